/* pool.h - one persistent worker thread per device, and batches of jobs.
 *
 * No Python.h. Workers are process-wide (devices are process-wide
 * resources); a worker is started the first time a job is sent to its device
 * and lives until the process exits. After fork() the child starts with no
 * workers and starts new ones on demand (pthread_atfork).
 *
 * A job is a function and an argument. Jobs sent to one device run one after
 * another, in submission order, on that device's thread. Jobs of different
 * devices run at the same time.
 *
 * The pool knows nothing of the GIL. A job that touches Python objects takes
 * the GIL itself (PyGILState_Ensure), and a caller that waits for such a job
 * must not hold the GIL while it waits.
 */
#ifndef DPMINI_POOL_H
#define DPMINI_POOL_H

#include <pthread.h>

/* Worker slots: one per (device kind, index). kind 1 = virtual CPU device,
 * kind 2 = CUDA device; index 0 .. DP_POOL_MAX_INDEX-1. */
#define DP_POOL_MAX_INDEX 256

typedef void (*dp_job_fn)(void *arg);

/* A batch: a count of jobs not yet finished, with a mutex and a condition.
 * Caller-owned (usually on the stack). Must outlive all its jobs: always wait
 * for a batch to finish (dp_batch_wait returning 1) before destroying it. */
typedef struct {
    pthread_mutex_t mu;
    pthread_cond_t done_cv;
    int pending;   /* jobs submitted and not finished; guarded by mu */
} dp_batch;

/* Returns 0, or an errno value if the mutex/condition cannot be made. */
int dp_batch_init(dp_batch *b);
void dp_batch_destroy(dp_batch *b);

/* Queue fn(arg) on the worker of (kind, index), starting the worker if needed.
 * Returns 0, or an errno value (EINVAL for a bad kind/index, or the error of
 * pthread_create / malloc); on failure the job is not queued and the batch's
 * count is unchanged. */
int dp_batch_submit(dp_batch *b, int kind, int index, dp_job_fn fn, void *arg);

/* Wait until every job of the batch has finished. timeout_ms < 0 waits
 * forever. Returns 1 when all are finished, 0 on timeout. */
int dp_batch_wait(dp_batch *b, long timeout_ms);

/* True when the calling thread is the worker of (kind, index). */
int dp_pool_on_worker(int kind, int index);

/* True when the calling thread is any pool worker. Code running inside a
 * job (a replica) that wants more copies done must run them inline: waiting
 * on another worker could deadlock when that worker waits on this one. */
int dp_pool_in_worker(void);

#endif
