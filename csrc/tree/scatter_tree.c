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
 * Files: tree_common.c (paths, helpers, argument parsing), scatter_walk.c
 * (passes (a), (b)), this file (passes (c), (d), dpmini.scatter and
 * dpmini.scatter_kwargs), gather_tree.c (gather), explain.c (_plan).
 *
 * Sections: pass (c): copy; pass (d): build; scatter_kwargs; Python functions.
 */
#include "dpmini.h"
#include "tree.h"
#include "walk.h"
#include "engine.h"
#include "plan.h"

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
        const char *cpath = PyUnicode_AsUTF8(c->leaves[i].path);
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

int dp_scatter_kwargs_ex(dp_state *st, PyObject *inputs, PyObject *kwargs,
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
    Py_XDECREF(in_dims);
    ctx_clear(&c);
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
"Split inputs over target_devices as torch.nn.parallel.scatter does (spec 3).\n"
"\n"
"inputs: an ndarray (any non-object dtype, ndim >= 1, any strides), or a\n"
"  tuple / list / dict / namedtuple nesting ndarrays and other objects.\n"
"target_devices: a non-empty sequence of devices (\"cpu:N\", \"cuda:N\", int N,\n"
"  dpmini.Device); not the host.\n"
"dim: the axis to split along; a negative dim is wrapped against each array's\n"
"  own rank (R27).\n"
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
"  ValueError: a 0-dim array (\"<path>: chunk expects at least a 1-dimensional\n"
"    array\"), before any copy (R22); with strict=True, exactly when the\n"
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
"    they are dropped, as in PyTorch (R06); the warning names each path and\n"
"    the rows dropped. An array with 0 rows along its dim (one empty chunk\n"
"    per device) loses nothing: no warning, and no error under strict.");

static PyObject *py_scatter(PyObject *module, PyObject *args, PyObject *kwds)
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
    Py_XDECREF(spec);
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
"inputs: the positional arguments, a tuple or a list of them; None means\n"
"  none, and any other object (a bare array) is one positional argument\n"
"  (inputs,). This is what PyTorch's scatter_kwargs gives once\n"
"  parallel_apply has unpacked or wrapped each replica's piece (spec 3.1,\n"
"  6.3): [x] and x both make replica i's arguments (x_i,).\n"
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

PyMethodDef dp_scatter_methods[] = {
    {"scatter", (PyCFunction)(void (*)(void))py_scatter,
     METH_VARARGS | METH_KEYWORDS, scatter_doc},
    {"scatter_kwargs", (PyCFunction)(void (*)(void))py_scatter_kwargs,
     METH_VARARGS | METH_KEYWORDS, scatter_kwargs_doc},
    {NULL, NULL, 0, NULL}
};
