/* copy_overlap.c - the copy engine's checks on out= arrays: a destination
 * that writes one byte from two elements or shares memory with a source,
 * and outputs that share memory with each other (copy_engine.h).
 */
#include "dpmini.h"
#include "gpu.h"
#include "copy_engine.h"
#include "copy.h"

#include <string.h>

/* Refuse an out= destination that the copy engine cannot write correctly
 * (PyTorch's assert_no_internal_overlap / assert_no_partial_overlap): dst
 * writing one byte from two elements (a zero stride, overlapping strides),
 * or dst sharing memory with any of srcs (a conservative bounds check,
 * copy.c). ValueError naming argname (and srcname[i] when nsrc > 1). */
int check_out_overlap(PyArrayObject *dst, PyArrayObject *const *srcs, Py_ssize_t nsrc,
                      const char *argname, const char *srcname)
{
    int64_t sh[DP_MAXDIMS], dst_st[DP_MAXDIMS], src_sh[DP_MAXDIMS], src_st[DP_MAXDIMS];
    int nd = PyArray_NDIM(dst);
    size_t item = (size_t)PyArray_ITEMSIZE(dst);
    for (int d = 0; d < nd; d++) {
        sh[d] = PyArray_DIM(dst, d);
        dst_st[d] = PyArray_STRIDE(dst, d);
    }
    if (dp_layout_has_internal_overlap(nd, sh, dst_st, item)) {
        PyErr_Format(PyExc_ValueError,
                     "%s: unsupported operation: more than one element of the written-to "
                     "array refers to a single memory location (a zero or overlapping "
                     "stride); pass an array with its own memory, e.g. numpy.empty_like(...)",
                     argname);
        return -1;
    }
    for (Py_ssize_t i = 0; i < nsrc; i++) {
        PyArrayObject *src = srcs[i];
        int snd = PyArray_NDIM(src);
        for (int d = 0; d < snd; d++) {
            src_sh[d] = PyArray_DIM(src, d);
            src_st[d] = PyArray_STRIDE(src, d);
        }
        if (dp_layouts_may_overlap(PyArray_BYTES(dst), nd, sh, dst_st, item,
                                   PyArray_BYTES(src), snd, src_sh, src_st,
                                   (size_t)PyArray_ITEMSIZE(src))) {
            if (nsrc > 1) {
                PyErr_Format(PyExc_ValueError,
                             "%s: unsupported operation: the written-to array overlaps the "
                             "memory of %s[%zd] (some elements of the input and the output "
                             "may refer to a single memory location); use a separate output "
                             "array", argname, srcname, i);
            } else {
                PyErr_Format(PyExc_ValueError,
                             "%s: unsupported operation: the written-to array overlaps the "
                             "memory of %s (some elements of the input and the output may "
                             "refer to a single memory location); use a separate output "
                             "array", argname, srcname);
            }
            return -1;
        }
    }
    return 0;
}

/* Refuse out[i] and out[j] (i < j) sharing memory: each is written by its
 * own job, possibly at the same time, so the result would be undefined. */
int check_outs_disjoint(PyArrayObject *const *outs, Py_ssize_t n)
{
    char name[48];
    for (Py_ssize_t j = 1; j < n; j++) {
        PyOS_snprintf(name, sizeof name, "out[%zd]", j);
        for (Py_ssize_t i = 0; i < j; i++) {
            int64_t a_sh[DP_MAXDIMS], a_st[DP_MAXDIMS], b_sh[DP_MAXDIMS], b_st[DP_MAXDIMS];
            for (int d = 0; d < PyArray_NDIM(outs[i]); d++) {
                a_sh[d] = PyArray_DIM(outs[i], d);
                a_st[d] = PyArray_STRIDE(outs[i], d);
            }
            for (int d = 0; d < PyArray_NDIM(outs[j]); d++) {
                b_sh[d] = PyArray_DIM(outs[j], d);
                b_st[d] = PyArray_STRIDE(outs[j], d);
            }
            if (dp_layouts_may_overlap(PyArray_BYTES(outs[i]), PyArray_NDIM(outs[i]), a_sh,
                                       a_st, (size_t)PyArray_ITEMSIZE(outs[i]),
                                       PyArray_BYTES(outs[j]), PyArray_NDIM(outs[j]), b_sh,
                                       b_st, (size_t)PyArray_ITEMSIZE(outs[j]))) {
                PyErr_Format(PyExc_ValueError,
                             "%s: unsupported operation: the written-to array overlaps the "
                             "memory of out[%zd]; pass separate output arrays", name, i);
                return -1;
            }
        }
    }
    return 0;
}
