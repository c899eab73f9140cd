/* array_module.c - module functions around dpmini.Array: from_dlpack,
 * empty, cuda_build_info, _gpu_at_exit; dp_array_methods. (The tests' hooks
 * into the GPU layer are dpmini._testing's: py/test_hooks.c.)
 */
#include "dpmini.h"
#include "dlpack.h"
#include "gpu.h"
#include "array.h"

#include <string.h>

/* ------------------------------------------------------------------ */
/* Module functions                                                    */
/* ------------------------------------------------------------------ */

PyDoc_STRVAR(from_dlpack_doc,
"from_dlpack(obj, /)\n--\n\n"
"Returns a dpmini.Array (CUDA memory) or a numpy.ndarray (host memory).\n"
"Import obj without a copy through DLPack (or the CUDA Array Interface): CUDA memory\n"
"becomes a dpmini.Array that keeps obj's memory alive; host memory becomes a\n"
"numpy.ndarray (numpy.from_dlpack). Raises TypeError (not a DLPack/CAI object),\n"
"BufferError (dtype or device dpmini cannot hold).");

static PyObject *py_from_dlpack(PyObject *m, PyObject *obj)
{
    dp_state *st = dp_state_from_module(m);
    int type, id;
    if (PyObject_TypeCheck(obj, st->ArrayType)) {
        return Py_NewRef(obj);
    }
    if (dlpack_device(obj, &type, &id) == 0 && (type == kDLCPU || type == kDLCUDAHost)) {
        PyObject *np = PyImport_ImportModule("numpy");
        PyObject *r = np ? PyObject_CallMethod(np, "from_dlpack", "O", obj) : NULL;
        Py_XDECREF(np);
        return r;
    }
    PyArrayObject *meta = dp_device_object_meta(st, obj, "obj");
    return meta ? dp_export(st, (PyObject *)meta) : NULL;
}

PyDoc_STRVAR(empty_doc,
"empty(shape, dtype=None, device='cpu', pin_memory=False)\n--\n\n"
"An uninitialised array (dtype None means float64): on a CUDA device a dpmini.Array; on the host a\n"
"numpy.ndarray, in page-locked (pinned) memory when pin_memory=True (needs CUDA),\n"
"so host<->GPU copies of it are direct DMA with no staging.\n"
"shape: an int (a 1-dim array of that many elements) or a tuple of ints, each >= 0, in\n"
"elements (not bytes), as numpy.empty; () is a 0-dim array. C-contiguous.\n"
"dtype: anything numpy.dtype accepts except object. device: 'cpu' (the host), 'cpu:N' (a\n"
"numpy.ndarray in that virtual device's memory), 'cuda:N', an int N or a dpmini.Device.\n"
"Raises ValueError (a negative size, a bad device), TypeError (a shape that is not an\n"
"int or a tuple of ints, an object or unknown dtype), MemoryError, dpmini.CudaError.");

static PyObject *py_empty(PyObject *m, PyObject *args, PyObject *kw)
{
    static char *kwlist[] = {"shape", "dtype", "device", "pin_memory", NULL};
    PyObject *shape_obj, *dtype_obj = Py_None, *dev_obj = NULL;
    int pin = 0;
    PyArray_Dims shape = {NULL, 0};
    PyArray_Descr *descr = NULL;
    dp_state *st = dp_state_from_module(m);
    dp_device dev = {DP_HOST, -1};
    PyObject *res = NULL;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "O|OOp:empty", kwlist, &shape_obj, &dtype_obj,
                                     &dev_obj, &pin)) {
        return NULL;
    }
    if (!PyArray_IntpConverter(shape_obj, &shape)) {
        return NULL;
    }
    if (!PyArray_DescrConverter(dtype_obj, &descr)) {
        goto done;
    }
    if (PyDataType_REFCHK(descr)) {
        PyErr_SetString(PyExc_TypeError, "dtype: object dtypes are not supported");
        goto done;
    }
    if (dev_obj != NULL && dev_obj != Py_None &&
        dp_device_from_object(st, dev_obj, "device", DP_DEV_ALLOW_HOST, &dev) < 0) {
        goto done;
    }
    if (pin && dev.kind != DP_HOST) {
        PyErr_SetString(PyExc_ValueError, "pin_memory: only host memory ('cpu') can be pinned");
        goto done;
    }
    if (!pin) {
        Py_INCREF(descr);
        res = dp_export(st, (PyObject *)dp_empty(st, dev, descr, shape.len, shape.ptr, NULL));
        goto done;
    }
    size_t nbytes = (size_t)PyDataType_ELSIZE(descr);
    for (int i = 0; i < shape.len; i++) {
        if (shape.ptr[i] < 0) {
            PyErr_SetString(PyExc_ValueError, "shape: negative dimensions are not allowed");
            goto done;
        }
        nbytes *= (size_t)shape.ptr[i];
    }
    PyObject *buf = dp_buffer_new_pinned(st, nbytes);
    if (buf == NULL) {
        goto done;
    }
    Py_INCREF(descr);
    res = PyArray_NewFromDescr(&PyArray_Type, descr, shape.len, shape.ptr, NULL,
                               ((dp_BufferObject *)buf)->ptr,
                               NPY_ARRAY_WRITEABLE | NPY_ARRAY_ALIGNED, NULL);
    if (res == NULL || PyArray_SetBaseObject((PyArrayObject *)res, buf) < 0) {
        if (res == NULL) {
            Py_DECREF(buf);
        }
        Py_CLEAR(res);
    }
done:
    Py_XDECREF(descr);
    PyDimMem_FREE(shape.ptr);
    return res;
}

static PyObject *py_cuda_build_info(PyObject *m, PyObject *unused)
{
    int rt = 0, drv = 0;
    dpc_versions(&rt, &drv);
    const char *nccl = dp_nccl_describe();
    char why[512] = "";
    (void)dp_cuda_unusable(why, sizeof why);
    return Py_BuildValue("{s:s,s:i,s:i,s:i,s:s,s:i,s:s}", "backend", dpc_backend(),
                         "runtime_version", rt, "driver_version", drv, "device_count",
                         dpc_device_count(), "nccl", nccl, "2d_min_run_default",
                         DP_2D_MIN_RUN_DEFAULT, "cuda_unusable", why);
}

/* Registered with atexit by dpmini/__init__.py: NCCL communicators hold
 * threads, sockets and GPU memory until destroyed. */
static PyObject *py_gpu_at_exit(PyObject *m, PyObject *unused)
{
    Py_BEGIN_ALLOW_THREADS /* ncclCommDestroy waits for the communicators */
    dp_nccl_shutdown();
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

PyMethodDef dp_array_methods[] = {
    {"_gpu_at_exit", py_gpu_at_exit, METH_NOARGS,
     "Private (dpmini/__init__.py registers it with atexit): destroy the cached NCCL "
     "communicators."},
    {"from_dlpack", py_from_dlpack, METH_O, from_dlpack_doc},
    {"empty", (PyCFunction)(void (*)(void))py_empty, METH_VARARGS | METH_KEYWORDS, empty_doc},
    {"cuda_build_info", py_cuda_build_info, METH_NOARGS,
     "cuda_build_info()\n--\n\nReturns a dict: backend ('cuda', 'emulated' or 'none'), CUDA runtime and "
     "driver versions (1000*major + 10*minor; 0 unknown), device_count, nccl (version and "
     "path once loaded, else why not), the 2D-copy run threshold, cuda_unusable (why CUDA cannot be "
     "used although a driver is installed, e.g. a driver older than the runtime; '' otherwise)."},
    {NULL},
};
