/* fuzz_core.c - libFuzzer harness over the pure-C core: plan.c, copy.c and
 * alloc.c.
 *
 * Build and run: `make fuzz` (clang -fsanitize=fuzzer,address,undefined),
 * FUZZ_SECONDS=60 by default; seeds in fuzz/corpus/. The same file also
 * builds without libFuzzer against fuzz/replay.c, which runs every corpus
 * file once (tests/test_fuzz_corpus.py does that in `make test`).
 *
 * The first input byte picks a target; the rest is read by a little byte
 * reader that yields zeros once the input is used up:
 *   0 dp_chunk_sizes       vs a 128-bit reference of torch.chunk
 *   1 dp_check_chunk_sizes vs a 128-bit reference of split_with_sizes
 *   2 dp_wrap_dim          vs the definition
 *   3 copies: random shapes, itemsizes and layouts (permuted, padded, steps
 *     of +-1/+-2, zero source strides, junk strides on size-1 dims). The
 *     copy is run unsimplified, simplified and cut into 1..6 parts with
 *     dp_copy_part; each time the whole destination buffer, including guard
 *     bytes and the gaps between elements, must equal what a naive
 *     element-by-element reference wrote. Buffers are malloc'ed at their
 *     exact size, so ASan flags any read or write outside them. Also checks
 *     dp_layout_is_dense and dp_dense_strides on both layouts.
 *   4 dp_layout_is_dense / dp_dense_strides on arbitrary shapes and strides
 *     (no buffer): no UB, and when it says dense, the strides it implies are
 *     the input's.
 *   5 the caching allocator (alloc.c; first byte 250..255, so that the
 *     older seeds keep their targets): a sequence of alloc / free / empty /
 *     set_limit on a book-keeping backend that may run out of memory. After
 *     every step the cache's counts must match the live blocks and what the
 *     backend has outstanding, the cache must hold at most
 *     min(limit, peak + slack), a block must be of the request's class or
 *     at most DP_ALLOC_FIT_CLASSES above,
 *     no block may be handed out twice, and at the end every backend block
 *     must have been released with the size it was allocated with.
 * Every broken invariant calls fail(), which prints and aborts, so libFuzzer
 * records the input as a crash.
 */
#include "plan.h"
#include "copy.h"
#include "alloc.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define GUARD 32
#define MAX_BYTES (1 << 16)   /* per buffer; bigger layouts are skipped */

static void fail(const char *what, int line)
{
    fprintf(stderr, "fuzz_core.c:%d: invariant broken: %s\n", line, what);
    abort();
}
#define CHECK(c) do { if (!(c)) fail(#c, __LINE__); } while (0)

/* ------------------------------------------------------------------ */
/* Byte reader                                                        */
/* ------------------------------------------------------------------ */

typedef struct {
    const uint8_t *p;
    size_t n;
} reader;

static uint8_t u8(reader *r)
{
    if (r->n == 0)
        return 0;
    r->n--;
    return *r->p++;
}

static uint64_t u64(reader *r)
{
    uint64_t v = 0;
    for (int i = 0; i < 8; i++)
        v = v << 8 | u8(r);
    return v;
}

/* An int64 that is usually interesting: small, near a power of two, or at
 * the ends of the range. */
static int64_t i64(reader *r)
{
    uint8_t kind = u8(r);
    switch (kind % 8) {
    case 0: return (int64_t)u8(r) - 8;
    case 1: return (int64_t)(u8(r) | (uint64_t)u8(r) << 8);
    case 2: return INT64_MAX - (int64_t)u8(r);
    case 3: return INT64_MIN + (int64_t)u8(r);
    case 4: return ((int64_t)1 << (u8(r) % 63)) + (int64_t)(int8_t)u8(r);
    case 5: return -((int64_t)1 << (u8(r) % 63));
    default: return (int64_t)u64(r);
    }
}

/* ------------------------------------------------------------------ */
/* 0-2: plan.c                                                        */
/* ------------------------------------------------------------------ */

