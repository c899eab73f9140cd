/* array_import.c - the imports of other libraries' GPU arrays as shadow
 * ndarrays over their device memory: CUDA Array Interface and DLPack
 * (dp_is_device_object, dp_device_object_meta). The synchronisation
 * contract is in array.c's file comment: an object with a CUDA
 * __dlpack_device__ is imported through __dlpack__(stream=<a dpmini stream>),
 * a CAI-only object's stream (or the legacy default stream) is synchronised.
 */
#include "dpmini.h"
#include "dlpack.h"
#include "gpu.h"
#include "array.h"
#include "interop.h"

#include <string.h>

/* ------------------------------------------------------------------ */
/* Asking an object for its device                                     */
/* ------------------------------------------------------------------ */

/* obj.__dlpack_device__(): 1 with (type, id); 0 when obj has none
 * (AttributeError); -1 with the exception set otherwise. */
static int dlpack_device_ex(PyObject *obj, int *type, int *id)
{
    PyObject *m = PyObject_GetAttrString(obj, "__dlpack_device__");
    if (m == NULL) {
        if (PyErr_ExceptionMatches(PyExc_AttributeError)) {
            PyErr_Clear();
            return 0;
        }
        return -1;
    }
    PyObject *r = PyObject_CallNoArgs(m);
    Py_DECREF(m);
    if (r == NULL) {
        return -1;
    }
    int ok = PyTuple_Check(r) && PyArg_ParseTuple(r, "ii", type, id);
    Py_DECREF(r);
    if (!ok) {
        if (!PyErr_Occurred()) {
            PyErr_SetString(PyExc_TypeError, "__dlpack_device__() must return a tuple "
                            "(device_type, device_id)");
        }
        return -1;
    }
    return 1;
}

/* The pending exception, re-raised (same type, the original as __cause__)
 * with the argument path and the failing protocol named. */
static void reraise_named(const char *argname, PyObject *obj, const char *what)
{
    PyObject *t, *v, *tb;
    PyErr_Fetch(&t, &v, &tb);
    PyErr_NormalizeException(&t, &v, &tb);
    if (v == NULL) {
        Py_XDECREF(t);
        Py_XDECREF(tb);
        PyErr_Format(PyExc_TypeError, "%s: %.100s.%s failed", argname, Py_TYPE(obj)->tp_name,
                     what);
        return;
    }
    if (tb != NULL) {
        PyException_SetTraceback(v, tb);
    }
    PyErr_Format(t, "%s: cannot use %.100s as a GPU array: its %s raised %.100s: %S", argname,
                 Py_TYPE(obj)->tp_name, what, Py_TYPE(v)->tp_name, v);
    PyObject *t2, *v2, *tb2;
    PyErr_Fetch(&t2, &v2, &tb2);
    PyErr_NormalizeException(&t2, &v2, &tb2);
    if (v2 != NULL && PyExceptionInstance_Check(v2)) {
        PyException_SetCause(v2, Py_NewRef(v));
    }
    PyErr_Restore(t2, v2, tb2);
    Py_XDECREF(t);
    Py_XDECREF(v);
    Py_XDECREF(tb);
}

int dp_is_device_object(dp_state *st, PyObject *obj)
{
    if (PyObject_TypeCheck(obj, st->ArrayType)) {
        return 1;
    }
    if (PyArray_Check(obj) || PyType_Check(obj)) {
        return 0;
    }
    /* Only AttributeError means "no such protocol" (a torch CPU tensor's
     * property raises it). Any other error (a CUDA tensor that requires
     * grad, a dtype the exporter cannot describe) makes obj a device object,
     * so that dp_device_object_meta, which knows the argument's name, raises
     * it instead of obj being silently treated as a non-array. */
    PyObject *cai = PyObject_GetAttrString(obj, "__cuda_array_interface__");
    if (cai != NULL) {
        Py_DECREF(cai);
        return 1;
    }
    if (!PyErr_ExceptionMatches(PyExc_AttributeError)) {
        PyErr_Clear();
        return 1;
    }
    PyErr_Clear();
    int type, id, r = dlpack_device_ex(obj, &type, &id);
    if (r < 0) {
        PyErr_Clear();
        return 1;
    }
    return r == 1 && (type == kDLCUDA || type == kDLCUDAManaged);
}

