"""One DataParallel call uses the options it started with.

dim, out_dims, device_ids and output_device changed by another thread while a
call runs apply from the next call, on the base type and on subclasses,
whether or not the subclass overrides a step (the step methods called during
a call use the call's snapshot, also through super()). The changes are made
from the replicas, which run on the devices' worker threads, and from a
thread the replica starts and joins, so the race is deterministic.
"""
import threading

import numpy as np
import pytest

import dpmini

D2 = ["cpu:0", "cpu:1"]


class MyDP(dpmini.DataParallel):
    pass


class ScatterOverride(dpmini.DataParallel):
    def scatter(self, inputs, kwargs, device_ids):
        return super().scatter(inputs, kwargs, device_ids)


class GatherOverride(dpmini.DataParallel):
    def gather(self, outputs, output_device):
        return super().gather(outputs, output_device)


class OwnForward(dpmini.DataParallel):
    """An overridden forward that runs the steps itself. It reads
    self.device_ids before any replica runs, and passes output_device=None
    (the call's own) to gather: an attribute it read after the replicas ran
    would be the new value."""

    def forward(self, *args, **kwargs):
        inputs, kws = self.scatter(args, kwargs, self.device_ids)
        replicas = self.replicate(self.module, self.device_ids[: len(inputs)])
        outputs = self.parallel_apply(replicas, inputs, kws)
        return self.gather(outputs, None)


CLASSES = [dpmini.DataParallel, MyDP, ScatterOverride, GatherOverride, OwnForward]


def _flip_in_thread(fn):
    t = threading.Thread(target=fn)
    t.start()
    t.join()


@pytest.mark.parametrize("cls", CLASSES, ids=lambda c: c.__name__)
def test_dim_set_by_another_thread_mid_call_applies_next_call(cls):
    holder = {}

    def module(x):
        _flip_in_thread(lambda: setattr(holder["dp"], "dim", 1))
        return x * 2

    dp = holder["dp"] = cls(module, D2, dim=0)
    x = np.arange(24.0).reshape(4, 6)
    out = dp(x)
    assert out.shape == (4, 6)            # scattered and gathered on dim 0
    np.testing.assert_array_equal(out, x * 2)
    assert dp.dim == 1                    # the change is kept for the next call
    dp.module = lambda x: x
    out = dp(x)
    assert out.shape == (4, 6)
    np.testing.assert_array_equal(out, x)


@pytest.mark.parametrize("cls", CLASSES, ids=lambda c: c.__name__)
def test_out_dims_and_output_device_set_mid_call(cls):
    holder = {}

    def module(x):
        dp = holder["dp"]
        dp.out_dims = "sum"               # set from a worker thread
        dp.output_device = "cpu:0"
        return x + 1

    dp = holder["dp"] = cls(module, D2, output_device="cpu:1")
    out = dp(np.zeros(4))
    np.testing.assert_array_equal(out, np.ones(4))    # concatenated, not summed
    assert str(dpmini.device_of(out)) == "cpu:1"
    assert dp.out_dims == "sum"


@pytest.mark.parametrize("cls", CLASSES, ids=lambda c: c.__name__)
def test_device_ids_set_mid_call(cls):
    holder = {}
    seen = []

    def module(x):
        seen.append(len(x))
        holder["dp"].device_ids = ["cpu:0"]
        return x

    dp = holder["dp"] = cls(module, D2)
    out = dp(np.arange(4.0))
    np.testing.assert_array_equal(out, np.arange(4.0))
    assert sorted(seen) == [2, 2]
    assert [str(d) for d in dp.device_ids] == ["cpu:0"]


def test_step_methods_outside_a_call_read_the_current_options():
    dp = MyDP(lambda x: x, D2, dim=0)
    dp.dim = 1
    ins, _ = dp.scatter((np.zeros((2, 6)),), {}, D2)
    assert ins[0][0].shape == (2, 3)
    g = dp.gather([np.zeros((2, 3)), np.zeros((2, 3))], "cpu")
    assert g.shape == (2, 6)


def test_calls_on_two_threads_each_use_their_own_options():
    # a call on another thread does not see this call's snapshot
    results = {}
    dp = MyDP(lambda x: x, D2, dim=0)

    def other():
        dp.dim = 1
        results["other"] = dp(np.zeros((2, 6))).shape

    def module(x):
        if "started" not in results:
            results["started"] = True
            _flip_in_thread(other)
        return x

    dp.module = module
    results["main"] = dp(np.zeros((4, 6))).shape
    assert results["main"] == (4, 6) and results["other"] == (2, 6)
