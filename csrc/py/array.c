/* array.c - dpmini.Array (an array in CUDA device memory): the type, its
 * getters and methods, and its __cuda_array_interface__ (v3) export. The
 * imports of other libraries' GPU arrays (CUDA Array Interface, DLPack) are
 * in array_import.c, the __dlpack__ export in array_dlpack.c, the module
 * functions from_dlpack, empty and cuda_build_info in array_module.c.
 *
 * Synchronisation contract: every dpmini operation that writes device memory
 * has synchronised its streams before it returns, so a dpmini.Array is always
 * ready: __cuda_array_interface__ reports stream None ("no synchronisation
 * needed") and __dlpack__(stream=...) has nothing to wait for. On import,
 * dpmini waits for the producer: an object with a CUDA __dlpack_device__ is
 * imported through __dlpack__(stream=<a dpmini stream>) (the producer orders
 * its work before that stream, which is then synchronised), even when it
 * also has __cuda_array_interface__ (PyTorch, CuPy); a CAI-only object's
 * "stream" is synchronised, and when the key is absent (CAI v2, e.g.
 * PyTorch's) or the version is < 3 the producer promises nothing, so the
 * legacy default stream of the array's device is synchronised (the CAI
 * spec's advice; PyTorch's and CuPy's default stream is that stream).
 *
 * Exported memory is marked on its buffer, so that the block is not handed
 * out again while the consumer's kernels may still read it (gpu_export.c):
 * a DLPack export when a consumer takes the capsule (a capsule dropped
 * unused marks nothing), with the stream the consumer named, which the
 * release then waits for; a CAI read (a property: a hasattr probe cannot be
 * told from a use) without a stream, so the release waits for a device sync
 * shared with other such blocks.
 */
#include "dpmini.h"
#include "dlpack.h"
#include "gpu.h"
#include "array.h"

#include <string.h>

/* ------------------------------------------------------------------ */
/* Wrapping shadows                                                    */
/* ------------------------------------------------------------------ */

static PyObject *array_wrap(dp_state *st, PyArrayObject *meta, dp_device dev)
{
    dp_ArrayObject *self = PyObject_New(dp_ArrayObject, st->ArrayType);
    if (self == NULL) {
        Py_DECREF(meta);
        return NULL;
    }
    self->meta = meta; /* stolen */
    self->dev = dev;
    return (PyObject *)self;
}

PyObject *dp_export(dp_state *st, PyObject *obj)
{
    if (obj == NULL || !PyArray_Check(obj)) {
        return obj;
    }
    dp_device d = dp_array_device(st, (PyArrayObject *)obj);
    if (d.kind != DP_CUDA) {
        return obj;
    }
    return array_wrap(st, (PyArrayObject *)obj, d);
}

/* Mark the buffer that owns a's memory as exported (see the file comment):
 * known 1 with the stream a DLPack consumer named, else 0. Exports to
 * different streams, or one without, leave no single stream to wait for. */
void mark_exported(dp_state *st, PyArrayObject *a, int known, void *stream)
{
    PyObject *b = (PyObject *)a;
    while (PyArray_Check(b) && PyArray_BASE((PyArrayObject *)b) != NULL) {
        b = PyArray_BASE((PyArrayObject *)b);
    }
    if (Py_IS_TYPE(b, st->BufferType)) {
        dp_BufferObject *buf = (dp_BufferObject *)b;
        if (known && (buf->exported == 0 ||
                      (buf->exported == 1 && buf->export_stream == stream))) {
            buf->exported = 1;
            buf->export_stream = stream;
        } else {
            buf->exported = 2;
        }
    }
}

/* ------------------------------------------------------------------ */
/* dpmini.Array                                                        */
/* ------------------------------------------------------------------ */

static void array_dealloc(PyObject *op)
{
    PyTypeObject *tp = Py_TYPE(op);
    Py_CLEAR(((dp_ArrayObject *)op)->meta);
    PyObject_Free(op);
    Py_DECREF(tp);
}

