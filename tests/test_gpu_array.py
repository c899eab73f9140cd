"""dpmini.Array: attributes, host copies, the CUDA Array Interface, DLPack
(producer and consumer), pinned memory, errors."""
import ctypes
import gc
import sys

import numpy as np
import pytest

import dpmini
from dpmini import _testing
from gpu_helpers import (DTYPES, EMULATED, cuda_debug, gpu, host, need_cupy, need_torch_cuda,
                         real_gpu, sample, two_gpus)

pytestmark = gpu

_get_name = ctypes.pythonapi.PyCapsule_GetName
_get_name.restype = ctypes.c_char_p
_get_name.argtypes = [ctypes.py_object]


def capsule_name(cap):
    return _get_name(cap).decode()


@pytest.mark.parametrize("dtype", DTYPES)
def test_round_trip_all_dtypes(dtype):
    x = sample((5, 7), dtype)
    a = dpmini.asarray(x, device="cuda:0")
    assert isinstance(a, dpmini.Array)
    assert a.shape == (5, 7) and a.dtype == x.dtype and a.ndim == 2 and a.size == 35
    assert a.nbytes == x.nbytes and a.strides == x.strides
    assert a.device == dpmini.Device("cuda:0") and str(dpmini.device_of(a)) == "cuda:0"
    y = a.numpy()
    assert type(y) is np.ndarray and y.dtype == x.dtype
    np.testing.assert_array_equal(y, x)


@pytest.mark.parametrize("view", ["T", "step", "neg", "col", "empty"])
def test_non_contiguous_to_device(view):
    x = sample((6, 8), "float32")
    v = {"T": x.T, "step": x[::2, 1::3], "neg": x[::-1, ::-2], "col": x[:, 3],
         "empty": x[:0]}[view]
    a = dpmini.asarray(v, 0)
    np.testing.assert_array_equal(a.numpy(), v)


def test_numpy_refuses_device_memory():
    a = dpmini.asarray(np.ones(3), 0)
    with pytest.raises(TypeError, match=r"\.numpy\(\)"):
        np.asarray(a)
    with pytest.raises(TypeError, match=r"\.numpy\(\)"):
        np.add(a, 1)
    assert "cuda:0" in repr(a) and "float64" in repr(a)


def test_cuda_array_interface_v3():
    x = sample((4, 6), "int32")
    a = dpmini.asarray(x, 0)
    cai = a.__cuda_array_interface__
    assert cai["version"] == 3 and cai["shape"] == (4, 6) and cai["typestr"] == "<i4"
    assert cai["strides"] is None and cai["stream"] is None
    assert cai["data"] == (a.data_ptr, False)
    # a strided view (the chunk that stays on its own device, docs/spec.md 3.4)
    c0, c1 = dpmini.comm.scatter(a, [0, 0], dim=1)
    assert c0.__cuda_array_interface__["strides"] == (24, 4)
    assert c0.data_ptr == a.data_ptr  # a view, no copy
    np.testing.assert_array_equal(c0.numpy(), x[:, :3])
    np.testing.assert_array_equal(c1.numpy(), x[:, 3:])


class CAIProducer:
    """A foreign GPU array: exposes only __cuda_array_interface__."""

    def __init__(self, arr, stream=None):
        self.arr = arr
        self.stream = stream

    @property
    def __cuda_array_interface__(self):
        d = dict(self.arr.__cuda_array_interface__)
        d["stream"] = self.stream
        return d


def test_cai_import_is_zero_copy_and_keeps_producer_alive():
    x = sample((3, 4), "float64")
    a = dpmini.asarray(x, 0)
    p = CAIProducer(a, stream=1)  # 1: the legacy default stream
    before = sys.getrefcount(p)
    b = dpmini.asarray(p)
    assert isinstance(b, dpmini.Array) and b.data_ptr == a.data_ptr
    assert sys.getrefcount(p) == before + 1
    del b
    gc.collect()
    assert sys.getrefcount(p) == before
    assert dpmini.device_of(p) == "cuda:0"
    with pytest.raises(ValueError, match="stream 0"):
        dpmini.asarray(CAIProducer(a, stream=0))