/* ------------------------------------------------------------------ */
/* Import: CUDA Array Interface                                         */
/* ------------------------------------------------------------------ */

static int tuple_of_intp(PyObject *t, const char *what, const char *argname, npy_intp *out,
                         int *n)
{
    if (!PyTuple_Check(t) || PyTuple_GET_SIZE(t) > NPY_MAXDIMS) {
        PyErr_Format(PyExc_TypeError, "%s: __cuda_array_interface__['%s'] must be a tuple "
                     "of ints", argname, what);
        return -1;
    }
    *n = (int)PyTuple_GET_SIZE(t);
    for (int i = 0; i < *n; i++) {
        long long v = PyLong_AsLongLong(PyTuple_GET_ITEM(t, i));
        if (v == -1 && PyErr_Occurred()) {
            return -1;
        }
        out[i] = (npy_intp)v;
    }
    return 0;
}

/* Build a shadow ndarray over device memory at ptr, owned by `owner`. */
static PyArrayObject *make_shadow(dp_state *st, int dev, void *ptr, PyArray_Descr *descr,
                                  int nd, npy_intp *shape, npy_intp *strides, int readonly,
                                  PyObject *owner)
{
    dp_device d = {DP_CUDA, dev};
    size_t itemsize = (size_t)PyDataType_ELSIZE(descr);
    /* bytes the view spans from ptr (for the buffer's record only) */
    size_t nbytes = itemsize;
    for (int i = 0; i < nd; i++) {
        nbytes *= (size_t)shape[i];
    }
    PyObject *buf = dp_buffer_wrap(st, d, ptr, nbytes, owner);
    if (buf == NULL) {
        Py_DECREF(descr);
        return NULL;
    }
    PyObject *arr = PyArray_NewFromDescr(&PyArray_Type, descr, nd, shape, strides, ptr,
                                         readonly ? 0 : NPY_ARRAY_WRITEABLE, NULL);
    if (arr == NULL) {
        Py_DECREF(buf);
        return NULL;
    }
    if (PyArray_SetBaseObject((PyArrayObject *)arr, buf) < 0) {
        Py_DECREF(arr);
        return NULL;
    }
    return (PyArrayObject *)arr;
}

