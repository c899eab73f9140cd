"""A subclass of dpmini.DataParallel whose own __init__ builds the torch module
and passes it to super().__init__ (the constructor's arguments are not the
module) is a torch.nn.Module wrapper as torch.nn.DataParallel's subclasses are:
its parameters are registered under "module.", it trains with autograd."""
import copy

DEVS = ["cpu:0", "cpu:1"]


def _subclass(torch):
    import dpmini

    class Built(dpmini.DataParallel):
        def __init__(self, width):
            super().__init__(torch.nn.Linear(4, width).double(), device_ids=DEVS)
            self.width = width

    return Built


def test_a_subclass_that_builds_its_module_is_an_nn_module(torch):
    built = _subclass(torch)(3)
    assert isinstance(built, torch.nn.Module)
    assert sorted(built.state_dict()) == ["module.bias", "module.weight"]
    assert built.width == 3
    assert [n for n, _ in built.named_children()] == ["module"]


def test_a_subclass_that_builds_its_module_trains_as_a_single_device_run(torch):
    torch.manual_seed(0)
    built = _subclass(torch)(3)
    ref = copy.deepcopy(built.module)
    x = torch.randn(5, 4, dtype=torch.float64)
    built(x).pow(2).sum().backward()
    ref(x).pow(2).sum().backward()
    assert torch.allclose(built.module.weight.grad, ref.weight.grad, rtol=0, atol=1e-12)
    assert torch.allclose(built.module.bias.grad, ref.bias.grad, rtol=0, atol=1e-12)


def test_a_subclass_that_builds_its_module_keeps_its_class_through_deepcopy(torch):
    cls = _subclass(torch)
    built = cls(2)
    clone = copy.deepcopy(built)
    assert isinstance(clone, cls) and isinstance(clone, torch.nn.Module)
    assert clone.width == 2 and clone.module is not built.module
