"""Gradient hooks of dpmini.distributed.DistributedDataParallel for torch modules.

During ``loss.backward()`` each parameter's gradient, once accumulated
(``Tensor.register_post_accumulate_grad_hook``), is copied into its bucket;
a full bucket is all-reduced by a background thread while autograd goes on
computing the other gradients (torch's DDP overlaps the same way). At the end
of the backward pass (a callback queued on autograd's engine, as torch's DDP
does) every bucket has been reduced and each ``param.grad`` holds the result.

Which backward passes are reduced (torch's DDP rule): only the one that follows
a forward through the wrapper with grad mode on. That forward arms the hooks
(``prepare``); the reduction at the end of the pass disarms them. Any other
backward pass (through the unwrapped module, a second backward of the same
graph, one before the first forward through the wrapper) finds them disarmed
and leaves its gradients accumulated locally, untouched, as plain torch does.

Weighting (exact for uneven batches): this rank's gradients are taken as the
mean over its ``rows`` rows (a loss that is a mean over the local batch, as in
torch's DDP); every bucket carries ``rows * grad`` and ``rows``, so the result
is ``sum_r rows_r * grad_r / sum_r rows_r``: the single-process mean gradient
over the global batch whatever the split. torch's DDP divides by the number of
ranks instead (equal where every rank has the same rows). A rank with 0 rows
adds zeros (its NaN mean is dropped).

Buckets: parameters in reverse registration order (roughly the order autograd
produces their gradients), split by dtype and into buckets of at most
``bucket_cap_mb`` MiB; buckets are reduced strictly in order on every rank so
that the collectives pair. A parameter with no gradient in a step (unused)
counts as zeros, and gets the reduced gradient like the others, so every rank
ends the step with equal gradients.

Accumulation (``DistributedDataParallel.no_sync``): a forward inside it does
not arm the hooks, so its backward stays local and ``param.grad`` adds up as
in plain torch; the next synchronized forward's ``prepare(rows)`` passes the
rows summed over those micro-batches, and its backward reduces the
accumulated gradients (a parameter whose hook does not fire then contributes
its accumulated ``param.grad``, zeros when it has none).

Dtypes: float16 and bfloat16 gradients travel in float32 buckets (MPI has no
16-bit float) and are rounded to the parameter's dtype once, when written
back. Sparse gradients (``nn.Embedding(sparse=True)``, ``nn.EmbeddingBag``)
are made dense for the reduction (a dense buffer of the parameter's size) and
given back sparse: the reduced gradient as a coalesced sparse tensor, whose
``to_dense()`` is torch's DDP result where every rank has the same rows.

Whose hooks (one set per module): the hooks belong to the wrapper that made
them. They are removed when that wrapper is garbage-collected (a
``weakref.finalize`` on it) or when a new wrapper of the same module is made
(the new one's replace them, so re-wrapping a model every epoch works);
a forward through the older wrapper then raises RuntimeError.
"""
import inspect
import queue
import threading
import weakref

import numpy as np


# module -> the GradientReducer whose hooks it carries now.
_HOOKED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


# DistributedDataParallel class -> its nn.Module adapter class.
_ADAPTERS: dict = {}


def adapter_type(cls):
    """The class of a DistributedDataParallel (class cls) around a torch.nn.Module:
    cls itself when it already is an nn.Module, else a class made once per cls
    with bases (cls, nn.Module), so that the wrapper is an nn.Module whose one
    child is ``module`` (parameters(), state_dict() with keys "module.*",
    train()/eval(), to(), zero_grad(), hooks), as torch's DDP is, and still an
    instance of cls. Its call is nn.Module's (hooks), its forward cls's call."""
    import torch

    nn = torch.nn
    if issubclass(cls, nn.Module):
        return cls
    made = _ADAPTERS.get(cls)
    if made is None:
        made = type(cls.__name__, (cls, nn.Module),
                    {"__module__": cls.__module__, "__qualname__": cls.__qualname__,
                     "__doc__": cls.__doc__, "__call__": nn.Module.__call__,
                     "forward": cls.__call__, "__repr__": nn.Module.__repr__})
        _ADAPTERS[cls] = made
    return made


def begin_module(wrapper):
    """Set up nn.Module's state on an adapter object (before any attribute)."""
    import torch

    if isinstance(wrapper, torch.nn.Module):
        torch.nn.Module.__init__(wrapper)


