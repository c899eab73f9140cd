"""Worker for the job-ending and torch DDP cases of tests/test_distributed.py.

    mpirun -np 4 python tests/distributed/jobs_worker.py CASE

Lines "<rank> OK <what>" / "<rank> ERR <case> <Type>: <message>" go to
$DIST_TEST_OUT/rank<r>.txt as in worker.py; values are asserted here.
"""
import os
import sys
import time

import numpy as np

import dpmini.distributed as dist
from mpi4py import MPI

CASE = sys.argv[1]
RANK = MPI.COMM_WORLD.Get_rank()


def say(msg):
    line = f"{RANK} {msg}".replace("\n", "|")
    print(line, flush=True)
    out = os.environ.get("DIST_TEST_OUT")
    if out:
        with open(os.path.join(out, f"rank{RANK}.txt"), "a") as f:
            f.write(line + "\n")


def case_exit_before_init():
    """The last rank returns normally without calling init(); the others'
    init times out and they exit with code 1 through MPI_Finalize."""
    if RANK == MPI.COMM_WORLD.Get_size() - 1:
        say("left before init")
        return
    try:
        dist.init(timeout=3.0)
    except TimeoutError as exc:   # uncaught, as in a script: the rank ends with code 1
        say(f"ERR init {type(exc).__name__}: {exc}")
        raise


def case_staggered_finish():
    """Every rank finishes, rank r after r * 0.4 s: the early ones wait in the
    exit agreement and every rank finalizes normally (exit code 0)."""
    dist.init(timeout=10.0)
    assert dist.all_reduce(np.ones(2)).tolist() == [dist.size()] * 2
    time.sleep(0.4 * RANK)
    say("finished")


def case_exit_code_kept():
    """The last rank ends with sys.exit(3) after the last collective; the
    agreement passes and the job's exit code is that rank's."""
    dist.init(timeout=10.0)
    dist.barrier()
    say("finished")
    if RANK == dist.size() - 1:
        sys.exit(3)


def case_finish_then_raise():
    """Rank 0 finishes at once; rank 1 raises a moment later (the job is aborted
    while rank 0 waits in the exit agreement, not in MPI_Finalize)."""
    dist.init(timeout=30.0)
    dist.barrier()
    if RANK == 1:
        time.sleep(0.5)
        raise RuntimeError("boom on rank 1 after rank 0 finished")
    if RANK > 1:
        time.sleep(1.0)
    say("finished")


def case_finish_while_others_work():
    """The last rank finishes while the others keep working past the timeout
    without a collective (a checkpoint written at the end): it waits for them
    at exit, and every rank finalizes normally."""
    MPI.COMM_WORLD.Barrier()   # the ranks reach the short-timeout init together
    dist.init(timeout=2.0)
    dist.barrier()
    if RANK != dist.size() - 1:
        time.sleep(8.0)
    say("finished")


def _torch_model(torch, seed):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(),
                               torch.nn.Linear(16, 3)).double()


def _gloo(torch):
    """torch.distributed on gloo under mpirun (rank and size from Open MPI's env)."""
    import torch.distributed as tdist
    if not tdist.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", os.environ.get("DIST_TEST_PORT", "29533"))
        tdist.init_process_group("gloo", rank=RANK, world_size=MPI.COMM_WORLD.Get_size())
    return tdist


def case_torch_ddp():
    """Gradient hooks: after loss.backward() every rank's grads are the
    single-process mean gradient (uneven split: exact), equal to torch DDP on
    gloo where the batch divides, and 3 SGD steps match single-process training."""
    import torch
    dist.init(timeout=60.0)
    P = dist.size()
    for n in (4 * P, 4 * P + 3, 3):   # divides; uneven; fewer rows than ranks
        model = _torch_model(torch, seed=RANK)              # differs until broadcast
        ddp = dist.DistributedDataParallel(model, device_ids=["cpu:0"], bucket_cap_mb=0.0005)
        assert len(ddp.reducer.buckets) > 1                  # several buckets in flight
        ref = _torch_model(torch, seed=0)
        g = torch.Generator().manual_seed(n)
        X, Y = torch.randn(n, 6, generator=g, dtype=torch.float64), torch.randn(
            n, 3, generator=g, dtype=torch.float64)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
        for step in range(3):
            xs, ys = dist.scatter(X.numpy()), dist.scatter(Y.numpy())
            opt.zero_grad()
            out = ddp(torch.from_numpy(xs))
            loss = ((out - torch.from_numpy(ys)) ** 2).mean() if len(xs) else out.sum() * 0.0
            loss.backward()
            ref_opt.zero_grad()
            ((ref(X) - Y) ** 2).mean().backward()
            for (name, p), q in zip(model.named_parameters(), ref.parameters()):
                diff = float((p.grad - q.grad).abs().max())
                assert diff <= 1e-12, (n, step, name, diff)
            opt.step()
            ref_opt.step()
        for p, q in zip(model.parameters(), ref.parameters()):
            assert float((p - q).detach().abs().max()) <= 1e-12, n
            assert np.array_equal(dist.broadcast(p.detach().numpy()), p.detach().numpy())
        ddp.reducer.remove()
    say("OK torch_ddp")


