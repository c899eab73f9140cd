"""dpmini.distributed.DistributedDataParallel and reduce_gradients.

DataParallel inside each rank, MPI between ranks: a rank's batch is split over
its local devices by dpmini.DataParallel (torch.chunk's rule, in threads), and
gradients are combined across ranks by reduce_gradients, weighted by the rows
each rank had so that uneven batches give exactly the single-process step.
"""
import contextlib
import hashlib
import pickle
import sys
import weakref

import numpy as np

import dpmini

__all__ = ["DistributedDataParallel", "reduce_gradients"]


def _to_numpy(v):
    """(host ndarray, back): back(arr) turns a NumPy result into v's library
    (torch.Tensor on v's device and dtype, jax.Array, cupy.ndarray); back is
    None for NumPy input (and for anything not recognised, passed unchanged)."""
    if v is None or isinstance(v, (np.ndarray, np.generic)):
        return v, None
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(v, torch.Tensor):
        dev, dt = v.device, v.dtype
        t = v.detach().cpu().resolve_conj().resolve_neg()
        host = t.float().numpy() if dt == torch.bfloat16 else t.numpy()

        def back(a, dev=dev, dt=dt):
            a = np.array(a, copy=True, order="C")
            return torch.from_numpy(a).to(device=dev, dtype=dt)
        return host, back
    jax = sys.modules.get("jax")
    if jax is not None and isinstance(v, jax.Array):
        devs = list(v.devices()) if hasattr(v, "devices") else []

        def back_jax(a, devs=devs):
            import jax.numpy as jnp
            out = jnp.asarray(a)
            return jax.device_put(out, devs[0]) if len(devs) == 1 else out
        return np.asarray(v), back_jax
    cupy = sys.modules.get("cupy")
    if cupy is not None and isinstance(v, cupy.ndarray):
        return v.get(), lambda a: cupy.asarray(a)
    if isinstance(v, dpmini.Array):   # on "cuda:N": an explicit copy each way
        return v.numpy(), lambda a, dev=v.device: dpmini.asarray(np.ascontiguousarray(a), dev)
    return v, None


def _is_array(v):
    if isinstance(v, np.ndarray):
        return True
    return _to_numpy(v)[1] is not None


def _module_arrays(module):
    """The module's arrays by name, as {name: (array, setter)}: a torch.nn.Module's
    state_dict() tensors (parameters and buffers, copied into in place) plus its
    array attributes; else a dict from module.parameters(), else the array
    attributes (vars(module)): NumPy and torch arrays are written in place,
    immutable ones (JAX) replaced via setattr / item assignment."""
    out = {}

    def inplace(v):
        if isinstance(v, np.ndarray):
            return lambda a: np.copyto(v, a)
        torch = sys.modules["torch"]

        def put(a):
            with torch.no_grad():
                v.copy_(torch.from_numpy(np.array(a, copy=True)).to(v.dtype))
        return put

    def add(name, v, holder, key, is_attr):
        torch = sys.modules.get("torch")
        if isinstance(v, np.ndarray) or (torch is not None and isinstance(v, torch.Tensor)):
            out[name] = (v, inplace(v))
        elif _is_array(v):
            back = _to_numpy(v)[1]
            if is_attr:
                out[name] = (v, lambda a: setattr(holder, key, back(a)))
            else:
                out[name] = (v, lambda a: holder.__setitem__(key, back(a)))

    torch = sys.modules.get("torch")
    if torch is not None and isinstance(module, torch.nn.Module):
        for k, v in module.state_dict(keep_vars=True).items():
            add(str(k), v, None, None, False)
    else:
        params = getattr(module, "parameters", None)
        if callable(params):
            got = params()
            if isinstance(got, dict):
                for k, v in got.items():
                    add(str(k), v, got, k, False)
                return out
    try:
        attrs = vars(module)
    except TypeError:
        return out
    for k, v in list(attrs.items()):
        if k not in out:
            add(k, v, module, k, True)
    return out


