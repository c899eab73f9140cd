/* test_overlap.c - unit tests for the overlap checks of csrc/core/copy.c
 * (dp_layout_extent, dp_layouts_may_overlap, dp_layout_has_internal_overlap).
 *
 * A standalone program: prints each failed check and exits non-zero if any
 * failed. Run by tests/test_c_units.py. Besides hand-written cases, a
 * deterministic random sweep checks the internal-overlap test against brute
 * force: it may refuse a layout that does not overlap (it is conservative)
 * but must never pass one that does, and must pass every sliced view of a
 * dense buffer.
 */
#include "copy.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "check.h"





/* Brute force: do two different indices touch a common byte? */
static int brute_internal_overlap(int nd, const int64_t *shape, const int64_t *strides,
                                  size_t item)
{
    int64_t numel = 1;
    for (int i = 0; i < nd; i++)
        numel *= shape[i];
    if (numel <= 1)
        return 0;
    int64_t *offs = malloc((size_t)numel * sizeof *offs);
    for (int64_t e = 0; e < numel; e++) {
        int64_t rem = e, off = 0;
        for (int i = nd - 1; i >= 0; i--) {
            off += (rem % shape[i]) * strides[i];
            rem /= shape[i];
        }
        offs[e] = off;
    }
    int hit = 0;
    for (int64_t a = 0; a < numel && !hit; a++)
        for (int64_t b = a + 1; b < numel && !hit; b++) {
            int64_t d = offs[a] - offs[b];
            if (d < 0)
                d = -d;
            hit = d < (int64_t)item;
        }
    free(offs);
    return hit;
}

static void test_extent(void)
{
    int64_t lo, hi;
    int64_t sh[2] = {3, 4}, st[2] = {32, 8};
    CHECK(dp_layout_extent(2, sh, st, 8, &lo, &hi) == 1 && lo == 0 && hi == 96);
    int64_t st2[2] = {-32, 8};
    CHECK(dp_layout_extent(2, sh, st2, 8, &lo, &hi) == 1 && lo == -64 && hi == 32);
    int64_t sh0[2] = {3, 0};
    CHECK(dp_layout_extent(2, sh0, st, 8, &lo, &hi) == 0);
    CHECK(dp_layout_extent(0, NULL, NULL, 4, &lo, &hi) == 1 && lo == 0 && hi == 4);
    int64_t big[2] = {INT64_MAX, 3}, bst[2] = {INT64_MAX, 1};
    CHECK(dp_layout_extent(2, big, bst, 1, &lo, &hi) == -1);
}

static void test_may_overlap(void)
{
    double buf[16];
    char *b = (char *)buf;
    int64_t sh4[1] = {4}, s8[1] = {8}, s16[1] = {16}, sm8[1] = {-8}, sh0[1] = {0};
    /* buf[0:4] vs buf[4:8]: adjacent, disjoint */
    CHECK(!dp_layouts_may_overlap(b, 1, sh4, s8, 8, b + 32, 1, sh4, s8, 8));
    /* buf[0:4] vs buf[3:7] */
    CHECK(dp_layouts_may_overlap(b, 1, sh4, s8, 8, b + 24, 1, sh4, s8, 8));
    /* buf[::2][:4] vs buf[1::2][:4]: interleaved, refused (conservative) */
    CHECK(dp_layouts_may_overlap(b, 1, sh4, s16, 8, b + 8, 1, sh4, s16, 8));
    /* buf[7:3:-1] (elements 7..4) vs buf[0:4]: disjoint; vs buf[4:8]: same bytes */
    CHECK(!dp_layouts_may_overlap(b + 56, 1, sh4, sm8, 8, b, 1, sh4, s8, 8));
    CHECK(dp_layouts_may_overlap(b + 56, 1, sh4, sm8, 8, b + 32, 1, sh4, s8, 8));
    /* an empty layout never overlaps */
    CHECK(!dp_layouts_may_overlap(b, 1, sh0, s8, 8, b, 1, sh4, s8, 8));
    /* itemsize counts: 4-byte items at b and b+3 share a byte */
    CHECK(dp_layouts_may_overlap(b, 0, NULL, NULL, 4, b + 3, 0, NULL, NULL, 4));
    CHECK(!dp_layouts_may_overlap(b, 0, NULL, NULL, 4, b + 4, 0, NULL, NULL, 4));
}

static void test_internal_fixed(void)
{
    int64_t sh[2] = {4, 3};
    int64_t c[2] = {24, 8}, f[2] = {8, 32}, z[2] = {0, 8}, half[2] = {12, 8};
    CHECK(!dp_layout_has_internal_overlap(2, sh, c, 8));
    CHECK(!dp_layout_has_internal_overlap(2, sh, f, 8));
    CHECK(dp_layout_has_internal_overlap(2, sh, z, 8));     /* zero stride, size 4 */
    CHECK(dp_layout_has_internal_overlap(2, sh, half, 8));  /* rows overlap */
    int64_t sh1[2] = {1, 3}, z1[2] = {0, 8};
    CHECK(!dp_layout_has_internal_overlap(2, sh1, z1, 8));  /* zero stride, size 1 */
    int64_t sh0[2] = {0, 3};
    CHECK(!dp_layout_has_internal_overlap(2, sh0, z, 8));   /* empty */
    int64_t s4[1] = {4}, st4[1] = {4};
    CHECK(dp_layout_has_internal_overlap(1, s4, st4, 8));   /* stride < itemsize */
    CHECK(!dp_layout_has_internal_overlap(0, NULL, NULL, 8));
}

/* Sliced views of a dense buffer (random shape, dim order, steps and signs)
 * never overlap; random strides must agree with brute force whenever the
 * check passes them. */
static void test_internal_sweep(void)
{
    for (int iter = 0; iter < 20000; iter++) {
        int nd = (int)rnd_in(4) + 1;
        size_t item = (size_t)1 << rnd_in(4);
        int64_t ext[4], shape[4], strides[4], dense[4];
        int perm[4];
        for (int i = 0; i < nd; i++) {
            ext[i] = rnd_in(6) + 1;
            perm[i] = i;
        }
        for (int i = nd - 1; i > 0; i--) {
            int j = (int)rnd_in(i + 1), t = perm[i];
            perm[i] = perm[j];
            perm[j] = t;
        }
        dp_dense_strides(nd, ext, item, perm, dense);
        for (int i = 0; i < nd; i++) {
            int64_t step = rnd_in(3) + 1;
            shape[i] = (ext[i] + step - 1) / step;
            strides[i] = dense[i] * step * (rnd() & 1 ? -1 : 1);
        }
        CHECK(!dp_layout_has_internal_overlap(nd, shape, strides, item));

        for (int i = 0; i < nd; i++) {
            shape[i] = rnd_in(4) + 1;
            strides[i] = (rnd_in(41) - 20) * (int64_t)(rnd() & 1 ? 1 : item);
        }
        if (!dp_layout_has_internal_overlap(nd, shape, strides, item))
            CHECK(!brute_internal_overlap(nd, shape, strides, item));
    }
}

int main(void)
{
    rng_state = 0x243F6A8885A308D3ull;  /* this test's seed */
    test_extent();
    test_may_overlap();
    test_internal_fixed();
    test_internal_sweep();
    if (failures) {
        printf("%d check(s) failed\n", failures);
        return 1;
    }
    printf("test_overlap: all checks passed\n");
    return 0;
}
