/* omp_team.c - park the calling thread's OpenMP team (omp_team.h).
 *
 * Sections: the runtimes (found among the loaded objects), the parked
 * region.
 */
#define _GNU_SOURCE
#include "omp_team.h"
#include "spin.h"

#include <dlfcn.h>
#include <link.h>
#include <pthread.h>
#include <stddef.h>
#include <stdlib.h>
#include <string.h>

#define MAX_RUNTIMES 4
/* A parked thread polls this long before it blocks: a call of small
 * replicas is over by then, and its end does not wait for a wake-up. */
#define PARK_SPIN_NS 50000L
/* A parked thread woken early (dp_omp_wake_parked) polls this long for the
 * region's end before it blocks again: the rest of the call (a gather) is
 * well under it, and the end then waits for no wake-up. */
#define WAKE_SPIN_NS 2000000L

/* ------------------------------------------------------------------ */
/* The runtimes                                                        */
/* ------------------------------------------------------------------ */

/* The entry points used, as libgomp names them (GOMP_parallel: GCC's call
 * for `#pragma omp parallel`; LLVM's and Intel's runtimes export it too). */
typedef struct {
    void (*parallel)(void (*fn)(void *), void *data, unsigned nthreads, unsigned flags);
    int (*max_threads)(void);
    int (*in_parallel)(void);
    int (*thread_num)(void);
    void (*set_threads)(int);   /* omp_set_num_threads */
    void *handle;   /* dlopen handle: keeps the object loaded while listed */
} omp_runtime;

static pthread_mutex_t runtimes_mu = PTHREAD_MUTEX_INITIALIZER;
static omp_runtime runtimes[MAX_RUNTIMES];   /* guarded by runtimes_mu */
static int nruntimes;
static unsigned long long seen_adds, seen_subs;
static int scanned;

/* The loader's counts of objects loaded and unloaded so far (glibc keeps
 * them in every dl_iterate_phdr record): stop at the first object. */
static int read_counts(struct dl_phdr_info *info, size_t size, void *data)
{
    unsigned long long *counts = data;
    if (size < offsetof(struct dl_phdr_info, dlpi_subs) + sizeof info->dlpi_subs) {
        return 1;   /* an old loader without the counts: 0, 0 (looked up once) */
    }
    counts[0] = info->dlpi_adds;
    counts[1] = info->dlpi_subs;
    return 1;
}

typedef struct {
    char *names[MAX_RUNTIMES];
    int n;
} runtime_names;

/* Objects named like an OpenMP runtime (libgomp*, libiomp*, libomp*; a
 * wheel's bundled copy has a hash after the name). Only names are taken
 * here: dlopen must not be called while dl_iterate_phdr holds its lock. */
static int collect_name(struct dl_phdr_info *info, size_t size, void *data)
{
    (void)size;
    runtime_names *found = data;
    const char *path = info->dlpi_name;
    const char *base = path != NULL ? strrchr(path, '/') : NULL;
    base = base != NULL ? base + 1 : path;
    if (base == NULL || found->n == MAX_RUNTIMES) {
        return found->n == MAX_RUNTIMES;
    }
    if (strncmp(base, "libgomp", 7) == 0 || strncmp(base, "libiomp", 7) == 0 ||
        strncmp(base, "libomp", 6) == 0) {
        char *copy = strdup(path);
        if (copy != NULL) {
            found->names[found->n++] = copy;
        }
    }
    return 0;
}

/* The runtime of an object already loaded: 1 with *rt filled (its handle
 * held), 0 when it is gone or lacks an entry point. */
static int open_runtime(const char *path, omp_runtime *rt)
{
    void *h = dlopen(path, RTLD_LAZY | RTLD_NOLOAD);
    if (h == NULL) {
        return 0;
    }
    *(void **)&rt->parallel = dlsym(h, "GOMP_parallel");
    *(void **)&rt->max_threads = dlsym(h, "omp_get_max_threads");
    *(void **)&rt->in_parallel = dlsym(h, "omp_in_parallel");
    *(void **)&rt->thread_num = dlsym(h, "omp_get_thread_num");
    *(void **)&rt->set_threads = dlsym(h, "omp_set_num_threads");
    if (rt->parallel == NULL || rt->max_threads == NULL || rt->in_parallel == NULL ||
        rt->thread_num == NULL || rt->set_threads == NULL) {
        dlclose(h);
        return 0;
    }
    rt->handle = h;
    return 1;
}

/* Look the runtimes up again (runtimes_mu held). Two names of one object
 * (a link and its target) count once. */
static void rescan(void)
{
    runtime_names found = {{NULL}, 0};
    omp_runtime fresh[MAX_RUNTIMES];
    int n = 0;
    dl_iterate_phdr(collect_name, &found);
    for (int i = 0; i < found.n; i++) {
        omp_runtime rt;
        if (open_runtime(found.names[i], &rt)) {
            int dup = 0;
            for (int j = 0; j < n; j++) {
                dup |= fresh[j].parallel == rt.parallel;
            }
            if (dup) {
                dlclose(rt.handle);
            } else {
                fresh[n++] = rt;
            }
        }
        free(found.names[i]);
    }
    for (int i = 0; i < nruntimes; i++) {
        dlclose(runtimes[i].handle);
    }
    memcpy(runtimes, fresh, (size_t)n * sizeof *fresh);
    nruntimes = n;
}

/* Set in a forked child: it never parks. A runtime's team does not survive
 * fork (libgomp's child still counts the parent's threads in the team of the
 * thread that forked, and its next region of more than one thread waits for
 * them for good), so the region that parks would hang a child whose own code
 * (small ops, replicas on dpmini's workers) never started one. */
static int forked_child;

/* A child forked while another thread looked the runtimes up would find
 * runtimes_mu held forever: it starts with the lock free (the list stays
 * valid: the same objects are mapped in the child). */
