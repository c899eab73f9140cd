/* scatter.c - scatter of nested Python structures: DataParallel's
 * scatter_kwargs (docs/spec.md 2.3-2.8, 3) with the decisions of docs/design.md,
 * and the Python functions dpmini.scatter and dpmini.scatter_kwargs.
 *
 * Scatter runs in four passes, so that every check happens before the first
 * copy and every array goes out in a single dp_scatter_run:
 *   (a) collect: walk inputs and kwargs; record each array leaf with its path
 *       ("args[1]['img']"), its wrapped dim and its chunk sizes (plan.c);
 *   (b) decide:  k = the smallest chunk count over all leaves, or the number
 *       of devices when there is none; different counts warn SplitWarning,
 *       or raise ValueError under strict=True, with messages that list
 *       every array leaf;
 *   (c) copy:    one dp_scatter_run for all leaves, k chunks each;
 *   (d) build:   walk the structures again and make k per-replica copies,
 *       chunk j of each leaf going into replica j.
 * Passes (a) and (d) must visit the leaves in the same order; (d) checks
 * that by identity and fails if user code changed the inputs in between.
 * _plan (explain.c) runs passes (a) and (b) only and describes the outcome
 * as a dict; what it shares with this file (scatter_ctx, pass (a) and (b))
 * is declared in tree.h.
 *
 * in_dims (JAX pmap's in_axes as the model) is walked alongside the inputs
 * in pass (a): it decides, per array leaf, the dim to split along or None
 * (broadcast: the whole array to every replica, copied in pass (c) with
 * dp_broadcast_coalesced). chunk_sizes / weights replace the torch.chunk
 * sizes of every split leaf (plan.c). Pass (d) needs none of it: every
 * array leaf has its k pieces ready, split or broadcast.
 *
 * Paths in messages are built lazily from a chain of path_seg structs on the
 * C stack, so only array leaves (and errors) pay for formatting them.
 *
 * Sections: pass (a): collect; the top of pass (a): in_dims split into the
 * entries of the positional and keyword arguments, and the positional
 * arguments; pass (b): count and check; pass (c): copy; pass (d): build;
 * scatter_kwargs; the Python functions.
 */
#include "dpmini.h"
#include "tree.h"
#include "walk.h"
#include "plan.h"
#include "engine.h"
#include "profile.h"

#include <limits.h>

/* The rule of docs/spec.md 3.1 for obj: one of S_*, or -1 with an exception set. */
static int scatter_kind(dp_state *st, PyObject *obj);

/* The children of a container of kind S_* (a tuple snapshot; for S_DICT
 * the flat (k0, v0, k1, v1, ...) of dict_flat). */
static PyObject *container_items(PyObject *obj, int kind);

/* Child i of a container walked through container_items (borrowed); sets *seg. */
static PyObject *container_child(int kind, PyObject *items, PyObject *names,
                          Py_ssize_t i, const path_seg *up, path_seg *seg);

/* How many children container_items gave. */
static Py_ssize_t items_len(int kind, PyObject *items);

/* Pass (b), checks: strict -> ValueError, else SplitWarning. */
static int scatter_check(scatter_ctx *c, int strict);

/* Pass (c): every split leaf's first c->k chunks in one dp_scatter_run,
 * and the broadcast leaves' copies. */
static int scatter_copy(scatter_ctx *c);
/* Pass (d): res[j] = obj as replica j sees it (c->k new references; all
 * NULL on failure). */
static int scatter_build(scatter_ctx *c, PyObject *obj, const path_seg *seg, PyObject **res);
/* After pass (d): every leaf was handed out, else RuntimeError. */
static int scatter_check_all_taken(scatter_ctx *c);

/* ------------------------------------------------------------------ */
/* Pass (a): collect                                                   */
/* ------------------------------------------------------------------ */

int ctx_init(scatter_ctx *c, dp_state *st, const dp_device *devs,
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
    c->node_top = -1;
    if (plan) {
        c->shared = PyList_New(0);
        if (c->shared == NULL)
            return -1;
    }
    return 0;
}

