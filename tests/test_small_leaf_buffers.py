"""Scatter and gather of many small leaves: the small chunks of one call share
buffers per device, and small host copies run at once in the calling thread
(csrc/engine/copy_engine.c, dp_empty_slab in csrc/py/host_memory.c). These
tests check what users see: values, layouts, independence of the pieces,
devices, and memory that comes back when the last piece is freed."""
import gc
from collections import OrderedDict, namedtuple

import numpy as np
import pytest

import dpmini

DEVS = ["cpu:10", "cpu:11"]


def many_leaves(n=50, shape=(8, 4), dtype=np.float32):
    return {f"k{i}": (np.arange(np.prod(shape)) + 1000 * i).astype(dtype).reshape(shape)
            for i in range(n)}


def test_chunks_of_many_small_leaves_hold_their_rows_on_their_device():
    x = many_leaves()
    ins, kws = dpmini.scatter_kwargs((), x, DEVS)
    assert len(kws) == 2
    for j, dev in enumerate(DEVS):
        for key, arr in x.items():
            piece = kws[j][key]
            np.testing.assert_array_equal(piece, arr[4 * j:4 * j + 4])
            assert dpmini.device_of(piece) == dpmini.Device(dev)
            assert piece.flags.c_contiguous and piece.flags.writeable
            assert piece.ctypes.data % 64 == 0


def test_chunks_sharing_a_buffer_are_independent():
    x = many_leaves(20)
    _, kws = dpmini.scatter_kwargs((), x, DEVS)
    first = kws[0]
    first["k3"][...] = -1.0
    for key, arr in x.items():
        if key != "k3":
            np.testing.assert_array_equal(first[key], arr[:4])
            assert not np.shares_memory(first[key], first["k3"])
    np.testing.assert_array_equal(first["k3"], np.full((4, 4), -1.0, np.float32))
    np.testing.assert_array_equal(x["k3"][:4], np.arange(16, dtype=np.float32).reshape(4, 4)
                                  + 3000)


def test_a_kept_chunk_outlives_the_others_and_memory_comes_back():
    gc.collect()
    start = [dpmini.memory_allocated(d) for d in DEVS]
    x = many_leaves(30)
    _, kws = dpmini.scatter_kwargs((), x, DEVS)
    kept = kws[1]["k7"]
    del kws
    gc.collect()
    np.testing.assert_array_equal(kept, x["k7"][4:])
    assert dpmini.memory_allocated(DEVS[1]) > start[1]
    del kept
    gc.collect()
    assert [dpmini.memory_allocated(d) for d in DEVS] == start


@pytest.mark.parametrize("layout", ["fortran", "transposed", "strided"])
def test_small_non_contiguous_leaves_scatter_and_gather_by_value(layout):
    base = {f"a{i}": np.arange(48, dtype=np.float64).reshape(6, 8) * (i + 1) for i in range(6)}
    if layout == "fortran":
        x = {k: np.asfortranarray(v) for k, v in base.items()}
    elif layout == "transposed":
        x = {k: v.T for k, v in base.items()}
    else:
        x = {k: v[:, ::2] for k, v in base.items()}
    for dim in (0, 1, -1):
        _, kws = dpmini.scatter_kwargs((), x, DEVS, dim=dim)
        for key, arr in x.items():
            parts = np.array_split(arr, 2, axis=dim)
            for j in range(2):
                np.testing.assert_array_equal(kws[j][key], parts[j])
        out = dpmini.gather([kws[0], kws[1]], DEVS[0], dim=dim)
        for key, arr in x.items():
            np.testing.assert_array_equal(out[key], arr)
            assert dpmini.device_of(out[key]) == dpmini.Device(DEVS[0])


def test_dataparallel_on_many_small_leaves_returns_every_leaf():
    class Twice:
        def __call__(self, d):
            return {k: v * 2 for k, v in d.items()}

    dp = dpmini.DataParallel(Twice(), device_ids=DEVS)
    x = many_leaves(100)
    for _ in range(3):
        out = dp(x)
        assert list(out) == list(x)
        for key, arr in x.items():
            np.testing.assert_array_equal(out[key], arr * 2)
            assert dpmini.device_of(out[key]) == dpmini.Device(DEVS[0])
    # the gathered results are independent arrays
    out["k0"][...] = 0
    np.testing.assert_array_equal(out["k1"], x["k1"] * 2)


