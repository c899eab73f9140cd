"""The copy limit that the benchmarks measure dpmini's copies against: dpmini.copy_limit
(csrc/core/copy_limit.c), the faster of libc memcpy and the copy engine's own streaming-store
(non-temporal) copy on the same threads, measured in the same run as dpmini.

A scatter+gather round trip of N bytes on 2 virtual devices reads and writes every byte twice
(src -> device buffers -> result). Its limit is two passes of N bytes by two threads, each over
its own contiguous half, at the rate dpmini.copy_limit(N, threads=2) measures (pre-touched
buffers: no page fault is timed). On many machines the streaming stores beat memcpy by up to
2x at hundreds of MiB, so a limit measured with memcpy alone could be beaten.

The limit route runs between dpmini's calls, one probe a round, like any other route, but
reports the probe's own copy times (LimitTimes): its buffers' allocation and page touching are
not part of the limit.

Use (benchmarks/bench_cpu.py):
    times = median_times({"dpmini": ..., "limit": limit_route(nbytes)}, rounds)
    seconds, how = limit_of(times)      # the faster of times["memcpy"] and times["stream"]
"""
import numpy as np

import dpmini


class LimitTimes(dict):
    """{"memcpy": seconds, "stream": seconds}: the times a limit route measured itself, which a
    benchmark's timer takes as they are instead of timing the call."""


def limit_route(nbytes, threads=2, passes=2, repeat=2):
    """A route that probes dpmini.copy_limit(nbytes, threads) once a call and returns the
    LimitTimes of `passes` passes of nbytes at its memcpy and streaming-store rates. The probe
    copies its fresh buffers `repeat` times and keeps the fastest: the first copy over newly
    mapped pages runs slower (and steadier figures come from two), and a limit is the best
    the machine does."""
    def probe():
        lim = dpmini.copy_limit(nbytes, threads=threads, repeat=repeat)
        return LimitTimes(memcpy=passes * nbytes / (lim["memcpy_gbps"] * 1e9),
                          stream=passes * nbytes / (lim["stream_gbps"] * 1e9))
    return probe


def limit_of(times):
    """(seconds, how) from a {route: seconds} that holds a limit route's "memcpy" and "stream"
    times: the faster of the two, and which one it is."""
    how = "stream" if times["stream"] < times["memcpy"] else "memcpy"
    return times[how], how


class CopytoRoundTrip:
    """The round trip with NumPy's np.copyto, two threads, each copying its contiguous half
    src -> tmp -> dst (the figure older READMEs used as the limit; not a limit: NumPy's copy
    is no faster than memcpy). Calling it runs one round trip."""

    def __init__(self, nbytes, pool):
        self.src = np.ones(nbytes, dtype=np.uint8)
        self.tmp = np.zeros(nbytes, dtype=np.uint8)
        self.dst = np.zeros(nbytes, dtype=np.uint8)
        half = nbytes // 2
        self.halves = [(0, half), (half, nbytes)]
        self.pool = pool

    def _copy_half(self, lo, hi):
        np.copyto(self.tmp[lo:hi], self.src[lo:hi])
        np.copyto(self.dst[lo:hi], self.tmp[lo:hi])

    def __call__(self):
        for f in [self.pool.submit(self._copy_half, lo, hi) for lo, hi in self.halves]:
            f.result()
