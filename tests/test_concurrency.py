"""Threads, nesting and fork: each check runs in a subprocess with a timeout, so
a deadlock fails the test instead of hanging the suite (STYLE: race tests in a
subprocess with a timeout). Arrays are large enough to use the device worker
threads rather than the inline copy path."""
from script_runner import run_script as run_with_timeout

TIMEOUT = 120


def run_script(body):
    run_with_timeout(body, timeout=TIMEOUT)


def test_many_python_threads_call_dataparallel_at_once():
    run_script("""
        import threading
        import numpy as np
        import dpmini

        D = ["cpu:0", "cpu:1", "cpu:2"]
        errors = []

        def worker(seed):
            try:
                rng = np.random.default_rng(seed)
                dp = dpmini.DataParallel(lambda x, *, s: x * s, device_ids=D)
                for _ in range(100):
                    x = rng.standard_normal((int(rng.integers(1, 40)), 2000))
                    out = dp(x, s=np.full((x.shape[0], 1), 2.0))
                    assert np.array_equal(out, x * 2.0)
            except BaseException as e:  # noqa: BLE001
                errors.append(repr(e))

        ts = [threading.Thread(target=worker, args=(i,)) for i in range(8)]
        for t in ts:
            t.start()
        for t in ts:
            t.join()
        assert not errors, errors
        print("OK")
    """)


def test_comm_calls_inside_a_replica_on_the_same_devices():
    run_script("""
        import numpy as np
        import dpmini
        from dpmini import comm

        D = ["cpu:0", "cpu:1"]
        big = np.ones((1000, 1000))

        def f(x):
            here = str(dpmini.device_of(x))
            chunks = comm.scatter(big, D)
            g = comm.gather(chunks, destination=here)
            b = comm.broadcast(g, D)
            r = comm.reduce_add(list(b), destination=here)
            return x + r.sum()

        out = dpmini.DataParallel(f, device_ids=D)(np.zeros(4))
        assert np.array_equal(out, np.full(4, 2e6)), out
        print("OK")
    """)


def test_nested_dataparallel_inside_a_replica():
    run_script("""
        import numpy as np
        import dpmini

        D = ["cpu:0", "cpu:1"]

        def outer(x):
            inner = dpmini.DataParallel(lambda y: y * 2, device_ids=D)
            r = inner(np.ones((1000, 200)))
            return x + r[: x.shape[0], 0]

        out = dpmini.DataParallel(outer, device_ids=D)(np.zeros(4))
        assert np.array_equal(out, np.full(4, 2.0)), out
        print("OK")
    """)


def test_replica_exception_with_pending_copies_does_not_hang():
    run_script("""
        import numpy as np
        import dpmini

        D = ["cpu:0", "cpu:1", "cpu:2"]

        def f(x):
            if str(dpmini.device_of(x)) == "cpu:1":
                raise ValueError("fail")
            return x * 1

        dp = dpmini.DataParallel(f, device_ids=D)
        for _ in range(20):
            try:
                dp(np.ones((3000, 500)))
            except ValueError as e:
                assert "replica 1 on device cpu:1" in str(e)
            else:
                raise AssertionError("no error")
        out = dpmini.DataParallel(lambda x: x, device_ids=D)(np.ones((3000, 500)))
        assert out.shape == (3000, 500)
        print("OK")
    """)


def test_fork_after_use():
    run_script("""
        import multiprocessing as mp
        import numpy as np
        import dpmini

        D = ["cpu:0", "cpu:1", "cpu:2"]
        # start the device workers in the parent
        dpmini.DataParallel(lambda x: x, device_ids=D)(np.zeros((6, 1000)))

        def child(q):
            out = dpmini.DataParallel(lambda x: x + 1, device_ids=D)(np.zeros((6, 100000)))
            q.put(float(out.sum()))

        ctx = mp.get_context("fork")
        q = ctx.Queue()
        p = ctx.Process(target=child, args=(q,))
        p.start()
        p.join(60)
        assert p.exitcode == 0, p.exitcode
        assert q.get(timeout=5) == 600000.0
        # the parent still works
        out = dpmini.DataParallel(lambda x: x * 3, device_ids=D)(np.ones((6, 1000)))
        assert out.sum() == 18000
        print("OK")
    """)


def test_module_releases_gil_work_runs_concurrently():
    # replicas that wait on each other can only finish if they run at the same time
    run_script("""
        import threading
        import numpy as np
        import dpmini

        D = ["cpu:0", "cpu:1", "cpu:2", "cpu:3"]
        barrier = threading.Barrier(4, timeout=30)

        def f(x):
            barrier.wait()
            return x * 2

        for _ in range(5):
            barrier.reset()
            out = dpmini.DataParallel(f, device_ids=D)(np.arange(400.0).reshape(4, 100))
            assert np.array_equal(out, np.arange(400.0).reshape(4, 100) * 2)
        print("OK")
    """)


