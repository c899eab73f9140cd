/* dist_nccl.h - NCCL (and the few CUDA runtime calls it needs) for the GPU
 * collectives of dpmini._dist, as a table of function pointers.
 *
 * Two tables fill it: dist_nccl.c takes the real libnccl.so.2 from
 * dpmini._dpmini (bound once for the process, lent through its C API
 * capsule) and loads libcudart with dlopen on the first GPU collective
 * (never at import), and
 * dist_nccl_emu.c implements the same calls over MPI on host memory, for the
 * emulated build of dpmini (its "cuda:N" arrays) so that the GPU logic runs
 * in CI. The signatures are NCCL's and the CUDA runtime's public ABI
 * (nccl.h, cuda_runtime_api.h), written here so that the build needs
 * neither header: ncclComm_t and cudaStream_t are pointers, ncclResult_t,
 * ncclDataType_t, ncclRedOp_t and cudaError_t are ints, ncclUniqueId is 128
 * bytes passed by value.
 */
#ifndef DPMINI_DIST_NCCL_H
#define DPMINI_DIST_NCCL_H

#include <mpi.h>
#include <stddef.h>

#include "capi.h"
#include <stdint.h>

typedef dp_nccl_comm_t dist_ncclComm_t;         /* core/capi.h's NCCL ABI */
typedef void *dist_stream_t;
typedef dp_nccl_unique_id dist_ncclUniqueId;

/* ncclResult_t */
enum { NCCL_OK = 0, NCCL_UNHANDLED_CUDA = 1, NCCL_SYSTEM = 2, NCCL_INTERNAL = 3,
       NCCL_INVALID_ARGUMENT = 4, NCCL_INVALID_USAGE = 5, NCCL_REMOTE = 6, NCCL_IN_PROGRESS = 7 };
/* ncclDataType_t */
enum { NCCL_T_INT8 = 0, NCCL_T_UINT8 = 1, NCCL_T_INT32 = 2, NCCL_T_UINT32 = 3, NCCL_T_INT64 = 4,
       NCCL_T_UINT64 = 5, NCCL_T_FLOAT16 = 6, NCCL_T_FLOAT32 = 7, NCCL_T_FLOAT64 = 8,
       NCCL_T_BFLOAT16 = 9 };
/* ncclRedOp_t */
enum { NCCL_SUM = 0, NCCL_PROD = 1, NCCL_MAX = 2, NCCL_MIN = 3, NCCL_AVG = 4 };
/* cudaError_t */
enum { CUDA_OK = 0, CUDA_INVALID_PITCH = 12, CUDA_NOT_READY = 600 };
/* cudaDeviceAttr: the largest pitch a 2D copy accepts, in bytes */
enum { CUDA_ATTR_MAX_PITCH = 11 };

typedef struct {
    char desc[400];        /* "NCCL 2.21.5 (path); CUDA runtime (path)" or the emulation */
    int emulated;
    int (*GetUniqueId)(dist_ncclUniqueId *);
    int (*CommInitRank)(dist_ncclComm_t *, int, dist_ncclUniqueId, int);
    int (*AllReduce)(const void *, void *, size_t, int, int, dist_ncclComm_t, dist_stream_t);
    int (*Broadcast)(const void *, void *, size_t, int, int, dist_ncclComm_t, dist_stream_t);
    int (*Reduce)(const void *, void *, size_t, int, int, int, dist_ncclComm_t, dist_stream_t);
    int (*Send)(const void *, size_t, int, int, dist_ncclComm_t, dist_stream_t);
    int (*Recv)(void *, size_t, int, int, dist_ncclComm_t, dist_stream_t);
    int (*GroupStart)(void);
    int (*GroupEnd)(void);
    int (*CommGetAsyncError)(dist_ncclComm_t, int *);
    int (*CommAbort)(dist_ncclComm_t);
    int (*CommDestroy)(dist_ncclComm_t);
    const char *(*GetErrorString)(int);
    /* CUDA runtime */
    int (*SetDevice)(int);
    int (*GetDevice)(int *);
    int (*StreamQuery)(dist_stream_t);
    int (*StreamSynchronize)(dist_stream_t);
    const char *(*CudaErrorString)(int);
    int (*Memcpy2DAsync)(void *, size_t, const void *, size_t, size_t, size_t, int, dist_stream_t);
    int (*DeviceGetAttribute)(int *, int, int);
    int (*DeviceGetPCIBusId)(char *, int, int);
} dist_nccl_api;

/* cudaMemcpyKind */
enum { CUDA_MEMCPY_DEFAULT = 4 };   /* the direction from the pointers (UVA) */

/* The table to use, loaded on first call (with the GIL held: the search
 * reads sys.path): the emulation when dist_nccl_set_emulated(1) was called
 * before, else the real libraries. NULL with a RuntimeError set (saying
 * which library was not found and where it was looked for). */
const dist_nccl_api *dist_nccl_get(void);
/* Choose the emulation (1) or the real NCCL (0) before the first GPU
 * collective; -1 with a RuntimeError once a table is in use. */
int dist_nccl_set_emulated(int on);
/* The description of the table in use, or "not loaded". */
const char *dist_nccl_describe(void);
/* An NCCL launch (communicator set-up, a collective or a send/recv group):
 * dpmini._dpmini's lock, exclusive of its cudaMalloc / cudaFree / device
 * syncs on every thread (capi.h). Without the GIL; after dist_nccl_get. */
void dist_launch_begin(void);
void dist_launch_end(void);

/* dist_nccl_emu.c: the emulated table; `parent` is the MPI communicator the
 * next emulated ncclCommInitRank duplicates (real NCCL connects through the
 * unique id; the emulation rides on MPI instead). */
const dist_nccl_api *dist_nccl_emu_table(void);
void dist_nccl_emu_set_parent(MPI_Comm parent);

#endif
