"""Regression tests for the findings of review 1 (f01-f20), one section per
finding. Crash-prone and thread checks run in a subprocess with a timeout, so
a segfault or a deadlock fails the test instead of killing or hanging the
suite."""
import subprocess
import sys
import textwrap

import numpy as np
import pytest

import dpmini

D2 = ["cpu:0", "cpu:1"]
TIMEOUT = 60


def run_script(body, timeout=TIMEOUT):
    code = textwrap.dedent(body)
    try:
        res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                             timeout=timeout)
    except subprocess.TimeoutExpired:
        pytest.fail(f"deadlock or hang: the script did not finish in {timeout}s")
    assert res.returncode == 0, f"rc {res.returncode}\n" + res.stdout + res.stderr
    assert res.stdout.strip().endswith("OK"), res.stdout + res.stderr
    return res


# --- f01-f03: a call keeps its own module reference and device list ----------

def test_f01_module_reassigned_during_call_keeps_the_old_module():
    run_script("""
        import numpy as np, dpmini
        class Mod:
            def __init__(s): s.w = np.full(3, 2.0)
            def __call__(s, d): return d["x"] * s.w[0]
        dp = dpmini.DataParallel(Mod(), ["cpu:0", "cpu:1"])
        class Sneaky(dict):
            def items(self):
                dp.module = abs                  # drops the last ref to Mod()
                junk = [bytearray(b"\\xff" * 48) for _ in range(1000)]
                return super().items()
        y = dp(Sneaky(x=np.ones((4, 3))))
        assert np.array_equal(y, np.full((4, 3), 2.0)), y
        assert dp.module is abs
        print("OK")
    """)


def test_f02_device_ids_reassigned_during_call_uses_the_old_devices():
    run_script("""
        import numpy as np, dpmini
        seen = []
        class Mod:
            def __init__(s): s.w = np.full(3, 2.0)
            def __call__(s, d):
                seen.append(str(dpmini.device_of(d["x"])))
                return d["x"] * s.w[0]
        dp = dpmini.DataParallel(Mod(), ["cpu:0", "cpu:1"])
        class Sneaky(dict):
            def items(self):
                dp.device_ids = ["cpu:7"]
                junk = [Mod() for _ in range(100)]
                return super().items()
        y = dp(Sneaky(x=np.ones((4, 3))))
        assert np.array_equal(y, np.full((4, 3), 2.0)), y
        assert sorted(seen) == ["cpu:0", "cpu:1"], seen
        assert [str(d) for d in dp.device_ids] == ["cpu:7"]
        print("OK")
    """)


def test_f01_subclass_forward_replicates_the_module_of_call_start():
    run_script("""
        import numpy as np, dpmini
        class DP(dpmini.DataParallel):
            def scatter(self, inputs, kwargs, device_ids):
                self.module = abs                # reassign between the steps
                return super().scatter(inputs, kwargs, device_ids)
            def replicate(self, module, device_ids):
                assert module is not abs
                assert [str(d) for d in device_ids] == ["cpu:0", "cpu:1"], device_ids
                return super().replicate(module, device_ids)
        dp = DP(lambda x: x + 1, ["cpu:0", "cpu:1"])
        assert np.array_equal(dp(np.zeros(4)), np.ones(4))
        print("OK")
    """)


def test_f03_module_hot_swapped_from_another_thread():
    run_script("""
        import numpy as np, dpmini, threading, time
        class Mod:
            def __init__(s, v): s.w = np.full(3, v); s.junk = [np.ones(2) for _ in range(3)]
            def __call__(s, x): return x * s.w[0]
        dp = dpmini.DataParallel(Mod(1.0), ["cpu:0", "cpu:1"])
        x = np.ones((100000, 3))            # > 256 KiB: copies release the GIL
        stop = False
        def caller():
            while not stop:
                dp(x)
        def swapper():
            i = 0
            while not stop:
                i += 1
                dp.module = Mod(float(i))
                dp.device_ids = ["cpu:%d" % (i % 3), "cpu:3"]
        ts = [threading.Thread(target=caller), threading.Thread(target=swapper)]
        [t.start() for t in ts]; time.sleep(1.5); stop = True; [t.join() for t in ts]
        print("OK")
    """)


