/* pool.c - the per-device worker threads and job batches declared in pool.h.
 *
 * One slot per (kind, index): a mutex, a condition, a queue of heap nodes
 * and counts of the slot's threads and of those that are idle (not running
 * a job). A submit queues the job and, when the queue is longer than the
 * number of idle threads, starts one more detached thread for the slot (at
 * most DP_POOL_MAX_THREADS); so a job never waits behind a running job
 * while the slot is under its cap, and a replica that waits on work it
 * handed to another thread cannot deadlock its own device. Threads take
 * the first loud job of the queue: a quiet job (dp_batch_submit_quiet) has
 * its thread counted but waits for dp_job_wake, or leaves the queue by
 * dp_job_withdraw, so that one thread may run several replicas' jobs
 * without waking the others (parallel_apply.c). Beyond
 * DP_POOL_KEEP_THREADS, a thread idle for IDLE_EXIT_MS exits, so a burst
 * does not leave dozens of threads behind.
 * In the common case (one job per device at a time) a slot has one thread.
 *
 * Latency: waking a thread blocked in a futex costs tens of microseconds, so
 * both a worker that just ran a job and a thread in dp_batch_wait spin for a
 * short while before blocking (longer while work comes in quick succession:
 * QUICK_SPIN_NS; EXPECTED_SPIN_NS while a caller has said more jobs are
 * coming), and a blocked dp_batch_wait woken by one job's end polls for
 * the others (SIBLING_SPIN_NS). The spin only *reads* the loud-job count /
 * batch count with relaxed atomic loads as a hint; every decision is then
 * confirmed under the mutex, so the mutexes still carry all the memory
 * ordering.
 *
 * Deadlock note: a job may submit to its own device and wait for that job
 * (another thread of the device runs it) as long as the device is under
 * DP_POOL_MAX_THREADS busy threads; at the cap the job queues and such a
 * wait can deadlock. dpmini's callers therefore still run copies and nested
 * replicas inline when they are on a worker (dp_pool_in_worker), so pool
 * threads never wait on the pool themselves.
 */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE 1 /* the same spelling as pyconfig.h, which may define it too */
#endif
#include "pool.h"
#include "spin.h"

#include <errno.h>
#include <stdlib.h>

#define NKINDS 2
#define STACK_BYTES ((size_t)8 << 20)   /* Python runs on workers: deep stacks */
#define IDLE_EXIT_MS 10000L             /* extra threads idle this long exit */
#define WORKER_SPIN_NS 50000L           /* idle worker polls its queue this long */
#define WAIT_SPIN_NS 50000L             /* dp_batch_wait polls this long */
/* When work comes in quick succession (a loop of small DataParallel calls),
 * a thread that blocks between two pieces of it pays a wake-up for each; on
 * an idle virtual machine waking a halted vCPU takes far longer than on a
 * busy one. So a kept worker (DP_POOL_KEEP_THREADS) whose last job came
 * less than QUICK_GAP_NS after it went idle polls for QUICK_SPIN_NS, and
 * dp_batch_wait polls that long
 * while the last batch it waited for finished within QUICK_GAP_NS. Other
 * work (long replicas, rare calls) keeps the short spins. */
#define QUICK_GAP_NS 1000000L
#define QUICK_SPIN_NS 250000L
/* A blocked dp_batch_wait is woken when one of several jobs finishes and
 * polls this long for the rest: jobs started together (replicas of one
 * call) usually end close together, and the last one's end then needs no
 * wake-up of the waiter, which may sit on a halted vCPU. */
#define SIBLING_SPIN_NS 2000000L
/* A worker's poll after a job while callers expect to hand out more
 * (dp_pool_expect_work). */
#define EXPECTED_SPIN_NS 2000000L

typedef dp_job_node job_node;