def _split_rows(args, kwargs, device_ids, dim, in_dims=None, chunk_sizes=None, weights=None):
    """This call's rows: the rows DataParallel splits of the first array leaf that
    is split (in_dims None leaves are broadcast and skipped), from dpmini.explain,
    so that in_dims and chunk_sizes are honoured; None when nothing is split."""
    try:
        plan = dpmini.explain(tuple(args), device_ids, dim, kwargs=kwargs, in_dims=in_dims,
                              chunk_sizes=chunk_sizes, weights=weights)
    except Exception:
        plan = None
    if plan is not None and not plan.error:
        for leaf in plan.leaves:
            if not leaf.get("broadcast") and leaf.get("sizes") is not None:
                return int(sum(leaf["sizes"]))
        return None
    if in_dims is None:
        return _first_rows((args, kwargs), dim)
    return None   # the call itself raises DataParallel's error


def _describe(arrays):
    out = {}
    for k, (v, _) in sorted(arrays.items()):
        dt = v.dtype
        out[k] = (tuple(int(n) for n in v.shape), type(v).__module__.split(".")[0],
                  dt.str if isinstance(dt, np.dtype) else str(dt))
    return out


def broadcast_arrays(arrays, root=0):
    """Copy root's arrays into every rank's (by name; collective). arrays:
    {name: (array, setter)} as _module_arrays gives; each travels as NumPy.

    Every rank's names, shapes, dtypes (and libraries) are first checked against
    root's: a difference raises the same ValueError on every rank, naming the
    ranks that differ and, for each array that differs (the first few), what
    every rank has under that name (shape, dtype, library, or missing).
    """
    from . import distributed as dist

    mine = _describe(arrays)
    roots = dist.broadcast(mine, root=root)
    bad = dist.all_gather(np.array([int(mine != roots)], dtype=np.int64))
    if bad.any():
        ranks = [int(r) for r in np.flatnonzero(bad)]
        every = _gather_objects(dist, mine)
        raise ValueError(f"DistributedDataParallel: the module's arrays on rank(s) {ranks} "
                         f"differ from rank {root}'s (names, shapes or dtypes): "
                         f"{_layout_differences(every)} (every rank raises this)")
    for name in sorted(arrays):
        v, put = arrays[name]
        put(broadcast_host_copy(v, root))


def broadcast_host_copy(v, root=0):
    """Root's value of the array v (collective), as a NumPy array of v's shape,
    0-dim included (np.ascontiguousarray would make a 0-dim array 1-dim)."""
    from . import distributed as dist

    host = np.array(_to_numpy(v)[0], copy=True, order="C")
    return dist.broadcast(host, root=root).reshape(host.shape)


def _gather_objects(dist, obj):
    """Every rank's obj (picklable), in rank order (collective: two all_gathers)."""
    blob = np.frombuffer(pickle.dumps(obj, protocol=4), dtype=np.uint8)
    lens = dist.all_gather(np.array([blob.size], dtype=np.int64))
    allb = dist.all_gather(blob)
    starts = np.concatenate([[0], np.cumsum(lens)])
    return [pickle.loads(allb[starts[r]:starts[r + 1]].tobytes()) for r in range(len(lens))]


def _layout_differences(every, most=4):
    """'name' with each rank's (shape, dtype, library) or 'missing', for the
    first `most` names whose entries differ between the ranks' descriptions."""
    names = sorted(set().union(*every))
    parts = []
    for name in names:
        got = [d.get(name) for d in every]
        if all(g == got[0] for g in got):
            continue
        parts.append(f"{name!r} is " + _by_rank(
            got, lambda g: "missing" if g is None else f"shape {g[0]} dtype {g[2]} ({g[1]})"))
    more = f"; and {len(parts) - most} more" if len(parts) > most else ""
    return "; ".join(parts[:most]) + more


