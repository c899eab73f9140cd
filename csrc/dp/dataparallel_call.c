/* dataparallel_call.c - one call of a dpmini.DataParallel: the argument
 * helpers, the snapshot of the settings a call works on, and forward (the
 * exact type's C path and the generic path through overridden steps), and the
 * functional data_parallel (docs/spec.md 2.9). The
 * type itself, construction and the step methods are in dataparallel.c, the
 * repr, attributes and pickling in dataparallel_attrs.c (docs/spec.md 2;
 * docs/design.md).
 */
#include "dpmini.h"
#include "dataparallel.h"
#include "dataparallel_type.h"
#include "gpu.h"
#include "walk.h"
#include "plan.h"
#include "profile.h"

#include <string.h>

/* ------------------------------------------------------------------ */
/* Helpers: arguments                                                  */
/* ------------------------------------------------------------------ */

/* A gather target: "cpu"/-1 (host; -1 warns FutureWarning, docs/spec.md 4.3) or a
 * device. */
int dp_parse_target_device(dp_state *st, PyObject *obj, const char *argname,
                           dp_device *out)
{
    if (dp_device_from_object(st, obj, argname, DP_DEV_ALLOW_HOST, out) < 0) {
        return -1;
    }
    if (dp_is_index_like(obj) && out->kind == DP_HOST &&
        PyErr_WarnEx(PyExc_FutureWarning,
                     "Using -1 to represent CPU tensor is deprecated. Please use a "
                     "device object or string instead, e.g., \"cpu\".", 1) < 0) {
        return -1;
    }
    return 0;
}

/* A new list of dpmini.Device for devs[0..n). */
PyObject *dp_device_list_new(dp_state *st, const dp_device *devs, Py_ssize_t n)
{
    PyObject *list = PyList_New(n);
    if (list == NULL) {
        return NULL;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *d = dp_device_to_object(st, devs[i]);
        if (d == NULL) {
            Py_DECREF(list);
            return NULL;
        }
        PyList_SET_ITEM(list, i, d);
    }
    return list;
}

/* Call module(*inputs[0], **kwargs[0]) (the one-device path, docs/spec.md 2.5).
 * On a GPU the device is made current for the call and restored after
 * (PyTorch leaves the current device as it is; dpmini runs every replica
 * with its GPU current, so CuPy allocations in DataParallel(device_ids=[1])
 * land on cuda:1 with one device as with several; docs/differences.md). */
static PyObject *call_first(dp_state *st, PyObject *module, PyObject *inputs, PyObject *kwargs,
                            dp_device dev)
{
    PyObject *args = NULL, *kw = NULL, *res = NULL;
    dpc_device_guard guard = {-1, 0, NULL};
    if (PyTuple_GET_SIZE(inputs) > 0) {
        args = input_as_args(PyTuple_GET_ITEM(inputs, 0));
    } else {
        args = PyTuple_New(0);
    }
    if (args == NULL) {
        goto fail;
    }
    if (PyTuple_GET_SIZE(kwargs) > 0 &&
        kwargs_as_dict(PyTuple_GET_ITEM(kwargs, 0), "kwargs", 0, &kw) < 0) {
        goto fail;
    }
    if (dev.kind == DP_CUDA) {
        dpc_status s = dpc_guard_enter(dev.index, &guard);
        if (s.code != 0) {
            dp_gpu_raise(st, s, "DataParallel: make the replica's GPU current");
            goto fail;
        }
    }
    res = PyObject_Call(module, args, kw);
    dpc_guard_leave(&guard);
fail:
    Py_XDECREF(args);
    Py_XDECREF(kw);
    return res;
}

/* docs/spec.md 2.4: a call with no arguments at all runs the module once, as
 * ((),) / ({},). Replaces *inputs and *kwargs (tuples) when both are empty. */
