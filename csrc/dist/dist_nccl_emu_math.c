/* dist_nccl_emu_math.c - the element arithmetic of the emulated NCCL
 * (dist_nccl_emu.c): the ten NCCL dtypes read as uint64 (integers, with
 * wrapping arithmetic as on a GPU) or double (floating; float16 and
 * bfloat16 converted by hand, rounded to nearest even), and the reduction
 * of every rank's contribution in rank order (sum, prod, max, min, avg).
 */
#include "dist_nccl.h"

#include <math.h>
#include <string.h>

size_t dist_emu_dtype_size(int t)
{
    static const size_t sizes[] = {1, 1, 4, 4, 8, 8, 2, 4, 8, 2};
    return t >= 0 && t <= NCCL_T_BFLOAT16 ? sizes[t] : 0;
}

static double half_to_double(uint16_t h)
{
    int e = (h >> 10) & 0x1f, m = h & 0x3ff;
    double v = e == 0 ? ldexp(m, -24) : e == 31 ? (m ? NAN : INFINITY) : ldexp(m + 1024, e - 25);
    return (h & 0x8000) ? -v : v;
}

static uint16_t half_from_double(double d)
{
    float f = (float)d;
    uint32_t x, m, h, rem, mid;
    memcpy(&x, &f, 4);
    uint16_t sign = (uint16_t)((x >> 16) & 0x8000);
    int e = (int)((x >> 23) & 0xff) - 127 + 15;
    m = x & 0x7fffff;
    if (((x >> 23) & 0xff) == 0xff)
        return sign | 0x7c00 | (m ? 0x200 : 0);
    if (e >= 31)
        return sign | 0x7c00;
    if (e <= 0) {                     /* a half subnormal, or zero */
        if (e < -10)
            return sign;
        m |= 0x800000;
        int shift = 14 - e;
        h = m >> shift;
        rem = m & ((1u << shift) - 1);
        mid = 1u << (shift - 1);
    } else {
        h = ((uint32_t)e << 10) | (m >> 13);
        rem = m & 0x1fff;
        mid = 0x1000;
    }
    if (rem > mid || (rem == mid && (h & 1)))
        h++;                          /* a carry rounds up into the exponent */
    return (uint16_t)(sign | h);
}

static double bf16_to_double(uint16_t b)
{
    uint32_t x = (uint32_t)b << 16;
    float f;
    memcpy(&f, &x, 4);
    return f;
}

static uint16_t bf16_from_double(double d)
{
    float f = (float)d;
    uint32_t x;
    memcpy(&x, &f, 4);
    if ((x & 0x7fffffff) > 0x7f800000)
        return (uint16_t)((x >> 16) | 0x40);
    return (uint16_t)((x + 0x7fff + ((x >> 16) & 1)) >> 16);
}

static int is_float(int t)
{
    return t >= NCCL_T_FLOAT16;
}

static int is_signed(int t)
{
    return t == NCCL_T_INT8 || t == NCCL_T_INT32 || t == NCCL_T_INT64;
}

/* Integers as uint64 (wrapping arithmetic, as on a GPU), floats as double. */
static uint64_t load_int(const char *p, int t)
{
    switch (t) {
    case NCCL_T_INT8: return (uint64_t)(int64_t)*(const int8_t *)p;
    case NCCL_T_UINT8: return *(const uint8_t *)p;
    case NCCL_T_INT32: return (uint64_t)(int64_t)*(const int32_t *)p;
    case NCCL_T_UINT32: return *(const uint32_t *)p;
    default: { uint64_t v; memcpy(&v, p, 8); return v; }
    }
}

static void store_int(char *p, int t, uint64_t v)
{
    switch (t) {
    case NCCL_T_INT8: case NCCL_T_UINT8: *(uint8_t *)p = (uint8_t)v; break;
    case NCCL_T_INT32: case NCCL_T_UINT32: { uint32_t w = (uint32_t)v; memcpy(p, &w, 4); break; }
    default: memcpy(p, &v, 8);
    }
}

static double load_float(const char *p, int t)
{
    uint16_t h;
    float f;
    double d;
    switch (t) {
    case NCCL_T_FLOAT16: memcpy(&h, p, 2); return half_to_double(h);
    case NCCL_T_BFLOAT16: memcpy(&h, p, 2); return bf16_to_double(h);
    case NCCL_T_FLOAT32: memcpy(&f, p, 4); return f;
    default: memcpy(&d, p, 8); return d;
    }
}

static void store_float(char *p, int t, double v)
{
    uint16_t h;
    float f = (float)v;
    switch (t) {
    case NCCL_T_FLOAT16: h = half_from_double(v); memcpy(p, &h, 2); break;
    case NCCL_T_BFLOAT16: h = bf16_from_double(v); memcpy(p, &h, 2); break;
    case NCCL_T_FLOAT32: memcpy(p, &f, 4); break;
    default: memcpy(p, &v, 8);
    }
}

static int int_less(uint64_t a, uint64_t b, int t)
{
    return is_signed(t) ? (int64_t)a < (int64_t)b : a < b;
}

void dist_emu_combine(const void *scratch, void *recv, size_t count, int dtype, int op,
                      int nranks)
{
    size_t w = dist_emu_dtype_size(dtype), row = count * w;
    const char *s = scratch;
    char *out = recv;
    for (size_t i = 0; i < count; i++) {
        if (is_float(dtype)) {
            double acc = load_float(s + i * w, dtype);
            for (int r = 1; r < nranks; r++) {
                double v = load_float(s + (size_t)r * row + i * w, dtype);
                acc = op == NCCL_PROD ? acc * v : op == NCCL_MAX ? (v > acc ? v : acc)
                    : op == NCCL_MIN ? (v < acc ? v : acc) : acc + v;
            }
            store_float(out + i * w, dtype, op == NCCL_AVG ? acc / nranks : acc);
        } else {
            uint64_t acc = load_int(s + i * w, dtype);
            for (int r = 1; r < nranks; r++) {
                uint64_t v = load_int(s + (size_t)r * row + i * w, dtype);
                acc = op == NCCL_PROD ? acc * v
                    : op == NCCL_MAX ? (int_less(acc, v, dtype) ? v : acc)
                    : op == NCCL_MIN ? (int_less(v, acc, dtype) ? v : acc) : acc + v;
            }
            if (op == NCCL_AVG)
                acc = is_signed(dtype) ? (uint64_t)((int64_t)acc / nranks) : acc / (uint64_t)nranks;
            store_int(out + i * w, dtype, acc);
        }
    }
}
