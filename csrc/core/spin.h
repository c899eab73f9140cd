/* spin.h - the short poll before a thread blocks, shared by the worker
 * pool (pool.c) and the parked OpenMP team (omp_team.c).
 *
 * A thread that expects what it waits for within microseconds polls for a
 * bounded time before it blocks: a wake-up through the kernel costs tens of
 * microseconds on a virtual machine, and far more when the vCPU it runs on
 * was halted. The poll yields its CPU after a few turns, so a thread it
 * waits for that needs the same core gets it, and it stops early on a busy
 * machine. No Python.h.
 */
#ifndef DPMINI_SPIN_H
#define DPMINI_SPIN_H

#include <sched.h>
#include <time.h>

#define SPIN_CONTENDED_NS 100000L       /* 16 spin turns taking longer: stop */
#define SPIN_YIELD_AFTER 16u            /* spin turns before sched_yield */

static inline void cpu_relax(void)
{
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    __asm__ __volatile__("yield");
#endif
}

/* Pause for the n-th turn of a spin loop. After the first few turns give
 * the CPU away: with more spinning threads than cores (e.g. 2 workers
 * and a waiter on 2 CPUs) the thread we are waiting for may need our core. */
static inline void spin_pause(unsigned n)
{
    if (n < SPIN_YIELD_AFTER)
        cpu_relax();
    else
        sched_yield();
}

/* CLOCK_MONOTONIC in nanoseconds. */
static inline long long now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (long long)ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

/* The clock of a spin loop, read every 16 turns. */
typedef struct {
    long long end;    /* stop polling after this time */
    long long last;   /* the previous reading */
    unsigned turns;
} spin_clock;

/* One turn of a spin loop: pause, and 0 when the spin should end: its time
 * is up, or 16 turns took over SPIN_CONTENDED_NS. Those turns yield the
 * CPU, so taking that long means other threads wanted this core (the
 * machine is busy): blocking then gives them the core instead of taking
 * turns with them, and a busy machine wakes a thread quickly anyway. */
static inline int spin_turn(spin_clock *c)
{
    spin_pause(++c->turns);
    if (c->turns % 16 != 0)
        return 1;
    long long t = now_ns();
    if (t > c->end || t - c->last > SPIN_CONTENDED_NS)
        return 0;
    c->last = t;
    return 1;
}

#endif
