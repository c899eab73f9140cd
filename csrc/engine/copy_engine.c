/* copy_engine.c - the copy engine's array-level scatter and gather that
 * DataParallel and dpmini.comm build on (dp_scatter_run, dp_gather_arrays),
 * and their helpers. The copy jobs (strided copies between host, virtual CPU
 * devices and GPUs, grouped per executing device and run on the device
 * worker threads, pool.c) are in copy_jobs.c, the overlap checks on out=
 * arrays in copy_overlap.c, broadcast (dp_copy_to_device,
 * dp_broadcast_coalesced) in copy_broadcast.c. The Python functions are in
 * comm.c, comm_broadcast.c and asarray.c, reduce_add in reduce.c, their
 * sequences of arrays in copy_arrays.c; what they
 * share is in copy_engine.h.
 *
 * Sections: helpers; scatter; gather.
 */
#include "dpmini.h"
#include "engine.h"
#include "gpu.h"
#include "copy_engine.h"
#include "plan.h"
#include "copy.h"
#include "pool.h"

#include <string.h>

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

/* A view of src with `shape`, starting at `data`, same strides (docs/spec.md 3.4). */
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

static PyArrayObject *region_in_slab(dp_state *st, dp_slab *s, size_t hint, dp_device dev,
                                     PyArrayObject *src, const npy_intp *shape,
                                     const npy_intp *strides);

/* A fresh array on dev for a copy of the strided region (data of `src`'s
 * dtype, `shape`, `strides`): a dense region keeps its layout (PyTorch's
 * memory_format=preserve), anything else becomes C-contiguous. */
PyArrayObject *empty_like_region(dp_state *st, dp_device dev, PyArrayObject *src,
                                 const npy_intp *shape, const npy_intp *strides)
{
    return region_in_slab(st, NULL, 0, dev, src, shape, strides);
}

/* empty_like_region carved from slab s (dp_empty_slab; NULL: its own
 * buffer); hint as dp_empty_slab's. */
static PyArrayObject *region_in_slab(dp_state *st, dp_slab *s, size_t hint, dp_device dev,
                                     PyArrayObject *src, const npy_intp *shape,
                                     const npy_intp *strides)
{
    int nd = PyArray_NDIM(src);
    size_t itemsize = (size_t)PyArray_ITEMSIZE(src);
    int64_t sh[DP_MAXDIMS], sd[DP_MAXDIMS], out[DP_MAXDIMS];
    int perm[DP_MAXDIMS];
    npy_intp new_strides[DP_MAXDIMS];
    const npy_intp *use = NULL;
    /* A region in C order whose dims are all longer than 1 (a shard of a
     * C-contiguous array, the usual case) keeps C order, which is what the
     * dense rule below would give it: no need to sort its dims. */
    int c_order = nd > 1 && itemsize > 0;
    npy_intp expect = (npy_intp)itemsize;
    for (int i = nd - 1; i >= 0 && c_order; i--) {
        c_order = shape[i] > 1 && strides[i] == expect &&
                  !__builtin_mul_overflow(expect, shape[i], &expect);
    }
    for (int i = 0; i < nd && !c_order; i++) {
        sh[i] = shape[i];
        sd[i] = strides[i];
    }
    if (!c_order && nd > 1 && itemsize > 0 && dp_layout_is_dense(nd, sh, sd, itemsize, perm)) {
        dp_dense_strides(nd, sh, itemsize, perm, out);
        for (int i = 0; i < nd; i++) {
            new_strides[i] = (npy_intp)out[i];
        }
        use = new_strides;
    }
    PyArray_Descr *descr = PyArray_DESCR(src);
    Py_INCREF(descr);
    return s != NULL ? dp_empty_slab(st, s, dev, descr, nd, shape, use, hint)
                     : dp_empty(st, dev, descr, nd, shape, use);
}

PyObject *devices_error(const char *argname)
{
    PyErr_Format(PyExc_ValueError, "%s: Expected at least one device to scatter to", argname);
    return NULL;
}

