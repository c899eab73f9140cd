/* cuda_emulate_ctx.c - the emulator's current device and CUDA contexts
 * (DPMINI_CUDA_EMULATE only; see cuda_emulate.c's file comment).
 *
 * A thread has a current device (cudaGetDevice; 0 on a fresh thread) and
 * starts with no context bound. As with the CUDA runtime: cudaSetDevice
 * creates and binds the device's context; a call through the device guard
 * (every call that names its device) creates that device's context and
 * leaves the thread as it found it; a call that needs a context and names
 * no device uses the thread's bound one, else creates and binds the current
 * device's, device 0 on a fresh thread. dpc_emu_contexts lists the devices
 * that got one, so a stray context on GPU 0 shows in tests
 * (tests/test_gpu_contexts.py).
 */
#if defined(DPMINI_CUDA_EMULATE)
#define _POSIX_C_SOURCE 200809L

#include "cuda_emulate.h"

#define EMU_MAX_DEVICES 64

static __thread int emu_current;
static __thread int emu_has_ctx;            /* this thread has a context bound */
static int emu_ctx[EMU_MAX_DEVICES];        /* 1: the device's context exists */
static int emu_first_ctx = -1;              /* first device given a context */

/* ---- contexts (see the file comment) ---- */

static void ctx_make(int dev)
{
    if (dev < 0 || dev >= EMU_MAX_DEVICES)
        return;
    __atomic_store_n(&emu_ctx[dev], 1, __ATOMIC_SEQ_CST);
    int none = -1;
    __atomic_compare_exchange_n(&emu_first_ctx, &none, dev, 0, __ATOMIC_SEQ_CST,
                                __ATOMIC_SEQ_CST);
}

/* A call through the device guard on dev: dev's context; it stays bound to
 * the thread only when dev was current already (the guard did not switch). */
void ctx_on(int dev)
{
    ctx_make(dev);
    if (emu_current == dev)
        emu_has_ctx = 1;
}

/* A call that needs a context: on dev when given (>= 0); else the thread's
 * bound one, else a device that has one (the real backend's choice), else
 * the current device's, created and bound (what the runtime itself does). */
void ctx_pick(int dev)
{
    if (dev >= 0) {
        ctx_on(dev);
        return;
    }
    if (emu_has_ctx)
        return;
    int first = __atomic_load_n(&emu_first_ctx, __ATOMIC_SEQ_CST);
    if (first >= 0) {
        ctx_on(first);
        return;
    }
    ctx_make(emu_current);
    emu_has_ctx = 1;
}

int dpc_initialised(void) { return __atomic_load_n(&emu_first_ctx, __ATOMIC_SEQ_CST) >= 0; }

int dpc_emu_contexts(int *devs, int max)
{
    int n = 0;
    for (int d = 0; d < EMU_MAX_DEVICES; d++) {
        if (__atomic_load_n(&emu_ctx[d], __ATOMIC_SEQ_CST) && n < max)
            devs[n++] = d;
    }
    return n;
}

dpc_status dpc_set_device(int dev)
{
    if (bad_dev(dev))
        return EMU_FAIL(E_INVALID_DEVICE, "cudaSetDevice(dev)", dev, emu_msg(E_INVALID_DEVICE));
    emu_current = dev;
    ctx_make(dev); /* CUDA 12+: cudaSetDevice initialises the device's context */
    emu_has_ctx = 1;
    return dpc_ok();
}

dpc_status dpc_guard_enter(int dev, dpc_device_guard *g)
{
    g->prev = emu_current;
    g->switched = 0;
    g->ctx = (void *)(uintptr_t)emu_has_ctx; /* the real guard keeps the CUcontext */
    if (bad_dev(dev))
        return EMU_FAIL(E_INVALID_DEVICE, "cudaSetDevice(dev)", dev, emu_msg(E_INVALID_DEVICE));
    g->switched = emu_current != dev;
    emu_current = dev;
    ctx_make(dev);
    emu_has_ctx = 1;
    return dpc_ok();
}

void dpc_guard_leave(dpc_device_guard *g)
{
    if (g->switched) {
        emu_current = g->prev;
        emu_has_ctx = (int)(uintptr_t)g->ctx; /* none included */
    }
    g->switched = 0;
}

int dpc_current_device(void) { return emu_current; }

#endif /* DPMINI_CUDA_EMULATE */
