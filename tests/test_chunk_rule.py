"""The chunk rule (docs/spec.md 0, 9.1), observed through dpmini.comm.scatter.

The oracle is torch.chunk: split = ceil(n/k), pieces of `split` rows with a
shorter last one; n == 0 gives k empty pieces. It is NOT np.array_split.
"""
import numpy as np
import pytest

import dpmini
from dpmini import comm

from conftest import cpu_devices, torch_chunk_sizes


def scatter_sizes(n, k, dim=0, **kw):
    shape = [3, 3]
    shape[dim] = n
    x = np.arange(int(np.prod(shape)), dtype=np.int64).reshape(shape)
    chunks = comm.scatter(x, cpu_devices(k), dim=dim, **kw)
    return [c.shape[dim] for c in chunks], chunks, x


# docs/spec.md 0.3, every worked example (k, n, expected sizes)
SPEC_0_3 = [
    (2, 0, [0, 0]), (2, 1, [1]), (2, 2, [1, 1]), (2, 3, [2, 1]), (2, 5, [3, 2]), (2, 7, [4, 3]),
    (3, 4, [2, 2]), (3, 5, [2, 2, 1]), (3, 7, [3, 3, 1]), (3, 10, [4, 4, 2]),
    (4, 1, [1]), (4, 2, [1, 1]), (4, 3, [1, 1, 1]), (4, 5, [2, 2, 1]), (4, 6, [2, 2, 2]),
    (4, 7, [2, 2, 2, 1]), (4, 9, [3, 3, 3]), (4, 10, [3, 3, 3, 1]), (4, 12, [3, 3, 3, 3]),
    (7, 36, [6, 6, 6, 6, 6, 6]), (8, 9, [2, 2, 2, 2, 1]), (8, 17, [3, 3, 3, 3, 3, 2]),
]


@pytest.mark.parametrize("k,n,expected", SPEC_0_3)
def test_spec_0_3_worked_table(k, n, expected):
    sizes, chunks, x = scatter_sizes(n, k)
    assert sizes == expected
    assert isinstance(chunks, tuple)
    # chunk i lives on devices[i]
    assert [str(dpmini.device_of(c)) for c in chunks] == cpu_devices(k)[: len(expected)]
    # the pieces are consecutive rows, in order
    np.testing.assert_array_equal(np.concatenate(chunks, axis=0), x)


@pytest.mark.parametrize("k,n,expected", SPEC_0_3)
def test_spec_0_3_worked_table_dim1(k, n, expected):
    sizes, chunks, x = scatter_sizes(n, k, dim=1)
    assert sizes == expected
    for c in chunks:
        assert c.shape[0] == 3
    np.testing.assert_array_equal(np.concatenate(chunks, axis=1), x)


def test_oracle_matches_spec_table():
    for k, n, expected in SPEC_0_3:
        assert torch_chunk_sizes(n, k) == expected


def test_spec_0_3_example_shape_5x3_on_4_devices(dev4):
    x = np.arange(15.0).reshape(5, 3)
    chunks = comm.scatter(x, dev4)
    assert [c.shape for c in chunks] == [(2, 3), (2, 3), (1, 3)]
    assert [str(dpmini.device_of(c)) for c in chunks] == ["cpu:0", "cpu:1", "cpu:2"]
    np.testing.assert_array_equal(chunks[0], x[0:2])
    np.testing.assert_array_equal(chunks[1], x[2:4])
    np.testing.assert_array_equal(chunks[2], x[4:5])


def test_spec_0_4_device_order_is_list_order():
    x = np.arange(8).reshape(4, 2)
    chunks = comm.scatter(x, ["cpu:1", "cpu:0"])
    assert [str(dpmini.device_of(c)) for c in chunks] == ["cpu:1", "cpu:0"]
    np.testing.assert_array_equal(chunks[0], x[0:2])  # rows 0..split-1 on cpu:1
    np.testing.assert_array_equal(chunks[1], x[2:4])


# Golden table (docs/spec.md 0.3), n = 8 devices, B = 0..127, generated from the ceil rule.
QUOTED_ROWS = {
    9: [2, 2, 2, 2, 1],
    17: [3, 3, 3, 3, 3, 2],
    25: [4, 4, 4, 4, 4, 4, 1],
    33: [5, 5, 5, 5, 5, 5, 3],
    41: [6, 6, 6, 6, 6, 6, 5],
    0: [0] * 8,
}