# --- f04-f06: out= that overlaps a source, or itself ------------------------

def test_f04_gather_out_overlapping_an_input_is_refused():
    buf = np.arange(10.0)
    with pytest.raises(ValueError, match=r"^out: .*arrays\[1\]"):
        dpmini.comm.gather([np.arange(2.0), buf[4:8]], out=buf[2:8])
    assert np.array_equal(buf, np.arange(10.0))          # nothing written
    # disjoint memory of the same buffer is fine
    parts = [buf[0:2], buf[2:4]]
    got = dpmini.comm.gather(parts, out=buf[6:10])
    assert np.array_equal(got, [0, 1, 2, 3]) and got.base is buf


def test_f05_scatter_out_overlapping_the_source_is_refused():
    a = np.arange(8.0)
    with pytest.raises(ValueError, match=r"^out\[0\]: .*memory of array"):
        dpmini.comm.scatter(a, out=[a[4:], a[:4]])
    b = np.zeros(8)
    with pytest.raises(ValueError, match=r"^out\[1\]: .*memory of out\[0\]"):
        dpmini.comm.scatter(a, out=[b[:4], b[2:6]])
    r = dpmini.comm.scatter(a, out=[b[:4], b[4:]])
    assert np.array_equal(b, a) and r[0].base is b


def test_f06_broadcast_out_overlapping_the_source_is_refused():
    a = np.arange(12.0)
    with pytest.raises(ValueError, match=r"^out\[0\]: .*memory of array"):
        dpmini.comm.broadcast(a[0:6], out=[a[1:12:2]])


@pytest.mark.parametrize("fn", ["gather", "scatter", "broadcast"])
def test_f06_zero_stride_or_self_overlapping_out_is_refused(fn):
    z = np.lib.stride_tricks.as_strided(np.zeros(1), shape=(4,), strides=(0,))
    rows = np.lib.stride_tricks.as_strided(np.zeros(8), shape=(3, 4), strides=(16, 8))
    for bad, src in [(z, np.arange(4.0)), (rows, np.ones((3, 4)))]:
        with pytest.raises(ValueError, match=r"more than one element of the written-to"):
            if fn == "gather":
                dpmini.comm.gather([src], out=bad)
            elif fn == "scatter":
                dpmini.comm.scatter(src, out=[bad])
            else:
                dpmini.comm.broadcast(src, out=[bad])


def test_f06_sliced_and_transposed_out_still_accepted():
    x = np.arange(24.0).reshape(4, 6)
    big = np.zeros((12, 8))
    out = big[::3, ::-1][:, 1:7]                  # strided, negative, a view
    dpmini.comm.broadcast(x, out=[out])
    assert np.array_equal(out, x)
    outT = np.zeros((6, 4)).T
    assert np.array_equal(dpmini.comm.gather([x[:2], x[2:]], out=outT), x)


# --- f07: a device has more than one thread to wait on -----------------------

def test_f07_replica_handing_work_to_a_helper_thread_does_not_deadlock():
    run_script("""
        import numpy as np, dpmini
        from concurrent.futures import ThreadPoolExecutor
        ex = ThreadPoolExecutor(1)
        big = np.ones(100000)               # > 256 KiB: goes to the device workers
        def replica(x):
            f = ex.submit(dpmini.comm.broadcast, big, ["cpu:0", "cpu:1"])
            return x + f.result()[1][:1]
        y = dpmini.DataParallel(replica, ["cpu:0", "cpu:1"])(np.ones(4))
        assert np.array_equal(y, np.full(4, 2.0)), y
        print("OK")
    """, timeout=30)


def test_f07_replicas_on_a_repeated_device_run_concurrently():
    run_script("""
        import threading, numpy as np, dpmini
        barrier = threading.Barrier(2, timeout=10)   # each replica waits for the other
        def replica(x):
            barrier.wait()
            return x * 2
        y = dpmini.DataParallel(replica, ["cpu:0", "cpu:0"])(np.arange(4.0))
        assert np.array_equal(y, np.arange(4.0) * 2), y
        print("OK")
    """, timeout=30)


# --- f08-f10: ndarray subclasses and object-dtype arrays ---------------------

