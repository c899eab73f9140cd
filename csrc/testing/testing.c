/* testing.c - dpmini._testing, the test-only extension (as CPython's
 * _testcapi): built only when DPMINI_TESTING=1 (setup.py; the Makefile's
 * builds set it), never imported by dpmini. It reaches _dpmini's internals
 * through one table of C function pointers, the capsule
 * dpmini._dpmini._test_api (csrc/py/test_api.h, filled in py/test_hooks.c),
 * so the hooks act on the same allocator, emulator and NCCL state as the
 * module under test. The Python functions below are the method table; each
 * wraps one entry of that table (test_api.h says how to add one).
 * The dist_* functions reach dpmini._dist's hooks the same way, through its
 * capsule dpmini._dist._test_api (csrc/dist/dist_test_api.h), imported at
 * their first call (this module also loads where _dist is not built).
 *
 * Errors: RuntimeError "not an emulated build" for an emulator hook outside
 * the emulated CUDA build; dpmini's own exceptions (CudaError, MemoryError)
 * through _dpmini's funnel; TypeError/ValueError/OverflowError for bad
 * arguments, as PyArg_ParseTuple raises them. */
#include <Python.h>

#include "test_api.h"
#include "dist_test_api.h"

typedef struct {
    PyObject *dpmini;          /* dpmini._dpmini, whose state the hooks use */
    const dp_test_api *api;    /* its capsule's table */
} testing_state;

static testing_state *state_of(PyObject *m)
{
    return (testing_state *)PyModule_GetState(m);
}

static const dp_test_api *api_of(PyObject *m)
{
    return state_of(m)->api;
}

/* NULL with RuntimeError when the build has no emulator (the hook is NULL). */
static int need_emulator(const void *hook)
{
    if (hook == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "not an emulated build (DPMINI_CUDA_EMULATE=1)");
        return -1;
    }
    return 0;
}

/* ---------------------------------------------------------- every build */

static PyObject *fail_alloc_after(PyObject *m, PyObject *arg)
{
    long n = PyLong_AsLong(arg);
    if (n == -1 && PyErr_Occurred()) {
        return NULL;
    }
    return PyLong_FromLong(api_of(m)->fail_alloc_after(n));
}

static PyObject *cache_stats(PyObject *m, PyObject *device)
{
    dp_cache_stats cs;
    if (api_of(m)->cache_stats(state_of(m)->dpmini, device, &cs) < 0) {
        return NULL;
    }
    return Py_BuildValue("{snsnsnsnsnsnsKsKsK}", "allocated", (Py_ssize_t)cs.allocated,
                         "cached", (Py_ssize_t)cs.cached, "peak", (Py_ssize_t)cs.peak,
                         "blocks", (Py_ssize_t)cs.nblocks, "limit", (Py_ssize_t)cs.limit,
                         "slack", (Py_ssize_t)cs.slack, "hits", cs.hits,
                         "misses", cs.misses, "evictions", cs.evictions);
}

static PyObject *cuda_debug(PyObject *m, PyObject *unused)
{
    dp_test_gpu_counters c;
    api_of(m)->gpu_counters(&c);
    return Py_BuildValue("{s:i,s:l,s:l,s:l,s:i,s:l,s:l,s:l,s:i}",
                         "current_device", c.current_device, "legacy_syncs", c.legacy_syncs,
                         "export_syncs", c.export_syncs,
                         "export_stream_syncs", c.export_stream_syncs,
                         "export_deferred", c.export_deferred, "nccl_calls", c.nccl_calls,
                         "nccl_destroyed", c.nccl_destroyed, "nccl_aborted", c.nccl_aborted,
                         "nccl_live_comms", c.nccl_live_comms);
}

static PyObject *nccl_dtypes(PyObject *m, PyObject *unused)
{
    static const char *names[] = {"int8", "uint8", "int16", "uint16", "int32", "uint32",
                                  "int64", "uint64", "float32", "float64", "float16"};
    _Static_assert(sizeof names / sizeof names[0] == DPC_T_NONE, "one name per DPC_T_*");
    PyObject *d = PyDict_New();
    for (int t = 0; d != NULL && t < DPC_T_NONE; t++) {
        PyObject *v = api_of(m)->nccl_supports(t) ? Py_True : Py_False;
        if (PyDict_SetItemString(d, names[t], v) < 0) {
            Py_CLEAR(d);
        }
    }
    return d;
}