def test_oracle_matches_quoted_rows():
    for b, row in QUOTED_ROWS.items():
        assert torch_chunk_sizes(b, 8) == row


@pytest.mark.parametrize("b", range(128))
def test_golden_table_8_devices(b, dev8):
    x = np.arange(b, dtype=np.float32)
    chunks = comm.scatter(x, dev8)
    sizes = [c.shape[0] for c in chunks]
    assert sizes == torch_chunk_sizes(b, 8)
    if b in QUOTED_ROWS:
        assert sizes == QUOTED_ROWS[b]
    assert [str(dpmini.device_of(c)) for c in chunks] == dev8[: len(sizes)]
    np.testing.assert_array_equal(np.concatenate(chunks), x)


def test_empty_batch_gives_n_empty_pieces(dev8):
    x = np.zeros((0, 5), dtype=np.float64)
    chunks = comm.scatter(x, dev8)
    assert len(chunks) == 8
    assert all(c.shape == (0, 5) for c in chunks)
    assert all(c.dtype == np.float64 for c in chunks)
    assert [str(dpmini.device_of(c)) for c in chunks] == dev8


def test_empty_batch_through_dataparallel(dev8):
    calls = []

    def module(x):
        calls.append(str(dpmini.device_of(x)))
        return x * 2

    out = dpmini.DataParallel(module, device_ids=dev8)(np.zeros((0, 4)))
    assert sorted(calls) == sorted(dev8)  # n replicas on empty inputs
    assert out.shape == (0, 4)
    assert str(dpmini.device_of(out)) == "cpu:0"


@pytest.mark.parametrize(
    "b,expected,not_expected",
    [
        (10, [3, 3, 3, 1], [3, 3, 2, 2]),
        (9, [3, 3, 3], [3, 2, 2, 2]),
        (4, [1, 1, 1, 1], None),
        (13, [4, 4, 4, 1], [4, 3, 3, 3]),
        (1, [1], None),
    ],
)
def test_uneven_split_is_ceil_not_array_split(b, expected, not_expected, dev4):
    x = np.arange(b * 6).reshape(b, 2, 3)
    chunks = comm.scatter(x, dev4)
    sizes = [c.shape[0] for c in chunks]
    assert sizes == expected
    if not_expected is not None:
        assert sizes != not_expected
        assert sizes != [len(a) for a in np.array_split(np.arange(b), 4)]
    assert [str(dpmini.device_of(c)) for c in chunks] == dev4[: len(expected)]


@pytest.mark.parametrize("b,replicas", [(10, 4), (9, 3), (4, 4)])
def test_round_trip_and_idle_devices(b, replicas, dev4):
    seen = []

    def identity(x):
        seen.append((str(dpmini.device_of(x)), x.shape[0]))
        return x

    x = np.arange(b * 6, dtype=np.float64).reshape(b, 2, 3)
    out = dpmini.DataParallel(identity, device_ids=dev4)(x)
    assert sorted(seen) == [(d, s) for d, s in zip(dev4, torch_chunk_sizes(b, 4))]
    assert len(seen) == replicas
    if b == 9:
        assert "cpu:3" not in [d for d, _ in seen]  # device_ids[3] gets no replica
    np.testing.assert_array_equal(out, x)
    assert str(dpmini.device_of(out)) == "cpu:0"


def test_nine_on_four_makes_no_copy_on_idle_device(dev4):
    x = np.ones((9, 1000), dtype=np.float64)
    before = dpmini.memory_allocated("cpu:3")
    chunks = comm.scatter(x, dev4)
    assert len(chunks) == 3
    assert dpmini.memory_allocated("cpu:3") == before
    assert dpmini.memory_allocated("cpu:2") >= 3 * 1000 * 8
    del chunks


@pytest.mark.parametrize(
    "b,k,expected,array_split",
    [
        (256, 6, [43, 43, 43, 43, 43, 41], [43, 43, 43, 43, 42, 42]),
        (31, 8, [4, 4, 4, 4, 4, 4, 4, 3], None),
        (38, 8, [5, 5, 5, 5, 5, 5, 5, 3], [5, 5, 5, 5, 5, 5, 4, 4]),
    ],
)
def test_torch_chunk_not_mxnet_not_array_split(b, k, expected, array_split):
    x = np.arange(b * 2, dtype=np.float32).reshape(b, 2)
    chunks = comm.scatter(x, cpu_devices(k))  # no error for non-divisible batches
    sizes = [c.shape[0] for c in chunks]
    assert sizes == expected
    if array_split is not None:
        assert [len(a) for a in np.array_split(np.arange(b), k)] == array_split
        assert sizes != array_split
    # not MXNet's even_split=False heavy last slice
    assert sizes[-1] <= sizes[0]


