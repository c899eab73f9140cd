/* test_plan.c - unit tests for csrc/core/plan.c (torch.chunk / split_with_sizes
 * arithmetic and dim wrapping).
 *
 * A standalone program: prints each failed check and exits non-zero if any
 * failed. Run by tests/test_c_units.py. The expected tables are the worked
 * examples of docs/spec.md 0.3; the property sweep checks the rule itself
 * (pieces of ceil(n/k) with a shorter last one) over many n and k, and the
 * edge cases near INT64_MAX check that nothing overflows.
 */
#include "plan.h"

#include <stdio.h>
#include <string.h>
#include "check.h"



/* Check dp_chunk_sizes(n, k) against an expected list of `count` sizes. */
static void expect_chunks(int64_t n, int k, int count, const int64_t *want)
{
    int64_t got[DP_MAX_DEVICES + 1];
    for (int i = 0; i <= k; i++)
        got[i] = -77;   /* sentinel: entry k must stay untouched */
    int rc = dp_chunk_sizes(n, k, got);
    int ok = rc == count && got[k] == -77;
    for (int i = 0; ok && i < k; i++)
        ok = got[i] == (i < count ? want[i] : 0);
    if (!ok) {
        failures++;
        printf("chunk n=%lld k=%d: got rc=%d [", (long long)n, k, rc);
        for (int i = 0; i < k; i++)
            printf("%s%lld", i ? "," : "", (long long)got[i]);
        printf("], want %d pieces\n", count);
    }
}

#define EXPECT(n, k, ...)                                                   \
    do {                                                                    \
        const int64_t want_[] = {__VA_ARGS__};                              \
        expect_chunks((n), (k), (int)(sizeof want_ / sizeof want_[0]), want_); \
    } while (0)

static void test_spec_table(void)
{
    EXPECT(0, 2, 0, 0);
    EXPECT(1, 2, 1);
    EXPECT(2, 2, 1, 1);
    EXPECT(3, 2, 2, 1);
    EXPECT(5, 2, 3, 2);
    EXPECT(7, 2, 4, 3);

    EXPECT(4, 3, 2, 2);
    EXPECT(5, 3, 2, 2, 1);
    EXPECT(7, 3, 3, 3, 1);
    EXPECT(10, 3, 4, 4, 2);
    EXPECT(0, 3, 0, 0, 0);

    EXPECT(1, 4, 1);
    EXPECT(2, 4, 1, 1);
    EXPECT(3, 4, 1, 1, 1);
    EXPECT(5, 4, 2, 2, 1);
    EXPECT(6, 4, 2, 2, 2);
    EXPECT(7, 4, 2, 2, 2, 1);
    EXPECT(9, 4, 3, 3, 3);
    EXPECT(10, 4, 3, 3, 3, 1);
    EXPECT(12, 4, 3, 3, 3, 3);

    EXPECT(36, 7, 6, 6, 6, 6, 6, 6);
    EXPECT(9, 8, 2, 2, 2, 2, 1);
    EXPECT(17, 8, 3, 3, 3, 3, 3, 2);
    EXPECT(25, 8, 4, 4, 4, 4, 4, 4, 1);
    EXPECT(256, 6, 43, 43, 43, 43, 43, 41);

    EXPECT(1, 1, 1);
    EXPECT(100, 1, 100);
    EXPECT(0, 1, 0);
}

/* The rule restated independently for every n in [0, 300] and k in [1, 40]:
 * the first count-1 pieces are equal to the largest piece, none is empty,
 * the sum is n, count <= k, and the piece size is the smallest that fits n
 * into k pieces. */
static void test_property_sweep(void)
{
    int64_t got[64];
    for (int k = 1; k <= 40; k++) {
        for (int64_t n = 1; n <= 300; n++) {
            int c = dp_chunk_sizes(n, k, got);
            int64_t split = got[0];
            int64_t sum = 0;
            int ok = c >= 1 && c <= k;
            for (int i = 0; ok && i < k; i++) {
                if (i < c - 1)
                    ok = got[i] == split;
                else if (i == c - 1)
                    ok = got[i] >= 1 && got[i] <= split;
                else
                    ok = got[i] == 0;
                sum += got[i];
            }
            ok = ok && sum == n && split * k >= n && (split - 1) * k < n;
            if (!ok) {
                failures++;
                printf("property failed n=%lld k=%d rc=%d\n", (long long)n, k, c);
            }
        }
    }
}

