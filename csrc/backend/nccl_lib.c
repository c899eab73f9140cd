/* nccl_lib.c - libnccl.so.2, loaded with dlopen on first use (never at
 * import) and bound once for the whole process: nccl.c's collectives and,
 * through the C API capsule (core/capi.h), dpmini._dist's. The search is
 * lib_search.c's: $DPMINI_NCCL_LIBRARY, the nvidia-nccl wheel, $CUDA_HOME,
 * /usr/local/cuda, the loader's path. */
#include "gpu.h"

#include <dlfcn.h>
#include <pthread.h>
#include <stddef.h>
#include <stdio.h>
#include <string.h>

static dp_nccl_lib lib;
static int lib_state;            /* 0 not tried, 1 bound, -1 failed */
static char lib_why[300];
static pthread_mutex_t lib_mu = PTHREAD_MUTEX_INITIALIZER;

/* Every symbol of the table from h; 0 naming the missing one in lib_why. */
static int bind(void *h, const char *path)
{
    static const struct {
        const char *name;
        size_t offset;
    } syms[] = {
#define S(field, name) {name, offsetof(dp_nccl_lib, field)}
        S(GetVersion, "ncclGetVersion"), S(GetErrorString, "ncclGetErrorString"),
        S(GetUniqueId, "ncclGetUniqueId"), S(CommInitAll, "ncclCommInitAll"),
        S(CommInitRank, "ncclCommInitRank"), S(CommDestroy, "ncclCommDestroy"),
        S(CommAbort, "ncclCommAbort"), S(CommGetAsyncError, "ncclCommGetAsyncError"),
        S(AllReduce, "ncclAllReduce"), S(Broadcast, "ncclBroadcast"), S(Reduce, "ncclReduce"),
        S(Send, "ncclSend"), S(Recv, "ncclRecv"), S(GroupStart, "ncclGroupStart"),
        S(GroupEnd, "ncclGroupEnd"),
#undef S
    };
    for (size_t i = 0; i < sizeof syms / sizeof syms[0]; i++) {
        void *p = dlsym(h, syms[i].name);
        if (p == NULL) {
            snprintf(lib_why, sizeof lib_why, "%.200s lacks %s (NCCL >= 2.7 is needed)", path,
                     syms[i].name);
            return 0;
        }
        memcpy((char *)&lib + syms[i].offset, &p, sizeof p);
    }
    int v = 0;
    lib.GetVersion(&v);
    /* NCCL >= 2.9 encodes MAJOR*10000 + MINOR*100 + PATCH */
    snprintf(lib.desc, sizeof lib.desc, "%d.%d.%d (%.200s)", v / 10000, (v / 100) % 100, v % 100,
             path);
    return 1;
}

static void load(void)
{
    static const char *const names[] = {"libnccl.so.2", "libnccl.so", NULL};
    dp_lib_search search = {"DPMINI_NCCL_LIBRARY", "nvidia/nccl/lib", names, 0, ""};
    char path[200] = "";
    void *h = dp_find_library(&search, path, sizeof path);
    if (h == NULL) {
        snprintf(lib_why, sizeof lib_why, "not found: %.280s", search.tried);
        lib_state = -1;
        return;
    }
    lib_state = bind(h, path) ? 1 : -1;
    if (lib_state < 0)
        dlclose(h);
}

const dp_nccl_lib *dp_nccl_lib_load(char *why, size_t why_len)
{
    pthread_mutex_lock(&lib_mu);
    if (lib_state == 0)
        load();
    int ok = lib_state == 1;
    if (!ok && why != NULL && why_len > 0)
        snprintf(why, why_len, "%s", lib_why);
    pthread_mutex_unlock(&lib_mu);
    return ok ? &lib : NULL;
}
