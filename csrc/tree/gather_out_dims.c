/* gather_out_dims.c - gather under out_dims None and "sum" (JAX pmap's
 * out_axes as the model; docs/design.md): every replica's value compared
 * with replica 0's (arrays through numpy.array_equal, GPU arrays through
 * host copies), or the replicas' values added (comm.reduce_add for arrays);
 * and the array position, which picks the mode and hands the result back
 * in the leaves' array library. Called by gather_map (gather_tree.c).
 */
#include "dpmini.h"
#include "tree.h"
#include "gather.h"
#include "engine.h"

#include <math.h>
#include <string.h>

/* One replica's value at an out_dims None array position as a host ndarray
 * for comparing (new reference): an ndarray as is (virtual-device memory is
 * host memory), a NumPy scalar as a 0-dim array, and a GPU array (dpmini,
 * CUDA Array Interface or DLPack) copied to the host. The copy costs a
 * device-to-host transfer per replica; dpmini has no comparison kernel. */
static PyObject *host_for_compare(gather_ctx *g, PyObject *v, const char *cpath)
{
    if (PyArray_Check(v))
        return Py_NewRef(v);
    PyObject *s = scalar_as_array(v);
    if (s != NULL || PyErr_Occurred())
        return s;
    PyArrayObject *a = dp_as_array(g->st, v, cpath, 0);
    if (a == NULL || dp_array_device(g->st, a).kind != DP_CUDA)
        return (PyObject *)a;
    dp_device host = {DP_HOST, -1};
    PyObject *h = dp_copy_to_device(g->st, a, host);
    Py_DECREF(a);
    return h;
}

/* Arrays holding Python objects cannot go to a device (convert.c's rule):
 * refused naming the output path and the replica, before the copy engine
 * would name its own argument. 0, or -1 with TypeError. */
static int refuse_object_arrays(PyObject *const *vals, Py_ssize_t n, const char *cpath)
{
    for (Py_ssize_t i = 0; i < n; i++) {
        if (PyArray_Check(vals[i]) &&
            PyDataType_REFCHK(PyArray_DESCR((PyArrayObject *)vals[i]))) {
            PyErr_Format(PyExc_TypeError,
                         "%s: replica %zd returned an array holding Python objects "
                         "(dtype %S), which cannot be copied between devices; use a "
                         "numeric, bool or structured dtype without objects", cpath, i,
                         (PyObject *)PyArray_DESCR((PyArrayObject *)vals[i]));
            return -1;
        }
    }
    return 0;
}

/* d's kind, 'f' for ml_dtypes' floating dtypes (their kind is 'V' or 'f'
 * as registered; they have NaN but no NumPy float kind). */
static char float_kind(PyArray_Descr *d)
{
    PyArray_Descr *acc = dp_sum_descr(d);
    if (acc == NULL)
        return d->kind;
    char k = acc->kind;   /* 'f' (float32) or 'c' (complex64) */
    Py_DECREF(acc);
    return k;
}

/* numpy.array_equal(a, b, equal_nan=...) with NaN equal to NaN when both
 * dtypes are numeric and one is floating or complex (as the default gather
 * treats float NaN values: review1 f17); other dtypes have no NaN. 1, 0 or
 * -1. */
static int arrays_equal(PyObject *a, PyObject *b)
{
    PyArray_Descr *da = PyArray_DESCR((PyArrayObject *)a);
    PyArray_Descr *db = PyArray_DESCR((PyArrayObject *)b);
    /* ml_dtypes' small floats (bfloat16, float8: kind 'V') count as floats */
    char ka = float_kind(da), kb = float_kind(db);
    int numeric = strchr("biufc", ka) != NULL && strchr("biufc", kb) != NULL;
    /* NaT is the NaN of datetime64 / timedelta64: equal to NaT here too. */
    int nan = (numeric && (strchr("fc", ka) != NULL || strchr("fc", kb) != NULL)) ||
              (ka == kb && strchr("mM", ka) != NULL);
    PyObject *np = PyImport_ImportModule("numpy"), *res = NULL;
    if (np == NULL)
        return -1;
    res = PyObject_CallMethod(np, "array_equal", "OOO", a, b, nan ? Py_True : Py_False);
    Py_DECREF(np);
    if (res == NULL)
        return -1;
    int eq = PyObject_IsTrue(res);
    Py_DECREF(res);
    return eq;
}

