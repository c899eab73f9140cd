"""GPU faults that only real hardware shows, made visible by the CUDA
emulator (csrc/backend/cuda_emulate.c): the device a DLPack producer runs on,
memory peer access does not cover, temporaries reused while queued work may
still touch them, stream handles used after a failed request.

Each test fails on the code before its fix on the
emulated build; the DLPack one also runs on real GPUs.
"""
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

import dpmini
from gpu_helpers import EMULATED, cuda_debug, gpu, sample, two_gpus

pytestmark = gpu
emulated = pytest.mark.skipif(not EMULATED, reason="uses the emulator's hooks")
from dpmini import _testing


class TorchLikeProducer:
    """DLPack like PyTorch's Tensor.__dlpack__(stream=...): it orders its work
    through an event recorded on the current stream of the CURRENT device, so
    it is correct only when its own device is current during the call."""

    def __init__(self, arr, dev):
        self.arr = arr
        self.dev = dev
        self.seen = []

    def __dlpack__(self, stream=None, max_version=None, **kw):
        self.seen.append(cuda_debug()["current_device"])
        return self.arr.__dlpack__(stream=stream, max_version=max_version)

    def __dlpack_device__(self):
        return (2, self.dev)


# ---- DLPack import waits on the producer's own device ----

@two_gpus
def test_dlpack_producer_runs_with_its_own_device_current():
    x = sample((4, 3), "float32")
    start = cuda_debug()["current_device"]
    other = 1 if start != 1 else 0
    p = TorchLikeProducer(dpmini.asarray(x, other), other)
    b = dpmini.from_dlpack(p)
    np.testing.assert_array_equal(b.numpy(), x)
    assert p.seen == [other]
    assert cuda_debug()["current_device"] == start  # restored afterwards


@two_gpus
def test_gather_of_dlpack_outputs_waits_on_each_producers_device():
    x = sample((6, 3), "int32")
    c0, c1 = dpmini.comm.scatter(x, [0, 1])
    p0, p1 = TorchLikeProducer(c0, 0), TorchLikeProducer(c1, 1)
    g = dpmini.comm.gather([p0, p1], destination=0)
    np.testing.assert_array_equal(g.numpy(), x)
    assert p0.seen == [0] and p1.seen == [1]


class PerThreadStreamOutput:
    """A replica's output as a library on per-thread default streams
    exports it: CAI stream 2, the per-thread default stream of the thread
    that made it."""

    def __init__(self, arr):
        self.arr = arr

    @property
    def __cuda_array_interface__(self):
        return dict(self.arr.__cuda_array_interface__, stream=2)


@emulated
def test_cai_per_thread_stream_from_another_thread_is_waited_for():
    # the output is imported on the caller's thread, whose own stream 2 is
    # another stream than the producer's: the device is synchronised
    import threading
    x = sample((5, 4), "float32")
    a = dpmini.asarray(x, 0)
    ptr, n = a.data_ptr, x.nbytes
    t = threading.Thread(target=lambda: _testing.emu_queue(0, 2, ptr, n))  # still running there
    t.start()
    t.join()
    assert _testing.emu_busy(ptr, n)
    b = dpmini.asarray(PerThreadStreamOutput(a))
    assert not _testing.emu_busy(ptr, n)  # the producer thread's work was waited for
    np.testing.assert_array_equal(b.numpy(), x)


# ---- no peer kernel on memory peer access does not cover ----

class CAIView:
    """Borrowed device memory (e.g. a VMM or cudaMallocAsync block)."""

    def __init__(self, ptr, shape, strides, typestr):
        self.__cuda_array_interface__ = {
            "version": 3, "shape": shape, "strides": strides, "typestr": typestr,
            "data": (ptr, False), "stream": None}


@two_gpus
@emulated
def test_strided_copy_from_memory_peer_access_does_not_cover():
    x = sample((4, 6), "float64")
    ptr = _testing.emu_nopeer_alloc(0, x.tobytes())
    try:
        src = CAIView(ptr, (6, 4), (8, 48), "<f8")  # x.T: strided, on cuda:0
        b = dpmini.asarray(src, 1)
        assert b.device == "cuda:1"
        np.testing.assert_array_equal(b.numpy(), x.T)
        # the same through gather, into a strided destination
        out = dpmini.empty((6, 8), "float64", device=1)
        dpmini.comm.gather([src, dpmini.asarray(x.T, 1)], dim=1, out=out)
        np.testing.assert_array_equal(out.numpy(), np.concatenate([x.T, x.T], 1))
    finally:
        _testing.emu_free(0, ptr)


