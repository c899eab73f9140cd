/* gpu_error.c - the one funnel from a failed dpc_status (cuda_api.h) to a
 * Python exception: dp_gpu_raise, declared in dpmini.h.
 *
 * The GPU layer below (backend/: gpu.c, nccl.c, the CUDA runtime behind
 * cuda_api.h) is plain C and reports failures as a dpc_status: the call,
 * file, line, device, the library's code and message. This file, above it,
 * chooses the exception type from the module state (dpmini.CudaError,
 * dpmini.NcclError, MemoryError) and writes the message.
 */
#include "dpmini.h"
#include "gpu.h"

#include <stdio.h>

int dp_gpu_raise(dp_state *st, dpc_status s, const char *op)
{
    char where[32];
    if (s.device >= 0) {
        snprintf(where, sizeof where, "cuda:%d", s.device);
    } else {
        snprintf(where, sizeof where, "the host");
    }
    const char *lib = s.lib == DPC_LIB_NCCL ? "NCCL" : (s.lib == DPC_LIB_CUDA ? "CUDA" : "dpmini");
    PyObject *type = s.oom ? PyExc_MemoryError
                           : (s.lib == DPC_LIB_NCCL ? st->NcclError : st->CudaError);
    /* A recoverable error was already cleared where it happened (CUDA_TRY
     * calls cudaGetLastError on the failing thread: the last error is per
     * thread, so clearing it here, on the Python thread, would do nothing).
     * A sticky one cannot be cleared: say so. */
    if (s.lib == DPC_LIB_DPMINI && s.code == DPC_DPMINI_INTERRUPTED && PyErr_Occurred()) {
        return -1; /* a signal handler's exception (KeyboardInterrupt): keep it */
    }
    int sticky = s.lib == DPC_LIB_CUDA && dpc_cuda_error_is_sticky(s.code);
    PyObject *msg = PyUnicode_FromFormat(
        "%s on %s: %s error %d (%s) from %s [%s:%d]%s", op, where, lib, s.code, s.msg,
        s.call, s.file, s.line,
        sticky ? "; this error is sticky: the CUDA context of this process is corrupted and "
                 "every later CUDA call will fail; the process must be restarted" : "");
    if (msg == NULL) {
        return -1;
    }
    PyObject *exc = PyObject_CallOneArg(type, msg);
    Py_DECREF(msg);
    if (exc == NULL) {
        return -1;
    }
    PyObject *code = PyLong_FromLong(s.code);
    if (code == NULL || PyObject_SetAttrString(exc, "status", code) < 0) {
        Py_XDECREF(code);
        Py_DECREF(exc);
        return -1;
    }
    Py_DECREF(code);
    PyErr_SetObject(type, exc);
    Py_DECREF(exc);
    return -1;
}
