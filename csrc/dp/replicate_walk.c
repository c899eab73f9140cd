/* replicate_walk.c - replicate's walk over a module's structure: classify
 * each object reachable from the module (instance __dict__s and __slots__
 * members, lists, tuples, namedtuples, dicts), collect its arrays, name the
 * path in errors, and link the nodes on paths to arrays (replicate.h).
 */
#include "dpmini.h"
#include "dataparallel.h"
#include "tree.h"
#include "replicate.h"

#include <string.h>

/* ------------------------------------------------------------------ */
/* Helpers: the walk                                                   */
/* ------------------------------------------------------------------ */
static int is_namedtuple_type(PyTypeObject *tp)
{
    int r = dp_has_attr((PyObject *)tp, "_fields");
    return r <= 0 ? r : dp_has_attr((PyObject *)tp, "_make");
}

static int has_instance_dict(PyTypeObject *tp)
{
#ifdef Py_TPFLAGS_MANAGED_DICT
    if (tp->tp_flags & Py_TPFLAGS_MANAGED_DICT) {
        return 1;
    }
#endif
    return tp->tp_dictoffset != 0;
}

/* Does a Python class in tp's MRO declare __slots__? Only heap types are
 * looked at: slots come from class statements, whose tp_dict is a dict. */
static int has_slots(PyTypeObject *tp)
{
    PyObject *mro = tp->tp_mro;
    for (Py_ssize_t i = 0; mro != NULL && i < PyTuple_GET_SIZE(mro); i++) {
        PyTypeObject *base = (PyTypeObject *)PyTuple_GET_ITEM(mro, i);
        if ((base->tp_flags & Py_TPFLAGS_HEAPTYPE) && base->tp_dict != NULL &&
            PyDict_GetItemString(base->tp_dict, "__slots__") != NULL) {
            return 1;
        }
    }
    return 0;
}

static int rep_classify(rep_walk *w, PyObject *o)
{
    dp_state *st = w->st;
    PyTypeObject *tp = Py_TYPE(o);
    if (o == Py_None || tp == &PyLong_Type || tp == &PyFloat_Type || tp == &PyUnicode_Type ||
        tp == &PyBool_Type || tp == &PyBytes_Type || tp == &PyComplex_Type) {
        return RK_LEAF;
    }
    int r = dp_is_array_leaf(st, o);
    if (r < 0 && PyErr_Occurred()) {
        return RK_ERROR;
    }
    if (r > 0 && !PyArray_Check(o)) {
        return RK_ARRAY;   /* dpmini.Array, torch, JAX, CuPy: imported by the walk */
    }
    if (r > 0) {
        /* Shared by reference, as PyTorch shares a module's non-parameter
         * attributes: object-dtype arrays (they cannot be copied between
         * devices), and MaskedArray / matrix (a plain copy would lose their
         * meaning). */
        if (PyDataType_REFCHK(PyArray_DESCR((PyArrayObject *)o))) {
            return RK_LEAF;
        }
        r = dp_refused_array_subclass(o, NULL);
        if (r < 0) {
            return RK_ERROR;
        }
        return r ? RK_LEAF : RK_ARRAY;
    }
    if (PyList_Check(o)) {
        return PyList_CheckExact(o) ? RK_LIST : RK_LIST_SUB;
    }
    if (PyDict_Check(o)) {
        return PyDict_CheckExact(o) ? RK_DICT : RK_DICT_SUB;
    }
    if (PyTuple_Check(o)) {
        if (PyTuple_CheckExact(o)) {
            return RK_TUPLE;
        }
        int nt = is_namedtuple_type(tp);
        return nt < 0 ? RK_ERROR : nt ? RK_NAMEDTUPLE : RK_LEAF;
    }
    if (PyType_Check(o) || PyModule_Check(o) || PyFunction_Check(o) || PyCFunction_Check(o) ||
        PyMethod_Check(o) || PyInstanceMethod_Check(o) ||
        (!has_instance_dict(tp) && !has_slots(tp))) {
        return RK_LEAF;
    }
    if (w->share_torch) {
        r = dp_is_torch_module(o);   /* shared on virtual CPUs (docs/design.md) */
        if (r != 0) {
            return r < 0 ? RK_ERROR : RK_LEAF;
        }
    }
    return RK_OBJECT;
}

