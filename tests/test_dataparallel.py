"""dpmini.DataParallel, data_parallel, replicate, parallel_apply (docs/spec.md 1, 2,
5, 6; design "DataParallel")."""
import threading

import numpy as np
import pytest

import dpmini

from conftest import cpu_devices, torch_chunk_sizes


def dev(a):
    return str(dpmini.device_of(a))


class Identity:
    """Returns its only positional argument; records (device, thread, shape) per call."""

    def __init__(self):
        self.calls = []
        self._lock = threading.Lock()

    def __call__(self, x):
        with self._lock:
            self.calls.append((dev(x), threading.get_ident(), x.shape))
        return x


# ------------------------------------------------------------- round trips

SHAPES_DIMS = [
    ((8,), 0), ((5,), 0), ((1,), 0), ((7, 3), 0), ((7, 3), 1), ((7, 3), -1), ((7, 3), -2),
    ((2, 9, 4), 1), ((2, 9, 4), 2), ((3, 4, 5, 6), 3), ((3, 4, 5, 6), -3), ((13, 2), 0),
    ((0, 3), 0), ((4, 0), 0),
]
DEVICE_LISTS = [
    ["cpu:0", "cpu:1"], ["cpu:1", "cpu:0"], ["cpu:0", "cpu:1", "cpu:2"],
    ["cpu:3", "cpu:1", "cpu:2", "cpu:0"], cpu_devices(6), ["cpu:0", "cpu:0"], ["cpu:2", "cpu:5"],
]


@pytest.mark.parametrize("shape,dim", SHAPES_DIMS, ids=str)
@pytest.mark.parametrize("devices", DEVICE_LISTS, ids=lambda d: ",".join(d))
def test_identity_round_trip(shape, dim, devices):
    x = np.arange(int(np.prod(shape)), dtype=np.float64).reshape(shape)
    m = Identity()
    dp = dpmini.DataParallel(m, device_ids=devices, dim=dim)
    out = dp(x)
    assert out.shape == x.shape and out.dtype == x.dtype
    np.testing.assert_array_equal(out, x)
    assert dev(out) == devices[0]  # output_device defaults to device_ids[0]
    n = x.shape[dim]
    sizes = torch_chunk_sizes(n, len(devices))
    wdim = dim % x.ndim
    got = sorted((d, s[wdim]) for d, _, s in m.calls)
    assert got == sorted(zip(devices, sizes))


def test_spec_0_4_reversed_device_order_puts_first_rows_on_cpu1():
    x = np.arange(4.0)
    seen = {}
    dpmini.DataParallel(lambda x: seen.__setitem__(dev(x), x.tolist()) or x,
                        device_ids=["cpu:1", "cpu:0"])(x)
    assert seen == {"cpu:1": [0.0, 1.0], "cpu:0": [2.0, 3.0]}
    out = dpmini.DataParallel(Identity(), device_ids=["cpu:1", "cpu:0"])(x)
    np.testing.assert_array_equal(out, x)
    assert dev(out) == "cpu:1"


def test_repeated_device_ids_round_trip():
    seen = []
    x = np.arange(6.0).reshape(3, 2)
    out = dpmini.DataParallel(lambda x: seen.append((dev(x), x.shape[0])) or x,
                              device_ids=["cpu:0", "cpu:0"])(x)
    assert sorted(seen) == [("cpu:0", 1), ("cpu:0", 2)]
    np.testing.assert_array_equal(out, x)


def test_batch_5_on_4_devices_uses_3_replicas(dev4):
    m = Identity()
    x = np.arange(15.0).reshape(5, 3)
    out = dpmini.DataParallel(m, device_ids=dev4)(x)
    assert len(m.calls) == 3
    assert sorted(d for d, _, _ in m.calls) == ["cpu:0", "cpu:1", "cpu:2"]
    assert sorted(s for _, _, s in m.calls) == [(1, 3), (2, 3), (2, 3)]
    # on worker threads, never the caller's (one worker may run several tiny
    # replicas one after another: docs/differences.md)
    assert threading.get_ident() not in {t for _, t, _ in m.calls}
    np.testing.assert_array_equal(out, x)


def test_replicas_run_concurrently(dev3):
    # every replica waits until all three have started: only possible when they run at once
    barrier = threading.Barrier(3, timeout=20)

    def f(x):
        barrier.wait()
        return x

    out = dpmini.DataParallel(f, device_ids=dev3)(np.arange(3.0))
    np.testing.assert_array_equal(out, np.arange(3.0))


