"""The benchmarks' copy limit (benchmarks/copy_limit.py) is dpmini.copy_limit, probed between
dpmini's calls: its route reports the memcpy and streaming-store times of the round trip's
two passes, and the limit is the faster of the two."""
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
import copy_limit  # noqa: E402


def test_the_limit_route_reports_both_ways_of_copying():
    times = copy_limit.limit_route(1 << 16)()
    assert isinstance(times, copy_limit.LimitTimes)
    assert sorted(times) == ["memcpy", "stream"]
    assert all(t > 0 for t in times.values())


def test_the_limit_is_the_faster_of_memcpy_and_stream():
    assert copy_limit.limit_of({"memcpy": 2.0, "stream": 1.0, "dpmini": 1.5}) == (1.0, "stream")
    assert copy_limit.limit_of({"memcpy": 1.0, "stream": 2.0}) == (1.0, "memcpy")


def test_the_copyto_route_makes_the_round_trip():
    with ThreadPoolExecutor(2) as pool:
        route = copy_limit.CopytoRoundTrip(1 << 20, pool)
        route.src[:] = np.arange(1 << 20) % 251
        route()
        assert np.array_equal(route.dst, route.src) and np.array_equal(route.tmp, route.src)
