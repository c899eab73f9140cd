/* dataparallel_module.c - the torch.nn.Module methods of DataParallel.
 *
 * torch.nn.DataParallel is itself an nn.Module whose one child is named
 * "module" (spec 1.8), so code written for it calls dp.parameters(),
 * dp.state_dict() (keys prefixed "module."), dp.train()/dp.eval(),
 * dp.zero_grad(), dp.to(...) on the wrapper. dpmini.DataParallel wraps any
 * callable; when that callable has these methods (a torch module, or any
 * object shaped like one) each method here forwards to it and adds the
 * "module" level exactly where PyTorch's wrapper adds it: names and keys
 * get "module." in front, recurse=False sees no parameters of the wrapper's
 * own, modules()/named_modules() start with the wrapper itself. When the
 * callable lacks the method, AttributeError says what was forwarded where.
 *
 * state_dict() and load_state_dict() are in dataparallel_state_dict.c.
 *
 * Attributes of the wrapped module itself are NOT forwarded (dp.weight is
 * an AttributeError, as in PyTorch: use dp.module.weight).
 */
#include "dataparallel_type.h"
#include "dp.h"

/* self.module.<name>, or -1 with AttributeError naming the forwarded method. */
PyObject *dp_wrapper_module_method(dp_DataParallelObject *self, const char *name)
{
    if (dp_check_initialised(self) < 0) {
        return NULL;
    }
    PyObject *m = PyObject_GetAttrString(self->module, name);
    if (m == NULL && PyErr_ExceptionMatches(PyExc_AttributeError)) {
        PyErr_Clear();
        PyErr_Format(PyExc_AttributeError,
                     "DataParallel.%s() forwards to module.%s(), and module (a %.100s) has no "
                     "attribute '%s' (these methods are for torch.nn.Module-like modules)",
                     name, name, Py_TYPE(self->module)->tp_name, name);
    }
    return m;
}

/* module.<name>(*args, **kwargs); new reference or NULL. */
PyObject *dp_wrapper_forward_call(dp_DataParallelObject *self, const char *name, PyObject *args,
                              PyObject *kwargs)
{
    PyObject *m = dp_wrapper_module_method(self, name);
    if (m == NULL) {
        return NULL;
    }
    PyObject *empty = NULL;
    if (args == NULL) {
        args = empty = PyTuple_New(0);
        if (args == NULL) {
            Py_DECREF(m);
            return NULL;
        }
    }
    PyObject *res = PyObject_Call(m, args, kwargs);
    Py_DECREF(m);
    Py_XDECREF(empty);
    return res;
}

/* module.<name>(*args, **kwargs), then self (the chaining methods). */
static PyObject *forward_return_self(dp_DataParallelObject *self, const char *name,
                                     PyObject *args, PyObject *kwargs)
{
    PyObject *res = dp_wrapper_forward_call(self, name, args, kwargs);
    if (res == NULL) {
        return NULL;
    }
    Py_DECREF(res);
    return Py_NewRef((PyObject *)self);
}

/* prefix + "module" joined with a dot as nn.Module joins names ("" -> "module"). */
static PyObject *child_prefix(PyObject *prefix, const char *tail)
{
    if (PyUnicode_GET_LENGTH(prefix) == 0) {
        return PyUnicode_FromString(tail);
    }
    return PyUnicode_FromFormat("%U.%s", prefix, tail);
}

static PyObject *empty_iter(void)
{
    PyObject *t = PyTuple_New(0);
    if (t == NULL) {
        return NULL;
    }
    PyObject *it = PyObject_GetIter(t);
    Py_DECREF(t);
    return it;
}

