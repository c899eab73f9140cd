"""Copies whose simplified layout keeps many dims: a copy job stores up to 8
dims inline and the rest of a descriptor on the heap (csrc/engine/copy_jobs.c).
Strided views of 9 to 32 dims (every other element along each dim, so no two
dims merge) must scatter, gather, broadcast and replicate exactly, on the
caller's thread (small) and on the device workers (large).
"""
import numpy as np
import pytest

import dpmini
from dpmini import comm

D2 = ["cpu:0", "cpu:1"]


def strided(ndim, side=4, dtype=np.int32):
    """A view of shape (side // 2,) * ndim taking every other element along each dim."""
    base = np.arange(side ** ndim, dtype=dtype).reshape((side,) * ndim)
    return base[(slice(None, None, 2),) * ndim]


@pytest.mark.parametrize("ndim", [8, 9, 12])
def test_scatter_and_gather_of_a_view_with_many_unmergeable_dims(ndim):
    x = strided(ndim)
    parts = comm.scatter(x, D2, dim=ndim - 1)
    assert [p.shape[ndim - 1] for p in parts] == [1, 1]
    for p, want in zip(parts, np.array_split(x, 2, axis=ndim - 1)):
        np.testing.assert_array_equal(p, want)
    np.testing.assert_array_equal(comm.gather(parts, dim=ndim - 1), x)
    y = x.transpose(tuple(reversed(range(ndim))))
    np.testing.assert_array_equal(comm.gather(comm.scatter(y, D2, dim=0), dim=0), y)


def test_large_copies_with_many_dims_run_on_the_workers():
    # every other element of a (3,) * 9 + (256,) int64 array: 512 KiB in 10
    # dims that do not merge, above the 256 KiB a call copies inline
    base = np.arange(3 ** 9 * 256, dtype=np.int64).reshape((3,) * 9 + (256,))
    x = base[(slice(None, None, 2),) * 10]
    assert x.shape == (2,) * 9 + (128,) and x.nbytes == 512 * 1024
    parts = comm.scatter(x, D2, dim=9)
    np.testing.assert_array_equal(comm.gather(parts, dim=9), x)
    np.testing.assert_array_equal(comm.gather(comm.scatter(x, D2, dim=0), dim=0), x)


def test_broadcast_and_replicate_with_many_dims():
    x = strided(11)
    for a in comm.broadcast(x, D2):
        np.testing.assert_array_equal(a, x)

    class M:
        def __init__(self):
            self.w = strided(10, dtype=np.float64)

        def __call__(self, v):
            return v

    m = M()
    for r in dpmini.replicate(m, D2):
        np.testing.assert_array_equal(r.w, m.w)
