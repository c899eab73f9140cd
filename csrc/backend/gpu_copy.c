/* gpu_copy.c - the executor of copy jobs that touch a CUDA device
 * (dp_gpu_copy), with pinned staging, and dp_gpu_add; it picks for each copy:
 *
 *   host -> device   pinned source, contiguous:       one cudaMemcpyAsync
 *                    pinned source, rows >= 2D limit:  one cudaMemcpy2DAsync
 *                    otherwise: packed on the host into pinned staging (two
 *                    halves, pack one while the other is in flight), then
 *                    contiguous DMA; a strided destination gets an unpack
 *                    kernel from a device temporary.
 *   device -> host   the mirror image (pack kernel first when the source is
 *                    strided, unpack on the host from staging).
 *   device -> same   cudaMemcpyAsync / cudaMemcpy2DAsync / strided kernel.
 *   device -> other  cudaMemcpyPeerAsync when both sides are contiguous
 *                    (direct with peer access, staged by the runtime without);
 *                    a strided side: the kernel reads the peer directly when
 *                    peer access is on, else pack, peer copy, unpack.
 *
 * Nothing here dereferences a device pointer on the host.
 */
#include "gpu.h"
#include "gpu_fork.h"
#include "env.h"
#include "alloc.h"
#include "pool.h"

#include <stdlib.h>
#include <string.h>

/* A device temporary for one copy (freed by the caller after a sync). */
typedef struct {
    int dev;
    void *ptr;
    size_t rounded;
} gtemp;

static dpc_status temp_alloc(gtemp *t, int dev, size_t nbytes)
{
    t->dev = dev;
    t->ptr = NULL;
    return dp_gpu_alloc(dev, nbytes, &t->ptr, &t->rounded);
}

static void temp_free(gtemp *t)
{
    if (t->ptr != NULL) {
        dp_gpu_free(t->dev, t->ptr, t->rounded);
        t->ptr = NULL;
    }
}

/* ------------------------------------------------------------------ */
/* Layout helpers                                                      */
/* ------------------------------------------------------------------ */

static size_t min_run(void)
{
    static size_t v;
    if (v == 0) {
        unsigned long long x;   /* env.h's rule; unset or invalid: the default */
        v = dp_env_uint("DPMINI_2D_MIN_RUN", 1, SIZE_MAX, &x) == DP_ENV_OK
                ? (size_t)x : DP_2D_MIN_RUN_DEFAULT;
    }
    return v;
}

/* Are `strides` C-contiguous over d's shape (in d's dim order)? */
static int contiguous(const dp_copy_desc *d, const int64_t *strides)
{
    int64_t expect = (int64_t)d->itemsize;
    for (int k = d->ndim - 1; k >= 0; k--) {
        if (d->shape[k] != 1 && strides[k] != expect) {
            return 0;
        }
        expect *= d->shape[k];
    }
    return 1;
}

/* A copy of rows: each side's innermost dim contiguous, rows at positive
 * pitches that cudaMemcpy2D accepts on dev (<= cudaDevAttrMaxPitch, which is
 * at most INT_MAX; larger pitches take the pack path). Fills width, height
 * (rows) and pitches in bytes. */
static int as_rows(const dp_copy_desc *d, int dev, size_t *width, size_t *height,
                   size_t *dpitch, size_t *spitch)
{
    size_t is = d->itemsize;
    if (d->ndim == 1 && d->src_strides[0] == (int64_t)is && d->dst_strides[0] == (int64_t)is) {
        *width = (size_t)d->shape[0] * is;
        *height = 1;
        *dpitch = *spitch = *width;
        return 1;
    }
    if (d->ndim != 2 || d->src_strides[1] != (int64_t)is || d->dst_strides[1] != (int64_t)is) {
        return 0;
    }
    size_t w = (size_t)d->shape[1] * is;
    if (d->src_strides[0] < (int64_t)w || d->dst_strides[0] < (int64_t)w) {
        return 0;
    }
    size_t maxp = dpc_max_pitch(dev);
    if ((size_t)d->src_strides[0] > maxp || (size_t)d->dst_strides[0] > maxp || w > maxp) {
        return 0;
    }
    *width = w;
    *height = (size_t)d->shape[0];
    *dpitch = (size_t)d->dst_strides[0];
    *spitch = (size_t)d->src_strides[0];
    return 1;
}

