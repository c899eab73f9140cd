/* scatter_py.c - the Python functions dpmini.scatter and
 * dpmini.scatter_kwargs: their docstrings and argument parsing, over
 * dp_scatter_kwargs_ex (scatter_tree.c).
 */
#include "dpmini.h"
#include "tree.h"
#include "walk.h"
#include "plan.h"
#include "profile.h"

#include <limits.h>

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

/* The call, one span under dpmini.profile() (profile.h); with a torch
 * tensor that requires grad (grad mode on), its differentiable form
 * dpmini._torch.scatter. */
static PyObject *py_scatter(PyObject *module, PyObject *args, PyObject *kwds)
{
    dp_prof_span sp;
    dp_prof_begin(&sp, DP_PROF_SCATTER);
    PyObject *res = py_scatter_steps(module, args, kwds);
    dp_prof_end(&sp, NULL);
    return res != NULL ? res
                       : dp_autograd_retry(dp_state_from_module(module), "scatter", args, kwds);
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
"  none. A tuple gives each replica a tuple (x_i,), a list a list [x_i], as\n"
"  PyTorch's scatter_kwargs does (its scatter keeps the container type).\n"
"  Any other object (a bare array) is one positional argument: replica i\n"
"  gets (x_i,), which is what PyTorch's parallel_apply makes of the x_i its\n"
"  scatter gives (spec 3.1, 6.3); PyTorch's scatter_kwargs itself fails on\n"
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
"replicas, so no replica runs without its inputs (R04; PyTorch pads the\n"
"short side instead). A side that is empty is () or {} in every replica.\n"
"With no arguments at all the result is ((), ()); DataParallel then runs one\n"
"replica with ((),), ({},) (spec 2.4).\n"
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
    PyObject *res = py_scatter_kwargs_once(module, args, kwds);
    return res != NULL ? res
                       : dp_autograd_retry(dp_state_from_module(module), "scatter_kwargs", args, kwds);
}

PyMethodDef dp_scatter_methods[] = {
    {"scatter", (PyCFunction)(void (*)(void))py_scatter,
     METH_VARARGS | METH_KEYWORDS, scatter_doc},
    {"scatter_kwargs", (PyCFunction)(void (*)(void))py_scatter_kwargs,
     METH_VARARGS | METH_KEYWORDS, scatter_kwargs_doc},
    {NULL, NULL, 0, NULL}
};
