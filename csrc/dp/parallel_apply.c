/* parallel_apply.c - parallel_apply: call replica i on the worker thread of
 * its device (docs/spec.md 6), for DataParallel.forward / .parallel_apply and the
 * module-level dpmini.parallel_apply; wraps a replica's exception as
 * "Caught T in replica i on device d." (docs/spec.md 6.5).
 *
 * parallel_apply: replica i runs on a persistent worker thread of its device
 * (a device has more than one when its jobs overlap, pool.h),
 * which takes the GIL and enters a copy of the caller's contextvars context
 * and the replica contexts that libraries registered (torch's grad mode,
 * autocast, streams: docs/spec.md 6.2; dpmini.register_replica_context). The
 * caller waits with the GIL released, in 50 ms slices so that Ctrl-C still works.
 *
 * Ctrl-C: the caller sends the KeyboardInterrupt to the running replicas
 * and waits DP_GRACE_MS more for them. A replica blocked in a C call (a
 * lock, time.sleep, a socket) sees it only when it returns to bytecode, so
 * after the grace (or at a second Ctrl-C) the caller raises anyway and
 * leaves those jobs to their workers: the jobs and the batch live in one
 * heap block (apply_run) that the last worker frees, each abandoned job
 * drops its own references when its replica returns, and its result is
 * discarded (docs/reliability.md).
 *
 * While two or more replicas run on virtual CPU devices, the caller's
 * OpenMP team can be parked (omp_team.h; torch asks for it): its idle
 * threads sleep instead of spinning on the cores the replicas need.
 *
 * Sections: types; a replica's exception; the replica contexts; the run
 * (the memory the workers share) and the chain that wakes them; the worker;
 * running a batch; arguments and devices; public functions (parallel_apply,
 * register_replica_context / unregister_replica_context).
 */
#include "dpmini.h"
#include "dataparallel.h"
#include "dp.h"
#include "pool.h"
#include "profile.h"
#include "cuda_api.h"
#include "omp_team.h"

#include <errno.h>
#include <string.h>

/* ------------------------------------------------------------------ */
/* Types                                                               */
/* ------------------------------------------------------------------ */

#define DP_WAIT_SLICE_MS 50              /* signal checks while waiting  */
#define DP_GRACE_MS 1000                 /* after Ctrl-C, wait this long for
                                            the replicas before giving up */
#define DP_GRACE_SLICES (DP_GRACE_MS / DP_WAIT_SLICE_MS)
#define DP_SMALL_JOBS 8                  /* replicas without heap memory */

/* One replica call of parallel_apply. Owned by the caller (on its stack or
 * PyMem); run_jobs moves it into heap memory shared with the workers while
 * they run it, and back when they are done (or leaves it to a worker whose
 * replica ignores Ctrl-C: `abandoned`). */
enum {
    JOB_QUEUED = 0,   /* not started, or entering its contexts: a Ctrl-C cancels it */
    JOB_RUNNING = 1,  /* the replica runs: a Ctrl-C is raised in its thread     */
    JOB_LEAVING = 2,  /* the replica returned; its contexts are being left      */
    JOB_DONE = 3,
};

typedef struct apply_run apply_run;

typedef struct {
    PyObject *module;      /* owned: the replica to call                      */
    PyObject *args;        /* owned: exact tuple of positional arguments      */
    PyObject *kwargs;      /* owned: exact dict, or NULL                      */
    PyObject *ctx;         /* owned: copy of the caller's context (worker jobs) */
    PyObject *result;      /* owned: the return value, once the job succeeded */
    PyObject *exc;         /* owned: the exception raised (traceback attached) */
    dp_device dev;         /* the replica's device                            */
    unsigned long ident;   /* thread running it; valid while JOB_RUNNING      */
    int state;             /* JOB_*; read and written with the GIL held       */
    int on_worker;         /* 1: submitted to the device worker; 0: inline    */
    int cancelled;         /* caller (GIL held): skip the call if not started */
    int interrupted;       /* caller (GIL held): an async exception was sent  */
    int no_tstate;         /* worker: no Python thread state could be made    */
    int abandoned;         /* caller (GIL held): gave up waiting (Ctrl-C); the
                              worker drops the job's references when it ends */
    PyInterpreterState *interp; /* the caller's interpreter (worker jobs)     */
    Py_ssize_t index;      /* the replica's position in the call              */
    PyObject *ctx_enters;  /* owned: tuple of the replica context enters of
                              the call (worker jobs), or NULL: none           */
    PyObject *ctx_device;  /* owned: the replica's dpmini.Device, with ctx_enters */
    PyObject *ctx_exits;   /* owned: tuple of the exits enter returned (None
                              entries), while the contexts are entered        */
    PyObject *numpy_handler; /* owned: NumPy's allocator in the worker's call
                              (numpy_allocator.c; None: NumPy's own), or NULL */
    int chained;           /* a worker job on a virtual CPU device: queued
                              quiet, its worker woken in a chain, and it may
                              run on another chained job's worker (claimed) */
    int claimed;           /* atomic: 1 once a thread has taken the job to run
                              (its own worker, or one that finished its own
                              while this job's worker was not woken yet)   */
    apply_run *run;        /* the call's run (worker jobs)                    */
    dp_prof_ctx prof;      /* the call's recording context (profile.h)       */
    uint64_t queued_ns;    /* when it was queued for its worker (profiling)  */
} apply_job;

/* The jobs of one call and their batch, in memory that outlives the call
 * when the caller gives up on a stuck replica (PyMem_Raw: the last worker
 * frees it without the GIL). The chained jobs (pool nodes[i] for job i,
 * in the same block) are woken in chain order: chain[p] is the job at
 * position p, next_wake the position the next wake looks at, claim_from a
 * position before which every chained job is claimed (a hint). */
struct apply_run {
    dp_batch batch;
    dp_job_node *nodes;
    Py_ssize_t *chain;
    Py_ssize_t nchain;
    Py_ssize_t next_wake;   /* atomic */
    Py_ssize_t claim_from;  /* atomic; written with the GIL held */
    dp_prof_session *prof_hold; /* keeps the jobs' profile session alive while
                                   workers may record into it, or NULL */
    apply_job jobs[];
};

/* A new thread state for the calling thread, bound as its GILState state;
 * NULL when out of memory. CPython 3.11's PyThreadState_New dereferences
 * the state it failed to allocate (its _PyThreadState_SetCurrent has no NULL
 * check), so there it is the same two steps with the check; 3.10 and 3.12+
 * check themselves. */
#if PY_VERSION_HEX >= 0x030B0000 && PY_VERSION_HEX < 0x030C0000
PyAPI_FUNC(void) _PyThreadState_SetCurrent(PyThreadState *tstate); /* exported, internal header */
static PyThreadState *new_thread_state(PyInterpreterState *interp)
{
    PyThreadState *ts = _PyThreadState_Prealloc(interp);
    if (ts != NULL) {
        _PyThreadState_SetCurrent(ts);
    }
    return ts;
}
#else
#define new_thread_state(interp) PyThreadState_New(interp)
#endif

#if PY_VERSION_HEX >= 0x030D0000
#define DP_IS_FINALIZING() Py_IsFinalizing()
#else
#define DP_IS_FINALIZING() _Py_IsFinalizing()
#endif

/* Per worker thread, in the pool's worker-local ints (pool.h; no
 * _Thread_local, see there): WL_PINNED, the worker keeps its Python thread
 * state between jobs; WL_DEPTH, replicas running in this thread (a replica
 * running on a worker runs nested parallel_apply calls inline). */
enum { WL_PINNED = 0, WL_DEPTH = 1 };

/* Replicas running in the calling thread (0 on threads that are not workers). */
static int replica_depth(void)
{
    int *wl = dp_pool_worker_local();
    return wl != NULL ? wl[WL_DEPTH] : 0;
}

/* ------------------------------------------------------------------ */
/* A replica's exception                                               */
/* ------------------------------------------------------------------ */

/* The exception being raised, as an instance with its traceback attached
 * (new reference); the error indicator is cleared. Never NULL. */
static PyObject *replica_take_exception(void)
{
    PyObject *exc;
    if (!PyErr_Occurred()) {
        PyErr_SetString(PyExc_SystemError, "a replica failed without setting an exception");
    }
#if PY_VERSION_HEX >= 0x030C0000
    exc = PyErr_GetRaisedException();
#else
    PyObject *type, *tb;
    PyErr_Fetch(&type, &exc, &tb);
    PyErr_NormalizeException(&type, &exc, &tb);
    if (exc != NULL && tb != NULL) {
        PyException_SetTraceback(exc, tb);
    }
    Py_XDECREF(type);
    Py_XDECREF(tb);
    if (exc == NULL) {
        exc = PyObject_CallNoArgs(PyExc_SystemError);
        if (exc == NULL) {   /* out of memory: keep whatever that raised */
            return replica_take_exception();
        }
    }
#endif
    return exc;
}

/* Raise exc again (steals the reference). */
static void restore_exception(PyObject *exc)
{
#if PY_VERSION_HEX >= 0x030C0000
    PyErr_SetRaisedException(exc);
#else
    PyErr_Restore(Py_NewRef((PyObject *)Py_TYPE(exc)), exc, PyException_GetTraceback(exc));
#endif
}

/* msg as a str whose repr() is itself, so that str(KeyError(m)) shows the
 * text unquoted (PyTorch's KeyErrorMessage, docs/spec.md 6.5): an instance of the
 * module's dpmini._dpmini._KeyErrorMessage, which pickles by name. Falls
 * back to msg. */
static PyObject *keyerror_message(dp_state *st, PyObject *msg)
{
    PyObject *res = PyObject_CallOneArg(st->KeyErrorMessage, msg);
    if (res == NULL) {
        PyErr_Clear();
        res = Py_NewRef(msg);
    }
    return res;
}

/* exc's traceback as text, as traceback.format_exception prints it; when
 * that fails, "T: str(exc)\n". New str, or NULL with an exception. */
