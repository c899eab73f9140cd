/* copy_jobs.c - the copy engine's jobs: strided copies between host,
 * virtual CPU devices and GPUs, queued in a job list, grouped per executing
 * device and run on the device worker threads (pool.c), or inline when the
 * total is small (copy_engine.h).
 */
#include "dpmini.h"
#include "gpu.h"
#include "copy_engine.h"
#include "pool.h"

#include <string.h>

/* Below this many bytes in one call, copying inline in the caller beats
 * waking worker threads (a wake-up costs microseconds; 256 KiB copies in
 * about 20). */
#define DP_INLINE_BYTES ((size_t)1 << 18)
/* ------------------------------------------------------------------ */
/* Copy jobs                                                           */
/* ------------------------------------------------------------------ */

void jobs_free(job_list *l)
{
    PyMem_Free(l->jobs);
    l->jobs = NULL;
    l->n = l->cap = 0;
    l->bytes = 0;
}

/* Queue dst[...] = src[...] for `shape`. Strides in bytes. */
int jobs_add(job_list *l, int nd, const npy_intp *shape, size_t itemsize,
             char *dst, const npy_intp *dst_strides,
             const char *src, const npy_intp *src_strides, copy_route route)
{
    int64_t sh[DP_MAXDIMS], ss[DP_MAXDIMS], ds[DP_MAXDIMS];
    if (itemsize == 0) {
        return 0;
    }
    for (int i = 0; i < nd; i++) {
        if (shape[i] == 0) {
            return 0;
        }
        sh[i] = shape[i];
        ss[i] = src_strides[i];
        ds[i] = dst_strides[i];
    }
    if (l->n == l->cap) {
        Py_ssize_t cap = l->cap ? 2 * l->cap : 16;
        copy_job *grown = PyMem_Realloc(l->jobs, (size_t)cap * sizeof(copy_job));
        if (grown == NULL) {
            PyErr_NoMemory();
            return -1;
        }
        l->jobs = grown;
        l->cap = cap;
    }
    copy_job *j = &l->jobs[l->n];
    if (dp_copy_init(&j->desc, nd, itemsize, sh, ss, ds) < 0) {
        PyErr_Format(PyExc_ValueError, "copy: %d dimensions is more than dpmini supports (%d)",
                     nd, DP_MAXDIMS);
        return -1;
    }
    dp_copy_simplify(&j->desc);
    j->dst = dst;
    j->src = src;
    j->exec = route.exec;
    j->src_dev = route.src;
    j->dst_dev = route.dst;
    l->bytes += (size_t)dp_copy_numel(&j->desc) * itemsize;
    l->n++;
    return 0;
}

typedef struct {
    copy_job *jobs;
    Py_ssize_t n;
    dpc_status status;  /* first failure of a GPU copy; code 0 when none */
    Py_ssize_t failed;  /* index of the failed job                       */
} job_group;

static int gpu_index(dp_device d)
{
    return d.kind == DP_CUDA ? d.index : -1;
}

/* Host copies with memcpy; copies with a CUDA side through dp_gpu_copy, each
 * job on its own stream slot (several replicas on one GPU overlap), all the
 * slots synced once at the end. */
static void run_group(void *arg)
{
    job_group *g = arg;
    dp_gpu_sync sync = {g->n ? gpu_index(g->jobs[0].exec) : -1, 0};
    g->status = dpc_ok();
    /* Many small host jobs that together write more than a large job (a
     * replicate of many parameters, a scatter of many leaves) stream too:
     * what decides is how much this thread writes, not each job's size. */
    uint64_t host_bytes = 0;
    for (Py_ssize_t i = 0; i < g->n; i++) {
        if (g->jobs[i].exec.kind != DP_CUDA) {
            host_bytes += (uint64_t)dp_copy_numel(&g->jobs[i].desc) * g->jobs[i].desc.itemsize;
        }
    }
    int mode = host_bytes >= DP_STREAM_MIN_JOB ? DP_COPY_STREAM : DP_COPY_AUTO;
    for (Py_ssize_t i = 0; i < g->n; i++) {
        copy_job *j = &g->jobs[i];
        if (j->exec.kind != DP_CUDA) {
            dp_copy_run_mode(&j->desc, j->dst, j->src, mode);
            continue;
        }
        dpc_status s = dp_gpu_copy(&j->desc, j->dst, gpu_index(j->dst_dev), j->src,
                                   gpu_index(j->src_dev), (int)i, &sync);
        if (s.code != 0) {
            g->status = s;
            g->failed = i;
            break;
        }
    }
    dpc_status s = dp_gpu_sync_finish(&sync);
    if (s.code != 0 && g->status.code == 0) {
        g->status = s;
        g->failed = 0;
    }
}

