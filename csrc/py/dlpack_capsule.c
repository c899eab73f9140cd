/* dlpack_capsule.c - DLPack capsules, the part that does not depend on where
 * the memory is: taking a producer's capsule (the DLPack Python
 * specification, dlpack.h's comment: the consumer renames the capsule it
 * takes and runs the deleter itself, through an owner capsule here), and
 * making a capsule over an ndarray's memory for a consumer. The GPU import
 * and export (array.c) and the host ones for ml_dtypes' dtypes
 * (host_dlpack.c) share them.
 */
#include "dpmini.h"
#include "dlpack.h"
#include "interop.h"

/* ------------------------------------------------------------------ */
/* Import                                                              */
/* ------------------------------------------------------------------ */

/* Destructors of the capsule that owns an imported tensor (an ndarray's
 * base): the producer's deleter. */
static void owner_versioned(PyObject *cap)
{
    PyObject *t, *v, *tb;
    PyErr_Fetch(&t, &v, &tb);   /* an array may die while an error is pending */
    DLManagedTensorVersioned *m = PyCapsule_GetPointer(cap, "dpmini.dlpack_owner_v");
    if (m != NULL && m->deleter != NULL)
        m->deleter(m);
    PyErr_Clear();
    PyErr_Restore(t, v, tb);
}

static void owner_legacy(PyObject *cap)
{
    PyObject *t, *v, *tb;
    PyErr_Fetch(&t, &v, &tb);   /* an array may die while an error is pending */
    DLManagedTensor *m = PyCapsule_GetPointer(cap, "dpmini.dlpack_owner");
    if (m != NULL && m->deleter != NULL)
        m->deleter(m);
    PyErr_Clear();
    PyErr_Restore(t, v, tb);
}

int dp_dlpack_open(PyObject *cap, const char *argname, DLTensor **t, int *readonly)
{
    *readonly = 0;
    if (PyCapsule_IsValid(cap, "dltensor_versioned")) {
        DLManagedTensorVersioned *m = PyCapsule_GetPointer(cap, "dltensor_versioned");
        if (m->version.major > DP_DLPACK_MAJOR) {
            PyErr_Format(PyExc_BufferError, "%s: DLPack version %u.%u is newer than dpmini "
                         "understands (%d.x)", argname, m->version.major, m->version.minor,
                         DP_DLPACK_MAJOR);
            return -1;
        }
        *t = &m->dl_tensor;
        *readonly = (m->flags & DLPACK_FLAG_BITMASK_READ_ONLY) != 0;
        return 0;
    }
    if (PyCapsule_IsValid(cap, "dltensor")) {
        *t = &((DLManagedTensor *)PyCapsule_GetPointer(cap, "dltensor"))->dl_tensor;
        return 0;
    }
    PyErr_Format(PyExc_BufferError, "%s: __dlpack__ did not return a DLPack capsule", argname);
    return -1;
}

PyObject *dp_dlpack_take(PyObject *cap)
{
    int versioned = PyCapsule_IsValid(cap, "dltensor_versioned");
    void *m = PyCapsule_GetPointer(cap, versioned ? "dltensor_versioned" : "dltensor");
    if (m == NULL)
        return NULL;
    PyObject *owner = versioned ? PyCapsule_New(m, "dpmini.dlpack_owner_v", owner_versioned)
                                : PyCapsule_New(m, "dpmini.dlpack_owner", owner_legacy);
    if (owner == NULL ||
        PyCapsule_SetName(cap, versioned ? "used_dltensor_versioned" : "used_dltensor") < 0) {
        if (owner != NULL)   /* not taken: the capsule keeps the tensor */
            PyCapsule_SetDestructor(owner, NULL);
        Py_XDECREF(owner);
        return NULL;
    }
    return owner;
}

npy_intp *dp_dlpack_shape(const DLTensor *t, npy_intp itemsize, npy_intp *shape,
                          npy_intp *strides)
{
    for (int i = 0; i < t->ndim; i++) {
        shape[i] = (npy_intp)t->shape[i];
        if (t->strides != NULL)
            strides[i] = (npy_intp)(t->strides[i] * (int64_t)itemsize);
    }
    return t->strides != NULL ? strides : NULL;
}

/* ------------------------------------------------------------------ */
/* Export                                                              */
/* ------------------------------------------------------------------ */

/* One allocation per exported capsule: the managed tensor, its shape and
 * strides (in items), and a strong reference to the object that keeps the
 * memory alive. */
