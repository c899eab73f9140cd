"""Bad-input catalogue (issue "Reliability", item 7): one table of hostile
inputs, each with its EXACT exception type and a message fragment that names
the argument. tests/test_argument_errors.py holds the first matrix (~94 cases);
nothing here repeats one of those. Cases marked "bug N" are regressions for
the bugs listed in docs/reliability.md.

Huge shapes cost no memory: they are zero-stride views (as_strided /
broadcast_to) of one element, so only their byte counts are huge.

test_catalogue_leaks_nothing runs the whole table three times and checks that
the reference counts of every shared input and dpmini's device memory come
back exactly.
"""
import gc
import re
import sys

import numpy as np
import pytest

import dpmini
from dpmini import comm

ast = np.lib.stride_tricks.as_strided
X = np.arange(12.0).reshape(4, 3)
Z8 = np.zeros(4, np.uint8)
ONE8 = np.zeros(1, np.uint8)
ROW = np.zeros(3)
D2 = ["cpu:0", "cpu:1"]
D4 = ["cpu:0", "cpu:1", "cpu:2", "cpu:3"]
ALL_DEVICES = ["cpu"] + D4
HAS_CUDA = dpmini.device_count() > 0
SHARED = (X, Z8, ONE8, ROW)   # refcounts checked around the whole table


def ident(x):
    return x


def huge8(n, *rest, writeable=False):
    """A uint8 view of n * prod(rest) elements over ONE byte (all strides 0)."""
    shape = (n, *rest)
    return ast(ONE8, shape=shape, strides=(0,) * len(shape), writeable=writeable)


def zero_stride_out(shape):
    """A writeable (n, 3) float64 view whose rows all alias one row."""
    return ast(ROW, shape=shape, strides=(0, 8), writeable=True)


def dp(fn, devices=D2, **kw):
    return dpmini.DataParallel(fn, device_ids=devices, **kw)


def by_first_value(outputs):
    """A replica that returns outputs[i] where i is the first value of its shard."""
    return lambda x: outputs[int(x.flat[0])]


def obj_array(n=4):
    return np.array([object() for _ in range(n)], dtype=object)


class RaisingArrayInterface:
    @property
    def __array_interface__(self):
        raise RuntimeError("broken __array_interface__")


class ClaimsCudaDLPack:
    """Host memory whose __dlpack_device__ says CUDA device 0."""

    def __dlpack__(self, *args, **kwargs):
        return X.__dlpack__()

    def __dlpack_device__(self):
        return (2, 0)


class EmptyCudaArrayInterface:
    """A CUDA Array Interface with no data (pointer 0) on the current device."""
    __cuda_array_interface__ = {"shape": (0,), "typestr": "<f4", "data": (0, False), "version": 3}


class KeysThatLie(dict):
    def keys(self):
        return ["zzz"]


