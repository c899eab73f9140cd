/* dist_gpu.c - all_reduce, reduce and broadcast of GPU arrays through NCCL
 * (dist_nccl.h's table: the real library or its emulation).
 *
 * A GPU array is read through its __cuda_array_interface__ (pointer,
 * shape, typestr, strides: C-contiguous only); the wrapper names its CUDA
 * device, its library and the library's current stream. Every call runs
 * the same guard as the host collectives first (dist_guard.c: kind, shape,
 * dtype, op, root and the device kind), then, on every rank at the same
 * call:
 *   1. this rank's NCCL communicator, made at the first GPU collective:
 *      every rank loads NCCL, sets its device and sends (ok, host name,
 *      device, PCI bus id, largest 2D copy pitch, error) to every rank
 *      (MPI_Iallgather, polled against the deadline); a failure anywhere is
 *      the same RuntimeError everywhere, two ranks on one GPU (one PCI bus
 *      id on one host: with a per-rank CUDA_VISIBLE_DEVICES every rank may
 *      call its GPU cuda:0) the same ValueError everywhere (NCCL refuses
 *      that); then rank 0's ncclGetUniqueId is broadcast over MPI and
 *      every rank calls ncclCommInitRank, polled against the deadline
 *      (a TimeoutError, GPU collectives off, when a rank never connects).
 *   2. the NCCL call queued on the stream with the communicator's device
 *      current (stream 0 is the legacy stream of the current device, and
 *      the caller's may be another), and its completion polled with
 *      cudaStreamQuery and ncclCommGetAsyncError against the deadline, with
 *      the GIL released (taken back every 50 ms for signal handlers). An
 *      NCCL error, a timeout or a KeyboardInterrupt aborts the NCCL
 *      communicator (ncclCommAbort) and turns GPU collectives off on this
 *      rank (host collectives keep working: no MPI message is in flight).
 * The result is a new array of the caller's library on the same device,
 * allocated by dpmini.distributed._gpu_alloc, complete when returned.
 * Reductions need an NCCL dtype; broadcast (and dist_gpu_move.c) move
 * bytes, any dtype.
 */
#include "dist.h"
#include "dist_nccl.h"

#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

/* ------------------------------------------------------------------ */
/* Reading GPU arrays                                                  */
/* ------------------------------------------------------------------ */

/* The NCCL type of a typestr ("<f4"), or -1. */
static int nccl_type_of(const char *ts)
{
    if (strlen(ts) < 3 || (ts[0] != '<' && ts[0] != '|'))
        return -1;
    int size = atoi(ts + 2);
    switch (ts[1]) {
    case 'i': return size == 1 ? NCCL_T_INT8 : size == 4 ? NCCL_T_INT32 : size == 8 ? NCCL_T_INT64 : -1;
    case 'u': return size == 1 ? NCCL_T_UINT8 : size == 4 ? NCCL_T_UINT32 : size == 8 ? NCCL_T_UINT64 : -1;
    case 'f': return size == 2 ? NCCL_T_FLOAT16 : size == 4 ? NCCL_T_FLOAT32 : size == 8 ? NCCL_T_FLOAT64 : -1;
    default: return -1;
    }
}

static PyObject *cai_item(PyObject *cai, const char *key, const char *path)
{
    PyObject *v = PyDict_Check(cai) ? PyDict_GetItemString(cai, key) : NULL;   /* borrowed */
    if (v == NULL)
        PyErr_Format(PyExc_TypeError, "%s: __cuda_array_interface__ lacks '%s'", path, key);
    return v;
}

