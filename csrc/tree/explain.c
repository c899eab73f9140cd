/* explain.c - dpmini._plan, the records behind dpmini.explain: runs scatter's
 * passes (a) and (b) (scatter.c) without copying and describes the
 * outcome as a dict (leaves, chunk sizes, replica count, warnings, errors).
 *
 * Sections: plan records; Python functions.
 */
#include "dpmini.h"
#include "tree.h"
#include "walk.h"
#include "plan.h"

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
    PyObject *shape = NULL, *nbytes = NULL, *res = NULL, *lib = NULL;
    int64_t *nb = PyMem_Malloc((size_t)c->ndev * sizeof(int64_t));
    if (nb == NULL)
        return PyErr_NoMemory();
    for (int j = 0; j < c->ndev; j++)
        nb[j] = (ok && j < c->k) ? (int64_t)PyArray_NBYTES(lf->arr) : 0;
    shape = PyArray_IntTupleFromIntp(PyArray_NDIM(lf->arr), PyArray_DIMS(lf->arr));
    nbytes = int_list(nb, c->ndev);
    lib = dp_array_describe(c->st, lf->obj, lf->arr);
    PyObject *path = lib != NULL ? leaf_path(c, lf) : NULL;
    if (shape != NULL && nbytes != NULL && path != NULL)
        res = Py_BuildValue("{s:O,s:O,s:O,s:O,s:n,s:O,s:O,s:O,s:O,s:O}",
                            "path", path, "library", lib, "shape", shape,
                            "dtype", (PyObject *)PyArray_DESCR(lf->arr),
                            "itemsize", (Py_ssize_t)PyArray_ITEMSIZE(lf->arr),
                            "dim", Py_None, "broadcast", Py_True, "sizes", Py_None,
                            "starts", Py_None, "nbytes", nbytes);
    PyMem_Free(nb);
    Py_XDECREF(shape);
    Py_XDECREF(nbytes);
    Py_XDECREF(lib);
    return res;
}

/* One entry of plan['leaves']. truncate: sizes past the replica count are 0. */
static PyObject *plan_leaf(scatter_ctx *c, scatter_leaf *lf, int truncate)
{
    if (lf->bcast)
        return plan_bcast_leaf(c, lf, truncate);
    PyObject *shape = NULL, *sizes = NULL, *starts = NULL, *nbytes = NULL, *res = NULL;
    PyObject *lib = NULL;
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
    lib = dp_array_describe(c->st, lf->obj, lf->arr);
    PyObject *path = lib != NULL ? leaf_path(c, lf) : NULL;
    if (shape != NULL && sizes != NULL && starts != NULL && nbytes != NULL && path != NULL)
        res = Py_BuildValue("{s:O,s:O,s:O,s:O,s:n,s:i,s:O,s:O,s:O,s:O}",
                            "path", path, "library", lib, "shape", shape,
                            "dtype", (PyObject *)PyArray_DESCR(lf->arr),
                            "itemsize", (Py_ssize_t)PyArray_ITEMSIZE(lf->arr),
                            "dim", lf->dim, "broadcast", Py_False, "sizes", sizes,
                            "starts", starts, "nbytes", nbytes);
    PyMem_Free(buf);
    Py_XDECREF(shape);
    Py_XDECREF(sizes);
    Py_XDECREF(starts);
    Py_XDECREF(nbytes);
    Py_XDECREF(lib);
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
"  'leaves': one dict per array, in argument order: 'path' (str), 'library'\n"
"    (str: the array's type and device, e.g. 'torch.Tensor cpu', 'cupy.ndarray\n"
"    cuda:0', 'numpy.ndarray cpu:1'), 'shape'\n"
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
    PyObject *spec = NULL;  /* the call's own copy of in_dims (NULL: None) */
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
        dims_take(in_dims, "in_dims", 0, &spec) < 0)
        return NULL;
    if ((ins = normalize_inputs(inputs)) == NULL) {
        Py_XDECREF(spec);
        return NULL;
    }
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
    if (split_top_spec(spec, PyTuple_GET_SIZE(ins), has_kw ? kw : NULL, &args_spec,
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
    Py_XDECREF(spec);
    PyMem_Free(devs);
    return res;
}

PyMethodDef dp_plan_methods[] = {
    {"_plan", (PyCFunction)(void (*)(void))py_plan,
     METH_VARARGS | METH_KEYWORDS, plan_doc},
    {NULL, NULL, 0, NULL}
};
