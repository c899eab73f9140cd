/* interop_torch.c - what PyTorch needs beyond DLPack (docs/design.md,
 * "Arrays of other libraries"): the torch.nn.Module rule of replicate, and
 * loading the torch adapter (dpmini/_torch.py), whose replica context
 * carries torch's per-thread state into the replica threads (as
 * torch.nn.parallel.parallel_apply does, spec 6.2). Everything here looks
 * torch up in sys.modules only: dpmini never imports torch.
 */
#include "dpmini.h"

/* sys.modules[name] (new reference) or NULL, never an exception. */
static PyObject *module_if_imported(const char *name)
{
    PyObject *n = PyUnicode_FromString(name);
    PyObject *mod = n != NULL ? PyImport_GetModule(n) : NULL;
    Py_XDECREF(n);
    PyErr_Clear();
    return mod;
}

/* ------------------------------------------------------------------ */
/* replicate                                                           */
/* ------------------------------------------------------------------ */

int dp_is_torch_module(PyObject *obj)
{
    if (PyType_Check(obj))
        return 0;
    PyObject *mod = module_if_imported("torch.nn");   /* only when torch is imported */
    if (mod == NULL)
        return 0;
    PyObject *cls = PyObject_GetAttrString(mod, "Module");
    Py_DECREF(mod);
    if (cls == NULL) {
        PyErr_Clear();
        return 0;
    }
    int r = PyType_Check(cls) && PyType_IsSubtype(Py_TYPE(obj), (PyTypeObject *)cls);
    Py_DECREF(cls);
    return r;
}

/* Is v shared by reference between the replicas (spec 5.5: PyTorch's
 * replicas share the "other Python attributes")? Everything but tensors,
 * modules and the containers that may hold them (dict, list, tuple, set,
 * whose copies deepcopy makes as before). 1/0/-1. */
static int shared_attr(PyObject *v, PyObject *tensor_cls)
{
    if (PyDict_Check(v) || PyList_Check(v) || PyTuple_Check(v) || PyAnySet_Check(v))
        return 0;
    if (tensor_cls != NULL && PyType_IsSubtype(Py_TYPE(v), (PyTypeObject *)tensor_cls))
        return 0;
    int r = dp_is_torch_module(v);
    return r < 0 ? -1 : !r;
}

/* A copy.deepcopy memo (a new dict) that maps id(v) -> v for every shared
 * attribute v (shared_attr) in the __dict__ of module and its submodules,
 * so that the per-replica deepcopy shares them as PyTorch's replicate does
 * (a threading.Lock, an open file, a tokenizer cannot be deep-copied). */
static PyObject *shared_attrs_memo(PyObject *module)
{
    PyObject *memo = PyDict_New(), *mods = NULL, *it = NULL, *m = NULL, *tensor_cls = NULL;
    PyObject *torch = module_if_imported("torch");
    if (torch != NULL) {
        tensor_cls = PyObject_GetAttrString(torch, "Tensor");
        Py_DECREF(torch);
        if (tensor_cls != NULL && !PyType_Check(tensor_cls))
            Py_CLEAR(tensor_cls);
        PyErr_Clear();
    }
    if (memo == NULL)
        goto fail;
    mods = PyObject_CallMethod(module, "modules", NULL);
    it = mods != NULL ? PyObject_GetIter(mods) : NULL;
    if (it == NULL)
        goto fail;
    while ((m = PyIter_Next(it)) != NULL) {
        PyObject *d = PyObject_GenericGetDict(m, NULL);
        Py_DECREF(m);
        if (d == NULL)
            goto fail;
        PyObject *key, *v;
        Py_ssize_t pos = 0;
        int rc = 0;
        while (rc == 0 && PyDict_Next(d, &pos, &key, &v)) {
            int r = shared_attr(v, tensor_cls);
            if (r < 0) {
                rc = -1;
                break;
            }
            if (r) {
                PyObject *id = PyLong_FromVoidPtr(v);
                rc = id != NULL ? PyDict_SetItem(memo, id, v) : -1;
                Py_XDECREF(id);
            }
        }
        Py_DECREF(d);
        if (rc < 0)
            goto fail;
    }
    if (PyErr_Occurred())
        goto fail;
    Py_DECREF(it);
    Py_DECREF(mods);
    Py_XDECREF(tensor_cls);
    return memo;
fail:
    Py_XDECREF(it);
    Py_XDECREF(mods);
    Py_XDECREF(tensor_cls);
    Py_XDECREF(memo);
    return NULL;
}

/* The pending error of copy.deepcopy(module), re-raised (same type, the
 * original as __cause__) naming the module and what was being done. */