/* Pointer, shape, typestr of `obj`'s CAI into m / *ptr; C-contiguous only. */
static int read_cai(PyObject *obj, const char *path, dist_meta *m, uintptr_t *ptr)
{
    PyObject *cai = PyObject_GetAttrString(obj, "__cuda_array_interface__");
    if (cai == NULL)
        return -1;
    int rc = -1;
    PyObject *shape = cai_item(cai, "shape", path);
    PyObject *ts = shape ? cai_item(cai, "typestr", path) : NULL;
    PyObject *data = ts ? cai_item(cai, "data", path) : NULL;
    PyObject *strides = PyDict_Check(cai) ? PyDict_GetItemString(cai, "strides") : NULL;
    if (data == NULL)
        goto done;
    const char *t = PyUnicode_AsUTF8(ts);
    if (t == NULL || !PyTuple_Check(shape) || !PyTuple_Check(data) || PyTuple_GET_SIZE(data) < 1) {
        PyErr_Format(PyExc_TypeError, "%s: a malformed __cuda_array_interface__", path);
        goto done;
    }
    Py_ssize_t nd = PyTuple_GET_SIZE(shape);
    if (nd > DIST_MAX_NDIM) {
        PyErr_Format(PyExc_ValueError, "%s: %zd dimensions, at most %d", path, nd, DIST_MAX_NDIM);
        goto done;
    }
    PyArray_Descr *d = NULL;
    if (!PyArray_DescrConverter(ts, &d))
        goto done;
    m->itemsize = PyDataType_ELSIZE(d);
    snprintf(m->dtype, sizeof m->dtype, "%s", t);
    PyObject *name = PyObject_GetAttrString((PyObject *)d, "name");
    const char *nm = name ? PyUnicode_AsUTF8(name) : NULL;
    snprintf(m->dtype_name, sizeof m->dtype_name, "%s", nm ? nm : t);
    Py_XDECREF(name);
    Py_DECREF(d);
    PyErr_Clear();
    m->ndim = nd;
    int64_t expect = m->itemsize, contiguous = 1;
    for (Py_ssize_t i = nd - 1; i >= 0; i--) {
        m->shape[i] = PyLong_AsLongLong(PyTuple_GET_ITEM(shape, i));
        if (m->shape[i] < 0) {
            if (!PyErr_Occurred())
                PyErr_Format(PyExc_ValueError, "%s: a negative size in the shape", path);
            goto done;
        }
        if (strides != NULL && strides != Py_None && PyTuple_Check(strides) &&
            PyTuple_GET_SIZE(strides) == nd && m->shape[i] > 1 &&
            PyLong_AsLongLong(PyTuple_GET_ITEM(strides, i)) != expect)
            contiguous = 0;
        expect *= m->shape[i];
    }
    if (PyErr_Occurred())
        goto done;
    if (!contiguous) {
        PyErr_Format(PyExc_ValueError, "%s: a non-contiguous GPU array; NCCL reads contiguous "
                     "memory: pass a contiguous copy (x.contiguous() in PyTorch, "
                     "cupy.ascontiguousarray(x))", path);
        goto done;
    }
    *ptr = (uintptr_t)PyLong_AsVoidPtr(PyTuple_GET_ITEM(data, 0));
    rc = PyErr_Occurred() ? -1 : 0;
done:
    Py_DECREF(cai);
    return rc;
}

/* A new C-contiguous array of `lib` shaped like m's array, on cuda:dev
 * (dpmini.distributed._gpu_alloc), and its device pointer. */
PyObject *dist_gpu_alloc(const char *lib, const dist_meta *m, int dev, uintptr_t *ptr)
{
    PyObject *mod = PyImport_ImportModule("dpmini.distributed");
    PyObject *fn = mod ? PyObject_GetAttrString(mod, "_gpu_alloc") : NULL;
    PyObject *shape = PyTuple_New((Py_ssize_t)m->ndim), *out = NULL;
    for (int64_t i = 0; shape != NULL && i < m->ndim; i++)
        PyTuple_SET_ITEM(shape, i, PyLong_FromLongLong(m->shape[i]));
    if (fn != NULL && shape != NULL && !PyErr_Occurred())
        out = PyObject_CallFunction(fn, "sOsi", lib, shape, m->dtype, dev);
    Py_XDECREF(mod);
    Py_XDECREF(fn);
    Py_XDECREF(shape);
    dist_meta scratch;
    memset(&scratch, 0, sizeof scratch);
    if (out != NULL && read_cai(out, "the result", &scratch, ptr) < 0)
        Py_CLEAR(out);
    return out;
}