/* named_parameters / named_buffers: (prefix='', recurse=True, remove_duplicate=True) */
static PyObject *named_tensors(dp_DataParallelObject *self, const char *name, PyObject *args,
                               PyObject *kwargs)
{
    static char *kwlist[] = {"prefix", "recurse", "remove_duplicate", NULL};
    PyObject *prefix = NULL;
    int recurse = 1, remove_duplicate = 1;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "|Upp", kwlist, &prefix, &recurse,
                                     &remove_duplicate)) {
        return NULL;
    }
    PyObject *m = dp_wrapper_module_method(self, name);
    if (m == NULL) {
        return NULL;
    }
    Py_DECREF(m);
    if (!recurse) {
        return empty_iter(); /* the wrapper holds no tensors of its own */
    }
    PyObject *empty = NULL, *full = NULL, *kw = NULL, *res = NULL;
    if (prefix == NULL) {
        prefix = empty = PyUnicode_FromString("");
        if (prefix == NULL) {
            return NULL;
        }
    }
    full = child_prefix(prefix, "module");
    kw = full == NULL ? NULL
         : Py_BuildValue("{sOsOsO}", "prefix", full, "recurse", Py_True, "remove_duplicate",
                         remove_duplicate ? Py_True : Py_False);
    if (kw != NULL) {
        res = dp_wrapper_forward_call(self, name, NULL, kw);
    }
    Py_XDECREF(empty);
    Py_XDECREF(full);
    Py_XDECREF(kw);
    return res;
}

/* parameters / buffers: (recurse=True) */
static PyObject *tensors(dp_DataParallelObject *self, const char *name, PyObject *args,
                         PyObject *kwargs)
{
    static char *kwlist[] = {"recurse", NULL};
    int recurse = 1;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "|p", kwlist, &recurse)) {
        return NULL;
    }
    PyObject *m = dp_wrapper_module_method(self, name);
    if (m == NULL) {
        return NULL;
    }
    Py_DECREF(m);
    if (!recurse) {
        return empty_iter();
    }
    return dp_wrapper_forward_call(self, name, NULL, NULL);
}

static PyObject *DP_parameters(dp_DataParallelObject *self, PyObject *args, PyObject *kw)
{
    return tensors(self, "parameters", args, kw);
}

static PyObject *DP_buffers(dp_DataParallelObject *self, PyObject *args, PyObject *kw)
{
    return tensors(self, "buffers", args, kw);
}

static PyObject *DP_named_parameters(dp_DataParallelObject *self, PyObject *args, PyObject *kw)
{
    return named_tensors(self, "named_parameters", args, kw);
}

static PyObject *DP_named_buffers(dp_DataParallelObject *self, PyObject *args, PyObject *kw)
{
    return named_tensors(self, "named_buffers", args, kw);
}

static PyObject *DP_children(dp_DataParallelObject *self, PyObject *unused)
{
    if (dp_check_initialised(self) < 0) {
        return NULL;
    }
    PyObject *t = PyTuple_Pack(1, self->module);
    PyObject *it = t == NULL ? NULL : PyObject_GetIter(t);
    Py_XDECREF(t);
    return it;
}

static PyObject *DP_named_children(dp_DataParallelObject *self, PyObject *unused)
{
    if (dp_check_initialised(self) < 0) {
        return NULL;
    }
    PyObject *t = Py_BuildValue("((sO))", "module", self->module);
    PyObject *it = t == NULL ? NULL : PyObject_GetIter(t);
    Py_XDECREF(t);
    return it;
}

/* named_modules(memo=None, prefix='', remove_duplicate=True): the wrapper
 * first, then module.named_modules(memo, prefix + "module", ...), as a list
 * iterator (the wrapper has one child, so nothing is gained by a generator). */
static PyObject *DP_named_modules(dp_DataParallelObject *self, PyObject *args, PyObject *kwargs)
{
    static char *kwlist[] = {"memo", "prefix", "remove_duplicate", NULL};
    PyObject *memo = Py_None, *prefix = NULL;
    int remove_duplicate = 1;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "|OUp", kwlist, &memo, &prefix,
                                     &remove_duplicate)) {
        return NULL;
    }
    PyObject *m = dp_wrapper_module_method(self, "named_modules");
    if (m == NULL) {
        return NULL;
    }
    Py_DECREF(m);
    PyObject *own_memo = NULL, *empty = NULL, *out = NULL, *full = NULL, *kw = NULL;
    PyObject *inner = NULL, *res = NULL;
    if (memo == Py_None) {
        memo = own_memo = PySet_New(NULL);
        if (memo == NULL) {
            goto done;
        }
    }
    if (prefix == NULL) {
        prefix = empty = PyUnicode_FromString("");
        if (prefix == NULL) {
            goto done;
        }
    }
    out = PyList_New(0);
    if (out == NULL) {
        goto done;
    }
    int seen = PySequence_Contains(memo, (PyObject *)self);
    if (seen < 0) {
        goto done;
    }
    if (!seen) {
        if (remove_duplicate) {
            PyObject *added = PyObject_CallMethod(memo, "add", "O", self);
            if (added == NULL) {
                goto done;
            }
            Py_DECREF(added);
        }
        PyObject *pair = PyTuple_Pack(2, prefix, (PyObject *)self);
        if (pair == NULL || PyList_Append(out, pair) < 0) {
            Py_XDECREF(pair);
            goto done;
        }
        Py_DECREF(pair);
        full = child_prefix(prefix, "module");
        kw = full == NULL ? NULL
             : Py_BuildValue("{sOsOsO}", "memo", memo, "prefix", full, "remove_duplicate",
                             remove_duplicate ? Py_True : Py_False);
        inner = kw == NULL ? NULL : dp_wrapper_forward_call(self, "named_modules", NULL, kw);
        if (inner == NULL) {
            goto done;
        }
        PyObject *ext = _PyList_Extend((PyListObject *)out, inner);
        if (ext == NULL) {
            goto done;
        }
        Py_DECREF(ext);
    }
    res = PyObject_GetIter(out);
