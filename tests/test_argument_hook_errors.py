"""An exception raised by the user's own hooks while dpmini reads an argument
(__dlpack_device__, __index__, __float__, a module's __copy__/__reduce_ex__)
keeps its type, gains the argument's path and the hook in its message, and
has the original as __cause__ (docs/libraries.md, "Probing")."""

import numpy as np
import pytest

import dpmini

D2 = ["cpu:0", "cpu:1"]


class DeviceQueryFails:
    """A DLPack exporter whose __dlpack_device__() raises."""

    def __init__(self, exc):
        self.exc = exc

    def __dlpack__(self, **kw):
        return np.arange(4.0).__dlpack__()

    def __dlpack_device__(self):
        raise self.exc


@pytest.mark.parametrize("exc", [RuntimeError("driver not initialised"), KeyError("kk"),
                                 ValueError("no device")])
def test_dlpack_device_error_is_re_raised_naming_the_path(exc):
    with pytest.raises(type(exc), match=r"^args\[0\]: calling __dlpack_device__\(\) of a "
                                        r"DeviceQueryFails object .*raised "
                                        + type(exc).__name__) as e:
        dpmini.DataParallel(lambda a: a, D2)(DeviceQueryFails(exc))
    assert e.value.__cause__ is exc
    with pytest.raises(type(exc), match=r"^inputs\[1\]\['m'\]: calling __dlpack_device__"):
        dpmini.scatter((np.zeros(4), {"m": DeviceQueryFails(exc)}), D2)
    with pytest.raises(type(exc), match=r"^out: calling __dlpack_device__"):
        dpmini.gather([DeviceQueryFails(exc), DeviceQueryFails(exc)], "cpu")


def test_dlpack_device_error_with_an_array_fallback_reads_the_host_copy():
    # A producer that cannot say where one buffer lives but has __array__
    # (a JAX array sharded over several JAX devices) is read through
    # numpy.asarray, a copy.
    class Sharded(DeviceQueryFails):
        def __array__(self, dtype=None, copy=None):
            return np.arange(4.0)

    out = dpmini.DataParallel(lambda a: a * 2, D2)(Sharded(RuntimeError("sharded")))
    np.testing.assert_array_equal(out, np.arange(4.0) * 2)


def test_dlpack_device_keyboard_interrupt_passes_unchanged():
    with pytest.raises(KeyboardInterrupt) as e:
        dpmini.scatter(DeviceQueryFails(KeyboardInterrupt()), D2)
    assert e.value.args == ()


class IndexFails:
    def __index__(self):
        raise ZeroDivisionError("boom")


class FloatFails:
    def __float__(self):
        raise ArithmeticError("float boom")

    def __add__(self, other):   # a number type (PyNumber_Check)
        return NotImplemented


@pytest.mark.parametrize("kwargs,path", [({"dim": IndexFails()}, "dim"),
                                         ({"chunk_sizes": [IndexFails(), 4]}, r"chunk_sizes\[0\]"),
                                         ({"in_dims": (IndexFails(),)}, r"in_dims\[0\]")])
def test_index_hook_error_keeps_its_type_and_names_the_argument(kwargs, path):
    x = np.zeros((4, 2))
    with pytest.raises(ZeroDivisionError,
                       match=rf"^{path}: .*IndexFails\.__index__\(\) raised ZeroDivisionError: "
                             r"boom$") as e:
        dpmini.DataParallel(lambda a: a, D2, **kwargs)(x)
    assert isinstance(e.value.__cause__, ZeroDivisionError)


def test_float_hook_error_keeps_its_type_and_names_the_argument():
    with pytest.raises(ArithmeticError, match=r"^weights\[1\]: .*FloatFails\.__float__\(\) "
                                              r"raised ArithmeticError: float boom$") as e:
        dpmini.DataParallel(lambda a: a, D2, weights=[1.0, FloatFails()])(np.zeros(4))
    assert type(e.value.__cause__) is ArithmeticError


def test_index_hook_keyboard_interrupt_passes_unchanged():
    class Interrupt:
        def __index__(self):
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt) as e:
        dpmini.DataParallel(lambda a: a, D2, dim=Interrupt())(np.zeros(4))
    assert e.value.args == ()


class CopyFails:
    def __init__(self):
        self.w = np.ones(2)

    def __copy__(self):
        raise RuntimeError("copy boom")

    def __call__(self, a):
        return a * self.w


class ReduceFails:
    def __init__(self):
        self.w = np.ones(2)

    def __reduce_ex__(self, protocol):
        raise RuntimeError("reduce boom")


class Holds:
    def __init__(self, inner):
        self.layers = [1, {"sub": inner}]

    def __call__(self, a):
        return a


@pytest.mark.parametrize("module,path,what", [
    (CopyFails(), "module", "copy boom"),
    (Holds(ReduceFails()), r"module\.layers\[1\]\['sub'\]", "reduce boom"),
    (Holds(CopyFails()), r"module\.layers\[1\]\['sub'\]", "copy boom")])
def test_module_copy_error_names_the_object_path(module, path, what):
    with pytest.raises(RuntimeError, match=rf"^{path}: copy\.copy\(\) of a \w+ object .*"
                                           rf"raised RuntimeError: {what}$") as e:
        dpmini.DataParallel(module, D2)(np.zeros((4, 2)))
    assert str(e.value.__cause__) == what
    with pytest.raises(RuntimeError, match=rf"^{path}: copy\.copy\(\)"):
        dpmini.replicate(module, D2)


class ItemsFail(dict):
    def items(self):
        raise RuntimeError("items boom")


class GetItemLies(dict):
    """keys() names a key its __getitem__ then refuses."""

    def keys(self):
        return ["zzz"]

    def items(self):
        return [("zzz", 1)]

    def __getitem__(self, k):
        raise KeyError(k)


def test_dict_subclass_items_error_names_the_argument():
    x = np.zeros((4, 2))
    with pytest.raises(RuntimeError, match=r"^args\[0\]: items boom$") as e:
        dpmini.DataParallel(lambda a: a, D2)(ItemsFail(a=x))
    assert str(e.value.__cause__) == "items boom"
    with pytest.raises(RuntimeError, match=r"^inputs\[1\]\[0\]: items boom$"):
        dpmini.scatter((x, [ItemsFail(a=x)]), D2)


def test_dict_subclass_getitem_error_names_the_output_path():
    out = GetItemLies(a=1)
    dict.__setitem__(out, "zzz", 1)   # present, but its __getitem__ refuses it
    with pytest.raises(KeyError) as e:
        dpmini.gather([{"o": out}, {"o": out}], "cpu")
    assert str(e.value) == ("out['o']: reading a GetItemLies (a dict subclass) with its "
                            "__getitem__('zzz') raised KeyError: 'zzz'")
    assert isinstance(e.value.__cause__, KeyError)
