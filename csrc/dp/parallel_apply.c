/* parallel_apply.c - parallel_apply: call replica i on the worker thread of
 * its device (docs/spec.md 6), for DataParallel.forward / .parallel_apply and the
 * module-level dpmini.parallel_apply; wraps a replica's exception as
 * "Caught T in replica i on device d." (docs/spec.md 6.5).
 *
 * parallel_apply: replica i runs on a persistent worker thread of its device
 * (a device has more than one when its jobs overlap, pool.h),
 * which takes the GIL and enters a copy of the caller's contextvars context
 * and the replica contexts that libraries registered (torch's grad mode,
 * autocast, streams: docs/spec.md 6.2; parallel_apply_context.c). The caller waits
 * with the GIL released, in 50 ms slices so that Ctrl-C still works.
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
 * Sections: types; helpers (the worker, running a batch). A replica's
 * exception is taken and re-raised in parallel_apply_errors.c; arguments and
 * the entry points are in parallel_apply_entry.c; the replica contexts in
 * parallel_apply_context.c.
 */
#include "dpmini.h"
#include "dataparallel.h"
#include "parallel_apply.h"
#include "dp.h"
#include "pool.h"
#include "cuda_api.h"

#include <errno.h>
#include <string.h>

/* ------------------------------------------------------------------ */
/* Types                                                               */
/* ------------------------------------------------------------------ */

#define DP_WAIT_SLICE_MS 50              /* signal checks while waiting  */
#define DP_GRACE_MS 1000                 /* after Ctrl-C, wait this long for
                                            the replicas before giving up */

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

void job_clear(apply_job *job)
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
 * contexts (parallel_apply_context.c). 0, or -1 with the error raised and
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
 * order; on failure re-raise the first failing replica's error (docs/spec.md 6.5). */
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

