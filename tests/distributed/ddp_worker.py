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


def _steps(ddp, model, n=2, rows=3):
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(n):
        opt.zero_grad()
        ddp(torch.randn(rows, 4, dtype=torch.float64)).pow(2).mean().backward()
        opt.step()


def _local_grad(model, x):
    return torch.autograd.grad(model(x).pow(2).sum(), model.weight)[0]


def _equal_on_every_rank(t):
    got = dist.all_gather(t.detach()[None])
    return all(torch.equal(got[0], got[i]) for i in range(len(got)))


def case_hooks_only_after_wrapper_forward():
    """Only the backward of a forward through the wrapper is reduced; a backward
    through the unwrapped module (on one rank or all), a second backward of the
    same graph, and one before the first forward stay local."""
    torch.manual_seed(0)
    model = nn.Linear(4, 2).double()
    ddp = dist.DistributedDataParallel(model, device_ids=["cpu:0"])
    model.zero_grad()
    x0 = torch.randn(2, 4, dtype=torch.float64) + RANK
    model(x0).pow(2).sum().backward()       # before any forward through the wrapper
    assert torch.equal(model.weight.grad, _local_grad(model, x0))
    torch.manual_seed(1 + RANK)
    _steps(ddp, model)
    assert _equal_on_every_rank(model.weight.grad)
    if RANK == 0:                            # one rank alone: must not wait for the others
        model.zero_grad()
        x = torch.randn(1, 4, dtype=torch.float64)
        model(x).sum().backward()
        assert torch.equal(model.weight.grad,
                           torch.autograd.grad(model(x).sum(), model.weight)[0])
    model.zero_grad()
    x = torch.randn(5, 4, dtype=torch.float64) * (RANK + 1)
    model(x).pow(2).sum().backward()         # every rank, unwrapped: local gradients
    assert torch.equal(model.weight.grad, _local_grad(model, x))
    model.zero_grad()
    loss = ddp(x).pow(2).mean()
    loss.backward(retain_graph=True)         # reduced
    reduced = model.weight.grad.clone()
    assert _equal_on_every_rank(reduced)
    model.zero_grad()
    loss.backward()                          # the same graph again: local
    assert torch.allclose(model.weight.grad, _local_grad(model, x) / 10, rtol=1e-14, atol=0)
    _steps(ddp, model, n=1)                  # the next step through the wrapper is reduced
    assert _equal_on_every_rank(model.weight.grad) and ddp.step == 4
    say("OK hooks_only_after_wrapper_forward")


def case_forward_without_backward():
    """A grad-mode forward through the wrapper on one rank with no backward after
    it (a validation forward under model.eval() only) changes nothing: the step
    counts reductions, and the next step pairs with the others' and is exact."""
    torch.manual_seed(0)
    model = nn.Linear(4, 1).double()
    ref = nn.Linear(4, 1).double()
    ref.load_state_dict(model.state_dict())
    ddp = dist.DistributedDataParallel(model, device_ids=["cpu:0"])
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(7)
    P = dist.size()
    for step in range(3):
        X = torch.randn(3 * P, 4, generator=g, dtype=torch.float64)
        opt.zero_grad()
        ddp(X[3 * RANK:3 * RANK + 3]).pow(2).mean().backward()
        opt.step()
        ref_opt.zero_grad()
        ref(X).pow(2).mean().backward()
        ref_opt.step()
        if RANK == 0 and step == 0:
            model.eval()
            ddp(torch.randn(5, 4, dtype=torch.float64)).pow(2).mean().item()
            model.train()
        assert float((model.weight - ref.weight).detach().abs().max()) <= 1e-12, step
    assert ddp.step == 3, ddp.step
    say("OK forward_without_backward")


