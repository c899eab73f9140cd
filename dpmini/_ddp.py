"""dpmini.distributed.DistributedDataParallel and reduce_gradients.

DataParallel inside each rank, MPI between ranks: a rank's batch is split over
its local devices by dpmini.DataParallel (torch.chunk's rule, in threads), and
gradients are combined across ranks by reduce_gradients, weighted by the rows
each rank had so that uneven batches give exactly the single-process step.
"""
import numpy as np

import dpmini

__all__ = ["DistributedDataParallel", "reduce_gradients"]


def _module_arrays(module):
    """The module's arrays by name: module.parameters() when it returns a
    mapping, else its ndarray attributes (vars(module))."""
    params = getattr(module, "parameters", None)
    if callable(params):
        got = params()
        if isinstance(got, dict):
            return {str(k): v for k, v in got.items() if isinstance(v, np.ndarray)}
    try:
        attrs = vars(module)
    except TypeError:
        return {}
    return {k: v for k, v in attrs.items() if isinstance(v, np.ndarray)}


def _first_rows(obj, dim):
    """shape[dim] of the first array with a dim in args/kwargs, or None."""
    stack = [obj]
    while stack:
        x = stack.pop(0)
        if isinstance(x, dict):
            stack.extend(x.values())
        elif isinstance(x, (list, tuple)):
            stack.extend(x)
        elif hasattr(x, "shape") and len(x.shape) > 0 and -len(x.shape) <= dim < len(x.shape):
            return int(x.shape[dim])
    return None


def _describe(arrays):
    return {k: (tuple(v.shape), v.dtype.str) for k, v in sorted(arrays.items())}


def broadcast_arrays(arrays, root=0):
    """Copy root's arrays into every rank's (in place, by name; collective).

    Every rank's names, shapes and dtypes are first checked against root's: a
    difference raises the same ValueError on every rank, naming the ranks.
    """
    from . import distributed as dist

    mine = _describe(arrays)
    roots = dist.broadcast(mine, root=root)
    bad = dist.all_gather(np.array([int(mine != roots)], dtype=np.int64))
    if bad.any():
        ranks = [int(r) for r in np.flatnonzero(bad)]
        raise ValueError(f"DistributedDataParallel: the module's arrays on rank(s) {ranks} "
                         f"differ from rank {root}'s (names, shapes or dtypes); rank {root} "
                         f"has {roots}")
    for name in sorted(arrays):
        got = dist.broadcast(arrays[name], root=root)
        np.copyto(arrays[name], got)


class DistributedDataParallel:
    """DataParallel on this rank's devices, data parallel across MPI ranks.

    module: any callable (as for dpmini.DataParallel). Its arrays (a dict from
        module.parameters(), else its ndarray attributes) are broadcast from
        rank 0 at construction, in place, so every rank starts equal.
    device_ids, dim, and any other keyword (output_device, in_dims, out_dims,
        chunk_sizes, weights, strict): passed to dpmini.DataParallel for the
        local devices.
    broadcast_module: False skips the broadcast at construction.

    Calling it runs dpmini.DataParallel on this rank's batch (split over the
    local devices, gathered locally) and remembers the batch's rows along dim
    (``last_rows``) for reduce_gradients. Construction is collective
    (requires dpmini.distributed.init()); calls are local.
    """

    def __init__(self, module, device_ids=None, dim=0, broadcast_module=True, **dp_kwargs):
        from . import distributed as dist

        dist._comm()
        self.module = module
        self.dim = dim
        self.local = dpmini.DataParallel(module, device_ids=device_ids, dim=dim, **dp_kwargs)
        self.last_rows = None
        if broadcast_module:
            broadcast_arrays(_module_arrays(module), root=0)

    @property
    def device_ids(self):
        """This rank's devices (from the local DataParallel)."""
        return self.local.device_ids

    def __call__(self, *args, **kwargs):
        self.last_rows = _first_rows((args, kwargs), self.dim)
        return self.local(*args, **kwargs)

    def reduce_gradients(self, grads, weights="rows", rows=None):
        """reduce_gradients(grads, weights, rows or self.last_rows); see there."""
        return reduce_gradients(grads, weights=weights,
                                rows=self.last_rows if rows is None else rows)

    def explain(self, inputs, chunk_sizes=None, weights=None):
        """dpmini.distributed.explain for a global batch over the ranks x this
        rank's devices (every rank is assumed to have the same device count)."""
        from . import distributed as dist

        return dist.explain(inputs, device_ids=self.device_ids, dim=self.dim,
                            chunk_sizes=chunk_sizes, weights=weights)