static dpc_status kdesc_from(const dp_copy_desc *d, const int64_t *src_strides,
                             const int64_t *dst_strides, dpc_kdesc *k)
{
    if (d->ndim > DPC_KMAXDIMS) {
        return dpc_fail(DPC_LIB_DPMINI, 1, 0, -1, "dp_gpu_copy", __FILE__, __LINE__,
                        "more strided dimensions than the copy kernel supports (16) after "
                        "merging; make the array contiguous first");
    }
    k->ndim = d->ndim > 0 ? d->ndim : 1;
    k->itemsize = (int)d->itemsize;
    k->numel = dp_copy_numel(d);
    for (int i = 0; i < d->ndim; i++) {
        k->shape[i] = d->shape[i];
        k->src_strides[i] = src_strides[i];
        k->dst_strides[i] = dst_strides[i];
    }
    if (d->ndim == 0) {
        k->shape[0] = 1;
        k->src_strides[0] = k->dst_strides[0] = (int64_t)d->itemsize;
    }
    return dpc_ok();
}

/* C-contiguous strides over d's shape. */
static void dense_strides(const dp_copy_desc *d, int64_t *out)
{
    int64_t s = (int64_t)d->itemsize;
    for (int k = d->ndim - 1; k >= 0; k--) {
        out[k] = s;
        s *= d->shape[k];
    }
}

/* Host side of staging: elements [a, b) (C order over d's shape) between a
 * strided host region and a packed buffer. pack: packed <- strided; else
 * strided <- packed. Runs of the innermost dim use memcpy when contiguous. */
static void host_range(const dp_copy_desc *d, const int64_t *strides, char *strided,
                       char *packed, int64_t a, int64_t b, int pack)
{
    int nd = d->ndim;
    size_t is = d->itemsize;
    int64_t idx[DP_MAXDIMS];
    if (nd == 0) {
        if (a < b) {
            pack ? memcpy(packed, strided, is) : memcpy(strided, packed, is);
        }
        return;
    }
    int64_t r = a;
    for (int k = nd - 1; k >= 0; k--) {
        idx[k] = r % d->shape[k];
        r /= d->shape[k];
    }
    int64_t inner = d->shape[nd - 1], istride = strides[nd - 1];
    for (int64_t i = a; i < b;) {
        int64_t off = 0;
        for (int k = 0; k < nd; k++) {
            off += idx[k] * strides[k];
        }
        int64_t run = inner - idx[nd - 1];
        if (run > b - i) {
            run = b - i;
        }
        char *p = strided + off, *q = packed + (i - a) * (int64_t)is;
        if (istride == (int64_t)is) {
            pack ? memcpy(q, p, (size_t)run * is) : memcpy(p, q, (size_t)run * is);
        } else {
            for (int64_t e = 0; e < run; e++) {
                pack ? memcpy(q + e * (int64_t)is, p + e * istride, is)
                     : memcpy(p + e * istride, q + e * (int64_t)is, is);
            }
        }
        i += run;
        idx[nd - 1] += run;
        for (int k = nd - 1; k > 0 && idx[k] >= d->shape[k]; k--) {
            idx[k] = 0;
            idx[k - 1]++;
        }
    }
}

/* ------------------------------------------------------------------ */
/* Pinned staging                                                      */
/* ------------------------------------------------------------------ */

typedef struct {
    pthread_mutex_t mu;      /* held for a whole staged copy            */
    char *half[2];           /* pinned, DP_STAGE_HALF bytes each        */
} gstage;

