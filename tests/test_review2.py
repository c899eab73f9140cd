"""Regression tests for the findings of review 2, one section per finding.
The GPU findings (out_dims "sum" and None on GPU arrays) are in
tests/test_gpu_review2.py, which `make test-emulated` runs. Crash-prone
checks run in a subprocess with a timeout, so a segfault fails the test
instead of killing the suite."""
import copy
import io
import os
import pickle
import subprocess
import sys
import textwrap
import warnings

import numpy as np
import pytest

import dpmini
from dpmini.__main__ import main

D2 = ["cpu:0", "cpu:1"]
D4 = ["cpu:0", "cpu:1", "cpu:2", "cpu:3"]
TIMEOUT = 60


def run_script(body, *flags, env=None, timeout=TIMEOUT):
    code = textwrap.dedent(body)
    try:
        res = subprocess.run([sys.executable, *flags, "-c", code], capture_output=True,
                             text=True, timeout=timeout, env=env)
    except subprocess.TimeoutExpired:
        pytest.fail(f"the script did not finish in {timeout}s")
    assert res.returncode == 0, f"rc {res.returncode}\n" + res.stdout + res.stderr
    assert res.stdout.strip().endswith("OK"), res.stdout + res.stderr
    return res


# --- 1: copy / deepcopy / pickle keep in_dims, out_dims, chunk_sizes, weights ---

def _scaled_by_table(x, w):        # w is broadcast whole (in_dims None)
    return x * w.sum()


def _sum_model(x):
    return {"y": x, "n": x.shape[0]}


class Sub(dpmini.DataParallel):     # a subclass with the five PyTorch arguments
    def __init__(self, module, device_ids=None, output_device=None, dim=0, strict=False):
        super().__init__(module, device_ids, output_device, dim, strict)


@pytest.mark.parametrize("clone", [copy.copy, copy.deepcopy,
                                   lambda dp: pickle.loads(pickle.dumps(dp))],
                         ids=["copy", "deepcopy", "pickle"])
def test_1_clones_keep_the_extension_options(clone):
    x, w = np.ones(4), np.arange(4.0)
    dp = dpmini.DataParallel(_scaled_by_table, D2, in_dims=(0, None), out_dims=0,
                             weights=[1, 3])
    dp.note = "kept"
    c = clone(dp)
    assert (c.in_dims, c.out_dims, c.chunk_sizes, c.weights) == \
        (dp.in_dims, dp.out_dims, dp.chunk_sizes, dp.weights) == ((0, None), 0, None, (1, 3))
    assert c.note == "kept"
    np.testing.assert_array_equal(c(x, w), dp(x, w))          # [6, 6, 6, 6]
    np.testing.assert_array_equal(c(x, w), np.full(4, 6.0))

    dp = dpmini.DataParallel(_sum_model, D2, out_dims={"n": "sum"}, chunk_sizes=[1, 3])
    c = clone(dp)
    assert c.chunk_sizes == (1, 3) and c.out_dims == {"n": "sum"} and c.weights is None
    assert c(np.ones((4, 2)))["n"] == 4


def test_1_reduce_form_and_plain_objects():
    dp = dpmini.DataParallel(_sum_model, D2)
    assert dp.__reduce__()[2] is None                          # nothing to restore
    dp = dpmini.DataParallel(_sum_model, D2, in_dims={0: 1})
    state, slots = dp.__reduce__()[2]
    assert state is None and slots == {"in_dims": {0: 1}}
    s = Sub(_sum_model, D2)
    s.in_dims = (1,)
    c = copy.deepcopy(s)
    assert type(c) is Sub and c.in_dims == (1,)


# --- 4: in_dims / out_dims entries replaced during a call ---------------------

def test_4_out_dims_mutated_during_gather():
    run_script("""
        import numpy as np, dpmini, warnings
        warnings.simplefilter("ignore")
        class Spec(dict): pass
        class Evil:
            def __eq__(self, other):
                dp.out_dims["a"] = Spec(y=None, z=0)   # replaces the entry being walked
                return True
            __hash__ = object.__hash__
        dp = dpmini.DataParallel(lambda x: {"a": {"y": Evil(), "z": x}}, ["cpu:0", "cpu:1"],
                                 out_dims={"a": Spec(y=None, z=0)})
        for _ in range(20):
            out = dp(np.ones((4, 3)))
            assert out["a"]["z"].shape == (4, 3)
        print("OK")
    """, "-X", "dev")


