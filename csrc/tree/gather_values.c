/* gather_values.c - gather at a leaf position (spec §4.5-4.8, R20): arrays
 * concatenated along dim onto the target (with the dtype check and the
 * NumPy-scalar / Python-number rule), str, bytes and numbers returned once
 * when every replica's value is equal, and any other object when every
 * replica returns the same one. Called by gather_map (gather_tree.c).
 */
#include "dpmini.h"
#include "tree.h"
#include "gather.h"
#include "engine.h"

#include <math.h>
#include <string.h>

/* A Python number (int, float, complex, bool; not a NumPy scalar). */
int is_py_number(PyObject *o)
{
    return (PyLong_Check(o) || PyFloat_Check(o) || PyComplex_Check(o)) &&
           !PyArray_IsScalar(o, Generic);
}

/* A NumPy scalar or a Python number as a new 0-dim ndarray; NULL with no
 * exception set for anything else. */
PyObject *scalar_as_array(PyObject *o)
{
    if (PyArray_IsScalar(o, Generic))
        return PyArray_FromScalar(o, NULL);
    if (is_py_number(o))
        return PyArray_FromAny(o, NULL, 0, 0, 0, NULL);
    return NULL;
}

/* The replicas' arrays at one position can be gathered into replica 0's
 * dtype without losing data: NumPy's same_kind casting (float64 -> float32
 * and int -> float are fine; float -> int, int -> bool and datetimes with
 * numbers are not), for str, bytes and structured dtypes safe casting (no
 * truncated strings), and never real with complex, in either order (as
 * PyTorch, whose comm functions see a complex array as its real view and
 * fail on the extra dim). Else TypeError naming the path and every
 * replica's dtype. arrs: n ndarrays. */
int check_dtypes(PyObject *const *arrs, Py_ssize_t n, const char *cpath)
{
    PyArray_Descr *d0 = PyArray_DESCR((PyArrayObject *)arrs[0]);
    for (Py_ssize_t i = 1; i < n; i++) {
        PyArray_Descr *di = PyArray_DESCR((PyArrayObject *)arrs[i]);
        if (di == d0)
            continue;   /* the same dtype object: nothing to cast */
        NPY_CASTING rule = strchr("SUV", d0->kind) != NULL || strchr("SUV", di->kind) != NULL
                               ? NPY_SAFE_CASTING : NPY_SAME_KIND_CASTING;
        int mixed_complex = (d0->kind == 'c') != (di->kind == 'c');
        if (!mixed_complex && PyArray_CanCastTypeTo(di, d0, rule))
            continue;
        PyObject *names = join_each(arrs, n, SHOW_DTYPE);
        if (names != NULL && mixed_complex)
            PyErr_Format(PyExc_TypeError,
                         "%s: replica %zd returned %S and replica 0 %S: real and complex "
                         "arrays are not gathered together, in either order (a real "
                         "result would drop the imaginary parts; PyTorch raises too) "
                         "(dtypes per replica: %U); cast the outputs to one dtype in the "
                         "replicas", cpath, i, (PyObject *)di, (PyObject *)d0, names);
        else if (names != NULL)
            PyErr_Format(PyExc_TypeError,
                         "%s: replica %zd returned %S, which cannot be gathered into "
                         "replica 0's dtype %S without losing data (dtypes per replica: "
                         "%U); gather casts to replica 0's dtype only within a kind "
                         "(NumPy's same_kind rule, e.g. float64 -> float32): cast the "
                         "outputs to one dtype in the replicas", cpath, i, (PyObject *)di,
                         (PyObject *)d0, names);
        Py_XDECREF(names);
        return -1;
    }
    return 0;
}

/* Replica counts up to this gather a leaf with arrays on the stack. */
#define GATHER_FEW 8

/* The usual position: every replica returned a plain ndarray (not a
 * subclass) of one dtype object and of one rank >= 1, with the same shape
 * outside dim. Then no check below can fail with a message that names the
 * position, so its path is not written. 1 with *wdim set, or 0. */
static int plain_position(const gather_ctx *g, PyObject *const *vals, Py_ssize_t n,
                          int *wdim)
{
    if (!PyArray_CheckExact(vals[0]))
        return 0;
    PyArrayObject *a0 = (PyArrayObject *)vals[0];
    PyArray_Descr *d0 = PyArray_DESCR(a0);
    int nd = PyArray_NDIM(a0);
    if (nd == 0 || g->dim < -nd || g->dim >= nd || PyDataType_REFCHK(d0))
        return 0;
    int d = g->dim < 0 ? g->dim + nd : g->dim;
    int64_t total = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        if (!PyArray_CheckExact(vals[i]))
            return 0;
        PyArrayObject *a = (PyArrayObject *)vals[i];
        if (PyArray_NDIM(a) != nd || PyArray_DESCR(a) != d0)
            return 0;
        for (int k = 0; k < nd; k++)
            if (k != d && PyArray_DIM(a, k) != PyArray_DIM(a0, k))
                return 0;
        if (__builtin_add_overflow(total, (int64_t)PyArray_DIM(a, d), &total) ||
            total > NPY_MAX_INTP)
            return 0;
    }
    *wdim = d;
    return 1;
}

