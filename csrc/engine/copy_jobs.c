/* copy_jobs.c - the copy engine's jobs: strided copies between host,
 * virtual CPU devices and GPUs, queued in a job list, grouped (per
 * executing device; per core when only host and virtual CPU memory is
 * touched) and run on the device worker threads (pool.c), or inline when
 * the total is small (copy_engine.h); and the feed: copies that start while
 * the caller is still queuing them (a broadcast of a module's many
 * parameters between host and virtual CPU devices), run by one consumer per
 * core.
 *
 * jobs_launch's first call starts the consumers on the device workers; each
 * later call publishes the jobs queued since. A consumer claims a run of
 * about FEED_CHUNK bytes of published jobs at a time, in queue order, and
 * copies it with streaming stores; jobs_run publishes the rest, closes the
 * feed and waits. A fixed set of consumers, not a batch of groups per call:
 * a new batch while the last one still copies would start new worker
 * threads (pool.c starts one when a device's threads are all busy), and the
 * copies of 2 devices would run on many threads over 2 cores.
 *
 * Sections: types and declarations; the jobs; the feed.
 */
#include "dpmini.h"
#include "gpu.h"
#include "copy_engine.h"
#include "pool.h"

#include <errno.h>
#include <pthread.h>
#include <string.h>

/* Copy spans of one thread under dpmini.profile(): the time it spent on
 * each device's copies (a scatter's destination, a gather's source) and
 * their bytes, recorded as one span a device. */
#define COPY_SPAN_DEVICES 8
typedef struct {
    dp_prof_ctx ctx;        /* ctx.s NULL: not recording                    */
    int path;               /* dp_prof_path                                 */
    int n;
    struct {
        dp_device dev;
        uint64_t start, busy, bytes;
        int strided;
    } dev[COPY_SPAN_DEVICES];
} copy_spans;

/* Start collecting copy spans for ctx (path: dp_prof_path). */
static void copy_spans_init(copy_spans *cs, dp_prof_ctx ctx, int path);

/* Job j copied from t0 to t1 (ns). */
static void copy_spans_add(copy_spans *cs, const copy_job *j, uint64_t t0, uint64_t t1);

/* Record the collected spans (end_ns > 0: each ends there, a
 * GPU copy's stream sync) and start over. */
static void copy_spans_flush(copy_spans *cs, uint64_t end_ns);

/* Run one host copy job here (no GIL needed), with dp_copy_run_mode's mode. */
static void job_run_host(const copy_job *j, int mode);

/* Close the feed jobs_launch started (if any), wait for its
 * consumers (GIL released) and free it; drop: jobs not claimed yet are not
 * copied (an error path). */
static void jobs_feed_end(job_list *l, int drop);
/* Below this many bytes in one call, copying inline in the caller beats
 * waking worker threads (a wake-up costs microseconds; 256 KiB copies in
 * about 20). */
#define DP_INLINE_BYTES ((size_t)1 << 18)
/* ------------------------------------------------------------------ */
/* Copy jobs                                                           */
/* ------------------------------------------------------------------ */

void jobs_init_fixed(job_list *l, copy_job *buf, Py_ssize_t cap)
{
    memset(l, 0, sizeof *l);
    l->jobs = l->fixed = buf;
    l->cap = cap;
}

void jobs_free(job_list *l)
{
    jobs_feed_end(l, 1);   /* an error path: the claimed copies still write */
    for (Py_ssize_t i = 0; i < l->n; i++) {
        if (l->jobs[i].big != NULL) {
            PyMem_Free(l->jobs[i].big);
        }
    }
    if (l->jobs != l->fixed) {
        PyMem_Free(l->jobs);
    }
    l->jobs = l->fixed = NULL;
    l->n = l->cap = 0;
    l->bytes = 0;
    l->launched = 0;
    l->launched_bytes = 0;
}

/* Room for `more` jobs beyond those queued, so that a caller that knows
 * how many it queues grows the list once: a job is a few hundred bytes,
 * and growing by doubling copied
 * every queued job again at each step. */
