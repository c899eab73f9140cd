/* dist_move.c - scatter, gather, all_gather and broadcast across ranks.
 *
 * An array of shape (outer..., n, inner...) is seen as `outer` blocks of n
 * rows of `inner_bytes` bytes; a rank's piece is its rows of every block.
 * Along the first dimension (outer == 1) pieces are contiguous and move
 * straight from/to the arrays. Otherwise root packs the pieces into one
 * staging buffer (one memcpy per block row, GIL released; see restage) and
 * they move as contiguous messages; a non-root rank's piece is always
 * contiguous. MPI derived datatypes (a vector of rows) describe both.
 * The split of rows across ranks is plan.c's (torch.chunk, or explicit
 * chunk_sizes, or weights), the same rule DataParallel uses for devices.
 */
#include "dist.h"
#include "plan.h" /* csrc/core/ */

#include <limits.h>
#include <stdio.h>
#include <string.h>
#include <unistd.h>

static int wrap_dim(int dim, int ndim, const char *name);

/* Bytes of memory this process can still take: MemAvailable of
 * /proc/meminfo, else the machine's physical memory; -1 unknown. */
static int64_t memory_available(void)
{
    FILE *f = fopen("/proc/meminfo", "r");
    char line[128];
    long long kib = -1;
    while (f != NULL && fgets(line, sizeof line, f) != NULL)
        if (sscanf(line, "MemAvailable: %lld kB", &kib) == 1)
            break;
    if (f != NULL)
        fclose(f);
    if (kib >= 0)
        return (int64_t)kib * 1024;
    long pages = sysconf(_SC_PHYS_PAGES), size = sysconf(_SC_PAGESIZE);
    return pages > 0 && size > 0 ? (int64_t)pages * size : -1;
}

/* MPI's int counts and the memory a copy needs, checked on x's shape
 * before PyArray_FromAny makes a view contiguous (a broadcast_to of 2**31
 * elements is gigabytes to copy, long enough for the other ranks to time
 * out, and may not fit at all). split_dim: the split/join dimension
 * (blocks, rows and row bytes each < 2**31), or DIST_WHOLE: the element
 * count < 2**31. -1 with OverflowError / IndexError / MemoryError. */
static int check_before_copy(PyArrayObject *a, const char *name, int native, int split_dim)
{
    int nd = PyArray_NDIM(a);
    int64_t item = PyArray_ITEMSIZE(a);
    if (split_dim == DIST_WHOLE) {
        int64_t n = PyArray_SIZE(a);
        if (n > INT_MAX || item > INT_MAX) {
            PyErr_Format(PyExc_OverflowError, "%s: %lld elements do not fit MPI's int count "
                         "(< 2**31)%s; move it in parts", name, (long long)n,
                         item > INT_MAX ? ", nor does its item size" : "");
            return -1;
        }
    } else if (nd <= DIST_MAX_NDIM) {
        int d = wrap_dim(split_dim, nd, name);
        if (d < 0)
            return -1;
        int64_t outer = 1, inner = item;
        for (int i = 0; i < d; i++)
            outer *= PyArray_DIM(a, i);
        for (int i = d + 1; i < nd; i++)
            inner *= PyArray_DIM(a, i);   /* a whole array's bytes fit in npy_intp */
        int64_t rows = PyArray_DIM(a, d);
        if (PyArray_SIZE(a) > 0 && (outer > INT_MAX || rows > INT_MAX || inner > INT_MAX)) {
            PyErr_Format(PyExc_OverflowError, "%s: %lld blocks of %lld rows of %lld bytes "
                         "along dim %d do not fit MPI's int counts (each must be < 2**31); "
                         "move it in parts", name, (long long)outer, (long long)rows,
                         (long long)inner, d);
            return -1;
        }
    }
    int copies = !PyArray_IS_C_CONTIGUOUS(a) || !PyArray_ISALIGNED(a) ||
                 (native && PyArray_ISBYTESWAPPED(a));
    int64_t need = (int64_t)PyArray_NBYTES(a);
    if (!copies || need < ((int64_t)64 << 20))
        return 0;
    int64_t avail = memory_available();
    if (avail >= 0 && need > avail) {
        char gib[64];   /* PyErr_Format has no %f */
        snprintf(gib, sizeof gib, "%.2f GiB, and this rank has %.2f GiB",
                 (double)need / (1 << 30), (double)avail / (1 << 30));
        PyErr_Format(PyExc_MemoryError, "%s: this view would be copied to be sent (it is not "
                     "C-contiguous%s), which needs %s of memory available; send a contiguous "
                     "array or move it in parts", name,
                     native && PyArray_ISBYTESWAPPED(a) ? ", or not in native byte order" : "",
                     gib);
        return -1;
    }
    return 0;
}

