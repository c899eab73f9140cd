/* copy_broadcast.c - the copy engine's broadcast: one array copied to a
 * device (dp_copy_to_device) and arrays copied to many devices, through NCCL
 * when every target is a GPU (dp_broadcast_coalesced) (copy_engine.h).
 */
#include "dpmini.h"
#include "gpu.h"
#include "copy_engine.h"
#include "engine.h"
#include "plan.h"

#include <string.h>

/* ------------------------------------------------------------------ */
/* Broadcast                                                           */
/* ------------------------------------------------------------------ */

/* copy_to for a src that lives on `home`. */
static PyObject *copy_from_to(dp_state *st, job_list *jobs, PyArrayObject *src, dp_device home,
                              dp_device dev)
{
    PyArrayObject *dst = empty_like_region(st, dev, src, PyArray_SHAPE(src),
                                           PyArray_STRIDES(src));
    if (dst == NULL) {
        return NULL;
    }
    if (jobs_add_array(jobs, dst, src, exec_device(home, dev)) < 0) {
        Py_DECREF(dst);
        return NULL;
    }
    return (PyObject *)dst;
}

/* Queue a copy of all of src into a fresh array on dev; new reference. */
PyObject *copy_to(dp_state *st, job_list *jobs, PyArrayObject *src, dp_device dev)
{
    return copy_from_to(st, jobs, src, dp_array_device(st, src), dev);
}

PyObject *dp_copy_to_device(dp_state *st, PyArrayObject *src, dp_device dev)
{
    job_list jobs = {0};
    PyObject *r = copy_to(st, &jobs, src, dev);
    if (r != NULL && jobs_run(&jobs) < 0) {
        Py_CLEAR(r);
    }
    jobs_free(&jobs);
    return r;
}

/* Arrays that take the NCCL path, broadcast together: one NCCL group (or a
 * few, NCCL's limit on operations a group) and one wait for all of them. */
typedef struct {
    int n;            /* arrays queued                               */
    int ndev;
    int ids[DP_MAX_DEVICES];
    void **bufs;      /* [array * ndev + rank]                        */
    size_t *nbytes;   /* per array                                    */
    int *roots;       /* per array: the rank holding the source       */
} nccl_batch;

