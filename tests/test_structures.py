"""dpmini.scatter / scatter_kwargs / gather on structures (docs/spec.md 3-4, design
"Decisions"; docs/spec.md 10 and 11)."""
import collections
import dataclasses
import re
import warnings

import numpy as np
import pytest

import dpmini

SCALAR_WARNING = ("Was asked to gather along dimension 0, but all input tensors were scalars; "
                  "will instead unsqueeze and return a vector.")

NT = collections.namedtuple("NT", ["a", "b"])


def dev(a):
    return str(dpmini.device_of(a))


@pytest.fixture
def no_warnings():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        yield


# =================================================================== scatter

def test_scatter_bare_array_gives_tuple_of_chunks(dev3):
    x = np.arange(12).reshape(6, 2)
    res = dpmini.scatter(x, dev3)
    assert isinstance(res, tuple) and len(res) == 3
    assert [dev(c) for c in res] == dev3
    np.testing.assert_array_equal(np.concatenate(res), x)


def test_scatter_tuple_gives_list_of_tuples(dev2):
    x = np.arange(8).reshape(4, 2)
    y = np.arange(4.0)
    res = dpmini.scatter((x, y), dev2)
    assert isinstance(res, list) and len(res) == 2
    for i, r in enumerate(res):
        assert type(r) is tuple and len(r) == 2
        np.testing.assert_array_equal(r[0], x[2 * i: 2 * i + 2])
        np.testing.assert_array_equal(r[1], y[2 * i: 2 * i + 2])
        assert dev(r[0]) == dev2[i] and dev(r[1]) == dev2[i]


def test_scatter_list_gives_list_of_lists(dev2):
    x = np.arange(4)
    res = dpmini.scatter([x, "tag"], dev2)
    assert len(res) == 2
    assert all(type(r) is list for r in res)
    assert [r[0].tolist() for r in res] == [[0, 1], [2, 3]]
    assert [r[1] for r in res] == ["tag", "tag"]


def test_scatter_dict_keeps_key_order(dev2):
    x = np.arange(4)
    inp = {"z": x, "a": x + 10, "m": "meta"}
    res = dpmini.scatter(inp, dev2)
    assert len(res) == 2
    for i, r in enumerate(res):
        assert type(r) is dict
        assert list(r) == ["z", "a", "m"]
        assert r["z"].tolist() == [2 * i, 2 * i + 1]
        assert r["a"].tolist() == [10 + 2 * i, 11 + 2 * i]
        assert r["m"] == "meta"


def test_scatter_ordereddict_type_kept(dev2):
    inp = collections.OrderedDict([("b", np.arange(4)), ("a", np.arange(4, 8))])
    res = dpmini.scatter(inp, dev2)
    for r in res:
        assert type(r) is collections.OrderedDict
        assert list(r) == ["b", "a"]


def test_namedtuple_scatter(dev2):
    a = np.arange(8).reshape(4, 2)
    res = dpmini.scatter(NT(a=a, b=7), dev2)
    assert len(res) == 2
    for i, r in enumerate(res):
        assert type(r) is NT
        np.testing.assert_array_equal(r.a, a[2 * i: 2 * i + 2])
        assert r.b == 7
        assert dev(r.a) == dev2[i]


def test_namedtuple_inside_args(dev2):
    a = np.arange(8).reshape(4, 2)
    inputs, kwargs = dpmini.scatter_kwargs((NT(a, "x"),), {"nt": NT(a, 3)}, dev2)
    assert len(inputs) == 2 and len(kwargs) == 2
    for i in range(2):
        assert type(inputs[i][0]) is NT and type(kwargs[i]["nt"]) is NT
        np.testing.assert_array_equal(inputs[i][0].a, a[2 * i: 2 * i + 2])
        assert inputs[i][0].b == "x" and kwargs[i]["nt"].b == 3


def test_scatter_nested_structure(dev2):
    x = np.arange(6).reshape(6, 1)
    inp = {"a": [x, (x * 2, "k")], "b": None}
    res = dpmini.scatter(inp, dev2)
    assert len(res) == 2
    for i, r in enumerate(res):
        rows = slice(3 * i, 3 * i + 3)
        np.testing.assert_array_equal(r["a"][0], x[rows])
        np.testing.assert_array_equal(r["a"][1][0], (x * 2)[rows])
        assert type(r["a"]) is list and type(r["a"][1]) is tuple
        assert r["a"][1][1] == "k"
        assert r["b"] is None


@pytest.mark.parametrize("obj", [None, "abc", b"raw", 1.2345, 10 ** 30, np.float64(2.5),
                                 np.int32(3), object(), {1, 2}], ids=lambda v: type(v).__name__)