PyObject *dist_as_array(PyObject *x, const char *name, int native, int split_dim)
{
    if (dist_refuse_subclass(x, name) < 0)
        return NULL;
    if (PyArray_Check(x) && check_before_copy((PyArrayObject *)x, name, native, split_dim) < 0)
        return NULL;
    PyObject *arr = PyArray_FromAny(x, NULL, 0, 0, NPY_ARRAY_C_CONTIGUOUS | NPY_ARRAY_ALIGNED,
                                    NULL);
    /* NPY_ARRAY_NOTSWAPPED does nothing without a dtype to convert to (a
     * '>f8' array came through as it was and MPI summed its bytes as native
     * numbers): ask for the native twin of its own dtype. */
    if (native && arr != NULL && PyArray_ISBYTESWAPPED((PyArrayObject *)arr)) {
        PyArray_Descr *d = PyArray_DescrNewByteorder(PyArray_DESCR((PyArrayObject *)arr),
                                                     NPY_NATIVE);
        Py_SETREF(arr, d ? PyArray_FromArray((PyArrayObject *)arr, d, NPY_ARRAY_CARRAY) : NULL);
    }
    if (arr == NULL)
        return NULL;
    if (PyDataType_REFCHK(PyArray_DESCR((PyArrayObject *)arr))) {
        PyErr_Format(PyExc_TypeError,
                     "%s: arrays holding Python objects (dtype %R) cannot travel as bytes; "
                     "broadcast() sends any picklable object", name,
                     (PyObject *)PyArray_DESCR((PyArrayObject *)arr));
        Py_DECREF(arr);
        return NULL;
    }
    if (PyArray_NDIM((PyArrayObject *)arr) > DIST_MAX_NDIM) {
        PyErr_Format(PyExc_ValueError, "%s: %d dimensions, at most %d", name,
                     PyArray_NDIM((PyArrayObject *)arr), DIST_MAX_NDIM);
        Py_DECREF(arr);
        return NULL;
    }
    return arr;
}

PyObject *dist_empty_like_meta(const dist_meta *m, int dim, int64_t rows, PyArrayObject *like)
{
    npy_intp shape[DIST_MAX_NDIM];
    for (int64_t i = 0; i < m->ndim; i++)
        shape[i] = (npy_intp)m->shape[i];
    if (dim >= 0)
        shape[dim] = (npy_intp)rows;
    PyArray_Descr *d = NULL;
    if (like != NULL) {
        d = PyArray_DESCR(like);
        Py_INCREF(d);
    } else {
        PyObject *s = PyUnicode_FromString(m->dtype);
        int ok = s != NULL && PyArray_DescrConverter(s, &d);
        Py_XDECREF(s);
        if (!ok)
            return NULL;
    }
    return PyArray_Empty((int)m->ndim, shape, d, 0);   /* steals d */
}

int dist_wait_data(dist_comm *c, MPI_Request *reqs, int *done, int n, double deadline,
                   int64_t call, int64_t kind, PyObject *keep1, PyObject *keep2,
                   PyObject *keep3)
{
    int st = dist_poll_data(reqs, n, done, deadline);
    if (st == 0)
        return 0;
    for (int i = 0; i < n; i++) {
        if (done[i] || reqs[i] == MPI_REQUEST_NULL)
            continue;
        MPI_Cancel(&reqs[i]);
        MPI_Request_free(&reqs[i]);
    }
    Py_XINCREF(keep1);   /* MPI may still read or write these: never freed */
    Py_XINCREF(keep2);
    Py_XINCREF(keep3);
    c->broken = 1;
    snprintf(c->broken_why, sizeof c->broken_why, "%s while moving the data of %s call %lld",
             st == 1 ? "a TimeoutError" : "an error", dist_kind_name(kind), (long long)call);
    char secs[32];
    snprintf(secs, sizeof secs, "%g", c->timeout);
    if (st == 1)
        PyErr_Format(PyExc_TimeoutError,
                     "dpmini.distributed.%s (call %lld on rank %d): every rank agreed on the "
                     "call but its data did not arrive within the timeout of %s s (a rank "
                     "died or is stalled); this communicator cannot be used again",
                     dist_kind_name(kind), (long long)call, c->rank, secs);
    return -1;
}

/* ------------------------------------------------------------------ */
/* Geometry and datatypes                                              */
/* ------------------------------------------------------------------ */

typedef struct {
    int64_t outer, rows, inner_bytes;   /* rows = shape[dim] of the whole */
} geometry;

/* From an agreed record; raises OverflowError (identically on every rank,
 * since every rank holds the same records) past MPI's int counts. */
