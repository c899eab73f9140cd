/* replicate.c - replicate: one copy of a module per device (docs/spec.md 5), for
 * DataParallel.forward / .replicate and the module-level dpmini.replicate.
 *
 * replicate: the arrays reachable from the module (instance __dict__s and
 * __slots__ members, lists, tuples, namedtuples, dicts) are broadcast in one coalesced call (copy_broadcast.c); each
 * replica is a shallow copy of every object on a path to an array, with the
 * arrays swapped for that device's copies. Everything else is shared.
 *
 * Sections: helpers (the build); public functions. The walk's types are in
 * replicate.h, the walk in replicate_walk.c, its bookkeeping in
 * replicate_map.c.
 */
#include "dpmini.h"
#include "dataparallel.h"
#include "tree.h"
#include "replicate.h"
#include "dp.h"
#include "engine.h"
#include "profile.h"

#include <string.h>

/* Marks a tuple replica under construction (a cycle back to it is shared). */
static char rep_busy_marker;
#define REP_BUSY ((PyObject *)(void *)&rep_busy_marker)

/* ------------------------------------------------------------------ */
/* Helpers: the build                                                  */
/* ------------------------------------------------------------------ */

/* The path of node n from the module (new str): w->path filled back from
 * the edges that lead to it (error messages only). */
static PyObject *node_path(rep_walk *w, Py_ssize_t n)
{
    int depth = 0;
    for (Py_ssize_t c = n; c != 0 && depth < DP_REPLICATE_MAX_DEPTH;) {
        Py_ssize_t e = 0;
        while (e < w->nedges && w->edges[e].child != c) {
            e++;
        }
        if (e == w->nedges) {
            break;
        }
        depth++;
        for (int d = depth; d > 1; d--) {
            w->path[d] = w->path[d - 1];
        }
        w->path[1].parent_kind = w->nodes[w->edges[e].parent].kind;
        w->path[1].index = w->edges[e].index;
        w->path[1].key = w->edges[e].key;
        c = w->edges[e].parent;
    }
    return rep_path(w, depth);
}

/* The pending error of copy.copy(node n's object), re-raised (same type,
 * the original as __cause__) naming its path (docs/libraries.md, "Probing"). */
static void name_copy_error(rep_walk *w, Py_ssize_t n)
{
    if (!PyErr_ExceptionMatches(PyExc_Exception)) {
        return;   /* KeyboardInterrupt: as it is */
    }
    PyObject *t, *v, *tb;
    PyErr_Fetch(&t, &v, &tb);
    PyErr_NormalizeException(&t, &v, &tb);
    PyObject *path = node_path(w, n);
    PyObject *msg = path != NULL && v != NULL ? PyUnicode_FromFormat(
        "%U: copy.copy() of a %.100s object (replicate makes one per device to hold that "
        "device's arrays) raised %.100s: %S", path, Py_TYPE(w->nodes[n].obj)->tp_name,
        Py_TYPE(v)->tp_name, v) : NULL;
    Py_XDECREF(path);
    PyErr_Clear();
    PyErr_Restore(t, v, tb);
    dp_reraise_msg(w->st, msg);
}

/* The replica of node n for one device (new reference). arrays_d: that
 * device's broadcast arrays; memo: one slot per node (NULL, REP_BUSY or a
 * new reference), so objects reachable twice stay one object. */
