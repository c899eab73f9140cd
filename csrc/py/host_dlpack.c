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
 * consumer renames the capsule it takes and calls the deleter itself; the
 * capsules themselves are dlpack_capsule.c's, shared with array.c.
 */
#include "dpmini.h"
#include "dlpack.h"
#include "interop.h"

#include <string.h>

/* ------------------------------------------------------------------ */
/* Import                                                              */
/* ------------------------------------------------------------------ */

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
    npy_intp *st = dp_dlpack_shape(t, PyDataType_ELSIZE(descr), shape, strides);
    PyObject *arr = PyArray_NewFromDescr(&PyArray_Type, descr, t->ndim, shape, st,
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
    DLTensor *t;
    int readonly;
    if (cap == NULL)
        return NULL;
    if (dp_dlpack_open(cap, argname, &t, &readonly) < 0)
        goto done;
    if (t->device.device_type != kDLCPU && t->device.device_type != kDLCUDAHost) {
        PyErr_Format(PyExc_BufferError, "%s: the DLPack tensor is not in host memory "
                     "(device type %d)", argname, (int)t->device.device_type);
        goto done;
    }
    PyArray_Descr *descr = dp_descr_from_dl(t->dtype);
    if (descr == NULL)
        goto done;   /* no NumPy dtype: the capsule dies unconsumed */
    owner = dp_dlpack_take(cap);
    if (owner == NULL) {
        Py_DECREF(descr);
        goto done;
    }
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

/* The capsule over a, a host ndarray (versioned: DLManagedTensorVersioned
 * with flags). */
static PyObject *to_capsule(PyArrayObject *a, int versioned, uint64_t flags)
{
    DLDevice cpu = {kDLCPU, 0};
    return dp_dlpack_capsule(a, (PyObject *)a, cpu, versioned, flags, NULL, NULL);
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