class DistributedDataParallel:
    """DataParallel on this rank's devices, data parallel across MPI ranks.

    module: any callable (as for dpmini.DataParallel). Its arrays (a
        torch.nn.Module's parameters and buffers via state_dict(), a dict from
        module.parameters(), else its NumPy/torch/JAX/CuPy array attributes) are
        broadcast from rank 0 at construction so every rank starts equal: NumPy
        and torch in place, immutable JAX arrays by replacing the attribute.
    device_ids, dim, and any other keyword (output_device, in_dims, out_dims,
        chunk_sizes, weights, strict): passed to dpmini.DataParallel for the
        local devices.
    broadcast_module: False skips the broadcast at construction.
    broadcast_buffers: for a torch.nn.Module with buffers (BatchNorm's running
        statistics), True (torch's DDP name and default) copies rank 0's
        buffers into every rank's before each training forward (the module in
        training mode, grad mode on), so they do not drift apart per rank:
        then every rank must make the same training forwards (a collective).
        False leaves each rank's buffers its own after construction.
    bucket_cap_mb: for a torch.nn.Module with parameters that require grad,
        the size in MiB (float > 0, torch's DDP default 25) of the buckets in
        which gradient hooks all-reduce the gradients during ``loss.backward()``
        (``dpmini/_ddp_torch.py``): each ``param.grad`` then ends the backward
        pass as ``sum_r rows_r * grad_r / sum_r rows_r`` over the ranks (exact for
        uneven batches; torch's DDP divides by the rank count instead, which is
        the same only where every rank has the same rows). The loss must be the
        mean over this rank's rows; call ``optimizer.zero_grad()`` every step.
        The hooks belong to this wrapper: they are removed when it is
        garbage-collected or when a new DistributedDataParallel of the same
        module is made (wrapping the model again each epoch is fine; the older
        wrapper's forward then raises RuntimeError). ``reducer.remove()``
        removes them at once.
        With autograd on and one local device the module runs itself (torch's
        graph intact); several local devices need a DataParallel that keeps
        torch's graph. Only the backward of a forward through the wrapper with
        grad mode on is reduced (that forward arms the hooks, the reduction
        disarms them; other backward passes stay local, as with torch's DDP).
        ``step`` counts the reductions that ran on this rank plus the
        training-mode forwards that no backward followed (each replaced by
        the next forward, its rows forgotten: a skipped step); an eval-mode
        forward without backward counts nothing, so a validation forward
        without torch.no_grad() may run on one rank alone. Each bucket's
        all_reduce carries ``step`` as its tag, so a rank that skipped a
        training step's backward (a NaN loss) meets the others' next step as
        a ValueError on every rank naming the tags and saying what to do, not
        as silently mixed steps.

    Around a torch.nn.Module the wrapper is also an nn.Module (as torch's DDP is)
    whose one child is ``module``: ``parameters()`` for the optimizer,
    ``state_dict()`` with keys ``module.*`` (as torch's DDP saves them),
    ``train()``/``eval()``, ``to()``, ``zero_grad()``, forward hooks; it stays an
    instance of DistributedDataParallel (``dpmini/_ddp_torch.py``, adapter_type).
        ``no_sync()`` accumulates gradients locally over several backward
        passes (see there); only the synchronized backward is a reduction.

    Calling it runs dpmini.DataParallel on this rank's batch (split over the
    local devices, gathered locally) and remembers the batch's rows
    (``last_rows``: the rows split of the first array that in_dims does not
    broadcast, as chunk_sizes splits them) for reduce_gradients, and ``sync_rows``:
    those rows summed over the calls since the last synchronized one (see
    ``no_sync``). Construction is collective (requires
    dpmini.distributed.init()); calls are local.
    """

    def __new__(cls, module=None, *args, **kwargs):
        torch = sys.modules.get("torch")
        if torch is not None and isinstance(module, torch.nn.Module):
            from ._ddp_torch import adapter_type
            cls = adapter_type(cls)
        return object.__new__(cls)

    def __init__(self, module, device_ids=None, dim=0, broadcast_module=True,
                 bucket_cap_mb=25.0, broadcast_buffers=True, **dp_kwargs):
        from . import distributed as dist

        dist._comm()
        if "torch" in sys.modules:
            from ._ddp_torch import begin_module
            begin_module(self)
        self.module = module
        self.dim = dim
        # Not a child module of the nn.Module adapter: state_dict() keys stay module.*.
        object.__setattr__(self, "local", dpmini.DataParallel(module, device_ids=device_ids,
                                                               dim=dim, **dp_kwargs))
        self.last_rows = None
        self.sync_rows = None
        self._step = 0
        self._syncing = True
        self._held_rows = 0   # rows of the calls inside no_sync() since the last synchronized one
        self._split = {k: dp_kwargs.get(k) for k in ("in_dims", "chunk_sizes", "weights")}
        if broadcast_module:
            broadcast_arrays(_module_arrays(module), root=0)
        self.reducer = None
        self.broadcast_buffers = False
        torch = sys.modules.get("torch")
        if torch is not None and isinstance(module, torch.nn.Module):
            from ._ddp_torch import GradientReducer, has_buffers, trains_with_autograd
            self.broadcast_buffers = bool(broadcast_buffers) and has_buffers(module)
            if trains_with_autograd(module):
                self.reducer = GradientReducer(module, bucket_cap_mb)
                weakref.finalize(self, self.reducer.remove)   # the hooks are the wrapper's

    @property
    def step(self):
        """The gradient hooks' step on this rank (0 without hooks): the reductions
        that ran plus the training-mode forwards that no backward followed; the
        tag of the reduction's collectives. Settable (the same value on every rank)."""
        return self.reducer.step if self.reducer is not None else self._step

    @step.setter
    def step(self, value):
        if self.reducer is not None:
            self.reducer.step = int(value)
        else:
            self._step = int(value)

    @property
    def device_ids(self):
        """This rank's devices (from the local DataParallel)."""
        return self.local.device_ids

    @contextlib.contextmanager
    def no_sync(self):
        """Context manager: inside it, backward passes accumulate gradients locally
        (no collective); the first synchronized backward after it reduces the sums.

        As torch's ``DistributedDataParallel.no_sync``: every micro-batch's loss
        is the mean over its own rows, ``param.grad`` adds up over the backward
        passes (do not zero it in between), and the forward call after the
        ``with`` block (outside it) is the synchronized one. Its backward gives
        every rank ``sum_r R_r * G_r / sum_r R_r``, where G_r is rank r's
        accumulated gradient and R_r its rows summed over the micro-batches since
        the last synchronized step (``sync_rows``). Where every rank runs the same
        number m of micro-batches, each of a fixed size on that rank (any size per
        rank, 0 included), this is exactly what one process gets by accumulating m
        micro-batches that are the union of the ranks' j-th ones: each rank's
        gradients count by the rows they were computed on. Micro-batches of
        different sizes on one rank are weighted by their summed rows (as their
        mean-of-means gradient is). Only the synchronized call counts as a
        ``step`` (its tag); ranks may run different numbers of micro-batches.
        Without gradient hooks (not a torch module that trains with autograd),
        ``reduce_gradients()``'s default rows are ``sync_rows`` likewise.
        """
        prev = self._syncing
        self._syncing = False
        try:
            yield self
        finally:
            self._syncing = prev

    def _count_rows(self, rows):
        """last_rows and sync_rows for a training call (outside no_sync the rows
        held since the last synchronized call are added and released)."""
        self.last_rows = rows
        if not self._syncing:
            self._held_rows += rows or 0
            return
        self.sync_rows = None if rows is None else rows + self._held_rows
        self._held_rows = 0

    def __call__(self, *args, **kwargs):
        rows = _split_rows(args, kwargs, self.device_ids, self.dim, **self._split)
        if self._syncing:   # torch's DDP does not sync buffers inside no_sync() either
            self._sync_buffers()
        if self.reducer is None:
            self._count_rows(rows)
            return self.local(*args, **kwargs)
        torch = sys.modules["torch"]
        if not torch.is_grad_enabled():   # evaluation: no backward follows, no step
            self.last_rows = rows
            return self.local(*args, **kwargs)
        self._count_rows(rows)
        if self._syncing:
            self.reducer.prepare(self.sync_rows, training=self.module.training)
        else:
            self.reducer.disarm()
        if len(self.device_ids) == 1:
            return self.module(*args, **kwargs)
        return self.local(*args, **kwargs)

    def _sync_buffers(self):
        """Rank 0's buffers into every rank's before a training forward (torch's
        broadcast_buffers rule; collective)."""
        if not self.broadcast_buffers:
            return
        torch = sys.modules["torch"]
        if torch.is_grad_enabled() and self.module.training:
            from ._ddp_torch import broadcast_buffers
            broadcast_buffers(self.module)

    def reduce_gradients(self, grads, weights="rows", rows=None, *, tag=None):
        """reduce_gradients(grads, weights, rows or self.sync_rows, tag=tag); see
        there (sync_rows: the rows since the last synchronized call, last_rows
        when no_sync() was not used)."""
        return reduce_gradients(grads, weights=weights,
                                rows=self.sync_rows if rows is None else rows, tag=tag)

    def explain(self, inputs, chunk_sizes=None, weights=None):
        """dpmini.distributed.explain for a global batch over the ranks x this
        rank's devices (every rank is assumed to have the same device count)."""
        from . import distributed as dist

        return dist.explain(inputs, device_ids=self.device_ids, dim=self.dim,
                            chunk_sizes=chunk_sizes, weights=weights)


