/* test_pool.c - standalone tests of csrc/core/pool.c (worker threads and batches).
 *
 * Build: cc -std=c11 -O1 -g -Wall -Wextra -Werror -pthread -Icsrc/core \
 *            tests/c/test_pool.c csrc/core/pool.c
 * Exit status 0 when every check passes; each failure is printed.
 */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE 1 /* the same spelling as pyconfig.h, which may define it too */
#endif
#include "pool.h"

#include <errno.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>
#include "check.h"
#include "timing.h"

static atomic_int counter;
static void job_inc(void *arg) { (void)arg; atomic_fetch_add(&counter, 1); }

/* ---- many jobs on one device: each runs exactly once ---- */
#define NMANY 2000
static atomic_int many_runs[NMANY];
static int many_ids[NMANY];

static void job_log(void *arg) { atomic_fetch_add(&many_runs[*(int *)arg], 1); }

static void test_many_on_one_device(void)
{
    dp_batch b;
    CHECK(dp_batch_init(&b) == 0);
    for (int i = 0; i < NMANY; i++) {
        many_ids[i] = i;
        atomic_store(&many_runs[i], 0);
        CHECK(dp_batch_submit(&b, 1, 0, job_log, &many_ids[i]) == 0);
    }
    CHECK(dp_batch_wait(&b, -1) == 1);
    int once = 1;
    for (int i = 0; i < NMANY; i++)
        once &= atomic_load(&many_runs[i]) == 1;
    CHECK(once);
    CHECK(dp_pool_threads(1, 0) >= 1 && dp_pool_threads(1, 0) <= DP_POOL_MAX_THREADS);
    dp_batch_destroy(&b);
}

/* ---- parallelism: each job waits for the other; serialized would stall ---- */
static atomic_int flag_a, flag_b;
static int meet_a, meet_b;

static int await_flag(atomic_int *f)
{
    double end = secs() + 2.0;
    while (!atomic_load(f))
        if (secs() > end)
            return 0;
    return 1;
}
static void job_a(void *arg) { (void)arg; atomic_store(&flag_a, 1); meet_a = await_flag(&flag_b); }
static void job_b(void *arg) { (void)arg; atomic_store(&flag_b, 1); meet_b = await_flag(&flag_a); }

static void test_parallel(int kind)
{
    dp_batch b;
    atomic_store(&flag_a, 0);
    atomic_store(&flag_b, 0);
    meet_a = meet_b = 0;
    CHECK(dp_batch_init(&b) == 0);
    CHECK(dp_batch_submit(&b, kind, 1, job_a, NULL) == 0);
    CHECK(dp_batch_submit(&b, kind, 2, job_b, NULL) == 0);
    CHECK(dp_batch_wait(&b, 5000) == 1);
    CHECK(meet_a && meet_b);
    dp_batch_destroy(&b);
}

/* ---- jobs of one device run at the same time (a repeated device) ---- */
static void test_parallel_same_device(void)
{
    dp_batch b;
    atomic_store(&flag_a, 0);
    atomic_store(&flag_b, 0);
    meet_a = meet_b = 0;
    CHECK(dp_batch_init(&b) == 0);
    CHECK(dp_batch_submit(&b, 1, 30, job_a, NULL) == 0);
    CHECK(dp_batch_submit(&b, 1, 30, job_b, NULL) == 0);
    CHECK(dp_batch_wait(&b, 5000) == 1);
    CHECK(meet_a && meet_b);
    dp_batch_destroy(&b);
}

/* ---- a job waits for work that a helper thread sends to its own device
 * (review1 f07: with one thread per device this deadlocked) ---- */
static void *helper_main(void *arg)
{
    (void)arg;
    dp_batch c;
    int ok = dp_batch_init(&c) == 0 && dp_batch_submit(&c, 1, 31, job_inc, NULL) == 0
             && dp_batch_wait(&c, 5000) == 1;
    dp_batch_destroy(&c);
    return ok ? (void *)1 : NULL;
}
static int helper_ok;
static void job_uses_helper(void *arg)
{
    (void)arg;
    pthread_t t;
    void *res = NULL;
    if (pthread_create(&t, NULL, helper_main, NULL) == 0 && pthread_join(t, &res) == 0)
        helper_ok = res != NULL;
}

