/* profile_py.c - the Python face of the span recorder (core/profile.h):
 * the private functions dpmini/_profile.py builds dpmini.profile() on.
 *
 * A session is held by a capsule; the thread that starts it records its
 * calls into it until it stops it. Events come back as tuples in the order
 * of PROFILE_FIELDS in dpmini/_profile.py.
 */
#include "dpmini.h"
#include "profile.h"
#include "copy_limit.h"
#include "copy.h"

#define SESSION_CAPSULE "dpmini._profile_session"
/* The most events a session may hold: 2**26 events of ~80 bytes is 5 GiB. */
#define MAX_CAPACITY ((Py_ssize_t)1 << 26)

static void session_capsule_free(PyObject *cap)
{
    dp_prof_session_release(PyCapsule_GetPointer(cap, SESSION_CAPSULE));
}

static dp_prof_session *session_of(PyObject *cap)
{
    return PyCapsule_GetPointer(cap, SESSION_CAPSULE);
}

/* _profile_start(capacity) -> session: a new session made the calling
 * thread's; RuntimeError when the thread already records into one. */
static PyObject *profile_start(PyObject *mod, PyObject *arg)
{
    Py_ssize_t cap = PyNumber_AsSsize_t(arg, PyExc_OverflowError);
    if (cap == -1 && PyErr_Occurred()) {
        return NULL;
    }
    if (cap < 1 || cap > MAX_CAPACITY) {
        PyErr_Format(PyExc_ValueError, "max_events: expected an int in [1, %zd], got %zd",
                     MAX_CAPACITY, cap);
        return NULL;
    }
    if (dp_prof_current().s != NULL) {
        PyErr_SetString(PyExc_RuntimeError,
                        "_profile_start: this thread already records into a session");
        return NULL;
    }
    dp_prof_session *s = dp_prof_session_new((uint32_t)cap);
    if (s == NULL) {
        return PyErr_NoMemory();
    }
    PyObject *capsule = PyCapsule_New(s, SESSION_CAPSULE, session_capsule_free);
    if (capsule == NULL) {
        dp_prof_session_release(s);
        return NULL;
    }
    (void)dp_prof_thread_push(s);
    return capsule;
}

/* _profile_stop(session): the calling thread stops recording into it. */
static PyObject *profile_stop(PyObject *mod, PyObject *cap)
{
    dp_prof_session *s = session_of(cap);
    if (s == NULL) {
        return NULL;
    }
    if (dp_prof_current().s == s) {
        dp_prof_thread_pop(NULL);
    }
    Py_RETURN_NONE;
}

/* _profile_counts(session) -> (slots taken, spans dropped) */
static PyObject *profile_counts(PyObject *mod, PyObject *cap)
{
    dp_prof_session *s = session_of(cap);
    if (s == NULL) {
        return NULL;
    }
    return Py_BuildValue("(IK)", dp_prof_session_count(s),
                         (unsigned long long)dp_prof_session_dropped(s));
}

static PyObject *event_tuple(const dp_prof_event *e)
{
    char label[DP_PROF_LABEL];
    memcpy(label, e->label, DP_PROF_LABEL);
    label[DP_PROF_LABEL - 1] = '\0';
    return Py_BuildValue("(KKKKIiiiiiiis)", (unsigned long long)e->start_ns,
                         (unsigned long long)e->end_ns, (unsigned long long)e->bytes,
                         (unsigned long long)e->thread, e->call, (int)e->kind, (int)e->phase,
                         (int)e->dev_kind, (int)e->dev_index, (int)e->path, (int)e->strided,
                         (int)e->root, label);
}

/* _profile_events(session, start, stop) -> list of event tuples of the
 * written slots in [start, stop). */
