/* gpu.h - dpmini's GPU layer over cuda_api.h (gpu.c, nccl.c), shared by
 * device.c, copy_engine.c, reduce.c, array.c and dataparallel.c.
 *
 * No Python.h here: everything in this header may run on a device worker
 * thread with the GIL released. Failures are dpc_status values; the layer
 * above turns them into Python exceptions (dp_gpu_raise, py/gpu_error.c).
 */
#ifndef DPMINI_GPU_H
#define DPMINI_GPU_H

#include <stddef.h>
#include <stdint.h>
#include "capi.h"
#include "copy.h"
#include "cuda_api.h"

/* Contiguous runs at least this long (bytes) go through cudaMemcpy2DAsync
 * (one DMA descriptor per row); shorter ones are packed first (on the host
 * into pinned staging, or by the pack kernel on the device). Not measured
 * here (no GPU in the session that wrote it): 1 KiB is where copy engines are
 * commonly reported to approach full PCIe bandwidth per row;
 * benchmarks/bench_gpu.py sweeps row lengths to measure the real crossover.
 * $DPMINI_2D_MIN_RUN overrides it (bytes). */
#define DP_2D_MIN_RUN_DEFAULT 1024

/* GPUs that get a memory cache and pinned staging of their own (gpu.c,
 * gpu_copy.c). */
#define DP_GPU_MAX 64

/* Pinned staging per device: two halves used alternately (pack one while
 * the other is in flight). Allocated on first use, kept for the process. */
#define DP_STAGE_HALF ((size_t)16 << 20)

/* Stream slots 0 .. DP_GPU_SLOTS-1 are for copies (one per replica chunk);
 * the two staging halves use their own slots. */
#define DP_GPU_SLOTS 12
#define DP_STAGE_SLOT 12
/* NCCL's own slot (after the two staging halves): its completion wait polls
 * this stream only, not copy work that other threads queue on slot 0. The
 * buffers a collective reads were written by copies already synchronised. */
#define DP_NCCL_SLOT 14

/* ---- device memory: a per-device caching allocator (never frees on the
 * hot path; cudaFree synchronises the whole device) ---- */
dpc_status dp_gpu_alloc(int dev, size_t nbytes, void **out, size_t *rounded);
void dp_gpu_free(int dev, void *p, size_t rounded);
/* Free a block that was exported (DLPack / CUDA Array Interface;
 * gpu_export.c): consumer, the stream a DLPack consumer named, is waited for
 * first when it is one that cannot have been destroyed since (the legacy
 * default stream, dpmini's own); otherwise (NULL, another library's handle)
 * the block is put aside and cached after the next device sync, shared with
 * other such blocks. Call without the GIL. */
void dp_gpu_free_exported(int dev, void *p, size_t rounded, dpc_stream consumer);
/* Release dev's put-aside blocks now (one device sync); blocks put aside on
 * all devices (tests). */
dpc_status dp_gpu_release_deferred(int dev);
/* gpu_launch.c: NCCL launches (begin/end, exclusive) never overlap the
 * device-synchronising calls cudaMalloc, cudaFree, cudaDeviceSynchronize
 * (device_call begin/end, shared). Never nested. */
void dp_launch_begin(void);
/* lib_search.c: capi.h's search for a shared library (GIL held). */
void *dp_find_library(dp_lib_search *s, char *found, size_t found_len);
/* nccl_lib.c: libnccl.so.2 bound once for the process (GIL held on the
 * first call); NULL with the reason in `why`. */
const dp_nccl_lib *dp_nccl_lib_load(char *why, size_t why_len);
void dp_launch_end(void);
void dp_device_call_begin(void);
void dp_device_call_end(void);
int dp_gpu_deferred_count(void);
/* Bytes put aside on dev: freed by their arrays, so not counted by
 * memory_allocated, but still reserved. */
size_t dp_gpu_deferred_bytes(int dev);
/* A block given up for lost (its device is unusable): the cache forgets it. */
void dp_gpu_forget(int dev, size_t rounded);
/* Counters for tests (_dpmini._cuda_debug): device syncs that released
 * exported blocks, consumer-stream syncs before reusing one; legacy default
 * stream syncs on import (array.c). */
