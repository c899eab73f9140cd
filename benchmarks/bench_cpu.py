"""dpmini on the CPU: scatter+gather bandwidth and DataParallel's per-call overhead.

Run: python benchmarks/bench_cpu.py [--size-mib 256] [--repeats 5] [--calls 20000]
(`make bench`). A script that prints figures, not a test; it always exits 0.

1. Scatter + gather of one float32 array (default 256 MiB, 4096 x 16384) over
   two virtual devices, along dim 0 and dim 1, best of --repeats rounds (each
   round runs every route once, after a warm-up round), for
     dpmini   comm.scatter(x, devs, dim) then comm.gather(parts, dim, 'cpu');
     numpy    np.array_split + np.ascontiguousarray per piece + np.concatenate
              (along dim 0 the pieces are already contiguous, so NumPy makes
              one copy where dpmini makes two: the "copies" column says so);
     limit    two threads running np.copyto (which releases the GIL) over the
              two halves of preallocated, pre-touched arrays, src -> tmp -> dst:
              the same two passes over the same bytes, the memory system's limit.
   Bandwidth counts every byte copied once (2 passes x array size / time).
   Target: dpmini within 1.25x of the limit, both dims.
2. DataParallel on a small (8, 4) float32 input with two virtual devices and an
   identity module, mean over --calls calls, next to a direct call of the same
   module. Target: overhead (the difference) under 30 microseconds per call.
"""
import argparse
import os
import platform
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np

import dpmini

DEVICES = ["cpu:0", "cpu:1"]
COLS = 16384                 # columns of the benchmark array (16384 float32 = 64 KiB a row)
LIMIT_RATIO_TARGET = 1.25    # dpmini time / memcpy-limit time
OVERHEAD_TARGET_US = 30.0    # DataParallel call minus direct call, microseconds


# ---------------------------------------------------------------- timing helpers

def best_times(routes, repeats):
    """Fastest seconds of each route over `repeats` rounds, after one warm-up round.

    routes: {name: fn}. Each round calls every route once, in turn, so a slow
    spell of a shared machine hits all routes alike and the ratios hold.
    """
    for fn in routes.values():
        fn()
    best = dict.fromkeys(routes, float("inf"))
    for _ in range(repeats):
        for name, fn in routes.items():
            start = time.perf_counter()
            fn()
            best[name] = min(best[name], time.perf_counter() - start)
    return best