done:
    Py_XDECREF(own_memo);
    Py_XDECREF(empty);
    Py_XDECREF(out);
    Py_XDECREF(full);
    Py_XDECREF(kw);
    Py_XDECREF(inner);
    return res;
}

static PyObject *DP_modules(dp_DataParallelObject *self, PyObject *unused)
{
    PyObject *noargs = PyTuple_New(0);
    PyObject *named = noargs == NULL ? NULL : DP_named_modules(self, noargs, NULL);
    Py_XDECREF(noargs);
    if (named == NULL) {
        return NULL;
    }
    PyObject *out = PyList_New(0), *item;
    while (out != NULL && (item = PyIter_Next(named)) != NULL) {
        int rc = PyList_Append(out, PyTuple_GET_ITEM(item, 1));
        Py_DECREF(item);
        if (rc < 0) {
            Py_CLEAR(out);
        }
    }
    Py_DECREF(named);
    if (out == NULL || PyErr_Occurred()) {
        Py_XDECREF(out);
        return NULL;
    }
    PyObject *it = PyObject_GetIter(out);
    Py_DECREF(out);
    return it;
}

/* The wrapper's own training flag, as nn.Module keeps one per module: kept in
 * the instance __dict__ (so copy and pickle carry it), True until set. */
static int set_own_training(dp_DataParallelObject *self, PyObject *value)
{
    PyObject **dictptr = &self->dict;
    if (*dictptr == NULL && (*dictptr = PyDict_New()) == NULL) {
        return -1;
    }
    return PyDict_SetItemString(*dictptr, "training", value);
}

/* train(mode=True): module.train(mode), then the wrapper's flag; returns self,
 * as nn.Module.train (which sets every module's flag, the wrapper's too). */
static PyObject *DP_train(dp_DataParallelObject *self, PyObject *args, PyObject *kwargs)
{
    static char *kwlist[] = {"mode", NULL};
    PyObject *mode = Py_True;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "|O:train", kwlist, &mode)) {
        return NULL;
    }
    PyObject *fwd = PyTuple_Pack(1, mode);
    PyObject *res = fwd == NULL ? NULL : forward_return_self(self, "train", fwd, NULL);
    Py_XDECREF(fwd);
    int on = res == NULL ? 0 : PyObject_IsTrue(mode);
    if (res != NULL && (on < 0 || set_own_training(self, on ? Py_True : Py_False) < 0)) {
        Py_CLEAR(res);
    }
    return res;
}

static PyObject *DP_eval(dp_DataParallelObject *self, PyObject *unused)
{
    PyObject *args = Py_BuildValue("(O)", Py_False);
    if (args == NULL) {
        return NULL;
    }
    PyObject *res = DP_train(self, args, NULL);
    Py_DECREF(args);
    return res;
}

static PyObject *DP_zero_grad(dp_DataParallelObject *self, PyObject *args, PyObject *kwargs)
{
    return dp_wrapper_forward_call(self, "zero_grad", args, kwargs);
}

/* the methods that change the module in place and return the wrapper */
#define DP_CHAIN(fn, name)                                                                    \
    static PyObject *fn(dp_DataParallelObject *self, PyObject *args, PyObject *kwargs)        \
    {                                                                                         \
        return forward_return_self(self, name, args, kwargs);                                 \
    }
