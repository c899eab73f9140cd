/* interop_torch.c - what PyTorch needs beyond DLPack (docs/design.md,
 * "Arrays of other libraries"): whether an object is a torch.nn.Module, and
 * loading dpmini/_torch.py, whose replica context carries torch's per-thread
 * state into the replica threads (as torch.nn.parallel.parallel_apply does,
 * docs/spec.md 6.2) and which makes a torch.nn.Module's replicas. Everything here
 * looks torch up in sys.modules only: dpmini never imports torch.
 */
#include "dpmini.h"

/* sys.modules[name] (new reference) or NULL, never an exception. */
static PyObject *module_if_imported(const char *name)
{
    PyObject *n = PyUnicode_FromString(name);
    PyObject *mod = n != NULL ? PyImport_GetModule(n) : NULL;
    Py_XDECREF(n);
    PyErr_Clear();
    return mod;
}

/* ------------------------------------------------------------------ */
/* torch.nn.Module                                                     */
/* ------------------------------------------------------------------ */

int dp_is_torch_module(PyObject *obj)
{
    if (PyType_Check(obj))
        return 0;
    PyObject *mod = module_if_imported("torch.nn");   /* only when torch is imported */
    if (mod == NULL)
        return 0;
    PyObject *cls = PyObject_GetAttrString(mod, "Module");
    Py_DECREF(mod);
    if (cls == NULL) {
        PyErr_Clear();
        return 0;
    }
    int r = PyType_Check(cls) && PyType_IsSubtype(Py_TYPE(obj), (PyTypeObject *)cls);
    Py_DECREF(cls);
    return r;
}

/* ------------------------------------------------------------------ */
/* torch's per-thread grad mode; its replica context                   */
/* ------------------------------------------------------------------ */

int dp_torch_grad_enabled(void)
{
    PyObject *torch = module_if_imported("torch");
    if (torch == NULL)
        return -1;
    PyObject *r = PyObject_CallMethod(torch, "is_grad_enabled", NULL);
    Py_DECREF(torch);
    int res = r == NULL ? -1 : PyObject_IsTrue(r);
    Py_XDECREF(r);
    PyErr_Clear();
    return res < 0 ? -1 : res;
}

/* What torch keeps per thread (grad mode, inference mode, autocast, the
 * current CUDA streams, the intra-op thread count, the random numbers of
 * replicas) is carried into the replicas by dpmini/_torch.py's provider,
 * registered when that module is imported. A replica may use torch without
 * a torch argument, so any call that finds torch imported loads it. */
int dp_torch_context_load(dp_state *st)
{
    if (st->torch_context_loaded)
        return 0;
    PyObject *torch = module_if_imported("torch");
    if (torch == NULL)
        return 0;
    Py_DECREF(torch);
    PyObject *adapter = PyImport_ImportModule("dpmini._torch");
    if (adapter == NULL)
        return -1;
    Py_DECREF(adapter);
    st->torch_context_loaded = 1;
    return 0;
}

/* ------------------------------------------------------------------ */
/* comm results                                                        */
/* ------------------------------------------------------------------ */

/* The first item of a sequence (new reference), or NULL with no error. */
static PyObject *first_item(PyObject *seq)
{
    if (PyArray_Check(seq) || !PySequence_Check(seq) || PyUnicode_Check(seq))
        return NULL;
    PyObject *f = PySequence_GetItem(seq, 0);
    if (f == NULL)
        PyErr_Clear();
    return f;
}

