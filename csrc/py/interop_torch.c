/* interop_torch.c - what PyTorch needs beyond DLPack (docs/design.md,
 * "Arrays of other libraries"): whether an object is a torch.nn.Module, and
 * torch's per-thread grad mode carried into the replica threads
 * (parallel_apply.c), as torch.nn.parallel.parallel_apply does. Everything
 * here looks torch up in sys.modules only: dpmini never imports torch. (A
 * torch.nn.Module's replicas are made by dpmini/_torch.py.)
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
/* torch.nn.Module                                                     */
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

/* ------------------------------------------------------------------ */
/* torch's per-thread grad mode (parallel_apply.c)                     */
/* ------------------------------------------------------------------ */

int dp_torch_grad_enabled(void)
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
    int prev = dp_torch_grad_enabled();
    PyObject *r = PyObject_CallMethod(torch, "set_grad_enabled", "O", on ? Py_True : Py_False);
    Py_DECREF(torch);
    Py_XDECREF(r);
    PyErr_Clear();
    return r == NULL ? -1 : prev;
}

/* CPU autocast, carried like grad mode: torch.autocast("cpu", dtype=...) of
 * the caller's state when CPU autocast is enabled there, else NULL (no
 * error). torch.nn.parallel.parallel_apply enters autocast per replica. */
PyObject *dp_torch_autocast_carry(void)
{
    PyObject *torch = module_if_imported("torch");
    if (torch == NULL)
        return NULL;
    /* torch >= 2.4 takes the device type; older ones name the CPU state */
    int old = 0;
    PyObject *res = NULL, *on = PyObject_CallMethod(torch, "is_autocast_enabled", "s", "cpu");
    if (on == NULL) {
        PyErr_Clear();
        old = 1;
        on = PyObject_CallMethod(torch, "is_autocast_cpu_enabled", NULL);
    }
    if (on != NULL && PyObject_IsTrue(on) == 1) {
        PyObject *dtype = old ? PyObject_CallMethod(torch, "get_autocast_cpu_dtype", NULL)
                              : PyObject_CallMethod(torch, "get_autocast_dtype", "s", "cpu");
        PyObject *ctor = dtype != NULL ? PyObject_GetAttrString(torch, "autocast") : NULL;
        PyObject *args = ctor != NULL ? Py_BuildValue("(s)", "cpu") : NULL;
        PyObject *kw = args != NULL ? Py_BuildValue("{s:O}", "dtype", dtype) : NULL;
        if (kw != NULL)
            res = PyObject_Call(ctor, args, kw);
        Py_XDECREF(kw);
        Py_XDECREF(args);
        Py_XDECREF(ctor);
        Py_XDECREF(dtype);
    }
    Py_XDECREF(on);
    Py_DECREF(torch);
    PyErr_Clear();
    return res;
}

int dp_torch_autocast_enter(PyObject *cm)
{
    PyObject *r = PyObject_CallMethod(cm, "__enter__", NULL);
    Py_XDECREF(r);
    PyErr_Clear();
    return r != NULL;
}

void dp_torch_autocast_exit(PyObject *cm)
{
    PyObject *t, *v, *tb;
    PyErr_Fetch(&t, &v, &tb);
    PyObject *r = PyObject_CallMethod(cm, "__exit__", "OOO", Py_None, Py_None, Py_None);
    Py_XDECREF(r);
    PyErr_Clear();
    PyErr_Restore(t, v, tb);
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