def case_no_sync_after_forward_without_backward():
    """An eval-mode forward with grad on (no backward) on rank 0 alone, then
    no_sync() micro-batches: their backward stays local (no collective on rank 0
    alone, which would wait for the others until the timeout), and the next
    synchronized step is exact and paired."""
    torch.manual_seed(0)
    model = nn.Linear(4, 1).double()
    ref = nn.Linear(4, 1).double()
    ref.load_state_dict(model.state_dict())
    ddp = dist.DistributedDataParallel(model, device_ids=["cpu:0"])
    g = torch.Generator().manual_seed(3)
    P = dist.size()
    if RANK == 0:
        model.eval()
        ddp(torch.randn(5, 4, dtype=torch.float64)).pow(2).mean().item()
        model.train()
    micro = [torch.randn(3 * P, 4, generator=g, dtype=torch.float64) for _ in range(3)]
    model.zero_grad()
    with ddp.no_sync():
        for X in micro[:-1]:
            ddp(X[3 * RANK:3 * RANK + 3]).pow(2).mean().backward()
    assert ddp.step == 0, ddp.step
    ddp(micro[-1][3 * RANK:3 * RANK + 3]).pow(2).mean().backward()
    ref.zero_grad()
    for X in micro:
        ref(X).pow(2).mean().backward()
    assert ddp.step == 1, ddp.step
    diff = float((model.weight.grad - ref.weight.grad).abs().max())
    assert diff <= 1e-12, diff
    say("OK no_sync_after_forward_without_backward")


def case_skipped_backward():
    """The last rank skips a training step's backward alone: every rank gets the
    same ValueError at the next reduction, saying what to do; the communicator
    stays usable."""
    import numpy as np
    torch.manual_seed(0)
    model = nn.Linear(4, 2).double()
    ddp = dist.DistributedDataParallel(model, device_ids=["cpu:0"])
    x = torch.randn(3, 4, dtype=torch.float64)
    last = dist.size() - 1
    for step in range(3):
        model.zero_grad()
        loss = ddp(x).pow(2).mean()
        if step == 1 and RANK == last:
            continue
        try:
            loss.backward()
        except ValueError as exc:
            err("skipped", exc)
            break
    assert float(dist.all_reduce(np.float64(1.0))) == dist.size()
    say("OK usable")

def case_rewrap_each_epoch():
    """A new wrapper of the same model each epoch takes its hooks over (training
    matches one process); the older wrapper's forward raises; a collected
    wrapper's hooks and thread are gone."""
    import copy
    import gc
    import weakref
    torch.manual_seed(0)
    model = nn.Linear(4, 2).double()
    ref = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(3)
    P = dist.size()
    old = None
    for epoch in range(3):
        ddp = dist.DistributedDataParallel(model, device_ids=["cpu:0"])
        if epoch == 0:
            old = ddp
        X = torch.randn(3 * P, 4, generator=g, dtype=torch.float64)
        Y = torch.randn(3 * P, 2, generator=g, dtype=torch.float64)
        opt.zero_grad()
        ((ddp(X[3 * RANK:3 * RANK + 3]) - Y[3 * RANK:3 * RANK + 3]) ** 2).mean().backward()
        opt.step()
        ref_opt.zero_grad()
        ((ref(X) - Y) ** 2).mean().backward()
        ref_opt.step()
        assert float((model.weight - ref.weight).detach().abs().max()) <= 1e-12, epoch
    try:
        old(torch.randn(2, 4, dtype=torch.float64))
    except RuntimeError as exc:
        err("old_wrapper", exc)
    reducer = ddp.reducer
    thread = reducer._thread
    gone = weakref.ref(ddp)
    del ddp, old
    gc.collect()
    assert gone() is None and reducer._handles == [] and reducer._removed
    thread.join(timeout=10)
    assert not thread.is_alive()
    say("OK rewrap_each_epoch")


def _local_grads(model, x):
    return torch.autograd.grad(model(x).float().pow(2).mean(), list(model.parameters()))


def case_half_gradients():
    """float16 and bfloat16 gradients are reduced in float32 and rounded once:
    sum_r rows_r * g_r / sum_r rows_r in float32, then the parameter's dtype."""
    P = dist.size()
    for dtype in (torch.float16, torch.bfloat16):
        torch.manual_seed(0)
        model = nn.Linear(4, 2).to(dtype)
        ddp = dist.DistributedDataParallel(model, device_ids=["cpu:0"])
        rows = RANK + 2
        x = (torch.randn(rows, 4) * (RANK + 1)).to(dtype)
        local = _local_grads(model, x)
        every = [dist.all_gather(g.float()[None]) for g in local]
        all_rows = [r + 2 for r in range(P)]
        ddp(x).float().pow(2).mean().backward()
        for p, got in zip(model.parameters(), every):
            want = sum(n * got[r] for r, n in enumerate(all_rows)) / sum(all_rows)
            assert p.grad.dtype == dtype and torch.equal(p.grad, want.to(dtype)), (dtype, p.grad)
    say("OK half_gradients")


