"""dpmini on the CPU: copy bandwidth against the memory limit, per-leaf and
per-device cost, replicate bandwidth, CPU replicas against plain NumPy, and an
optional scaling table.

Run: python benchmarks/bench_cpu.py [--rounds 7] [--calls 2000] [--scaling]
(`make bench`). A script that prints figures, not a test; it always exits 0.
Every figure is printed with its target and "met" or "MISSED".

Timing on a shared machine: the routes of one figure run interleaved (each
round runs every route once, in turn, after a warm-up round) and each figure
is the MEDIAN over the rounds, so a slow spell hits all routes alike. The
load average (`uptime`) is printed before and after; figures taken under load
are noisy, the ratios less so.

1. Scatter + gather of a 256 MiB float32 array over virtual devices, for
   (4096, 16384) on dims 0, 1 and -1 with 2 devices, dim 1 with 4 devices,
   and a time-major (T, B, F) = (512, 256, 512) array on dim 1, against
     limit   the same two passes by two threads at the rate of dpmini.copy_limit
             (benchmarks/copy_limit.py): the faster of libc memcpy ("memcpy")
             and the copy engine's own streaming-store copy ("stream"), on
             pre-touched buffers, probed once a round in this run;
     copyto  the same with NumPy's np.copyto (the figure older READMEs used);
     numpy   np.array_split + np.ascontiguousarray + np.concatenate.
   Target: dpmini <= 1.25x the limit.
2. Per-call overhead: DataParallel(identity) on a dict of one (8, 4) float32
   array, 2 devices, minus a direct call: target < 30 us. Per-leaf cost: the
   same with 100 leaves, minus the 1-leaf call, divided by 99: target <= 2 us
   per leaf per call.
3. Per-device cost: DataParallel(identity) on an (64, 4) float32 input over
   64 virtual devices, divided by 64. Target <= 4 us per device per call.
4. Replicate of a module holding 1,000 float32 parameters of 32 KiB on 2
   devices, bytes copied (2 x 32 MiB) per second. Target >= 15 GB/s.
5. CPU replicas and BLAS: one training step of an MLP (4096 x 784 -> 512 ->
   10, float32) and an elementwise-heavy step, DataParallel on 2 virtual
   devices against the same step in plain NumPy on one device, with NumPy's
   default threading. Targets >= 1.0x (MLP) and >= 1.7x (elementwise).
   Each route is timed as a loop of that route alone runs it: 5 calls after
   BLAS_SETTLE_S of untimed calls of the same route, the routes alternating
   round by round. The first call after switching from the other route is
   printed beside it (not a target): see BLAS_SETTLE_S for why it differs.
6. --scaling: scatter+gather time and ratio to the limit vs array size
   (1 KiB .. 1 GiB, --max-scaling-mib), vs devices (2 .. 64) and vs leaves
   (1 .. 10,000), printed as Markdown tables for benchmarks/README.md.

Items 2-4 move by 2x between runs on a busy machine; bench_instructions.py
counts the same cases in instructions (callgrind), which do not.
"""
import argparse
import os
import platform
import resource
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

# 64 virtual devices for the per-device figure; read at import of dpmini.
os.environ.setdefault("DPMINI_CPU_DEVICES", "64")

import numpy as np  # noqa: E402

import dpmini  # noqa: E402
from copy_limit import CopytoRoundTrip, LimitTimes, limit_of, limit_route  # noqa: E402

