/* device_module.c - device counts (CUDA devices, virtual CPU devices and
 * $DPMINI_CPU_DEVICES, the default device list) and the module functions
 * over devices (device_count, cpu_device_count, device_of), with the
 * table dp_device_methods, which also lists host_memory.c's functions.
 */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE 1 /* the same spelling as pyconfig.h, which may define it too */
#endif
#include "dpmini.h"
#include "gpu.h"
#include "env.h"

#include <errno.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#ifdef __GLIBC__
#include <malloc.h>
#endif

#include "alloc.h"
#include "host_memory.h"
#include "pool.h"
/* ------------------------------------------------------------------ */
/* Device counts                                                       */
/* ------------------------------------------------------------------ */

int dp_cuda_device_count(void)
{
    return dpc_device_count(); /* 0 without a GPU, a driver or a CUDA build */
}

int dp_cpu_device_count(void)
{
    unsigned long long v;
    if (dp_env_uint("DPMINI_CPU_DEVICES", 1, DP_POOL_MAX_INDEX, &v) == DP_ENV_OK) {
        return (int)v;   /* env.h's rule, as for every DPMINI_ number */
    }
    int n = dp_pool_cores();
    return n < 2 ? 2 : (n > DP_POOL_MAX_INDEX ? DP_POOL_MAX_INDEX : n);
}

/* dp_cpu_device_count, warning RuntimeWarning when $DPMINI_CPU_DEVICES is
 * set but not an int in 1..DP_POOL_MAX_INDEX (GIL held). -1 if the warning
 * raised (warnings turned into errors). */
static int cpu_device_count_checked(int *out)
{
    int n = dp_cpu_device_count();
    unsigned long long v;
    if (dp_env_uint("DPMINI_CPU_DEVICES", 1, DP_POOL_MAX_INDEX, &v) == DP_ENV_INVALID) {
        if (PyErr_WarnFormat(PyExc_RuntimeWarning, 1,
                             "DPMINI_CPU_DEVICES=%.50s is not an int in 1..%d; using %d "
                             "virtual CPU devices (the usable cores, at least 2) instead",
                             getenv("DPMINI_CPU_DEVICES"), DP_POOL_MAX_INDEX, n) < 0) {
            return -1;
        }
    }
    *out = n;
    return 0;
}