void ctx_clear(scatter_ctx *c)
{
    for (Py_ssize_t i = 0; i < c->nleaves; i++) {
        scatter_leaf *lf = &c->leaves[i];
        Py_CLEAR(lf->obj);
        Py_CLEAR(lf->arr);
        Py_CLEAR(lf->origin);
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
    for (Py_ssize_t i = 0; i < c->nnodes; i++)
        Py_CLEAR(c->nodes[i].name);
    PyMem_Free(c->nodes);
    c->nodes = NULL;
    c->nnodes = c->ncap = 0;
    c->node_top = -1;
    Py_CLEAR(c->shared);
    Py_CLEAR(c->error);
}

/* The rule of docs/spec.md 3.1 for obj: one of S_*, or -1 with an exception set. */
static int scatter_kind(dp_state *st, PyObject *obj)
{
    if (PyArray_CheckExact(obj))
        return S_ARRAY;   /* the usual leaf, first */
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
        if (r < 0 || (r && refuse_unsplittable(obj, NULL, "scattered") < 0))
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
 * snapshot) or S_DICT (dict_flat's (k0, v0, k1, v1, ...)), as a new
 * reference. */
static PyObject *container_items(PyObject *obj, int kind)
{
    return kind == S_DICT ? dict_flat(obj) : seq_snapshot(obj);
}

/* Child i of a container walked through container_items: sets *seg and
 * returns the child (borrowed from items). */
static PyObject *container_child(int kind, PyObject *items, PyObject *names,
                          Py_ssize_t i, const path_seg *up, path_seg *seg)
{
    if (kind == S_DICT) {
        *seg = seg_child(up, SEG_KEY, 0, container_key(items, i));
        return PyTuple_GET_ITEM(items, 2 * i + 1);
    }
    if (names != NULL)
        *seg = seg_child(up, SEG_ATTR, 0, PyTuple_GET_ITEM(names, i));
    else
        *seg = seg_child(up, SEG_INDEX, i, NULL);
    return PyTuple_GET_ITEM(items, i);
}

static Py_ssize_t items_len(int kind, PyObject *items)
{
    return kind == S_DICT ? PyTuple_GET_SIZE(items) / 2 : PyTuple_GET_SIZE(items);
}

/* ------------------------------------------------------------------ */
/* Paths of the leaves                                                 */
/* ------------------------------------------------------------------ */

/* Grow *buf (elsize-byte items, *cap of them) to hold `need`, doubling from
 * `first`; at most INT_MAX items (their indexes are ints). */
static int grow_items(void **buf, Py_ssize_t *cap, Py_ssize_t need, Py_ssize_t first,
                      size_t elsize)
{
    if (need <= *cap)
        return 0;
    Py_ssize_t n = *cap ? 2 * *cap : first;
    while (n < need)
        n *= 2;
    if (n > INT_MAX) {
        PyErr_SetString(PyExc_ValueError, "scatter: too many arrays");
        return -1;
    }
    void *grown = PyMem_Realloc(*buf, (size_t)n * elsize);
    if (grown == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    *buf = grown;
    *cap = n;
    return 0;
}

/* Room for `nodes` more path steps and `leaves` more leaves (one
 * allocation per container rather than a doubling per few leaves). */
static int ctx_reserve(scatter_ctx *c, Py_ssize_t nodes, Py_ssize_t leaves)
{
    void *nb = c->nodes, *lb = c->leaves;
    int rc = grow_items(&nb, &c->ncap, c->nnodes + nodes, 32, sizeof *c->nodes);
    c->nodes = nb;
    if (rc == 0)
        rc = grow_items(&lb, &c->cap, c->nleaves + leaves, 8, sizeof *c->leaves);
    c->leaves = lb;
    return rc;
}

/* The node of seg, kept in c->nodes: the steps from seg up to the
 * container being walked (c->node_top, whose step is live on the stack) are
 * added. Returns its index, or -1 with MemoryError. */
static int node_of(scatter_ctx *c, const path_seg *seg)
{
    const path_seg *few[8], **chain = few;
    int n = 0, rc = -1;
    for (const path_seg *s = seg; s != NULL; s = s->up) {
        if (c->node_top >= 0 && c->nodes[c->node_top].seg == s)
            break;
        n++;
    }
    if (n == 0)
        return c->node_top;
    if (n > (int)(sizeof few / sizeof few[0])) {
        chain = PyMem_Malloc((size_t)n * sizeof *chain);
        if (chain == NULL) {
            PyErr_NoMemory();
            return -1;
        }
    }
    int k = n;
    for (const path_seg *s = seg; k > 0; s = s->up)
        chain[--k] = s;   /* chain[0]: the step just below node_top */
    if (c->nnodes + n > c->ncap && ctx_reserve(c, n, 0) < 0)
        goto done;
    int up = c->node_top;
    for (int i = 0; i < n; i++) {
        path_node *nd = &c->nodes[c->nnodes];
        nd->up = up;
        nd->kind = chain[i]->kind;
        nd->root = chain[i]->root;
        nd->index = chain[i]->index;
        nd->name = Py_XNewRef(chain[i]->name);
        nd->seg = chain[i];
        up = (int)c->nnodes++;
    }
    rc = up;
done:
    if (chain != few)
        PyMem_Free(chain);
    return rc;
}

PyObject *leaf_path(scatter_ctx *c, scatter_leaf *lf)
{
    if (lf->path != NULL)
        return lf->path;
    int n = 0;
    for (int i = lf->node; i >= 0; i = c->nodes[i].up)
        n++;
    if (n == 0) {
        PyErr_SetString(PyExc_SystemError, "scatter: a leaf without a path");
        return NULL;
    }
    path_seg few[16], *segs = few;
    if (n > (int)(sizeof few / sizeof few[0])) {
        segs = PyMem_Malloc((size_t)n * sizeof *segs);
        if (segs == NULL)
            return PyErr_NoMemory();
    }
    int k = n;
    for (int i = lf->node; i >= 0; i = c->nodes[i].up) {
        path_node *nd = &c->nodes[i];
        k--;
        segs[k].kind = nd->kind;
        segs[k].root = nd->root;
        segs[k].index = nd->index;
        segs[k].name = nd->name;
    }
    for (k = 0; k < n; k++) {
        segs[k].up = k > 0 ? &segs[k - 1] : NULL;
        segs[k].depth = k;
    }
    lf->path = path_str(&segs[n - 1]);
    if (segs != few)
        PyMem_Free(segs);
    return lf->path;
}

/* Plan mode: keep the first caller error as text and go on; otherwise (or
 * for other errors) leave it pending. Returns 0 when absorbed, else -1. */
int absorb_error(scatter_ctx *c)
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
        /* torch.cuda.comm.scatter's chunk_sizes (docs/spec.md 0.7, 8.5), for every
         * split leaf: the sizes must add up to each one's length. */
        memcpy(sizes, c->chunk_sizes, (size_t)c->ndev * sizeof(int64_t));
        if (dp_check_chunk_sizes(n, c->ndev, sizes, NULL) != DP_OK) {
            /* Each size is >= 0, but their sum can pass INT64_MAX: say so
             * (as comm.scatter does) instead of printing a wrapped sum. */
            long long sum = 0;
            int overflow = 0;
            for (int j = 0; j < c->ndev && !overflow; j++)
                overflow = __builtin_add_overflow(sum, (long long)sizes[j], &sum);
            PyObject *total = overflow
                ? PyUnicode_FromFormat("more than %lld", (long long)INT64_MAX)
                : PyUnicode_FromFormat("%lld", sum);
            PyObject *sz = total != NULL ? sizes_repr(sizes, c->ndev) : NULL;
            PyObject *shape = sz != NULL ? shape_repr(arr) : NULL;
            if (shape != NULL)
                PyErr_Format(PyExc_ValueError,
                             "%s: chunk_sizes %U sum to %U, but the array has size "
                             "%lld along dim %d (shape %U); chunk_sizes must sum to the "
                             "size of every split array (give the others in_dims None "
                             "to broadcast them)", cpath, sz, total, (long long)n, wdim,
                             shape);
            Py_XDECREF(total);
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

/* One array leaf measured in pass (a): what its scatter_leaf records. */
typedef struct {
    PyArrayObject *arr;   /* new reference                                  */
    int64_t *sizes;       /* PyMem, c->ndev chunk sizes; NULL: broadcast    */
    int wdim, count;      /* the wrapped dim, the chunks it splits into     */
    int bcast;            /* in_dims None: the whole array to every replica */
} leaf_split;

/* What a step of collect_leaf returns: done, an error about this leaf (plan
 * mode may absorb it), or a failure to pass on. */
enum { LEAF_OK = 0, LEAF_BAD = -1, LEAF_FAIL = -2 };

/* The usual leaf: a plain ndarray of numbers split along the default dim
 * into torch.chunk sizes. Nothing in it can fail with a message that names
 * the path, so the path is not written. 1 with ls filled, 0 when obj is not
 * such a leaf, -1 with MemoryError. */
static int plain_leaf(scatter_ctx *c, PyObject *obj, PyObject *spec, leaf_split *ls)
{
    if (spec != NULL || c->chunk_sizes != NULL || c->weights != NULL ||
        !PyArray_CheckExact(obj) || PyDataType_REFCHK(PyArray_DESCR((PyArrayObject *)obj)))
        return 0;
    int nd = PyArray_NDIM((PyArrayObject *)obj), dim = c->dim;
    if (nd == 0 || dim < -nd || dim >= nd)
        return 0;
    int wdim = dim < 0 ? dim + nd : dim;
    int64_t *sizes = PyMem_Malloc((size_t)c->ndev * sizeof(int64_t));
    if (sizes == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    int count = dp_chunk_sizes((int64_t)PyArray_DIM((PyArrayObject *)obj, wdim), c->ndev,
                               sizes);
    if (count < 1) {
        PyMem_Free(sizes);   /* never: the general route reports it */
        return 0;
    }
    *ls = (leaf_split){(PyArrayObject *)Py_NewRef(obj), sizes, wdim, count, 0};
    return 1;
}

/* A leaf's in_dims entry (NULL or None: *dim as it is, an int: that dim).
 * 0, or -1: a container entry (TypeError naming both paths) or no int. */
static int leaf_dim(PyObject *spec, const path_seg *seg, const path_seg *sseg, int *dim)
{
    if (spec_is_container(spec)) {
        spec_mismatch(sseg, spec, seg, "an array", NULL);
        return -1;
    }
    if (spec == NULL || spec == Py_None)
        return 0;
    PyObject *sp = path_str(sseg);
    const char *csp = sp != NULL ? PyUnicode_AsUTF8(sp) : NULL;
    int r = csp != NULL ? dp_int_from_object(spec, csp, dim) : -1;
    Py_XDECREF(sp);
    return r;
}

/* Any other leaf, at cpath: its in_dims entry read, then the array taken
 * whole (broadcast) or measured along its dim. LEAF_OK with ls filled,
 * LEAF_BAD or LEAF_FAIL. */
static int measure_leaf(scatter_ctx *c, PyObject *obj, const char *cpath, const path_seg *seg,
                        PyObject *spec, const path_seg *sseg, leaf_split *ls)
{
    int dim = c->dim;
    if (leaf_dim(spec, seg, sseg, &dim) < 0)
        return LEAF_BAD;
    if (ls->bcast) {
        /* in_dims None: the whole array, any rank (0-dim included), to every
         * replica; it takes no part in the replica count. */
        ls->arr = dp_as_array(c->st, obj, cpath, 0);
        return ls->arr != NULL ? LEAF_OK : LEAF_BAD;
    }
    /* docs/spec.md 0.5, 10.3: never broadcast a 0-dim array, refuse it up front. */
    if (PyArray_Check(obj) && PyArray_NDIM((PyArrayObject *)obj) == 0) {
        dp_raise_zero_dim(c->st, cpath);
        return LEAF_BAD;
    }
    ls->arr = dp_as_array(c->st, obj, cpath, 1);
    /* docs/spec.md 0.6, 10.4: a negative dim is wrapped for each array on its own. */
    if (ls->arr == NULL || dp_wrap_dim_or_raise(dim, PyArray_NDIM(ls->arr), cpath,
                                                &ls->wdim) < 0)
        return LEAF_BAD;
    ls->sizes = PyMem_Malloc((size_t)c->ndev * sizeof(int64_t));
    if (ls->sizes == NULL) {
        PyErr_NoMemory();
        return LEAF_FAIL;
    }
    ls->count = leaf_sizes(c, ls->arr, ls->wdim, cpath, ls->sizes);
    if (ls->count < 0) {
        PyMem_Free(ls->sizes);
        ls->sizes = NULL;
        return LEAF_BAD;
    }
    return LEAF_OK;
}

/* The leaf appended to c->leaves, taking ls's array and sizes. 0 or -1. */
static int record_leaf(scatter_ctx *c, PyObject *obj, const path_seg *seg, leaf_split *ls)
{
    PyObject *origin = dp_array_origin(c->st, obj);
    if (origin == NULL)
        return -1;
    int node = node_of(c, seg);
    if (node < 0 || (c->nleaves == c->cap && ctx_reserve(c, 0, 1) < 0)) {
        Py_DECREF(origin);
        return -1;
    }
    scatter_leaf *lf = &c->leaves[c->nleaves++];
    lf->obj = Py_NewRef(obj);
    lf->arr = ls->arr;
    lf->origin = origin;
    lf->node = node;
    lf->path = NULL;
    lf->bcast = ls->bcast;
    lf->dim = ls->wdim;
    lf->count = ls->count;
    lf->sizes = ls->sizes;
    ls->arr = NULL;
    ls->sizes = NULL;
    return 0;
}

/* Pass (a) for one array leaf. spec: its in_dims entry (NULL: c->dim, an
 * int: that dim, None: broadcast); sseg its path. */
static int collect_leaf(scatter_ctx *c, PyObject *obj, const path_seg *seg,
                        PyObject *spec, const path_seg *sseg)
{
    leaf_split ls = {NULL, NULL, 0, 0, spec == Py_None};
    int r = plain_leaf(c, obj, spec, &ls);
    if (r == 0) {
        PyObject *owned = NULL;
        char buf[256];
        const char *cpath = path_text(seg, buf, sizeof buf, &owned);
        r = cpath != NULL ? measure_leaf(c, obj, cpath, seg, spec, sseg, &ls) : LEAF_FAIL;
        Py_XDECREF(owned);
    }
    else {
        r = r > 0 ? LEAF_OK : LEAF_FAIL;
    }
    if (r == LEAF_OK && record_leaf(c, obj, seg, &ls) == 0)
        return 0;
    int res = r == LEAF_BAD && absorb_error(c) == 0 ? 0 : -1;
    PyMem_Free(ls.sizes);
    Py_XDECREF(ls.arr);
    return res;
}

/* Pass (a) for the children of a container of the given kind. spec: its
 * in_dims entry (NULL: the default everywhere below), sseg its path. */
static int collect_container(scatter_ctx *c, PyObject *obj, int kind,
                             const path_seg *seg, PyObject *spec, const path_seg *sseg)
{
    PyObject *items = NULL, *names = NULL, *fast = NULL;
    int rc = -1;

    if (check_depth(seg, "inputs") < 0 || Py_EnterRecursiveCall(" while scattering inputs"))
        return -1;
    int outer = c->node_top, me = node_of(c, seg);
    if (me < 0)
        goto done;
    c->node_top = me;   /* the leaves below keep their paths from here */
    items = container_items(obj, kind);
    if (items == NULL) {
        /* a dict subclass's own items() failed: name its path */
        PyObject *path = path_str(seg);
        dp_reraise_at(c->st, path);
        Py_XDECREF(path);
        goto done;
    }
    Py_ssize_t n = items_len(kind, items);
    /* every child may be a leaf: one step and one leaf each */
    if (ctx_reserve(c, n, n) < 0)
        goto done;
    if (kind == S_NAMEDTUPLE)
        names = namedtuple_names(obj, n);
    if (spec_is_container(spec)) {
        /* A tuple/list mirrors a tuple, list or namedtuple by position; a
         * dict mirrors a dict by key. */
        int dict_spec = PyDict_Check(spec);
        if (dict_spec != (kind == S_DICT)) {
            spec_mismatch(sseg, spec, seg, kind == S_DICT ? "a dict" : "a sequence",
                          kind == S_DICT
                              ? "a dict instead (by key), or an int or None for it"
                              : "a tuple or list instead (by position, e.g. (0, 1)), or "
                                "an int or None for it; a dict's int keys address positional "
                                "arguments only at the top of the in_dims of DataParallel, "
                                "scatter_kwargs and explain");
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
        PyObject *key = kind == S_DICT ? container_key(items, i) : NULL;
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
    c->node_top = outer;
    Py_XDECREF(items);
    Py_XDECREF(names);
    Py_XDECREF(fast);
    Py_LeaveRecursiveCall();
    return rc;
}

/* Pass (a): record the array leaves under obj (and, for _plan, the paths of
 * the shared leaves). spec: obj's in_dims entry (NULL: the default). */
int collect(scatter_ctx *c, PyObject *obj, const path_seg *seg,
            PyObject *spec, const path_seg *sseg)
{
    int kind = scatter_kind(c->st, obj);
    if (kind < 0) {
        /* probing obj for the array protocols raised, or obj cannot be split
         * (refuse_unsplittable): name its path; a plan keeps it as its error */
        PyObject *path = path_str(seg);
        dp_reraise_at(c->st, path);
        Py_XDECREF(path);
        return absorb_error(c);
    }
    if (kind == S_ARRAY)
        return collect_leaf(c, obj, seg, spec, sseg);
    if (kind == S_SHARED) {
        /* Shared values are never split; an int or None for them is fine,
         * but a non-empty structure addresses children that are not there. */
        if (spec_is_container(spec) && PyObject_Length(spec) > 0) {
            spec_mismatch(sseg, spec, seg, "not split (a value shared by every replica)", NULL);
            return absorb_error(c);
        }
        return c->plan ? append_steal(c->shared, path_str(seg)) : 0;
    }
    return collect_container(c, obj, kind, seg, spec, sseg);
}

/* ------------------------------------------------------------------ */
/* in_dims at the top, positional arguments                            */
/* ------------------------------------------------------------------ */

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
int split_top_spec(PyObject *in_dims, Py_ssize_t nin, PyObject *kwargs,
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
        else if (dp_is_index_like(key)) {
            PyObject *ik = PyNumber_Index(key);  /* numpy ints too: one int key */
            if (ik == NULL)
                return -1;
            Py_ssize_t i = PyLong_AsSsize_t(ik);
            if (i == -1 && PyErr_Occurred())
                PyErr_Clear();
            int set = (i >= 0 && i < nin) ? PyDict_SetItem(a, ik, value) : 0;
            Py_DECREF(ik);
            if (set < 0)
                return -1;
            if (i < 0 || i >= nin)
                return raise_at(PyExc_ValueError, &kseg,
                                "the call has %zd positional argument%s, so int keys "
                                "must be in 0..%zd", nin, nin == 1 ? "" : "s", nin - 1);
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
int collect_args(scatter_ctx *c, PyObject *inputs, PyObject *args_spec)
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

/* ------------------------------------------------------------------ */
/* Pass (b): count and check                                           */
/* ------------------------------------------------------------------ */

/* The one condition behind both SplitWarning and strict=True's ValueError:
 * does leaf lf lose rows when only the first c->k chunks are used, i.e. has
 * it more chunks than k and rows in them? An array with 0 rows along its
 * dim has more chunks than k (torch.chunk gives it one empty chunk per
 * device) but loses nothing, so it neither warns nor raises. *kept: the
 * rows the first k chunks hold (may be NULL). */
static int leaf_drops_rows(const scatter_ctx *c, const scatter_leaf *lf, int64_t *kept)
{
    if (lf->bcast || lf->count <= c->k)
        return 0;
    int64_t n = (int64_t)PyArray_DIM(lf->arr, lf->dim), got = 0;
    for (int j = 0; j < c->k; j++)
        got += lf->sizes[j];
    if (kept != NULL)
        *kept = got;
    return got < n;
}

/* Pass (b): the replica count, and c->mismatch: whether any leaf loses rows
 * (leaf_drops_rows), the condition for SplitWarning and for strict=True. */
void scatter_count(scatter_ctx *c)
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
    c->k = k;
    for (Py_ssize_t i = 0; i < c->nleaves; i++)
        if (leaf_drops_rows(c, &c->leaves[i], NULL))
            c->mismatch = 1;
}

/* The strict=True error text (modelled on JAX pmap's, docs/spec.md 10.2): every array
 * path, its shape, the dim and the size along it. */
PyObject *strict_message(scatter_ctx *c)
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
        PyObject *path = leaf_path(c, lf);
        PyObject *shape = path != NULL ? shape_repr(lf->arr) : NULL;
        if (shape == NULL)
            goto done;
        PyObject *line = PyUnicode_FromFormat(
            "  %U: shape %U, size %lld along dim %d -> %d chunk%s", path, shape,
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
        PyObject *path = leaf_path(c, lf);
        if (path == NULL)
            goto done;
        if (append_steal(parts, PyUnicode_FromFormat("%U: %d chunk%s", path,
                                                     lf->count,
                                                     lf->count == 1 ? "" : "s")) < 0)
            goto done;
    }
    res = join_str(", ", parts);
done:
    Py_DECREF(parts);
    return res;
}

/* The SplitWarning text (docs/spec.md 10.2): every leaf that loses rows. *out = NULL when
 * none does (then c->mismatch is 0 too: the same leaf_drops_rows). */
int truncation_message(scatter_ctx *c, PyObject **out)
{
    PyObject *parts = PyList_New(0), *body = NULL, *counts = NULL;
    int rc = -1;
    *out = NULL;
    if (parts == NULL)
        return -1;
    for (Py_ssize_t i = 0; i < c->nleaves; i++) {
        scatter_leaf *lf = &c->leaves[i];
        int64_t n = lf->bcast ? 0 : (int64_t)PyArray_DIM(lf->arr, lf->dim), kept = 0;
        if (!leaf_drops_rows(c, lf, &kept))
            continue;
        /* "rows" only along dim 0; "indices" along any other dim. */
        const char *one = lf->dim == 0 ? "row" : "index";
        const char *many = lf->dim == 0 ? "rows" : "indices";
        PyObject *path = leaf_path(c, lf);
        if (path == NULL)
            goto done;
        PyObject *part = kept == n - 1
            ? PyUnicode_FromFormat("%U: %s %lld of %lld along dim %d is dropped",
                                   path, one, (long long)kept, (long long)n, lf->dim)
            : PyUnicode_FromFormat("%U: %s %lld..%lld of %lld along dim %d are dropped",
                                   path, many, (long long)kept, (long long)(n - 1),
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

/* Pass (b), checks: when some array loses rows (c->mismatch), strict ->
 * ValueError, else SplitWarning; otherwise neither. */
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

/* ------------------------------------------------------------------ */
/* Pass (c): copy                                                      */
/* ------------------------------------------------------------------ */

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
    /* Each leaf's pieces go back into its own library (torch in, torch
     * shards out), sharing the memory dpmini copied into (interop.c). */
    for (Py_ssize_t i = 0; r == 0 && i < c->nleaves; i++) {
        if (c->leaves[i].origin == Py_None)
            continue;   /* a NumPy or dpmini array: its chunks stay as they are */
        PyObject *path = leaf_path(c, &c->leaves[i]);
        const char *cpath = path != NULL ? PyUnicode_AsUTF8(path) : NULL;
        if (cpath == NULL ||
            dp_convert_all(c->st, c->leaves[i].origin, c->chunks + i * c->k, c->k, cpath) < 0)
            r = -1;
    }
    return r;
}

/* ------------------------------------------------------------------ */
/* Pass (d): build                                                     */
/* ------------------------------------------------------------------ */

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
 * a plain dict is filled directly, a dict subclass rebuilt by
 * rebuild_mapping (copy.copy, then its values set). */
static int build_container(scatter_ctx *c, PyObject *obj, int kind,
                           const path_seg *seg, PyObject **res)
{
    const int k = c->k;
    PyObject *items = NULL, *names = NULL, **tmp = NULL;
    int exact_dict = kind == S_DICT && PyDict_CheckExact(obj);
    int rc = -1;

    for (int j = 0; j < k; j++)
        res[j] = NULL;
    if (check_depth(seg, "inputs") < 0 || Py_EnterRecursiveCall(" while scattering inputs"))
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
            res[j] = dict_new_sized(n);
        else /* S_LIST, or the pairs of a dict subclass */
            res[j] = PyList_New(n);
        if (res[j] == NULL)
            goto done;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        path_seg cseg;
        PyObject *child = container_child(kind, items, names, i, seg, &cseg);
        if (scatter_build(c, child, &cseg, tmp) < 0)
            goto done;
        PyObject *key = kind == S_DICT ? container_key(items, i) : NULL;
        if (place_child(kind, exact_dict, res, tmp, k, i, key) < 0)
            goto done;
    }
    if (kind == S_NAMEDTUPLE || (kind == S_DICT && !exact_dict)) {
        for (int j = 0; j < k; j++) {
            PyObject *r;
            if (kind == S_NAMEDTUPLE) {
                r = PyObject_Call((PyObject *)Py_TYPE(obj), res[j], NULL);
                if (r == NULL)
                    raise_rebuild_error(seg, Py_TYPE(obj), "type(obj)(*fields)", "");
            }
            else {
                r = rebuild_mapping(c->st, obj, res[j], seg);
            }
            if (r == NULL)
                goto done;
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
static int scatter_build(scatter_ctx *c, PyObject *obj, const path_seg *seg, PyObject **res)
{
    /* The next leaf of pass (a), the same object: an array leaf (its kind
     * was decided there). */
    if (c->cursor < c->nleaves && c->leaves[c->cursor].obj == obj)
        return take_chunks(c, obj, res);
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
static int scatter_check_all_taken(scatter_ctx *c)
{
    if (c->cursor != c->nleaves) {
        PyErr_SetString(PyExc_RuntimeError,
                        "scatter: the inputs changed while they were being scattered");
        return -1;
    }
    return 0;
}

/* ------------------------------------------------------------------ */
/* scatter_kwargs                                                      */
/* ------------------------------------------------------------------ */

int dp_scatter_kwargs(dp_state *st, PyObject *inputs, PyObject *kwargs,
                      const dp_device *devs, Py_ssize_t ndev, int dim, int strict,
                      PyObject **inputs_out, PyObject **kwargs_out)
{
    dp_split_opts opts = {dim, strict, NULL, NULL, NULL};
    return dp_scatter_kwargs_ex(st, inputs, kwargs, devs, ndev, &opts, inputs_out,
                                kwargs_out);
}

/* scatter_kwargs' inputs is a tuple (or NULL) and kwargs a dict (or NULL):
 * 0, else TypeError naming the argument. */
static int check_inputs_kwargs(PyObject *inputs, PyObject *kwargs)
{
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
    return 0;
}

/* Pass (d) for one side: the c->k groups of obj (is_args: the positional
 * arguments' tuple, else the kwargs dict) built in tmp and moved into side
 * (a new tuple of c->k), or c->k empty ones, () or {}, when obj is NULL. */
static int build_side(scatter_ctx *c, PyObject *obj, int is_args, const path_seg *root,
                      PyObject **tmp, PyObject *side)
{
    if (obj != NULL) {
        int rc = is_args ? build_container(c, obj, S_TUPLE, root, tmp)
                         : scatter_build(c, obj, root, tmp);
        if (rc < 0)
            return -1;
    }
    else {
        for (int j = 0; j < c->k; j++)
            tmp[j] = is_args ? PyTuple_New(0) : PyDict_New();
    }
    for (int j = 0; j < c->k; j++) {
        if (tmp[j] == NULL)
            return -1;
        PyTuple_SET_ITEM(side, j, tmp[j]);
        tmp[j] = NULL;
    }
    return 0;
}

/* docs/spec.md 2.7: nothing to scatter gives no groups at all, () and (); DataParallel
 * then runs one replica with ((),), ({},) (docs/spec.md 2.4). */
static int no_groups(PyObject **inputs_out, PyObject **kwargs_out)
{
    PyObject *ins = PyTuple_New(0), *kws = PyTuple_New(0);
    if (ins == NULL || kws == NULL) {
        Py_XDECREF(ins);
        Py_XDECREF(kws);
        return -1;
    }
    *inputs_out = ins;
    *kwargs_out = kws;
    return 0;
}

/* Passes (a)-(c) over the positional arguments (NULL: none) and kwargs
 * (NULL: none), together: one replica count for both. */
static int scatter_collect_copy(scatter_ctx *c, PyObject *inputs, PyObject *args_spec,
                                PyObject *kwargs, const path_seg *kw_root,
                                PyObject *kw_spec, const path_seg *sroot, int strict)
{
    if (inputs != NULL && collect_args(c, inputs, args_spec) < 0)    /* (a) */
        return -1;
    if (kwargs != NULL && collect(c, kwargs, kw_root, kw_spec, sroot) < 0)
        return -1;
    scatter_count(c);                                                /* (b) */
    if (scatter_check(c, strict) < 0)
        return -1;
    return scatter_copy(c);                                          /* (c) */
}

static int dp_scatter_kwargs_ex_steps(dp_state *st, PyObject *inputs, PyObject *kwargs,
                                      const dp_device *devs, Py_ssize_t ndev,
                                      const dp_split_opts *opts,
                                      PyObject **inputs_out, PyObject **kwargs_out)
{
    scatter_ctx c;
    PyObject *ins = NULL, *kws = NULL, **tmp = NULL;
    PyObject *args_spec = NULL, *kw_spec = NULL, *own[2] = {NULL, NULL};
    PyObject *in_dims = NULL;  /* the call's own copy of opts->in_dims */
    path_seg args_root = seg_root("args"), kw_root = seg_root("kwargs");
    path_seg sroot = seg_root("in_dims");
    int rc = -1, dim = opts->dim, strict = opts->strict;

    memset(&c, 0, sizeof c);

    *inputs_out = *kwargs_out = NULL;
    if (check_inputs_kwargs(inputs, kwargs) < 0)
        return -1;
    Py_ssize_t nin = inputs != NULL ? PyTuple_GET_SIZE(inputs) : 0;
    int has_kw = kwargs != NULL && PyDict_GET_SIZE(kwargs) > 0;

    if (dims_take(opts->in_dims, "in_dims", 0, &in_dims) < 0)
        return -1;
    if (split_top_spec(in_dims, nin, has_kw ? kwargs : NULL, &args_spec, &kw_spec,
                       own) < 0)
        goto fail;

    if (nin == 0 && !has_kw) {
        rc = no_groups(inputs_out, kwargs_out);
        goto fail;
    }

    if (ctx_init(&c, st, devs, ndev, dim, 0) < 0)
        goto fail;
    c.chunk_sizes = opts->chunk_sizes;
    c.weights = opts->weights;
    if (scatter_collect_copy(&c, nin > 0 ? inputs : NULL, args_spec,
                             has_kw ? kwargs : NULL, &kw_root, kw_spec, &sroot, strict) < 0)
        goto fail;

    /* (d) exactly k groups on each side; a missing side is padded with ()
     * or {} (docs/spec.md 2.7, without PyTorch's uneven padding). */
    tmp = PyMem_Calloc((size_t)c.k, sizeof *tmp);
    ins = PyTuple_New(c.k);
    kws = PyTuple_New(c.k);
    if (tmp == NULL || ins == NULL || kws == NULL) {
        if (tmp == NULL)
            PyErr_NoMemory();
        goto fail;
    }
    if (build_side(&c, nin > 0 ? inputs : NULL, 1, &args_root, tmp, ins) < 0 ||
        build_side(&c, has_kw ? kwargs : NULL, 0, &kw_root, tmp, kws) < 0)
        goto fail;
    if (scatter_check_all_taken(&c) < 0)
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
    Py_XDECREF(in_dims);
    ctx_clear(&c);
    return rc;
}

/* dp_scatter_kwargs_ex under dpmini.profile(): one span around it (profile.h). */
int dp_scatter_kwargs_ex(dp_state *st, PyObject *inputs, PyObject *kwargs,
                         const dp_device *devs, Py_ssize_t ndev,
                         const dp_split_opts *opts,
                         PyObject **inputs_out, PyObject **kwargs_out)
{
    dp_prof_span sp;
    dp_prof_begin(&sp, DP_PROF_SCATTER);
    int rc = dp_scatter_kwargs_ex_steps(st, inputs, kwargs, devs, ndev, opts, inputs_out,
                                        kwargs_out);
    dp_prof_end(&sp, NULL);
    return rc;
}

/* ------------------------------------------------------------------ */
/* Python functions                                                    */
/* ------------------------------------------------------------------ */

PyDoc_STRVAR(scatter_doc,
"scatter($module, inputs, target_devices, dim=0, strict=False, in_dims=None,\n"
"        chunk_sizes=None, weights=None)\n"
"--\n"
"\n"
"Split inputs over target_devices as torch.nn.parallel.scatter does (docs/spec.md 3).\n"
"\n"
"inputs: an ndarray (any non-object dtype, ndim >= 1, any strides), or a\n"
"  tuple / list / dict / namedtuple nesting ndarrays and other objects.\n"
"target_devices: a non-empty sequence of devices (\"cpu:N\", \"cuda:N\", int N,\n"
"  dpmini.Device); not the host.\n"
"dim: the axis to split along; a negative dim is wrapped against each array's\n"
"  own rank (docs/spec.md 10.4).\n"
"strict: raise ValueError instead of warning SplitWarning when an array would\n"
"  lose rows (see Warns: the same condition for both).\n"
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
"  sum(chunk_sizes) rows (torch.cuda.comm.scatter's chunk_sizes, docs/spec.md 0.7;\n"
"  PyTorch's DataParallel lacks it, pytorch issue 46381). A 0 gives that\n"
"  device an empty chunk; devices after the last non-empty chunk idle.\n"
"weights: len(target_devices) finite numbers > 0: sizes proportional to\n"
"  them (largest remainder, so they sum to n; no device gets an empty chunk\n"
"  unless n < len(target_devices)). At most one of chunk_sizes and weights.\n"
"\n"
"Returns\n"
"  - a bare ndarray: a tuple of its chunks. torch.chunk rule (docs/spec.md 0.1): pieces\n"
"    of ceil(n / len(target_devices)) rows along dim with a shorter last one,\n"
"    so there may be fewer chunks than devices (9 rows on 4 devices: 3,3,3);\n"
"    n == 0 gives one empty chunk per device. Chunk j is on target_devices[j],\n"
"    has the input's dtype, and is a view when that device is the array's own.\n"
"  - a non-empty tuple, list, dict or namedtuple: a list of k structures, one\n"
"    per replica, with chunk j of every array in structure j. Tuples and\n"
"    lists become plain tuples and lists, namedtuples type(obj)(*fields),\n"
"    plain dicts dicts in key order; a dict subclass (OrderedDict, Counter,\n"
"    defaultdict, your own) is copy.copy(obj) with each value replaced, so\n"
"    it keeps its type, keys, order, default_factory and attributes (never\n"
"    type(obj)(pairs), which a Counter would count). k is the smallest chunk\n"
"    count over all arrays, or len(target_devices) when there is no array.\n"
"  - anything else (None, str, numbers, NumPy scalars, empty containers,\n"
"    other objects): a list of len(target_devices) references to it.\n"
"  Non-array values inside structures are shared by reference, never copied.\n"
"\n"
"Raises\n"
"  dpmini.ZeroDimError (a ValueError and a RuntimeError): a 0-dim array\n"
"    (\"<path>: chunk expects at least a 1-dimensional tensor\"), before any copy\n"
"    (docs/spec.md 10.3).\n"
"  ValueError: with strict=True, exactly when the\n"
"    SplitWarning below would be warned (each path, shape, dim and size is\n"
"    listed);\n"
"    chunk_sizes that do not sum to an array's size (names it); bad\n"
"    chunk_sizes / weights (wrong length, negative, not finite or not > 0,\n"
"    both given); an in_dims entry that addresses a child that does not\n"
"    exist (names the entry, e.g. in_dims[1]['x']).\n"
"  IndexError: dim out of range for an array (names its path).\n"
"  TypeError: a namedtuple that cannot be rebuilt from its fields, or a dict\n"
"    subclass whose copy.copy fails or changes its type or keys, naming its\n"
"    path; an in_dims entry of the wrong type or shape (a tuple for an array,\n"
"    a dict for a list, a str).\n"
"  RecursionError: structures (or in_dims) nested more than 512 levels deep\n"
"    (dpmini's own bound, whatever sys.getrecursionlimit() says; a container\n"
"    inside itself hits it), naming the path's first steps.\n"
"Warns\n"
"  dpmini.SplitWarning (strict=False): some split array has rows after its\n"
"    first k chunks (k: the smallest chunk count over the split arrays), so\n"
"    they are dropped, as in PyTorch (docs/spec.md 10.2); the warning names each path and\n"
"    the rows dropped. An array with 0 rows along its dim (one empty chunk\n"
"    per device) loses nothing: no warning, and no error under strict.");

static PyObject *py_scatter_steps(PyObject *module, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"inputs", "target_devices", "dim", "strict", "in_dims",
                             "chunk_sizes", "weights", NULL};
    PyObject *inputs, *devobj, *dimobj = NULL, *out = NULL, **res = NULL;
    PyObject *in_dims = Py_None, *csobj = Py_None, *wobj = Py_None;
    PyObject *spec = NULL;  /* the call's own copy of in_dims (NULL: None) */
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
    if (parse_dim(dimobj, &dim) < 0 || dims_take(in_dims, "in_dims", 0, &spec) < 0)
        return NULL;
    if (dp_device_list_from_object(st, devobj, "target_devices", &devs, &ndev) < 0)
        goto done;
    if (dp_parse_split_sizes(csobj, wobj, ndev, sizes_buf, weights_buf, &opts) < 0)
        goto done;
    if (ctx_init(&c, st, devs, ndev, dim, 0) < 0)
        goto done;
    c.chunk_sizes = opts.chunk_sizes;
    c.weights = opts.weights;
    if (collect(&c, inputs, &root, spec, &sroot) < 0)
        goto done;
    if ((kind = scatter_kind(st, inputs)) < 0)
        goto done;
    scatter_count(&c);
    if (scatter_check(&c, strict) < 0 || scatter_copy(&c) < 0)
        goto done;
    res = PyMem_Calloc((size_t)c.k, sizeof *res);
    if (res == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    if (scatter_build(&c, inputs, &root, res) < 0 || scatter_check_all_taken(&c) < 0)
        goto done;
    /* docs/spec.md 3.3: a bare array gives a tuple of chunks, a structure a list. */
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
    Py_XDECREF(spec);
    return out;
}

/* The call (dp_entry_call): one span under dpmini.profile(); a torch tensor
 * that requires grad goes to dpmini._torch.scatter. */
static PyObject *py_scatter(PyObject *module, PyObject *args, PyObject *kwds)
{
    static const char *const structures[] = {"inputs", NULL};
    static const dp_entry e = {py_scatter_steps, DP_PROF_SCATTER,
                                NULL, "scatter", structures};
    return dp_entry_call(module, args, kwds, &e);
}

PyDoc_STRVAR(scatter_kwargs_doc,
"scatter_kwargs($module, inputs, kwargs, target_devices, dim=0, strict=False,\n"
"               in_dims=None, chunk_sizes=None, weights=None)\n"
"--\n"
"\n"
"Split positional and keyword arguments for each replica, as\n"
"torch.nn.parallel.scatter_kwargs (docs/spec.md 2.7, 3) with dpmini's replica count.\n"
"\n"
"inputs: the positional arguments, a tuple or a list of them; None means\n"
"  none. A tuple gives each replica a tuple (x_i,), a list a list [x_i], as\n"
"  PyTorch's scatter_kwargs does (its scatter keeps the container type).\n"
"  Any other object (a bare array) is one positional argument: replica i\n"
"  gets (x_i,), which is what PyTorch's parallel_apply makes of the x_i its\n"
"  scatter gives (docs/spec.md 3.1, 6.3); PyTorch's scatter_kwargs itself fails on\n"
"  a bare array of more than one element ('if inputs' asks for its truth\n"
"  value: RuntimeError/ValueError 'ambiguous'), a documented difference.\n"
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
"(a list when inputs is a list) of positional arguments and a dict of\n"
"keyword arguments per replica. k is\n"
"the smallest chunk count over ALL arrays of inputs and kwargs together, or\n"
"len(target_devices) when there is no array: non-array values never add\n"
"replicas, so no replica runs without its inputs (docs/spec.md 10.1; PyTorch pads the\n"
"short side instead). A side that is empty is () or {} in every replica.\n"
"With no arguments at all the result is ((), ()); DataParallel then runs one\n"
"replica with ((),), ({},) (docs/spec.md 2.4).\n"
"\n"
"Raises and warns as dpmini.scatter; paths name the argument, e.g. args[0],\n"
"args[1]['img'], args[0].a (namedtuple field) or kwargs['mask'].");

static PyObject *py_scatter_kwargs_once(PyObject *module, PyObject *args, PyObject *kwds)
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
    if ((in_out = dp_inputs_as_lists(inputs, in_out)) == NULL)
        goto done;
    res = PyTuple_Pack(2, in_out, kw_out);
done:
    Py_XDECREF(in_out);
    Py_XDECREF(kw_out);
    Py_DECREF(ins);
    PyMem_Free(devs);
    return res;
}

/* The call; with a torch tensor that requires grad (grad mode on), its
 * differentiable form dpmini._torch.scatter_kwargs. */
static PyObject *py_scatter_kwargs(PyObject *module, PyObject *args, PyObject *kwds)
{
    static const char *const structures[] = {"inputs", "kwargs", NULL};
    return dp_call_with_retry(module, args, kwds, py_scatter_kwargs_once, "scatter_kwargs",
                              structures);
}

PyMethodDef dp_scatter_methods[] = {
    {"scatter", (PyCFunction)(void (*)(void))py_scatter,
     METH_VARARGS | METH_KEYWORDS, scatter_doc},
    {"scatter_kwargs", (PyCFunction)(void (*)(void))py_scatter_kwargs,
     METH_VARARGS | METH_KEYWORDS, scatter_kwargs_doc},
    {NULL, NULL, 0, NULL}
};
