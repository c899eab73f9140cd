/* test_weights.c - unit tests for dp_weighted_sizes and dp_sizes_count
 * (csrc/core/plan.c): dpmini's weights= rule.
 *
 * A standalone program run by tests/test_c_units.py: prints each failed check
 * and exits non-zero if any failed. The worked examples are those of plan.h;
 * the sweep checks the rule's three promises (the sizes sum to n, every size
 * is within one row of its quota unless step 3 moved a row, and no chunk is
 * empty when n >= k) against an independent restatement.
 */
#include "plan.h"

#include <math.h>   /* NAN, INFINITY (macros: no libm needed) */
#include <stdint.h>
#include <stdio.h>
#include "check.h"


static double absd(double x)
{
    return x < 0 ? -x : x;
}


static void expect(int64_t n, int k, const double *w, const int64_t *want, int count)
{
    int64_t got[DP_MAX_DEVICES + 1];
    got[k] = -77;
    int rc = dp_weighted_sizes(n, k, w, got, NULL);
    int ok = rc == count && got[k] == -77;
    for (int i = 0; ok && i < k; i++)
        ok = got[i] == want[i];
    if (!ok) {
        failures++;
        printf("weighted n=%lld k=%d: got rc=%d [", (long long)n, k, rc);
        for (int i = 0; i < k; i++)
            printf("%s%lld", i ? "," : "", (long long)got[i]);
        printf("], want rc=%d\n", count);
    }
}

#define EXPECT(n, count, W, WANT)                                             \
    do {                                                                      \
        const double w_[] = W;                                                \
        const int64_t want_[] = WANT;                                         \
        expect((n), (int)(sizeof w_ / sizeof w_[0]), w_, want_, (count));     \
    } while (0)
#define L(...) {__VA_ARGS__}

static void test_examples(void)
{
    EXPECT(9, 4, L(1, 1, 1, 1), L(3, 2, 2, 2));
    EXPECT(10, 2, L(1, 3), L(3, 7));
    EXPECT(10, 2, L(0.1, 0.3), L(3, 7));
    EXPECT(5, 3, L(100, 1, 1), L(3, 1, 1));
    EXPECT(2, 4, L(1, 3, 1, 3), L(0, 1, 0, 1));
    EXPECT(12, 4, L(1, 1, 1, 1), L(3, 3, 3, 3));
    EXPECT(12, 3, L(1, 2, 3), L(2, 4, 6));
    EXPECT(7, 2, L(0.5, 0.5), L(4, 3));
    EXPECT(3, 3, L(1, 1, 1, 1), L(1, 1, 1, 0));   /* as torch.chunk: 3 replicas */
    EXPECT(2, 2, L(1, 1, 1, 1), L(1, 1, 0, 0));
    EXPECT(0, 3, L(1, 2, 3), L(0, 0, 0));          /* n == 0: every replica runs */
    EXPECT(1, 1, L(5), L(1));
    EXPECT(100, 3, L(1e300, 1e300, 1e300), L(34, 33, 33));  /* no overflow */
    EXPECT(100, 2, L(1e-300, 1e-300), L(50, 50));
}

static void test_errors(void)
{
    int64_t s[4];
    int bad = 99;
    const double ok[] = {1, 1};
    const double zero[] = {1, 0, 1};
    const double neg[] = {1, 1, -2};
    const double nan_[] = {NAN, 1};
    const double inf_[] = {1, INFINITY};
    CHECK(dp_weighted_sizes(5, 3, zero, s, &bad) == DP_ERR_WEIGHT && bad == 1);
    CHECK(dp_weighted_sizes(5, 3, neg, s, &bad) == DP_ERR_WEIGHT && bad == 2);
    CHECK(dp_weighted_sizes(5, 2, nan_, s, &bad) == DP_ERR_WEIGHT && bad == 0);
    CHECK(dp_weighted_sizes(5, 2, inf_, s, &bad) == DP_ERR_WEIGHT && bad == 1);
    CHECK(dp_weighted_sizes(5, 2, inf_, s, NULL) == DP_ERR_WEIGHT);
    CHECK(dp_weighted_sizes(-1, 2, ok, s, &bad) == DP_ERR_ARG && bad == -1);
    CHECK(dp_weighted_sizes(5, 0, ok, s, &bad) == DP_ERR_ARG);
    CHECK(dp_weighted_sizes(5, 2, NULL, s, &bad) == DP_ERR_ARG);
    CHECK(dp_weighted_sizes(5, 2, ok, NULL, &bad) == DP_ERR_ARG);
    CHECK(dp_weighted_sizes(5, DP_MAX_DEVICES + 1, ok, s, &bad) == DP_ERR_ARG);
}

static void test_count(void)
{
    const int64_t a[] = {3, 2, 0, 0};
    const int64_t b[] = {0, 3, 2, 0};
    const int64_t c[] = {0, 0, 0};
    const int64_t d[] = {1, 0, 0, 1};
    CHECK(dp_sizes_count(4, a) == 2);
    CHECK(dp_sizes_count(4, b) == 3);
    CHECK(dp_sizes_count(3, c) == 3);
    CHECK(dp_sizes_count(4, d) == 4);
    CHECK(dp_sizes_count(0, a) == DP_ERR_ARG);
    CHECK(dp_sizes_count(2, NULL) == DP_ERR_ARG);
}

/* Sweep: random-ish weights from a fixed LCG, n in [0, 200], k in [1, 12]. */
static void test_sweep(void)
{
    uint64_t seed = 12345;
    double w[16];
    int64_t s[16];
    for (int k = 1; k <= 12; k++) {
        for (int trial = 0; trial < 20; trial++) {
            double total = 0;
            for (int i = 0; i < k; i++) {
                seed = seed * 6364136223846793005ULL + 1442695040888963407ULL;
                w[i] = 0.05 + (double)(seed >> 40) / (double)(1ULL << 24) * (trial % 3 ? 1.0 : 50.0);
                total += w[i];
            }
            for (int64_t n = 0; n <= 200; n++) {
                int rc = dp_weighted_sizes(n, k, w, s, NULL);
                int64_t sum = 0;
                int ok = rc >= 1 && rc <= k;
                int moved = 0;
                for (int i = 0; ok && i < k; i++) {
                    double quota = (double)n * w[i] / total;
                    ok = s[i] >= 0;
                    sum += s[i];
                    if (absd((double)s[i] - quota) >= 1.0 + 1e-9)
                        moved = 1;
                    if (n >= k && s[i] == 0)
                        ok = 0;
                }
                ok = ok && sum == n && rc == dp_sizes_count(k, s);
                /* Far from quota only when step 3 had to fill empty chunks,
                 * which needs some quota below 1. */
                if (moved) {
                    int small = 0;
                    for (int i = 0; i < k; i++)
                        small |= (double)n * w[i] / total < 1.0;
                    ok = ok && small;
                }
                if (!ok) {
                    failures++;
                    printf("sweep failed n=%lld k=%d trial=%d rc=%d\n", (long long)n, k,
                           trial, rc);
                }
            }
        }
    }
}

int main(void)
{
    test_examples();
    test_errors();
    test_count();
    test_sweep();
    if (failures) {
        printf("test_weights: %d check(s) failed\n", failures);
        return 1;
    }
    printf("test_weights: all checks passed\n");
    return 0;
}
