"""dpmini.distributed: data parallel across processes and machines, on MPI.

Launch one process per rank with ``mpirun -np N python script.py`` (or ``srun``)
and call :func:`init` in each. Every collective here is called by every rank of
the communicator, in the same order (SPMD), and works on NumPy host arrays of
any dtype (object arrays excepted; :func:`broadcast` also takes any picklable
object), on host arrays of other libraries (moved as NumPy, handed back in
their library), and on GPU arrays (CUDA memory with a
``__cuda_array_interface__``: PyTorch, CuPy, dpmini on "cuda:N"), which move
through NCCL: one NCCL communicator per rank, one GPU per rank, made at the
first GPU collective (NCCL is loaded with dlopen then, never at import;
with dpmini's emulated build, or ``DPMINI_DIST_NCCL=emulate``, an emulation
over MPI on host memory stands in for it).

The collectives run in C (``dpmini._dist``) with the GIL released, on dpmini's
own duplicate of the communicator, and each is **guarded**: before any data
moves, every rank sends every other rank a small record of the call (which
collective, its call number, root, dim, op, shape, dtype, the split
arguments). Every rank then holds every record and decides the same thing:

* the records agree: the data moves (non-blocking MPI, polled against the same
  deadline);
* they disagree: the same ``ValueError`` on every rank, naming each rank's
  call (the communicator stays usable);
* a rank's argument was bad (a dim out of range, a wrong ``chunk_sizes``): that
  rank raises its own error and every other rank a ``ValueError`` quoting it;
* a rank did not arrive within ``timeout`` seconds: ``TimeoutError`` on the
  ranks that did, naming the missing ranks (the communicator is then unusable:
  messages of that call may still be in flight).

Importing this module under a launcher with more than one rank installs a
``sys.excepthook`` that calls ``MPI_Abort`` when an exception ends a rank
(also before :func:`init`), so one failing rank ends the whole job with a
non-zero exit in seconds instead of leaving the others waiting (the same as
running ``python -m mpi4py script.py``; pass ``abort_on_exception=False`` to
init to keep Python's own hook).

At exit the ranks agree before any of them enters ``MPI_Finalize``
(``dpmini/_dist_exit.py``): all arrived and healthy, every rank finalizes
normally; a communicator broken by a ``TimeoutError`` ends the job with
``MPI_Abort`` while no rank is finalizing (Open MPI's launcher can hang when a
rank aborts after another finalized).

Splits follow dpmini's (and PyTorch's) chunk rule over ranks: ``ceil(n/size)``
rows per rank with a shorter last piece, so 9 rows on 4 ranks give 3, 3, 3, 0
(an empty piece of the right shape, never an error); or explicit
``chunk_sizes`` / ``weights`` (one per rank, the same on every rank).
Then :class:`DistributedDataParallel` splits each rank's rows across its local
devices with :class:`dpmini.DataParallel`'s rules.

Requires ``mpi4py`` and an MPI library: ``pip install "dpmini[mpi]"`` plus the
system MPI (``apt-get install openmpi-bin libopenmpi-dev`` or MPICH), then
rebuild dpmini so that ``dpmini._dist`` is compiled.
"""
import atexit
import operator
import os
import pickle
import sys

import numpy as np

_HOW = ('dpmini.distributed needs MPI: install the system MPI (Debian/Ubuntu: '
        'apt-get install openmpi-bin libopenmpi-dev, or MPICH), then '
        'pip install "dpmini[mpi]" (mpi4py) and rebuild dpmini '
        '(pip install --no-build-isolation -e . or make build) so that its optional '
        'extension dpmini._dist is compiled')

try:
    from mpi4py import MPI
except ImportError as exc:   # no mpi4py, or mpi4py without a loadable libmpi
    raise ImportError(f"{_HOW} ({exc})") from exc
try:
    from . import _dist
