/* copy.h - strided N-d copies on host memory, as pure C.
 *
 * No Python.h: unit-tested and fuzzed on its own.
 * A copy is described by one shape and two stride vectors. Strides are in
 * BYTES and may be negative or zero (zero only on the source: a broadcast
 * read). Shapes are in elements. Pointers point at element [0,...,0].
 */
#ifndef DPMINI_COPY_H
#define DPMINI_COPY_H

#include <stdint.h>
#include <stddef.h>

#define DP_MAXDIMS 64

typedef struct {
    int ndim;                        /* 0..DP_MAXDIMS; 0 means one element  */
    size_t itemsize;                 /* bytes per element, >= 1             */
    int64_t shape[DP_MAXDIMS];       /* elements, each >= 0                 */
    int64_t src_strides[DP_MAXDIMS]; /* bytes, any sign                     */
    int64_t dst_strides[DP_MAXDIMS]; /* bytes, any sign, never 0 where the
                                        matching shape entry is > 1         */
} dp_copy_desc;

/* Fill *d for a copy of `ndim` dims. Returns 0, or -1 if ndim is out of range
 * or itemsize is 0. */
int dp_copy_init(dp_copy_desc *d, int ndim, size_t itemsize, const int64_t *shape,
                 const int64_t *src_strides, const int64_t *dst_strides);

/* Number of elements (product of shape); 0 if any dim is 0. */
int64_t dp_copy_numel(const dp_copy_desc *d);

/* Rewrite *d to an equivalent copy with as few dims as the layout allows:
 * drop size-1 dims, order dims so the destination's innermost stride comes
 * last, merge neighbouring dims that are contiguous in both source and
 * destination. A copy that is fully contiguous on both sides ends as ndim 1
 * with both strides equal to itemsize. Pointers are unaffected (only the
 * order and grouping of dims change, never the element addresses). */
void dp_copy_simplify(dp_copy_desc *d);

/* Execute the copy: for every index i, dst[i] = src[i] (itemsize bytes).
 * Contiguous innermost runs use memcpy. Source and destination must not
 * overlap. Never touches a byte outside the addressed elements. */
void dp_copy_run(const dp_copy_desc *d, char *dst, const char *src);

/* dp_copy_run with a choice of stores. DP_COPY_AUTO (what dp_copy_run does):
 * streaming (non-temporal, cache-bypassing) stores when the job copies at
 * least DP_STREAM_MIN_JOB bytes in contiguous runs of at least
 * DP_STREAM_MIN_RUN bytes, on x86-64 (AVX when the CPU has it, else SSE2);
 * ordinary stores otherwise. DP_COPY_ORDINARY never streams; DP_COPY_STREAM
 * streams whenever the runs allow it, whatever the job size (for tests and
 * the fuzzer: the result is the same bytes either way). */
#define DP_COPY_AUTO 0
#define DP_COPY_ORDINARY 1
#define DP_COPY_STREAM 2
#define DP_STREAM_MIN_JOB ((uint64_t)4 << 20)   /* 4 MiB: beyond a core's cache share */
#define DP_STREAM_MIN_RUN ((size_t)256)          /* four 64-byte lines */
void dp_copy_run_mode(const dp_copy_desc *d, char *dst, const char *src, int mode);

/* Cut a (simplified) copy into `parts` pieces of about equal bytes along its
 * outermost dim with more than one element, for running on several threads.
 * Writes piece `part` (0-based) to *out and the byte offsets to add to the
 * src and dst pointers. A piece may be empty (numel 0) when there is less
 * work than parts. Returns 0, or -1 when parts < 1 or part out of range. */
int dp_copy_part(const dp_copy_desc *d, int parts, int part, dp_copy_desc *out,
                 int64_t *src_offset, int64_t *dst_offset);

/* Is the strided layout (shape, strides in bytes) dense and non-overlapping
 * with positive strides, i.e. a permutation of a contiguous layout? Size-1
 * and size-0 dims are ignored. When it is, and perm is not NULL, perm[0..ndim)
 * receives the dims ordered from the largest stride to the smallest, which is
 * the order to allocate a copy that keeps the same strides (PyTorch's
 * memory_format=preserve rule, docs/spec.md 3.4). Returns 1 or 0. */
int dp_layout_is_dense(int ndim, const int64_t *shape, const int64_t *strides,
                       size_t itemsize, int *perm);

/* Strides (bytes) of a fresh dense array of `shape` laid out in the dim order
 * perm (perm[0] outermost). perm NULL means C order. */
void dp_dense_strides(int ndim, const int64_t *shape, size_t itemsize,
                      const int *perm, int64_t *strides_out);

/* Overlap checks (PyTorch's assert_no_internal_overlap and
 * assert_no_partial_overlap, for copies with a caller-given destination).
 *
 * dp_layout_extent: the byte range [*lo, *hi) a strided layout can touch, as
 * offsets from its element [0,...,0] (*lo <= 0 < *hi). Returns 0 for an
 * empty layout (a dim of size 0: nothing is touched), 1 otherwise, and -1
 * when the range does not fit in int64 (no real buffer is that large). */
int dp_layout_extent(int ndim, const int64_t *shape, const int64_t *strides,
                     size_t itemsize, int64_t *lo, int64_t *hi);

/* May layout a (element [0,...,0] at pa) and layout b (at pb) share a byte?
 * Conservative: 1 when their byte extents intersect, so two interleaved
 * views such as x[::2] and x[1::2] count as overlapping; 0 when either is
 * empty or the extents are disjoint. */
int dp_layouts_may_overlap(const char *pa, int ndim_a, const int64_t *shape_a,
                           const int64_t *strides_a, size_t itemsize_a,
                           const char *pb, int ndim_b, const int64_t *shape_b,
                           const int64_t *strides_b, size_t itemsize_b);

/* May two different indices of one layout address a common byte? 1 for a
 * zero stride on a dim of size > 1, and whenever, with the dims of size > 1
 * ordered by |stride|, a stride is smaller than the byte extent of the dims
 * inside it. Every view made by slicing (any steps, signs and dim order) of
 * a dense array passes (0); exotic as_strided layouts that interleave
 * without sharing bytes are refused too (conservative). */
int dp_layout_has_internal_overlap(int ndim, const int64_t *shape,
                                   const int64_t *strides, size_t itemsize);

#endif
