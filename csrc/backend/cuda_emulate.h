/* cuda_emulate.h - what cuda_emulate.c (devices, pointers, memory,
 * streams) and cuda_emulate_copy.c (copies, kernels) share: CUDA's error
 * codes, the failure macro and the range checks. DPMINI_CUDA_EMULATE only.
 * The functions keep the names they had as file-local helpers before the
 * split; hidden visibility keeps them out of the extension's exports. */
#ifndef DPMINI_CUDA_EMULATE_H
#define DPMINI_CUDA_EMULATE_H

#include "cuda_api.h"

#include <stdint.h>

#pragma GCC visibility push(hidden)

/* CUDA's own codes, so messages and .status look like the real thing. */
enum { E_INVALID_VALUE = 1, E_OOM = 2, E_INVALID_PITCH = 12, E_INVALID_DEVICE = 101 };
#define E_INVALID_HANDLE 400
#define E_ILLEGAL_ADDRESS 700

#define EMU_FAIL(code, call, dev, msg)                                          \
    dpc_fail(DPC_LIB_CUDA, (code), (code) == E_OOM, (dev), (call), __FILE__, __LINE__, (msg))

/* The message of a CUDA code, as cudaGetErrorString words it. */
const char *emu_msg(int code);
/* 1 when dev is not a device index of the emulator. */
int bad_dev(int dev);
/* 1 when s is the poisoned handle of a failed dpc_stream_get (counted). */
int poisoned(dpc_stream s);
/* The injected fault, once (0: none). */
int take_fault(void);
/* Check a device range [p + lo, p + hi) and return its host address (NULL:
 * not a live device range). */
char *dev_range(const void *p, int64_t lo, int64_t hi, int *dev_out);
/* A kernel on dev touching device range [p + lo, p + hi): its host address,
 * or NULL, with *illegal = 1 when peer access does not cover the block. */
char *kernel_range(int dev, const void *p, int64_t lo, int64_t hi, int *illegal);
/* Is p a device pointer (*dev: its device)? No context involved, unlike
 * dpc_is_device_ptr (cuda_emulate.c). */
int tagged(const void *p, int *dev);
/* The emulator's context model (cuda_emulate_ctx.c): a call through the
 * device guard on dev creates dev's context; ctx_pick(dev) is a call that
 * needs a context, on dev when >= 0, else the thread's bound one, else a
 * device that has one, else the current device's (created and bound). */
void ctx_on(int dev);
void ctx_pick(int dev);
/* Record that s (on dev) touches host range [lo, hi) of device memory. */
void note_pending(dpc_stream s, int dev, const char *lo, const char *hi);

#pragma GCC visibility pop

#endif
