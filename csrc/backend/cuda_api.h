/* cuda_api.h - the only door from dpmini's C code to a CUDA runtime.
 *
 * No Python.h. Three implementations, chosen at build time (setup.py):
 *   cuda/runtime.cu      the real one: CUDA runtime + kernels (nvcc found);
 *                        defines DPMINI_HAVE_CUDA for the C files too;
 *   csrc/cuda_emulate.c  DPMINI_CUDA_EMULATE=1: host memory, synchronous,
 *                        $DPMINI_EMULATE_GPUS fake devices (default 2), so
 *                        every GPU code path of dpmini runs in CI;
 *   csrc/cuda_stub.c     neither: no device, every call fails cleanly.
 *
 * Conventions
 *   - Every call returns a dpc_status by value; code 0 is success. A failed
 *     status records the library, its code, the failing call's text, file,
 *     line and device, so exactly one function (dp_gpu_raise, in
 *     py/gpu_error.c) can turn it into dpmini.CudaError / NcclError /
 *     MemoryError.
 *   - Device pointers are `void *` that the HOST MUST NEVER DEREFERENCE
 *     (under emulation they are tagged addresses that fault if touched).
 *     Host pointers are ordinary memory, pinned or pageable.
 *   - Sizes are bytes (size_t) unless named `numel` (elements).
 *   - `dev` is the CUDA device index a call works on. Every call that needs
 *     it current saves the calling thread's current device, switches only
 *     when it differs, and switches back before returning, so dpmini never
 *     changes the caller's current device (PyTorch's device guard). Only
 *     dpc_set_device changes it for good (replica worker threads). The real
 *     backend saves and restores the thread's CUDA context itself (NULL
 *     included): a fresh thread that had no context is left with none, so no
 *     context is created on a GPU dpmini never used and later code of another
 *     library still lands on the device it would have used.
 *   - Streams are dpmini's own non-blocking streams, cached per (device,
 *     slot); they are never destroyed (like PyTorch's pool of streams). They
 *     are NOT ordered after the legacy default stream, so work another library
 *     queued there is waited for explicitly on import (array.c).
 *   - Nothing here takes the GIL or touches Python objects.
 */
#ifndef DPMINI_CUDA_API_H
#define DPMINI_CUDA_API_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

enum { DPC_LIB_NONE = 0, DPC_LIB_CUDA = 1, DPC_LIB_NCCL = 2, DPC_LIB_DPMINI = 3 };
/* DPC_LIB_DPMINI code of a wait that a signal handler interrupted: the
 * handler's exception (KeyboardInterrupt) is already set, and dp_gpu_raise
 * keeps it. */
#define DPC_DPMINI_INTERRUPTED 90

typedef struct {
    int code;          /* 0: success; else the library's own status code      */
    int lib;           /* DPC_LIB_*: whose code it is                           */
    int oom;           /* 1 when the failure is an out-of-memory                */
    int device;        /* device the call was made on; -1 for the host          */
    int line;          /* source line of the failing call                      */
    const char *call;  /* text of the failing call (static string)             */
    const char *file;  /* source file of the failing call (static string)      */
    const char *msg;   /* the library's message (static string), never NULL    */
} dpc_status;

static inline dpc_status dpc_ok(void)
{
    dpc_status s = {0, DPC_LIB_NONE, 0, -1, 0, "", "", "no error"};
    return s;
}

static inline dpc_status dpc_fail(int lib, int code, int oom, int dev, const char *call,
                                  const char *file, int line, const char *msg)
{
    dpc_status s = {code, lib, oom, dev, line, call, file, msg ? msg : "unknown error"};
    return s;
}

/* Propagate a failed status out of a function that returns dpc_status. */
#define DPC_TRY(expr)                                                           \
    do {                                                                        \
        dpc_status dpc_s_ = (expr);                                             \
        if (dpc_s_.code != 0)                                                   \
            return dpc_s_;                                                      \
    } while (0)