static void test_helper_thread_on_own_device(void)
{
    dp_batch b;
    helper_ok = 0;
    CHECK(dp_batch_init(&b) == 0);
    CHECK(dp_batch_submit(&b, 1, 31, job_uses_helper, NULL) == 0);
    CHECK(dp_batch_wait(&b, 10000) == 1);
    CHECK(helper_ok);
    dp_batch_destroy(&b);
}

/* ---- beyond DP_POOL_MAX_THREADS busy threads, a job queues ---- */
static atomic_int gate_open, blocked_running, late_ran;
static pthread_mutex_t gate_mu = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t gate_cv = PTHREAD_COND_INITIALIZER;

/* Blocks (no polling: up to DP_POOL_MAX_THREADS of these wait at once)
 * until open_gate(), at most 60 s. */
static void job_blocked(void *arg)
{
    (void)arg;
    struct timespec deadline;
    clock_gettime(CLOCK_REALTIME, &deadline);
    deadline.tv_sec += 60;
    atomic_fetch_add(&blocked_running, 1);
    pthread_mutex_lock(&gate_mu);
    while (!atomic_load(&gate_open))
        if (pthread_cond_timedwait(&gate_cv, &gate_mu, &deadline) == ETIMEDOUT)
            break;
    pthread_mutex_unlock(&gate_mu);
}

static void open_gate(void)
{
    pthread_mutex_lock(&gate_mu);
    atomic_store(&gate_open, 1);
    pthread_cond_broadcast(&gate_cv);
    pthread_mutex_unlock(&gate_mu);
}
static void job_late(void *arg) { (void)arg; atomic_store(&late_ran, 1); }

static void test_cap(void)
{
    dp_batch b;
    atomic_store(&gate_open, 0);
    atomic_store(&blocked_running, 0);
    atomic_store(&late_ran, 0);
    CHECK(dp_batch_init(&b) == 0);
    for (int i = 0; i < DP_POOL_MAX_THREADS; i++)
        CHECK(dp_batch_submit(&b, 1, 32, job_blocked, NULL) == 0);
    CHECK(dp_batch_submit(&b, 1, 32, job_late, NULL) == 0);
    double end = secs() + 30.0;
    while (atomic_load(&blocked_running) < DP_POOL_MAX_THREADS && secs() < end)
        sleep_ms(1);
    CHECK(atomic_load(&blocked_running) == DP_POOL_MAX_THREADS);
    sleep_ms(50);
    CHECK(!atomic_load(&late_ran));
    CHECK(dp_pool_threads(1, 32) == DP_POOL_MAX_THREADS);
    open_gate();
    CHECK(dp_batch_wait(&b, 10000) == 1);
    CHECK(atomic_load(&late_ran));
    dp_batch_destroy(&b);
}

/* ---- dp_pool_trim lets idle threads go; the device starts new ones ---- */
static atomic_int trim_exits;
static void count_exit(void) { atomic_fetch_add(&trim_exits, 1); }

static void test_trim(void)
{
    dp_batch b;
    atomic_store(&gate_open, 0);
    atomic_store(&blocked_running, 0);
    atomic_store(&late_ran, 0);
    atomic_store(&trim_exits, 0);
    dp_pool_set_exit_hook(count_exit);
    CHECK(dp_batch_init(&b) == 0);
    for (int i = 0; i < 6; i++)
        CHECK(dp_batch_submit(&b, 1, 40, job_blocked, NULL) == 0);
    double end = secs() + 5.0;
    while (atomic_load(&blocked_running) < 6 && secs() < end)
        sleep_ms(1);
    CHECK(dp_pool_threads(1, 40) == 6);
    dp_pool_trim();                    /* all 6 busy: none leaves */
    CHECK(dp_pool_trim_wait(5000) == 1);   /* a loaded machine may take a while to settle */
    CHECK(dp_pool_threads(1, 40) == 6);
    open_gate();
    CHECK(dp_batch_wait(&b, 10000) == 1);
    dp_pool_trim();                    /* now idle: all leave, hook run by each */
    CHECK(dp_pool_trim_wait(5000) == 1);
    CHECK(dp_pool_threads(1, 40) == 0);
    CHECK(atomic_load(&trim_exits) >= 6);
    CHECK(dp_batch_submit(&b, 1, 40, job_late, NULL) == 0);
    CHECK(dp_batch_wait(&b, 10000) == 1);
    CHECK(atomic_load(&late_ran) && dp_pool_threads(1, 40) == 1);
    dp_batch_destroy(&b);
    dp_pool_set_exit_hook(NULL);
}