def has_buffers(module):
    """Whether the torch.nn.Module has buffers (BatchNorm's running statistics...)."""
    return any(True for _ in module.buffers())


def broadcast_buffers(module, root=0):
    """Copy root's buffers into every rank's module, in place (collective; by
    name, in sorted order, so that the broadcasts pair). torch's DDP does this
    before every forward with grad mode on (broadcast_buffers=True), so that
    BatchNorm's running statistics stay rank 0's rather than drift per rank."""
    import torch

    from ._ddp import broadcast_host_copy
    from . import distributed as dist

    mine = dist.rank() == root
    for _, buf in sorted(module.named_buffers(), key=lambda kv: kv[0]):
        got = broadcast_host_copy(buf, root)
        if not mine:
            with torch.no_grad():
                buf.copy_(torch.from_numpy(got).to(device=buf.device, dtype=buf.dtype))


def trains_with_autograd(module):
    """Whether the torch.nn.Module has a parameter that requires grad."""
    return any(p.requires_grad for p in module.parameters())


def _tag_keyword(all_reduce):
    """The one place the step's tag reaches the collective: {'tag': ...} when
    dpmini.distributed.all_reduce takes tag= (a skipped step is then an error on
    every rank naming the tags), else nothing."""
    try:
        takes = "tag" in inspect.signature(all_reduce).parameters
    except (TypeError, ValueError):
        takes = False
    return (lambda tag: {"tag": tag}) if takes else (lambda tag: {})


def _explained(error):
    """A reduction's error; the guard's tag mismatch (the ranks were at
    different steps) gets what to do appended, the original as __cause__."""
    if not (isinstance(error, ValueError) and "tag=" in str(error)):
        return error
    out = ValueError(
        f"{error} -- DistributedDataParallel: the ranks are at different steps: a rank "
        "skipped the backward of a training-mode forward through the wrapper that the other "
        "ranks ran (e.g. it skipped a NaN loss alone). Every rank must skip a step together: "
        "all_reduce a flag ('my loss is finite', op='min') before backward() and skip on "
        "every rank when it is 0 (docs/distributed.md). The ranks raised this at different "
        "iterations of their training loops, now one backward apart: end the job and "
        "restart from a checkpoint")
    out.__cause__ = error
    return out


def _sparse_parameters(module):
    """ids of the parameters whose gradients torch makes sparse: the weights of
    nn.Embedding / nn.EmbeddingBag built with sparse=True."""
    import torch
    out = set()
    for m in module.modules():
        if isinstance(m, (torch.nn.Embedding, torch.nn.EmbeddingBag)) and m.sparse:
            out.add(id(m.weight))
    return out


class _Bucket:
    """Parameters of one dtype reduced together; flat holds rows * grad of each
    and, last, this rank's rows."""

    def __init__(self, index, params, np_dtype):
        self.index = index
        self.params = params
        self.sizes = [p.numel() for p in params]
        self.offsets = np.concatenate([[0], np.cumsum(self.sizes)]).astype(int)
        self.flat = np.zeros(int(self.offsets[-1]) + 1, dtype=np_dtype)
        self.pending = set()
        self.result = None
        self.error = None


# How long remove() waits for the reducing thread to finish its bucket in flight.
_JOIN_S = 10.0