DP_CHAIN(DP_to, "to")
DP_CHAIN(DP_cuda, "cuda")
DP_CHAIN(DP_cpu, "cpu")
DP_CHAIN(DP_float, "float")
DP_CHAIN(DP_double, "double")
DP_CHAIN(DP_half, "half")
DP_CHAIN(DP_bfloat16, "bfloat16")
DP_CHAIN(DP_requires_grad_, "requires_grad_")

/* apply(fn): fn on every submodule, then on the wrapper; returns self. */
static PyObject *DP_apply(dp_DataParallelObject *self, PyObject *fn)
{
    PyObject *args = PyTuple_Pack(1, fn);
    if (args == NULL) {
        return NULL;
    }
    PyObject *res = dp_wrapper_forward_call(self, "apply", args, NULL);
    Py_DECREF(args);
    if (res == NULL) {
        return NULL;
    }
    Py_DECREF(res);
    res = PyObject_CallOneArg(fn, (PyObject *)self);
    if (res == NULL) {
        return NULL;
    }
    Py_DECREF(res);
    return Py_NewRef((PyObject *)self);
}

PyObject *dp_DataParallel_get_training(dp_DataParallelObject *self, void *closure)
{
    PyObject *t = self->dict == NULL ? NULL : PyDict_GetItemString(self->dict, "training");
    return Py_NewRef(t != NULL ? t : Py_True);
}

int dp_DataParallel_set_training(dp_DataParallelObject *self, PyObject *value, void *closure)
{
    if (value == NULL) {
        PyErr_SetString(PyExc_AttributeError, "DataParallel.training cannot be deleted");
        return -1;
    }
    return set_own_training(self, value);
}

#define FWD_DOC(sig, what)                                                                    \
    sig "\n--\n\n" what "\n\nForwarded to the wrapped module, as torch.nn.DataParallel (an "   \
        "nn.Module whose\none child is named \"module\", spec 1.8) does for its module. "         \
        "Errors:\nRuntimeError before __init__; AttributeError when the module has no such\n"    \
        "method (a plain function); whatever the module's method raises."

