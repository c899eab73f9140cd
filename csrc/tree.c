/* tree.c - scatter and gather of nested Python structures.
 *
 * DataParallel's scatter_kwargs and gather (spec §2.3-2.8, §3, §4) with the
 * decisions of docs/design.md, plus the Python functions dpmini.scatter,
 * dpmini.scatter_kwargs, dpmini.gather and dpmini._plan (for dpmini.explain).
 *
 * Scatter runs in four passes, so that every check happens before the first
 * copy and every array goes out in a single dp_scatter_run:
 *   (a) collect: walk inputs and kwargs; record each array leaf with its path
 *       ("args[1]['img']"), its wrapped dim and its chunk sizes (plan.c);
 *   (b) decide:  k = the smallest chunk count over all leaves, or the number
 *       of devices when there is none; different counts warn SplitWarning,
 *       or raise ValueError under strict=True;
 *   (c) copy:    one dp_scatter_run for all leaves, k chunks each (comm.c);
 *   (d) build:   walk the structures again and make k per-replica copies,
 *       chunk j of each leaf going into replica j.
 * Passes (a) and (d) must visit the leaves in the same order; (d) checks
 * that by identity and fails if user code changed the inputs in between.
 * _plan runs passes (a) and (b) only and describes the outcome as a dict.
 *
 * in_dims (JAX pmap's in_axes as the model) is walked alongside the inputs
 * in pass (a): it decides, per array leaf, the dim to split along or None
 * (broadcast: the whole array to every replica, copied in pass (c) with
 * dp_broadcast_coalesced). chunk_sizes / weights replace the torch.chunk
 * sizes of every split leaf (plan.c). Pass (d) needs none of it: every
 * array leaf has its k pieces ready, split or broadcast.
 *
 * Gather walks the replicas' outputs side by side: outputs[0] picks the rule
 * (as in PyTorch) but every replica is checked against it, and array
 * positions are concatenated with dp_gather_arrays.
 *
 * Paths in messages are built lazily from a chain of path_seg structs on the
 * C stack, so only array leaves (and errors) pay for formatting them.
 *
 * Sections: paths and helpers; scatter; gather; plan; Python functions.
 */
#include "dpmini.h"

#include <limits.h>
#include <math.h>
#include <stdarg.h>

/* ------------------------------------------------------------------ */
/* Paths and helpers                                                   */
/* ------------------------------------------------------------------ */

typedef enum { SEG_ROOT, SEG_INDEX, SEG_KEY, SEG_ATTR } seg_kind;

/* One step of a path such as kwargs['batch'][2] or out.logits. */
typedef struct path_seg {
    const struct path_seg *up;  /* the parent; NULL only for SEG_ROOT      */
    seg_kind kind;
    const char *root;           /* SEG_ROOT: "args", "kwargs", "inputs", "out" */
    Py_ssize_t index;           /* SEG_INDEX: position in a tuple or list  */
    PyObject *name;             /* SEG_KEY: the dict key, shown with repr;
                                   SEG_ATTR: the field name (a str).
                                   Borrowed: the walker holds a reference. */
} path_seg;

static path_seg seg_root(const char *root)
{
    path_seg s = {NULL, SEG_ROOT, root, 0, NULL};
    return s;
}

static path_seg seg_child(const path_seg *up, seg_kind kind, Py_ssize_t index,
                          PyObject *name)
{
    path_seg s = {up, kind, NULL, index, name};
    return s;
}

/* The path as a new str. */
static PyObject *path_str(const path_seg *seg)
{
    if (seg->kind == SEG_ROOT)
        return PyUnicode_FromString(seg->root);
    PyObject *up = path_str(seg->up);
    if (up == NULL)
        return NULL;
    PyObject *res;
    switch (seg->kind) {
    case SEG_INDEX:
        res = PyUnicode_FromFormat("%U[%zd]", up, seg->index);
        break;
    case SEG_KEY:
        res = PyUnicode_FromFormat("%U[%R]", up, seg->name);
        break;
    default: /* SEG_ATTR */
        res = PyUnicode_Check(seg->name)
                  ? PyUnicode_FromFormat("%U.%U", up, seg->name)
                  : PyUnicode_FromFormat("%U.%S", up, seg->name);
        break;
    }
    Py_DECREF(up);
    return res;
}

/* Take the pending exception (normalized instance, new reference; NULL when
 * none is set) and clear it. */
static PyObject *take_exception(void)
{
#if PY_VERSION_HEX >= 0x030C0000
    return PyErr_GetRaisedException();
#else
    PyObject *type, *value, *tb;
    PyErr_Fetch(&type, &value, &tb);
    if (type == NULL)
        return NULL;
    PyErr_NormalizeException(&type, &value, &tb);
    if (value != NULL && tb != NULL)
        PyException_SetTraceback(value, tb);
    Py_XDECREF(type);
    Py_XDECREF(tb);
    return value;
#endif
}

/* Make `cause` (stolen; may be NULL) the __cause__ of the pending exception. */
static void attach_cause(PyObject *cause)
{
    if (cause == NULL)
        return;
    if (!PyErr_Occurred()) {
        Py_DECREF(cause);
        return;
    }
#if PY_VERSION_HEX >= 0x030C0000
    PyObject *exc = PyErr_GetRaisedException();
    PyException_SetCause(exc, Py_NewRef(cause));
    PyException_SetContext(exc, cause);
    PyErr_SetRaisedException(exc);
#else
    PyObject *type, *value, *tb;
    PyErr_Fetch(&type, &value, &tb);
    PyErr_NormalizeException(&type, &value, &tb);
    if (value != NULL) {
        PyException_SetCause(value, Py_NewRef(cause));
        PyException_SetContext(value, cause);
    }
    else {
        Py_DECREF(cause);
    }
    PyErr_Restore(type, value, tb);
#endif
}

/* Turn the pending exception of a failed constructor call into a TypeError
 * "<path>: cannot rebuild <type> as <how> (<Error>: <message>)<hint>",
 * chained to the original. */
static void raise_rebuild_error(const path_seg *seg, PyTypeObject *tp,
                                const char *how, const char *hint)
{
    PyObject *cause = take_exception();
    PyObject *path = path_str(seg);
    if (path != NULL) {
        if (cause != NULL)
            PyErr_Format(PyExc_TypeError,
                         "%U: cannot rebuild %s as %s for each replica (%s: %S)%s",
                         path, tp->tp_name, how, Py_TYPE(cause)->tp_name, cause,
                         hint);
        else
            PyErr_Format(PyExc_TypeError,
                         "%U: cannot rebuild %s as %s for each replica%s",
                         path, tp->tp_name, how, hint);
        Py_DECREF(path);
    }
    attach_cause(cause);
}

/* hasattr(obj, name) that lets errors other than AttributeError through:
 * 1, 0, or -1 with an exception set. */
static int has_attr(PyObject *obj, const char *name)
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

/* A namedtuple: a tuple subclass with `_fields` and `_asdict` (the test of
 * scatter_gather.py). 1, 0 or -1. */
static int is_namedtuple(PyObject *obj)
{
    if (!PyTuple_Check(obj) || PyTuple_CheckExact(obj))
        return 0;
    int r = has_attr(obj, "_asdict");
    if (r <= 0)
        return r;
    return has_attr(obj, "_fields");
}

/* An instance (not a class) of a dataclass. 1, 0 or -1. */
static int is_dataclass_instance(PyObject *obj)
{
    if (PyType_Check(obj))
        return 0;
    return has_attr((PyObject *)Py_TYPE(obj), "__dataclass_fields__");
}

/* type(obj)._fields when it is a tuple of n str (for paths like args[0].a),
 * else NULL with no exception set: paths then fall back to [i]. */
static PyObject *namedtuple_names(PyObject *obj, Py_ssize_t n)
{
    PyObject *names = PyObject_GetAttrString((PyObject *)Py_TYPE(obj), "_fields");
    if (names == NULL) {
        PyErr_Clear();
        return NULL;
    }
    if (!PyTuple_Check(names) || PyTuple_GET_SIZE(names) != n)
        goto no;
    for (Py_ssize_t i = 0; i < n; i++)
        if (!PyUnicode_Check(PyTuple_GET_ITEM(names, i)))
            goto no;
    return names;
no:
    Py_DECREF(names);
    return NULL;
}

/* A snapshot of a tuple's or list's items as a tuple (new reference), so
 * that user code run during a walk cannot resize what is being walked. */
static PyObject *seq_snapshot(PyObject *seq)
{
    if (PyList_Check(seq))
        return PyList_AsTuple(seq);
    return Py_NewRef(seq);
}

/* A dict's items as a list of (key, value) 2-tuples; dict subclasses go
 * through their items() (as `obj.items()` in PyTorch), so an OrderedDict
 * keeps its own order. */
static PyObject *dict_pairs(PyObject *d)
{
    PyObject *items = PyMapping_Items(d);
    if (items == NULL)
        return NULL;
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(items); i++) {
        PyObject *p = PyList_GET_ITEM(items, i);
        if (!PyTuple_Check(p) || PyTuple_GET_SIZE(p) != 2) {
            PyErr_Format(PyExc_TypeError,
                         "%.100s.items() must give (key, value) pairs, got %.100s",
                         Py_TYPE(d)->tp_name, Py_TYPE(p)->tp_name);
            Py_DECREF(items);
            return NULL;
        }
    }
    return items;
}

/* sep.join(list); the list holds str. */
static PyObject *join_str(const char *sep, PyObject *list)
{
    PyObject *s = PyUnicode_FromString(sep);
    if (s == NULL)
        return NULL;
    PyObject *res = PyUnicode_Join(s, list);
    Py_DECREF(s);
    return res;
}

/* Append a new str to list, stealing it (NULL: an error is already set). */
static int append_steal(PyObject *list, PyObject *item)
{
    if (item == NULL)
        return -1;
    int r = PyList_Append(list, item);
    Py_DECREF(item);
    return r;
}

/* "(5, 3)" for an array's shape. */
static PyObject *shape_repr(PyArrayObject *a)
{
    PyObject *t = PyArray_IntTupleFromIntp(PyArray_NDIM(a), PyArray_DIMS(a));
    if (t == NULL)
        return NULL;
    PyObject *r = PyObject_Repr(t);
    Py_DECREF(t);
    return r;
}

/* Is the pending exception a caller mistake that _plan reports as text? */
static int is_caller_error(void)
{
    return PyErr_ExceptionMatches(PyExc_ValueError) ||
           PyErr_ExceptionMatches(PyExc_IndexError) ||
           PyErr_ExceptionMatches(PyExc_TypeError) ||
           PyErr_ExceptionMatches(PyExc_BufferError);
}

/* Raise exc with "<path of seg>: <fmt...>" (the path is usually that of an
 * in_dims / out_dims entry). Always returns -1. */
static int raise_at(PyObject *exc, const path_seg *seg, const char *fmt, ...)
{
    va_list va;
    va_start(va, fmt);
    PyObject *msg = PyUnicode_FromFormatV(fmt, va);
    va_end(va);
    PyObject *path = msg != NULL ? path_str(seg) : NULL;
    if (path != NULL)
        PyErr_Format(exc, "%U: %U", path, msg);
    Py_XDECREF(path);
    Py_XDECREF(msg);
    return -1;
}

/* Is spec a container entry of in_dims / out_dims (tuple, list or dict)? */
static int spec_is_container(PyObject *spec)
{
    return spec != NULL && (PyTuple_Check(spec) || PyList_Check(spec) || PyDict_Check(spec));
}

/* The entry of a container spec for child i (key: the child's dict key or
 * field name, NULL for positions), borrowed, or NULL when the spec does not
 * list it (the child then uses the default). *sseg becomes its path. A
 * leaf spec (NULL, int, None, "sum") applies to every child: returned as is
 * with *sseg = *up. -1 only on an error from a dict lookup. */
static int spec_child(PyObject *spec, const path_seg *up, Py_ssize_t i, PyObject *key,
                      PyObject **child, path_seg *sseg)
{
    *child = NULL;
    *sseg = *up;
    if (!spec_is_container(spec)) {
        *child = spec;
        return 0;
    }
    if (PyDict_Check(spec)) {
        if (key == NULL)
            return 0;
        *sseg = seg_child(up, SEG_KEY, 0, key);
        *child = PyDict_GetItemWithError(spec, key);
        return *child == NULL && PyErr_Occurred() ? -1 : 0;
    }
    *sseg = seg_child(up, SEG_INDEX, i, NULL);
    Py_ssize_t len = PySequence_Fast_GET_SIZE(spec);
    if (i < len)
        *child = PySequence_Fast_GET_ITEM(spec, i);
    return 0;
}

/* A short description of a spec container: "a tuple of 3 entries". */
static PyObject *spec_what(PyObject *spec)
{
    return PyUnicode_FromFormat("a %.50s of %zd entr%s", Py_TYPE(spec)->tp_name,
                                PyObject_Length(spec),
                                PyObject_Length(spec) == 1 ? "y" : "ies");
}

/* A container spec at a position that is not a container of the matching
 * kind: TypeError naming both paths. what: how the value is described. */
static int spec_mismatch(const path_seg *sseg, PyObject *spec, const path_seg *seg,
                         const char *what)
{
    PyObject *vp = path_str(seg), *sw = vp != NULL ? spec_what(spec) : NULL;
    if (sw != NULL)
        raise_at(PyExc_TypeError, sseg,
                 "%U mirrors the children of %U, but %U is %s; give an int or None "
                 "for it instead", sw, vp, vp, what);
    Py_XDECREF(vp);
    Py_XDECREF(sw);
    return -1;
}

/* Check that a container spec addresses only children that exist: a
 * tuple/list (a PySequence_Fast) at most n entries, a dict only keys of
 * `keys_of` (a dict; NULL: names in `names`, a tuple of str, e.g. dataclass
 * fields). ValueError naming the first entry that addresses nothing. */
