"""in_dims / out_dims: JAX pmap's in_axes / out_axes on top of PyTorch's rules.

in_dims mirrors the arguments (a tuple is a prefix of the positional ones, a
dict addresses positions by int and keywords by name); an int splits along
that dim, None broadcasts the array whole and never changes the replica
count. out_dims mirrors the outputs; an int gathers along that dim, None
checks that the replicas agree, "sum" adds. None for both is PyTorch.
"""
import collections
import dataclasses
import os
import warnings

import numpy as np
import pytest

import dpmini

D2 = ["cpu:0", "cpu:1"]
D3 = ["cpu:0", "cpu:1", "cpu:2"]
D4 = ["cpu:0", "cpu:1", "cpu:2", "cpu:3"]


def shapes(groups, i):
    return [np.shape(g[i]) for g in groups]


# ---------------------------------------------------------------- in_dims


def test_default_is_pytorch():
    x = np.arange(20.0).reshape(5, 4)
    a = dpmini.scatter_kwargs((x,), None, D4)
    b = dpmini.scatter_kwargs((x,), None, D4, in_dims=None)
    assert [s[0].shape for s in a[0]] == [s[0].shape for s in b[0]] == [(2, 4), (2, 4), (1, 4)]


def test_tuple_prefix_split_and_broadcast():
    x = np.arange(20.0).reshape(5, 4)
    table = np.arange(7.0)
    extra = np.arange(10.0).reshape(2, 5)
    with pytest.warns(dpmini.SplitWarning, match=r"args\[0\].*args\[2\]"):
        ins, kws = dpmini.scatter_kwargs((x, table, extra), None, D4, in_dims=(0, None))
    # table is broadcast and does not count; extra (not listed) uses dim 0: 2 chunks
    assert len(ins) == 2
    assert shapes(ins, 0) == [(2, 4), (2, 4)]
    assert shapes(ins, 1) == [(7,), (7,)]
    assert shapes(ins, 2) == [(1, 5), (1, 5)]
    for j, group in enumerate(ins):
        assert np.array_equal(group[1], table)
        assert str(dpmini.device_of(group[1])) == D4[j]


def test_broadcast_never_changes_replica_count():
    x = np.zeros((9, 2))
    small = np.zeros(1)
    ins, _ = dpmini.scatter_kwargs((x, small), None, D3, in_dims=(0, None))
    assert len(ins) == 3
    ins, _ = dpmini.scatter_kwargs((small,), None, D3, in_dims=(None,))
    assert len(ins) == 3  # no split leaf: every device runs


def test_broadcast_is_the_array_itself_on_its_own_device():
    t = dpmini.asarray(np.arange(6.0), "cpu:1")
    ins, _ = dpmini.scatter_kwargs((np.zeros(4), t), None, D2, in_dims=(0, None))
    assert ins[1][1] is t
    assert ins[0][1] is not t and np.array_equal(ins[0][1], t)
    assert str(dpmini.device_of(ins[0][1])) == "cpu:0"


def test_broadcast_accepts_0dim_arrays():
    s = np.array(3.5)
    ins, _ = dpmini.scatter_kwargs((np.zeros(4), s), None, D2, in_dims=(0, None))
    assert [float(g[1]) for g in ins] == [3.5, 3.5]
    assert [g[1].shape for g in ins] == [(), ()]


def test_int_dim_per_argument():
    a = np.zeros((4, 6))
    b = np.zeros((6, 4))
    ins, _ = dpmini.scatter_kwargs((a, b), None, D2, in_dims=(1, 0))
    assert shapes(ins, 0) == [(4, 3), (4, 3)]
    assert shapes(ins, 1) == [(3, 4), (3, 4)]


def test_top_level_int_applies_to_everything():
    a = np.zeros((4, 6))
    ins, kws = dpmini.scatter_kwargs((a,), {"m": np.zeros((2, 6))}, D3, in_dims=1)
    assert shapes(ins, 0) == [(4, 2)] * 3
    assert [k["m"].shape for k in kws] == [(2, 2)] * 3


def test_dict_addresses_positions_and_keywords():
    x = np.zeros((4, 3))
    seq = np.zeros((5, 4, 2))
    mask = np.ones(9)
    ins, kws = dpmini.scatter_kwargs((x, seq), {"mask": mask, "flag": True}, D2,
                                     in_dims={1: 1, "mask": None})
    assert shapes(ins, 0) == [(2, 3), (2, 3)]
    assert shapes(ins, 1) == [(5, 2, 2), (5, 2, 2)]
    assert [k["mask"].shape for k in kws] == [(9,), (9,)]
    assert all(k["flag"] is True for k in kws)


