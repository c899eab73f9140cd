"""More than 64 replicas on one device that wait on each other: the device's
pool grows to one thread per replica (pool.h, up to DP_POOL_MAX_THREADS =
1024), so the replicas all run at once and a barrier among them completes;
past the limit the call is refused up front with a RuntimeError that says
why. Each check runs in a subprocess with a timeout (a deadlock fails it)."""
import subprocess
import sys
import textwrap

import pytest

TIMEOUT = 120


def run_script(body):
    code = textwrap.dedent(body)
    try:
        res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                             timeout=TIMEOUT)
    except subprocess.TimeoutExpired:
        pytest.fail(f"deadlock: the script did not finish in {TIMEOUT}s")
    assert res.returncode == 0, res.stdout + res.stderr
    return res.stdout.split()


@pytest.mark.parametrize("n", [65, 100])
def test_replicas_waiting_on_each_other_on_one_device_all_run(n):
    out = run_script(f"""
        import threading
        import numpy as np
        import dpmini

        N = {n}
        bar = threading.Barrier(N, timeout=60)   # a deadlock breaks it instead of hanging

        def replica(x):
            bar.wait()
            return x + 1

        dp = dpmini.DataParallel(replica, device_ids=["cpu:0"] * N)
        out = dp(np.arange(N, dtype=np.int64))
        print(out.tolist() == list(range(1, N + 1)), bar.broken)
    """)
    assert out == ["True", "False"]


def test_parallel_apply_with_many_waiting_replicas_on_one_device():
    out = run_script("""
        import threading
        import numpy as np
        import dpmini

        N = 100
        bar = threading.Barrier(N, timeout=60)

        def f(i):
            bar.wait()
            return i * 3

        res = dpmini.parallel_apply([f] * N, [(i,) for i in range(N)], devices=["cpu:0"] * N)
        print(res == [3 * i for i in range(N)])
    """)
    assert out == ["True"]


def test_more_replicas_on_one_device_than_threads_are_refused_up_front():
    out = run_script("""
        import dpmini

        ran = []
        N = 1025
        try:
            dpmini.parallel_apply([ran.append] * N, [(i,) for i in range(N)],
                                  devices=["cpu:3"] * N)
        except RuntimeError as e:
            print("RuntimeError|" + str(e))
        print("ran|%d" % len(ran))
    """)
    text = " ".join(out)
    assert text.startswith("RuntimeError|parallel_apply: more than 1024 replicas on device cpu:3")
    assert "(replica 1024 is one too many)" in text
    assert "at most 1024 threads" in text
    assert out[-1] == "ran|0"   # refused before any replica started
