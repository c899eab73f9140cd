/* dist_guard.c - phase 1 of every dpmini.distributed collective: the
 * bounded agreement on what is being called (see dist.h).
 *
 * Why point-to-point and not MPI_Iallgather: a rank whose record never
 * arrives is then known by name (its receive is the one still pending at
 * the deadline), so the TimeoutError can say which ranks are missing. The
 * records travel on their own tag of a communicator that only dpmini uses,
 * in order between every pair of ranks (MPI's non-overtaking rule), so a
 * rank that skipped a call is seen as a call-number mismatch, never as a
 * silent match with the wrong call.
 */
#include "dist.h"

#include <sched.h>
#include <string.h>
#include <time.h>

static const char *kind_names[] = {"?", "barrier", "scatter", "gather", "all_gather",
                                   "broadcast", "all_reduce", "reduce"};
static const char *op_names[] = {"", "sum", "mean", "max", "min"};

const char *dist_kind_name(int64_t kind)
{
    return (kind >= 1 && kind <= DIST_REDUCE) ? kind_names[kind] : "?";
}

const char *dist_op_name(int64_t op)
{
    return (op >= 0 && op <= DIST_OP_MIN) ? op_names[op] : "?";
}

double dist_now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

int dist_mpi_error(int code, const char *what)
{
    char text[MPI_MAX_ERROR_STRING + 1];
    int len = 0;
    if (MPI_Error_string(code, text, &len) != MPI_SUCCESS)
        len = 0;
    text[len] = '\0';
    PyErr_Format(PyExc_RuntimeError, "dpmini.distributed: %s failed: MPI error %d: %s",
                 what, code, text);
    return -1;
}

#define DIST_HOT_SPIN 0.001

/* spin: seconds without progress during which the loop only yields. */
static int poll_pause(PyThreadState **ts, double deadline, double last_progress,
                      double *next_signals, double spin)
{
    double t = dist_now();
    if (t >= deadline)
        return 1;
    if (t >= *next_signals) {
        PyEval_RestoreThread(*ts);
        int interrupted = PyErr_CheckSignals() < 0;
        *ts = PyEval_SaveThread();
        if (interrupted)
            return -1;
        *next_signals = t + 0.05;
    }
    /* Test again at once for the first DIST_HOT_SPIN seconds without
     * progress, as MPI's own blocking calls do (on a busy machine a
     * sched_yield hands the core to another process for a whole time
     * slice, milliseconds, while the message is about to arrive); then
     * yield while data may be moving (MPI progresses inside MPI_Test, so a
     * sleep would stall a collective that is about to finish); sleep once
     * nothing has completed for `spin` seconds (a slow peer). */
    if (t - last_progress < DIST_HOT_SPIN) {
        return 0;
    } else if (t - last_progress < spin) {
        sched_yield();
    } else {
        struct timespec nap = {0, t - last_progress < 0.1 ? 50000 : 500000};
        nanosleep(&nap, NULL);
    }
    return 0;
}

int dist_poll_pause(PyThreadState **ts, double deadline, double last_progress,
                    double *next_signals)
{
    return poll_pause(ts, deadline, last_progress, next_signals, 0.005);
}

static int poll_requests(MPI_Request *reqs, int n, int *done, double deadline, double spin)
{
    int left = 0, rc = MPI_SUCCESS, result = 0, interrupted = 0;
    for (int i = 0; i < n; i++)
        left += !done[i];
    if (left == 0)
        return 0;
    double last_progress = dist_now(), next_signals = last_progress + 0.05;
    PyThreadState *ts = PyEval_SaveThread();
    while (left > 0) {
        for (int i = 0; i < n; i++) {
            if (done[i])
                continue;
            int flag = 0;
            rc = MPI_Test(&reqs[i], &flag, MPI_STATUS_IGNORE);
            if (rc != MPI_SUCCESS)
                goto out;
            if (flag) {
                done[i] = 1;
                left--;
                last_progress = dist_now();
            }
        }
        if (left == 0)
            break;
        int pause = poll_pause(&ts, deadline, last_progress, &next_signals, spin);
        if (pause != 0) {
            result = pause > 0;
            interrupted = pause < 0;
            break;
        }
    }
out:
    PyEval_RestoreThread(ts);
    if (interrupted)
        return -1;
    if (rc != MPI_SUCCESS)
        return dist_mpi_error(rc, "MPI_Test");
    return result;
}