LIMIT_RATIO_TARGET = 1.25    # dpmini time / copy-limit time
LEAF_TARGET_US = 2.0         # per leaf per call, 2 devices
OVERHEAD_TARGET_US = 30.0    # DataParallel call minus direct call, one (8, 4) leaf
DEVICE_TARGET_US = 4.0       # per device per call, 64 devices, tiny input
REPLICATE_TARGET_GBPS = 15.0
MLP_TARGET = 1.0             # DataParallel speed / NumPy speed
STEPS_IN_A_RUN = 5           # item 5: calls in a row, as a training loop makes them
# After each call that used more than one thread, OpenBLAS's idle helper threads
# spin (since 0.3.27 on x86-64 a loop of nops that never yields the core) for
# 2**THREAD_TIMEOUT TSC ticks before they sleep: THREAD_TIMEOUT is 28 in OpenBLAS's
# driver/others/blas_server.c (the environment variable OPENBLAS_THREAD_TIMEOUT=n,
# read when OpenBLAS loads, makes it 2**n, n clamped to 4..30), so ~0.12 s at
# 2.3 GHz. A DataParallel call that starts in that window, right after NumPy's
# 2-thread products, shares a core with the spinner (measured here: ~55-70 ms
# against ~30-40 ms); a NumPy call after the helper went to sleep wakes it. Item 5
# times each route as it runs in a loop of that route alone: after this long of
# untimed calls of the same route, longer than the window for n <= 28 on any TSC
# of 0.9 GHz or more.
BLAS_SETTLE_S = 0.3
ELEMENTWISE_TARGET = 1.7

VERDICTS = []                # (text, met) for the summary


def verdict(text, met):
    """Record one target line and return its verdict word."""
    VERDICTS.append((text, met))
    return "met" if met else "MISSED"


def devices(n):
    return [f"cpu:{i}" for i in range(n)]


# ---------------------------------------------------------------- timing helpers

def median_times(routes, rounds):
    """Median seconds of each route over `rounds` interleaved rounds, after one warm-up round.
    A route that returns LimitTimes (copy_limit.limit_route) gives its own times, each under
    its own name ("memcpy", "stream"), instead of the time of the call."""
    for fn in routes.values():
        fn()
    times = {}
    for _ in range(rounds):
        for name, fn in routes.items():
            start = time.perf_counter()
            res = fn()
            took = {name: time.perf_counter() - start}
            for key, t in (res if isinstance(res, LimitTimes) else took).items():
                times.setdefault(key, []).append(t)
    return {name: statistics.median(t) for name, t in times.items()}


def median_per_call(routes, calls, rounds):
    """Median over `rounds` of the mean seconds per call of each route (calls calls a round)."""
    def batch(fn):
        def run():
            for _ in range(calls):
                fn()
        return run
    t = median_times({name: batch(fn) for name, fn in routes.items()}, rounds)
    return {name: v / calls for name, v in t.items()}


def steady_per_call(routes, calls, rounds, warm_s):
    """Median over `rounds` of the mean seconds per call of `calls` calls of each
    route, each timed run preceded by untimed calls of the same route for at least
    warm_s seconds: the state a loop of that route alone is in. Routes alternate."""
    times = {name: [] for name in routes}
    for _ in range(rounds):
        for name, fn in routes.items():
            end = time.perf_counter() + warm_s
            while time.perf_counter() < end:
                fn()
            start = time.perf_counter()
            for _ in range(calls):
                fn()
            times[name].append((time.perf_counter() - start) / calls)
    return {name: statistics.median(t) for name, t in times.items()}


def first_call_after(routes, rounds, warm_s):
    """Median seconds of the first call of each of two routes right after warm_s
    seconds of calls of the other route: the cost of switching."""
    (a, fa), (b, fb) = routes.items()
    times = {a: [], b: []}
    for _ in range(rounds):
        for name, fn, other in ((a, fa, fb), (b, fb, fa)):
            end = time.perf_counter() + warm_s
            while time.perf_counter() < end:
                other()
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t) for name, t in times.items()}


def uptime():
    """The load line of `uptime` (or /proc/loadavg)."""
    try:
        return subprocess.run(["uptime"], capture_output=True, text=True, timeout=5).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        with open("/proc/loadavg") as f:
            return "loadavg " + f.read().strip()


# ---------------------------------------------------------------- 1. bandwidth

def dpmini_roundtrip(x, dim, devs):
    parts = dpmini.comm.scatter(x, devs, dim=dim)
    return dpmini.comm.gather(parts, dim=dim, destination="cpu")


