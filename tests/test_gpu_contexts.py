"""No CUDA context on a GPU dpmini was not asked to use.

A CUDA call that needs a context, made on a thread that has none, binds (and
creates) the primary context of the thread's current device, device 0 on a
fresh thread: ~300-500 MiB of GPU 0's memory and a process listed on a GPU
the user kept free. The emulator models it: a thread starts with no context,
calls made through the device guard create the context of the device they
name, and calls that are not (page-locked host memory, pointer queries, a
device restored by NCCL's communicator setup) create the current device's;
emu_contexts() lists the devices that got one. Each test runs in a fresh
process with 3 emulated GPUs and works on cuda:1 (and cuda:2) only.
"""
import os

import pytest

import dpmini
from gpu_helpers import EMULATED, gpu
from script_runner import run_script

pytestmark = [*gpu, pytest.mark.skipif(not EMULATED, reason="uses the emulator's context model")]

ENV = dict(os.environ, DPMINI_EMULATE_GPUS="3",
           PYTHONPATH=os.path.dirname(os.path.dirname(os.path.abspath(dpmini.__file__))))

PRELUDE = """
    import threading
    import numpy as np
    import dpmini
    from dpmini import _testing

    class CAI:
        def __init__(self, d):
            self.__cuda_array_interface__ = d

    def in_fresh_thread(fn):
        err = []
        def run():
            try:
                fn()
            except BaseException as e:
                err.append(e)
        t = threading.Thread(target=run)
        t.start()
        t.join(60)
        if err:
            raise err[0]

    assert _testing.emu_contexts() == [], _testing.emu_contexts()
"""


def test_copies_imports_and_pinned_memory_on_gpu1_leave_gpu0_alone(tmp_path):
    run_script(PRELUDE + """
    x = np.arange(24.0).reshape(4, 6)

    def work():
        a = dpmini.asarray(x, 1)                    # pageable source: pinned staging
        t = dpmini.asarray(x.T, 1)                  # strided source
        h = dpmini.comm.gather(dpmini.comm.scatter(a, [1, 1]), destination="cpu")
        np.testing.assert_array_equal(h, x)
        np.testing.assert_array_equal(t.numpy(), x.T)
        b = dpmini.asarray(CAI(a.__cuda_array_interface__))  # pointer query on import
        assert b.device == "cuda:1"
        np.testing.assert_array_equal(b.numpy(), x)
        p = dpmini.empty((16,), "float32", pin_memory=True)  # page-locked host memory
        p[:] = 1
        del p

    in_fresh_thread(work)
    assert _testing.emu_contexts() == [1], _testing.emu_contexts()
    print("OK")
    """, env=ENV, cwd=tmp_path)


def test_empty_cai_import_with_a_null_pointer_creates_no_context(tmp_path):
    run_script(PRELUDE + """
    def work():
        for stream in (None, 1):
            d = {"shape": (0, 3), "typestr": "<f4", "data": (0, False), "version": 3}
            if stream is not None:
                d["stream"] = stream
            e = dpmini.asarray(CAI(d))
            assert e.shape == (0, 3) and e.numpy().shape == (0, 3)

    in_fresh_thread(work)
    assert _testing.emu_contexts() == [], _testing.emu_contexts()
    print("OK")
    """, env=ENV, cwd=tmp_path)


def test_nccl_setup_on_gpus_1_and_2_restores_no_device_0(tmp_path):
    run_script(PRELUDE + """
    _testing.emulated_nccl(1)
    x = np.arange(10, dtype="float32")

    def work():
        out = dpmini.comm.broadcast(dpmini.asarray(x, 1), [1, 2])  # ncclCommInitAll
        assert cuda_debug_calls() >= 1
        for o in out:
            np.testing.assert_array_equal(o.numpy(), x)
        r = dpmini.comm.reduce_add(out, destination=2)
        np.testing.assert_array_equal(r.numpy(), 2 * x)

    def cuda_debug_calls():
        return _testing.cuda_debug()["nccl_calls"]

    in_fresh_thread(work)
    assert _testing.emu_contexts() == [1, 2], _testing.emu_contexts()
    print("OK")
    """, env=ENV, cwd=tmp_path)


def test_work_on_gpu2_from_a_fresh_thread_creates_gpu2s_context_only(tmp_path):
    run_script(PRELUDE + """
    def work():
        a = dpmini.asarray(np.ones(4), 2)
        assert _testing.cuda_debug()["current_device"] == 0   # a fresh thread's answer
        np.testing.assert_array_equal(a.numpy(), np.ones(4))

    in_fresh_thread(work)
    assert _testing.emu_contexts() == [2], _testing.emu_contexts()
    print("OK")
    """, env=ENV, cwd=tmp_path)