/* ------------------------------------------------------------------ */
/* Scatter                                                             */
/* ------------------------------------------------------------------ */

/* Bytes of a chunk of src with `shape` (no overflow: a region of src). */
static size_t region_bytes(PyArrayObject *src, const npy_intp *shape)
{
    size_t n = (size_t)PyArray_ITEMSIZE(src);
    for (int d = 0; d < PyArray_NDIM(src); d++) {
        n *= (size_t)shape[d];
    }
    return n;
}

/* Chunks no larger than this share buffers per device (dp_slab), when a
 * device gets at least two of them in one call: a scatter of many small
 * leaves then allocates a few buffers instead of one per chunk. */
static int slab_piece(dp_device d, size_t nbytes)
{
    return d.kind != DP_CUDA && nbytes > 0 && nbytes <= DP_SLAB_PIECE_MAX;
}

/* A call that copies at most this many bytes between host memory (the host
 * and virtual CPU devices) copies them at once, in the calling thread,
 * without queueing jobs: the job list would run them there too (it copies
 * inline below a larger bound, copy_jobs.c), and for small leaves queueing
 * costs more than copying. */
#define DP_DIRECT_BYTES ((size_t)64 << 10)

/* dst[...] = src[...] for `shape` now, in this thread (strides in bytes;
 * host memory on both sides). */
static int copy_now_run(int nd, const npy_intp *shape, size_t itemsize, char *dst,
                    const npy_intp *dst_strides, const char *src, const npy_intp *src_strides)
{
    int64_t run = (int64_t)itemsize;
    int flat = 1;
    for (int i = nd - 1; i >= 0; i--) {
        if (shape[i] == 0) {
            return 0;
        }
        if (shape[i] != 1) {
            flat = flat && src_strides[i] == run && dst_strides[i] == run;
            run *= (int64_t)shape[i];   /* no overflow: a small region */
        }
    }
    if (itemsize == 0) {
        return 0;
    }
    if (flat) {   /* contiguous on both sides: one run */
        memcpy(dst, src, (size_t)run);
        return 0;
    }
    int64_t sh[DP_MAXDIMS], ss[DP_MAXDIMS], ds[DP_MAXDIMS];
    dp_copy_desc d;
    for (int i = 0; i < nd && i < DP_MAXDIMS; i++) {
        sh[i] = shape[i];
        ss[i] = src_strides[i];
        ds[i] = dst_strides[i];
    }
    if (dp_copy_init(&d, nd, itemsize, sh, ss, ds) < 0) {
        PyErr_Format(PyExc_ValueError, "copy: %d dimensions is more than dpmini supports (%d)",
                     nd, DP_MAXDIMS);
        return -1;
    }
    dp_copy_simplify(&d);
    dp_copy_run_mode(&d, dst, src, DP_COPY_AUTO);
    return 0;
}

/* copy_now_run, recorded under dpmini.profile() as a copy for device dev. */
static int copy_now(dp_device dev, int nd, const npy_intp *shape, size_t itemsize, char *dst,
                    const npy_intp *dst_strides, const char *src, const npy_intp *src_strides)
{
    dp_prof_ctx prof = dp_prof_current();
    uint64_t t0 = prof.s != NULL ? dp_prof_now() : 0;
    int rc = copy_now_run(nd, shape, itemsize, dst, dst_strides, src, src_strides);
    if (prof.s != NULL) {
        uint64_t bytes = itemsize;
        int strided = 0;
        int64_t run = (int64_t)itemsize;
        for (int i = nd - 1; i >= 0; i--) {
            bytes *= (uint64_t)shape[i];
            if (shape[i] != 1) {
                strided |= src_strides[i] != run || dst_strides[i] != run;
                run *= (int64_t)shape[i];
            }
        }
        dp_prof_record_span(&prof, DP_PROF_COPY, dev.kind, dev.index, t0, dp_prof_now(), bytes,
                            DP_PROF_PATH_INLINE, strided, NULL);
    }
    return rc;
}