static PyObject *emulated_nccl(PyObject *m, PyObject *args)
{
    int on = -1, fail_next = 0;
    if (!PyArg_ParseTuple(args, "|ii:emulated_nccl", &on, &fail_next)) {
        return NULL;
    }
    int prev = api_of(m)->nccl_emulate(on, fail_next);
    if (prev < 0) {
        return need_emulator(NULL), NULL;
    }
    return PyBool_FromLong(prev);
}

/* ------------------------------------------------- emulated build only */

static long syncs_with_gil;

/* Called by the emulator at every sync, on the syncing thread. */
static void count_gil_syncs(void)
{
    if (PyGILState_Check()) {
        __atomic_add_fetch(&syncs_with_gil, 1, __ATOMIC_RELAXED);
    }
}

static PyObject *emu_stats(PyObject *m, PyObject *unused)
{
    const dp_test_api *api = api_of(m);
    long bad, busy;
    if (need_emulator((const void *)api->emu_stats) < 0) {
        return NULL;
    }
    api->emu_set_sync_hook(count_gil_syncs); /* counted from the first call on */
    api->emu_stats(&bad, &busy);
    return Py_BuildValue("{s:l,s:l,s:l,s:l,s:l}", "bad_stream_handles", bad,
                         "freed_while_queued", busy, "nccl_crossed", api->emu_nccl_crossed(),
                         "syncs_with_gil", __atomic_load_n(&syncs_with_gil, __ATOMIC_RELAXED),
                         "launch_overlaps", api->emu_launch_overlaps());
}

/* An int argument of a hook taking one int (fault code, slot, mode). */
static int int_arg(PyObject *arg, int *out)
{
    long v = PyLong_AsLong(arg);
    if (v == -1 && PyErr_Occurred()) {
        return -1;
    }
    if (v < INT_MIN || v > INT_MAX) {
        PyErr_SetString(PyExc_OverflowError, "argument does not fit in a C int");
        return -1;
    }
    *out = (int)v;
    return 0;
}

static PyObject *emulate_fault(PyObject *m, PyObject *arg)
{
    int code;
    if (need_emulator((const void *)api_of(m)->emu_inject_fault) < 0 || int_arg(arg, &code) < 0) {
        return NULL;
    }
    api_of(m)->emu_inject_fault(code);
    Py_RETURN_NONE;
}

static PyObject *emu_fail_stream_get(PyObject *m, PyObject *arg)
{
    int slot;
    if (need_emulator((const void *)api_of(m)->emu_fail_stream_get) < 0 ||
        int_arg(arg, &slot) < 0) {
        return NULL;
    }
    api_of(m)->emu_fail_stream_get(slot);
    Py_RETURN_NONE;
}

static PyObject *emu_nccl_hang(PyObject *m, PyObject *arg)
{
    int mode;
    if (need_emulator((const void *)api_of(m)->emu_nccl_hang) < 0 || int_arg(arg, &mode) < 0) {
        return NULL;
    }
    api_of(m)->emu_nccl_hang(mode);
    Py_RETURN_NONE;
}

static PyObject *emu_nopeer_alloc(PyObject *m, PyObject *args)
{
    const dp_test_api *api = api_of(m);
    int dev;
    Py_buffer b;
    void *p = NULL;
    if (need_emulator((const void *)api->emu_nopeer_fill) < 0 ||
        !PyArg_ParseTuple(args, "iy*:emu_nopeer_alloc", &dev, &b)) {
        return NULL;
    }
    dpc_status st = api->emu_nopeer_fill(dev, b.buf, (size_t)b.len, &p);
    PyBuffer_Release(&b);
    if (st.code != 0) {
        return api->raise_status(state_of(m)->dpmini, st, "emu_nopeer_alloc"), NULL;
    }
    return PyLong_FromVoidPtr(p);
}

