// runtime.cu - cuda_api.h on the real CUDA runtime: devices, memory,
// dpmini's stream pool, copies, and the two kernel families (strided copy
// for pack/unpack, elementwise add for reduce_add). Compiled by nvcc when
// setup.py finds it; the runtime is linked statically (cudart_static), so
// `import dpmini` works with no driver: cudaGetDeviceCount fails and
// dpc_device_count() returns 0.
//
// Every runtime call goes through CUDA_TRY, which returns a dpc_status with
// the call's text, file, line, device and cudaGetErrorString's message, and
// clears the failing thread's last error (per thread in CUDA) there.
// Kernels first, then launchers that take an explicit stream and check the
// launch (cudaGetLastError), as llm.c does.
//
// The device guard: every entry that needs a device current opens
// ON_DEVICE(dev), which saves the thread's current device, switches only when
// it differs and switches back when the function returns (any return path:
// a C++ destructor). Only dpc_set_device changes the current device for good.
#include <cuda_runtime.h>
#include <cuda_fp16.h>
#include <dlfcn.h>
#include <limits.h>
#include <pthread.h>
#include <stdlib.h>

#include "cuda_api.h" /* csrc/backend/ (-I in setup.py) */
#include "strided.h"

#define CUDA_TRY(call, dev)                                                          \
    do {                                                                             \
        cudaError_t e_ = (call);                                                     \
        if (e_ != cudaSuccess) {                                                     \
            (void)cudaGetLastError(); /* clear a non-sticky error (this thread) */   \
            return dpc_fail(DPC_LIB_CUDA, (int)e_, e_ == cudaErrorMemoryAllocation,  \
                            (dev), #call, __FILE__, __LINE__, cudaGetErrorString(e_)); \
        }                                                                            \
    } while (0)

// ---------------------------------------------------------------- device guard

// cuCtxGetCurrent / cuCtxSetCurrent through the runtime's driver entry
// points (no link against libcuda, so import still works without a driver).
// The guard saves the thread's CUDA context before switching and restores
// exactly that context afterwards, NULL included: a thread that had no
// context (a fresh thread: cudaGetDevice says 0 but nothing is bound) is left
// with none, so later code of another library (torch.ones(device='cuda'),
// CuPy) still lands on the device it would have used, and no context is
// created on a GPU dpmini never used. NULL entry points (very old driver):
// the guard switches back with cudaSetDevice.
typedef int (*dp_cuCtxGetCurrent_t)(void **);
typedef int (*dp_cuCtxSetCurrent_t)(void *);
typedef int (*dp_cuDevicePrimaryCtxGetState_t)(int, unsigned *, int *);
static dp_cuCtxGetCurrent_t g_cuCtxGetCurrent;
static dp_cuCtxSetCurrent_t g_cuCtxSetCurrent;
static dp_cuDevicePrimaryCtxGetState_t g_cuPrimaryCtxGetState;
static pthread_once_t g_entry_once = PTHREAD_ONCE_INIT;

static void load_entry_points(void)
{
    void *a = NULL, *b = NULL, *c = NULL;
    cudaDriverEntryPointQueryResult qa, qb, qc;
    if (cudaGetDriverEntryPointByVersion("cuCtxGetCurrent", &a, 12000, cudaEnableDefault, &qa) ==
            cudaSuccess && qa == cudaDriverEntryPointSuccess &&
        cudaGetDriverEntryPointByVersion("cuCtxSetCurrent", &b, 12000, cudaEnableDefault,
                                         &qb) == cudaSuccess &&
        qb == cudaDriverEntryPointSuccess) {
        g_cuCtxGetCurrent = (dp_cuCtxGetCurrent_t)a;
        g_cuCtxSetCurrent = (dp_cuCtxSetCurrent_t)b;
    }
    if (cudaGetDriverEntryPointByVersion("cuDevicePrimaryCtxGetState", &c, 12000,
                                         cudaEnableDefault, &qc) == cudaSuccess &&
        qc == cudaDriverEntryPointSuccess)
        g_cuPrimaryCtxGetState = (dp_cuDevicePrimaryCtxGetState_t)c;
    (void)cudaGetLastError();
}

// dpmini has made or bound a context (or initialised the driver to count
// devices): a forked child cannot use CUDA (gpu_fork.c). g_ctx_dev: the
// first device dpmini made current, where calls that name no device run.
static int g_initialised;
static int g_ctx_dev = -1;

static void note_context(int dev)
{
    __atomic_store_n(&g_initialised, 1, __ATOMIC_RELAXED);
    int none = -1;
    __atomic_compare_exchange_n(&g_ctx_dev, &none, dev, 0, __ATOMIC_RELAXED, __ATOMIC_RELAXED);
}

// Make dev current; remember what to restore (device and context).
static cudaError_t guard_enter(int dev, dpc_device_guard *g)
{
    g->prev = -1;
    g->switched = 0;
    g->ctx = NULL;
    if (dev < 0)
        return cudaSuccess;
    pthread_once(&g_entry_once, load_entry_points);
    note_context(dev);
    cudaError_t err = cudaGetDevice(&g->prev);
    if (err != cudaSuccess || g->prev == dev)
        return err;
    if (g_cuCtxGetCurrent != NULL && g_cuCtxGetCurrent(&g->ctx) != 0)
        g->ctx = NULL;
    err = cudaSetDevice(dev);
    g->switched = err == cudaSuccess;
    return err;
}

static void guard_leave(dpc_device_guard *g)
{
    if (!g->switched)
        return;
    g->switched = 0;
    if (g_cuCtxSetCurrent != NULL) {
        if (g_cuCtxSetCurrent(g->ctx) == 0)
            return;
    }
    if (cudaSetDevice(g->prev) != cudaSuccess)
        (void)cudaGetLastError();
}

struct DevGuard {
    dpc_device_guard g;
    cudaError_t err;
    explicit DevGuard(int dev) { err = guard_enter(dev, &g); }
    ~DevGuard() { guard_leave(&g); }
};

#define ON_DEVICE(dev)                                                               \
    DevGuard dev_guard_(dev);                                                        \
    CUDA_TRY(dev_guard_.err, dev)

// The device for a call that needs a context but names no device (dev -1):
// -1 (no switch) when the thread has a context bound; else the first device
// dpmini used; else a device whose primary context another library made
// active; else -1, the current device (nothing better exists).
static int pick_device(int dev)
{
    if (dev >= 0)
        return dev;
    pthread_once(&g_entry_once, load_entry_points);
    void *ctx = NULL;
    if (g_cuCtxGetCurrent != NULL && g_cuCtxGetCurrent(&ctx) == 0 && ctx != NULL)
        return -1;
    int first = __atomic_load_n(&g_ctx_dev, __ATOMIC_RELAXED);
    if (first >= 0)
        return first;
    int n = 0;
    if (g_cuPrimaryCtxGetState != NULL && cudaGetDeviceCount(&n) == cudaSuccess) {
        for (int d = 0; d < n; d++) {
            unsigned flags = 0;
            int active = 0;
            if (g_cuPrimaryCtxGetState(d, &flags, &active) == 0 && active)
                return d;
        }
    }
    (void)cudaGetLastError();
    return -1;
}

// ---------------------------------------------------------------- kernels

// One thread per element, grid-stride. The index arithmetic is
// dp_strided_copy_one from strided.h (the emulator runs the same).
__global__ void dp_strided_copy_kernel(dpc_kdesc d, char *dst, const char *src)
{
    int64_t stride = (int64_t)gridDim.x * blockDim.x;
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < d.numel; i += stride)
        dp_strided_copy_one(&d, dst, src, i);
}