typedef struct {
    pthread_mutex_t mu;
    pthread_cond_t cv;       /* signalled when a job is queued (monotonic clock) */
    job_node *head, *tail;   /* guarded by mu */
    int nqueued;             /* jobs in the queue; guarded by mu */
    int nloud;               /* of those, the ones a thread may take (not
                                quiet, pool.h); guarded by mu, also read as
                                the spin hint */
    int nthreads;            /* threads started and not exited; guarded by mu */
    int ntrim;               /* idle threads asked to exit (dp_pool_trim);
                                guarded by mu */
    int nidle;               /* of those, the ones not running a job (spinning,
                                waiting or about to take one); guarded by mu.
                                Invariant: every idle thread takes a loud job
                                before it blocks, and nqueued <= nidle (an
                                idle thread leaves only when it is spare), so
                                every queued job has a thread for it once it
                                is loud. */
    int prewake;             /* dp_pool_prewake: an idle thread is to poll
                                instead of blocking on; guarded by mu */
    int kind, index;
} slot;

static slot slots[NKINDS][DP_POOL_MAX_INDEX];
static dp_exit_hook_fn exit_hook;   /* set once, before workers start */
static int ntrimming;               /* threads leaving for dp_pool_trim (atomic) */
static pthread_once_t slots_once = PTHREAD_ONCE_INIT;
static void init_slots(void);
/* Bumped in the fork child. A worker that finds it changed after its job is
 * the thread that called fork() inside that job, now alone in the child: it
 * must not touch the batch (its mutex may be stuck locked) and it stops,
 * which ends the child with status 0 unless the job exited or exec'd. */
static unsigned fork_gen;
/* How long the last dp_batch_wait waited (QUICK_GAP_NS when it timed out):
 * only a hint for the next one's spin, so racing updates are harmless. */
static long long last_wait_ns = QUICK_GAP_NS;
/* dp_pool_expect_work's count of callers that will hand out more jobs. */
static int expecting_callers;


/* What a worker keeps on its stack; found through worker_key. */
typedef struct {
    slot *s;
    int local[2];   /* dp_pool_worker_local */
} worker_self;

static pthread_key_t worker_key;   /* -> the worker's worker_self; made in init_slots */
static int worker_key_ok;          /* 0 when the key could not be made */

static worker_self *self_of_thread(void)
{
    pthread_once(&slots_once, init_slots);
    return worker_key_ok ? pthread_getspecific(worker_key) : NULL;
}

static void reset_slots(void)
{
    for (int k = 0; k < NKINDS; k++)
        for (int i = 0; i < DP_POOL_MAX_INDEX; i++) {
            slot *s = &slots[k][i];
            pthread_condattr_t ca;
            pthread_mutex_init(&s->mu, NULL);
            /* Idle threads time out on the monotonic clock. If the attribute
             * cannot be set, the condition uses the default clock: timeouts
             * then follow wall-clock jumps, which is harmless here. */
            if (pthread_condattr_init(&ca) == 0) {
                pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
                pthread_cond_init(&s->cv, &ca);
                pthread_condattr_destroy(&ca);
            } else {
                pthread_cond_init(&s->cv, NULL);
            }
            /* In a fork child, queued nodes are leaked on purpose: the parent
             * may have been halfway through changing the list. */
            s->head = s->tail = NULL;
            s->nqueued = 0;
            s->nloud = 0;
            s->nthreads = 0;
            s->nidle = 0;
            s->ntrim = 0;
            s->prewake = 0;
            s->kind = k + 1;
            s->index = i;
        }
}

/* Runs in the child after fork(). Only the forking thread exists there, so
 * every worker is gone and any slot mutex may be stuck locked by a thread
 * that no longer exists: start over with fresh slots (workers then start on
 * demand again) instead of waiting forever on workers that are not there. */
static void atfork_child(void)
{
    reset_slots();
    ntrimming = 0;     /* threads the parent was trimming are not here */
    fork_gen++;
    if (worker_key_ok)   /* the forking thread is no longer any slot's worker */
        (void)pthread_setspecific(worker_key, NULL);
}

