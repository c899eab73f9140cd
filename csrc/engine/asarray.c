/* asarray.c - dpmini.asarray (torch.as_tensor's rule): obj as an ndarray
 * without a copy, or a copy on a device unless it already lives there; the
 * copy runs on the copy engine (copy_engine.h).
 */
#include "dpmini.h"
#include "copy_engine.h"
#include "engine.h"

/* ------------------------------------------------------------------ */
/* asarray                                                             */
/* ------------------------------------------------------------------ */

PyDoc_STRVAR(asarray_doc,
"asarray(obj, device=None, pin_memory=False)\n"
"--\n"
"\n"
"Returns an ndarray (on device when one is given).\n"
"obj as an ndarray without a copy, like numpy.asarray: an ndarray (subclasses other\n"
"than MaskedArray and matrix are accepted), a buffer-protocol object (bytes,\n"
"bytearray, memoryview, array.array: read through a memoryview, so bytes become a 1-D\n"
"uint8 array), an __array_interface__ / __array_struct__ object, a nested list or a\n"
"number; any shape, non-object dtype. With device ('cpu', 'cpu:N', a CUDA device or a\n"
"dpmini.Device), a copy on that device (from dpmini's caching allocator) unless obj\n"
"already lives there (then the array itself). Dense layouts keep their strides.\n"
"pin_memory: True gives a C-contiguous copy in page-locked host memory (GPUs copy to\n"
"and from it directly), always a copy; device must then be None or the host.\n"
"Rule source: torch.as_tensor(obj, device=device) (a copy only when needed);\n"
"pin_memory as torch.Tensor.pin_memory().\n"
"Raises TypeError (not an array, object dtype, MaskedArray/matrix), ValueError\n"
"(ragged nested lists: 'obj: ...', bad device, pin_memory with a GPU device).");

/* obj as an ndarray without a copy: nested lists and Python numbers as
 * numpy.asarray takes them (not of object dtype), anything else through
 * dp_as_array. New reference or NULL. */
static PyArrayObject *asarray_source(dp_state *st, PyObject *obj)
{
    if (PyArray_Check(obj) ||
        !(PyList_Check(obj) || PyTuple_Check(obj) || PyNumber_Check(obj))) {
        return dp_as_array(st, obj, "obj", 0);
    }
    PyArrayObject *arr = (PyArrayObject *)PyArray_FromAny(obj, NULL, 0, 0, 0, NULL);
    if (arr == NULL && PyErr_ExceptionMatches(PyExc_ValueError)) {
        /* e.g. ragged nested lists: say which argument */
        PyObject *t, *v, *tb;
        PyErr_Fetch(&t, &v, &tb);
        PyErr_NormalizeException(&t, &v, &tb);
        PyErr_Format(PyExc_ValueError, "obj: cannot make an array of this %.100s (%S)",
                     Py_TYPE(obj)->tp_name, v ? v : Py_None);
        Py_XDECREF(t);
        Py_XDECREF(v);
        Py_XDECREF(tb);
    }
    if (arr != NULL && PyDataType_REFCHK(PyArray_DESCR(arr))) {
        Py_CLEAR(arr);
        PyErr_Format(PyExc_TypeError, "obj: %.100s does not convert to a numeric array",
                     Py_TYPE(obj)->tp_name);
    }
    return arr;
}

/* pin_memory=True: a C-contiguous copy of arr in page-locked host memory
 * (direct DMA to and from GPUs); dev_obj must be None or the host. */
static PyObject *pinned_copy(dp_state *st, PyArrayObject *arr, PyObject *dev_obj)
{
    dp_device dev, host = {DP_HOST, -1};
    if (dev_obj != Py_None &&
        (dp_device_from_object(st, dev_obj, "device", DP_DEV_ALLOW_HOST, &dev) < 0 ||
         dev.kind != DP_HOST)) {
        if (!PyErr_Occurred()) {
            PyErr_SetString(PyExc_ValueError,
                            "pin_memory: only host memory ('cpu') can be pinned");
        }
        return NULL;
    }
    PyObject *buf = dp_buffer_new_pinned(st, (size_t)PyArray_NBYTES(arr));
    if (buf == NULL) {
        return NULL;
    }
    PyArray_Descr *descr = PyArray_DESCR(arr);
    Py_INCREF(descr);
    PyObject *result = PyArray_NewFromDescr(&PyArray_Type, descr, PyArray_NDIM(arr),
                                            PyArray_SHAPE(arr), NULL,
                                            ((dp_BufferObject *)buf)->ptr,
                                            NPY_ARRAY_WRITEABLE | NPY_ARRAY_ALIGNED, NULL);
    if (result == NULL) {
        Py_DECREF(buf);
        return NULL;
    }
    if (PyArray_SetBaseObject((PyArrayObject *)result, buf) < 0) {
        Py_DECREF(result);
        return NULL;
    }
    job_list jobs = {0};
    if (jobs_add_array(&jobs, (PyArrayObject *)result, arr,
                       exec_device(dp_array_device(st, arr), host)) < 0 ||
        jobs_run(&jobs) < 0) {
        Py_CLEAR(result);
    }
    jobs_free(&jobs);
    return result;
}

/* obj (arr as an ndarray) on the device dev_obj names: itself when it lives
 * there (a dpmini.Array as is), else a copy. A GPU array comes back as a
 * dpmini.Array. */
static PyObject *asarray_on(dp_state *st, PyObject *obj, PyArrayObject *arr,
                            PyObject *dev_obj)
{
    dp_device dev;
    if (dp_device_from_object(st, dev_obj, "device", DP_DEV_ALLOW_HOST, &dev) < 0) {
        return NULL;
    }
    if (dp_device_eq(dp_array_device(st, arr), dev)) {
        if (PyObject_TypeCheck(obj, st->ArrayType)) {
            return Py_NewRef(obj);
        }
        return dp_export(st, Py_NewRef((PyObject *)arr));
    }
    job_list jobs = {0};
    PyObject *result = copy_to(st, &jobs, arr, dev);
    if (result != NULL && jobs_run(&jobs) < 0) {
        Py_CLEAR(result);
    }
    jobs_free(&jobs);
    return dp_export(st, result);
}

static PyObject *py_asarray(PyObject *m, PyObject *args, PyObject *kw)
{
    static char *kwlist[] = {"obj", "device", "pin_memory", NULL};
    PyObject *obj, *dev_obj = Py_None, *result;
    dp_state *st = dp_state_from_module(m);
    int pin = 0;

    if (!PyArg_ParseTupleAndKeywords(args, kw, "O|Op:asarray", kwlist, &obj, &dev_obj, &pin)) {
        return NULL;
    }
    PyArrayObject *arr = asarray_source(st, obj);
    if (arr == NULL) {
        return NULL;
    }
    if (pin) {
        result = pinned_copy(st, arr, dev_obj);
    } else if (dev_obj != Py_None) {
        result = asarray_on(st, obj, arr, dev_obj);
    } else if (PyObject_TypeCheck(obj, st->ArrayType)) {
        result = Py_NewRef(obj);
    } else {
        return dp_export(st, (PyObject *)arr); /* a GPU import becomes a dpmini.Array */
    }
    Py_DECREF(arr);
    return result;
}

PyMethodDef dp_comm_methods[] = {
    {"asarray", (PyCFunction)(void (*)(void))py_asarray, METH_VARARGS | METH_KEYWORDS,
     asarray_doc},
    {NULL},
};