static PyObject *rep_build(rep_walk *w, Py_ssize_t n, PyObject *arrays_d, PyObject **memo)
{
    rep_node *node = &w->nodes[n];
    PyObject *copy = NULL, *cdict = NULL, *v = NULL, *made = NULL;

    if (!node->has_array || memo[n] == REP_BUSY) {
        return Py_NewRef(node->obj);
    }
    if (memo[n] != NULL) {
        return Py_NewRef(memo[n]);
    }
    if (node->kind == RK_ARRAY) {
        copy = PyList_GET_ITEM(arrays_d, node->array_index);
        memo[n] = Py_NewRef(copy);
        return Py_NewRef(copy);
    }
    if (Py_EnterRecursiveCall(" while replicating a module")) {
        return NULL;
    }
    switch (node->kind) {
    case RK_LIST:
        copy = PyList_GetSlice(node->obj, 0, PY_SSIZE_T_MAX);
        break;
    case RK_DICT:
        copy = PyDict_Copy(node->obj);
        break;
    case RK_TUPLE:
    case RK_NAMEDTUPLE:
        copy = PySequence_List(node->obj);   /* items, turned into a tuple below */
        break;
    default:   /* RK_LIST_SUB, RK_DICT_SUB, RK_OBJECT */
        copy = PyObject_CallOneArg(w->st->copy_copy, node->obj);
        if (copy == NULL) {
            name_copy_error(w, n);
        }
        break;
    }
    if (copy == NULL) {
        goto fail;
    }
    if (node->kind == RK_OBJECT || node->kind == RK_LIST_SUB || node->kind == RK_DICT_SUB) {
        if (copy == node->obj) {
            PyErr_Format(PyExc_TypeError,
                         "replicate: copy.copy() returned the same %.100s object; a module "
                         "object holding arrays must be copyable (check its __copy__)",
                         Py_TYPE(node->obj)->tp_name);
            goto fail;
        }
    }
    if (node->kind == RK_OBJECT && node->dict != NULL) {
        cdict = PyObject_GenericGetDict(copy, NULL);
        if (cdict == NULL) {
            goto fail;
        }
        if (cdict == node->dict || !PyDict_Check(cdict)) {
            PyErr_Format(PyExc_TypeError,
                         "replicate: copy.copy() of a %.100s object shares its __dict__; a "
                         "module object holding arrays must be copyable (check its __copy__)",
                         Py_TYPE(node->obj)->tp_name);
            goto fail;
        }
    }
    if (node->kind == RK_TUPLE || node->kind == RK_NAMEDTUPLE) {
        memo[n] = REP_BUSY;
    } else {
        memo[n] = Py_NewRef(copy);
    }
    for (Py_ssize_t e = node->first_edge; e < node->first_edge + node->nedges; e++) {
        const rep_edge *ed = &w->sorted[e];
        v = rep_build(w, ed->child, arrays_d, memo);
        node = &w->nodes[n];
        if (v == NULL) {
            goto fail;
        }
        int rc = 0;
        switch (node->kind) {
        case RK_LIST:
        case RK_TUPLE:
        case RK_NAMEDTUPLE:
            if (ed->index < PyList_GET_SIZE(copy)) {
                rc = PyList_SetItem(copy, ed->index, v);   /* steals v */
                v = NULL;
            }
            break;
        case RK_LIST_SUB:
            rc = PySequence_SetItem(copy, ed->index, v);
            break;
        case RK_DICT:
            rc = PyDict_SetItem(copy, ed->key, v);
            break;
        case RK_DICT_SUB:
            rc = PyObject_SetItem(copy, ed->key, v);
            break;
        default:   /* RK_OBJECT */
            if (ed->index == REP_SLOT_EDGE) {
                rc = Py_TYPE(ed->key)->tp_descr_set(ed->key, copy, v);
            } else {
                rc = PyDict_SetItem(cdict, ed->key, v);
            }
            break;
        }
        Py_CLEAR(v);
        if (rc < 0) {
            goto fail;
        }
    }
    if (node->kind == RK_TUPLE) {
        made = PyList_AsTuple(copy);
    } else if (node->kind == RK_NAMEDTUPLE) {
        made = PyObject_CallMethod((PyObject *)Py_TYPE(node->obj), "_make", "O", copy);
    }
    if (node->kind == RK_TUPLE || node->kind == RK_NAMEDTUPLE) {
        if (made == NULL) {
            goto fail;
        }
        Py_SETREF(copy, made);
        memo[n] = Py_NewRef(copy);
    }
    Py_LeaveRecursiveCall();
    Py_XDECREF(cdict);
    return copy;

fail:
    Py_LeaveRecursiveCall();
    if (memo[n] == REP_BUSY) {
        memo[n] = NULL;
    }
    Py_XDECREF(v);
    Py_XDECREF(cdict);
    Py_XDECREF(copy);
    return NULL;
}

/* dpmini._torch.replicate(module, devices, detach=None): a torch.nn.Module's
 * replicas by torch's rules (docs/spec.md 5); detach None follows grad mode. */
static PyObject *replicate_torch(dp_state *st, PyObject *module, const dp_device *devs,
                                 Py_ssize_t ndev)
{
    PyObject *ids = PyList_New(ndev), *args = NULL, *res = NULL;
    for (Py_ssize_t d = 0; ids != NULL && d < ndev; d++) {
        PyObject *dev = dp_device_to_object(st, devs[d]);
        if (dev == NULL) {
            Py_CLEAR(ids);
            break;
        }
        PyList_SET_ITEM(ids, d, dev);
    }
    args = ids != NULL ? PyTuple_Pack(3, module, ids, Py_None) : NULL;
    if (args != NULL) {
        res = dp_torch_call("replicate", args, NULL);
    }
    Py_XDECREF(args);
    Py_XDECREF(ids);
    if (res != NULL && !PyList_Check(res)) {
        PyErr_Format(PyExc_TypeError, "replicate: dpmini._torch.replicate returned %.100s, "
                     "not a list", Py_TYPE(res)->tp_name);
        Py_CLEAR(res);
    }
    return res;
}

