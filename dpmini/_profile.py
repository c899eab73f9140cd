"""dpmini.profile(): where a DataParallel call spends its time, per device.

The spans are recorded in C (csrc/core/profile.c) with the monotonic clock
into a buffer preallocated when the outermost profile() of a thread starts;
the threads that work for a call (copy workers, replica workers) record
into the buffer of the thread that made the call. This module turns them
into a table, a Gantt chart, a Chrome/Perfetto trace and plain dicts.

Python code that is part of a call (the torch adapter's steps) records
through :func:`span` (a measured step on a device) and :func:`phase` (a
step of the call itself, or the call); both do nothing outside profile().
"""
import contextlib
import html
import json
import operator
import threading

from . import _dpmini

__all__ = ["profile", "Profile", "span", "phase", "recording", "copy_limit"]

# The order of the C event tuples (csrc/py/profile_py.c, event_tuple).
_FIELDS = ("start_ns", "end_ns", "bytes", "thread", "call", "kind", "phase", "dev_kind",
           "dev_index", "path", "strided", "root", "label")
# enum dp_prof_kind (csrc/core/profile.h), in order.
_KINDS = ("call", "scatter", "replicate", "parallel_apply", "gather", "broadcast", "reduce",
          "copy", "replica", "wait", "sum", "blas", "user", "device")
_PHASES = _KINDS[:7]
# enum dp_prof_path
_PATHS = (None, "inline", "worker", "stream", "feed", "gpu")
_DEVICE_KINDS = ("cpu", "cpu", "cuda")

_DEFAULT_MAX_EVENTS = 1 << 16
_local = threading.local()


def _stack():
    stack = getattr(_local, "stack", None)
    if stack is None:
        stack = _local.stack = []
    return stack


def recording():
    """Whether the calling thread records into a profile() now (bool).

    Python steps that would compute something only for the profile (a byte
    count) can skip it when this is False.
    """
    return _dpmini._profile_recording()


@contextlib.contextmanager
def span(label, device=None, bytes=0):
    """Record the body of a ``with`` block as one span of the current call.

    Args:
        label: str, the span's name (at most 23 bytes are kept).
        device: the device the work is for (a dpmini.Device, "cpu:1",
            "cuda:0", "cpu" for the host) or None.
        bytes: int >= 0, bytes the step moved (copies), for GB/s.

    Nothing is recorded outside :func:`profile` (one C flag check). The span
    belongs to the call the thread is in (an open :func:`phase` or a C call),
    as kind ``"user"``. Raises ValueError for a bad device, as the C
    functions do.
    """
    if not _dpmini._profile_recording():
        yield
        return
    t0 = _dpmini._profile_now()
    try:
        yield
    finally:
        _dpmini._profile_record(label, t0, _dpmini._profile_now(), device, bytes)


@contextlib.contextmanager
def phase(kind, label=None):
    """Record the body as a phase of a call (or as the call itself).

    Args:
        kind: one of "call", "scatter", "replicate", "parallel_apply",
            "gather", "broadcast", "reduce".
        label: str or None, a name shown with the span (e.g. the module's
            class name for "call").

    The first phase a thread opens outside any call opens a new call (as a
    standalone ``dpmini.scatter`` is a call of its own); C steps run inside
    it belong to it. Raises ValueError for an unknown kind.
    """
    if kind not in _PHASES:
        raise ValueError(f"kind: expected one of {', '.join(_PHASES)}, got {kind!r}")
    if not _dpmini._profile_recording():
        yield
        return
    token = _dpmini._profile_begin(_PHASES.index(kind))
    try:
        yield
    finally:
        _dpmini._profile_end(token, label)


def copy_limit(nbytes, threads=1, repeat=7):
    """The machine's copy limit now: the faster of memcpy and streaming stores.

    Args:
        nbytes: int >= 1, bytes copied in all (split over the threads).
        threads: int in [1, 64], threads copying at the same time.
        repeat: int >= 1, copies timed; the best counts.

    Returns a dict: ``memcpy_gbps`` (libc memcpy), ``stream_gbps``
    (non-temporal stores, what the copy engine uses for large copies) and
    ``gbps``, the faster of the two: the limit a copy's GB/s is compared
    with, measured in the same run (pages touched beforehand, so no page
    faults are timed). GB/s are 1e9 bytes per second. Raises ValueError for
    bad arguments, MemoryError when the buffers (2 x nbytes) cannot be had.
    """
    rates = {}
    for key, streaming in (("memcpy_gbps", False), ("stream_gbps", True)):
        seconds = _dpmini._copy_limit_seconds(nbytes, threads, streaming, repeat)
        rates[key] = nbytes / seconds / 1e9 if seconds > 0 else float("inf")
    rates["gbps"] = max(rates["memcpy_gbps"], rates["stream_gbps"])
    return rates