static PyObject *profile_events(PyObject *mod, PyObject *args)
{
    PyObject *cap;
    Py_ssize_t start, stop;
    if (!PyArg_ParseTuple(args, "Onn:_profile_events", &cap, &start, &stop)) {
        return NULL;
    }
    dp_prof_session *s = session_of(cap);
    if (s == NULL) {
        return NULL;
    }
    Py_ssize_t n = (Py_ssize_t)dp_prof_session_count(s);
    start = start < 0 ? 0 : start;
    stop = stop > n ? n : stop;
    const dp_prof_event *ev = dp_prof_session_events(s);
    PyObject *out = PyList_New(0);
    for (Py_ssize_t i = start; out != NULL && i < stop; i++) {
        if (!__atomic_load_n(&ev[i].ready, __ATOMIC_ACQUIRE)) {
            continue;
        }
        PyObject *t = event_tuple(&ev[i]);
        if (t == NULL || PyList_Append(out, t) < 0) {
            Py_CLEAR(out);
        }
        Py_XDECREF(t);
    }
    return out;
}

/* _profile_record(label, start_ns, end_ns, device=None, bytes=0) -> bool:
 * a span recorded from Python into the calling thread's session, in its
 * current call and phase; False (nothing recorded) outside a session. */
static PyObject *profile_record(PyObject *mod, PyObject *args, PyObject *kwargs)
{
    static char *kwlist[] = {"label", "start_ns", "end_ns", "device", "bytes", NULL};
    const char *label;
    unsigned long long t0, t1, bytes = 0;
    PyObject *devobj = Py_None;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "sKK|OK:_profile_record", kwlist, &label,
                                     &t0, &t1, &devobj, &bytes)) {
        return NULL;
    }
    if (t1 < t0) {
        PyErr_Format(PyExc_ValueError, "end_ns: expected >= start_ns (%llu), got %llu", t0, t1);
        return NULL;
    }
    dp_device dev = {DP_HOST, -1};
    int has_dev = devobj != Py_None;
    if (has_dev && dp_device_from_object(dp_state_from_module(mod), devobj, "device",
                                         DP_DEV_ALLOW_HOST, &dev) < 0) {
        return NULL;
    }
    dp_prof_ctx c = dp_prof_current();
    if (c.s == NULL) {
        Py_RETURN_FALSE;
    }
    dp_prof_record_span(&c, DP_PROF_USER, has_dev ? dev.kind : -1, has_dev ? dev.index : -1,
                        t0, t1, bytes, DP_PROF_PATH_NONE, 0, label);
    Py_RETURN_TRUE;
}

/* The phase kinds Python may open (dpmini._profile.phase). */
static int phase_kind(long kind)
{
    return kind >= DP_PROF_CALL && kind <= DP_PROF_REDUCE;
}

/* _profile_begin(kind) -> token: open a phase span (a call when the thread
 * has none open) on the calling thread; pass the token to _profile_end. */
static PyObject *profile_begin(PyObject *mod, PyObject *arg)
{
    long kind = PyLong_AsLong(arg);
    if (kind == -1 && PyErr_Occurred()) {
        return NULL;
    }
    if (!phase_kind(kind)) {
        PyErr_Format(PyExc_ValueError, "kind: expected a phase kind in [%d, %d], got %ld",
                     DP_PROF_CALL, DP_PROF_REDUCE, kind);
        return NULL;
    }
    dp_prof_span sp;
    dp_prof_begin(&sp, (int)kind);
    return PyBytes_FromStringAndSize((const char *)&sp, sizeof sp);
}

/* _profile_end(token, label) -> None: close the span _profile_begin opened. */
static PyObject *profile_end(PyObject *mod, PyObject *args)
{
    PyObject *token;
    const char *label;
    if (!PyArg_ParseTuple(args, "Sz:_profile_end", &token, &label)) {
        return NULL;
    }
    if (PyBytes_GET_SIZE(token) != (Py_ssize_t)sizeof(dp_prof_span)) {
        PyErr_SetString(PyExc_ValueError, "token: expected what _profile_begin returned");
        return NULL;
    }
    dp_prof_span sp;
    memcpy(&sp, PyBytes_AS_STRING(token), sizeof sp);
    dp_prof_end(&sp, label);
    Py_RETURN_NONE;
}

