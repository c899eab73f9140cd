"""Environment variables: $DPMINI_CPU_DEVICES (warned about when invalid,
described by `python -m dpmini info`) and $DPMINI_CACHE_LIMIT (caps the
allocator cache)."""
import os
import subprocess
import sys
import warnings

import numpy as np
import pytest

import dpmini
from script_runner import TIMEOUT, run_script


# --- environment variables ----------------------

@pytest.mark.parametrize("value", ["300", "0", "abc", "4x"])
def test_invalid_cpu_devices_env_warns(value):
    res = run_script(f"""
        import os, warnings
        os.environ["DPMINI_CPU_DEVICES"] = {value!r}
        import dpmini
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            n = dpmini.cpu_device_count()
            dp = dpmini.DataParallel(abs)
        msgs = [str(x.message) for x in w if x.category is RuntimeWarning]
        assert len(msgs) == 2, msgs
        assert "DPMINI_CPU_DEVICES={value}" in msgs[0] and f"using {{n}}" in msgs[0], msgs
        assert len(dp.device_ids) == n >= 2
        print("OK")
    """)


def test_valid_cpu_devices_env_is_silent():
    run_script("""
        import os, warnings
        os.environ["DPMINI_CPU_DEVICES"] = "3"
        warnings.simplefilter("error")
        import dpmini
        assert dpmini.cpu_device_count() == 3
        print("OK")
    """)


def test_cache_limit_env_caps_the_cache():
    run_script("""
        import os, warnings
        os.environ["DPMINI_CACHE_LIMIT"] = "0"
        import numpy as np, dpmini
        a = dpmini.asarray(np.ones(1000), "cpu:5")
        del a
        assert dpmini.memory_reserved("cpu:5") == 0
        print("OK")
    """)
    run_script("""
        import os, warnings
        os.environ["DPMINI_CACHE_LIMIT"] = "lots"
        import numpy as np, dpmini
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            a = dpmini.asarray(np.ones(1000), "cpu:5")
        assert any("DPMINI_CACHE_LIMIT=lots" in str(x.message) for x in w), w
        del a
        assert dpmini.memory_reserved("cpu:5") > 0     # the default still caches
        print("OK")
    """)


# --- `python -m dpmini info` wording ---------------------------------------

def test_info_describes_the_pool_and_a_rejected_env():
    env = dict(os.environ, DPMINI_CPU_DEVICES="abc")
    p = subprocess.run([sys.executable, "-m", "dpmini", "info"], capture_output=True,
                       text=True, env=env, timeout=TIMEOUT)
    assert p.returncode == 0, p.stderr
    assert "one worker thread per device, more while its jobs overlap, up to 1024" in p.stdout
    assert "one worker thread each" not in p.stdout
    assert "$DPMINI_CPU_DEVICES='abc' rejected (not an int in 1..256)" in p.stdout
    assert "$DPMINI_CPU_DEVICES=abc)" not in p.stdout
    env["DPMINI_CPU_DEVICES"] = "3"
    p = subprocess.run([sys.executable, "-m", "dpmini", "info"], capture_output=True,
                       text=True, env=env, timeout=TIMEOUT)
    assert "virtual CPU devices: 3" in p.stdout and "rejected" not in p.stdout
