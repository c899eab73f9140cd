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
# Same seed, same call: same outputs whatever thread runs first, for any
# number of replicas. Not covered: random functions outside this table that
# take no generator (they draw from the default generator in thread order),
# and draws made by other threads while a swapped function runs. With one
# replica, or replicas on GPUs, nothing changes (the replica draws as torch
# would). DPMINI_TORCH_RNG=0 turns the rule off (read at every call).
import os
import threading

import torch.nn.functional as _F
from torch.overrides import TorchFunctionMode as _TorchFunctionMode

_rng_local = threading.local()   # .mode: this replica thread's _ReplicaRandom
_swap_lock = threading.Lock()    # one swapped random function at a time


def _pass_generator(generator, func, args, kwargs):
    """Random functions with a generator argument: use the replica's."""
    if kwargs.get("generator") is None:
        kwargs = dict(kwargs, generator=generator)
    return func(*args, **kwargs)


def _bound(func, args, kwargs):
    """The values of func's parameters (a Python function's, defaults
    included) in a call func(*args, **kwargs), in order."""
    code = func.__code__
    names = code.co_varnames[:code.co_argcount]
    defaults = func.__defaults__ or ()
    values = dict(zip(names[len(names) - len(defaults):], defaults))
    values.update(zip(names, args))
    values.update(kwargs)
    return [values.get(n) for n in names]


def _dropout(generator, func, args, kwargs, alpha=False):
    """F.dropout / F.alpha_dropout with the replica's generator, computed as
    torch computes them on the CPU (at::native dropout: a Bernoulli(1 - p)
    noise tensor, scaled; for alpha dropout, SELU's affine correction).
    Without a draw (not training, p 0 or 1, an empty input, a bad p): torch's
    own function."""
    x, p, training, inplace = _bound(func, args, kwargs)   # (input, p, training, inplace)
    if not isinstance(x, torch.Tensor) or type(p) not in (int, float) or \
            not training or not 0 < p < 1 or x.numel() == 0:
        return func(*args, **kwargs)
    noise = torch.empty_like(x).bernoulli_(1 - p, generator=generator)
    if not alpha:
        noise.div_(1 - p)
        return x.mul_(noise) if inplace else x * noise
    a_selu = 1.7580993408473766
    a = 1.0 / ((a_selu * a_selu * p + 1) * (1 - p)) ** 0.5
    b = noise.add(-1).mul_(a_selu * a).add_(a_selu * a * p)
    noise.mul_(a)
    return (x.mul_(noise) if inplace else x * noise).add_(b)


def _alpha_dropout(generator, func, args, kwargs):
    return _dropout(generator, func, args, kwargs, alpha=True)


def _swapped(generator, func, args, kwargs):
    """A random function that takes no generator: run with the default CPU
    generator holding the replica's state, one at a time, then the replica's
    generator takes the advanced state and the default one gets its own back."""
    default = torch.default_generator
    with _swap_lock:
        own = default.get_state()
        default.set_state(generator.get_state())
        try:
            return func(*args, **kwargs)
        finally:
            generator.set_state(default.get_state())
            default.set_state(own)


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
_RANDOM = {}


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

    def __torch_function__(self, func, types, args=(), kwargs=None):
        how = _RANDOM.get(func)
        kwargs = kwargs or {}
        if how is None or not _on_cpu(args, kwargs):
            # random draws on a GPU use that GPU's own generator, as in torch
            return func(*args, **kwargs)
        if not self.seeded:
            self.generator.manual_seed((self.call.get() + self.index) % 2**32)
            self.seeded = True
        return how(self.generator, func, args, kwargs)


def _call_seed(devices):
    """The call's _CallSeed, or None when its replicas need no generators of
    their own (fewer than two on virtual CPU devices, or DPMINI_TORCH_RNG=0)."""
    if sum(d.type == "cpu" for d in devices) < 2 or \
            os.environ.get("DPMINI_TORCH_RNG", "1").strip() == "0":
        return None
    if not _RANDOM:
        _RANDOM.update(_random_table())
    return _CallSeed()


def _enter_random(call, index):
    """Make this replica thread (replica `index` of the call) draw from a
    generator of its own; returns the function that ends it."""
    mode = getattr(_rng_local, "mode", None)
    if mode is None:   # one generator and mode per thread, kept between calls
        mode = _rng_local.mode = _ReplicaRandom(torch.Generator())
    mode.start(call, index)
    return mode.leave


register_replica_context(_replica_context)