template <typename T>
__global__ void dp_add_kernel(T *acc, const T *x, int64_t n)
{
    int64_t stride = (int64_t)gridDim.x * blockDim.x;
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride)
        acc[i] = (T)(acc[i] + x[i]);
}

// ---------------------------------------------------------------- devices

static int g_count = -1;
static int g_count_err; // the CUDA error of the count query, kept for reports

// Counting devices through the runtime initialises the driver (cuInit), and
// a child forked after that cannot use CUDA even if the parent never made a
// context. So the count comes from NVML when it can (gpu_nvml.c: not when a
// GPU is in MIG mode): only when CUDA_VISIBLE_DEVICES is unset (its
// ordinal, UUID and MIG rules are the runtime's) and the driver's CUDA major
// version is not older than the runtime's (else the runtime's query reports
// the error).
extern "C" int dpc_device_count(void)
{
    if (g_count < 0) {
        int n = -1, rt = 0, drv = 0;
        if (cudaRuntimeGetVersion(&rt) != cudaSuccess || cudaDriverGetVersion(&drv) != cudaSuccess)
            rt = drv = 0;
        (void)cudaGetLastError();
        const char *vis = getenv("CUDA_VISIBLE_DEVICES");
        if (vis == NULL && drv > 0 && drv / 1000 >= rt / 1000)
            n = dpc_nvml_device_count("libnvidia-ml.so.1");
        if (n < 0) {
            n = 0;
            cudaError_t e = cudaGetDeviceCount(&n); // cuInit
            if (e != cudaSuccess) {
                (void)cudaGetLastError();
                n = 0;
                g_count_err = (int)e;
            } else if (n > 0) {
                __atomic_store_n(&g_initialised, 1, __ATOMIC_RELAXED);
            }
        }
        g_count = n;
    }
    return g_count;
}

