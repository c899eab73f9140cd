/* convert.c - turning Python arguments into what the C core works on:
 * arrays (without copies), dims and ints. Every error names the argument. */
#include "dpmini.h"
#include "plan.h"

int dp_is_array_leaf(dp_state *st, PyObject *obj)
{
    /* Every other library's arrays (PyTorch, JAX, CuPy: DLPack or the CUDA
     * Array Interface) are leaves too, imported zero-copy (interop.c). */
    if (PyArray_Check(obj) || PyObject_TypeCheck(obj, st->ArrayType))
        return 1;
    /* Containers first: a dict, list or tuple (subclasses included: an
     * attribute-access dict whose __getattr__ raises KeyError or returns a
     * new empty dict) is walked as a container, never probed for the array
     * protocols, as PyTorch walks any isinstance(obj, dict). */
    if (PyTuple_Check(obj) || PyList_Check(obj) || PyDict_Check(obj))
        return 0;
    return dp_is_foreign_array(st, obj);
}

/* hasattr(obj, name) that lets errors other than AttributeError through
 * (an __array_interface__ property that raises KeyboardInterrupt, say):
 * 1, 0, or -1 with an exception set. */
int dp_has_attr(PyObject *obj, const char *name)
{
    PyObject *v = PyObject_GetAttrString(obj, name);
    if (v != NULL) {
        Py_DECREF(v);
        return 1;
    }
    if (PyErr_ExceptionMatches(PyExc_AttributeError)) {
        PyErr_Clear();
        return 0;
    }
    return -1;
}

/* Is obj an instance of module.name? Only looked up when the module is
 * already imported (an object cannot be an instance of a class that does
 * not exist yet), with a subtype check that runs no user code. 1, 0, or -1
 * with an exception set. */
static int is_instance_of(PyObject *obj, const char *module, const char *name)
{
    PyObject *modname = PyUnicode_FromString(module);
    if (modname == NULL) {
        return -1;
    }
    PyObject *mod = PyImport_GetModule(modname);
    Py_DECREF(modname);
    if (mod == NULL) {
        return PyErr_Occurred() ? -1 : 0;
    }
    PyObject *cls = PyObject_GetAttrString(mod, name);
    Py_DECREF(mod);
    if (cls == NULL) {
        if (PyErr_ExceptionMatches(PyExc_AttributeError)) {
            PyErr_Clear();
            return 0;
        }
        return -1;
    }
    int r = PyType_Check(cls) && PyType_IsSubtype(Py_TYPE(obj), (PyTypeObject *)cls);
    Py_DECREF(cls);
    return r;
}

int dp_refused_array_subclass(PyObject *obj, const char *argname)
{
    if (!PyArray_Check(obj) || PyArray_CheckExact(obj)) {
        return 0;
    }
    int r = is_instance_of(obj, "numpy.ma", "MaskedArray");
    if (r < 0) {
        return -1;
    }
    if (r) {
        if (argname != NULL) {
            PyErr_Format(PyExc_TypeError,
                         "%s: numpy.ma.MaskedArray is not supported (dpmini's chunks and "
                         "gathered results are plain arrays: the mask would be lost); pass "
                         "a.filled(fill_value), "
                         "or np.asarray(a) to drop the mask knowingly, and pass the mask "
                         "as an array of its own if the replicas need it", argname);
        }
        return 1;
    }
    r = is_instance_of(obj, "numpy", "matrix");
    if (r < 0) {
        return -1;
    }
    if (r) {
        if (argname != NULL) {
            PyErr_Format(PyExc_TypeError,
                         "%s: numpy.matrix is not supported (dpmini's chunks and gathered "
                         "results are plain 2-D arrays, on which * is no longer a matrix "
                         "product); pass "
                         "np.asarray(m)", argname);
        }
        return 1;
    }
    return 0;
}

/* The pending error of a probe of obj (its own getter's, KeyboardInterrupt
 * as it is) re-raised naming argname. Returns NULL. */
static PyArrayObject *reraise_at_arg(dp_state *st, const char *argname)
{
    PyObject *path = PyUnicode_FromString(argname);
    dp_reraise_at(st, path);
    Py_XDECREF(path);
    return NULL;
}

/* How obj (no ndarray, no dpmini.Array, no foreign array) offers its
 * memory: 1 the buffer protocol, 2 __array_interface__ or
 * __array_struct__, 0 neither, -1 a getter raised. */
