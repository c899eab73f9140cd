/* interop.c - arrays of other libraries (PyTorch, JAX, CuPy, ...): the one
 * definition of an array leaf, the zero-copy import of a foreign array, and
 * (in interop_origin.c) the way back into the caller's library.
 *
 * An array leaf (scatter, gather, replicate, explain, the comm functions) is
 * a numpy.ndarray (subclasses included), a dpmini.Array, or any object that
 * exports __dlpack__ together with __dlpack_device__, or
 * __cuda_array_interface__. Buffer-protocol objects (bytes, memoryview) and
 * __array_interface__-only objects are not leaves (comm still reads them).
 *
 * Probing an object for those protocols looks the attributes up; only
 * AttributeError means "not there". Any other Exception raised by a lookup
 * (a dict-backed __getattr__ raising KeyError, a CUDA tensor's property
 * raising RuntimeError) is re-raised, same type, saying which protocol and
 * type raised it; the tree walkers then prefix the path of the object
 * (args[1], module.cfg) with dp_reraise_at. docs/design.md, "Arrays of other
 * libraries", states the rule.
 *
 * Import: host memory (DLPack device kDLCPU / kDLCUDAHost) through
 * numpy.from_dlpack (a view, no copy); CUDA memory through array.c's
 * DLPack/CAI import (a shadow ndarray, no copy). A producer whose DLPack
 * export refuses (JAX arrays sharded over several JAX devices) is read with
 * numpy.asarray (a copy). A tensor that requires grad is refused, and so is
 * a JAX tracer (inside jit/grad/vmap: no values to split), which counts as a
 * leaf so that every walker refuses it naming its path. A dtype NumPy lacks
 * (bfloat16...) is named (interop_dtype.c).
 *
 * The way back ("origin", the caller's library) is interop_origin.c.
 *
 * interop_torch.c holds what PyTorch needs beyond this (nn.Module, grad mode).
 */
#include "dpmini.h"
#include "profile.h"
#include "dlpack.h"
#include "interop.h"

#include <string.h>

/* ------------------------------------------------------------------ */
/* Probing                                                             */
/* ------------------------------------------------------------------ */

/* Types that never carry the protocols: no attribute lookup for them. */
static int never_foreign(PyObject *obj)
{
    PyTypeObject *tp = Py_TYPE(obj);
    return obj == Py_None || tp == &PyBool_Type || tp == &PyLong_Type ||
           tp == &PyFloat_Type || tp == &PyComplex_Type || tp == &PyUnicode_Type ||
           tp == &PyBytes_Type || tp == &PyByteArray_Type || tp == &PyMemoryView_Type ||
           tp == &PyTuple_Type || tp == &PyList_Type || tp == &PyDict_Type ||
           tp == &PySet_Type || tp == &PyFrozenSet_Type || PyType_Check(obj) ||
           PyModule_Check(obj) || PyFunction_Check(obj) || PyCFunction_Check(obj) ||
           PyMethod_Check(obj) || PyArray_IsScalar(obj, Generic);
}

/* Re-raise the pending exception as the same type with message msg (a str,
 * stolen) and the original as __cause__. KeyError gets the dpmini
 * _KeyErrorMessage str so that str(e) is the text, not its repr. When the
 * type cannot be built from one message, the original stays pending. */
static void reraise_with(dp_state *st, PyObject *msg)
{
    PyObject *t, *v, *tb;
    PyErr_Fetch(&t, &v, &tb);
    PyErr_NormalizeException(&t, &v, &tb);
    if (msg == NULL || v == NULL) {
        Py_XDECREF(msg);
        PyErr_Restore(t, v, tb);
        return;
    }
    if (tb != NULL)
        PyException_SetTraceback(v, tb);
    PyObject *arg = msg;
    if (PyType_IsSubtype((PyTypeObject *)t, (PyTypeObject *)PyExc_KeyError) && st != NULL &&
        st->KeyErrorMessage != NULL)
        arg = PyObject_CallOneArg(st->KeyErrorMessage, msg);
    PyObject *nv = arg != NULL ? PyObject_CallOneArg(t, arg) : NULL;
    if (arg != msg)
        Py_XDECREF(arg);
    Py_DECREF(msg);
    if (nv == NULL || !PyExceptionInstance_Check(nv)) {
        Py_XDECREF(nv);
        PyErr_Clear();
        PyErr_Restore(t, v, tb);
        return;
    }
    PyException_SetCause(nv, v);   /* steals v */
    PyErr_SetObject(t, nv);
    Py_DECREF(nv);
    Py_DECREF(t);
    Py_XDECREF(tb);
}

