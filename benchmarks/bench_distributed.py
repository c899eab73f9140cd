"""dpmini.distributed against raw mpi4py, in the same run (run it under mpirun).

Run: mpirun -np 2 --bind-to core python benchmarks/bench_distributed.py
     mpirun -np 4 python benchmarks/bench_distributed.py      (`make bench-distributed`)
     options: --sizes 32,65536,... (bytes per call) --calls N --ops all_reduce,broadcast,...
A script that prints figures on rank 0, not a test; it always exits 0.

For each collective and size, the dpmini call and the raw mpi4py call are
interleaved (dpmini, raw, raw, dpmini, ...: neither always goes first), each
after a Barrier, and each call is timed on every rank; a figure is the median
over the calls of that rank, the slowest rank's median reported. Every call
makes a fresh result, as dpmini's does:

  all_reduce  dist.all_reduce(x)               comm.Allreduce(x, np.empty_like(x))
  broadcast   dist.broadcast(x or None)        comm.Bcast(x or np.empty(n)), root 0
  scatter     dist.scatter(x or None)          comm.Scatter(x, np.empty(n / P)), root 0
  gather      dist.gather(piece)               comm.Gather(piece, np.empty(n) on root)

dpmini's calls are guarded (every rank checks every other rank's call first:
collective, call number, shape, dtype, op, root) and raw mpi4py's are not.
Targets (the issue's): <= 2x raw at 32 bytes (8 float32) and <= 1.25x raw from
64 KiB to 64 MiB; the last column says whether each figure meets them.
"""
import argparse
import os
import sys
import time

import numpy as np
from mpi4py import MPI

import dpmini.distributed as dist

SIZES = [32, 64 << 10, 1 << 20, 4 << 20, 16 << 20, 64 << 20]
OPS = ["all_reduce", "broadcast", "scatter", "gather"]


def target(nbytes):
    """The ratio to meet at this size (None: no target)."""
    if nbytes <= 32:
        return 2.0
    if (64 << 10) <= nbytes <= (64 << 20):
        return 1.25
    return None


def calls_for(nbytes, calls):
    """Calls per side: many for small arrays, fewer for large ones."""
    if calls:
        return calls
    return int(max(11, min(2001, (2 << 30) // max(nbytes, 1) // 8)))


def pair(op, n, comm):
    """(dpmini call, raw call) for `op` on n float32 elements."""
    rank, P = comm.Get_rank(), comm.Get_size()
    x = np.full(n, float(rank + 1), np.float32)
    piece = np.full(n // P, float(rank + 1), np.float32)
    if op == "all_reduce":
        return (lambda: dist.all_reduce(x),
                lambda: comm.Allreduce(x, np.empty_like(x)))
    if op == "broadcast":
        return (lambda: dist.broadcast(x if rank == 0 else None),
                lambda: comm.Bcast(x if rank == 0 else np.empty(n, np.float32), root=0))
    if op == "scatter":
        return (lambda: dist.scatter(x if rank == 0 else None),
                lambda: comm.Scatter(x if rank == 0 else None,
                                     np.empty(n // P, np.float32), root=0))
    if op == "gather":
        return (lambda: dist.gather(piece),
                lambda: comm.Gather(piece, np.empty(n // P * P, np.float32) if rank == 0
                                    else None, root=0))
    raise ValueError(op)


def interleaved(ours, raw, calls, comm):
    """Per-call seconds (this rank's median) of ours and raw, alternating."""
    t_ours, t_raw = [], []
    for fn in (ours, raw):   # warm-up (the first call allocates buffers)
        for _ in range(3):
            fn()
    for i in range(calls):
        order = ((ours, t_ours), (raw, t_raw)) if i % 2 == 0 else ((raw, t_raw), (ours, t_ours))
        for fn, times in order:
            comm.Barrier()
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
    return float(np.median(t_ours)), float(np.median(t_raw))


def fmt(seconds):
    return f"{seconds * 1e6:.1f} us" if seconds < 1e-3 else f"{seconds * 1e3:.2f} ms"


def size_text(nbytes):
    if nbytes < 1024:
        return f"{nbytes} B ({nbytes // 4} float32)"
    return f"{nbytes >> 10} KiB" if nbytes < (1 << 20) else f"{nbytes >> 20} MiB"


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--sizes", default=",".join(str(s) for s in SIZES),
                   help="bytes per call, comma-separated")
    p.add_argument("--ops", default=",".join(OPS))
    p.add_argument("--calls", type=int, default=0, help="calls per side (default: by size)")
    args = p.parse_args(argv)
    dist.init(timeout=300)
    comm = MPI.COMM_WORLD
    rank, P = comm.Get_rank(), comm.Get_size()
    say = print if rank == 0 else (lambda *a, **k: None)
    load0 = os.getloadavg()
    mpi = MPI.Get_library_version().replace("\0", "").splitlines()[0].strip()
    say(f"{P} ranks, {mpi}, Python "
        f"{sys.version.split()[0]}, NumPy {np.__version__}, {os.cpu_count()} CPUs, load "
        f"average {load0[0]:.1f} at the start")
    say("| collective | size | dpmini | raw mpi4py | dpmini / raw | target |")
    say("|---|---|---|---|---|---|")
    missed = []
    for op in args.ops.split(","):
        for nbytes in (int(s) for s in args.sizes.split(",")):
            n = max(P, nbytes // 4 // P * P)
            ours, raw = pair(op, n, comm)
            t_ours, t_raw = interleaved(ours, raw, calls_for(nbytes, args.calls), comm)
            t_ours = comm.allreduce(t_ours, op=MPI.MAX)
            t_raw = comm.allreduce(t_raw, op=MPI.MAX)
            ratio = t_ours / t_raw
            goal = target(nbytes)
            verdict = "" if goal is None else (f"<= {goal}x: met" if ratio <= goal
                                               else f"<= {goal}x: NOT met")
            if goal is not None and ratio > goal:
                missed.append(f"{op} {size_text(nbytes)} {ratio:.2f}x")
            say(f"| {op} | {size_text(nbytes)} | {fmt(t_ours)} | {fmt(t_raw)} | "
                f"{ratio:.2f}x | {verdict} |")
    say(f"\nload average {os.getloadavg()[0]:.1f} at the end; targets "
        + ("met everywhere" if not missed else "NOT met: " + ", ".join(missed)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
