/* cuda_emulate.c - a CPU emulation of cuda_api.h, built only with
 * DPMINI_CUDA_EMULATE=1, so that every GPU code path of dpmini (device
 * arrays, staging, 2D copies, pack/unpack kernels, peer copies, the reduce
 * kernel, errors and out-of-memory) runs in CI on a machine without a GPU.
 *
 * What it keeps from a GPU:
 *   - $DPMINI_EMULATE_GPUS devices (1..64, default 2), each with a memory
 *     limit of $DPMINI_EMULATE_MEM bytes (default 4 GiB) -> out-of-memory.
 *   - Device memory is NOT host memory to the host: a device pointer is the
 *     host address with bit 55 set and the device index in bits 48..54, an
 *     address that faults when dereferenced (non-canonical on x86-64, outside
 *     the 48-bit space on AArch64). Any place that hands a device pointer to
 *     NumPy or memcpy crashes the test instead of passing silently.
 *   - Every copy checks its direction and that each device range lies in a
 *     live allocation (use-after-free and overruns fail as
 *     cudaErrorInvalidValue); freed memory is poisoned with 0xDB first.
 *   - Pinned memory is tracked, so "is this pinned" answers as the runtime
 *     would.
 *   - A current device per thread (cudaGetDevice), changed only by
 *     dpc_set_device, as the real backend's device guard promises.
 *   - cudaMemcpy2D's pitch limit: pitches or widths over INT_MAX (the
 *     cudaDevAttrMaxPitch of current GPUs) fail with
 *     cudaErrorInvalidPitchValue, as on a GPU.
 *   - dpc_emu_inject_fault(code): the next copy or kernel fails with that
 *     CUDA code (tests of sticky-error messages; the emulator itself stays
 *     usable afterwards, a real GPU would not).
 *   - Work in flight: every copy or kernel is recorded with the device
 *     ranges it touches until its stream is synchronised (or the device, or
 *     cudaFree, which waits as a device sync does and calls the sync hook);
 *     dpmini's allocator asks dpc_emu_busy before a block goes
 *     back to its cache, so "temporary reused while a copy may still write
 *     it" is counted (dpc_emu_stats). The data itself moves at once.
 *   - Stream handles: a failed dpc_stream_get leaves a poisoned handle; using
 *     it fails (cudaErrorInvalidResourceHandle) and is counted, as is any use
 *     of another library's handle after dpc_emu_destroy_stream (on hardware
 *     a crash, or a wait on whatever stream reused the address).
 *   - Memory kinds: dpc_emu_malloc_nopeer gives blocks that peer access does
 *     not cover (VMM, cudaMallocAsync pools, IPC): a kernel on another device
 *     touching one fails with 700, as on hardware. $DPMINI_EMULATE_PEER=0 (or
 *     dpc_emu_set_peer(0)) reports no peer access at all.
 *   - dpc_guard_enter/leave: the current device is restored only by leave.
 *   - Contexts (cuda_emulate_ctx.c): a thread starts with none bound. A
 *     call through the device guard (any call that names its device)
 *     creates that device's context; a call that needs one and names no
 *     device (page-locked host memory, pointer queries with dev -1) uses the
 *     thread's bound context, else creates and binds the current device's
 *     (device 0 on a fresh thread), as the runtime does; cudaSetDevice
 *     creates and binds. dpc_emu_contexts lists the devices that got one, so
 *     a stray context on GPU 0 shows.
 *   - NCCL launches (dpc_emu_launching, from the emulated ncclGroupEnd): a
 *     cudaMalloc, cudaFree or device sync of another thread during one is
 *     counted (dpc_emu_launch_overlaps), a deadlock on hardware.
 *   - dpc_emu_queue: another library's kernel queued on any stream handle,
 *     pending until that stream (or the device) is synchronised; a query
 *     of that stream says "not ready" meanwhile. Handle 2
 *     (the per-thread default stream) is the calling thread's own stream.
 * What it does not keep: real asynchrony (every call completes before it
 * returns, so a read racing a producer is caught only through the records
 * above), real bandwidth.
 * Kernels run the index arithmetic of cuda/strided.h, element by element.
 *
 * This file: devices, pointers, the records of work in flight, memory and
 * streams; cuda_emulate_copy.c: the copies and kernels over them
 * (cuda_emulate.h: what the two share).
 */
