/* gather_containers.c - gather at a container position (spec §4.1, R14,
 * R17, R18): dicts key by key, lists / tuples / namedtuples position by
 * position, dataclass instances field by field, each rebuilt in replica 0's
 * type, with the out_dims container entry for its children. Called by
 * gather_map (gather_tree.c), which they call back for each child.
 */
#include "dpmini.h"
#include "tree.h"
#include "gather.h"

#include <math.h>
#include <string.h>

/* The pending error of a dict subclass's own keys() / __getitem__ /
 * __contains__ (what), re-raised as the same type naming the output path
 * and the hook, the original as __cause__ (docs/libraries.md, "Probing"). */
static void name_mapping_error(dp_state *st, PyObject *d, const path_seg *seg,
                               const char *what, PyObject *key)
{
    if (!PyErr_ExceptionMatches(PyExc_Exception))
        return;   /* KeyboardInterrupt: as it is */
    PyObject *t, *v, *tb;
    PyErr_Fetch(&t, &v, &tb);
    PyErr_NormalizeException(&t, &v, &tb);
    PyObject *path = path_str(seg);
    PyObject *kr = path != NULL && key != NULL ? path_key_repr(key) : NULL;
    PyObject *msg = NULL;
    if (path != NULL && v != NULL && kr != NULL)
        msg = PyUnicode_FromFormat("%U: reading a %.100s (a dict subclass) with its "
                                   "__getitem__(%U) raised %.100s: %S", path,
                                   Py_TYPE(d)->tp_name, kr, Py_TYPE(v)->tp_name, v);
    else if (path != NULL && v != NULL && key == NULL)
        msg = PyUnicode_FromFormat("%U: reading a %.100s (a dict subclass) with its %s "
                                   "raised %.100s: %S", path, Py_TYPE(d)->tp_name, what,
                                   Py_TYPE(v)->tp_name, v);
    Py_XDECREF(kr);
    Py_XDECREF(path);
    PyErr_Clear();
    PyErr_Restore(t, v, tb);
    dp_reraise_msg(st, msg);
}

/* Dicts: same number of keys, every key of replica 0 in every dict; key order
 * and type from replica 0 (spec 4.1, R14). */
