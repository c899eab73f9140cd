/* pool.h - one persistent worker thread per device, and batches of jobs.
 *
 * No Python.h. Workers are process-wide (devices are process-wide
 * resources). Each device has a small set of persistent threads: a job goes
 * to an idle thread of its device, and when every thread of the device is
 * busy, a new one is started (up to DP_POOL_MAX_THREADS per device; beyond
 * that, jobs queue until a thread is free). A device's first thread is
 * started by its first job and lives until the process exits; threads beyond
 * DP_POOL_KEEP_THREADS exit after a while idle. After fork() the child starts
 * with no workers and starts new ones on demand (pthread_atfork).
 *
 * A job is a function and an argument. Jobs are taken in submission order,
 * but jobs sent to one device may run at the same time (on different
 * threads of that device), and so do jobs of different devices: there is no
 * ordering between the jobs of a batch. This is what lets a job wait for
 * work that another thread sends to its own device (no deadlock below the
 * cap), and what runs replicas on a repeated device concurrently, like
 * PyTorch's one thread per replica.
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

/* Threads per device: at most DP_POOL_MAX_THREADS run jobs at once; the
 * first DP_POOL_KEEP_THREADS stay when idle, the others exit after ~10 s
 * without work. parallel_apply refuses a call with more replicas on one
 * device than this up front (they may wait on each other, so they must all
 * run at once); 1024 threads of 8 MiB stack is 8 GiB of address space. */
#define DP_POOL_MAX_THREADS 1024
#define DP_POOL_KEEP_THREADS 4

typedef void (*dp_job_fn)(void *arg);

/* A batch: a count of jobs not yet finished, with a mutex and a condition.
 * Caller-owned (usually on the stack). Must outlive all its jobs: wait for a
 * batch to finish (dp_batch_wait returning 1) before destroying it, or hand
 * it to its workers with dp_batch_abandon. */
typedef struct {
    pthread_mutex_t mu;
    pthread_cond_t done_cv;
    int pending;   /* jobs submitted and not finished; guarded by mu */
    int sleepers;  /* threads blocked in dp_batch_wait; guarded by mu */
    void (*orphan_free)(void *);  /* set by dp_batch_abandon; guarded by mu */
    void *orphan_arg;
} dp_batch;

/* Returns 0, or an errno value if the mutex/condition cannot be made. */
int dp_batch_init(dp_batch *b);
void dp_batch_destroy(dp_batch *b);

/* Queue fn(arg) for a thread of device (kind, index), starting one if every
 * thread of the device is busy (and the device is under its cap). Returns 0,
 * or an errno value (EINVAL for a bad kind/index, or the error of
 * pthread_create / malloc when the device has no thread at all); on failure
 * the job is not queued and the batch's count is unchanged. */
int dp_batch_submit(dp_batch *b, int kind, int index, dp_job_fn fn, void *arg);

/* A job node that the caller keeps (dp_batch_submit_quiet), for jobs that
 * may be run by someone else before a thread of their device is woken for
 * them. The fields are pool.c's; the node must stay valid until the batch
 * has finished (it lives with the batch, e.g. in the same heap block). */
typedef struct dp_job_node {
    struct dp_job_node *next;
    dp_job_fn fn;
    void *arg;
    dp_batch *batch;
    void *slot;     /* the device's slot */
    int state;      /* DP_NODE_*; guarded by the slot's mutex */
    int owned;      /* 1: malloc'd by dp_batch_submit, freed after its job */
} dp_job_node;

/* What dp_job_wake / dp_job_withdraw found: the node was still queued and
 * no thread had been woken for it (QUIET), it was queued and a thread was
 * woken for it (LOUD), a thread has taken it (TAKEN: its job runs or has
 * run), it was withdrawn (REMOVED). */
enum { DP_NODE_QUIET = 0, DP_NODE_LOUD = 1, DP_NODE_TAKEN = 2, DP_NODE_REMOVED = 3 };

/* Like dp_batch_submit, with the caller's node, but quiet: the job is
 * queued and counted in the batch, and the device has a thread for it
 * (started here when needed, with the same errors as dp_batch_submit), but
 * no thread takes it until dp_job_wake(node); dp_job_withdraw(node) takes
 * it out of the queue instead. parallel_apply uses it to wake the replicas'
 * workers in a chain after the GIL is released (parallel_apply.c). */
int dp_batch_submit_quiet(dp_batch *b, int kind, int index, dp_job_fn fn, void *arg,
                          dp_job_node *node);

/* Let a thread of the node's device take it (QUIET -> LOUD). Returns the
 * state it found: QUIET when this call woke a thread for it, or LOUD,
 * TAKEN, REMOVED, when there was nothing to do. */
int dp_job_wake(dp_job_node *node);