static PyObject *replica_traceback_text(dp_state *st, PyObject *exc)
{
    PyObject *tp = (PyObject *)Py_TYPE(exc), *text = NULL;
    PyObject *tb = PyException_GetTraceback(exc);
    PyObject *lines = PyObject_CallFunctionObjArgs(st->format_exception, tp, exc,
                                                   tb ? tb : Py_None, NULL);
    PyObject *empty = PyUnicode_FromStringAndSize(NULL, 0);
    if (lines != NULL && empty != NULL) {
        text = PyUnicode_Join(empty, lines);
    }
    Py_XDECREF(tb);
    Py_XDECREF(lines);
    Py_XDECREF(empty);
    if (text == NULL) {   /* formatting failed: fall back to str(exc) */
        PyErr_Clear();
        text = PyUnicode_FromFormat("%s: %S\n", ((PyTypeObject *)tp)->tp_name, exc);
    }
    return text;
}

/* "Caught T in replica i on device d.\nOriginal Traceback (most recent call
 * last):\n..." for exc (docs/spec.md 6.5). New str, or NULL with an
 * exception. */
static PyObject *replica_error_message(dp_state *st, PyObject *exc, Py_ssize_t i, dp_device dev)
{
    char devbuf[32];
    dp_device_format(dev, devbuf, sizeof devbuf);
    PyObject *text = replica_traceback_text(st, exc), *msg = NULL;
    PyObject *name = text != NULL ? PyObject_GetAttrString((PyObject *)Py_TYPE(exc), "__name__")
                                  : NULL;
    PyObject *prefix = name != NULL ? PyUnicode_FromString("Traceback (most recent call last):\n")
                                    : NULL;
    Py_ssize_t starts = prefix != NULL ? PyUnicode_Tailmatch(text, prefix, 0, PY_SSIZE_T_MAX, -1)
                                       : -1;
    if (starts > 0) {
        msg = PyUnicode_FromFormat("Caught %U in replica %zd on device %s.\nOriginal %U",
                                   name, i, devbuf, text);
    } else if (starts == 0) {   /* no Python frame (e.g. a builtin replica): keep the shape */
        msg = PyUnicode_FromFormat("Caught %U in replica %zd on device %s.\nOriginal %U%U",
                                   name, i, devbuf, prefix, text);
    }
    Py_XDECREF(text);
    Py_XDECREF(name);
    Py_XDECREF(prefix);
    return msg;
}

/* The exception that replaces a replica's exception of type tp: tp built
 * from msg (a KeyError's message shown unquoted; a type whose `message`
 * attribute is true is built as tp(message=msg)), or RuntimeError(msg) when
 * tp cannot be built from one string. New reference, or NULL with an
 * exception that is not an Exception (a KeyboardInterrupt meanwhile) or
 * that RuntimeError(msg) raised. */
static PyObject *replica_error_instance(dp_state *st, PyObject *tp, PyObject *msg)
{
    PyObject *wrapped = NULL;
    PyObject *arg = tp == PyExc_KeyError ? keyerror_message(st, msg) : Py_NewRef(msg);
    PyObject *attr = PyObject_GetAttrString(tp, "message");
    if (attr == NULL) {
        PyErr_Clear();
    }
    if (attr != NULL && PyObject_IsTrue(attr) == 1) {
        PyObject *noargs = PyTuple_New(0);
        PyObject *kw = Py_BuildValue("{sO}", "message", arg);
        if (noargs != NULL && kw != NULL) {
            wrapped = PyObject_Call(tp, noargs, kw);
        }
        Py_XDECREF(noargs);
        Py_XDECREF(kw);
    } else {
        PyErr_Clear();
        wrapped = PyObject_CallOneArg(tp, arg);
    }
    Py_XDECREF(attr);
    Py_DECREF(arg);
    if (wrapped != NULL && !PyExceptionInstance_Check(wrapped)) {
        Py_CLEAR(wrapped);
    }
    if (wrapped == NULL) {
        if (PyErr_Occurred() && !PyErr_ExceptionMatches(PyExc_Exception)) {
            return NULL;   /* e.g. KeyboardInterrupt while building it: keep it */
        }
        PyErr_Clear();
        wrapped = PyObject_CallOneArg(PyExc_RuntimeError, msg);
    }
    return wrapped;
}

/* Re-raise exc, raised by replica i on dev, as PyTorch's ExceptionWrapper
 * does (docs/spec.md 6.5): same type, message "Caught T in replica i on device d.\n
 * Original Traceback (most recent call last):\n...", the original as
 * __cause__; RuntimeError when the type cannot be built from one string.
 * Exceptions that are not Exception subclasses (KeyboardInterrupt,
 * SystemExit) are re-raised unchanged. */
static void raise_replica_error(dp_state *st, PyObject *exc, Py_ssize_t i, dp_device dev)
{
    if (!PyObject_IsInstance(exc, PyExc_Exception)) {
        restore_exception(Py_NewRef(exc));
        return;
    }
    PyObject *msg = replica_error_message(st, exc, i, dev);
    PyObject *wrapped = msg != NULL ? replica_error_instance(st, (PyObject *)Py_TYPE(exc), msg)
                                    : NULL;
    if (wrapped != NULL) {
        PyException_SetCause(wrapped, Py_NewRef(exc));
        PyErr_SetObject((PyObject *)Py_TYPE(wrapped), wrapped);
        Py_DECREF(wrapped);
    }
    Py_XDECREF(msg);
}

/* ------------------------------------------------------------------ */
/* Replica contexts                                                    */
/* ------------------------------------------------------------------ */

/* Replica contexts: per-thread state of an array library that a replica on
 * a worker thread must see as the caller has it (docs/spec.md 6.2: torch's
 * parallel_apply carries grad mode, autocast and the current stream into
 * each worker). dpmini knows no library here: an adapter registers a
 * provider (dpmini.register_replica_context, the registry at the end of
 * this file), and parallel_apply calls
 *   - contexts_capture once per call, on the caller's thread, before any
 *     replica starts: each provider(devices) returns an enter callable, or
 *     None when it has nothing to carry this call;
 *   - contexts_enter in each worker thread before its replica runs:
 *     enter(i, device) returns an exit callable or None;
 *   - contexts_exit in that thread after the replica returned, raised, or
 *     was skipped after a Ctrl-C, and also when the caller has given up on
 *     it (abandoned): the exits in reverse order.
 * Replicas that run inline on the caller's thread (one replica, nested
 * calls, host devices) need nothing carried and call no provider.
 *
 * The torch adapter (dpmini/_torch.py) is loaded, and registers itself,
 * the first time a call finds torch imported (dp_torch_context_load,
 * interop_torch.c). A call with no provider registered and torch not
 * imported costs one sys.modules lookup.
 */

/* The devices of jobs[0..m) as a tuple of dpmini.Device (new reference). */
static PyObject *device_tuple(dp_state *st, const apply_job *jobs, Py_ssize_t m)
{
    PyObject *devs = PyTuple_New(m);
    for (Py_ssize_t i = 0; devs != NULL && i < m; i++) {
        PyObject *d = dp_device_to_object(st, jobs[i].dev);
        if (d == NULL) {
            Py_CLEAR(devs);
            break;
        }
        PyTuple_SET_ITEM(devs, i, d);
    }
    return devs;
}

/* The pending error of provider(devices), raised again (same type, the
 * original as __cause__) naming the provider. */
static void name_provider_error(PyObject *provider)
{
    if (!PyErr_ExceptionMatches(PyExc_Exception)) {
        return;
    }
    PyObject *t, *v, *tb;
    PyErr_Fetch(&t, &v, &tb);
    PyErr_NormalizeException(&t, &v, &tb);
    PyObject *msg = v != NULL ? PyUnicode_FromFormat(
        "parallel_apply: the replica context provider %R raised %.100s: %S (no replica ran)",
        provider, Py_TYPE(v)->tp_name, v) : NULL;
    PyErr_Restore(t, v, tb);
    dp_reraise_msg(NULL, msg);
}

/* Call every provider with devs; the tuple of the enter callables they
 * returned (new reference), or Py_None when none has anything to carry. A
 * provider's error is raised again naming the provider. */
static PyObject *call_providers(PyObject *providers, PyObject *devs)
{
    Py_ssize_t n = PyTuple_GET_SIZE(providers), got = 0;
    PyObject *enters = PyTuple_New(n);
    if (enters == NULL) {
        return NULL;
    }
    for (Py_ssize_t k = 0; k < n; k++) {
        PyObject *p = PyTuple_GET_ITEM(providers, k);
        PyObject *e = PyObject_CallOneArg(p, devs);
        if (e == NULL) {
            name_provider_error(p);
            Py_DECREF(enters);
            return NULL;
        }
        if (e == Py_None) {
            Py_DECREF(e);
            continue;
        }
        PyTuple_SET_ITEM(enters, got++, e);
    }
    if (got == 0) {
        Py_DECREF(enters);
        return Py_NewRef(Py_None);
    }
    if (got < n) {   /* the slots past got are empty */
        Py_SETREF(enters, PyTuple_GetSlice(enters, 0, got));
    }
    return enters;
}

/* Run exits[0..n) in reverse order (a worker thread, GIL held); None
 * entries are skipped. Returns the first error as an exception instance
 * (new reference; later ones are reported as unraisable), or NULL. */
static PyObject *run_exits(PyObject *exits, Py_ssize_t n)
{
    PyObject *first = NULL;
    for (Py_ssize_t k = n - 1; k >= 0; k--) {
        PyObject *x = PyTuple_GET_ITEM(exits, k);
        if (x == Py_None) {
            continue;
        }
        PyObject *r = PyObject_CallNoArgs(x);
        if (r != NULL) {
            Py_DECREF(r);
        } else if (first == NULL) {
            first = replica_take_exception();
        } else {
            PyErr_WriteUnraisable(x);
        }
    }
    return first;
}

/* Call the registered replica context providers once (the caller's thread,
 * GIL held, before any job is queued) and give each worker job its enters
 * and device; 0, or -1 with the provider's error raised. Loads the torch
 * adapter first when torch is imported. */