static PyArrayObject *import_cai(dp_state *st, PyObject *obj, PyObject *cai,
                                 const char *argname)
{
    PyArray_Descr *descr = NULL;
    npy_intp shape[NPY_MAXDIMS], strides[NPY_MAXDIMS];
    int nd = 0, nst = 0, has_strides = 0;
    if (!PyDict_Check(cai)) {
        PyErr_Format(PyExc_TypeError, "%s: __cuda_array_interface__ must be a dict", argname);
        return NULL;
    }
    PyObject *shape_o = PyDict_GetItemString(cai, "shape");
    PyObject *typestr = PyDict_GetItemString(cai, "typestr");
    PyObject *data = PyDict_GetItemString(cai, "data");
    PyObject *strides_o = PyDict_GetItemString(cai, "strides");
    PyObject *mask = PyDict_GetItemString(cai, "mask");
    PyObject *stream = PyDict_GetItemString(cai, "stream");
    PyObject *version = PyDict_GetItemString(cai, "version");
    long ver = version != NULL && PyLong_Check(version) ? PyLong_AsLong(version) : 0;
    if (ver == -1 && PyErr_Occurred()) {
        return NULL;
    }
    if (shape_o == NULL || typestr == NULL || data == NULL || !PyTuple_Check(data) ||
        PyTuple_GET_SIZE(data) != 2) {
        PyErr_Format(PyExc_TypeError, "%s: __cuda_array_interface__ lacks 'shape', 'typestr' "
                     "or a (pointer, read_only) 'data'", argname);
        return NULL;
    }
    if (mask != NULL && mask != Py_None) {
        PyErr_Format(PyExc_BufferError, "%s: masked CUDA arrays are not supported", argname);
        return NULL;
    }
    if (tuple_of_intp(shape_o, "shape", argname, shape, &nd) < 0) {
        return NULL;
    }
    if (strides_o != NULL && strides_o != Py_None) {
        if (tuple_of_intp(strides_o, "strides", argname, strides, &nst) < 0) {
            return NULL;
        }
        if (nst != nd) {
            PyErr_Format(PyExc_ValueError, "%s: __cuda_array_interface__ has %d strides for "
                         "%d dims", argname, nst, nd);
            return NULL;
        }
        has_strides = 1;
    }
    if (!PyArray_DescrConverter(typestr, &descr)) {
        return NULL;
    }
    if (PyDataType_REFCHK(descr)) {
        Py_DECREF(descr);
        PyErr_Format(PyExc_TypeError, "%s: object dtypes cannot live on a GPU", argname);
        return NULL;
    }
    void *ptr = PyLong_AsVoidPtr(PyTuple_GET_ITEM(data, 0));
    int readonly = PyObject_IsTrue(PyTuple_GET_ITEM(data, 1));
    if ((ptr == NULL && PyErr_Occurred()) || readonly < 0) {
        Py_DECREF(descr);
        return NULL;
    }
    /* A NULL pointer (an empty array) has no memory: no device to ask and
     * nothing to wait for; it is taken to be on the caller's current device
     * (cudaGetDevice, which creates no context). */
    int dev = ptr == NULL ? dpc_current_device() : 0;
    if (dev < 0) {
        dev = 0;
    }
    if (ptr != NULL && !dpc_is_device_ptr(ptr, &dev)) {
        Py_DECREF(descr);
        PyErr_Format(PyExc_BufferError, "%s: __cuda_array_interface__ pointer %p is not CUDA "
                     "device memory that dpmini can see", argname, ptr);
        return NULL;
    }
    if (dev >= dpc_device_count()) {
        Py_DECREF(descr);
        PyErr_Format(PyExc_BufferError, "%s: memory on CUDA device %d, but dpmini sees %d",
                     argname, dev, dpc_device_count());
        return NULL;
    }
    if (ptr == NULL) {
        /* nothing to wait for */
    } else if (stream == NULL || ver < 3) {
        /* No 'stream' key (CAI v2, e.g. PyTorch) or version < 3: the producer
         * promises nothing. Its work is most likely on the legacy default
         * stream (PyTorch's and CuPy's default), which dpmini's non-blocking
         * streams do not wait for: synchronise it (GIL released). */
        dpc_status s;
        Py_BEGIN_ALLOW_THREADS
        s = dpc_stream_sync(dev, DPC_STREAM_LEGACY);
        Py_END_ALLOW_THREADS
        __atomic_add_fetch(&dp_gpu_stat_legacy_syncs, 1, __ATOMIC_RELAXED);
        if (s.code != 0) {
            Py_DECREF(descr);
            dp_gpu_raise(st, s, "import __cuda_array_interface__ (no 'stream' key): wait for "
                         "the legacy default stream");
            return NULL;
        }
    } else if (stream != Py_None) {
        /* v3: the producer's work is ordered on this stream; wait for it */
        void *sp = PyLong_AsVoidPtr(stream);
        if (sp == NULL && PyErr_Occurred()) {
            Py_DECREF(descr);
            return NULL;
        }
        if (sp == NULL) {
            Py_DECREF(descr);
            PyErr_Format(PyExc_ValueError, "%s: __cuda_array_interface__ stream 0 is "
                         "disallowed (ambiguous)", argname);
            return NULL;
        }
        dpc_status s;
        Py_BEGIN_ALLOW_THREADS
        if (sp == DPC_STREAM_PER_THREAD) {
            /* the per-thread default stream of the PRODUCER's thread, which
             * need not be this one (a replica's output, gathered on the
             * caller's thread): this thread cannot name it, so the device is
             * synchronised */
            s = dpc_device_sync(dev);
        } else {
            s = dpc_stream_sync(dev, sp); /* on dev, the caller's device left as it was */
        }
        Py_END_ALLOW_THREADS
        if (s.code != 0) {
            Py_DECREF(descr);
            dp_gpu_raise(st, s, "import __cuda_array_interface__: wait for the producer's stream");
            return NULL;
        }
    }
    return make_shadow(st, dev, ptr, descr, nd, shape, has_strides ? strides : NULL, readonly,
                       obj);
}

/* ------------------------------------------------------------------ */
/* Import: DLPack                                                      */
/* ------------------------------------------------------------------ */

/* Owner of an imported DLPack tensor: a capsule whose destructor calls the
 * producer's deleter. */
