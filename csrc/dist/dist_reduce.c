/* dist_reduce.c - barrier, all_reduce and reduce across ranks.
 *
 * Reductions run on MPI's own operations (MPI_Iallreduce / MPI_Ireduce on
 * the predefined datatype of the array's dtype), polled against the
 * deadline. "mean" is "sum" divided by the number of ranks on the result,
 * for floating and complex dtypes only (an integer mean would have to
 * round or change dtype; say which you want with op="sum"). "max" and
 * "min" of floating dtypes propagate NaN as NumPy does (nan_ops below).
 */
#include "dist.h"

#include <limits.h>
#include <string.h>

PyObject *dist_barrier(dist_comm *c, PyObject *args, PyObject *kw)
{
    static char *kwlist[] = {DIST_GUARD_KWLIST, NULL};
    dist_guard_kw gk = {NULL, NULL, NULL};
    if (!PyArg_ParseTupleAndKeywords(args, kw, "|$OOO:barrier", kwlist, &gk.tag, &gk.error,
                                     &gk.context))
        return NULL;
    if (dist_enter(c) < 0)
        return NULL;
    dist_meta mine;
    memset(&mine, 0, sizeof mine);
    mine.kind = DIST_BARRIER;
    mine.root = -1;
    mine.ndim = -1;
    PyObject *saved = NULL, *argerr = NULL;
    dist_guard_kw_read(&gk, &mine, &argerr);
    if (dist_arg_error(&argerr))
        dist_meta_fail(&mine, &saved);
    int rc = dist_agree(c, &mine, &saved, dist_now() + c->timeout);
    dist_leave(c);
    if (rc < 0)
        return NULL;
    Py_RETURN_NONE;
}

static int parse_op(const char *op)
{
    if (strcmp(op, "sum") == 0)
        return DIST_OP_SUM;
    if (strcmp(op, "mean") == 0)
        return DIST_OP_MEAN;
    if (strcmp(op, "max") == 0)
        return DIST_OP_MAX;
    if (strcmp(op, "min") == 0)
        return DIST_OP_MIN;
    PyErr_Format(PyExc_ValueError, "op: expected 'sum', 'mean', 'max' or 'min', got '%.40s'",
                 op);
    return -1;
}

/* OverflowError past MPI's int count (a converted list; an ndarray view
 * is checked before its copy by dist_as_array). */
static int too_many(npy_intp n)
{
    if (n <= INT_MAX)
        return 0;
    PyErr_Format(PyExc_OverflowError, "x: %lld elements do not fit MPI's int count "
                 "(< 2**31); reduce it in parts", (long long)n);
    return -1;
}

/* max / min of floating dtypes as NumPy's np.maximum / np.minimum: NaN
 * wherever any rank holds NaN, whichever rank that is (MPI_MAX keeps or
 * drops a NaN depending on the order it meets it: min(1, NaN, 3, 4) gave
 * 3). A NaN in `in` replaces inout; a NaN in inout stays, since every
 * comparison with it is false. */
/* Elements are read and written with memcpy: the small arrays that travel
 * inside the guard's record start 8-byte aligned, less than a long double
 * needs. */
#define NAN_PROPAGATING(name, T, cmp)                                        \
    static void name(const void *in, void *inout, int n)                    \
    {                                                                        \
        for (int i = 0; i < n; i++) {                                        \
            T a, b;                                                          \
            memcpy(&a, (const char *)in + (size_t)i * sizeof(T), sizeof(T)); \
            memcpy(&b, (const char *)inout + (size_t)i * sizeof(T), sizeof(T)); \
            if (a != a || a cmp b)                                           \
                memcpy((char *)inout + (size_t)i * sizeof(T), &a, sizeof(T)); \
        }                                                                    \
    }
