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
    } else if ((d = dist_descr_of(m->dtype)) == NULL) {
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

/* How a piece travels: inside the record's message up to
 * DIST_MOVE_FUSE_BYTES (one eager message, copied in and out), as a
 * message right behind the record up to DIST_FOLLOW_BYTES (straight from
 * and into the arrays, sent before the verdict), else as a message after
 * the verdict. Past MPI's eager size the copy out of the record's buffer
 * costs more than the message it saves. */
#define DIST_MOVE_FUSE_BYTES (8 << 10)
enum path { PATH_AFTER = 0, PATH_FUSED, PATH_FOLLOW };

static enum path path_for(int64_t nbytes)
{
    return nbytes <= DIST_MOVE_FUSE_BYTES ? PATH_FUSED
         : nbytes <= DIST_FOLLOW_BYTES ? PATH_FOLLOW : PATH_AFTER;
}

/* ------------------------------------------------------------------ */
/* One call: its state and its messages                                */
/* ------------------------------------------------------------------ */

/* One call of scatter, gather, all_gather or broadcast: this rank's record
 * and arrays, and the requests and datatypes of its data messages. */
typedef struct {
    dist_comm *c;
    dist_meta mine;
    double deadline;
    PyObject *arr;        /* this rank's array (root's for scatter and broadcast) */
    PyObject *out;        /* the result                                   */
    PyObject *stage;      /* every rank's piece contiguous, in rank order  */
    PyObject *saved;      /* this rank's own argument error               */
    PyObject *argerr;     /* a bad root or dim, raised at the guard        */
    dist_gpu_arg ga;
    dist_piece *pieces;   /* scatter's follow sends, one per rank          */
    dist_piece one;       /* the follow send of gather and broadcast       */
    MPI_Request *reqs;
    int *done, n;
    MPI_Datatype *types;
    int ntypes;
    int agreed_open;      /* agreed; follow messages not yet taken         */
    int waited;           /* the requests were waited for                  */
#define MOVE_INLINE 18
    MPI_Request inline_reqs[MOVE_INLINE];
    int inline_done[MOVE_INLINE];
    MPI_Datatype inline_types[MOVE_INLINE];
    dist_piece inline_pieces[MOVE_INLINE];
} move_call;

static int move_begin(move_call *m, dist_comm *c, int64_t kind, int root, int dim,
                      PyObject *argerr)
{
    memset(m, 0, sizeof *m);
    m->c = c;
    if (dist_enter(c) < 0) {
        Py_XDECREF(argerr);
        return -1;
    }
    m->argerr = argerr;
    m->deadline = dist_now() + c->timeout;
    m->mine.kind = kind;
    m->mine.root = root;
    m->mine.dim = dim;
    m->mine.ndim = -1;
    return 0;
}

/* Room for this call's requests and datatypes (2 per rank, plus one):
 * inside the call's state for a few ranks (a small collective's mallocs
 * cost as much as its messages). */
static int move_alloc(move_call *m)
{
    size_t n = 2 * (size_t)m->c->size + 2;
    if (n <= MOVE_INLINE) {
        m->reqs = m->inline_reqs;
        m->done = m->inline_done;
        m->types = m->inline_types;
        m->pieces = m->inline_pieces;
        return 0;
    }
    m->reqs = PyMem_Calloc(n, sizeof(MPI_Request));
    m->done = PyMem_Calloc(n, sizeof(int));
    m->types = PyMem_Calloc(n, sizeof(MPI_Datatype));
    m->pieces = PyMem_Calloc(n, sizeof(dist_piece));
    if (m->reqs == NULL || m->done == NULL || m->types == NULL || m->pieces == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    return 0;
}

/* A call that failed after posting messages: they complete (the other
 * ranks agreed and take part) before their buffers go, keeping the pending
 * exception; a timeout leaks the buffers and breaks the communicator. */
static void move_finish_posted(move_call *m)
{
    PyObject *type, *value, *tb;
    PyErr_Fetch(&type, &value, &tb);
    dist_wait_data(m->c, m->reqs, m->done, m->n, m->deadline, m->mine.call, m->mine.kind,
                   m->arr, m->out, m->stage);
    PyErr_Clear();
    PyErr_Restore(type, value, tb);
}

/* The end of every call: frees the call's state, returns `result` (which
 * takes over m->out's reference when it is m->out). */
static PyObject *move_end(move_call *m, PyObject *result)
{
    if (result == NULL && m->agreed_open)   /* failed after agreeing: take what was sent */
        dist_follow_drain(m->c, m->deadline);
    if (result == NULL && m->n > 0 && !m->waited)   /* and let posted messages finish */
        move_finish_posted(m);
    for (int i = 0; i < m->ntypes; i++)
        MPI_Type_free(&m->types[i]);
    if (m->reqs != m->inline_reqs) {
        PyMem_Free(m->types);
        PyMem_Free(m->reqs);
        PyMem_Free(m->done);
        PyMem_Free(m->pieces);
    }
    dist_gpu_arg_clear(&m->ga);
    Py_XDECREF(m->stage);
    Py_XDECREF(m->arr);
    Py_XDECREF(m->argerr);   /* already raised (NULL) unless the call failed before */
    Py_XDECREF(m->saved);
    if (result != m->out)
        Py_XDECREF(m->out);
    dist_leave(m->c);
    return result;
}

/* Phase 1 with this rank's sends (pieces or fused bytes); afterwards this
 * rank's follow sends are the call's first requests. */
static int move_agree(move_call *m, dist_send *s)
{
    if (PyErr_Occurred())
        dist_meta_fail(&m->mine, &m->saved);
    s->keep = m->stage != NULL ? m->stage : m->arr;
    if (dist_agree_send(m->c, &m->mine, &m->saved, m->deadline, s) < 0)
        return -1;
    m->agreed_open = 1;
    if (m->reqs == NULL && move_alloc(m) < 0)
        return -1;
    m->n = dist_follow_take(m->c, m->reqs, m->done);
    return 0;
}

/* A piece of `rows` rows of every block, contiguous at buf, to or from
 * rank `peer` on `tag`: plain bytes when they fit one int count (Open MPI
 * moves MPI_BYTE faster than a derived type), else rows of bytes. */
static int move_piece(move_call *m, char *buf, const geometry *g, int64_t rows, int peer,
                      int tag, int send)
{
    int64_t bytes = g->outer * rows * g->inner_bytes;
    int count = 1, rc;
    MPI_Datatype t = MPI_BYTE;
    if (bytes <= INT_MAX) {
        count = (int)bytes;
    } else {
        if (rows_type(g, rows, rows, &m->types[m->ntypes]) < 0)
            return -1;
        t = m->types[m->ntypes++];
    }
    rc = send ? MPI_Isend(buf, count, t, peer, tag, m->c->comm, &m->reqs[m->n])
              : MPI_Irecv(buf, count, t, peer, tag, m->c->comm, &m->reqs[m->n]);
    m->done[m->n++] = 0;
    if (rc == MPI_SUCCESS)
        return 0;
    m->c->broken = 1;
    snprintf(m->c->broken_why, sizeof m->c->broken_why, "an MPI error in %s",
             dist_kind_name(m->mine.kind));
    return dist_mpi_error(rc, "posting the data messages");
}

/* Every receive of this rank is posted: nothing more to take on failure. */
static void move_posted(move_call *m)
{
    m->agreed_open = 0;
}

static int move_wait(move_call *m)
{
    m->waited = 1;
    return dist_wait_data(m->c, m->reqs, m->done, m->n, m->deadline, m->mine.call,
                          m->mine.kind, m->arr, m->out, m->stage);
}

/* ------------------------------------------------------------------ */
/* scatter                                                             */
/* ------------------------------------------------------------------ */

typedef struct {
    PyObject *x, *cs, *w, *gpu;
    int root, dim;
    int64_t *sizes;      /* the rows of every rank (P)                     */
    split_args split;
    dist_guard_kw gk;
} scatter_args;

/* Root: its array and its rows per rank into the record; the other ranks
 * only their split arguments (and, for a GPU result, their device). */
static void scatter_read(move_call *m, scatter_args *a)
{
    dist_comm *c = m->c;
    int me = c->rank, root = a->root;
    if (dist_arg_error(&m->argerr) || check_root(root, c->size) < 0 ||
        dist_read_split(a->cs, a->w, c->size, &a->split, &m->mine) < 0)
        return;
    if (me == root && a->gpu != Py_None) {   /* NCCL (dist_gpu_move.c) */
        int d = dist_gpu_read(c, a->x, a->gpu, 0, &m->mine, &m->ga) == 0
                ? wrap_dim(a->dim, (int)m->mine.ndim, "x") : -1;
        if (d >= 0)
            dist_plan_rows(&a->split, m->mine.shape[d], c->size, a->sizes);
    } else if (me == root && a->x == Py_None) {
        PyErr_Format(PyExc_TypeError, "x: rank %d is scatter's root (root=%d) and passed None; "
                     "root passes the array to split, only the other ranks pass None", me, root);
    } else if (me == root && (m->arr = dist_as_array(a->x, "x", 0, a->dim)) != NULL) {
        int d = wrap_dim(a->dim, PyArray_NDIM((PyArrayObject *)m->arr), "x");
        if (d >= 0 && dist_plan_rows(&a->split, PyArray_DIM((PyArrayObject *)m->arr, d),
                                     c->size, a->sizes) == 0)
            dist_meta_array(&m->mine, m->arr);
    } else if (me != root && a->gpu != Py_None &&
               dist_gpu_read(c, a->x, a->gpu, 0, &m->mine, &m->ga) < 0) {
        PyErr_Clear();   /* off root, x only names this rank's device: a bad one is ignored */
        memset(&m->ga, 0, sizeof m->ga);
    }
}

/* Root's pieces, contiguous: straight from x along the first dimension,
 * else from a staged copy (one memcpy per block row). base: piece 0. */
static char *scatter_pieces(move_call *m, const geometry *g, const int64_t *sizes)
{
    if (g->outer == 1)
        return PyArray_DATA((PyArrayObject *)m->arr);
    if ((m->stage = new_stage(g)) == NULL)
        return NULL;
    restage(PyArray_DATA((PyArrayObject *)m->arr), PyArray_DATA((PyArrayObject *)m->stage), g,
            sizes, m->c->size, 1);
    return PyArray_DATA((PyArrayObject *)m->stage);
}

/* Root, before the agreement: every other rank's piece follows root's
 * record when the largest fits DIST_FOLLOW_BYTES. */
static int scatter_plan_sends(move_call *m, const int64_t *sizes, dist_send *s)
{
    int P = m->c->size, d = (int)m->mine.dim;
    if (m->arr == NULL || m->mine.err[0] || PyErr_Occurred())
        return 0;
    d = dp_wrap_dim(d, (int)m->mine.ndim);
    geometry g;
    if (geometry_of(&m->mine, d, m->mine.shape[d], &g) < 0)
        return -1;
    int64_t largest = 0;
    for (int r = 0; r < P; r++)
        largest = sizes[r] > largest ? sizes[r] : largest;
    if (largest * g.outer * g.inner_bytes > DIST_FOLLOW_BYTES || move_alloc(m) < 0)
        return PyErr_Occurred() ? -1 : 0;
    char *base = scatter_pieces(m, &g, sizes);
    if (base == NULL)
        return -1;
    for (int r = 0; r < P; r++) {
        m->pieces[r].buf = base;
        m->pieces[r].count = (int)(sizes[r] * g.outer * g.inner_bytes);
        m->pieces[r].type = MPI_BYTE;
        base += sizes[r] * g.outer * g.inner_bytes;
    }
    s->follow_to = -1;
    s->piece = m->pieces;
    s->each = 1;
    return 0;
}

/* Root after the agreement: its own piece copied, the pieces that did not
 * follow the record sent (contiguous, from x or the stage). */
static int scatter_root_sends(move_call *m, const geometry *g, const int64_t *sizes)
{
    const dist_meta *rm = &m->c->peers[m->c->rank];
    char *base = m->stage != NULL ? PyArray_DATA((PyArrayObject *)m->stage)
               : rm->follow_to == -2 ? scatter_pieces(m, g, sizes)
               : PyArray_DATA((PyArrayObject *)m->arr);
    if (base == NULL)
        return -1;
    for (int r = 0; r < m->c->size; r++) {
        if (r == m->c->rank)
            memcpy(PyArray_DATA((PyArrayObject *)m->out), base,
                   (size_t)(g->outer * sizes[r] * g->inner_bytes));
        else if (rm->follow_to == -2 && move_piece(m, base, g, sizes[r], r, DIST_TAG_DATA, 1) < 0)
            return -1;
        base += g->outer * sizes[r] * g->inner_bytes;
    }
    return 0;
}

static PyObject *scatter_host(move_call *m, const geometry *g, const int64_t *sizes, int root)
{
    dist_comm *c = m->c;
    int me = c->rank;
    const dist_meta *rm = &c->peers[root];
    m->out = dist_empty_like_meta(rm, dp_wrap_dim((int)m->mine.dim, (int)rm->ndim), sizes[me],
                                  (PyArrayObject *)m->arr);
    if (m->out == NULL)
        return NULL;
    char *dst = PyArray_DATA((PyArrayObject *)m->out);
    if (me == root) {
        if (scatter_root_sends(m, g, sizes) < 0)
            return NULL;
    } else if (move_piece(m, dst, g, sizes[me], root, dist_follows_to(rm, root, me)
                          ? DIST_TAG_FOLLOW : DIST_TAG_DATA, 0) < 0) {
        return NULL;
    }
    move_posted(m);
    return move_wait(m) < 0 ? NULL : m->out;
}

PyObject *dist_scatter(dist_comm *c, PyObject *args, PyObject *kw)
{
    static char *kwlist[] = {"x", "root", "dim", "chunk_sizes", "weights", "gpu",
                             DIST_GUARD_KWLIST, NULL};
    scatter_args a = {Py_None, Py_None, Py_None, Py_None, 0, 0, NULL, {0, NULL, NULL},
                      {NULL, NULL, NULL}};
    PyObject *rootobj = NULL, *dimobj = NULL, *argerr = NULL;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "O|OOOOO$OOO:scatter", kwlist, &a.x, &rootobj,
                                     &dimobj, &a.cs, &a.w, &a.gpu, &a.gk.tag, &a.gk.error,
                                     &a.gk.context))
        return NULL;
    dist_int_arg(rootobj, "root", &a.root, &argerr);
    dist_int_arg(dimobj, "dim", &a.dim, &argerr);
    move_call m;
    if (move_begin(&m, c, DIST_SCATTER, a.root, a.dim, argerr) < 0)
        return NULL;
    int P = c->size;
    int64_t *buf = PyMem_Calloc((size_t)P * 2 + 1, sizeof(int64_t));
    double *wts = PyMem_Calloc((size_t)P + 1, sizeof(double));
    PyObject *out = NULL;
    dist_send s = DIST_SEND_NONE;
    a.sizes = buf;
    a.split.sizes = buf != NULL ? buf + P : NULL;
    a.split.weights = wts;
    dist_guard_kw_read(&a.gk, &m.mine, &m.argerr);
    if (buf == NULL || wts == NULL)
        PyErr_NoMemory();
    else
        scatter_read(&m, &a);
    if (!PyErr_Occurred())
        scatter_plan_sends(&m, a.sizes, &s);
    if (move_agree(&m, &s) < 0)
        goto done;
    const dist_meta *rm = &c->peers[a.root];
    int d = dp_wrap_dim(a.dim, (int)rm->ndim);
    geometry g;
    if (dist_plan_rows(&a.split, rm->shape[d], P, a.sizes) < 0 ||
        geometry_of(rm, d, rm->shape[d], &g) < 0)
        goto done;
    if (rm->dev_kind == DIST_DEV_GPU) {
        move_posted(&m);
        m.out = dist_gpu_scatter(c, rm, &m.ga, a.sizes, d, a.root, m.deadline);
        out = m.out;
        goto done;
    }
    out = scatter_host(&m, &g, a.sizes, a.root);
done:
    PyMem_Free(buf);
    PyMem_Free(wts);
    return move_end(&m, out);
}