# (id, call, exact exception type, regex the message must contain)
CATALOGUE = [
    # ------------------------------------------------ DataParallel(...) arguments
    ("dp-device_ids-single-str", lambda: dp(ident, "cpu:0"), TypeError, r"^device_ids: expected a list"),
    ("dp-device_ids-single-Device", lambda: dp(ident, dpmini.Device("cpu:0")), TypeError, r"^device_ids: .*single"),
    ("dp-device_ids-None-entry", lambda: dp(ident, ["cpu:0", None]), TypeError, r"^device_ids\[1\]: expected a device"),
    ("dp-device_ids-bool-entry", lambda: dp(ident, [True]), TypeError, r"^device_ids\[0\]: .*got bool"),
    ("dp-device_ids-bytes-entry", lambda: dp(ident, [b"cpu:0"]), TypeError, r"^device_ids\[0\]: .*got bytes"),
    ("dp-device_ids-bytes", lambda: dp(ident, b"cpu:0"), TypeError,
     r"^device_ids: expected a list of devices, got bytes \(device names are str"),
    ("dp-device_ids-bytearray", lambda: dp(ident, bytearray(b"\x00\x01")), TypeError,
     r"^device_ids: expected a list of devices, got bytearray"),
    ("dp-device_ids-memoryview", lambda: dp(ident, memoryview(b"\x00\x01")), TypeError,
     r"^device_ids: expected a list of devices, got memoryview"),
    ("parallel_apply-devices-bytes",
     lambda: dpmini.parallel_apply([ident, ident], [(1,), (2,)], devices=b"\x00\x01"), TypeError,
     r"^devices: expected a list of devices, got bytes \(device names are str"),
    ("dp-device_ids-257", lambda: dp(ident, ["cpu:0"] * 257), ValueError, r"^device_ids: at most 256 devices, got 257"),
    ("dp-device_ids-huge-int", lambda: dp(ident, [2 ** 70]), ValueError, r"^device_ids\[0\]: "),
    ("dp-device_ids-uppercase", lambda: dp(ident, ["CPU:0"]), ValueError, r"^device_ids\[0\]: unknown device 'CPU:0'"),
    ("dp-device_ids-space", lambda: dp(ident, ["cpu: 1"]), ValueError, r"^device_ids\[0\]: unknown device"),
    ("dp-device_ids-nul", lambda: dp(ident, ["cpu:0", "cpu:1\x00junk"]), ValueError,   # bug 6
     r"^device_ids\[1\]: unknown device 'cpu:1\\x00junk'"),
    ("dp-device_ids-index-overflow", lambda: dp(ident, ["cpu:99999999999999999999"]), ValueError,
     r"^device_ids\[0\]: unknown device"),
    ("dp-output_device-list", lambda: dp(ident, output_device=["cpu:0"]), TypeError, r"^output_device: .*got list"),
    ("dp-output_device-nul", lambda: dp(ident, output_device="cpu\x00"), ValueError,    # bug 6
     r"^output_device: unknown device"),
    ("dp-dim-huge", lambda: dp(ident, dim=2 ** 40), ValueError, r"^dim: 1099511627776 is out of range"),
    ("dp-dim-bool", lambda: dp(ident, dim=True), TypeError, r"^dim: expected an int, got bool"),
    # ---------------------------------------------------- DataParallel call inputs
    ("dp-dim-1-on-1d", lambda: dp(ident, dim=1)(np.zeros(4)), IndexError, r"Dimension out of range"),
    ("dp-nested-0dim", lambda: dp(ident)(X, [{"a": np.array(1.0)}]), dpmini.ZeroDimError,
     r"^args\[1\]\[0\]\['a'\]: chunk expects at least a 1-dimensional tensor"),
    ("dp-kwarg-object-dtype", lambda: dp(ident)(X, k=[obj_array()]), TypeError, r"^kwargs\['k'\]\[0\]: .*dtype object"),
    ("dp-structured-object-field", lambda: dp(ident)(np.zeros(4, dtype=[("a", "O"), ("b", "f8")])), TypeError,
     r"^args\[0\]: arrays holding Python objects"),
    ("dp-strict-mismatch", lambda: dp(lambda x, y: x, strict=True)(X, y=np.zeros(1)), ValueError, r"kwargs\['y'\]"),
    ("dp-huge-input", lambda: dp(ident)(huge8(2 ** 62)), MemoryError, r"cannot allocate \d+ bytes on device cpu:0"),
    # ------------------------------------------------------ replica outputs (gather)
    ("out-wider", lambda: dp(by_first_value({0: np.zeros((2, 3)), 6: np.zeros((2, 4))}))(X), ValueError,
     r"^out: Input array at index 1 has invalid shape \[2, 4\], but expected \[2, 3\]"),
    ("out-rank", lambda: dp(by_first_value({0: np.zeros((2, 3)), 6: np.zeros((2, 3, 1))}))(X), ValueError,
     r"^out: Expected all arrays to have the same number of dimensions"),
    ("out-none-vs-array", lambda: dp(by_first_value({0: None, 6: np.zeros(2)}))(X), TypeError, r"^out: .*None"),
    ("out-array-vs-list", lambda: dp(by_first_value({0: np.zeros(2), 6: [np.zeros(2)]}))(X), TypeError,
     r"^out: every replica must return an array here"),
    ("out-ragged-lists", lambda: dp(by_first_value({0: [X], 6: [X, X]}))(X), ValueError,
     r"^out: the replicas returned sequences of different lengths"),
    ("out-ragged-nested", lambda: dp(by_first_value({0: {"a": [X]}, 6: {"a": [X, X]}}))(X), ValueError,
     r"^out\['a'\]: .*different lengths"),
    ("out-dict-keys", lambda: dp(by_first_value({0: {"a": X}, 6: {"b": X}}))(X), ValueError, r"^out: .*key 'a'"),
    ("out-object-dtype", lambda: dp(lambda x: obj_array(len(x)))(X), TypeError, r"^out: .*dtype object"),
    ("out-different-floats", lambda: dp(lambda x: float(x[0, 0]))(X), TypeError, r"^out: the replicas returned different values"),
    ("out-0dim-other-dim", lambda: dp(lambda x: np.array(1.0), dim=1)(X), ValueError, r"^out: every replica returned a 0-dim array"),
    ("out-0dim-mixed", lambda: dp(by_first_value({0: np.array(1.0), 6: np.zeros(2)}))(X), ValueError,
     r"^out: some replicas returned 0-dim arrays"),
    ("out-huge-sum-overflows", lambda: dp(lambda x: huge8(2 ** 62), D4)(X), ValueError,   # bug 2
     r"^out: the gathered size along dimension 0 is larger than"),
    # ---------------------------------------------- functional forms, scatter, gather
    ("data_parallel-module_kwargs-int", lambda: dpmini.data_parallel(ident, X, D2, module_kwargs=5), TypeError,
     r"module_kwargs"),
    ("data_parallel-output_device-bad", lambda: dpmini.data_parallel(ident, X, D2, output_device="cpu:x"), ValueError,
     r"^output_device: unknown device"),
    ("replicate-devices-str", lambda: dpmini.replicate(ident, "cpu:0"), TypeError, r"^devices: expected a list of devices"),
    ("scatter-strict", lambda: dpmini.scatter((X, np.zeros(1)), D2, strict=True), ValueError, r"\[1\]"),
    ("gather-outputs-int", lambda: dpmini.gather(5, "cpu"), TypeError, r"^outputs: expected a list or tuple"),
    ("gather-outputs-empty", lambda: dpmini.gather([], "cpu"), ValueError, r"^outputs: expected at least one"),
    ("gather-huge-sum-overflows", lambda: dpmini.gather([huge8(2 ** 62)] * 4, "cpu"), ValueError,   # bug 2
     r"^out: the gathered size along dimension 0 is larger than"),
    ("explain-kwargs-list", lambda: dpmini.explain(X, D2, kwargs=[1]), TypeError,   # bug 7
     r"^kwargs: expected a mapping"),
    # ----------------------------------------------------------------- comm.scatter
    ("comm-scatter-chunk-sum-overflows", lambda: comm.scatter(X, D4[:3], chunk_sizes=[2 ** 62] * 3), ValueError,  # bug 1
     r"^chunk_sizes: .*sum exactly to 4 .*larger than 9223372036854775807"),
    ("comm-scatter-chunk-size-int-overflow", lambda: comm.scatter(X, D2, chunk_sizes=[2 ** 70, 1]), ValueError,  # bug 4
     r"^chunk_sizes\[0\]: 1180591620717411303424 is out of range"),
    ("comm-scatter-chunk-size-None", lambda: comm.scatter(X, D2, chunk_sizes=[2, None]), TypeError,
     r"^chunk_sizes\[1\]: expected an int, got NoneType"),
    ("comm-scatter-chunk-size-bool", lambda: comm.scatter(X, D2, chunk_sizes=[True, 3]), TypeError,
     r"^chunk_sizes\[0\]: expected an int, got bool"),
    ("comm-scatter-out-and-devices", lambda: comm.scatter(X, D2, out=[X.copy()]), ValueError, r"^out: 'devices'"),
    ("comm-scatter-out-int", lambda: comm.scatter(X, out=5), TypeError, r"^out: expected a sequence of arrays"),
    ("comm-scatter-out-entry-str", lambda: comm.scatter(X, out=[np.zeros((2, 3)), "x"]), TypeError,
     r"^out\[1\]: expected a numpy.ndarray or a GPU array, got str"),
    ("comm-scatter-out-dtype", lambda: comm.scatter(X, out=[np.zeros((2, 3), np.float32), np.zeros((2, 3))]),
     TypeError, r"^out\[0\]: expected dtype float64, got float32"),
    ("comm-scatter-out-rank", lambda: comm.scatter(X, out=[np.zeros((2, 3, 1)), np.zeros((2, 3))]), ValueError,
     r"^out\[0\]: Output array has incorrect shape: expected 2 dimensions"),
    ("comm-scatter-out-broadcast-readonly", lambda: comm.scatter(X, out=[np.zeros((2, 3)), np.broadcast_to(ROW, (2, 3))]),
     ValueError, r"^out\[1\]: output array is read-only"),
    ("comm-scatter-out-zero-stride", lambda: comm.scatter(X, out=[np.zeros((2, 3)), zero_stride_out((2, 3))]),  # bug 5
     ValueError, r"^out\[1\]: unsupported operation: more than one element of the written-to array"),
    ("comm-scatter-out-is-source", lambda: comm.scatter(X, out=[X[1:3], np.zeros((2, 3))]), ValueError,  # bug 5
     r"^out\[0\]: unsupported operation: the written-to array overlaps the memory of array"),
    ("comm-scatter-out-aliases-out", lambda: (lambda b: comm.scatter(X, out=[b[:2], b[1:]]))(np.zeros((3, 3))),  # bug 5
     ValueError, r"^out\[1\]: unsupported operation: the written-to array overlaps the memory of out\[0\]"),
    # 4 * (2**62 + 1) wraps to exactly 4: before bugs 3 and 5 were fixed this passed the size
    # check and read 2**62 bytes past Z8 (a segfault); now the zero-stride check stops it first
    ("comm-scatter-out-total-overflows", lambda: comm.scatter(Z8, out=[huge8(2 ** 62 + 1, writeable=True)] * 4),  # bug 3
     ValueError, r"^out\[0\]: unsupported operation: more than one element"),
    ("comm-scatter-huge", lambda: comm.scatter(huge8(2 ** 62), D2), MemoryError, r"cannot allocate \d+ bytes on device cpu:0"),
    ("comm-scatter-array-interface-raises", lambda: comm.scatter(RaisingArrayInterface(), D2), RuntimeError,
     r"broken __array_interface__"),  # the getter's own error propagates (review1 f16)
    ("comm-scatter-devices-str", lambda: comm.scatter(X, "cpu:0"), TypeError, r"^devices: expected a list of devices"),
    # ------------------------------------------------------------------ comm.gather
    ("comm-gather-arrays-int", lambda: comm.gather(5), TypeError, r"^arrays: expected a sequence of arrays, got int"),
    ("comm-gather-destination-list", lambda: comm.gather([X], destination=["cpu:0"]), TypeError,
     r"^destination: expected a device"),
    ("comm-gather-destination-nul", lambda: comm.gather([X], destination="cpu:0\x00"), ValueError,  # bug 6
     r"^destination: unknown device"),
    ("comm-gather-sum-overflows", lambda: comm.gather([huge8(2 ** 62)] * 4), ValueError,   # bug 2
     r"^arrays: the gathered size along dimension 0 is larger than .* index 1"),
    ("comm-gather-sum-is-2-pow-63", lambda: comm.gather([huge8(2 ** 62)] * 2), ValueError,   # bug 2
     r"^arrays: the gathered size along dimension 0"),
    ("comm-gather-dim1-sum-overflows", lambda: comm.gather([huge8(2, 2 ** 61)] * 4, dim=1), ValueError,  # bug 2
     r"^arrays: the gathered size along dimension 1 is larger than .* index 3"),
    ("comm-gather-dim1-bytes-too-big", lambda: comm.gather([huge8(2, 2 ** 61)] * 3, dim=1), ValueError,  # bug 9
     r"array is too big: its byte count overflows"),
    ("empty-negative-dim", lambda: dpmini.empty((-1,), "f8", "cpu"), ValueError,
     r"^shape\[0\] is -1: dimensions must be >= 0"),
    ("empty-negative-second-dim", lambda: dpmini.empty((3, -2), "f8", "cpu:1"), ValueError,
     r"^shape\[1\] is -2: dimensions must be >= 0"),
    ("comm-gather-huge-alloc", lambda: comm.gather([huge8(2 ** 50)] * 2, destination="cpu:1"), MemoryError,
     r"cannot allocate \d+ bytes on device cpu:1"),
    ("comm-gather-out-zero-stride", lambda: comm.gather([X, X], out=zero_stride_out((8, 3))), ValueError,  # bug 5
     r"^out: unsupported operation: more than one element"),
    ("comm-gather-out-is-input", lambda: comm.gather([X[:2], X[2:]], out=X), ValueError,  # bug 5
     r"^out: unsupported operation: the written-to array overlaps the memory of arrays\[0\]"),
    ("comm-gather-out-partly-input", lambda: (lambda b: comm.gather([b[5:], X], out=b[:8]))(np.zeros((9, 3))),  # bug 5
     ValueError, r"^out: .*arrays\[0\]"),
    # -------------------------------------------------------- broadcast and reduce
    ("comm-broadcast-devices-str", lambda: comm.broadcast(X, "cpu:0"), TypeError, r"^devices: expected a list"),
    ("comm-broadcast-host", lambda: comm.broadcast(X, ["cpu:0", "cpu"]), ValueError, r"^devices\[1\]: expected a non-host"),
    ("comm-broadcast-int", lambda: comm.broadcast(42, D2), TypeError, r"^array: expected an array"),
    ("comm-broadcast-huge", lambda: comm.broadcast(huge8(2 ** 62), D2), MemoryError, r"on device cpu:0"),
    ("comm-broadcast_coalesced-buffer_size-0", lambda: comm.broadcast_coalesced([X], D2, buffer_size=0), ValueError,
     r"^buffer_size: expected a positive number of bytes, got 0"),
    ("comm-broadcast_coalesced-buffer_size-str", lambda: comm.broadcast_coalesced([X], D2, buffer_size="1"), TypeError,
     r"^buffer_size: expected an int, got str"),
    ("scatter-dlpack-on-cuda-unseen", lambda: dpmini.scatter(ClaimsCudaDLPack(), D2), BufferError,
     r"^inputs: DLPack tensor on CUDA device 0, but dpmini sees no CUDA device \(built without"),
    ("comm-scatter-cai-on-cuda-unseen", lambda: comm.scatter(EmptyCudaArrayInterface(), D2),
     BufferError, r"^array: memory on CUDA device 0, but dpmini sees no CUDA device"),
    ("gather-dict-keys-lie", lambda: dpmini.gather([KeysThatLie(a=X), KeysThatLie(a=X)], "cpu"),
     ValueError, r"^out: replica 0 returned a dict whose keys\(\) gives the key 'zzz', which it "
     r"has no item for"),
    ("comm-broadcast_coalesced-int", lambda: comm.broadcast_coalesced(5, D2), TypeError, r"^arrays: expected a sequence"),
    ("comm-broadcast_coalesced-object", lambda: comm.broadcast_coalesced([X, obj_array()], D2), TypeError,
     r"^arrays\[1\]: arrays holding Python objects"),
    ("comm-broadcast_coalesced-huge", lambda: comm.broadcast_coalesced([huge8(2 ** 62)] * 4, D2), MemoryError,
     r"on device cpu:0"),
    ("comm-reduce_add-int", lambda: comm.reduce_add(5), TypeError, r"^arrays: expected a sequence"),
    ("comm-reduce_add-entry-str", lambda: comm.reduce_add([X, "x"]), TypeError, r"^arrays\[1\]: expected an array"),
    ("comm-reduce_add-object", lambda: comm.reduce_add([obj_array(), obj_array()]), TypeError,
     r"^arrays\[0\]: arrays holding Python objects"),
    ("comm-reduce_add-destination-list", lambda: comm.reduce_add([X, X], destination=["cpu:0"]), TypeError,
     r"^destination: expected a device"),
    ("comm-reduce_add-huge", lambda: comm.reduce_add([huge8(2 ** 62)] * 2), MemoryError, r"cannot allocate"),
    ("comm-reduce_add_coalesced-int", lambda: comm.reduce_add_coalesced(5), TypeError,
     r"^per_device: expected a sequence of per-device sequences"),
    ("comm-reduce_add_coalesced-flat", lambda: comm.reduce_add_coalesced([X, X]), TypeError,
     r"^per_device\[0\]: expected a sequence of arrays"),
    ("comm-reduce_add_coalesced-empty", lambda: comm.reduce_add_coalesced([]), ValueError,
     r"^per_device: expected at least one"),
    ("comm-reduce_add_coalesced-buffer_size", lambda: comm.reduce_add_coalesced([[X], [X]], buffer_size=-5),
     ValueError, r"^buffer_size: expected a positive number of bytes, got -5"),
    ("comm-reduce_add_coalesced-shape", lambda: comm.reduce_add_coalesced([[X], [X[:2]]]), ValueError,
     r"^per_device\[:\]\[0\]: input 1 has invalid size"),
    # --------------------------------------------------------------- parallel_apply
    ("parallel_apply-modules-int", lambda: dpmini.parallel_apply(5, [(X,)]), TypeError, r"modules must be a sequence"),
    ("parallel_apply-inputs-int", lambda: dpmini.parallel_apply([ident], 5), TypeError, r"inputs must be a sequence"),
    ("parallel_apply-kwargs-entry", lambda: dpmini.parallel_apply([ident], [(X,)], [5]), TypeError,
     r"^kwargs_tup\[0\]: expected a dict"),
    ("parallel_apply-host-device", lambda: dpmini.parallel_apply([ident], [(X,)], None, ["cpu"]), ValueError,
     r"^devices\[0\]: expected a non-host device"),
    # --------------------------------------------------------- devices and memory
    ("Device-nul", lambda: dpmini.Device("cpu:1\x00"), ValueError, r"^spec: unknown device 'cpu:1\\x00'"),  # bug 6
    ("Device-trailing-space", lambda: dpmini.Device("cpu:1 "), ValueError, r"^spec: unknown device 'cpu:1 '"),
    ("Device-huge-index", lambda: dpmini.Device("cpu:99999999999999999999"), ValueError, r"^spec: unknown device"),
    ("memory_reserved-cuda", lambda: dpmini.memory_reserved("cuda:0"), ValueError, r"^device: CUDA device 0"),
    ("memory_allocated-float", lambda: dpmini.memory_allocated(1.5), TypeError, r"^device: expected a device"),
    ("asarray-device-list", lambda: dpmini.asarray(X, ["cpu:0"]), TypeError, r"^device: expected a device"),
    ("asarray-object-array", lambda: dpmini.asarray(obj_array(), "cpu:0"), TypeError, r"^obj: "),
    ("asarray-huge", lambda: dpmini.asarray(huge8(2 ** 62), "cpu:1"), MemoryError, r"on device cpu:1"),
    ("device_of-None", lambda: dpmini.device_of(None), TypeError, r"^array: expected a numpy.ndarray"),
]