void dp_reraise_msg(dp_state *st, PyObject *msg)
{
    if (!PyErr_ExceptionMatches(PyExc_Exception)) {
        Py_XDECREF(msg);   /* KeyboardInterrupt, SystemExit: as they are */
        return;
    }
    reraise_with(st, msg);
}

void dp_reraise_at(dp_state *st, PyObject *path)
{
    if (path == NULL || !PyErr_ExceptionMatches(PyExc_Exception))
        return;   /* KeyboardInterrupt, SystemExit: as they are */
    PyObject *t, *v, *tb;
    PyErr_Fetch(&t, &v, &tb);
    PyErr_NormalizeException(&t, &v, &tb);
    PyObject *text = v != NULL ? PyObject_Str(v) : NULL;
    if (text == NULL) {
        PyErr_Clear();
        PyErr_Restore(t, v, tb);
        return;
    }
    /* Already named (an inner walker prefixed it): leave it. */
    int named = PyUnicode_Tailmatch(text, path, 0, PY_SSIZE_T_MAX, -1) == 1;
    PyObject *msg = named ? NULL : PyUnicode_FromFormat("%U: %U", path, text);
    Py_DECREF(text);
    PyErr_Restore(t, v, tb);
    if (!named)
        reraise_with(st, msg);
}

/* Look attribute name up on obj: 1 there (callable for the DLPack methods,
 * a dict with 'data' for the CUDA Array Interface: a __getattr__ answering None or {} for
 * every name is no exporter), 0 AttributeError or the wrong kind of value,
 * -1 any other error (re-raised naming the protocol and the type). */
static int probe_attr(dp_state *st, PyObject *obj, const char *name, int callable)
{
    PyObject *v = PyObject_GetAttrString(obj, name);
    if (v != NULL) {
        /* A CAI dict has a 'data' entry (v3: shape, typestr, data,
         * version): a __getattr__ answering {} for every name is no array. */
        int ok = callable ? PyCallable_Check(v)
                          : PyDict_Check(v) && PyDict_GetItemString(v, "data") != NULL;
        Py_DECREF(v);
        return ok;
    }
    if (PyErr_ExceptionMatches(PyExc_AttributeError)) {
        PyErr_Clear();
        return 0;
    }
    if (PyErr_ExceptionMatches(PyExc_Exception)) {
        PyObject *t, *v2, *tb;
        PyErr_Fetch(&t, &v2, &tb);
        PyErr_NormalizeException(&t, &v2, &tb);
        PyObject *msg = PyUnicode_FromFormat(
            "looking up %s on a %.100s object (to tell whether it is an array) raised "
            "%.100s: %S; dpmini takes only AttributeError to mean that an object lacks "
            "an attribute (make __getattr__ raise AttributeError)", name,
            Py_TYPE(obj)->tp_name, Py_TYPE(v2)->tp_name, v2);
        PyErr_Restore(t, v2, tb);
        reraise_with(st, msg);
    }
    return -1;
}

/* Is obj a JAX tracer (an abstract value inside jax.jit, grad, vmap...)? The
 * class is looked up in sys.modules only: without JAX imported there are no
 * tracers. 1/0, never an exception. */
static int is_jax_tracer(PyObject *obj)
{
    static const char *const mods[] = {"jax._src.core", "jax.core"};
    for (size_t i = 0; i < sizeof mods / sizeof mods[0]; i++) {
        PyObject *name = PyUnicode_FromString(mods[i]);
        PyObject *mod = name != NULL ? PyImport_GetModule(name) : NULL;
        Py_XDECREF(name);
        PyObject *cls = mod != NULL ? PyObject_GetAttrString(mod, "Tracer") : NULL;
        Py_XDECREF(mod);
        PyErr_Clear();
        if (cls == NULL)
            continue;
        int r = PyType_Check(cls) && PyType_IsSubtype(Py_TYPE(obj), (PyTypeObject *)cls);
        Py_DECREF(cls);
        return r;
    }
    return 0;
}

/* TypeError for a JAX tracer at argname (it has no values to split). */
static void refuse_jax_tracer(PyObject *obj, const char *argname)
{
    PyErr_Format(PyExc_TypeError,
                 "%s: a JAX tracer (%.100s) inside a JAX transformation (jax.jit, jax.grad, "
                 "jax.vmap...): it has no values yet, and dpmini splits concrete arrays "
                 "(copied on its own threads, outside JAX's trace); call DataParallel "
                 "outside jit/grad/vmap, or jit the module instead "
                 "(DataParallel(jax.jit(f), ...))", argname, Py_TYPE(obj)->tp_name);
}

