"""NumPy arrays of ml_dtypes' dtypes (bfloat16, the float8/float6/float4 kinds,
int4...): split, copied and gathered as their own dtype, bit for bit; sums of
the floating kinds accumulate in float32 and round once (docs/libraries.md, "Dtypes NumPy
lacks"). ml_dtypes' dtypes are registered at run time (kind 'V', a type number
NumPy hands out), so these tests also check that nothing keyed on kind or type
number misreads them."""
import numpy as np
import pytest

import dpmini

ml_dtypes = pytest.importorskip("ml_dtypes")

DEVS = ["cpu:0", "cpu:1"]
NAMES = [n for n in ("bfloat16", "float8_e3m4", "float8_e4m3", "float8_e4m3b11fnuz",
                     "float8_e4m3fn", "float8_e4m3fnuz", "float8_e5m2", "float8_e5m2fnuz",
                     "float8_e8m0fnu", "float6_e2m3fn", "float6_e3m2fn", "float4_e2m1fn",
                     "int4", "uint4", "int2", "uint2", "complex32")
         if hasattr(ml_dtypes, n)]
FLOATS = [n for n in NAMES if n.startswith(("bfloat", "float"))]


def sample(name, shape=(6, 3)):
    """Every byte pattern the dtype's itemsize allows, cycled (NaNs included)."""
    dt = np.dtype(getattr(ml_dtypes, name))
    n = int(np.prod(shape))
    raw = (np.arange(n * dt.itemsize, dtype=np.uint64) * 37 % 256).astype(np.uint8)
    return raw.view(dt).reshape(shape) if dt.itemsize == 1 else \
        np.frombuffer(raw.tobytes(), dtype=dt)[:n].reshape(shape)


def bits(a):
    return np.ascontiguousarray(a).view(np.uint8)


@pytest.mark.parametrize("name", NAMES)
def test_scatter_gather_round_trip_keeps_the_dtype_and_every_bit(name):
    x = sample(name)
    parts = dpmini.scatter(x, DEVS)
    assert [p.dtype for p in parts] == [x.dtype] * 2
    assert [dpmini.device_of(p) for p in parts] == [dpmini.Device(d) for d in DEVS]
    back = dpmini.gather(list(parts), "cpu")
    assert back.dtype == x.dtype and np.array_equal(bits(back), bits(x))
    cols = dpmini.gather(list(dpmini.scatter(x, DEVS, dim=1)), "cpu", dim=1)
    assert cols.dtype == x.dtype and np.array_equal(bits(cols), bits(x))


@pytest.mark.parametrize("name", NAMES)
def test_comm_scatter_gather_broadcast_keep_every_bit(name):
    x = sample(name)
    parts = dpmini.comm.scatter(x, DEVS)
    assert [p.dtype for p in parts] == [x.dtype] * 2
    back = dpmini.comm.gather(parts, destination="cpu")
    assert np.array_equal(bits(back), bits(x))
    out = np.empty_like(x)
    dpmini.comm.gather(parts, out=out)
    assert np.array_equal(bits(out), bits(x))
    for copy in dpmini.comm.broadcast(x, DEVS):
        assert copy.dtype == x.dtype and np.array_equal(bits(copy), bits(x))


@pytest.mark.parametrize("name", NAMES)
def test_dataparallel_returns_the_replicas_arrays_in_their_dtype(name):
    x = sample(name)
    out = dpmini.DataParallel(lambda a: {"same": a}, DEVS)(x)
    assert out["same"].dtype == x.dtype and np.array_equal(bits(out["same"]), bits(x))


