"""replicate walks __slots__: arrays held in slots are broadcast, a slots-only
object without arrays is shared."""

import numpy as np
import pytest

import dpmini

D2 = ["cpu:0", "cpu:1"]


# --- replicate walks __slots__ -----------------------------------------

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


def test_replicate_broadcasts_arrays_held_in_slots():
    m = _SlotChild()
    reps = dpmini.replicate(m, D2)
    assert str(dpmini.device_of(reps[1].w)) == "cpu:1"
    assert str(dpmini.device_of(reps[1].layers[0])) == "cpu:1"
    assert reps[1].layers[1] == "name" and str(dpmini.device_of(reps[1].bias)) == "cpu:1"
    assert not hasattr(reps[1], "unset")
    assert m.w.base is None or str(dpmini.device_of(m.w)) == "cpu"   # original untouched
    assert np.array_equal(dpmini.DataParallel(m, D2)(np.zeros(4)), np.ones(4))


def test_slots_only_object_without_arrays_is_shared():
    class Plain:
        __slots__ = ("k",)

        def __init__(self):
            self.k = 3

        def __call__(self, x):
            return x
    p = Plain()
    assert all(r is p for r in dpmini.replicate(p, D2))