int dist_poll(MPI_Request *reqs, int n, int *done, double deadline)
{
    return poll_requests(reqs, n, done, deadline, 0.005);
}

int dist_poll_data(MPI_Request *reqs, int n, int *done, double deadline)
{
    return poll_requests(reqs, n, done, deadline, 1.0);
}

void dist_meta_fail(dist_meta *mine, PyObject **saved)
{
    PyObject *type = NULL, *exc = NULL, *tb = NULL;
    PyErr_Fetch(&type, &exc, &tb);
    PyErr_NormalizeException(&type, &exc, &tb);
    if (exc != NULL && tb != NULL)
        PyException_SetTraceback(exc, tb);
    Py_XDECREF(type);
    Py_XDECREF(tb);
    const char *tname = exc ? Py_TYPE(exc)->tp_name : "Error";
    PyObject *msg = exc ? PyObject_Str(exc) : NULL;
    const char *text = msg ? PyUnicode_AsUTF8(msg) : NULL;
    if (text == NULL) {
        PyErr_Clear();
        text = "?";
    }
    snprintf(mine->err, sizeof mine->err, "%s: %s", tname, text);
    Py_XDECREF(msg);
    if (*saved == NULL)
        *saved = exc;
    else
        Py_XDECREF(exc);
}

static void copy_attr_str(PyObject *obj, const char *attr, char *out, size_t n)
{
    PyObject *s = PyObject_GetAttrString(obj, attr);
    const char *t = s ? PyUnicode_AsUTF8(s) : NULL;
    if (t == NULL) {
        PyErr_Clear();
        t = "?";
    }
    snprintf(out, n, "%s", t);
    Py_XDECREF(s);
}

/* dtype.str and dtype.name of the last few dtypes seen (numpy computes
 * name in Python: several microseconds a call, as much as a small
 * collective's exchange). Holds a reference to each descr, so a cached
 * pointer is never another dtype's. */
#define NAME_CACHE 8
static struct {
    PyArray_Descr *descr;
    char str[24], name[24];
} names[NAME_CACHE];
static int names_next;

static void dtype_names(PyArray_Descr *d, dist_meta *m)
{
    for (int i = 0; i < NAME_CACHE; i++) {
        if (names[i].descr == d) {
            memcpy(m->dtype, names[i].str, sizeof m->dtype);
            memcpy(m->dtype_name, names[i].name, sizeof m->dtype_name);
            return;
        }
    }
    copy_attr_str((PyObject *)d, "str", m->dtype, sizeof m->dtype);
    copy_attr_str((PyObject *)d, "name", m->dtype_name, sizeof m->dtype_name);
    int i = names_next;
    names_next = (names_next + 1) % NAME_CACHE;
    Py_INCREF(d);
    Py_XSETREF(names[i].descr, d);
    memcpy(names[i].str, m->dtype, sizeof names[i].str);
    memcpy(names[i].name, m->dtype_name, sizeof names[i].name);
}

PyArray_Descr *dist_descr_of(const char *str)
{
    for (int i = 0; i < NAME_CACHE; i++) {
        PyArray_Descr *d = names[i].descr;
        if (d != NULL && !PyDataType_HASFIELDS(d) && strcmp(names[i].str, str) == 0)
            return (PyArray_Descr *)Py_NewRef((PyObject *)d);
    }
    PyArray_Descr *d = NULL;
    PyObject *s = PyUnicode_FromString(str);
    int ok = s != NULL && PyArray_DescrConverter(s, &d);
    Py_XDECREF(s);
    if (!ok)
        return NULL;
    dist_meta seen;
    dtype_names(d, &seen);   /* cached from now on */
    return d;
}

