"""Exceptions raised inside replicas (docs/spec.md 6.5) and dpmini's exception types."""
import re
import threading

import numpy as np
import pytest

import dpmini


class Failing:
    """Replica i gets row [i] of np.arange(k); it raises exc_factory(i) when i is in `fail`."""

    def __init__(self, fail, exc_factory=lambda i: ValueError(f"boom-{i}")):
        self.fail = set(fail)
        self.exc_factory = exc_factory
        self.raised = {}
        self.lock = threading.Lock()

    def __call__(self, x):
        i = int(x[0])
        if i in self.fail:
            exc = self.exc_factory(i)
            with self.lock:
                self.raised[i] = exc
            raise exc
        return x


def run(module, k=4, devices=None):
    devices = devices or [f"cpu:{i}" for i in range(k)]
    return dpmini.DataParallel(module, device_ids=devices)(np.arange(float(len(devices))))


@pytest.mark.parametrize("pos", [0, 1, 2, 3])
def test_replica_exception_at_each_position(pos):
    m = Failing([pos])
    with pytest.raises(ValueError) as info:
        run(m)
    e = info.value
    assert type(e) is ValueError
    assert re.search(rf"Caught ValueError in replica {pos} on device cpu:{pos}\.\nOriginal Traceback", str(e))
    assert f"boom-{pos}" in str(e)  # the worker's traceback text includes the original message
    assert e.__cause__ is m.raised[pos]


def test_message_regex_from_the_brief():
    with pytest.raises(ValueError, match=r"Caught ValueError in replica 1 on device cpu:1\.\nOriginal Traceback"):
        run(Failing([1]))


def test_traceback_text_names_the_failing_function():
    def deep_helper(x):
        raise ValueError("inner problem")

    class M:
        def __call__(self, x):
            if int(x[0]) == 1:
                deep_helper(x)
            return x

    with pytest.raises(ValueError) as info:
        run(M(), k=2)
    assert "deep_helper" in str(info.value)
    assert "inner problem" in str(info.value)


def test_device_name_follows_device_list_order():
    with pytest.raises(ValueError, match=r"Caught ValueError in replica 1 on device cpu:0\.\n"):
        run(Failing([1]), devices=["cpu:2", "cpu:0", "cpu:1"])


def test_lowest_index_wins():
    m = Failing([1, 3], exc_factory=lambda i: ValueError(f"boom-{i}"))
    with pytest.raises(ValueError) as info:
        run(m)
    msg = str(info.value)
    assert "replica 1 on device cpu:1" in msg
    assert "boom-1" in msg and "boom-3" not in msg
    assert info.value.__cause__ is m.raised[1]


def test_lowest_index_wins_with_different_types():
    m = Failing([2, 3], exc_factory=lambda i: (TypeError if i == 3 else IndexError)(f"e{i}"))
    with pytest.raises(IndexError, match=r"Caught IndexError in replica 2 on device cpu:2\."):
        run(m)


def test_all_replicas_fail():
    with pytest.raises(ValueError, match=r"replica 0 on device cpu:0"):
        run(Failing([0, 1, 2, 3]))


def test_key_error_message_not_repr_quoted():
    m = Failing([1], exc_factory=lambda i: KeyError("missing_key"))
    with pytest.raises(KeyError) as info:
        run(m, k=2)
    msg = str(info.value)
    # real newlines, not the repr-quoted "\\n" that a plain KeyError would show
    assert re.search(r"Caught KeyError in replica 1 on device cpu:1\.\nOriginal Traceback", msg)
    assert not msg.startswith(("'", '"'))
    assert "missing_key" in msg
    assert info.value.__cause__ is m.raised[1]


class TwoArgError(Exception):
    def __init__(self, a, b):
        super().__init__(a, b)


def test_exception_that_cannot_be_built_from_one_string():
    m = Failing([1], exc_factory=lambda i: TwoArgError("x", i))
    with pytest.raises(RuntimeError) as info:
        run(m, k=2)
    assert type(info.value) is RuntimeError
    assert re.search(r"Caught TwoArgError in replica 1 on device cpu:1\.\nOriginal Traceback", str(info.value))
    assert info.value.__cause__ is m.raised[1]


def test_custom_exception_subclass_keeps_type():
    class MyError(ValueError):
        pass

    with pytest.raises(MyError, match=r"Caught MyError in replica 0 on device cpu:0"):
        run(Failing([0], exc_factory=lambda i: MyError("custom")), k=2)


def test_parallel_apply_wraps_errors():
    def ok(x):
        return x

    def bad(x):
        raise ValueError("pa")

    with pytest.raises(ValueError, match=r"Caught ValueError in replica 2 on device cpu:5\.\nOriginal Traceback"):
        dpmini.parallel_apply([ok, ok, bad], [(1,), (2,), (3,)], None, ["cpu:3", "cpu:4", "cpu:5"])


def test_parallel_apply_single_module_error_is_wrapped():
    def bad(x):
        raise ValueError("single")

    with pytest.raises(ValueError, match=r"Caught ValueError in replica 0 on device cpu:1"):
        dpmini.parallel_apply([bad], [(1,)], None, ["cpu:1"])


def test_single_device_dataparallel_raises_original():
    err = ValueError("direct")

    def bad(x):
        raise err

    with pytest.raises(ValueError) as info:
        dpmini.DataParallel(bad, device_ids=["cpu:0"])(np.arange(2.0))
    assert info.value is err  # module called directly: no wrapping (docs/spec.md 2.5)


def test_workers_healthy_after_an_error():
    for _ in range(3):
        with pytest.raises(ValueError):
            run(Failing([1]))
    out = run(Failing([]))
    np.testing.assert_array_equal(out, np.arange(4.0))


def test_error_in_kwargs_replica():
    def f(x, *, y):
        if int(y[0]) == 2:  # replica 1 gets y[2:4]
            raise ZeroDivisionError("y2")
        return x

    with pytest.raises(ZeroDivisionError, match=r"Caught ZeroDivisionError in replica 1 on device cpu:1"):
        dpmini.DataParallel(f, device_ids=["cpu:0", "cpu:1"])(np.arange(4.0), y=np.arange(4.0))


# ------------------------------------------------------- exception types

def test_exception_hierarchy():
    assert issubclass(dpmini.DPError, Exception)
    assert issubclass(dpmini.CudaError, dpmini.DPError)
    assert issubclass(dpmini.NcclError, dpmini.DPError)
    assert issubclass(dpmini.SplitWarning, UserWarning)
    try:
        e = dpmini.DPError("x")
    except TypeError:
        e = None
    assert hasattr(dpmini.DPError, "status") or (e is not None and hasattr(e, "status"))


def test_dperror_is_picklable():
    import pickle

    e = dpmini.DPError("some failure")
    e2 = pickle.loads(pickle.dumps(e))
    assert type(e2) is dpmini.DPError
    assert "some failure" in str(e2)