static void init_slots(void)
{
    worker_key_ok = pthread_key_create(&worker_key, NULL) == 0;
    reset_slots();
    pthread_atfork(NULL, NULL, atfork_child);
}

static slot *get_slot(int kind, int index)
{
    if (kind < 1 || kind > NKINDS || index < 0 || index >= DP_POOL_MAX_INDEX)
        return NULL;
    pthread_once(&slots_once, init_slots);
    return &slots[kind - 1][index];
}

static void finish_job(dp_batch *b)
{
    void (*orphan_free)(void *) = NULL;
    void *orphan_arg = NULL;
    pthread_mutex_lock(&b->mu);
    int left = b->pending - 1;
    __atomic_store_n(&b->pending, left, __ATOMIC_RELAXED);
    /* Signal while still holding the lock: once we unlock, a waiter may see
     * pending == 0, return and destroy the batch, so the batch must not be
     * touched (not even to signal) after pthread_mutex_unlock. An abandoned
     * batch has no waiter: its last job frees it, after the unlock. */
    if (left == 0) {
        orphan_free = b->orphan_free;
        orphan_arg = b->orphan_arg;
        if (orphan_free == NULL)
            pthread_cond_signal(&b->done_cv);
    } else if (b->sleepers > 0) {
        pthread_cond_signal(&b->done_cv);   /* poll for the others (SIBLING_SPIN_NS) */
    }
    pthread_mutex_unlock(&b->mu);
    if (orphan_free != NULL)
        orphan_free(orphan_arg);
}

/* Unlink node j from s's queue, whose node prev precedes it (NULL when j is
 * the head). Called with s->mu held. */
static void unlink_node(slot *s, job_node *prev, job_node *j)
{
    if (prev)
        prev->next = j->next;
    else
        s->head = j->next;
    if (s->tail == j)
        s->tail = prev;
    j->next = NULL;
    s->nqueued--;
    if (j->state == DP_NODE_LOUD)
        __atomic_store_n(&s->nloud, s->nloud - 1, __ATOMIC_RELAXED);
}

/* The first loud node of s's queue, unlinked and marked taken; s->nloud > 0.
 * Called with s->mu held. Quiet nodes are few (one per replica of a call
 * whose worker is not woken yet), so the walk is short. */
static job_node *take_loud(slot *s)
{
    job_node *prev = NULL, *j = s->head;
    while (j->state != DP_NODE_LOUD) {
        prev = j;
        j = j->next;
    }
    unlink_node(s, prev, j);
    __atomic_store_n(&j->state, DP_NODE_TAKEN, __ATOMIC_RELAXED);
    return j;
}

/* Spin a little for loud work before sleeping on s->cv: a job that comes
 * right after the last one starts without a wake-up. Longer (QUICK_SPIN_NS)
 * when the last job came in quick succession; spin_turn stops early when
 * other threads want the core. */
static void spin_for_work(slot *s, long long idle_since, int quick)
{
    long long usual_end = idle_since + (quick ? QUICK_SPIN_NS : WORKER_SPIN_NS);
    spin_clock clock = {idle_since + EXPECTED_SPIN_NS, idle_since, 0};
    while (!__atomic_load_n(&s->nloud, __ATOMIC_RELAXED) && spin_turn(&clock)) {
        /* <= 0: a fork child may see a count its forking thread then lowers */
        if (clock.last > usual_end && __atomic_load_n(&expecting_callers, __ATOMIC_RELAXED) <= 0)
            break;
    }
}

void dp_pool_expect_work(int delta)
{
    __atomic_add_fetch(&expecting_callers, delta, __ATOMIC_RELAXED);
}

void dp_pool_prewake(int kind, int index)
{
    slot *s = get_slot(kind, index);
    if (s == NULL)
        return;
    pthread_mutex_lock(&s->mu);
    if (s->nidle > 0 && !s->nloud) {
        s->prewake = 1;
        pthread_cond_signal(&s->cv);
    }
    pthread_mutex_unlock(&s->mu);
}

