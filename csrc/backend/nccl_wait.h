/* nccl_wait.h - polling wait for a collective (nccl_wait.c). Call with the
 * GIL released (it takes it for a moment to run signal handlers). */
#ifndef DPMINI_NCCL_WAIT_H
#define DPMINI_NCCL_WAIT_H
#include "cuda_api.h"

/* The asynchronous NCCL error of rank i (ncclCommGetAsyncError), 0: none. */
typedef int (*dp_nccl_async_err_fn)(void *ctx, int i);

/* Wait until NCCL's stream (slot DP_NCCL_SLOT) of every devs[i] has finished; fails on an
 * asynchronous NCCL error, after $DPMINI_NCCL_TIMEOUT seconds, or when a
 * signal handler raised (DPC_DPMINI_INTERRUPTED, its exception left set). */
dpc_status dp_nccl_wait(int n, const int *devs, dp_nccl_async_err_fn async_err, void *ctx);

#endif