/* Walk o (depth: containers above it). Returns its node index, RK_LEAF
 * when it is not a node, RK_ERROR with an exception set. */
Py_ssize_t rep_walk_obj(rep_walk *w, PyObject *o, int depth);

/* Add an edge parent -> child for the walk of child (borrowed). */
static int rep_walk_child(rep_walk *w, Py_ssize_t parent, PyObject *child,
                          Py_ssize_t index, PyObject *key, int depth)
{
    Py_INCREF(child);   /* the walk may run Python code (e.g. a __dict__ hook) */
    if (depth < DP_REPLICATE_MAX_DEPTH + 2) {
        w->path[depth].parent_kind = w->nodes[parent].kind;
        w->path[depth].index = index;
        w->path[depth].key = key;
    }
    Py_ssize_t c = rep_walk_obj(w, child, depth);
    Py_DECREF(child);
    if (c == RK_ERROR) {
        return -1;
    }
    if (c >= 0 && rep_add_edge(w, parent, c, index, key) < 0) {
        return -1;
    }
    return 0;
}

static int rep_walk_dict(rep_walk *w, Py_ssize_t parent, PyObject *dict, int depth)
{
    Py_ssize_t pos = 0;
    PyObject *key, *value;
    while (PyDict_Next(dict, &pos, &key, &value)) {
        Py_INCREF(key);
        int rc = rep_walk_child(w, parent, value, -1, key, depth);
        Py_DECREF(key);
        if (rc < 0) {
            return -1;
        }
    }
    return 0;
}

/* Walk the __slots__ members of o, class by class along its MRO (a slot
 * named __x is stored mangled, as _Cls__x). Each member is read and later
 * written through its member descriptor, so properties or __getattr__ of the
 * same name do not interfere. Unset slots are skipped. */
static int rep_walk_slots(rep_walk *w, Py_ssize_t parent, PyObject *o, int depth)
{
    PyObject *mro = Py_TYPE(o)->tp_mro;
    for (Py_ssize_t i = 0; mro != NULL && i < PyTuple_GET_SIZE(mro); i++) {
        PyTypeObject *cls = (PyTypeObject *)PyTuple_GET_ITEM(mro, i);
        if (!(cls->tp_flags & Py_TPFLAGS_HEAPTYPE) || cls->tp_dict == NULL) {
            continue;
        }
        PyObject *slots = PyDict_GetItemString(cls->tp_dict, "__slots__");
        if (slots == NULL) {
            continue;
        }
        PyObject *names = PyUnicode_Check(slots) ? PyTuple_Pack(1, slots)
                                                 : PySequence_Tuple(slots);
        if (names == NULL) {
            return -1;
        }
        for (Py_ssize_t j = 0; j < PyTuple_GET_SIZE(names); j++) {
            PyObject *name = PyTuple_GET_ITEM(names, j), *attr = NULL, *desc, *value;
            if (!PyUnicode_Check(name) ||
                PyUnicode_CompareWithASCIIString(name, "__dict__") == 0 ||
                PyUnicode_CompareWithASCIIString(name, "__weakref__") == 0) {
                continue;
            }
            Py_ssize_t len = PyUnicode_GetLength(name);
            const char *cname = cls->tp_name, *dot = strrchr(cname, '.');
            cname = dot ? dot + 1 : cname;
            while (*cname == '_') {
                cname++;
            }
            int priv = len > 2 && PyUnicode_READ_CHAR(name, 0) == '_' &&
                       PyUnicode_READ_CHAR(name, 1) == '_' &&
                       !(PyUnicode_READ_CHAR(name, len - 1) == '_' &&
                         PyUnicode_READ_CHAR(name, len - 2) == '_') && *cname != '\0';
            attr = priv ? PyUnicode_FromFormat("_%s%U", cname, name) : Py_NewRef(name);
            if (attr == NULL) {
                Py_DECREF(names);
                return -1;
            }
            desc = PyDict_GetItemWithError(cls->tp_dict, attr);   /* borrowed */
            Py_DECREF(attr);
            if (desc == NULL) {
                if (PyErr_Occurred()) {
                    Py_DECREF(names);
                    return -1;
                }
                continue;
            }
            if (Py_TYPE(desc)->tp_descr_get == NULL || Py_TYPE(desc)->tp_descr_set == NULL) {
                continue;
            }
            Py_INCREF(desc);
            value = Py_TYPE(desc)->tp_descr_get(desc, o, (PyObject *)Py_TYPE(o));
            if (value == NULL) {
                Py_DECREF(desc);
                if (PyErr_ExceptionMatches(PyExc_AttributeError)) {   /* unset */
                    PyErr_Clear();
                    continue;
                }
                Py_DECREF(names);
                return -1;
            }
            int rc = rep_walk_child(w, parent, value, REP_SLOT_EDGE, desc, depth);
            Py_DECREF(value);
            Py_DECREF(desc);
            if (rc < 0) {
                Py_DECREF(names);
                return -1;
            }
        }
        Py_DECREF(names);
    }
    return 0;
}