/* Wait, with s->mu held, for loud work on s. 1 when there is some; 0 when
 * this thread is to leave (trimmed, or an extra thread idle for
 * IDLE_EXIT_MS), with *trimmed set for a trim; 2 when dp_pool_prewake
 * asked it to poll for work that is coming; s->mu still held. */
static int wait_for_work(slot *s, int *trimmed)
{
    while (!s->nloud) {
        if (s->prewake) {
            s->prewake = 0;
            return 2;
        }
        if (s->ntrim > 0 && s->nidle <= s->nqueued) {
            /* Quiet jobs queued since dp_pool_trim counted this thread
             * spare count on it: the trim is called off, not the job. */
            s->ntrim--;
            __atomic_sub_fetch(&ntrimming, 1, __ATOMIC_RELEASE);
            continue;
        }
        if (s->ntrim > 0) {   /* dp_pool_trim: leave now */
            s->ntrim--;
            s->nthreads--;
            s->nidle--;
            *trimmed = 1;
            return 0;
        }
        if (s->nthreads <= DP_POOL_KEEP_THREADS) {
            pthread_cond_wait(&s->cv, &s->mu);
            continue;
        }
        /* An extra thread: exit when idle for IDLE_EXIT_MS. */
        struct timespec deadline;
        long long d = now_ns() + IDLE_EXIT_MS * 1000000LL;
        deadline.tv_sec = (time_t)(d / 1000000000LL);
        deadline.tv_nsec = (long)(d % 1000000000LL);
        /* Not while quiet jobs count on this thread (nqueued <= nidle). */
        if (pthread_cond_timedwait(&s->cv, &s->mu, &deadline) == ETIMEDOUT &&
            !s->nloud && s->nthreads > DP_POOL_KEEP_THREADS && s->nidle > s->nqueued) {
            s->nthreads--;
            s->nidle--;
            return 0;
        }
    }
    return 1;
}

/* Run j, taken from s. 0, or -1 when the process forked meanwhile (gen is
 * the fork generation this thread started in): the thread then just ends. */
static int run_job(slot *s, job_node *j, unsigned gen)
{
    /* A caller's node lives until its batch has finished, which is after
     * finish_job below; a pool node is ours to free. */
    j->fn(j->arg);
    dp_batch *b = j->batch;
    if (j->owned)
        free(j);
    if (gen != fork_gen)
        return -1;
    /* Idle again before the batch can see the job finished: a caller that
     * submits its next batch right away then finds this thread idle instead
     * of starting another one. */
    pthread_mutex_lock(&s->mu);
    s->nidle++;
    pthread_mutex_unlock(&s->mu);
    finish_job(b);
    return 0;
}

static void *worker_main(void *p)
{
    slot *s = p;
    unsigned gen = fork_gen;
    int trimmed = 0;
    worker_self self = {s, {0, 0}};
    /* Keys below PTHREAD_KEY_2NDLEVEL_SIZE (32) need no memory; a later key
     * may fail with ENOMEM, and then this thread does not know it is a
     * worker: its jobs' nested work goes to the pool instead of inline,
     * which still works below DP_POOL_MAX_THREADS. */
    if (worker_key_ok)
        (void)pthread_setspecific(worker_key, &self);
    long long idle_since;
    int quick = 0;   /* the last job came in quick succession (QUICK_SPIN_NS) */
    for (;;) {
        idle_since = now_ns();
        spin_for_work(s, idle_since, quick);
        pthread_mutex_lock(&s->mu);
        int got = wait_for_work(s, &trimmed);
        if (got != 1) {
            pthread_mutex_unlock(&s->mu);
            if (got == 2)
                continue;   /* prewoken: poll for the coming job */
            break;
        }
        job_node *j = take_loud(s);
        s->nidle--;
        /* Only a device's kept threads poll long: the extra ones serve
         * bursts of overlapping jobs, and many of them polling would crowd
         * the cores. */
        quick = now_ns() - idle_since < QUICK_GAP_NS && s->nthreads <= DP_POOL_KEEP_THREADS;
        pthread_mutex_unlock(&s->mu);
        if (run_job(s, j, gen) < 0)
            return NULL;
    }
    dp_exit_hook_fn hook = __atomic_load_n(&exit_hook, __ATOMIC_ACQUIRE);
    if (hook != NULL)
        hook();
    if (worker_key_ok)
        (void)pthread_setspecific(worker_key, NULL);
    if (trimmed)
        __atomic_sub_fetch(&ntrimming, 1, __ATOMIC_RELEASE);
    return NULL;
}

