"""Fault injection (issue "Reliability", item 6): replicas that raise at every
position, replicas that return wrong shapes or types, Ctrl-C during a long
replica, and an allocation failure at every allocation of a call.

After each fault: the right exception, nothing leaked (device memory back to
its baseline, reference counts unchanged) and the next call works and is
exact. tests/test_exceptions.py checks the exception text itself;
tests/test_concurrency.py the first KeyboardInterrupt case.

The allocation hook is _testing.fail_alloc_after(n): n more device
allocations succeed, the next one fails as if the system were out of memory
(csrc/py/host_memory.c raw_alloc; docs/reliability.md).
"""
import gc
import subprocess
import sys
import textwrap

import numpy as np
import pytest

import dpmini
from dpmini import _testing, comm

D4 = ["cpu:0", "cpu:1", "cpu:2", "cpu:3"]
D8 = [f"cpu:{i}" for i in range(8)]
ALL = ["cpu"] + [f"cpu:{i}" for i in range(8)]
# 512 KiB: above the inline threshold, so copies run on the worker threads
BIG = np.arange(512 * 128, dtype=np.float64).reshape(512, 128)


def device_bytes():
    return [dpmini.memory_allocated(d) for d in ALL]


@pytest.fixture(autouse=True)
def hook_off():
    _testing.fail_alloc_after(-1)
    yield
    _testing.fail_alloc_after(-1)


# ------------------------------------------------------- replicas that raise

@pytest.mark.parametrize("k", [2, 8])
def test_replica_raises_at_every_position_then_recovers(k):
    devices = D8[:k]
    x = BIG[: 8 * k]
    rows = len(x) // k

    def model(a, *, scale):
        pos = int(a[0, 0]) // (rows * 128)
        if pos in fail:
            raise ArithmeticError(f"replica {pos} failed")
        return a * scale

    dp = dpmini.DataParallel(model, device_ids=devices)
    scale = np.full((len(x), 1), 2.0)
    fail = set()
    np.testing.assert_array_equal(dp(x, scale=scale), x * 2)
    gc.collect()
    base, refs = device_bytes(), (sys.getrefcount(x), sys.getrefcount(scale), sys.getrefcount(model))
    for pos in range(k):
        for fail in ({pos}, set(range(pos, k))):
            with pytest.raises(ArithmeticError, match=rf"Caught ArithmeticError in replica {pos} on device cpu:{pos}\."):
                dp(x, scale=scale)
        fail = set()
        np.testing.assert_array_equal(dp(x, scale=scale), x * 2)
    gc.collect()
    assert device_bytes() == base
    assert (sys.getrefcount(x), sys.getrefcount(scale), sys.getrefcount(model)) == refs


# -------------------------------------------- replicas returning wrong things

WRONG_OUTPUTS = [
    (lambda a: a[:, :1], ValueError),            # wrong shape
    (lambda a: a[..., None], ValueError),        # wrong rank
    (lambda a: None, TypeError),
    (lambda a: [a], TypeError),
    (lambda a: {"x": a}, TypeError),
    (lambda a: "text", TypeError),
    (lambda a: np.empty(a.shape, dtype=object), TypeError),
    (lambda a: np.array(1.0), ValueError),       # 0-dim among 2-dim
]


@pytest.mark.parametrize("bad_pos", [0, 3])
def test_wrong_outputs_raise_and_leave_nothing_behind(bad_pos):
    x = BIG[:64]

    def model(a):
        if int(a[0, 0]) == bad_pos * 16 * 128:
            return wrong(a)
        return a + 1

    dp = dpmini.DataParallel(model, device_ids=D4)
    wrong = WRONG_OUTPUTS[0][0]
    with pytest.raises(ValueError):
        dp(x)
    gc.collect()
    base, ref = device_bytes(), sys.getrefcount(x)
    for wrong, exc in WRONG_OUTPUTS:
        with pytest.raises(exc, match=r"^out"):
            dp(x)
    gc.collect()
    assert device_bytes() == base
    assert sys.getrefcount(x) == ref
    np.testing.assert_array_equal(dpmini.DataParallel(lambda a: a + 1, device_ids=D4)(x), x + 1)


# ------------------------------------------------------------ Ctrl-C

def test_ctrl_c_during_long_replicas_ends_promptly_and_workers_recover():
    code = textwrap.dedent("""
        import os, signal, threading, time
        import numpy as np
        import dpmini

        D = ["cpu:0", "cpu:1", "cpu:2"]
        big = np.ones((3000, 200))
        base = [dpmini.memory_allocated(d) for d in D]
        stop = threading.Event()

        def long_replica(x):
            # a long computation that checks for cancellation between steps
            t = time.monotonic()
            while not stop.is_set() and time.monotonic() - t < 60:
                np.sqrt(x[:10])
            return x

        dp = dpmini.DataParallel(long_replica, device_ids=D)
        for round in range(3):
            stop.clear()
            threading.Timer(0.3, os.kill, (os.getpid(), signal.SIGINT)).start()
            t0 = time.monotonic()
            try:
                dp(big)
            except KeyboardInterrupt:
                pass
            else:
                raise AssertionError("no KeyboardInterrupt")
            waited = time.monotonic() - t0
            assert waited < 5, waited        # promptly: not after the replicas' 60 s
            stop.set()                       # the replicas notice and return
            # the same workers run the next calls, on the copy threads too
            for _ in range(5):
                out = dpmini.DataParallel(lambda x: x * 2, device_ids=D)(big)
                assert np.array_equal(out, big * 2)
            del out
        import gc; gc.collect()
        time.sleep(0.2)
        gc.collect()
        assert [dpmini.memory_allocated(d) for d in D] == base, ([dpmini.memory_allocated(d) for d in D], base)
        print("OK")
    """)
    try:
        res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    except subprocess.TimeoutExpired:
        pytest.fail("hang: Ctrl-C did not end the call, or the workers did not recover")
    assert res.returncode == 0 and res.stdout.strip().endswith("OK"), res.stdout + res.stderr


