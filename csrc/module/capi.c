/* capi.c - the C API capsule dpmini._dpmini lends dpmini._dist
 * (core/capi.h): the NCCL launch lock, the library search and the NCCL
 * table, so that the process has one of each whichever extension calls. */
#include "dpmini.h"
#include "capi.h"
#include "gpu.h"

static const dp_capi capi = {
    DP_CAPI_VERSION,
    dp_launch_begin,
    dp_launch_end,
    dp_find_library,
    dp_nccl_lib_load,
};

int dp_capi_add(PyObject *m)
{
    PyObject *cap = PyCapsule_New((void *)&capi, DP_CAPI_NAME, NULL);
    if (cap == NULL) {
        return -1;
    }
    int rc = PyModule_AddObjectRef(m, "_C_API", cap);
    Py_DECREF(cap);
    return rc;
}
