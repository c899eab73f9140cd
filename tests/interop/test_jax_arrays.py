"""JAX arrays through DataParallel, scatter, gather, replicate, explain and
comm on the virtual CPU devices: JAX in, JAX shards and JAX
results out; an array sharded over several JAX devices is read through
numpy.asarray (a copy) and never called a GPU array."""
import warnings

import numpy as np
import pytest

import dpmini

DEVS = ["cpu:0", "cpu:1"]


def is_jax(a, jax):
    return isinstance(a, jax.Array)


@pytest.mark.parametrize("dim", [0, 1, -1])
def test_split_along_dim_gives_jax_shards(jax, jnp, dim):
    x = jnp.arange(24.0).reshape(4, 6)
    seen = []

    def replica(s):
        seen.append(s)
        return s * 2

    out = dpmini.DataParallel(replica, DEVS, dim=dim)(x)
    assert is_jax(out, jax) and out.dtype == jnp.float64
    np.testing.assert_array_equal(np.asarray(out), np.asarray(x) * 2)
    assert all(is_jax(s, jax) for s in seen)
    want = np.array_split(np.asarray(x), 2, axis=dim)
    got = sorted((np.asarray(s) for s in seen), key=lambda a: a.flat[0])
    for g, w in zip(got, want):
        np.testing.assert_array_equal(g, w)


def test_shards_alias_dpmini_device_memory(jax, jnp):
    x = jnp.arange(16.0)
    before = dpmini.memory_allocated("cpu:1")
    parts = dpmini.scatter(x, DEVS)
    assert all(is_jax(p, jax) for p in parts)
    assert dpmini.memory_allocated("cpu:1") >= before + 8 * 8
    assert parts[1].unsafe_buffer_pointer() % 64 == 0
    np.testing.assert_array_equal(np.asarray(parts[1]), np.arange(8.0, 16.0))
    del parts
    assert dpmini.memory_allocated("cpu:1") == before


def test_outputs_dicts_and_losses(jax, jnp):
    x = jnp.arange(8.0).reshape(4, 2)

    def replica(s, scale):
        return {"y": s * scale, "loss": (s ** 2).sum()}

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        out = dpmini.DataParallel(replica, DEVS, in_dims=(0, None))(x, jnp.array(2.0))
    assert is_jax(out["y"], jax) and is_jax(out["loss"], jax)
    np.testing.assert_array_equal(np.asarray(out["y"]), np.asarray(x) * 2)
    np.testing.assert_array_equal(np.asarray(out["loss"]), [14.0, 126.0])


def test_sharded_jax_array_is_read_on_the_host(jax, jnp):
    if len(jax.devices()) < 2:
        pytest.skip("needs 2 JAX CPU devices (XLA_FLAGS set before JAX was imported)")
    from jax.sharding import Mesh, NamedSharding, PartitionSpec
    mesh = Mesh(np.array(jax.devices()[:2]), ("d",))
    x = jax.device_put(jnp.arange(8.0).reshape(4, 2), NamedSharding(mesh, PartitionSpec("d")))
    assert len(x.sharding.device_set) == 2
    seen = []
    out = dpmini.DataParallel(lambda s: seen.append(s) or s + 1, DEVS)(x)
    assert is_jax(out, jax)
    np.testing.assert_array_equal(np.asarray(out), np.arange(8.0).reshape(4, 2) + 1)
    assert all(is_jax(s, jax) and s.shape == (2, 2) for s in seen)
    plan = dpmini.explain((x,), DEVS)
    assert plan.error is None and "GPU" not in str(plan)


def test_gather_mixed_with_torch_is_refused(jax, jnp, torch):
    with pytest.raises(TypeError, match=r"^out\[0\]: .*different libraries"):
        dpmini.gather([(jnp.ones(2),), (torch.ones(2),)], "cpu")


def test_comm_and_replicate_with_jax(jax, jnp):
    x = jnp.arange(6.0)
    parts = dpmini.comm.scatter(x, DEVS)
    assert all(is_jax(p, jax) for p in parts)
    g = dpmini.comm.gather(list(parts), destination="cpu")
    assert is_jax(g, jax)
    np.testing.assert_array_equal(np.asarray(g), np.arange(6.0))

    class M:
        def __init__(self):
            self.w = jnp.ones(3)

    reps = dpmini.replicate(M(), DEVS)
    assert all(is_jax(r.w, jax) for r in reps)
    assert reps[0].w.unsafe_buffer_pointer() != reps[1].w.unsafe_buffer_pointer()


def test_explain_shows_jax_leaves(jax, jnp):
    plan = dpmini.explain((jnp.ones((4, 2)),), DEVS)
    assert plan.leaves[0]["library"] == "jax.Array cpu"