extern "C" int dpc_initialised(void) { return __atomic_load_n(&g_initialised, __ATOMIC_RELAXED); }

extern "C" int dpc_device_error(const char **msg)
{
    (void)dpc_device_count();
    *msg = g_count_err ? cudaGetErrorString((cudaError_t)g_count_err) : "no error";
    return g_count_err;
}

extern "C" const char *dpc_backend(void) { return "cuda"; }

extern "C" void dpc_versions(int *runtime, int *driver)
{
    *runtime = 0;
    *driver = 0;
    if (cudaRuntimeGetVersion(runtime) != cudaSuccess)
        *runtime = 0;
    if (cudaDriverGetVersion(driver) != cudaSuccess)
        *driver = 0;
    (void)cudaGetLastError();
}

extern "C" dpc_status dpc_set_device(int dev)
{
    int cur = -1;
    if (cudaGetDevice(&cur) == cudaSuccess && cur == dev)
        return dpc_ok();
    (void)cudaGetLastError();
    note_context(dev);
    CUDA_TRY(cudaSetDevice(dev), dev);
    return dpc_ok();
}

extern "C" dpc_status dpc_guard_enter(int dev, dpc_device_guard *g)
{
    cudaError_t e = guard_enter(dev, g);
    if (e != cudaSuccess) {
        (void)cudaGetLastError();
        g->switched = 0;
        return dpc_fail(DPC_LIB_CUDA, (int)e, 0, dev, "cudaSetDevice(dev)", __FILE__, __LINE__,
                        cudaGetErrorString(e));
    }
    return dpc_ok();
}

extern "C" void dpc_guard_leave(dpc_device_guard *g) { guard_leave(g); }

extern "C" int dpc_current_device(void)
{
    int cur = -1;
    if (cudaGetDevice(&cur) != cudaSuccess) {
        (void)cudaGetLastError();
        return -1;
    }
    return cur;
}

#define DPC_MAX_DEV 64

extern "C" size_t dpc_max_pitch(int dev)
{
    static int cache[DPC_MAX_DEV]; // 0: not asked yet (benign race: same value)
    if (dev < 0 || dev >= DPC_MAX_DEV)
        return (size_t)INT_MAX;
    if (cache[dev] == 0) {
        int v = 0;
        if (cudaDeviceGetAttribute(&v, cudaDevAttrMaxPitch, dev) != cudaSuccess || v <= 0) {
            (void)cudaGetLastError();
            v = INT_MAX;
        }
        cache[dev] = v;
    }
    return (size_t)cache[dev];
}

extern "C" dpc_status dpc_device_sync(int dev)
{
    ON_DEVICE(dev);
    CUDA_TRY(cudaDeviceSynchronize(), dev);
    return dpc_ok();
}

extern "C" dpc_status dpc_enable_peer(int dev, int peer, int *on)
{
    int can = 0;
    *on = 0;
    if (dev == peer)
        return dpc_ok();
    CUDA_TRY(cudaDeviceCanAccessPeer(&can, dev, peer), dev);
    if (!can)
        return dpc_ok();
    ON_DEVICE(dev);
    cudaError_t e = cudaDeviceEnablePeerAccess(peer, 0);
    if (e == cudaErrorPeerAccessAlreadyEnabled) {
        (void)cudaGetLastError();
    } else {
        CUDA_TRY(e, dev);
    }
    *on = 1;
    return dpc_ok();
}

// ---------------------------------------------------------------- memory

extern "C" dpc_status dpc_malloc(int dev, size_t nbytes, void **out)
{
    ON_DEVICE(dev);
    CUDA_TRY(cudaMalloc(out, nbytes ? nbytes : 1), dev);
    return dpc_ok();
}

