/* plan.h - the split rules of torch.chunk / torch.split_with_sizes as pure C.
 *
 * No Python.h: this file is unit-tested and fuzzed on its own.
 * Units: every size and offset here is in ELEMENTS along one dimension
 * unless the name ends in _bytes.
 */
#ifndef DPMINI_PLAN_H
#define DPMINI_PLAN_H

#include <stdint.h>
#include <stddef.h>

/* Largest number of devices one call may name (virtual CPU or CUDA). */
#define DP_MAX_DEVICES 256

/* Status codes shared by plan.c and copy.c (0 is success). */
enum {
    DP_OK = 0,
    DP_ERR_ARG = -1,           /* an argument is out of its documented range */
    DP_ERR_NEGATIVE_SIZE = -2, /* an explicit chunk size is negative          */
    DP_ERR_SIZE_SUM = -3,      /* explicit chunk sizes do not add up to n     */
    DP_ERR_OVERFLOW = -4,      /* a byte count does not fit in int64          */
    DP_ERR_WEIGHT = -5         /* a weight is not a finite number > 0         */
};

/* torch.chunk(k) on a dimension of length n (aten TensorShape.cpp: chunk).
 * split = ceil(n / k); pieces of `split` rows with a shorter last piece, so the
 * number of pieces is max(ceil(n / split), 1) and can be less than k.
 * n == 0 is special: exactly k pieces of size 0 (split_with_sizes([0]*k)).
 *
 * sizes: caller-owned array of k entries; entries [count, k) are set to 0.
 * Returns the number of pieces (1..k), or DP_ERR_ARG when n < 0 or k < 1.
 * Examples: (10,4)->[3,3,3,1] 4; (9,4)->[3,3,3] 3; (0,3)->[0,0,0] 3. */
int dp_chunk_sizes(int64_t n, int k, int64_t *sizes);

/* Validate explicit sizes as torch.split_with_sizes does (docs/spec.md 0.7): every
 * size >= 0 and sum == n. On failure *bad_index is the first negative entry
 * (DP_ERR_NEGATIVE_SIZE) or -1 (DP_ERR_SIZE_SUM). Returns DP_OK or an error. */
int dp_check_chunk_sizes(int64_t n, int k, const int64_t *sizes, int *bad_index);

/* Sizes proportional to weights (dpmini's `weights=`; PyTorch has explicit
 * sizes only, in comm.scatter's chunk_sizes, pytorch issue 46381).
 *
 * weights: k finite numbers > 0 (only their ratios matter). The rule:
 *   1. quota_i = n * w_i / sum(w); every device gets floor(quota_i) rows;
 *   2. largest remainder (Hamilton's method): the rows still left go one
 *      each to the devices with the largest quota_i - floor(quota_i), ties
 *      to the lower index, so the sizes sum to n exactly;
 *   3. no empty chunk unless there are too few rows: when n >= k, every
 *      device left with 0 rows (lowest index first) takes one row from the
 *      device with the most rows (the highest index among equals, so that
 *      the lower indices keep the rows their ties gave them: (9,
 *      [0.001,1,1,1]) -> [1,3,3,2]). So a device
 *      gets 0 rows only when n < k, and then the n rows go to the devices
 *      with the largest shares (equal weights: the first n devices, as
 *      torch.chunk does).
 * sizes: caller-owned array of k entries.
 * Returns dp_sizes_count(k, sizes), DP_ERR_ARG (n < 0, k < 1, NULL
 * pointers), or DP_ERR_WEIGHT with *bad_index (may be NULL) set to the first
 * weight that is not a finite number > 0.
 * Examples: (9, [1,1,1,1]) -> [3,2,2,2]; (10, [1,3]) -> [3,7] (quota 2.5, 7.5:
 * tie to device 0); (5, [100,1,1]) -> [3,1,1] (step 3); (2, [1,3,1,3]) ->
 * [0,1,0,1]. */
int dp_weighted_sizes(int64_t n, int k, const double *weights, int64_t *sizes,
                      int *bad_index);

/* The number of replicas a list of k sizes makes, chunk j on device j:
 * the index of the last non-empty chunk plus one (devices after it idle, as
 * with torch.chunk), or k when every chunk is empty (n == 0 runs every
 * replica on an empty chunk, docs/spec.md 0.2). Devices before the last non-empty
 * chunk run their replica even on an empty chunk. Returns 1..k, or
 * DP_ERR_ARG when k < 1 or sizes is NULL. */
int dp_sizes_count(int k, const int64_t *sizes);

/* Wrap a possibly negative dim against rank ndim (at::maybe_wrap_dim).
 * Returns the wrapped dim in [0, ndim) or DP_ERR_ARG when out of
 * [-ndim, ndim-1] or ndim < 1. */
int dp_wrap_dim(int dim, int ndim);

#endif