def test_scatter_non_array_is_shared_by_reference(obj, dev3):
    res = dpmini.scatter(obj, dev3)
    assert len(res) == 3
    assert all(r is obj for r in res)


def test_scatter_custom_object_shared(dev2):
    class Cfg:
        pass

    cfg = Cfg()
    inputs, kwargs = dpmini.scatter_kwargs((np.arange(4), cfg), {"cfg": cfg}, dev2)
    assert all(inp[1] is cfg for inp in inputs)
    assert all(kw["cfg"] is cfg for kw in kwargs)


def test_scatter_numpy_scalars_shared_not_split(dev2):
    s = np.float64(0.5)
    f = 1.2345
    inputs, _ = dpmini.scatter_kwargs((np.arange(4), s, f, "txt"), {}, dev2)
    assert len(inputs) == 2
    for inp in inputs:
        assert inp[1] is s and inp[2] is f and inp[3] == "txt"


def test_scatter_list_of_numbers_is_copied_not_split(dev2):
    res = dpmini.scatter([1, 2, 3], dev2)
    assert res == [[1, 2, 3], [1, 2, 3]]


@pytest.mark.parametrize("empty", [(), [], {}], ids=repr)
def test_scatter_empty_containers(empty, dev3):
    res = dpmini.scatter(empty, dev3)
    assert len(res) == 3
    assert all(r == empty and type(r) is type(empty) for r in res)


# ============================================================= scatter_kwargs

def test_scatter_kwargs_basic(dev2):
    x = np.arange(8).reshape(4, 2)
    y = np.arange(4.0)
    inputs, kwargs = dpmini.scatter_kwargs((x,), {"y": y, "flag": True}, dev2)
    assert isinstance(inputs, tuple) and isinstance(kwargs, tuple)
    assert len(inputs) == 2 and len(kwargs) == 2
    for i in range(2):
        assert type(inputs[i]) is tuple and type(kwargs[i]) is dict
        np.testing.assert_array_equal(inputs[i][0], x[2 * i: 2 * i + 2])
        np.testing.assert_array_equal(kwargs[i]["y"], y[2 * i: 2 * i + 2])
        assert kwargs[i]["flag"] is True
        assert dev(inputs[i][0]) == dev2[i] and dev(kwargs[i]["y"]) == dev2[i]


def test_scatter_kwargs_pads_kwargs_with_empty_dicts(dev3):
    inputs, kwargs = dpmini.scatter_kwargs((np.arange(6),), {}, dev3)
    assert len(inputs) == 3
    assert kwargs == ({}, {}, {})
    inputs, kwargs = dpmini.scatter_kwargs((np.arange(6),), None, dev3)
    assert kwargs == ({}, {}, {})


def test_scatter_kwargs_pads_inputs_with_empty_tuples(dev3):
    inputs, kwargs = dpmini.scatter_kwargs((), {"x": np.arange(6)}, dev3)
    assert inputs == ((), (), ())
    assert [kw["x"].tolist() for kw in kwargs] == [[0, 1], [2, 3], [4, 5]]


def test_scatter_kwargs_nothing(dev2):
    assert dpmini.scatter_kwargs((), {}, dev2) == ((), ())


def test_scatter_kwargs_no_array_leaf_gives_one_replica_per_device(dev3):
    inputs, kwargs = dpmini.scatter_kwargs((5, "s"), {"a": [1, 2]}, dev3)
    assert inputs == ((5, "s"),) * 3
    assert kwargs == ({"a": [1, 2]},) * 3


def test_non_array_kwarg_does_not_add_replicas(dev2):
    x = np.arange(3.0).reshape(1, 3)
    inputs, kwargs = dpmini.scatter_kwargs((x,), {"delta": 3}, dev2)
    assert len(inputs) == 1 and len(kwargs) == 1
    np.testing.assert_array_equal(inputs[0][0], x)
    assert kwargs[0] == {"delta": 3}

    calls = []

    class Add:
        def __call__(self, x, *, delta=2):
            calls.append(dev(x))
            return x + delta

    out = dpmini.DataParallel(Add(), device_ids=dev2)(x, delta=3)
    assert out.shape == (1, 3)
    np.testing.assert_array_equal(out, x + 3)
    assert calls == ["cpu:0"]  # only device 0 is used, nobody is called without x


def test_array_kwarg_of_batch_one(dev2, no_warnings):
    x = np.ones((1, 3))
    m = np.full((1, 3), 2.0)
    inputs, kwargs = dpmini.scatter_kwargs((x,), {"m": m}, dev2)
    assert len(inputs) == 1 and len(kwargs) == 1
    np.testing.assert_array_equal(kwargs[0]["m"], m)
    out = dpmini.DataParallel(lambda x, m: x * m, device_ids=dev2)(x, m=m)
    np.testing.assert_array_equal(out, [[2.0, 2.0, 2.0]])