except ImportError as exc:
    if "dpmini._dist" in str(exc) and ("built against" in str(exc) or "linked" in str(exc)):
        raise   # the ABI guard: say exactly that
    raise ImportError(f"{_HOW} ({exc})") from exc

from ._ddp import DistributedDataParallel, _to_numpy, reduce_gradients  # noqa: E402
from . import _dist_exit  # noqa: E402
from ._dist_explain import DistPlan, explain  # noqa: E402

__all__ = [
    "init", "is_initialized", "finalize", "rank", "size", "local_rank", "local_size",
    "barrier", "scatter", "gather", "all_gather", "broadcast", "all_reduce", "reduce",
    "split_sizes", "set_timeout", "get_timeout", "nccl_info", "DistributedDataParallel",
    "reduce_gradients", "explain", "DistPlan",
]


class _State:
    comm = None          # _dist.Comm
    local_rank = 0
    local_size = 1
    prev_hook = None
    exit_hook = False
    stuck = None         # the parent communicator of an init() whose wait was abandoned
    exit_comm = None     # mpi4py communicator of the exit agreement (_dist_exit)


_state = _State()


def init(comm=None, timeout=60.0, abort_on_exception=True):
    """Start dpmini.distributed on `comm` (collective: every rank calls it).

    comm: an mpi4py intracommunicator, default ``MPI.COMM_WORLD``; dpmini works
        on its own duplicate (``MPI_Comm_idup``), so its messages never meet yours.
    timeout: seconds (float > 0) each collective waits for the other ranks
        before raising ``TimeoutError``; choose it above the longest time one
        rank can run ahead of the slowest between two collectives. init itself
        waits at most this long for every rank to call init: past it, the ranks
        that did raise ``TimeoutError`` (a rank may have failed before init, or
        left without calling it). Such a rank is not aborted: it goes on to
        ``MPI_Finalize`` (exit code 1 if the error ends it), where it meets the
        rank that left, which is finalizing too (a rank that failed with an
        exception has already aborted the job); aborting while that rank is in
        ``MPI_Finalize`` is what can hang Open MPI's launcher.
    abort_on_exception: keep the ``sys.excepthook`` (installed at import when
        there is more than one rank) that prints the traceback and then calls
        ``MPI_Abort`` (exit code 1 for the whole job) when an uncaught exception
        ends this rank; False puts Python's own hook back.

    init also makes a second duplicate of `comm` for the exit agreement: at
    exit every rank waits for every other rank before ``MPI_Finalize`` (a rank
    that fails meanwhile aborts the job), and the job is aborted instead when a
    communicator was broken by a ``TimeoutError``.

    Calling init again replaces the communicator. Raises TypeError (comm not
    an mpi4py communicator), ValueError (bad timeout, an intercommunicator),
    TimeoutError (not every rank called init within `timeout`).
    """
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)):
        raise TypeError(f"timeout: expected seconds as a number, got {type(timeout).__name__}")
    parent = MPI.COMM_WORLD if comm is None else comm
    # The hooks first: they must end the job if the wait below is abandoned.
    if not _state.exit_hook:
        atexit.register(_end_job)           # runs before mpi4py's MPI_Finalize (LIFO)
        atexit.register(_free_gpu)          # ncclCommDestroy, before both
        _state.exit_hook = True
    if abort_on_exception and _state.prev_hook is None:
        _state.prev_hook = sys.excepthook
        sys.excepthook = _abort_hook
    elif not abort_on_exception and _state.prev_hook is not None:
        sys.excepthook, _state.prev_hook = _state.prev_hook, None
    stuck = _dist._stuck_inits()
    try:
        new = _dist.Comm(parent, float(timeout))
    except BaseException:
        if _dist._stuck_inits() != stuck:   # TimeoutError or Ctrl-C: the idup is pending
            _state.stuck = parent
        raise
    if _state.comm is not None:
        _state.comm.free()
    _state.comm = new
    if _state.exit_comm is None:
        _state.exit_comm = _dist_exit.make_exit_comm(parent, float(timeout))
        if _state.exit_comm is None:   # a rank vanished right after the first duplicate
            _state.stuck = parent
            raise TimeoutError(f"dpmini.distributed.init (rank {parent.Get_rank()} of "
                               f"{parent.Get_size()}): not every rank completed init() within "
                               f"the timeout of {timeout:g} s")
    local = parent.Split_type(MPI.COMM_TYPE_SHARED, key=parent.Get_rank())
    try:
        _state.local_rank, _state.local_size = local.Get_rank(), local.Get_size()
    finally:
        local.Free()