/* ------------------------------------------------------------------ */
/* gather / all_gather                                                 */
/* ------------------------------------------------------------------ */

/* This rank's piece into the record (host, GPU, or a GPU array staged
 * through the host whose device kind still goes to the guard). */
static void gather_read(move_call *m, PyObject *x, int dim, PyObject *gpu, int all)
{
    if (dist_arg_error(&m->argerr) || (!all && check_root((int)m->mine.root, m->c->size) < 0))
        return;
    if (PyTuple_Check(gpu)) {   /* NCCL (dist_gpu_move.c) */
        if (dist_gpu_read(m->c, x, gpu, 0, &m->mine, &m->ga) == 0)
            m->mine.dim = wrap_dim(dim, (int)m->mine.ndim, "x");
    } else if ((m->arr = dist_as_array(x, "x", 0, dim)) != NULL) {
        int d = wrap_dim(dim, PyArray_NDIM((PyArrayObject *)m->arr), "x");
        m->mine.dim = d;
        if (d >= 0)
            dist_meta_array(&m->mine, m->arr);
        if (gpu != Py_None && (m->mine.dev_id = PyLong_AsLong(gpu)) != -1)
            m->mine.dev_kind = DIST_DEV_GPU_STAGED;
    }
}

/* This rank's piece: inside the record, right behind it, or after. */
static void gather_plan_sends(move_call *m, int to, dist_send *s)
{
    if (m->arr == NULL)
        return;
    int64_t nbytes = (int64_t)PyArray_NBYTES((PyArrayObject *)m->arr);
    enum path p = path_for(nbytes);
    if (p == PATH_FUSED) {
        s->fused = PyArray_DATA((PyArrayObject *)m->arr);
        s->fused_len = nbytes;
        s->fused_to = to;
    } else if (p == PATH_FOLLOW) {
        m->one.buf = PyArray_DATA((PyArrayObject *)m->arr);
        m->one.count = (int)nbytes;
        m->one.type = MPI_BYTE;
        s->follow_to = to;
        s->piece = &m->one;
    }
}