static void fuzz_chunk_sizes(reader *r)
{
    int64_t n = i64(r);
    int k = (int)(u8(r) | (u8(r) & 1) << 8) - 2;   /* -2 .. 509 */
    if (k < 1 || n < 0) {
        int64_t dummy[1];
        CHECK(dp_chunk_sizes(n, k, dummy) == DP_ERR_ARG);
        return;
    }
    if (k > DP_MAX_DEVICES)
        k = DP_MAX_DEVICES;
    int64_t *sizes = malloc((size_t)k * sizeof *sizes);   /* exact: ASan checks */
    if (sizes == NULL)
        return;
    int count = dp_chunk_sizes(n, k, sizes);
    CHECK(count >= 1 && count <= k);
    if (n == 0) {
        CHECK(count == k);
        for (int i = 0; i < k; i++)
            CHECK(sizes[i] == 0);
        free(sizes);
        return;
    }
    /* reference: split = ceil(n / k), count = ceil(n / split) */
    __int128 split = ((__int128)n + k - 1) / k;
    __int128 rcount = ((__int128)n + split - 1) / split;
    CHECK(count == (int)rcount);
    __int128 sum = 0;
    for (int i = 0; i < k; i++) {
        if (i < count - 1)
            CHECK(sizes[i] == split);
        else if (i == count - 1)
            CHECK(sizes[i] >= 1 && sizes[i] <= split);
        else
            CHECK(sizes[i] == 0);
        sum += sizes[i];
    }
    CHECK(sum == n);
    free(sizes);
}

static void fuzz_check_chunk_sizes(reader *r)
{
    int64_t n = i64(r);
    int k = (int)(u8(r) % 20) - 1;   /* -1 .. 18 */
    int64_t *sizes = calloc((size_t)(k > 0 ? k : 1), sizeof *sizes);
    if (sizes == NULL)
        return;
    /* Often make the sizes a valid split of n and then maybe disturb one. */
    int valid = u8(r) & 1;
    for (int i = 0; i < k; i++)
        sizes[i] = i64(r);
    if (valid && k >= 1 && n >= 0) {
        int64_t left = n;
        for (int i = 0; i < k - 1; i++) {
            sizes[i] = left == 0 ? 0 : (int64_t)(u64(r) % (uint64_t)left);
            left -= sizes[i];
        }
        sizes[k - 1] = left;
        if (u8(r) & 1) {   /* off by -2..2, wrapping like the unsigned it is */
            int j = u8(r) % k;
            sizes[j] = (int64_t)((uint64_t)sizes[j] + (uint64_t)(int64_t)((int8_t)u8(r) % 3));
        }
    }
    int bad = 12345;
    int rc = dp_check_chunk_sizes(n, k, sizes, &bad);
    if (n < 0 || k < 1) {
        CHECK(rc == DP_ERR_ARG && bad == -1);
        free(sizes);
        return;
    }
    int neg = -1;
    __int128 sum = 0;
    for (int i = 0; i < k; i++) {
        if (sizes[i] < 0 && neg < 0)
            neg = i;
        sum += sizes[i];
    }
    if (neg >= 0)
        CHECK(rc == DP_ERR_NEGATIVE_SIZE && bad == neg);
    else if (sum != n)
        CHECK(rc == DP_ERR_SIZE_SUM && bad == -1);
    else
        CHECK(rc == DP_OK && bad == -1);
    CHECK(dp_check_chunk_sizes(n, k, sizes, NULL) == rc);   /* NULL bad_index is fine */
    free(sizes);
}

static void fuzz_wrap_dim(reader *r)
{
    int dim = (int)(uint32_t)u64(r);
    int ndim = (int)(uint32_t)u64(r);
    if (u8(r) & 1) {   /* mostly small values */
        dim = (int)(int8_t)u8(r) % 70;
        ndim = (int)(int8_t)u8(r) % 70;
    }
    int got = dp_wrap_dim(dim, ndim);
    long long d = dim, nd = ndim;
    if (nd < 1 || d < -nd || d >= nd)
        CHECK(got == DP_ERR_ARG);
    else
        CHECK(got == (d < 0 ? d + nd : d) && got >= 0 && got < ndim);
}

/* ------------------------------------------------------------------ */
/* 3: copies                                                          */
/* ------------------------------------------------------------------ */

typedef struct {
    int64_t strides[DP_MAXDIMS];   /* bytes                                 */
    int64_t origin;                /* byte offset of element [0,...,0]      */
    size_t bytes;                  /* buffer size                           */
} layout;

