"""Code written for torch.nn.DataParallel calls nn.Module methods on the wrapper
(docs/spec.md 1.8: the wrapper is an nn.Module whose one child is "module"). Each
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


def test_the_wrapper_is_an_nn_module_and_the_c_type(torch):
    model, ours, theirs = _pair(torch)
    assert isinstance(ours, torch.nn.Module) and isinstance(ours, dpmini.DataParallel)
    assert type(ours).__name__ == "DataParallel"
    assert repr(ours) == repr(theirs)
    assert ours.get_submodule("module.0") is model[0]
    seq = torch.nn.Sequential(ours, torch.nn.ReLU())
    assert [n for n, _ in seq.named_parameters()] == ["0.module.0.weight", "0.module.0.bias",
                                                        "0.module.1.weight", "0.module.1.bias"]


def test_a_parent_sees_the_wrapped_parameters_and_reaches_train_eval(torch):
    class Parent(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.enc = dpmini.DataParallel(torch.nn.Linear(2, 2), ["cpu:0", "cpu:1"])
            self.drop = torch.nn.Dropout()

    p = Parent()
    assert list(p.state_dict()) == ["enc.module.weight", "enc.module.bias"]
    assert len(list(p.parameters())) == 2
    p.eval()
    assert p.enc.training is False and p.enc.module.training is False


def test_forward_hooks_run_once_per_call_on_the_wrapper(torch):
    model, ours, _ = _pair(torch)
    seen = []
    ours.register_forward_pre_hook(lambda m, args: seen.append(("pre", args[0].shape[0])))
    ours.register_forward_hook(lambda m, args, out: seen.append(("post", out.shape[0])))
    with torch.no_grad():
        ours(torch.randn(6, 4))
    assert seen == [("pre", 6), ("post", 6)]


def test_assigning_module_registers_the_child_and_the_call_uses_it(torch):
    _, ours, _ = _pair(torch)
    other = torch.nn.Linear(4, 1)
    ours.module = other
    assert ours.module is other and [n for n, _ in ours.named_parameters()] == [
        "module.weight", "module.bias"]
    with torch.no_grad():
        assert torch.allclose(ours(torch.ones(3, 4)), other(torch.ones(3, 4)))
    with pytest.raises(TypeError, match="child module 'module'"):
        ours.module = lambda x: x
    assert ours.module is other


@pytest.mark.parametrize("how", ["add_module", "register_module", "_modules", "Module.__setattr__"])
def test_a_child_replaced_through_nn_modules_own_ways_is_the_one_called(torch, how):
    # as torch.ao.quantization's swaps do (module._modules[name] = new)
    _, ours, _ = _pair(torch)
    other = torch.nn.Linear(4, 5)
    if how == "add_module":
        ours.add_module("module", other)
    elif how == "register_module":
        ours.register_module("module", other)
    elif how == "_modules":
        ours._modules["module"] = other
    else:
        torch.nn.Module.__setattr__(ours, "module", other)
    x = torch.randn(6, 4)
    y = ours(x)
    assert ours.module is other
    torch.testing.assert_close(y, other(x))
    y.sum().backward()
    assert other.weight.grad is not None


def test_a_wrapper_made_its_own_child_is_a_recursion_error(torch):
    _, ours, _ = _pair(torch)
    ours._modules["module"] = ours
    with pytest.raises(RecursionError, match="^module: the wrapper is its own child"):
        ours(torch.ones(2, 4))


def test_a_deleted_child_is_an_attribute_error_as_in_torch(torch):
    _, ours, theirs = _pair(torch)
    del ours.module
    del theirs.module
    assert not hasattr(ours, "module") and list(ours.parameters()) == []
    for wrapper in (ours, theirs):
        with pytest.raises(AttributeError, match="no attribute 'module'"):
            wrapper(torch.ones(2, 4))


def test_deepcopy_pickle_and_torch_save_keep_module_and_settings(torch):
    import copy
    import io
    import pickle

    model, _, _ = _pair(torch)
    ours = dpmini.DataParallel(model, ["cpu:0", "cpu:1"], output_device="cpu", dim=0,
                               chunk_sizes=[3, 1])
    buf = io.BytesIO()
    torch.save(ours, buf)
    buf.seek(0)
    for clone in (copy.deepcopy(ours), pickle.loads(pickle.dumps(ours)),
                  torch.load(buf, weights_only=False)):
        assert type(clone) is type(ours) and clone.module is not model
        assert [str(d) for d in clone.device_ids] == ["cpu:0", "cpu:1"]
        assert str(clone.output_device) == "cpu" and clone.chunk_sizes == (3, 1)
        assert all(torch.equal(a, b) for a, b in zip(clone.state_dict().values(),
                                                     ours.state_dict().values()))
        with torch.no_grad():
            assert torch.allclose(clone.eval()(torch.ones(4, 4)), ours.eval()(torch.ones(4, 4)))


def test_a_subclass_wrapping_a_torch_module_gets_the_adapter(torch):
    import copy

    class Doubled(dpmini.DataParallel):
        def __init__(self, module, tag):
            super().__init__(module, ["cpu:0", "cpu:1"])
            self.tag = tag

        def gather(self, outputs, output_device=None):
            return super().gather(outputs, output_device) * 2

    model = torch.nn.Linear(3, 2)
    dp = Doubled(model, "t")
    assert isinstance(dp, Doubled) and isinstance(dp, torch.nn.Module)
    assert type(dp).__name__ == "Doubled" and type(Doubled(model, "u")) is type(dp)
    x = torch.randn(5, 3)
    out = dp(x)
    assert torch.allclose(out, 2 * model(x)) and out.grad_fn is not None
    clone = copy.deepcopy(dp)
    assert type(clone) is type(dp) and clone.tag == "t"
    assert [n for n, _ in dp.named_parameters()] == ["module.weight", "module.bias"]


def test_a_wrapper_inside_a_wrapper_is_replicated_with_its_settings(torch):
    inner = dpmini.DataParallel(torch.nn.Linear(3, 3), ["cpu:0", "cpu:1"], dim=0)
    outer = dpmini.DataParallel(torch.nn.Sequential(inner), ["cpu:0", "cpu:1"])
    rep = inner._replicate_for_data_parallel()
    assert [str(d) for d in rep.device_ids] == ["cpu:0", "cpu:1"] and rep.module is inner.module
    x = torch.randn(8, 3)
    with torch.no_grad():
        assert torch.allclose(outer(x), inner.module(x), atol=1e-6)
    outer(x).sum().backward()
    assert inner.module.weight.grad is not None


def test_a_plain_callable_keeps_the_c_type(torch):
    dp = dpmini.DataParallel(lambda t: t, ["cpu:0", "cpu:1"])
    assert type(dp) is dpmini.DataParallel and not isinstance(dp, torch.nn.Module)
