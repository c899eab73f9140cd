/* copy.c - strided N-d copies on host memory, as pure C.
 *
 * Implements copy.h: the inner engine of every host-side scatter and gather.
 * A copy is first simplified (size-1 dims dropped, dims ordered by the
 * destination's strides, contiguous neighbours merged), then run as an
 * odometer over the outer dims with one memcpy per innermost run when that
 * run is contiguous on both sides, or a fixed-size element loop otherwise.
 * A fully contiguous copy simplifies to one dim and so runs as a single
 * memcpy; dp_copy_part cuts it into per-thread byte ranges.
 *
 * Addresses are kept as int64 byte offsets from the base pointers and only
 * turned into pointers for the element actually read or written: stepping a
 * pointer past either end of its buffer (as an odometer does before it
 * wraps, or as negative strides do) is undefined behaviour in C even when
 * the pointer is never dereferenced.
 */
#include "copy.h"

#include <string.h>

/* ------------------------------------------------------------------ */
/* Helpers                                                            */
/* ------------------------------------------------------------------ */

/* |x| as unsigned, defined for INT64_MIN too. */
static uint64_t magnitude(int64_t x)
{
    return x < 0 ? (uint64_t)0 - (uint64_t)x : (uint64_t)x;
}

/* The copy with nothing to do, in the shape simplify and part hand out. */
static void make_empty(dp_copy_desc *d)
{
    d->ndim = 1;
    d->shape[0] = 0;
    d->src_strides[0] = (int64_t)d->itemsize;
    d->dst_strides[0] = (int64_t)d->itemsize;
}

/* Copy n elements of `itemsize` bytes with the given byte strides. The
 * memcpy calls have a constant size in each fast path, so the compiler turns
 * them into single unaligned loads and stores: element addresses of a
 * strided view need not be aligned to the element size. Sizes 32 and 64
 * come from short contiguous runs widened into one element (dp_copy_run). */
static void copy_run1d(char *dst, const char *src, int64_t n, int64_t ds,
                       int64_t ss, size_t itemsize)
{
    int64_t item = (int64_t)itemsize;
    if (ds == item && ss == item) {
        memcpy(dst, src, (size_t)n * itemsize);
        return;
    }
#define DP_STRIDED_LOOP(K)                                   \
    for (int64_t i = 0; i < n; i++)                          \
        memcpy(dst + i * ds, src + i * ss, (K));             \
    return
    switch (itemsize) {
    case 1: DP_STRIDED_LOOP(1);
    case 2: DP_STRIDED_LOOP(2);
    case 4: DP_STRIDED_LOOP(4);
    case 8: DP_STRIDED_LOOP(8);
    case 16: DP_STRIDED_LOOP(16);
    case 32: DP_STRIDED_LOOP(32);
    case 64: DP_STRIDED_LOOP(64);
    default: DP_STRIDED_LOOP(itemsize);
    }
#undef DP_STRIDED_LOOP
}

/* ------------------------------------------------------------------ */
/* Public functions                                                   */
/* ------------------------------------------------------------------ */

int dp_copy_init(dp_copy_desc *d, int ndim, size_t itemsize, const int64_t *shape,
                 const int64_t *src_strides, const int64_t *dst_strides)
{
    if (d == NULL || ndim < 0 || ndim > DP_MAXDIMS || itemsize == 0)
        return -1;
    if (ndim > 0 && (shape == NULL || src_strides == NULL || dst_strides == NULL))
        return -1;
    for (int i = 0; i < ndim; i++)
        if (shape[i] < 0)   /* the struct promises shape >= 0 */
            return -1;
    d->ndim = ndim;
    d->itemsize = itemsize;
    for (int i = 0; i < ndim; i++) {
        d->shape[i] = shape[i];
        d->src_strides[i] = src_strides[i];
        d->dst_strides[i] = dst_strides[i];
    }
    return 0;
}

int64_t dp_copy_numel(const dp_copy_desc *d)
{
    int64_t n = 1;
    for (int i = 0; i < d->ndim; i++) {
        if (d->shape[i] == 0)
            return 0;
        n *= d->shape[i];
    }
    return n;
}

