/* interop_origin.c - the way back: results handed to the caller's array
 * library ("origin"), and the replicas' array leaves. The library's own
 * from_dlpack is found from the type's top-level module (torch, jax/jaxlib,
 * cupy), else through array_api_compat.array_namespace, else the module's
 * from_dlpack; cached per type in the module state. NumPy, dpmini.Array and
 * libraries without a from_dlpack have origin None: their results stay NumPy /
 * dpmini.Array. A host result of an ml_dtypes dtype (bfloat16...) goes back
 * through host_dlpack.c's export, which NumPy's __dlpack__ cannot do. What
 * an array leaf is and how it is read: interop.c.
 */
#include "dpmini.h"
#include "interop.h"

/* ------------------------------------------------------------------ */
/* Origins: the way back                                               */
/* ------------------------------------------------------------------ */


/* The converter for obj's type (new reference; Py_None when none). */
static PyObject *origin_lookup(PyObject *obj)
{
    PyObject *top = dp_top_module(obj), *conv = NULL;
    if (top == NULL)
        return NULL;
    const char *name = PyUnicode_AsUTF8(top);
    if (name == NULL) {
        Py_DECREF(top);
        return NULL;
    }
    if (strcmp(name, "torch") == 0)
        conv = dp_import_attr_quiet("torch", "from_dlpack");
    else if (strcmp(name, "jax") == 0 || strcmp(name, "jaxlib") == 0)
        conv = dp_import_attr_quiet("jax.numpy", "from_dlpack");
    else if (strcmp(name, "cupy") == 0)
        conv = dp_import_attr_quiet("cupy", "from_dlpack");
    else if (name[0] != '\0' && strcmp(name, "numpy") != 0 && strcmp(name, "builtins") != 0) {
        /* array_api_compat's namespace when it knows the type, else the
         * type's own package's from_dlpack. */
        PyObject *ns_fn = dp_import_attr_quiet("array_api_compat", "array_namespace");
        if (ns_fn != NULL) {
            PyObject *ns = PyObject_CallOneArg(ns_fn, obj);
            Py_DECREF(ns_fn);
            if (ns != NULL) {
                conv = PyObject_GetAttrString(ns, "from_dlpack");
                Py_DECREF(ns);
            }
            if (conv == NULL && PyErr_Occurred()) {
                if (!PyErr_ExceptionMatches(PyExc_Exception)) {
                    Py_DECREF(top);
                    return NULL;
                }
                PyErr_Clear();
            }
        }
        if (conv == NULL && !PyErr_Occurred()) {
            /* only a package already imported (the type's __module__ is
             * never imported on its behalf) */
            PyObject *mod = PyImport_GetModule(top);
            if (mod != NULL) {
                conv = PyObject_GetAttrString(mod, "from_dlpack");
                Py_DECREF(mod);
                if (conv != NULL && !PyCallable_Check(conv))
                    Py_CLEAR(conv);
            }
            if (PyErr_Occurred() && PyErr_ExceptionMatches(PyExc_Exception))
                PyErr_Clear();
        }
    }
    Py_DECREF(top);
    if (conv == NULL && PyErr_Occurred())
        return NULL;
    return conv != NULL ? conv : Py_NewRef(Py_None);
}

PyObject *dp_array_origin(dp_state *st, PyObject *obj)
{
    if (PyArray_Check(obj) || PyObject_TypeCheck(obj, st->ArrayType) ||
        PyArray_IsScalar(obj, Generic))
        return Py_NewRef(Py_None);
    if (st->origins == NULL && (st->origins = PyDict_New()) == NULL)
        return NULL;
    PyObject *conv = PyDict_GetItemWithError(st->origins, (PyObject *)Py_TYPE(obj));
    if (conv != NULL)
        return Py_NewRef(conv);
    if (PyErr_Occurred())
        return NULL;
    conv = origin_lookup(obj);
    if (conv == NULL)
        return NULL;
    if (PyDict_SetItem(st->origins, (PyObject *)Py_TYPE(obj), conv) < 0) {
        Py_DECREF(conv);
        return NULL;
    }
    return conv;
}

