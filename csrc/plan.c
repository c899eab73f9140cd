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
     * device gets an empty piece (spec 0.2). */
    if (n == 0) {
        for (int i = 0; i < k; i++)
            sizes[i] = 0;
        return k;
    }

    /* Pieces of `split` rows with a shorter last one; the count can be less
     * than k, e.g. n=9, k=4: split 3 gives [3,3,3] (spec 0.1). */
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

int dp_wrap_dim(int dim, int ndim)
{
    if (ndim < 1 || dim < -ndim || dim >= ndim)
        return DP_ERR_ARG;
    return dim < 0 ? dim + ndim : dim;
}
