"""Property tests: gather(scatter(x)) is bit-identical to x for random shapes,
dtypes, dims, device counts, explicit chunk sizes and non-contiguous views;
chunk shapes follow torch.chunk's rule (computed here from ceil(n/k))."""
import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import dpmini
from dpmini import comm

DTYPES = ["?", "i1", "i2", "i4", "i8", "u1", "u2", "u4", "u8", "f2", "f4", "f8", "c8", "c16",
          ">i4", ">f8", [("a", "<i2"), ("b", "<f4")]]

SETTINGS = settings(max_examples=200, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


def chunk_rule(n, k):
    if n == 0:
        return [0] * k
    split = -(-n // k)
    count = -(-n // split)
    return [split] * (count - 1) + [n - split * (count - 1)]


@st.composite
def arrays(draw):
    """A random array, possibly a non-contiguous view (transpose, steps, negative steps)."""
    ndim = draw(st.integers(1, 4))
    shape = draw(st.lists(st.integers(0, 9), min_size=ndim, max_size=ndim))
    dtype = np.dtype(draw(st.sampled_from(DTYPES)))
    # a bigger base so step slices still leave up to `shape` elements
    steps = draw(st.lists(st.sampled_from([1, 1, 2, 3, -1, -2]), min_size=ndim, max_size=ndim))
    base_shape = [max(1, s * abs(t)) for s, t in zip(shape, steps)]
    nbytes = int(np.prod(base_shape)) * dtype.itemsize
    raw = draw(st.binary(min_size=nbytes, max_size=nbytes))
    base = np.frombuffer(raw, dtype=np.uint8).copy()
    if dtype == np.bool_:
        base &= 1
    base = base.view(dtype).reshape(base_shape)
    view = base[tuple(slice(None, s * abs(t), t) if t > 0 else slice(s * abs(t) - 1 if s else 0, None, t)
                      for s, t in zip(shape, steps))]
    view = view[tuple(slice(0, s) for s in shape)]
    if draw(st.booleans()):
        perm = draw(st.permutations(range(ndim)))
        view = view.transpose(perm)
    if draw(st.booleans()):
        view = np.asfortranarray(view)
    return view


@st.composite
def cases(draw):
    x = draw(arrays())
    dim = draw(st.integers(-x.ndim, x.ndim - 1))
    k = draw(st.integers(1, 6))
    pool = [f"cpu:{i}" for i in range(8)]
    devices = draw(st.lists(st.sampled_from(pool), min_size=k, max_size=k))
    sizes = None
    if draw(st.booleans()):
        n = x.shape[dim]
        cuts = sorted(draw(st.lists(st.integers(0, n), min_size=k - 1, max_size=k - 1)))
        edges = [0] + cuts + [n]
        sizes = [edges[i + 1] - edges[i] for i in range(k)]
    return x, dim, devices, sizes


def bits(a):
    return np.ascontiguousarray(a).tobytes()


@SETTINGS
@given(cases())
def test_scatter_gather_round_trip(case):
    x, dim, devices, sizes = case
    k = len(devices)
    wdim = dim % x.ndim
    n = x.shape[wdim]
    chunks = comm.scatter(x, devices, chunk_sizes=sizes, dim=dim)
    expected_sizes = sizes if sizes is not None else chunk_rule(n, k)
    assert [c.shape[wdim] for c in chunks] == expected_sizes
    for c in chunks:
        assert c.dtype == x.dtype
        assert c.shape[:wdim] == x.shape[:wdim] and c.shape[wdim + 1:] == x.shape[wdim + 1:]
    assert [str(dpmini.device_of(c)) for c in chunks] == devices[: len(chunks)]
    # each chunk holds the logical rows it should
    start = 0
    for c, s in zip(chunks, expected_sizes):
        want = np.take(x, np.arange(start, start + s), axis=wdim)
        assert bits(c) == bits(want)
        start += s
    # gather back, to the host and to a virtual device
    y = comm.gather(chunks, dim=dim)
    assert y.shape == x.shape and y.dtype == x.dtype
    assert bits(y) == bits(x)
    assert str(dpmini.device_of(y)) == "cpu"
    z = comm.gather(chunks, dim=dim, destination=devices[-1])
    assert bits(z) == bits(x)
    assert str(dpmini.device_of(z)) == devices[-1]


@SETTINGS
@given(cases())
def test_structure_round_trip(case):
    x, dim, devices, _ = case
    y = np.ascontiguousarray(x)[..., ::-1]  # same shape, so the same chunk count
    k_x = len(chunk_rule(x.shape[dim % x.ndim], len(devices)))
    parts = dpmini.scatter({"x": x, "pair": (y, "tag")}, devices, dim=dim)
    assert len(parts) == k_x
    assert all(p["pair"][1] == "tag" for p in parts)
    g = dpmini.gather(parts, "cpu", dim=dim)
    assert list(g) == ["x", "pair"]
    assert bits(g["x"]) == bits(x) and g["x"].dtype == x.dtype
    assert bits(g["pair"][0]) == bits(y)
    assert g["pair"][1] == "tag"


@SETTINGS
@given(st.integers(0, 300), st.integers(1, 16))
def test_chunk_counts(n, k):
    chunks = comm.scatter(np.zeros(n, dtype=np.uint8), [f"cpu:{i}" for i in range(k)])
    sizes = [c.shape[0] for c in chunks]
    assert sizes == chunk_rule(n, k)
    assert sum(sizes) == n
    assert 1 <= len(sizes) <= k
    if n:
        split = -(-n // k)
        assert all(s == split for s in sizes[:-1]) and 0 < sizes[-1] <= split
    else:
        assert len(sizes) == k