/* Called with s->mu held. */
static int start_worker(slot *s)
{
    pthread_attr_t attr;
    pthread_t tid;
    int rc = pthread_attr_init(&attr);
    if (rc)
        return rc;
    rc = pthread_attr_setstacksize(&attr, STACK_BYTES);
    if (!rc)
        rc = pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
    /* Signal masks are left alone: a worker blocking signals would pass that
     * mask on to processes that a job forks and execs (they would then ignore
     * SIGTERM), and CPython's C-level signal handler works on any thread. */
    if (!rc)
        rc = pthread_create(&tid, &attr, worker_main, s);
    pthread_attr_destroy(&attr);
    if (!rc) {
        s->nthreads++;
        s->nidle++;   /* it will take a queued job before it blocks */
    }
    return rc;
}

int dp_batch_init(dp_batch *b)
{
    pthread_condattr_t ca;
    int rc = pthread_mutex_init(&b->mu, NULL);
    if (rc)
        return rc;
    rc = pthread_condattr_init(&ca);
    if (!rc) {
        /* dp_batch_wait measures its timeout on the monotonic clock, so it is
         * immune to wall-clock jumps. */
        rc = pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
        if (!rc)
            rc = pthread_cond_init(&b->done_cv, &ca);
        pthread_condattr_destroy(&ca);
    }
    if (rc) {
        pthread_mutex_destroy(&b->mu);
        return rc;
    }
    b->pending = 0;
    b->sleepers = 0;
    b->orphan_free = NULL;
    b->orphan_arg = NULL;
    return 0;
}

void dp_batch_destroy(dp_batch *b)
{
    pthread_cond_destroy(&b->done_cv);
    pthread_mutex_destroy(&b->mu);
}

/* Queue node j (filled in but for next/slot/state) on s: loud, or quiet. */
static int submit_node(slot *s, dp_batch *b, job_node *j, int loud)
{
    j->next = NULL;
    j->slot = s;
    j->state = loud ? DP_NODE_LOUD : DP_NODE_QUIET;
    pthread_mutex_lock(&s->mu);
    /* Start a thread under the slot mutex when this job would otherwise
     * wait: more queued jobs (this one included) than idle threads. When the
     * start fails but the slot has threads, the job waits for one of them;
     * with no thread at all it is refused. */
    if (s->nqueued + 1 > s->nidle && s->nthreads < DP_POOL_MAX_THREADS) {
        int rc = start_worker(s);
        if (rc && s->nthreads == 0) {
            pthread_mutex_unlock(&s->mu);
            return rc;
        }
    }
    /* Count the job before it is visible to the worker. Lock order is slot
     * then batch; the worker never holds both, so this cannot deadlock. */
    pthread_mutex_lock(&b->mu);
    __atomic_store_n(&b->pending, b->pending + 1, __ATOMIC_RELAXED);
    pthread_mutex_unlock(&b->mu);
    if (s->tail)
        s->tail->next = j;
    else
        s->head = j;
    s->tail = j;
    s->nqueued++;
    if (loud) {
        __atomic_store_n(&s->nloud, s->nloud + 1, __ATOMIC_RELAXED);
        pthread_cond_signal(&s->cv);   /* no syscall when no thread is blocked */
    }
    pthread_mutex_unlock(&s->mu);
    return 0;
}

