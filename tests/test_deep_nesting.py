"""Deeply nested structures give RecursionError, never a crash (docs/spec.md 10.5).

Every walker (scatter, scatter_kwargs, gather, explain, replicate,
DataParallel on the base type and on a subclass, in_dims / out_dims) bounds
its depth with DP_MAX_NESTING (csrc/tree/tree.h): CPython's recursion guard alone
does not protect the C stack once sys.setrecursionlimit() is raised. The
crash cases run in a subprocess with a timeout, with the limit raised to
10**6; a segfault there shows as a negative return code.
"""
import subprocess
import sys
import textwrap

import numpy as np
import pytest

import dpmini

D2 = ["cpu:0", "cpu:1"]
MAX_NESTING = 512  # DP_MAX_NESTING in csrc/tree/tree.h

CHILD = textwrap.dedent(
    """
    import sys, numpy as np, dpmini
    sys.setrecursionlimit(10**6)
    D2 = ["cpu:0", "cpu:1"]

    def deep(leaf, n=30000, make=lambda c: (c,)):
        for _ in range(n):
            leaf = make(leaf)
        return leaf

    x = np.arange(4.0)
    t = deep(x)
    lst = deep(x, make=lambda c: [c])
    dct = deep(x, make=lambda c: {"k": c})
    spec = deep(0)

    class Holder:
        def __init__(self, v):
            self.v = v
        def __call__(self, a):
            return self.v

    class MyDP(dpmini.DataParallel):
        pass

    cases = {
        "scatter tuple": lambda: dpmini.scatter(t, D2),
        "scatter list": lambda: dpmini.scatter(lst, D2),
        "scatter dict": lambda: dpmini.scatter(dct, D2),
        "scatter_kwargs args": lambda: dpmini.scatter_kwargs((t,), None, D2),
        "scatter_kwargs kwargs": lambda: dpmini.scatter_kwargs((), {"a": t}, D2),
        "scatter in_dims": lambda: dpmini.scatter((x,), D2, in_dims=spec),
        "gather": lambda: dpmini.gather([t, t], "cpu"),
        "gather dict": lambda: dpmini.gather([dct, dct], "cpu"),
        "gather out_dims": lambda: dpmini.gather([(x,), (x,)], "cpu", out_dims=spec),
        "explain": lambda: dpmini.explain(t, D2),
        "DataParallel input": lambda: dpmini.DataParallel(lambda a: a, D2)(t),
        "DataParallel output": lambda: dpmini.DataParallel(Holder(t), D2)(x),
        "subclass input": lambda: MyDP(lambda a: a, D2)(t),
        "subclass output": lambda: MyDP(Holder(t), D2)(x),
        "data_parallel": lambda: dpmini.data_parallel(lambda a: a, (t,), D2),
    }
    for name, f in cases.items():
        try:
            f()
            print(name, "OK", sep="\\t")
        except RecursionError as e:
            print(name, "RecursionError", sep="\\t")
        except Exception as e:
            print(name, "OTHER " + type(e).__name__, sep="\\t")

    # replicate follows the same bound (docs/design.md)
    h = Holder((np.zeros(2), t))
    try:
        dpmini.replicate(h, D2)
        print("replicate", "OK", sep="\\t")
    except RecursionError:
        print("replicate", "RecursionError", sep="\\t")
    """
)


def test_30000_deep_structures_raise_recursion_error_in_a_subprocess():
    proc = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, (proc.returncode, proc.stdout[-2000:], proc.stderr[-2000:])
    lines = dict(line.split("\t", 1) for line in proc.stdout.splitlines())
    expected_recursion = [
        "scatter tuple", "scatter list", "scatter dict", "scatter_kwargs args",
        "scatter_kwargs kwargs", "scatter in_dims", "gather", "gather dict",
        "gather out_dims", "explain", "DataParallel input", "DataParallel output",
        "subclass input", "subclass output", "data_parallel", "replicate",
    ]
    for name in expected_recursion:
        assert lines.get(name) == "RecursionError", (name, proc.stdout)