extern long dp_gpu_stat_export_syncs;
extern long dp_gpu_stat_export_stream_syncs;
extern long dp_gpu_stat_legacy_syncs;
void dp_gpu_memory(int dev, size_t *allocated, size_t *reserved);
/* dpmini's own cudaMalloc blocks (gpu_owned.c): only these are read by a
 * kernel on a peer device; borrowed memory may be a kind peer access does
 * not cover. add returns -1 when out of memory (the block is then simply
 * never treated as peer-readable). */
int dp_gpu_owned_add(int dev, void *p, size_t size);
void dp_gpu_owned_remove(int dev, void *p);
int dp_gpu_owned(int dev, const void *p);
void dp_gpu_empty_cache(void);

/* ---- copies ----
 * The streams a group of copy jobs on one device has used; synced once at
 * the end of the group (stream syncs, never a device-wide sync). */
typedef struct {
    int dev;
    unsigned used;       /* bit i: slot i of dev has queued work */
} dp_gpu_sync;

/* One strided copy (a simplified dp_copy_desc, numel > 0) between any two
 * places of which at least one is a CUDA device: dst_dev / src_dev are CUDA
 * device indices or -1 for host memory (pinned or not). Queued on stream
 * `slot` of the executing device, recorded in *sync; staged paths finish
 * before returning. The path (direct, 2D, host pack, pack kernel, peer) is
 * chosen from the layout; see gpu.c. */
dpc_status dp_gpu_copy(const dp_copy_desc *d, char *dst, int dst_dev, const char *src,
                       int src_dev, int slot, dp_gpu_sync *sync);
dpc_status dp_gpu_sync_finish(dp_gpu_sync *sync);

/* acc[i] += x[i] on dev (both device pointers, numel elements of type). */
dpc_status dp_gpu_add(int dev, int type, void *acc, const void *x, int64_t numel);

/* 1 with a sentence in buf when CUDA is unusable although a driver is
 * installed (e.g. older than the runtime); 0 when it works or the machine
 * simply has no driver or GPU (gpu_driver.c). */
int dp_cuda_unusable(char *buf, size_t size);

/* ---- NCCL (nccl.c), loaded with dlopen on first use ---- */
/* 1 when libnccl could be loaded (never under emulation). */
int dp_nccl_available(void);
/* "2.21.5", or "not loaded" / "not found: <dlerror>". */
const char *dp_nccl_describe(void);
/* Broadcast nbytes from bufs[root] to bufs[i] on devs[i] (distinct devices),
 * as one NCCL group; returns when done. */
dpc_status dp_nccl_broadcast(int n, const int *devs, void *const *bufs, size_t nbytes,
                             int root);
/* narr broadcasts over the same devices in one NCCL group (split into groups
 * of at most 2048 rank calls, NCCL's limit) and one wait: array a goes from
 * bufs[a * n + roots[a]] to bufs[a * n + i] on devs[i], nbytes[a] bytes. */
dpc_status dp_nccl_broadcast_many(int n, const int *devs, int narr, void *const *bufs,
                                  const size_t *nbytes, const int *roots);
/* At interpreter exit: destroy the cached communicators (not in a forked
 * child, not while a collective runs). */
void dp_nccl_shutdown(void);
/* recv (on devs[root]) = sum of send[i] (on devs[i]); numel elements of
 * DPC_T_* type; one group; returns when done. */
dpc_status dp_nccl_reduce(int n, const int *devs, const void *const *send, void *recv,
                          int64_t numel, int type, int root);
/* 1 when NCCL can reduce DPC_T_* type (not int16/uint16: NCCL has no 16-bit
 * integers), so the caller picks the add kernel otherwise. */
int dp_nccl_supports(int type);
/* Tests: collectives run, uncached communicator sets destroyed, sets aborted. */
void dp_nccl_stats(long *calls, long *destroyed, long *aborted);
/* Tests, emulated builds only (else -1): switch the stand-in NCCL on (1) or
 * off (0; -1 leaves it), make the next ncclGroupEnd fail with fail_next
 * (0: no); returns whether it was on. */
int dp_nccl_emulate(int on, int fail_next);
/* Tests, emulated builds: communicators alive (-1 elsewhere). */
int dp_nccl_live_comms(void);
/* Tests, emulated builds: collectives of different communicator sets that
 * ran at once on a shared device (a hang on hardware); -1 elsewhere. */
long dp_nccl_crossed(void);
/* Tests, emulated builds: the next collective never finishes (1: and
 * ncclCommGetAsyncError reports ncclRemoteError; 2: silently). */
void dp_nccl_emulate_hang(int mode);

#endif
