/* test_omp_team.c - standalone tests of csrc/core/omp_team.c: the calling
 * thread's OpenMP team sleeps while dp_omp_run_parked runs a function.
 *
 * Build: cc -std=c11 -O1 -g -Wall -Wextra -Werror -pthread -fopenmp -Icsrc/core \
 *            tests/c/test_omp_team.c csrc/core/omp_team.c
 * The program runs itself again with OMP_WAIT_POLICY=active (libgomp reads
 * it when it loads): an idle team then spins for good, so a team that was
 * not parked shows as CPU time. Exit status 0 when every check passes.
 */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE 1
#endif
#include "omp_team.h"

#include <errno.h>
#include <omp.h>
#include <stdio.h>
#include <stdlib.h>
#include <signal.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>
#include "check.h"
#include "timing.h"

/* A region of two threads: afterwards the second one waits, spinning. */
static long team_sum(int n)
{
    long sum = 0;
#pragma omp parallel for num_threads(2) reduction(+ : sum)
    for (int i = 0; i < n; i++) {
        sum += i;
    }
    return sum;
}

static void noop(void *arg)
{
    (void)arg;
}

typedef struct {
    int calls;
    int in_parallel;   /* omp_in_parallel() inside the function */
    int nested;        /* dp_omp_run_parked's result from inside it */
    double cpu;        /* process CPU seconds over a 200 ms sleep */
} probe;

static void sleep_probe(void *arg)
{
    probe *p = arg;
    p->calls++;
    p->in_parallel = omp_in_parallel();
    p->nested = dp_omp_run_parked(noop, NULL);
    double c0 = cpu_secs();
    sleep_ms(200);
    p->cpu = cpu_secs() - c0;
}

/* The control: with the active policy an idle team burns a core. */
static void test_idle_team_spins_unparked(void)
{
    omp_set_num_threads(2);
    /* half a core in 0.2 s; a loaded machine may deny a spinning thread
     * that much now and then: one of five tries must show it */
    double cpu = 0.0;
    for (int attempt = 0; attempt < 5 && !(cpu > 0.1); attempt++) {
        CHECK(team_sum(1000) == 499500);
        double c0 = cpu_secs();
        sleep_ms(200);
        cpu = cpu_secs() - c0;
        if (!(cpu > 0.1)) {
            printf("an idle team used %.3f s of CPU in 0.2 s\n", cpu);
        }
    }
    CHECK(cpu > 0.1);
}

static void test_team_sleeps_while_parked(void)
{
    omp_set_num_threads(2);
    CHECK(team_sum(1000) == 499500);
    probe p = {0};
    CHECK(dp_omp_run_parked(sleep_probe, &p) == 1);
    CHECK(p.calls == 1);
    CHECK(p.in_parallel == 1);
    CHECK(p.nested == 0);   /* inside the region: nothing more to park */
    if (!(p.cpu < 0.05)) {
        printf("a parked team used %.3f s of CPU in 0.2 s\n", p.cpu);
    }
    CHECK(p.cpu < 0.05);
    /* the team works as before */
    CHECK(omp_get_max_threads() == 2);
    CHECK(omp_in_parallel() == 0);
    CHECK(team_sum(100000) == 4999950000L);
}

typedef struct {
    double cpu_asleep;   /* process CPU seconds over 100 ms before the wake */
    double cpu_woken;    /* and over 100 ms after it */
} wake_probe;

static void wake_midway(void *arg)
{
    wake_probe *w = arg;
    double c0 = cpu_secs();
    sleep_ms(100);
    double c1 = cpu_secs();
    dp_omp_wake_parked();
    dp_omp_wake_parked();   /* a second wake changes nothing */
    sleep_ms(100);
    w->cpu_asleep = c1 - c0;
    w->cpu_woken = cpu_secs() - c1;
}

/* Woken early, the parked thread polls for the end (WAKE_SPIN_NS, 2 ms)
 * and then sleeps again: the rest of the call is not spent spinning. */