static int contexts_capture(dp_state *st, apply_job *jobs, Py_ssize_t m)
{
    if (dp_torch_context_load(st) < 0) {
        return -1;
    }
    PyObject *providers = st->replica_contexts;
    if (providers == NULL || PyTuple_GET_SIZE(providers) == 0) {
        return 0;
    }
    Py_INCREF(providers);   /* a provider may register another meanwhile */
    PyObject *devs = device_tuple(st, jobs, m);
    PyObject *enters = devs != NULL ? call_providers(providers, devs) : NULL;
    Py_DECREF(providers);
    if (enters == NULL) {
        Py_XDECREF(devs);
        return -1;
    }
    if (enters != Py_None) {
        for (Py_ssize_t i = 0; i < m; i++) {
            if (jobs[i].on_worker) {
                jobs[i].ctx_enters = Py_NewRef(enters);
                jobs[i].ctx_device = Py_NewRef(PyTuple_GET_ITEM(devs, i));
            }
        }
    }
    Py_DECREF(enters);
    Py_DECREF(devs);
    return 0;
}

/* In the job's worker thread, before its replica runs: enter(job->index,
 * device) for each enter; 0, or -1 with the error raised (the contexts
 * entered before it are left again). */
static int contexts_enter(apply_job *job)
{
    if (job->ctx_enters == NULL) {
        return 0;
    }
    Py_ssize_t n = PyTuple_GET_SIZE(job->ctx_enters);
    PyObject *exits = PyTuple_New(n), *index = PyLong_FromSsize_t(job->index);
    if (exits == NULL || index == NULL) {
        Py_XDECREF(exits);
        Py_XDECREF(index);
        return -1;
    }
    for (Py_ssize_t k = 0; k < n; k++) {
        PyObject *args[2] = {index, job->ctx_device};
        PyObject *x = PyObject_Vectorcall(PyTuple_GET_ITEM(job->ctx_enters, k), args, 2, NULL);
        if (x == NULL) {
            /* the contexts entered so far are left, in reverse order */
            PyObject *err = replica_take_exception();
            PyObject *later = run_exits(exits, k);
            if (later != NULL) {
                PyErr_SetObject((PyObject *)Py_TYPE(later), later);
                PyErr_WriteUnraisable(PyTuple_GET_ITEM(job->ctx_enters, k));
                Py_DECREF(later);
            }
            for (Py_ssize_t j = k; j < n; j++) {
                PyTuple_SET_ITEM(exits, j, Py_NewRef(Py_None));
            }
            Py_DECREF(exits);
            Py_DECREF(index);
            restore_exception(err);
            return -1;
        }
        PyTuple_SET_ITEM(exits, k, x);
    }
    Py_DECREF(index);
    job->ctx_exits = exits;
    return 0;
}

/* After the replica (returned, raised or was skipped): the exits in reverse
 * order; 0, or -1 with the first error raised (later ones go to
 * sys.unraisablehook). Does nothing when none is entered. */
static int contexts_exit(apply_job *job)
{
    if (job->ctx_exits == NULL) {
        return 0;
    }
    PyObject *exits = job->ctx_exits;
    job->ctx_exits = NULL;
    PyObject *err = run_exits(exits, PyTuple_GET_SIZE(exits));
    Py_DECREF(exits);
    if (err != NULL) {
        restore_exception(err);
        return -1;
    }
    return 0;
}

/* ------------------------------------------------------------------ */
/* The run and the chain                                               */
/* ------------------------------------------------------------------ */

/* pool.c calls this after the last job of an abandoned run (no GIL). */
static void run_free(void *arg)
{
    apply_run *run = arg;
    dp_batch_destroy(&run->batch);
    dp_prof_session_release(run->prof_hold);
    PyMem_RawFree(run);
}

/* The jobs move into a heap apply_run while workers may touch them: NULL
 * with MemoryError, or the run with its batch made. */
static apply_run *run_new(apply_job *jobs, Py_ssize_t m)
{
    size_t n = (size_t)m;
    apply_run *run = NULL;
    if (n <= (PY_SSIZE_T_MAX - sizeof *run) /
                 (sizeof *jobs + sizeof *run->nodes + sizeof *run->chain)) {
        run = PyMem_RawMalloc(sizeof *run +
                              n * (sizeof *jobs + sizeof *run->nodes + sizeof *run->chain));
    }
    if (run == NULL) {
        PyErr_NoMemory();
        return NULL;
    }
    int rc = dp_batch_init(&run->batch);
    if (rc != 0) {
        PyMem_RawFree(run);
        PyErr_Format(PyExc_RuntimeError, "parallel_apply: cannot create a job batch (%s)",
                     strerror(rc));
        return NULL;
    }
    memcpy(run->jobs, jobs, n * sizeof *jobs);
    run->nodes = (dp_job_node *)(void *)&run->jobs[n];   /* sizes: multiples of pointers */
    run->chain = (Py_ssize_t *)(void *)&run->nodes[n];
    run->nchain = run->next_wake = run->claim_from = 0;
    run->prof_hold = NULL;
    for (size_t i = 0; i < n; i++) {
        run->jobs[i].run = run;
        run->jobs[i].chained = 0;
        run->jobs[i].claimed = 0;
    }
    return run;
}

/* Every job has finished: the jobs go back to the caller's array. */
static void run_end(apply_run *run, apply_job *jobs, Py_ssize_t m)
{
    memcpy(jobs, run->jobs, (size_t)m * sizeof *jobs);
    run_free(run);
}

/* Give up waiting (GIL held): the finished jobs go back to the caller's
 * array; each unfinished worker job stays in the run, marked abandoned, and
 * its worker drops its references when the replica returns; the last
 * worker frees the run. The caller's copy of an abandoned job is zeroed, so
 * it owns nothing there. */
static void run_abandon(apply_run *run, apply_job *jobs, Py_ssize_t m)
{
    for (Py_ssize_t i = 0; i < m; i++) {
        apply_job *job = &run->jobs[i];
        if (job->on_worker && job->state != JOB_DONE) {
            job->abandoned = 1;
            memset(&jobs[i], 0, sizeof jobs[i]);
        } else {
            jobs[i] = *job;
        }
    }
    if (dp_batch_abandon(&run->batch, run_free, run)) {
        run_free(run);   /* the last job finished meanwhile */
    }
}

/* Chained jobs (virtual CPU devices). Waking 64 workers that each take the
 * GIL for a replica of a microsecond costs 64 thread wake-ups and 64 GIL
 * hand-offs, most of the call on two cores. So the caller queues these jobs
 * quiet (pool.h) and wakes the first one's worker once it has released the
 * GIL; each woken worker first wakes the next unclaimed job's worker (the
 * chain), then claims its own job and takes the GIL. A worker that has run
 * its own replica, still holding the GIL, claims and runs one by one the
 * chained jobs whose workers have not been woken yet (their pool nodes are
 * withdrawn, so those workers never wake); the chain skips claimed jobs. A
 * call of 64 tiny replicas thus wakes about two workers. No replica waits
 * for another: a worker claims more only after its own replica returned,
 * and the chain reaches every unclaimed job's worker without needing the
 * GIL, so replicas that wait on each other (a barrier) all still run at
 * once. GPU jobs are never chained: they run on their GPU's own worker. */

/* Wake the worker of the next chained job nobody has claimed (any thread,
 * no GIL needed). The caller calls it once to start and each woken worker
 * once, before its replica: so until every chained job is claimed or has
 * its worker woken, one wake is on its way down the chain. */
static void chain_wake(apply_run *run)
{
    for (;;) {
        Py_ssize_t p = __atomic_fetch_add(&run->next_wake, 1, __ATOMIC_RELAXED);
        if (p >= run->nchain) {
            return;
        }
        Py_ssize_t i = run->chain[p];
        if (__atomic_load_n(&run->jobs[i].claimed, __ATOMIC_ACQUIRE)) {
            continue;   /* running or ran: its thread needs no wake */
        }
        if (dp_job_wake(&run->nodes[i]) == DP_NODE_QUIET) {
            return;
        }
        /* withdrawn meanwhile by a worker that claimed it: go on */
    }
}

/* A chained job whose worker has not started, now claimed by the caller
 * (GIL held) and its pool node withdrawn (the caller counts it finished in
 * the batch later, dp_batch_finish); NULL when none is left. While the
 * chain goes on, a job whose worker was woken is left to it: that worker
 * passes the chain on when it starts. */
static apply_job *claim_next(apply_run *run)
{
    Py_ssize_t p = __atomic_load_n(&run->claim_from, __ATOMIC_RELAXED);
    Py_ssize_t first = -1;   /* the first position not claimed yet */
    apply_job *got = NULL;
    /* Once the chain has passed the last job, a woken worker would pass
     * nothing on: its job may be taken too, if it has not started yet. */
    int woken_too = __atomic_load_n(&run->next_wake, __ATOMIC_RELAXED) >= run->nchain;
    for (; p < run->nchain && got == NULL; p++) {
        Py_ssize_t i = run->chain[p];
        if (__atomic_load_n(&run->jobs[i].claimed, __ATOMIC_ACQUIRE)) {
            continue;
        }
        int was = dp_job_withdraw(&run->nodes[i], woken_too);
        if (was == DP_NODE_QUIET || (was == DP_NODE_LOUD && woken_too)) {
            /* nobody else can reach it now: its node is gone */
            __atomic_store_n(&run->jobs[i].claimed, 1, __ATOMIC_RELEASE);
            got = &run->jobs[i];
        } else if (first < 0) {
            first = p;
        }
    }
    __atomic_store_n(&run->claim_from, first >= 0 ? first : p, __ATOMIC_RELAXED);
    return got;
}

/* ------------------------------------------------------------------ */
/* The worker                                                          */
/* ------------------------------------------------------------------ */

/* pool.c calls this in a worker thread that exits (idle, or dp_pool_trim):
 * delete the thread state apply_job_main made for it. Ensure takes the GIL
 * (count 2); the first Release keeps it (count 1), the second drops the
 * count to 0, which clears and deletes the state and releases the GIL.
 * Skipped during and after finalization, when taking the GIL would stop the
 * thread (or there is no interpreter left). */
static void worker_exit(void)
{
    int *wl = dp_pool_worker_local();
    if (wl == NULL || !wl[WL_PINNED]) {
        return;
    }
    wl[WL_PINNED] = 0;
    if (DP_IS_FINALIZING() || !Py_IsInitialized()) {
        return;
    }
    (void)PyGILState_Ensure();
    PyGILState_Release(PyGILState_LOCKED);
    PyGILState_Release(PyGILState_UNLOCKED);
}

