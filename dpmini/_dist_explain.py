"""dpmini.distributed.explain: which rank and which device get which rows.

Pure bookkeeping on plan.c's rules (through dpmini._dist.split_sizes): no
communication, so it can run on one rank, or before init() with size= given.
"""
import numpy as np

from . import _dist

__all__ = ["DistPlan", "explain"]


class DistPlan:
    """How a global batch splits over ranks, then over each rank's devices.

    Attributes:
      rows: the global batch's rows along dim (int).
      ranks: per rank, (start, stop) in the global batch.
      devices: per rank, a list of (device, start, stop) in the global batch.
    str(plan) is a table, one line per rank.
    """

    def __init__(self, rows, dim, ranks, devices, rule):
        self.rows, self.dim, self.ranks, self.devices, self.rule = rows, dim, ranks, devices, rule

    def __str__(self):
        ndev = max((len(d) for d in self.devices), default=0)
        lines = [f"global batch: {self.rows} rows along dim {self.dim} -> {len(self.ranks)} "
                 f"ranks by {self.rule}, then {ndev} devices per rank by torch.chunk's rule"]
        for r, ((a, b), devs) in enumerate(zip(self.ranks, self.devices)):
            parts = ", ".join(f"{d} {s}:{e} ({e - s})" for d, s, e in devs)
            lines.append(f"  rank {r}: rows {a}:{b} ({b - a}) -> {parts}")
        return "\n".join(lines)

    def __repr__(self):
        return f"<DistPlan rows={self.rows} ranks={len(self.ranks)}>"


def _rows_of(inputs, dim):
    if isinstance(inputs, (int, np.integer)) and not isinstance(inputs, bool):
        return int(inputs)
    stack = [inputs]
    while stack:
        x = stack.pop(0)
        if isinstance(x, dict):
            stack.extend(x.values())
        elif isinstance(x, (list, tuple)):
            stack.extend(x)
        elif hasattr(x, "shape") and len(x.shape) > 0:
            ndim = len(x.shape)
            if not -ndim <= dim < ndim:
                raise IndexError(f"dim: {dim} is out of range for an array with {ndim} "
                                 f"dimension(s)")
            return int(x.shape[dim])
    raise TypeError("inputs: expected a row count (int) or arrays (an array, or a tuple/list/"
                    "dict holding one) to find the batch's rows along dim")


def explain(inputs, device_ids=None, dim=0, size=None, chunk_sizes=None, weights=None):
    """The DistPlan of a global batch over `size` ranks x `device_ids` per rank.

    inputs: the global batch (an array or a container of arrays: the first
        array's shape[dim] is the row count) or the row count itself (int).
    device_ids: each rank's local devices (default: DataParallel's default,
        the virtual CPU devices or every CUDA device).
    size: number of ranks (default: dpmini.distributed.size()).
    chunk_sizes / weights: the rank-level split, as for scatter.
    Raises TypeError/IndexError/ValueError for bad arguments.
    """
    from . import DataParallel, distributed

    n = _rows_of(inputs, dim)
    if size is None:
        size = distributed.size()
    per_rank = _dist.split_sizes(n, size, chunk_sizes, weights)
    devices = [str(d) for d in DataParallel(_identity, device_ids=device_ids).device_ids]
    rule = ("chunk_sizes" if chunk_sizes is not None else "weights" if weights is not None
            else "torch.chunk's rule")
    ranks, devs, start = [], [], 0
    for rows in per_rank:
        ranks.append((start, start + rows))
        local, s = [], start
        for d, k in zip(devices, _dist.split_sizes(rows, len(devices))):
            local.append((d, s, s + k))
            s += k
        devs.append(local)
        start += rows
    return DistPlan(n, dim, ranks, devs, rule)


def _identity(*args):
    return args
