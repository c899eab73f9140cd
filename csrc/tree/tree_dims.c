/* tree_dims.c - in_dims / out_dims (JAX pmap's in_axes / out_axes as the
 * model): checking a spec (dp_check_dims_spec), the copy one call walks
 * (dims_take), and the helpers that walk a container spec beside the
 * structure it mirrors (spec_child, spec_mismatch, spec_check_children).
 * Used by scatter.c and gather.c (tree.h).
 */
#include "dpmini.h"
#include "tree.h"
#include "walk.h"

#include <math.h>
#include <stdarg.h>

/* Is spec a container entry of in_dims / out_dims (tuple, list or dict)? */
int spec_is_container(PyObject *spec)
{
    return spec != NULL && (PyTuple_Check(spec) || PyList_Check(spec) || PyDict_Check(spec));
}

/* The entry of a container spec for child i (key: the child's dict key or
 * field name, NULL for positions), borrowed, or NULL when the spec does not
 * list it (the child then uses the default). *sseg becomes its path. A
 * leaf spec (NULL, int, None, "sum") applies to every child: returned as is
 * with *sseg = *up. -1 only on an error from a dict lookup. */
int spec_child(PyObject *spec, const path_seg *up, Py_ssize_t i, PyObject *key,
               PyObject **child, path_seg *sseg)
{
    *child = NULL;
    *sseg = *up;
    if (!spec_is_container(spec)) {
        *child = spec;
        return 0;
    }
    if (PyDict_Check(spec)) {
        if (key == NULL)
            return 0;
        *sseg = seg_child(up, SEG_KEY, 0, key);
        *child = PyDict_GetItemWithError(spec, key);
        return *child == NULL && PyErr_Occurred() ? -1 : 0;
    }
    *sseg = seg_child(up, SEG_INDEX, i, NULL);
    Py_ssize_t len = PySequence_Fast_GET_SIZE(spec);
    if (i < len)
        *child = PySequence_Fast_GET_ITEM(spec, i);
    return 0;
}

/* A short description of a spec container: "a tuple of 3 entries". */
static PyObject *spec_what(PyObject *spec)
{
    return PyUnicode_FromFormat("a %.50s of %zd entr%s", Py_TYPE(spec)->tp_name,
                                PyObject_Length(spec),
                                PyObject_Length(spec) == 1 ? "y" : "ies");
}

/* A container spec at a position that is not a container of the matching
 * kind: TypeError naming both paths. what: how the value is described; fix:
 * what to give instead (NULL: "an int or None for it instead"). */
int spec_mismatch(const path_seg *sseg, PyObject *spec, const path_seg *seg,
                  const char *what, const char *fix)
{
    PyObject *vp = path_str(seg), *sw = vp != NULL ? spec_what(spec) : NULL;
    if (sw != NULL)
        raise_at(PyExc_TypeError, sseg, "%U mirrors the children of %U, but %U is %s; "
                 "give %s", sw, vp, vp, what, fix ? fix : "an int or None for it instead");
    Py_XDECREF(vp);
    Py_XDECREF(sw);
    return -1;
}

/* Check that a container spec addresses only children that exist: a
 * tuple/list (a PySequence_Fast) at most n entries, a dict only keys of
 * `keys_of` (a dict; NULL: names in `names`, a tuple of str, e.g. dataclass
 * fields). ValueError naming the first entry that addresses nothing. */
int spec_check_children(PyObject *spec, const path_seg *sseg, const path_seg *seg,
                        Py_ssize_t n, PyObject *keys_of, PyObject *names)
{
    if (!PyDict_Check(spec)) {
        Py_ssize_t len = PySequence_Fast_GET_SIZE(spec);
        if (len <= n)
            return 0;
        PyObject *vp = path_str(seg);
        if (vp != NULL)
            raise_at(PyExc_ValueError, sseg,
                     "has %zd entries, but %U has only %zd (entries past the end "
                     "address nothing)", len, vp, n);
        Py_XDECREF(vp);
        return -1;
    }
    Py_ssize_t pos = 0;
    PyObject *key, *value;
    while (PyDict_Next(spec, &pos, &key, &value)) {
        int has;
        if (keys_of != NULL) {
            has = PyDict_Contains(keys_of, key);
        }
        else {
            has = 0;
            for (Py_ssize_t i = 0; names != NULL && i < PyTuple_GET_SIZE(names) && !has; i++) {
                has = PyObject_RichCompareBool(PyTuple_GET_ITEM(names, i), key, Py_EQ);
                if (has < 0)
                    return -1;
            }
        }
        if (has < 0)
            return -1;
        if (has)
            continue;
        path_seg kseg = seg_child(sseg, SEG_KEY, 0, key);
        PyObject *vp = path_str(seg);
        if (vp != NULL)
            raise_at(PyExc_ValueError, &kseg, "%U has no key %R (a dict in in_dims or "
                     "out_dims may name only keys that exist)", vp, key);
        Py_XDECREF(vp);
        return -1;
    }
    return 0;
}


