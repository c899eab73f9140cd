/* nccl_emulate.c - a stand-in NCCL made of cuda_api.h calls, for
 * DPMINI_CUDA_EMULATE builds: switched on with _dpmini._emulated_nccl(True)
 * (nccl.c's dp_nccl_emulate installs these functions in place of the
 * dlopen'ed ones), so that the NCCL paths of copy_engine.c and reduce.c and
 * nccl.c's locking, caching, destroy and abort logic run in CI. Other
 * builds get the test hooks' answers "not emulated".
 */
#define _POSIX_C_SOURCE 200809L

#include "plan.h"
#include "gpu.h"
#include "nccl_api.h"

#include <pthread.h>
#include <stdio.h>
#include <time.h>
#include <stdlib.h>
#include <unistd.h>
#include <string.h>

#ifdef DPMINI_CUDA_EMULATE
/* Calls inside a group are recorded per thread and run at GroupEnd with
 * cuda_api.h copies and the add kernel, checking what NCCL checks: every
 * rank of a communicator set called, the same op, root and count. */
enum { EMU_BCAST = 1, EMU_REDUCE = 2 };
typedef struct dp_nccl_comm {
    int rank, nranks, dev;
    int async_err;                /* ncclCommGetAsyncError's answer          */
    struct dp_nccl_comm **set;     /* comms[0 .. nranks-1]                    */
    int *alive;                   /* shared: ranks not yet destroyed         */
} emu_comm;
typedef struct {
    int op, type, root;
    const void *send;
    void *recv;
    size_t count;
    emu_comm *comm;
} emu_call;

/* A group's calls (NCCL_GROUP_OPS at most), allocated per group. */
static __thread emu_call *emu_calls;
static __thread int emu_ncalls, emu_depth;
static int emu_nccl_fail_next;    /* tests: next GroupEnd fails with this  */
/* Collectives of different communicator sets running at once on a shared
 * device: on hardware their kernels can be queued on the device's streams
 * in different orders on different devices and wait for each other forever.
 * The stand-in marks each device of a running collective (and holds it a
 * little, so concurrent threads meet) and counts such crossings. */
static pthread_mutex_t emu_busy_mu = PTHREAD_MUTEX_INITIALIZER;
static emu_comm **emu_busy_set[DP_MAX_DEVICES]; /* guarded by emu_busy_mu */
static int emu_busy_n[DP_MAX_DEVICES];          /* guarded by emu_busy_mu */
static long emu_nccl_crossed;
static int emu_nccl_live;         /* communicators alive (tests)           */

static ncclResult_t emu_version(int *v)
{
    *v = 22105;
    return 0;
}

static ncclResult_t emu_init_all(ncclComm_t *comms, int n, const int *devs)
{
    emu_comm **set = calloc((size_t)n, sizeof *set);
    int *alive = malloc(sizeof *alive);
    if (set == NULL || alive == NULL) {
        free(set);
        free(alive);
        return 1; /* ncclUnhandledCudaError... any non-zero: a failure */
    }
    *alive = n;
    /* NCCL makes each device current while it sets up, then restores the
     * device it found (cudaSetDevice: on a fresh thread device 0, whose
     * context that creates) */
    int saved = dpc_current_device();
    for (int i = 0; i < n; i++) {
        (void)dpc_set_device(devs[i]);
    }
    (void)dpc_set_device(saved >= 0 ? saved : 0);
    for (int i = 0; i < n; i++) {
        set[i] = calloc(1, sizeof **set);
        set[i]->rank = i;
        set[i]->nranks = n;
        set[i]->dev = devs[i];
        set[i]->set = set;
        set[i]->alive = alive;
        comms[i] = set[i];
    }
    __atomic_add_fetch(&emu_nccl_live, n, __ATOMIC_RELAXED);
    return 0;
}

static int emu_nccl_hang_next;    /* tests: next collective hangs (1: with
                                   * an async error, 2: silently)           */

static ncclResult_t emu_async_error(ncclComm_t c, ncclResult_t *e)
{
    *e = c == NULL ? 0 : __atomic_load_n(&c->async_err, __ATOMIC_SEQ_CST);
    return c == NULL ? 4 : 0;
}

static ncclResult_t emu_destroy(ncclComm_t c)
{
    if (c == NULL) {
        return 4; /* ncclInvalidArgument */
    }
    dpc_emu_set_stuck(c->dev, 0); /* an abort ends a hung collective's kernels */
    if (--*c->alive == 0) {
        free(c->set);
        free(c->alive);
    }
    free(c);
    __atomic_sub_fetch(&emu_nccl_live, 1, __ATOMIC_RELAXED);
    return 0;
}

