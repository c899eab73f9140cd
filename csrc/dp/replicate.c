/* replicate.c - replicate: one copy of a module per device (docs/spec.md 5), for
 * DataParallel.forward / .replicate and the module-level dpmini.replicate.
 *
 * replicate: the arrays reachable from the module (instance __dict__s and
 * __slots__ members, lists, tuples, namedtuples, dicts) are broadcast in one coalesced call (copy_broadcast.c); each
 * replica is a shallow copy of every object on a path to an array, with the
 * arrays swapped for that device's copies. Everything else is shared.
 *
 * Sections: types; the node map (object address to walk node) and the walk
 * state's buffers; the walk over the module's structure (classify each
 * object, collect its arrays, name the path in errors, link the nodes on
 * paths to arrays); the build of one replica per device; public functions.
 */
#include "dpmini.h"
#include "dataparallel.h"
#include "tree.h"
#include "dp.h"
#include "engine.h"
#include "profile.h"

#include <string.h>

/* ------------------------------------------------------------------ */
/* Types                                                               */
/* ------------------------------------------------------------------ */

/* The walkers' bound (tree.h): deeper raises RecursionError naming the path. */
#define DP_REPLICATE_MAX_DEPTH DP_MAX_NESTING
#define DP_BROADCAST_BUFFER ((size_t)10485760)  /* 10 MiB, docs/spec.md 5.3 */

/* replicate: what kind of object a walked node is. */
enum {
    RK_ERROR = -2,         /* an exception is set                             */
    RK_LEAF = -1,          /* shared by reference, never descended            */
    RK_ARRAY = 0,          /* an array leaf: replaced by its device copy      */
    RK_LIST,               /* exact list: rebuilt                             */
    RK_LIST_SUB,           /* list subclass: copy.copy, items set             */
    RK_TUPLE,              /* exact tuple: rebuilt                            */
    RK_NAMEDTUPLE,         /* namedtuple: type(obj)._make(items)              */
    RK_DICT,               /* exact dict: rebuilt                             */
    RK_DICT_SUB,           /* dict subclass: copy.copy, items set             */
    RK_OBJECT              /* instance with a __dict__: copy.copy, dict set   */
};

typedef struct {
    PyObject *obj;         /* owned: the original object                      */
    PyObject *dict;        /* owned: RK_OBJECT's __dict__ as walked, or NULL  */
    int kind;              /* RK_ARRAY .. RK_OBJECT                           */
    int has_array;         /* 1: an array is reachable from here              */
    Py_ssize_t array_index;   /* RK_ARRAY: index in the broadcast list        */
    Py_ssize_t first_edge;    /* into rep_walk.sorted (edges to array paths)  */
    Py_ssize_t nedges;
} rep_node;

#define REP_SLOT_EDGE (-2)      /* rep_edge.index of a __slots__ member   */

typedef struct {
    Py_ssize_t parent, child;  /* node indices                                */
    Py_ssize_t index;          /* list/tuple position; -1 for a dict key or
                                  attribute; REP_SLOT_EDGE for a slot         */
    PyObject *key;             /* owned: dict key or attribute name; the slot's
                                  member descriptor for REP_SLOT_EDGE; NULL for
                                  list/tuple positions                        */
} rep_edge;

/* Open-addressing map from object address to node index. */
#define PTRMAP_INLINE 64       /* power of two */
typedef struct {
    PyObject **keys;           /* NULL = empty slot */
    Py_ssize_t *vals;
    size_t mask;               /* capacity - 1 */
    size_t len;
    PyObject *ikeys[PTRMAP_INLINE];
    Py_ssize_t ivals[PTRMAP_INLINE];
} ptrmap;

/* One step of the path from the module to the node being walked (for
 * error messages only: module.cfg, module.layers[1]['w']). */
typedef struct {
    int parent_kind;           /* RK_* of the parent                          */
    Py_ssize_t index;          /* as rep_edge.index                           */
    PyObject *key;             /* borrowed, as rep_edge.key                   */
} rep_step;

