/* dist_nccl.c - the real NCCL and CUDA runtime for dpmini._dist, loaded with
 * dlopen on the first GPU collective (never at import), or the emulation
 * (dist_nccl_emu.c) when dpmini.distributed chose it.
 *
 * libnccl.so.2 is looked for in dpmini's order (the same as the
 * single-process NCCL of csrc/backend/nccl.c): $DPMINI_NCCL_LIBRARY (a full
 * path), the nvidia-nccl wheel (<sys.path entry>/nvidia/nccl/lib),
 * $CUDA_HOME/lib64, /usr/local/cuda/lib64, then the loader's default path.
 * The CUDA runtime likewise ($DPMINI_CUDART_LIBRARY, the nvidia-cuda-runtime
 * wheel, $CUDA_HOME/lib64, /usr/local/cuda/lib64, the default path), except
 * that a runtime already loaded in the process (PyTorch's, CuPy's) is used
 * first (RTLD_NOLOAD), so that dpmini and the array library share one
 * current device.
 *
 * The table is process-wide, like the library it describes: it is filled
 * once under the GIL and never changes afterwards.
 */
#include "dist.h"
#include "dist_nccl.h"

#include <dlfcn.h>
#include <string.h>
#include <unistd.h>

static dist_nccl_api real_api;
static const dist_nccl_api *in_use;       /* set once, under the GIL */
static int want_emulated = -1;          /* -1: ask dpmini.distributed */

int dist_nccl_set_emulated(int on)
{
    if (in_use != NULL && (in_use->emulated != 0) != (on != 0)) {
        PyErr_Format(PyExc_RuntimeError, "dpmini.distributed: the %s NCCL is already in use "
                     "in this process", in_use->emulated ? "emulated" : "real");
        return -1;
    }
    want_emulated = on != 0;
    return 0;
}

const char *dist_nccl_describe(void)
{
    return in_use != NULL ? in_use->desc : "not loaded";
}

/* ------------------------------------------------------------------ */
/* Finding a library                                                   */
/* ------------------------------------------------------------------ */

typedef struct {
    const char *env;         /* a full path from the environment          */
    const char *wheel;       /* a folder under site-packages              */
    const char *const *names;/* sonames, most wanted first                */
    int share;               /* try RTLD_NOLOAD on the sonames first      */
    char tried[512];         /* what was looked at, for the error message */
} lib_search;

static void note(lib_search *s, const char *what)
{
    size_t len = strlen(s->tried);
    if (len < sizeof s->tried - 1)
        snprintf(s->tried + len, sizeof s->tried - len, "%s%s", len ? ", " : "", what);
}

/* dst = src, cut to n - 1 bytes. */
static void keep(char *dst, size_t n, const char *src)
{
    size_t len = strlen(src);
    if (len >= n)
        len = n - 1;
    memcpy(dst, src, len);
    dst[len] = '\0';
}

static void *open_path(lib_search *s, const char *path, int check_file)
{
    if (check_file && access(path, R_OK) != 0)
        return NULL;
    void *h = dlopen(path, RTLD_NOW | RTLD_LOCAL);
    if (h == NULL)
        note(s, dlerror());
    return h;
}

/* With the GIL held (sys.path). The handle, or NULL (s->tried says why). */
static void *find_library(lib_search *s, char *found, size_t found_len)
{
    char path[4096];
    void *h = NULL;
    s->tried[0] = '\0';
    for (int i = 0; s->share && s->names[i] != NULL && h == NULL; i++) {
        h = dlopen(s->names[i], RTLD_NOW | RTLD_LOCAL | RTLD_NOLOAD);
        if (h != NULL)
            snprintf(found, found_len, "%s, already loaded", s->names[i]);
    }
    const char *env = getenv(s->env);
    if (h == NULL && env != NULL && *env) {
        h = open_path(s, env, 0);
        if (h != NULL)
            keep(found, found_len, env);
    }
    PyObject *sys_path = PySys_GetObject("path");   /* borrowed */
    Py_ssize_t n = sys_path != NULL && PyList_Check(sys_path) ? PyList_GET_SIZE(sys_path) : 0;
    for (Py_ssize_t i = 0; i < n && h == NULL; i++) {
        const char *dir = PyUnicode_Check(PyList_GET_ITEM(sys_path, i))
                          ? PyUnicode_AsUTF8(PyList_GET_ITEM(sys_path, i)) : NULL;
        if (dir == NULL) {
            PyErr_Clear();
            continue;
        }
        for (int k = 0; s->names[k] != NULL && h == NULL; k++) {
            snprintf(path, sizeof path, "%s/%s/%s", dir, s->wheel, s->names[k]);
            if ((h = open_path(s, path, 1)) != NULL)
                keep(found, found_len, path);
        }
    }
    const char *dirs[2] = {getenv("CUDA_HOME"), "/usr/local/cuda"};
    for (int d = 0; d < 2 && h == NULL; d++) {
        if (dirs[d] == NULL || !*dirs[d])
            continue;
        for (int k = 0; s->names[k] != NULL && h == NULL; k++) {
            snprintf(path, sizeof path, "%s/lib64/%s", dirs[d], s->names[k]);
            if ((h = open_path(s, path, 1)) != NULL)
                keep(found, found_len, path);
        }
    }
    for (int k = 0; s->names[k] != NULL && h == NULL; k++) {
        if ((h = open_path(s, s->names[k], 0)) != NULL)
            keep(found, found_len, s->names[k]);
    }
    return h;
}