/* Drop the references a job owns (GIL held). */
static void job_clear(apply_job *job)
{
    Py_CLEAR(job->module);
    Py_CLEAR(job->args);
    Py_CLEAR(job->kwargs);
    Py_CLEAR(job->ctx);
    Py_CLEAR(job->ctx_enters);
    Py_CLEAR(job->ctx_device);
    Py_CLEAR(job->ctx_exits);
    Py_CLEAR(job->numpy_handler);
    Py_CLEAR(job->result);
    Py_CLEAR(job->exc);
}

static void run_job(apply_job *job, int *wl);

/* Runs on a worker of job->dev (pool.c): takes the GIL, runs the job, and
 * for a chained job the chained jobs nobody has claimed. */
static void apply_job_main(void *arg)
{
    apply_job *job = arg;
    apply_run *run = job->run;
    int chained = job->chained;
    dp_prof_record_since(&job->prof, DP_PROF_WAIT, job->dev.kind, job->dev.index, job->queued_ns,
                         "worker start");
    int *wl = dp_pool_worker_local();
    int unpinned[2] = {1, 0};   /* no worker-local ints (pool.h): plain GILState */
    if (wl == NULL) {
        wl = unpinned;
    }
    if (chained) {
        /* Pass the chain on before anything that can wait. This worker was
         * woken, so no other thread claims its job (claim_next). */
        chain_wake(run);
        __atomic_store_n(&job->claimed, 1, __ATOMIC_RELEASE);
    }
    if (!wl[WL_PINNED]) {
        /* The thread's first job: make its thread state here, where a
         * failure (out of memory) can be reported, rather than inside
         * PyGILState_Ensure, which ends the process with a fatal error. The
         * state is the thread's GILState state with a count of one that is
         * never released, so it outlives the job and the next job does not
         * create and destroy one again. */
        if (new_thread_state(job->interp) == NULL) {
            job->no_tstate = 1;   /* read by the caller after the batch wait */
            return;
        }
        wl[WL_PINNED] = 1;
    }
    unsigned gen = dp_pool_fork_generation();
    uint64_t t_gil = job->prof.s != NULL ? dp_prof_now() : 0;
    PyGILState_STATE g = PyGILState_Ensure();
    dp_prof_record_since(&job->prof, DP_PROF_WAIT, job->dev.kind, job->dev.index, t_gil, "GIL");
    run_job(job, wl);
    /* Not in a child that a replica forked: the parent's replicas are the
     * parent's to run. */
    int withdrawn = 0;
    for (apply_job *next; chained && dp_pool_fork_generation() == gen &&
                          (next = claim_next(run)) != NULL;) {
        withdrawn++;
        run_job(next, wl);
    }
    PyGILState_Release(g);
    if (withdrawn > 0 && dp_pool_fork_generation() == gen) {
        /* the pool still counts this thread's own job: the run stays alive */
        dp_batch_finish(&run->batch, withdrawn);
    }
}

/* The replica's device made current (a GPU: CuPy / PyTorch code in the
 * module then allocates and launches on its device), the caller's
 * contextvars context copy and NumPy allocator entered, then the replica
 * contexts (contexts_enter). 0, or -1 with the error raised and
 * nothing left entered. */
static int enter_replica(apply_job *job)
{
    dpc_status cs = job->dev.kind == DP_CUDA ? dpc_set_device(job->dev.index) : dpc_ok();
    if (cs.code != 0) {
        PyObject *mod = PyImport_ImportModule("dpmini._dpmini");
        if (mod != NULL) {
            dp_gpu_raise(dp_state_from_module(mod), cs, "replica: make the GPU current");
            Py_DECREF(mod);
        }
        return -1;
    }
    if (PyContext_Enter(job->ctx) < 0) {
        return -1;
    }
    if (dp_numpy_allocator_enter(job->numpy_handler) < 0 || contexts_enter(job) < 0) {
        PyObject *e = replica_take_exception();
        (void)PyContext_Exit(job->ctx);
        restore_exception(e);
        return -1;
    }
    return 0;
}

/* Keep the first error of a job: the one pending now becomes its exception
 * when it has none (its result dropped), else it is dropped. */
static void keep_first_error(apply_job *job)
{
    PyObject *e = replica_take_exception();
    if (job->exc == NULL) {
        Py_CLEAR(job->result);
        job->exc = e;
    } else {
        Py_DECREF(e);
    }
}

/* Undo enter_replica: the replica contexts left (an exit's error, when the
 * replica itself did not fail, is its error), then the context copy. */
static void leave_replica(apply_job *job)
{
    if (contexts_exit(job) < 0) {
        if (job->exc != NULL) {
            PyErr_WriteUnraisable(job->module);
        } else {
            keep_first_error(job);
        }
    }
    if (PyContext_Exit(job->ctx) < 0) {
        keep_first_error(job);
    }
}

/* Runs job in a worker thread (GIL held): enters the caller's context copy
 * and the replica contexts, calls the replica, records the outcome, leaves
 * them again. A Ctrl-C reaches the replica only while JOB_RUNNING: one that
 * comes while the contexts are entered cancels the call, and none is sent
 * while they are left (JOB_LEAVING), so the exits always run whole. */
static void run_job(apply_job *job, int *wl)
{
    if (!job->cancelled) {
        job->ident = PyThread_get_thread_ident();
        wl[WL_DEPTH]++;
        if (enter_replica(job) < 0) {
            job->exc = replica_take_exception();
        } else {
            if (!job->cancelled) {
                job->state = JOB_RUNNING;
                uint64_t t_run = job->prof.s != NULL ? dp_prof_now() : 0;
                job->result = PyObject_Call(job->module, job->args, job->kwargs);
                dp_prof_record_since(&job->prof, DP_PROF_REPLICA, job->dev.kind, job->dev.index,
                                     t_run, NULL);
                job->state = JOB_LEAVING;
                if (job->result == NULL) {
                    job->exc = replica_take_exception();
                }
            }
            if (job->interrupted) {
                /* An injected exception that arrived after the call
                 * returned must not fire in the exits or in this worker's
                 * next job. */
                PyThreadState_SetAsyncExc(job->ident, NULL);
            }
            leave_replica(job);
        }
        wl[WL_DEPTH]--;
    }
    job->state = JOB_DONE;
    if (job->abandoned) {
        /* The caller has returned (Ctrl-C): nobody reads the outcome. */
        job_clear(job);
    }
}

/* Runs job in the calling thread (GIL held). */
static void apply_job_inline(apply_job *job)
{
    job->state = JOB_RUNNING;
    uint64_t t_run = job->prof.s != NULL ? dp_prof_now() : 0;
    job->result = PyObject_Call(job->module, job->args, job->kwargs);
    dp_prof_record_since(&job->prof, DP_PROF_REPLICA, job->dev.kind, job->dev.index, t_run, NULL);
    if (job->result == NULL) {
        job->exc = replica_take_exception();
    }
    job->state = JOB_DONE;
}

/* ------------------------------------------------------------------ */
/* Running a batch                                                     */
/* ------------------------------------------------------------------ */

/* Stop the worker jobs: queued ones are skipped, running ones get exc_type
 * raised in their thread (GIL held). */
static void interrupt_jobs(apply_job *jobs, Py_ssize_t m, PyObject *exc_type)
{
    for (Py_ssize_t i = 0; i < m; i++) {
        apply_job *job = &jobs[i];
        if (!job->on_worker) {
            continue;
        }
        if (job->state == JOB_QUEUED) {
            job->cancelled = 1;
        } else if (job->state == JOB_RUNNING && exc_type != NULL) {
            PyThreadState_SetAsyncExc(job->ident, exc_type);
            job->interrupted = 1;
        }
    }
}

/* Refuse (RuntimeError) a call with more worker replicas on one device
 * than that device has threads (DP_POOL_MAX_THREADS): replicas may wait on
 * each other (a barrier), so a replica left queued behind the others could
 * deadlock the call. Below the cap the device starts a thread per replica. */