/* The goto twin: keep the first failure in `st`, jump to cleanup. */
#define DPC_TRY_GOTO(st, expr, label)                                           \
    do {                                                                        \
        (st) = (expr);                                                          \
        if ((st).code != 0)                                                     \
            goto label;                                                         \
    } while (0)

/* Copy directions (the memcpy kinds of the runtime). */
enum { DPC_H2D = 1, DPC_D2H = 2, DPC_D2D = 3 };

typedef void *dpc_stream;

/* Element types of the reduce kernel (dpc_launch_add). */
enum {
    DPC_T_I8, DPC_T_U8, DPC_T_I16, DPC_T_U16, DPC_T_I32, DPC_T_U32, DPC_T_I64, DPC_T_U64,
    DPC_T_F32, DPC_T_F64, DPC_T_F16, DPC_T_NONE
};
/* DPC_T_F16 adds in float and rounds once to half (to nearest even), as
 * NumPy's float16 add does, so results match the host bit for bit. */

/* Most dims a kernel descriptor carries (after dim collapsing). */
#define DPC_KMAXDIMS 16

/* A strided element copy for the device kernels and the emulator: for every
 * element index i (C order over shape), dst[dst_off(i)] = src[src_off(i)].
 * Strides in bytes, any sign; itemsize bytes per element. See cuda/strided.h
 * for the index arithmetic, shared by the kernels and the emulator. */
typedef struct {
    int ndim;                            /* 1..DPC_KMAXDIMS                  */
    int itemsize;                        /* bytes, >= 1                      */
    int64_t numel;                       /* product of shape, > 0            */
    int64_t shape[DPC_KMAXDIMS];         /* elements                         */
    int64_t src_strides[DPC_KMAXDIMS];   /* bytes                            */
    int64_t dst_strides[DPC_KMAXDIMS];   /* bytes                            */
} dpc_kdesc;

/* ---- devices ---- */
/* Number of devices; 0 when there is no driver, no GPU, or no CUDA build.
 * Never fails; cached after the first call. */
int dpc_device_count(void);
/* gpu_nvml.c: the GPUs NVML (`library`, "libnvidia-ml.so.1") counts, when
 * none is in MIG mode; -1 when NVML is missing or unusable, or a GPU is in
 * MIG mode (the runtime then counts its MIG instances). Initialises no CUDA. */
int dpc_nvml_device_count(const char *library);
/* The CUDA error code the device count query failed with (0: none), and
 * the runtime's message for it (never NULL). A driver older than the
 * runtime gives cudaErrorInsufficientDriver (35) with a driver version > 0;
 * a machine without any driver gives the same code with driver version 0. */
int dpc_device_error(const char **msg);
/* "cuda", "emulated" or "none". */
const char *dpc_backend(void);
/* Versions: runtime and driver as CUDA encodes them (12040 = 12.4); 0 when
 * unknown. */
void dpc_versions(int *runtime, int *driver);
dpc_status dpc_set_device(int dev);
/* Enable peer access from dev to peer when the hardware allows; *on is 1
 * when dev can read and write peer's memory directly afterwards. */
dpc_status dpc_enable_peer(int dev, int peer, int *on);
/* A device guard that the caller holds across its own code (e.g. a call into
 * another library that works on "the current device", such as PyTorch's
 * Tensor.__dlpack__): enter makes dev current, leave restores exactly what
 * the thread had before (the real backend restores the thread's CUDA context,
 * none included, so a thread that had no context is left without one).
 * leave is a no-op when enter failed or did not switch. */
typedef struct {
    int prev;       /* device current before enter (-1 unknown)           */
    int switched;   /* 1 when enter changed the device                     */
    void *ctx;      /* real backend: the thread's CUcontext before (NULL ok) */
} dpc_device_guard;
dpc_status dpc_guard_enter(int dev, dpc_device_guard *g);
void dpc_guard_leave(dpc_device_guard *g);
/* The calling thread's current device (cudaGetDevice; -1 on failure). For
 * tests of the device guard (_dpmini._cuda_debug). */