class DLPackProducer:
    """A foreign GPU array: exposes only DLPack (delegating to a dpmini.Array)."""

    def __init__(self, arr, legacy=False):
        self.arr = arr
        self.legacy = legacy
        self.kwargs = None

    def __dlpack__(self, stream=None, max_version=None, **kw):
        self.kwargs = dict(stream=stream, max_version=max_version)
        if self.legacy:
            return self.arr.__dlpack__(stream=stream)
        return self.arr.__dlpack__(stream=stream, max_version=max_version)

    def __dlpack_device__(self):
        return self.arr.__dlpack_device__()


@pytest.mark.parametrize("legacy", [False, True])
def test_dlpack_import_zero_copy(legacy):
    x = sample((4, 5), "int16")
    a = dpmini.asarray(x, 0)
    p = DLPackProducer(a, legacy)
    b = dpmini.from_dlpack(p)
    assert isinstance(b, dpmini.Array) and b.data_ptr == a.data_ptr
    assert p.kwargs["max_version"] == (1, 0) and isinstance(p.kwargs["stream"], int)
    np.testing.assert_array_equal(b.numpy(), x)
    before = sys.getrefcount(a)
    del b
    gc.collect()
    assert sys.getrefcount(a) == before - 1  # the capsule's reference was released


def test_dlpack_export_capsules():
    a = dpmini.asarray(np.arange(6.0).reshape(2, 3), 0)
    assert a.__dlpack_device__() == (2, 0)
    assert capsule_name(a.__dlpack__()) == "dltensor"
    assert capsule_name(a.__dlpack__(max_version=(0, 8))) == "dltensor"
    assert capsule_name(a.__dlpack__(max_version=(1, 0))) == "dltensor_versioned"
    base = sys.getrefcount(a)
    caps = [a.__dlpack__(max_version=(1, 0)) for _ in range(10)]
    assert sys.getrefcount(a) == base + 10
    del caps  # unconsumed capsules release their reference
    gc.collect()
    assert sys.getrefcount(a) == base


def test_dlpack_refusals():
    a = dpmini.asarray(np.ones(4, "f4"), 0)
    with pytest.raises(BufferError, match="stream 0"):
        a.__dlpack__(stream=0)
    with pytest.raises(BufferError, match="copy=True"):
        a.__dlpack__(dl_device=(1, 0), copy=False)
    with pytest.raises(BufferError, match="cannot export"):
        a.__dlpack__(dl_device=(2, 7))
    with pytest.raises(TypeError):
        a.__dlpack__(stream="x")


def test_dlpack_host_copy_through_numpy_from_dlpack():
    x = sample((3, 3), "float32")
    a = dpmini.asarray(x, 0)

    class HostView:
        def __dlpack__(self, stream=None, max_version=None, dl_device=None, copy=None):
            return a.__dlpack__(dl_device=(1, 0), copy=True, max_version=max_version)

        def __dlpack_device__(self):
            return (1, 0)

    y = np.from_dlpack(HostView())
    np.testing.assert_array_equal(y, x)


def test_dlpack_copy_true_on_device():
    a = dpmini.asarray(np.arange(5, dtype="i8"), 0)

    class Copy:
        def __dlpack__(self, stream=None, max_version=None):
            return a.__dlpack__(stream=stream, max_version=max_version, copy=True)

        def __dlpack_device__(self):
            return (2, 0)

    b = dpmini.from_dlpack(Copy())
    assert b.data_ptr != a.data_ptr
    np.testing.assert_array_equal(b.numpy(), np.arange(5))


