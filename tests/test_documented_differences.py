"""Rows of docs/differences.md hold: each documented dpmini behaviour is
checked here (the PyTorch side is the rule docs/spec.md states, and is not
run)."""
import numpy as np
import pytest

import dpmini
from dpmini import comm

D = ["cpu:0", "cpu:1"]
X = np.arange(12.0).reshape(4, 3)


def test_complex_negative_dim_wraps_against_the_complex_rank():
    z = (np.arange(24) + 1j * np.arange(24)).reshape(4, 6)
    for dim, axis in ((-1, 1), (-2, 0)):
        parts = dpmini.scatter(z, D, dim=dim)
        assert all(p.dtype == z.dtype for p in parts)
        np.testing.assert_array_equal(np.concatenate(parts, axis=axis), z)
        assert parts[0].shape == ((4, 3) if axis == 1 else (2, 6))
        np.testing.assert_array_equal(dpmini.gather(list(parts), "cpu", dim=dim), z)


def test_float64_into_float16_rounds_once():
    x = np.array([1 + 2**-11 + 2**-30])           # just above the float16 midpoint
    twice = np.float16(np.float32(x[0]))           # PyTorch's path: through float32
    assert twice == 1.0
    g = dpmini.gather([np.array([0.5], np.float16), x], "cpu")
    assert g.dtype == np.float16
    assert g[1] == np.float16(x[0]) == 1.0009765625 != twice


def test_scatter_to_no_devices_raises():
    for inputs in ("x", X, (X, 1), None):
        with pytest.raises(ValueError, match=r"^target_devices: expected at least one device"):
            dpmini.scatter(inputs, [])


def test_output_device_host_is_allowed():
    dp = dpmini.DataParallel(lambda a: a * 2, D, output_device="cpu")
    out = dp(X)
    np.testing.assert_array_equal(out, X * 2)
    assert dpmini.device_of(out) == "cpu"


EXCEPTION_ROWS = [
    (lambda: dpmini.scatter(np.ones(()), D), dpmini.ZeroDimError),   # ValueError, RuntimeError
    (lambda: dpmini.DataParallel(abs, device_ids=[]), ValueError),
    (lambda: comm.scatter(X, []), ValueError),
    (lambda: comm.broadcast(X), ValueError),
    (lambda: comm.scatter(X, D, chunk_sizes=[-1, 5]), ValueError),
    (lambda: comm.scatter(X, D, chunk_sizes=[1, 1]), ValueError),
    (lambda: comm.scatter(X, D, chunk_sizes=[4]), ValueError),
    (lambda: comm.gather([]), ValueError),
    (lambda: comm.gather([X, X[0]]), ValueError),
    (lambda: comm.gather([X, X[:, :2]]), ValueError),
    (lambda: comm.gather([X, X], destination="cpu", out=np.zeros((8, 3))), ValueError),
    (lambda: comm.gather([X, X], out=np.zeros((7, 3))), ValueError),
    (lambda: comm.broadcast(X, D, out=[np.zeros_like(X)]), ValueError),
    (lambda: comm.scatter(X, D, out=[np.zeros((2, 3)), np.zeros((2, 3))]), ValueError),
    (lambda: comm.scatter(X, out=[np.zeros((1, 3)), np.zeros((2, 3))]), ValueError),
    (lambda: comm.scatter(X, [-1, 0]), ValueError),
    (lambda: comm.broadcast(X, [-1]), ValueError),
    (lambda: dpmini.gather([{"a": X}, {"b": X}], "cpu"), ValueError),
    (lambda: dpmini.parallel_apply([abs, abs], [(X,)]), ValueError),
    (lambda: dpmini.scatter(X, D, dim=5), IndexError),
]


@pytest.mark.parametrize("call,exc", EXCEPTION_ROWS, ids=[str(i) for i in range(len(EXCEPTION_ROWS))])
def test_exception_classes_as_documented(call, exc):
    with pytest.raises(BaseException) as info:
        call()
    assert type(info.value) is exc, f"{type(info.value).__name__}: {info.value}"


def test_reduce_add_of_host_arrays_is_allowed():
    np.testing.assert_array_equal(comm.reduce_add([X, X], destination="cpu"), 2 * X)