static int check_threads_per_device(const apply_job *jobs, Py_ssize_t m)
{
    if (m <= DP_POOL_MAX_THREADS) {
        return 0;
    }
    int *count = PyMem_Calloc(2 * DP_POOL_MAX_INDEX, sizeof *count);
    if (count == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    int rc = 0;
    for (Py_ssize_t i = 0; i < m && rc == 0; i++) {
        const apply_job *job = &jobs[i];
        int slot = (job->dev.kind == DP_CUDA ? DP_POOL_MAX_INDEX : 0) + job->dev.index;
        if (!job->on_worker || job->dev.index < 0 || job->dev.index >= DP_POOL_MAX_INDEX) {
            continue;
        }
        if (++count[slot] > DP_POOL_MAX_THREADS) {
            char devbuf[32];
            dp_device_format(job->dev, devbuf, sizeof devbuf);
            PyErr_Format(PyExc_RuntimeError,
                         "parallel_apply: more than %d replicas on device %s (replica %zd is "
                         "one too many): replicas of one call run at the same time, one "
                         "worker thread each, and a device has at most %d threads; use fewer "
                         "replicas per device", DP_POOL_MAX_THREADS, devbuf, i,
                         DP_POOL_MAX_THREADS);
            rc = -1;
        }
    }
    PyMem_Free(count);
    return rc;
}

/* BLAS thread limits while replicas run on virtual CPU devices
 * (dpmini/_blas.py, threadpoolctl): with two or more such replicas, each
 * BLAS pool is cut to cores // replicas threads for the call, so the
 * replicas do not oversubscribe the cores. Not inside a replica (the outer
 * call has set them). Returns a new reference to the token for blas_restore
 * (None when nothing changed), or NULL with an exception. */
static PyObject *blas_limit(const apply_job *jobs, Py_ssize_t m, int nested)
{
    Py_ssize_t ncpu = 0;
    for (Py_ssize_t i = 0; i < m; i++) {
        ncpu += jobs[i].dev.kind == DP_VCPU;
    }
    if (nested || ncpu < 2) {
        return Py_NewRef(Py_None);
    }
    /* sys.modules first: the import machinery costs microseconds a call */
    PyObject *name = PyUnicode_FromString("dpmini._blas");
    if (name == NULL) {
        return NULL;
    }
    PyObject *mod = PyImport_GetModule(name);
    if (mod == NULL && !PyErr_Occurred()) {
        mod = PyImport_Import(name);
    }
    Py_DECREF(name);
    if (mod == NULL) {
        return NULL;
    }
    PyObject *token = PyObject_CallMethod(mod, "limit", "n", ncpu);
    Py_DECREF(mod);
    return token;
}

/* Undo blas_limit (steals token: None, or dpmini._blas.limit's list of
 * (set_num_threads, previous count) pairs). The pairs are called from C, not
 * from a Python loop, so a Ctrl-C cannot stop the restoring half-way and
 * leave pools capped: a KeyboardInterrupt raised inside a setter written in
 * Python (threadpoolctl's) is retried once (setting a count twice is
 * harmless) and then re-armed with PyErr_SetInterrupt, so the caller still
 * gets it at its next check. Any other error is reported as unraisable, not
 * lost silently, and the remaining pools are still restored. */
static void blas_restore(PyObject *token)
{
    int interrupted = 0;
    Py_ssize_t n = PyList_Check(token) ? PyList_GET_SIZE(token) : 0;
    if (token != Py_None && !PyList_Check(token)) {
        PyErr_SetString(PyExc_TypeError, "dpmini._blas.limit: expected None or a list");
        PyErr_WriteUnraisable(token);
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *pair = PyList_GET_ITEM(token, i);
        if (!PyTuple_Check(pair) || PyTuple_GET_SIZE(pair) != 2) {
            PyErr_SetString(PyExc_TypeError, "dpmini._blas.limit: expected (setter, count) "
                            "pairs");
            PyErr_WriteUnraisable(token);
            continue;
        }
        for (int tries = 0; tries < 2; tries++) {
            PyObject *r = PyObject_CallOneArg(PyTuple_GET_ITEM(pair, 0),
                                              PyTuple_GET_ITEM(pair, 1));
            if (r != NULL) {
                Py_DECREF(r);
                break;
            }
            if (!PyErr_ExceptionMatches(PyExc_KeyboardInterrupt)) {
                PyErr_WriteUnraisable(pair);
                break;
            }
            PyErr_Clear();
            interrupted = 1;
        }
    }
    if (interrupted) {
        PyErr_SetInterrupt();
    }
    Py_DECREF(token);
}

/* One call's run of its jobs, through the steps of run_jobs: plan where
 * each job runs, start the run, limit the BLAS pools, submit the worker
 * jobs, run the inline ones, wait for the workers, finish, collect. */
typedef struct {
    dp_state *st;
    apply_job *caller_jobs;  /* the caller's array: the jobs before and after the run */
    apply_job *jobs;         /* the jobs now: caller_jobs, or run->jobs while
                                workers may touch them                     */
    Py_ssize_t m;
    apply_run *run;          /* the memory shared with the workers, or NULL
                                (every job inline, or the run is over)     */
    dp_prof_ctx prof;        /* the call's recording context (profile.h)   */
    PyObject *blas;          /* owned: blas_limit's token, until restored  */
    PyObject *abort;         /* owned: the exception that stops the whole
                                call (a signal, a failed submit), or NULL  */
    int nested;              /* called from inside a replica: all inline   */
    int numpy_alloc;         /* the NumPy allocator is on; -1: not read yet */
    int nsubmitted;          /* worker jobs queued                         */
    int kicked;              /* the chain of the chained jobs is started   */
    int grace;               /* wait slices left after an interrupt, or -1 */
    int trim;                /* a worker thread could not start            */
} run_state;

/* Where each job runs: inline (one job, a call from inside a replica, the
 * host, or a caller that is that device's worker) or on its device's
 * worker. 1 when any job runs on a worker, 0 when none does, -1 with
 * RuntimeError during interpreter shutdown. */
static int plan_jobs(run_state *rs)
{
    int any_worker = 0;
    for (Py_ssize_t i = 0; i < rs->m; i++) {
        apply_job *job = &rs->jobs[i];
        job->prof = rs->prof;
        job->on_worker = !(rs->m == 1 || rs->nested || job->dev.kind == DP_HOST ||
                           dp_pool_on_worker(job->dev.kind, job->dev.index));
        job->interp = PyThreadState_GetInterpreter(PyThreadState_Get());
        if (job->on_worker && DP_IS_FINALIZING()) {
            /* A worker taking the GIL now would be stopped by CPython for
             * good (it exits threads that are not the finalizing one), so
             * the call would never return: refuse it, as concurrent.futures
             * refuses new work after interpreter shutdown. */
            PyErr_SetString(PyExc_RuntimeError,
                            "parallel_apply: cannot run replicas on worker threads during "
                            "interpreter shutdown (sys.is_finalizing() is true)");
            return -1;
        }
        any_worker |= job->on_worker;
    }
    return any_worker;
}

/* With worker jobs: move the jobs into a run shared with the workers,
 * which keeps the profile session alive for them. Then number the jobs and
 * capture the replica contexts. 0, or -1 with the error raised and the
 * jobs back in the caller's array. */
static int start_run(run_state *rs, int any_worker)
{
    if (any_worker) {
        if (check_threads_per_device(rs->jobs, rs->m) < 0) {
            return -1;
        }
        rs->run = run_new(rs->caller_jobs, rs->m);
        if (rs->run == NULL) {
            return -1;
        }
        rs->jobs = rs->run->jobs;
        dp_pool_set_exit_hook(worker_exit);
        if (rs->prof.s != NULL) {
            dp_prof_session_retain(rs->prof.s);
            rs->run->prof_hold = rs->prof.s;
        }
    }
    for (Py_ssize_t i = 0; i < rs->m; i++) {
        rs->jobs[i].index = i;
    }
    /* The replica contexts are captured before the BLAS pools are cut: a
     * provider that reads a thread count reads the caller's own. */
    if (rs->run != NULL && contexts_capture(rs->st, rs->jobs, rs->m) < 0) {
        run_end(rs->run, rs->caller_jobs, rs->m);
        rs->run = NULL;
        rs->jobs = rs->caller_jobs;
        return -1;
    }
    return 0;
}

/* Cut the BLAS pools for the call (blas_limit). 0, or -1 with the error
 * raised and the run ended. */
static int limit_blas_pools(run_state *rs)
{
    uint64_t t_blas = rs->prof.s != NULL ? dp_prof_now() : 0;
    rs->blas = blas_limit(rs->jobs, rs->m, rs->nested);
    if (rs->blas == NULL) {
        if (rs->run != NULL) {
            run_end(rs->run, rs->caller_jobs, rs->m);
            rs->run = NULL;
            rs->jobs = rs->caller_jobs;
        }
        return -1;
    }
    if (rs->blas != Py_None) {
        dp_prof_record_since(&rs->prof, DP_PROF_BLAS, -1, -1, t_blas, "limit");
    }
    return 0;
}

/* A worker job's copy of the caller's contextvars context, with the NumPy
 * allocator of its device to set in that copy (the caller's context keeps
 * its own). 0, or -1 with the error raised and no copy kept. */
static int copy_caller_context(run_state *rs, apply_job *job)
{
    job->ctx = PyContext_CopyCurrent();
    if (job->ctx == NULL) {
        return -1;
    }
    if (rs->numpy_alloc < 0) {
        rs->numpy_alloc = dp_numpy_allocator_enabled();
    }
    job->numpy_handler = rs->numpy_alloc ? dp_numpy_allocator(rs->st, job->dev)
                                         : Py_NewRef(Py_None);
    if (job->numpy_handler == NULL) {
        Py_CLEAR(job->ctx);
        return -1;
    }
    return 0;
}

/* Queue job i on its device's worker: a job on a virtual CPU device quiet,
 * its worker woken later down the chain (chain_wake); any other at once.
 * 0, or -1 with RuntimeError (rs->trim set when no thread could start). */
static int submit_job(run_state *rs, Py_ssize_t i)
{
    apply_run *run = rs->run;
    apply_job *job = &rs->jobs[i];
    int rc;
    job->queued_ns = rs->prof.s != NULL ? dp_prof_now() : 0;
    if (job->dev.kind == DP_VCPU) {
        job->chained = 1;
        rc = dp_batch_submit_quiet(&run->batch, job->dev.kind, job->dev.index, apply_job_main,
                                   job, &run->nodes[i]);
        if (rc == 0) {
            run->chain[run->nchain++] = i;
        } else {
            job->chained = 0;
        }
    } else {
        rc = dp_batch_submit(&run->batch, job->dev.kind, job->dev.index, apply_job_main, job);
    }
    if (rc == 0) {
        return 0;
    }
    char devbuf[32];
    dp_device_format(job->dev, devbuf, sizeof devbuf);
    if (rc == EAGAIN || rc == ENOMEM) {
        PyErr_Format(PyExc_RuntimeError,
                     "parallel_apply: cannot start a worker thread for replica %zd on "
                     "device %s (%s: the process is out of memory, address space or "
                     "threads); no replica of this call is left running",
                     i, devbuf, strerror(rc));
        rs->trim = 1;
    } else {
        PyErr_Format(PyExc_RuntimeError,
                     "parallel_apply: cannot queue replica %zd on the worker of device "
                     "%s (%s)", i, devbuf, strerror(rc));
    }
    return -1;
}

/* Queue the worker jobs, before the inline ones run. The first failure
 * stops the call (rs->abort): that job and the worker jobs after it were
 * never queued, so no worker owns them, and they are skipped. */
static void submit_jobs(run_state *rs)
{
    for (Py_ssize_t i = 0; i < rs->m; i++) {
        apply_job *job = &rs->jobs[i];
        if (!job->on_worker) {
            continue;
        }
        if (copy_caller_context(rs, job) < 0 || submit_job(rs, i) < 0) {
            job->on_worker = 0;
            job->cancelled = 1;
            rs->abort = replica_take_exception();
            break;
        }
        rs->nsubmitted++;
    }
    for (Py_ssize_t i = 0; i < rs->m && rs->abort != NULL; i++) {
        if (rs->jobs[i].on_worker && rs->jobs[i].ctx == NULL) {
            rs->jobs[i].on_worker = 0;   /* after the failing one: never queued */
            rs->jobs[i].cancelled = 1;
        }
    }
}

/* Run the inline jobs in the calling thread while the workers run theirs.
 * A KeyboardInterrupt or SystemExit in one stops the call: the worker
 * replicas get it too and the wait gives them the grace period. */
static void run_inline_jobs(run_state *rs)
{
    for (Py_ssize_t i = 0; i < rs->m; i++) {
        apply_job *job = &rs->jobs[i];
        if (job->on_worker || job->cancelled) {
            continue;
        }
        if (rs->nsubmitted > 0 && !rs->kicked) {
            /* An inline replica may wait for a worker replica (a barrier):
             * start the chain now. The woken worker waits for the GIL. */
            chain_wake(rs->run);
            rs->kicked = 1;
        }
        if (rs->abort != NULL) {
            job->cancelled = 1;
            continue;
        }
        apply_job_inline(job);
        if (job->exc != NULL && !PyObject_IsInstance(job->exc, PyExc_Exception)) {
            rs->abort = Py_NewRef(job->exc);
            interrupt_jobs(rs->jobs, rs->m, (PyObject *)Py_TYPE(rs->abort));
            rs->grace = DP_GRACE_SLICES;
        }
    }
    if (rs->abort != NULL) {
        interrupt_jobs(rs->jobs, rs->m, NULL);   /* unstarted worker jobs are skipped */
    }
}

/* A signal handler raised while the caller waits (Ctrl-C): the running
 * worker replicas get the same exception. The first one starts the grace
 * period, a second one ends it; the call raises the first exception that
 * stopped it. */
static void interrupt_wait(run_state *rs)
{
    PyObject *e = replica_take_exception();
    interrupt_jobs(rs->jobs, rs->m, (PyObject *)Py_TYPE(e));
    rs->grace = rs->grace < 0 ? DP_GRACE_SLICES : 0;
    if (rs->abort == NULL) {
        rs->abort = e;
    } else {
        Py_DECREF(e);
    }
}

/* Wait for the worker jobs with the GIL released, in slices so that the
 * caller still sees signals. When the grace period after an interrupt
 * ends, replicas still running are stuck in a C call that the
 * KeyboardInterrupt reaches only when it returns: the caller stops waiting
 * and leaves them to their workers (run_abandon; the last one frees the
 * run). */
static void wait_workers(run_state *rs)
{
    if (rs->nsubmitted == 0) {
        return;
    }
    uint64_t t_wait = rs->prof.s != NULL ? dp_prof_now() : 0;
    for (;;) {
        int done;
        Py_BEGIN_ALLOW_THREADS
        if (!rs->kicked) {
            chain_wake(rs->run);   /* with the GIL released: the worker takes it at once */
            rs->kicked = 1;
        }
        done = dp_batch_wait(&rs->run->batch, DP_WAIT_SLICE_MS);
        Py_END_ALLOW_THREADS
        if (done) {
            break;
        }
        if (rs->grace == 0) {
            run_abandon(rs->run, rs->caller_jobs, rs->m);
            rs->run = NULL;   /* no longer the caller's: the workers free it */
            rs->jobs = rs->caller_jobs;
            break;
        }
        if (rs->grace > 0) {
            rs->grace--;
        }
        if (PyErr_CheckSignals() < 0) {
            interrupt_wait(rs);
        }
    }
    dp_prof_record_since(&rs->prof, DP_PROF_WAIT, -1, -1, t_wait, "replicas");
}

/* Every replica has finished, or is abandoned: the BLAS pools get their
 * thread counts back and the jobs go back to the caller's array. After a
 * worker thread could not start, idle workers are let go, so that the
 * threads this call started give their stacks back and the next call has
 * room. */
static void finish_run(run_state *rs)
{
    int blas_set = rs->blas != Py_None;
    uint64_t t_blas = rs->prof.s != NULL && blas_set ? dp_prof_now() : 0;
    blas_restore(rs->blas);
    rs->blas = NULL;
    if (blas_set) {
        dp_prof_record_since(&rs->prof, DP_PROF_BLAS, -1, -1, t_blas, "restore");
    }
    if (rs->run != NULL) {
        run_end(rs->run, rs->caller_jobs, rs->m);
        rs->run = NULL;
    }
    rs->jobs = rs->caller_jobs;
    if (rs->trim) {
        dp_pool_trim();
        Py_BEGIN_ALLOW_THREADS   /* their exit hooks take the GIL */
        (void)dp_pool_trim_wait(2000);
        Py_END_ALLOW_THREADS
    }
}

/* The results as a list in replica order, or NULL with the exception that
 * stopped the call, else the first failing replica's (docs/spec.md 6.5). */
static PyObject *collect_results(run_state *rs)
{
    apply_job *jobs = rs->caller_jobs;
    if (rs->abort != NULL) {
        restore_exception(rs->abort);
        rs->abort = NULL;
        return NULL;
    }
    for (Py_ssize_t i = 0; i < rs->m; i++) {
        if (jobs[i].no_tstate) {
            char devbuf[32];
            dp_device_format(jobs[i].dev, devbuf, sizeof devbuf);
            PyErr_Format(PyExc_MemoryError,
                         "parallel_apply: out of memory making a Python thread state for "
                         "replica %zd's worker thread on device %s", i, devbuf);
            return NULL;
        }
        if (jobs[i].exc != NULL) {
            raise_replica_error(rs->st, jobs[i].exc, i, jobs[i].dev);
            return NULL;
        }
        if (jobs[i].result == NULL) {
            PyErr_Format(PyExc_SystemError, "parallel_apply: replica %zd did not run", i);
            return NULL;
        }
    }
    PyObject *result = PyList_New(rs->m);
    if (result == NULL) {
        return NULL;
    }
    for (Py_ssize_t i = 0; i < rs->m; i++) {
        PyList_SET_ITEM(result, i, jobs[i].result);
        jobs[i].result = NULL;
    }
    return result;
}

/* Queue the worker jobs, run the inline ones, wait for the workers. */
static void run_replicas(void *arg)
{
    run_state *rs = arg;
    submit_jobs(rs);
    run_inline_jobs(rs);
    wait_workers(rs);
}

/* The type a library registered is torch.nn.Module, whose work on the
 * caller's thread (a backward) leaves the team spinning. Replicas of other
 * libraries do not park: parking a team that was asleep would wake it, and
 * it would then spin after the call. */
int dp_park_candidate(const dp_state *st, PyObject *module, Py_ssize_t nvcpu)
{
    PyTypeObject *tp = (PyTypeObject *)st->park_openmp_type;
    return tp != NULL && nvcpu >= 2 && module != NULL && PyType_IsSubtype(Py_TYPE(module), tp);
}

/* Call the library's prepare callable (its errors are dropped: a call parks
 * either way). torch's, torch.get_num_threads, makes torch set the thread's
 * OpenMP count now if it never did: torch sets it on a thread's first use,
 * to MKL's count before torch.set_num_threads was called, and MKL answers 1
 * inside a parallel region; omp_team keeps a count set inside the region, so
 * that first use inside it would leave the thread single-threaded for good. */
static void prepare_to_park(const dp_state *st)
{
    if (st->park_openmp_prepare == NULL) {
        return;
    }
    PyObject *et, *ev, *tb;
    PyErr_Fetch(&et, &ev, &tb);
    PyObject *res = PyObject_CallNoArgs(st->park_openmp_prepare);
    Py_XDECREF(res);
    PyErr_Clear();
    PyErr_Restore(et, ev, tb);
}

/* Parking is for calls that run long enough for a spinning team to cost
 * them: after a parked region the team spins again (milliseconds), so in a
 * loop of short calls with nothing else in between, parking each one would
 * keep a core spinning that was otherwise asleep, and cost each call the
 * team's wake-up (tens of microseconds). So a candidate call parks only
 * when the last candidate call (any thread) ran at least PARK_MIN_NS; the
 * first one parks. */
#define PARK_MIN_NS 1000000LL
static long long last_candidate_ns = PARK_MIN_NS;   /* atomic */

void dp_run_park_candidate(const dp_state *st, void (*fn)(void *), void *arg)
{
    uint64_t t0 = dp_prof_now();
    if (__atomic_load_n(&last_candidate_ns, __ATOMIC_RELAXED) >= PARK_MIN_NS) {
        prepare_to_park(st);
        (void)dp_omp_run_parked(fn, arg);
    } else {
        fn(arg);
    }
    __atomic_store_n(&last_candidate_ns, (long long)(dp_prof_now() - t0), __ATOMIC_RELAXED);
}

/* A parallel_apply call is a park candidate (dp_park_candidate) for its
 * first replica and the jobs on virtual CPU workers. Not inside a replica:
 * the outer call parked the team or chose not to. Inside a DataParallel
 * call that parked it already (its whole forward), omp_team finds nothing
 * to park. */
static int park_candidate(const run_state *rs)
{
    if (rs->nested || rs->m == 0) {
        return 0;
    }
    Py_ssize_t ncpu = 0;
    for (Py_ssize_t i = 0; i < rs->m; i++) {
        ncpu += rs->jobs[i].on_worker && rs->jobs[i].dev.kind == DP_VCPU;
    }
    return dp_park_candidate(rs->st, rs->jobs[0].module, ncpu);
}

/* Run the m prepared jobs (GIL held) and return their results as a list,
 * in replica order; on failure re-raise the first failing replica's error
 * (docs/spec.md 6.5). The worker jobs are queued first, then the caller
 * runs the inline ones (with one replica or inside a replica, all of them)
 * and waits for the workers. */
static PyObject *run_jobs(dp_state *st, apply_job *caller_jobs, Py_ssize_t m)
{
    run_state rs = {.st = st, .caller_jobs = caller_jobs, .jobs = caller_jobs, .m = m,
                    .prof = dp_prof_current(), .nested = replica_depth() > 0,
                    .numpy_alloc = -1, .grace = -1};
    int any_worker = plan_jobs(&rs);
    if (any_worker < 0 || start_run(&rs, any_worker) < 0 || limit_blas_pools(&rs) < 0) {
        return NULL;
    }
    if (park_candidate(&rs)) {
        dp_run_park_candidate(st, run_replicas, &rs);
    } else {
        run_replicas(&rs);
    }
    finish_run(&rs);
    return collect_results(&rs);
}

/* ------------------------------------------------------------------ */
/* Arguments and devices                                               */
/* ------------------------------------------------------------------ */

/* One replica's positional arguments as an exact tuple (new reference):
 * a list or tuple is unpacked, anything else becomes (input,) (docs/spec.md 6.3). */
PyObject *input_as_args(PyObject *input)
{
    if (PyTuple_CheckExact(input)) {
        return Py_NewRef(input);
    }
    if (PyTuple_Check(input) || PyList_Check(input)) {
        return PySequence_Tuple(input);
    }
    return PyTuple_Pack(1, input);
}

/* One replica's keyword arguments as an exact dict or NULL (*out, new
 * reference). None is no keywords. */
int kwargs_as_dict(PyObject *kw, const char *what, Py_ssize_t i, PyObject **out)
{
    *out = NULL;
    if (kw == NULL || kw == Py_None) {
        return 0;
    }
    if (PyDict_CheckExact(kw)) {
        *out = Py_NewRef(kw);
        return 0;
    }
    if (!PyMapping_Check(kw) || PySequence_Check(kw)) {
        PyErr_Format(PyExc_TypeError, "%s[%zd]: expected a dict of keyword arguments, got %.100s",
                     what, i, Py_TYPE(kw)->tp_name);
        return -1;
    }
    PyObject *d = PyDict_New();
    if (d == NULL || PyDict_Update(d, kw) < 0) {
        Py_XDECREF(d);
        return -1;
    }
    *out = d;
    return 0;
}

/* The device a replica runs on when none is given: the device of the first
 * array among its top-level arguments, else entry i of the default list. */
static int auto_device(dp_state *st, PyObject *args, Py_ssize_t i,
                       dp_device **defaults, Py_ssize_t *ndefaults, dp_device *out)
{
    for (Py_ssize_t j = 0; j < PyTuple_GET_SIZE(args); j++) {
        PyObject *a = PyTuple_GET_ITEM(args, j);
        int r = dp_is_array_leaf(st, a);
        if (r < 0 && PyErr_Occurred()) {
            PyObject *path = PyUnicode_FromFormat("inputs[%zd][%zd]", i, j);
            dp_reraise_at(st, path);   /* a protocol probe raised: name it */
            Py_XDECREF(path);
            return -1;
        }
        if (r > 0) {
            /* only where the memory lives is read: a tensor that requires grad
             * is looked at detached, and goes to its replica as it is */
            char name[64];
            snprintf(name, sizeof name, "inputs[%zd][%zd]", i, j);
            PyArrayObject *aa = PyArray_Check(a) || PyObject_TypeCheck(a, st->ArrayType)
                                    ? dp_as_array(st, a, name, 0) /* GPU arrays: the shadow */
                                    : dp_import_foreign_detached(st, a, name);
            if (aa == NULL) {
                return -1;
            }
            dp_device d = dp_array_device(st, aa);
            Py_DECREF(aa);
            if (d.kind != DP_HOST) {
                *out = d;
                return 0;
            }
            break;
        }
    }
    if (*defaults == NULL && dp_default_devices(st, defaults, ndefaults) < 0) {
        return -1;
    }
    *out = (*defaults)[i % *ndefaults];
    return 0;
}

/* parallel_apply's arguments as fast sequences, and the jobs made of them. */
typedef struct {
    PyObject *mods;        /* owned: the modules                              */
    PyObject *ins;         /* owned: the inputs, one per module               */
    PyObject *kws;         /* owned: kwargs_tup's entries, or NULL: none given */
    PyObject *devseq;      /* owned: the devices argument's entries, or NULL  */
    Py_ssize_t m;          /* the module count                                */
    apply_job *jobs;       /* small or PyMem: m zeroed jobs once allocated    */
    Py_ssize_t njobs;      /* the jobs to clear at the end                    */
    dp_device *defaults;   /* PyMem: the default devices, read when first needed */
    Py_ssize_t ndefaults;
    apply_job small[DP_SMALL_JOBS];
} apply_args;

/* An optional argument with one entry per module (kwargs_tup, devices) as
 * a fast sequence in *out (NULL when None or absent); `what` names its
 * entries in the count mismatch's ValueError. 0, or -1 with the error
 * raised (*out then may hold a reference). */
static int per_module_sequence(PyObject *arg, const char *type_error, const char *what,
                               Py_ssize_t m, PyObject **out)
{
    *out = NULL;
    if (arg == NULL || arg == Py_None) {
        return 0;
    }
    *out = PySequence_Fast(arg, type_error);
    if (*out == NULL) {
        return -1;
    }
    if (PySequence_Fast_GET_SIZE(*out) != m) {
        PyErr_Format(PyExc_ValueError,
                     "parallel_apply: the number of modules (%zd) is not equal to the "
                     "number of %s (%zd)", m, what, PySequence_Fast_GET_SIZE(*out));
        return -1;
    }
    return 0;
}

/* Read the sequences and check that each has one entry per module (devices
 * from cdevs, ncdevs of them, when given). 0, or -1 with the error raised. */
static int read_arguments(apply_args *a, PyObject *modules, PyObject *inputs,
                          PyObject *kwargs_tup, PyObject *devices, const dp_device *cdevs,
                          Py_ssize_t ncdevs)
{
    a->mods = PySequence_Fast(modules, "parallel_apply: modules must be a sequence of callables");
    if (a->mods == NULL) {
        return -1;
    }
    a->m = PySequence_Fast_GET_SIZE(a->mods);
    a->ins = PySequence_Fast(inputs, "parallel_apply: inputs must be a sequence (one entry per module)");
    if (a->ins == NULL) {
        return -1;
    }
    if (PySequence_Fast_GET_SIZE(a->ins) != a->m) {
        PyErr_Format(PyExc_ValueError,
                     "parallel_apply: the number of modules (%zd) is not equal to the number "
                     "of inputs (%zd)", a->m, PySequence_Fast_GET_SIZE(a->ins));
        return -1;
    }
    if (per_module_sequence(kwargs_tup, "parallel_apply: kwargs_tup must be a sequence of dicts",
                            "kwargs_tup entries", a->m, &a->kws) < 0) {
        return -1;
    }
    if (cdevs != NULL) {
        if (ncdevs != a->m) {
            PyErr_Format(PyExc_ValueError,
                         "parallel_apply: the number of modules (%zd) is not equal to the "
                         "number of devices (%zd)", a->m, ncdevs);
            return -1;
        }
        return 0;
    }
    if (devices != NULL && dp_refuse_bytes_as_devices(devices, "devices") < 0) {
        return -1;
    }
    return per_module_sequence(devices, "parallel_apply: devices must be a sequence of devices",
                               "devices", a->m, &a->devseq);
}

/* Room for m zeroed jobs: a->small (zeroed with *a), or PyMem. 0, or -1
 * with MemoryError. */
static int alloc_jobs(apply_args *a)
{
    if (a->m > DP_SMALL_JOBS) {
        a->jobs = PyMem_Calloc((size_t)a->m, sizeof *a->jobs);
        if (a->jobs == NULL) {
            a->jobs = a->small;
            PyErr_NoMemory();
            return -1;
        }
    }
    a->njobs = a->m;
    return 0;
}

/* Job i: its module, arguments, keyword arguments and device (cdevs[i],
 * else devices[i], else auto_device). 0, or -1 with the error raised. */
static int fill_job(dp_state *st, apply_args *a, Py_ssize_t i, const dp_device *cdevs)
{
    apply_job *job = &a->jobs[i];
    job->module = Py_NewRef(PySequence_Fast_GET_ITEM(a->mods, i));
    job->args = input_as_args(PySequence_Fast_GET_ITEM(a->ins, i));
    if (job->args == NULL) {
        return -1;
    }
    if (a->kws != NULL &&
        kwargs_as_dict(PySequence_Fast_GET_ITEM(a->kws, i), "kwargs_tup", i, &job->kwargs) < 0) {
        return -1;
    }
    PyObject *dev = a->devseq ? PySequence_Fast_GET_ITEM(a->devseq, i) : Py_None;
    if (cdevs != NULL) {
        job->dev = cdevs[i];
    } else if (dev != Py_None) {
        char name[40];
        snprintf(name, sizeof name, "devices[%zd]", i);
        return dp_device_from_object(st, dev, name, 0, &job->dev);
    } else {
        return auto_device(st, job->args, i, &a->defaults, &a->ndefaults, &job->dev);
    }
    return 0;
}

/* parallel_apply over Python sequences. Devices come from cdevs (ncdevs
 * entries, must equal the module count) when given, else from `devices`
 * (None or a sequence, None entries allowed), else auto_device. */
static PyObject *parallel_apply_run_steps(dp_state *st, PyObject *modules, PyObject *inputs,
                                          PyObject *kwargs_tup, PyObject *devices,
                                          const dp_device *cdevs, Py_ssize_t ncdevs)
{
    apply_args a = {0};
    PyObject *result = NULL;
    a.jobs = a.small;
    if (read_arguments(&a, modules, inputs, kwargs_tup, devices, cdevs, ncdevs) == 0 &&
        alloc_jobs(&a) == 0) {
        Py_ssize_t i = 0;
        while (i < a.m && fill_job(st, &a, i, cdevs) == 0) {
            i++;
        }
        if (i == a.m) {
            result = run_jobs(st, a.jobs, a.m);
        }
    }
    for (Py_ssize_t i = 0; i < a.njobs; i++) {
        job_clear(&a.jobs[i]);
    }
    if (a.jobs != a.small) {
        PyMem_Free(a.jobs);
    }
    PyMem_Free(a.defaults);
    Py_XDECREF(a.mods);
    Py_XDECREF(a.ins);
    Py_XDECREF(a.kws);
    Py_XDECREF(a.devseq);
    return result;
}

/* parallel_apply_run under dpmini.profile(): one span around it (profile.h). */
PyObject *parallel_apply_run(dp_state *st, PyObject *modules, PyObject *inputs,
                             PyObject *kwargs_tup, PyObject *devices,
                             const dp_device *cdevs, Py_ssize_t ncdevs)
{
    dp_prof_span sp;
    dp_prof_begin(&sp, DP_PROF_APPLY);
    PyObject *res = parallel_apply_run_steps(st, modules, inputs, kwargs_tup, devices, cdevs,
                                             ncdevs);
    dp_prof_end(&sp, NULL);
    return res;
}

/* ------------------------------------------------------------------ */
/* Public functions: module level                                      */
/* ------------------------------------------------------------------ */

PyDoc_STRVAR(parallel_apply_doc,
"parallel_apply(modules, inputs, kwargs_tup=None, devices=None)\n--\n\n"
"Returns a list with one result per module.\n"
"Call modules[i](*inputs[i], **kwargs_tup[i]) for every i, each on the\n"
"persistent worker thread of devices[i] (PyTorch parallel_apply, docs/spec.md 6);\n"
"return the results as a list in index order (docs/spec.md 6.4).\n"
"inputs[i]: a list or tuple is unpacked, anything else is passed as the one\n"
"positional argument. kwargs_tup: None (no keywords) or one dict per module.\n"
"devices: None, or one device per module (None entries allowed); a missing\n"
"device is that of the first array among inputs[i]'s top-level items when\n"
"it lives on a device, else entry i of the default device list.\n"
"Each worker holds the GIL while it runs Python code and enters a copy of\n"
"the caller's contextvars context (numpy.errstate etc. apply, like PyTorch\n"
"copying grad mode, docs/spec.md 6.2). With one module, or when called from inside\n"
"a replica running on a worker, the calls run inline in the caller thread.\n"
"Replicas sharing a device (e.g. ['cpu:0', 'cpu:0']) run at the same time on\n"
"threads of that device (like PyTorch's one thread per replica; the GIL is\n"
"shared as usual). Ctrl-C while waiting raises KeyboardInterrupt in\n"
"the running replicas, waits for them, and re-raises it.\n"
"With two or more replicas on virtual CPU devices, the BLAS thread pools\n"
"(OpenBLAS, MKL, BLIS; found with threadpoolctl) run with cores // replicas\n"
"threads (at least 1) until every replica has finished, then get their\n"
"counts back, so\n"
"replicas x BLAS threads <= cores; DPMINI_BLAS_LIMIT=0 turns this off\n"
"(dpmini/_blas.py; PyTorch does not do this).\n"
"NumPy arrays of 256 KiB and more (np.zeros aside) that a replica on a\n"
"worker of virtual CPU device cpu:i makes come from cpu:i's caching\n"
"allocator (NumPy's NEP 49 handler, set in the replica's context copy only;\n"
"as PyTorch replicas on GPUs use the CUDA caching allocator): no page\n"
"faults for reused temporaries; DPMINI_NUMPY_ALLOCATOR=0 turns this off.\n"
"Errors: ValueError 'parallel_apply: the number of modules (M) is not equal\n"
"to the number of inputs (N)' (likewise kwargs_tup and devices); the first\n"
"failing replica (lowest index) is re-raised with its type and the message\n"
"'Caught T in replica i on device d.\\nOriginal Traceback (most recent call\n"
"last):\\n...', the original exception as __cause__ (RuntimeError when T\n"
"cannot be built from one string). RuntimeError, before any replica runs,\n"
"for more than 1024 replicas on one device (they run at once, one worker\n"
"thread each) and for a call during interpreter finalization\n"
"(sys.is_finalizing(); as concurrent.futures); RuntimeError when a worker\n"
"thread cannot be started (out of memory, address space or threads) and\n"
"MemoryError when its Python thread state cannot be made.");

static PyObject *py_parallel_apply(PyObject *mod, PyObject *args, PyObject *kwargs)
{
    static char *kwlist[] = {"modules", "inputs", "kwargs_tup", "devices", NULL};
    PyObject *modules, *inputs, *kw = Py_None, *devices = Py_None;
    dp_state *st = dp_state_from_module(mod);
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "OO|OO:parallel_apply", kwlist,
                                     &modules, &inputs, &kw, &devices)) {
        return NULL;
    }
    return parallel_apply_run(st, modules, inputs, kw, devices, NULL, 0);
}