PyObject *dp_comm_back(dp_state *st, PyObject *like, int from_seq, PyObject *result)
{
    if (result == NULL)
        return NULL;
    PyObject *src = from_seq ? first_item(like) : Py_NewRef(like);
    if (src == NULL)
        return result;
    PyObject *origin = dp_array_origin(st, src);
    Py_DECREF(src);
    if (origin == NULL) {
        Py_DECREF(result);
        return NULL;
    }
    PyObject *res = result;
    if (origin != Py_None && (PyTuple_CheckExact(result) || PyList_CheckExact(result))) {
        /* scatter / broadcast: each piece back into the library */
        Py_ssize_t n = PySequence_Fast_GET_SIZE(result);
        res = PyTuple_CheckExact(result) ? PyTuple_New(n) : PyList_New(n);
        for (Py_ssize_t i = 0; res != NULL && i < n; i++) {
            PyObject *v = dp_to_origin(st, origin,
                                       Py_NewRef(PySequence_Fast_GET_ITEM(result, i)), "result");
            if (v == NULL)
                Py_CLEAR(res);
            else if (PyTuple_Check(res))
                PyTuple_SET_ITEM(res, i, v);
            else
                PyList_SET_ITEM(res, i, v);
        }
        Py_DECREF(result);
    }
    else if (origin != Py_None) {
        res = dp_to_origin(st, origin, result, "result");
    }
    Py_DECREF(origin);
    return res;
}

PyObject *dp_comm_back_rows(dp_state *st, PyObject *arrays, PyObject *rows)
{
    if (rows == NULL || !PyList_Check(rows))
        return rows;
    PyObject *seq = PySequence_Fast(arrays, "arrays");
    if (seq == NULL) {
        Py_DECREF(rows);
        return NULL;
    }
    for (Py_ssize_t i = 0; i < PySequence_Fast_GET_SIZE(seq); i++) {
        PyObject *origin = dp_array_origin(st, PySequence_Fast_GET_ITEM(seq, i));
        if (origin == NULL)
            goto fail;
        for (Py_ssize_t d = 0; d < PyList_GET_SIZE(rows); d++) {
            PyObject *row = PyList_GET_ITEM(rows, d);
            if (!PyList_Check(row) || i >= PyList_GET_SIZE(row))
                continue;
            PyObject *v = dp_to_origin(st, origin, Py_NewRef(PyList_GET_ITEM(row, i)),
                                       "result");
            if (v == NULL || PyList_SetItem(row, i, v) < 0) {
                Py_DECREF(origin);
                goto fail;
            }
        }
        Py_DECREF(origin);
    }
    Py_DECREF(seq);
    return rows;
fail:
    Py_DECREF(seq);
    Py_DECREF(rows);
    return NULL;
}

/* ------------------------------------------------------------------ */
/* Host tensors without DLPack's Python layers                         */
/* ------------------------------------------------------------------ */
/* torch's __dlpack__, __dlpack_device__ and from_dlpack are Python
 * functions; Tensor.numpy() and torch.from_numpy are C and share the same
 * memory, for the dtypes both libraries have. Anything else (bfloat16,
 * float8, sparse, subclasses, GPU tensors) keeps the DLPack path. */

/* torch dtypes (by name) that .numpy() and from_numpy share as DLPack does */
static const char *const host_dtype_names[] = {
    "bool", "uint8", "int8", "int16", "int32", "int64",
    "float16", "float32", "float64", "complex64", "complex128", NULL};

/* st->torch_host (borrowed), filled the first time torch is imported; NULL
 * with no error while it is not (or lacks a name: then never fast). */
static PyObject *torch_host(dp_state *st)
{
    if (st->torch_host != NULL)
        return st->torch_host;
    PyObject *torch = module_if_imported("torch");
    PyObject *nn = module_if_imported("torch.nn");
    PyObject *th = NULL, *dtypes = NULL;
    if (torch == NULL || nn == NULL)
        goto done;
    Py_ssize_t n = 0;
    while (host_dtype_names[n] != NULL)
        n++;
    dtypes = PyTuple_New(n);
    for (Py_ssize_t i = 0; dtypes != NULL && i < n; i++) {
        PyObject *d = PyObject_GetAttrString(torch, host_dtype_names[i]);
        if (d == NULL)
            Py_CLEAR(dtypes);
        else
            PyTuple_SET_ITEM(dtypes, i, d);
    }
    if (dtypes != NULL)
        th = Py_BuildValue("(NNNNO)", PyObject_GetAttrString(torch, "Tensor"),
                           PyObject_GetAttrString(nn, "Parameter"),
                           PyObject_GetAttrString(torch, "from_dlpack"),
                           PyObject_GetAttrString(torch, "from_numpy"), dtypes);
done:
    Py_XDECREF(torch);
    Py_XDECREF(nn);
    Py_XDECREF(dtypes);
    PyErr_Clear();
    st->torch_host = th;
    return th;
}