static int fix_empty_call(PyObject **inputs, PyObject **kwargs)
{
    if (PyTuple_GET_SIZE(*inputs) != 0 || PyTuple_GET_SIZE(*kwargs) != 0) {
        return 0;
    }
    PyObject *noargs = PyTuple_New(0);
    PyObject *nokw = PyDict_New();
    PyObject *in = NULL, *kw = NULL;
    if (noargs != NULL && nokw != NULL) {
        in = PyTuple_Pack(1, noargs);
        kw = PyTuple_Pack(1, nokw);
    }
    Py_XDECREF(noargs);
    Py_XDECREF(nokw);
    if (in == NULL || kw == NULL) {
        Py_XDECREF(in);
        Py_XDECREF(kw);
        return -1;
    }
    Py_SETREF(*inputs, in);
    Py_SETREF(*kwargs, kw);
    return 0;
}

/* ------------------------------------------------------------------ */
/* Helpers: forward                                                    */
/* ------------------------------------------------------------------ */


/* scatter_kwargs with the options o over devs[0..ndev). */
int dp_scatter_with(dp_state *st, PyObject *args, PyObject *kwargs, const dp_device *devs,
                    Py_ssize_t ndev, const call_opts *o, PyObject **inputs,
                    PyObject **kws)
{
    int64_t sizes_buf[DP_MAX_DEVICES];
    double weights_buf[DP_MAX_DEVICES];
    dp_split_opts so;
    if (dp_parse_split_sizes(o->chunk_sizes, o->weights, ndev, sizes_buf, weights_buf,
                             &so) < 0) {
        return -1;
    }
    so.dim = o->dim;
    so.strict = o->strict;
    so.in_dims = o->in_dims;
    return dp_scatter_kwargs_ex(st, args, kwargs, devs, ndev, &so, inputs, kws);
}

/* Check in_dims, out_dims, chunk_sizes and weights as given to a
 * constructor (ndev devices); replace chunk_sizes / weights (new
 * references in *cs_out / *w_out) by tuples. */
int dp_check_call_opts(PyObject *in_dims, PyObject *out_dims, PyObject *cs, PyObject *w,
                       Py_ssize_t ndev, PyObject **cs_out, PyObject **w_out)
{
    int64_t sizes_buf[DP_MAX_DEVICES];
    double weights_buf[DP_MAX_DEVICES];
    dp_split_opts so;
    *cs_out = *w_out = NULL;
    if (dp_check_dims_spec(in_dims, "in_dims", 0) < 0 ||
        dp_check_dims_spec(out_dims, "out_dims", 1) < 0 ||
        dp_parse_split_sizes(cs, w, ndev, sizes_buf, weights_buf, &so) < 0) {
        return -1;
    }
    *cs_out = cs == Py_None ? Py_NewRef(Py_None) : PySequence_Tuple(cs);
    *w_out = w == Py_None ? Py_NewRef(Py_None) : PySequence_Tuple(w);
    if (*cs_out == NULL || *w_out == NULL) {
        Py_CLEAR(*cs_out);
        Py_CLEAR(*w_out);
        return -1;
    }
    return 0;
}

/* DataParallel.forward with the C steps (the exact type, and
 * data_parallel): docs/spec.md 2 in order. args: tuple; kwargs: dict or NULL. */