int dp_batch_submit(dp_batch *b, int kind, int index, dp_job_fn fn, void *arg)
{
    slot *s = get_slot(kind, index);
    if (!s || !b || !fn)
        return EINVAL;
    job_node *j = malloc(sizeof *j);
    if (!j)
        return ENOMEM;
    *j = (job_node){ .fn = fn, .arg = arg, .batch = b, .owned = 1 };
    int rc = submit_node(s, b, j, 1);
    if (rc)
        free(j);
    return rc;
}

int dp_batch_submit_quiet(dp_batch *b, int kind, int index, dp_job_fn fn, void *arg,
                          dp_job_node *node)
{
    slot *s = get_slot(kind, index);
    if (!s || !b || !fn || !node)
        return EINVAL;
    *node = (job_node){ .fn = fn, .arg = arg, .batch = b, .owned = 0 };
    return submit_node(s, b, node, 0);
}

int dp_job_wake(dp_job_node *j)
{
    slot *s = j->slot;
    pthread_mutex_lock(&s->mu);
    int was = j->state;
    if (was == DP_NODE_QUIET) {
        __atomic_store_n(&j->state, DP_NODE_LOUD, __ATOMIC_RELAXED);
        __atomic_store_n(&s->nloud, s->nloud + 1, __ATOMIC_RELAXED);
        pthread_cond_signal(&s->cv);
    }
    pthread_mutex_unlock(&s->mu);
    return was;
}

int dp_job_withdraw(dp_job_node *j, int woken_too)
{
    /* A node never goes back to quiet or loud: one that is neither needs no lock. */
    int was = __atomic_load_n(&j->state, __ATOMIC_RELAXED);
    if (was != DP_NODE_QUIET && (was != DP_NODE_LOUD || !woken_too))
        return was;
    slot *s = j->slot;
    pthread_mutex_lock(&s->mu);
    was = j->state;
    if (was == DP_NODE_QUIET || (was == DP_NODE_LOUD && woken_too)) {
        job_node *prev = NULL, *q = s->head;
        for (; q != NULL && q != j; q = q->next)
            prev = q;
        if (q == NULL) {   /* a fork child's fresh queue: the node is not there */
            pthread_mutex_unlock(&s->mu);
            return DP_NODE_REMOVED;
        }
        unlink_node(s, prev, j);
        __atomic_store_n(&j->state, DP_NODE_REMOVED, __ATOMIC_RELAXED);
    }
    pthread_mutex_unlock(&s->mu);
    return was;
}

void dp_batch_finish(dp_batch *b, int n)
{
    while (n-- > 0)
        finish_job(b);
}

/* Poll b->pending for 0 from start for spin_ns (nothing when <= 0). */
static void poll_pending(dp_batch *b, long long start, long long spin_ns)
{
    spin_clock clock = {start + spin_ns, start, 0};
    while (spin_ns > 0 && __atomic_load_n(&b->pending, __ATOMIC_RELAXED) > 0 &&
           spin_turn(&clock)) {
    }
}

