"""dpmini.distributed against raw mpi4py, in the same run (run it under mpirun).

Run: mpirun -np 4 python benchmarks/bench_distributed.py [--size-mib 256]
     [--reduce-mib 64] [--repeats 5] [--calls 2000]      (`make bench-distributed`)
A script that prints figures on rank 0, not a test; it always exits 0.

1. scatter then gather of one float32 array (default 256 MiB, 4096 x 16384)
   from/to rank 0, along dim 0 and dim 1, best of --repeats rounds, for
     dpmini  dist.scatter(x, dim=d) then dist.gather(piece, dim=d): the guard
             (one metadata record to and from every rank), plan.c's split, MPI
             derived datatypes for dim 1 (no staging copy), a fresh output;
     raw     comm.Scatterv / comm.Gatherv of the same bytes as contiguous
             pieces into preallocated buffers (no guard, no plan, and along
             dim 1 it moves the same byte counts, not the columns);
     packed  along dim 1 only: raw plus the NumPy a user needs to move
             columns (np.ascontiguousarray of each rank's columns on root
             before Scatterv, np.concatenate of the pieces after Gatherv);
             dpmini packs in C (one memcpy per block row), so "dpmini / packed"
             is the guard and planning cost, "dpmini / raw" adds the packing.
2. all_reduce of a float32 array (default 64 MiB): dist.all_reduce(x) (guard,
   a fresh result) against comm.Allreduce(x, out) into a fresh np.empty_like.
3. Per-call cost on a (8, 4) float32 array: scatter+gather and all_reduce,
   mean over --calls calls, next to the raw mpi4py calls.
Target: dpmini within 1.10x of raw on the large arrays (dim 1: of "packed").
"""
import argparse
import sys
import time

import numpy as np
from mpi4py import MPI

import dpmini.distributed as dist

COLS = 16384
TARGET = 1.10


def best(fn, repeats, comm):
    fn()                                  # warm-up
    times = []
    for _ in range(repeats):
        comm.Barrier()
        start = time.perf_counter()
        fn()
        comm.Barrier()
        times.append(time.perf_counter() - start)
    return min(times)


def mean_call(fn, calls, comm):
    for _ in range(min(calls, 50)):
        fn()
    comm.Barrier()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    comm.Barrier()
    return (time.perf_counter() - start) / calls


