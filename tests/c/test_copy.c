/* test_copy.c - unit tests for csrc/core/copy.c (strided N-d host copies).
 *
 * A standalone program: prints each failed check and exits non-zero if any
 * failed. Run by tests/test_c_units.py.
 *
 * The main test is a deterministic random sweep: random shapes (ndim 0..8,
 * sometimes 64), itemsizes 1,2,3,4,8,16, and source/destination layouts that
 * are permuted, sliced with steps of +-1/+-2, padded, or broadcast (zero
 * source strides). Each copy is run unsimplified, simplified, and split into
 * 1..5 parts, and the whole destination buffer, including guard bytes on
 * both sides and the unaddressed gaps between elements, must equal what a
 * naive element-by-element reference produced.
 */
#include "copy.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "check.h"



#define GUARD 64
#define MAX_BUF (1 << 20)

/* ------------------------------------------------------------------ */
/* Helpers: deterministic RNG, layouts, the naive reference            */
/* ------------------------------------------------------------------ */



static void fill_random(char *p, size_t n)
{
    for (size_t i = 0; i < n; i++)
        p[i] = (char)(rnd() >> 56);
}

/* A strided view into a fresh buffer: every dim is laid out over an extent
 * of ext[d] elements in a random memory order, the view walks it with step
 * +-1 or +-2 from a random start, and (for a source) a dim may be broadcast
 * with stride 0. Size-1 dims may get a junk stride, since it is never used.
 * Returns the buffer size in bytes, or 0 if it would be too large. */
static size_t make_layout(int ndim, const int64_t *shape, size_t item, int fancy,
                          int allow_zero, const int *perm_in, int64_t *strides,
                          int64_t *base)
{
    /* zero-initialised only to quiet gcc's maybe-uninitialized for ndim 0 */
    int64_t ext[DP_MAXDIMS] = {0}, step[DP_MAXDIMS] = {0}, slack[DP_MAXDIMS] = {0};
    int perm[DP_MAXDIMS] = {0};
    uint64_t total = item;

    for (int d = 0; d < ndim; d++) {
        int64_t pad = 0, s = 1;
        if (fancy && rnd_in(ndim > 8 ? 16 : 3) == 0) {
            static const int64_t steps[] = {1, 2, -1, -2};
            s = steps[rnd_in(4)];
            pad = rnd_in(3);
        }
        if (shape[d] == 0)
            s = 1;
        int64_t span = shape[d] > 0 ? (shape[d] - 1) * (s < 0 ? -s : s) + 1 : 1;
        ext[d] = span + pad;
        step[d] = s;
        slack[d] = pad;
        total *= (uint64_t)ext[d];
        if (total > MAX_BUF)
            return 0;
        perm[d] = perm_in ? perm_in[d] : d;
    }
    if (fancy && perm_in == NULL)
        for (int d = ndim - 1; d > 0; d--) {   /* Fisher-Yates */
            int j = (int)rnd_in(d + 1), t = perm[d];
            perm[d] = perm[j];
            perm[j] = t;
        }

    int64_t es[DP_MAXDIMS];
    dp_dense_strides(ndim, ext, item, perm, es);
    *base = 0;
    for (int d = 0; d < ndim; d++) {
        int64_t r = rnd_in(slack[d] + 1);
        int64_t start = step[d] > 0 ? r : ext[d] - 1 - r;
        *base += start * es[d];
        strides[d] = step[d] * es[d];
        if (allow_zero && fancy && rnd_in(4) == 0)
            strides[d] = 0;
        if (shape[d] == 1 && rnd_in(4) == 0)
            strides[d] = (int64_t)rnd_in(100000) - 50000;
    }
    return (size_t)total;
}

/* dst[i] = src[i] for every multi-index, each address recomputed from
 * scratch: slow and obviously right. */
