"""Bad-input matrix: every caller mistake raises ValueError / TypeError /
IndexError (BufferError for buffers) and the message names the argument
(design: "Caller mistakes ...", docs/spec.md 0.6-0.7, 4.6, 4.8, 6.1, 8.1-8.5)."""
import re

import numpy as np
import pytest

import dpmini
from dpmini import comm

X = np.arange(12.0).reshape(4, 3)
D2 = ["cpu:0", "cpu:1"]
HAS_CUDA = dpmini.device_count() > 0
no_gpu = pytest.mark.skipif(HAS_CUDA, reason="checks the errors of a machine without CUDA")


def ident(x):
    return x


def readonly(shape):
    a = np.zeros(shape)
    a.flags.writeable = False
    return a


def obj_array():
    return np.array([object(), object(), object(), object()], dtype=object)


CASES = [
    # ----------------------------------------------------- DataParallel(...)
    pytest.param(lambda: dpmini.DataParallel(ident, device_ids=5), TypeError, r"device_ids", id="dp-device_ids-int"),
    pytest.param(lambda: dpmini.DataParallel(ident, device_ids=[1.5]), TypeError, r"device_ids\[0\]",
                 id="dp-device_ids-float-entry"),
    pytest.param(lambda: dpmini.DataParallel(ident, device_ids=["cpu:0", object()]), TypeError, r"device_ids\[1\]",
                 id="dp-device_ids-object-entry"),
    pytest.param(lambda: dpmini.DataParallel(ident, device_ids=[]), ValueError, r"device_ids", id="dp-empty-devices"),
    pytest.param(lambda: dpmini.DataParallel(ident, device_ids=["cpu"]), ValueError,
                 r"(?i)expected a non-host device", id="dp-host-string"),
    pytest.param(lambda: dpmini.DataParallel(ident, device_ids=["cpu:0", -1]), ValueError,
                 r"device_ids\[1\].*(?i:non-host)|(?i:non-host).*device_ids\[1\]", id="dp-host-minus-one"),
    pytest.param(lambda: dpmini.DataParallel(ident, device_ids=["gpu:0"]), ValueError, r"device_ids\[0\]",
                 id="dp-gpu-string"),
    pytest.param(lambda: dpmini.DataParallel(ident, device_ids=["cpu:x"]), ValueError, r"device_ids\[0\]",
                 id="dp-cpu-x"),
    pytest.param(lambda: dpmini.DataParallel(ident, device_ids=["cpu:0", "cpu:-1"]), ValueError,
                 r"device_ids\[1\]", id="dp-cpu-minus-1"),
    pytest.param(lambda: dpmini.DataParallel(ident, device_ids=["cpu:999"]), ValueError, r"device_ids\[0\]",
                 id="dp-cpu-999"),
    pytest.param(lambda: dpmini.DataParallel(ident, device_ids=["cpu:256"]), ValueError, r"device_ids\[0\]",
                 id="dp-cpu-256"),
    pytest.param(lambda: dpmini.DataParallel(ident, device_ids=["cpu:0", "cuda:0"]), ValueError,
                 r"device_ids\[1\].*CUDA|CUDA.*device_ids\[1\]", id="dp-cuda-string", marks=no_gpu),
    pytest.param(lambda: dpmini.DataParallel(ident, device_ids=[0, 1]), ValueError,
                 r"device_ids\[0\].*CUDA|CUDA.*device_ids\[0\]", id="dp-cuda-int", marks=no_gpu),
    pytest.param(lambda: dpmini.DataParallel(ident, device_ids=["cuda"]), ValueError, r"CUDA", id="dp-cuda-bare",
                 marks=no_gpu),
    pytest.param(lambda: dpmini.DataParallel(ident, device_ids=[-2]), ValueError, r"device_ids\[0\]",
                 id="dp-negative-int"),
    pytest.param(lambda: dpmini.DataParallel(ident, device_ids=D2, output_device="gpu"), ValueError,
                 r"output_device", id="dp-output-device-bad"),
    pytest.param(lambda: dpmini.DataParallel(ident, device_ids=D2, output_device="cuda:0"), ValueError,
                 r"output_device.*CUDA|CUDA.*output_device", id="dp-output-device-cuda", marks=no_gpu),
    pytest.param(lambda: dpmini.DataParallel(ident, device_ids=D2, output_device=2.0), TypeError,
                 r"output_device", id="dp-output-device-float"),
    pytest.param(lambda: dpmini.DataParallel(ident, device_ids=D2, dim="0"), TypeError, r"dim", id="dp-dim-str"),
    pytest.param(lambda: dpmini.DataParallel(ident, device_ids=D2, dim=1.0), TypeError, r"dim", id="dp-dim-float"),
    pytest.param(lambda: dpmini.DataParallel(42, device_ids=D2)(X), TypeError, r"module", id="dp-module-not-callable"),
    pytest.param(lambda: dpmini.DataParallel(ident, device_ids=D2, dim=2)(X), IndexError,
                 r"Dimension out of range.*\[-2, 1\].*2", id="dp-dim-out-of-range"),
    pytest.param(lambda: dpmini.DataParallel(ident, device_ids=D2)(obj_array()), (TypeError, ValueError),
                 r"object", id="dp-object-dtype"),
    pytest.param(lambda: dpmini.DataParallel(ident, device_ids=D2)(np.array(3.0)), ValueError,
                 r"1-dimensional", id="dp-zero-dim-input"),
    # ----------------------------------------------------------- functional
    pytest.param(lambda: dpmini.data_parallel(ident, X, device_ids=["gpu:1"]), ValueError, r"device_ids",
                 id="data_parallel-bad-device"),
    pytest.param(lambda: dpmini.data_parallel(ident, X, device_ids=D2, module_kwargs=[1]), TypeError,
                 r"module_kwargs", id="data_parallel-module-kwargs-list"),
    pytest.param(lambda: dpmini.replicate(object(), ["cpu"]), ValueError, r"(?i)non-host",
                 id="replicate-host"),
    pytest.param(lambda: dpmini.scatter(X, D2, dim=-3), IndexError, r"Dimension out of range",
                 id="scatter-dim-neg-out-of-range"),
    pytest.param(lambda: dpmini.scatter(X, D2, dim="a"), TypeError, r"dim", id="scatter-dim-str"),
    pytest.param(lambda: dpmini.scatter(X, []), ValueError, r"target_devices", id="scatter-empty-devices"),
    pytest.param(lambda: dpmini.scatter(X, ["cpu:0", "tpu:1"]), ValueError, r"target_devices\[1\]",
                 id="scatter-bad-device"),
    pytest.param(lambda: dpmini.scatter_kwargs((X,), [("a", 1)], D2), TypeError, r"kwargs",
                 id="scatter_kwargs-kwargs-not-dict"),
    pytest.param(lambda: dpmini.scatter_kwargs((X,), {"o": obj_array()}, D2), (TypeError, ValueError),
                 r"\['o'\]", id="scatter_kwargs-object-dtype-path"),
    pytest.param(lambda: dpmini.gather([X, X], "gpu"), ValueError, r"target_device", id="gather-bad-target"),
    pytest.param(lambda: dpmini.gather([X, X], "cpu", dim=7), IndexError, r"Dimension out of range",
                 id="gather-dim-out-of-range"),
    # -------------------------------------------------------- comm.scatter
    pytest.param(lambda: comm.scatter(X, D2, dim=2), IndexError, r"Dimension out of range.*\[-2, 1\].*2",
                 id="comm-scatter-dim-2"),
    pytest.param(lambda: comm.scatter(X, D2, dim=-3), IndexError, r"Dimension out of range.*-3",
                 id="comm-scatter-dim-minus-3"),
    pytest.param(lambda: comm.scatter(X, D2, dim=None), TypeError, r"dim", id="comm-scatter-dim-none"),
    pytest.param(lambda: comm.scatter(obj_array(), D2), (TypeError, ValueError), r"object",
                 id="comm-scatter-object-dtype"),
    pytest.param(lambda: comm.scatter(np.array(1.0), D2), ValueError, r"1-dimensional",
                 id="comm-scatter-zero-dim"),
    pytest.param(lambda: comm.scatter(42, D2), TypeError, r"array|tensor|buffer", id="comm-scatter-int"),
    pytest.param(lambda: comm.scatter(X, []), ValueError, r"devices", id="comm-scatter-no-devices"),
    pytest.param(lambda: comm.scatter(X, ["cpu", "cpu:1"]), ValueError, r"devices\[0\]",
                 id="comm-scatter-host-device"),
    pytest.param(lambda: comm.scatter(X, ["cpu:0", "cpu:1000"]), ValueError, r"devices\[1\]",
                 id="comm-scatter-index-too-big"),
    pytest.param(lambda: comm.scatter(X, ["cuda:0"]), ValueError, r"devices.*CUDA|CUDA.*devices",
                 id="comm-scatter-cuda", marks=no_gpu),
    pytest.param(lambda: comm.scatter(X, D2, chunk_sizes=[4]), ValueError, r"chunk_sizes",
                 id="chunk-sizes-wrong-length"),
    pytest.param(lambda: comm.scatter(X, D2, chunk_sizes=[5, -1]), ValueError, r"chunk_sizes",
                 id="chunk-sizes-negative"),
    pytest.param(lambda: comm.scatter(X, D2, chunk_sizes=[1, 2]), ValueError, r"chunk_sizes.*4|4.*chunk_sizes",
                 id="chunk-sizes-bad-sum"),
    pytest.param(lambda: comm.scatter(X, D2, chunk_sizes=[2.0, 2.0]), TypeError, r"chunk_sizes",
                 id="chunk-sizes-floats"),
    pytest.param(lambda: comm.scatter(X, D2, chunk_sizes=7), TypeError, r"chunk_sizes", id="chunk-sizes-int"),
    pytest.param(lambda: comm.scatter(X, out=[]), ValueError, r"out", id="comm-scatter-empty-out"),
    pytest.param(lambda: comm.scatter(X, out=[np.zeros((2, 3)), np.zeros((1, 3))]), ValueError, r"out",
                 id="comm-scatter-out-bad-total"),
    pytest.param(lambda: comm.scatter(X, out=[np.zeros((2, 3)), np.zeros((2, 2))]), ValueError, r"out",
                 id="comm-scatter-out-bad-shape"),
    pytest.param(lambda: comm.scatter(X, out=[readonly((2, 3)), np.zeros((2, 3))]), (ValueError, BufferError),
                 r"out", id="comm-scatter-out-readonly"),
    # --------------------------------------------------------- comm.gather
    pytest.param(lambda: comm.gather([]), ValueError, r"at least one", id="gather-empty"),
    pytest.param(lambda: comm.gather([np.zeros((2, 4)), np.zeros((2, 5))]), ValueError,
                 r"index 1.*invalid shape|invalid shape.*index 1", id="gather-shape-mismatch"),
    pytest.param(lambda: comm.gather([np.zeros((2, 4)), np.zeros((2, 4, 1))]), ValueError,
                 r"index 1.*dimensions|dimensions.*index 1", id="gather-rank-mismatch"),
    pytest.param(lambda: comm.gather([np.zeros((2, 4)), np.zeros((3, 4))], dim=1), ValueError,
                 r"index 1", id="gather-dim1-mismatch"),
    pytest.param(lambda: comm.gather([np.zeros(2), "x"]), TypeError, r"\[1\]", id="gather-non-array"),
    pytest.param(lambda: comm.gather([np.zeros(2), obj_array()]), (TypeError, ValueError), r"object|\[1\]",
                 id="gather-object-dtype"),
    pytest.param(lambda: comm.gather([np.zeros((2, 2))], dim=2), IndexError, r"Dimension out of range",
                 id="gather-dim-2"),
    pytest.param(lambda: comm.gather([X, X], out=np.zeros((7, 3))), ValueError, r"out", id="gather-out-shape"),
    pytest.param(lambda: comm.gather([X, X], out=np.zeros((8, 3)), destination="cpu:0"), ValueError,
                 r"out.*destination|destination.*out", id="gather-out-and-destination"),
    pytest.param(lambda: comm.gather([X, X], out=readonly((8, 3))), (ValueError, BufferError), r"out",
                 id="gather-out-readonly"),
    pytest.param(lambda: comm.gather([X, X], out=[1, 2]), TypeError, r"out", id="gather-out-not-array"),
    pytest.param(lambda: comm.gather([X], destination="cpu:abc"), ValueError, r"destination",
                 id="gather-bad-destination"),
    pytest.param(lambda: comm.gather([X], destination="cuda:0"), ValueError,
                 r"destination.*CUDA|CUDA.*destination", id="gather-cuda-destination", marks=no_gpu),
    # ---------------------------------------------------- broadcast, reduce
    pytest.param(lambda: comm.broadcast(X, []), ValueError, r"devices", id="broadcast-no-devices"),
    pytest.param(lambda: comm.broadcast(X, ["cpu:0", "bogus"]), ValueError, r"devices\[1\]",
                 id="broadcast-bad-device"),
    pytest.param(lambda: comm.broadcast(obj_array(), D2), (TypeError, ValueError), r"object",
                 id="broadcast-object-dtype"),
    pytest.param(lambda: comm.broadcast_coalesced([X, "x"], D2), TypeError, r"\[1\]",
                 id="broadcast-coalesced-non-array"),
    pytest.param(lambda: comm.broadcast_coalesced([X], []), ValueError, r"devices",
                 id="broadcast-coalesced-no-devices"),
    pytest.param(lambda: comm.reduce_add([np.zeros((2, 3)), np.zeros((3, 2))]), ValueError,
                 r"input 1 has invalid size|\[1\]", id="reduce-add-shape"),
    pytest.param(lambda: comm.reduce_add([]), ValueError, r"at least one|empty|inputs|arrays",
                 id="reduce-add-empty"),
    pytest.param(lambda: comm.reduce_add([X, X], destination="nowhere"), ValueError, r"destination",
                 id="reduce-add-bad-destination"),
    pytest.param(lambda: comm.reduce_add_coalesced([[X, X], [X]]), ValueError, r"\[1\]|number|length",
                 id="reduce-add-coalesced-ragged"),
    # ------------------------------------------------------ parallel_apply
    pytest.param(lambda: dpmini.parallel_apply([ident, ident], [(X,)]), ValueError,
                 r"modules.*inputs|inputs.*modules", id="parallel-apply-inputs-length"),
    pytest.param(lambda: dpmini.parallel_apply([ident, ident], [(X,), (X,)], [{}]), ValueError, r"kwargs_tup",
                 id="parallel-apply-kwargs-length"),
    pytest.param(lambda: dpmini.parallel_apply([ident, ident], [(X,), (X,)], None, ["cpu:0"]), ValueError,
                 r"devices", id="parallel-apply-devices-length"),
    pytest.param(lambda: dpmini.parallel_apply([ident, ident], [(X,), (X,)], None, ["cpu:0", "gpu:1"]),
                 ValueError, r"devices\[1\]", id="parallel-apply-bad-device"),
    # ---------------------------------------------------------- devices API
    pytest.param(lambda: dpmini.Device("gpu:0"), ValueError, r"gpu:0", id="device-gpu"),
    pytest.param(lambda: dpmini.Device("cpu:"), ValueError, r"cpu:", id="device-cpu-colon"),
    pytest.param(lambda: dpmini.Device("cpu:1:2"), ValueError, r"cpu:1:2", id="device-two-colons"),
    pytest.param(lambda: dpmini.Device(-5), ValueError, r"-5", id="device-minus-5"),
    pytest.param(lambda: dpmini.Device(None), TypeError, r"", id="device-none"),
    pytest.param(lambda: dpmini.asarray(X, dpmini.Device("cuda:0")), ValueError, r"device.*CUDA",
                 id="asarray-cuda-device", marks=no_gpu),
    pytest.param(lambda: dpmini.DataParallel(ident, device_ids=["cpu:0", dpmini.Device("cuda:0")]), ValueError,
                 r"device_ids\[1\].*CUDA", id="dp-cuda-device-object", marks=no_gpu),
    pytest.param(lambda: comm.scatter(X, ["cpu:0", dpmini.Device("cuda:1")]), ValueError,
                 r"devices\[1\].*CUDA", id="comm-scatter-cuda-device-object", marks=no_gpu),
    pytest.param(lambda: comm.gather([X], destination=dpmini.Device("cuda:0")), ValueError,
                 r"destination.*CUDA", id="gather-cuda-device-object", marks=no_gpu),
    pytest.param(lambda: dpmini.Device(256), ValueError, r"256", id="device-int-256"),
    pytest.param(lambda: dpmini.Device(True), TypeError, r"", id="device-bool"),
    pytest.param(lambda: dpmini.asarray(X, "cpu:x"), ValueError, r"device", id="asarray-bad-device"),
    pytest.param(lambda: dpmini.memory_allocated("gpu:0"), ValueError, r"device", id="memory-allocated-bad"),
    pytest.param(lambda: dpmini.device_of("not an array"), TypeError, r"array", id="device-of-non-array"),
]


@pytest.mark.parametrize("call,exc,pattern", CASES)
def test_bad_input(call, exc, pattern):
    with pytest.raises(exc) as info:
        call()
    assert re.search(pattern, str(info.value), re.S), f"message {str(info.value)!r} does not match {pattern!r}"


def test_matrix_is_large_enough():
    assert len(CASES) >= 30


def test_bad_input_leaves_arrays_untouched():
    x = X.copy()
    for call in (lambda: comm.scatter(x, D2, chunk_sizes=[1, 2]),
                 lambda: comm.gather([x, np.zeros((1, 2))], out=x),
                 lambda: comm.gather([x[:2], x[2:]], out=np.zeros((7, 3)))):
        with pytest.raises((ValueError, IndexError, TypeError)):
            call()
    np.testing.assert_array_equal(x, X)
