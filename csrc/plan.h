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
    DP_ERR_OVERFLOW = -4       /* a byte count does not fit in int64          */
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

/* Validate explicit sizes as torch.split_with_sizes does (spec 0.7): every
 * size >= 0 and sum == n. On failure *bad_index is the first negative entry
 * (DP_ERR_NEGATIVE_SIZE) or -1 (DP_ERR_SIZE_SUM). Returns DP_OK or an error. */
int dp_check_chunk_sizes(int64_t n, int k, const int64_t *sizes, int *bad_index);

/* Wrap a possibly negative dim against rank ndim (at::maybe_wrap_dim).
 * Returns the wrapped dim in [0, ndim) or DP_ERR_ARG when out of
 * [-ndim, ndim-1] or ndim < 1. */
int dp_wrap_dim(int dim, int ndim);

#endif