PyMethodDef dp_parallel_apply_methods[] = {
    {"parallel_apply", (PyCFunction)(void (*)(void))py_parallel_apply,
     METH_VARARGS | METH_KEYWORDS, parallel_apply_doc},
    {NULL, NULL, 0, NULL},
};

/* The module's registry with provider added (add) or removed. */
static PyObject *registry_update(PyObject *mod, PyObject *provider, int add)
{
    dp_state *st = dp_state_from_module(mod);
    PyObject *old = st->replica_contexts;
    Py_ssize_t n = old != NULL ? PyTuple_GET_SIZE(old) : 0, at = -1;
    for (Py_ssize_t k = 0; k < n && at < 0; k++) {
        PyObject *p = PyTuple_GET_ITEM(old, k);
        int eq = p == provider ? 1 : PyObject_RichCompareBool(p, provider, Py_EQ);
        if (eq < 0) {
            return NULL;
        }
        at = eq ? k : -1;
    }
    if (add ? at >= 0 : at < 0) {
        return Py_NewRef(add ? Py_None : Py_False);   /* already there / not there */
    }
    PyObject *upd = PyTuple_New(add ? n + 1 : n - 1);
    if (upd == NULL) {
        return NULL;
    }
    for (Py_ssize_t k = 0, j = 0; k < n; k++) {
        if (k != at) {
            PyTuple_SET_ITEM(upd, j++, Py_NewRef(PyTuple_GET_ITEM(old, k)));
        }
    }
    if (add) {
        PyTuple_SET_ITEM(upd, n, Py_NewRef(provider));
    }
    /* a new tuple: a call iterating the old one keeps its own reference */
    st->replica_contexts = upd;
    Py_XDECREF(old);
    return Py_NewRef(add ? Py_None : Py_True);
}