static int host_protocol(PyObject *obj)
{
    if (PyObject_CheckBuffer(obj)) {
        return 1;
    }
    int h = dp_has_attr(obj, "__array_interface__");
    if (h == 0) {
        h = dp_has_attr(obj, "__array_struct__");
    }
    return h < 0 ? -1 : h ? 2 : 0;
}

/* obj's memory read through its protocol (host_protocol's kind), no copy:
 * NumPy wraps the exporter's memory. A buffer (bytes, bytearray,
 * memoryview, array.array) is read through a memoryview, so its format
 * decides the dtype: bytes are a 1-D uint8 array, not NumPy's 0-dim 'S'
 * scalar. TypeError naming argname when NumPy cannot read it. */
static PyArrayObject *read_protocol(PyObject *obj, int kind, const char *argname)
{
    PyObject *src = kind == 1 ? PyMemoryView_FromObject(obj) : Py_NewRef(obj);
    PyArrayObject *arr = src ? (PyArrayObject *)PyArray_FromAny(src, NULL, 0, 0, 0, NULL)
                             : NULL;
    Py_XDECREF(src);
    if (arr != NULL || !PyErr_ExceptionMatches(PyExc_Exception)) {
        return arr;   /* KeyboardInterrupt, SystemExit: let them through */
    }
    PyObject *t, *v, *tb;
    PyErr_Fetch(&t, &v, &tb);
    PyErr_NormalizeException(&t, &v, &tb);
    PyErr_Format(PyExc_TypeError, "%s: cannot read %.100s as an array (%S)",
                 argname, Py_TYPE(obj)->tp_name, v ? v : Py_None);
    Py_XDECREF(t);
    Py_XDECREF(v);
    Py_XDECREF(tb);
    return NULL;
}

/* obj, neither an ndarray nor a dpmini.Array, as an ndarray: a foreign
 * array (PyTorch, JAX, CuPy...: DLPack or CUDA Array Interface first), else
 * through the buffer protocol or __array_interface__. */
static PyArrayObject *other_as_array(dp_state *st, PyObject *obj, const char *argname)
{
    int r = dp_is_foreign_array(st, obj);
    if (r < 0) {
        return reraise_at_arg(st, argname);
    }
    if (r) {
        return dp_import_foreign(st, obj, argname);
    }
    int kind = host_protocol(obj);
    if (kind < 0) {
        return reraise_at_arg(st, argname);
    }
    if (kind == 0) {
        PyErr_Format(PyExc_TypeError,
                     "%s: expected an array (numpy.ndarray, dpmini.Array, an object with "
                     "__dlpack__ or __cuda_array_interface__ such as a torch.Tensor, JAX or "
                     "CuPy array, or an object with the buffer protocol or "
                     "__array_interface__), got %.100s",
                     argname, Py_TYPE(obj)->tp_name);
        return NULL;
    }
    return read_protocol(obj, kind, argname);
}

/* arr (stolen) when it can be copied between devices and has min_ndim
 * dimensions or more; else NULL with TypeError / ZeroDimError naming argname. */
static PyArrayObject *checked_array(dp_state *st, PyArrayObject *arr, const char *argname,
                                    int min_ndim)
{
    if (PyDataType_REFCHK(PyArray_DESCR(arr))) {
        PyErr_Format(PyExc_TypeError,
                     "%s: arrays holding Python objects (dtype %S) cannot be copied between "
                     "devices; use a numeric, bool or structured dtype without objects",
                     argname, (PyObject *)PyArray_DESCR(arr));
        Py_DECREF(arr);
        return NULL;
    }
    if (PyArray_NDIM(arr) < min_ndim) {
        dp_raise_zero_dim(st, argname);
        Py_DECREF(arr);
        return NULL;
    }
    return arr;
}

int dp_raise_zero_dim(dp_state *st, const char *argname)
{
    PyErr_Format(st->ZeroDimError,
                 "%s: chunk expects at least a 1-dimensional tensor (got a 0-dim array); wrap "
                 "it in a 1-element array, or pass a Python number to share it", argname);
    return -1;
}

PyArrayObject *dp_as_array(dp_state *st, PyObject *obj, const char *argname, int min_ndim)
{
    PyArrayObject *arr;
    if (PyArray_Check(obj)) {
        if (dp_refused_array_subclass(obj, argname) != 0) {
            return NULL;
        }
        arr = (PyArrayObject *)Py_NewRef(obj);
    } else if (PyObject_TypeCheck(obj, st->ArrayType)) {
        /* the shadow ndarray of a GPU array (see dpmini.h); never exposed */
        arr = dp_device_object_meta(st, obj, argname);
    } else {
        arr = other_as_array(st, obj, argname);
    }
    return arr != NULL ? checked_array(st, arr, argname, min_ndim) : NULL;
}

