"""The one conversion of int and real arguments (csrc/py/convert.c), Device
spellings, setters that accept what the constructor accepts, the one parser of
DPMINI_* environment variables, out= type messages, and explain's dtype text.

Rule under test (dpmini.h, dp_index_from_object): an int argument accepts int
and anything with __index__ (NumPy integer scalars of every width, 0-dim
integer arrays); bool (Python or NumPy), floats and arrays with dimensions are
TypeError naming the argument; out-of-range values are ValueError naming it.
"""
import os
import subprocess
import sys
import textwrap
import warnings

import numpy as np
import pytest

import dpmini
from dpmini import comm

DEVS = ["cpu:0", "cpu:1"]
X = np.arange(12.0).reshape(4, 3)

NP_INTS = [np.int8, np.int16, np.int32, np.int64, np.uint8, np.uint16, np.uint32, np.uint64,
           np.intp, np.uintp]


def ident(a):
    return a


# --- accepted: numpy integers of every width, 0-dim integer arrays, everywhere --

@pytest.mark.parametrize("kind", NP_INTS, ids=lambda t: t.__name__)
def test_numpy_integer_dims_accepted_everywhere(kind):
    one = kind(1)
    ref = dpmini.scatter(X, DEVS, dim=1)
    for got in (dpmini.scatter(X, DEVS, dim=one),
                dpmini.scatter(X, DEVS, dim=np.array(1, dtype=kind))):
        assert [g.shape for g in got] == [r.shape for r in ref]
    # in_dims / out_dims entries, a bare in_dims, dict keys of in_dims
    for in_dims in ((one,), one, {kind(0): one}, [one]):
        dp = dpmini.DataParallel(lambda a: (a,), device_ids=DEVS, in_dims=in_dims,
                                 out_dims=(one,))
        np.testing.assert_array_equal(dp(X)[0], X)
    dp = dpmini.DataParallel(lambda a: (a,), device_ids=DEVS, dim=1, out_dims=(kind(1),))
    np.testing.assert_array_equal(dp(X)[0], X)
    dp.in_dims = (kind(1),)
    dp.out_dims = [kind(1)]
    np.testing.assert_array_equal(dp(X)[0], X)
    got = dpmini.scatter(X, DEVS, chunk_sizes=[kind(1), kind(3)])
    assert [g.shape[0] for g in got] == [1, 3]
    got = comm.scatter(X, DEVS, chunk_sizes=[kind(1), np.array(3, dtype=kind)], dim=kind(0))
    assert [g.shape[0] for g in got] == [1, 3]
    got = dpmini.scatter(X, DEVS, weights=[kind(1), np.array(3, dtype=kind)])
    assert [g.shape[0] for g in got] == [1, 3]


def test_numpy_integer_device_indices():
    assert dpmini.Device(np.int64(-1)) == dpmini.Device(-1) == "cpu"
    assert dpmini.Device(np.uint8(3)) == dpmini.Device(3)
    # -1 for the host warns FutureWarning (docs/spec.md 4.3) whatever the int's type
    for host in (-1, np.int64(-1), np.int8(-1)):
        with pytest.warns(FutureWarning, match="Using -1 to represent CPU"):
            out = dpmini.gather([X[:2], X[2:]], host)
        assert dpmini.device_of(out) == "cpu"
        with pytest.warns(FutureWarning, match="Using -1 to represent CPU"):
            out = comm.gather([X[:2], X[2:]], destination=host)
        assert dpmini.device_of(out) == "cpu"
        with pytest.warns(FutureWarning, match="Using -1 to represent CPU"):
            dp = dpmini.DataParallel(ident, DEVS, output_device=host)
        assert dp.output_device == "cpu"


def test_numpy_floats_accepted_as_weights():
    for w in ([np.float32(1), np.float64(3)], [np.array(1.0), 3], [1, np.float16(3)]):
        got = dpmini.scatter(X, DEVS, weights=w)
        assert [g.shape[0] for g in got] == [1, 3]


# --- refused: each with the argument's name and what was expected ---------------

def scatter(**kw):
    return dpmini.scatter(X, DEVS, **kw)


