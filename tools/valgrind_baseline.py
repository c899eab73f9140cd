"""The valgrind baseline (`make test-valgrind`, docs/reliability.md).

Run under valgrind exactly like the real run, but WITHOUT importing dpmini:
whatever memcheck reports here comes from CPython, NumPy, pytest or the dynamic
loader (for example CPython's own hash-randomisation seed read with getrandom,
which valgrind treats as uninitialised, and readline's start-up leaks), so it
is turned into the suppression file build/valgrind/python.supp for the run
that imports dpmini. Errors in that run are therefore new with dpmini.
"""
import fractions  # noqa: F401  (the test suite's other imports, so their
import gzip  # noqa: F401       start-up noise is in the baseline too)
import queue  # noqa: F401
import readline  # noqa: F401
import sysconfig  # noqa: F401
import zoneinfo  # noqa: F401

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st


@settings(max_examples=5, deadline=None)
@given(st.lists(st.integers(0, 5), min_size=1))
def test_baseline_hypothesis(xs):
    assert xs.index(xs[0]) == 0


def test_baseline_numpy_only():
    a = np.arange(12.0).reshape(4, 3)
    assert np.array_equal(np.concatenate(np.array_split(a, 2)), a)
    assert int.from_bytes(b"\x01\x02", "little") == 513
