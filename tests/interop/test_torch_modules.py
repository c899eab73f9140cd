"""torch.nn.Module replicas on the virtual CPU devices, made by PyTorch's rules
(docs/spec.md 5.5-5.7): each module's replica is a shallow __dict__ copy, parameters are
broadcast copies (plain copies under no_grad), replica 0 shares the original's
buffers. CPU autocast in the caller holds in the replica threads."""
import contextlib
import os

import dpmini

DEVS = ["cpu:0", "cpu:1"]


@contextlib.contextmanager
def replica_threads(torch, replicas=2):
    """torch's intra-op thread count of each of `replicas` replicas on virtual
    CPU devices (cores // replicas, docs/libraries.md, "torch's per-thread state"): a reduction computed
    alone with it gives the replicas' bits."""
    threads = torch.get_num_threads()
    torch.set_num_threads(max(1, min(threads, len(os.sched_getaffinity(0)) // replicas)))
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def test_replicas_are_shallow_copies_with_their_own_parameters(torch):
    model = torch.nn.Linear(3, 2)
    reps = dpmini.replicate(model, DEVS)
    assert all(type(r) is torch.nn.Linear and r is not model for r in reps)
    assert all(r._is_replica for r in reps)
    # with grad mode on: differentiable copies, replica 0 on the original memory
    assert reps[0].weight.data_ptr() == model.weight.data_ptr()
    assert reps[1].weight.data_ptr() != model.weight.data_ptr()
    assert torch.equal(reps[1].weight, model.weight)
    assert reps[1].weight.grad_fn is not None and list(reps[1].parameters()) == []
    # made per call, as PyTorch's replicate is
    assert dpmini.replicate(model, DEVS)[1] is not reps[1]


def test_scripted_modules_replicate_and_train_as_on_one_device(torch):
    import warnings
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)   # torch.jit.script is deprecated
        scripted = torch.jit.script(torch.nn.Sequential(torch.nn.Linear(4, 5), torch.nn.Tanh(),
                                                        torch.nn.Linear(5, 2)).double())
        inner = torch.nn.Sequential(torch.nn.Linear(2, 3).double(),
                                    torch.jit.script(torch.nn.Linear(3, 1).double()))
    x = torch.randn(8, 4, dtype=torch.float64)
    for model, data in ((scripted, x), (inner, x[:, :2])):
        want = model(data)
        want.sum().backward()
        grads = [p.grad.clone() for p in model.parameters()]
        model.zero_grad()
        got = dpmini.DataParallel(model, DEVS)(data)
        got.sum().backward()
        assert torch.allclose(got, want, atol=1e-12)
        assert all(torch.allclose(p.grad, g, atol=1e-12) for p, g in zip(model.parameters(), grads))
        with torch.no_grad():
            assert torch.allclose(dpmini.DataParallel(model, DEVS)(data), want, atol=1e-12)
    # a frozen one (its submodules have no `training` attribute) in eval
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        frozen = torch.jit.freeze(scripted.eval())
    with torch.no_grad():
        assert torch.allclose(dpmini.DataParallel(frozen, DEVS)(x), frozen(x), atol=1e-12)


def test_no_grad_replicas_are_copies_in_their_devices_memory(torch):
    # as torch's broadcast copies: replica 0 the parameters themselves, the others
    # copies that dpmini.memory_allocated shows on their device
    model = torch.nn.Linear(300, 200)
    before = dpmini.memory_allocated("cpu:1")
    with torch.no_grad():
        reps = dpmini.replicate(model, DEVS, detach=True)
    assert dpmini.memory_allocated("cpu:1") >= before + (300 * 200 + 200) * 4
    assert reps[0].weight is model.weight          # docs/spec.md 5.3: devices[0] keeps the tensors
    assert reps[1].weight.data_ptr() != model.weight.data_ptr()
    assert str(dpmini.device_of(reps[1].weight)) == "cpu:1"
    assert torch.equal(reps[1].weight, model.weight) and not reps[1].weight.requires_grad
    del reps
    assert dpmini.memory_allocated("cpu:1") == before


def test_a_sparse_parameter_is_copied_by_torch_in_both_grad_modes(torch):
    class SparseWeight(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.eye(4, dtype=torch.float64).to_sparse())

        def forward(self, x):
            return torch.sparse.mm(self.w, x.t()).t()

    model = SparseWeight()
    x = torch.arange(8.0, dtype=torch.float64).reshape(2, 4)
    with torch.no_grad():
        assert torch.equal(dpmini.DataParallel(model, DEVS)(x), x)
    y = dpmini.DataParallel(model, DEVS)(x)
    assert torch.equal(y, x)
    y.sum().backward()
    got = model.w.grad.to_dense()
    model.w.grad = None
    model(x).sum().backward()                 # one device
    assert torch.equal(got, model.w.grad.to_dense())


def test_a_forward_writing_its_parameters_under_no_grad_writes_only_its_own(torch):
    # a weight clip, a max-norm constraint, an EMA: with torch's broadcast copies only
    # replica 0's write reaches the original and each replica sees its own write once
    class HalvesItsWeight(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.ones(3))

        def forward(self, x):
            with torch.no_grad():
                self.w.mul_(0.5)
            return x * self.w

    devs = ["cpu:0", "cpu:1", "cpu:2", "cpu:3"]
    for mode in (torch.enable_grad, torch.no_grad, torch.inference_mode):
        model = HalvesItsWeight()
        with mode():
            y = dpmini.DataParallel(model, devs)(torch.ones(8, 3))
        assert torch.equal(y, torch.full((8, 3), 0.5)), (mode, y)
        assert torch.equal(model.w.detach(), torch.full((3,), 0.5)), (mode, model.w)


def test_batchnorm_train_mode_updates_only_from_replica_zero(torch):
    torch.manual_seed(0)
    x = torch.randn(64, 16) + 3
    ref = torch.nn.BatchNorm1d(16)
    with torch.no_grad(), replica_threads(torch):
        ref(x[:32])                       # replica 0's shard alone
    for _ in range(10):
        bn = torch.nn.BatchNorm1d(16)
        with torch.no_grad():
            dpmini.DataParallel(bn, DEVS)(x)
        assert torch.equal(bn.running_mean, ref.running_mean)
        assert torch.equal(bn.running_var, ref.running_var)
        assert int(bn.num_batches_tracked) == 1


def test_counter_rebinding_is_lost_containers_keep_every_replica(torch):
    # docs/spec.md 5.5/9.6: rebinding an attribute in forward touches the replica only;
    # a list is shared by the replicas' shallow copies, so it keeps all entries
    class Counter(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.calls = 0
            self.seen = []

        def forward(self, x):
            self.calls += 1
            self.seen.append(x.shape[0])
            return x * 2

    c = Counter()
    with torch.no_grad():
        for _ in range(5):
            out = dpmini.DataParallel(c, DEVS)(torch.ones(4, 2))
            assert torch.equal(out, torch.full((4, 2), 2.0))
    assert c.calls == 0
    assert c.seen == [2, 2] * 5


def test_cpu_autocast_holds_in_the_replica_threads(torch):
    m = torch.nn.Linear(4, 4)
    x = torch.randn(4, 4)
    # float16 here; bfloat16 (autocast's default): test_ml_dtypes_interop.py
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.float16):
        want = m(x)
        got = dpmini.DataParallel(m, DEVS)(x)
        on = dpmini.DataParallel(lambda t: torch.full((2,), float(torch.is_autocast_enabled("cpu"))),
                                 DEVS)(x)
    assert want.dtype == torch.float16 and got.dtype == torch.float16
    assert torch.equal(got, want)
    assert on.tolist() == [1.0] * 4
    with torch.no_grad():
        assert dpmini.DataParallel(m, DEVS)(x).dtype == torch.float32


def test_other_attributes_are_shared_as_in_pytorch(torch):
    # docs/spec.md 5.5: PyTorch's replicas share the module's other Python attributes
    import threading

    class WithLock(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(2, 2)
            self.lock = threading.Lock()
            self.locks = [threading.Lock()]
            self.lin.tag = threading.Lock()    # in a submodule too

        def forward(self, x):
            with self.lock:
                return self.lin(x)

    model = WithLock()
    with torch.no_grad():
        x = torch.arange(8.0).reshape(4, 2)
        out = dpmini.DataParallel(model, DEVS)(x)
        assert torch.allclose(out, model(x))
    reps = dpmini.replicate(model, DEVS)
    assert reps[1].lock is model.lock and reps[1].locks is model.locks
    assert reps[1].lin.tag is model.lin.tag
    # submodules and parameters are the replica's own
    assert reps[1].lin is not model.lin and reps[1].lin is reps[1]._modules["lin"]
    assert reps[1].lin.weight.data_ptr() != model.lin.weight.data_ptr()
