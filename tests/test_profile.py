"""dpmini.profile(): spans of a call per device, their bytes and times, the views.

The coverage check runs a 256 MiB round trip (the size the profile's
acceptance names), where the copies and the replica take tens of milliseconds and
the caller's own steps between spans (the walk, a worker's wake-up) a small,
fixed part of that. It takes the best of many attempts (on a shared machine
a thread that becomes runnable may wait a time slice for a core, and one
device may finish its copies well before the other): each device's spans
must cover the call's wall time within 10% in at least one attempt. No
copy span may claim more bandwidth than the machine's copy limit (the
faster of memcpy and streaming stores, measured in the same run) allows,
and the best must reach a real fraction of it.
"""
import json
import os
import threading
import time

import numpy as np
import pytest

import dpmini
from dpmini import _dpmini
from dpmini import _profile

D2 = ["cpu:0", "cpu:1"]
ATTEMPTS = 12
# each attempt ~30-300 ms; the loop stops at the first that shows the coverage, and
# on a loaded machine goes on past COVERAGE_ATTEMPTS until COVERAGE_SECONDS have passed
COVERAGE_ATTEMPTS = 30
COVERAGE_SECONDS = 30


def identity(a):
    return a


def round_trip(x, dim):
    dp = dpmini.DataParallel(identity, device_ids=D2, dim=dim)
    dp(x)  # warm: worker threads started, allocator caches filled
    return dp


def one_call(prof):
    calls = prof.calls()
    assert len(calls) == 1, calls
    return calls[0]


def copies(prof, phase, device):
    return [e for e in prof.events
            if e["kind"] == "copy" and e["phase"] == phase and e["device"] == device]


# ------------------------------------------------------------ round trip


@pytest.mark.skipif(bool(os.environ.get("DPMINI_SANITIZER")),
                    reason="a sanitizer slows the caller's own steps (the walk, the frees), "
                    "which no device span covers, far more than the copies; the 10% bound "
                    "is the release build's")
@pytest.mark.parametrize("dim", [0, 1])
def test_round_trip_spans_cover_each_devices_wall_time_within_10_percent(dim):
    # a device's spans: its copies, the waits for its worker thread, its replica
    x = np.random.default_rng(0).random((8192, 8192), dtype=np.float32)   # 256 MiB
    dp = round_trip(x, dim)
    best = {}
    deadline = time.monotonic() + COVERAGE_SECONDS
    attempts = 0
    while attempts < COVERAGE_ATTEMPTS or time.monotonic() < deadline:
        attempts += 1
        with dpmini.profile() as prof:
            dp(x)
        c = one_call(prof)
        for dev in D2:
            share = c["devices"][dev]["busy_ns"] / c["wall_ns"]
            assert 0.0 < share <= 1.0, (dev, c)   # a union of spans inside the call
            best[dev] = max(best.get(dev, 0.0), share)
        if all(v >= 0.9 for v in best.values()):
            break
    assert all(v >= 0.9 for v in best.values()), (best, attempts)


@pytest.mark.parametrize("dim", [0, 1])
def test_round_trip_copy_spans_carry_each_chunks_bytes_and_layout(dim):
    x = np.arange(2048 * 1024, dtype=np.float32).reshape(2048, 1024)
    dp = round_trip(x, dim)
    with dpmini.profile() as prof:
        y = dp(x)
    np.testing.assert_array_equal(y, x)
    for dev in D2:
        for phase in ("scatter", "gather"):
            spans = copies(prof, phase, dev)
            assert sum(e["bytes"] for e in spans) == x.nbytes // 2, (phase, dev, spans)
            # dim=1 chunks of a C-contiguous array are strided on one side
            assert {e["strided"] for e in spans} == {dim == 1}
            assert all(e["path"] in ("stream", "worker", "inline") for e in spans)
        replica = [e for e in prof.events if e["kind"] == "replica" and e["device"] == dev]
        assert len(replica) == 1
    c = one_call(prof)
    assert c["name"] == "dpmini.DataParallel"
    assert set(c["phases"]) == {"scatter", "replicate", "parallel_apply", "gather"}
    assert c["idle_devices"] == []


