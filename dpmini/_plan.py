"""dpmini.explain: what DataParallel would do with some inputs, shown before it does it.

`explain` asks the C core for the split plan of a call (the same code path that
DataParallel's scatter runs, with no copy made) and wraps the answer in a `Plan`,
whose `str()` is a fixed-width table: per array leaf, which rows go to which
device, the shape of each chunk and its size in bytes.

The split rule is torch.chunk's (docs/spec.md 0.1): for k devices and n rows along the
split dim, split = ceil(n / k) rows per chunk with a shorter last one, so there
are max(ceil(n / split), 1) chunks, which can be fewer than k; n == 0 gives k
empty chunks (docs/spec.md 0.2). Chunk i goes to device_ids[i] (docs/spec.md 0.4). The replica
count is the smallest chunk count over all array leaves of args and kwargs
together (docs/spec.md 10.1); non-array leaves are shared by reference (docs/spec.md 3.1).

Beyond PyTorch, `in_dims` (JAX pmap's in_axes) picks a dim per argument or
broadcasts an array whole (None), and `chunk_sizes` / `weights` replace the
torch.chunk sizes (see DataParallel's docstring). `Plan.plot()` draws the plan
with matplotlib (an optional dependency: `pip install dpmini[plot]`).
"""
import html
import os
import sys

from . import _dpmini

__all__ = ["Plan", "explain"]

_SIZE_UNITS = ("B", "KiB", "MiB", "GiB", "TiB")


def explain(inputs, device_ids, dim=0, kwargs=None, strict=False, in_dims=None,
            chunk_sizes=None, weights=None):
    """Return the `Plan` DataParallel would follow for a call with these arguments.

    inputs: the positional arguments. A tuple is taken as the argument tuple;
        anything else is wrapped as (inputs,) and None becomes () -- the rule of
        dpmini.data_parallel (docs/spec.md 2.9), so a list counts as ONE argument.
    device_ids: the devices ("cpu:0", Device, int for CUDA), or None for the
        default list (every CUDA device, else the virtual CPU devices).
    dim: the split dim (int, may be negative; wrapped per array leaf).
    kwargs: the keyword arguments (a mapping) or None.
    strict: as DataParallel(strict=True): an array that would lose rows (the
        condition of dpmini.SplitWarning) becomes an error.
    in_dims, chunk_sizes, weights: as for DataParallel (in_dims addresses the
        positional arguments by position and kwargs by name; None leaves are
        broadcast whole; chunk_sizes / weights give one entry per device).

    Nothing is copied and the module is not needed. Mistakes DataParallel
    rejects at construction (a bad device, a host device in device_ids) raise
    ValueError/TypeError as there (so do in_dims entries of the wrong type and
    chunk_sizes / weights of the wrong length or value). Mistakes it would
    raise while scattering (a 0-dim array leaf, a dim out of range, chunk
    counts that differ under strict=True, chunk_sizes that do not sum to an
    array's size, an in_dims that does not match the arguments) do not raise: they are recorded in `plan.error`, so the table
    still shows everything found up to that point.
    """
    if not isinstance(inputs, tuple):
        inputs = () if inputs is None else (inputs,)
    try:
        kwargs = {} if kwargs is None else dict(kwargs)
    except (TypeError, ValueError):
        raise TypeError(f"kwargs: expected a mapping of keyword arguments or None, "
                        f"got {type(kwargs).__name__}") from None
    record = _dpmini._plan(inputs, kwargs, device_ids, dim, strict, in_dims=in_dims,
                           chunk_sizes=chunk_sizes, weights=weights)
    record["dim"] = dim
    record["in_dims"] = in_dims
    record["chunk_sizes"] = None if chunk_sizes is None else list(chunk_sizes)
    record["weights"] = None if weights is None else list(weights)
    return Plan(record)