int dist_gpu_read(dist_comm *c, PyObject *x, PyObject *gpu, int alloc, dist_meta *m,
                  dist_gpu_arg *g)
{
    int dev = -1;
    const char *lib = NULL;
    long long stream = 0;
    memset(g, 0, sizeof *g);
    g->obj = x;
    g->dev = -1;
    if (!PyArg_ParseTuple(gpu, "isL;gpu: expected (device, library, stream)", &dev, &lib, &stream))
        return -1;
    m->dev_kind = DIST_DEV_GPU;
    m->dev_id = dev;
    snprintf(m->lib, sizeof m->lib, "%s", lib);
    g->dev = dev;
    g->stream = (intptr_t)stream;
    if (read_cai(x, "x", m, &g->ptr) < 0)
        return -1;
    g->nccl_type = nccl_type_of(m->dtype);   /* -1: moved as bytes only */
    g->count = 1;
    for (int64_t i = 0; i < m->ndim; i++)
        g->count *= (size_t)m->shape[i];
    if (c->nccl != NULL && c->nccl_dev != dev) {
        PyErr_Format(PyExc_ValueError, "x: a GPU array on cuda:%d, but this rank's NCCL "
                     "communicator is on cuda:%d (made by its first GPU collective; NCCL uses "
                     "one GPU per rank)", dev, c->nccl_dev);
        return -1;
    }
    if (alloc && (g->out = dist_gpu_alloc(lib, m, dev, &g->out_ptr)) == NULL)
        return -1;
    return 0;
}

void dist_gpu_arg_clear(dist_gpu_arg *g)
{
    Py_CLEAR(g->out);
}

int dist_gpu_op(const dist_meta *m, int op)
{
    if (nccl_type_of(m->dtype) < 0) {
        PyErr_Format(PyExc_TypeError, "x: dtype %s of a GPU array has no NCCL reduction (NCCL "
                     "reduces int8, uint8, int32, uint32, int64, uint64, float16, bfloat16, "
                     "float32 and float64)", m->dtype_name);
        return -1;
    }
    if (op == DIST_OP_MEAN && m->dtype[1] != 'f') {
        PyErr_Format(PyExc_TypeError, "op='mean' needs a floating dtype, x has %s; use "
                     "op='sum' and divide as you want", m->dtype_name);
        return -1;
    }
    return op == DIST_OP_MEAN ? NCCL_AVG : op == DIST_OP_MAX ? NCCL_MAX
         : op == DIST_OP_MIN ? NCCL_MIN : NCCL_SUM;
}

/* ------------------------------------------------------------------ */
/* The communicator                                                    */
/* ------------------------------------------------------------------ */

typedef struct {
    int64_t ok, dev, max_pitch;
    char host[64];
    char bus_id[64];       /* cudaDeviceGetPCIBusId: one physical GPU */
    char err[256];
} peer_info;

typedef struct {
    int64_t rc;
    dist_ncclUniqueId id;
} id_msg;

/* Poll one request against the deadline; on a timeout the communicator is
 * broken (the message may still be in flight) and TimeoutError set. */
static int wait_one(dist_comm *c, MPI_Request *req, double deadline, int64_t kind)
{
    int done = 0;
    return dist_wait_data(c, req, &done, 1, deadline, c->calls, kind, NULL, NULL, NULL);
}

/* This rank's GPU as the others compare it: its PCI bus id and its
 * largest 2D copy pitch (an error in mine->err). */
static void describe_device(const dist_nccl_api *api, int dev, peer_info *mine)
{
    int pitch = 0, rc;
    if ((rc = api->DeviceGetPCIBusId(mine->bus_id, (int)sizeof mine->bus_id, dev)) != CUDA_OK)
        snprintf(mine->err, sizeof mine->err, "cudaDeviceGetPCIBusId(%d) failed: %s", dev,
                 api->CudaErrorString(rc));
    else if ((rc = api->DeviceGetAttribute(&pitch, CUDA_ATTR_MAX_PITCH, dev)) != CUDA_OK)
        snprintf(mine->err, sizeof mine->err, "cudaDeviceGetAttribute(cudaDevAttrMaxPitch, %d) "
                 "failed: %s", dev, api->CudaErrorString(rc));
    mine->bus_id[sizeof mine->bus_id - 1] = '\0';
    mine->max_pitch = pitch;
}