def numpy_roundtrip(x, dim, ndev):
    pieces = [np.ascontiguousarray(p) for p in np.array_split(x, ndev, axis=dim)]
    return np.concatenate(pieces, axis=dim)


def bench_bandwidth(rounds, pool):
    """Table of scatter+gather cases against the limits. Returns {case: ratio}."""
    mib = 256
    wide = np.random.default_rng(0).standard_normal((4096, 16384), dtype=np.float32)
    tbf = np.random.default_rng(1).standard_normal((512, 256, 512), dtype=np.float32)
    cases = [(wide, 0, 2), (wide, 1, 2), (wide, -1, 2), (wide, 1, 4), (tbf, 1, 2)]
    limit = limit_route(mib * 2**20)
    copyto = CopytoRoundTrip(mib * 2**20, pool)
    print(f"1. scatter+gather of {mib} MiB float32, median of {rounds} interleaved rounds; "
          "GB/s counts each byte copied once (2 passes); limit = the faster of memcpy and "
          "stream")
    print(f"  {'shape':<16}{'dim':>4}{'devs':>5}{'dpmini ms':>11}{'memcpy ms':>11}"
          f"{'stream ms':>11}{'copyto ms':>11}{'numpy ms':>10}{'dpmini GB/s':>13}{'x limit':>9}"
          "  target")
    ratios = {}
    for x, dim, ndev in cases:
        devs = devices(ndev)
        y = dpmini_roundtrip(x, dim, devs)
        if not np.array_equal(y, x):
            raise AssertionError(f"dpmini scatter+gather of {x.shape} on dim {dim} changed it")
        del y
        t = median_times({"dpmini": lambda: dpmini_roundtrip(x, dim, devs),
                          "limit": limit, "copyto": copyto,
                          "numpy": lambda: numpy_roundtrip(x, dim, ndev)}, rounds)
        limit_s, how = limit_of(t)
        r = t["dpmini"] / limit_s
        key = f"{x.shape} dim {dim} on {ndev} devices"
        ratios[key] = r
        v = verdict(f"scatter+gather {key}: {r:.2f}x the copy limit ({how}) "
                    f"(target <= {LIMIT_RATIO_TARGET}x)", r <= LIMIT_RATIO_TARGET)
        print(f"  {str(x.shape):<16}{dim:>4}{ndev:>5}{t['dpmini'] * 1e3:>11.1f}"
              f"{t['memcpy'] * 1e3:>11.1f}{t['stream'] * 1e3:>11.1f}{t['copyto'] * 1e3:>11.1f}"
              f"{t['numpy'] * 1e3:>10.1f}{2 * x.nbytes / t['dpmini'] / 1e9:>13.2f}{r:>9.2f}"
              f"  <= {LIMIT_RATIO_TARGET} {v}")
    return ratios


# ---------------------------------------------------------------- 2-4. overheads

class Identity:
    """The smallest module: returns its input."""

    def __call__(self, x):
        return x


def bench_leaves(calls, rounds):
    dp = dpmini.DataParallel(Identity(), device_ids=devices(2))
    many = {f"k{i}": np.full((8, 4), i, dtype=np.float32) for i in range(100)}
    one = {"k0": many["k0"]}
    out = dp(many)
    if not all(np.array_equal(out[k], many[k]) for k in many):
        raise AssertionError("DataParallel(identity) changed a leaf")
    module = Identity()
    t = median_per_call({"100": lambda: dp(many), "1": lambda: dp(one),
                         "direct": lambda: module(one)}, calls, rounds)
    per_leaf = (t["100"] - t["1"]) / 99 * 1e6
    overhead = (t["1"] - t["direct"]) * 1e6
    v = verdict(f"DataParallel per-call overhead {overhead:.1f} us, one (8, 4) leaf "
                f"(target < {OVERHEAD_TARGET_US:.0f} us)", overhead < OVERHEAD_TARGET_US)
    print(f"2. DataParallel(identity) per-call overhead on one (8, 4) float32 leaf, 2 devices: "
          f"{overhead:.1f} us (direct call {t['direct'] * 1e6:.2f} us) "
          f"(target < {OVERHEAD_TARGET_US:.0f}): {v}")
    v = verdict(f"per-leaf cost {per_leaf:.2f} us (target <= {LEAF_TARGET_US} us)",
                per_leaf <= LEAF_TARGET_US)
    print(f"2. DataParallel(identity), dict of (8, 4) float32 leaves on 2 devices: "
          f"1 leaf {t['1'] * 1e6:.1f} us, 100 leaves {t['100'] * 1e6:.1f} us per call; "
          f"per leaf {per_leaf:.2f} us (target <= {LEAF_TARGET_US}): {v}")
    return per_leaf