def test_short_batch_with_flag_kwarg(dev4):
    # torch.chunk(4) of 3 rows is [1,1,1] (docs/spec.md 0.3: k=4, 3 -> [1,1,1]):
    # 3 replicas (one per chunk), not 4 (docs/spec.md 10.1).
    x = np.arange(9.0).reshape(3, 3)
    inputs, kwargs = dpmini.scatter_kwargs((x,), {"flag": True}, dev4)
    assert len(inputs) == 3 and len(kwargs) == 3
    assert [inp[0].shape[0] for inp in inputs] == [1, 1, 1]
    assert all(kw == {"flag": True} for kw in kwargs)

    calls = []

    def f(x, flag=False):
        calls.append((dev(x), x.shape[0], flag))
        return x if flag else -x

    out = dpmini.DataParallel(f, device_ids=dev4)(x, flag=True)
    assert sorted(calls) == [("cpu:0", 1, True), ("cpu:1", 1, True), ("cpu:2", 1, True)]
    np.testing.assert_array_equal(out, x)

    # on 2 devices the 3 rows split [2, 1]
    calls.clear()
    out = dpmini.DataParallel(f, device_ids=dev4[:2])(x, flag=True)
    assert sorted(calls) == [("cpu:0", 2, True), ("cpu:1", 1, True)]
    np.testing.assert_array_equal(out, x)


def test_spec_2_8_kwarg_with_fewer_chunks_limits_replicas(dev2):
    x = np.arange(4.0)
    m = np.array([7.0])
    with pytest.warns(dpmini.SplitWarning):
        inputs, kwargs = dpmini.scatter_kwargs((x,), {"m": m}, dev2)
    assert len(inputs) == 1 and len(kwargs) == 1
    np.testing.assert_array_equal(inputs[0][0], x[:2])
    np.testing.assert_array_equal(kwargs[0]["m"], m)


# ====================================================================== truncation to the smallest chunk count

def test_different_batch_sizes_truncate_with_split_warning(dev2):
    x = np.arange(15.0).reshape(5, 3)
    y = np.arange(3.0).reshape(1, 3)
    with pytest.warns(dpmini.SplitWarning) as rec:
        res = dpmini.scatter([x, y], dev2)
    assert len(res) == 1
    np.testing.assert_array_equal(res[0][0], x[0:3])
    np.testing.assert_array_equal(res[0][1], y[0:1])
    msg = " ".join(str(w.message) for w in rec if issubclass(w.category, dpmini.SplitWarning))
    assert "[0]" in msg  # names the argument that loses rows ...
    assert "3" in msg and "4" in msg  # ... and the rows dropped (rows 3-4 of x)


def test_dataparallel_parity_result_and_warning(dev2):
    seen = []

    def f(pair):
        x, y = pair
        seen.append((x.shape, y.shape))
        return x

    x = np.arange(15.0).reshape(5, 3)
    y = np.arange(3.0).reshape(1, 3)
    with pytest.warns(dpmini.SplitWarning) as rec:
        out = dpmini.DataParallel(f, device_ids=dev2)([x, y])
    assert seen == [((3, 3), (1, 3))]
    np.testing.assert_array_equal(out, x[:3])  # the exact 3-row parity result
    msg = " ".join(str(w.message) for w in rec if issubclass(w.category, dpmini.SplitWarning))
    assert re.search(r"\[0\]\[0\]", msg)  # the path of x inside the list argument
    assert "3" in msg and "4" in msg  # rows dropped from x (rows 3-4)


def test_split_warning_is_a_user_warning():
    assert issubclass(dpmini.SplitWarning, UserWarning)


def test_strict_raises_listing_paths_shapes_and_sizes(dev2):
    x = np.arange(15.0).reshape(5, 3)
    y = np.arange(3.0).reshape(1, 3)
    with pytest.raises(ValueError) as info:
        dpmini.scatter_kwargs((x,), {"y": y}, dev2, strict=True)
    msg = str(info.value)
    assert re.search(r"[\[(]5, 3[\])]", msg) and re.search(r"[\[(]1, 3[\])]", msg)
    assert "'y'" in msg and "[0]" in msg


def test_strict_dataparallel_raises_before_calling_module(dev2):
    calls = []
    dp = dpmini.DataParallel(lambda *a: calls.append(1), device_ids=dev2, strict=True)
    assert dp.strict is True
    with pytest.raises(ValueError, match=r"5"):
        dp(np.zeros((5, 3)), np.zeros((1, 3)))
    assert calls == []


