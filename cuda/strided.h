/* strided.h - index arithmetic of the strided copy (pack / unpack) and of the
 * reduce, shared by the CUDA kernels (cuda/runtime.cu) and the CPU emulator
 * (csrc/cuda_emulate.c), so the arithmetic the GPU runs is the arithmetic the
 * CI tests against NumPy.
 *
 * Element i of a dpc_kdesc copy (0 <= i < numel) is the C-order multi-index
 * (i_0, ..., i_{n-1}) over shape; its byte offsets are sum_k i_k*stride[k] on
 * each side. Offsets may be negative (negative strides); pointers given to a
 * copy point at element (0, ..., 0).
 */
#ifndef DPMINI_STRIDED_H
#define DPMINI_STRIDED_H

#include <stdint.h>
#include <string.h>
#include "cuda_api.h" /* csrc/backend/ (-I in setup.py) */

#if defined(__CUDACC__)
#define DP_HD __host__ __device__ __forceinline__
#else
#define DP_HD static inline
#endif

/* Byte offsets of element i on the source and destination sides. */
DP_HD void dp_kdesc_offsets(const dpc_kdesc *d, int64_t i, int64_t *src_off,
                            int64_t *dst_off)
{
    int64_t so = 0, dof = 0;
    for (int k = d->ndim - 1; k >= 0; k--) {
        int64_t n = d->shape[k];
        int64_t q = i / n;
        int64_t r = i - q * n;
        so += r * d->src_strides[k];
        dof += r * d->dst_strides[k];
        i = q;
    }
    *src_off = so;
    *dst_off = dof;
}

/* The same with 32-bit division, for copies of at most 2^32 - 1 elements
 * (then every extent and index fits): 64-bit division is a long software
 * sequence on GPUs, 32-bit a short one, and it runs once per dimension per
 * element. Offsets stay 64-bit (strides may be large). */
DP_HD void dp_kdesc_offsets32(const dpc_kdesc *d, uint32_t i, int64_t *src_off,
                              int64_t *dst_off)
{
    int64_t so = 0, dof = 0;
    for (int k = d->ndim - 1; k >= 0; k--) {
        uint32_t n = (uint32_t)d->shape[k];
        uint32_t q = i / n;
        uint32_t r = i - q * n;
        so += (int64_t)r * d->src_strides[k];
        dof += (int64_t)r * d->dst_strides[k];
        i = q;
    }
    *src_off = so;
    *dst_off = dof;
}

/* Copy one element of `size` bytes; the fast widths when both addresses are
 * aligned to them. */
DP_HD void dp_copy_elem(char *dst, const char *src, int size)
{
    uintptr_t a = (uintptr_t)dst | (uintptr_t)src;
    switch (size) {
    case 1: *dst = *src; return;
    case 2: if (!(a & 1)) { *(uint16_t *)dst = *(const uint16_t *)src; return; } break;
    case 4: if (!(a & 3)) { *(uint32_t *)dst = *(const uint32_t *)src; return; } break;
    case 8: if (!(a & 7)) { *(uint64_t *)dst = *(const uint64_t *)src; return; } break;
    case 16:
        if (!(a & 7)) {
            ((uint64_t *)dst)[0] = ((const uint64_t *)src)[0];
            ((uint64_t *)dst)[1] = ((const uint64_t *)src)[1];
            return;
        }
        break;
    default: break;
    }
    for (int b = 0; b < size; b++)
        dst[b] = src[b];
}

/* Element i of the strided copy. */
DP_HD void dp_strided_copy_one(const dpc_kdesc *d, char *dst, const char *src, int64_t i)
{
    int64_t so, dof;
    if (d->numel <= (int64_t)UINT32_MAX) /* the same branch for every thread */
        dp_kdesc_offsets32(d, (uint32_t)i, &so, &dof);
    else
        dp_kdesc_offsets(d, i, &so, &dof);
    dp_copy_elem(dst + dof, src + so, d->itemsize);
}

#endif
