/* gpu_driver.c - why CUDA is unusable, when it is, in words.
 *
 * dpmini links the CUDA runtime statically, so `import dpmini` works on any
 * machine; cudaGetDeviceCount then fails without a driver (device_count()
 * is 0: virtual CPU devices are the default, as they should be) but also
 * with a driver older than the runtime needs (cudaErrorInsufficientDriver
 * with a driver version > 0). The second is a broken GPU setup, not a
 * CPU-only machine: it must not silently fall back to the CPU. So the
 * default device list warns, a CUDA device request raises with the reason,
 * and `python -m dpmini info` / cuda_build_info() show it.
 */
#include "gpu.h"

#include <stdio.h>

int dp_cuda_unusable(char *buf, size_t size)
{
    const char *msg;
    int err = dpc_device_error(&msg);
    int rt = 0, drv = 0;
    dpc_versions(&rt, &drv);
    if (err == 0 || dpc_device_count() > 0 || (err == 35 && drv == 0) || err == 100) {
        return 0; /* fine, or no driver / no GPU at all: a CPU-only machine */
    }
    if (err == 35) {
        snprintf(buf, size, "the NVIDIA driver (CUDA %d.%d) is older than the CUDA runtime "
                 "dpmini was built with (%d.%d): cudaGetDeviceCount failed with error 35 (%s); "
                 "update the driver or build dpmini with an older CUDA toolkit",
                 drv / 1000, drv % 1000 / 10, rt / 1000, rt % 1000 / 10, msg);
    } else {
        snprintf(buf, size, "cudaGetDeviceCount failed with CUDA error %d (%s); driver CUDA "
                 "%d.%d, runtime %d.%d", err, msg, drv / 1000, drv % 1000 / 10, rt / 1000,
                 rt % 1000 / 10);
    }
    return 1;
}
