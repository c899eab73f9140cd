/* dist_module.c - the dpmini._dist module: the Comm type, the MPI ABI
 * guard, multi-phase init with module state, and the capsule _test_api of
 * hooks that only the test-only dpmini._testing opens (dist_test_api.h).
 *
 * Built only when mpi.h and mpi4py's headers are found (setup.py). The
 * communicator comes from mpi4py's C API (PyMPIComm_Get after
 * import_mpi4py()); dpmini works on its own duplicate of it (MPI_Comm_idup,
 * bounded by the timeout), so its messages never meet the user's.
 */
#define DIST_IMPORT_ARRAY
#include "dist.h"
#include "dist_nccl.h"
#include "dist_test_api.h"
#include <mpi4py/mpi4py.h>

#include <string.h>

typedef struct {
    PyTypeObject *Comm;
    int stuck_inits;   /* Comm() waits left unfinished (see wait_for_dup) */
} dist_state;

/* ------------------------------------------------------------------ */
/* ABI guard                                                           */
/* ------------------------------------------------------------------ */

#if defined(OPEN_MPI)
#define DIST_BUILD_FAMILY "Open MPI"
#elif defined(MPICH_VERSION) || defined(MPICH_NAME)
#define DIST_BUILD_FAMILY "MPICH"
#else
#define DIST_BUILD_FAMILY "unknown"
#endif

/* The handle ABI family named by an MPI library version string. */
static const char *family_of(const char *version)
{
    if (strstr(version, "Open MPI") != NULL)
        return "Open MPI";
    if (strstr(version, "MPICH") != NULL || strstr(version, "Intel(R) MPI") != NULL ||
        strstr(version, "MVAPICH") != NULL)
        return "MPICH";
    return "unknown";
}

/* The ABI guard: 0 when the MPI library whose version string is `theirs`
 * (mpi4py's) has the handle ABI of the mpi.h this module was built with and
 * is the library it is linked to; else -1 with ImportError. */
static int check_abi(const char *theirs)
{
    char ours[MPI_MAX_LIBRARY_VERSION_STRING + 1];
    int len = 0;
    if (MPI_Get_library_version(ours, &len) != MPI_SUCCESS)
        len = 0;
    ours[len] = '\0';
    const char *fam = family_of(theirs);
    if (strcmp(fam, DIST_BUILD_FAMILY) != 0) {
        PyErr_Format(PyExc_ImportError,
                     "dpmini._dist was built against %s's mpi.h, but mpi4py runs on a %s "
                     "library (%.80s); their MPI handles differ, so using them together "
                     "would corrupt memory. Rebuild dpmini against the MPI that mpi4py uses "
                     "(pip install --no-build-isolation --force-reinstall dpmini), or point "
                     "mpi4py at the other one (MPI4PY_LIBMPI)",
                     DIST_BUILD_FAMILY, fam, theirs);
        return -1;
    }
    size_t n = strcspn(theirs, "\n");
    if (len > 0 && (strncmp(ours, theirs, n) != 0 || strcspn(ours, "\n") != n)) {
        PyErr_Format(PyExc_ImportError,
                     "dpmini._dist is linked to one MPI library (%.80s) and mpi4py runs on "
                     "another (%.80s): two MPI libraries in one process; rebuild dpmini "
                     "against the MPI that mpi4py uses", ours, theirs);
        return -1;
    }
    return 0;
}

/* The guard at import, before any handle crosses from mpi4py. */
static int check_abi_of_mpi4py(void)
{
    PyObject *mpi = PyImport_ImportModule("mpi4py.MPI");
    PyObject *ver = mpi ? PyObject_CallMethod(mpi, "Get_library_version", NULL) : NULL;
    const char *theirs = ver ? PyUnicode_AsUTF8(ver) : NULL;
    int rc = theirs ? check_abi(theirs) : -1;
    Py_XDECREF(mpi);
    Py_XDECREF(ver);
    return rc;
}

static PyObject *build_info(PyObject *Py_UNUSED(m), PyObject *Py_UNUSED(a))
{
    char ours[MPI_MAX_LIBRARY_VERSION_STRING + 1];
    int len = 0;
    if (MPI_Get_library_version(ours, &len) != MPI_SUCCESS)
        len = 0;
    ours[len] = '\0';
    return Py_BuildValue("{s:s,s:(ii),s:s}", "family", DIST_BUILD_FAMILY, "mpi_version",
                         MPI_VERSION, MPI_SUBVERSION, "library", ours);
}

