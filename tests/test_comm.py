"""dpmini.comm: scatter / gather / broadcast / broadcast_coalesced / reduce_add /
reduce_add_coalesced (docs/spec.md 8, 4.3, 4.6-4.8, 3.4, 5.3; strided inputs split in logical order)."""
import warnings

import numpy as np
import pytest

import dpmini
from dpmini import comm


def dev(a):
    return str(dpmini.device_of(a))


ALL_DTYPES = [
    np.bool_, np.int8, np.int16, np.int32, np.int64,
    np.uint8, np.uint16, np.uint32, np.uint64,
    np.float16, np.float32, np.float64, np.complex64, np.complex128,
]
STRUCTURED = np.dtype([("a", "<i4"), ("b", "<f8"), ("c", "S3")])


def sample(shape, dtype, seed=0):
    """Deterministic data of any dtype, bit patterns varied."""
    dtype = np.dtype(dtype)
    rng = np.random.default_rng(seed)
    n = int(np.prod(shape))
    if dtype == np.bool_:
        return (rng.integers(0, 2, size=shape)).astype(np.bool_)
    if dtype.fields is not None:
        a = np.zeros(shape, dtype=dtype)
        a["a"] = rng.integers(-1000, 1000, size=shape)
        a["b"] = rng.standard_normal(size=shape)
        a["c"] = np.array([b"xyz"[i % 3:] for i in range(n)], dtype="S3").reshape(shape)
        return a
    raw = rng.integers(0, 256, size=n * dtype.itemsize, dtype=np.uint8).tobytes()
    a = np.frombuffer(raw, dtype=dtype).reshape(shape).copy()
    if dtype.kind in "fc":
        a[~np.isfinite(a)] = 1.5  # keep comparisons simple
    return a


def bits(a):
    return np.ascontiguousarray(a).tobytes()


# --------------------------------------------------------------------- scatter

def test_scatter_returns_tuple_of_copies_on_each_device(dev3):
    x = np.arange(24.0).reshape(6, 4)
    chunks = comm.scatter(x, dev3)
    assert isinstance(chunks, tuple) and len(chunks) == 3
    assert [dev(c) for c in chunks] == dev3
    for i, c in enumerate(chunks):
        assert type(c) is np.ndarray
        np.testing.assert_array_equal(c, x[2 * i: 2 * i + 2])
        assert not np.shares_memory(c, x)  # host -> virtual device is a copy
    # the caller's array is untouched and still on the host
    assert dev(x) == "cpu"


def test_scatter_chunks_are_independent_copies(dev2):
    x = np.arange(8.0)
    chunks = comm.scatter(x, dev2)
    chunks[0][:] = -1
    chunks[1][:] = -2
    np.testing.assert_array_equal(x, np.arange(8.0))


def test_scatter_view_rule_chunk_on_own_device_is_a_view(dev2):
    xd = dpmini.asarray(np.arange(12.0).reshape(4, 3), "cpu:0")
    assert dev(xd) == "cpu:0"
    chunks = comm.scatter(xd, dev2)
    assert np.shares_memory(chunks[0], xd)
    assert not np.shares_memory(chunks[1], xd)
    assert dev(chunks[0]) == "cpu:0" and dev(chunks[1]) == "cpu:1"
    np.testing.assert_array_equal(chunks[0], xd[:2])
    np.testing.assert_array_equal(chunks[1], xd[2:])


def test_scatter_view_rule_dim1_view_is_noncontiguous():
    xd = dpmini.asarray(np.arange(12.0).reshape(3, 4), "cpu:1")
    chunks = comm.scatter(xd, ["cpu:0", "cpu:1"], dim=1)
    assert np.shares_memory(chunks[1], xd)          # a view, even non-contiguous
    assert not chunks[1].flags.c_contiguous
    assert not np.shares_memory(chunks[0], xd)
    np.testing.assert_array_equal(chunks[0], xd[:, :2])
    np.testing.assert_array_equal(chunks[1], xd[:, 2:])
    assert dev(chunks[1]) == "cpu:1"


def test_scatter_view_rule_repeated_device():
    xd = dpmini.asarray(np.arange(6), "cpu:2")
    chunks = comm.scatter(xd, ["cpu:2", "cpu:2", "cpu:0"])
    assert np.shares_memory(chunks[0], xd) and np.shares_memory(chunks[1], xd)
    assert not np.shares_memory(chunks[2], xd)
    assert [c.tolist() for c in chunks] == [[0, 1], [2, 3], [4, 5]]