/* One scatter: where its chunks go, the slabs that hold a device's small
 * host chunks together, and the jobs that copy them there. */
typedef struct {
    dp_state *st;
    const dp_device *devs;
    int maxk;                      /* the most chunks of any item          */
    dp_slab slabs[DP_MAX_DEVICES];
    size_t left[DP_MAX_DEVICES];   /* slab bytes each device still needs   */
    int pieces[DP_MAX_DEVICES];    /* chunks each device's slab will hold  */
    Py_ssize_t njobs;              /* jobs to reserve                      */
    int direct;                    /* small host total: copied right away  */
    job_list jobs;
} scatter_run;

/* Every chunk's output NULL, and r->maxk: no more chunks than devices. */
static int scatter_start(scatter_run *r, dp_scatter_item *items, int nitems)
{
    for (int i = 0; i < nitems; i++) {
        for (int j = 0; j < items[i].nchunks; j++) {
            items[i].out[j] = NULL;
        }
        r->maxk = items[i].nchunks > r->maxk ? items[i].nchunks : r->maxk;
    }
    if (r->maxk > DP_MAX_DEVICES) {
        PyErr_Format(PyExc_ValueError, "scatter: %d chunks is more than %d devices", r->maxk,
                     DP_MAX_DEVICES);
        return -1;
    }
    return 0;
}

/* The sizes before anything is allocated: the bytes each device's slab
 * needs and how many chunks it holds, whether the host copies are small
 * enough to run right away, and how many jobs to reserve. */
static void scatter_measure(scatter_run *r, dp_scatter_item *items, int nitems)
{
    size_t total = 0;              /* bytes copied between host memory */
    for (int i = 0; i < nitems; i++) {
        dp_scatter_item *it = &items[i];
        npy_intp shape[DP_MAXDIMS];
        memcpy(shape, PyArray_SHAPE(it->src), (size_t)PyArray_NDIM(it->src) * sizeof(npy_intp));
        dp_device home = dp_array_device(r->st, it->src);
        for (int j = 0; j < it->nchunks; j++) {
            if (dp_device_eq(r->devs[j], home)) {
                continue;   /* a view */
            }
            shape[it->dim] = (npy_intp)it->sizes[j];
            size_t nb = region_bytes(it->src, shape);
            if (home.kind == DP_CUDA || r->devs[j].kind == DP_CUDA) {
                r->njobs++;
                continue;
            }
            total = total + nb >= total ? total + nb : SIZE_MAX;
            if (slab_piece(r->devs[j], nb)) {
                r->left[j] += DP_SLAB_ROUND(nb);
                r->pieces[j]++;
            }
        }
    }
    r->direct = total <= DP_DIRECT_BYTES;
    if (!r->direct) {   /* then every copy is queued */
        for (int i = 0; i < nitems; i++) {
            r->njobs += items[i].nchunks;
        }
    }
}

/* The chunks of one item: a view where the chunk stays on the source's
 * device, else a fresh array (in the device's slab when it holds several
 * small host chunks) and its copy, made now or queued. */