/* ---- one job at a time on a device keeps one thread ---- */
static void test_sequential_keeps_one_thread(void)
{
    dp_batch b;
    CHECK(dp_batch_init(&b) == 0);
    for (int i = 0; i < 2000; i++) {
        CHECK(dp_batch_submit(&b, 1, 33, job_inc, NULL) == 0);
        CHECK(dp_batch_wait(&b, -1) == 1);
        if (i % 100 == 0)
            sleep_ms(1);   /* let the thread leave its spin and block, too */
    }
    CHECK(dp_pool_threads(1, 33) == 1);
    dp_batch_destroy(&b);
}

/* ---- many batches, reused and recreated ---- */

static void test_many_batches(void)
{
    atomic_store(&counter, 0);
    dp_batch reused;
    CHECK(dp_batch_init(&reused) == 0);
    for (int r = 0; r < 500; r++) {
        dp_batch b;
        CHECK(dp_batch_init(&b) == 0);
        for (int d = 0; d < 4; d++) {
            CHECK(dp_batch_submit(&b, 1 + d % 2, d, job_inc, NULL) == 0);
            CHECK(dp_batch_submit(&reused, 2 - d % 2, d, job_inc, NULL) == 0);
        }
        CHECK(dp_batch_wait(&b, -1) == 1);
        CHECK(b.pending == 0);
        dp_batch_destroy(&b);
        CHECK(dp_batch_wait(&reused, -1) == 1);
    }
    CHECK(atomic_load(&counter) == 500 * 8);
    dp_batch_destroy(&reused);
}

/* ---- timeout path ---- */
static void job_sleep200(void *arg) { (void)arg; sleep_ms(200); }

static void test_timeout(void)
{
    dp_batch b;
    CHECK(dp_batch_init(&b) == 0);
    CHECK(dp_batch_wait(&b, 0) == 1);      /* empty batch: done at once */
    double t0 = secs();                    /* before the submit: the job ends >= 200 ms later */
    CHECK(dp_batch_submit(&b, 1, 7, job_sleep200, NULL) == 0);
    CHECK(dp_batch_wait(&b, 10) == 0);
    double waited = secs() - t0;
    CHECK(waited >= 0.009);   /* returned 0 above: the job was still running */
    CHECK(dp_batch_wait(&b, 0) == 0);
    CHECK(dp_batch_wait(&b, -1) == 1);
    CHECK(secs() - t0 >= 0.190);
    dp_batch_destroy(&b);
}

/* ---- one job of several ends: the waiter wakes, polls, and waits on ---- */
static void job_sleep20(void *arg) { (void)arg; sleep_ms(20); atomic_fetch_add(&counter, 1); }
static void job_sleep100(void *arg) { (void)arg; sleep_ms(100); atomic_fetch_add(&counter, 1); }
static void job_gated_inc(void *arg) { job_blocked(arg); atomic_fetch_add(&counter, 1); }

