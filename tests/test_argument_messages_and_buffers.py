"""Argument errors name the argument; reduce_add refuses mixed and structured
dtypes; bytes-like objects read as uint8 vectors and array.array keeps its
type."""

import numpy as np
import pytest

import dpmini

D2 = ["cpu:0", "cpu:1"]


# --- messages name the argument; buffers read as memoryviews -------------

def test_reduce_add_refuses_mixed_and_structured_dtypes():
    with pytest.raises(TypeError, match=r"^arrays\[1\]: expected dtype int64 .*got float64"):
        dpmini.comm.reduce_add([np.arange(3), np.ones(3) / 2])
    with pytest.raises(TypeError, match=r"^arrays: arrays of dtype .* cannot be summed"):
        dpmini.comm.reduce_add([np.zeros(2, "i4,f8")] * 2)
    assert np.array_equal(dpmini.comm.reduce_add([np.arange(3)] * 2), [0, 2, 4])


def test_sum_paths_say_when_only_the_byte_order_differs():
    native, swapped = np.arange(3.0), np.arange(3.0).astype(">f8" if np.little_endian else "<f8")
    note = r"the same type in the other byte order.*newbyteorder"
    with pytest.raises(TypeError, match=r"^arrays\[1\]: expected dtype float64 .*" + note):
        dpmini.comm.reduce_add([native, swapped])
    with pytest.raises(TypeError, match=r"^out\[1\]: expected dtype float64, got .*" + note):
        dpmini.comm.scatter(np.ones(4), out=[np.zeros(2), np.zeros(2, swapped.dtype)])
    dp = dpmini.DataParallel(lambda a: a.astype(swapped.dtype) if a[0] > 0 else a, D2,
                             out_dims="sum")
    with pytest.raises(TypeError, match=r"replica 1's value at out has dtype .*" + note):
        dp(np.arange(4.0))
    # a real dtype difference gets no byte-order note; one byte order throughout sums
    with pytest.raises(TypeError) as e:
        dpmini.comm.reduce_add([native, swapped.astype(np.float32)])
    assert "byte order" not in str(e.value)
    assert np.array_equal(dpmini.comm.reduce_add([swapped, swapped]), [0.0, 2.0, 4.0])


def test_argument_errors_name_the_argument():
    with pytest.raises(ValueError, match=r"^chunk_sizes\[0\]: .* out of range"):
        dpmini.comm.scatter(np.ones(5), D2, chunk_sizes=[2**70, 3])
    with pytest.raises(TypeError, match=r"^out: expected a sequence of arrays"):
        dpmini.comm.scatter(np.ones(4), out=np.zeros(4))
    with pytest.raises(ValueError, match=r"^obj: "):
        dpmini.asarray([[1], [1, 2]], "cpu:1")


@pytest.mark.parametrize("make", [lambda: b"abcdef", lambda: bytearray(b"abcdef"),
                                  lambda: memoryview(b"abcdef")])
def test_bytes_like_objects_are_uint8_vectors(make):
    chunks = dpmini.comm.scatter(make(), D2)
    assert [c.tolist() for c in chunks] == [[97, 98, 99], [100, 101, 102]]
    assert chunks[0].dtype == np.uint8
    assert dpmini.asarray(make()).shape == (6,)


def test_array_array_keeps_its_type():
    import array
    a = array.array("d", [1.0, 2.0, 3.0, 4.0])
    chunks = dpmini.comm.scatter(a, D2)
    assert chunks[0].dtype == np.float64 and chunks[1].tolist() == [3.0, 4.0]
