"""A DataParallel over a torch.nn.Module keeps replicate's walk of the module tree
between calls (dpmini/_torch.py, "The replica plan"); every change to the tree
made between two calls is seen by the second: a parameter, buffer or submodule
swapped, added or removed (through setattr or the module's dicts), train()/eval(),
requires_grad, and attributes read in forward."""
import pytest

import dpmini

DEVS = ["cpu:0", "cpu:1"]


def both_modes(torch, dp, model, x):
    """dp(x) equals model(x) under torch.no_grad() and with grad mode on, and
    backward gives each parameter the gradient of the direct call."""
    with torch.no_grad():
        assert torch.allclose(dp(x), model(x), atol=1e-6)
    model.zero_grad()
    model(x).square().sum().backward()
    want = {n: None if p.grad is None else p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    dp(x).square().sum().backward()
    for n, p in model.named_parameters():
        if want[n] is None:
            assert p.grad is None, n
        else:
            assert torch.allclose(p.grad, want[n], atol=1e-5), n


@pytest.fixture
def net(torch):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 4))
    return model, dpmini.DataParallel(model, DEVS), torch.randn(8, 6)


def test_a_parameter_swapped_by_setattr_is_used_and_gets_the_gradient(torch, net):
    model, dp, x = net
    both_modes(torch, dp, model, x)
    model.zero_grad(set_to_none=True)
    old = model[0].weight
    model[0].weight = torch.nn.Parameter(torch.randn(5, 6))
    both_modes(torch, dp, model, x)
    assert old.grad is None


def test_a_parameter_swapped_in_the_modules_dict_is_used(torch, net):
    model, dp, x = net
    both_modes(torch, dp, model, x)
    model[2]._parameters["bias"] = torch.nn.Parameter(torch.full((4,), 3.0))
    both_modes(torch, dp, model, x)


def test_a_parameter_removed_or_set_to_none_is_seen(torch, net):
    model, dp, x = net
    both_modes(torch, dp, model, x)
    model[0].bias = None
    both_modes(torch, dp, model, x)
    del model[2]._parameters["bias"]
    model[2].register_parameter("bias", None)
    both_modes(torch, dp, model, x)


def test_a_submodule_added_replaced_or_removed_is_seen(torch, net):
    model, dp, x = net
    both_modes(torch, dp, model, x)
    model.append(torch.nn.Linear(4, 3))
    both_modes(torch, dp, model, x)
    model[1] = torch.nn.ReLU()
    both_modes(torch, dp, model, x)
    del model[3]
    both_modes(torch, dp, model, x)
    model[0] = torch.nn.Sequential(torch.nn.Linear(6, 7), torch.nn.Linear(7, 5))
    both_modes(torch, dp, model, x)


def test_a_buffer_swapped_added_or_removed_is_seen(torch):
    class Scaled(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(3, 3)
            self.register_buffer("scale", torch.ones(3))

        def forward(self, x):
            out = self.lin(x) * self.scale
            return out + self.shift if hasattr(self, "shift") else out

    model = Scaled()
    dp = dpmini.DataParallel(model, DEVS)
    x = torch.randn(4, 3)
    both_modes(torch, dp, model, x)
    model.scale = torch.full((3,), 2.0)
    both_modes(torch, dp, model, x)
    model.register_buffer("shift", torch.full((3,), 5.0))
    both_modes(torch, dp, model, x)
    model._buffers["scale"] = torch.full((3,), -1.0)
    both_modes(torch, dp, model, x)
    del model.shift
    both_modes(torch, dp, model, x)


def test_train_and_eval_are_seen(torch):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 64), torch.nn.Dropout(0.5))
    dp = dpmini.DataParallel(model, DEVS)
    x = torch.randn(8, 8)
    with torch.no_grad():
        model.eval()
        assert torch.equal(dp(x), model(x))
        model.train()
        assert (dp(x) == 0).any()             # dropout draws in training mode
        model[1].eval()                        # one submodule only
        assert torch.allclose(dp(x), model(x))


def test_requires_grad_changes_are_seen(torch, net):
    model, dp, x = net
    both_modes(torch, dp, model, x)
    model[0].weight.requires_grad_(False)
    both_modes(torch, dp, model, x)
    assert model[0].weight.grad is None
    model[0].weight.requires_grad_(True)
    both_modes(torch, dp, model, x)
    assert model[0].weight.grad is not None


def test_a_buffer_that_starts_requiring_grad_gets_its_gradient(torch):
    class WithBuffer(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("w", torch.ones(3))

        def forward(self, x):
            return x * self.w

    model = WithBuffer()
    dp = dpmini.DataParallel(model, DEVS)
    x = torch.randn(4, 3)
    assert not dp(x).requires_grad
    model.w.requires_grad_(True)
    dp(x).sum().backward()
    assert torch.allclose(model.w.grad, x.sum(0))


def test_a_new_wrapped_module_is_walked(torch, net):
    model, dp, x = net
    both_modes(torch, dp, model, x)
    other = torch.nn.Linear(6, 4)
    dp.module = other
    both_modes(torch, dp, other, x)


def test_a_class_with_its_own_parameters_method_is_walked_every_call(torch):
    class Reversed(torch.nn.Sequential):
        def parameters(self, recurse=True):
            return iter(list(super().parameters(recurse))[::-1])

    torch.manual_seed(0)
    model = Reversed(torch.nn.Linear(3, 3), torch.nn.Linear(3, 2))
    dp = dpmini.DataParallel(model, DEVS)
    x = torch.randn(4, 3)
    both_modes(torch, dp, model, x)
    assert "_dpmini_replica_plan" not in dp.__dict__


def test_the_walk_is_not_pickled_or_copied(torch, net):
    import copy
    import pickle
    model, dp, x = net
    with torch.no_grad():
        dp(x)
    assert "_dpmini_replica_plan" in dp.__dict__
    again = pickle.loads(pickle.dumps(dp))
    assert "_dpmini_replica_plan" not in again.__dict__
    twin = copy.deepcopy(dp)
    assert "_dpmini_replica_plan" not in twin.__dict__
    with torch.no_grad():
        assert torch.allclose(twin(x), model(x)) and torch.allclose(again(x), model(x))
