"""dpmini.Device, device_of, asarray, device counts, memory accounting
(design "Devices")."""
import gc
import os
import subprocess
import sys

import numpy as np
import pytest

import dpmini


@pytest.mark.parametrize(
    "spec,type_,index,text",
    [("cpu", "cpu", None, "cpu"), (-1, "cpu", None, "cpu"), ("cpu:0", "cpu", 0, "cpu:0"),
     ("cpu:1", "cpu", 1, "cpu:1"), ("cpu:255", "cpu", 255, "cpu:255")],
)
def test_device_parse(spec, type_, index, text):
    d = dpmini.Device(spec)
    assert d.type == type_
    assert d.index == index
    assert str(d) == text
    assert repr(d) == f"dpmini.Device('{text}')"


def test_device_equality_and_hash():
    a = dpmini.Device("cpu:1")
    assert a == dpmini.Device("cpu:1")
    assert a == "cpu:1"
    assert a != "cpu:2" and a != dpmini.Device("cpu:2")
    assert a != dpmini.Device("cpu")
    assert dpmini.Device(-1) == dpmini.Device("cpu") == "cpu"
    assert hash(a) == hash(dpmini.Device("cpu:1"))
    assert len({a, dpmini.Device("cpu:1"), dpmini.Device("cpu:2")}) == 2
    assert dpmini.Device(dpmini.Device("cpu:3")) == "cpu:3"


@pytest.mark.parametrize("spec,text", [("cuda", "cuda:0"), ("cuda:0", "cuda:0"), (0, "cuda:0"), (3, "cuda:3")])
def test_device_cuda_name_and_use_without_gpu(spec, text):
    # like torch.device, a Device may name an absent CUDA device; using it is what fails
    d = dpmini.Device(spec)
    assert d.type == "cuda" and str(d) == text
    if dpmini.device_count() > 0:
        pytest.skip("has a GPU")
    with pytest.raises(ValueError, match=r"(?s)device.*CUDA"):
        dpmini.asarray(np.zeros(2), d)
    with pytest.raises(ValueError, match=r"(?s)device_ids\[1\].*CUDA"):
        dpmini.DataParallel(lambda x: x, device_ids=["cpu:0", d])


def test_device_count_without_gpu():
    n = dpmini.device_count()
    assert isinstance(n, int) and n >= 0


def _run(code, **env):
    e = dict(os.environ)
    e.pop("DPMINI_CPU_DEVICES", None)
    e.update(env)
    res = subprocess.run([sys.executable, "-c", code], env=e, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    return res.stdout.strip()


def test_cpu_device_count_env():
    assert _run("import dpmini; print(dpmini.cpu_device_count())", DPMINI_CPU_DEVICES="5") == "5"


def test_cpu_device_count_default_is_usable_cores_at_least_2():
    expected = max(2, len(os.sched_getaffinity(0)))
    assert _run("import dpmini; print(dpmini.cpu_device_count())") == str(expected)


def test_device_of():
    x = np.arange(4.0)
    assert dpmini.device_of(x) == dpmini.Device("cpu")
    xd = dpmini.asarray(x, "cpu:2")
    assert dpmini.device_of(xd) == "cpu:2"
    assert dpmini.device_of(xd[1:]) == "cpu:2"          # views follow the base chain
    assert dpmini.device_of(xd.reshape(2, 2).T) == "cpu:2"
    assert dpmini.device_of(np.array(xd)) == "cpu"      # a NumPy copy is host memory
    assert isinstance(dpmini.device_of(xd), dpmini.Device)


def test_asarray():
    x = np.arange(6.0).reshape(2, 3)
    assert dpmini.asarray(x) is x
    xd = dpmini.asarray(x, "cpu:1")
    assert xd is not x and not np.shares_memory(xd, x)
    np.testing.assert_array_equal(xd, x)
    assert xd.dtype == x.dtype and xd.shape == x.shape
    assert dpmini.asarray(xd, "cpu:1") is xd               # already there: as is
    assert dpmini.asarray(xd, dpmini.Device("cpu:1")) is xd
    moved = dpmini.asarray(xd, "cpu:2")
    assert dpmini.device_of(moved) == "cpu:2"
    np.testing.assert_array_equal(moved, x)
    host = dpmini.asarray(xd, "cpu")
    assert dpmini.device_of(host) == "cpu"
    np.testing.assert_array_equal(host, x)


def test_asarray_of_nested_list():
    # design: "dpmini.asarray(obj, device=None): obj as an array" (np.asarray-like)
    lst = dpmini.asarray([[1, 2], [3, 4]], "cpu:0")
    assert dpmini.device_of(lst) == "cpu:0"
    np.testing.assert_array_equal(lst, [[1, 2], [3, 4]])


def test_asarray_noncontiguous_source():
    x = np.arange(12).reshape(3, 4).T[::-1]
    xd = dpmini.asarray(x, "cpu:3")
    np.testing.assert_array_equal(xd, x)


def test_memory_allocated_and_reserved():
    d = "cpu:11"
    gc.collect()
    before = dpmini.memory_allocated(d)
    a = dpmini.asarray(np.zeros(1000), d)
    assert dpmini.memory_allocated(d) >= before + 8000
    assert dpmini.memory_reserved(d) >= dpmini.memory_allocated(d)
    del a
    gc.collect()
    assert dpmini.memory_allocated(d) == before
    assert dpmini.memory_reserved(d) >= dpmini.memory_allocated(d)
    dpmini.empty_cache()
    assert dpmini.memory_reserved(d) == dpmini.memory_allocated(d)


def test_memory_accepts_device_object():
    assert dpmini.memory_allocated(dpmini.Device("cpu:12")) == dpmini.memory_allocated("cpu:12")
