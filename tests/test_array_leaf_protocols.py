"""The one definition of an array leaf (csrc/py/interop.c), without any other
array library installed: an object with __dlpack__ + __dlpack_device__ is
split, handed to the replicas in its own "library" (the from_dlpack of its
type's module) and gathered back into it; bytes/memoryview stay shared;
probing an object whose __getattr__ raises something other than
AttributeError is an error naming the object's path, as an argument and as a
module attribute (docs/design.md, "Arrays of other libraries")."""
import subprocess
import sys
import sys as _sys
import textwrap
import types

import numpy as np
import pytest

import dpmini

DEVS = ["cpu:0", "cpu:1"]


# ---- a tiny array library speaking DLPack (host memory) ------------------

fakelib = types.ModuleType("dpmini_test_fakelib")
_sys.modules["dpmini_test_fakelib"] = fakelib


class FakeArray:
    """Wraps an ndarray; exports it through DLPack only (no buffer protocol,
    no __array_interface__)."""

    def __init__(self, a):
        self._a = a

    def __dlpack__(self, **kw):
        return self._a.__dlpack__(**kw)

    def __dlpack_device__(self):
        return self._a.__dlpack_device__()

    @property
    def shape(self):
        return self._a.shape


FakeArray.__module__ = "dpmini_test_fakelib"


def _from_dlpack(x):
    return FakeArray(np.from_dlpack(x))


fakelib.from_dlpack = _from_dlpack
fakelib.FakeArray = FakeArray


def test_dlpack_objects_are_split_and_come_back_in_their_library():
    x = np.arange(12.0).reshape(6, 2)
    seen = []

    def replica(a):
        seen.append((type(a), a.shape))
        return FakeArray(a._a * 2)

    out = dpmini.DataParallel(replica, DEVS)(FakeArray(x))
    assert type(out) is FakeArray
    np.testing.assert_array_equal(out._a, x * 2)
    assert sorted(s[1] for s in seen) == [(3, 2), (3, 2)]
    assert all(s[0] is FakeArray for s in seen)


def test_shards_share_the_device_memory_dpmini_copied_into():
    x = np.arange(8.0)
    before = dpmini.memory_allocated("cpu:1")
    parts = dpmini.scatter(FakeArray(x), DEVS)
    assert [type(p) for p in parts] == [FakeArray, FakeArray]
    # the shard holds cpu:1's memory (a view of it, no other copy): the
    # block stays allocated while the shard lives and is freed with it
    assert dpmini.memory_allocated("cpu:1") >= before + 4 * 8
    assert parts[1]._a.ctypes.data % 64 == 0   # dpmini's block alignment
    np.testing.assert_array_equal(parts[1]._a, x[4:])
    del parts
    assert dpmini.memory_allocated("cpu:1") == before


def test_mixed_libraries_each_keep_their_type():
    x = np.arange(4.0)
    got = []
    dpmini.DataParallel(lambda a, b: got.append((type(a), type(b))) or a._a, DEVS)(
        FakeArray(x), x.copy())
    assert got == [(FakeArray, np.ndarray)] * 2


def test_gather_refuses_two_libraries_at_one_position():
    with pytest.raises(TypeError, match=r"out\['y'\].*different libraries.*FakeArray, ndarray"):
        dpmini.gather([{"y": FakeArray(np.ones(2))}, {"y": np.ones(2)}], "cpu")


def test_bytes_and_memoryview_stay_shared_leaves():
    b, m = b"abcd", memoryview(b"xy")
    parts = dpmini.scatter((np.arange(4.0), b, m), DEVS)
    assert all(p[1] is b and p[2] is m for p in parts)
    # comm still reads buffer objects
    assert [len(c) for c in dpmini.comm.scatter(b, DEVS)] == [2, 2]


