/* plan.c - the split rules of torch.chunk / torch.split_with_sizes as pure C.
 *
 * Implements plan.h. No Python.h and no allocation: every function works on
 * caller-owned arrays, so this file can be unit-tested (tests/c/test_plan.c)
 * and fuzzed on its own. All sizes are element counts along one dimension.
 *
 * Every computation is written so that it cannot overflow int64 for any
 * n in [0, INT64_MAX]: ceil(n / k) is n / k + (n % k != 0) (the textbook
 * (n + k - 1) / k overflows near INT64_MAX), and a running sum of explicit
 * sizes is compared against what is left of n instead of being added up.
 */
#include "plan.h"

#include <math.h>   /* isfinite (a macro: no libm needed) */

/* ceil(a / b) for a >= 0, b >= 1, without forming a + b - 1. */
static int64_t ceil_div(int64_t a, int64_t b)
{
    return a / b + (a % b != 0);
}

int dp_chunk_sizes(int64_t n, int k, int64_t *sizes)
{
    if (n < 0 || k < 1 || sizes == NULL)
        return DP_ERR_ARG;

    /* n == 0: torch.chunk goes through split_with_sizes([0] * k), so every
     * device gets an empty piece (docs/spec.md 0.2). */
    if (n == 0) {
        for (int i = 0; i < k; i++)
            sizes[i] = 0;
        return k;
    }

    /* Pieces of `split` rows with a shorter last one; the count can be less
     * than k, e.g. n=9, k=4: split 3 gives [3,3,3] (docs/spec.md 0.1). */
    int64_t split = ceil_div(n, k);
    int64_t count = ceil_div(n, split); /* 1 <= count <= k */
    for (int64_t i = 0; i < count - 1; i++)
        sizes[i] = split;
    /* split * (count - 1) < n, so this product cannot overflow. */
    sizes[count - 1] = n - split * (count - 1);
    for (int64_t i = count; i < k; i++)
        sizes[i] = 0;
    return (int)count;
}

int dp_check_chunk_sizes(int64_t n, int k, const int64_t *sizes, int *bad_index)
{
    if (bad_index != NULL)
        *bad_index = -1;
    if (n < 0 || k < 1 || sizes == NULL)
        return DP_ERR_ARG;

    /* torch checks each entry for a negative size while it walks the list and
     * only then compares the total with n, so a negative entry is reported
     * even when the sum is also wrong. `left` is what remains of n; once an
     * entry is larger than that the sum is known to be wrong (and adding it
     * up could overflow), so we stop subtracting but keep looking for
     * negative entries. */
    int64_t left = n;
    int too_big = 0;
    for (int i = 0; i < k; i++) {
        if (sizes[i] < 0) {
            if (bad_index != NULL)
                *bad_index = i;
            return DP_ERR_NEGATIVE_SIZE;
        }
        if (!too_big) {
            if (sizes[i] > left)
                too_big = 1;
            else
                left -= sizes[i];
        }
    }
    if (too_big || left != 0)
        return DP_ERR_SIZE_SUM;
    return DP_OK;
}

int dp_sizes_count(int k, const int64_t *sizes)
{
    if (k < 1 || sizes == NULL)
        return DP_ERR_ARG;
    for (int i = k - 1; i >= 0; i--)
        if (sizes[i] != 0)
            return i + 1;
    return k;
}

/* Remainders (in rows, within [0, 1)) closer than this are ties. */
#define DP_REM_EPS 1e-9L

/* The weights checked (each finite and > 0; else DP_ERR_WEIGHT with
 * *bad_index) and their sum, formed in long double; when even that
 * overflows (weights near DBL_MAX on a platform whose long double is
 * double) the weights are scaled by the largest one first (only ratios
 * matter): *scale is that divisor (1 otherwise). DP_OK or DP_ERR_WEIGHT. */
static int weights_total(int k, const double *weights, int *bad_index, long double *scale,
                         long double *total)
{
    double wmax = 0.0;
    for (int i = 0; i < k; i++) {
        double w = weights[i];
        if (!(w > 0.0) || !isfinite(w)) {   /* also catches NaN */
            if (bad_index != NULL)
                *bad_index = i;
            return DP_ERR_WEIGHT;
        }
        if (w > wmax)
            wmax = w;
    }
    *scale = 1.0L;
    *total = 0.0L;
    for (int i = 0; i < k; i++)
        *total += (long double)weights[i];
    if (!isfinite((double)*total) || *total > 1e300L) {
        *scale = (long double)wmax;
        *total = 0.0L;
        for (int i = 0; i < k; i++)
            *total += (long double)weights[i] / *scale;
    }
    return DP_OK;
}