static void naive_copy(const dp_copy_desc *d, char *dst, const char *src)
{
    int64_t idx[DP_MAXDIMS] = {0};
    if (dp_copy_numel(d) == 0)
        return;
    for (;;) {
        int64_t so = 0, dof = 0;
        for (int i = 0; i < d->ndim; i++) {
            so += idx[i] * d->src_strides[i];
            dof += idx[i] * d->dst_strides[i];
        }
        memcpy(dst + dof, src + so, d->itemsize);
        int k = d->ndim - 1;
        while (k >= 0 && ++idx[k] == d->shape[k])
            idx[k--] = 0;
        if (k < 0)
            return;
    }
}

/* Run desc split into `parts` pieces (parts 0 = run it whole). */
static void run_parts(const dp_copy_desc *d, int parts, char *dst, const char *src)
{
    if (parts == 0) {
        dp_copy_run(d, dst, src);
        return;
    }
    int64_t total = 0;
    for (int p = 0; p < parts; p++) {
        dp_copy_desc piece;
        int64_t so = -1, dof = -1;
        CHECK(dp_copy_part(d, parts, p, &piece, &so, &dof) == 0);
        total += dp_copy_numel(&piece);
        dp_copy_run(&piece, dst + dof, src + so);
    }
    CHECK(total == dp_copy_numel(d));
}

/* ------------------------------------------------------------------ */
/* The random sweep                                                    */
/* ------------------------------------------------------------------ */

static void check_simplified(const dp_copy_desc *orig, const dp_copy_desc *s)
{
    CHECK(dp_copy_numel(s) == dp_copy_numel(orig));
    CHECK(s->ndim >= 1 && s->ndim <= (orig->ndim > 1 ? orig->ndim : 1));
    CHECK(s->itemsize == orig->itemsize);
    for (int i = 0; s->ndim > 1 && i < s->ndim; i++)
        CHECK(s->shape[i] > 1);
    for (int i = 0; i + 1 < s->ndim; i++)
        CHECK(llabs(s->dst_strides[i]) >= llabs(s->dst_strides[i + 1]));
}

static void one_trial(int trial)
{
    static const size_t items[] = {1, 2, 3, 4, 8, 16};
    static char src[MAX_BUF], init[MAX_BUF + 2 * GUARD], ref[MAX_BUF + 2 * GUARD],
        out[MAX_BUF + 2 * GUARD];
    int64_t shape[DP_MAXDIMS], ss[DP_MAXDIMS], ds[DP_MAXDIMS], sbase, dbase;
    size_t item = items[rnd_in(6)], ssize, dsize;
    int ndim, perm[DP_MAXDIMS];

    do {   /* draw until both buffers fit */
        ndim = trial % 50 == 0 ? DP_MAXDIMS : (int)rnd_in(9);
        for (int d = 0; d < ndim; d++)
            shape[d] = ndim > 8 ? (rnd_in(8) == 0 ? 2 : 1) : rnd_in(7);
        if (ndim <= 8 && rnd_in(10) == 0 && ndim > 0)
            shape[rnd_in(ndim)] = rnd_in(200);   /* one long dim */
        if (ndim > 0 && rnd_in(5) != 0)
            for (int d = 0; d < ndim; d++)   /* mostly avoid numel 0 */
                if (shape[d] == 0)
                    shape[d] = 1 + rnd_in(4);
        int mode = (int)rnd_in(4);   /* 0 both plain, 1 same perm, 2,3 random */
        for (int d = 0; d < ndim; d++)
            perm[d] = ndim - 1 - d;
        ssize = make_layout(ndim, shape, item, mode >= 2, 1, mode == 1 ? perm : NULL,
                            ss, &sbase);
        dsize = make_layout(ndim, shape, item, mode >= 2, 0, mode == 1 ? perm : NULL,
                            ds, &dbase);
    } while (ssize == 0 || dsize == 0);

    dp_copy_desc desc, simple;
    CHECK(dp_copy_init(&desc, ndim, item, shape, ss, ds) == 0);
    fill_random(src, ssize);
    fill_random(init, dsize + 2 * GUARD);
    memcpy(ref, init, dsize + 2 * GUARD);
    naive_copy(&desc, ref + GUARD + dbase, src + sbase);

    simple = desc;
    dp_copy_simplify(&simple);
    check_simplified(&desc, &simple);

    /* variant -1: unsimplified whole; 0: simplified whole; 1..5: parts;
     * 6: the unsimplified copy in 3 parts; 7: simplified whole with
     * streaming stores wherever the runs allow them. */
    for (int v = -1; v <= 7; v++) {
        const dp_copy_desc *d = v < 0 || v == 6 ? &desc : &simple;
        int parts = v < 0 || v == 7 ? 0 : v == 6 ? 3 : v;
        memcpy(out, init, dsize + 2 * GUARD);
        if (v == 7)
            dp_copy_run_mode(d, out + GUARD + dbase, src + sbase, DP_COPY_STREAM);
        else
            run_parts(d, parts, out + GUARD + dbase, src + sbase);
        if (memcmp(out, ref, dsize + 2 * GUARD) != 0) {
            size_t at = 0;
            while (out[at] == ref[at])
                at++;
            failures++;
            printf("trial %d variant %d: ndim %d item %zu simplified ndim %d: "
                   "first bad byte %td (dst region %zu bytes)\n",
                   trial, v, ndim, item, simple.ndim, (ptrdiff_t)at - GUARD, dsize);
        }
    }
}