/* ------------------------------------------------------------------ */
/* Comm                                                                */
/* ------------------------------------------------------------------ */

static void free_comm(dist_comm *c)
{
    dist_gpu_free(c, 0);
    int finalized = 1;
    MPI_Finalized(&finalized);
    if (c->comm != MPI_COMM_NULL && !finalized && !c->broken)
        MPI_Comm_free(&c->comm);
    c->comm = MPI_COMM_NULL;
}

/* MPI_Comm_dup is collective and blocking: a rank that never calls init()
 * (it raised before) would leave every other rank in it forever. So:
 * MPI_Comm_idup, polled against the timeout with the GIL released (Ctrl-C
 * checked). On a timeout or an interrupt the duplication stays pending:
 * MPI may still write *out and the request cannot be freed (it is
 * erroneous for a non-blocking collective), so both are left alone for
 * good, counted in stuck_inits. MPI_Finalize does not wait on the pending
 * duplication (Open MPI 4.1, measured), so dpmini.distributed lets such a rank
 * finalize and meet there a rank that left without init, rather than
 * MPI_Abort while that rank is in MPI_Finalize (which can hang Open MPI's
 * launcher). 0, or -1 with an exception set. */
static int wait_for_dup(PyTypeObject *tp, MPI_Comm parent, double timeout, MPI_Comm *comm)
{
    MPI_Comm *out = PyMem_Malloc(sizeof(MPI_Comm));
    if (out == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    *out = MPI_COMM_NULL;
    MPI_Request req = MPI_REQUEST_NULL;
    int done = 0, rc = MPI_Comm_idup(parent, out, &req);
    if (rc != MPI_SUCCESS) {
        PyMem_Free(out);
        return dist_mpi_error(rc, "MPI_Comm_idup");
    }
    int st = dist_poll(&req, 1, &done, dist_now() + timeout);
    if (st == 0) {
        *comm = *out;
        PyMem_Free(out);
        return 0;
    }
    dist_state *ds = PyType_GetModuleState(tp);
    if (ds != NULL)
        ds->stuck_inits++;
    if (st == 1) {
        int me = -1, n = 0;
        MPI_Comm_rank(parent, &me);
        MPI_Comm_size(parent, &n);
        char secs[32];
        snprintf(secs, sizeof secs, "%g", timeout);
        PyErr_Format(PyExc_TimeoutError,
                     "dpmini.distributed.init (rank %d of %d): not every rank reached init() "
                     "within the timeout of %s s (a rank may have failed before init: see its "
                     "error in the job's output; or left without calling it); the job cannot "
                     "go on: this rank ends through MPI_Finalize, where it meets a rank that "
                     "left", me, n, secs);
    }
    return -1;   /* st == -1: an interrupt or an MPI error, already raised */
}

static PyObject *Comm_new(PyTypeObject *tp, PyObject *args, PyObject *kw)
{
    static char *kwlist[] = {"comm", "timeout", NULL};
    PyObject *obj;
    double timeout = 60.0;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "Od:Comm", kwlist, &obj, &timeout))
        return NULL;
    if (!(timeout > 0.0) || timeout > 1e9) {
        char t[32];
        snprintf(t, sizeof t, "%g", timeout);
        PyErr_Format(PyExc_ValueError, "timeout: expected seconds > 0 (and at most 1e9), got %s", t);
        return NULL;
    }
    MPI_Comm *parent = PyMPIComm_Get(obj);
    if (parent == NULL) {
        PyErr_Format(PyExc_TypeError, "comm: expected an mpi4py communicator (mpi4py.MPI.Comm), "
                     "got %.80s", Py_TYPE(obj)->tp_name);
        return NULL;
    }
    int inited = 0, finalized = 0, inter = 0;
    MPI_Initialized(&inited);
    MPI_Finalized(&finalized);
    if (!inited || finalized) {
        PyErr_SetString(PyExc_RuntimeError, "comm: MPI is not initialized (or already finalized)");
        return NULL;
    }
    if (*parent == MPI_COMM_NULL) {
        PyErr_SetString(PyExc_ValueError, "comm: MPI.COMM_NULL is not a communicator to use");
        return NULL;
    }
    MPI_Comm_test_inter(*parent, &inter);
    if (inter) {
        PyErr_SetString(PyExc_ValueError, "comm: an intercommunicator; give an intracommunicator");
        return NULL;
    }
    dist_comm *c = (dist_comm *)tp->tp_alloc(tp, 0);
    if (c == NULL)
        return NULL;
    c->comm = MPI_COMM_NULL;
    c->timeout = timeout;
    if (wait_for_dup(tp, *parent, timeout, &c->comm) < 0) {
        c->comm = MPI_COMM_NULL;
        goto fail;
    }
    MPI_Comm_set_errhandler(c->comm, MPI_ERRORS_RETURN);
    MPI_Comm_rank(c->comm, &c->rank);
    MPI_Comm_size(c->comm, &c->size);
    c->lock = PyThread_allocate_lock();
    c->peers = PyMem_Calloc((size_t)c->size, sizeof(dist_meta));
    c->reqs = PyMem_Calloc((size_t)c->size * 3, sizeof(MPI_Request));
    c->done = PyMem_Calloc((size_t)c->size * 3, sizeof(int));
    if (c->lock == NULL || c->peers == NULL || c->reqs == NULL || c->done == NULL) {
        PyErr_NoMemory();
        goto fail;
    }
    return (PyObject *)c;
