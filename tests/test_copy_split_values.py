"""Copies between host and virtual CPU devices are split by cores, not by
device (csrc/engine: group_cpu in copy_jobs.c, the feed also in copy_jobs.c): a
broadcast's copies of one array run on the same worker, scatter and gather
jobs are cut into as many groups as the machine has cores (a job straddling
a cut is split by rows), and a broadcast of many arrays is fed to one
consumer per core while the rest is still being set up. Whatever the split,
every value must land where a plain copy (np.copy, np.split,
np.concatenate) puts it, with the same dtype, shape and layout rule.
"""
import numpy as np
import pytest

import dpmini
from dpmini import comm

DEVICE_LISTS = [
    ["cpu:0", "cpu:1"],
    ["cpu:0", "cpu:1", "cpu:2"],
    ["cpu:0", "cpu:1", "cpu:2", "cpu:3"],
    ["cpu:3", "cpu:1", "cpu:2", "cpu:0", "cpu:1"],   # a repeated device
    ["cpu:2", "cpu:0", "cpu:1"],   # the sources' own device first (see below)
]


def odd_arrays(n, seed):
    """n arrays of odd sizes (1 .. ~50,000 elements), mixed dtypes and
    layouts, a 0-d and an empty one among them: about 8 MiB in all."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        size = int(rng.integers(1, 50_001))
        kind = i % 7
        if kind == 0:
            a = rng.standard_normal(size).astype(np.float32)
        elif kind == 1:
            a = rng.integers(-100, 100, size).astype(np.int8)
        elif kind == 2:
            a = rng.standard_normal((size % 97 + 1, 33)).T            # Fortran order
        elif kind == 3:
            a = rng.standard_normal((size % 61 + 2, 130))[::2, 1::3]  # strided
        elif kind == 4:
            a = (rng.standard_normal(size) + 1j).astype(np.complex64)
        elif kind == 5:
            a = np.array([f"s{j}" for j in range(size % 500 + 1)], dtype="S7")  # itemsize 7
        else:
            a = rng.integers(0, 2, size).astype(bool)
        out.append(a)
    out.insert(5, np.array(3.5))
    out.insert(11, np.empty((0, 4), np.float32))
    return out


def assert_copy_of(b, a, device):
    assert dpmini.device_of(b) == dpmini.Device(device)
    assert b.dtype == a.dtype and b.shape == a.shape
    np.testing.assert_array_equal(b, np.copy(a))


@pytest.mark.parametrize("devs", DEVICE_LISTS, ids=lambda d: ",".join(d))
def test_broadcast_coalesced_of_many_odd_arrays_matches_np_copy(devs):
    arrays = odd_arrays(400, seed=len(devs))
    if devs[0] == "cpu:2":   # sources on a virtual device: its row is the sources
        arrays = list(comm.broadcast_coalesced(arrays, ["cpu:2"])[0])
    before = [np.copy(a) for a in arrays]
    rows = comm.broadcast_coalesced(arrays, devs)
    assert len(rows) == len(devs)
    for d, row in zip(devs, rows):
        assert len(row) == len(arrays)
        for a, b in zip(arrays, row):
            assert_copy_of(b, a, d)
            assert (b is a) == (d == "cpu:2" == devs[0])
            if b is not a:
                assert not np.shares_memory(a, b)
    for a, b in zip(arrays, before):   # the sources are untouched
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("ndev", [3, 4])
def test_broadcast_coalesced_of_a_few_large_arrays_matches_np_copy(ndev):
    # jobs of many MiB each: the consumers claim whole jobs, one after another
    rng = np.random.default_rng(ndev)
    arrays = [rng.standard_normal(3_000_001).astype(np.float32),
              rng.integers(0, 255, (1001, 4099)).astype(np.uint8),
              rng.standard_normal((2049, 1025))[:, ::2]]
    devs = [f"cpu:{i}" for i in range(ndev)]
    for d, row in zip(devs, comm.broadcast_coalesced(arrays, devs)):
        for a, b in zip(arrays, row):
            assert_copy_of(b, a, d)


class Params:
    def __init__(self, arrays):
        self.params = arrays
        self.inner = {"w": arrays[3], "again": arrays[3]}

    def __call__(self, x):
        return x


@pytest.mark.parametrize("ndev", [2, 3, 4])
def test_replicate_of_many_odd_parameters_matches_np_copy(ndev):
    m = Params(odd_arrays(300, seed=10 + ndev))
    devs = [f"cpu:{i}" for i in range(ndev)]
    reps = dpmini.replicate(m, devs)
    for d, r in zip(devs, reps):
        assert r.params is not m.params
        for a, b in zip(m.params, r.params):
            assert_copy_of(b, a, d)
        assert r.inner["w"] is r.inner["again"] is r.params[3]


SHAPES = [(1001, 777), (3, 100_003), (257, 3, 1025), (4096, 129)]


@pytest.mark.parametrize("devs", DEVICE_LISTS, ids=lambda d: ",".join(d))
@pytest.mark.parametrize("dim", [0, 1, -1])
@pytest.mark.parametrize("shape", SHAPES)
def test_scatter_gather_on_any_device_count_matches_numpy(devs, dim, shape):
    rng = np.random.default_rng(sum(shape))
    x = rng.standard_normal(shape).astype(np.float32)
    if shape[dim] < len(devs):
        pytest.skip("fewer elements along dim than devices")
    parts = comm.scatter(x, devs, dim=dim)
    bounds = np.cumsum([p.shape[dim] for p in parts])[:-1]
    for d, p, want in zip(devs, parts, np.split(x, bounds, axis=dim)):
        assert_copy_of(p, want, d)
    y = comm.gather(parts, dim=dim, destination="cpu")
    np.testing.assert_array_equal(y, x)


@pytest.mark.parametrize("ndev", [3, 4, 5])
def test_scatter_gather_of_strided_input_with_uneven_chunks_matches_numpy(ndev):
    rng = np.random.default_rng(ndev)
    base = rng.integers(-2**31, 2**31, (2003, 1501), dtype=np.int64)
    x = base[1:, ::3]                       # not contiguous: runs of one element
    devs = [f"cpu:{i}" for i in range(ndev)]
    sizes = [1] + [(x.shape[1] - 1) // (ndev - 1)] * (ndev - 2)
    sizes.append(x.shape[1] - sum(sizes))
    parts = comm.scatter(x, devs, chunk_sizes=sizes, dim=1)
    for p, want in zip(parts, np.split(x, np.cumsum(sizes)[:-1], axis=1)):
        np.testing.assert_array_equal(p, want)
    out = np.full((x.shape[0], x.shape[1]), -1, dtype=np.int64)
    assert comm.gather(parts, dim=1, out=out) is out
    np.testing.assert_array_equal(out, x)


@pytest.mark.parametrize("ndev", [3, 4])
def test_broadcast_of_one_large_array_matches_np_copy(ndev):
    # ndev jobs on fewer cores: the middle job is split by rows (and a 1-d
    # job by elements, 7-byte elements included)
    devs = [f"cpu:{i}" for i in range(ndev)]
    for x in (np.random.default_rng(0).standard_normal((1001, 777)).astype(np.float32),
              np.frombuffer(np.random.default_rng(1).bytes(7 * 300_007), dtype="S7"),
              np.arange(1_000_003, dtype=np.float64)[::-1]):
        for d, b in zip(devs, comm.broadcast(x, devs)):
            assert_copy_of(b, x, d)