/* Where each rank's piece lands: the result along the first dimension,
 * else the stage (pieces contiguous, restaged into the result after). */
static char *gather_dest(move_call *m, const geometry *g)
{
    if (g->outer > 1 && (m->stage = new_stage(g)) == NULL)
        return NULL;
    return PyArray_DATA((PyArrayObject *)(m->stage != NULL ? m->stage : m->out));
}

/* The receiving rank: each piece copied (its own, a fused one) or
 * received (behind its record, or after the verdict). */
static int gather_receive(move_call *m, const geometry *g, const int64_t *rows)
{
    dist_comm *c = m->c;
    char *dst = gather_dest(m, g);
    if (dst == NULL)
        return -1;
    for (int r = 0; r < c->size; r++) {
        size_t bytes = (size_t)(g->outer * rows[r] * g->inner_bytes);
        const dist_meta *pr = &c->peers[r];
        if (r == c->rank)
            memcpy(dst, PyArray_DATA((PyArrayObject *)m->arr), bytes);
        else if (pr->fused_len >= 0)
            memcpy(dst, dist_fused_payload(c, r), bytes);
        else if (move_piece(m, dst, g, rows[r], r, dist_follows_to(pr, r, c->rank)
                            ? DIST_TAG_FOLLOW : DIST_TAG_DATA, 0) < 0)
            return -1;
        dst += bytes;
    }
    return 0;
}

