"""The torch rows of docs/differences.md hold: tensors of a torch.func
transform (grad, jacrev, vmap) have no storage of their own and are refused
with a TypeError naming the path and what to do instead (nn.Module or plain
function, args or kwargs); tensor subclasses travel as plain tensors; a
gathered output's storage is dpmini's and cannot be resized."""
import os

import pytest

import dpmini

# torch raises these errors as C++ exceptions, and a C++ throw aborts the process under
# the preloaded ASan runtime (make test-asan): those tests run in make test-interop.
throws_in_cxx = pytest.mark.skipif(bool(os.environ.get("DPMINI_SANITIZER")),
                                   reason="a C++ exception thrown by torch aborts under ASan")

DEVS = ["cpu:0", "cpu:1"]
REFUSED = r"a tensor of a torch\.func transform .*not around DataParallel"


@throws_in_cxx
@pytest.mark.parametrize("transform", ["grad", "jacrev", "vmap"])
def test_transformed_tensors_are_refused_naming_the_path(torch, transform):
    dp = dpmini.DataParallel(torch.nn.Linear(3, 2).double(), DEVS)
    x = torch.randn(4, 3, dtype=torch.float64)
    with pytest.raises(TypeError, match=rf"^args\[0\]: {REFUSED}"):
        if transform == "grad":
            torch.func.grad(lambda a: dp(a).sum())(x)
        elif transform == "jacrev":
            torch.func.jacrev(dp)(x)
        else:
            torch.func.vmap(dp)(x.unsqueeze(1))


@throws_in_cxx
def test_plain_function_and_kwargs_are_named(torch):
    dp = dpmini.DataParallel(lambda a, mask: a * mask["m"], DEVS)
    x = torch.ones(4, 2, dtype=torch.float64)
    with pytest.raises(TypeError, match=rf"^kwargs\['mask'\]\['m'\]: {REFUSED}"):
        torch.func.grad(lambda m: dp(x, mask={"m": m}).sum())(x)


def test_torch_func_inside_the_module_still_works(torch):
    """The way out the message names: the transform inside each replica."""
    w = torch.randn(3, dtype=torch.float64)
    per_row_grad = torch.func.vmap(torch.func.grad(lambda row: (row * w).sum() ** 2))
    dp = dpmini.DataParallel(per_row_grad, DEVS)
    x = torch.randn(6, 3, dtype=torch.float64)
    with torch.no_grad():
        got = dp(x)
    assert torch.allclose(got, per_row_grad(x), rtol=0, atol=1e-12)


def test_tensor_subclass_inputs_reach_replicas_and_output_as_plain_tensors(torch):
    class Tagged(torch.Tensor):
        pass

    seen = []
    dp = dpmini.DataParallel(lambda a: seen.append(type(a)) or a * 2, DEVS)
    x = torch.arange(8.0).reshape(4, 2).as_subclass(Tagged)
    out = dp(x)
    assert seen == [torch.Tensor, torch.Tensor]
    assert type(out) is torch.Tensor
    assert torch.equal(out, torch.arange(8.0).reshape(4, 2) * 2)


@throws_in_cxx
def test_gathered_output_storage_is_not_resizable_but_its_clone_is(torch):
    dp = dpmini.DataParallel(torch.nn.Identity(), DEVS)
    with torch.no_grad():
        out = dp(torch.ones(4, 3))
    with pytest.raises(RuntimeError, match="not resizable"):
        out.resize_(8, 3)
    assert out.clone().resize_(8, 3).shape == (8, 3)