static int spec_check_children(PyObject *spec, const path_seg *sseg, const path_seg *seg,
                               Py_ssize_t n, PyObject *keys_of, PyObject *names)
{
    if (!PyDict_Check(spec)) {
        Py_ssize_t len = PySequence_Fast_GET_SIZE(spec);
        if (len <= n)
            return 0;
        PyObject *vp = path_str(seg);
        if (vp != NULL)
            raise_at(PyExc_ValueError, sseg,
                     "has %zd entries, but %U has only %zd (entries past the end "
                     "address nothing)", len, vp, n);
        Py_XDECREF(vp);
        return -1;
    }
    Py_ssize_t pos = 0;
    PyObject *key, *value;
    while (PyDict_Next(spec, &pos, &key, &value)) {
        int has;
        if (keys_of != NULL) {
            has = PyDict_Contains(keys_of, key);
        }
        else {
            has = 0;
            for (Py_ssize_t i = 0; names != NULL && i < PyTuple_GET_SIZE(names) && !has; i++) {
                has = PyObject_RichCompareBool(PyTuple_GET_ITEM(names, i), key, Py_EQ);
                if (has < 0)
                    return -1;
            }
        }
        if (has < 0)
            return -1;
        if (has)
            continue;
        path_seg kseg = seg_child(sseg, SEG_KEY, 0, key);
        PyObject *vp = path_str(seg);
        if (vp != NULL)
            raise_at(PyExc_ValueError, &kseg, "%U has no key %R (a dict in in_dims or "
                     "out_dims may name only keys that exist)", vp, key);
        Py_XDECREF(vp);
        return -1;
    }
    return 0;
}

/* ------------------------------------------------------------------ */
/* Scatter                                                             */
/* ------------------------------------------------------------------ */

/* What the scatter rules (spec 3.1) do with an object. */
enum {
    S_SHARED,      /* every replica gets the same object                  */
    S_ARRAY,       /* split into chunks                                   */
    S_TUPLE,       /* non-empty tuple: one plain tuple per replica        */
    S_LIST,        /* non-empty list: one list per replica                */
    S_NAMEDTUPLE,  /* non-empty namedtuple: type(obj)(*fields) per replica */
    S_DICT         /* non-empty dict: type(obj)(pairs) per replica        */
};

/* One array leaf found by pass (a). */
typedef struct {
    PyObject *obj;        /* the leaf as found in the structure (strong)   */
    PyArrayObject *arr;   /* dp_as_array(obj): what is split (strong)      */
    PyObject *path;       /* str, e.g. "args[1]['img']"                    */
    int bcast;            /* 1: in_dims None: the whole array goes to every
                             replica (dim, count, sizes unused)            */
    int dim;              /* wrapped against arr's rank: 0 <= dim < ndim   */
    int count;            /* chunks it makes on its own, 1..ndev           */
    int64_t *sizes;       /* ndev chunk sizes along dim (elements, PyMem);
                             entries from `count` on are 0; NULL if bcast  */
} scatter_leaf;

typedef struct {
    dp_state *st;
    const dp_device *devs;    /* borrowed, ndev entries                     */
    int ndev;                 /* 1..DP_MAX_DEVICES                          */
    int dim;                  /* as given; wrapped per leaf                 */
    const int64_t *chunk_sizes;  /* ndev explicit sizes, or NULL (borrowed) */
    const double *weights;    /* ndev weights, or NULL (borrowed)           */
    int plan;                 /* _plan: no copies; record shared paths and
                                 the first caller error instead of raising */
    scatter_leaf *leaves;     /* PyMem, nleaves used of cap                 */
    Py_ssize_t nleaves, cap;
    PyObject *shared;         /* plan only: list of paths of shared leaves  */
    PyObject *error;          /* plan only: first caller error (str) or NULL */
    int k;                    /* replica count, from pass (b)               */
    int mismatch;             /* leaves gave different chunk counts         */
    PyObject **chunks;        /* nleaves * k new references from pass (c);
                                 a slot is NULL once pass (d) took it       */
    Py_ssize_t cursor;        /* pass (d): the next leaf to hand out        */
} scatter_ctx;

static int ctx_init(scatter_ctx *c, dp_state *st, const dp_device *devs,
                    Py_ssize_t ndev, int dim, int plan)
{
    memset(c, 0, sizeof *c);
    if (ndev < 1 || ndev > DP_MAX_DEVICES) {
        PyErr_Format(PyExc_ValueError,
                     "scatter: expected 1 to %d devices, got %zd", DP_MAX_DEVICES, ndev);
        return -1;
    }
    c->st = st;
    c->devs = devs;
    c->ndev = (int)ndev;
    c->dim = dim;
    c->plan = plan;
    c->k = (int)ndev;
    if (plan) {
        c->shared = PyList_New(0);
        if (c->shared == NULL)
            return -1;
    }
    return 0;
}

static void ctx_clear(scatter_ctx *c)
{
    for (Py_ssize_t i = 0; i < c->nleaves; i++) {
        scatter_leaf *lf = &c->leaves[i];
        Py_CLEAR(lf->obj);
        Py_CLEAR(lf->arr);
        Py_CLEAR(lf->path);
        PyMem_Free(lf->sizes);
        lf->sizes = NULL;
    }
    if (c->chunks != NULL) {
        for (Py_ssize_t i = 0; i < c->nleaves * c->k; i++)
            Py_CLEAR(c->chunks[i]);
        PyMem_Free(c->chunks);
        c->chunks = NULL;
    }
    PyMem_Free(c->leaves);
    c->leaves = NULL;
    c->nleaves = c->cap = 0;
    Py_CLEAR(c->shared);
    Py_CLEAR(c->error);
}

/* The rule of spec 3.1 for obj: one of S_*, or -1 with an exception set. */
static int scatter_kind(dp_state *st, PyObject *obj)
{
    if (PyTuple_CheckExact(obj))
        return PyTuple_GET_SIZE(obj) > 0 ? S_TUPLE : S_SHARED;
    if (PyList_CheckExact(obj))
        return PyList_GET_SIZE(obj) > 0 ? S_LIST : S_SHARED;
    if (PyDict_CheckExact(obj))
        return PyDict_GET_SIZE(obj) > 0 ? S_DICT : S_SHARED;
    if (obj == Py_None || PyUnicode_CheckExact(obj) || PyLong_CheckExact(obj) ||
        PyFloat_CheckExact(obj))
        return S_SHARED;
    int r = dp_is_array_leaf(st, obj);
    if (r < 0)
        return -1;
    if (r)
        return S_ARRAY;
    if (PyTuple_Check(obj)) {
        /* An empty namedtuple is shared: PyTorch would zip nothing and make
         * zero replicas. */
        if (PyTuple_GET_SIZE(obj) == 0)
            return S_SHARED;
        r = is_namedtuple(obj);
        if (r < 0)
            return -1;
        return r ? S_NAMEDTUPLE : S_TUPLE;
    }
    if (PyList_Check(obj))
        return PyList_GET_SIZE(obj) > 0 ? S_LIST : S_SHARED;
    if (PyDict_Check(obj))
        return PyDict_GET_SIZE(obj) > 0 ? S_DICT : S_SHARED;
    return S_SHARED;
}

/* The children of a container of kind S_TUPLE/S_LIST/S_NAMEDTUPLE (a tuple
 * snapshot) or S_DICT (a list of pairs), as a new reference. */
static PyObject *container_items(PyObject *obj, int kind)
{
    return kind == S_DICT ? dict_pairs(obj) : seq_snapshot(obj);
}

/* Child i of a container walked through container_items: sets *seg and
 * returns the child (borrowed from items). */
static PyObject *container_child(int kind, PyObject *items, PyObject *names,
                                 Py_ssize_t i, const path_seg *up, path_seg *seg)
{
    if (kind == S_DICT) {
        PyObject *pair = PyList_GET_ITEM(items, i);
        *seg = seg_child(up, SEG_KEY, 0, PyTuple_GET_ITEM(pair, 0));
        return PyTuple_GET_ITEM(pair, 1);
    }
    if (names != NULL)
        *seg = seg_child(up, SEG_ATTR, 0, PyTuple_GET_ITEM(names, i));
    else
        *seg = seg_child(up, SEG_INDEX, i, NULL);
    return PyTuple_GET_ITEM(items, i);
}

static Py_ssize_t items_len(int kind, PyObject *items)
{
    return kind == S_DICT ? PyList_GET_SIZE(items) : PyTuple_GET_SIZE(items);
}

/* Plan mode: keep the first caller error as text and go on; otherwise (or
 * for other errors) leave it pending. Returns 0 when absorbed, else -1. */
static int absorb_error(scatter_ctx *c)
{
    if (!c->plan || !is_caller_error())
        return -1;
    PyObject *exc = take_exception();
    if (exc == NULL)
        return 0;
    if (c->error == NULL) {
        c->error = PyObject_Str(exc);
        if (c->error == NULL) {
            Py_DECREF(exc);
            return -1;
        }
    }
    Py_DECREF(exc);
    return 0;
}

/* "[3, 2, 1]" for n sizes. */
static PyObject *sizes_repr(const int64_t *v, int n)
{
    PyObject *list = PyList_New(n), *res = NULL;
    if (list == NULL)
        return NULL;
    for (int j = 0; j < n; j++) {
        PyObject *x = PyLong_FromLongLong((long long)v[j]);
        if (x == NULL)
            goto done;
        PyList_SET_ITEM(list, j, x);
    }
    res = PyObject_Repr(list);
done:
    Py_DECREF(list);
    return res;
}

/* The sizes of one split leaf of n rows: chunk_sizes, weights or the
 * torch.chunk rule. Returns the chunk count (1..ndev) or -1 with an
 * exception naming the leaf. */
static int leaf_sizes(scatter_ctx *c, PyArrayObject *arr, int wdim, const char *cpath,
                      int64_t *sizes)
{
    int64_t n = (int64_t)PyArray_DIM(arr, wdim);
    int count;
    if (c->chunk_sizes != NULL) {
        /* torch.cuda.comm.scatter's chunk_sizes (spec 0.7, 8.5), for every
         * split leaf: the sizes must add up to each one's length. */
        memcpy(sizes, c->chunk_sizes, (size_t)c->ndev * sizeof(int64_t));
        if (dp_check_chunk_sizes(n, c->ndev, sizes, NULL) != DP_OK) {
            long long sum = 0;
            for (int j = 0; j < c->ndev; j++)
                sum += sizes[j];
            PyObject *sz = sizes_repr(sizes, c->ndev);
            PyObject *shape = sz != NULL ? shape_repr(arr) : NULL;
            if (shape != NULL)
                PyErr_Format(PyExc_ValueError,
                             "%s: chunk_sizes %U sum to %lld, but the array has size "
                             "%lld along dim %d (shape %U); chunk_sizes must sum to the "
                             "size of every split array (give the others in_dims None "
                             "to broadcast them)", cpath, sz, sum, (long long)n, wdim, shape);
            Py_XDECREF(sz);
            Py_XDECREF(shape);
            return -1;
        }
        count = dp_sizes_count(c->ndev, sizes);
    }
    else if (c->weights != NULL) {
        count = dp_weighted_sizes(n, c->ndev, c->weights, sizes, NULL);
    }
    else {
        count = dp_chunk_sizes(n, c->ndev, sizes);
    }
    if (count < 1) {
        PyErr_Format(PyExc_SystemError, "%s: computing the chunk sizes failed (%d)", cpath,
                     count);
        return -1;
    }
    return count;
}

/* Pass (a) for one array leaf. spec: its in_dims entry (NULL: c->dim, an
 * int: that dim, None: broadcast); sseg its path. */
static int collect_leaf(scatter_ctx *c, PyObject *obj, const path_seg *seg,
                        PyObject *spec, const path_seg *sseg)
{
    PyObject *path = NULL;
    PyArrayObject *arr = NULL;
    int64_t *sizes = NULL;
    const char *cpath;
    int wdim = 0, count = 0, dim = c->dim, bcast = spec == Py_None;

    path = path_str(seg);
    if (path == NULL)
        goto fail;
    cpath = PyUnicode_AsUTF8(path);
    if (cpath == NULL)
        goto fail;

    if (spec_is_container(spec)) {
        spec_mismatch(sseg, spec, seg, "an array");
        goto leaf_error;
    }
    if (spec != NULL && spec != Py_None) {
        PyObject *sp = path_str(sseg);
        const char *csp = sp != NULL ? PyUnicode_AsUTF8(sp) : NULL;
        int r = csp != NULL ? dp_int_from_object(spec, csp, &dim) : -1;
        Py_XDECREF(sp);
        if (r < 0)
            goto leaf_error;
    }
    if (bcast) {
        /* in_dims None: the whole array, any rank (0-dim included), to every
         * replica; it takes no part in the replica count. */
        arr = dp_as_array(c->st, obj, cpath, 0);
        if (arr == NULL)
            goto leaf_error;
        goto record;
    }

    /* spec 0.5 / R22: never broadcast a 0-dim array, refuse it up front. */
    if (PyArray_Check(obj) && PyArray_NDIM((PyArrayObject *)obj) == 0) {
        PyErr_Format(PyExc_ValueError,
                     "%s: chunk expects at least a 1-dimensional array (got a "
                     "0-dim array); wrap it in a 1-element array or pass a "
                     "Python number to share it", cpath);
        goto leaf_error;
    }
    arr = dp_as_array(c->st, obj, cpath, 1);
    if (arr == NULL)
        goto leaf_error;
    /* spec 0.6 / R27: a negative dim is wrapped for each array on its own. */
    if (dp_wrap_dim_or_raise(dim, PyArray_NDIM(arr), cpath, &wdim) < 0)
        goto leaf_error;

    sizes = PyMem_Malloc((size_t)c->ndev * sizeof(int64_t));
    if (sizes == NULL) {
        PyErr_NoMemory();
        goto fail;
    }
    count = leaf_sizes(c, arr, wdim, cpath, sizes);
    if (count < 0) {
        PyMem_Free(sizes);
        sizes = NULL;
        goto leaf_error;
    }

record:
    if (c->nleaves == c->cap) {
        Py_ssize_t cap = c->cap ? 2 * c->cap : 8;
        scatter_leaf *lv = PyMem_Realloc(c->leaves, (size_t)cap * sizeof *lv);
        if (lv == NULL) {
            PyErr_NoMemory();
            goto fail;
        }
        c->leaves = lv;
        c->cap = cap;
    }
    scatter_leaf *lf = &c->leaves[c->nleaves++];
    lf->obj = Py_NewRef(obj);
    lf->arr = arr;
    lf->path = path;
    lf->bcast = bcast;
    lf->dim = wdim;
    lf->count = count;
    lf->sizes = sizes;
    return 0;

leaf_error:
    if (absorb_error(c) == 0) {
        Py_XDECREF(arr);
        Py_XDECREF(path);
        return 0;
    }
fail:
    PyMem_Free(sizes);
    Py_XDECREF(arr);
    Py_XDECREF(path);
    return -1;
}