/* This rank's piece to the receiving ranks when neither inside nor right
 * behind its record. */
static int gather_send_after(move_call *m, const geometry *g, int64_t rows, int all, int root)
{
    if (m->mine.fused_len >= 0 || m->mine.follow_to != -2)
        return 0;
    for (int r = 0; r < m->c->size; r++) {
        if ((!all && r != root) || r == m->c->rank)
            continue;
        if (move_piece(m, PyArray_DATA((PyArrayObject *)m->arr), g, rows, r, DIST_TAG_DATA,
                       1) < 0)
            return -1;
    }
    return 0;
}

static PyObject *gather_host(move_call *m, int d, int all, int root)
{
    dist_comm *c = m->c;
    int P = c->size, receives = all || c->rank == root;
    int64_t total = 0, *rows = PyMem_Calloc((size_t)P, sizeof(int64_t));
    if (rows == NULL)
        return PyErr_NoMemory();
    for (int r = 0; r < P; r++)
        total += rows[r] = c->peers[r].shape[d];
    PyObject *res = NULL;
    geometry g;
    if (geometry_of(&m->mine, d, total, &g) < 0)
        goto out;
    if (receives && ((m->out = dist_empty_like_meta(&m->mine, d, total,
                                                    (PyArrayObject *)m->arr)) == NULL ||
                     gather_receive(m, &g, rows) < 0))
        goto out;
    if (gather_send_after(m, &g, rows[c->rank], all, root) < 0)
        goto out;
    move_posted(m);
    if (move_wait(m) < 0)
        goto out;
    if (m->stage != NULL)
        restage(PyArray_DATA((PyArrayObject *)m->out), PyArray_DATA((PyArrayObject *)m->stage),
                &g, rows, P, 0);
    res = m->out != NULL ? m->out : Py_NewRef(Py_None);
out:
    PyMem_Free(rows);
    return res;
}

