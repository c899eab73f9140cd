"""With grad mode on, DataParallel's structures keep what the C walkers give without
it (docs/spec.md 3.1, 4.1, 11.4): dict subclasses keep their type, dataclasses are not
rebuilt through __init__, a dataclass input reaches every replica as the same object,
Hugging Face's ModelOutput (a dataclass that is an OrderedDict) stays a whole one, and
the gradients equal a single-device run. Also the gradients autograd hands over with a
conjugate bit, modules whose own __setattr__ keeps state (an RNN's flat weights), and
one-shot iterators as the functions' sequence arguments."""
import collections
import dataclasses
from typing import Optional

import pytest

import dpmini
from .conftest import DEVS


class TaggedDict(dict):
    pass


@dataclasses.dataclass
class ModelOutputLike(collections.OrderedDict):
    """transformers.utils.ModelOutput's shape: keys are the fields that are not None."""
    loss: object = None
    logits: object = None

    def __post_init__(self):
        for f in dataclasses.fields(self):
            if getattr(self, f.name) is not None:
                self[f.name] = getattr(self, f.name)

    def __setitem__(self, key, value):
        super().__setitem__(key, value)
        super().__setattr__(key, value)


POST_INITS = []


@dataclasses.dataclass
class Scaled:
    y: object
    twice: object = dataclasses.field(init=False)

    def __post_init__(self):
        POST_INITS.append(1)
        self.twice = self.y * 2


def _linear(torch):
    torch.manual_seed(0)
    return torch.nn.Linear(4, 3).double()


