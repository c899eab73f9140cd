/* gpu_debug.c - private hooks into the CUDA emulator for the tests of
 * tests/test_gpu_emulated_hardware.py (not API). In a real CUDA build, or
 * one without CUDA, every hook raises RuntimeError.
 *
 *   _emu_stats()                 {"bad_stream_handles", "freed_while_queued",
 *                                 "nccl_crossed", "syncs_with_gil" (counted
 *                                 from the first _emu_stats() call on),
 *                                 "launch_overlaps" (device calls during an
 *                                 NCCL launch of another thread)}
 *   _emu_fail_stream_get(slot)   the next stream request of that slot fails
 *   _emu_nopeer_alloc(dev, data) device memory that peer access does not
 *                                cover (VMM / async pool / IPC), filled with
 *                                the bytes of `data`; returns its address
 *   _emu_free(dev, ptr)          frees such memory
 *   _emu_nccl_hang(mode)         the next NCCL collective never finishes
 *   _emu_contexts()              devices whose (emulated) CUDA context exists
 *   _emu_queue(dev, stream, ptr, nbytes)
 *                                another library's kernel queued on `stream`
 *                                (any handle) touching [ptr, ptr + nbytes):
 *                                recorded until that stream or dev is synced
 *   _emu_busy(ptr, nbytes)       whether queued work still touches the range
 *   _emu_destroy_stream(stream)  another library destroyed that stream handle
 */
#include "dpmini.h"
#include "gpu.h"

#ifdef DPMINI_CUDA_EMULATE

static long syncs_with_gil;

/* Called by the emulator at every sync, on the syncing thread. */
static void count_gil_syncs(void)
{
    if (PyGILState_Check()) {
        __atomic_add_fetch(&syncs_with_gil, 1, __ATOMIC_RELAXED);
    }
}

static PyObject *py_emu_stats(PyObject *m, PyObject *unused)
{
    long bad, busy;
    dpc_emu_set_sync_hook(count_gil_syncs); /* counted from the first call on */
    dpc_emu_stats(&bad, &busy);
    return Py_BuildValue("{s:l,s:l,s:l,s:l,s:l}", "bad_stream_handles", bad, "freed_while_queued",
                         busy, "nccl_crossed", dp_nccl_crossed(), "syncs_with_gil",
                         __atomic_load_n(&syncs_with_gil, __ATOMIC_RELAXED), "launch_overlaps",
                         dpc_emu_launch_overlaps());
}

static PyObject *py_emu_nccl_hang(PyObject *m, PyObject *arg)
{
    long mode = PyLong_AsLong(arg);
    if (mode == -1 && PyErr_Occurred()) {
        return NULL;
    }
    dp_nccl_emulate_hang((int)mode);
    Py_RETURN_NONE;
}

static PyObject *py_emu_fail_stream_get(PyObject *m, PyObject *arg)
{
    long slot = PyLong_AsLong(arg);
    if (slot == -1 && PyErr_Occurred()) {
        return NULL;
    }
    dpc_emu_fail_stream_get((int)slot);
    Py_RETURN_NONE;
}

static PyObject *py_emu_nopeer_alloc(PyObject *m, PyObject *args)
{
    int dev;
    Py_buffer b;
    void *p = NULL;
    if (!PyArg_ParseTuple(args, "iy*:_emu_nopeer_alloc", &dev, &b)) {
        return NULL;
    }
    dpc_stream s = NULL;
    dpc_status st = dpc_emu_malloc_nopeer(dev, (size_t)b.len, &p);
    if (st.code == 0) {
        st = dpc_stream_get(dev, 0, &s);
    }
    if (st.code == 0) {
        st = dpc_memcpy_async(dev, p, b.buf, (size_t)b.len, DPC_H2D, s);
    }
    if (st.code == 0) {
        st = dpc_stream_sync(dev, s);
    }
    PyBuffer_Release(&b);
    if (st.code != 0) {
        if (p != NULL) {
            (void)dpc_free(dev, p);
        }
        return dp_gpu_raise(dp_state_from_module(m), st, "_emu_nopeer_alloc"), NULL;
    }
    return PyLong_FromVoidPtr(p);
}

static PyObject *py_emu_free(PyObject *m, PyObject *args)
{
    int dev;
    PyObject *ptr;
    if (!PyArg_ParseTuple(args, "iO:_emu_free", &dev, &ptr)) {
        return NULL;
    }
    void *p = PyLong_AsVoidPtr(ptr);
    if (p == NULL && PyErr_Occurred()) {
        return NULL;
    }
    dpc_status st = dpc_free(dev, p);
    if (st.code != 0) {
        return dp_gpu_raise(dp_state_from_module(m), st, "_emu_free"), NULL;
    }
    Py_RETURN_NONE;
}

static PyObject *py_emu_contexts(PyObject *m, PyObject *unused)
{
    int devs[64];
    int n = dpc_emu_contexts(devs, 64);
    PyObject *l = PyList_New(n);
    for (int i = 0; l != NULL && i < n; i++) {
        PyObject *v = PyLong_FromLong(devs[i]);
        if (v == NULL) {
            Py_CLEAR(l);
            break;
        }
        PyList_SET_ITEM(l, i, v);
    }
    return l;
}

