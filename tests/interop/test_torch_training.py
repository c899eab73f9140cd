"""Training through dpmini.DataParallel with torch's autograd (docs/spec.md 7): PyTorch's
tutorial "Optional: Data Parallelism" with only the class name changed, and
loss.backward() after dp(x) giving each parameter the gradient of a single-device
run over the whole batch."""
import warnings

import pytest

import dpmini


def _devs(n):
    return [f"cpu:{i}" for i in range(n)]


# PyTorch's data_parallel_tutorial.py, as written there (its batches: 100 rows of
# 5 features, batch_size 30), with torch.nn.DataParallel replaced by
# dpmini.DataParallel and the sizes also recorded in a list the replicas share.
def _tutorial(torch, ndev, capsys):
    from torch.utils.data import DataLoader, Dataset

    input_size, output_size, batch_size, data_size = 5, 2, 30, 100

    class RandomDataset(Dataset):
        def __init__(self, size, length):
            self.len = length
            self.data = torch.randn(length, size)

        def __getitem__(self, index):
            return self.data[index]

        def __len__(self):
            return self.len

    rand_loader = DataLoader(dataset=RandomDataset(input_size, data_size),
                             batch_size=batch_size, shuffle=True)

    class Model(torch.nn.Module):
        def __init__(self, input_size, output_size):
            super().__init__()
            self.fc = torch.nn.Linear(input_size, output_size)
            self.sizes = []

        def forward(self, input):
            output = self.fc(input)
            print("\tIn Model: input size", input.size(), "output size", output.size())
            self.sizes.append((input.size(0), output.size(0)))
            return output

    model = Model(input_size, output_size)
    model = dpmini.DataParallel(model, device_ids=_devs(ndev))
    outside = []
    for data in rand_loader:
        input = data
        output = model(input)
        print("Outside: input size", input.size(), "output_size", output.size())
        outside.append((input.size(0), tuple(output.size())))
        assert output.grad_fn is not None
    printed = capsys.readouterr().out
    return model.module.sizes, outside, printed


@pytest.mark.parametrize("ndev, per_batch, last", [
    (2, [15, 15], [5, 5]),
    (3, [10, 10, 10], [4, 4, 2]),
    (8, [4] * 7 + [2], [2, 2, 2, 2, 2]),
])
def test_the_tutorial_runs_with_the_sizes_it_documents(torch, capsys, ndev, per_batch, last):
    inside, outside, printed = _tutorial(torch, ndev, capsys)
    assert outside == [(30, (30, 2))] * 3 + [(10, (10, 2))]
    want = [per_batch] * 3 + [last]
    got, i = [], 0
    for sizes in want:                     # replicas of one call may print in any order
        got.append(sorted((s for s, _ in inside[i:i + len(sizes)]), reverse=True))
        i += len(sizes)
    assert got == want and i == len(inside)
    assert all(a == b for a, b in inside)
    assert printed.count("In Model: input size") == len(inside)
    assert "Outside: input size torch.Size([30, 5]) output_size torch.Size([30, 2])" in printed


def _mlp(torch, seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(),
                               torch.nn.Linear(16, 3)).double()


def _grads(model):
    return [p.grad.clone() for p in model.parameters()]


@pytest.mark.parametrize("ndev", [1, 2, 3, 4])
@pytest.mark.parametrize("batch", [7, 10, 12])
def test_backward_gives_the_single_device_gradients(torch, ndev, batch):
    model = _mlp(torch)
    x = torch.randn(batch, 6, dtype=torch.float64)
    y = torch.randn(batch, 3, dtype=torch.float64)
    criterion = torch.nn.MSELoss()
    dp = dpmini.DataParallel(model, device_ids=_devs(ndev))
    criterion(dp(x), y).backward()
    got = _grads(model)
    model.zero_grad()
    criterion(model(x), y).backward()
    for g, w in zip(got, _grads(model)):
        assert torch.allclose(g, w, rtol=0, atol=1e-12)


def test_an_optimizer_step_matches_the_single_device_step(torch):
    ref, ours = _mlp(torch), _mlp(torch)
    dp = dpmini.DataParallel(ours, device_ids=_devs(3))
    opts = [torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in (ref, dp)]
    for step in range(3):
        torch.manual_seed(step + 10)
        x, y = torch.randn(11, 6, dtype=torch.float64), torch.randn(11, 3, dtype=torch.float64)
        for model, opt in zip((ref, dp), opts):
            opt.zero_grad()
            torch.nn.functional.mse_loss(model(x), y).backward()
            opt.step()
    for a, b in zip(ref.parameters(), ours.parameters()):
        assert torch.allclose(a, b, rtol=0, atol=1e-12)


