/* parallel_apply.h - internal: what the parallel_apply files share:
 * parallel_apply.c (the worker threads and running a batch of replica calls),
 * parallel_apply_chain.c (the call's shared memory and the wake chain),
 * parallel_apply_errors.c (taking and re-raising a replica's exception) and
 * parallel_apply_entry.c (arguments, devices and the Python entry point).
 * Not part of dpmini.h; include after it.
 *
 * Conventions as in dpmini.h: PyObject* results are new references or NULL
 * with an exception set. The symbols below are hidden: they do not widen
 * what the extension module exports.
 */
#ifndef DPMINI_PARALLEL_APPLY_H
#define DPMINI_PARALLEL_APPLY_H

#include "dpmini.h"
#include "pool.h"
#include "profile.h"

#pragma GCC visibility push(hidden)

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
    apply_run *run;        /* the call's run (worker jobs, parallel_apply_chain.c) */
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

/* parallel_apply_chain.c: the run of jobs[0..m) (a copy, each job's `run`
 * set, none chained), with its batch made; NULL with MemoryError or
 * RuntimeError. */
apply_run *run_new(apply_job *jobs, Py_ssize_t m);
/* parallel_apply_chain.c: every job has finished: the jobs go back to the
 * caller's array and the run is freed. */
void run_end(apply_run *run, apply_job *jobs, Py_ssize_t m);
/* parallel_apply_chain.c: give up waiting (GIL held, Ctrl-C): finished jobs
 * go back to the caller's array, unfinished ones stay, marked abandoned, and
 * the last worker frees the run. */
void run_abandon(apply_run *run, apply_job *jobs, Py_ssize_t m);
/* parallel_apply_chain.c: free a run (no GIL needed). */
void run_free(void *run);
/* parallel_apply_chain.c: wake the worker of the next chained job nobody
 * has claimed (any thread, no GIL). */
void chain_wake(apply_run *run);
/* parallel_apply_chain.c: claim a chained job whose worker has not started
 * (GIL held); its pool node is withdrawn, and the caller counts it finished
 * in the batch later (dp_batch_finish). NULL when none is left. */
apply_job *claim_next(apply_run *run);

/* parallel_apply.c: drop the references a job owns (GIL held). */
void job_clear(apply_job *job);
/* parallel_apply_errors.c: the exception being raised, as an instance with
 * its traceback attached (new reference); the error indicator is cleared.
 * Never NULL. */
PyObject *replica_take_exception(void);
/* parallel_apply_errors.c: raise exc again (steals the reference). */
void restore_exception(PyObject *exc);
/* parallel_apply_errors.c: raise replica i's exception exc (borrowed) as
 * "Caught T in replica i on device d." (docs/spec.md 6.5). */
void raise_replica_error(dp_state *st, PyObject *exc, Py_ssize_t i, dp_device dev);
/* parallel_apply_context.c: call the registered replica context providers
 * once (the caller's thread, GIL held, before any job is queued) and give
 * each worker job its enters and device; 0, or -1 with the provider's error
 * raised. Loads the torch adapter first when torch is imported. */
int contexts_capture(dp_state *st, apply_job *jobs, Py_ssize_t m);
/* parallel_apply_context.c: in the job's worker thread, before its replica
 * runs: enter(job->index, device) for each enter; 0, or -1 with the error
 * raised (the contexts entered before it are left again). */
int contexts_enter(apply_job *job);
/* parallel_apply_context.c: after the replica (returned, raised or was
 * skipped): the exits in reverse order; 0, or -1 with the first error raised
 * (later ones go to sys.unraisablehook). Does nothing when none is entered. */
int contexts_exit(apply_job *job);

/* parallel_apply.c: run jobs[0..m) (on device workers or inline) and wait;
 * the list of results, or NULL with the first replica's error raised. */
PyObject *run_jobs(dp_state *st, apply_job *jobs, Py_ssize_t m);

#pragma GCC visibility pop

#endif