/* argerr: a bad root or dim (dist_args.c), raised at the guard; stolen. */
static PyObject *gather_common(dist_comm *c, PyObject *x, int root, int dim, int64_t kind,
                               PyObject *gpu, const dist_guard_kw *gk, PyObject *argerr)
{
    int all = kind == DIST_ALL_GATHER;
    move_call m;
    if (move_begin(&m, c, kind, all ? -1 : root, dim, argerr) < 0)
        return NULL;
    dist_send s = DIST_SEND_NONE;
    dist_guard_kw_read(gk, &m.mine, &m.argerr);
    gather_read(&m, x, dim, gpu, all);
    if (!PyErr_Occurred() && m.mine.dev_kind != DIST_DEV_GPU)
        gather_plan_sends(&m, all ? -1 : root, &s);
    if (move_agree(&m, &s) < 0)
        return move_end(&m, NULL);
    if (m.mine.dev_kind == DIST_DEV_GPU) {
        move_posted(&m);
        m.out = dist_gpu_gather(c, &m.mine, &m.ga, (int)m.mine.dim, all ? -1 : root,
                                m.deadline);
        return move_end(&m, m.out);
    }
    return move_end(&m, gather_host(&m, (int)m.mine.dim, all, root));
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

/* Root's array (or, off root, a GPU result's device) into the record. */
static void broadcast_read(move_call *m, PyObject *x, PyObject *gpu, int root)
{
    dist_comm *c = m->c;
    int me = c->rank;
    if (dist_arg_error(&m->argerr) || check_root(root, c->size) < 0)
        return;
    if (me == root && gpu != Py_None)
        dist_gpu_read(c, x, gpu, 1, &m->mine, &m->ga);            /* NCCL (dist_gpu.c) */
    else if (me == root && (m->arr = dist_as_array(x, "x", 0, DIST_WHOLE)) != NULL)
        dist_meta_array(&m->mine, m->arr);
    else if (me != root && gpu != Py_None && dist_gpu_read(c, x, gpu, 0, &m->mine, &m->ga) < 0) {
        PyErr_Clear();   /* off root, x only names this rank's device: a bad one is ignored */
        memset(&m->ga, 0, sizeof m->ga);
    }
}

/* Root's array: inside its record, right behind it to every rank (while
 * the P - 1 copies of it stay within DIST_FOLLOW_BYTES), or by
 * MPI_Ibcast after the verdict. */
static void broadcast_plan_sends(move_call *m, dist_send *s)
{
    if (m->arr == NULL)
        return;
    int64_t nbytes = (int64_t)PyArray_NBYTES((PyArrayObject *)m->arr);
    if (path_for(nbytes) == PATH_FUSED) {
        s->fused = PyArray_DATA((PyArrayObject *)m->arr);
        s->fused_len = nbytes;
    } else if (m->c->size > 1 && path_for(nbytes * (m->c->size - 1)) == PATH_FOLLOW) {
        m->one.buf = PyArray_DATA((PyArrayObject *)m->arr);
        m->one.count = (int)nbytes;
        m->one.type = MPI_BYTE;
        s->follow_to = -1;
        s->piece = &m->one;
    }
}

/* After the verdict, root's bytes by MPI_Ibcast (root sends from x). */
static int broadcast_after(move_call *m, const dist_meta *rm, int root)
{
    npy_intp count = PyArray_SIZE((PyArrayObject *)m->out);
    size_t nbytes = (size_t)PyArray_NBYTES((PyArrayObject *)m->out);
    if (count > INT_MAX || rm->itemsize > INT_MAX) {
        PyErr_Format(PyExc_OverflowError, "dpmini.distributed.broadcast: %lld elements do "
                     "not fit MPI's int count (< 2**31)", (long long)count);
        return -1;
    }
    if (count == 0 || rm->itemsize == 0)
        return 0;
    MPI_Datatype unit = MPI_BYTE;
    int rc = MPI_SUCCESS;
    if (nbytes <= INT_MAX) {
        count = (npy_intp)nbytes;
    } else if ((rc = MPI_Type_contiguous((int)rm->itemsize, MPI_BYTE, &unit)) == MPI_SUCCESS &&
               (rc = MPI_Type_commit(&unit)) == MPI_SUCCESS) {
        m->types[m->ntypes++] = unit;
    }
    void *buf = PyArray_DATA((PyArrayObject *)(m->c->rank == root ? m->arr : m->out));
    if (rc == MPI_SUCCESS)
        rc = MPI_Ibcast(buf, (int)count, unit, root, m->c->comm, &m->reqs[m->n]);
    if (rc != MPI_SUCCESS)
        return dist_mpi_error(rc, "MPI_Ibcast");
    m->done[m->n++] = 0;
    return 0;
}

/* The result: root copies x while its messages travel (a small copy
 * keeps the GIL: releasing it costs more), or returns the pickle bytes the
 * wrapper made; the others copy root's fused bytes or receive them. */
static PyObject *broadcast_host(move_call *m, int root)
{
    dist_comm *c = m->c;
    int me = c->rank;
    const dist_meta *rm = &c->peers[root];
    int copies = me == root && !rm->is_object;   /* pickle bytes are the wrapper's own */
    m->out = me == root && !copies ? Py_NewRef(m->arr)
           : dist_empty_like_meta(rm, -1, 0, me == root ? (PyArrayObject *)m->arr : NULL);
    if (m->out == NULL)
        return NULL;
    char *dst = PyArray_DATA((PyArrayObject *)m->out);
    size_t nbytes = (size_t)PyArray_NBYTES((PyArrayObject *)m->out);
    int64_t bytes = (int64_t)nbytes;
    geometry whole = {1, 1, bytes};
    if (me != root && rm->fused_len >= 0)
        memcpy(dst, dist_fused_payload(c, root), nbytes);
    else if (me != root && dist_follows_to(rm, root, me) &&
             move_piece(m, dst, &whole, 1, root, DIST_TAG_FOLLOW, 0) < 0)
        return NULL;
    else if (rm->fused_len < 0 && rm->follow_to == -2 && broadcast_after(m, rm, root) < 0)
        return NULL;
    move_posted(m);
    if (copies && nbytes < DIST_MOVE_FUSE_BYTES) {
        memcpy(dst, PyArray_DATA((PyArrayObject *)m->arr), nbytes);
    } else if (copies) {
        const char *src = PyArray_DATA((PyArrayObject *)m->arr);
        Py_BEGIN_ALLOW_THREADS
        memcpy(dst, src, nbytes);
        Py_END_ALLOW_THREADS
    }
    return move_wait(m) < 0 ? NULL : m->out;
}

/* broadcast(x, root=0, pickled=False, error=None, gpu=None, *, tag, context)
 * -> (array, root's pickled flag). x matters on root only: an ndarray, or
 * (pickled=True) a uint8 array of pickle bytes that the Python wrapper made;
 * error: an exception the wrapper met (pickling) to raise on every rank. */
PyObject *dist_broadcast(dist_comm *c, PyObject *args, PyObject *kw)
{
    static char *kwlist[] = {"x", "root", "pickled", "error", "gpu", "tag", "context", NULL};
    PyObject *x = Py_None, *gpu = Py_None, *rootobj = NULL, *argerr = NULL;
    dist_guard_kw gk = {NULL, NULL, NULL};
    int root = 0, pickled = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "O|OpOO$OO:broadcast", kwlist, &x, &rootobj,
                                     &pickled, &gk.error, &gpu, &gk.tag, &gk.context))
        return NULL;
    dist_int_arg(rootobj, "root", &root, &argerr);
    move_call m;
    if (move_begin(&m, c, DIST_BROADCAST, root, 0, argerr) < 0)
        return NULL;
    m.mine.is_object = pickled;
    dist_send s = DIST_SEND_NONE;
    dist_guard_kw_read(&gk, &m.mine, &m.argerr);   /* the wrapper's error (pickling) first */
    broadcast_read(&m, x, gpu, root);
    if (!PyErr_Occurred())
        broadcast_plan_sends(&m, &s);
    if (move_agree(&m, &s) < 0)
        return move_end(&m, NULL);
    const dist_meta *rm = &c->peers[root];
    PyObject *out;
    if (rm->dev_kind == DIST_DEV_GPU) {
        move_posted(&m);
        out = m.out = dist_gpu_broadcast(c, rm, &m.ga, root, m.deadline);
    } else {
        out = broadcast_host(&m, root);
    }
    PyObject *res = out != NULL ? Py_BuildValue("(OO)", out, rm->is_object && rm->dev_kind !=
                                                DIST_DEV_GPU ? Py_True : Py_False) : NULL;
    return move_end(&m, res);   /* res holds the result */
}
