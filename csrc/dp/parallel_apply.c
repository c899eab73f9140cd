/* parallel_apply.c - parallel_apply: call replica i on the worker thread of
 * its device (spec §6), for DataParallel.forward / .parallel_apply and the
 * module-level dpmini.parallel_apply; wraps a replica's exception as
 * "Caught T in replica i on device d." (spec 6.5).
 *
 * parallel_apply: replica i runs on a persistent worker thread of its device
 * (a device has more than one when its jobs overlap, pool.h),
 * which takes the GIL and enters a copy of the caller's contextvars context
 * (the analogue of PyTorch copying grad mode, spec 6.2). The caller waits
 * with the GIL released, in 50 ms slices so that Ctrl-C still works.
 *
 * Sections: types; helpers (exceptions, arguments, jobs); public functions.
 */
#include "dpmini.h"
#include "dataparallel.h"
#include "dp.h"
#include "pool.h"
#include "cuda_api.h"

#include <errno.h>
#include <string.h>

/* ------------------------------------------------------------------ */
/* Types                                                               */
/* ------------------------------------------------------------------ */

#define DP_WAIT_SLICE_MS 50              /* signal checks while waiting  */
#define DP_SMALL_JOBS 8                  /* replicas without heap memory */

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

/* One replica call of parallel_apply. Owned by the caller (on its stack or
 * PyMem); a worker touches it only while the caller waits for the batch. */
enum { JOB_QUEUED = 0, JOB_RUNNING = 1, JOB_DONE = 2 };

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
    PyInterpreterState *interp; /* the caller's interpreter (worker jobs)     */
    int torch_no_grad;     /* the caller runs under torch.no_grad(): so does
                              the worker's call (interop.c)                   */
    PyObject *torch_autocast; /* owned: the caller's CPU autocast, entered
                              around the worker's call, or NULL               */
} apply_job;

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
/* Helpers: exceptions                                                 */
/* ------------------------------------------------------------------ */

/* The exception being raised, as an instance with its traceback attached
 * (new reference); the error indicator is cleared. Never NULL. */