static void owner_versioned(PyObject *cap)
{
    PyObject *t, *v, *tb;
    PyErr_Fetch(&t, &v, &tb);   /* an array may die while an error is pending */
    DLManagedTensorVersioned *m = PyCapsule_GetPointer(cap, "dpmini.dlpack_owner_v");
    if (m != NULL && m->deleter != NULL) {
        m->deleter(m);
    }
    PyErr_Clear();
    PyErr_Restore(t, v, tb);
}

static void owner_legacy(PyObject *cap)
{
    PyObject *t, *v, *tb;
    PyErr_Fetch(&t, &v, &tb);   /* an array may die while an error is pending */
    DLManagedTensor *m = PyCapsule_GetPointer(cap, "dpmini.dlpack_owner");
    if (m != NULL && m->deleter != NULL) {
        m->deleter(m);
    }
    PyErr_Clear();
    PyErr_Restore(t, v, tb);
}

static PyArrayObject *import_dlpack(dp_state *st, PyObject *obj, int dev_hint,
                                    const char *argname)
{
    PyObject *cap = NULL, *owner = NULL, *stream = NULL, *kw = NULL, *meth = NULL;
    PyArrayObject *res = NULL;
    int readonly = 0;
    dpc_stream s = NULL;
    dpc_status status = dpc_stream_get(dev_hint, 0, &s);
    if (status.code != 0) {
        dp_gpu_raise(st, status, "import __dlpack__: get a stream");
        return NULL;
    }
    stream = PyLong_FromVoidPtr(s);
    kw = Py_BuildValue("{sOs(ii)}", "stream", stream, "max_version", 1, 0);
    meth = PyObject_GetAttrString(obj, "__dlpack__");
    if (stream == NULL || kw == NULL || meth == NULL) {
        goto done;
    }
    PyObject *empty = PyTuple_New(0);
    if (empty == NULL) {
        goto done;
    }
    /* The producer's device current while it runs: PyTorch's __dlpack__
     * orders its work through an event recorded on the current stream of
     * the CURRENT device, so with another device current it would wait for
     * the wrong GPU's work (and the import would read while kernels run). */
    dpc_device_guard guard;
    status = dpc_guard_enter(dev_hint, &guard);
    if (status.code != 0) {
        Py_DECREF(empty);
        dp_gpu_raise(st, status, "import __dlpack__: make the producer's device current");
        goto done;
    }
    cap = PyObject_Call(meth, empty, kw);
    if (cap == NULL && PyErr_ExceptionMatches(PyExc_TypeError)) {
        PyErr_Clear(); /* a pre-1.0 producer: no max_version keyword */
        PyDict_DelItemString(kw, "max_version");
        cap = PyObject_Call(meth, empty, kw);
    }
    dpc_guard_leave(&guard);
    Py_DECREF(empty);
    if (cap == NULL) {
        reraise_named(argname, obj, "__dlpack__()");
        goto done;
    }
    DLTensor *t;
    if (PyCapsule_IsValid(cap, "dltensor_versioned")) {
        DLManagedTensorVersioned *m = PyCapsule_GetPointer(cap, "dltensor_versioned");
        if (m->version.major > DP_DLPACK_MAJOR) {
            PyErr_Format(PyExc_BufferError, "%s: DLPack version %u.%u is newer than dpmini "
                         "understands (%d.x)", argname, m->version.major, m->version.minor,
                         DP_DLPACK_MAJOR);
            goto done;
        }
        owner = PyCapsule_New(m, "dpmini.dlpack_owner_v", owner_versioned);
        if (owner == NULL || PyCapsule_SetName(cap, "used_dltensor_versioned") < 0) {
            goto done;
        }
        t = &m->dl_tensor;
        readonly = (m->flags & DLPACK_FLAG_BITMASK_READ_ONLY) != 0; /* a read-only shadow */
    } else if (PyCapsule_IsValid(cap, "dltensor")) {
        DLManagedTensor *m = PyCapsule_GetPointer(cap, "dltensor");
        owner = PyCapsule_New(m, "dpmini.dlpack_owner", owner_legacy);
        if (owner == NULL || PyCapsule_SetName(cap, "used_dltensor") < 0) {
            goto done;
        }
        t = &m->dl_tensor;
    } else {
        PyErr_Format(PyExc_BufferError, "%s: __dlpack__ did not return a DLPack capsule",
                     argname);
        goto done;
    }
    if (t->device.device_type != kDLCUDA && t->device.device_type != kDLCUDAManaged) {
        PyErr_Format(PyExc_BufferError, "%s: DLPack tensor is not on a CUDA device "
                     "(device type %d)", argname, (int)t->device.device_type);
        goto done;
    }
    if (t->ndim < 0 || t->ndim > NPY_MAXDIMS) {
        PyErr_Format(PyExc_BufferError, "%s: DLPack ndim %d out of range", argname, t->ndim);
        goto done;
    }
    PyArray_Descr *descr = dp_descr_from_dl(t->dtype);
    if (descr == NULL) {
        PyErr_Format(PyExc_BufferError, "%s: DLPack dtype (code %d, bits %d, lanes %d) has no "
                     "NumPy equivalent", argname, t->dtype.code, t->dtype.bits, t->dtype.lanes);
        goto done;
    }
    npy_intp shape[NPY_MAXDIMS], strides[NPY_MAXDIMS];
    for (int i = 0; i < t->ndim; i++) {
        shape[i] = (npy_intp)t->shape[i];
        if (t->strides != NULL) {
            strides[i] = (npy_intp)(t->strides[i] * (int64_t)PyDataType_ELSIZE(descr));
        }
    }
    {
        Py_BEGIN_ALLOW_THREADS
        status = dpc_stream_sync(t->device.device_id, s);
        Py_END_ALLOW_THREADS
        if (status.code != 0) {
            Py_DECREF(descr);
            dp_gpu_raise(st, status, "import __dlpack__: wait for the producer");
            goto done;
        }
    }
    if (t->device.device_id != dev_hint) {
        Py_DECREF(descr);
        PyErr_Format(PyExc_BufferError, "%s: __dlpack_device__ said CUDA device %d, the tensor "
                     "is on %d", argname, dev_hint, (int)t->device.device_id);
        goto done;
    }
    res = make_shadow(st, t->device.device_id, (char *)t->data + t->byte_offset, descr,
                      t->ndim, shape, t->strides ? strides : NULL, readonly, owner);
done:
    Py_XDECREF(owner);
    Py_XDECREF(cap);
    Py_XDECREF(meth);
    Py_XDECREF(kw);
    Py_XDECREF(stream);
    return res;
}

