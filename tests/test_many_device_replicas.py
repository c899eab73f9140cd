"""parallel_apply on many virtual CPU devices: the replicas' workers are
woken in a chain and a worker that has run its own replica runs the ones
whose workers have not been woken yet (parallel_apply.c, "Chained jobs").
What must hold whatever thread runs a replica: replicas that wait on each
other still all run at once, each replica sees its own device, its own copy
of the caller's contextvars and the caller's torch grad mode, results come
back in replica order, an error names its replica and device, Ctrl-C stops
the call. Each check runs in a subprocess with 64 virtual devices and a
timeout (a deadlock fails the test instead of stalling the suite)."""
import os

from script_runner import run_script

ENV = dict(os.environ, DPMINI_CPU_DEVICES="64")

PRELUDE = """
    import contextvars, os, signal, sys, threading, time
    import numpy as np
    import dpmini

    D = [f"cpu:{i}" for i in range(64)]
    X = np.arange(64.0).reshape(64, 1)
"""


def run(body, timeout=120):
    run_script(PRELUDE + body, env=ENV, timeout=timeout)


def test_64_replicas_waiting_on_one_barrier_all_run():
    # warm (workers spinning) and cold (workers asleep) calls, a device list
    # with a repeated device (two threads of cpu:0), and parallel_apply with
    # one module per replica
    run("""
    for rnd in range(12):
        b = threading.Barrier(64, timeout=30)   # BrokenBarrierError, not a hang
        out = dpmini.DataParallel(lambda x: (b.wait(), x * 2)[1], device_ids=D)(X)
        assert np.array_equal(out, X * 2), rnd
        if rnd % 3 == 2:
            time.sleep(0.05)
    R = ["cpu:0"] * 4 + D[1:61]
    b = threading.Barrier(64, timeout=30)
    out = dpmini.DataParallel(lambda x: (b.wait(), x + 1)[1], device_ids=R)(X)
    assert np.array_equal(out, X + 1)
    b = threading.Barrier(64, timeout=30)
    mods = [(lambda k: lambda x: (b.wait(), x + k)[1])(k) for k in range(64)]
    outs = dpmini.parallel_apply(mods, [(X[k],) for k in range(64)], devices=D)
    assert [float(o[0]) for o in outs] == [2.0 * k for k in range(64)]
    print("OK")
    """)


def test_each_replica_sees_its_device_its_context_copy_and_the_caller_thread_state():
    # per-thread state (as torch's grad mode is) carried by a registered
    # replica context: every replica sees the caller's value although the
    # replicas before it on the same thread set another, and each worker
    # thread has its own value back after the call
    run("""
    tl = threading.local()
    entered = []

    def provider(devices):
        assert len(devices) == 64
        caller = getattr(tl, "mode", "unset")
        def enter(i, device):
            prev = getattr(tl, "mode", "unset")
            tl.mode = caller
            entered.append((i, str(device)))
            def leave():
                tl.mode = prev
            return leave
        return enter
    dpmini.register_replica_context(provider)

    var = contextvars.ContextVar("var", default="unset")
    var.set("caller")
    tl.mode = "caller's"

    seen = {}

    def replica(x):
        k = int(x[0, 0])
        seen[k] = (str(dpmini.device_of(x)), var.get(), tl.mode)
        var.set(f"replica {k}")
        tl.mode = f"replica {k}"
        return x

    for rnd in range(6):
        seen.clear()
        entered.clear()
        out = dpmini.DataParallel(replica, device_ids=D)(X)
        assert np.array_equal(out, X)
        assert seen == {k: (f"cpu:{k}", "caller", "caller's") for k in range(64)}, seen
        assert sorted(entered) == [(k, f"cpu:{k}") for k in range(64)], entered
        assert var.get() == "caller" and tl.mode == "caller's"
        if rnd % 2:
            time.sleep(0.05)
    # each worker thread had "unset" before the first call: so it has now
    back = dpmini.parallel_apply([lambda x: getattr(tl, "mode", "unset")] * 64,
                                 [(X[k],) for k in range(64)], devices=D)
    assert dpmini.unregister_replica_context(provider) is True
    assert dpmini.unregister_replica_context(provider) is False
    after = dpmini.parallel_apply([lambda x: getattr(tl, "mode", "unset")] * 64,
                                  [(X[k],) for k in range(64)], devices=D)
    assert set(back) == {"caller's"} and set(after) == {"unset"}, (back, after)
    print("OK")
    """)