/* Two ranks on one physical GPU of one host: a ValueError, 0 when none. */
static int check_one_gpu_per_rank(const peer_info *all, int P)
{
    for (int r = 0; r < P; r++) {
        for (int s = r + 1; s < P; s++) {
            if (strcmp(all[r].bus_id, all[s].bus_id) == 0 && strcmp(all[r].host, all[s].host) == 0) {
                PyErr_Format(PyExc_ValueError, "dpmini.distributed: ranks %d and %d both use "
                             "GPU cuda:%lld of host %s (PCI bus id %s, as cuda:%lld on rank %d); "
                             "NCCL needs one GPU per rank (every rank raises this): give each "
                             "rank its own device, e.g. cuda:local_rank()", r, s,
                             (long long)all[r].dev, all[r].host, all[r].bus_id,
                             (long long)all[s].dev, s);
                return -1;
            }
        }
    }
    return 0;
}

int dist_gpu_enter(const dist_comm *c)
{
    const dist_nccl_api *api = dist_nccl_get();
    int prev = -1, rc = api != NULL ? api->GetDevice(&prev) : CUDA_OK;
    if (api != NULL && rc == CUDA_OK && prev != c->nccl_dev)
        rc = api->SetDevice(c->nccl_dev);
    if (api == NULL || rc != CUDA_OK) {
        if (api != NULL)
            PyErr_Format(PyExc_RuntimeError, "dpmini.distributed: could not make the NCCL "
                         "communicator's device cuda:%d current: %s", c->nccl_dev,
                         api->CudaErrorString(rc));
        return -2;
    }
    return prev;
}

void dist_gpu_leave(const dist_comm *c, int prev)
{
    const dist_nccl_api *api = dist_nccl_get();
    if (api != NULL && prev >= 0 && prev != c->nccl_dev)
        api->SetDevice(prev);
}

void dist_gpu_free(dist_comm *c, int abort)
{
    if (c->nccl == NULL)
        return;
    const dist_nccl_api *api = dist_nccl_get();
    if (api == NULL) {
        PyErr_Clear();
        return;
    }
    if (abort)
        api->CommAbort((dist_ncclComm_t)c->nccl);
    else
        api->CommDestroy((dist_ncclComm_t)c->nccl);
    c->nccl = NULL;
}

/* ncclCommInitRank blocks until every rank has connected, and a rank that
 * died never connects: it runs on a thread of its own while the caller
 * polls it against the deadline (GIL released, signal handlers run). On a
 * timeout or an interrupt the thread is abandoned: it aborts whatever
 * communicator it gets and frees its job. It takes no launch lock (an
 * abandoned thread would hold it for ever); NCCL's own set-up is all it
 * does. */
enum { INIT_RUNNING = 0, INIT_DONE = 1, INIT_ABANDONED = 2 };

typedef struct {
    const dist_nccl_api *api;
    dist_ncclUniqueId id;
    int nranks, rank, dev, rc, state;
    dist_ncclComm_t comm;
} init_job;

static void *init_thread(void *arg)
{
    init_job *j = arg;
    j->rc = j->api->SetDevice(j->dev) == CUDA_OK
            ? j->api->CommInitRank(&j->comm, j->nranks, j->id, j->rank) : NCCL_UNHANDLED_CUDA;
    if (__atomic_exchange_n(&j->state, INIT_DONE, __ATOMIC_SEQ_CST) == INIT_ABANDONED) {
        if (j->rc == NCCL_OK && j->comm != NULL)
            j->api->CommAbort(j->comm);
        free(j);
    }
    return NULL;
}

/* 0 with *comm and *rc (NCCL's result), 1 past the deadline, -1 a signal
 * handler raised (its exception set). */