static ncclResult_t emu_record(int op, const void *send, void *recv, size_t count, int type,
                               int root, ncclComm_t comm)
{
    if (emu_depth == 0 || emu_calls == NULL || comm == NULL) {
        return 5; /* ncclInvalidUsage: dpmini always groups */
    }
    if (emu_ncalls >= NCCL_GROUP_OPS) {
        return 5; /* NCCL's limit on operations in a group */
    }
    emu_call *c = &emu_calls[emu_ncalls++];
    c->op = op;
    c->send = send;
    c->recv = recv;
    c->count = count;
    c->type = type;
    c->root = root;
    c->comm = comm;
    return 0;
}

static ncclResult_t emu_bcast(const void *send, void *recv, size_t count, int type, int root,
                              ncclComm_t comm, void *stream)
{
    (void)stream;
    return emu_record(EMU_BCAST, send, recv, count, type, root, comm);
}

static ncclResult_t emu_reduce(const void *send, void *recv, size_t count, int type, int op,
                               int root, ncclComm_t comm, void *stream)
{
    (void)stream;
    if (op != NCCL_SUM) {
        return 4;
    }
    return emu_record(EMU_REDUCE, send, recv, count, type, root, comm);
}

static ncclResult_t emu_group_start(void)
{
    if (emu_depth == 0) {
        emu_ncalls = 0;
        emu_calls = calloc(NCCL_GROUP_OPS, sizeof *emu_calls);
        if (emu_calls == NULL) {
            return 1;
        }
    }
    emu_depth++;
    return 0;
}

static int dpc_of_nccl(int nt, size_t *size)
{
    switch (nt) {
    case NCCL_INT8: *size = 1; return DPC_T_I8;
    case NCCL_UINT8: *size = 1; return DPC_T_U8;
    case NCCL_INT32: *size = 4; return DPC_T_I32;
    case NCCL_UINT32: *size = 4; return DPC_T_U32;
    case NCCL_INT64: *size = 8; return DPC_T_I64;
    case NCCL_UINT64: *size = 8; return DPC_T_U64;
    case NCCL_FLOAT32: *size = 4; return DPC_T_F32;
    case NCCL_FLOAT64: *size = 8; return DPC_T_F64;
    case NCCL_FLOAT16: *size = 2; return DPC_T_F16;
    default: return -1;
    }
}

/* One collective: col[r] is rank r's call (checked alike by the caller). */
static ncclResult_t emu_run_one(emu_call **col, int n)
{
    emu_call *c0 = col[0];
    size_t isz = 1;
    int t = c0->op == EMU_BCAST ? DPC_T_U8 : dpc_of_nccl(c0->type, &isz);
    emu_call *rc = col[c0->root];
    int rdev = rc->comm->dev;
    size_t bytes = c0->count * isz;
    dpc_stream s;
    if (t < 0 || dpc_stream_get(rdev, 0, &s).code != 0) {
        return 1;
    }
    if (c0->op == EMU_BCAST) {
        for (int i = 0; i < n; i++) {
            emu_call *c = col[i];
            if (c != rc &&
                dpc_memcpy_peer_async(c->recv, c->comm->dev, rc->send, rdev, bytes, s).code) {
                return 1;
            }
        }
        if (rc->recv != rc->send &&
            dpc_memcpy_async(rdev, rc->recv, rc->send, bytes, DPC_D2D, s).code) {
            return 1;
        }
        return 0;
    }
    /* reduce: recv = sum of every rank's send, through a temporary on root */
    void *tmp = NULL;
    if (dpc_memcpy_async(rdev, rc->recv, rc->send, bytes, DPC_D2D, s).code ||
        dpc_malloc(rdev, bytes, &tmp).code) {
        return 1;
    }
    ncclResult_t r = 0;
    for (int i = 0; i < n && r == 0; i++) {
        emu_call *c = col[i];
        if (c == rc) {
            continue;
        }
        if (dpc_memcpy_peer_async(tmp, rdev, c->send, c->comm->dev, bytes, s).code ||
            dpc_launch_add(rdev, t, rc->recv, tmp, (int64_t)c0->count, s).code) {
            r = 1;
        }
    }
    (void)dpc_free(rdev, tmp);
    return r;
}

/* The calls of a group, as NCCL matches them: one communicator set; the
 * k-th call of every rank forms collective k, which must agree on op,
 * root, count and type. */