static int geometry_of(const dist_meta *m, int dim, int64_t rows, geometry *g)
{
    int64_t outer = 1, inner = m->itemsize;
    for (int i = 0; i < dim; i++)
        outer *= m->shape[i];
    for (int64_t i = dim + 1; i < m->ndim; i++)
        inner *= m->shape[i];   /* a whole array's bytes fit in npy_intp */
    g->outer = outer;
    g->rows = rows;
    g->inner_bytes = inner;
    if (outer > INT_MAX || rows > INT_MAX || inner > INT_MAX) {
        PyErr_Format(PyExc_OverflowError,
                     "dpmini.distributed.%s: %lld blocks of %lld rows of %lld bytes do not fit "
                     "MPI's int counts (each must be < 2**31)", dist_kind_name(m->kind),
                     (long long)outer, (long long)rows, (long long)inner);
        return -1;
    }
    return 0;
}

/* `count` rows of each of g->outer blocks, stride `stride` rows. */
static int rows_type(const geometry *g, int64_t count, int64_t stride, MPI_Datatype *t)
{
    MPI_Datatype row;
    int rc = MPI_Type_contiguous((int)g->inner_bytes, MPI_BYTE, &row);
    if (rc == MPI_SUCCESS) {
        rc = MPI_Type_vector((int)g->outer, (int)count, (int)stride, row, t);
        MPI_Type_free(&row);
    }
    if (rc == MPI_SUCCESS)
        rc = MPI_Type_commit(t);
    return rc == MPI_SUCCESS ? 0 : dist_mpi_error(rc, "building an MPI datatype");
}

static int check_root(int root, int P)
{
    if (root >= 0 && root < P)
        return 0;
    PyErr_Format(PyExc_ValueError, "root: %d is not a rank of this communicator (0..%d)",
                 root, P - 1);
    return -1;
}

static int wrap_dim(int dim, int ndim, const char *name)
{
    int d = dp_wrap_dim(dim, ndim);
    if (d < 0) {
        if (ndim < 1)
            PyErr_Format(PyExc_ValueError, "%s: a 0-d array has no dim to split or join "
                         "along", name);
        else
            PyErr_Format(PyExc_IndexError, "dim: %d is out of range for %s with %d "
                         "dimension(s) (expected %d..%d)", dim, name, ndim, -ndim, ndim - 1);
    }
    return d;
}

/* Between the strided layout (g->outer blocks of g->rows rows) and the
 * staged one (every rank's piece contiguous, in rank order), in the
 * direction `to_staged`, GIL released. Used when outer > 1 (dim is not the
 * first non-trivial one): Open MPI packs a vector datatype with a slower
 * pipeline than one memcpy per block row, and the staged pieces then move
 * as plain contiguous messages. */
static void restage(char *strided, char *staged, const geometry *g, const int64_t *rows,
                    int P, int to_staged)
{
    Py_BEGIN_ALLOW_THREADS
    size_t ib = (size_t)g->inner_bytes;
    char *s = staged;
    int64_t off = 0;
    for (int r = 0; r < P; r++) {
        size_t n = (size_t)rows[r] * ib;
        for (int64_t o = 0; o < g->outer && n > 0; o++) {
            char *t = strided + ((size_t)(o * g->rows + off)) * ib;
            if (to_staged)
                memcpy(s, t, n);
            else
                memcpy(t, s, n);
            s += n;
        }
        off += rows[r];
    }
    Py_END_ALLOW_THREADS
}

static PyObject *new_stage(const geometry *g)
{
    npy_intp nbytes = (npy_intp)(g->outer * g->rows * g->inner_bytes);
    return PyArray_SimpleNew(1, &nbytes, NPY_UINT8);
}

/* The bytes of arr to send with the record, -1: none (no array, or one
 * past DIST_MOVE_FUSE_BYTES: moving data needs no reduction on arrival, so
 * past MPI's eager size one message straight into the result is faster
 * than a copy out of the record's buffer). */
#define DIST_MOVE_FUSE_BYTES (8 << 10)
static int64_t fused_bytes(PyObject *arr)
{
    if (arr == NULL || PyArray_NBYTES((PyArrayObject *)arr) > DIST_MOVE_FUSE_BYTES)
        return -1;
    return (int64_t)PyArray_NBYTES((PyArrayObject *)arr);
}

/* `rows` rows of each of g->outer blocks from a contiguous piece into
 * blocks of `stride` rows at dst (stride == rows: contiguous too). */
static void copy_rows(char *dst, const char *piece, const geometry *g, int64_t rows,
                      int64_t stride)
{
    size_t n = (size_t)(rows * g->inner_bytes);
    if (stride == rows) {
        memcpy(dst, piece, n * (size_t)g->outer);
        return;
    }
    for (int64_t o = 0; o < g->outer; o++)
        memcpy(dst + (size_t)(o * stride * g->inner_bytes), piece + (size_t)o * n, n);
}