static int init_rank(dist_comm *c, const dist_nccl_api *api, int dev, const id_msg *idm,
                     double deadline, dist_ncclComm_t *comm, int *rc)
{
    init_job *j = calloc(1, sizeof *j);
    pthread_t t;
    if (j == NULL) {
        *rc = NCCL_SYSTEM;
        return 0;
    }
    *j = (init_job){api, idm->id, c->size, c->rank, dev, NCCL_OK, INIT_RUNNING, NULL};
    if (pthread_create(&t, NULL, init_thread, j) != 0) {
        free(j);
        *rc = NCCL_SYSTEM;
        return 0;
    }
    pthread_detach(t);
    int pause = 0;
    double start = dist_now(), next_signals = start + 0.05;
    PyThreadState *ts = PyEval_SaveThread();
    while (__atomic_load_n(&j->state, __ATOMIC_SEQ_CST) != INIT_DONE &&
           (pause = dist_poll_pause(&ts, deadline, start, &next_signals)) == 0) {
    }
    PyEval_RestoreThread(ts);
    if (pause != 0 &&
        __atomic_exchange_n(&j->state, INIT_ABANDONED, __ATOMIC_SEQ_CST) == INIT_RUNNING)
        return pause;   /* the thread frees j when NCCL returns */
    *comm = j->comm;
    *rc = j->rc;
    free(j);
    return 0;
}

/* The set-up of this rank's NCCL communicator while it is in flight. The
 * MPI buffers are blocks of their own, leaked (set to NULL here) when a
 * message may still be in flight (a timeout). */
typedef struct {
    const dist_nccl_api *api;   /* NULL: NCCL could not be loaded (mine->err says why) */
    peer_info *all;             /* every rank's record (size of them), then this rank's */
    peer_info *mine;            /* &all[size] */
    id_msg *idm;                /* rank 0's unique id, broadcast */
    int dev;                    /* the communicator's device (-1 until known) */
    int prev;                   /* the thread's current device before, restored at the end */
} comm_setup;

/* The pending exception's text into buf (the exception cleared). */
static void take_error_text(char *buf, size_t n)
{
    PyObject *t, *v, *tb;
    PyErr_Fetch(&t, &v, &tb);
    PyObject *text = v ? PyObject_Str(v) : NULL;
    const char *utf8 = text ? PyUnicode_AsUTF8(text) : NULL;
    snprintf(buf, n, "%s", utf8 ? utf8 : "?");
    PyErr_Clear();
    Py_XDECREF(text);
    Py_XDECREF(t);
    Py_XDECREF(v);
    Py_XDECREF(tb);
}

/* This rank's record: NCCL loaded, its device made current (dev < 0: the
 * current one) and described, and the host name; a failure is not raised
 * here but written into the record, for every rank to raise alike. */
static void describe_self(comm_setup *s)
{
    peer_info *mine = s->mine;
    int rc;
    s->api = dist_nccl_get();
    if (s->api == NULL)
        take_error_text(mine->err, sizeof mine->err);
    else if ((rc = s->api->GetDevice(&s->prev)) != CUDA_OK)
        snprintf(mine->err, sizeof mine->err, "cudaGetDevice failed: %s",
                 s->api->CudaErrorString(rc));
    else if ((rc = s->api->SetDevice(s->dev = s->dev < 0 ? s->prev : s->dev)) != CUDA_OK)
        snprintf(mine->err, sizeof mine->err, "cudaSetDevice(%d) failed: %s", s->dev,
                 s->api->CudaErrorString(rc));
    else
        describe_device(s->api, s->dev, mine);
    mine->ok = mine->err[0] == '\0';
    mine->dev = s->dev;
    if (gethostname(mine->host, sizeof mine->host - 1) != 0)
        snprintf(mine->host, sizeof mine->host, "?");
}

/* Every rank's record to every rank (MPI_Iallgather), then the checks that
 * every rank makes alike: NCCL started everywhere, one GPU per rank. */