#if defined(DPMINI_CUDA_EMULATE)
#define _POSIX_C_SOURCE 200809L

#include "cuda_api.h"
#include "../cuda/strided.h"
#include "cuda_emulate.h"

#include <limits.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#define EMU_TAG ((uintptr_t)1 << 55)
#define EMU_DEV_SHIFT 48
#define EMU_ADDR_MASK (((uintptr_t)1 << EMU_DEV_SHIFT) - 1)
#define EMU_MAX_DEVICES 64

typedef struct emu_alloc {
    struct emu_alloc *next;
    char *host;       /* the real memory                                  */
    size_t size;      /* bytes                                            */
    int dev;          /* device index, -1 for pinned host memory          */
    int nopeer;       /* 1: peer access does not cover it (VMM/pool/IPC)  */
} emu_alloc;

/* A queued operation's device range, until its stream is synchronised. */
typedef struct emu_pend {
    struct emu_pend *next;
    dpc_stream s;
    int dev;
    int foreign;      /* another library's work (dpc_emu_queue): a query of
                         its stream says "not ready" until a sync */
    const char *lo, *hi;
} emu_pend;

static pthread_mutex_t emu_mu = PTHREAD_MUTEX_INITIALIZER;
static emu_alloc *emu_live;                 /* guarded by emu_mu          */
static size_t emu_used[EMU_MAX_DEVICES];    /* guarded by emu_mu          */
static int emu_count = -1;
static int emu_count_err;                   /* $DPMINI_EMULATE_DRIVER_ERROR */
static size_t emu_limit;
static int emu_fault;                       /* next failing code, 0: none */
static int emu_peer = -1;                   /* peer access: 1 on, 0 off    */
static int emu_fail_slot = -1;              /* next stream_get to fail     */
static emu_pend *emu_pending;               /* guarded by emu_mu          */
static long emu_npending;                   /* guarded by emu_mu          */
static long emu_bad_handles, emu_freed_busy;
static int emu_stuck[EMU_MAX_DEVICES];      /* 1: dev's work never finishes */
static void wait_unstuck(int dev);
static void (*emu_sync_hook)(void);

void dpc_emu_set_sync_hook(void (*hook)(void)) { emu_sync_hook = hook; }

#define EMU_POISON_STREAM ((dpc_stream)(uintptr_t)0xDEAD0000DEADull)

const char *emu_msg(int code)
{
    switch (code) {
    case E_INVALID_VALUE: return "invalid argument";
    case E_OOM: return "out of memory";
    case E_INVALID_PITCH: return "invalid pitch argument";
    case E_INVALID_DEVICE: return "invalid device ordinal";
    case E_INVALID_HANDLE: return "invalid resource handle";
    case 700: return "an illegal memory access was encountered";
    case 719: return "unspecified launch failure";
    default: return "unknown error";
    }
}

int dpc_device_count(void)
{
    if (emu_count < 0) {
        const char *e = getenv("DPMINI_EMULATE_GPUS");
        long n = e && *e ? strtol(e, NULL, 10) : 2;
        const char *m = getenv("DPMINI_EMULATE_MEM");
        emu_limit = m && *m ? (size_t)strtoull(m, NULL, 10) : ((size_t)4 << 30);
        emu_count = n < 0 ? 0 : (n > EMU_MAX_DEVICES ? EMU_MAX_DEVICES : (int)n);
        /* a driver too old for the runtime: no device, the error kept */
        const char *de = getenv("DPMINI_EMULATE_DRIVER_ERROR");
        emu_count_err = de && *de ? (int)strtol(de, NULL, 10) : 0;
        if (emu_count_err)
            emu_count = 0;
    }
    return emu_count;
}

