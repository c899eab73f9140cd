"""DataParallel / parallel_apply limit BLAS threads while replicas run on
virtual CPU devices (dpmini/_blas.py): replicas x BLAS threads <= cores during
the call, the previous counts afterwards, DPMINI_BLAS_LIMIT=0 turns it off."""
import os

import numpy as np
import pytest

import dpmini

threadpoolctl = pytest.importorskip("threadpoolctl")

DEVS = ["cpu:0", "cpu:1"]


def blas_threads():
    """Thread count of every BLAS pool threadpoolctl sees, by library path (OpenMP
    counts are per thread and not limited, see dpmini/_blas.py)."""
    return {info["filepath"]: info["num_threads"] for info in threadpoolctl.threadpool_info()
            if info["user_api"] == "blas"}


def cores():
    return len(os.sched_getaffinity(0))


@pytest.fixture
def many_threads():
    """Every pool at cores + 2 threads (more than any limit), restored afterwards."""
    if not blas_threads():
        pytest.skip("no BLAS pool loaded")
    with threadpoolctl.threadpool_limits(limits=cores() + 2):
        # threadpool_limits only lowers limits for some libraries: set them directly
        ctrl = threadpoolctl.ThreadpoolController()
        before = {lib.filepath: lib.num_threads for lib in ctrl.lib_controllers}
        for lib in ctrl.lib_controllers:
            lib.set_num_threads(cores() + 2)
        yield blas_threads()
        for lib in ctrl.lib_controllers:
            lib.set_num_threads(before[lib.filepath])


class Recorder:
    """A module that records the BLAS thread counts it sees and returns x @ x.T."""

    def __init__(self):
        self.seen = []

    def __call__(self, x):
        self.seen.append(blas_threads())
        return x @ x.T


def test_replicas_on_two_cpu_devices_see_cores_over_two(many_threads, monkeypatch):
    monkeypatch.delenv("DPMINI_BLAS_LIMIT", raising=False)
    module = Recorder()
    x = np.arange(24, dtype=np.float64).reshape(4, 6)
    out = dpmini.DataParallel(module, device_ids=DEVS)(x)
    np.testing.assert_array_equal(out, np.concatenate([x[:2] @ x[:2].T, x[2:] @ x[2:].T]))
    per = max(1, cores() // 2)
    assert len(module.seen) == 2
    for seen in module.seen:
        assert seen == {path: min(n, per) for path, n in many_threads.items()}
    assert blas_threads() == many_threads   # set back after the call


def test_limit_scales_with_the_number_of_replicas(many_threads, monkeypatch):
    monkeypatch.delenv("DPMINI_BLAS_LIMIT", raising=False)
    module = Recorder()
    x = np.ones((8, 3))
    dpmini.DataParallel(module, device_ids=[f"cpu:{i}" for i in range(4)])(x)
    per = max(1, cores() // 4)
    assert module.seen == [{p: min(k, per) for p, k in many_threads.items()}] * 4
    assert blas_threads() == many_threads


def test_env_zero_turns_the_limit_off(many_threads, monkeypatch):
    monkeypatch.setenv("DPMINI_BLAS_LIMIT", "0")
    module = Recorder()
    dpmini.DataParallel(module, device_ids=DEVS)(np.ones((4, 3)))
    assert module.seen == [many_threads, many_threads]
    assert blas_threads() == many_threads


def test_counts_are_set_back_when_a_replica_raises(many_threads, monkeypatch):
    monkeypatch.delenv("DPMINI_BLAS_LIMIT", raising=False)

    def failing(x):
        if x[0, 0] > 0:
            raise ValueError("boom")
        return x

    x = np.zeros((4, 2))
    x[2:] = 1
    with pytest.raises(ValueError, match="boom"):
        dpmini.DataParallel(failing, device_ids=DEVS)(x)
    assert blas_threads() == many_threads


def test_one_replica_and_nested_calls_change_nothing_inside(many_threads, monkeypatch):
    monkeypatch.delenv("DPMINI_BLAS_LIMIT", raising=False)
    per = max(1, cores() // 2)
    module = Recorder()
    dpmini.parallel_apply([module], [(np.ones((2, 2)),)], devices=["cpu:0"])
    assert module.seen == [many_threads]   # one replica: no limit

    inner = Recorder()
    inner_dp = dpmini.DataParallel(inner, device_ids=DEVS)

    def outer(x):
        return inner_dp(x)

    dpmini.DataParallel(outer, device_ids=DEVS)(np.ones((8, 2)))
    # inner calls run inside replicas: the outer limit stands, no further cut
    assert inner.seen and all(s == {p: min(k, per) for p, k in many_threads.items()}
                              for s in inner.seen)
    assert blas_threads() == many_threads


class Setter:
    """A pool's set_num_threads that records its counts and raises `fail` on
    its first call."""

    def __init__(self, fail=None):
        self.calls, self.fail = [], fail

    def __call__(self, n):
        self.calls.append(n)
        if self.fail is not None and len(self.calls) == 1:
            raise self.fail


def run_two_replicas():
    x = np.arange(8.0).reshape(4, 2)
    return dpmini.DataParallel(lambda a: a * 2, device_ids=DEVS)(x)


def test_restore_finishes_through_a_ctrl_c_and_hands_it_on(monkeypatch):
    first, second = Setter(KeyboardInterrupt()), Setter()
    monkeypatch.setattr(dpmini._blas, "limit", lambda replicas: [(first, 8), (second, 4)])
    with pytest.raises(KeyboardInterrupt):
        run_two_replicas()
        for _ in range(1000):   # the re-armed interrupt arrives at a check in Python
            pass
    assert first.calls == [8, 8] and second.calls == [4]


def test_restore_reports_a_failing_pool_and_restores_the_others(monkeypatch):
    first, second = Setter(ValueError("pool gone")), Setter()
    monkeypatch.setattr(dpmini._blas, "limit", lambda replicas: [(first, 8), (second, 4)])
    seen = []
    monkeypatch.setattr("sys.unraisablehook", lambda u: seen.append(u.exc_value))
    np.testing.assert_array_equal(run_two_replicas(), np.arange(8.0).reshape(4, 2) * 2)
    assert first.calls == [8] and second.calls == [4]
    assert [str(e) for e in seen] == ["pool gone"]


class FakePool:
    def __init__(self, threads, fail_get=None):
        self.threads, self.sets, self.fail_get = threads, [], fail_get

    def get(self):
        if self.fail_get is not None:
            raise self.fail_get
        return self.threads

    def put(self, n):
        self.sets.append(n)
        self.threads = n


def test_limit_interrupted_half_way_sets_back_what_it_cut(monkeypatch):
    monkeypatch.delenv("DPMINI_BLAS_LIMIT", raising=False)
    cut, broken = FakePool(8), FakePool(8, fail_get=KeyboardInterrupt())
    pools = tuple((None, (p.get, p.put)) for p in (cut, broken))
    monkeypatch.setattr(dpmini._blas, "_state",
                        {"controller": object(), "missing": False, "cores": 2, "pools": pools})
    with pytest.raises(KeyboardInterrupt):
        run_two_replicas()
    assert cut.sets == [1, 8] and cut.threads == 8 and broken.sets == []