/* "module.layers[1]['w']": the path of the node at depth (new str). */
PyObject *rep_path(rep_walk *w, int depth)
{
    PyObject *p = PyUnicode_FromString("module");
    /* Long paths show their first 32 steps, as tree_common.c's path_str. */
    int shown = depth > 40 ? 32 : depth;
    for (int d = 1; p != NULL && d <= shown && d < DP_REPLICATE_MAX_DEPTH + 2; d++) {
        const rep_step *s = &w->path[d];
        PyObject *name = NULL;
        if (s->index >= 0) {
            Py_SETREF(p, PyUnicode_FromFormat("%U[%zd]", p, s->index));
        } else if (s->index == REP_SLOT_EDGE || s->parent_kind == RK_OBJECT) {
            name = s->index == REP_SLOT_EDGE ? PyObject_GetAttrString(s->key, "__name__")
                                             : Py_NewRef(s->key);
            Py_SETREF(p, name != NULL ? PyUnicode_FromFormat("%U.%S", p, name) : NULL);
        } else {
            name = path_key_repr(s->key);   /* "<type key>" when repr fails */
            Py_SETREF(p, name != NULL ? PyUnicode_FromFormat("%U[%U]", p, name) : NULL);
        }
        Py_XDECREF(name);
    }
    if (p != NULL && shown < depth) {
        Py_SETREF(p, PyUnicode_FromFormat("%U...(%d more levels)", p, depth - shown));
    }
    return p;
}

/* The walk failed at depth: name the object's path in the error. */
static Py_ssize_t rep_error_at(rep_walk *w, int depth)
{
    PyObject *t, *v, *tb;
    PyErr_Fetch(&t, &v, &tb);
    PyObject *path = rep_path(w, depth);
    if (path == NULL) {
        PyErr_Clear();
    }
    PyErr_Restore(t, v, tb);
    dp_reraise_at(w->st, path);
    Py_XDECREF(path);
    return RK_ERROR;
}

/* An array leaf found by the walk: its import (ndarray or GPU shadow, no
 * copy), itself and its way back, appended to w's lists. */
static int rep_add_array(rep_walk *w, PyObject *o, int depth)
{
    PyObject *imp = NULL, *origin = NULL, *path = NULL;
    int rc = -1;
    if (PyArray_Check(o)) {
        imp = Py_NewRef(o);
    } else {
        path = rep_path(w, depth);
        const char *cpath = path != NULL ? PyUnicode_AsUTF8(path) : NULL;
        imp = cpath != NULL ? (PyObject *)dp_as_array(w->st, o, cpath, 0) : NULL;
    }
    origin = imp != NULL ? dp_array_origin(w->st, o) : NULL;
    if (origin != NULL && PyList_Append(w->arrays, imp) == 0 &&
        PyList_Append(w->leaves, o) == 0 && PyList_Append(w->origins, origin) == 0) {
        rc = 0;
    }
    Py_XDECREF(imp);
    Py_XDECREF(origin);
    Py_XDECREF(path);
    return rc;
}

/* The most nodes a list or tuple reserves room for at once. */
#define REP_RESERVE_MAX 4096