int dp_is_foreign_array(dp_state *st, PyObject *obj)
{
    if (PyArray_Check(obj) || PyObject_TypeCheck(obj, st->ArrayType) || never_foreign(obj))
        return 0;
    /* A JAX tracer is an array leaf (so that every walker refuses it naming
     * its path, dp_import_foreign) instead of a value shared whole. */
    if (is_jax_tracer(obj))
        return 1;
    int r = probe_attr(st, obj, "__dlpack__", 1);
    if (r < 0)
        return -1;
    if (r == 1) {
        r = probe_attr(st, obj, "__dlpack_device__", 1);
        if (r != 0)
            return r;
    }
    return probe_attr(st, obj, "__cuda_array_interface__", 0);
}

/* ------------------------------------------------------------------ */
/* Import                                                              */
/* ------------------------------------------------------------------ */

/* "torch", "jax", "cupy": the top-level package of obj's type (new str). */
/* The type's own name, without a module prefix ("ArrayImpl"). */
static const char *short_name(PyTypeObject *tp)
{
    const char *dot = strrchr(tp->tp_name, '.');
    return dot != NULL ? dot + 1 : tp->tp_name;
}

PyObject *dp_top_module(PyObject *obj)
{
    PyObject *mod = PyObject_GetAttrString((PyObject *)Py_TYPE(obj), "__module__");
    if (mod == NULL || !PyUnicode_Check(mod)) {
        Py_XDECREF(mod);
        PyErr_Clear();
        return PyUnicode_FromString("");
    }
    Py_ssize_t dot = PyUnicode_FindChar(mod, '.', 0, PyUnicode_GET_LENGTH(mod), 1);
    if (dot >= 0)
        Py_SETREF(mod, PyUnicode_Substring(mod, 0, dot));
    return mod;
}

PyObject *dp_array_type_name(dp_state *st, PyObject *obj)
{
    if (PyArray_Check(obj))
        return PyUnicode_FromString("numpy.ndarray");
    if (PyObject_TypeCheck(obj, st->ArrayType))
        return PyUnicode_FromString("dpmini.Array");
    PyObject *top = dp_top_module(obj), *res = NULL;
    if (top == NULL)
        return NULL;
    if (PyUnicode_CompareWithASCIIString(top, "jaxlib") == 0 ||
        PyUnicode_CompareWithASCIIString(top, "jax") == 0) {
        Py_DECREF(top);
        return PyUnicode_FromString("jax.Array");   /* jaxlib._jax.ArrayImpl */
    }
    Py_DECREF(top);
    PyObject *mod = PyObject_GetAttrString((PyObject *)Py_TYPE(obj), "__module__");
    if (mod != NULL && PyUnicode_Check(mod) && PyUnicode_GET_LENGTH(mod) > 0 &&
        PyUnicode_CompareWithASCIIString(mod, "builtins") != 0)
        res = PyUnicode_FromFormat("%U.%s", mod, short_name(Py_TYPE(obj)));
    else
        res = PyUnicode_FromString(short_name(Py_TYPE(obj)));
    PyErr_Clear();
    Py_XDECREF(mod);
    return res;
}

/* module.attr, or NULL with no exception when either is missing. */
PyObject *dp_import_attr_quiet(const char *module, const char *attr)
{
    PyObject *mod = PyImport_ImportModule(module);
    PyObject *r = mod != NULL ? PyObject_GetAttrString(mod, attr) : NULL;
    Py_XDECREF(mod);
    if (r == NULL || !PyCallable_Check(r)) {
        Py_XDECREF(r);
        if (PyErr_Occurred() && !PyErr_ExceptionMatches(PyExc_Exception))
            return NULL;   /* KeyboardInterrupt: the caller sees it pending */
        PyErr_Clear();
        return NULL;
    }
    return r;
}

/* A tensor that requires grad (torch). With grad mode off in this thread
 * (torch.no_grad(), inference_mode) nothing that dpmini copies would need a
 * graph, so it is read detached (x.detach(): a view, no copy): 2. With grad
 * mode on: 1 with st->RequiresGradError (a TypeError) naming argname; the
 * entry points catch it and run their differentiable form in dpmini._torch
 * (dp_autograd_retry). 0: not such a tensor; -1: an error from asking. */