def _abort_hook(tp, value, tb):
    """sys.excepthook while initialized: print, then MPI_Abort the job."""
    prev = _state.prev_hook or sys.__excepthook__
    prev(tp, value, tb)
    if _state.stuck is not None:
        # The rank missing from init most likely left and is in MPI_Finalize:
        # meet it there (see init) instead of aborting under it.
        parent = _state.stuck
        sys.stderr.write(f"dpmini.distributed: rank {parent.Get_rank()} of {parent.Get_size()} "
                         f"ended with {tp.__name__} after init() did not complete on every "
                         "rank; exiting (code 1) through MPI_Finalize, not MPI_Abort\n")
        sys.stderr.flush()
        return
    comm = _state.comm
    if comm is not None and comm.size > 1:
        sys.stderr.write(f"dpmini.distributed: rank {comm.rank} of {comm.size} ended with "
                         f"{tp.__name__}; aborting the job (MPI_Abort, exit code 1)\n")
        sys.stderr.flush()
        comm.abort(1)
    world = MPI.COMM_WORLD
    if MPI.Is_initialized() and not MPI.Is_finalized() and world.Get_size() > 1:
        # Before init (or after finalize): still abort, so that this rank does not
        # sit in MPI_Finalize while the others give up on it and abort.
        sys.stderr.write(f"dpmini.distributed: rank {world.Get_rank()} of {world.Get_size()} "
                         f"ended with {tp.__name__}; aborting the job (MPI_Abort, exit code 1)\n")
        sys.stderr.flush()
        world.Abort(1)


def _install_abort_hook():
    """At import, with more than one rank: abort the job when an exception ends
    this rank (init(abort_on_exception=False) puts the previous hook back)."""
    if _state.prev_hook is None and MPI.COMM_WORLD.Get_size() > 1:
        _state.prev_hook = sys.excepthook
        sys.excepthook = _abort_hook


def _end_job():
    """At exit, before mpi4py's MPI_Finalize: after an unfinished init, straight
    to MPI_Finalize (see init); else the exit agreement of _dist_exit decides
    between MPI_Finalize on every rank and MPI_Abort (a communicator broken by a
    TimeoutError, whose messages in flight MPI_Finalize could wait on forever)."""
    if _state.stuck is not None:
        return
    comm = _state.comm
    broken = comm is not None and comm.broken
    if _state.exit_comm is not None and _state.exit_comm.Get_size() > 1:
        _dist_exit.end(_state.exit_comm, broken)
        return
    if broken and comm.size > 1:
        sys.stderr.write(f"dpmini.distributed: rank {comm.rank} exits after a TimeoutError; "
                         "aborting the job (MPI_Abort, exit code 1) rather than waiting in "
                         "MPI_Finalize\n")
        sys.stderr.flush()
        comm.abort(1)


def _free_gpu():
    """At exit: destroy this rank's NCCL communicator while MPI and CUDA still work."""
    if _state.comm is not None:
        _state.comm.free_gpu()


def is_initialized():
    """True once :func:`init` has run (and :func:`finalize` has not)."""
    return _state.comm is not None


def finalize():
    """Free dpmini's communicator and restore ``sys.excepthook`` (collective).

    MPI itself is finalized by mpi4py at exit, not here.
    """
    if _state.comm is not None:
        _state.comm.free()
        _state.comm = None
    if _state.prev_hook is not None:
        sys.excepthook, _state.prev_hook = _state.prev_hook, None