def reduce_gradients(grads, weights="rows", rows=None):
    """All-reduce a dict or list/tuple of gradient arrays across the ranks (collective).

    weights:
      "rows" (default): each rank's grads are MEANS over its `rows` rows; the
          result is the mean over every rank's rows, sum_r rows_r * g_r /
          sum_r rows_r, which is the single-process mean gradient over the
          global batch whatever the split (a rank with 0 rows contributes
          nothing, even if its grads are NaN).
      "sum": grads are sums; the result is their sum over the ranks.
      "mean": the plain mean over ranks (Horovod's allreduce average).
      a number: this rank's weight (weighted mean with the others' weights).
    rows: this rank's rows (int >= 0), needed for weights="rows".
    Returns the same container type with new float/complex arrays of the
    same shapes. Raises TypeError (container or dtypes), ValueError (rows
    missing or negative, weights unknown), plus the collectives' errors.
    """
    from . import distributed as dist

    if isinstance(grads, dict):
        keys, values = list(grads.keys()), list(grads.values())
    elif isinstance(grads, (list, tuple)):
        keys, values = None, list(grads)
    else:
        raise TypeError(f"grads: expected a dict or a list/tuple of arrays, got "
                        f"{type(grads).__name__}")
    arrays = []
    for i, v in enumerate(values):
        a = np.asarray(v)
        if a.dtype.kind not in "fc":
            where = f"grads[{keys[i]!r}]" if keys is not None else f"grads[{i}]"
            raise TypeError(f"{where}: expected a floating or complex array, got dtype {a.dtype}")
        arrays.append(a)
    if isinstance(weights, str) and weights in ("sum", "mean"):
        w = None
    elif isinstance(weights, str) and weights == "rows":
        if rows is None:
            raise ValueError("rows: weights='rows' needs this rank's row count (call the "
                             "DistributedDataParallel first, or pass rows=)")
        if isinstance(rows, bool) or not isinstance(rows, (int, np.integer)) or rows < 0:
            raise ValueError(f"rows: expected an int >= 0, got {rows!r}")
        w = float(rows)
    elif isinstance(weights, (int, float, np.integer, np.floating)) and not isinstance(weights, bool):
        w = float(weights)
        if not (w >= 0.0 and np.isfinite(w)):
            raise ValueError(f"weights: expected a finite number >= 0, got {weights!r}")
    else:
        raise ValueError(f"weights: expected 'rows', 'sum', 'mean' or a number, got {weights!r}")

    # One all_reduce per dtype: the flattened arrays, then the weight.
    out = [None] * len(arrays)
    by_dtype = {}
    for i, a in enumerate(arrays):
        by_dtype.setdefault(a.dtype.str, []).append(i)
    for dt in sorted(by_dtype):
        idx = by_dtype[dt]
        parts = []
        for i in idx:
            a = arrays[i].ravel()
            if w is None:
                parts.append(a)
            elif w == 0.0:
                parts.append(np.zeros_like(a))
            else:
                parts.append(a * w)
        parts.append(np.array([1.0 if w is None else w], dtype=dt))
        total = dist.all_reduce(np.concatenate(parts), op="sum")
        denom = total[-1]
        if weights == "sum":
            denom = 1.0
        elif w is not None and denom == 0:
            raise ValueError("reduce_gradients: the weights of every rank add up to 0 "
                             "(no rank had rows)")
        start = 0
        for i in idx:
            k = arrays[i].size
            out[i] = (total[start:start + k] / denom).reshape(arrays[i].shape)
            start += k
    if keys is not None:
        return dict(zip(keys, out))
    return type(grads)(out) if isinstance(grads, tuple) else out