static int requires_grad(dp_state *st, PyObject *obj, const char *argname)
{
    PyObject *rg = PyObject_GetAttrString(obj, "requires_grad");
    if (rg == NULL) {
        PyErr_Clear();
        return 0;
    }
    int yes = rg == Py_True;
    Py_DECREF(rg);
    if (!yes)
        return 0;
    PyObject *enabled = dp_import_attr_quiet("torch", "is_grad_enabled");
    PyObject *on = enabled != NULL ? PyObject_CallNoArgs(enabled) : NULL;
    Py_XDECREF(enabled);
    if (on == NULL && PyErr_Occurred())
        return -1;
    int grad_on = on == NULL || on == Py_True;   /* no torch.is_grad_enabled: refuse */
    Py_XDECREF(on);
    if (!grad_on)
        return 2;
    PyObject *name = dp_array_type_name(st, obj);
    if (name == NULL)
        return 1;
    if (strncmp(argname, "out", 3) == 0 && (argname[3] == '\0' || argname[3] == '[' ||
                                            argname[3] == '.')) {
        /* A replica's output (gather's paths start with "out"): the inputs
         * need not have required grad; the module's parameters did. */
        PyErr_Format(st->RequiresGradError,
                     "%s: a replica returned a %U that requires grad (computed from "
                     "parameters that require grad, with grad mode on): this step cannot "
                     "record autograd, because the module is not a torch.nn.Module "
                     "(dpmini.DataParallel and data_parallel record the graph for one, as "
                     "torch.nn.DataParallel does); wrap the model in a torch.nn.Module, or "
                     "call it under torch.no_grad()", argname, name);
        Py_DECREF(name);
        return 1;
    }
    PyErr_Format(st->RequiresGradError,
                 "%s: a %U that requires grad: this step cannot record autograd (the "
                 "module-level functions and DataParallel over a torch.nn.Module do); pass "
                 "x.detach(), or call under torch.no_grad() (where it is read detached)",
                 argname, name);
    Py_DECREF(name);
    return 1;
}

/* Inside torch.autograd.forward_ad.dual_level() a tensor may carry a
 * forward-mode tangent, which dpmini's copies would drop (torch's
 * DataParallel steps define no forward-mode rule either, so torch raises):
 * refused naming argname. Asked only while a dual level is open (torch's
 * forward_ad._current_level >= 0), before requires_grad: the differentiable
 * retry detaches, which drops the tangent too. 1 with TypeError, 0, or -1
 * with an interrupt that came while asking. */
static int refuse_dual_tensor(PyObject *obj, const char *argname)
{
    PyObject *name = PyUnicode_FromString("torch.autograd.forward_ad");
    PyObject *mod = name != NULL ? PyImport_GetModule(name) : NULL;
    Py_XDECREF(name);
    PyObject *level = mod != NULL ? PyObject_GetAttrString(mod, "_current_level") : NULL;
    long lv = level != NULL && PyLong_Check(level) ? PyLong_AsLong(level) : -1;
    Py_XDECREF(level);
    PyObject *dual = lv >= 0 ? PyObject_CallMethod(mod, "unpack_dual", "O", obj) : NULL;
    Py_XDECREF(mod);
    PyObject *tangent = dual != NULL ? PyObject_GetAttrString(dual, "tangent") : NULL;
    Py_XDECREF(dual);
    if (PyErr_Occurred()) {
        if (!PyErr_ExceptionMatches(PyExc_Exception)) {
            return -1;   /* KeyboardInterrupt: raised */
        }
        PyErr_Clear();   /* not a tensor torch can unpack: no tangent */
    }
    int yes = tangent != NULL && tangent != Py_None;
    Py_XDECREF(tangent);
    if (yes) {
        PyErr_Format(PyExc_TypeError,
                     "%s: a tensor with a forward-mode AD tangent (torch.autograd.forward_ad"
                     ".make_dual): dpmini's copies do not carry tangents, and neither do "
                     "torch.nn.DataParallel's steps (they have no forward-mode rule); compute "
                     "the JVP with the module itself, or pass the primal "
                     "(forward_ad.unpack_dual(x).primal)", argname);
    }
    return yes;
}

/* A torch tensor with a lazy bit set: the negative bit (a view such as
 * x.conj().imag), whose DLPack export hands over the unnegated memory without
 * saying so (NumPy's from_dlpack reads the wrong sign too), or the conjugate
 * bit (x.conj()), which torch refuses to export with its own BufferError that
 * names no way out. Both are refused with the call that resolves them: 1 with
 * TypeError naming argname, 0 when obj is not such a tensor, -1 when asking
 * raised. */
static int refuse_lazy_bit(PyObject *obj, const char *argname)
{
    static const struct { const char *ask, *what, *example, *reason, *fix; } bits[] = {
        {"is_conj", "conjugate", "x.conj()",
         "torch does not export it through DLPack", "x.resolve_conj()"},
        {"is_neg", "negative", "x.conj().imag",
         "its DLPack export would hand over the values with the wrong sign",
         "x.resolve_neg()"},
    };
    for (size_t i = 0; i < sizeof bits / sizeof bits[0]; i++) {
        PyObject *m = PyObject_GetAttrString(obj, bits[i].ask);
        if (m == NULL) {
            PyErr_Clear();
            return 0;   /* not a torch tensor: it has neither */
        }
        PyObject *r = PyCallable_Check(m) ? PyObject_CallNoArgs(m) : Py_NewRef(Py_False);
        Py_DECREF(m);
        if (r == NULL)
            return -1;
        int yes = r == Py_True;
        Py_DECREF(r);
        if (yes) {
            PyErr_Format(PyExc_TypeError,
                         "%s: a tensor with the %s bit set (a lazy view such as %s): %s; "
                         "pass %s", argname, bits[i].what, bits[i].example, bits[i].reason,
                         bits[i].fix);
            return 1;
        }
    }
    return 0;
}