# explicit chunk sizes (docs/spec.md 0.7, 8.5)
@pytest.mark.parametrize(
    "sizes",
    [[2, 0, 3], [0, 0, 5], [5, 0, 0], [1, 1, 3], [0, 5, 0]],
)
def test_explicit_chunk_sizes_zero_allowed(sizes, dev3):
    x = np.arange(10).reshape(5, 2)
    chunks = comm.scatter(x, dev3, chunk_sizes=sizes)
    assert len(chunks) == 3
    assert [c.shape for c in chunks] == [(s, 2) for s in sizes]
    assert [str(dpmini.device_of(c)) for c in chunks] == dev3
    np.testing.assert_array_equal(np.concatenate(chunks), x)


def test_explicit_chunk_sizes_dim1(dev2):
    x = np.arange(12).reshape(2, 6)
    chunks = comm.scatter(x, dev2, chunk_sizes=[5, 1], dim=1)
    assert [c.shape for c in chunks] == [(2, 5), (2, 1)]
    np.testing.assert_array_equal(chunks[0], x[:, :5])
    np.testing.assert_array_equal(chunks[1], x[:, 5:])


def test_explicit_chunk_sizes_tuple_accepted(dev2):
    x = np.arange(4)
    chunks = comm.scatter(x, dev2, chunk_sizes=(3, 1))
    assert [c.shape for c in chunks] == [(3,), (1,)]


def test_explicit_chunk_sizes_negative_is_an_error(dev3):
    x = np.arange(5)
    with pytest.raises(ValueError, match="chunk_sizes"):
        comm.scatter(x, dev3, chunk_sizes=[3, -1, 3])


def test_explicit_chunk_sizes_bad_sum_is_an_error(dev3):
    x = np.arange(5)
    with pytest.raises(ValueError, match="chunk_sizes") as info:
        comm.scatter(x, dev3, chunk_sizes=[1, 1, 1])
    assert "5" in str(info.value)  # names the size along dim
    with pytest.raises(ValueError, match="chunk_sizes"):
        comm.scatter(x, dev3, chunk_sizes=[2, 2, 2])


def test_explicit_chunk_sizes_wrong_length_is_an_error(dev3):
    x = np.arange(5)
    with pytest.raises(ValueError, match="chunk_sizes"):
        comm.scatter(x, dev3, chunk_sizes=[5])
    with pytest.raises(ValueError, match="chunk_sizes"):
        comm.scatter(x, dev3, chunk_sizes=[1, 1, 1, 2])


@pytest.mark.parametrize("k", [1, 2, 3, 5, 8])
def test_n_zero_gives_k_empty_chunks(k):
    x = np.empty((3, 0, 2), dtype=np.int16)
    chunks = comm.scatter(x, cpu_devices(k), dim=1)
    assert len(chunks) == k
    assert all(c.shape == (3, 0, 2) and c.dtype == np.int16 for c in chunks)
    assert [str(dpmini.device_of(c)) for c in chunks] == cpu_devices(k)


@pytest.mark.parametrize("k", [1, 2, 3, 4, 5, 6, 7, 8, 16])
@pytest.mark.parametrize("n", [0, 1, 2, 3, 7, 15, 16, 17, 33, 100])
def test_chunk_rule_grid(n, k):
    x = np.arange(n, dtype=np.int32)
    chunks = comm.scatter(x, cpu_devices(k))
    assert [c.shape[0] for c in chunks] == torch_chunk_sizes(n, k)
    # never an empty chunk unless n == 0; never more than k
    assert len(chunks) <= k
    if n:
        assert all(c.shape[0] > 0 for c in chunks)


def test_single_device_gets_everything():
    x = np.arange(7)
    chunks = comm.scatter(x, ["cpu:3"])
    assert len(chunks) == 1
    np.testing.assert_array_equal(chunks[0], x)
    assert str(dpmini.device_of(chunks[0])) == "cpu:3"