def test_4_in_dims_mutated_during_scatter():
    run_script("""
        import numpy as np, dpmini, warnings
        warnings.simplefilter("ignore")
        class Spec(dict): pass
        class Batch(dict):
            def items(self):
                dp.in_dims[0] = Spec(x=0, y=None)
                return super().items()
            def keys(self):
                dp.in_dims[0] = Spec(x=0, y=None)
                return super().keys()
        dp = dpmini.DataParallel(lambda b: b["x"], ["cpu:0", "cpu:1"], in_dims=[Spec(x=0, y=None)])
        for _ in range(20):
            assert dp(Batch(x=np.ones((4, 3)), y=np.ones(2))).shape == (4, 3)
        for _ in range(20):   # the functional forms too
            dpmini.scatter(Batch(x=np.ones((4, 3)), y=np.ones(2)), ["cpu:0", "cpu:1"],
                           in_dims=dp.in_dims[0])
            dpmini.explain((Batch(x=np.ones((4, 3)), y=np.ones(2)),), ["cpu:0", "cpu:1"],
                           in_dims=dp.in_dims)
        print("OK")
    """, "-X", "dev")


def test_4_a_change_during_a_call_applies_from_the_next_call():
    spec = [0]
    seen = []

    class Batch(dict):
        def items(self):
            spec[0] = None                    # broadcast from now on
            return super().items()

    def model(b):
        seen.append(b["x"].shape)
        return b["x"]

    dp = dpmini.DataParallel(model, D2, out_dims=0)
    dp.in_dims = spec
    dp(Batch(x=np.ones((4, 3))))              # this call still splits on dim 0
    assert sorted(seen) == [(2, 3), (2, 3)]
    assert dp.in_dims == [None]


def test_4_chunk_sizes_list_mutated_by_index():
    class Sneaky:
        def __init__(self, v): self.v = v
        def __index__(self):
            sizes.clear()                     # the caller's list shrinks mid-parse
            return self.v
    sizes = [Sneaky(2), Sneaky(2)]
    out = dpmini.scatter(np.zeros((4, 2)), D2, chunk_sizes=sizes)
    assert [o.shape for o in out] == [(2, 2), (2, 2)]


def test_4_self_referencing_in_dims_is_an_error_not_a_crash():
    spec = []
    spec.append(spec)
    with pytest.raises(RecursionError):
        dpmini.scatter((np.zeros(4),), D2, in_dims=spec)


# --- 5: the chunk_sizes sum in the error message cannot overflow --------------

@pytest.mark.parametrize("sizes", [[2**62] * 4, [2**63 - 1] * 2 + [0, 0]])
def test_5_chunk_sizes_sum_overflow_message(sizes):
    with pytest.raises(ValueError) as info:
        dpmini.scatter(np.zeros((5, 2)), D4, chunk_sizes=sizes)
    msg = str(info.value)
    assert f"sum to more than {2**63 - 1}, but the array has size 5" in msg, msg
    assert "sum to -" not in msg and "sum to 0," not in msg


def test_5_chunk_sizes_sum_in_range_message():
    with pytest.raises(ValueError, match=r"chunk_sizes \[1, 1\] sum to 2, but the array "
                                         r"has size 5"):
        dpmini.scatter(np.zeros((5, 2)), D2, chunk_sizes=[1, 1])
    with pytest.raises(ValueError, match="sum to more than 9223372036854775807"):
        dpmini.scatter(np.zeros(5), D2, chunk_sizes=[2**63 - 1, 2**63 - 1])


# --- 6: the command line exits 2 with an argparse message, never a traceback --

BAD_CLI = [
    (["--shape", "100000000000,100000000000"], "--shape"),
    (["--shape", "5,3", "--dim", "99999999999"], "--dim"),
    (["--shape", "5,3", "--devices", "2", "--chunk-sizes", "99999999999999999999,1"],
     "--chunk-sizes"),
    (["--shape", "5,3", "--devices", "2", "--chunk-sizes", "-1,6"], "--chunk-sizes"),
    (["--shape", "5,3", "--devices", "3", "--chunk-sizes", "1,4"], "chunk_sizes"),
    (["--shape", "5,3", "--plot", "/nonexistent/dir/x.png"], "--plot"),
    (["--shape", "5,3", "--plot", "x.unknownext"], "--plot"),
    (["--shape", "5,3", "--dtype", "nosuchtype"], "--dtype"),
    (["--kw", "a=3", "--kw", "a=4"], "--kw"),
    (["--shape", "5", "--devices", "0"], "--devices"),
    (["--shape", "5", "--devices", "300"], "--devices"),
    ([], "--shape"),
]