int dpc_current_device(void);
/* Largest row pitch (bytes) cudaMemcpy2D accepts on dev
 * (cudaDevAttrMaxPitch, at most INT_MAX); cached. */
size_t dpc_max_pitch(int dev);
/* Wait for all work on dev, every stream (cudaDeviceSynchronize). */
dpc_status dpc_device_sync(int dev);

/* Sticky errors: after one of these CUDA codes the CUDA context of the
 * process is corrupted and every later call fails; only a restart helps
 * (CUDA 13 driver_types.h: "the process must be terminated and relaunched").
 * Any other code is recoverable: CUDA_TRY clears the failing thread's last
 * error (cudaGetLastError is per thread, so it is done there, not later on
 * the Python thread). */
static inline int dpc_cuda_error_is_sticky(int code)
{
    switch (code) {
    case 226: /* cudaErrorContained */
    case 700: /* cudaErrorIllegalAddress */
    case 702: /* cudaErrorLaunchTimeout */
    case 710: /* cudaErrorAssert */
    case 714: /* cudaErrorHardwareStackError */
    case 715: /* cudaErrorIllegalInstruction */
    case 716: /* cudaErrorMisalignedAddress */
    case 717: /* cudaErrorInvalidAddressSpace */
    case 718: /* cudaErrorInvalidPc */
    case 719: /* cudaErrorLaunchFailure */
    case 721: /* cudaErrorTensorMemoryLeak */
    case 810: /* cudaErrorMpsClientTerminated */
    case 911: /* cudaErrorExternalDevice */
        return 1;
    default:
        return 0;
    }
}

/* 1 once dpmini initialised CUDA in this process (made or bound a context,
 * or initialised the driver to count devices): a child forked after that
 * cannot use CUDA (gpu_fork.c). */
int dpc_initialised(void);

/* ---- memory ---- */
dpc_status dpc_malloc(int dev, size_t nbytes, void **out);
dpc_status dpc_free(int dev, void *p);
/* Page-locked host memory (cudaHostAlloc, portable to every device), made
 * with dev's context current (the device of the copy it stages for), so a
 * thread without a context does not create one on device 0. dev -1 (no
 * device in question, e.g. pin_memory=True): the thread's own context if it
 * has one, else a device dpmini already uses, else the current device. */
dpc_status dpc_host_alloc(int dev, size_t nbytes, void **out);
dpc_status dpc_host_free(int dev, void *p);
/* 1 when p is page-locked host memory the runtime knows, else 0. Asked on
 * dev (the device the copy runs on), so a fresh thread does not create a
 * context on device 0 for the question. */
int dpc_is_pinned(int dev, const void *p);
/* 1 when p is device memory; *dev receives its device. Asked like
 * dpc_host_alloc with dev -1: in the thread's context, else on a device
 * dpmini already uses (unified addressing answers for every device). */
int dpc_is_device_ptr(const void *p, int *dev);

/* ---- streams ---- */
dpc_status dpc_stream_get(int dev, int slot, dpc_stream *out);
/* Wait on the host for s on dev. s may also be another library's stream
 * handle, or DPC_STREAM_LEGACY / DPC_STREAM_PER_THREAD (the values CUDA and
 * the CUDA Array Interface give them): the default streams of dev. */
dpc_status dpc_stream_sync(int dev, dpc_stream s);
/* Has all work queued on s (on dev) finished? *done 1 yes, 0 not yet
 * (cudaStreamQuery's cudaErrorNotReady); a failed status for an error. */
dpc_status dpc_stream_query(int dev, dpc_stream s, int *done);
#define DPC_STREAM_LEGACY ((dpc_stream)(uintptr_t)1)
#define DPC_STREAM_PER_THREAD ((dpc_stream)(uintptr_t)2)

/* ---- copies (asynchronous on s; sources must stay valid until s is synced) ---- */
dpc_status dpc_memcpy_async(int dev, void *dst, const void *src, size_t nbytes, int kind,
                            dpc_stream s);
