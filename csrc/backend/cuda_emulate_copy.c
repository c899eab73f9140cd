/* cuda_emulate_copy.c - the copies (cudaMemcpy*Async) and kernels (strided
 * copy, add) of the CPU emulation of cuda_api.h (cuda_emulate.c's file
 * comment says what it keeps from a GPU): each checks its device ranges
 * against the live allocations, moves the data at once and records the
 * ranges as work in flight on its stream.
 */
#if defined(DPMINI_CUDA_EMULATE)
#define _POSIX_C_SOURCE 200809L

#include "cuda_api.h"
#include "../cuda/strided.h"
#include "cuda_emulate.h"

#include <limits.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

/* ---- copies ---- */

#define BAD_COPY(call, dev) EMU_FAIL(E_INVALID_VALUE, call, dev, emu_msg(E_INVALID_VALUE))

/* Resolve one side of a copy: a device side must be a live device range; a
 * host side must not be a device pointer. */
static char *side(const void *p, size_t n, int on_device)
{
    if (on_device)
        return dev_range(p, 0, (int64_t)n, NULL);
    return tagged(p, NULL) ? NULL : (char *)p;
}

dpc_status dpc_memcpy_async(int dev, void *dst, const void *src, size_t nbytes, int kind,
                            dpc_stream s)
{
    if (bad_dev(dev) || poisoned(s))
        return BAD_COPY("cudaMemcpyAsync(dst, src, n, kind, s)", dev);
    ctx_on(dev);
    if (nbytes == 0)
        return dpc_ok();
    int f = take_fault();
    if (f)
        return EMU_FAIL(f, "cudaMemcpyAsync(dst, src, n, kind, s)", dev, emu_msg(f));
    char *d = side(dst, nbytes, kind != DPC_D2H);
    char *c = side(src, nbytes, kind != DPC_H2D);
    if (d == NULL || c == NULL)
        return BAD_COPY("cudaMemcpyAsync(dst, src, n, kind, s)", dev);
    memmove(d, c, nbytes);
    if (kind != DPC_D2H)
        note_pending(s, dev, d, d + nbytes);
    if (kind != DPC_H2D)
        note_pending(s, dev, c, c + nbytes);
    return dpc_ok();
}

dpc_status dpc_memcpy2d_async(int dev, void *dst, size_t dpitch, const void *src,
                              size_t spitch, size_t width, size_t height, int kind,
                              dpc_stream s)
{
    if (bad_dev(dev) || poisoned(s) || width > dpitch || width > spitch)
        return BAD_COPY("cudaMemcpy2DAsync(dst, dpitch, src, spitch, w, h, kind, s)", dev);
    ctx_on(dev);
    if (width == 0 || height == 0)
        return dpc_ok();
    if (dpitch > (size_t)INT_MAX || spitch > (size_t)INT_MAX || width > (size_t)INT_MAX)
        return EMU_FAIL(E_INVALID_PITCH,
                        "cudaMemcpy2DAsync(dst, dpitch, src, spitch, w, h, kind, s)", dev,
                        emu_msg(E_INVALID_PITCH));
    size_t dspan = dpitch * (height - 1) + width, sspan = spitch * (height - 1) + width;
    char *d = side(dst, dspan, kind != DPC_D2H);
    char *c = side(src, sspan, kind != DPC_H2D);
    if (d == NULL || c == NULL)
        return BAD_COPY("cudaMemcpy2DAsync(dst, dpitch, src, spitch, w, h, kind, s)", dev);
    for (size_t r = 0; r < height; r++)
        memcpy(d + r * dpitch, c + r * spitch, width);
    if (kind != DPC_D2H)
        note_pending(s, dev, d, d + dspan);
    if (kind != DPC_H2D)
        note_pending(s, dev, c, c + sspan);
    return dpc_ok();
}

dpc_status dpc_memcpy_peer_async(void *dst, int dst_dev, const void *src, int src_dev,
                                 size_t nbytes, dpc_stream s)
{
    int dd = -1, sd = -1;
    if (poisoned(s))
        return BAD_COPY("cudaMemcpyPeerAsync(dst, dst_dev, src, src_dev, n, s)", dst_dev);
    if (!bad_dev(dst_dev))
        ctx_on(dst_dev);
    if (nbytes == 0)
        return dpc_ok();
    char *d = dev_range(dst, 0, (int64_t)nbytes, &dd);
    char *c = dev_range(src, 0, (int64_t)nbytes, &sd);
    if (d == NULL || c == NULL || dd != dst_dev || sd != src_dev)
        return BAD_COPY("cudaMemcpyPeerAsync(dst, dst_dev, src, src_dev, n, s)", dst_dev);
    memcpy(d, c, nbytes);
    note_pending(s, dst_dev, d, d + nbytes);
    note_pending(s, dst_dev, c, c + nbytes);
    return dpc_ok();
}