def test_f08_masked_array_is_refused_with_its_path():
    ma = np.ma.masked_array([1.0, 2.0, 1e9, 4.0], mask=[0, 0, 1, 0])
    dp = dpmini.DataParallel(lambda x: x, D2)
    with pytest.raises(TypeError, match=r"^args\[0\]: numpy\.ma\.MaskedArray .*\.filled"):
        dp(ma)
    with pytest.raises(TypeError, match=r"^kwargs\['m'\]: numpy\.ma\.MaskedArray"):
        dp(np.ones(4), m=ma)
    with pytest.raises(TypeError, match=r"^array: numpy\.ma\.MaskedArray"):
        dpmini.comm.scatter(ma, D2)
    with pytest.raises(TypeError, match=r"^out: numpy\.ma\.MaskedArray"):
        dpmini.DataParallel(lambda x: np.ma.masked_array(x), D2)(np.ones(4))
    assert np.array_equal(dp(ma.filled(0.0)), [1, 2, 0, 4])


def test_f09_matrix_is_refused_other_subclasses_become_plain_arrays(tmp_path):
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", PendingDeprecationWarning)
        m = np.matrix([[1.0, 2], [3, 4]])
    with pytest.raises(TypeError, match=r"^inputs: numpy\.matrix .*np\.asarray"):
        dpmini.scatter(m, D2)
    with pytest.raises(TypeError, match=r"^obj: numpy\.matrix"):
        dpmini.asarray(m, "cpu:1")
    rec = np.rec.array([(1, 2.0), (3, 4.0)], dtype=[("a", "i4"), ("b", "f8")])
    chunks = dpmini.scatter(rec, D2)
    assert [type(c) for c in chunks] == [np.ndarray, np.ndarray]
    assert np.array_equal(dpmini.DataParallel(lambda r: r["a"], D2)(rec), [1, 3])
    mm = np.memmap(tmp_path / "mm.dat", dtype="f8", mode="w+", shape=(4, 3))
    mm[:] = 7.0
    out = dpmini.DataParallel(lambda x: x + 1, D2)(mm)
    assert type(out) is np.ndarray and np.array_equal(out, np.full((4, 3), 8.0))

    class Mine(np.ndarray):
        pass
    x = np.arange(6.0).reshape(3, 2).view(Mine)
    assert all(type(c) is np.ndarray for c in dpmini.comm.scatter(x, D2))
    assert type(dpmini.comm.gather([x, x])) is np.ndarray


def test_f10_object_array_held_by_a_module_is_shared():
    class Clf:
        def __init__(s):
            s.w = np.ones((3, 2))
            s.w[:, 1] = 2
            s.labels = np.array(["cat", "dog"], dtype=object)
        def __call__(s, x):
            assert str(dpmini.device_of(s.w)) == str(dpmini.device_of(x))
            return s.labels[(x @ s.w).argmax(1)].astype(str)
    clf = Clf()
    reps = dpmini.replicate(clf, D2)
    assert reps[1].labels is clf.labels and reps[1].w is not clf.w
    out = dpmini.DataParallel(clf, D2)(np.ones((4, 3)))
    assert out.tolist() == ["dog"] * 4


def test_f10_object_array_input_is_still_a_type_error_naming_the_path():
    objs = np.array([object(), object()], dtype=object)
    with pytest.raises(TypeError, match=r"^kwargs\['x'\]: arrays holding Python objects"):
        dpmini.DataParallel(lambda x: x, D2)(x=objs)


# --- f11: a replica's KeyError pickles ---------------------------------------

def test_f11_wrapped_keyerror_pickles_and_keeps_its_text():
    import pickle

    def f(x):
        raise KeyError("k")
    with pytest.raises(KeyError) as info:
        dpmini.DataParallel(f, D2)(np.ones(4))
    e = info.value
    assert type(e.args[0]) is dpmini._dpmini._KeyErrorMessage
    assert dpmini._dpmini._KeyErrorMessage.__module__ == "dpmini._dpmini"
    assert str(e).startswith("Caught KeyError in replica 0 on device cpu:0.\nOriginal Traceback")
    back = pickle.loads(pickle.dumps(e))
    assert type(back) is KeyError and str(back) == str(e)


# --- f12: Device hash agrees with its string equality ------------------------

