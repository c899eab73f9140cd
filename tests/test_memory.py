"""Leak checks: many DataParallel / comm calls leave no growth in traced Python
memory, RSS, reference counts or dpmini device memory."""
import gc
import os
import sys
import tracemalloc

import numpy as np
import pytest

import dpmini
from dpmini import comm

pytestmark = pytest.mark.slow

DEVICES = ["cpu:0", "cpu:1"]
# Under ASan (make test-asan) freed memory sits in the quarantine, so RSS
# grows by design; the RSS checks are skipped there, the others still run.
SANITIZED = bool(os.environ.get("DPMINI_SANITIZER"))
CALLS = 10_000
WARMUP = 300


def rss_bytes():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class Net:
    def __init__(self):
        self.w = dpmini.asarray(np.ones(256), "cpu:0")
        self.b = np.zeros(256)
        self.cfg = {"scale": dpmini.asarray(np.full(256, 2.0), "cpu:0")}

    def __call__(self, x, pair, *, opts, flag):
        h = x * self.w + pair[0] + self.b
        return h, {"s": opts["scale"] * pair[1], "n": opts["name"]}


@pytest.fixture
def inputs():
    x = np.ones((8, 256))
    y = np.full((8, 256), 3.0)
    z = np.arange(8.0).reshape(8, 1)
    scale = np.full((8, 1), 0.5)
    return x, y, z, scale


def one_call(dp, x, y, z, scale):
    out = dp(x, (y, z), opts={"scale": scale, "name": "n"}, flag=True)
    assert out[0].shape == (8, 256) and out[1]["s"].shape == (8, 1)
    return out


def device_bytes():
    return [dpmini.memory_allocated(d) for d in DEVICES]


def test_dataparallel_no_growth_refcounts_and_device_memory(inputs):
    x, y, z, scale = inputs
    net = Net()
    dp = dpmini.DataParallel(net, device_ids=DEVICES)
    out = one_call(dp, x, y, z, scale)
    np.testing.assert_array_equal(out[0], x + y)
    np.testing.assert_array_equal(out[1]["s"], scale * z)
    del out
    for _ in range(WARMUP):
        one_call(dp, x, y, z, scale)
    gc.collect()
    refs = [sys.getrefcount(o) for o in (x, y, z, scale, net, net.w, net.cfg, dp)]
    dev0 = device_bytes()
    rss0 = rss_bytes()
    for _ in range(CALLS):
        one_call(dp, x, y, z, scale)
    gc.collect()
    assert [sys.getrefcount(o) for o in (x, y, z, scale, net, net.w, net.cfg, dp)] == refs
    assert device_bytes() == dev0
    # a leak of one 8 KiB chunk per call would be 80 MiB
    assert SANITIZED or rss_bytes() - rss0 < 16 * 2 ** 20


def test_dataparallel_no_traced_python_growth(inputs):
    x, y, z, scale = inputs
    dp = dpmini.DataParallel(Net(), device_ids=DEVICES)
    for _ in range(WARMUP):
        one_call(dp, x, y, z, scale)
    gc.collect()
    tracemalloc.start()
    try:
        for _ in range(200):
            one_call(dp, x, y, z, scale)
        gc.collect()
        before, _ = tracemalloc.get_traced_memory()
        for _ in range(CALLS):
            one_call(dp, x, y, z, scale)
        gc.collect()
        after, _ = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    # a leak of even one small object per call (>= 32 bytes) shows up as >= 320 KB
    assert after - before < 256 * 1024


def test_memory_allocated_returns_to_start(inputs):
    x, y, z, scale = inputs
    dp = dpmini.DataParallel(Net(), device_ids=DEVICES)
    gc.collect()
    start = device_bytes()
    outs = [one_call(dp, x, y, z, scale) for _ in range(20)]
    # outputs live on output_device (cpu:0) while held
    assert dpmini.memory_allocated("cpu:0") >= start[0] + 20 * 8 * 256 * 8
    del outs
    gc.collect()
    assert device_bytes() == start


def test_error_path_does_not_leak():
    x = np.ones((4, 512))

    class Bad:
        def __call__(self, x):
            if dpmini.device_of(x) == dpmini.Device("cpu:1"):
                raise ValueError("replica failure")
            return x

    net = Bad()
    dp = dpmini.DataParallel(net, device_ids=DEVICES)
    for _ in range(50):
        with pytest.raises(ValueError):
            dp(x)
    gc.collect()
    refs = (sys.getrefcount(x), sys.getrefcount(net))
    dev0 = device_bytes()
    rss0 = rss_bytes()
    for _ in range(2000):
        with pytest.raises(ValueError):
            dp(x)
    gc.collect()
    assert (sys.getrefcount(x), sys.getrefcount(net)) == refs
    assert device_bytes() == dev0
    assert SANITIZED or rss_bytes() - rss0 < 16 * 2 ** 20


def test_bad_argument_path_does_not_leak():
    x = np.ones((4, 512))
    gc.collect()
    ref = sys.getrefcount(x)
    dev0 = device_bytes()
    for _ in range(2000):
        with pytest.raises(ValueError):
            comm.scatter(x, DEVICES, chunk_sizes=[1, 2])
        with pytest.raises(ValueError):
            comm.gather([x, np.ones((4, 3))])
        with pytest.raises(ValueError):
            dpmini.scatter_kwargs((x,), {"k": np.array(1.0)}, DEVICES)
    gc.collect()
    assert sys.getrefcount(x) == ref
    assert device_bytes() == dev0


def test_comm_loop_no_growth():
    x = np.arange(4096.0).reshape(64, 64)
    xd = dpmini.asarray(x, "cpu:0")
    for _ in range(100):
        comm.gather(comm.scatter(x, DEVICES), destination="cpu:1")
    gc.collect()
    refs = (sys.getrefcount(x), sys.getrefcount(xd))
    dev0 = device_bytes()
    rss0 = rss_bytes()
    for _ in range(CALLS):
        chunks = comm.scatter(xd, DEVICES)  # a view and a copy
        y = comm.gather(chunks, destination="cpu:1")
        b = comm.broadcast(xd, DEVICES)
        r = comm.reduce_add(list(b))
        del chunks, y, b, r
    gc.collect()
    assert (sys.getrefcount(x), sys.getrefcount(xd)) == refs
    assert device_bytes() == dev0
    assert SANITIZED or rss_bytes() - rss0 < 16 * 2 ** 20


def test_scattered_chunks_release_device_memory():
    gc.collect()
    dev0 = device_bytes()
    chunks = comm.scatter(np.ones((4, 1000)), DEVICES)
    assert dpmini.memory_allocated("cpu:1") >= dev0[1] + 2 * 1000 * 8
    view = chunks[1][:, :10]
    del chunks
    gc.collect()
    # the view keeps its buffer alive
    assert dpmini.memory_allocated("cpu:1") >= dev0[1] + 2 * 1000 * 8
    del view
    gc.collect()
    assert device_bytes() == dev0
