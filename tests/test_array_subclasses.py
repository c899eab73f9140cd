"""ndarray subclasses and object-dtype arrays: masked arrays and np.matrix are
refused with their path, other subclasses become plain arrays (and are summed
with NumPy's own add, whatever their __array_ufunc__ does), object arrays
held by a module are shared and object-array inputs are a TypeError naming the
path."""

import numpy as np
import pytest

import dpmini

D2 = ["cpu:0", "cpu:1"]


# --- ndarray subclasses and object-dtype arrays ---------------------

def test_masked_array_is_refused_with_its_path():
    ma = np.ma.masked_array([1.0, 2.0, 1e9, 4.0], mask=[0, 0, 1, 0])
    dp = dpmini.DataParallel(lambda x: x, D2)
    with pytest.raises(TypeError, match=r"^args\[0\]: numpy\.ma\.MaskedArray .*\.filled"):
        dp(ma)
    with pytest.raises(TypeError, match=r"^kwargs\['m'\]: numpy\.ma\.MaskedArray"):
        dp(np.ones(4), m=ma)
    with pytest.raises(TypeError, match=r"^array: numpy\.ma\.MaskedArray"):
        dpmini.comm.scatter(ma, D2)
    with pytest.raises(TypeError, match=r"^out: numpy\.ma\.MaskedArray"):
        dpmini.DataParallel(lambda x: np.ma.masked_array(x), D2)(np.ones(4))
    assert np.array_equal(dp(ma.filled(0.0)), [1, 2, 0, 4])


def test_matrix_is_refused_other_subclasses_become_plain_arrays(tmp_path):
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", PendingDeprecationWarning)
        m = np.matrix([[1.0, 2], [3, 4]])
    with pytest.raises(TypeError, match=r"^inputs: numpy\.matrix .*np\.asarray"):
        dpmini.scatter(m, D2)
    with pytest.raises(TypeError, match=r"^obj: numpy\.matrix"):
        dpmini.asarray(m, "cpu:1")
    rec = np.rec.array([(1, 2.0), (3, 4.0)], dtype=[("a", "i4"), ("b", "f8")])
    chunks = dpmini.scatter(rec, D2)
    assert [type(c) for c in chunks] == [np.ndarray, np.ndarray]
    assert np.array_equal(dpmini.DataParallel(lambda r: r["a"], D2)(rec), [1, 3])
    mm = np.memmap(tmp_path / "mm.dat", dtype="f8", mode="w+", shape=(4, 3))
    mm[:] = 7.0
    out = dpmini.DataParallel(lambda x: x + 1, D2)(mm)
    assert type(out) is np.ndarray and np.array_equal(out, np.full((4, 3), 8.0))

    class Mine(np.ndarray):
        pass
    x = np.arange(6.0).reshape(3, 2).view(Mine)
    assert all(type(c) is np.ndarray for c in dpmini.comm.scatter(x, D2))
    assert type(dpmini.comm.gather([x, x])) is np.ndarray


class _ReturnsNew(np.ndarray):
    """Computes NumPy's result but ignores out= (returns a new array)."""

    def __array_ufunc__(self, ufunc, method, *inputs, **kwargs):
        kwargs.pop("out", None)
        return getattr(ufunc, method)(*[np.asarray(i) for i in inputs], **kwargs)


class _ReturnsNumber(np.ndarray):
    """An override that returns something that is not an array."""

    def __array_ufunc__(self, ufunc, method, *inputs, **kwargs):
        return 42


@pytest.mark.parametrize("sub", [_ReturnsNew, _ReturnsNumber])
def test_sums_of_subclasses_use_numpys_add_not_the_subclass_override(sub):
    a, b = np.ones((4, 3)).view(sub), np.full((4, 3), 2.0).view(sub)
    for dest in ("cpu", "cpu:1"):
        got = dpmini.comm.reduce_add([a, b], dest)
        assert type(got) is np.ndarray and np.array_equal(got, np.full((4, 3), 3.0))
    (got,) = dpmini.comm.reduce_add_coalesced([[a], [b]], "cpu")
    assert np.array_equal(got, np.full((4, 3), 3.0))
    dp = dpmini.DataParallel(lambda x: np.full((2, 3), 1.0).view(sub), D2, out_dims="sum")
    assert np.array_equal(dp(np.zeros((4, 1))), np.full((2, 3), 2.0))


@pytest.mark.parametrize("sub", [_ReturnsNew, _ReturnsNumber])
def test_widened_sums_of_subclasses_use_numpys_add(sub):
    ml_dtypes = pytest.importorskip("ml_dtypes")
    a = np.ones((4, 3), dtype=ml_dtypes.bfloat16).view(sub)
    got = dpmini.comm.reduce_add([a, a, a], "cpu")
    assert got.dtype == ml_dtypes.bfloat16 and np.array_equal(got.astype(np.float32),
                                                              np.full((4, 3), 3.0))
    dp = dpmini.DataParallel(lambda x: np.ones((2, 3), dtype=ml_dtypes.bfloat16).view(sub), D2,
                             out_dims="sum")
    assert np.array_equal(dp(np.zeros((4, 1))).astype(np.float32), np.full((2, 3), 2.0))


def test_object_array_held_by_a_module_is_shared():
    class Clf:
        def __init__(s):
            s.w = np.ones((3, 2))
            s.w[:, 1] = 2
            s.labels = np.array(["cat", "dog"], dtype=object)
        def __call__(s, x):
            assert str(dpmini.device_of(s.w)) == str(dpmini.device_of(x))
            return s.labels[(x @ s.w).argmax(1)].astype(str)
    clf = Clf()
    reps = dpmini.replicate(clf, D2)
    assert reps[1].labels is clf.labels and reps[1].w is not clf.w
    out = dpmini.DataParallel(clf, D2)(np.ones((4, 3)))
    assert out.tolist() == ["dog"] * 4


def test_object_array_input_is_still_a_type_error_naming_the_path():
    objs = np.array([object(), object()], dtype=object)
    with pytest.raises(TypeError, match=r"^kwargs\['x'\]: arrays holding Python objects"):
        dpmini.DataParallel(lambda x: x, D2)(x=objs)
