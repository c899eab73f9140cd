/* tree_args.c - the arguments of the tree's Python functions and of
 * DataParallel: dim, scatter_kwargs' inputs and kwargs, and chunk_sizes /
 * weights (dp_parse_split_sizes; the sizes themselves come from plan.c).
 */
#include "dpmini.h"
#include "tree.h"
#include "walk.h"
#include "plan.h"

#include <math.h>
#include <stdarg.h>

/* ------------------------------------------------------------------ */
/* Arguments: dim, inputs, kwargs, chunk_sizes / weights               */
/* ------------------------------------------------------------------ */

/* dim argument: 0 when absent. */
int parse_dim(PyObject *obj, int *dim)
{
    *dim = 0;
    return obj == NULL ? 0 : dp_int_from_object(obj, "dim", dim);
}

/* scatter_kwargs' inputs: None -> empty, a tuple as is, a list as the tuple
 * of its items (each replica's piece is made a list again afterwards,
 * dp_inputs_as_lists), anything else one positional argument (inputs,).
 * That is what torch's scatter_kwargs gives once parallel_apply has called
 * the module (docs/spec.md 3.1, 6.3): scatter([x]) makes [x_i] per replica, which
 * parallel_apply unpacks, and scatter(x) makes x_i, which it wraps as
 * (x_i,). New reference. */
int dp_refuse_unsplittable_inputs(PyObject *inputs)
{
    if (!PyTuple_Check(inputs) || PyTuple_CheckExact(inputs))
        return 0;
    return refuse_unsplittable(inputs, "inputs", "scattered");
}

PyObject *normalize_inputs(PyObject *inputs)
{
    if (inputs == Py_None)
        return PyTuple_New(0);
    if (PyTuple_Check(inputs)) {
        if (dp_refuse_unsplittable_inputs(inputs) < 0)
            return NULL;
        return Py_NewRef(inputs);
    }
    if (PyList_Check(inputs))
        return PyList_AsTuple(inputs);
    return PyTuple_Pack(1, inputs);
}

PyObject *dp_inputs_as_lists(PyObject *inputs, PyObject *per_replica)
{
    if (per_replica == NULL || !PyList_Check(inputs) || PyList_GET_SIZE(inputs) == 0)
        return per_replica;
    Py_ssize_t k = PyTuple_GET_SIZE(per_replica);
    PyObject *res = PyTuple_New(k);
    for (Py_ssize_t i = 0; res != NULL && i < k; i++) {
        PyObject *row = PySequence_List(PyTuple_GET_ITEM(per_replica, i));
        if (row == NULL)
            Py_CLEAR(res);
        else
            PyTuple_SET_ITEM(res, i, row);
    }
    Py_DECREF(per_replica);
    return res;
}

/* kwargs: None -> NULL (no kwargs); a dict as is (borrowed). */
int normalize_kwargs(PyObject *kwargs, PyObject **out)
{
    *out = NULL;
    if (kwargs == Py_None)
        return 0;
    if (!PyDict_Check(kwargs)) {
        PyErr_Format(PyExc_TypeError, "kwargs: expected a dict or None, got %.100s",
                     Py_TYPE(kwargs)->tp_name);
        return -1;
    }
    *out = kwargs;
    return 0;
}

/* One sequence argument of ndev entries (chunk_sizes or weights). */
static PyObject *per_device_seq(PyObject *obj, const char *argname, const char *what,
                                Py_ssize_t ndev)
{
    if (PyUnicode_Check(obj) || PyBytes_Check(obj) || PyDict_Check(obj) ||
        !PySequence_Check(obj)) {
        PyErr_Format(PyExc_TypeError, "%s: expected a sequence of %s (one per device), "
                     "got %.100s", argname, what, Py_TYPE(obj)->tp_name);
        return NULL;
    }
    /* A tuple of its own (not PySequence_Fast, which returns a list itself):
     * __index__ / __float__ of an entry may change the caller's list. */
    PyObject *fast = PySequence_Tuple(obj);
    if (fast == NULL)
        return NULL;
    if (PySequence_Fast_GET_SIZE(fast) != ndev) {
        PyErr_Format(PyExc_ValueError, "%s: expected %zd entries (one per device in "
                     "device_ids), got %zd", argname, ndev, PySequence_Fast_GET_SIZE(fast));
        Py_DECREF(fast);
        return NULL;
    }
    return fast;
}

int dp_parse_split_sizes(PyObject *chunk_sizes, PyObject *weights, Py_ssize_t ndev,
                         int64_t *sizes_buf, double *weights_buf, dp_split_opts *opts)
{
    opts->chunk_sizes = NULL;
    opts->weights = NULL;
    if (chunk_sizes == Py_None)
        chunk_sizes = NULL;
    if (weights == Py_None)
        weights = NULL;
    if (chunk_sizes != NULL && weights != NULL) {
        PyErr_SetString(PyExc_ValueError,
                        "chunk_sizes and weights: give at most one (chunk_sizes fixes each "
                        "device's rows, weights makes them proportional)");
        return -1;
    }
    if (ndev < 1 || ndev > DP_MAX_DEVICES) {
        PyErr_Format(PyExc_ValueError, "expected 1 to %d devices, got %zd", DP_MAX_DEVICES,
                     ndev);
        return -1;
    }
    if (chunk_sizes != NULL) {
        PyObject *fast = per_device_seq(chunk_sizes, "chunk_sizes", "ints", ndev);
        if (fast == NULL)
            return -1;
        for (Py_ssize_t i = 0; i < ndev; i++) {
            PyObject *v = PySequence_Fast_GET_ITEM(fast, i);
            char name[48];
            long long x;
            snprintf(name, sizeof name, "chunk_sizes[%zd]", i);
            if (dp_index_from_object(v, name, LLONG_MIN, LLONG_MAX, &x) < 0) {
                Py_DECREF(fast);
                return -1;
            }
            if (x < 0) {
                PyErr_Format(PyExc_ValueError, "chunk_sizes[%zd]: must be >= 0 (rows for "
                             "device %zd), got %lld", i, i, x);
                Py_DECREF(fast);
                return -1;
            }
            sizes_buf[i] = (int64_t)x;
        }
        Py_DECREF(fast);
        opts->chunk_sizes = sizes_buf;
    }
    if (weights != NULL) {
        PyObject *fast = per_device_seq(weights, "weights", "numbers", ndev);
        if (fast == NULL)
            return -1;
        for (Py_ssize_t i = 0; i < ndev; i++) {
            PyObject *v = PySequence_Fast_GET_ITEM(fast, i);
            char name[48];
            double x;
            snprintf(name, sizeof name, "weights[%zd]", i);
            if (dp_real_from_object(v, name, &x) < 0) {
                Py_DECREF(fast);
                return -1;
            }
            if (!(x > 0.0) || !isfinite(x)) {
                PyErr_Format(PyExc_ValueError, "weights[%zd]: must be a finite number > 0, "
                             "got %R", i, v);
                Py_DECREF(fast);
                return -1;
            }
            weights_buf[i] = x;
        }
        Py_DECREF(fast);
        opts->weights = weights_buf;
    }
    return 0;
}