int dpc_device_error(const char **msg)
{
    (void)dpc_device_count();
    *msg = emu_count_err == 35 ? "CUDA driver version is insufficient for CUDA runtime version"
                               : (emu_count_err ? "unknown error" : "no error");
    return emu_count_err;
}

const char *dpc_backend(void) { return "emulated"; }

void dpc_versions(int *runtime, int *driver)
{
    (void)dpc_device_count();
    *runtime = emu_count_err ? 13000 : 0;  /* what a too-old driver would show */
    *driver = emu_count_err ? 12020 : 0;
}

int bad_dev(int dev) { return dev < 0 || dev >= dpc_device_count(); }

dpc_status dpc_enable_peer(int dev, int peer, int *on)
{
    if (bad_dev(dev) || bad_dev(peer))
        return EMU_FAIL(E_INVALID_DEVICE, "cudaDeviceEnablePeerAccess(peer)", dev,
                        emu_msg(E_INVALID_DEVICE));
    if (emu_peer < 0) {
        const char *e = getenv("DPMINI_EMULATE_PEER");
        emu_peer = !(e && strcmp(e, "0") == 0);
    }
    ctx_on(dev);
    *on = dev != peer && emu_peer;
    return dpc_ok();
}

void dpc_emu_set_peer(int on) { emu_peer = on != 0; }


/* ---- work in flight (records only; the data moves at once) ---- */

/* CUDA's per-thread default stream handle (2) names a different stream on
 * every thread: the calling thread's. */
static int emu_next_tid;
static __thread int emu_tid;

static dpc_stream resolve_stream(dpc_stream s)
{
    if (s != DPC_STREAM_PER_THREAD)
        return s;
    if (emu_tid == 0)
        emu_tid = __atomic_add_fetch(&emu_next_tid, 1, __ATOMIC_SEQ_CST);
    return (dpc_stream)(uintptr_t)(0x30000000u + (unsigned)emu_tid);
}

static void forget_pending(int by_dev, int dev, dpc_stream s)
{
    s = resolve_stream(s);
    pthread_mutex_lock(&emu_mu);
    for (emu_pend **l = &emu_pending; *l;) {
        emu_pend *q = *l;
        if (by_dev ? q->dev == dev : q->s == s) {
            *l = q->next;
            free(q);
            emu_npending--;
        } else {
            l = &q->next;
        }
    }
    pthread_mutex_unlock(&emu_mu);
}

/* Record that s (on dev) touches host range [lo, hi) of device memory. */
void note_pending(dpc_stream s, int dev, const char *lo, const char *hi)
{
    emu_pend *q = malloc(sizeof *q);
    if (q == NULL)
        return;
    q->s = resolve_stream(s);
    q->dev = dev;
    q->foreign = 0;
    q->lo = lo;
    q->hi = hi;
    pthread_mutex_lock(&emu_mu);
    if (emu_npending > 100000) { /* a leak of records, not of work: drop them */
        while (emu_pending) {
            emu_pend *n = emu_pending->next;
            free(emu_pending);
            emu_pending = n;
        }
        emu_npending = 0;
    }
    q->next = emu_pending;
    emu_pending = q;
    emu_npending++;
    pthread_mutex_unlock(&emu_mu);
}

int dpc_emu_busy(const void *p, size_t n)
{
    const char *lo = (const char *)((uintptr_t)p & (((uintptr_t)1 << 48) - 1)), *hi = lo + n;
    int busy = 0;
    pthread_mutex_lock(&emu_mu);
    for (emu_pend *q = emu_pending; q && !busy; q = q->next)
        busy = q->lo < hi && lo < q->hi;
    pthread_mutex_unlock(&emu_mu);
    return busy;
}