NAN_PROPAGATING(max_f, float, >)
NAN_PROPAGATING(min_f, float, <)
NAN_PROPAGATING(max_d, double, >)
NAN_PROPAGATING(min_d, double, <)
NAN_PROPAGATING(max_ld, long double, >)
NAN_PROPAGATING(min_ld, long double, <)

#define NAN_OP(name, fn_f, fn_d, fn_ld)                                      \
    static void name(void *in, void *inout, int *len, MPI_Datatype *t)      \
    {                                                                        \
        if (*t == MPI_FLOAT)                                                 \
            fn_f(in, inout, *len);                                           \
        else if (*t == MPI_DOUBLE)                                           \
            fn_d(in, inout, *len);                                           \
        else                                                                 \
            fn_ld(in, inout, *len);                                          \
    }
NAN_OP(nan_max, max_f, max_d, max_ld)
NAN_OP(nan_min, min_f, min_d, min_ld)

/* The two operations, made once (MPI_Op_create after MPI_Init; kept until
 * MPI_Finalize frees them). -1 with RuntimeError. */
static int nan_ops(MPI_Op *max, MPI_Op *min)
{
    static MPI_Op ops[2] = {MPI_OP_NULL, MPI_OP_NULL};
    if (ops[0] == MPI_OP_NULL) {
        int rc = MPI_Op_create(nan_max, 1, &ops[0]);
        if (rc == MPI_SUCCESS)
            rc = MPI_Op_create(nan_min, 1, &ops[1]);
        if (rc != MPI_SUCCESS)
            return dist_mpi_error(rc, "MPI_Op_create");
    }
    *max = ops[0];
    *min = ops[1];
    return 0;
}

/* The MPI datatype and operation for this dtype and op, or an error
 * naming the dtype. */
static int mpi_op_for(PyArrayObject *a, int op, MPI_Datatype *t, MPI_Op *o)
{
    PyArray_Descr *d = PyArray_DESCR(a);
    char kind = d->kind;
    npy_intp size = PyArray_ITEMSIZE(a);
    *t = MPI_DATATYPE_NULL;
    if (kind == 'b') {
        *t = MPI_C_BOOL;
    } else if (kind == 'i') {
        *t = size == 1 ? MPI_INT8_T : size == 2 ? MPI_INT16_T : size == 4 ? MPI_INT32_T
           : size == 8 ? MPI_INT64_T : MPI_DATATYPE_NULL;
    } else if (kind == 'u') {
        *t = size == 1 ? MPI_UINT8_T : size == 2 ? MPI_UINT16_T : size == 4 ? MPI_UINT32_T
           : size == 8 ? MPI_UINT64_T : MPI_DATATYPE_NULL;
    } else if (kind == 'f') {
        *t = d->type_num == NPY_FLOAT ? MPI_FLOAT : d->type_num == NPY_DOUBLE ? MPI_DOUBLE
           : d->type_num == NPY_LONGDOUBLE ? MPI_LONG_DOUBLE : MPI_DATATYPE_NULL;
    } else if (kind == 'c') {
        *t = d->type_num == NPY_CFLOAT ? MPI_C_FLOAT_COMPLEX
           : d->type_num == NPY_CDOUBLE ? MPI_C_DOUBLE_COMPLEX : MPI_DATATYPE_NULL;
    }
    if (*t == MPI_DATATYPE_NULL) {
        PyErr_Format(PyExc_TypeError, "x: dtype %R has no MPI reduction (bool, integers, "
                     "float32, float64, longdouble, complex64 and complex128 do)", (PyObject *)d);
        return -1;
    }
    if (op == DIST_OP_MEAN && kind != 'f' && kind != 'c') {
        PyErr_Format(PyExc_TypeError, "op='mean' needs a floating or complex dtype, x has %R; "
                     "use op='sum' and divide as you want", (PyObject *)d);
        return -1;
    }
    if (kind == 'b' && op == DIST_OP_SUM) {
        PyErr_SetString(PyExc_TypeError, "op='sum' of bool arrays: MPI has no sum of bools; "
                        "use op='max' (any) or op='min' (all), or sum an integer dtype");
        return -1;
    }
    if (kind == 'c' && (op == DIST_OP_MAX || op == DIST_OP_MIN)) {
        PyErr_Format(PyExc_TypeError, "op='%s' of complex arrays: complex numbers have no "
                     "order", dist_op_name(op));
        return -1;
    }
    if (kind == 'b') {
        *o = op == DIST_OP_MAX ? MPI_LOR : MPI_LAND;
    } else if (kind == 'f' && (op == DIST_OP_MAX || op == DIST_OP_MIN)) {
        MPI_Op mx, mn;
        if (nan_ops(&mx, &mn) < 0)
            return -1;
        *o = op == DIST_OP_MAX ? mx : mn;
    } else
        *o = op == DIST_OP_MAX ? MPI_MAX : op == DIST_OP_MIN ? MPI_MIN : MPI_SUM;
    return too_many(PyArray_SIZE(a));
}

