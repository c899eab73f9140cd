"""Which stream dpmini.distributed hands NCCL for a GPU array of PyTorch or
CuPy: the library's current stream on the array's own device (NCCL launches
there, so work queued by the caller on that stream orders before the
collective). Checked with stand-in modules: CPU-only torch has no CUDA
streams and CuPy is not installed here."""
import sys
import types

import pytest

dist = pytest.importorskip("dpmini.distributed", exc_type=ImportError)


class _Stream:
    def __init__(self, ptr):
        self.ptr = ptr
        self.cuda_stream = ptr


def _fake_array_type(module, device):
    """A GPU array type of `module` on cuda:device (DLPack kind 2)."""
    cls = type("ndarray", (), {
        "__module__": module,
        "__dlpack_device__": lambda self: (2, device),
        "__cuda_array_interface__": property(lambda self: {"version": 3}),
    })
    return cls()


def test_cupy_stream_is_the_current_stream_of_the_arrays_device(monkeypatch):
    asked = []

    def get_current_stream(device_id=None):
        asked.append(device_id)
        # CuPy keeps one current stream per device: 100 + device here
        return _Stream(100 + (0 if device_id is None else device_id))

    cupy = types.ModuleType("cupy")
    cupy.cuda = types.SimpleNamespace(get_current_stream=get_current_stream)
    monkeypatch.setitem(sys.modules, "cupy", cupy)
    x = _fake_array_type("cupy._core.core", 3)
    assert dist._gpu_args(x) == (3, "cupy", 103)
    assert asked == [3]


def test_torch_stream_is_the_current_stream_of_the_tensors_device(monkeypatch):
    asked = []

    def current_stream(device=None):
        asked.append(device)
        return _Stream(200 + (0 if device is None else device))

    torch = types.ModuleType("torch")
    torch.cuda = types.SimpleNamespace(current_stream=current_stream)
    monkeypatch.setitem(sys.modules, "torch", torch)
    x = _fake_array_type("torch", 2)
    assert dist._gpu_args(x) == (2, "torch", 202)
    assert asked == [2]
