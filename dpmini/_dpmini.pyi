"""Type stubs for the C extension dpmini._dpmini (and its C submodule ``comm``).

Parameter names, kinds and defaults mirror ``inspect.signature`` of the runtime
objects exactly; tests/test_stubs.py and mypy.stubtest (tests/test_stubtest.py,
whose allowlist names the stub-only names) check this against the built extension.

Arrays: results that live on the host or on a virtual CPU device are
``numpy.ndarray``; on a CUDA device they are :class:`Array`. Where the device is
only known at run time (``asarray``, ``empty``, ``comm.gather`` ...) the result
is typed :data:`_AnyArray` (``Any``), as typeshed does for value-dependent
return types, rather than a union every caller would have to narrow.

DeviceLike (like the _-prefixed aliases, _TorchDeviceLike and _Comm) exists only in this stub,
not at run time: import it under ``if typing.TYPE_CHECKING:``.
"""
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, Final, Literal, Protocol, SupportsFloat, SupportsIndex, TypeAlias, final

from typing_extensions import Self, disjoint_base

import numpy as np
from numpy.typing import ArrayLike, DTypeLike, NDArray

# ----------------------------------------------------------------- stub-only
class _TorchDeviceLike(Protocol):
    """A torch.device: told at run time by its type's name and module, read through these."""

    @property
    def type(self) -> str: ...
    @property
    def index(self) -> int | None: ...

DeviceLike: TypeAlias = str | SupportsIndex | Device | _TorchDeviceLike
"""'cpu' or -1 (the host), 'cpu:N', 'cuda', 'cuda:N', an int N >= 0 (NumPy integers too), a Device,
or a torch.device (torch.device('cpu') is the host, torch.device('cpu', N) is 'cpu:N')."""

# numpy.ndarray (host, cpu:N) or dpmini.Array (cuda:N), decided at run time.
_AnyArray: TypeAlias = Any
# What the functions accept as one array: anything numpy.asarray takes, or an Array.
_ArrayIn: TypeAlias = ArrayLike | Array

# ----------------------------------------------------------------- constants
MAX_DEVICES: Final[int]
has_cuda: Final[int]  # 1 when this build runs GPU code (real CUDA or the emulator), else 0
cuda_backend: Final[Literal["cuda", "emulated", "none"]]

# ---------------------------------------------------------------- exceptions
class DPError(Exception):
    status: int | None

class CudaError(DPError): ...
class NcclError(DPError): ...

class _RequiresGradError(TypeError):
    status: int | None

class SplitWarning(UserWarning):
    status: int | None

class ZeroDimError(ValueError, RuntimeError):
    status: int | None

# --------------------------------------------------------------------- types
@final
class Device:
    def __new__(cls, spec: DeviceLike) -> Device: ...
    @property
    def type(self) -> Literal["cpu", "cuda"]: ...
    @property
    def index(self) -> int | None: ...
    def __eq__(self, other: object, /) -> bool: ...
    def __ne__(self, other: object, /) -> bool: ...
    def __hash__(self) -> int: ...

@final
class _Buffer:
    """Memory owned by one dpmini device (the base of its arrays). Not created directly."""

    @property
    def device(self) -> Device: ...
    @property
    def nbytes(self) -> int: ...

@final
class Array:
    """An array in CUDA device memory. Not created directly: use asarray(x, device='cuda:0')."""

    @property
    def shape(self) -> tuple[int, ...]: ...
    @property
    def strides(self) -> tuple[int, ...]: ...
    @property
    def dtype(self) -> np.dtype[Any]: ...
    @property
    def ndim(self) -> int: ...
    @property
    def size(self) -> int: ...
    @property
    def nbytes(self) -> int: ...
    @property
    def device(self) -> Device: ...
    @property
    def data_ptr(self) -> int: ...
    @property
    def __cuda_array_interface__(self) -> dict[str, Any]: ...
    def numpy(self) -> NDArray[Any]: ...
    def __dlpack__(
        self,
        *,
        stream: int | Any | None = None,
        max_version: tuple[int, int] | None = None,
        dl_device: tuple[int, int] | None = None,
        copy: bool | None = None,
    ) -> Any: ...
    def __dlpack_device__(self) -> tuple[int, int]: ...
    # __array__ is deliberately absent: it always raises TypeError at run time,
    # so declaring it would make an Array pass for numpy.typing.ArrayLike.