def _with_linear(torch, body):
    """A module holding one float64 Linear(4, 3) as `lin`, whose forward is
    body(lin, *args, **kwargs)."""
    class M(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = _linear(torch)

        def forward(self, *args, **kwargs):
            return body(self.lin, *args, **kwargs)

    return M()


def _x(torch, rows=6):
    return torch.randn(rows, 4, dtype=torch.float64)


def _grads(m):
    return [p.grad.clone() for p in m.parameters()]


def _same_grads(torch, m, loss_dp, loss_plain):
    loss_dp.backward()
    got = _grads(m)
    m.zero_grad()
    loss_plain().backward()
    for g, w in zip(got, _grads(m)):
        assert torch.allclose(g, w, rtol=0, atol=1e-12)


def test_dict_subclass_output_keeps_its_type_with_grad(torch):
    def body(lin, x):
        return TaggedDict(a=lin(x))

    m, x = _with_linear(torch, body), _x(torch)
    out = dpmini.DataParallel(m, DEVS)(x)
    assert type(out) is TaggedDict and out["a"].requires_grad
    _same_grads(torch, m, out["a"].sum(), lambda: m(x)["a"].sum())


def test_dict_subclass_input_reaches_replicas_as_its_type_with_grad(torch):
    seen = []

    def body(lin, d):
        seen.append(type(d))
        return lin(d["x"])

    m, x = _with_linear(torch, body), _x(torch).requires_grad_()
    dpmini.DataParallel(m, DEVS)(TaggedDict(x=x)).pow(2).sum().backward()
    assert seen == [TaggedDict, TaggedDict]
    got = x.grad.clone()
    x.grad = None
    m(TaggedDict(x=x)).pow(2).sum().backward()
    assert torch.allclose(got, x.grad, rtol=0, atol=1e-12)


def test_dataclass_output_with_init_false_field_is_not_rebuilt_with_grad(torch):
    def body(lin, x):
        return Scaled(lin(x))

    m, x = _with_linear(torch, body), _x(torch)
    POST_INITS.clear()
    out = dpmini.DataParallel(m, DEVS)(x)
    assert len(POST_INITS) == 2            # once in each replica, never on the result
    assert type(out) is Scaled and out.y.requires_grad
    assert torch.allclose(out.twice, m(x).twice, rtol=0, atol=1e-12)
    _same_grads(torch, m, out.y.sum(), lambda: m(x).y.sum())


def test_dataclass_input_is_the_same_object_in_every_replica_with_grad(torch):
    seen = []

    def body(lin, s, x):
        seen.append(s)
        return lin(x) * s.y.sum()

    m, x = _with_linear(torch, body), _x(torch)
    w = torch.randn(3, dtype=torch.float64, requires_grad=True)
    POST_INITS.clear()
    s = Scaled(w)
    dpmini.DataParallel(m, DEVS)(s, x).sum().backward()
    assert len(seen) == 2 and all(o is s for o in seen) and len(POST_INITS) == 1
    got = w.grad.clone()
    w.grad = None
    m(s, x).sum().backward()
    assert torch.allclose(got, w.grad, rtol=0, atol=1e-12)


@pytest.mark.parametrize("grad", [False, True])
def test_model_output_like_result_is_a_whole_ordered_dict(torch, grad):
    def body(lin, x, labels):
        logits = lin(x)
        return ModelOutputLike(loss=torch.nn.functional.cross_entropy(logits, labels),
                               logits=logits)

    m, x = _with_linear(torch, body), _x(torch)
    labels = torch.tensor([0, 1, 2, 0, 1, 2])
    with torch.set_grad_enabled(grad), pytest.warns(UserWarning, match="unsqueeze"):
        out = dpmini.DataParallel(m, DEVS)(x, labels=labels)   # 0-dim losses: spec 4.5
    assert type(out) is ModelOutputLike and list(out.keys()) == ["loss", "logits"]
    assert out["logits"] is out.logits and out.loss.shape == (2,)
    assert out == collections.OrderedDict([("loss", out.loss), ("logits", out.logits)])
    assert out.logits.requires_grad is grad and out.loss.requires_grad is grad
    if grad:
        halves = [m(x[:3], labels[:3]).loss, m(x[3:], labels[3:]).loss]
        _same_grads(torch, m, out.loss.sum(), lambda: halves[0] + halves[1])


def test_gradients_with_a_conjugate_bit_reach_parameters_and_inputs(torch):
    class M(torch.nn.Module):
        def __init__(self):
            super().__init__()
            torch.manual_seed(1)
            self.w = torch.nn.Parameter(torch.randn(4, dtype=torch.complex128))

        def forward(self, x):
            return x * self.w.conj()

    m = M()
    x = torch.randn(6, 4, dtype=torch.complex128, requires_grad=True)
    dpmini.DataParallel(m, DEVS)(x).abs().sum().backward()
    got_w, got_x = m.w.grad.clone(), x.grad.clone()
    m.zero_grad()
    x.grad = None
    m(x).abs().sum().backward()
    assert torch.allclose(got_w, m.w.grad, rtol=0, atol=1e-12)
    assert torch.allclose(got_x, x.grad, rtol=0, atol=1e-12)


def test_rnn_replicas_run_with_their_own_flat_weights(torch):
    torch.manual_seed(2)
    m = torch.nn.LSTM(4, 5, batch_first=True).double()
    dp = dpmini.DataParallel(m, DEVS)
    for replica in dp.replicate(m, DEVS):
        own = [getattr(replica, n) for n in replica._flat_weights_names]
        assert all(a is b for a, b in zip(replica._flat_weights, own))
    assert all(a is getattr(m, n) for a, n in zip(m._flat_weights, m._flat_weights_names))
    x = torch.randn(6, 3, 4, dtype=torch.float64)
    out, _ = dp(x)
    _same_grads(torch, m, out.sum(), lambda: m(x)[0].sum())


@dataclasses.dataclass
class FieldsOnlyDict(dict):
    """A dataclass that is a dict but keeps its tensors as fields only."""
    logits: object
    aux: Optional[object] = None


def test_dict_dataclass_output_is_gathered_by_fields_with_grad(torch):
    def body(lin, x):
        y = lin(x)
        out = FieldsOnlyDict(y, y * 2)
        out["logits"] = y                  # one of the fields is also a key
        return out

    m, x = _with_linear(torch, body), _x(torch)
    out = dpmini.DataParallel(m, DEVS)(x)
    assert type(out) is FieldsOnlyDict and list(out.keys()) == ["logits"]
    assert out["logits"] is out.logits and out.aux.requires_grad
    _same_grads(torch, m, out.aux.sum() + out.logits.sum(),
                lambda: m(x).aux.sum() + m(x).logits.sum())
    a = torch.randn(2, 3, dtype=torch.float64, requires_grad=True)
    b = torch.randn(2, 3, dtype=torch.float64, requires_grad=True)
    g = dpmini.gather([FieldsOnlyDict(a * 1, a * 2), FieldsOnlyDict(b * 1, b * 2)], "cpu")
    g.aux.sum().backward()
    assert torch.equal(a.grad, torch.full((2, 3), 2.0, dtype=torch.float64))


def test_one_shot_iterators_are_read_once_with_grad(torch):
    a = torch.randn(3, dtype=torch.float64, requires_grad=True)
    x = torch.randn(4, 3, dtype=torch.float64, requires_grad=True)
    devs = ["cpu:0", "cpu:1"]
    comm = dpmini.comm
    assert comm.gather((t for t in (a, a)), destination="cpu").shape == (6,)
    total = comm.reduce_add((t for t in (a, a)), destination="cpu")
    assert torch.equal(total, 2 * a.detach())
    (summed,) = comm.reduce_add_coalesced(((t,) for t in (a, a)), destination="cpu")
    assert torch.equal(summed, 2 * a.detach())
    rows = comm.broadcast_coalesced((t for t in [a]), (d for d in devs))
    assert len(rows) == 2 and all(len(r) == 1 and torch.equal(r[0], a.detach()) for r in rows)
    pieces = dpmini.scatter(x, (d for d in devs))
    assert [p.shape[0] for p in pieces] == [2, 2]
    sum(p.sum() for p in pieces).backward()
    assert torch.equal(x.grad, torch.ones(4, 3, dtype=torch.float64))
    ins, kws = dpmini.scatter_kwargs((x,), {}, (d for d in devs))
    assert len(ins) == 2 and ins[0][0].requires_grad


@pytest.mark.parametrize("devices", [None, DEVS])
def test_torchs_steps_by_hand_with_grad_give_single_device_gradients(torch, devices):
    # scatter -> replicate -> parallel_apply -> gather, as DataParallel.forward runs them;
    # parallel_apply picks the devices itself when none are given (spec 6.1)
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(3, 5), torch.nn.Tanh(), torch.nn.Linear(5, 2)).double()
    x = torch.randn(7, 3, dtype=torch.float64, requires_grad=True)
    ref_x = x.detach().clone().requires_grad_()
    (m(ref_x) ** 2).sum().backward()
    ref = [p.grad.clone() for p in m.parameters()]
    m.zero_grad()
    pieces = dpmini.scatter(x, DEVS)
    replicas = dpmini.replicate(m, DEVS)
    outs = dpmini.parallel_apply(replicas, [(p,) for p in pieces], None, devices)
    y = dpmini.gather(outs, "cpu:0")
    (y ** 2).sum().backward()
    torch.testing.assert_close(x.grad, ref_x.grad, rtol=0, atol=1e-12)
    for p, r in zip(m.parameters(), ref):
        torch.testing.assert_close(p.grad, r, rtol=0, atol=1e-12)