/* The funnel for a failed group: names the copy's two devices. */
static int group_error(job_group *g)
{
    char op[96], a[32], b[32];
    copy_job *j = &g->jobs[g->failed];
    dp_device_format(j->src_dev, a, sizeof a);
    dp_device_format(j->dst_dev, b, sizeof b);
    snprintf(op, sizeof op, "copy %s -> %s", a, b);
    /* jobs carry no module state; errors are rare, so look the module up */
    PyObject *mod = PyImport_ImportModule("dpmini._dpmini");
    if (mod == NULL) {
        return -1;
    }
    int rc = dp_gpu_raise(dp_state_from_module(mod), g->status, op);
    Py_DECREF(mod);
    return rc;
}

static int exec_before(const void *a, const void *b)
{
    const copy_job *x = a, *y = b;
    if (x->exec.kind != y->exec.kind) {
        return x->exec.kind - y->exec.kind;
    }
    return x->exec.index - y->exec.index;
}

/* 1 when a group has a CUDA job: it waits on streams (slot 0 is shared with
 * large copies and NCCL), so it never runs with the GIL held. */
static int group_has_cuda(const job_group *g)
{
    for (Py_ssize_t i = 0; i < g->n; i++) {
        if (g->jobs[i].exec.kind == DP_CUDA) {
            return 1;
        }
    }
    return 0;
}

/* Order jobs by executing device. A job is a large struct (its copy
 * descriptor holds DP_MAXDIMS dims), so the usual already-ordered list (one
 * leaf's jobs, queued device by device) is left alone instead of sorted. */
static void sort_jobs(job_list *l)
{
    for (Py_ssize_t i = 1; i < l->n; i++) {
        if (exec_before(&l->jobs[i - 1], &l->jobs[i]) > 0) {
            qsort(l->jobs, (size_t)l->n, sizeof(copy_job), exec_before);
            return;
        }
    }
}

/* Run every queued job: each device's jobs on its worker, all devices at
 * once, the GIL released. Small totals, host-only jobs, and calls made from
 * inside a worker (a replica) run inline (the GIL released for CUDA jobs). */
int jobs_run(job_list *l)
{
    if (l->n == 0) {
        return 0;
    }
    if (l->bytes < DP_INLINE_BYTES || dp_pool_in_worker()) {
        /* one group per executing device, run here one after another */
        sort_jobs(l);
        Py_ssize_t start = 0;
        for (Py_ssize_t i = 1; i <= l->n; i++) {
            if (i < l->n && dp_device_eq(l->jobs[i].exec, l->jobs[start].exec)) {
                continue;
            }
            job_group g = {&l->jobs[start], i - start, {0}, 0};
            if (l->bytes < DP_INLINE_BYTES && !group_has_cuda(&g)) {
                run_group(&g);
            } else {
                Py_BEGIN_ALLOW_THREADS
                run_group(&g);
                Py_END_ALLOW_THREADS
            }
            if (g.status.code != 0) {
                return group_error(&g);
            }
            start = i;
        }
        return 0;
    }
    sort_jobs(l);
    job_group *groups = PyMem_Malloc((size_t)l->n * sizeof(job_group));
    if (groups == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    Py_ssize_t ng = 0;
    for (Py_ssize_t i = 0; i < l->n; i++) {
        if (i == 0 || !dp_device_eq(l->jobs[i].exec, l->jobs[i - 1].exec)) {
            groups[ng].jobs = &l->jobs[i];
            groups[ng].n = 0;
            groups[ng].status = dpc_ok();
            groups[ng].failed = 0;
            ng++;
        }
        groups[ng - 1].n++;
    }
    int err = 0;
    Py_BEGIN_ALLOW_THREADS
    dp_batch batch;
    err = dp_batch_init(&batch);
    if (err == 0) {
        for (Py_ssize_t g = 0; g < ng; g++) {
            dp_device ex = groups[g].jobs[0].exec;
            if (ex.kind == DP_HOST ||
                dp_batch_submit(&batch, ex.kind, ex.index, run_group, &groups[g]) != 0) {
                run_group(&groups[g]); /* no worker: the caller does it */
            }
        }
        dp_batch_wait(&batch, -1);
        dp_batch_destroy(&batch);
    }
    Py_END_ALLOW_THREADS
    if (err == 0) {
        for (Py_ssize_t g = 0; g < ng; g++) {
            if (groups[g].status.code != 0) {
                int rc = group_error(&groups[g]);
                PyMem_Free(groups);
                return rc;
            }
        }
    }
    PyMem_Free(groups);
    if (err != 0) {
        errno = err;
        PyErr_SetFromErrno(PyExc_OSError);
        return -1;
    }
    return 0;
}
