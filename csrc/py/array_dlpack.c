/* array_dlpack.c - the __dlpack__ export of a dpmini.Array (versioned and
 * legacy capsules, copy=True to the host) and __dlpack_device__. A
 * dpmini.Array is always ready (array.c's file comment), so stream= has
 * nothing to wait for; the exported buffer is marked (synchronised before
 * its block is reused).
 */
#include "dpmini.h"
#include "dlpack.h"
#include "gpu.h"
#include "array.h"
#include "interop.h"

#include <string.h>

/* ------------------------------------------------------------------ */
/* Export: DLPack                                                      */
/* ------------------------------------------------------------------ */

/* One allocation per export: the managed tensor, its shape and strides, and
 * a strong reference to the exported dpmini.Array. */
typedef struct {
    union {
        DLManagedTensorVersioned v;
        DLManagedTensor legacy;
    } mt;
    int versioned;
    int unconsumed;          /* set when the capsule dies never taken    */
    int stream_known;        /* the consumer named a stream to wait on   */
    void *stream;            /* that stream (1: the legacy default)      */
    PyObject *owner;
    int64_t shape[NPY_MAXDIMS];
    int64_t strides[NPY_MAXDIMS];
} export_ctx;

static void export_release(export_ctx *ctx)
{
    /* The deleter may run on any thread (a consumer's), GIL or not. */
    if (!Py_IsInitialized()) {
        return; /* interpreter gone: leak rather than crash */
    }
    PyGILState_STATE g = PyGILState_Ensure();
    if (!ctx->unconsumed && ctx->owner != NULL) {
        /* a consumer had the memory: its work on ctx->stream must finish
         * before the block is reused (marked now, waited for at the free) */
        mark_exported(dp_state_from_type(Py_TYPE(ctx->owner)),
                      ((dp_ArrayObject *)ctx->owner)->meta, ctx->stream_known, ctx->stream);
    }
    Py_XDECREF(ctx->owner);
    PyMem_RawFree(ctx);
    PyGILState_Release(g);
}

static void deleter_versioned(DLManagedTensorVersioned *self)
{
    export_release((export_ctx *)self->manager_ctx);
}

static void deleter_legacy(DLManagedTensor *self)
{
    export_release((export_ctx *)self->manager_ctx);
}

/* Destructor of an exported capsule: delete only when never consumed. */
static void capsule_versioned(PyObject *cap)
{
    if (PyCapsule_IsValid(cap, "used_dltensor_versioned")) {
        return;
    }
    PyObject *t, *v, *tb;
    PyErr_Fetch(&t, &v, &tb);
    DLManagedTensorVersioned *m = PyCapsule_GetPointer(cap, "dltensor_versioned");
    if (m != NULL && m->deleter != NULL) {
        ((export_ctx *)m->manager_ctx)->unconsumed = 1; /* nobody used the memory */
        m->deleter(m);
    }
    PyErr_Clear();
    PyErr_Restore(t, v, tb);
}

static void capsule_legacy(PyObject *cap)
{
    if (PyCapsule_IsValid(cap, "used_dltensor")) {
        return;
    }
    PyObject *t, *v, *tb;
    PyErr_Fetch(&t, &v, &tb);
    DLManagedTensor *m = PyCapsule_GetPointer(cap, "dltensor");
    if (m != NULL && m->deleter != NULL) {
        ((export_ctx *)m->manager_ctx)->unconsumed = 1; /* nobody used the memory */
        m->deleter(m);
    }
    PyErr_Clear();
    PyErr_Restore(t, v, tb);
}

static PyObject *to_capsule(dp_ArrayObject *self, int versioned, int copied, int stream_known,
                            void *stream)
{
    PyArrayObject *a = self->meta;
    DLDataType dt;
    if (dp_dl_from_descr(PyArray_DESCR(a), &dt) < 0) {
        PyErr_Format(PyExc_BufferError, "__dlpack__: dtype %S has no DLPack equivalent",
                     (PyObject *)PyArray_DESCR(a));
        return NULL;
    }
    npy_intp is = PyArray_ITEMSIZE(a);
    for (int i = 0; i < PyArray_NDIM(a); i++) {
        if (is > 0 && PyArray_STRIDES(a)[i] % is != 0) {
            PyErr_SetString(PyExc_BufferError, "__dlpack__: strides that are not a multiple "
                            "of the item size cannot be expressed in DLPack");
            return NULL;
        }
    }
    export_ctx *ctx = PyMem_RawCalloc(1, sizeof *ctx);
    if (ctx == NULL) {
        return PyErr_NoMemory();
    }
    DLTensor *t = versioned ? &ctx->mt.v.dl_tensor : &ctx->mt.legacy.dl_tensor;
    for (int i = 0; i < PyArray_NDIM(a); i++) {
        ctx->shape[i] = PyArray_DIM(a, i);
        ctx->strides[i] = is > 0 ? PyArray_STRIDES(a)[i] / is : 0;
    }
    t->data = PyArray_DATA(a);
    t->device.device_type = kDLCUDA;
    t->device.device_id = self->dev.index;
    t->ndim = PyArray_NDIM(a);
    t->dtype = dt;
    t->shape = ctx->shape;
    t->strides = ctx->strides;
    t->byte_offset = 0;
    ctx->versioned = versioned;
    ctx->stream_known = stream_known;
    ctx->stream = stream;
    ctx->owner = (PyObject *)self; /* marked exported when a consumer releases it */
    Py_INCREF(self);
    PyObject *cap;
    if (versioned) {
        ctx->mt.v.version.major = DP_DLPACK_MAJOR;
        ctx->mt.v.version.minor = DP_DLPACK_MINOR;
        ctx->mt.v.manager_ctx = ctx;
        ctx->mt.v.deleter = deleter_versioned;
        ctx->mt.v.flags = (copied ? DLPACK_FLAG_BITMASK_IS_COPIED : 0) |
                          (PyArray_ISWRITEABLE(a) ? 0 : DLPACK_FLAG_BITMASK_READ_ONLY);
        cap = PyCapsule_New(&ctx->mt.v, "dltensor_versioned", capsule_versioned);
    } else {
        ctx->mt.legacy.manager_ctx = ctx;
        ctx->mt.legacy.deleter = deleter_legacy;
        cap = PyCapsule_New(&ctx->mt.legacy, "dltensor", capsule_legacy);
    }
    if (cap == NULL) {
        Py_DECREF(self);
        PyMem_RawFree(ctx);
    }
    return cap;
}