#define REP_INLINE_NODES 8
#define REP_INLINE_EDGES 16
typedef struct {
    dp_state *st;
    rep_node *nodes;           /* nodes[0] is the root when it is a node      */
    Py_ssize_t nnodes, cap_nodes;
    rep_edge *edges;           /* every parent -> node edge, in walk order    */
    Py_ssize_t nedges, cap_edges;
    rep_edge *sorted;          /* edges to array paths, grouped by parent     */
    PyObject *arrays;          /* owned list: arrays found, deduplicated, as
                                  imported (ndarray or GPU shadow)            */
    PyObject *leaves;          /* owned list: the objects found, same order   */
    PyObject *origins;         /* owned list: each one's way back (interop.c) */
    int share_torch;           /* all devices virtual CPUs: torch.nn.Module
                                  objects are shared, not copied              */
    rep_step path[DP_REPLICATE_MAX_DEPTH + 2];  /* path[1..depth]             */
    ptrmap map;
    rep_node inline_nodes[REP_INLINE_NODES];
    rep_edge inline_edges[REP_INLINE_EDGES];
} rep_walk;

/* Marks a tuple replica under construction (a cycle back to it is shared). */
static char rep_busy_marker;
#define REP_BUSY ((PyObject *)(void *)&rep_busy_marker)

/* ------------------------------------------------------------------ */
/* The node map and the walk state                                     */
/* ------------------------------------------------------------------ */

static size_t ptr_hash(const void *p)
{
    uint64_t x = (uint64_t)(uintptr_t)p;
    x ^= x >> 17;
    x *= 0x9E3779B97F4A7C15ull;
    return (size_t)(x ^ (x >> 31));
}

static void ptrmap_init(ptrmap *m)
{
    memset(m->ikeys, 0, sizeof m->ikeys);
    m->keys = m->ikeys;
    m->vals = m->ivals;
    m->mask = PTRMAP_INLINE - 1;
    m->len = 0;
}

static void ptrmap_free(ptrmap *m)
{
    if (m->keys != m->ikeys) {
        PyMem_Free(m->keys);
        PyMem_Free(m->vals);
    }
}

/* The node index of key, or -1 when it has none. */
static Py_ssize_t ptrmap_get(const ptrmap *m, PyObject *key)
{
    for (size_t i = ptr_hash(key) & m->mask;; i = (i + 1) & m->mask) {
        if (m->keys[i] == key) {
            return m->vals[i];
        }
        if (m->keys[i] == NULL) {
            return -1;
        }
    }
}

static void ptrmap_insert(PyObject **keys, Py_ssize_t *vals, size_t mask,
                          PyObject *key, Py_ssize_t val)
{
    size_t i = ptr_hash(key) & mask;
    while (keys[i] != NULL) {
        i = (i + 1) & mask;
    }
    keys[i] = key;
    vals[i] = val;
}

/* key must not be present yet. */
static int ptrmap_put(ptrmap *m, PyObject *key, Py_ssize_t val)
{
    if ((m->len + 1) * 2 > m->mask + 1) {
        size_t cap = (m->mask + 1) * 2;
        PyObject **keys = PyMem_Calloc(cap, sizeof *keys);
        Py_ssize_t *vals = PyMem_Malloc(cap * sizeof *vals);
        if (keys == NULL || vals == NULL) {
            PyMem_Free(keys);
            PyMem_Free(vals);
            PyErr_NoMemory();
            return -1;
        }
        for (size_t i = 0; i <= m->mask; i++) {
            if (m->keys[i] != NULL) {
                ptrmap_insert(keys, vals, cap - 1, m->keys[i], m->vals[i]);
            }
        }
        ptrmap_free(m);
        m->keys = keys;
        m->vals = vals;
        m->mask = cap - 1;
    }
    ptrmap_insert(m->keys, m->vals, m->mask, key, val);
    m->len++;
    return 0;
}

/* An empty walk over st (nothing allocated yet). */
static void rep_walk_init(rep_walk *w, dp_state *st)
{
    w->st = st;
    w->nodes = w->inline_nodes;
    w->nnodes = 0;
    w->cap_nodes = REP_INLINE_NODES;
    w->edges = w->inline_edges;
    w->nedges = 0;
    w->cap_edges = REP_INLINE_EDGES;
    w->sorted = NULL;
    w->arrays = w->leaves = w->origins = NULL;
    w->share_torch = 0;
    ptrmap_init(&w->map);
}

/* Release everything the walk holds. */
static void rep_walk_free(rep_walk *w)
{
    for (Py_ssize_t i = 0; i < w->nnodes; i++) {
        Py_XDECREF(w->nodes[i].obj);
        Py_XDECREF(w->nodes[i].dict);
    }
    for (Py_ssize_t i = 0; i < w->nedges; i++) {
        Py_XDECREF(w->edges[i].key);
    }
    if (w->nodes != w->inline_nodes) {
        PyMem_Free(w->nodes);
    }
    if (w->edges != w->inline_edges) {
        PyMem_Free(w->edges);
    }
    PyMem_Free(w->sorted);
    Py_XDECREF(w->arrays);
    Py_XDECREF(w->leaves);
    Py_XDECREF(w->origins);
    ptrmap_free(&w->map);
}

