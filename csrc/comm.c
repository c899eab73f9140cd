/* comm.c - the copy engine (scatter, gather, broadcast as copy jobs run on
 * the device worker threads) and the dpmini.comm functions, which mirror
 * torch.cuda.comm (spec §8). */
#include "dpmini.h"
#include "gpu.h"

#include <string.h>

/* Below this many bytes in one call, copying inline in the caller beats
 * waking worker threads (a wake-up costs microseconds; 256 KiB copies in
 * about 20). */
#define DP_INLINE_BYTES ((size_t)1 << 18)

/* Default bucket size of broadcast_coalesced (spec 5.3). */
#define DP_BUCKET_BYTES 10485760

/* ------------------------------------------------------------------ */
/* Copy jobs                                                           */
/* ------------------------------------------------------------------ */

typedef struct {
    dp_copy_desc desc;  /* simplified                                       */
    char *dst;
    const char *src;
    dp_device exec;     /* whose worker runs it; the host means the caller  */
    dp_device src_dev, dst_dev; /* where each side lives (CUDA: device memory) */
} copy_job;

/* Where a copy goes: its two sides, and the device whose worker runs it (a
 * CUDA side when there is one, so GPU copies run on a GPU's worker). */
typedef struct {
    dp_device src, dst, exec;
} copy_route;

typedef struct {
    copy_job *jobs;     /* PyMem_Malloc'ed */
    Py_ssize_t n, cap;
    size_t bytes;       /* total bytes to copy */
} job_list;

static void jobs_free(job_list *l)
{
    PyMem_Free(l->jobs);
    l->jobs = NULL;
    l->n = l->cap = 0;
    l->bytes = 0;
}