/* Arrays at one position: concatenate along dim onto the target (spec 4.5-4.8). */
PyObject *gather_leaf(gather_ctx *g, PyObject *const *vals, Py_ssize_t n,
                      const path_seg *seg)
{
    int plain_dim;
    if (plain_position(g, vals, n, &plain_dim))
        /* "out": never shown, plain_position checked what would name it */
        return dp_gather_arrays_slab(g->st, (PyArrayObject **)vals, n, plain_dim, g->target,
                                     NULL, "out", g->slab);

    PyArrayObject **parts = NULL, *parts_few[GATHER_FEW];
    PyObject **arrs = NULL, *arrs_few[GATHER_FEW];  /* new references: vals as arrays */
    PyObject *path = NULL, *res = NULL;
    char buf[512];
    const char *cpath;
    int all0 = 1, any0 = 0, views = 0, wdim;

    cpath = path_text(seg, buf, sizeof buf, &path);   /* no str object made */
    if (cpath == NULL)
        goto done;
    if (n <= GATHER_FEW) {   /* the usual replica counts: no allocation */
        memset(parts_few, 0, sizeof parts_few);
        memset(arrs_few, 0, sizeof arrs_few);
        parts = parts_few;
        arrs = arrs_few;
    } else {
        parts = PyMem_Calloc((size_t)n, sizeof *parts);
        arrs = parts != NULL ? PyMem_Calloc((size_t)n, sizeof *arrs) : NULL;
        if (arrs == NULL) {
            PyErr_NoMemory();
            goto done;
        }
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        if (dp_refused_array_subclass(vals[i], cpath) != 0)
            goto done;
        arrs[i] = PyArray_Check(vals[i]) ? Py_NewRef(vals[i]) : scalar_as_array(vals[i]);
        if (arrs[i] == NULL && !PyErr_Occurred())  /* GPU arrays */
            arrs[i] = (PyObject *)dp_as_array(g->st, vals[i], cpath, 0);
        if (arrs[i] == NULL)
            goto done;
        if (PyArray_NDIM((PyArrayObject *)arrs[i]) == 0)
            any0 = 1;
        else
            all0 = 0;
    }
    vals = arrs;
    if (check_dtypes(arrs, n, cpath) < 0)
        goto done;
    if (any0 && !all0) {
        /* PyTorch fails inside comm.gather on the rank mismatch. */
        PyObject *dims = join_each(vals, n, SHOW_NDIM);
        if (dims != NULL)
            PyErr_Format(PyExc_ValueError,
                         "%s: some replicas returned 0-dim arrays and others did not "
                         "(ndim per replica: %U); 0-dim arrays are gathered into a "
                         "vector only when every replica returns one", cpath, dims);
        Py_XDECREF(dims);
        goto done;
    }

    if (all0) {
        /* spec 4.5 / R20: only dim == 0 literally turns scalars into a vector. */
        if (g->dim != 0) {
            PyErr_Format(PyExc_ValueError,
                         "%s: every replica returned a 0-dim array, which can only "
                         "be gathered with dim=0 (into a vector of one value per "
                         "replica), got dim=%d", cpath, g->dim);
            goto done;
        }
        npy_intp one = 1;
        PyArray_Dims shape = {&one, 1};
        views = 1;
        for (Py_ssize_t i = 0; i < n; i++) {
            parts[i] = (PyArrayObject *)PyArray_Newshape((PyArrayObject *)vals[i],
                                                         &shape, NPY_CORDER);
            if (parts[i] == NULL)
                goto done;
        }
        if (PyErr_WarnEx(PyExc_UserWarning,
                         "Was asked to gather along dimension 0, but all input "
                         "tensors were scalars; will instead unsqueeze and return "
                         "a vector.", 1) < 0)
            goto done;
        wdim = 0;
    }
    else {
        for (Py_ssize_t i = 0; i < n; i++)
            parts[i] = (PyArrayObject *)vals[i];
        if (dp_wrap_dim_or_raise(g->dim, PyArray_NDIM(parts[0]), cpath, &wdim) < 0)
            goto done;
    }
    res = dp_gather_arrays_slab(g->st, parts, n, wdim, g->target, NULL, cpath, g->slab);
done:
    if (parts != NULL && views)
        for (Py_ssize_t i = 0; i < n; i++)
            Py_XDECREF(parts[i]);
    if (parts != parts_few)
        PyMem_Free(parts);
    if (arrs != NULL)
        for (Py_ssize_t i = 0; i < n; i++)
            Py_XDECREF(arrs[i]);
    if (arrs != arrs_few)
        PyMem_Free(arrs);
    Py_XDECREF(path);
    return res;
}

