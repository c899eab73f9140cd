/* module.c - the dpmini._dpmini module's init, the top layer (csrc/module/,
 * above dp/): the exec slot of multi-phase init makes the exception types
 * and the heap types, fills the module state (py/state.c keeps its
 * definition, lookups and GC hooks) and adds the method tables of every
 * layer. Nothing calls into this file but Python's import. */
#include "dpmini.h"
#include "engine.h"
#include "walk.h"
#include "dp.h"
#include "pool.h"
#include "cuda_api.h"
#include "test_api.h"

/* capi.c: the C API capsule for dpmini._dist (_C_API). */
int dp_capi_add(PyObject *m);

/* ------------------------------------------------------------------ */
/* Init                                                                */
/* ------------------------------------------------------------------ */

static int add_type(PyObject *m, PyType_Spec *spec, PyObject *base,
                    PyTypeObject **slot)
{
    PyObject *tp = PyType_FromModuleAndSpec(m, spec, base);
    if (tp == NULL) {
        return -1;
    }
    *slot = (PyTypeObject *)tp;
    const char *dot = strrchr(spec->name, '.');
    const char *name = dot ? dot + 1 : spec->name;
    return PyModule_AddObjectRef(m, name, tp);
}

static int add_exception(PyObject *m, const char *qualname, PyObject *base,
                         const char *doc, PyObject **slot)
{
    /* .status: the library's status code (CUDA or NCCL), None otherwise. */
    PyObject *dict = Py_BuildValue("{sO}", "status", Py_None);
    if (dict == NULL) {
        return -1;
    }
    PyObject *exc = PyErr_NewExceptionWithDoc(qualname, doc, base, dict);
    Py_DECREF(dict);
    if (exc == NULL) {
        return -1;
    }
    *slot = exc;
    const char *dot = strrchr(qualname, '.');
    return PyModule_AddObjectRef(m, dot + 1, exc);
}

/* dpmini.ZeroDimError: a ValueError (dpmini's kind of caller mistake) that is
 * also a RuntimeError (what torch.chunk raises for it), so that code written
 * for either catches it. */
static int add_zero_dim_error(PyObject *m, dp_state *st)
{
    PyObject *bases = PyTuple_Pack(2, PyExc_ValueError, PyExc_RuntimeError);
    if (bases == NULL) {
        return -1;
    }
    int rc = add_exception(m, "dpmini.ZeroDimError", bases,
                           "A 0-dim array (one value, no dimension) was to be split: PyTorch's\n"
                           "\"chunk expects at least a 1-dimensional tensor\" (docs/spec.md 10.3),\n"
                           "raised before any copy and naming the argument's path. Both a\n"
                           "ValueError and a RuntimeError (torch.chunk's type).",
                           &st->ZeroDimError);
    Py_DECREF(bases);
    return rc;
}

/* _test_api: the capsule of test hooks that only dpmini._testing opens
 * (py/test_api.h); the module itself offers no Python function for them. */
static int add_test_api(PyObject *m)
{
    PyObject *cap = PyCapsule_New((void *)&dp_test_api_table, DP_TEST_API_CAPSULE, NULL);
    if (cap == NULL) {
        return -1;
    }
    int rc = PyModule_AddObjectRef(m, "_test_api", cap);
    Py_DECREF(cap);
    return rc;
}

static PyObject *import_attr(const char *module, const char *attr)
{
    PyObject *mod = PyImport_ImportModule(module);
    if (mod == NULL) {
        return NULL;
    }
    PyObject *res = PyObject_GetAttrString(mod, attr);
    Py_DECREF(mod);
    return res;
}

/* dpmini._dpmini._KeyErrorMessage: a str whose repr() is itself, so that
 * str(KeyError(msg)) shows a replica's traceback unquoted (PyTorch's
 * torch._utils.KeyErrorMessage). Made once, reachable by name for pickle. */
static int add_keyerror_message(PyObject *m, PyObject **slot)
{
    PyObject *str_str = PyObject_GetAttrString((PyObject *)&PyUnicode_Type, "__str__");
    if (str_str == NULL) {
        return -1;
    }
    PyObject *ns = Py_BuildValue(
        "{sOssssss}", "__repr__", str_str, "__module__", "dpmini._dpmini",
        "__qualname__", "_KeyErrorMessage",
        "__doc__", "str subclass whose repr() is the text itself (for KeyError messages).");
    Py_DECREF(str_str);
    if (ns == NULL) {
        return -1;
    }
    PyObject *tp = PyObject_CallFunction((PyObject *)&PyType_Type, "s(O)O", "_KeyErrorMessage",
                                         (PyObject *)&PyUnicode_Type, ns);
    Py_DECREF(ns);
    if (tp == NULL) {
        return -1;
    }
    *slot = tp;
    return PyModule_AddObjectRef(m, "_KeyErrorMessage", tp);
}

/* dpmini._dpmini.comm: a module object holding the torch.cuda.comm
 * counterparts, named as in PyTorch, with __module__ 'dpmini.comm' (which
 * re-exports them) and the main module as their self (for the state). */