PyObject *array_dlpack(PyObject *op, PyObject *args, PyObject *kw)
{
    static char *kwlist[] = {"stream", "max_version", "dl_device", "copy", NULL};
    PyObject *stream = Py_None, *max_version = Py_None, *dl_device = Py_None, *copy = Py_None;
    int stream_known = 0;       /* a stream the consumer will use the tensor on */
    void *consumer = NULL;
    dp_ArrayObject *self = (dp_ArrayObject *)op;
    dp_state *st = dp_state_from_type(Py_TYPE(op));
    if (!PyArg_ParseTupleAndKeywords(args, kw, "|$OOOO:__dlpack__", kwlist, &stream,
                                     &max_version, &dl_device, &copy)) {
        return NULL;
    }
    if (stream != Py_None) {
        if (!PyLong_Check(stream)) {
            PyErr_Format(PyExc_TypeError, "__dlpack__: stream must be None or an int, got "
                         "%.100s", Py_TYPE(stream)->tp_name);
            return NULL;
        }
        long v = PyLong_AsLong(stream);
        if (v == -1 && PyErr_Occurred()) {
            return NULL;
        }
        if (v == 0) {
            PyErr_SetString(PyExc_BufferError, "__dlpack__: stream 0 is disallowed for CUDA "
                            "(ambiguous; use 1 for the legacy default stream)");
            return NULL;
        }
        /* Nothing to order: dpmini arrays are always ready (see file comment).
         * Kept to wait on before the memory is reused: a handle, or 1 (the
         * legacy default stream); -1 (no synchronisation) and 2 (the
         * consumer thread's per-thread default stream) name nothing dpmini
         * can wait on later. */
        if (v > 0 && v != 2) {
            stream_known = 1;
            consumer = PyLong_AsVoidPtr(stream);
            if (consumer == NULL && PyErr_Occurred()) {
                return NULL;
            }
        }
    }
    int versioned = 0;
    if (max_version != Py_None) {
        int major, minor;
        if (!PyArg_ParseTuple(max_version, "ii:max_version", &major, &minor)) {
            return NULL;
        }
        versioned = major >= 1;
    }
    int want_copy = -1; /* -1: None (copy only if needed) */
    if (copy != Py_None) {
        want_copy = PyObject_IsTrue(copy);
        if (want_copy < 0) {
            return NULL;
        }
    }
    if (dl_device != Py_None) {
        int type, id;
        if (!PyArg_ParseTuple(dl_device, "ii:dl_device", &type, &id)) {
            return NULL;
        }
        if (type == kDLCPU) {
            if (want_copy == 0) {
                PyErr_SetString(PyExc_BufferError, "__dlpack__: the array is on a CUDA "
                                "device; exporting to the CPU needs copy=True");
                return NULL;
            }
            dp_device host = {DP_HOST, -1};
            PyObject *h = st->copy_to_device(st, self->meta, host);
            if (h != NULL && dp_dtype_is_ml(PyArray_DESCR((PyArrayObject *)h))) {
                /* NumPy's own __dlpack__ refuses ml_dtypes' dtypes */
                Py_SETREF(h, dp_host_dlpack_export(st, (PyArrayObject *)h));
            }
            if (h == NULL) {
                return NULL;
            }
            PyObject *kwargs = max_version == Py_None ? NULL
                             : Py_BuildValue("{sO}", "max_version", max_version);
            PyObject *m = PyObject_GetAttrString(h, "__dlpack__");
            PyObject *empty = PyTuple_New(0);
            PyObject *cap = (m && empty && (max_version == Py_None || kwargs))
                          ? PyObject_Call(m, empty, kwargs) : NULL;
            Py_XDECREF(empty);
            Py_XDECREF(m);
            Py_XDECREF(kwargs);
            Py_DECREF(h);
            return cap;
        }
        if (type != kDLCUDA || id != self->dev.index) {
            PyErr_Format(PyExc_BufferError, "__dlpack__: cannot export to device (%d, %d); "
                         "the array is on (%d, %d)", type, id, (int)kDLCUDA, self->dev.index);
            return NULL;
        }
    }
    if (want_copy == 1) {
        PyObject *c = dp_export(st, st->copy_to_device(st, self->meta, self->dev));
        if (c == NULL) {
            return NULL;
        }
        PyObject *cap = to_capsule((dp_ArrayObject *)c, versioned, 1, stream_known, consumer);
        Py_DECREF(c);
        return cap;
    }
    return to_capsule(self, versioned, 0, stream_known, consumer);
}

PyObject *array_dlpack_device(PyObject *op, PyObject *unused)
{
    return Py_BuildValue("(ii)", (int)kDLCUDA, ((dp_ArrayObject *)op)->dev.index);
}
