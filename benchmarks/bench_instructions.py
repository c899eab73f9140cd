"""Instructions, not seconds: what dpmini's per-leaf, per-device and
replicate costs are made of, counted by valgrind's callgrind, so that two
builds can be compared on a busy machine (wall-clock figures from
bench_cpu.py move by 2x there; instruction counts by well under 1%).

Run: python benchmarks/bench_instructions.py [--calls 50]
Needs valgrind on PATH; prints a line and exits 0 without it. A script that
prints figures, not a test.

Each figure runs a child Python under `valgrind --tool=callgrind` that warms
up through an entry point callgrind does not count (DataParallel.forward,
DataParallel.replicate), then makes --calls calls through the counted one
(DataParallel.__call__: csrc/dp/dataparallel.c DataParallel_call;
dpmini.replicate: dp_replicate), and reads callgrind's "Collected" total:
  per leaf     DataParallel(identity) on a dict of 100 (8, 4) float32 arrays
               minus the same with 1 array, / 99, 2 devices (the calling
               thread: scatter, gather, bookkeeping; the copies of small
               leaves run in it too);
  per device   DataParallel(identity) on a (64, 4) float32 array over 64
               virtual devices, / 64, the calling thread and the replicas'
               worker threads (apply_job_main); thread switches are not
               instructions and are not in it;
  replicate    dpmini.replicate of a module of 1,000 float32 parameters of
               32 KiB onto 2 devices, per call and per parameter, the calling
               thread only (the copies themselves run on the device workers).
"""
import argparse
import os
import re
import shutil
import subprocess
import sys

CHILD = r"""
import os, sys
os.environ["DPMINI_CPU_DEVICES"] = "64"
import numpy as np, dpmini
mode, calls = sys.argv[1], int(sys.argv[2])
class Identity:
    def __call__(self, x):
        return x
class Params:
    def __init__(self, n, nbytes):
        self.params = [np.full(nbytes // 4, i, dtype=np.float32) for i in range(n)]
    def __call__(self, x):
        return x
if mode in ("leaves100", "leaves1"):
    n = 100 if mode == "leaves100" else 1
    dp = dpmini.DataParallel(Identity(), device_ids=["cpu:0", "cpu:1"])
    x = {f"k{i}": np.full((8, 4), i, dtype=np.float32) for i in range(n)}
    for _ in range(20):
        dp.forward(x)
    for _ in range(calls):
        dp(x)
elif mode == "devices":
    dp = dpmini.DataParallel(Identity(), device_ids=[f"cpu:{i}" for i in range(64)])
    x = np.ones((64, 4), np.float32)
    for _ in range(20):
        dp.forward(x)
    for _ in range(calls):
        dp(x)
else:
    m = Params(1000, 32 * 1024)
    devs = ["cpu:0", "cpu:1"]
    warm = dpmini.DataParallel(m, device_ids=devs)
    for _ in range(3):
        warm.replicate(m, devs)
    for _ in range(calls):
        dpmini.replicate(m, devs)
"""

TOGGLES = {
    "leaves100": ["DataParallel_call"],
    "leaves1": ["DataParallel_call"],
    "devices": ["DataParallel_call", "apply_job_main"],
    "replicate": ["dp_replicate"],
}


def collected(mode, calls):
    """Instructions callgrind counted in `calls` calls of `mode`."""
    cmd = ["valgrind", "--tool=callgrind", "--callgrind-out-file=/dev/null"]
    cmd += [f"--toggle-collect={fn}" for fn in TOGGLES[mode]]
    cmd += [sys.executable, "-c", CHILD, mode, str(calls)]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
    m = re.search(r"Collected\s*:\s*(\d+)", res.stderr)
    if res.returncode != 0 or m is None:
        raise RuntimeError(f"callgrind run of {mode} failed:\n{res.stderr[-2000:]}")
    return int(m.group(1))


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--calls", type=int, default=50, help="counted calls per figure (default 50)")
    args = p.parse_args(argv)
    if args.calls < 1:
        p.error("--calls must be at least 1")
    if shutil.which("valgrind") is None:
        print("valgrind not found: no instruction counts (apt-get install valgrind)")
        return 0
    n = args.calls
    many, one = collected("leaves100", n), collected("leaves1", n)
    print(f"per leaf (dict of 100 (8, 4) leaves, 2 devices): {(many - one) / n / 99:,.0f} "
          f"instructions (100 leaves: {many / n:,.0f} a call, 1 leaf: {one / n:,.0f})")
    dev = collected("devices", n)
    print(f"per device ((64, 4) input, 64 devices, caller + workers): {dev / n / 64:,.0f} "
          f"instructions ({dev / n:,.0f} a call)")
    rep_calls = max(1, n // 10)
    rep = collected("replicate", rep_calls)
    print(f"replicate (1,000 x 32 KiB parameters, 2 devices, caller): {rep / rep_calls:,.0f} "
          f"instructions a call, {rep / rep_calls / 1000:,.0f} a parameter")
    return 0


if __name__ == "__main__":
    sys.exit(main())