/* Grow a buffer that may still be the inline one to hold at least `need`
 * (at least doubling it, so that many small reservations stay linear). */
static void *reserve_buffer(void *buf, const void *inline_buf, Py_ssize_t *cap, Py_ssize_t need,
                            size_t elsize)
{
    if (need < *cap * 2) {
        need = *cap * 2;
    }
    if (need > PY_SSIZE_T_MAX / (Py_ssize_t)elsize) {
        PyErr_NoMemory();
        return NULL;
    }
    void *nb;
    if (buf == inline_buf) {
        nb = PyMem_Malloc((size_t)need * elsize);
        if (nb != NULL) {
            memcpy(nb, buf, (size_t)*cap * elsize);
        }
    } else {
        nb = PyMem_Realloc(buf, (size_t)need * elsize);
    }
    if (nb == NULL) {
        PyErr_NoMemory();
        return NULL;
    }
    *cap = need;
    return nb;
}

/* Double a buffer that may still be the inline one. */
static void *grow_buffer(void *buf, const void *inline_buf, Py_ssize_t *cap, size_t elsize)
{
    return reserve_buffer(buf, inline_buf, cap, *cap + 1, elsize);
}

/* Room for `more` nodes and edges beyond those added (one allocation for a
 * list's or tuple's children instead of a doubling every few). */
static int rep_reserve(rep_walk *w, Py_ssize_t more)
{
    if (more > PY_SSIZE_T_MAX / 2 - w->nnodes - w->nedges) {
        PyErr_NoMemory();
        return -1;
    }
    if (w->nnodes + more > w->cap_nodes) {
        rep_node *nb = reserve_buffer(w->nodes, w->inline_nodes, &w->cap_nodes,
                                      w->nnodes + more, sizeof *nb);
        if (nb == NULL) {
            return -1;
        }
        w->nodes = nb;
    }
    if (w->nedges + more > w->cap_edges) {
        rep_edge *nb = reserve_buffer(w->edges, w->inline_edges, &w->cap_edges,
                                      w->nedges + more, sizeof *nb);
        if (nb == NULL) {
            return -1;
        }
        w->edges = nb;
    }
    return 0;
}

/* A new node for obj (borrowed) of kind; its index, or -1. */
static Py_ssize_t rep_add_node(rep_walk *w, PyObject *obj, int kind)
{
    if (w->nnodes == w->cap_nodes) {
        rep_node *nb = grow_buffer(w->nodes, w->inline_nodes, &w->cap_nodes, sizeof *nb);
        if (nb == NULL) {
            return -1;
        }
        w->nodes = nb;
    }
    if (ptrmap_put(&w->map, obj, w->nnodes) < 0) {
        return -1;
    }
    rep_node *n = &w->nodes[w->nnodes];
    n->obj = Py_NewRef(obj);
    n->dict = NULL;
    n->kind = kind;
    n->has_array = kind == RK_ARRAY;
    n->array_index = -1;
    n->first_edge = 0;
    n->nedges = 0;
    return w->nnodes++;
}

/* An edge parent -> child; key: borrowed, or NULL for a position. */
static int rep_add_edge(rep_walk *w, Py_ssize_t parent, Py_ssize_t child,
                        Py_ssize_t index, PyObject *key)
{
    if (w->nedges == w->cap_edges) {
        rep_edge *nb = grow_buffer(w->edges, w->inline_edges, &w->cap_edges, sizeof *nb);
        if (nb == NULL) {
            return -1;
        }
        w->edges = nb;
    }
    rep_edge *e = &w->edges[w->nedges++];
    e->parent = parent;
    e->child = child;
    e->index = index;
    e->key = key ? Py_NewRef(key) : NULL;
    return 0;
}

/* ------------------------------------------------------------------ */
/* The walk                                                            */
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
static Py_ssize_t rep_walk_obj(rep_walk *w, PyObject *o, int depth);

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
static PyObject *rep_path(rep_walk *w, int depth)
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

/* The walk went deeper than DP_REPLICATE_MAX_DEPTH: RecursionError naming
 * the path. As the scatter and gather walkers (check_depth): never a
 * silent stop that would leave deeper arrays shared. */