/* ------------------------------------------------------------------ */
/* Fixed cases                                                         */
/* ------------------------------------------------------------------ */

static dp_copy_desc desc2(int64_t n0, int64_t n1, size_t item, int64_t s0, int64_t s1,
                          int64_t d0, int64_t d1)
{
    dp_copy_desc d;
    int64_t sh[2] = {n0, n1}, ss[2] = {s0, s1}, ds[2] = {d0, d1};
    dp_copy_init(&d, 2, item, sh, ss, ds);
    return d;
}

static void test_simplify_cases(void)
{
    dp_copy_desc d;
    int64_t sh3[3] = {2, 3, 4}, c3[3] = {48, 16, 4}, r3[3] = {-48, -16, -4};

    CHECK(dp_copy_init(&d, 3, 4, sh3, c3, c3) == 0);
    dp_copy_simplify(&d);
    CHECK(d.ndim == 1 && d.shape[0] == 24 && d.src_strides[0] == 4 && d.dst_strides[0] == 4);

    CHECK(dp_copy_init(&d, 3, 4, sh3, r3, r3) == 0);   /* reversed both sides */
    dp_copy_simplify(&d);
    CHECK(d.ndim == 1 && d.shape[0] == 24 && d.src_strides[0] == -4 && d.dst_strides[0] == -4);

    d = desc2(4, 3, 4, 24, 4, 12, 4);   /* a column chunk of a (4,6) array */
    dp_copy_simplify(&d);
    CHECK(d.ndim == 2 && d.shape[0] == 4 && d.shape[1] == 3 && d.src_strides[0] == 24 &&
          d.dst_strides[0] == 12 && d.src_strides[1] == 4 && d.dst_strides[1] == 4);

    d = desc2(3, 5, 4, 20, 4, 4, 12);   /* C source into an F destination */
    dp_copy_simplify(&d);
    CHECK(d.ndim == 2 && d.shape[0] == 5 && d.shape[1] == 3 && d.src_strides[0] == 4 &&
          d.dst_strides[0] == 12 && d.src_strides[1] == 20 && d.dst_strides[1] == 4);

    d = desc2(4, 5, 8, 0, 0, 40, 8);    /* broadcast of one element */
    dp_copy_simplify(&d);
    CHECK(d.ndim == 1 && d.shape[0] == 20 && d.src_strides[0] == 0 && d.dst_strides[0] == 8);

    d = desc2(1, 1, 2, 999, -5, 0, 7);  /* one element */
    dp_copy_simplify(&d);
    CHECK(d.ndim == 1 && d.shape[0] == 1 && d.src_strides[0] == 2 && d.dst_strides[0] == 2);

    d = desc2(3, 0, 4, 16, 4, 16, 4);   /* nothing to copy */
    dp_copy_simplify(&d);
    CHECK(dp_copy_numel(&d) == 0);

    CHECK(dp_copy_init(&d, 0, 8, NULL, NULL, NULL) == 0);
    CHECK(dp_copy_numel(&d) == 1);
    dp_copy_simplify(&d);
    CHECK(d.ndim == 1 && d.shape[0] == 1 && d.src_strides[0] == 8);

    /* 64 dims, ten of size 2, contiguous: one run of 1024 elements. */
    int64_t sh[DP_MAXDIMS], st[DP_MAXDIMS];
    for (int i = 0; i < DP_MAXDIMS; i++)
        sh[i] = i % 6 == 0 && i < 60 ? 2 : 1;
    dp_dense_strides(DP_MAXDIMS, sh, 4, NULL, st);
    CHECK(dp_copy_init(&d, DP_MAXDIMS, 4, sh, st, st) == 0);
    CHECK(dp_copy_numel(&d) == 1024);
    dp_copy_simplify(&d);
    CHECK(d.ndim == 1 && d.shape[0] == 1024 && d.dst_strides[0] == 4);

    int64_t neg[1] = {-1}, one[1] = {1};
    CHECK(dp_copy_init(&d, -1, 4, one, one, one) == -1);
    CHECK(dp_copy_init(&d, DP_MAXDIMS + 1, 4, one, one, one) == -1);
    CHECK(dp_copy_init(&d, 1, 0, one, one, one) == -1);
    CHECK(dp_copy_init(&d, 1, 4, neg, one, one) == -1);
}