def test_f12_device_hash_equals_hash_of_its_spelling():
    for spec in ["cpu", "cpu:0", "cpu:1", "cpu:255"]:
        d = dpmini.Device(spec)
        assert d == spec and hash(d) == hash(spec) == hash(str(d))
    assert "cpu:1" in {dpmini.Device("cpu:1")}
    assert {"cpu:1": 1}[dpmini.Device("cpu:1")] == 1
    assert dpmini.Device(-1) == "cpu" and hash(dpmini.Device(-1)) == hash("cpu")
    assert dpmini.Device("cpu:1") != "cpu:01"       # only the canonical spelling


# --- f13: signatures and the dpmini.comm submodule ---------------------------

COMM_NAMES = ["scatter", "gather", "broadcast", "broadcast_coalesced", "reduce_add",
              "reduce_add_coalesced"]


@pytest.mark.parametrize("name", COMM_NAMES)
def test_f13_comm_functions_have_signatures_and_names(name):
    import inspect
    import pickle
    fn = getattr(dpmini.comm, name)
    assert fn is getattr(dpmini._dpmini.comm, name)
    assert fn.__name__ == name and fn.__module__ == "dpmini.comm"
    sig = inspect.signature(fn)
    assert list(sig.parameters)[0] in ("array", "arrays", "per_device")
    assert "--" not in fn.__doc__.splitlines()[:2]
    assert "Raises" in fn.__doc__
    assert pickle.loads(pickle.dumps(fn)) is fn


def test_f13_every_public_function_has_a_signature():
    import inspect
    for name in dpmini.__all__:
        obj = getattr(dpmini, name)
        if callable(obj) and not isinstance(obj, type):
            inspect.signature(obj)
    for meth in ["forward", "scatter", "replicate", "parallel_apply", "gather"]:
        inspect.signature(getattr(dpmini.DataParallel, meth))
    assert list(inspect.signature(dpmini.asarray).parameters) == ["obj", "device"]
    assert "Rule source" in dpmini.asarray.__doc__
    assert "Rule source" in dpmini.device_of.__doc__
    assert "Errors" in dpmini.DataParallel.replicate.__doc__
    assert "Errors" in dpmini.DataParallel.parallel_apply.__doc__
    assert "TypeError when module is not callable" in dpmini.data_parallel.__doc__


# --- f18 and DPMINI_CACHE_LIMIT: environment variables ----------------------

@pytest.mark.parametrize("value", ["300", "0", "abc", "4x"])
def test_f18_invalid_cpu_devices_env_warns(value):
    res = run_script(f"""
        import os, warnings
        os.environ["DPMINI_CPU_DEVICES"] = {value!r}
        import dpmini
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            n = dpmini.cpu_device_count()
            dp = dpmini.DataParallel(abs)
        msgs = [str(x.message) for x in w if x.category is RuntimeWarning]
        assert len(msgs) == 2, msgs
        assert "DPMINI_CPU_DEVICES={value}" in msgs[0] and f"using {{n}}" in msgs[0], msgs
        assert len(dp.device_ids) == n >= 2
        print("OK")
    """)


def test_f18_valid_cpu_devices_env_is_silent():
    run_script("""
        import os, warnings
        os.environ["DPMINI_CPU_DEVICES"] = "3"
        warnings.simplefilter("error")
        import dpmini
        assert dpmini.cpu_device_count() == 3
        print("OK")
    """)


def test_cache_limit_env_caps_the_cache():
    run_script("""
        import os, warnings
        os.environ["DPMINI_CACHE_LIMIT"] = "0"
        import numpy as np, dpmini
        a = dpmini.asarray(np.ones(1000), "cpu:5")
        del a
        assert dpmini.memory_reserved("cpu:5") == 0
        print("OK")
    """)
    run_script("""
        import os, warnings
        os.environ["DPMINI_CACHE_LIMIT"] = "lots"
        import numpy as np, dpmini
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            a = dpmini.asarray(np.ones(1000), "cpu:5")
        assert any("DPMINI_CACHE_LIMIT=lots" in str(x.message) for x in w), w
        del a
        assert dpmini.memory_reserved("cpu:5") > 0     # the default still caches
        print("OK")
    """)


# --- f14: README's API table uses the real parameter names --------------------