/* obj.<name> is Py_True (never an exception) */
static int attr_true(PyObject *obj, const char *name)
{
    PyObject *v = PyObject_GetAttrString(obj, name);
    int yes = v == Py_True;
    Py_XDECREF(v);
    PyErr_Clear();
    return yes;
}

/* Is obj.dtype one of the tuple's (identity: torch dtypes are singletons)? */
static int dtype_in(PyObject *obj, PyObject *dtypes)
{
    PyObject *d = PyObject_GetAttrString(obj, "dtype");
    int found = 0;
    for (Py_ssize_t i = 0; d != NULL && i < PyTuple_GET_SIZE(dtypes); i++)
        found |= PyTuple_GET_ITEM(dtypes, i) == d;
    Py_XDECREF(d);
    PyErr_Clear();
    return found;
}

PyArrayObject *dp_torch_host_view(dp_state *st, PyObject *obj)
{
    const char *name = Py_TYPE(obj)->tp_name;
    if (strcmp(name, "Tensor") != 0 && strcmp(name, "Parameter") != 0)
        return NULL;
    PyObject *th = torch_host(st);
    if (th == NULL || ((PyObject *)Py_TYPE(obj) != PyTuple_GET_ITEM(th, 0) &&
                       (PyObject *)Py_TYPE(obj) != PyTuple_GET_ITEM(th, 1)))
        return NULL;
    if (!attr_true(obj, "is_cpu") || attr_true(obj, "is_sparse") ||
        !dtype_in(obj, PyTuple_GET_ITEM(th, 4)))
        return NULL;
    PyObject *a = PyObject_CallMethod(obj, "numpy", NULL);
    if (a == NULL) {
        if (PyErr_ExceptionMatches(PyExc_Exception))
            PyErr_Clear();   /* torch refuses it: DLPack decides */
        return NULL;
    }
    if (!PyArray_CheckExact(a)) {
        Py_DECREF(a);
        return NULL;
    }
    return (PyArrayObject *)a;
}

/* NumPy type numbers torch.from_numpy shares as from_dlpack does */
static int host_type_num(int t)
{
    switch (t) {
    case NPY_BOOL: case NPY_UINT8: case NPY_INT8: case NPY_INT16: case NPY_INT32:
    case NPY_INT64: case NPY_HALF: case NPY_FLOAT32: case NPY_FLOAT64:
    case NPY_COMPLEX64: case NPY_COMPLEX128:
        return 1;
    default:
        return 0;
    }
}

PyObject *dp_torch_from_host(dp_state *st, PyObject *origin, PyArrayObject *arr)
{
    PyObject *th = st->torch_host != NULL ? st->torch_host : torch_host(st);
    if (th == NULL || origin != PyTuple_GET_ITEM(th, 2) || !PyArray_CheckExact(arr))
        return NULL;
    PyArray_Descr *d = PyArray_DESCR(arr);
    if (!host_type_num(d->type_num) || !PyArray_ISNOTSWAPPED(arr) ||
        !PyArray_ISWRITEABLE(arr) || !PyArray_ISALIGNED(arr))
        return NULL;
    for (int i = 0; i < PyArray_NDIM(arr); i++) {
        npy_intp s = PyArray_STRIDES(arr)[i];
        if (s < 0 || s % PyArray_ITEMSIZE(arr) != 0)
            return NULL;
    }
    PyObject *t = PyObject_CallOneArg(PyTuple_GET_ITEM(th, 3), (PyObject *)arr);
    if (t == NULL && PyErr_ExceptionMatches(PyExc_Exception))
        PyErr_Clear();   /* torch refuses it: from_dlpack decides */
    return t;
}