PyObject *run_jobs(dp_state *st, apply_job *caller_jobs, Py_ssize_t m)
{
    apply_run *run = NULL;
    apply_job *jobs = caller_jobs;   /* run->jobs once there is a run */
    int have_batch = 0, nsubmitted = 0, nested = replica_depth() > 0, trim = 0, kicked = 0;
    int grace = -1;           /* wait slices left after an interrupt, or -1 */
    PyObject *abort = NULL;   /* stops the whole call: signal, submit failure */
    PyObject *result = NULL;
    char devbuf[32];
    dp_prof_ctx prof = dp_prof_current();

    for (Py_ssize_t i = 0; i < m; i++) {
        apply_job *job = &jobs[i];
        job->prof = prof;
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
        have_batch |= job->on_worker;
    }
    if (have_batch) {
        if (check_threads_per_device(jobs, m) < 0) {
            return NULL;
        }
        run = run_new(caller_jobs, m);
        if (run == NULL) {
            return NULL;
        }
        jobs = run->jobs;
        dp_pool_set_exit_hook(worker_exit);
        if (prof.s != NULL) {
            dp_prof_session_retain(prof.s);
            run->prof_hold = prof.s;
        }
    }
    for (Py_ssize_t i = 0; i < m; i++) {
        jobs[i].index = i;
    }
    /* The replica contexts are captured before the BLAS pools are cut: a
     * provider that reads a thread count reads the caller's own. */
    if (have_batch && contexts_capture(st, jobs, m) < 0) {
        run_end(run, caller_jobs, m);
        return NULL;
    }
    uint64_t t_blas = prof.s != NULL ? dp_prof_now() : 0;
    PyObject *blas = blas_limit(jobs, m, nested);
    if (blas != NULL && blas != Py_None) {
        dp_prof_record_since(&prof, DP_PROF_BLAS, -1, -1, t_blas, "limit");
    }
    if (blas == NULL) {
        if (have_batch) {
            run_end(run, caller_jobs, m);
        }
        return NULL;
    }
    /* Queue the worker jobs first, then run the inline ones meanwhile. */
    int numpy_alloc = -1;
    for (Py_ssize_t i = 0; i < m && abort == NULL; i++) {
        apply_job *job = &jobs[i];
        if (!job->on_worker) {
            continue;
        }
        job->ctx = PyContext_CopyCurrent();
        if (job->ctx != NULL) {
            /* set in the context copy: the caller's context keeps its own */
            if (numpy_alloc < 0) {
                numpy_alloc = dp_numpy_allocator_enabled();
            }
            job->numpy_handler = numpy_alloc ? dp_numpy_allocator(st, job->dev)
                                             : Py_NewRef(Py_None);
            if (job->numpy_handler == NULL) {
                Py_CLEAR(job->ctx);
            }
        }
        if (job->ctx == NULL) {
            job->on_worker = 0;
            job->cancelled = 1;
            abort = replica_take_exception();
            break;
        }
        int rc;
        job->queued_ns = prof.s != NULL ? dp_prof_now() : 0;
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
            abort = replica_take_exception();
            break;
        }
        nsubmitted++;
    }
    for (Py_ssize_t i = 0; i < m && abort != NULL; i++) {
        if (jobs[i].on_worker && jobs[i].ctx == NULL) {
            /* after the failing one: never queued, so no worker owns it */
            jobs[i].on_worker = 0;
            jobs[i].cancelled = 1;
        }
    }
    for (Py_ssize_t i = 0; i < m; i++) {
        apply_job *job = &jobs[i];
        if (job->on_worker || job->cancelled) {
            continue;
        }
        if (nsubmitted > 0 && !kicked) {
            /* An inline replica may wait for a worker replica (a barrier):
             * start the chain now. The woken worker waits for the GIL. */
            chain_wake(run);
            kicked = 1;
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
            grace = DP_GRACE_MS / DP_WAIT_SLICE_MS;
        }
    }
    if (abort != NULL) {
        interrupt_jobs(jobs, m, NULL);   /* unstarted worker jobs are skipped */
    }
    int abandoned = 0;
    uint64_t t_wait = prof.s != NULL && nsubmitted > 0 ? dp_prof_now() : 0;
    while (nsubmitted > 0) {
        int done;
        Py_BEGIN_ALLOW_THREADS
        if (!kicked) {
            chain_wake(run);   /* with the GIL released: the worker takes it at once */
            kicked = 1;
        }
        done = dp_batch_wait(&run->batch, DP_WAIT_SLICE_MS);
        Py_END_ALLOW_THREADS
        if (done) {
            break;
        }
        if (grace == 0) {
            /* Replicas still run after the interrupt: stuck in a C call
             * that the KeyboardInterrupt reaches only when it returns. */
            run_abandon(run, caller_jobs, m);
            abandoned = 1;
            break;
        }
        if (grace > 0) {
            grace--;
        }
        if (PyErr_CheckSignals() < 0) {
            PyObject *e = replica_take_exception();
            interrupt_jobs(jobs, m, (PyObject *)Py_TYPE(e));
            /* the first interrupt starts the grace, a second one ends it */
            grace = grace < 0 ? DP_GRACE_MS / DP_WAIT_SLICE_MS : 0;
            if (abort == NULL) {
                abort = e;
            } else {
                Py_DECREF(e);
            }
        }
    }
    if (nsubmitted > 0) {
        dp_prof_record_since(&prof, DP_PROF_WAIT, -1, -1, t_wait, "replicas");
    }
    t_blas = prof.s != NULL && blas != Py_None ? dp_prof_now() : 0;
    int blas_set = blas != Py_None;
    blas_restore(blas);   /* every replica has finished, or is abandoned */
    if (blas_set) {
        dp_prof_record_since(&prof, DP_PROF_BLAS, -1, -1, t_blas, "restore");
    }
    if (have_batch && !abandoned) {
        run_end(run, caller_jobs, m);
    }
    jobs = caller_jobs;
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