void dp_attach_cause(PyObject *cause)
{
    if (cause == NULL)
        return;
    if (!PyErr_Occurred()) {
        Py_DECREF(cause);
        return;
    }
#if PY_VERSION_HEX >= 0x030C0000
    PyObject *exc = PyErr_GetRaisedException();
    PyException_SetCause(exc, Py_NewRef(cause));
    PyException_SetContext(exc, cause);
    PyErr_SetRaisedException(exc);
#else
    PyObject *type, *value, *tb;
    PyErr_Fetch(&type, &value, &tb);
    PyErr_NormalizeException(&type, &value, &tb);
    if (value != NULL) {
        PyException_SetCause(value, Py_NewRef(cause));
        PyException_SetContext(value, cause);
    }
    else {
        Py_DECREF(cause);
    }
    PyErr_Restore(type, value, tb);
#endif
}

/* The pending error as "argname: cannot read <type> as an array (<what>: <error>)". */
static void raise_unreadable(PyObject *obj, const char *argname, const char *what)
{
    if (!PyErr_ExceptionMatches(PyExc_Exception))
        return;
    PyObject *t, *v, *tb;
    PyErr_Fetch(&t, &v, &tb);
    PyErr_NormalizeException(&t, &v, &tb);
    PyErr_Format(PyExc_TypeError, "%s: cannot read %.100s as an array (%s raised %.100s: %S)",
                 argname, Py_TYPE(obj)->tp_name, what, v ? Py_TYPE(v)->tp_name : "?",
                 v ? v : Py_None);
    dp_attach_cause(v);
    Py_XDECREF(t);
    Py_XDECREF(tb);
}

/* numpy.<fn>(obj) as an ndarray (new reference), errors as raise_unreadable. */
static PyArrayObject *numpy_read(PyObject *obj, const char *fn, const char *argname)
{
    PyObject *np = PyImport_ImportModule("numpy");
    PyObject *r = np != NULL ? PyObject_CallMethod(np, fn, "O", obj) : NULL;
    Py_XDECREF(np);
    if (r != NULL && !PyArray_Check(r)) {
        Py_DECREF(r);
        PyErr_Format(PyExc_TypeError, "%s: numpy.%s returned no ndarray", argname, fn);
        return NULL;
    }
    if (r == NULL) {
        char what[64];
        snprintf(what, sizeof what, "numpy.%s", fn);
        raise_unreadable(obj, argname, what);
    }
    return (PyArrayObject *)r;
}

/* The TypeError for a host tensor whose dtype no NumPy dtype matches
 * (missing: its name), the pending error of numpy.from_dlpack as __cause__. */
static void refuse_missing_dtype(dp_state *st, PyObject *obj, const char *argname,
                                 const char *missing)
{
    PyObject *t, *v, *tb;
    PyErr_Fetch(&t, &v, &tb);
    PyErr_NormalizeException(&t, &v, &tb);
    PyObject *name = dp_array_type_name(st, obj);
    if (name == NULL) {
        Py_XDECREF(t);
        Py_XDECREF(v);
        Py_XDECREF(tb);
        return;
    }
    PyErr_Format(PyExc_TypeError,
                 "%s: a %U of dtype %s: NumPy has no such dtype, and dpmini splits, copies "
                 "and gathers arrays as NumPy dtypes, with ml_dtypes' bfloat16, float8 and "
                 "complex32 when the ml_dtypes package is installed (pip install ml_dtypes); "
                 "install it, or convert first (x.float(), or x.to(torch.float32) / "
                 "x.astype(jnp.float32)) and back inside the replica if it needs that dtype",
                 argname, name, missing);
    Py_DECREF(name);
    dp_attach_cause(v);
    Py_XDECREF(t);
    Py_XDECREF(tb);
}

/* Host memory through numpy.from_dlpack (a view, no copy). When NumPy
 * refuses the dtype (bfloat16, float8, complex32: NumPy has none), dpmini's
 * own DLPack import reads it as ml_dtypes' dtype (host_dlpack.c, a view
 * too); when no dtype matches (ml_dtypes missing, a packed float4), a
 * TypeError that says which dtype and what to do, the original as
 * __cause__. */