def test_strict_scatter(dev2):
    with pytest.raises(ValueError):
        dpmini.scatter((np.zeros(5), np.zeros(1)), dev2, strict=True)


def test_same_chunk_counts_do_not_warn(dev4, no_warnings):
    # (6,) and (5,) on 4 devices both give 3 chunks ([2,2,2] and [2,2,1]): no warning.
    inputs, _ = dpmini.scatter_kwargs((np.zeros(6), np.zeros(5)), {}, dev4, strict=True)
    assert len(inputs) == 3
    assert [inp[1].shape[0] for inp in inputs] == [2, 2, 1]


def test_spec_3_2_truncation_example(dev4):
    x = np.arange(15.0).reshape(5, 3)
    y = np.arange(6.0).reshape(2, 3)
    with pytest.warns(dpmini.SplitWarning):
        res = dpmini.scatter((x, y), dev4)
    assert len(res) == 2
    assert [r[0].shape[0] for r in res] == [2, 2]
    assert [r[1].shape[0] for r in res] == [1, 1]


# ====================================================================== non-array values are shared, arrays split

def test_strings_copied_arrays_split(dev2):
    batch = {"img": np.arange(12.0).reshape(4, 3), "txt": ["a", "b", "c", "d"]}
    res = dpmini.scatter(batch, dev2)
    assert len(res) == 2
    np.testing.assert_array_equal(res[0]["img"], batch["img"][0:2])
    np.testing.assert_array_equal(res[1]["img"], batch["img"][2:4])
    assert res[0]["txt"] == ["a", "b", "c", "d"] and res[1]["txt"] == ["a", "b", "c", "d"]


def test_numpy_batch_is_split_not_duplicated(dev2):
    # the blog case: batch 16 on 2 devices must come back with 16 rows, not 32
    x = np.arange(16.0).reshape(16, 1)
    out = dpmini.DataParallel(lambda x: x * 2, device_ids=dev2)(x)
    assert out.shape == (16, 1)
    np.testing.assert_array_equal(out, x * 2)


def test_all_non_array_inputs_run_on_every_device(dev2):
    seen = []

    def f(txt):
        seen.append(len(txt))
        return np.array([len(txt)])

    out = dpmini.DataParallel(f, device_ids=dev2)(["a", "b", "c", "d"])
    assert seen == [4, 4]
    np.testing.assert_array_equal(out, [4, 4])  # n*B semantics, PyTorch parity


# ====================================================================== 0-dim arrays cannot be split

def test_zero_dim_kwarg_is_an_error(dev2):
    calls = []

    def f(ids, k):
        calls.append(1)
        return ids

    kwargs = {"ids": np.zeros((4, 6)), "k": np.array(37)}
    with pytest.raises(ValueError, match="chunk expects at least a 1-dimensional tensor") as info:
        dpmini.scatter_kwargs((), kwargs, dev2)
    assert re.search(r"\['k'\]", str(info.value))
    # PyTorch's words and its type too: code written for torch.chunk's RuntimeError catches it
    with pytest.raises(RuntimeError, match="chunk expects at least a 1-dimensional tensor") as info:
        dpmini.DataParallel(f, device_ids=dev2)(**kwargs)
    assert type(info.value) is dpmini.ZeroDimError and isinstance(info.value, ValueError)
    assert calls == []


def test_zero_dim_positional_is_an_error(dev2):
    with pytest.raises(ValueError, match=r"1-dimensional") as info:
        dpmini.scatter_kwargs((np.zeros(4), np.array(1.0)), {}, dev2)
    assert "[1]" in str(info.value)
    with pytest.raises(ValueError, match=r"1-dimensional"):
        dpmini.scatter(np.array(5), dev2)


def test_python_int_is_copied(dev2):
    _, kwargs = dpmini.scatter_kwargs((), {"ids": np.zeros((4, 6)), "k": 37}, dev2)
    assert [kw["k"] for kw in kwargs] == [37, 37]
    assert [kw["ids"].shape for kw in kwargs] == [(2, 6), (2, 6)]


def test_workaround_shape_n_by_1(dev2):
    k = np.full((2, 1), 37)
    _, kwargs = dpmini.scatter_kwargs((), {"ids": np.zeros((4, 6)), "k": k}, dev2)
    assert [kw["k"].shape for kw in kwargs] == [(1, 1), (1, 1)]
    assert [int(kw["k"][0, 0]) for kw in kwargs] == [37, 37]


# ====================================================================== negative dims

