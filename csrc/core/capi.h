/* capi.h - what dpmini._dpmini lends dpmini._dist through a capsule
 * (dpmini._dpmini._C_API, as NumPy's _ARRAY_API): the process-wide lock
 * that keeps device-synchronising CUDA calls out of NCCL launches, the one
 * search for NCCL and the CUDA runtime, and the one NCCL table. One copy of each in the
 * process, whichever extension calls. Plain C: the capsule holds a pointer
 * to a static dp_capi of _dpmini, valid while the process lives.
 */
#ifndef DPMINI_CAPI_H
#define DPMINI_CAPI_H

#include <stddef.h>

#define DP_CAPI_NAME "dpmini._dpmini._C_API"
#define DP_CAPI_VERSION 2

/* Where a shared library is looked for, in this order: a library of these
 * sonames already loaded in the process (when `share`: the array library's
 * CUDA runtime, so that both share one current device), the full path in
 * $env, <sys.path entry>/<wheel>/<soname> (pip's nvidia-* wheels),
 * $CUDA_HOME/lib64, /usr/local/cuda/lib64, then the loader's path. */
typedef struct {
    const char *env;
    const char *wheel;
    const char *const *names;   /* sonames, most wanted first, NULL-ended */
    int share;
    char tried[512];            /* what failed, for the error message */
} dp_lib_search;

/* NCCL's ABI as dpmini calls it (nccl.h), written here so the build needs
 * no NCCL header: ncclComm_t is a pointer, ncclResult_t, ncclDataType_t and
 * ncclRedOp_t are ints, ncclUniqueId is 128 bytes passed by value, and a
 * cudaStream_t is a pointer. */
typedef struct {
    char internal[128];
} dp_nccl_unique_id;
typedef struct dp_nccl_comm *dp_nccl_comm_t;

/* The functions of libnccl.so.2 both extensions call, bound once. */
typedef struct {
    char desc[256];             /* "2.21.5 (path)" */
    int (*GetVersion)(int *);
    const char *(*GetErrorString)(int);
    int (*GetUniqueId)(dp_nccl_unique_id *);
    int (*CommInitAll)(dp_nccl_comm_t *, int, const int *);
    int (*CommInitRank)(dp_nccl_comm_t *, int, dp_nccl_unique_id, int);
    int (*CommDestroy)(dp_nccl_comm_t);
    int (*CommAbort)(dp_nccl_comm_t);
    int (*CommGetAsyncError)(dp_nccl_comm_t, int *);
    int (*AllReduce)(const void *, void *, size_t, int, int, dp_nccl_comm_t, void *);
    int (*Broadcast)(const void *, void *, size_t, int, int, dp_nccl_comm_t, void *);
    int (*Reduce)(const void *, void *, size_t, int, int, int, dp_nccl_comm_t, void *);
    int (*Send)(const void *, size_t, int, int, dp_nccl_comm_t, void *);
    int (*Recv)(void *, size_t, int, int, dp_nccl_comm_t, void *);
    int (*GroupStart)(void);
    int (*GroupEnd)(void);
} dp_nccl_lib;

typedef struct {
    unsigned version;           /* DP_CAPI_VERSION */
    /* An NCCL launch (group end, communicator set-up): exclusive of
     * cudaMalloc / cudaFree / cudaDeviceSynchronize in every thread. Call
     * without the GIL; never nested. */
    void (*launch_begin)(void);
    void (*launch_end)(void);
    /* dlopen of the first match (RTLD_NOW | RTLD_LOCAL), its path in
     * `found`; NULL when none (s->tried says why). With the GIL held (it
     * reads sys.path). */
    void *(*find_library)(dp_lib_search *s, char *found, size_t found_len);
    /* libnccl.so.2 (found as find_library finds it, $DPMINI_NCCL_LIBRARY
     * first), loaded and bound on the first call; NULL with the reason in
     * `why`. With the GIL held. */
    const dp_nccl_lib *(*nccl)(char *why, size_t why_len);
} dp_capi;

#endif