def raw_scatter_gather(comm, x, rows_shape, counts):
    rank = comm.Get_rank()
    displs = np.concatenate([[0], np.cumsum(counts)[:-1]])
    piece = np.empty(counts[rank], np.float32)
    send = [x, (counts, displs), MPI.FLOAT] if rank == 0 else None
    comm.Scatterv(send, piece, root=0)
    out = np.empty(rows_shape, np.float32) if rank == 0 else None
    comm.Gatherv(piece, [out, (counts, displs), MPI.FLOAT] if rank == 0 else None, root=0)
    return out


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--size-mib", type=int, default=256)
    p.add_argument("--reduce-mib", type=int, default=64)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--calls", type=int, default=2000)
    args = p.parse_args(argv)
    dist.init(timeout=120)
    comm, rank, P = MPI.COMM_WORLD, dist.rank(), dist.size()
    say = print if rank == 0 else (lambda *a, **k: None)

    rows = args.size_mib * 2 ** 20 // (4 * COLS)
    x = np.random.default_rng(0).random((rows, COLS), dtype=np.float32) if rank == 0 else None
    say(f"{P} ranks, {MPI.Get_library_version().splitlines()[0].strip()}, "
        f"Python {sys.version.split()[0]}, NumPy {np.__version__}")
    say(f"1. scatter + gather of {args.size_mib} MiB float32 ({rows} x {COLS}), best of "
        f"{args.repeats}")
    say("| dim | dpmini | raw mpi4py Scatterv+Gatherv | raw + NumPy packing | dpmini / raw "
        "| dpmini / packed |")
    say("|---|---|---|---|---|---|")
    ratios = []
    for dim in (0, 1):
        def ours():
            back = dist.gather(dist.scatter(x, dim=dim), dim=dim)
            if rank == 0:
                assert back.shape == x.shape
        n = rows if dim == 0 else COLS
        other = COLS if dim == 0 else rows
        counts = np.array(dist.split_sizes(n, P)) * other
        flat = x.reshape(-1) if rank == 0 else None

        def raw():
            raw_scatter_gather(comm, flat, (rows * COLS,), counts)

        def packed():
            cols = np.concatenate([[0], np.cumsum(dist.split_sizes(COLS, P))])
            staged = (np.concatenate([np.ascontiguousarray(x[:, a:b]).reshape(-1)
                                      for a, b in zip(cols[:-1], cols[1:])])
                      if rank == 0 else None)
            back = raw_scatter_gather(comm, staged, (rows * COLS,), counts)
            if rank == 0:
                np.concatenate([back[rows * a:rows * b].reshape(rows, b - a)
                                for a, b in zip(cols[:-1], cols[1:])], axis=1)
        t_ours, t_raw = best(ours, args.repeats, comm), best(raw, args.repeats, comm)
        if dim == 0:
            ratios.append(t_ours / t_raw)
            say(f"| 0 | {t_ours * 1e3:.1f} ms | {t_raw * 1e3:.1f} ms | (not needed) | "
                f"{t_ours / t_raw:.2f}x | |")
        else:
            t_packed = best(packed, args.repeats, comm)
            ratios.append(t_ours / t_packed)
            say(f"| 1 | {t_ours * 1e3:.1f} ms | {t_raw * 1e3:.1f} ms | {t_packed * 1e3:.1f} ms | "
                f"{t_ours / t_raw:.2f}x | {t_ours / t_packed:.2f}x |")
    if rank == 0:
        back = dist.gather(dist.scatter(x, dim=1), dim=1)
        assert np.array_equal(back, x)
    else:
        dist.gather(dist.scatter(None, dim=1), dim=1)
    del x

    m = args.reduce_mib * 2 ** 20 // 4
    y = np.full(m, float(rank + 1), np.float32)
    say(f"\n2. all_reduce of {args.reduce_mib} MiB float32, best of {args.repeats}")

    def raw_ar():
        out = np.empty_like(y)
        comm.Allreduce(y, out, op=MPI.SUM)
    t_ours = best(lambda: dist.all_reduce(y), args.repeats, comm)
    t_raw = best(raw_ar, args.repeats, comm)
    ratios.append(t_ours / t_raw)
    say("| all_reduce | dpmini | raw mpi4py Allreduce | dpmini / raw |\n|---|---|---|---|")
    say(f"| {args.reduce_mib} MiB | {t_ours * 1e3:.1f} ms | {t_raw * 1e3:.1f} ms | "
        f"{t_ours / t_raw:.2f}x |")
    assert dist.all_reduce(y)[0] == P * (P + 1) / 2
    del y

    small = np.ones((8, 4), np.float32)
    say(f"\n3. per call on an (8, 4) float32 array, mean of {args.calls} calls")
    counts = np.array(dist.split_sizes(8, P)) * 4

    def ours_sg():
        dist.gather(dist.scatter(small if rank == 0 else None))
    sflat = small.reshape(-1)
    t1 = mean_call(ours_sg, args.calls, comm)
    t2 = mean_call(lambda: raw_scatter_gather(comm, sflat, (32,), counts), args.calls, comm)
    t3 = mean_call(lambda: dist.all_reduce(small), args.calls, comm)
    t4 = mean_call(lambda: comm.Allreduce(small, np.empty_like(small)), args.calls, comm)
    say("| call | dpmini | raw mpi4py |\n|---|---|---|")
    say(f"| scatter + gather | {t1 * 1e6:.0f} us | {t2 * 1e6:.0f} us |")
    say(f"| all_reduce | {t3 * 1e6:.0f} us | {t4 * 1e6:.0f} us |")
    say(f"\ntarget: large arrays within {TARGET:.2f}x of raw mpi4py: "
        + ("met" if max(ratios) <= TARGET else f"NOT met (worst {max(ratios):.2f}x)"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
