/* gather.c - gather of nested Python structures: DataParallel's gather
 * (docs/spec.md 4) with out_dims, and the Python function dpmini.gather.
 *
 * Gather walks the replicas' outputs side by side: outputs[0] picks the rule
 * (as in PyTorch) but every replica is checked against it, and array
 * positions are concatenated with dp_gather_arrays.
 *
 * Conventions as in tree.h: int results are 0 or -1 with an exception set
 * unless said otherwise; PyObject* results are new references or NULL with
 * an exception set. vals[i] is replica i's value at the position (borrowed,
 * n >= 1), seg its path.
 *
 * Sections: types and the walk's declarations; leaves (arrays concatenated
 * along dim onto the target, with the dtype check and the NumPy-scalar /
 * Python-number rule; str, bytes and numbers returned once when every
 * replica's value is equal; any other object when every replica returns the
 * same one); out_dims None and "sum" (JAX pmap's out_axes as the model:
 * every replica's value compared with replica 0's, or the values added);
 * containers (dicts key by key, lists / tuples / namedtuples position by
 * position, dataclass instances field by field, rebuilt in replica 0's
 * type); the walk (the kind of value at a position, the check that every
 * replica returned that kind, gather_map, dp_gather_outputs); the Python
 * function dpmini.gather.
 */
#include "dpmini.h"
#include "tree.h"
#include "engine.h"
#include "walk.h"
#include "profile.h"

#include <math.h>
#include <string.h>

/* What gather does at a leaf (out_dims; OUT_CAT is PyTorch's rule). */
enum {
    OUT_CAT = 0,   /* concatenate arrays along dim (the rules of docs/spec.md 4)  */
    OUT_SAME,      /* out_dims None: every replica's value must be equal  */
    OUT_SUM        /* out_dims "sum": add the replicas' values            */
};

typedef struct {
    dp_state *st;
    dp_device target;   /* where arrays are gathered                      */
    int dim;            /* as given; wrapped per array position           */
    int mode;           /* OUT_*, from out_dims; OUT_CAT by default       */
    dp_slab *slab;      /* the call's buffers for small results (shared by
                           the copies of g made for out_dims entries)     */
} gather_ctx;

/* What gather does with the value at one position (outputs[0]'s kind picks
 * the rule; every replica must have the same kind). */
enum {
    G_ARRAY,       /* concatenate along dim                               */
    G_NONE,        /* None                                                */
    G_DICT,        /* key by key, replica 0's order and type              */
    G_NAMEDTUPLE,  /* field by field, type(out)._make                     */
    G_DATACLASS,   /* field by field, rebuilt with the class              */
    G_SEQ,         /* list/tuple: position by position, same length       */
    G_VALUE,       /* str, bytes, numbers: one value if all are equal     */
    G_OTHER        /* anything else: the same object from every replica   */
};

/* What join_each shows of each replica's value. */
enum { SHOW_TYPE, SHOW_REPR, SHOW_NDIM, SHOW_LEN, SHOW_DTYPE };

/* ------------------------------------------------------------------ */
/* The walk (declared first: the containers call it back)             */
/* ------------------------------------------------------------------ */

/* ", ".join of one item per value (SHOW_*), for error messages. */
static PyObject *join_each(PyObject *const *vals, Py_ssize_t n, int show);
/* Probing a value's kind raised: re-raise it naming seg. Returns -1. */
static int kind_error_at(gather_ctx *g, const path_seg *seg);
/* The gathered value of one position; spec: its out_dims entry (NULL:
 * g->mode and g->dim, inherited), sseg the entry's path. */
static PyObject *gather_map(gather_ctx *g, PyObject *const *vals, Py_ssize_t n,
                     const path_seg *seg, PyObject *spec, const path_seg *sseg);

/* ------------------------------------------------------------------ */
/* Leaves                                                             */
/* ------------------------------------------------------------------ */

/* A Python number (int, float, complex, bool; not a NumPy scalar)? 1 or 0. */
static int is_py_number(PyObject *o);
/* A NumPy scalar or Python number as a new 0-dim ndarray; NULL with no
 * exception set for anything else. */
static PyObject *scalar_as_array(PyObject *o);
/* The n ndarrays can be gathered into arrs[0]'s dtype without losing data;
 * else TypeError naming cpath and every replica's dtype. */
static int check_dtypes(PyObject *const *arrs, Py_ssize_t n, const char *cpath);
/* Arrays: concatenated along g->dim onto g->target (docs/spec.md 4.5-4.8). */
static PyObject *gather_leaf(gather_ctx *g, PyObject *const *vals, Py_ssize_t n,
                      const path_seg *seg);
/* Two floats/complexes equal but for NaN in the same places? 1 or 0. */
static int same_nan_value(PyObject *a, PyObject *b);
/* str, bytes, numbers: vals[0] when every replica's value is equal. */
static PyObject *gather_value(gather_ctx *g, PyObject *const *vals, Py_ssize_t n,
                       const path_seg *seg);
/* Any other object: vals[0] when every replica returns the same one (or
 * equal values of one type hashed by value). */
static PyObject *gather_same(gather_ctx *g, PyObject *const *vals, Py_ssize_t n,
                      const path_seg *seg);

/* ------------------------------------------------------------------ */
/* Containers rebuilt                                                 */
/* ------------------------------------------------------------------ */

/* Dicts key by key, in replica 0's key order and type (docs/spec.md 4.1, 11.2). */
static PyObject *gather_dict(gather_ctx *g, PyObject *const *vals, Py_ssize_t n,
                      const path_seg *seg, PyObject *spec, const path_seg *sseg);
/* Lists, tuples, namedtuples (kind G_SEQ / G_NAMEDTUPLE) position by
 * position, same length everywhere (docs/spec.md 11.5). */
static PyObject *gather_seq(gather_ctx *g, PyObject *const *vals, Py_ssize_t n,
                     int kind, const path_seg *seg, PyObject *spec,
                     const path_seg *sseg);
/* Dataclass instances field by field, without running __init__ (docs/spec.md 11.4). */
static PyObject *gather_dataclass(gather_ctx *g, PyObject *const *vals, Py_ssize_t n,
                           const path_seg *seg, PyObject *spec,
                           const path_seg *sseg);

/* ------------------------------------------------------------------ */
/* out_dims None and "sum"                                            */
/* ------------------------------------------------------------------ */

/* out_dims "sum" at a number: v0 + v1 + ... in replica order. */
static PyObject *gather_sum_values(gather_ctx *g, PyObject *const *vals, Py_ssize_t n,
                            const path_seg *seg);
/* out_dims None at a str/number/other object: vals[0] when all are equal. */
static PyObject *gather_equal_values(gather_ctx *g, PyObject *const *vals, Py_ssize_t n,
                              const path_seg *seg);
/* An array position, gathered by g->mode, handed back in the leaves'
 * array library. */
static PyObject *gather_array_position(gather_ctx *g, PyObject *const *vals, Py_ssize_t n,
                                const path_seg *seg);

