/* test_alloc.c - standalone tests of csrc/core/alloc.c (the caching allocator).
 *
 * Build: cc -std=c11 -O1 -g -Wall -Wextra -Werror -pthread -Icsrc/core \
 *            tests/c/test_alloc.c csrc/core/alloc.c
 * The backend here is malloc with books: every block it hands out is
 * tracked, so the tests can check what the cache holds against what the
 * backend has outstanding, and it can be told to run out of memory.
 * Exit status 0 when every check passes; each failure is printed.
 */
#include "alloc.h"

#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include "check.h"

typedef struct {
    pthread_mutex_t mu;
    size_t live_bytes, live_blocks;   /* outstanding backend blocks */
    size_t cap;                       /* alloc fails past this many live bytes */
    unsigned long allocs, releases;
} fake_backend;

static int fake_alloc(void *ctx, size_t size, void **out, void *err)
{
    fake_backend *f = ctx;
    if (err != NULL) {
        *(int *)err += 1;   /* the caller's pointer reaches the backend */
    }
    pthread_mutex_lock(&f->mu);
    int oom = f->live_bytes + size > f->cap;
    if (!oom) {
        f->live_bytes += size;
        f->live_blocks++;
        f->allocs++;
    }
    pthread_mutex_unlock(&f->mu);
    if (oom) {
        return DP_ALLOC_OOM;
    }
    /* a small real allocation stands for the block: ASan sees misuse */
    *out = malloc(16);
    if (*out == NULL) {
        abort();
    }
    memcpy(*out, &size, sizeof size);   /* the size it was asked for */
    return DP_ALLOC_OK;
}

static void fake_release(void *ctx, void *ptr, size_t size)
{
    fake_backend *f = ctx;
    size_t asked;
    memcpy(&asked, ptr, sizeof asked);
    CHECK(asked == size);   /* released with the size it was allocated with */
    free(ptr);
    pthread_mutex_lock(&f->mu);
    f->live_bytes -= size;
    f->live_blocks--;
    f->releases++;
    pthread_mutex_unlock(&f->mu);
}

static void fake_init(fake_backend *f, size_t cap)
{
    memset(f, 0, sizeof *f);
    pthread_mutex_init(&f->mu, NULL);
    f->cap = cap;
}

static dp_alloc_backend backend_of(fake_backend *f)
{
    dp_alloc_backend be = {fake_alloc, fake_release, f};
    return be;
}

#define MiB ((size_t)1 << 20)

/* ---- size classes ---- */
static void test_classes(void)
{
    CHECK(dp_cache_class(0) == 0 && dp_cache_class(1) == 0 && dp_cache_class(512) == 0);
    CHECK(dp_cache_class_size(0) == 512);
    CHECK(dp_cache_class(513) == 1 && dp_cache_class_size(1) == 640);
    CHECK(dp_cache_class(1024) == 4 && dp_cache_class_size(4) == 1024);
    CHECK(dp_cache_class(1025) == 5 && dp_cache_class_size(5) == 1280);
    CHECK(dp_cache_class_size(-1) == 0 && dp_cache_class_size(DP_ALLOC_NCLASSES) == 0);
    size_t top = ((size_t)1 << 63) + ((size_t)3 << 61);   /* 1.75 * 2^63 */
    CHECK(dp_cache_class(top) == DP_ALLOC_NCLASSES - 1);
    CHECK(dp_cache_class_size(DP_ALLOC_NCLASSES - 1) == top);
    CHECK(dp_cache_class(top + 1) == -1 && dp_cache_class(SIZE_MAX) == -1);
    for (int c = 0; c < DP_ALLOC_NCLASSES; c++) {
        CHECK(dp_cache_class(dp_cache_class_size(c)) == c);
        if (c > 0) {
            CHECK(dp_cache_class_size(c) > dp_cache_class_size(c - 1));
            CHECK(dp_cache_class(dp_cache_class_size(c - 1) + 1) == c);
        }
    }
    for (int i = 0; i < 100000; i++) {
        size_t n = (size_t)(rnd() >> rnd_in(64));
        int c = dp_cache_class(n);
        if (c < 0) {
            CHECK(n > top);
            continue;
        }
        size_t sz = dp_cache_class_size(c);
        CHECK(sz >= n);
        CHECK(n <= 512 ? sz == 512 : sz - n < sz / 5 + 1);   /* < 25% of n wasted */
        CHECK(c == 0 || dp_cache_class_size(c - 1) < n);      /* the smallest fit */
    }
}

