/* nccl.c - NCCL, loaded with dlopen on first use (never at import), for
 * comm.broadcast / broadcast_coalesced / reduce_add on distinct GPUs.
 *
 * The library is nccl_lib.c's, bound once for both extensions; its search
 * order for libnccl.so.2 (lib_search.c):
 * $DPMINI_NCCL_LIBRARY (a full path), the nvidia-nccl wheel's folder
 * (site-packages/nvidia/nccl/lib, found on sys.path), $CUDA_HOME/lib64,
 * /usr/local/cuda/lib64, then the default loader path. Not loaded: callers
 * use the copy-and-kernel fallback.
 * Under emulation (and in CPU-only builds) NCCL is never loaded.
 *
 * The NCCL declarations (nccl_api.h) are the few we call, written from NCCL's
 * public ABI (nccl.h), so the build does not need NCCL's headers.
 * Communicators (ncclCommInitAll over a device list) are cached per device
 * list (8 lists at most) for the life of the process, like PyTorch's; a list
 * that finds the cache full gets communicators that are destroyed after the
 * call. One process-wide lock (nccl_run_mu) is held from taking the
 * communicators through the final stream syncs: collectives of two threads
 * on overlapping device lists ([0, 1] and [1, 0]) share NCCL's stream slot of
 * each device, and if they were queued there in different orders each
 * device would wait in one collective for ranks that wait in the other (a
 * hang). So collectives run one at a time, in one order on every device
 * (a collective is bandwidth-bound on the same links anyway). Each cache
 * entry also has its own lock (eviction, destroy). After any
 * failure the entry's communicators are aborted (ncclCommAbort) and evicted:
 * a failed collective can leave them unusable.
 *
 * Under emulation (DPMINI_CUDA_EMULATE) a stand-in NCCL made of cuda_api.h
 * calls (nccl_emulate.c) can be switched on (_dpmini._emulated_nccl(True)): off by default,
 * like a machine without libnccl; on, so the NCCL paths of copy_engine.c
 * and reduce.c and the locking, caching, destroy and abort logic here run
 * in CI.
 */
#include "gpu.h"
#include "gpu_fork.h"
#include "nccl_wait.h"
#include "nccl_api.h"
#include "plan.h" /* DP_MAX_DEVICES */

#include <pthread.h>
#include <stdio.h>
#include <time.h>
#include <stdlib.h>
#include <string.h>

static dp_nccl_lib nccl;   /* nccl_lib.c's, or the stand-in under emulation */

static pthread_mutex_t nccl_mu = PTHREAD_MUTEX_INITIALIZER;
static pthread_mutex_t nccl_run_mu = PTHREAD_MUTEX_INITIALIZER; /* one collective at a time */
static int nccl_state;            /* 0 not tried, 1 loaded, -1 absent  */
static char nccl_desc[256] = "not loaded";

#define NCCL_MAX_COMMS 8
typedef struct {
    pthread_mutex_t mu;           /* held for a whole collective             */
    int n;                        /* guarded by nccl_mu (with comms)         */
    int devs[DP_MAX_DEVICES];
    ncclComm_t *comms;            /* NULL: a free slot                       */
} comm_entry;
static comm_entry comm_cache[NCCL_MAX_COMMS];
static pthread_once_t comm_once = PTHREAD_ONCE_INIT;
static long nccl_calls;           /* collectives run (tests)                 */
static long nccl_destroyed;       /* uncached communicator sets destroyed    */
static long nccl_aborted;         /* communicator sets aborted after errors  */

static void comm_init(void)
{
    for (int i = 0; i < NCCL_MAX_COMMS; i++) {
        pthread_mutex_init(&comm_cache[i].mu, NULL);
    }
}

/* With the GIL held (nccl_lib.c's first load reads sys.path). */
static void nccl_load(void)
{
    char why[200] = "";
    if (strcmp(dpc_backend(), "cuda") != 0 || dpc_device_count() == 0) {
        snprintf(nccl_desc, sizeof nccl_desc, "not loaded (%s backend)", dpc_backend());
        nccl_state = -1;
        return;
    }
    const dp_nccl_lib *lib = dp_nccl_lib_load(why, sizeof why);
    if (lib == NULL) {
        snprintf(nccl_desc, sizeof nccl_desc, "%s", why);
        nccl_state = -1;
        return;
    }
    nccl = *lib;
    snprintf(nccl_desc, sizeof nccl_desc, "%s", lib->desc);
    nccl_state = 1;
}