void dist_meta_array(dist_meta *m, PyObject *arr)
{
    PyArrayObject *a = (PyArrayObject *)arr;
    m->ndim = PyArray_NDIM(a);
    m->dev_kind = DIST_DEV_HOST;
    m->dev_id = -1;
    for (int i = 0; i < PyArray_NDIM(a) && i < DIST_MAX_NDIM; i++)
        m->shape[i] = PyArray_DIM(a, i);
    m->itemsize = PyArray_ITEMSIZE(a);
    dtype_names(PyArray_DESCR(a), m);
    if (PyArray_ISBYTESWAPPED(a)) {   /* '>f8' is named float64 too: show the byte order */
        char name[24];
        snprintf(name, sizeof name, "%s", m->dtype_name);
        snprintf(m->dtype_name, sizeof m->dtype_name, "%.12s (%.8s)", name, m->dtype);
    }
    /* A structured dtype's str is only "|V12": 'i4,f8' and 'f4,i8' would
     * agree. Its repr (names, formats, offsets) is hashed (FNV-1a) into the
     * record and named in messages. */
    m->fields_hash = 0;
    if (PyDataType_HASFIELDS(PyArray_DESCR(a))) {
        PyObject *r = PyObject_Repr((PyObject *)PyArray_DESCR(a));
        const char *t = r ? PyUnicode_AsUTF8(r) : NULL;
        uint64_t h = 1469598103934665603ULL;
        for (; t != NULL && *t; t++)
            h = (h ^ (unsigned char)*t) * 1099511628211ULL;
        if (t == NULL)
            PyErr_Clear();
        Py_XDECREF(r);
        m->fields_hash = h;
        snprintf(m->dtype_name, sizeof m->dtype_name, "%.8s fields#%06x", m->dtype,
                 (unsigned)(h & 0xffffff));
    }
}

int dist_enter(dist_comm *c)
{
    if (c->comm == MPI_COMM_NULL) {
        PyErr_SetString(PyExc_RuntimeError,
                        "dpmini.distributed: this communicator was freed; call init() again");
        return -1;
    }
    if (c->broken) {
        PyErr_Format(PyExc_RuntimeError,
                     "dpmini.distributed: this communicator cannot be used after %s "
                     "(messages of that call may still be in flight); end the job",
                     c->broken_why);
        return -1;
    }
    if (!PyThread_acquire_lock(c->lock, NOWAIT_LOCK)) {   /* never blocks: the GIL stays */
        PyErr_SetString(PyExc_RuntimeError,
                        "dpmini.distributed: a communicator serves one thread at a time, and "
                        "another thread of this rank is inside a collective on it (calls pair "
                        "across ranks by their order, which two threads do not keep); call "
                        "the collectives from one thread");
        return -1;
    }
    return 0;
}

void dist_leave(dist_comm *c)
{
    PyThread_release_lock(c->lock);
}

/* ------------------------------------------------------------------ */
/* Messages                                                            */
/* ------------------------------------------------------------------ */

static int kind_has_root(int64_t k)
{
    return k == DIST_SCATTER || k == DIST_GATHER || k == DIST_BROADCAST || k == DIST_REDUCE;
}

static int kind_has_dim(int64_t k)
{
    return k == DIST_SCATTER || k == DIST_GATHER || k == DIST_ALL_GATHER;
}

static int kind_compares_arrays(int64_t k)
{
    return k == DIST_GATHER || k == DIST_ALL_GATHER || k == DIST_ALL_REDUCE || k == DIST_REDUCE;
}

static void describe(const dist_meta *m, char *buf, size_t n)
{
    size_t len = 0;
#define ADD(...) do { if (len < n) len += (size_t)snprintf(buf + len, n - len, __VA_ARGS__); } while (0)
    ADD("%s call %lld", dist_kind_name(m->kind), (long long)m->call);
    if (m->has_tag > 0)
        ADD(" tag=%s", m->tag_text);
    if (m->ctx_text[0])
        ADD(" %s", m->ctx_text);
    if (kind_has_root(m->kind))
        ADD(" root=%lld", (long long)m->root);
    if (kind_has_dim(m->kind))
        ADD(" dim=%lld", (long long)m->dim);
    if (m->op != DIST_OP_NONE)
        ADD(" op=%s", dist_op_name(m->op));
    if (m->kind == DIST_SCATTER && m->split_text[0])
        ADD(" %s", m->split_text);
    if (kind_compares_arrays(m->kind) && m->ndim >= 0) {
        ADD(" shape (");
        for (int64_t i = 0; i < m->ndim && i < DIST_MAX_NDIM; i++)
            ADD("%lld%s", (long long)m->shape[i], m->ndim == 1 ? "," : (i + 1 < m->ndim ? ", " : ""));
        ADD(") dtype %s%s", m->dtype_name, m->dev_kind == DIST_DEV_GPU ? " (GPU array)"
            : m->dev_kind == DIST_DEV_GPU_STAGED ? " (GPU array, staged)" : "");
    }
#undef ADD
}

