"""Broadcast of many arrays to distinct GPUs through NCCL: one NCCL group and
one wait for all of them, not one per array.

A model with hundreds of parameters paid one ncclGroupStart/End, one poll of
every rank's stream and one lock round per parameter. Now every array that
takes the NCCL path is queued in one group (NCCL takes at most 2048
operations between ncclGroupStart and ncclGroupEnd, so very long lists are
split into groups of that many rank calls) and waited for once. Runs on the
emulated NCCL (its groups now hold several collectives, matched per
communicator in call order, as NCCL matches them) and on real GPUs with NCCL.
"""
import gc

import numpy as np
import pytest

import dpmini
from dpmini import _testing
from gpu_helpers import EMULATED, cuda_debug, gpu, sample, two_gpus

pytestmark = [*gpu, two_gpus]
_d = dpmini._dpmini


@pytest.fixture
def nccl():
    if EMULATED:
        was = _testing.emulated_nccl(1)
        yield
        _testing.emulated_nccl(1 if was else 0)
    else:
        dpmini.comm.broadcast(dpmini.asarray(np.zeros(1), 0), [0, 1])  # loads NCCL if present
        if not _d.cuda_build_info()["nccl"][:1].isdigit():
            pytest.skip("NCCL did not load: " + _d.cuda_build_info()["nccl"])
        yield


def _mixed_arrays(n):
    """n arrays of several dtypes and shapes, on cuda:0 and cuda:1 (two roots),
    with a strided view and an empty array among them (those take the copy
    path)."""
    dtypes = ["float32", "int64", "float16", "uint8", "float64", "int32"]
    xs, arrs = [], []
    for i in range(n):
        x = sample((i % 7 + 1, 3), dtypes[i % len(dtypes)], seed=i)
        xs.append(x)
        arrs.append(dpmini.asarray(x, i % 2))
    w = sample((4, 6), "float32", seed=99)
    xs.append(w[:, 3:])  # a strided GPU view (a chunk along dim 1)
    arrs.append(dpmini.comm.scatter(dpmini.asarray(w, 0), [0, 0], dim=1)[1])
    xs.append(np.zeros((0, 3), "float32"))
    arrs.append(dpmini.asarray(xs[-1], 1))
    return xs, arrs


def test_broadcast_coalesced_of_many_arrays_is_one_nccl_group(nccl):
    xs, arrs = _mixed_arrays(60)
    calls = cuda_debug()["nccl_calls"]
    rows = dpmini.comm.broadcast_coalesced(arrs, [0, 1])
    assert cuda_debug()["nccl_calls"] - calls == 1  # before: one group per array (60)
    assert len(rows) == 2
    for d, row in enumerate(rows):
        assert len(row) == len(xs)
        for x, a, o in zip(xs, arrs, row):
            assert o.device == f"cuda:{d}" and o.dtype == x.dtype and o.shape == x.shape
            np.testing.assert_array_equal(o.numpy(), x)
            if a.device == f"cuda:{d}":
                assert o.data_ptr == a.data_ptr  # its own device: the array itself


def test_broadcast_order_of_roots_and_devices(nccl):
    # targets listed in another order than the arrays' homes
    xs, arrs = _mixed_arrays(9)
    rows = dpmini.comm.broadcast_coalesced(arrs, [1, 0])
    for d, row in zip([1, 0], rows):
        for x, o in zip(xs, row):
            assert o.device == f"cuda:{d}"
            np.testing.assert_array_equal(o.numpy(), x)


def test_very_long_lists_are_split_into_groups_nccl_accepts(nccl):
    # 2 ranks x 1500 arrays = 3000 rank calls: more than NCCL's 2048 a group
    xs = [np.full((2,), i, "int32") for i in range(1500)]
    arrs = [dpmini.asarray(x, 0) for x in xs]
    calls = cuda_debug()["nccl_calls"]
    rows = dpmini.comm.broadcast_coalesced(arrs, [0, 1])
    groups = cuda_debug()["nccl_calls"] - calls
    assert 2 <= groups <= 3
    got = np.stack([o.numpy() for o in rows[1]])
    np.testing.assert_array_equal(got, np.stack(xs))


@pytest.mark.skipif(not EMULATED, reason="fails a group through the emulated NCCL")
def test_a_failed_group_raises_and_leaks_nothing(nccl):
    xs, arrs = _mixed_arrays(12)
    gc.collect()
    allocated = dpmini.memory_allocated("cuda:1")
    aborted = cuda_debug()["nccl_aborted"]
    _testing.emulated_nccl(-1, 3)  # the next group fails (ncclInternalError)
    with pytest.raises(dpmini.NcclError):
        dpmini.comm.broadcast_coalesced(arrs, [0, 1])
    gc.collect()
    assert cuda_debug()["nccl_aborted"] == aborted + 1
    assert dpmini.memory_allocated("cuda:1") == allocated  # the outputs were freed
    rows = dpmini.comm.broadcast_coalesced(arrs, [0, 1])  # new communicators work
    for x, o in zip(xs, rows[1]):
        np.testing.assert_array_equal(o.numpy(), x)


def test_replicate_of_many_parameters_is_one_nccl_group(nccl):
    class Model:
        pass

    m = Model()
    m.layers = [{"w": sample((4, 3), "float32", seed=i), "b": sample((3,), "float32", seed=i)}
                for i in range(40)]
    m.layers = [{k: dpmini.asarray(v, 0) for k, v in layer.items()} for layer in m.layers]
    calls = cuda_debug()["nccl_calls"]
    r0, r1 = dpmini.replicate(m, [0, 1])
    assert cuda_debug()["nccl_calls"] - calls == 1  # before: 80
    for l0, l1 in zip(m.layers, r1.layers):
        for k in ("w", "b"):
            assert l1[k].device == "cuda:1"
            np.testing.assert_array_equal(l1[k].numpy(), l0[k].numpy())
