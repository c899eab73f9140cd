/* host_dlpack.c - DLPack in host memory for the dtypes that NumPy's own
 * DLPack refuses in both directions (ml_dtypes' bfloat16, the float8
 * kinds, complex32; interop_dtype.c maps their type codes):
 *
 * - import: a producer's CPU tensor (torch.bfloat16, a JAX bfloat16 array)
 *   read as an ndarray of the ml_dtypes dtype over the producer's memory
 *   (a view, no copy; the producer's deleter runs when the ndarray dies);
 * - export: dpmini._dpmini._HostDLPack, a small object with __dlpack__ and
 *   __dlpack_device__ over such an ndarray, which interop_origin.c hands to
 *   the caller's library (torch.from_dlpack, jax.numpy.from_dlpack), so a
 *   bfloat16 result comes back as that library's bfloat16.
 *
 * Both follow the DLPack Python specification (dlpack.h's comment): a
 * consumer renames the capsule it takes and calls the deleter itself.
 */
#include "dpmini.h"
#include "dlpack.h"
#include "interop.h"

#include <string.h>

/* ------------------------------------------------------------------ */
/* Import                                                              */
/* ------------------------------------------------------------------ */

/* Destructors of the capsule that owns an imported tensor (an ndarray's
 * base): the producer's deleter. */
static void owner_versioned(PyObject *cap)
{
    PyObject *t, *v, *tb;
    PyErr_Fetch(&t, &v, &tb);   /* an array may die while an error is pending */
    DLManagedTensorVersioned *m = PyCapsule_GetPointer(cap, "dpmini.host_dlpack_v");
    if (m != NULL && m->deleter != NULL)
        m->deleter(m);
    PyErr_Clear();
    PyErr_Restore(t, v, tb);
}

static void owner_legacy(PyObject *cap)
{
    PyObject *t, *v, *tb;
    PyErr_Fetch(&t, &v, &tb);   /* an array may die while an error is pending */
    DLManagedTensor *m = PyCapsule_GetPointer(cap, "dpmini.host_dlpack");
    if (m != NULL && m->deleter != NULL)
        m->deleter(m);
    PyErr_Clear();
    PyErr_Restore(t, v, tb);
}

/* obj.__dlpack__(max_version=(1, 1)), or without the keyword for a
 * producer older than DLPack 1.0. New reference or NULL. */
static PyObject *ask_capsule(PyObject *obj)
{
    PyObject *meth = PyObject_GetAttrString(obj, "__dlpack__");
    if (meth == NULL)
        return NULL;
    PyObject *empty = PyTuple_New(0);
    PyObject *kw = Py_BuildValue("{s(ii)}", "max_version", DP_DLPACK_MAJOR, DP_DLPACK_MINOR);
    PyObject *cap = empty != NULL && kw != NULL ? PyObject_Call(meth, empty, kw) : NULL;
    if (cap == NULL && PyErr_ExceptionMatches(PyExc_TypeError)) {
        PyErr_Clear();
        cap = PyObject_CallNoArgs(meth);
    }
    Py_XDECREF(kw);
    Py_XDECREF(empty);
    Py_DECREF(meth);
    return cap;
}

/* The ndarray over t's memory with dtype descr (stolen), owned by owner. */
static PyArrayObject *view_of(DLTensor *t, PyArray_Descr *descr, int readonly,
                              PyObject *owner, const char *argname)
{
    npy_intp shape[NPY_MAXDIMS], strides[NPY_MAXDIMS];
    if (t->ndim < 0 || t->ndim > NPY_MAXDIMS) {
        Py_DECREF(descr);
        PyErr_Format(PyExc_BufferError, "%s: DLPack ndim %d out of range", argname, t->ndim);
        return NULL;
    }
    for (int i = 0; i < t->ndim; i++) {
        shape[i] = (npy_intp)t->shape[i];
        if (t->strides != NULL)
            strides[i] = (npy_intp)(t->strides[i] * (int64_t)PyDataType_ELSIZE(descr));
    }
    PyObject *arr = PyArray_NewFromDescr(&PyArray_Type, descr, t->ndim, shape,
                                         t->strides != NULL ? strides : NULL,
                                         (char *)t->data + t->byte_offset,
                                         readonly ? 0 : NPY_ARRAY_WRITEABLE, NULL);
    if (arr != NULL && PyArray_SetBaseObject((PyArrayObject *)arr, Py_NewRef(owner)) < 0)
        Py_CLEAR(arr);
    return (PyArrayObject *)arr;
}