/* "0-2,5" into buf from the ranks r with group[r] == g. */
static void rank_list(const int *group, int P, int g, char *buf, size_t n)
{
    size_t len = 0;
    buf[0] = '\0';
    for (int r = 0; r < P; r++) {
        if (group[r] != g)
            continue;
        int e = r;
        while (e + 1 < P && group[e + 1] == g)
            e++;
        if (len < n)
            len += (size_t)snprintf(buf + len, n - len, "%s%d", len ? "," : "", r);
        if (e > r && len < n)
            len += (size_t)snprintf(buf + len, n - len, "%s%d", e == r + 1 ? "," : "-", e);
        r = e;
    }
}

/* ValueError listing the ranks grouped by their description. */
static int raise_mismatch(dist_comm *c, const dist_meta *mine, const char *what)
{
    int P = c->size;
    int *group = PyMem_Malloc(sizeof(int) * (size_t)P);
    char (*desc)[320] = PyMem_Malloc(sizeof(*desc) * (size_t)P);
    PyObject *parts = PyList_New(0);
    if (group == NULL || desc == NULL || parts == NULL) {
        PyMem_Free(group);
        PyMem_Free(desc);
        Py_XDECREF(parts);
        PyErr_NoMemory();
        return -1;
    }
    for (int r = 0; r < P; r++) {
        describe(&c->peers[r], desc[r], sizeof desc[r]);
        group[r] = -1;
    }
    int groups = 0;
    for (int r = 0; r < P; r++) {
        if (group[r] >= 0)
            continue;
        for (int s = r; s < P; s++)
            if (group[s] < 0 && strcmp(desc[s], desc[r]) == 0)
                group[s] = groups;
        if (groups < 32) {
            char ranks[128];
            rank_list(group, P, groups, ranks, sizeof ranks);
            PyObject *line = PyUnicode_FromFormat("\n  rank %s: %s", ranks, desc[r]);
            if (line == NULL || PyList_Append(parts, line) < 0) {
                Py_XDECREF(line);
                goto fail;
            }
            Py_DECREF(line);
        }
        groups++;
    }
    PyObject *empty = PyUnicode_FromString("");
    PyObject *body = empty ? PyUnicode_Join(empty, parts) : NULL;
    Py_XDECREF(empty);
    if (body != NULL) {
        PyErr_Format(PyExc_ValueError,
                     "dpmini.distributed.%s: the ranks disagree on %s (every rank raises "
                     "this error; the communicator stays usable):%U%s",
                     dist_kind_name(c->peers[0].kind), what, body,
                     groups > 32 ? "\n  ... (more groups left out)" : "");
        Py_DECREF(body);
    }
fail:
    PyMem_Free(group);
    PyMem_Free(desc);
    Py_DECREF(parts);
    return -1;
}

/* The first field on which two records that must agree differ, or NULL. */
static const char *first_difference(const dist_meta *a, const dist_meta *b)
{
    if (a->call != b->call)
        return "the call number (a rank skipped or added a collective)";
    if (a->kind != b->kind)
        return "the collective";
    if (kind_has_root(a->kind) && a->root != b->root)
        return "root";
    if (kind_has_dim(a->kind) && a->dim != b->dim)
        return "dim";
    if (a->op != b->op)
        return "op";
    if (a->ctx_hash != b->ctx_hash)
        return "the options";
    if (a->kind == DIST_SCATTER && a->split_hash != b->split_hash)
        return "chunk_sizes/weights";
    if (!kind_compares_arrays(a->kind) || a->err[0] || b->err[0])
        return NULL;
    if (a->dev_kind != b->dev_kind)
        return "the device kind (a host array on some ranks, a GPU array on others)";
    if (strcmp(a->dtype, b->dtype) != 0 || a->itemsize != b->itemsize)
        return "dtype";
    if (a->ndim != b->ndim)
        return "the number of dimensions";
    for (int64_t i = 0; i < a->ndim && i < DIST_MAX_NDIM; i++) {
        int ragged = (a->kind == DIST_GATHER || a->kind == DIST_ALL_GATHER) && i == a->dim;
        if (!ragged && a->shape[i] != b->shape[i])
            return "shape";
    }
    return NULL;
}