/* ------------------------------------------------------------------ */
/* Leaves                                                             */
/* ------------------------------------------------------------------ */
/* A Python number (int, float, complex, bool; not a NumPy scalar). */
static int is_py_number(PyObject *o)
{
    return (PyLong_Check(o) || PyFloat_Check(o) || PyComplex_Check(o)) &&
           !PyArray_IsScalar(o, Generic);
}

/* A NumPy scalar, a Python number or a 0-dim ndarray: NumPy's 0-dim values,
 * which may be mixed at one position (check_kinds). */
static int is_zero_dim_value(PyObject *o)
{
    return PyArray_IsScalar(o, Generic) || is_py_number(o) ||
           (PyArray_Check(o) && PyArray_NDIM((PyArrayObject *)o) == 0);
}

/* A NumPy scalar or a Python number as a new 0-dim ndarray; NULL with no
 * exception set for anything else. */
static PyObject *scalar_as_array(PyObject *o)
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
static int check_dtypes(PyObject *const *arrs, Py_ssize_t n, const char *cpath)
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

/* A leaf position's arrays in flight: the replicas' values as ndarrays, and
 * the parts concatenated (arrs itself, or 0-dim arrays viewed as 1-element
 * vectors). Up to GATHER_FEW replicas the slots are on the stack. */
typedef struct {
    Py_ssize_t n;
    PyObject **arrs, *arrs_few[GATHER_FEW];         /* new references           */
    PyArrayObject **parts, *parts_few[GATHER_FEW];  /* new references if views */
    int views;      /* parts are views made here                            */
    int all0, any0; /* every / some array is 0-dim                          */
} leaf_parts;

