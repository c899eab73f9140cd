"""Replica contexts (dpmini.register_replica_context): a provider is called once
per call on the caller's thread, its enter in each worker thread before the
replica and its exit after it, on success, on error and after a Ctrl-C; errors
of each step are reported where they belong. No array library needed."""
import threading

import numpy as np
import pytest

import dpmini
from script_runner import run_script

DEVS = ["cpu:0", "cpu:1"]


class Recorder:
    """A provider that records what it is called with, and on which thread."""

    def __init__(self, fail=None):
        self.calls, self.enters, self.exits = [], [], []
        self.fail = fail   # "provider", "enter 1", "exit 1": raise there
        self.lock = threading.Lock()

    def __call__(self, devices):
        self.calls.append((threading.get_ident(), tuple(str(d) for d in devices)))
        if self.fail == "provider":
            raise ValueError("provider failed")

        def enter(i, device):
            with self.lock:
                self.enters.append((i, str(device), threading.get_ident()))
            if self.fail == f"enter {i}":
                raise ValueError(f"enter {i} failed")

            def leave():
                with self.lock:
                    self.exits.append((i, threading.get_ident()))
                if self.fail == f"exit {i}":
                    raise ValueError(f"exit {i} failed")
            return leave
        return enter


@pytest.fixture
def recorder():
    made = []

    def make(fail=None):
        r = Recorder(fail)
        dpmini.register_replica_context(r)
        made.append(r)
        return r
    yield make
    for r in made:
        dpmini.unregister_replica_context(r)


def ident(x):
    return threading.get_ident()


def test_provider_once_on_caller_enter_and_exit_in_each_replica_thread(recorder):
    r = recorder()
    out = dpmini.parallel_apply([ident, ident], [(1,), (2,)], devices=DEVS)
    assert r.calls == [(threading.get_ident(), ("cpu:0", "cpu:1"))]
    assert sorted((i, d) for i, d, _ in r.enters) == [(0, "cpu:0"), (1, "cpu:1")]
    # enter and exit run on the thread that ran the replica
    assert {i: t for i, _, t in r.enters} == {0: out[0], 1: out[1]}
    assert dict(r.exits) == {0: out[0], 1: out[1]}


def test_one_replica_runs_inline_without_the_provider(recorder):
    r = recorder()
    assert dpmini.parallel_apply([ident], [(1,)], devices=["cpu:1"]) == [threading.get_ident()]
    assert r.calls == [] and r.enters == []


def test_provider_returning_none_carries_nothing():
    called = []

    def provider(devices):
        called.append(devices)
        return None
    dpmini.register_replica_context(provider)
    try:
        assert dpmini.parallel_apply([abs, abs], [(-1,), (-2,)], devices=DEVS) == [1, 2]
    finally:
        assert dpmini.unregister_replica_context(provider) is True
    assert len(called) == 1 and [str(d) for d in called[0]] == DEVS


def test_registering_twice_calls_it_once(recorder):
    r = recorder()
    dpmini.register_replica_context(r)
    dpmini.parallel_apply([ident, ident], [(1,), (2,)], devices=DEVS)
    assert len(r.calls) == 1 and len(r.enters) == 2


def test_exit_runs_when_the_replica_raises(recorder):
    r = recorder()

    def replica(x):
        if x == 1:
            raise KeyError("bad")
        return x
    with pytest.raises(KeyError, match="Caught KeyError in replica 1 on device cpu:1"):
        dpmini.parallel_apply([replica, replica], [(0,), (1,)], devices=DEVS)
    assert sorted(i for i, _ in r.exits) == [0, 1]


def test_provider_error_names_the_provider_and_no_replica_runs(recorder):
    r = recorder("provider")
    ran = []
    with pytest.raises(ValueError, match=r"replica context provider .*Recorder.* raised "
                                         r"ValueError: provider failed \(no replica ran\)"):
        dpmini.parallel_apply([ran.append, ran.append], [(0,), (1,)], devices=DEVS)
    assert ran == [] and r.enters == []