static int exchange_records(dist_comm *c, comm_setup *s, double deadline, int64_t kind)
{
    MPI_Request req = MPI_REQUEST_NULL;
    int rc = MPI_Iallgather(s->mine, (int)sizeof *s->mine, MPI_BYTE, s->all,
                            (int)sizeof *s->mine, MPI_BYTE, c->comm, &req);
    if (rc != MPI_SUCCESS)
        return dist_mpi_error(rc, "MPI_Iallgather (NCCL set-up)");
    if (wait_one(c, &req, deadline, kind) < 0) {
        s->all = NULL;   /* MPI may still read or write them: leaked */
        s->idm = NULL;
        return -1;
    }
    for (int r = 0; r < c->size; r++) {
        if (!s->all[r].ok) {
            PyErr_Format(PyExc_RuntimeError, "dpmini.distributed: rank %d could not start NCCL "
                         "for GPU arrays (every rank raises this): %s", r, s->all[r].err);
            return -1;
        }
    }
    return check_one_gpu_per_rank(s->all, c->size);
}

/* Rank 0's ncclGetUniqueId (or its failure) to every rank (MPI_Ibcast). */
static int share_unique_id(dist_comm *c, comm_setup *s, double deadline, int64_t kind)
{
    int rc;
    if (c->rank == 0 && (rc = s->api->GetUniqueId(&s->idm->id)) != NCCL_OK)
        s->idm->rc = rc;
    MPI_Request req = MPI_REQUEST_NULL;
    rc = MPI_Ibcast(s->idm, (int)sizeof *s->idm, MPI_BYTE, 0, c->comm, &req);
    if (rc != MPI_SUCCESS)
        return dist_mpi_error(rc, "MPI_Ibcast (NCCL unique id)");
    if (wait_one(c, &req, deadline, kind) < 0) {
        s->all = NULL;   /* leaked, as above */
        s->idm = NULL;
        return -1;
    }
    if (s->idm->rc != NCCL_OK) {
        PyErr_Format(PyExc_RuntimeError, "dpmini.distributed: ncclGetUniqueId failed on rank 0 "
                     "(every rank raises this): %s", s->api->GetErrorString((int)s->idm->rc));
        return -1;
    }
    return 0;
}

/* ncclCommInitRank polled against the deadline; on success the
 * communicator, its device and the ranks' smallest 2D copy pitch go into c. */
static int connect_rank(dist_comm *c, comm_setup *s, double deadline)
{
    if (s->api->emulated)
        dist_nccl_emu_set_parent(c->comm);
    dist_ncclComm_t comm = NULL;
    int rc = NCCL_OK, waited = init_rank(c, s->api, s->dev, s->idm, deadline, &comm, &rc);
    if (waited != 0) {
        char secs[32];
        snprintf(secs, sizeof secs, "%g", c->timeout);
        if (waited > 0)
            PyErr_Format(PyExc_TimeoutError, "dpmini.distributed: ncclCommInitRank on rank %d "
                         "(cuda:%d) did not complete within the timeout of %s s (a rank died "
                         "or cannot connect); GPU collectives are off on this rank", c->rank,
                         s->dev, secs);
        snprintf(c->nccl_broken, sizeof c->nccl_broken, "%s in ncclCommInitRank",
                 waited > 0 ? "a TimeoutError" : "an interrupt");
        return -1;
    }
    if (rc != NCCL_OK) {
        PyErr_Format(PyExc_RuntimeError, "dpmini.distributed: ncclCommInitRank on rank %d "
                     "(cuda:%d) failed: %s", c->rank, s->dev, s->api->GetErrorString(rc));
        return -1;
    }
    c->nccl = comm;
    c->nccl_dev = s->dev;
    c->nccl_max_pitch = s->all[0].max_pitch;
    for (int r = 1; r < c->size; r++)
        if (s->all[r].max_pitch < c->nccl_max_pitch)
            c->nccl_max_pitch = s->all[r].max_pitch;
    return 0;
}

/* This rank's NCCL communicator on `dev` (-1: the CUDA current device).
 * Collective: every rank calls it at the same call. */
