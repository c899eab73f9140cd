/* nccl_wait.c - waiting for a collective without hanging forever.
 *
 * A collective whose peer failed never finishes: cudaStreamSynchronize
 * would block for ever, with the GIL released, so Ctrl-C is never seen
 * either. Instead the streams are polled (cudaStreamQuery), and between
 * polls: ncclCommGetAsyncError of every rank (an error there means the
 * collective will not finish), pending signals (PyErr_CheckSignals, the GIL
 * taken for a moment every 100 ms: a KeyboardInterrupt ends the wait), and a
 * timeout ($DPMINI_NCCL_TIMEOUT seconds, default 1800 like PyTorch's
 * process-group default; 0 none). Whatever ends the wait early, the caller
 * (nccl.c run_group) aborts the communicators (ncclCommAbort), which is
 * what makes NCCL's kernels exit.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h> /* the GIL and signals; not py/'s state or types */
#include "gpu.h"
#include "nccl_wait.h"
#include "env.h"

#include <time.h>

static double now_s(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + (double)t.tv_nsec * 1e-9;
}

/* $DPMINI_NCCL_TIMEOUT: whole seconds, env.h's rule; unset or invalid: 1800. */
static double timeout_s(void)
{
    unsigned long long v;
    return dp_env_uint("DPMINI_NCCL_TIMEOUT", 0, 1ull << 31, &v) == DP_ENV_OK ? (double)v
                                                                               : 1800.0;
}

/* 1 when a signal handler raised (its exception is left set). */
static int signalled(void)
{
    PyGILState_STATE g = PyGILState_Ensure();
    int r = PyErr_CheckSignals();
    PyGILState_Release(g);
    return r < 0;
}

dpc_status dp_nccl_wait(int n, const int *devs, dp_nccl_async_err_fn async_err, void *ctx)
{
    double start = now_s(), limit = timeout_s(), last_signal_check = start;
    long nap_ns = 20000;
    for (;;) {
        int all = 1;
        for (int i = 0; i < n; i++) {
            dpc_stream s;
            int done = 0;
            DPC_TRY(dpc_stream_get(devs[i], DP_NCCL_SLOT, &s));
            DPC_TRY(dpc_stream_query(devs[i], s, &done));
            all = all && done;
        }
        if (all) {
            return dpc_ok();
        }
        for (int i = 0; i < n; i++) {
            int e = async_err(ctx, i);
            if (e != 0) {
                return dpc_fail(DPC_LIB_NCCL, e, 0, devs[i], "ncclCommGetAsyncError(comm, &err)",
                                __FILE__, __LINE__,
                                "the collective failed on a rank (asynchronous NCCL error); "
                                "its communicators were aborted");
            }
        }
        double t = now_s();
        if (limit > 0 && t - start > limit) {
            return dpc_fail(DPC_LIB_DPMINI, 3, 0, devs[0], "NCCL collective", __FILE__, __LINE__,
                            "did not finish within $DPMINI_NCCL_TIMEOUT seconds (default 1800); "
                            "its communicators were aborted");
        }
        if (t - last_signal_check >= 0.1) {
            last_signal_check = t;
            if (signalled()) {
                return dpc_fail(DPC_LIB_DPMINI, DPC_DPMINI_INTERRUPTED, 0, devs[0],
                                "NCCL collective", __FILE__, __LINE__, "interrupted by a signal");
            }
        }
        struct timespec nap = {0, nap_ns};
        nanosleep(&nap, NULL);
        if (nap_ns < 1000000) {
            nap_ns *= 2; /* a short collective is seen at once, a long one costs ~1 ms */
        }
    }
}
