/* scatter_walk.c - pass (a) of scatter (see scatter_tree.c): walk the
 * inputs and kwargs with their in_dims and record every array leaf with its
 * path, dim and chunk sizes (plan.c). Pass (b), the replica count and its
 * checks, is in scatter_count.c; the top of the walk (the positional
 * arguments and the top of in_dims) in scatter_args.c. scatter_kwargs
 * (scatter_tree.c) and _plan (explain.c) both run these passes; the
 * scatter_ctx they fill is in tree.h.
 */
#include "dpmini.h"
#include "tree.h"
#include "walk.h"
#include "plan.h"

#include <limits.h>

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

/* The rule of spec 3.1 for obj: one of S_*, or -1 with an exception set. */
int scatter_kind(dp_state *st, PyObject *obj)
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
 * snapshot) or S_DICT (dict_flat's (k0, v0, k1, v1, ...)), as a new
 * reference. */
PyObject *container_items(PyObject *obj, int kind)
{
    return kind == S_DICT ? dict_flat(obj) : seq_snapshot(obj);
}

/* Child i of a container walked through container_items: sets *seg and
 * returns the child (borrowed from items). */
PyObject *container_child(int kind, PyObject *items, PyObject *names,
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

Py_ssize_t items_len(int kind, PyObject *items)
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
        /* torch.cuda.comm.scatter's chunk_sizes (spec 0.7, 8.5), for every
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

/* Pass (a) for one array leaf. spec: its in_dims entry (NULL: c->dim, an
 * int: that dim, None: broadcast); sseg its path. */
static int collect_leaf(scatter_ctx *c, PyObject *obj, const path_seg *seg,
                        PyObject *spec, const path_seg *sseg)
{
    PyObject *owned = NULL, *origin = NULL;
    PyArrayObject *arr = NULL;
    int64_t *sizes = NULL;
    char buf[256];
    const char *cpath;
    int wdim = 0, count = 0, dim = c->dim, bcast = spec == Py_None;

    /* The usual leaf: a plain ndarray of numbers split along the default
     * dim into torch.chunk sizes. Nothing in it can fail with a message
     * that names the path, so the path is not written. */
    if (spec == NULL && c->chunk_sizes == NULL && c->weights == NULL &&
        PyArray_CheckExact(obj) && !PyDataType_REFCHK(PyArray_DESCR((PyArrayObject *)obj))) {
        int nd = PyArray_NDIM((PyArrayObject *)obj);
        if (nd > 0 && dim >= -nd && dim < nd) {
            wdim = dim < 0 ? dim + nd : dim;
            sizes = PyMem_Malloc((size_t)c->ndev * sizeof(int64_t));
            if (sizes == NULL) {
                PyErr_NoMemory();
                goto fail;
            }
            count = dp_chunk_sizes((int64_t)PyArray_DIM((PyArrayObject *)obj, wdim), c->ndev,
                                   sizes);
            if (count >= 1) {
                arr = (PyArrayObject *)Py_NewRef(obj);
                goto record;
            }
            PyMem_Free(sizes);   /* never: the general route reports it */
            sizes = NULL;
        }
    }

    cpath = path_text(seg, buf, sizeof buf, &owned);
    if (cpath == NULL)
        goto fail;

    if (spec_is_container(spec)) {
        spec_mismatch(sseg, spec, seg, "an array", NULL);
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
    origin = dp_array_origin(c->st, obj);
    if (origin == NULL)
        goto fail;
    int node = node_of(c, seg);
    if (node < 0)
        goto fail;
    if (c->nleaves == c->cap && ctx_reserve(c, 0, 1) < 0)
        goto fail;
    scatter_leaf *lf = &c->leaves[c->nleaves++];
    lf->obj = Py_NewRef(obj);
    lf->arr = arr;
    lf->origin = origin;
    lf->node = node;
    lf->path = NULL;
    lf->bcast = bcast;
    lf->dim = wdim;
    lf->count = count;
    lf->sizes = sizes;
    Py_XDECREF(owned);
    return 0;

leaf_error:
    if (absorb_error(c) == 0) {
        Py_XDECREF(arr);
        Py_XDECREF(owned);
        return 0;
    }
fail:
    PyMem_Free(sizes);
    Py_XDECREF(origin);
    Py_XDECREF(arr);
    Py_XDECREF(owned);
    return -1;
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
        /* probing obj for the array protocols raised: name its path */
        PyObject *path = path_str(seg);
        dp_reraise_at(c->st, path);
        Py_XDECREF(path);
        return -1;
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
