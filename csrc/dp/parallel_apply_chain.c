/* parallel_apply_chain.c - the memory of one parallel_apply call that the
 * worker threads share (apply_run: the jobs, their batch and pool nodes),
 * and the chain that wakes the workers of jobs on virtual CPU devices one
 * after another while a worker that has finished its own replica runs the
 * jobs whose workers were not woken yet. The workers' side (apply_job_main)
 * and the caller's (run_jobs) are in parallel_apply.c.
 */
#include "dpmini.h"
#include "parallel_apply.h"
#include "pool.h"

#include <string.h>

/* ------------------------------------------------------------------ */
/* The run                                                             */
/* ------------------------------------------------------------------ */

/* pool.c calls this after the last job of an abandoned run (no GIL). */
void run_free(void *arg)
{
    apply_run *run = arg;
    dp_batch_destroy(&run->batch);
    dp_prof_session_release(run->prof_hold);
    PyMem_RawFree(run);
}

/* The jobs move into a heap apply_run while workers may touch them: NULL
 * with MemoryError, or the run with its batch made. */
apply_run *run_new(apply_job *jobs, Py_ssize_t m)
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
void run_end(apply_run *run, apply_job *jobs, Py_ssize_t m)
{
    memcpy(jobs, run->jobs, (size_t)m * sizeof *jobs);
    run_free(run);
}

/* Give up waiting (GIL held): the finished jobs go back to the caller's
 * array; each unfinished worker job stays in the run, marked abandoned, and
 * its worker drops its references when the replica returns; the last
 * worker frees the run. The caller's copy of an abandoned job is zeroed, so
 * it owns nothing there. */
void run_abandon(apply_run *run, apply_job *jobs, Py_ssize_t m)
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

/* ------------------------------------------------------------------ */
/* The chain                                                           */
/* ------------------------------------------------------------------ */

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
void chain_wake(apply_run *run)
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
apply_job *claim_next(apply_run *run)
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
