"""The benchmarks' memory limit (benchmarks/copy_limit.py): dpmini._testing.stream_copy runs
the copy engine's contiguous copy (csrc/core/copy.c) with streaming or ordinary stores and
must give the same bytes as the source; the limit is the faster of memcpy and stream."""
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest

from dpmini import _testing

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
import copy_limit  # noqa: E402


@pytest.mark.parametrize("streaming", [True, False])
@pytest.mark.parametrize("nbytes", [0, 1, 255, 256, 4097, (4 << 20) + 13])
def test_stream_copy_copies_every_byte(nbytes, streaming):
    src = np.random.default_rng(nbytes).integers(0, 256, nbytes, dtype=np.uint8)
    dst = np.zeros(nbytes + 64, dtype=np.uint8)
    _testing.stream_copy(dst[7:7 + nbytes], src, streaming=streaming)  # unaligned start
    assert np.array_equal(dst[7:7 + nbytes], src)
    assert not dst[:7].any() and not dst[7 + nbytes:].any()   # nothing outside


def test_stream_copy_refuses_different_sizes_and_read_only_targets():
    with pytest.raises(ValueError, match="dst has 8 bytes, src 9"):
        _testing.stream_copy(bytearray(8), bytes(9))
    with pytest.raises(TypeError):
        _testing.stream_copy(bytes(8), bytes(8))


@pytest.mark.parametrize("kind", copy_limit.KINDS)
def test_every_limit_route_makes_the_round_trip(kind):
    with ThreadPoolExecutor(2) as pool:
        route = copy_limit.TwoThreadCopy(1 << 20, pool, kind)
        route.src[:] = np.arange(1 << 20) % 251
        route()
        assert np.array_equal(route.dst, route.src) and np.array_equal(route.tmp, route.src)


def test_the_limit_is_the_faster_of_memcpy_and_stream():
    with ThreadPoolExecutor(2) as pool:
        assert sorted(copy_limit.limit_routes(4096, pool)) == ["memcpy", "stream"]
    assert copy_limit.limit_of({"memcpy": 2.0, "stream": 1.0, "dpmini": 1.5}) == (1.0, "stream")
    assert copy_limit.limit_of({"memcpy": 1.0, "stream": 2.0}) == (1.0, "memcpy")
    assert copy_limit.limit_of({"memcpy": 1.0}) == (1.0, "memcpy only")