static void test_part_cases(void)
{
    dp_copy_desc d, p;
    int64_t so, dof, n1[1] = {1000}, s1[1] = {8};

    CHECK(dp_copy_init(&d, 1, 8, n1, s1, s1) == 0);   /* one contiguous run */
    CHECK(dp_copy_part(&d, 2, 0, &p, &so, &dof) == 0);
    CHECK(p.ndim == 1 && p.shape[0] == 500 && so == 0 && dof == 0);
    CHECK(dp_copy_part(&d, 2, 1, &p, &so, &dof) == 0);
    CHECK(p.ndim == 1 && p.shape[0] == 500 && so == 4000 && dof == 4000);

    d = desc2(1, 10, 4, 400, -4, 40, 4);   /* size-1 outer dim is skipped */
    const int64_t len[3] = {4, 3, 3}, at[3] = {0, 4, 7};
    for (int i = 0; i < 3; i++) {
        CHECK(dp_copy_part(&d, 3, i, &p, &so, &dof) == 0);
        CHECK(p.shape[0] == 1 && p.shape[1] == len[i]);
        CHECK(so == -4 * at[i] && dof == 4 * at[i]);
    }

    d = desc2(2, 3, 4, 12, 4, 12, 4);      /* fewer rows than parts */
    for (int i = 0; i < 5; i++) {
        CHECK(dp_copy_part(&d, 5, i, &p, &so, &dof) == 0);
        CHECK(dp_copy_numel(&p) == (i < 2 ? 3 : 0));
    }
    CHECK(dp_copy_part(&d, 0, 0, &p, &so, &dof) == -1);
    CHECK(dp_copy_part(&d, 2, 2, &p, &so, &dof) == -1);
    CHECK(dp_copy_part(&d, 2, -1, &p, &so, &dof) == -1);

    /* ndim 0: one element, done by part 0 only; numel-0 copies touch nothing. */
    char a[8] = "abcdefg", b[8] = "1234567";
    CHECK(dp_copy_init(&d, 0, 3, NULL, NULL, NULL) == 0);
    for (int i = 0; i < 3; i++) {
        CHECK(dp_copy_part(&d, 3, i, &p, &so, &dof) == 0);
        CHECK(dp_copy_numel(&p) == (i == 0));
        dp_copy_run(&p, b + dof, a + so);
    }
    CHECK(memcmp(b, "abc4567", 8) == 0);
    d = desc2(0, 5, 1, 5, 1, 5, 1);
    dp_copy_run(&d, b, a);
    CHECK(memcmp(b, "abc4567", 8) == 0);
}