/* gather's result from the fused pieces (rank r's at dist_fused_payload,
 * this rank's own in arr), ranks in order along dim d. */
static PyObject *join_fused(dist_comm *c, const dist_meta *mine, PyObject *arr, int d,
                            int64_t total, const geometry *g)
{
    PyObject *out = dist_empty_like_meta(mine, d, total, (PyArrayObject *)arr);
    if (out == NULL)
        return NULL;
    char *base = PyArray_DATA((PyArrayObject *)out);
    int64_t off = 0;
    for (int r = 0; r < c->size; r++) {
        int64_t rows = c->peers[r].shape[d];
        const char *piece = r == c->rank ? PyArray_DATA((PyArrayObject *)arr)
                                         : dist_fused_payload(c, r);
        if (rows > 0)
            copy_rows(base + (size_t)(off * g->inner_bytes), piece, g, rows, total);
        off += rows;
    }
    return out;
}

/* ------------------------------------------------------------------ */
/* scatter                                                             */
/* ------------------------------------------------------------------ */

PyObject *dist_scatter(dist_comm *c, PyObject *args, PyObject *kw)
{
    static char *kwlist[] = {"x", "root", "dim", "chunk_sizes", "weights", "gpu",
                             DIST_GUARD_KWLIST, NULL};
    PyObject *x = Py_None, *cs = Py_None, *w = Py_None, *gpu = Py_None;
    PyObject *rootobj = NULL, *dimobj = NULL, *argerr = NULL;
    dist_guard_kw gk = {NULL, NULL, NULL};
    int root = 0, dim = 0, P = c->size, me = c->rank;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "O|OOOOO$OOO:scatter", kwlist, &x, &rootobj,
                                     &dimobj, &cs, &w, &gpu, &gk.tag, &gk.error, &gk.context))
        return NULL;
    dist_int_arg(rootobj, "root", &root, &argerr);
    dist_int_arg(dimobj, "dim", &dim, &argerr);
    if (dist_enter(c) < 0) {
        Py_XDECREF(argerr);
        return NULL;
    }
    double deadline = dist_now() + c->timeout;
    PyObject *arr = NULL, *out = NULL, *saved = NULL, *stage = NULL;
    MPI_Datatype *types = NULL;
    MPI_Request *reqs = NULL;
    int *done = NULL, ntypes = 0;
    int64_t *sizes = PyMem_Calloc((size_t)P * 2 + 1, sizeof(int64_t));
    double *wts = PyMem_Calloc((size_t)P + 1, sizeof(double));
    split_args s = {0, NULL, wts};
    dist_gpu_arg ga;
    memset(&ga, 0, sizeof ga);
    dist_meta mine;
    memset(&mine, 0, sizeof mine);
    mine.kind = DIST_SCATTER;
    mine.root = root;
    mine.dim = dim;
    mine.ndim = -1;
    dist_guard_kw_read(&gk, &mine, &argerr);
    if (sizes == NULL || wts == NULL) {
        PyErr_NoMemory();
        goto fail_local;
    }
    s.sizes = sizes + P;
    int ok = !dist_arg_error(&argerr) && check_root(root, P) == 0 &&
             dist_read_split(cs, w, P, &s, &mine) == 0;
    if (ok && me == root && gpu != Py_None) {   /* NCCL (dist_gpu_move.c) */
        int d = dist_gpu_read(c, x, gpu, 0, &mine, &ga) == 0 ? wrap_dim(dim, (int)mine.ndim, "x")
                                                              : -1;
        if (d >= 0)
            dist_plan_rows(&s, mine.shape[d], P, sizes);
    } else if (ok && me == root && x == Py_None) {
        PyErr_Format(PyExc_TypeError, "x: rank %d is scatter's root (root=%d) and passed None; "
                     "root passes the array to split, only the other ranks pass None", me, root);
    } else if (ok && me == root && (arr = dist_as_array(x, "x", 0, dim)) != NULL) {
        int d = wrap_dim(dim, PyArray_NDIM((PyArrayObject *)arr), "x");
        if (d >= 0 && dist_plan_rows(&s, PyArray_DIM((PyArrayObject *)arr, d), P, sizes) == 0)
            dist_meta_array(&mine, arr);
    } else if (ok && me != root && gpu != Py_None && dist_gpu_read(c, x, gpu, 0, &mine, &ga) < 0) {
        PyErr_Clear();   /* off root, x only names this rank's device: a bad one is ignored */
        memset(&ga, 0, sizeof ga);
    }
    if (PyErr_Occurred())
        dist_meta_fail(&mine, &saved);
    if (dist_agree(c, &mine, &saved, deadline) < 0)
        goto fail;

    const dist_meta *rm = &c->peers[root];
    int d = dp_wrap_dim(dim, (int)rm->ndim);
    geometry g;
    if (dist_plan_rows(&s, rm->shape[d], P, sizes) < 0 || geometry_of(rm, d, rm->shape[d], &g) < 0)
        goto fail;
    if (rm->dev_kind == DIST_DEV_GPU) {
        out = dist_gpu_scatter(c, rm, &ga, sizes, d, root, deadline);
        goto done;
    }
    out = dist_empty_like_meta(rm, d, sizes[me], (PyArrayObject *)arr);
    types = PyMem_Calloc((size_t)P + 1, sizeof(MPI_Datatype));
    reqs = PyMem_Calloc((size_t)P + 1, sizeof(MPI_Request));
    done = PyMem_Calloc((size_t)P + 1, sizeof(int));
    if (out == NULL || types == NULL || reqs == NULL || done == NULL) {
        if (!PyErr_Occurred())
            PyErr_NoMemory();
        goto fail;
    }
    int n = 0, rc = MPI_SUCCESS;
    if (me != root) {
        if (rows_type(&g, sizes[me], sizes[me], &types[ntypes]) < 0)
            goto fail;
        rc = MPI_Irecv(PyArray_DATA((PyArrayObject *)out), 1, types[ntypes++], root,
                       DIST_TAG_DATA, c->comm, &reqs[n++]);
    }
    int64_t off = 0;
    const char *own = NULL;   /* root's own piece, copied once the sends are posted */
    if (me == root && g.outer > 1) {
        if ((stage = new_stage(&g)) == NULL)
            goto fail;
        restage(PyArray_DATA((PyArrayObject *)arr), PyArray_DATA((PyArrayObject *)stage), &g,
                sizes, P, 1);
    }
    for (int r = 0; me == root && r < P && rc == MPI_SUCCESS; r++) {
        char *base;
        if (stage != NULL) {
            base = (char *)PyArray_DATA((PyArrayObject *)stage) + g.outer * off * g.inner_bytes;
            if (rows_type(&g, sizes[r], sizes[r], &types[ntypes]) < 0)
                goto fail;
        } else {
            base = (char *)PyArray_DATA((PyArrayObject *)arr) + off * g.inner_bytes;
            if (rows_type(&g, sizes[r], g.rows, &types[ntypes]) < 0)
                goto fail;
        }
        if (r == me)
            own = base;
        else
            rc = MPI_Isend(base, 1, types[ntypes], r, DIST_TAG_DATA, c->comm, &reqs[n++]);
        ntypes++;
        off += sizes[r];
    }
    if (own != NULL && rc == MPI_SUCCESS)   /* contiguous: staged, or outer == 1 */
        memcpy(PyArray_DATA((PyArrayObject *)out), own,
               (size_t)(g.outer * sizes[me] * g.inner_bytes));
    if (rc != MPI_SUCCESS) {
        dist_mpi_error(rc, "posting the scatter messages");
        c->broken = 1;
        snprintf(c->broken_why, sizeof c->broken_why, "an MPI error in scatter");
        goto fail;
    }
    if (dist_wait_data(c, reqs, done, n, deadline, mine.call, DIST_SCATTER, arr, out, stage) < 0)
        goto fail;
    goto done;