def test_scatter_dense_copy_keeps_strides_fortran_dim1(dev2):
    # docs/spec.md 3.4: a copied chunk keeps its strides when the view is dense (preserve format)
    x = np.asfortranarray(np.arange(24.0).reshape(4, 6))
    chunks = comm.scatter(x, dev2, dim=1)
    for i, c in enumerate(chunks):
        assert c.flags.f_contiguous
        np.testing.assert_array_equal(c, x[:, 3 * i: 3 * i + 3])


def test_scatter_non_dense_copy_is_c_contiguous(dev2):
    x = np.arange(10).reshape(2, 5).T  # chunk views along dim 0 have gaps
    chunks = comm.scatter(x, dev2)
    assert all(c.flags.c_contiguous for c in chunks)


@pytest.mark.parametrize("dtype", ALL_DTYPES + [STRUCTURED], ids=lambda d: np.dtype(d).name)
def test_scatter_gather_all_dtypes_bit_identical(dtype, dev3):
    x = sample((7, 5), dtype)
    chunks = comm.scatter(x, dev3)
    assert all(c.dtype == x.dtype for c in chunks)
    for c, (lo, hi) in zip(chunks, [(0, 3), (3, 6), (6, 7)]):
        assert bits(c) == bits(x[lo:hi])
    y = comm.gather(chunks)
    assert y.dtype == x.dtype and y.shape == x.shape
    assert bits(y) == bits(x)
    assert dev(y) == "cpu"


@pytest.mark.parametrize("dtype", [np.complex64, np.complex128])
def test_complex_stays_complex(dtype, dev2):
    x = (np.arange(6) + 1j * np.arange(6, 12)).astype(dtype)
    chunks = comm.scatter(x, dev2)
    assert [c.shape for c in chunks] == [(3,), (3,)]  # no view_as_real trailing 2
    y = comm.gather(chunks, destination="cpu:1")
    assert y.dtype == dtype
    np.testing.assert_array_equal(y, x)


# strided / non-contiguous inputs split in logical order, not storage order
def test_transposed_split(dev2):
    x = np.arange(10).reshape(2, 5).T
    a, b = comm.scatter(x, dev2)
    np.testing.assert_array_equal(a, [[0, 5], [1, 6], [2, 7]])
    np.testing.assert_array_equal(b, [[3, 8], [4, 9]])


def test_step_slice_split(dev2):
    x = np.arange(6.0)[::2]
    a, b = comm.scatter(x, dev2)
    np.testing.assert_array_equal(a, [0.0, 2.0])
    np.testing.assert_array_equal(b, [4.0])


def test_negative_stride_split(dev2):
    x = np.arange(4)[::-1]
    a, b = comm.scatter(x, dev2)
    np.testing.assert_array_equal(a, [3, 2])
    np.testing.assert_array_equal(b, [1, 0])


def test_dim1_of_c_contiguous_round_trip(dev2):
    x = np.arange(24).reshape(4, 6)
    chunks = comm.scatter(x, dev2, dim=1)
    np.testing.assert_array_equal(chunks[0], x[:, :3])
    np.testing.assert_array_equal(chunks[1], x[:, 3:])
    y = comm.gather(chunks, dim=1)
    np.testing.assert_array_equal(y, x)


def test_gather_of_noncontiguous_parts_is_logical_concat():
    parts = [np.arange(10).reshape(2, 5).T, np.arange(10, 20).reshape(2, 5).T[::-1]]
    parts = [dpmini.asarray(p, "cpu:0") for p in parts[:1]] + parts[1:]
    y = comm.gather(parts)
    np.testing.assert_array_equal(y, np.concatenate([np.asarray(p) for p in parts]))
    y1 = comm.gather([np.arange(12).reshape(3, 4)[:, ::2], np.arange(12).reshape(3, 4)[:, 1::2]], dim=1)
    np.testing.assert_array_equal(y1, [[0, 2, 1, 3], [4, 6, 5, 7], [8, 10, 9, 11]])