static Py_ssize_t rep_too_deep(rep_walk *w, int depth)
{
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

/* Walk the items of list or tuple node n (o). A module's list of parameters
 * gets room for them at once (at most REP_RESERVE_MAX: a long list of plain
 * numbers adds no nodes). The list is read again at each item: the walk may
 * run Python code that changes it. */
static int rep_walk_items(rep_walk *w, Py_ssize_t n, PyObject *o, int depth)
{
    int is_list = PyList_Check(o);
    Py_ssize_t len = is_list ? PyList_GET_SIZE(o) : PyTuple_GET_SIZE(o);
    if (rep_reserve(w, len < REP_RESERVE_MAX ? len : REP_RESERVE_MAX) < 0) {
        return -1;
    }
    for (Py_ssize_t i = 0; i < (is_list ? PyList_GET_SIZE(o) : PyTuple_GET_SIZE(o)); i++) {
        PyObject *item = is_list ? PyList_GET_ITEM(o, i) : PyTuple_GET_ITEM(o, i);
        if (rep_walk_child(w, n, item, i, NULL, depth) < 0) {
            return -1;
        }
    }
    return 0;
}

/* Walk object node n (o): its __dict__ (kept in the node for the build;
 * none when it has no usable one), then its __slots__ members. */
static int rep_walk_object(rep_walk *w, Py_ssize_t n, PyObject *o, int depth)
{
    if (has_instance_dict(Py_TYPE(o))) {
        PyObject *d = PyObject_GenericGetDict(o, NULL);
        if (d == NULL || !PyDict_Check(d)) {   /* no usable __dict__ */
            PyErr_Clear();
            Py_XDECREF(d);
        } else {
            w->nodes[n].dict = d;
            if (rep_walk_dict(w, n, d, depth) < 0) {
                return -1;
            }
        }
    }
    return rep_walk_slots(w, n, o, depth);
}

static Py_ssize_t rep_walk_obj(rep_walk *w, PyObject *o, int depth)
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
        return rep_too_deep(w, depth);
    }
    n = rep_add_node(w, o, kind);
    if (n < 0) {
        return RK_ERROR;
    }
    int rc = 0;
    switch (kind) {
    case RK_ARRAY:
        w->nodes[n].array_index = PyList_GET_SIZE(w->arrays);
        rc = rep_add_array(w, o, depth);
        break;
    case RK_LIST:
    case RK_LIST_SUB:
    case RK_TUPLE:
    case RK_NAMEDTUPLE:
        rc = rep_walk_items(w, n, o, depth + 1);
        break;
    case RK_DICT:
    case RK_DICT_SUB:
        rc = rep_walk_dict(w, n, o, depth + 1);
        break;
    case RK_OBJECT:
        rc = rep_walk_object(w, n, o, depth + 1);
        break;
    }
    return rc < 0 ? RK_ERROR : n;
}

/* After the walk: mark every node with an array below it, and group the
 * edges that lead to arrays by parent (w->sorted). */
static int rep_link(rep_walk *w)
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

/* ------------------------------------------------------------------ */
/* The build                                                           */
/* ------------------------------------------------------------------ */

/* The path of node n from the module (new str): w->path filled back from
 * the edges that lead to it (error messages only). */
static PyObject *node_path(rep_walk *w, Py_ssize_t n)
{
    int depth = 0;
    for (Py_ssize_t c = n; c != 0 && depth < DP_REPLICATE_MAX_DEPTH;) {
        Py_ssize_t e = 0;
        while (e < w->nedges && w->edges[e].child != c) {
            e++;
        }
        if (e == w->nedges) {
            break;
        }
        depth++;
        for (int d = depth; d > 1; d--) {
            w->path[d] = w->path[d - 1];
        }
        w->path[1].parent_kind = w->nodes[w->edges[e].parent].kind;
        w->path[1].index = w->edges[e].index;
        w->path[1].key = w->edges[e].key;
        c = w->edges[e].parent;
    }
    return rep_path(w, depth);
}

/* The pending error of copy.copy(node n's object), re-raised (same type,
 * the original as __cause__) naming its path (docs/libraries.md, "Probing"). */
static void name_copy_error(rep_walk *w, Py_ssize_t n)
{
    if (!PyErr_ExceptionMatches(PyExc_Exception)) {
        return;   /* KeyboardInterrupt: as it is */
    }
    PyObject *t, *v, *tb;
    PyErr_Fetch(&t, &v, &tb);
    PyErr_NormalizeException(&t, &v, &tb);
    PyObject *path = node_path(w, n);
    PyObject *msg = path != NULL && v != NULL ? PyUnicode_FromFormat(
        "%U: copy.copy() of a %.100s object (replicate makes one per device to hold that "
        "device's arrays) raised %.100s: %S", path, Py_TYPE(w->nodes[n].obj)->tp_name,
        Py_TYPE(v)->tp_name, v) : NULL;
    Py_XDECREF(path);
    PyErr_Clear();
    PyErr_Restore(t, v, tb);
    dp_reraise_msg(w->st, msg);
}