PyObject *dp_forward_core(dp_state *st, PyObject *module, PyObject *args, PyObject *kwargs,
                          const dp_device *devs, Py_ssize_t ndev, dp_device out_dev,
                          const call_opts *o)
{
    PyObject *inputs = NULL, *kws = NULL, *replicas = NULL, *outputs = NULL, *res = NULL;

    dp_prof_ctx prof = dp_prof_current();
    for (Py_ssize_t i = 0; prof.s != NULL && i < ndev; i++) {   /* idle ones too */
        dp_prof_record_since(&prof, DP_PROF_DEVICE, devs[i].kind, devs[i].index, dp_prof_now(),
                             NULL);
    }
    if (dp_scatter_with(st, args, kwargs, devs, ndev, o, &inputs, &kws) < 0) {
        return NULL;
    }
    if (fix_empty_call(&inputs, &kws) < 0) {
        goto fail;
    }
    if (ndev == 1) {
        res = call_first(st, module, inputs, kws, devs[0]);
        goto fail;
    }
    Py_ssize_t k = PyTuple_GET_SIZE(inputs);
    Py_ssize_t nrep = k < ndev ? k : ndev;
    replicas = replicate_core(st, module, devs, nrep);
    if (replicas == NULL) {
        goto fail;
    }
    outputs = parallel_apply_run(st, replicas, inputs, kws, NULL, devs, nrep);
    if (outputs == NULL) {
        goto fail;
    }
    res = dp_gather_outputs_ex(st, outputs, out_dev, o->dim, o->out_dims);
fail:
    Py_XDECREF(inputs);
    Py_XDECREF(kws);
    Py_XDECREF(replicas);
    Py_XDECREF(outputs);
    return res;
}

int dp_check_initialised(dp_DataParallelObject *self)
{
    if (self->devs == NULL) {
        PyErr_Format(PyExc_RuntimeError,
                     "%.100s: DataParallel.__init__() was not called (a subclass __init__ "
                     "must call super().__init__(module, ...))", Py_TYPE(self)->tp_name);
        return -1;
    }
    return 0;
}


/* Fill *s from self (initialised; GIL held). -1 with MemoryError. */
int dp_snapshot_take(dp_DataParallelObject *self, dp_snapshot *s)
{
    s->ndev = self->ndev;
    if (s->ndev <= DP_SNAP_INLINE) {
        s->devs = s->inline_devs;
    } else {
        s->devs = PyMem_Malloc((size_t)s->ndev * sizeof *s->devs);
        if (s->devs == NULL) {
            PyErr_NoMemory();
            return -1;
        }
    }
    if (s->ndev > 0) {   /* 0 before __init__ (gather works without it) */
        memcpy(s->devs, self->devs, (size_t)s->ndev * sizeof *s->devs);
    }
    s->module = Py_NewRef(self->module);
    s->output_device = self->output_device;
    s->dim = self->dim;
    s->strict = self->strict;
    s->in_dims = Py_NewRef(self->in_dims);
    s->out_dims = Py_NewRef(self->out_dims);
    s->chunk_sizes = Py_NewRef(self->chunk_sizes);
    s->weights = Py_NewRef(self->weights);
    return 0;
}

/* The call options a snapshot holds (borrowed from it). */
call_opts dp_snap_opts(const dp_snapshot *s)
{
    call_opts o = {s->dim, s->strict, s->in_dims, s->out_dims, s->chunk_sizes, s->weights};
    return o;
}

void dp_snapshot_release(dp_snapshot *s)
{
    Py_CLEAR(s->module);
    Py_CLEAR(s->in_dims);
    Py_CLEAR(s->out_dims);
    Py_CLEAR(s->chunk_sizes);
    Py_CLEAR(s->weights);
    if (s->devs != s->inline_devs) {
        PyMem_Free(s->devs);
    }
    s->devs = NULL;
}

/* One call's options, for the step methods too. On a subclass, forward
 * runs self.scatter, self.replicate, self.parallel_apply and self.gather
 * through attribute lookup (overridden or not); each of them, when called
 * on the thread of a running call of the same object (directly or through
 * super()), uses that call's snapshot instead of reading self again, so
 * another thread setting dp.dim = 1 mid-call cannot make the call scatter
 * on 0 and gather on 1. The running calls are a list on the object (the
 * GIL guards it), one entry per call in progress, each tagged with its
 * thread. __call__ on a subclass takes the snapshot before looking up
 * forward, so an overridden forward that calls the steps itself gets it as
 * well. A step method called outside any call reads self. */
void dp_call_push(dp_DataParallelObject *self, dp_snapshot *s, int claimed)
{
    s->thread = PyThread_get_thread_ident();
    s->claimed = claimed;
    s->next = self->active;
    self->active = s;
}

