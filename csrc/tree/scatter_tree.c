/* scatter_tree.c - scatter of nested Python structures.
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
 * Files: tree_common.c, tree_containers.c, tree_dims.c, tree_args.c (paths,
 * container tests, in_dims / out_dims, argument parsing), scatter_walk.c and
 * scatter_args.c (pass (a)), scatter_count.c (pass (b)), this file (passes
 * (c), (d), dp_scatter_kwargs), scatter_py.c (dpmini.scatter and
 * dpmini.scatter_kwargs), gather_*.c (gather), explain.c (_plan).
 *
 * Sections: pass (c): copy; pass (d): build; scatter_kwargs.
 */
#include "dpmini.h"
#include "tree.h"
#include "walk.h"
#include "engine.h"
#include "plan.h"
#include "profile.h"

#include <limits.h>

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
int scatter_copy(scatter_ctx *c)
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
int scatter_build(scatter_ctx *c, PyObject *obj, const path_seg *seg, PyObject **res)
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
int scatter_check_all_taken(scatter_ctx *c)
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

    if (dims_take(opts->in_dims, "in_dims", 0, &in_dims) < 0)
        return -1;
    if (split_top_spec(in_dims, nin, has_kw ? kwargs : NULL, &args_spec, &kw_spec,
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
        if (scatter_build(&c, kwargs, &kw_root, tmp) < 0)
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
