/* gpu_fork.h - the GPU layer in a child forked after the parent initialised
 * CUDA (gpu_fork.c). No Python.h. */
#ifndef DPMINI_GPU_FORK_H
#define DPMINI_GPU_FORK_H

#include "cuda_api.h"

/* dpmini status code of GPU work refused in such a child. */
#define DPC_DPMINI_FORKED 91

/* 1 in a process forked after its parent initialised CUDA (dpmini's GPU
 * state there is a copy of the parent's and unusable), else 0. */
int dp_gpu_forked(void);
/* The status GPU work returns in such a child (dev: the device asked for;
 * -1 none): a dpmini error whose message says why and what to do. */
dpc_status dp_gpu_forked_status(int dev);

#endif