static int scatter_add_item(scatter_run *r, dp_scatter_item *it)
{
    PyArrayObject *src = it->src;
    int nd = PyArray_NDIM(src);
    npy_intp shape[DP_MAXDIMS];
    memcpy(shape, PyArray_SHAPE(src), (size_t)nd * sizeof(npy_intp));
    dp_device home = dp_array_device(r->st, src);
    npy_intp stride = PyArray_STRIDES(src)[it->dim];
    int64_t offset = 0;
    for (int j = 0; j < it->nchunks; j++) {
        dp_device dev = r->devs[j];
        char *data = PyArray_BYTES(src) + offset * stride;
        shape[it->dim] = (npy_intp)it->sizes[j];
        offset += it->sizes[j];
        if (dp_device_eq(dev, home)) {
            it->out[j] = make_view(src, data, shape);
            if (it->out[j] == NULL) {
                return -1;
            }
            continue;
        }
        dp_slab *slab = NULL;
        size_t hint = 0;
        int host = home.kind != DP_CUDA && dev.kind != DP_CUDA;
        if (host && r->pieces[j] >= 2) {
            size_t nb = region_bytes(src, shape);
            if (slab_piece(dev, nb)) {
                slab = &r->slabs[j];
                hint = r->left[j];
                r->left[j] -= DP_SLAB_ROUND(nb);
            }
        }
        PyArrayObject *dst = region_in_slab(r->st, slab, hint, dev, src, shape,
                                            PyArray_STRIDES(src));
        if (dst == NULL) {
            return -1;
        }
        it->out[j] = (PyObject *)dst;
        int rc = r->direct && host
            ? copy_now(dev, nd, shape, (size_t)PyArray_ITEMSIZE(src), PyArray_BYTES(dst),
                       PyArray_STRIDES(dst), data, PyArray_STRIDES(src))
            : jobs_add(&r->jobs, nd, shape, (size_t)PyArray_ITEMSIZE(src),
                       PyArray_BYTES(dst), PyArray_STRIDES(dst), data,
                       PyArray_STRIDES(src), exec_device(home, dev));
        if (rc < 0) {
            return -1;
        }
    }
    return 0;
}

/* Chunks on GPUs leave as dpmini.Array; a view on the source's device or a
 * host copy as it is. */
static int scatter_export_gpu_chunks(scatter_run *r, dp_scatter_item *items, int nitems)
{
    for (int j = 0; j < r->maxk; j++) {
        if (r->devs[j].kind != DP_CUDA) {
            continue;
        }
        for (int i = 0; i < nitems; i++) {
            if (j < items[i].nchunks) {
                items[i].out[j] = dp_export(r->st, items[i].out[j]);
                if (items[i].out[j] == NULL) {
                    return -1;
                }
            }
        }
    }
    return 0;
}

static void scatter_clear_slabs(scatter_run *r)
{
    for (int j = 0; j < r->maxk; j++) {
        dp_slab_clear(&r->slabs[j]);
    }
}

/* Every chunk made and copied, in the order: measure, reserve, add each
 * item, run the jobs, export the GPU chunks. */
static int scatter_make_chunks(scatter_run *r, dp_scatter_item *items, int nitems)
{
    scatter_measure(r, items, nitems);
    if (r->njobs > 0 && jobs_reserve(&r->jobs, r->njobs) < 0) {
        return -1;
    }
    for (int i = 0; i < nitems; i++) {
        if (scatter_add_item(r, &items[i]) < 0) {
            return -1;
        }
    }
    scatter_clear_slabs(r);
    if (jobs_run(&r->jobs) < 0) {
        return -1;
    }
    jobs_free(&r->jobs);
    return scatter_export_gpu_chunks(r, items, nitems);
}