PyDoc_STRVAR(register_replica_context_doc,
"register_replica_context(provider)\n--\n\n"
"Returns None.\n"
"Carry per-thread state of a library into the worker threads that run\n"
"replicas (as torch.nn.parallel.parallel_apply carries torch's grad mode,\n"
"autocast and current CUDA stream, docs/spec.md 6.2). For each call that runs\n"
"replicas on worker threads, parallel_apply (and DataParallel's forward)\n"
"calls provider(devices) once on the caller's thread before any replica\n"
"starts; devices is a tuple of dpmini.Device, one per replica. It returns\n"
"None (nothing to carry this call) or enter, a callable that each worker\n"
"thread calls as enter(i, device) just before replica i runs there; enter\n"
"returns None or exit, which that thread calls with no arguments after the\n"
"replica returned or raised, or was skipped after a Ctrl-C. Worker threads\n"
"persist between calls, so enter sets the state on every call and exit\n"
"restores what the thread had. Providers run in registration order, exits\n"
"in reverse order. Replicas that run inline in the caller's thread (one\n"
"replica, nested calls) already see the caller's state: no provider is\n"
"called. Registering the same provider (==) twice does nothing.\n"
"Errors: TypeError when provider is not callable. An exception raised by\n"
"provider fails the call before any replica runs (raised again naming the\n"
"provider, the original as __cause__); one raised by enter or exit is\n"
"replica i's error (docs/spec.md 6.5; an exit's error when the replica already\n"
"failed is reported with sys.unraisablehook). dpmini registers PyTorch's\n"
"provider itself the first time a call finds torch imported (docs/libraries.md,\n"
"\"torch's per-thread state in the replicas\").");

