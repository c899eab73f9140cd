/* array.c - dpmini.Array (an array in CUDA device memory): the type, its
 * getters and methods, and its __cuda_array_interface__ (v3) export; the
 * imports of other libraries' GPU arrays (CUDA Array Interface, DLPack) as
 * shadow ndarrays; the __dlpack__ export (versioned and legacy capsules,
 * copy=True to the host) and __dlpack_device__; the module functions
 * from_dlpack, empty, cuda_build_info, _gpu_at_exit (dp_array_methods).
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
 *
 * Sections: imports (asking an object for its device, CAI, DLPack); the
 * DLPack export; the type; module functions.
 */
#include "dpmini.h"
#include "dlpack.h"
#include "gpu.h"
#include "interop.h"

#include <string.h>

/* Mark the buffer that owns a's memory as exported (this file's comment;
 * gpu_export.c waits before its block is reused): known 1 with the stream a
 * DLPack consumer named (its release waits on that stream), 0 for none (a
 * device sync shared with other such blocks). */
static void mark_exported(dp_state *st, PyArrayObject *a, int known, void *stream);

/* dpmini.Array.__dlpack__ and __dlpack_device__, in the type's method
 * table. */
static PyObject *array_dlpack(PyObject *op, PyObject *args, PyObject *kw);
static PyObject *array_dlpack_device(PyObject *op, PyObject *unused);

/* (device_type, device_id) from obj.__dlpack_device__(), or -1 with no error
 * set (none, or it raised). */
static int dlpack_device(PyObject *obj, int *type, int *id);

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
    dp_attach_cause(v);
    Py_XDECREF(t);
    Py_XDECREF(tb);
}

/* BufferError: argname's `what` is on CUDA device dev, which dpmini does not
 * see (none at all, or fewer devices). */