fail:
    Py_DECREF(c);
    return NULL;
}

static void Comm_dealloc(dist_comm *c)
{
    PyTypeObject *tp = Py_TYPE(c);
    free_comm(c);
    if (c->lock != NULL)
        PyThread_free_lock(c->lock);
    if (!c->broken) {   /* broken: MPI may still read peers[rank] */
        PyMem_Free(c->peers);
        PyMem_Free(c->reqs);
        PyMem_Free(c->wire);
        PyMem_Free(c->wire_out);
    }
    PyMem_Free(c->done);
    tp->tp_free((PyObject *)c);
    Py_DECREF(tp);
}

static PyObject *Comm_free(dist_comm *c, PyObject *Py_UNUSED(a))
{
    free_comm(c);
    Py_RETURN_NONE;
}

static PyObject *Comm_free_gpu(dist_comm *c, PyObject *Py_UNUSED(a))
{
    dist_gpu_free(c, 0);
    Py_RETURN_NONE;
}

static PyObject *get_nccl_device(dist_comm *c, void *p)
{
    if (c->nccl == NULL)
        Py_RETURN_NONE;
    return PyLong_FromLong(c->nccl_dev);
}

static PyObject *get_nccl_broken(dist_comm *c, void *p)
{
    return PyUnicode_FromString(c->nccl_broken);
}

static PyObject *Comm_abort(dist_comm *c, PyObject *arg)
{
    int code = (int)PyLong_AsLong(arg);
    if (code == -1 && PyErr_Occurred())
        return NULL;
    MPI_Abort(c->comm != MPI_COMM_NULL ? c->comm : MPI_COMM_WORLD, code);
    Py_RETURN_NONE;   /* not reached */
}

static PyObject *get_rank(dist_comm *c, void *p) { return PyLong_FromLong(c->rank); }
static PyObject *get_size(dist_comm *c, void *p) { return PyLong_FromLong(c->size); }
static PyObject *get_calls(dist_comm *c, void *p) { return PyLong_FromLongLong(c->calls); }
static PyObject *get_broken(dist_comm *c, void *p) { return PyBool_FromLong(c->broken); }
static PyObject *get_timeout(dist_comm *c, void *p) { return PyFloat_FromDouble(c->timeout); }

static int set_timeout(dist_comm *c, PyObject *v, void *p)
{
    double t = v ? PyFloat_AsDouble(v) : -1.0;
    if (t == -1.0 && PyErr_Occurred())
        return -1;
    if (!(t > 0.0) || t > 1e9) {
        PyErr_SetString(PyExc_ValueError, "timeout: expected seconds > 0 (and finite)");
        return -1;
    }
    c->timeout = t;
    return 0;
}

static PyGetSetDef Comm_getset[] = {
    {"rank", (getter)get_rank, NULL, "This process's rank in the communicator (int).", NULL},
    {"size", (getter)get_size, NULL, "Number of ranks (int).", NULL},
    {"calls", (getter)get_calls, NULL, "Collectives called so far on this rank (int).", NULL},
    {"broken", (getter)get_broken, NULL, "True after a TimeoutError: unusable.", NULL},
    {"nccl_device", (getter)get_nccl_device, NULL,
     "The CUDA device of this rank's NCCL communicator (int), None before the first GPU\n"
     "collective (and after free_gpu() or an abort).", NULL},
    {"nccl_broken", (getter)get_nccl_broken, NULL,
     "Why GPU collectives are off on this rank (its NCCL communicator was aborted), or ''.",
     NULL},
    {"timeout", (getter)get_timeout, (setter)set_timeout,
     "Seconds each collective may wait for the other ranks (float > 0).", NULL},
    {NULL},
};