def _nested(leaf, n, make=lambda c: (c,)):
    for _ in range(n):
        leaf = make(leaf)
    return leaf


def test_nesting_within_the_limit_is_scattered_and_gathered():
    x = np.arange(4.0)
    t = _nested(x, 400)
    parts = dpmini.scatter(t, D2)
    leaf = parts[1]
    for _ in range(400 - 1):
        leaf = leaf[0]
    np.testing.assert_array_equal(leaf[0], [2.0, 3.0])
    g = dpmini.gather(parts, "cpu")
    for _ in range(400):
        g = g[0]
    np.testing.assert_array_equal(g, x)


def test_the_error_names_the_path_prefix_and_the_limit():
    t = _nested(np.zeros(4), MAX_NESTING + 5, make=lambda c: {"k": c})
    with pytest.raises(RecursionError) as info:
        dpmini.scatter(("s", t), D2)
    msg = str(info.value)
    assert msg.startswith("inputs[1]['k']['k']['k']")
    assert "more levels" in msg and str(MAX_NESTING) in msg
    with pytest.raises(RecursionError) as info:
        dpmini.gather([{"o": t}, {"o": t}], "cpu")
    assert str(info.value).startswith("out['o']['k']['k']")


def test_self_referencing_dict_input_names_the_path():
    d = {"x": np.zeros(4)}
    d["self"] = d
    with pytest.raises(RecursionError) as info:
        dpmini.scatter_kwargs((), {"batch": d}, D2)
    msg = str(info.value)
    assert msg.startswith("kwargs['batch']['self']['self']")
    assert "inside itself" in msg
    with pytest.raises(RecursionError) as info:
        dpmini.DataParallel(lambda **kw: 0, D2)(batch=d)
    assert "kwargs['batch']['self']" in str(info.value)


def test_self_referencing_list_output_names_the_path():
    out = [np.zeros(2)]
    out.append(out)
    with pytest.raises(RecursionError) as info:
        dpmini.gather([out, out], "cpu")
    assert str(info.value).startswith("out[1][1][1]")


def test_deep_in_dims_names_its_root():
    spec = _nested(0, MAX_NESTING + 5, make=lambda c: [c])
    with pytest.raises(RecursionError, match=r"^in_dims: nested deeper than"):
        dpmini.scatter((np.zeros(4),), D2, in_dims=spec)


def test_a_key_whose_repr_fails_is_shown_by_its_type():
    class BadRepr:
        def __repr__(self):
            raise RuntimeError("no repr")

    with pytest.raises(IndexError) as info:
        dpmini.scatter({BadRepr(): np.zeros(4)}, D2, dim=3)
    assert str(info.value).startswith("inputs[<BadRepr key>]")


class _Holder:
    def __init__(self, v):
        self.v = v


def test_replicate_copies_arrays_deep_within_the_limit():
    x = np.arange(4.0)
    h = _Holder(_nested(x, 400, make=lambda c: [c]))
    reps = dpmini.replicate(h, D2)
    leaf = reps[1].v
    for _ in range(400):
        leaf = leaf[0]
    assert leaf is not x                       # copied to cpu:1, not shared
    np.testing.assert_array_equal(leaf, x)


def test_replicate_deeper_than_the_limit_raises_naming_the_path():
    h = _Holder(_nested(np.zeros(4), MAX_NESTING + 5, make=lambda c: [c]))
    with pytest.raises(RecursionError) as info:
        dpmini.replicate(h, D2)
    msg = str(info.value)
    assert msg.startswith("module.v[0][0][0]"), msg
    assert "more levels" in msg and str(MAX_NESTING) in msg


def test_gather_shows_a_key_whose_repr_fails_by_its_type():
    class BadRepr:
        def __repr__(self):
            raise RuntimeError("no repr")

    with pytest.raises(ValueError) as info:
        dpmini.gather([{BadRepr(): np.ones(1)}, {BadRepr(): np.ones(1)}], "cpu")
    msg = str(info.value)
    assert msg.startswith("out: replica 1 returned a dict without the key <BadRepr key>"), msg