PyArrayObject *dp_host_dlpack_import(PyObject *obj, const char *argname)
{
    PyObject *cap = ask_capsule(obj), *owner = NULL;
    PyArrayObject *res = NULL;
    if (cap == NULL)
        return NULL;
    int versioned = PyCapsule_IsValid(cap, "dltensor_versioned");
    if (!versioned && !PyCapsule_IsValid(cap, "dltensor")) {
        PyErr_Format(PyExc_BufferError, "%s: __dlpack__ did not return a DLPack capsule",
                     argname);
        goto done;
    }
    DLManagedTensorVersioned *mv = versioned
        ? PyCapsule_GetPointer(cap, "dltensor_versioned") : NULL;
    DLManagedTensor *ml = versioned ? NULL : PyCapsule_GetPointer(cap, "dltensor");
    if (versioned && mv->version.major > DP_DLPACK_MAJOR) {
        PyErr_Format(PyExc_BufferError, "%s: DLPack version %u.%u is newer than dpmini "
                     "understands (%d.x)", argname, mv->version.major, mv->version.minor,
                     DP_DLPACK_MAJOR);
        goto done;
    }
    DLTensor *t = versioned ? &mv->dl_tensor : &ml->dl_tensor;
    if (t->device.device_type != kDLCPU && t->device.device_type != kDLCUDAHost) {
        PyErr_Format(PyExc_BufferError, "%s: the DLPack tensor is not in host memory "
                     "(device type %d)", argname, (int)t->device.device_type);
        goto done;
    }
    PyArray_Descr *descr = dp_descr_from_dl(t->dtype);
    if (descr == NULL)
        goto done;   /* no NumPy dtype: the capsule dies unconsumed */
    owner = versioned ? PyCapsule_New(mv, "dpmini.host_dlpack_v", owner_versioned)
                      : PyCapsule_New(ml, "dpmini.host_dlpack", owner_legacy);
    if (owner == NULL ||
        PyCapsule_SetName(cap, versioned ? "used_dltensor_versioned" : "used_dltensor") < 0) {
        Py_DECREF(descr);
        if (owner != NULL)   /* not taken: the capsule keeps the tensor */
            PyCapsule_SetDestructor(owner, NULL);
        goto done;
    }
    int readonly = versioned && (mv->flags & DLPACK_FLAG_BITMASK_READ_ONLY) != 0;
    res = view_of(t, descr, readonly, owner, argname);
done:
    Py_XDECREF(owner);
    Py_DECREF(cap);
    return res;
}

/* ------------------------------------------------------------------ */
/* Export                                                              */
/* ------------------------------------------------------------------ */

typedef struct {
    PyObject_HEAD
    PyArrayObject *arr;   /* the exported ndarray */
} host_export_object;

/* One allocation per exported capsule: the managed tensor, its shape and
 * strides, and a strong reference to the ndarray. */
typedef struct {
    union {
        DLManagedTensorVersioned v;
        DLManagedTensor legacy;
    } mt;
    PyObject *owner;
    int64_t shape[NPY_MAXDIMS];
    int64_t strides[NPY_MAXDIMS];
} host_ctx;

static void ctx_release(host_ctx *ctx)
{
    if (!Py_IsInitialized())
        return;   /* interpreter gone: leak rather than crash */
    PyGILState_STATE g = PyGILState_Ensure();   /* any thread may delete */
    Py_XDECREF(ctx->owner);
    PyMem_RawFree(ctx);
    PyGILState_Release(g);
}