/* A strided view of `shape` into a fresh buffer: dims get extents ext[d] in
 * a random memory order, the view walks each with step +-1 or +-2 (0 for a
 * broadcast source dim) from a random start inside the extent. Returns 0,
 * or -1 when the buffer would be larger than MAX_BYTES. */
static int make_layout(reader *r, int nd, const int64_t *shape, size_t item,
                       int allow_zero, layout *out)
{
    int order[DP_MAXDIMS];
    int64_t ext[DP_MAXDIMS], step[DP_MAXDIMS], start[DP_MAXDIMS], mstride[DP_MAXDIMS];
    for (int d = 0; d < nd; d++)
        order[d] = d;
    for (int d = nd - 1; d > 0; d--) {   /* Fisher-Yates from input bytes */
        int j = u8(r) % (d + 1);
        int t = order[d];
        order[d] = order[j];
        order[j] = t;
    }
    for (int d = 0; d < nd; d++) {
        static const int steps[] = {1, 1, -1, 2, -2, 0};
        uint8_t b = u8(r);
        step[d] = steps[b % (allow_zero ? 6 : 5)];
        int64_t span = shape[d] == 0 ? 1 : (step[d] == 0 ? 1 : (shape[d] - 1) * (step[d] < 0 ? -step[d] : step[d]) + 1);
        int64_t pad = (b >> 3) % 3;
        ext[d] = span + pad;
        int64_t off = pad ? (b >> 5) % (pad + 1) : 0;
        start[d] = step[d] < 0 ? ext[d] - 1 - off : off;
    }
    /* memory strides: innermost in `order` is contiguous */
    uint64_t acc = item;
    for (int i = nd - 1; i >= 0; i--) {
        int d = order[i];
        mstride[d] = (int64_t)acc;
        acc *= (uint64_t)ext[d];
        if (acc > MAX_BYTES)
            return -1;
    }
    out->bytes = (size_t)acc;
    out->origin = 0;
    for (int d = 0; d < nd; d++) {
        out->strides[d] = step[d] * mstride[d];
        out->origin += start[d] * mstride[d];
        if (shape[d] == 1 && (u8(r) & 7) == 0)   /* never used: any value */
            out->strides[d] = (int64_t)(int32_t)(uint32_t)u64(r) * 4096;
    }
    return 0;
}

/* dst[i] = src[i] for every index, one element at a time. */
static void reference_copy(int nd, const int64_t *shape, size_t item, char *dst,
                           const int64_t *ds, const char *src, const int64_t *ss)
{
    int64_t idx[DP_MAXDIMS] = {0};
    for (int d = 0; d < nd; d++)
        if (shape[d] == 0)
            return;
    for (;;) {
        int64_t so = 0, dof = 0;
        for (int d = 0; d < nd; d++) {
            so += idx[d] * ss[d];
            dof += idx[d] * ds[d];
        }
        memcpy(dst + dof, src + so, item);
        int d = nd - 1;
        for (; d >= 0; d--) {
            if (++idx[d] < shape[d])
                break;
            idx[d] = 0;
        }
        if (d < 0)
            return;
    }
}

/* Is the layout dense by brute force: strides > 0 on every dim of extent > 1
 * and the element offsets are exactly 0, item, 2*item, ... (size <= 1 dims
 * ignored, as dp_layout_is_dense documents). */
static int reference_dense(int nd, const int64_t *shape, const int64_t *strides, size_t item)
{
    int64_t idx[DP_MAXDIMS] = {0};
    int64_t n = 1;
    for (int d = 0; d < nd; d++) {
        if (shape[d] <= 1)
            continue;
        if (strides[d] <= 0)
            return 0;
        n *= shape[d];
    }
    unsigned char *seen = calloc((size_t)n, 1);
    if (seen == NULL)
        abort();
    int ok = 1;
    for (;;) {
        __int128 off = 0;   /* strides may be anything: no overflow here */
        for (int d = 0; d < nd; d++)
            if (shape[d] > 1)
                off += (__int128)idx[d] * strides[d];
        if (off % (__int128)item != 0 || off / (__int128)item >= n || seen[(int64_t)(off / (__int128)item)]) {
            ok = 0;
            break;
        }
        seen[(int64_t)(off / (__int128)item)] = 1;
        int d = nd - 1;
        for (; d >= 0; d--) {
            if (shape[d] > 1 && ++idx[d] < shape[d])
                break;
            idx[d] = 0;
        }
        if (d < 0)
            break;
    }
    free(seen);
    return ok;
}