static void test_wait_outlasts_first_finisher(void)
{
    dp_batch b;
    CHECK(dp_batch_init(&b) == 0);
    atomic_store(&counter, 0);
    atomic_store(&gate_open, 0);
    /* the first job ends (usually inside the wait below); the second stays
     * behind the gate, so the batch cannot be done when the wait returns */
    CHECK(dp_batch_submit(&b, 1, 0, job_sleep20, NULL) == 0);
    CHECK(dp_batch_submit(&b, 1, 1, job_gated_inc, NULL) == 0);
    double t0 = secs();
    CHECK(dp_batch_wait(&b, 50) == 0);
    double waited = secs() - t0;
    CHECK(waited >= 0.049);   /* a wake by the first job did not end the wait early */
    CHECK(waited < 10.0);     /* nor did the wait run on to the gate's 60 s */
    double end = secs() + 30.0;
    while (atomic_load(&counter) < 1 && secs() < end)
        sleep_ms(1);
    CHECK(atomic_load(&counter) == 1);
    CHECK(dp_batch_wait(&b, 0) == 0);
    open_gate();
    CHECK(dp_batch_wait(&b, -1) == 1);
    CHECK(atomic_load(&counter) == 2);
    /* and without a timeout, through the wake-up of the first */
    CHECK(dp_batch_submit(&b, 1, 0, job_sleep20, NULL) == 0);
    CHECK(dp_batch_submit(&b, 1, 1, job_sleep100, NULL) == 0);
    CHECK(dp_batch_wait(&b, -1) == 1);
    CHECK(atomic_load(&counter) == 4);
    dp_batch_destroy(&b);
}

/* ---- a caller that expects to hand out jobs keeps the workers polling ---- */
static void test_prewoken_worker_polls_while_work_is_expected(void)
{
    dp_batch b;
    CHECK(dp_batch_init(&b) == 0);
    atomic_store(&counter, 0);
    CHECK(dp_batch_submit(&b, 1, 5, job_inc, NULL) == 0);   /* device 5 gets a thread */
    CHECK(dp_batch_wait(&b, -1) == 1);
    sleep_ms(50);                       /* its poll is over: it sleeps */
    dp_pool_prewake(0, 5);              /* bad kinds and indexes are no-ops */
    dp_pool_prewake(1, -1);
    dp_pool_prewake(1, DP_POOL_MAX_INDEX);
    double c0 = cpu_secs();
    sleep_ms(50);
    double asleep = cpu_secs() - c0;
    dp_pool_expect_work(1);
    /* The poll lasts EXPECTED_SPIN_NS (2 ms) of wall time, then the worker
     * sleeps again. A loaded machine may give a polling thread less than a
     * quarter of those 2 ms: the lower bound needs one of five tries. */
    double polled = 0.0;
    for (int attempt = 0; attempt < 5 && !(polled > 0.0005); attempt++) {
        dp_pool_prewake(1, 5);
        c0 = cpu_secs();
        sleep_ms(100);
        polled = cpu_secs() - c0;
        if (!(polled > 0.0005 && polled < 0.05))
            printf("worker CPU: %.4f s after the prewake\n", polled);
        CHECK(polled < 0.05);
    }
    if (!(asleep < 0.01))
        printf("worker CPU: %.4f s asleep\n", asleep);
    CHECK(asleep < 0.01);
    CHECK(polled > 0.0005);
    CHECK(dp_batch_submit(&b, 1, 5, job_inc, NULL) == 0);
    CHECK(dp_batch_wait(&b, -1) == 1);
    dp_pool_expect_work(-1);
    CHECK(atomic_load(&counter) == 2);
    CHECK(dp_pool_threads(1, 5) == 1);
    dp_batch_destroy(&b);
}

/* ---- bad arguments ---- */
static void test_einval(void)
{
    dp_batch b;
    CHECK(dp_batch_init(&b) == 0);
    CHECK(dp_batch_submit(&b, 0, 0, job_inc, NULL) == EINVAL);
    CHECK(dp_batch_submit(&b, 3, 0, job_inc, NULL) == EINVAL);
    CHECK(dp_batch_submit(&b, 1, -1, job_inc, NULL) == EINVAL);
    CHECK(dp_batch_submit(&b, 2, DP_POOL_MAX_INDEX, job_inc, NULL) == EINVAL);
    CHECK(dp_batch_submit(&b, 1, 0, NULL, NULL) == EINVAL);
    CHECK(b.pending == 0);
    CHECK(dp_batch_wait(&b, -1) == 1);
    CHECK(dp_batch_submit(&b, 2, DP_POOL_MAX_INDEX - 1, job_inc, NULL) == 0);
    CHECK(dp_batch_wait(&b, -1) == 1);
    CHECK(!dp_pool_on_worker(0, 0) && !dp_pool_on_worker(3, 0));
    CHECK(!dp_pool_on_worker(1, -1) && !dp_pool_on_worker(1, DP_POOL_MAX_INDEX));
    dp_batch_destroy(&b);
}