/* The shallow copy that node n's replica starts from (new reference): a
 * list or dict copied, a tuple's items as a list (made a tuple once they
 * are replaced), anything else copy.copy(obj), with the copy's __dict__ in
 * *cdict for an object whose walk read one. NULL with an exception, also
 * when copy.copy shares the object or its __dict__. */
static PyObject *rep_copy_node(rep_walk *w, Py_ssize_t n, PyObject **cdict)
{
    rep_node *node = &w->nodes[n];
    *cdict = NULL;
    switch (node->kind) {
    case RK_LIST:
        return PyList_GetSlice(node->obj, 0, PY_SSIZE_T_MAX);
    case RK_DICT:
        return PyDict_Copy(node->obj);
    case RK_TUPLE:
    case RK_NAMEDTUPLE:
        return PySequence_List(node->obj);
    default:   /* RK_LIST_SUB, RK_DICT_SUB, RK_OBJECT */
        break;
    }
    PyObject *copy = PyObject_CallOneArg(w->st->copy_copy, node->obj);
    if (copy == NULL) {
        name_copy_error(w, n);
        return NULL;
    }
    if (copy == node->obj) {
        PyErr_Format(PyExc_TypeError,
                     "replicate: copy.copy() returned the same %.100s object; a module "
                     "object holding arrays must be copyable (check its __copy__)",
                     Py_TYPE(node->obj)->tp_name);
        Py_DECREF(copy);
        return NULL;
    }
    if (node->kind == RK_OBJECT && node->dict != NULL) {
        *cdict = PyObject_GenericGetDict(copy, NULL);
        if (*cdict != NULL && (*cdict == node->dict || !PyDict_Check(*cdict))) {
            PyErr_Format(PyExc_TypeError,
                         "replicate: copy.copy() of a %.100s object shares its __dict__; a "
                         "module object holding arrays must be copyable (check its __copy__)",
                         Py_TYPE(node->obj)->tp_name);
            Py_CLEAR(*cdict);
        }
        if (*cdict == NULL) {
            Py_DECREF(copy);
            return NULL;
        }
    }
    return copy;
}

/* Put v (stolen), the replica of the child of edge ed, in copy, the
 * replica under construction of a node of kind (cdict: its __dict__ copy
 * for an object). 0, or -1 with an exception. */
static int rep_set_child(int kind, PyObject *copy, PyObject *cdict, const rep_edge *ed,
                         PyObject *v)
{
    int rc = 0;
    switch (kind) {
    case RK_LIST:
    case RK_TUPLE:
    case RK_NAMEDTUPLE:
        if (ed->index < PyList_GET_SIZE(copy)) {
            return PyList_SetItem(copy, ed->index, v);   /* steals v */
        }
        break;
    case RK_LIST_SUB:
        rc = PySequence_SetItem(copy, ed->index, v);
        break;
    case RK_DICT:
        rc = PyDict_SetItem(copy, ed->key, v);
        break;
    case RK_DICT_SUB:
        rc = PyObject_SetItem(copy, ed->key, v);
        break;
    default:   /* RK_OBJECT */
        if (ed->index == REP_SLOT_EDGE) {
            rc = Py_TYPE(ed->key)->tp_descr_set(ed->key, copy, v);
        } else {
            rc = PyDict_SetItem(cdict, ed->key, v);
        }
        break;
    }
    Py_DECREF(v);
    return rc;
}

static PyObject *rep_build(rep_walk *w, Py_ssize_t n, PyObject *arrays_d, PyObject **memo);

/* Build the replicas of node n's children on paths to arrays and put each
 * in copy (cdict: an object's __dict__ copy). 0, or -1 with an exception. */
static int rep_build_children(rep_walk *w, Py_ssize_t n, PyObject *copy, PyObject *cdict,
                              PyObject *arrays_d, PyObject **memo)
{
    Py_ssize_t first = w->nodes[n].first_edge, end = first + w->nodes[n].nedges;
    for (Py_ssize_t e = first; e < end; e++) {
        const rep_edge *ed = &w->sorted[e];
        PyObject *v = rep_build(w, ed->child, arrays_d, memo);
        if (v == NULL || rep_set_child(w->nodes[n].kind, copy, cdict, ed, v) < 0) {
            return -1;
        }
    }
    return 0;
}