static ncclResult_t emu_run(void)
{
    int n = emu_ncalls;
    if (n == 0) {
        return 0;
    }
    int nranks = emu_calls[0].comm->nranks, k_of[DP_MAX_DEVICES] = {0};
    if (n % nranks != 0) {
        return 5;
    }
    int m = n / nranks;
    emu_call **order = calloc((size_t)n, sizeof *order);
    if (order == NULL) {
        return 1;
    }
    ncclResult_t r = 0;
    for (int i = 0; i < n && r == 0; i++) {
        emu_call *c = &emu_calls[i];
        int rank = c->comm->rank, k = k_of[rank]++;
        if (c->comm->set != emu_calls[0].comm->set || k >= m) {
            r = 5;
        } else {
            order[k * nranks + rank] = c;
        }
    }
    for (int k = 0; k < m && r == 0; k++) {
        emu_call **col = &order[k * nranks];
        for (int i = 0; i < nranks && r == 0; i++) {
            if (col[i]->op != col[0]->op || col[i]->root != col[0]->root ||
                col[i]->count != col[0]->count || col[i]->type != col[0]->type ||
                col[0]->root < 0 || col[0]->root >= nranks ||
                (col[0]->op == EMU_BCAST && col[0]->type != NCCL_UINT8)) {
                r = 5;
            }
        }
        if (r == 0) {
            r = emu_run_one(col, nranks);
        }
    }
    free(order);
    return r;
}

static ncclResult_t emu_group_end(void)
{
    if (emu_depth == 0) {
        return 5;
    }
    if (--emu_depth > 0) {
        return 0;
    }
    int fail = __atomic_exchange_n(&emu_nccl_fail_next, 0, __ATOMIC_SEQ_CST);
    int n = emu_ncalls;
    pthread_mutex_lock(&emu_busy_mu);
    for (int i = 0; i < n; i++) {
        int d = emu_calls[i].comm->dev;
        if (emu_busy_n[d] > 0 && emu_busy_set[d] != emu_calls[i].comm->set) {
            emu_nccl_crossed++;
        }
        emu_busy_n[d]++;
        emu_busy_set[d] = emu_calls[i].comm->set;
    }
    pthread_mutex_unlock(&emu_busy_mu);
    dpc_emu_launching(1);   /* device calls of other threads now are counted */
    struct timespec hold = {0, 200000}; /* 0.2 ms: a collective takes time */
    nanosleep(&hold, NULL);
    ncclResult_t r = fail ? fail : emu_run();
    dpc_emu_launching(0);
    int hang = __atomic_exchange_n(&emu_nccl_hang_next, 0, __ATOMIC_SEQ_CST);
    for (int i = 0; r == 0 && hang && i < n; i++) { /* a peer died: never finishes */
        __atomic_store_n(&emu_calls[i].comm->async_err, hang == 1 ? 6 : 0, __ATOMIC_SEQ_CST);
        dpc_emu_set_stuck(emu_calls[i].comm->dev, 1);
    }
    pthread_mutex_lock(&emu_busy_mu);
    for (int i = 0; i < n; i++) {
        emu_busy_n[emu_calls[i].comm->dev]--;
    }
    pthread_mutex_unlock(&emu_busy_mu);
    emu_ncalls = 0;
    free(emu_calls);
    emu_calls = NULL;
    return r;
}

static const char *emu_error_string(ncclResult_t r)
{
    switch (r) {
    case 1: return "unhandled cuda error (emulated NCCL)";
    case 3: return "internal error (emulated NCCL)";
    case 4: return "invalid argument (emulated NCCL)";
    case 5: return "invalid usage (emulated NCCL)";
    case 6: return "remote process exited or there was a network error (emulated NCCL)";
    default: return "unknown result (emulated NCCL)";
    }
}

int dp_nccl_emu_install(dp_nccl_lib *nccl, char *nccl_desc, size_t desc_size)
{
    nccl->GetVersion = emu_version;
    nccl->CommInitAll = emu_init_all;
    nccl->CommDestroy = emu_destroy;
    nccl->CommAbort = emu_destroy;
    nccl->Broadcast = emu_bcast;
    nccl->Reduce = emu_reduce;
    nccl->GroupStart = emu_group_start;
    nccl->GroupEnd = emu_group_end;
    nccl->GetErrorString = emu_error_string;
    nccl->CommGetAsyncError = emu_async_error;
    snprintf(nccl_desc, desc_size, "2.21.5 (emulated)");
    return 1;
}

void dp_nccl_emu_fail_next(int fail_next)
{
    __atomic_store_n(&emu_nccl_fail_next, fail_next, __ATOMIC_SEQ_CST);
}

int dp_nccl_live_comms(void)
{
    return __atomic_load_n(&emu_nccl_live, __ATOMIC_RELAXED);
}

void dp_nccl_emulate_hang(int mode)
{
    __atomic_store_n(&emu_nccl_hang_next, mode, __ATOMIC_SEQ_CST);
}

long dp_nccl_crossed(void)
{
    pthread_mutex_lock(&emu_busy_mu);
    long c = emu_nccl_crossed;
    pthread_mutex_unlock(&emu_busy_mu);
    return c;
}
#else
void dp_nccl_emulate_hang(int mode)
{
    (void)mode;
}

long dp_nccl_crossed(void)
{
    return -1;
}

int dp_nccl_live_comms(void)
{
    return -1;
}
#endif
