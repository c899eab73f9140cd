"""When dpmini may reuse the memory of an exported dpmini.Array.

A consumer's kernels may still read an exported block after the consumer let
go of it, so the block must not go back to the cache before they finished.
What dpmini knows decides the wait:
  - DLPack: the consumer names its stream (__dlpack__(stream=s)); the block is
    marked only when a consumer takes the capsule (a capsule dropped unused
    marks nothing) and its release waits on that stream, not on the device,
    when the stream outlives the consumer (the legacy default stream,
    dpmini's own); another library's handle may be destroyed by then and is
    never used after the consumer let go: the block waits for a device sync;
  - the CUDA Array Interface: a read of the property (a hasattr probe too)
    cannot be told from a use and names no stream; the block's release is
    deferred and released with others after one device sync, so a freed
    block costs no device-wide sync of its own.
The emulator records work queued on any stream handle (_testing.emu_queue), so a block
handed out while a consumer's kernel still touches it is counted
(freed_while_queued).
"""
import ctypes
import gc

import numpy as np
import pytest

import dpmini
from dpmini import _testing
from gpu_helpers import EMULATED, cuda_debug, gpu

pytestmark = gpu
emulated = pytest.mark.skipif(not EMULATED, reason="uses the emulator's hooks")

CONSUMER_STREAM = 0x7A5000  # a handle the emulator treats as another library's stream


def _dbg(key):
    return cuda_debug()[key]


class Consumer:
    """A DLPack consumer written with ctypes: takes the capsule (renames it
    'used_...'), reads the data pointer, and later calls the deleter, as
    torch.from_dlpack does when its tensor dies."""

    _get = ctypes.pythonapi.PyCapsule_GetPointer
    _get.restype = ctypes.c_void_p
    _get.argtypes = [ctypes.py_object, ctypes.c_char_p]
    _rename = ctypes.pythonapi.PyCapsule_SetName
    _rename.restype = ctypes.c_int
    _rename.argtypes = [ctypes.py_object, ctypes.c_char_p]

    def __init__(self, arr, stream):
        cap = arr.__dlpack__(stream=stream, max_version=(1, 0))
        self.managed = self._get(cap, b"dltensor_versioned")
        assert self._rename(cap, b"used_dltensor_versioned") == 0
        del cap  # a used capsule's destructor does nothing
        ptr = ctypes.c_void_p.from_address
        # DLManagedTensorVersioned: version (2 x u32), manager_ctx, deleter, flags, dl_tensor
        self.deleter = ptr(self.managed + 8 + ctypes.sizeof(ctypes.c_void_p)).value
        self.data = ptr(self.managed + 8 + 2 * ctypes.sizeof(ctypes.c_void_p) + 8).value

    def release(self):
        ctypes.CFUNCTYPE(None, ctypes.c_void_p)(self.deleter)(self.managed)


# ---- a read of __cuda_array_interface__ costs no device sync per block ----

def test_cai_reads_do_not_sync_the_device_at_every_free():
    before = _dbg("export_syncs")
    for _ in range(40):
        a = dpmini.asarray(np.ones(32, "float32"), 0)
        assert hasattr(a, "__cuda_array_interface__")  # a probe, as torch.as_tensor does
        del a
    gc.collect()
    # one device sync per batch of deferred blocks (before: one per block, 40)
    assert _dbg("export_syncs") - before <= 40 // 8


def test_deferred_blocks_are_released_by_empty_cache():
    dpmini.empty_cache()
    allocated = dpmini.memory_allocated("cuda:0")
    a = dpmini.asarray(np.arange(64.0), 0)
    assert dpmini.memory_allocated("cuda:0") > allocated
    _ = a.__cuda_array_interface__["data"]
    del a
    gc.collect()
    assert _dbg("export_deferred") == 1
    # freed by its array: not allocated any more, still reserved until the sync
    assert dpmini.memory_allocated("cuda:0") == allocated
    assert dpmini.memory_reserved("cuda:0") > allocated
    before = _dbg("export_syncs")
    dpmini.empty_cache()
    assert _dbg("export_deferred") == 0
    assert _dbg("export_syncs") == before + 1  # one sync for all of them


@emulated
def test_cai_consumer_kernels_finish_before_the_block_is_reused():
    busy0 = _testing.emu_stats()["freed_while_queued"]
    keep = []
    for i in range(30):
        a = dpmini.asarray(np.full(256, i, "float64"), 0)
        ptr = a.__cuda_array_interface__["data"][0]
        _testing.emu_queue(0, CONSUMER_STREAM, ptr, 256 * 8)  # the consumer's kernel reads it
        del a
        keep.append(dpmini.asarray(np.full(256, -i, "float64"), 0))  # wants a block now
    gc.collect()
    assert _testing.emu_stats()["freed_while_queued"] == busy0
    for i, b in enumerate(keep):
        np.testing.assert_array_equal(b.numpy(), np.full(256, -i, "float64"))
    dpmini.empty_cache()


