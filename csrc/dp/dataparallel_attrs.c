/* dataparallel_attrs.c - dpmini.DataParallel's state as Python sees it: the
 * repr, the attributes (module, device_ids, output_device, dim, strict and
 * the extension options in_dims, out_dims, chunk_sizes, weights; each setter
 * accepts what the constructor accepts) and __reduce__ for copy, deepcopy
 * and pickle. The type itself, construction and forward are in
 * dataparallel.c (docs/spec.md 1, 2; docs/design.md).
 */
#include "dpmini.h"
#include "dataparallel_type.h"
#include "dp.h"
#include "walk.h"

/* ------------------------------------------------------------------ */
/* repr                                                                */
/* ------------------------------------------------------------------ */

PyObject *dp_DataParallel_repr(dp_DataParallelObject *self)
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
    return dp_device_list_new(st, self->devs, self->devs ? self->ndev : 0);
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
        if (dp_check_initialised(self) < 0) {
            return -1;
        }
        d = self->devs[0];
    } else if (dp_parse_target_device(st, value, "output_device", &d) < 0) {
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

/* chunk_sizes / weights: checked against device_ids and the other one. */
static int set_sizes_opt(dp_DataParallelObject *self, PyObject *value, int is_weights)
{
    PyObject *cs_t, *w_t;
    if (refuse_delete(value, is_weights ? "weights" : "chunk_sizes") < 0 ||
        dp_check_initialised(self) < 0) {
        return -1;
    }
    if (dp_check_call_opts(Py_None, Py_None, is_weights ? self->chunk_sizes : value,
                        is_weights ? value : self->weights, self->ndev, &cs_t, &w_t) < 0) {
        return -1;
    }
    Py_SETREF(self->chunk_sizes, cs_t);
    Py_SETREF(self->weights, w_t);
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

const char dp_DataParallel_reduce_doc[] =
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
"__init__ was not called.";

PyObject *dp_DataParallel_reduce(dp_DataParallelObject *self, PyObject *unused)
{
    PyObject *ids = NULL, *out = NULL, *args = NULL, *state = NULL, *opts = NULL;
    PyObject *res = NULL;
    char buf[32];
    if (dp_check_initialised(self) < 0) {
        return NULL;
    }
    ids = PyList_New(self->ndev);
    if (ids == NULL) {
        goto done;
    }
    for (Py_ssize_t i = 0; i < self->ndev; i++) {
        dp_device_format(self->devs[i], buf, sizeof buf);
        PyObject *s = PyUnicode_FromString(buf);
        if (s == NULL) {
            goto done;
        }
        PyList_SET_ITEM(ids, i, s);
    }
    dp_device_format(self->output_device, buf, sizeof buf);
    out = PyUnicode_FromString(buf);
    if (out == NULL) {
        goto done;
    }
    args = Py_BuildValue("(OOOiO)", self->module, ids, out, self->dim,
                         self->strict ? Py_True : Py_False);
    if (args == NULL) {
        goto done;
    }
    state = (self->dict != NULL && PyDict_GET_SIZE(self->dict) > 0)
            ? PyDict_Copy(self->dict) : Py_NewRef(Py_None);
    if (state == NULL) {
        goto done;
    }
    {
        /* The extension options go in pickle's slotstate: copy and pickle
         * setattr() each entry, through the validating setters, and a
         * subclass __init__ taking only the five PyTorch arguments still
         * rebuilds. */
        static const char *const names[] = {"in_dims", "out_dims", "chunk_sizes", "weights"};
        PyObject *vals[] = {self->in_dims, self->out_dims, self->chunk_sizes, self->weights};
        opts = PyDict_New();
        if (opts == NULL) {
            goto done;
        }
        for (int i = 0; i < 4; i++) {
            if (vals[i] != Py_None && PyDict_SetItemString(opts, names[i], vals[i]) < 0) {
                goto done;
            }
        }
        if (PyDict_GET_SIZE(opts) > 0) {
            Py_SETREF(state, PyTuple_Pack(2, state, opts));
            if (state == NULL) {
                goto done;
            }
        }
    }
    dp_state *st = dp_state_from_type(Py_TYPE(self));
    if (st == NULL) {
        goto done;
    }
    if (Py_TYPE(self) == st->DataParallelType) {
        res = PyTuple_Pack(3, (PyObject *)Py_TYPE(self), args, state);
    }
    else {
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
    Py_XDECREF(opts);
    Py_XDECREF(ids);
    Py_XDECREF(out);
    Py_XDECREF(args);
    Py_XDECREF(state);
    return res;
}

PyGetSetDef dp_DataParallel_getset[] = {
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