def case_sparse_gradients():
    """nn.Embedding(sparse=True): the reduced gradient comes back sparse, its
    dense form the rows-weighted mean of every rank's dense gradient."""
    P = dist.size()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(10, 3, sparse=True)).double()
    ddp = dist.DistributedDataParallel(model, device_ids=["cpu:0"])
    idx = torch.tensor([RANK, RANK + 1, 7])
    w = model[0].weight
    local = torch.autograd.grad(model(idx).pow(2).mean(), w)[0].to_dense()
    every = dist.all_gather(local[None])
    ddp(idx).pow(2).mean().backward()
    assert w.grad.is_sparse, w.grad.layout
    want = every.sum(0) / P                     # every rank has 3 rows
    assert torch.allclose(w.grad.to_dense(), want, rtol=1e-15, atol=0)
    torch.optim.SGD(model.parameters(), lr=0.1).step()   # SGD takes sparse gradients
    assert _equal_on_every_rank(w)
    say("OK sparse_gradients")


def case_half_all_reduce():
    """all_reduce / reduce of float16 and bfloat16 (NumPy, ml_dtypes, torch):
    summed in float32, rounded once, in the input's dtype; float16 on one rank
    and float32 on another is a ValueError on every rank."""
    import numpy as np
    P = dist.size()
    x = np.array([1.0, 2049.0, 0.1], dtype=np.float16) * (RANK + 1)
    want = (sum(x.astype(np.float32) / (RANK + 1) * (r + 1) for r in range(P))).astype(np.float16)
    got = dist.all_reduce(x)
    assert got.dtype == np.float16 and np.array_equal(got, want), got
    got = dist.all_reduce(torch.from_numpy(x))
    assert got.dtype == torch.float16 and np.array_equal(got.numpy(), want)
    out = torch.empty(3, dtype=torch.float16)
    assert dist.all_reduce(torch.from_numpy(x), out=out) is out and np.array_equal(out, want)
    got = dist.all_reduce(torch.from_numpy(x).to(torch.bfloat16), op="max")
    assert got.dtype == torch.bfloat16
    assert torch.equal(got, torch.from_numpy(x * 0 + x / (RANK + 1) * P).to(torch.bfloat16))
    r = dist.reduce(x)
    assert (r is None) == (RANK != 0) and (r is None or np.array_equal(r, want))
    try:
        import ml_dtypes
    except ImportError:
        ml_dtypes = None
    if ml_dtypes is not None:
        b = x.astype(np.float32).astype(ml_dtypes.bfloat16)
        got = dist.all_reduce(b)
        want_b = sum(b.astype(np.float32) / (RANK + 1) * (k + 1) for k in range(P))
        assert got.dtype == b.dtype and np.array_equal(got, want_b.astype(ml_dtypes.bfloat16))
    try:
        dist.all_reduce(x if RANK == 0 else x.astype(np.float32))
    except ValueError as exc:
        err("mixed", exc)
    say("OK half_all_reduce")


