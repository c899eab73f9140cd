/* nccl_api.h - the few NCCL declarations dpmini calls, written from NCCL's
 * public ABI (nccl.h) so the build does not need NCCL's headers, and the
 * table of NCCL functions that nccl.c fills with dlsym or, under emulation,
 * with nccl_emulate.c's stand-ins. Shared by nccl.c and nccl_emulate.c only. */
#ifndef DPMINI_NCCL_API_H
#define DPMINI_NCCL_API_H

#include <stddef.h>

#pragma GCC visibility push(hidden)

typedef struct dp_ncclComm *ncclComm_t;
typedef int ncclResult_t;                      /* 0 = ncclSuccess */
enum { NCCL_INT8 = 0, NCCL_UINT8 = 1, NCCL_INT32 = 2, NCCL_UINT32 = 3, NCCL_INT64 = 4,
       NCCL_UINT64 = 5, NCCL_FLOAT16 = 6, NCCL_FLOAT32 = 7, NCCL_FLOAT64 = 8, NCCL_SUM = 0 };

/* NCCL takes at most 2048 operations between ncclGroupStart and
 * ncclGroupEnd (NCCL's group-call documentation); a group of many arrays
 * holds at most this many rank calls (nccl.c), and the stand-in refuses more
 * (nccl_emulate.c). */
#define NCCL_GROUP_OPS 2048

typedef struct {
    ncclResult_t (*GetVersion)(int *);
    ncclResult_t (*CommInitAll)(ncclComm_t *, int, const int *);
    ncclResult_t (*CommDestroy)(ncclComm_t);
    ncclResult_t (*CommAbort)(ncclComm_t);
    ncclResult_t (*Broadcast)(const void *, void *, size_t, int, int, ncclComm_t, void *);
    ncclResult_t (*Reduce)(const void *, void *, size_t, int, int, int, ncclComm_t, void *);
    ncclResult_t (*GroupStart)(void);
    ncclResult_t (*GroupEnd)(void);
    const char *(*GetErrorString)(ncclResult_t);
    ncclResult_t (*CommGetAsyncError)(ncclComm_t, ncclResult_t *);
} dp_nccl_fns;

#ifdef DPMINI_CUDA_EMULATE
/* nccl_emulate.c: fill *fns with the emulated NCCL and desc with its
 * description; returns 1 (nccl.c's "loaded" state). Called under nccl.c's
 * lock. */
int dp_nccl_emu_install(dp_nccl_fns *fns, char *desc, size_t desc_size);
/* nccl_emulate.c: the next emulated GroupEnd fails with this result (tests). */
void dp_nccl_emu_fail_next(int fail_next);
#endif

#pragma GCC visibility pop

#endif