/* Queue dst[...] = src[...] for `shape`. Strides in bytes. */
static int jobs_add(job_list *l, int nd, const npy_intp *shape, size_t itemsize,
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
static int check_out_overlap(PyArrayObject *dst, PyArrayObject *const *srcs, Py_ssize_t nsrc,
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
static int check_outs_disjoint(PyArrayObject *const *outs, Py_ssize_t n)
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
    for (Py_ssize_t i = 0; i < g->n; i++) {
        copy_job *j = &g->jobs[i];
        if (j->exec.kind != DP_CUDA) {
            dp_copy_run(&j->desc, j->dst, j->src);
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

/* Run every queued job: each device's jobs on its worker, all devices at
 * once, the GIL released. Small totals, host-only jobs, and calls made from
 * inside a worker (a replica) run inline. */
static int jobs_run(job_list *l)
{
    if (l->n == 0) {
        return 0;
    }
    if (l->bytes < DP_INLINE_BYTES || dp_pool_in_worker()) {
        /* one group per executing device, run here one after another */
        qsort(l->jobs, (size_t)l->n, sizeof(copy_job), exec_before);
        Py_ssize_t start = 0;
        for (Py_ssize_t i = 1; i <= l->n; i++) {
            if (i < l->n && dp_device_eq(l->jobs[i].exec, l->jobs[start].exec)) {
                continue;
            }
            job_group g = {&l->jobs[start], i - start, {0}, 0};
            if (l->bytes < DP_INLINE_BYTES) {
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
    qsort(l->jobs, (size_t)l->n, sizeof(copy_job), exec_before);
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
static copy_route exec_device(dp_device src, dp_device dst)
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

static PyObject *devices_error(const char *argname)
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

/* Chunk sizes from a Python sequence (comm.scatter's chunk_sizes). */
static int parse_chunk_sizes(PyObject *obj, Py_ssize_t ndev, int64_t n, int dim,
                             int64_t *sizes)
{
    PyObject *seq = PySequence_Fast(obj, "");
    if (seq == NULL) {
        if (PyErr_ExceptionMatches(PyExc_TypeError)) {
            PyErr_Format(PyExc_TypeError, "chunk_sizes: expected a sequence of ints, got %.100s",
                         Py_TYPE(obj)->tp_name);
        }
        return -1;
    }
    Py_ssize_t len = PySequence_Fast_GET_SIZE(seq);
    if (len != ndev) {
        Py_DECREF(seq);
        PyErr_Format(PyExc_ValueError,
                     "chunk_sizes: Expected devices and chunk_sizes to be of same length, "
                     "but got len(devices) = %zd and len(chunk_sizes) = %zd", ndev, len);
        return -1;
    }
    for (Py_ssize_t i = 0; i < len; i++) {
        PyObject *v = PySequence_Fast_GET_ITEM(seq, i);
        if (!PyIndex_Check(v) || PyBool_Check(v) || PyFloat_Check(v)) {
            Py_DECREF(seq);
            PyErr_Format(PyExc_TypeError, "chunk_sizes[%zd]: expected an int, got %.100s",
                         i, Py_TYPE(v)->tp_name);
            return -1;
        }
        PyObject *idx = PyNumber_Index(v);
        long long x = idx ? PyLong_AsLongLong(idx) : -1;
        if (x == -1 && PyErr_Occurred()) {
            if (idx != NULL && PyErr_ExceptionMatches(PyExc_OverflowError)) {
                PyErr_Format(PyExc_ValueError,
                             "chunk_sizes[%zd]: %S is out of range (a chunk size is a "
                             "non-negative int64)", i, idx);
            }
            Py_XDECREF(idx);
            Py_DECREF(seq);
            return -1;
        }
        Py_XDECREF(idx);
        sizes[i] = x;
    }
    Py_DECREF(seq);
    int bad;
    int rc = dp_check_chunk_sizes(n, (int)ndev, sizes, &bad);
    if (rc == DP_ERR_NEGATIVE_SIZE) {
        PyErr_Format(PyExc_ValueError,
                     "chunk_sizes: split_with_sizes expects split_sizes to be non-negative, "
                     "but chunk_sizes[%d] is %lld", bad, (long long)sizes[bad]);
        return -1;
    }
    if (rc != DP_OK) {
        /* The sizes are each >= 0 here but their sum can pass INT64_MAX
         * (reliability.md, bug 1): say so instead of printing a wrapped sum. */
        long long sum = 0;
        int overflow = 0;
        for (Py_ssize_t i = 0; i < ndev && !overflow; i++) {
            overflow = __builtin_add_overflow(sum, (long long)sizes[i], &sum);
        }
        if (overflow) {
            PyErr_Format(PyExc_ValueError,
                         "chunk_sizes: split_with_sizes expects split_sizes to sum exactly to "
                         "%lld (input array's size at dimension %d), but got a sum larger "
                         "than %lld", (long long)n, dim, (long long)INT64_MAX);
            return -1;
        }
        PyErr_Format(PyExc_ValueError,
                     "chunk_sizes: split_with_sizes expects split_sizes to sum exactly to %lld "
                     "(input array's size at dimension %d), but got sum %lld",
                     (long long)n, dim, sum);
        return -1;
    }
    return 0;
}

/* comm.scatter with out=: copy chunk i of src into out[i] in place. */
static PyObject *scatter_into(dp_state *st, PyArrayObject *src, int dim, PyObject *out_obj)
{
    PyObject *seq = NULL, *result = NULL;
    PyArrayObject **outs = NULL;
    job_list jobs = {0};
    Py_ssize_t n = 0, i;
    int nd = PyArray_NDIM(src);

    if (PyArray_Check(out_obj) || PyUnicode_Check(out_obj) || PyBytes_Check(out_obj)) {
        PyErr_Format(PyExc_TypeError, "out: expected a sequence of arrays, got %.100s",
                     Py_TYPE(out_obj)->tp_name);
        return NULL;
    }
    seq = PySequence_Fast(out_obj, "out: expected a sequence of arrays");
    if (seq == NULL) {
        return NULL;
    }
    n = PySequence_Fast_GET_SIZE(seq);
    if (n == 0) {
        PyErr_SetString(PyExc_ValueError, "out: Expected at least one output array to scatter to");
        goto done;
    }
    outs = PyMem_Calloc((size_t)n, sizeof(PyArrayObject *));
    if (outs == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    int64_t total = 0;
    for (i = 0; i < n; i++) {
        PyObject *o = PySequence_Fast_GET_ITEM(seq, i);
        if (!PyArray_Check(o) && !dp_is_device_object(st, o)) {
            PyErr_Format(PyExc_TypeError, "out[%zd]: expected a numpy.ndarray or a GPU array, "
                         "got %.100s", i, Py_TYPE(o)->tp_name);
            goto done;
        }
        outs[i] = dp_as_array(st, o, "out", 0); /* a GPU array: its shadow */
        if (outs[i] == NULL) {
            goto done;
        }
        if (PyArray_NDIM(outs[i]) != nd) {
            PyErr_Format(PyExc_ValueError,
                         "out[%zd]: Output array has incorrect shape: expected %d dimensions, "
                         "got %d", i, nd, PyArray_NDIM(outs[i]));
            goto done;
        }
        for (int d = 0; d < nd; d++) {
            if (d != dim && PyArray_DIM(outs[i], d) != PyArray_DIM(src, d)) {
                PyErr_Format(PyExc_ValueError,
                             "out[%zd]: Output array has incorrect shape: size %zd at "
                             "dimension %d, expected %zd", i, (Py_ssize_t)PyArray_DIM(outs[i], d),
                             d, (Py_ssize_t)PyArray_DIM(src, d));
                goto done;
            }
        }
        if (!PyArray_EquivTypes(PyArray_DESCR(outs[i]), PyArray_DESCR(src))) {
            PyErr_Format(PyExc_TypeError, "out[%zd]: expected dtype %S, got %S", i,
                         (PyObject *)PyArray_DESCR(src), (PyObject *)PyArray_DESCR(outs[i]));
            goto done;
        }
        if (!PyArray_ISWRITEABLE(outs[i])) {
            PyErr_Format(PyExc_ValueError, "out[%zd]: output array is read-only", i);
            goto done;
        }
        char name[48];
        PyOS_snprintf(name, sizeof name, "out[%zd]", i);
        if (check_out_overlap(outs[i], &src, 1, name, "array") < 0) {
            goto done;
        }
        /* A wrapped sum could pass the check below and copy past src
         * (reliability.md, bug 3). */
        if (__builtin_add_overflow(total, (int64_t)PyArray_DIM(outs[i], dim), &total)) {
            PyErr_Format(PyExc_ValueError,
                         "out: Total size for output arrays along scatter dim %d does not "
                         "match the source array size at dim %d (the sizes up to out[%zd] "
                         "add up to more than %lld)", dim, dim, i, (long long)INT64_MAX);
            goto done;
        }
    }
    if (check_outs_disjoint(outs, n) < 0) {
        goto done;
    }
    if (total != PyArray_DIM(src, dim)) {
        PyErr_Format(PyExc_ValueError,
                     "out: Total size for output arrays along scatter dim %d does not match "
                     "the source array size at dim %d (%lld != %lld)", dim, dim,
                     (long long)total, (long long)PyArray_DIM(src, dim));
        goto done;
    }
    dp_device home = dp_array_device(st, src);
    int64_t offset = 0;
    for (i = 0; i < n; i++) {
        const char *data = PyArray_BYTES(src) + offset * PyArray_STRIDES(src)[dim];
        offset += PyArray_DIM(outs[i], dim);
        if (jobs_add(&jobs, nd, PyArray_SHAPE(outs[i]), (size_t)PyArray_ITEMSIZE(src),
                     PyArray_BYTES(outs[i]), PyArray_STRIDES(outs[i]), data,
                     PyArray_STRIDES(src),
                     exec_device(home, dp_array_device(st, outs[i]))) < 0) {
            goto done;
        }
    }
    if (jobs_run(&jobs) < 0) {
        goto done;
    }
    result = PyList_AsTuple(seq);
done:
    jobs_free(&jobs);
    for (i = 0; outs != NULL && i < n; i++) {
        Py_XDECREF(outs[i]);
    }
    PyMem_Free(outs);
    Py_DECREF(seq);
    return result;
}

PyDoc_STRVAR(comm_scatter_doc,
"scatter(array, devices=None, chunk_sizes=None, dim=0, out=None)\n"
"--\n"
"\n"
"Returns a tuple of arrays, chunk i on devices[i] (or out itself).\n"
"Split `array` along `dim` and copy chunk i to devices[i] (torch.cuda.comm.scatter,\n"
"spec 8.5). array: ndarray, buffer-protocol object (bytes read as 1-D uint8) or\n"
"__array_interface__ object, ndim >= 1, any non-object dtype, any strides. Without\n"
"chunk_sizes the rule is torch.chunk: split = ceil(n / k) elements per chunk with a\n"
"shorter last one, so there may be fewer chunks than devices; n == 0 gives k empty\n"
"chunks. chunk_sizes: one int per device (elements along dim, >= 0, summing to n).\n"
"A chunk whose device is the array's own device is a view; others are copies (dense\n"
"chunks keep their strides, others are C-contiguous). out: a sequence of preallocated\n"
"arrays to fill instead of devices and chunk_sizes. The copies run on the device\n"
"threads with the GIL released.\n"
"Raises ValueError (no devices, bad chunk_sizes naming chunk_sizes[i], out\n"
"mismatches, an out[i] overlapping array, another out[j] or itself), TypeError (not\n"
"an array, object dtype, MaskedArray/matrix, out not a sequence of arrays),\n"
"IndexError (dim out of range).");

static PyObject *comm_scatter(PyObject *m, PyObject *args, PyObject *kw)
{
    static char *kwlist[] = {"array", "devices", "chunk_sizes", "dim", "out", NULL};
    PyObject *obj, *devices_obj = Py_None, *sizes_obj = Py_None, *dim_obj = NULL,
             *out_obj = Py_None, *result = NULL;
    dp_state *st = dp_state_from_module(m);
    dp_device *devs = NULL;
    Py_ssize_t ndev = 0;
    PyArrayObject *arr = NULL;
    int64_t *sizes = NULL;
    PyObject **chunks = NULL;
    int dim = 0;

    if (!PyArg_ParseTupleAndKeywords(args, kw, "O|OOOO:scatter", kwlist, &obj, &devices_obj,
                                     &sizes_obj, &dim_obj, &out_obj)) {
        return NULL;
    }
    if (dim_obj != NULL && dp_int_from_object(dim_obj, "dim", &dim) < 0) {
        return NULL;
    }
    arr = dp_as_array(st, obj, "array", 1);
    if (arr == NULL) {
        return NULL;
    }
    if (dp_wrap_dim_or_raise(dim, PyArray_NDIM(arr), "dim", &dim) < 0) {
        goto done;
    }
    if (out_obj != Py_None) {
        if (devices_obj != Py_None || sizes_obj != Py_None) {
            PyErr_SetString(PyExc_ValueError,
                            "out: 'devices' and 'chunk_sizes' must not be given with 'out'");
            goto done;
        }
        result = scatter_into(st, arr, dim, out_obj);
        goto done;
    }
    if (devices_obj == Py_None) {
        devices_error("devices");
        goto done;
    }
    if (PySequence_Check(devices_obj) && !PyUnicode_Check(devices_obj) &&
        PySequence_Size(devices_obj) == 0) {
        devices_error("devices");
        goto done;
    }
    if (dp_device_list_from_object(st, devices_obj, "devices", &devs, &ndev) < 0) {
        goto done;
    }
    sizes = PyMem_Calloc((size_t)ndev, sizeof(int64_t));
    chunks = PyMem_Calloc((size_t)ndev, sizeof(PyObject *));
    if (sizes == NULL || chunks == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    int nchunks;
    if (sizes_obj == Py_None) {
        nchunks = dp_chunk_sizes(PyArray_DIM(arr, dim), (int)ndev, sizes);
    } else {
        if (parse_chunk_sizes(sizes_obj, ndev, PyArray_DIM(arr, dim), dim, sizes) < 0) {
            goto done;
        }
        nchunks = (int)ndev;
    }
    dp_scatter_item item = {arr, dim, nchunks, sizes, chunks};
    if (dp_scatter_run(st, &item, 1, devs) < 0) {
        goto done;
    }
    result = PyTuple_New(nchunks);
    if (result == NULL) {
        for (int j = 0; j < nchunks; j++) {
            Py_DECREF(chunks[j]);
        }
        goto done;
    }
    for (int j = 0; j < nchunks; j++) {
        PyTuple_SET_ITEM(result, j, chunks[j]);
    }
done:
    PyMem_Free(chunks);
    PyMem_Free(sizes);
    PyMem_Free(devs);
    Py_XDECREF(arr);
    return result;
}

/* ------------------------------------------------------------------ */
/* Gather                                                              */
/* ------------------------------------------------------------------ */

static PyObject *shape_str(int nd, const npy_intp *shape)
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

/* Parse a gather/reduce destination: None -> *dflt, "cpu"/-1 -> host (-1
 * warns, spec 4.3), else a device. */
static int parse_destination(dp_state *st, PyObject *obj, const char *argname,
                             dp_device dflt, dp_device *out)
{
    if (obj == NULL || obj == Py_None) {
        *out = dflt;
        return 0;
    }
    if (dp_device_from_object(st, obj, argname, DP_DEV_ALLOW_HOST, out) < 0) {
        return -1;
    }
    if (PyLong_Check(obj) && out->kind == DP_HOST) {
        if (PyErr_WarnEx(PyExc_FutureWarning,
                         "Using -1 to represent CPU tensor is deprecated. Please use a "
                         "device object or string instead, e.g., \"cpu\".", 1) < 0) {
            return -1;
        }
    }
    return 0;
}

/* A sequence of arrays as a PyMem array of new references. */
static int arrays_from_sequence(dp_state *st, PyObject *obj, const char *argname,
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

static void arrays_free(PyArrayObject **arrs, Py_ssize_t n)
{
    for (Py_ssize_t i = 0; i < n; i++) {
        Py_XDECREF(arrs[i]);
    }
    PyMem_Free(arrs);
}

PyDoc_STRVAR(comm_gather_doc,
"gather(arrays, dim=0, destination=None, out=None)\n"
"--\n"
"\n"
"Returns the gathered ndarray (out itself when given).\n"
"Concatenate arrays along dim onto one device (torch.cuda.comm.gather, spec 4.6-4.8).\n"
"arrays: a non-empty sequence of arrays of equal ndim whose sizes agree except along\n"
"dim; dim may be negative (wrapped against arrays[0]). destination: 'cpu' or None\n"
"(the host; -1 also, with a FutureWarning), 'cpu:N' or a CUDA device. The result is a\n"
"fresh C-contiguous array with arrays[0]'s dtype (other dtypes are cast), from\n"
"dpmini's caching allocator. out: an ndarray of the gathered shape, written in place\n"
"and returned (then destination must be None). Copies run on the device threads with\n"
"the GIL released.\n"
"Raises ValueError (empty list, shape or rank mismatch, out mismatch, out with\n"
"destination, read-only out, out overlapping arrays[i] or itself), IndexError (dim),\n"
"TypeError (not arrays, object dtype, MaskedArray/matrix).");

static PyObject *comm_gather(PyObject *m, PyObject *args, PyObject *kw)
{
    static char *kwlist[] = {"arrays", "dim", "destination", "out", NULL};
    PyObject *arrays_obj, *dim_obj = NULL, *dest_obj = Py_None, *out_obj = Py_None;
    dp_state *st = dp_state_from_module(m);
    PyArrayObject **parts = NULL;
    Py_ssize_t n = 0;
    int dim = 0;
    dp_device host = {DP_HOST, -1}, dest;
    PyObject *result = NULL;

    if (!PyArg_ParseTupleAndKeywords(args, kw, "O|OOO:gather", kwlist, &arrays_obj, &dim_obj,
                                     &dest_obj, &out_obj)) {
        return NULL;
    }
    if (dim_obj != NULL && dp_int_from_object(dim_obj, "dim", &dim) < 0) {
        return NULL;
    }
    if (out_obj != Py_None && dest_obj != Py_None) {
        PyErr_SetString(PyExc_ValueError,
                        "out: 'destination' must not be given together with 'out'");
        return NULL;
    }
    if (out_obj != Py_None && !PyArray_Check(out_obj) && !dp_is_device_object(st, out_obj)) {
        PyErr_Format(PyExc_TypeError, "out: expected a numpy.ndarray or a GPU array, got "
                     "%.100s", Py_TYPE(out_obj)->tp_name);
        return NULL;
    }
    if (parse_destination(st, dest_obj, "destination", host, &dest) < 0) {
        return NULL;
    }
    if (arrays_from_sequence(st, arrays_obj, "arrays", 0, &parts, &n) < 0) {
        return NULL;
    }
    if (n == 0) {
        PyErr_SetString(PyExc_ValueError, "arrays: Expected at least one array to gather from");
        goto done;
    }
    if (dp_wrap_dim_or_raise(dim, PyArray_NDIM(parts[0]), "dim", &dim) < 0) {
        goto done;
    }
    if (out_obj == Py_None) {
        result = dp_gather_arrays(st, parts, n, dim, dest, NULL, "arrays");
    } else {
        PyArrayObject *out_arr = dp_as_array(st, out_obj, "out", 0);
        if (out_arr != NULL) {
            result = dp_gather_arrays(st, parts, n, dim, dest, out_arr, "arrays");
            Py_DECREF(out_arr);
            if (result != NULL) { /* the caller's own object, written in place */
                Py_SETREF(result, Py_NewRef(out_obj));
            }
        }
    }
done:
    arrays_free(parts, n);
    return result;
}

/* ------------------------------------------------------------------ */
/* Broadcast                                                           */
/* ------------------------------------------------------------------ */

/* Queue a copy of all of src into a fresh array on dev; new reference. */
static PyObject *copy_to(dp_state *st, job_list *jobs, PyArrayObject *src, dp_device dev)
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

PyDoc_STRVAR(comm_broadcast_doc,
"broadcast(array, devices=None, out=None)\n"
"--\n"
"\n"
"Returns a tuple with one array per device (or out's arrays).\n"
"Copy array to every device (torch.cuda.comm.broadcast, spec 8.1). Exactly one of\n"
"devices / out. The entry for the array's own device is the array itself; the others\n"
"are copies (dense layouts keep their strides). out: arrays of the same shape and dtype\n"
"to fill in place.\n"
"Raises ValueError (both or neither of devices/out, shape mismatch, read-only out,\n"
"out[i] overlapping array, another out[j] or itself), TypeError (not an array, object\n"
"dtype, MaskedArray/matrix).");

static PyObject *comm_broadcast(PyObject *m, PyObject *args, PyObject *kw)
{
    static char *kwlist[] = {"array", "devices", "out", NULL};
    PyObject *obj, *devices_obj = Py_None, *out_obj = Py_None, *result = NULL;
    dp_state *st = dp_state_from_module(m);
    dp_device *devs = NULL;
    Py_ssize_t ndev = 0;
    PyArrayObject *arr;
    PyArrayObject **outs = NULL;
    Py_ssize_t nout = 0;
    job_list jobs = {0};

    if (!PyArg_ParseTupleAndKeywords(args, kw, "O|OO:broadcast", kwlist, &obj, &devices_obj,
                                     &out_obj)) {
        return NULL;
    }
    if ((devices_obj == Py_None) == (out_obj == Py_None)) {
        PyErr_SetString(PyExc_ValueError,
                        "devices, out: Exactly one of 'devices' and 'out' must be specified");
        return NULL;
    }
    arr = dp_as_array(st, obj, "array", 0);
    if (arr == NULL) {
        return NULL;
    }
    if (out_obj != Py_None) {
        if (arrays_from_sequence(st, out_obj, "out", 0, &outs, &nout) < 0 ||
            check_outs_disjoint(outs, nout) < 0) {
            goto done;
        }
        for (Py_ssize_t i = 0; i < nout; i++) {
            if (!PyArray_SAMESHAPE(outs[i], arr) ||
                !PyArray_EquivTypes(PyArray_DESCR(outs[i]), PyArray_DESCR(arr))) {
                PyErr_Format(PyExc_ValueError,
                             "out[%zd]: expected an array of the source's shape and dtype",
                             i);
                goto done;
            }
            if (!PyArray_ISWRITEABLE(outs[i])) {
                PyErr_Format(PyExc_ValueError, "out[%zd]: output array is read-only", i);
                goto done;
            }
            char name[48];
            PyOS_snprintf(name, sizeof name, "out[%zd]", i);
            if (check_out_overlap(outs[i], &arr, 1, name, "array") < 0) {
                goto done;
            }
            if (jobs_add(&jobs, PyArray_NDIM(arr), PyArray_SHAPE(arr),
                         (size_t)PyArray_ITEMSIZE(arr), PyArray_BYTES(outs[i]),
                         PyArray_STRIDES(outs[i]), PyArray_BYTES(arr), PyArray_STRIDES(arr),
                         exec_device(dp_array_device(st, arr),
                                     dp_array_device(st, outs[i]))) < 0) {
                goto done;
            }
        }
        if (jobs_run(&jobs) < 0) {
            goto done;
        }
        result = PySequence_Tuple(out_obj);
        goto done;
    }
    if (dp_device_list_from_object(st, devices_obj, "devices", &devs, &ndev) < 0) {
        goto done;
    }
    PyObject *one = PyList_New(1);
    if (one == NULL) {
        goto done;
    }
    Py_INCREF(arr);
    PyList_SET_ITEM(one, 0, (PyObject *)arr);
    PyObject *rows = dp_broadcast_coalesced(st, one, devs, ndev, DP_BUCKET_BYTES);
    Py_DECREF(one);
    if (rows == NULL) {
        goto done;
    }
    result = PyTuple_New(ndev);
    if (result != NULL) {
        for (Py_ssize_t d = 0; d < ndev; d++) {
            PyObject *item = PyList_GET_ITEM(PyList_GET_ITEM(rows, d), 0);
            Py_INCREF(item);
            PyTuple_SET_ITEM(result, d, item);
        }
    }
    Py_DECREF(rows);
done:
    jobs_free(&jobs);
    arrays_free(outs, nout);
    PyMem_Free(devs);
    Py_DECREF(arr);
    return result;
}

static int parse_buffer_size(PyObject *obj, size_t *out)
{
    if (obj == NULL) {
        *out = DP_BUCKET_BYTES;
        return 0;
    }
    int v;
    if (dp_int_from_object(obj, "buffer_size", &v) < 0) {
        return -1;
    }
    if (v <= 0) {
        PyErr_Format(PyExc_ValueError, "buffer_size: expected a positive number of bytes, got %d",
                     v);
        return -1;
    }
    *out = (size_t)v;
    return 0;
}

PyDoc_STRVAR(comm_broadcast_coalesced_doc,
"broadcast_coalesced(arrays, devices, buffer_size=10485760)\n"
"--\n"
"\n"
"Returns a list of lists: entry d holds every array's copy on devices[d].\n"
"Copy every array to every device (torch.cuda.comm.broadcast_coalesced, spec 5.3), in\n"
"the order of arrays. Entries for an array's own device are the array itself (PyTorch\n"
"requires all arrays on devices[0]; dpmini accepts them anywhere and copies to\n"
"devices[0] too when needed). buffer_size (bytes, > 0) is validated for\n"
"compatibility: on CPU devices all copies already run in one batched pass, so no flat\n"
"staging buffer is used.\n"
"Raises ValueError (no devices, bad buffer_size), TypeError (not arrays, object\n"
"dtype).");

static PyObject *comm_broadcast_coalesced(PyObject *m, PyObject *args, PyObject *kw)
{
    static char *kwlist[] = {"arrays", "devices", "buffer_size", NULL};
    PyObject *arrays_obj, *devices_obj, *bs_obj = NULL, *result;
    dp_state *st = dp_state_from_module(m);
    dp_device *devs = NULL;
    Py_ssize_t ndev = 0;
    size_t bs;

    if (!PyArg_ParseTupleAndKeywords(args, kw, "OO|O:broadcast_coalesced", kwlist,
                                     &arrays_obj, &devices_obj, &bs_obj)) {
        return NULL;
    }
    if (parse_buffer_size(bs_obj, &bs) < 0 ||
        dp_device_list_from_object(st, devices_obj, "devices", &devs, &ndev) < 0) {
        return NULL;
    }
    result = dp_broadcast_coalesced(st, arrays_obj, devs, ndev, bs);
    PyMem_Free(devs);
    return result;
}

/* ------------------------------------------------------------------ */
/* Reduce                                                              */
/* ------------------------------------------------------------------ */

/* The reduce kernel's element type for a dtype (complex as pairs of floats:
 * *scale 2); DPC_T_NONE when the kernel cannot add it (float16, bool, ...). */
static int add_type(PyArray_Descr *d, int *scale)
{
    *scale = 1;
    if (!PyDataType_ISNOTSWAPPED(d)) {
        return DPC_T_NONE;
    }
    switch (d->type_num) {
    case NPY_INT8: return DPC_T_I8;
    case NPY_UINT8: return DPC_T_U8;
    case NPY_INT16: return DPC_T_I16;
    case NPY_UINT16: return DPC_T_U16;
    case NPY_INT32: return DPC_T_I32;
    case NPY_UINT32: return DPC_T_U32;
    case NPY_INT64: case NPY_LONGLONG: return PyDataType_ELSIZE(d) == 8 ? DPC_T_I64 : DPC_T_NONE;
    case NPY_UINT64: case NPY_ULONGLONG: return PyDataType_ELSIZE(d) == 8 ? DPC_T_U64 : DPC_T_NONE;
    case NPY_FLOAT32: return DPC_T_F32;
    case NPY_FLOAT64: return DPC_T_F64;
    case NPY_COMPLEX64: *scale = 2; return DPC_T_F32;
    case NPY_COMPLEX128: *scale = 2; return DPC_T_F64;
    default: return DPC_T_NONE;
    }
}

/* A C-contiguous copy of src on dev, synchronously (new shadow/ndarray). */
static PyArrayObject *dense_copy(dp_state *st, PyArrayObject *src, dp_device dev)
{
    job_list jobs = {0};
    PyArray_Descr *descr = PyArray_DESCR(src);
    Py_INCREF(descr);
    PyArrayObject *dst = dp_empty(st, dev, descr, PyArray_NDIM(src), PyArray_SHAPE(src), NULL);
    if (dst == NULL) {
        return NULL;
    }
    if (jobs_add(&jobs, PyArray_NDIM(src), PyArray_SHAPE(src), (size_t)PyArray_ITEMSIZE(src),
                 PyArray_BYTES(dst), PyArray_STRIDES(dst), PyArray_BYTES(src),
                 PyArray_STRIDES(src), exec_device(dp_array_device(st, src), dev)) < 0 ||
        jobs_run(&jobs) < 0) {
        Py_CLEAR(dst);
    }
    jobs_free(&jobs);
    return dst;
}

/* reduce_add with a GPU among the inputs or as the destination (shapes
 * already checked, n >= 1). NCCL reduce when every input is a contiguous
 * array on a distinct GPU, dest is one of them, NCCL has the dtype (not
 * int16/uint16) and NCCL loads; else the
 * fallback: copies onto dest and the add kernel; dtypes the kernel cannot
 * add (or mixed dtypes) are summed on the host by NumPy and copied. */
static PyObject *gpu_reduce_add(dp_state *st, PyArrayObject **parts, Py_ssize_t n,
                                dp_device dest)
{
    dp_device host = {DP_HOST, -1};
    PyArray_Descr *d0 = PyArray_DESCR(parts[0]);
    int scale, type = add_type(d0, &scale), same = 1, distinct = 1, root = -1;
    int ids[DP_MAX_DEVICES];
    const void *send[DP_MAX_DEVICES];
    for (Py_ssize_t i = 0; i < n; i++) {
        dp_device di = dp_array_device(st, parts[i]);
        same = same && PyArray_EquivTypes(PyArray_DESCR(parts[i]), d0);
        distinct = distinct && di.kind == DP_CUDA && PyArray_IS_C_CONTIGUOUS(parts[i]) &&
                   n <= DP_MAX_DEVICES;
        for (Py_ssize_t k = 0; distinct && k < i; k++) {
            distinct = ids[k] != di.index;
        }
        if (distinct) {
            ids[i] = di.index;
            send[i] = PyArray_DATA(parts[i]);
            if (dp_device_eq(di, dest)) {
                root = (int)i;
            }
        }
    }
    if (dest.kind != DP_CUDA || !same || type == DPC_T_NONE) {
        /* host sum: inputs copied to the host, NumPy adds, result to dest */
        PyObject *acc = dp_copy_to_device(st, parts[0], host);
        for (Py_ssize_t i = 1; acc != NULL && i < n; i++) {
            PyObject *hp = dp_array_device(st, parts[i]).kind == DP_CUDA
                         ? dp_copy_to_device(st, parts[i], host) : Py_NewRef(parts[i]);
            PyObject *sum = hp ? PyNumber_InPlaceAdd(acc, hp) : NULL;
            Py_XDECREF(hp);
            if (sum == NULL) {
                Py_CLEAR(acc);
                break;
            }
            Py_DECREF(sum);
        }
        if (acc == NULL || dest.kind == DP_HOST) {
            return acc;
        }
        PyObject *r = dp_copy_to_device(st, (PyArrayObject *)acc, dest);
        Py_DECREF(acc);
        return r;
    }
    int64_t numel = (int64_t)PyArray_SIZE(parts[0]) * scale;
    if (distinct && root >= 0 && n > 1 && dp_nccl_supports(type) && dp_nccl_available()) {
        Py_INCREF(d0);
        PyArrayObject *out = dp_empty(st, dest, d0, PyArray_NDIM(parts[0]),
                                      PyArray_SHAPE(parts[0]), NULL);
        if (out == NULL) {
            return NULL;
        }
        dpc_status s;
        Py_BEGIN_ALLOW_THREADS
        s = dp_nccl_reduce((int)n, ids, send, PyArray_DATA(out), numel, type, root);
        Py_END_ALLOW_THREADS
        if (s.code != 0) {
            Py_DECREF(out);
            dp_gpu_raise(st, s, "reduce_add (ncclReduce)");
            return NULL;
        }
        return (PyObject *)out;
    }
    PyArrayObject *acc = dense_copy(st, parts[0], dest);
    for (Py_ssize_t i = 1; acc != NULL && i < n; i++) {
        PyArrayObject *x = dense_copy(st, parts[i], dest);
        if (x == NULL) {
            Py_CLEAR(acc);
            break;
        }
        dpc_status s;
        Py_BEGIN_ALLOW_THREADS
        s = dp_gpu_add(dest.index, type, PyArray_DATA(acc), PyArray_DATA(x), numel);
        Py_END_ALLOW_THREADS
        Py_DECREF(x);
        if (s.code != 0) {
            Py_CLEAR(acc);
            dp_gpu_raise(st, s, "reduce_add (add kernel)");
        }
    }
    return (PyObject *)acc;
}

PyObject *dp_reduce_add(dp_state *st, PyObject *arrays, dp_device dest, const char *argname)
{
    PyArrayObject **parts = NULL;
    Py_ssize_t n = 0;
    PyObject *acc = NULL;
    job_list jobs = {0};

    if (arrays_from_sequence(st, arrays, argname, 0, &parts, &n) < 0) {
        return NULL;
    }
    if (n == 0) {
        PyErr_Format(PyExc_ValueError, "%s: expected at least one array to reduce", argname);
        goto done;
    }
    {
        /* Sums need a numeric dtype: structured, string and datetime arrays
         * have no addition. */
        PyArray_Descr *d0 = PyArray_DESCR(parts[0]);
        char k = d0->kind;
        if (PyDataType_HASFIELDS(d0) || k == 'V' || k == 'S' || k == 'U' || k == 'M') {
            PyErr_Format(PyExc_TypeError,
                         "%s: arrays of dtype %S cannot be summed (structured, void, string "
                         "and datetime dtypes have no addition); sum numeric fields one by "
                         "one", argname, (PyObject *)d0);
            goto done;
        }
    }
    for (Py_ssize_t i = 1; i < n; i++) {
        if (!PyArray_EquivTypes(PyArray_DESCR(parts[i]), PyArray_DESCR(parts[0]))) {
            /* PyTorch's reduce_add needs one dtype; no silent casting. */
            PyErr_Format(PyExc_TypeError,
                         "%s[%zd]: expected dtype %S (the dtype of %s[0]), got %S; convert "
                         "the arrays to one dtype first", argname, i,
                         (PyObject *)PyArray_DESCR(parts[0]), argname,
                         (PyObject *)PyArray_DESCR(parts[i]));
            goto done;
        }
    }
    for (Py_ssize_t i = 1; i < n; i++) {
        if (!PyArray_SAMESHAPE(parts[i], parts[0])) {
            PyObject *got = shape_str(PyArray_NDIM(parts[i]), PyArray_SHAPE(parts[i]));
            PyObject *exp = got ? shape_str(PyArray_NDIM(parts[0]), PyArray_SHAPE(parts[0]))
                                : NULL;
            if (exp != NULL) {
                PyErr_Format(PyExc_ValueError,
                             "%s: input %zd has invalid size: got %U, but expected %U",
                             argname, i, got, exp);
            }
            Py_XDECREF(got);
            Py_XDECREF(exp);
            goto done;
        }
    }
    if (n == 1 && dp_device_eq(dp_array_device(st, parts[0]), dest)) {
        Py_INCREF(parts[0]);
        acc = (PyObject *)parts[0]; /* a single input is returned as is (spec 8.3) */
        goto done;
    }
    int on_gpu = dest.kind == DP_CUDA;
    for (Py_ssize_t i = 0; i < n; i++) {
        on_gpu = on_gpu || dp_array_device(st, parts[i]).kind == DP_CUDA;
    }
    if (on_gpu) {
        acc = gpu_reduce_add(st, parts, n, dest);
        goto done;
    }
    /* The sum starts as a copy of arrays[0] on dest; the others are added in
     * index order with NumPy's add (same_kind casting into arrays[0]'s dtype). */
    PyArray_Descr *descr = PyArray_DESCR(parts[0]);
    Py_INCREF(descr);
    acc = (PyObject *)dp_empty(st, dest, descr, PyArray_NDIM(parts[0]),
                               PyArray_SHAPE(parts[0]), NULL);
    if (acc == NULL) {
        goto done;
    }
    if (jobs_add(&jobs, PyArray_NDIM(parts[0]), PyArray_SHAPE(parts[0]),
                 (size_t)PyArray_ITEMSIZE(parts[0]), PyArray_BYTES((PyArrayObject *)acc),
                 PyArray_STRIDES((PyArrayObject *)acc), PyArray_BYTES(parts[0]),
                 PyArray_STRIDES(parts[0]), exec_device(dp_array_device(st, parts[0]), dest)) < 0 ||
        jobs_run(&jobs) < 0) {
        Py_CLEAR(acc);
        goto done;
    }
    for (Py_ssize_t i = 1; i < n; i++) {
        PyObject *sum = PyNumber_InPlaceAdd(acc, (PyObject *)parts[i]);
        if (sum == NULL) {
            Py_CLEAR(acc);
            goto done;
        }
        Py_DECREF(sum); /* the same object as acc */
    }
done:
    jobs_free(&jobs);
    arrays_free(parts, n);
    return dp_export(st, acc);
}

PyDoc_STRVAR(comm_reduce_add_doc,
"reduce_add(arrays, destination=None)\n"
"--\n"
"\n"
"Returns the sum as an ndarray on destination.\n"
"Sum arrays of one shape and one dtype onto destination (torch.cuda.comm.reduce_add,\n"
"spec 8.3): the sum is (a0 + a1) + a2 ..., in index order. destination None: the\n"
"device of arrays[0]; 'cpu' the host. A single input already on destination is\n"
"returned as is.\n"
"Raises ValueError (empty, size mismatch: 'input i has invalid size'), TypeError (not\n"
"arrays, object dtype, arrays[i] with another dtype than arrays[0], structured\n"
"dtypes).");

static PyObject *comm_reduce_add(PyObject *m, PyObject *args, PyObject *kw)
{
    static char *kwlist[] = {"arrays", "destination", NULL};
    PyObject *arrays_obj, *dest_obj = Py_None;
    dp_state *st = dp_state_from_module(m);
    dp_device dest, dflt = {DP_HOST, -1};

    if (!PyArg_ParseTupleAndKeywords(args, kw, "O|O:reduce_add", kwlist, &arrays_obj,
                                     &dest_obj)) {
        return NULL;
    }
    if (dest_obj == Py_None && PySequence_Check(arrays_obj) && PySequence_Size(arrays_obj) > 0) {
        PyObject *first = PySequence_GetItem(arrays_obj, 0);
        if (first == NULL) {
            return NULL;
        }
        if (PyArray_Check(first)) {
            dflt = dp_array_device(st, (PyArrayObject *)first);
        }
        Py_DECREF(first);
    }
    PyErr_Clear();
    if (parse_destination(st, dest_obj, "destination", dflt, &dest) < 0) {
        return NULL;
    }
    return dp_reduce_add(st, arrays_obj, dest, "arrays");
}

PyDoc_STRVAR(comm_reduce_add_coalesced_doc,
"reduce_add_coalesced(per_device, destination=None, buffer_size=10485760)\n"
"--\n"
"\n"
"Returns a tuple whose entry t is the sum over d of per_device[d][t].\n"
"per_device[d][t] is array t on device d (torch.cuda.comm.reduce_add_coalesced, spec\n"
"8.4; the rule of reduce_add for each t). All inner sequences must have the same\n"
"length. buffer_size (bytes, > 0) is validated for compatibility.\n"
"Raises ValueError (empty, lengths or sizes that differ, bad buffer_size), TypeError\n"
"(as reduce_add).");

static PyObject *comm_reduce_add_coalesced(PyObject *m, PyObject *args, PyObject *kw)
{
    static char *kwlist[] = {"per_device", "destination", "buffer_size", NULL};
    PyObject *pd_obj, *dest_obj = Py_None, *bs_obj = NULL, *seq = NULL, *result = NULL;
    PyObject *column = NULL;
    dp_state *st = dp_state_from_module(m);
    size_t bs;

    if (!PyArg_ParseTupleAndKeywords(args, kw, "O|OO:reduce_add_coalesced", kwlist, &pd_obj,
                                     &dest_obj, &bs_obj)) {
        return NULL;
    }
    if (parse_buffer_size(bs_obj, &bs) < 0) {
        return NULL;
    }
    seq = PySequence_Fast(pd_obj, "per_device: expected a sequence of per-device sequences");
    if (seq == NULL) {
        return NULL;
    }
    Py_ssize_t ndev = PySequence_Fast_GET_SIZE(seq), ntensors = -1;
    if (ndev == 0) {
        PyErr_SetString(PyExc_ValueError, "per_device: expected at least one device's arrays");
        goto done;
    }
    for (Py_ssize_t d = 0; d < ndev; d++) {
        PyObject *row = PySequence_Fast_GET_ITEM(seq, d);
        Py_ssize_t len = PyArray_Check(row) ? -1 : PySequence_Size(row);
        if (len < 0) {
            PyErr_Clear();
            PyErr_Format(PyExc_TypeError, "per_device[%zd]: expected a sequence of arrays", d);
            goto done;
        }
        if (ntensors >= 0 && len != ntensors) {
            PyErr_Format(PyExc_ValueError,
                         "per_device[%zd]: has %zd arrays, but per_device[0] has %zd", d, len,
                         ntensors);
            goto done;
        }
        ntensors = len;
    }
    PyObject *first_row = PySequence_Fast_GET_ITEM(seq, 0);
    result = PyTuple_New(ntensors);
    if (result == NULL) {
        goto done;
    }
    for (Py_ssize_t t = 0; t < ntensors; t++) {
        column = PyList_New(ndev);
        if (column == NULL) {
            Py_CLEAR(result);
            goto done;
        }
        for (Py_ssize_t d = 0; d < ndev; d++) {
            PyObject *item = PySequence_GetItem(PySequence_Fast_GET_ITEM(seq, d), t);
            if (item == NULL) {
                Py_CLEAR(result);
                goto done;
            }
            PyList_SET_ITEM(column, d, item);
        }
        dp_device dest, dflt = {DP_HOST, -1};
        PyObject *first = PyList_GET_ITEM(column, 0);
        if (PyArray_Check(first)) {
            dflt = dp_array_device(st, (PyArrayObject *)first);
        }
        char name[64];
        snprintf(name, sizeof name, "per_device[:][%zd]", t);
        if (parse_destination(st, dest_obj, "destination", dflt, &dest) < 0) {
            Py_CLEAR(result);
            goto done;
        }
        PyObject *sum = dp_reduce_add(st, column, dest, name);
        Py_CLEAR(column);
        if (sum == NULL) {
            Py_CLEAR(result);
            goto done;
        }
        PyTuple_SET_ITEM(result, t, sum);
    }
    (void)first_row;
done:
    Py_XDECREF(column);
    Py_DECREF(seq);
    return result;
}

/* ------------------------------------------------------------------ */
/* asarray                                                             */
/* ------------------------------------------------------------------ */

PyDoc_STRVAR(asarray_doc,
"asarray(obj, device=None)\n"
"--\n"
"\n"
"Returns an ndarray (on device when one is given).\n"
"obj as an ndarray without a copy, like numpy.asarray: an ndarray (subclasses other\n"
"than MaskedArray and matrix are accepted), a buffer-protocol object (bytes,\n"
"bytearray, memoryview, array.array: read through a memoryview, so bytes become a 1-D\n"
"uint8 array), an __array_interface__ / __array_struct__ object, a nested list or a\n"
"number; any shape, non-object dtype. With device ('cpu', 'cpu:N', a CUDA device or a\n"
"dpmini.Device), a copy on that device (from dpmini's caching allocator) unless obj\n"
"already lives there (then the array itself). Dense layouts keep their strides.\n"
"Rule source: torch.as_tensor(obj, device=device) (a copy only when needed).\n"
"Raises TypeError (not an array, object dtype, MaskedArray/matrix), ValueError\n"
"(ragged nested lists: 'obj: ...', bad device).");

static PyObject *py_asarray(PyObject *m, PyObject *args, PyObject *kw)
{
    static char *kwlist[] = {"obj", "device", "pin_memory", NULL};
    PyObject *obj, *dev_obj = Py_None, *result = NULL;
    dp_state *st = dp_state_from_module(m);
    dp_device dev;
    job_list jobs = {0};
    int pin = 0;

    if (!PyArg_ParseTupleAndKeywords(args, kw, "O|Op:asarray", kwlist, &obj, &dev_obj, &pin)) {
        return NULL;
    }
    PyArrayObject *arr;
    if (!PyArray_Check(obj) &&
        (PyList_Check(obj) || PyTuple_Check(obj) || PyNumber_Check(obj))) {
        /* Nested lists and Python numbers, as numpy.asarray takes them. */
        arr = (PyArrayObject *)PyArray_FromAny(obj, NULL, 0, 0, 0, NULL);
        if (arr == NULL && PyErr_ExceptionMatches(PyExc_ValueError)) {
            /* e.g. ragged nested lists: say which argument */
            PyObject *t, *v, *tb;
            PyErr_Fetch(&t, &v, &tb);
            PyErr_NormalizeException(&t, &v, &tb);
            PyErr_Format(PyExc_ValueError, "obj: cannot make an array of this %.100s (%S)",
                         Py_TYPE(obj)->tp_name, v ? v : Py_None);
            Py_XDECREF(t);
            Py_XDECREF(v);
            Py_XDECREF(tb);
        }
        if (arr != NULL && PyDataType_REFCHK(PyArray_DESCR(arr))) {
            Py_CLEAR(arr);
            PyErr_Format(PyExc_TypeError, "obj: %.100s does not convert to a numeric array",
                         Py_TYPE(obj)->tp_name);
        }
    } else {
        arr = dp_as_array(st, obj, "obj", 0);
    }
    if (arr == NULL) {
        return NULL;
    }
    if (pin) {
        /* a copy in page-locked host memory (direct DMA to and from GPUs) */
        if (dev_obj != Py_None &&
            (dp_device_from_object(st, dev_obj, "device", DP_DEV_ALLOW_HOST, &dev) < 0 ||
             dev.kind != DP_HOST)) {
            if (!PyErr_Occurred()) {
                PyErr_SetString(PyExc_ValueError,
                                "pin_memory: only host memory ('cpu') can be pinned");
            }
            goto done;
        }
        PyObject *buf = dp_buffer_new_pinned(st, (size_t)PyArray_NBYTES(arr));
        if (buf == NULL) {
            goto done;
        }
        PyArray_Descr *descr = PyArray_DESCR(arr);
        Py_INCREF(descr);
        result = PyArray_NewFromDescr(&PyArray_Type, descr, PyArray_NDIM(arr),
                                      PyArray_SHAPE(arr), NULL, ((dp_BufferObject *)buf)->ptr,
                                      NPY_ARRAY_WRITEABLE | NPY_ARRAY_ALIGNED, NULL);
        if (result == NULL) {
            Py_DECREF(buf);
            goto done;
        }
        if (PyArray_SetBaseObject((PyArrayObject *)result, buf) < 0) {
            Py_CLEAR(result);
            goto done;
        }
        dp_device host = {DP_HOST, -1};
        if (jobs_add(&jobs, PyArray_NDIM(arr), PyArray_SHAPE(arr), (size_t)PyArray_ITEMSIZE(arr),
                     PyArray_BYTES((PyArrayObject *)result),
                     PyArray_STRIDES((PyArrayObject *)result), PyArray_BYTES(arr),
                     PyArray_STRIDES(arr), exec_device(dp_array_device(st, arr), host)) < 0 ||
            jobs_run(&jobs) < 0) {
            Py_CLEAR(result);
        }
        goto done;
    }
    if (dev_obj == Py_None) {
        if (PyObject_TypeCheck(obj, st->ArrayType)) {
            Py_DECREF(arr);
            return Py_NewRef(obj);
        }
        return dp_export(st, (PyObject *)arr); /* a GPU import becomes a dpmini.Array */
    }
    if (dp_device_from_object(st, dev_obj, "device", DP_DEV_ALLOW_HOST, &dev) < 0) {
        goto done;
    }
    if (dp_device_eq(dp_array_device(st, arr), dev)) {
        if (PyObject_TypeCheck(obj, st->ArrayType)) {
            result = Py_NewRef(obj);
        } else {
            Py_INCREF(arr);
            result = dp_export(st, (PyObject *)arr);
        }
        goto done;
    }
    result = copy_to(st, &jobs, arr, dev);
    if (result != NULL && jobs_run(&jobs) < 0) {
        Py_CLEAR(result);
    }
    result = dp_export(st, result);
done:
    jobs_free(&jobs);
    Py_DECREF(arr);
    return result;
}

PyMethodDef dp_comm_methods[] = {
    {"asarray", (PyCFunction)(void (*)(void))py_asarray, METH_VARARGS | METH_KEYWORDS,
     asarray_doc},
    {NULL},
};

/* The functions of dpmini.comm (module.c makes the submodule; self is the
 * dpmini._dpmini module). */
PyMethodDef dp_comm_submodule_methods[] = {
    {"scatter", (PyCFunction)(void (*)(void))comm_scatter, METH_VARARGS | METH_KEYWORDS,
     comm_scatter_doc},
    {"gather", (PyCFunction)(void (*)(void))comm_gather, METH_VARARGS | METH_KEYWORDS,
     comm_gather_doc},
    {"broadcast", (PyCFunction)(void (*)(void))comm_broadcast,
     METH_VARARGS | METH_KEYWORDS, comm_broadcast_doc},
    {"broadcast_coalesced", (PyCFunction)(void (*)(void))comm_broadcast_coalesced,
     METH_VARARGS | METH_KEYWORDS, comm_broadcast_coalesced_doc},
    {"reduce_add", (PyCFunction)(void (*)(void))comm_reduce_add,
     METH_VARARGS | METH_KEYWORDS, comm_reduce_add_doc},
    {"reduce_add_coalesced", (PyCFunction)(void (*)(void))comm_reduce_add_coalesced,
     METH_VARARGS | METH_KEYWORDS, comm_reduce_add_coalesced_doc},
    {NULL},
};