static void deleter_versioned(DLManagedTensorVersioned *self)
{
    ctx_release(self->manager_ctx);
}

static void deleter_legacy(DLManagedTensor *self)
{
    ctx_release(self->manager_ctx);
}

/* Destructors of an exported capsule: delete only when never consumed. */
static void capsule_versioned(PyObject *cap)
{
    if (PyCapsule_IsValid(cap, "used_dltensor_versioned"))
        return;
    PyObject *t, *v, *tb;
    PyErr_Fetch(&t, &v, &tb);
    DLManagedTensorVersioned *m = PyCapsule_GetPointer(cap, "dltensor_versioned");
    if (m != NULL)
        m->deleter(m);
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
    if (m != NULL)
        m->deleter(m);
    PyErr_Clear();
    PyErr_Restore(t, v, tb);
}

/* The capsule over a (versioned: DLManagedTensorVersioned), flags as given. */
static PyObject *to_capsule(PyArrayObject *a, int versioned, uint64_t flags)
{
    DLDataType dt;
    if (dp_dl_from_descr(PyArray_DESCR(a), &dt) < 0) {
        PyErr_Format(PyExc_BufferError, "__dlpack__: dtype %S has no DLPack type code",
                     (PyObject *)PyArray_DESCR(a));
        return NULL;
    }
    npy_intp is = PyArray_ITEMSIZE(a);
    for (int i = 0; i < PyArray_NDIM(a); i++) {
        if (PyArray_STRIDES(a)[i] % is != 0) {
            PyErr_SetString(PyExc_BufferError, "__dlpack__: strides that are not a multiple "
                            "of the item size cannot be expressed in DLPack");
            return NULL;
        }
    }
    host_ctx *ctx = PyMem_RawCalloc(1, sizeof *ctx);
    if (ctx == NULL)
        return PyErr_NoMemory();
    DLTensor *t = versioned ? &ctx->mt.v.dl_tensor : &ctx->mt.legacy.dl_tensor;
    for (int i = 0; i < PyArray_NDIM(a); i++) {
        ctx->shape[i] = PyArray_DIM(a, i);
        ctx->strides[i] = PyArray_STRIDES(a)[i] / is;
    }
    t->data = PyArray_DATA(a);
    t->device.device_type = kDLCPU;
    t->device.device_id = 0;
    t->ndim = PyArray_NDIM(a);
    t->dtype = dt;
    t->shape = ctx->shape;
    t->strides = ctx->strides;
    ctx->owner = Py_NewRef(a);
    PyObject *cap;
    if (versioned) {
        ctx->mt.v.version.major = DP_DLPACK_MAJOR;
        ctx->mt.v.version.minor = DP_DLPACK_MINOR;
        ctx->mt.v.manager_ctx = ctx;
        ctx->mt.v.deleter = deleter_versioned;
        ctx->mt.v.flags = flags | (PyArray_ISWRITEABLE(a) ? 0 : DLPACK_FLAG_BITMASK_READ_ONLY);
        cap = PyCapsule_New(&ctx->mt.v, "dltensor_versioned", capsule_versioned);
    } else {
        ctx->mt.legacy.manager_ctx = ctx;
        ctx->mt.legacy.deleter = deleter_legacy;
        cap = PyCapsule_New(&ctx->mt.legacy, "dltensor", capsule_legacy);
    }
    if (cap == NULL) {
        Py_DECREF(a);
        PyMem_RawFree(ctx);
    }
    return cap;
}

/* __dlpack__(*, stream=None, max_version=None, dl_device=None, copy=None),
 * as the DLPack Python specification words it for host memory: stream must
 * be None (or -1), dl_device the CPU, copy=True exports a fresh copy. */
