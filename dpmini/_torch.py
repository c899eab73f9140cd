"""dpmini._torch: what is specific to PyTorch, in one module.

Imported only when a torch module or a tensor that requires grad reaches dpmini (the C
entry points import it then; ``import dpmini`` never imports torch). It holds:

- the autograd Functions around dpmini's C copies (docs/spec.md 7): a scatter's backward
  gathers the gradient back onto the input's device, a gather's backward scatters it
  with the replicas' sizes, a broadcast's backward sums the copies' gradients onto the
  source (PyTorch's ReduceAddCoalesced), a reduce_add's backward hands the gradient to
  every input. The copies themselves are always dpmini's C functions, called on detached
  tensors under ``torch.no_grad()``; the Functions only record the graph.
- the differentiable forms of ``scatter``, ``scatter_kwargs``, ``gather``,
  ``data_parallel`` and the ``comm`` functions, which the C entry points call when they
  meet a tensor that requires grad with grad mode on (``_RequiresGradError``).
- ``replicate``: PyTorch's replicate rules for a ``torch.nn.Module`` (docs/spec.md 5).
- the ``torch.nn.Module`` adapter: ``dpmini.DataParallel(torch_module)`` is made of
  ``adapter_type(dpmini.DataParallel)``, a subclass of the C type that is also an
  ``nn.Module`` whose one child is ``module`` (docs/spec.md 1.8).
- the replica context (registered with ``register_replica_context`` when this module
  is imported): torch's per-thread state (grad and inference mode, autocast, current
  streams, intra-op threads) carried into each replica's thread, and the rule that
  makes random numbers in replicas on virtual CPU devices reproducible.

Under ``torch.no_grad()`` none of this runs per call except the replicate rules: the C
paths are used as they are.
"""
from __future__ import annotations

import copy
import dataclasses
import functools
import numbers
import os
import threading
from collections import OrderedDict
from typing import Any, Callable, Sequence, cast

import torch
import torch.nn.functional as _F
from torch import nn
from torch.overrides import TorchFunctionMode as _TorchFunctionMode
from torch.overrides import _get_current_function_mode as _current_function_mode

from . import _blas, _dpmini
from ._dpmini import register_replica_context

_DP = _dpmini.DataParallel
_comm = _dpmini.comm

# ---------------------------------------------------------------------------
# Devices
# ---------------------------------------------------------------------------


def _device_arg(t: torch.Tensor) -> str:
    """The dpmini device of a tensor's memory: "cpu" (the host) or "cuda:N"."""
    if t.is_cpu:
        return "cpu"
    return f"{t.device.type}:{t.get_device()}"


def _on_host(tensors: Any) -> bool:
    return all(t.device.type == "cpu" for t in tensors)


def _is_virtual_cpu(device: Any) -> bool:
    return str(device).startswith("cpu:")


# ---------------------------------------------------------------------------
# Autograd Functions (docs/spec.md 7)
# ---------------------------------------------------------------------------


def _resolved(g: Any) -> Any:
    """g with a conjugate or negative bit applied (a new tensor then; None stays
    None). Gradients autograd makes may carry those lazy bits (the backward of
    x.conj() is a conj view), which dpmini's DLPack import refuses (docs/libraries.md);
    torch's own comm functions accept them."""
    if g is not None and (g.is_conj() or g.is_neg()):
        return g.resolve_conj().resolve_neg()
    return g


def _zeros_for(like: list[tuple[Any, ...]], grads: tuple[Any, ...]) -> list[torch.Tensor]:
    """The gradients of the pieces, a zero tensor where a piece got none (like: each
    piece's (shape, dtype, device))."""
    return [g if g is not None else torch.zeros(shape, dtype=dtype, device=device)
            for (shape, dtype, device), g in zip(like, grads)]


class _Scatter(torch.autograd.Function):
    """Pieces of one tensor on the replicas' devices (made by dpmini's C scatter or
    broadcast before apply, passed in a list so autograd does not track them).

    dim: the split dimension, or None when every piece is a whole copy. Backward
    (PyTorch's Scatter.backward = Gather): the pieces' gradients concatenated along dim
    onto the source's device (rows a split dropped get zeros), or summed for copies.
    """

    @staticmethod
    def forward(ctx: Any, src: torch.Tensor, pieces: list[torch.Tensor], dim: int | None):
        ctx.dim = dim
        ctx.dest = _device_arg(src)
        ctx.src_shape = src.shape
        ctx.like = [(p.shape, p.dtype, p.device) for p in pieces]
        return tuple(pieces)

    @staticmethod
    def backward(ctx: Any, *grads: Any):
        grads = tuple(_resolved(g) for g in grads)
        if all(g is None for g in grads):
            return None, None, None
        if ctx.dim is None:
            present = [g for g in grads if g is not None]
            return _sum_grads(present, ctx.dest), None, None
        full = _zeros_for(ctx.like, grads)
        missing = ctx.src_shape[ctx.dim] - sum(g.shape[ctx.dim] for g in full)
        if missing > 0:
            shape = list(ctx.src_shape)
            shape[ctx.dim] = missing
            full.append(full[0].new_zeros(shape))
        return _comm.gather(full, dim=ctx.dim, destination=ctx.dest), None, None


class _Gather(torch.autograd.Function):
    """The gathered tensor (made by dpmini's C gather before apply, in a list) as a
    function of the replicas' outputs.

    rule: ("dim", d) concatenated along d; ("scalar",) 0-dim outputs made a vector;
    ("first",) replica 0's value (out_dims None); ("sum",) their sum. Backward (PyTorch's
    Gather.backward = Scatter): the gradient split with the replicas' sizes and sent to
    each replica's device; g[i] for scalars; all of it to replica 0; all of it to each.
    """

    @staticmethod
    def forward(ctx: Any, result: list[torch.Tensor], rule: tuple[Any, ...], *outs: torch.Tensor):
        ctx.rule = rule
        ctx.sizes = [o.shape[rule[1]] for o in outs] if rule[0] == "dim" else None
        ctx.devices = [_device_arg(o) for o in outs]
        return result[0]

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor):
        g = _resolved(g)
        kind, k = ctx.rule[0], len(ctx.devices)
        if kind == "first":
            grads: list[Any] = [g] + [None] * (k - 1)
        elif kind == "sum":
            grads = _fan_out(g, ctx.devices)
        elif kind == "scalar":
            grads = [g[i] for i in range(k)]
        elif all(d == "cpu" for d in ctx.devices):
            grads = list(g.split(ctx.sizes, ctx.rule[1]))   # views, no copy
        else:
            grads = list(_comm.scatter(g.contiguous(), devices=ctx.devices,
                                       chunk_sizes=ctx.sizes, dim=ctx.rule[1]))
        return (None, None, *grads)


def _fan_out(g: torch.Tensor, devices: list[str]) -> list[torch.Tensor]:
    """g on each of devices: the tensor itself on the host, dpmini's broadcast else."""
    if all(d == "cpu" for d in devices):
        return [g] * len(devices)
    copies = _comm.broadcast(g, devices=[d for d in devices if d != "cpu"])
    it = iter(copies)
    return [g if d == "cpu" else next(it) for d in devices]


class _ReduceAdd(torch.autograd.Function):
    """dpmini's reduce_add result (in a list) as a function of its inputs; backward
    hands the gradient to every input (on its device)."""

    @staticmethod
    def forward(ctx: Any, result: list[torch.Tensor], *inputs: torch.Tensor):
        ctx.devices = [_device_arg(t) for t in inputs]
        return result[0]

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor):
        return (None, *_fan_out(_resolved(g), ctx.devices))