int dp_nccl_available(void)
{
    pthread_mutex_lock(&nccl_mu);
    if (nccl_state == 0) {
        nccl_load();
    }
    int ok = nccl_state == 1;
    pthread_mutex_unlock(&nccl_mu);
    return ok;
}

const char *dp_nccl_describe(void)
{
    return nccl_desc;
}

#define NCCL_FAIL(r, dev, call)                                                 \
    dpc_fail(DPC_LIB_NCCL, (r), 0, (dev), (call), __FILE__, __LINE__, nccl.GetErrorString(r))

/* Communicators for a device list, for one collective: from the cache with
 * the entry's lock held (entry != NULL), or uncached (entry NULL, destroyed
 * by comms_release). */
typedef struct {
    comm_entry *entry;
    ncclComm_t *comms;
    int n;
} comm_lease;

static int entry_matches(const comm_entry *e, int n, const int *devs)
{
    return e->comms != NULL && e->n == n && memcmp(e->devs, devs, (size_t)n * sizeof(int)) == 0;
}

static dpc_status comms_acquire(int n, const int *devs, comm_lease *L)
{
    pthread_once(&comm_once, comm_init);
    L->entry = NULL;
    L->comms = NULL;
    L->n = n;
    for (;;) {
        comm_entry *hit = NULL;
        pthread_mutex_lock(&nccl_mu);
        for (int i = 0; i < NCCL_MAX_COMMS && hit == NULL; i++) {
            if (entry_matches(&comm_cache[i], n, devs)) {
                hit = &comm_cache[i];
            }
        }
        pthread_mutex_unlock(&nccl_mu);
        if (hit == NULL) {
            break;
        }
        pthread_mutex_lock(&hit->mu);
        pthread_mutex_lock(&nccl_mu);
        int still = entry_matches(hit, n, devs); /* not evicted meanwhile */
        pthread_mutex_unlock(&nccl_mu);
        if (still) {
            L->entry = hit;
            L->comms = hit->comms;
            return dpc_ok();
        }
        pthread_mutex_unlock(&hit->mu);
    }
    ncclComm_t *comms = calloc((size_t)n, sizeof(ncclComm_t));
    if (comms == NULL) {
        return dpc_fail(DPC_LIB_DPMINI, 1, 1, -1, "calloc", __FILE__, __LINE__,
                        "out of host memory");
    }
    /* NCCL sets each device while it builds the communicators, then restores
     * the device it found current; on a fresh thread that is device 0 and the
     * restore creates its context. Under a guard on devs[0] it restores
     * devs[0], and the guard then restores the thread (no context included). */
    dpc_device_guard guard;
    dpc_status gs = dpc_guard_enter(devs[0], &guard);
    if (gs.code != 0) {
        free(comms);
        return gs;
    }
    dp_launch_begin();   /* it allocates and connects on every device */
    ncclResult_t r = nccl.CommInitAll(comms, n, devs);
    dp_launch_end();
    dpc_guard_leave(&guard);
    if (r != 0) {
        free(comms);
        return NCCL_FAIL(r, devs[0], "ncclCommInitAll(comms, n, devs)");
    }
    L->comms = comms;
    /* Cache it in a free slot whose lock nobody holds (an evicting thread
     * may still hold a freed slot's lock briefly: skip that one). Another
     * thread may have cached the same list meanwhile: then these stay
     * uncached and are destroyed after the call. */
    pthread_mutex_lock(&nccl_mu);
    int dup = 0;
    for (int i = 0; i < NCCL_MAX_COMMS; i++) {
        dup = dup || entry_matches(&comm_cache[i], n, devs);
    }
    for (int i = 0; i < NCCL_MAX_COMMS && !dup; i++) {
        comm_entry *e = &comm_cache[i];
        if (e->comms == NULL && pthread_mutex_trylock(&e->mu) == 0) {
            e->n = n;
            memcpy(e->devs, devs, (size_t)n * sizeof(int));
            e->comms = comms;
            L->entry = e;
            break;
        }
    }
    pthread_mutex_unlock(&nccl_mu);
    return dpc_ok();
}

/* End a collective: on failure abort the communicators (and evict them
 * from the cache); uncached ones are destroyed; the entry lock is released. */