def test_negative_dim_resolved_per_array(dev2):
    x = np.arange(24).reshape(4, 6)
    y = np.arange(6)
    inputs, _ = dpmini.scatter_kwargs((x, y), {}, dev2, dim=-1)
    assert [inp[0].shape for inp in inputs] == [(4, 3), (4, 3)]
    assert [inp[1].shape for inp in inputs] == [(3,), (3,)]
    np.testing.assert_array_equal(inputs[1][0], x[:, 3:])
    np.testing.assert_array_equal(inputs[1][1], y[3:])
    outs = [(inp[0], inp[1]) for inp in inputs]
    g = dpmini.gather(outs, "cpu", dim=-1)
    assert type(g) is tuple
    np.testing.assert_array_equal(g[0], x)
    np.testing.assert_array_equal(g[1], y)


def test_dim_minus_two_matches_positive(dev3):
    x = np.arange(60).reshape(6, 10)
    z = np.arange(120).reshape(4, 6, 5)
    neg, _ = dpmini.scatter_kwargs((x, z), {}, dev3, dim=-2)
    assert [inp[0].shape for inp in neg] == [(2, 10)] * 3
    assert [inp[1].shape for inp in neg] == [(4, 2, 5)] * 3
    pos0 = dpmini.scatter(x, dev3, dim=0)
    pos1 = dpmini.scatter(z, dev3, dim=1)
    for i in range(3):
        np.testing.assert_array_equal(neg[i][0], pos0[i])
        np.testing.assert_array_equal(neg[i][1], pos1[i])
    g = dpmini.gather([inp for inp in neg], "cpu:0", dim=-2)
    np.testing.assert_array_equal(g[0], x)
    np.testing.assert_array_equal(g[1], z)


def test_dataparallel_dim_minus_one(dev2):
    x = np.arange(24.0).reshape(4, 6)
    y = np.arange(6.0)
    dp = dpmini.DataParallel(lambda a, b: (a + 1, b * 2), device_ids=dev2, dim=-1)
    a, b = dp(x, y)
    np.testing.assert_array_equal(a, x + 1)
    np.testing.assert_array_equal(b, y * 2)


# ==================================================================== gather

def test_gather_tuple_and_list(dev2):
    outs = [(np.zeros((2, 2)), [np.ones(1), np.arange(2)]),
            (np.ones((1, 2)), [np.zeros(3), np.arange(2, 4)])]
    g = dpmini.gather(outs, "cpu:1")
    assert type(g) is tuple and type(g[1]) is list
    np.testing.assert_array_equal(g[0], [[0, 0], [0, 0], [1, 1]])
    np.testing.assert_array_equal(g[1][0], [1, 0, 0, 0])
    np.testing.assert_array_equal(g[1][1], [0, 1, 2, 3])
    assert dev(g[0]) == "cpu:1" and dev(g[1][1]) == "cpu:1"


def test_gather_bare_arrays_to_host():
    g = dpmini.gather([np.arange(2), np.arange(2, 5)], "cpu")
    np.testing.assert_array_equal(g, np.arange(5))
    assert dev(g) == "cpu"


def test_gather_minus_one_target_warns():
    with pytest.warns(FutureWarning):
        g = dpmini.gather([np.arange(2), np.arange(2, 5)], -1)
    assert dev(g) == "cpu"


def test_dict_key_order_from_replica_0():
    outs = [{"b": np.zeros(2), "a": np.arange(2)},
            {"a": np.arange(2, 4), "b": np.ones(2)}]
    g = dpmini.gather(outs, "cpu:0")
    assert type(g) is dict and list(g) == ["b", "a"]
    np.testing.assert_array_equal(g["a"], np.arange(4))
    np.testing.assert_array_equal(g["b"], [0, 0, 1, 1])


def test_dict_outputs_shapes(dev2):
    out = dpmini.DataParallel(lambda x: {"a": x, "b": x[:, 0]}, device_ids=dev2)(np.zeros((4, 3)))
    assert out["a"].shape == (4, 3) and out["b"].shape == (4,)


def test_ordereddict_type_kept():
    outs = [collections.OrderedDict([("y", np.zeros(1)), ("x", np.zeros(1))]),
            collections.OrderedDict([("x", np.ones(1)), ("y", np.ones(1))])]
    g = dpmini.gather(outs, "cpu")
    assert type(g) is collections.OrderedDict
    assert list(g) == ["y", "x"]
    np.testing.assert_array_equal(g["x"], [0, 1])


def test_dict_key_count_mismatch():
    outs = [{"a": np.zeros(1), "b": np.zeros(1)}, {"a": np.zeros(1)}]
    with pytest.raises(ValueError, match="All dicts must have the same number of keys"):
        dpmini.gather(outs, "cpu")