static void check_dense(int nd, const int64_t *shape, const int64_t *strides, size_t item)
{
    int perm[DP_MAXDIMS];
    int got = dp_layout_is_dense(nd, shape, strides, item, perm);
    CHECK(got == reference_dense(nd, shape, strides, item));
    CHECK(dp_layout_is_dense(nd, shape, strides, item, NULL) == got);
    if (got) {
        /* perm is a permutation whose dense strides are the input's */
        int used[DP_MAXDIMS] = {0};
        for (int i = 0; i < nd; i++) {
            CHECK(perm[i] >= 0 && perm[i] < nd && !used[perm[i]]);
            used[perm[i]] = 1;
        }
        int64_t back[DP_MAXDIMS];
        dp_dense_strides(nd, shape, item, perm, back);
        for (int d = 0; d < nd; d++)
            if (shape[d] > 1)
                CHECK(back[d] == strides[d]);
    }
}

static void check_desc_invariants(const dp_copy_desc *d, int64_t numel)
{
    CHECK(d->ndim >= 1 && d->ndim <= DP_MAXDIMS);
    CHECK(dp_copy_numel(d) == numel);
    for (int i = 0; i < d->ndim; i++) {
        CHECK(d->shape[i] >= 0);
        if (numel > 1)
            CHECK(d->shape[i] > 1);   /* size-1 dims dropped */
    }
}

static void fuzz_copy(reader *r)
{
    static const size_t items[] = {1, 2, 3, 4, 8, 16, 5, 12, 32, 64, 7, 24};
    int nd = u8(r) % 10;
    if (nd == 9)
        nd = 9 + u8(r) % (DP_MAXDIMS - 8);   /* up to 64 dims, mostly size 1 */
    size_t item = items[u8(r) % 12];
    int64_t shape[DP_MAXDIMS];
    for (int d = 0; d < nd; d++) {
        uint8_t b = u8(r);
        shape[d] = nd > 8 ? (b % 8 == 0 ? 2 : 1) : b % 6;
    }
    dp_copy_desc bad;
    CHECK(dp_copy_init(&bad, -1, item, shape, shape, shape) == -1);
    CHECK(dp_copy_init(&bad, DP_MAXDIMS + 1, item, shape, shape, shape) == -1);
    CHECK(dp_copy_init(&bad, nd, 0, shape, shape, shape) == -1);

    layout sl, dl;
    if (make_layout(r, nd, shape, item, 1, &sl) < 0 || make_layout(r, nd, shape, item, 0, &dl) < 0)
        return;

    int64_t numel = 1;
    for (int d = 0; d < nd; d++)
        numel *= shape[d];

    size_t dbytes = dl.bytes + 2 * GUARD;
    char *src = malloc(sl.bytes);
    char *expect = malloc(dbytes);
    char *got = malloc(dbytes);
    char *init = malloc(dbytes);
    if (!src || !expect || !got || !init)
        abort();
    uint32_t h = 2166136261u ^ (uint32_t)u8(r);
    for (size_t i = 0; i < sl.bytes; i++) {
        h = (h ^ (uint32_t)i) * 16777619u;
        src[i] = (char)(h >> 24);
    }
    for (size_t i = 0; i < dbytes; i++)
        init[i] = (char)(0xA5 ^ (i * 7));
    memcpy(expect, init, dbytes);
    reference_copy(nd, shape, item, expect + GUARD + dl.origin, dl.strides,
                   src + sl.origin, sl.strides);

    dp_copy_desc d, s;
    CHECK(dp_copy_init(&d, nd, item, shape, sl.strides, dl.strides) == 0);
    CHECK(d.ndim == nd && dp_copy_numel(&d) == numel);

    /* 1. as given */
    memcpy(got, init, dbytes);
    dp_copy_run(&d, got + GUARD + dl.origin, src + sl.origin);
    CHECK(memcmp(got, expect, dbytes) == 0);

    /* 2. simplified; simplifying twice changes nothing */
    s = d;
    dp_copy_simplify(&s);
    check_desc_invariants(&s, numel);
    dp_copy_desc s2 = s;
    dp_copy_simplify(&s2);
    CHECK(s2.ndim == s.ndim);
    for (int i = 0; i < s.ndim; i++)
        CHECK(s2.shape[i] == s.shape[i] && s2.src_strides[i] == s.src_strides[i] &&
              s2.dst_strides[i] == s.dst_strides[i]);
    memcpy(got, init, dbytes);
    dp_copy_run(&s, got + GUARD + dl.origin, src + sl.origin);
    CHECK(memcmp(got, expect, dbytes) == 0);
    /* 2b. simplified, streaming stores wherever the runs allow them */
    memcpy(got, init, dbytes);
    dp_copy_run_mode(&s, got + GUARD + dl.origin, src + sl.origin, DP_COPY_STREAM);
    CHECK(memcmp(got, expect, dbytes) == 0);

    /* 3. in parts, of the simplified and of the raw copy */
    int parts = 1 + u8(r) % 6;
    for (int which = 0; which < 2; which++) {
        const dp_copy_desc *whole = which == 0 ? &s : &d;
        int64_t total = 0;
        memcpy(got, init, dbytes);
        for (int p = 0; p < parts; p++) {
            dp_copy_desc piece;
            int64_t so = -1, doff = -1;
            CHECK(dp_copy_part(whole, parts, p, &piece, &so, &doff) == 0);
            int64_t pn = dp_copy_numel(&piece);
            total += pn;
            if (pn > 0)
                dp_copy_run(&piece, got + GUARD + dl.origin + doff, src + sl.origin + so);
        }
        CHECK(total == numel);
        CHECK(memcmp(got, expect, dbytes) == 0);
    }
    dp_copy_desc dummy;
    int64_t a, b;
    CHECK(dp_copy_part(&s, parts, parts, &dummy, &a, &b) == -1);
    CHECK(dp_copy_part(&s, 0, 0, &dummy, &a, &b) == -1);
    CHECK(dp_copy_part(&s, parts, -1, &dummy, &a, &b) == -1);

    /* 4. density of both layouts; a fresh dense layout is dense */
    if (nd > 0) {
        check_dense(nd, shape, sl.strides, item);
        check_dense(nd, shape, dl.strides, item);
        int64_t c[DP_MAXDIMS];
        dp_dense_strides(nd, shape, item, NULL, c);
        CHECK(dp_layout_is_dense(nd, shape, c, item, NULL));
    }

    free(src);
    free(expect);
    free(got);
    free(init);
}

