"""An error raised while dpmini probes an object (an __array_interface__ or
__array_struct__ getter, a namedtuple's fields in replicate) propagates as it
is, not as a different error."""

import numpy as np
import pytest

import dpmini

D2 = ["cpu:0", "cpu:1"]


# --- an __array_interface__ getter's own error propagates ----------------

@pytest.mark.parametrize("attr", ["__array_interface__", "__array_struct__"])
def test_array_interface_getter_errors_propagate(attr):
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


def test_namedtuple_probe_errors_propagate_in_replicate():
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
