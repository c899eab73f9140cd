/* gpu_export.c - when the memory of an exported block may be reused.
 *
 * A block handed to another library (DLPack or the CUDA Array Interface)
 * may still be read by the consumer's kernels after the consumer let go of
 * it: they run on the consumer's own stream, which dpmini's streams are not
 * ordered with. So such a block goes back to the cache only after that work
 * is known to be done:
 *
 *   - DLPack export whose consumer named a stream that lives as long as
 *     the process (__dlpack__(stream=s), s = 1, the legacy default stream,
 *     or dpmini's own import stream): the release waits for that stream
 *     only (the consumer promised to use the tensor there);
 *   - everything else (another library's stream handle: it may be
 *     destroyed by the time the block is freed, CuPy destroys streams at
 *     garbage collection, and a destroyed handle must not be used; a CUDA
 *     Array Interface read, which names no stream and cannot be told from
 *     a hasattr probe; DLPack with stream None or 2, the per-thread default
 *     stream of a thread dpmini cannot wait on; a failed stream wait): the
 *     block is put aside, per device, and released
 *     with the others after ONE device synchronisation, when DP_DEFER_MAX
 *     blocks or DP_DEFER_BYTES are waiting, when an allocation on the device
 *     runs out of memory, or at empty_cache(). A probe thus costs a block
 *     held a little longer, not a cudaDeviceSynchronize per free.
 *
 * Pure C over cuda_api.h; called without the GIL.
 */
#include "gpu.h"
#include "gpu_fork.h"

#include <pthread.h>
#include <string.h>

#define DP_DEFER_MAX 16
#define DP_DEFER_BYTES ((size_t)64 << 20)
#define DP_DEFER_DEVS 64

typedef struct {
    void *p;
    size_t rounded;
} deferred_block;

typedef struct {
    pthread_mutex_t mu;
    int n;                                  /* guarded by mu */
    size_t bytes;                           /* guarded by mu */
    deferred_block blocks[DP_DEFER_MAX];    /* guarded by mu */
} defer_list;

static defer_list defer[DP_DEFER_DEVS];
static pthread_once_t defer_once = PTHREAD_ONCE_INIT;

long dp_gpu_stat_export_syncs;
long dp_gpu_stat_export_stream_syncs;

static void defer_init(void)
{
    for (int d = 0; d < DP_DEFER_DEVS; d++) {
        pthread_mutex_init(&defer[d].mu, NULL);
    }
}

/* Release blocks taken off a list: one device sync, then all to the cache.
 * A failed sync (a sticky error: the context is gone) leaks them rather than
 * caching memory that may still be read. */
static dpc_status release(int dev, deferred_block *b, int n)
{
    if (n == 0) {
        return dpc_ok();
    }
    dp_device_call_begin();
    dpc_status s = dpc_device_sync(dev);
    dp_device_call_end();
    __atomic_add_fetch(&dp_gpu_stat_export_syncs, 1, __ATOMIC_RELAXED);
    for (int i = 0; i < n; i++) {
        if (s.code == 0) {
            dp_gpu_free(dev, b[i].p, b[i].rounded);
        } else {
            dp_gpu_forget(dev, b[i].rounded);
        }
    }
    return s;
}

dpc_status dp_gpu_release_deferred(int dev)
{
    deferred_block taken[DP_DEFER_MAX];
    int n;
    if (dev < 0 || dev >= DP_DEFER_DEVS || dp_gpu_forked()) {
        return dpc_ok();
    }
    pthread_once(&defer_once, defer_init);
    defer_list *L = &defer[dev];
    pthread_mutex_lock(&L->mu);
    n = L->n;
    memcpy(taken, L->blocks, (size_t)n * sizeof taken[0]);
    L->n = 0;
    L->bytes = 0;
    pthread_mutex_unlock(&L->mu);
    return release(dev, taken, n);
}

int dp_gpu_deferred_count(void)
{
    int total = 0;
    pthread_once(&defer_once, defer_init);
    for (int d = 0; d < DP_DEFER_DEVS; d++) {
        pthread_mutex_lock(&defer[d].mu);
        total += defer[d].n;
        pthread_mutex_unlock(&defer[d].mu);
    }
    return total;
}

size_t dp_gpu_deferred_bytes(int dev)
{
    size_t bytes;
    if (dev < 0 || dev >= DP_DEFER_DEVS) {
        return 0;
    }
    pthread_once(&defer_once, defer_init);
    pthread_mutex_lock(&defer[dev].mu);
    bytes = defer[dev].bytes;
    pthread_mutex_unlock(&defer[dev].mu);
    return bytes;
}

/* Put a block aside; when the list is full, release it (and the block). */
static void defer_block(int dev, void *p, size_t rounded)
{
    deferred_block taken[DP_DEFER_MAX + 1];
    int n = 0;
    pthread_once(&defer_once, defer_init);
    defer_list *L = &defer[dev];
    pthread_mutex_lock(&L->mu);
    L->blocks[L->n].p = p;
    L->blocks[L->n].rounded = rounded;
    L->n++;
    L->bytes += rounded;
    if (L->n == DP_DEFER_MAX || L->bytes >= DP_DEFER_BYTES) {
        n = L->n;
        memcpy(taken, L->blocks, (size_t)n * sizeof taken[0]);
        L->n = 0;
        L->bytes = 0;
    }
    pthread_mutex_unlock(&L->mu);
    (void)release(dev, taken, n);
}

/* Whether `s`, a stream a DLPack consumer named, still exists whenever the
 * block is freed: the legacy default stream, or dpmini's own slot-0 stream
 * of dev (its DLPack imports name it), never destroyed before exit. */
static int lasting_stream(int dev, dpc_stream s)
{
    dpc_stream own = NULL;
    if (s == NULL || s == DPC_STREAM_PER_THREAD) {
        return 0;
    }
    if (s == DPC_STREAM_LEGACY) {
        return 1;
    }
    return dpc_stream_get(dev, 0, &own).code == 0 && own == s;
}

void dp_gpu_free_exported(int dev, void *p, size_t rounded, dpc_stream consumer)
{
    if (dp_gpu_forked()) {
        return; /* the parent's memory: nothing of it may be touched here */
    }
    if (dev < 0 || dev >= DP_DEFER_DEVS) {
        return;
    }
    if (lasting_stream(dev, consumer)) {
        /* the stream the consumer named: its work on the block is there */
        dpc_status s = dpc_stream_sync(dev, consumer);
        if (s.code == 0) {
            __atomic_add_fetch(&dp_gpu_stat_export_stream_syncs, 1, __ATOMIC_RELAXED);
            dp_gpu_free(dev, p, rounded);
            return;
        }
        /* a failed wait: fall back to a device sync */
    }
    defer_block(dev, p, rounded);
}