int dp_scatter_run(dp_state *st, dp_scatter_item *items, int nitems, const dp_device *devs)
{
    scatter_run r = {.st = st, .devs = devs};
    if (scatter_start(&r, items, nitems) < 0) {
        return -1;
    }
    if (scatter_make_chunks(&r, items, nitems) == 0) {
        return 0;
    }
    jobs_free(&r.jobs);
    scatter_clear_slabs(&r);
    for (int i = 0; i < nitems; i++) {
        for (int j = 0; j < items[i].nchunks; j++) {
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
    return dp_gather_arrays_slab(st, parts, n, dim, dest, out, argname, NULL);
}

/* The parts of a gather agree (at least one, the same ndim, no Python
 * objects, the same shape but along dim) and their sizes along dim add up
 * without overflow: 0 with the result's shape in shape[0..*nd), else -1. */
static int gather_check_parts(PyArrayObject **parts, Py_ssize_t n, int dim,
                              const char *argname, npy_intp *shape, int *nd_out)
{
    if (n == 0) {
        PyErr_Format(PyExc_ValueError, "%s: Expected at least one array to gather from",
                     argname);
        return -1;
    }
    int nd = PyArray_NDIM(parts[0]);
    if (dim < 0 || dim >= nd) {
        PyErr_Format(PyExc_IndexError, "%s: dim %d out of range for %d-dim arrays", argname,
                     dim, nd);
        return -1;
    }
    memcpy(shape, PyArray_SHAPE(parts[0]), (size_t)nd * sizeof(npy_intp));
    int64_t total = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyArrayObject *p = parts[i];
        if (PyArray_NDIM(p) != nd) {
            PyErr_Format(PyExc_ValueError,
                         "%s: Expected all arrays to have the same number of dimensions, but "
                         "array at index %zd has %d dimensions, (expected %d)",
                         argname, i, PyArray_NDIM(p), nd);
            return -1;
        }
        if (PyDataType_REFCHK(PyArray_DESCR(p))) {
            PyErr_Format(PyExc_TypeError, "%s: array at index %zd holds Python objects "
                         "(dtype %S); they cannot be gathered", argname, i,
                         (PyObject *)PyArray_DESCR(p));
            return -1;
        }
        shape[dim] = PyArray_DIM(p, dim);
        for (int d = 0; d < nd; d++) {
            if (PyArray_DIM(p, d) != shape[d]) {
                shape_error(argname, i, p, shape, nd);
                return -1;
            }
        }
        /* Shapes of strided views (zero strides) can be huge: a wrapped sum
         * would allocate too little and copy past it. */
        if (__builtin_add_overflow(total, (int64_t)PyArray_DIM(p, dim), &total) ||
            total > NPY_MAX_INTP) {
            PyErr_Format(PyExc_ValueError,
                         "%s: the gathered size along dimension %d is larger than %zd "
                         "(at array index %zd)", argname, dim, (Py_ssize_t)NPY_MAX_INTP, i);
            return -1;
        }
    }
    shape[dim] = (npy_intp)total;
    *nd_out = nd;
    return 0;
}

/* An out= array can take the gathered result: its shape is shape, it is
 * writeable and it overlaps no part. 0, else -1 (ValueError). */
static int gather_check_out(PyArrayObject *out, PyArrayObject **parts, Py_ssize_t n,
                            int nd, const npy_intp *shape, const char *argname)
{
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
        return -1;
    }
    if (!PyArray_ISWRITEABLE(out)) {
        PyErr_SetString(PyExc_ValueError, "out: output array is read-only");
        return -1;
    }
    return check_out_overlap(out, parts, n, "out", argname);
}

/* One gather into its result: where the parts go and the jobs that copy
 * them there. */
typedef struct {
    dp_state *st;
    PyArrayObject *result;  /* out (new reference) or a fresh array        */
    dp_device dest;         /* where result lives                          */
    int nd, dim;
    int direct;             /* small and in host memory: copied right away */
    job_list jobs;
} gather_into;

/* Part p of another dtype, cast to the result's dtype (as PyTorch does,
 * docs/spec.md 4.7) into dst, result's region for it. NumPy's own casting loop does
 * it, with the GIL held; on a GPU side the cast is made on the host, then
 * copied (NumPy never sees device memory). */
static int gather_cast_part(gather_into *g, PyArrayObject *p, char *dst)
{
    dp_state *st = g->st;
    PyArrayObject *result = g->result;
    if (g->dest.kind == DP_CUDA || dp_array_device(st, p).kind == DP_CUDA) {
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
            return -1;
        }
        job_list one = {0};
        int rc = jobs_add(&one, g->nd, PyArray_SHAPE(p), (size_t)PyArray_ITEMSIZE(result), dst,
                          PyArray_STRIDES(result), PyArray_BYTES((PyArrayObject *)cast),
                          PyArray_STRIDES((PyArrayObject *)cast), exec_device(host, g->dest));
        if (rc == 0) {
            rc = jobs_run(&one);
        }
        jobs_free(&one);
        Py_DECREF(cast);
        return rc;
    }
    PyObject *view = make_view(result, dst, PyArray_SHAPE(p));
    if (view == NULL) {
        return -1;
    }
    int rc = PyArray_CopyInto((PyArrayObject *)view, p);
    Py_DECREF(view);
    return rc;
}