class profile(contextlib.ContextDecorator):
    """Record where dpmini's calls spend their time: a context manager and decorator.

    ``with dpmini.profile() as prof: dp(x)`` records every DataParallel,
    data_parallel, scatter, gather, replicate, parallel_apply and dpmini.comm
    call the thread makes inside the block: per call and per device, the
    scatter copies (bytes, strided or contiguous, which copy path), the
    replicate copies, each replica's run (start, end, thread), waits (a
    worker waiting for the GIL, the caller waiting for replicas), the gather
    copies, sums, and BLAS thread-limit changes. Times are CLOCK_MONOTONIC
    nanoseconds (``time.monotonic_ns``).

    Args:
        max_events: int in [1, 2**26], the events the buffer holds (about
            80 bytes each, allocated when the outermost profile of the
            thread starts). When it is full, recording stops and
            :attr:`Profile.dropped` counts the spans that were not recorded.

    Returns (``as``): a :class:`Profile`, filled when the block ends.

    Per thread: another thread's calls are not recorded (its own profile()
    records them). Nests: an inner profile() gets the events of its own
    block, and the outer one gets them too. As a decorator
    (``@dpmini.profile()``) each call of the function is recorded afresh;
    the object's ``.result`` is the last call's Profile.

    Outside profile() nothing is recorded and the hot paths check one flag.
    Raises ValueError for a bad max_events, RuntimeError when the same
    profile object is entered again while active, or left on another thread.
    Modelled on torch.profiler.profile (a context manager whose result has a
    table and a Chrome trace export).
    """

    def __init__(self, max_events=_DEFAULT_MAX_EVENTS):
        if isinstance(max_events, bool) or not hasattr(type(max_events), "__index__"):
            raise TypeError(f"max_events: expected an int, got {type(max_events).__name__}")
        max_events = operator.index(max_events)
        if not 1 <= max_events <= 1 << 26:
            raise ValueError(f"max_events: expected an int in [1, {1 << 26}], got {max_events}")
        self.max_events = max_events
        self.result = None
        self._active = None

    def _recreate_cm(self):
        return self

    def __enter__(self):
        if self._active is not None:
            raise RuntimeError("profile: this profile object is already active; use a new "
                               "dpmini.profile() for a nested block")
        stack = _stack()
        if stack:
            session = stack[0]._active["session"]
            start, dropped = _dpmini._profile_counts(session)
        else:
            session = _dpmini._profile_start(self.max_events)
            start, dropped = 0, 0
        self._active = {"session": session, "start": start, "dropped": dropped,
                        "thread": threading.get_ident(), "t0": _dpmini._profile_now()}
        stack.append(self)
        self.result = Profile([], 0, self._active["t0"], self._active["t0"])
        return self.result

    def __exit__(self, *exc):
        active = self._active
        if active is None:
            return False
        if active["thread"] != threading.get_ident():
            raise RuntimeError("profile: left on another thread than the one that entered it")
        t1 = _dpmini._profile_now()
        stack = _stack()
        session = active["session"]
        count, dropped = _dpmini._profile_counts(session)
        rows = _dpmini._profile_events(session, active["start"], count)
        # Blocks may end out of order (asyncio tasks on one thread): they all share
        # the outermost block's session, which stops when the last of them ends.
        for i in range(len(stack) - 1, -1, -1):
            if stack[i] is self:
                del stack[i]
                break
        if not stack:
            _dpmini._profile_stop(session)
        self._active = None
        self.result._fill([_event_dict(r) for r in rows], dropped - active["dropped"],
                          active["t0"], t1)
        return False


def _device_name(kind, index):
    if kind < 0:
        return None
    if kind == 0:
        return "cpu"
    return f"{_DEVICE_KINDS[kind]}:{index}"


