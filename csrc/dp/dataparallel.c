/* dataparallel.c - the dpmini.DataParallel type and the functional
 * data_parallel (docs/spec.md 1, 2, 9; docs/design.md).
 *
 * DataParallel.forward runs, in order (docs/spec.md 2):
 *   scatter (scatter.c) -> no arguments: ((),) / ({},) -> one device: call the
 *   module on piece 0, no gather -> replicate onto device_ids[:k] ->
 *   parallel_apply on the device worker threads (pool.c) -> gather (gather.c).
 * On the exact type the four steps are C functions; on a Python subclass
 * they are looked up on self, so overriding any of them works.
 * replicate is in replicate.c, parallel_apply in parallel_apply.c.
 *
 * Sections: types (the object, one call's options and its snapshot of the
 * settings); one call (argument helpers, the snapshot, forward: the exact
 * type's C path and the generic path through overridden steps); the type
 * (construction, GC, __call__, the step methods); repr, attributes (each
 * setter accepts what the constructor accepts) and __reduce__ for copy,
 * deepcopy and pickle; the type's tables and docstring; data_parallel. A
 * torch module is wrapped by a subclass that is also a torch.nn.Module
 * (dpmini/_torch.py), chosen in tp_new.
 */
#include "dpmini.h"
#include "dataparallel.h"
#include "dp.h"
#include "gpu.h"
#include "walk.h"
#include "plan.h"
#include "profile.h"
#include "omp_team.h"
#include "pool.h"

#include <structmember.h>
#include <string.h>

/* ------------------------------------------------------------------ */
/* Types                                                               */
/* ------------------------------------------------------------------ */

typedef struct {
    PyObject_HEAD
    PyObject *module;          /* the wrapped callable; Py_None before __init__ */
    dp_device *devs;           /* device_ids, PyMem_Malloc'ed; NULL before __init__ */
    Py_ssize_t ndev;           /* len(device_ids); >= 1 once devs is set */
    dp_device output_device;   /* gather target; may be the host */
    int dim;                   /* scatter/gather dim as given (wrapped per array) */
    int strict;                /* 1: different chunk counts raise (scatter.c) */
    PyObject *in_dims;         /* owned; None: dim for every input (scatter.c,
                                  dp_split_opts); types checked on set */
    PyObject *out_dims;        /* owned; None: dim for every output */
    PyObject *chunk_sizes;     /* owned; None or a tuple of ints >= 0 */
    PyObject *weights;         /* owned; None or a tuple of numbers > 0;
                                  never both set; lengths are checked
                                  against device_ids on each call */
    struct dp_snapshot *active;  /* the calls running now, innermost first (see
                                    call_push); NULL when none */
    PyObject *dict;            /* instance __dict__ (tp_dictoffset); may be NULL */
    PyObject *weakreflist;     /* weak references (tp_weaklistoffset); may be NULL */
} dp_DataParallelObject;

/* The split and gather options of one call (all borrowed; Py_None when not
 * given). See dp_split_opts and dp_gather_outputs_ex in dpmini.h. */
typedef struct {
    int dim;
    int strict;
    PyObject *in_dims;
    PyObject *out_dims;
    PyObject *chunk_sizes;
    PyObject *weights;
} call_opts;

/* What one call uses of a DataParallel's settings. User code run during the
 * call (a dict subclass's items(), a replica, another thread while the GIL
 * is released) may reassign dp.module or dp.device_ids; the call keeps its
 * own reference and its own copy of the device list, so it neither reads
 * freed memory nor mixes old and new settings. */
#define DP_SNAP_INLINE 16
typedef struct dp_snapshot {
    struct dp_snapshot *next;  /* the call below it in self->active          */
    unsigned long thread;      /* PyThread_get_thread_ident() of its caller  */
    int claimed;               /* taken by forward (forward_dispatch)        */
    PyObject *module;          /* owned                                      */
    dp_device *devs;           /* inline_devs or PyMem_Malloc'ed; ndev items */
    Py_ssize_t ndev;
    dp_device output_device;
    int dim;
    int strict;
    PyObject *in_dims;         /* owned; the extension options (docs/spec.md 12-14) */
    PyObject *out_dims;        /* owned                                      */
    PyObject *chunk_sizes;     /* owned                                      */
    PyObject *weights;         /* owned                                      */
    dp_device inline_devs[DP_SNAP_INLINE];
} dp_snapshot;

/* ------------------------------------------------------------------ */
/* One call: arguments                                                 */
/* ------------------------------------------------------------------ */

/* A gather target: "cpu"/-1 (host; -1 warns FutureWarning, docs/spec.md 4.3) or a
 * device. */
