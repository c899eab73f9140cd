"""The GPU layer across fork() and at exit.

CUDA cannot be used in a child forked after the parent initialised it: the
child's copy of the parent's contexts, streams and locks is unusable, and a
CUDA call there fails with an obscure error or hangs on a lock a parent
thread held at fork time. dpmini poisons its GPU state in such a child: any
GPU work raises dpmini.CudaError saying why and what to do (the 'spawn'
start method), as PyTorch does, while virtual CPU devices keep working. A parent
that only counted devices has not initialised CUDA for that, so its child may
use the GPUs. NCCL communicators are destroyed at interpreter exit (they hold
threads, sockets and GPU memory until then).

Each test runs in a fresh process (the emulator stands in for the driver:
a context created is "CUDA initialised").
"""
import os

import pytest

import dpmini
from gpu_helpers import EMULATED, gpu
from script_runner import run_script

pytestmark = [*gpu, pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")]
emulated = pytest.mark.skipif(not EMULATED, reason="uses the emulated build")

ENV = dict(os.environ,
           PYTHONPATH=os.path.dirname(os.path.dirname(os.path.abspath(dpmini.__file__))))

CHILD = """
    import os, sys, warnings
    import numpy as np
    import dpmini
    warnings.simplefilter("ignore", DeprecationWarning)  # fork with threads (3.12+)

    def in_child(fn):
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                code = fn()
            except BaseException as e:
                print("child raised", type(e).__name__, e, flush=True)
            finally:
                os._exit(code)
        _, status = os.waitpid(pid, 0)
        return os.waitstatus_to_exitcode(status)
"""


def test_child_forked_after_gpu_use_gets_a_clear_error(tmp_path):
    run_script(CHILD + """
    x = np.arange(12.0).reshape(3, 4)
    a = dpmini.asarray(x, 0)          # CUDA initialised in the parent

    def child():
        msgs = []
        for work in (lambda: dpmini.asarray(x, 0), lambda: a.numpy(),
                     lambda: dpmini.comm.scatter(x, [0, 0]),
                     lambda: dpmini.empty((4,), "float32", device="cuda:0")):
            try:
                work()
            except dpmini.CudaError as e:
                msgs.append(str(e))
        assert len(msgs) == 4, msgs
        for m in msgs:
            assert "fork" in m and "spawn" in m, m
        # virtual CPU devices still work
        parts = dpmini.scatter(x, ["cpu:0", "cpu:1"])
        np.testing.assert_array_equal(dpmini.gather(parts, "cpu"), x)
        global a
        a = None                      # freeing the parent's GPU array is quiet
        return 0

    assert in_child(child) == 0
    np.testing.assert_array_equal(a.numpy(), x)   # the parent is unaffected
    print("OK")
    """, env=ENV, cwd=tmp_path)


def _nvml_missing():
    import ctypes
    try:
        ctypes.CDLL("libnvidia-ml.so.1")
    except OSError:
        return True
    return False


@pytest.mark.skipif(not EMULATED and ("CUDA_VISIBLE_DEVICES" in os.environ or _nvml_missing()),
                    reason="on GPUs the count avoids the driver through NVML only, and only "
                    "without CUDA_VISIBLE_DEVICES")
def test_child_of_a_parent_that_only_counted_devices_may_use_the_gpu(tmp_path):
    run_script(CHILD + """
    assert dpmini.device_count() >= 1   # counting does not initialise CUDA
    x = np.arange(6.0)

    def child():
        np.testing.assert_array_equal(dpmini.asarray(x, 0).numpy(), x)
        return 0

    assert in_child(child) == 0
    print("OK")
    """, env=ENV, cwd=tmp_path)


@emulated
def test_nccl_communicators_are_destroyed_at_exit(tmp_path):
    # atexit runs last-registered first: this check, registered before dpmini
    # is imported, runs after dpmini's own exit hook
    run_script("""
    import atexit

    def check():
        live = _testing.cuda_debug()["nccl_live_comms"]
        print("live at exit:", live)
        assert live == 0, live
        print("OK", flush=True)

    atexit.register(check)
    import numpy as np
    import dpmini
    from dpmini import _testing
    _testing.emulated_nccl(1)
    out = dpmini.comm.broadcast(dpmini.asarray(np.arange(4.0), 0), [0, 1])
    assert _testing.cuda_debug()["nccl_live_comms"] == 2
    del out
    """, env=dict(ENV, DPMINI_EMULATE_GPUS="2"), cwd=tmp_path)