def _event_dict(row):
    e = dict(zip(_FIELDS, row))
    kind = _KINDS[e["kind"]] if 0 <= e["kind"] < len(_KINDS) else str(e["kind"])
    out = {
        "name": e["label"] or kind,
        "kind": kind,
        "phase": _KINDS[e["phase"]] if 0 <= e["phase"] < len(_PHASES) else None,
        "call": e["call"] or None,
        "device": _device_name(e["dev_kind"], e["dev_index"]),
        "thread": e["thread"],
        "start_ns": e["start_ns"],
        "end_ns": e["end_ns"],
        "duration_ns": e["end_ns"] - e["start_ns"],
        "bytes": e["bytes"],
        "path": _PATHS[e["path"]] if e["path"] < len(_PATHS) else str(e["path"]),
        "strided": bool(e["strided"]),
        "root": bool(e["root"]),
    }
    return out


def _union_ns(intervals):
    """Total length of the union of (start, end) intervals."""
    total, end = 0, None
    for a, b in sorted(intervals):
        if end is None or a > end:
            total += b - a
            end = b
        elif b > end:
            total += b - end
            end = b
    return total


def _device_sort_key(name):
    kind, _, index = name.partition(":")
    return (kind != "cpu" or not index, kind, int(index) if index.isdigit() else -1)