static gstage stages[DP_GPU_MAX];
static pthread_once_t stage_once = PTHREAD_ONCE_INIT;

static void stage_init(void)
{
    for (int i = 0; i < DP_GPU_MAX; i++) {
        pthread_mutex_init(&stages[i].mu, NULL);
    }
}

/* Lock dev's staging (allocating it on first use). */
static dpc_status stage_lock(int dev, gstage **out)
{
    pthread_once(&stage_once, stage_init);
    gstage *g = &stages[dev];
    pthread_mutex_lock(&g->mu);
    for (int h = 0; h < 2; h++) {
        if (g->half[h] == NULL) {
            dpc_status s = dpc_host_alloc(dev, DP_STAGE_HALF, (void **)&g->half[h]);
            if (s.code != 0) {
                pthread_mutex_unlock(&g->mu);
                return s;
            }
        }
    }
    *out = g;
    return dpc_ok();
}

/* host (strided per d->src_strides) -> dst (device, contiguous in d's order). */
static dpc_status staged_h2d(const dp_copy_desc *d, char *dst, int dev, const char *src)
{
    gstage *g;
    dpc_stream ss[2] = {NULL, NULL};
    int got = 0; /* streams obtained: only those are synced on failure */
    dpc_status s;
    DPC_TRY(stage_lock(dev, &g));
    int64_t n = dp_copy_numel(d), per = (int64_t)(DP_STAGE_HALF / d->itemsize);
    int k = 0;
    DPC_TRY_GOTO(s, dpc_stream_get(dev, DP_STAGE_SLOT, &ss[0]), done);
    got = 1;
    DPC_TRY_GOTO(s, dpc_stream_get(dev, DP_STAGE_SLOT + 1, &ss[1]), done);
    got = 2;
    for (int64_t a = 0; a < n; a += per, k ^= 1) {
        int64_t b = a + per < n ? a + per : n;
        DPC_TRY_GOTO(s, dpc_stream_sync(dev, ss[k]), done); /* half k is free again */
        host_range(d, d->src_strides, (char *)src, g->half[k], a, b, 1);
        DPC_TRY_GOTO(s, dpc_memcpy_async(dev, dst + a * (int64_t)d->itemsize, g->half[k],
                                         (size_t)(b - a) * d->itemsize, DPC_H2D, ss[k]),
                     done);
    }
    DPC_TRY_GOTO(s, dpc_stream_sync(dev, ss[0]), done);
    DPC_TRY_GOTO(s, dpc_stream_sync(dev, ss[1]), done);
done:
    for (int i = 0; s.code != 0 && i < got; i++) { /* never leave a half in flight */
        (void)dpc_stream_sync(dev, ss[i]);
    }
    pthread_mutex_unlock(&g->mu);
    return s;
}

/* src (device, contiguous in d's order) -> host (strided per d->dst_strides). */
static dpc_status staged_d2h(const dp_copy_desc *d, char *dst, int dev, const char *src)
{
    gstage *g;
    dpc_stream ss[2] = {NULL, NULL};
    int got = 0; /* streams obtained: only those are synced on failure */
    dpc_status s;
    DPC_TRY(stage_lock(dev, &g));
    int64_t n = dp_copy_numel(d), per = (int64_t)(DP_STAGE_HALF / d->itemsize);
    int64_t prev_a = -1, prev_b = -1;
    int k = 0;
    DPC_TRY_GOTO(s, dpc_stream_get(dev, DP_STAGE_SLOT, &ss[0]), done);
    got = 1;
    DPC_TRY_GOTO(s, dpc_stream_get(dev, DP_STAGE_SLOT + 1, &ss[1]), done);
    got = 2;
    for (int64_t a = 0; a < n; a += per, k ^= 1) {
        int64_t b = a + per < n ? a + per : n;
        DPC_TRY_GOTO(s, dpc_memcpy_async(dev, g->half[k], src + a * (int64_t)d->itemsize,
                                         (size_t)(b - a) * d->itemsize, DPC_D2H, ss[k]),
                     done);
        if (prev_a >= 0) { /* unpack the previous range while this one flies */
            DPC_TRY_GOTO(s, dpc_stream_sync(dev, ss[k ^ 1]), done);
            host_range(d, d->dst_strides, dst, g->half[k ^ 1], prev_a, prev_b, 0);
        }
        prev_a = a;
        prev_b = b;
    }
    if (prev_a >= 0) {
        DPC_TRY_GOTO(s, dpc_stream_sync(dev, ss[k ^ 1]), done);
        host_range(d, d->dst_strides, dst, g->half[k ^ 1], prev_a, prev_b, 0);
    }
done:
    for (int i = 0; s.code != 0 && i < got; i++) {
        (void)dpc_stream_sync(dev, ss[i]);
    }
    pthread_mutex_unlock(&g->mu);
    return s;
}

