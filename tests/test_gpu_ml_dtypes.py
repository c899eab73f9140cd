"""ml_dtypes' bfloat16 and float8 on GPU arrays (the emulated build or a real
GPU): dpmini.Array keeps the dtype through copies, exports it through DLPack
with its DLPack type code (kDLBfloat 16 bits, the float8 codes of DLPack 1.1),
a foreign GPU array of those codes is imported as the ml_dtypes dtype, and
sums accumulate in float32 and round once (docs/libraries.md, "Dtypes NumPy lacks")."""
import ctypes

import numpy as np
import pytest

import dpmini

from gpu_helpers import gpu, two_gpus

ml_dtypes = pytest.importorskip("ml_dtypes")
pytestmark = gpu

CODES = {"bfloat16": (4, 16), "float8_e4m3fn": (10, 8), "float8_e5m2": (12, 8),
         "float8_e4m3b11fnuz": (9, 8), "float8_e8m0fnu": (14, 8)}


class _DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class _DLTensor(ctypes.Structure):
    _fields_ = [("data", ctypes.c_void_p), ("device_type", ctypes.c_int),
                ("device_id", ctypes.c_int), ("ndim", ctypes.c_int), ("dtype", _DLDataType),
                ("shape", ctypes.c_void_p), ("strides", ctypes.c_void_p),
                ("byte_offset", ctypes.c_uint64)]


def capsule_dtype(cap):
    """(code, bits, lanes) of a legacy "dltensor" capsule, read without consuming it."""
    get = ctypes.pythonapi.PyCapsule_GetPointer
    get.restype, get.argtypes = ctypes.c_void_p, [ctypes.py_object, ctypes.c_char_p]
    t = _DLTensor.from_address(get(cap, b"dltensor"))
    return t.dtype.code, t.dtype.bits, t.dtype.lanes


def sample(name, n=12):
    dt = np.dtype(getattr(ml_dtypes, name))
    return (np.arange(n * dt.itemsize) * 37 % 256).astype(np.uint8).view(dt)


class GpuArray:
    """A foreign GPU array speaking DLPack only, delegating to a dpmini.Array."""

    def __init__(self, arr):
        self.arr = arr

    def __dlpack__(self, **kw):
        return self.arr.__dlpack__(**kw)

    def __dlpack_device__(self):
        return self.arr.__dlpack_device__()


@pytest.mark.parametrize("name", sorted(CODES))
def test_gpu_arrays_keep_the_dtype_and_export_its_dlpack_code(name):
    x = sample(name)
    a = dpmini.asarray(x, "cuda:0")
    assert a.dtype == x.dtype
    assert np.array_equal(a.numpy().view(np.uint8), x.view(np.uint8))
    assert capsule_dtype(a.__dlpack__()) == CODES[name] + (1,)
    host_cap = a.__dlpack__(dl_device=(1, 0), copy=True)   # a host copy, exported by dpmini
    assert capsule_dtype(host_cap) == CODES[name] + (1,)
    back = dpmini.asarray(GpuArray(a))          # dpmini's CUDA DLPack import
    assert back.dtype == x.dtype
    assert np.array_equal(back.numpy().view(np.uint8), x.view(np.uint8))


@two_gpus
def test_gpu_scatter_gather_of_bfloat16_keeps_every_bit():
    x = sample("bfloat16", 16).reshape(8, 2)
    parts = dpmini.scatter(x, [0, 1])
    assert [p.dtype for p in parts] == [x.dtype] * 2
    back = dpmini.gather(list(parts), "cpu")
    assert back.dtype == x.dtype and np.array_equal(back.view(np.uint8), x.view(np.uint8))


@two_gpus
def test_gpu_bfloat16_sum_accumulates_in_float32():
    bf16 = ml_dtypes.bfloat16
    a = np.array([1.0, 3.0], dtype=bf16)
    b = np.array([2.0 ** -8, 1.0], dtype=bf16)
    c = np.array([2.0 ** -8, -0.5], dtype=bf16)
    want = (a.astype(np.float32) + b.astype(np.float32) + c.astype(np.float32)).astype(bf16)
    parts = [dpmini.asarray(a, "cuda:0"), dpmini.asarray(b, "cuda:1"),
             dpmini.asarray(c, "cuda:0")]
    got = dpmini.comm.reduce_add(parts, "cuda:0")
    assert isinstance(got, dpmini.Array) and got.device == dpmini.Device("cuda:0")
    assert got.dtype == np.dtype(bf16)
    assert np.array_equal(got.numpy().view(np.uint8), want.view(np.uint8))
    assert float(got.numpy()[0]) == 1.0078125
