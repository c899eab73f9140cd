"""Gather never loses data by casting to replica 0's dtype (docs/spec.md 11.7).

Arrays at one output position are gathered in replica 0's dtype (as
PyTorch's comm.gather does); a replica whose dtype cannot be cast to it
within a kind (NumPy's same_kind rule; safe casting for str, bytes and
structured dtypes) raises TypeError naming the path and every dtype: real
with complex in either order, float into int, int into bool, datetimes with
numbers, longer strings into shorter ones. Real with complex is refused in
either order (PyTorch's comm functions see complex arrays as real views with
an extra dim and fail on it), so no order drops the imaginary part.
"""
import re

import numpy as np
import pytest

import dpmini


def _gather(a, b, **kw):
    return dpmini.gather([{"out": (a,)}, {"out": (b,)}], "cpu", **kw)


@pytest.mark.parametrize("a,b", [
    (np.zeros(2, np.float32), np.ones(2, np.complex64)),
    (np.zeros(2, np.complex128), np.ones(2, np.float64)),
])
def test_real_and_complex_raise_naming_path_and_dtypes(a, b):
    with pytest.raises(TypeError) as info:
        _gather(a, b)
    msg = str(info.value)
    assert msg.startswith("out['out'][0]: replica 1 returned ")
    assert f"dtypes per replica: {a.dtype}, {b.dtype}" in msg


def test_complex_into_complex_of_another_width_keeps_imaginary_parts():
    g = _gather(np.array([1j], np.complex64), np.array([2 + 3j], np.complex128))
    assert g["out"][0].dtype == np.complex64
    np.testing.assert_array_equal(g["out"][0], [1j, 2 + 3j])


def test_complex_then_real_raises_too():
    with pytest.raises(TypeError, match="real and complex arrays are not gathered together"):
        _gather(np.array([1j]), np.array([2.0], np.float32))


@pytest.mark.parametrize("a,b", [
    (np.zeros(2, np.int64), np.full(2, 0.5)),          # float -> int
    (np.zeros(2, np.bool_), np.arange(2)),              # int -> bool
    (np.zeros(2, "M8[s]"), np.arange(2)),               # int -> datetime
    (np.zeros(2, np.float64), np.zeros(2, "m8[s]")),    # timedelta -> float
    (np.array(["ab"]), np.array(["abcdef"])),           # str truncated
    (np.array([b"a"]), np.array([b"abc"])),             # bytes truncated
])
def test_kind_changes_that_lose_data_raise(a, b):
    with pytest.raises(TypeError, match=re.escape(f"dtypes per replica: {a.dtype}, {b.dtype}")):
        _gather(a, b)


@pytest.mark.parametrize("a,b", [
    (np.zeros(1, np.float32), np.ones(1, np.float64)),  # same kind, narrower
    (np.zeros(1, np.float32), np.ones(1, np.int64)),    # int -> float
    (np.zeros(1, np.int8), np.ones(1, np.bool_)),       # bool -> int
    (np.zeros(1, np.int16), np.ones(1, np.int64)),      # same kind
    (np.array(["abcdef"]), np.array(["ab"])),           # str widened
])
def test_casts_within_a_kind_follow_replica_0(a, b):
    g = _gather(a, b)["out"][0]
    assert g.dtype == a.dtype
    np.testing.assert_array_equal(g, np.concatenate([a, b.astype(a.dtype)]))


def test_out_dims_sum_refuses_complex_into_real():
    with pytest.raises(TypeError, match=r"complex128"):
        dpmini.gather([np.zeros(2), np.ones(2, np.complex128)], "cpu", out_dims="sum")


def test_out_dims_sum_refuses_complex_into_real_nested():
    with pytest.raises(TypeError) as info:
        dpmini.gather([(np.zeros(2),), (np.ones(2, np.complex128),)], "cpu", out_dims=("sum",))
    assert str(info.value).startswith("out[0]: replica 1 returned complex128")


def test_dataparallel_real_and_complex_outputs():
    def module(x):
        return x if x[0] == 0 else x.astype(np.complex64) * 1j

    dp = dpmini.DataParallel(module, ["cpu:0", "cpu:1"])
    with pytest.raises(TypeError, match="float64, complex64"):
        dp(np.arange(4.0))


def test_scalars_of_real_and_complex_raise():
    with pytest.raises(TypeError, match="float64, complex128"):
        dpmini.gather([np.float64(1.0), np.complex128(1j)], "cpu")


@pytest.mark.parametrize("a", [np.array(["NaT"], "M8[s]"), np.array(["NaT"], "m8[ms]"),
                               np.datetime64("NaT", "s"), np.timedelta64("NaT")])
def test_nat_equals_nat_under_out_dims_none(a):
    # as NaN equals NaN
    g = dpmini.gather([(a,), (a.copy(),)], "cpu", out_dims=(None,))
    assert np.isnat(g[0]).all()
    b = np.array(["2020-01-01"], "M8[s]") if a.dtype.kind == "M" else np.array([1], "m8[ms]")
    with pytest.raises(TypeError, match="differs"):
        dpmini.gather([(a,), (b,)], "cpu", out_dims=(None,))


def test_nan_equals_nan_under_out_dims_none():
    g = dpmini.gather([(np.array([np.nan]),), (np.array([np.nan]),)], "cpu", out_dims=(None,))
    assert np.isnan(g[0]).all()


@pytest.mark.parametrize("out_dims", [{"a": None}, "sum", None])
def test_object_dtype_outputs_are_refused_naming_the_output_path(out_dims):
    o = np.array(["a"], dtype=object)
    with pytest.raises(TypeError) as info:
        dpmini.gather([{"a": o}, {"a": o}], "cpu", out_dims=out_dims)
    msg = str(info.value)
    assert msg.startswith("out['a']: ") and "tensors" not in msg and "['a'][0]" not in msg