static void test_chunk_edges(void)
{
    int64_t s[DP_MAX_DEVICES];

    CHECK(dp_chunk_sizes(-1, 2, s) == DP_ERR_ARG);
    CHECK(dp_chunk_sizes(5, 0, s) == DP_ERR_ARG);
    CHECK(dp_chunk_sizes(5, -3, s) == DP_ERR_ARG);
    CHECK(dp_chunk_sizes(5, 2, NULL) == DP_ERR_ARG);

    /* Near INT64_MAX: (n + k - 1) / k would overflow here. */
    CHECK(dp_chunk_sizes(INT64_MAX, 2, s) == 2);
    CHECK(s[0] == INT64_MAX / 2 + 1 && s[1] == INT64_MAX / 2);
    CHECK(dp_chunk_sizes(INT64_MAX, 1, s) == 1 && s[0] == INT64_MAX);
    CHECK(dp_chunk_sizes(INT64_MAX - 1, 3, s) == 3);
    CHECK(s[0] + s[1] + s[2] == INT64_MAX - 1);
    CHECK(dp_chunk_sizes(INT64_MAX, DP_MAX_DEVICES, s) == DP_MAX_DEVICES);
    {
        int64_t left = INT64_MAX;
        for (int i = 0; i < DP_MAX_DEVICES; i++)
            left -= s[i];
        CHECK(left == 0);
    }

    /* Many devices, few rows: one row each, the rest unused. */
    CHECK(dp_chunk_sizes(3, DP_MAX_DEVICES, s) == 3);
    CHECK(s[0] == 1 && s[2] == 1 && s[3] == 0 && s[DP_MAX_DEVICES - 1] == 0);
    CHECK(dp_chunk_sizes(0, DP_MAX_DEVICES, s) == DP_MAX_DEVICES);
    CHECK(s[0] == 0 && s[DP_MAX_DEVICES - 1] == 0);
}

static void test_check_sizes(void)
{
    int bad = 99;
    const int64_t ok3[] = {2, 0, 3};
    const int64_t neg[] = {1, -1, 5, -2};
    const int64_t short_[] = {1, 2};
    const int64_t huge[] = {INT64_MAX, INT64_MAX, 1};
    const int64_t huge_neg[] = {INT64_MAX, INT64_MAX, -1};
    const int64_t zeros[] = {0, 0, 0};

    CHECK(dp_check_chunk_sizes(5, 3, ok3, &bad) == DP_OK && bad == -1);
    CHECK(dp_check_chunk_sizes(0, 3, zeros, &bad) == DP_OK && bad == -1);
    CHECK(dp_check_chunk_sizes(1, 3, zeros, &bad) == DP_ERR_SIZE_SUM && bad == -1);
    CHECK(dp_check_chunk_sizes(5, 3, ok3, NULL) == DP_OK);

    /* First negative entry is reported, even though the sum is wrong too. */
    CHECK(dp_check_chunk_sizes(3, 4, neg, &bad) == DP_ERR_NEGATIVE_SIZE && bad == 1);
    CHECK(dp_check_chunk_sizes(3, 4, neg, NULL) == DP_ERR_NEGATIVE_SIZE);

    CHECK(dp_check_chunk_sizes(4, 2, short_, &bad) == DP_ERR_SIZE_SUM && bad == -1);
    CHECK(dp_check_chunk_sizes(2, 2, short_, &bad) == DP_ERR_SIZE_SUM);

    /* Sums past INT64_MAX must not wrap around to a "correct" total. */
    CHECK(dp_check_chunk_sizes(INT64_MAX, 3, huge, &bad) == DP_ERR_SIZE_SUM && bad == -1);
    CHECK(dp_check_chunk_sizes(0, 3, huge, &bad) == DP_ERR_SIZE_SUM);
    CHECK(dp_check_chunk_sizes(INT64_MAX, 3, huge_neg, &bad) == DP_ERR_NEGATIVE_SIZE &&
          bad == 2);
    CHECK(dp_check_chunk_sizes(INT64_MAX, 1, huge, &bad) == DP_OK);

    CHECK(dp_check_chunk_sizes(-1, 3, zeros, &bad) == DP_ERR_ARG);
    CHECK(dp_check_chunk_sizes(0, 0, zeros, &bad) == DP_ERR_ARG);
    CHECK(dp_check_chunk_sizes(0, 3, NULL, &bad) == DP_ERR_ARG);
}

static void test_wrap_dim(void)
{
    CHECK(dp_wrap_dim(0, 1) == 0);
    CHECK(dp_wrap_dim(-1, 1) == 0);
    CHECK(dp_wrap_dim(1, 1) == DP_ERR_ARG);
    CHECK(dp_wrap_dim(-2, 1) == DP_ERR_ARG);
    CHECK(dp_wrap_dim(2, 3) == 2);
    CHECK(dp_wrap_dim(-1, 3) == 2);
    CHECK(dp_wrap_dim(-3, 3) == 0);
    CHECK(dp_wrap_dim(-4, 3) == DP_ERR_ARG);
    CHECK(dp_wrap_dim(3, 3) == DP_ERR_ARG);
    CHECK(dp_wrap_dim(0, 0) == DP_ERR_ARG);
    CHECK(dp_wrap_dim(-1, 0) == DP_ERR_ARG);
    CHECK(dp_wrap_dim(0, -2) == DP_ERR_ARG);
    for (int nd = 1; nd <= 64; nd++)
        for (int d = -nd; d < nd; d++)
            CHECK(dp_wrap_dim(d, nd) == (d < 0 ? d + nd : d));
}

int main(void)
{
    test_spec_table();
    test_property_sweep();
    test_chunk_edges();
    test_check_sizes();
    test_wrap_dim();
    if (failures) {
        printf("test_plan: %d check(s) failed\n", failures);
        return 1;
    }
    printf("test_plan: all checks passed\n");
    return 0;
}