/* ---- a freed block is reused for any request of its class ---- */
static void test_reuse(void)
{
    fake_backend f;
    dp_cache c;
    void *p, *q;
    size_t r1, r2;
    int calls = 0;
    fake_init(&f, SIZE_MAX);
    CHECK(dp_cache_init(&c, backend_of(&f), SIZE_MAX, 0) == 0);
    CHECK(dp_cache_alloc(&c, 1000, &p, &r1, &calls) == DP_ALLOC_OK);
    CHECK(r1 == 1024 && calls == 1);
    dp_cache_free(&c, p, r1);
    dp_cache_stats s = dp_cache_get_stats(&c);
    CHECK(s.allocated == 0 && s.cached == 1024 && s.nblocks == 1 && s.peak == 1024);
    CHECK(dp_cache_alloc(&c, 900, &q, &r2, &calls) == DP_ALLOC_OK);
    CHECK(q == p && r2 == 1024 && calls == 1);   /* a hit: no backend call */
    s = dp_cache_get_stats(&c);
    CHECK(s.hits == 1 && s.misses == 1 && s.cached == 0 && s.allocated == 1024);
    dp_cache_free(&c, q, r2);
    dp_cache_destroy(&c);
    CHECK(f.live_blocks == 0 && f.live_bytes == 0);
}

/* ---- a request takes a cached block up to DP_ALLOC_FIT_CLASSES classes up ---- */
static void test_fit_above(void)
{
    fake_backend f;
    dp_cache c;
    void *p5, *p7, *q;
    size_t r5, r7, rq;
    fake_init(&f, SIZE_MAX);
    CHECK(dp_cache_init(&c, backend_of(&f), SIZE_MAX, 0) == 0);
    CHECK(dp_cache_alloc(&c, 1792, &p7, &r7, NULL) == DP_ALLOC_OK && r7 == 1792); /* class 7 */
    CHECK(dp_cache_alloc(&c, 1280, &p5, &r5, NULL) == DP_ALLOC_OK && r5 == 1280); /* class 5 */
    dp_cache_free(&c, p7, r7);
    dp_cache_free(&c, p5, r5);
    CHECK(dp_cache_alloc(&c, 1000, &q, &rq, NULL) == DP_ALLOC_OK);   /* class 4 */
    CHECK(q == p5 && rq == 1280);            /* one class up: taken, its size reported */
    CHECK(dp_cache_get_stats(&c).allocated == 1280);
    dp_cache_free(&c, q, rq);
    CHECK(dp_cache_alloc(&c, 1024, &q, &rq, NULL) == DP_ALLOC_OK);
    CHECK(q == p5 && rq == 1280);            /* the smallest fitting class first */
    void *q2;
    size_t rq2;
    CHECK(dp_cache_alloc(&c, 1024, &q2, &rq2, NULL) == DP_ALLOC_OK);
    CHECK(q2 != p7 && rq2 == 1024);          /* three classes up: not taken, a miss */
    dp_cache_free(&c, q, rq);
    dp_cache_free(&c, q2, rq2);
    dp_cache_destroy(&c);
    CHECK(f.live_blocks == 0);
}

/* ---- slack: the cache may hold that much above the peak ---- */
static void test_slack(void)
{
    fake_backend f;
    dp_cache c;
    void *p;
    size_t r;
    fake_init(&f, SIZE_MAX);
    CHECK(dp_cache_init(&c, backend_of(&f), SIZE_MAX, 4 * MiB) == 0);
    for (int i = 1; i <= 8; i++) {   /* one live block at a time, 8 classes */
        CHECK(dp_cache_alloc(&c, (size_t)i * MiB / 2, &p, &r, NULL) == DP_ALLOC_OK);
        dp_cache_free(&c, p, r);
    }
    dp_cache_stats s = dp_cache_get_stats(&c);
    CHECK(s.peak == 4 * MiB && s.cached == 7 * MiB + MiB / 2);   /* 4 + 3.5 MiB kept */
    CHECK(s.cached > s.peak && s.cached <= s.peak + 4 * MiB && s.nblocks == 2);
    dp_cache_destroy(&c);
    CHECK(f.live_blocks == 0);
}