class GradientReducer:
    """Installs the hooks on `module`'s parameters that require grad.

    module: a torch.nn.Module (its parameters already equal on every rank).
    bucket_cap_mb: bucket size in MiB (float > 0; torch's DDP default is 25).
    ``prepare(rows, training)`` arms the hooks for the next backward pass (the
    wrapper's forward does it); without it a backward pass is not reduced.
    ``step`` is the tag of the reduction's collectives: it counts the
    reductions that ran on this rank, plus the training-mode forwards that no
    backward followed (replaced by the next forward: a skipped step). An
    eval-mode forward without backward (a validation forward without
    torch.no_grad()) counts nothing, so it may run on one rank alone; a rank
    that skipped a training step's backward the others ran is a ValueError on
    every rank at its next reduction (it says what to do).
    """

    def __init__(self, module, bucket_cap_mb=25.0):
        import torch

        from . import distributed as dist

        if isinstance(bucket_cap_mb, bool) or not isinstance(bucket_cap_mb, (int, float)) \
                or not bucket_cap_mb > 0:
            raise ValueError(f"bucket_cap_mb: expected a number of MiB > 0, got {bucket_cap_mb!r}")
        self._torch = torch
        self._all_reduce = dist.all_reduce
        self._tag = _tag_keyword(dist.all_reduce)
        params = [p for p in module.parameters() if p.requires_grad]
        self._sparse = _sparse_parameters(module)
        self._params = params
        self._cap_bytes = bucket_cap_mb * 2 ** 20
        self._plan_buckets()
        self._take_over(module)
        self._handles = [p.register_post_accumulate_grad_hook(self._on_grad) for p in params]
        self.rows = None
        self.step = 0
        self._ready = False     # armed by a forward through the wrapper
        self._ready_training = False   # that forward was in training mode
        self._in_pass = False   # a reduced backward pass is under way
        self._accumulated = False   # a local (unreduced) backward ran since the last reduction
        self._queue = queue.Queue()
        self._thread = None

    def _plan_buckets(self):
        """Buckets for the parameters' dtypes now (again after module.to(dtype))."""
        self._dtypes = tuple(p.dtype for p in self._params)
        self.buckets = self._make_buckets(self._params, self._cap_bytes)
        self._where = {}
        for b in self.buckets:
            for i, p in enumerate(b.params):
                self._where[id(p)] = (b, i)

    def _make_buckets(self, params, cap_bytes):
        by_dtype = {}
        for p in reversed(params):
            by_dtype.setdefault(p.dtype, []).append(p)
        buckets = []
        for dtype, ps in by_dtype.items():
            np_dtype = self._bucket_dtype(dtype)
            cur, size = [], 0
            for p in ps:
                nbytes = p.numel() * np_dtype.itemsize
                if cur and size + nbytes > cap_bytes:
                    buckets.append(_Bucket(len(buckets), cur, np_dtype))
                    cur, size = [], 0
                cur.append(p)
                size += nbytes
            if cur:
                buckets.append(_Bucket(len(buckets), cur, np_dtype))
        return buckets

    def _bucket_dtype(self, dtype):
        """The NumPy dtype a torch dtype's gradients are reduced in: float32 for
        float16 and bfloat16 (rounded back once), else the dtype itself."""
        torch = self._torch
        if dtype in (torch.float16, torch.bfloat16):
            return np.dtype(np.float32)
        return torch.empty(0, dtype=dtype).numpy().dtype

    def prepare(self, rows, training=True):
        """Arm the hooks for the next backward pass with this rank's rows (int >= 0);
        training: the module's mode in this forward. A forward that no backward
        followed is replaced by this one (its rows forgotten); if it was in
        training mode its step counts as skipped."""
        if self._ready and self._ready_training:
            self.step += 1
        if self._removed:
            raise RuntimeError("DistributedDataParallel: this wrapper's gradient hooks were "
                               "removed, as a newer DistributedDataParallel wraps the same "
                               "module (one set of hooks per module): call the newer one")
        if self._dtypes != tuple(p.dtype for p in self._params):
            self._plan_buckets()
        self.rows = rows
        self._ready = True
        self._ready_training = bool(training)

    def disarm(self):
        """A forward inside no_sync(): the backward that follows stays local.
        A forward that was armed and never reduced is forgotten here as it
        would be by the next prepare() (a training one counts as a skipped
        step), so every rank counts it once, whichever forward comes next."""
        if self._ready and self._ready_training:
            self.step += 1
        self._ready = False

    def _take_over(self, module):
        """The module's hooks are this reducer's from now on: an older reducer's
        are removed (one set of hooks per module)."""
        self._removed = False
        older = _HOOKED.get(module)
        if older is not None:
            older.remove()
        _HOOKED[module] = self

    def remove(self):
        """Take the hooks off the parameters and end the reducing thread (the
        wrapper's finalizer, or a newer wrapper of the module, calls it). A later
        prepare() raises RuntimeError; calling it twice is harmless."""
        for h in self._handles:
            h.remove()
        self._handles = []
        self._removed = True
        self._ready = False
        thread, self._thread = self._thread, None
        if thread is not None:
            self._queue.put(None)
            # Joined, not left to run: at interpreter exit (the wrapper's
            # finalizer runs from atexit) a daemon thread that still drops a
            # tensor while Python finalizes is ended inside torch's C++
            # (pthread_exit through its frames), which aborts the process.
            # Its bucket in flight is bounded by the communicator's timeout.
            if thread is not threading.current_thread():
                thread.join(timeout=_JOIN_S)

    # ---------------------------------------------------------------- backward
    def _start_pass(self):
        """At the first gradient of a backward pass: reset the buckets, queue
        the end-of-pass callback, start the reducing thread if needed."""
        self._in_pass = True
        self._next = 0
        for b in self.buckets:
            b.pending = set(range(len(b.params)))
            b.result = b.error = None
            b.flat[-1] = float(self.rows)
        self._done = queue.Queue()
        self._pass_error = None
        if self._thread is None or not self._thread.is_alive():
            self._thread = threading.Thread(target=self._reduce_loop, daemon=True,
                                            name="dpmini-ddp-reduce")
            self._thread.start()
        self._torch.autograd.Variable._execution_engine.queue_callback(self._finish_pass)

    def _on_grad(self, p):
        if not self._in_pass:
            if not self._ready:   # not the backward of a forward through the wrapper
                self._accumulated = True   # param.grad adds up locally (no_sync)
                return
            self._start_pass()
        b, i = self._where[id(p)]
        self._fill(b, i, p.grad)
        b.pending.discard(i)
        self._launch_ready()

    def _fill(self, b, i, grad):
        view = b.flat[b.offsets[i]:b.offsets[i + 1]]
        w = float(self.rows)
        if grad is None or w == 0.0:
            view[...] = 0
            return
        g = grad.detach()
        if g.is_sparse:
            g = g.to_dense()
        if g.device.type != "cpu":
            g = g.cpu()
        g = g.reshape(-1)
        if g.dtype != self._torch.float32 and view.dtype == np.float32:
            g = g.float()   # float16 / bfloat16 in a float32 bucket
        np.multiply(g.numpy(), w, out=view)

    def _launch_ready(self):
        """Queue buckets in order while the next one has every gradient."""
        while self._next < len(self.buckets) and not self.buckets[self._next].pending:
            self._queue.put((self.buckets[self._next], self.step))
            self._next += 1

    def _reduce_loop(self):
        """The reducing thread: buckets in order. After a bucket's error (the same
        on every rank) the pass's later buckets are not sent, on any rank, so the
        next pass pairs again (and a timeout is waited for once, not per bucket)."""
        while True:
            item = self._queue.get()
            if item is None:   # remove(): the hooks are gone
                return
            b, step = item
            if self._pass_error is not None:
                b.error = self._pass_error
            else:
                try:
                    b.result = self._all_reduce(
                        b.flat, op="sum", **self._tag(f"ddp step {step} bucket {b.index}"))
                except BaseException as exc:   # raised on the backward's thread at the end
                    b.error = self._pass_error = exc
            self._done.put(b)

    def _finish_pass(self):
        """End of backward: unused parameters count as zeros, every bucket is
        waited for, then each param.grad gets sum_r rows_r g_r / sum_r rows_r.
        The reduction disarms the hooks, whatever its outcome."""
        self._in_pass = False
        self._ready = False
        accumulated, self._accumulated = self._accumulated, False
        for b in self.buckets:
            for i in sorted(b.pending):
                self._fill(b, i, b.params[i].grad if accumulated else None)
            b.pending.clear()
        self._launch_ready()
        for _ in self.buckets:
            self._done.get()
        if self._pass_error is not None:
            raise _explained(self._pass_error)
        for b in self.buckets:
            self._write_back(b)
        self.step += 1

    def _write_back(self, b):
        torch = self._torch
        total = float(b.result[-1])
        if total == 0.0:
            raise ValueError("DistributedDataParallel: no rank had rows in this step (the "
                             "rows of every rank add up to 0), so there is no mean gradient")
        for i, p in enumerate(b.params):
            src = torch.from_numpy(b.result[b.offsets[i]:b.offsets[i + 1]]).view(p.shape)
            g = p.grad
            if id(p) in self._sparse:   # given back sparse, as it came
                dense = (src / total).to(device=p.device, dtype=p.dtype)
                p.grad = dense.to_sparse(1)
                continue
            if g is not None and g.device.type == "cpu" and g.dtype == src.dtype \
                    and g.is_contiguous():
                torch.div(src, total, out=g)   # in place, one pass
            elif g is not None:
                g.copy_(src / total)
            else:
                p.grad = (src / total).to(device=p.device, dtype=p.dtype)