/* ------------------------------------------------------------------ */
/* Copies                                                              */
/* ------------------------------------------------------------------ */

static dpc_status use_stream(dp_gpu_sync *sy, int dev, int slot, dpc_stream *s)
{
    DPC_TRY(dpc_stream_get(dev, slot, s));
    if (sy->dev == dev) {
        sy->used |= 1u << slot;
    }
    return dpc_ok();
}

static dpc_status copy_h2d(const dp_copy_desc *d, char *dst, int dev, const char *src,
                           int slot, dp_gpu_sync *sy)
{
    size_t bytes = (size_t)dp_copy_numel(d) * d->itemsize, w, h, dp, sp;
    int dc = contiguous(d, d->dst_strides), sc = contiguous(d, d->src_strides);
    dpc_stream s;
    dpc_status st = dpc_ok();
    DPC_TRY(use_stream(sy, dev, slot, &s));
    if (dpc_is_pinned(dev, src)) {
        if (dc && sc) {
            return dpc_memcpy_async(dev, dst, src, bytes, DPC_H2D, s);
        }
        if (as_rows(d, dev, &w, &h, &dp, &sp) && w >= min_run()) {
            return dpc_memcpy2d_async(dev, dst, dp, src, sp, w, h, DPC_H2D, s);
        }
    }
    if (dc) {
        return staged_h2d(d, dst, dev, src);
    }
    /* strided destination: stage into a dense temporary, unpack on the device */
    gtemp t = {0};
    dpc_kdesc k;
    int64_t dense[DP_MAXDIMS];
    dense_strides(d, dense);
    DPC_TRY_GOTO(st, kdesc_from(d, dense, d->dst_strides, &k), done);
    DPC_TRY_GOTO(st, temp_alloc(&t, dev, bytes), done);
    DPC_TRY_GOTO(st, staged_h2d(d, t.ptr, dev, src), done);
    DPC_TRY_GOTO(st, dpc_launch_strided_copy(dev, &k, dst, t.ptr, s), done);
    DPC_TRY_GOTO(st, dpc_stream_sync(dev, s), done);
done:
    if (st.code != 0 && t.ptr != NULL) { /* nothing may still touch t when cached */
        (void)dpc_stream_sync(dev, s);
    }
    temp_free(&t);
    return st;
}