static PyObject *emu_free(PyObject *m, PyObject *args)
{
    const dp_test_api *api = api_of(m);
    int dev;
    PyObject *ptr;
    if (need_emulator((const void *)api->emu_free) < 0 ||
        !PyArg_ParseTuple(args, "iO:emu_free", &dev, &ptr)) {
        return NULL;
    }
    void *p = PyLong_AsVoidPtr(ptr);
    if (p == NULL && PyErr_Occurred()) {
        return NULL;
    }
    dpc_status st = api->emu_free(dev, p);
    if (st.code != 0) {
        return api->raise_status(state_of(m)->dpmini, st, "emu_free"), NULL;
    }
    Py_RETURN_NONE;
}

static PyObject *emu_contexts(PyObject *m, PyObject *unused)
{
    int devs[64];
    if (need_emulator((const void *)api_of(m)->emu_contexts) < 0) {
        return NULL;
    }
    int n = api_of(m)->emu_contexts(devs, 64);
    PyObject *l = PyList_New(n);
    for (int i = 0; l != NULL && i < n; i++) {
        PyObject *v = PyLong_FromLong(devs[i]);
        if (v == NULL) {
            Py_CLEAR(l);
            break;
        }
        PyList_SET_ITEM(l, i, v);
    }
    return l;
}

/* A device range given as ints: address and nbytes >= 0. */
static int range_arg(PyObject *ptr, Py_ssize_t n, void **p)
{
    *p = PyLong_AsVoidPtr(ptr);
    if (*p == NULL && PyErr_Occurred()) {
        return -1;
    }
    if (n < 0) {
        PyErr_SetString(PyExc_ValueError, "nbytes must be >= 0");
        return -1;
    }
    return 0;
}

static PyObject *emu_queue(PyObject *m, PyObject *args)
{
    int dev;
    PyObject *stream, *ptr;
    Py_ssize_t n;
    void *p, *s;
    if (need_emulator((const void *)api_of(m)->emu_queue) < 0 ||
        !PyArg_ParseTuple(args, "iOOn:emu_queue", &dev, &stream, &ptr, &n) ||
        range_arg(ptr, n, &p) < 0) {
        return NULL;
    }
    s = PyLong_AsVoidPtr(stream);
    if (s == NULL && PyErr_Occurred()) {
        return NULL;
    }
    api_of(m)->emu_queue(dev, s, p, (size_t)n);
    Py_RETURN_NONE;
}

static PyObject *emu_busy(PyObject *m, PyObject *args)
{
    PyObject *ptr;
    Py_ssize_t n;
    void *p;
    if (need_emulator((const void *)api_of(m)->emu_busy) < 0 ||
        !PyArg_ParseTuple(args, "On:emu_busy", &ptr, &n) || range_arg(ptr, n, &p) < 0) {
        return NULL;
    }
    return PyBool_FromLong(api_of(m)->emu_busy(p, (size_t)n));
}

static PyObject *emu_destroy_stream(PyObject *m, PyObject *arg)
{
    if (need_emulator((const void *)api_of(m)->emu_destroy_stream) < 0) {
        return NULL;
    }
    void *s = PyLong_AsVoidPtr(arg);
    if (s == NULL && PyErr_Occurred()) {
        return NULL;
    }
    api_of(m)->emu_destroy_stream(s);
    Py_RETURN_NONE;
}

/* ------------------------------------------------- dpmini._dist's hooks */

/* The table of dpmini._dist (dist_test_api.h), imported at the first call of
 * a dist_* hook rather than with this module, which loads where _dist is not
 * built; NULL with the ImportError when it is not. */