def test_nested_prefix_rule_and_mirrors():
    batch = {"img": np.zeros((4, 3)), "seq": np.zeros((7, 4)), "meta": {"id": np.arange(4),
                                                                         "tab": np.zeros(5)}}
    out = dpmini.scatter(batch, D2, in_dims={"seq": 1, "meta": {"tab": None}})
    assert [o["img"].shape for o in out] == [(2, 3), (2, 3)]
    assert [o["seq"].shape for o in out] == [(7, 2), (7, 2)]
    assert [o["meta"]["id"].shape for o in out] == [(2,), (2,)]
    assert [o["meta"]["tab"].shape for o in out] == [(5,), (5,)]
    # None for a container: every leaf under it is broadcast
    out = dpmini.scatter(batch, D2, in_dims={"meta": None})
    assert [o["meta"]["id"].shape for o in out] == [(4,), (4,)]


def test_list_and_namedtuple_mirrors():
    P = collections.namedtuple("P", "a b")
    out = dpmini.scatter([np.zeros(4), P(np.zeros((2, 4)), np.zeros(3))], D2,
                         in_dims=[0, (1, None)])
    assert [o[0].shape for o in out] == [(2,), (2,)]
    assert [o[1].a.shape for o in out] == [(2, 2), (2, 2)]
    assert [o[1].b.shape for o in out] == [(3,), (3,)]
    assert all(isinstance(o[1], P) for o in out)


def test_non_array_leaves_accept_int_or_none():
    ins, _ = dpmini.scatter_kwargs((np.zeros(4), "tag", 3), None, D2, in_dims=(0, None, 1))
    assert [g[1] for g in ins] == ["tag", "tag"] and [g[2] for g in ins] == [3, 3]


def test_negative_dim_in_in_dims_wraps_per_array():
    ins, _ = dpmini.scatter_kwargs((np.zeros((2, 6)), np.zeros(4)), None, D2, in_dims=(-1, -1))
    assert shapes(ins, 0) == [(2, 3), (2, 3)] and shapes(ins, 1) == [(2,), (2,)]


@pytest.mark.parametrize("in_dims, exc, words", [
    ((0, 0, 0), ValueError, ["in_dims", "3 entries", "2 positional"]),
    ({"maks": None}, ValueError, ["in_dims['maks']", "no keyword argument"]),
    ({5: None}, ValueError, ["in_dims[5]", "0..1"]),
    ({1.5: None}, TypeError, ["in_dims[1.5]", "position (int) or", "name (str)"]),
    ((("x",),), TypeError, ["in_dims[0][0]", "got str"]),
    (((0,),), TypeError, ["in_dims[0]", "args[0]", "array"]),
    ((0, {"a": 0}), TypeError, ["in_dims[1]", "args[1]"]),
    ("zero", TypeError, ["in_dims", "str"]),
    ((True,), TypeError, ["in_dims[0]", "bool"]),
    ((0, 2**40), ValueError, ["in_dims[1]"]),
    ((5,), IndexError, ["args[0]", "Dimension out of range"]),
])
def test_in_dims_errors_name_the_entry(in_dims, exc, words):
    with pytest.raises(exc) as info:
        dpmini.scatter_kwargs((np.zeros((4, 2)), np.zeros(3)), {"mask": np.zeros(4)}, D2,
                              in_dims=in_dims)
    for w in words:
        assert w in str(info.value)


def test_nested_structure_errors_name_the_path():
    batch = ({"x": np.zeros(4)}, [np.zeros(4), np.zeros(4)])
    with pytest.raises(ValueError, match=r"in_dims\[0\]\['y'\].*no key 'y'"):
        dpmini.scatter_kwargs(batch, None, D2, in_dims=({"y": 0},))
    with pytest.raises(ValueError, match=r"in_dims\[1\]: has 3 entries.*args\[1\] has only 2"):
        dpmini.scatter_kwargs(batch, None, D2, in_dims=(0, (0, 0, 0)))
    with pytest.raises(TypeError, match=r"in_dims\[1\].*sequence"):
        dpmini.scatter_kwargs(batch, None, D2, in_dims=(0, {"x": 0}))
    with pytest.raises(TypeError, match=r"in_dims\[0\].*dict"):
        dpmini.scatter_kwargs(batch, None, D2, in_dims=((0,),))
    with pytest.raises(TypeError, match=r"in_dims\[1\]\['x'\]"):
        dpmini.scatter(({"x": np.zeros(4)},), D2, in_dims=(0, {"x": "bad"}))