/* ------------------------------------------------------------------ */
/* The verdict: the same on every rank, from the same records           */
/* ------------------------------------------------------------------ */

static int check_magic(const dist_comm *c, const dist_meta *mine)
{
    for (int r = 0; r < c->size; r++) {
        if (c->peers[r].magic != DIST_MAGIC) {
            PyErr_Format(PyExc_RuntimeError,
                         "dpmini.distributed.%s: rank %d sent a record that is not "
                         "dpmini's; is another library using dpmini's communicator?",
                         dist_kind_name(mine->kind), r);
            return -1;
        }
    }
    return 0;
}

/* Every rank in the same call of the same collective. */
static int check_same_call(dist_comm *c, const dist_meta *mine)
{
    for (int r = 1; r < c->size; r++)
        if (c->peers[r].call != c->peers[0].call || c->peers[r].kind != c->peers[0].kind)
            return raise_mismatch(c, mine, c->peers[r].call != c->peers[0].call
                                  ? "the call number (a rank skipped or added a collective)"
                                  : "the collective");
    return 0;
}

/* The same tag: a rank that skipped a tagged call (a training step) is
 * named here instead of pairing its next call with this one. */
static int check_tags(dist_comm *c, const dist_meta *mine)
{
    const dist_meta *tagged = NULL;   /* the first rank whose tag was read */
    for (int r = 0; r < c->size; r++) {
        const dist_meta *m = &c->peers[r];
        if (m->has_tag < 0)
            continue;
        if (tagged == NULL)
            tagged = m;
        else if (m->has_tag != tagged->has_tag || m->tag_hash != tagged->tag_hash)
            return raise_mismatch(c, mine, "tag (a rank skipped or added a call)");
    }
    return 0;
}

/* Local argument errors, raised everywhere: this rank's own exception
 * where it had one, else a ValueError quoting the first rank's. */
static int raise_local_errors(const dist_comm *c, const dist_meta *mine, PyObject **saved)
{
    int first_err = -1;
    for (int r = 0; r < c->size && first_err < 0; r++)
        if (c->peers[r].err[0])
            first_err = r;
    if (first_err < 0)
        return 0;
    if (*saved != NULL) {
        PyObject *exc = *saved;
        *saved = NULL;
        PyErr_Restore(Py_NewRef((PyObject *)Py_TYPE(exc)), exc, PyException_GetTraceback(exc));
        return -1;
    }
    PyErr_Format(PyExc_ValueError,
                 "dpmini.distributed.%s (call %lld): rank %d rejected its arguments: %s "
                 "(every rank raises; the communicator stays usable)",
                 dist_kind_name(mine->kind), (long long)mine->call, first_err,
                 c->peers[first_err].err);
    return -1;
}

/* The fields this collective needs to agree, then a structured dtype's
 * fields among the ranks that have them, against the first such rank (not
 * rank 0's: scatter hands the other ranks raw void of the same size, which
 * has none and gathers back). */
static int check_fields(dist_comm *c, const dist_meta *mine)
{
    for (int r = 1; r < c->size; r++) {
        const char *what = first_difference(&c->peers[0], &c->peers[r]);
        if (what != NULL)
            return raise_mismatch(c, mine, what);
    }
    const dist_meta *fields = NULL;
    for (int r = 0; r < c->size && kind_compares_arrays(mine->kind); r++) {
        if (c->peers[r].fields_hash == 0)
            continue;
        if (fields == NULL)
            fields = &c->peers[r];
        else if (c->peers[r].fields_hash != fields->fields_hash)
            return raise_mismatch(c, mine, "dtype");
    }
    return 0;
}

/* A GPU collective needs an NCCL communicator on every rank or on none
 * (made together), and none aborted. */
static int check_nccl(const dist_comm *c, const dist_meta *mine)
{
    const dist_meta *lead = kind_has_root(mine->kind) && !kind_compares_arrays(mine->kind)
                            ? &c->peers[mine->root] : &c->peers[0];
    if (lead->dev_kind != DIST_DEV_GPU)
        return 0;
    for (int r = 0; r < c->size; r++) {
        if (c->peers[r].nccl_state == 2 || c->peers[r].nccl_state != c->peers[0].nccl_state) {
            int bad = c->peers[r].nccl_state == 2 ? r : 0;
            PyErr_Format(PyExc_RuntimeError,
                         "dpmini.distributed.%s (call %lld): GPU collectives are off: rank %d's "
                         "NCCL communicator %s after an earlier NCCL error, timeout or "
                         "interrupt (every rank raises this; host arrays still work)",
                         dist_kind_name(mine->kind), (long long)mine->call, bad,
                         c->peers[bad].nccl_state == 2 ? "was aborted" : "is missing");
            return -1;
        }
    }
    return 0;
}