if HAS_CUDA:   # the CUDA-absent messages are only checked without a GPU
    CATALOGUE = [c for c in CATALOGUE if "cuda" not in c[0]]


@pytest.mark.parametrize("call,exc,pattern", [c[1:] for c in CATALOGUE], ids=[c[0] for c in CATALOGUE])
def test_bad_input_catalogue(call, exc, pattern):
    with pytest.raises(BaseException) as info:
        call()
    assert type(info.value) is exc, f"raised {type(info.value).__name__}: {info.value}"
    msg = str(info.value)
    assert re.search(pattern, msg, re.S), f"message {msg!r} does not match {pattern!r}"


def test_catalogue_is_large_and_new():
    from test_argument_errors import CASES

    assert len(CATALOGUE) >= 60
    ids = [c[0] for c in CATALOGUE]
    assert len(set(ids)) == len(ids)
    assert not set(ids) & {p.id for p in CASES}


def _device_bytes():
    return [dpmini.memory_allocated(d) for d in ALL_DEVICES]


def test_catalogue_leaks_nothing():
    def run_all():
        for _, call, exc, _ in CATALOGUE:
            try:
                call()
            except exc:
                pass
            # anything else is reported by test_bad_input_catalogue

    run_all()   # warm-up: caches, interned strings, lazily created objects
    gc.collect()
    refs = [sys.getrefcount(o) for o in SHARED]
    mod_refs = sys.getrefcount(dpmini._dpmini)
    dev0 = _device_bytes()
    for _ in range(3):
        run_all()
    gc.collect()
    refs_after = [sys.getrefcount(o) for o in SHARED]
    mod_refs_after = sys.getrefcount(dpmini._dpmini)
    assert refs_after == refs
    assert mod_refs_after == mod_refs
    assert _device_bytes() == dev0