/* ---- dp_pool_on_worker, and a worker submitting to itself / others ---- */
static int seen_self, seen_other_index, seen_other_kind, nested_ok, self_ran;
static void job_mark(void *arg) { (void)arg; self_ran = dp_pool_on_worker(1, 3); }
static void job_probe(void *arg)
{
    (void)arg;
    seen_self = dp_pool_on_worker(1, 3);
    seen_other_index = dp_pool_on_worker(1, 4);
    seen_other_kind = dp_pool_on_worker(2, 3);
    /* A job may wait for a different worker... */
    dp_batch inner;
    nested_ok = dp_batch_init(&inner) == 0
        && dp_batch_submit(&inner, 2, 3, job_inc, NULL) == 0
        && dp_batch_wait(&inner, 5000) == 1;
    dp_batch_destroy(&inner);
}
static dp_batch self_batch;
static void job_submit_self(void *arg)
{
    (void)arg;
    /* ...and may queue on its own worker (but must not wait for that job). */
    nested_ok &= dp_batch_submit(&self_batch, 1, 3, job_mark, NULL) == 0;
}

static void test_on_worker(void)
{
    dp_batch b;
    CHECK(!dp_pool_on_worker(1, 3));
    CHECK(dp_batch_init(&b) == 0);
    CHECK(dp_batch_submit(&b, 1, 3, job_probe, NULL) == 0);
    CHECK(dp_batch_wait(&b, 5000) == 1);
    CHECK(seen_self && !seen_other_index && !seen_other_kind && nested_ok);
    CHECK(dp_batch_init(&self_batch) == 0);
    CHECK(dp_batch_submit(&b, 1, 3, job_submit_self, NULL) == 0);
    CHECK(dp_batch_wait(&b, 5000) == 1);
    CHECK(dp_batch_wait(&self_batch, 5000) == 1);
    CHECK(nested_ok && self_ran);
    CHECK(!dp_pool_on_worker(1, 3));
    dp_batch_destroy(&self_batch);
    dp_batch_destroy(&b);
}

/* ---- fork: the child gets fresh workers, even with jobs queued in the parent */
static void test_fork(void)
{
    dp_batch b, busy;
    CHECK(dp_batch_init(&b) == 0);
    CHECK(dp_batch_init(&busy) == 0);
    CHECK(dp_batch_submit(&b, 1, 0, job_inc, NULL) == 0);
    CHECK(dp_batch_wait(&b, -1) == 1);
    /* Leave (1,0) busy with a queue behind it while forking. */
    CHECK(dp_batch_submit(&busy, 1, 0, job_sleep200, NULL) == 0);
    CHECK(dp_batch_submit(&busy, 1, 0, job_inc, NULL) == 0);
    fflush(stdout);
    pid_t pid = fork();
    if (pid == 0) {
        alarm(10);   /* a hang in the child ends it by SIGALRM */
        dp_batch c;
        int ok = dp_batch_init(&c) == 0;
        atomic_store(&counter, 0);
        ok = ok && dp_batch_submit(&c, 1, 0, job_inc, NULL) == 0
                && dp_batch_submit(&c, 2, 5, job_inc, NULL) == 0
                && dp_batch_wait(&c, 5000) == 1
                && atomic_load(&counter) == 2;
        _exit(ok ? 0 : 1);
    }
    CHECK(pid > 0);
    if (pid > 0) {
        int status = 0;
        CHECK(waitpid(pid, &status, 0) == pid);
        CHECK(WIFEXITED(status) && WEXITSTATUS(status) == 0);
        if (WIFSIGNALED(status))
            printf("child killed by signal %d\n", WTERMSIG(status));
    }
    CHECK(dp_batch_wait(&busy, -1) == 1);   /* the parent's pool still works */
    dp_batch_destroy(&busy);
    dp_batch_destroy(&b);
}