def test_no_argument_call_runs_once(dev3):
    calls = []

    def f():
        calls.append(threading.get_ident())
        return np.arange(3.0)

    out = dpmini.DataParallel(f, device_ids=dev3)()
    assert len(calls) == 1
    np.testing.assert_array_equal(out, np.arange(3.0))
    assert dev(out) == "cpu:0"  # gathered to output_device


def test_no_argument_call_output_device_cpu(dev2):
    out = dpmini.DataParallel(lambda: np.ones(2), device_ids=dev2, output_device="cpu")()
    assert dev(out) == "cpu"


def test_single_device_calls_module_directly_no_gather():
    m = Identity()
    x = np.arange(6.0).reshape(3, 2)
    out = dpmini.DataParallel(m, device_ids=["cpu:1"], output_device="cpu")(x)
    assert len(m.calls) == 1
    assert m.calls[0][0] == "cpu:1"
    np.testing.assert_array_equal(out, x)
    assert dev(out) == "cpu:1"  # not moved to output_device (docs/spec.md 2.5)


def test_single_device_called_in_caller_thread():
    m = Identity()
    dpmini.DataParallel(m, device_ids=["cpu:0"])(np.arange(2.0))
    assert m.calls[0][1] == threading.get_ident()


def test_single_device_zero_dim_output_stays_zero_dim():
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out = dpmini.DataParallel(lambda x: np.asarray(x.sum()), device_ids=["cpu:0"])(np.arange(4.0))
    assert out.ndim == 0
    assert float(out) == 6.0


def test_single_device_returns_non_gatherable_output_as_is():
    # no gather on the single-device path: any object comes back unchanged
    marker = object()
    out = dpmini.DataParallel(lambda x: (marker, x.shape), device_ids=["cpu:0"])(np.arange(4.0))
    assert out[0] is marker and out[1] == (4,)


def test_output_device_default_vs_cpu(dev2):
    x = np.arange(8.0).reshape(4, 2)
    out_default = dpmini.DataParallel(lambda x: x + 1, device_ids=dev2)(x)
    out_cpu = dpmini.DataParallel(lambda x: x + 1, device_ids=dev2, output_device="cpu")(x)
    out_1 = dpmini.DataParallel(lambda x: x + 1, device_ids=dev2, output_device="cpu:1")(x)
    out_7 = dpmini.DataParallel(lambda x: x + 1, device_ids=dev2, output_device="cpu:7")(x)
    assert dev(out_default) == "cpu:0"
    assert dev(out_cpu) == "cpu"
    assert dev(out_1) == "cpu:1"
    assert dev(out_7) == "cpu:7"
    for o in (out_default, out_cpu, out_1, out_7):
        np.testing.assert_array_equal(o, x + 1)


def test_input_on_device_matches_input_on_host(dev2):
    # The result is the same whether the input starts on the host or on cpu:0
    x = np.random.default_rng(0).standard_normal((6, 4))
    f = lambda x: x * 3 - 1  # noqa: E731
    a = dpmini.DataParallel(f, device_ids=dev2)(x)
    b = dpmini.DataParallel(f, device_ids=dev2)(dpmini.asarray(x, "cpu:0"))
    c = dpmini.DataParallel(f, device_ids=dev2)(dpmini.asarray(x, "cpu:5"))
    assert a.tobytes() == b.tobytes() == c.tobytes()
    assert dev(a) == dev(b) == dev(c) == "cpu:0"


def test_device_ids_not_starting_at_0():
    seen = {}
    x = np.arange(6.0)
    out = dpmini.DataParallel(lambda x: seen.__setitem__(dev(x), x.tolist()) or x,
                              device_ids=["cpu:3", "cpu:2"])(dpmini.asarray(x, "cpu:3"))
    assert seen == {"cpu:3": [0.0, 1.0, 2.0], "cpu:2": [3.0, 4.0, 5.0]}
    assert dev(out) == "cpu:3"