@disjoint_base
class DataParallel:
    def __init__(
        self,
        module: Callable[..., Any],
        device_ids: Sequence[DeviceLike] | None = None,
        output_device: DeviceLike | None = None,
        dim: SupportsIndex = 0,
        strict: bool = False,
        in_dims: Any = None,
        out_dims: Any = None,
        chunk_sizes: Sequence[SupportsIndex] | None = None,
        weights: Sequence[SupportsFloat] | None = None,
    ) -> None: ...
    def __call__(self, *args: Any, **kwargs: Any) -> Any: ...
    def forward(self, *args: Any, **kwargs: Any) -> Any: ...
    def scatter(
        self,
        inputs: Any,
        kwargs: Mapping[str, Any] | None = None,
        device_ids: Sequence[DeviceLike] | None = None,
    ) -> tuple[tuple[tuple[Any, ...] | list[Any], ...], tuple[dict[str, Any], ...]]: ...
    def replicate(self, module: Any, device_ids: Sequence[DeviceLike]) -> list[Any]: ...
    def parallel_apply(
        self,
        replicas: Sequence[Callable[..., Any]],
        inputs: Sequence[Any],
        kwargs: Sequence[Mapping[str, Any]] | None = None,
    ) -> list[Any]: ...
    def gather(self, outputs: Sequence[Any], output_device: DeviceLike | None = None) -> Any: ...
    @property
    def module(self) -> Callable[..., Any]: ...
    @module.setter
    def module(self, value: Callable[..., Any]) -> None: ...
    @property
    def device_ids(self) -> list[Device]: ...
    @device_ids.setter
    def device_ids(self, value: Sequence[DeviceLike] | None) -> None: ...
    @property
    def output_device(self) -> Device: ...
    @output_device.setter
    def output_device(self, value: DeviceLike | None) -> None: ...
    @property
    def dim(self) -> int: ...
    @dim.setter
    def dim(self, value: SupportsIndex) -> None: ...
    @property
    def strict(self) -> bool: ...
    @strict.setter
    def strict(self, value: bool) -> None: ...
    @property
    def in_dims(self) -> Any: ...
    @in_dims.setter
    def in_dims(self, value: Any) -> None: ...
    @property
    def out_dims(self) -> Any: ...
    @out_dims.setter
    def out_dims(self, value: Any) -> None: ...
    @property
    def chunk_sizes(self) -> tuple[int, ...] | None: ...
    @chunk_sizes.setter
    def chunk_sizes(self, value: Sequence[SupportsIndex] | None) -> None: ...
    @property
    def weights(self) -> tuple[float, ...] | None: ...
    @weights.setter
    def weights(self, value: Sequence[SupportsFloat] | None) -> None: ...
    # A torch.nn.Module as module gives an object of a subclass that is also a
    # torch.nn.Module (dpmini/_torch.py), with nn.Module's methods.

# ----------------------------------------------------------------- functions
def data_parallel(
    module: Callable[..., Any],
    inputs: Any,
    device_ids: Sequence[DeviceLike] | None = None,
    output_device: DeviceLike | None = None,
    dim: SupportsIndex = 0,
    module_kwargs: Mapping[str, Any] | None = None,
    *,
    in_dims: Any = None,
    out_dims: Any = None,
    chunk_sizes: Sequence[SupportsIndex] | None = None,
    weights: Sequence[SupportsFloat] | None = None,
) -> Any: ...
def scatter(
    inputs: Any,
    target_devices: Sequence[DeviceLike],
    dim: SupportsIndex = 0,
    strict: bool = False,
    in_dims: Any = None,
    chunk_sizes: Sequence[SupportsIndex] | None = None,
    weights: Sequence[SupportsFloat] | None = None,
) -> tuple[Any, ...]: ...
def scatter_kwargs(
    inputs: Any,
    kwargs: Mapping[str, Any] | None,
    target_devices: Sequence[DeviceLike],
    dim: SupportsIndex = 0,
    strict: bool = False,
    in_dims: Any = None,
    chunk_sizes: Sequence[SupportsIndex] | None = None,
    weights: Sequence[SupportsFloat] | None = None,
) -> tuple[tuple[tuple[Any, ...] | list[Any], ...], tuple[dict[str, Any], ...]]: ...
def gather(
    outputs: Sequence[Any], target_device: DeviceLike, dim: SupportsIndex = 0, out_dims: Any = None
) -> Any: ...
def replicate(module: Any, devices: Sequence[DeviceLike], detach: bool = False) -> list[Any]: ...
def parallel_apply(
    modules: Sequence[Callable[..., Any]],
    inputs: Sequence[Any],
    kwargs_tup: Sequence[Mapping[str, Any]] | None = None,
    devices: Sequence[DeviceLike | None] | None = None,
) -> list[Any]: ...
def register_replica_context(
    provider: Callable[
        [tuple[Device, ...]],
        Callable[[int, Device], Callable[[], object] | None] | None,
    ],
) -> None: ...
def unregister_replica_context(provider: Callable[..., Any]) -> bool: ...
def asarray(
    obj: Any, device: DeviceLike | None = None, pin_memory: bool = False
) -> _AnyArray: ...
def empty(
    shape: int | Sequence[int],
    dtype: DTypeLike | None = None,
    device: DeviceLike = "cpu",
    pin_memory: bool = False,
) -> _AnyArray: ...
def from_dlpack(obj: Any, /) -> _AnyArray: ...
def device_of(array: Any) -> Device: ...
def device_count() -> int: ...
def cpu_device_count() -> int: ...
def memory_allocated(device: DeviceLike) -> int: ...
def memory_reserved(device: DeviceLike) -> int: ...
def empty_cache() -> None: ...
def cuda_build_info() -> dict[str, Any]: ...