def test_deep_nesting_with_grad_works_and_a_self_containing_list_is_named(torch):
    # 400 levels, inside the 512 of docs/spec.md 10.5, in and out of a module with grad on
    def nest(v, n):
        for _ in range(n):
            v = [v]
        return v

    def innermost(v):
        depth = 0
        while isinstance(v, list):
            v, depth = v[0], depth + 1
        return depth, v

    class Deep(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.p = torch.nn.Parameter(torch.ones(1, dtype=torch.float64))

        def forward(self, x, deep=None):
            return nest(x * self.p, 400)

    x = torch.ones(4, 1, dtype=torch.float64, requires_grad=True)
    model = Deep()
    depth, y = innermost(dpmini.DataParallel(model, DEVS)(x, nest(x, 400)))
    assert depth == 400 and y.shape == (4, 1)
    y.sum().backward()
    assert model.p.grad.item() == 4.0 and torch.equal(x.grad, torch.ones(4, 1, dtype=torch.float64))
    loop = []
    loop.append(loop)
    with pytest.raises(RecursionError, match=r"^args\[1\]\[0\]\[0\]"):
        dpmini.DataParallel(model, DEVS)(x, loop)

    class ReturnsLoop(Deep):
        def forward(self, x):
            return [x * self.p, loop]
    with pytest.raises(RecursionError, match=r"^out\[1\]\[0\]\[0\]"):
        dpmini.DataParallel(ReturnsLoop(), DEVS)(x)


def test_a_tensor_that_requires_grad_is_found_behind_containers_made_on_the_fly(torch):
    # a mapping whose values() builds new tuples: one freed after its visit must not
    # hide the next one made at the same address
    class FreshValues(dict):
        def values(self):
            return [(v,) for v in dict.values(self)]

    g = torch.ones(2, dtype=torch.float64, requires_grad=True)
    n = torch.ones(2, dtype=torch.float64)

    class TwoMaps(torch.nn.Module):
        def __init__(self, reverse):
            super().__init__()
            self.reverse = reverse

        def forward(self, x):
            maps = [FreshValues(a=x * g), FreshValues(a=x * n)]
            return maps[::-1] if self.reverse else maps

    for reverse in (False, True):
        out = dpmini.DataParallel(TwoMaps(reverse), DEVS)(torch.ones(4, 2, dtype=torch.float64))
        grads = [v["a"] for v in out if v["a"].requires_grad]
        assert len(grads) == 1
        grads[0].sum().backward()
        assert torch.equal(g.grad, torch.full((2,), 4.0, dtype=torch.float64))
        g.grad = None