/* ---- fork() called inside a job: the child's copy of that worker ---- */
static int fork_job_status = -1;
static void job_fork(void *arg)
{
    int plain_return = *(int *)arg;
    fflush(stdout);
    pid_t pid = fork();
    if (pid == 0) {
        alarm(10);
        if (plain_return)
            return;   /* the pool must end this thread (and so the child), not hang */
        dp_batch c;   /* no longer (1,9)'s worker: can wait for (1,9) here */
        int ok = !dp_pool_on_worker(1, 9) && dp_batch_init(&c) == 0
            && dp_batch_submit(&c, 1, 9, job_inc, NULL) == 0
            && dp_batch_wait(&c, 5000) == 1;
        _exit(ok ? 0 : 1);
    }
    int status = 0;
    fork_job_status = pid > 0 && waitpid(pid, &status, 0) == pid ? status : -1;
}

static void test_fork_in_job(void)
{
    for (int plain_return = 0; plain_return < 2; plain_return++) {
        dp_batch b;
        CHECK(dp_batch_init(&b) == 0);
        CHECK(dp_batch_submit(&b, 1, 9, job_fork, &plain_return) == 0);
        CHECK(dp_batch_wait(&b, 15000) == 1);
        CHECK(WIFEXITED(fork_job_status) && WEXITSTATUS(fork_job_status) == 0);
        dp_batch_destroy(&b);
    }
}

/* ---- latency of an empty job round trip ---- */
static void job_empty(void *arg) { (void)arg; }

static void test_latency(void)
{
    enum { N = 10000 };
    dp_batch b;
    CHECK(dp_batch_init(&b) == 0);
    int ok = 1;
    double t0 = secs();
    for (int i = 0; i < N; i++) {
        ok &= dp_batch_submit(&b, 1, 10 + i % 2, job_empty, NULL) == 0;
        ok &= dp_batch_wait(&b, -1) == 1;
    }
    double dt = secs() - t0;
    CHECK(ok);
    printf("round trip (submit+run+wait, empty job, 2 devices): %.2f us mean\n",
           dt / N * 1e6);
    dp_batch_destroy(&b);
}

/* ---- dp_batch_abandon: the last job frees the batch, after its last touch ---- */
static atomic_int abandon_release, abandon_freed, abandon_ran;
static void job_block(void *arg)
{
    (void)arg;
    while (!atomic_load(&abandon_release))
        sleep_ms(1);
    atomic_fetch_add(&abandon_ran, 1);
}
static void free_abandoned(void *arg)
{
    dp_batch *b = arg;
    CHECK(b->pending == 0);
    dp_batch_destroy(b);
    free(b);   /* under ASan: a later touch of the batch would be reported */
    atomic_fetch_add(&abandon_freed, 1);
}

static void test_abandon(void)
{
    dp_batch *b = malloc(sizeof *b);
    CHECK(b != NULL && dp_batch_init(b) == 0);
    CHECK(dp_batch_submit(b, 1, 20, job_block, NULL) == 0);
    CHECK(dp_batch_submit(b, 1, 21, job_block, NULL) == 0);
    CHECK(dp_batch_submit(b, 1, 20, job_inc, NULL) == 0);
    CHECK(dp_batch_wait(b, 20) == 0);            /* the blocked jobs hold it */
    CHECK(dp_batch_abandon(b, free_abandoned, b) == 0);
    CHECK(atomic_load(&abandon_freed) == 0);
    atomic_store(&abandon_release, 1);
    double t0 = secs();
    while (atomic_load(&abandon_freed) == 0 && secs() - t0 < 10)
        sleep_ms(1);
    CHECK(atomic_load(&abandon_freed) == 1 && atomic_load(&abandon_ran) == 2);
    /* the devices' workers take new batches afterwards */
    dp_batch again;
    CHECK(dp_batch_init(&again) == 0);
    int before = atomic_load(&counter);
    CHECK(dp_batch_submit(&again, 1, 20, job_inc, NULL) == 0);
    CHECK(dp_batch_submit(&again, 1, 21, job_inc, NULL) == 0);
    CHECK(dp_batch_wait(&again, 10000) == 1 && atomic_load(&counter) == before + 2);
    /* every job finished already: 1, nothing called, the caller destroys it */
    CHECK(dp_batch_abandon(&again, free_abandoned, &again) == 1);
    CHECK(atomic_load(&abandon_freed) == 1);
    dp_batch_destroy(&again);
}

