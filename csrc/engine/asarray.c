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
"asarray(obj, device=None)\n"
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
"Rule source: torch.as_tensor(obj, device=device) (a copy only when needed).\n"
"Raises TypeError (not an array, object dtype, MaskedArray/matrix), ValueError\n"
"(ragged nested lists: 'obj: ...', bad device).");

static PyObject *py_asarray(PyObject *m, PyObject *args, PyObject *kw)
{
    static char *kwlist[] = {"obj", "device", "pin_memory", NULL};
    PyObject *obj, *dev_obj = Py_None, *result = NULL;
    dp_state *st = dp_state_from_module(m);
    dp_device dev;
    job_list jobs = {0};
    int pin = 0;

    if (!PyArg_ParseTupleAndKeywords(args, kw, "O|Op:asarray", kwlist, &obj, &dev_obj, &pin)) {
        return NULL;
    }
    PyArrayObject *arr;
    if (!PyArray_Check(obj) &&
        (PyList_Check(obj) || PyTuple_Check(obj) || PyNumber_Check(obj))) {
        /* Nested lists and Python numbers, as numpy.asarray takes them. */
        arr = (PyArrayObject *)PyArray_FromAny(obj, NULL, 0, 0, 0, NULL);
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
    } else {
        arr = dp_as_array(st, obj, "obj", 0);
    }
    if (arr == NULL) {
        return NULL;
    }
    if (pin) {
        /* a copy in page-locked host memory (direct DMA to and from GPUs) */
        if (dev_obj != Py_None &&
            (dp_device_from_object(st, dev_obj, "device", DP_DEV_ALLOW_HOST, &dev) < 0 ||
             dev.kind != DP_HOST)) {
            if (!PyErr_Occurred()) {
                PyErr_SetString(PyExc_ValueError,
                                "pin_memory: only host memory ('cpu') can be pinned");
            }
            goto done;
        }
        PyObject *buf = dp_buffer_new_pinned(st, (size_t)PyArray_NBYTES(arr));
        if (buf == NULL) {
            goto done;
        }
        PyArray_Descr *descr = PyArray_DESCR(arr);
        Py_INCREF(descr);
        result = PyArray_NewFromDescr(&PyArray_Type, descr, PyArray_NDIM(arr),
                                      PyArray_SHAPE(arr), NULL, ((dp_BufferObject *)buf)->ptr,
                                      NPY_ARRAY_WRITEABLE | NPY_ARRAY_ALIGNED, NULL);
        if (result == NULL) {
            Py_DECREF(buf);
            goto done;
        }
        if (PyArray_SetBaseObject((PyArrayObject *)result, buf) < 0) {
            Py_CLEAR(result);
            goto done;
        }
        dp_device host = {DP_HOST, -1};
        if (jobs_add(&jobs, PyArray_NDIM(arr), PyArray_SHAPE(arr), (size_t)PyArray_ITEMSIZE(arr),
                     PyArray_BYTES((PyArrayObject *)result),
                     PyArray_STRIDES((PyArrayObject *)result), PyArray_BYTES(arr),
                     PyArray_STRIDES(arr), exec_device(dp_array_device(st, arr), host)) < 0 ||
            jobs_run(&jobs) < 0) {
            Py_CLEAR(result);
        }
        goto done;
    }
    if (dev_obj == Py_None) {
        if (PyObject_TypeCheck(obj, st->ArrayType)) {
            Py_DECREF(arr);
            return Py_NewRef(obj);
        }
        return dp_export(st, (PyObject *)arr); /* a GPU import becomes a dpmini.Array */
    }
    if (dp_device_from_object(st, dev_obj, "device", DP_DEV_ALLOW_HOST, &dev) < 0) {
        goto done;
    }
    if (dp_device_eq(dp_array_device(st, arr), dev)) {
        if (PyObject_TypeCheck(obj, st->ArrayType)) {
            result = Py_NewRef(obj);
        } else {
            Py_INCREF(arr);
            result = dp_export(st, (PyObject *)arr);
        }
        goto done;
    }
    result = copy_to(st, &jobs, arr, dev);
    if (result != NULL && jobs_run(&jobs) < 0) {
        Py_CLEAR(result);
    }
    result = dp_export(st, result);
done:
    jobs_free(&jobs);
    Py_DECREF(arr);
    return result;
}

PyMethodDef dp_comm_methods[] = {
    {"asarray", (PyCFunction)(void (*)(void))py_asarray, METH_VARARGS | METH_KEYWORDS,
     asarray_doc},
    {NULL},
};