/* Two floats/complexes that differ only by being NaN in the same places
 * (nan != nan in Python, but every replica returning nan is one value). */
int same_nan_value(PyObject *a, PyObject *b)
{
    if (!(PyFloat_Check(a) || PyComplex_Check(a)) || !(PyFloat_Check(b) || PyComplex_Check(b)))
        return 0;
    double ar = PyFloat_Check(a) ? PyFloat_AS_DOUBLE(a) : PyComplex_RealAsDouble(a);
    double ai = PyFloat_Check(a) ? 0.0 : PyComplex_ImagAsDouble(a);
    double br = PyFloat_Check(b) ? PyFloat_AS_DOUBLE(b) : PyComplex_RealAsDouble(b);
    double bi = PyFloat_Check(b) ? 0.0 : PyComplex_ImagAsDouble(b);
    return (ar == br || (ar != ar && br != br)) && (ai == bi || (ai != ai && bi != bi));
}

/* str, bytes, numbers: returned once when every replica's value is equal
 * (NaN counting as equal to NaN). */
PyObject *gather_value(gather_ctx *g, PyObject *const *vals, Py_ssize_t n,
                       const path_seg *seg)
{
    for (Py_ssize_t i = 1; i < n; i++) {
        int eq = PyObject_RichCompareBool(vals[0], vals[i], Py_EQ);
        if (eq < 0)
            return kind_error_at(g, seg), NULL;
        if (!eq)
            eq = same_nan_value(vals[0], vals[i]);
        if (eq)
            continue;
        PyObject *path = path_str(seg), *joined = join_each(vals, n, SHOW_REPR);
        if (joined != NULL && path != NULL)
            PyErr_Format(PyExc_TypeError,
                         "%U: the replicas returned different values (%U); a str, "
                         "bytes or number output is returned once, only when every "
                         "replica returns an equal value: return an array to get "
                         "one value per replica", path, joined);
        Py_XDECREF(joined);
        Py_XDECREF(path);
        return NULL;
    }
    return Py_NewRef(vals[0]);
}

/* Any other object: returned when every replica returns the same object,
 * or equal values (== and the same hash) of one type hashed by value
 * (Fraction, Decimal, date, frozenset: such types are by convention
 * immutable, so one value stands for all). Unhashable objects (mutable
 * ones) and objects hashed by identity must be the same object: equal but
 * separate ones would each be a replica's own state. */
PyObject *gather_same(gather_ctx *g, PyObject *const *vals, Py_ssize_t n,
                      const path_seg *seg)
{
    PyTypeObject *tp = Py_TYPE(vals[0]);
    /* A value type: hashable by value, not by identity (object.__hash__). */
    int hashable = tp->tp_hash != NULL && tp->tp_hash != PyObject_HashNotImplemented &&
                   tp->tp_hash != PyBaseObject_Type.tp_hash;
    for (Py_ssize_t i = 1; i < n; i++) {
        if (vals[i] == vals[0])
            continue;
        if (hashable && Py_TYPE(vals[i]) == tp) {
            int eq = PyObject_RichCompareBool(vals[0], vals[i], Py_EQ);
            if (eq < 0)
                return kind_error_at(g, seg), NULL;
            if (eq) {
                /* Each hash checked before the next call: a raising
                 * __hash__ propagates, named with the path. */
                Py_hash_t h0 = PyObject_Hash(vals[0]);
                if (h0 == -1 && PyErr_Occurred())
                    return kind_error_at(g, seg), NULL;
                Py_hash_t hi = PyObject_Hash(vals[i]);
                if (hi == -1 && PyErr_Occurred())
                    return kind_error_at(g, seg), NULL;
                if (h0 == hi)
                    continue;
            }
        }
        PyObject *path = path_str(seg);
        if (path != NULL)
            PyErr_Format(PyExc_TypeError,
                         "%U: the replicas returned different %.100s objects; gather "
                         "can only return such an object when every replica returns "
                         "the same one, or equal values of one hashable type (return "
                         "arrays, or a dict, tuple, namedtuple or dataclass of them)",
                         path, tp->tp_name);
        Py_XDECREF(path);
        return NULL;
    }
    return Py_NewRef(vals[0]);
}