/* out_dims None at an array position: every replica's array must equal
 * replica 0's (numpy.array_equal: same shape, equal values, NaN equal to
 * NaN in floating and complex arrays); GPU arrays are compared through host
 * copies. The result is replica 0's array on the target device (itself when
 * it already lives there; a NumPy scalar is returned as is). */
static PyObject *gather_equal_arrays(gather_ctx *g, PyObject *const *vals, Py_ssize_t n,
                                     const path_seg *seg)
{
    PyObject *path = path_str(seg), *h0 = NULL, *res = NULL;
    const char *cpath = path != NULL ? PyUnicode_AsUTF8(path) : NULL;
    if (cpath == NULL)
        goto done;
    for (Py_ssize_t i = 0; i < n; i++) {
        if (dp_refused_array_subclass(vals[i], cpath) != 0)
            goto done;
    }
    if (refuse_object_arrays(vals, n, cpath) < 0)
        goto done;
    h0 = host_for_compare(g, vals[0], cpath);
    if (h0 == NULL)
        goto done;
    for (Py_ssize_t i = 1; i < n; i++) {
        PyObject *hi = host_for_compare(g, vals[i], cpath);
        int eq = hi != NULL ? arrays_equal(h0, hi) : -1;
        Py_XDECREF(hi);
        if (eq < 0)
            goto done;
        if (eq)
            continue;
        PyErr_Format(PyExc_TypeError,
                     "%U: out_dims gives None here (every replica returns the same "
                     "value), but replica %zd returned an array that differs from "
                     "replica 0's (shape or values); give an int to gather the "
                     "replicas' arrays along that dim, or \"sum\" to add them",
                     path, i);
        goto done;
    }
    if (PyArray_IsScalar(vals[0], Generic) || is_py_number(vals[0])) {
        res = Py_NewRef(vals[0]);  /* a NumPy scalar or a number: a host value */
        goto done;
    }
    /* Replica 0's array onto the target: the copy engine (GPU arrays of any
     * producer included; the array itself when it lives there already). */
    PyObject *one = PyList_New(1), *per_dev = NULL;
    if (one == NULL)
        goto done;
    PyList_SET_ITEM(one, 0, Py_NewRef(vals[0]));
    per_dev = dp_broadcast_coalesced(g->st, one, &g->target, 1, 0);
    if (per_dev != NULL)
        res = Py_NewRef(PyList_GET_ITEM(PyList_GET_ITEM(per_dev, 0), 0));
    Py_DECREF(one);
    Py_XDECREF(per_dev);
done:
    Py_XDECREF(h0);
    Py_XDECREF(path);
    return res;
}

/* out_dims "sum" at an array position: comm.reduce_add onto the target
 * (same shapes; replica 0's dtype). NumPy scalars count as 0-dim arrays;
 * every other array (ndarray, dpmini.Array, CUDA Array Interface and DLPack
 * objects) goes to dp_reduce_add as is, which imports it as comm.reduce_add
 * does. */
static PyObject *gather_sum_arrays(gather_ctx *g, PyObject *const *vals, Py_ssize_t n,
                                   const path_seg *seg)
{
    PyObject *list = PyList_New(n), *path = NULL, *res = NULL;
    if (list == NULL)
        return NULL;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *a = scalar_as_array(vals[i]);
        if (a == NULL && !PyErr_Occurred())
            a = Py_NewRef(vals[i]);
        if (a == NULL)
            goto done;
        PyList_SET_ITEM(list, i, a);
    }
    path = path_str(seg);
    const char *cpath = path != NULL ? PyUnicode_AsUTF8(path) : NULL;
    if (cpath == NULL)
        goto done;
    /* The sum is in replica 0's dtype: the same no-data-loss rule as
     * concatenation, checked on host ndarrays and GPU shadows alike. */
    int all_nd = 1;
    for (Py_ssize_t i = 0; i < n; i++)
        all_nd = all_nd && PyArray_Check(PyList_GET_ITEM(list, i));
    if (refuse_object_arrays(((PyListObject *)list)->ob_item, n, cpath) < 0 ||
        (all_nd && check_dtypes(((PyListObject *)list)->ob_item, n, cpath) < 0))
        goto done;
    for (Py_ssize_t i = 1; all_nd && i < n; i++) {
        PyArray_Descr *d0 = PyArray_DESCR((PyArrayObject *)PyList_GET_ITEM(list, 0)),
                      *di = PyArray_DESCR((PyArrayObject *)PyList_GET_ITEM(list, i));
        if (!PyArray_EquivTypes(d0, di)) {
            /* The sum needs one dtype (PyTorch's reduce_add); name the
             * replica apart from the path. */
            PyErr_Format(PyExc_TypeError,
                         "%s: out_dims gives \"sum\" here, but replica %zd's value at %s "
                         "has dtype %S%s and replica 0's %S (a Python float is float64); "
                         "\"sum\" adds in one dtype: return one dtype from every replica",
                         cpath, i, cpath, (PyObject *)di, dp_byteorder_note(d0, di),
                         (PyObject *)d0);
            goto done;
        }
    }
    res = dp_reduce_add(g->st, list, g->target, cpath);