def test_dict_missing_key_is_named():
    outs = [{"logits": np.zeros(1), "aux": np.zeros(1)}, {"logits": np.zeros(1), "other": np.zeros(1)}]
    with pytest.raises(ValueError, match="aux"):
        dpmini.gather(outs, "cpu")


def test_gather_namedtuple():
    outs = [NT(np.zeros(2), 5), NT(np.ones(1), 5)]
    g = dpmini.gather(outs, "cpu")
    assert type(g) is NT
    np.testing.assert_array_equal(g.a, [0, 0, 1])
    assert g.b == 5


@dataclasses.dataclass
class X1:
    foo: object
    bar: object


@dataclasses.dataclass(frozen=True)
class Frozen:
    logits: object
    name: str = "model"


def test_dataclass_of_scalars_by_field():
    outs = [X1(np.array(1), np.array(2)), X1(np.array(3), np.array(4))]
    with pytest.warns(UserWarning, match=re.escape(SCALAR_WARNING)):
        g = dpmini.gather(outs, "cpu")
    assert type(g) is X1
    np.testing.assert_array_equal(g.foo, [1, 3])
    np.testing.assert_array_equal(g.bar, [2, 4])


def test_dataclass_arrays_and_frozen(dev2):
    outs = [Frozen(np.zeros((2, 3))), Frozen(np.ones((1, 3)))]
    g = dpmini.gather(outs, "cpu:1")
    assert type(g) is Frozen
    assert g.logits.shape == (3, 3) and g.name == "model"
    assert dev(g.logits) == "cpu:1"
    out = dpmini.DataParallel(lambda x: Frozen(x * 2, "m"), device_ids=dev2)(np.arange(4.0))
    assert type(out) is Frozen and out.name == "m"
    np.testing.assert_array_equal(out.logits, np.arange(4.0) * 2)


def test_nested_lists_equal_structure():
    t = [np.full(i + 1, i) for i in range(6)]
    outs = [{"a": [[t[0], t[1]], [t[2]]]}, {"a": [[t[3], t[4]], [t[5]]]}]
    g = dpmini.gather(outs, "cpu:0")
    assert len(g["a"]) == 2 and len(g["a"][0]) == 2 and len(g["a"][1]) == 1
    np.testing.assert_array_equal(g["a"][0][0], np.concatenate([t[0], t[3]]))
    np.testing.assert_array_equal(g["a"][0][1], np.concatenate([t[1], t[4]]))
    np.testing.assert_array_equal(g["a"][1][0], np.concatenate([t[2], t[5]]))


def test_ragged_nested_lists_raise():
    t = [np.zeros(1)] * 6
    outs = [{"a": [[t[0], t[1]], [t[2]]]}, {"a": [[t[3]], [t[4], t[5]]]}]
    with pytest.raises(ValueError) as info:
        dpmini.gather(outs, "cpu")
    msg = str(info.value)
    assert re.search(r"\['a'\]\[0\]", msg)
    assert "2" in msg and "1" in msg


def test_outer_length_mismatch_raises():
    with pytest.raises(ValueError):
        dpmini.gather([[np.zeros(1), np.zeros(1)], [np.zeros(1)]], "cpu")


def test_none_in_every_replica():
    g = dpmini.gather([(np.zeros(2), None), (np.ones(1), None)], "cpu")
    assert type(g) is tuple and g[1] is None
    np.testing.assert_array_equal(g[0], [0, 0, 1])


def test_none_input_passed_to_every_replica(dev2):
    inputs, _ = dpmini.scatter_kwargs((np.arange(4), None), {"m": None}, dev2)
    assert len(inputs) == 2
    assert all(inp[1] is None for inp in inputs)
    seen = []
    out = dpmini.DataParallel(lambda x, mask: seen.append(mask) or x, device_ids=dev2)(np.arange(4), None)
    assert seen == [None, None]
    np.testing.assert_array_equal(out, np.arange(4))


def test_none_then_array_raises_type_error():
    outs = [{"logits": (np.zeros(2), None)}, {"logits": (np.zeros(2), np.ones(2))}]
    with pytest.raises(TypeError) as info:
        dpmini.gather(outs, "cpu")
    msg = str(info.value)
    assert re.search(r"\['logits'\]\[1\]", msg)
    assert "NoneType" in msg and "ndarray" in msg
    with pytest.raises(TypeError):
        dpmini.gather([None, np.zeros(1)], "cpu")