static void raise_unseen_cuda(const char *argname, const char *what, int dev)
{
    int count = dpc_device_count();
    if (count <= 0) {
        PyErr_Format(PyExc_BufferError, "%s: %s on CUDA device %d, but dpmini sees no CUDA "
                     "device (built without CUDA, or no GPU or driver)", argname, what, dev);
    } else {
        PyErr_Format(PyExc_BufferError, "%s: %s on CUDA device %d, but dpmini sees %d CUDA "
                     "device%s (0 to %d)", argname, what, dev, count, count == 1 ? "" : "s",
                     count - 1);
    }
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

/* What a __cuda_array_interface__ dict says, read and checked. */
typedef struct {
    PyArray_Descr *descr;   /* owned */
    npy_intp shape[NPY_MAXDIMS], strides[NPY_MAXDIMS];
    int nd, has_strides;
    void *ptr;              /* NULL: an empty array, no memory            */
    int readonly;
    PyObject *stream;       /* borrowed from the dict; NULL when absent   */
    long version;
    int dev;                /* the CUDA device of ptr                     */
} cai_fields;

/* The dict's keys into f (f->descr owned on success): shape, strides,
 * typestr, data, mask refused, stream and version. 0, or -1 with the
 * exception set naming argname. */
static int cai_read(PyObject *cai, const char *argname, cai_fields *f)
{
    if (!PyDict_Check(cai)) {
        PyErr_Format(PyExc_TypeError, "%s: __cuda_array_interface__ must be a dict", argname);
        return -1;
    }
    PyObject *shape_o = PyDict_GetItemString(cai, "shape");
    PyObject *typestr = PyDict_GetItemString(cai, "typestr");
    PyObject *data = PyDict_GetItemString(cai, "data");
    PyObject *strides_o = PyDict_GetItemString(cai, "strides");
    PyObject *mask = PyDict_GetItemString(cai, "mask");
    PyObject *version = PyDict_GetItemString(cai, "version");
    f->stream = PyDict_GetItemString(cai, "stream");
    f->version = version != NULL && PyLong_Check(version) ? PyLong_AsLong(version) : 0;
    if (f->version == -1 && PyErr_Occurred()) {
        return -1;
    }
    if (shape_o == NULL || typestr == NULL || data == NULL || !PyTuple_Check(data) ||
        PyTuple_GET_SIZE(data) != 2) {
        PyErr_Format(PyExc_TypeError, "%s: __cuda_array_interface__ lacks 'shape', 'typestr' "
                     "or a (pointer, read_only) 'data'", argname);
        return -1;
    }
    if (mask != NULL && mask != Py_None) {
        PyErr_Format(PyExc_BufferError, "%s: masked CUDA arrays are not supported", argname);
        return -1;
    }
    if (tuple_of_intp(shape_o, "shape", argname, f->shape, &f->nd) < 0) {
        return -1;
    }
    if (strides_o != NULL && strides_o != Py_None) {
        int nst = 0;
        if (tuple_of_intp(strides_o, "strides", argname, f->strides, &nst) < 0) {
            return -1;
        }
        if (nst != f->nd) {
            PyErr_Format(PyExc_ValueError, "%s: __cuda_array_interface__ has %d strides for "
                         "%d dims", argname, nst, f->nd);
            return -1;
        }
        f->has_strides = 1;
    }
    if (!PyArray_DescrConverter(typestr, &f->descr)) {
        return -1;
    }
    if (PyDataType_REFCHK(f->descr)) {
        Py_CLEAR(f->descr);
        PyErr_Format(PyExc_TypeError, "%s: object dtypes cannot live on a GPU", argname);
        return -1;
    }
    f->ptr = PyLong_AsVoidPtr(PyTuple_GET_ITEM(data, 0));
    f->readonly = PyObject_IsTrue(PyTuple_GET_ITEM(data, 1));
    if ((f->ptr == NULL && PyErr_Occurred()) || f->readonly < 0) {
        Py_CLEAR(f->descr);
        return -1;
    }
    return 0;
}

/* f->dev: the CUDA device that holds f->ptr, one dpmini sees. A NULL
 * pointer (an empty array) has no memory: no device to ask; it is taken to
 * be on the caller's current device (cudaGetDevice, which creates no
 * context). 0, or -1 with BufferError. */
static int cai_device(cai_fields *f, const char *argname)
{
    int dev = f->ptr == NULL ? dpc_current_device() : 0;
    if (dev < 0) {
        dev = 0;
    }
    if (f->ptr != NULL && !dpc_is_device_ptr(f->ptr, &dev)) {
        PyErr_Format(PyExc_BufferError, "%s: __cuda_array_interface__ pointer %p is not CUDA "
                     "device memory that dpmini can see", argname, f->ptr);
        return -1;
    }
    if (dev >= dpc_device_count()) {
        raise_unseen_cuda(argname, "memory", dev);
        return -1;
    }
    f->dev = dev;
    return 0;
}

/* Wait for the producer's work on the memory (GIL released): nothing for an
 * empty array; the legacy default stream when the dict promises nothing
 * (no 'stream' key, as CAI v2 of PyTorch, or version < 3); else the stream
 * it names (None: nothing to wait for). 0, or -1 with the exception set. */
static int cai_wait(dp_state *st, const cai_fields *f, const char *argname)
{
    if (f->ptr == NULL) {
        return 0;
    }
    dpc_status s;
    if (f->stream == NULL || f->version < 3) {
        /* The producer's work is most likely on the legacy default stream
         * (PyTorch's and CuPy's default), which dpmini's non-blocking
         * streams do not wait for. */
        Py_BEGIN_ALLOW_THREADS
        s = dpc_stream_sync(f->dev, DPC_STREAM_LEGACY);
        Py_END_ALLOW_THREADS
        __atomic_add_fetch(&dp_gpu_stat_legacy_syncs, 1, __ATOMIC_RELAXED);
        if (s.code != 0) {
            dp_gpu_raise(st, s, "import __cuda_array_interface__ (no 'stream' key): wait for "
                         "the legacy default stream");
            return -1;
        }
        return 0;
    }
    if (f->stream == Py_None) {
        return 0;
    }
    /* v3: the producer's work is ordered on this stream; wait for it */
    void *sp = PyLong_AsVoidPtr(f->stream);
    if (sp == NULL && PyErr_Occurred()) {
        return -1;
    }
    if (sp == NULL) {
        PyErr_Format(PyExc_ValueError, "%s: __cuda_array_interface__ stream 0 is "
                     "disallowed (ambiguous)", argname);
        return -1;
    }
    Py_BEGIN_ALLOW_THREADS
    if (sp == DPC_STREAM_PER_THREAD) {
        /* the per-thread default stream of the PRODUCER's thread, which
         * need not be this one (a replica's output, gathered on the
         * caller's thread): this thread cannot name it, so the device is
         * synchronised */
        s = dpc_device_sync(f->dev);
    } else {
        s = dpc_stream_sync(f->dev, sp); /* on dev, the caller's device left as it was */
    }
    Py_END_ALLOW_THREADS
    if (s.code != 0) {
        dp_gpu_raise(st, s, "import __cuda_array_interface__: wait for the producer's stream");
        return -1;
    }
    return 0;
}

static PyArrayObject *import_cai(dp_state *st, PyObject *obj, PyObject *cai,
                                 const char *argname)
{
    cai_fields f = {0};
    if (cai_read(cai, argname, &f) < 0) {
        return NULL;
    }
    if (cai_device(&f, argname) < 0 || cai_wait(st, &f, argname) < 0) {
        Py_DECREF(f.descr);
        return NULL;
    }
    return make_shadow(st, f.dev, f.ptr, f.descr, f.nd, f.shape,
                       f.has_strides ? f.strides : NULL, f.readonly, obj);
}

/* ------------------------------------------------------------------ */
/* Import: DLPack                                                      */
/* ------------------------------------------------------------------ */

/* obj.__dlpack__(stream=s, max_version=(1, 0)) with the producer's device
 * dev current, or without max_version for a producer older than DLPack 1.0.
 * New reference, or NULL (an error of __dlpack__ itself named with argname). */
static PyObject *ask_gpu_capsule(dp_state *st, PyObject *obj, int dev, dpc_stream s,
                                 const char *argname)
{
    PyObject *cap = NULL, *empty = NULL, *stream = PyLong_FromVoidPtr(s);
    PyObject *kw = Py_BuildValue("{sOs(ii)}", "stream", stream, "max_version", 1, 0);
    PyObject *meth = PyObject_GetAttrString(obj, "__dlpack__");
    if (stream == NULL || kw == NULL || meth == NULL || (empty = PyTuple_New(0)) == NULL)
        goto done;
    /* The producer's device current while it runs: PyTorch's __dlpack__
     * orders its work through an event recorded on the current stream of
     * the CURRENT device, so with another device current it would wait for
     * the wrong GPU's work (and the import would read while kernels run). */
    dpc_device_guard guard;
    dpc_status status = dpc_guard_enter(dev, &guard);
    if (status.code != 0) {
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
    if (cap == NULL)
        reraise_named(argname, obj, "__dlpack__()");
done:
    Py_XDECREF(empty);
    Py_XDECREF(meth);
    Py_XDECREF(kw);
    Py_XDECREF(stream);
    return cap;
}

/* The NumPy dtype of t, a tensor on a CUDA device that an ndarray can
 * describe (new reference), or NULL with BufferError. */
static PyArray_Descr *gpu_tensor_descr(const DLTensor *t, const char *argname)
{
    if (t->device.device_type != kDLCUDA && t->device.device_type != kDLCUDAManaged) {
        PyErr_Format(PyExc_BufferError, "%s: DLPack tensor is not on a CUDA device "
                     "(device type %d)", argname, (int)t->device.device_type);
        return NULL;
    }
    if (t->ndim < 0 || t->ndim > NPY_MAXDIMS) {
        PyErr_Format(PyExc_BufferError, "%s: DLPack ndim %d out of range", argname, t->ndim);
        return NULL;
    }
    PyArray_Descr *descr = dp_descr_from_dl(t->dtype);
    if (descr == NULL)
        PyErr_Format(PyExc_BufferError, "%s: DLPack dtype (code %d, bits %d, lanes %d) has no "
                     "NumPy equivalent", argname, t->dtype.code, t->dtype.bits, t->dtype.lanes);
    return descr;
}

/* The producer's work, ordered before stream s by its __dlpack__, waited
 * for. 0 or -1. */
static int wait_producer(dp_state *st, const DLTensor *t, dpc_stream s)
{
    dpc_status status;
    Py_BEGIN_ALLOW_THREADS
    status = dpc_stream_sync(t->device.device_id, s);
    Py_END_ALLOW_THREADS
    if (status.code != 0) {
        dp_gpu_raise(st, status, "import __dlpack__: wait for the producer");
        return -1;
    }
    return 0;
}

/* obj's DLPack tensor on CUDA device dev_hint (what __dlpack_device__
 * said) as a shadow ndarray over its memory, once the producer's work is
 * done. */
static PyArrayObject *import_dlpack(dp_state *st, PyObject *obj, int dev_hint,
                                    const char *argname)
{
    dpc_stream s = NULL;
    dpc_status status = dpc_stream_get(dev_hint, 0, &s);
    if (status.code != 0) {
        dp_gpu_raise(st, status, "import __dlpack__: get a stream");
        return NULL;
    }
    PyObject *cap = ask_gpu_capsule(st, obj, dev_hint, s, argname), *owner = NULL;
    if (cap == NULL)
        return NULL;
    PyArrayObject *res = NULL;
    PyArray_Descr *descr = NULL;
    DLTensor *t;
    int readonly;   /* a read-only shadow */
    if (dp_dlpack_open(cap, argname, &t, &readonly) < 0 ||
        (descr = gpu_tensor_descr(t, argname)) == NULL || wait_producer(st, t, s) < 0)
        goto done;
    if (t->device.device_id != dev_hint) {
        PyErr_Format(PyExc_BufferError, "%s: __dlpack_device__ said CUDA device %d, the tensor "
                     "is on %d", argname, dev_hint, (int)t->device.device_id);
        goto done;
    }
    if ((owner = dp_dlpack_take(cap)) == NULL)
        goto done;
    npy_intp shape[NPY_MAXDIMS], strides_buf[NPY_MAXDIMS];
    npy_intp *strides = dp_dlpack_shape(t, PyDataType_ELSIZE(descr), shape, strides_buf);
    res = make_shadow(st, t->device.device_id, (char *)t->data + t->byte_offset, descr,
                      t->ndim, shape, strides, readonly, owner);
    descr = NULL;   /* make_shadow's */
done:
    Py_XDECREF(descr);
    Py_XDECREF(owner);
    Py_DECREF(cap);
    return res;
}

/* (device_type, device_id) from obj.__dlpack_device__(), or -1 (no error). */
static int dlpack_device(PyObject *obj, int *type, int *id)
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
            raise_unseen_cuda(argname, "DLPack tensor", id);
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

/* ------------------------------------------------------------------ */
/* Export: DLPack                                                      */
/* ------------------------------------------------------------------ */

/* A consumer released what it took of owner, a dpmini.Array: its work on
 * stream (NULL: none named) must finish before the block is reused (marked
 * now, waited for at the free). */
static void release_exported(PyObject *owner, void *stream)
{
    mark_exported(dp_state_from_type(Py_TYPE(owner)), ((dp_ArrayObject *)owner)->meta,
                  stream != NULL, stream);
}

/* The capsule over self's memory; copied: it is a fresh copy (the
 * IS_COPIED flag); consumer: the stream the consumer named, or NULL. */
static PyObject *to_capsule(dp_ArrayObject *self, int versioned, int copied, void *consumer)
{
    DLDevice dev = {kDLCUDA, self->dev.index};
    return dp_dlpack_capsule(self->meta, (PyObject *)self, dev, versioned,
                             copied ? DLPACK_FLAG_BITMASK_IS_COPIED : 0, release_exported,
                             consumer);
}

/* __dlpack__'s keyword arguments, read and checked. */
typedef struct {
    void *consumer;     /* a stream the consumer will use the tensor on; NULL: none */
    int versioned;      /* max_version >= (1, 0): a versioned capsule        */
    int want_copy;      /* copy: -1 None (copy only if needed), 0 or 1       */
    int to_host;        /* dl_device is the CPU (a copy there)               */
} dlpack_args;

/* stream: None, or a CUDA stream handle as an int. 0 with *consumer set
 * (NULL: nothing to wait on later), or -1. */
static int dlpack_stream(PyObject *stream, void **consumer)
{
    *consumer = NULL;
    if (stream == Py_None)
        return 0;
    if (!PyLong_Check(stream)) {
        PyErr_Format(PyExc_TypeError, "__dlpack__: stream must be None or an int, got "
                     "%.100s", Py_TYPE(stream)->tp_name);
        return -1;
    }
    long v = PyLong_AsLong(stream);
    if (v == -1 && PyErr_Occurred())
        return -1;
    if (v == 0) {
        PyErr_SetString(PyExc_BufferError, "__dlpack__: stream 0 is disallowed for CUDA "
                        "(ambiguous; use 1 for the legacy default stream)");
        return -1;
    }
    /* Nothing to order: dpmini arrays are always ready (see file comment).
     * Kept to wait on before the memory is reused: a handle, or 1 (the
     * legacy default stream); -1 (no synchronisation) and 2 (the consumer
     * thread's per-thread default stream) name nothing dpmini can wait on
     * later. A handle > 0 is never NULL, so NULL means "none". */
    if (v > 0 && v != 2) {
        *consumer = PyLong_AsVoidPtr(stream);
        if (*consumer == NULL && PyErr_Occurred())
            return -1;
    }
    return 0;
}

/* The keyword arguments of __dlpack__ on self into a, in the order they
 * are checked. 0 or -1. */
static int dlpack_args_read(dp_ArrayObject *self, PyObject *stream, PyObject *max_version,
                            PyObject *dl_device, PyObject *copy, dlpack_args *a)
{
    *a = (dlpack_args){NULL, 0, -1, 0};
    if (dlpack_stream(stream, &a->consumer) < 0)
        return -1;
    if (max_version != Py_None) {
        int major, minor;
        if (!PyArg_ParseTuple(max_version, "ii:max_version", &major, &minor))
            return -1;
        a->versioned = major >= 1;
    }
    if (copy != Py_None && (a->want_copy = PyObject_IsTrue(copy)) < 0)
        return -1;
    if (dl_device == Py_None)
        return 0;
    int type, id;
    if (!PyArg_ParseTuple(dl_device, "ii:dl_device", &type, &id))
        return -1;
    if (type == kDLCPU) {
        if (a->want_copy == 0) {
            PyErr_SetString(PyExc_BufferError, "__dlpack__: the array is on a CUDA "
                            "device; exporting to the CPU needs copy=True");
            return -1;
        }
        a->to_host = 1;
        return 0;
    }
    if (type != kDLCUDA || id != self->dev.index) {
        PyErr_Format(PyExc_BufferError, "__dlpack__: cannot export to device (%d, %d); "
                     "the array is on (%d, %d)", type, id, (int)kDLCUDA, self->dev.index);
        return -1;
    }
    return 0;
}

/* __dlpack__(dl_device=(kDLCPU, 0), copy=True): a host copy's own
 * __dlpack__ (max_version passed on), or _HostDLPack's for the ml_dtypes
 * dtypes NumPy's __dlpack__ refuses. */
static PyObject *export_to_host(dp_state *st, dp_ArrayObject *self, PyObject *max_version)
{
    dp_device host = {DP_HOST, -1};
    PyObject *h = st->copy_to_device(st, self->meta, host);
    if (h != NULL && dp_dtype_is_ml(PyArray_DESCR((PyArrayObject *)h)))
        Py_SETREF(h, dp_host_dlpack_export(st, (PyArrayObject *)h));
    if (h == NULL)
        return NULL;
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

static PyObject *array_dlpack(PyObject *op, PyObject *args, PyObject *kw)
{
    static char *kwlist[] = {"stream", "max_version", "dl_device", "copy", NULL};
    PyObject *stream = Py_None, *max_version = Py_None, *dl_device = Py_None, *copy = Py_None;
    dp_ArrayObject *self = (dp_ArrayObject *)op;
    dp_state *st = dp_state_from_type(Py_TYPE(op));
    dlpack_args a;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "|$OOOO:__dlpack__", kwlist, &stream,
                                     &max_version, &dl_device, &copy) ||
        dlpack_args_read(self, stream, max_version, dl_device, copy, &a) < 0)
        return NULL;
    if (a.to_host)
        return export_to_host(st, self, max_version);
    if (a.want_copy != 1)
        return to_capsule(self, a.versioned, 0, a.consumer);
    PyObject *c = dp_export(st, st->copy_to_device(st, self->meta, self->dev));
    if (c == NULL)
        return NULL;
    PyObject *cap = to_capsule((dp_ArrayObject *)c, a.versioned, 1, a.consumer);
    Py_DECREF(c);
    return cap;
}

static PyObject *array_dlpack_device(PyObject *op, PyObject *unused)
{
    return Py_BuildValue("(ii)", (int)kDLCUDA, ((dp_ArrayObject *)op)->dev.index);
}

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
static void mark_exported(dp_state *st, PyArrayObject *a, int known, void *stream)
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

/* ------------------------------------------------------------------ */
/* Module functions                                                    */
/* ------------------------------------------------------------------ */

PyDoc_STRVAR(from_dlpack_doc,
"from_dlpack(obj, /)\n--\n\n"
"Returns a dpmini.Array (CUDA memory) or a numpy.ndarray (host memory).\n"
"Import obj without a copy through DLPack (or the CUDA Array Interface): CUDA memory\n"
"becomes a dpmini.Array that keeps obj's memory alive; host memory becomes a\n"
"numpy.ndarray (numpy.from_dlpack). Raises TypeError (not a DLPack/CAI object),\n"
"BufferError (dtype or device dpmini cannot hold).");

static PyObject *py_from_dlpack(PyObject *m, PyObject *obj)
{
    dp_state *st = dp_state_from_module(m);
    int type, id;
    if (PyObject_TypeCheck(obj, st->ArrayType)) {
        return Py_NewRef(obj);
    }
    if (dlpack_device(obj, &type, &id) == 0 && (type == kDLCPU || type == kDLCUDAHost)) {
        PyObject *np = PyImport_ImportModule("numpy");
        PyObject *r = np ? PyObject_CallMethod(np, "from_dlpack", "O", obj) : NULL;
        Py_XDECREF(np);
        return r;
    }
    PyArrayObject *meta = dp_device_object_meta(st, obj, "obj");
    return meta ? dp_export(st, (PyObject *)meta) : NULL;
}

PyDoc_STRVAR(empty_doc,
"empty(shape, dtype=None, device='cpu', pin_memory=False)\n--\n\n"
"An uninitialised array (dtype None means float64): on a CUDA device a dpmini.Array; on the host a\n"
"numpy.ndarray, in page-locked (pinned) memory when pin_memory=True (needs CUDA),\n"
"so host<->GPU copies of it are direct DMA with no staging.\n"
"shape: an int (a 1-dim array of that many elements) or a tuple of ints, each >= 0, in\n"
"elements (not bytes), as numpy.empty; () is a 0-dim array. C-contiguous.\n"
"dtype: anything numpy.dtype accepts except object. device: 'cpu' (the host), 'cpu:N' (a\n"
"numpy.ndarray in that virtual device's memory), 'cuda:N', an int N or a dpmini.Device.\n"
"Raises ValueError (a negative size, a bad device), TypeError (a shape that is not an\n"
"int or a tuple of ints, an object or unknown dtype), MemoryError, dpmini.CudaError.");

static PyObject *py_empty(PyObject *m, PyObject *args, PyObject *kw)
{
    static char *kwlist[] = {"shape", "dtype", "device", "pin_memory", NULL};
    PyObject *shape_obj, *dtype_obj = Py_None, *dev_obj = NULL;
    int pin = 0;
    PyArray_Dims shape = {NULL, 0};
    PyArray_Descr *descr = NULL;
    dp_state *st = dp_state_from_module(m);
    dp_device dev = {DP_HOST, -1};
    PyObject *res = NULL;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "O|OOp:empty", kwlist, &shape_obj, &dtype_obj,
                                     &dev_obj, &pin)) {
        return NULL;
    }
    if (!PyArray_IntpConverter(shape_obj, &shape)) {
        return NULL;
    }
    if (!PyArray_DescrConverter(dtype_obj, &descr)) {
        goto done;
    }
    if (PyDataType_REFCHK(descr)) {
        PyErr_SetString(PyExc_TypeError, "dtype: object dtypes are not supported");
        goto done;
    }
    if (dev_obj != NULL && dev_obj != Py_None &&
        dp_device_from_object(st, dev_obj, "device", DP_DEV_ALLOW_HOST, &dev) < 0) {
        goto done;
    }
    if (pin && dev.kind != DP_HOST) {
        PyErr_SetString(PyExc_ValueError, "pin_memory: only host memory ('cpu') can be pinned");
        goto done;
    }
    if (!pin) {
        Py_INCREF(descr);
        res = dp_export(st, (PyObject *)dp_empty(st, dev, descr, shape.len, shape.ptr, NULL));
        goto done;
    }
    size_t nbytes = (size_t)PyDataType_ELSIZE(descr);
    for (int i = 0; i < shape.len; i++) {
        if (shape.ptr[i] < 0) {
            PyErr_SetString(PyExc_ValueError, "shape: negative dimensions are not allowed");
            goto done;
        }
        nbytes *= (size_t)shape.ptr[i];
    }
    PyObject *buf = dp_buffer_new_pinned(st, nbytes);
    if (buf == NULL) {
        goto done;
    }
    Py_INCREF(descr);
    res = PyArray_NewFromDescr(&PyArray_Type, descr, shape.len, shape.ptr, NULL,
                               ((dp_BufferObject *)buf)->ptr,
                               NPY_ARRAY_WRITEABLE | NPY_ARRAY_ALIGNED, NULL);
    if (res == NULL || PyArray_SetBaseObject((PyArrayObject *)res, buf) < 0) {
        if (res == NULL) {
            Py_DECREF(buf);
        }
        Py_CLEAR(res);
    }
