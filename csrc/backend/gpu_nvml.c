/* gpu_nvml.c - the number of CUDA devices from NVML, without initialising
 * the CUDA driver (a child forked after cuInit cannot use CUDA, even if the
 * parent never made a context). PyTorch counts the same way
 * (_device_count_nvml). Pure C over dlopen: no CUDA header, no Python.
 *
 * NVML counts physical GPUs; the CUDA runtime enumerates what the process
 * may use, and on a GPU in MIG mode that is its MIG instances (one per
 * process unless CUDA_VISIBLE_DEVICES lists more), not the GPU. So NVML's
 * count is used only when no GPU has MIG mode enabled; otherwise, or when
 * NVML cannot tell, the caller asks the runtime (cudaGetDeviceCount).
 */
#include "cuda_api.h"

#include <dlfcn.h>
#include <limits.h>
#include <stddef.h>

/* nvml.h's ABI, written here so the build needs no NVML header. */
enum { NVML_OK = 0, NVML_NOT_SUPPORTED = 3, NVML_FUNCTION_NOT_FOUND = 13 };
enum { NVML_MIG_ENABLED = 1 };
typedef struct nvml_device *nvml_device_t;

typedef struct {
    int (*init)(void);
    int (*shutdown)(void);
    int (*count)(unsigned *);
    int (*handle)(unsigned, nvml_device_t *);
    int (*mig_mode)(nvml_device_t, unsigned *, unsigned *);   /* NULL: NVML before MIG */
} nvml_fns;

static int bind_nvml(void *h, nvml_fns *f)
{
    *(void **)&f->init = dlsym(h, "nvmlInit_v2");
    *(void **)&f->shutdown = dlsym(h, "nvmlShutdown");
    *(void **)&f->count = dlsym(h, "nvmlDeviceGetCount_v2");
    *(void **)&f->handle = dlsym(h, "nvmlDeviceGetHandleByIndex_v2");
    *(void **)&f->mig_mode = dlsym(h, "nvmlDeviceGetMigMode");
    return f->init != NULL && f->shutdown != NULL && f->count != NULL && f->handle != NULL;
}

/* 1 when GPU i has MIG mode on, 0 when off or not supported, -1 unknown. */
static int mig_enabled(const nvml_fns *f, unsigned i)
{
    nvml_device_t dev = NULL;
    unsigned current = 0, pending = 0;
    if (f->mig_mode == NULL)
        return 0;   /* an NVML older than MIG: a driver without it */
    if (f->handle(i, &dev) != NVML_OK)
        return -1;
    int rc = f->mig_mode(dev, &current, &pending);
    if (rc == NVML_NOT_SUPPORTED || rc == NVML_FUNCTION_NOT_FOUND)
        return 0;
    return rc == NVML_OK ? current == NVML_MIG_ENABLED : -1;
}

/* The GPUs NVML counts when none is in MIG mode, else -1. */
static int count_without_mig(const nvml_fns *f)
{
    unsigned c = 0;
    if (f->count(&c) != NVML_OK || c > INT_MAX)
        return -1;
    for (unsigned i = 0; i < c; i++) {
        if (mig_enabled(f, i) != 0)
            return -1;
    }
    return (int)c;
}

int dpc_nvml_device_count(const char *library)
{
    void *h = dlopen(library, RTLD_NOW | RTLD_LOCAL);
    if (h == NULL)
        return -1;
    nvml_fns f;
    int n = -1;
    if (bind_nvml(h, &f) && f.init() == NVML_OK) {
        n = count_without_mig(&f);
        (void)f.shutdown();
    }
    dlclose(h);
    return n;
}