def test_f14_readme_api_table_matches_the_signatures():
    import inspect
    import re
    from pathlib import Path
    readme = (Path(__file__).resolve().parent.parent / "README.md").read_text()
    checked = 0
    for name in ["DataParallel", "data_parallel", "scatter", "scatter_kwargs", "gather",
                 "replicate", "parallel_apply", "explain"]:
        for m in re.finditer(r"`%s\(([^`]*)\)`" % name, readme):
            assert m.group(1) == str(inspect.signature(getattr(dpmini, name)))[1:-1], m.group(0)
            checked += 1
    assert checked >= 8


# --- f15: messages name the argument; buffers read as memoryviews -------------

def test_f15_reduce_add_refuses_mixed_and_structured_dtypes():
    with pytest.raises(TypeError, match=r"^arrays\[1\]: expected dtype int64 .*got float64"):
        dpmini.comm.reduce_add([np.arange(3), np.ones(3) / 2])
    with pytest.raises(TypeError, match=r"^arrays: arrays of dtype .* cannot be summed"):
        dpmini.comm.reduce_add([np.zeros(2, "i4,f8")] * 2)
    assert np.array_equal(dpmini.comm.reduce_add([np.arange(3)] * 2), [0, 2, 4])


def test_f15_argument_errors_name_the_argument():
    with pytest.raises(ValueError, match=r"^chunk_sizes\[0\]: .* out of range"):
        dpmini.comm.scatter(np.ones(5), D2, chunk_sizes=[2**70, 3])
    with pytest.raises(TypeError, match=r"^out: expected a sequence of arrays"):
        dpmini.comm.scatter(np.ones(4), out=np.zeros(4))
    with pytest.raises(ValueError, match=r"^obj: "):
        dpmini.asarray([[1], [1, 2]], "cpu:1")


@pytest.mark.parametrize("make", [lambda: b"abcdef", lambda: bytearray(b"abcdef"),
                                  lambda: memoryview(b"abcdef")])
def test_f15_bytes_like_objects_are_uint8_vectors(make):
    chunks = dpmini.comm.scatter(make(), D2)
    assert [c.tolist() for c in chunks] == [[97, 98, 99], [100, 101, 102]]
    assert chunks[0].dtype == np.uint8
    assert dpmini.asarray(make()).shape == (6,)


def test_f15_array_array_keeps_its_type():
    import array
    a = array.array("d", [1.0, 2.0, 3.0, 4.0])
    chunks = dpmini.comm.scatter(a, D2)
    assert chunks[0].dtype == np.float64 and chunks[1].tolist() == [3.0, 4.0]


# --- f16: an __array_interface__ getter's own error propagates ----------------

@pytest.mark.parametrize("attr", ["__array_interface__", "__array_struct__"])
def test_f16_array_interface_getter_errors_propagate(attr):
    class Boom(Exception):
        pass

    def getter(self):
        raise Boom("from the getter")
    Raises = type("Raises", (), {attr: property(getter)})
    with pytest.raises(Boom):
        dpmini.comm.scatter(Raises(), D2)
    with pytest.raises(Boom):
        dpmini.asarray(Raises(), "cpu:1")

    class NoAttr:
        pass
    with pytest.raises(TypeError, match=r"^array: expected an array"):
        dpmini.comm.scatter(NoAttr(), D2)


def test_f16_namedtuple_probe_errors_propagate_in_replicate():
    class Meta(type):
        def __getattribute__(cls, name):
            if name == "_fields":
                raise RuntimeError("probe")
            return super().__getattribute__(name)

    class Odd(tuple, metaclass=Meta):
        pass

    class Mod:
        def __init__(s):
            s.t = Odd((np.ones(2),))
        def __call__(s, x):
            return x
    with pytest.raises(RuntimeError, match="probe"):
        dpmini.replicate(Mod(), D2)


# --- f17: NaN outputs count as one value ---------------------------------------

def test_f17_nan_outputs_are_equal_values():
    import math
    out = dpmini.DataParallel(lambda x: float("nan"), D2)(np.ones(4))
    assert math.isnan(out)
    out = dpmini.DataParallel(lambda x: complex(float("nan"), 1.0), D2)(np.ones(4))
    assert math.isnan(out.real) and out.imag == 1.0
    with pytest.raises(TypeError, match="different values"):
        dpmini.DataParallel(lambda x: complex(float("nan"), float(x[0])), D2)(np.arange(4.0))
    with pytest.raises(TypeError, match="different values"):
        dpmini.DataParallel(lambda x: float("nan") if x[0] == 0 else 1.0, D2)(np.arange(4.0))


