"""Broadcast and replicate of many arrays onto virtual CPU devices: the copy
engine starts copying in slices (of 4 MiB per device) while it still sets up
the rest (csrc/engine: jobs_launch). Values, layouts and dtypes must come out
as with one copy at the end, and a failure part-way (an allocation failing
after some slices have started) must raise MemoryError, wait for the started
copies, and leave no device memory or references behind.
"""
import gc
import sys

import numpy as np
import pytest

import dpmini
from dpmini import _testing, comm

D2 = ["cpu:0", "cpu:1"]
D3 = ["cpu:1", "cpu:2", "cpu:3"]
ALL = ["cpu"] + [f"cpu:{i}" for i in range(4)]


@pytest.fixture(autouse=True)
def hook_off():
    _testing.fail_alloc_after(-1)
    yield
    _testing.fail_alloc_after(-1)


def many_arrays(n=300, seed=0):
    """n arrays of 32-64 KiB (about 14 MiB), mixed dtypes and layouts, so a
    broadcast to 2 or 3 devices crosses several slices."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        kind = i % 5
        if kind == 0:
            a = rng.standard_normal(8192).astype(np.float32)
        elif kind == 1:
            a = rng.integers(-1000, 1000, (64, 128)).astype(np.int64)
        elif kind == 2:
            a = rng.standard_normal((128, 96)).T          # Fortran order: kept
        elif kind == 3:
            a = rng.standard_normal((256, 64))[::2, 1:]   # strided: made contiguous
        else:
            a = np.full((4096,), i, dtype=np.float64)
        out.append(a)
    return out


def device_bytes():
    return [dpmini.memory_allocated(d) for d in ALL]


@pytest.mark.parametrize("devs", [D2, D3])
def test_broadcast_coalesced_of_many_arrays_copies_every_value(devs):
    arrays = many_arrays()
    res = comm.broadcast_coalesced(arrays, devs)
    assert len(res) == len(devs)
    for d, row in zip(devs, res):
        assert len(row) == len(arrays)
        for a, b in zip(arrays, row):
            assert dpmini.device_of(b) == dpmini.Device(d)
            assert b.dtype == a.dtype and b.shape == a.shape
            np.testing.assert_array_equal(b, a)
        assert row[2].flags.f_contiguous and not row[2].flags.c_contiguous
        assert row[3].flags.c_contiguous


class Params:
    def __init__(self, arrays):
        self.params = arrays

    def __call__(self, x):
        return x


def test_replicate_of_a_module_with_many_parameters_copies_every_value():
    m = Params(many_arrays(seed=1))
    reps = dpmini.replicate(m, D3)
    for d, r in zip(D3, reps):
        assert r is not m and r.params is not m.params
        for a, b in zip(m.params, r.params):
            assert dpmini.device_of(b) == dpmini.Device(d)
            np.testing.assert_array_equal(b, a)


def test_allocation_failure_part_way_through_the_slices_leaks_nothing():
    arrays = many_arrays(n=200, seed=2)
    expect = [a.copy() for a in arrays]

    def check(res):
        for row in res:
            for a, b in zip(expect, row):
                np.testing.assert_array_equal(b, a)

    check(comm.broadcast_coalesced(arrays, D2))
    gc.collect()
    base = device_bytes()
    refs = [sys.getrefcount(a) for a in arrays]
    # 400 allocations in all (200 arrays x 2 devices); fail early, in the
    # middle (slices started) and near the end.
    for n in (0, 1, 150, 255, 256, 300, 399):
        _testing.fail_alloc_after(n)
        with pytest.raises(MemoryError, match="cannot allocate"):
            comm.broadcast_coalesced(arrays, D2)
        assert _testing.fail_alloc_after(-1) == -1
        gc.collect()
        assert device_bytes() == base, f"allocation {n}: device memory leaked"
        assert [sys.getrefcount(a) for a in arrays] == refs
        check(comm.broadcast_coalesced(arrays, D2))
        check([arrays])   # the sources are untouched