static PyObject *array_repr(PyObject *op)
{
    dp_ArrayObject *self = (dp_ArrayObject *)op;
    PyObject *shape = PyArray_IntTupleFromIntp(PyArray_NDIM(self->meta),
                                               PyArray_DIMS(self->meta));
    if (shape == NULL) {
        return NULL;
    }
    PyObject *r = PyUnicode_FromFormat("dpmini.Array(shape=%R, dtype=%S, device='cuda:%d')",
                                       shape, (PyObject *)PyArray_DESCR(self->meta),
                                       self->dev.index);
    Py_DECREF(shape);
    return r;
}

#define META(op) (((dp_ArrayObject *)(op))->meta)

static PyObject *get_shape(PyObject *op, void *c)
{
    return PyArray_IntTupleFromIntp(PyArray_NDIM(META(op)), PyArray_DIMS(META(op)));
}

static PyObject *get_strides(PyObject *op, void *c)
{
    return PyArray_IntTupleFromIntp(PyArray_NDIM(META(op)), PyArray_STRIDES(META(op)));
}

static PyObject *get_dtype(PyObject *op, void *c)
{
    PyObject *d = (PyObject *)PyArray_DESCR(META(op));
    Py_INCREF(d);
    return d;
}

static PyObject *get_ndim(PyObject *op, void *c)
{
    return PyLong_FromLong(PyArray_NDIM(META(op)));
}

static PyObject *get_size(PyObject *op, void *c)
{
    return PyLong_FromSsize_t((Py_ssize_t)PyArray_SIZE(META(op)));
}

static PyObject *get_nbytes(PyObject *op, void *c)
{
    return PyLong_FromSsize_t((Py_ssize_t)PyArray_NBYTES(META(op)));
}

static PyObject *get_device(PyObject *op, void *c)
{
    dp_state *st = dp_state_from_type(Py_TYPE(op));
    return st ? dp_device_to_object(st, ((dp_ArrayObject *)op)->dev) : NULL;
}

static PyObject *get_data_ptr(PyObject *op, void *c)
{
    return PyLong_FromVoidPtr(PyArray_DATA(META(op)));
}

static PyObject *get_cai(PyObject *op, void *c)
{
    PyArrayObject *a = META(op);
    PyObject *shape = NULL, *strides = NULL, *typestr = NULL, *descr = NULL, *res = NULL;
    shape = PyArray_IntTupleFromIntp(PyArray_NDIM(a), PyArray_DIMS(a));
    if (PyArray_IS_C_CONTIGUOUS(a)) {
        strides = Py_NewRef(Py_None);
    } else {
        strides = PyArray_IntTupleFromIntp(PyArray_NDIM(a), PyArray_STRIDES(a));
    }
    typestr = PyObject_GetAttrString((PyObject *)PyArray_DESCR(a), "str");
    if (shape == NULL || strides == NULL || typestr == NULL) {
        goto done;
    }
    descr = Py_BuildValue("[(sO)]", "", typestr);
    if (descr == NULL) {
        goto done;
    }
    void *ptr = PyArray_SIZE(a) == 0 ? NULL : PyArray_DATA(a);
    mark_exported(dp_state_from_type(Py_TYPE(op)), a, 0, NULL); /* no stream named */
    res = Py_BuildValue("{sOsOsOs(NO)sOsisO}", "shape", shape, "typestr", typestr, "descr",
                        descr, "data", PyLong_FromVoidPtr(ptr),
                        PyArray_ISWRITEABLE(a) ? Py_False : Py_True, "strides", strides,
                        "version", 3, "stream", Py_None);
done:
    Py_XDECREF(shape);
    Py_XDECREF(strides);
    Py_XDECREF(typestr);
    Py_XDECREF(descr);
    return res;
}

static PyObject *array_numpy(PyObject *op, PyObject *unused)
{
    dp_state *st = dp_state_from_type(Py_TYPE(op));
    dp_device host = {DP_HOST, -1};
    return st->copy_to_device(st, META(op), host);
}