class Plan:
    """How one DataParallel call would split its inputs over the devices.

    Built by `dpmini.explain`; `str(plan)` is a readable table. Attributes:

    devices: list of dpmini.Device, in device_ids order (chunk i -> devices[i]).
    replicas: int k, the number of replicas that would run (<= len(devices);
        1 for a call without arguments; 0 when error is set).
    dim: the split dim as given to explain (each leaf also has its wrapped dim).
    rule: how the sizes were computed: "chunk" (torch.chunk), "chunk_sizes" or
        "weights"; chunk_sizes / weights: the lists given, or None.
    leaves: one dict per array leaf, in argument order, with
        'path'     the argument path, e.g. "args[0]" or "kwargs['mask']";
        'library'  the array's type and device: "numpy.ndarray cpu",
                   "torch.Tensor cpu", "jax.Array cpu", "cupy.ndarray cuda:0";
        'shape'    the full shape (tuple of ints); 'dtype' a numpy.dtype;
        'itemsize' bytes per element;
        'broadcast' True for an in_dims None leaf: the whole array goes to every
                   replica; then 'dim', 'sizes' and 'starts' are None and
                   'nbytes' holds the whole array's bytes per replica device;
        'dim'      the wrapped split dim (0 <= dim < ndim);
        'sizes'    len(devices) ints: rows along dim each device gets (0: none;
                   with error set, each array's own torch.chunk sizes);
        'starts'   len(devices) ints: the first of those rows;
        'nbytes'   len(devices) ints: bytes each chunk holds.
    shared: paths of non-array leaves (passed to every replica by reference).
    warnings: messages DataParallel would warn (dpmini.SplitWarning texts).
    error: None, or the message DataParallel would raise for this call.
    """

    def __init__(self, record):
        """record: the dict returned by the C function dpmini._dpmini._plan."""
        self._record = record
        self.devices = list(record["devices"])
        self.replicas = int(record["replicas"])
        self.dim = record.get("dim", 0)
        self.leaves = list(record["leaves"])
        self.shared = list(record.get("shared", ()))
        self.warnings = list(record.get("warnings", ()))
        self.error = record.get("error")
        self.rule = record.get("rule", "chunk")
        self.chunk_sizes = record.get("chunk_sizes")
        self.weights = record.get("weights")

    def to_dict(self):
        """The plan as a plain dict (the keys listed in the class docstring, plus 'dim')."""
        return dict(self._record)

    def __repr__(self):
        extra = f", error={self.error!r}" if self.error else ""
        return (f"<dpmini.Plan: {_count(self.replicas, 'replica')} on "
                f"{_count(len(self.devices), 'device')}, "
                f"{_count(len(self.leaves), 'array leaf', 'array leaves')}, "
                f"{_count(len(self.warnings), 'warning')}{extra}>")

    def __str__(self):
        rule = ""
        if self.rule == "chunk_sizes":
            rule = f", chunk_sizes={self.chunk_sizes}"
        elif self.rule == "weights":
            rule = f", weights={self.weights}"
        lines = [f"DataParallel plan: {_count(self.replicas, 'replica')} on "
                 f"{_count(len(self.devices), 'device')} (dim={self.dim}{rule})"
                 + (", the call would raise (error below)" if self.error else "")]
        for leaf in self.leaves:
            lines.append("")
            lines.extend(_leaf_block(leaf, self.devices, self.replicas))
        if self.shared:
            lines.append("")
            lines.append("shared by reference: " + ", ".join(self.shared))
        if self.warnings or self.error:
            lines.append("")
        lines.extend(f"warning: {w}" for w in self.warnings)
        if self.error:
            lines.append(f"error: {self.error}")
        return "\n".join(lines)

    def _repr_html_(self):
        """A Jupyter rich display: the plan as HTML tables, one per array leaf.

        The same content as str(plan): the summary line, per leaf a table of
        device, range along dim, chunk shape and size, then shared leaves,
        warnings and the error.
        """
        esc = html.escape
        lines = str(self).split("\n")
        parts = [f"<p><b>{esc(lines[0])}</b></p>"]
        for leaf in self.leaves:
            title, header, rows = _leaf_table(leaf, self.devices, self.replicas)
            cells = "".join("<tr>" + "".join(f"<td>{esc(c)}</td>" for c in row) + "</tr>"
                            for row in rows)
            parts.append(f"<p>{esc(title)}</p><table><tr>"
                         + "".join(f"<th>{esc(h)}</th>" for h in header)
                         + f"</tr>{cells}</table>")
        if self.shared:
            parts.append(f"<p>shared by reference: {esc(', '.join(self.shared))}</p>")
        parts.extend(f"<p>warning: {esc(w)}</p>" for w in self.warnings)
        if self.error:
            parts.append(f"<p><b>error:</b> {esc(self.error)}</p>")
        return "\n".join(parts)

    def idle_devices(self):
        """The devices that get nothing: no replica runs there (a list of str)."""
        return [str(d) for i, d in enumerate(self.devices) if i >= self.replicas]

    def plot(self, ax=None, title=None):
        """Draw the plan: one horizontal strip per array leaf, along its split dim.

        Each strip is the leaf's split dim scaled to the full width; the rows
        of each device are a segment in that device's colour, labelled with
        the device and its row range. A broadcast leaf (in_dims None) is one
        hatched strip (the whole array on every replica). Devices that get
        nothing (no replica) are listed in the legend as "(nothing)" with no
        fill, and rows lost to truncation are drawn as a red hatched tail.

        A plan whose call would raise (plan.error) has no chunks to show:
        every leaf is drawn as one grey dotted strip, the title says
        "the call would raise: <error>", and the legend lists every device as
        getting nothing.

        Many devices: beyond 16 devices the idle ones (always the last ones)
        share one legend entry ("cpu:50..cpu:63: nothing (14 devices)"); a
        legend of more than 16 entries is laid out in columns (at most 8) and
        a new figure grows wider and taller to hold it.

        ax: a matplotlib Axes to draw into (None: a new Figure, laid out with
        tight_layout; a given Axes' figure is left to its owner's layout).
        title: the title (None: "DataParallel plan: k replicas on n devices").
        Returns the matplotlib Figure. Needs matplotlib (an optional
        dependency: pip install "dpmini[plot]"); ImportError otherwise. With
        no display (no $DISPLAY and no $MPLBACKEND, on Linux) the Agg backend
        is used, so this works on servers and in CI; save with fig.savefig(path).
        """
        plt = _pyplot()
        from matplotlib.patches import Patch

        leaves = self.leaves
        failed = bool(self.error)
        replicas = 0 if failed else self.replicas
        colours = _device_colours(len(self.devices))
        entries = _legend_entries(self.devices, replicas)
        rows = len(entries) if len(entries) <= 16 else max(16, -(-len(entries) // 8))
        ncol = -(-len(entries) // rows) if entries else 1
        # Legend width in inches at fontsize 8: each column (filled top to
        # bottom) as wide as its longest label, plus the colour patch.
        columns = [entries[c * rows:(c + 1) * rows] for c in range(ncol)]
        legend_width = sum(0.45 + 0.062 * max(len(label) for label, _ in col)
                           for col in columns if col) or 1.0
        created = ax is None
        if created:
            width = 6.7 + legend_width
            height = max(1.4 + 0.6 * max(len(leaves), 1), 0.9 + 0.17 * rows)
            fig, ax = plt.subplots(figsize=(width, height))
        else:
            fig = ax.figure
        for row, leaf in enumerate(leaves):
            y = len(leaves) - 1 - row
            if failed:
                _draw_failed_leaf(ax, y)
            else:
                _draw_leaf(ax, y, leaf, self.devices, replicas, colours)
        ax.set_yticks(range(len(leaves)))
        ax.set_yticklabels([_leaf_label(leaf) for leaf in reversed(leaves)], fontsize=8)
        ax.set_xlim(0.0, 1.0)
        ax.set_ylim(-0.6, max(len(leaves), 1) - 0.4)
        ax.set_xlabel("position along the split dim (fraction of its rows)", fontsize=8)
        for side in ("top", "right"):
            ax.spines[side].set_visible(False)
        handles = []
        for label, index in entries:
            if index is not None:
                handles.append(Patch(facecolor=colours[index], label=label))
            else:
                handles.append(Patch(facecolor="white", edgecolor="grey", linestyle="--",
                                     label=label))
        ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.01, 1.0), ncol=ncol,
                  fontsize=8, frameon=False, title="devices", title_fontsize=8,
                  columnspacing=1.0)
        if title is None:
            if failed:
                title = "the call would raise: " + _shorten(self.error, 300)
            else:
                title = (f"DataParallel plan: {_count(self.replicas, 'replica')} on "
                         f"{_count(len(self.devices), 'device')}")
                if self.rule != "chunk":
                    title += f" ({self.rule})"
        if failed:
            ax.set_title(_wrap(title, 90), fontsize=9, color="firebrick")
        else:
            ax.set_title(title, fontsize=10)
        notes = [f"warning: {w}" for w in self.warnings]
        if self.error:
            notes.append(f"error: {self.error}")
        if notes:
            fig.text(0.01, 0.01, "\n".join(_shorten(n, 120) for n in notes), fontsize=6,
                     va="bottom", color="firebrick")
        if created:
            fig.tight_layout(rect=(0, 0.06 * min(len(notes), 3), 1, 1))
        return fig


def _legend_entries(devices, replicas):
    """(label, colour index or None) per legend entry: every device, "(nothing)"
    for those without a replica; beyond 16 devices the idle ones (the last
    ones) are one entry."""
    entries = [(str(dev), i) for i, dev in enumerate(devices) if i < replicas]
    idle = [str(dev) for i, dev in enumerate(devices) if i >= replicas]
    if len(devices) > 16 and len(idle) > 1:
        entries.append((f"{idle[0]}..{idle[-1]}: nothing ({len(idle)} devices)", None))
    else:
        entries.extend((f"{dev} (nothing)", None) for dev in idle)
    return entries


def _wrap(text, width):
    """text broken into lines of at most width characters (for titles)."""
    import textwrap

    return "\n".join(textwrap.wrap(text, width)) or text


def _draw_failed_leaf(ax, y):
    """A leaf of a plan whose call would raise: no chunks, one grey strip."""
    ax.barh(y, 1.0, left=0.0, height=0.6, color="0.92", hatch="..", edgecolor="0.6",
            linewidth=0.8)
    ax.text(0.5, y, "not split: the call would raise (see the title)", ha="center",
            va="center", fontsize=8, color="0.3")


def _pyplot():
    """matplotlib.pyplot, on the Agg backend when there is no display."""
    try:
        import matplotlib
    except ImportError as exc:
        raise ImportError(
            "Plan.plot() needs matplotlib, an optional dependency of dpmini: "
            "pip install 'dpmini[plot]' (or pip install matplotlib)") from exc
    if ("matplotlib.pyplot" not in sys.modules and not os.environ.get("MPLBACKEND")
            and not os.environ.get("DISPLAY") and sys.platform.startswith("linux")):
        matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _device_colours(n):
    """n distinct colours, device i -> colours[i] (tab10, then tab20, then a ramp)."""
    import matplotlib

    if n <= 10:
        cmap = matplotlib.colormaps["tab10"]
        return [cmap(i) for i in range(n)]
    if n <= 20:
        cmap = matplotlib.colormaps["tab20"]
        return [cmap(i) for i in range(n)]
    cmap = matplotlib.colormaps["viridis"]
    return [cmap(i / max(n - 1, 1)) for i in range(n)]


def _leaf_label(leaf):
    """The y tick label of a leaf: its path, shape and split dim."""
    how = "broadcast" if leaf.get("broadcast") else f"dim {leaf['dim']}"
    return f"{leaf['path']}\n{_shape_text(leaf['shape'])}, {how}"


def _draw_leaf(ax, y, leaf, devices, replicas, colours):
    """One strip of Plan.plot for a leaf at height y."""
    height = 0.6
    if leaf.get("broadcast"):
        ax.barh(y, 1.0, left=0.0, height=height, color="0.88", hatch="//",
                edgecolor="0.5", linewidth=0.8)
        ax.text(0.5, y, f"whole array on each of the {_count(replicas, 'replica')}",
                ha="center", va="center", fontsize=8)
        return
    total = int(leaf["shape"][leaf["dim"]])
    if total == 0:
        ax.barh(y, 1.0, left=0.0, height=height, color="white", edgecolor="0.4",
                linestyle="--", linewidth=0.8)
        ax.text(0.5, y, f"0 rows: each of the {_count(replicas, 'replica')} gets an "
                "empty chunk", ha="center", va="center", fontsize=8)
        return
    kept = 0
    for i, dev in enumerate(devices):
        size, start = int(leaf["sizes"][i]), int(leaf["starts"][i])
        if size == 0:
            continue
        kept = max(kept, start + size)
        left, width = start / total, size / total
        ax.barh(y, width, left=left, height=height, color=colours[i], edgecolor="white",
                linewidth=1.0)
        if width >= 0.07:
            ax.text(left + width / 2, y, f"{dev}\n[{start}:{start + size})", ha="center",
                    va="center", fontsize=7)
    if kept < total:
        # Rows no replica receives (truncation to the smallest chunk count, docs/spec.md 10.2).
        ax.barh(y, (total - kept) / total, left=kept / total, height=height, color="white",
                hatch="xx", edgecolor="firebrick", linewidth=0.8)
        ax.text((kept + total) / 2 / total, y, f"dropped\n[{kept}:{total})", ha="center",
                va="center", fontsize=7, color="firebrick",
                bbox={"facecolor": "white", "edgecolor": "none", "pad": 1.0})


def _shorten(text, width):
    """text cut to width characters with an ellipsis."""
    return text if len(text) <= width else text[:width - 3] + "..."


def _library_text(leaf):
    """' [torch.Tensor cpu]': the leaf's library and device, for its title."""
    return f" [{leaf['library']}]" if leaf.get("library") else ""


def _leaf_block(leaf, devices, replicas):
    """Lines of the table for one array leaf: a title, a header and one row per device."""
    title, header, rows = _leaf_table(leaf, devices, replicas)
    return [title] + _columns([header] + rows, indent="  ")


def _leaf_table(leaf, devices, replicas):
    """One array leaf's (title, header, rows): the text table and the HTML one."""
    if leaf.get("broadcast"):
        title = (f"{leaf['path']}: shape {_shape_text(leaf['shape'])} "
                 f"{_dtype_name(leaf['dtype'])}, broadcast whole (in_dims None)"
                 f"{_library_text(leaf)}")
        header = ("device", "rows", "chunk shape", "size")
        rows = []
        for i, dev in enumerate(devices):
            if i >= replicas:
                rows.append((str(dev), "-", "-", "(no replica)"))
            else:
                rows.append((str(dev), "all", _shape_text(leaf["shape"]),
                             _bytes_text(leaf["nbytes"][i])))
        return title, header, rows
    dim = leaf["dim"]
    title = (f"{leaf['path']}: shape {_shape_text(leaf['shape'])} "
             f"{_dtype_name(leaf['dtype'])}, split along dim {dim}{_library_text(leaf)}")
    header = ("device", f"dim {dim} range", "chunk shape", "size")
    rows = [_device_row(leaf, i, str(dev), replicas) for i, dev in enumerate(devices)]
    return title, header, rows


def _device_row(leaf, i, device, replicas):
    """One row (device, range, chunk shape, size) of a leaf's block.

    A device shows its chunk when it has rows, or when it runs a replica (an
    empty chunk when n == 0, docs/spec.md 0.2); otherwise "-" and "(no replica)".
    Rows lost to truncation (docs/spec.md 10.2) are named in the plan's warning instead.
    """
    size, start = leaf["sizes"][i], leaf["starts"][i]
    if size == 0 and i >= replicas:
        return (device, "-", "-", "(no replica)")
    shape = list(leaf["shape"])
    shape[leaf["dim"]] = size
    return (device, f"[{start}:{start + size})", _shape_text(shape),
            _bytes_text(leaf["nbytes"][i]))


def _columns(rows, indent):
    """Left-aligned fixed-width columns, two spaces apart, trailing spaces trimmed."""
    widths = [max(len(row[c]) for row in rows) for c in range(len(rows[0]))]
    return [(indent + "  ".join(cell.ljust(w) for cell, w in zip(row, widths))).rstrip()
            for row in rows]


def _shape_text(shape):
    """(5, 3) -> "(5, 3)"; (7,) -> "(7,)"; () -> "()"."""
    return str(tuple(int(s) for s in shape))


def _dtype_name(dtype):
    """A dtype as NumPy's str() writes it: "float32", ">f4" (byte order shown),
    "|S5", "[('a', '<f8'), ('b', '<i4', (2,))]" for a structured dtype (whose
    .name would be the uninformative "void96"). Anything else with .name (another
    library's dtype) by that name, else str()."""
    if type(dtype).__module__.startswith("numpy"):
        return str(dtype)
    return getattr(dtype, "name", str(dtype))


def _bytes_text(nbytes):
    """A byte count in binary units: 24 -> "24 B", 1536 -> "1.5 KiB", 2**28 -> "256.0 MiB"."""
    value, unit = float(nbytes), 0
    while value >= 1024 and unit < len(_SIZE_UNITS) - 1:
        value /= 1024
        unit += 1
    if unit == 0:
        return f"{int(nbytes)} B"
    return f"{value:.1f} {_SIZE_UNITS[unit]}"


def _count(n, singular, plural=None):
    """3, "replica" -> "3 replicas"; 1, "replica" -> "1 replica"."""
    return f"{n} {singular if n == 1 else (plural or singular + 's')}"
