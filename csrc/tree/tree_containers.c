/* tree_containers.c - the containers the tree walkers go into: the tests
 * for namedtuples and dataclass instances, snapshots of a sequence's items
 * and a dict's pairs (safe from user code resizing them during a walk), and
 * a dict subclass rebuilt with other values (rebuild_mapping). Used by
 * scatter.c, gather.c and explain.c (tree.h).
 */
#include "dpmini.h"
#include "tree.h"

#include <math.h>
#include <stdarg.h>

/* A dict subclass rebuilt with other values (scatter, gather; replicate
 * does the same in replicate.c): copy.copy(obj), then copy[key] = value for
 * each (key, value) of pairs (a list of 2-tuples, obj's keys in its order).
 * So the copy keeps obj's type, its keys and their order, and what the
 * class keeps besides its items (a defaultdict's default_factory, instance
 * attributes), and no constructor sees the pairs: type(obj)(pairs) would
 * count them as keys in a Counter and fails for a defaultdict. The copy
 * must come back as a new object of the same type with exactly the keys
 * of pairs, else TypeError naming the path. */
PyObject *rebuild_mapping(dp_state *st, PyObject *obj, PyObject *pairs,
                          const path_seg *seg)
{
    PyTypeObject *tp = Py_TYPE(obj);
    PyObject *copy = PyObject_CallOneArg(st->copy_copy, obj);
    if (copy == NULL)
        goto fail;
    if (copy == obj || Py_TYPE(copy) != tp) {
        PyErr_Format(PyExc_TypeError, "copy.copy() returned %s",
                     copy == obj ? "the same object" : Py_TYPE(copy)->tp_name);
        goto fail;
    }
    Py_ssize_t n = PyList_GET_SIZE(pairs);
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *pair = PyList_GET_ITEM(pairs, i);
        if (PyObject_SetItem(copy, PyTuple_GET_ITEM(pair, 0), PyTuple_GET_ITEM(pair, 1)) < 0)
            goto fail;
    }
    Py_ssize_t len = PyObject_Length(copy);
    if (len < 0)
        goto fail;
    if (len != n) {
        PyErr_Format(PyExc_TypeError, "the copy has %zd keys, the original %zd", len, n);
        goto fail;
    }
    return copy;
fail:
    Py_XDECREF(copy);
    raise_rebuild_error(seg, tp, "copy.copy(obj) with its values replaced", "");
    return NULL;
}

/* A namedtuple: a tuple subclass with `_fields` and `_asdict` (the test of
 * scatter_gather.py). 1, 0 or -1. */
int is_namedtuple(PyObject *obj)
{
    if (!PyTuple_Check(obj) || PyTuple_CheckExact(obj))
        return 0;
    int r = dp_has_attr(obj, "_asdict");
    if (r <= 0)
        return r;
    return dp_has_attr(obj, "_fields");
}

/* Namedtuples whose fields share no batch dimension, so that splitting or
 * gathering them field by field would give pieces that do not fit together
 * (docs/spec.md 3.1). Known by module and name: nothing is imported. */
static const struct {
    const char *module, *name, *why;
} unsplittable_types[] = {
    {"torch.nn.utils.rnn", "PackedSequence",
     "its data has sum(lengths) rows and batch_sizes one entry per time step, so its fields "
     "share no batch dimension; pass (and return) the padded batch and its lengths, and pack "
     "inside forward (torch.nn.utils.rnn.pack_padded_sequence, pad_packed_sequence)"},
};

/* Is tp the unsplittable type i (by its name and __module__)? 1, 0 or -1. */
static int is_unsplittable_type(PyTypeObject *tp, size_t i)
{
    const char *dot = strrchr(tp->tp_name, '.');
    if (strcmp(dot != NULL ? dot + 1 : tp->tp_name, unsplittable_types[i].name) != 0)
        return 0;
    PyObject *mod = PyObject_GetAttrString((PyObject *)tp, "__module__");
    if (mod == NULL) {
        /* a type whose __module__ cannot be read is not the one named */
        if (!PyErr_ExceptionMatches(PyExc_Exception))
            return -1;
        PyErr_Clear();
        return 0;
    }
    int same = PyUnicode_Check(mod) &&
               PyUnicode_CompareWithASCIIString(mod, unsplittable_types[i].module) == 0;
    Py_DECREF(mod);
    return same;
}