def reduce_gradients(grads, weights="rows", rows=None, *, tag=None):
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
      The mode (rows, sum, mean or a number) must be the same on every rank
      (checked: a mixed mode would silently change the arithmetic).
    rows: this rank's rows (int >= 0), needed for weights="rows".
    tag: None, an int or a str naming this step, the same on every rank (as in
        dpmini.distributed.all_reduce): a rank that skipped or added a step
        makes every rank raise ValueError naming the tags.
    Dict entries are paired across ranks by key, list entries by position. Every
    rank must pass the same keys (or list length) with the same shape and dtype
    under each: else the same ValueError on every rank names the differing keys,
    or each entry that differs (``grads['w']``) with every rank's shape and dtype
    (checked with one small all_gather of a digest; the details are exchanged only
    when the digests differ).
    Every check is collective: a rank whose own arguments are wrong (rows
    missing or negative, an unknown weights, a gradient that is None or not a
    floating/complex array) raises its error
    and every other rank a ValueError quoting it, at the same call, so a caught
    error leaves every rank's next call paired with the same call elsewhere.
    Returns the same container type with new float/complex arrays of the
    same shapes, each in its input's library (torch, JAX, CuPy, else NumPy). Raises TypeError (container or dtypes), ValueError (rows
    missing or negative, weights unknown, ranks that disagree), plus the
    collectives' errors.
    """
    from . import distributed as dist

    keys, arrays, backs, w, error = [], [], [], None, None
    try:
        keys, arrays, backs = _read_grads(grads)
        w = _own_weight(weights, rows)
    except Exception as exc:   # raised at the guard below, on every rank
        error = exc
    mode = ("a number" if not isinstance(weights, str) else repr(weights)) if error is None \
        else "?"
    # The first collective carries this rank's error, the mode and the tag.
    _check_layout(dist, keys, arrays, error=error, tag=tag,
                  context=f"reduce_gradients weights={mode}" if error is None else None)
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
        total = dist.all_reduce(np.concatenate(parts), op="sum", tag=tag)
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
    out = [o if b is None else b(o) for o, b in zip(out, backs)]
    if isinstance(grads, dict):
        got = dict(zip(keys, out))
        return {k: got[k] for k in grads}
    return type(grads)(out) if isinstance(grads, tuple) else out


def _read_grads(grads):
    """(keys or None, host arrays, backs) of a dict or list/tuple of gradients;
    TypeError naming the entry that is no floating or complex array. A torch
    tensor that requires grad is read detached: gradients are data here."""
    if isinstance(grads, dict):
        # Paired by key, not insertion order: a canonical order, the same key set checked.
        keys = sorted(grads, key=repr)
        values = [grads[k] for k in keys]
    elif isinstance(grads, (list, tuple)):
        keys, values = None, list(grads)
    else:
        raise TypeError(f"grads: expected a dict or a list/tuple of arrays, got "
                        f"{type(grads).__name__}")
    arrays, backs = [], []
    for i, v in enumerate(values):
        where = f"grads[{keys[i]!r}]" if keys is not None else f"grads[{i}]"
        if v is None:
            raise TypeError(f"{where}: expected a floating or complex array, got None (a "
                            "parameter without a gradient: pass zeros, or leave it out on "
                            "every rank)")
        a, back = _to_numpy(v)
        backs.append(back)
        a = np.asarray(a)
        if a.dtype.kind not in "fc":
            raise TypeError(f"{where}: expected a floating or complex array, got dtype {a.dtype}")
        arrays.append(a)
    return keys, arrays, backs


def _own_weight(weights, rows):
    """This rank's weight (float), None for "sum"/"mean"; ValueError for bad input."""
    if isinstance(weights, str) and weights in ("sum", "mean"):
        return None
    if isinstance(weights, str) and weights == "rows":
        if rows is None:
            raise ValueError("rows: weights='rows' needs this rank's row count (call the "
                             "DistributedDataParallel first, or pass rows=)")
        if isinstance(rows, bool) or not isinstance(rows, (int, np.integer)) or rows < 0:
            raise ValueError(f"rows: expected an int >= 0, got {rows!r}")
        return float(rows)
    if isinstance(weights, (int, float, np.integer, np.floating)) and not isinstance(weights, bool):
        w = float(weights)
        if not (w >= 0.0 and np.isfinite(w)):
            raise ValueError(f"weights: expected a finite number >= 0, got {weights!r}")
        return w
    raise ValueError(f"weights: expected 'rows', 'sum', 'mean' or a number, got {weights!r}")


