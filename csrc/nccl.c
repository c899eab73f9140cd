/* nccl.c - NCCL, loaded with dlopen on first use (never at import), for
 * comm.broadcast / broadcast_coalesced / reduce_add on distinct GPUs.
 *
 * Search order for libnccl.so.2: $DPMINI_NCCL_LIBRARY (a full path), the
 * nvidia-nccl wheel's folder (site-packages/nvidia/nccl/lib, found on
 * sys.path), $CUDA_HOME/lib64, /usr/local/cuda/lib64, then the default
 * loader path. Not loaded: callers use the copy-and-kernel fallback.
 * Under emulation (and in CPU-only builds) NCCL is never loaded.
 *
 * The NCCL declarations below are the few we call, written from NCCL's
 * public ABI (nccl.h), so the build does not need NCCL's headers.
 * Communicators (ncclCommInitAll over a device list) are cached per device
 * list for the life of the process, like PyTorch's.
 */
#include "dpmini.h"
#include "gpu.h"

#include <dlfcn.h>
#include <stdlib.h>
#include <unistd.h>
#include <string.h>

typedef struct dp_ncclComm *ncclComm_t;
typedef int ncclResult_t;                      /* 0 = ncclSuccess */
enum { NCCL_INT8 = 0, NCCL_UINT8 = 1, NCCL_INT32 = 2, NCCL_UINT32 = 3, NCCL_INT64 = 4,
       NCCL_UINT64 = 5, NCCL_FLOAT32 = 7, NCCL_FLOAT64 = 8, NCCL_SUM = 0 };

static struct {
    ncclResult_t (*GetVersion)(int *);
    ncclResult_t (*CommInitAll)(ncclComm_t *, int, const int *);
    ncclResult_t (*Broadcast)(const void *, void *, size_t, int, int, ncclComm_t, void *);
    ncclResult_t (*Reduce)(const void *, void *, size_t, int, int, int, ncclComm_t, void *);
    ncclResult_t (*GroupStart)(void);
    ncclResult_t (*GroupEnd)(void);
    const char *(*GetErrorString)(ncclResult_t);
} nccl;

static pthread_mutex_t nccl_mu = PTHREAD_MUTEX_INITIALIZER;
static int nccl_state;            /* 0 not tried, 1 loaded, -1 absent  */
static char nccl_desc[256] = "not loaded";

#define NCCL_MAX_COMMS 8
static struct {
    int n;
    int devs[DP_MAX_DEVICES];
    ncclComm_t *comms;
} comm_cache[NCCL_MAX_COMMS];     /* guarded by nccl_mu */

static int try_open(const char *path)
{
    void *h = dlopen(path, RTLD_NOW | RTLD_LOCAL);
    if (h == NULL) {
        snprintf(nccl_desc, sizeof nccl_desc, "not found: %s", dlerror());
        return 0;
    }
#define SYM(field, name)                                                        \
    *(void **)&nccl.field = dlsym(h, name);                                     \
    if (nccl.field == NULL) {                                                   \
        snprintf(nccl_desc, sizeof nccl_desc, "%s lacks %s", path, name);       \
        dlclose(h);                                                             \
        return 0;                                                               \
    }
    SYM(GetVersion, "ncclGetVersion");
    SYM(CommInitAll, "ncclCommInitAll");
    SYM(Broadcast, "ncclBroadcast");
    SYM(Reduce, "ncclReduce");
    SYM(GroupStart, "ncclGroupStart");
    SYM(GroupEnd, "ncclGroupEnd");
    SYM(GetErrorString, "ncclGetErrorString");
#undef SYM
    int v = 0;
    nccl.GetVersion(&v);
    /* NCCL >= 2.9 encodes MAJOR*10000 + MINOR*100 + PATCH */
    snprintf(nccl_desc, sizeof nccl_desc, "%d.%d.%d (%s)", v / 10000, (v / 100) % 100,
             v % 100, path);
    return 1;
}