# --------------------------------------------------- allocation failures

class Net:
    """A module that owns arrays (so replicate allocates too)."""

    def __init__(self):
        self.w = np.full(128, 0.5)
        self.layers = [{"b": np.ones(128)}]

    def __call__(self, x, pair, *, opts):
        return {"y": x * self.w + self.layers[0]["b"] + pair[0], "z": opts["s"] * pair[1]}


def every_allocation_fails_once(call, check, watched, limit=200):
    """Make allocation 0, 1, 2, ... of `call` fail in turn until a call runs
    without reaching the failure. Each failure must be a MemoryError that
    leaks nothing; the call after it must work. Returns the number of
    allocation points found."""
    check(call())
    gc.collect()
    base = device_bytes()
    refs = [sys.getrefcount(o) for o in watched]
    for n in range(limit):
        _testing.fail_alloc_after(n)
        try:
            result = call()
        except MemoryError as e:
            assert "cannot allocate" in str(e)
            assert _testing.fail_alloc_after(-1) == -1   # the injected failure is what fired
            gc.collect()
            assert device_bytes() == base, f"allocation {n}: device memory leaked"
            refs_now = [sys.getrefcount(o) for o in watched]
            assert refs_now == refs, f"allocation {n}: reference counts changed"
            check(call())   # the next call works
            continue
        assert _testing.fail_alloc_after(-1) >= 0   # finished before reaching the failure
        check(result)
        del result
        gc.collect()
        assert device_bytes() == base
        return n
    pytest.fail(f"more than {limit} allocations")


@pytest.mark.slow  # ~50 s: one whole call per allocation point
def test_allocation_failure_at_every_point_of_a_dataparallel_call():
    x = BIG[:256, :]
    x = np.ascontiguousarray(x[:, :128])
    p0, p1 = x * 2, np.arange(256.0).reshape(256, 1)
    s = np.full((256, 1), 3.0)
    net = Net()
    dp = dpmini.DataParallel(net, device_ids=D4, output_device="cpu:2")

    def check(out):
        np.testing.assert_array_equal(out["y"], x * 0.5 + 1 + p0)
        np.testing.assert_array_equal(out["z"], s * p1)

    points = every_allocation_fails_once(lambda: dp(x, (p0, p1), opts={"s": s}), check,
                                         [x, p0, p1, s, net, net.w, dp])
    assert points >= 20   # scatter (4 leaves x 3 copies), replicate, gather


COMM_CALLS = {
    "scatter": (lambda: comm.scatter(BIG, D4), lambda r: np.testing.assert_array_equal(np.concatenate(r), BIG)),
    "scatter-dim1-sizes": (lambda: comm.scatter(BIG, D4, chunk_sizes=[1, 0, 100, 27], dim=1),
                           lambda r: np.testing.assert_array_equal(np.concatenate(r, axis=1), BIG)),
    "gather": (lambda: comm.gather([BIG, BIG[::-1]], dim=1, destination="cpu:3"),
               lambda r: np.testing.assert_array_equal(r, np.concatenate([BIG, BIG[::-1]], axis=1))),
    "broadcast": (lambda: comm.broadcast(BIG, D4), lambda r: [np.testing.assert_array_equal(a, BIG) for a in r]),
    "broadcast_coalesced": (lambda: comm.broadcast_coalesced([BIG, BIG[:3, :5], np.ones(7, np.int8)], D4,
                                                             buffer_size=4096),
                            lambda r: np.testing.assert_array_equal(r[3][1], BIG[:3, :5])),
    "reduce_add": (lambda: comm.reduce_add([BIG, BIG, BIG], destination="cpu:1"),
                   lambda r: np.testing.assert_array_equal(r, BIG * 3)),
    "reduce_add_coalesced": (lambda: comm.reduce_add_coalesced([[BIG, np.ones(5)], [BIG, np.ones(5)]],
                                                               destination="cpu:2", buffer_size=4096),
                             lambda r: np.testing.assert_array_equal(r[0], BIG * 2)),
    "asarray": (lambda: dpmini.asarray(BIG, "cpu:5"), lambda r: np.testing.assert_array_equal(r, BIG)),
}


@pytest.mark.parametrize("name", list(COMM_CALLS))
def test_allocation_failure_at_every_point_of_a_comm_call(name):
    call, check = COMM_CALLS[name]
    assert every_allocation_fails_once(call, check, [BIG]) >= 1


def test_alloc_hook_reports_and_turns_off():
    assert _testing.fail_alloc_after(3) == -1
    assert _testing.fail_alloc_after(-5) == 3
    assert _testing.fail_alloc_after(-1) == -1
    _testing.fail_alloc_after(0)
    with pytest.raises(MemoryError, match="cannot allocate 8 bytes on device cpu:1"):
        dpmini.asarray(np.ones(1), "cpu:1")
    np.testing.assert_array_equal(dpmini.asarray(np.ones(1), "cpu:1"), np.ones(1))