static int verdict(dist_comm *c, const dist_meta *mine, PyObject **saved)
{
    if (check_magic(c, mine) < 0 || check_same_call(c, mine) < 0 || check_tags(c, mine) < 0 ||
        raise_local_errors(c, mine, saved) < 0 || check_fields(c, mine) < 0 ||
        check_nccl(c, mine) < 0)
        return -1;
    return 0;
}

/* ------------------------------------------------------------------ */
/* The exchange                                                        */
/* ------------------------------------------------------------------ */

/* c->reqs / c->done hold one agreement's requests: [0, P) the records
 * received, [P, 2P) the records sent, [2P, 3P) the data that follows this
 * rank's record. */
#define RECORD_REQS(c) (2 * (c)->size)
#define FOLLOW_REQS(c) ((c)->reqs + 2 * (c)->size)
#define FOLLOW_DONE(c) ((c)->done + 2 * (c)->size)

static void set_broken(dist_comm *c, const char *why)
{
    c->broken = 1;
    snprintf(c->broken_why, sizeof c->broken_why, "%s", why);
}

/* Cancel pending receives, release pending sends (their buffers, c->wire,
 * c->wire_out and the follow data's c->follow_keep, are kept alive for
 * good once the comm is broken). */
static void abandon(dist_comm *c)
{
    for (int i = 0; i < 3 * c->size; i++) {
        if (c->done[i] || c->reqs[i] == MPI_REQUEST_NULL)
            continue;
        if (i < c->size)
            MPI_Cancel(&c->reqs[i]);
        MPI_Request_free(&c->reqs[i]);
    }
    Py_XINCREF(c->follow_keep);   /* MPI may still read it: never freed */
    c->follow_keep = NULL;
}

/* The agreement's buffers, made at the first call: P receive slots of
 * c->wire_stride bytes (a record, then a fused payload when P is small
 * enough for DIST_FUSE_BYTES per rank) and one send buffer. */
static int wire_buffers(dist_comm *c)
{
    if (c->wire != NULL)
        return 0;
    size_t stride = sizeof(dist_meta) + (c->size <= DIST_FUSE_RANKS ? DIST_FUSE_BYTES : 0);
    c->wire = PyMem_Malloc(stride * (size_t)c->size);
    c->wire_out = PyMem_Malloc(stride);
    if (c->wire == NULL || c->wire_out == NULL) {
        PyMem_Free(c->wire);
        PyMem_Free(c->wire_out);
        c->wire = c->wire_out = NULL;
        PyErr_NoMemory();
        return -1;
    }
    c->wire_stride = stride;
    return 0;
}

int64_t dist_fuse_limit(const dist_comm *c)
{
    return c->size <= DIST_FUSE_RANKS ? DIST_FUSE_BYTES : -1;
}

const char *dist_fused_payload(const dist_comm *c, int r)
{
    return c->wire + (size_t)r * c->wire_stride + sizeof(dist_meta);
}

int dist_follows_to(const dist_meta *m, int r, int to)
{
    return r != to && (m->follow_to == -1 || m->follow_to == to);
}

/* This rank's record (and fused payload) into c->wire_out and c->peers. */
static void stage_record(dist_comm *c, dist_meta *mine, const dist_send *s)
{
    int64_t len = s->fused_len;
    if (s->fused == NULL || len < 0 || len > dist_fuse_limit(c) || mine->err[0])
        len = -1;
    mine->magic = DIST_MAGIC;
    mine->call = ++c->calls;
    mine->nccl_state = c->nccl_broken[0] ? 2 : c->nccl != NULL ? 1 : 0;
    mine->fused_len = len;
    mine->fused_to = s->fused_to;
    mine->follow_to = mine->err[0] || s->piece == NULL ? -2 : s->follow_to;
    c->peers[c->rank] = *mine;
    memcpy(c->wire_out, mine, sizeof(dist_meta));
    if (len > 0)
        memcpy(c->wire_out + sizeof(dist_meta), s->fused, (size_t)len);
}