#define KW (PyCFunction)(void (*)(void))
/* Each text starts with the signature as inspect.signature shows it ("--"
 * line) so that mypy.stubtest checks dpmini/_dist.pyi against it. */
static PyMethodDef Comm_methods[] = {
    {"barrier", KW dist_barrier, METH_VARARGS | METH_KEYWORDS,
     "barrier($self, /, *, tag=None, error=None, context=None)\n--\n\n"
     "Wait for every rank (guarded)."},
    {"scatter", KW dist_scatter, METH_VARARGS | METH_KEYWORDS,
     "scatter($self, /, x, root=0, dim=0, chunk_sizes=None, weights=None, gpu=None, *, "
     "tag=None, error=None, context=None)\n--\n\n"
     "This rank's piece of root's x. gpu=(device, library, stream): a GPU array, moved by\n"
     "NCCL (off root x only names the device)."},
    {"gather", KW dist_gather, METH_VARARGS | METH_KEYWORDS,
     "gather($self, /, x, root=0, dim=0, gpu=None, *, tag=None, error=None, context=None)\n"
     "--\n\n"
     "The joined array on root, None elsewhere. gpu=(device, library, stream): x is a GPU\n"
     "array, moved by NCCL; gpu=device (int): the CUDA device of the GPU array x was staged\n"
     "from, for the guard."},
    {"all_gather", KW dist_all_gather, METH_VARARGS | METH_KEYWORDS,
     "all_gather($self, /, x, dim=0, gpu=None, *, tag=None, error=None, context=None)\n"
     "--\n\n"
     "The joined array on every rank (gpu as gather)."},
    {"broadcast", KW dist_broadcast, METH_VARARGS | METH_KEYWORDS,
     "broadcast($self, /, x, root=0, pickled=False, error=None, gpu=None, *, tag=None, "
     "context=None)\n--\n\n"
     "(root's array, root's pickled flag). gpu=(device, library, stream): x is a GPU array,\n"
     "moved by NCCL."},
    {"all_reduce", KW dist_all_reduce, METH_VARARGS | METH_KEYWORDS,
     "all_reduce($self, /, x, op='sum', gpu=None, *, tag=None, error=None, context=None)\n"
     "--\n\n"
     "The reduced array on every rank. gpu=(device, library, stream): x is a GPU array,\n"
     "reduced by NCCL."},
    {"reduce", KW dist_reduce, METH_VARARGS | METH_KEYWORDS,
     "reduce($self, /, x, root=0, op='sum', gpu=None, *, tag=None, error=None, "
     "context=None)\n--\n\n"
     "The reduced array on root, None elsewhere (gpu as all_reduce)."},
    {"free", (PyCFunction)Comm_free, METH_NOARGS,
     "free($self, /)\n--\n\n"
     "Free dpmini's duplicate communicator (and destroy its NCCL communicator)."},
    {"free_gpu", (PyCFunction)Comm_free_gpu, METH_NOARGS,
     "free_gpu($self, /)\n--\n\n"
     "Destroy this rank's NCCL communicator (ncclCommDestroy); the next GPU collective makes\n"
     "a new one on every rank. Call it on every rank, between collectives."},
    {"abort", (PyCFunction)Comm_abort, METH_O,
     "abort($self, code, /)\n--\n\n"
     "MPI_Abort the whole job with this exit code (does not return)."},
    {NULL},
};

PyDoc_STRVAR(Comm_doc,
"Comm(comm, timeout=60.0)\n--\n\n"
"dpmini's duplicate of an mpi4py intracommunicator (MPI_Comm_idup: collective, every rank\n"
"must construct it; TimeoutError when not every rank does within `timeout` seconds), with\n"
"the guarded collectives of dpmini.distributed. See that module for the API; this type is\n"
"its engine.");

static PyType_Slot Comm_slots[] = {
    {Py_tp_new, Comm_new},
    {Py_tp_dealloc, Comm_dealloc},
    {Py_tp_methods, Comm_methods},
    {Py_tp_getset, Comm_getset},
    {Py_tp_doc, (void *)Comm_doc},
    {0, NULL},
};