def test_enter_error_is_the_replicas_error_and_the_replica_does_not_run(recorder):
    first = recorder()
    second = recorder("enter 1")
    ran = []
    with pytest.raises(ValueError, match="Caught ValueError in replica 1 on device cpu:1"):
        dpmini.parallel_apply([ran.append, ran.append], [(0,), (1,)], devices=DEVS)
    assert ran == [0]
    # the context entered before the failing one is left again
    assert sorted(i for i, _ in first.exits) == [0, 1]
    assert sorted(i for i, _ in second.exits) == [0]


def test_exit_error_is_the_replicas_error(recorder):
    recorder("exit 0")
    with pytest.raises(ValueError, match="Caught ValueError in replica 0 on device cpu:0"):
        dpmini.parallel_apply([abs, abs], [(-1,), (-2,)], devices=DEVS)


def test_exits_run_in_reverse_order_of_registration(recorder):
    order = []

    def make(name):
        def provider(devices):
            def enter(i, device):
                order.append((i, "enter", name))
                return lambda: order.append((i, "exit", name))
            return enter
        return provider
    a, b = make("a"), make("b")
    dpmini.register_replica_context(a)
    dpmini.register_replica_context(b)
    try:
        dpmini.parallel_apply([abs, abs], [(-1,), (-2,)], devices=DEVS)
    finally:
        dpmini.unregister_replica_context(a)
        dpmini.unregister_replica_context(b)
    for i in (0, 1):
        assert [(s, n) for k, s, n in order if k == i] == [
            ("enter", "a"), ("enter", "b"), ("exit", "b"), ("exit", "a")]


def test_provider_not_callable_is_refused():
    with pytest.raises(TypeError, match="register_replica_context: provider must be callable, "
                                        "got int"):
        dpmini.register_replica_context(3)


def test_dataparallel_forward_enters_the_contexts(recorder):
    r = recorder()
    out = dpmini.DataParallel(lambda x: x + 1, device_ids=DEVS)(np.arange(4.0))
    assert np.array_equal(out, np.arange(4.0) + 1)
    assert len(r.calls) == 1 and sorted(i for i, _, _ in r.enters) == [0, 1]
    assert sorted(i for i, _ in r.exits) == [0, 1]


def test_ctrl_c_still_runs_the_exit_of_a_replica_it_stopped():
    # the replica gets the KeyboardInterrupt; its exit runs whole on its thread
    run_script("""
        import _thread, threading, time, dpmini
        exits = []
        def provider(devices):
            def enter(i, device):
                def leave():
                    time.sleep(0.2)         # a Ctrl-C here would cut it short
                    exits.append(i)
                return leave
            return enter
        dpmini.register_replica_context(provider)
        started = threading.Barrier(3)
        def replica(x):
            started.wait()
            while True:
                time.sleep(0.01)
        threading.Timer(0.0, lambda: (started.wait(), time.sleep(0.1),
                                      _thread.interrupt_main())).start()
        try:
            dpmini.parallel_apply([replica, replica], [(0,), (1,)], devices=["cpu:0", "cpu:1"])
        except KeyboardInterrupt:
            pass
        else:
            raise AssertionError("no KeyboardInterrupt")
        deadline = time.time() + 10
        while len(exits) < 2 and time.time() < deadline:
            time.sleep(0.05)
        assert sorted(exits) == [0, 1], exits
        print("OK")
    """, timeout=60)


def test_a_provider_returning_none_beside_one_that_carries(recorder):
    def nothing(devices):
        return None
    dpmini.register_replica_context(nothing)
    try:
        r = recorder()
        out = dpmini.parallel_apply([ident, ident], [(1,), (2,)], devices=DEVS)
    finally:
        dpmini.unregister_replica_context(nothing)
    assert sorted(i for i, _, _ in r.enters) == [0, 1]
    assert dict(r.exits) == {0: out[0], 1: out[1]}
