/* copy_limit.c - the copy limit probe (copy_limit.h). */
#define _GNU_SOURCE
#include "copy_limit.h"
#include "copy.h"
#include "profile.h"

#include <pthread.h>
#include <stdlib.h>
#include <string.h>

typedef struct {
    char *src, *dst;
    uint64_t bytes;
    int mode;
    pthread_barrier_t *start;
} limit_part;

static void copy_part(const limit_part *p)
{
    dp_copy_desc d;
    int64_t shape = (int64_t)p->bytes, stride = 1;
    dp_copy_init(&d, 1, 1, &shape, &stride, &stride);
    dp_copy_run_mode(&d, p->dst, p->src, p->mode);
}

static void *part_main(void *arg)
{
    limit_part *p = arg;
    pthread_barrier_wait(p->start);
    copy_part(p);
    return NULL;
}

/* One timed copy on `threads` threads (the caller is the last one). */
static double timed_copy(limit_part *parts, int threads)
{
    pthread_t tid[64];
    pthread_barrier_t start;
    int started = 0;
    pthread_barrier_init(&start, NULL, (unsigned)threads);
    for (int t = 0; t < threads; t++) {
        parts[t].start = &start;
    }
    for (int t = 0; t + 1 < threads; t++) {
        if (pthread_create(&tid[t], NULL, part_main, &parts[t]) != 0) {
            break;
        }
        started++;
    }
    if (started + 1 < threads) {   /* release the ones that wait, then fail */
        for (int t = started; t + 1 < threads; t++) {
            pthread_barrier_wait(&start);
        }
        for (int t = 0; t < started; t++) {
            pthread_join(tid[t], NULL);
        }
        pthread_barrier_destroy(&start);
        return -1.0;
    }
    pthread_barrier_wait(&start);
    uint64_t t0 = dp_prof_now();
    copy_part(&parts[threads - 1]);
    for (int t = 0; t + 1 < threads; t++) {
        pthread_join(tid[t], NULL);
    }
    uint64_t t1 = dp_prof_now();
    pthread_barrier_destroy(&start);
    return (double)(t1 - t0) * 1e-9;
}

int dp_copy_limit_time(uint64_t bytes, int threads, int mode, int repeat, double *seconds)
{
    if (bytes == 0 || threads < 1 || threads > 64 || repeat < 1) {
        return -1;
    }
    limit_part parts[64];
    uint64_t each = bytes / (uint64_t)threads;
    int rc = 0;
    memset(parts, 0, sizeof parts);
    for (int t = 0; t < threads && rc == 0; t++) {
        parts[t].bytes = t + 1 < threads ? each : bytes - each * (uint64_t)(threads - 1);
        parts[t].mode = mode;
        parts[t].src = aligned_alloc(4096, (parts[t].bytes + 4095) / 4096 * 4096);
        parts[t].dst = aligned_alloc(4096, (parts[t].bytes + 4095) / 4096 * 4096);
        if (parts[t].src == NULL || parts[t].dst == NULL) {
            rc = -1;
            break;
        }
        memset(parts[t].src, 1, parts[t].bytes);   /* pages touched: no faults timed */
        memset(parts[t].dst, 2, parts[t].bytes);
    }
    double best = -1.0;
    for (int r = 0; r < repeat && rc == 0; r++) {
        double s = timed_copy(parts, threads);
        if (s < 0) {
            rc = -1;
        } else if (best < 0 || s < best) {
            best = s;
        }
    }
    for (int t = 0; t < threads; t++) {
        free(parts[t].src);
        free(parts[t].dst);
    }
    *seconds = best;
    return rc;
}