static void name_deepcopy_error(PyObject *module)
{
    if (!PyErr_ExceptionMatches(PyExc_Exception))
        return;
    PyObject *t, *v, *tb;
    PyErr_Fetch(&t, &v, &tb);
    PyErr_NormalizeException(&t, &v, &tb);
    PyObject *msg = v != NULL ? PyUnicode_FromFormat(
        "module: copy.deepcopy of the %.100s for a replica on another virtual CPU device "
        "raised %.100s: %S (attributes that are not tensors, modules or dicts/lists/tuples/"
        "sets are shared by reference, as in PyTorch; an object inside such a container "
        "must be deep-copyable, or hold it in an attribute of its own)",
        Py_TYPE(module)->tp_name, Py_TYPE(v)->tp_name, v) : NULL;
    PyErr_Restore(t, v, tb);
    dp_reraise_msg(NULL, msg);
}

PyObject *dp_replicate_torch_module(dp_state *st, PyObject *module, const dp_device *devs,
                                    Py_ssize_t ndev)
{
    int ncpu = 0, ncuda = 0;
    for (Py_ssize_t d = 0; d < ndev; d++) {
        ncpu += devs[d].kind == DP_VCPU;
        ncuda += devs[d].kind == DP_CUDA;
    }
    if (ncpu == ndev) {
        /* Virtual CPU devices are one host memory. Replica 0 is the module
         * itself (as PyTorch's replica on device_ids[0] shares the original's
         * parameters and buffers, spec 5.6); replicas 1..k-1 are each a
         * copy.deepcopy made now, under torch.no_grad(), so that forwards
         * writing to their module (BatchNorm running stats, functional_call,
         * counters) touch only their own copy, whose updates are then lost. */
        PyObject *res = PyList_New(ndev);
        if (res == NULL)
            return NULL;
        PyList_SET_ITEM(res, 0, Py_NewRef(module));
        if (ndev == 1)
            return res;
        PyObject *copy = PyImport_ImportModule("copy");
        PyObject *deep = copy != NULL ? PyObject_GetAttrString(copy, "deepcopy") : NULL;
        Py_XDECREF(copy);
        PyObject *memo = deep != NULL ? shared_attrs_memo(module) : NULL;
        if (memo == NULL)
            Py_CLEAR(deep);
        int prev = deep != NULL ? dp_torch_set_grad(0) : -1;
        for (Py_ssize_t d = 1; deep != NULL && d < ndev; d++) {
            /* a memo per replica: deepcopy adds every copy it makes */
            PyObject *md = PyDict_Copy(memo);
            PyObject *c = md != NULL ? PyObject_CallFunctionObjArgs(deep, module, md, NULL)
                                     : NULL;
            Py_XDECREF(md);
            if (c == NULL) {
                name_deepcopy_error(module);
                Py_CLEAR(deep);
                break;
            }
            PyList_SET_ITEM(res, d, c);
        }
        Py_XDECREF(memo);
        if (prev >= 0) {
            PyObject *t, *v, *tb;
            PyErr_Fetch(&t, &v, &tb);
            dp_torch_set_grad(prev);
            PyErr_Restore(t, v, tb);
        }
        if (deep == NULL) {
            Py_DECREF(res);
            return NULL;
        }
        Py_DECREF(deep);
        return res;
    }
    if (ncuda != ndev) {
        PyErr_SetString(PyExc_TypeError,
                        "replicate: a torch.nn.Module is replicated over virtual CPU devices "
                        "(copies) or over CUDA devices (torch.nn.parallel.replicate), not a "
                        "mix of both");
        return NULL;
    }
    /* CUDA devices: PyTorch's own replicate (its parameters must be on
     * devices[0], as torch.nn.DataParallel requires), detached: dpmini has
     * no autograd. Not run on a real GPU yet (docs/design.md). */
    PyObject *ids = PyList_New(ndev), *res = NULL;
    for (Py_ssize_t d = 0; ids != NULL && d < ndev; d++) {
        PyObject *i = PyLong_FromLong(devs[d].index);
        if (i == NULL) {
            Py_CLEAR(ids);
            break;
        }
        PyList_SET_ITEM(ids, d, i);
    }
    PyObject *par = ids != NULL ? PyImport_ImportModule("torch.nn.parallel") : NULL;
    PyObject *fn = par != NULL ? PyObject_GetAttrString(par, "replicate") : NULL;
    Py_XDECREF(par);
    if (fn != NULL) {
        PyObject *args = Py_BuildValue("(OO)", module, ids), *kw = Py_BuildValue("{s:O}",
                                                                               "detach", Py_True);
        if (args != NULL && kw != NULL)
            res = PyObject_Call(fn, args, kw);
        Py_XDECREF(args);
        Py_XDECREF(kw);
        Py_DECREF(fn);
    }
    Py_XDECREF(ids);
    if (res != NULL && !PyList_Check(res)) {
        Py_SETREF(res, PySequence_List(res));
    }
    return res;
}

/* ------------------------------------------------------------------ */
/* torch's per-thread grad mode; its replica context                   */
/* ------------------------------------------------------------------ */

/* torch.is_grad_enabled() in this thread: 1/0; -1 when torch is not
 * imported (never an exception). */
