"""Regression tests for the findings of review 1 (f01-f20), one section per
finding. Crash-prone and thread checks run in a subprocess with a timeout, so
a segfault or a deadlock fails the test instead of killing or hanging the
suite."""
import subprocess
import sys
import textwrap

import numpy as np
import pytest

import dpmini

D2 = ["cpu:0", "cpu:1"]
TIMEOUT = 60


def run_script(body, timeout=TIMEOUT):
    code = textwrap.dedent(body)
    try:
        res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                             timeout=timeout)
    except subprocess.TimeoutExpired:
        pytest.fail(f"deadlock or hang: the script did not finish in {timeout}s")
    assert res.returncode == 0, f"rc {res.returncode}\n" + res.stdout + res.stderr
    assert res.stdout.strip().endswith("OK"), res.stdout + res.stderr
    return res


# --- f01-f03: a call keeps its own module reference and device list ----------

def test_f01_module_reassigned_during_call_keeps_the_old_module():
    run_script("""
        import numpy as np, dpmini
        class Mod:
            def __init__(s): s.w = np.full(3, 2.0)
            def __call__(s, d): return d["x"] * s.w[0]
        dp = dpmini.DataParallel(Mod(), ["cpu:0", "cpu:1"])
        class Sneaky(dict):
            def items(self):
                dp.module = abs                  # drops the last ref to Mod()
                junk = [bytearray(b"\\xff" * 48) for _ in range(1000)]
                return super().items()
        y = dp(Sneaky(x=np.ones((4, 3))))
        assert np.array_equal(y, np.full((4, 3), 2.0)), y
        assert dp.module is abs
        print("OK")
    """)


def test_f02_device_ids_reassigned_during_call_uses_the_old_devices():
    run_script("""
        import numpy as np, dpmini
        seen = []
        class Mod:
            def __init__(s): s.w = np.full(3, 2.0)
            def __call__(s, d):
                seen.append(str(dpmini.device_of(d["x"])))
                return d["x"] * s.w[0]
        dp = dpmini.DataParallel(Mod(), ["cpu:0", "cpu:1"])
        class Sneaky(dict):
            def items(self):
                dp.device_ids = ["cpu:7"]
                junk = [Mod() for _ in range(100)]
                return super().items()
        y = dp(Sneaky(x=np.ones((4, 3))))
        assert np.array_equal(y, np.full((4, 3), 2.0)), y
        assert sorted(seen) == ["cpu:0", "cpu:1"], seen
        assert [str(d) for d in dp.device_ids] == ["cpu:7"]
        print("OK")
    """)


def test_f01_subclass_forward_replicates_the_module_of_call_start():
    run_script("""
        import numpy as np, dpmini
        class DP(dpmini.DataParallel):
            def scatter(self, inputs, kwargs, device_ids):
                self.module = abs                # reassign between the steps
                return super().scatter(inputs, kwargs, device_ids)
            def replicate(self, module, device_ids):
                assert module is not abs
                assert [str(d) for d in device_ids] == ["cpu:0", "cpu:1"], device_ids
                return super().replicate(module, device_ids)
        dp = DP(lambda x: x + 1, ["cpu:0", "cpu:1"])
        assert np.array_equal(dp(np.zeros(4)), np.ones(4))
        print("OK")
    """)


def test_f03_module_hot_swapped_from_another_thread():
    run_script("""
        import numpy as np, dpmini, threading, time
        class Mod:
            def __init__(s, v): s.w = np.full(3, v); s.junk = [np.ones(2) for _ in range(3)]
            def __call__(s, x): return x * s.w[0]
        dp = dpmini.DataParallel(Mod(1.0), ["cpu:0", "cpu:1"])
        x = np.ones((100000, 3))            # > 256 KiB: copies release the GIL
        stop = False
        def caller():
            while not stop:
                dp(x)
        def swapper():
            i = 0
            while not stop:
                i += 1
                dp.module = Mod(float(i))
                dp.device_ids = ["cpu:%d" % (i % 3), "cpu:3"]
        ts = [threading.Thread(target=caller), threading.Thread(target=swapper)]
        [t.start() for t in ts]; time.sleep(1.5); stop = True; [t.join() for t in ts]
        print("OK")
    """)