/* Open MPI 4.1's sum of 8- and 16-bit integers (its AVX op component)
 * saturates: two int8 127 gave 127 where NumPy wraps to -2 (measured on
 * this machine, 16 elements and more). Such sums run on 32-bit integers
 * (exact below 2**24 ranks) and are cast back at the end, which wraps as
 * NumPy does. Replaces *arr and *t; returns the narrow dtype to cast back to
 * (new reference), or NULL: nothing to do, or an error (PyErr_Occurred). */
static PyArray_Descr *widen_small_int_sum(PyObject **arr, int op, MPI_Datatype *t,
                                          MPI_Op *o)
{
    PyArray_Descr *d = PyArray_DESCR((PyArrayObject *)*arr);
    if (op != DIST_OP_SUM || (d->kind != 'i' && d->kind != 'u') ||
        PyArray_ITEMSIZE((PyArrayObject *)*arr) >= 4)
        return NULL;
    PyObject *wide = PyArray_Cast((PyArrayObject *)*arr, d->kind == 'i' ? NPY_INT32 : NPY_UINT32);
    if (wide == NULL)
        return NULL;
    Py_INCREF(d);
    Py_SETREF(*arr, wide);
    if (mpi_op_for((PyArrayObject *)wide, op, t, o) < 0) {
        Py_DECREF(d);
        return NULL;
    }
    return d;
}

/* Whether every rank's data came with its record (the arrays agree, so
 * either every rank fused or none did; the records say it identically on
 * every rank). */
static int every_rank_fused(const dist_comm *c)
{
    for (int r = 0; r < c->size; r++)
        if (c->peers[r].fused_len < 0)
            return 0;
    return 1;
}

/* The reduction of the fused payloads, in rank order on every rank (so
 * every rank's result is the same, bit for bit): a new array like arr. */
static PyObject *reduce_fused(dist_comm *c, PyObject *arr, int count, MPI_Datatype t, MPI_Op o)
{
    PyObject *out = PyArray_NewLikeArray((PyArrayObject *)arr, NPY_CORDER, NULL, 0);
    if (out == NULL)
        return NULL;
    char *acc = PyArray_DATA((PyArrayObject *)out);
    const char *mine = PyArray_DATA((PyArrayObject *)arr);
    memcpy(acc, c->rank == 0 ? mine : dist_fused_payload(c, 0),
           (size_t)PyArray_NBYTES((PyArrayObject *)arr));
    for (int r = 1; r < c->size; r++) {
        int rc = MPI_Reduce_local(r == c->rank ? mine : dist_fused_payload(c, r), acc, count,
                                  t, o);
        if (rc != MPI_SUCCESS) {
            Py_DECREF(out);
            dist_mpi_error(rc, "MPI_Reduce_local");
            return NULL;
        }
    }
    return out;
}

/* One call of all_reduce or reduce: this rank's record, arrays and MPI
 * operation. */