def test_misaligned_and_zero_stride_inputs_are_fine():
    """Not errors: unaligned buffers and broadcast (zero-stride) SOURCES are
    valid inputs and copy exactly."""
    raw = np.frombuffer(bytearray(8 * 12 + 1), dtype=np.float64, offset=1).reshape(4, 3)
    assert not raw.flags.aligned
    np.copyto(raw, X) if raw.flags.writeable else None
    for src in (raw, np.broadcast_to(ROW + 1, (4, 3))):
        chunks = comm.scatter(src, D2)
        np.testing.assert_array_equal(comm.gather(chunks), src)
    out = np.frombuffer(bytearray(8 * 24 + 1), dtype=np.float64, offset=1).reshape(8, 3)
    comm.gather([X, X], out=out)
    np.testing.assert_array_equal(out, np.concatenate([X, X]))


def test_duplicate_devices_are_allowed():
    """A repeated device is not an error (docs/differences.md: its one worker runs the
    replicas one after another); the result is exact."""
    np.testing.assert_array_equal(dp(lambda x: x * 2, ["cpu:1", "cpu:1", "cpu:0"])(X), X * 2)
    b = comm.broadcast(X, ["cpu:1", "cpu:1"])
    assert b[0] is not b[1] or b[0] is X
    np.testing.assert_array_equal(b[1], X)