void dp_copy_simplify(dp_copy_desc *d)
{
    int64_t shape[DP_MAXDIMS], ss[DP_MAXDIMS], ds[DP_MAXDIMS];
    int n = 0;

    if (dp_copy_numel(d) == 0) {
        make_empty(d);
        return;
    }

    /* 1. Drop size-1 dims: their index is always 0, so strides are moot. */
    for (int i = 0; i < d->ndim; i++) {
        if (d->shape[i] == 1)
            continue;
        shape[n] = d->shape[i];
        ss[n] = d->src_strides[i];
        ds[n] = d->dst_strides[i];
        n++;
    }
    if (n == 0) {   /* one element: the contiguous 1-d form */
        d->ndim = 1;
        d->shape[0] = 1;
        d->src_strides[0] = d->dst_strides[0] = (int64_t)d->itemsize;
        return;
    }

    /* 2. Stable insertion sort by |dst stride|, largest first, moving shape
     * and both strides together. Writing in destination order keeps stores
     * sequential, and puts the dims that can merge next to each other. */
    for (int i = 1; i < n; i++) {
        int64_t sh = shape[i], s = ss[i], t = ds[i];
        uint64_t key = magnitude(t);
        int j = i;
        while (j > 0 && magnitude(ds[j - 1]) < key) {
            shape[j] = shape[j - 1];
            ss[j] = ss[j - 1];
            ds[j] = ds[j - 1];
            j--;
        }
        shape[j] = sh;
        ss[j] = s;
        ds[j] = t;
    }

    /* 3. Merge outer dim i into the running inner dim when stepping i once is
     * the same as stepping the inner dim shape-many times, on both sides.
     * This also merges broadcast reads (src stride 0 on both dims) and
     * reversed runs (both strides negative). Products are formed unsigned so
     * absurd inputs wrap instead of being undefined; for a real buffer they
     * are byte distances inside that buffer. */
    int out = n - 1;   /* write position, filled from the inner end */
    for (int i = n - 2; i >= 0; i--) {
        uint64_t sext = (uint64_t)shape[out] * (uint64_t)ss[out];
        uint64_t dext = (uint64_t)shape[out] * (uint64_t)ds[out];
        if (sext == (uint64_t)ss[i] && dext == (uint64_t)ds[i]) {
            shape[out] *= shape[i];
        } else {
            out--;
            shape[out] = shape[i];
            ss[out] = ss[i];
            ds[out] = ds[i];
        }
    }
    d->ndim = n - out;
    for (int i = 0; i < d->ndim; i++) {
        d->shape[i] = shape[out + i];
        d->src_strides[i] = ss[out + i];
        d->dst_strides[i] = ds[out + i];
    }
}

void dp_copy_run(const dp_copy_desc *d, char *dst, const char *src)
{
    int64_t idx[DP_MAXDIMS];
    int nd = d->ndim;

    if (nd <= 0) {
        memcpy(dst, src, d->itemsize);
        return;
    }
    if (dp_copy_numel(d) == 0)
        return;

    size_t item = d->itemsize;
    int inner = nd - 1;
    int64_t n = d->shape[inner];
    int64_t iss = d->src_strides[inner], ids = d->dst_strides[inner];

    /* A short innermost run that is contiguous on both sides (e.g. a chunk
     * of a few columns) is treated as one wide element of the next dim out:
     * a fixed-size copy per run is several times faster than calling libc
     * memcpy for every 8 or 16 bytes. */
    if (inner > 0 && iss == (int64_t)item && ids == (int64_t)item &&
        (uint64_t)n * item <= 64) {
        item *= (size_t)n;
        inner--;
        n = d->shape[inner];
        iss = d->src_strides[inner];
        ids = d->dst_strides[inner];
    }

    int64_t soff = 0, doff = 0;
    for (int i = 0; i < inner; i++)
        idx[i] = 0;

    for (;;) {
        copy_run1d(dst + doff, src + soff, n, ids, iss, item);

        /* Odometer over dims [0, inner): bump the innermost outer dim; when
         * it wraps, rewind its offset and carry into the next one out. */
        int k = inner - 1;
        for (; k >= 0; k--) {
            soff += d->src_strides[k];
            doff += d->dst_strides[k];
            if (++idx[k] < d->shape[k])
                break;
            soff -= d->src_strides[k] * d->shape[k];
            doff -= d->dst_strides[k] * d->shape[k];
            idx[k] = 0;
        }
        if (k < 0)
            return;
    }
}

int dp_copy_part(const dp_copy_desc *d, int parts, int part, dp_copy_desc *out,
                 int64_t *src_offset, int64_t *dst_offset)
{
    if (parts < 1 || part < 0 || part >= parts)
        return -1;
    *out = *d;
    *src_offset = 0;
    *dst_offset = 0;

    if (dp_copy_numel(d) == 0)
        return 0;   /* every piece is the same empty copy */

    int k = 0;
    while (k < d->ndim && d->shape[k] <= 1)
        k++;
    if (k == d->ndim) {
        /* A single element (possibly ndim 0): piece 0 does it all. */
        if (part != 0)
            make_empty(out);
        return 0;
    }

    /* Rows [start, start + len) of dim k; the first n % parts pieces get one
     * extra row. start <= n, so start * stride stays inside the buffer. */
    int64_t n = d->shape[k];
    int64_t base = n / parts, rem = n % parts;
    int64_t len = base + (part < rem);
    int64_t start = base * part + (part < rem ? part : rem);
    out->shape[k] = len;
    if (len > 0) {
        *src_offset = start * d->src_strides[k];
        *dst_offset = start * d->dst_strides[k];
    }
    return 0;
}

