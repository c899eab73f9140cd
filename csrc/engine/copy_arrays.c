/* copy_arrays.c - the engine functions' sequences of arrays
 * (arrays_from_sequence: each item imported through dp_as_array and named
 * "tensors[i]" in errors; arrays_free), declared in copy_engine.h.
 */
#include "dpmini.h"
#include "copy_engine.h"

#include <string.h>

/* Write "[i]" and a terminating NUL at buf (room for 23 bytes; i >= 0). */
static void index_suffix(char *buf, Py_ssize_t i)
{
    char digits[24];
    int n = 0;
    do {
        digits[n++] = (char)('0' + i % 10);
        i /= 10;
    } while (i > 0);
    *buf++ = '[';
    while (n > 0) {
        *buf++ = digits[--n];
    }
    *buf++ = ']';
    *buf = '\0';
}

int arrays_from_sequence(dp_state *st, PyObject *obj, const char *argname,
                         int min_ndim, PyArrayObject ***out, Py_ssize_t *n)
{
    if (PyArray_Check(obj) || PyUnicode_Check(obj)) {
        PyErr_Format(PyExc_TypeError, "%s: expected a sequence of arrays, got %.100s",
                     argname, Py_TYPE(obj)->tp_name);
        return -1;
    }
    PyObject *seq = PySequence_Fast(obj, "");
    if (seq == NULL) {
        if (PyErr_ExceptionMatches(PyExc_TypeError)) {
            PyErr_Format(PyExc_TypeError, "%s: expected a sequence of arrays, got %.100s",
                         argname, Py_TYPE(obj)->tp_name);
        }
        return -1;
    }
    Py_ssize_t len = PySequence_Fast_GET_SIZE(seq);
    PyArrayObject **arrs = PyMem_Calloc((size_t)(len ? len : 1), sizeof(PyArrayObject *));
    if (arrs == NULL) {
        Py_DECREF(seq);
        PyErr_NoMemory();
        return -1;
    }
    char name[96];
    size_t plen = strlen(argname);
    if (plen > sizeof name - 24) {
        plen = sizeof name - 24;   /* argname is a short literal; room for "[N]" */
    }
    memcpy(name, argname, plen);
    for (Py_ssize_t i = 0; i < len; i++) {
        index_suffix(name + plen, i);   /* "tensors[12]": no printf per item */
        arrs[i] = dp_as_array(st, PySequence_Fast_GET_ITEM(seq, i), name, min_ndim);
        if (arrs[i] == NULL) {
            for (Py_ssize_t k = 0; k < i; k++) {
                Py_DECREF(arrs[k]);
            }
            PyMem_Free(arrs);
            Py_DECREF(seq);
            return -1;
        }
    }
    Py_DECREF(seq);
    *out = arrs;
    *n = len;
    return 0;
}

void arrays_free(PyArrayObject **arrs, Py_ssize_t n)
{
    for (Py_ssize_t i = 0; i < n; i++) {
        Py_XDECREF(arrs[i]);
    }
    PyMem_Free(arrs);
}