static PyMethodDef dp_DataParallel_module_methods[] = {
    {"parameters", (PyCFunction)(void (*)(void))DP_parameters, METH_VARARGS | METH_KEYWORDS,
     FWD_DOC("parameters($self, recurse=True)",
             "An iterator over module.parameters() (the arrays/tensors of any shape and\n"
             "dtype the module holds). recurse=False: empty (the wrapper has none).")},
    {"named_parameters", (PyCFunction)(void (*)(void))DP_named_parameters,
     METH_VARARGS | METH_KEYWORDS,
     FWD_DOC("named_parameters($self, prefix='', recurse=True, remove_duplicate=True)",
             "(name, parameter) pairs of the module, each name starting with\n"
             "prefix + \"module.\" (e.g. \"module.weight\"). recurse=False: empty.")},
    {"buffers", (PyCFunction)(void (*)(void))DP_buffers, METH_VARARGS | METH_KEYWORDS,
     FWD_DOC("buffers($self, recurse=True)",
             "An iterator over module.buffers(). recurse=False: empty.")},
    {"named_buffers", (PyCFunction)(void (*)(void))DP_named_buffers,
     METH_VARARGS | METH_KEYWORDS,
     FWD_DOC("named_buffers($self, prefix='', recurse=True, remove_duplicate=True)",
             "(name, buffer) pairs, names starting with prefix + \"module.\".")},
    {"children", (PyCFunction)DP_children, METH_NOARGS,
     FWD_DOC("children($self)", "An iterator over the one child: the module.")},
    {"named_children", (PyCFunction)DP_named_children, METH_NOARGS,
     FWD_DOC("named_children($self)", "An iterator over the one pair (\"module\", module).")},
    {"modules", (PyCFunction)DP_modules, METH_NOARGS,
     FWD_DOC("modules($self)", "The wrapper itself, then module.modules().")},
    {"named_modules", (PyCFunction)(void (*)(void))DP_named_modules,
     METH_VARARGS | METH_KEYWORDS,
     FWD_DOC("named_modules($self, memo=None, prefix='', remove_duplicate=True)",
             "(prefix, wrapper), then module.named_modules() under prefix + \"module\".")},
    {"state_dict", (PyCFunction)(void (*)(void))dp_DataParallel_state_dict, METH_VARARGS | METH_KEYWORDS,
     FWD_DOC("state_dict($self, destination=None, prefix='', keep_vars=False)",
             "module.state_dict() with every key prefixed \"module.\" (prefix + \"module.\"),\n"
             "as torch.nn.DataParallel's. Values are the module's arrays/tensors as they are.")},
    {"load_state_dict", (PyCFunction)(void (*)(void))dp_DataParallel_load_state_dict,
     METH_VARARGS | METH_KEYWORDS,
     FWD_DOC("load_state_dict($self, state_dict, strict=True, assign=False)",
             "Load a mapping whose keys carry the \"module.\" prefix (what state_dict() gives)\n"
             "into the module. Keys without it are unexpected. strict=True: RuntimeError\n"
             "\"Error(s) in loading state_dict for DataParallel\" listing the missing and\n"
             "unexpected keys (prefixed), as nn.Module; else returns them as the module's\n"
             "_IncompatibleKeys(missing_keys, unexpected_keys). TypeError: not a mapping.")},
    {"train", (PyCFunction)(void (*)(void))DP_train, METH_VARARGS | METH_KEYWORDS,
     FWD_DOC("train($self, mode=True)", "module.train(mode); returns self.")},
    {"eval", (PyCFunction)DP_eval, METH_NOARGS,
     FWD_DOC("eval($self)", "module.train(False); returns self.")},
    {"zero_grad", (PyCFunction)(void (*)(void))DP_zero_grad, METH_VARARGS | METH_KEYWORDS,
     FWD_DOC("zero_grad($self, set_to_none=True)", "module.zero_grad(...); returns None.")},
    {"to", (PyCFunction)(void (*)(void))DP_to, METH_VARARGS | METH_KEYWORDS,
     FWD_DOC("to($self, *args, **kwargs)", "module.to(...) (device and/or dtype); returns self.")},
    {"cuda", (PyCFunction)(void (*)(void))DP_cuda, METH_VARARGS | METH_KEYWORDS,
     FWD_DOC("cuda($self, device=None)", "module.cuda(device); returns self.")},
    {"cpu", (PyCFunction)(void (*)(void))DP_cpu, METH_VARARGS | METH_KEYWORDS,
     FWD_DOC("cpu($self)", "module.cpu(); returns self.")},
    {"float", (PyCFunction)(void (*)(void))DP_float, METH_VARARGS | METH_KEYWORDS,
     FWD_DOC("float($self)", "module.float() (float32 floating arrays); returns self.")},
    {"double", (PyCFunction)(void (*)(void))DP_double, METH_VARARGS | METH_KEYWORDS,
     FWD_DOC("double($self)", "module.double() (float64 floating arrays); returns self.")},
    {"half", (PyCFunction)(void (*)(void))DP_half, METH_VARARGS | METH_KEYWORDS,
     FWD_DOC("half($self)", "module.half() (float16 floating arrays); returns self.")},
    {"bfloat16", (PyCFunction)(void (*)(void))DP_bfloat16, METH_VARARGS | METH_KEYWORDS,
     FWD_DOC("bfloat16($self)", "module.bfloat16(); returns self.")},
    {"requires_grad_", (PyCFunction)(void (*)(void))DP_requires_grad_,
     METH_VARARGS | METH_KEYWORDS,
     FWD_DOC("requires_grad_($self, requires_grad=True)",
             "module.requires_grad_(...); returns self.")},
    {"apply", (PyCFunction)DP_apply, METH_O,
     FWD_DOC("apply($self, fn, /)",
             "module.apply(fn) (fn on every submodule), then fn(self); returns self.")},
    {NULL, NULL, 0, NULL},
};

int dp_DataParallel_add_module_methods(PyTypeObject *tp)
{
    for (PyMethodDef *def = dp_DataParallel_module_methods; def->ml_name != NULL; def++) {
        PyObject *descr = PyDescr_NewMethod(tp, def);
        if (descr == NULL) {
            return -1;
        }
        int rc = PyObject_SetAttrString((PyObject *)tp, def->ml_name, descr);
        Py_DECREF(descr);
        if (rc < 0) {
            return -1;
        }
    }
    return 0;
}
