"""NumPy arrays made inside a replica on a virtual CPU device take their memory
from that device's caching allocator (csrc/py/numpy_allocator.c); the
caller's own arrays do not; DPMINI_NUMPY_ALLOCATOR=0 turns it off; arrays
that outlive the call (kept, returned, grown, freed on another thread or at
exit) stay valid."""
import threading

import numpy as np
import pytest

import dpmini
from script_runner import run_script

try:
    from numpy._core.multiarray import get_handler_name
except ImportError:  # NumPy 1.x
    from numpy.core.multiarray import get_handler_name

BIG = 1 << 18      # float64 elements: 2 MiB, from the device's cache
SMALL = 16         # 128 bytes: malloc'ed behind the same handler


class NameOfNewArrays:
    def __call__(self, x):
        big, small = np.empty(BIG), np.empty(SMALL)
        return np.array([get_handler_name(big) + "|" + get_handler_name(small)])


def test_replica_arrays_come_from_their_device(monkeypatch):
    monkeypatch.delenv("DPMINI_NUMPY_ALLOCATOR", raising=False)
    dp = dpmini.DataParallel(NameOfNewArrays(), device_ids=["cpu:0", "cpu:1", "cpu:2"])
    names = list(dp(np.zeros((3, 1))))
    assert names == [f"dpmini cpu:{i} caching allocator|dpmini cpu:{i} caching allocator"
                     for i in range(3)]
    # the caller's context keeps NumPy's own allocator
    assert get_handler_name(np.empty(BIG)) == get_handler_name()
    assert not get_handler_name().startswith("dpmini")


def test_turned_off_by_environment(monkeypatch):
    monkeypatch.setenv("DPMINI_NUMPY_ALLOCATOR", "0")
    dp = dpmini.DataParallel(NameOfNewArrays(), device_ids=["cpu:0", "cpu:1"])
    default = get_handler_name()
    assert list(dp(np.zeros((2, 1)))) == [default + "|" + default] * 2


def test_a_single_replica_runs_inline_with_numpys_allocator(monkeypatch):
    monkeypatch.delenv("DPMINI_NUMPY_ALLOCATOR", raising=False)
    dp = dpmini.DataParallel(NameOfNewArrays(), device_ids=["cpu:0"])
    default = get_handler_name()
    assert list(dp(np.zeros((1, 1)))) == [default + "|" + default]


def test_kept_arrays_stay_valid_and_are_accounted(monkeypatch):
    monkeypatch.delenv("DPMINI_NUMPY_ALLOCATOR", raising=False)
    kept = {}

    def keep(x):
        i = int(x[0, 0])
        a = np.full(BIG, float(i))
        kept[i] = a
        return x

    dp = dpmini.DataParallel(keep, device_ids=["cpu:0", "cpu:1"])
    before = [dpmini.memory_allocated(f"cpu:{i}") for i in range(2)]
    dp(np.array([[0.0], [1.0]]))
    after = [dpmini.memory_allocated(f"cpu:{i}") for i in range(2)]
    assert all(a - b >= BIG * 8 for a, b in zip(after, before)), (before, after)
    assert [float(kept[i].sum()) for i in range(2)] == [0.0, float(BIG)]
    # freed on another thread, without any replica running
    t = threading.Thread(target=kept.clear)
    t.start()
    t.join()
    assert [dpmini.memory_allocated(f"cpu:{i}") for i in range(2)] == before


def test_zeros_are_zero_in_reused_blocks(monkeypatch):
    monkeypatch.delenv("DPMINI_NUMPY_ALLOCATOR", raising=False)

    def dirty_then_zeros(x):
        for _ in range(3):
            a = np.full(BIG, 7.0)   # a block of the cache, left dirty
            del a
            z = np.zeros(BIG)       # calloc: the same block, zeroed
            assert not z.any()
        return np.zeros((1, 3)) + z[:3]

    dp = dpmini.DataParallel(dirty_then_zeros, device_ids=["cpu:0", "cpu:1"])
    np.testing.assert_array_equal(dp(np.ones((2, 1))), np.zeros((2, 3)))


@pytest.mark.parametrize("start,grow", [(SMALL, BIG), (BIG, 4 * BIG), (4 * BIG, SMALL),
                                        (BIG, BIG - 1), (SMALL, SMALL + 1)])
def test_resize_keeps_the_data(monkeypatch, start, grow):
    monkeypatch.delenv("DPMINI_NUMPY_ALLOCATOR", raising=False)

    def resize(x):
        a = np.arange(start, dtype=np.float64)
        a.resize(grow, refcheck=False)   # NumPy reallocs through the handler
        keep = min(start, grow)
        np.testing.assert_array_equal(a[:keep], np.arange(keep, dtype=np.float64))
        if grow > start:
            assert not a[start:].any()   # resize zero-fills what it adds
        return np.array([[a[:keep].sum()]])

    dp = dpmini.DataParallel(resize, device_ids=["cpu:0", "cpu:1"])
    keep = min(start, grow)
    np.testing.assert_array_equal(dp(np.ones((2, 1))),
                                  np.full((2, 1), keep * (keep - 1) / 2))


def test_fromiter_growth(monkeypatch):
    monkeypatch.delenv("DPMINI_NUMPY_ALLOCATOR", raising=False)

    def grow(x):
        a = np.fromiter((i for i in range(100_000)), dtype=np.int64)   # grows by realloc
        return np.array([[a.sum()]])

    dp = dpmini.DataParallel(grow, device_ids=["cpu:0", "cpu:1"])
    np.testing.assert_array_equal(dp(np.ones((2, 1))), np.full((2, 1), 4999950000))


def test_results_match_numpys_allocator(monkeypatch):
    def step(x):
        return np.tanh(x) * np.exp(-x * x) + np.sin(x)

    x = np.random.default_rng(0).standard_normal((512, 300)).astype(np.float32)
    monkeypatch.setenv("DPMINI_NUMPY_ALLOCATOR", "0")
    off = dpmini.DataParallel(step, device_ids=["cpu:0", "cpu:1"])(x)
    monkeypatch.delenv("DPMINI_NUMPY_ALLOCATOR")
    on = dpmini.DataParallel(step, device_ids=["cpu:0", "cpu:1"])(x)
    np.testing.assert_array_equal(on, off)
    np.testing.assert_array_equal(on, step(x))


def test_arrays_kept_past_interpreter_exit():
    """Arrays a replica stored in a global are freed at exit, after the
    module's state is gone: no crash, exit status 0."""
    run_script("""
        import numpy as np, dpmini
        KEPT = []
        def keep(x):
            KEPT.append(np.ones(1 << 20))
            return x
        dpmini.DataParallel(keep, device_ids=["cpu:0", "cpu:1"])(np.ones((2, 2)))
        assert len(KEPT) == 2 and all(float(a.sum()) == 1 << 20 for a in KEPT)
        print("OK")
    """)
