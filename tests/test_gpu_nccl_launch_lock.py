"""NCCL launches and device-synchronising calls of other threads never
overlap: while ncclGroupEnd launches its kernels device after device, a
cudaFree, cudaMalloc or cudaDeviceSynchronize on another thread can wait for
a launched kernel whose peers wait to be launched (NCCL's documented
deadlock). The emulated NCCL marks its launches and the emulator counts such
calls ("launch_overlaps")."""
import threading

import numpy as np
import pytest

import dpmini
from dpmini import _testing
from gpu_helpers import EMULATED, gpu, two_gpus

pytestmark = gpu
emulated = pytest.mark.skipif(not EMULATED, reason="uses the emulator's hooks")
MIB = 1 << 20


@two_gpus
@emulated
def test_allocations_and_frees_of_other_threads_wait_for_nccl_launches():
    was = _testing.emulated_nccl(1)
    try:
        before = _testing.emu_stats()["launch_overlaps"]
        x = np.arange(4096, dtype="float32")
        src = dpmini.asarray(x, 0)
        stop = threading.Event()
        errors = []

        def churn():   # cudaMalloc + cudaFree (empty_cache) on both GPUs, no GIL held
            try:
                while not stop.is_set():
                    for d in (0, 1):
                        dpmini.empty((3 * MIB,), np.uint8, device=f"cuda:{d}")
                    dpmini.empty_cache()
            except BaseException as e:   # reported by the main thread
                errors.append(e)

        t = threading.Thread(target=churn)
        t.start()
        try:
            for _ in range(200):
                outs = dpmini.comm.broadcast(src, [0, 1])
            np.testing.assert_array_equal(outs[1].numpy(), x)
        finally:
            stop.set()
            t.join(60)
        assert not t.is_alive() and not errors, errors
        assert _testing.emu_stats()["launch_overlaps"] == before
    finally:
        _testing.emulated_nccl(1 if was else 0)