def test_gather_from_permuted_numpy(dev2):
    # pytorch#74809: a tensor built from np.arange(10).reshape(2,5).T
    x = np.arange(10).reshape(2, 5).T
    y = comm.gather([x, x], destination="cpu:1")
    np.testing.assert_array_equal(y, np.concatenate([x, x]))


@pytest.mark.parametrize(
    "make",
    [
        lambda: np.asfortranarray(np.arange(60.0).reshape(5, 12)),
        lambda: np.arange(180.0).reshape(5, 36)[:, ::-3],
        lambda: np.arange(240.0).reshape(10, 24)[::2, 1::2],
        lambda: np.broadcast_to(np.arange(12.0), (5, 12)),
        lambda: np.broadcast_to(np.arange(5.0)[:, None], (5, 12)),
        lambda: np.arange(60.0).reshape(3, 4, 5).transpose(2, 0, 1).reshape(5, 12),
        lambda: np.arange(60.0).reshape(12, 5).T,
        lambda: np.arange(60.0).reshape(12, 5).T[::-1, ::-1],
    ],
    ids=["fortran", "neg-step-cols", "step-rows-cols", "bcast-rows", "bcast-cols",
         "permuted", "transposed", "transposed-reversed"],
)
@pytest.mark.parametrize("dim", [0, 1, -1, -2])
def test_noncontiguous_inputs_round_trip(make, dim, dev3):
    x = make()
    assert x.shape == (5, 12)
    chunks = comm.scatter(x, dev3, dim=dim)
    n = x.shape[dim]
    split = -(-n // 3)
    for i, c in enumerate(chunks):
        np.testing.assert_array_equal(c, np.take(x, range(i * split, min(n, (i + 1) * split)), axis=dim))
    y = comm.gather(chunks, dim=dim)
    np.testing.assert_array_equal(y, x)


def test_broadcast_zero_stride_chunks_are_writable_copies(dev2):
    x = np.broadcast_to(np.arange(3.0), (4, 3))
    a, b = comm.scatter(x, dev2)
    a[0, 0] = 99.0  # a copy on its own device; the source is read-only
    assert x[0, 0] == 0.0 and x[1, 0] == 0.0
    np.testing.assert_array_equal(b, [[0, 1, 2], [0, 1, 2]])


def test_scatter_buffer_protocol_bytearray(dev2):
    buf = bytearray(range(10))
    chunks = comm.scatter(buf, dev2)
    assert all(c.dtype == np.uint8 for c in chunks)
    assert [c.tolist() for c in chunks] == [[0, 1, 2, 3, 4], [5, 6, 7, 8, 9]]
    assert [dev(c) for c in chunks] == dev2


def test_scatter_buffer_protocol_memoryview(dev2):
    x = np.arange(12.0).reshape(4, 3)
    chunks = comm.scatter(memoryview(x), dev2)
    assert [c.shape for c in chunks] == [(2, 3), (2, 3)]
    assert chunks[0].dtype == np.float64
    np.testing.assert_array_equal(np.concatenate(chunks), x)


def test_scatter_buffer_protocol_strided_memoryview(dev2):
    x = np.arange(12, dtype=np.int32).reshape(4, 3)
    mv = memoryview(x)[::-2]
    chunks = comm.scatter(mv, dev2)
    np.testing.assert_array_equal(np.concatenate(chunks), x[::-2])


def test_scatter_array_interface_object(dev2):
    base = np.arange(6, dtype=np.int16).reshape(3, 2)

    class OnlyInterface:
        def __init__(self, a):
            self._a = a

        @property
        def __array_interface__(self):
            return self._a.__array_interface__

    obj = OnlyInterface(base)
    assert not isinstance(obj, np.ndarray)
    chunks = comm.scatter(obj, dev2)
    assert [c.shape for c in chunks] == [(2, 2), (1, 2)]
    assert chunks[0].dtype == np.int16
    np.testing.assert_array_equal(np.concatenate(chunks), base)


def test_scatter_ndarray_subclass_accepted(dev2):
    class Sub(np.ndarray):
        pass

    x = np.arange(4.0).view(Sub)
    chunks = comm.scatter(x, dev2)
    np.testing.assert_array_equal(np.concatenate([np.asarray(c) for c in chunks]), np.arange(4.0))


def test_scatter_with_out(dev2):
    x = np.arange(10.0).reshape(5, 2)
    outs = [dpmini.asarray(np.zeros((3, 2)), "cpu:0"), dpmini.asarray(np.zeros((2, 2)), "cpu:1")]
    res = comm.scatter(x, out=outs)
    assert len(res) == 2
    assert res[0] is outs[0] and res[1] is outs[1]
    np.testing.assert_array_equal(outs[0], x[:3])
    np.testing.assert_array_equal(outs[1], x[3:])


@pytest.mark.parametrize("container", [list, tuple, iter])
def test_scatter_with_out_as_any_sequence(container):
    x = np.arange(10.0).reshape(5, 2)
    outs = [np.zeros((3, 2)), np.zeros((2, 2))]
    res = comm.scatter(x, out=container(outs))
    assert type(res) is tuple and res[0] is outs[0] and res[1] is outs[1]
    np.testing.assert_array_equal(outs[1], x[3:])


def test_scatter_with_out_uneven_sizes_and_dim1():
    x = np.arange(10.0).reshape(2, 5)
    outs = [np.zeros((2, 1)), np.zeros((2, 4))]
    comm.scatter(x, dim=1, out=outs)
    np.testing.assert_array_equal(outs[0], x[:, :1])
    np.testing.assert_array_equal(outs[1], x[:, 1:])


def test_scatter_with_out_bad_total(dev2):
    x = np.arange(10.0).reshape(5, 2)
    with pytest.raises(ValueError, match="out"):
        comm.scatter(x, out=[np.zeros((2, 2)), np.zeros((2, 2))])
    with pytest.raises(ValueError, match="out"):
        comm.scatter(x, out=[np.zeros((3, 3)), np.zeros((2, 2))])
    with pytest.raises(ValueError, match="out|devices"):
        comm.scatter(x, dev2, out=[np.zeros((3, 2)), np.zeros((2, 2))])


# ---------------------------------------------------------------------- gather

def test_gather_concatenates_uneven_parts():
    a = np.arange(8).reshape(2, 4)
    b = np.arange(8, 20).reshape(3, 4)
    y = comm.gather([a, b])
    assert y.shape == (5, 4)
    np.testing.assert_array_equal(y, np.concatenate([a, b]))
    assert dev(y) == "cpu"  # destination None is the host
    assert not np.shares_memory(y, a) and not np.shares_memory(y, b)


def test_gather_result_is_always_fresh():
    a = dpmini.asarray(np.arange(4.0), "cpu:0")
    y = comm.gather([a], destination="cpu:0")
    np.testing.assert_array_equal(y, a)
    assert not np.shares_memory(y, a)


def test_gather_parts_from_several_devices_to_device(dev3):
    x = np.arange(30.0).reshape(10, 3)
    chunks = comm.scatter(x, dev3)
    y = comm.gather(chunks, destination="cpu:1")
    assert dev(y) == "cpu:1"
    np.testing.assert_array_equal(y, x)


def test_gather_destination_cpu_string_no_warning():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        y = comm.gather([np.ones(2), np.zeros(1)], destination="cpu")
    assert dev(y) == "cpu"
    np.testing.assert_array_equal(y, [1, 1, 0])


def test_gather_destination_minus_one_warns_futurewarning():
    with pytest.warns(FutureWarning):
        y = comm.gather([np.ones(2), np.zeros(1)], destination=-1)
    assert dev(y) == "cpu"
    np.testing.assert_array_equal(y, [1, 1, 0])


def test_gather_destination_device_object():
    y = comm.gather([np.ones(2)], destination=dpmini.Device("cpu:3"))
    assert dev(y) == "cpu:3"


def test_gather_dim1_and_negative_dim():
    a = np.arange(6).reshape(2, 3)
    b = np.arange(6, 12).reshape(2, 3)
    y1 = comm.gather([a, b], dim=1)
    ym1 = comm.gather([a, b], dim=-1)
    assert y1.shape == (2, 6) and ym1.shape == (2, 6)
    np.testing.assert_array_equal(ym1, y1)
    np.testing.assert_array_equal(y1, np.concatenate([a, b], axis=1))
    ym2 = comm.gather([a, b], dim=-2)
    np.testing.assert_array_equal(ym2, np.concatenate([a, b], axis=0))


def test_gather_mixed_dtypes_cast_to_first():
    a = np.array([1, 2], dtype=np.int32)
    b = np.array([3.7, -1.2], dtype=np.float64)
    y = comm.gather([a, b])
    assert y.dtype == np.int32
    np.testing.assert_array_equal(y, np.array([1, 2, 3.7, -1.2]).astype(np.int32))
    y2 = comm.gather([b, a])
    assert y2.dtype == np.float64
    np.testing.assert_array_equal(y2, [3.7, -1.2, 1, 2])


def test_gather_shape_mismatch_message():
    with pytest.raises(ValueError, match=r"index 1") as info:
        comm.gather([np.zeros((2, 4)), np.zeros((2, 5))])
    msg = str(info.value)
    assert "invalid shape" in msg
    assert "5" in msg and "4" in msg


def test_gather_rank_mismatch_message():
    with pytest.raises(ValueError, match=r"index 2.*dimensions|dimensions.*index 2"):
        comm.gather([np.zeros((2, 4)), np.zeros((1, 4)), np.zeros((2, 4, 1))])


def test_gather_empty_list():
    with pytest.raises(ValueError, match="at least one"):
        comm.gather([])


def test_gather_out():
    a = np.arange(4.0).reshape(2, 2)
    b = np.arange(4.0, 6.0).reshape(1, 2)
    out = dpmini.asarray(np.zeros((3, 2)), "cpu:2")
    res = comm.gather([a, b], out=out)
    assert res is out
    np.testing.assert_array_equal(out, [[0, 1], [2, 3], [4, 5]])
    assert dev(out) == "cpu:2"


def test_gather_out_noncontiguous():
    a = np.arange(4.0).reshape(2, 2)
    big = np.zeros((2, 8))
    out = big[:, ::2]
    comm.gather([a, a], dim=1, out=out)
    np.testing.assert_array_equal(big[:, ::2], np.concatenate([a, a], axis=1))
    np.testing.assert_array_equal(big[:, 1::2], 0)


def test_gather_out_wrong_shape():
    with pytest.raises(ValueError, match=r"out"):
        comm.gather([np.zeros((2, 2)), np.zeros((1, 2))], out=np.zeros((4, 2)))


def test_gather_out_and_destination_together():
    with pytest.raises(ValueError, match=r"out|destination"):
        comm.gather([np.zeros((2, 2))], out=np.zeros((2, 2)), destination="cpu")


def test_gather_zero_length_parts():
    y = comm.gather([np.zeros((0, 3)), np.ones((2, 3)), np.zeros((0, 3))])
    assert y.shape == (2, 3)
    np.testing.assert_array_equal(y, 1)


# ------------------------------------------------------------------- broadcast

def test_broadcast_from_host(dev3):
    x = np.arange(6.0).reshape(2, 3)
    res = comm.broadcast(x, dev3)
    assert isinstance(res, tuple) and len(res) == 3
    assert [dev(r) for r in res] == dev3
    for r in res:
        np.testing.assert_array_equal(r, x)
        assert r.dtype == x.dtype
        assert not np.shares_memory(r, x)


def test_broadcast_own_device_entry_is_the_array_itself():
    xd = dpmini.asarray(np.arange(5), "cpu:1")
    res = comm.broadcast(xd, ["cpu:0", "cpu:1", "cpu:2"])
    assert res[1] is xd
    assert res[0] is not xd and res[2] is not xd
    assert not np.shares_memory(res[0], xd)
    for r in res:
        np.testing.assert_array_equal(r, np.arange(5))


def test_broadcast_noncontiguous_source(dev2):
    x = np.arange(12).reshape(3, 4).T[::-1]
    res = comm.broadcast(x, dev2)
    for r in res:
        np.testing.assert_array_equal(r, x)


def test_broadcast_coalesced_structure_and_values():
    arrays = [np.arange(6.0).reshape(2, 3), np.arange(4, dtype=np.int32),
              np.ones((3,), dtype=np.float16), np.arange(5.0)[::-1]]
    devices = ["cpu:0", "cpu:1", "cpu:2"]
    res = comm.broadcast_coalesced(arrays, devices)
    assert isinstance(res, list) and len(res) == 3
    for d, per in zip(devices, res):
        assert isinstance(per, list) and len(per) == len(arrays)
        for a, r in zip(arrays, per):
            assert r.dtype == a.dtype and r.shape == a.shape
            np.testing.assert_array_equal(r, a)
            assert dev(r) == d


def test_broadcast_coalesced_first_list_is_inputs_on_devices0():
    arrays = [dpmini.asarray(np.arange(3.0), "cpu:0"), dpmini.asarray(np.arange(4), "cpu:0")]
    res = comm.broadcast_coalesced(arrays, ["cpu:0", "cpu:1"])
    assert res[0][0] is arrays[0] and res[0][1] is arrays[1]
    assert not np.shares_memory(res[1][0], arrays[0])


@pytest.mark.parametrize("buffer_size", [1, 8, 24, 10485760])
def test_broadcast_coalesced_buffer_sizes(buffer_size):
    arrays = [np.full((i + 1,), i, dtype=np.float32 if i % 2 else np.int64) for i in range(7)]
    res = comm.broadcast_coalesced(arrays, ["cpu:1", "cpu:0"], buffer_size=buffer_size)
    for per in res:
        for a, r in zip(arrays, per):
            assert r.dtype == a.dtype
            np.testing.assert_array_equal(r, a)


def test_broadcast_coalesced_copies_have_own_storage():
    arrays = [np.zeros(4), np.zeros(4)]
    res = comm.broadcast_coalesced(arrays, ["cpu:0", "cpu:1"])
    res[1][0][:] = 1
    np.testing.assert_array_equal(res[1][1], 0)
    np.testing.assert_array_equal(res[0][0], 0)
    np.testing.assert_array_equal(arrays[0], 0)


# ------------------------------------------------------------------ reduce_add

def test_reduce_add_sums_on_first_device():
    parts = [dpmini.asarray(np.full((2, 3), i + 1.0), f"cpu:{i}") for i in range(3)]
    y = comm.reduce_add(parts)
    np.testing.assert_array_equal(y, np.full((2, 3), 6.0))
    assert dev(y) == "cpu:0"
    # inputs untouched
    for i, p in enumerate(parts):
        np.testing.assert_array_equal(p, i + 1.0)


def test_reduce_add_destination():
    parts = [dpmini.asarray(np.arange(4), "cpu:0"), dpmini.asarray(np.arange(4), "cpu:1")]
    y = comm.reduce_add(parts, destination="cpu:1")
    assert dev(y) == "cpu:1"
    np.testing.assert_array_equal(y, 2 * np.arange(4))
    assert y.dtype == parts[0].dtype


def test_reduce_add_noncontiguous_inputs():
    a = np.arange(12.0).reshape(3, 4).T
    b = np.arange(12.0, 24.0).reshape(4, 3)[::-1]
    y = comm.reduce_add([a, b])
    np.testing.assert_array_equal(y, a + b)


def test_reduce_add_single_input_is_returned():
    a = dpmini.asarray(np.arange(3.0), "cpu:2")
    assert comm.reduce_add([a]) is a


def test_reduce_add_shape_mismatch():
    with pytest.raises(ValueError, match=r"input 1 has invalid size|1"):
        comm.reduce_add([np.zeros((2, 3)), np.zeros((3, 2))])


def test_reduce_add_coalesced():
    per_device = [
        [dpmini.asarray(np.full(3, d + 1.0), f"cpu:{d}"), dpmini.asarray(np.full((2, 2), 10 * (d + 1), np.int32), f"cpu:{d}")]
        for d in range(3)
    ]
    res = comm.reduce_add_coalesced(per_device)
    assert isinstance(res, tuple) and len(res) == 2
    np.testing.assert_array_equal(res[0], np.full(3, 6.0))
    np.testing.assert_array_equal(res[1], np.full((2, 2), 60))
    assert res[1].dtype == np.int32
    assert dev(res[0]) == "cpu:0" and dev(res[1]) == "cpu:0"


@pytest.mark.parametrize("buffer_size", [1, 16, 10485760])
def test_reduce_add_coalesced_destination_and_order(buffer_size):
    shapes = [(3,), (2, 2), (1,), (5,)]
    per_device = [[dpmini.asarray(np.full(s, (d + 1) * (j + 1), dtype=np.float64), f"cpu:{d}")
                   for j, s in enumerate(shapes)] for d in range(2)]
    res = comm.reduce_add_coalesced(per_device, destination="cpu:1", buffer_size=buffer_size)
    assert [r.shape for r in res] == shapes
    for j, r in enumerate(res):
        np.testing.assert_array_equal(r, 3 * (j + 1))
        assert dev(r) == "cpu:1"


# -------------------------------------------- large arrays (worker-thread copy path)

@pytest.mark.parametrize(
    "make,dim",
    [
        (lambda x: x, 0),
        (lambda x: x, 1),
        (lambda x: x[::-1, ::2], 0),
        (lambda x: x.T, 0),
        (lambda x: np.asfortranarray(x), 1),
        (lambda x: x[:, ::-3], -1),
    ],
    ids=["contig-d0", "contig-d1", "reversed-step", "transposed", "fortran-d1", "neg-step-dlast"],
)
def test_large_scatter_gather_round_trip(make, dim):
    base = np.random.default_rng(1).standard_normal((1200, 1500))  # ~14 MB
    x = make(base)
    devices = ["cpu:0", "cpu:1", "cpu:2", "cpu:3", "cpu:4"]
    chunks = comm.scatter(x, devices, dim=dim)
    n = x.shape[dim]
    split = -(-n // 5)
    for i, c in enumerate(chunks):
        assert dev(c) == devices[i]
        np.testing.assert_array_equal(c, np.take(x, range(i * split, min(n, (i + 1) * split)), axis=dim))
    y = comm.gather(chunks, dim=dim, destination="cpu:2")
    assert bits(y) == bits(x)


def test_large_broadcast_and_reduce_add():
    x = np.random.default_rng(2).standard_normal((1000, 1000))
    copies = comm.broadcast(x, ["cpu:0", "cpu:1", "cpu:2"])
    for c in copies:
        assert bits(c) == bits(x)
    s = comm.reduce_add(list(copies), destination="cpu:1")
    np.testing.assert_array_equal(s, (x + x) + x)
    per = comm.broadcast_coalesced([x, x[:10].astype(np.float32)], ["cpu:0", "cpu:1"], buffer_size=1 << 16)
    assert bits(per[1][0]) == bits(x) and bits(per[1][1]) == bits(x[:10].astype(np.float32))


def test_large_dataparallel_round_trip():
    x = np.random.default_rng(3).standard_normal((999, 2000))
    out = dpmini.DataParallel(lambda a: a * 1.0, device_ids=["cpu:0", "cpu:1", "cpu:2", "cpu:3"])(x)
    assert bits(out) == bits(x)


def test_gather_to_device_equals_gather_to_host_then_copy():
    rng = np.random.default_rng(28)
    parts = [dpmini.asarray(rng.standard_normal((int(rng.integers(1, 300)), 257)), f"cpu:{i}") for i in range(4)]
    host = comm.gather(parts, destination="cpu")
    for target in ["cpu:0", "cpu:1", "cpu:3", "cpu:9"]:
        on_dev = comm.gather(parts, destination=target)
        assert dev(on_dev) == target
        assert bits(on_dev) == bits(host)
        assert bits(dpmini.asarray(host, target)) == bits(on_dev)


def test_comm_signatures_are_torch_cuda_comms():
    """docs/spec.md 8.1, 8.5, 8.6: out is keyword-only; scatter takes streams as its
    5th positional (accepted, one per device; dpmini's copies are finished on
    return)."""
    import inspect
    x = np.arange(12.0).reshape(6, 2)
    devs = ["cpu:0", "cpu:1"]
    params = inspect.signature(comm.scatter).parameters
    assert list(params) == ["array", "devices", "chunk_sizes", "dim", "streams", "out"]
    assert params["out"].kind is inspect.Parameter.KEYWORD_ONLY
    for fn in (comm.gather, comm.broadcast):
        assert inspect.signature(fn).parameters["out"].kind is inspect.Parameter.KEYWORD_ONLY
    a, b = comm.scatter(x, devs, None, 0, [None, None])
    np.testing.assert_array_equal(np.concatenate([a, b]), x)
    with pytest.raises(ValueError, match="streams: expected None or one stream per device"):
        comm.scatter(x, devs, None, 0, [None])
    with pytest.raises(TypeError):
        comm.gather([a, b], 0, None, np.empty_like(x))      # out only by keyword
    np.testing.assert_array_equal(comm.gather([a, b], 0, out=np.empty_like(x)), x)
