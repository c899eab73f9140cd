/* capi.h - what dpmini._dpmini lends dpmini._dist through a capsule
 * (dpmini._dpmini._C_API, as NumPy's _ARRAY_API): the process-wide lock
 * that keeps device-synchronising CUDA calls out of NCCL launches, and the
 * one search for NCCL and the CUDA runtime. One copy of each in the
 * process, whichever extension calls. Plain C: the capsule holds a pointer
 * to a static dp_capi of _dpmini, valid while the process lives.
 */
#ifndef DPMINI_CAPI_H
#define DPMINI_CAPI_H

#include <stddef.h>

#define DP_CAPI_NAME "dpmini._dpmini._C_API"
#define DP_CAPI_VERSION 1

/* Where a shared library is looked for, in this order: a library of these
 * sonames already loaded in the process (when `share`: the array library's
 * CUDA runtime, so that both share one current device), the full path in
 * $env, <sys.path entry>/<wheel>/<soname> (pip's nvidia-* wheels),
 * $CUDA_HOME/lib64, /usr/local/cuda/lib64, then the loader's path. */
typedef struct {
    const char *env;
    const char *wheel;
    const char *const *names;   /* sonames, most wanted first, NULL-ended */
    int share;
    char tried[512];            /* what failed, for the error message */
} dp_lib_search;

typedef struct {
    unsigned version;           /* DP_CAPI_VERSION */
    /* An NCCL launch (group end, communicator set-up): exclusive of
     * cudaMalloc / cudaFree / cudaDeviceSynchronize in every thread. Call
     * without the GIL; never nested. */
    void (*launch_begin)(void);
    void (*launch_end)(void);
    /* dlopen of the first match (RTLD_NOW | RTLD_LOCAL), its path in
     * `found`; NULL when none (s->tried says why). With the GIL held (it
     * reads sys.path). */
    void *(*find_library)(dp_lib_search *s, char *found, size_t found_len);
} dp_capi;

#endif