/* Post the record receives, the record sends, then the follow sends. */
static int post_exchange(dist_comm *c, const dist_meta *mine, const dist_send *s)
{
    int P = c->size, me = c->rank, rc = MPI_SUCCESS;
    for (int i = 0; i < 3 * P; i++) {
        c->reqs[i] = MPI_REQUEST_NULL;
        c->done[i] = 1;
    }
    for (int r = 0; r < P && rc == MPI_SUCCESS; r++) {
        if (r == me)
            continue;
        rc = MPI_Irecv(c->wire + (size_t)r * c->wire_stride, (int)c->wire_stride, MPI_BYTE, r,
                       DIST_TAG_META, c->comm, &c->reqs[r]);
        c->done[r] = rc != MPI_SUCCESS;
    }
    int64_t len = mine->fused_len;
    for (int r = 0; r < P && rc == MPI_SUCCESS; r++) {
        if (r == me)
            continue;
        int64_t n = sizeof(dist_meta) + (len > 0 && (mine->fused_to < 0 || mine->fused_to == r)
                                         ? len : 0);
        rc = MPI_Isend(c->wire_out, (int)n, MPI_BYTE, r, DIST_TAG_META, c->comm, &c->reqs[P + r]);
        c->done[P + r] = rc != MPI_SUCCESS;
    }
    for (int r = 0; r < P && rc == MPI_SUCCESS; r++) {
        if (!dist_follows_to(mine, me, r))
            continue;
        const dist_piece *p = &s->piece[s->each ? r : 0];
        rc = MPI_Isend(p->buf, p->count, p->type, r, DIST_TAG_FOLLOW, c->comm,
                       &FOLLOW_REQS(c)[r]);
        FOLLOW_DONE(c)[r] = rc != MPI_SUCCESS;
    }
    return rc == MPI_SUCCESS ? 0 : dist_mpi_error(rc, "posting the agreement messages");
}

/* TimeoutError naming the ranks whose record did not arrive (or, when
 * every record arrived, those that did not take this rank's). */
static void raise_timeout(const dist_comm *c, const dist_meta *mine)
{
    int P = c->size, me = c->rank;
    int *miss = PyMem_Malloc(sizeof(int) * (size_t)P);
    if (miss == NULL) {
        PyErr_NoMemory();
        return;
    }
    int nmiss = 0;
    for (int r = 0; r < P; r++)
        nmiss += miss[r] = (r != me && !c->done[r]);
    if (nmiss == 0)
        for (int r = 0; r < P; r++)
            nmiss += miss[r] = (r != me && !c->done[P + r]);
    char ranks[160], secs[32];
    rank_list(miss, P, 1, ranks, sizeof ranks);
    snprintf(secs, sizeof secs, "%g", c->timeout);
    PyErr_Format(PyExc_TimeoutError,
                 "dpmini.distributed.%s (call %lld on rank %d): rank%s %s did not "
                 "arrive within the timeout of %s s (a rank skipped this call, is "
                 "still busy, or has exited); this communicator cannot be used again",
                 dist_kind_name(mine->kind), (long long)mine->call, me,
                 nmiss == 1 ? "" : "s", ranks, secs);
    PyMem_Free(miss);
}

/* Wait for the records; on a timeout or an error the exchange is
 * abandoned and the communicator marked broken. */
static int wait_records(dist_comm *c, const dist_meta *mine, double deadline)
{
    int st = dist_poll(c->reqs, RECORD_REQS(c), c->done, deadline);
    if (st == 0)
        return 0;
    char why[160];
    snprintf(why, sizeof why, "%s in %s call %lld", st == 1 ? "a TimeoutError" : "an error",
             dist_kind_name(mine->kind), (long long)mine->call);
    if (st == 1)
        raise_timeout(c, mine);   /* from the requests still pending */
    abandon(c);
    set_broken(c, why);
    return -1;
}

static void read_records(dist_comm *c)
{
    for (int r = 0; r < c->size; r++)
        if (r != c->rank)
            memcpy(&c->peers[r], c->wire + (size_t)r * c->wire_stride, sizeof(dist_meta));
}

int dist_agree(dist_comm *c, dist_meta *mine, PyObject **saved, double deadline)
{
    dist_send s = DIST_SEND_NONE;
    return dist_agree_send(c, mine, saved, deadline, &s);
}