def _is_rank(c, root):
    """Whether this rank is `root`, without raising: a root that is no int (an
    array, a float) is for the C call to refuse at its guard, so that every
    rank raises, not this one alone before the others' call."""
    try:
        return c.rank == operator.index(root)
    except Exception:
        return False


def _comm():
    if _state.comm is None:
        raise RuntimeError("dpmini.distributed is not initialized: call "
                           "dpmini.distributed.init() on every rank first")
    return _state.comm


def rank():
    """This process's rank (int, 0..size()-1)."""
    return _comm().rank


def size():
    """The number of ranks (int >= 1)."""
    return _comm().size


def local_rank():
    """This process's rank among the ranks on its machine (MPI_COMM_TYPE_SHARED)."""
    _comm()
    return _state.local_rank


def local_size():
    """The number of ranks on this process's machine."""
    _comm()
    return _state.local_size


def get_timeout():
    """The current timeout in seconds (float)."""
    return _comm().timeout


def set_timeout(seconds):
    """Set the timeout (seconds > 0) of the collectives that follow, on this rank."""
    _comm().timeout = seconds


def barrier(*, tag=None):
    """Wait until every rank arrives (guarded: TimeoutError naming the missing
    ranks; tag as in :func:`all_reduce`)."""
    _comm().barrier(tag=tag)


def scatter(x, root=0, dim=0, chunk_sizes=None, weights=None, *, tag=None, out=None):
    """Split `x` along `dim` across the ranks; every rank returns its piece.

    x: the global array on `root` (ignored on the other ranks; pass None).
    root: the rank that holds x (the same on every rank).
    dim: the split dimension, may be negative (the same on every rank).
    chunk_sizes: rows per rank (list of size() ints, summing to x.shape[dim]),
        or weights: size() positive numbers (rows in proportion, dpmini's
        weighted rule); neither: torch.chunk's rule, ceil(n/size) rows per rank
        with a shorter last piece, so trailing ranks may get 0 rows (an empty
        array of the right shape). The same on every rank (checked).
    tag, out: as in :func:`all_reduce` (out: this rank's piece's shape).
    Returns a new C-contiguous ndarray with x's dtype and x's shape except
    shape[dim] (x's dtype string is sent, so structured dtypes arrive as raw
    void of the same size on the other ranks). A GPU array on root (with a
    ``__cuda_array_interface__``) moves by NCCL send/recv: every rank gets a
    new array of root's library on its GPU (as in :func:`broadcast`).
    Raises (on every rank): ValueError/IndexError/TypeError for bad arguments on
    any rank, ValueError when the ranks disagree, TimeoutError.
    """
    c = _comm()
    if out is None and tag is None and (x is None or type(x) is np.ndarray):
        return c.scatter(x, root, dim, chunk_sizes, weights)   # no wrapper checks needed
    if _is_rank(c, root):
        x, back, gpu, error = _prepare(x)
    else:   # off root x is ignored, or names the device of a GPU result
        back, gpu, error = None, _gpu_args_safe(x), None
    if gpu is not None:   # NCCL; off root x only names the device
        return _write_out(out, c.scatter(x, root, dim, chunk_sizes, weights, gpu, tag=tag,
                                         error=error), None)
    return _write_out(out, c.scatter(x, root, dim, chunk_sizes, weights, tag=tag, error=error),
                      back)