@pytest.mark.parametrize("dim", [0, 1])
def test_round_trip_copy_rate_is_within_the_copy_limit_measured_in_the_same_run(dim):
    x = np.random.default_rng(1).random((2048, 4096), dtype=np.float32)   # 32 MiB
    dp = round_trip(x, dim)
    chunk = x.nbytes // 2
    # the limit is measured before and after the calls: noise can only slow a
    # measurement, so the higher of the two bounds the spans' rates, and the
    # lower of the two is what the best span must reach a real fraction of
    before = _profile.copy_limit(chunk, threads=1, repeat=15)
    assert before["gbps"] == max(before["memcpy_gbps"], before["stream_gbps"])
    rates = []
    deadline = time.monotonic() + COVERAGE_SECONDS
    attempts = 0
    while attempts < ATTEMPTS or (time.monotonic() < deadline
                                  and max(rates) < before["gbps"] / 8):
        attempts += 1
        with dpmini.profile() as prof:
            dp(x)
        rates += [e["bytes"] / e["duration_ns"]      # GB/s
                  for dev in D2 for phase in ("scatter", "gather")
                  for e in copies(prof, phase, dev)]
    after = _profile.copy_limit(chunk, threads=1, repeat=15)
    high = max(before["gbps"], after["gbps"])
    low = min(before["gbps"], after["gbps"])
    # a span faster than one thread's best copy would be too short
    assert max(rates) <= 2.0 * high, (max(rates), before, after)
    # and not vacuous: the copies ran at a real fraction of the limit
    assert max(rates) >= low / 8, (max(rates), before, after, attempts)


def test_call_and_phase_spans_nest_in_time():
    x = np.ones((512, 256))
    dp = round_trip(x, 0)
    with dpmini.profile() as prof:
        dp(x)
    root = [e for e in prof.events if e["root"]]
    assert len(root) == 1 and root[0]["kind"] == "call"
    r = root[0]
    assert prof.start_ns <= r["start_ns"] <= r["end_ns"] <= prof.end_ns
    for e in prof.events:
        assert r["start_ns"] <= e["start_ns"] <= e["end_ns"] <= r["end_ns"], e
        assert e["call"] == r["call"]
    order = [e["kind"] for e in prof.events if e["device"] is None and not e["root"]
             and e["kind"] in ("scatter", "replicate", "parallel_apply", "gather")]
    assert order == ["scatter", "replicate", "parallel_apply", "gather"]


def test_small_batch_reports_the_device_without_a_chunk_as_idle():
    dp = dpmini.DataParallel(identity, device_ids=["cpu:0", "cpu:1", "cpu:2"])
    with dpmini.profile() as prof:
        dp(np.ones((2, 3)))
    c = one_call(prof)
    assert c["idle_devices"] == ["cpu:2"]
    assert "idle devices: cpu:2" in prof.table()


def test_standalone_functions_are_calls_of_their_own():
    x = np.ones((8, 4))
    with dpmini.profile() as prof:
        parts = dpmini.scatter(x, D2)
        dpmini.gather(list(parts), "cpu:0")
        dpmini.comm.broadcast(x, D2)
        dpmini.comm.reduce_add([x, x], "cpu:0")
    names = [c["name"] for c in prof.calls()]
    assert names == ["scatter", "gather", "comm.broadcast", "comm.reduce_add"]
    sums = [e for e in prof.events if e["kind"] == "sum"]
    assert len(sums) == 1 and sums[0]["device"] == "cpu:0"


# ------------------------------------------------------------ the buffer


def test_full_buffer_stops_recording_and_counts_the_dropped_spans():
    x = np.ones((64, 4))
    dp = round_trip(x, 0)
    # a call records at least 13 spans: 2 device marks, 4 phases, the call,
    # 2 scatter and 2 gather copies, 2 replicas (waits vary with scheduling)
    with dpmini.profile() as full:
        dp(x)
    assert len(full.events) >= 13 and full.dropped == 0
    with dpmini.profile(max_events=3) as prof:
        dp(x)
    assert len(prof.events) == 3
    assert prof.dropped >= 10
    assert f"{prof.dropped} spans dropped" in prof.table()
    with dpmini.profile(max_events=3) as again:   # a new buffer: nothing carried over
        pass
    assert again.events == [] and again.dropped == 0


def test_max_events_is_checked():
    with pytest.raises(ValueError, match="max_events"):
        dpmini.profile(max_events=0)
    with pytest.raises(TypeError, match="max_events"):
        dpmini.profile(max_events=2.5)
    assert dpmini.profile(max_events=np.int64(5)).max_events == 5


# ------------------------------------------------------------ scope


def test_nothing_is_recorded_outside_profile():
    x = np.ones((64, 4))
    dp = round_trip(x, 0)
    assert not _profile.recording()
    with dpmini.profile() as prof:
        assert _profile.recording()
    assert not _profile.recording()
    dp(x)   # after the block: not added to it
    assert prof.events == [] and prof.calls() == []
    with dpmini.profile() as later:
        pass
    assert later.events == []