@pytest.mark.parametrize("argv,option", BAD_CLI, ids=[" ".join(a) or "none" for a, _ in BAD_CLI])
def test_6_cli_bad_arguments_exit_2(argv, option, capsys, tmp_path, monkeypatch):
    if "--plot" in argv and "libasan" in os.environ.get("LD_PRELOAD", ""):
        # checking a --plot path imports matplotlib, which aborts under ASan
        pytest.skip("matplotlib cannot be imported under LD_PRELOAD ASan")
    monkeypatch.chdir(tmp_path)
    try:
        rc = main(["explain", *argv], out=io.StringIO())
    except SystemExit as exc:             # argparse's own errors
        rc = exc.code
    err = capsys.readouterr().err
    assert rc == 2, err
    assert "usage: python -m dpmini explain" in err, err
    assert "python -m dpmini explain: error:" in err and option in err, err
    assert "Traceback" not in err
    assert not list(tmp_path.iterdir())   # nothing printed or written before the check


def test_6_cli_subprocess_has_no_traceback():
    p = subprocess.run([sys.executable, "-m", "dpmini", "explain", "--shape",
                        "100000000000,100000000000"], capture_output=True, text=True,
                       timeout=TIMEOUT)
    assert p.returncode == 2 and "Traceback" not in p.stderr, p.stderr
    assert "error: --shape" in p.stderr


def test_6_cli_devices_count_and_list_documented():
    p = subprocess.run([sys.executable, "-m", "dpmini", "explain", "--help"],
                       capture_output=True, text=True, timeout=TIMEOUT)
    text = " ".join(p.stdout.split())
    assert "COUNT" in text and "LIST" in text and "0," in text
    rc = main(["explain", "--shape", "4", "--devices", "cpu:1"], out=io.StringIO())
    assert rc == 0                        # one named device is a list


def test_6_cli_plot_written_after_checks(tmp_path):
    pytest.importorskip("matplotlib")
    if "libasan" in os.environ.get("LD_PRELOAD", ""):
        pytest.skip("matplotlib cannot be imported under LD_PRELOAD ASan")
    out = io.StringIO()
    rc = main(["explain", "--shape", "5,3", "--plot", str(tmp_path / "p.svg")], out=out)
    assert rc == 0 and (tmp_path / "p.svg").stat().st_size > 1000


# --- 7, 8: Plan.plot() with many devices, and of a plan that would raise -----

def _matplotlib():
    if "libasan" in os.environ.get("LD_PRELOAD", ""):
        pytest.skip("matplotlib cannot be imported under LD_PRELOAD ASan")
    return pytest.importorskip("matplotlib")


@pytest.mark.parametrize("ndev,rows", [(17, 9), (64, 100), (256, 1000)])
def test_7_plot_legend_fits_with_many_devices(ndev, rows):
    mpl = _matplotlib()
    plan = dpmini.explain(np.zeros((rows, 3)), [f"cpu:{i}" for i in range(ndev)])
    with warnings.catch_warnings():
        warnings.simplefilter("error")    # no "Tight layout not applied"
        fig = plan.plot()
        fig.canvas.draw()
    ax = fig.axes[0]
    leg = ax.get_legend().get_window_extent()
    fb = fig.bbox
    assert fb.x0 <= leg.x0 and leg.x1 <= fb.x1 and fb.y0 <= leg.y0 and leg.y1 <= fb.y1
    labels = [t.get_text() for t in ax.get_legend().get_texts()]
    idle = ndev - plan.replicas
    if idle > 1:                          # the idle devices share one entry
        assert labels[-1] == f"cpu:{plan.replicas}..cpu:{ndev - 1}: nothing ({idle} devices)"
    assert len(labels) == plan.replicas + (1 if idle > 1 else idle)
    mpl.pyplot.close(fig)