typedef struct {
    dist_comm *c;
    dist_meta mine;
    double deadline;
    int all, root, op, nccl_op;
    PyObject *arr, *out, *saved, *argerr;
    PyArray_Descr *narrow;   /* a small-integer sum's own dtype */
    MPI_Datatype t;
    MPI_Op o;
    dist_gpu_arg g;
    dist_piece piece;        /* this rank's array behind its record (two ranks) */
} reduce_call;

/* The op, root and array into the record (a local error stays pending for
 * the guard). */
static void reduce_read(reduce_call *r, PyObject *x, const char *opname, PyObject *gpu)
{
    dist_comm *c = r->c;
    r->op = dist_arg_error(&r->argerr) ? -1 : parse_op(opname);
    r->mine.op = r->op < 0 ? DIST_OP_NONE : r->op;
    if (r->op < 0)
        return;
    if (!r->all && (r->root < 0 || r->root >= c->size)) {
        PyErr_Format(PyExc_ValueError, "root: %d is not a rank of this communicator (0..%d)",
                     r->root, c->size - 1);
    } else if (gpu != Py_None) {   /* NCCL (dist_gpu.c) */
        if (dist_gpu_read(c, x, gpu, r->all || c->rank == r->root, &r->mine, &r->g) == 0)
            r->nccl_op = dist_gpu_op(&r->mine, r->op);
    } else if ((r->arr = dist_as_array(x, "x", 1, DIST_WHOLE)) != NULL &&
               mpi_op_for((PyArrayObject *)r->arr, r->op, &r->t, &r->o) == 0) {
        dist_meta_array(&r->mine, r->arr);   /* the caller's dtype, before any widening */
        r->narrow = widen_small_int_sum(&r->arr, r->op, &r->t, &r->o);
    }
}

/* How this rank's array travels: inside its record's message; or, between
 * two ranks past DIST_PAIR_MIN bytes (where the copies into and out of
 * the record's buffer cost more than a message), right behind it straight
 * from the array (reduce_pair). */
#define DIST_PAIR_MIN (8 << 10)
static void reduce_plan_sends(reduce_call *r, dist_send *s)
{
    if (r->arr == NULL || PyErr_Occurred())
        return;
    int64_t nbytes = (int64_t)PyArray_NBYTES((PyArrayObject *)r->arr);
    s->fused_to = r->all ? -1 : r->root;
    if (r->c->size == 2 && nbytes > DIST_PAIR_MIN && nbytes <= dist_fuse_limit(r->c)) {
        r->piece.buf = PyArray_DATA((PyArrayObject *)r->arr);
        r->piece.count = (int)nbytes;
        r->piece.type = MPI_BYTE;
        s->follow_to = s->fused_to;
        s->piece = &r->piece;
        s->keep = r->arr;
    } else {
        s->fused = PyArray_DATA((PyArrayObject *)r->arr);
        s->fused_len = nbytes;
    }
}

/* Two ranks whose arrays followed their records: the other rank's array
 * is received (into the result on rank 1, into scratch on rank 0, which
 * copies its own into the result meanwhile) and combined in rank order,
 * x1 op x0, on both ranks (the same bits on both, as reduce_fused). */