/* ---- quiet jobs: counted and given a thread, run only once woken ---- */
static atomic_int quiet_gate;
static void job_wait_gate(void *arg)
{
    (void)arg;
    while (!atomic_load(&quiet_gate))
        sleep_ms(1);
}

static void test_quiet_jobs(void)
{
    dp_batch b, other;
    dp_job_node q1, q2, q3;
    CHECK(dp_batch_init(&b) == 0);
    CHECK(dp_batch_init(&other) == 0);
    atomic_store(&counter, 0);
    atomic_store(&quiet_gate, 0);
    /* withdrawn while another job of the batch runs: never runs */
    CHECK(dp_batch_submit(&b, 1, 41, job_wait_gate, NULL) == 0);
    CHECK(dp_batch_submit_quiet(&b, 1, 40, job_inc, NULL, &q1) == 0);
    CHECK(dp_pool_threads(1, 40) == 1);              /* its thread is there */
    CHECK(dp_job_withdraw(&q1, 0) == DP_NODE_QUIET);
    CHECK(dp_job_withdraw(&q1, 0) == DP_NODE_REMOVED);
    CHECK(dp_job_wake(&q1) == DP_NODE_REMOVED);
    CHECK(dp_batch_wait(&b, 0) == 0);                /* still counted */
    dp_batch_finish(&b, 1);
    atomic_store(&quiet_gate, 1);
    CHECK(dp_batch_wait(&b, 5000) == 1);
    CHECK(atomic_load(&counter) == 0);
    /* not taken while quiet; runs once woken, once */
    CHECK(dp_batch_submit_quiet(&b, 1, 42, job_inc, NULL, &q2) == 0);
    sleep_ms(20);
    CHECK(atomic_load(&counter) == 0);
    CHECK(dp_batch_wait(&b, 0) == 0);
    CHECK(dp_job_wake(&q2) == DP_NODE_QUIET);
    CHECK(dp_batch_wait(&b, 5000) == 1);
    CHECK(atomic_load(&counter) == 1);
    CHECK(dp_job_wake(&q2) == DP_NODE_TAKEN);
    CHECK(dp_job_withdraw(&q2, 1) == DP_NODE_TAKEN);
    /* a quiet job ahead of another batch's job in the queue of a device
     * whose one thread is asleep: the other job still runs */
    CHECK(dp_batch_submit(&b, 1, 43, job_inc, NULL) == 0);
    CHECK(dp_batch_wait(&b, 5000) == 1);
    sleep_ms(20);                                    /* its thread blocks */
    CHECK(dp_batch_submit_quiet(&b, 1, 43, job_inc, NULL, &q3) == 0);
    CHECK(dp_batch_submit(&other, 1, 43, job_inc, NULL) == 0);
    CHECK(dp_batch_wait(&other, 5000) == 1);
    CHECK(atomic_load(&counter) == 3);
    CHECK(dp_job_wake(&q3) == DP_NODE_QUIET);
    CHECK(dp_batch_wait(&b, 5000) == 1);
    CHECK(atomic_load(&counter) == 4);
    dp_batch_destroy(&other);
    dp_batch_destroy(&b);
}

int main(void)
{
    test_many_on_one_device();
    test_parallel(1);
    test_parallel(2);
    test_parallel_same_device();
    test_helper_thread_on_own_device();
    test_cap();
    test_trim();
    test_sequential_keeps_one_thread();
    test_many_batches();
    test_timeout();
    test_wait_outlasts_first_finisher();
    test_prewoken_worker_polls_while_work_is_expected();
    test_einval();
    test_on_worker();
    test_fork();
    test_fork_in_job();
    test_abandon();
    test_quiet_jobs();
    test_latency();
    if (failures) {
        printf("test_pool: %d failure(s)\n", failures);
        return 1;
    }
    printf("test_pool: all passed\n");
    return 0;
}