/* height rows of width bytes; pitches in bytes (>= width). */
dpc_status dpc_memcpy2d_async(int dev, void *dst, size_t dpitch, const void *src,
                              size_t spitch, size_t width, size_t height, int kind,
                              dpc_stream s);
/* Between devices: direct over NVLink/PCIe when peer access is on, staged by
 * the runtime through the host otherwise. Queued on s of dst_dev. */
dpc_status dpc_memcpy_peer_async(void *dst, int dst_dev, const void *src, int src_dev,
                                 size_t nbytes, dpc_stream s);

/* ---- kernels (both pointers on dev, or peer-accessible from it) ---- */
/* The strided copy: pack (strided -> dense), unpack (dense -> strided), or
 * any strided -> strided copy on one device. */
dpc_status dpc_launch_strided_copy(int dev, const dpc_kdesc *d, void *dst, const void *src,
                                   dpc_stream s);
/* acc[i] += x[i] for numel elements of type DPC_T_*. */
dpc_status dpc_launch_add(int dev, int type, void *acc, const void *x, int64_t numel,
                          dpc_stream s);

#ifdef DPMINI_CUDA_EMULATE
/* Emulator only: the next copy or kernel fails with CUDA code `code`. */
void dpc_emu_inject_fault(int code);
/* Emulator only: the next dpc_stream_get of this slot fails (its *out is then
 * a poisoned handle: any later use of it is counted, see dpc_emu_stats). */
void dpc_emu_fail_stream_get(int slot);
/* Emulator only: device memory of a kind peer access does not cover (VMM /
 * cudaMallocAsync pools / IPC): a kernel on another device that touches it
 * fails with cudaErrorIllegalAddress (700), as on hardware. Free with
 * dpc_free. */
dpc_status dpc_emu_malloc_nopeer(int dev, size_t nbytes, void **out);
/* Emulator only: 0 makes dpc_enable_peer report no peer access. */
void dpc_emu_set_peer(int on);
/* Emulator only: 1 when queued work not yet synchronised (stream sync of its
 * stream, device sync, cudaFree) touches [p, p + n); dpmini's allocator asks
 * before a block goes back to its cache (gpu.c). */
int dpc_emu_busy(const void *p, size_t n);
/* Emulator only: uses of poisoned stream handles; blocks returned to a cache
 * while queued work still touched them. */
void dpc_emu_stats(long *bad_handles, long *freed_busy);
void dpc_emu_note_freed_busy(void);
/* Emulator only: on (1), work on dev's streams never finishes (a hung
 * collective): stream syncs block, queries say "not ready", until off. */
void dpc_emu_set_stuck(int dev, int on);
/* Emulator only: hook called at every stream or device sync (tests count
 * syncs made with the GIL held). */
void dpc_emu_set_sync_hook(void (*hook)(void));
/* Emulator only: the devices whose context exists (a thread starts with no
 * context; a call through the device guard creates its device's, a call that
 * needs one without a device creates the current device's, as on hardware);
 * writes at most max, returns how many. */
int dpc_emu_contexts(int *devs, int max);
/* Emulator only: another library's kernel queued on stream s of dev touching
 * device memory [p, p + n), pending until s or dev is synchronised. */
void dpc_emu_queue(int dev, dpc_stream s, const void *p, size_t n);
/* Emulator only: another library destroyed its stream s (CuPy does at
 * garbage collection): work queued on it still finishes at a device sync,
 * and any later use of the handle is counted as a bad handle (undefined
 * behaviour on hardware). */
void dpc_emu_destroy_stream(dpc_stream s);
/* Emulator only: the calling thread launches an NCCL group (on: 1) or is
 * done (0). A cudaMalloc, cudaFree or device sync on another thread
 * meanwhile is counted (dpc_emu_launch_overlaps): on hardware such a call
 * can wait for a launched NCCL kernel while that kernel's peers wait to be
 * launched, for ever. */
void dpc_emu_launching(int on);
long dpc_emu_launch_overlaps(void);
#endif

#ifdef __cplusplus
}
#endif
#endif