int dp_default_devices(dp_state *st, dp_device **out, Py_ssize_t *n)
{
    int ncuda = dp_cuda_device_count();
    int count = ncuda;
    char why[512];
    if (ncuda <= 0 && dp_cuda_unusable(why, sizeof why) &&
        PyErr_WarnFormat(PyExc_RuntimeWarning, 1, "CUDA is unusable, so the default devices "
                         "are virtual CPU devices: %s", why) < 0) {
        return -1;
    }
    if (ncuda <= 0 && cpu_device_count_checked(&count) < 0) {
        return -1;
    }
    dp_device *devs = PyMem_Malloc(sizeof(dp_device) * (size_t)count);
    if (devs == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    for (int i = 0; i < count; i++) {
        devs[i].kind = ncuda > 0 ? DP_CUDA : DP_VCPU;
        devs[i].index = i;
    }
    *out = devs;
    *n = count;
    return 0;
}

/* ------------------------------------------------------------------ */
/* Module functions                                                    */
/* ------------------------------------------------------------------ */

static PyObject *py_device_count(PyObject *m, PyObject *unused)
{
    return PyLong_FromLong(dp_cuda_device_count());
}

static PyObject *py_cpu_device_count(PyObject *m, PyObject *unused)
{
    int n;
    if (cpu_device_count_checked(&n) < 0) {
        return NULL;
    }
    return PyLong_FromLong(n);
}

/* The device of a host array of another library (a torch CPU tensor, a
 * JAX array): where the memory its DLPack export hands over lives (a shard
 * dpmini made on cpu:1 is on cpu:1, others on the host). A tensor that
 * requires grad is read detached (the same memory). */
static PyObject *foreign_device_of(dp_state *st, PyObject *arg)
{
    PyArrayObject *a = dp_import_foreign_detached(st, arg, "array");
    if (a == NULL) {
        return NULL;
    }
    dp_device d = dp_array_device(st, a);
    if (d.kind == DP_HOST) {
        (void)dp_vcpu_device_of_ptr(PyArray_DATA(a), &d);   /* a shard dpmini made */
    }
    Py_DECREF(a);
    return dp_device_to_object(st, d);
}

static PyObject *py_device_of(PyObject *m, PyObject *arg)
{
    dp_state *st = dp_state_from_module(m);
    if (!PyArray_Check(arg) && dp_is_device_object(st, arg)) {
        PyArrayObject *meta = dp_device_object_meta(st, arg, "array");
        if (meta == NULL) {
            return NULL;
        }
        PyObject *r = dp_device_to_object(st, dp_array_device(st, meta));
        Py_DECREF(meta);
        return r;
    }
    int foreign = PyArray_Check(arg) ? 0 : dp_is_foreign_array(st, arg);
    if (foreign < 0) {
        return NULL;
    }
    if (foreign) {
        return foreign_device_of(st, arg);
    }
    if (!PyArray_Check(arg)) {
        PyObject *tn = dp_type_name(arg);
        if (tn != NULL) {
            PyErr_Format(PyExc_TypeError, "array: expected a numpy.ndarray, a GPU array or an "
                         "array of another library (torch, JAX), got %U", tn);
            Py_DECREF(tn);
        }
        return NULL;
    }
    return dp_device_to_object(st, dp_array_device(st, (PyArrayObject *)arg));
}


PyMethodDef dp_device_methods[] = {
    {"device_count", py_device_count, METH_NOARGS,
     "device_count()\n--\n\nReturns an int: the number of CUDA devices dpmini can use (0 without a GPU, a "
     "driver, or a CUDA build). Never raises. Source: torch.cuda.device_count."},
    {"cpu_device_count", py_cpu_device_count, METH_NOARGS,
     "cpu_device_count()\n--\n\nReturns an int: the number of virtual CPU devices ('cpu:0'..) that "
     "DataParallel uses when device_ids is None and there is no GPU: $DPMINI_CPU_DEVICES "
     "when set (1..256), else the number of usable cores, at least 2. An invalid\n"
     "$DPMINI_CPU_DEVICES warns RuntimeWarning naming it and the count used instead."},
    {"device_of", py_device_of, METH_O,
     "device_of(array)\n--\n\nReturns a dpmini.Device: the device that owns an array's memory.\n"
     "A numpy.ndarray: the dpmini device for arrays dpmini allocated (and views of them),\n"
     "else the host ('cpu'). A GPU array: a dpmini.Array, or any object with\n"
     "__cuda_array_interface__ or a CUDA __dlpack_device__() (CuPy, PyTorch CUDA tensors,\n"
     "Numba): its CUDA device, e.g. Device('cuda:1'), read through the same zero-copy\n"
     "import dpmini uses for arguments (no data is copied). A host array of another\n"
     "library (a torch CPU tensor, a JAX array): the device of the memory it shares, so\n"
     "a shard that dpmini.scatter made on 'cpu:1' is on Device('cpu:1'), other tensors\n"
     "on the host ('cpu').\n"
     "Rule source: torch.Tensor.device (a view lives where its base's memory lives).\n"
     "Raises TypeError when array is none of these (a list, a NumPy scalar), naming its\n"
     "type by module and qualified name, and the producer's own error (or TypeError/BufferError naming\n"
     "'array') when a GPU object's protocol fails."},
    {"memory_allocated", py_memory_allocated, METH_O,
     "memory_allocated(device)\n--\n\nReturns an int: bytes (rounded to the allocator's block sizes) "
     "held by live dpmini arrays on a device ('cpu' counts dpmini's host allocations "
     "only). device: 'cpu' or -1 (the host), 'cpu:N', 'cuda:N', an int or a dpmini.Device.\n"
     "Errors: TypeError for a device of the wrong type (a float, a list); ValueError for\n"
     "an unknown spelling, a virtual device index outside 0..255, or a CUDA device that\n"
     "does not exist (the message says when dpmini sees no GPU at all).\n"
     "Source: torch.cuda.memory_allocated."},
    {"memory_reserved", py_memory_reserved, METH_O,
     "memory_reserved(device)\n--\n\nReturns an int: memory_allocated plus the bytes the caching "
     "allocator keeps for reuse on that device. device: as for memory_allocated.\n"
     "Errors: TypeError for a device of the wrong type; ValueError for an unknown spelling,\n"
     "an index out of range or a missing CUDA device. Source: torch.cuda.memory_reserved."},
    {"empty_cache", py_empty_cache, METH_NOARGS,
     "empty_cache()\n--\n\nReturn every cached block of every device (virtual CPU devices, the\n"
     "host's gathered outputs, CUDA devices) to the system; returns None. CUDA blocks that were\n"
     "exported to another library and wait for a device synchronisation before reuse are\n"
     "released first (one sync per device). Live arrays are not touched. Errors: none (takes\n"
     "no argument; TypeError if given one).\n"
     "Source: torch.cuda.empty_cache."},
    {NULL},
};