/* A tuple or namedtuple node's replica from the list of its items (stolen):
 * tuple(items), or type(obj)._make(items). NULL with an exception. */
static PyObject *rep_tuple_from_items(rep_walk *w, Py_ssize_t n, PyObject *items)
{
    rep_node *node = &w->nodes[n];
    PyObject *made = node->kind == RK_TUPLE
                     ? PyList_AsTuple(items)
                     : PyObject_CallMethod((PyObject *)Py_TYPE(node->obj), "_make", "O", items);
    Py_DECREF(items);
    return made;
}

/* The replica of node n for one device (new reference). arrays_d: that
 * device's broadcast arrays; memo: one slot per node (NULL, REP_BUSY or a
 * new reference), so objects reachable twice stay one object. */
static PyObject *rep_build(rep_walk *w, Py_ssize_t n, PyObject *arrays_d, PyObject **memo)
{
    rep_node *node = &w->nodes[n];
    if (!node->has_array || memo[n] == REP_BUSY) {
        return Py_NewRef(node->obj);
    }
    if (memo[n] != NULL) {
        return Py_NewRef(memo[n]);
    }
    if (node->kind == RK_ARRAY) {
        PyObject *copy = PyList_GET_ITEM(arrays_d, node->array_index);
        memo[n] = Py_NewRef(copy);
        return Py_NewRef(copy);
    }
    if (Py_EnterRecursiveCall(" while replicating a module")) {
        return NULL;
    }
    int is_tuple = node->kind == RK_TUPLE || node->kind == RK_NAMEDTUPLE;
    PyObject *cdict;
    PyObject *copy = rep_copy_node(w, n, &cdict);
    if (copy != NULL) {
        /* A tuple is made from its items last: until then a path back to
         * it (a cycle) shares the original. */
        memo[n] = is_tuple ? REP_BUSY : Py_NewRef(copy);
        if (rep_build_children(w, n, copy, cdict, arrays_d, memo) < 0) {
            Py_CLEAR(copy);
        } else if (is_tuple) {
            copy = rep_tuple_from_items(w, n, copy);
            if (copy != NULL) {
                memo[n] = Py_NewRef(copy);
            }
        }
    }
    Py_LeaveRecursiveCall();
    Py_XDECREF(cdict);
    if (copy == NULL && memo[n] == REP_BUSY) {
        memo[n] = NULL;
    }
    return copy;
}

/* dpmini._torch.replicate(module, devices, detach=None): a torch.nn.Module's
 * replicas by torch's rules (docs/spec.md 5); detach None follows grad mode. */
static PyObject *replicate_torch(dp_state *st, PyObject *module, const dp_device *devs,
                                 Py_ssize_t ndev)
{
    PyObject *ids = PyList_New(ndev), *args = NULL, *res = NULL;
    for (Py_ssize_t d = 0; ids != NULL && d < ndev; d++) {
        PyObject *dev = dp_device_to_object(st, devs[d]);
        if (dev == NULL) {
            Py_CLEAR(ids);
            break;
        }
        PyList_SET_ITEM(ids, d, dev);
    }
    args = ids != NULL ? PyTuple_Pack(3, module, ids, Py_None) : NULL;
    if (args != NULL) {
        res = dp_torch_call("replicate", args, NULL);
    }
    Py_XDECREF(args);
    Py_XDECREF(ids);
    if (res != NULL && !PyList_Check(res)) {
        PyErr_Format(PyExc_TypeError, "replicate: dpmini._torch.replicate returned %.100s, "
                     "not a list", Py_TYPE(res)->tp_name);
        Py_CLEAR(res);
    }
    return res;
}

/* Walk module: its root node, RK_LEAF when it is not a node (plain
 * callables: functions, builtins, bound methods hold no arrays and are not
 * walked), RK_ERROR with an exception. */
static Py_ssize_t rep_walk_module(rep_walk *w, PyObject *module, const dp_device *devs,
                                  Py_ssize_t ndev)
{
    if (PyFunction_Check(module) || PyCFunction_Check(module) || PyMethod_Check(module)) {
        return RK_LEAF;
    }
    w->share_torch = 1;
    for (Py_ssize_t d = 0; d < ndev; d++) {
        w->share_torch &= devs[d].kind == DP_VCPU;
    }
    w->arrays = PyList_New(0);
    w->leaves = PyList_New(0);
    w->origins = PyList_New(0);
    if (w->arrays == NULL || w->leaves == NULL || w->origins == NULL) {
        return RK_ERROR;
    }
    return rep_walk_obj(w, module, 0);
}

