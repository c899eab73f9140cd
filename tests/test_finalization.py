"""Calls made during interpreter finalization (sys.is_finalizing() true, e.g.
from a __del__ run at exit): parallel_apply and DataParallel raise
RuntimeError at once instead of hanging (a worker thread that takes the GIL
then is stopped by CPython for good), as concurrent.futures refuses new work
after shutdown; comm calls, whose worker jobs never take the GIL, still work.
Each check runs in a subprocess with a timeout, so a hang fails the test."""
import subprocess
import sys
import textwrap

import pytest

TIMEOUT = 60


def run_at_exit(call_src):
    """Run call_src (an expression using `obj`) from a __del__ at exit and
    return the lines the script printed."""
    code = textwrap.dedent("""
        import sys
        import numpy as np
        import dpmini
        from dpmini import comm

        class Model:
            def __call__(self, x):
                return x * 2

        class AtExit:
            def __init__(self):
                self.dp = dpmini.DataParallel(Model(), device_ids=["cpu:0", "cpu:1"])
                self.np, self.dpmini, self.comm, self.sys = np, dpmini, comm, sys
                self.x = np.arange(8.0)
                self.big = np.arange(2_000_000.0)   # large enough for the worker threads

            def __del__(self):
                obj, np, sys = self, self.np, self.sys
                fin = sys.is_finalizing()
                try:
                    res = CALL
                    print("RESULT ok", fin, res, flush=True)
                except RuntimeError as e:
                    print("RESULT RuntimeError", fin, e, flush=True)

        # warm the workers up first, so that they exist when finalization starts
        holder = AtExit()
        holder.dp(holder.x)
        print("READY", sys.is_finalizing(), flush=True)
    """).replace("CALL", call_src)
    try:
        res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                             timeout=TIMEOUT)
    except subprocess.TimeoutExpired:
        pytest.fail(f"hang: the call made during finalization did not return in {TIMEOUT}s")
    assert res.returncode == 0, res.stdout + res.stderr
    lines = res.stdout.splitlines()
    assert lines[0] == "READY False", res.stdout + res.stderr
    return [ln for ln in lines if ln.startswith("RESULT")], res


@pytest.mark.parametrize("call", [
    "obj.dp(obj.x)",
    "obj.dpmini.parallel_apply([lambda v: v, lambda v: v], [(obj.x,), (obj.x,)],"
    " devices=['cpu:0', 'cpu:1'])",
])
def test_replicas_during_finalization_raise_runtime_error(call):
    results, res = run_at_exit(call)
    assert len(results) == 1, res.stdout + res.stderr
    words = results[0].split(" ", 3)
    assert words[1:3] == ["RuntimeError", "True"], results
    assert "interpreter shutdown" in words[3] and "sys.is_finalizing()" in words[3], results


def test_one_replica_during_finalization_runs_inline():
    # A single replica runs in the calling thread (no worker): it still works.
    results, res = run_at_exit("obj.dpmini.parallel_apply([lambda v: v * 2],"
                               " [(obj.x,)], devices=['cpu:0'])[0].tolist()")
    want = [2.0 * i for i in range(8)]
    assert results == [f"RESULT ok True {want}"], res.stdout + res.stderr


def test_comm_during_finalization_still_copies():
    # comm's copies run on the workers without the GIL: they finish normally.
    results, res = run_at_exit("[(float(p[0]), float(p[-1]), len(p)) for p in"
                               " obj.comm.scatter(obj.big, ['cpu:0', 'cpu:1'])]")
    want = [(0.0, 999_999.0, 1_000_000), (1_000_000.0, 1_999_999.0, 1_000_000)]
    assert results == [f"RESULT ok True {want}"], res.stdout + res.stderr