int refuse_unsplittable(PyObject *obj, const char *path, const char *verb)
{
    PyObject *mro = Py_TYPE(obj)->tp_mro;   /* subclasses of such a type too */
    Py_ssize_t n = mro != NULL && PyTuple_Check(mro) ? PyTuple_GET_SIZE(mro) : 0;
    for (Py_ssize_t k = 0; k < n; k++) {
        PyTypeObject *tp = (PyTypeObject *)PyTuple_GET_ITEM(mro, k);
        for (size_t i = 0; i < sizeof unsplittable_types / sizeof unsplittable_types[0]; i++) {
            int r = is_unsplittable_type(tp, i);
            if (r < 0)
                return -1;
            if (r) {
                PyErr_Format(PyExc_TypeError, "%s%sa %s.%s cannot be %s: %s",
                             path != NULL ? path : "", path != NULL ? ": " : "",
                             unsplittable_types[i].module, unsplittable_types[i].name, verb,
                             unsplittable_types[i].why);
                return -1;
            }
        }
    }
    return 0;
}

/* An instance (not a class) of a dataclass. 1, 0 or -1. */
int is_dataclass_instance(PyObject *obj)
{
    if (PyType_Check(obj))
        return 0;
    return dp_has_attr((PyObject *)Py_TYPE(obj), "__dataclass_fields__");
}

/* type(obj)._fields when it is a tuple of n str (for paths like args[0].a),
 * else NULL with no exception set: paths then fall back to [i]. */
PyObject *namedtuple_names(PyObject *obj, Py_ssize_t n)
{
    PyObject *names = PyObject_GetAttrString((PyObject *)Py_TYPE(obj), "_fields");
    if (names == NULL) {
        PyErr_Clear();
        return NULL;
    }
    if (!PyTuple_Check(names) || PyTuple_GET_SIZE(names) != n)
        goto no;
    for (Py_ssize_t i = 0; i < n; i++)
        if (!PyUnicode_Check(PyTuple_GET_ITEM(names, i)))
            goto no;
    return names;
no:
    Py_DECREF(names);
    return NULL;
}

/* A snapshot of a tuple's or list's items as a tuple (new reference), so
 * that user code run during a walk cannot resize what is being walked. */
PyObject *seq_snapshot(PyObject *seq)
{
    if (PyList_Check(seq))
        return PyList_AsTuple(seq);
    return Py_NewRef(seq);
}

/* A dict's items as a list of (key, value) 2-tuples; dict subclasses go
 * through their items() (as `obj.items()` in PyTorch), so an OrderedDict
 * keeps its own order. */
PyObject *dict_pairs(PyObject *d)
{
    PyObject *items = PyMapping_Items(d);
    if (items == NULL)
        return NULL;
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(items); i++) {
        PyObject *p = PyList_GET_ITEM(items, i);
        if (!PyTuple_Check(p) || PyTuple_GET_SIZE(p) != 2) {
            PyErr_Format(PyExc_TypeError,
                         "%.100s.items() must give (key, value) pairs, got %.100s",
                         Py_TYPE(d)->tp_name, Py_TYPE(p)->tp_name);
            Py_DECREF(items);
            return NULL;
        }
    }
    return items;
}

/* A dict's items flattened into one tuple (k0, v0, k1, v1, ...): an exact
 * dict read with PyDict_Next (no user code runs, one allocation), a dict
 * subclass through its items() (dict_pairs). */
PyObject *dict_flat(PyObject *d)
{
    if (PyDict_CheckExact(d)) {
        Py_ssize_t n = PyDict_GET_SIZE(d), pos = 0, i = 0;
        PyObject *flat = PyTuple_New(2 * n), *k, *v;
        if (flat == NULL)
            return NULL;
        while (i < n && PyDict_Next(d, &pos, &k, &v)) {
            PyTuple_SET_ITEM(flat, 2 * i, Py_NewRef(k));
            PyTuple_SET_ITEM(flat, 2 * i + 1, Py_NewRef(v));
            i++;
        }
        return flat;   /* i == n: nothing ran between the size and the walk */
    }
    PyObject *pairs = dict_pairs(d);
    if (pairs == NULL)
        return NULL;
    Py_ssize_t n = PyList_GET_SIZE(pairs);
    PyObject *flat = PyTuple_New(2 * n);
    for (Py_ssize_t i = 0; flat != NULL && i < n; i++) {
        PyObject *p = PyList_GET_ITEM(pairs, i);
        PyTuple_SET_ITEM(flat, 2 * i, Py_NewRef(PyTuple_GET_ITEM(p, 0)));
        PyTuple_SET_ITEM(flat, 2 * i + 1, Py_NewRef(PyTuple_GET_ITEM(p, 1)));
    }
    Py_DECREF(pairs);
    return flat;
}

/* A new empty dict with room for n keys (no resizing while it is filled). */
PyObject *dict_new_sized(Py_ssize_t n)
{
#if PY_VERSION_HEX < 0x030D0000
    return _PyDict_NewPresized(n);
#else
    (void)n;
    return PyDict_New();
#endif
}