static void test_dense_cases(void)
{
    int perm[DP_MAXDIMS];
    int64_t st[DP_MAXDIMS];
    const int64_t nchw[4] = {2, 3, 4, 5};
    const int64_t c_st[4] = {240, 80, 20, 4}, nhwc[4] = {240, 4, 60, 12};

    CHECK(dp_layout_is_dense(4, nchw, c_st, 4, perm) == 1);
    CHECK(perm[0] == 0 && perm[1] == 1 && perm[2] == 2 && perm[3] == 3);
    CHECK(dp_layout_is_dense(4, nchw, nhwc, 4, perm) == 1);   /* channels-last */
    CHECK(perm[0] == 0 && perm[1] == 2 && perm[2] == 3 && perm[3] == 1);
    dp_dense_strides(4, nchw, 4, perm, st);
    CHECK(memcmp(st, nhwc, sizeof nhwc) == 0);
    dp_dense_strides(4, nchw, 4, NULL, st);
    CHECK(memcmp(st, c_st, sizeof c_st) == 0);

    const int64_t gap[4] = {480, 160, 40, 8}, neg[4] = {240, 80, 20, -4};
    const int64_t dup[4] = {240, 80, 20, 20}, bc[4] = {0, 80, 20, 4};
    CHECK(dp_layout_is_dense(4, nchw, gap, 4, NULL) == 0);
    CHECK(dp_layout_is_dense(4, nchw, neg, 4, NULL) == 0);
    CHECK(dp_layout_is_dense(4, nchw, dup, 4, NULL) == 0);
    CHECK(dp_layout_is_dense(4, nchw, bc, 4, NULL) == 0);

    /* Size-1 dims are ignored, whatever their stride; ties keep dim order. */
    const int64_t sh1[3] = {3, 1, 4}, st1[3] = {16, -7, 4}, st2[3] = {16, 16, 4};
    CHECK(dp_layout_is_dense(3, sh1, st1, 4, perm) == 1);
    CHECK(perm[0] == 0 && perm[1] == 2 && perm[2] == 1);
    CHECK(dp_layout_is_dense(3, sh1, st2, 4, perm) == 1);
    CHECK(perm[0] == 0 && perm[1] == 1 && perm[2] == 2);
    const int64_t sh0[2] = {0, 3}, st0[2] = {12, 4}, stbad[2] = {12, 8};
    CHECK(dp_layout_is_dense(2, sh0, st0, 4, perm) == 1);
    CHECK(dp_layout_is_dense(2, sh0, stbad, 4, perm) == 0);
    CHECK(dp_layout_is_dense(0, NULL, NULL, 4, perm) == 1);

    /* Round trip: strides from a random perm are dense and give it back. */
    for (int t = 0; t < 200; t++) {
        int nd = 1 + (int)rnd_in(6), p[DP_MAXDIMS];
        int64_t sh[DP_MAXDIMS];
        for (int i = 0; i < nd; i++) {
            sh[i] = 2 + rnd_in(4);
            p[i] = i;
        }
        for (int i = nd - 1; i > 0; i--) {
            int j = (int)rnd_in(i + 1), x = p[i];
            p[i] = p[j];
            p[j] = x;
        }
        dp_dense_strides(nd, sh, 2, p, st);
        CHECK(dp_layout_is_dense(nd, sh, st, 2, perm) == 1);
        CHECK(memcmp(perm, p, (size_t)nd * sizeof(int)) == 0);
    }
}