def test_no_allocation_on_devices_not_in_device_ids():
    others = [f"cpu:{i}" for i in range(16) if i not in (7, 8)]
    before = [dpmini.memory_allocated(d) for d in others]
    used7, used8 = dpmini.memory_allocated("cpu:7"), dpmini.memory_allocated("cpu:8")
    x = np.ones((6, 1000))
    held = []
    out = dpmini.DataParallel(lambda x: held.append(x) or x * 1, device_ids=["cpu:8", "cpu:7"])(x)
    assert [dpmini.memory_allocated(d) for d in others] == before
    # each device holds its own chunk (the replicas' x * 1 are gone after the gather),
    # cpu:8 the gathered output too; a block is its size class (at most 1/4 more)
    chunk = 3 * 1000 * 8
    assert chunk <= dpmini.memory_allocated("cpu:7") - used7 <= chunk * 5 // 4
    assert 3 * chunk <= dpmini.memory_allocated("cpu:8") - used8 <= 3 * chunk * 5 // 4
    assert out.shape == (6, 1000) and len(held) == 2


def test_attributes(dev2):
    m = Identity()
    dp = dpmini.DataParallel(m, device_ids=dev2, dim=1)
    assert dp.module is m
    assert isinstance(dp.device_ids, list)
    assert all(isinstance(d, dpmini.Device) for d in dp.device_ids)
    assert [str(d) for d in dp.device_ids] == dev2
    assert dp.device_ids == [dpmini.Device("cpu:0"), dpmini.Device("cpu:1")]
    assert isinstance(dp.output_device, dpmini.Device)
    assert str(dp.output_device) == "cpu:0"
    assert dp.dim == 1
    assert dp.strict is False


def test_attributes_explicit_output_device_and_device_objects():
    dp = dpmini.DataParallel(Identity(), device_ids=[dpmini.Device("cpu:2"), "cpu:4"],
                             output_device="cpu")
    assert [str(d) for d in dp.device_ids] == ["cpu:2", "cpu:4"]
    assert str(dp.output_device) == "cpu"
    assert dp.output_device.index is None
    assert dp.dim == 0


def test_kwargs_are_scattered(dev2):
    seen = []

    def f(x, *, scale, name):
        seen.append((dev(x), dev(scale), name))
        return x * scale

    x = np.arange(4.0)
    out = dpmini.DataParallel(f, device_ids=dev2)(x, scale=np.array([1.0, 2.0, 3.0, 4.0]), name="n")
    np.testing.assert_array_equal(out, x * [1, 2, 3, 4])
    assert sorted(seen) == [("cpu:0", "cpu:0", "n"), ("cpu:1", "cpu:1", "n")]


# ------------------------------------------------------------ subclassing

def test_subclass_overrides_every_step(dev2):
    log = []

    class MyDP(dpmini.DataParallel):
        def scatter(self, inputs, kwargs, device_ids):
            log.append(("scatter", len(inputs), sorted(kwargs), [str(d) for d in device_ids]))
            return super().scatter(inputs, kwargs, device_ids)

        def replicate(self, module, device_ids):
            log.append(("replicate", module is self.module, [str(d) for d in device_ids]))
            return super().replicate(module, device_ids)

        def parallel_apply(self, replicas, inputs, kwargs):
            log.append(("parallel_apply", len(replicas), len(inputs), len(kwargs)))
            return super().parallel_apply(replicas, inputs, kwargs)

        def gather(self, outputs, output_device):
            log.append(("gather", len(outputs), str(output_device)))
            return super().gather(outputs, output_device)

    x = np.arange(6.0).reshape(3, 2)
    dp = MyDP(lambda x, k: x + k, device_ids=["cpu:0", "cpu:1", "cpu:2", "cpu:3"])
    assert isinstance(dp, dpmini.DataParallel)
    out = dp(x, k=1)
    np.testing.assert_array_equal(out, x + 1)
    assert [e[0] for e in log] == ["scatter", "replicate", "parallel_apply", "gather"]
    assert log[0] == ("scatter", 1, ["k"], ["cpu:0", "cpu:1", "cpu:2", "cpu:3"])
    assert log[1] == ("replicate", True, ["cpu:0", "cpu:1", "cpu:2"])  # device_ids[:len(inputs)]
    assert log[2] == ("parallel_apply", 3, 3, 3)
    assert log[3] == ("gather", 3, "cpu:0")


def test_subclass_gather_result_is_returned(dev2):
    class MyDP(dpmini.DataParallel):
        def gather(self, outputs, output_device):
            return ("custom", len(outputs))

    assert MyDP(lambda x: x, device_ids=dev2)(np.arange(4)) == ("custom", 2)


