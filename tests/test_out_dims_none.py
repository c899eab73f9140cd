"""out_dims None (the output must be the same on every replica): NaN counts as
equal to NaN, for Python values, NumPy scalars and arrays of every dtype; a
real difference is a TypeError naming the place."""
import copy

import numpy as np
import pytest

import dpmini

D2 = ["cpu:0", "cpu:1"]


# --- NaN outputs count as one value ---------------------------------------

def test_nan_outputs_are_equal_values():
    import math
    out = dpmini.DataParallel(lambda x: float("nan"), D2)(np.ones(4))
    assert math.isnan(out)
    out = dpmini.DataParallel(lambda x: complex(float("nan"), 1.0), D2)(np.ones(4))
    assert math.isnan(out.real) and out.imag == 1.0
    with pytest.raises(TypeError, match="different values"):
        dpmini.DataParallel(lambda x: complex(float("nan"), float(x[0])), D2)(np.arange(4.0))
    with pytest.raises(TypeError, match="different values"):
        dpmini.DataParallel(lambda x: float("nan") if x[0] == 0 else 1.0, D2)(np.arange(4.0))


# --- out_dims None treats NaN as equal to NaN -----------------------------

def test_out_dims_none_nan_values():
    nan = float("nan")
    out = dpmini.gather([(1, nan), (1, float("nan"))], "cpu", out_dims=(None, None))
    assert out[0] == 1 and np.isnan(out[1])
    out = dpmini.gather([[complex(nan, 1)], [complex(nan, 1)]], "cpu", out_dims=[None])
    assert np.isnan(out[0].real)
    with pytest.raises(TypeError, match="different values"):
        dpmini.gather([(1, nan), (1, 2.0)], "cpu", out_dims=(None, None))


@pytest.mark.parametrize("dtype", ["float32", "float64", "complex128"])
def test_out_dims_none_nan_arrays(dtype):
    a = np.array([1.0, np.nan, 3.0], dtype=dtype)
    out = dpmini.gather([(a,), (a.copy(),)], "cpu", out_dims=(None,))
    np.testing.assert_array_equal(out[0], a)
    s = np.float64("nan")                  # NumPy scalars too
    assert np.isnan(dpmini.gather([[s], [np.float64("nan")]], "cpu", out_dims=[None])[0])
    with pytest.raises(TypeError, match="differs from replica 0's"):
        dpmini.gather([[a], [np.array([1.0, np.nan, 4.0], dtype=dtype)]], "cpu",
                      out_dims=[None])


def test_out_dims_none_other_dtypes():
    # (a top-level out_dims=None is the default: wrap the output to compare)
    ints = np.arange(3)
    assert dpmini.gather([(ints,), (ints.copy(),)], "cpu", out_dims=(None,))[0] is ints
    strs = np.array(["a", "b"])
    np.testing.assert_array_equal(
        dpmini.gather([(strs,), (strs.copy(),)], "cpu", out_dims=(None,))[0], strs)
    with pytest.raises(TypeError, match="differs"):               # shape differs
        dpmini.gather([(ints,), (ints[:2],)], "cpu", out_dims=(None,))
    dp = dpmini.DataParallel(lambda x: (x, np.array([np.nan, 1.0])), D2, out_dims=(0, None))
    y, same = dp(np.ones(4))
    assert np.isnan(same[0]) and same[1] == 1.0