def test_pinned_memory():
    e = dpmini.empty((4, 3), "float32", pin_memory=True)
    assert type(e) is np.ndarray and e.shape == (4, 3) and str(dpmini.device_of(e)) == "cpu"
    x = sample((5, 2), "int64")
    p = dpmini.asarray(x, pin_memory=True)
    assert type(p) is np.ndarray and p.ctypes.data != x.ctypes.data
    np.testing.assert_array_equal(p, x)
    with pytest.raises(ValueError, match="pin_memory"):
        dpmini.empty((2,), pin_memory=True, device=0)


def test_empty_on_device_and_memory_accounting():
    dpmini.empty_cache()
    before = dpmini.memory_allocated("cuda:0")
    a = dpmini.empty((1024, 1024), "float32", device="cuda:0")
    assert isinstance(a, dpmini.Array) and a.shape == (1024, 1024)
    assert dpmini.memory_allocated("cuda:0") >= before + (4 << 20)
    del a
    assert dpmini.memory_allocated("cuda:0") == before
    assert dpmini.memory_reserved("cuda:0") >= 4 << 20
    dpmini.empty_cache()


def test_out_of_memory_is_memory_error_and_device_stays_usable():
    with pytest.raises(MemoryError, match="cuda:0"):
        dpmini.empty((1 << 44,), "uint8", device=0)
    a = dpmini.asarray(np.arange(3), 0)
    np.testing.assert_array_equal(a.numpy(), np.arange(3))


def test_build_info():
    info = dpmini._dpmini.cuda_build_info()
    assert info["backend"] in ("cuda", "emulated")
    assert info["device_count"] == dpmini.device_count()
    assert isinstance(info["nccl"], str)
    assert dpmini._dpmini.has_cuda == 1


@two_gpus
def test_copy_between_devices():
    x = sample((16, 9), "float64")
    a = dpmini.asarray(x, 0)
    b = dpmini.asarray(a, 1)
    assert b.device == "cuda:1"
    np.testing.assert_array_equal(b.numpy(), x)
    assert dpmini.asarray(a, 0) is a


@pytest.mark.skipif(EMULATED, reason="CuPy needs a real GPU")
def test_cupy_round_trip():
    cp = need_cupy()
    c = cp.arange(12, dtype=cp.float32).reshape(3, 4)
    a = dpmini.asarray(c)
    assert a.data_ptr == c.data.ptr
    back = cp.asarray(a)  # through __cuda_array_interface__
    assert back.data.ptr == c.data.ptr
    d = cp.from_dlpack(a)
    cp.testing.assert_array_equal(d, c)


@real_gpu
def test_torch_round_trip():
    torch = need_torch_cuda()
    t = torch.arange(12, dtype=torch.float32, device="cuda:0").reshape(3, 4)
    a = dpmini.from_dlpack(t)
    assert a.data_ptr == t.data_ptr()
    b = dpmini.asarray(t)  # CAI
    assert b.data_ptr == t.data_ptr()
    u = torch.from_dlpack(a)
    assert u.data_ptr() == t.data_ptr()
    assert torch.equal(u, t)


# ---- imports wait for the producer ----

class CAIv2:
    """A CUDA Array Interface v2 producer (PyTorch's kind): no 'stream' key."""

    def __init__(self, arr, version=2):
        self.arr = arr
        self.version = version

    @property
    def __cuda_array_interface__(self):
        d = dict(self.arr.__cuda_array_interface__)
        del d["stream"]
        d["version"] = self.version
        return d


@pytest.mark.parametrize("version", [2, 3])
def test_cai_without_stream_key_waits_for_the_legacy_stream(version):
    a = dpmini.asarray(np.arange(6.0), 0)
    before = cuda_debug()["legacy_syncs"]
    b = dpmini.asarray(CAIv2(a, version))
    assert b.data_ptr == a.data_ptr
    assert cuda_debug()["legacy_syncs"] == before + 1  # no promise: synchronised
    dpmini.asarray(CAIProducer(a, stream=None))  # v3, stream None: ready
    dpmini.asarray(CAIProducer(a, stream=1))  # v3, a stream: that one is synced
    assert cuda_debug()["legacy_syncs"] == before + 1


