"""The memory limit that dpmini's copies are measured against: the fastest way this machine
moves the same bytes, measured in the same run as dpmini.

A scatter+gather round trip of N bytes on 2 virtual devices reads and writes every byte twice
(src -> device buffers -> result). The limit does the same two passes with two threads, each
over its contiguous half, src -> tmp -> dst, on preallocated, pre-touched buffers (no page
fault is timed), in two ways:

  memcpy  libc memcpy through ctypes (the GIL is released for the call);
  stream  the copy engine's own contiguous copy with streaming (non-temporal) stores
          (dpmini._testing.stream_copy over csrc/core/copy.c), what dpmini uses for large
          jobs; on many machines it beats memcpy by up to 2x at hundreds of MiB.

The limit is the faster of the two (their medians over the same interleaved rounds as
dpmini's): a ratio under 1 to a limit measured with memcpy alone only said that memcpy was
the slower way. dpmini._testing is built by every Makefile build (DPMINI_TESTING=1); without
it only memcpy is timed and limit_of() says so.

Use (benchmarks/bench_cpu.py; a notebook adds benchmarks/ to sys.path first):
    routes = limit_routes(nbytes, pool)          # {"memcpy": fn, "stream": fn}, pool of 2 threads
    times = median_times({**routes, "dpmini": ...}, rounds)
    seconds, how = limit_of(times)               # the faster, and "memcpy" or "stream"
"""
import ctypes
import ctypes.util

import numpy as np

try:
    from dpmini import _testing
except ImportError:   # a build without DPMINI_TESTING=1
    _testing = None

_LIBC = ctypes.CDLL(ctypes.util.find_library("c") or None)
_MEMCPY = _LIBC.memcpy
_MEMCPY.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t]
_MEMCPY.restype = ctypes.c_void_p

KINDS = ("memcpy", "stream", "copyto")


class TwoThreadCopy:
    """Two threads, each copying its contiguous half src -> tmp -> dst with `kind`:
    "memcpy" (libc), "stream" (the copy engine's streaming stores) or "copyto" (np.copyto,
    the figure older READMEs used). Calling it runs one round trip and returns when both
    halves are done."""

    def __init__(self, nbytes, pool, kind="memcpy"):
        if kind not in KINDS:
            raise ValueError(f"kind: expected one of {KINDS}, got {kind!r}")
        if kind == "stream" and _testing is None:
            raise RuntimeError("kind='stream' needs dpmini._testing (build with DPMINI_TESTING=1)")
        self.src = np.ones(nbytes, dtype=np.uint8)
        self.tmp = np.zeros(nbytes, dtype=np.uint8)
        self.dst = np.zeros(nbytes, dtype=np.uint8)
        half = nbytes // 2
        self.halves = [(0, half), (half, nbytes)]
        self.pool = pool
        self.kind = kind

    def _copy_half(self, lo, hi):
        if self.kind == "memcpy":
            s, t, d = (a.ctypes.data + lo for a in (self.src, self.tmp, self.dst))
            _MEMCPY(t, s, hi - lo)
            _MEMCPY(d, t, hi - lo)
        elif self.kind == "stream":
            _testing.stream_copy(self.tmp[lo:hi], self.src[lo:hi])
            _testing.stream_copy(self.dst[lo:hi], self.tmp[lo:hi])
        else:
            np.copyto(self.tmp[lo:hi], self.src[lo:hi])
            np.copyto(self.dst[lo:hi], self.tmp[lo:hi])

    def __call__(self):
        for f in [self.pool.submit(self._copy_half, lo, hi) for lo, hi in self.halves]:
            f.result()


def limit_routes(nbytes, pool):
    """{"memcpy": TwoThreadCopy, "stream": TwoThreadCopy} for nbytes (only "memcpy" when
    dpmini._testing is missing): time them beside dpmini, then call limit_of."""
    routes = {"memcpy": TwoThreadCopy(nbytes, pool, "memcpy")}
    if _testing is not None:
        routes["stream"] = TwoThreadCopy(nbytes, pool, "stream")
    return routes


def limit_of(times):
    """(seconds, how) from a {route: seconds} that holds limit_routes' routes: the faster of
    "memcpy" and "stream"; how is "memcpy", "stream", or "memcpy only" when stream was not
    timed (then a ratio under 1 may mean the limit is too low)."""
    if "stream" not in times:
        return times["memcpy"], "memcpy only"
    how = "stream" if times["stream"] < times["memcpy"] else "memcpy"
    return times[how], how
