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

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>
#define DP_HAVE_STREAM 1
#else
#define DP_HAVE_STREAM 0
#endif

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
/* Streaming (non-temporal) stores                                    */
/* ------------------------------------------------------------------ */

/* A large copy writes far more than the caches hold, so ordinary stores
 * first read every destination line into the cache (read-for-ownership)
 * and later evict it: three memory passes for two. Streaming stores write
 * around the cache. glibc's memcpy streams only single calls above about
 * the shared cache size, so a copy made of many shorter runs (a scatter
 * along dim 1: one run per row) never gets them; here the whole job's size
 * decides. x86-64 only (SSE2 is part of the base ISA; AVX when the CPU has
 * it, detected at run time); elsewhere the ordinary path. */
#if DP_HAVE_STREAM
/* Copy n bytes with 16-byte streaming stores: plain memcpy up to the first
 * 16-byte aligned destination byte, then 64 bytes a step, then the tail. */
static void stream_copy_sse2(char *dst, const char *src, size_t n)
{
    size_t head = (size_t)(-(uintptr_t)dst & 15u);
    if (head > n)
        head = n;
    memcpy(dst, src, head);
    dst += head;
    src += head;
    n -= head;
    for (; n >= 64; n -= 64, dst += 64, src += 64) {
        __m128i a = _mm_loadu_si128((const __m128i *)(const void *)src);
        __m128i b = _mm_loadu_si128((const __m128i *)(const void *)(src + 16));
        __m128i c = _mm_loadu_si128((const __m128i *)(const void *)(src + 32));
        __m128i e = _mm_loadu_si128((const __m128i *)(const void *)(src + 48));
        _mm_stream_si128((__m128i *)(void *)dst, a);
        _mm_stream_si128((__m128i *)(void *)(dst + 16), b);
        _mm_stream_si128((__m128i *)(void *)(dst + 32), c);
        _mm_stream_si128((__m128i *)(void *)(dst + 48), e);
    }
    memcpy(dst, src, n);
}

/* The same with 32-byte AVX streaming stores (aligned to 32). */
__attribute__((target("avx")))
static void stream_copy_avx(char *dst, const char *src, size_t n)
{
    size_t head = (size_t)(-(uintptr_t)dst & 31u);
    if (head > n)
        head = n;
    memcpy(dst, src, head);
    dst += head;
    src += head;
    n -= head;
    for (; n >= 128; n -= 128, dst += 128, src += 128) {
        __m256i a = _mm256_loadu_si256((const __m256i *)(const void *)src);
        __m256i b = _mm256_loadu_si256((const __m256i *)(const void *)(src + 32));
        __m256i c = _mm256_loadu_si256((const __m256i *)(const void *)(src + 64));
        __m256i e = _mm256_loadu_si256((const __m256i *)(const void *)(src + 96));
        _mm256_stream_si256((__m256i *)(void *)dst, a);
        _mm256_stream_si256((__m256i *)(void *)(dst + 32), b);
        _mm256_stream_si256((__m256i *)(void *)(dst + 64), c);
        _mm256_stream_si256((__m256i *)(void *)(dst + 96), e);
    }
    memcpy(dst, src, n);
}
#endif

/* The streaming copy for this CPU, or NULL where there is none. */
typedef void (*stream_fn)(char *, const char *, size_t);

static stream_fn stream_kernel(void)
{
#if DP_HAVE_STREAM
    /* __builtin_cpu_supports reads a table libgcc fills at load time */
    if (__builtin_cpu_supports("avx"))
        return stream_copy_avx;
    return stream_copy_sse2;
#else
    return NULL;
#endif
}

/* Make the streaming stores visible to other threads before the job is
 * reported done (they are weakly ordered; the pool's lock alone does not
 * order them on every CPU). */
static void stream_fence(void)
{
#if DP_HAVE_STREAM
    _mm_sfence();
#endif
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
    dp_copy_run_mode(d, dst, src, DP_COPY_AUTO);
}

void dp_copy_run_mode(const dp_copy_desc *d, char *dst, const char *src, int mode)
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

    /* Streaming stores when the innermost runs are contiguous and long
     * enough to fill whole cache lines, and the job is large (AUTO) or the
     * caller asks (ALWAYS, for tests). */
    stream_fn stream = NULL;
    size_t run_bytes = (size_t)n * item;
    if (mode != DP_COPY_ORDINARY && iss == (int64_t)item && ids == (int64_t)item &&
        run_bytes >= DP_STREAM_MIN_RUN &&
        (mode == DP_COPY_STREAM ||
         (uint64_t)dp_copy_numel(d) * d->itemsize >= DP_STREAM_MIN_JOB))
        stream = stream_kernel();

    int64_t soff = 0, doff = 0;
    for (int i = 0; i < inner; i++)
        idx[i] = 0;

    for (;;) {
        if (stream != NULL)
            stream(dst + doff, src + soff, run_bytes);
        else
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
            break;
    }
    if (stream != NULL)
        stream_fence();
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
            return 0;   /* no element at all, whatever the other dims' strides */
    }
    for (int i = 0; i < ndim; i++) {
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
