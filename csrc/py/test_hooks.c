/* test_hooks.c - dp_test_api_table: the one table of hooks that the
 * test-only extension dpmini._testing reaches through the capsule
 * dpmini._dpmini._test_api (test_api.h says how to add one). The emulator's
 * hooks (the emu_* group) exist only in the emulated CUDA build
 * (DPMINI_CUDA_EMULATE, backend/cuda_emulate*.c); elsewhere they are NULL. */
#include "test_api.h"
#include "dpmini.h"
#include "gpu.h"
#include "host_memory.h"

static int cache_stats(PyObject *dpmini, PyObject *device, dp_cache_stats *out)
{
    return dp_host_cache_stats(dp_state_from_module(dpmini), device, out);
}

static void gpu_counters(dp_test_gpu_counters *out)
{
    out->current_device = dpc_current_device();
    out->legacy_syncs = __atomic_load_n(&dp_gpu_stat_legacy_syncs, __ATOMIC_RELAXED);
    out->export_syncs = __atomic_load_n(&dp_gpu_stat_export_syncs, __ATOMIC_RELAXED);
    out->export_stream_syncs = __atomic_load_n(&dp_gpu_stat_export_stream_syncs,
                                               __ATOMIC_RELAXED);
    out->export_deferred = dp_gpu_deferred_count();
    dp_nccl_stats(&out->nccl_calls, &out->nccl_destroyed, &out->nccl_aborted);
    out->nccl_live_comms = dp_nccl_live_comms();
}

static int raise_status(PyObject *dpmini, dpc_status s, const char *op)
{
    return dp_gpu_raise(dp_state_from_module(dpmini), s, op);
}

#ifdef DPMINI_CUDA_EMULATE

/* Device memory that peer access does not cover (VMM, an async pool, IPC),
 * holding the n bytes at data; freed again when a step fails. */
static dpc_status emu_nopeer_fill(int dev, const void *data, size_t n, void **out)
{
    void *p = NULL;
    dpc_stream s = NULL;
    dpc_status st = dpc_emu_malloc_nopeer(dev, n, &p);
    if (st.code == 0) {
        st = dpc_stream_get(dev, 0, &s);
    }
    if (st.code == 0) {
        st = dpc_memcpy_async(dev, p, data, n, DPC_H2D, s);
    }
    if (st.code == 0) {
        st = dpc_stream_sync(dev, s);
    }
    if (st.code != 0 && p != NULL) {
        (void)dpc_free(dev, p);
        p = NULL;
    }
    *out = p;
    return st;
}

#define EMU(fn) fn
#else
#define EMU(fn) NULL
#endif

const dp_test_api dp_test_api_table = {
    .version = DP_TEST_API_VERSION,
    .fail_alloc_after = dp_host_fail_alloc_after,
    .cache_stats = cache_stats,
    .gpu_counters = gpu_counters,
    .nccl_supports = dp_nccl_supports,
    .nccl_emulate = dp_nccl_emulate,
    .raise_status = raise_status,
    .emu_inject_fault = EMU(dpc_emu_inject_fault),
    .emu_fail_stream_get = EMU(dpc_emu_fail_stream_get),
    .emu_nopeer_fill = EMU(emu_nopeer_fill),
    .emu_free = EMU(dpc_free),
    .emu_stats = EMU(dpc_emu_stats),
    .emu_nccl_crossed = EMU(dp_nccl_crossed),
    .emu_set_sync_hook = EMU(dpc_emu_set_sync_hook),
    .emu_nccl_hang = EMU(dp_nccl_emulate_hang),
    .emu_contexts = EMU(dpc_emu_contexts),
    .emu_queue = EMU(dpc_emu_queue),
    .emu_busy = EMU(dpc_emu_busy),
    .emu_launch_overlaps = EMU(dpc_emu_launch_overlaps),
    .emu_destroy_stream = EMU(dpc_emu_destroy_stream),
};