typedef struct {
    union {
        DLManagedTensorVersioned v;
        DLManagedTensor legacy;
    } mt;
    int unconsumed;          /* set when the capsule dies never taken    */
    dp_dlpack_release on_release;
    void *stream;            /* passed to on_release                     */
    PyObject *owner;
    int64_t shape[NPY_MAXDIMS];
    int64_t strides[NPY_MAXDIMS];
} export_ctx;

static void export_release(export_ctx *ctx)
{
    /* The deleter may run on any thread (a consumer's), GIL or not. */
    if (!Py_IsInitialized())
        return;   /* interpreter gone: leak rather than crash */
    PyGILState_STATE g = PyGILState_Ensure();
    if (!ctx->unconsumed && ctx->on_release != NULL)
        ctx->on_release(ctx->owner, ctx->stream);
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

/* Destructors of an exported capsule: delete only when never consumed. */
static void capsule_versioned(PyObject *cap)
{
    if (PyCapsule_IsValid(cap, "used_dltensor_versioned"))
        return;
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
    if (PyCapsule_IsValid(cap, "used_dltensor"))
        return;
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

/* a's dtype and strides in DLPack's terms: 0, or -1 with BufferError. */
static int check_exportable(PyArrayObject *a, DLDataType *dt)
{
    if (dp_dl_from_descr(PyArray_DESCR(a), dt) < 0) {
        PyErr_Format(PyExc_BufferError, "__dlpack__: dtype %S has no DLPack type code",
                     (PyObject *)PyArray_DESCR(a));
        return -1;
    }
    npy_intp is = PyArray_ITEMSIZE(a);
    for (int i = 0; i < PyArray_NDIM(a); i++) {
        if (is > 0 && PyArray_STRIDES(a)[i] % is != 0) {
            PyErr_SetString(PyExc_BufferError, "__dlpack__: strides that are not a multiple "
                            "of the item size cannot be expressed in DLPack");
            return -1;
        }
    }
    return 0;
}

/* The capsule over ctx's managed tensor, versioned or legacy. */
static PyObject *new_capsule(export_ctx *ctx, int versioned, uint64_t flags)
{
    if (!versioned) {
        ctx->mt.legacy.manager_ctx = ctx;
        ctx->mt.legacy.deleter = deleter_legacy;
        return PyCapsule_New(&ctx->mt.legacy, "dltensor", capsule_legacy);
    }
    ctx->mt.v.version.major = DP_DLPACK_MAJOR;
    ctx->mt.v.version.minor = DP_DLPACK_MINOR;
    ctx->mt.v.manager_ctx = ctx;
    ctx->mt.v.deleter = deleter_versioned;
    ctx->mt.v.flags = flags;
    return PyCapsule_New(&ctx->mt.v, "dltensor_versioned", capsule_versioned);
}

PyObject *dp_dlpack_capsule(PyArrayObject *a, PyObject *owner, DLDevice dev, int versioned,
                            uint64_t flags, dp_dlpack_release on_release, void *stream)
{
    DLDataType dt;
    if (check_exportable(a, &dt) < 0)
        return NULL;
    export_ctx *ctx = PyMem_RawCalloc(1, sizeof *ctx);
    if (ctx == NULL)
        return PyErr_NoMemory();
    npy_intp is = PyArray_ITEMSIZE(a);
    DLTensor *t = versioned ? &ctx->mt.v.dl_tensor : &ctx->mt.legacy.dl_tensor;
    for (int i = 0; i < PyArray_NDIM(a); i++) {
        ctx->shape[i] = PyArray_DIM(a, i);
        ctx->strides[i] = is > 0 ? PyArray_STRIDES(a)[i] / is : 0;
    }
    t->data = PyArray_DATA(a);
    t->device = dev;
    t->ndim = PyArray_NDIM(a);
    t->dtype = dt;
    t->shape = ctx->shape;
    t->strides = ctx->strides;
    t->byte_offset = 0;
    ctx->on_release = on_release;
    ctx->stream = stream;
    ctx->owner = Py_NewRef(owner);
    if (!PyArray_ISWRITEABLE(a))
        flags |= DLPACK_FLAG_BITMASK_READ_ONLY;
    PyObject *cap = new_capsule(ctx, versioned, flags);
    if (cap == NULL) {
        Py_DECREF(owner);
        PyMem_RawFree(ctx);
    }
    return cap;
}