fail_local:
    dist_meta_fail(&mine, &saved);
    dist_agree(c, &mine, &saved, deadline);
fail:
    Py_CLEAR(out);
done:
    for (int i = 0; i < ntypes; i++)
        MPI_Type_free(&types[i]);
    PyMem_Free(types);
    PyMem_Free(reqs);
    PyMem_Free(done);
    PyMem_Free(sizes);
    PyMem_Free(wts);
    Py_XDECREF(stage);
    Py_XDECREF(arr);
    Py_XDECREF(argerr);   /* set only when the call failed before reading it */
    dist_leave(c);
    return out;
}

/* ------------------------------------------------------------------ */
/* gather / all_gather                                                 */
/* ------------------------------------------------------------------ */

/* argerr: a bad root or dim (dist_args.c), raised at the guard; stolen. */
static PyObject *gather_common(dist_comm *c, PyObject *x, int root, int dim, int64_t kind,
                               PyObject *gpu, const dist_guard_kw *gk, PyObject *argerr)
{
    int P = c->size, me = c->rank, all = kind == DIST_ALL_GATHER;
    if (dist_enter(c) < 0) {
        Py_XDECREF(argerr);
        return NULL;
    }
    double deadline = dist_now() + c->timeout;
    PyObject *arr = NULL, *out = NULL, *saved = NULL, *stage = NULL;
    MPI_Datatype *types = NULL;
    MPI_Request *reqs = NULL;
    int64_t *rows_of = NULL;
    int *done = NULL, ntypes = 0, n = 0, rc = MPI_SUCCESS;
    dist_gpu_arg ga;
    memset(&ga, 0, sizeof ga);
    dist_meta mine;
    memset(&mine, 0, sizeof mine);
    mine.kind = kind;
    mine.root = all ? -1 : root;
    mine.dim = dim;
    mine.ndim = -1;
    dist_guard_kw_read(gk, &mine, &argerr);
    if (dist_arg_error(&argerr) || (!all && check_root(root, P) < 0)) {
        /* the error goes to the guard below */
    } else if (PyTuple_Check(gpu)) {   /* NCCL (dist_gpu_move.c) */
        if (dist_gpu_read(c, x, gpu, 0, &mine, &ga) == 0)
            mine.dim = wrap_dim(dim, (int)mine.ndim, "x");
    } else if ((arr = dist_as_array(x, "x", 0, dim)) != NULL) {
        int d = wrap_dim(dim, PyArray_NDIM((PyArrayObject *)arr), "x");
        mine.dim = d;
        if (d >= 0)
            dist_meta_array(&mine, arr);
        /* a GPU array the wrapper staged through the host (gpu: its
         * device): its device kind still goes to the guard */
        if (gpu != Py_None && (mine.dev_id = PyLong_AsLong(gpu)) != -1)
            mine.dev_kind = DIST_DEV_GPU_STAGED;
    }
    if (PyErr_Occurred())
        dist_meta_fail(&mine, &saved);
    /* A small piece travels with the record (dist_agree_fused). */
    if (dist_agree_fused(c, &mine, &saved, deadline,
                         arr != NULL ? PyArray_DATA((PyArrayObject *)arr) : NULL,
                         fused_bytes(arr), all ? -1 : root) < 0)
        goto fail;

    int d = (int)mine.dim;
    if (mine.dev_kind == DIST_DEV_GPU) {
        out = dist_gpu_gather(c, &mine, &ga, d, all ? -1 : root, deadline);
        goto done;
    }
    int64_t total = 0;
    int fused = 1;
    for (int r = 0; r < P; r++) {
        total += c->peers[r].shape[d];
        fused &= c->peers[r].fused_len >= 0;
    }
    geometry g;
    if (geometry_of(&mine, d, total, &g) < 0)
        goto fail;
    int receives = all || me == root;
    if (fused) {   /* every piece came with its record */
        if (receives && (out = join_fused(c, &mine, arr, d, total, &g)) == NULL)
            goto fail;
        if (out == NULL)
            out = Py_NewRef(Py_None);
        goto done;
    }
    types = PyMem_Calloc((size_t)P + 1, sizeof(MPI_Datatype));
    reqs = PyMem_Calloc((size_t)P * 2, sizeof(MPI_Request));
    done = PyMem_Calloc((size_t)P * 2, sizeof(int));
    rows_of = PyMem_Calloc((size_t)P, sizeof(int64_t));
    if (types == NULL || reqs == NULL || done == NULL || rows_of == NULL) {
        PyErr_NoMemory();
        goto fail;
    }
    for (int r = 0; r < P; r++)
        rows_of[r] = c->peers[r].shape[d];
    if (receives) {
        out = dist_empty_like_meta(&mine, d, total, (PyArrayObject *)arr);
        if (out == NULL || (g.outer > 1 && (stage = new_stage(&g)) == NULL))
            goto fail;
        int64_t off = 0;
        for (int r = 0; r < P && rc == MPI_SUCCESS; r++) {
            char *base;
            if (stage != NULL) {
                base = (char *)PyArray_DATA((PyArrayObject *)stage) + g.outer * off * g.inner_bytes;
                if (rows_type(&g, rows_of[r], rows_of[r], &types[ntypes]) < 0)
                    goto fail;
            } else {
                base = (char *)PyArray_DATA((PyArrayObject *)out) + off * g.inner_bytes;
                if (rows_type(&g, rows_of[r], total, &types[ntypes]) < 0)
                    goto fail;
            }
            if (r == me)   /* this rank's own piece: copied, not messaged */
                copy_rows(base, PyArray_DATA((PyArrayObject *)arr), &g, rows_of[r],
                          stage != NULL ? rows_of[r] : total);
            else
                rc = MPI_Irecv(base, 1, types[ntypes], r, DIST_TAG_DATA, c->comm, &reqs[n++]);
            ntypes++;
            off += rows_of[r];
        }
    }
    if (rc == MPI_SUCCESS) {
        if (rows_type(&g, mine.shape[d], mine.shape[d], &types[ntypes]) < 0)
            goto fail;
        ntypes++;
    }
    MPI_Datatype piece = types[ntypes - 1];
    for (int r = 0; r < P && rc == MPI_SUCCESS; r++) {
        if ((!all && r != root) || r == me)
            continue;
        rc = MPI_Isend(PyArray_DATA((PyArrayObject *)arr), 1, piece, r, DIST_TAG_DATA,
                       c->comm, &reqs[n++]);
    }
    if (rc != MPI_SUCCESS) {
        dist_mpi_error(rc, "posting the gather messages");
        c->broken = 1;
        snprintf(c->broken_why, sizeof c->broken_why, "an MPI error in gather");
        goto fail;
    }
    if (dist_wait_data(c, reqs, done, n, deadline, mine.call, kind, arr, out, stage) < 0)
        goto fail;
    if (stage != NULL)
        restage(PyArray_DATA((PyArrayObject *)out), PyArray_DATA((PyArrayObject *)stage), &g,
                rows_of, P, 0);
    if (out == NULL)
        out = Py_NewRef(Py_None);
    goto done;
fail:
    Py_CLEAR(out);
done:
    for (int i = 0; i < ntypes; i++)
        MPI_Type_free(&types[i]);
    PyMem_Free(types);
    PyMem_Free(reqs);
    PyMem_Free(done);
    PyMem_Free(rows_of);
    Py_XDECREF(stage);
    Py_XDECREF(arr);
    Py_XDECREF(argerr);   /* already raised (NULL) unless the call failed before */
    dist_leave(c);
    return out;
}