void dp_call_pop(dp_DataParallelObject *self, dp_snapshot *s)
{
    for (dp_snapshot **p = &self->active; *p != NULL; p = &(*p)->next) {
        if (*p == s) {
            *p = s->next;
            break;
        }
    }
    s->next = NULL;
}

/* The innermost call of self running on this thread, or NULL. */
static dp_snapshot *call_current(dp_DataParallelObject *self)
{
    unsigned long me = PyThread_get_thread_ident();
    for (dp_snapshot *s = self->active; s != NULL; s = s->next) {
        if (s->thread == me) {
            return s;
        }
    }
    return NULL;
}

/* The options for a step method: the running call's (*borrowed = 1; do not
 * release) or a fresh snapshot of self (*borrowed = 0). */
int dp_step_options(dp_DataParallelObject *self, dp_snapshot *buf, int *borrowed)
{
    dp_snapshot *cur = call_current(self);
    *borrowed = cur != NULL;
    if (cur != NULL) {
        *buf = *cur;     /* devs keeps pointing into *cur, alive for the call */
        buf->next = NULL;
        return 0;
    }
    return dp_snapshot_take(self, buf);
}

/* forward on a Python subclass: each step through attribute lookup. */
static PyObject *forward_generic(dp_DataParallelObject *self, dp_state *st,
                                 const dp_snapshot *snap, PyObject *args, PyObject *kwargs)
{
    PyObject *kw = NULL, *ids = NULL, *pair = NULL, *inputs = NULL, *kws = NULL;
    PyObject *used = NULL, *replicas = NULL, *outputs = NULL, *outdev = NULL, *res = NULL;

    kw = kwargs ? Py_NewRef(kwargs) : PyDict_New();
    ids = dp_device_list_new(st, snap->devs, snap->ndev);
    if (kw == NULL || ids == NULL) {
        goto fail;
    }
    pair = PyObject_CallMethod((PyObject *)self, "scatter", "OOO", args, kw, ids);
    if (pair == NULL) {
        goto fail;
    }
    if (!PyTuple_Check(pair) || PyTuple_GET_SIZE(pair) != 2) {
        PyErr_Format(PyExc_TypeError,
                     "DataParallel.forward: %.100s.scatter() must return (inputs, kwargs), "
                     "got %.100s", Py_TYPE(self)->tp_name, Py_TYPE(pair)->tp_name);
        goto fail;
    }
    for (int side = 0; side < 2; side++) {
        PyObject *v = PyTuple_GET_ITEM(pair, side);
        if (!PyTuple_Check(v) && !PyList_Check(v)) {
            PyErr_Format(PyExc_TypeError,
                         "DataParallel.forward: %.100s.scatter() must return (inputs, "
                         "kwargs), two tuples or lists with one entry per replica (a "
                         "tuple of arguments, a dict of keyword arguments), got %s=%.100s",
                         Py_TYPE(self)->tp_name, side ? "kwargs" : "inputs",
                         Py_TYPE(v)->tp_name);
            goto fail;
        }
    }
    inputs = PySequence_Tuple(PyTuple_GET_ITEM(pair, 0));
    kws = PySequence_Tuple(PyTuple_GET_ITEM(pair, 1));
    if (inputs == NULL || kws == NULL || fix_empty_call(&inputs, &kws) < 0) {
        goto fail;
    }
    if (snap->ndev == 1) {
        res = call_first(st, snap->module, inputs, kws, snap->devs[0]);
        goto fail;
    }
    used = PyList_GetSlice(ids, 0, PyTuple_GET_SIZE(inputs));
    if (used == NULL) {
        goto fail;
    }
    replicas = PyObject_CallMethod((PyObject *)self, "replicate", "OO", snap->module, used);
    if (replicas == NULL) {
        goto fail;
    }
    if (!PyList_Check(replicas) && !PyTuple_Check(replicas)) {
        PyErr_Format(PyExc_TypeError,
                     "DataParallel.forward: %.100s.replicate() must return a list (or "
                     "tuple) of replicas, one per device in device_ids[:%zd], got %.100s",
                     Py_TYPE(self)->tp_name, PyList_GET_SIZE(used), Py_TYPE(replicas)->tp_name);
        goto fail;
    }
    outputs = PyObject_CallMethod((PyObject *)self, "parallel_apply", "OOO", replicas, inputs, kws);
    if (outputs == NULL) {
        goto fail;
    }
    outdev = dp_device_to_object(st, snap->output_device);
    if (outdev == NULL) {
        goto fail;
    }
    res = PyObject_CallMethod((PyObject *)self, "gather", "OO", outputs, outdev);
fail:
    Py_XDECREF(kw);
    Py_XDECREF(ids);
    Py_XDECREF(pair);
    Py_XDECREF(inputs);
    Py_XDECREF(kws);
    Py_XDECREF(used);
    Py_XDECREF(replicas);
    Py_XDECREF(outputs);
    Py_XDECREF(outdev);
    return res;
}

