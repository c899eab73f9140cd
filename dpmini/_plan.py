"""dpmini.explain: what DataParallel would do with some inputs, shown before it does it.

`explain` asks the C core for the split plan of a call (the same code path that
DataParallel's scatter runs, with no copy made) and wraps the answer in a `Plan`,
whose `str()` is a fixed-width table: per array leaf, which rows go to which
device, the shape of each chunk and its size in bytes.

The split rule is torch.chunk's (spec 0.1): for k devices and n rows along the
split dim, split = ceil(n / k) rows per chunk with a shorter last one, so there
are max(ceil(n / split), 1) chunks, which can be fewer than k; n == 0 gives k
empty chunks (spec 0.2). Chunk i goes to device_ids[i] (spec 0.4). The replica
count is the smallest chunk count over all array leaves of args and kwargs
together (design.md, R04); non-array leaves are shared by reference (R13).
"""
from . import _dpmini

__all__ = ["Plan", "explain"]

_SIZE_UNITS = ("B", "KiB", "MiB", "GiB", "TiB")


def explain(inputs, device_ids, dim=0, kwargs=None, strict=False):
    """Return the `Plan` DataParallel would follow for a call with these arguments.

    inputs: the positional arguments. A tuple is taken as the argument tuple;
        anything else is wrapped as (inputs,) and None becomes () -- the rule of
        dpmini.data_parallel (spec 2.9), so a list counts as ONE argument.
    device_ids: the devices ("cpu:0", Device, int for CUDA), or None for the
        default list (every CUDA device, else the virtual CPU devices).
    dim: the split dim (int, may be negative; wrapped per array leaf).
    kwargs: the keyword arguments (a mapping) or None.
    strict: as DataParallel(strict=True): different chunk counts become an error.

    Nothing is copied and the module is not needed. Mistakes DataParallel
    rejects at construction (a bad device, a host device in device_ids) raise
    ValueError/TypeError as there. Mistakes it would raise while scattering (a
    0-dim array leaf, a dim out of range, chunk counts that differ under
    strict=True) do not raise: they are recorded in `plan.error`, so the table
    still shows everything found up to that point.
    """
    if not isinstance(inputs, tuple):
        inputs = () if inputs is None else (inputs,)
    try:
        kwargs = {} if kwargs is None else dict(kwargs)
    except (TypeError, ValueError):
        raise TypeError(f"kwargs: expected a mapping of keyword arguments or None, "
                        f"got {type(kwargs).__name__}") from None
    record = _dpmini._plan(inputs, kwargs, device_ids, dim, strict)
    record["dim"] = dim
    return Plan(record)


class Plan:
    """How one DataParallel call would split its inputs over the devices.

    Built by `dpmini.explain`; `str(plan)` is a readable table. Attributes:

    devices: list of dpmini.Device, in device_ids order (chunk i -> devices[i]).
    replicas: int k, the number of replicas that would run (<= len(devices);
        1 for a call without arguments; 0 when error is set).
    dim: the split dim as given to explain (each leaf also has its wrapped dim).
    leaves: one dict per array leaf, in argument order, with
        'path'     the argument path, e.g. "args[0]" or "kwargs['mask']";
        'shape'    the full shape (tuple of ints); 'dtype' a numpy.dtype;
        'itemsize' bytes per element; 'dim' the wrapped split dim (0 <= dim < ndim);
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
        lines = [f"DataParallel plan: {_count(self.replicas, 'replica')} on "
                 f"{_count(len(self.devices), 'device')} (dim={self.dim})"
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


def _leaf_block(leaf, devices, replicas):
    """Lines of the table for one array leaf: a title, a header and one row per device."""
    dim = leaf["dim"]
    title = (f"{leaf['path']}: shape {_shape_text(leaf['shape'])} "
             f"{_dtype_name(leaf['dtype'])}, split along dim {dim}")
    header = ("device", f"dim {dim} range", "chunk shape", "size")
    rows = [_device_row(leaf, i, str(dev), replicas) for i, dev in enumerate(devices)]
    return [title] + _columns([header] + rows, indent="  ")


def _device_row(leaf, i, device, replicas):
    """One row (device, range, chunk shape, size) of a leaf's block.

    A device shows its chunk when it has rows, or when it runs a replica (an
    empty chunk when n == 0, spec 0.2); otherwise "-" and "(no replica)".
    Rows lost to truncation (R06) are named in the plan's warning instead.
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
    """A numpy dtype (or anything with .name, or a str) as its short name, e.g. "float32"."""
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