REFUSED = [
    # (call, exception, words that must all appear)
    (lambda: scatter(chunk_sizes=[np.uint64(2**64 - 1), 1]), ValueError,
     ["chunk_sizes[0]", "18446744073709551615", "out of range", "int64"]),
    (lambda: scatter(chunk_sizes=[2**70, 1]), ValueError, ["chunk_sizes[0]", "out of range"]),
    (lambda: comm.scatter(X, DEVS, chunk_sizes=[np.uint64(2**64 - 1), 1]), ValueError,
     ["chunk_sizes[0]", "out of range"]),
    (lambda: scatter(chunk_sizes=[np.array([1]), 3]), TypeError,
     ["chunk_sizes[0]", "expected an int", "numpy.ndarray of shape (1,)"]),
    (lambda: comm.scatter(X, DEVS, chunk_sizes=[1, np.array([3])]), TypeError,
     ["chunk_sizes[1]", "expected an int", "shape (1,)"]),
    (lambda: scatter(chunk_sizes=[np.array(1.0), 3]), TypeError,
     ["chunk_sizes[0]", "expected an int", "numpy.ndarray"]),
    (lambda: scatter(chunk_sizes=[np.float64(1), 3]), TypeError,
     ["chunk_sizes[0]", "expected an int", "numpy.float64"]),
    (lambda: scatter(chunk_sizes=[np.True_, 3]), TypeError, ["chunk_sizes[0]", "bool"]),
    (lambda: scatter(chunk_sizes=[np.array(True), 3]), TypeError, ["chunk_sizes[0]", "int"]),
    (lambda: scatter(dim=np.array([1])), TypeError,
     ["dim", "expected an int", "numpy.ndarray of shape (1,)"]),
    (lambda: scatter(dim=np.zeros((0,), dtype=int)), TypeError, ["dim", "shape (0,)"]),
    (lambda: scatter(dim=np.True_), TypeError, ["dim", "expected an int", "bool"]),
    (lambda: scatter(dim=True), TypeError, ["dim", "expected an int", "bool"]),
    (lambda: scatter(dim=1.0), TypeError, ["dim", "expected an int", "float"]),
    (lambda: scatter(dim=np.float32(1)), TypeError, ["dim", "expected an int", "float32"]),
    (lambda: scatter(dim=2**40), ValueError, ["dim", "1099511627776", "out of range"]),
    (lambda: scatter(dim=np.uint64(2**64 - 1)), ValueError,
     ["dim", "18446744073709551615", "out of range", "2147483647"]),
    (lambda: comm.gather([X, X], dim=np.array([0])), TypeError, ["dim", "shape (1,)"]),
    (lambda: scatter(weights=[1, 2**1100]), ValueError,
     ["weights[1]", "out of range", "float64"]),
    (lambda: scatter(weights=[1, np.array([2.0])]), TypeError,
     ["weights[1]", "expected a real number", "shape (1,)"]),
    (lambda: scatter(weights=[np.True_, 1]), TypeError, ["weights[0]", "real number", "bool"]),
    (lambda: scatter(weights=[np.complex64(1), 1]), TypeError,
     ["weights[0]", "real number", "complex64"]),
    (lambda: scatter(weights=["1", 1]), TypeError, ["weights[0]", "real number", "str"]),
    (lambda: dpmini.DataParallel(ident, DEVS, in_dims=(np.array([0]),))(X), TypeError,
     ["in_dims[0]", "numpy.ndarray"]),
    (lambda: dpmini.DataParallel(ident, DEVS, in_dims=(np.uint64(2**64 - 1),))(X), ValueError,
     ["in_dims[0]", "out of range"]),
    (lambda: dpmini.DataParallel(ident, DEVS, out_dims=(np.float64(0),)), TypeError,
     ["out_dims[0]", "float64"]),
    (lambda: dpmini.DataParallel(ident, DEVS, in_dims={np.True_: 0})(X), TypeError,
     ["in_dims", "bool"]),
    (lambda: dpmini.Device(np.array([1])), TypeError, ["spec", "ndarray"]),
    (lambda: dpmini.Device(np.uint64(2**64 - 1)), ValueError, ["spec", "out of range"]),
]


@pytest.mark.parametrize("call,exc,words", REFUSED, ids=[str(i) for i in range(len(REFUSED))])
def test_bad_numbers_name_the_argument(call, exc, words):
    with pytest.raises(BaseException) as info:
        call()
    assert type(info.value) is exc, f"{type(info.value).__name__}: {info.value}"
    for w in words:
        assert w in str(info.value), (w, str(info.value))


def test_index_raising_other_errors_passes_them_through():
    class Boom:
        def __index__(self):
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        scatter(dim=Boom())

    class Refuses:
        def __index__(self):
            raise TypeError("no")

    with pytest.raises(TypeError, match=r"^dim: expected an int, got .*Refuses"):
        scatter(dim=Refuses())


# --- Device spellings: only the canonical one --------------------------------

@pytest.mark.parametrize("spec", ["cpu:00", "cpu:01", " cpu:0", "cpu:0 ", "cpu:+1", "+1",
                                  "cuda:00", "CPU:0", "cpu: 1", "cpu:\ud800", "\ud800"])
def test_non_canonical_device_spellings_are_refused(spec):
    with pytest.raises(ValueError, match=r"^spec: unknown device"):
        dpmini.Device(spec)
    with pytest.raises(ValueError, match=r"^target_devices\[1\]: unknown device"):
        dpmini.scatter(X, ["cpu:0", spec])