static dpc_status comms_release(comm_lease *L, dpc_status st)
{
    if (st.code != 0) {
        if (L->entry != NULL) {
            pthread_mutex_lock(&nccl_mu);
            L->entry->comms = NULL; /* evicted: later calls make new ones */
            pthread_mutex_unlock(&nccl_mu);
        }
        for (int i = 0; i < L->n; i++) {
            (void)nccl.CommAbort(L->comms[i]);
        }
        free(L->comms);
        __atomic_add_fetch(&nccl_aborted, 1, __ATOMIC_RELAXED);
    } else if (L->entry == NULL) {
        for (int i = 0; i < L->n; i++) {
            ncclResult_t r = nccl.CommDestroy(L->comms[i]);
            if (r != 0 && st.code == 0) {
                st = NCCL_FAIL(r, -1, "ncclCommDestroy(comm)");
            }
        }
        free(L->comms);
        __atomic_add_fetch(&nccl_destroyed, 1, __ATOMIC_RELAXED);
    }
    if (L->entry != NULL) {
        pthread_mutex_unlock(&L->entry->mu);
    }
    L->entry = NULL;
    L->comms = NULL;
    return st;
}

static int async_err(void *ctx, int i)
{
    ncclResult_t e = 0;
    ncclResult_t r = nccl.CommGetAsyncError(((ncclComm_t *)ctx)[i], &e);
    return r != 0 ? r : e;
}

/* One grouped collective: op(i) queues rank i's call. */
typedef ncclResult_t (*rank_fn)(void *ctx, int i, ncclComm_t comm, dpc_stream s);

static dpc_status run_group(int n, const int *devs, int root, rank_fn op, void *ctx,
                            const char *what)
{
    comm_lease L;
    dpc_status st;
    if (dp_gpu_forked()) {
        return dp_gpu_forked_status(devs[root]);
    }
    pthread_mutex_lock(&nccl_run_mu);
    st = comms_acquire(n, devs, &L);
    if (st.code != 0) {
        pthread_mutex_unlock(&nccl_run_mu);
        return st;
    }
    dp_launch_begin();   /* no cudaFree / cudaMalloc / device sync meanwhile */
    ncclResult_t r = nccl.GroupStart();
    if (r != 0) {
        dp_launch_end();
        st = comms_release(&L, NCCL_FAIL(r, devs[root], "ncclGroupStart()"));
        pthread_mutex_unlock(&nccl_run_mu);
        return st;
    }
    st = dpc_ok();
    for (int i = 0; i < n && st.code == 0; i++) {
        dpc_stream s;
        st = dpc_stream_get(devs[i], DP_NCCL_SLOT, &s);
        if (st.code == 0) {
            r = op(ctx, i, L.comms[i], s);
            if (r != 0) {
                st = NCCL_FAIL(r, devs[i], what);
            }
        }
    }
    r = nccl.GroupEnd();
    dp_launch_end();
    if (r != 0 && st.code == 0) {
        st = NCCL_FAIL(r, devs[root], "ncclGroupEnd()");
    }
    if (st.code == 0) {
        st = dp_nccl_wait(n, devs, async_err, L.comms); /* polls: errors, Ctrl-C, timeout */
    }
    __atomic_add_fetch(&nccl_calls, 1, __ATOMIC_RELAXED);
    st = comms_release(&L, st);
    pthread_mutex_unlock(&nccl_run_mu);
    return st;
}

typedef struct {
    void *const *bufs;      /* [array * n + rank] */
    const size_t *nbytes;
    const int *roots;
    int narr, n;
} bcast_ctx;

/* Rank i's calls: one broadcast per array, in array order on every rank
 * (NCCL matches a communicator's calls in a group by their order). */
static ncclResult_t bcast_rank(void *ctx, int i, ncclComm_t comm, dpc_stream s)
{
    bcast_ctx *c = ctx;
    for (int a = 0; a < c->narr; a++) {
        void *const *b = &c->bufs[(size_t)a * (size_t)c->n];
        int root = c->roots[a];
        ncclResult_t r = nccl.Broadcast(b[root], b[i], c->nbytes[a], NCCL_UINT8, root, comm, s);
        if (r != 0) {
            return r;
        }
    }
    return 0;
}

dpc_status dp_nccl_broadcast_many(int n, const int *devs, int narr, void *const *bufs,
                                  const size_t *nbytes, const int *roots)
{
    int per = NCCL_GROUP_OPS / n > 0 ? NCCL_GROUP_OPS / n : 1;
    for (int a = 0; a < narr; a += per) {
        bcast_ctx c = {&bufs[(size_t)a * (size_t)n], &nbytes[a], &roots[a],
                       narr - a < per ? narr - a : per, n};
        DPC_TRY(run_group(n, devs, roots[a], bcast_rank, &c, "ncclBroadcast"));
    }
    return dpc_ok();
}