void dpc_emu_stats(long *bad_handles, long *freed_busy)
{
    *bad_handles = __atomic_load_n(&emu_bad_handles, __ATOMIC_RELAXED);
    *freed_busy = __atomic_load_n(&emu_freed_busy, __ATOMIC_RELAXED);
}

void dpc_emu_note_freed_busy(void) { __atomic_add_fetch(&emu_freed_busy, 1, __ATOMIC_RELAXED); }

void dpc_emu_fail_stream_get(int slot) { __atomic_store_n(&emu_fail_slot, slot, __ATOMIC_SEQ_CST); }

/* NCCL launches in progress (dpc_emu_launching), and device calls of other
 * threads that overlapped one. */
static int emu_launches;
static __thread int emu_this_thread_launches;
static long emu_launch_overlaps;

void dpc_emu_launching(int on)
{
    emu_this_thread_launches = on;
    __atomic_add_fetch(&emu_launches, on ? 1 : -1, __ATOMIC_SEQ_CST);
}

long dpc_emu_launch_overlaps(void)
{
    return __atomic_load_n(&emu_launch_overlaps, __ATOMIC_SEQ_CST);
}

/* A device-synchronising call: counted when another thread is launching. */
static void device_call(void)
{
    if (!emu_this_thread_launches && __atomic_load_n(&emu_launches, __ATOMIC_SEQ_CST) > 0)
        __atomic_add_fetch(&emu_launch_overlaps, 1, __ATOMIC_SEQ_CST);
}

/* Handles another library destroyed (dpc_emu_destroy_stream); the oldest
 * is forgotten when more are destroyed. */
#define EMU_DESTROYED_MAX 64
static dpc_stream emu_destroyed[EMU_DESTROYED_MAX];
static int emu_destroyed_next;
static pthread_mutex_t emu_destroyed_mu = PTHREAD_MUTEX_INITIALIZER;

void dpc_emu_destroy_stream(dpc_stream s)
{
    pthread_mutex_lock(&emu_destroyed_mu);
    emu_destroyed[emu_destroyed_next] = s;
    emu_destroyed_next = (emu_destroyed_next + 1) % EMU_DESTROYED_MAX;
    pthread_mutex_unlock(&emu_destroyed_mu);
}

static int destroyed(dpc_stream s)
{
    int found = 0;
    pthread_mutex_lock(&emu_destroyed_mu);
    for (int i = 0; i < EMU_DESTROYED_MAX && !found; i++)
        found = s != NULL && emu_destroyed[i] == s;
    pthread_mutex_unlock(&emu_destroyed_mu);
    return found;
}

/* 1 when s is the poisoned handle of a failed dpc_stream_get, or a handle
 * its library destroyed (counted: undefined behaviour on hardware). */
int poisoned(dpc_stream s)
{
    if (s != EMU_POISON_STREAM && !destroyed(s))
        return 0;
    __atomic_add_fetch(&emu_bad_handles, 1, __ATOMIC_RELAXED);
    return 1;
}

size_t dpc_max_pitch(int dev)
{
    (void)dev;
    return (size_t)INT_MAX;
}

dpc_status dpc_device_sync(int dev)
{
    if (bad_dev(dev))
        return EMU_FAIL(E_INVALID_DEVICE, "cudaDeviceSynchronize()", dev,
                        emu_msg(E_INVALID_DEVICE));
    ctx_on(dev);
    device_call();
    wait_unstuck(dev);
    forget_pending(1, dev, NULL);
    return dpc_ok();
}

void dpc_emu_inject_fault(int code) { __atomic_store_n(&emu_fault, code, __ATOMIC_SEQ_CST); }

/* The injected fault, once (0: none). */
int take_fault(void) { return __atomic_exchange_n(&emu_fault, 0, __ATOMIC_SEQ_CST); }

/* ---- pointers ---- */