def test_nested_profiles_see_their_own_block_and_the_outer_one_everything():
    x = np.ones((64, 4))
    dp = round_trip(x, 0)
    with dpmini.profile() as outer:
        dp(x)
        with dpmini.profile() as inner:
            dp(x)
        dp(x)
    assert len(outer.calls()) == 3
    assert len(inner.calls()) == 1
    assert inner.calls()[0]["call"] == outer.calls()[1]["call"]
    key = lambda e: (e["kind"], e["start_ns"], e["thread"])  # noqa: E731
    assert {key(e) for e in inner.events} <= {key(e) for e in outer.events}


def test_profiles_that_end_out_of_order_leave_the_thread_able_to_profile():
    """Two blocks on one thread ending first-in first-out (asyncio tasks do): each
    gets its own events, and later profiles still work."""
    x = np.ones((64, 4))
    dp = round_trip(x, 0)
    first, second = dpmini.profile(), dpmini.profile()
    a = first.__enter__()
    dp(x)
    b = second.__enter__()
    dp(x)
    first.__exit__(None, None, None)
    dp(x)
    assert _profile.recording()
    second.__exit__(None, None, None)
    assert not _profile.recording()
    assert len(a.calls()) == 2 and len(b.calls()) == 2
    with dpmini.profile() as later:
        dp(x)
    assert len(later.calls()) == 1


def test_profile_records_only_its_own_threads_calls():
    x = np.ones((64, 4))
    dp = round_trip(x, 0)
    first_done, stop = threading.Event(), threading.Event()
    other = {}

    def busy():
        n = 0
        while not stop.is_set():
            dp(x)
            n += 1
            first_done.set()
        other["calls"] = n
        other["tid"] = threading.get_native_id()

    t = threading.Thread(target=busy)
    t.start()
    assert first_done.wait(30)   # the other thread is calling when the profile starts
    try:
        with dpmini.profile() as prof:
            for _ in range(3):
                dp(x)
    finally:
        stop.set()
        t.join()
    assert other["calls"] > 0
    assert len(prof.calls()) == 3
    mine = threading.get_native_id()
    assert {e["thread"] for e in prof.events if e["device"] is None} == {mine}


def test_a_profile_object_cannot_be_entered_twice_at_once():
    p = dpmini.profile()
    with p:
        with pytest.raises(RuntimeError, match="already active"):
            with p:
                pass


def test_decorator_records_each_call_afresh():
    x = np.ones((64, 4))
    dp = round_trip(x, 0)
    prof = dpmini.profile()

    @prof
    def step(n):
        for _ in range(n):
            dp(x)

    step(2)
    assert len(prof.result.calls()) == 2
    step(1)
    assert len(prof.result.calls()) == 1


# ------------------------------------------------------------ Python spans


def test_python_phase_and_span_join_the_call_they_are_in():
    with dpmini.profile() as prof:
        with _profile.phase("call", "TorchAdapter"):
            with _profile.span("autograd copy", device="cpu:1", bytes=4096):
                pass
            dpmini.scatter(np.ones((4, 2)), D2)
    calls = prof.calls()
    assert len(calls) == 1 and calls[0]["name"] == "TorchAdapter"
    user = [e for e in prof.events if e["kind"] == "user"]
    assert len(user) == 1
    assert user[0]["device"] == "cpu:1" and user[0]["bytes"] == 4096
    assert user[0]["phase"] == "call" and user[0]["call"] == calls[0]["call"]
    assert [e["kind"] for e in prof.events if e["kind"] == "scatter"] == ["scatter"]


def test_python_spans_outside_profile_record_nothing_and_check_their_arguments():
    with _profile.span("x", device="cpu:0"):
        pass
    with pytest.raises(ValueError, match="kind"):
        with _profile.phase("walk"):
            pass
    with dpmini.profile():
        with pytest.raises(ValueError, match="device"):
            with _profile.span("x", device="gpu:7"):
                pass
    assert _dpmini._profile_record("x", 1, 2) is False


# ------------------------------------------------------------ views