def test_scatter_in_dims_mirrors_inputs_and_says_how_to_address_a_tuple():
    """scatter's in_dims mirrors `inputs` itself: a tuple is addressed by a tuple;
    the int-key dict form belongs to the argument lists of DataParallel,
    scatter_kwargs and explain, whose results it must match."""
    args = (np.ones((4, 6)), np.ones((4, 6)))
    with pytest.raises(TypeError, match=r"^in_dims: a dict .* inputs is a sequence; give a tuple "
                                        r"or list instead .*int keys address positional"):
        dpmini.scatter(args, D2, in_dims={1: 1})
    with pytest.raises(TypeError, match=r"^in_dims: a tuple .* inputs is a dict; give a dict "
                                        r"instead"):
        dpmini.scatter({"a": np.ones(4)}, D2, in_dims=(1,))
    by_tuple = dpmini.scatter(args, D2, in_dims=(0, 1))   # {1: 1}: args[0] keeps dim 0
    by_kwargs, _ = dpmini.scatter_kwargs(args, {}, D2, in_dims={1: 1})
    assert [[a.shape for a in r] for r in by_tuple] == [[a.shape for a in r] for r in by_kwargs] \
        == [[(2, 6), (4, 3)], [(2, 6), (4, 3)]]


def test_in_dims_on_shared_value_with_children_is_an_error():
    with pytest.raises(TypeError, match=r"in_dims\[1\].*args\[1\].*shared"):
        dpmini.scatter_kwargs((np.zeros(4), "tag"), None, D2, in_dims=(0, (0,)))


def test_in_dims_with_no_arguments_is_an_error():
    with pytest.raises(ValueError, match="in_dims"):
        dpmini.scatter_kwargs((), None, D2, in_dims=(0,))


def test_mismatch_warning_ignores_broadcast_leaves():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        dpmini.scatter_kwargs((np.zeros(4), np.zeros(7)), None, D2, in_dims=(0, None))
    with pytest.warns(dpmini.SplitWarning, match=r"args\[0\]"):
        dpmini.scatter_kwargs((np.zeros(5), np.zeros(1)), None, D2)


def test_dataparallel_in_dims_and_attribute():
    seen = []

    def f(x, table):
        seen.append((x.shape, table.shape))
        return x + table.sum()

    table = np.ones(3)
    dp = dpmini.DataParallel(f, D2, in_dims=(0, None))
    assert dp.in_dims == (0, None)
    y = dp(np.zeros((4, 2)), table)
    assert y.shape == (4, 2) and np.all(y == 3.0)
    assert sorted(seen) == [((2, 2), (3,)), ((2, 2), (3,))]
    assert "in_dims=(0, None)" in repr(dp)
    dp.in_dims = None
    assert dp.in_dims is None
    with pytest.raises(TypeError, match="in_dims"):
        dp.in_dims = "x"
    with pytest.raises(TypeError, match=r"in_dims\[0\]"):
        dpmini.DataParallel(f, D2, in_dims=(1.5,))


def test_dataparallel_subclass_scatter_uses_in_dims():
    class DP(dpmini.DataParallel):
        pass

    dp = DP(lambda x, t: x * t.size, D2, in_dims=(0, None))
    ins, kws = dp.scatter((np.zeros(4), np.ones(5)), {}, None)
    assert [g[1].shape for g in ins] == [(5,), (5,)]
    assert np.array_equal(dp(np.ones(4), np.ones(5)), np.full(4, 5.0))


def test_data_parallel_function_in_and_out_dims():
    def f(x, table, scale=1.0):
        return {"y": x * scale, "n": np.array([x.shape[0]])}

    out = dpmini.data_parallel(f, (np.ones((6, 2)), np.ones(3)), D3,
                               module_kwargs={"scale": 2.0}, in_dims=(0, None),
                               out_dims={"n": "sum"})
    assert np.array_equal(out["y"], np.full((6, 2), 2.0))
    assert out["n"].tolist() == [6]


# ---------------------------------------------------------------- out_dims


