"""A torch training step: dpmini.distributed.DistributedDataParallel's gradient
hooks against torch.nn.parallel.DistributedDataParallel on gloo and against a
hand-written mpi4py step, same model.

    mpirun -np 2 python benchmarks/bench_ddp_torch.py [--width 512] [--layers 4] [--rows 64]

All three run in the same job (torch.distributed on gloo gets its rank and
size from Open MPI's environment), interleaved step by step (each goes first
in turn) so that all see the same machine load; each step is forward, loss,
backward (with the all-reduce), SGD step, after a barrier. The hand-written
step is what a user would write with mpi4py alone: backward, then every
gradient times this rank's rows flattened into one buffer with the rows last,
one ``comm.Allreduce`` (no guard, no overlap with the backward), divided by the
summed rows and copied back (the same uneven-batch weighting as dpmini's).
Printed on rank 0: the median step time of each over the measured rounds (the
slowest rank's) and the ratios dpmini / torch and dpmini / mpi4py (below 1:
dpmini faster), and, on an uneven split (rows + 1 on rank 0), each one's
largest gradient difference from one process on the whole batch (float64
run): torch's DDP divides by the rank count, dpmini weights by rows.
"""
import argparse
import os
import statistics
import time

import numpy as np
import torch
import torch.distributed as tdist
from mpi4py import MPI

import dpmini.distributed as dist


def model_of(width, layers, dtype, seed=0):
    torch.manual_seed(seed)
    mods = []
    for i in range(layers):
        mods += [torch.nn.Linear(width, width), torch.nn.Tanh()]
    return torch.nn.Sequential(*mods[:-1]).to(dtype)


def step(model, opt, x, y):
    opt.zero_grad()
    loss = ((model(x) - y) ** 2).mean()
    loss.backward()
    opt.step()


def mpi4py_step(model, opt, x, y, rows, comm):
    """One step with the gradients all-reduced by hand: one flat buffer, one Allreduce."""
    opt.zero_grad()
    loss = ((model(x) - y) ** 2).mean()
    loss.backward()
    params = [p for p in model.parameters()]
    flat = torch.cat([p.grad.reshape(-1) * rows for p in params]
                     + [torch.tensor([float(rows)], dtype=params[0].dtype)])
    total = np.empty(flat.numel(), dtype=np.float32)
    comm.Allreduce(flat.numpy(), total)
    total = torch.from_numpy(total)
    summed = float(total[-1])
    off = 0
    for p in params:
        n = p.numel()
        torch.div(total[off:off + n].view(p.shape), summed, out=p.grad)
        off += n
    opt.step()


def timing(a):
    rank, P = dist.rank(), dist.size()
    ours_m = model_of(a.width, a.layers, torch.float32)
    ours = dist.DistributedDataParallel(ours_m, device_ids=["cpu:0"], bucket_cap_mb=a.bucket_mb)
    theirs = torch.nn.parallel.DistributedDataParallel(
        model_of(a.width, a.layers, torch.float32), bucket_cap_mb=a.bucket_mb)
    hand = model_of(a.width, a.layers, torch.float32)
    o1 = torch.optim.SGD(ours_m.parameters(), lr=1e-3)
    o2 = torch.optim.SGD(theirs.parameters(), lr=1e-3)
    o3 = torch.optim.SGD(hand.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(a.rows, a.width, generator=g)
    y = torch.randn(a.rows, a.width, generator=g)
    t_ours, t_theirs, t_hand = [], [], []
    runs = [(lambda: step(ours, o1, x, y), t_ours), (lambda: step(theirs, o2, x, y), t_theirs),
            (lambda: mpi4py_step(hand, o3, x, y, a.rows, MPI.COMM_WORLD), t_hand)]
    for i in range(a.warmup + a.rounds):
        for k in range(3):   # each goes first in turn
            run, times = runs[(i + k) % 3]
            MPI.COMM_WORLD.Barrier()
            s = time.perf_counter()
            run()
            if i >= a.warmup:
                times.append(time.perf_counter() - s)
    # A step is as slow as its slowest rank.
    mo = MPI.COMM_WORLD.allreduce(statistics.median(t_ours), op=MPI.MAX)
    mt = MPI.COMM_WORLD.allreduce(statistics.median(t_theirs), op=MPI.MAX)
    mh = MPI.COMM_WORLD.allreduce(statistics.median(t_hand), op=MPI.MAX)
    params = sum(p.numel() for p in ours_m.parameters())
    if rank == 0:
        print(f"ranks {P}, model {a.layers}x Linear({a.width}) = {params} float32 parameters, "
              f"{a.rows} rows per rank, buckets {a.bucket_mb} MiB, {a.rounds} rounds")
        print(f"  step time  dpmini hooks {mo * 1e3:8.2f} ms   torch DDP gloo {mt * 1e3:8.2f} ms"
              f"   mpi4py by hand {mh * 1e3:8.2f} ms")
        print(f"  ratio dpmini/torch {mo / mt:5.2f}   dpmini/mpi4py {mo / mh:5.2f}"
              f"   (load average {os.getloadavg()[0]:.1f})")


def exactness(a):
    rank, P = dist.rank(), dist.size()
    sizes = [a.rows + (1 if r == 0 else 0) for r in range(P)]
    n = sum(sizes)
    g = torch.Generator().manual_seed(123)
    X = torch.randn(n, a.width, generator=g, dtype=torch.float64)
    Y = torch.randn(n, a.width, generator=g, dtype=torch.float64)
    start = sum(sizes[:rank])
    x, y = X[start:start + sizes[rank]], Y[start:start + sizes[rank]]
    ref = model_of(a.width, 2, torch.float64)
    ((ref(X) - Y) ** 2).mean().backward()
    ours_m = model_of(a.width, 2, torch.float64)
    ours = dist.DistributedDataParallel(ours_m, device_ids=["cpu:0"])
    ((ours(x) - y) ** 2).mean().backward()
    theirs = torch.nn.parallel.DistributedDataParallel(model_of(a.width, 2, torch.float64))
    ((theirs(x) - y) ** 2).mean().backward()

    def worst(m):
        return max(float((p.grad - q.grad).abs().max()) for p, q in zip(m.parameters(),
                                                                           ref.parameters()))
    d_ours = MPI.COMM_WORLD.allreduce(worst(ours_m), op=MPI.MAX)
    d_theirs = MPI.COMM_WORLD.allreduce(worst(theirs.module), op=MPI.MAX)
    if rank == 0:
        print(f"uneven split {sizes} (float64): largest gradient difference from one process "
              f"dpmini {d_ours:.2e}, torch DDP {d_theirs:.2e}")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--width", type=int, default=512)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--rows", type=int, default=64)
    ap.add_argument("--bucket-mb", type=float, default=1.0)
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=5)
    a = ap.parse_args()
    torch.set_num_threads(1)
    dist.init(timeout=120.0)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29555")
    tdist.init_process_group("gloo", rank=dist.rank(), world_size=dist.size())
    timing(a)
    exactness(a)
    tdist.destroy_process_group()


if __name__ == "__main__":
    main()