def test_explain_names_the_library_and_device():
    plan = dpmini.explain((FakeArray(np.ones((4, 2))), np.ones(4)), DEVS)
    assert [leaf["library"] for leaf in plan.leaves] == [
        "dpmini_test_fakelib.FakeArray cpu", "numpy.ndarray cpu"]
    assert "[dpmini_test_fakelib.FakeArray cpu]" in str(plan)


# ---- probing that raises ---------------------------------------------------

class DictBacked:
    """A dict-backed config: __getattr__ raises KeyError for missing names."""

    def __init__(self, **kw):
        self.__dict__["_d"] = dict(kw)

    def __getattr__(self, name):
        return self.__dict__["_d"][name]


def test_probe_error_in_an_argument_names_its_path():
    with pytest.raises(KeyError) as e:
        dpmini.scatter((np.ones(4), {"cfg": DictBacked(a=1)}), DEVS)
    msg = str(e.value)
    assert msg.startswith("inputs[1]['cfg']: looking up __dlpack__ on a DictBacked object")
    assert "AttributeError" in msg and isinstance(e.value.__cause__, KeyError)
    with pytest.raises(KeyError, match=r"^args\[1\]: looking up __dlpack__"):
        dpmini.DataParallel(lambda *a: a[0], DEVS)(np.ones(4), DictBacked())
    with pytest.raises(KeyError, match=r"^kwargs\['c'\]: looking up"):
        dpmini.DataParallel(lambda x, c: x, DEVS)(np.ones(4), c=DictBacked())
    with pytest.raises(KeyError, match=r"^array: looking up __dlpack__"):
        dpmini.comm.scatter(DictBacked(), DEVS)


def test_probe_error_in_an_output_names_its_position():
    with pytest.raises(KeyError, match=r"^out\[1\]: looking up __dlpack__"):
        dpmini.gather([(np.ones(1), DictBacked()), (np.ones(1), DictBacked())], "cpu")


class Model:
    def __init__(self):
        self.w = np.ones(3)
        self.cfg = DictBacked(lr=0.1)

    def __call__(self, x):
        return x


def test_probe_error_in_a_module_attribute_names_its_path():
    with pytest.raises(KeyError) as e:
        dpmini.replicate(Model(), DEVS)
    assert str(e.value).startswith("module.cfg: looking up __dlpack__ on a DictBacked object")
    m = Model()
    m.layers = [{"inner": DictBacked()}]
    del m.cfg
    with pytest.raises(KeyError, match=r"^module\.layers\[0\]\['inner'\]: looking up"):
        dpmini.DataParallel(m, DEVS)(np.ones(4))


def test_attribute_error_means_not_an_array_and_is_shared():
    class Plain:
        def __getattr__(self, name):
            raise AttributeError(name)

    p = Plain()
    parts = dpmini.scatter((np.ones(4), p), DEVS)
    assert parts[0][1] is p and parts[1][1] is p
    m = Model()
    m.cfg = p
    reps = dpmini.replicate(m, DEVS)
    assert reps[0].cfg is p and reps[1].cfg is p


def test_keyboard_interrupt_from_a_probe_passes_unchanged():
    class Interrupting:
        def __getattr__(self, name):
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        dpmini.scatter((np.ones(4), Interrupting()), DEVS)


def test_probe_errors_never_crash_in_a_subprocess():
    code = textwrap.dedent("""
        import numpy as np, dpmini
        class C:
            def __getattr__(self, n): raise KeyError(n)
        class M:
            def __init__(self): self.w = np.ones(2); self.cfg = C()
            def __call__(self, x): return x
        for f in (lambda: dpmini.replicate(M(), ["cpu:0", "cpu:1"]),
                  lambda: dpmini.DataParallel(M(), ["cpu:0", "cpu:1"])(np.ones(4)),
                  lambda: dpmini.scatter(C(), ["cpu:0", "cpu:1"]),
                  lambda: dpmini.gather([C(), C()], "cpu")):
            try:
                f()
            except KeyError:
                pass
        print("ok")
    """)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "ok"


