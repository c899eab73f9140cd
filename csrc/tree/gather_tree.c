/* gather_tree.c - gather of nested Python structures: DataParallel's
 * gather (spec §4) with out_dims, and the Python function dpmini.gather.
 *
 * Gather walks the replicas' outputs side by side: outputs[0] picks the rule
 * (as in PyTorch) but every replica is checked against it, and array
 * positions are concatenated with dp_gather_arrays.
 *
 * This file: the kind of value at a position, the check that every replica
 * returned that kind, the walk itself (gather_map, dp_gather_outputs) and
 * dpmini.gather. The rules at each kind of position are in gather_values.c
 * (arrays concatenated; str, numbers and other objects), gather_containers.c
 * (dicts, sequences, namedtuples, dataclasses rebuilt) and gather_out_dims.c
 * (out_dims None and "sum"); gather.h is what they share.
 *
 * Sections: gather (kinds, the walk, dp_gather_outputs); Python functions.
 */
#include "dpmini.h"
#include "tree.h"
#include "gather.h"
#include "walk.h"
#include "engine.h"
#include "profile.h"

#include <math.h>
#include <string.h>

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


/* ", ".join of one item per value, for error messages: type(x).__name__
 * ("ndarray, NoneType"), repr(x) (cut at 80 characters), x.ndim for
 * arrays, or len(x) for tuples. */
PyObject *join_each(PyObject *const *vals, Py_ssize_t n, int show)
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
int kind_error_at(gather_ctx *g, const path_seg *seg)
{
    PyObject *path = path_str(seg);
    dp_reraise_at(g->st, path);
    Py_XDECREF(path);
    return -1;
}

/* Every replica must return the same kind of value at this position (for a
 * dataclass, the same class): R19 c/d. Two mixes are allowed, as one kind:
 * namedtuples with plain tuples or lists (replica 0's type is rebuilt, as
 * PyTorch does), and NumPy scalars with Python numbers (np.float64(1.0) and
 * 1.0: all gathered as 0-dim arrays, the NumPy scalar rule). Returns the
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
                if (!PyArray_IsScalar(vals[j], Generic) && !is_py_number(vals[j]))
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
PyObject *gather_map(gather_ctx *g, PyObject *const *vals, Py_ssize_t n,
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
"    or strings into shorter ones; other sizes must match (spec 4.6). When\n"
"    every replica returns a 0-dim array and dim == 0, the result is a\n"
"    vector of one value per replica, with PyTorch's UserWarning (spec 4.5,\n"
"    R20). NumPy scalars mixed with Python numbers (np.float64(1.0) and\n"
"    1.0) are all taken as 0-dim arrays.\n"
"  None: None.  dict: key by key, replica 0's key order; a dict subclass\n"
"  (OrderedDict, Counter, defaultdict, ...) is copy.copy(replica 0's) with\n"
"  the gathered values set, so it keeps its type, keys and default_factory\n"
"  (R14).  namedtuple: field by field, type(out)._make; a namedtuple at one\n"
"  replica and a plain tuple or list at another give replica 0's type, as\n"
"  in PyTorch.  dataclass: field by field, set on type(out).__new__(type(out))\n"
"  with object.__setattr__: __init__/__post_init__ do not run again (frozen\n"
"  ones too; a dataclass that is a dict also gets replica 0's keys) (R17).\n"
"  list/tuple: position by position (R18).  str, bytes, Python numbers: the\n"
"  value, once, when all replicas return an equal value.  Any other object:\n"
"  that object, when all replicas return the same one or equal values of\n"
"  one type hashed by value (Fraction, Decimal, date, frozenset).\n"
"\n"
"Raises (messages name the position, e.g. out['logits'][1] or out.loss)\n"
"  TypeError: replicas returned different kinds of value at one position\n"
"    (the type from each replica is listed, R19), different str/number\n"
"    values, or different other objects; arrays whose dtypes cannot be\n"
"    gathered without losing data (each replica's dtype is listed); outputs\n"
"    not a list or tuple.\n"
"  RecursionError: outputs (or out_dims) nested more than 512 levels deep.\n"
"  ValueError: dicts with different numbers of keys (\"All dicts must have\n"
"    the same number of keys\") or a missing key, sequences of different\n"
"    lengths, 0-dim arrays with dim != 0, array shapes that differ outside\n"
"    dim (spec 4.6), no outputs.\n"
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
    /* spec 4.3: -1 for the host still works but is deprecated. */
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
    PyObject *res = py_gather_once(module, args, kwds);
    return res != NULL ? res
                       : dp_autograd_retry(dp_state_from_module(module), "gather", args, kwds);
}


PyMethodDef dp_gather_methods[] = {
    {"gather", (PyCFunction)(void (*)(void))py_gather,
     METH_VARARGS | METH_KEYWORDS, gather_doc},
    {NULL, NULL, 0, NULL}
};
