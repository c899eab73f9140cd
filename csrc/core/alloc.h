/* alloc.h - the caching allocator: one cache per device, pure C (no Python.h).
 *
 * A cache hands out blocks from a backend (two callbacks: host memory for
 * virtual CPU devices and the host, device memory through cuda_api.h for
 * GPUs) and keeps freed blocks for reuse, like PyTorch's CUDA caching
 * allocator. Without a cache every scatter of a large array would map fresh
 * pages and pay a page fault per 4 KiB, which costs more than the copy.
 *
 * Size classes: a request is rounded up to its class, 512 bytes for the
 * smallest and then four classes per power of two (2^k, 1.25 * 2^k,
 * 1.5 * 2^k, 1.75 * 2^k), so rounding wastes less than 25%. A request takes
 * a cached block of its own class, else of one of the DP_ALLOC_FIT_CLASSES
 * classes above it (at most 1.5x its class size), so a variable-size
 * workload reuses blocks across nearby sizes. Lookup is constant time: one
 * free list per class, at most 1 + DP_ALLOC_FIT_CLASSES lists looked at.
 *
 * Bound: the cache holds at most min(limit, peak + slack) bytes, where limit
 * is the hard limit ($DPMINI_CACHE_LIMIT), peak the most bytes ever handed
 * out at once by this cache, and slack a small constant given at init (so
 * a workload whose peak is one block still keeps a few sizes). Memory in use
 * is then at most live + peak + slack <= 2 * peak + slack: a freed block
 * that does not fit evicts the least recently cached blocks first. A miss
 * whose backend allocation fails frees the whole cache and tries again.
 *
 * Locking: one mutex per cache (so per device); the backend is called
 * without it held. Thread-safe; not fork-safe while a call is in flight.
 */
#ifndef DPMINI_ALLOC_H
#define DPMINI_ALLOC_H

#include <pthread.h>
#include <stddef.h>

/* Classes: index 0 is 512 bytes; then 4 per power of two from 2^9 up. */
#define DP_ALLOC_MIN 512
#define DP_ALLOC_NCLASSES (4 * (64 - 9))
#define DP_ALLOC_FIT_CLASSES 2   /* a hit may take a block this many classes up */

/* Backend results. */
#define DP_ALLOC_OK 0
#define DP_ALLOC_OOM 1   /* out of memory: the cache is freed and it is retried once */

/* The memory a cache hands out. alloc returns DP_ALLOC_OK with *out set, or
 * DP_ALLOC_OOM, or another non-zero code that dp_cache_alloc returns as is.
 * err is the pointer given to dp_cache_alloc (a place for backend details,
 * e.g. a dpc_status); ctx is the backend's own. release must accept every
 * block alloc returned, with the size it was asked for. Neither is called
 * with the cache's mutex held. */
typedef struct {
    int (*alloc)(void *ctx, size_t size, void **out, void *err);
    void (*release)(void *ctx, void *ptr, size_t size);
    void *ctx;
} dp_alloc_backend;

typedef struct dp_cblock dp_cblock;   /* a cached block (alloc.c) */

typedef struct {
    size_t allocated;        /* bytes handed out and not freed (class sizes)   */
    size_t cached;           /* bytes held for reuse                           */
    size_t peak;             /* most bytes ever allocated at once              */
    size_t nblocks;          /* blocks held for reuse                          */
    size_t limit, slack;     /* the bound's parameters (see above)             */
    unsigned long long hits, misses, evictions;
} dp_cache_stats;

typedef struct {
    pthread_mutex_t mu;
    dp_alloc_backend be;
    size_t limit;                           /* hard limit on cached bytes */
    size_t slack;                           /* cached bytes allowed above peak */
    dp_cblock *bins[DP_ALLOC_NCLASSES];     /* per class, most recent first */
    dp_cblock *lru_old, *lru_new;           /* every cached block, by age */
    dp_cblock *spare;                       /* unused nodes, chained by next */
    int nspare;                             /* their number (<= DP_ALLOC_SPARE) */
    dp_cache_stats st;
} dp_cache;

/* Class of a request (0 up to 512 bytes), or -1 when it is too large to
 * round (> 1.75 * 2^63). */
int dp_cache_class(size_t nbytes);
/* Size of a class, bytes (0 for an index out of range). */
size_t dp_cache_class_size(int cls);

/* Returns 0, or an errno value when the mutex cannot be made. */
int dp_cache_init(dp_cache *c, dp_alloc_backend be, size_t limit, size_t slack);
/* Frees every cached block; live blocks must have been freed already
 * (or are leaked to the backend's owner). */
void dp_cache_destroy(dp_cache *c);

/* Allocate nbytes: the block's size (its class size, nbytes rounded up to
 * its class or, for a cached block of a class above, that class's size) in
 * *rounded.
 * Returns DP_ALLOC_OK with *out set, DP_ALLOC_OOM when the backend is out of
 * memory even after the cache was freed (or the size cannot be rounded), or
 * the backend's own code. */
int dp_cache_alloc(dp_cache *c, size_t nbytes, void **out, size_t *rounded, void *err);
/* Give back a block from dp_cache_alloc with its *rounded size: cached when
 * it fits the bound, else returned to the backend. */
void dp_cache_free(dp_cache *c, void *ptr, size_t rounded);
/* Forget a live block without caching or releasing it (its memory may still
 * be in use elsewhere and is leaked on purpose). */
void dp_cache_forget(dp_cache *c, size_t rounded);
/* Return every cached block to the backend. */
void dp_cache_empty(dp_cache *c);
/* Change the hard limit; cached blocks beyond it are released. */
void dp_cache_set_limit(dp_cache *c, size_t limit);
dp_cache_stats dp_cache_get_stats(dp_cache *c);

#endif