# Private, but used by dpmini/_plan.py (the record behind dpmini.explain).
def _plan(
    inputs: Any,
    kwargs: Mapping[str, Any] | None,
    device_ids: Sequence[DeviceLike] | None,
    dim: SupportsIndex = 0,
    strict: bool = False,
    in_dims: Any = None,
    chunk_sizes: Sequence[SupportsIndex] | None = None,
    weights: Sequence[SupportsFloat] | None = None,
) -> dict[str, Any]: ...

# Private, used by dpmini/_profile.py (dpmini.profile and its recording API).
def _profile_start(capacity: SupportsIndex, /) -> Any: ...
def _profile_stop(session: Any, /) -> None: ...
def _profile_counts(session: Any, /) -> tuple[int, int]: ...
def _profile_events(session: Any, start: int, stop: int, /) -> list[tuple[Any, ...]]: ...
def _profile_record(
    label: str,
    start_ns: int,
    end_ns: int,
    device: DeviceLike | None = None,
    bytes: int = 0,
) -> bool: ...
def _profile_begin(kind: SupportsIndex, /) -> bytes: ...
def _profile_end(token: bytes, label: str | None, /) -> None: ...
def _profile_now() -> int: ...
def _profile_recording() -> bool: ...
def _copy_limit_seconds(bytes: int, threads: int, streaming: bool, repeat: int, /) -> float: ...
def _gpu_at_exit() -> None: ...
def _park_openmp_team(
    cls: type | None, prepare: Callable[[], object] | None = None, /
) -> type | None: ...

# ---------------------------------------------------------------- submodule
# dpmini._dpmini.comm is a module object created by the same shared library
# (its __name__ is "dpmini.comm"). A single .so cannot carry a second stub file
# (dpmini/_dpmini/ would have to be a package), so its type is this protocol:
# mypy checks `_dpmini.comm.scatter(...)` against the methods below (self is
# bound away), and dpmini/comm.py's re-exports inherit these signatures.
class _Comm(Protocol):
    def scatter(
        self,
        array: _ArrayIn,
        devices: Sequence[DeviceLike] | None = None,
        chunk_sizes: Sequence[SupportsIndex] | None = None,
        dim: SupportsIndex = 0,
        streams: Sequence[Any] | None = None,
        *,
        out: Sequence[_AnyArray] | None = None,
    ) -> tuple[_AnyArray, ...]: ...
    def gather(
        self,
        arrays: Sequence[_ArrayIn],
        dim: SupportsIndex = 0,
        destination: DeviceLike | None = None,
        *,
        out: _AnyArray | None = None,
    ) -> _AnyArray: ...
    def broadcast(
        self,
        array: _ArrayIn,
        devices: Sequence[DeviceLike] | None = None,
        *,
        out: Sequence[_AnyArray] | None = None,
    ) -> tuple[_AnyArray, ...]: ...
    def broadcast_coalesced(
        self,
        arrays: Sequence[_ArrayIn],
        devices: Sequence[DeviceLike],
        buffer_size: int = 10485760,
    ) -> list[list[_AnyArray]]: ...
    def reduce_add(
        self, arrays: Sequence[_ArrayIn], destination: DeviceLike | None = None
    ) -> _AnyArray: ...
    def reduce_add_coalesced(
        self,
        per_device: Sequence[Sequence[_ArrayIn]],
        destination: DeviceLike | None = None,
        buffer_size: int = 10485760,
    ) -> tuple[_AnyArray, ...]: ...

comm: _Comm
