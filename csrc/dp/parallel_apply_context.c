/* parallel_apply_context.c - replica contexts: per-thread state of an array
 * library that a replica on a worker thread must see as the caller has it
 * (docs/spec.md 6.2: torch's parallel_apply carries grad mode, autocast and the
 * current stream into each worker). dpmini knows no library here: an
 * adapter registers a provider (dpmini.register_replica_context), and
 * parallel_apply (parallel_apply.c) calls
 *   - contexts_capture once per call, on the caller's thread, before any
 *     replica starts: each provider(devices) returns an enter callable, or
 *     None when it has nothing to carry this call;
 *   - contexts_enter in each worker thread before its replica runs:
 *     enter(i, device) returns an exit callable or None;
 *   - contexts_exit in that thread after the replica returned, raised, or
 *     was skipped after a Ctrl-C, and also when the caller has given up on
 *     it (abandoned): the exits in reverse order.
 * Replicas that run inline on the caller's thread (one replica, nested
 * calls, host devices) need nothing carried and call no provider.
 *
 * The torch adapter (dpmini/_torch.py) is loaded, and registers itself,
 * the first time a call finds torch imported (dp_torch_context_load,
 * interop_torch.c). A call with no provider registered and torch not
 * imported costs one sys.modules lookup.
 */
#include "dpmini.h"
#include "parallel_apply.h"

/* ------------------------------------------------------------------ */
/* Helpers                                                             */
/* ------------------------------------------------------------------ */

/* The devices of jobs[0..m) as a tuple of dpmini.Device (new reference). */
static PyObject *device_tuple(dp_state *st, const apply_job *jobs, Py_ssize_t m)
{
    PyObject *devs = PyTuple_New(m);
    for (Py_ssize_t i = 0; devs != NULL && i < m; i++) {
        PyObject *d = dp_device_to_object(st, jobs[i].dev);
        if (d == NULL) {
            Py_CLEAR(devs);
            break;
        }
        PyTuple_SET_ITEM(devs, i, d);
    }
    return devs;
}

/* The pending error of provider(devices), raised again (same type, the
 * original as __cause__) naming the provider. */
static void name_provider_error(PyObject *provider)
{
    if (!PyErr_ExceptionMatches(PyExc_Exception)) {
        return;
    }
    PyObject *t, *v, *tb;
    PyErr_Fetch(&t, &v, &tb);
    PyErr_NormalizeException(&t, &v, &tb);
    PyObject *msg = v != NULL ? PyUnicode_FromFormat(
        "parallel_apply: the replica context provider %R raised %.100s: %S (no replica ran)",
        provider, Py_TYPE(v)->tp_name, v) : NULL;
    PyErr_Restore(t, v, tb);
    dp_reraise_msg(NULL, msg);
}

/* Call every provider with devs; the tuple of the enter callables they
 * returned (new reference), or Py_None when none has anything to carry. A
 * provider's error is raised again naming the provider. */
static PyObject *call_providers(PyObject *providers, PyObject *devs)
{
    Py_ssize_t n = PyTuple_GET_SIZE(providers), got = 0;
    PyObject *enters = PyTuple_New(n);
    if (enters == NULL) {
        return NULL;
    }
    for (Py_ssize_t k = 0; k < n; k++) {
        PyObject *p = PyTuple_GET_ITEM(providers, k);
        PyObject *e = PyObject_CallOneArg(p, devs);
        if (e == NULL) {
            name_provider_error(p);
            Py_DECREF(enters);
            return NULL;
        }
        if (e == Py_None) {
            Py_DECREF(e);
            continue;
        }
        PyTuple_SET_ITEM(enters, got++, e);
    }
    if (got == 0) {
        Py_DECREF(enters);
        return Py_NewRef(Py_None);
    }
    if (got < n) {   /* the slots past got are empty */
        Py_SETREF(enters, PyTuple_GetSlice(enters, 0, got));
    }
    return enters;
}

/* Run exits[0..n) in reverse order (a worker thread, GIL held); None
 * entries are skipped. Returns the first error as an exception instance
 * (new reference; later ones are reported as unraisable), or NULL. */