/* ---- the cache holds at most min(limit, peak): oldest blocks go first ---- */
static void test_bound(void)
{
    fake_backend f;
    dp_cache c;
    void *a, *b, *d;
    size_t ra, rb, rd;
    fake_init(&f, SIZE_MAX);
    CHECK(dp_cache_init(&c, backend_of(&f), SIZE_MAX, 0) == 0);
    CHECK(dp_cache_alloc(&c, MiB, &a, &ra, NULL) == DP_ALLOC_OK);
    dp_cache_free(&c, a, ra);                       /* peak 1 MiB, cached 1 MiB */
    CHECK(dp_cache_alloc(&c, MiB / 2, &b, &rb, NULL) == DP_ALLOC_OK);
    CHECK(dp_cache_get_stats(&c).peak == MiB);      /* 1.5 MiB would be 2 blocks */
    dp_cache_free(&c, b, rb);                       /* evicts the older 1 MiB */
    dp_cache_stats s = dp_cache_get_stats(&c);
    CHECK(s.cached == MiB / 2 && s.nblocks == 1 && s.evictions == 1);
    CHECK(f.live_bytes == MiB / 2);
    /* the hard limit: nothing larger than it is cached */
    dp_cache_set_limit(&c, MiB / 4);
    CHECK(dp_cache_get_stats(&c).cached == 0 && f.live_bytes == 0);
    CHECK(dp_cache_alloc(&c, MiB / 8, &d, &rd, NULL) == DP_ALLOC_OK);
    dp_cache_free(&c, d, rd);
    CHECK(dp_cache_get_stats(&c).cached == MiB / 8);
    dp_cache_set_limit(&c, 0);                      /* 0: no caching */
    CHECK(dp_cache_get_stats(&c).cached == 0 && f.live_blocks == 0);
    CHECK(dp_cache_alloc(&c, 100, &d, &rd, NULL) == DP_ALLOC_OK);
    dp_cache_free(&c, d, rd);
    CHECK(f.live_blocks == 0);
    dp_cache_destroy(&c);
}

/* ---- a backend out of memory: the cache is freed and it is retried ---- */
static void test_oom_retry(void)
{
    fake_backend f;
    dp_cache c;
    void *p[4], *q;
    size_t r[4], rq;
    fake_init(&f, 4 * MiB);
    CHECK(dp_cache_init(&c, backend_of(&f), SIZE_MAX, 0) == 0);
    for (int i = 0; i < 4; i++) {
        CHECK(dp_cache_alloc(&c, MiB, &p[i], &r[i], NULL) == DP_ALLOC_OK);
    }
    CHECK(dp_cache_alloc(&c, MiB, &q, &rq, NULL) == DP_ALLOC_OOM);   /* 4 live: full */
    for (int i = 0; i < 4; i++) {
        dp_cache_free(&c, p[i], r[i]);
    }
    CHECK(dp_cache_get_stats(&c).cached == 4 * MiB);
    /* 2 MiB is another class: the backend is full of cached 1 MiB blocks */
    CHECK(dp_cache_alloc(&c, 2 * MiB, &q, &rq, NULL) == DP_ALLOC_OK);
    CHECK(dp_cache_get_stats(&c).cached == 0 && f.live_bytes == 2 * MiB);
    dp_cache_forget(&c, rq);   /* leaked on purpose: not released, not cached */
    CHECK(dp_cache_get_stats(&c).allocated == 0 && f.live_bytes == 2 * MiB);
    fake_release(&f, q, rq);
    dp_cache_destroy(&c);
    CHECK(f.live_bytes == 0);
}

/* ---- random alloc/free sequences keep the books straight ---- */
#define NLIVE 64
static void check_books(dp_cache *c, fake_backend *f, size_t live_rounded, size_t limit,
                        size_t slack)
{
    dp_cache_stats s = dp_cache_get_stats(c);
    CHECK(s.allocated == live_rounded);
    CHECK(s.allocated + s.cached == f->live_bytes);
    CHECK(s.cached <= limit && s.cached <= s.peak + slack);
    CHECK(s.allocated <= s.peak);
}

