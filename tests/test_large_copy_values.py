"""Copies large enough for streaming stores (csrc/copy.c: a thread writing
4 MiB or more in runs of 256 bytes or more) give exactly the input back:
scatter + gather along dims 0, 1 and -1 with odd, unaligned run lengths and
offsets, and a replicate of many small parameters."""
import numpy as np
import pytest

import dpmini

DEVS = ["cpu:0", "cpu:1"]


@pytest.mark.parametrize("dim", [0, 1, -1])
@pytest.mark.parametrize("cols", [8192, 8191])
def test_scatter_gather_round_trip_of_a_large_array(dim, cols):
    x = np.random.default_rng(cols + dim).standard_normal((700, cols)).astype(np.float32)
    parts = dpmini.comm.scatter(x, DEVS, dim=dim)
    np.testing.assert_array_equal(np.concatenate(parts, axis=dim), x)
    np.testing.assert_array_equal(dpmini.comm.gather(parts, dim=dim, destination="cpu"), x)


def test_unaligned_byte_view_round_trip():
    base = np.random.default_rng(1).integers(0, 256, size=(2050, 4099), dtype=np.uint8)
    x = base[1:, 3:]   # rows start at odd addresses, runs of 4096 / 2048 bytes
    for dim in (0, 1):
        parts = dpmini.comm.scatter(x, DEVS, dim=dim)
        np.testing.assert_array_equal(dpmini.comm.gather(parts, dim=dim, destination="cpu"), x)


class Params:
    def __init__(self, arrays):
        self.params = arrays

    def __call__(self, x):
        return x


def test_replicate_of_many_parameters_copies_every_byte():
    rng = np.random.default_rng(2)
    arrays = [rng.standard_normal(8191 - i % 7).astype(np.float32) for i in range(300)]
    reps = dpmini.replicate(Params(arrays), DEVS)
    for rep in reps:
        assert len(rep.params) == len(arrays)
        for got, want in zip(rep.params, arrays):
            np.testing.assert_array_equal(got, want)
    out = dpmini.comm.broadcast_coalesced(arrays, DEVS)
    for row in out:
        for got, want in zip(row, arrays):
            np.testing.assert_array_equal(got, want)