/* ---- kernels ---- */

/* The byte range [lo, hi) a strided side touches, relative to its base. */
static void span(const dpc_kdesc *d, const int64_t *strides, int64_t *lo, int64_t *hi)
{
    int64_t l = 0, h = 0;
    for (int k = 0; k < d->ndim; k++) {
        int64_t e = strides[k] * (d->shape[k] - 1);
        if (e < 0)
            l += e;
        else
            h += e;
    }
    *lo = l;
    *hi = h + d->itemsize;
}

dpc_status dpc_launch_strided_copy(int dev, const dpc_kdesc *d, void *dst, const void *src,
                                   dpc_stream s)
{
    int64_t slo, shi, dlo, dhi;
    int illegal = 0;
    if (bad_dev(dev) || poisoned(s) || d->ndim < 1 || d->ndim > DPC_KMAXDIMS || d->itemsize < 1)
        return BAD_COPY("dp_strided_copy_kernel<<<grid, block, 0, s>>>", dev);
    ctx_on(dev);
    if (d->numel == 0)
        return dpc_ok();
    int f = take_fault();
    if (f)
        return EMU_FAIL(f, "dp_strided_copy_kernel<<<grid, block, 0, s>>>", dev, emu_msg(f));
    span(d, d->src_strides, &slo, &shi);
    span(d, d->dst_strides, &dlo, &dhi);
    char *hd = kernel_range(dev, dst, dlo, dhi, &illegal);
    char *hs = kernel_range(dev, src, slo, shi, &illegal);
    if (illegal)
        return EMU_FAIL(E_ILLEGAL_ADDRESS, "dp_strided_copy_kernel<<<grid, block, 0, s>>>", dev,
                        emu_msg(E_ILLEGAL_ADDRESS));
    if (hd == NULL || hs == NULL)
        return BAD_COPY("dp_strided_copy_kernel<<<grid, block, 0, s>>>", dev);
    for (int64_t i = 0; i < d->numel; i++)
        dp_strided_copy_one(d, hd, hs, i);
    note_pending(s, dev, hd + dlo, hd + dhi);
    note_pending(s, dev, hs + slo, hs + shi);
    return dpc_ok();
}

#define EMU_ADD(T)                                                              \
    do {                                                                        \
        T *a_ = (T *)ha;                                                        \
        const T *x_ = (const T *)hx;                                            \
        for (int64_t i = 0; i < numel; i++)                                     \
            a_[i] = (T)(a_[i] + x_[i]);                                         \
    } while (0)

static const int type_size[] = {1, 1, 2, 2, 4, 4, 8, 8, 4, 8, 2};

dpc_status dpc_launch_add(int dev, int type, void *acc, const void *x, int64_t numel,
                          dpc_stream s)
{
    int illegal = 0;
    if (bad_dev(dev) || poisoned(s) || type < 0 || type >= DPC_T_NONE)
        return BAD_COPY("dp_add_kernel<<<grid, block, 0, s>>>", dev);
    ctx_on(dev);
    if (numel == 0)
        return dpc_ok();
    int64_t n = numel * type_size[type];
    char *ha = kernel_range(dev, acc, 0, n, &illegal), *hx = kernel_range(dev, x, 0, n, &illegal);
    if (illegal)
        return EMU_FAIL(E_ILLEGAL_ADDRESS, "dp_add_kernel<<<grid, block, 0, s>>>", dev,
                        emu_msg(E_ILLEGAL_ADDRESS));
    if (ha == NULL || hx == NULL)
        return BAD_COPY("dp_add_kernel<<<grid, block, 0, s>>>", dev);
    switch (type) {
    case DPC_T_I8: EMU_ADD(int8_t); break;
    case DPC_T_U8: EMU_ADD(uint8_t); break;
    case DPC_T_I16: EMU_ADD(int16_t); break;
    case DPC_T_U16: EMU_ADD(uint16_t); break;
    case DPC_T_I32: EMU_ADD(int32_t); break;
    case DPC_T_U32: EMU_ADD(uint32_t); break;
    case DPC_T_I64: EMU_ADD(int64_t); break;
    case DPC_T_U64: EMU_ADD(uint64_t); break;
    case DPC_T_F32: EMU_ADD(float); break;
    case DPC_T_F64: EMU_ADD(double); break;
    case DPC_T_F16: { /* in float, one rounding to half: NumPy's float16 add */
        _Float16 *a_ = (_Float16 *)ha;
        const _Float16 *x_ = (const _Float16 *)hx;
        for (int64_t i = 0; i < numel; i++)
            a_[i] = (_Float16)((float)a_[i] + (float)x_[i]);
        break;
    }
    }
    note_pending(s, dev, ha, ha + n);
    note_pending(s, dev, hx, hx + n);
    return dpc_ok();
}

#endif /* DPMINI_CUDA_EMULATE */