int dp_wrap_dim_or_raise(int dim, int ndim, const char *argname, int *out)
{
    int w = dp_wrap_dim(dim, ndim);
    if (w < 0) {
        if (ndim < 1) {
            PyErr_Format(PyExc_IndexError,
                         "%s: dimension specified as %d but the array has no dimensions",
                         argname, dim);
        } else {
            PyErr_Format(PyExc_IndexError,
                         "%s: Dimension out of range (expected to be in range of [%d, %d], "
                         "but got %d)", argname, -ndim, ndim - 1, dim);
        }
        return -1;
    }
    *out = w;
    return 0;
}

/* ------------------------------------------------------------------ */
/* Numbers: the one conversion of int and real arguments               */
/* ------------------------------------------------------------------ */

/* The type's name as a user would write it: numpy.int64, mylib.ndarray
 * (tp_name alone is "ndarray" for a class of that name in any module).
 * New reference, or NULL with an exception set. */
PyObject *dp_type_name(PyObject *obj)
{
    PyTypeObject *tp = Py_TYPE(obj);
    if (!(tp->tp_flags & Py_TPFLAGS_HEAPTYPE)) {
        return PyUnicode_FromString(tp->tp_name);   /* static types: "numpy.int64" */
    }
    PyObject *mod = PyObject_GetAttrString((PyObject *)tp, "__module__");
    PyObject *qual = PyObject_GetAttrString((PyObject *)tp, "__qualname__");
    PyObject *res = NULL;
    if (mod != NULL && qual != NULL && PyUnicode_Check(mod) && PyUnicode_Check(qual)) {
        res = PyUnicode_CompareWithASCIIString(mod, "builtins") == 0
                  ? Py_NewRef(qual) : PyUnicode_FromFormat("%U.%U", mod, qual);
    }
    Py_XDECREF(mod);
    Py_XDECREF(qual);
    if (res == NULL) {
        if (PyErr_Occurred() && !PyErr_ExceptionMatches(PyExc_Exception)) {
            return NULL;   /* KeyboardInterrupt from a metaclass: let it through */
        }
        PyErr_Clear();
        res = PyUnicode_FromString(tp->tp_name);
    }
    return res;
}

/* The pending error of obj's __index__ / __float__ (hook), re-raised as the
 * same type naming argname, the original as __cause__ (docs/libraries.md, "Probing").
 * Always -1. */
static int reraise_hook_error(PyObject *obj, const char *argname, const char *hook)
{
    if (!PyErr_ExceptionMatches(PyExc_Exception))
        return -1;   /* KeyboardInterrupt: as it is */
    PyObject *t, *v, *tb;
    PyErr_Fetch(&t, &v, &tb);
    PyErr_NormalizeException(&t, &v, &tb);
    PyObject *tn = dp_type_name(obj);
    PyObject *msg = tn != NULL && v != NULL
        ? PyUnicode_FromFormat("%s: %U.%s() raised %.100s: %S", argname, tn, hook,
                               Py_TYPE(v)->tp_name, v)
        : NULL;
    Py_XDECREF(tn);
    PyErr_Clear();
    PyErr_Restore(t, v, tb);
    dp_reraise_msg(NULL, msg);
    return -1;
}

/* TypeError "argname: expected <what>, got <type>" (with the shape of an
 * array, which is no scalar however small). Always -1. */
static int refuse_number(PyObject *obj, const char *argname, const char *what)
{
    PyObject *tn = dp_type_name(obj);
    if (tn == NULL) {
        return -1;
    }
    if (PyArray_Check(obj) && PyArray_NDIM((PyArrayObject *)obj) > 0) {
        PyObject *shape = PyObject_GetAttrString(obj, "shape");
        if (shape != NULL) {
            PyErr_Format(PyExc_TypeError,
                         "%s: expected %s, got a %U of shape %S (an array with dimensions "
                         "is not a scalar; pass a Python number, e.g. a.item())",
                         argname, what, tn, shape);
            Py_DECREF(shape);
        }
    } else {
        PyErr_Format(PyExc_TypeError, "%s: expected %s, got %U", argname, what, tn);
    }
    Py_DECREF(tn);
    return -1;
}

/* bool in any spelling: True, numpy.bool_, a 0-dim bool array. */
static int is_boolish(PyObject *obj)
{
    return PyBool_Check(obj) || PyArray_IsScalar(obj, Bool) ||
           (PyArray_Check(obj) && PyArray_TYPE((PyArrayObject *)obj) == NPY_BOOL);
}

