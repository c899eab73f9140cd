"""Sparse gradients through DataParallel (docs/spec.md 7.4: PyTorch's reduce_add_coalesced
sums sparse gradients apart from the dense ones): an nn.Embedding(sparse=True)
trained through dpmini.DataParallel gets, in its .grad, the sparse gradient a
single-device run over the whole batch gives."""
import copy

DEVS = ["cpu:0", "cpu:1"]


def test_sparse_embedding_gradient_equals_a_single_device_run(torch):
    import dpmini

    torch.manual_seed(0)
    model = torch.nn.Embedding(20, 4, sparse=True).double()
    ref = copy.deepcopy(model)
    idx = torch.randint(0, 20, (6, 3))
    dpmini.DataParallel(model, DEVS)(idx).pow(2).sum().backward()
    ref(idx).pow(2).sum().backward()
    assert model.weight.grad.is_sparse
    assert torch.allclose(model.weight.grad.to_dense(), ref.weight.grad.to_dense(),
                          rtol=0, atol=1e-12)


def test_sparse_embedding_trains_with_sparse_adam_as_a_single_device_run(torch):
    import dpmini

    torch.manual_seed(1)
    model = torch.nn.Embedding(30, 5, sparse=True).double()
    ref = copy.deepcopy(model)
    dp = dpmini.DataParallel(model, ["cpu:0", "cpu:1", "cpu:2"])
    opt, ref_opt = (torch.optim.SparseAdam(list(m.parameters()), lr=0.01) for m in (dp, ref))
    for step in range(3):
        idx = torch.randint(0, 30, (7, 2))
        for o, m in ((opt, dp), (ref_opt, ref)):
            o.zero_grad()
            m(idx).pow(2).sum().backward()
            o.step()
    assert torch.allclose(model.weight, ref.weight, rtol=0, atol=1e-12)


def test_a_sparse_gradient_of_a_broadcast_input_is_summed(torch):
    import dpmini

    weight = torch.randn(10, 3, dtype=torch.float64, requires_grad=True)
    copies = dpmini.comm.broadcast(weight, devices=DEVS)
    idx = torch.tensor([[1, 2], [2, 7]])
    loss = sum(torch.nn.functional.embedding(idx[i], c, sparse=True).sum()
               for i, c in enumerate(copies))
    loss.backward()
    expected = torch.zeros(10, 3, dtype=torch.float64)
    for i in (1, 2, 2, 7):
        expected[i] += 1
    assert torch.equal(weight.grad.to_dense(), expected)


def test_sparse_dense_and_partly_used_parameters_each_get_their_summed_gradient(torch):
    # the broadcast's backward sums dense gradients of all replicas together,
    # sparse ones apart, and a parameter only some replicas used from those alone
    import dpmini

    class Mixed(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = torch.nn.Embedding(20, 4, sparse=True)
            self.lin = torch.nn.Linear(4, 3)
            self.extra = torch.nn.Parameter(torch.randn(3))

        def forward(self, idx):
            h = self.lin(self.emb(idx).sum(1))
            return h + self.extra if bool(idx[0, 0] >= 10) else h

    torch.manual_seed(2)
    model = Mixed().double()
    ref = copy.deepcopy(model)
    idx = torch.tensor([[1, 4], [3, 3], [12, 0], [15, 19]])   # only replica 1 uses extra
    dpmini.DataParallel(model, DEVS)(idx).pow(2).sum().backward()
    torch.cat([ref(c) for c in idx.chunk(2)]).pow(2).sum().backward()
    assert model.emb.weight.grad.is_sparse
    assert torch.allclose(model.emb.weight.grad.to_dense(), ref.emb.weight.grad.to_dense(),
                          rtol=0, atol=1e-12)
    for name in ("lin.weight", "lin.bias", "extra"):
        got, want = model.get_parameter(name).grad, ref.get_parameter(name).grad
        assert torch.allclose(got, want, rtol=0, atol=1e-12), name
