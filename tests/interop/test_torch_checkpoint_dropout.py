"""torch.utils.checkpoint with dropout inside replicas on virtual CPU devices.

On GPUs each replica's dropout draws from its device's generator, and checkpoint
stashes that generator's state so the recomputation in backward draws the same
mask: the gradients equal those of the same call without checkpoint. dpmini's
replicas on virtual CPU devices draw from per-replica generators (the random
numbers rule of docs/libraries.md); in a replica torch.get_rng_state and
torch.set_rng_state are that generator's, so checkpoint stashes its state and the
recomputation, run by torch's autograd engine on the caller's thread, draws the
replica's mask from the default generator set to it."""
import os

import pytest

# torch raises a C++ exception in the recomputation (its saved-tensor check), and a C++
# throw aborts the process under the preloaded ASan runtime (its __cxa_throw interceptor
# finds no real __cxa_throw): nothing of dpmini's to see there.
pytestmark = pytest.mark.skipif(bool(os.environ.get("DPMINI_SANITIZER")),
                                reason="a C++ exception thrown by torch aborts under ASan")

DEVS = ["cpu:0", "cpu:1"]


def _grads_with_and_without_checkpoint(torch, use_reentrant):
    import torch.nn.functional as F
    import torch.utils.checkpoint as cp

    import dpmini

    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a = torch.nn.Linear(8, 8)
            self.b = torch.nn.Linear(8, 1)
            self.checkpoint = False

        def inner(self, x):
            return F.dropout(torch.relu(self.a(x)), 0.5, self.training)

        def forward(self, x):
            if self.checkpoint:
                h = cp.checkpoint(self.inner, x, use_reentrant=use_reentrant)
            else:
                h = self.inner(x)
            return self.b(h)

    torch.manual_seed(0)
    model = Block().double()
    dp = dpmini.DataParallel(model, DEVS)
    x = torch.randn(8, 8, dtype=torch.float64, requires_grad=use_reentrant)
    grads = []
    for checkpoint in (False, True):
        model.zero_grad()
        model.checkpoint = checkpoint
        torch.manual_seed(7)
        dp(x).sum().backward()
        grads.append([p.grad.clone() for p in model.parameters()])
    return grads


@pytest.mark.parametrize("use_reentrant", [False, True])
def test_checkpoint_with_dropout_gives_the_gradients_of_the_call_without_it(torch, use_reentrant):
    plain, checkpointed = _grads_with_and_without_checkpoint(torch, use_reentrant)
    for g, h in zip(plain, checkpointed):
        assert torch.allclose(g, h, rtol=0, atol=1e-12)