int dp_is_index_like(PyObject *obj)
{
    if (PyLong_Check(obj)) {
        return !PyBool_Check(obj);
    }
    if (is_boolish(obj) || PyFloat_Check(obj)) {
        return 0;
    }
    if (PyArray_Check(obj)) {
        PyArrayObject *a = (PyArrayObject *)obj;
        return PyArray_NDIM(a) == 0 && PyTypeNum_ISINTEGER(PyArray_TYPE(a));
    }
    return PyIndex_Check(obj);
}

int dp_index_from_object(PyObject *obj, const char *argname, long long lo, long long hi,
                         long long *out)
{
    if (!dp_is_index_like(obj)) {
        return refuse_number(obj, argname, "an int");
    }
    PyObject *idx = PyNumber_Index(obj);
    if (idx == NULL) {
        if (PyErr_ExceptionMatches(PyExc_TypeError)) {
            PyErr_Clear();   /* a type whose __index__ refuses: say what was expected */
            return refuse_number(obj, argname, "an int");
        }
        return reraise_hook_error(obj, argname, "__index__");   /* its own error */
    }
    int overflow;
    long long v = PyLong_AsLongLongAndOverflow(idx, &overflow);
    if (v == -1 && PyErr_Occurred()) {
        Py_DECREF(idx);
        return -1;
    }
    if (overflow || v < lo || v > hi) {
        if (lo == LLONG_MIN && hi == LLONG_MAX) {
            PyErr_Format(PyExc_ValueError, "%s: %.60S is out of range (expected an int that "
                         "fits in int64)", argname, idx);
        } else {
            PyErr_Format(PyExc_ValueError, "%s: %.60S is out of range (expected an int from "
                         "%lld to %lld)", argname, idx, lo, hi);
        }
        Py_DECREF(idx);
        return -1;
    }
    Py_DECREF(idx);
    *out = v;
    return 0;
}

int dp_int_from_object(PyObject *obj, const char *argname, int *out)
{
    long long v = 0; /* set on success; gcc -O3 cannot see that (-Wmaybe-uninitialized) */
    if (dp_index_from_object(obj, argname, INT32_MIN, INT32_MAX, &v) < 0) {
        return -1;
    }
    *out = (int)v;
    return 0;
}

int dp_real_from_object(PyObject *obj, const char *argname, double *out)
{
    if (is_boolish(obj) || PyComplex_Check(obj) || PyUnicode_Check(obj) ||
        PyBytes_Check(obj) || PyArray_IsScalar(obj, ComplexFloating) ||
        (PyArray_Check(obj) && (PyArray_NDIM((PyArrayObject *)obj) > 0 ||
                                !(PyTypeNum_ISINTEGER(PyArray_TYPE((PyArrayObject *)obj)) ||
                                  PyTypeNum_ISFLOAT(PyArray_TYPE((PyArrayObject *)obj))))) ||
        !PyNumber_Check(obj)) {
        return refuse_number(obj, argname, "a real number");
    }
    double x = PyFloat_AsDouble(obj);
    if (x == -1.0 && PyErr_Occurred()) {
        if (PyErr_ExceptionMatches(PyExc_OverflowError)) {
            PyErr_Clear();
            PyErr_Format(PyExc_ValueError, "%s: %.60R... is out of range (too large for a "
                         "float64)", argname, obj);
            return -1;
        }
        if (PyErr_ExceptionMatches(PyExc_TypeError)) {
            PyErr_Clear();
            return refuse_number(obj, argname, "a real number");
        }
        return reraise_hook_error(obj, argname, "__float__");   /* its own error */
    }
    *out = x;
    return 0;
}

int dp_refuse_out_array(PyObject *obj, const char *argname)
{
    PyObject *tn = dp_type_name(obj);
    if (tn == NULL) {
        return -1;
    }
    int r = dp_has_attr(obj, "__array_interface__");
    if (r >= 0) {
        int arraylike = r || PyObject_CheckBuffer(obj);
        PyErr_Format(PyExc_TypeError,
                     "%s: expected a numpy.ndarray or a GPU array, got %U%s",
                     argname, tn,
                     arraylike ? " (an array-like, but not a numpy.ndarray: the result is "
                                 "written into out, so pass np.asarray(x) when that shares "
                                 "x's memory, or omit out and copy the result)" : "");
    }
    Py_DECREF(tn);
    return -1;
}