# ---- temporaries are not cached while a peer copy uses them ----

@two_gpus
@emulated
def test_temporaries_wait_for_queued_copies_on_an_error_path(tmp_path):
    code = textwrap.dedent("""
        import numpy as np, dpmini
        from dpmini import _testing
        x = np.arange(12.0).reshape(4, 3)
        chunks = [dpmini.asarray(x, 0), dpmini.asarray(x, 0)]
        out = dpmini.empty((4, 6), "float64", device=1)
        before = _testing.emu_stats()["freed_while_queued"]
        _testing.emulate_fault(1)  # the unpack kernel after the peer copy fails
        try:
            dpmini.comm.gather(chunks, dim=1, out=out)
        except dpmini.CudaError as e:
            assert e.status == 1, e
        else:
            raise SystemExit("no CudaError")
        print("freed_while_queued", _testing.emu_stats()["freed_while_queued"] - before)
        dpmini.comm.gather(chunks, dim=1, out=out)  # still usable afterwards
        np.testing.assert_array_equal(out.numpy(), np.concatenate([x, x], 1))
    """)
    env = dict(os.environ, DPMINI_EMULATE_PEER="0",  # no peer access: pack, copy, unpack
               PYTHONPATH=os.path.dirname(os.path.dirname(os.path.abspath(dpmini.__file__))))
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                       timeout=120, cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert "freed_while_queued 0" in r.stdout, r.stdout


# ---- a failed stream request leaves nothing to sync ----

@emulated
@pytest.mark.parametrize("direction", ["to_device", "to_host"])
def test_failed_staging_stream_request_syncs_only_obtained_streams(direction):
    x = np.arange(100000.0)  # pageable host memory: staged through pinned halves
    a = dpmini.asarray(x, 0)
    before = _testing.emu_stats()["bad_stream_handles"]
    _testing.emu_fail_stream_get(13)  # the second staging half's stream (DP_STAGE_SLOT + 1)
    with pytest.raises(dpmini.CudaError) as e:
        if direction == "to_device":
            dpmini.asarray(x, 0)
        else:
            a.numpy()
    assert e.value.status == 1
    assert _testing.emu_stats()["bad_stream_handles"] == before
    np.testing.assert_array_equal(dpmini.asarray(x, 0).numpy(), x)  # usable afterwards


# ---- concurrent collectives on overlapping device lists ----

@two_gpus
@emulated
def test_concurrent_collectives_on_crossed_device_lists_run_one_at_a_time():
    import threading
    was = _testing.emulated_nccl(1)
    try:
        x = np.arange(64, dtype="float32")
        before = _testing.emu_stats()["nccl_crossed"]
        errors = []

        def work(devs):
            try:
                src = dpmini.asarray(x, devs[0])
                for _ in range(60):
                    outs = dpmini.comm.broadcast(src, devs)
                    parts = [dpmini.asarray(x, d) for d in devs]
                    r = dpmini.comm.reduce_add(parts, destination=devs[0])
                np.testing.assert_array_equal(outs[1].numpy(), x)
                np.testing.assert_array_equal(r.numpy(), 2 * x)
            except BaseException as e:  # reported by the main thread
                errors.append(e)

        ts = [threading.Thread(target=work, args=(d,)) for d in ([0, 1], [1, 0])]
        for t in ts:
            t.start()
        for t in ts:
            t.join(120)
        assert not any(t.is_alive() for t in ts)
        assert not errors, errors
        assert _testing.emu_stats()["nccl_crossed"] == before
    finally:
        _testing.emulated_nccl(1 if was else 0)


# ---- a collective that never finishes does not hang the caller ----

_HUNG = textwrap.dedent("""
    import signal, sys
    import numpy as np, dpmini
    from dpmini import _testing
    _testing.emulated_nccl(1)
    x = np.arange(32.0)
    src = dpmini.asarray(x, 0)
    dpmini.comm.broadcast(src, [0, 1])  # communicators made and cached
    aborted = _testing.cuda_debug()["nccl_aborted"]
    mode = sys.argv[1]
    if mode == "signal":
        def on_alarm(*a):
            raise KeyboardInterrupt
        signal.signal(signal.SIGALRM, on_alarm)
        signal.setitimer(signal.ITIMER_REAL, 0.3)
    _testing.emu_nccl_hang(1 if mode == "async_error" else 2)
    try:
        dpmini.comm.broadcast(src, [0, 1])
    except BaseException as e:
        print("raised", type(e).__name__, str(e).replace("\\n", " "))
    else:
        print("no error")
    print("aborted", _testing.cuda_debug()["nccl_aborted"] - aborted)
    outs = dpmini.comm.broadcast(src, [0, 1])  # new communicators work
    np.testing.assert_array_equal(outs[1].numpy(), x)
    print("usable")
""")