class Profile:
    """The spans one :func:`profile` block recorded, and views of them.

    Attributes:
        events: list of dicts, one per span, in recording order: ``name``,
            ``kind`` ("call", "scatter", "replicate", "parallel_apply",
            "gather", "broadcast", "reduce" for a call's phases on the
            calling thread; "copy", "replica", "wait", "sum", "blas",
            "user", "device" for work on a device), ``phase`` (the phase it
            ran in), ``call`` (int id, None outside a call), ``device``
            ("cpu:0", "cuda:1", "cpu" for the host, or None), ``thread`` (OS
            thread id), ``start_ns``/``end_ns``/``duration_ns`` (monotonic
            ns), ``bytes``, ``path`` (a copy's path: "inline", "worker",
            "stream" (streaming stores), "feed", "gpu"), ``strided`` (a copy
            with a non-contiguous side), ``root`` (the span that opened its
            call: its wall time).
        dropped: int, spans not recorded because the buffer was full.
        start_ns, end_ns: the block's own start and end (monotonic ns).
    """

    def __init__(self, events, dropped, start_ns, end_ns):
        self._fill(events, dropped, start_ns, end_ns)

    def _fill(self, events, dropped, start_ns, end_ns):
        self.events = events
        self.dropped = dropped
        self.start_ns = start_ns
        self.end_ns = end_ns

    def calls(self):
        """Per call, a summary dict (list, in call order).

        Keys: ``call`` (id), ``name``, ``wall_ns`` (the call's span),
        ``phases`` ({phase: ns on the calling thread}), ``devices``
        ({device: {"copy_ns", "copy_bytes", "copy_gbps", "replica_ns",
        "wait_ns", "busy_ns" (the union of its spans), "idle_ns"
        (wall - busy), "copy_by_phase": {phase: {"ns", "bytes", "gbps",
        "strided", "paths"}}}}), ``idle_devices`` (devices the call could
        use that ran no replica and copied nothing), ``overhead_ns``
        (dpmini's own time: wall minus the time when some replica ran or
        some copy ran, on any device), ``overhead_share`` (of wall).
        """
        by_call = {}
        for e in self.events:
            if e["call"] is not None:
                by_call.setdefault(e["call"], []).append(e)
        return [_call_summary(cid, evs) for cid, evs in sorted(by_call.items())]

    def table(self, unit="ms"):
        """The per-call table as text: phase x device times, GB/s, idle devices, overhead.

        Args:
            unit: "ms" or "us" for the times.

        Returns a str (print it). Each call shows its wall time, the time of
        each phase on the calling thread, then one row per device: its
        scatter / replicate / gather copies (time and GB/s, "strided" when a
        side was not contiguous), its replica's run, waits, busy and idle
        time; then dpmini's own overhead (wall - time when some replica or
        copy ran) and the idle devices. Raises ValueError for another unit.
        """
        scale = {"ms": 1e6, "us": 1e3}.get(unit)
        if scale is None:
            raise ValueError(f"unit: expected 'ms' or 'us', got {unit!r}")
        lines = []
        if self.dropped:
            lines.append(f"WARNING: {self.dropped} spans dropped (buffer full: "
                         f"raise profile(max_events=...))")
        calls = self.calls()
        if not calls:
            lines.append("no dpmini calls recorded")
        for c in calls:
            lines.extend(_call_lines(c, scale, unit))
        return "\n".join(lines)

    def __str__(self):
        return self.table()

    def __repr__(self):
        return (f"<dpmini.Profile: {len(self.calls())} calls, {len(self.events)} spans, "
                f"{self.dropped} dropped>")

    def _repr_html_(self):
        """A Jupyter rich display: the per-call tables as HTML."""
        parts = []
        if self.dropped:
            parts.append(f"<p><b>{self.dropped} spans dropped</b> (buffer full)</p>")
        for c in self.calls():
            parts.append(_call_html(c))
        if not parts:
            parts.append("<p>no dpmini calls recorded</p>")
        return "\n".join(parts)

    def export_chrome_trace(self, path):
        """Write the spans as Trace Event Format JSON (chrome://tracing, Perfetto).

        Args:
            path: str or os.PathLike, the file to write.

        One process track per device (named "cpu:0", ...) with one thread
        track per OS thread that worked for it, and a "calls" track with each
        call's phases on the calling thread; complete events (``"ph": "X"``,
        ``ts``/``dur`` in microseconds) with the span's bytes, path, call and
        phase in ``args``. The format torch.profiler's export_chrome_trace
        writes. Raises OSError when the file cannot be written.
        """
        with open(path, "w", encoding="utf-8") as f:
            json.dump(self.chrome_trace(), f)

    def chrome_trace(self):
        """The Trace Event Format object export_chrome_trace writes (a dict)."""
        tracks = {None: 0}
        for e in self.events:
            dev = _track_of(e)
            if dev not in tracks:
                tracks[dev] = 0
        names = sorted((d for d in tracks if d is not None), key=_device_sort_key)
        for i, d in enumerate(names, start=1):
            tracks[d] = i
        out = [{"name": "process_name", "ph": "M", "pid": 0, "tid": 0,
                "args": {"name": "dpmini calls"}}]
        out += [{"name": "process_name", "ph": "M", "pid": tracks[d], "tid": 0,
                 "args": {"name": d}} for d in names]
        out += [{"name": "process_sort_index", "ph": "M", "pid": pid, "tid": 0,
                 "args": {"sort_index": pid}} for pid in tracks.values()]
        t0 = self.start_ns
        for e in self.events:
            if e["kind"] == "device":
                continue
            args = {"call": e["call"], "phase": e["phase"], "thread": e["thread"]}
            if e["bytes"]:
                args["bytes"] = e["bytes"]
                args["GB/s"] = round(e["bytes"] / max(e["duration_ns"], 1), 3)
            if e["path"]:
                args["path"] = e["path"]
                args["strided"] = e["strided"]
            out.append({"name": _span_title(e), "cat": e["kind"], "ph": "X",
                        "ts": (e["start_ns"] - t0) / 1e3, "dur": e["duration_ns"] / 1e3,
                        "pid": tracks[_track_of(e)], "tid": e["thread"], "args": args})
        return {"traceEvents": out, "displayTimeUnit": "ms"}

    def plot(self, ax=None, title=None):
        """A Gantt chart of the spans: one row per device (and one for the calls' phases).

        Args:
            ax: a matplotlib Axes to draw on, or None for a new figure.
            title: str or None.

        Bars are coloured by what they are: scatter, replicate and gather
        copies, replica runs, waits, sums; the top row shows each call's
        phases on the calling thread. The x axis is ms since the profile
        started. Returns the Axes. Needs matplotlib (ImportError naming it
        otherwise).
        """
        from ._plan import _pyplot

        plt = _pyplot()
        devices = sorted({e["device"] for e in self.events
                          if e["device"] is not None and e["kind"] != "device"},
                         key=_device_sort_key)
        rows = ["calls"] + devices
        if ax is None:
            _, ax = plt.subplots(figsize=(10, 1 + 0.6 * len(rows)))
        colours = _plot_colours()
        used = {}
        t0 = self.start_ns
        for e in self.events:
            if e["kind"] == "device":
                continue
            row = 0 if e["device"] is None else rows.index(e["device"])
            key = _colour_key(e)
            colour = colours.get(key, "#999999")
            y = len(rows) - 1 - row
            # the calls row: each call a thin bar under its phases
            bottom, height = (y - 0.4, 0.2) if e["root"] else \
                (y - 0.15, 0.55) if row == 0 else (y - 0.4, 0.8)
            used[key] = colour
            ax.broken_barh([((e["start_ns"] - t0) / 1e6, max(e["duration_ns"], 1) / 1e6)],
                           (bottom, height), facecolors=colour, edgecolors="none")
        ax.set_yticks(range(len(rows)))
        ax.set_yticklabels(list(reversed(rows)))
        ax.set_xlabel("ms since profile() started")
        if title:
            ax.set_title(title)
        if used:
            from matplotlib.patches import Patch

            ax.legend(handles=[Patch(color=c, label=k) for k, c in used.items()],
                      loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize="small")
        return ax