def case_torch_ddp_vs_gloo():
    """Where the batch divides, dpmini's hooks give torch DDP's gradients."""
    import torch
    dist.init(timeout=60.0)
    tdist = _gloo(torch)
    P = dist.size()
    n = 4 * P
    g = torch.Generator().manual_seed(5)
    X, Y = torch.randn(n, 6, generator=g, dtype=torch.float64), torch.randn(
        n, 3, generator=g, dtype=torch.float64)
    xs, ys = torch.from_numpy(dist.scatter(X.numpy())), torch.from_numpy(dist.scatter(Y.numpy()))
    ours = _torch_model(torch, seed=0)
    ddp = dist.DistributedDataParallel(ours, device_ids=["cpu:0"])
    ((ddp(xs) - ys) ** 2).mean().backward()
    theirs = torch.nn.parallel.DistributedDataParallel(_torch_model(torch, seed=0))
    ((theirs(xs) - ys) ** 2).mean().backward()
    for p, q in zip(ours.parameters(), theirs.module.parameters()):
        assert float((p.grad - q.grad).abs().max()) <= 1e-12
    tdist.destroy_process_group()
    say("OK torch_ddp_vs_gloo")


def case_hosts():
    """Across tools/multihost.py's hosts (2 ranks each): two hostnames, the
    local ranks per host, and the collectives' values over TCP."""
    import socket
    dist.init(timeout=60.0)
    P = dist.size()
    names = MPI.COMM_WORLD.allgather(socket.gethostname())
    assert len(set(names)) == 2, names
    assert dist.local_size() == 2 and dist.local_rank() == RANK % 2, (dist.local_size(),
                                                                      dist.local_rank())
    big = np.arange(3_000_000, dtype=np.float64) * (RANK + 1)   # 24 MB: many TCP frames
    got = dist.all_reduce(big)
    assert np.array_equal(got, np.arange(3_000_000, dtype=np.float64) * (P * (P + 1) // 2))
    x = dist.scatter(np.arange(22.0).reshape(11, 2) if RANK == 0 else None)
    back = dist.gather(x)
    if RANK == 0:
        assert np.array_equal(back, np.arange(22.0).reshape(11, 2))
    say(f"OK hosts {names[RANK]}")

def case_torch_ddp_skipped_backward():
    """Rank 3 skips the backward pass of step 1 (as for a NaN loss): at its next
    backward every rank raises the same ValueError naming the steps' tags."""
    import torch
    dist.init(timeout=30.0)
    model = _torch_model(torch, seed=0)
    ddp = dist.DistributedDataParallel(model, device_ids=["cpu:0"])
    x, y = torch.randn(4, 6, dtype=torch.float64), torch.randn(4, 3, dtype=torch.float64)
    for step in range(3):
        loss = ((ddp(x) - y) ** 2).mean()
        if step == 1 and RANK == 3:
            continue
        try:
            loss.backward()
        except ValueError as exc:
            say(f"ERR skipped {type(exc).__name__}: {exc}")
            break
    assert float(dist.all_reduce(np.float64(1.0))) == dist.size()   # still usable
    say("OK usable")

def case_torch_ddp_no_sync():
    """no_sync(): two micro-batches accumulated locally, the third synchronized,
    rank r with r + 1 rows per micro-batch (uneven): after each step's backward
    every rank's grads are what one process gets accumulating the three
    micro-batches made of every rank's j-th rows (each loss its mean), and two
    SGD steps match single-process training."""
    import torch
    dist.init(timeout=60.0)
    P = dist.size()
    model = _torch_model(torch, seed=RANK)
    ddp = dist.DistributedDataParallel(model, device_ids=["cpu:0"], bucket_cap_mb=0.0005)
    ref = _torch_model(torch, seed=0)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    rows = [r + 1 for r in range(P)]
    start = sum(rows[:RANK])
    g = torch.Generator().manual_seed(11)
    for step in range(2):
        micro = [(torch.randn(sum(rows), 6, generator=g, dtype=torch.float64),
                  torch.randn(sum(rows), 3, generator=g, dtype=torch.float64))
                 for _ in range(3)]
        opt.zero_grad()
        ref_opt.zero_grad()
        for j, (X, Y) in enumerate(micro):
            x, y = X[start:start + rows[RANK]], Y[start:start + rows[RANK]]
            if j < 2:
                with ddp.no_sync():
                    ((ddp(x) - y) ** 2).mean().backward()
            else:
                ((ddp(x) - y) ** 2).mean().backward()
            ((ref(X) - Y) ** 2).mean().backward()
        assert ddp.sync_rows == 3 * rows[RANK] and ddp.step == step + 1, (ddp.sync_rows, ddp.step)
        for (name, p), q in zip(model.named_parameters(), ref.parameters()):
            diff = float((p.grad - q.grad).abs().max())
            assert diff <= 1e-12, (step, name, diff)
        opt.step()
        ref_opt.step()
    for p, q in zip(model.parameters(), ref.parameters()):
        assert float((p - q).detach().abs().max()) <= 1e-12
    # a synchronized step after no_sync is back to one micro-batch
    opt.zero_grad()
    X = torch.randn(sum(rows), 6, generator=g, dtype=torch.float64)
    Y = torch.randn(sum(rows), 3, generator=g, dtype=torch.float64)
    ((ddp(X[start:start + rows[RANK]]) - Y[start:start + rows[RANK]]) ** 2).mean().backward()
    ref_opt.zero_grad()
    ((ref(X) - Y) ** 2).mean().backward()
    assert ddp.sync_rows == rows[RANK]
    for p, q in zip(model.parameters(), ref.parameters()):
        assert float((p.grad - q.grad).abs().max()) <= 1e-12
    ddp.reducer.remove()
    say("OK torch_ddp_no_sync")


if __name__ == "__main__":
    globals()["case_" + CASE]()
