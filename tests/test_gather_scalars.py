"""Scalar and value outputs at one position (docs/spec.md 11.6, 11.8).

- NumPy scalars or 0-dim ndarrays mixed with Python numbers (np.float64(1.0)
  or np.array(1.0) from one replica, 1.0 from another) are all gathered as
  0-dim arrays: the NumPy scalar rule,
  a vector of one value per replica, whichever replica returns which.
- Other objects: the same object from every replica, or equal values of one
  type hashed by value (Fraction, Decimal, date, frozenset) -> that value.
"""
import datetime
import decimal
import fractions
import re

import numpy as np
import pytest

import dpmini

SCALAR_WARNING = "all input tensors were scalars"


@pytest.mark.parametrize("outs", [
    [np.float64(1.0), 1.0],
    [1.0, np.float64(1.0)],
    [np.float32(1.5), 2],
    [3, np.int64(4)],
    [np.array(1.0), 2.0],
    [2.0, np.array(1.5, dtype=np.float32)],
])
def test_numpy_scalars_mixed_with_python_numbers_are_scalars(outs):
    with pytest.warns(UserWarning, match=SCALAR_WARNING):
        g = dpmini.gather([(np.zeros(1), v) for v in outs], "cpu")
    assert isinstance(g[1], np.ndarray) and g[1].shape == (2,)
    np.testing.assert_array_equal(g[1], [float(v) for v in outs])


def test_python_numbers_alone_keep_the_value_rule():
    assert dpmini.gather([1.0, 1.0], "cpu") == 1.0
    with pytest.raises(TypeError, match="different values"):
        dpmini.gather([1.0, 2.0], "cpu")


def test_numpy_scalar_and_str_still_refused():
    with pytest.raises(TypeError, match="types per replica: float64, str"):
        dpmini.gather([np.float64(1.0), "1.0"], "cpu")


def test_numpy_scalar_and_python_number_under_out_dims_none():
    g = dpmini.gather([(np.float64(1.0),), (1.0,)], "cpu", out_dims=(None,))
    assert g[0] == 1.0
    with pytest.raises(TypeError, match="differs"):
        dpmini.gather([(np.float64(1.0),), (2.0,)], "cpu", out_dims=(None,))


def test_numpy_scalar_and_python_number_summed():
    g = dpmini.gather([(np.float64(1.0),), (2.0,)], "cpu", out_dims=("sum",))
    assert float(g[0]) == 3.0
    g = dpmini.gather([(2.0,), (np.array(1.0),)], "cpu", out_dims=("sum",))
    assert float(g[0]) == 3.0


def test_zero_dim_array_loss_with_a_number_from_an_empty_shard():
    dp = dpmini.DataParallel(lambda a: np.asarray(a.sum()) if len(a) > 1 else 0.0,
                             ["cpu:0", "cpu:1"])
    with pytest.warns(UserWarning, match=SCALAR_WARNING):
        out = dp(np.ones((3, 2)))
    np.testing.assert_array_equal(out, [4.0, 0.0])


@pytest.mark.parametrize("make", [
    lambda: fractions.Fraction(1, 3),
    lambda: decimal.Decimal("1.25"),
    lambda: datetime.date(2024, 2, 29),
    lambda: datetime.timedelta(seconds=5),
    lambda: frozenset({1, 2}),
])
def test_equal_hashable_values_gather_to_the_value(make):
    a, b = make(), make()
    g = dpmini.gather([(np.zeros(1), a), (np.zeros(1), b)], "cpu")
    assert g[1] == a and type(g[1]) is type(a)


def test_different_hashable_values_raise():
    with pytest.raises(TypeError, match=re.escape("out: the replicas returned different Fraction")):
        dpmini.gather([fractions.Fraction(1, 3), fractions.Fraction(1, 2)], "cpu")


def test_equal_values_of_different_types_raise():
    with pytest.raises(TypeError):
        dpmini.gather([fractions.Fraction(1), decimal.Decimal(1)], "cpu")


def test_equal_unhashable_objects_must_be_the_same_object():
    with pytest.raises(TypeError, match="different set objects"):
        dpmini.gather([{1}, {1}], "cpu")
    s = {1}
    assert dpmini.gather([s, s], "cpu") is s


def test_dataparallel_returning_equal_dates():
    dp = dpmini.DataParallel(lambda x: (x, datetime.date(2020, 1, 1)), ["cpu:0", "cpu:1"])
    out = dp(np.arange(4.0))
    assert out[1] == datetime.date(2020, 1, 1)


# ---- errors at one position: the user's exception, the replica named apart --

class _HashRaises:
    def __eq__(self, other):
        return True

    def __hash__(self):
        raise RuntimeError("hash raised")


def test_a_raising_hash_propagates_named_with_the_path():
    with pytest.raises(RuntimeError, match=r"^out\[1\]: hash raised"):
        dpmini.gather([(np.ones(1), _HashRaises()), (np.ones(1), _HashRaises())], "cpu")


class _EqRaises(float):
    def __eq__(self, other):
        raise ValueError("eq raised")

    __hash__ = float.__hash__


@pytest.mark.parametrize("out_dims", [0, None])
def test_a_raising_eq_propagates_named_with_the_path(out_dims):
    with pytest.raises(ValueError, match=r"^out\[1\]: eq raised"):
        dpmini.gather([(np.ones(1), _EqRaises(1.0)), (np.ones(1), _EqRaises(1.0))], "cpu",
                      out_dims=out_dims)


def test_values_of_different_types_name_the_types_not_a_kind():
    with pytest.raises(TypeError) as info:
        dpmini.gather([(np.ones(1), fractions.Fraction(1, 2)), (np.ones(1), 0.5)], "cpu")
    msg = str(info.value)
    assert msg.startswith("out[1]: the replicas returned values of different types here")
    assert "Fraction, float" in msg and "not an array or container" not in msg


def test_sum_of_mixed_dtypes_names_the_replica_apart_from_the_path():
    outs = [(np.ones(1, "f4"), np.float32(1.0)), (np.ones(1, "f4"), 2.0)]
    with pytest.raises(TypeError) as info:
        dpmini.gather(outs, "cpu", out_dims="sum")
    msg = str(info.value)
    assert msg.startswith("out[1]: ") and "replica 1's value at out[1]" in msg
    assert "float64" in msg and "float32" in msg and "out[1][1]" not in msg