static PyObject *array_array(PyObject *op, PyObject *args, PyObject *kw)
{
    PyErr_Format(PyExc_TypeError,
                 "dpmini.Array lives on cuda:%d; NumPy cannot read device memory. Call "
                 ".numpy() for an explicit copy to the host",
                 ((dp_ArrayObject *)op)->dev.index);
    return NULL;
}

static PyGetSetDef array_getset[] = {
    {"shape", get_shape, NULL, "Tuple of sizes (elements).", NULL},
    {"strides", get_strides, NULL, "Tuple of strides in BYTES (NumPy's convention).", NULL},
    {"dtype", get_dtype, NULL, "numpy.dtype of the elements.", NULL},
    {"ndim", get_ndim, NULL, "Number of dimensions.", NULL},
    {"size", get_size, NULL, "Number of elements.", NULL},
    {"nbytes", get_nbytes, NULL, "size * itemsize.", NULL},
    {"device", get_device, NULL, "The dpmini.Device ('cuda:N') holding the memory.", NULL},
    {"data_ptr", get_data_ptr, NULL, "Device address of element (0, ..., 0).", NULL},
    {"__cuda_array_interface__", get_cai, NULL,
     "CUDA Array Interface v3 (stream None: dpmini arrays are always ready).", NULL},
    {NULL},
};

static PyMethodDef array_methods_tbl[] = {
    {"numpy", array_numpy, METH_NOARGS,
     "numpy($self)\n--\n\nReturns a numpy.ndarray: an explicit copy to host memory (same shape, dtype; "
     "C-contiguous unless the layout is dense, then the same strides)."},
    {"__array__", (PyCFunction)(void (*)(void))array_array, METH_VARARGS | METH_KEYWORDS,
     "Refused with TypeError: use .numpy()."},
    {"__dlpack__", (PyCFunction)(void (*)(void))array_dlpack, METH_VARARGS | METH_KEYWORDS,
     "__dlpack__($self, *, stream=None, max_version=None, dl_device=None, copy=None)\n--\n\n"
     "Returns a PyCapsule. DLPack export: a 'dltensor_versioned' capsule when max_version >= (1, 0), else a "
     "legacy 'dltensor'. dl_device=(1, 0) with copy=True exports a host copy. stream: the "
     "consumer's CUDA stream (an int; 0 refused); the array is ready on any stream, and once "
     "the consumer released the tensor its memory is reused only after that stream (1: the "
     "legacy default stream) finished; None, -1 or 2: after a device sync. Refusals "
     "raise BufferError."},
    {"__dlpack_device__", array_dlpack_device, METH_NOARGS,
     "__dlpack_device__($self)\n--\n\nReturns (2, device_index): kDLCUDA and the CUDA device."},
    {NULL},
};

PyDoc_STRVAR(array_doc,
"An array in CUDA device memory (made by dpmini: scatter/gather/asarray results,\n"
"shards of DataParallel on GPUs, or a zero-copy import of CuPy/PyTorch/Numba/JAX\n"
"memory). Attributes shape, dtype, strides (bytes), device, nbytes, ndim, size;\n"
"exports __cuda_array_interface__ (v3) and __dlpack__; .numpy() copies to the host.\n"
"np.asarray() on it raises TypeError (no implicit device-to-host copy).\n"
"Not created directly: use dpmini.asarray(x, device='cuda:0').");

static PyType_Slot array_slots[] = {
    {Py_tp_dealloc, array_dealloc},
    {Py_tp_repr, array_repr},
    {Py_tp_getset, array_getset},
    {Py_tp_methods, array_methods_tbl},
    {Py_tp_doc, (void *)array_doc},
    {0, NULL},
};

PyType_Spec dp_array_spec = {
    .name = "dpmini.Array",
    .basicsize = sizeof(dp_ArrayObject),
    .flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_IMMUTABLETYPE | Py_TPFLAGS_DISALLOW_INSTANTIATION,
    .slots = array_slots,
};