/* Streaming stores: every run length around the 16/32-byte alignment steps
 * and the 64/128-byte loop steps, at every misalignment of source and
 * destination, as one run and as rows of a 2-d copy with padded strides;
 * the whole destination (guards and row gaps included) must equal memcpy's
 * result. Then a job large enough that DP_COPY_AUTO streams by itself, and
 * DP_COPY_ORDINARY on the same. */
static void test_stream_cases(void)
{
    static char src[4096], init[4096 + 2 * GUARD], ref[4096 + 2 * GUARD],
        out[4096 + 2 * GUARD];
    static const int64_t lens[] = {0, 1, 15, 16, 17, 31, 32, 33, 63, 64, 65, 127, 128,
                                   129, 255, 256, 257, 300, 511, 512, 1000, 1023};
    fill_random(src, sizeof src);
    fill_random(init, sizeof init);
    for (size_t li = 0; li < sizeof lens / sizeof lens[0]; li++) {
        for (int sa = 0; sa < 33; sa += 3) {
            for (int da = 0; da < 33; da += 2) {
                int64_t n = lens[li];
                for (int rows = 1; rows <= 3; rows += 2) {
                    int64_t shape[2] = {rows, n}, ss[2] = {n + 7, 1}, ds[2] = {n + 5, 1};
                    dp_copy_desc d;
                    CHECK(dp_copy_init(&d, 2, 1, shape, ss, ds) == 0);
                    memcpy(ref, init, sizeof ref);
                    for (int r = 0; r < rows; r++)
                        memcpy(ref + GUARD + da + r * (n + 5), src + sa + r * (n + 7),
                               (size_t)n);
                    for (int mode = 0; mode < 3; mode++) {
                        memcpy(out, init, sizeof out);
                        dp_copy_run_mode(&d, out + GUARD + da, src + sa, mode);
                        if (memcmp(out, ref, sizeof out) != 0) {
                            failures++;
                            printf("stream case len %lld src+%d dst+%d rows %d mode %d: "
                                   "wrong bytes\n", (long long)n, sa, da, rows, mode);
                        }
                    }
                }
            }
        }
    }

    /* 4 MiB + a bit in 300 rows of 14 KiB runs with gaps: AUTO streams. */
    int64_t rows = 300, run = 14 * 1024 + 3, gap = 37;
    size_t bytes = (size_t)(rows * (run + gap));
    char *a = malloc(bytes), *b = malloc(bytes + 2 * GUARD), *c = malloc(bytes + 2 * GUARD);
    CHECK(a != NULL && b != NULL && c != NULL);
    if (a == NULL || b == NULL || c == NULL) {
        free(a);
        free(b);
        free(c);
        return;
    }
    CHECK((uint64_t)(rows * run) * 1 >= DP_STREAM_MIN_JOB);
    fill_random(a, bytes);
    for (int mode = 0; mode < 3; mode++) {
        int64_t shape[2] = {rows, run}, st[2] = {run + gap, 1};
        dp_copy_desc d;
        CHECK(dp_copy_init(&d, 2, 1, shape, st, st) == 0);
        memset(b, 0x5a, bytes + 2 * GUARD);
        memset(c, 0x5a, bytes + 2 * GUARD);
        for (int64_t r = 0; r < rows; r++)
            memcpy(c + GUARD + 1 + r * (run + gap), a + r * (run + gap), (size_t)run);
        /* the destination is offset by one byte from the source's alignment */
        dp_copy_run_mode(&d, b + GUARD + 1, a, mode);
        if (memcmp(b, c, bytes + 2 * GUARD - 1) != 0) {
            failures++;
            printf("large stream case mode %d: wrong bytes\n", mode);
        }
    }
    free(a);
    free(b);
    free(c);
}

int main(void)
{
    test_simplify_cases();
    test_part_cases();
    test_dense_cases();
    for (int t = 0; t < 4000; t++)
        one_trial(t);
    test_stream_cases();
    if (failures) {
        printf("test_copy: %d check(s) failed\n", failures);
        return 1;
    }
    printf("test_copy: all checks passed\n");
    return 0;
}