static void test_random_sequences(void)
{
    rng_state = 12345;
    for (int round = 0; round < 50; round++) {
        fake_backend f;
        dp_cache c;
        void *ptr[NLIVE] = {0};
        size_t rounded[NLIVE] = {0}, live = 0;
        size_t limit = round % 5 == 0 ? 0 : (size_t)rnd_in(64) * MiB;
        fake_init(&f, round % 3 == 0 ? 32 * MiB : SIZE_MAX);
        size_t slack = round % 2 ? 0 : (size_t)rnd_in(8) * MiB;
        CHECK(dp_cache_init(&c, backend_of(&f), limit, slack) == 0);
        for (int op = 0; op < 2000; op++) {
            int i = (int)rnd_in(NLIVE);
            if (ptr[i] == NULL) {
                size_t n = (size_t)rnd_in(4 * MiB) >> rnd_in(12);
                int rc = dp_cache_alloc(&c, n, &ptr[i], &rounded[i], NULL);
                if (rc == DP_ALLOC_OK) {
                    CHECK(rounded[i] >= n);
                    CHECK(dp_cache_class(rounded[i]) <= dp_cache_class(n) + DP_ALLOC_FIT_CLASSES);
                    for (int j = 0; j < NLIVE; j++) {
                        CHECK(j == i || ptr[j] != ptr[i]);   /* never handed out twice */
                    }
                    live += rounded[i];
                } else {
                    CHECK(rc == DP_ALLOC_OOM && f.cap != SIZE_MAX);
                    ptr[i] = NULL;
                }
            } else {
                dp_cache_free(&c, ptr[i], rounded[i]);
                live -= rounded[i];
                ptr[i] = NULL;
            }
            if (op % 97 == 0) {
                dp_cache_empty(&c);
                CHECK(dp_cache_get_stats(&c).cached == 0);
            }
            check_books(&c, &f, live, limit, slack);
        }
        for (int i = 0; i < NLIVE; i++) {
            if (ptr[i] != NULL) {
                dp_cache_free(&c, ptr[i], rounded[i]);
            }
        }
        dp_cache_destroy(&c);
        CHECK(f.live_blocks == 0);
    }
}

/* ---- many threads on one cache ---- */
typedef struct {
    dp_cache *c;
    uint64_t seed;
} thread_arg;

static void *hammer(void *p)
{
    thread_arg *a = p;
    uint64_t s = a->seed;
    void *ptr[8] = {0};
    size_t r[8];
    for (int op = 0; op < 20000; op++) {
        s ^= s >> 12;
        s ^= s << 25;
        s ^= s >> 27;
        uint64_t x = s * 0x2545F4914F6CDD1Dull;
        int i = (int)(x % 8);
        if (ptr[i] == NULL) {
            if (dp_cache_alloc(a->c, (size_t)(x >> 40) % 100000, &ptr[i], &r[i], NULL)) {
                ptr[i] = NULL;
            }
        } else {
            dp_cache_free(a->c, ptr[i], r[i]);
            ptr[i] = NULL;
        }
    }
    for (int i = 0; i < 8; i++) {
        if (ptr[i] != NULL) {
            dp_cache_free(a->c, ptr[i], r[i]);
        }
    }
    return NULL;
}

static void test_threads(void)
{
    fake_backend f;
    dp_cache c;
    pthread_t t[4];
    thread_arg a[4];
    fake_init(&f, SIZE_MAX);
    CHECK(dp_cache_init(&c, backend_of(&f), 4 * MiB, 0) == 0);
    for (int i = 0; i < 4; i++) {
        a[i].c = &c;
        a[i].seed = 0x1234567ull * (uint64_t)(i + 1);
        CHECK(pthread_create(&t[i], NULL, hammer, &a[i]) == 0);
    }
    for (int i = 0; i < 4; i++) {
        pthread_join(t[i], NULL);
    }
    dp_cache_stats s = dp_cache_get_stats(&c);
    CHECK(s.allocated == 0 && s.cached == f.live_bytes && s.cached <= 4 * MiB);
    CHECK(s.hits + s.misses > 0 && s.hits > 0);
    dp_cache_destroy(&c);
    CHECK(f.live_blocks == 0);
}

int main(void)
{
    test_classes();
    test_reuse();
    test_fit_above();
    test_slack();
    test_bound();
    test_oom_retry();
    test_random_sequences();
    test_threads();
    if (failures) {
        printf("test_alloc: %d failure(s)\n", failures);
        return 1;
    }
    printf("test_alloc: all passed\n");
    return 0;
}