PyObject *dist_gather(dist_comm *c, PyObject *args, PyObject *kw)
{
    static char *kwlist[] = {"x", "root", "dim", "gpu", DIST_GUARD_KWLIST, NULL};
    PyObject *x, *gpu = Py_None, *rootobj = NULL, *dimobj = NULL, *argerr = NULL;
    dist_guard_kw gk = {NULL, NULL, NULL};
    int root = 0, dim = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "O|OOO$OOO:gather", kwlist, &x, &rootobj, &dimobj,
                                     &gpu, &gk.tag, &gk.error, &gk.context))
        return NULL;
    dist_int_arg(rootobj, "root", &root, &argerr);
    dist_int_arg(dimobj, "dim", &dim, &argerr);
    return gather_common(c, x, root, dim, DIST_GATHER, gpu, &gk, argerr);
}

PyObject *dist_all_gather(dist_comm *c, PyObject *args, PyObject *kw)
{
    static char *kwlist[] = {"x", "dim", "gpu", DIST_GUARD_KWLIST, NULL};
    PyObject *x, *gpu = Py_None, *dimobj = NULL, *argerr = NULL;
    dist_guard_kw gk = {NULL, NULL, NULL};
    int dim = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "O|OO$OOO:all_gather", kwlist, &x, &dimobj, &gpu,
                                     &gk.tag, &gk.error, &gk.context))
        return NULL;
    dist_int_arg(dimobj, "dim", &dim, &argerr);
    return gather_common(c, x, 0, dim, DIST_ALL_GATHER, gpu, &gk, argerr);
}