static int torch_grad_enabled(void)
{
    PyObject *torch = module_if_imported("torch");
    if (torch == NULL)
        return -1;
    PyObject *r = PyObject_CallMethod(torch, "is_grad_enabled", NULL);
    Py_DECREF(torch);
    int res = r == NULL ? -1 : PyObject_IsTrue(r);
    Py_XDECREF(r);
    PyErr_Clear();
    return res < 0 ? -1 : res;
}

int dp_torch_set_grad(int on)
{
    PyObject *torch = module_if_imported("torch");
    if (torch == NULL)
        return -1;
    int prev = torch_grad_enabled();
    PyObject *r = PyObject_CallMethod(torch, "set_grad_enabled", "O", on ? Py_True : Py_False);
    Py_DECREF(torch);
    Py_XDECREF(r);
    PyErr_Clear();
    return r == NULL ? -1 : prev;
}

/* What torch keeps per thread (grad mode, inference mode, autocast, the
 * current CUDA streams, the intra-op thread count, the random numbers of
 * replicas) is carried into the replicas by dpmini/_torch.py's provider,
 * registered when that module is imported. A replica may use torch without
 * a torch argument, so any call that finds torch imported loads it. */
int dp_torch_context_load(dp_state *st)
{
    if (st->torch_context_loaded)
        return 0;
    PyObject *torch = module_if_imported("torch");
    if (torch == NULL)
        return 0;
    Py_DECREF(torch);
    PyObject *adapter = PyImport_ImportModule("dpmini._torch");
    if (adapter == NULL)
        return -1;
    Py_DECREF(adapter);
    st->torch_context_loaded = 1;
    return 0;
}

/* ------------------------------------------------------------------ */
/* comm results                                                        */
/* ------------------------------------------------------------------ */

/* The first item of a sequence (new reference), or NULL with no error. */
static PyObject *first_item(PyObject *seq)
{
    if (PyArray_Check(seq) || !PySequence_Check(seq) || PyUnicode_Check(seq))
        return NULL;
    PyObject *f = PySequence_GetItem(seq, 0);
    if (f == NULL)
        PyErr_Clear();
    return f;
}

PyObject *dp_comm_back(dp_state *st, PyObject *like, int from_seq, PyObject *result)
{
    if (result == NULL)
        return NULL;
    PyObject *src = from_seq ? first_item(like) : Py_NewRef(like);
    if (src == NULL)
        return result;
    PyObject *origin = dp_array_origin(st, src);
    Py_DECREF(src);
    if (origin == NULL) {
        Py_DECREF(result);
        return NULL;
    }
    PyObject *res = result;
    if (origin != Py_None && (PyTuple_CheckExact(result) || PyList_CheckExact(result))) {
        /* scatter / broadcast: each piece back into the library */
        Py_ssize_t n = PySequence_Fast_GET_SIZE(result);
        res = PyTuple_CheckExact(result) ? PyTuple_New(n) : PyList_New(n);
        for (Py_ssize_t i = 0; res != NULL && i < n; i++) {
            PyObject *v = dp_to_origin(st, origin,
                                       Py_NewRef(PySequence_Fast_GET_ITEM(result, i)), "result");
            if (v == NULL)
                Py_CLEAR(res);
            else if (PyTuple_Check(res))
                PyTuple_SET_ITEM(res, i, v);
            else
                PyList_SET_ITEM(res, i, v);
        }
        Py_DECREF(result);
    }
    else if (origin != Py_None) {
        res = dp_to_origin(st, origin, result, "result");
    }
    Py_DECREF(origin);
    return res;
}

PyObject *dp_comm_back_rows(dp_state *st, PyObject *arrays, PyObject *rows)
{
    if (rows == NULL || !PyList_Check(rows))
        return rows;
    PyObject *seq = PySequence_Fast(arrays, "arrays");
    if (seq == NULL) {
        Py_DECREF(rows);
        return NULL;
    }
    for (Py_ssize_t i = 0; i < PySequence_Fast_GET_SIZE(seq); i++) {
        PyObject *origin = dp_array_origin(st, PySequence_Fast_GET_ITEM(seq, i));
        if (origin == NULL)
            goto fail;
        for (Py_ssize_t d = 0; d < PyList_GET_SIZE(rows); d++) {
            PyObject *row = PyList_GET_ITEM(rows, d);
            if (!PyList_Check(row) || i >= PyList_GET_SIZE(row))
                continue;
            PyObject *v = dp_to_origin(st, origin, Py_NewRef(PyList_GET_ITEM(row, i)),
                                       "result");
            if (v == NULL || PyList_SetItem(row, i, v) < 0) {
                Py_DECREF(origin);
                goto fail;
            }
        }
        Py_DECREF(origin);
    }
    Py_DECREF(seq);
    return rows;
fail:
    Py_DECREF(seq);
    Py_DECREF(rows);
    return NULL;
}