def test_results_in_replica_order_and_error_names_its_replica():
    run("""
    outs = dpmini.parallel_apply([lambda x: x * 3] * 64, [(X[k],) for k in range(64)], devices=D)
    assert [float(o[0]) for o in outs] == [3.0 * k for k in range(64)]
    outs = dpmini.parallel_apply([lambda x: str(dpmini.device_of(x))] * 64,
                                 dpmini.comm.scatter(X, D), devices=D)
    assert outs == D, outs

    def replica(x):
        k = int(x[0, 0])
        if k in (37, 50):
            raise ValueError(f"bad row {k}")
        return x

    for rnd in range(3):
        try:
            dpmini.DataParallel(replica, device_ids=D)(X)
        except ValueError as e:
            assert "in replica 37 on device cpu:37" in str(e), str(e)
            assert "bad row 37" in str(e), str(e)
        else:
            raise AssertionError("no error")
        # the workers are fine afterwards
        assert np.array_equal(dpmini.DataParallel(lambda x: x, device_ids=D)(X), X)
    print("OK")
    """)


def test_nested_call_inside_each_of_64_replicas():
    run("""
    def replica(x):
        inner = dpmini.DataParallel(lambda y: y + 1, device_ids=["cpu:0", "cpu:1"])
        return inner(np.repeat(x, 2, axis=0))[:1] * 10

    out = dpmini.DataParallel(replica, device_ids=D, output_device="cpu:0")(X)
    assert np.array_equal(out, (X + 1) * 10), out
    print("OK")
    """)


def test_two_threads_calling_on_the_same_64_devices():
    # two callers' jobs share the devices' queues (a job not woken yet ahead
    # of another call's job); each call's replicas wait on their own barrier
    run("""
    errors = []

    def caller(seed):
        try:
            for rnd in range(15):
                b = threading.Barrier(64, timeout=30)
                dev = D if seed == 0 else D[::-1]
                out = dpmini.DataParallel(lambda x: (b.wait(), x + seed)[1], device_ids=dev)(X)
                assert np.array_equal(out, X + seed), (seed, rnd)
                plain = dpmini.DataParallel(lambda x: x * 2, device_ids=dev)(X)
                assert np.array_equal(plain, X * 2), (seed, rnd)
                if rnd % 4 == 3:
                    time.sleep(0.02)
        except BaseException as e:
            errors.append(repr(e))

    ts = [threading.Thread(target=caller, args=(s,)) for s in range(2)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    assert not errors, errors
    print("OK")
    """, timeout=180)


def test_ctrl_c_stops_64_busy_replicas_and_the_next_call_is_exact():
    # every replica loops in bytecode until interrupted: the KeyboardInterrupt
    # reaches the thread running it, the replicas not started are skipped
    run("""
    started = []

    def replica(x):
        started.append(int(x[0, 0]))
        end = time.monotonic() + 20
        while time.monotonic() < end:
            time.sleep(0.001)
        return x

    threading.Timer(0.5, os.kill, (os.getpid(), signal.SIGINT)).start()
    t0 = time.monotonic()
    try:
        dpmini.DataParallel(replica, device_ids=D)(X)
    except KeyboardInterrupt:
        waited = time.monotonic() - t0
    else:
        raise AssertionError("no KeyboardInterrupt")
    assert waited < 5, waited
    assert len(started) == len(set(started)) >= 1, started
    for k in range(3):
        out = dpmini.DataParallel(lambda x: x - k, device_ids=D)(X)
        assert np.array_equal(out, X - k)
    print("OK")
    """, timeout=60)


def test_ctrl_c_with_64_replicas_blocked_in_c_calls_then_they_return():
    # every replica blocks in Event.wait (one C call), so all 64 must have
    # started (the chain wakes each worker while the others wait); the call
    # gives up after its grace and leaves them running; when they return
    # (raising the KeyboardInterrupt sent to them), the devices serve the
    # next calls
    run("""
    ev = threading.Event()
    all_started = threading.Event()
    started, finished = [], []
    sent = []

    def replica(x):
        started.append(int(x[0, 0]))
        if len(started) == 64:
            all_started.set()
        try:
            ev.wait()
        finally:
            finished.append(int(x[0, 0]))
        return x

    def interrupt_once_all_started():
        # however slowly the 64 threads start, the interrupt finds them all
        # inside the C call
        all_started.wait(30)
        sent.append(time.monotonic())
        os.kill(os.getpid(), signal.SIGINT)

    threading.Thread(target=interrupt_once_all_started, daemon=True).start()
    try:
        dpmini.DataParallel(replica, device_ids=D)(X)
    except KeyboardInterrupt:
        waited = time.monotonic() - sent[0]
    else:
        raise AssertionError("no KeyboardInterrupt")
    assert waited < 5, waited
    assert sorted(started) == list(range(64)), sorted(started)
    ev.set()
    end = time.monotonic() + 30
    while len(finished) < 64 and time.monotonic() < end:
        time.sleep(0.01)
    assert sorted(finished) == list(range(64)), sorted(finished)
    for k in range(3):
        out = dpmini.DataParallel(lambda x: x + k, device_ids=D)(X)
        assert np.array_equal(out, X + k)
    print("OK")
    """, timeout=90)