/* Take a quiet node (with woken_too, also a woken one that no thread has
 * taken yet: the thread woken for it goes back to wait) out of its queue:
 * its job will not run on the pool. It still counts in its batch until the
 * caller calls dp_batch_finish for it. Returns the state it found; the node
 * was withdrawn when that is QUIET (or LOUD, with woken_too), and is left
 * as it is otherwise. */
int dp_job_withdraw(dp_job_node *node, int woken_too);

/* Count n withdrawn jobs of b as finished, as their threads would have;
 * the last one may free an abandoned batch (dp_batch_abandon), so b must
 * not be touched afterwards unless the caller still holds a job of b. */
void dp_batch_finish(dp_batch *b, int n);

/* Wait until every job of the batch has finished. timeout_ms < 0 waits
 * forever. Returns 1 when all are finished, 0 on timeout. */
int dp_batch_wait(dp_batch *b, long timeout_ms);

/* Give up waiting for b: when its last job finishes, the worker that ran
 * it calls free_fn(arg) (without the GIL, after its last touch of b), which
 * must dp_batch_destroy b and free the memory holding it and the jobs.
 * Returns 0 when that is now the workers' task, or 1 when every job had
 * already finished: then nothing is called and the caller destroys b as
 * usual. parallel_apply uses it to return from Ctrl-C while a replica is
 * stuck in a C call (docs/reliability.md). */
int dp_batch_abandon(dp_batch *b, void (*free_fn)(void *), void *arg);

/* Ask every idle worker thread of every device to exit (they release their
 * stacks); devices start threads again on demand. parallel_apply calls it
 * when a thread could not be started (out of memory or threads), so that a
 * failed call does not keep the address space it took. Returns at once. */
void dp_pool_trim(void);
/* Wait until the threads dp_pool_trim asked to leave have run the exit hook
 * and returned (their stacks go back to glibc's stack cache or the system),
 * at most timeout_ms. Returns 1 when all have left, 0 on timeout. Call
 * without locks that the exit hook takes (the GIL: see parallel_apply.c). */
int dp_pool_trim_wait(long timeout_ms);

/* A function every worker thread calls just before it exits (idle timeout
 * or dp_pool_trim; not at process exit), e.g. to free its Python thread
 * state. Set once, before the first job. */
typedef void (*dp_exit_hook_fn)(void);
void dp_pool_set_exit_hook(dp_exit_hook_fn fn);

/* Two ints of per-thread storage for the code a worker runs (parallel_apply
 * keeps its thread-state flag and nesting depth there), zero when the
 * thread starts; NULL on threads that are not workers. The pool keeps no
 * _Thread_local variables: glibc allocates a dlopen'ed library's
 * thread-locals lazily, on a thread's first access, and aborts the process
 * ("cannot allocate memory for thread-local data") when that allocation
 * fails, so worker identity lives on the worker's stack, found through a
 * pthread key (docs/reliability.md). */
int *dp_pool_worker_local(void);

/* True when the calling thread is a worker thread of (kind, index). */
int dp_pool_on_worker(int kind, int index);

/* Bumped in a fork() child (pthread_atfork). A job that runs more work
 * after calling Python code compares it before and after, so that the
 * thread that forked does not go on running the parent's work in the
 * child. */
unsigned dp_pool_fork_generation(void);

/* True when the calling thread is any pool worker. dpmini runs the copies
 * and nested replicas of code that runs inside a job (a replica) inline in
 * that thread: a pool thread then never waits on the pool, so no chain of
 * waits can exhaust a device's DP_POOL_MAX_THREADS and deadlock, and small
 * nested work does not grow the thread count. */
int dp_pool_in_worker(void);

/* A caller that will hand the workers more jobs within a millisecond or
 * two (the steps of one DataParallel call: scatter, broadcast, replicas)
 * says so with +1 when it starts and -1 when it is done (calls nest and
 * overlap: a count). Meanwhile a worker that finishes a job polls for the
 * next one for up to EXPECTED_SPIN_NS instead of its usual spin, so that
 * it does not fall asleep between the steps: waking it again costs from
 * tens of microseconds to milliseconds on a virtual machine whose vCPU
 * was halted. */
void dp_pool_expect_work(int delta);

/* Wake an idle thread of device (kind, index), if one sleeps, to poll for
 * a job the caller is about to submit (as after dp_pool_expect_work), so
 * that its wake-up overlaps the caller's own preparation. Nothing for a
 * bad kind or index. */
void dp_pool_prewake(int kind, int index);

/* Threads the device (kind, index) has now (0 before its first job), or -1
 * for a bad kind/index. For tests and diagnostics. */
int dp_pool_threads(int kind, int index);

/* The cores this process may run on (its affinity mask), at least 1: how
 * many workers copying at once can run side by side. */
int dp_pool_cores(void);

#endif
