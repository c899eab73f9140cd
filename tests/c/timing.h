/* timing.h - clocks and sleeps for the C unit tests that measure time (the
 * worker pool, the parked OpenMP team). Include after the test has defined
 * _GNU_SOURCE (clock_gettime and nanosleep under -std=c11). */
#ifndef DPMINI_TEST_TIMING_H
#define DPMINI_TEST_TIMING_H

#include <errno.h>
#include <time.h>

/* CLOCK_MONOTONIC in seconds. */
static inline double secs(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + ts.tv_nsec * 1e-9;
}

/* The CPU time of all of the process's threads, in seconds. */
static inline double cpu_secs(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &ts);
    return ts.tv_sec + ts.tv_nsec * 1e-9;
}

/* Sleep ms milliseconds, through signals. */
static inline void sleep_ms(long ms)
{
    struct timespec ts = {ms / 1000, (ms % 1000) * 1000000L};
    while (nanosleep(&ts, &ts) == -1 && errno == EINTR) {
    }
}

#endif