# ---- DLPack: marked when consumed, released after the consumer's stream ----

def test_dlpack_capsule_dropped_unused_marks_nothing():
    a = dpmini.asarray(np.arange(48.0), 0)
    ptr = a.data_ptr
    before = (_dbg("export_syncs"), _dbg("export_stream_syncs"), _dbg("export_deferred"))
    cap = a.__dlpack__(max_version=(1, 0))
    del cap  # never consumed: the deleter runs from the capsule's destructor
    cap = a.__dlpack__()  # the legacy capsule too
    del cap, a
    gc.collect()
    assert (_dbg("export_syncs"), _dbg("export_stream_syncs"), _dbg("export_deferred")) == before
    b = dpmini.asarray(np.zeros(48), 0)
    assert b.data_ptr == ptr  # cached at once, as never-exported memory


@emulated
def test_dlpack_release_waits_on_the_legacy_stream_only():
    # stream 1 (the legacy default stream) lives as long as the process
    busy0 = _testing.emu_stats()["freed_while_queued"]
    a = dpmini.asarray(np.arange(100.0), 0)
    c = Consumer(a, 1)
    assert c.data == a.data_ptr
    _testing.emu_queue(0, 1, c.data, 800)  # the consumer's kernel, still queued
    syncs, ssyncs = _dbg("export_syncs"), _dbg("export_stream_syncs")
    del a
    gc.collect()
    assert _dbg("export_stream_syncs") == ssyncs  # the consumer still holds it
    c.release()
    gc.collect()
    assert _dbg("export_stream_syncs") == ssyncs + 1
    assert _dbg("export_syncs") == syncs  # no device-wide sync
    assert not _testing.emu_busy(c.data, 800)  # the consumer's work was waited for
    assert _testing.emu_stats()["freed_while_queued"] == busy0


@emulated
def test_another_librarys_stream_is_not_used_after_the_consumer_destroyed_it():
    # CuPy destroys a stream at garbage collection, maybe before the block is
    # freed: the handle must not be synchronised then (undefined behaviour);
    # the block waits for a device sync instead
    dpmini.empty_cache()
    bad0 = _testing.emu_stats()["bad_stream_handles"]
    busy0 = _testing.emu_stats()["freed_while_queued"]
    a = dpmini.asarray(np.arange(100.0), 0)
    c = Consumer(a, CONSUMER_STREAM)
    _testing.emu_queue(0, CONSUMER_STREAM, c.data, 800)  # the consumer's kernel, still queued
    deferred, ssyncs = _dbg("export_deferred"), _dbg("export_stream_syncs")
    c.release()
    _testing.emu_destroy_stream(CONSUMER_STREAM)
    del a
    gc.collect()
    assert _testing.emu_stats()["bad_stream_handles"] == bad0
    assert _dbg("export_stream_syncs") == ssyncs
    assert _dbg("export_deferred") == deferred + 1
    dpmini.empty_cache()  # one device sync: the consumer's work is done
    assert not _testing.emu_busy(c.data, 800)
    assert _testing.emu_stats()["freed_while_queued"] == busy0
    assert _dbg("export_deferred") == 0


@emulated
@pytest.mark.parametrize("stream", [None, 2], ids=["no-stream", "per-thread-default"])
def test_dlpack_export_to_an_unknown_stream_is_deferred(stream):
    # None names no stream; 2 (per-thread default) is the consumer thread's,
    # which dpmini's freeing thread cannot wait on
    a = dpmini.asarray(np.arange(10.0), 0)
    c = Consumer(a, stream)
    deferred, ssyncs = _dbg("export_deferred"), _dbg("export_stream_syncs")
    del a
    c.release()
    gc.collect()
    assert _dbg("export_deferred") == deferred + 1
    assert _dbg("export_stream_syncs") == ssyncs
    dpmini.empty_cache()
    assert _dbg("export_deferred") == 0


def test_dlpack_consumer_reads_the_values_and_releases_once():
    x = np.arange(12.0).reshape(3, 4)
    a = dpmini.asarray(x, 0)
    b = dpmini.from_dlpack(_Producer(a))  # dpmini itself as the consumer
    del a
    gc.collect()
    np.testing.assert_array_equal(b.numpy(), x)
    ssyncs = _dbg("export_stream_syncs")
    del b
    gc.collect()
    assert _dbg("export_stream_syncs") == ssyncs + 1  # dpmini's import stream


class _Producer:
    def __init__(self, arr):
        self.arr = arr

    def __dlpack__(self, **kw):
        return self.arr.__dlpack__(**kw)

    def __dlpack_device__(self):
        return self.arr.__dlpack_device__()