def _check_layout(dist, keys, arrays, error=None, tag=None, context=None):
    """Every rank's gradients must have the same keys (dict; keys sorted by repr,
    None for a list) and the same shape and dtype under each (collective).

    Checked on a digest of the layout (one all_gather of one int64); only when the
    digests differ is every rank's layout gathered, to raise the same ValueError on
    every rank naming what differs: the keys, or each entry with every rank's shape
    and dtype (the packed buffer that all_reduce would see says nothing useful).
    The digest's all_gather is the call's guard: it carries this rank's own
    argument error, the tag and the options (context) that every rank must share."""
    names = [repr(k) for k in keys] if keys is not None else list(range(len(arrays)))
    layout = (keys is not None, [(n, tuple(int(d) for d in a.shape), a.dtype.str, str(a.dtype))
                                 for n, a in zip(names, arrays)])
    blob = pickle.dumps(layout, protocol=4)
    digest = np.frombuffer(hashlib.blake2b(blob, digest_size=8).digest(), dtype="<i8")
    got = dist._comm().all_gather(digest, 0, None, tag=tag, error=error, context=context)
    if (got == digest[0]).all():
        return
    full = _gather_objects(dist, layout)
    if any(f[0] != full[0][0] for f in full):
        raise ValueError("reduce_gradients: grads is " + _by_rank(
            [f[0] for f in full], lambda d: "a dict" if d else "a list/tuple")
            + " (every rank raises this)")
    per = [f[1] for f in full]
    P = len(per)
    entries = [dict((n, (shape, dt, name)) for n, shape, dt, name in p) for p in per]
    if keys is not None and any(set(e) != set(entries[0]) for e in entries):
        union = sorted(set().union(*entries))
        diff = {k: [r for r in range(P) if k not in entries[r]] for k in union}
        diff = {k: v for k, v in diff.items() if v}
        raise ValueError("reduce_gradients: the ranks' gradient dicts have different keys: "
                         + "; ".join(f"{k} missing on rank(s) {v}" for k, v in diff.items()))
    if keys is None and any(len(p) != len(per[0]) for p in per):
        raise ValueError("reduce_gradients: the ranks pass different numbers of gradients: "
                         + _by_rank([len(p) for p in per], str)
                         + " (every rank raises this)")
    parts = []
    for n, *_ in per[0]:
        got = [e[n] for e in entries]
        if any(g != got[0] for g in got):
            parts.append(f"grads[{n}] has " + _by_rank(
                got, lambda g: f"shape {g[0]} dtype {g[2]}"))
    raise ValueError("reduce_gradients: the ranks' gradients differ in shape or dtype: "
                     + "; ".join(parts) + " (every rank raises this; the communicator "
                     "stays usable)")


def _by_rank(values, text):
    """'A on rank(s) [0, 2], B on rank(s) [1]': each distinct value with its ranks."""
    groups = {}
    for r, v in enumerate(values):
        groups.setdefault(v, []).append(r)
    return ", ".join(f"{text(v)} on rank(s) {rs}" for v, rs in groups.items())