def gather(x, root=0, dim=0, *, tag=None, out=None):
    """Join every rank's `x` along `dim` on `root` (ragged along dim allowed).

    x: this rank's array; every rank's must have the same dtype, the same
    shape except along dim, and the same device kind (host or GPU; checked).
    tag, out: as in :func:`all_reduce` (out: on root, the joined shape; ignored
    elsewhere).
    Returns the joined array (ranks in order) on root, None elsewhere.
    gather(scatter(x)) returns x exactly. Errors as scatter. GPU arrays with a
    ``__cuda_array_interface__`` move by NCCL send/recv and arrive as a new
    array of x's library on root's GPU; other GPU arrays (JAX) are staged
    through the host (copied to host memory, moved by MPI, copied back).
    """
    c = _state.comm
    if type(x) is np.ndarray and out is None and tag is None and c is not None:
        return c.gather(x, root, dim)   # the common case, without the wrappers' checks
    return _gather(x, out, lambda c, v, gpu, error: c.gather(v, root, dim, gpu, tag=tag,
                                                               error=error))


def all_gather(x, dim=0, *, tag=None, out=None):
    """gather on every rank: every rank returns the joined array (GPU arrays
    as in gather; tag and out as in :func:`all_reduce`)."""
    c = _state.comm
    if type(x) is np.ndarray and out is None and tag is None and c is not None:
        return c.all_gather(x, dim)   # the common case, without the wrappers' checks
    return _gather(x, out, lambda c, v, gpu, error: c.all_gather(v, dim, gpu, tag=tag,
                                                                   error=error))


def _gather(x, out, call):
    c = _comm()
    dev = _cuda_device(x)   # a GPU array staged through the host: its device kind goes to the guard
    x, back, gpu, error = _prepare(x)
    if gpu is not None:
        return _write_out(out, call(c, x, gpu, error), None)
    return _write_out(out, call(c, x, dev, error), back)


def broadcast(x, root=0, *, tag=None, out=None):
    """Root's `x` on every rank.

    On root, an ndarray (or NumPy scalar) travels as raw bytes and arrives as an
    ndarray of the same dtype and shape; a GPU array (PyTorch, CuPy, dpmini on
    "cuda:N": CUDA memory with a ``__cuda_array_interface__``) goes through
    NCCL (ncclBroadcast) and arrives as a new array of root's library on each
    rank's GPU: the device of a GPU array passed as x there, else that rank's
    NCCL communicator's device, else its current CUDA device. Anything else is
    pickled and arrives as an equal object. x is otherwise ignored on the
    other ranks (pass None). A pickling error on root is raised on every rank.
    tag, out: as in :func:`all_reduce` (out: root's array's shape; pickled
    objects take no out). torch's in-place ``broadcast(t, src)`` is
    ``broadcast(t, root, out=t)``.
    """
    c = _comm()
    if out is None and tag is None and (type(x) is np.ndarray or (
            x is None and type(root) is int and root != c.rank)):
        arr, was_pickled = c.broadcast(x, root)   # the common case, no wrapper checks
        return pickle.loads(arr.tobytes()) if was_pickled else arr
    mine = _is_rank(c, root)
    error = _grad_error(x, "x") if mine else None
    gpu = _gpu_args_safe(x)
    if gpu is not None:
        return _write_out(out, c.broadcast(x, root, False, error, gpu, tag=tag)[0], None)
    pickled = False
    if mine and error is None and not isinstance(x, (np.ndarray, np.generic)):
        try:
            x = np.frombuffer(pickle.dumps(x, protocol=pickle.HIGHEST_PROTOCOL), dtype=np.uint8)
            pickled = True
        except Exception as exc:  # raised on every rank by the guard
            error = TypeError(f"x: cannot pickle {type(x).__name__} for broadcast: {exc}")
    arr, was_pickled = c.broadcast(x if error is None else None, root, pickled, error, tag=tag)
    if not was_pickled:
        return _write_out(out, arr, None)
    obj = pickle.loads(arr.tobytes())
    if out is not None and not hasattr(obj, "shape"):
        raise TypeError(f"out: broadcast of a {type(obj).__name__} (pickled, not an array) "
                        "takes no out")
    return _write_out(out, obj, None)