static PyObject *py_register_replica_context(PyObject *mod, PyObject *provider)
{
    if (!PyCallable_Check(provider)) {
        PyErr_Format(PyExc_TypeError,
                     "register_replica_context: provider must be callable, got %.100s",
                     Py_TYPE(provider)->tp_name);
        return NULL;
    }
    return registry_update(mod, provider, 1);
}

PyDoc_STRVAR(unregister_replica_context_doc,
"unregister_replica_context(provider)\n--\n\n"
"Returns True when provider (==) was registered and is now removed, else\n"
"False. Undoes register_replica_context: later calls no longer call it\n"
"(a call already running still enters and exits it). Raises nothing but\n"
"what provider's __eq__ raises.");

static PyObject *py_unregister_replica_context(PyObject *mod, PyObject *provider)
{
    return registry_update(mod, provider, 0);
}

PyDoc_STRVAR(park_openmp_team_doc,
"_park_openmp_team(cls, prepare=None) -> type | None\n\n"
"Private (dpmini/_torch.py registers torch.nn.Module and\n"
"torch.get_num_threads). A DataParallel or parallel_apply call that runs two\n"
"or more replicas on virtual CPU devices, the first an instance of cls, parks\n"
"the caller's OpenMP team: its other threads, which an OpenMP runtime keeps\n"
"spinning for milliseconds after a parallel region (libgomp's default wait\n"
"policy), sleep until the call is done instead of sharing the cores with it;\n"
"unless the previous such call took under 1 ms (docs/spec.md 6.3). prepare,\n"
"when given, is called with no arguments before each call parks (its errors\n"
"are ignored). cls None: no call parks. Returns the previous cls (None:\n"
"none). Raises TypeError when cls is neither a type nor None, or prepare is\n"
"neither callable nor None.");

static PyObject *py_park_openmp_team(PyObject *mod, PyObject *args)
{
    PyObject *cls, *prepare = Py_None;
    if (!PyArg_ParseTuple(args, "O|O:_park_openmp_team", &cls, &prepare)) {
        return NULL;
    }
    if (cls != Py_None && !PyType_Check(cls)) {
        PyErr_Format(PyExc_TypeError, "_park_openmp_team: cls: expected a type or None, got %.100s",
                     Py_TYPE(cls)->tp_name);
        return NULL;
    }
    if (prepare != Py_None && !PyCallable_Check(prepare)) {
        PyErr_Format(PyExc_TypeError,
                     "_park_openmp_team: prepare: expected a callable or None, got %.100s",
                     Py_TYPE(prepare)->tp_name);
        return NULL;
    }
    dp_state *st = dp_state_from_module(mod);
    PyObject *prev = st->park_openmp_type;
    st->park_openmp_type = cls == Py_None ? NULL : Py_NewRef(cls);
    Py_XSETREF(st->park_openmp_prepare, prepare == Py_None ? NULL : Py_NewRef(prepare));
    return prev != NULL ? prev : Py_NewRef(Py_None);
}

PyMethodDef dp_replica_context_methods[] = {
    {"register_replica_context", py_register_replica_context, METH_O,
     register_replica_context_doc},
    {"unregister_replica_context", py_unregister_replica_context, METH_O,
     unregister_replica_context_doc},
    {"_park_openmp_team", py_park_openmp_team, METH_VARARGS, park_openmp_team_doc},
    {NULL, NULL, 0, NULL},
};