int dp_batch_wait(dp_batch *b, long timeout_ms)
{
    if (timeout_ms > 1000000000000L)   /* > 31 years: forever, avoids overflow */
        timeout_ms = -1;
    long long start = now_ns();
    long long spin_ns = __atomic_load_n(&last_wait_ns, __ATOMIC_RELAXED) < QUICK_GAP_NS
                            ? QUICK_SPIN_NS : WAIT_SPIN_NS;
    if (timeout_ms >= 0 && timeout_ms * 1000000LL < spin_ns)
        spin_ns = timeout_ms * 1000000LL;
    poll_pending(b, start, spin_ns);

    long long end = timeout_ms >= 0 ? start + timeout_ms * 1000000LL : -1;
    struct timespec deadline = {0, 0};
    if (end >= 0) {
        deadline.tv_sec = (time_t)(end / 1000000000LL);
        deadline.tv_nsec = (long)(end % 1000000000LL);
    }
    /* Always take the lock, even when the spin saw 0: it orders the jobs'
     * writes before our return, and it cannot be acquired until the last
     * worker has unlocked, after which the batch may be destroyed safely. */
    pthread_mutex_lock(&b->mu);
    int done = 1;
    int seen = b->pending;
    while (b->pending > 0) {   /* loop: wakeups may be spurious */
        if (b->pending < seen) {   /* a job finished: poll for the others */
            seen = b->pending;
            long long t = now_ns();
            long long poll_ns = end >= 0 && end - t < SIBLING_SPIN_NS ? end - t : SIBLING_SPIN_NS;
            pthread_mutex_unlock(&b->mu);
            poll_pending(b, t, poll_ns);
            pthread_mutex_lock(&b->mu);
            continue;
        }
        b->sleepers++;
        int rc = timeout_ms < 0 ? pthread_cond_wait(&b->done_cv, &b->mu)
                                : pthread_cond_timedwait(&b->done_cv, &b->mu, &deadline);
        b->sleepers--;
        if (rc == ETIMEDOUT) {
            done = b->pending == 0;
            break;
        }
    }
    pthread_mutex_unlock(&b->mu);
    __atomic_store_n(&last_wait_ns, done ? now_ns() - start : QUICK_GAP_NS, __ATOMIC_RELAXED);
    return done;
}

int dp_batch_abandon(dp_batch *b, void (*free_fn)(void *), void *arg)
{
    pthread_mutex_lock(&b->mu);
    int done = b->pending == 0;
    if (!done) {
        b->orphan_free = free_fn;
        b->orphan_arg = arg;
    }
    pthread_mutex_unlock(&b->mu);
    return done;
}

int dp_pool_on_worker(int kind, int index)
{
    worker_self *w = self_of_thread();
    return w != NULL && w->s->kind == kind && w->s->index == index;
}

unsigned dp_pool_fork_generation(void)
{
    return __atomic_load_n(&fork_gen, __ATOMIC_RELAXED);
}

int dp_pool_in_worker(void)
{
    return self_of_thread() != NULL;
}

int *dp_pool_worker_local(void)
{
    worker_self *w = self_of_thread();
    return w != NULL ? w->local : NULL;
}

int dp_pool_threads(int kind, int index)
{
    slot *s = get_slot(kind, index);
    if (!s)
        return -1;
    pthread_mutex_lock(&s->mu);
    int n = s->nthreads;
    pthread_mutex_unlock(&s->mu);
    return n;
}

void dp_pool_set_exit_hook(dp_exit_hook_fn fn)
{
    __atomic_store_n(&exit_hook, fn, __ATOMIC_RELEASE);
}

void dp_pool_trim(void)
{
    pthread_once(&slots_once, init_slots);
    for (int k = 0; k < NKINDS; k++)
        for (int i = 0; i < DP_POOL_MAX_INDEX; i++) {
            slot *s = &slots[k][i];
            pthread_mutex_lock(&s->mu);
            /* Idle threads not needed for queued jobs; at most that many
             * wake to leave, so a queued job keeps its thread. */
            int spare = s->nidle - s->nqueued - s->ntrim;
            if (spare > 0) {
                s->ntrim += spare;
                __atomic_add_fetch(&ntrimming, spare, __ATOMIC_RELAXED);
                pthread_cond_broadcast(&s->cv);
            }
            pthread_mutex_unlock(&s->mu);
        }
}

int dp_pool_trim_wait(long timeout_ms)
{
    long long end = now_ns() + timeout_ms * 1000000LL;
    struct timespec ms = {0, 1000000L};
    while (__atomic_load_n(&ntrimming, __ATOMIC_ACQUIRE) > 0) {
        if (now_ns() > end)
            return 0;
        nanosleep(&ms, NULL);
    }
    return 1;
}

int dp_pool_cores(void)
{
    int n = 0;
#ifdef CPU_COUNT
    cpu_set_t set;
    if (sched_getaffinity(0, sizeof set, &set) == 0)
        n = CPU_COUNT(&set);
#endif
    return n < 1 ? 1 : n;
}