/* Part p into dst, result's region for it: copied now when small and in
 * host memory, queued as a job otherwise, cast when its dtype differs. */
static int gather_add_part(gather_into *g, PyArrayObject *p, char *dst)
{
    if (!PyArray_EquivTypes(PyArray_DESCR(p), PyArray_DESCR(g->result))) {
        return gather_cast_part(g, p, dst);
    }
    dp_device pdev = dp_array_device(g->st, p);
    if (g->direct && pdev.kind != DP_CUDA) {   /* a small copy in host memory */
        return copy_now(pdev, g->nd, PyArray_SHAPE(p), (size_t)PyArray_ITEMSIZE(p), dst,
                        PyArray_STRIDES(g->result), PyArray_BYTES(p), PyArray_STRIDES(p));
    }
    return jobs_add(&g->jobs, g->nd, PyArray_SHAPE(p), (size_t)PyArray_ITEMSIZE(p), dst,
                    PyArray_STRIDES(g->result), PyArray_BYTES(p), PyArray_STRIDES(p),
                    exec_device(pdev, g->dest));
}

/* Every part into its region of g->result, one after the other along dim,
 * and the queued jobs run. */
static int gather_add_parts(gather_into *g, PyArrayObject **parts, Py_ssize_t n)
{
    if (!g->direct && jobs_reserve(&g->jobs, n) < 0) {
        return -1;
    }
    npy_intp stride = PyArray_STRIDES(g->result)[g->dim];
    int64_t offset = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        char *dst = PyArray_BYTES(g->result) + offset * stride;
        offset += PyArray_DIM(parts[i], g->dim);
        if (gather_add_part(g, parts[i], dst) < 0) {
            return -1;
        }
    }
    return jobs_run(&g->jobs);
}

PyObject *dp_gather_arrays_slab(dp_state *st, PyArrayObject **parts, Py_ssize_t n, int dim,
                                dp_device dest, PyArrayObject *out, const char *argname,
                                dp_slab *slab)
{
    npy_intp shape[DP_MAXDIMS];
    int nd;
    if (gather_check_parts(parts, n, dim, argname, shape, &nd) < 0) {
        return NULL;
    }
    gather_into g = {.st = st, .nd = nd, .dim = dim};
    if (out != NULL) {
        if (gather_check_out(out, parts, n, nd, shape, argname) < 0) {
            return NULL;
        }
        g.result = (PyArrayObject *)Py_NewRef(out);
        g.dest = dp_array_device(st, out);
    } else {
        PyArray_Descr *descr = PyArray_DESCR(parts[0]);
        Py_INCREF(descr);
        g.result = dp_empty_slab(st, slab, dest, descr, nd, shape, NULL, 0);
        if (g.result == NULL) {
            return NULL;
        }
        g.dest = dest;
    }
    copy_job few[2];   /* a gather per leaf from 2 devices allocates no job list */
    jobs_init_fixed(&g.jobs, few, 2);
    g.direct = g.dest.kind != DP_CUDA && (size_t)PyArray_NBYTES(g.result) <= DP_DIRECT_BYTES;
    int rc = gather_add_parts(&g, parts, n);
    jobs_free(&g.jobs);
    if (rc < 0) {
        Py_DECREF(g.result);
        return NULL;
    }
    if (out != NULL || g.dest.kind != DP_CUDA) {
        return (PyObject *)g.result;
    }
    return dp_export(st, (PyObject *)g.result);
}