/* replicate(module, devs[0..ndev)) -> list of ndev replicas (docs/spec.md 5,
 * dpmini's rules in the header comment). ndev may be 0. */
static PyObject *replicate_core_steps(dp_state *st, PyObject *module, const dp_device *devs,
                                      Py_ssize_t ndev)
{
    rep_walk w;
    PyObject *result = NULL, *bc = NULL;
    PyObject **memo = NULL;
    Py_ssize_t root = RK_LEAF;

    rep_walk_init(&w, st);
    result = PyList_New(ndev);
    if (result == NULL) {
        goto fail;
    }
    if (ndev == 0) {
        goto done;
    }
    /* A torch.nn.Module: torch's own rule (docs/spec.md 5), in dpmini/_torch.py. */
    int torch_mod = dp_is_torch_module(module);
    if (torch_mod < 0) {
        goto fail;
    }
    if (torch_mod) {
        Py_SETREF(result, replicate_torch(st, module, devs, ndev));
        if (result == NULL) {
            goto fail;
        }
        goto done;
    }
    w.share_torch = 1;
    for (Py_ssize_t d = 0; d < ndev; d++) {
        w.share_torch &= devs[d].kind == DP_VCPU;
    }
    /* Plain callables (functions, builtins, bound methods) hold no arrays. */
    if (!PyFunction_Check(module) && !PyCFunction_Check(module) && !PyMethod_Check(module)) {
        w.arrays = PyList_New(0);
        w.leaves = PyList_New(0);
        w.origins = PyList_New(0);
        if (w.arrays == NULL || w.leaves == NULL || w.origins == NULL) {
            goto fail;
        }
        root = rep_walk_obj(&w, module, 0);
        if (root == RK_ERROR) {
            goto fail;
        }
    }
    if (root < 0 || PyList_GET_SIZE(w.arrays) == 0) {
        for (Py_ssize_t d = 0; d < ndev; d++) {
            PyList_SET_ITEM(result, d, Py_NewRef(module));
        }
        goto done;
    }
    if (rep_link(&w) < 0) {
        goto fail;
    }
    bc = dp_broadcast_coalesced(st, w.arrays, devs, ndev, DP_BROADCAST_BUFFER);
    if (bc == NULL) {
        goto fail;
    }
    if (!PyList_Check(bc) || PyList_GET_SIZE(bc) != ndev) {
        PyErr_SetString(PyExc_SystemError, "replicate: broadcast_coalesced returned a bad list");
        goto fail;
    }
    memo = PyMem_Calloc((size_t)w.nnodes, sizeof *memo);
    if (memo == NULL) {
        PyErr_NoMemory();
        goto fail;
    }
    for (Py_ssize_t d = 0; d < ndev; d++) {
        PyObject *arrays_d = PyList_GET_ITEM(bc, d);
        if (!PyList_Check(arrays_d) || PyList_GET_SIZE(arrays_d) != PyList_GET_SIZE(w.arrays)) {
            PyErr_SetString(PyExc_SystemError,
                            "replicate: broadcast_coalesced returned a bad list");
            goto fail;
        }
        if (dp_replicas_leaves(st, arrays_d, w.arrays, w.leaves, w.origins) < 0) {
            goto fail;
        }
        PyObject *rep = rep_build(&w, root, arrays_d, memo);
        for (Py_ssize_t i = 0; i < w.nnodes; i++) {
            if (memo[i] != REP_BUSY) {
                Py_XDECREF(memo[i]);
            }
            memo[i] = NULL;
        }
        if (rep == NULL) {
            goto fail;
        }
        PyList_SET_ITEM(result, d, rep);
    }
done:
    PyMem_Free(memo);
    Py_XDECREF(bc);
    rep_walk_free(&w);
    return result;

fail:
    if (memo != NULL) {
        for (Py_ssize_t i = 0; i < w.nnodes; i++) {
            if (memo[i] != REP_BUSY) {
                Py_XDECREF(memo[i]);
            }
        }
    }
    PyMem_Free(memo);
    Py_XDECREF(bc);
    Py_XDECREF(result);
    rep_walk_free(&w);
    return NULL;
}