def mean_time(fn, calls):
    """Mean seconds per call of fn() over `calls` calls, after calls // 20 warm-up calls."""
    for _ in range(max(calls // 20, 1)):
        fn()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - start) / calls


# ---------------------------------------------------------------- the three copy routes

def dpmini_roundtrip(x, dim):
    """dpmini: scatter x over DEVICES along dim, gather the parts back to the host."""
    parts = dpmini.comm.scatter(x, DEVICES, dim=dim)
    return dpmini.comm.gather(parts, dim=dim, destination="cpu")


def numpy_roundtrip(x, dim):
    """NumPy: split, make each piece contiguous (a copy where it is not), concatenate."""
    pieces = [np.ascontiguousarray(p) for p in np.array_split(x, len(DEVICES), axis=dim)]
    return np.concatenate(pieces, axis=dim)


def numpy_copies(x, dim):
    """How many full copies numpy_roundtrip makes (1 or 2): ascontiguousarray copies only
    pieces that are not already contiguous."""
    pieces = np.array_split(x, len(DEVICES), axis=dim)
    copied = any(not np.shares_memory(np.ascontiguousarray(p), x) for p in pieces)
    return 2 if copied else 1


class TwoThreadCopy:
    """The physical limit: two threads, each copying its half src -> tmp -> dst.

    All three arrays are allocated and touched once up front, so no page fault
    is timed. np.copyto releases the GIL, so the two halves run in parallel.
    """

    def __init__(self, x):
        self.src = x.reshape(-1)
        self.tmp = np.empty_like(self.src)
        self.dst = np.empty_like(self.src)
        self.tmp.fill(0)
        self.dst.fill(0)
        half = self.src.size // 2
        self.halves = [slice(0, half), slice(half, self.src.size)]
        self.pool = ThreadPoolExecutor(max_workers=2)

    def _copy_half(self, part):
        np.copyto(self.tmp[part], self.src[part])
        np.copyto(self.dst[part], self.tmp[part])

    def __call__(self):
        for future in [self.pool.submit(self._copy_half, part) for part in self.halves]:
            future.result()

    def close(self):
        self.pool.shutdown()


# ---------------------------------------------------------------- reports

def gbps(nbytes, seconds):
    """Decimal gigabytes per second."""
    return nbytes / seconds / 1e9


def check_roundtrip(x, dim):
    """Raise AssertionError unless both routes give back x exactly."""
    for name, route in (("dpmini", dpmini_roundtrip), ("numpy", numpy_roundtrip)):
        y = route(x, dim)
        if y.shape != x.shape or y.dtype != x.dtype or not np.array_equal(y, x):
            raise AssertionError(f"{name} scatter+gather along dim {dim} changed the array")


def bench_bandwidth(x, repeats):
    """Time the three routes for dim 0 and dim 1; print one table. Returns the dpmini/limit ratios."""
    print(f"scatter+gather of {x.shape} {x.dtype} ({x.nbytes / 2**20:.0f} MiB) on {DEVICES}, "
          f"best of {repeats} rounds; GB/s counts each byte copied once")
    print(f"  {'dim':<4}{'route':<8}{'copies':>7}{'ms':>10}{'GB/s':>8}{'x limit':>9}")
    limit = TwoThreadCopy(x)
    ratios = {}
    try:
        for dim in (0, 1):
            check_roundtrip(x, dim)
            best = best_times({"dpmini": lambda: dpmini_roundtrip(x, dim),
                               "numpy": lambda: numpy_roundtrip(x, dim),
                               "limit": limit}, repeats)
            copies = {"dpmini": 2, "numpy": numpy_copies(x, dim), "limit": 2}
            for name, t in best.items():
                print(f"  {dim:<4}{name:<8}{copies[name]:>7}{t * 1e3:>10.1f}"
                      f"{gbps(copies[name] * x.nbytes, t):>8.2f}{t / best['limit']:>9.2f}")
            ratios[dim] = best["dpmini"] / best["limit"]
    finally:
        limit.close()
    return ratios


class Identity:
    """The smallest module: returns its input."""

    def __call__(self, x):
        return x


def bench_overhead(calls):
    """Mean time of a DataParallel call and of a direct call; print both. Returns the overhead (us)."""
    module = Identity()
    parallel = dpmini.DataParallel(module, device_ids=DEVICES)
    x = np.arange(32, dtype=np.float32).reshape(8, 4)
    if not np.array_equal(parallel(x), x):
        raise AssertionError("DataParallel(identity) did not return its input")
    t_dp = mean_time(lambda: parallel(x), calls) * 1e6
    t_direct = mean_time(lambda: module(x), calls) * 1e6
    overhead = t_dp - t_direct
    print(f"DataParallel per-call overhead, identity module, {x.shape} {x.dtype} on {DEVICES}, "
          f"mean of {calls} calls")
    print(f"  DataParallel {t_dp:9.2f} us/call")
    print(f"  direct call  {t_direct:9.2f} us/call")
    print(f"  overhead     {overhead:9.2f} us/call")
    return overhead


def print_environment():
    """Python, NumPy, dpmini and core counts, and OpenBLAS settings that slow NumPy here."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    print(f"python {platform.python_version()}, numpy {np.__version__}, "
          f"{platform.machine()}, {cores} usable cores ({os.cpu_count()} online), "
          f"dpmini.cpu_device_count() = {dpmini.cpu_device_count()}")
    for name in ("OPENBLAS_CORETYPE", "OPENBLAS_L2_SIZE"):
        if os.environ.get(name):
            print(f"{name}={os.environ[name]} (set in this environment)")


def print_targets(ratios, overhead):
    """One line per target with its verdict."""
    print("targets")
    for dim, ratio in ratios.items():
        verdict = "met" if ratio <= LIMIT_RATIO_TARGET else "MISSED"
        print(f"  dim {dim}: dpmini {ratio:.2f}x the memcpy limit "
              f"(target <= {LIMIT_RATIO_TARGET}x): {verdict}")
    verdict = "met" if overhead < OVERHEAD_TARGET_US else "MISSED"
    print(f"  DataParallel overhead {overhead:.1f} us/call "
          f"(target < {OVERHEAD_TARGET_US:.0f} us): {verdict}")


def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--size-mib", type=int, default=256,
                        help="array size in MiB, a multiple of 1 (default 256: 4096 x 16384 float32)")
    parser.add_argument("--repeats", type=int, default=5, help="timed repeats per route (default 5)")
    parser.add_argument("--calls", type=int, default=20000,
                        help="calls averaged for the overhead figure (default 20000)")
    args = parser.parse_args(argv)
    if args.size_mib < 1 or args.repeats < 1 or args.calls < 1:
        parser.error("--size-mib, --repeats and --calls must be at least 1")
    return args


def main(argv=None):
    args = parse_args(argv)
    print_environment()
    rows = args.size_mib * 2**20 // (4 * COLS)
    x = np.random.default_rng(0).standard_normal((rows, COLS), dtype=np.float32)
    print()
    ratios = bench_bandwidth(x, args.repeats)
    del x
    print()
    overhead = bench_overhead(args.calls)
    print()
    print_targets(ratios, overhead)
    return 0


if __name__ == "__main__":
    sys.exit(main())