static int collect(scatter_ctx *c, PyObject *obj, const path_seg *seg,
                   PyObject *spec, const path_seg *sseg);

/* Pass (a) for the children of a container of the given kind. spec: its
 * in_dims entry (NULL: the default everywhere below), sseg its path. */
static int collect_container(scatter_ctx *c, PyObject *obj, int kind,
                             const path_seg *seg, PyObject *spec, const path_seg *sseg)
{
    PyObject *items = NULL, *names = NULL, *fast = NULL;
    int rc = -1;

    if (Py_EnterRecursiveCall(" while scattering inputs"))
        return -1;
    items = container_items(obj, kind);
    if (items == NULL)
        goto done;
    Py_ssize_t n = items_len(kind, items);
    if (kind == S_NAMEDTUPLE)
        names = namedtuple_names(obj, n);
    if (spec_is_container(spec)) {
        /* A tuple/list mirrors a tuple, list or namedtuple by position; a
         * dict mirrors a dict by key. */
        int dict_spec = PyDict_Check(spec);
        if (dict_spec != (kind == S_DICT)) {
            spec_mismatch(sseg, spec, seg, kind == S_DICT ? "a dict (give a dict)"
                                                          : "a sequence (give a tuple or list)");
            goto spec_error;
        }
        if (!dict_spec) {
            fast = PySequence_Fast(spec, "in_dims");
            if (fast == NULL)
                goto done;
            spec = fast;
        }
        if (spec_check_children(spec, sseg, seg, n, dict_spec ? obj : NULL, NULL) < 0)
            goto spec_error;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        path_seg cseg, csseg;
        PyObject *cspec;
        PyObject *child = container_child(kind, items, names, i, seg, &cseg);
        PyObject *key = kind == S_DICT ? PyTuple_GET_ITEM(PyList_GET_ITEM(items, i), 0) : NULL;
        if (spec_child(spec, sseg, i, key, &cspec, &csseg) < 0)
            goto done;
        if (collect(c, child, &cseg, cspec, &csseg) < 0)
            goto done;
    }
    rc = 0;
    goto done;
spec_error:
    /* _plan records the mismatch and skips this container. */
    if (absorb_error(c) == 0)
        rc = 0;
done:
    Py_XDECREF(items);
    Py_XDECREF(names);
    Py_XDECREF(fast);
    Py_LeaveRecursiveCall();
    return rc;
}

/* Pass (a): record the array leaves under obj (and, for _plan, the paths of
 * the shared leaves). spec: obj's in_dims entry (NULL: the default). */
static int collect(scatter_ctx *c, PyObject *obj, const path_seg *seg,
                   PyObject *spec, const path_seg *sseg)
{
    int kind = scatter_kind(c->st, obj);
    if (kind < 0)
        return -1;
    if (kind == S_ARRAY)
        return collect_leaf(c, obj, seg, spec, sseg);
    if (kind == S_SHARED) {
        /* Shared values are never split; an int or None for them is fine,
         * but a non-empty structure addresses children that are not there. */
        if (spec_is_container(spec) && PyObject_Length(spec) > 0) {
            spec_mismatch(sseg, spec, seg, "not split (a value shared by every replica)");
            return absorb_error(c);
        }
        return c->plan ? append_steal(c->shared, path_str(seg)) : 0;
    }
    return collect_container(c, obj, kind, seg, spec, sseg);
}

/* Pass (b): the replica count and whether the leaves disagree. */
static void scatter_count(scatter_ctx *c)
{
    c->k = c->ndev;
    c->mismatch = 0;
    int k = c->ndev + 1;
    /* Broadcast leaves (in_dims None) never limit the count. */
    for (Py_ssize_t i = 0; i < c->nleaves; i++)
        if (!c->leaves[i].bcast && c->leaves[i].count < k)
            k = c->leaves[i].count;
    if (k > c->ndev)
        return;  /* no split leaf: every device runs a replica */
    for (Py_ssize_t i = 0; i < c->nleaves; i++)
        if (!c->leaves[i].bcast && c->leaves[i].count != k)
            c->mismatch = 1;
    c->k = k;
}

/* The strict=True error text (modelled on JAX pmap's, R29): every array
 * path, its shape, the dim and the size along it. */
static PyObject *strict_message(scatter_ctx *c)
{
    PyObject *lines = PyList_New(0), *res = NULL;
    if (lines == NULL)
        return NULL;
    if (append_steal(lines, PyUnicode_FromFormat(
            "scatter got arrays that split into different numbers of chunks "
            "over %d devices (strict=True):", c->ndev)) < 0)
        goto done;
    for (Py_ssize_t i = 0; i < c->nleaves; i++) {
        scatter_leaf *lf = &c->leaves[i];
        if (lf->bcast)
            continue;
        PyObject *shape = shape_repr(lf->arr);
        if (shape == NULL)
            goto done;
        PyObject *line = PyUnicode_FromFormat(
            "  %U: shape %U, size %lld along dim %d -> %d chunk%s", lf->path, shape,
            (long long)PyArray_DIM(lf->arr, lf->dim), lf->dim, lf->count,
            lf->count == 1 ? "" : "s");
        Py_DECREF(shape);
        if (append_steal(lines, line) < 0)
            goto done;
    }
    if (append_steal(lines, PyUnicode_FromString(
            "Give every array the same size along dim, or pass strict=False to "
            "use the smallest count as PyTorch does (the rows after it are "
            "then dropped).")) < 0)
        goto done;
    res = join_str("\n", lines);
done:
    Py_DECREF(lines);
    return res;
}

/* "args[0]: 2 chunks, args[1]: 1 chunk": every array path with its count. */
static PyObject *chunk_counts(scatter_ctx *c)
{
    PyObject *parts = PyList_New(0), *res = NULL;
    if (parts == NULL)
        return NULL;
    for (Py_ssize_t i = 0; i < c->nleaves; i++) {
        scatter_leaf *lf = &c->leaves[i];
        if (lf->bcast)
            continue;
        if (append_steal(parts, PyUnicode_FromFormat("%U: %d chunk%s", lf->path,
                                                     lf->count,
                                                     lf->count == 1 ? "" : "s")) < 0)
            goto done;
    }
    res = join_str(", ", parts);
done:
    Py_DECREF(parts);
    return res;
}

/* The SplitWarning text (R06), or *out = NULL when no row is dropped (only
 * 0-row arrays exceed k). */
static int truncation_message(scatter_ctx *c, PyObject **out)
{
    PyObject *parts = PyList_New(0), *body = NULL, *counts = NULL;
    int rc = -1;
    *out = NULL;
    if (parts == NULL)
        return -1;
    for (Py_ssize_t i = 0; i < c->nleaves; i++) {
        scatter_leaf *lf = &c->leaves[i];
        if (lf->bcast || lf->count <= c->k)
            continue;
        int64_t n = (int64_t)PyArray_DIM(lf->arr, lf->dim), kept = 0;
        for (int j = 0; j < c->k; j++)
            kept += lf->sizes[j];
        if (kept >= n)
            continue;
        /* "rows" only along dim 0; "indices" along any other dim. */
        const char *one = lf->dim == 0 ? "row" : "index";
        const char *many = lf->dim == 0 ? "rows" : "indices";
        PyObject *part = kept == n - 1
            ? PyUnicode_FromFormat("%U: %s %lld of %lld along dim %d is dropped",
                                   lf->path, one, (long long)kept, (long long)n, lf->dim)
            : PyUnicode_FromFormat("%U: %s %lld..%lld of %lld along dim %d are dropped",
                                   lf->path, many, (long long)kept, (long long)(n - 1),
                                   (long long)n, lf->dim);
        if (append_steal(parts, part) < 0)
            goto done;
    }
    if (PyList_GET_SIZE(parts) > 0) {
        body = join_str("; ", parts);
        counts = chunk_counts(c);
        if (body == NULL || counts == NULL)
            goto done;
        *out = PyUnicode_FromFormat(
            "scatter got arrays that split into different numbers of chunks over "
            "%d devices (%U), so only %d replica%s (the smallest count, as in "
            "PyTorch): %U. Give every array the same size along dim, or pass "
            "strict=True to raise instead.",
            c->ndev, counts, c->k, c->k == 1 ? " runs" : "s run", body);
        if (*out == NULL)
            goto done;
    }
    rc = 0;
done:
    Py_XDECREF(body);
    Py_XDECREF(counts);
    Py_DECREF(parts);
    return rc;
}

/* Pass (b), checks: strict -> ValueError, else SplitWarning. */
static int scatter_check(scatter_ctx *c, int strict)
{
    if (!c->mismatch)
        return 0;
    if (strict) {
        PyObject *msg = strict_message(c);
        if (msg == NULL)
            return -1;
        PyErr_SetObject(PyExc_ValueError, msg);
        Py_DECREF(msg);
        return -1;
    }
    PyObject *msg;
    if (truncation_message(c, &msg) < 0)
        return -1;
    if (msg == NULL)
        return 0;
    const char *text = PyUnicode_AsUTF8(msg);
    int r = text == NULL ? -1 : PyErr_WarnEx(c->st->SplitWarning, text, 1);
    Py_DECREF(msg);
    return r;
}

/* Pass (c) for the broadcast leaves: the whole array on each of the k
 * replica devices, in one dp_broadcast_coalesced (the array itself where it
 * already lives on that device). */
static int broadcast_copy(scatter_ctx *c, Py_ssize_t nbcast)
{
    PyObject *arrays = PyList_New(nbcast), *per_dev = NULL;
    int rc = -1;
    if (arrays == NULL)
        return -1;
    for (Py_ssize_t i = 0, b = 0; i < c->nleaves; i++)
        if (c->leaves[i].bcast)
            PyList_SET_ITEM(arrays, b++, Py_NewRef((PyObject *)c->leaves[i].arr));
    per_dev = dp_broadcast_coalesced(c->st, arrays, c->devs, c->k, 0);
    if (per_dev == NULL)
        goto done;
    for (Py_ssize_t i = 0, b = 0; i < c->nleaves; i++) {
        if (!c->leaves[i].bcast)
            continue;
        for (int j = 0; j < c->k; j++)
            c->chunks[i * c->k + j] = Py_NewRef(PyList_GET_ITEM(PyList_GET_ITEM(per_dev, j), b));
        b++;
    }
    rc = 0;
done:
    Py_DECREF(arrays);
    Py_XDECREF(per_dev);
    return rc;
}

/* Pass (c): every split leaf's first k chunks, in one dp_scatter_run, and
 * every broadcast leaf's k copies. */
static int scatter_copy(scatter_ctx *c)
{
    if (c->nleaves == 0)
        return 0;
    if (c->nleaves > INT_MAX) {
        PyErr_SetString(PyExc_ValueError, "scatter: too many arrays");
        return -1;
    }
    dp_scatter_item *items = PyMem_Calloc((size_t)c->nleaves, sizeof *items);
    c->chunks = PyMem_Calloc((size_t)c->nleaves * (size_t)c->k, sizeof(PyObject *));
    if (items == NULL || c->chunks == NULL) {
        PyMem_Free(items);
        PyErr_NoMemory();
        return -1;
    }
    int nitems = 0;
    for (Py_ssize_t i = 0; i < c->nleaves; i++) {
        if (c->leaves[i].bcast)
            continue;
        items[nitems].src = c->leaves[i].arr;
        items[nitems].dim = c->leaves[i].dim;
        items[nitems].nchunks = c->k;
        items[nitems].sizes = c->leaves[i].sizes;
        items[nitems].out = c->chunks + i * c->k;
        nitems++;
    }
    int r = nitems > 0 ? dp_scatter_run(c->st, items, nitems, c->devs) : 0;
    PyMem_Free(items);
    if (r == 0 && nitems < c->nleaves)
        r = broadcast_copy(c, c->nleaves - nitems);
    return r;
}

/* Pass (d) for an array leaf: hand out its k chunks. */
static int take_chunks(scatter_ctx *c, PyObject *obj, PyObject **res)
{
    if (c->cursor >= c->nleaves || c->leaves[c->cursor].obj != obj) {
        PyErr_SetString(PyExc_RuntimeError,
                        "scatter: the inputs changed while they were being scattered");
        return -1;
    }
    PyObject **slot = c->chunks + c->cursor * c->k;
    for (int j = 0; j < c->k; j++) {
        res[j] = slot[j];
        slot[j] = NULL;
    }
    c->cursor++;
    return 0;
}

static int build(scatter_ctx *c, PyObject *obj, const path_seg *seg, PyObject **res);

/* Put the k values of child i (tmp, stolen in every case) into the k
 * per-replica containers being built. */
static int place_child(int kind, int exact_dict, PyObject **res, PyObject **tmp,
                       int k, Py_ssize_t i, PyObject *key)
{
    int j = 0, rc = -1;
    for (; j < k; j++) {
        switch (kind) {
        case S_TUPLE:
        case S_NAMEDTUPLE:
            PyTuple_SET_ITEM(res[j], i, tmp[j]);
            break;
        case S_LIST:
            PyList_SET_ITEM(res[j], i, tmp[j]);
            break;
        default: /* S_DICT */
            if (exact_dict) {
                int r = PyDict_SetItem(res[j], key, tmp[j]);
                Py_DECREF(tmp[j]);
                if (r < 0) {
                    j++;
                    goto done;
                }
            }
            else {
                PyObject *pair = PyTuple_Pack(2, key, tmp[j]);
                Py_DECREF(tmp[j]);
                if (pair == NULL) {
                    j++;
                    goto done;
                }
                PyList_SET_ITEM(res[j], i, pair);
            }
            break;
        }
        tmp[j] = NULL;
    }
    rc = 0;
done:
    for (; j < k; j++)
        Py_CLEAR(tmp[j]);
    return rc;
}