static void *to_dev(char *host, int dev)
{
    return (void *)((uintptr_t)host | EMU_TAG | ((uintptr_t)dev << EMU_DEV_SHIFT));
}

/* Is p a device pointer (and of which device)? The emulator's own check:
 * no context involved. */
int tagged(const void *p, int *dev)
{
    uintptr_t u = (uintptr_t)p;
    if (!(u & EMU_TAG))
        return 0;
    if (dev)
        *dev = (int)((u >> EMU_DEV_SHIFT) & 0x7f);
    return 1;
}

int dpc_is_device_ptr(const void *p, int *dev)
{
    ctx_pick(-1); /* cudaPointerGetAttributes needs a context */
    return tagged(p, dev);
}

void dpc_emu_queue(int dev, dpc_stream s, const void *p, size_t n)
{
    char *h = (char *)((uintptr_t)p & EMU_ADDR_MASK);
    note_pending(s, dev, h, h + n);
    pthread_mutex_lock(&emu_mu);
    if (emu_pending != NULL)
        emu_pending->foreign = 1;   /* the record just added */
    pthread_mutex_unlock(&emu_mu);
}

/* Another library's work still queued on s (unfinished until a sync). */
static int foreign_pending(dpc_stream s)
{
    int found = 0;
    s = resolve_stream(s);
    pthread_mutex_lock(&emu_mu);
    for (emu_pend *q = emu_pending; q != NULL && !found; q = q->next)
        found = q->foreign && q->s == s;
    pthread_mutex_unlock(&emu_mu);
    return found;
}

static char *to_host(const void *p) { return (char *)((uintptr_t)p & EMU_ADDR_MASK); }

/* Is [host, host+n) inside a live allocation of device `dev` (-1: pinned)?
 * 1: yes, 2: yes and peer access does not cover that block, 0: no. */
static int live_range(const char *host, size_t n, int dev)
{
    int ok = 0;
    pthread_mutex_lock(&emu_mu);
    for (emu_alloc *a = emu_live; a; a = a->next) {
        if (a->dev == dev && host >= a->host && host + n <= a->host + a->size) {
            ok = a->nopeer ? 2 : 1;
            break;
        }
    }
    pthread_mutex_unlock(&emu_mu);
    return ok;
}

/* Check a device range [p + lo, p + hi) and return its host address. */
static char *dev_range_ex(const void *p, int64_t lo, int64_t hi, int *dev_out, int *nopeer)
{
    int dev, live = 1;
    if (!tagged(p, &dev))
        return NULL;
    char *h = to_host(p);
    if (hi > lo && !(live = live_range(h + lo, (size_t)(hi - lo), dev)))
        return NULL;
    if (dev_out)
        *dev_out = dev;
    if (nopeer)
        *nopeer = live == 2;
    return h;
}

char *dev_range(const void *p, int64_t lo, int64_t hi, int *dev_out)
{
    return dev_range_ex(p, lo, hi, dev_out, NULL);
}

/* A kernel on dev touching device range [p + lo, p + hi): its host address,
 * or NULL with *illegal = 1 when the block is on another device and peer
 * access does not cover it (cudaErrorIllegalAddress on hardware). */
char *kernel_range(int dev, const void *p, int64_t lo, int64_t hi, int *illegal)
{
    int pdev = -1, nopeer = 0;
    char *h = dev_range_ex(p, lo, hi, &pdev, &nopeer);
    if (h != NULL && pdev != dev && nopeer) {
        *illegal = 1;
        return NULL;
    }
    return h;
}

static dpc_status track(char *host, size_t n, int dev, const char *call)
{
    emu_alloc *a = malloc(sizeof *a);
    if (a == NULL)
        return EMU_FAIL(E_OOM, call, dev, emu_msg(E_OOM));
    a->host = host;
    a->size = n;
    a->dev = dev;
    a->nopeer = 0;
    pthread_mutex_lock(&emu_mu);
    a->next = emu_live;
    emu_live = a;
    pthread_mutex_unlock(&emu_mu);
    return dpc_ok();
}

