"""A subclass step that returns the wrong kind of value gets a TypeError that
names the method and what it must return, instead of
"'NoneType' object is not iterable"."""
import numpy as np
import pytest

import dpmini

D2 = ["cpu:0", "cpu:1"]


def test_scatter_returning_kwargs_none():
    class DP(dpmini.DataParallel):
        def scatter(self, inputs, kwargs, device_ids):
            ins, _ = super().scatter(inputs, kwargs, device_ids)
            return ins, None

    with pytest.raises(TypeError) as info:
        DP(lambda x: x, D2)(np.zeros(4))
    msg = str(info.value)
    assert "DP.scatter() must return (inputs, kwargs)" in msg
    assert "kwargs=NoneType" in msg


def test_scatter_returning_inputs_none():
    class DP(dpmini.DataParallel):
        def scatter(self, inputs, kwargs, device_ids):
            return None, ({}, {})

    with pytest.raises(TypeError, match=r"DP\.scatter\(\) must return .*inputs=NoneType"):
        DP(lambda x: x, D2)(np.zeros(4))


def test_scatter_returning_none():
    class DP(dpmini.DataParallel):
        def scatter(self, inputs, kwargs, device_ids):
            return None

    with pytest.raises(TypeError, match=r"DP\.scatter\(\) must return \(inputs, kwargs\), got NoneType"):
        DP(lambda x: x, D2)(np.zeros(4))


def test_replicate_returning_none():
    class DP(dpmini.DataParallel):
        def replicate(self, module, device_ids):
            return None

    with pytest.raises(TypeError) as info:
        DP(lambda x: x, D2)(np.zeros(4))
    msg = str(info.value)
    assert "DP.replicate() must return a list (or tuple) of replicas" in msg
    assert "device_ids[:2]" in msg and "got NoneType" in msg


def test_steps_returning_lists_still_work():
    class DP(dpmini.DataParallel):
        def scatter(self, inputs, kwargs, device_ids):
            ins, kws = super().scatter(inputs, kwargs, device_ids)
            return list(ins), list(kws)

        def replicate(self, module, device_ids):
            return tuple(super().replicate(module, device_ids))

    out = DP(lambda x: x * 3, D2)(np.arange(4.0))
    np.testing.assert_array_equal(out, np.arange(4.0) * 3)