def test_probe_error_in_parallel_apply_device_guess_names_the_input():
    f = lambda *a: 1  # noqa: E731
    with pytest.raises(KeyError, match=r"^inputs\[1\]\[0\]: looking up __dlpack__"):
        dpmini.parallel_apply([f, f], [(np.ones(2),), (DictBacked(),)])


def test_getattr_answering_for_every_name_is_not_a_dlpack_exporter():
    class Namespace:
        def __getattr__(self, name):
            return None   # no AttributeError, but nothing callable either

    ns = Namespace()
    parts = dpmini.scatter((np.ones(4), ns), DEVS)
    assert parts[0][1] is ns and parts[1][1] is ns


# ---- containers first: dict, list and tuple subclasses are never probed ------

class AttrDict(dict):
    """Attribute access on a dict: missing attributes raise KeyError."""
    __getattr__ = dict.__getitem__


class AddictLike(dict):
    """addict-style: a missing key (and so any attribute) is a new empty
    instance, so getattr(obj, '__dlpack__') returns a dict, never raises."""

    def __missing__(self, key):
        return AddictLike()

    __getattr__ = dict.__getitem__


class AttrList(list):
    def __getattr__(self, name):
        raise KeyError(name)


@pytest.mark.parametrize("cls", [AttrDict, AddictLike])
def test_attribute_dicts_are_walked_as_dicts_as_inputs_and_outputs(cls):
    parts = dpmini.scatter((cls(x=np.arange(4.0)),), DEVS)
    assert type(parts[1][0]) is cls
    np.testing.assert_array_equal(parts[1][0]["x"], [2.0, 3.0])
    out = dpmini.DataParallel(lambda d: cls(y=d["x"] * 2), DEVS)(cls(x=np.arange(4.0)))
    assert type(out) is cls
    np.testing.assert_array_equal(out["y"], [0.0, 2.0, 4.0, 6.0])
    plan = dpmini.explain((cls(x=np.arange(4.0)),), DEVS)
    assert "['x']" in str(plan)


@pytest.mark.parametrize("cls", [AttrDict, AddictLike])
def test_attribute_dict_module_attribute_is_replicated_as_a_dict(cls):
    class M:
        def __init__(self):
            self.cfg = cls(scale=2.0, w=np.ones(2))

        def __call__(self, x):
            return x * self.cfg["scale"]

    m = M()
    reps = dpmini.replicate(m, DEVS)
    assert type(reps[1].cfg) is cls and reps[1].cfg["w"] is not m.cfg["w"]
    np.testing.assert_array_equal(dpmini.DataParallel(m, DEVS)(np.arange(4.0)),
                                  [0.0, 2.0, 4.0, 6.0])


def test_list_subclass_with_a_raising_getattr_is_walked_as_a_list():
    parts = dpmini.scatter((AttrList([np.arange(4.0)]),), DEVS)
    np.testing.assert_array_equal(parts[1][0][0], [2.0, 3.0])
    g = dpmini.gather([AttrList([np.ones(1)]), AttrList([np.ones(1)])], "cpu")
    np.testing.assert_array_equal(g[0], [1.0, 1.0])


def test_attribute_dict_in_dims_and_out_dims_walk_as_dicts():
    out = dpmini.DataParallel(lambda d: d, DEVS, in_dims=(AttrDict(x=0),),
                              out_dims=AttrDict(x=0))(AttrDict(x=np.arange(4.0)))
    np.testing.assert_array_equal(out["x"], np.arange(4.0))


def test_getattr_returning_a_dict_for_dlpack_is_not_an_array():
    class AnswersDicts:
        def __getattr__(self, name):
            return {}

    obj = AnswersDicts()
    parts = dpmini.scatter((np.arange(4.0), obj), DEVS)
    assert parts[0][1] is obj and parts[1][1] is obj