static const dist_test_api *dist_api(void)
{
    PyObject *dist = PyImport_ImportModule("dpmini._dist");
    PyObject *cap = dist != NULL ? PyObject_GetAttrString(dist, "_test_api") : NULL;
    if (dist != NULL && cap == NULL && PyErr_ExceptionMatches(PyExc_AttributeError)) {
        PyErr_Format(PyExc_ImportError, "dpmini._dist (%R) has no test hooks (_test_api): "
                     "it is another build than dpmini._testing; rebuild both", dist);
    }
    const dist_test_api *t = cap != NULL ? PyCapsule_GetPointer(cap, DIST_TEST_API_CAPSULE)
                                         : NULL;
    Py_XDECREF(cap);   /* the module keeps the table alive: it is static storage */
    Py_XDECREF(dist);
    if (t != NULL && t->version != DIST_TEST_API_VERSION) {
        PyErr_Format(PyExc_ImportError, "dpmini._testing was built for dpmini._dist's test "
                     "API version %d, dpmini._dist has %d: rebuild both",
                     DIST_TEST_API_VERSION, t->version);
        return NULL;
    }
    return t;
}

static PyObject *dist_check_abi(PyObject *m, PyObject *arg)
{
    const char *version = PyUnicode_AsUTF8(arg);
    const dist_test_api *t = version != NULL ? dist_api() : NULL;
    if (t == NULL || t->check_abi(version) < 0) {
        return NULL;
    }
    Py_RETURN_NONE;
}

static PyObject *dist_nccl_emulate(PyObject *m, PyObject *arg)
{
    int on = PyObject_IsTrue(arg);
    const dist_test_api *t = on >= 0 ? dist_api() : NULL;
    if (t == NULL || t->nccl_set_emulated(on) < 0) {
        return NULL;
    }
    Py_RETURN_NONE;
}

/* ------------------------------------------------------------ the table */

static PyMethodDef testing_methods[] = {
    {"fail_alloc_after", fail_alloc_after, METH_O,
     "fail_alloc_after(n) -> int\n\nLet n more host and virtual-CPU device allocations succeed, "
     "then fail the next one (MemoryError); n < 0 turns it off. Returns the previous count "
     "(-1 when none was pending, e.g. once the failure has fired)."},
    {"cache_stats", cache_stats, METH_O,
     "cache_stats(device) -> dict\n\nThe caching allocator's counters of a host or virtual CPU "
     "device: allocated, cached, peak, limit, slack (bytes), blocks (cached), hits, misses, "
     "evictions. Errors: as dpmini.memory_allocated; ValueError for a CUDA device."},
    {"cuda_debug", cuda_debug, METH_NOARGS,
     "cuda_debug() -> dict\n\nThe calling thread's current CUDA device and dpmini's sync and "
     "NCCL counters (nccl_live_comms is -1 outside the emulated build)."},
    {"nccl_dtypes", nccl_dtypes, METH_NOARGS,
     "nccl_dtypes() -> dict\n\nWhich reduce_add dtypes dpmini hands to NCCL (name -> bool)."},
    {"emulated_nccl", emulated_nccl, METH_VARARGS,
     "emulated_nccl(on=-1, fail_next=0) -> bool\n\nEmulated build: the stand-in NCCL on (1), "
     "off (0) or unchanged (-1); fail_next != 0 makes the next group fail with that "
     "ncclResult_t. Returns whether it was on."},
    {"emulate_fault", emulate_fault, METH_O,
     "emulate_fault(code)\n\nEmulated build: the next copy or kernel fails with this CUDA code."},
    {"emu_stats", emu_stats, METH_NOARGS,
     "emu_stats() -> dict\n\nEmulated build: bad_stream_handles (uses of poisoned handles), "
     "freed_while_queued (blocks cached while queued work touched them), nccl_crossed "
     "(collectives of different communicator sets at once on one device), syncs_with_gil "
     "(counted from the first emu_stats() call on), launch_overlaps (device calls of another "
     "thread during an NCCL launch)."},
    {"emu_fail_stream_get", emu_fail_stream_get, METH_O,
     "emu_fail_stream_get(slot)\n\nEmulated build: the next stream request of this slot fails."},
    {"emu_nopeer_alloc", emu_nopeer_alloc, METH_VARARGS,
     "emu_nopeer_alloc(dev, data) -> int\n\nEmulated build: address of device memory that "
     "peer access does not cover (VMM, async pool, IPC), holding data's bytes."},
    {"emu_free", emu_free, METH_VARARGS,
     "emu_free(dev, address)\n\nEmulated build: frees emu_nopeer_alloc's memory."},
    {"emu_nccl_hang", emu_nccl_hang, METH_O,
     "emu_nccl_hang(mode)\n\nEmulated build: the next NCCL collective never finishes (1: with "
     "an asynchronous error, 2: silently)."},
    {"emu_contexts", emu_contexts, METH_NOARGS,
     "emu_contexts() -> list[int]\n\nEmulated build: sorted devices whose CUDA context exists."},
    {"emu_queue", emu_queue, METH_VARARGS,
     "emu_queue(dev, stream, address, nbytes)\n\nEmulated build: another library's kernel "
     "queued on `stream` (any handle) touching the range, pending until that stream or the "
     "device is synced."},
    {"emu_busy", emu_busy, METH_VARARGS,
     "emu_busy(address, nbytes) -> bool\n\nEmulated build: whether queued work still touches "
     "the range."},
    {"emu_destroy_stream", emu_destroy_stream, METH_O,
     "emu_destroy_stream(stream)\n\nEmulated build: another library destroyed that stream "
     "handle; later uses of it are counted as bad handles."},
    {"dist_check_abi", dist_check_abi, METH_O,
     "dist_check_abi(library_version)\n\ndpmini._dist's ABI guard on another MPI library "
     "version string: None when it has the handle ABI of the mpi.h _dist was built with and "
     "is the library _dist is linked to, else ImportError saying which is which. ImportError "
     "too when dpmini._dist is not built."},
    {"dist_nccl_emulate", dist_nccl_emulate, METH_O,
     "dist_nccl_emulate(on)\n\nBefore the first GPU collective of dpmini.distributed: NCCL "
     "emulated over MPI on host memory (csrc/dist/dist_nccl_emu.c) when on is true, else the "
     "real libnccl, instead of the choice of dpmini.distributed._nccl_wants_emulation. "
     "RuntimeError once the other one is in use; ImportError when dpmini._dist is not built."},
    {NULL},
};