/* Every symbol of the table from the two handles; 0, or -1 naming the
 * missing one in `why`. */
static int bind(void *nccl, void *cudart, char *why, size_t n)
{
    static const struct {
        int from_nccl;
        const char *name;
        size_t offset;
    } syms[] = {
#define S(lib, field, name) {lib, name, offsetof(dist_nccl_api, field)}
        S(1, GetUniqueId, "ncclGetUniqueId"), S(1, CommInitRank, "ncclCommInitRank"),
        S(1, AllReduce, "ncclAllReduce"), S(1, Broadcast, "ncclBroadcast"),
        S(1, Reduce, "ncclReduce"), S(1, Send, "ncclSend"), S(1, Recv, "ncclRecv"),
        S(1, GroupStart, "ncclGroupStart"), S(1, GroupEnd, "ncclGroupEnd"),
        S(1, CommGetAsyncError, "ncclCommGetAsyncError"), S(1, CommAbort, "ncclCommAbort"),
        S(1, CommDestroy, "ncclCommDestroy"), S(1, GetErrorString, "ncclGetErrorString"),
        S(0, SetDevice, "cudaSetDevice"), S(0, GetDevice, "cudaGetDevice"),
        S(0, StreamQuery, "cudaStreamQuery"), S(0, StreamSynchronize, "cudaStreamSynchronize"),
        S(0, CudaErrorString, "cudaGetErrorString"), S(0, Memcpy2DAsync, "cudaMemcpy2DAsync"),
        S(0, DeviceGetAttribute, "cudaDeviceGetAttribute"),
        S(0, DeviceGetPCIBusId, "cudaDeviceGetPCIBusId"),
#undef S
    };
    for (size_t i = 0; i < sizeof syms / sizeof syms[0]; i++) {
        void *p = dlsym(syms[i].from_nccl ? nccl : cudart, syms[i].name);
        if (p == NULL) {
            snprintf(why, n, "%s lacks %s (NCCL >= 2.7 and a CUDA runtime are needed)",
                     syms[i].from_nccl ? "libnccl" : "libcudart", syms[i].name);
            return -1;
        }
        memcpy((char *)&real_api + syms[i].offset, &p, sizeof p);
    }
    return 0;
}

static const dist_nccl_api *load_real(void)
{
    static const char *const nccl_names[] = {"libnccl.so.2", "libnccl.so", NULL};
    static const char *const cudart_names[] = {"libcudart.so.13", "libcudart.so.12",
                                               "libcudart.so.11.0", "libcudart.so", NULL};
    lib_search ns = {"DPMINI_NCCL_LIBRARY", "nvidia/nccl/lib", nccl_names, 0, ""};
    lib_search cs = {"DPMINI_CUDART_LIBRARY", "nvidia/cuda_runtime/lib", cudart_names, 1, ""};
    char nccl_at[200] = "", cudart_at[200] = "", why[200] = "";
    void *cudart = find_library(&cs, cudart_at, sizeof cudart_at);
    if (cudart == NULL) {
        PyErr_Format(PyExc_RuntimeError, "dpmini.distributed: GPU arrays need the CUDA runtime "
                     "(libcudart), which was not found ($DPMINI_CUDART_LIBRARY, the "
                     "nvidia-cuda-runtime wheel, $CUDA_HOME/lib64, /usr/local/cuda/lib64, the "
                     "loader's path): %.300s", cs.tried);
        return NULL;
    }
    void *nccl = find_library(&ns, nccl_at, sizeof nccl_at);
    if (nccl == NULL) {
        dlclose(cudart);
        PyErr_Format(PyExc_RuntimeError, "dpmini.distributed: GPU arrays need NCCL "
                     "(libnccl.so.2), which was not found ($DPMINI_NCCL_LIBRARY, the "
                     "nvidia-nccl wheel, $CUDA_HOME/lib64, /usr/local/cuda/lib64, the loader's "
                     "path): %.300s; install it (pip install nvidia-nccl-cu12) or pass host "
                     "arrays", ns.tried);
        return NULL;
    }
    if (bind(nccl, cudart, why, sizeof why) < 0) {
        dlclose(nccl);
        dlclose(cudart);
        PyErr_Format(PyExc_RuntimeError, "dpmini.distributed: %s", why);
        return NULL;
    }
    int v = 0;
    int (*version)(int *) = (int (*)(int *))dlsym(nccl, "ncclGetVersion");
    if (version != NULL)
        version(&v);
    /* NCCL >= 2.9 encodes MAJOR*10000 + MINOR*100 + PATCH */
    snprintf(real_api.desc, sizeof real_api.desc, "NCCL %d.%d.%d (%.160s); CUDA runtime (%.160s)",
             v / 10000, (v / 100) % 100, v % 100, nccl_at, cudart_at);
    real_api.emulated = 0;
    return &real_api;
}

const dist_nccl_api *dist_nccl_get(void)
{
    if (in_use != NULL)
        return in_use;
    int emulate = want_emulated;
    if (emulate < 0) {   /* dpmini's emulated build, or $DPMINI_DIST_NCCL=emulate */
        PyObject *mod = PyImport_ImportModule("dpmini.distributed");
        PyObject *r = mod ? PyObject_CallMethod(mod, "_nccl_wants_emulation", NULL) : NULL;
        emulate = r != NULL ? PyObject_IsTrue(r) : -1;
        Py_XDECREF(mod);
        Py_XDECREF(r);
        if (emulate < 0)
            return NULL;
    }
    in_use = emulate ? dist_nccl_emu_table() : load_real();
    return in_use;
}