int dist_gpu_comm(dist_comm *c, int dev, double deadline, int64_t kind)
{
    if (c->nccl != NULL)
        return 0;
    comm_setup s = {.dev = dev, .prev = -1};
    s.all = PyMem_Calloc((size_t)c->size + 1, sizeof(peer_info));
    s.idm = PyMem_Calloc(1, sizeof(id_msg));
    if (s.all == NULL || s.idm == NULL) {
        PyMem_Free(s.all);
        PyMem_Free(s.idm);
        PyErr_NoMemory();
        return -1;   /* the others time out: no memory for a few hundred bytes */
    }
    s.mine = &s.all[c->size];
    describe_self(&s);
    int rc = exchange_records(c, &s, deadline, kind) == 0 &&
             share_unique_id(c, &s, deadline, kind) == 0 && connect_rank(c, &s, deadline) == 0
             ? 0 : -1;
    if (s.api != NULL && s.prev >= 0 && s.prev != s.dev)
        s.api->SetDevice(s.prev);
    PyMem_Free(s.all);
    PyMem_Free(s.idm);
    return rc;
}

/* ------------------------------------------------------------------ */
/* Waiting for the stream                                              */
/* ------------------------------------------------------------------ */

int dist_gpu_finish(dist_comm *c, int rc, dist_stream_t s, double deadline, const char *what,
                    int64_t call, PyObject *keep1, PyObject *keep2, PyObject *keep3)
{
    const dist_nccl_api *api = dist_nccl_get();
    int cuda = CUDA_OK, async = NCCL_OK, timed_out = 0, interrupted = 0;
    if (rc == NCCL_OK) {
        double next_signals = dist_now() + 0.05, start = dist_now();
        PyThreadState *ts = PyEval_SaveThread();
        for (;;) {
            cuda = api->StreamQuery(s);
            if (cuda != CUDA_NOT_READY)
                break;
            if (api->CommGetAsyncError((dist_ncclComm_t)c->nccl, &async) != NCCL_OK ||
                (async != NCCL_OK && async != NCCL_IN_PROGRESS))
                break;
            async = NCCL_OK;
            int pause = dist_poll_pause(&ts, deadline, start, &next_signals);
            if (pause != 0) {
                timed_out = pause > 0;
                interrupted = pause < 0;
                break;
            }
        }
        PyEval_RestoreThread(ts);
        if (cuda == CUDA_OK && !timed_out && !interrupted && async == NCCL_OK)
            return 0;
    }
    Py_XINCREF(keep1);   /* a peer may still write or read them (emulation): never freed */
    Py_XINCREF(keep2);
    Py_XINCREF(keep3);
    char secs[32];
    snprintf(secs, sizeof secs, "%g", c->timeout);
    snprintf(c->nccl_broken, sizeof c->nccl_broken, "%s in %s call %lld",
             timed_out ? "a TimeoutError" : interrupted ? "an interrupt" : "an NCCL error",
             what, (long long)call);
    dist_gpu_free(c, 1);
    if (interrupted)
        return -1;
    if (timed_out)
        PyErr_Format(PyExc_TimeoutError, "dpmini.distributed.%s (call %lld on rank %d): the NCCL "
                     "collective did not complete within the timeout of %s s (a rank died or "
                     "is stalled, or its GPU is busy); its NCCL communicator was aborted, GPU "
                     "collectives are off on this rank", what, (long long)call, c->rank, secs);
    else if (rc != NCCL_OK || async != NCCL_OK)
        PyErr_Format(PyExc_RuntimeError, "dpmini.distributed.%s (call %lld on rank %d): NCCL "
                     "error %d: %s; its NCCL communicator was aborted, GPU collectives are off "
                     "on this rank", what, (long long)call, c->rank, rc != NCCL_OK ? rc : async,
                     api->GetErrorString(rc != NCCL_OK ? rc : async));
    else
        PyErr_Format(PyExc_RuntimeError, "dpmini.distributed.%s (call %lld on rank %d): CUDA "
                     "error %d while waiting for the stream: %s; the NCCL communicator was "
                     "aborted, GPU collectives are off on this rank", what, (long long)call,
                     c->rank, cuda, api->CudaErrorString(cuda));
    return -1;
}