PyObject *dp_to_origin(dp_state *st, PyObject *origin, PyObject *arr, const char *argname)
{
    if (arr == NULL || origin == NULL || origin == Py_None)
        return arr;
    if (PyArray_Check(arr)) {
        /* torch.from_numpy: the tensor from_dlpack gives, without its Python layers */
        PyObject *t = dp_torch_from_host(st, origin, (PyArrayObject *)arr);
        if (t != NULL || PyErr_Occurred()) {
            Py_DECREF(arr);
            return t;
        }
    }
    /* NumPy's own __dlpack__ refuses ml_dtypes' dtypes: a bfloat16 result
     * goes back through dpmini's export, as that library's bfloat16. */
    PyObject *r, *via = PyArray_Check(arr) && dp_dtype_is_ml(PyArray_DESCR((PyArrayObject *)arr))
                        ? dp_host_dlpack_export(st, (PyArrayObject *)arr) : Py_NewRef(arr);
    r = via != NULL ? PyObject_CallOneArg(origin, via) : NULL;
    Py_XDECREF(via);
    if (r == NULL && PyArray_Check(arr) && PyErr_ExceptionMatches(PyExc_Exception)) {
        /* A GPU-only library (CuPy) cannot hold host memory: results on
         * the host or a virtual CPU device stay NumPy arrays (docs/libraries.md). */
        PyErr_Clear();
        return arr;
    }
    Py_DECREF(arr);
    if (r == NULL && PyErr_ExceptionMatches(PyExc_Exception)) {
        PyObject *t, *v, *tb;
        PyErr_Fetch(&t, &v, &tb);
        PyErr_NormalizeException(&t, &v, &tb);
        PyObject *msg = PyUnicode_FromFormat(
            "%s: cannot hand the result back through %R (the from_dlpack of the inputs' "
            "library): %S", argname, origin, v ? v : Py_None);
        PyErr_Restore(t, v, tb);
        dp_reraise_msg(st, msg);
    }
    return r;
}

int dp_convert_all(dp_state *st, PyObject *origin, PyObject **items, Py_ssize_t n,
                   const char *argname)
{
    if (origin == NULL || origin == Py_None)
        return 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        items[i] = dp_to_origin(st, origin, items[i], argname);
        if (items[i] == NULL)
            return -1;
    }
    return 0;
}

PyObject *dp_array_describe(dp_state *st, PyObject *obj, PyArrayObject *arr)
{
    PyObject *name = dp_array_type_name(st, obj);
    if (name == NULL)
        return NULL;
    char dev[48];
    dp_device d = dp_array_device(st, arr);
    dp_device_format(d, dev, sizeof dev);
    PyObject *res = PyUnicode_FromFormat("%U %s", name, dev);
    Py_DECREF(name);
    return res;
}

/* ------------------------------------------------------------------ */
/* replicate                                                           */
/* ------------------------------------------------------------------ */

int dp_replicas_leaves(dp_state *st, PyObject *row, PyObject *imported, PyObject *leaves,
                       PyObject *origins)
{
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(row); i++) {
        PyObject *item = PyList_GET_ITEM(row, i), *imp = PyList_GET_ITEM(imported, i);
        PyObject *leaf = PyList_GET_ITEM(leaves, i), *v;
        int same = item == imp || (PyObject_TypeCheck(item, st->ArrayType) &&
                                   (PyObject *)((dp_ArrayObject *)item)->meta == imp);
        if (same)
            v = Py_NewRef(leaf);   /* already on this device: the original */
        else
            v = dp_to_origin(st, PyList_GET_ITEM(origins, i), Py_NewRef(item), "module");
        if (v == NULL)
            return -1;
        PyList_SetItem(row, i, v);
    }
    return 0;
}