/* _copy_limit_seconds(bytes, threads, streaming, repeat) -> float: the
 * best time of `threads` threads copying `bytes` in all with memcpy
 * (streaming False) or streaming stores (True); GIL released. */
static PyObject *copy_limit_seconds(PyObject *mod, PyObject *args)
{
    unsigned long long bytes;
    int threads, streaming, repeat;
    if (!PyArg_ParseTuple(args, "Kipi:_copy_limit_seconds", &bytes, &threads, &streaming,
                          &repeat)) {
        return NULL;
    }
    if (bytes == 0 || threads < 1 || threads > 64 || repeat < 1) {
        PyErr_Format(PyExc_ValueError, "_copy_limit_seconds: expected bytes >= 1, threads in "
                     "[1, 64] and repeat >= 1, got %llu, %d, %d", bytes, threads, repeat);
        return NULL;
    }
    double s = 0;
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = dp_copy_limit_time(bytes, threads, streaming ? DP_COPY_STREAM : DP_COPY_ORDINARY,
                            repeat, &s);
    Py_END_ALLOW_THREADS
    if (rc < 0) {
        return PyErr_Format(PyExc_MemoryError, "_copy_limit_seconds: cannot allocate 2 x %llu "
                            "bytes or start %d threads", bytes, threads);
    }
    return PyFloat_FromDouble(s);
}

/* _profile_now() -> int: the recorder's clock (CLOCK_MONOTONIC, ns). */
static PyObject *profile_now(PyObject *mod, PyObject *unused)
{
    return PyLong_FromUnsignedLongLong(dp_prof_now());
}

/* _profile_recording() -> bool: does the calling thread record? */
static PyObject *profile_recording(PyObject *mod, PyObject *unused)
{
    return PyBool_FromLong(dp_prof_current().s != NULL);
}

PyMethodDef dp_profile_methods[] = {
    {"_profile_start", profile_start, METH_O,
     "_profile_start($module, capacity, /)\n--\n\nStart recording the calling thread's calls "
     "into a new session of `capacity` events (private; dpmini.profile uses it)."},
    {"_profile_stop", profile_stop, METH_O,
     "_profile_stop($module, session, /)\n--\n\nStop the calling thread's recording into session "
     "(private)."},
    {"_profile_counts", profile_counts, METH_O,
     "_profile_counts($module, session, /)\n--\n\nEvents recorded and spans dropped "
     "(private)."},
    {"_profile_events", profile_events, METH_VARARGS,
     "_profile_events($module, session, start, stop, /)\n--\n\nThe event tuples of slots "
     "[start, stop) (private)."},
    {"_profile_record", (PyCFunction)(void (*)(void))profile_record,
     METH_VARARGS | METH_KEYWORDS,
     "_profile_record($module, label, start_ns, end_ns, device=None, bytes=0)\n--\n\n"
     "Record a span from Python into the calling thread's session (private; "
     "dpmini._profile.span uses it)."},
    {"_profile_begin", profile_begin, METH_O,
     "_profile_begin($module, kind, /)\n--\n\nOpen a phase span on the calling thread "
     "(private; dpmini._profile.phase uses it)."},
    {"_profile_end", profile_end, METH_VARARGS,
     "_profile_end($module, token, label, /)\n--\n\nClose the span _profile_begin opened "
     "(private)."},
    {"_copy_limit_seconds", copy_limit_seconds, METH_VARARGS,
     "_copy_limit_seconds($module, bytes, threads, streaming, repeat, /)\n--\n\nBest time "
     "(s) of `threads` threads copying `bytes` in all with memcpy or streaming stores "
     "(private; dpmini._profile.copy_limit uses it)."},
    {"_profile_now", profile_now, METH_NOARGS,
     "_profile_now($module, /)\n--\n\nThe recorder's clock, CLOCK_MONOTONIC nanoseconds "
     "(private)."},
    {"_profile_recording", profile_recording, METH_NOARGS,
     "_profile_recording($module, /)\n--\n\nWhether the calling thread records (private)."},
    {NULL, NULL, 0, NULL},
};