static PyArrayObject *read_host_dlpack(dp_state *st, PyObject *obj, const char *argname)
{
    PyObject *np = PyImport_ImportModule("numpy");
    PyObject *r = np != NULL ? PyObject_CallMethod(np, "from_dlpack", "O", obj) : NULL;
    Py_XDECREF(np);
    if (r != NULL && !PyArray_Check(r)) {
        Py_DECREF(r);
        PyErr_Format(PyExc_TypeError, "%s: numpy.from_dlpack returned no ndarray", argname);
        return NULL;
    }
    if (r != NULL || !PyErr_ExceptionMatches(PyExc_Exception))
        return (PyArrayObject *)r;
    char buf[96];
    PyObject *t, *v, *tb;
    PyErr_Fetch(&t, &v, &tb);
    const char *missing = dp_dlpack_dtype_missing(obj, buf, sizeof buf);
    if (missing == NULL) {
        PyErr_Restore(t, v, tb);
        raise_unreadable(obj, argname, "numpy.from_dlpack");
        return NULL;
    }
    PyArrayObject *a = dp_host_dlpack_import(obj, argname);
    if (a != NULL || PyErr_Occurred()) {
        Py_XDECREF(t);
        Py_XDECREF(v);
        Py_XDECREF(tb);
        return a;
    }
    PyErr_Restore(t, v, tb);
    refuse_missing_dtype(st, obj, argname, missing);
    return NULL;
}

PyObject *dp_torch_call(const char *name, PyObject *args, PyObject *kwargs)
{
    PyObject *fn = NULL, *mod = PyImport_ImportModule("dpmini._torch");
    if (mod != NULL) {
        fn = PyObject_GetAttrString(mod, name);
        Py_DECREF(mod);
    }
    if (fn == NULL) {
        return NULL;
    }
    PyObject *res = PyObject_Call(fn, args, kwargs);
    Py_DECREF(fn);
    return res;
}

PyObject *dp_autograd_retry(dp_state *st, const char *name, PyObject *args, PyObject *kwargs)
{
    if (!PyErr_ExceptionMatches(st->RequiresGradError)) {
        return NULL;
    }
    PyErr_Clear();
    return dp_torch_call(name, args, kwargs);
}

/* Is the argument at position pos, or named key, one of the structure
 * parameters (the first ones of the call, named in structures)? */
static int is_structure_arg(const char *const *structures, Py_ssize_t pos, PyObject *key)
{
    for (Py_ssize_t j = 0; structures != NULL && structures[j] != NULL; j++) {
        if (key != NULL ? PyUnicode_CompareWithASCIIString(key, structures[j]) == 0 : pos == j) {
            return 1;
        }
    }
    return 0;
}

/* v itself, or the tuple of its items when it is a one-shot iterator that
 * is not a structure argument. A new reference, or NULL. */
static PyObject *frozen_arg(PyObject *v, const char *const *structures, Py_ssize_t pos,
                            PyObject *key)
{
    if (PyIter_Check(v) && !is_structure_arg(structures, pos, key)) {
        return PySequence_Tuple(v);
    }
    return Py_NewRef(v);
}

/* Does any argument need dp_freeze_iterators' copy? */
static int has_iterator_arg(PyObject *args, PyObject *kw)
{
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(args); i++) {
        if (PyIter_Check(PyTuple_GET_ITEM(args, i))) {
            return 1;
        }
    }
    PyObject *key, *v;
    Py_ssize_t pos = 0;
    while (kw != NULL && PyDict_Next(kw, &pos, &key, &v)) {
        if (PyIter_Check(v)) {
            return 1;
        }
    }
    return 0;
}

int dp_freeze_iterators(PyObject *args, PyObject *kw, const char *const *structures,
                        PyObject **args_out, PyObject **kw_out)
{
    if (!has_iterator_arg(args, kw)) {   /* the usual call: nothing to copy */
        *args_out = Py_NewRef(args);
        *kw_out = Py_XNewRef(kw);
        return 0;
    }
    Py_ssize_t n = PyTuple_GET_SIZE(args);
    *args_out = PyTuple_New(n);
    *kw_out = kw != NULL ? PyDict_New() : NULL;
    if (*args_out == NULL || (kw != NULL && *kw_out == NULL)) {
        goto fail;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *f = frozen_arg(PyTuple_GET_ITEM(args, i), structures, i, NULL);
        if (f == NULL) {
            goto fail;
        }
        PyTuple_SET_ITEM(*args_out, i, f);
    }
    PyObject *key, *v;
    Py_ssize_t pos = 0;
    while (kw != NULL && PyDict_Next(kw, &pos, &key, &v)) {
        PyObject *f = frozen_arg(v, structures, -1, key);
        int r = f != NULL ? PyDict_SetItem(*kw_out, key, f) : -1;
        Py_XDECREF(f);
        if (r < 0) {
            goto fail;
        }
    }
    return 0;
fail:
    Py_CLEAR(*args_out);
    Py_CLEAR(*kw_out);
    return -1;
}

