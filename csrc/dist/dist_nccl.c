/* dist_nccl.c - the real NCCL and CUDA runtime for dpmini._dist, loaded with
 * dlopen on the first GPU collective (never at import), or the emulation
 * (dist_nccl_emu.c) when dpmini.distributed chose it.
 *
 * NCCL is dpmini._dpmini's table (csrc/backend/nccl_lib.c, bound once for
 * the process and lent through its C API capsule, core/capi.h), and the
 * CUDA runtime is found by the same search (csrc/backend/lib_search.c), so
 * both extensions use the same libraries: libnccl.so.2 in
 * $DPMINI_NCCL_LIBRARY (a full
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
/* What dpmini._dpmini lends (capi.h)                                  */
/* ------------------------------------------------------------------ */

static const dp_capi *capi;   /* set once, under the GIL */

/* The C API capsule of dpmini._dpmini; NULL with an exception set. */
static const dp_capi *dpmini_capi(void)
{
    if (capi != NULL)
        return capi;
    const dp_capi *c = PyCapsule_Import(DP_CAPI_NAME, 0);
    if (c != NULL && c->version != DP_CAPI_VERSION) {
        PyErr_Format(PyExc_ImportError, "dpmini._dist: dpmini._dpmini's C API is version %u, "
                     "this build needs %d: rebuild dpmini", c->version, DP_CAPI_VERSION);
        c = NULL;
    }
    capi = c;
    return capi;
}

void dist_launch_begin(void)
{
    if (capi != NULL)
        capi->launch_begin();
}

void dist_launch_end(void)
{
    if (capi != NULL)
        capi->launch_end();
}

/* The CUDA runtime's symbols of the table from its handle; 0, or -1 naming
 * the missing one in `why`. */
static int bind_cudart(void *cudart, char *why, size_t n)
{
    static const struct {
        const char *name;
        size_t offset;
    } syms[] = {
#define S(field, name) {name, offsetof(dist_nccl_api, field)}
        S(SetDevice, "cudaSetDevice"), S(GetDevice, "cudaGetDevice"),
        S(StreamQuery, "cudaStreamQuery"), S(StreamSynchronize, "cudaStreamSynchronize"),
        S(CudaErrorString, "cudaGetErrorString"), S(Memcpy2DAsync, "cudaMemcpy2DAsync"),
        S(DeviceGetAttribute, "cudaDeviceGetAttribute"),
        S(DeviceGetPCIBusId, "cudaDeviceGetPCIBusId"),
#undef S
    };
    for (size_t i = 0; i < sizeof syms / sizeof syms[0]; i++) {
        void *p = dlsym(cudart, syms[i].name);
        if (p == NULL) {
            snprintf(why, n, "libcudart lacks %s", syms[i].name);
            return -1;
        }
        memcpy((char *)&real_api + syms[i].offset, &p, sizeof p);
    }
    return 0;
}

/* The NCCL functions of the table from dpmini._dpmini's. */
static void take_nccl(const dp_nccl_lib *lib)
{
    real_api.GetUniqueId = lib->GetUniqueId;
    real_api.CommInitRank = lib->CommInitRank;
    real_api.AllReduce = lib->AllReduce;
    real_api.Broadcast = lib->Broadcast;
    real_api.Reduce = lib->Reduce;
    real_api.Send = lib->Send;
    real_api.Recv = lib->Recv;
    real_api.GroupStart = lib->GroupStart;
    real_api.GroupEnd = lib->GroupEnd;
    real_api.CommGetAsyncError = lib->CommGetAsyncError;
    real_api.CommAbort = lib->CommAbort;
    real_api.CommDestroy = lib->CommDestroy;
    real_api.GetErrorString = lib->GetErrorString;
}

static const dist_nccl_api *load_real(void)
{
    static const char *const cudart_names[] = {"libcudart.so.13", "libcudart.so.12",
                                               "libcudart.so.11.0", "libcudart.so", NULL};
    dp_lib_search cs = {"DPMINI_CUDART_LIBRARY", "nvidia/cuda_runtime/lib", cudart_names, 1, ""};
    char cudart_at[200] = "", why[300] = "";
    void *cudart = capi->find_library(&cs, cudart_at, sizeof cudart_at);
    if (cudart == NULL) {
        PyErr_Format(PyExc_RuntimeError, "dpmini.distributed: GPU arrays need the CUDA runtime "
                     "(libcudart), which was not found ($DPMINI_CUDART_LIBRARY, the "
                     "nvidia-cuda-runtime wheel, $CUDA_HOME/lib64, /usr/local/cuda/lib64, the "
                     "loader's path): %.300s", cs.tried);
        return NULL;
    }
    const dp_nccl_lib *lib = capi->nccl(why, sizeof why);
    if (lib == NULL) {
        dlclose(cudart);
        PyErr_Format(PyExc_RuntimeError, "dpmini.distributed: GPU arrays need NCCL "
                     "(libnccl.so.2), which was not found or not usable ($DPMINI_NCCL_LIBRARY, "
                     "the nvidia-nccl wheel, $CUDA_HOME/lib64, /usr/local/cuda/lib64, the "
                     "loader's path): %.300s; install it (pip install nvidia-nccl-cu12) or pass "
                     "host arrays", why);
        return NULL;
    }
    if (bind_cudart(cudart, why, sizeof why) < 0) {
        dlclose(cudart);
        PyErr_Format(PyExc_RuntimeError, "dpmini.distributed: %s", why);
        return NULL;
    }
    take_nccl(lib);
    snprintf(real_api.desc, sizeof real_api.desc, "NCCL %.200s; CUDA runtime (%.160s)",
             lib->desc, cudart_at);
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
    if (dpmini_capi() == NULL)
        return NULL;
    in_use = emulate ? dist_nccl_emu_table() : load_real();
    return in_use;
}