def test_keyboard_interrupt_while_waiting_for_replicas():
    # the caller's wait must be interruptible: the replicas poll (in Python code) until
    # told to stop, for at most 60 s; `capped` would be set if the interrupt only came
    # after they ran to the end
    run_script("""
        import signal
        import threading
        import time
        import numpy as np
        import dpmini

        D = ["cpu:0", "cpu:1"]
        stop = threading.Event()
        capped = threading.Event()

        def f(x):
            for _ in range(6000):
                if stop.is_set():
                    return x
                time.sleep(0.01)
            capped.set()
            return x

        def alarm(*args):
            raise KeyboardInterrupt

        signal.signal(signal.SIGALRM, alarm)
        signal.setitimer(signal.ITIMER_REAL, 0.5)
        try:
            dpmini.DataParallel(f, device_ids=D)(np.zeros(4))
        except KeyboardInterrupt:
            assert not capped.is_set()
        else:
            raise AssertionError("no KeyboardInterrupt")
        stop.set()
        out = dpmini.DataParallel(lambda x: x + 1, device_ids=D)(np.zeros(4))
        assert np.array_equal(out, np.ones(4))
        print("OK")
    """)


def test_eight_threads_share_one_dataparallel_1000_calls_each():
    # issue "Reliability" item 5: one DataParallel object, 8 threads, 1,000 calls each,
    # every result exact. Sizes alternate between the inline copy path (< 256 KiB)
    # and the worker-thread path; kwargs are scattered too. Device objects and the
    # comm functions are shared by all threads as well.
    run_script("""
        import threading
        import numpy as np
        import dpmini
        from dpmini import comm

        D = [dpmini.Device(f"cpu:{i}") for i in range(3)]   # shared Device objects
        dp = dpmini.DataParallel(lambda x, *, s: {"y": x * s, "tag": "same"}, device_ids=D)
        shared = np.arange(6000.0).reshape(60, 100)
        errors = []
        start = threading.Barrier(8)

        def worker(seed):
            try:
                rng = np.random.default_rng(seed)
                start.wait()
                for i in range(1000):
                    rows = int(rng.integers(1, 40))
                    cols = 1000 if i % 4 == 0 else 8
                    x = rng.standard_normal((rows, cols))
                    s = rng.standard_normal((rows, 1))
                    out = dp(x, s=s)
                    assert np.array_equal(out["y"], x * s)
                    if i % 50 == 0:
                        g = comm.gather(comm.scatter(shared, D), destination=D[seed % 3])
                        assert np.array_equal(g, shared)
                        assert np.array_equal(comm.reduce_add(list(comm.broadcast(shared, D))), shared * 3)
            except BaseException as e:  # noqa: BLE001
                errors.append(repr(e))

        ts = [threading.Thread(target=worker, args=(i,)) for i in range(8)]
        for t in ts:
            t.start()
        for t in ts:
            t.join()
        assert not errors, errors[:3]
        print("OK")
    """)


def test_replacing_module_and_device_ids_during_calls():
    # bug 8 (docs/reliability.md): forward used a borrowed module and the object's own
    # device array while the GIL was released, so setting dp.module / dp.device_ids from
    # another thread (or from a replica) freed them under it: a crash. Also the subclass
    # path and the scatter / parallel_apply methods.
    run_script("""
        import threading
        import numpy as np
        import dpmini

        D = ["cpu:0", "cpu:1", "cpu:2"]

        class Sub(dpmini.DataParallel):
            pass

        big = np.ones((600, 1000))
        for cls in (dpmini.DataParallel, Sub):
            dp = cls(lambda x: x * 2, device_ids=D)
            stop = threading.Event()

            def setter():
                while not stop.is_set():
                    dp.device_ids = list(D)
                    dp.module = eval("lambda x: x * 2")   # a fresh object: the old one dies

            t = threading.Thread(target=setter)
            t.start()
            try:
                for _ in range(40):
                    out = dp(big)
                    assert out.shape == big.shape and out[0, 0] == 2.0 and out[-1, -1] == 2.0
                    ins, kws = dp.scatter((big,), {})
                    assert len(ins) == 3
                    outs = dp.parallel_apply([lambda x: x] * 3, ins, kws)
                    assert sum(o.shape[0] for o in outs) == 600
            finally:
                stop.set()
                t.join()

        # a replica that replaces them itself
        def m(x):
            dp.device_ids = ["cpu:3", "cpu:4"]
            dp.module = eval("lambda x: x")
            return x + 1

        for _ in range(20):
            dp = dpmini.DataParallel(m, device_ids=D)
            assert np.array_equal(dp(big), big + 1)
        print("OK")
    """)
