"""chunk_sizes= and weights=: per-device sizes along the split dim.

chunk_sizes is torch.cuda.comm.scatter's argument (docs/spec.md 0.7, 8.5) brought to
DataParallel (pytorch issue 46381); weights makes sizes proportional, with the
largest-remainder rounding of csrc/core/plan.c (dp_weighted_sizes): the sizes sum
to n and no device gets an empty chunk unless n < number of devices.
"""
import math

import numpy as np
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

import dpmini

D2 = ["cpu:0", "cpu:1"]
D3 = ["cpu:0", "cpu:1", "cpu:2"]
D4 = ["cpu:0", "cpu:1", "cpu:2", "cpu:3"]


def sizes(chunks, dim=0):
    return [c.shape[dim] for c in chunks]


def weighted_oracle(n, w):
    """The rule restated in Python (plan.h): floors, largest remainder, fill empties."""
    k, total = len(w), sum(w)
    quota = [n * x / total for x in w]
    s = [math.floor(q) for q in quota]
    # Remainders closer than 1e-9 are ties, broken towards the lower index
    # (plan.c's DP_REM_EPS: 99.99999999999999 vs 100.0 is a tie, not a win).
    rem = [q - f for q, f in zip(quota, s)]
    order = []
    for i in range(k):
        j = len(order)
        while j > 0 and rem[order[j - 1]] < rem[i] - 1e-9:
            j -= 1
        order.insert(j, i)
    t = 0
    while sum(s) < n:
        s[order[t % k]] += 1
        t += 1
    if n >= k:
        for i in range(k):
            if s[i] == 0:
                donor = max(range(k), key=lambda j: (s[j], j))  # highest index among equals
                s[donor] -= 1
                s[i] = 1
    return s


# ---------------------------------------------------------------- chunk_sizes


def test_chunk_sizes_scatter():
    x = np.arange(20.0).reshape(10, 2)
    out = dpmini.scatter(x, D3, chunk_sizes=[5, 2, 3])
    assert sizes(out) == [5, 2, 3]
    assert np.array_equal(np.concatenate(out), x)


def test_chunk_sizes_zero_in_the_middle_runs_an_empty_replica():
    out = dpmini.scatter(np.arange(6.0), D3, chunk_sizes=[3, 0, 3])
    assert sizes(out) == [3, 0, 3]


def test_chunk_sizes_trailing_zeros_idle():
    out = dpmini.scatter(np.arange(6.0), D4, chunk_sizes=[4, 2, 0, 0])
    assert sizes(out) == [4, 2]


def test_chunk_sizes_along_dim1_and_every_split_leaf():
    a, b = np.zeros((3, 6)), np.zeros((2, 6))
    ins, _ = dpmini.scatter_kwargs((a, b), None, D2, dim=1, chunk_sizes=[1, 5])
    assert [g[0].shape for g in ins] == [(3, 1), (3, 5)]
    assert [g[1].shape for g in ins] == [(2, 1), (2, 5)]


def test_chunk_sizes_leaf_of_other_size_is_named():
    with pytest.raises(ValueError, match=r"args\[1\]: chunk_sizes \[3, 3\] sum to 6.*size 4"):
        dpmini.scatter_kwargs((np.zeros(6), np.zeros(4)), None, D2, chunk_sizes=[3, 3])
    # broadcast leaves are exempt
    ins, _ = dpmini.scatter_kwargs((np.zeros(6), np.zeros(4)), None, D2, chunk_sizes=[3, 3],
                                   in_dims=(0, None))
    assert [g[1].shape for g in ins] == [(4,), (4,)]


@pytest.mark.parametrize("cs, exc, words", [
    ([1, 2], ValueError, ["chunk_sizes", "expected 3 entries", "got 2"]),
    ([1, 2, 3, 0], ValueError, ["expected 3 entries"]),
    ([4, -1, 3], ValueError, ["chunk_sizes[1]", ">= 0", "-1"]),
    ([1.0, 2, 3], TypeError, ["chunk_sizes[0]", "int", "float"]),
    ([True, 2, 3], TypeError, ["chunk_sizes[0]", "bool"]),
    (5, TypeError, ["chunk_sizes", "sequence"]),
    ("123", TypeError, ["chunk_sizes", "str"]),
])
def test_chunk_sizes_errors(cs, exc, words):
    with pytest.raises(exc) as info:
        dpmini.scatter(np.zeros(6), D3, chunk_sizes=cs)
    for w in words:
        assert w in str(info.value)


def test_chunk_sizes_numpy_ints_ok():
    assert sizes(dpmini.scatter(np.zeros(6), D3, chunk_sizes=np.array([1, 2, 3]))) == [1, 2, 3]


# ---------------------------------------------------------------- weights


@pytest.mark.parametrize("n, w, want", [
    (9, [1, 1, 1, 1], [3, 2, 2, 2]),
    (10, [1, 3], [3, 7]),
    (10, [0.1, 0.3], [3, 7]),
    (12, [1, 2, 3], [2, 4, 6]),
    (5, [100, 1, 1], [3, 1, 1]),        # still no empty chunk
    (3, [1, 1, 1, 1], [1, 1, 1]),       # n < devices: as torch.chunk, 3 replicas
    (2, [1, 3, 1, 3], [0, 1, 0, 1]),    # n < devices: rows to the largest shares
    (9, [0.001, 1, 1, 1], [1, 3, 3, 2]),  # the empty device's row from the last largest
])
def test_weighted_examples(n, w, want):
    out = dpmini.scatter(np.arange(float(n)), [f"cpu:{i}" for i in range(len(w))], weights=w)
    assert sizes(out) == want


