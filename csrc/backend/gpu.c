/* gpu.c - dpmini's GPU layer: the per-device caching allocator. The
 * executor of copy jobs that touch a CUDA device (dp_gpu_copy, pinned
 * staging) is gpu_copy.c.
 *
 * Nothing here dereferences a device pointer on the host, and nothing here
 * uses Python: a failure is a dpc_status, which py/gpu_error.c's
 * dp_gpu_raise turns into a Python exception.
 */
#include "gpu.h"
#include "gpu_fork.h"
#include "env.h"
#include "alloc.h"
#include "pool.h"

#include <stdlib.h>
#include <string.h>

/* ------------------------------------------------------------------ */
/* Caching allocator                                                   */
/* ------------------------------------------------------------------ */

/* One cache per GPU (alloc.h): the same size classes and bound as host
 * memory, with no hard limit (as PyTorch) but the peak + 32 MiB bound, and
 * cudaMalloc / cudaFree (through cuda_api.h) as the backend. */
#define GPU_CACHE_SLACK ((size_t)32 << 20)

static dp_cache gcaches[DP_GPU_MAX];
static int gdevs[DP_GPU_MAX];          /* backend contexts: the device index */
static pthread_once_t gcaches_once = PTHREAD_ONCE_INIT;

/* err: a dpc_status * for the failure's details. */
static int gpu_block_alloc(void *ctx, size_t size, void **out, void *err)
{
    dp_device_call_begin();
    dpc_status s = dpc_malloc(*(int *)ctx, size, out);
    dp_device_call_end();
    *(dpc_status *)err = s;
    if (s.code == 0) {
        (void)dp_gpu_owned_add(*(int *)ctx, *out, size);
        return DP_ALLOC_OK;
    }
    return s.oom ? DP_ALLOC_OOM : 2;
}

static void gpu_block_release(void *ctx, void *ptr, size_t size)
{
    (void)size;
    dp_gpu_owned_remove(*(int *)ctx, ptr);
    dp_device_call_begin();
    (void)dpc_free(*(int *)ctx, ptr);
    dp_device_call_end();
}

static void init_gcaches(void)
{
    for (int d = 0; d < DP_GPU_MAX; d++) {
        gdevs[d] = d;
        dp_alloc_backend be = {gpu_block_alloc, gpu_block_release, &gdevs[d]};
        (void)dp_cache_init(&gcaches[d], be, SIZE_MAX, GPU_CACHE_SLACK);
    }
}

static dp_cache *gcache(int dev)
{
    pthread_once(&gcaches_once, init_gcaches);
    return &gcaches[dev];
}

dpc_status dp_gpu_alloc(int dev, size_t nbytes, void **out, size_t *rounded)
{
    if (dev < 0 || dev >= DP_GPU_MAX) {
        return dpc_fail(DPC_LIB_DPMINI, 1, 0, dev, "dp_gpu_alloc", __FILE__, __LINE__,
                        "device index out of range");
    }
    if (dp_gpu_forked()) {
        return dp_gpu_forked_status(dev);
    }
    dpc_status s = dpc_ok();
    int rc = dp_cache_alloc(gcache(dev), nbytes, out, rounded, &s);
    if (rc == DP_ALLOC_OOM && dp_gpu_deferred_count() > 0) {
        /* exported blocks waiting for a device sync (gpu_export.c): release
         * them and try once more */
        s = dp_gpu_release_deferred(dev);
        if (s.code == 0) {
            rc = dp_cache_alloc(gcache(dev), nbytes, out, rounded, &s);
        }
    }
    if (rc != DP_ALLOC_OK && s.code == 0) {   /* the size cannot be rounded */
        s = dpc_fail(DPC_LIB_DPMINI, 2, 1, dev, "dp_gpu_alloc", __FILE__, __LINE__,
                     "allocation size too large");
    }
    return rc == DP_ALLOC_OK ? dpc_ok() : s;
}

void dp_gpu_free(int dev, void *p, size_t rounded)
{
    if (dp_gpu_forked()) {
        return; /* the parent's memory; its cache's lock may be held forever */
    }
#ifdef DPMINI_CUDA_EMULATE
    if (dpc_emu_busy(p, rounded)) { /* queued work may still touch it: a bug */
        dpc_emu_note_freed_busy();
    }
#endif
    dp_cache_free(gcache(dev), p, rounded);
}

long dp_gpu_stat_legacy_syncs;

void dp_gpu_forget(int dev, size_t rounded)
{
    dp_cache_forget(gcache(dev), rounded);
}

void dp_gpu_memory(int dev, size_t *allocated, size_t *reserved)
{
    dp_cache_stats st = dp_cache_get_stats(gcache(dev));
    size_t aside = dp_gpu_deferred_bytes(dev); /* freed, not yet cached */
    *allocated = st.allocated - (aside < st.allocated ? aside : st.allocated);
    *reserved = st.allocated + st.cached;
}

void dp_gpu_empty_cache(void)
{
    int n = dpc_device_count();
    if (dp_gpu_forked()) {
        return;
    }
    for (int d = 0; d < n && d < DP_GPU_MAX; d++) {
        (void)dp_gpu_release_deferred(d); /* exported blocks put aside first */
        dp_cache_empty(gcache(d));
    }
}