/* (device_type, device_id) from obj.__dlpack_device__(), or -1 (no error). */
int dlpack_device(PyObject *obj, int *type, int *id)
{
    int r = dlpack_device_ex(obj, type, id);
    if (r < 0) {
        PyErr_Clear();
    }
    return r == 1 ? 0 : -1;
}

PyArrayObject *dp_device_object_meta(dp_state *st, PyObject *obj, const char *argname)
{
    if (PyObject_TypeCheck(obj, st->ArrayType)) {
        PyArrayObject *m = ((dp_ArrayObject *)obj)->meta;
        Py_INCREF(m);
        return m;
    }
    /* DLPack first: __dlpack__(stream=ours) lets the producer order its work
     * before our stream (CAI v2 producers such as PyTorch promise nothing). */
    int type, id, r = dlpack_device_ex(obj, &type, &id);
    if (r < 0) {
        reraise_named(argname, obj, "__dlpack_device__()");
        return NULL;
    }
    if (r == 1 && (type == kDLCUDA || type == kDLCUDAManaged)) {
        if (id < 0 || id >= dpc_device_count()) {
            PyErr_Format(PyExc_BufferError, "%s: DLPack tensor on CUDA device %d, but dpmini "
                         "sees %d", argname, id, dpc_device_count());
            return NULL;
        }
        return import_dlpack(st, obj, id, argname);
    }
    PyObject *cai = PyObject_GetAttrString(obj, "__cuda_array_interface__");
    if (cai != NULL) {
        PyArrayObject *a = import_cai(st, obj, cai, argname);
        Py_DECREF(cai);
        return a;
    }
    if (!PyErr_ExceptionMatches(PyExc_AttributeError)) {
        reraise_named(argname, obj, "__cuda_array_interface__");
        return NULL;
    }
    PyErr_Clear();
    PyErr_Format(PyExc_TypeError, "%s: %.100s is not a GPU array (no __cuda_array_interface__ "
                 "or CUDA __dlpack_device__)", argname, Py_TYPE(obj)->tp_name);
    return NULL;
}