/* ------------------------------------------------------------------ */
/* 4: dp_layout_is_dense on anything                                  */
/* ------------------------------------------------------------------ */

static void fuzz_dense_any(reader *r)
{
    int nd = u8(r) % (DP_MAXDIMS + 2) - 1;   /* -1 .. 64 */
    size_t item = 1 + u8(r) % 16;
    int64_t shape[DP_MAXDIMS] = {0}, strides[DP_MAXDIMS] = {0};
    int small = u8(r) & 1;
    int64_t numel = 1;
    for (int d = 0; d < nd; d++) {
        shape[d] = small ? u8(r) % 5 : i64(r);
        if (shape[d] < 0)
            shape[d] = -(shape[d] + 1);   /* shapes are >= 0 */
        strides[d] = small ? ((int64_t)(int8_t)u8(r)) * (int64_t)item : i64(r);
        if (shape[d] > 1)
            numel = numel > (1 << 12) / shape[d] ? (1 << 13) : numel * shape[d];
    }
    int perm[DP_MAXDIMS];
    int got = dp_layout_is_dense(nd, shape, strides, item, perm);
    if (nd < 0) {
        CHECK(got == 0);
        return;
    }
    if (numel <= (1 << 12))
        check_dense(nd, shape, strides, item);
    else if (got) {
        int64_t back[DP_MAXDIMS];
        dp_dense_strides(nd, shape, item, perm, back);
        for (int d = 0; d < nd; d++)
            if (shape[d] > 1)
                CHECK(back[d] == strides[d]);
    }
}

/* ------------------------------------------------------------------ */
/* 5: the caching allocator                                            */
/* ------------------------------------------------------------------ */

typedef struct {
    size_t live_bytes, live_blocks, cap;
} books;

