"""NumPy arrays made inside a replica on a virtual CPU device take their memory
from that device's caching allocator (csrc/py/numpy_allocator.c) from
256 KiB up, counted exactly by memory_allocated; smaller ones and np.zeros
keep NumPy's own memory; the caller's arrays are not touched;
DPMINI_NUMPY_ALLOCATOR=0 turns it off; arrays that outlive the call (kept,
returned, grown, freed on another thread or at exit) stay valid; memory
cached for one device does not make another run out."""
import os
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
SMALL = 16         # 128 bytes: NumPy's own memory behind the same handler
SANITIZED = bool(os.environ.get("DPMINI_SANITIZER"))


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


@pytest.mark.parametrize("nbytes", [256 << 10, 8 << 20, (8 << 20) + 8, 10 << 20])
def test_big_arrays_are_counted_at_their_size_class(monkeypatch, nbytes):
    """An 8 MiB array holds an 8 MiB block (no header pushing it a class up)."""
    monkeypatch.delenv("DPMINI_NUMPY_ALLOCATOR", raising=False)
    dpmini.empty_cache()   # else a cached block up to 2 classes larger may serve it
    kept = []

    def keep(x):
        kept.append(np.empty(nbytes, dtype=np.uint8))
        return x

    dp = dpmini.DataParallel(keep, device_ids=["cpu:0", "cpu:1"])
    before = dpmini.memory_allocated("cpu:1")
    dp(np.zeros((2, 1)))
    grown = dpmini.memory_allocated("cpu:1") - before
    expected = {256 << 10: 256 << 10, 8 << 20: 8 << 20, (8 << 20) + 8: 10 << 20,
                10 << 20: 10 << 20}[nbytes]
    assert grown == expected
    kept.clear()
    assert dpmini.memory_allocated("cpu:1") == before


def test_small_arrays_and_zeros_keep_numpys_memory(monkeypatch):
    monkeypatch.delenv("DPMINI_NUMPY_ALLOCATOR", raising=False)
    dpmini.empty_cache()   # else a cached block up to 2 classes larger may serve it
    kept = {}

    def keep(x):
        kept[int(x[0, 0])] = (np.ones(1000),                 # 8 KB: NumPy's own
                              np.zeros(1 << 20),             # 8 MiB of lazily zeroed pages
                              np.ones(SMALL).repeat(1 << 16))  # 8 MiB: the device's cache
        return x

    dp = dpmini.DataParallel(keep, device_ids=["cpu:0", "cpu:1"])
    before = dpmini.memory_allocated("cpu:0")
    dp(np.array([[0.0], [1.0]]))
    assert dpmini.memory_allocated("cpu:0") - before == 8 << 20
    small, zeros, big = kept[0]
    assert float(small.sum()) == 1000 and not zeros.any() and float(big.sum()) == 1 << 20
    del small, zeros, big
    kept.clear()
    assert dpmini.memory_allocated("cpu:0") == before


@pytest.mark.slow  # ~25 s: fills the address-space cap in a subprocess
@pytest.mark.skipif(SANITIZED, reason="an address-space limit cannot hold a sanitizer's shadow")
def test_memory_cached_for_other_devices_is_given_back_when_short():
    """Blocks cached for cpu:0-3 are freed when cpu:4 runs out of address space."""
    run_script("""
        import resource, numpy as np, dpmini
        def make(mib):
            def step(x):
                t = np.ones(mib << 17)   # mib MiB of float64, freed at return
                return x + t[0]
            return step
        limit = 3500 << 20
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
        dpmini.DataParallel(make(400), device_ids=["cpu:0", "cpu:1", "cpu:2", "cpu:3"])(
            np.zeros((4, 1)))
        held = sum(dpmini.memory_reserved(f"cpu:{i}") for i in range(4))
        assert held >= 4 * (400 << 20), held
        out = dpmini.DataParallel(make(900), device_ids=["cpu:4", "cpu:5"])(np.zeros((2, 1)))
        assert out.tolist() == [[1.0], [1.0]]
        print("OK")
    """, timeout=300)


def test_an_error_while_preparing_the_allocator_is_raised_as_itself():
    """An invalid $DPMINI_CACHE_LIMIT under -W error: the warning, raised where
    the allocator is first prepared (no array to scatter), reaches the caller."""
    run_script("""
        import os
        os.environ["DPMINI_CACHE_LIMIT"] = "abc"
        import numpy as np, dpmini
        def f(x):
            return np.full((1, 2), x)
        dp = dpmini.DataParallel(f, device_ids=["cpu:0", "cpu:1"])
        try:
            dp(5.0)
        except RuntimeWarning as e:
            assert "DPMINI_CACHE_LIMIT=abc" in str(e), e
        else:
            raise AssertionError("no RuntimeWarning")
        assert dp(5.0).tolist() == [[5.0, 5.0], [5.0, 5.0]]   # read once: works after
        print("OK")
    """, "-W", "error::RuntimeWarning")