static PyObject *take_exception(void)
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
            return take_exception();
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
 * text unquoted (PyTorch's KeyErrorMessage, spec 6.5): an instance of the
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

/* Re-raise exc, raised by replica i on dev, as PyTorch's ExceptionWrapper
 * does (spec 6.5): same type, message "Caught T in replica i on device d.\n
 * Original Traceback (most recent call last):\n...", the original as
 * __cause__; RuntimeError when the type cannot be built from one string.
 * Exceptions that are not Exception subclasses (KeyboardInterrupt,
 * SystemExit) are re-raised unchanged. */
static void raise_replica_error(dp_state *st, PyObject *exc, Py_ssize_t i, dp_device dev)
{
    PyObject *tp = (PyObject *)Py_TYPE(exc);
    PyObject *tb = NULL, *lines = NULL, *empty = NULL, *text = NULL, *name = NULL;
    PyObject *msg = NULL, *arg = NULL, *attr = NULL, *kw = NULL, *noargs = NULL;
    PyObject *wrapped = NULL;
    char devbuf[32];

    if (!PyObject_IsInstance(exc, PyExc_Exception)) {
        restore_exception(Py_NewRef(exc));
        return;
    }
    dp_device_format(dev, devbuf, sizeof devbuf);

    tb = PyException_GetTraceback(exc);
    lines = PyObject_CallFunctionObjArgs(st->format_exception, tp, exc,
                                         tb ? tb : Py_None, NULL);
    empty = PyUnicode_FromStringAndSize(NULL, 0);
    if (lines != NULL && empty != NULL) {
        text = PyUnicode_Join(empty, lines);
    }
    if (text == NULL) {   /* formatting failed: fall back to str(exc) */
        PyErr_Clear();
        text = PyUnicode_FromFormat("%s: %S\n", ((PyTypeObject *)tp)->tp_name, exc);
        if (text == NULL) {
            goto fail;
        }
    }
    name = PyObject_GetAttrString(tp, "__name__");
    if (name == NULL) {
        goto fail;
    }
    {
        static const char head[] = "Traceback (most recent call last):\n";
        PyObject *prefix = PyUnicode_FromString(head);
        if (prefix == NULL) {
            goto fail;
        }
        Py_ssize_t starts = PyUnicode_Tailmatch(text, prefix, 0, PY_SSIZE_T_MAX, -1);
        if (starts < 0) {
            Py_DECREF(prefix);
            goto fail;
        }
        if (starts) {
            msg = PyUnicode_FromFormat("Caught %U in replica %zd on device %s.\nOriginal %U",
                                       name, i, devbuf, text);
        } else {   /* no Python frame (e.g. a builtin replica): keep the shape */
            msg = PyUnicode_FromFormat("Caught %U in replica %zd on device %s.\nOriginal %U%U",
                                       name, i, devbuf, prefix, text);
        }
        Py_DECREF(prefix);
    }
    if (msg == NULL) {
        goto fail;
    }

    if (tp == PyExc_KeyError) {
        arg = keyerror_message(st, msg);
    } else {
        arg = Py_NewRef(msg);
    }
    attr = PyObject_GetAttrString(tp, "message");
    if (attr == NULL) {
        PyErr_Clear();
    }
    if (attr != NULL && PyObject_IsTrue(attr) == 1) {
        noargs = PyTuple_New(0);
        kw = Py_BuildValue("{sO}", "message", arg);
        if (noargs != NULL && kw != NULL) {
            wrapped = PyObject_Call(tp, noargs, kw);
        }
    } else {
        PyErr_Clear();
        wrapped = PyObject_CallOneArg(tp, arg);
    }
    if (wrapped != NULL && !PyExceptionInstance_Check(wrapped)) {
        Py_CLEAR(wrapped);
    }
    if (wrapped == NULL) {
        if (PyErr_Occurred() && !PyErr_ExceptionMatches(PyExc_Exception)) {
            goto fail;   /* e.g. KeyboardInterrupt while building it: keep it */
        }
        PyErr_Clear();
        wrapped = PyObject_CallOneArg(PyExc_RuntimeError, msg);
        if (wrapped == NULL) {
            goto fail;
        }
    }
    PyException_SetCause(wrapped, Py_NewRef(exc));
    PyErr_SetObject((PyObject *)Py_TYPE(wrapped), wrapped);
fail:
    Py_XDECREF(tb);
    Py_XDECREF(lines);
    Py_XDECREF(empty);
    Py_XDECREF(text);
    Py_XDECREF(name);
    Py_XDECREF(msg);
    Py_XDECREF(arg);
    Py_XDECREF(attr);
    Py_XDECREF(kw);
    Py_XDECREF(noargs);
    Py_XDECREF(wrapped);
}

/* ------------------------------------------------------------------ */
/* Helpers: arguments                                                  */
/* ------------------------------------------------------------------ */

/* One replica's positional arguments as an exact tuple (new reference):
 * a list or tuple is unpacked, anything else becomes (input,) (spec 6.3). */
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

/* ------------------------------------------------------------------ */
/* Helpers: parallel_apply                                             */
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

/* Runs on the worker of job->dev (pool.c): takes the GIL, enters the
 * caller's context copy, calls the replica, records the outcome. */
static void apply_job_main(void *arg)
{
    apply_job *job = arg;
    int *wl = dp_pool_worker_local();
    int unpinned[2] = {1, 0};   /* no worker-local ints (pool.h): plain GILState */
    if (wl == NULL) {
        wl = unpinned;
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
    PyGILState_STATE g = PyGILState_Ensure();
    if (!job->cancelled) {
        job->ident = PyThread_get_thread_ident();
        job->state = JOB_RUNNING;
        wl[WL_DEPTH]++;
        /* A replica on a GPU runs with that GPU current, so CuPy / PyTorch
         * code in the module allocates and launches on its device. */
        dpc_status cs = job->dev.kind == DP_CUDA ? dpc_set_device(job->dev.index) : dpc_ok();
        if (cs.code != 0) {
            PyObject *mod = PyImport_ImportModule("dpmini._dpmini");
            if (mod != NULL) {
                dp_gpu_raise(dp_state_from_module(mod), cs, "replica: make the GPU current");
                Py_DECREF(mod);
            }
            job->exc = take_exception();
        } else if (PyContext_Enter(job->ctx) < 0) {
            job->exc = take_exception();
        } else {
            /* torch's grad mode is per thread: carry the caller's over, as
             * torch.nn.parallel.parallel_apply does. */
            int prev = job->torch_no_grad ? dp_torch_set_grad(0) : -1;
            int cast = job->torch_autocast != NULL && dp_torch_autocast_enter(job->torch_autocast);
            job->result = PyObject_Call(job->module, job->args, job->kwargs);
            if (cast) {
                dp_torch_autocast_exit(job->torch_autocast);
            }
            if (job->result == NULL) {
                job->exc = take_exception();
            }
            if (prev >= 0) {
                dp_torch_set_grad(prev);
            }
            if (PyContext_Exit(job->ctx) < 0) {
                PyObject *e = take_exception();
                if (job->exc == NULL) {
                    Py_CLEAR(job->result);
                    job->exc = e;
                } else {
                    Py_DECREF(e);
                }
            }
        }
        wl[WL_DEPTH]--;
        if (job->interrupted) {
            /* An injected exception that arrived after the call returned
             * must not fire in this worker's next job. */
            PyThreadState_SetAsyncExc(job->ident, NULL);
        }
    }
    job->state = JOB_DONE;
    PyGILState_Release(g);
}

/* Runs job in the calling thread (GIL held). */
static void apply_job_inline(apply_job *job)
{
    job->state = JOB_RUNNING;
    job->result = PyObject_Call(job->module, job->args, job->kwargs);
    if (job->result == NULL) {
        job->exc = take_exception();
    }
    job->state = JOB_DONE;
}

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

/* Run the m prepared jobs and return their results as a list, in replica
 * order; on failure re-raise the first failing replica's error (spec 6.5). */
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

/* Undo blas_limit (steals token). dpmini._blas.restore does not raise; if
 * it still fails, the error is reported as unraisable, not lost silently. */
static void blas_restore(PyObject *token)
{
    if (token == Py_None) {
        Py_DECREF(token);
        return;
    }
    PyObject *mod = PyImport_ImportModule("dpmini._blas");
    PyObject *r = mod ? PyObject_CallMethod(mod, "restore", "O", token) : NULL;
    if (r == NULL) {
        PyErr_WriteUnraisable(token);
    }
    Py_XDECREF(r);
    Py_XDECREF(mod);
    Py_DECREF(token);
}

static PyObject *run_jobs(dp_state *st, apply_job *jobs, Py_ssize_t m)
{
    dp_batch batch;
    int have_batch = 0, nsubmitted = 0, nested = replica_depth() > 0, trim = 0;
    PyObject *abort = NULL;   /* stops the whole call: signal, submit failure */
    PyObject *result = NULL;
    char devbuf[32];

    for (Py_ssize_t i = 0; i < m; i++) {
        apply_job *job = &jobs[i];
        job->on_worker = !(m == 1 || nested || job->dev.kind == DP_HOST ||
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
            return NULL;
        }
        if (job->on_worker && !have_batch) {
            int rc = dp_batch_init(&batch);
            if (rc != 0) {
                PyErr_Format(PyExc_RuntimeError, "parallel_apply: cannot create a job batch (%s)",
                             strerror(rc));
                return NULL;
            }
            have_batch = 1;
            dp_pool_set_exit_hook(worker_exit);
        }
    }
    if (have_batch && check_threads_per_device(jobs, m) < 0) {
        dp_batch_destroy(&batch);
        return NULL;
    }
    PyObject *blas = blas_limit(jobs, m, nested);
    if (blas == NULL) {
        if (have_batch) {
            dp_batch_destroy(&batch);
        }
        return NULL;
    }
    /* Queue the worker jobs first, then run the inline ones meanwhile. */
    for (Py_ssize_t i = 0; i < m && abort == NULL; i++) {
        apply_job *job = &jobs[i];
        if (!job->on_worker) {
            continue;
        }
        job->ctx = PyContext_CopyCurrent();
        job->torch_no_grad = dp_torch_grad_enabled() == 0;
        job->torch_autocast = dp_torch_autocast_carry();
        if (job->ctx == NULL) {
            job->on_worker = 0;
            job->cancelled = 1;
            abort = take_exception();
            break;
        }
        int rc = dp_batch_submit(&batch, job->dev.kind, job->dev.index, apply_job_main, job);
        if (rc != 0) {
            dp_device_format(job->dev, devbuf, sizeof devbuf);
            if (rc == EAGAIN || rc == ENOMEM) {
                PyErr_Format(PyExc_RuntimeError,
                             "parallel_apply: cannot start a worker thread for replica %zd on "
                             "device %s (%s: the process is out of memory, address space or "
                             "threads); no replica of this call is left running",
                             i, devbuf, strerror(rc));
                trim = 1;
            } else {
                PyErr_Format(PyExc_RuntimeError,
                             "parallel_apply: cannot queue replica %zd on the worker of device "
                             "%s (%s)", i, devbuf, strerror(rc));
            }
            job->on_worker = 0;
            job->cancelled = 1;
            abort = take_exception();
            break;
        }
        nsubmitted++;
    }
    for (Py_ssize_t i = 0; i < m; i++) {
        apply_job *job = &jobs[i];
        if (job->on_worker || job->cancelled) {
            continue;
        }
        if (abort != NULL) {
            job->cancelled = 1;
            continue;
        }
        apply_job_inline(job);
        if (job->exc != NULL && !PyObject_IsInstance(job->exc, PyExc_Exception)) {
            /* KeyboardInterrupt or SystemExit in the caller: stop the rest. */
            abort = Py_NewRef(job->exc);
            interrupt_jobs(jobs, m, (PyObject *)Py_TYPE(abort));
        }
    }
    if (abort != NULL) {
        interrupt_jobs(jobs, m, NULL);   /* unstarted worker jobs are skipped */
    }
    while (nsubmitted > 0) {
        int done;
        Py_BEGIN_ALLOW_THREADS
        done = dp_batch_wait(&batch, DP_WAIT_SLICE_MS);
        Py_END_ALLOW_THREADS
        if (done) {
            break;
        }
        if (PyErr_CheckSignals() < 0) {
            PyObject *e = take_exception();
            interrupt_jobs(jobs, m, (PyObject *)Py_TYPE(e));
            if (abort == NULL) {
                abort = e;
            } else {
                Py_DECREF(e);
            }
        }
    }
    blas_restore(blas);   /* every replica has finished */
    if (have_batch) {
        dp_batch_destroy(&batch);
    }
    if (trim) {
        /* Let idle workers go, so that the threads this failed call started
         * give their stacks back and the next call has room. */
        dp_pool_trim();
        Py_BEGIN_ALLOW_THREADS   /* their exit hooks take the GIL */
        (void)dp_pool_trim_wait(2000);
        Py_END_ALLOW_THREADS
    }
    if (abort != NULL) {
        restore_exception(abort);
        return NULL;
    }
    for (Py_ssize_t i = 0; i < m; i++) {
        if (jobs[i].no_tstate) {
            dp_device_format(jobs[i].dev, devbuf, sizeof devbuf);
            PyErr_Format(PyExc_MemoryError,
                         "parallel_apply: out of memory making a Python thread state for "
                         "replica %zd's worker thread on device %s", i, devbuf);
            return NULL;
        }
        if (jobs[i].exc != NULL) {
            raise_replica_error(st, jobs[i].exc, i, jobs[i].dev);
            return NULL;
        }
        if (jobs[i].result == NULL) {
            PyErr_Format(PyExc_SystemError, "parallel_apply: replica %zd did not run", i);
            return NULL;
        }
    }
    result = PyList_New(m);
    if (result == NULL) {
        return NULL;
    }
    for (Py_ssize_t i = 0; i < m; i++) {
        PyList_SET_ITEM(result, i, jobs[i].result);
        jobs[i].result = NULL;
    }
    return result;
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
            PyArrayObject *aa = dp_as_array(st, a, "args", 0); /* GPU arrays: the shadow */
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

/* parallel_apply over Python sequences. Devices come from cdevs (ncdevs
 * entries, must equal the module count) when given, else from `devices`
 * (None or a sequence, None entries allowed), else auto_device. */
PyObject *parallel_apply_run(dp_state *st, PyObject *modules, PyObject *inputs,
                             PyObject *kwargs_tup, PyObject *devices,
                             const dp_device *cdevs, Py_ssize_t ncdevs)
{
    PyObject *mods = NULL, *ins = NULL, *kws = NULL, *devseq = NULL, *result = NULL;
    apply_job small[DP_SMALL_JOBS];
    apply_job *jobs = small;
    dp_device *defaults = NULL;
    Py_ssize_t ndefaults = 0, m = 0;

    mods = PySequence_Fast(modules, "parallel_apply: modules must be a sequence of callables");
    if (mods == NULL) {
        goto fail;
    }
    m = PySequence_Fast_GET_SIZE(mods);
    ins = PySequence_Fast(inputs, "parallel_apply: inputs must be a sequence (one entry per module)");
    if (ins == NULL) {
        m = 0;
        goto fail;
    }
    if (PySequence_Fast_GET_SIZE(ins) != m) {
        PyErr_Format(PyExc_ValueError,
                     "parallel_apply: the number of modules (%zd) is not equal to the number "
                     "of inputs (%zd)", m, PySequence_Fast_GET_SIZE(ins));
        m = 0;
        goto fail;
    }
    if (kwargs_tup != NULL && kwargs_tup != Py_None) {
        kws = PySequence_Fast(kwargs_tup, "parallel_apply: kwargs_tup must be a sequence of dicts");
        if (kws == NULL || PySequence_Fast_GET_SIZE(kws) != m) {
            if (kws != NULL) {
                PyErr_Format(PyExc_ValueError,
                             "parallel_apply: the number of modules (%zd) is not equal to the "
                             "number of kwargs_tup entries (%zd)", m, PySequence_Fast_GET_SIZE(kws));
            }
            m = 0;
            goto fail;
        }
    }
    if (cdevs != NULL) {
        if (ncdevs != m) {
            PyErr_Format(PyExc_ValueError,
                         "parallel_apply: the number of modules (%zd) is not equal to the "
                         "number of devices (%zd)", m, ncdevs);
            m = 0;
            goto fail;
        }
    } else if (devices != NULL && devices != Py_None) {
        devseq = PySequence_Fast(devices, "parallel_apply: devices must be a sequence of devices");
        if (devseq == NULL || PySequence_Fast_GET_SIZE(devseq) != m) {
            if (devseq != NULL) {
                PyErr_Format(PyExc_ValueError,
                             "parallel_apply: the number of modules (%zd) is not equal to the "
                             "number of devices (%zd)", m, PySequence_Fast_GET_SIZE(devseq));
            }
            m = 0;
            goto fail;
        }
    }
    if (m > DP_SMALL_JOBS) {
        jobs = PyMem_Calloc((size_t)m, sizeof *jobs);
        if (jobs == NULL) {
            jobs = small;
            m = 0;
            PyErr_NoMemory();
            goto fail;
        }
    } else {
        memset(small, 0, sizeof small);
    }
    for (Py_ssize_t i = 0; i < m; i++) {
        apply_job *job = &jobs[i];
        job->module = Py_NewRef(PySequence_Fast_GET_ITEM(mods, i));
        job->args = input_as_args(PySequence_Fast_GET_ITEM(ins, i));
        if (job->args == NULL) {
            goto fail;
        }
        if (kws != NULL &&
            kwargs_as_dict(PySequence_Fast_GET_ITEM(kws, i), "kwargs_tup", i, &job->kwargs) < 0) {
            goto fail;
        }
        PyObject *dev = devseq ? PySequence_Fast_GET_ITEM(devseq, i) : Py_None;
        if (cdevs != NULL) {
            job->dev = cdevs[i];
        } else if (dev != Py_None) {
            char name[40];
            snprintf(name, sizeof name, "devices[%zd]", i);
            if (dp_device_from_object(st, dev, name, 0, &job->dev) < 0) {
                goto fail;
            }
        } else if (auto_device(st, job->args, i, &defaults, &ndefaults, &job->dev) < 0) {
            goto fail;
        }
    }
    result = run_jobs(st, jobs, m);
fail:
    for (Py_ssize_t i = 0; i < m; i++) {
        Py_XDECREF(jobs[i].module);
        Py_XDECREF(jobs[i].args);
        Py_XDECREF(jobs[i].kwargs);
        Py_XDECREF(jobs[i].ctx);
        Py_XDECREF(jobs[i].torch_autocast);
        Py_XDECREF(jobs[i].result);
        Py_XDECREF(jobs[i].exc);
    }
    if (jobs != small) {
        PyMem_Free(jobs);
    }
    PyMem_Free(defaults);
    Py_XDECREF(mods);
    Py_XDECREF(ins);
    Py_XDECREF(kws);
    Py_XDECREF(devseq);
    return result;
}

/* ------------------------------------------------------------------ */
/* Public functions: module level                                      */
/* ------------------------------------------------------------------ */

PyDoc_STRVAR(parallel_apply_doc,
"parallel_apply(modules, inputs, kwargs_tup=None, devices=None)\n--\n\n"
"Returns a list with one result per module.\n"
"Call modules[i](*inputs[i], **kwargs_tup[i]) for every i, each on the\n"
"persistent worker thread of devices[i] (PyTorch parallel_apply, spec §6);\n"
"return the results as a list in index order (spec 6.4).\n"
"inputs[i]: a list or tuple is unpacked, anything else is passed as the one\n"
"positional argument. kwargs_tup: None (no keywords) or one dict per module.\n"
"devices: None, or one device per module (None entries allowed); a missing\n"
"device is that of the first array among inputs[i]'s top-level items when\n"
"it lives on a device, else entry i of the default device list.\n"
"Each worker holds the GIL while it runs Python code and enters a copy of\n"
"the caller's contextvars context (numpy.errstate etc. apply, like PyTorch\n"
"copying grad mode, spec 6.2). With one module, or when called from inside\n"
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

static PyObject *dp_parallel_apply(PyObject *mod, PyObject *args, PyObject *kwargs)
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
    {"parallel_apply", (PyCFunction)(void (*)(void))dp_parallel_apply,
     METH_VARARGS | METH_KEYWORDS, parallel_apply_doc},
    {NULL, NULL, 0, NULL},
};