static int reduce_pair(reduce_call *r)
{
    dist_comm *c = r->c;
    int me = c->rank, peer = 1 - me, receives = dist_follows_to(&c->peers[peer], peer, me);
    PyObject *theirs = NULL;
    if (receives) {
        r->out = PyArray_NewLikeArray((PyArrayObject *)r->arr, NPY_CORDER, NULL, 0);
        theirs = r->out == NULL ? NULL : me == 0
                 ? PyArray_NewLikeArray((PyArrayObject *)r->arr, NPY_CORDER, NULL, 0)
                 : Py_NewRef(r->out);
        if (theirs == NULL) {
            dist_follow_drain(c, r->deadline);   /* take what was sent, finish our send */
            return -1;
        }
    }
    MPI_Request reqs[3];
    int done[3], n = dist_follow_take(c, reqs, done), rc = MPI_SUCCESS;
    int count = (int)PyArray_SIZE((PyArrayObject *)r->arr);
    if (receives) {
        int nbytes = (int)PyArray_NBYTES((PyArrayObject *)r->arr);   /* <= DIST_FUSE_BYTES */
        rc = MPI_Irecv(PyArray_DATA((PyArrayObject *)theirs), nbytes, MPI_BYTE, peer,
                       DIST_TAG_FOLLOW, c->comm, &reqs[n]);
        done[n++] = rc != MPI_SUCCESS;
        if (me == 0)
            memcpy(PyArray_DATA((PyArrayObject *)r->out), PyArray_DATA((PyArrayObject *)r->arr),
                   (size_t)PyArray_NBYTES((PyArrayObject *)r->arr));
    }
    int st = dist_wait_data(c, reqs, done, n, r->deadline, r->mine.call, r->mine.kind, r->arr,
                            r->out, theirs);
    if (rc != MPI_SUCCESS && st == 0)
        st = dist_mpi_error(rc, "MPI_Irecv");
    if (st == 0 && receives) {
        const void *in = PyArray_DATA((PyArrayObject *)(me == 0 ? theirs : r->arr));
        rc = MPI_Reduce_local(in, PyArray_DATA((PyArrayObject *)r->out), count, r->t, r->o);
        if (rc != MPI_SUCCESS)
            st = dist_mpi_error(rc, "MPI_Reduce_local");
    }
    Py_XDECREF(theirs);
    return st == 0 ? 0 : -1;
}

/* The host reduction after the agreement: from the fused payloads, or by
 * MPI_Iallreduce / MPI_Ireduce (MPI writes the result: no copy of x first). */
static int reduce_host(reduce_call *r)
{
    dist_comm *c = r->c;
    int count = (int)PyArray_SIZE((PyArrayObject *)r->arr), receives = r->all || c->rank == r->root;
    if (c->peers[c->rank].follow_to != -2)
        return reduce_pair(r);
    if (every_rank_fused(c))
        return receives && (r->out = reduce_fused(c, r->arr, count, r->t, r->o)) == NULL ? -1 : 0;
    if (receives && (r->out = PyArray_NewLikeArray((PyArrayObject *)r->arr, NPY_CORDER, NULL,
                                                   0)) == NULL)
        return -1;
    void *src = PyArray_DATA((PyArrayObject *)r->arr);
    void *dst = receives ? PyArray_DATA((PyArrayObject *)r->out) : NULL;
    MPI_Request req = MPI_REQUEST_NULL;
    int done = 0;
    int rc = r->all ? MPI_Iallreduce(src, dst, count, r->t, r->o, c->comm, &req)
                    : MPI_Ireduce(src, dst, count, r->t, r->o, r->root, c->comm, &req);
    if (rc != MPI_SUCCESS)
        return dist_mpi_error(rc, r->all ? "MPI_Iallreduce" : "MPI_Ireduce");
    return dist_wait_data(c, &req, &done, 1, r->deadline, r->mine.call, r->mine.kind, r->arr,
                          r->out, NULL);
}

/* A widened sum cast back to 8 or 16 bits (wrapping as NumPy does), or a
 * mean divided by the number of ranks. */
static int reduce_finish(reduce_call *r)
{
    if (r->out == NULL) {
        r->out = Py_NewRef(Py_None);
    } else if (r->narrow != NULL) {
        PyObject *back = PyArray_CastToType((PyArrayObject *)r->out, r->narrow, 0);
        r->narrow = NULL;   /* stolen */
        Py_SETREF(r->out, back);
    } else if (r->op == DIST_OP_MEAN) {
        PyObject *k = PyLong_FromLong(r->c->size);
        PyObject *q = k ? PyNumber_InPlaceTrueDivide(r->out, k) : NULL;
        Py_XDECREF(k);
        if (q == NULL)
            Py_CLEAR(r->out);
        Py_XDECREF(q);   /* in place: q is out */
    }
    return r->out == NULL ? -1 : 0;
}