def test_gathered_small_results_share_buffers_and_free_them():
    gc.collect()
    start = dpmini.memory_allocated(DEVS[0])
    x = many_leaves(40, shape=(2, 3), dtype=np.int64)
    _, kws = dpmini.scatter_kwargs((), x, DEVS)
    out = dpmini.gather(list(kws), DEVS[0])
    del kws
    for key, arr in x.items():
        np.testing.assert_array_equal(out[key], arr)
    one = out["k39"]
    del out
    gc.collect()
    np.testing.assert_array_equal(one, x["k39"])
    del one
    gc.collect()
    assert dpmini.memory_allocated(DEVS[0]) == start


def test_mixed_sizes_zero_size_and_large_leaves_in_one_call():
    x = {
        "tiny": np.arange(4, dtype=np.int8).reshape(4, 1),
        "empty": np.zeros((0, 3), np.float32),
        "big": np.arange(2 * 70_000, dtype=np.float64).reshape(2, 70_000),
        "mid": np.arange(2 * 512, dtype=np.float32).reshape(2, 512),
        "bool": np.array([[True], [False], [True], [True]]),
    }
    _, kws = dpmini.scatter_kwargs((), x, DEVS)
    for key, arr in x.items():
        parts = np.array_split(arr, 2) if arr.shape[0] else [arr, arr]
        for j in range(2):
            np.testing.assert_array_equal(kws[j][key], parts[j])
            assert kws[j][key].dtype == arr.dtype
    out = dpmini.gather(list(kws), DEVS[0])
    for key, arr in x.items():
        if arr.shape[0]:
            np.testing.assert_array_equal(out[key], arr)


def test_leaf_paths_in_messages_after_sibling_containers():
    # The paths of leaves are written after the walk, from steps kept per
    # container: siblings walked one after another must keep their own.
    P = namedtuple("P", "a b")
    good = np.zeros((4, 2))
    bad = np.zeros((3, 2))
    inputs = ({"first": [good, (good, good)], "second": OrderedDict(x=good, y=P(good, bad))},)
    with pytest.warns(dpmini.SplitWarning) as rec:
        dpmini.scatter_kwargs(inputs, {"kw": [good, {"deep": bad}]}, ["cpu:0", "cpu:1", "cpu:2"])
    text = str(rec[0].message)
    assert "args[0]['second']['y'].b" in text
    assert "kwargs['kw'][1]['deep']" in text
    assert "args[0]['first'][1][0]: 2 chunks" in text
    assert "args[0]['second']['y'].b: 3 chunks" in text
    with pytest.raises(ValueError) as exc:
        dpmini.scatter_kwargs(inputs, {"kw": [good, {"deep": bad}]},
                              ["cpu:0", "cpu:1", "cpu:2"], strict=True)
    msg = str(exc.value)
    for path in ("args[0]['first'][0]", "args[0]['first'][1][0]", "args[0]['first'][1][1]",
                 "args[0]['second']['x']", "args[0]['second']['y'].a",
                 "args[0]['second']['y'].b", "kwargs['kw'][0]", "kwargs['kw'][1]['deep']"):
        assert f"  {path}: shape" in msg


def test_explain_lists_every_leaf_path_in_order():
    leaf = np.zeros((4, 2))
    inputs = ([leaf, {"a": leaf, "b": (leaf, [leaf])}], {"c": leaf})
    plan = dpmini.explain(inputs, ["cpu:0", "cpu:1"],
                          kwargs={"k": {"d": leaf}, "e": [leaf, leaf]})
    paths = [entry["path"] for entry in plan.leaves]
    assert paths == ["args[0][0]", "args[0][1]['a']", "args[0][1]['b'][0]",
                     "args[0][1]['b'][1][0]", "args[1]['c']", "kwargs['k']['d']",
                     "kwargs['e'][0]", "kwargs['e'][1]"]
