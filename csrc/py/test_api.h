/* test_api.h - the hooks that the test-only extension dpmini._testing
 * (csrc/testing/testing.c, built when DPMINI_TESTING=1) reaches inside
 * _dpmini: one table of C function pointers, filled in py/test_hooks.c and
 * exported by module/module.c as the capsule dpmini._dpmini._test_api (the
 * pattern of NumPy's _ARRAY_API and CPython's _testcapi). The shipped module
 * has no Python function for any of them.
 *
 * Adding a hook takes three lines in three known places: a field in
 * dp_test_api below, its value in test_hooks.c's table, and the Python
 * function in testing.c's method table. Entries that exist only in the
 * emulated CUDA build (the emu_* group) are NULL in the other builds, and
 * dpmini._testing raises RuntimeError("not an emulated build") for them.
 * Bump DP_TEST_API_VERSION when a field changes type or place. */
#ifndef DPMINI_TEST_API_H
#define DPMINI_TEST_API_H

#include <Python.h>
#include "alloc.h"
#include "cuda_api.h"

#define DP_TEST_API_CAPSULE "dpmini._dpmini._test_api"
#define DP_TEST_API_VERSION 1

/* dpmini's GPU sync and NCCL counters (testing.gpu_counters()). */
typedef struct dp_test_gpu_counters {
    int current_device;            /* the calling thread's CUDA device */
    long legacy_syncs;             /* syncs of the legacy default stream */
    long export_syncs;             /* device syncs before an export */
    long export_stream_syncs;      /* stream syncs before an export */
    int export_deferred;           /* exported blocks waiting for their consumer */
    long nccl_calls, nccl_destroyed, nccl_aborted;
    int nccl_live_comms;           /* -1 outside the emulated build */
} dp_test_gpu_counters;

typedef struct dp_test_api {
    int version;                   /* DP_TEST_API_VERSION */
    /* ---- every build ---- */
    /* Host allocations: n more succeed, then one fails as out of memory
     * (-1: off); returns the previous countdown. */
    long (*fail_alloc_after)(long n);
    /* The caching allocator's counters of a host or "cpu:N" device (the
     * device argument as Python passes it); -1 with an exception set. */
    int (*cache_stats)(PyObject *dpmini, PyObject *device, dp_cache_stats *out);
    void (*gpu_counters)(dp_test_gpu_counters *out);
    /* 1 when dpmini hands DPC_T_* type to NCCL for reduce_add. */
    int (*nccl_supports)(int type);
    /* Emulated builds: the stand-in NCCL on (1) / off (0) / unchanged (-1),
     * and the next ncclGroupEnd fails with fail_next (0: no); the previous
     * state, or -1 in other builds. */
    int (*nccl_emulate)(int on, int fail_next);
    /* dpmini's status-to-exception funnel (CudaError, NcclError,
     * MemoryError) of the module dpmini; returns -1. */
    int (*raise_status)(PyObject *dpmini, dpc_status s, const char *op);
    /* ---- emulated CUDA build only (NULL otherwise) ---- */
    void (*emu_inject_fault)(int code);            /* next copy or kernel fails */
    void (*emu_fail_stream_get)(int slot);         /* next stream request of slot fails */
    /* device memory outside peer access, holding n bytes of data */
    dpc_status (*emu_nopeer_fill)(int dev, const void *data, size_t n, void **out);
    dpc_status (*emu_free)(int dev, void *p);
    void (*emu_stats)(long *bad_handles, long *freed_busy);
    long (*emu_nccl_crossed)(void);
    void (*emu_set_sync_hook)(void (*hook)(void)); /* called at every sync */
    void (*emu_nccl_hang)(int mode);               /* 1: with an async error, 2: silently */
    int (*emu_contexts)(int *devs, int max);
    void (*emu_queue)(int dev, dpc_stream s, const void *p, size_t n);
    int (*emu_busy)(const void *p, size_t n);
    long (*emu_launch_overlaps)(void);             /* device calls during another thread's NCCL launch */
    void (*emu_destroy_stream)(dpc_stream s);      /* another library destroyed that handle */
} dp_test_api;

/* test_hooks.c: the one table (static storage, filled at compile time). */
extern const dp_test_api dp_test_api_table;

#endif