static int add_comm_submodule(PyObject *m)
{
    PyObject *sub = PyModule_New("dpmini.comm");
    PyObject *modname = PyUnicode_FromString("dpmini.comm");
    int rc = -1;
    if (sub == NULL || modname == NULL ||
        PyModule_SetDocString(sub, "torch.cuda.comm for NumPy arrays on dpmini devices "
                                   "(docs/spec.md 8); see each function's docstring.") < 0) {
        goto done;
    }
    for (PyMethodDef *def = dp_comm_submodule_methods; def->ml_name != NULL; def++) {
        PyObject *fn = PyCFunction_NewEx(def, m, modname);
        if (fn == NULL || PyModule_AddObjectRef(sub, def->ml_name, fn) < 0) {
            Py_XDECREF(fn);
            goto done;
        }
        Py_DECREF(fn);
    }
    rc = PyModule_AddObjectRef(m, "comm", sub);
done:
    Py_XDECREF(sub);
    Py_XDECREF(modname);
    return rc;
}

static int dp_exec(PyObject *m)
{
    dp_state *st = dp_state_from_module(m);

    st->copy_to_device = dp_copy_to_device;   /* py/ copies through the engine */
    if (dp_import_numpy() < 0) {
        return -1;
    }
    if (add_exception(m, "dpmini.DPError", PyExc_Exception,
                      "Base of dpmini's own failures (device, CUDA, NCCL); caller mistakes are\n"
                      "ValueError, TypeError, IndexError or BufferError instead.\n"
                      "Attribute .status: the failing library's own status code as an int\n"
                      "(cudaError_t for CudaError, ncclResult_t for NcclError, e.g. 2 for\n"
                      "cudaErrorMemoryAllocation), or None (the class default) when no library\n"
                      "code applies. Instances pickle with their message and status.",
                      &st->DPError) < 0 ||
        add_exception(m, "dpmini.CudaError", st->DPError,
                      "A CUDA runtime call failed; the message names the call and the device.",
                      &st->CudaError) < 0 ||
        add_exception(m, "dpmini.NcclError", st->DPError,
                      "An NCCL call failed; the message names the call and the devices.",
                      &st->NcclError) < 0 ||
        add_exception(m, "dpmini.SplitWarning", PyExc_UserWarning,
                      "A split array has rows after its first k chunks (k: the smallest "
                      "chunk count over the split arrays), and they were dropped (PyTorch "
                      "drops them silently, docs/spec.md 3.2). strict=True raises ValueError "
                      "instead, on exactly the same condition.",
                      &st->SplitWarning) < 0 ||
        add_zero_dim_error(m, st) < 0 ||
        add_exception(m, "dpmini._dpmini._RequiresGradError", PyExc_TypeError,
                      "A torch tensor that requires grad, met with grad mode on by a step\n"
                      "that cannot record autograd (internal: the module-level functions\n"
                      "catch it and run their differentiable form in dpmini._torch).",
                      &st->RequiresGradError) < 0) {
        return -1;
    }
    if (add_type(m, &dp_device_spec, NULL, &st->DeviceType) < 0 ||
        add_type(m, &dp_buffer_spec, NULL, &st->BufferType) < 0 ||
        add_type(m, &dp_dataparallel_spec, NULL, &st->DataParallelType) < 0 ||
        add_type(m, &dp_array_spec, NULL, &st->ArrayType) < 0) {
        return -1;
    }
    /* internal (not a module attribute): interop_origin.c hands it out */
    st->HostDLPackType = (PyTypeObject *)PyType_FromModuleAndSpec(m, &dp_host_dlpack_spec,
                                                                  NULL);
    if (st->HostDLPackType == NULL) {
        return -1;
    }
    st->copy_copy = import_attr("copy", "copy");
    st->dataclasses_fields = import_attr("dataclasses", "fields");
    st->format_exception = import_attr("traceback", "format_exception");
    if (st->copy_copy == NULL || st->dataclasses_fields == NULL ||
        st->format_exception == NULL ||
        add_keyerror_message(m, &st->KeyErrorMessage) < 0) {
        return -1;
    }
    if (PyModule_AddFunctions(m, dp_device_methods) < 0 ||
        PyModule_AddFunctions(m, dp_comm_methods) < 0 ||
        PyModule_AddFunctions(m, dp_scatter_methods) < 0 ||
        PyModule_AddFunctions(m, dp_gather_methods) < 0 ||
        PyModule_AddFunctions(m, dp_plan_methods) < 0 ||
        PyModule_AddFunctions(m, dp_replicate_methods) < 0 ||
        PyModule_AddFunctions(m, dp_parallel_apply_methods) < 0 ||
        PyModule_AddFunctions(m, dp_replica_context_methods) < 0 ||
        PyModule_AddFunctions(m, dp_dataparallel_methods) < 0 ||
        PyModule_AddFunctions(m, dp_array_methods) < 0 ||
        add_test_api(m) < 0 ||
        PyModule_AddFunctions(m, dp_profile_methods) < 0 ||
        add_comm_submodule(m) < 0 || dp_capi_add(m) < 0) {
        return -1;
    }
    if (PyModule_AddIntConstant(m, "MAX_DEVICES", DP_POOL_MAX_INDEX) < 0 ||
        /* has_cuda: this build runs GPU code (real CUDA, or the emulator);
         * cuda_backend says which ("cuda", "emulated", "none"). */
        PyModule_AddIntConstant(m, "has_cuda", strcmp(dpc_backend(), "none") != 0) < 0 ||
        PyModule_AddStringConstant(m, "cuda_backend", dpc_backend()) < 0) {
        return -1;
    }
    return 0;
}

static PyModuleDef_Slot dp_slots[] = {
    {Py_mod_exec, dp_exec},
    {0, NULL},
};

PyMODINIT_FUNC PyInit__dpmini(void)
{
    dp_module_def.m_slots = dp_slots; /* the same table on every call */
    return PyModuleDef_Init(&dp_module_def);
}
