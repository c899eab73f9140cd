/* gpu_fork.c - dpmini's GPU state in a forked child.
 *
 * CUDA cannot be used in a child forked after the parent initialised it:
 * the child inherits copies of the parent's contexts, streams, pinned
 * mappings and of the locks of dpmini's GPU layer (allocator caches,
 * staging, NCCL), some perhaps held by a parent thread that does not exist
 * in the child. A CUDA call there fails with an obscure error (3,
 * initialization error) or a lock waits forever. So a fork handler marks
 * such a child, and the GPU layer refuses work there with a message that
 * says why and what to do (PyTorch refuses the same way: "Cannot
 * re-initialize CUDA in forked subprocess"); blocks of the parent that the
 * child frees are left alone (the parent still owns that memory). Virtual
 * CPU devices are unaffected. A parent that never initialised CUDA leaves
 * its child free to use it.
 *
 * The handler is installed when the extension is loaded (a constructor), so
 * a fork at any later point is seen. No Python here.
 */
#include "gpu_fork.h"

#include <pthread.h>

static int forked; /* written only in the child, before it has threads */

static void fork_child(void)
{
    if (dpc_initialised()) {
        forked = 1;
    }
}

__attribute__((constructor)) static void install_fork_handler(void)
{
    (void)pthread_atfork(NULL, NULL, fork_child);
}

int dp_gpu_forked(void)
{
    return forked;
}

dpc_status dp_gpu_forked_status(int dev)
{
    return dpc_fail(DPC_LIB_DPMINI, DPC_DPMINI_FORKED, 0, dev, "fork()", __FILE__, __LINE__,
                    "this process was forked after its parent initialised CUDA, and a forked "
                    "child cannot use CUDA (its copy of the parent's CUDA state is unusable); "
                    "start worker processes with the 'spawn' (or 'forkserver') start method, "
                    "e.g. multiprocessing.get_context('spawn'), or use the GPU only in the "
                    "children");
}