static PyType_Spec Comm_spec = {
    "dpmini._dist.Comm", sizeof(dist_comm), 0, Py_TPFLAGS_DEFAULT, Comm_slots,
};

/* ------------------------------------------------------------------ */
/* Module                                                              */
/* ------------------------------------------------------------------ */

/* The hooks that only dpmini._testing opens, through the capsule _test_api
 * (dist_test_api.h); this module offers no Python function for them. */
static const dist_test_api test_api = {
    .version = DIST_TEST_API_VERSION,
    .check_abi = check_abi,
    .nccl_set_emulated = dist_nccl_set_emulated,
};

static int add_test_api(PyObject *m)
{
    PyObject *cap = PyCapsule_New((void *)&test_api, DIST_TEST_API_CAPSULE, NULL);
    if (cap == NULL)
        return -1;
    int rc = PyModule_AddObjectRef(m, "_test_api", cap);
    Py_DECREF(cap);
    return rc;
}

static int dist_exec(PyObject *m)
{
    if (_import_array() < 0)
        return -1;
    if (import_mpi4py() < 0)
        return -1;
    if (check_abi_of_mpi4py() < 0 || add_test_api(m) < 0)
        return -1;
    dist_state *st = PyModule_GetState(m);
    st->Comm = (PyTypeObject *)PyType_FromModuleAndSpec(m, &Comm_spec, NULL);
    if (st->Comm == NULL || PyModule_AddObjectRef(m, "Comm", (PyObject *)st->Comm) < 0)
        return -1;
    return PyModule_AddStringConstant(m, "BUILD_FAMILY", DIST_BUILD_FAMILY);
}

static int dist_traverse(PyObject *m, visitproc visit, void *arg)
{
    dist_state *st = PyModule_GetState(m);
    Py_VISIT(st->Comm);
    return 0;
}

static int dist_clear(PyObject *m)
{
    dist_state *st = PyModule_GetState(m);
    Py_CLEAR(st->Comm);
    return 0;
}

static PyObject *stuck_inits(PyObject *m, PyObject *Py_UNUSED(a))
{
    dist_state *st = PyModule_GetState(m);
    return PyLong_FromLong(st->stuck_inits);
}

static PyObject *nccl_info(PyObject *Py_UNUSED(m), PyObject *Py_UNUSED(a))
{
    return PyUnicode_FromString(dist_nccl_describe());
}

static PyMethodDef dist_functions[] = {
    {"_stuck_inits", stuck_inits, METH_NOARGS,
     "_stuck_inits($module, /)\n--\n\n"
     "How many Comm() constructions ended (TimeoutError, interrupt) with their\n"
     "MPI_Comm_idup still pending (int); dpmini.distributed then skips the exit agreement and\n"
     "goes straight to MPI_Finalize."},
    {"nccl_info", nccl_info, METH_NOARGS,
     "nccl_info($module, /)\n--\n\n"
     "The NCCL in use for GPU arrays (str): library version and path, or the emulation, or\n"
     "'not loaded' before the first GPU collective."},
    {"split_sizes", KW dist_split_sizes, METH_VARARGS | METH_KEYWORDS,
     "split_sizes($module, /, n, size, chunk_sizes=None, weights=None)\n--\n\n"
     "The rows each of `size` ranks gets of n rows (list of ints), by plan.c's rules\n"
     "(torch.chunk's ceil(n/size) pieces, torch.split_with_sizes' check of chunk_sizes, or\n"
     "dpmini's weighted rule)."},
    {"build_info", build_info, METH_NOARGS,
     "build_info($module, /)\n--\n\n"
     "{'family', 'mpi_version', 'library'}: the MPI this module was built against and the\n"
     "library it runs on."},
    {NULL},
};

static PyModuleDef_Slot dist_slots[] = {
    {Py_mod_exec, dist_exec},
    {0, NULL},
};

static struct PyModuleDef dist_def = {
    PyModuleDef_HEAD_INIT, "dpmini._dist",
    "dpmini's MPI collectives in C (the engine of dpmini.distributed).",
    sizeof(dist_state), dist_functions, dist_slots, dist_traverse, dist_clear, NULL,
};

PyMODINIT_FUNC PyInit__dist(void)
{
    return PyModuleDef_Init(&dist_def);
}