PyObject *dp_forward_dispatch(dp_DataParallelObject *self, PyObject *args, PyObject *kwargs)
{
    dp_state *st = dp_state_from_type(Py_TYPE(self));
    if (st == NULL || dp_check_initialised(self) < 0) {
        return NULL;
    }
    dp_snapshot snap, *use = &snap;
    PyObject *res;
    if (Py_TYPE(self) == st->DataParallelType) {
        if (dp_snapshot_take(self, &snap) < 0) {
            return NULL;
        }
        if (kwargs != NULL && PyDict_GET_SIZE(kwargs) == 0) {
            kwargs = NULL;
        }
        call_opts o = dp_snap_opts(&snap);
        res = dp_forward_core(st, snap.module, args, kwargs, snap.devs, snap.ndev,
                           snap.output_device, &o);
        dp_snapshot_release(&snap);
        return res;
    }
    /* A subclass: the snapshot __call__ took for this call, or a new one
     * (forward called directly). */
    dp_snapshot *cur = call_current(self);
    if (cur != NULL && !cur->claimed) {
        cur->claimed = 1;
        use = cur;
    } else {
        if (dp_snapshot_take(self, &snap) < 0) {
            return NULL;
        }
        dp_call_push(self, &snap, 1);
    }
    res = forward_generic(self, st, use, args, kwargs);
    if (use == &snap) {
        dp_call_pop(self, &snap);
        dp_snapshot_release(&snap);
    }
    return res;
}

/* ------------------------------------------------------------------ */
/* Public functions: module level                                      */
/* ------------------------------------------------------------------ */

PyDoc_STRVAR(data_parallel_doc,
"data_parallel(module, inputs, device_ids=None, output_device=None, dim=0, module_kwargs=None,\n"
"              *, in_dims=None, out_dims=None, chunk_sizes=None, weights=None)\n"
"--\n\n"
"Functional DataParallel (PyTorch data_parallel, docs/spec.md 2.9): the same steps\n"
"as DataParallel.forward (scatter, empty-call fix, one-device fast path,\n"
"replicate, parallel_apply, gather). inputs: a tuple of positional arguments;\n"
"anything else is one argument (a list counts as ONE argument), None means\n"
"none. module_kwargs: None or a dict. device_ids/output_device/dim and\n"
"in_dims/out_dims/chunk_sizes/weights as for DataParallel (in_dims addresses\n"
"inputs by position and module_kwargs by name).\n"
"Errors: TypeError when module is not callable or module_kwargs is not a\n"
"dict; ValueError for bad device_ids/output_device (empty, the host in\n"
"device_ids, a missing CUDA device), 0-dim array inputs, bad in_dims/out_dims/\n"
"chunk_sizes/weights, or (as DataParallel) structure mismatches in the\n"
"outputs; IndexError for a dim out of range; TypeError/OverflowError for a dim\n"
"that is not an int; a failing replica's exception as 'Caught T in replica i\n"
"on device d.' (docs/spec.md 6.5). Different chunk counts warn dpmini.SplitWarning\n"
"(no strict here).");