/* With the GIL held (reads sys.path once). */
static void nccl_load(void)
{
    char path[4096];
    const char *env = getenv("DPMINI_NCCL_LIBRARY");
    if (strcmp(dpc_backend(), "cuda") != 0 || dpc_device_count() == 0) {
        snprintf(nccl_desc, sizeof nccl_desc, "not loaded (%s backend)", dpc_backend());
        nccl_state = -1;
        return;
    }
    if (env && *env && try_open(env)) {
        nccl_state = 1;
        return;
    }
    PyObject *sys_path = PySys_GetObject("path"); /* borrowed */
    for (Py_ssize_t i = 0; sys_path && PyList_Check(sys_path) && i < PyList_GET_SIZE(sys_path);
         i++) {
        PyObject *p = PyList_GET_ITEM(sys_path, i);
        const char *s = PyUnicode_Check(p) ? PyUnicode_AsUTF8(p) : NULL;
        if (s == NULL) {
            PyErr_Clear();
            continue;
        }
        snprintf(path, sizeof path, "%s/nvidia/nccl/lib/libnccl.so.2", s);
        if (access(path, R_OK) == 0 && try_open(path)) {
            nccl_state = 1;
            return;
        }
    }
    const char *home = getenv("CUDA_HOME");
    if (home && *home) {
        snprintf(path, sizeof path, "%s/lib64/libnccl.so.2", home);
        if (access(path, R_OK) == 0 && try_open(path)) {
            nccl_state = 1;
            return;
        }
    }
    if ((access("/usr/local/cuda/lib64/libnccl.so.2", R_OK) == 0 &&
         try_open("/usr/local/cuda/lib64/libnccl.so.2")) ||
        try_open("libnccl.so.2")) {
        nccl_state = 1;
        return;
    }
    nccl_state = -1;
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

#define NCCL_TRY(call, dev)                                                     \
    do {                                                                        \
        ncclResult_t r_ = (call);                                               \
        if (r_ != 0)                                                            \
            return dpc_fail(DPC_LIB_NCCL, r_, 0, (dev), #call, __FILE__, __LINE__, \
                            nccl.GetErrorString(r_));                           \
    } while (0)

static dpc_status get_comms(int n, const int *devs, ncclComm_t **out)
{
    int free_slot = -1;
    pthread_mutex_lock(&nccl_mu);
    for (int i = 0; i < NCCL_MAX_COMMS; i++) {
        if (comm_cache[i].comms && comm_cache[i].n == n &&
            memcmp(comm_cache[i].devs, devs, (size_t)n * sizeof(int)) == 0) {
            *out = comm_cache[i].comms;
            pthread_mutex_unlock(&nccl_mu);
            return dpc_ok();
        }
        if (!comm_cache[i].comms && free_slot < 0) {
            free_slot = i;
        }
    }
    pthread_mutex_unlock(&nccl_mu);
    ncclComm_t *comms = calloc((size_t)n, sizeof(ncclComm_t));
    if (comms == NULL) {
        return dpc_fail(DPC_LIB_DPMINI, 1, 1, -1, "calloc", __FILE__, __LINE__,
                        "out of host memory");
    }
    ncclResult_t r = nccl.CommInitAll(comms, n, devs);
    if (r != 0) {
        free(comms);
        return dpc_fail(DPC_LIB_NCCL, r, 0, devs[0], "ncclCommInitAll(comms, n, devs)",
                        __FILE__, __LINE__, nccl.GetErrorString(r));
    }
    pthread_mutex_lock(&nccl_mu);
    if (free_slot >= 0 && !comm_cache[free_slot].comms) {
        comm_cache[free_slot].n = n;
        memcpy(comm_cache[free_slot].devs, devs, (size_t)n * sizeof(int));
        comm_cache[free_slot].comms = comms;
    } /* else: a cache miss every time past 8 device lists (leaks nothing: kept) */
    pthread_mutex_unlock(&nccl_mu);
    *out = comms;
    return dpc_ok();
}

static dpc_status sync_all(int n, const int *devs)
{
    for (int i = 0; i < n; i++) {
        dpc_stream s;
        DPC_TRY(dpc_stream_get(devs[i], 0, &s));
        DPC_TRY(dpc_stream_sync(devs[i], s));
    }
    return dpc_ok();
}

dpc_status dp_nccl_broadcast(int n, const int *devs, void *const *bufs, size_t nbytes, int root)
{
    ncclComm_t *comms;
    DPC_TRY(get_comms(n, devs, &comms));
    NCCL_TRY(nccl.GroupStart(), devs[root]);
    for (int i = 0; i < n; i++) {
        dpc_stream s;
        dpc_status st = dpc_stream_get(devs[i], 0, &s);
        if (st.code != 0) {
            nccl.GroupEnd();
            return st;
        }
        ncclResult_t r = nccl.Broadcast(bufs[root], bufs[i], nbytes, NCCL_UINT8, root,
                                        comms[i], s);
        if (r != 0) {
            nccl.GroupEnd();
            return dpc_fail(DPC_LIB_NCCL, r, 0, devs[i], "ncclBroadcast", __FILE__, __LINE__,
                            nccl.GetErrorString(r));
        }
    }
    NCCL_TRY(nccl.GroupEnd(), devs[root]);
    return sync_all(n, devs);
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
    default: return -1;
    }
}

dpc_status dp_nccl_reduce(int n, const int *devs, const void *const *send, void *recv,
                          int64_t numel, int type, int root)
{
    ncclComm_t *comms;
    int nt = nccl_type(type);
    if (nt < 0) {
        return dpc_fail(DPC_LIB_DPMINI, 1, 0, devs[root], "ncclReduce", __FILE__, __LINE__,
                        "dtype not supported by NCCL");
    }
    DPC_TRY(get_comms(n, devs, &comms));
    NCCL_TRY(nccl.GroupStart(), devs[root]);
    for (int i = 0; i < n; i++) {
        dpc_stream s;
        dpc_status st = dpc_stream_get(devs[i], 0, &s);
        if (st.code != 0) {
            nccl.GroupEnd();
            return st;
        }
        ncclResult_t r = nccl.Reduce(send[i], i == root ? recv : NULL, (size_t)numel, nt,
                                     NCCL_SUM, root, comms[i], s);
        if (r != 0) {
            nccl.GroupEnd();
            return dpc_fail(DPC_LIB_NCCL, r, 0, devs[i], "ncclReduce", __FILE__, __LINE__,
                            nccl.GetErrorString(r));
        }
    }
    NCCL_TRY(nccl.GroupEnd(), devs[root]);
    return sync_all(n, devs);
}