static int parse_target_device(dp_state *st, PyObject *obj, const char *argname,
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
static PyObject *device_list_new(dp_state *st, const dp_device *devs, Py_ssize_t n)
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
/* One call: the snapshot and forward                                  */
/* ------------------------------------------------------------------ */


/* scatter_kwargs with the options o over devs[0..ndev). */
static int scatter_with(dp_state *st, PyObject *args, PyObject *kwargs, const dp_device *devs,
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
static int check_call_opts(PyObject *in_dims, PyObject *out_dims, PyObject *cs, PyObject *w,
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
static PyObject *forward_core(dp_state *st, PyObject *module, PyObject *args, PyObject *kwargs,
                              const dp_device *devs, Py_ssize_t ndev, dp_device out_dev,
                              const call_opts *o)
{
    PyObject *inputs = NULL, *kws = NULL, *replicas = NULL, *outputs = NULL, *res = NULL;

    dp_prof_ctx prof = dp_prof_current();
    for (Py_ssize_t i = 0; prof.s != NULL && i < ndev; i++) {   /* idle ones too */
        dp_prof_record_since(&prof, DP_PROF_DEVICE, devs[i].kind, devs[i].index, dp_prof_now(),
                             NULL);
    }
    if (scatter_with(st, args, kwargs, devs, ndev, o, &inputs, &kws) < 0) {
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

/* -1 with RuntimeError when __init__ was not called. */
static int check_initialised(dp_DataParallelObject *self)
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
static int snapshot_take(dp_DataParallelObject *self, dp_snapshot *s)
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
static call_opts snapshot_opts(const dp_snapshot *s)
{
    call_opts o = {s->dim, s->strict, s->in_dims, s->out_dims, s->chunk_sizes, s->weights};
    return o;
}

/* Drop what snapshot_take took. */
static void snapshot_release(dp_snapshot *s)
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
static void call_push(dp_DataParallelObject *self, dp_snapshot *s, int claimed)
{
    s->thread = PyThread_get_thread_ident();
    s->claimed = claimed;
    s->next = self->active;
    self->active = s;
}

static void call_pop(dp_DataParallelObject *self, dp_snapshot *s)
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
static int step_options(dp_DataParallelObject *self, dp_snapshot *buf, int *borrowed)
{
    dp_snapshot *cur = call_current(self);
    *borrowed = cur != NULL;
    if (cur != NULL) {
        *buf = *cur;     /* devs keeps pointing into *cur, alive for the call */
        buf->next = NULL;
        return 0;
    }
    return snapshot_take(self, buf);
}

/* forward on a Python subclass: each step through attribute lookup. */
static PyObject *forward_generic(dp_DataParallelObject *self, dp_state *st,
                                 const dp_snapshot *snap, PyObject *args, PyObject *kwargs)
{
    PyObject *kw = NULL, *ids = NULL, *pair = NULL, *inputs = NULL, *kws = NULL;
    PyObject *used = NULL, *replicas = NULL, *outputs = NULL, *outdev = NULL, *res = NULL;

    kw = kwargs ? Py_NewRef(kwargs) : PyDict_New();
    ids = device_list_new(st, snap->devs, snap->ndev);
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
    /* The replicas are done; the gather runs on this thread: a parked team
     * (forward_generic_call) wakes now, not when the gather has ended. */
    dp_omp_wake_parked();
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

/* forward_generic as the function dp_run_park_candidate runs. */
typedef struct {
    dp_DataParallelObject *self;
    dp_state *st;
    const dp_snapshot *snap;
    PyObject *args, *kwargs;
    PyObject *res;
} generic_call;

static void forward_generic_parked(void *arg)
{
    generic_call *c = arg;
    c->res = forward_generic(c->self, c->st, c->snap, c->args, c->kwargs);
}

/* The overridable steps, with the caller's OpenMP team parked for all of
 * them when the call is a park candidate (dp_park_candidate): the scatter and
 * broadcast copies run on the devices' worker threads as the replicas do,
 * and would share the cores with the team's spinning threads too. */
static PyObject *forward_generic_call(dp_DataParallelObject *self, dp_state *st,
                                      const dp_snapshot *snap, PyObject *args,
                                      PyObject *kwargs)
{
    Py_ssize_t nvcpu = 0;
    for (Py_ssize_t i = 0; i < snap->ndev; i++) {
        nvcpu += snap->devs[i].kind == DP_VCPU;
    }
    if (!dp_park_candidate(st, snap->module, nvcpu)) {
        return forward_generic(self, st, snap, args, kwargs);
    }
    generic_call c = {self, st, snap, args, kwargs, NULL};
    dp_run_park_candidate(st, forward_generic_parked, &c);
    return c.res;
}

/* A call on several devices hands their workers its steps' jobs one after
 * another (scatter copies, broadcast, replicas): the pool is told so for
 * the call (dp_pool_expect_work(-1) after it) and the devices' sleeping
 * workers start polling now. 1 when told, else 0. */
static int expect_steps(const dp_device *devs, Py_ssize_t ndev)
{
    if (ndev < 2) {
        return 0;
    }
    dp_pool_expect_work(1);
    for (Py_ssize_t i = 0; i < ndev; i++) {
        dp_pool_prewake(devs[i].kind, devs[i].index);
    }
    return 1;
}

/* forward: the C path on the exact type, the overridable steps on a subclass. */
static PyObject *forward_dispatch(dp_DataParallelObject *self, PyObject *args, PyObject *kwargs)
{
    dp_state *st = dp_state_from_type(Py_TYPE(self));
    if (st == NULL || check_initialised(self) < 0) {
        return NULL;
    }
    dp_snapshot snap, *use = &snap;
    PyObject *res;
    if (Py_TYPE(self) == st->DataParallelType) {
        if (snapshot_take(self, &snap) < 0) {
            return NULL;
        }
        if (kwargs != NULL && PyDict_GET_SIZE(kwargs) == 0) {
            kwargs = NULL;
        }
        call_opts o = snapshot_opts(&snap);
        int steps = expect_steps(snap.devs, snap.ndev);
        res = forward_core(st, snap.module, args, kwargs, snap.devs, snap.ndev,
                           snap.output_device, &o);
        dp_pool_expect_work(-steps);
        snapshot_release(&snap);
        return res;
    }
    /* A subclass: the snapshot __call__ took for this call, or a new one
     * (forward called directly). */
    dp_snapshot *cur = call_current(self);
    if (cur != NULL && !cur->claimed) {
        cur->claimed = 1;
        use = cur;
    } else {
        if (snapshot_take(self, &snap) < 0) {
            return NULL;
        }
        call_push(self, &snap, 1);
    }
    int steps = expect_steps(use->devs, use->ndev);
    res = forward_generic_call(self, st, use, args, kwargs);
    dp_pool_expect_work(-steps);
    if (use == &snap) {
        call_pop(self, &snap);
        snapshot_release(&snap);
    }
    return res;
}

/* ------------------------------------------------------------------ */
/* The DataParallel type                                               */
/* ------------------------------------------------------------------ */

static PyObject *DataParallel_new_fill(dp_DataParallelObject *self);

/* The module argument of a constructor call (borrowed; NULL when absent). */
static PyObject *module_argument(PyObject *args, PyObject *kwargs)
{
    if (args != NULL && PyTuple_GET_SIZE(args) > 0) {
        return PyTuple_GET_ITEM(args, 0);
    }
    return kwargs != NULL ? PyDict_GetItemString(kwargs, "module") : NULL;
}

/* A torch.nn.Module to wrap: the object is made of the torch adapter type for
 * type (dpmini._torch.adapter_type: a subclass of type that is also an
 * nn.Module, docs/spec.md 1.8), whose __init__ Python then runs. NULL with no error
 * for any other module (or a type that is already an adapter). */
static PyTypeObject *torch_adapter_for(PyTypeObject *type, PyObject *args, PyObject *kwargs)
{
    PyObject *module = module_argument(args, kwargs);
    int torch_mod = module != NULL ? dp_is_torch_module(module) : 0;
    if (torch_mod <= 0) {
        return NULL;
    }
    PyObject *targs = PyTuple_Pack(1, (PyObject *)type);
    PyObject *adapter = targs != NULL ? dp_torch_call("adapter_type", targs, NULL) : NULL;
    Py_XDECREF(targs);
    if (adapter != NULL && (!PyType_Check(adapter) ||
                            !PyType_IsSubtype((PyTypeObject *)adapter, type))) {
        PyErr_Format(PyExc_TypeError, "DataParallel: dpmini._torch.adapter_type(%.100s) "
                     "returned %R, not a subclass", type->tp_name, adapter);
        Py_CLEAR(adapter);
    }
    return (PyTypeObject *)adapter;
}

static PyObject *DataParallel_new(PyTypeObject *type, PyObject *args, PyObject *kwargs)
{
    /* Arguments are parsed by __init__, so subclasses may change the
     * constructor's signature. */
    PyTypeObject *adapter = torch_adapter_for(type, args, kwargs);
    if (adapter == NULL && PyErr_Occurred()) {
        return NULL;
    }
    if (adapter != NULL && adapter != type) {
        PyObject *obj = adapter->tp_alloc(adapter, 0);
        Py_DECREF(adapter);
        return obj != NULL ? DataParallel_new_fill((dp_DataParallelObject *)obj) : NULL;
    }
    Py_XDECREF(adapter);
    dp_DataParallelObject *self = (dp_DataParallelObject *)type->tp_alloc(type, 0);
    return self != NULL ? DataParallel_new_fill(self) : NULL;
}

/* The fields of a new object before __init__. */
static PyObject *DataParallel_new_fill(dp_DataParallelObject *self)
{
    self->module = Py_NewRef(Py_None);
    self->devs = NULL;
    self->ndev = 0;
    self->output_device.kind = DP_HOST;
    self->output_device.index = -1;
    self->dim = 0;
    self->strict = 0;
    self->in_dims = Py_NewRef(Py_None);
    self->out_dims = Py_NewRef(Py_None);
    self->chunk_sizes = Py_NewRef(Py_None);
    self->weights = Py_NewRef(Py_None);
    return (PyObject *)self;
}

/* A torch.nn.Module given to __init__ of an object that tp_new made without
 * one (a subclass whose own __init__ builds the module and passes it to
 * super().__init__): the object becomes its type's torch adapter
 * (dpmini._torch.adopt), as when the module is the constructor's argument.
 * Static types cannot change an object's class; they never get here with a
 * torch module (tp_new chose the adapter). */
static int adopt_torch_module(dp_DataParallelObject *self, PyObject *module)
{
    if (!(Py_TYPE(self)->tp_flags & Py_TPFLAGS_HEAPTYPE)) {
        return 0;
    }
    int torch_mod = dp_is_torch_module(module);
    if (torch_mod <= 0) {
        return torch_mod;
    }
    PyObject *targs = PyTuple_Pack(2, (PyObject *)self, module);
    PyObject *res = targs != NULL ? dp_torch_call("adopt", targs, NULL) : NULL;
    Py_XDECREF(targs);
    Py_XDECREF(res);
    return res != NULL ? 0 : -1;
}

static int DataParallel_init(dp_DataParallelObject *self, PyObject *args, PyObject *kwargs)
{
    static char *kwlist[] = {"module", "device_ids", "output_device", "dim", "strict",
                             "in_dims", "out_dims", "chunk_sizes", "weights", NULL};
    PyObject *module, *ids = Py_None, *out = Py_None, *dimobj = NULL;
    PyObject *in_dims = Py_None, *out_dims = Py_None, *cs = Py_None, *w = Py_None;
    PyObject *cs_t = NULL, *w_t = NULL;
    int strict = 0, dim = 0;
    dp_device *devs = NULL, outdev;
    Py_ssize_t ndev = 0;
    dp_state *st = dp_state_from_type(Py_TYPE(self));

    if (st == NULL ||
        !PyArg_ParseTupleAndKeywords(args, kwargs, "O|OOOpOOOO:DataParallel", kwlist,
                                     &module, &ids, &out, &dimobj, &strict, &in_dims,
                                     &out_dims, &cs, &w)) {
        return -1;
    }
    if (!PyCallable_Check(module)) {
        PyErr_Format(PyExc_TypeError, "DataParallel: module must be callable, got %.100s",
                     Py_TYPE(module)->tp_name);
        return -1;
    }
    if (adopt_torch_module(self, module) < 0) {
        return -1;
    }
    if (ids == Py_None) {
        if (dp_default_devices(st, &devs, &ndev) < 0) {
            return -1;
        }
    } else if (dp_device_list_from_object(st, ids, "device_ids", &devs, &ndev) < 0) {
        return -1;
    }
    if (out == Py_None) {
        outdev = devs[0];
    } else if (parse_target_device(st, out, "output_device", &outdev) < 0) {
        goto fail;
    }
    if (dimobj != NULL && dp_int_from_object(dimobj, "dim", &dim) < 0) {
        goto fail;
    }
    if (check_call_opts(in_dims, out_dims, cs, w, ndev, &cs_t, &w_t) < 0) {
        goto fail;
    }
    Py_SETREF(self->module, Py_NewRef(module));
    Py_SETREF(self->in_dims, Py_NewRef(in_dims));
    Py_SETREF(self->out_dims, Py_NewRef(out_dims));
    Py_SETREF(self->chunk_sizes, cs_t);
    Py_SETREF(self->weights, w_t);
    PyMem_Free(self->devs);
    self->devs = devs;
    self->ndev = ndev;
    self->output_device = outdev;
    self->dim = dim;
    self->strict = strict;
    return 0;
fail:
    PyMem_Free(devs);
    return -1;
}

static int DataParallel_traverse(dp_DataParallelObject *self, visitproc visit, void *arg)
{
    Py_VISIT(Py_TYPE(self));
    Py_VISIT(self->module);
    Py_VISIT(self->in_dims);
    Py_VISIT(self->out_dims);
    Py_VISIT(self->chunk_sizes);
    Py_VISIT(self->weights);
    Py_VISIT(self->dict);
    return 0;
}

static int DataParallel_clear(dp_DataParallelObject *self)
{
    /* module stays a valid object (None) for finalizers that still run. */
    if (self->module != NULL && self->module != Py_None) {
        Py_SETREF(self->module, Py_NewRef(Py_None));
    }
    /* The options hold only ints, None, str and containers of them, but a
     * user may put anything in a list; they too stay valid objects. */
    if (self->in_dims != NULL && self->in_dims != Py_None) {
        Py_SETREF(self->in_dims, Py_NewRef(Py_None));
    }
    if (self->out_dims != NULL && self->out_dims != Py_None) {
        Py_SETREF(self->out_dims, Py_NewRef(Py_None));
    }
    Py_CLEAR(self->dict);
    return 0;
}

static void DataParallel_dealloc(dp_DataParallelObject *self)
{
    PyTypeObject *tp = Py_TYPE(self);
    PyObject_GC_UnTrack(self);
    if (self->weakreflist != NULL) {
        PyObject_ClearWeakRefs((PyObject *)self);
    }
    DataParallel_clear(self);
    Py_CLEAR(self->module);
    Py_CLEAR(self->in_dims);
    Py_CLEAR(self->out_dims);
    Py_CLEAR(self->chunk_sizes);
    Py_CLEAR(self->weights);
    PyMem_Free(self->devs);
    self->devs = NULL;
    tp->tp_free((PyObject *)self);
    Py_DECREF(tp);
}

static PyObject *DataParallel_call_steps(dp_DataParallelObject *self, PyObject *args,
                                         PyObject *kwargs)
{
    dp_state *st = dp_state_from_type(Py_TYPE(self));
    if (st == NULL) {
        return NULL;
    }
    if (Py_TYPE(self) == st->DataParallelType) {
        return forward_dispatch(self, args, kwargs);
    }
    /* The call's options are read now, before any user code runs. */
    dp_snapshot snap;
    int inited = self->devs != NULL;   /* else forward raises, or is the user's */
    if (inited) {
        if (snapshot_take(self, &snap) < 0) {
            return NULL;
        }
        call_push(self, &snap, 0);
    }
    PyObject *res = NULL, *fwd = PyObject_GetAttrString((PyObject *)self, "forward");
    if (fwd != NULL) {
        res = PyObject_Call(fwd, args, kwargs);
        Py_DECREF(fwd);
    }
    if (inited) {
        call_pop(self, &snap);
        snapshot_release(&snap);
    }
    return res;
}

/* DataParallel_call under dpmini.profile(): one span around it (profile.h). */
static PyObject *DataParallel_call(dp_DataParallelObject *self, PyObject *args, PyObject *kwargs)
{
    dp_prof_span sp;
    dp_prof_begin(&sp, DP_PROF_CALL);
    PyObject *res = DataParallel_call_steps(self, args, kwargs);
    dp_prof_end(&sp, Py_TYPE(self)->tp_name);
    return res;
}

/* --- methods --- */

PyDoc_STRVAR(forward_doc,
"forward($self, *args, **kwargs)\n--\n\n"
"Run the module data-parallel over device_ids (PyTorch DataParallel.forward,\n"
"docs/spec.md 2), in order:\n"
"  inputs, kwargs = self.scatter(args, kwargs, self.device_ids)\n"
"  no arguments at all -> inputs, kwargs = ((),), ({},)\n"
"  one device -> return module(*inputs[0], **kwargs[0])  (no gather, docs/spec.md 2.5)\n"
"  replicas = self.replicate(self.module, self.device_ids[:len(inputs)])\n"
"  outputs = self.parallel_apply(replicas, inputs, kwargs)\n"
"  return self.gather(outputs, self.output_device)\n"
"Arrays (numpy.ndarray leaves of args/kwargs) are split along dim into\n"
"ceil(n/k)-row chunks; the replica count is the smallest chunk count over all\n"
"array leaves (dpmini's fix of PyTorch issue #31460). Subclasses may override\n"
"any of the four steps. Unlike PyTorch, the module's arrays may live anywhere:\n"
"they are broadcast from where they are (no device check, docs/spec.md 2.2).\n"
"Errors: those of the steps; a replica's exception is re-raised as\n"
"'Caught T in replica i on device d.' (docs/spec.md 6.5).");

static PyObject *DataParallel_forward(dp_DataParallelObject *self, PyObject *args, PyObject *kwargs)
{
    return forward_dispatch(self, args, kwargs);
}

PyDoc_STRVAR(scatter_doc,
"scatter($self, inputs, kwargs=None, device_ids=None)\n--\n\n"
"Returns (inputs_tuple, kwargs_tuple).\n"
"Split positional inputs (a tuple; a list is taken as a tuple) and kwargs (a\n"
"dict or None) over device_ids along self.dim (PyTorch scatter_kwargs, spec\n"
"2.3, 2.7, §3). Returns two tuples of equal length k (the replica count): k\n"
"tuples of positional arguments and k dicts. Both are empty when there are\n"
"no arguments. Chunk counts that differ warn dpmini.SplitWarning, or raise\n"
"ValueError when self.strict. device_ids None means self.device_ids.\n"
"Uses self.dim, self.in_dims, self.chunk_sizes and self.weights (see the\n"
"class), as the running call read them when called during a call.\n"
"Errors: TypeError for inputs/kwargs of the wrong type, ValueError for bad\n"
"devices or 0-dim arrays, IndexError for a dim out of range.");

static PyObject *DataParallel_scatter(dp_DataParallelObject *self, PyObject *args, PyObject *kwargs)
{
    static char *kwlist[] = {"inputs", "kwargs", "device_ids", NULL};
    PyObject *inputs, *kw = Py_None, *ids = Py_None, *in = NULL, *ins = NULL, *kws = NULL;
    PyObject *res = NULL;
    dp_device *devs = NULL;
    Py_ssize_t ndev = 0;
    dp_state *st = dp_state_from_type(Py_TYPE(self));

    dp_snapshot snap;
    int borrowed;

    if (st == NULL || check_initialised(self) < 0 ||
        !PyArg_ParseTupleAndKeywords(args, kwargs, "O|OO:scatter", kwlist, &inputs, &kw, &ids) ||
        step_options(self, &snap, &borrowed) < 0) {
        return NULL;
    }
    if (inputs == Py_None) {
        in = PyTuple_New(0);
    } else if (PyTuple_Check(inputs) || PyList_Check(inputs)) {
        in = dp_refuse_unsplittable_inputs(inputs) < 0 ? NULL : PySequence_Tuple(inputs);
    } else {
        PyErr_Format(PyExc_TypeError, "scatter: inputs must be a tuple of positional "
                     "arguments, got %.100s", Py_TYPE(inputs)->tp_name);
    }
    if (in == NULL) {
        goto fail;
    }
    if (kw != Py_None && !PyDict_Check(kw)) {
        PyErr_Format(PyExc_TypeError, "scatter: kwargs must be a dict or None, got %.100s",
                     Py_TYPE(kw)->tp_name);
        goto fail;
    }
    if (ids != Py_None &&
        dp_device_list_from_object(st, ids, "device_ids", &devs, &ndev) < 0) {
        goto fail;
    }
    call_opts o = snapshot_opts(&snap);
    if (scatter_with(st, in, kw == Py_None ? NULL : kw, devs ? devs : snap.devs,
                     devs ? ndev : snap.ndev, &o, &ins, &kws) < 0 ||
        (ins = dp_inputs_as_lists(inputs, ins)) == NULL) {
        goto fail;   /* a list of inputs gives lists, as PyTorch's scatter_kwargs */
    }
    res = PyTuple_Pack(2, ins, kws);
fail:
    if (!borrowed) {
        snapshot_release(&snap);
    }
    PyMem_Free(devs);
    Py_XDECREF(in);
    Py_XDECREF(ins);
    Py_XDECREF(kws);
    return res;
}

PyDoc_STRVAR(replicate_doc,
"replicate($self, module, device_ids)\n--\n\n"
"dpmini.replicate(module, device_ids): one replica of module per device, as\n"
"a list (shallow copies holding each device's copies of the module's arrays;\n"
"the module itself when it holds none). See dpmini.replicate.\n"
"Errors: ValueError for a bad device list (empty entries, the host, a CUDA\n"
"device that does not exist), TypeError for a device of the wrong type or\n"
"when an object holding arrays cannot be copied (copy.copy fails).");

static PyObject *DataParallel_replicate(dp_DataParallelObject *self, PyObject *args, PyObject *kwargs)
{
    static char *kwlist[] = {"module", "device_ids", NULL};
    PyObject *module, *devices;
    dp_state *st = dp_state_from_type(Py_TYPE(self));
    if (st == NULL ||
        !PyArg_ParseTupleAndKeywords(args, kwargs, "OO:replicate", kwlist, &module, &devices)) {
        return NULL;
    }
    return replicate_common(st, module, devices);
}

PyDoc_STRVAR(parallel_apply_doc,
"parallel_apply($self, replicas, inputs, kwargs=None)\n--\n\n"
"dpmini.parallel_apply(replicas, inputs, kwargs, self.device_ids[:len(replicas)]):\n"
"replica i runs as replicas[i](*inputs[i], **kwargs[i]) on device_ids[i]'s\n"
"worker thread; results in replica order. See dpmini.parallel_apply.\n"
"Errors: RuntimeError when DataParallel.__init__ was not called; ValueError\n"
"'parallel_apply: the number of modules (M) is not equal to the number of\n"
"inputs (N)' (likewise kwargs); TypeError for inputs/kwargs of the wrong\n"
"type; a failing replica's exception re-raised as 'Caught T in replica i on\n"
"device d.' with the original as __cause__ (docs/spec.md 6.5).");

static PyObject *DataParallel_parallel_apply(dp_DataParallelObject *self, PyObject *args,
                                             PyObject *kwargs)
{
    static char *kwlist[] = {"replicas", "inputs", "kwargs", NULL};
    PyObject *replicas, *inputs, *kw = Py_None;
    dp_state *st = dp_state_from_type(Py_TYPE(self));
    if (st == NULL || check_initialised(self) < 0 ||
        !PyArg_ParseTupleAndKeywords(args, kwargs, "OO|O:parallel_apply", kwlist,
                                     &replicas, &inputs, &kw)) {
        return NULL;
    }
    dp_snapshot snap;
    int borrowed;
    if (step_options(self, &snap, &borrowed) < 0) {
        return NULL;
    }
    PyObject *res = NULL;
    Py_ssize_t m = PyObject_Length(replicas);
    if (m >= 0) {
        res = parallel_apply_run(st, replicas, inputs, kw, NULL, snap.devs,
                                 m < snap.ndev ? m : snap.ndev);
    }
    if (!borrowed) {
        snapshot_release(&snap);
    }
    return res;
}

PyDoc_STRVAR(gather_doc,
"gather($self, outputs, output_device=None)\n--\n\n"
"Combine the per-replica outputs onto output_device along self.dim (PyTorch\n"
"gather, docs/spec.md 4, with dpmini's rules in docs/design.md). output_device:\n"
"'cpu' or -1 for the host (-1 warns FutureWarning), 'cpu:N', 'cuda:N', an int\n"
"or a Device; None means self.output_device. Follows self.dim and\n"
"self.out_dims (see the class), as the running call read them when called\n"
"during a call. Errors: TypeError/ValueError naming the output path for mismatched\n"
"structures or shapes, or the out_dims entry that does not fit.");

static PyObject *DataParallel_gather(dp_DataParallelObject *self, PyObject *args, PyObject *kwargs)
{
    static char *kwlist[] = {"outputs", "output_device", NULL};
    PyObject *outputs, *out = Py_None;
    dp_state *st = dp_state_from_type(Py_TYPE(self));
    dp_snapshot snap;
    int borrowed;
    if (st == NULL ||
        !PyArg_ParseTupleAndKeywords(args, kwargs, "O|O:gather", kwlist, &outputs, &out) ||
        step_options(self, &snap, &borrowed) < 0) {
        return NULL;
    }
    /* Options read before any user code runs (parse_target_device may warn). */
    dp_device d = snap.output_device;
    PyObject *res = NULL;
    if (out == Py_None || parse_target_device(st, out, "output_device", &d) == 0) {
        res = dp_gather_outputs_ex(st, outputs, d, snap.dim, snap.out_dims);
    }
    if (!borrowed) {
        snapshot_release(&snap);
    }
    return res;
}

/* DataParallel._rebuild(cls, args): the object that copy, deepcopy and
 * pickle make for a subclass (see __reduce__): cls's memory with
 * DataParallel's own __init__(*args), so a subclass whose __init__ takes
 * other arguments (or runs work of its own) is cloned without calling it,
 * as copy.copy does for plain Python objects. */
static PyObject *DataParallel_rebuild(PyObject *base, PyObject *args)
{
    PyObject *cls, *initargs;
    if (!PyArg_ParseTuple(args, "OO!:_rebuild", &cls, &PyTuple_Type, &initargs)) {
        return NULL;
    }
    if (!PyType_Check(cls) || !PyType_IsSubtype((PyTypeObject *)cls, (PyTypeObject *)base)) {
        PyErr_Format(PyExc_TypeError, "_rebuild: cls: expected a subclass of %s, got %R",
                     ((PyTypeObject *)base)->tp_name, cls);
        return NULL;
    }
    PyObject *obj = DataParallel_new((PyTypeObject *)cls, initargs, NULL);
    if (obj != NULL && DataParallel_init((dp_DataParallelObject *)obj, initargs, NULL) < 0) {
        Py_CLEAR(obj);
    }
    return obj;
}

/* ------------------------------------------------------------------ */
/* repr, attributes, pickling                                          */
/* ------------------------------------------------------------------ */

/* DataParallel(module=..., device_ids=[...], output_device=..., dim=...),
 * with strict and the extension options only when set. */
static PyObject *DataParallel_repr(dp_DataParallelObject *self)
{
    PyObject *parts = NULL, *sep = NULL, *ids = NULL, *res = NULL;
    const char *name = Py_TYPE(self)->tp_name;
    const char *dot = strrchr(name, '.');
    char buf[32];
    int rc = Py_ReprEnter((PyObject *)self);

    if (rc != 0) {
        return rc > 0 ? PyUnicode_FromFormat("%s(...)", dot ? dot + 1 : name) : NULL;
    }
    if (dot != NULL) {
        name = dot + 1;
    }
    if (self->devs == NULL) {
        res = PyUnicode_FromFormat("%s(<not initialised>)", name);
        goto done;
    }
    parts = PyList_New(self->ndev);
    sep = PyUnicode_FromString(", ");
    if (parts == NULL || sep == NULL) {
        goto done;
    }
    for (Py_ssize_t i = 0; i < self->ndev; i++) {
        dp_device_format(self->devs[i], buf, sizeof buf);
        PyObject *s = PyUnicode_FromFormat("'%s'", buf);
        if (s == NULL) {
            goto done;
        }
        PyList_SET_ITEM(parts, i, s);
    }
    ids = PyUnicode_Join(sep, parts);
    if (ids == NULL) {
        goto done;
    }
    dp_device_format(self->output_device, buf, sizeof buf);
    {
        /* The extension options, only when set. repr(module) and the
         * options' reprs run user code that may reassign dp.module. */
        PyObject *module = Py_NewRef(self->module);
        static const char *const names[] = {"in_dims", "out_dims", "chunk_sizes", "weights"};
        PyObject *vals[] = {Py_NewRef(self->in_dims), Py_NewRef(self->out_dims),
                            Py_NewRef(self->chunk_sizes), Py_NewRef(self->weights)};
        PyObject *extra = PyUnicode_FromString("");
        for (int i = 0; i < 4 && extra != NULL; i++) {
            if (vals[i] != Py_None) {
                Py_SETREF(extra, PyUnicode_FromFormat("%U, %s=%R", extra, names[i], vals[i]));
            }
        }
        if (extra != NULL) {
            res = PyUnicode_FromFormat("%s(module=%R, device_ids=[%U], output_device='%s', "
                                       "dim=%d%s%U)", name, module, ids, buf, self->dim,
                                       self->strict ? ", strict=True" : "", extra);
            Py_DECREF(extra);
        }
        for (int i = 0; i < 4; i++) {
            Py_DECREF(vals[i]);
        }
        Py_DECREF(module);
    }
done:
    Py_ReprLeave((PyObject *)self);
    Py_XDECREF(parts);
    Py_XDECREF(sep);
    Py_XDECREF(ids);
    return res;
}

/* --- attributes --- */

static int refuse_delete(PyObject *value, const char *name)
{
    if (value == NULL) {
        PyErr_Format(PyExc_AttributeError, "cannot delete DataParallel.%s", name);
        return -1;
    }
    return 0;
}

static PyObject *DataParallel_get_module(dp_DataParallelObject *self, void *c)
{
    return Py_NewRef(self->module);
}

static int DataParallel_set_module(dp_DataParallelObject *self, PyObject *value, void *c)
{
    if (refuse_delete(value, "module") < 0) {
        return -1;
    }
    if (!PyCallable_Check(value)) {
        PyErr_Format(PyExc_TypeError, "DataParallel.module: expected a callable, got %.100s",
                     Py_TYPE(value)->tp_name);
        return -1;
    }
    Py_SETREF(self->module, Py_NewRef(value));
    return 0;
}

static PyObject *DataParallel_get_device_ids(dp_DataParallelObject *self, void *c)
{
    dp_state *st = dp_state_from_type(Py_TYPE(self));
    if (st == NULL) {
        return NULL;
    }
    return device_list_new(st, self->devs, self->devs ? self->ndev : 0);
}

static int DataParallel_set_device_ids(dp_DataParallelObject *self, PyObject *value, void *c)
{
    dp_state *st = dp_state_from_type(Py_TYPE(self));
    dp_device *devs;
    Py_ssize_t n;
    if (st == NULL || refuse_delete(value, "device_ids") < 0) {
        return -1;
    }
    /* what the constructor accepts: None is the default devices */
    if (value == Py_None ? dp_default_devices(st, &devs, &n) < 0
                         : dp_device_list_from_object(st, value, "device_ids", &devs, &n) < 0) {
        return -1;
    }
    PyMem_Free(self->devs);
    self->devs = devs;
    self->ndev = n;
    return 0;
}

static PyObject *DataParallel_get_output_device(dp_DataParallelObject *self, void *c)
{
    dp_state *st = dp_state_from_type(Py_TYPE(self));
    if (st == NULL) {
        return NULL;
    }
    return dp_device_to_object(st, self->output_device);
}

static int DataParallel_set_output_device(dp_DataParallelObject *self, PyObject *value, void *c)
{
    dp_state *st = dp_state_from_type(Py_TYPE(self));
    dp_device d;
    if (st == NULL || refuse_delete(value, "output_device") < 0) {
        return -1;
    }
    if (value == Py_None) {
        /* as in the constructor: device_ids[0], as it is now */
        if (check_initialised(self) < 0) {
            return -1;
        }
        d = self->devs[0];
    } else if (parse_target_device(st, value, "output_device", &d) < 0) {
        return -1;
    }
    self->output_device = d;
    return 0;
}

static PyObject *DataParallel_get_dim(dp_DataParallelObject *self, void *c)
{
    return PyLong_FromLong(self->dim);
}

static int DataParallel_set_dim(dp_DataParallelObject *self, PyObject *value, void *c)
{
    int dim;
    if (refuse_delete(value, "dim") < 0 || dp_int_from_object(value, "dim", &dim) < 0) {
        return -1;
    }
    self->dim = dim;
    return 0;
}

static PyObject *DataParallel_get_strict(dp_DataParallelObject *self, void *c)
{
    return PyBool_FromLong(self->strict);
}

static int DataParallel_set_strict(dp_DataParallelObject *self, PyObject *value, void *c)
{
    if (refuse_delete(value, "strict") < 0) {
        return -1;
    }
    int v = PyObject_IsTrue(value);
    if (v < 0) {
        return -1;
    }
    self->strict = v;
    return 0;
}

static PyObject *DataParallel_get_in_dims(dp_DataParallelObject *self, void *c)
{
    return Py_NewRef(self->in_dims);
}

static int DataParallel_set_in_dims(dp_DataParallelObject *self, PyObject *value, void *c)
{
    if (refuse_delete(value, "in_dims") < 0 || dp_check_dims_spec(value, "in_dims", 0) < 0) {
        return -1;
    }
    Py_SETREF(self->in_dims, Py_NewRef(value));
    return 0;
}

static PyObject *DataParallel_get_out_dims(dp_DataParallelObject *self, void *c)
{
    return Py_NewRef(self->out_dims);
}

static int DataParallel_set_out_dims(dp_DataParallelObject *self, PyObject *value, void *c)
{
    if (refuse_delete(value, "out_dims") < 0 || dp_check_dims_spec(value, "out_dims", 1) < 0) {
        return -1;
    }
    Py_SETREF(self->out_dims, Py_NewRef(value));
    return 0;
}

/* chunk_sizes / weights: the new value checked against device_ids, and
 * refused while the other one is set (at most one). The other one is not
 * checked again: after device_ids changed it may no longer fit, which the
 * next call reports, and setting either to None must still work. */
static int set_sizes_opt(dp_DataParallelObject *self, PyObject *value, int is_weights)
{
    PyObject *cs_t, *w_t;
    if (refuse_delete(value, is_weights ? "weights" : "chunk_sizes") < 0 ||
        check_initialised(self) < 0) {
        return -1;
    }
    /* With both given, check_call_opts refuses them together. */
    PyObject *other = value != Py_None ? (is_weights ? self->chunk_sizes : self->weights)
                                       : Py_None;
    if (check_call_opts(Py_None, Py_None, is_weights ? other : value, is_weights ? value : other,
                        self->ndev, &cs_t, &w_t) < 0) {
        return -1;
    }
    if (is_weights) {
        Py_SETREF(self->weights, w_t);
        Py_DECREF(cs_t);
    } else {
        Py_SETREF(self->chunk_sizes, cs_t);
        Py_DECREF(w_t);
    }
    return 0;
}

static PyObject *DataParallel_get_chunk_sizes(dp_DataParallelObject *self, void *c)
{
    return Py_NewRef(self->chunk_sizes);
}

static int DataParallel_set_chunk_sizes(dp_DataParallelObject *self, PyObject *value, void *c)
{
    return set_sizes_opt(self, value, 0);
}

static PyObject *DataParallel_get_weights(dp_DataParallelObject *self, void *c)
{
    return Py_NewRef(self->weights);
}

static int DataParallel_set_weights(dp_DataParallelObject *self, PyObject *value, void *c)
{
    return set_sizes_opt(self, value, 1);
}

PyDoc_STRVAR(DataParallel_reduce_doc,
"__reduce__($self)\n--\n\n"
"Support for copy.copy, copy.deepcopy and pickle: rebuilds\n"
"type(self)(module, device_ids as strings, output_device as a string, dim,\n"
"strict), then restores the instance __dict__ and sets in_dims, out_dims,\n"
"chunk_sizes and weights (those that are not None) through their attribute\n"
"setters, so the clone splits and gathers as self does. The state is\n"
"(__dict__ or None, {option: value}), pickle's (state, slotstate) form.\n"
"For a subclass the object is made by DataParallel._rebuild(type(self),\n"
"args): the subclass's memory set up by DataParallel.__init__, without\n"
"calling the subclass's __init__ (whatever arguments it takes), as copy.copy\n"
"does for Python objects; its __dict__ is then restored. The\n"
"module must itself be picklable for pickle. Errors: RuntimeError when\n"
"__init__ was not called.");

/* __reduce__'s constructor arguments: (module, device_ids as strings,
 * output_device as a string, dim, strict). New tuple, or NULL. */
static PyObject *reduce_args(dp_DataParallelObject *self)
{
    char buf[32];
    PyObject *out = NULL, *args = NULL;
    PyObject *ids = PyList_New(self->ndev);
    for (Py_ssize_t i = 0; ids != NULL && i < self->ndev; i++) {
        dp_device_format(self->devs[i], buf, sizeof buf);
        PyObject *s = PyUnicode_FromString(buf);
        if (s == NULL) {
            Py_CLEAR(ids);
            break;
        }
        PyList_SET_ITEM(ids, i, s);
    }
    if (ids != NULL) {
        dp_device_format(self->output_device, buf, sizeof buf);
        out = PyUnicode_FromString(buf);
    }
    if (out != NULL) {
        args = Py_BuildValue("(OOOiO)", self->module, ids, out, self->dim,
                             self->strict ? Py_True : Py_False);
    }
    Py_XDECREF(ids);
    Py_XDECREF(out);
    return args;
}

/* __reduce__'s state: the instance __dict__'s copy (None when empty) and,
 * when any is set, the extension options in pickle's slotstate: copy and
 * pickle setattr() each entry, through the validating setters, and a
 * subclass __init__ taking only the five PyTorch arguments still rebuilds.
 * New reference, or NULL. */
static PyObject *reduce_state(dp_DataParallelObject *self)
{
    static const char *const names[] = {"in_dims", "out_dims", "chunk_sizes", "weights"};
    PyObject *vals[] = {self->in_dims, self->out_dims, self->chunk_sizes, self->weights};
    PyObject *state = (self->dict != NULL && PyDict_GET_SIZE(self->dict) > 0)
                      ? PyDict_Copy(self->dict) : Py_NewRef(Py_None);
    PyObject *opts = state != NULL ? PyDict_New() : NULL;
    if (opts == NULL) {
        Py_XDECREF(state);
        return NULL;
    }
    for (int i = 0; i < 4; i++) {
        if (vals[i] != Py_None && PyDict_SetItemString(opts, names[i], vals[i]) < 0) {
            Py_CLEAR(state);
            break;
        }
    }
    if (state != NULL && PyDict_GET_SIZE(opts) > 0) {
        Py_SETREF(state, PyTuple_Pack(2, state, opts));
    }
    Py_DECREF(opts);
    return state;
}

static PyObject *DataParallel_reduce(dp_DataParallelObject *self, PyObject *unused)
{
    PyObject *args = NULL, *state = NULL, *res = NULL;
    if (check_initialised(self) < 0) {
        return NULL;
    }
    args = reduce_args(self);
    state = args != NULL ? reduce_state(self) : NULL;
    dp_state *st = state != NULL ? dp_state_from_type(Py_TYPE(self)) : NULL;
    if (st == NULL) {
        goto done;
    }
    if (Py_TYPE(self) == st->DataParallelType) {
        res = PyTuple_Pack(3, (PyObject *)Py_TYPE(self), args, state);
    } else {
        /* A subclass: its __init__ may take other arguments, so the clone
         * is made by DataParallel._rebuild without calling it. */
        PyObject *rebuild = PyObject_GetAttrString((PyObject *)st->DataParallelType, "_rebuild");
        PyObject *rargs = rebuild != NULL ? PyTuple_Pack(2, (PyObject *)Py_TYPE(self), args) : NULL;
        if (rargs != NULL) {
            res = PyTuple_Pack(3, rebuild, rargs, state);
        }
        Py_XDECREF(rebuild);
        Py_XDECREF(rargs);
    }
done:
    Py_XDECREF(args);
    Py_XDECREF(state);
    return res;
}

static PyGetSetDef DataParallel_getset[] = {
    {"module", (getter)DataParallel_get_module, (setter)DataParallel_set_module,
     "The wrapped callable (any callable object).", NULL},
    {"device_ids", (getter)DataParallel_get_device_ids, (setter)DataParallel_set_device_ids,
     "The devices, as a new list of dpmini.Device on each read; set with any\n"
     "non-empty sequence of non-host devices, or None for the default devices\n"
     "(as in the constructor).", NULL},
    {"output_device", (getter)DataParallel_get_output_device,
     (setter)DataParallel_set_output_device,
     "Where forward gathers the outputs (a dpmini.Device; may be the host).\n"
     "Setting None means device_ids[0] as it is then (as in the constructor).", NULL},
    {"dim", (getter)DataParallel_get_dim, (setter)DataParallel_set_dim,
     "The scatter/gather dimension (an int; negative dims wrap per array).", NULL},
    {"strict", (getter)DataParallel_get_strict, (setter)DataParallel_set_strict,
     "True: raise ValueError instead of warning dpmini.SplitWarning, on the\n"
     "same condition (a split array would lose rows).", NULL},
    {"in_dims", (getter)DataParallel_get_in_dims, (setter)DataParallel_set_in_dims,
     "How each input is split (None: dim everywhere). A structure mirroring\n"
     "the arguments: see DataParallel's docstring.", NULL},
    {"out_dims", (getter)DataParallel_get_out_dims, (setter)DataParallel_set_out_dims,
     "How each output is gathered (None: dim everywhere): an int dim, None\n"
     "(replicas must agree), \"sum\", or a structure of them.", NULL},
    {"chunk_sizes", (getter)DataParallel_get_chunk_sizes,
     (setter)DataParallel_set_chunk_sizes,
     "None, or a tuple of per-device sizes along the split dim.", NULL},
    {"weights", (getter)DataParallel_get_weights, (setter)DataParallel_set_weights,
     "None, or a tuple of per-device weights (sizes proportional to them).", NULL},
    {"__dict__", PyObject_GenericGetDict, PyObject_GenericSetDict, NULL, NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

/* ------------------------------------------------------------------ */
/* The type's tables                                                   */
/* ------------------------------------------------------------------ */

static PyMethodDef DataParallel_methods[] = {
    {"forward", (PyCFunction)(void (*)(void))DataParallel_forward,
     METH_VARARGS | METH_KEYWORDS, forward_doc},
    {"scatter", (PyCFunction)(void (*)(void))DataParallel_scatter,
     METH_VARARGS | METH_KEYWORDS, scatter_doc},
    {"replicate", (PyCFunction)(void (*)(void))DataParallel_replicate,
     METH_VARARGS | METH_KEYWORDS, replicate_doc},
    {"parallel_apply", (PyCFunction)(void (*)(void))DataParallel_parallel_apply,
     METH_VARARGS | METH_KEYWORDS, parallel_apply_doc},
    {"gather", (PyCFunction)(void (*)(void))DataParallel_gather,
     METH_VARARGS | METH_KEYWORDS, gather_doc},
    {"__reduce__", (PyCFunction)DataParallel_reduce, METH_NOARGS, DataParallel_reduce_doc},
    {"_rebuild", (PyCFunction)DataParallel_rebuild, METH_VARARGS | METH_CLASS,
     "_rebuild(cls, args)\n--\n\nFor __reduce__: a cls object set up by DataParallel.__init__(*args),\n"
     "without calling cls.__init__. Errors: TypeError when cls is not a subclass."},
    {NULL, NULL, 0, NULL},
};

static PyMemberDef DataParallel_members[] = {
    {"__dictoffset__", T_PYSSIZET, offsetof(dp_DataParallelObject, dict), READONLY, NULL},
    {"__weaklistoffset__", T_PYSSIZET, offsetof(dp_DataParallelObject, weakreflist),
     READONLY, NULL},
    {NULL, 0, 0, 0, NULL},
};

PyDoc_STRVAR(DataParallel_doc,
"DataParallel(module, device_ids=None, output_device=None, dim=0, strict=False,\n"
"             in_dims=None, out_dims=None, chunk_sizes=None, weights=None)\n--\n\n"
"Run module data-parallel over devices, as torch.nn.DataParallel does for\n"
"tensors (docs/spec.md 1-2), with NumPy arrays as the tensors.\n"
"module: any callable (TypeError otherwise); a torch.nn.Module gives an\n"
"object of a subclass that is also a torch.nn.Module whose child is module\n"
"(dpmini._torch.DataParallel; docs/spec.md 1.8), which records autograd with grad\n"
"mode on (docs/spec.md 7). device_ids: a non-empty\n"
"sequence of devices ('cpu:N', 'cuda:N', int N, dpmini.Device; the host is\n"
"refused); None means every CUDA device, else cpu:0..cpu_device_count()-1.\n"
"output_device: where outputs are gathered; None means device_ids[0]; 'cpu'\n"
"or -1 is the host (-1 warns FutureWarning). dim: the int dimension to split\n"
"and gather along. strict: raise ValueError instead of warning\n"
"dpmini.SplitWarning; both happen exactly when a split array would lose\n"
"rows (it has rows after the first k chunks, k the smallest chunk count;\n"
"a 0-row array loses none), see dpmini.scatter.\n"
"\n"
"Shapes and dtypes. Inputs: any structure (tuples, lists, dicts,\n"
"namedtuples) of arrays (numpy.ndarray of any rank >= 1 and any dtype\n"
"except object; dpmini.Array and CUDA Array Interface / DLPack objects on\n"
"GPUs) and other objects. Each array of n rows along dim is split into\n"
"chunks of ceil(n/k) rows by default (k = len(device_ids); the last chunk\n"
"smaller, fewer chunks when n is small; see chunk_sizes and weights); a\n"
"chunk keeps the array's other dims and its dtype. 0-dim arrays are\n"
"refused (ValueError), object arrays are TypeError; other objects go to\n"
"every replica unchanged. Outputs: replica outputs of one structure;\n"
"arrays at one position are concatenated along dim on output_device (the\n"
"replicas' shapes with their dim sizes added; replica 0's dtype, other\n"
"dtypes cast only within a kind: real with complex, float into int raise\n"
"TypeError); 0-dim outputs become a vector of one value per replica; None,\n"
"str and numbers are returned once when every replica's is equal. Mappings\n"
"and dataclasses keep their type (see dpmini.gather). Structures deeper\n"
"than 512 levels raise RecursionError naming the path.\n"
"\n"
"Calling the object runs forward(*args, **kwargs). Subclasses may override\n"
"forward, scatter, replicate, parallel_apply and gather, and may add\n"
"attributes; scatter must return (inputs, kwargs), two tuples or lists, and\n"
"replicate a list or tuple (TypeError naming the method otherwise). Each\n"
"call reads module, device_ids, output_device, dim, strict, in_dims,\n"
"out_dims, chunk_sizes and weights once, when it starts: the step methods\n"
"called during it on its thread (directly, through super(), or from an\n"
"overridden forward) use those values, so a change made meanwhile (from\n"
"another thread or a replica) applies from the next call. The module's\n"
"arrays are not required to be on device_ids[0] (documented difference\n"
"from PyTorch's device check, docs/spec.md 2.2).\n"
"\n"
"Beyond PyTorch (all None by default, which is exactly PyTorch's behaviour):\n"
"in_dims: how each input is split, modelled on JAX pmap's in_axes. A\n"
"  structure mirroring the arguments: a tuple/list is a prefix of the\n"
"  positional arguments; a dict addresses positional arguments by int key\n"
"  and keyword arguments by name ({0: 1, 'table': None}); an int is a dim\n"
"  for every argument. Inside, an int splits along that dim, None\n"
"  broadcasts the whole array (any rank) to every replica (a copy on each\n"
"  device, the array itself on its own device; never changes the replica\n"
"  count), and tuples/lists/dicts mirror containers (a prefix / a subset of\n"
"  keys; the rest uses dim). An int or None for a container applies to\n"
"  every array under it. Entries that address nothing: ValueError naming\n"
"  the entry (\"in_dims[1]['x']\"); wrong types: TypeError.\n"
"out_dims: how each output is gathered, modelled on pmap's out_axes: an int\n"
"  gathers along that dim; None returns replica 0's value after checking\n"
"  that every replica returned an equal one (numpy.array_equal for arrays,\n"
"  NaN equal to NaN, NaT to NaT; GPU arrays compared through host copies; TypeError\n"
"  naming the path otherwise); \"sum\" adds the replicas' values\n"
"  (arrays with comm.reduce_add onto output_device, numbers with +): the\n"
"  sum of per-replica gradients, counts or summed losses. Structures mirror\n"
"  the output as for in_dims (a dict also names dataclass fields). A\n"
"  top-level None is the default (dim everywhere): to check that a bare\n"
"  array output is the same on every replica, return it in a tuple and\n"
"  give out_dims=(None,).\n"
"chunk_sizes: one int >= 0 per device in device_ids: the rows along the\n"
"  split dim each device gets, for every split array (each must have\n"
"  sum(chunk_sizes) rows, else ValueError naming it). From\n"
"  torch.cuda.comm.scatter's chunk_sizes (PyTorch's DataParallel lacks it,\n"
"  pytorch issue 46381). A 0 gives an empty chunk; devices after the last\n"
"  non-empty chunk idle.\n"
"weights: one finite number > 0 per device: sizes proportional to them,\n"
"  rounded by largest remainder so they sum to n; no device gets an empty\n"
"  chunk unless n < len(device_ids) (then the rows go to the largest\n"
"  shares). For devices of unequal speed. At most one of chunk_sizes and\n"
"  weights (ValueError); wrong length, negative sizes, zero, negative, NaN\n"
"  or infinite weights: ValueError; wrong types: TypeError.\n"
"\n"
"Ints (dim, in_dims / out_dims entries, chunk_sizes, device indices) may be\n"
"any integer with __index__ (NumPy integer scalars, 0-dim integer arrays);\n"
"bool, floats and arrays with dimensions are TypeError, values out of range\n"
"ValueError, each naming the argument. Every option is also an attribute;\n"
"assigning it accepts what the constructor accepts (device_ids = None: the\n"
"default devices; output_device = None: device_ids[0] as it is then).");

static PyType_Slot DataParallel_slots[] = {
    {Py_tp_doc, (void *)DataParallel_doc},
    {Py_tp_new, DataParallel_new},
    {Py_tp_init, DataParallel_init},
    {Py_tp_dealloc, DataParallel_dealloc},
    {Py_tp_traverse, DataParallel_traverse},
    {Py_tp_clear, DataParallel_clear},
    {Py_tp_call, DataParallel_call},
    {Py_tp_repr, DataParallel_repr},
    {Py_tp_methods, DataParallel_methods},
    {Py_tp_getset, DataParallel_getset},
    {Py_tp_members, DataParallel_members},
    {0, NULL},
};

PyType_Spec dp_dataparallel_spec = {
    .name = "dpmini.DataParallel",
    .basicsize = sizeof(dp_DataParallelObject),
    .itemsize = 0,
    .flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_BASETYPE | Py_TPFLAGS_HAVE_GC,
    .slots = DataParallel_slots,
};

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

static PyObject *data_parallel_steps(PyObject *mod, PyObject *args, PyObject *kwargs)
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
    if (dp_refuse_unsplittable_inputs(inputs) < 0) {   /* before any path unpacks it */
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
    } else if (parse_target_device(st, out, "output_device", &outdev) < 0) {
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
    res = forward_core(st, module, in, (mkw == Py_None || PyDict_GET_SIZE(mkw) == 0) ? NULL : mkw,
                       devs, ndev, outdev, &o);
fail:
    Py_XDECREF(in);
    PyMem_Free(devs);
    return res;
}

/* data_parallel_steps under dpmini.profile(): one span around it (profile.h). */
static PyObject *py_data_parallel(PyObject *mod, PyObject *args, PyObject *kwargs)
{
    dp_prof_span sp;
    dp_prof_begin(&sp, DP_PROF_CALL);
    PyObject *res = data_parallel_steps(mod, args, kwargs);
    dp_prof_end(&sp, "data_parallel");
    return res;
}

PyMethodDef dp_dataparallel_methods[] = {
    {"data_parallel", (PyCFunction)(void (*)(void))py_data_parallel,
     METH_VARARGS | METH_KEYWORDS, data_parallel_doc},
    {NULL, NULL, 0, NULL},
};