/* Step 1: the floor of each quota n * w / total into sizes, clamped to
 * [0, n] against rounding, and what the floor left off into rem. */
static void floor_quotas(int64_t n, int k, const double *weights, long double scale,
                         long double total, int64_t *sizes, long double *rem)
{
    for (int i = 0; i < k; i++) {
        long double quota = (long double)n * ((long double)weights[i] / scale) / total;
        /* floor without libm: quota >= 0, so truncation is the floor once
         * it is clamped into [0, n]. */
        int64_t fl;
        if (!(quota > 0.0L))
            fl = 0, quota = 0.0L;
        else if (quota >= (long double)n)   /* (long double)n may round up */
            fl = n, quota = (long double)n;
        else
            fl = (int64_t)quota;
        sizes[i] = fl;
        rem[i] = quota - (long double)fl;
    }
}

/* The sum of the floors, at most n: when rounding pushed them past n
 * (only for huge n) they are capped in device order, starting again. */
static int64_t floors_sum(int64_t n, int k, int64_t *sizes)
{
    int64_t sum = 0;
    int over = 0;
    for (int i = 0; i < k; i++) {
        if (sizes[i] > n - sum)
            over = 1;
        else
            sum += sizes[i];
    }
    if (!over)
        return sum;
    int64_t left = n;
    for (int i = 0; i < k; i++) {
        if (sizes[i] > left)
            sizes[i] = left;
        left -= sizes[i];
    }
    return n;
}

/* Step 2, largest remainder: devices ordered by remainder (descending, ties
 * to the lower index; remainders closer than DP_REM_EPS count as ties, so
 * 10 rows at [1, 3] give [3, 7] whatever the rounding of 2.5 and 7.5);
 * what is left of n is handed out one row each in that order (a second
 * round only when rounding lost more than k rows). Insertion sort: k <= 256. */
static void hand_out_rest(int64_t n, int k, int64_t *sizes, const long double *rem)
{
    int order[DP_MAX_DEVICES];
    for (int i = 0; i < k; i++) {
        int j = i;
        while (j > 0 && rem[order[j - 1]] < rem[i] - DP_REM_EPS) {
            order[j] = order[j - 1];
            j--;
        }
        order[j] = i;
    }
    int64_t sum = floors_sum(n, k, sizes);
    for (int t = 0; sum < n; t = (t + 1) % k) {
        sizes[order[t]]++;
        sum++;
    }
}

/* Step 3: no empty chunk when every device can have a row (n >= k): an
 * empty one takes a row from the largest (the highest index among equals). */
static void fill_empty(int64_t n, int k, int64_t *sizes)
{
    if (n < k)
        return;
    for (int i = 0; i < k; i++) {
        if (sizes[i] != 0)
            continue;
        int donor = 0;
        for (int j = 1; j < k; j++)
            if (sizes[j] >= sizes[donor])
                donor = j;
        sizes[donor]--;  /* >= 2: n >= k rows and a device has none */
        sizes[i] = 1;
    }
}

int dp_weighted_sizes(int64_t n, int k, const double *weights, int64_t *sizes,
                      int *bad_index)
{
    if (bad_index != NULL)
        *bad_index = -1;
    if (n < 0 || k < 1 || k > DP_MAX_DEVICES || weights == NULL || sizes == NULL)
        return DP_ERR_ARG;
    long double scale, total, rem[DP_MAX_DEVICES];
    int r = weights_total(k, weights, bad_index, &scale, &total);
    if (r != DP_OK)
        return r;
    floor_quotas(n, k, weights, scale, total, sizes, rem);
    hand_out_rest(n, k, sizes, rem);
    fill_empty(n, k, sizes);
    return dp_sizes_count(k, sizes);
}

int dp_wrap_dim(int dim, int ndim)
{
    if (ndim < 1 || dim < -ndim || dim >= ndim)
        return DP_ERR_ARG;
    return dim < 0 ? dim + ndim : dim;
}