done:
    Py_XDECREF(descr);
    PyDimMem_FREE(shape.ptr);
    return res;
}

static PyObject *py_cuda_build_info(PyObject *m, PyObject *unused)
{
    int rt = 0, drv = 0;
    dpc_versions(&rt, &drv);
    const char *nccl = dp_nccl_describe();
    char why[512] = "";
    (void)dp_cuda_unusable(why, sizeof why);
    return Py_BuildValue("{s:s,s:i,s:i,s:i,s:s,s:i,s:s}", "backend", dpc_backend(),
                         "runtime_version", rt, "driver_version", drv, "device_count",
                         dpc_device_count(), "nccl", nccl, "2d_min_run_default",
                         DP_2D_MIN_RUN_DEFAULT, "cuda_unusable", why);
}

/* Registered with atexit by dpmini/__init__.py: NCCL communicators hold
 * threads, sockets and GPU memory until destroyed. */
static PyObject *py_gpu_at_exit(PyObject *m, PyObject *unused)
{
    Py_BEGIN_ALLOW_THREADS /* ncclCommDestroy waits for the communicators */
    dp_nccl_shutdown();
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

PyMethodDef dp_array_methods[] = {
    {"_gpu_at_exit", py_gpu_at_exit, METH_NOARGS,
     "Private (dpmini/__init__.py registers it with atexit): destroy the cached NCCL "
     "communicators."},
    {"from_dlpack", py_from_dlpack, METH_O, from_dlpack_doc},
    {"empty", (PyCFunction)(void (*)(void))py_empty, METH_VARARGS | METH_KEYWORDS, empty_doc},
    {"cuda_build_info", py_cuda_build_info, METH_NOARGS,
     "cuda_build_info()\n--\n\nReturns a dict: backend ('cuda', 'emulated' or 'none'), CUDA runtime and "
     "driver versions (1000*major + 10*minor; 0 unknown), device_count, nccl (version and "
     "path once loaded, else why not), the 2D-copy run threshold, cuda_unusable (why CUDA cannot be "
     "used although a driver is installed, e.g. a driver older than the runtime; '' otherwise)."},
    {NULL},
};