static int books_alloc(void *ctx, size_t size, void **out, void *err)
{
    books *b = ctx;
    (void)err;
    if (size > b->cap || b->live_bytes > b->cap - size)
        return DP_ALLOC_OOM;
    size_t *p = malloc(sizeof *p);   /* a token standing for the block */
    CHECK(p != NULL);
    *p = size;
    b->live_bytes += size;
    b->live_blocks++;
    *out = p;
    return DP_ALLOC_OK;
}

static void books_release(void *ctx, void *ptr, size_t size)
{
    books *b = ctx;
    CHECK(*(size_t *)ptr == size);
    CHECK(b->live_blocks > 0 && b->live_bytes >= size);
    b->live_bytes -= size;
    b->live_blocks--;
    free(ptr);
}

#define FUZZ_SLOTS 16

static void fuzz_alloc(reader *r)
{
    books bk = {0, 0, 0};
    dp_cache c;
    void *ptr[FUZZ_SLOTS] = {0};
    size_t rounded[FUZZ_SLOTS] = {0}, live = 0;
    uint8_t capb = u8(r);
    bk.cap = capb == 0 ? SIZE_MAX : (size_t)capb << (u8(r) % 40);
    size_t limit = (size_t)i64(r);
    size_t slack = (size_t)u8(r) << (u8(r) % 64);
    dp_alloc_backend be = {books_alloc, books_release, &bk};
    CHECK(dp_cache_init(&c, be, limit, slack) == 0);
    for (int step = 0; step < 256 && r->n > 0; step++) {
        uint8_t op = u8(r);
        int i = (op >> 2) % FUZZ_SLOTS;
        switch (op % 4) {
        case 0:
        case 1:
            if (ptr[i] == NULL) {
                size_t n = (size_t)u64(r) >> (u8(r) % 64);
                int rc = dp_cache_alloc(&c, n, &ptr[i], &rounded[i], NULL);
                if (rc == DP_ALLOC_OK) {
                    CHECK(rounded[i] >= n && dp_cache_class(rounded[i]) >= 0);
                    CHECK(dp_cache_class(rounded[i]) <= dp_cache_class(n) + DP_ALLOC_FIT_CLASSES);
                    CHECK(dp_cache_class_size(dp_cache_class(rounded[i])) == rounded[i]);
                    for (int j = 0; j < FUZZ_SLOTS; j++)
                        CHECK(j == i || ptr[j] != ptr[i]);
                    live += rounded[i];
                } else {
                    CHECK(rc == DP_ALLOC_OOM);
                    ptr[i] = NULL;
                }
                break;
            }
            /* the slot is taken: free it */
            /* fall through */
        case 2:
            if (ptr[i] != NULL) {
                dp_cache_free(&c, ptr[i], rounded[i]);
                live -= rounded[i];
                ptr[i] = NULL;
            }
            break;
        default:
            if (op & 0x80) {
                dp_cache_empty(&c);
                CHECK(dp_cache_get_stats(&c).cached == 0);
            } else {
                limit = (size_t)i64(r);
                dp_cache_set_limit(&c, limit);
            }
            break;
        }
        dp_cache_stats st = dp_cache_get_stats(&c);
        CHECK(st.allocated == live);
        CHECK(st.allocated + st.cached == bk.live_bytes);
        CHECK(st.cached <= limit && st.allocated <= st.peak);
        CHECK(st.cached <= st.peak || st.cached - st.peak <= slack);
    }
    for (int i = 0; i < FUZZ_SLOTS; i++)
        if (ptr[i] != NULL)
            dp_cache_free(&c, ptr[i], rounded[i]);
    dp_cache_destroy(&c);
    CHECK(bk.live_blocks == 0 && bk.live_bytes == 0);
}

/* ------------------------------------------------------------------ */

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    reader r = {data, size};
    uint8_t target = u8(&r);
    if (target >= 250) {
        fuzz_alloc(&r);
        return 0;
    }
    switch (target % 5) {
    case 0: fuzz_chunk_sizes(&r); break;
    case 1: fuzz_check_chunk_sizes(&r); break;
    case 2: fuzz_wrap_dim(&r); break;
    case 3: fuzz_copy(&r); break;
    default: fuzz_dense_any(&r); break;
    }
    return 0;
}
