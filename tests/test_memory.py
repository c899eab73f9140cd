"""Leak checks: many DataParallel / comm calls leave no growth in traced Python
memory, RSS, reference counts or dpmini device memory.

DataParallel and every comm function are called 100,000 times (issue
"Reliability", item 4): RSS may grow by less than 2 MiB, traced Python memory
by less than one small object per 100 calls, and reference counts and device
memory must come back exactly. The whole file takes about 25 s."""
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
MANY = 100_000          # the reliability checks: DataParallel and each comm function
RSS_SLACK = 2 * 2 ** 20
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
    mod_refs = sys.getrefcount(dpmini._dpmini)
    dev0 = device_bytes()
    rss0 = rss_bytes()
    for _ in range(MANY):
        one_call(dp, x, y, z, scale)
    gc.collect()
    assert [sys.getrefcount(o) for o in (x, y, z, scale, net, net.w, net.cfg, dp)] == refs
    mod_refs_after = sys.getrefcount(dpmini._dpmini)  # not inside assert: pytest would hold a reference
    assert mod_refs_after == mod_refs
    assert device_bytes() == dev0
    # a leak of one 32-byte object per call would be 3.2 MB
    assert SANITIZED or rss_bytes() - rss0 < RSS_SLACK


def _traced_growth(dp, x, y, z, scale):
    """Traced bytes gained over MANY calls: the lowest checkpoint of the second half
    against the lowest of the first, and the checkpoints."""
    gc.collect()
    tracemalloc.start()
    traced = []
    try:
        for _ in range(8):
            for _ in range(MANY // 8):
                one_call(dp, x, y, z, scale)
            gc.collect()
            traced.append(tracemalloc.get_traced_memory()[0])
    finally:
        tracemalloc.stop()
    return min(traced[4:]) - min(traced[:4]), traced


def test_dataparallel_no_traced_python_growth(inputs):
    x, y, z, scale = inputs
    dp = dpmini.DataParallel(Net(), device_ids=DEVICES)
    for _ in range(WARMUP):
        one_call(dp, x, y, z, scale)
    # CPython's bounded caches (free lists, per-thread state) make the traced total
    # move up and down by tens of KiB between checkpoints (seen under ASan, and
    # once in a full run while other tests' worker threads were leaving); a leak
    # only grows. So compare the lowest checkpoint of the second half with the
    # lowest of the first: a leak of one small object (>= 32 bytes) every 100 calls
    # raises it by >= 16 KiB over the 50,000 calls between the halves, and does so
    # again in a second measurement, which a one-off step does not.
    growth, traced = _traced_growth(dp, x, y, z, scale)
    if growth >= 16 * 1024:
        again, traced_again = _traced_growth(dp, x, y, z, scale)
        growth, traced = min((growth, traced), (again, traced_again))
    assert growth < 16 * 1024, traced


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


# ------------------------------------------------- every comm function, 100k calls

_X = np.arange(256.0).reshape(16, 16)
_I = np.ones(3, np.int32)


def _comm_cases():
    """name -> (inputs to watch, call). Arrays live on the host, on cpu:0 and
    on cpu:1 so that views, copies and in-place writes are all exercised."""
    x = _X.copy()
    xd = dpmini.asarray(x, "cpu:0")
    i1 = dpmini.asarray(_I, "cpu:1")
    parts = [x[:8], dpmini.asarray(x[8:], "cpu:1")]
    outs = [np.empty((8, 16)), dpmini.asarray(np.empty((8, 16)), "cpu:1")]
    gout = np.empty((16, 16))
    return {
        "scatter": ((x,), lambda: comm.scatter(x, DEVICES)),
        "scatter-chunk_sizes-dim1": ((xd,), lambda: comm.scatter(xd, DEVICES, chunk_sizes=[3, 13], dim=1)),
        "scatter-out": ((x, *outs), lambda: comm.scatter(x, out=outs)),
        "gather": (tuple(parts), lambda: comm.gather(parts, destination="cpu:1")),
        "gather-dim1-host": (tuple(parts), lambda: comm.gather([x, xd], dim=1)),
        "gather-out": ((*parts, gout), lambda: comm.gather(parts, out=gout)),
        "broadcast": ((xd,), lambda: comm.broadcast(xd, DEVICES)),
        "broadcast_coalesced": ((x, xd, i1), lambda: comm.broadcast_coalesced([x, xd, i1], DEVICES,
                                                                               buffer_size=1024)),
        "reduce_add": ((x, xd), lambda: comm.reduce_add([x, xd], destination="cpu:1")),
        "reduce_add_coalesced": ((x, xd, i1), lambda: comm.reduce_add_coalesced(
            [[x, _I], [xd, i1]], destination="cpu:0", buffer_size=1024)),
    }


def _comm_growth(call):
    """Traced and RSS bytes gained over MANY calls, after 1000 traced ones."""
    tracemalloc.start()
    try:
        for _ in range(1000):
            call()
        gc.collect()
        traced0, _ = tracemalloc.get_traced_memory()
        rss0 = rss_bytes()
        for _ in range(MANY):
            call()
        gc.collect()
        traced1, _ = tracemalloc.get_traced_memory()
        rss1 = rss_bytes()
    finally:
        tracemalloc.stop()
    return traced1 - traced0, rss1 - rss0


@pytest.mark.parametrize("name", list(_comm_cases()))
def test_comm_function_100k_calls_no_growth(name):
    watched, call = _comm_cases()[name]
    for _ in range(1000):
        call()
    gc.collect()
    refs = [sys.getrefcount(o) for o in watched]
    mod_refs = sys.getrefcount(dpmini._dpmini)
    dev0 = device_bytes()
    traced, rss = _comm_growth(call)
    # CPython's bounded caches can step up once between two checkpoints (see
    # test_dataparallel_no_traced_python_growth); a leak grows again in a second
    # measurement, a one-off step does not
    if traced >= 16 * 1024 or (not SANITIZED and rss >= RSS_SLACK):
        again = _comm_growth(call)
        traced, rss = min(traced, again[0]), min(rss, again[1])
    refs_after = [sys.getrefcount(o) for o in watched]
    mod_refs_after = sys.getrefcount(dpmini._dpmini)  # not inside assert: pytest would hold a reference
    assert refs_after == refs
    assert mod_refs_after == mod_refs
    assert device_bytes() == dev0
    assert traced < 16 * 1024
    assert SANITIZED or rss < RSS_SLACK