def _track_of(e):
    return e["device"] if e["device"] is not None and e["kind"] != "device" else None


def _span_title(e):
    if e["kind"] == "copy":
        return f"{e['phase'] or 'copy'} copy"
    if e["kind"] == "user" or e["kind"] in _PHASES:
        return e["name"] if e["name"] == e["kind"] else f"{e['kind']}: {e['name']}"
    if e["kind"] == "wait":
        return f"wait ({e['name']})"
    return e["name"]


def _colour_key(e):
    if e["kind"] == "copy":
        return f"{e['phase'] or 'other'} copy"
    return e["kind"]


def _plot_colours():
    return {"call": "#bbbbbb", "scatter": "#9ecae1", "replicate": "#c7e9c0",
            "parallel_apply": "#fdd0a2", "gather": "#dadaeb", "broadcast": "#c7e9c0",
            "reduce": "#fcbba1", "scatter copy": "#3182bd", "replicate copy": "#31a354",
            "broadcast copy": "#31a354", "gather copy": "#756bb1", "reduce copy": "#de2d26",
            "other copy": "#636363", "replica": "#e6550d", "wait": "#fdae6b", "sum": "#a50f15",
            "blas": "#e7ba52", "user": "#8c6d31"}


def _gbps(nbytes, ns):
    return nbytes / ns if ns > 0 else None


def _call_summary(cid, evs):
    roots = [e for e in evs if e["root"]]
    root = roots[-1] if roots else max(evs, key=lambda e: e["duration_ns"])
    wall = root["duration_ns"]
    phases = {}
    for e in evs:
        if e["kind"] in _PHASES and e is not root:
            phases[e["kind"]] = phases.get(e["kind"], 0) + e["duration_ns"]
    if root["kind"] != "call":
        phases[root["kind"]] = phases.get(root["kind"], 0) + wall
    devices = {}
    known = set()
    work = []
    for e in evs:
        if e["device"] is None:
            continue
        if e["kind"] == "device":
            known.add(e["device"])
            continue
        d = devices.setdefault(e["device"], {"copy_ns": 0, "copy_bytes": 0, "replica_ns": 0,
                                             "wait_ns": 0, "other_ns": 0, "spans": [],
                                             "copy_by_phase": {}})
        d["spans"].append((e["start_ns"], e["end_ns"]))
        if e["kind"] == "copy":
            d["copy_ns"] += e["duration_ns"]
            d["copy_bytes"] += e["bytes"]
            p = d["copy_by_phase"].setdefault(e["phase"] or "other",
                                              {"ns": 0, "bytes": 0, "strided": False,
                                               "paths": []})
            p["ns"] += e["duration_ns"]
            p["bytes"] += e["bytes"]
            p["strided"] |= e["strided"]
            if e["path"] not in p["paths"]:
                p["paths"].append(e["path"])
            work.append((e["start_ns"], e["end_ns"]))
        elif e["kind"] == "replica":
            d["replica_ns"] += e["duration_ns"]
            work.append((e["start_ns"], e["end_ns"]))
        elif e["kind"] == "wait":
            d["wait_ns"] += e["duration_ns"]
        else:
            d["other_ns"] += e["duration_ns"]
    for name, d in devices.items():
        d["busy_ns"] = _union_ns(d.pop("spans"))
        d["idle_ns"] = max(wall - d["busy_ns"], 0)
        d["copy_gbps"] = _gbps(d["copy_bytes"], d["copy_ns"])
        for p in d["copy_by_phase"].values():
            p["gbps"] = _gbps(p["bytes"], p["ns"])
    for name in known - set(devices):
        devices[name] = {"copy_ns": 0, "copy_bytes": 0, "replica_ns": 0, "wait_ns": 0,
                         "other_ns": 0, "busy_ns": 0, "idle_ns": wall, "copy_gbps": None,
                         "copy_by_phase": {}}
    idle = sorted((n for n, d in devices.items()
                   if d["replica_ns"] == 0 and d["copy_ns"] == 0), key=_device_sort_key)
    overhead = max(wall - _union_ns(work), 0)
    return {"call": cid, "name": root["name"], "wall_ns": wall, "phases": phases,
            "devices": dict(sorted(devices.items(), key=lambda kv: _device_sort_key(kv[0]))),
            "idle_devices": idle, "overhead_ns": overhead,
            "overhead_share": overhead / wall if wall else 0.0}


