"""Worker for tests/test_distributed_ddp.py: DistributedDataParallel around torch
modules under mpirun, one case per launch.

    mpirun -np 2 python tests/distributed/ddp_worker.py CASE

Lines "<rank> OK <what>" / "<rank> ERR <case> <Type>: <message>" go to
$DIST_TEST_OUT/rank<r>.txt as in worker.py; values are asserted here (a failed
assert ends the job non-zero through dpmini's abort hook).
"""
import os
import sys

import numpy as np
import torch
from torch import nn

import dpmini.distributed as dist

CASE = sys.argv[1]
RANK = 0


def say(msg):
    line = f"{RANK} {msg}".replace("\n", "|")
    print(line, flush=True)
    out = os.environ.get("DIST_TEST_OUT")
    if out:
        with open(os.path.join(out, f"rank{RANK}.txt"), "a") as f:
            f.write(line + "\n")


def err(case, exc):
    say(f"ERR {case} {type(exc).__name__}: {exc}")


class Scaled(nn.Module):
    """A linear layer times a learnable 0-dim temperature, then BatchNorm."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(3, 3)
        self.logit_scale = nn.Parameter(torch.tensor(2.0))
        self.bn = nn.BatchNorm1d(3)

    def forward(self, x):
        return self.bn(self.lin(x) * self.logit_scale.exp())


def case_zero_dim_arrays():
    """0-dim parameters and buffers (num_batches_tracked) are broadcast with their shape."""
    torch.manual_seed(RANK)
    m = Scaled().double()
    with torch.no_grad():
        m.logit_scale.fill_(float(RANK + 1))
        m.bn.num_batches_tracked.fill_(RANK + 5)
    dist.DistributedDataParallel(m, device_ids=["cpu:0"])
    assert m.logit_scale.shape == () and m.logit_scale.item() == 1.0
    assert m.bn.num_batches_tracked.shape == () and m.bn.num_batches_tracked.item() == 5
    assert m.bn.num_batches_tracked.dtype == torch.int64
    w = dist.all_gather(m.lin.weight.detach()[None])
    assert all(torch.equal(w[0], w[i]) for i in range(len(w)))
    say("OK zero_dim_arrays")


if __name__ == "__main__":
    dist.init(timeout=float(os.environ.get("DIST_TEST_TIMEOUT", "30")))
    RANK = dist.rank()
    globals()["case_" + CASE]()
