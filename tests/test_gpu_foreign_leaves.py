"""GPU arrays that are not ndarrays as module attributes and as arguments
on the emulated build or a real GPU:

- replicate / DataParallel of a module holding a dpmini.Array parameter
  (the "model on cuda:0, then DataParallel" set-up) used to read it as an
  ndarray and crash: replica i now holds device i's copy, replica 0 the
  parameter itself when it already lives on device_ids[0];
- a GPU "library" speaking the CUDA Array Interface and DLPack, with a
  from_dlpack of its own (as CuPy), gets its shards and gathered results
  back as its own type, on the right device, sharing dpmini's memory.

Never run against real CuPy / torch.cuda here (tests/gpu_helpers.py says how
those are skipped); these objects stand in for them.
"""
import os
import subprocess
import sys
import textwrap
import types

import numpy as np
import pytest

import dpmini

from gpu_helpers import gpu, host, sample, two_gpus

pytestmark = gpu

gpulib = types.ModuleType("dpmini_test_gpulib")
sys.modules["dpmini_test_gpulib"] = gpulib


class GpuArray:
    """A foreign GPU array (CuPy-like): CAI and DLPack, delegating to a dpmini.Array."""

    def __init__(self, arr):
        self.arr = arr

    @property
    def __cuda_array_interface__(self):
        return self.arr.__cuda_array_interface__

    def __dlpack__(self, **kw):
        return self.arr.__dlpack__(**kw)

    def __dlpack_device__(self):
        return self.arr.__dlpack_device__()


GpuArray.__module__ = "dpmini_test_gpulib"
gpulib.GpuArray = GpuArray
def _gpu_from_dlpack(x):
    if x.__dlpack_device__()[0] != 2:   # as CuPy: GPU memory only
        raise BufferError("GpuArray holds CUDA memory only")
    return GpuArray(dpmini.from_dlpack(x))


gpulib.from_dlpack = _gpu_from_dlpack


class Model:
    def __init__(self, w):
        self.w = w
        self.cfg = {"scale": 2.0}

    def __call__(self, x):
        return x


def test_replicate_of_a_dpmini_array_parameter_on_one_gpu():
    w = dpmini.asarray(sample((3, 2), "float32"), 0)
    reps = dpmini.replicate(Model(w), [0, 0])
    # every replica on the parameter's own device holds it (as for ndarrays)
    assert reps[0].w is w and reps[1].w is w
    assert reps[0].cfg is reps[1].cfg            # objects without arrays: shared


@two_gpus
def test_replica_i_holds_device_i_copy():
    w = dpmini.asarray(sample((4,), "float64"), 0)
    reps = dpmini.replicate(Model(w), [0, 1])
    assert reps[0].w is w
    assert str(reps[1].w.device) == "cuda:1"
    np.testing.assert_array_equal(host(reps[1].w), host(w))
    # a parameter on cuda:1 with device_ids [0, 1]: both replicas get copies
    w1 = dpmini.asarray(sample((4,), "float64"), 1)
    reps = dpmini.replicate(Model(w1), [0, 1])
    assert str(reps[0].w.device) == "cuda:0" and reps[1].w is w1


def test_dataparallel_with_a_gpu_parameter_runs():
    w = dpmini.asarray(np.arange(3.0), 0)
    seen = []

    class Net(Model):
        def __call__(self, x):
            seen.append(type(self.w))
            return x

    x = sample((4, 3), "float64")
    out = dpmini.DataParallel(Net(w), [0, 0], output_device="cpu")(x)
    np.testing.assert_array_equal(out, x)
    assert seen == [dpmini.Array, dpmini.Array]


def test_gpu_parameter_replicate_never_crashes_in_a_subprocess(tmp_path):
    code = textwrap.dedent("""
        import numpy as np, dpmini
        class M:
            def __init__(self, w): self.w = w; self.layers = [{"b": w}]
            def __call__(self, x): return x
        w = dpmini.asarray(np.ones(3), 0)
        reps = dpmini.replicate(M(w), [0, 0])
        assert reps[0].w is w and reps[1].layers[0]["b"] is reps[1].w
        dpmini.DataParallel(M(w), [0, 0], output_device="cpu")(np.ones((4, 2)))
        print("ok")
    """)
    env = dict(os.environ, PYTHONPATH=os.path.dirname(os.path.dirname(dpmini.__file__)))
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       timeout=120, cwd=tmp_path, env=env)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "ok"


def test_foreign_gpu_library_gets_its_own_shards_zero_copy():
    x = sample((6, 2), "float32")
    src = GpuArray(dpmini.asarray(x, 0))
    parts = dpmini.scatter(src, [0, 0])
    assert [type(p) for p in parts] == [GpuArray, GpuArray]
    # chunk 0 stays on the input's own device: a view of the input's memory
    assert parts[0].arr.data_ptr == src.arr.data_ptr
    np.testing.assert_array_equal(host(parts[1].arr), x[3:])


def test_foreign_gpu_library_results_come_back_as_its_type():
    x = sample((6, 2), "float64")
    seen = []

    def replica(a):
        seen.append(type(a))
        return a

    out = dpmini.DataParallel(replica, [0, 0])(GpuArray(dpmini.asarray(x, 0)))
    assert seen == [GpuArray, GpuArray]
    assert type(out) is GpuArray and str(out.arr.device) == "cuda:0"
    np.testing.assert_array_equal(host(out.arr), x)
    plan = dpmini.explain((GpuArray(dpmini.asarray(x, 0)),), [0, 0])
    assert plan.leaves[0]["library"] == "dpmini_test_gpulib.GpuArray cuda:0"


@two_gpus
def test_module_holding_foreign_gpu_arrays_gets_copies_of_that_type():
    w = GpuArray(dpmini.asarray(np.arange(4.0), 0))
    reps = dpmini.replicate(Model(w), [0, 1])
    assert reps[0].w is w and type(reps[1].w) is GpuArray
    assert reps[1].w.arr.data_ptr != w.arr.data_ptr
    assert str(reps[1].w.arr.device) == "cuda:1"
    np.testing.assert_array_equal(host(reps[1].w.arr), np.arange(4.0))


def test_gpu_only_library_results_on_the_host_stay_numpy():
    x = sample((4, 2), "float64")
    out = dpmini.DataParallel(lambda a: a, [0, 0], output_device="cpu")(
        GpuArray(dpmini.asarray(x, 0)))
    assert type(out) is np.ndarray   # CuPy cannot hold host memory
    np.testing.assert_array_equal(out, x)
    parts = dpmini.scatter(GpuArray(dpmini.asarray(x, 0)), ["cpu:0", "cpu:1"])
    assert [type(p) for p in parts] == [np.ndarray, np.ndarray]
