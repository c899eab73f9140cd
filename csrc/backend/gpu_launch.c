/* gpu_launch.c - one process-wide lock between NCCL launches and the CUDA
 * calls that synchronise a device.
 *
 * ncclGroupEnd (and ncclCommInitAll / ncclCommInitRank, which allocate and
 * connect) launch their kernels device after device; a kernel already
 * launched waits for its peers. If another thread calls cudaFree,
 * cudaMalloc or cudaDeviceSynchronize meanwhile, that call waits for the
 * launched kernel while the launch of the peers' kernels may wait for the
 * call (a device-wide synchronisation, or the driver's allocation lock):
 * both threads wait for ever (NCCL's documentation warns of exactly this).
 * So NCCL launches hold this lock exclusively and those calls hold it
 * shared: they never overlap, and frees or allocations on many threads
 * still run together. The completion wait after a launch holds nothing.
 *
 * dpmini._dist takes the same lock for its launches through dpmini._dpmini's
 * C API capsule (py/capi.c), so both extensions share one lock.
 */
#define _POSIX_C_SOURCE 200809L
#include "gpu.h"

#include <pthread.h>

static pthread_rwlock_t launch_lock = PTHREAD_RWLOCK_INITIALIZER;

void dp_launch_begin(void)
{
    pthread_rwlock_wrlock(&launch_lock);
}

void dp_launch_end(void)
{
    pthread_rwlock_unlock(&launch_lock);
}

void dp_device_call_begin(void)
{
    pthread_rwlock_rdlock(&launch_lock);
}

void dp_device_call_end(void)
{
    pthread_rwlock_unlock(&launch_lock);
}
