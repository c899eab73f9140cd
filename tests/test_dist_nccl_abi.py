"""csrc/dist/dist_nccl.h writes NCCL's and the CUDA runtime's ABI by hand (the
build needs neither header): its constants must equal nccl.h's and
driver_types.h's. Compiled against the real headers where they are found
(CUDA_HOME, /usr/local/cuda, /usr/local/include), else skipped."""
import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

CHECK = r"""
#include <nccl.h>
#include <cuda_runtime_api.h>
#include "dist_nccl.h"
_Static_assert(NCCL_T_INT8 == ncclInt8 && NCCL_T_UINT8 == ncclUint8 && NCCL_T_INT32 == ncclInt32 && NCCL_T_UINT32 == ncclUint32 && NCCL_T_INT64 == ncclInt64 && NCCL_T_UINT64 == ncclUint64 && NCCL_T_FLOAT16 == ncclFloat16 && NCCL_T_FLOAT32 == ncclFloat32 && NCCL_T_FLOAT64 == ncclFloat64 && NCCL_T_BFLOAT16 == ncclBfloat16, "types");
_Static_assert(NCCL_SUM == ncclSum && NCCL_PROD == ncclProd && NCCL_MAX == ncclMax && NCCL_MIN == ncclMin && NCCL_AVG == ncclAvg, "ops");
_Static_assert(NCCL_OK == ncclSuccess && NCCL_UNHANDLED_CUDA == ncclUnhandledCudaError && NCCL_SYSTEM == ncclSystemError && NCCL_INTERNAL == ncclInternalError && NCCL_INVALID_ARGUMENT == ncclInvalidArgument && NCCL_INVALID_USAGE == ncclInvalidUsage && NCCL_REMOTE == ncclRemoteError && NCCL_IN_PROGRESS == ncclInProgress, "results");
_Static_assert(CUDA_OK == cudaSuccess && CUDA_NOT_READY == cudaErrorNotReady && CUDA_MEMCPY_DEFAULT == cudaMemcpyDefault, "cuda");
_Static_assert(CUDA_INVALID_PITCH == cudaErrorInvalidPitchValue && CUDA_ATTR_MAX_PITCH == cudaDevAttrMaxPitch, "pitch");
_Static_assert(sizeof(dist_ncclUniqueId) == sizeof(ncclUniqueId), "id");
_Static_assert(sizeof(ncclResult_t) == sizeof(int) && sizeof(ncclDataType_t) == sizeof(int) && sizeof(ncclRedOp_t) == sizeof(int) && sizeof(cudaError_t) == sizeof(int), "enum sizes");
"""


def _include_dirs():
    dirs = [os.path.join(h, "include") for h in (os.environ.get("CUDA_HOME"), "/usr/local/cuda")
            if h]
    dirs.append("/usr/local/include")
    nccl = [d for d in dirs if os.path.exists(os.path.join(d, "nccl.h"))]
    cuda = [d for d in dirs if os.path.exists(os.path.join(d, "cuda_runtime_api.h"))]
    return (nccl[:1] + cuda[:1]) if nccl and cuda else None


def _mpi_include():
    try:
        out = subprocess.run(["mpicc", "--showme:compile"], capture_output=True, text=True,
                             timeout=30).stdout.split()
    except (OSError, subprocess.SubprocessError):
        return None
    return [f for f in out if f.startswith("-I")] or None


def test_dist_nccl_h_constants_equal_ncclh_and_the_cuda_runtime(tmp_path):
    cc = shutil.which("cc") or shutil.which("gcc")
    dirs, mpi = _include_dirs(), _mpi_include()
    if cc is None or dirs is None or mpi is None:
        pytest.skip("needs a C compiler, nccl.h, cuda_runtime_api.h and mpicc")
    src = tmp_path / "dist_nccl_abi.c"
    src.write_text(CHECK)
    cmd = [cc, "-std=c11", "-fsyntax-only", *("-I" + d for d in dirs), *mpi,
           "-I" + str(ROOT / "csrc" / "dist"), "-I" + str(ROOT / "csrc" / "core"), str(src)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