static PyObject *dp_data_parallel_steps(PyObject *mod, PyObject *args, PyObject *kwargs)
{
    static char *kwlist[] = {"module", "inputs", "device_ids", "output_device", "dim",
                             "module_kwargs", "in_dims", "out_dims", "chunk_sizes",
                             "weights", NULL};
    PyObject *module, *inputs, *ids = Py_None, *out = Py_None, *dimobj = NULL;
    PyObject *mkw = Py_None, *in = NULL, *res = NULL;
    call_opts o = {0, 0, Py_None, Py_None, Py_None, Py_None};
    dp_device *devs = NULL, outdev;
    Py_ssize_t ndev = 0;
    int dim = 0;
    dp_state *st = dp_state_from_module(mod);

    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "OO|OOOO$OOOO:data_parallel", kwlist,
                                     &module, &inputs, &ids, &out, &dimobj, &mkw,
                                     &o.in_dims, &o.out_dims, &o.chunk_sizes, &o.weights)) {
        return NULL;
    }
    if (!PyCallable_Check(module)) {
        PyErr_Format(PyExc_TypeError, "data_parallel: module must be callable, got %.100s",
                     Py_TYPE(module)->tp_name);
        return NULL;
    }
    /* A torch.nn.Module with grad mode on: the differentiable steps (docs/spec.md 7). */
    int torch_mod = dp_is_torch_module(module);
    if (torch_mod < 0) {
        return NULL;
    }
    if (torch_mod && dp_torch_grad_enabled() == 1) {
        return dp_torch_call("data_parallel", args, kwargs);
    }
    if (mkw != Py_None && !PyDict_Check(mkw)) {
        PyErr_Format(PyExc_TypeError, "data_parallel: module_kwargs must be a dict or None, "
                     "got %.100s", Py_TYPE(mkw)->tp_name);
        return NULL;
    }
    if (dimobj != NULL && dp_int_from_object(dimobj, "dim", &dim) < 0) {
        return NULL;
    }
    if (dp_check_dims_spec(o.in_dims, "in_dims", 0) < 0 ||
        dp_check_dims_spec(o.out_dims, "out_dims", 1) < 0) {
        return NULL;
    }
    o.dim = dim;
    if (ids == Py_None) {
        if (dp_default_devices(st, &devs, &ndev) < 0) {
            return NULL;
        }
    } else if (dp_device_list_from_object(st, ids, "device_ids", &devs, &ndev) < 0) {
        return NULL;
    }
    if (out == Py_None) {
        outdev = devs[0];
    } else if (dp_parse_target_device(st, out, "output_device", &outdev) < 0) {
        goto fail;
    }
    if (inputs == Py_None) {
        in = PyTuple_New(0);
    } else if (PyTuple_Check(inputs)) {
        in = PySequence_Tuple(inputs);
    } else {
        in = PyTuple_Pack(1, inputs);
    }
    if (in == NULL) {
        goto fail;
    }
    res = dp_forward_core(st, module, in, (mkw == Py_None || PyDict_GET_SIZE(mkw) == 0) ? NULL : mkw,
                       devs, ndev, outdev, &o);
fail:
    Py_XDECREF(in);
    PyMem_Free(devs);
    return res;
}

/* dp_data_parallel under dpmini.profile(): one span around it (profile.h). */
static PyObject *dp_data_parallel(PyObject *mod, PyObject *args, PyObject *kwargs)
{
    dp_prof_span sp;
    dp_prof_begin(&sp, DP_PROF_CALL);
    PyObject *res = dp_data_parallel_steps(mod, args, kwargs);
    dp_prof_end(&sp, "data_parallel");
    return res;
}

PyMethodDef dp_dataparallel_methods[] = {
    {"data_parallel", (PyCFunction)(void (*)(void))dp_data_parallel,
     METH_VARARGS | METH_KEYWORDS, data_parallel_doc},
    {NULL, NULL, 0, NULL},
};