class _Broadcast(torch.autograd.Function):
    """Parameters on every replica's device (docs/spec.md 5.2, 7.3): devices[0]'s are the
    parameters' own memory (docs/spec.md 5.6), the others dpmini's C copies
    (broadcast_coalesced). Outputs are device-major (all of devices[0], then
    devices[1], ...). Backward (ReduceAddCoalesced): each parameter's gradients from
    all replicas summed onto the parameter's device; the sum accumulates into .grad."""

    @staticmethod
    def forward(ctx: Any, devices: list[Any], *params: torch.Tensor):
        ctx.n = len(params)
        ctx.dests = [_device_arg(p) for p in params]
        detached = [p.detach() for p in params]
        copies = _copies(detached, devices)
        ctx.mark_non_differentiable(*[c for row in copies for c, p in zip(row, params)
                                      if not p.requires_grad])
        return tuple(c for row in copies for c in row)

    @staticmethod
    def backward(ctx: Any, *grads: Any):
        n = ctx.n
        grads = tuple(_resolved(g) for g in grads)
        per_param = [[grads[d * n + i] for d in range(len(grads) // n)] for i in range(n)]
        return (None, *_sum_param_grads(per_param, ctx.dests))


def _sum_param_grads(per_param: list[list[Any]], dests: list[str]) -> list[Any]:
    """Each parameter's gradients (per_param[i]: one per replica, None where a
    replica gave none) summed onto its device dests[i]; None where no replica gave
    one. Parameters whose replicas all gave dense gradients are summed in one
    dpmini reduce_add_coalesced call per destination (torch's ReduceAddCoalesced),
    the others one by one (_sum_grads); the sums are the same either way."""
    sums: list[Any] = [None] * len(per_param)
    together: dict[str, list[int]] = {}
    for i, gs in enumerate(per_param):
        present = [g for g in gs if g is not None]
        if len(gs) > 1 and len(present) == len(gs) and all(g.layout == torch.strided
                                                            for g in gs):
            together.setdefault(dests[i], []).append(i)
        elif present:
            sums[i] = _sum_grads(present, dests[i])
    for dest, idx in together.items():
        rows = [[per_param[i][d] for i in idx] for d in range(len(per_param[idx[0]]))]
        for i, total in zip(idx, _comm.reduce_add_coalesced(rows, destination=dest)):
            sums[i] = total
    return sums


def _sum_grads(grads: list[torch.Tensor], dest: str) -> torch.Tensor:
    """The sum of copies' gradients on dest: the gradient itself when there is one
    already there; dpmini's reduce_add for dense ones; torch's own add for sparse
    ones (they have no DLPack export), each moved to dest first, as PyTorch's
    reduce_add_coalesced sums sparse gradients apart (docs/spec.md 7.4)."""
    if len(grads) == 1 and _device_arg(grads[0]) == dest:
        return grads[0]
    if all(g.layout == torch.strided for g in grads):
        return _comm.reduce_add(grads, destination=dest)
    total = grads[0].to(dest)
    for g in grads[1:]:
        total = total + g.to(dest)
    return total


def _copies(tensors: list[torch.Tensor], devices: list[Any]) -> list[list[torch.Tensor]]:
    """Per device, the tensors there: devices[0] the tensors themselves (docs/spec.md 5.3,
    5.6), the others dpmini's C broadcast_coalesced copies; a layout the C copies cannot
    read (sparse) is copied by torch's own .to()."""
    rows = [list(tensors)]
    others = list(devices[1:])
    if not others:
        return rows
    is_dense = [t.layout == torch.strided for t in tensors]
    dense = [t for t, yes in zip(tensors, is_dense) if yes]
    dense_rows = (_comm.broadcast_coalesced(dense, others) if dense
                  else [[] for _ in others])
    for d, dense_row in zip(others, dense_rows):
        made = iter(dense_row)
        rows.append([next(made) if yes else _torch_copy(t, d)
                     for t, yes in zip(tensors, is_dense)])
    return rows


def _torch_copy(t: torch.Tensor, device: Any) -> torch.Tensor:
    """t (a sparse tensor: no DLPack export) copied onto dpmini device `device` by
    torch itself; a virtual CPU device is torch's CPU."""
    return t.to("cpu" if _is_virtual_cpu(device) else str(device), copy=True)


# ---------------------------------------------------------------------------
# Walking a structure beside its per-replica pieces
# ---------------------------------------------------------------------------


def _is_instance_of_dataclass(obj: Any) -> bool:
    return dataclasses.is_dataclass(obj) and not isinstance(obj, type)


def _needs_grad(obj: Any) -> bool:
    """Does obj hold a tensor that requires grad (tuples, lists, dicts, dataclasses;
    a dataclass that is a dict, both its fields and its items)? Walked with a stack
    and each container once, so neither deep nesting (the C walkers name the path
    of what is too deep) nor a container holding itself can exhaust the recursion
    limit."""
    if isinstance(obj, torch.Tensor):
        return obj.requires_grad
    # seen keeps each container it names alive: a container made on the fly (a
    # values() that builds tuples) could otherwise free its id for the next one
    stack: list[Any] = [obj]
    seen: dict[int, Any] = {}
    while stack:
        o = stack.pop()
        if isinstance(o, torch.Tensor):
            if o.requires_grad:
                return True
            continue
        if id(o) in seen:
            continue
        if isinstance(o, (tuple, list)):
            seen[id(o)] = o
            stack.extend(o)
            continue
        if _is_instance_of_dataclass(o):
            seen[id(o)] = o
            stack.extend(getattr(o, f.name) for f in dataclasses.fields(o))
        if isinstance(o, dict):
            seen[id(o)] = o
            stack.extend(o.values())
    return False


# The gather walks a dataclass field by field, also one that is a dict
# (docs/spec.md 11.4); the scatter walks only tuples, lists and dicts (by
# items). `fields` chooses between the two below.

def _children(obj: Any, fields: bool = True) -> list[tuple[Any, Any]] | None:
    """(key, child) pairs of a container, or None for a leaf."""
    if isinstance(obj, (tuple, list)):
        return list(enumerate(obj))
    if fields and _is_instance_of_dataclass(obj):
        return [(f.name, getattr(obj, f.name)) for f in dataclasses.fields(obj)]
    if isinstance(obj, dict):
        return list(obj.items())
    return None


def _child(obj: Any, key: Any, fields: bool = True) -> Any:
    if fields and _is_instance_of_dataclass(obj):
        return getattr(obj, key)
    return obj[key]


def _rebuild(like: Any, new: dict[Any, Any], fields: bool = True) -> Any:
    """like with the children in new replaced, keeping its type as dpmini's C walkers
    do (docs/spec.md 3.1, 11.4): a tuple or namedtuple is made anew, a list copied, a
    dict subclass is copy.copy(like) with the new values assigned as items, a dataclass
    copy.copy(like) with the fields set by object.__setattr__ (neither __init__ nor
    __post_init__ runs again; frozen ones work), and the items of the same names that
    it has when it is also a dict. like itself when no child changes (an autograd
    Function returns the very tensor the C step made)."""
    new = {k: v for k, v in new.items() if v is not _child(like, k, fields)}
    if not new:
        return like
    if isinstance(like, tuple):
        items = [new.get(i, v) for i, v in enumerate(like)]
        if hasattr(like, "_fields"):
            return type(like)(*items)
        return type(like)(items) if type(like) is not tuple else tuple(items)
    if isinstance(like, list):
        seq: list[Any] = list(like) if type(like) is list else type(like)(like)
        for i, v in new.items():
            seq[i] = v
        return seq
    out = dict(like) if type(like) is dict else copy.copy(like)
    by_field = fields and _is_instance_of_dataclass(out)
    for key, v in new.items():
        if by_field:
            object.__setattr__(out, key, v)
            if isinstance(out, dict) and key in out:
                out[key] = v
        else:
            out[key] = v
    return out


def _fits(src: Any, outs: list[Any]) -> bool:
    """Do the per-replica pieces have src's container shape at this level?"""
    if isinstance(src, (tuple, list)):
        return all(isinstance(o, (tuple, list)) and len(o) == len(src) for o in outs)
    if isinstance(src, dict):
        return all(isinstance(o, dict) and all(k in o for k in src) for o in outs)
    return all(type(o) is type(src) for o in outs)


def _split_dim(src: torch.Tensor, pieces: list[torch.Tensor]) -> int | None:
    """The dim src was split along (the one where a piece's size differs), or None
    when every piece is whole (a broadcast, or one piece)."""
    for d in range(src.dim()):
        if any(p.dim() != src.dim() or p.shape[d] != src.shape[d] for p in pieces):
            return d
    return None


def _attach_scatter(src: Any, outs: list[Any], depth: int = 0) -> list[Any]:
    """outs (one structure per replica, made from src by the C scatter) with each
    piece of a tensor that requires grad recorded as a _Scatter of it."""
    if isinstance(src, torch.Tensor):
        if not src.requires_grad or not all(isinstance(o, torch.Tensor) for o in outs):
            return outs
        return list(_Scatter.apply(src, list(outs), _split_dim(src, outs)))
    # Only the containers the C scatter splits, by their items: anything else (a
    # dataclass) reaches every replica as the same object, its tensors with their
    # own autograd history.
    kids = _children(src, fields=False) if isinstance(src, (tuple, list, dict)) else None
    if kids is None or depth > 512 or not outs or not _fits(src, outs):
        return outs
    new: list[dict[Any, Any]] = [{} for _ in outs]
    for key, value in kids:
        if not _needs_grad(value):
            continue
        column = _attach_scatter(value, [_child(o, key, fields=False) for o in outs], depth + 1)
        for j, v in enumerate(column):
            new[j][key] = v
    return [_rebuild(o, n, fields=False) for o, n in zip(outs, new)]


_DEFAULT = object()   # out_dims not given at this level: gather along dim


def _spec_child(spec: Any, key: Any, container: Any) -> Any:
    """The out_dims entry for a child: tuples/lists are a prefix of a sequence,
    dicts address keys (and dataclass fields); anything else applies below."""
    if isinstance(spec, (tuple, list)):
        if isinstance(container, (tuple, list)) and isinstance(key, int) and key < len(spec):
            return spec[key]
        return _DEFAULT
    if isinstance(spec, dict):
        return spec.get(key, _DEFAULT)
    return spec


def _gather_rule(spec: Any, dim: int, outs: list[torch.Tensor], result: torch.Tensor):
    if isinstance(spec, str) and spec == "sum":
        return ("sum",)
    if spec is None:
        return ("first",)
    d = dim if spec is _DEFAULT else int(spec)
    if all(o.dim() == 0 for o in outs) and result.dim() == 1:
        return ("scalar",)
    return ("dim", d % outs[0].dim())


def _attach_gather(outs: list[Any], result: Any, spec: Any, dim: int, depth: int = 0) -> Any:
    """result (the C gather of outs) with each tensor gathered from replicas' tensors
    that require grad recorded as a _Gather of them."""
    first = outs[0]
    if isinstance(first, torch.Tensor):
        if not isinstance(result, torch.Tensor) or not any(
                isinstance(o, torch.Tensor) and o.requires_grad for o in outs):
            return result
        if not all(isinstance(o, torch.Tensor) for o in outs):
            return result
        return _Gather.apply([result], _gather_rule(spec, dim, outs, result), *outs)
    kids = _children(first)
    if kids is None or depth > 512 or result is None or _children(result) is None:
        return result
    new = {}
    for key, _ in kids:
        column = [_child(o, key) for o in outs]
        if not any(_needs_grad(v) for v in column):
            continue
        try:
            sub = _child(result, key)
        except (KeyError, IndexError, AttributeError):
            continue
        new[key] = _attach_gather(column, sub, _spec_child(spec, key, first), dim, depth + 1)
    return _rebuild(result, new)


# ---------------------------------------------------------------------------
# Differentiable forms of the module-level functions (called by the C entry
# points with the caller's arguments when a tensor requires grad)
# ---------------------------------------------------------------------------


def _arg(args: tuple[Any, ...], kwargs: dict[str, Any], i: int, name: str, default: Any = None):
    """A call's argument: positional i, or keyword name, or default."""
    if len(args) > i:
        return args[i]
    return kwargs.get(name, default)


def scatter(*args: Any, **kwargs: Any) -> Any:
    """dpmini.scatter with autograd: pieces of tensors that require grad are
    differentiable (docs/spec.md 7.1)."""
    with torch.no_grad():
        res = _dpmini.scatter(*args, **kwargs)
    outs = _attach_scatter(_arg(args, kwargs, 0, "inputs"), list(res))
    return type(res)(outs) if isinstance(res, tuple) else outs


def scatter_kwargs(*args: Any, **kwargs: Any) -> Any:
    """dpmini.scatter_kwargs with autograd (docs/spec.md 7.1)."""
    with torch.no_grad():
        ins, kws = _dpmini.scatter_kwargs(*args, **kwargs)
    return _attach_scatter_kwargs(_arg(args, kwargs, 0, "inputs"),
                                  _arg(args, kwargs, 1, "kwargs"), ins, kws)


def _attach_scatter_kwargs(inputs: Any, kw: Any, ins: Any, kws: Any) -> tuple[Any, Any]:
    if not _needs_grad((inputs, kw)) or len(ins) != len(kws):
        return ins, kws
    if inputs is None:
        inputs = ()
    elif not isinstance(inputs, (tuple, list)):
        inputs = (inputs,)          # a bare array is one positional argument
    src = (tuple(inputs), kw or {})
    pairs = _attach_scatter(src, [(i, k) for i, k in zip(ins, kws)])
    return tuple(p[0] for p in pairs), tuple(p[1] for p in pairs)


def gather(*args: Any, **kwargs: Any) -> Any:
    """dpmini.gather with autograd: the result is differentiable in the replicas'
    outputs (docs/spec.md 7.2)."""
    with torch.no_grad():
        res = _dpmini.gather(*args, **kwargs)
    outs = list(_arg(args, kwargs, 0, "outputs"))
    if not outs:
        return res
    dim = int(_arg(args, kwargs, 2, "dim", 0))
    spec = _arg(args, kwargs, 3, "out_dims", None)
    return _attach_gather(outs, res, _DEFAULT if spec is None else spec, dim)


def data_parallel(module: nn.Module, inputs: Any, device_ids: Any = None,
                  output_device: Any = None, dim: Any = 0, module_kwargs: Any = None, *,
                  in_dims: Any = None, out_dims: Any = None, chunk_sizes: Any = None,
                  weights: Any = None) -> Any:
    """dpmini.data_parallel of a torch.nn.Module with grad mode on: the steps of
    DataParallel.forward with autograd (docs/spec.md 2.9, 7)."""
    wrapper = DataParallel(module, device_ids, output_device, dim, False, in_dims, out_dims,
                           chunk_sizes, weights)
    if inputs is None:
        inputs = ()
    elif not isinstance(inputs, tuple):
        inputs = (inputs,)
    return _DP.forward(wrapper, *inputs, **(module_kwargs or {}))


def comm_scatter(*args: Any, **kwargs: Any) -> Any:
    """dpmini.comm.scatter with autograd (into out=, no graph is recorded)."""
    with torch.no_grad():
        res = _comm.scatter(*args, **kwargs)
    src = _arg(args, kwargs, 0, "array")
    if kwargs.get("out") is not None or not isinstance(src, torch.Tensor):
        return res
    return tuple(_attach_scatter(src, list(res)))


def comm_gather(*args: Any, **kwargs: Any) -> Any:
    """dpmini.comm.gather with autograd (into out=, no graph is recorded)."""
    with torch.no_grad():
        res = _comm.gather(*args, **kwargs)
    outs = list(_arg(args, kwargs, 0, "arrays"))
    if kwargs.get("out") is not None or not outs:
        return res
    return _attach_gather(outs, res, _DEFAULT, int(_arg(args, kwargs, 1, "dim", 0)))


def comm_broadcast(*args: Any, **kwargs: Any) -> Any:
    """dpmini.comm.broadcast with autograd: backward sums the copies' gradients."""
    with torch.no_grad():
        res = _comm.broadcast(*args, **kwargs)
    src = _arg(args, kwargs, 0, "array")
    if kwargs.get("out") is not None or not isinstance(src, torch.Tensor):
        return res
    return tuple(_Scatter.apply(src, list(res), None))


def comm_broadcast_coalesced(*args: Any, **kwargs: Any) -> Any:
    """dpmini.comm.broadcast_coalesced with autograd (per tensor, as comm_broadcast)."""
    with torch.no_grad():
        res = _comm.broadcast_coalesced(*args, **kwargs)
    rows = [list(r) for r in res]
    for i, src in enumerate(_arg(args, kwargs, 0, "arrays")):
        if isinstance(src, torch.Tensor) and src.requires_grad:
            column = _Scatter.apply(src, [r[i] for r in rows], None)
            for r, c in zip(rows, column):
                r[i] = c
    return rows


def comm_reduce_add(*args: Any, **kwargs: Any) -> Any:
    """dpmini.comm.reduce_add with autograd: backward gives each input the gradient."""
    with torch.no_grad():
        res = _comm.reduce_add(*args, **kwargs)
    inputs = list(_arg(args, kwargs, 0, "arrays"))
    if not all(isinstance(t, torch.Tensor) for t in inputs):
        return res
    return _ReduceAdd.apply([res], *inputs)


def comm_reduce_add_coalesced(*args: Any, **kwargs: Any) -> Any:
    """dpmini.comm.reduce_add_coalesced with autograd (per tensor, as reduce_add)."""
    with torch.no_grad():
        res = _comm.reduce_add_coalesced(*args, **kwargs)
    per_device = [list(row) for row in _arg(args, kwargs, 0, "per_device")]
    out = list(res)
    for i in range(len(out)):
        column = [row[i] for row in per_device]
        if all(isinstance(t, torch.Tensor) for t in column):
            out[i] = _ReduceAdd.apply([out[i]], *column)
    return tuple(out)


# ---------------------------------------------------------------------------
# replicate: PyTorch's rules for a torch.nn.Module (docs/spec.md 5)
# ---------------------------------------------------------------------------


def replicate(network: nn.Module, devices: Any, detach: bool | None = None) -> list[nn.Module]:
    """One replica of network per device, made as torch.nn.parallel.replicate makes
    them (docs/spec.md 5.2-5.7).

    Each module's replica is module._replicate_for_data_parallel() (a shallow copy of
    its __dict__: Python attributes and containers are shared with the original).
    Parameters: with autograd (detach False, or None with grad mode on) a _Broadcast:
    devices[0]'s replica uses the parameters' own memory, the others dpmini's C
    copies, and backward sums the replicas' gradients onto the parameters. Detached
    (detach True, or None under torch.no_grad()): devices[0]'s replica holds the
    Parameters themselves, the others plain C copies (sparse ones: torch's .to()), so
    a replica that writes its parameters in place writes its own. Buffers:
    devices[0]'s replica holds the original buffers (in-place updates such as
    BatchNorm's running statistics persist, docs/spec.md 5.6), the others get C copies;
    buffers that require grad follow the parameters' rule. An empty devices list
    gives [].
    Errors: those of dpmini.comm.broadcast_coalesced for bad devices.
    """
    return _replicate(_ReplicaPlan(network), devices, detach)


def _replicate(plan: _ReplicaPlan, devices: Any, detach: bool | None) -> list[nn.Module]:
    """replicate of plan's tree (plan: its walk, current)."""
    devices = list(devices)
    if not devices:
        return []
    if detach is None:
        detach = not torch.is_grad_enabled()
    param_copies = _replicate_tensors(plan.params, devices, detach)
    buffers = plan.buffers
    grad_buffers = [b for b in buffers if b.requires_grad]
    if not grad_buffers:
        buffer_copies = _replicate_tensors(buffers, devices, True)
    else:
        plain_buffers = [b for b in buffers if not b.requires_grad]
        buffer_copies = _merge_rows(
            buffers,
            (grad_buffers, _replicate_tensors(grad_buffers, devices, detach)),
            (plain_buffers, _replicate_tensors(plain_buffers, devices, True)))
    return [_replica_tree(plan, param_copies[j], buffer_copies[j], register=detach and j == 0)
            for j in range(len(devices))]


def _replicate_tensors(tensors: Sequence[torch.Tensor], devices: list[Any],
                       detach: bool) -> list[list[torch.Tensor]]:
    """Per device, the replicas' tensors (device-major rows)."""
    if not tensors:
        return [[] for _ in devices]
    if detach:
        # devices[0] keeps the tensors themselves (docs/spec.md 5.3), the others copies;
        # under no_grad the C copies read tensors that require grad detached
        with torch.no_grad():
            return _copies(list(tensors), devices)
    flat = _Broadcast.apply(devices, *tensors)
    n = len(tensors)
    return [list(flat[j * n:(j + 1) * n]) for j in range(len(devices))]


def _merge_rows(order: list[torch.Tensor], *parts: tuple[list[torch.Tensor], list[list[Any]]]):
    """Per device, the copies of order's tensors, taken from parts (tensors, rows)."""
    where = {}
    for p, (tensors, _) in enumerate(parts):
        for i, t in enumerate(tensors):
            where[id(t)] = (p, i)
    ndev = len(parts[0][1])
    return [[parts[where[id(t)][0]][1][j][where[id(t)][1]] for t in order]
            for j in range(ndev)]


# ---------------------------------------------------------------------------
# The replica plan: replicate's walk of a module tree, kept between calls
# ---------------------------------------------------------------------------
# DataParallel's replicate walks the module tree on every call (its modules,
# parameters and buffers in torch's order, and where each one sits). A
# DataParallel keeps that walk (a _ReplicaPlan) and reuses it while the tree
# is the same: every module of the plan still has the same class and the same
# names bound to the same child modules, parameters and buffers (identities;
# the plan holds those objects, so an identity cannot be reused by a new one).
# A parameter or buffer swapped, added or removed, a submodule added, replaced
# or removed anywhere in the tree: the key differs and the walk is made again.
# What the walk does not hold is read at every call: each module's __dict__
# (its training flag and other attributes), the tensors' requires_grad, and
# the tensors' values. A tree with a module class that changes how torch
# walks it (overriding modules(), parameters(), buffers() or their named_
# forms, checked when the walk is made) is walked on every call.
_PLAN_ATTR = "_dpmini_replica_plan"
_WALK_METHODS = ("modules", "named_modules", "parameters", "named_parameters", "buffers",
                 "named_buffers", "_named_members")


def _walks_as_torch(cls: type) -> bool:
    """Does cls walk a module tree with nn.Module's own methods?"""
    return all(getattr(cls, name, None) is getattr(nn.Module, name) for name in _WALK_METHODS)


def _module_key(m: nn.Module) -> tuple[Any, ...]:
    """What the plan depends on in one module: its class, and the names and
    identities of its children, parameters and buffers, in order."""
    # keys(), not iteration: a ScriptModule's dicts are wrappers without __iter__
    mods, params, bufs = m._modules, m._parameters, m._buffers
    return (type(m), tuple(mods.keys()), tuple(map(id, mods.values())), tuple(params.keys()),
            tuple(map(id, params.values())), tuple(bufs.keys()), tuple(map(id, bufs.values())))


class _ReplicaPlan:
    """replicate's walk of the tree under root: modules (root first), params and
    buffers (torch's order, each once), and per module the positions of its
    children, parameters and buffers in those lists (None for a None entry);
    key: _module_key of every module, as it was when walked."""

    __slots__ = ("root", "modules", "params", "buffers", "links", "key", "types")

    def __init__(self, root: nn.Module) -> None:
        self.root = root
        self.modules = modules = list(root.modules())
        self.params = list(root.parameters())
        self.buffers = list(root.buffers())
        where = {id(m): i for i, m in enumerate(modules)}
        pwhere = {id(p): i for i, p in enumerate(self.params)}
        bwhere = {id(b): i for i, b in enumerate(self.buffers)}

        def places(items, index):
            return tuple((k, None if v is None else index[id(v)]) for k, v in items)
        self.links = [(places(m._modules.items(), where), places(m._parameters.items(), pwhere),
                       places(m._buffers.items(), bwhere)) for m in modules]
        self.key = tuple(_module_key(m) for m in modules)
        self.types = tuple({type(m): None for m in modules})

    def current(self, root: nn.Module) -> bool:
        """Is this still the walk of root's tree?"""
        if root is not self.root:
            return False
        for m, key in zip(self.modules, self.key):
            if _module_key(m) != key:
                return False
        return True


def _plan_for(holder: Any, network: nn.Module) -> _ReplicaPlan:
    """holder's plan for network (made again when not current; holder: the
    DataParallel, which keeps it in its __dict__ under _PLAN_ATTR)."""
    plan = holder.__dict__.get(_PLAN_ATTR)
    if plan is None or not plan.current(network):
        plan = _ReplicaPlan(network)
        if all(map(_walks_as_torch, plan.types)):
            holder.__dict__[_PLAN_ATTR] = plan
        else:
            holder.__dict__.pop(_PLAN_ATTR, None)
    return plan


_MODULE_REPLICATE = nn.Module._replicate_for_data_parallel
_MODULE_SETATTR = nn.Module.__setattr__


def _shallow_replica(module: nn.Module) -> nn.Module:
    """module._replicate_for_data_parallel() plus torch replicate's
    _former_parameters. When the module's class does not override that method, the
    same __dict__ is built directly (nn.Module.__setattr__ per field costs more than
    the copy)."""
    if type(module)._replicate_for_data_parallel is not _MODULE_REPLICATE:
        replica = module._replicate_for_data_parallel()
        replica._former_parameters = OrderedDict()
        return replica
    state = module.__dict__.copy()
    state["_parameters"] = {}
    state["_buffers"] = state["_buffers"].copy()
    state["_modules"] = state["_modules"].copy()
    state["_is_replica"] = True
    state["_former_parameters"] = OrderedDict()
    replica = module.__new__(type(module))
    object.__setattr__(replica, "__dict__", state)
    return replica


def _replica_tree(plan: _ReplicaPlan, params: list[torch.Tensor], buffers: list[torch.Tensor],
                  register: bool) -> nn.Module:
    """One device's replica of plan's root: every module's replica, linked to its
    children's replicas, holding that device's parameters and buffers. register: params
    are the original Parameters (detached replica 0), registered as parameters as
    setattr does in PyTorch; otherwise plain attributes (docs/spec.md 5.5)."""
    replicas = [_shallow_replica(m) for m in plan.modules]
    for replica, (kids, own_params, own_buffers) in zip(replicas, plan.links):
        # A class with its own __setattr__ gets the values through it, as PyTorch's
        # replicate assigns them (an RNN keeps its _flat_weights in step there, the
        # adapter its module); nn.Module's own would store them where the direct
        # writes below do, which cost less.
        own_setattr = type(replica).__setattr__ is not _MODULE_SETATTR
        former: dict[str, Any] = replica.__dict__["_former_parameters"]
        for key, i in kids:
            value = None if i is None else replicas[i]
            if own_setattr:
                setattr(replica, key, value)
            else:
                replica._modules[key] = value
        for key, i in own_params:
            param = None if i is None else params[i]
            if own_setattr and param is not None:
                setattr(replica, key, param)
            elif register and param is not None:
                replica._parameters[key] = param
            else:
                replica.__dict__[key] = param
            former[key] = param
        for key, i in own_buffers:
            if own_setattr and i is not None:
                setattr(replica, key, buffers[i])
            else:
                replica._buffers[key] = None if i is None else buffers[i]
        if isinstance(replica, _FAST_PATH_TYPES):
            replica.__class__ = _fast_path_replica_class(type(replica))
    return replicas[0]


# torch's modules with an eval fast path: it runs only when no TorchFunctionMode is
# active (torch.overrides.has_torch_function), and its outputs differ from the
# other path's (TransformerEncoder's nested tensors give 0 at padded positions).
# Their replicas get a class that leaves the random-number mode where the fast
# path could run (_fast_path_replica_class).
_FAST_PATH_TYPES = (nn.MultiheadAttention, nn.TransformerEncoderLayer, nn.TransformerEncoder)


_FAST_PATH_CLASSES: dict[type, type] = {}


def _fast_path_replica_class(cls: Any) -> type:
    """The class of a replica of a cls module: a subclass whose forward runs
    cls.forward outside the thread's random-number mode when torch's fast path
    could run (_fast_path_possible), made once per class. A copy or a pickle of
    such a replica is a cls module (its __reduce_ex__), and its name and
    forward's signature are cls's."""
    if "_dpmini_fast_path_base" in cls.__dict__:
        return cls
    sub = _FAST_PATH_CLASSES.get(cls)
    if sub is None:
        @functools.wraps(cls.forward)
        def forward(self: Any, *args: Any, **kwargs: Any) -> Any:
            return _outside_random_mode(cls.forward, self, args, kwargs)

        def __reduce_ex__(self: Any, protocol: Any) -> Any:
            return (_new_module, (cls,), self.__dict__)
        sub = type(cls.__name__, (cls,), {
            "forward": forward, "__reduce_ex__": __reduce_ex__, "__module__": cls.__module__,
            "__qualname__": cls.__qualname__, "_dpmini_fast_path_base": cls})
        _FAST_PATH_CLASSES[cls] = sub
    return sub


def _new_module(cls: Any) -> Any:
    """An empty cls instance, for a copy or a pickle to fill (__setstate__)."""
    return cls.__new__(cls)


def _outside_random_mode(forward: Any, module: nn.Module, args: tuple[Any, ...],
                         kwargs: dict[str, Any]) -> Any:
    """forward(module, *args, **kwargs), with this thread's random-number mode
    left for the call when it is the innermost TorchFunctionMode and torch's
    fast path could run."""
    mode = _replica_random()
    if mode is None or _current_function_mode() is not mode or \
            not _fast_path_possible(module, args, kwargs):
        return forward(module, *args, **kwargs)
    mode.__exit__(None, None, None)
    try:
        return forward(module, *args, **kwargs)
    finally:
        mode.__enter__()


def _fast_path_possible(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """Could torch take module's eval fast path in this call? The conditions it
    checks first: the module (for a TransformerEncoder, its first layer) not
    training and, with grad mode on, no tensor of the call or of that module
    requiring grad. When torch's other conditions fail, its other path runs
    outside the mode (random functions there draw in thread order)."""
    owner = module
    layers = getattr(module, "layers", None) if isinstance(module, nn.TransformerEncoder) else None
    if layers is not None and len(layers) > 0:
        owner = layers[0]
    if owner.training:
        return False
    if not torch.is_grad_enabled():
        return True
    tensors: list[Any] = [v for v in (*args, *kwargs.values()) if isinstance(v, torch.Tensor)]
    for m in owner.modules():
        tensors.extend(m._parameters.values())
        tensors.extend(m.__dict__.get("_former_parameters", {}).values())   # a replica's
    return not any(t is not None and t.requires_grad for t in tensors)


# ---------------------------------------------------------------------------
# The nn.Module adapter (docs/spec.md 1.8)
# ---------------------------------------------------------------------------

_OPTIONS = ("dim", "strict", "in_dims", "out_dims", "chunk_sizes", "weights")


def _settings(dp: Any) -> dict[str, Any]:
    """The C part's settings, as DataParallel.__init__ takes them (devices as text)."""
    out = {name: getattr(dp, name) for name in _OPTIONS}
    out["device_ids"] = [str(d) for d in dp.device_ids]
    out["output_device"] = str(dp.output_device)
    return out


class DataParallel(_DP, nn.Module):
    """dpmini.DataParallel over a torch.nn.Module: the C type (its forward, scatter and
    parallel_apply) and a torch.nn.Module whose one child is ``module`` (docs/spec.md 1.8), as
    torch.nn.DataParallel is. ``dpmini.DataParallel(torch_module, ...)`` makes one;
    the arguments, attributes and call are DataParallel's.

    From nn.Module: parameters()/state_dict() with keys "module.*", nesting in a
    parent, train()/eval(), hooks (run once per call on the wrapper, as in PyTorch),
    get_submodule, named_modules, to(), repr, copy/deepcopy/pickle/torch.save.
    With grad mode on the call records autograd (docs/spec.md 7): scatter and gather are
    differentiable and replicas' parameters are broadcast copies whose gradients are
    summed onto the original parameters, so loss.backward() after dp(x) leaves in
    each parameter's .grad what a single-device run gives. Under torch.no_grad() the C
    steps run as they are.
    Errors: those of dpmini.DataParallel; TypeError when ``module`` is assigned
    something that is not an nn.Module (nn.Module's rule).
    """

    _dpmini_user_class: type = _DP

    def __init__(self, module: nn.Module, device_ids: Any = None, output_device: Any = None,
                 dim: Any = 0, strict: bool = False, in_dims: Any = None, out_dims: Any = None,
                 chunk_sizes: Any = None, weights: Any = None) -> None:
        nn.Module.__init__(self)
        _DP.__init__(self, module, device_ids, output_device, dim, strict, in_dims, out_dims,
                     chunk_sizes, weights)
        self._modules["module"] = module

    # The C type's own attributes come before nn.Module's in the MRO: the ones that
    # must be nn.Module's are named here.
    __call__ = nn.Module.__call__
    __repr__ = nn.Module.__repr__
    __getstate__ = nn.Module.__getstate__

    @property
    def module(self) -> Any:   # type: ignore[override]
        """The wrapped module: the child "module" (the C part follows it at each call).
        AttributeError once the child was deleted, as nn.Module gives."""
        mods = self.__dict__.get("_modules")
        if mods is None:   # inside _DP.__init__, before nn.Module's state exists
            return _DP.module.__get__(self)
        if "module" not in mods:
            raise AttributeError(f"'{type(self).__name__}' object has no attribute 'module'")
        return mods["module"]

    @module.setter
    def module(self, value: Any) -> None:
        self.__setattr__("module", value)

    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        """DataParallel's forward, over the child "module" as it is now: nn.Module's own
        ways to replace a child (add_module, register_module, _modules[...], as
        torch.ao.quantization's swaps do) bypass this class's __setattr__."""
        child = self.module
        if child is self:   # torch recurses until RecursionError; here threads would too
            raise RecursionError("module: the wrapper is its own child 'module', so its call "
                                 "would call itself without end")
        if child is not _DP.module.__get__(self):
            cast(Any, _DP).module.__set__(self, child)
            self.__dict__.pop(_PLAN_ATTR, None)
        return _DP.forward(self, *inputs, **kwargs)

    def __setattr__(self, name: str, value: Any) -> None:
        if name != "module":
            nn.Module.__setattr__(self, name, value)
            return
        if self.__dict__.get("_modules") is not None:
            nn.Module.__setattr__(self, name, value)   # registers (or raises TypeError)
        cast(Any, _DP).module.__set__(self, value)
        self.__dict__.pop(_PLAN_ATTR, None)   # the old tree's walk: let it go

    def __reduce_ex__(self, protocol: Any) -> Any:
        module_state = nn.Module.__getstate__(self)
        module_state.pop(_PLAN_ATTR, None)   # a cache of this object's tree, made again
        state = {"module_state": module_state, "settings": _settings(self)}
        return (_rebuild_adapter, (self._dpmini_user_class,), state)

    def __setstate__(self, state: dict[str, Any]) -> None:
        nn.Module.__setstate__(self, state["module_state"])
        settings = dict(state["settings"])
        module = cast(nn.Module, self._modules["module"])
        _DP.__init__(self, module, settings.pop("device_ids"), settings.pop("output_device"),
                     **settings)

    def _replicate_for_data_parallel(self) -> Any:
        replica = nn.Module._replicate_for_data_parallel(self)
        replica.__dict__.pop(_PLAN_ATTR, None)
        settings = _settings(self)
        module = cast(nn.Module, self._modules["module"])
        _DP.__init__(replica, module, settings.pop("device_ids"), settings.pop("output_device"),
                     **settings)
        return replica

    def scatter(self, inputs: Any, kwargs: Any = None, device_ids: Any = None) -> Any:
        """DataParallel.scatter; with grad mode on, pieces of tensors that require grad
        are differentiable (docs/spec.md 7.1)."""
        if not torch.is_grad_enabled():
            return _DP.scatter(self, inputs, kwargs, device_ids)
        with torch.no_grad():
            ins, kws = _DP.scatter(self, inputs, kwargs, device_ids)
        return _attach_scatter_kwargs(inputs, kwargs, ins, kws)

    def replicate(self, module: Any, device_ids: Any) -> Any:
        """dpmini.replicate(module, device_ids): PyTorch's replicate rules (docs/spec.md 5),
        differentiable with grad mode on."""
        if not isinstance(module, nn.Module):
            return _DP.replicate(self, module, device_ids)
        return _replicate(_plan_for(self, module), device_ids, not torch.is_grad_enabled())

    def gather(self, outputs: Any, output_device: Any = None) -> Any:
        """DataParallel.gather; with grad mode on, differentiable in the replicas'
        outputs (docs/spec.md 7.2)."""
        if not torch.is_grad_enabled() or not _needs_grad(outputs):
            return _DP.gather(self, outputs, output_device)
        with torch.no_grad():
            res = _DP.gather(self, outputs, output_device)
        spec = self.out_dims
        return _attach_gather(list(outputs), res, _DEFAULT if spec is None else spec,
                              self.dim)


DataParallel.__module__ = "dpmini"
DataParallel.__qualname__ = "DataParallel"

_ADAPTERS: dict[type, type] = {}


def adapter_type(cls: type) -> type:
    """The adapter class for a DataParallel class cls: cls itself when it is
    already an nn.Module, DataParallel for dpmini.DataParallel, else a class made
    once per cls with bases (cls, DataParallel), so cls's own methods come first,
    then the adapter's, then the C type's and nn.Module's."""
    if issubclass(cls, nn.Module):
        return cls
    if cls is _DP:
        return DataParallel
    made = _ADAPTERS.get(cls)
    if made is None:
        made = type(cls.__name__, (cls, DataParallel),
                    {"__module__": cls.__module__, "__qualname__": cls.__qualname__,
                     "_dpmini_user_class": cls, "__doc__": cls.__doc__})
        _ADAPTERS[cls] = made
    return made


def adopt(dp: Any, module: nn.Module) -> None:
    """Make dp, an object of a DataParallel subclass made without a torch module
    (its __init__ builds one and passes it to super().__init__), the adapter of
    its class, as if the module had been the constructor's argument: its class
    becomes adapter_type(type(dp)), nn.Module's state is set up and module is the
    child "module". An object that already is an nn.Module is left as it is."""
    cls = adapter_type(type(dp))
    if cls is type(dp):
        return
    dp.__class__ = cls
    nn.Module.__init__(dp)
    dp._modules["module"] = module


def _rebuild_adapter(cls: type) -> Any:
    """For pickle and copy: an uninitialised adapter object of cls's adapter type;
    __setstate__ then restores it."""
    return _DP.__new__(adapter_type(cls))


# ---------------------------------------------------------------------------
# Replica context: torch's per-thread state in the replica threads
# ---------------------------------------------------------------------------
# torch keeps per thread: grad mode, inference mode, autocast (per device
# type: enabled, dtype; and the autocast cache), the current CUDA stream of
# each device and the intra-op thread count. torch.nn.parallel.parallel_apply
# carries grad mode, the autocast flag and the current stream of each device
# into each replica's thread (docs/spec.md 6.2). dpmini's replica threads persist
# between calls (csrc/dp/pool.c), so the provider below sets all of these in
# the replica's thread on every call and sets back what that thread had once
# the replica has returned (dpmini.register_replica_context: parallel_apply
# calls the provider on the caller's thread, then enter and exit in each
# worker thread).
#
# Differences from torch, on purpose: the autocast dtype is carried as well as
# the flag (torch copies only the flag, so a bfloat16 region would run as the
# default float16 in its replicas), CPU and CUDA autocast are both carried,
# inference mode is carried (torch's workers start outside it), and the
# intra-op thread count of replicas on virtual CPU devices is cut to
# cores // replicas while they run, as dpmini/_blas.py cuts the BLAS pools.
_AUTOCAST_TYPES = ("cpu", "cuda")


def _autocast_read():
    """This thread's autocast state: ((enabled, dtype) per type of
    _AUTOCAST_TYPES, cache enabled)."""
    return (tuple((torch.is_autocast_enabled(t), torch.get_autocast_dtype(t))
                  for t in _AUTOCAST_TYPES), torch.is_autocast_cache_enabled())


def _autocast_write(state):
    """Set this thread's autocast state to what _autocast_read returned."""
    per_type, cache = state
    for t, (on, dtype) in zip(_AUTOCAST_TYPES, per_type):
        torch.set_autocast_enabled(t, on)
        torch.set_autocast_dtype(t, dtype)
    torch.set_autocast_cache_enabled(cache)


_NO_AUTOCAST = None   # the state of a thread outside any autocast, read once


def _caller_streams(devices):
    """{cuda index: torch's current stream there} of the caller's thread, for
    the GPU replicas; empty when torch has not initialised CUDA (every thread
    then uses the default stream, and reading it would initialise CUDA)."""
    cuda = {d.index for d in devices if d.type == "cuda"}
    if not cuda or not torch.cuda.is_initialized():
        return {}
    return {i: torch.cuda.current_stream(i) for i in cuda}


class _ReplicaCall:
    """The caller's torch state for one parallel_apply call (read on the
    caller's thread), and `enter`, which each replica thread calls."""

    __slots__ = ("grad", "inference", "autocast", "streams", "threads", "limit", "seed")

    def __init__(self, devices):
        self.grad = torch.is_grad_enabled()
        self.inference = torch.is_inference_mode_enabled()
        self.autocast = _autocast_read() if torch._C._is_any_autocast_enabled() else None
        self.streams = _caller_streams(devices)
        # the caller's count, not the process-wide one: torch.set_num_threads
        # sets both, and a thread that never called it reads the process-wide
        self.threads = torch.get_num_threads()
        per = _blas.threads_per_replica(sum(d.type == "cpu" for d in devices))
        self.limit = self.threads if per is None else min(self.threads, per)
        self.seed = _call_seed(devices)

    def enter(self, index, device):
        """Set the caller's state in this replica thread (replica `index` on
        `device`); returns the function that sets back what it had. When a
        step raises, the steps before it are undone first."""
        undo = []
        try:
            self._set(index, device, undo)
        except BaseException:
            _Undo(undo)()
            raise
        return _Undo(undo)

    def _set(self, index, device, undo):
        """The steps of enter, each appending its undo to `undo`."""
        if self.inference:
            guard = torch.inference_mode(True)
            guard.__enter__()
            undo.append(lambda: guard.__exit__(None, None, None))
        prev_grad = torch.is_grad_enabled()
        # torch.set_grad_enabled(mode) does this, and builds a context manager
        torch._C._set_grad_enabled(self.grad)
        undo.append(lambda: torch._C._set_grad_enabled(prev_grad))
        if self.autocast is not None or torch._C._is_any_autocast_enabled():
            undo.append(_enter_autocast(self.autocast))
        stream = self.streams.get(device.index) if device.type == "cuda" else None
        if stream is not None:
            prev_stream = torch.cuda.current_stream(device.index)
            torch.cuda.set_stream(stream)
            undo.append(lambda: torch.cuda.set_stream(prev_stream))
        if torch.get_num_threads() != self.limit:
            torch.set_num_threads(self.limit)
        if self.limit != self.threads:
            # the caller's count, which set_num_threads also makes the
            # process-wide one again (it was the caller's before the call)
            undo.append(lambda: torch.set_num_threads(self.threads))
        if self.seed is not None and device.type == "cpu":
            undo.append(_enter_random(self.seed, index))


def _enter_autocast(state):
    """Enter autocast with `state` (None: none enabled) in this thread, as
    torch.autocast.__enter__ does (one nesting level: the cache of cast
    weights is cleared when the outermost level is left); returns the
    function that leaves it and sets back the thread's own state."""
    global _NO_AUTOCAST
    prev = _autocast_read()
    if state is None:
        if _NO_AUTOCAST is None:
            _NO_AUTOCAST = (tuple((False, torch.get_autocast_dtype(t)) for t in _AUTOCAST_TYPES),
                            True)
        state = _NO_AUTOCAST
    _autocast_write(state)
    torch.autocast_increment_nesting()

    def leave():
        if torch.autocast_decrement_nesting() == 0:
            torch.clear_autocast_cache()
        _autocast_write(prev)
    return leave


class _Undo:
    """Calls the steps of a replica context's exit in reverse order; every
    step runs even when one raises (the first error is raised after)."""

    __slots__ = ("steps",)

    def __init__(self, steps):
        self.steps = steps

    def __call__(self):
        err = None
        for step in reversed(self.steps):
            try:
                step()
            except BaseException as e:   # the rest must still be set back
                err = err or e
        if err is not None:
            raise err


def _replica_context(devices):
    """dpmini's replica context provider for torch (register_replica_context):
    the caller's torch state, entered in each replica thread."""
    return _ReplicaCall(devices).enter



# ---------------------------------------------------------------------------
# Replica context: reproducible random numbers in replicas on virtual CPU devices
# ---------------------------------------------------------------------------
# Each GPU has its own torch generator, so torch's replicas on GPUs draw their
# dropout masks from their own device's generator, and torch.manual_seed(s)
# before a call makes the call repeatable. Virtual CPU devices share torch's one
# CPU generator, and replicas running at once would draw from it in whatever
# order their threads run. So, as each GPU has its own generator, each replica
# of a call that runs two or more replicas on virtual CPU devices draws from a
# generator of its own:
#   - the call draws one number s from torch's default CPU generator (it
#     advances it as one small random op, torch.randint, would), when the
#     first of its replicas runs a random function: a call whose replicas draw
#     nothing leaves the caller's generator as it was;
#   - replica i's generator is seeded with (s + i) mod 2**32 (torch's CPU
#     generator, an mt19937, keeps 32 bits of a seed);
#   - in replica i's thread a TorchFunctionMode hands that generator to the
#     random functions that take one (generator=None given), runs F.dropout
#     and F.alpha_dropout with it (as torch computes them on the CPU), and runs
#     the random functions that take none (_WITHOUT_GENERATOR: F.dropout1d/2d/3d,
#     feature alpha dropout, rrelu, gumbel_softmax, fractional max pooling,
#     scaled_dot_product_attention and multi_head_attention_forward with
#     dropout) one at a time, with the default generator's state swapped for
#     the replica's around each.
# A random function whose call draws nothing (a dropout not training or with p
# 0 or 1, attention with dropout_p 0) runs as it is: no seeding, no swap. A
# replica of a module with a torch eval fast path (_FAST_PATH_TYPES) runs its
# forward with the mode left when that fast path could run (_fast_path_possible):
# any active TorchFunctionMode turns it off, and its outputs differ from the
# other path's at padded positions.
# Same seed, same call: same outputs whatever thread runs first, for any
# number of replicas. Not covered: random functions outside this table that
# take no generator (they draw from the default generator in thread order),
# and draws made by other threads while a swapped function runs. With one
# replica, or replicas on GPUs, nothing changes (the replica draws as torch
# would). DPMINI_TORCH_RNG=0 turns the rule off (read at every call).
_rng_local = threading.local()   # .mode: this replica thread's _ReplicaRandom
_swap_lock = threading.Lock()    # one swapped random function at a time


# Each handler below gets the replica's _ReplicaRandom and asks it for the
# generator only when the call draws: the first draw of a call seeds it from
# the caller's generator, and a call that draws nothing must leave that as it was.


def _pass_generator(mode, func, args, kwargs):
    """Random functions with a generator argument: use the replica's (a
    generator given by the caller is kept)."""
    if kwargs.get("generator") is None:
        kwargs = dict(kwargs, generator=mode.seeded_generator())
    return func(*args, **kwargs)


def _named(func, args, kwargs):
    """{name: value} of func's parameters (a Python function's, defaults
    included) in a call func(*args, **kwargs)."""
    code = func.__code__
    names = code.co_varnames[:code.co_argcount]
    defaults = func.__defaults__ or ()
    values = dict(zip(names[len(names) - len(defaults):], defaults))
    values.update(zip(names, args))
    values.update(kwargs)
    return values


def _bound(func, args, kwargs):
    """The values of func's parameters (a Python function's, defaults
    included) in a call func(*args, **kwargs), in order."""
    values = _named(func, args, kwargs)
    return [values.get(n) for n in func.__code__.co_varnames[:func.__code__.co_argcount]]


def _probability(p):
    """p as a float when it is a real number (a NumPy float too), else None."""
    return float(p) if isinstance(p, numbers.Real) else None


def _dropout(mode, func, args, kwargs, alpha=False):
    """F.dropout / F.alpha_dropout with the replica's generator, computed as
    torch computes them on the CPU (at::native dropout: a Bernoulli(1 - p)
    noise tensor, scaled; for alpha dropout, SELU's affine correction).
    Without a draw (not training, p 0 or 1, an empty input, a p that is not a
    real number in [0, 1]): torch's own function."""
    x, p, training, inplace = _bound(func, args, kwargs)   # (input, p, training, inplace)
    p = _probability(p)
    if not isinstance(x, torch.Tensor) or p is None or not 0 <= p <= 1 or \
            _dropout_idle(x, p, training):
        return func(*args, **kwargs)
    # complex inputs get a real mask, as torch's CPU dropout draws it
    real = x.real.dtype if x.is_complex() else x.dtype
    noise = torch.empty_like(x, dtype=real).bernoulli_(1 - p, generator=mode.seeded_generator())
    if not alpha:
        noise.div_(1 - p)
        return x.mul_(noise) if inplace else x * noise
    a_selu = 1.7580993408473766
    a = 1.0 / ((a_selu * a_selu * p + 1) * (1 - p)) ** 0.5
    b = noise.add(-1).mul_(a_selu * a).add_(a_selu * a * p)
    noise.mul_(a)
    return (x.mul_(noise) if inplace else x * noise).add_(b)


def _alpha_dropout(mode, func, args, kwargs):
    return _dropout(mode, func, args, kwargs, alpha=True)


def _swapped(mode, func, args, kwargs):
    """A random function that takes no generator: run with the default CPU
    generator holding the replica's state, one at a time, then the replica's
    generator takes the advanced state and the default one gets its own back.
    (A call that draws nothing never gets here: _ReplicaRandom runs it as it is.)"""
    generator = mode.seeded_generator()
    default = torch.default_generator
    with _swap_lock:
        own = default.get_state()
        default.set_state(generator.get_state())
        try:
            return func(*args, **kwargs)
        finally:
            generator.set_state(default.get_state())
            default.set_state(own)


def _dropout_idle(x, p, training):
    """torch's dropouts draw nothing when not training, for p 0 or 1, or for
    an empty input (at::native _dropout_impl)."""
    p = _probability(p)
    return not training or p in (0.0, 1.0) or (isinstance(x, torch.Tensor) and x.numel() == 0)


def _no_draw_rules():
    """{random function: (func, args, kwargs) -> True when the call draws
    nothing}, from what torch's code does. Functions not here (gumbel_softmax,
    fractional max pooling, torch.rand and the other functions with a
    generator argument but torch.rrelu) always draw; F.dropout and
    F.alpha_dropout check for themselves."""
    rules = {}
    for name in ("dropout1d", "dropout2d", "dropout3d", "feature_alpha_dropout"):
        rules[getattr(_F, name, None)] = lambda f, a, k: _dropout_idle(*_bound(f, a, k)[:3])
    for name in ("dropout", "dropout_", "alpha_dropout", "alpha_dropout_", "feature_dropout",
                 "feature_dropout_", "feature_alpha_dropout", "feature_alpha_dropout_"):
        rules[getattr(torch, name)] = lambda f, a, k: _dropout_idle(
            _arg(a, k, 0, "input"), _arg(a, k, 1, "p"), _arg(a, k, 2, "train"))
    rules[_F.rrelu] = lambda f, a, k: not _named(f, a, k)["training"]
    rules[torch.rrelu] = rules[torch.rrelu_] = \
        lambda f, a, k: not _arg(a, k, 3, "training", False)
    rules[_F.scaled_dot_product_attention] = \
        lambda f, a, k: _probability(_arg(a, k, 4, "dropout_p", 0.0)) == 0.0
    rules[_F.multi_head_attention_forward] = lambda f, a, k: (
        lambda v: not v["training"] or _probability(v["dropout_p"]) == 0.0)(_named(f, a, k))
    rules.pop(None, None)
    return rules


def _draws_nothing(func, args, kwargs):
    """Does this call of a random function draw nothing? False when not known
    (no rule for it, or a rule that cannot read the call)."""
    rule = _NO_DRAW.get(func)
    if rule is None:
        return False
    try:
        return bool(rule(func, args, kwargs))
    except Exception:   # the arguments are not what the rule reads: assume a draw
        return False


def _random_table():
    """{torch function: how a replica runs it}."""
    table = {}
    with_generator = [
        torch.rand, torch.randn, torch.randint, torch.randperm, torch.rand_like,
        torch.randn_like, torch.randint_like, torch.normal, torch.bernoulli,
        torch.multinomial, torch.poisson, torch.rrelu, torch.rrelu_,
        torch.Tensor.uniform_, torch.Tensor.normal_, torch.Tensor.random_,
        torch.Tensor.exponential_, torch.Tensor.geometric_, torch.Tensor.log_normal_,
        torch.Tensor.cauchy_, torch.Tensor.bernoulli_, torch.Tensor.bernoulli,
        torch.Tensor.multinomial,
    ]
    for name in ("uniform_", "normal_", "trunc_normal_", "xavier_uniform_", "xavier_normal_",
                 "kaiming_uniform_", "kaiming_normal_", "orthogonal_", "sparse_"):
        f = getattr(torch.nn.init, name, None)
        if f is not None and "generator" in f.__code__.co_varnames:
            with_generator.append(f)
    for f in with_generator:
        table[f] = _pass_generator
    table[_F.dropout] = _dropout
    table[_F.alpha_dropout] = _alpha_dropout
    for name in _WITHOUT_GENERATOR:
        f = getattr(_F, name, None)
        if f is not None:
            table[f] = _swapped
    for name in ("dropout", "dropout_", "alpha_dropout", "alpha_dropout_", "feature_dropout",
                 "feature_dropout_", "feature_alpha_dropout", "feature_alpha_dropout_"):
        table[getattr(torch, name)] = _swapped
    return table


_WITHOUT_GENERATOR = (
    "dropout1d", "dropout2d", "dropout3d", "feature_alpha_dropout", "rrelu", "rrelu_",
    "gumbel_softmax", "fractional_max_pool2d", "fractional_max_pool3d",
    "fractional_max_pool2d_with_indices", "fractional_max_pool3d_with_indices",
    "scaled_dot_product_attention", "multi_head_attention_forward",
)
_RANDOM: dict[Any, Any] = {}
_NO_DRAW: dict[Any, Any] = {}


def _on_cpu(args, kwargs):
    """Does a random function called with args, kwargs draw on the CPU? (its
    first argument's device when it is a tensor, else its device= argument)"""
    first = args[0] if args else kwargs.get("input")
    if isinstance(first, torch.Tensor):
        return first.device.type == "cpu"
    device = kwargs.get("device")
    return device is None or torch.device(device).type == "cpu"


class _CallSeed:
    """The number a call draws from the default CPU generator, drawn by the
    first of its replicas that runs a random function (a call whose replicas
    draw nothing leaves the caller's generator as it was). Replicas of the
    call are the only threads drawing from the default generator meanwhile
    (the caller waits), so whichever draws it, it is the same number."""

    __slots__ = ("value", "lock")

    def __init__(self):
        self.value = None
        self.lock = threading.Lock()

    def get(self):
        with self.lock:
            if self.value is None:
                self.value = int(torch.randint(0, 2**32, (1,), dtype=torch.int64)[0])
            return self.value


class _ReplicaRandom(_TorchFunctionMode):
    """In one replica thread: random functions draw from the replica's own
    generator (the rule above), seeded at the first of them."""

    def __init__(self, generator):
        super().__init__()
        self.generator = generator
        self.call = None      # the _CallSeed of the call being run
        self.index = 0        # the replica's index in that call
        self.seeded = False

    def start(self, call, index):
        self.call, self.index, self.seeded = call, index, False
        self.__enter__()

    def leave(self):
        self.__exit__(None, None, None)
        self.call = None

    def seeded_generator(self):
        """The replica's generator, seeded first if no random function has
        drawn from it in this call yet."""
        if not self.seeded:
            with torch._C.DisableTorchFunction():   # the call's draw is the default's
                self.generator.manual_seed((self.call.get() + self.index) % 2**32)
            self.seeded = True
        return self.generator

    def __torch_function__(self, func, types, args=(), kwargs=None):
        how = _RANDOM.get(func)
        kwargs = kwargs or {}
        if how is None or not _on_cpu(args, kwargs) or _draws_nothing(func, args, kwargs):
            # random draws on a GPU use that GPU's own generator, as in torch
            return func(*args, **kwargs)
        return how(self, func, args, kwargs)


def _call_seed(devices):
    """The call's _CallSeed, or None when its replicas need no generators of
    their own (fewer than two on virtual CPU devices, or DPMINI_TORCH_RNG=0)."""
    if sum(d.type == "cpu" for d in devices) < 2 or \
            os.environ.get("DPMINI_TORCH_RNG", "1").strip() == "0":
        return None
    if not _RANDOM:
        _RANDOM.update(_random_table())
        _NO_DRAW.update(_no_draw_rules())
    return _CallSeed()



def _replica_random():
    """This thread's _ReplicaRandom while it runs a replica under the rule, else None."""
    mode = getattr(_rng_local, "mode", None)
    return mode if mode is not None and mode.call is not None else None


# torch.get_rng_state / torch.set_rng_state are the CPU generator's state, as
# torch.cuda.get_rng_state(d) is device d's. In a replica under the rule the
# replica's generator is its CPU generator, so there they read and set that
# generator's state. torch.utils.checkpoint stashes torch.get_rng_state() in
# forward and, in backward, runs the recomputation (on the thread that runs
# backward, outside the replica) with the default generator set to it: the
# recomputation then draws what the replica drew (the replica's F.dropout is
# torch's own CPU dropout drawing from its generator), as checkpoint's stash of
# a GPU's generator makes it do on GPUs.
_TORCH_GET_RNG_STATE = torch.random.get_rng_state
_TORCH_SET_RNG_STATE = torch.random.set_rng_state


def get_rng_state() -> torch.Tensor:
    """torch.get_rng_state, which dpmini replaces: the default CPU generator's
    state as a ByteTensor, or, in a replica thread that draws from a generator of
    its own (the random numbers rule of docs/libraries.md), that generator's
    state (seeded first, as the replica's first random function would)."""
    mode = _replica_random()
    if mode is None:
        return _TORCH_GET_RNG_STATE()
    return mode.seeded_generator().get_state()


def set_rng_state(new_state: torch.Tensor) -> None:
    """torch.set_rng_state, which dpmini replaces: set the default CPU
    generator's state (a ByteTensor from get_rng_state), or, in a replica thread
    that draws from a generator of its own, that generator's; errors as torch's."""
    mode = _replica_random()
    if mode is None:
        _TORCH_SET_RNG_STATE(new_state)
        return
    mode.generator.set_state(new_state)
    mode.seeded = True


def _install_rng_state_functions():
    """Put get_rng_state / set_rng_state in place of torch's (torch and
    torch.random; torch.utils.checkpoint and torch.random.fork_rng look them up
    as torch.get_rng_state and torch.set_rng_state at each call)."""
    for name, fn, orig in (("get_rng_state", get_rng_state, _TORCH_GET_RNG_STATE),
                           ("set_rng_state", set_rng_state, _TORCH_SET_RNG_STATE)):
        fn.__wrapped__ = orig
        for owner in (torch, torch.random):
            if getattr(owner, name, None) is orig:
                setattr(owner, name, fn)


def _enter_random(call, index):
    """Make this replica thread (replica `index` of the call) draw from a
    generator of its own; returns the function that ends it."""
    mode = getattr(_rng_local, "mode", None)
    if mode is None:   # one generator and mode per thread, kept between calls
        mode = _rng_local.mode = _ReplicaRandom(torch.Generator())
    mode.start(call, index)
    return mode.leave


_install_rng_state_functions()
register_replica_context(_replica_context)

# torch's work on the caller's thread (the backward before the next forward) runs
# on the caller's OpenMP team, whose threads keep spinning for milliseconds after
# each parallel region under libgomp's default wait policy; while nn.Module replicas
# run on virtual CPU devices that team is parked (docs/spec.md 6.3). DPMINI_PARK_OPENMP=0
# in the environment when torch is first used through dpmini turns it off.
# torch.get_num_threads is called before each parked call: torch sets a thread's
# count on its first use, which must not be inside the parked region.
if os.environ.get("DPMINI_PARK_OPENMP", "1").strip() != "0":
    _dpmini._park_openmp_team(nn.Module, torch.get_num_threads)
else:
    _dpmini._park_openmp_team(None)