/* (dev, stream, ptr, nbytes) or (ptr, nbytes): a device range as ints. */
static int range_arg(PyObject *ptr, Py_ssize_t n, void **p)
{
    *p = PyLong_AsVoidPtr(ptr);
    if (*p == NULL && PyErr_Occurred()) {
        return -1;
    }
    if (n < 0) {
        PyErr_SetString(PyExc_ValueError, "nbytes must be >= 0");
        return -1;
    }
    return 0;
}

static PyObject *py_emu_queue(PyObject *m, PyObject *args)
{
    int dev;
    PyObject *stream, *ptr;
    Py_ssize_t n;
    void *p, *s;
    if (!PyArg_ParseTuple(args, "iOOn:_emu_queue", &dev, &stream, &ptr, &n) ||
        range_arg(ptr, n, &p) < 0) {
        return NULL;
    }
    s = PyLong_AsVoidPtr(stream);
    if (s == NULL && PyErr_Occurred()) {
        return NULL;
    }
    dpc_emu_queue(dev, s, p, (size_t)n);
    Py_RETURN_NONE;
}

static PyObject *py_emu_busy(PyObject *m, PyObject *args)
{
    PyObject *ptr;
    Py_ssize_t n;
    void *p;
    if (!PyArg_ParseTuple(args, "On:_emu_busy", &ptr, &n) || range_arg(ptr, n, &p) < 0) {
        return NULL;
    }
    return PyBool_FromLong(dpc_emu_busy(p, (size_t)n));
}

static PyObject *py_emu_destroy_stream(PyObject *m, PyObject *arg)
{
    void *s = PyLong_AsVoidPtr(arg);
    if (s == NULL && PyErr_Occurred()) {
        return NULL;
    }
    dpc_emu_destroy_stream(s);
    Py_RETURN_NONE;
}

#else

static PyObject *not_emulated(void)
{
    PyErr_SetString(PyExc_RuntimeError, "not an emulated build (DPMINI_CUDA_EMULATE=1)");
    return NULL;
}

static PyObject *py_emu_stats(PyObject *m, PyObject *unused) { return not_emulated(); }
static PyObject *py_emu_fail_stream_get(PyObject *m, PyObject *a) { return not_emulated(); }
static PyObject *py_emu_nopeer_alloc(PyObject *m, PyObject *a) { return not_emulated(); }
static PyObject *py_emu_free(PyObject *m, PyObject *a) { return not_emulated(); }
static PyObject *py_emu_nccl_hang(PyObject *m, PyObject *a) { return not_emulated(); }
static PyObject *py_emu_contexts(PyObject *m, PyObject *unused) { return not_emulated(); }
static PyObject *py_emu_queue(PyObject *m, PyObject *a) { return not_emulated(); }
static PyObject *py_emu_busy(PyObject *m, PyObject *a) { return not_emulated(); }
static PyObject *py_emu_destroy_stream(PyObject *m, PyObject *a) { return not_emulated(); }

#endif

PyMethodDef dp_gpu_debug_methods[] = {
    {"_emu_stats", py_emu_stats, METH_NOARGS,
     "Private (tests, emulated builds): uses of poisoned stream handles, blocks cached while "
     "queued work touched them."},
    {"_emu_fail_stream_get", py_emu_fail_stream_get, METH_O,
     "Private (tests, emulated builds): the next stream request of this slot fails."},
    {"_emu_nopeer_alloc", py_emu_nopeer_alloc, METH_VARARGS,
     "Private (tests, emulated builds): _emu_nopeer_alloc(dev, data) -> address of device "
     "memory peer access does not cover, holding data's bytes."},
    {"_emu_nccl_hang", py_emu_nccl_hang, METH_O,
     "Private (tests, emulated builds): the next NCCL collective never finishes (1: with an "
     "asynchronous error, 2: silently)."},
    {"_emu_free", py_emu_free, METH_VARARGS,
     "Private (tests, emulated builds): _emu_free(dev, address)."},
    {"_emu_contexts", py_emu_contexts, METH_NOARGS,
     "Private (tests, emulated builds): sorted list of the devices whose CUDA context exists."},
    {"_emu_queue", py_emu_queue, METH_VARARGS,
     "Private (tests, emulated builds): _emu_queue(dev, stream, address, nbytes): another "
     "library's kernel on `stream` touching the range, pending until a sync."},
    {"_emu_busy", py_emu_busy, METH_VARARGS,
     "Private (tests, emulated builds): _emu_busy(address, nbytes) -> whether queued work "
     "still touches the range."},
    {"_emu_destroy_stream", py_emu_destroy_stream, METH_O,
     "Private (tests, emulated builds): _emu_destroy_stream(stream): another library "
     "destroyed that stream handle; later uses of it are counted as bad handles."},
    {NULL},
};
