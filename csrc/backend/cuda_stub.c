/* cuda_stub.c - cuda_api.h for a build with neither CUDA (cuda/runtime.cu)
 * nor the emulator: no device; every call fails with a clear status. */
#if !defined(DPMINI_HAVE_CUDA) && !defined(DPMINI_CUDA_EMULATE)

#include "cuda_api.h"

#define NO_CUDA(call)                                                           \
    dpc_fail(DPC_LIB_DPMINI, 1, 0, -1, call, __FILE__, __LINE__,                \
             "dpmini was built without CUDA")

int dpc_device_count(void) { return 0; }
const char *dpc_backend(void) { return "none"; }
int dpc_device_error(const char **msg) { *msg = "no error"; return 0; }
void dpc_versions(int *runtime, int *driver) { *runtime = 0; *driver = 0; }
dpc_status dpc_set_device(int dev) { (void)dev; return NO_CUDA("cudaSetDevice"); }
dpc_status dpc_enable_peer(int dev, int peer, int *on)
{
    (void)dev; (void)peer; *on = 0;
    return NO_CUDA("cudaDeviceEnablePeerAccess");
}
dpc_status dpc_guard_enter(int dev, dpc_device_guard *g)
{
    (void)dev; g->prev = -1; g->switched = 0; g->ctx = NULL;
    return NO_CUDA("cudaSetDevice");
}
void dpc_guard_leave(dpc_device_guard *g) { (void)g; }
int dpc_current_device(void) { return -1; }
size_t dpc_max_pitch(int dev) { (void)dev; return 0; }
dpc_status dpc_device_sync(int dev) { (void)dev; return NO_CUDA("cudaDeviceSynchronize"); }
dpc_status dpc_malloc(int dev, size_t n, void **out)
{
    (void)dev; (void)n; *out = NULL;
    return NO_CUDA("cudaMalloc");
}
dpc_status dpc_free(int dev, void *p) { (void)dev; (void)p; return NO_CUDA("cudaFree"); }
dpc_status dpc_host_alloc(int dev, size_t n, void **out)
{
    (void)dev; (void)n; *out = NULL;
    return NO_CUDA("cudaHostAlloc");
}
dpc_status dpc_host_free(int dev, void *p) { (void)dev; (void)p; return NO_CUDA("cudaFreeHost"); }
int dpc_initialised(void) { return 0; }
int dpc_is_pinned(int dev, const void *p) { (void)dev; (void)p; return 0; }
int dpc_is_device_ptr(const void *p, int *dev) { (void)p; (void)dev; return 0; }
dpc_status dpc_stream_get(int dev, int slot, dpc_stream *out)
{
    (void)dev; (void)slot; *out = NULL;
    return NO_CUDA("cudaStreamCreate");
}
dpc_status dpc_stream_query(int dev, dpc_stream s, int *done)
{
    (void)dev; (void)s; *done = 1;
    return NO_CUDA("cudaStreamQuery");
}
dpc_status dpc_stream_sync(int dev, dpc_stream s) { (void)dev; (void)s; return NO_CUDA("cudaStreamSynchronize"); }
dpc_status dpc_memcpy_async(int dev, void *d, const void *s, size_t n, int k, dpc_stream st)
{
    (void)dev; (void)d; (void)s; (void)n; (void)k; (void)st;
    return NO_CUDA("cudaMemcpyAsync");
}
dpc_status dpc_memcpy2d_async(int dev, void *d, size_t dp, const void *s, size_t sp, size_t w,
                              size_t h, int k, dpc_stream st)
{
    (void)dev; (void)d; (void)dp; (void)s; (void)sp; (void)w; (void)h; (void)k; (void)st;
    return NO_CUDA("cudaMemcpy2DAsync");
}
dpc_status dpc_memcpy_peer_async(void *d, int dd, const void *s, int sd, size_t n, dpc_stream st)
{
    (void)d; (void)dd; (void)s; (void)sd; (void)n; (void)st;
    return NO_CUDA("cudaMemcpyPeerAsync");
}
dpc_status dpc_launch_strided_copy(int dev, const dpc_kdesc *k, void *d, const void *s,
                                   dpc_stream st)
{
    (void)dev; (void)k; (void)d; (void)s; (void)st;
    return NO_CUDA("dp_strided_copy_kernel");
}
dpc_status dpc_launch_add(int dev, int t, void *a, const void *x, int64_t n, dpc_stream st)
{
    (void)dev; (void)t; (void)a; (void)x; (void)n; (void)st;
    return NO_CUDA("dp_add_kernel");
}

#endif