Py_ssize_t rep_walk_obj(rep_walk *w, PyObject *o, int depth)
{
    Py_ssize_t n = ptrmap_get(&w->map, o);
    if (n >= 0) {
        return n;
    }
    int kind = rep_classify(w, o);
    if (kind == RK_ERROR) {
        return rep_error_at(w, depth);
    }
    if (kind == RK_LEAF) {
        return kind;
    }
    if (depth > DP_REPLICATE_MAX_DEPTH) {
        /* As the scatter and gather walkers (check_depth): never a silent
         * stop that would leave deeper arrays shared. */
        PyObject *path = rep_path(w, depth);
        if (path != NULL) {
            PyErr_Format(PyExc_RecursionError,
                         "%U: module nested deeper than %d levels (dpmini walks at most "
                         "%d levels of attributes, tuples, lists, dicts and other "
                         "containers)", path, DP_MAX_NESTING, DP_MAX_NESTING);
        }
        Py_XDECREF(path);
        return RK_ERROR;
    }
    n = rep_add_node(w, o, kind);
    if (n < 0) {
        return RK_ERROR;
    }
    switch (kind) {
    case RK_ARRAY:
        w->nodes[n].array_index = PyList_GET_SIZE(w->arrays);
        if (rep_add_array(w, o, depth) < 0) {
            return RK_ERROR;
        }
        break;
    case RK_LIST:
    case RK_LIST_SUB:
        /* a module's list of parameters: room for them at once (at most
         * REP_RESERVE_MAX: a long list of plain numbers adds no nodes) */
        if (rep_reserve(w, PyList_GET_SIZE(o) < REP_RESERVE_MAX ? PyList_GET_SIZE(o)
                                                                : REP_RESERVE_MAX) < 0) {
            return RK_ERROR;
        }
        for (Py_ssize_t i = 0; i < PyList_GET_SIZE(o); i++) {
            if (rep_walk_child(w, n, PyList_GET_ITEM(o, i), i, NULL, depth + 1) < 0) {
                return RK_ERROR;
            }
        }
        break;
    case RK_TUPLE:
    case RK_NAMEDTUPLE:
        if (rep_reserve(w, PyTuple_GET_SIZE(o) < REP_RESERVE_MAX ? PyTuple_GET_SIZE(o)
                                                                 : REP_RESERVE_MAX) < 0) {
            return RK_ERROR;
        }
        for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(o); i++) {
            if (rep_walk_child(w, n, PyTuple_GET_ITEM(o, i), i, NULL, depth + 1) < 0) {
                return RK_ERROR;
            }
        }
        break;
    case RK_DICT:
    case RK_DICT_SUB:
        if (rep_walk_dict(w, n, o, depth + 1) < 0) {
            return RK_ERROR;
        }
        break;
    case RK_OBJECT: {
        if (has_instance_dict(Py_TYPE(o))) {
            PyObject *d = PyObject_GenericGetDict(o, NULL);
            if (d == NULL || !PyDict_Check(d)) {   /* no usable __dict__ */
                PyErr_Clear();
                Py_XDECREF(d);
            } else {
                w->nodes[n].dict = d;
                if (rep_walk_dict(w, n, d, depth + 1) < 0) {
                    return RK_ERROR;
                }
            }
        }
        if (rep_walk_slots(w, n, o, depth + 1) < 0) {
            return RK_ERROR;
        }
        break;
    }
    }
    return n;
}

/* After the walk: mark every node with an array below it, and group the
 * edges that lead to arrays by parent (w->sorted). */
int rep_link(rep_walk *w)
{
    int changed = 1;
    while (changed) {   /* edges are in post-order: usually one pass */
        changed = 0;
        for (Py_ssize_t e = 0; e < w->nedges; e++) {
            rep_edge *ed = &w->edges[e];
            if (w->nodes[ed->child].has_array && !w->nodes[ed->parent].has_array) {
                w->nodes[ed->parent].has_array = 1;
                changed = 1;
            }
        }
    }
    Py_ssize_t nkeep = 0;
    for (Py_ssize_t e = 0; e < w->nedges; e++) {
        if (w->nodes[w->edges[e].child].has_array) {
            w->nodes[w->edges[e].parent].nedges++;
            nkeep++;
        }
    }
    w->sorted = PyMem_Malloc((size_t)(nkeep ? nkeep : 1) * sizeof *w->sorted);
    if (w->sorted == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    Py_ssize_t start = 0;
    for (Py_ssize_t i = 0; i < w->nnodes; i++) {
        w->nodes[i].first_edge = start;
        start += w->nodes[i].nedges;
        w->nodes[i].nedges = 0;
    }
    for (Py_ssize_t e = 0; e < w->nedges; e++) {
        if (w->nodes[w->edges[e].child].has_array) {
            rep_node *p = &w->nodes[w->edges[e].parent];
            w->sorted[p->first_edge + p->nedges++] = w->edges[e];   /* key borrowed */
        }
    }
    return 0;
}