PyObject *gather_dict(gather_ctx *g, PyObject *const *vals, Py_ssize_t n,
                      const path_seg *seg, PyObject *spec, const path_seg *sseg)
{
    PyObject *keys = NULL, *acc = NULL, *res = NULL, **child = NULL;
    int exact = PyDict_CheckExact(vals[0]);
    Py_ssize_t len0 = PyDict_GET_SIZE(vals[0]);

    for (Py_ssize_t i = 1; i < n; i++) {
        if (PyDict_GET_SIZE(vals[i]) == len0)
            continue;
        PyObject *path = path_str(seg);
        if (path != NULL)
            PyErr_Format(PyExc_ValueError,
                         "%U: All dicts must have the same number of keys (replica 0 "
                         "returned %zd, replica %zd returned %zd)",
                         path, len0, i, PyDict_GET_SIZE(vals[i]));
        Py_XDECREF(path);
        return NULL;
    }
    /* An exact dict: its keys and values in one snapshot (dict_flat, no
     * user code); a subclass: its keys(). */
    keys = exact ? dict_flat(vals[0]) : PyMapping_Keys(vals[0]);
    if (keys == NULL) {
        name_mapping_error(g->st, vals[0], seg, "keys()", NULL);
        goto done;
    }
    Py_ssize_t nkeys = exact ? PyTuple_GET_SIZE(keys) / 2 : PyList_GET_SIZE(keys);
    if (spec_is_container(spec) &&
        spec_check_children(spec, sseg, seg, 0, vals[0], NULL) < 0)
        goto done;
    child = PyMem_Calloc((size_t)n, sizeof *child);
    acc = exact ? dict_new_sized(nkeys) : PyList_New(0);
    if (child == NULL || acc == NULL) {
        if (child == NULL)
            PyErr_NoMemory();
        goto done;
    }
    for (Py_ssize_t q = 0; q < nkeys; q++) {
        PyObject *key = exact ? PyTuple_GET_ITEM(keys, 2 * q) : PyList_GET_ITEM(keys, q), *v;
        path_seg cseg = seg_child(seg, SEG_KEY, 0, key);
        int ok = 1;
        for (Py_ssize_t i = 0; i < n && ok; i++) {
            int has;
            if (i == 0 && exact) {   /* replica 0's value, from the snapshot */
                child[0] = Py_NewRef(PyTuple_GET_ITEM(keys, 2 * q + 1));
                continue;
            }
            if (PyDict_CheckExact(vals[i])) {
                /* one lookup; a str key's hash is cached */
                PyObject *found = PyDict_GetItemWithError(vals[i], key);
                if (found != NULL) {
                    child[i] = Py_NewRef(found);
                    continue;
                }
                has = PyErr_Occurred() ? -1 : 0;
            }
            else {
                has = PyDict_Contains(vals[i], key);
            }
            if (has == 0) {
                PyObject *path = path_str(seg), *kr = path != NULL ? path_key_repr(key) : NULL;
                if (path != NULL && kr != NULL)
                    PyErr_Format(PyExc_ValueError,
                                 "%U: replica %zd returned a dict without the key %U "
                                 "that replica 0 returned; every replica must "
                                 "return the same keys", path, i, kr);
                Py_XDECREF(kr);
                Py_XDECREF(path);
            }
            if (has <= 0 || (child[i] = PyObject_GetItem(vals[i], key)) == NULL) {
                if (has != 0)
                    name_mapping_error(g->st, vals[i], seg, "[key]", key);
                ok = 0;
            }
        }
        path_seg csseg;
        PyObject *cspec;
        if (ok && spec_child(spec, sseg, q, key, &cspec, &csseg) < 0)
            ok = 0;
        v = ok ? gather_map(g, child, n, &cseg, cspec, &csseg) : NULL;
        for (Py_ssize_t i = 0; i < n; i++)
            Py_CLEAR(child[i]);
        if (v == NULL)
            goto done;
        int r;
        if (exact) {
            r = PyDict_SetItem(acc, key, v);
        }
        else {
            PyObject *pair = PyTuple_Pack(2, key, v);
            r = append_steal(acc, pair);
        }
        Py_DECREF(v);
        if (r < 0)
            goto done;
    }
    if (exact) {
        res = Py_NewRef(acc);
    }
    else {
        res = rebuild_mapping(g->st, vals[0], acc, seg);
    }
done:
    PyMem_Free(child);
    Py_XDECREF(keys);
    Py_XDECREF(acc);
    return res;
}

/* Lists, tuples, namedtuples: position by position, same length everywhere
 * (spec 4.1's strict zip, R18). */