/* ------------------------------------------------------------- the module */

static int testing_exec(PyObject *m)
{
    testing_state *st = state_of(m);
    st->dpmini = PyImport_ImportModule("dpmini._dpmini");
    if (st->dpmini == NULL) {
        return -1;
    }
    PyObject *cap = PyObject_GetAttrString(st->dpmini, "_test_api");
    if (cap == NULL) {
        return -1;
    }
    st->api = (const dp_test_api *)PyCapsule_GetPointer(cap, DP_TEST_API_CAPSULE);
    Py_DECREF(cap);
    if (st->api == NULL) {
        return -1;
    }
    if (st->api->version != DP_TEST_API_VERSION) {
        PyErr_Format(PyExc_ImportError, "dpmini._testing was built for test API version %d, "
                     "dpmini._dpmini has %d: rebuild both", DP_TEST_API_VERSION,
                     st->api->version);
        return -1;
    }
    return 0;
}

static int testing_traverse(PyObject *m, visitproc visit, void *arg)
{
    Py_VISIT(state_of(m)->dpmini);
    return 0;
}

static int testing_clear(PyObject *m)
{
    Py_CLEAR(state_of(m)->dpmini);
    return 0;
}

static void testing_free(void *m)
{
    testing_clear((PyObject *)m);
}

static PyModuleDef_Slot testing_slots[] = {
    {Py_mod_exec, testing_exec},
    {0, NULL},
};

static struct PyModuleDef testing_def = {
    PyModuleDef_HEAD_INIT,
    .m_name = "dpmini._testing",
    .m_doc = "Test hooks into dpmini._dpmini (allocation failures, allocator counters, the CUDA "
             "emulator's fault injection) and dpmini._dist (its ABI guard, the NCCL emulation "
             "switch): for dpmini's own tests only, not API; built when DPMINI_TESTING=1.",
    .m_size = sizeof(testing_state),
    .m_methods = testing_methods,
    .m_slots = testing_slots,
    .m_traverse = testing_traverse,
    .m_clear = testing_clear,
    .m_free = testing_free,
};

PyMODINIT_FUNC PyInit__testing(void)
{
    return PyModuleDef_Init(&testing_def);
}
