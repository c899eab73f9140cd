/* alloc.c - the caching allocator declared in alloc.h.
 *
 * Each cached block has a node (malloc'ed here; the block itself may be
 * device memory that the host cannot write) on two doubly linked lists: its
 * class's bin (most recently cached first, so a hit reuses warm memory) and
 * the cache's age list (oldest first, the eviction order). Every operation
 * is O(1) apart from evictions, which are O(blocks evicted). Backend calls
 * and free() of nodes happen after the mutex is released: evicted blocks
 * are collected on a private list first. A few unused nodes are kept for
 * reuse (a block handed out gives its node back; a block cached takes one),
 * so the usual alloc / free pair calls neither malloc nor free.
 */
#include "alloc.h"

#include <stdint.h>
#include <stdlib.h>

#define DP_ALLOC_SPARE 64   /* unused nodes a cache keeps */

struct dp_cblock {
    dp_cblock *prev, *next;          /* bin list                     */
    dp_cblock *older, *newer;        /* age list                     */
    void *ptr;
    size_t size;                     /* class size                   */
    int cls;
};

int dp_cache_class(size_t nbytes)
{
    if (nbytes <= DP_ALLOC_MIN) {
        return 0;
    }
    int k = 63 - __builtin_clzll((unsigned long long)nbytes);   /* 2^k <= n, k >= 9 */
    size_t base = (size_t)1 << k, step = base >> 2;
    size_t j = (nbytes - base + step - 1) / step;                /* 0..4 */
    if (j == 4) {
        if (k == 63) {
            return -1;
        }
        k++;
        j = 0;
    }
    return 4 * (k - 9) + (int)j;
}

size_t dp_cache_class_size(int cls)
{
    if (cls < 0 || cls >= DP_ALLOC_NCLASSES) {
        return 0;
    }
    int k = 9 + cls / 4;
    size_t base = (size_t)1 << k;
    return base + (size_t)(cls % 4) * (base >> 2);
}

int dp_cache_init(dp_cache *c, dp_alloc_backend be, size_t limit, size_t slack)
{
    int rc = pthread_mutex_init(&c->mu, NULL);
    if (rc) {
        return rc;
    }
    c->be = be;
    c->limit = limit;
    c->slack = slack;
    for (int i = 0; i < DP_ALLOC_NCLASSES; i++) {
        c->bins[i] = NULL;
    }
    c->lru_old = c->lru_new = NULL;
    c->spare = NULL;
    c->nspare = 0;
    c->st = (dp_cache_stats){0};
    return 0;
}

/* Keep node b for reuse: 1, or 0 when enough are kept (free it after
 * unlocking). Mutex held. */
static int keep_node(dp_cache *c, dp_cblock *b)
{
    if (c->nspare >= DP_ALLOC_SPARE) {
        return 0;
    }
    b->next = c->spare;
    c->spare = b;
    c->nspare++;
    return 1;
}

/* Unlink b from its bin and the age list; mutex held. */
static void unlink_block(dp_cache *c, dp_cblock *b)
{
    if (b->prev) {
        b->prev->next = b->next;
    } else {
        c->bins[b->cls] = b->next;
    }
    if (b->next) {
        b->next->prev = b->prev;
    }
    if (b->older) {
        b->older->newer = b->newer;
    } else {
        c->lru_old = b->newer;
    }
    if (b->newer) {
        b->newer->older = b->older;
    } else {
        c->lru_new = b->older;
    }
    c->st.cached -= b->size;
    c->st.nblocks--;
}

/* Evict the oldest blocks until cached + extra <= bound; they are chained
 * through ->next onto *out for release after unlocking. Mutex held. */
static void evict_to(dp_cache *c, size_t bound, size_t extra, dp_cblock **out)
{
    while (c->lru_old != NULL && (c->st.cached + extra > bound || extra > bound)) {
        dp_cblock *b = c->lru_old;
        unlink_block(c, b);
        b->next = *out;
        *out = b;
        c->st.evictions++;
    }
}

/* Release a chain built by evict_to; mutex not held. */
static void release_chain(dp_cache *c, dp_cblock *b)
{
    while (b != NULL) {
        dp_cblock *next = b->next;
        c->be.release(c->be.ctx, b->ptr, b->size);
        free(b);
        b = next;
    }
}

static size_t bound_of(const dp_cache *c)
{
    size_t soft = c->st.peak + c->slack;
    if (soft < c->st.peak) {
        soft = SIZE_MAX;   /* overflow */
    }
    return c->limit < soft ? c->limit : soft;
}

