/* copy_feed.c - the copy engine's feed: copies that start while the caller
 * is still queuing them (a broadcast of a module's many parameters between
 * host and virtual CPU devices), run by one consumer per core (copy_engine.h).
 *
 * jobs_launch's first call starts the consumers on the device workers; each
 * later call publishes the jobs queued since. A consumer claims a run of
 * about FEED_CHUNK bytes of published jobs at a time, in queue order, and
 * copies it with streaming stores; jobs_run publishes the rest, closes the
 * feed and waits. A fixed set of consumers, not a batch of groups per call:
 * a new batch while the last one still copies would start new worker
 * threads (pool.c starts one when a device's threads are all busy), and the
 * copies of 2 devices would run on many threads over 2 cores.
 */
#include "dpmini.h"
#include "copy_engine.h"
#include "pool.h"

#include <errno.h>
#include <pthread.h>
#include <string.h>

/* Bytes a consumer claims at a time: enough to make a claim's lock cheap
 * against its copy, small enough that the consumers end together. */
#define FEED_CHUNK ((uint64_t)1 << 19)

struct job_feed {
    pthread_mutex_t mu;
    pthread_cond_t cv;      /* signalled when jobs are published or the feed closes */
    const copy_job *jobs;   /* the list's jobs (they never move while the feed runs) */
    Py_ssize_t published;   /* jobs [0, published) may be claimed; guarded by mu */
    Py_ssize_t claimed;     /* jobs [0, claimed) are claimed; guarded by mu */
    int closed;             /* no more jobs come; guarded by mu */
    dp_batch batch;         /* the consumers */
    dp_prof_ctx prof;       /* the call's recording context (profile.h) */
};

/* A consumer (a device worker, no GIL): claims and copies runs of jobs until
 * the feed is closed and empty. A run ends at a job boundary past
 * FEED_CHUNK bytes, and never between two copies of one source (a
 * broadcast's second copy then reads the source from this core's cache). */
static void feed_consume(void *arg)
{
    struct job_feed *f = arg;
    copy_spans cs;
    copy_spans_init(&cs, f->prof, DP_PROF_PATH_FEED);
    pthread_mutex_lock(&f->mu);
    for (;;) {
        if (f->claimed == f->published && cs.n > 0) {
            copy_spans_flush(&cs, 0);   /* a busy stretch ends */
        }
        while (f->claimed == f->published && !f->closed) {
            pthread_cond_wait(&f->cv, &f->mu);
        }
        if (f->claimed == f->published) {
            break;
        }
        Py_ssize_t from = f->claimed, to = from;
        uint64_t bytes = 0;
        while (to < f->published &&
               (bytes < FEED_CHUNK || f->jobs[to].src == f->jobs[to - 1].src)) {
            bytes += f->jobs[to].bytes;
            to++;
        }
        f->claimed = to;
        pthread_mutex_unlock(&f->mu);
        uint64_t t0 = cs.ctx.s != NULL ? dp_prof_now() : 0;
        for (Py_ssize_t i = from; i < to; i++) {
            job_run_host(&f->jobs[i], DP_COPY_STREAM);
            if (cs.ctx.s != NULL) {
                uint64_t t1 = dp_prof_now();
                copy_spans_add(&cs, &f->jobs[i], t0, t1);
                t0 = t1;
            }
        }
        pthread_mutex_lock(&f->mu);
    }
    pthread_mutex_unlock(&f->mu);
    copy_spans_flush(&cs, 0);
}

/* Publish jobs [0, n) (GIL held; the lock is never held long). */
static void feed_publish(struct job_feed *f, Py_ssize_t n, int close)
{
    pthread_mutex_lock(&f->mu);
    f->published = n;
    f->closed |= close;
    pthread_cond_broadcast(&f->cv);
    pthread_mutex_unlock(&f->mu);
}

/* Close the feed, wait for its consumers (the GIL released) and free it.
 * drop: the jobs not claimed yet are dropped (an error path). */
void jobs_feed_end(job_list *l, int drop)
{
    struct job_feed *f = l->feed;
    if (f == NULL) {
        return;
    }
    pthread_mutex_lock(&f->mu);
    if (drop) {
        f->published = f->claimed;
    }
    f->closed = 1;
    pthread_cond_broadcast(&f->cv);
    pthread_mutex_unlock(&f->mu);
    Py_BEGIN_ALLOW_THREADS
    dp_batch_wait(&f->batch, -1);
    Py_END_ALLOW_THREADS
    dp_batch_destroy(&f->batch);
    pthread_cond_destroy(&f->cv);
    pthread_mutex_destroy(&f->mu);
    PyMem_Free(f);
    l->feed = NULL;
}

/* Start the consumers: one per core, at most one per virtual CPU device the
 * queued jobs go through, each on one of those devices' workers. 1 when at
 * least one started, 0 when none could (jobs_run copies), -1 on error. */
static int feed_start(job_list *l)
{
    unsigned char seen[DP_POOL_MAX_INDEX] = {0};
    for (Py_ssize_t i = 0; i < l->n; i++) {
        int x = l->jobs[i].exec.index;
        seen[x >= 0 && x < DP_POOL_MAX_INDEX ? x : 0] = 1;
    }
    struct job_feed *f = PyMem_Calloc(1, sizeof *f);
    if (f == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    if (pthread_mutex_init(&f->mu, NULL) != 0) {
        goto no_mutex;
    }
    if (pthread_cond_init(&f->cv, NULL) != 0) {
        goto no_cond;
    }
    if (dp_batch_init(&f->batch) != 0) {
        goto no_batch;
    }
    f->jobs = l->jobs;
    f->published = l->n;
    f->prof = dp_prof_current();
    int want = dp_pool_cores(), started = 0;
    for (int x = 0; x < DP_POOL_MAX_INDEX && started < want; x++) {
        if (seen[x] && dp_batch_submit(&f->batch, DP_VCPU, x, feed_consume, f) == 0) {
            started++;
        }
    }
    if (started > 0) {
        l->feed = f;
        return 1;
    }
    dp_batch_destroy(&f->batch);   /* none started: jobs_run copies instead */
no_batch:
    pthread_cond_destroy(&f->cv);
no_cond:
    pthread_mutex_destroy(&f->mu);
no_mutex:
    PyMem_Free(f);
    return 0;
}

/* 1 when jobs [from, l->n) only touch host and virtual CPU memory (the
 * feed's kind: GPU copies report errors, so they run in jobs_run). */
static int host_only(const job_list *l, Py_ssize_t from)
{
    for (Py_ssize_t i = from; i < l->n; i++) {
        if (l->jobs[i].exec.kind != DP_VCPU || l->jobs[i].src_dev.kind == DP_CUDA ||
            l->jobs[i].dst_dev.kind == DP_CUDA) {
            return 0;
        }
    }
    return 1;
}

int jobs_launch(job_list *l)
{
    if (l->n == l->launched) {
        return l->feed != NULL;
    }
    if (l->feed == NULL) {
        if (dp_pool_in_worker() || !host_only(l, 0)) {
            return 0;
        }
        int r = feed_start(l);
        if (r <= 0) {
            return r;
        }
    } else {
        if (!host_only(l, l->launched)) {
            return 0;   /* left for jobs_run, after the feed ends */
        }
        feed_publish(l->feed, l->n, 0);
    }
    l->launched = l->n;
    l->launched_bytes = l->bytes;
    return 1;
}