int dist_agree_fused(dist_comm *c, dist_meta *mine, PyObject **saved, double deadline,
                     const void *payload, int64_t len, int to)
{
    dist_send s = DIST_SEND_NONE;
    s.fused = payload;
    s.fused_len = len;
    s.fused_to = to;
    return dist_agree_send(c, mine, saved, deadline, &s);
}

int dist_agree_send(dist_comm *c, dist_meta *mine, PyObject **saved, double deadline,
                    const dist_send *s)
{
    int v = -1;
    if (wire_buffers(c) < 0)
        goto out;
    stage_record(c, mine, s);
    c->follow_keep = mine->follow_to != -2 ? s->keep : NULL;
    if (post_exchange(c, mine, s) < 0) {
        abandon(c);
        set_broken(c, "an MPI error posting the agreement messages");
        goto out;
    }
    if (wait_records(c, mine, deadline) < 0)
        goto out;
    read_records(c);
    v = verdict(c, mine, saved);
    if (v < 0)
        dist_follow_drain(c, deadline);
out:
    Py_CLEAR(*saved);
    return v;
}

int dist_follow_take(dist_comm *c, MPI_Request *reqs, int *done)
{
    int n = 0;
    for (int r = 0; r < c->size; r++) {
        if (FOLLOW_DONE(c)[r])
            continue;
        reqs[n] = FOLLOW_REQS(c)[r];
        done[n++] = 0;
        FOLLOW_REQS(c)[r] = MPI_REQUEST_NULL;
        FOLLOW_DONE(c)[r] = 1;
    }
    c->follow_keep = NULL;
    return n;
}

/* Wait (GIL released, signals checked) until rank src's follow message
 * can be received: 0 matched (*msg, *st), 1 deadline, -1 exception set. */
static int probe_follow(dist_comm *c, int src, double deadline, MPI_Message *msg,
                        MPI_Status *st)
{
    int flag = 0, pause = 0, rc;
    double start = dist_now(), next_signals = start + 0.05;
    PyThreadState *ts = PyEval_SaveThread();
    while ((rc = MPI_Improbe(src, DIST_TAG_FOLLOW, c->comm, &flag, msg, st)) == MPI_SUCCESS &&
           !flag && (pause = dist_poll_pause(&ts, deadline, start, &next_signals)) == 0)
        ;
    PyEval_RestoreThread(ts);
    if (rc != MPI_SUCCESS)
        return dist_mpi_error(rc, "MPI_Improbe");
    return flag ? 0 : pause > 0 ? 1 : -1;
}

/* Receive rank src's follow message into scratch memory (leaked if MPI
 * may still write it). 0, 1 deadline, -1 exception set. */
static int discard_follow(dist_comm *c, int src, double deadline)
{
    MPI_Message msg;
    MPI_Status st;
    int n = 0, done = 0, rc = probe_follow(c, src, deadline, &msg, &st);
    if (rc != 0)
        return rc;
    MPI_Get_count(&st, MPI_BYTE, &n);
    char *buf = PyMem_RawMalloc(n > 0 ? (size_t)n : 1);
    if (buf == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    MPI_Request req = MPI_REQUEST_NULL;
    rc = MPI_Imrecv(buf, n, MPI_BYTE, &msg, &req);
    if (rc != MPI_SUCCESS) {
        PyMem_RawFree(buf);
        return dist_mpi_error(rc, "MPI_Imrecv");
    }
    int w = dist_poll(&req, 1, &done, deadline);
    if (w == 0)
        PyMem_RawFree(buf);
    else
        MPI_Request_free(&req);
    return w;
}

void dist_follow_drain(dist_comm *c, double deadline)
{
    PyObject *type, *value, *tb;
    PyErr_Fetch(&type, &value, &tb);
    int st = 0;
    for (int r = 0; r < c->size && st == 0; r++)
        if (dist_follows_to(&c->peers[r], r, c->rank))
            st = discard_follow(c, r, deadline);
    if (st == 0)
        st = dist_poll(FOLLOW_REQS(c), c->size, FOLLOW_DONE(c), deadline);
    if (st != 0) {
        abandon(c);
        set_broken(c, "a TimeoutError taking the data of a call the ranks disagreed on");
    }
    c->follow_keep = NULL;
    PyErr_Clear();
    PyErr_Restore(type, value, tb);
}