def all_reduce(x, op="sum", *, tag=None, out=None):
    """Combine every rank's `x` element-wise; every rank returns the result.

    op: "sum", "mean" (sum / size(), floating and complex dtypes only), "max"
    or "min". Every rank's x must have the same shape, dtype and device kind
    (host or GPU; checked). Host dtypes: bool (max = any, min = all),
    integers, float16, bfloat16 (torch's, or ml_dtypes' in NumPy), float32,
    float64, longdouble, complex64, complex128. MPI has no 16-bit floats:
    float16 and bfloat16 are reduced in float32 and rounded to their dtype once
    at the end (as dpmini's single-process sums of bfloat16 are), so the result
    can differ in the last bit from a chain of 16-bit adds. GPU arrays (C-contiguous, with a ``__cuda_array_interface__``)
    go through NCCL (ncclAllReduce on the library's current stream, "mean" as
    ncclAvg) with NCCL's dtypes: int8, uint8, int32, uint32, int64, uint64,
    float16, float32, float64 (others: TypeError naming the dtype). Returns a new array (GPU: of x's library on x's
    device, complete when returned; host: non-native byte order comes back
    native).

    NaN: "max" and "min" return NaN wherever any rank holds NaN, whichever
    rank that is (NumPy's np.maximum/np.minimum rule; a NaN beats inf and
    -inf); "sum" and "mean" follow IEEE (NaN + x is NaN, inf + -inf is NaN).
    Integers and bool have no NaN: max/min are exact.

    tag: None, an int or a str naming this call (a training step), the same on
        every rank: a rank whose call carries another tag (it skipped or added
        a call) makes every rank raise ValueError naming the tags, instead of
        silently pairing its calls with the others' next ones.
    out: an array of the result's shape and dtype (NumPy, or a torch tensor
        on the CPU or the GPU) that the result is written into and that is
        returned; ``all_reduce(t, out=t)`` is torch's in-place
        ``dist.all_reduce(t)``. Checked before any data moves here; a wrong
        one raises on every rank.
    Collectives are not differentiable (as torch.distributed's are not): a
    torch tensor that requires grad, with grad mode on, is refused on every
    rank with a TypeError naming ``.detach()``. A communicator serves one
    thread at a time: a collective called while another thread of this rank
    is in one raises RuntimeError.
    """
    c = _state.comm
    if type(x) is np.ndarray and out is None and tag is None and c is not None \
            and x.dtype.char != "e" and x.dtype.kind != "V":
        return c.all_reduce(x, op)   # the common case, without the wrappers' checks
    return _reduce(x, out, lambda c, v, gpu, error, context: c.all_reduce(
        v, op, gpu, tag=tag, error=error, context=context))


def reduce(x, root=0, op="sum", *, tag=None, out=None):
    """all_reduce whose result lands on `root` only (None elsewhere); GPU
    arrays through ncclReduce. tag and out as in :func:`all_reduce` (out is
    written on root only)."""
    mine = _is_rank(_comm(), root)
    return _reduce(x, out if mine else None,
                   lambda c, v, gpu, error, context: c.reduce(v, root, op, gpu, tag=tag,
                                                              error=error, context=context))


def _reduce(x, out, call):
    c = _comm()
    given = x
    x, back, gpu, error = _prepare(x)
    if error is None and out is not None:   # the result is shaped and typed as x
        error = _out_error(out, given)
    narrow, context = None, None
    if gpu is None and error is None:
        x, narrow, context = _in_float32(given, x)
    result = call(c, x, gpu, error, context)
    if narrow is not None and result is not None:
        result = result.astype(narrow)   # rounded once
    return _write_out(out, result, None if gpu is not None else back)


def _half_name(given, host):
    """'float16' or 'bfloat16' when the caller's array (given; host: its NumPy
    form) has a 16-bit float dtype, else None."""
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(given, torch.Tensor) and given.dtype in (
            torch.float16, torch.bfloat16):
        return str(given.dtype).split(".")[-1]
    dt = getattr(host, "dtype", None)
    if isinstance(dt, np.dtype) and (dt.char == "e" or (
            dt.type.__module__ == "ml_dtypes" and dt.name == "bfloat16")):
        return dt.name
    return None