int jobs_reserve(job_list *l, Py_ssize_t more)
{
    if (more <= l->cap - l->n) {
        return 0;
    }
    if (l->feed != NULL) {   /* workers are reading the jobs: never move them */
        PyErr_SetString(PyExc_SystemError, "copy jobs: list grown while its jobs run");
        return -1;
    }
    if (more > PY_SSIZE_T_MAX / (Py_ssize_t)sizeof(copy_job) - l->n) {
        PyErr_NoMemory();
        return -1;
    }
    Py_ssize_t cap = l->n + more;
    copy_job *grown;
    if (l->jobs != NULL && l->jobs == l->fixed) {   /* out of the caller's storage */
        grown = PyMem_Malloc((size_t)cap * sizeof(copy_job));
        if (grown != NULL) {
            memcpy(grown, l->jobs, (size_t)l->n * sizeof(copy_job));
        }
    } else {
        grown = PyMem_Realloc(l->jobs, (size_t)cap * sizeof(copy_job));
    }
    if (grown == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    l->jobs = grown;
    l->cap = cap;
    return 0;
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
    if (l->n == l->cap && jobs_reserve(l, l->cap ? l->cap : 4) < 0) {
        return -1;
    }
    copy_job *j = &l->jobs[l->n];
    /* Contiguous in C order on both sides (size-1 dims aside): the one-run
     * form dp_copy_simplify would give it, without building a descriptor. */
    int64_t run = (int64_t)itemsize;
    int flat = itemsize <= (size_t)INT64_MAX;
    for (int i = nd - 1; i >= 0 && flat; i--) {
        if (sh[i] != 1) {
            flat = ss[i] == run && ds[i] == run && !__builtin_mul_overflow(run, sh[i], &run);
        }
    }
    if (flat) {
        j->big = NULL;
        j->ndim = 1;
        j->itemsize = itemsize;
        j->shape[0] = run / (int64_t)itemsize;
        j->src_strides[0] = j->dst_strides[0] = (int64_t)itemsize;
        j->bytes = (uint64_t)run;
        goto queued;
    }
    dp_copy_desc d;   /* only its first nd dims are written */
    if (dp_copy_init(&d, nd, itemsize, sh, ss, ds) < 0) {
        PyErr_Format(PyExc_ValueError, "copy: %d dimensions is more than dpmini supports (%d)",
                     nd, DP_MAXDIMS);
        return -1;
    }
    dp_copy_simplify(&d);
    j->big = NULL;
    if (d.ndim > JOB_DIMS) {
        j->big = PyMem_Malloc(sizeof d);
        if (j->big == NULL) {
            PyErr_NoMemory();
            return -1;
        }
        *j->big = d;
    } else {
        for (int i = 0; i < d.ndim; i++) {
            j->shape[i] = d.shape[i];
            j->src_strides[i] = d.src_strides[i];
            j->dst_strides[i] = d.dst_strides[i];
        }
    }
    j->ndim = d.ndim;
    j->itemsize = itemsize;
    j->bytes = (uint64_t)dp_copy_numel(&d) * itemsize;
queued:
    j->dst = dst;
    j->src = src;
    j->exec = route.exec;
    j->src_dev = route.src;
    j->dst_dev = route.dst;
    l->bytes += (size_t)j->bytes;
    l->n++;
    return 0;
}

int jobs_add_array(job_list *l, PyArrayObject *dst, PyArrayObject *src, copy_route route)
{
    return jobs_add(l, PyArray_NDIM(src), PyArray_SHAPE(src), (size_t)PyArray_ITEMSIZE(src),
                    PyArray_BYTES(dst), PyArray_STRIDES(dst), PyArray_BYTES(src),
                    PyArray_STRIDES(src), route);
}

/* The job's copy as a dp_copy_desc: its heap one, or *buf filled in. */
static const dp_copy_desc *job_desc(const copy_job *j, dp_copy_desc *buf)
{
    if (j->big != NULL) {
        return j->big;
    }
    buf->ndim = j->ndim;
    buf->itemsize = j->itemsize;
    for (int i = 0; i < j->ndim; i++) {
        buf->shape[i] = j->shape[i];
        buf->src_strides[i] = j->src_strides[i];
        buf->dst_strides[i] = j->dst_strides[i];
    }
    return buf;
}

/* ------------------------------------------------------------------ */
/* Copy spans (dpmini.profile)                                          */
/* ------------------------------------------------------------------ */

static void copy_spans_init(copy_spans *cs, dp_prof_ctx ctx, int path)
{
    cs->ctx = ctx;
    cs->path = path;
    cs->n = 0;
}

/* 1 when j is one contiguous run on both sides. */
static int job_contiguous(const copy_job *j)
{
    return j->big == NULL && j->ndim == 1 && j->src_strides[0] == (int64_t)j->itemsize &&
           j->dst_strides[0] == (int64_t)j->itemsize;
}

static void copy_spans_add(copy_spans *cs, const copy_job *j, uint64_t t0, uint64_t t1)
{
    /* the device a copy is for: a gather's source, anything else's destination */
    dp_device d = cs->ctx.phase == DP_PROF_GATHER ? j->src_dev : j->dst_dev;
    int k = 0;
    while (k < cs->n && !dp_device_eq(cs->dev[k].dev, d)) {
        k++;
    }
    if (k == COPY_SPAN_DEVICES) {
        copy_spans_flush(cs, 0);
        k = 0;
    }
    if (k == cs->n) {
        cs->dev[k].dev = d;
        cs->dev[k].start = t0;
        cs->dev[k].busy = cs->dev[k].bytes = 0;
        cs->dev[k].strided = 0;
        cs->n++;
    }
    cs->dev[k].busy += t1 - t0;
    cs->dev[k].bytes += j->bytes;
    cs->dev[k].strided |= !job_contiguous(j);
}

/* Each device's span starts at its first copy and lasts the time spent on
 * its copies (one thread may alternate between devices: a broadcast). */
static void copy_spans_flush(copy_spans *cs, uint64_t end_ns)
{
    for (int k = 0; k < cs->n; k++) {
        uint64_t end = end_ns > 0 ? end_ns : cs->dev[k].start + cs->dev[k].busy;
        dp_prof_record_span(&cs->ctx, DP_PROF_COPY, cs->dev[k].dev.kind, cs->dev[k].dev.index,
                            cs->dev[k].start, end, cs->dev[k].bytes, cs->path,
                            cs->dev[k].strided, NULL);
    }
    cs->n = 0;
}

static void job_run_host(const copy_job *j, int mode)
{
    dp_copy_desc buf;
    dp_copy_run_mode(job_desc(j, &buf), j->dst, j->src, mode);
}

typedef struct {
    copy_job **jobs;    /* the group's jobs, in the order they were queued */
    Py_ssize_t n;
    dp_device worker;   /* whose worker runs the group (host: the caller) */
    dpc_status status;  /* first failure of a GPU copy; code 0 when none */
    Py_ssize_t failed;  /* index of the failed job                       */
    dp_prof_ctx prof;   /* the call's recording context (profile.h)       */
    int on_caller;      /* run on the calling thread                      */
    uint64_t queued_ns; /* when it was handed to its worker (profiling), or 0 */
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
    dp_gpu_sync sync = {g->n ? gpu_index(g->jobs[0]->exec) : -1, 0};
    g->status = dpc_ok();
    /* Many small host jobs that together write more than a large job (a
     * replicate of many parameters, a scatter of many leaves) stream too:
     * what decides is how much this thread writes, not each job's size. */
    uint64_t host_bytes = 0;
    for (Py_ssize_t i = 0; i < g->n; i++) {
        if (g->jobs[i]->exec.kind != DP_CUDA) {
            host_bytes += g->jobs[i]->bytes;
        }
    }
    int mode = host_bytes >= DP_STREAM_MIN_JOB ? DP_COPY_STREAM : DP_COPY_AUTO;
    copy_spans cs;
    copy_spans_init(&cs, g->prof, sync.dev >= 0 ? DP_PROF_PATH_GPU
                                  : mode == DP_COPY_STREAM ? DP_PROF_PATH_STREAM
                                  : g->on_caller ? DP_PROF_PATH_INLINE : DP_PROF_PATH_WORKER);
    uint64_t t0 = cs.ctx.s != NULL ? dp_prof_now() : 0;
    if (g->queued_ns != 0 && g->n > 0) {
        /* the time the group waited for its worker thread to run */
        const copy_job *j = g->jobs[0];
        dp_device d = cs.ctx.phase == DP_PROF_GATHER ? j->src_dev : j->dst_dev;
        dp_prof_record_span(&cs.ctx, DP_PROF_WAIT, d.kind, d.index, g->queued_ns, t0, 0,
                            DP_PROF_PATH_NONE, 0, "worker start");
    }
    for (Py_ssize_t i = 0; i < g->n; i++) {
        copy_job *j = g->jobs[i];
        dp_copy_desc buf;
        const dp_copy_desc *d = job_desc(j, &buf);
        if (j->exec.kind != DP_CUDA) {
            dp_copy_run_mode(d, j->dst, j->src, mode);
        } else {
            dpc_status s = dp_gpu_copy(d, j->dst, gpu_index(j->dst_dev), j->src,
                                       gpu_index(j->src_dev), (int)i, &sync);
            if (s.code != 0) {
                g->status = s;
                g->failed = i;
                break;
            }
        }
        if (cs.ctx.s != NULL) {
            uint64_t t1 = dp_prof_now();
            copy_spans_add(&cs, j, t0, t1);
            t0 = t1;
        }
    }
    dpc_status s = dp_gpu_sync_finish(&sync);
    if (s.code != 0 && g->status.code == 0) {
        g->status = s;
        g->failed = 0;
    }
    if (cs.ctx.s != NULL) {
        /* GPU copies end when their streams are synced */
        copy_spans_flush(&cs, sync.dev >= 0 ? dp_prof_now() : 0);
    }
}

/* The funnel for a failed group: names the copy's two devices. */
static int group_error(job_group *g)
{
    char op[96], a[32], b[32];
    copy_job *j = g->jobs[g->failed];
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

static int exec_before(const copy_job *x, const copy_job *y)
{
    if (x->exec.kind != y->exec.kind) {
        return x->exec.kind - y->exec.kind;
    }
    return x->exec.index - y->exec.index;
}

/* The rank of a job's executing device in exec_before's order: the host,
 * then the virtual CPU devices, then the GPUs, each by index. */
#define EXEC_KEYS (1 + 2 * DP_POOL_MAX_INDEX)
static int exec_key(const copy_job *j)
{
    if (j->exec.kind == DP_HOST) {
        return 0;
    }
    int i = j->exec.index < 0 ? 0 : j->exec.index >= DP_POOL_MAX_INDEX
            ? DP_POOL_MAX_INDEX - 1 : j->exec.index;   /* never out of range; a
               clamped key would only cut one device's jobs into two groups */
    return 1 + (j->exec.kind == DP_CUDA ? DP_POOL_MAX_INDEX : 0) + i;
}

/* 1 when a group has a CUDA job: it waits on streams (slot 0 is shared with
 * large copies and NCCL), so it never runs with the GIL held. */
static int group_has_cuda(const job_group *g)
{
    for (Py_ssize_t i = 0; i < g->n; i++) {
        if (g->jobs[i]->exec.kind == DP_CUDA) {
            return 1;
        }
    }
    return 0;
}

/* The jobs ordered by executing device (each device's in queue order) in
 * *order (PyMem), cut into groups of one device each in *groups (PyMem);
 * *ng groups. Pointers are sorted, not the jobs (a few hundred bytes each). */
static int group_jobs(copy_job *jobs, Py_ssize_t njobs, copy_job ***order, job_group **groups,
                      Py_ssize_t *ng)
{
    copy_job **o = PyMem_Malloc((size_t)njobs * sizeof *o);
    job_group *g = o != NULL ? PyMem_Malloc((size_t)njobs * sizeof *g) : NULL;
    if (g == NULL) {
        PyMem_Free(o);
        PyErr_NoMemory();
        return -1;
    }
    int sorted = 1;
    for (Py_ssize_t i = 0; i < njobs && sorted; i++) {
        sorted = i == 0 || exec_before(&jobs[i - 1], &jobs[i]) <= 0;
    }
    if (sorted) {
        for (Py_ssize_t i = 0; i < njobs; i++) {
            o[i] = &jobs[i];
        }
    } else {
        /* a counting sort by device: stable, one pass to count, one to place */
        Py_ssize_t *at = PyMem_Calloc(EXEC_KEYS + 1, sizeof *at);
        if (at == NULL) {
            PyMem_Free(o);
            PyMem_Free(g);
            PyErr_NoMemory();
            return -1;
        }
        for (Py_ssize_t i = 0; i < njobs; i++) {
            at[exec_key(&jobs[i]) + 1]++;
        }
        for (int k = 0; k < EXEC_KEYS; k++) {
            at[k + 1] += at[k];
        }
        for (Py_ssize_t i = 0; i < njobs; i++) {
            o[at[exec_key(&jobs[i])]++] = &jobs[i];
        }
        PyMem_Free(at);
    }
    Py_ssize_t n = 0;
    for (Py_ssize_t i = 0; i < njobs; i++) {
        if (i == 0 || !dp_device_eq(o[i]->exec, o[i - 1]->exec)) {
            g[n].jobs = &o[i];
            g[n].n = 0;
            g[n].worker = o[i]->exec;
            g[n].status = dpc_ok();
            g[n].failed = 0;
            n++;
        }
        g[n - 1].n++;
    }
    *order = o;
    *groups = g;
    *ng = n;
    return 0;
}

/* ------------------------------------------------------------------ */
/* Grouping by cores (host and virtual CPU memory only)                */
/* ------------------------------------------------------------------ */

/* 1 when every job copies between host and virtual CPU memory on a virtual
 * CPU device's worker: which worker runs it changes nothing but speed. */
static int jobs_cpu_only(const copy_job *jobs, Py_ssize_t n)
{
    for (Py_ssize_t i = 0; i < n; i++) {
        if (jobs[i].exec.kind != DP_VCPU || jobs[i].src_dev.kind == DP_CUDA ||
            jobs[i].dst_dev.kind == DP_CUDA) {
            return 0;
        }
    }
    return 1;
}

/* Rows [r0, r1) of job j's outermost dim (simplified: every row the same
 * bytes) as *piece. */
static void job_rows(const copy_job *j, int64_t r0, int64_t r1, copy_job *piece)
{
    *piece = *j;
    piece->shape[0] = r1 - r0;
    piece->src = j->src + r0 * j->src_strides[0];
    piece->dst = j->dst + r0 * j->dst_strides[0];
    piece->bytes = j->bytes / (uint64_t)j->shape[0] * (uint64_t)(r1 - r0);
}

/* The row of job j (rows of row_bytes) nearest to byte `at` of it, rounded
 * to a 4 KiB multiple of bytes where a row divides 4 KiB (a contiguous run
 * cut into pages keeps the streaming stores aligned), within [0, rows]. */
static int64_t cut_row(uint64_t at, uint64_t row_bytes, int64_t rows)
{
    uint64_t r = (at + row_bytes / 2) / row_bytes;
    if (row_bytes < 4096 && 4096 % row_bytes == 0) {
        uint64_t step = 4096 / row_bytes;
        r = (r + step / 2) / step * step;
    }
    return r > (uint64_t)rows ? rows : (int64_t)r;
}

/* Mark virtual CPU device d in seen[]. */
static void mark_vcpu(unsigned char *seen, dp_device d)
{
    if (d.kind == DP_VCPU && d.index >= 0 && d.index < DP_POOL_MAX_INDEX) {
        seen[d.index] = 1;
    }
}

/* The virtual CPU devices the jobs touch into workers, by index, and the
 * jobs' bytes into *total. The number of groups: one per such device, at
 * most one per core, at least one (then on cpu:0). */
static int cpu_workers(const copy_job *jobs, Py_ssize_t njobs, int *workers, uint64_t *total)
{
    unsigned char seen[DP_POOL_MAX_INDEX] = {0};
    int nw = 0;
    *total = 0;
    for (Py_ssize_t i = 0; i < njobs; i++) {
        mark_vcpu(seen, jobs[i].exec);
        mark_vcpu(seen, jobs[i].src_dev);
        mark_vcpu(seen, jobs[i].dst_dev);
        *total += jobs[i].bytes;
    }
    for (int x = 0; x < DP_POOL_MAX_INDEX; x++) {
        if (seen[x]) {
            workers[nw++] = x;
        }
    }
    int cores = dp_pool_cores();
    int G = nw < cores ? nw : cores;
    if (G < 1) {
        G = 1;
        workers[0] = 0;
    }
    return G;
}

/* group_cpu's cut of the queue into G runs of about equal bytes, in
 * progress. */
typedef struct {
    copy_job **o;         /* the order: pointers to jobs and pieces          */
    copy_job *pieces;     /* the split pieces                                */
    job_group *g;         /* the groups; g[n] is being filled                */
    Py_ssize_t k, np, n;  /* pointers, pieces, groups done                   */
    int cut, G;           /* the next cut: at byte total * cut / G           */
    uint64_t total, pos;  /* all bytes; bytes of the jobs before this one    */
} cpu_cut;

/* Past a cut: a new group starts unless the current one is still empty. */
static void next_group(cpu_cut *c)
{
    if (c->g[c->n].n > 0) {
        c->n++;
        c->g[c->n].jobs = &c->o[c->k];
        c->g[c->n].n = 0;
    }
    c->cut++;
}

/* Job j into the order, split by rows at each cut that falls inside it. */
static void cut_job(cpu_cut *c, copy_job *j)
{
    int split = j->big == NULL && j->ndim >= 1 && j->shape[0] > 1;
    int64_t rows = split ? j->shape[0] : 1, done = 0;
    uint64_t row_bytes = j->bytes / (uint64_t)rows;
    while (c->cut < c->G) {
        uint64_t at = (uint64_t)((unsigned __int128)c->total * (unsigned)c->cut /
                                 (unsigned)c->G);
        if (at >= c->pos + j->bytes) {
            break;    /* beyond this job (or at its end: the next job starts there) */
        }
        int64_t r = at <= c->pos ? 0 : cut_row(at - c->pos, row_bytes, rows);
        if (r >= rows) {
            break;    /* nearer the end: the next job takes the cut */
        }
        if (r > done) {
            job_rows(j, done, r, &c->pieces[c->np]);
            c->o[c->k++] = &c->pieces[c->np++];
            c->g[c->n].n++;
            done = r;
        }
        next_group(c);
    }
    if (done == 0) {
        c->o[c->k++] = j;
    } else {
        job_rows(j, done, rows, &c->pieces[c->np]);
        c->o[c->k++] = &c->pieces[c->np++];
    }
    c->g[c->n].n++;
    c->pos += j->bytes;
}

/* Group the jobs (jobs_cpu_only) into one group per core, at most one per
 * virtual CPU device the copies touch (executing device, source or
 * destination: a gather of two parts onto cpu:0 copies on two cores, not
 * one): the queue order is cut
 * into `ngroups` runs of about equal bytes, a job that straddles a cut
 * split by rows. Group k runs on the k-th of those devices (by index),
 * whoever the copies' destinations are. Queue order keeps a broadcast's
 * copies of one array together (replicate: the second copy reads the source
 * from cache), and no more threads copy than the cores can run (4 devices
 * on 2 cores). *order (PyMem) holds the pointers and the split pieces;
 * *groups (PyMem); *ng groups, each with jobs. */
static int group_cpu(copy_job *jobs, Py_ssize_t njobs, copy_job ***order, job_group **groups,
                     Py_ssize_t *ng)
{
    int workers[DP_POOL_MAX_INDEX];
    uint64_t total;
    int G = cpu_workers(jobs, njobs, workers, &total);
    /* pointers, then the pieces: each cut adds at most two (its two sides) */
    Py_ssize_t npieces = 2 * (Py_ssize_t)G;
    size_t head = (size_t)(njobs + npieces) * sizeof(copy_job *);
    char *block = PyMem_Malloc(head + (size_t)npieces * sizeof(copy_job));
    job_group *g = block != NULL ? PyMem_Malloc((size_t)G * sizeof *g) : NULL;
    if (g == NULL) {
        PyMem_Free(block);
        PyErr_NoMemory();
        return -1;
    }
    cpu_cut c = {(copy_job **)block, (copy_job *)(block + head), g, 0, 0, 0, 1, G, total, 0};
    g[0].jobs = c.o;
    g[0].n = 0;
    for (Py_ssize_t i = 0; i < njobs; i++) {
        cut_job(&c, &jobs[i]);
    }
    Py_ssize_t n = c.n + (g[c.n].n > 0);
    for (Py_ssize_t x = 0; x < n; x++) {
        g[x].worker = (dp_device){DP_VCPU, workers[x]};
        g[x].status = dpc_ok();
        g[x].failed = 0;
    }
    *order = c.o;
    *groups = g;
    *ng = n;
    return 0;
}

/* The groups jobs_launch and jobs_run hand to the workers: by cores for
 * host and virtual CPU copies (group_cpu), else one per executing device. */
static int make_groups(copy_job *jobs, Py_ssize_t njobs, copy_job ***order, job_group **groups,
                       Py_ssize_t *ng)
{
    if (njobs > 0 && jobs_cpu_only(jobs, njobs)) {
        return group_cpu(jobs, njobs, order, groups, ng);
    }
    return group_jobs(jobs, njobs, order, groups, ng);
}

/* Host copies of a few hundred KiB in all: here, in queue order (none
 * streams below DP_STREAM_MIN_JOB). 1 when every job is a host job and all
 * ran, 0 (nothing run) when one is a CUDA job. */
static int run_small_inline(copy_job *jobs, Py_ssize_t n)
{
    for (Py_ssize_t i = 0; i < n; i++) {
        if (jobs[i].exec.kind == DP_CUDA) {
            return 0;
        }
    }
    copy_spans cs;
    copy_spans_init(&cs, dp_prof_current(), DP_PROF_PATH_INLINE);
    uint64_t t0 = cs.ctx.s != NULL ? dp_prof_now() : 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        copy_job *j = &jobs[i];
        dp_copy_desc buf;
        dp_copy_run_mode(job_desc(j, &buf), j->dst, j->src, DP_COPY_AUTO);
        if (cs.ctx.s != NULL) {
            uint64_t t1 = dp_prof_now();
            copy_spans_add(&cs, j, t0, t1);
            t0 = t1;
        }
    }
    copy_spans_flush(&cs, 0);
    return 1;
}

/* The first failed group's error raised: 0, or -1. */
static int groups_status(job_group *groups, Py_ssize_t ng)
{
    for (Py_ssize_t g = 0; g < ng; g++) {
        if (groups[g].status.code != 0) {
            return group_error(&groups[g]);
        }
    }
    return 0;
}

/* One group per executing device, run here one after another (the GIL
 * released unless small and host-only); stops at the first failure. 0 or
 * -1. */
static int run_groups_here(job_group *groups, Py_ssize_t ng, int small)
{
    for (Py_ssize_t g = 0; g < ng; g++) {
        if (small && !group_has_cuda(&groups[g])) {
            run_group(&groups[g]);
        } else {
            Py_BEGIN_ALLOW_THREADS
            run_group(&groups[g]);
            Py_END_ALLOW_THREADS
        }
        if (groups[g].status.code != 0) {
            return group_error(&groups[g]);
        }
    }
    return 0;
}

/* Every group on its worker, all at once, the GIL released (a host group,
 * or one no worker takes, runs on the caller). 0, or -1 (OSError when no
 * batch could be made). */
static int run_groups_on_workers(job_group *groups, Py_ssize_t ng, dp_prof_ctx prof)
{
    int err;
    Py_BEGIN_ALLOW_THREADS
    dp_batch batch;
    err = dp_batch_init(&batch);
    if (err == 0) {
        for (Py_ssize_t g = 0; g < ng; g++) {
            dp_device ex = groups[g].worker;
            groups[g].queued_ns = prof.s != NULL && ex.kind != DP_HOST ? dp_prof_now() : 0;
            if (ex.kind == DP_HOST ||
                dp_batch_submit(&batch, ex.kind, ex.index, run_group, &groups[g]) != 0) {
                run_group(&groups[g]); /* no worker: the caller does it */
            }
        }
        dp_batch_wait(&batch, -1);
        dp_batch_destroy(&batch);
    }
    Py_END_ALLOW_THREADS
    if (err != 0) {
        errno = err;
        PyErr_SetFromErrno(PyExc_OSError);
        return -1;
    }
    return groups_status(groups, ng);
}

/* jobs_run for the jobs not launched yet: each group (make_groups) on its
 * worker, all at once, the GIL released. Small totals, host-only jobs, and
 * calls made from inside a worker (a replica) run inline (the GIL released
 * for CUDA jobs). */
static int run_rest(job_list *l)
{
    copy_job *jobs = l->jobs + l->launched;
    Py_ssize_t n = l->n - l->launched;
    if (n == 0) {
        return 0;
    }
    int small = l->bytes - l->launched_bytes < DP_INLINE_BYTES;
    if (small && run_small_inline(jobs, n)) {
        return 0;
    }
    copy_job **order;
    job_group *groups;
    Py_ssize_t ng;
    int here = small || dp_pool_in_worker();
    if ((here ? group_jobs(jobs, n, &order, &groups, &ng)
              : make_groups(jobs, n, &order, &groups, &ng)) < 0) {
        return -1;
    }
    dp_prof_ctx prof = dp_prof_current();
    for (Py_ssize_t g = 0; g < ng; g++) {
        groups[g].prof = prof;
        groups[g].on_caller = here || groups[g].worker.kind == DP_HOST;
        groups[g].queued_ns = 0;
    }
    int rc = here ? run_groups_here(groups, ng, small)
                  : run_groups_on_workers(groups, ng, prof);
    PyMem_Free(groups);
    PyMem_Free(order);
    return rc;
}

int jobs_run(job_list *l)
{
    if (l->feed != NULL) {
        (void)jobs_launch(l);   /* the rest too, when the feed can take them */
        jobs_feed_end(l, 0);
    }
    return run_rest(l);
}

/* ------------------------------------------------------------------ */
/* The feed                                                           */
/* ------------------------------------------------------------------ */

/* Bytes a consumer claims at a time: enough to make a claim's lock cheap
 * against its copy, small enough that the consumers end together. */
#define FEED_CHUNK ((uint64_t)1 << 19)

struct job_feed {
    pthread_mutex_t mu;
    pthread_cond_t cv;      /* signalled when jobs are published or the feed closes */
    const copy_job *jobs;   /* the list's jobs (they never move while the feed runs) */
    Py_ssize_t published;   /* jobs [0, published) may be claimed; guarded by mu */
    Py_ssize_t claimed;     /* jobs [0, claimed) are claimed; guarded by mu */
    int closed;             /* no more jobs come; guarded by mu */
    dp_batch batch;         /* the consumers */
    dp_prof_ctx prof;       /* the call's recording context (profile.h) */
};

/* A consumer (a device worker, no GIL): claims and copies runs of jobs until
 * the feed is closed and empty. A run ends at a job boundary past
 * FEED_CHUNK bytes, and never between two copies of one source (a
 * broadcast's second copy then reads the source from this core's cache). */
static void feed_consume(void *arg)
{
    struct job_feed *f = arg;
    copy_spans cs;
    copy_spans_init(&cs, f->prof, DP_PROF_PATH_FEED);
    pthread_mutex_lock(&f->mu);
    for (;;) {
        if (f->claimed == f->published && cs.n > 0) {
            copy_spans_flush(&cs, 0);   /* a busy stretch ends */
        }
        while (f->claimed == f->published && !f->closed) {
            pthread_cond_wait(&f->cv, &f->mu);
        }
        if (f->claimed == f->published) {
            break;
        }
        Py_ssize_t from = f->claimed, to = from;
        uint64_t bytes = 0;
        while (to < f->published &&
               (bytes < FEED_CHUNK || f->jobs[to].src == f->jobs[to - 1].src)) {
            bytes += f->jobs[to].bytes;
            to++;
        }
        f->claimed = to;
        pthread_mutex_unlock(&f->mu);
        uint64_t t0 = cs.ctx.s != NULL ? dp_prof_now() : 0;
        for (Py_ssize_t i = from; i < to; i++) {
            job_run_host(&f->jobs[i], DP_COPY_STREAM);
            if (cs.ctx.s != NULL) {
                uint64_t t1 = dp_prof_now();
                copy_spans_add(&cs, &f->jobs[i], t0, t1);
                t0 = t1;
            }
        }
        pthread_mutex_lock(&f->mu);
    }
    pthread_mutex_unlock(&f->mu);
    copy_spans_flush(&cs, 0);
}

/* Publish jobs [0, n) (GIL held; the lock is never held long). */
static void feed_publish(struct job_feed *f, Py_ssize_t n, int close)
{
    pthread_mutex_lock(&f->mu);
    f->published = n;
    f->closed |= close;
    pthread_cond_broadcast(&f->cv);
    pthread_mutex_unlock(&f->mu);
}

/* Close the feed, wait for its consumers (the GIL released) and free it.
 * drop: the jobs not claimed yet are dropped (an error path). */
static void jobs_feed_end(job_list *l, int drop)
{
    struct job_feed *f = l->feed;
    if (f == NULL) {
        return;
    }
    pthread_mutex_lock(&f->mu);
    if (drop) {
        f->published = f->claimed;
    }
    f->closed = 1;
    pthread_cond_broadcast(&f->cv);
    pthread_mutex_unlock(&f->mu);
    Py_BEGIN_ALLOW_THREADS
    dp_batch_wait(&f->batch, -1);
    Py_END_ALLOW_THREADS
    dp_batch_destroy(&f->batch);
    pthread_cond_destroy(&f->cv);
    pthread_mutex_destroy(&f->mu);
    PyMem_Free(f);
    l->feed = NULL;
}

/* Start the consumers: one per core, at most one per virtual CPU device the
 * queued jobs go through, each on one of those devices' workers. 1 when at
 * least one started, 0 when none could (jobs_run copies), -1 on error. */
static int feed_start(job_list *l)
{
    unsigned char seen[DP_POOL_MAX_INDEX] = {0};
    for (Py_ssize_t i = 0; i < l->n; i++) {
        int x = l->jobs[i].exec.index;
        seen[x >= 0 && x < DP_POOL_MAX_INDEX ? x : 0] = 1;
    }
    struct job_feed *f = PyMem_Calloc(1, sizeof *f);
    if (f == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    if (pthread_mutex_init(&f->mu, NULL) != 0) {
        goto no_mutex;
    }
    if (pthread_cond_init(&f->cv, NULL) != 0) {
        goto no_cond;
    }
    if (dp_batch_init(&f->batch) != 0) {
        goto no_batch;
    }
    f->jobs = l->jobs;
    f->published = l->n;
    f->prof = dp_prof_current();
    int want = dp_pool_cores(), started = 0;
    for (int x = 0; x < DP_POOL_MAX_INDEX && started < want; x++) {
        if (seen[x] && dp_batch_submit(&f->batch, DP_VCPU, x, feed_consume, f) == 0) {
            started++;
        }
    }
    if (started > 0) {
        l->feed = f;
        return 1;
    }
    dp_batch_destroy(&f->batch);   /* none started: jobs_run copies instead */
no_batch:
    pthread_cond_destroy(&f->cv);
no_cond:
    pthread_mutex_destroy(&f->mu);
no_mutex:
    PyMem_Free(f);
    return 0;
}

/* 1 when jobs [from, l->n) only touch host and virtual CPU memory (the
 * feed's kind: GPU copies report errors, so they run in jobs_run). */
static int host_only(const job_list *l, Py_ssize_t from)
{
    for (Py_ssize_t i = from; i < l->n; i++) {
        if (l->jobs[i].exec.kind != DP_VCPU || l->jobs[i].src_dev.kind == DP_CUDA ||
            l->jobs[i].dst_dev.kind == DP_CUDA) {
            return 0;
        }
    }
    return 1;
}

int jobs_launch(job_list *l)
{
    if (l->n == l->launched) {
        return l->feed != NULL;
    }
    if (l->feed == NULL) {
        if (dp_pool_in_worker() || !host_only(l, 0)) {
            return 0;
        }
        int r = feed_start(l);
        if (r <= 0) {
            return r;
        }
    } else {
        if (!host_only(l, l->launched)) {
            return 0;   /* left for jobs_run, after the feed ends */
        }
        feed_publish(l->feed, l->n, 0);
    }
    l->launched = l->n;
    l->launched_bytes = l->bytes;
    return 1;
}