static int untrack(char *host, int dev, size_t *size)
{
    int found = 0;
    pthread_mutex_lock(&emu_mu);
    for (emu_alloc **l = &emu_live; *l; l = &(*l)->next) {
        if ((*l)->host == host && (*l)->dev == dev) {
            emu_alloc *a = *l;
            *l = a->next;
            *size = a->size;
            if (dev >= 0)
                emu_used[dev] -= a->size;
            free(a);
            found = 1;
            break;
        }
    }
    pthread_mutex_unlock(&emu_mu);
    return found;
}

/* ---- memory ---- */

dpc_status dpc_malloc(int dev, size_t nbytes, void **out)
{
    if (bad_dev(dev))
        return EMU_FAIL(E_INVALID_DEVICE, "cudaMalloc(&p, nbytes)", dev, emu_msg(E_INVALID_DEVICE));
    ctx_on(dev);
    device_call();
    pthread_mutex_lock(&emu_mu);
    int over = emu_used[dev] + nbytes > emu_limit;
    if (!over)
        emu_used[dev] += nbytes;
    pthread_mutex_unlock(&emu_mu);
    if (over)
        return EMU_FAIL(E_OOM, "cudaMalloc(&p, nbytes)", dev, emu_msg(E_OOM));
    char *h = NULL;
    if (posix_memalign((void **)&h, 256, nbytes ? nbytes : 1) != 0) {
        pthread_mutex_lock(&emu_mu);
        emu_used[dev] -= nbytes;
        pthread_mutex_unlock(&emu_mu);
        return EMU_FAIL(E_OOM, "cudaMalloc(&p, nbytes)", dev, emu_msg(E_OOM));
    }
    dpc_status s = track(h, nbytes, dev, "cudaMalloc(&p, nbytes)");
    if (s.code) {
        free(h);
        return s;
    }
    *out = to_dev(h, dev);
    return dpc_ok();
}

dpc_status dpc_free(int dev, void *p)
{
    int pdev;
    size_t size;
    if (p == NULL)
        return dpc_ok();
    ctx_on(dev);
    if (!tagged(p, &pdev) || pdev != dev || !untrack(to_host(p), dev, &size))
        return EMU_FAIL(E_INVALID_VALUE, "cudaFree(p)", dev, emu_msg(E_INVALID_VALUE));
    device_call();
    wait_unstuck(dev);            /* cudaFree synchronises the device */
    forget_pending(1, dev, NULL);
    /* poison (the first 64 MiB: a huge lazily-mapped block stays cheap):
     * a later read sees garbage */
    memset(to_host(p), 0xDB, size < ((size_t)64 << 20) ? size : ((size_t)64 << 20));
    free(to_host(p));
    return dpc_ok();
}

dpc_status dpc_emu_malloc_nopeer(int dev, size_t nbytes, void **out)
{
    DPC_TRY(dpc_malloc(dev, nbytes, out));
    pthread_mutex_lock(&emu_mu);
    for (emu_alloc *a = emu_live; a; a = a->next) {
        if (a->host == to_host(*out) && a->dev == dev)
            a->nopeer = 1;
    }
    pthread_mutex_unlock(&emu_mu);
    return dpc_ok();
}

dpc_status dpc_host_alloc(int dev, size_t nbytes, void **out)
{
    char *h = NULL;
    if (dev >= 0 && bad_dev(dev))
        return EMU_FAIL(E_INVALID_DEVICE, "cudaHostAlloc(&p, nbytes, cudaHostAllocPortable)", dev,
                        emu_msg(E_INVALID_DEVICE));
    ctx_pick(dev);
    if (posix_memalign((void **)&h, 4096, nbytes ? nbytes : 1) != 0)
        return EMU_FAIL(E_OOM, "cudaHostAlloc(&p, nbytes, cudaHostAllocPortable)", -1,
                        emu_msg(E_OOM));
    dpc_status s = track(h, nbytes, -1, "cudaHostAlloc");
    if (s.code) {
        free(h);
        return s;
    }
    *out = h;
    return dpc_ok();
}