def test_canonical_device_strings_equal_and_hash_alike():
    for spec in ["cpu", "cpu:0", "cpu:10", "cpu:255", "cuda:0", "cuda:3"]:
        d = dpmini.Device(spec)
        assert d == spec and str(d) == spec and hash(d) == hash(spec)
        assert {d: 1}[spec] == 1


# --- setters accept what the constructor accepts -------------------------------

def test_setters_accept_what_the_constructor_accepts():
    dp = dpmini.DataParallel(ident, device_ids=["cpu:1", "cpu:0"], output_device=None)
    assert dp.output_device == "cpu:1"
    dp.output_device = "cpu:0"
    dp.output_device = None
    assert dp.output_device == "cpu:1"          # device_ids[0], as in the constructor
    dp.device_ids = ["cpu:2", "cpu:3"]
    dp.output_device = None
    assert dp.output_device == "cpu:2"
    dp.device_ids = None                         # the default devices, as in the constructor
    assert dp.device_ids == dpmini.DataParallel(ident).device_ids
    dp.dim = np.int32(1)
    assert dp.dim == 1 and type(dp.dim) is int
    dp.strict = np.True_
    assert dp.strict is True
    dp.output_device = "cpu"
    for name, value in [("in_dims", (np.int64(0),)), ("out_dims", np.int64(0)),
                        ("chunk_sizes", None), ("weights", None)]:
        setattr(dp, name, value)
    with pytest.raises(TypeError, match=r"^output_device: expected a device"):
        dp.output_device = 1.5


# --- one rule for DPMINI_* numbers ------------------------------------------

def _run(code, **env):
    e = dict(os.environ)
    e.update(env)
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=e,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.strip()


COUNT = """
import warnings, dpmini
with warnings.catch_warnings(record=True) as w:
    warnings.simplefilter("always")
    n = dpmini.cpu_device_count()
    dpmini.DataParallel(abs)
print(n, sum(issubclass(x.category, RuntimeWarning) for x in w))
"""

CACHE = """
import warnings, numpy as np, dpmini
with warnings.catch_warnings(record=True) as w:
    warnings.simplefilter("always")
    a = dpmini.asarray(np.ones(1000), "cpu:5")
del a
print(dpmini.memory_reserved("cpu:5") == 0, sum(issubclass(x.category, RuntimeWarning) for x in w))
"""


@pytest.mark.parametrize("text", [" 4", "4 ", "\t4", "04"])
def test_env_numbers_allow_spaces_around_them(text):
    assert _run(COUNT, DPMINI_CPU_DEVICES=text) == "4 0"
    assert _run(CACHE, DPMINI_CACHE_LIMIT=text.replace("4", "0")) == "True 0"


@pytest.mark.parametrize("text", ["+4", "-4", "4k", "0x4", "4 4", "4.0"])
def test_env_numbers_refuse_anything_else_alike(text):
    n, warned = _run(COUNT, DPMINI_CPU_DEVICES=text).split()
    assert int(n) >= 2 and warned == "2"     # cpu_device_count() and DataParallel() each warn
    assert _run(CACHE, DPMINI_CACHE_LIMIT=text.replace("4", "0")) == "False 1"


# --- out= of the wrong type ---------------------------------------------------

class ndarray:                         # an ndarray-like from another library
    def __init__(self):
        self.__array_interface__ = np.zeros((4, 3)).__array_interface__


ndarray.__module__ = "mylib"


def test_gather_out_names_the_full_type():
    with pytest.raises(TypeError) as info:
        comm.gather([X[:2], X[2:]], out=ndarray())
    msg = str(info.value)
    assert msg.startswith("out: expected a numpy.ndarray or a GPU array, got mylib.ndarray")
    assert "np.asarray" in msg
    with pytest.raises(TypeError, match=r"^out: .* got memoryview \(an array-like"):
        comm.gather([X[:2], X[2:]], out=memoryview(np.zeros((4, 3))))
    with pytest.raises(TypeError, match=r"^out\[1\]: .* got mylib.ndarray"):
        comm.scatter(X, out=[np.zeros((2, 3)), ndarray()])


# --- explain prints dtypes as NumPy writes them ------------------------------

@pytest.mark.parametrize("dtype", [np.dtype([("a", "<f8"), ("b", "<i4", (2,))]),
                                   np.dtype(">f4"), np.dtype("S5"), np.dtype("float32")])
def test_explain_prints_dtype_as_numpy_writes_it(dtype):
    text = str(dpmini.explain(np.zeros(4, dtype=dtype), DEVS))
    assert f"shape (4,) {dtype}, split" in text
    assert "void" not in text