/* once(m, args, kw, ctx), as dp_call_with_retry runs it. */
typedef PyObject *(*once_fn)(PyObject *m, PyObject *args, PyObject *kw, const void *ctx);

static PyObject *call_frozen_with_retry(PyObject *m, PyObject *args, PyObject *kw,
                                        once_fn once, const void *ctx,
                                        const char *torch_name, const char *const *structures)
{
    PyObject *a, *k;
    if (dp_freeze_iterators(args, kw, structures, &a, &k) < 0) {
        return NULL;
    }
    PyObject *res = once(m, a, k, ctx);
    if (res == NULL) {
        res = dp_autograd_retry(dp_state_from_module(m), torch_name, a, k);
    }
    Py_DECREF(a);
    Py_XDECREF(k);
    return res;
}

static PyObject *plain_once(PyObject *m, PyObject *args, PyObject *kw, const void *ctx)
{
    const PyCFunctionWithKeywords *fn = ctx;
    return (*fn)(m, args, kw);
}

PyObject *dp_call_with_retry(PyObject *m, PyObject *args, PyObject *kw,
                             PyCFunctionWithKeywords once, const char *torch_name,
                             const char *const *structures)
{
    return call_frozen_with_retry(m, args, kw, plain_once, &once, torch_name, structures);
}

/* An entry's steps inside its profile span. */
static PyObject *entry_once(PyObject *m, PyObject *args, PyObject *kw, const void *ctx)
{
    const dp_entry *e = ctx;
    dp_prof_span sp;
    dp_prof_begin(&sp, e->phase);
    PyObject *res = e->steps(m, args, kw);
    dp_prof_end(&sp, e->label);
    return res;
}

PyObject *dp_entry_call(PyObject *m, PyObject *args, PyObject *kw, const dp_entry *e)
{
    return call_frozen_with_retry(m, args, kw, entry_once, e, e->torch_name, e->structures);
}

static PyArrayObject *import_foreign(dp_state *st, PyObject *obj, const char *argname);

/* Is obj a tensor of a torch.func transform (grad, jacrev, vmap: a wrapper
 * with no storage of its own)? Asked only after an import failed, so the
 * fast path pays nothing. 1/0, never an exception. */
static int is_functorch_tensor(PyObject *obj)
{
    PyObject *name = PyUnicode_FromString("torch");
    PyObject *torch = name != NULL ? PyImport_GetModule(name) : NULL;   /* never imports it */
    Py_XDECREF(name);
    if (torch == NULL) {
        PyErr_Clear();
        return 0;
    }
    Py_DECREF(torch);
    PyObject *ask = dp_import_attr_quiet("torch._C._functorch", "is_functorch_wrapped_tensor");
    PyObject *r = ask != NULL ? PyObject_CallOneArg(ask, obj) : NULL;
    Py_XDECREF(ask);
    int yes = r == Py_True;
    Py_XDECREF(r);
    PyErr_Clear();
    return yes;
}

/* The pending error replaced by a TypeError that says what a torch.func
 * transform's tensor is and what to do, when obj is one. */
static void explain_functorch_tensor(PyObject *obj, const char *argname)
{
    if (!PyErr_ExceptionMatches(PyExc_Exception))
        return;   /* KeyboardInterrupt and the like as they are */
    PyObject *t, *v, *tb;
    PyErr_Fetch(&t, &v, &tb);
    if (!is_functorch_tensor(obj)) {
        PyErr_Restore(t, v, tb);
        return;
    }
    PyErr_NormalizeException(&t, &v, &tb);
    PyErr_Format(PyExc_TypeError,
                 "%s: a tensor of a torch.func transform (torch.func.grad, jacrev, vmap...): "
                 "it has no storage of its own, and dpmini copies values on its own threads, "
                 "outside the transform; apply torch.func inside the module, or to the "
                 "module itself, not around DataParallel (for gradients, call "
                 "loss.backward() on DataParallel's output)", argname);
    dp_attach_cause(v);
    Py_XDECREF(t);
    Py_XDECREF(tb);
}

/* dp_import_foreign and dp_import_foreign_detached; detach_always: a tensor
 * that requires grad is read detached whatever the grad mode. */
