"""JAX tracers (the abstract values inside jax.jit, jax.grad, jax.vmap) are
not split or shared: every walker refuses them with a TypeError naming the
path and what to do, and explain reports the same error."""
import numpy as np
import pytest

import dpmini

DEVS = ["cpu:0", "cpu:1"]
TRACER = r"a JAX tracer \(\w*Tracer\) inside a JAX transformation"


def test_dataparallel_under_jit_is_refused_not_shared_whole(jax, jnp):
    dp = dpmini.DataParallel(lambda b: {"rows": b.shape[0]}, DEVS, out_dims={"rows": "sum"})
    x = jnp.zeros((6, 2))
    assert dp(x)["rows"] == 6
    with pytest.raises(TypeError, match=rf"^args\[0\]: {TRACER}.*outside jit") as e:
        jax.jit(lambda a: dp(a)["rows"])(x)
    assert "jax.jit(f)" in str(e.value)


@pytest.mark.parametrize("transform", ["grad", "vmap"])
def test_grad_and_vmap_tracers_are_refused(jax, jnp, transform):
    dp = dpmini.DataParallel(lambda b: b * 2, DEVS)
    x = jnp.ones((4, 2))
    with pytest.raises(TypeError, match=rf"^args\[0\]: {TRACER}"):
        if transform == "grad":
            jax.grad(lambda a: dp(a).sum())(x)
        else:
            jax.vmap(dp)(x)


def test_tracers_are_named_in_kwargs_outputs_modules_and_explain(jax, jnp):
    x = jnp.ones((4, 2))

    def in_kwargs(a):
        return dpmini.DataParallel(lambda b, mask: b, DEVS)(np.ones(4), mask={"m": a})

    with pytest.raises(TypeError, match=rf"^kwargs\['mask'\]\['m'\]: {TRACER}"):
        jax.jit(in_kwargs)(x)

    def gathered(a):
        return dpmini.gather([a, a], "cpu")

    with pytest.raises(TypeError, match=rf"^out: {TRACER}"):
        jax.jit(gathered)(x)

    class Holder:
        def __call__(self, b):
            return b

    def replicated(a):
        h = Holder()
        h.w = a
        return dpmini.replicate(h, DEVS)

    with pytest.raises(TypeError, match=rf"^module\.w: {TRACER}"):
        jax.jit(replicated)(x)

    seen = []

    def explained(a):
        seen.append(dpmini.explain((np.ones(4), a), DEVS))
        return a

    jax.jit(explained)(x)
    plan = seen[0]
    assert plan.error is not None and plan.error.startswith("args[1]: a JAX tracer")
    assert "args[1]" not in [leaf.get("path") for leaf in plan.leaves]