/* argerr: a bad root or op (dist_args.c), raised at the guard; stolen. */
static PyObject *reduce_common(dist_comm *c, PyObject *x, int root, const char *opname,
                               int64_t kind, PyObject *gpu, const dist_guard_kw *gk,
                               PyObject *argerr)
{
    if (dist_enter(c) < 0) {
        Py_XDECREF(argerr);
        return NULL;
    }
    reduce_call r;
    memset(&r, 0, sizeof r);
    r.c = c;
    r.deadline = dist_now() + c->timeout;
    r.all = kind == DIST_ALL_REDUCE;
    r.root = root;
    r.argerr = argerr;
    r.t = MPI_DATATYPE_NULL;
    r.o = MPI_OP_NULL;
    r.mine.kind = kind;
    r.mine.root = r.all ? -1 : root;
    r.mine.ndim = -1;
    dist_guard_kw_read(gk, &r.mine, &r.argerr);
    reduce_read(&r, x, opname, gpu);
    if (PyErr_Occurred())
        dist_meta_fail(&r.mine, &r.saved);
    dist_send s = DIST_SEND_NONE;   /* a rank with an error sends no data (stage_record) */
    reduce_plan_sends(&r, &s);
    if (dist_agree_send(c, &r.mine, &r.saved, r.deadline, &s) < 0) {
        Py_CLEAR(r.out);
    } else if (gpu != Py_None) {   /* every rank's is (the guard compared the device kinds) */
        r.out = dist_gpu_reduce(c, &r.mine, &r.g, r.nccl_op, r.all ? -1 : root, r.deadline);
    } else if (reduce_host(&r) < 0 || reduce_finish(&r) < 0) {
        Py_CLEAR(r.out);
    }
    dist_gpu_arg_clear(&r.g);
    Py_XDECREF(r.arr);
    Py_XDECREF(r.narrow);
    Py_XDECREF(r.argerr);   /* already raised (NULL) unless the call failed before */
    dist_leave(c);
    return r.out;
}

PyObject *dist_all_reduce(dist_comm *c, PyObject *args, PyObject *kw)
{
    static char *kwlist[] = {"x", "op", "gpu", DIST_GUARD_KWLIST, NULL};
    PyObject *x, *gpu = Py_None, *opobj = NULL, *argerr = NULL;
    dist_guard_kw gk = {NULL, NULL, NULL};
    const char *op = "sum";
    if (!PyArg_ParseTupleAndKeywords(args, kw, "O|OO$OOO:all_reduce", kwlist, &x, &opobj, &gpu,
                                     &gk.tag, &gk.error, &gk.context))
        return NULL;
    dist_op_arg(opobj, &op, &argerr);
    return reduce_common(c, x, -1, op, DIST_ALL_REDUCE, gpu, &gk, argerr);
}

PyObject *dist_reduce(dist_comm *c, PyObject *args, PyObject *kw)
{
    static char *kwlist[] = {"x", "root", "op", "gpu", DIST_GUARD_KWLIST, NULL};
    PyObject *x, *gpu = Py_None, *rootobj = NULL, *opobj = NULL, *argerr = NULL;
    dist_guard_kw gk = {NULL, NULL, NULL};
    int root = 0;
    const char *op = "sum";
    if (!PyArg_ParseTupleAndKeywords(args, kw, "O|OOO$OOO:reduce", kwlist, &x, &rootobj, &opobj,
                                     &gpu, &gk.tag, &gk.error, &gk.context))
        return NULL;
    dist_int_arg(rootobj, "root", &root, &argerr);
    dist_op_arg(opobj, &op, &argerr);
    return reduce_common(c, x, root, op, DIST_REDUCE, gpu, &gk, argerr);
}