def test_subclass_scatter_controls_inputs(dev2):
    class MyDP(dpmini.DataParallel):
        def scatter(self, inputs, kwargs, device_ids):
            return ((np.array([1.0]),), (np.array([2.0]),)), ({}, {})

    out = MyDP(lambda x: x * 10, device_ids=dev2)(np.arange(100.0))
    np.testing.assert_array_equal(out, [10.0, 20.0])


def test_subclass_parallel_apply_override(dev2):
    class MyDP(dpmini.DataParallel):
        def parallel_apply(self, replicas, inputs, kwargs):
            return [inp[0] * 0 + i for i, inp in enumerate(inputs)]

    out = MyDP(lambda x: x, device_ids=dev2)(np.arange(4.0))
    np.testing.assert_array_equal(out, [0, 0, 1, 1])


def test_subclass_init_and_extra_attributes(dev2):
    class MyDP(dpmini.DataParallel):
        def __init__(self, module, **kw):
            super().__init__(module, **kw)
            self.extra = 42

    dp = MyDP(Identity(), device_ids=dev2)
    assert dp.extra == 42
    np.testing.assert_array_equal(dp(np.arange(4.0)), np.arange(4.0))


# -------------------------------------------------------- data_parallel()

def test_data_parallel_list_counts_as_one_positional_argument(dev2):
    seen = []

    def f(*args):
        seen.append(len(args))
        (pair,) = args
        assert isinstance(pair, list)
        return pair[0] + pair[1]

    a = np.arange(4.0)
    b = np.ones(4)
    out = dpmini.data_parallel(f, [a, b], device_ids=dev2)
    assert seen == [1, 1]
    np.testing.assert_array_equal(out, a + b)
    assert dev(out) == "cpu:0"


def test_data_parallel_tuple_is_the_argument_tuple(dev2):
    out = dpmini.data_parallel(lambda a, b: a - b, (np.arange(4.0), np.ones(4)), device_ids=dev2)
    np.testing.assert_array_equal(out, np.arange(4.0) - 1)


def test_data_parallel_single_array_is_wrapped(dev2):
    out = dpmini.data_parallel(lambda x: x * 2, np.arange(4.0), device_ids=dev2, output_device="cpu:1")
    np.testing.assert_array_equal(out, np.arange(4.0) * 2)
    assert dev(out) == "cpu:1"


def test_data_parallel_none_inputs_and_module_kwargs(dev2):
    calls = []
    out = dpmini.data_parallel(lambda: calls.append(1) or np.ones(1), None, device_ids=dev2)
    assert calls == [1]
    np.testing.assert_array_equal(out, [1.0])
    out = dpmini.data_parallel(lambda x, *, y: x + y, (np.arange(4.0),), device_ids=dev2,
                               module_kwargs={"y": np.full(4, 10.0)})
    np.testing.assert_array_equal(out, np.arange(4.0) + 10)


def test_data_parallel_dim(dev2):
    x = np.arange(12.0).reshape(2, 6)
    seen = []
    out = dpmini.data_parallel(lambda x: seen.append(x.shape) or x, x, device_ids=dev2, dim=1)
    assert sorted(seen) == [(2, 3), (2, 3)]
    np.testing.assert_array_equal(out, x)


def test_data_parallel_single_device_fast_path():
    out = dpmini.data_parallel(lambda x: np.asarray(x.sum()), np.arange(4.0), device_ids=["cpu:1"])
    assert out.ndim == 0 and float(out) == 6.0


# -------------------------------------------------------------- replicate

class Sub:
    def __init__(self):
        self.v = np.arange(3.0)


class Model:
    def __init__(self, place=None):
        put = (lambda a: dpmini.asarray(a, place)) if place else (lambda a: a)
        self.w = put(np.arange(6.0).reshape(2, 3))
        self.layers = [put(np.ones(2)), put(np.zeros(3, dtype=np.int32))]
        self.cfg = {"b": put(np.full(2, 7.0)), "name": "model"}
        self.sub = Sub()
        self.sub.v = put(self.sub.v)
        self.tag = "t"
        self.calls = 0

    def __call__(self, x):
        return x @ self.w.T if x.ndim == 2 else x