def test_bfloat16_sums_accumulate_in_float32_and_round_once():
    bf16 = ml_dtypes.bfloat16
    # 1 + 2**-8 rounds back to 1 in bfloat16 (a half ulp, ties to even), so
    # adding two of them one at a time gives 1; in float32 they add to 2**-7
    # first, which bfloat16 holds: 1.0078125
    a = np.array([1.0, 3.0], dtype=bf16)
    b = np.array([2.0 ** -8, 1.0], dtype=bf16)
    c = np.array([2.0 ** -8, -0.5], dtype=bf16)
    stepwise = (a + b) + c
    want = (a.astype(np.float32) + b.astype(np.float32) + c.astype(np.float32)).astype(bf16)
    assert float(want[0]) == 1.0078125 and float(stepwise[0]) == 1.0
    got = dpmini.comm.reduce_add([a, b, c], "cpu:1")
    assert got.dtype == bf16 and dpmini.device_of(got) == dpmini.Device("cpu:1")
    assert np.array_equal(bits(got), bits(want))
    per_device = [[a, b], [b, c], [c, a]]
    sums = dpmini.comm.reduce_add_coalesced(per_device, "cpu")
    assert [s.dtype for s in sums] == [bf16] * 2
    assert np.array_equal(bits(sums[0]), bits(want))


def test_out_dims_sum_of_bfloat16_matches_a_float32_reference():
    bf16 = ml_dtypes.bfloat16
    parts = [np.array([1.0, 3.0], dtype=bf16), np.array([2.0 ** -8, 1.0], dtype=bf16),
             np.array([2.0 ** -8, -0.5], dtype=bf16)]
    dp = dpmini.DataParallel(lambda i: parts[int(i[0])], ["cpu:0", "cpu:1", "cpu:0"],
                             out_dims="sum")
    got = dp(np.arange(3))
    want = sum(p.astype(np.float32) for p in parts).astype(bf16)
    assert got.dtype == bf16 and np.array_equal(bits(got), bits(want))


@pytest.mark.parametrize("name", FLOATS)
def test_small_float_sums_match_a_float32_reference(name):
    dt = getattr(ml_dtypes, name)
    rng = np.random.default_rng(0)
    parts = [rng.uniform(0, 2, size=(5, 3)).astype(dt) for _ in range(3)]
    want = sum(p.astype(np.float32) for p in parts).astype(dt)
    got = dpmini.comm.reduce_add(parts, "cpu")
    assert got.dtype == np.dtype(dt)
    assert np.array_equal(bits(got), bits(want))


def test_complex32_sums_accumulate_in_complex64():
    c32 = getattr(ml_dtypes, "complex32", None)
    if c32 is None:
        pytest.skip("this ml_dtypes has no complex32")
    parts = [np.array([1 + 2j, 0.5j], dtype=c32), np.array([2 ** -11, 1], dtype=c32),
             np.array([2 ** -11, -1j], dtype=c32)]
    want = sum(p.astype(np.complex64) for p in parts).astype(c32)
    got = dpmini.comm.reduce_add(parts, "cpu")
    assert got.dtype == np.dtype(c32) and np.array_equal(bits(got), bits(want))


@pytest.mark.parametrize("name", [n for n in ("int4", "uint4", "int2") if n in NAMES])
def test_small_integer_sums_are_refused_naming_the_argument(name):
    x = np.ones(4, dtype=getattr(ml_dtypes, name))
    with pytest.raises(TypeError, match=rf"^arrays: arrays of dtype {name} cannot be summed"):
        dpmini.comm.reduce_add([x, x], "cpu")
    with pytest.raises(TypeError, match=rf"^out: arrays of dtype {name} cannot be summed"):
        dpmini.DataParallel(lambda a: a, DEVS, out_dims="sum")(np.ones((2, 2), dtype=x.dtype))


def test_out_dims_none_counts_bfloat16_nan_as_equal_to_nan():
    same = np.array([1.0, np.nan], dtype=ml_dtypes.bfloat16)
    out = dpmini.DataParallel(lambda a: (same, a), DEVS, out_dims=(None, 0))(np.ones(2))
    assert out[0].dtype == same.dtype and np.array_equal(bits(out[0]), bits(same))


def test_gather_refuses_a_float32_replica_into_bfloat16_naming_both():
    outs = [np.ones(2, dtype=ml_dtypes.bfloat16), np.ones(2, dtype=np.float32)]
    with pytest.raises(TypeError, match=r"replica 1 returned float32.*bfloat16"):
        dpmini.gather(outs, "cpu")
