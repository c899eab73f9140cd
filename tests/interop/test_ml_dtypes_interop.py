"""torch bfloat16/float8 tensors and JAX bfloat16/float8 arrays through dpmini
as their own dtype: read through dpmini's own DLPack import (NumPy's refuses
them) as ml_dtypes' dtypes, and handed back through dpmini's DLPack export as
the caller's library's dtype (docs/libraries.md, "Dtypes NumPy lacks")."""
import subprocess
import sys

import numpy as np
import pytest

import dpmini

from .conftest import DEVS

ml_dtypes = pytest.importorskip("ml_dtypes")

TORCH_DTYPES = ["bfloat16", "float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz",
                "float8_e5m2fnuz", "float8_e8m0fnu", "complex32"]
JAX_DTYPES = ["bfloat16", "float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz",
              "float8_e4m3b11fnuz", "float8_e3m4", "float8_e4m3", "float8_e8m0fnu"]


def torch_sample(torch, name, shape=(6, 2)):
    dt = getattr(torch, name)
    raw = (torch.arange(int(np.prod(shape)) * dt.itemsize) * 37 % 256).to(torch.uint8)
    return raw.view(dt).reshape(shape)


def torch_bits(torch, t):
    return t.contiguous().view(torch.uint8)


@pytest.mark.parametrize("name", TORCH_DTYPES)
def test_torch_small_float_round_trip_keeps_the_dtype_and_every_bit(torch, name):
    if not hasattr(torch, name):
        pytest.skip(f"this torch has no {name}")
    x = torch_sample(torch, name)
    parts = dpmini.scatter(x, DEVS)
    assert [(type(p), p.dtype) for p in parts] == [(torch.Tensor, x.dtype)] * 2
    back = dpmini.gather(list(parts), "cpu")
    assert type(back) is torch.Tensor and back.dtype == x.dtype
    assert torch.equal(torch_bits(torch, back), torch_bits(torch, x))
    out = dpmini.DataParallel(lambda t: {"t": t}, DEVS)(x)["t"]
    assert out.dtype == x.dtype and torch.equal(torch_bits(torch, out), torch_bits(torch, x))
    comm = dpmini.comm.gather(dpmini.comm.scatter(x, DEVS), destination="cpu")
    assert comm.dtype == x.dtype and torch.equal(torch_bits(torch, comm), torch_bits(torch, x))


def test_torch_bfloat16_sums_match_a_float32_reference(torch):
    a = torch.tensor([1.0, 3.0], dtype=torch.bfloat16)
    b = torch.tensor([2.0 ** -8, 1.0], dtype=torch.bfloat16)
    c = torch.tensor([2.0 ** -8, -0.5], dtype=torch.bfloat16)
    want = (a.float() + b.float() + c.float()).bfloat16()
    got = dpmini.comm.reduce_add([a, b, c], "cpu")
    assert got.dtype == torch.bfloat16 and torch.equal(got, want)
    assert got[0].item() == 1.0078125   # one rounding: not 1.0 as bfloat16 steps give
    parts = [a, b, c]
    dp = dpmini.DataParallel(lambda i: parts[int(i[0])], ["cpu:0", "cpu:1", "cpu:0"],
                             out_dims="sum")
    summed = dp(torch.arange(3))
    assert summed.dtype == torch.bfloat16 and torch.equal(summed, want)


def test_torch_float8_sums_round_once_from_float32(torch):
    xs = [torch.tensor([0.5, 1.0, 2.0, 3.0]).to(torch.float8_e4m3fn) for _ in range(3)]
    want = sum(x.float() for x in xs).to(torch.float8_e4m3fn)
    got = dpmini.comm.reduce_add(xs, "cpu")
    assert got.dtype == torch.float8_e4m3fn
    assert torch.equal(torch_bits(torch, got), torch_bits(torch, want))


def test_cpu_autocast_returns_bfloat16_as_torch_does(torch):
    w = torch.randn(3, 4)

    def fn(t):
        return t @ w.T

    x = torch.randn(6, 4)
    with torch.no_grad(), torch.autocast("cpu"):
        want = fn(x)
        got = dpmini.DataParallel(fn, DEVS)(x)
    assert want.dtype == torch.bfloat16
    assert got.dtype == torch.bfloat16 and torch.equal(got, want)


def test_a_bfloat16_module_runs_on_bfloat16_inputs(torch):
    m = torch.nn.Linear(4, 3).bfloat16()
    x = torch.randn(6, 4, dtype=torch.bfloat16)
    with torch.no_grad():
        want = m(x)
        got = dpmini.DataParallel(m, DEVS)(x)
    assert got.dtype == torch.bfloat16 and torch.equal(got, want)


@pytest.mark.parametrize("name", JAX_DTYPES)
def test_jax_small_float_round_trip_keeps_the_dtype_and_every_bit(jax, name):
    import jax.numpy as jnp
    if not hasattr(jnp, name):
        pytest.skip(f"this JAX has no {name}")
    dt = np.dtype(getattr(jnp, name))
    host = (np.arange(12) * 37 % 256).astype(np.uint8).view(dt).reshape(6, 2) \
        if dt.itemsize == 1 else np.arange(12, dtype=np.float32).reshape(6, 2).astype(dt)
    x = jnp.asarray(host)
    parts = dpmini.scatter(x, DEVS)
    assert [p.dtype for p in parts] == [dt] * 2
    back = dpmini.gather(list(parts), "cpu")
    assert isinstance(back, jax.Array) and back.dtype == dt
    assert np.array_equal(np.asarray(back).view(np.uint8), host.view(np.uint8))


def test_jax_bfloat16_model_output_comes_back_as_jax_bfloat16(jax):
    import jax.numpy as jnp
    x = jnp.arange(12, dtype=jnp.float32).reshape(6, 2).astype(jnp.bfloat16)
    out = dpmini.DataParallel(lambda a: a * 2, DEVS)(x)
    assert isinstance(out, jax.Array) and out.dtype == jnp.bfloat16
    assert np.array_equal(np.asarray(out), np.asarray(x * 2))
    s = dpmini.DataParallel(lambda a: a, DEVS, out_dims="sum")(x)
    want = (np.asarray(x)[:3].astype(np.float32) + np.asarray(x)[3:].astype(np.float32)
            ).astype(ml_dtypes.bfloat16)
    assert s.dtype == jnp.bfloat16 and np.array_equal(np.asarray(s), want)


def test_a_packed_float4_tensor_is_refused_naming_its_dtype(torch):
    if not hasattr(torch, "float4_e2m1fn_x2"):
        pytest.skip("this torch has no float4_e2m1fn_x2")
    x = torch.zeros(4, dtype=torch.uint8).view(torch.float4_e2m1fn_x2)
    with pytest.raises(TypeError, match=r"^args\[0\]: a torch.Tensor of dtype a vector dtype "
                                        r".*NumPy has no such dtype"):
        dpmini.DataParallel(lambda t: t, DEVS)(x)


def test_without_ml_dtypes_bfloat16_is_refused_as_before(torch):
    code = (
        "import sys; sys.modules['ml_dtypes'] = None\n"
        "import torch, dpmini\n"
        "x = torch.zeros(4, dtype=torch.bfloat16)\n"
        "try:\n"
        "    dpmini.DataParallel(lambda t: t, ['cpu:0', 'cpu:1'])(x)\n"
        "except TypeError as e:\n"
        "    print(e)\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("args[0]: a torch.Tensor of dtype bfloat16: NumPy has no such "
                               "dtype"), r.stdout
    assert "pip install ml_dtypes" in r.stdout