done:
    Py_DECREF(list);
    Py_XDECREF(path);
    return res;
}

/* out_dims "sum" at a number: v0 + v1 + ... in replica order. str and
 * bytes (which + would concatenate) and non-numbers are refused. */
PyObject *gather_sum_values(gather_ctx *g, PyObject *const *vals, Py_ssize_t n,
                            const path_seg *seg)
{
    if (PyUnicode_Check(vals[0]) || PyBytes_Check(vals[0]) || !PyNumber_Check(vals[0])) {
        PyObject *path = path_str(seg);
        if (path != NULL)
            PyErr_Format(PyExc_TypeError,
                         "%U: out_dims gives \"sum\" here, but replica 0 returned a "
                         "%.100s; \"sum\" adds arrays and numbers", path,
                         Py_TYPE(vals[0])->tp_name);
        Py_XDECREF(path);
        return NULL;
    }
    PyObject *acc = Py_NewRef(vals[0]);
    for (Py_ssize_t i = 1; i < n && acc != NULL; i++)
        Py_SETREF(acc, PyNumber_Add(acc, vals[i]));
    return acc;
}

/* out_dims None at a str/number/other object: every value must equal
 * replica 0's (==, NaN counting as equal to NaN as in gather_value); the
 * result is replica 0's value. */
PyObject *gather_equal_values(gather_ctx *g, PyObject *const *vals, Py_ssize_t n,
                              const path_seg *seg)
{
    for (Py_ssize_t i = 1; i < n; i++) {
        int eq = PyObject_RichCompareBool(vals[0], vals[i], Py_EQ);
        if (eq < 0)
            return kind_error_at(g, seg), NULL;
        if (!eq)
            eq = same_nan_value(vals[0], vals[i]);  /* as gather_value */
        if (eq)
            continue;
        PyObject *path = path_str(seg), *joined = join_each(vals, n, SHOW_REPR);
        if (path != NULL && joined != NULL)
            PyErr_Format(PyExc_TypeError,
                         "%U: out_dims gives None here (every replica returns the same "
                         "value), but the replicas returned different values (%U)",
                         path, joined);
        Py_XDECREF(path);
        Py_XDECREF(joined);
        return NULL;
    }
    return Py_NewRef(vals[0]);
}

/* An array position: every replica's arrays from one library (NumPy and
 * dpmini.Array count as one), gathered by the mode, and the result handed
 * back in that library (torch tensors in, one torch tensor out; interop.c). */
PyObject *gather_array_position(gather_ctx *g, PyObject *const *vals, Py_ssize_t n,
                                const path_seg *seg)
{
    PyObject *origin = dp_array_origin(g->st, vals[0]), *res = NULL, *path = NULL;
    if (origin == NULL)
        return NULL;
    for (Py_ssize_t i = 1; i < n; i++) {
        PyObject *oi = dp_array_origin(g->st, vals[i]);
        if (oi == NULL)
            goto done;
        Py_DECREF(oi);
        if (oi == origin)
            continue;
        PyObject *names = join_each(vals, n, SHOW_TYPE);
        path = path_str(seg);
        if (names != NULL && path != NULL)
            PyErr_Format(PyExc_TypeError,
                         "%U: the replicas returned arrays of different libraries (types "
                         "per replica: %U); return one library's arrays at each position",
                         path, names);
        Py_XDECREF(names);
        goto done;
    }
    if (g->mode == OUT_SAME)
        res = gather_equal_arrays(g, vals, n, seg);
    else if (g->mode == OUT_SUM)
        res = gather_sum_arrays(g, vals, n, seg);
    else
        res = gather_leaf(g, vals, n, seg);
    if (res != NULL && origin != Py_None) {
        path = path_str(seg);
        const char *cpath = path != NULL ? PyUnicode_AsUTF8(path) : NULL;
        if (cpath != NULL)
            res = dp_to_origin(g->st, origin, res, cpath);
        else
            Py_CLEAR(res);
    }
done:
    Py_XDECREF(path);
    Py_DECREF(origin);
    return res;
}