static PyArrayObject *import_checked(dp_state *st, PyObject *obj, const char *argname,
                                     int detach_always)
{
    if (is_jax_tracer(obj)) {
        refuse_jax_tracer(obj, argname);
        return NULL;
    }
    if (refuse_dual_tensor(obj, argname))
        return NULL;
    int rg = requires_grad(st, obj, argname);
    if (rg == 1 && detach_always) {
        PyErr_Clear();   /* requires_grad's own RequiresGradError */
        rg = 2;
    }
    PyArrayObject *a = NULL;
    if (rg == 1 || rg < 0 || refuse_lazy_bit(obj, argname))
        a = NULL;
    else if (rg == 0)
        a = import_foreign(st, obj, argname);
    else {
        PyObject *detached = PyObject_CallMethod(obj, "detach", NULL);
        if (detached != NULL) {
            a = import_foreign(st, detached, argname);
            Py_DECREF(detached);   /* the array keeps what it needs through DLPack */
        }
    }
    if (a == NULL && PyErr_Occurred())
        explain_functorch_tensor(obj, argname);
    return a;
}

PyArrayObject *dp_import_foreign(dp_state *st, PyObject *obj, const char *argname)
{
    return import_checked(st, obj, argname, 0);
}

PyArrayObject *dp_import_foreign_detached(dp_state *st, PyObject *obj, const char *argname)
{
    return import_checked(st, obj, argname, 1);
}

static PyArrayObject *import_foreign(dp_state *st, PyObject *obj, const char *argname)
{
    PyArrayObject *view = dp_torch_host_view(st, obj);   /* what DLPack gives, in C */
    if (view != NULL || PyErr_Occurred())
        return view;
    PyObject *m = PyObject_GetAttrString(obj, "__dlpack_device__");
    if (m == NULL) {
        if (!PyErr_ExceptionMatches(PyExc_AttributeError))
            return NULL;
        PyErr_Clear();   /* CUDA Array Interface only */
        return dp_device_object_meta(st, obj, argname);
    }
    PyObject *dev = PyObject_CallNoArgs(m);
    Py_DECREF(m);
    int type = 0, id = 0;
    if (dev != NULL) {
        int ok = PyTuple_Check(dev) && PyArg_ParseTuple(dev, "ii", &type, &id);
        Py_DECREF(dev);
        if (!ok) {
            if (!PyErr_Occurred())
                PyErr_SetString(PyExc_TypeError, "__dlpack_device__() did not return a "
                                "(device_type, device_id) tuple");
            raise_unreadable(obj, argname, "__dlpack_device__()");
            return NULL;
        }
    }
    else {
        if (!PyErr_ExceptionMatches(PyExc_Exception))
            return NULL;
        /* The producer cannot say where one buffer lives (a JAX array
         * sharded over several JAX devices): a host copy through
         * numpy.asarray, as the docs say, for an object with __array__
         * that gives numbers. Otherwise (or when that fails) the producer's
         * own error, re-raised naming the path and the protocol (docs/libraries.md,
         * "Probing"). */
        PyObject *t, *v, *tb;
        PyErr_Fetch(&t, &v, &tb);
        int has = dp_has_attr(obj, "__array__");
        PyArrayObject *a = has == 1 ? numpy_read(obj, "asarray", argname) : NULL;
        if (a != NULL && !PyDataType_REFCHK(PyArray_DESCR(a))) {
            Py_XDECREF(t);
            Py_XDECREF(v);
            Py_XDECREF(tb);
            return a;
        }
        Py_XDECREF(a);
        if (PyErr_Occurred() && !PyErr_ExceptionMatches(PyExc_Exception)) {
            Py_XDECREF(t);   /* KeyboardInterrupt from the fallback: as it is */
            Py_XDECREF(v);
            Py_XDECREF(tb);
            return NULL;
        }
        PyErr_Clear();
        PyErr_NormalizeException(&t, &v, &tb);
        PyObject *msg = PyUnicode_FromFormat(
            "%s: calling __dlpack_device__() of a %.100s object (to tell where its memory "
            "lives) raised %.100s: %S", argname, Py_TYPE(obj)->tp_name,
            v != NULL ? Py_TYPE(v)->tp_name : "?", v != NULL ? v : Py_None);
        PyErr_Restore(t, v, tb);
        reraise_with(st, msg);
        return NULL;
    }
    if (type == kDLCPU || type == kDLCUDAHost)
        return read_host_dlpack(st, obj, argname);   /* a view, no copy */
    if (type == kDLCUDA || type == kDLCUDAManaged)
        return dp_device_object_meta(st, obj, argname);
    PyErr_Format(PyExc_TypeError,
                 "%s: %.100s lives on DLPack device type %d (device %d); dpmini reads host "
                 "memory and CUDA device memory only", argname, Py_TYPE(obj)->tp_name, type,
                 id);
    return NULL;
}
