/* state.c - the module state of dpmini._dpmini: its PyModuleDef (size and
 * GC hooks; the exec slot is the top layer's, csrc/module/module.c, which
 * sets m_slots in PyInit__dpmini), the lookups of the state from a module or
 * a type, and the NumPy C-API table that every other file imports. */
#define DP_IMPORT_ARRAY
#include "dpmini.h"

/* ------------------------------------------------------------------ */
/* State lookup                                                        */
/* ------------------------------------------------------------------ */

dp_state *dp_state_from_module(PyObject *module)
{
    return (dp_state *)PyModule_GetState(module);
}

dp_state *dp_state_from_type(PyTypeObject *tp)
{
#if PY_VERSION_HEX >= 0x030B0000
    PyObject *m = PyType_GetModuleByDef(tp, &dp_module_def);
    if (m == NULL) {
        return NULL;
    }
    return (dp_state *)PyModule_GetState(m);
#else
    /* Python 3.10: walk the MRO to the first heap type that dpmini made. */
    PyObject *mro = tp->tp_mro;
    Py_ssize_t n = mro ? PyTuple_GET_SIZE(mro) : 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyTypeObject *base = (PyTypeObject *)PyTuple_GET_ITEM(mro, i);
        if (!(base->tp_flags & Py_TPFLAGS_HEAPTYPE)) {
            continue;
        }
        PyObject *m = PyType_GetModule(base);
        if (m != NULL && PyModule_GetDef(m) == &dp_module_def) {
            return (dp_state *)PyModule_GetState(m);
        }
        PyErr_Clear();
    }
    PyErr_SetString(PyExc_TypeError, "type is not a dpmini type");
    return NULL;
#endif
}

int dp_import_numpy(void)
{
    return _import_array();
}

/* ------------------------------------------------------------------ */
/* GC hooks and the module definition                                  */
/* ------------------------------------------------------------------ */

static int dp_traverse(PyObject *m, visitproc visit, void *arg)
{
    dp_state *st = dp_state_from_module(m);
    Py_VISIT(st->DeviceType);
    Py_VISIT(st->BufferType);
    Py_VISIT(st->DataParallelType);
    Py_VISIT(st->ArrayType);
    Py_VISIT(st->HostDLPackType);
    Py_VISIT(st->DPError);
    Py_VISIT(st->CudaError);
    Py_VISIT(st->NcclError);
    Py_VISIT(st->SplitWarning);
    Py_VISIT(st->ZeroDimError);
    Py_VISIT(st->RequiresGradError);
    Py_VISIT(st->copy_copy);
    Py_VISIT(st->dataclasses_fields);
    Py_VISIT(st->format_exception);
    Py_VISIT(st->KeyErrorMessage);
    Py_VISIT(st->origins);
    Py_VISIT(st->torch_host);
    Py_VISIT(st->numpy_handlers);
    Py_VISIT(st->replica_contexts);
    Py_VISIT(st->park_openmp_type);
    Py_VISIT(st->park_openmp_prepare);
    return 0;
}

static int dp_clear(PyObject *m)
{
    dp_state *st = dp_state_from_module(m);
    Py_CLEAR(st->DeviceType);
    Py_CLEAR(st->BufferType);
    Py_CLEAR(st->DataParallelType);
    Py_CLEAR(st->ArrayType);
    Py_CLEAR(st->HostDLPackType);
    Py_CLEAR(st->DPError);
    Py_CLEAR(st->CudaError);
    Py_CLEAR(st->NcclError);
    Py_CLEAR(st->SplitWarning);
    Py_CLEAR(st->ZeroDimError);
    Py_CLEAR(st->RequiresGradError);
    Py_CLEAR(st->copy_copy);
    Py_CLEAR(st->dataclasses_fields);
    Py_CLEAR(st->format_exception);
    Py_CLEAR(st->KeyErrorMessage);
    Py_CLEAR(st->origins);
    Py_CLEAR(st->torch_host);
    Py_CLEAR(st->numpy_handlers);
    Py_CLEAR(st->replica_contexts);
    Py_CLEAR(st->park_openmp_type);
    Py_CLEAR(st->park_openmp_prepare);
    return 0;
}

static void dp_free(void *m)
{
    dp_clear((PyObject *)m);
}

struct PyModuleDef dp_module_def = {
    PyModuleDef_HEAD_INIT,
    .m_name = "dpmini._dpmini",
    .m_doc = "C core of dpmini: PyTorch-exact DataParallel scatter/gather for NumPy arrays.",
    .m_size = sizeof(dp_state),
    .m_slots = NULL,  /* dp_exec's slots: set by PyInit__dpmini (module/module.c) */
    .m_traverse = dp_traverse,
    .m_clear = dp_clear,
    .m_free = dp_free,
};