# --- f19: DataParallel copies and pickles; SplitWarning wording ---------------

class _Scale:
    def __init__(self, s):
        self.s = np.full(1, s)

    def __call__(self, x):
        return x * self.s[0]


class _TaggedDP(dpmini.DataParallel):
    pass


def test_f19_dataparallel_pickles_and_copies():
    import copy
    import pickle
    dp = _TaggedDP(_Scale(3.0), ["cpu:2", "cpu:1"], output_device="cpu", dim=-1, strict=True)
    dp.tag = "hello"
    for clone in [pickle.loads(pickle.dumps(dp)), copy.copy(dp), copy.deepcopy(dp)]:
        assert type(clone) is _TaggedDP and clone is not dp
        assert [str(d) for d in clone.device_ids] == ["cpu:2", "cpu:1"]
        assert str(clone.output_device) == "cpu"
        assert clone.dim == -1 and clone.strict is True and clone.tag == "hello"
        assert np.array_equal(clone(np.ones((2, 4))), np.full((2, 4), 3.0))
    assert copy.copy(dp).module is dp.module
    assert copy.deepcopy(dp).module is not dp.module
    plain = dpmini.DataParallel(abs, D2)
    back = pickle.loads(pickle.dumps(plain))
    assert back.module is abs and str(back.output_device) == "cpu:0"
    with pytest.raises(RuntimeError, match="__init__"):
        _TaggedDP.__new__(_TaggedDP).__reduce__()


def test_f19_split_warning_says_rows_only_along_dim_0():
    dp = dpmini.DataParallel(lambda a, b: a, ["cpu:0", "cpu:1", "cpu:2"], dim=1)
    with pytest.warns(dpmini.SplitWarning) as rec:
        dp(np.ones((2, 3)), np.ones((2, 2)))
    msg = str(rec[0].message)
    assert "index 2 of 3 along dim 1 is dropped" in msg and "row" not in msg, msg
    dp0 = dpmini.DataParallel(lambda a, b: a, ["cpu:0", "cpu:1", "cpu:2"])
    with pytest.warns(dpmini.SplitWarning) as rec:
        dp0(np.ones((5, 1)), np.ones((2, 1)))
    assert "row 4 of 5 along dim 0 is dropped" in str(rec[0].message)


# --- f20: replicate walks __slots__ -----------------------------------------

class _SlotBase:
    __slots__ = ("__w", "unset")

    def __init__(self):
        self.__w = np.ones(3)

    @property
    def w(self):
        return self.__w


class _SlotChild(_SlotBase):
    __slots__ = ("layers", "__dict__")

    def __init__(self):
        super().__init__()
        self.layers = [np.zeros(2), "name"]
        self.bias = np.full(2, 5.0)

    def __call__(self, x):
        devs = {str(dpmini.device_of(a)) for a in (self.w, self.layers[0], self.bias)}
        assert devs == {str(dpmini.device_of(x))}, devs
        return x + self.w[0]


def test_f20_replicate_broadcasts_arrays_held_in_slots():
    m = _SlotChild()
    reps = dpmini.replicate(m, D2)
    assert str(dpmini.device_of(reps[1].w)) == "cpu:1"
    assert str(dpmini.device_of(reps[1].layers[0])) == "cpu:1"
    assert reps[1].layers[1] == "name" and str(dpmini.device_of(reps[1].bias)) == "cpu:1"
    assert not hasattr(reps[1], "unset")
    assert m.w.base is None or str(dpmini.device_of(m.w)) == "cpu"   # original untouched
    assert np.array_equal(dpmini.DataParallel(m, D2)(np.zeros(4)), np.ones(4))


def test_f20_slots_only_object_without_arrays_is_shared():
    class Plain:
        __slots__ = ("k",)

        def __init__(self):
            self.k = 3

        def __call__(self, x):
            return x
    p = Plain()
    assert all(r is p for r in dpmini.replicate(p, D2))
