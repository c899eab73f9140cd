/* copy_engine.c - the copy engine: copy jobs (strided copies between host,
 * virtual CPU devices and GPUs), grouped per executing device and run on the
 * device worker threads (pool.c); the overlap checks on out= arrays; and the
 * array-level scatter, gather and broadcast that DataParallel and
 * dpmini.comm build on (dp_scatter_run, dp_gather_arrays, dp_copy_to_device,
 * dp_broadcast_coalesced). The Python functions are in comm.c, reduce_add
 * in reduce.c; what they share is in copy_engine.h.
 *
 * Sections: copy jobs; helpers; scatter; gather; broadcast.
 */
#include "dpmini.h"
#include "engine.h"
#include "gpu.h"
#include "copy_engine.h"
#include "plan.h"
#include "copy.h"
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

/* Refuse an out= destination that the copy engine cannot write correctly
 * (PyTorch's assert_no_internal_overlap / assert_no_partial_overlap): dst
 * writing one byte from two elements (a zero stride, overlapping strides),
 * or dst sharing memory with any of srcs (a conservative bounds check,
 * copy.c). ValueError naming argname (and srcname[i] when nsrc > 1). */
int check_out_overlap(PyArrayObject *dst, PyArrayObject *const *srcs, Py_ssize_t nsrc,
                      const char *argname, const char *srcname)
{
    int64_t sh[DP_MAXDIMS], dst_st[DP_MAXDIMS], src_sh[DP_MAXDIMS], src_st[DP_MAXDIMS];
    int nd = PyArray_NDIM(dst);
    size_t item = (size_t)PyArray_ITEMSIZE(dst);
    for (int d = 0; d < nd; d++) {
        sh[d] = PyArray_DIM(dst, d);
        dst_st[d] = PyArray_STRIDE(dst, d);
    }
    if (dp_layout_has_internal_overlap(nd, sh, dst_st, item)) {
        PyErr_Format(PyExc_ValueError,
                     "%s: unsupported operation: more than one element of the written-to "
                     "array refers to a single memory location (a zero or overlapping "
                     "stride); pass an array with its own memory, e.g. numpy.empty_like(...)",
                     argname);
        return -1;
    }
    for (Py_ssize_t i = 0; i < nsrc; i++) {
        PyArrayObject *src = srcs[i];
        int snd = PyArray_NDIM(src);
        for (int d = 0; d < snd; d++) {
            src_sh[d] = PyArray_DIM(src, d);
            src_st[d] = PyArray_STRIDE(src, d);
        }
        if (dp_layouts_may_overlap(PyArray_BYTES(dst), nd, sh, dst_st, item,
                                   PyArray_BYTES(src), snd, src_sh, src_st,
                                   (size_t)PyArray_ITEMSIZE(src))) {
            if (nsrc > 1) {
                PyErr_Format(PyExc_ValueError,
                             "%s: unsupported operation: the written-to array overlaps the "
                             "memory of %s[%zd] (some elements of the input and the output "
                             "may refer to a single memory location); use a separate output "
                             "array", argname, srcname, i);
            } else {
                PyErr_Format(PyExc_ValueError,
                             "%s: unsupported operation: the written-to array overlaps the "
                             "memory of %s (some elements of the input and the output may "
                             "refer to a single memory location); use a separate output "
                             "array", argname, srcname);
            }
            return -1;
        }
    }
    return 0;
}

/* Refuse out[i] and out[j] (i < j) sharing memory: each is written by its
 * own job, possibly at the same time, so the result would be undefined. */