static PyObject *run_exits(PyObject *exits, Py_ssize_t n)
{
    PyObject *first = NULL;
    for (Py_ssize_t k = n - 1; k >= 0; k--) {
        PyObject *x = PyTuple_GET_ITEM(exits, k);
        if (x == Py_None) {
            continue;
        }
        PyObject *r = PyObject_CallNoArgs(x);
        if (r != NULL) {
            Py_DECREF(r);
        } else if (first == NULL) {
            first = replica_take_exception();
        } else {
            PyErr_WriteUnraisable(x);
        }
    }
    return first;
}

/* ------------------------------------------------------------------ */
/* Hidden functions (parallel_apply.h)                                 */
/* ------------------------------------------------------------------ */

int contexts_capture(dp_state *st, apply_job *jobs, Py_ssize_t m)
{
    if (dp_torch_context_load(st) < 0) {
        return -1;
    }
    PyObject *providers = st->replica_contexts;
    if (providers == NULL || PyTuple_GET_SIZE(providers) == 0) {
        return 0;
    }
    Py_INCREF(providers);   /* a provider may register another meanwhile */
    PyObject *devs = device_tuple(st, jobs, m);
    PyObject *enters = devs != NULL ? call_providers(providers, devs) : NULL;
    Py_DECREF(providers);
    if (enters == NULL) {
        Py_XDECREF(devs);
        return -1;
    }
    if (enters != Py_None) {
        for (Py_ssize_t i = 0; i < m; i++) {
            if (jobs[i].on_worker) {
                jobs[i].ctx_enters = Py_NewRef(enters);
                jobs[i].ctx_device = Py_NewRef(PyTuple_GET_ITEM(devs, i));
            }
        }
    }
    Py_DECREF(enters);
    Py_DECREF(devs);
    return 0;
}

int contexts_enter(apply_job *job)
{
    if (job->ctx_enters == NULL) {
        return 0;
    }
    Py_ssize_t n = PyTuple_GET_SIZE(job->ctx_enters);
    PyObject *exits = PyTuple_New(n), *index = PyLong_FromSsize_t(job->index);
    if (exits == NULL || index == NULL) {
        Py_XDECREF(exits);
        Py_XDECREF(index);
        return -1;
    }
    for (Py_ssize_t k = 0; k < n; k++) {
        PyObject *args[2] = {index, job->ctx_device};
        PyObject *x = PyObject_Vectorcall(PyTuple_GET_ITEM(job->ctx_enters, k), args, 2, NULL);
        if (x == NULL) {
            /* the contexts entered so far are left, in reverse order */
            PyObject *err = replica_take_exception();
            PyObject *later = run_exits(exits, k);
            if (later != NULL) {
                PyErr_SetObject((PyObject *)Py_TYPE(later), later);
                PyErr_WriteUnraisable(PyTuple_GET_ITEM(job->ctx_enters, k));
                Py_DECREF(later);
            }
            for (Py_ssize_t j = k; j < n; j++) {
                PyTuple_SET_ITEM(exits, j, Py_NewRef(Py_None));
            }
            Py_DECREF(exits);
            Py_DECREF(index);
            restore_exception(err);
            return -1;
        }
        PyTuple_SET_ITEM(exits, k, x);
    }
    Py_DECREF(index);
    job->ctx_exits = exits;
    return 0;
}

int contexts_exit(apply_job *job)
{
    if (job->ctx_exits == NULL) {
        return 0;
    }
    PyObject *exits = job->ctx_exits;
    job->ctx_exits = NULL;
    PyObject *err = run_exits(exits, PyTuple_GET_SIZE(exits));
    Py_DECREF(exits);
    if (err != NULL) {
        restore_exception(err);
        return -1;
    }
    return 0;
}

/* ------------------------------------------------------------------ */
/* Public functions                                                    */
/* ------------------------------------------------------------------ */