@pytest.mark.parametrize("other", [None, [np.zeros(2)], "x", 3])
def test_array_then_other_raises_type_error(other):
    outs = [{"logits": (np.zeros(2), np.zeros(2))}, {"logits": (np.zeros(2), other)}]
    with pytest.raises(TypeError) as info:
        dpmini.gather(outs, "cpu")
    msg = str(info.value)
    assert re.search(r"\['logits'\]\[1\]", msg)
    assert "ndarray" in msg and type(other).__name__ in msg


def test_dataparallel_replica_returns_none_on_one_device(dev2):
    def f(x):
        return None if dev(x) == "cpu:0" else x

    with pytest.raises(TypeError):
        dpmini.DataParallel(f, device_ids=dev2)(np.arange(4))


# --------------------------------------------------- strings, numbers, objects

@pytest.mark.parametrize("value", ["label", b"raw", 7, 2.5, 1 + 2j, True],
                         ids=repr)
def test_gather_equal_non_array_values_returned_once(value):
    g = dpmini.gather([(np.zeros(1), value), (np.zeros(1), value), (np.zeros(1), value)], "cpu")
    assert g[1] == value
    assert type(g[1]) is type(value)


def test_gather_equal_str_top_level():
    assert dpmini.gather(["x", "x"], "cpu") == "x"


@pytest.mark.parametrize("values", [("a", "b"), (1, 2), (1.0, 1.5)],
                         ids=repr)
def test_gather_different_non_array_values_raise(values):
    outs = [(np.zeros(1), values[0]), (np.zeros(1), values[1])]
    with pytest.raises(TypeError) as info:
        dpmini.gather(outs, "cpu")
    msg = str(info.value)
    assert "[1]" in msg
    assert str(values[0]) in msg and str(values[1]) in msg


def test_gather_numpy_scalar_loss_is_gathered_like_a_0dim_array(dev2):
    # x.mean() returns a NumPy scalar: dpmini treats it as a 0-dim array (the counterpart
    # of a 0-dim tensor loss), so the scalar rule of docs/spec.md 4.5 gives one value per replica.
    with pytest.warns(UserWarning, match="all input tensors were scalars"):
        out = dpmini.DataParallel(lambda x: x.mean(), device_ids=dev2)(np.arange(4.0))
    assert out.shape == (2,)
    np.testing.assert_array_equal(out, [0.5, 2.5])


def test_gather_numpy_scalars_keep_dtype():
    with pytest.warns(UserWarning):
        out = dpmini.gather([np.float32(1.5), np.float32(2.5)], "cpu")
    assert out.dtype == np.float32
    np.testing.assert_array_equal(out, [1.5, 2.5])


def test_gather_same_object_identity():
    marker = object()
    g = dpmini.gather([(np.zeros(1), marker), (np.zeros(1), marker)], "cpu")
    assert g[1] is marker


def test_gather_equal_but_distinct_objects_raise():
    class Same:
        def __eq__(self, other):
            return True

        __hash__ = object.__hash__

    with pytest.raises(TypeError):
        dpmini.gather([Same(), Same()], "cpu")


# ====================================================================== 0-dim outputs

def test_scalars_become_vector_with_warning():
    outs = [np.array(1.5), np.array(2.5), np.array(-1.0)]
    with pytest.warns(UserWarning, match=re.escape(SCALAR_WARNING)):
        g = dpmini.gather(outs, "cpu:1")
    assert g.shape == (3,) and g.dtype == np.float64
    np.testing.assert_array_equal(g, [1.5, 2.5, -1.0])
    assert dev(g) == "cpu:1"


def test_dataparallel_loss_vector_of_length_k(dev2):
    def loss(x):
        return np.asarray(x.sum())

    x = np.arange(4.0).reshape(2, 2)
    with pytest.warns(UserWarning, match=re.escape(SCALAR_WARNING)):
        out = dpmini.DataParallel(loss, device_ids=dev2)(x)
    assert out.shape == (2,)
    np.testing.assert_array_equal(out, [1.0, 5.0])
    assert dev(out) == "cpu:0"


def test_batch_one_gives_length_one_vector(dev2):
    with pytest.warns(UserWarning, match=re.escape(SCALAR_WARNING)):
        out = dpmini.DataParallel(lambda x: np.asarray(x.sum()), device_ids=dev2)(np.ones((1, 2)))
    assert out.shape == (1,)
    np.testing.assert_array_equal(out, [2.0])


@pytest.mark.parametrize("dim", [-1, 1])
def test_scalars_with_other_dim_raise(dim):
    with pytest.raises(ValueError):
        dpmini.gather([np.array(1.0), np.array(2.0)], "cpu", dim=dim)