class BothInterfaces(CAIProducer):
    """CAI and DLPack, like PyTorch and CuPy: DLPack must win."""

    def __init__(self, arr):
        super().__init__(arr, stream=None)
        self.used = []

    @property
    def __cuda_array_interface__(self):
        self.used.append("cai")
        return super().__cuda_array_interface__

    def __dlpack__(self, stream=None, max_version=None, **kw):
        self.used.append(("dlpack", stream))
        return self.arr.__dlpack__(stream=stream, max_version=max_version)

    def __dlpack_device__(self):
        return self.arr.__dlpack_device__()


@pytest.mark.parametrize("how", ["asarray", "from_dlpack", "scatter"])
def test_objects_with_both_interfaces_are_imported_through_dlpack(how):
    x = sample((4, 2), "float32")
    a = dpmini.asarray(x, 0)
    p = BothInterfaces(a)
    if how == "asarray":
        r = dpmini.asarray(p)
    elif how == "from_dlpack":
        r = dpmini.from_dlpack(p)
    else:
        r = dpmini.comm.scatter(p, [0, 0])[0]
    np.testing.assert_array_equal(host(r), x[: len(host(r))])
    calls = [u for u in p.used if u != "cai"]
    assert calls and all(u[0] == "dlpack" and isinstance(u[1], int) and u[1] != 0
                         for u in calls)


@real_gpu
def test_torch_default_stream_work_is_waited_for():
    """PyTorch's CAI is v2 (no 'stream'): its pending kernels on the default
    stream must be done before dpmini copies the memory."""
    torch = need_torch_cuda()
    for via in ("cai", "dlpack"):
        t = torch.zeros(1 << 20, device="cuda:0")
        torch.cuda._sleep(200_000_000)  # ~0.1 s of GPU time queued first
        u = t + 1  # runs after the sleep
        obj = CAIOnly(u) if via == "cai" else u
        got = dpmini.asarray(obj).numpy()
        assert (got == 1).all(), via


class CAIOnly:
    def __init__(self, t):
        self.t = t

    @property
    def __cuda_array_interface__(self):
        return self.t.__cuda_array_interface__


# ---- the caller's current device is left alone ----

@two_gpus
def test_current_device_is_not_changed():
    start = cuda_debug()["current_device"]
    x = sample((6, 5), "float32")
    a = dpmini.asarray(x, 1)
    b = dpmini.asarray(CAIProducer(a, stream=1))  # an import that syncs on cuda:1
    c = dpmini.asarray(a, 0)
    dpmini.comm.scatter(x, [1, 0])
    np.testing.assert_array_equal(b.numpy(), c.numpy())
    assert cuda_debug()["current_device"] == start


# ---- exported memory is not reused under a consumer ----

def test_exported_buffers_are_synchronised_before_reuse():
    dbg = cuda_debug
    dpmini.empty_cache()  # nothing deferred from earlier tests
    before = dbg()["export_syncs"]
    a = dpmini.asarray(np.ones(64), 0)
    del a  # never exported: cached at once
    assert dbg()["export_syncs"] == before and dbg()["export_deferred"] == 0
    a = dpmini.asarray(np.ones(64), 0)
    a.__cuda_array_interface__  # no stream named: released after a device sync
    del a
    gc.collect()
    assert dbg()["export_syncs"] == before and dbg()["export_deferred"] == 1
    dpmini.empty_cache()
    assert dbg()["export_syncs"] == before + 1 and dbg()["export_deferred"] == 0
    ssyncs = dbg()["export_stream_syncs"]
    c0, c1 = dpmini.comm.scatter(dpmini.asarray(np.ones(64), 0), [0, 0])
    b = dpmini.from_dlpack(DLPackProducer(c1))  # a view's export marks the block
    del c0, c1
    gc.collect()
    assert dbg()["export_stream_syncs"] == ssyncs  # b still holds it
    del b
    gc.collect()
    # the consumer (dpmini's import) named its stream: that stream is waited for
    assert dbg()["export_stream_syncs"] == ssyncs + 1
    assert dbg()["export_syncs"] == before + 1