def test_replicate_copies_arrays_in_attributes_to_each_device():
    m = Model()
    devices = ["cpu:0", "cpu:1", "cpu:2"]
    reps = dpmini.replicate(m, devices)
    assert isinstance(reps, list) and len(reps) == 3
    for d, r in zip(devices, reps):
        assert type(r) is Model
        assert r is not m
        for got, want in [(r.w, m.w), (r.layers[0], m.layers[0]), (r.layers[1], m.layers[1]),
                          (r.cfg["b"], m.cfg["b"]), (r.sub.v, m.sub.v)]:
            assert dev(got) == d
            assert got.dtype == want.dtype
            np.testing.assert_array_equal(got, want)
            assert not np.shares_memory(got, want)  # host arrays: copies everywhere
        assert r.cfg["name"] == "model" and r.tag == "t"
    # the original is untouched
    assert dev(m.w) == "cpu" and dev(m.sub.v) == "cpu"


def test_replicate_replica0_shares_storage_when_on_device_ids0():
    m = Model(place="cpu:0")
    reps = dpmini.replicate(m, ["cpu:0", "cpu:1"])
    r0, r1 = reps
    for got, want in [(r0.w, m.w), (r0.layers[0], m.layers[0]), (r0.cfg["b"], m.cfg["b"]),
                      (r0.sub.v, m.sub.v)]:
        assert np.shares_memory(got, want)
    for got, want in [(r1.w, m.w), (r1.layers[0], m.layers[0]), (r1.cfg["b"], m.cfg["b"]),
                      (r1.sub.v, m.sub.v)]:
        assert not np.shares_memory(got, want)
        assert dev(got) == "cpu:1"


def test_replicate_module_not_on_device_ids0_is_allowed():
    m = Model(place="cpu:5")
    reps = dpmini.replicate(m, ["cpu:0", "cpu:1"])
    assert dev(reps[0].w) == "cpu:0" and not np.shares_memory(reps[0].w, m.w)
    out = dpmini.DataParallel(m, device_ids=["cpu:0", "cpu:1"])(np.ones((4, 3)))
    np.testing.assert_array_equal(out, np.ones((4, 3)) @ m.w.T)


def test_replicate_shared_array_stays_shared_within_replica():
    class Tied:
        def __init__(self):
            self.a = np.arange(4.0)
            self.b = self.a

    reps = dpmini.replicate(Tied(), ["cpu:0", "cpu:1"])
    for r in reps:
        assert r.a is r.b


class Stats:
    def __init__(self, place):
        self.running = np.zeros(2)
        if place:
            self.running = dpmini.asarray(self.running, place)
        self.calls = 0

    def __call__(self, x):
        np.add(self.running, x.sum(axis=0), out=self.running)  # in place (BatchNorm-like)
        self.calls = self.calls + 1  # attribute rebinding
        return x


def test_spec_5_6_inplace_update_on_replica0_persists():
    m = Stats(place="cpu:0")
    x = np.arange(8.0).reshape(4, 2)
    dpmini.DataParallel(m, device_ids=["cpu:0", "cpu:1"])(x)
    np.testing.assert_array_equal(m.running, x[:2].sum(axis=0))  # device 0's slice only
    assert m.calls == 0  # rebinding on a replica is lost


def test_spec_5_6_inplace_update_lost_when_module_not_on_device0():
    m = Stats(place=None)
    x = np.arange(8.0).reshape(4, 2)
    dpmini.DataParallel(m, device_ids=["cpu:0", "cpu:1"])(x)
    np.testing.assert_array_equal(m.running, [0.0, 0.0])
    assert m.calls == 0


def test_spec_5_6_single_device_updates_the_module_itself():
    m = Stats(place="cpu:0")
    dpmini.DataParallel(m, device_ids=["cpu:0"])(np.ones((2, 2)))
    np.testing.assert_array_equal(m.running, [2.0, 2.0])
    assert m.calls == 1


def test_replicas_see_their_own_device_weights(dev3):
    seen = []

    class M:
        def __init__(self):
            self.w = np.ones(2)

        def __call__(self, x):
            seen.append((dev(x), dev(self.w)))
            return x

    dpmini.DataParallel(M(), device_ids=dev3)(np.zeros((3, 2)))
    assert sorted(seen) == [(d, d) for d in dev3]


# --------------------------------------------------------- parallel_apply

