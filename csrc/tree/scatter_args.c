/* scatter_args.c - the top of scatter's pass (a) (scatter_walk.c): in_dims
 * split into the entries of the positional and the keyword arguments, and
 * the walk over the positional arguments, each with its entry.
 */
#include "dpmini.h"
#include "tree.h"

/* ------------------------------------------------------------------ */
/* in_dims at the top, positional arguments                            */
/* ------------------------------------------------------------------ */

/* The top of in_dims for scatter_kwargs, split into the entries for the
 * positional arguments and for the keyword arguments:
 *   NULL / None  -> both NULL (dim everywhere);
 *   int          -> that int for both (every leaf);
 *   tuple / list -> *args_spec = it (a prefix of the positional arguments),
 *                   *kw_spec NULL;
 *   dict         -> int keys address positional arguments, str keys keyword
 *                   arguments: *args_spec = a new dict {index: entry},
 *                   *kw_spec = a new dict {name: entry} (NULL when empty).
 * Every entry must address an argument of this call. New references (or
 * borrowed ints) are returned in *own for the caller to release. */
int split_top_spec(PyObject *in_dims, Py_ssize_t nin, PyObject *kwargs,
                   PyObject **args_spec, PyObject **kw_spec, PyObject **own)
{
    path_seg sroot = seg_root("in_dims");
    *args_spec = *kw_spec = NULL;
    own[0] = own[1] = NULL;
    if (in_dims == NULL || in_dims == Py_None)
        return 0;
    if (PyLong_Check(in_dims) && !PyBool_Check(in_dims)) {
        *args_spec = *kw_spec = in_dims;
        return 0;
    }
    if (PyTuple_Check(in_dims) || PyList_Check(in_dims)) {
        Py_ssize_t len = PySequence_Length(in_dims);
        if (len > nin)
            return raise_at(PyExc_ValueError, &sroot,
                            "has %zd entries, but the call has %zd positional argument%s "
                            "(a tuple or list in_dims mirrors a prefix of the positional "
                            "arguments; give keyword arguments in a dict by name)",
                            len, nin, nin == 1 ? "" : "s");
        *args_spec = in_dims;
        return 0;
    }
    if (!PyDict_Check(in_dims))
        return raise_at(PyExc_TypeError, &sroot,
                        "expected None, an int, a tuple or list (one entry per positional "
                        "argument) or a dict (int keys: positions, str keys: keyword "
                        "names), got %.100s", Py_TYPE(in_dims)->tp_name);
    PyObject *a = PyDict_New(), *k = PyDict_New();
    own[0] = a;
    own[1] = k;
    if (a == NULL || k == NULL)
        return -1;
    Py_ssize_t pos = 0;
    PyObject *key, *value;
    while (PyDict_Next(in_dims, &pos, &key, &value)) {
        path_seg kseg = seg_child(&sroot, SEG_KEY, 0, key);
        if (PyUnicode_Check(key)) {
            int has = kwargs != NULL ? PyDict_Contains(kwargs, key) : 0;
            if (has < 0)
                return -1;
            if (!has)
                return raise_at(PyExc_ValueError, &kseg,
                                "the call has no keyword argument %R", key);
            if (PyDict_SetItem(k, key, value) < 0)
                return -1;
        }
        else if (dp_is_index_like(key)) {
            PyObject *ik = PyNumber_Index(key);  /* numpy ints too: one int key */
            if (ik == NULL)
                return -1;
            Py_ssize_t i = PyLong_AsSsize_t(ik);
            if (i == -1 && PyErr_Occurred())
                PyErr_Clear();
            int set = (i >= 0 && i < nin) ? PyDict_SetItem(a, ik, value) : 0;
            Py_DECREF(ik);
            if (set < 0)
                return -1;
            if (i < 0 || i >= nin)
                return raise_at(PyExc_ValueError, &kseg,
                                "the call has %zd positional argument%s, so int keys "
                                "must be in 0..%zd", nin, nin == 1 ? "" : "s", nin - 1);
        }
        else {
            return raise_at(PyExc_TypeError, &kseg,
                            "a dict in_dims is keyed by argument position (int) or "
                            "keyword name (str), got a key of type %.100s",
                            Py_TYPE(key)->tp_name);
        }
    }
    *args_spec = a;
    *kw_spec = PyDict_GET_SIZE(k) > 0 ? k : NULL;
    return 0;
}

/* Pass (a) for the positional arguments: argument i with its entry of
 * args_spec (see split_top_spec). */
int collect_args(scatter_ctx *c, PyObject *inputs, PyObject *args_spec)
{
    path_seg args_root = seg_root("args"), sroot = seg_root("in_dims");
    PyObject *fast = NULL;
    int rc = -1;
    if (args_spec != NULL && (PyTuple_Check(args_spec) || PyList_Check(args_spec))) {
        fast = PySequence_Fast(args_spec, "in_dims");
        if (fast == NULL)
            return -1;
    }
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(inputs); i++) {
        path_seg seg = seg_child(&args_root, SEG_INDEX, i, NULL), sseg = sroot;
        PyObject *spec = args_spec;
        if (fast != NULL) {
            spec = i < PySequence_Fast_GET_SIZE(fast) ? PySequence_Fast_GET_ITEM(fast, i) : NULL;
            sseg = seg_child(&sroot, SEG_INDEX, i, NULL);
        }
        else if (args_spec != NULL && PyDict_Check(args_spec)) {
            PyObject *key = PyLong_FromSsize_t(i);
            if (key == NULL)
                goto done;
            spec = PyDict_GetItemWithError(args_spec, key);
            Py_DECREF(key);
            if (spec == NULL && PyErr_Occurred())
                goto done;
            sseg = seg_child(&sroot, SEG_INDEX, i, NULL);
        }
        if (collect(c, PyTuple_GET_ITEM(inputs, i), &seg, spec, &sseg) < 0)
            goto done;
    }
    rc = 0;
done:
    Py_XDECREF(fast);
    return rc;
}