def test_chrome_trace_has_the_trace_event_formats_required_fields(tmp_path):
    x = np.ones((256, 64))
    dp = round_trip(x, 0)
    with dpmini.profile() as prof:
        dp(x)
    path = tmp_path / "trace.json"
    prof.export_chrome_trace(path)
    doc = json.loads(path.read_text())
    assert isinstance(doc["traceEvents"], list) and doc["traceEvents"]
    names = {}
    for ev in doc["traceEvents"]:
        assert isinstance(ev["name"], str) and ev["name"]
        assert ev["ph"] in ("X", "M")
        assert isinstance(ev["pid"], int) and isinstance(ev["tid"], int)
        if ev["ph"] == "X":
            assert isinstance(ev["ts"], (int, float)) and ev["ts"] >= 0
            assert isinstance(ev["dur"], (int, float)) and ev["dur"] >= 0
            assert isinstance(ev["cat"], str)
        elif ev["name"] == "process_name":
            names[ev["pid"]] = ev["args"]["name"]
    # one track per device, and the device's copies on it
    assert sorted(n for n in names.values() if n.startswith("cpu:")) == D2
    for pid, name in names.items():
        if name in D2:
            cats = {ev["cat"] for ev in doc["traceEvents"]
                    if ev["ph"] == "X" and ev["pid"] == pid}
            assert {"copy", "replica"} <= cats
    copy = next(ev for ev in doc["traceEvents"] if ev.get("cat") == "copy")
    assert copy["args"]["bytes"] > 0 and copy["args"]["phase"] in ("scatter", "gather")


def test_table_shows_phase_by_device_times_rates_and_overhead():
    x = np.ones((1024, 256), dtype=np.float32)
    dp = round_trip(x, 1)
    with dpmini.profile() as prof:
        dp(x)
    text = prof.table()
    assert "scatter copy" in text and "gather copy" in text
    assert "cpu:0" in text and "cpu:1" in text
    assert "GB/s strided" in text
    assert "dpmini's own overhead" in text
    c = one_call(prof)
    assert 0 <= c["overhead_ns"] <= c["wall_ns"]
    assert "<table>" in prof._repr_html_()
    with pytest.raises(ValueError, match="unit"):
        prof.table(unit="s")


@pytest.mark.skipif(bool(os.environ.get("DPMINI_SANITIZER")),
                    reason="matplotlib's font code throws a C++ exception while it draws the "
                           "labels, which aborts under the preloaded ASan runtime")
def test_plot_draws_one_row_per_device_and_the_calls_row():
    matplotlib = pytest.importorskip("matplotlib")
    matplotlib.use("Agg")
    x = np.ones((256, 64))
    dp = round_trip(x, 0)
    with dpmini.profile() as prof:
        dp(x)
    ax = prof.plot(title="round trip")
    labels = [t.get_text() for t in ax.get_yticklabels()]
    assert labels == ["cpu:1", "cpu:0", "calls"]
    legend = [t.get_text() for t in ax.get_legend().get_texts()]
    assert "scatter copy" in legend and "gather copy" in legend and "replica" in legend
    import matplotlib.pyplot as plt

    plt.close("all")


def test_plan_has_a_rich_display():
    plan = dpmini.explain((np.ones((5, 3)),), D2)
    html = plan._repr_html_()
    assert "<table>" in html and "cpu:0" in html and "cpu:1" in html


def test_small_copies_made_inline_are_spans_of_their_device_too():
    x = np.ones((64, 8), dtype=np.float32)   # 2 KiB: copied in the calling thread
    dp = round_trip(x, 0)
    with dpmini.profile() as prof:
        dp(x)
    for dev in D2:
        for phase in ("scatter", "gather"):
            spans = copies(prof, phase, dev)
            assert [e["path"] for e in spans] == ["inline"]
            assert spans[0]["bytes"] == x.nbytes // 2 and not spans[0]["strided"]


class Weights:
    """A model whose arrays replicate copies: one large, many small."""

    def __init__(self):
        self.W = np.ones((512, 512))
        self.b = [np.full(1000, float(i)) for i in range(50)]

    def __call__(self, x):
        return x


def test_replicate_copies_are_spans_of_each_device_with_its_bytes():
    m = Weights()
    dpmini.replicate(m, D2)
    with dpmini.profile() as prof:
        reps = dpmini.replicate(m, D2)
    assert reps[1].b[7][0] == 7.0
    want = m.W.nbytes + sum(b.nbytes for b in m.b)
    for dev in D2:
        assert sum(e["bytes"] for e in copies(prof, "replicate", dev)) == want
    assert [c["name"] for c in prof.calls()] == ["replicate"]


def test_gather_onto_one_device_copies_on_one_thread_per_part():
    # both parts go to cpu:0 (the output device); each is copied by its own
    # worker thread, not both by cpu:0's (the gather took twice the scatter)
    x = np.ones((2048, 1024), dtype=np.float32)   # 8 MiB: copied on the workers
    dp = round_trip(x, 0)
    with dpmini.profile() as prof:
        dp(x)
    threads = {dev: {e["thread"] for e in copies(prof, "gather", dev)} for dev in D2}
    assert all(len(t) == 1 for t in threads.values()), threads
    assert threads["cpu:0"] != threads["cpu:1"]