def _in_float32(given, host):
    """(array to reduce, dtype to round the result to or None, guard context).
    MPI has no 16-bit float: float16 and bfloat16 are reduced in float32 and
    rounded once; the context keeps a float16 rank and a float32 rank apart
    at the guard."""
    name = _half_name(given, host)
    if name is None:
        return host, None, None
    narrow = host.dtype if host.dtype != np.float32 else None   # torch bfloat16: back() rounds
    return np.asarray(host, dtype=np.float32), narrow, f"{name} summed in float32"


# ------------------------------------------------------------------ local checks
def _grad_error(x, name):
    """TypeError for a torch tensor that requires grad with grad mode on (the
    collectives are not differentiable, as torch.distributed's are not), else None."""
    torch = sys.modules.get("torch")
    if (torch is not None and isinstance(x, torch.Tensor) and x.requires_grad
            and torch.is_grad_enabled()):
        return TypeError(f"{name}: a torch tensor that requires grad: dpmini.distributed's "
                         "collectives are not differentiable (nor are torch.distributed's); "
                         f"pass {name}.detach(), or call under torch.no_grad()")
    return None


def _prepare(x):
    """(x as the C call takes it, back, gpu, error). error: what this rank found
    wrong with x (None when nothing); the C call raises it at its guard, so that
    every rank raises at this call and the next call pairs as it should."""
    try:
        error = _grad_error(x, "x")
        if error is not None:
            return None, None, None, error
        gpu = _gpu_args(x)
        if gpu is not None:
            return x, None, gpu, None
        v, back = _to_numpy(x)
        return v, back, None, None
    except Exception as exc:   # raised at the guard on every rank
        return None, None, None, exc


def _gpu_args_safe(x):
    try:
        return _gpu_args(x)
    except Exception:
        return None


def _out_error(out, like):
    """ValueError/TypeError when `out` cannot take a result shaped and typed like
    `like` (x of all_reduce/reduce), else None."""
    try:
        if not hasattr(like, "dtype"):   # a list or a Python number: as NumPy reads it
            like = np.asarray(like)
        _check_out(out, tuple(like.shape), _dtype_of(like))
    except Exception as exc:
        return exc
    return None


def _dtype_of(a):
    """A NumPy dtype for a NumPy or torch array (torch dtypes through numpy)."""
    dt = a.dtype
    if isinstance(dt, np.dtype):
        return dt.newbyteorder("=")
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(dt, torch.dtype):
        return torch.empty(0, dtype=dt).numpy().dtype if dt != torch.bfloat16 else dt
    return dt


def _check_out(out, shape, dtype):
    """Raise TypeError/ValueError unless out is a writable array of this shape and dtype."""
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(out, torch.Tensor):
        err = _grad_error(out, "out")
        if err is not None:
            raise err
    elif not isinstance(out, np.ndarray) and not hasattr(out, "__cuda_array_interface__"):
        raise TypeError(f"out: expected a NumPy array or a torch tensor to write the result "
                        f"into, got {type(out).__name__}")
    elif isinstance(out, np.ndarray) and not out.flags.writeable:
        raise ValueError("out: the array is read-only")
    got = tuple(int(n) for n in out.shape)
    if got != tuple(shape):
        raise ValueError(f"out: expected shape {tuple(shape)} (the result's), got {got}")
    if _dtype_of(out) != dtype:
        raise TypeError(f"out: expected dtype {dtype} (the result's), got {out.dtype}")


