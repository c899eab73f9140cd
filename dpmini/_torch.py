"""What dpmini needs to know about PyTorch (imported only once torch is).

(The torch adapter's own part of this module goes above; the lead merges the
two parts. This part: the replica context.)
"""

# ---------------------------------------------------------------------------
# Replica context: torch's per-thread state in the replica threads
# ---------------------------------------------------------------------------
# torch keeps per thread: grad mode, inference mode, autocast (per device
# type: enabled, dtype; and the autocast cache), the current CUDA stream of
# each device and the intra-op thread count. torch.nn.parallel.parallel_apply
# carries grad mode, the autocast flag and the current stream of each device
# into each replica's thread (spec 6.2). dpmini's replica threads persist
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
import torch

from . import _blas
from ._dpmini import register_replica_context

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

    __slots__ = ("grad", "inference", "autocast", "streams", "threads", "limit")

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

    def enter(self, index, device):
        """Set the caller's state in this replica thread (replica `index` on
        `device`); returns the function that sets back what it had."""
        undo = []
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
        return _Undo(undo)


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


register_replica_context(_replica_context)
