/* device_arrays.c - ndarrays over device memory: dp_empty (one buffer of
 * its own), dp_empty_slab (small arrays of one call carved out of a shared
 * buffer per device) and dp_array_device (where an array's memory lives:
 * the device of the dpmini buffer at the end of its base chain, else the
 * host). The buffers themselves are host_memory.c's.
 */
#include "dpmini.h"

#include <stdint.h>

/* The byte count of an array of descr and shape; -1 with ValueError (and
 * descr released) when it is invalid or too big. */
static inline int array_nbytes(PyArray_Descr *descr, int nd, const npy_intp *shape, size_t *out)
{
    size_t nbytes = (size_t)PyDataType_ELSIZE(descr);
    for (int i = 0; i < nd; i++) {
        if (shape[i] < 0) {
            Py_DECREF(descr);
            PyErr_Format(PyExc_ValueError, "shape[%d] is %zd: dimensions must be >= 0",
                         i, (Py_ssize_t)shape[i]);
            return -1;
        }
        if (shape[i] != 0 && nbytes > SIZE_MAX / (size_t)shape[i]) {
            Py_DECREF(descr);
            PyErr_SetString(PyExc_ValueError, "array is too big: its byte count overflows");
            return -1;
        }
        nbytes *= (size_t)shape[i];
    }
    /* NumPy's limit; larger sizes also reach malloc as "negative" ones
     * (found by valgrind; reliability.md, bug 9). */
    if (nbytes > (size_t)NPY_MAX_INTP) {
        Py_DECREF(descr);
        PyErr_SetString(PyExc_ValueError, "array is too big: its byte count overflows");
        return -1;
    }
    *out = nbytes;
    return 0;
}

/* An ndarray over the memory at ptr, whose base becomes buf (stolen, also
 * on failure); descr stolen. */
static inline PyArrayObject *array_over(PyObject *buf, char *ptr, PyArray_Descr *descr, int nd,
                                 const npy_intp *shape, const npy_intp *strides)
{
    PyObject *arr = PyArray_NewFromDescr(&PyArray_Type, descr, nd, (npy_intp *)shape,
                                         (npy_intp *)strides, ptr,
                                         NPY_ARRAY_WRITEABLE | NPY_ARRAY_ALIGNED, NULL);
    if (arr == NULL) {
        Py_DECREF(buf);
        return NULL;
    }
    if (PyArray_SetBaseObject((PyArrayObject *)arr, buf) < 0) { /* steals buf */
        Py_DECREF(arr);
        return NULL;
    }
    return (PyArrayObject *)arr;
}

PyArrayObject *dp_empty(dp_state *st, dp_device d, PyArray_Descr *descr, int nd,
                        const npy_intp *shape, const npy_intp *strides)
{
    size_t nbytes;
    if (array_nbytes(descr, nd, shape, &nbytes) < 0) {
        return NULL;
    }
    PyObject *buf = dp_buffer_new(st, d, nbytes);
    if (buf == NULL) {
        Py_DECREF(descr);
        return NULL;
    }
    return array_over(buf, ((dp_BufferObject *)buf)->ptr, descr, nd, shape, strides);
}

PyArrayObject *dp_empty_slab(dp_state *st, dp_slab *s, dp_device d, PyArray_Descr *descr,
                             int nd, const npy_intp *shape, const npy_intp *strides,
                             size_t hint)
{
    size_t nbytes;
    if (s == NULL || d.kind == DP_CUDA) {
        return dp_empty(st, d, descr, nd, shape, strides);
    }
    if (array_nbytes(descr, nd, shape, &nbytes) < 0) {
        return NULL;
    }
    if (nbytes == 0 || nbytes > DP_SLAB_PIECE_MAX) {
        return dp_empty(st, d, descr, nd, shape, strides);
    }
    size_t piece = DP_SLAB_ROUND(nbytes);
    if (s->buf != NULL && !dp_device_eq(((dp_BufferObject *)s->buf)->dev, d)) {
        dp_slab_clear(s);   /* one device per slab */
    }
    if (s->buf == NULL || s->cap - s->used < piece) {
        size_t cap = hint;
        if (cap == 0 && s->next == 0) {
            cap = piece;        /* the first: its own size, as dp_empty's */
            s->next = 1024;
        }
        else if (cap == 0) {
            cap = s->next;
            s->next = cap * 2 < DP_SLAB_MAX ? cap * 2 : DP_SLAB_MAX;
        }
        cap = cap < DP_SLAB_MAX ? cap : DP_SLAB_MAX;
        cap = cap > piece ? cap : piece;
        PyObject *buf = dp_buffer_new(st, d, cap);
        if (buf == NULL) {
            Py_DECREF(descr);
            return NULL;
        }
        Py_XSETREF(s->buf, buf);
        s->used = 0;
        s->cap = cap;
    }
    char *ptr = (char *)((dp_BufferObject *)s->buf)->ptr + s->used;
    s->used += piece;
    return array_over(Py_NewRef(s->buf), ptr, descr, nd, shape, strides);
}

void dp_slab_clear(dp_slab *s)
{
    Py_CLEAR(s->buf);
    s->used = s->cap = 0;
}

dp_device dp_array_device(dp_state *st, PyArrayObject *a)
{
    PyObject *b = (PyObject *)a;
    while (PyArray_Check(b) && PyArray_BASE((PyArrayObject *)b) != NULL) {
        b = PyArray_BASE((PyArrayObject *)b);
    }
    if (Py_IS_TYPE(b, st->BufferType)) {
        return ((dp_BufferObject *)b)->dev;
    }
    dp_device host = {DP_HOST, -1};
    return host;
}