int dp_layout_is_dense(int ndim, const int64_t *shape, const int64_t *strides,
                       size_t itemsize, int *perm)
{
    int order[DP_MAXDIMS];

    if (ndim < 0 || ndim > DP_MAXDIMS)
        return 0;

    /* Stable sort of all dims by stride, largest first; equal strides keep
     * the lower dim outer. Size-0/1 dims go where their stride puts them:
     * their stride does not address anything, so any place is correct. */
    for (int i = 0; i < ndim; i++) {
        int j = i;
        while (j > 0 && strides[order[j - 1]] < strides[i]) {
            order[j] = order[j - 1];
            j--;
        }
        order[j] = i;
    }

    /* From the innermost dim out, each dim with extent > 1 must step exactly
     * over everything inside it. That also rules out zero, negative and
     * repeated strides, and gaps. */
    int64_t expect = (int64_t)itemsize;
    for (int i = ndim - 1; i >= 0; i--) {
        int dim = order[i];
        if (shape[dim] <= 1)
            continue;
        if (strides[dim] != expect)
            return 0;
        if (expect > INT64_MAX / shape[dim])
            return 0;   /* no real buffer is this large */
        expect *= shape[dim];
    }
    if (perm != NULL)
        for (int i = 0; i < ndim; i++)
            perm[i] = order[i];
    return 1;
}

void dp_dense_strides(int ndim, const int64_t *shape, size_t itemsize,
                      const int *perm, int64_t *strides_out)
{
    /* Like NumPy and PyTorch, a size-0 dim counts as 1 here so the strides of
     * an empty array stay distinct. The product is formed unsigned; callers
     * check numel * itemsize for overflow before they allocate. */
    uint64_t acc = (uint64_t)itemsize;
    for (int i = ndim - 1; i >= 0; i--) {
        int dim = perm != NULL ? perm[i] : i;
        strides_out[dim] = (int64_t)acc;
        acc *= (uint64_t)(shape[dim] > 1 ? shape[dim] : 1);
    }
}

/* ------------------------------------------------------------------ */
/* Overlap checks                                                      */
/* ------------------------------------------------------------------ */

int dp_layout_extent(int ndim, const int64_t *shape, const int64_t *strides,
                     size_t itemsize, int64_t *lo, int64_t *hi)
{
    uint64_t neg = 0, pos = (uint64_t)itemsize;
    *lo = 0;
    *hi = (int64_t)itemsize;
    for (int i = 0; i < ndim; i++)
        if (shape[i] == 0)
            return 0;
    for (int i = 0; i < ndim; i++) {
        if (shape[i] <= 1)
            continue;
        uint64_t m = magnitude(strides[i]), n = (uint64_t)(shape[i] - 1);
        if (m != 0 && n > (uint64_t)INT64_MAX / m)
            return -1;
        if (strides[i] < 0)
            neg += m * n;
        else
            pos += m * n;
        if (neg > (uint64_t)INT64_MAX || pos > (uint64_t)INT64_MAX)
            return -1;
    }
    *lo = -(int64_t)neg;
    *hi = (int64_t)pos;
    return 1;
}

int dp_layouts_may_overlap(const char *pa, int ndim_a, const int64_t *shape_a,
                           const int64_t *strides_a, size_t itemsize_a,
                           const char *pb, int ndim_b, const int64_t *shape_b,
                           const int64_t *strides_b, size_t itemsize_b)
{
    int64_t alo, ahi, blo, bhi;
    int ra = dp_layout_extent(ndim_a, shape_a, strides_a, itemsize_a, &alo, &ahi);
    int rb = dp_layout_extent(ndim_b, shape_b, strides_b, itemsize_b, &blo, &bhi);
    if (ra == 0 || rb == 0)
        return 0;
    if (ra < 0 || rb < 0)
        return 1;
    /* Compare as addresses; pointer arithmetic outside a buffer is undefined,
     * so work on uintptr_t (wrap-around is well defined there). */
    uintptr_t a0 = (uintptr_t)pa - (uintptr_t)(uint64_t)-alo;
    uintptr_t a1 = (uintptr_t)pa + (uintptr_t)ahi;
    uintptr_t b0 = (uintptr_t)pb - (uintptr_t)(uint64_t)-blo;
    uintptr_t b1 = (uintptr_t)pb + (uintptr_t)bhi;
    return a0 < b1 && b0 < a1;
}

int dp_layout_has_internal_overlap(int ndim, const int64_t *shape,
                                   const int64_t *strides, size_t itemsize)
{
    int order[DP_MAXDIMS];
    int n = 0;
    if (ndim < 0 || ndim > DP_MAXDIMS)
        return 1;
    for (int i = 0; i < ndim; i++) {
        if (shape[i] == 0)
            return 0;   /* no element at all */
        if (shape[i] <= 1)
            continue;
        if (strides[i] == 0)
            return 1;
        /* insertion sort by |stride|, smallest first */
        int j = n++;
        while (j > 0 && magnitude(strides[order[j - 1]]) > magnitude(strides[i])) {
            order[j] = order[j - 1];
            j--;
        }
        order[j] = i;
    }
    /* Each dim must step over the whole byte extent of the dims inside it. */
    uint64_t extent = (uint64_t)itemsize;
    for (int k = 0; k < n; k++) {
        int d = order[k];
        uint64_t m = magnitude(strides[d]);
        if (m < extent)
            return 1;
        uint64_t steps = (uint64_t)(shape[d] - 1);
        if (steps > ((uint64_t)INT64_MAX - extent) / m)
            return 1;   /* no real buffer is this large */
        extent += m * steps;
    }
    return 0;
}
