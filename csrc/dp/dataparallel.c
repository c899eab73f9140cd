/* dataparallel.c - the dpmini.DataParallel type (the functional data_parallel is in
 * dataparallel_call.c)
 * (docs/spec.md 1, 2, 9; docs/design.md).
 *
 * DataParallel.forward runs, in order (docs/spec.md 2):
 *   scatter (scatter.c) -> no arguments: ((),) / ({},) -> one device: call the
 *   module on piece 0, no gather -> replicate onto device_ids[:k] ->
 *   parallel_apply on the device worker threads (pool.c) -> gather (gather.c).
 * On the exact type the four steps are C functions; on a Python subclass
 * they are looked up on self, so overriding any of them works.
 * replicate is in replicate.c, parallel_apply in parallel_apply.c.
 *
 * This file: the DataParallel type (construction, GC, the step methods, the
 * docstring). One call (the settings snapshot, forward) and module-level
 * data_parallel are in dataparallel_call.c; repr, attributes and pickling in
 * dataparallel_attrs.c; the object layout in dataparallel_type.h. A torch
 * module is wrapped by a subclass that is also a torch.nn.Module
 * (dpmini/_torch.py), chosen here in tp_new.
 */
#include "dpmini.h"
#include "dataparallel.h"
#include "dataparallel_type.h"
#include "dp.h"
#include "walk.h"
#include "profile.h"

#include <structmember.h>
#include <string.h>

/* ------------------------------------------------------------------ */
/* Public functions: the DataParallel type                             */
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
    } else if (dp_parse_target_device(st, out, "output_device", &outdev) < 0) {
        goto fail;
    }
    if (dimobj != NULL && dp_int_from_object(dimobj, "dim", &dim) < 0) {
        goto fail;
    }
    if (dp_check_call_opts(in_dims, out_dims, cs, w, ndev, &cs_t, &w_t) < 0) {
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
        return dp_forward_dispatch(self, args, kwargs);
    }
    /* The call's options are read now, before any user code runs. */
    dp_snapshot snap;
    int inited = self->devs != NULL;   /* else forward raises, or is the user's */
    if (inited) {
        if (dp_snapshot_take(self, &snap) < 0) {
            return NULL;
        }
        dp_call_push(self, &snap, 0);
    }
    PyObject *res = NULL, *fwd = PyObject_GetAttrString((PyObject *)self, "forward");
    if (fwd != NULL) {
        res = PyObject_Call(fwd, args, kwargs);
        Py_DECREF(fwd);
    }
    if (inited) {
        dp_call_pop(self, &snap);
        dp_snapshot_release(&snap);
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
    return dp_forward_dispatch(self, args, kwargs);
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

    if (st == NULL || dp_check_initialised(self) < 0 ||
        !PyArg_ParseTupleAndKeywords(args, kwargs, "O|OO:scatter", kwlist, &inputs, &kw, &ids) ||
        dp_step_options(self, &snap, &borrowed) < 0) {
        return NULL;
    }
    if (inputs == Py_None) {
        in = PyTuple_New(0);
    } else if (PyTuple_Check(inputs) || PyList_Check(inputs)) {
        in = PySequence_Tuple(inputs);
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
    call_opts o = dp_snap_opts(&snap);
    if (dp_scatter_with(st, in, kw == Py_None ? NULL : kw, devs ? devs : snap.devs,
                     devs ? ndev : snap.ndev, &o, &ins, &kws) < 0 ||
        (ins = dp_inputs_as_lists(inputs, ins)) == NULL) {
        goto fail;   /* a list of inputs gives lists, as PyTorch's scatter_kwargs */
    }
    res = PyTuple_Pack(2, ins, kws);
fail:
    if (!borrowed) {
        dp_snapshot_release(&snap);
    }
    PyMem_Free(devs);
    Py_XDECREF(in);
    Py_XDECREF(ins);
    Py_XDECREF(kws);
    return res;
}

PyDoc_STRVAR(dp_replicate_doc,
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

PyDoc_STRVAR(dp_parallel_apply_doc,
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
    if (st == NULL || dp_check_initialised(self) < 0 ||
        !PyArg_ParseTupleAndKeywords(args, kwargs, "OO|O:parallel_apply", kwlist,
                                     &replicas, &inputs, &kw)) {
        return NULL;
    }
    dp_snapshot snap;
    int borrowed;
    if (dp_step_options(self, &snap, &borrowed) < 0) {
        return NULL;
    }
    PyObject *res = NULL;
    Py_ssize_t m = PyObject_Length(replicas);
    if (m >= 0) {
        res = parallel_apply_run(st, replicas, inputs, kw, NULL, snap.devs,
                                 m < snap.ndev ? m : snap.ndev);
    }
    if (!borrowed) {
        dp_snapshot_release(&snap);
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
        dp_step_options(self, &snap, &borrowed) < 0) {
        return NULL;
    }
    /* Options read before any user code runs (parse_target_device may warn). */
    dp_device d = snap.output_device;
    PyObject *res = NULL;
    if (out == Py_None || dp_parse_target_device(st, out, "output_device", &d) == 0) {
        res = dp_gather_outputs_ex(st, outputs, d, snap.dim, snap.out_dims);
    }
    if (!borrowed) {
        dp_snapshot_release(&snap);
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

static PyMethodDef DataParallel_methods[] = {
    {"forward", (PyCFunction)(void (*)(void))DataParallel_forward,
     METH_VARARGS | METH_KEYWORDS, forward_doc},
    {"scatter", (PyCFunction)(void (*)(void))DataParallel_scatter,
     METH_VARARGS | METH_KEYWORDS, scatter_doc},
    {"replicate", (PyCFunction)(void (*)(void))DataParallel_replicate,
     METH_VARARGS | METH_KEYWORDS, dp_replicate_doc},
    {"parallel_apply", (PyCFunction)(void (*)(void))DataParallel_parallel_apply,
     METH_VARARGS | METH_KEYWORDS, dp_parallel_apply_doc},
    {"gather", (PyCFunction)(void (*)(void))DataParallel_gather,
     METH_VARARGS | METH_KEYWORDS, gather_doc},
    {"__reduce__", (PyCFunction)dp_DataParallel_reduce, METH_NOARGS, dp_DataParallel_reduce_doc},
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
    {Py_tp_repr, dp_DataParallel_repr},
    {Py_tp_methods, DataParallel_methods},
    {Py_tp_getset, dp_DataParallel_getset},
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
