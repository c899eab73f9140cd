"""dpmini: PyTorch-exact DataParallel scatter/gather for NumPy arrays, in C.

Wrap any callable in :class:`DataParallel` and call it: every array argument is
split along ``dim`` across the devices with the rules of ``torch.chunk``, one
replica runs per device on that device's worker thread, and the outputs are
gathered on ``output_device``. Without a GPU the devices are virtual CPU
devices ``"cpu:0"``, ``"cpu:1"``, ...; see :func:`cpu_device_count`.

Use :func:`explain` to see how a call will be split before running it.
"""
from . import comm
from ._dpmini import (
    Array,
    CudaError,
    DataParallel,
    Device,
    DPError,
    NcclError,
    SplitWarning,
    ZeroDimError,
    asarray,
    cpu_device_count,
    data_parallel,
    device_count,
    device_of,
    empty,
    empty_cache,
    from_dlpack,
    gather,
    memory_allocated,
    memory_reserved,
    parallel_apply,
    register_replica_context,
    replicate,
    scatter,
    scatter_kwargs,
    unregister_replica_context,
)
from ._plan import Plan, explain
from ._profile import Profile, copy_limit, profile

import atexit as _atexit

from ._dpmini import _gpu_at_exit

# NCCL communicators hold threads, sockets and GPU memory until destroyed.
_atexit.register(_gpu_at_exit)
del _atexit, _gpu_at_exit

__version__ = "0.1.0"

__all__ = [
    "DataParallel",
    "data_parallel",
    "scatter",
    "scatter_kwargs",
    "gather",
    "replicate",
    "parallel_apply",
    "register_replica_context",
    "unregister_replica_context",
    "explain",
    "Plan",
    "profile",
    "Profile",
    "copy_limit",
    "comm",
    "Device",
    "device_count",
    "cpu_device_count",
    "device_of",
    "asarray",
    "Array",
    "empty",
    "from_dlpack",
    "memory_allocated",
    "memory_reserved",
    "empty_cache",
    "DPError",
    "CudaError",
    "NcclError",
    "SplitWarning",
    "ZeroDimError",
]