/* replicate_core under dpmini.profile(): one span around it (profile.h). */
PyObject *replicate_core(dp_state *st, PyObject *module, const dp_device *devs,
                         Py_ssize_t ndev)
{
    dp_prof_span sp;
    dp_prof_begin(&sp, DP_PROF_REPLICATE);
    PyObject *res = replicate_core_steps(st, module, devs, ndev);
    dp_prof_end(&sp, NULL);
    return res;
}

/* replicate's device argument: an empty sequence gives n = 0 (no error). */
static int replicate_devices(dp_state *st, PyObject *obj, dp_device **devs, Py_ssize_t *n)
{
    *devs = NULL;
    *n = 0;
    if ((PyList_Check(obj) || PyTuple_Check(obj)) && PySequence_Size(obj) == 0) {
        return 0;
    }
    return dp_device_list_from_object(st, obj, "devices", devs, n);
}

PyDoc_STRVAR(replicate_doc,
"replicate(module, devices, detach=False)\n--\n\n"
"Returns a list of replicas.\n"
"One replica of module per device, in order (PyTorch replicate, docs/spec.md 5).\n"
"devices: a sequence of devices ('cpu:N', 'cuda:N', int, dpmini.Device); an\n"
"empty sequence gives []. Arrays reachable from module through instance\n"
"__dict__ attributes, __slots__ members (of every class in the MRO), lists,\n"
"tuples, namedtuples, dicts (and their subclasses) and sub-objects (depth\n"
"<= 512; deeper raises RecursionError naming the path) are\n"
"broadcast with one broadcast_coalesced call (10 MiB buckets); replica d is a\n"
"shallow copy (copy.copy; lists/dicts/tuples rebuilt) of every object on a\n"
"path to an array, with the arrays replaced by device d's copies. Objects\n"
"with no array below them are shared, and an object reachable twice is one\n"
"object in each replica. A module holding no arrays (functions, builtins,\n"
"bound methods, plain objects) is returned as the same object for every\n"
"device. The replica on devices[0] holds the original arrays where they\n"
"already live there (docs/spec.md 5.6). Arrays of other libraries (torch, JAX, CuPy,\n"
"dpmini.Array: anything with __dlpack__/__dlpack_device__ or\n"
"__cuda_array_interface__) are copied the same way and stay of their type. A\n"
"torch.nn.Module is replicated by PyTorch's rules (docs/spec.md 5.5-5.7, dpmini._torch):\n"
"module._replicate_for_data_parallel() per submodule and device (a shallow\n"
"__dict__ copy: Python attributes and containers are shared), parameters as\n"
"differentiable broadcast copies (their gradients summed onto the original;\n"
"with detach=True, or detach=None under torch.no_grad(), plain copies, which\n"
"on virtual CPU devices share the original's host memory), buffers shared by\n"
"the replica on devices[0] and copied for the others (docs/libraries.md,\n"
"'torch.nn.Module replicas'). detach applies to torch modules only. Errors:\n"
"ValueError/TypeError for bad devices; TypeError when an object with arrays\n"
"cannot be copied, or for a tensor that requires grad (naming its path,\n"
"e.g. module.w); a non-AttributeError raised while probing an attribute for\n"
"the array protocols, re-raised naming its path (module.cfg).");

PyObject *replicate_common(dp_state *st, PyObject *module, PyObject *devices)
{
    dp_device *devs = NULL;
    Py_ssize_t n = 0;
    if (replicate_devices(st, devices, &devs, &n) < 0) {
        return NULL;
    }
    PyObject *res = replicate_core(st, module, devs, n);
    PyMem_Free(devs);
    return res;
}


/* ------------------------------------------------------------------ */
/* Public functions: module level                                      */
/* ------------------------------------------------------------------ */

static PyObject *dp_replicate(PyObject *mod, PyObject *args, PyObject *kwargs)
{
    static char *kwlist[] = {"module", "devices", "detach", NULL};
    PyObject *module, *devices;
    int detach = 0;
    dp_state *st = dp_state_from_module(mod);
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "OO|p:replicate", kwlist,
                                     &module, &devices, &detach)) {
        return NULL;
    }
    int torch_mod = dp_is_torch_module(module);
    if (torch_mod) {
        return torch_mod < 0 ? NULL : dp_torch_call("replicate", args, kwargs);
    }
    return replicate_common(st, module, devices);
}

PyMethodDef dp_replicate_methods[] = {
    {"replicate", (PyCFunction)(void (*)(void))dp_replicate, METH_VARARGS | METH_KEYWORDS,
     replicate_doc},
    {NULL, NULL, 0, NULL},
};