def case_broadcast_buffers():
    """broadcast_buffers=True: rank 0's buffers are copied in before each training
    forward (then this rank's batch updates them); False keeps each rank's own;
    an eval-mode or no_grad forward broadcasts nothing (it may run on one rank)."""
    for flag in (True, False):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(3, 3), nn.BatchNorm1d(3)).double()
        ddp = dist.DistributedDataParallel(model, device_ids=["cpu:0"], broadcast_buffers=flag)
        bn = model[1]
        with torch.no_grad():
            bn.running_mean.fill_(float(RANK))
            bn.num_batches_tracked.fill_(10 * RANK)
        if RANK == 0:
            with torch.no_grad():
                ddp(torch.randn(4, 3, dtype=torch.float64))   # alone: no collective
            model.eval()
            ddp(torch.randn(4, 3, dtype=torch.float64))
            model.train()
            with torch.no_grad():
                bn.running_mean.fill_(0.0)
                bn.num_batches_tracked.fill_(0)
        x = torch.randn(4, 3, dtype=torch.float64) + RANK
        with torch.no_grad():
            batch_mean = model[0](x).mean(0)
        ddp(x).pow(2).mean().backward()
        start = 0.0 if flag else float(RANK)
        want = 0.9 * start + 0.1 * batch_mean
        assert torch.allclose(bn.running_mean, want, rtol=1e-14, atol=1e-15), (flag, RANK)
        assert bn.num_batches_tracked.item() == (1 if flag else 10 * RANK + 1)
        assert ddp.broadcast_buffers == flag
    say("OK broadcast_buffers")


def case_module_face():
    """Around a torch module the wrapper is an nn.Module whose one child is
    ``module`` (torch's DDP's face) and still a DistributedDataParallel."""
    import copy

    import numpy as np
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))   # float32
    ref = copy.deepcopy(model).double()
    ddp = dist.DistributedDataParallel(model, device_ids=["cpu:0"])
    assert isinstance(ddp, nn.Module) and isinstance(ddp, dist.DistributedDataParallel)
    assert type(ddp).__name__ == "DistributedDataParallel"
    assert dict(ddp.named_children()) == {"module": model}
    assert list(ddp.state_dict()) == ["module." + k for k in model.state_dict()]
    assert [n for n, _ in ddp.named_parameters()] == \
        ["module." + n for n, _ in model.named_parameters()]
    assert all(a is b for a, b in zip(ddp.parameters(), model.parameters()))
    ddp.eval()
    assert not model.training and not ddp.training
    ddp.train()
    assert model.training
    assert ddp.to(torch.float64) is ddp and model[0].weight.dtype == torch.float64
    calls = []
    ddp.register_forward_hook(lambda mod, args, out: calls.append(out.shape))
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(4)
    P = dist.size()
    sizes = [3 + r for r in range(P)]                 # uneven
    start = sum(sizes[:RANK])
    for step in range(2):
        X = torch.randn(sum(sizes), 4, generator=g, dtype=torch.float64)
        ddp.zero_grad()
        assert all(p.grad is None for p in model.parameters())
        ddp(X[start:start + sizes[RANK]]).pow(2).mean().backward()
        opt.step()
        ref_opt.zero_grad()
        ref(X).pow(2).mean().backward()
        ref_opt.step()
        for p, q in zip(model.parameters(), ref.parameters()):
            assert p.grad.dtype == torch.float64
            assert float((p - q).detach().abs().max()) <= 1e-12, step
    assert calls == [(sizes[RANK], 2)] * 2, calls
    saved = {k: v.clone() for k, v in ddp.state_dict().items()}
    with torch.no_grad():
        model[0].weight.zero_()
    ddp.load_state_dict(saved)                          # keys module.*, as torch's DDP saves
    assert torch.equal(model[0].weight, saved["module.0.weight"])

    class Plain:
        def __init__(self):
            self.w = np.ones(3)

        def __call__(self, x):
            return x * self.w

    plain = dist.DistributedDataParallel(Plain(), device_ids=["cpu:0"])
    assert not isinstance(plain, nn.Module) and isinstance(plain, dist.DistributedDataParallel)
    say("OK module_face")


def case_layout_mismatch():
    """Different models on the ranks: the same ValueError on every rank names
    each differing array with what every rank has."""
    width = 3 if RANK == 0 else 4
    model = nn.Sequential(nn.Linear(2, width))
    if RANK == 1:
        model.register_buffer("extra", torch.zeros(2))
    try:
        dist.DistributedDataParallel(model, device_ids=["cpu:0"])
    except ValueError as exc:
        err("layout", exc)
    say("OK layout_mismatch")


if __name__ == "__main__":
    dist.init(timeout=float(os.environ.get("DIST_TEST_TIMEOUT", "30")))
    RANK = dist.rank()
    globals()["case_" + CASE]()