def _write_out(out, result, back):
    """The result in the caller's library (back from _to_numpy); written into
    `out` (and out returned) when out is given and this rank has a result."""
    result = _back(back, result)
    if out is None or result is None:
        return result
    _check_out(out, tuple(result.shape), _dtype_of(result))
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(out, torch.Tensor):
        with torch.no_grad():
            out.copy_(result if isinstance(result, torch.Tensor)
                      else torch.from_numpy(np.ascontiguousarray(result)))
    elif isinstance(out, np.ndarray) and isinstance(result, np.ndarray):
        np.copyto(out, result, casting="equiv")
    else:
        out[...] = result
    return out


# ------------------------------------------------------------------ GPU arrays
# kDLCUDA and kDLCUDAManaged in DLPack's DLDeviceType.
_CUDA_KINDS = (2, 13)


def _cuda_device(x):
    """The CUDA device (int) of a GPU array (a CUDA __dlpack_device__), else None."""
    if x is None or isinstance(x, (np.ndarray, np.generic)):
        return None
    try:
        kind, dev = type(x).__dlpack_device__(x)
    except Exception:   # no DLPack, or a library's own refusal: a host object
        return None
    return int(dev) if kind in _CUDA_KINDS else None


def _gpu_args(x):
    """(device, library, stream) when NCCL can read x (a GPU array with a
    __cuda_array_interface__: PyTorch, CuPy, dpmini), else None. stream: the
    library's current stream on x's device (torch.cuda.current_stream,
    cupy.cuda.get_current_stream), else 0 (the legacy default stream)."""
    dev = _cuda_device(x)
    if dev is None or not hasattr(x, "__cuda_array_interface__"):
        return None
    lib = type(x).__module__.split(".")[0]
    stream = 0
    if lib == "torch":
        stream = int(sys.modules["torch"].cuda.current_stream(dev).cuda_stream)
    elif lib == "cupy":
        # CuPy keeps a current stream per device: x's, not the current device's
        stream = int(sys.modules["cupy"].cuda.get_current_stream(dev).ptr)
    return dev, lib, stream


def _gpu_alloc(lib, shape, typestr, device):
    """A new C-contiguous GPU array of `lib` ("torch", "cupy", else dpmini.Array)
    on cuda:`device` (called from C for NCCL's results)."""
    dt = np.dtype(typestr)
    if lib == "torch":
        import torch
        tdt = torch.from_numpy(np.empty(0, dt)).dtype
        return torch.empty(tuple(shape), dtype=tdt, device=f"cuda:{device}")
    if lib == "cupy":
        import cupy
        with cupy.cuda.Device(device):
            return cupy.empty(tuple(shape), dt)
    import dpmini
    return dpmini.empty(tuple(shape), dt, device=f"cuda:{device}")


def _nccl_wants_emulation():
    """Whether the first GPU collective should use NCCL emulated over MPI on host
    memory (csrc/dist/dist_nccl_emu.c): with dpmini's emulated build, or when
    $DPMINI_DIST_NCCL is "emulate" (called from C, once)."""
    from . import _dpmini
    info = _dpmini.cuda_build_info()
    if os.environ.get("DPMINI_DIST_NCCL") == "emulate":
        if info.get("backend") == "cuda" and info.get("device_count", 0) > 0:
            raise RuntimeError("DPMINI_DIST_NCCL=emulate: the emulation reads GPU arrays as host "
                               "memory, which real GPU memory is not; unset it on a machine with "
                               "GPUs")
        return True
    return info.get("backend") == "emulated"


def nccl_info():
    """The NCCL used for GPU arrays (str): its version and path, the emulation,
    or "not loaded" before the first GPU collective."""
    return _dist.nccl_info()


def _back(back, result):
    """The result in the input's library (back from _to_numpy), None stays None."""
    return result if back is None or result is None else back(result)


def split_sizes(n, size=None, chunk_sizes=None, weights=None):
    """Rows per rank for n rows: what :func:`scatter` gives (list of ints).

    size: number of ranks (default: size()). Needs no communication.
    """
    if size is None:
        size = _comm().size
    return _dist.split_sizes(n, size, chunk_sizes, weights)


_install_abort_hook()