static void test_woken_team_polls_briefly_then_sleeps(void)
{
    omp_set_num_threads(2);
    CHECK(team_sum(1000) == 499500);
    dp_omp_wake_parked();   /* no parked region: nothing to wake */
    /* the poll's 2 ms of wall time may get less than a quarter of that in
     * CPU on a loaded machine: the lower bound needs one of five tries */
    wake_probe w = {0, 0};
    for (int attempt = 0; attempt < 5 && !(w.cpu_woken > 0.0005); attempt++) {
        CHECK(dp_omp_run_parked(wake_midway, &w) == 1);
        if (!(w.cpu_asleep < 0.02 && w.cpu_woken > 0.0005 && w.cpu_woken < 0.05)) {
            printf("a woken team used %.4f s of CPU asleep, %.4f s after the wake\n",
                   w.cpu_asleep, w.cpu_woken);
        }
        CHECK(w.cpu_asleep < 0.02);
        CHECK(w.cpu_woken < 0.05);
    }
    CHECK(w.cpu_woken > 0.0005);
    CHECK(team_sum(100000) == 4999950000L);
}

static void test_team_of_one_runs_plain(void)
{
    omp_set_num_threads(1);
    probe p = {0};
    CHECK(dp_omp_run_parked(sleep_probe, &p) == 0);
    CHECK(p.calls == 1);
    CHECK(p.in_parallel == 0);
    omp_set_num_threads(2);
}

static void test_repeated_parks(void)
{
    omp_set_num_threads(2);
    int parked = 0;
    for (int i = 0; i < 2000; i++) {
        parked += dp_omp_run_parked(noop, NULL);
        if (i % 100 == 0) {
            CHECK(team_sum(1000) == 499500);
        }
    }
    CHECK(parked == 2000);
}

static void set_one_thread(void *arg)
{
    (void)arg;
    omp_set_num_threads(1);
}

/* A thread count the function sets stays the thread's after the region (torch
 * sets a thread's count when it first uses it, maybe inside the region). */
static void test_thread_count_set_inside_is_kept(void)
{
    omp_set_num_threads(2);
    CHECK(team_sum(1000) == 499500);
    CHECK(dp_omp_run_parked(set_one_thread, NULL) == 1);
    CHECK(omp_get_max_threads() == 1);
    omp_set_num_threads(2);
    CHECK(dp_omp_run_parked(noop, NULL) == 1);
    CHECK(omp_get_max_threads() == 2);
}

/* A child forked after the team ran does not park: the team's threads are not
 * in the child, and a region of two threads there would wait for them. */
static void test_forked_child_runs_plain(void)
{
    omp_set_num_threads(2);
    CHECK(team_sum(1000) == 499500);
    CHECK(dp_omp_run_parked(noop, NULL) == 1);
    fflush(stdout);
    pid_t pid = fork();
    if (pid == 0) {
        alarm(10);   /* a hang shows as SIGALRM */
        probe p = {0};
        int parked = dp_omp_run_parked(sleep_probe, &p);
        _exit(parked == 0 && p.calls == 1 ? 0 : 3);
    }
    CHECK(pid > 0);
    int status = 0;
    CHECK(waitpid(pid, &status, 0) == pid);
    if (!(WIFEXITED(status) && WEXITSTATUS(status) == 0)) {
        printf("the forked child ended with status %#x\n", status);
    }
    CHECK(WIFEXITED(status) && WEXITSTATUS(status) == 0);
}

int main(int argc, char **argv)
{
    (void)argc;
    const char *policy = getenv("OMP_WAIT_POLICY");
    if (policy == NULL || strcmp(policy, "active") != 0) {
        setenv("OMP_WAIT_POLICY", "active", 1);
        execv("/proc/self/exe", argv);
        printf("cannot run again with OMP_WAIT_POLICY=active: %s\n", strerror(errno));
        return 1;
    }
    test_idle_team_spins_unparked();
    test_team_sleeps_while_parked();
    test_woken_team_polls_briefly_then_sleeps();
    test_team_of_one_runs_plain();
    test_repeated_parks();
    test_thread_count_set_inside_is_kept();
    test_forked_child_runs_plain();
    if (failures) {
        printf("%d check(s) failed\n", failures);
    }
    return failures != 0;
}