def test_8_plot_of_an_error_plan_draws_no_device_colours():
    mpl = _matplotlib()
    plan = dpmini.explain((np.zeros(4), np.zeros(1)), D2, strict=True)
    assert plan.error and plan.replicas == 0
    fig = plan.plot()
    ax = fig.axes[0]
    device_colours = {tuple(c) for c in (mpl.colormaps["tab10"](i) for i in range(2))}
    assert not [p for p in ax.patches if tuple(p.get_facecolor()) in device_colours]
    assert len(ax.patches) == 2 and all(p.get_hatch() == ".." for p in ax.patches)
    assert ax.get_title().startswith("the call would raise: ")
    assert "strict=True" in ax.get_title().replace("\n", " ")
    assert [t.get_text() for t in ax.get_legend().get_texts()] == \
        ["cpu:0 (nothing)", "cpu:1 (nothing)"]
    mpl.pyplot.close(fig)


# --- 9: `python -m dpmini info` wording ---------------------------------------

def test_9_info_describes_the_pool_and_a_rejected_env():
    env = dict(os.environ, DPMINI_CPU_DEVICES="abc")
    p = subprocess.run([sys.executable, "-m", "dpmini", "info"], capture_output=True,
                       text=True, env=env, timeout=TIMEOUT)
    assert p.returncode == 0, p.stderr
    assert "one worker thread per device, more while its jobs overlap, up to 1024" in p.stdout
    assert "one worker thread each" not in p.stdout
    assert "$DPMINI_CPU_DEVICES='abc' rejected (not an int in 1..256)" in p.stdout
    assert "$DPMINI_CPU_DEVICES=abc)" not in p.stdout
    env["DPMINI_CPU_DEVICES"] = "3"
    p = subprocess.run([sys.executable, "-m", "dpmini", "info"], capture_output=True,
                       text=True, env=env, timeout=TIMEOUT)
    assert "virtual CPU devices: 3" in p.stdout and "rejected" not in p.stdout


# --- 10: out_dims None treats NaN as equal to NaN -----------------------------

def test_10_out_dims_none_nan_values():
    nan = float("nan")
    out = dpmini.gather([(1, nan), (1, float("nan"))], "cpu", out_dims=(None, None))
    assert out[0] == 1 and np.isnan(out[1])
    out = dpmini.gather([[complex(nan, 1)], [complex(nan, 1)]], "cpu", out_dims=[None])
    assert np.isnan(out[0].real)
    with pytest.raises(TypeError, match="different values"):
        dpmini.gather([(1, nan), (1, 2.0)], "cpu", out_dims=(None, None))


@pytest.mark.parametrize("dtype", ["float32", "float64", "complex128"])
def test_10_out_dims_none_nan_arrays(dtype):
    a = np.array([1.0, np.nan, 3.0], dtype=dtype)
    out = dpmini.gather([(a,), (a.copy(),)], "cpu", out_dims=(None,))
    np.testing.assert_array_equal(out[0], a)
    s = np.float64("nan")                  # NumPy scalars too
    assert np.isnan(dpmini.gather([[s], [np.float64("nan")]], "cpu", out_dims=[None])[0])
    with pytest.raises(TypeError, match="differs from replica 0's"):
        dpmini.gather([[a], [np.array([1.0, np.nan, 4.0], dtype=dtype)]], "cpu",
                      out_dims=[None])


def test_10_out_dims_none_other_dtypes():
    # (a top-level out_dims=None is the default: wrap the output to compare)
    ints = np.arange(3)
    assert dpmini.gather([(ints,), (ints.copy(),)], "cpu", out_dims=(None,))[0] is ints
    strs = np.array(["a", "b"])
    np.testing.assert_array_equal(
        dpmini.gather([(strs,), (strs.copy(),)], "cpu", out_dims=(None,))[0], strs)
    with pytest.raises(TypeError, match="differs"):               # shape differs
        dpmini.gather([(ints,), (ints[:2],)], "cpu", out_dims=(None,))
    dp = dpmini.DataParallel(lambda x: (x, np.array([np.nan, 1.0])), D2, out_dims=(0, None))
    y, same = dp(np.ones(4))
    assert np.isnan(same[0]) and same[1] == 1.0


# --- 11: docstrings and docs --------------------------------------------------

def test_11_docstrings():
    for fn in (dpmini.memory_allocated, dpmini.memory_reserved, dpmini.empty_cache):
        assert "Errors" in fn.__doc__ or "Raises" in fn.__doc__, fn
    assert ".status" in dpmini.DPError.__doc__
    assert "copy" in dpmini.Device.__reduce__.__doc__
    assert "dpmini.Array" in dpmini.device_of.__doc__
    doc = dpmini.DataParallel.__doc__
    assert "dtype" in doc and "object" in doc and "Shapes" in doc
    assert "tuple of ints" in dpmini.empty.__doc__