/* ------------------------------------------------------------------ */
/* broadcast                                                           */
/* ------------------------------------------------------------------ */

/* broadcast(x, root=0, pickled=False, error=None, gpu=None, *, tag, context)
 * -> (array, root's pickled flag). x matters on root only: an ndarray, or
 * (pickled=True) a uint8 array of pickle bytes that the Python wrapper made;
 * error: an exception the wrapper met (pickling) to raise on every rank. */
PyObject *dist_broadcast(dist_comm *c, PyObject *args, PyObject *kw)
{
    static char *kwlist[] = {"x", "root", "pickled", "error", "gpu", "tag", "context", NULL};
    PyObject *x = Py_None, *gpu = Py_None, *rootobj = NULL, *argerr = NULL;
    dist_guard_kw gk = {NULL, NULL, NULL};
    int root = 0, pickled = 0, P = c->size, me = c->rank;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "O|OpOO$OO:broadcast", kwlist, &x, &rootobj,
                                     &pickled, &gk.error, &gpu, &gk.tag, &gk.context))
        return NULL;
    dist_int_arg(rootobj, "root", &root, &argerr);
    if (dist_enter(c) < 0) {
        Py_XDECREF(argerr);
        return NULL;
    }
    double deadline = dist_now() + c->timeout;
    PyObject *arr = NULL, *out = NULL, *saved = NULL, *res = NULL;
    MPI_Datatype unit = MPI_DATATYPE_NULL;
    MPI_Request req = MPI_REQUEST_NULL;
    int done = 0;
    dist_gpu_arg g;
    memset(&g, 0, sizeof g);
    dist_meta mine;
    memset(&mine, 0, sizeof mine);
    mine.kind = DIST_BROADCAST;
    mine.root = root;
    mine.ndim = -1;
    mine.is_object = pickled;
    dist_guard_kw_read(&gk, &mine, &argerr);   /* the wrapper's error (pickling) first */
    if (dist_arg_error(&argerr) || check_root(root, P) < 0) {
        /* the error goes to the guard below */
    }
    else if (me == root && gpu != Py_None)
        dist_gpu_read(c, x, gpu, 1, &mine, &g);            /* NCCL (dist_gpu.c) */
    else if (me == root && (arr = dist_as_array(x, "x", 0, DIST_WHOLE)) != NULL)
        dist_meta_array(&mine, arr);
    else if (me != root && gpu != Py_None && dist_gpu_read(c, x, gpu, 0, &mine, &g) < 0) {
        PyErr_Clear();   /* off root, x only names this rank's device: a bad one is ignored */
        memset(&g, 0, sizeof g);
    }
    if (PyErr_Occurred())
        dist_meta_fail(&mine, &saved);
    /* A small array travels with root's record (dist_agree_fused). */
    if (dist_agree_fused(c, &mine, &saved, deadline,
                         arr != NULL ? PyArray_DATA((PyArrayObject *)arr) : NULL,
                         fused_bytes(arr), -1) < 0)
        goto fail;
    const dist_meta *rm = &c->peers[root];
    if (rm->dev_kind == DIST_DEV_GPU) {
        out = dist_gpu_broadcast(c, rm, &g, root, deadline);
        if (out != NULL)
            res = Py_BuildValue("(OO)", out, Py_False);
        goto fail;
    }
    out = me == root ? PyArray_NewLikeArray((PyArrayObject *)arr, NPY_CORDER, NULL, 0)
                     : dist_empty_like_meta(rm, -1, 0, NULL);
    if (out == NULL)
        goto fail;
    char *dst = PyArray_DATA((PyArrayObject *)out);
    size_t nbytes = (size_t)PyArray_NBYTES((PyArrayObject *)out);
    if (rm->fused_len >= 0) {   /* root's bytes came with its record */
        memcpy(dst, me == root ? PyArray_DATA((PyArrayObject *)arr)
                               : dist_fused_payload(c, root), nbytes);
        res = Py_BuildValue("(OO)", out, rm->is_object ? Py_True : Py_False);
        goto fail;
    }
    npy_intp count = PyArray_SIZE((PyArrayObject *)out);
    if (count > INT_MAX || rm->itemsize > INT_MAX) {
        PyErr_Format(PyExc_OverflowError, "dpmini.distributed.broadcast: %lld elements do "
                     "not fit MPI's int count (< 2**31)", (long long)count);
        goto fail;
    }
    if (count > 0 && rm->itemsize > 0) {
        /* Root sends from x itself and copies x into its result while the
         * others receive (both only read x). Plain bytes when they fit one
         * int count: Open MPI moves MPI_BYTE faster than a derived type. */
        int rc = MPI_SUCCESS;
        if (nbytes <= INT_MAX) {
            unit = MPI_BYTE;
            count = (npy_intp)nbytes;
        } else if ((rc = MPI_Type_contiguous((int)rm->itemsize, MPI_BYTE, &unit)) == MPI_SUCCESS) {
            rc = MPI_Type_commit(&unit);
        }
        if (rc == MPI_SUCCESS)
            rc = MPI_Ibcast(me == root ? PyArray_DATA((PyArrayObject *)arr) : dst, (int)count,
                            unit, root, c->comm, &req);
        if (unit == MPI_BYTE)
            unit = MPI_DATATYPE_NULL;   /* not ours to free */
        if (rc != MPI_SUCCESS) {
            dist_mpi_error(rc, "MPI_Ibcast");
            goto fail;
        }
        if (me == root) {
            const char *src = PyArray_DATA((PyArrayObject *)arr);
            Py_BEGIN_ALLOW_THREADS
            memcpy(dst, src, nbytes);
            Py_END_ALLOW_THREADS
        }
        if (dist_wait_data(c, &req, &done, 1, deadline, mine.call, DIST_BROADCAST, out, arr, NULL) < 0)
            goto fail;
    } else if (me == root) {
        memcpy(dst, PyArray_DATA((PyArrayObject *)arr), nbytes);
    }
    res = Py_BuildValue("(OO)", out, rm->is_object ? Py_True : Py_False);
fail:
    if (unit != MPI_DATATYPE_NULL)
        MPI_Type_free(&unit);
    dist_gpu_arg_clear(&g);
    Py_XDECREF(out);
    Py_XDECREF(arr);
    Py_XDECREF(argerr);   /* already raised (NULL) unless the call failed before */
    dist_leave(c);
    return res;
}
