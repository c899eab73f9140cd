"""Code written for torch.nn.DataParallel calls nn.Module methods on the wrapper
(spec 1.8: the wrapper is an nn.Module whose one child is "module"). Each
method of dpmini.DataParallel is compared with torch.nn.DataParallel's on the
same module (torch runs it on the CPU here, where its wrapper calls the module
directly): names, keys, errors, return values."""
import pytest

import dpmini


def _pair(torch):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.BatchNorm1d(3))
    return model, dpmini.DataParallel(model, ["cpu:0", "cpu:1"]), torch.nn.DataParallel(model)


def test_names_and_keys_carry_the_module_prefix_as_torch(torch):
    model, ours, theirs = _pair(torch)
    assert list(ours.state_dict()) == list(theirs.state_dict())
    assert list(ours.state_dict(prefix="p.")) == list(theirs.state_dict(prefix="p."))
    for name in ("named_parameters", "named_buffers"):
        for kw in ({}, {"prefix": "x"}, {"recurse": False}):
            assert ([n for n, _ in getattr(ours, name)(**kw)]
                    == [n for n, _ in getattr(theirs, name)(**kw)]), (name, kw)
    assert [n for n, _ in ours.named_modules()] == ["", "module", "module.0", "module.1"]
    assert [m for _, m in ours.named_modules()][1:] == [m for _, m in theirs.named_modules()][1:]
    assert list(ours.modules())[0] is ours and list(ours.modules())[1] is model
    assert list(ours.children()) == [model]
    assert list(ours.named_children()) == [("module", model)]
    assert [p.data_ptr() for p in ours.parameters()] == [p.data_ptr() for p in model.parameters()]
    assert list(ours.parameters(recurse=False)) == list(theirs.parameters(recurse=False)) == []
    assert len(list(ours.buffers())) == 3


def test_load_state_dict_matches_torch_messages_and_results(torch):
    model, ours, theirs = _pair(torch)
    sd = theirs.state_dict()
    assert tuple(ours.load_state_dict(sd)) == tuple(theirs.load_state_dict(sd)) == ([], [])
    bare = {k[len("module."):]: v for k, v in sd.items()}      # the classic mistake
    errors = []
    for wrapper in (ours, theirs):
        with pytest.raises(RuntimeError) as info:
            wrapper.load_state_dict(bare)
        errors.append(str(info.value))
    assert errors[0] == errors[1]
    assert 'Missing key(s) in state_dict: "module.0.weight"' in errors[0]
    assert ours.load_state_dict(bare, strict=False) == theirs.load_state_dict(bare, strict=False)


def test_loaded_values_reach_the_module(torch):
    model, ours, _ = _pair(torch)
    other = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.BatchNorm1d(3))
    with torch.no_grad():
        other[0].weight.fill_(2.5)
    ours.load_state_dict(torch.nn.DataParallel(other).state_dict())
    assert torch.equal(model[0].weight, torch.full((3, 4), 2.5))


def test_train_eval_to_zero_grad_act_on_the_module_and_chain(torch):
    model, ours, theirs = _pair(torch)
    for wrapper in (ours, theirs):
        assert wrapper.eval() is wrapper and model.training is False and wrapper.training is False
        model.train()
        assert wrapper.training is False              # each keeps its own flag
        assert wrapper.train() is wrapper and model.training is True and wrapper.training is True
        wrapper.training = False
        assert model.training is True
    assert ours.to(torch.float64) is ours and model[0].weight.dtype == torch.float64
    assert ours.double() is ours and ours.float() is ours
    assert model[0].weight.dtype == torch.float32
    model[0].weight.grad = torch.ones(3, 4)
    assert ours.zero_grad() is None and model[0].weight.grad is None
    seen = []
    assert ours.apply(seen.append) is ours
    assert seen[-1] is ours and seen[-2] is model


def test_an_optimizer_over_the_wrapper_parameters_trains_the_module(torch):
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    ours = dpmini.DataParallel(model, ["cpu:0", "cpu:1"])
    opt = torch.optim.SGD(ours.parameters(), lr=0.1)
    before = model.weight.detach().clone()
    model.weight.grad = torch.ones_like(model.weight)
    opt.step()
    assert torch.allclose(model.weight, before - 0.1)


def test_state_dict_positional_arguments_warn_as_torch(torch):
    model, ours, theirs = _pair(torch)
    for wrapper in (ours, theirs):
        with pytest.warns(FutureWarning):
            keys = list(wrapper.state_dict(None, "p."))
        assert keys[0] == "p.module.0.weight"