def bench_devices(calls, rounds):
    n = dpmini.cpu_device_count()
    if n < 64:
        print(f"3. per-device cost: skipped, only {n} virtual devices (set DPMINI_CPU_DEVICES=64)")
        return None
    x = np.ones((64, 4), dtype=np.float32)
    dp64 = dpmini.DataParallel(Identity(), device_ids=devices(64))
    dp2 = dpmini.DataParallel(Identity(), device_ids=devices(2))
    if not np.array_equal(dp64(x), x):
        raise AssertionError("DataParallel(identity) on 64 devices changed its input")
    t = median_per_call({"64": lambda: dp64(x), "2": lambda: dp2(x)}, max(calls // 10, 1), rounds)
    per_dev = t["64"] / 64 * 1e6
    marginal = (t["64"] - t["2"]) / 62 * 1e6
    v = verdict(f"per-device cost {per_dev:.2f} us (target <= {DEVICE_TARGET_US} us)",
                per_dev <= DEVICE_TARGET_US)
    print(f"3. DataParallel(identity), (64, 4) float32: 2 devices {t['2'] * 1e6:.1f} us, "
          f"64 devices {t['64'] * 1e6:.1f} us per call; per device {per_dev:.2f} us "
          f"(marginal {marginal:.2f}) (target <= {DEVICE_TARGET_US}): {v}")
    return per_dev


class Params:
    """A module holding n float32 parameters of `nbytes` each."""

    def __init__(self, n, nbytes):
        self.params = [np.full(nbytes // 4, i, dtype=np.float32) for i in range(n)]

    def __call__(self, x):
        return x


def bench_replicate(rounds):
    m = Params(1000, 32 * 1024)
    devs = devices(2)
    reps = dpmini.replicate(m, devs)
    if not all(np.array_equal(a, b) for r in reps for a, b in zip(r.params, m.params)):
        raise AssertionError("replicate changed a parameter")
    del reps
    t = median_times({"replicate": lambda: dpmini.replicate(m, devs)}, rounds)["replicate"]
    gbps = 2 * 1000 * 32 * 1024 / t / 1e9
    v = verdict(f"replicate {gbps:.1f} GB/s (target >= {REPLICATE_TARGET_GBPS})",
                gbps >= REPLICATE_TARGET_GBPS)
    print(f"4. replicate of 1,000 float32 parameters of 32 KiB on 2 devices: {t * 1e3:.2f} ms, "
          f"{gbps:.1f} GB/s (target >= {REPLICATE_TARGET_GBPS}): {v}")
    return gbps


# ---------------------------------------------------------------- 5. BLAS

class MLPStep:
    """Forward and backward of relu(x @ w1) @ w2 with a squared loss: the gradients."""

    def __init__(self):
        rng = np.random.default_rng(2)
        self.w1 = rng.standard_normal((784, 512), dtype=np.float32) * 0.05
        self.w2 = rng.standard_normal((512, 10), dtype=np.float32) * 0.05

    def __call__(self, x):
        h = x @ self.w1
        a = np.maximum(h, 0)
        y = a @ self.w2
        gy = 2 * y / y.shape[0]
        gw2 = a.T @ gy
        ga = (gy @ self.w2.T) * (h > 0)
        gw1 = x.T @ ga
        return gw1, gw2


class ElementwiseStep:
    """Elementwise-heavy work (NumPy runs it on one thread): exp, tanh, products."""

    def __call__(self, x):
        return np.tanh(x) * np.exp(-x * x) + np.sin(x)


def kernel_time(fn, calls=STEPS_IN_A_RUN):
    """System CPU seconds and minor page faults a call of fn, over `calls` calls
    (resource.getrusage of the whole process: the replicas' threads included)."""
    fn()
    r0 = resource.getrusage(resource.RUSAGE_SELF)
    for _ in range(calls):
        fn()
    r1 = resource.getrusage(resource.RUSAGE_SELF)
    return (r1.ru_stime - r0.ru_stime) / calls, (r1.ru_minflt - r0.ru_minflt) / calls


def bench_blas(rounds):
    rng = np.random.default_rng(3)
    results = {}
    for name, module, x, target in (
            ("MLP step 4096x784 -> 512 -> 10", MLPStep(),
             rng.standard_normal((4096, 784), dtype=np.float32), MLP_TARGET),
            ("elementwise step (4096, 2048)", ElementwiseStep(),
             rng.standard_normal((4096, 2048), dtype=np.float32), ELEMENTWISE_TARGET)):
        dp = dpmini.DataParallel(module, device_ids=devices(2))
        def run_dp(dp=dp, x=x):
            return dp(x)   # the per-device gradients come back stacked (gather)
        routes = {"numpy": lambda m=module, x=x: m(x), "dpmini": run_dp}
        t = steady_per_call(routes, STEPS_IN_A_RUN, rounds, BLAS_SETTLE_S)
        speed = t["numpy"] / t["dpmini"]
        results[name] = speed
        after = first_call_after(routes, rounds, BLAS_SETTLE_S)
        v = verdict(f"{name}: DataParallel on 2 devices {speed:.2f}x plain NumPy "
                    f"(target >= {target}x)", speed >= target)
        print(f"5. {name}: a call in a loop of one route: NumPy {t['numpy'] * 1e3:.1f} ms, "
              f"DataParallel on 2 devices {t['dpmini'] * 1e3:.1f} ms: {speed:.2f}x "
              f"(target >= {target}): {v}\n"
              f"   the first call after switching routes: DataParallel after NumPy "
              f"{after['dpmini'] * 1e3:.1f} ms, NumPy after DataParallel "
              f"{after['numpy'] * 1e3:.1f} ms (OpenBLAS's helper thread spinning or "
              f"asleep; see BLAS_SETTLE_S)")
        kernel = {r: kernel_time(f) for r, f in routes.items()}
        print(f"   in the kernel (page faults) a call: NumPy {kernel['numpy'][0] * 1e3:.1f} ms, "
              f"{kernel['numpy'][1]:.0f} faults; DataParallel {kernel['dpmini'][0] * 1e3:.1f} ms, "
              f"{kernel['dpmini'][1]:.0f} faults (replicas allocate from their device's cache; "
              f"DPMINI_NUMPY_ALLOCATOR=0 turns that off)")
    return results


# ---------------------------------------------------------------- 6. scaling

def bench_scaling(rounds, max_mib, pool):
    print("6. scaling: scatter+gather (dim 0 on 2 devices unless said), median of "
          f"{rounds} rounds")
    print("\n| array size | dpmini | limit (faster of memcpy, stream) | x limit |\n|---|---|---|---|")
    size = 1024
    while size <= max_mib * 2**20:
        x = np.ones((size // 4 // 256, 256) if size >= 4096 else (size // 4,), np.float32)
        t = median_times({"d": lambda: dpmini_roundtrip(x, 0, devices(2)),
                          "limit": limit_route(size)}, rounds)
        lim, how = limit_of(t)
        print(f"| {fmt_bytes(size)} | {fmt_t(t['d'])} | {fmt_t(lim)} ({how}) | "
              f"{t['d'] / lim:.2f}x |")
        del x
        size *= 8 if size < 2**20 else 4
    print("\n| devices | 64 MiB, dim 0 | x limit | (n, 4) tiny input, identity DataParallel |"
          "\n|---|---|---|---|")
    x = np.ones((4096, 4096), np.float32)
    limit = limit_route(x.nbytes)
    for n in (2, 4, 8, 16, 32, 64):
        if n > dpmini.cpu_device_count():
            break
        tiny = np.ones((n, 4), np.float32)
        dp = dpmini.DataParallel(Identity(), device_ids=devices(n))
        t = median_times({"d": lambda: dpmini_roundtrip(x, 0, devices(n)), "limit": limit,
                          "c": lambda: [dp(tiny) for _ in range(100)]}, rounds)
        print(f"| {n} | {fmt_t(t['d'])} | {t['d'] / limit_of(t)[0]:.2f}x | "
              f"{fmt_t(t['c'] / 100)} |")
    del x
    print("\n| leaves (8, 4) float32 in a dict | identity DataParallel, 2 devices | per leaf |"
          "\n|---|---|---|")
    dp = dpmini.DataParallel(Identity(), device_ids=devices(2))
    for n in (1, 10, 100, 1000, 10000):
        tree = {f"k{i}": np.ones((8, 4), np.float32) for i in range(n)}
        reps = max(1, 1000 // n)
        t = median_times({"d": lambda: [dp(tree) for _ in range(reps)]}, rounds)["d"] / reps
        print(f"| {n} | {fmt_t(t)} | {fmt_t(t / n)} |")
    print()


def fmt_bytes(n):
    for unit in ("GiB", "MiB", "KiB"):
        scale = {"GiB": 2**30, "MiB": 2**20, "KiB": 2**10}[unit]
        if n >= scale:
            return f"{n // scale} {unit}"
    return f"{n} B"


def fmt_t(s):
    if s >= 1e-3:
        return f"{s * 1e3:.2f} ms"
    return f"{s * 1e6:.1f} us"


# ---------------------------------------------------------------- main

def print_environment():
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")),
                       cpu)
    except OSError:
        pass
    print(f"python {platform.python_version()}, numpy {np.__version__}, {cpu}, "
          f"{cores} usable cores ({os.cpu_count()} online), "
          f"dpmini.cpu_device_count() = {dpmini.cpu_device_count()}")
    print(f"load: {uptime()}")


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rounds", type=int, default=7, help="interleaved rounds per figure (default 7)")
    p.add_argument("--calls", type=int, default=2000,
                   help="calls per round for the per-call figures (default 2000)")
    p.add_argument("--only", default="12345",
                   help="which numbered figures to run, e.g. 13 (default 12345)")
    p.add_argument("--scaling", action="store_true", help="also print the scaling tables (6)")
    p.add_argument("--max-scaling-mib", type=int, default=1024,
                   help="largest array of the size table, MiB (default 1024)")
    args = p.parse_args(argv)
    if args.rounds < 1 or args.calls < 1 or args.max_scaling_mib < 1:
        p.error("--rounds, --calls and --max-scaling-mib must be at least 1")
    return args


def main(argv=None):
    args = parse_args(argv)
    print_environment()
    pool = ThreadPoolExecutor(max_workers=2)
    try:
        if "1" in args.only:
            bench_bandwidth(args.rounds, pool)
        if "2" in args.only:
            bench_leaves(args.calls, args.rounds)
        if "3" in args.only:
            bench_devices(args.calls, args.rounds)
        if "4" in args.only:
            bench_replicate(args.rounds)
        if "5" in args.only:
            bench_blas(args.rounds)
        if args.scaling:
            bench_scaling(args.rounds, args.max_scaling_mib, pool)
    finally:
        pool.shutdown()
    print(f"load: {uptime()}")
    print("targets")
    for text, met in VERDICTS:
        print(f"  {text}: {'met' if met else 'MISSED'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