def test_inputs_and_kwargs_that_require_grad_get_their_grad(torch):
    class Scaled(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(4, 2).double()

        def forward(self, x, scale=None, bias=None):
            return self.lin(x) * scale + bias

    torch.manual_seed(1)
    m = Scaled()
    x = torch.randn(9, 4, dtype=torch.float64, requires_grad=True)
    scale = torch.randn(9, 1, dtype=torch.float64, requires_grad=True)
    bias = torch.randn(2, dtype=torch.float64, requires_grad=True)   # 1 row: not split
    dp = dpmini.DataParallel(m, _devs(3), in_dims={"bias": None})
    (dp(x, scale=scale, bias=bias) ** 2).sum().backward()
    got = [t.grad.clone() for t in (x, scale, bias, m.lin.weight)]
    for t in (x, scale, bias, m.lin.weight):
        t.grad = None
    (m(x, scale=scale, bias=bias) ** 2).sum().backward()
    for g, t in zip(got, (x, scale, bias, m.lin.weight)):
        assert torch.allclose(g, t.grad, rtol=0, atol=1e-12)


def test_tied_weights_get_one_summed_gradient(torch):
    class Tied(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a = torch.nn.Linear(5, 5, bias=False).double()
            self.b = torch.nn.Linear(5, 5, bias=False).double()
            self.b.weight = self.a.weight

        def forward(self, x):
            return self.b(torch.tanh(self.a(x)))

    torch.manual_seed(2)
    m = Tied()
    x = torch.randn(8, 5, dtype=torch.float64)
    dpmini.DataParallel(m, _devs(3))(x).sum().backward()
    got = m.a.weight.grad.clone()
    m.zero_grad()
    m(x).sum().backward()
    assert torch.allclose(got, m.a.weight.grad, rtol=0, atol=1e-12)


def test_tuple_and_dict_outputs_are_differentiable(torch):
    class Heads(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(4, 3).double()

        def forward(self, x):
            h = self.lin(x)
            return {"h": h, "pair": (h.sum(1), torch.tanh(h))}

    torch.manual_seed(3)
    m = Heads()
    x = torch.randn(7, 4, dtype=torch.float64)

    def loss(out):
        return out["h"].pow(2).sum() + out["pair"][0].sum() + out["pair"][1].sum()

    loss(dpmini.DataParallel(m, _devs(2))(x)).backward()
    got = _grads(m)
    m.zero_grad()
    loss(m(x)).backward()
    for g, w in zip(got, _grads(m)):
        assert torch.allclose(g, w, rtol=0, atol=1e-12)


def test_a_model_returning_its_own_loss_gives_a_vector_with_torchs_warning(torch):
    class WithLoss(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(4, 1).double()

        def forward(self, x, y):
            return torch.nn.functional.mse_loss(self.lin(x), y, reduction="sum")

    torch.manual_seed(4)
    m = WithLoss()
    x, y = torch.randn(10, 4, dtype=torch.float64), torch.randn(10, 1, dtype=torch.float64)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        losses = dpmini.DataParallel(m, _devs(3))(x, y)
    assert losses.shape == (3,)
    assert any("all input tensors were scalars" in str(w.message) for w in caught)
    losses.sum().backward()                 # per-replica sums add up to the whole sum
    got = _grads(m)
    m.zero_grad()
    m(x, y).backward()
    for g, w in zip(got, _grads(m)):
        assert torch.allclose(g, w, rtol=0, atol=1e-12)


def test_each_element_of_a_gathered_loss_vector_sends_its_gradient_to_its_replica(torch):
    # docs/spec.md 9.4: element i's gradient reaches replica i as a 0-dim gradient
    class HookedLoss(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.ones(2, dtype=torch.float64))
            self.seen = {}

        def forward(self, x):
            loss = (x * self.w).sum()
            row = int(x[0, 0].item())
            loss.register_hook(lambda g: self.seen.__setitem__(row, (g.shape, g.item())))
            return loss

    m = HookedLoss()
    x = torch.tensor([[0.0, 1.0], [2.0, 3.0], [4.0, 5.0]], dtype=torch.float64)
    scale = torch.tensor([1.0, 10.0, 100.0], dtype=torch.float64)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        losses = dpmini.DataParallel(m, _devs(3))(x)
    (losses * scale).sum().backward()
    assert m.seen == {0: ((), 1.0), 2: ((), 10.0), 4: ((), 100.0)}
    assert torch.equal(m.w.grad, (x * scale[:, None]).sum(0))


def test_batchnorm_in_training_keeps_replica_zeros_statistics(torch):
    torch.manual_seed(5)
    x = torch.randn(12, 3, dtype=torch.float64) + 2
    bn, ref = torch.nn.BatchNorm1d(3).double(), torch.nn.BatchNorm1d(3).double()
    out = dpmini.DataParallel(bn, _devs(2))(x)
    out.sum().backward()
    with torch.no_grad():
        ref(x[:6])
    # equal up to the last bits: the replica ran with its own intra-op thread count
    assert torch.allclose(bn.running_mean, ref.running_mean, rtol=0, atol=1e-14)
    assert not torch.allclose(bn.running_mean, 0.1 * x.mean(0), rtol=0, atol=1e-6)  # not the whole batch's
    assert int(bn.num_batches_tracked) == 1
    assert bn.weight.grad is not None


def test_no_grad_records_nothing_and_copies_no_parameters(torch):
    model = _mlp(torch)
    before = dpmini.memory_allocated("cpu:1")
    with torch.no_grad():
        out = dpmini.DataParallel(model, _devs(2))(torch.randn(8, 6, dtype=torch.float64))
        assert dpmini.memory_allocated("cpu:1") == before
    assert out.grad_fn is None and not out.requires_grad


def test_functional_data_parallel_is_differentiable(torch):
    model = _mlp(torch)
    x = torch.randn(9, 6, dtype=torch.float64, requires_grad=True)
    dpmini.data_parallel(model, x, _devs(3)).pow(2).sum().backward()
    got = _grads(model) + [x.grad.clone()]
    model.zero_grad()
    x.grad = None
    model(x).pow(2).sum().backward()
    for g, w in zip(got, _grads(model) + [x.grad]):
        assert torch.allclose(g, w, rtol=0, atol=1e-12)


def test_module_level_functions_are_differentiable(torch):
    a = torch.arange(12.0, dtype=torch.float64).reshape(6, 2).requires_grad_()
    pieces = dpmini.scatter(a, _devs(3))
    weights = [1.0, 2.0, 3.0]
    out = dpmini.gather([p * w for p, w in zip(pieces, weights)], "cpu")
    out.sum().backward()
    assert a.grad.tolist() == [[1.0, 1.0]] * 2 + [[2.0, 2.0]] * 2 + [[3.0, 3.0]] * 2

    b = torch.ones(3, dtype=torch.float64, requires_grad=True)
    copies = dpmini.comm.broadcast(b, _devs(2))
    (copies[0] * 2 + copies[1] * 3).sum().backward()
    assert b.grad.tolist() == [5.0] * 3

    c = torch.ones(2, dtype=torch.float64, requires_grad=True)
    d = torch.ones(2, dtype=torch.float64, requires_grad=True)
    (dpmini.comm.reduce_add([c, d], destination="cpu") * 4).sum().backward()
    assert c.grad.tolist() == d.grad.tolist() == [4.0, 4.0]

    e = torch.arange(4.0, dtype=torch.float64, requires_grad=True)
    parts = dpmini.comm.scatter(e, _devs(2), chunk_sizes=[1, 3])
    dpmini.comm.gather([parts[1], parts[0]], destination="cpu").pow(2).sum().backward()
    assert e.grad.tolist() == [0.0, 2.0, 4.0, 6.0]


def test_replicas_parameter_gradients_sum_onto_the_original(torch):
    model = torch.nn.Linear(2, 1, bias=False).double()
    reps = dpmini.replicate(model, _devs(3))
    x = torch.ones(1, 2, dtype=torch.float64)
    sum(r(x).sum() for r in reps).backward()
    assert model.weight.grad.tolist() == [[3.0, 3.0]]


def test_scatter_kwargs_of_a_bare_tensor_is_differentiable(torch):
    x = torch.arange(8.0, dtype=torch.float64).reshape(4, 2).requires_grad_()
    ins, kws = dpmini.scatter_kwargs(x, None, _devs(2))
    (ins[0][0].sum() + 2 * ins[1][0].sum()).backward()
    assert x.grad.tolist() == [[1.0, 1.0]] * 2 + [[2.0, 2.0]] * 2