dpc_status dpc_host_free(int dev, void *p)
{
    size_t size;
    if (p == NULL)
        return dpc_ok();
    ctx_pick(dev >= 0 && !bad_dev(dev) ? dev : -1);
    if (!untrack(p, -1, &size))
        return EMU_FAIL(E_INVALID_VALUE, "cudaFreeHost(p)", -1, emu_msg(E_INVALID_VALUE));
    memset(p, 0xDB, size);
    free(p);
    return dpc_ok();
}

int dpc_is_pinned(int dev, const void *p)
{
    ctx_pick(dev >= 0 && !bad_dev(dev) ? dev : -1);
    return !tagged(p, NULL) && live_range(p, 1, -1);
}

/* ---- streams: handles, and the records of work queued on them ---- */

dpc_status dpc_stream_get(int dev, int slot, dpc_stream *out)
{
    *out = EMU_POISON_STREAM; /* what a caller sees if it ignores a failure */
    if (bad_dev(dev))
        return EMU_FAIL(E_INVALID_DEVICE, "cudaStreamCreateWithFlags", dev,
                        emu_msg(E_INVALID_DEVICE));
    ctx_on(dev);
    int want = slot;
    if (__atomic_compare_exchange_n(&emu_fail_slot, &want, -1, 0, __ATOMIC_SEQ_CST,
                                    __ATOMIC_SEQ_CST))
        return EMU_FAIL(E_INVALID_VALUE, "cudaStreamCreateWithFlags", dev,
                        emu_msg(E_INVALID_VALUE));
    *out = (dpc_stream)(uintptr_t)(0x1000 + dev * 256 + slot);
    return dpc_ok();
}

void dpc_emu_set_stuck(int dev, int on)
{
    if (!bad_dev(dev))
        __atomic_store_n(&emu_stuck[dev], on, __ATOMIC_SEQ_CST);
}

/* Block while dev is stuck, as cudaStreamSynchronize on a hung kernel does. */
static void wait_unstuck(int dev)
{
    void (*hook)(void) = emu_sync_hook;
    if (hook)
        hook();
    struct timespec t = {0, 1000000};
    while (__atomic_load_n(&emu_stuck[dev], __ATOMIC_SEQ_CST))
        nanosleep(&t, NULL);
}

dpc_status dpc_stream_query(int dev, dpc_stream s, int *done)
{
    *done = 0;
    if (bad_dev(dev))
        return EMU_FAIL(E_INVALID_DEVICE, "cudaStreamQuery(s)", dev, emu_msg(E_INVALID_DEVICE));
    ctx_on(dev);
    if (poisoned(s))
        return EMU_FAIL(E_INVALID_HANDLE, "cudaStreamQuery(s)", dev, emu_msg(E_INVALID_HANDLE));
    *done = !__atomic_load_n(&emu_stuck[dev], __ATOMIC_SEQ_CST) && !foreign_pending(s);
    if (*done)
        forget_pending(0, dev, s);
    return dpc_ok();
}

dpc_status dpc_stream_sync(int dev, dpc_stream s)
{
    if (bad_dev(dev))
        return EMU_FAIL(E_INVALID_DEVICE, "cudaStreamSynchronize(s)", dev,
                        emu_msg(E_INVALID_DEVICE));
    ctx_on(dev);
    if (poisoned(s))
        return EMU_FAIL(E_INVALID_HANDLE, "cudaStreamSynchronize(s)", dev,
                        emu_msg(E_INVALID_HANDLE));
    wait_unstuck(dev);
    forget_pending(0, dev, s);
    return dpc_ok();
}

#endif /* DPMINI_CUDA_EMULATE */