/* Check one in_dims / out_dims entry (recursively). */
static int check_spec(PyObject *spec, const path_seg *sseg, int is_out)
{
    if (spec == Py_None)
        return 0;
    if (dp_is_index_like(spec)) {
        /* the one int conversion (convert.c), with the entry's path as name */
        PyObject *sp = path_str(sseg);
        const char *csp = sp != NULL ? PyUnicode_AsUTF8(sp) : NULL;
        int dim;
        int r = csp != NULL ? dp_int_from_object(spec, csp, &dim) : -1;
        Py_XDECREF(sp);
        return r;
    }
    if (is_out && PyUnicode_Check(spec)) {
        if (PyUnicode_CompareWithASCIIString(spec, "sum") == 0)
            return 0;
        return raise_at(PyExc_ValueError, sseg,
                        "unknown reduction %R (out_dims takes an int dim, None or "
                        "\"sum\")", spec);
    }
    if (PyTuple_Check(spec) || PyList_Check(spec) || PyDict_Check(spec)) {
        int rc = -1;
        if (check_depth(sseg, is_out ? "out_dims" : "in_dims") < 0 ||
            Py_EnterRecursiveCall(" while checking in_dims / out_dims"))
            return -1;
        if (PyDict_Check(spec)) {
            Py_ssize_t pos = 0;
            PyObject *key, *value;
            while (PyDict_Next(spec, &pos, &key, &value)) {
                path_seg cseg = seg_child(sseg, SEG_KEY, 0, key);
                if (check_spec(value, &cseg, is_out) < 0)
                    goto done;
            }
        }
        else {
            PyObject *fast = PySequence_Fast(spec, "spec");
            if (fast == NULL)
                goto done;
            for (Py_ssize_t i = 0; i < PySequence_Fast_GET_SIZE(fast); i++) {
                path_seg cseg = seg_child(sseg, SEG_INDEX, i, NULL);
                if (check_spec(PySequence_Fast_GET_ITEM(fast, i), &cseg, is_out) < 0) {
                    Py_DECREF(fast);
                    goto done;
                }
            }
            Py_DECREF(fast);
        }
        rc = 0;
    done:
        Py_LeaveRecursiveCall();
        return rc;
    }
    return raise_at(PyExc_TypeError, sseg,
                    "expected an int (a dim), None (%s)%s or a tuple, list or dict of "
                    "them, got %.100s %.80R",
                    is_out ? "every replica returns the same value" : "broadcast the whole "
                    "array to every replica", is_out ? ", \"sum\"" : "",
                    Py_TYPE(spec)->tp_name, spec);
}

int dp_check_dims_spec(PyObject *spec, const char *argname, int is_out)
{
    if (spec == NULL)
        return 0;
    path_seg root = seg_root(argname);
    return check_spec(spec, &root, is_out);
}

/* A copy of one in_dims / out_dims entry in containers nobody else can
 * reach: lists stay lists and tuples tuples (plain ones), dicts (subclasses
 * included) become plain dicts; leaves (ints, None, "sum") are shared, being
 * immutable. Only C-level reads of the user's containers (no items(),
 * __iter__ or other user code), so nothing can change them half-way. */
static PyObject *spec_copy(PyObject *spec, const char *argname, int depth)
{
    if (!PyTuple_Check(spec) && !PyList_Check(spec) && !PyDict_Check(spec)) {
        /* NumPy integers (and other __index__ objects) become Python ints, so
         * the walkers see one kind of dim; one whose __index__ fails is kept
         * for check_spec to refuse with its path. */
        if (PyLong_CheckExact(spec) || !dp_is_index_like(spec))
            return Py_NewRef(spec);
        PyObject *idx = PyNumber_Index(spec);
        if (idx == NULL && PyErr_ExceptionMatches(PyExc_Exception)) {
            PyErr_Clear();
            return Py_NewRef(spec);
        }
        return idx;
    }
    if (depth > DP_MAX_NESTING) {
        /* The copy has no paths; dp_check_dims_spec on it would name one. */
        PyErr_Format(PyExc_RecursionError,
                     "%s: nested deeper than %d levels (dpmini walks at most %d levels "
                     "of tuples, lists and dicts; is a container inside itself?)",
                     argname, DP_MAX_NESTING, DP_MAX_NESTING);
        return NULL;
    }
    if (Py_EnterRecursiveCall(" while copying in_dims / out_dims"))
        return NULL;
    PyObject *items = NULL, *res = NULL;
    if (PyDict_Check(spec)) {
        /* PyDict_Items reads the dict's own storage (strong references),
         * also for subclasses; hashing the keys into the copy may run user
         * code, which can then change only the user's dict, not items. */
        items = PyDict_Items(spec);
        res = items != NULL ? PyDict_New() : NULL;
        for (Py_ssize_t i = 0; res != NULL && i < PyList_GET_SIZE(items); i++) {
            PyObject *pair = PyList_GET_ITEM(items, i);
            PyObject *v = spec_copy(PyTuple_GET_ITEM(pair, 1), argname, depth + 1);
            if (v == NULL || PyDict_SetItem(res, PyTuple_GET_ITEM(pair, 0), v) < 0)
                Py_CLEAR(res);
            Py_XDECREF(v);
        }
    }
    else {
        int is_list = PyList_Check(spec);
        items = is_list ? PyList_AsTuple(spec) : Py_NewRef(spec);
        Py_ssize_t n = items != NULL ? PyTuple_GET_SIZE(items) : 0;
        res = items == NULL ? NULL : is_list ? PyList_New(n) : PyTuple_New(n);
        for (Py_ssize_t i = 0; res != NULL && i < n; i++) {
            PyObject *v = spec_copy(PyTuple_GET_ITEM(items, i), argname, depth + 1);
            if (v == NULL)
                Py_CLEAR(res);
            else if (is_list)
                PyList_SET_ITEM(res, i, v);
            else
                PyTuple_SET_ITEM(res, i, v);
        }
    }
    Py_XDECREF(items);
    Py_LeaveRecursiveCall();
    return res;
}

int dims_take(PyObject *spec, const char *argname, int is_out, PyObject **out)
{
    *out = NULL;
    if (spec == NULL || spec == Py_None)
        return 0;
    PyObject *copy = spec_copy(spec, argname, 0);
    if (copy == NULL || dp_check_dims_spec(copy, argname, is_out) < 0) {
        Py_XDECREF(copy);
        return -1;
    }
    *out = copy;
    return 0;
}