/* The module's registry with provider added (add) or removed. */
static PyObject *registry_update(PyObject *mod, PyObject *provider, int add)
{
    dp_state *st = dp_state_from_module(mod);
    PyObject *old = st->replica_contexts;
    Py_ssize_t n = old != NULL ? PyTuple_GET_SIZE(old) : 0, at = -1;
    for (Py_ssize_t k = 0; k < n && at < 0; k++) {
        PyObject *p = PyTuple_GET_ITEM(old, k);
        int eq = p == provider ? 1 : PyObject_RichCompareBool(p, provider, Py_EQ);
        if (eq < 0) {
            return NULL;
        }
        at = eq ? k : -1;
    }
    if (add ? at >= 0 : at < 0) {
        return Py_NewRef(add ? Py_None : Py_False);   /* already there / not there */
    }
    PyObject *upd = PyTuple_New(add ? n + 1 : n - 1);
    if (upd == NULL) {
        return NULL;
    }
    for (Py_ssize_t k = 0, j = 0; k < n; k++) {
        if (k != at) {
            PyTuple_SET_ITEM(upd, j++, Py_NewRef(PyTuple_GET_ITEM(old, k)));
        }
    }
    if (add) {
        PyTuple_SET_ITEM(upd, n, Py_NewRef(provider));
    }
    /* a new tuple: a call iterating the old one keeps its own reference */
    st->replica_contexts = upd;
    Py_XDECREF(old);
    return Py_NewRef(add ? Py_None : Py_True);
}

PyDoc_STRVAR(register_replica_context_doc,
"register_replica_context(provider)\n--\n\n"
"Returns None.\n"
"Carry per-thread state of a library into the worker threads that run\n"
"replicas (as torch.nn.parallel.parallel_apply carries torch's grad mode,\n"
"autocast and current CUDA stream, docs/spec.md 6.2). For each call that runs\n"
"replicas on worker threads, parallel_apply (and DataParallel's forward)\n"
"calls provider(devices) once on the caller's thread before any replica\n"
"starts; devices is a tuple of dpmini.Device, one per replica. It returns\n"
"None (nothing to carry this call) or enter, a callable that each worker\n"
"thread calls as enter(i, device) just before replica i runs there; enter\n"
"returns None or exit, which that thread calls with no arguments after the\n"
"replica returned or raised, or was skipped after a Ctrl-C. Worker threads\n"
"persist between calls, so enter sets the state on every call and exit\n"
"restores what the thread had. Providers run in registration order, exits\n"
"in reverse order. Replicas that run inline in the caller's thread (one\n"
"replica, nested calls) already see the caller's state: no provider is\n"
"called. Registering the same provider (==) twice does nothing.\n"
"Errors: TypeError when provider is not callable. An exception raised by\n"
"provider fails the call before any replica runs (raised again naming the\n"
"provider, the original as __cause__); one raised by enter or exit is\n"
"replica i's error (docs/spec.md 6.5; an exit's error when the replica already\n"
"failed is reported with sys.unraisablehook). dpmini registers PyTorch's\n"
"provider itself the first time a call finds torch imported (docs/libraries.md,\n"
"\"torch's per-thread state in the replicas\").");

static PyObject *dp_register_replica_context(PyObject *mod, PyObject *provider)
{
    if (!PyCallable_Check(provider)) {
        PyErr_Format(PyExc_TypeError,
                     "register_replica_context: provider must be callable, got %.100s",
                     Py_TYPE(provider)->tp_name);
        return NULL;
    }
    return registry_update(mod, provider, 1);
}

PyDoc_STRVAR(unregister_replica_context_doc,
"unregister_replica_context(provider)\n--\n\n"
"Returns True when provider (==) was registered and is now removed, else\n"
"False. Undoes register_replica_context: later calls no longer call it\n"
"(a call already running still enters and exits it). Raises nothing but\n"
"what provider's __eq__ raises.");

static PyObject *dp_unregister_replica_context(PyObject *mod, PyObject *provider)
{
    return registry_update(mod, provider, 0);
}

PyMethodDef dp_replica_context_methods[] = {
    {"register_replica_context", dp_register_replica_context, METH_O,
     register_replica_context_doc},
    {"unregister_replica_context", dp_unregister_replica_context, METH_O,
     unregister_replica_context_doc},
    {NULL, NULL, 0, NULL},
};
