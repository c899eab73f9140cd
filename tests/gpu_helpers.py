"""Shared bits of the GPU tests (tests/test_gpu_*.py).

They run on a real GPU, and in CI on the CPU emulation of the CUDA layer
(`make test-emulated`: DPMINI_CUDA_EMULATE=1 build, DPMINI_EMULATE_GPUS=2).
Without a device they skip, with the reason.
"""
import numpy as np
import pytest

import dpmini
from dpmini import _testing

NGPU = dpmini.device_count()
BACKEND = dpmini._dpmini.cuda_backend
EMULATED = BACKEND == "emulated"

gpu = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        NGPU == 0,
        reason=f"no CUDA device (dpmini.device_count() == 0, backend {BACKEND!r}); "
        "`make test-emulated` runs these tests on the CPU emulation of the CUDA layer",
    ),
]

two_gpus = pytest.mark.skipif(NGPU < 2, reason="needs 2 CUDA devices")
real_gpu = pytest.mark.skipif(BACKEND != "cuda", reason="needs a real GPU (not the emulator)")

DTYPES = ["bool", "int8", "uint8", "int16", "uint16", "int32", "uint32", "int64", "uint64",
          "float16", "float32", "float64", "complex64", "complex128"]

# Device lists: several replicas on one GPU, and distinct GPUs where present.
DEVICE_LISTS = [[0, 0], [0, 0, 0]] + ([[0, 1], [1, 0, 1]] if NGPU >= 2 else [])


def sample(shape, dtype, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.integers(0, 100, size=shape)
    if np.dtype(dtype).kind == "c":
        return (x + 1j * rng.integers(0, 100, size=shape)).astype(dtype)
    if np.dtype(dtype) == np.bool_:
        return x % 2 == 0
    return x.astype(dtype)


def chunk_sizes(n, k):
    """torch.chunk's sizes (the oracle)."""
    if n == 0:
        return [0] * k
    split = -(-n // k)
    count = -(-n // split)
    return [split] * (count - 1) + [n - split * (count - 1)]


def host(a):
    """A host copy of a dpmini.Array (or the ndarray itself)."""
    return a.numpy() if isinstance(a, dpmini.Array) else np.asarray(a)


def need_torch_cuda():
    """torch with a working CUDA device, else skip (torch may be installed
    without CUDA, or see no GPU)."""
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("torch is installed but torch.cuda.is_available() is False")
    return torch


def need_cupy():
    """CuPy that can reach a GPU, else skip."""
    cp = pytest.importorskip("cupy")
    try:
        if cp.cuda.runtime.getDeviceCount() < 1:
            pytest.skip("CuPy sees no GPU")
    except Exception as e:  # CUDA driver/runtime mismatch, no driver...
        pytest.skip(f"CuPy cannot use the GPU: {e}")
    return cp


def cuda_debug():
    """dpmini's private counters (current device, syncs, NCCL)."""
    return _testing.cuda_debug()
