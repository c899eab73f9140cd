/* gpu_owned.c - which device memory is dpmini's own cudaMalloc blocks.
 *
 * Peer access (cudaDeviceEnablePeerAccess) maps only memory from cudaMalloc
 * into the peer's address space. Memory another library lends dpmini
 * through DLPack or the CUDA Array Interface may be of a kind it does not
 * cover: VMM allocations (cuMemCreate/cuMemMap; PyTorch's
 * expandable_segments), stream-ordered pools (cudaMallocAsync; CuPy's
 * MemoryAsyncPool) or IPC handles. A kernel on another device that reads
 * such memory faults with cudaErrorIllegalAddress, a sticky error that
 * corrupts the process's CUDA context. So gpu.c lets a kernel read a peer's
 * memory directly only when the memory lies in one of the blocks listed
 * here (added and removed by the GPU caching allocator's backend); anything
 * else is packed on its own device and copied with cudaMemcpyPeerAsync.
 *
 * A flat table under one mutex: blocks are few (the allocator caches them)
 * and the lookup runs once per strided cross-device copy, not per element.
 */
#include "gpu.h"

#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>

typedef struct {
    uintptr_t base;
    size_t size;
    int dev;
} owned_block;

static pthread_mutex_t owned_mu = PTHREAD_MUTEX_INITIALIZER;
static owned_block *owned;      /* guarded by owned_mu */
static size_t owned_n, owned_cap;

int dp_gpu_owned_add(int dev, void *p, size_t size)
{
    int rc = 0;
    pthread_mutex_lock(&owned_mu);
    if (owned_n == owned_cap) {
        size_t cap = owned_cap ? owned_cap * 2 : 64;
        owned_block *b = realloc(owned, cap * sizeof *b);
        if (b == NULL) {
            rc = -1;
            goto done;
        }
        owned = b;
        owned_cap = cap;
    }
    owned[owned_n].base = (uintptr_t)p;
    owned[owned_n].size = size;
    owned[owned_n].dev = dev;
    owned_n++;
done:
    pthread_mutex_unlock(&owned_mu);
    return rc;
}

void dp_gpu_owned_remove(int dev, void *p)
{
    pthread_mutex_lock(&owned_mu);
    for (size_t i = 0; i < owned_n; i++) {
        if (owned[i].base == (uintptr_t)p && owned[i].dev == dev) {
            owned[i] = owned[--owned_n];
            break;
        }
    }
    pthread_mutex_unlock(&owned_mu);
}

int dp_gpu_owned(int dev, const void *p)
{
    uintptr_t u = (uintptr_t)p;
    int found = 0;
    pthread_mutex_lock(&owned_mu);
    for (size_t i = 0; i < owned_n && !found; i++) {
        found = owned[i].dev == dev && u >= owned[i].base && u - owned[i].base < owned[i].size;
    }
    pthread_mutex_unlock(&owned_mu);
    return found;
}