static dpc_status copy_d2h(const dp_copy_desc *d, char *dst, const char *src, int dev,
                           int slot, dp_gpu_sync *sy)
{
    size_t bytes = (size_t)dp_copy_numel(d) * d->itemsize, w, h, dp, sp;
    int dc = contiguous(d, d->dst_strides), sc = contiguous(d, d->src_strides);
    dpc_stream s;
    dpc_status st = dpc_ok();
    DPC_TRY(use_stream(sy, dev, slot, &s));
    if (dpc_is_pinned(dev, dst)) {
        if (dc && sc) {
            return dpc_memcpy_async(dev, dst, src, bytes, DPC_D2H, s);
        }
        if (as_rows(d, dev, &w, &h, &dp, &sp) && w >= min_run()) {
            return dpc_memcpy2d_async(dev, dst, dp, src, sp, w, h, DPC_D2H, s);
        }
    }
    if (sc) {
        return staged_d2h(d, dst, dev, src);
    }
    /* strided source: pack on the device into a dense temporary first */
    gtemp t = {0};
    dpc_kdesc k;
    int64_t dense[DP_MAXDIMS];
    dense_strides(d, dense);
    DPC_TRY_GOTO(st, kdesc_from(d, d->src_strides, dense, &k), done);
    DPC_TRY_GOTO(st, temp_alloc(&t, dev, bytes), done);
    DPC_TRY_GOTO(st, dpc_launch_strided_copy(dev, &k, t.ptr, src, s), done);
    DPC_TRY_GOTO(st, dpc_stream_sync(dev, s), done);
    DPC_TRY_GOTO(st, staged_d2h(d, dst, dev, t.ptr), done);
done:
    if (st.code != 0 && t.ptr != NULL) { /* nothing may still touch t when cached */
        (void)dpc_stream_sync(dev, s);
    }
    temp_free(&t);
    return st;
}

static int peer_on(int dev, int peer)
{
    static signed char state[DP_GPU_MAX][DP_GPU_MAX]; /* 0 unknown, 1 on, -1 off */
    if (state[dev][peer] == 0) {
        int on = 0;
        dpc_status s = dpc_enable_peer(dev, peer, &on);
        state[dev][peer] = (s.code == 0 && on) ? 1 : -1;
    }
    return state[dev][peer] == 1;
}

static dpc_status copy_d2d(const dp_copy_desc *d, char *dst, int ddev, const char *src,
                           int sdev, int slot, dp_gpu_sync *sy)
{
    size_t bytes = (size_t)dp_copy_numel(d) * d->itemsize, w, h, dp, sp;
    int dc = contiguous(d, d->dst_strides), sc = contiguous(d, d->src_strides);
    dpc_stream s, s2 = NULL;
    dpc_kdesc k;
    dpc_status st = dpc_ok();
    gtemp ts = {0}, td = {0};
    int64_t dense[DP_MAXDIMS];
    DPC_TRY(use_stream(sy, ddev, slot, &s));
    if (ddev == sdev) {
        if (dc && sc) {
            return dpc_memcpy_async(ddev, dst, src, bytes, DPC_D2D, s);
        }
        if (as_rows(d, ddev, &w, &h, &dp, &sp) && w >= min_run()) {
            return dpc_memcpy2d_async(ddev, dst, dp, src, sp, w, h, DPC_D2D, s);
        }
        DPC_TRY(kdesc_from(d, d->src_strides, d->dst_strides, &k));
        return dpc_launch_strided_copy(ddev, &k, dst, src, s);
    }
    if (dc && sc) {
        peer_on(ddev, sdev);
        return dpc_memcpy_peer_async(dst, ddev, src, sdev, bytes, s);
    }
    /* The kernel reads the peer's memory directly only when it is one of
     * dpmini's own cudaMalloc blocks: peer access does not cover borrowed
     * VMM, stream-ordered-pool or IPC memory (gpu_owned.c). */
    if (dp_gpu_owned(sdev, src) && peer_on(ddev, sdev)) {
        DPC_TRY(kdesc_from(d, d->src_strides, d->dst_strides, &k));
        return dpc_launch_strided_copy(ddev, &k, dst, src, s);
    }
    /* no peer access: pack on the source device, runtime-staged peer copy,
     * unpack on the destination device */
    dense_strides(d, dense);
    const char *from = src;
    if (!sc) {
        DPC_TRY_GOTO(st, kdesc_from(d, d->src_strides, dense, &k), done);
        DPC_TRY_GOTO(st, temp_alloc(&ts, sdev, bytes), done);
        dpc_stream got;
        DPC_TRY_GOTO(st, dpc_stream_get(sdev, slot, &got), done);
        s2 = got; /* only an obtained handle is synced on failure */
        DPC_TRY_GOTO(st, dpc_launch_strided_copy(sdev, &k, ts.ptr, src, s2), done);
        DPC_TRY_GOTO(st, dpc_stream_sync(sdev, s2), done);
        from = ts.ptr;
    }
    char *to = dst;
    if (!dc) {
        DPC_TRY_GOTO(st, temp_alloc(&td, ddev, bytes), done);
        to = td.ptr;
    }
    DPC_TRY_GOTO(st, dpc_memcpy_peer_async(to, ddev, from, sdev, bytes, s), done);
    if (!dc) {
        DPC_TRY_GOTO(st, kdesc_from(d, dense, d->dst_strides, &k), done);
        DPC_TRY_GOTO(st, dpc_launch_strided_copy(ddev, &k, dst, td.ptr, s), done);
    }
    DPC_TRY_GOTO(st, dpc_stream_sync(ddev, s), done);
done:
    if (st.code != 0) { /* the peer copy or a kernel may still use the temporaries */
        (void)dpc_stream_sync(ddev, s);
        if (s2 != NULL) {
            (void)dpc_stream_sync(sdev, s2);
        }
    }
    temp_free(&ts);
    temp_free(&td);
    return st;
}