/* The walk's arrays broadcast to devs[0..ndev) (a list of ndev lists, one
 * copy of each array per device), or NULL with an exception. */
static PyObject *rep_broadcast(rep_walk *w, const dp_device *devs, Py_ssize_t ndev)
{
    PyObject *bc = dp_broadcast_coalesced(w->st, w->arrays, devs, ndev, DP_BROADCAST_BUFFER);
    if (bc == NULL) {
        return NULL;
    }
    int ok = PyList_Check(bc) && PyList_GET_SIZE(bc) == ndev;
    for (Py_ssize_t d = 0; ok && d < ndev; d++) {
        PyObject *arrays_d = PyList_GET_ITEM(bc, d);
        ok = PyList_Check(arrays_d) && PyList_GET_SIZE(arrays_d) == PyList_GET_SIZE(w->arrays);
    }
    if (!ok) {
        PyErr_SetString(PyExc_SystemError, "replicate: broadcast_coalesced returned a bad list");
        Py_CLEAR(bc);
    }
    return bc;
}

/* Empty the memo between devices (REP_BUSY slots hold no reference). */
static void memo_clear(PyObject **memo, Py_ssize_t n)
{
    for (Py_ssize_t i = 0; i < n; i++) {
        if (memo[i] != REP_BUSY) {
            Py_XDECREF(memo[i]);
        }
        memo[i] = NULL;
    }
}

/* After the walk found arrays below root: broadcast them and build one
 * replica per device into result (a list of ndev empty slots). 0, or -1
 * with an exception. */
static int rep_build_replicas(rep_walk *w, Py_ssize_t root, const dp_device *devs,
                              Py_ssize_t ndev, PyObject *result)
{
    if (rep_link(w) < 0) {
        return -1;
    }
    PyObject *bc = rep_broadcast(w, devs, ndev);
    if (bc == NULL) {
        return -1;
    }
    PyObject **memo = PyMem_Calloc((size_t)w->nnodes, sizeof *memo);
    if (memo == NULL) {
        Py_DECREF(bc);
        PyErr_NoMemory();
        return -1;
    }
    int rc = 0;
    for (Py_ssize_t d = 0; d < ndev && rc == 0; d++) {
        PyObject *arrays_d = PyList_GET_ITEM(bc, d);
        PyObject *rep = NULL;
        if (dp_replicas_leaves(w->st, arrays_d, w->arrays, w->leaves, w->origins) == 0) {
            rep = rep_build(w, root, arrays_d, memo);
        }
        memo_clear(memo, w->nnodes);
        if (rep == NULL) {
            rc = -1;
        } else {
            PyList_SET_ITEM(result, d, rep);
        }
    }
    PyMem_Free(memo);
    Py_DECREF(bc);
    return rc;
}

/* replicate(module, devs[0..ndev)) -> list of ndev replicas (docs/spec.md 5,
 * dpmini's rules in the header comment). ndev may be 0. */
static PyObject *replicate_core_steps(dp_state *st, PyObject *module, const dp_device *devs,
                                      Py_ssize_t ndev)
{
    PyObject *result = PyList_New(ndev);
    if (result == NULL || ndev == 0) {
        return result;
    }
    /* A torch.nn.Module: torch's own rule (docs/spec.md 5), in dpmini/_torch.py. */
    int torch_mod = dp_is_torch_module(module);
    if (torch_mod != 0) {
        Py_SETREF(result, torch_mod < 0 ? NULL : replicate_torch(st, module, devs, ndev));
        return result;
    }
    rep_walk w;
    rep_walk_init(&w, st);
    Py_ssize_t root = rep_walk_module(&w, module, devs, ndev);
    if (root == RK_ERROR) {
        Py_CLEAR(result);
    } else if (root < 0 || PyList_GET_SIZE(w.arrays) == 0) {
        for (Py_ssize_t d = 0; d < ndev; d++) {   /* no arrays: the module itself */
            PyList_SET_ITEM(result, d, Py_NewRef(module));
        }
    } else if (rep_build_replicas(&w, root, devs, ndev, result) < 0) {
        Py_CLEAR(result);
    }
    rep_walk_free(&w);
    return result;
}