def _dlpack_flags(cap):
    get = ctypes.pythonapi.PyCapsule_GetPointer
    get.restype = ctypes.c_void_p
    get.argtypes = [ctypes.py_object, ctypes.c_char_p]
    p = get(cap, b"dltensor_versioned")
    # DLManagedTensorVersioned: version (2 x u32), manager_ctx, deleter, flags (u64)
    return ctypes.c_uint64.from_address(p + 8 + 2 * ctypes.sizeof(ctypes.c_void_p)).value


def test_dlpack_read_only_flag_both_ways():
    a = dpmini.asarray(np.arange(4.0), 0)
    assert _dlpack_flags(a.__dlpack__(max_version=(1, 0))) & 2 == 0
    cai = dict(a.__cuda_array_interface__)
    cai["data"] = (cai["data"][0], True)

    class ReadOnly:
        __cuda_array_interface__ = cai

    ro = dpmini.asarray(ReadOnly())
    assert _dlpack_flags(ro.__dlpack__(max_version=(1, 0))) & 1  # DLPACK_FLAG_BITMASK_READ_ONLY
    back = dpmini.from_dlpack(DLPackProducer(ro))  # accepted, stays read-only
    np.testing.assert_array_equal(back.numpy(), np.arange(4.0))
    with pytest.raises(ValueError, match="read-only"):
        dpmini.comm.gather([a], out=back)


# ---- protocol errors propagate, DLPack-only objects are leaves ----

class RequiresGrad:
    """Like a CUDA tensor with requires_grad: the CAI getter raises."""

    @property
    def __cuda_array_interface__(self):
        raise RuntimeError("Can't get __cuda_array_interface__ on Variable that requires grad")


def test_cai_getter_errors_propagate_with_the_argument_path():
    with pytest.raises(RuntimeError, match=r"requires grad") as e:
        dpmini.scatter({"x": RequiresGrad()}, [0, 0])
    assert "'x'" in str(e.value) and "__cuda_array_interface__" in str(e.value)
    with pytest.raises(RuntimeError, match="requires grad"):
        dpmini.comm.scatter(RequiresGrad(), [0, 0])

    class NoCAI:
        @property
        def __cuda_array_interface__(self):
            raise AttributeError("not on a GPU")

    obj = NoCAI()
    parts = dpmini.scatter(({"o": obj},), [0, 0])  # AttributeError: not an array, shared
    assert parts[0][0]["o"] is obj and parts[1][0]["o"] is obj


def test_dlpack_only_objects_are_array_leaves():
    x = sample((6, 3), "int32")
    p = DLPackProducer(dpmini.asarray(x, 0))
    parts = dpmini.scatter(({"x": p},), [0, 0])
    assert [host(q[0]["x"]).shape for q in parts] == [(3, 3), (3, 3)]
    np.testing.assert_array_equal(host(parts[1][0]["x"]), x[3:])


# ---- sticky errors say so ----

@pytest.mark.skipif(not EMULATED, reason="injects a fault into the emulator")
def test_sticky_errors_say_the_process_must_restart():
    x = np.arange(10.0)
    _testing.emulate_fault(700)  # cudaErrorIllegalAddress
    with pytest.raises(dpmini.CudaError, match="sticky.*must be restarted") as e:
        dpmini.asarray(x, 0)
    assert e.value.status == 700
    _testing.emulate_fault(1)  # cudaErrorInvalidValue: recoverable
    with pytest.raises(dpmini.CudaError) as e:
        dpmini.asarray(x, 0)
    assert e.value.status == 1 and "sticky" not in str(e.value)
    np.testing.assert_array_equal(dpmini.asarray(x, 0).numpy(), x)
