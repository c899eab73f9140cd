/* nccl_api.h - the few NCCL declarations dpmini calls, written from NCCL's
 * public ABI (nccl.h) so the build does not need NCCL's headers. The table
 * of NCCL functions is core/capi.h's dp_nccl_lib: nccl_lib.c binds it once
 * for both extensions, nccl_emulate.c fills one with its stand-ins. Shared
 * by nccl.c and nccl_emulate.c only. */
#ifndef DPMINI_NCCL_API_H
#define DPMINI_NCCL_API_H

#include <stddef.h>

#include "capi.h"

#pragma GCC visibility push(hidden)

typedef dp_nccl_comm_t ncclComm_t;           /* core/capi.h's NCCL ABI */
typedef int ncclResult_t;                      /* 0 = ncclSuccess */
enum { NCCL_INT8 = 0, NCCL_UINT8 = 1, NCCL_INT32 = 2, NCCL_UINT32 = 3, NCCL_INT64 = 4,
       NCCL_UINT64 = 5, NCCL_FLOAT16 = 6, NCCL_FLOAT32 = 7, NCCL_FLOAT64 = 8, NCCL_SUM = 0 };

/* NCCL takes at most 2048 operations between ncclGroupStart and
 * ncclGroupEnd (NCCL's group-call documentation); a group of many arrays
 * holds at most this many rank calls (nccl.c), and the stand-in refuses more
 * (nccl_emulate.c). */
#define NCCL_GROUP_OPS 2048

#ifdef DPMINI_CUDA_EMULATE
/* nccl_emulate.c: fill *fns with the emulated NCCL and desc with its
 * description; returns 1 (nccl.c's "loaded" state). Called under nccl.c's
 * lock. */
int dp_nccl_emu_install(dp_nccl_lib *fns, char *desc, size_t desc_size);
/* nccl_emulate.c: the next emulated GroupEnd fails with this result (tests). */
void dp_nccl_emu_fail_next(int fail_next);
#endif

#pragma GCC visibility pop

#endif