static PyObject *host_export_dlpack(PyObject *op, PyObject *args, PyObject *kw)
{
    static char *kwlist[] = {"stream", "max_version", "dl_device", "copy", NULL};
    PyObject *stream = Py_None, *max_version = Py_None, *dl_device = Py_None, *copy = Py_None;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "|$OOOO:__dlpack__", kwlist, &stream,
                                     &max_version, &dl_device, &copy))
        return NULL;
    if (stream != Py_None && !(PyLong_Check(stream) && PyLong_AsLong(stream) == -1)) {
        if (!PyErr_Occurred())
            PyErr_SetString(PyExc_BufferError, "__dlpack__: host memory takes stream=None");
        return NULL;
    }
    int versioned = 0, major = 0, minor = 0, type = kDLCPU, id = 0;
    if (max_version != Py_None) {
        if (!PyArg_ParseTuple(max_version, "ii:max_version", &major, &minor))
            return NULL;
        versioned = major >= 1;
    }
    if (dl_device != Py_None && !PyArg_ParseTuple(dl_device, "ii:dl_device", &type, &id))
        return NULL;
    if (type != kDLCPU) {
        PyErr_Format(PyExc_BufferError, "__dlpack__: cannot export host memory to DLPack "
                     "device (%d, %d)", type, id);
        return NULL;
    }
    int want_copy = copy == Py_None ? 0 : PyObject_IsTrue(copy);
    if (want_copy < 0)
        return NULL;
    PyArrayObject *a = ((host_export_object *)op)->arr;
    if (!want_copy)
        return to_capsule(a, versioned, 0);
    PyArrayObject *c = (PyArrayObject *)PyArray_NewCopy(a, NPY_CORDER);
    PyObject *cap = c != NULL ? to_capsule(c, versioned, DLPACK_FLAG_BITMASK_IS_COPIED) : NULL;
    Py_XDECREF(c);
    return cap;
}

static PyObject *host_export_device(PyObject *op, PyObject *unused)
{
    return Py_BuildValue("(ii)", (int)kDLCPU, 0);
}

static int host_export_traverse(PyObject *op, visitproc visit, void *arg)
{
    Py_VISIT(Py_TYPE(op));
    Py_VISIT(((host_export_object *)op)->arr);
    return 0;
}

static void host_export_dealloc(PyObject *op)
{
    PyTypeObject *tp = Py_TYPE(op);
    PyObject_GC_UnTrack(op);
    Py_CLEAR(((host_export_object *)op)->arr);
    tp->tp_free(op);
    Py_DECREF(tp);
}

static PyMethodDef host_export_methods[] = {
    {"__dlpack__", (PyCFunction)(void (*)(void))host_export_dlpack,
     METH_VARARGS | METH_KEYWORDS,
     "__dlpack__(*, stream=None, max_version=None, dl_device=None, copy=None)\n--\n\n"
     "A DLPack capsule over the host ndarray (versioned when max_version >= (1, 0))."},
    {"__dlpack_device__", host_export_device, METH_NOARGS,
     "__dlpack_device__()\n--\n\nReturns (1, 0): kDLCPU."},
    {NULL, NULL, 0, NULL},
};

static PyType_Slot host_export_slots[] = {
    {Py_tp_doc, "A host ndarray of an ml_dtypes dtype (bfloat16, float8, complex32), "
                "exported through DLPack to the caller's array library (NumPy's own "
                "__dlpack__ refuses these dtypes). Internal to dpmini."},
    {Py_tp_methods, host_export_methods},
    {Py_tp_traverse, host_export_traverse},
    {Py_tp_dealloc, host_export_dealloc},
    {0, NULL},
};

PyType_Spec dp_host_dlpack_spec = {
    .name = "dpmini._dpmini._HostDLPack",
    .basicsize = sizeof(host_export_object),
    .flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_DISALLOW_INSTANTIATION,
    .slots = host_export_slots,
};

PyObject *dp_host_dlpack_export(dp_state *st, PyArrayObject *arr)
{
    host_export_object *o = PyObject_GC_New(host_export_object, st->HostDLPackType);
    if (o == NULL)
        return NULL;
    o->arr = (PyArrayObject *)Py_NewRef(arr);
    PyObject_GC_Track(o);
    return (PyObject *)o;
}