static void unlock_in_child(void)
{
    pthread_mutex_init(&runtimes_mu, NULL);
    forked_child = 1;
}

/* Registered when the object is loaded, so that a fork before the first
 * parked call is seen too. */
__attribute__((constructor)) static void register_atfork(void)
{
    (void)pthread_atfork(NULL, NULL, unlock_in_child);
}

/* The loaded runtimes, copied into out; their number. Looked up again only
 * when the loader's counts changed since the last look. */
static int current_runtimes(omp_runtime *out)
{
    unsigned long long counts[2] = {0, 0};
    dl_iterate_phdr(read_counts, counts);
    pthread_mutex_lock(&runtimes_mu);
    if (!scanned || counts[0] != seen_adds || counts[1] != seen_subs) {
        rescan();
        seen_adds = counts[0];
        seen_subs = counts[1];
        scanned = 1;
    }
    int n = nruntimes;
    memcpy(out, runtimes, (size_t)n * sizeof *out);
    pthread_mutex_unlock(&runtimes_mu);
    return n;
}

/* ------------------------------------------------------------------ */
/* The parked region                                                   */
/* ------------------------------------------------------------------ */

/* One parked region: the master (thread 0) runs the rest (the runtimes
 * after this one, then fn); the others wait on `woken` until it is done. */
typedef struct parked_region {
    const omp_runtime *rts;
    int level, n;
    dp_team_fn fn;
    void *arg;
    int parked;             /* runtimes parked so far (the master's count) */
    int threads_set;        /* the master's thread count when fn returned, */
    int threads_changed;    /* when fn changed it (omp_set_num_threads) */
    pthread_mutex_t mu;
    pthread_cond_t woken;
    int done;               /* written under mu; polled atomically */
    int wake;               /* dp_omp_wake_parked was called; under mu */
    struct parked_region *outer;   /* the master's enclosing parked region */
} parked_region;

/* The innermost region the calling thread is the master of (one per loaded
 * runtime, nested), for dp_omp_wake_parked. */
static __thread parked_region *current_region;

static int run_from(const omp_runtime *rts, int level, int n, dp_team_fn fn, void *arg);

/* Poll for the region's end for spin_ns, unless it ended already. */
static void poll_for_end(parked_region *p, long spin_ns)
{
    spin_clock clock = {now_ns() + spin_ns, now_ns(), 0};
    while (!__atomic_load_n(&p->done, __ATOMIC_ACQUIRE) && spin_turn(&clock)) {
    }
}

/* A parked thread: poll briefly, then sleep until the region ends; woken
 * early, poll once more (WAKE_SPIN_NS) before sleeping again. */
static void wait_for_end(parked_region *p)
{
    int polled_after_wake = 0;
    poll_for_end(p, PARK_SPIN_NS);
    pthread_mutex_lock(&p->mu);
    while (!p->done) {
        if (p->wake && !polled_after_wake) {
            polled_after_wake = 1;
            pthread_mutex_unlock(&p->mu);
            poll_for_end(p, WAKE_SPIN_NS);
            pthread_mutex_lock(&p->mu);
            continue;
        }
        pthread_cond_wait(&p->woken, &p->mu);
    }
    pthread_mutex_unlock(&p->mu);
}

static void region_body(void *data)
{
    parked_region *p = data;
    if (p->rts[p->level].thread_num() != 0) {
        wait_for_end(p);
        return;
    }
    int threads = p->rts[p->level].max_threads();
    p->outer = current_region;
    current_region = p;
    p->parked = 1 + run_from(p->rts, p->level + 1, p->n, p->fn, p->arg);
    current_region = p->outer;
    p->threads_set = p->rts[p->level].max_threads();
    p->threads_changed = p->threads_set != threads;
    pthread_mutex_lock(&p->mu);
    __atomic_store_n(&p->done, 1, __ATOMIC_RELEASE);
    pthread_cond_broadcast(&p->woken);
    pthread_mutex_unlock(&p->mu);
}

/* fn(arg) with the teams of runtimes level .. n-1 parked; how many were. */
static int run_from(const omp_runtime *rts, int level, int n, dp_team_fn fn, void *arg)
{
    for (; level < n; level++) {
        const omp_runtime *rt = &rts[level];
        int team = rt->max_threads();
        if (team > 1 && !rt->in_parallel()) {
            parked_region p = {.rts = rts, .level = level, .n = n, .fn = fn, .arg = arg,
                               .mu = PTHREAD_MUTEX_INITIALIZER,
                               .woken = PTHREAD_COND_INITIALIZER};
            rt->parallel(region_body, &p, (unsigned)team, 0);
            /* The region's end drops what fn set in its implicit task: a
             * thread count fn set (torch.set_num_threads, or torch setting
             * a new thread's count when it first uses it) is the thread's. */
            if (p.threads_changed) {
                rt->set_threads(p.threads_set);
            }
            pthread_mutex_destroy(&p.mu);
            pthread_cond_destroy(&p.woken);
            return p.parked;
        }
    }
    fn(arg);
    return 0;
}

int dp_omp_run_parked(dp_team_fn fn, void *arg)
{
    if (__atomic_load_n(&forked_child, __ATOMIC_RELAXED)) {
        fn(arg);
        return 0;
    }
    omp_runtime rts[MAX_RUNTIMES];
    int n = current_runtimes(rts);
    return run_from(rts, 0, n, fn, arg);
}

void dp_omp_wake_parked(void)
{
    for (parked_region *p = current_region; p != NULL; p = p->outer) {
        pthread_mutex_lock(&p->mu);
        p->wake = 1;
        pthread_cond_broadcast(&p->woken);
        pthread_mutex_unlock(&p->mu);
    }
}