def outs2():
    return [
        {"loss": 1.5, "g": np.ones(3), "y": np.ones((2, 2)), "c": np.arange(3), "s": None},
        {"loss": 2.0, "g": np.full(3, 2.0), "y": np.zeros((2, 2)), "c": np.arange(3), "s": None},
    ]


def test_out_dims_sum_int_none():
    r = dpmini.gather(outs2(), "cpu:0",
                      out_dims={"loss": "sum", "g": "sum", "y": 1, "c": None, "s": "sum"})
    assert r["loss"] == 3.5
    assert np.array_equal(r["g"], np.full(3, 3.0)) and str(dpmini.device_of(r["g"])) == "cpu:0"
    assert r["y"].shape == (2, 4)
    assert np.array_equal(r["c"], np.arange(3)) and str(dpmini.device_of(r["c"])) == "cpu:0"
    assert r["s"] is None


def test_out_dims_default_is_pytorch():
    o = [np.ones((2, 3)), np.ones((1, 3))]
    assert dpmini.gather(o, "cpu:0").shape == dpmini.gather(o, "cpu:0", out_dims=None).shape


def test_out_dims_none_on_host():
    r = dpmini.gather([np.arange(3), np.arange(3)], "cpu", out_dims=None)
    assert r.shape == (6,)  # top-level None is the default
    r = dpmini.gather([(np.arange(3),), (np.arange(3),)], "cpu", out_dims=(None,))
    assert np.array_equal(r[0], np.arange(3)) and str(dpmini.device_of(r[0])) == "cpu"


def test_out_dims_none_requires_equal_values():
    with pytest.raises(TypeError, match=r"out\['y'\].*replica 1.*differs"):
        dpmini.gather(outs2(), "cpu:0", out_dims={"loss": "sum", "y": None})
    with pytest.raises(TypeError, match=r"out\['loss'\].*different values"):
        dpmini.gather(outs2(), "cpu:0", out_dims={"loss": None, "y": 0})
    with pytest.raises(TypeError, match=r"out\[0\]"):
        dpmini.gather([(np.arange(3),), (np.arange(4),)], "cpu", out_dims=(None,))


def test_out_dims_container_prefix_rule():
    o = [{"a": {"x": np.ones(2), "y": 2}}, {"a": {"x": np.ones(2), "y": 3}}]
    r = dpmini.gather(o, "cpu:0", out_dims={"a": "sum"})
    assert np.array_equal(r["a"]["x"], np.full(2, 2.0)) and r["a"]["y"] == 5


def test_out_dims_sum_of_scalars_and_shapes():
    r = dpmini.gather([np.float64(1.5), np.float64(2.5)], "cpu:0", out_dims="sum")
    assert float(r) == 4.0
    with pytest.raises(ValueError, match=r"out.*invalid size"):
        dpmini.gather([np.ones(2), np.ones(3)], "cpu:0", out_dims="sum")
    with pytest.raises(TypeError, match=r"out\['t'\].*\"sum\".*str"):
        dpmini.gather([{"t": "a"}, {"t": "b"}], "cpu:0", out_dims={"t": "sum"})


def test_out_dims_tuple_namedtuple_dataclass():
    P = collections.namedtuple("P", "a b")

    @dataclasses.dataclass
    class Out:
        loss: float
        grad: np.ndarray

    r = dpmini.gather([P(np.ones(2), 1), P(np.ones(2), 1)], "cpu:0", out_dims=("sum", None))
    assert isinstance(r, P) and np.array_equal(r.a, np.full(2, 2.0)) and r.b == 1
    r = dpmini.gather([Out(1.0, np.ones(2)), Out(2.0, np.ones(2))], "cpu:0",
                      out_dims={"loss": "sum", "grad": "sum"})
    assert isinstance(r, Out) and r.loss == 3.0 and np.array_equal(r.grad, np.full(2, 2.0))
    with pytest.raises(ValueError, match=r"out_dims\['nope'\]"):
        dpmini.gather([Out(1.0, np.ones(2))] * 2, "cpu:0", out_dims={"nope": "sum"})