/* The slots for n replicas. 0, or -1 with MemoryError. */
static int leaf_parts_init(leaf_parts *lp, Py_ssize_t n)
{
    memset(lp, 0, sizeof *lp);
    lp->n = n;
    lp->all0 = 1;
    if (n <= GATHER_FEW) {   /* the usual replica counts: no allocation */
        lp->parts = lp->parts_few;
        lp->arrs = lp->arrs_few;
        return 0;
    }
    lp->parts = PyMem_Calloc((size_t)n, sizeof *lp->parts);
    lp->arrs = lp->parts != NULL ? PyMem_Calloc((size_t)n, sizeof *lp->arrs) : NULL;
    if (lp->arrs == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    return 0;
}

static void leaf_parts_clear(leaf_parts *lp)
{
    if (lp->parts != NULL && lp->views)
        for (Py_ssize_t i = 0; i < lp->n; i++)
            Py_XDECREF(lp->parts[i]);
    if (lp->parts != lp->parts_few)
        PyMem_Free(lp->parts);
    if (lp->arrs != NULL)
        for (Py_ssize_t i = 0; i < lp->n; i++)
            Py_XDECREF(lp->arrs[i]);
    if (lp->arrs != lp->arrs_few)
        PyMem_Free(lp->arrs);
}

/* Each replica's value as an ndarray into lp->arrs (NumPy scalars and
 * numbers as 0-dim arrays, GPU arrays as their shadows), noting 0-dim ones.
 * 0 or -1. */
static int leaf_as_arrays(gather_ctx *g, leaf_parts *lp, PyObject *const *vals,
                          const char *cpath)
{
    for (Py_ssize_t i = 0; i < lp->n; i++) {
        if (dp_refused_array_subclass(vals[i], cpath) != 0)
            return -1;
        PyObject *a = PyArray_Check(vals[i]) ? Py_NewRef(vals[i]) : scalar_as_array(vals[i]);
        if (a == NULL && !PyErr_Occurred())  /* GPU arrays */
            a = (PyObject *)dp_as_array(g->st, vals[i], cpath, 0);
        if ((lp->arrs[i] = a) == NULL)
            return -1;
        if (PyArray_NDIM((PyArrayObject *)a) == 0)
            lp->any0 = 1;
        else
            lp->all0 = 0;
    }
    return 0;
}

/* 0-dim arrays are gathered only when every replica returns one (PyTorch
 * fails inside comm.gather on the rank mismatch). 0, or -1 with ValueError. */
static int check_leaf_ranks(const leaf_parts *lp, const char *cpath)
{
    if (!lp->any0 || lp->all0)
        return 0;
    PyObject *dims = join_each(lp->arrs, lp->n, SHOW_NDIM);
    if (dims != NULL)
        PyErr_Format(PyExc_ValueError,
                     "%s: some replicas returned 0-dim arrays and others did not "
                     "(ndim per replica: %U); 0-dim arrays are gathered into a "
                     "vector only when every replica returns one", cpath, dims);
    Py_XDECREF(dims);
    return -1;
}

/* Every replica returned a 0-dim array: each viewed as a 1-element vector,
 * gathered along 0 with PyTorch's UserWarning (docs/spec.md 4.5, 11.8: only
 * dim == 0 literally turns scalars into a vector). 0 or -1. */
static int scalars_as_vector(gather_ctx *g, leaf_parts *lp, const char *cpath)
{
    if (g->dim != 0) {
        PyErr_Format(PyExc_ValueError,
                     "%s: every replica returned a 0-dim array, which can only "
                     "be gathered with dim=0 (into a vector of one value per "
                     "replica), got dim=%d", cpath, g->dim);
        return -1;
    }
    npy_intp one = 1;
    PyArray_Dims shape = {&one, 1};
    lp->views = 1;
    for (Py_ssize_t i = 0; i < lp->n; i++) {
        lp->parts[i] = (PyArrayObject *)PyArray_Newshape((PyArrayObject *)lp->arrs[i],
                                                         &shape, NPY_CORDER);
        if (lp->parts[i] == NULL)
            return -1;
    }
    return PyErr_WarnEx(PyExc_UserWarning,
                        "Was asked to gather along dimension 0, but all input "
                        "tensors were scalars; will instead unsqueeze and return "
                        "a vector.", 1) < 0 ? -1 : 0;
}

/* Arrays at one position: concatenate along dim onto the target (docs/spec.md 4.5-4.8). */
static PyObject *gather_leaf(gather_ctx *g, PyObject *const *vals, Py_ssize_t n,
                      const path_seg *seg)
{
    int wdim;
    if (plain_position(g, vals, n, &wdim))
        /* "out": never shown, plain_position checked what would name it */
        return dp_gather_arrays_slab(g->st, (PyArrayObject **)vals, n, wdim, g->target,
                                     NULL, "out", g->slab);

    PyObject *path = NULL, *res = NULL;
    char buf[512];
    leaf_parts lp;
    const char *cpath = path_text(seg, buf, sizeof buf, &path);   /* no str object made */
    if (cpath == NULL) {
        Py_XDECREF(path);
        return NULL;
    }
    if (leaf_parts_init(&lp, n) < 0 || leaf_as_arrays(g, &lp, vals, cpath) < 0 ||
        check_dtypes(lp.arrs, n, cpath) < 0 || check_leaf_ranks(&lp, cpath) < 0)
        goto done;
    if (lp.all0) {
        if (scalars_as_vector(g, &lp, cpath) < 0)
            goto done;
        wdim = 0;
    }
    else {
        for (Py_ssize_t i = 0; i < n; i++)
            lp.parts[i] = (PyArrayObject *)lp.arrs[i];
        if (dp_wrap_dim_or_raise(g->dim, PyArray_NDIM(lp.parts[0]), cpath, &wdim) < 0)
            goto done;
    }
    res = dp_gather_arrays_slab(g->st, lp.parts, n, wdim, g->target, NULL, cpath, g->slab);
done:
    leaf_parts_clear(&lp);
    Py_XDECREF(path);
    return res;
}

/* Two floats/complexes that differ only by being NaN in the same places
 * (nan != nan in Python, but every replica returning nan is one value). */
static int same_nan_value(PyObject *a, PyObject *b)
{
    if (!(PyFloat_Check(a) || PyComplex_Check(a)) || !(PyFloat_Check(b) || PyComplex_Check(b)))
        return 0;
    double ar = PyFloat_Check(a) ? PyFloat_AS_DOUBLE(a) : PyComplex_RealAsDouble(a);
    double ai = PyFloat_Check(a) ? 0.0 : PyComplex_ImagAsDouble(a);
    double br = PyFloat_Check(b) ? PyFloat_AS_DOUBLE(b) : PyComplex_RealAsDouble(b);
    double bi = PyFloat_Check(b) ? 0.0 : PyComplex_ImagAsDouble(b);
    return (ar == br || (ar != ar && br != br)) && (ai == bi || (ai != ai && bi != bi));
}

/* Whether every replica's value equals replica 0's (==, NaN counting as
 * equal to NaN): 1 or 0, or -1 when == raised (named with the path). */
static int values_equal(gather_ctx *g, PyObject *const *vals, Py_ssize_t n,
                        const path_seg *seg)
{
    for (Py_ssize_t i = 1; i < n; i++) {
        int eq = PyObject_RichCompareBool(vals[0], vals[i], Py_EQ);
        if (eq < 0)
            return kind_error_at(g, seg);
        if (!eq && !same_nan_value(vals[0], vals[i]))
            return 0;
    }
    return 1;
}

/* The replicas' values differ: TypeError naming the path and every value,
 * lead written before that and what after it. */
static void values_differ(PyObject *const *vals, Py_ssize_t n, const path_seg *seg,
                          const char *lead, const char *what)
{
    PyObject *path = path_str(seg), *joined = join_each(vals, n, SHOW_REPR);
    if (joined != NULL && path != NULL)
        PyErr_Format(PyExc_TypeError, "%U: %sthe replicas returned different values (%U)%s",
                     path, lead, joined, what);
    Py_XDECREF(joined);
    Py_XDECREF(path);
}

/* str, bytes, numbers: returned once when every replica's value is equal
 * (NaN counting as equal to NaN). */
static PyObject *gather_value(gather_ctx *g, PyObject *const *vals, Py_ssize_t n,
                       const path_seg *seg)
{
    int eq = values_equal(g, vals, n, seg);
    if (eq == 0)
        values_differ(vals, n, seg, "", "; a str, bytes or number output is returned once, "
                      "only when every replica returns an equal value: return an array to "
                      "get one value per replica");
    return eq == 1 ? Py_NewRef(vals[0]) : NULL;
}

/* Any other object: returned when every replica returns the same object,
 * or equal values (== and the same hash) of one type hashed by value
 * (Fraction, Decimal, date, frozenset: such types are by convention
 * immutable, so one value stands for all). Unhashable objects (mutable
 * ones) and objects hashed by identity must be the same object: equal but
 * separate ones would each be a replica's own state. */
static PyObject *gather_same(gather_ctx *g, PyObject *const *vals, Py_ssize_t n,
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

/* ------------------------------------------------------------------ */
/* out_dims None and "sum"                                            */
/* ------------------------------------------------------------------ */
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
static PyObject *gather_sum_values(gather_ctx *g, PyObject *const *vals, Py_ssize_t n,
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
static PyObject *gather_equal_values(gather_ctx *g, PyObject *const *vals, Py_ssize_t n,
                              const path_seg *seg)
{
    int eq = values_equal(g, vals, n, seg);
    if (eq == 0)
        values_differ(vals, n, seg, "out_dims gives None here (every replica returns the "
                      "same value), but ", "");
    return eq == 1 ? Py_NewRef(vals[0]) : NULL;
}

/* An array position: every replica's arrays from one library (NumPy and
 * dpmini.Array count as one), gathered by the mode, and the result handed
 * back in that library (torch tensors in, one torch tensor out; interop.c). */
static PyObject *gather_array_position(gather_ctx *g, PyObject *const *vals, Py_ssize_t n,
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

/* ------------------------------------------------------------------ */
/* Containers rebuilt                                                 */
/* ------------------------------------------------------------------ */
/* The pending error of a dict subclass's own keys() / __getitem__ /
 * __contains__ (what), re-raised as the same type naming the output path
 * and the hook, the original as __cause__ (docs/libraries.md, "Probing"). */
static void name_mapping_error(dp_state *st, PyObject *d, const path_seg *seg,
                               const char *what, PyObject *key)
{
    if (!PyErr_ExceptionMatches(PyExc_Exception))
        return;   /* KeyboardInterrupt: as it is */
    PyObject *t, *v, *tb;
    PyErr_Fetch(&t, &v, &tb);
    PyErr_NormalizeException(&t, &v, &tb);
    PyObject *path = path_str(seg);
    PyObject *kr = path != NULL && key != NULL ? path_key_repr(key) : NULL;
    PyObject *msg = NULL;
    if (path != NULL && v != NULL && kr != NULL)
        msg = PyUnicode_FromFormat("%U: reading a %.100s (a dict subclass) with its "
                                   "__getitem__(%U) raised %.100s: %S", path,
                                   Py_TYPE(d)->tp_name, kr, Py_TYPE(v)->tp_name, v);
    else if (path != NULL && v != NULL && key == NULL)
        msg = PyUnicode_FromFormat("%U: reading a %.100s (a dict subclass) with its %s "
                                   "raised %.100s: %S", path, Py_TYPE(d)->tp_name, what,
                                   Py_TYPE(v)->tp_name, v);
    Py_XDECREF(kr);
    Py_XDECREF(path);
    PyErr_Clear();
    PyErr_Restore(t, v, tb);
    dp_reraise_msg(st, msg);
}

/* The walk over one container position, the same for dicts, sequences and
 * dataclasses: the replicas' containers, the position's out_dims entry, and
 * the slots that hold the replicas' values at one child at a time. */
typedef struct {
    gather_ctx *g;
    PyObject *const *vals;  /* replica i's container (borrowed)             */
    Py_ssize_t n;
    const path_seg *seg;    /* the containers' path                         */
    PyObject *spec;         /* the out_dims entry (NULL: inherited)         */
    const path_seg *sseg;   /* its path                                     */
    PyObject **child;       /* n slots: replica i's value at one child      */
    int owned;              /* the slots hold new references (else borrowed) */
} gather_walk;

/* The walk's slots. 0, or -1 with MemoryError. */
static int walk_begin(gather_walk *w, gather_ctx *g, PyObject *const *vals, Py_ssize_t n,
                      const path_seg *seg, PyObject *spec, const path_seg *sseg, int owned)
{
    *w = (gather_walk){g, vals, n, seg, spec, sseg, NULL, owned};
    w->child = PyMem_Calloc((size_t)n, sizeof *w->child);
    if (w->child == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    return 0;
}

static void walk_end(gather_walk *w)
{
    PyMem_Free(w->child);
    w->child = NULL;
}

/* The gathered value at one child whose values the caller put in w->child
 * (filled 0: filling them failed, an exception is set); cseg is the child's
 * path, pos or key picks its out_dims entry. The slots are emptied either
 * way. New reference or NULL. */
static PyObject *walk_child(gather_walk *w, int filled, const path_seg *cseg, Py_ssize_t pos,
                            PyObject *key)
{
    PyObject *v = NULL, *cspec;
    path_seg csseg;
    if (filled && spec_child(w->spec, w->sseg, pos, key, &cspec, &csseg) == 0)
        v = gather_map(w->g, w->child, w->n, cseg, cspec, &csseg);
    for (Py_ssize_t i = 0; i < w->n; i++) {
        if (w->owned)
            Py_CLEAR(w->child[i]);
        else
            w->child[i] = NULL;
    }
    return v;
}

/* Every replica's dict has as many keys as replica 0's (PyTorch's message
 * first). 0, or -1 with ValueError. */
static int check_dict_sizes(PyObject *const *vals, Py_ssize_t n, const path_seg *seg)
{
    Py_ssize_t len0 = PyDict_GET_SIZE(vals[0]);
    for (Py_ssize_t i = 1; i < n; i++) {
        if (PyDict_GET_SIZE(vals[i]) == len0)
            continue;
        PyObject *path = path_str(seg);
        if (path != NULL)
            PyErr_Format(PyExc_ValueError,
                         "%U: All dicts must have the same number of keys (replica 0 "
                         "returned %zd, replica %zd returned %zd)",
                         path, len0, i, PyDict_GET_SIZE(vals[i]));
        Py_XDECREF(path);
        return -1;
    }
    return 0;
}

/* Replica i's dict lacks key: ValueError naming the path and the key. */
static void missing_key_error(const path_seg *seg, Py_ssize_t i, PyObject *key)
{
    PyObject *path = path_str(seg), *kr = path != NULL ? path_key_repr(key) : NULL;
    if (path != NULL && kr != NULL && i == 0)
        /* a dict subclass whose keys() lists a key it has no item for */
        PyErr_Format(PyExc_ValueError,
                     "%U: replica 0 returned a dict whose keys() gives the key %U, "
                     "which it has no item for; a dict subclass's keys() must give "
                     "its own keys", path, kr);
    else if (path != NULL && kr != NULL)
        PyErr_Format(PyExc_ValueError,
                     "%U: replica %zd returned a dict without the key %U "
                     "that replica 0 returned; every replica must "
                     "return the same keys", path, i, kr);
    Py_XDECREF(kr);
    Py_XDECREF(path);
}

/* Every replica's value at replica 0's q-th key into w->child (new
 * references); replica 0's from flat, its dict_flat snapshot, when its dict
 * is exact (flat NULL otherwise). 1, or 0 with an exception set. */
static int dict_values_at(gather_walk *w, PyObject *flat, Py_ssize_t q, PyObject *key)
{
    for (Py_ssize_t i = 0; i < w->n; i++) {
        int has;
        if (i == 0 && flat != NULL) {
            w->child[0] = Py_NewRef(PyTuple_GET_ITEM(flat, 2 * q + 1));
            continue;
        }
        if (PyDict_CheckExact(w->vals[i])) {
            /* one lookup; a str key's hash is cached */
            PyObject *found = PyDict_GetItemWithError(w->vals[i], key);
            if (found != NULL) {
                w->child[i] = Py_NewRef(found);
                continue;
            }
            has = PyErr_Occurred() ? -1 : 0;
        }
        else {
            has = PyDict_Contains(w->vals[i], key);
        }
        if (has == 0) {
            missing_key_error(w->seg, i, key);
            return 0;
        }
        if (has < 0 || (w->child[i] = PyObject_GetItem(w->vals[i], key)) == NULL) {
            name_mapping_error(w->g->st, w->vals[i], w->seg, "[key]", key);
            return 0;
        }
    }
    return 1;
}

/* key: v into acc, a dict (exact) or a list of (key, value) pairs. Steals
 * v. 0 or -1. */
static int dict_store(PyObject *acc, int exact, PyObject *key, PyObject *v)
{
    int r = exact ? PyDict_SetItem(acc, key, v) : append_steal(acc, PyTuple_Pack(2, key, v));
    Py_DECREF(v);
    return r;
}

/* Dicts: same number of keys, every key of replica 0 in every dict; key order
 * and type from replica 0 (docs/spec.md 4.1, 11.2). */
static PyObject *gather_dict(gather_ctx *g, PyObject *const *vals, Py_ssize_t n,
                      const path_seg *seg, PyObject *spec, const path_seg *sseg)
{
    PyObject *acc = NULL, *res = NULL;
    gather_walk w = {0};
    int exact = PyDict_CheckExact(vals[0]);

    if (check_dict_sizes(vals, n, seg) < 0)
        return NULL;
    /* An exact dict: its keys and values in one snapshot (dict_flat, no
     * user code); a subclass: its keys(). */
    PyObject *keys = exact ? dict_flat(vals[0]) : PyMapping_Keys(vals[0]);
    if (keys == NULL) {
        name_mapping_error(g->st, vals[0], seg, "keys()", NULL);
        return NULL;
    }
    Py_ssize_t nkeys = exact ? PyTuple_GET_SIZE(keys) / 2 : PyList_GET_SIZE(keys);
    if (spec_is_container(spec) &&
        spec_check_children(spec, sseg, seg, 0, vals[0], NULL) < 0)
        goto done;
    if (walk_begin(&w, g, vals, n, seg, spec, sseg, 1) < 0)
        goto done;
    acc = exact ? dict_new_sized(nkeys) : PyList_New(0);
    if (acc == NULL)
        goto done;
    for (Py_ssize_t q = 0; q < nkeys; q++) {
        PyObject *key = exact ? PyTuple_GET_ITEM(keys, 2 * q) : PyList_GET_ITEM(keys, q);
        path_seg cseg = seg_child(seg, SEG_KEY, 0, key);
        int filled = dict_values_at(&w, exact ? keys : NULL, q, key);
        PyObject *v = walk_child(&w, filled, &cseg, q, key);
        if (v == NULL || dict_store(acc, exact, key, v) < 0)
            goto done;
    }
    res = exact ? Py_NewRef(acc) : rebuild_mapping(g->st, vals[0], acc, seg);
done:
    walk_end(&w);
    Py_DECREF(keys);
    Py_XDECREF(acc);
    return res;
}

/* Each replica's list or tuple as a tuple (seq_snapshot) into snap (n
 * slots, new references), every one of replica 0's length. The length, or
 * -1 (ValueError naming every replica's length when they differ). */
static Py_ssize_t seq_snapshots(PyObject **snap, PyObject *const *vals, Py_ssize_t n,
                                const path_seg *seg)
{
    for (Py_ssize_t i = 0; i < n; i++)
        if ((snap[i] = seq_snapshot(vals[i])) == NULL)
            return -1;
    Py_ssize_t len0 = PyTuple_GET_SIZE(snap[0]);
    for (Py_ssize_t i = 1; i < n; i++) {
        if (PyTuple_GET_SIZE(snap[i]) == len0)
            continue;
        PyObject *path = path_str(seg), *lens = join_each(snap, n, SHOW_LEN);
        if (lens != NULL && path != NULL)
            PyErr_Format(PyExc_ValueError,
                         "%U: the replicas returned sequences of different lengths "
                         "(lengths per replica: %U); every replica must return the "
                         "same length", path, lens);
        Py_XDECREF(lens);
        Py_XDECREF(path);
        return -1;
    }
    return len0;
}

/* The gathered items (a list) in the type of v0, replica 0's sequence:
 * type(out)._make for a namedtuple, the list or a tuple for the exact
 * types, type(out)(items) for a subclass. */
static PyObject *rebuild_seq(PyObject *v0, int kind, PyObject *items, const path_seg *seg)
{
    PyTypeObject *tp = Py_TYPE(v0);
    PyObject *res = NULL;
    if (kind == G_NAMEDTUPLE) {
        PyObject *make = PyObject_GetAttrString((PyObject *)tp, "_make");
        if (make != NULL) {
            res = PyObject_CallOneArg(make, items);
            Py_DECREF(make);
        }
        if (res == NULL)
            raise_rebuild_error(seg, tp, "type(out)._make(fields)", "");
        return res;
    }
    if (PyList_CheckExact(v0))
        return Py_NewRef(items);
    if (PyTuple_CheckExact(v0))
        return PyList_AsTuple(items);
    res = PyObject_CallOneArg((PyObject *)tp, items);
    if (res == NULL)
        raise_rebuild_error(seg, tp, "type(out)(items)", "");
    return res;
}

/* Lists, tuples, namedtuples: position by position, same length everywhere
 * (docs/spec.md 4.1's strict zip, 11.5). */
static PyObject *gather_seq(gather_ctx *g, PyObject *const *vals, Py_ssize_t n,
                     int kind, const path_seg *seg, PyObject *spec,
                     const path_seg *sseg)
{
    PyObject **snap = NULL, *items = NULL, *names = NULL, *res = NULL;
    gather_walk w = {0};
    Py_ssize_t len0 = 0;

    snap = PyMem_Calloc((size_t)n, sizeof *snap);
    if (snap == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    if (walk_begin(&w, g, vals, n, seg, spec, sseg, 0) < 0 ||
        (len0 = seq_snapshots(snap, vals, n, seg)) < 0)
        goto done;
    if (spec_is_container(spec) &&
        spec_check_children(spec, sseg, seg, len0, NULL, NULL) < 0)
        goto done;
    items = PyList_New(len0);
    if (items == NULL)
        goto done;
    if (kind == G_NAMEDTUPLE)
        names = namedtuple_names(vals[0], len0);
    for (Py_ssize_t pos = 0; pos < len0; pos++) {
        path_seg cseg = names != NULL
            ? seg_child(seg, SEG_ATTR, 0, PyTuple_GET_ITEM(names, pos))
            : seg_child(seg, SEG_INDEX, pos, NULL);
        for (Py_ssize_t i = 0; i < n; i++)
            w.child[i] = PyTuple_GET_ITEM(snap[i], pos);  /* borrowed from snap */
        PyObject *v = walk_child(&w, 1, &cseg, pos, NULL);
        if (v == NULL)
            goto done;
        PyList_SET_ITEM(items, pos, v);
    }
    res = rebuild_seq(vals[0], kind, items, seg);
done:
    if (snap != NULL)
        for (Py_ssize_t i = 0; i < n; i++)
            Py_XDECREF(snap[i]);
    PyMem_Free(snap);
    walk_end(&w);
    Py_XDECREF(items);
    Py_XDECREF(names);
    return res;
}

/* dataclasses.fields(v0): a tuple (new reference), or NULL. */
static PyObject *dataclass_fields(gather_ctx *g, PyObject *v0)
{
    PyObject *fields = PyObject_CallOneArg(g->st->dataclasses_fields, v0);
    if (fields != NULL && !PyTuple_Check(fields)) {
        PyErr_SetString(PyExc_TypeError, "dataclasses.fields() did not return a tuple");
        Py_CLEAR(fields);
    }
    return fields;
}

/* A dict in out_dims names fields of the dataclass: every key must be one
 * of fields' names. 0 or -1. */
static int check_field_spec(PyObject *spec, const path_seg *sseg, const path_seg *seg,
                            PyObject *fields)
{
    PyObject *fnames = PyTuple_New(PyTuple_GET_SIZE(fields));
    if (fnames == NULL)
        return -1;
    for (Py_ssize_t f = 0; f < PyTuple_GET_SIZE(fields); f++) {
        PyObject *nm = PyObject_GetAttrString(PyTuple_GET_ITEM(fields, f), "name");
        if (nm == NULL) {
            Py_DECREF(fnames);
            return -1;
        }
        PyTuple_SET_ITEM(fnames, f, nm);
    }
    int r = spec_check_children(spec, sseg, seg, 0, NULL, fnames);
    Py_DECREF(fnames);
    return r;
}

/* Each field's gathered value into byname (name: value), in fields'
 * order. 0 or -1. */
static int gather_fields(gather_walk *w, PyObject *fields, PyObject *byname)
{
    for (Py_ssize_t f = 0; f < PyTuple_GET_SIZE(fields); f++) {
        PyObject *name = PyObject_GetAttrString(PyTuple_GET_ITEM(fields, f), "name");
        if (name == NULL)
            return -1;
        path_seg cseg = seg_child(w->seg, SEG_ATTR, 0, name);
        int filled = 1;
        for (Py_ssize_t i = 0; i < w->n && filled; i++)
            filled = (w->child[i] = PyObject_GetAttr(w->vals[i], name)) != NULL;
        PyObject *v = walk_child(w, filled, &cseg, f, name);
        int r = v != NULL ? PyDict_SetItem(byname, name, v) : -1;
        Py_XDECREF(v);
        Py_DECREF(name);
        if (r < 0)
            return -1;
    }
    return 0;
}

/* tp.__new__(tp): an instance of exactly tp, with no __init__ run. */
static PyObject *new_instance(PyTypeObject *tp, const path_seg *seg)
{
    PyObject *newfn = PyObject_GetAttrString((PyObject *)tp, "__new__");
    PyObject *inst = newfn != NULL ? PyObject_CallOneArg(newfn, (PyObject *)tp) : NULL;
    Py_XDECREF(newfn);
    if (inst == NULL || Py_TYPE(inst) != tp) {
        if (inst != NULL)
            PyErr_Format(PyExc_TypeError, "__new__ returned a %.100s",
                         Py_TYPE(inst)->tp_name);
        raise_rebuild_error(seg, tp, "type(out).__new__(type(out)) with its fields set", "");
        Py_CLEAR(inst);
    }
    return inst;
}

/* A dataclass that is a dict: replica 0's keys (in the order its keys()
 * gives), each set to the gathered field of that name through the class's
 * own item assignment, which an OrderedDict (Hugging Face's ModelOutput)
 * needs to keep its order. 0 or -1 (TypeError for a key that is no field). */
static int set_dataclass_keys(PyObject *inst, PyObject *v0, PyObject *byname,
                              const path_seg *seg)
{
    PyObject *keys = PyMapping_Keys(v0);
    if (keys == NULL)
        return -1;
    int r = 0;
    for (Py_ssize_t q = 0; r == 0 && q < PyList_GET_SIZE(keys); q++) {
        PyObject *key = PyList_GET_ITEM(keys, q);
        PyObject *v = PyDict_GetItemWithError(byname, key);
        if (v != NULL) {
            r = PyObject_SetItem(inst, key, v);
            continue;
        }
        r = -1;
        if (PyErr_Occurred())
            break;
        PyObject *path = path_str(seg), *kr = path != NULL ? path_key_repr(key) : NULL;
        if (path != NULL && kr != NULL)
            PyErr_Format(PyExc_TypeError,
                         "%U: replica 0 returned a %.100s (a dataclass and a "
                         "dict) with the key %U, which is not one of its "
                         "fields", path, Py_TYPE(v0)->tp_name, kr);
        Py_XDECREF(path);
        Py_XDECREF(kr);
    }
    Py_DECREF(keys);
    return r;
}

/* Dataclass instances: field by field (dataclasses.fields, init=False
 * fields included), into a new instance made as copy.copy makes one,
 * cls.__new__(cls), with each field set by object.__setattr__. __init__ and
 * __post_init__ do not run again: they ran in the replicas, and running
 * them on gathered values would redo their work (a scaling applied twice);
 * frozen dataclasses and __slots__ work the same way. A dataclass that is
 * also a dict (Hugging Face's ModelOutput) gets replica 0's keys, each with
 * the gathered value of the field of that name (docs/spec.md 11.4). */
static PyObject *gather_dataclass(gather_ctx *g, PyObject *const *vals, Py_ssize_t n,
                           const path_seg *seg, PyObject *spec,
                           const path_seg *sseg)
{
    PyObject *byname = NULL, *inst = NULL, *res = NULL;
    gather_walk w = {0};

    PyObject *fields = dataclass_fields(g, vals[0]);
    if (fields == NULL)
        return NULL;
    if (spec != NULL && PyDict_Check(spec) && check_field_spec(spec, sseg, seg, fields) < 0)
        goto done;
    byname = PyDict_New();
    if (byname == NULL || walk_begin(&w, g, vals, n, seg, spec, sseg, 1) < 0 ||
        gather_fields(&w, fields, byname) < 0)
        goto done;
    inst = new_instance(Py_TYPE(vals[0]), seg);
    if (inst == NULL)
        goto done;
    Py_ssize_t pos = 0;
    PyObject *name, *v;
    while (PyDict_Next(byname, &pos, &name, &v))
        if (PyObject_GenericSetAttr(inst, name, v) < 0)
            goto done;
    if (PyDict_Check(inst) && set_dataclass_keys(inst, vals[0], byname, seg) < 0)
        goto done;
    res = Py_NewRef(inst);
done:
    walk_end(&w);
    Py_DECREF(fields);
    Py_XDECREF(byname);
    Py_XDECREF(inst);
    return res;
}

/* ------------------------------------------------------------------ */
/* Gather                                                              */
/* ------------------------------------------------------------------ */

/* For "every replica must return %s here, as replica 0 does". */
static const char *const gather_kind_names[] = {
    "an array", "None", "a dict", "a namedtuple",
    "a dataclass instance (of one class)", "a list or tuple",
    "a str, bytes or number", "an object that is not an array or container"};

/* One of G_*, or -1 with an exception set. */
static int gather_kind(dp_state *st, PyObject *o)
{
    if (o == Py_None)
        return G_NONE;
    if (PyArray_CheckExact(o))
        return G_ARRAY;   /* the usual leaf, first */
    if (PyList_CheckExact(o) || PyTuple_CheckExact(o))
        return G_SEQ;
    if (PyDict_CheckExact(o))
        return G_DICT;
    if (PyUnicode_CheckExact(o) || PyLong_CheckExact(o) || PyFloat_CheckExact(o) ||
        PyBool_Check(o) || PyBytes_CheckExact(o))
        return G_VALUE;
    int r = dp_is_array_leaf(st, o);
    if (r < 0)
        return -1;
    /* A NumPy scalar (what x.mean() returns) is NumPy's 0-dim value, the
     * counterpart of a 0-dim tensor loss: gathered like a 0-dim array. */
    if (r || PyArray_IsScalar(o, Generic))
        return G_ARRAY;
    /* Before dict: a dataclass that is also a dict (e.g. Hugging Face's
     * ModelOutput) is rebuilt from its fields. */
    r = is_dataclass_instance(o);
    if (r < 0)
        return -1;
    if (r)
        return G_DATACLASS;
    if (PyDict_Check(o))
        return G_DICT;
    if (PyTuple_Check(o)) {
        r = is_namedtuple(o);
        if (r < 0 || (r && refuse_unsplittable(o, NULL, "gathered") < 0))
            return -1;
        return r ? G_NAMEDTUPLE : G_SEQ;
    }
    if (PyList_Check(o))
        return G_SEQ;
    if (PyLong_Check(o) || PyFloat_Check(o) || PyComplex_Check(o) ||
        PyUnicode_Check(o) || PyBytes_Check(o))
        return G_VALUE;
    return G_OTHER;
}


/* ", ".join of one item per value, for error messages: type(x).__name__
 * ("ndarray, NoneType"), repr(x) (cut at 80 characters), x.ndim for
 * arrays, or len(x) for tuples. */
static PyObject *join_each(PyObject *const *vals, Py_ssize_t n, int show)
{
    PyObject *list = PyList_New(0), *res = NULL;
    if (list == NULL)
        return NULL;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *item;
        switch (show) {
        case SHOW_TYPE:
            item = PyObject_GetAttrString((PyObject *)Py_TYPE(vals[i]), "__name__");
            break;
        case SHOW_REPR:
            item = PyUnicode_FromFormat("%.80R", vals[i]);
            break;
        case SHOW_NDIM:
            item = PyUnicode_FromFormat("%d", PyArray_NDIM((PyArrayObject *)vals[i]));
            break;
        case SHOW_DTYPE:
            item = PyObject_Str((PyObject *)PyArray_DESCR((PyArrayObject *)vals[i]));
            break;
        default: /* SHOW_LEN */
            item = PyUnicode_FromFormat("%zd", PyTuple_GET_SIZE(vals[i]));
            break;
        }
        if (append_steal(list, item) < 0)
            goto done;
    }
    res = join_str(", ", list);
done:
    Py_DECREF(list);
    return res;
}

/* gather_kind failed (probing a value for the array protocols raised):
 * name the position. Returns -1. */
static int kind_error_at(gather_ctx *g, const path_seg *seg)
{
    PyObject *path = path_str(seg);
    dp_reraise_at(g->st, path);
    Py_XDECREF(path);
    return -1;
}

/* Every replica must return the same kind of value at this position (for a
 * dataclass, the same class; docs/spec.md 11.1). Two mixes are allowed, as one kind:
 * namedtuples with plain tuples or lists (replica 0's type is rebuilt, as
 * PyTorch does), and NumPy scalars or 0-dim ndarrays with Python numbers
 * (np.float64(1.0) or np.array(1.0), and 1.0: all gathered as 0-dim arrays,
 * the NumPy scalar rule). Returns the
 * kind to gather with, or -1. */
static int check_kinds(gather_ctx *g, PyObject *const *vals, Py_ssize_t n,
                       int kind0, const path_seg *seg)
{
    int kind = kind0;
    for (Py_ssize_t i = 1; i < n; i++) {
        int ki = gather_kind(g->st, vals[i]);
        if (ki < 0)
            return kind_error_at(g, seg);
        if (ki == kind0 && (kind0 != G_DATACLASS || Py_TYPE(vals[i]) == Py_TYPE(vals[0])))
            continue;
        if ((kind0 == G_SEQ || kind0 == G_NAMEDTUPLE) && (ki == G_SEQ || ki == G_NAMEDTUPLE))
            continue;
        if ((kind0 == G_ARRAY || kind0 == G_VALUE) && (ki == G_ARRAY || ki == G_VALUE)) {
            Py_ssize_t j = 0;
            for (; j < n; j++)
                if (!is_zero_dim_value(vals[j]))
                    break;
            if (j == n) {
                kind = G_ARRAY;
                continue;
            }
        }
        PyObject *path = path_str(seg), *names = join_each(vals, n, SHOW_TYPE);
        if (path != NULL && names != NULL && (kind0 == G_VALUE || kind0 == G_OTHER) &&
            (ki == G_VALUE || ki == G_OTHER))
            /* Fraction(1, 2) and 0.5: both plain values, of different types. */
            PyErr_Format(PyExc_TypeError,
                         "%U: the replicas returned values of different types here "
                         "(types per replica: %U); every replica must return a value "
                         "of one type at one position", path, names);
        else if (path != NULL && names != NULL)
            PyErr_Format(PyExc_TypeError,
                         "%U: every replica must return %s here, as replica 0 "
                         "does, but replica %zd does not (types per replica: %U)",
                         path, gather_kind_names[kind0], i, names);
        Py_XDECREF(path);
        Py_XDECREF(names);
        return -1;
    }
    return kind;
}


/* The gathered value of one position; vals[i] is replica i's value there
 * (borrowed: the caller keeps them alive). spec: the out_dims entry for
 * this position (NULL: g->mode and g->dim, inherited), sseg its path. */
static PyObject *gather_map(gather_ctx *g, PyObject *const *vals, Py_ssize_t n,
                     const path_seg *seg, PyObject *spec, const path_seg *sseg)
{
    if (spec != NULL && !spec_is_container(spec)) {
        /* A leaf entry: it holds for everything under this position. */
        gather_ctx g2 = *g;
        if (spec == Py_None) {
            g2.mode = OUT_SAME;
        }
        else if (PyUnicode_Check(spec)) {
            g2.mode = OUT_SUM;  /* "sum": dp_check_dims_spec allowed nothing else */
        }
        else {
            PyObject *sp = path_str(sseg);
            const char *csp = sp != NULL ? PyUnicode_AsUTF8(sp) : NULL;
            int r = csp != NULL ? dp_int_from_object(spec, csp, &g2.dim) : -1;
            Py_XDECREF(sp);
            if (r < 0)
                return NULL;
            g2.mode = OUT_CAT;
        }
        return gather_map(&g2, vals, n, seg, NULL, sseg);
    }
    int kind = gather_kind(g->st, vals[0]);
    if (kind < 0) {
        kind_error_at(g, seg);
        return NULL;
    }
    if ((kind = check_kinds(g, vals, n, kind, seg)) < 0)
        return NULL;
    if (spec != NULL) {
        /* A container entry must mirror a container of its kind. */
        int dict_spec = PyDict_Check(spec);
        int fits = dict_spec ? (kind == G_DICT || kind == G_DATACLASS)
                             : (kind == G_SEQ || kind == G_NAMEDTUPLE);
        if (!fits) {
            spec_mismatch(sseg, spec, seg, gather_kind_names[kind], NULL);
            return NULL;
        }
    }
    switch (kind) {
    case G_ARRAY:
        return gather_array_position(g, vals, n, seg);
    case G_NONE:
        Py_RETURN_NONE;
    case G_VALUE:
    case G_OTHER:
        if (g->mode == OUT_SAME)
            return gather_equal_values(g, vals, n, seg);
        if (g->mode == OUT_SUM)
            return gather_sum_values(g, vals, n, seg);
        return kind == G_VALUE ? gather_value(g, vals, n, seg) : gather_same(g, vals, n, seg);
    default:
        break;
    }
    if (check_depth(seg, "outputs") < 0 || Py_EnterRecursiveCall(" while gathering outputs"))
        return NULL;
    PyObject *res, *fast = NULL;
    if (spec != NULL && !PyDict_Check(spec)) {
        fast = PySequence_Fast(spec, "out_dims");
        if (fast == NULL) {
            Py_LeaveRecursiveCall();
            return NULL;
        }
        spec = fast;
    }
    if (kind == G_DICT)
        res = gather_dict(g, vals, n, seg, spec, sseg);
    else if (kind == G_DATACLASS)
        res = gather_dataclass(g, vals, n, seg, spec, sseg);
    else
        res = gather_seq(g, vals, n, kind, seg, spec, sseg);
    Py_XDECREF(fast);
    Py_LeaveRecursiveCall();
    return res;
}

PyObject *dp_gather_outputs(dp_state *st, PyObject *outputs, dp_device target,
                            int dim)
{
    return dp_gather_outputs_ex(st, outputs, target, dim, NULL);
}

static PyObject *dp_gather_outputs_ex_steps(dp_state *st, PyObject *outputs, dp_device target,
                                            int dim, PyObject *out_dims)
{
    if (!PyList_Check(outputs) && !PyTuple_Check(outputs)) {
        if (dp_check_dims_spec(out_dims == Py_None ? NULL : out_dims, "out_dims", 1) < 0)
            return NULL;
        PyErr_Format(PyExc_TypeError,
                     "outputs: expected a list or tuple with one entry per replica, "
                     "got %.100s", Py_TYPE(outputs)->tp_name);
        return NULL;
    }
    /* The call's own copy: gather runs user code (__eq__, constructors). */
    PyObject *spec = NULL;
    if (dims_take(out_dims, "out_dims", 1, &spec) < 0)
        return NULL;
    PyObject *snap = seq_snapshot(outputs);
    if (snap == NULL) {
        Py_XDECREF(spec);
        return NULL;
    }
    PyObject *res = NULL;
    Py_ssize_t n = PyTuple_GET_SIZE(snap);
    if (n == 0) {
        PyErr_Format(PyExc_ValueError,
                     "outputs: expected at least one replica output, got an empty %.100s",
                     Py_TYPE(outputs)->tp_name);
    }
    else {
        dp_slab slab = {0};
        gather_ctx g = {st, target, dim, OUT_CAT, &slab};
        path_seg root = seg_root("out"), sroot = seg_root("out_dims");
        res = gather_map(&g, &PyTuple_GET_ITEM(snap, 0), n, &root, spec, &sroot);
        dp_slab_clear(&slab);
    }
    Py_DECREF(snap);
    Py_XDECREF(spec);
    return res;
}

/* dp_gather_outputs_ex under dpmini.profile(): one span around it (profile.h). */
PyObject *dp_gather_outputs_ex(dp_state *st, PyObject *outputs, dp_device target,
                               int dim, PyObject *out_dims)
{
    dp_prof_span sp;
    dp_prof_begin(&sp, DP_PROF_GATHER);
    PyObject *res = dp_gather_outputs_ex_steps(st, outputs, target, dim, out_dims);
    dp_prof_end(&sp, NULL);
    return res;
}

/* ------------------------------------------------------------------ */
/* Python functions                                                    */
/* ------------------------------------------------------------------ */

PyDoc_STRVAR(gather_doc,
"gather($module, outputs, target_device, dim=0, out_dims=None)\n"
"--\n"
"\n"
"Combine the replicas' outputs onto target_device, as\n"
"torch.nn.parallel.gather (docs/spec.md 4) with dpmini's checks (docs/design.md).\n"
"\n"
"outputs: a list or tuple with one output per replica (at least one).\n"
"target_device: a device, or the host (\"cpu\" or -1; -1 warns FutureWarning\n"
"  as PyTorch does).\n"
"dim: the axis to concatenate along, wrapped against each array's rank.\n"
"out_dims: None (the rules below along dim, PyTorch), or a structure that\n"
"  mirrors replica 0's output (JAX pmap's out_axes): an int gathers along\n"
"  that dim; None returns replica 0's value (arrays copied to target_device)\n"
"  after checking that every replica returned an equal one (numpy\n"
"  array_equal for arrays: same shape and values, NaN equal to NaN and NaT\n"
"  to NaT; GPU\n"
"  arrays compared through host copies), TypeError naming the path\n"
"  otherwise; a top-level None is the default, so wrap a bare array\n"
"  output in a tuple and give (None,) to compare it; \"sum\" adds the replicas' values: arrays (same shape)\n"
"  with comm.reduce_add onto target_device, in replica order, in replica\n"
"  0's dtype; numbers with +; None stays None; str/bytes are refused. A\n"
"  tuple/list mirrors a list/tuple/namedtuple by position (a prefix), a dict\n"
"  mirrors a dict by key or a dataclass by field name (a subset); what it\n"
"  leaves out uses dim. An int, None or \"sum\" given for a container\n"
"  applies to every leaf under it.\n"
"\n"
"outputs[0] picks the rule at each position and every replica is checked:\n"
"  ndarray (or NumPy scalar, taken as a 0-dim array): concatenated along\n"
"    dim onto target_device in replica 0's dtype; the others are cast only\n"
"    within a kind (NumPy's same_kind: float64 -> float32, int -> float),\n"
"    never real with complex (either order), float into int, int into bool,\n"
"    or strings into shorter ones; other sizes must match (docs/spec.md 4.6). When\n"
"    every replica returns a 0-dim array and dim == 0, the result is a\n"
"    vector of one value per replica, with PyTorch's UserWarning (docs/spec.md 4.5,\n"
"    11.8). NumPy scalars and 0-dim ndarrays mixed with Python numbers\n"
"    (np.float64(1.0) or np.array(1.0), and 1.0) are all taken as 0-dim\n"
"    arrays.\n"
"  None: None.  dict: key by key, replica 0's key order; a dict subclass\n"
"  (OrderedDict, Counter, defaultdict, ...) is copy.copy(replica 0's) with\n"
"  the gathered values set, so it keeps its type, keys and default_factory\n"
"  (docs/spec.md 11.2).  namedtuple: field by field, type(out)._make; a namedtuple at one\n"
"  replica and a plain tuple or list at another give replica 0's type, as\n"
"  in PyTorch.  dataclass: field by field, set on type(out).__new__(type(out))\n"
"  with object.__setattr__: __init__/__post_init__ do not run again (frozen\n"
"  ones too; a dataclass that is a dict also gets replica 0's keys) (docs/spec.md 11.4).\n"
"  list/tuple: position by position (docs/spec.md 11.5).  str, bytes, Python numbers: the\n"
"  value, once, when all replicas return an equal value.  Any other object:\n"
"  that object, when all replicas return the same one or equal values of\n"
"  one type hashed by value (Fraction, Decimal, date, frozenset).\n"
"\n"
"Raises (messages name the position, e.g. out['logits'][1] or out.loss)\n"
"  TypeError: replicas returned different kinds of value at one position\n"
"    (the type from each replica is listed, docs/spec.md 11.1), different str/number\n"
"    values, or different other objects; arrays whose dtypes cannot be\n"
"    gathered without losing data (each replica's dtype is listed); outputs\n"
"    not a list or tuple.\n"
"  RecursionError: outputs (or out_dims) nested more than 512 levels deep.\n"
"  ValueError: dicts with different numbers of keys (\"All dicts must have\n"
"    the same number of keys\") or a missing key, sequences of different\n"
"    lengths, 0-dim arrays with dim != 0, array shapes that differ outside\n"
"    dim (docs/spec.md 4.6), no outputs.\n"
"  IndexError: dim out of range.");

static PyObject *py_gather_once(PyObject *module, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"outputs", "target_device", "dim", "out_dims", NULL};
    PyObject *outputs, *target_obj, *dimobj = NULL, *out_dims = Py_None;
    dp_device target;
    int dim;

    if (!PyArg_ParseTupleAndKeywords(args, kwds, "OO|O$O:gather", kwlist, &outputs,
                                     &target_obj, &dimobj, &out_dims))
        return NULL;
    dp_state *st = dp_state_from_module(module);
    if (parse_dim(dimobj, &dim) < 0)
        return NULL;
    if (dp_device_from_object(st, target_obj, "target_device", DP_DEV_ALLOW_HOST,
                              &target) < 0)
        return NULL;
    /* docs/spec.md 4.3: -1 for the host still works but is deprecated. */
    /* (an int that named the host is -1, NumPy integers included) */
    if (dp_is_index_like(target_obj) && target.kind == DP_HOST &&
        PyErr_WarnEx(PyExc_FutureWarning,
                     "Using -1 to represent CPU tensor is deprecated. Please use "
                     "a device object or string instead, e.g., \"cpu\".", 1) < 0)
        return NULL;
    return dp_gather_outputs_ex(st, outputs, target, dim, out_dims);
}

/* The call; with a torch tensor that requires grad (grad mode on), its
 * differentiable form dpmini._torch.gather. */
static PyObject *py_gather(PyObject *module, PyObject *args, PyObject *kwds)
{
    return dp_call_with_retry(module, args, kwds, py_gather_once, "gather", NULL);
}


PyMethodDef dp_gather_methods[] = {
    {"gather", (PyCFunction)(void (*)(void))py_gather,
     METH_VARARGS | METH_KEYWORDS, gather_doc},
    {NULL, NULL, 0, NULL}
};