@two_gpus
@emulated
@pytest.mark.parametrize("mode, expect", [
    ("async_error", "raised NcclError .*ncclCommGetAsyncError"),
    ("timeout", "raised CudaError .*DPMINI_NCCL_TIMEOUT"),
    ("signal", "raised KeyboardInterrupt"),
])
def test_a_collective_that_never_finishes_is_aborted(mode, expect, tmp_path):
    import re
    env = dict(os.environ, DPMINI_NCCL_TIMEOUT="1" if mode == "timeout" else "60",
               PYTHONPATH=os.path.dirname(os.path.dirname(os.path.abspath(dpmini.__file__))))
    r = subprocess.run([sys.executable, "-c", _HUNG, mode], env=env, capture_output=True,
                       text=True, timeout=60, cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert re.search(expect, r.stdout), r.stdout
    assert "aborted 1" in r.stdout and "usable" in r.stdout, r.stdout


# ---- a driver older than the runtime is reported, not hidden ----

_OLD_DRIVER = textwrap.dedent("""
    import io, warnings
    import numpy as np, dpmini
    from dpmini.__main__ import main
    info = dpmini._dpmini.cuda_build_info()
    print("count:", dpmini.device_count())
    print("unusable:", info["cuda_unusable"])
    if dpmini.device_count():
        raise SystemExit(0)
    try:
        dpmini.asarray(np.ones(3), 0)
    except ValueError as e:
        print("asarray:", e)
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        dp = dpmini.DataParallel(lambda x: x * 2)
    print("warned:", [str(m.message) for m in w if m.category is RuntimeWarning])
    np.testing.assert_array_equal(dp(np.arange(4.0)), 2 * np.arange(4.0))  # still runs, on CPU
    out = io.StringIO()
    main(["info"], out)
    print("info:", out.getvalue().replace("\\n", " | "))
""")


@emulated
@pytest.mark.parametrize("driver_error", ["35", ""])
def test_a_driver_older_than_the_runtime_is_reported(driver_error, tmp_path):
    env = dict(os.environ, DPMINI_EMULATE_DRIVER_ERROR=driver_error,
               PYTHONPATH=os.path.dirname(os.path.dirname(os.path.abspath(dpmini.__file__))))
    r = subprocess.run([sys.executable, "-c", _OLD_DRIVER], env=env, capture_output=True,
                       text=True, timeout=120, cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    lines = dict(line.split(": ", 1) for line in r.stdout.splitlines() if ": " in line)
    if not driver_error:  # the emulator's two GPUs work: nothing to report
        assert lines["count"] == "2" and lines["unusable"] == "", r.stdout
        return
    why = "driver (CUDA 12.2) is older than the CUDA runtime dpmini was built with (13.0)"
    assert why in lines["unusable"]
    assert "CUDA device 0 requested, but CUDA is unusable" in lines["asarray"]
    assert why in lines["asarray"]
    assert "virtual CPU devices" in lines["warned"] and why in lines["warned"]
    assert "CUDA UNUSABLE" in lines["info"] and "driver 12.2" in lines["info"]


# ---- no stream sync with the GIL held, small copies included ----

@two_gpus
@emulated
def test_small_copies_wait_on_streams_without_the_gil():
    x = sample((6, 4), "float32")  # far below the 256 KiB inline threshold
    before = _testing.emu_stats()["syncs_with_gil"]
    a = dpmini.asarray(x, 0)
    b = dpmini.asarray(a, 1)
    t = dpmini.asarray(x.T, 0)  # strided source: staged through pinned halves
    g = dpmini.comm.gather(dpmini.comm.scatter(a, [0, 1]), destination=0)
    np.testing.assert_array_equal(b.numpy(), x)
    np.testing.assert_array_equal(t.numpy(), x.T)
    np.testing.assert_array_equal(g.numpy(), x)
    assert _testing.emu_stats()["syncs_with_gil"] == before


# ---- one-GPU DataParallel runs the module with its GPU current ----

@two_gpus
def test_one_gpu_dataparallel_runs_the_module_with_its_gpu_current():
    start = cuda_debug()["current_device"]
    other = 1 if start != 1 else 0
    seen = []

    def module(x):
        seen.append(cuda_debug()["current_device"])
        return x

    x = sample((4, 2), "float32")
    for devs in ([other], [other, other]):
        seen.clear()
        r = dpmini.DataParallel(module, device_ids=devs, output_device="cpu")(x)
        np.testing.assert_array_equal(dpmini.asarray(r).numpy() if not isinstance(r, np.ndarray)
                                      else r, x)
        assert seen and set(seen) == {other}, (devs, seen)
        assert cuda_debug()["current_device"] == start


# ---- the GPU block cache is bounded (size classes, peak + slack) ----

def test_gpu_block_cache_stays_bounded_over_many_sizes(tmp_path):
    # a fresh process: the bound follows the process's peak allocation
    code = textwrap.dedent("""
        import dpmini
        step = 256 << 10
        for k in range(1, 161):  # 160 distinct sizes up to 40 MiB, each freed at once
            a = dpmini.empty((k * step,), "uint8", device="cuda:0")
            del a
        print(dpmini.memory_reserved("cuda:0") - dpmini.memory_allocated("cuda:0"))
    """)
    env = dict(os.environ,
               PYTHONPATH=os.path.dirname(os.path.dirname(os.path.abspath(dpmini.__file__))))
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                       timeout=120, cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    cached = int(r.stdout)
    # an exact-size, unbounded cache would hold all of them (~3.1 GiB); the
    # bound is the peak (one 40 MiB block, rounded up to its class) + 32 MiB
    assert cached <= (160 << 18) * 5 // 4 + (32 << 20), cached


# ---- a fresh thread's current device survives dpmini's guard ----

@two_gpus
def test_fresh_thread_keeps_its_current_device_after_work_on_another_gpu():
    import threading
    seen = {}

    def work():
        seen["before"] = cuda_debug()["current_device"]
        a = dpmini.asarray(np.arange(6.0), 1)
        np.testing.assert_array_equal(a.numpy(), np.arange(6.0))
        seen["after"] = cuda_debug()["current_device"]

    t = threading.Thread(target=work)
    t.start()
    t.join(60)
    assert seen["after"] == seen["before"], seen


# ---- on hardware: PyTorch's expandable segments are VMM memory ----

@two_gpus
@pytest.mark.skipif(EMULATED, reason="needs PyTorch on real GPUs (the emulator's "
                    "emu_nopeer_alloc covers it above)")
def test_strided_copy_from_torch_expandable_segments(tmp_path):
    pytest.importorskip("torch")
    code = textwrap.dedent("""
        import numpy as np, torch, dpmini
        assert torch.cuda.device_count() >= 2
        t = torch.arange(24.0, device="cuda:0").reshape(4, 6).t()  # strided, VMM-backed
        b = dpmini.asarray(t, 1)
        np.testing.assert_array_equal(b.numpy(), np.arange(24.0).reshape(4, 6).T)
        print("ok")
    """)
    env = dict(os.environ, PYTORCH_CUDA_ALLOC_CONF="expandable_segments:True",
               PYTHONPATH=os.path.dirname(os.path.dirname(os.path.abspath(dpmini.__file__))))
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                       timeout=120, cwd=tmp_path)
    assert r.returncode == 0 and "ok" in r.stdout, r.stderr


# ---- float16 reduce_add on GPUs (kernel / NCCL), rounded as NumPy ----

@pytest.mark.parametrize("devs", [[0, 0, 0], [0, 1]], ids=str)
def test_float16_reduce_add_on_gpus_rounds_like_numpy(devs):
    if max(devs) >= dpmini.device_count():
        pytest.skip("needs 2 CUDA devices")
    rng = np.random.default_rng(5)
    xs = [(rng.standard_normal((64, 33)) * 10 ** rng.uniform(-3, 3, (64, 33))).astype("float16")
          for _ in devs]
    want = xs[0].copy()
    for x in xs[1:]:
        want += x  # NumPy: each add in float, rounded once to half
    r = dpmini.comm.reduce_add([dpmini.asarray(x, d) for x, d in zip(xs, devs)],
                               destination=devs[0])
    assert r.dtype == np.float16
    np.testing.assert_array_equal(r.numpy().view("uint16"), want.view("uint16"))