_TABLE_PHASES = ("scatter", "replicate", "broadcast", "gather", "reduce")


def _copy_cell(p, scale):
    if p is None:
        return "-"
    rate = f" {p['gbps']:.1f} GB/s" if p["gbps"] is not None else ""
    return f"{p['ns'] / scale:.2f}{rate}{' strided' if p['strided'] else ''}"


def _call_lines(c, scale, unit):
    phases = ", ".join(f"{k} {v / scale:.2f}" for k, v in c["phases"].items())
    lines = [f"call {c['call']} ({c['name']}): wall {c['wall_ns'] / scale:.2f} {unit}"
             f"; phases ({unit}): {phases or '-'}"]
    used = [p for p in _TABLE_PHASES
            if any(p in d["copy_by_phase"] for d in c["devices"].values())]
    header = ["device"] + [f"{p} copy" for p in used] + ["replica", "wait", "busy", "idle"]
    rows = []
    for name, d in c["devices"].items():
        rows.append([name] + [_copy_cell(d["copy_by_phase"].get(p), scale) for p in used] +
                    [f"{d['replica_ns'] / scale:.2f}", f"{d['wait_ns'] / scale:.2f}",
                     f"{d['busy_ns'] / scale:.2f}", f"{d['idle_ns'] / scale:.2f}"])
    if rows:
        widths = [max(len(r[i]) for r in rows + [header]) for i in range(len(header))]
        lines.append("  " + "  ".join(h.ljust(w) for h, w in zip(header, widths)) +
                     f"   ({unit})")
        for r in rows:
            lines.append("  " + "  ".join(v.ljust(w) for v, w in zip(r, widths)))
    lines.append(f"  dpmini's own overhead: {c['overhead_ns'] / scale:.2f} {unit} "
                 f"({100 * c['overhead_share']:.1f}% of wall; wall minus the time when a "
                 f"replica or a copy ran)")
    if c["idle_devices"]:
        lines.append(f"  idle devices: {', '.join(c['idle_devices'])}")
    return lines


def _call_html(c):
    scale = 1e6
    esc = html.escape
    used = [p for p in _TABLE_PHASES
            if any(p in d["copy_by_phase"] for d in c["devices"].values())]
    head = "".join(f"<th>{esc(p)} copy (ms, GB/s)</th>" for p in used)
    rows = []
    for name, d in c["devices"].items():
        cells = "".join(f"<td>{esc(_copy_cell(d['copy_by_phase'].get(p), scale))}</td>"
                        for p in used)
        rows.append(f"<tr><td>{esc(name)}</td>{cells}<td>{d['replica_ns'] / scale:.2f}</td>"
                    f"<td>{d['wait_ns'] / scale:.2f}</td><td>{d['idle_ns'] / scale:.2f}</td></tr>")
    phases = ", ".join(f"{esc(k)} {v / scale:.2f} ms" for k, v in c["phases"].items())
    idle = (f"<br>idle devices: {esc(', '.join(c['idle_devices']))}"
            if c["idle_devices"] else "")
    return (f"<p><b>call {c['call']}</b> ({esc(c['name'])}): wall {c['wall_ns'] / scale:.2f} ms; "
            f"{phases}<br>dpmini's own overhead {c['overhead_ns'] / scale:.2f} ms "
            f"({100 * c['overhead_share']:.1f}%){idle}</p>"
            f"<table><tr><th>device</th>{head}<th>replica (ms)</th><th>wait (ms)</th>"
            f"<th>idle (ms)</th></tr>{''.join(rows)}</table>")