def test_parallel_apply_outputs_in_replica_order_when_replica0_is_slowest():
    n = 4
    others_done = threading.Event()
    finished = []
    lock = threading.Lock()

    class M:
        def __init__(self, i):
            self.i = i

        def __call__(self, x):
            if self.i == 0:
                others_done.wait(timeout=20)  # replica 0 finishes last
            with lock:
                finished.append(self.i)
                if len(finished) == n - 1 and self.i != 0:
                    others_done.set()
            return x * 10 + self.i

    modules = [M(i) for i in range(n)]
    inputs = [(np.array([float(i)]),) for i in range(n)]
    outs = dpmini.parallel_apply(modules, inputs, None, cpu_devices(n))
    assert isinstance(outs, list)
    assert others_done.is_set() and finished[-1] == 0
    for i, o in enumerate(outs):
        np.testing.assert_array_equal(o, [i * 10.0 + i])


def test_parallel_apply_lone_array_input_is_not_unpacked():
    seen = []
    outs = dpmini.parallel_apply([lambda *a: seen.append(len(a)) or a[0]] * 2,
                                 [np.arange(3.0), np.arange(2.0)])
    assert seen == [1, 1]
    assert [o.shape for o in outs] == [(3,), (2,)]


def test_parallel_apply_kwargs_and_devices():
    outs = dpmini.parallel_apply([lambda x, *, k: x + k] * 3,
                                 [(np.zeros(1),), (np.ones(1),), (np.full(1, 2.0),)],
                                 [{"k": 10}, {"k": 20}, {"k": 30}],
                                 ["cpu:0", "cpu:1", "cpu:2"])
    assert [float(o[0]) for o in outs] == [10.0, 21.0, 32.0]


def test_parallel_apply_single_module_runs_inline():
    tid = []
    outs = dpmini.parallel_apply([lambda x: tid.append(threading.get_ident()) or x], [(np.ones(1),)])
    assert tid == [threading.get_ident()]
    assert len(outs) == 1


def test_parallel_apply_non_array_outputs_are_kept():
    outs = dpmini.parallel_apply([lambda x: ("s", x)] * 2, [(1,), (2,)], devices=["cpu:0", "cpu:1"])
    assert outs == [("s", 1), ("s", 2)]


# --------------------------------------------------------- default devices

def test_default_device_ids_use_cpu_device_count():
    import os
    import subprocess
    import sys

    code = (
        "import dpmini, numpy as np\n"
        "dp = dpmini.DataParallel(lambda x: x)\n"
        "print([str(d) for d in dp.device_ids], dpmini.cpu_device_count())\n"
    )
    env = dict(os.environ, DPMINI_CPU_DEVICES="3")
    res = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    if dpmini.device_count() == 0:
        assert res.stdout.strip() == "['cpu:0', 'cpu:1', 'cpu:2'] 3"


def test_view_rule_through_dataparallel(dev2):
    # docs/spec.md 3.4: the chunk for the device the input already lives on is a view, not a copy
    xd = dpmini.asarray(np.arange(8.0).reshape(4, 2), "cpu:0")
    seen = {}
    dpmini.DataParallel(lambda x: seen.__setitem__(dev(x), x) or x * 1, device_ids=dev2)(xd)
    assert np.shares_memory(seen["cpu:0"], xd)
    assert not np.shares_memory(seen["cpu:1"], xd)


# ------------------------------------------------------------------ module not on device_ids[0]

class Linear:
    def __init__(self, place=None):
        w = np.arange(6.0).reshape(3, 2)
        self.w = dpmini.asarray(w, place) if place else w
        self.last = None

    def __call__(self, x):
        self.last = x  # attribute assignment inside forward (pytorch#73218)
        return x @ self.w


@pytest.mark.parametrize(
    "place,device_ids",
    [(None, ["cpu:0", "cpu:1"]), ("cpu:0", ["cpu:1", "cpu:2", "cpu:3"]), ("cpu:0", ["cpu:0"]),
     (None, ["cpu:2"])],
)
def test_module_not_on_device_ids0_is_broadcast_not_refused(place, device_ids):
    # design decision (docs/spec.md 2.2): arrays are broadcast from wherever they live
    m = Linear(place)
    x = np.arange(30.0).reshape(10, 3)
    out = dpmini.DataParallel(m, device_ids=device_ids)(x)
    np.testing.assert_array_equal(out, x @ np.arange(6.0).reshape(3, 2))
    if len(device_ids) > 1:
        assert dev(out) == device_ids[0]
    assert dev(m.w) == (place or "cpu")  # the module is not moved


def test_attribute_set_in_forward_does_not_persist(dev2):
    m = Linear()
    dpmini.DataParallel(m, device_ids=dev2)(np.ones((4, 3)))
    assert m.last is None