def test_mixed_scalar_and_vector_raise():
    # not all scalars: the plain array rule applies, and a 0-dim array cannot be concatenated
    # (PyTorch has no defined behaviour here; either a dim or a rank error is acceptable)
    with pytest.raises((ValueError, IndexError)):
        dpmini.gather([np.array(1.0), np.array([2.0])], "cpu")


# ====================================================================== dim=1 scatter, outputs with the batch on dim 0

def test_dim1_gather_mismatch_is_an_error(dev3):
    def cell(x):
        return np.ones((x.shape[1], 1))  # batch on dim 0 of the output

    x = np.zeros((4, 7))
    pieces = dpmini.scatter(x, dev3, dim=1)
    assert [p.shape[1] for p in pieces] == [3, 3, 1]
    with pytest.raises(ValueError) as info:
        dpmini.DataParallel(cell, device_ids=dev3, dim=1)(x)
    msg = str(info.value)
    assert "index 2" in msg
    assert re.search(r"[\[(]1, 1[\])]", msg) and re.search(r"[\[(]3, 1[\])]", msg)


def test_divisible_batch_gives_silently_wrong_layout(dev3):
    out = dpmini.DataParallel(lambda x: np.ones((x.shape[1], 1)), device_ids=dev3, dim=1)(np.zeros((4, 6)))
    assert out.shape == (2, 3)


# ====================================================================== per-replica padding to the longest sequence

def _rnn_like(total_length=None):
    def f(x, lengths):
        t = int(lengths.max()) if total_length is None else total_length
        return x[:, :t] * 1.0

    return f


def test_variable_length_outputs_raise(dev2):
    x = np.arange(60.0).reshape(4, 5, 3)
    lengths = np.array([5, 4, 2, 1])
    with pytest.raises(ValueError) as info:
        dpmini.DataParallel(_rnn_like(), device_ids=dev2)(x, lengths)
    msg = str(info.value)
    assert "index 1" in msg
    assert re.search(r"[\[(]2, 2, 3[\])]", msg) and re.search(r"[\[(]2, 5, 3[\])]", msg)


def test_total_length_fixes_it(dev2):
    x = np.arange(60.0).reshape(4, 5, 3)
    lengths = np.array([5, 4, 2, 1])
    out = dpmini.DataParallel(_rnn_like(total_length=5), device_ids=dev2)(x, lengths)
    assert out.shape == (4, 5, 3)
    np.testing.assert_array_equal(out, x)


# ====================================================================== inconsistent split sizes (JAX pmap's model)

def test_pmap_contrast_same_inputs_parity_rules(dev2):
    # different batch sizes: truncated with a warning (not JAX's error) unless strict
    with pytest.warns(dpmini.SplitWarning):
        inputs, _ = dpmini.scatter_kwargs((np.ones((8, 4)), np.ones((1, 4))), {}, dev2)
    assert len(inputs) == 1
    # a Python scalar needs no in_axes=None: it is copied to every replica
    inputs, _ = dpmini.scatter_kwargs((np.ones((8, 100)), 10), {}, dev2)
    assert [inp[1] for inp in inputs] == [10, 10]
    # a 0-dim array raises
    with pytest.raises(ValueError, match="1-dimensional"):
        dpmini.scatter_kwargs((np.ones((8, 100)), np.array(10)), {}, dev2)


def test_strict_message_lists_path_shape_dim_and_size(dev2):
    with pytest.raises(ValueError) as info:
        dpmini.scatter_kwargs((), {"x": np.arange(1), "y": np.arange(2)}, dev2, strict=True)
    msg = str(info.value)
    for needle in ["['x']", "['y']", "(1,)", "(2,)", "dim 0"]:
        assert needle in msg, needle


def test_gather_equal_numpy_scalars_are_not_collapsed():
    # NumPy scalars follow the 0-dim array rule, not the "equal value returned once" rule
    with pytest.warns(UserWarning, match=re.escape(SCALAR_WARNING)):
        out = dpmini.gather([np.float64(1.0), np.float64(1.0), np.float64(1.0)], "cpu:1")
    assert isinstance(out, np.ndarray) and out.shape == (3,)
    assert dev(out) == "cpu:1"


def test_gather_numpy_scalars_mixed_with_0dim_arrays():
    with pytest.warns(UserWarning, match=re.escape(SCALAR_WARNING)):
        out = dpmini.gather([np.float64(1.0), np.array(2.0)], "cpu")
    np.testing.assert_array_equal(out, [1.0, 2.0])


def test_gather_numpy_scalars_other_dim_raise():
    with pytest.raises(ValueError):
        dpmini.gather([np.float64(1.0), np.float64(2.0)], "cpu", dim=-1)


# NumPy scalars mixed with Python numbers: tests/test_gather_scalars.py