/* Pass (d) for a container of the given kind: res[j] = its copy for replica
 * j (new references; all NULL on failure). Tuples, lists and the top-level
 * args come back as plain tuples/lists; namedtuples as type(obj)(*fields);
 * dicts as type(obj)(pairs) (a plain dict is filled directly). */
static int build_container(scatter_ctx *c, PyObject *obj, int kind,
                           const path_seg *seg, PyObject **res)
{
    const int k = c->k;
    PyObject *items = NULL, *names = NULL, **tmp = NULL;
    int exact_dict = kind == S_DICT && PyDict_CheckExact(obj);
    int rc = -1;

    for (int j = 0; j < k; j++)
        res[j] = NULL;
    if (Py_EnterRecursiveCall(" while scattering inputs"))
        return -1;
    items = container_items(obj, kind);
    if (items == NULL)
        goto done;
    Py_ssize_t n = items_len(kind, items);
    if (kind == S_NAMEDTUPLE)
        names = namedtuple_names(obj, n);
    tmp = PyMem_Calloc((size_t)k, sizeof *tmp);
    if (tmp == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    for (int j = 0; j < k; j++) {
        if (kind == S_TUPLE || kind == S_NAMEDTUPLE)
            res[j] = PyTuple_New(n);
        else if (exact_dict)
            res[j] = PyDict_New();
        else /* S_LIST, or the pairs of a dict subclass */
            res[j] = PyList_New(n);
        if (res[j] == NULL)
            goto done;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        path_seg cseg;
        PyObject *child = container_child(kind, items, names, i, seg, &cseg);
        if (build(c, child, &cseg, tmp) < 0)
            goto done;
        PyObject *key = kind == S_DICT ? PyTuple_GET_ITEM(PyList_GET_ITEM(items, i), 0) : NULL;
        if (place_child(kind, exact_dict, res, tmp, k, i, key) < 0)
            goto done;
    }
    if (kind == S_NAMEDTUPLE || (kind == S_DICT && !exact_dict)) {
        for (int j = 0; j < k; j++) {
            PyObject *r = kind == S_NAMEDTUPLE
                ? PyObject_Call((PyObject *)Py_TYPE(obj), res[j], NULL)
                : PyObject_CallOneArg((PyObject *)Py_TYPE(obj), res[j]);
            if (r == NULL) {
                if (kind == S_NAMEDTUPLE)
                    raise_rebuild_error(seg, Py_TYPE(obj), "type(obj)(*fields)", "");
                else
                    raise_rebuild_error(seg, Py_TYPE(obj),
                                        "type(obj)(list of (key, value) pairs)",
                                        "; pass a dict or OrderedDict instead");
                goto done;
            }
            Py_SETREF(res[j], r);
        }
    }
    rc = 0;
done:
    if (rc < 0)
        for (int j = 0; j < k; j++)
            Py_CLEAR(res[j]);
    PyMem_Free(tmp);
    Py_XDECREF(items);
    Py_XDECREF(names);
    Py_LeaveRecursiveCall();
    return rc;
}

/* Pass (d): res[j] = obj as replica j sees it (k new references; all NULL on
 * failure). */
static int build(scatter_ctx *c, PyObject *obj, const path_seg *seg, PyObject **res)
{
    int kind = scatter_kind(c->st, obj);
    if (kind < 0)
        return -1;
    if (kind == S_ARRAY)
        return take_chunks(c, obj, res);
    if (kind == S_SHARED) {
        for (int j = 0; j < c->k; j++)
            res[j] = Py_NewRef(obj);
        return 0;
    }
    return build_container(c, obj, kind, seg, res);
}

/* The leaves must all have been handed out by pass (d). */
static int check_all_taken(scatter_ctx *c)
{
    if (c->cursor != c->nleaves) {
        PyErr_SetString(PyExc_RuntimeError,
                        "scatter: the inputs changed while they were being scattered");
        return -1;
    }
    return 0;
}

/* The top of in_dims for scatter_kwargs, split into the entries for the
 * positional arguments and for the keyword arguments:
 *   NULL / None  -> both NULL (dim everywhere);
 *   int          -> that int for both (every leaf);
 *   tuple / list -> *args_spec = it (a prefix of the positional arguments),
 *                   *kw_spec NULL;
 *   dict         -> int keys address positional arguments, str keys keyword
 *                   arguments: *args_spec = a new dict {index: entry},
 *                   *kw_spec = a new dict {name: entry} (NULL when empty).
 * Every entry must address an argument of this call. New references (or
 * borrowed ints) are returned in *own for the caller to release. */
static int split_top_spec(PyObject *in_dims, Py_ssize_t nin, PyObject *kwargs,
                          PyObject **args_spec, PyObject **kw_spec, PyObject **own)
{
    path_seg sroot = seg_root("in_dims");
    *args_spec = *kw_spec = NULL;
    own[0] = own[1] = NULL;
    if (in_dims == NULL || in_dims == Py_None)
        return 0;
    if (PyLong_Check(in_dims) && !PyBool_Check(in_dims)) {
        *args_spec = *kw_spec = in_dims;
        return 0;
    }
    if (PyTuple_Check(in_dims) || PyList_Check(in_dims)) {
        Py_ssize_t len = PySequence_Length(in_dims);
        if (len > nin)
            return raise_at(PyExc_ValueError, &sroot,
                            "has %zd entries, but the call has %zd positional argument%s "
                            "(a tuple or list in_dims mirrors a prefix of the positional "
                            "arguments; give keyword arguments in a dict by name)",
                            len, nin, nin == 1 ? "" : "s");
        *args_spec = in_dims;
        return 0;
    }
    if (!PyDict_Check(in_dims))
        return raise_at(PyExc_TypeError, &sroot,
                        "expected None, an int, a tuple or list (one entry per positional "
                        "argument) or a dict (int keys: positions, str keys: keyword "
                        "names), got %.100s", Py_TYPE(in_dims)->tp_name);
    PyObject *a = PyDict_New(), *k = PyDict_New();
    own[0] = a;
    own[1] = k;
    if (a == NULL || k == NULL)
        return -1;
    Py_ssize_t pos = 0;
    PyObject *key, *value;
    while (PyDict_Next(in_dims, &pos, &key, &value)) {
        path_seg kseg = seg_child(&sroot, SEG_KEY, 0, key);
        if (PyUnicode_Check(key)) {
            int has = kwargs != NULL ? PyDict_Contains(kwargs, key) : 0;
            if (has < 0)
                return -1;
            if (!has)
                return raise_at(PyExc_ValueError, &kseg,
                                "the call has no keyword argument %R", key);
            if (PyDict_SetItem(k, key, value) < 0)
                return -1;
        }
        else if (PyLong_Check(key) && !PyBool_Check(key)) {
            Py_ssize_t i = PyLong_AsSsize_t(key);
            if (i == -1 && PyErr_Occurred())
                PyErr_Clear();
            if (i < 0 || i >= nin)
                return raise_at(PyExc_ValueError, &kseg,
                                "the call has %zd positional argument%s, so int keys "
                                "must be in 0..%zd", nin, nin == 1 ? "" : "s", nin - 1);
            if (PyDict_SetItem(a, key, value) < 0)
                return -1;
        }
        else {
            return raise_at(PyExc_TypeError, &kseg,
                            "a dict in_dims is keyed by argument position (int) or "
                            "keyword name (str), got a key of type %.100s",
                            Py_TYPE(key)->tp_name);
        }
    }
    *args_spec = a;
    *kw_spec = PyDict_GET_SIZE(k) > 0 ? k : NULL;
    return 0;
}

/* Pass (a) for the positional arguments: argument i with its entry of
 * args_spec (see split_top_spec). */
static int collect_args(scatter_ctx *c, PyObject *inputs, PyObject *args_spec)
{
    path_seg args_root = seg_root("args"), sroot = seg_root("in_dims");
    PyObject *fast = NULL;
    int rc = -1;
    if (args_spec != NULL && (PyTuple_Check(args_spec) || PyList_Check(args_spec))) {
        fast = PySequence_Fast(args_spec, "in_dims");
        if (fast == NULL)
            return -1;
    }
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(inputs); i++) {
        path_seg seg = seg_child(&args_root, SEG_INDEX, i, NULL), sseg = sroot;
        PyObject *spec = args_spec;
        if (fast != NULL) {
            spec = i < PySequence_Fast_GET_SIZE(fast) ? PySequence_Fast_GET_ITEM(fast, i) : NULL;
            sseg = seg_child(&sroot, SEG_INDEX, i, NULL);
        }
        else if (args_spec != NULL && PyDict_Check(args_spec)) {
            PyObject *key = PyLong_FromSsize_t(i);
            if (key == NULL)
                goto done;
            spec = PyDict_GetItemWithError(args_spec, key);
            Py_DECREF(key);
            if (spec == NULL && PyErr_Occurred())
                goto done;
            sseg = seg_child(&sroot, SEG_INDEX, i, NULL);
        }
        if (collect(c, PyTuple_GET_ITEM(inputs, i), &seg, spec, &sseg) < 0)
            goto done;
    }
    rc = 0;
done:
    Py_XDECREF(fast);
    return rc;
}

int dp_scatter_kwargs(dp_state *st, PyObject *inputs, PyObject *kwargs,
                      const dp_device *devs, Py_ssize_t ndev, int dim, int strict,
                      PyObject **inputs_out, PyObject **kwargs_out)
{
    dp_split_opts opts = {dim, strict, NULL, NULL, NULL};
    return dp_scatter_kwargs_ex(st, inputs, kwargs, devs, ndev, &opts, inputs_out,
                                kwargs_out);
}

int dp_scatter_kwargs_ex(dp_state *st, PyObject *inputs, PyObject *kwargs,
                         const dp_device *devs, Py_ssize_t ndev,
                         const dp_split_opts *opts,
                         PyObject **inputs_out, PyObject **kwargs_out)
{
    scatter_ctx c;
    PyObject *ins = NULL, *kws = NULL, **tmp = NULL;
    PyObject *args_spec = NULL, *kw_spec = NULL, *own[2] = {NULL, NULL};
    path_seg args_root = seg_root("args"), kw_root = seg_root("kwargs");
    path_seg sroot = seg_root("in_dims");
    int rc = -1, dim = opts->dim, strict = opts->strict;

    memset(&c, 0, sizeof c);

    *inputs_out = *kwargs_out = NULL;
    if (inputs != NULL && !PyTuple_Check(inputs)) {
        PyErr_Format(PyExc_TypeError, "inputs: expected a tuple, got %.100s",
                     Py_TYPE(inputs)->tp_name);
        return -1;
    }
    if (kwargs != NULL && !PyDict_Check(kwargs)) {
        PyErr_Format(PyExc_TypeError, "kwargs: expected a dict, got %.100s",
                     Py_TYPE(kwargs)->tp_name);
        return -1;
    }
    Py_ssize_t nin = inputs != NULL ? PyTuple_GET_SIZE(inputs) : 0;
    int has_kw = kwargs != NULL && PyDict_GET_SIZE(kwargs) > 0;

    if (opts->in_dims != NULL && dp_check_dims_spec(opts->in_dims, "in_dims", 0) < 0)
        return -1;
    if (split_top_spec(opts->in_dims, nin, has_kw ? kwargs : NULL, &args_spec, &kw_spec,
                       own) < 0)
        goto fail;

    /* spec 2.7: nothing to scatter gives no groups at all; DataParallel then
     * runs one replica with ((),), ({},) (spec 2.4). */
    if (nin == 0 && !has_kw) {
        ins = PyTuple_New(0);
        kws = PyTuple_New(0);
        if (ins == NULL || kws == NULL)
            goto fail;
        *inputs_out = ins;
        *kwargs_out = kws;
        ins = kws = NULL;
        rc = 0;
        goto fail;
    }

    if (ctx_init(&c, st, devs, ndev, dim, 0) < 0)
        goto fail;
    c.chunk_sizes = opts->chunk_sizes;
    c.weights = opts->weights;
    /* (a) args and kwargs together: one replica count for both (R04). */
    if (nin > 0 && collect_args(&c, inputs, args_spec) < 0)
        goto fail;
    if (has_kw && collect(&c, kwargs, &kw_root, kw_spec, &sroot) < 0)
        goto fail;
    scatter_count(&c);                       /* (b) */
    if (scatter_check(&c, strict) < 0)
        goto fail;
    if (scatter_copy(&c) < 0)                /* (c) */
        goto fail;

    /* (d) exactly k groups on each side; a missing side is padded with ()
     * or {} (spec 2.7, without PyTorch's uneven padding). */
    tmp = PyMem_Calloc((size_t)c.k, sizeof *tmp);
    ins = PyTuple_New(c.k);
    kws = PyTuple_New(c.k);
    if (tmp == NULL || ins == NULL || kws == NULL) {
        if (tmp == NULL)
            PyErr_NoMemory();
        goto fail;
    }
    if (nin > 0) {
        if (build_container(&c, inputs, S_TUPLE, &args_root, tmp) < 0)
            goto fail;
    }
    else {
        for (int j = 0; j < c.k; j++)
            tmp[j] = PyTuple_New(0);
    }
    for (int j = 0; j < c.k; j++) {
        if (tmp[j] == NULL)
            goto fail;
        PyTuple_SET_ITEM(ins, j, tmp[j]);
        tmp[j] = NULL;
    }
    if (has_kw) {
        if (build(&c, kwargs, &kw_root, tmp) < 0)
            goto fail;
    }
    else {
        for (int j = 0; j < c.k; j++)
            tmp[j] = PyDict_New();
    }
    for (int j = 0; j < c.k; j++) {
        if (tmp[j] == NULL)
            goto fail;
        PyTuple_SET_ITEM(kws, j, tmp[j]);
        tmp[j] = NULL;
    }
    if (check_all_taken(&c) < 0)
        goto fail;

    *inputs_out = ins;
    *kwargs_out = kws;
    ins = kws = NULL;
    rc = 0;
fail:
    if (tmp != NULL) {
        for (int j = 0; j < c.k; j++)
            Py_XDECREF(tmp[j]);
        PyMem_Free(tmp);
    }
    Py_XDECREF(ins);
    Py_XDECREF(kws);
    Py_XDECREF(own[0]);
    Py_XDECREF(own[1]);
    ctx_clear(&c);
    return rc;
}

