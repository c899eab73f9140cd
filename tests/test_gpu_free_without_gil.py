"""cudaFree synchronises the device: a block the GPU cache evicts is released
with the GIL released, so that a free does not stall every Python thread
behind any library's long kernel. The emulator's cudaFree waits like a device
sync and reports it to the sync hook, which counts syncs made with the GIL
held (_testing.emu_stats()["syncs_with_gil"])."""
import gc

import numpy as np
import pytest

import dpmini
from dpmini import _testing
from gpu_helpers import EMULATED, gpu

pytestmark = gpu
emulated = pytest.mark.skipif(not EMULATED, reason="uses the emulator's hooks")
MIB = 1 << 20


@emulated
def test_cache_eviction_frees_device_memory_without_the_gil():
    dpmini.empty_cache()
    before = _testing.emu_stats()["syncs_with_gil"]
    a = dpmini.empty((40 * MIB,), np.uint8, device="cuda:0")
    del a   # cached: 40 MiB <= peak + 32 MiB
    b = dpmini.empty((48 * MIB,), np.uint8, device="cuda:0")
    reserved = dpmini.memory_reserved("cuda:0")
    del b   # cached 40 + 48 MiB > peak 48 + 32 MiB: the oldest block is evicted
    gc.collect()
    assert dpmini.memory_reserved("cuda:0") < reserved + 48 * MIB   # a block was freed
    assert _testing.emu_stats()["syncs_with_gil"] == before
    dpmini.empty_cache()