int check_outs_disjoint(PyArrayObject *const *outs, Py_ssize_t n)
{
    char name[48];
    for (Py_ssize_t j = 1; j < n; j++) {
        PyOS_snprintf(name, sizeof name, "out[%zd]", j);
        for (Py_ssize_t i = 0; i < j; i++) {
            int64_t a_sh[DP_MAXDIMS], a_st[DP_MAXDIMS], b_sh[DP_MAXDIMS], b_st[DP_MAXDIMS];
            for (int d = 0; d < PyArray_NDIM(outs[i]); d++) {
                a_sh[d] = PyArray_DIM(outs[i], d);
                a_st[d] = PyArray_STRIDE(outs[i], d);
            }
            for (int d = 0; d < PyArray_NDIM(outs[j]); d++) {
                b_sh[d] = PyArray_DIM(outs[j], d);
                b_st[d] = PyArray_STRIDE(outs[j], d);
            }
            if (dp_layouts_may_overlap(PyArray_BYTES(outs[i]), PyArray_NDIM(outs[i]), a_sh,
                                       a_st, (size_t)PyArray_ITEMSIZE(outs[i]),
                                       PyArray_BYTES(outs[j]), PyArray_NDIM(outs[j]), b_sh,
                                       b_st, (size_t)PyArray_ITEMSIZE(outs[j]))) {
                PyErr_Format(PyExc_ValueError,
                             "%s: unsupported operation: the written-to array overlaps the "
                             "memory of out[%zd]; pass separate output arrays", name, i);
                return -1;
            }
        }
    }
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

/* ------------------------------------------------------------------ */
/* Helpers                                                             */
/* ------------------------------------------------------------------ */

/* The route of a copy between src and dst: run by the worker of a CUDA side
 * when there is one, else of the destination unless it is the host. */
copy_route exec_device(dp_device src, dp_device dst)
{
    copy_route r = {src, dst, dst.kind != DP_HOST ? dst : src};
    if (dst.kind != DP_CUDA && src.kind == DP_CUDA) {
        r.exec = src;
    }
    return r;
}

/* A view of src with `shape`, starting at `data`, same strides (spec 3.4). */
static PyObject *make_view(PyArrayObject *src, char *data, const npy_intp *shape)
{
    PyArray_Descr *descr = PyArray_DESCR(src);
    Py_INCREF(descr);
    PyObject *v = PyArray_NewFromDescr(&PyArray_Type, descr, PyArray_NDIM(src),
                                       (npy_intp *)shape, PyArray_STRIDES(src), data,
                                       PyArray_FLAGS(src) & NPY_ARRAY_WRITEABLE, NULL);
    if (v == NULL) {
        return NULL;
    }
    Py_INCREF(src);
    if (PyArray_SetBaseObject((PyArrayObject *)v, (PyObject *)src) < 0) {
        Py_DECREF(v);
        return NULL;
    }
    return v;
}

/* A fresh array on dev for a copy of the strided region (data of `src`'s
 * dtype, `shape`, `strides`): a dense region keeps its layout (PyTorch's
 * memory_format=preserve), anything else becomes C-contiguous. */
static PyArrayObject *empty_like_region(dp_state *st, dp_device dev, PyArrayObject *src,
                                        const npy_intp *shape, const npy_intp *strides)
{
    int nd = PyArray_NDIM(src);
    size_t itemsize = (size_t)PyArray_ITEMSIZE(src);
    int64_t sh[DP_MAXDIMS], sd[DP_MAXDIMS], out[DP_MAXDIMS];
    int perm[DP_MAXDIMS];
    npy_intp new_strides[DP_MAXDIMS];
    const npy_intp *use = NULL;
    for (int i = 0; i < nd; i++) {
        sh[i] = shape[i];
        sd[i] = strides[i];
    }
    if (nd > 1 && itemsize > 0 && dp_layout_is_dense(nd, sh, sd, itemsize, perm)) {
        dp_dense_strides(nd, sh, itemsize, perm, out);
        for (int i = 0; i < nd; i++) {
            new_strides[i] = (npy_intp)out[i];
        }
        use = new_strides;
    }
    PyArray_Descr *descr = PyArray_DESCR(src);
    Py_INCREF(descr);
    return dp_empty(st, dev, descr, nd, shape, use);
}

PyObject *devices_error(const char *argname)
{
    PyErr_Format(PyExc_ValueError, "%s: Expected at least one device to scatter to", argname);
    return NULL;
}

/* ------------------------------------------------------------------ */
/* Scatter                                                             */
/* ------------------------------------------------------------------ */

int dp_scatter_run(dp_state *st, dp_scatter_item *items, int nitems, const dp_device *devs)
{
    job_list jobs = {0};
    int i, j;
    for (i = 0; i < nitems; i++) {
        for (j = 0; j < items[i].nchunks; j++) {
            items[i].out[j] = NULL;
        }
    }
    for (i = 0; i < nitems; i++) {
        dp_scatter_item *it = &items[i];
        PyArrayObject *src = it->src;
        int nd = PyArray_NDIM(src);
        npy_intp shape[DP_MAXDIMS];
        memcpy(shape, PyArray_SHAPE(src), (size_t)nd * sizeof(npy_intp));
        dp_device home = dp_array_device(st, src);
        npy_intp stride = PyArray_STRIDES(src)[it->dim];
        int64_t offset = 0;
        for (j = 0; j < it->nchunks; j++) {
            char *data = PyArray_BYTES(src) + offset * stride;
            shape[it->dim] = (npy_intp)it->sizes[j];
            offset += it->sizes[j];
            if (dp_device_eq(devs[j], home)) {
                it->out[j] = make_view(src, data, shape);
                if (it->out[j] == NULL) {
                    goto fail;
                }
                continue;
            }
            PyArrayObject *dst = empty_like_region(st, devs[j], src, shape,
                                                   PyArray_STRIDES(src));
            if (dst == NULL) {
                goto fail;
            }
            it->out[j] = (PyObject *)dst;
            if (jobs_add(&jobs, nd, shape, (size_t)PyArray_ITEMSIZE(src),
                         PyArray_BYTES(dst), PyArray_STRIDES(dst), data,
                         PyArray_STRIDES(src), exec_device(home, devs[j])) < 0) {
                goto fail;
            }
        }
    }
    if (jobs_run(&jobs) < 0) {
        goto fail;
    }
    jobs_free(&jobs);
    for (i = 0; i < nitems; i++) { /* chunks on GPUs leave as dpmini.Array */
        for (j = 0; j < items[i].nchunks; j++) {
            items[i].out[j] = dp_export(st, items[i].out[j]);
            if (items[i].out[j] == NULL) {
                goto fail;
            }
        }
    }
    return 0;
fail:
    jobs_free(&jobs);
    for (i = 0; i < nitems; i++) {
        for (j = 0; j < items[i].nchunks; j++) {
            Py_CLEAR(items[i].out[j]);
        }
    }
    return -1;
}
/* ------------------------------------------------------------------ */
/* Gather                                                              */
/* ------------------------------------------------------------------ */

PyObject *shape_str(int nd, const npy_intp *shape)
{
    PyObject *parts = PyList_New(nd);
    if (parts == NULL) {
        return NULL;
    }
    for (int i = 0; i < nd; i++) {
        PyObject *s = PyUnicode_FromFormat("%zd", (Py_ssize_t)shape[i]);
        if (s == NULL) {
            Py_DECREF(parts);
            return NULL;
        }
        PyList_SET_ITEM(parts, i, s);
    }
    PyObject *sep = PyUnicode_FromString(", ");
    PyObject *joined = sep ? PyUnicode_Join(sep, parts) : NULL;
    Py_XDECREF(sep);
    Py_DECREF(parts);
    if (joined == NULL) {
        return NULL;
    }
    PyObject *res = PyUnicode_FromFormat("[%U]", joined);
    Py_DECREF(joined);
    return res;
}

static void shape_error(const char *argname, Py_ssize_t i, PyArrayObject *part,
                        const npy_intp *expected, int nd)
{
    PyObject *got = shape_str(nd, PyArray_SHAPE(part));
    PyObject *exp = got ? shape_str(nd, expected) : NULL;
    if (exp != NULL) {
        PyErr_Format(PyExc_ValueError,
                     "%s: Input array at index %zd has invalid shape %U, but expected %U",
                     argname, i, got, exp);
    }
    Py_XDECREF(got);
    Py_XDECREF(exp);
}

PyObject *dp_gather_arrays(dp_state *st, PyArrayObject **parts, Py_ssize_t n, int dim,
                           dp_device dest, PyArrayObject *out, const char *argname)
{
    job_list jobs = {0};
    PyArrayObject *result = NULL;
    npy_intp shape[DP_MAXDIMS];
    Py_ssize_t i;

    if (n == 0) {
        PyErr_Format(PyExc_ValueError, "%s: Expected at least one array to gather from",
                     argname);
        return NULL;
    }
    int nd = PyArray_NDIM(parts[0]);
    if (dim < 0 || dim >= nd) {
        PyErr_Format(PyExc_IndexError, "%s: dim %d out of range for %d-dim arrays", argname,
                     dim, nd);
        return NULL;
    }
    memcpy(shape, PyArray_SHAPE(parts[0]), (size_t)nd * sizeof(npy_intp));
    int64_t total = 0;
    for (i = 0; i < n; i++) {
        PyArrayObject *p = parts[i];
        if (PyArray_NDIM(p) != nd) {
            PyErr_Format(PyExc_ValueError,
                         "%s: Expected all arrays to have the same number of dimensions, but "
                         "array at index %zd has %d dimensions, (expected %d)",
                         argname, i, PyArray_NDIM(p), nd);
            return NULL;
        }
        if (PyDataType_REFCHK(PyArray_DESCR(p))) {
            PyErr_Format(PyExc_TypeError, "%s: array at index %zd holds Python objects "
                         "(dtype %S); they cannot be gathered", argname, i,
                         (PyObject *)PyArray_DESCR(p));
            return NULL;
        }
        shape[dim] = PyArray_DIM(p, dim);
        for (int d = 0; d < nd; d++) {
            if (PyArray_DIM(p, d) != shape[d]) {
                shape_error(argname, i, p, shape, nd);
                return NULL;
            }
        }
        /* Shapes of strided views (zero strides) can be huge: a wrapped sum
         * would allocate too little and copy past it (reliability.md, bug 2). */
        if (__builtin_add_overflow(total, (int64_t)PyArray_DIM(p, dim), &total) ||
            total > NPY_MAX_INTP) {
            PyErr_Format(PyExc_ValueError,
                         "%s: the gathered size along dimension %d is larger than %zd "
                         "(at array index %zd)", argname, dim, (Py_ssize_t)NPY_MAX_INTP, i);
            return NULL;
        }
    }
    shape[dim] = (npy_intp)total;
    if (out != NULL) {
        int bad = PyArray_NDIM(out) != nd;
        for (int d = 0; !bad && d < nd; d++) {
            bad = PyArray_DIM(out, d) != shape[d];
        }
        if (bad) {
            PyObject *exp = shape_str(nd, shape);
            PyObject *got = exp ? shape_str(PyArray_NDIM(out), PyArray_SHAPE(out)) : NULL;
            if (got != NULL) {
                PyErr_Format(PyExc_ValueError,
                             "out: Expected out array to have shape %U, but got %U", exp, got);
            }
            Py_XDECREF(exp);
            Py_XDECREF(got);
            return NULL;
        }
        if (!PyArray_ISWRITEABLE(out)) {
            PyErr_SetString(PyExc_ValueError, "out: output array is read-only");
            return NULL;
        }
        if (check_out_overlap(out, parts, n, "out", argname) < 0) {
            return NULL;
        }
        Py_INCREF(out);
        result = out;
        dest = dp_array_device(st, out);
    } else {
        PyArray_Descr *descr = PyArray_DESCR(parts[0]);
        Py_INCREF(descr);
        result = dp_empty(st, dest, descr, nd, shape, NULL);
        if (result == NULL) {
            return NULL;
        }
    }
    npy_intp stride = PyArray_STRIDES(result)[dim];
    int64_t offset = 0;
    for (i = 0; i < n; i++) {
        PyArrayObject *p = parts[i];
        char *dst = PyArray_BYTES(result) + offset * stride;
        offset += PyArray_DIM(p, dim);
        if (PyArray_EquivTypes(PyArray_DESCR(p), PyArray_DESCR(result))) {
            if (jobs_add(&jobs, nd, PyArray_SHAPE(p), (size_t)PyArray_ITEMSIZE(p), dst,
                         PyArray_STRIDES(result), PyArray_BYTES(p), PyArray_STRIDES(p),
                         exec_device(dp_array_device(st, p), dest)) < 0) {
                goto fail;
            }
            continue;
        }
        /* Other dtypes are cast to the result's dtype, as PyTorch does (spec
         * 4.7); NumPy's own casting loop does it, with the GIL held. On a GPU
         * side: cast on the host, then copy (NumPy never sees device memory). */
        if (dest.kind == DP_CUDA || dp_array_device(st, p).kind == DP_CUDA) {
            dp_device host = {DP_HOST, -1};
            PyObject *hp = dp_array_device(st, p).kind == DP_CUDA
                         ? dp_copy_to_device(st, p, host) : Py_NewRef(p);
            PyArray_Descr *rd = PyArray_DESCR(result);
            Py_XINCREF(rd);
            PyObject *cast = hp ? PyArray_CastToType((PyArrayObject *)hp, rd, 0) : NULL;
            if (hp == NULL) {
                Py_DECREF(rd);
            }
            Py_XDECREF(hp);
            if (cast == NULL) {
                goto fail;
            }
            job_list one = {0};
            int rc = jobs_add(&one, nd, PyArray_SHAPE(p), (size_t)PyArray_ITEMSIZE(result), dst,
                              PyArray_STRIDES(result), PyArray_BYTES((PyArrayObject *)cast),
                              PyArray_STRIDES((PyArrayObject *)cast), exec_device(host, dest));
            if (rc == 0) {
                rc = jobs_run(&one);
            }
            jobs_free(&one);
            Py_DECREF(cast);
            if (rc < 0) {
                goto fail;
            }
            continue;
        }
        PyObject *view = make_view(result, dst, PyArray_SHAPE(p));
        if (view == NULL) {
            goto fail;
        }
        int rc = PyArray_CopyInto((PyArrayObject *)view, p);
        Py_DECREF(view);
        if (rc < 0) {
            goto fail;
        }
    }
    if (jobs_run(&jobs) < 0) {
        goto fail;
    }
    jobs_free(&jobs);
    if (out != NULL) {
        return (PyObject *)result;
    }
    return dp_export(st, (PyObject *)result);
fail:
    jobs_free(&jobs);
    Py_DECREF(result);
    return NULL;
}
/* A sequence of arrays as a PyMem array of new references. */
int arrays_from_sequence(dp_state *st, PyObject *obj, const char *argname,
                         int min_ndim, PyArrayObject ***out, Py_ssize_t *n)
{
    if (PyArray_Check(obj) || PyUnicode_Check(obj)) {
        PyErr_Format(PyExc_TypeError, "%s: expected a sequence of arrays, got %.100s",
                     argname, Py_TYPE(obj)->tp_name);
        return -1;
    }
    PyObject *seq = PySequence_Fast(obj, "");
    if (seq == NULL) {
        if (PyErr_ExceptionMatches(PyExc_TypeError)) {
            PyErr_Format(PyExc_TypeError, "%s: expected a sequence of arrays, got %.100s",
                         argname, Py_TYPE(obj)->tp_name);
        }
        return -1;
    }
    Py_ssize_t len = PySequence_Fast_GET_SIZE(seq);
    PyArrayObject **arrs = PyMem_Calloc((size_t)(len ? len : 1), sizeof(PyArrayObject *));
    if (arrs == NULL) {
        Py_DECREF(seq);
        PyErr_NoMemory();
        return -1;
    }
    for (Py_ssize_t i = 0; i < len; i++) {
        char name[96];
        snprintf(name, sizeof name, "%s[%zd]", argname, i);
        arrs[i] = dp_as_array(st, PySequence_Fast_GET_ITEM(seq, i), name, min_ndim);
        if (arrs[i] == NULL) {
            for (Py_ssize_t k = 0; k < i; k++) {
                Py_DECREF(arrs[k]);
            }
            PyMem_Free(arrs);
            Py_DECREF(seq);
            return -1;
        }
    }
    Py_DECREF(seq);
    *out = arrs;
    *n = len;
    return 0;
}

void arrays_free(PyArrayObject **arrs, Py_ssize_t n)
{
    for (Py_ssize_t i = 0; i < n; i++) {
        Py_XDECREF(arrs[i]);
    }
    PyMem_Free(arrs);
}

/* ------------------------------------------------------------------ */
/* Broadcast                                                           */
/* ------------------------------------------------------------------ */

/* Queue a copy of all of src into a fresh array on dev; new reference. */
PyObject *copy_to(dp_state *st, job_list *jobs, PyArrayObject *src, dp_device dev)
{
    PyArrayObject *dst = empty_like_region(st, dev, src, PyArray_SHAPE(src),
                                           PyArray_STRIDES(src));
    if (dst == NULL) {
        return NULL;
    }
    if (jobs_add(jobs, PyArray_NDIM(src), PyArray_SHAPE(src), (size_t)PyArray_ITEMSIZE(src),
                 PyArray_BYTES(dst), PyArray_STRIDES(dst), PyArray_BYTES(src),
                 PyArray_STRIDES(src), exec_device(dp_array_device(st, src), dev)) < 0) {
        Py_DECREF(dst);
        return NULL;
    }
    return (PyObject *)dst;
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

/* broadcast through NCCL when every target is a distinct GPU, the source
 * is a contiguous array on one of them, and NCCL loads. Returns 1 when done
 * (row entries filled), 0 to use the copy path, -1 on error. */
static int nccl_broadcast_one(dp_state *st, PyArrayObject *src, const dp_device *devs,
                              Py_ssize_t ndev, PyObject *result, Py_ssize_t i)
{
    dp_device home = dp_array_device(st, src);
    int ids[DP_MAX_DEVICES], root = -1;
    void *bufs[DP_MAX_DEVICES];
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
        ids[d] = devs[d].index;
        if (devs[d].index == home.index) {
            root = (int)d;
        }
    }
    if (root < 0 || !dp_nccl_available()) {
        return 0;
    }
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
    dpc_status s;
    Py_BEGIN_ALLOW_THREADS
    s = dp_nccl_broadcast((int)ndev, ids, bufs, (size_t)PyArray_NBYTES(src), root);
    Py_END_ALLOW_THREADS
    if (s.code != 0) {
        return dp_gpu_raise(st, s, "broadcast (ncclBroadcast)");
    }
    return 1;
}

PyObject *dp_broadcast_coalesced(dp_state *st, PyObject *arrays, const dp_device *devs,
                                 Py_ssize_t ndev, size_t buffer_size)
{
    PyArrayObject **src = NULL;
    Py_ssize_t n = 0;
    job_list jobs = {0};
    PyObject *result = NULL;

    (void)buffer_size; /* see comm_broadcast_coalesced's docstring */
    if (arrays_from_sequence(st, arrays, "tensors", 0, &src, &n) < 0) {
        return NULL;
    }
    result = PyList_New(ndev);
    if (result == NULL) {
        goto fail;
    }
    for (Py_ssize_t d = 0; d < ndev; d++) {
        PyObject *row = PyList_New(n);
        if (row == NULL) {
            goto fail;
        }
        PyList_SET_ITEM(result, d, row);
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        int r = nccl_broadcast_one(st, src[i], devs, ndev, result, i);
        if (r < 0) {
            goto fail;
        }
        for (Py_ssize_t d = 0; r == 0 && d < ndev; d++) {
            PyObject *row = PyList_GET_ITEM(result, d);
            PyObject *item;
            if (dp_device_eq(dp_array_device(st, src[i]), devs[d])) {
                item = (PyObject *)src[i];
                Py_INCREF(item);
            } else {
                item = copy_to(st, &jobs, src[i], devs[d]);
                if (item == NULL) {
                    goto fail;
                }
            }
            PyList_SET_ITEM(row, i, item);
        }
    }
    if (jobs_run(&jobs) < 0) {
        goto fail;
    }
    jobs_free(&jobs);
    arrays_free(src, n);
    for (Py_ssize_t d = 0; d < ndev; d++) { /* GPU entries leave as dpmini.Array */
        PyObject *row = PyList_GET_ITEM(result, d);
        for (Py_ssize_t i = 0; i < n; i++) {
            PyObject *e = dp_export(st, Py_NewRef(PyList_GET_ITEM(row, i)));
            if (e == NULL) {
                Py_DECREF(result);
                return NULL;
            }
            PyList_SetItem(row, i, e);
        }
    }
    return result;
fail:
    jobs_free(&jobs);
    arrays_free(src, n);
    Py_XDECREF(result);
    return NULL;
}