PyObject *gather_seq(gather_ctx *g, PyObject *const *vals, Py_ssize_t n,
                     int kind, const path_seg *seg, PyObject *spec,
                     const path_seg *sseg)
{
    PyObject **snap = NULL, **child = NULL;
    PyObject *items = NULL, *names = NULL, *res = NULL;
    Py_ssize_t len0;

    snap = PyMem_Calloc((size_t)n, sizeof *snap);
    child = PyMem_Calloc((size_t)n, sizeof *child);
    if (snap == NULL || child == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    for (Py_ssize_t i = 0; i < n; i++)
        if ((snap[i] = seq_snapshot(vals[i])) == NULL)
            goto done;
    len0 = PyTuple_GET_SIZE(snap[0]);
    for (Py_ssize_t i = 1; i < n; i++) {
        if (PyTuple_GET_SIZE(snap[i]) == len0)
            continue;
        PyObject *path = path_str(seg), *lens = join_each(snap, n, SHOW_LEN);
        if (lens != NULL && path != NULL)
            PyErr_Format(PyExc_ValueError,
                         "%U: the replicas returned sequences of different lengths "
                         "(lengths per replica: %U); every replica must return the "
                         "same length", path, lens);
        Py_XDECREF(lens);
        Py_XDECREF(path);
        goto done;
    }

    if (spec_is_container(spec) &&
        spec_check_children(spec, sseg, seg, len0, NULL, NULL) < 0)
        goto done;
    items = PyList_New(len0);
    if (items == NULL)
        goto done;
    if (kind == G_NAMEDTUPLE)
        names = namedtuple_names(vals[0], len0);
    for (Py_ssize_t pos = 0; pos < len0; pos++) {
        path_seg cseg = names != NULL
            ? seg_child(seg, SEG_ATTR, 0, PyTuple_GET_ITEM(names, pos))
            : seg_child(seg, SEG_INDEX, pos, NULL);
        path_seg csseg;
        PyObject *cspec;
        if (spec_child(spec, sseg, pos, NULL, &cspec, &csseg) < 0)
            goto done;
        for (Py_ssize_t i = 0; i < n; i++)
            child[i] = PyTuple_GET_ITEM(snap[i], pos);  /* borrowed from snap */
        PyObject *v = gather_map(g, child, n, &cseg, cspec, &csseg);
        if (v == NULL)
            goto done;
        PyList_SET_ITEM(items, pos, v);
    }

    PyTypeObject *tp = Py_TYPE(vals[0]);
    if (kind == G_NAMEDTUPLE) {
        PyObject *make = PyObject_GetAttrString((PyObject *)tp, "_make");
        if (make != NULL) {
            res = PyObject_CallOneArg(make, items);
            Py_DECREF(make);
        }
        if (res == NULL)
            raise_rebuild_error(seg, tp, "type(out)._make(fields)", "");
    }
    else if (PyList_CheckExact(vals[0])) {
        res = Py_NewRef(items);
    }
    else if (PyTuple_CheckExact(vals[0])) {
        res = PyList_AsTuple(items);
    }
    else {
        res = PyObject_CallOneArg((PyObject *)tp, items);
        if (res == NULL)
            raise_rebuild_error(seg, tp, "type(out)(items)", "");
    }
done:
    if (snap != NULL)
        for (Py_ssize_t i = 0; i < n; i++)
            Py_XDECREF(snap[i]);
    PyMem_Free(snap);
    PyMem_Free(child);
    Py_XDECREF(items);
    Py_XDECREF(names);
    return res;
}

/* Dataclass instances: field by field (dataclasses.fields, init=False
 * fields included), into a new instance made as copy.copy makes one,
 * cls.__new__(cls), with each field set by object.__setattr__. __init__ and
 * __post_init__ do not run again: they ran in the replicas, and running
 * them on gathered values would redo their work (a scaling applied twice);
 * frozen dataclasses and __slots__ work the same way. A dataclass that is
 * also a dict (Hugging Face's ModelOutput) gets replica 0's keys, each with
 * the gathered value of the field of that name (R17). */
PyObject *gather_dataclass(gather_ctx *g, PyObject *const *vals, Py_ssize_t n,
                           const path_seg *seg, PyObject *spec,
                           const path_seg *sseg)
{
    PyObject *fields = NULL, *byname = NULL, *newfn = NULL, *inst = NULL, *keys = NULL;
    PyObject *res = NULL, **child = NULL;
    PyTypeObject *tp = Py_TYPE(vals[0]);

    fields = PyObject_CallOneArg(g->st->dataclasses_fields, vals[0]);
    if (fields == NULL)
        goto done;
    if (!PyTuple_Check(fields)) {
        PyErr_SetString(PyExc_TypeError, "dataclasses.fields() did not return a tuple");
        goto done;
    }
    if (spec != NULL && PyDict_Check(spec)) {
        /* A dict in out_dims names fields of the dataclass. */
        PyObject *fnames = PyTuple_New(PyTuple_GET_SIZE(fields));
        if (fnames == NULL)
            goto done;
        for (Py_ssize_t f = 0; f < PyTuple_GET_SIZE(fields); f++) {
            PyObject *nm = PyObject_GetAttrString(PyTuple_GET_ITEM(fields, f), "name");
            if (nm == NULL) {
                Py_DECREF(fnames);
                goto done;
            }
            PyTuple_SET_ITEM(fnames, f, nm);
        }
        int r = spec_check_children(spec, sseg, seg, 0, NULL, fnames);
        Py_DECREF(fnames);
        if (r < 0)
            goto done;
    }
    byname = PyDict_New();
    child = PyMem_Calloc((size_t)n, sizeof *child);
    if (byname == NULL || child == NULL) {
        if (child == NULL)
            PyErr_NoMemory();
        goto done;
    }
    for (Py_ssize_t f = 0; f < PyTuple_GET_SIZE(fields); f++) {
        PyObject *field = PyTuple_GET_ITEM(fields, f), *v = NULL;
        PyObject *name = PyObject_GetAttrString(field, "name");
        int ok = name != NULL;
        if (ok) {
            path_seg cseg = seg_child(seg, SEG_ATTR, 0, name), csseg;
            PyObject *cspec;
            if (spec_child(spec, sseg, f, name, &cspec, &csseg) < 0)
                ok = 0;
            for (Py_ssize_t i = 0; i < n && ok; i++)
                if ((child[i] = PyObject_GetAttr(vals[i], name)) == NULL)
                    ok = 0;
            v = ok ? gather_map(g, child, n, &cseg, cspec, &csseg) : NULL;
            for (Py_ssize_t i = 0; i < n; i++)
                Py_CLEAR(child[i]);
        }
        int r = v != NULL ? PyDict_SetItem(byname, name, v) : -1;
        Py_XDECREF(v);
        Py_XDECREF(name);
        if (r < 0)
            goto done;
    }
    newfn = PyObject_GetAttrString((PyObject *)tp, "__new__");
    inst = newfn != NULL ? PyObject_CallOneArg(newfn, (PyObject *)tp) : NULL;
    if (inst == NULL || Py_TYPE(inst) != tp) {
        if (inst != NULL)
            PyErr_Format(PyExc_TypeError, "__new__ returned a %.100s",
                         Py_TYPE(inst)->tp_name);
        raise_rebuild_error(seg, tp, "type(out).__new__(type(out)) with its fields set", "");
        goto done;
    }
    Py_ssize_t pos = 0;
    PyObject *name, *v;
    while (PyDict_Next(byname, &pos, &name, &v))
        if (PyObject_GenericSetAttr(inst, name, v) < 0)
            goto done;
    if (PyDict_Check(inst)) {
        keys = PyDict_Keys(vals[0]);  /* the dict's own storage, in its order */
        for (Py_ssize_t q = 0; keys != NULL && q < PyList_GET_SIZE(keys); q++) {
            PyObject *key = PyList_GET_ITEM(keys, q);
            v = PyDict_GetItemWithError(byname, key);
            if (v == NULL) {
                if (!PyErr_Occurred()) {
                    PyObject *path = path_str(seg), *kr = path != NULL ? path_key_repr(key) : NULL;
                    if (path != NULL && kr != NULL)
                        PyErr_Format(PyExc_TypeError,
                                     "%U: replica 0 returned a %.100s (a dataclass and a "
                                     "dict) with the key %U, which is not one of its "
                                     "fields", path, tp->tp_name, kr);
                    Py_XDECREF(path);
                    Py_XDECREF(kr);
                }
                goto done;
            }
            if (PyDict_SetItem(inst, key, v) < 0)
                goto done;
        }
        if (keys == NULL)
            goto done;
    }
    res = Py_NewRef(inst);
done:
    PyMem_Free(child);
    Py_XDECREF(fields);
    Py_XDECREF(byname);
    Py_XDECREF(newfn);
    Py_XDECREF(inst);
    Py_XDECREF(keys);
    return res;
}
