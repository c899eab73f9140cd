"""SplitWarning and strict=True follow one rule (leaf_drops_rows in
csrc/tree/scatter.c): both fire exactly when some split array loses rows,
that is, has rows in chunks past the replica count k (the smallest chunk
count over the split arrays). An array with 0 rows along its dim makes one
empty chunk per device but loses nothing, so it triggers neither.
"""
import random
import warnings

import numpy as np
import pytest

import dpmini


def chunk_count(n, ndev):
    """torch.chunk's count for n rows over ndev chunks (0 rows: ndev empty chunks)."""
    if n == 0:
        return ndev
    step = -(-n // ndev)
    return -(-n // step)


def drops_rows(sizes, ndev):
    """The rule, restated independently: some array has more rows than the
    first k chunks of it hold."""
    k = min(chunk_count(n, ndev) for n in sizes)
    for n in sizes:
        if n == 0:
            continue
        step = -(-n // ndev)
        if min(n, k * step) < n:
            return True
    return False


def outcome(call):
    """('warn'|'raise'|'quiet', replica count or None)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            res = call()
        except ValueError as exc:
            assert "strict=True" in str(exc)
            return "raise", None
    split = [w for w in caught if issubclass(w.category, dpmini.SplitWarning)]
    assert len(split) <= 1
    return ("warn" if split else "quiet"), len(res)


def test_zero_row_array_neither_warns_nor_raises():
    devs = ["cpu:0", "cpu:1"]
    args = (np.zeros(0), np.ones(1))
    assert outcome(lambda: dpmini.scatter(args, devs)) == ("quiet", 1)
    assert outcome(lambda: dpmini.scatter(args, devs, strict=True)) == ("quiet", 1)
    plan = dpmini.explain(args, devs, strict=True)
    assert not plan.error and not plan.warnings


def test_dropped_rows_warn_and_strict_raises():
    devs = ["cpu:0", "cpu:1"]
    args = (np.zeros(4), np.ones(1))
    assert outcome(lambda: dpmini.scatter(args, devs))[0] == "warn"
    assert outcome(lambda: dpmini.scatter(args, devs, strict=True))[0] == "raise"


def test_strict_raises_iff_split_warning_is_emitted():
    rng = random.Random(8)
    seen = set()
    for _ in range(400):
        ndev = rng.randint(1, 6)
        devs = [f"cpu:{i}" for i in range(ndev)]
        sizes = [rng.choice([0, 0, 1, 2, 3, 5, 7, 8, 13]) for _ in range(rng.randint(1, 4))]
        args = tuple(np.zeros((n, 2)) for n in sizes)
        loose, k = outcome(lambda: dpmini.scatter(args, devs))
        strict, _ = outcome(lambda: dpmini.scatter(args, devs, strict=True))
        assert (loose == "warn") == (strict == "raise"), (sizes, ndev, loose, strict)
        assert (loose == "warn") == drops_rows(sizes, ndev), (sizes, ndev, loose)
        # DataParallel and explain() follow the same rule
        dp = dpmini.DataParallel(lambda *a: len(a), device_ids=devs, strict=True,
                                 out_dims=None)
        dp_out, _ = outcome(lambda: [dp(*args)])
        assert (dp_out == "raise") == (strict == "raise"), (sizes, ndev)
        plan = dpmini.explain(args, devs, strict=True)
        assert bool(plan.error) == (strict == "raise"), (sizes, ndev, plan.error)
        plan = dpmini.explain(args, devs)
        assert bool(plan.warnings) == (loose == "warn"), (sizes, ndev, plan.warnings)
        seen.add(loose)
    assert seen == {"warn", "quiet"}   # both sides of the rule were exercised


@pytest.mark.parametrize("in_dims", [(0, 1), (1, 0)])
def test_rule_holds_with_in_dims_and_kwargs(in_dims):
    devs = ["cpu:0", "cpu:1", "cpu:2"]
    a, b = np.zeros((5, 0)), np.zeros((0, 5))
    # one array has 0 rows along its dim: never a warning
    args = (a, b) if in_dims == (0, 1) else (b, a)
    assert outcome(lambda: dpmini.scatter(args, devs, in_dims=in_dims))[0] == "quiet"
    assert outcome(lambda: dpmini.scatter(args, devs, in_dims=in_dims, strict=True))[0] == "quiet"
    kw = {"x": np.zeros(7), "y": np.zeros(1)}
    assert outcome(lambda: dpmini.scatter_kwargs((), kw, devs)[1])[0] == "warn"
    assert outcome(lambda: dpmini.scatter_kwargs((), kw, devs, strict=True))[0] == "raise"