def test_weights_zero_rows_every_replica_runs():
    assert sizes(dpmini.scatter(np.zeros(0), D3, weights=[1, 2, 3])) == [0, 0, 0]


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(n=st.integers(0, 300),
       w=st.lists(st.floats(0.01, 100.0, allow_nan=False), min_size=1, max_size=8))
@example(n=1, w=[99.99999999999999, 100.0])   # near-equal remainders tie
def test_weights_property(n, w):
    plan = dpmini.explain((np.broadcast_to(np.zeros(()), (n,)),),
                          [f"cpu:{i}" for i in range(len(w))], weights=w)
    got = plan.leaves[0]["sizes"]
    assert sum(got) == n
    if n >= len(w):
        assert min(got) >= 1                   # no empty chunk unless asked
    assert got == weighted_oracle(n, w)


@pytest.mark.parametrize("w, exc, words", [
    ([1, 2], ValueError, ["weights", "expected 3 entries"]),
    ([1, 0, 1], ValueError, ["weights[1]", "finite number > 0"]),
    ([1, -2, 1], ValueError, ["weights[1]"]),
    ([1, 1, float("nan")], ValueError, ["weights[2]", "nan"]),
    ([1, float("inf"), 1], ValueError, ["weights[1]", "inf"]),
    ([1, "2", 1], TypeError, ["weights[1]", "str"]),
    ([1, 1j, 1], TypeError, ["weights[1]", "complex"]),
    ([1, None, 1], TypeError, ["weights[1]"]),
    (2.0, TypeError, ["weights", "sequence"]),
])
def test_weights_errors(w, exc, words):
    with pytest.raises(exc) as info:
        dpmini.scatter(np.zeros(6), D3, weights=w)
    for word in words:
        assert word in str(info.value)


def test_both_given_is_an_error():
    with pytest.raises(ValueError, match="chunk_sizes and weights"):
        dpmini.scatter_kwargs((np.zeros(6),), None, D3, chunk_sizes=[2, 2, 2], weights=[1, 1, 1])
    with pytest.raises(ValueError, match="at most one"):
        dpmini.DataParallel(lambda x: x, D3, chunk_sizes=[2, 2, 2], weights=[1, 1, 1])


# ---------------------------------------------------------------- DataParallel


def test_dataparallel_weights_round_trip():
    seen = []

    def f(x):
        seen.append(x.shape[0])
        return x * 2

    x = np.arange(20.0).reshape(10, 2)
    dp = dpmini.DataParallel(f, D2, weights=[1, 4])
    assert dp.weights == (1, 4) and dp.chunk_sizes is None
    assert np.array_equal(dp(x), x * 2)
    assert sorted(seen) == [2, 8]
    assert "weights=(1, 4)" in repr(dp)


def test_dataparallel_chunk_sizes_attribute():
    dp = dpmini.DataParallel(lambda x: x + 0, D3, chunk_sizes=[1, 0, 3])
    assert dp.chunk_sizes == (1, 0, 3)
    assert np.array_equal(dp(np.arange(4.0)), np.arange(4.0))
    with pytest.raises(ValueError, match="at most one"):
        dp.weights = [1, 1, 1]
    dp.chunk_sizes = None
    dp.weights = [1, 1, 2]
    assert dp.weights == (1, 1, 2)
    with pytest.raises(ValueError, match="expected 3 entries"):
        dp.weights = [1, 1]
    dp.device_ids = D2  # lengths are checked again on each call
    with pytest.raises(ValueError, match="weights: expected 2 entries"):
        dp(np.arange(4.0))
    # the stale option does not block setting the other one to None, or itself anew
    dp.chunk_sizes = None
    dp.weights = [1, 3]
    assert np.array_equal(dp(np.arange(4.0)), np.arange(4.0))
    dp.device_ids = D3
    dp.weights = None
    dp.chunk_sizes = [1, 1, 2]
    assert dp.chunk_sizes == (1, 1, 2) and dp.weights is None


def test_dataparallel_constructor_errors():
    with pytest.raises(ValueError, match=r"chunk_sizes: expected 2"):
        dpmini.DataParallel(lambda x: x, D2, chunk_sizes=[1, 2, 3])
    with pytest.raises(ValueError, match=r"weights\[0\]"):
        dpmini.DataParallel(lambda x: x, D2, weights=[0, 1])


def test_data_parallel_function_chunk_sizes():
    out = dpmini.data_parallel(lambda x: x * 1, np.arange(5.0), D2, chunk_sizes=[4, 1])
    assert np.array_equal(out, np.arange(5.0))


def test_explain_shows_weights():
    plan = dpmini.explain((np.zeros((10, 3)),), D4, weights=[1, 2, 3, 4])
    assert plan.rule == "weights" and plan.weights == [1, 2, 3, 4]
    assert plan.leaves[0]["sizes"] == [1, 2, 3, 4]
    assert "weights=[1, 2, 3, 4]" in str(plan)
    bad = dpmini.explain((np.zeros(5),), D2, chunk_sizes=[2, 2])
    assert bad.error is not None and "sum to 4" in bad.error and bad.replicas == 0