/* ------------------------------------------------------------------ */
/* Gather                                                              */
/* ------------------------------------------------------------------ */

/* What gather does at a leaf (out_dims; OUT_CAT is PyTorch's rule). */
enum {
    OUT_CAT = 0,   /* concatenate arrays along dim (the rules of spec 4)  */
    OUT_SAME,      /* out_dims None: every replica's value must be equal  */
    OUT_SUM        /* out_dims "sum": add the replicas' values            */
};

typedef struct {
    dp_state *st;
    dp_device target;   /* where arrays are gathered                      */
    int dim;            /* as given; wrapped per array position           */
    int mode;           /* OUT_*, from out_dims; OUT_CAT by default       */
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
        if (r < 0)
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

/* What join_each shows of each replica's value. */
enum { SHOW_TYPE, SHOW_REPR, SHOW_NDIM, SHOW_LEN };

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

/* Every replica must return the same kind of value at this position (for a
 * dataclass, the same class): R19 c/d. */
static int check_kinds(gather_ctx *g, PyObject *const *vals, Py_ssize_t n,
                       int kind0, const path_seg *seg)
{
    for (Py_ssize_t i = 1; i < n; i++) {
        int ki = gather_kind(g->st, vals[i]);
        if (ki < 0)
            return -1;
        if (ki == kind0 && (kind0 != G_DATACLASS || Py_TYPE(vals[i]) == Py_TYPE(vals[0])))
            continue;
        PyObject *path = path_str(seg), *names = join_each(vals, n, SHOW_TYPE);
        if (path != NULL && names != NULL)
            PyErr_Format(PyExc_TypeError,
                         "%U: every replica must return %s here, as replica 0 "
                         "does, but replica %zd does not (types per replica: %U)",
                         path, gather_kind_names[kind0], i, names);
        Py_XDECREF(path);
        Py_XDECREF(names);
        return -1;
    }
    return 0;
}

static PyObject *gather_map(gather_ctx *g, PyObject *const *vals, Py_ssize_t n,
                            const path_seg *seg, PyObject *spec, const path_seg *sseg);

/* Arrays at one position: concatenate along dim onto the target (spec 4.5-4.8). */
static PyObject *gather_leaf(gather_ctx *g, PyObject *const *vals, Py_ssize_t n,
                             const path_seg *seg)
{
    PyArrayObject **parts = NULL;
    PyObject **arrs = NULL;  /* new references: vals as arrays */
    PyObject *path = NULL, *res = NULL;
    const char *cpath;
    int all0 = 1, any0 = 0, views = 0, wdim;

    path = path_str(seg);
    if (path == NULL)
        goto done;
    cpath = PyUnicode_AsUTF8(path);
    if (cpath == NULL)
        goto done;
    parts = PyMem_Calloc((size_t)n, sizeof *parts);
    if (parts == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    arrs = PyMem_Calloc((size_t)n, sizeof *arrs);
    if (arrs == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        if (dp_refused_array_subclass(vals[i], cpath) != 0)
            goto done;
        arrs[i] = PyArray_Check(vals[i]) ? Py_NewRef(vals[i])
                : PyArray_IsScalar(vals[i], Generic) ? PyArray_FromScalar(vals[i], NULL)
                : (PyObject *)dp_as_array(g->st, vals[i], cpath, 0); /* GPU arrays */
        if (arrs[i] == NULL)
            goto done;
        if (PyArray_NDIM((PyArrayObject *)arrs[i]) == 0)
            any0 = 1;
        else
            all0 = 0;
    }
    vals = arrs;
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
    res = dp_gather_arrays(g->st, parts, n, wdim, g->target, NULL, cpath);
done:
    if (parts != NULL && views)
        for (Py_ssize_t i = 0; i < n; i++)
            Py_XDECREF(parts[i]);
    PyMem_Free(parts);
    if (arrs != NULL)
        for (Py_ssize_t i = 0; i < n; i++)
            Py_XDECREF(arrs[i]);
    PyMem_Free(arrs);
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

/* str, bytes, numbers: returned once when every replica's value is equal
 * (NaN counting as equal to NaN). */
static PyObject *gather_value(gather_ctx *g, PyObject *const *vals, Py_ssize_t n,
                              const path_seg *seg)
{
    for (Py_ssize_t i = 1; i < n; i++) {
        int eq = PyObject_RichCompareBool(vals[0], vals[i], Py_EQ);
        if (eq < 0)
            return NULL;
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

/* Any other object: the same object from every replica is returned. */
static PyObject *gather_same(gather_ctx *g, PyObject *const *vals, Py_ssize_t n,
                             const path_seg *seg)
{
    for (Py_ssize_t i = 1; i < n; i++) {
        if (vals[i] == vals[0])
            continue;
        PyObject *path = path_str(seg);
        if (path != NULL)
            PyErr_Format(PyExc_TypeError,
                         "%U: the replicas returned different %.100s objects; gather "
                         "can only return such an object when every replica returns "
                         "the same one (return arrays, or a dict, tuple, namedtuple "
                         "or dataclass of them)", path, Py_TYPE(vals[0])->tp_name);
        Py_XDECREF(path);
        return NULL;
    }
    return Py_NewRef(vals[0]);
}

/* Dicts: same number of keys, every key of replica 0 in every dict; key order
 * and type from replica 0 (spec 4.1, R14). */
static PyObject *gather_dict(gather_ctx *g, PyObject *const *vals, Py_ssize_t n,
                             const path_seg *seg, PyObject *spec, const path_seg *sseg)
{
    PyObject *keys = NULL, *acc = NULL, *res = NULL, **child = NULL;
    int exact = PyDict_CheckExact(vals[0]);
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
        return NULL;
    }
    keys = PyMapping_Keys(vals[0]);
    if (keys == NULL)
        goto done;
    if (spec_is_container(spec) &&
        spec_check_children(spec, sseg, seg, 0, vals[0], NULL) < 0)
        goto done;
    child = PyMem_Calloc((size_t)n, sizeof *child);
    acc = exact ? PyDict_New() : PyList_New(0);
    if (child == NULL || acc == NULL) {
        if (child == NULL)
            PyErr_NoMemory();
        goto done;
    }
    for (Py_ssize_t q = 0; q < PyList_GET_SIZE(keys); q++) {
        PyObject *key = PyList_GET_ITEM(keys, q), *v;
        path_seg cseg = seg_child(seg, SEG_KEY, 0, key);
        int ok = 1;
        for (Py_ssize_t i = 0; i < n && ok; i++) {
            int has = PyDict_Contains(vals[i], key);
            if (has == 0) {
                PyObject *path = path_str(seg);
                if (path != NULL)
                    PyErr_Format(PyExc_ValueError,
                                 "%U: replica %zd returned a dict without the key %R "
                                 "that replica 0 returned; every replica must "
                                 "return the same keys", path, i, key);
                Py_XDECREF(path);
            }
            if (has <= 0 || (child[i] = PyObject_GetItem(vals[i], key)) == NULL)
                ok = 0;
        }
        path_seg csseg;
        PyObject *cspec;
        if (ok && spec_child(spec, sseg, q, key, &cspec, &csseg) < 0)
            ok = 0;
        v = ok ? gather_map(g, child, n, &cseg, cspec, &csseg) : NULL;
        for (Py_ssize_t i = 0; i < n; i++)
            Py_CLEAR(child[i]);
        if (v == NULL)
            goto done;
        int r;
        if (exact) {
            r = PyDict_SetItem(acc, key, v);
        }
        else {
            PyObject *pair = PyTuple_Pack(2, key, v);
            r = append_steal(acc, pair);
        }
        Py_DECREF(v);
        if (r < 0)
            goto done;
    }
    if (exact) {
        res = Py_NewRef(acc);
    }
    else {
        res = PyObject_CallOneArg((PyObject *)Py_TYPE(vals[0]), acc);
        if (res == NULL)
            raise_rebuild_error(seg, Py_TYPE(vals[0]),
                                "type(out)(list of (key, value) pairs)", "");
    }
done:
    PyMem_Free(child);
    Py_XDECREF(keys);
    Py_XDECREF(acc);
    return res;
}

/* Lists, tuples, namedtuples: position by position, same length everywhere
 * (spec 4.1's strict zip, R18). */
static PyObject *gather_seq(gather_ctx *g, PyObject *const *vals, Py_ssize_t n,
                            int kind, const path_seg *seg, PyObject *spec,
                            const path_seg *sseg)
{
    PyObject **snap = NULL, **child = NULL;
    PyObject *items = NULL, *names = NULL, *res = NULL;
    Py_ssize_t len0;

    snap = PyMem_Calloc((size_t)n, sizeof *snap);
    child = PyMem_Calloc((size_t)n, sizeof *child);
    if (snap == NULL || child == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    for (Py_ssize_t i = 0; i < n; i++)
        if ((snap[i] = seq_snapshot(vals[i])) == NULL)
            goto done;
    len0 = PyTuple_GET_SIZE(snap[0]);
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
        goto done;
    }

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
        path_seg csseg;
        PyObject *cspec;
        if (spec_child(spec, sseg, pos, NULL, &cspec, &csseg) < 0)
            goto done;
        for (Py_ssize_t i = 0; i < n; i++)
            child[i] = PyTuple_GET_ITEM(snap[i], pos);  /* borrowed from snap */
        PyObject *v = gather_map(g, child, n, &cseg, cspec, &csseg);
        if (v == NULL)
            goto done;
        PyList_SET_ITEM(items, pos, v);
    }

    PyTypeObject *tp = Py_TYPE(vals[0]);
    if (kind == G_NAMEDTUPLE) {
        PyObject *make = PyObject_GetAttrString((PyObject *)tp, "_make");
        if (make != NULL) {
            res = PyObject_CallOneArg(make, items);
            Py_DECREF(make);
        }
        if (res == NULL)
            raise_rebuild_error(seg, tp, "type(out)._make(fields)", "");
    }
    else if (PyList_CheckExact(vals[0])) {
        res = Py_NewRef(items);
    }
    else if (PyTuple_CheckExact(vals[0])) {
        res = PyList_AsTuple(items);
    }
    else {
        res = PyObject_CallOneArg((PyObject *)tp, items);
        if (res == NULL)
            raise_rebuild_error(seg, tp, "type(out)(items)", "");
    }
done:
    if (snap != NULL)
        for (Py_ssize_t i = 0; i < n; i++)
            Py_XDECREF(snap[i]);
    PyMem_Free(snap);
    PyMem_Free(child);
    Py_XDECREF(items);
    Py_XDECREF(names);
    return res;
}

/* Dataclass instances: field by field (dataclasses.fields), rebuilt as
 * cls(**init_fields) and object.__setattr__ for the others (R17). */
static PyObject *gather_dataclass(gather_ctx *g, PyObject *const *vals, Py_ssize_t n,
                                  const path_seg *seg, PyObject *spec,
                                  const path_seg *sseg)
{
    PyObject *fields = NULL, *kw = NULL, *late = NULL, *empty = NULL, *inst = NULL;
    PyObject *res = NULL, **child = NULL;
    PyTypeObject *tp = Py_TYPE(vals[0]);

    fields = PyObject_CallOneArg(g->st->dataclasses_fields, vals[0]);
    if (fields == NULL)
        goto done;
    if (!PyTuple_Check(fields)) {
        PyErr_SetString(PyExc_TypeError, "dataclasses.fields() did not return a tuple");
        goto done;
    }
    if (spec != NULL && PyDict_Check(spec)) {
        /* A dict in out_dims names fields of the dataclass. */
        PyObject *fnames = PyTuple_New(PyTuple_GET_SIZE(fields));
        if (fnames == NULL)
            goto done;
        for (Py_ssize_t f = 0; f < PyTuple_GET_SIZE(fields); f++) {
            PyObject *nm = PyObject_GetAttrString(PyTuple_GET_ITEM(fields, f), "name");
            if (nm == NULL) {
                Py_DECREF(fnames);
                goto done;
            }
            PyTuple_SET_ITEM(fnames, f, nm);
        }
        int r = spec_check_children(spec, sseg, seg, 0, NULL, fnames);
        Py_DECREF(fnames);
        if (r < 0)
            goto done;
    }
    kw = PyDict_New();
    late = PyList_New(0);
    child = PyMem_Calloc((size_t)n, sizeof *child);
    if (kw == NULL || late == NULL || child == NULL) {
        if (child == NULL)
            PyErr_NoMemory();
        goto done;
    }
    for (Py_ssize_t f = 0; f < PyTuple_GET_SIZE(fields); f++) {
        PyObject *field = PyTuple_GET_ITEM(fields, f), *v = NULL;
        PyObject *name = PyObject_GetAttrString(field, "name");
        PyObject *init = name != NULL ? PyObject_GetAttrString(field, "init") : NULL;
        int is_init = init != NULL ? PyObject_IsTrue(init) : -1;
        int ok = is_init >= 0;
        if (ok) {
            path_seg cseg = seg_child(seg, SEG_ATTR, 0, name), csseg;
            PyObject *cspec;
            if (spec_child(spec, sseg, f, name, &cspec, &csseg) < 0)
                ok = 0;
            for (Py_ssize_t i = 0; i < n && ok; i++)
                if ((child[i] = PyObject_GetAttr(vals[i], name)) == NULL)
                    ok = 0;
            v = ok ? gather_map(g, child, n, &cseg, cspec, &csseg) : NULL;
            for (Py_ssize_t i = 0; i < n; i++)
                Py_CLEAR(child[i]);
        }
        int r = -1;
        if (v != NULL) {
            if (is_init)
                r = PyDict_SetItem(kw, name, v);
            else
                r = append_steal(late, PyTuple_Pack(2, name, v));
        }
        Py_XDECREF(v);
        Py_XDECREF(init);
        Py_XDECREF(name);
        if (r < 0)
            goto done;
    }
    empty = PyTuple_New(0);
    if (empty == NULL)
        goto done;
    inst = PyObject_Call((PyObject *)tp, empty, kw);
    if (inst == NULL) {
        raise_rebuild_error(seg, tp, "type(out)(**init_fields)", "");
        goto done;
    }
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(late); i++) {
        PyObject *pair = PyList_GET_ITEM(late, i);
        if (PyObject_GenericSetAttr(inst, PyTuple_GET_ITEM(pair, 0),
                                    PyTuple_GET_ITEM(pair, 1)) < 0)
            goto done;
    }
    res = Py_NewRef(inst);
done:
    PyMem_Free(child);
    Py_XDECREF(fields);
    Py_XDECREF(kw);
    Py_XDECREF(late);
    Py_XDECREF(empty);
    Py_XDECREF(inst);
    return res;
}

/* out_dims None at an array position: every replica's array must equal
 * replica 0's (numpy.array_equal: same shape, equal values); the result is
 * replica 0's array on the target device (itself when it lives there). */
static PyObject *gather_equal_arrays(gather_ctx *g, PyObject *const *vals, Py_ssize_t n,
                                     const path_seg *seg)
{
    for (Py_ssize_t i = 1; i < n; i++) {
        int eq;
        if (PyArray_Check(vals[0]) && PyArray_Check(vals[i])) {
            PyArrayObject *a = (PyArrayObject *)vals[0], *b = (PyArrayObject *)vals[i];
            eq = PyArray_NDIM(a) == PyArray_NDIM(b) && PyArray_SAMESHAPE(a, b);
            if (eq) {
                PyObject *cmp = PyObject_RichCompare(vals[0], vals[i], Py_EQ);
                PyObject *all = cmp != NULL ? PyObject_CallMethod(cmp, "all", NULL) : NULL;
                eq = all != NULL ? PyObject_IsTrue(all) : -1;
                Py_XDECREF(cmp);
                Py_XDECREF(all);
            }
        }
        else {
            eq = PyObject_RichCompareBool(vals[0], vals[i], Py_EQ);
        }
        if (eq < 0)
            return NULL;
        if (eq)
            continue;
        PyObject *path = path_str(seg);
        if (path != NULL)
            PyErr_Format(PyExc_TypeError,
                         "%U: out_dims gives None here (every replica returns the same "
                         "value), but replica %zd returned an array that differs from "
                         "replica 0's (shape or values); give an int to gather the "
                         "replicas' arrays along that dim, or \"sum\" to add them",
                         path, i);
        Py_XDECREF(path);
        return NULL;
    }
    if (!PyArray_Check(vals[0]))
        return Py_NewRef(vals[0]);  /* a NumPy scalar: a host value */
    PyObject *one = PyList_New(1), *per_dev = NULL, *res = NULL;
    if (one == NULL)
        return NULL;
    PyList_SET_ITEM(one, 0, Py_NewRef(vals[0]));
    per_dev = dp_broadcast_coalesced(g->st, one, &g->target, 1, 0);
    if (per_dev != NULL)
        res = Py_NewRef(PyList_GET_ITEM(PyList_GET_ITEM(per_dev, 0), 0));
    Py_DECREF(one);
    Py_XDECREF(per_dev);
    return res;
}

/* out_dims "sum" at an array position: comm.reduce_add onto the target
 * (same shapes; replica 0's dtype). NumPy scalars count as 0-dim arrays. */
static PyObject *gather_sum_arrays(gather_ctx *g, PyObject *const *vals, Py_ssize_t n,
                                   const path_seg *seg)
{
    PyObject *list = PyList_New(n), *path = NULL, *res = NULL;
    if (list == NULL)
        return NULL;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *a = PyArray_Check(vals[i]) ? Py_NewRef(vals[i])
                                             : PyArray_FromScalar(vals[i], NULL);
        if (a == NULL)
            goto done;
        PyList_SET_ITEM(list, i, a);
    }
    path = path_str(seg);
    const char *cpath = path != NULL ? PyUnicode_AsUTF8(path) : NULL;
    if (cpath != NULL)
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
 * replica 0's (==); the result is replica 0's value. */
static PyObject *gather_equal_values(gather_ctx *g, PyObject *const *vals, Py_ssize_t n,
                                     const path_seg *seg)
{
    for (Py_ssize_t i = 1; i < n; i++) {
        int eq = PyObject_RichCompareBool(vals[0], vals[i], Py_EQ);
        if (eq < 0)
            return NULL;
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
    if (kind < 0 || check_kinds(g, vals, n, kind, seg) < 0)
        return NULL;
    if (spec != NULL) {
        /* A container entry must mirror a container of its kind. */
        int dict_spec = PyDict_Check(spec);
        int fits = dict_spec ? (kind == G_DICT || kind == G_DATACLASS)
                             : (kind == G_SEQ || kind == G_NAMEDTUPLE);
        if (!fits) {
            spec_mismatch(sseg, spec, seg, gather_kind_names[kind]);
            return NULL;
        }
    }
    switch (kind) {
    case G_ARRAY:
        if (g->mode == OUT_SAME)
            return gather_equal_arrays(g, vals, n, seg);
        if (g->mode == OUT_SUM)
            return gather_sum_arrays(g, vals, n, seg);
        return gather_leaf(g, vals, n, seg);
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
    if (Py_EnterRecursiveCall(" while gathering outputs"))
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

PyObject *dp_gather_outputs_ex(dp_state *st, PyObject *outputs, dp_device target,
                               int dim, PyObject *out_dims)
{
    if (out_dims == Py_None)
        out_dims = NULL;
    if (dp_check_dims_spec(out_dims, "out_dims", 1) < 0)
        return NULL;
    if (!PyList_Check(outputs) && !PyTuple_Check(outputs)) {
        PyErr_Format(PyExc_TypeError,
                     "outputs: expected a list or tuple with one entry per replica, "
                     "got %.100s", Py_TYPE(outputs)->tp_name);
        return NULL;
    }
    PyObject *snap = seq_snapshot(outputs);
    if (snap == NULL)
        return NULL;
    PyObject *res = NULL;
    Py_ssize_t n = PyTuple_GET_SIZE(snap);
    if (n == 0) {
        PyErr_Format(PyExc_ValueError,
                     "outputs: expected at least one replica output, got an empty %.100s",
                     Py_TYPE(outputs)->tp_name);
    }
    else {
        gather_ctx g = {st, target, dim, OUT_CAT};
        path_seg root = seg_root("out"), sroot = seg_root("out_dims");
        res = gather_map(&g, &PyTuple_GET_ITEM(snap, 0), n, &root, out_dims, &sroot);
    }
    Py_DECREF(snap);
    return res;
}

/* ------------------------------------------------------------------ */
/* Plan (dpmini.explain)                                               */
/* ------------------------------------------------------------------ */

/* A list of n Python ints. */
static PyObject *int_list(const int64_t *v, int n)
{
    PyObject *list = PyList_New(n);
    if (list == NULL)
        return NULL;
    for (int j = 0; j < n; j++) {
        PyObject *x = PyLong_FromLongLong((long long)v[j]);
        if (x == NULL) {
            Py_DECREF(list);
            return NULL;
        }
        PyList_SET_ITEM(list, j, x);
    }
    return list;
}

/* plan['leaves'] entry of a broadcast leaf (in_dims None): 'dim',
 * 'sizes' and 'starts' are None; 'nbytes' is the whole array's size for
 * each device that runs a replica (none when the call would raise). */
static PyObject *plan_bcast_leaf(scatter_ctx *c, scatter_leaf *lf, int ok)
{
    PyObject *shape = NULL, *nbytes = NULL, *res = NULL;
    int64_t *nb = PyMem_Malloc((size_t)c->ndev * sizeof(int64_t));
    if (nb == NULL)
        return PyErr_NoMemory();
    for (int j = 0; j < c->ndev; j++)
        nb[j] = (ok && j < c->k) ? (int64_t)PyArray_NBYTES(lf->arr) : 0;
    shape = PyArray_IntTupleFromIntp(PyArray_NDIM(lf->arr), PyArray_DIMS(lf->arr));
    nbytes = int_list(nb, c->ndev);
    if (shape != NULL && nbytes != NULL)
        res = Py_BuildValue("{s:O,s:O,s:O,s:n,s:O,s:O,s:O,s:O,s:O}",
                            "path", lf->path, "shape", shape,
                            "dtype", (PyObject *)PyArray_DESCR(lf->arr),
                            "itemsize", (Py_ssize_t)PyArray_ITEMSIZE(lf->arr),
                            "dim", Py_None, "broadcast", Py_True, "sizes", Py_None,
                            "starts", Py_None, "nbytes", nbytes);
    PyMem_Free(nb);
    Py_XDECREF(shape);
    Py_XDECREF(nbytes);
    return res;
}

/* One entry of plan['leaves']. truncate: sizes past the replica count are 0. */
static PyObject *plan_leaf(scatter_ctx *c, scatter_leaf *lf, int truncate)
{
    if (lf->bcast)
        return plan_bcast_leaf(c, lf, truncate);
    PyObject *shape = NULL, *sizes = NULL, *starts = NULL, *nbytes = NULL, *res = NULL;
    int64_t *buf = PyMem_Malloc(3 * (size_t)c->ndev * sizeof(int64_t));
    if (buf == NULL)
        return PyErr_NoMemory();
    int64_t *sz = buf, *st = buf + c->ndev, *nb = buf + 2 * c->ndev;

    /* Bytes per index along dim: fits, since the whole array exists. */
    int64_t row = (int64_t)PyArray_ITEMSIZE(lf->arr);
    for (int d = 0; d < PyArray_NDIM(lf->arr); d++)
        if (d != lf->dim)
            row *= (int64_t)PyArray_DIM(lf->arr, d);
    int64_t start = 0;
    for (int j = 0; j < c->ndev; j++) {
        sz[j] = (truncate && j >= c->k) ? 0 : lf->sizes[j];
        st[j] = start;
        nb[j] = sz[j] * row;
        start += sz[j];
    }
    shape = PyArray_IntTupleFromIntp(PyArray_NDIM(lf->arr), PyArray_DIMS(lf->arr));
    sizes = int_list(sz, c->ndev);
    starts = int_list(st, c->ndev);
    nbytes = int_list(nb, c->ndev);
    if (shape != NULL && sizes != NULL && starts != NULL && nbytes != NULL)
        res = Py_BuildValue("{s:O,s:O,s:O,s:n,s:i,s:O,s:O,s:O,s:O}",
                            "path", lf->path, "shape", shape,
                            "dtype", (PyObject *)PyArray_DESCR(lf->arr),
                            "itemsize", (Py_ssize_t)PyArray_ITEMSIZE(lf->arr),
                            "dim", lf->dim, "broadcast", Py_False, "sizes", sizes,
                            "starts", starts, "nbytes", nbytes);
    PyMem_Free(buf);
    Py_XDECREF(shape);
    Py_XDECREF(sizes);
    Py_XDECREF(starts);
    Py_XDECREF(nbytes);
    return res;
}

/* The plan of a scatter_kwargs call, from passes (a) and (b). no_args: both
 * inputs and kwargs were empty (DataParallel then runs one replica). */
static PyObject *plan_result(scatter_ctx *c, int strict, int no_args)
{
    PyObject *devices = NULL, *leaves = NULL, *warnings = NULL, *error = NULL;
    PyObject *res = NULL;

    warnings = PyList_New(0);
    devices = PyList_New(c->ndev);
    leaves = PyList_New(0);
    if (warnings == NULL || devices == NULL || leaves == NULL)
        goto done;
    if (c->error != NULL) {
        error = Py_NewRef(c->error);
    }
    else if (c->mismatch && strict) {
        if ((error = strict_message(c)) == NULL)
            goto done;
    }
    else if (c->mismatch) {
        PyObject *msg;
        if (truncation_message(c, &msg) < 0)
            goto done;
        if (msg != NULL && append_steal(warnings, msg) < 0)
            goto done;
    }
    for (int j = 0; j < c->ndev; j++) {
        PyObject *d = dp_device_to_object(c->st, c->devs[j]);
        if (d == NULL)
            goto done;
        PyList_SET_ITEM(devices, j, d);
    }
    for (Py_ssize_t i = 0; i < c->nleaves; i++)
        if (append_steal(leaves, plan_leaf(c, &c->leaves[i], error == NULL)) < 0)
            goto done;
    res = Py_BuildValue("{s:O,s:i,s:O,s:O,s:O,s:O,s:s}",
                        "devices", devices,
                        "replicas", error != NULL ? 0 : (no_args ? 1 : c->k),
                        "leaves", leaves, "shared", c->shared,
                        "warnings", warnings, "error", error ? error : Py_None,
                        "rule", c->chunk_sizes != NULL ? "chunk_sizes"
                                : c->weights != NULL ? "weights" : "chunk");
done:
    Py_XDECREF(devices);
    Py_XDECREF(leaves);
    Py_XDECREF(warnings);
    Py_XDECREF(error);
    return res;
}

/* ------------------------------------------------------------------ */
/* Python functions                                                    */
/* ------------------------------------------------------------------ */

/* dim argument: 0 when absent. */
static int parse_dim(PyObject *obj, int *dim)
{
    *dim = 0;
    return obj == NULL ? 0 : dp_int_from_object(obj, "dim", dim);
}

/* scatter_kwargs' inputs: None -> empty, a tuple as is, anything else is
 * one positional argument (inputs,) (spec 2.9). New reference. */
static PyObject *normalize_inputs(PyObject *inputs)
{
    if (inputs == Py_None)
        return PyTuple_New(0);
    if (PyTuple_Check(inputs))
        return Py_NewRef(inputs);
    return PyTuple_Pack(1, inputs);
}

/* kwargs: None -> NULL (no kwargs); a dict as is (borrowed). */
static int normalize_kwargs(PyObject *kwargs, PyObject **out)
{
    *out = NULL;
    if (kwargs == Py_None)
        return 0;
    if (!PyDict_Check(kwargs)) {
        PyErr_Format(PyExc_TypeError, "kwargs: expected a dict or None, got %.100s",
                     Py_TYPE(kwargs)->tp_name);
        return -1;
    }
    *out = kwargs;
    return 0;
}

/* Check one in_dims / out_dims entry (recursively). */
static int check_spec(PyObject *spec, const path_seg *sseg, int is_out)
{
    if (spec == Py_None || (PyLong_Check(spec) && !PyBool_Check(spec))) {
        if (spec == Py_None)
            return 0;
        int overflow;
        long v = PyLong_AsLongAndOverflow(spec, &overflow);
        if ((v == -1 && PyErr_Occurred()) || overflow || v > INT32_MAX || v < INT32_MIN) {
            PyErr_Clear();
            return raise_at(PyExc_OverflowError, sseg, "%R is out of range for a dim", spec);
        }
        return 0;
    }
    if (is_out && PyUnicode_Check(spec)) {
        if (PyUnicode_CompareWithASCIIString(spec, "sum") == 0)
            return 0;
        return raise_at(PyExc_ValueError, sseg,
                        "unknown reduction %R (out_dims takes an int dim, None or "
                        "\"sum\")", spec);
    }
    if (PyTuple_Check(spec) || PyList_Check(spec) || PyDict_Check(spec)) {
        int rc = -1;
        if (Py_EnterRecursiveCall(" while checking in_dims / out_dims"))
            return -1;
        if (PyDict_Check(spec)) {
            Py_ssize_t pos = 0;
            PyObject *key, *value;
            while (PyDict_Next(spec, &pos, &key, &value)) {
                path_seg cseg = seg_child(sseg, SEG_KEY, 0, key);
                if (check_spec(value, &cseg, is_out) < 0)
                    goto done;
            }
        }
        else {
            PyObject *fast = PySequence_Fast(spec, "spec");
            if (fast == NULL)
                goto done;
            for (Py_ssize_t i = 0; i < PySequence_Fast_GET_SIZE(fast); i++) {
                path_seg cseg = seg_child(sseg, SEG_INDEX, i, NULL);
                if (check_spec(PySequence_Fast_GET_ITEM(fast, i), &cseg, is_out) < 0) {
                    Py_DECREF(fast);
                    goto done;
                }
            }
            Py_DECREF(fast);
        }
        rc = 0;
    done:
        Py_LeaveRecursiveCall();
        return rc;
    }
    return raise_at(PyExc_TypeError, sseg,
                    "expected an int (a dim), None (%s)%s or a tuple, list or dict of "
                    "them, got %.100s %.80R",
                    is_out ? "every replica returns the same value" : "broadcast the whole "
                    "array to every replica", is_out ? ", \"sum\"" : "",
                    Py_TYPE(spec)->tp_name, spec);
}

int dp_check_dims_spec(PyObject *spec, const char *argname, int is_out)
{
    if (spec == NULL)
        return 0;
    path_seg root = seg_root(argname);
    return check_spec(spec, &root, is_out);
}

/* One sequence argument of ndev entries (chunk_sizes or weights). */
static PyObject *per_device_seq(PyObject *obj, const char *argname, const char *what,
                                Py_ssize_t ndev)
{
    if (PyUnicode_Check(obj) || PyBytes_Check(obj) || PyDict_Check(obj) ||
        !PySequence_Check(obj)) {
        PyErr_Format(PyExc_TypeError, "%s: expected a sequence of %s (one per device), "
                     "got %.100s", argname, what, Py_TYPE(obj)->tp_name);
        return NULL;
    }
    PyObject *fast = PySequence_Fast(obj, argname);
    if (fast == NULL)
        return NULL;
    if (PySequence_Fast_GET_SIZE(fast) != ndev) {
        PyErr_Format(PyExc_ValueError, "%s: expected %zd entries (one per device in "
                     "device_ids), got %zd", argname, ndev, PySequence_Fast_GET_SIZE(fast));
        Py_DECREF(fast);
        return NULL;
    }
    return fast;
}

int dp_parse_split_sizes(PyObject *chunk_sizes, PyObject *weights, Py_ssize_t ndev,
                         int64_t *sizes_buf, double *weights_buf, dp_split_opts *opts)
{
    opts->chunk_sizes = NULL;
    opts->weights = NULL;
    if (chunk_sizes == Py_None)
        chunk_sizes = NULL;
    if (weights == Py_None)
        weights = NULL;
    if (chunk_sizes != NULL && weights != NULL) {
        PyErr_SetString(PyExc_ValueError,
                        "chunk_sizes and weights: give at most one (chunk_sizes fixes each "
                        "device's rows, weights makes them proportional)");
        return -1;
    }
    if (ndev < 1 || ndev > DP_MAX_DEVICES) {
        PyErr_Format(PyExc_ValueError, "expected 1 to %d devices, got %zd", DP_MAX_DEVICES,
                     ndev);
        return -1;
    }
    if (chunk_sizes != NULL) {
        PyObject *fast = per_device_seq(chunk_sizes, "chunk_sizes", "ints", ndev);
        if (fast == NULL)
            return -1;
        for (Py_ssize_t i = 0; i < ndev; i++) {
            PyObject *v = PySequence_Fast_GET_ITEM(fast, i);
            if (PyBool_Check(v) || PyFloat_Check(v) || !PyIndex_Check(v)) {
                PyErr_Format(PyExc_TypeError, "chunk_sizes[%zd]: expected an int, got "
                             "%.100s", i, Py_TYPE(v)->tp_name);
                Py_DECREF(fast);
                return -1;
            }
            PyObject *idx = PyNumber_Index(v);
            long long x = idx != NULL ? PyLong_AsLongLong(idx) : -1;
            Py_XDECREF(idx);
            if (x == -1 && PyErr_Occurred()) {
                Py_DECREF(fast);
                return -1;
            }
            if (x < 0) {
                PyErr_Format(PyExc_ValueError, "chunk_sizes[%zd]: must be >= 0 (rows for "
                             "device %zd), got %lld", i, i, x);
                Py_DECREF(fast);
                return -1;
            }
            sizes_buf[i] = (int64_t)x;
        }
        Py_DECREF(fast);
        opts->chunk_sizes = sizes_buf;
    }
    if (weights != NULL) {
        PyObject *fast = per_device_seq(weights, "weights", "numbers", ndev);
        if (fast == NULL)
            return -1;
        for (Py_ssize_t i = 0; i < ndev; i++) {
            PyObject *v = PySequence_Fast_GET_ITEM(fast, i);
            if (PyBool_Check(v) || PyComplex_Check(v) || !PyNumber_Check(v) ||
                PyUnicode_Check(v)) {
                PyErr_Format(PyExc_TypeError, "weights[%zd]: expected a real number, got "
                             "%.100s", i, Py_TYPE(v)->tp_name);
                Py_DECREF(fast);
                return -1;
            }
            double x = PyFloat_AsDouble(v);
            if (x == -1.0 && PyErr_Occurred()) {
                Py_DECREF(fast);
                return -1;
            }
            if (!(x > 0.0) || !isfinite(x)) {
                PyErr_Format(PyExc_ValueError, "weights[%zd]: must be a finite number > 0, "
                             "got %R", i, v);
                Py_DECREF(fast);
                return -1;
            }
            weights_buf[i] = x;
        }
        Py_DECREF(fast);
        opts->weights = weights_buf;
    }
    return 0;
}

PyDoc_STRVAR(scatter_doc,
"scatter($module, inputs, target_devices, dim=0, strict=False, in_dims=None,\n"
"        chunk_sizes=None, weights=None)\n"
"--\n"
"\n"
"Split inputs over target_devices as torch.nn.parallel.scatter does (spec 3).\n"
"\n"
"inputs: an ndarray (any non-object dtype, ndim >= 1, any strides), or a\n"
"  tuple / list / dict / namedtuple nesting ndarrays and other objects.\n"
"target_devices: a non-empty sequence of devices (\"cpu:N\", \"cuda:N\", int N,\n"
"  dpmini.Device); not the host.\n"
"dim: the axis to split along; a negative dim is wrapped against each array's\n"
"  own rank (R27).\n"
"strict: raise instead of warning when arrays give different chunk counts.\n"
"in_dims: None (every array split along dim, PyTorch), or a structure that\n"
"  mirrors inputs (JAX pmap's in_axes): an int splits along that dim, None\n"
"  broadcasts the whole array (any rank, 0-dim included) to every replica (a\n"
"  copy per device; the array itself on its own device) without affecting\n"
"  the replica count, a tuple/list mirrors a tuple/list/namedtuple by position\n"
"  (a prefix: later items use dim), a dict mirrors a dict (a subset of its\n"
"  keys: the others use dim), and an int or None given for a container\n"
"  applies to every leaf under it.\n"
"chunk_sizes: len(target_devices) ints >= 0, the rows along the split dim of\n"
"  each device, the same for every split array, which must each have\n"
"  sum(chunk_sizes) rows (torch.cuda.comm.scatter's chunk_sizes, spec 0.7;\n"
"  PyTorch's DataParallel lacks it, pytorch issue 46381). A 0 gives that\n"
"  device an empty chunk; devices after the last non-empty chunk idle.\n"
"weights: len(target_devices) finite numbers > 0: sizes proportional to\n"
"  them (largest remainder, so they sum to n; no device gets an empty chunk\n"
"  unless n < len(target_devices)). At most one of chunk_sizes and weights.\n"
"\n"
"Returns\n"
"  - a bare ndarray: a tuple of its chunks. torch.chunk rule (spec 0.1): pieces\n"
"    of ceil(n / len(target_devices)) rows along dim with a shorter last one,\n"
"    so there may be fewer chunks than devices (9 rows on 4 devices: 3,3,3);\n"
"    n == 0 gives one empty chunk per device. Chunk j is on target_devices[j],\n"
"    has the input's dtype, and is a view when that device is the array's own.\n"
"  - a non-empty tuple, list, dict or namedtuple: a list of k structures, one\n"
"    per replica, with chunk j of every array in structure j. Tuples and\n"
"    lists become plain tuples and lists, namedtuples type(obj)(*fields),\n"
"    dicts type(obj)(pairs) in key order. k is the smallest chunk count over\n"
"    all arrays, or len(target_devices) when there is no array.\n"
"  - anything else (None, str, numbers, NumPy scalars, empty containers,\n"
"    other objects): a list of len(target_devices) references to it.\n"
"  Non-array values inside structures are shared by reference, never copied.\n"
"\n"
"Raises\n"
"  ValueError: a 0-dim array (\"<path>: chunk expects at least a 1-dimensional\n"
"    array\"), before any copy (R22); with strict=True, arrays that split into\n"
"    different chunk counts (each path, shape, dim and size is listed);\n"
"    chunk_sizes that do not sum to an array's size (names it); bad\n"
"    chunk_sizes / weights (wrong length, negative, not finite or not > 0,\n"
"    both given); an in_dims entry that addresses a child that does not\n"
"    exist (names the entry, e.g. in_dims[1]['x']).\n"
"  IndexError: dim out of range for an array (names its path).\n"
"  TypeError: a dict subclass or namedtuple that cannot be rebuilt from its\n"
"    items (e.g. defaultdict), naming its path; an in_dims entry of the wrong\n"
"    type or shape (a tuple for an array, a dict for a list, a str).\n"
"Warns\n"
"  dpmini.SplitWarning: arrays split into different chunk counts and\n"
"    strict=False: every replica gets the first k chunks and the rows after\n"
"    them are dropped, as in PyTorch (R06); the warning names each path and\n"
"    the rows dropped.");

static PyObject *py_scatter(PyObject *module, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"inputs", "target_devices", "dim", "strict", "in_dims",
                             "chunk_sizes", "weights", NULL};
    PyObject *inputs, *devobj, *dimobj = NULL, *out = NULL, **res = NULL;
    PyObject *in_dims = Py_None, *csobj = Py_None, *wobj = Py_None;
    dp_device *devs = NULL;
    Py_ssize_t ndev = 0;
    int dim, strict = 0, kind;
    scatter_ctx c;
    path_seg root = seg_root("inputs"), sroot = seg_root("in_dims");
    int64_t sizes_buf[DP_MAX_DEVICES];
    double weights_buf[DP_MAX_DEVICES];
    dp_split_opts opts;

    memset(&c, 0, sizeof c);
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "OO|Op$OOO:scatter", kwlist, &inputs,
                                     &devobj, &dimobj, &strict, &in_dims, &csobj, &wobj))
        return NULL;
    dp_state *st = dp_state_from_module(module);
    if (parse_dim(dimobj, &dim) < 0 || dp_check_dims_spec(in_dims, "in_dims", 0) < 0)
        return NULL;
    if (dp_device_list_from_object(st, devobj, "target_devices", &devs, &ndev) < 0)
        return NULL;
    if (dp_parse_split_sizes(csobj, wobj, ndev, sizes_buf, weights_buf, &opts) < 0)
        goto done;
    if (ctx_init(&c, st, devs, ndev, dim, 0) < 0)
        goto done;
    c.chunk_sizes = opts.chunk_sizes;
    c.weights = opts.weights;
    if ((kind = scatter_kind(st, inputs)) < 0)
        goto done;
    if (collect(&c, inputs, &root, in_dims == Py_None ? NULL : in_dims, &sroot) < 0)
        goto done;
    scatter_count(&c);
    if (scatter_check(&c, strict) < 0 || scatter_copy(&c) < 0)
        goto done;
    res = PyMem_Calloc((size_t)c.k, sizeof *res);
    if (res == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    if (build(&c, inputs, &root, res) < 0 || check_all_taken(&c) < 0)
        goto done;
    /* spec 3.3: a bare array gives a tuple of chunks, a structure a list. */
    out = kind == S_ARRAY ? PyTuple_New(c.k) : PyList_New(c.k);
    if (out == NULL)
        goto done;
    for (int j = 0; j < c.k; j++) {
        if (kind == S_ARRAY)
            PyTuple_SET_ITEM(out, j, res[j]);
        else
            PyList_SET_ITEM(out, j, res[j]);
        res[j] = NULL;
    }
done:
    if (res != NULL) {
        for (int j = 0; j < c.k; j++)
            Py_XDECREF(res[j]);
        PyMem_Free(res);
    }
    ctx_clear(&c);
    PyMem_Free(devs);
    return out;
}

PyDoc_STRVAR(scatter_kwargs_doc,
"scatter_kwargs($module, inputs, kwargs, target_devices, dim=0, strict=False,\n"
"               in_dims=None, chunk_sizes=None, weights=None)\n"
"--\n"
"\n"
"Split positional and keyword arguments for each replica, as\n"
"torch.nn.parallel.scatter_kwargs (spec 2.7, 3) with dpmini's replica count.\n"
"\n"
"inputs: the positional arguments, a tuple; None means none, any other\n"
"  object is one positional argument (inputs,) (spec 2.9).\n"
"kwargs: a dict or None.\n"
"target_devices, dim, strict, chunk_sizes, weights: as in dpmini.scatter.\n"
"in_dims: None (every array split along dim), an int or None for every\n"
"  argument, a tuple/list mirroring a prefix of the positional arguments\n"
"  (in_dims=(0, None): args[0] split on dim 0, args[1] broadcast, the rest\n"
"  on dim), or a dict addressing arguments by position (int keys) and by\n"
"  keyword name (str keys): {0: 1, 'mask': None}. Entries nest as in\n"
"  dpmini.scatter; every entry must name an argument of the call\n"
"  (ValueError naming it, e.g. in_dims['mask']).\n"
"\n"
"Returns (inputs_tuple, kwargs_tuple), each with exactly k entries: a tuple\n"
"of positional arguments and a dict of keyword arguments per replica. k is\n"
"the smallest chunk count over ALL arrays of inputs and kwargs together, or\n"
"len(target_devices) when there is no array: non-array values never add\n"
"replicas, so no replica runs without its inputs (R04; PyTorch pads the\n"
"short side instead). A side that is empty is () or {} in every replica.\n"
"With no arguments at all the result is ((), ()); DataParallel then runs one\n"
"replica with ((),), ({},) (spec 2.4).\n"
"\n"
"Raises and warns as dpmini.scatter; paths name the argument, e.g. args[0],\n"
"args[1]['img'], args[0].a (namedtuple field) or kwargs['mask'].");

static PyObject *py_scatter_kwargs(PyObject *module, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"inputs", "kwargs", "target_devices", "dim", "strict",
                             "in_dims", "chunk_sizes", "weights", NULL};
    PyObject *inputs, *kwobj, *devobj, *dimobj = NULL;
    PyObject *in_dims = Py_None, *csobj = Py_None, *wobj = Py_None;
    PyObject *ins = NULL, *kw = NULL, *in_out = NULL, *kw_out = NULL, *res = NULL;
    dp_device *devs = NULL;
    Py_ssize_t ndev = 0;
    int dim, strict = 0;
    int64_t sizes_buf[DP_MAX_DEVICES];
    double weights_buf[DP_MAX_DEVICES];
    dp_split_opts opts;

    if (!PyArg_ParseTupleAndKeywords(args, kwds, "OOO|Op$OOO:scatter_kwargs", kwlist,
                                     &inputs, &kwobj, &devobj, &dimobj, &strict,
                                     &in_dims, &csobj, &wobj))
        return NULL;
    dp_state *st = dp_state_from_module(module);
    if (parse_dim(dimobj, &dim) < 0 || normalize_kwargs(kwobj, &kw) < 0)
        return NULL;
    if ((ins = normalize_inputs(inputs)) == NULL)
        return NULL;
    if (dp_device_list_from_object(st, devobj, "target_devices", &devs, &ndev) < 0)
        goto done;
    if (dp_parse_split_sizes(csobj, wobj, ndev, sizes_buf, weights_buf, &opts) < 0)
        goto done;
    opts.dim = dim;
    opts.strict = strict;
    opts.in_dims = in_dims;
    if (dp_scatter_kwargs_ex(st, ins, kw, devs, ndev, &opts, &in_out, &kw_out) < 0)
        goto done;
    res = PyTuple_Pack(2, in_out, kw_out);
done:
    Py_XDECREF(in_out);
    Py_XDECREF(kw_out);
    Py_DECREF(ins);
    PyMem_Free(devs);
    return res;
}

PyDoc_STRVAR(gather_doc,
"gather($module, outputs, target_device, dim=0, out_dims=None)\n"
"--\n"
"\n"
"Combine the replicas' outputs onto target_device, as\n"
"torch.nn.parallel.gather (spec 4) with dpmini's checks (docs/design.md).\n"
"\n"
"outputs: a list or tuple with one output per replica (at least one).\n"
"target_device: a device, or the host (\"cpu\" or -1; -1 warns FutureWarning\n"
"  as PyTorch does).\n"
"dim: the axis to concatenate along, wrapped against each array's rank.\n"
"out_dims: None (the rules below along dim, PyTorch), or a structure that\n"
"  mirrors replica 0's output (JAX pmap's out_axes): an int gathers along\n"
"  that dim; None returns replica 0's value (arrays copied to target_device)\n"
"  after checking that every replica returned an equal one (numpy\n"
"  array_equal for arrays: same shape and values), TypeError naming the\n"
"  path otherwise; \"sum\" adds the replicas' values: arrays (same shape)\n"
"  with comm.reduce_add onto target_device, in replica order, in replica\n"
"  0's dtype; numbers with +; None stays None; str/bytes are refused. A\n"
"  tuple/list mirrors a list/tuple/namedtuple by position (a prefix), a dict\n"
"  mirrors a dict by key or a dataclass by field name (a subset); what it\n"
"  leaves out uses dim. An int, None or \"sum\" given for a container\n"
"  applies to every leaf under it.\n"
"\n"
"outputs[0] picks the rule at each position and every replica is checked:\n"
"  ndarray (or NumPy scalar, taken as a 0-dim array): concatenated along\n"
"    dim onto target_device (dtype of replica 0,\n"
"    others cast; other sizes must match, spec 4.6). When every replica\n"
"    returns a 0-dim array and dim == 0, the result is a vector of one value\n"
"    per replica, with PyTorch's UserWarning (spec 4.5, R20).\n"
"  None: None.  dict: key by key, replica 0's key order and dict type (R14).\n"
"  namedtuple: field by field, type(out)._make.  dataclass: field by field,\n"
"  rebuilt with the class (R17).  list/tuple: position by position (R18).\n"
"  str, bytes, Python numbers: the value, once, when all\n"
"  replicas return an equal value.  Any other object: that object, when all\n"
"  replicas return the same one.\n"
"\n"
"Raises (messages name the position, e.g. out['logits'][1] or out.loss)\n"
"  TypeError: replicas returned different kinds of value at one position\n"
"    (the type from each replica is listed, R19), different str/number\n"
"    values, or different other objects; outputs not a list or tuple.\n"
"  ValueError: dicts with different numbers of keys (\"All dicts must have\n"
"    the same number of keys\") or a missing key, sequences of different\n"
"    lengths, 0-dim arrays with dim != 0, array shapes that differ outside\n"
"    dim (spec 4.6), no outputs.\n"
"  IndexError: dim out of range.");

static PyObject *py_gather(PyObject *module, PyObject *args, PyObject *kwds)
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
    /* spec 4.3: -1 for the host still works but is deprecated. */
    if (PyLong_Check(target_obj) && !PyBool_Check(target_obj)) {
        int overflow;
        long v = PyLong_AsLongAndOverflow(target_obj, &overflow);
        if (v == -1 && !overflow && !PyErr_Occurred() &&
            PyErr_WarnEx(PyExc_FutureWarning,
                         "Using -1 to represent CPU tensor is deprecated. Please use "
                         "a device object or string instead, e.g., \"cpu\".", 1) < 0)
            return NULL;
        if (PyErr_Occurred())
            return NULL;
    }
    return dp_gather_outputs_ex(st, outputs, target, dim, out_dims);
}

PyDoc_STRVAR(plan_doc,
"_plan($module, inputs, kwargs, device_ids, dim=0, strict=False, in_dims=None,\n"
"      chunk_sizes=None, weights=None)\n"
"--\n"
"\n"
"Describe what scatter_kwargs(inputs, kwargs, device_ids, dim, strict) would\n"
"do, without copying anything (the data behind dpmini.explain / Plan).\n"
"\n"
"inputs, kwargs, dim, strict, in_dims, chunk_sizes, weights: as in\n"
"dpmini.scatter_kwargs (in_dims and chunk_sizes/weights of the wrong type or\n"
"length raise, as DataParallel's constructor does); device_ids: a\n"
"sequence of devices, or None for the default devices.\n"
"\n"
"Returns a dict:\n"
"  'devices': [Device, ...] (all of device_ids);\n"
"  'replicas': k, the number of replicas that would run (1 when there are no\n"
"    arguments at all, as DataParallel runs it; 0 when 'error' is set);\n"
"  'rule': how sizes are computed: 'chunk' (torch.chunk), 'chunk_sizes' or\n"
"    'weights';\n"
"  'leaves': one dict per array, in argument order: 'path' (str), 'shape'\n"
"    (tuple), 'dtype' (numpy.dtype), 'itemsize' (int), 'broadcast' (bool:\n"
"    in_dims None; then 'dim', 'sizes' and 'starts' are None and 'nbytes'\n"
"    the whole array's bytes on every device that runs a replica), 'dim'\n"
"    (wrapped int),\n"
"    and lists with one int per device: 'sizes' (rows along dim; 0 for a\n"
"    device that gets nothing), 'starts' (first row along dim), 'nbytes'\n"
"    (bytes of the chunk). With 'error' set the sizes are each array's own\n"
"    chunking, not truncated to a common count;\n"
"  'shared': paths of the non-array values, passed by reference to every\n"
"    replica (e.g. \"kwargs['flag']\");\n"
"  'warnings': the SplitWarning texts the call would issue;\n"
"  'error': None, or the message of the ValueError / IndexError / TypeError\n"
"    the call would raise for its arguments (0-dim array, dim out of range,\n"
"    strict mismatch, chunk_sizes not summing to an array's size, an in_dims\n"
"    structure that does not match the arguments).");

static PyObject *py_plan(PyObject *module, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"inputs", "kwargs", "device_ids", "dim", "strict", "in_dims",
                             "chunk_sizes", "weights", NULL};
    PyObject *inputs, *kwobj, *devobj, *dimobj = NULL;
    PyObject *in_dims = Py_None, *csobj = Py_None, *wobj = Py_None;
    PyObject *ins = NULL, *kw = NULL, *res = NULL;
    PyObject *args_spec = NULL, *kw_spec = NULL, *own[2] = {NULL, NULL};
    dp_device *devs = NULL;
    Py_ssize_t ndev = 0;
    int dim, strict = 0;
    scatter_ctx c;
    path_seg kw_root = seg_root("kwargs"), sroot = seg_root("in_dims");
    int64_t sizes_buf[DP_MAX_DEVICES];
    double weights_buf[DP_MAX_DEVICES];
    dp_split_opts opts;

    memset(&c, 0, sizeof c);
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "OOO|Op$OOO:_plan", kwlist, &inputs,
                                     &kwobj, &devobj, &dimobj, &strict, &in_dims, &csobj,
                                     &wobj))
        return NULL;
    dp_state *st = dp_state_from_module(module);
    if (parse_dim(dimobj, &dim) < 0 || normalize_kwargs(kwobj, &kw) < 0 ||
        dp_check_dims_spec(in_dims, "in_dims", 0) < 0)
        return NULL;
    if ((ins = normalize_inputs(inputs)) == NULL)
        return NULL;
    if (devobj == Py_None) {
        if (dp_default_devices(st, &devs, &ndev) < 0)
            goto done;
    }
    else if (dp_device_list_from_object(st, devobj, "device_ids", &devs, &ndev) < 0) {
        goto done;
    }
    if (dp_parse_split_sizes(csobj, wobj, ndev, sizes_buf, weights_buf, &opts) < 0)
        goto done;
    if (ctx_init(&c, st, devs, ndev, dim, 1) < 0)
        goto done;
    c.chunk_sizes = opts.chunk_sizes;
    c.weights = opts.weights;
    int has_kw = kw != NULL && PyDict_GET_SIZE(kw) > 0;
    /* An in_dims that does not fit the call is recorded as the plan's error. */
    if (split_top_spec(in_dims, PyTuple_GET_SIZE(ins), has_kw ? kw : NULL, &args_spec,
                       &kw_spec, own) < 0) {
        if (absorb_error(&c) < 0)
            goto done;
    }
    else {
        if (PyTuple_GET_SIZE(ins) > 0 && collect_args(&c, ins, args_spec) < 0)
            goto done;
        if (has_kw && collect(&c, kw, &kw_root, kw_spec, &sroot) < 0)
            goto done;
    }
    scatter_count(&c);
    res = plan_result(&c, strict, PyTuple_GET_SIZE(ins) == 0 && !has_kw);
done:
    Py_XDECREF(own[0]);
    Py_XDECREF(own[1]);
    ctx_clear(&c);
    Py_DECREF(ins);
    PyMem_Free(devs);
    return res;
}

PyMethodDef dp_tree_methods[] = {
    {"scatter", (PyCFunction)(void (*)(void))py_scatter,
     METH_VARARGS | METH_KEYWORDS, scatter_doc},
    {"scatter_kwargs", (PyCFunction)(void (*)(void))py_scatter_kwargs,
     METH_VARARGS | METH_KEYWORDS, scatter_kwargs_doc},
    {"gather", (PyCFunction)(void (*)(void))py_gather,
     METH_VARARGS | METH_KEYWORDS, gather_doc},
    {"_plan", (PyCFunction)(void (*)(void))py_plan,
     METH_VARARGS | METH_KEYWORDS, plan_doc},
    {NULL, NULL, 0, NULL}
};