/* replicate_core under dpmini.profile(): one span around it (profile.h). */
PyObject *replicate_core(dp_state *st, PyObject *module, const dp_device *devs,
                         Py_ssize_t ndev)
{
    dp_prof_span sp;
    dp_prof_begin(&sp, DP_PROF_REPLICATE);
    PyObject *res = replicate_core_steps(st, module, devs, ndev);
    dp_prof_end(&sp, NULL);
    return res;
}

/* replicate's device argument: an empty sequence gives n = 0 (no error). */
static int replicate_devices(dp_state *st, PyObject *obj, dp_device **devs, Py_ssize_t *n)
{
    *devs = NULL;
    *n = 0;
    if ((PyList_Check(obj) || PyTuple_Check(obj)) && PySequence_Size(obj) == 0) {
        return 0;
    }
    return dp_device_list_from_object(st, obj, "devices", devs, n);
}

PyDoc_STRVAR(replicate_doc,
"replicate(module, devices, detach=False)\n--\n\n"
"Returns a list of replicas.\n"
"One replica of module per device, in order (PyTorch replicate, docs/spec.md 5).\n"
"devices: a sequence of devices ('cpu:N', 'cuda:N', int, dpmini.Device); an\n"
"empty sequence gives []. Arrays reachable from module through instance\n"
"__dict__ attributes, __slots__ members (of every class in the MRO), lists,\n"
"tuples, namedtuples, dicts (and their subclasses) and sub-objects (depth\n"
"<= 512; deeper raises RecursionError naming the path) are\n"
"broadcast with one broadcast_coalesced call (10 MiB buckets); replica d is a\n"
"shallow copy (copy.copy; lists/dicts/tuples rebuilt) of every object on a\n"
"path to an array, with the arrays replaced by device d's copies. Objects\n"
"with no array below them are shared, and an object reachable twice is one\n"
"object in each replica. A module holding no arrays (functions, builtins,\n"
"bound methods, plain objects) is returned as the same object for every\n"
"device. The replica on devices[0] holds the original arrays where they\n"
"already live there (docs/spec.md 5.6). Arrays of other libraries (torch, JAX, CuPy,\n"
"dpmini.Array: anything with __dlpack__/__dlpack_device__ or\n"
"__cuda_array_interface__) are copied the same way and stay of their type. A\n"
"torch.nn.Module is replicated by PyTorch's rules (docs/spec.md 5.5-5.7, dpmini._torch):\n"
"module._replicate_for_data_parallel() per submodule and device (a shallow\n"
"__dict__ copy: Python attributes and containers are shared), parameters as\n"
"differentiable broadcast copies (their gradients summed onto the original;\n"
"with detach=True, or detach=None under torch.no_grad(), plain copies, which\n"
"on virtual CPU devices share the original's host memory), buffers shared by\n"
"the replica on devices[0] and copied for the others (docs/libraries.md,\n"
"'torch.nn.Module replicas'). detach applies to torch modules only. Errors:\n"
"ValueError/TypeError for bad devices; TypeError when an object with arrays\n"
"cannot be copied, or for a tensor that requires grad (naming its path,\n"
"e.g. module.w); a non-AttributeError raised while probing an attribute for\n"
"the array protocols, re-raised naming its path (module.cfg).");

PyObject *replicate_common(dp_state *st, PyObject *module, PyObject *devices)
{
    dp_device *devs = NULL;
    Py_ssize_t n = 0;
    if (replicate_devices(st, devices, &devs, &n) < 0) {
        return NULL;
    }
    PyObject *res = replicate_core(st, module, devs, n);
    PyMem_Free(devs);
    return res;
}


/* ------------------------------------------------------------------ */
/* Public functions: module level                                      */
/* ------------------------------------------------------------------ */

static PyObject *py_replicate(PyObject *mod, PyObject *args, PyObject *kwargs)
{
    static char *kwlist[] = {"module", "devices", "detach", NULL};
    PyObject *module, *devices;
    int detach = 0;
    dp_state *st = dp_state_from_module(mod);
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "OO|p:replicate", kwlist,
                                     &module, &devices, &detach)) {
        return NULL;
    }
    int torch_mod = dp_is_torch_module(module);
    if (torch_mod) {
        return torch_mod < 0 ? NULL : dp_torch_call("replicate", args, kwargs);
    }
    return replicate_common(st, module, devices);
}

PyMethodDef dp_replicate_methods[] = {
    {"replicate", (PyCFunction)(void (*)(void))py_replicate, METH_VARARGS | METH_KEYWORDS,
     replicate_doc},
    {NULL, NULL, 0, NULL},
};