int dp_cache_alloc(dp_cache *c, size_t nbytes, void **out, size_t *rounded, void *err)
{
    int cls = dp_cache_class(nbytes);
    if (cls < 0) {
        return DP_ALLOC_OOM;
    }
    size_t size = dp_cache_class_size(cls);
    pthread_mutex_lock(&c->mu);
    dp_cblock *b = NULL;
    for (int k = cls; k <= cls + DP_ALLOC_FIT_CLASSES && k < DP_ALLOC_NCLASSES; k++) {
        if (c->bins[k] != NULL) {
            b = c->bins[k];
            break;
        }
    }
    if (b != NULL) {
        size = b->size;
        unlink_block(c, b);
        c->st.hits++;
        c->st.allocated += size;
        if (c->st.allocated > c->st.peak) {
            c->st.peak = c->st.allocated;
        }
        *out = b->ptr;
        *rounded = size;
        int kept = keep_node(c, b);
        pthread_mutex_unlock(&c->mu);
        if (!kept) {
            free(b);
        }
        return DP_ALLOC_OK;
    }
    c->st.misses++;
    pthread_mutex_unlock(&c->mu);

    void *p = NULL;
    int rc = c->be.alloc(c->be.ctx, size, &p, err);
    if (rc == DP_ALLOC_OOM) {
        dp_cache_empty(c);   /* as PyTorch: free the cache, try once more */
        rc = c->be.alloc(c->be.ctx, size, &p, err);
    }
    if (rc != DP_ALLOC_OK) {
        return rc;
    }
    pthread_mutex_lock(&c->mu);
    c->st.allocated += size;
    if (c->st.allocated > c->st.peak) {
        c->st.peak = c->st.allocated;
    }
    pthread_mutex_unlock(&c->mu);
    *out = p;
    *rounded = size;
    return DP_ALLOC_OK;
}

void dp_cache_free(dp_cache *c, void *ptr, size_t rounded)
{
    int cls = dp_cache_class(rounded);
    dp_cblock *b, *evicted = NULL;
    pthread_mutex_lock(&c->mu);
    b = c->spare;
    if (b != NULL) {
        c->spare = b->next;
        c->nspare--;
    } else {   /* no node kept: make one without holding the mutex */
        pthread_mutex_unlock(&c->mu);
        b = malloc(sizeof *b);
        pthread_mutex_lock(&c->mu);
    }
    c->st.allocated -= rounded;
    size_t bound = bound_of(c);
    if (b != NULL && cls >= 0 && rounded <= bound) {
        evict_to(c, bound, rounded, &evicted);
        b->ptr = ptr;
        b->size = rounded;
        b->cls = cls;
        b->prev = NULL;
        b->next = c->bins[cls];
        if (b->next) {
            b->next->prev = b;
        }
        c->bins[cls] = b;
        b->older = c->lru_new;
        b->newer = NULL;
        if (c->lru_new) {
            c->lru_new->newer = b;
        } else {
            c->lru_old = b;
        }
        c->lru_new = b;
        c->st.cached += rounded;
        c->st.nblocks++;
        b = NULL;
        ptr = NULL;
    }
    if (b != NULL && keep_node(c, b)) {
        b = NULL;
    }
    pthread_mutex_unlock(&c->mu);
    release_chain(c, evicted);
    free(b);
    if (ptr != NULL) {
        c->be.release(c->be.ctx, ptr, rounded);
    }
}

void dp_cache_forget(dp_cache *c, size_t rounded)
{
    pthread_mutex_lock(&c->mu);
    c->st.allocated -= rounded;
    pthread_mutex_unlock(&c->mu);
}

void dp_cache_empty(dp_cache *c)
{
    dp_cblock *evicted = NULL;
    pthread_mutex_lock(&c->mu);
    evict_to(c, 0, 1, &evicted);
    pthread_mutex_unlock(&c->mu);
    release_chain(c, evicted);
}

void dp_cache_set_limit(dp_cache *c, size_t limit)
{
    dp_cblock *evicted = NULL;
    pthread_mutex_lock(&c->mu);
    c->limit = limit;
    evict_to(c, bound_of(c), 0, &evicted);
    pthread_mutex_unlock(&c->mu);
    release_chain(c, evicted);
}

dp_cache_stats dp_cache_get_stats(dp_cache *c)
{
    pthread_mutex_lock(&c->mu);
    dp_cache_stats s = c->st;
    s.limit = c->limit;
    s.slack = c->slack;
    pthread_mutex_unlock(&c->mu);
    return s;
}

void dp_cache_destroy(dp_cache *c)
{
    dp_cache_empty(c);
    while (c->spare != NULL) {
        dp_cblock *next = c->spare->next;
        free(c->spare);
        c->spare = next;
    }
    c->nspare = 0;
    pthread_mutex_destroy(&c->mu);
}