@pytest.mark.parametrize("out_dims, exc, words", [
    ({"loss": "mean"}, ValueError, ["out_dims['loss']", "'mean'"]),
    ({"zz": None}, ValueError, ["out_dims['zz']", "no key 'zz'"]),
    ({"loss": (0,)}, TypeError, ["out_dims['loss']", "out['loss']"]),
    ((0, 0), TypeError, ["out_dims", "dict"]),
    ({"g": 1.5}, TypeError, ["out_dims['g']", "float"]),
    ({"y": 5, "loss": "sum"}, IndexError, ["out['y']"]),
])
def test_out_dims_errors(out_dims, exc, words):
    with pytest.raises(exc) as info:
        dpmini.gather(outs2(), "cpu:0", out_dims=out_dims)
    for w in words:
        assert w in str(info.value)


def test_out_dims_seq_too_long():
    with pytest.raises(ValueError, match=r"out_dims: has 3 entries.*out has only 2"):
        dpmini.gather([(np.ones(1), np.ones(1))] * 2, "cpu:0", out_dims=(0, 0, 0))


def test_dataparallel_out_dims_gradients():
    def step(x):
        return {"loss_sum": float(x.sum()), "grads": {"w": x.sum(axis=0)}, "n": len(x)}

    x = np.arange(12.0).reshape(6, 2)
    dp = dpmini.DataParallel(step, D3, out_dims={"loss_sum": "sum", "grads": "sum", "n": "sum"})
    r = dp(x)
    assert r["loss_sum"] == x.sum() and r["n"] == 6
    assert np.array_equal(r["grads"]["w"], x.sum(axis=0))
    assert dp.out_dims["grads"] == "sum"
    with pytest.raises(ValueError, match=r"out_dims\['loss_sum'\].*no key"):
        dp.gather([{"a": np.ones(1)}, {"a": np.ones(1)}], None)
    dp.out_dims = {"n": "sum"}  # the keys it does not list use dim
    r2 = dp.gather([{"a": np.ones(1), "n": 1}, {"a": np.ones(1), "n": 2}], None)
    assert r2["a"].shape == (2,) and r2["n"] == 3
    with pytest.raises(ValueError, match="out_dims"):
        dp.out_dims = {"x": "max"}


def test_single_device_path_skips_gather():
    dp = dpmini.DataParallel(lambda x: {"s": x.sum()}, ["cpu:0"], out_dims={"s": "sum"})
    assert float(dp(np.ones(3))["s"]) == 3.0


# ---------------------------------------------------------------- leaks


def test_no_refcount_or_memory_growth_with_extensions():
    import gc
    import sys
    import tracemalloc

    table = np.ones(7)
    x = np.ones((8, 3))
    spec_in = ({"x": 0, "t": None}, 1)
    spec_out = {"s": "sum", "t": None, "y": 0}

    def f(d, z):
        return {"s": d["x"].sum(axis=0), "t": d["t"], "y": d["x"] + z.sum()}

    dp = dpmini.DataParallel(f, D2, in_dims=spec_in, out_dims=spec_out, weights=[1, 3])

    def call():
        dp({"x": x, "t": table}, np.ones((2, 8)))
        try:
            dpmini.scatter_kwargs(({"x": x},), None, D2, in_dims=({"nope": 0},))
        except ValueError:
            pass
        try:
            dpmini.gather([{"a": 1}, {"a": 1}], "cpu:0", out_dims={"b": None})
        except ValueError:
            pass
        assert dpmini.explain((x,), D2, in_dims=((0,),)).error
        assert dpmini.explain((x, table), D2, in_dims=(0, None), chunk_sizes=[2, 2]).error

    for _ in range(200):
        call()
    gc.collect()
    refs = [sys.getrefcount(o) for o in (table, x, spec_in, spec_out)]

    def traced_growth():
        tracemalloc.start()
        before = tracemalloc.get_traced_memory()[0]
        for _ in range(2000):
            call()
        gc.collect()
        grown = tracemalloc.get_traced_memory()[0] - before
        tracemalloc.stop()
        return grown

    # a bounded cache may step up once while measuring; a leak grows again
    grown = traced_growth()
    if grown >= 64 * 1024:
        grown = min(grown, traced_growth())
    assert [sys.getrefcount(o) for o in (table, x, spec_in, spec_out)] == refs
    if not os.environ.get("DPMINI_SANITIZER"):
        # Under ASan (PYTHONMALLOC=malloc, slower worker threads) CPython's and
        # threadpoolctl's bounded caches hold more at the moment of measuring
        # (measured: 111 KiB after 1,000 calls, 134 KiB after 4,000, i.e. not
        # per call); leaks there are test_memory's and valgrind's to find.
        assert grown < 64 * 1024, grown
