"""Rebuilt containers keep their exact type, keys and values.

Mappings: a dict subclass is rebuilt as copy.copy(obj) with its values set
key by key (never type(obj)(pairs), which a Counter counts as keys and a
defaultdict refuses), the same on scatter, gather and replicate.
Dataclasses: gathered fields are set on cls.__new__(cls) with
object.__setattr__; __init__ / __post_init__ do not run again.
Sequences: gather of a namedtuple at one replica and a plain tuple or list at
another gives replica 0's type, as PyTorch does.
"""
import collections
import dataclasses

import numpy as np
import pytest

import dpmini

D2 = ["cpu:0", "cpu:1"]


class Tagged(dict):
    """A user dict subclass with an attribute and a constructor of its own."""

    def __init__(self, tag, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.tag = tag


def _mappings():
    dd = collections.defaultdict(list)
    dd["x"] = np.arange(4.0)
    dd["n"] = 3
    return {
        "Counter": collections.Counter(a=3, b=1),
        "OrderedDict": collections.OrderedDict([("z", np.arange(4.0)), ("a", 1)]),
        "defaultdict": dd,
        "Tagged": Tagged("t1", x=np.arange(4.0), y="s"),
    }


def _check_same_mapping(got, orig, replica=None):
    assert type(got) is type(orig)
    assert list(got) == list(orig)
    for k, v in orig.items():
        if isinstance(v, np.ndarray):
            want = v if replica is None else np.array_split(v, 2)[replica]
            np.testing.assert_array_equal(got[k], want)
        else:
            assert got[k] is v
    if isinstance(orig, collections.defaultdict):
        assert got.default_factory is orig.default_factory
    if isinstance(orig, Tagged):
        assert got.tag == orig.tag


@pytest.mark.parametrize("name", list(_mappings()))
def test_scatter_keeps_mapping_type_keys_and_values(name):
    m = _mappings()[name]
    for top in (m, {"m": m}, (np.arange(4.0), m)):
        parts = dpmini.scatter(top, D2)
        assert len(parts) == 2
        for j, p in enumerate(parts):
            got = p if top is m else p["m"] if isinstance(top, dict) else p[1]
            has_array = any(isinstance(v, np.ndarray) for v in m.values())
            # rebuilt per replica even without arrays (PyTorch's rule)
            _check_same_mapping(got, m, j if has_array else None)


def test_scatter_counter_values_are_not_counted_as_keys():
    parts = dpmini.scatter({"x": np.zeros(4), "c": collections.Counter(a=3, b=1)}, D2)
    assert parts[0]["c"] == collections.Counter(a=3, b=1)
    c = collections.Counter(a=np.arange(4))
    parts = dpmini.scatter(c, D2)
    assert type(parts[1]) is collections.Counter
    np.testing.assert_array_equal(parts[1]["a"], [2, 3])


def test_scatter_defaultdict_is_accepted_with_its_factory():
    dd = collections.defaultdict(lambda: "missing", x=np.arange(4.0))
    parts = dpmini.scatter_kwargs((), {"d": dd}, D2)[1]
    for j in range(2):
        got = parts[j]["d"]
        assert type(got) is collections.defaultdict
        assert got.default_factory is dd.default_factory
        assert got["nope"] == "missing"
    np.testing.assert_array_equal(parts[0]["d"]["x"], [0.0, 1.0])


@pytest.mark.parametrize("name", list(_mappings()))
def test_gather_keeps_mapping_type_keys_and_values(name):
    m = _mappings()[name]
    outs = dpmini.scatter(m, D2) if any(isinstance(v, np.ndarray) for v in m.values()) \
        else [m, m]
    g = dpmini.gather(outs, "cpu")
    _check_same_mapping(g, m)


def test_gather_two_counters():
    g = dpmini.gather([collections.Counter(a=1), collections.Counter(a=1)], "cpu")
    assert type(g) is collections.Counter and g == collections.Counter(a=1)
    g = dpmini.gather([collections.Counter(a=np.ones(1)), collections.Counter(a=np.zeros(1))],
                      "cpu")
    np.testing.assert_array_equal(g["a"], [1.0, 0.0])


@pytest.mark.parametrize("name", list(_mappings()))
def test_replicate_keeps_mapping_type_keys_and_values(name):
    m = _mappings()[name]

    class Module:
        def __init__(self):
            self.m = m

        def __call__(self, x):
            return x

    reps = dpmini.replicate(Module(), D2)
    for r in reps:
        got = r.m
        assert type(got) is type(m) and list(got) == list(m)
        for k, v in m.items():
            if isinstance(v, np.ndarray):
                np.testing.assert_array_equal(got[k], v)
            else:
                assert got[k] is v
        if isinstance(m, collections.defaultdict):
            assert got.default_factory is m.default_factory


def test_dataparallel_with_mapping_inputs_and_outputs():
    dd = collections.defaultdict(int, x=np.arange(4.0))
    dp = dpmini.DataParallel(lambda d: collections.Counter(s=d["x"] * 2, n=d["missing"]), D2)
    g = dp(dd)
    assert type(g) is collections.Counter
    np.testing.assert_array_equal(g["s"], np.arange(4.0) * 2)
    assert g["n"] == 0


def test_mapping_whose_copy_fails_names_the_path():
    class NoCopy(dict):
        def __copy__(self):
            raise RuntimeError("no copies")

    with pytest.raises(TypeError) as info:
        dpmini.scatter({"a": NoCopy(x=np.zeros(4))}, D2)
    msg = str(info.value)
    assert msg.startswith("inputs['a']: cannot rebuild") and "no copies" in msg


# ----------------------------------------------------------------- dataclasses

CALLS = []


@dataclasses.dataclass
class Scaled:
    logits: object
    temperature: float = 2.0

    def __post_init__(self):
        CALLS.append("post_init")
        self.logits = self.logits / self.temperature


@dataclasses.dataclass(frozen=True)
class FrozenOut:
    logits: object
    steps: int = 0

    def __post_init__(self):
        CALLS.append("frozen_post_init")


@dataclasses.dataclass
class WithInitFalse:
    x: object
    derived: object = dataclasses.field(init=False)

    def __post_init__(self):
        self.derived = self.x.sum()


@dataclasses.dataclass
class Slotted:
    __slots__ = ("a", "b")
    a: object
    b: object


def test_gathered_dataclass_does_not_run_post_init_again():
    outs = [Scaled(np.array([2.0, 4.0])), Scaled(np.array([6.0]))]
    CALLS.clear()
    g = dpmini.gather(outs, "cpu")
    assert CALLS == []
    assert type(g) is Scaled
    np.testing.assert_array_equal(g.logits, [1.0, 2.0, 3.0])   # scaled once
    assert g.temperature == 2.0


def test_dataparallel_dataclass_scaled_once():
    dp = dpmini.DataParallel(lambda x: Scaled(x), D2)
    g = dp(np.arange(4.0))
    np.testing.assert_array_equal(g.logits, np.arange(4.0) / 2)


def test_gathered_frozen_dataclass():
    outs = [FrozenOut(np.zeros(1), 3), FrozenOut(np.ones(2), 3)]
    CALLS.clear()
    g = dpmini.gather(outs, "cpu")
    assert CALLS == [] and type(g) is FrozenOut
    np.testing.assert_array_equal(g.logits, [0.0, 1.0, 1.0])
    assert g.steps == 3
    with pytest.raises(dataclasses.FrozenInstanceError):
        g.steps = 4


def test_gathered_dataclass_init_false_field_and_slots():
    with pytest.warns(UserWarning, match="scalars"):   # derived: a NumPy scalar each
        g = dpmini.gather([WithInitFalse(np.ones(2)), WithInitFalse(np.ones(3))], "cpu")
    np.testing.assert_array_equal(g.x, np.ones(5))
    np.testing.assert_array_equal(g.derived, [2.0, 3.0])   # gathered, not recomputed
    g = dpmini.gather([Slotted(np.zeros(1), "s"), Slotted(np.ones(1), "s")], "cpu")
    assert type(g) is Slotted and g.b == "s"
    np.testing.assert_array_equal(g.a, [0.0, 1.0])


@dataclasses.dataclass
class DictOutput(dict):
    """A dataclass that is also a dict, like Hugging Face's ModelOutput."""
    loss: object = None
    logits: object = None

    def __post_init__(self):
        CALLS.append("dict_post_init")
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if v is not None:
                self[f.name] = v


def test_gathered_dict_dataclass_keeps_replica_0_keys():
    outs = [DictOutput(logits=np.zeros(1)), DictOutput(logits=np.ones(1))]
    CALLS.clear()
    g = dpmini.gather(outs, "cpu")
    assert CALLS == [] and type(g) is DictOutput
    assert list(g.keys()) == ["logits"] and g.loss is None
    np.testing.assert_array_equal(g["logits"], [0.0, 1.0])
    assert g["logits"] is g.logits


@dataclasses.dataclass
class OrderedDictOutput(collections.OrderedDict):
    """ModelOutput's own base: a dataclass that is an OrderedDict."""
    loss: object = None
    logits: object = None

    def __post_init__(self):
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if v is not None:
                self[f.name] = v


def test_gathered_ordered_dict_dataclass_is_a_whole_ordered_dict():
    outs = [OrderedDictOutput(logits=np.zeros(1), loss=np.ones(1)),
            OrderedDictOutput(logits=np.ones(1), loss=np.ones(1))]
    g = dpmini.gather(outs, "cpu")
    assert type(g) is OrderedDictOutput
    assert list(g.keys()) == ["loss", "logits"] and len(g) == 2
    assert g == collections.OrderedDict([("loss", g.loss), ("logits", g.logits)])
    g.move_to_end("loss")
    assert list(g) == ["logits", "loss"]
    np.testing.assert_array_equal(g["logits"], [0.0, 1.0])


# ------------------------------------------- namedtuples with tuples and lists

P = collections.namedtuple("P", "a b")


@pytest.mark.parametrize("other", [tuple, list])
def test_gather_namedtuple_first_then_plain_sequence(other):
    outs = [P(np.zeros(1), 5), other([np.ones(2), 5])]
    g = dpmini.gather(outs, "cpu")
    assert type(g) is P
    np.testing.assert_array_equal(g.a, [0.0, 1.0, 1.0])
    assert g.b == 5


@pytest.mark.parametrize("first", [tuple, list])
def test_gather_plain_sequence_first_then_namedtuple(first):
    outs = [first([np.zeros(1), 5]), P(np.ones(1), 5)]
    g = dpmini.gather(outs, "cpu")
    assert type(g) is first
    np.testing.assert_array_equal(g[0], [0.0, 1.0])


def test_gather_namedtuple_mix_still_checks_lengths():
    with pytest.raises(ValueError, match="different lengths"):
        dpmini.gather([P(np.zeros(1), 5), (np.ones(1),)], "cpu")