/* ------------------------------------------------------------------ */
/* The collectives                                                     */
/* ------------------------------------------------------------------ */

static PyObject *reduce_on_device(dist_comm *c, const dist_meta *mine, dist_gpu_arg *g,
                                  int nccl_op, int root, double deadline)
{
    int all = root < 0;
    const char *what = all ? "all_reduce" : "reduce";
    const dist_nccl_api *api = dist_nccl_get();
    dist_stream_t s = (dist_stream_t)g->stream;
    int rc = NCCL_OK;
    if (g->count > 0) {
        Py_BEGIN_ALLOW_THREADS
        dist_launch_begin();
        rc = all ? api->AllReduce((void *)g->ptr, (void *)g->out_ptr, g->count, g->nccl_type,
                                  nccl_op, (dist_ncclComm_t)c->nccl, s)
                 : api->Reduce((void *)g->ptr, (void *)g->out_ptr, g->count, g->nccl_type,
                               nccl_op, root, (dist_ncclComm_t)c->nccl, s);
        dist_launch_end();
        Py_END_ALLOW_THREADS
        if (dist_gpu_finish(c, rc, s, deadline, what, mine->call, g->obj, g->out, NULL) < 0)
            return NULL;
    }
    if (!all && c->rank != root)
        Py_RETURN_NONE;
    return Py_NewRef(g->out);
}

PyObject *dist_gpu_reduce(dist_comm *c, const dist_meta *mine, dist_gpu_arg *g, int nccl_op,
                          int root, double deadline)
{
    if (dist_gpu_comm(c, g->dev, deadline, mine->kind) < 0)
        return NULL;
    int prev = dist_gpu_enter(c);
    if (prev == -2)
        return NULL;   /* the others wait for this rank until their timeout */
    PyObject *out = reduce_on_device(c, mine, g, nccl_op, root, deadline);
    dist_gpu_leave(c, prev);
    return out;
}

static PyObject *broadcast_on_device(dist_comm *c, const dist_meta *rm, dist_gpu_arg *g, int root,
                                     double deadline)
{
    const dist_nccl_api *api = dist_nccl_get();
    size_t bytes = (size_t)rm->itemsize;   /* moved as bytes: any dtype */
    for (int64_t i = 0; i < rm->ndim; i++)
        bytes *= (size_t)rm->shape[i];
    if (g->out == NULL) {   /* off root: like root's array, on this rank's device */
        g->out = dist_gpu_alloc(rm->lib, rm, c->nccl_dev, &g->out_ptr);
        if (g->out == NULL)
            return NULL;   /* the others wait for this rank until their timeout */
    }
    if (bytes > 0) {
        dist_stream_t s = (dist_stream_t)g->stream;
        int rc;
        Py_BEGIN_ALLOW_THREADS
        dist_launch_begin();
        rc = api->Broadcast((void *)g->ptr, (void *)g->out_ptr, bytes, NCCL_T_UINT8, root,
                            (dist_ncclComm_t)c->nccl, s);
        dist_launch_end();
        Py_END_ALLOW_THREADS
        if (dist_gpu_finish(c, rc, s, deadline, "broadcast", rm->call, g->obj, g->out, NULL) < 0)
            return NULL;
    }
    return Py_NewRef(g->out);
}

PyObject *dist_gpu_broadcast(dist_comm *c, const dist_meta *rm, dist_gpu_arg *g, int root,
                             double deadline)
{
    if (dist_gpu_comm(c, g->obj != NULL ? g->dev : -1, deadline, DIST_BROADCAST) < 0)
        return NULL;
    int prev = dist_gpu_enter(c);
    if (prev == -2)
        return NULL;   /* the others wait for this rank until their timeout */
    PyObject *out = broadcast_on_device(c, rm, g, root, deadline);
    dist_gpu_leave(c, prev);
    return out;
}
