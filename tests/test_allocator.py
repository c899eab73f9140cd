"""The caching allocator (csrc/core/alloc.c through host_memory.c): size classes reuse
blocks across nearby sizes, the cache holds at most min($DPMINI_CACHE_LIMIT,
peak allocated bytes + 32 MiB) per device, so memory_reserved stays within
twice the peak plus 32 MiB on a variable-size workload, and empty_cache()
gives the memory back to the system (RSS falls). Counters come from _testing.cache_stats.
Checks that read RSS or set the environment run in a subprocess."""
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

import dpmini
from dpmini import _testing, comm

SANITIZED = bool(os.environ.get("DPMINI_SANITIZER"))


def run_script(body, env=None):
    res = subprocess.run([sys.executable, "-c", textwrap.dedent(body)], capture_output=True,
                         text=True, timeout=120, env={**os.environ, **(env or {})})
    assert res.returncode == 0, res.stdout + res.stderr
    return res.stdout.split()


def test_nearby_sizes_reuse_one_block():
    dpmini.empty_cache()
    before = _testing.cache_stats("cpu:5")
    a = comm.broadcast(np.zeros(1000), ["cpu:5"])[0]     # 8000 bytes: the 8192 class
    del a
    b = comm.broadcast(np.zeros(950), ["cpu:5"])[0]      # 7600 bytes: the same class
    after = _testing.cache_stats("cpu:5")
    assert after["hits"] - before["hits"] == 1
    assert after["misses"] - before["misses"] == 1
    assert dpmini.memory_allocated("cpu:5") - before["allocated"] == 8192
    del b


def test_variable_size_batches_keep_reserved_within_twice_the_peak():
    dpmini.empty_cache()
    rng = np.random.default_rng(0)
    dev = ["cpu:6", "cpu:7"]
    worst = 0
    for _ in range(300):
        rows = int(rng.integers(1, 4000))
        parts = comm.scatter(np.ones((rows, 256), np.float32), dev)
        assert parts[0].shape[0] + parts[1].shape[0] == rows
        del parts
        s = _testing.cache_stats("cpu:6")
        assert s["slack"] == 32 << 20 and s["cached"] <= s["peak"] + s["slack"]
        worst = max(worst, dpmini.memory_reserved("cpu:6") - (2 * s["peak"] + s["slack"]))
    assert worst <= 0
    s = _testing.cache_stats("cpu:6")
    assert s["hits"] > 4 * s["misses"]    # the cache still does its job


def test_cache_limit_zero_caches_nothing():
    out = run_script("""
        import numpy as np, dpmini
        from dpmini import comm
        for n in (10, 1000, 100000, 1000000):
            comm.broadcast(np.ones(n), ["cpu:1"])
        print(dpmini.memory_allocated("cpu:1"), dpmini.memory_reserved("cpu:1"))
    """, env={"DPMINI_CACHE_LIMIT": "0"})
    assert out == ["0", "0"]


def test_cache_limit_bounds_what_is_cached():
    out = run_script("""
        import numpy as np, dpmini
        from dpmini import comm, _testing
        keep = [comm.broadcast(np.ones(n), ["cpu:1"])[0] for n in (1000, 20000, 200000)]
        del keep
        s = _testing.cache_stats("cpu:1")
        print(s["cached"] <= 200000, s["cached"] > 0, s["allocated"])
    """, env={"DPMINI_CACHE_LIMIT": "200000"})
    assert out == ["True", "True", "0"]


@pytest.mark.skipif(SANITIZED, reason="RSS under a sanitizer is the shadow's, not ours")
def test_empty_cache_returns_memory_to_the_system():
    out = run_script("""
        import numpy as np, dpmini
        from dpmini import comm, _testing

        def rss():
            return int(open("/proc/self/statm").read().split()[1]) * 4096

        src = np.ones(3 << 20)                    # 24 MiB
        blocks = [comm.broadcast(src[: (3 << 20) - k * 4096], ["cpu:2"])[0] for k in range(16)]
        del blocks                                # ~380 MiB now cached (peak bound)
        cached = _testing.cache_stats("cpu:2")["cached"]
        before = rss()
        dpmini.empty_cache()
        after = rss()
        print(cached >= 300 << 20, before - after >= 300 << 20,
              dpmini.memory_reserved("cpu:2"))
    """)
    assert out == ["True", "True", "0"]
