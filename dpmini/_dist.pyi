"""Type stubs for the optional C extension dpmini._dist, the engine of dpmini.distributed.

Parameter names, kinds and defaults mirror ``inspect.signature`` of the runtime
objects (each C function's text signature); mypy.stubtest (tests/test_stubtest.py)
checks this file against the built extension where it is built (MPI and mpi4py).

Arrays: host arrays are ``numpy.ndarray``; a GPU array (torch, CuPy, dpmini.Array on
"cuda:N") comes back in the caller's library, so results are typed :data:`_AnyArray`
(``Any``). ``gpu=`` is what dpmini.distributed passes for a GPU array: ``(device,
library, stream)`` (:data:`_GpuArgs`), or, for gather and all_gather, the CUDA device
(int) of a GPU array it staged through the host.

_AnyArray and _GpuArgs exist only in this stub, not at run time. The hooks that only
tests use are not here: they are in the test-only extension dpmini._testing
(``dist_check_abi``, ``dist_nccl_emulate``), through the capsule ``_test_api``.
"""
from collections.abc import Sequence
from typing import Any, Final, SupportsFloat, SupportsIndex, TypeAlias, final

from mpi4py import MPI

# ----------------------------------------------------------------- stub-only
# numpy.ndarray, or a GPU array of the caller's library, decided at run time.
_AnyArray: TypeAlias = Any
# A GPU array's CUDA device, its library ("torch", "cupy", "dpmini") and that
# library's current stream (a cudaStream_t as an int, 0: the legacy default stream).
_GpuArgs: TypeAlias = tuple[int, str, int]

# ----------------------------------------------------------------- constants
BUILD_FAMILY: Final[str]   # "Open MPI", "MPICH" or "unknown": the mpi.h built against

# --------------------------------------------------------------------- types
@final
class Comm:
    """dpmini's duplicate of an mpi4py intracommunicator (MPI_Comm_idup, collective,
    bounded by `timeout`) with the guarded collectives of dpmini.distributed."""

    def __new__(cls, comm: MPI.Comm, timeout: float = 60.0) -> Comm: ...
    @property
    def rank(self) -> int: ...
    @property
    def size(self) -> int: ...
    @property
    def calls(self) -> int: ...
    @property
    def broken(self) -> bool: ...
    @property
    def nccl_device(self) -> int | None: ...
    @property
    def nccl_broken(self) -> str: ...
    @property
    def timeout(self) -> float: ...
    @timeout.setter
    def timeout(self, value: SupportsFloat, /) -> None: ...
    def barrier(
        self, *, tag: int | str | None = None, error: BaseException | None = None,
        context: str | None = None,
    ) -> None: ...
    def scatter(
        self,
        x: Any,
        root: SupportsIndex = 0,
        dim: SupportsIndex = 0,
        chunk_sizes: Sequence[SupportsIndex] | None = None,
        weights: Sequence[SupportsFloat] | None = None,
        gpu: _GpuArgs | None = None,
        *,
        tag: int | str | None = None,
        error: BaseException | None = None,
        context: str | None = None,
    ) -> _AnyArray: ...
    def gather(
        self,
        x: Any,
        root: SupportsIndex = 0,
        dim: SupportsIndex = 0,
        gpu: _GpuArgs | int | None = None,
        *,
        tag: int | str | None = None,
        error: BaseException | None = None,
        context: str | None = None,
    ) -> _AnyArray | None: ...
    def all_gather(
        self,
        x: Any,
        dim: SupportsIndex = 0,
        gpu: _GpuArgs | int | None = None,
        *,
        tag: int | str | None = None,
        error: BaseException | None = None,
        context: str | None = None,
    ) -> _AnyArray: ...
    def broadcast(
        self,
        x: Any,
        root: SupportsIndex = 0,
        pickled: bool = False,
        error: BaseException | None = None,
        gpu: _GpuArgs | None = None,
        *,
        tag: int | str | None = None,
        context: str | None = None,
    ) -> tuple[_AnyArray, bool]: ...
    def all_reduce(
        self,
        x: Any,
        op: str = "sum",
        gpu: _GpuArgs | None = None,
        *,
        tag: int | str | None = None,
        error: BaseException | None = None,
        context: str | None = None,
    ) -> _AnyArray: ...
    def reduce(
        self,
        x: Any,
        root: SupportsIndex = 0,
        op: str = "sum",
        gpu: _GpuArgs | None = None,
        *,
        tag: int | str | None = None,
        error: BaseException | None = None,
        context: str | None = None,
    ) -> _AnyArray | None: ...
    def free(self) -> None: ...
    def free_gpu(self) -> None: ...
    def abort(self, code: SupportsIndex, /) -> None: ...

# ----------------------------------------------------------------- functions
def nccl_info() -> str: ...
def split_sizes(
    n: SupportsIndex,
    size: SupportsIndex,
    chunk_sizes: Sequence[SupportsIndex] | None = None,
    weights: Sequence[SupportsFloat] | None = None,
) -> list[int]: ...
def build_info() -> dict[str, Any]: ...

# Private, used by dpmini/distributed.py (init: whether Comm() left an MPI_Comm_idup pending).
def _stuck_inits() -> int: ...
