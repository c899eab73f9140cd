"""A device has more than one worker thread to wait on: a replica that hands work
to a helper thread does not deadlock, and replicas on a repeated device run
concurrently (in a subprocess with a timeout)."""

import numpy as np

import dpmini
from script_runner import run_script


# --- a device has more than one thread to wait on -----------------------

def test_replica_handing_work_to_a_helper_thread_does_not_deadlock():
    run_script("""
        import numpy as np, dpmini
        from concurrent.futures import ThreadPoolExecutor
        ex = ThreadPoolExecutor(1)
        big = np.ones(100000)               # > 256 KiB: goes to the device workers
        def replica(x):
            f = ex.submit(dpmini.comm.broadcast, big, ["cpu:0", "cpu:1"])
            return x + f.result()[1][:1]
        y = dpmini.DataParallel(replica, ["cpu:0", "cpu:1"])(np.ones(4))
        assert np.array_equal(y, np.full(4, 2.0)), y
        print("OK")
    """, timeout=30)


def test_replicas_on_a_repeated_device_run_concurrently():
    run_script("""
        import threading, numpy as np, dpmini
        barrier = threading.Barrier(2, timeout=10)   # each replica waits for the other
        def replica(x):
            barrier.wait()
            return x * 2
        y = dpmini.DataParallel(replica, ["cpu:0", "cpu:0"])(np.arange(4.0))
        assert np.array_equal(y, np.arange(4.0) * 2), y
        print("OK")
    """, timeout=30)