/* A device worker thread (pool.c, kind 2) of dev makes dev its current
 * device for good, once: its CUDA calls then never switch devices (nor
 * create a context on device 0, the default of a fresh thread). */
static void adopt_worker_device(int dev)
{
    static _Thread_local int adopted = -1;
    if (adopted != dev && dp_pool_on_worker(2, dev)) {
        if (dpc_set_device(dev).code == 0) {
            adopted = dev;
        }
    }
}

dpc_status dp_gpu_copy(const dp_copy_desc *d, char *dst, int dst_dev, const char *src,
                       int src_dev, int slot, dp_gpu_sync *sync)
{
    slot = slot % DP_GPU_SLOTS;
    if (dp_copy_numel(d) == 0) {
        return dpc_ok();
    }
    if (dp_gpu_forked()) {
        return dp_gpu_forked_status(dst_dev >= 0 ? dst_dev : src_dev);
    }
    adopt_worker_device(src_dev < 0 || dst_dev >= 0 ? dst_dev : src_dev);
    if (src_dev < 0) {
        return copy_h2d(d, dst, dst_dev, src, slot, sync);
    }
    if (dst_dev < 0) {
        return copy_d2h(d, dst, src, src_dev, slot, sync);
    }
    return copy_d2d(d, dst, dst_dev, src, src_dev, slot, sync);
}

dpc_status dp_gpu_sync_finish(dp_gpu_sync *sync)
{
    dpc_status first = dpc_ok();
    for (int slot = 0; slot < DP_GPU_SLOTS; slot++) {
        if (sync->used & (1u << slot)) {
            dpc_stream s;
            dpc_status st = dpc_stream_get(sync->dev, slot, &s);
            if (st.code == 0) {
                st = dpc_stream_sync(sync->dev, s);
            }
            if (st.code != 0 && first.code == 0) {
                first = st; /* keep the first error, sync the rest */
            }
        }
    }
    sync->used = 0;
    return first;
}

dpc_status dp_gpu_add(int dev, int type, void *acc, const void *x, int64_t numel)
{
    dpc_stream s;
    if (dp_gpu_forked()) {
        return dp_gpu_forked_status(dev);
    }
    DPC_TRY(dpc_stream_get(dev, 0, &s));
    DPC_TRY(dpc_launch_add(dev, type, acc, x, numel, s));
    return dpc_stream_sync(dev, s);
}