extern "C" dpc_status dpc_free(int dev, void *p)
{
    ON_DEVICE(dev);
    CUDA_TRY(cudaFree(p), dev);
    return dpc_ok();
}

extern "C" dpc_status dpc_host_alloc(int dev, size_t nbytes, void **out)
{
    int on = pick_device(dev);
    ON_DEVICE(on); // not device 0's context on a fresh thread
    __atomic_store_n(&g_initialised, 1, __ATOMIC_RELAXED);
    CUDA_TRY(cudaHostAlloc(out, nbytes ? nbytes : 1, cudaHostAllocPortable), on);
    return dpc_ok();
}

extern "C" dpc_status dpc_host_free(int dev, void *p)
{
    int on = pick_device(dev);
    ON_DEVICE(on);
    CUDA_TRY(cudaFreeHost(p), on);
    return dpc_ok();
}

extern "C" int dpc_is_pinned(int dev, const void *p)
{
    cudaPointerAttributes a;
    DevGuard g(dev); // not device 0's context on a fresh thread
    if (g.err != cudaSuccess || cudaPointerGetAttributes(&a, p) != cudaSuccess) {
        (void)cudaGetLastError();
        return 0;
    }
    return a.type == cudaMemoryTypeHost;
}

extern "C" int dpc_is_device_ptr(const void *p, int *dev)
{
    cudaPointerAttributes a;
    DevGuard g(pick_device(-1)); // unified addressing: any context answers
    __atomic_store_n(&g_initialised, 1, __ATOMIC_RELAXED);
    if (g.err != cudaSuccess || cudaPointerGetAttributes(&a, p) != cudaSuccess) {
        (void)cudaGetLastError();
        return 0;
    }
    if (a.type != cudaMemoryTypeDevice && a.type != cudaMemoryTypeManaged)
        return 0;
    if (dev)
        *dev = a.device;
    return 1;
}

// ---------------------------------------------------------------- streams

#define DPC_MAX_SLOTS 16

static cudaStream_t g_streams[DPC_MAX_DEV][DPC_MAX_SLOTS]; // created lazily, never freed
static pthread_mutex_t g_stream_mu = PTHREAD_MUTEX_INITIALIZER;

extern "C" dpc_status dpc_stream_get(int dev, int slot, dpc_stream *out)
{
    if (dev < 0 || dev >= DPC_MAX_DEV)
        return dpc_fail(DPC_LIB_CUDA, (int)cudaErrorInvalidDevice, 0, dev, "dpc_stream_get",
                        __FILE__, __LINE__, "device index out of range");
    slot %= DPC_MAX_SLOTS;
    pthread_mutex_lock(&g_stream_mu);
    cudaStream_t s = g_streams[dev][slot];
    cudaError_t e = cudaSuccess;
    if (s == NULL) {
        DevGuard g(dev);
        e = g.err;
        if (e == cudaSuccess)
            e = cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking);
        if (e == cudaSuccess)
            g_streams[dev][slot] = s;
    }
    pthread_mutex_unlock(&g_stream_mu);
    CUDA_TRY(e, dev);
    *out = (dpc_stream)s;
    return dpc_ok();
}

extern "C" dpc_status dpc_stream_sync(int dev, dpc_stream s)
{
    // On dev: the legacy / per-thread default stream handles (1, 2) mean
    // the current device's, and a fresh thread must not touch device 0.
    ON_DEVICE(dev);
    CUDA_TRY(cudaStreamSynchronize((cudaStream_t)s), dev);
    return dpc_ok();
}

extern "C" dpc_status dpc_stream_query(int dev, dpc_stream s, int *done)
{
    *done = 0;
    ON_DEVICE(dev);
    cudaError_t e = cudaStreamQuery((cudaStream_t)s);
    if (e == cudaErrorNotReady) {
        (void)cudaGetLastError(); // "not yet" is not an error
        return dpc_ok();
    }
    CUDA_TRY(e, dev);
    *done = 1;
    return dpc_ok();
}

// ---------------------------------------------------------------- copies

static cudaMemcpyKind kind_of(int kind)
{
    return kind == DPC_H2D ? cudaMemcpyHostToDevice
         : kind == DPC_D2H ? cudaMemcpyDeviceToHost : cudaMemcpyDeviceToDevice;
}