static int batch_init(nccl_batch *b, Py_ssize_t narr, Py_ssize_t ndev)
{
    b->n = 0;
    b->ndev = (int)ndev;
    b->bufs = PyMem_Calloc((size_t)(narr * ndev) + 1, sizeof(void *));
    b->nbytes = PyMem_Calloc((size_t)narr + 1, sizeof(size_t));
    b->roots = PyMem_Calloc((size_t)narr + 1, sizeof(int));
    if (b->bufs == NULL || b->nbytes == NULL || b->roots == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    return 0;
}

static void batch_free(nccl_batch *b)
{
    PyMem_Free(b->bufs);
    PyMem_Free(b->nbytes);
    PyMem_Free(b->roots);
    b->bufs = NULL;
    b->nbytes = NULL;
    b->roots = NULL;
}

/* Queue src for the NCCL broadcast when every target is a distinct GPU, the
 * source is a contiguous array on one of them, and NCCL loads: the outputs
 * are allocated and put in the result rows. Returns 1 when queued, 0 to use
 * the copy path, -1 on error. */
static int nccl_broadcast_queue(dp_state *st, PyArrayObject *src, const dp_device *devs,
                                Py_ssize_t ndev, PyObject *result, Py_ssize_t i,
                                nccl_batch *b)
{
    dp_device home = dp_array_device(st, src);
    int root = -1;
    if (home.kind != DP_CUDA || ndev < 2 || !PyArray_IS_C_CONTIGUOUS(src) ||
        PyArray_NBYTES(src) == 0) {
        return 0;
    }
    for (Py_ssize_t d = 0; d < ndev; d++) {
        if (devs[d].kind != DP_CUDA) {
            return 0;
        }
        for (Py_ssize_t e = 0; e < d; e++) {
            if (devs[e].index == devs[d].index) {
                return 0; /* a repeated GPU: the copy path */
            }
        }
        b->ids[d] = devs[d].index;
        if (devs[d].index == home.index) {
            root = (int)d;
        }
    }
    if (root < 0 || !dp_nccl_available()) {
        return 0;
    }
    void **bufs = &b->bufs[(size_t)b->n * (size_t)ndev];
    for (Py_ssize_t d = 0; d < ndev; d++) {
        PyObject *item;
        if ((int)d == root) {
            item = Py_NewRef(src);
        } else {
            PyArray_Descr *descr = PyArray_DESCR(src);
            Py_INCREF(descr);
            item = (PyObject *)dp_empty(st, devs[d], descr, PyArray_NDIM(src),
                                        PyArray_SHAPE(src), NULL);
            if (item == NULL) {
                return -1;
            }
        }
        bufs[d] = PyArray_BYTES((PyArrayObject *)item);
        PyList_SET_ITEM(PyList_GET_ITEM(result, d), i, item);
    }
    b->nbytes[b->n] = (size_t)PyArray_NBYTES(src);
    b->roots[b->n] = root;
    b->n++;
    return 1;
}

static int nccl_broadcast_run(dp_state *st, nccl_batch *b)
{
    if (b->n == 0) {
        return 0;
    }
    dpc_status s;
    Py_BEGIN_ALLOW_THREADS
    s = dp_nccl_broadcast_many(b->ndev, b->ids, b->n, b->bufs, b->nbytes, b->roots);
    Py_END_ALLOW_THREADS
    if (s.code != 0) {
        return dp_gpu_raise(st, s, "broadcast (ncclBroadcast)");
    }
    return 0;
}

/* The result: ndev rows (lists) of n entries each, empty until filled. */
static PyObject *new_rows(Py_ssize_t ndev, Py_ssize_t n)
{
    PyObject *result = PyList_New(ndev);
    for (Py_ssize_t d = 0; result != NULL && d < ndev; d++) {
        PyObject *row = PyList_New(n);
        if (row == NULL) {
            Py_CLEAR(result);
            break;
        }
        PyList_SET_ITEM(result, d, row);
    }
    return result;
}

/* Whether the copies start while the rest are still being set up:
 * between virtual CPU devices (a module of many parameters, none on a GPU)
 * when there is enough to copy for streaming stores to pay
 * (DP_STREAM_MIN_JOB a device): the jobs then go to the copying workers
 * every MiB (copy_jobs.c). *any_cuda: a GPU among the sources or targets. */
static int feed_copies(dp_state *st, PyArrayObject **src, Py_ssize_t n, const dp_device *devs,
                       Py_ssize_t ndev, int *any_cuda)
{
    int all_vcpu = 1;
    uint64_t src_bytes = 0;
    *any_cuda = 0;
    for (Py_ssize_t d = 0; d < ndev; d++) {
        all_vcpu &= devs[d].kind == DP_VCPU;
        *any_cuda |= devs[d].kind == DP_CUDA;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        *any_cuda |= dp_array_device(st, src[i]).kind == DP_CUDA;
        src_bytes += (uint64_t)PyArray_NBYTES(src[i]);
    }
    return all_vcpu && !*any_cuda && src_bytes >= DP_STREAM_MIN_JOB;
}

/* Entry i of every row: src itself on its own device, else a copy queued
 * on jobs. 0 or -1. */
static int queue_copies(dp_state *st, PyArrayObject *src, const dp_device *devs,
                        Py_ssize_t ndev, PyObject *result, Py_ssize_t i, job_list *jobs)
{
    dp_device home = dp_array_device(st, src);
    for (Py_ssize_t d = 0; d < ndev; d++) {
        PyObject *item = dp_device_eq(home, devs[d])
            ? Py_NewRef((PyObject *)src) : copy_from_to(st, jobs, src, home, devs[d]);
        if (item == NULL) {
            return -1;
        }
        PyList_SET_ITEM(PyList_GET_ITEM(result, d), i, item);
    }
    return 0;
}

/* The rows' GPU entries as dpmini.Array (every entry passed to dp_export).
 * 0, or -1 with result's entries partly exported. */
static int export_rows(dp_state *st, PyObject *result, Py_ssize_t ndev, Py_ssize_t n)
{
    for (Py_ssize_t d = 0; d < ndev; d++) {
        PyObject *row = PyList_GET_ITEM(result, d);
        for (Py_ssize_t i = 0; i < n; i++) {
            PyObject *e = dp_export(st, Py_NewRef(PyList_GET_ITEM(row, i)));
            if (e == NULL) {
                return -1;
            }
            PyList_SetItem(row, i, e);
        }
    }
    return 0;
}

PyObject *dp_broadcast_coalesced(dp_state *st, PyObject *arrays, const dp_device *devs,
                                 Py_ssize_t ndev, size_t buffer_size)
{
    PyArrayObject **src = NULL;
    Py_ssize_t n = 0;
    job_list jobs = {0};
    PyObject *result = NULL;
    nccl_batch batch = {0};
    int any_cuda = 0, ok = 0;

    (void)buffer_size; /* see comm_broadcast_coalesced's docstring */
    if (arrays_from_sequence(st, arrays, "arrays", 0, &src, &n) < 0) {
        return NULL;
    }
    if (batch_init(&batch, n, ndev) < 0 || (result = new_rows(ndev, n)) == NULL) {
        goto done;
    }
    if (n > 0 && ndev > PY_SSIZE_T_MAX / n) {
        PyErr_NoMemory();
        goto done;
    }
    if (jobs_reserve(&jobs, n * ndev) < 0) {
        goto done;
    }
    int pipeline = feed_copies(st, src, n, devs, ndev, &any_cuda);
    for (Py_ssize_t i = 0; i < n; i++) {
        if (pipeline && jobs.bytes - jobs.launched_bytes >= ((size_t)1 << 20) &&
            jobs_launch(&jobs) < 0) {
            goto done;
        }
        int r = nccl_broadcast_queue(st, src[i], devs, ndev, result, i, &batch);
        if (r < 0 || (r == 0 && queue_copies(st, src[i], devs, ndev, result, i, &jobs) < 0)) {
            goto done;
        }
    }
    ok = !(nccl_broadcast_run(st, &batch) < 0 || jobs_run(&jobs) < 0);
done:
    jobs_free(&jobs);
    batch_free(&batch);
    arrays_free(src, n);
    /* GPU entries leave as dpmini.Array */
    if (ok && any_cuda && export_rows(st, result, ndev, n) < 0) {
        ok = 0;
    }
    if (!ok) {
        Py_CLEAR(result);
    }
    return result;
}