dpc_status dp_nccl_broadcast(int n, const int *devs, void *const *bufs, size_t nbytes, int root)
{
    return dp_nccl_broadcast_many(n, devs, 1, bufs, &nbytes, &root);
}

static int nccl_type(int t)
{
    switch (t) {
    case DPC_T_I8: return NCCL_INT8;
    case DPC_T_U8: return NCCL_UINT8;
    case DPC_T_I32: return NCCL_INT32;
    case DPC_T_U32: return NCCL_UINT32;
    case DPC_T_I64: return NCCL_INT64;
    case DPC_T_U64: return NCCL_UINT64;
    case DPC_T_F32: return NCCL_FLOAT32;
    case DPC_T_F64: return NCCL_FLOAT64;
    case DPC_T_F16: return NCCL_FLOAT16;
    default: return -1; /* int16/uint16: NCCL has no 16-bit integer type */
    }
}

int dp_nccl_supports(int type)
{
    return nccl_type(type) >= 0;
}

typedef struct {
    const void *const *send;
    void *recv;
    size_t count;
    int nt, root;
} reduce_ctx;

static ncclResult_t reduce_rank(void *ctx, int i, ncclComm_t comm, dpc_stream s)
{
    reduce_ctx *c = ctx;
    return nccl.Reduce(c->send[i], i == c->root ? c->recv : NULL, c->count, c->nt, NCCL_SUM,
                       c->root, comm, s);
}

dpc_status dp_nccl_reduce(int n, const int *devs, const void *const *send, void *recv,
                          int64_t numel, int type, int root)
{
    int nt = nccl_type(type);
    if (nt < 0) {
        return dpc_fail(DPC_LIB_DPMINI, 1, 0, devs[root], "ncclReduce", __FILE__, __LINE__,
                        "dtype not supported by NCCL");
    }
    reduce_ctx c = {send, recv, (size_t)numel, nt, root};
    return run_group(n, devs, root, reduce_rank, &c, "ncclReduce");
}

void dp_nccl_shutdown(void)
{
    /* At interpreter exit: destroy the cached communicators (they hold NCCL
     * threads, sockets and GPU memory). Not in a forked child (they are the
     * parent's), and not while a collective runs on another thread (a
     * daemon thread at exit): destroying would wait for it or race with it. */
    if (dp_gpu_forked() || pthread_mutex_trylock(&nccl_run_mu) != 0) {
        return;
    }
    pthread_mutex_lock(&nccl_mu);
    int loaded = nccl_state == 1;
    pthread_mutex_unlock(&nccl_mu);
    pthread_once(&comm_once, comm_init);
    for (int i = 0; loaded && i < NCCL_MAX_COMMS; i++) {
        comm_entry *e = &comm_cache[i];
        pthread_mutex_lock(&e->mu);
        pthread_mutex_lock(&nccl_mu);
        ncclComm_t *comms = e->comms;
        int n = e->n;
        e->comms = NULL;
        pthread_mutex_unlock(&nccl_mu);
        for (int r = 0; comms != NULL && r < n; r++) {
            (void)nccl.CommDestroy(comms[r]);
        }
        free(comms);
        pthread_mutex_unlock(&e->mu);
    }
    pthread_mutex_unlock(&nccl_run_mu);
}

void dp_nccl_stats(long *calls, long *destroyed, long *aborted)
{
    *calls = __atomic_load_n(&nccl_calls, __ATOMIC_RELAXED);
    *destroyed = __atomic_load_n(&nccl_destroyed, __ATOMIC_RELAXED);
    *aborted = __atomic_load_n(&nccl_aborted, __ATOMIC_RELAXED);
}

/* ------------------------------------------------------------------ */
/* Switching the emulated NCCL on (nccl_emulate.c)                     */
/* ------------------------------------------------------------------ */

#ifdef DPMINI_CUDA_EMULATE
int dp_nccl_emulate(int on, int fail_next)
{
    pthread_mutex_lock(&nccl_mu);
    int prev = nccl_state == 1;
    if (on >= 0) {
        if (on) {
            nccl_state = dp_nccl_emu_install(&nccl, nccl_desc, sizeof nccl_desc);
        } else {
            nccl_state = -1;
            snprintf(nccl_desc, sizeof nccl_desc, "not loaded (emulated backend)");
        }
    }
    if (fail_next) {
        dp_nccl_emu_fail_next(fail_next);
    }
    pthread_mutex_unlock(&nccl_mu);
    return prev;
}
#else
int dp_nccl_emulate(int on, int fail_next)
{
    (void)on;
    (void)fail_next;
    return -1; /* not an emulated build */
}
#endif