extern "C" dpc_status dpc_memcpy_async(int dev, void *dst, const void *src, size_t nbytes,
                                       int kind, dpc_stream s)
{
    if (nbytes == 0)
        return dpc_ok();
    ON_DEVICE(dev);
    CUDA_TRY(cudaMemcpyAsync(dst, src, nbytes, kind_of(kind), (cudaStream_t)s), dev);
    return dpc_ok();
}

extern "C" dpc_status dpc_memcpy2d_async(int dev, void *dst, size_t dpitch, const void *src,
                                         size_t spitch, size_t width, size_t height, int kind,
                                         dpc_stream s)
{
    if (width == 0 || height == 0)
        return dpc_ok();
    ON_DEVICE(dev);
    CUDA_TRY(cudaMemcpy2DAsync(dst, dpitch, src, spitch, width, height, kind_of(kind),
                               (cudaStream_t)s), dev);
    return dpc_ok();
}

extern "C" dpc_status dpc_memcpy_peer_async(void *dst, int dst_dev, const void *src,
                                            int src_dev, size_t nbytes, dpc_stream s)
{
    if (nbytes == 0)
        return dpc_ok();
    ON_DEVICE(dst_dev);
    CUDA_TRY(cudaMemcpyPeerAsync(dst, dst_dev, src, src_dev, nbytes, (cudaStream_t)s), dst_dev);
    return dpc_ok();
}

// ---------------------------------------------------------------- launchers

static unsigned grid_for(int64_t n, int threads)
{
    int64_t blocks = (n + threads - 1) / threads;
    return (unsigned)(blocks > 65535 * 8 ? 65535 * 8 : (blocks < 1 ? 1 : blocks));
}

extern "C" dpc_status dpc_launch_strided_copy(int dev, const dpc_kdesc *d, void *dst,
                                              const void *src, dpc_stream s)
{
    if (d->numel == 0)
        return dpc_ok();
    ON_DEVICE(dev);
    dp_strided_copy_kernel<<<grid_for(d->numel, 256), 256, 0, (cudaStream_t)s>>>(
        *d, (char *)dst, (const char *)src);
    CUDA_TRY(cudaGetLastError(), dev);
    return dpc_ok();
}

// float16: add in float, round once to half (to nearest even), as NumPy.
__global__ void dp_add_half_kernel(__half *acc, const __half *x, int64_t n)
{
    int64_t stride = (int64_t)gridDim.x * blockDim.x;
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride)
        acc[i] = __float2half_rn(__half2float(acc[i]) + __half2float(x[i]));
}

static cudaError_t add_half(void *acc, const void *x, int64_t n, cudaStream_t s)
{
    dp_add_half_kernel<<<grid_for(n, 256), 256, 0, s>>>((__half *)acc, (const __half *)x, n);
    return cudaGetLastError();
}

template <typename T>
static cudaError_t add_as(void *acc, const void *x, int64_t n, cudaStream_t s)
{
    dp_add_kernel<T><<<grid_for(n, 256), 256, 0, s>>>((T *)acc, (const T *)x, n);
    return cudaGetLastError();
}

extern "C" dpc_status dpc_launch_add(int dev, int type, void *acc, const void *x,
                                     int64_t numel, dpc_stream s)
{
    if (numel == 0)
        return dpc_ok();
    ON_DEVICE(dev);
    cudaStream_t st = (cudaStream_t)s;
    cudaError_t e = cudaErrorInvalidValue;
    switch (type) {
    case DPC_T_I8: e = add_as<int8_t>(acc, x, numel, st); break;
    case DPC_T_U8: e = add_as<uint8_t>(acc, x, numel, st); break;
    case DPC_T_I16: e = add_as<int16_t>(acc, x, numel, st); break;
    case DPC_T_U16: e = add_as<uint16_t>(acc, x, numel, st); break;
    case DPC_T_I32: e = add_as<int32_t>(acc, x, numel, st); break;
    case DPC_T_U32: e = add_as<uint32_t>(acc, x, numel, st); break;
    case DPC_T_I64: e = add_as<int64_t>(acc, x, numel, st); break;
    case DPC_T_U64: e = add_as<uint64_t>(acc, x, numel, st); break;
    case DPC_T_F32: e = add_as<float>(acc, x, numel, st); break;
    case DPC_T_F64: e = add_as<double>(acc, x, numel, st); break;
    case DPC_T_F16: e = add_half(acc, x, numel, st); break;
    default: break;
    }
    CUDA_TRY(e, dev);
    return dpc_ok();
}
