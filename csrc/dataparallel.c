/* dataparallel.c - dpmini.DataParallel and the functional replicate,
 * parallel_apply and data_parallel (spec §1, §2, §5, §6; docs/design.md).
 *
 * DataParallel.forward runs, in order (spec §2):
 *   scatter (tree.c) -> no arguments: ((),) / ({},) -> one device: call the
 *   module on piece 0, no gather -> replicate onto device_ids[:k] ->
 *   parallel_apply on the device worker threads (pool.c) -> gather (tree.c).
 * On the exact type the four steps are the C functions below; on a Python
 * subclass they are looked up on self, so overriding any of them works.
 *
 * replicate: the arrays reachable from the module (instance __dict__s,
 * lists, tuples, dicts) are broadcast in one coalesced call (comm.c); each
 * replica is a shallow copy of every object on a path to an array, with the
 * arrays swapped for that device's copies. Everything else is shared.
 *
 * parallel_apply: replica i runs on the persistent worker of its device,
 * which takes the GIL and enters a copy of the caller's contextvars context
 * (the analogue of PyTorch copying grad mode, spec 6.2). The caller waits
 * with the GIL released, in 50 ms slices so that Ctrl-C still works.
 */
#include "dpmini.h"

#include <structmember.h>
#include <string.h>

/* ------------------------------------------------------------------ */
/* Types                                                               */
/* ------------------------------------------------------------------ */

#define DP_REPLICATE_MAX_DEPTH 64        /* containers deeper are shared */
#define DP_BROADCAST_BUFFER ((size_t)10485760)  /* 10 MiB, spec 5.3 */
#define DP_WAIT_SLICE_MS 50              /* signal checks while waiting  */
#define DP_SMALL_JOBS 8                  /* replicas without heap memory */

typedef struct {
    PyObject_HEAD
    PyObject *module;          /* the wrapped callable; Py_None before __init__ */
    dp_device *devs;           /* device_ids, PyMem_Malloc'ed; NULL before __init__ */
    Py_ssize_t ndev;           /* len(device_ids); >= 1 once devs is set */
    dp_device output_device;   /* gather target; may be the host */
    int dim;                   /* scatter/gather dim as given (wrapped per array) */
    int strict;                /* 1: different chunk counts raise (tree.c) */
    PyObject *dict;            /* instance __dict__ (tp_dictoffset); may be NULL */
    PyObject *weakreflist;     /* weak references (tp_weaklistoffset); may be NULL */
} dp_DataParallelObject;

/* One replica call of parallel_apply. Owned by the caller (on its stack or
 * PyMem); a worker touches it only while the caller waits for the batch. */
enum { JOB_QUEUED = 0, JOB_RUNNING = 1, JOB_DONE = 2 };

typedef struct {
    PyObject *module;      /* owned: the replica to call                      */
    PyObject *args;        /* owned: exact tuple of positional arguments      */
    PyObject *kwargs;      /* owned: exact dict, or NULL                      */
    PyObject *ctx;         /* owned: copy of the caller's context (worker jobs) */
    PyObject *result;      /* owned: the return value, once the job succeeded */
    PyObject *exc;         /* owned: the exception raised (traceback attached) */
    dp_device dev;         /* the replica's device                            */
    unsigned long ident;   /* thread running it; valid while JOB_RUNNING      */
    int state;             /* JOB_*; read and written with the GIL held       */
    int on_worker;         /* 1: submitted to the device worker; 0: inline    */
    int cancelled;         /* caller (GIL held): skip the call if not started */
    int interrupted;       /* caller (GIL held): an async exception was sent  */
} apply_job;

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

typedef struct {
    Py_ssize_t parent, child;  /* node indices                                */
    Py_ssize_t index;          /* list/tuple position                         */
    PyObject *key;             /* owned: dict key or attribute name; NULL for
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

#define REP_INLINE_NODES 8
#define REP_INLINE_EDGES 16
typedef struct {
    dp_state *st;
    rep_node *nodes;           /* nodes[0] is the root when it is a node      */
    Py_ssize_t nnodes, cap_nodes;
    rep_edge *edges;           /* every parent -> node edge, in walk order    */
    Py_ssize_t nedges, cap_edges;
    rep_edge *sorted;          /* edges to array paths, grouped by parent     */
    PyObject *arrays;          /* owned list: arrays found, deduplicated      */
    ptrmap map;
    rep_node inline_nodes[REP_INLINE_NODES];
    rep_edge inline_edges[REP_INLINE_EDGES];
} rep_walk;

/* Marks a tuple replica under construction (a cycle back to it is shared). */
static char rep_busy_marker;
#define REP_BUSY ((PyObject *)(void *)&rep_busy_marker)

/* Per thread: the worker keeps its Python thread state between jobs, and
 * a replica running on a worker runs nested parallel_apply calls inline. */
static _Thread_local int tl_gil_pinned;
static _Thread_local int tl_replica_depth;

/* ------------------------------------------------------------------ */
/* Helpers: exceptions                                                 */
/* ------------------------------------------------------------------ */

/* The exception being raised, as an instance with its traceback attached
 * (new reference); the error indicator is cleared. Never NULL. */
static PyObject *take_exception(void)
{
    PyObject *exc;
    if (!PyErr_Occurred()) {
        PyErr_SetString(PyExc_SystemError, "a replica failed without setting an exception");
    }
#if PY_VERSION_HEX >= 0x030C0000
    exc = PyErr_GetRaisedException();
#else
    PyObject *type, *tb;
    PyErr_Fetch(&type, &exc, &tb);
    PyErr_NormalizeException(&type, &exc, &tb);
    if (exc != NULL && tb != NULL) {
        PyException_SetTraceback(exc, tb);
    }
    Py_XDECREF(type);
    Py_XDECREF(tb);
    if (exc == NULL) {
        exc = PyObject_CallNoArgs(PyExc_SystemError);
        if (exc == NULL) {   /* out of memory: keep whatever that raised */
            return take_exception();
        }
    }
#endif
    return exc;
}

/* Raise exc again (steals the reference). */
static void restore_exception(PyObject *exc)
{
#if PY_VERSION_HEX >= 0x030C0000
    PyErr_SetRaisedException(exc);
#else
    PyErr_Restore(Py_NewRef((PyObject *)Py_TYPE(exc)), exc, PyException_GetTraceback(exc));
#endif
}

/* msg as a str whose repr() is itself, so that str(KeyError(m)) shows the
 * text unquoted (PyTorch's KeyErrorMessage, spec 6.5). Falls back to msg. */
static PyObject *keyerror_message(PyObject *msg)
{
    PyObject *str_str = NULL, *ns = NULL, *tp = NULL, *res = NULL;
    str_str = PyObject_GetAttrString((PyObject *)&PyUnicode_Type, "__str__");
    ns = Py_BuildValue("{sOss}", "__repr__", str_str ? str_str : Py_None,
                       "__module__", "dpmini");
    if (str_str == NULL || ns == NULL) {
        goto fail;
    }
    /* Made per error (rare); a str subclass with __repr__ = str.__str__. */
    tp = PyObject_CallFunction((PyObject *)&PyType_Type, "s(O)O", "KeyErrorMessage",
                               (PyObject *)&PyUnicode_Type, ns);
    if (tp == NULL) {
        goto fail;
    }
    res = PyObject_CallOneArg(tp, msg);
fail:
    if (res == NULL) {
        PyErr_Clear();
        res = Py_NewRef(msg);
    }
    Py_XDECREF(str_str);
    Py_XDECREF(ns);
    Py_XDECREF(tp);
    return res;
}

/* Re-raise exc, raised by replica i on dev, as PyTorch's ExceptionWrapper
 * does (spec 6.5): same type, message "Caught T in replica i on device d.\n
 * Original Traceback (most recent call last):\n...", the original as
 * __cause__; RuntimeError when the type cannot be built from one string.
 * Exceptions that are not Exception subclasses (KeyboardInterrupt,
 * SystemExit) are re-raised unchanged. */
static void raise_replica_error(dp_state *st, PyObject *exc, Py_ssize_t i, dp_device dev)
{
    PyObject *tp = (PyObject *)Py_TYPE(exc);
    PyObject *tb = NULL, *lines = NULL, *empty = NULL, *text = NULL, *name = NULL;
    PyObject *msg = NULL, *arg = NULL, *attr = NULL, *kw = NULL, *noargs = NULL;
    PyObject *wrapped = NULL;
    char devbuf[32];

    if (!PyObject_IsInstance(exc, PyExc_Exception)) {
        restore_exception(Py_NewRef(exc));
        return;
    }
    dp_device_format(dev, devbuf, sizeof devbuf);

    tb = PyException_GetTraceback(exc);
    lines = PyObject_CallFunctionObjArgs(st->format_exception, tp, exc,
                                         tb ? tb : Py_None, NULL);
    empty = PyUnicode_FromStringAndSize(NULL, 0);
    if (lines != NULL && empty != NULL) {
        text = PyUnicode_Join(empty, lines);
    }
    if (text == NULL) {   /* formatting failed: fall back to str(exc) */
        PyErr_Clear();
        text = PyUnicode_FromFormat("%s: %S\n", ((PyTypeObject *)tp)->tp_name, exc);
        if (text == NULL) {
            goto fail;
        }
    }
    name = PyObject_GetAttrString(tp, "__name__");
    if (name == NULL) {
        goto fail;
    }
    {
        static const char head[] = "Traceback (most recent call last):\n";
        PyObject *prefix = PyUnicode_FromString(head);
        if (prefix == NULL) {
            goto fail;
        }
        Py_ssize_t starts = PyUnicode_Tailmatch(text, prefix, 0, PY_SSIZE_T_MAX, -1);
        if (starts < 0) {
            Py_DECREF(prefix);
            goto fail;
        }
        if (starts) {
            msg = PyUnicode_FromFormat("Caught %U in replica %zd on device %s.\nOriginal %U",
                                       name, i, devbuf, text);
        } else {   /* no Python frame (e.g. a builtin replica): keep the shape */
            msg = PyUnicode_FromFormat("Caught %U in replica %zd on device %s.\nOriginal %U%U",
                                       name, i, devbuf, prefix, text);
        }
        Py_DECREF(prefix);
    }
    if (msg == NULL) {
        goto fail;
    }

    if (tp == PyExc_KeyError) {
        arg = keyerror_message(msg);
    } else {
        arg = Py_NewRef(msg);
    }
    attr = PyObject_GetAttrString(tp, "message");
    if (attr == NULL) {
        PyErr_Clear();
    }
    if (attr != NULL && PyObject_IsTrue(attr) == 1) {
        noargs = PyTuple_New(0);
        kw = Py_BuildValue("{sO}", "message", arg);
        if (noargs != NULL && kw != NULL) {
            wrapped = PyObject_Call(tp, noargs, kw);
        }
    } else {
        PyErr_Clear();
        wrapped = PyObject_CallOneArg(tp, arg);
    }
    if (wrapped != NULL && !PyExceptionInstance_Check(wrapped)) {
        Py_CLEAR(wrapped);
    }
    if (wrapped == NULL) {
        if (PyErr_Occurred() && !PyErr_ExceptionMatches(PyExc_Exception)) {
            goto fail;   /* e.g. KeyboardInterrupt while building it: keep it */
        }
        PyErr_Clear();
        wrapped = PyObject_CallOneArg(PyExc_RuntimeError, msg);
        if (wrapped == NULL) {
            goto fail;
        }
    }
    PyException_SetCause(wrapped, Py_NewRef(exc));
    PyErr_SetObject((PyObject *)Py_TYPE(wrapped), wrapped);
fail:
    Py_XDECREF(tb);
    Py_XDECREF(lines);
    Py_XDECREF(empty);
    Py_XDECREF(text);
    Py_XDECREF(name);
    Py_XDECREF(msg);
    Py_XDECREF(arg);
    Py_XDECREF(attr);
    Py_XDECREF(kw);
    Py_XDECREF(noargs);
    Py_XDECREF(wrapped);
}

/* ------------------------------------------------------------------ */
/* Helpers: arguments                                                  */
/* ------------------------------------------------------------------ */

/* A gather target: "cpu"/-1 (host; -1 warns FutureWarning, spec 4.3) or a
 * device. */
static int parse_target_device(dp_state *st, PyObject *obj, const char *argname,
                               dp_device *out)
{
    if (dp_device_from_object(st, obj, argname, DP_DEV_ALLOW_HOST, out) < 0) {
        return -1;
    }
    if (PyLong_Check(obj) && out->kind == DP_HOST &&
        PyErr_WarnEx(PyExc_FutureWarning,
                     "Using -1 to represent CPU tensor is deprecated. Please use a "
                     "device object or string instead, e.g., \"cpu\".", 1) < 0) {
        return -1;
    }
    return 0;
}

/* A new list of dpmini.Device for devs[0..n). */
static PyObject *device_list(dp_state *st, const dp_device *devs, Py_ssize_t n)
{
    PyObject *list = PyList_New(n);
    if (list == NULL) {
        return NULL;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *d = dp_device_to_object(st, devs[i]);
        if (d == NULL) {
            Py_DECREF(list);
            return NULL;
        }
        PyList_SET_ITEM(list, i, d);
    }
    return list;
}

/* One replica's positional arguments as an exact tuple (new reference):
 * a list or tuple is unpacked, anything else becomes (input,) (spec 6.3). */
static PyObject *input_as_args(PyObject *input)
{
    if (PyTuple_CheckExact(input)) {
        return Py_NewRef(input);
    }
    if (PyTuple_Check(input) || PyList_Check(input)) {
        return PySequence_Tuple(input);
    }
    return PyTuple_Pack(1, input);
}

/* One replica's keyword arguments as an exact dict or NULL (*out, new
 * reference). None is no keywords. */
static int kwargs_as_dict(PyObject *kw, const char *what, Py_ssize_t i, PyObject **out)
{
    *out = NULL;
    if (kw == NULL || kw == Py_None) {
        return 0;
    }
    if (PyDict_CheckExact(kw)) {
        *out = Py_NewRef(kw);
        return 0;
    }
    if (!PyMapping_Check(kw) || PySequence_Check(kw)) {
        PyErr_Format(PyExc_TypeError, "%s[%zd]: expected a dict of keyword arguments, got %.100s",
                     what, i, Py_TYPE(kw)->tp_name);
        return -1;
    }
    PyObject *d = PyDict_New();
    if (d == NULL || PyDict_Update(d, kw) < 0) {
        Py_XDECREF(d);
        return -1;
    }
    *out = d;
    return 0;
}

/* Call module(*inputs[0], **kwargs[0]) (the one-device path, spec 2.5). */
static PyObject *call_first(PyObject *module, PyObject *inputs, PyObject *kwargs)
{
    PyObject *args = NULL, *kw = NULL, *res = NULL;
    if (PyTuple_GET_SIZE(inputs) > 0) {
        args = input_as_args(PyTuple_GET_ITEM(inputs, 0));
    } else {
        args = PyTuple_New(0);
    }
    if (args == NULL) {
        goto fail;
    }
    if (PyTuple_GET_SIZE(kwargs) > 0 &&
        kwargs_as_dict(PyTuple_GET_ITEM(kwargs, 0), "kwargs", 0, &kw) < 0) {
        goto fail;
    }
    res = PyObject_Call(module, args, kw);
fail:
    Py_XDECREF(args);
    Py_XDECREF(kw);
    return res;
}

/* Spec 2.4: a call with no arguments at all runs the module once, as
 * ((),) / ({},). Replaces *inputs and *kwargs (tuples) when both are empty. */
static int fix_empty_call(PyObject **inputs, PyObject **kwargs)
{
    if (PyTuple_GET_SIZE(*inputs) != 0 || PyTuple_GET_SIZE(*kwargs) != 0) {
        return 0;
    }
    PyObject *noargs = PyTuple_New(0);
    PyObject *nokw = PyDict_New();
    PyObject *in = NULL, *kw = NULL;
    if (noargs != NULL && nokw != NULL) {
        in = PyTuple_Pack(1, noargs);
        kw = PyTuple_Pack(1, nokw);
    }
    Py_XDECREF(noargs);
    Py_XDECREF(nokw);
    if (in == NULL || kw == NULL) {
        Py_XDECREF(in);
        Py_XDECREF(kw);
        return -1;
    }
    Py_SETREF(*inputs, in);
    Py_SETREF(*kwargs, kw);
    return 0;
}

/* ------------------------------------------------------------------ */
/* Helpers: replicate                                                  */
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
    w->arrays = NULL;
    ptrmap_init(&w->map);
}

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
    ptrmap_free(&w->map);
}

/* Double a buffer that may still be the inline one. */
static void *grow_buffer(void *buf, const void *inline_buf, Py_ssize_t *cap, size_t elsize)
{
    Py_ssize_t ncap = *cap * 2;
    void *nb;
    if (buf == inline_buf) {
        nb = PyMem_Malloc((size_t)ncap * elsize);
        if (nb != NULL) {
            memcpy(nb, buf, (size_t)*cap * elsize);
        }
    } else {
        nb = PyMem_Realloc(buf, (size_t)ncap * elsize);
    }
    if (nb == NULL) {
        PyErr_NoMemory();
        return NULL;
    }
    *cap = ncap;
    return nb;
}

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

/* key: borrowed, or NULL for a position. */
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

static int is_namedtuple_type(PyTypeObject *tp)
{
    return PyObject_HasAttrString((PyObject *)tp, "_fields") &&
           PyObject_HasAttrString((PyObject *)tp, "_make");
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

static int rep_classify(dp_state *st, PyObject *o)
{
    PyTypeObject *tp = Py_TYPE(o);
    if (o == Py_None || tp == &PyLong_Type || tp == &PyFloat_Type || tp == &PyUnicode_Type ||
        tp == &PyBool_Type || tp == &PyBytes_Type || tp == &PyComplex_Type) {
        return RK_LEAF;
    }
    int r = dp_is_array_leaf(st, o);
    if (r < 0 && PyErr_Occurred()) {
        return RK_ERROR;
    }
    if (r > 0) {
        return RK_ARRAY;
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
        return is_namedtuple_type(tp) ? RK_NAMEDTUPLE : RK_LEAF;
    }
    if (PyType_Check(o) || PyModule_Check(o) || PyFunction_Check(o) || PyCFunction_Check(o) ||
        PyMethod_Check(o) || PyInstanceMethod_Check(o) || !has_instance_dict(tp)) {
        return RK_LEAF;
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

static Py_ssize_t rep_walk_obj(rep_walk *w, PyObject *o, int depth)
{
    Py_ssize_t n = ptrmap_get(&w->map, o);
    if (n >= 0) {
        return n;
    }
    int kind = rep_classify(w->st, o);
    if (kind == RK_ERROR || kind == RK_LEAF) {
        return kind;
    }
    if (kind != RK_ARRAY && depth >= DP_REPLICATE_MAX_DEPTH) {
        return RK_LEAF;
    }
    n = rep_add_node(w, o, kind);
    if (n < 0) {
        return RK_ERROR;
    }
    switch (kind) {
    case RK_ARRAY:
        w->nodes[n].array_index = PyList_GET_SIZE(w->arrays);
        if (PyList_Append(w->arrays, o) < 0) {
            return RK_ERROR;
        }
        break;
    case RK_LIST:
    case RK_LIST_SUB:
        for (Py_ssize_t i = 0; i < PyList_GET_SIZE(o); i++) {
            if (rep_walk_child(w, n, PyList_GET_ITEM(o, i), i, NULL, depth + 1) < 0) {
                return RK_ERROR;
            }
        }
        break;
    case RK_TUPLE:
    case RK_NAMEDTUPLE:
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
        PyObject *d = PyObject_GenericGetDict(o, NULL);
        if (d == NULL || !PyDict_Check(d)) {   /* no usable __dict__: shared */
            PyErr_Clear();
            Py_XDECREF(d);
            break;
        }
        w->nodes[n].dict = d;
        if (rep_walk_dict(w, n, d, depth + 1) < 0) {
            return RK_ERROR;
        }
        break;
    }
    }
    return n;
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

/* The replica of node n for one device (new reference). arrays_d: that
 * device's broadcast arrays; memo: one slot per node (NULL, REP_BUSY or a
 * new reference), so objects reachable twice stay one object. */
static PyObject *rep_build(rep_walk *w, Py_ssize_t n, PyObject *arrays_d, PyObject **memo)
{
    rep_node *node = &w->nodes[n];
    PyObject *copy = NULL, *cdict = NULL, *v = NULL, *made = NULL;

    if (!node->has_array || memo[n] == REP_BUSY) {
        return Py_NewRef(node->obj);
    }
    if (memo[n] != NULL) {
        return Py_NewRef(memo[n]);
    }
    if (node->kind == RK_ARRAY) {
        copy = PyList_GET_ITEM(arrays_d, node->array_index);
        memo[n] = Py_NewRef(copy);
        return Py_NewRef(copy);
    }
    if (Py_EnterRecursiveCall(" while replicating a module")) {
        return NULL;
    }
    switch (node->kind) {
    case RK_LIST:
        copy = PyList_GetSlice(node->obj, 0, PY_SSIZE_T_MAX);
        break;
    case RK_DICT:
        copy = PyDict_Copy(node->obj);
        break;
    case RK_TUPLE:
    case RK_NAMEDTUPLE:
        copy = PySequence_List(node->obj);   /* items, turned into a tuple below */
        break;
    default:   /* RK_LIST_SUB, RK_DICT_SUB, RK_OBJECT */
        copy = PyObject_CallOneArg(w->st->copy_copy, node->obj);
        break;
    }
    if (copy == NULL) {
        goto fail;
    }
    if (node->kind == RK_OBJECT || node->kind == RK_LIST_SUB || node->kind == RK_DICT_SUB) {
        if (copy == node->obj) {
            PyErr_Format(PyExc_TypeError,
                         "replicate: copy.copy() returned the same %.100s object; a module "
                         "object holding arrays must be copyable (check its __copy__)",
                         Py_TYPE(node->obj)->tp_name);
            goto fail;
        }
    }
    if (node->kind == RK_OBJECT) {
        cdict = PyObject_GenericGetDict(copy, NULL);
        if (cdict == NULL) {
            goto fail;
        }
        if (cdict == node->dict || !PyDict_Check(cdict)) {
            PyErr_Format(PyExc_TypeError,
                         "replicate: copy.copy() of a %.100s object shares its __dict__; a "
                         "module object holding arrays must be copyable (check its __copy__)",
                         Py_TYPE(node->obj)->tp_name);
            goto fail;
        }
    }
    if (node->kind == RK_TUPLE || node->kind == RK_NAMEDTUPLE) {
        memo[n] = REP_BUSY;
    } else {
        memo[n] = Py_NewRef(copy);
    }
    for (Py_ssize_t e = node->first_edge; e < node->first_edge + node->nedges; e++) {
        const rep_edge *ed = &w->sorted[e];
        v = rep_build(w, ed->child, arrays_d, memo);
        node = &w->nodes[n];
        if (v == NULL) {
            goto fail;
        }
        int rc = 0;
        switch (node->kind) {
        case RK_LIST:
        case RK_TUPLE:
        case RK_NAMEDTUPLE:
            if (ed->index < PyList_GET_SIZE(copy)) {
                rc = PyList_SetItem(copy, ed->index, v);   /* steals v */
                v = NULL;
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
            rc = PyDict_SetItem(cdict, ed->key, v);
            break;
        }
        Py_CLEAR(v);
        if (rc < 0) {
            goto fail;
        }
    }
    if (node->kind == RK_TUPLE) {
        made = PyList_AsTuple(copy);
    } else if (node->kind == RK_NAMEDTUPLE) {
        made = PyObject_CallMethod((PyObject *)Py_TYPE(node->obj), "_make", "O", copy);
    }
    if (node->kind == RK_TUPLE || node->kind == RK_NAMEDTUPLE) {
        if (made == NULL) {
            goto fail;
        }
        Py_SETREF(copy, made);
        memo[n] = Py_NewRef(copy);
    }
    Py_LeaveRecursiveCall();
    Py_XDECREF(cdict);
    return copy;

fail:
    Py_LeaveRecursiveCall();
    if (memo[n] == REP_BUSY) {
        memo[n] = NULL;
    }
    Py_XDECREF(v);
    Py_XDECREF(cdict);
    Py_XDECREF(copy);
    return NULL;
}

/* replicate(module, devs[0..ndev)) -> list of ndev replicas (spec 5,
 * dpmini's rules in the header comment). ndev may be 0. */
static PyObject *replicate_core(dp_state *st, PyObject *module, const dp_device *devs,
                                Py_ssize_t ndev)
{
    rep_walk w;
    PyObject *result = NULL, *bc = NULL;
    PyObject **memo = NULL;
    Py_ssize_t root = RK_LEAF;

    rep_walk_init(&w, st);
    result = PyList_New(ndev);
    if (result == NULL) {
        goto fail;
    }
    if (ndev == 0) {
        goto done;
    }
    /* Plain callables (functions, builtins, bound methods) hold no arrays. */
    if (!PyFunction_Check(module) && !PyCFunction_Check(module) && !PyMethod_Check(module)) {
        w.arrays = PyList_New(0);
        if (w.arrays == NULL) {
            goto fail;
        }
        root = rep_walk_obj(&w, module, 0);
        if (root == RK_ERROR) {
            goto fail;
        }
    }
    if (root < 0 || PyList_GET_SIZE(w.arrays) == 0) {
        for (Py_ssize_t d = 0; d < ndev; d++) {
            PyList_SET_ITEM(result, d, Py_NewRef(module));
        }
        goto done;
    }
    if (rep_link(&w) < 0) {
        goto fail;
    }
    bc = dp_broadcast_coalesced(st, w.arrays, devs, ndev, DP_BROADCAST_BUFFER);
    if (bc == NULL) {
        goto fail;
    }
    if (!PyList_Check(bc) || PyList_GET_SIZE(bc) != ndev) {
        PyErr_SetString(PyExc_SystemError, "replicate: broadcast_coalesced returned a bad list");
        goto fail;
    }
    memo = PyMem_Calloc((size_t)w.nnodes, sizeof *memo);
    if (memo == NULL) {
        PyErr_NoMemory();
        goto fail;
    }
    for (Py_ssize_t d = 0; d < ndev; d++) {
        PyObject *arrays_d = PyList_GET_ITEM(bc, d);
        if (!PyList_Check(arrays_d) || PyList_GET_SIZE(arrays_d) != PyList_GET_SIZE(w.arrays)) {
            PyErr_SetString(PyExc_SystemError,
                            "replicate: broadcast_coalesced returned a bad list");
            goto fail;
        }
        PyObject *rep = rep_build(&w, root, arrays_d, memo);
        for (Py_ssize_t i = 0; i < w.nnodes; i++) {
            if (memo[i] != REP_BUSY) {
                Py_XDECREF(memo[i]);
            }
            memo[i] = NULL;
        }
        if (rep == NULL) {
            goto fail;
        }
        PyList_SET_ITEM(result, d, rep);
    }
done:
    PyMem_Free(memo);
    Py_XDECREF(bc);
    rep_walk_free(&w);
    return result;

fail:
    if (memo != NULL) {
        for (Py_ssize_t i = 0; i < w.nnodes; i++) {
            if (memo[i] != REP_BUSY) {
                Py_XDECREF(memo[i]);
            }
        }
    }
    PyMem_Free(memo);
    Py_XDECREF(bc);
    Py_XDECREF(result);
    rep_walk_free(&w);
    return NULL;
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

/* ------------------------------------------------------------------ */
/* Helpers: parallel_apply                                             */
/* ------------------------------------------------------------------ */

/* Runs on the worker of job->dev (pool.c): takes the GIL, enters the
 * caller's context copy, calls the replica, records the outcome. */
static void apply_job_main(void *arg)
{
    apply_job *job = arg;
    PyGILState_STATE g = PyGILState_Ensure();
    if (!tl_gil_pinned) {
        /* One extra, never released: the thread state outlives the job, so
         * the next job does not create and destroy one again. */
        (void)PyGILState_Ensure();
        tl_gil_pinned = 1;
    }
    if (!job->cancelled) {
        job->ident = PyThread_get_thread_ident();
        job->state = JOB_RUNNING;
        tl_replica_depth++;
        if (PyContext_Enter(job->ctx) < 0) {
            job->exc = take_exception();
        } else {
            job->result = PyObject_Call(job->module, job->args, job->kwargs);
            if (job->result == NULL) {
                job->exc = take_exception();
            }
            if (PyContext_Exit(job->ctx) < 0) {
                PyObject *e = take_exception();
                if (job->exc == NULL) {
                    Py_CLEAR(job->result);
                    job->exc = e;
                } else {
                    Py_DECREF(e);
                }
            }
        }
        tl_replica_depth--;
        if (job->interrupted) {
            /* An injected exception that arrived after the call returned
             * must not fire in this worker's next job. */
            PyThreadState_SetAsyncExc(job->ident, NULL);
        }
    }
    job->state = JOB_DONE;
    PyGILState_Release(g);
}

/* Runs job in the calling thread (GIL held). */
static void apply_job_inline(apply_job *job)
{
    job->state = JOB_RUNNING;
    job->result = PyObject_Call(job->module, job->args, job->kwargs);
    if (job->result == NULL) {
        job->exc = take_exception();
    }
    job->state = JOB_DONE;
}

/* Stop the worker jobs: queued ones are skipped, running ones get exc_type
 * raised in their thread (GIL held). */
static void interrupt_jobs(apply_job *jobs, Py_ssize_t m, PyObject *exc_type)
{
    for (Py_ssize_t i = 0; i < m; i++) {
        apply_job *job = &jobs[i];
        if (!job->on_worker) {
            continue;
        }
        if (job->state == JOB_QUEUED) {
            job->cancelled = 1;
        } else if (job->state == JOB_RUNNING && exc_type != NULL) {
            PyThreadState_SetAsyncExc(job->ident, exc_type);
            job->interrupted = 1;
        }
    }
}

/* Run the m prepared jobs and return their results as a list, in replica
 * order; on failure re-raise the first failing replica's error (spec 6.5). */
static PyObject *run_jobs(dp_state *st, apply_job *jobs, Py_ssize_t m)
{
    dp_batch batch;
    int have_batch = 0, nsubmitted = 0, nested = tl_replica_depth > 0;
    PyObject *abort = NULL;   /* stops the whole call: signal, submit failure */
    PyObject *result = NULL;
    char devbuf[32];

    for (Py_ssize_t i = 0; i < m; i++) {
        apply_job *job = &jobs[i];
        job->on_worker = !(m == 1 || nested || job->dev.kind == DP_HOST ||
                           dp_pool_on_worker(job->dev.kind, job->dev.index));
        if (job->on_worker && !have_batch) {
            int rc = dp_batch_init(&batch);
            if (rc != 0) {
                PyErr_Format(PyExc_RuntimeError, "parallel_apply: cannot create a job batch (%s)",
                             strerror(rc));
                return NULL;
            }
            have_batch = 1;
        }
    }
    /* Queue the worker jobs first, then run the inline ones meanwhile. */
    for (Py_ssize_t i = 0; i < m && abort == NULL; i++) {
        apply_job *job = &jobs[i];
        if (!job->on_worker) {
            continue;
        }
        job->ctx = PyContext_CopyCurrent();
        if (job->ctx == NULL) {
            job->on_worker = 0;
            job->cancelled = 1;
            abort = take_exception();
            break;
        }
        int rc = dp_batch_submit(&batch, job->dev.kind, job->dev.index, apply_job_main, job);
        if (rc != 0) {
            dp_device_format(job->dev, devbuf, sizeof devbuf);
            PyErr_Format(PyExc_RuntimeError,
                         "parallel_apply: cannot queue replica %zd on the worker of device %s (%s)",
                         i, devbuf, strerror(rc));
            job->on_worker = 0;
            job->cancelled = 1;
            abort = take_exception();
            break;
        }
        nsubmitted++;
    }
    for (Py_ssize_t i = 0; i < m; i++) {
        apply_job *job = &jobs[i];
        if (job->on_worker || job->cancelled) {
            continue;
        }
        if (abort != NULL) {
            job->cancelled = 1;
            continue;
        }
        apply_job_inline(job);
        if (job->exc != NULL && !PyObject_IsInstance(job->exc, PyExc_Exception)) {
            /* KeyboardInterrupt or SystemExit in the caller: stop the rest. */
            abort = Py_NewRef(job->exc);
            interrupt_jobs(jobs, m, (PyObject *)Py_TYPE(abort));
        }
    }
    if (abort != NULL) {
        interrupt_jobs(jobs, m, NULL);   /* unstarted worker jobs are skipped */
    }
    while (nsubmitted > 0) {
        int done;
        Py_BEGIN_ALLOW_THREADS
        done = dp_batch_wait(&batch, DP_WAIT_SLICE_MS);
        Py_END_ALLOW_THREADS
        if (done) {
            break;
        }
        if (PyErr_CheckSignals() < 0) {
            PyObject *e = take_exception();
            interrupt_jobs(jobs, m, (PyObject *)Py_TYPE(e));
            if (abort == NULL) {
                abort = e;
            } else {
                Py_DECREF(e);
            }
        }
    }
    if (have_batch) {
        dp_batch_destroy(&batch);
    }
    if (abort != NULL) {
        restore_exception(abort);
        return NULL;
    }
    for (Py_ssize_t i = 0; i < m; i++) {
        if (jobs[i].exc != NULL) {
            raise_replica_error(st, jobs[i].exc, i, jobs[i].dev);
            return NULL;
        }
        if (jobs[i].result == NULL) {
            PyErr_Format(PyExc_SystemError, "parallel_apply: replica %zd did not run", i);
            return NULL;
        }
    }
    result = PyList_New(m);
    if (result == NULL) {
        return NULL;
    }
    for (Py_ssize_t i = 0; i < m; i++) {
        PyList_SET_ITEM(result, i, jobs[i].result);
        jobs[i].result = NULL;
    }
    return result;
}

/* The device a replica runs on when none is given: the device of the first
 * array among its top-level arguments, else entry i of the default list. */
static int auto_device(dp_state *st, PyObject *args, Py_ssize_t i,
                       dp_device **defaults, Py_ssize_t *ndefaults, dp_device *out)
{
    for (Py_ssize_t j = 0; j < PyTuple_GET_SIZE(args); j++) {
        PyObject *a = PyTuple_GET_ITEM(args, j);
        int r = dp_is_array_leaf(st, a);
        if (r < 0 && PyErr_Occurred()) {
            return -1;
        }
        if (r > 0) {
            dp_device d = dp_array_device(st, (PyArrayObject *)a);
            if (d.kind != DP_HOST) {
                *out = d;
                return 0;
            }
            break;
        }
    }
    if (*defaults == NULL && dp_default_devices(st, defaults, ndefaults) < 0) {
        return -1;
    }
    *out = (*defaults)[i % *ndefaults];
    return 0;
}

/* parallel_apply over Python sequences. Devices come from cdevs (ncdevs
 * entries, must equal the module count) when given, else from `devices`
 * (None or a sequence, None entries allowed), else auto_device. */
static PyObject *parallel_apply_run(dp_state *st, PyObject *modules, PyObject *inputs,
                                    PyObject *kwargs_tup, PyObject *devices,
                                    const dp_device *cdevs, Py_ssize_t ncdevs)
{
    PyObject *mods = NULL, *ins = NULL, *kws = NULL, *devseq = NULL, *result = NULL;
    apply_job small[DP_SMALL_JOBS];
    apply_job *jobs = small;
    dp_device *defaults = NULL;
    Py_ssize_t ndefaults = 0, m = 0;

    mods = PySequence_Fast(modules, "parallel_apply: modules must be a sequence of callables");
    if (mods == NULL) {
        goto fail;
    }
    m = PySequence_Fast_GET_SIZE(mods);
    ins = PySequence_Fast(inputs, "parallel_apply: inputs must be a sequence (one entry per module)");
    if (ins == NULL) {
        m = 0;
        goto fail;
    }
    if (PySequence_Fast_GET_SIZE(ins) != m) {
        PyErr_Format(PyExc_ValueError,
                     "parallel_apply: the number of modules (%zd) is not equal to the number "
                     "of inputs (%zd)", m, PySequence_Fast_GET_SIZE(ins));
        m = 0;
        goto fail;
    }
    if (kwargs_tup != NULL && kwargs_tup != Py_None) {
        kws = PySequence_Fast(kwargs_tup, "parallel_apply: kwargs_tup must be a sequence of dicts");
        if (kws == NULL || PySequence_Fast_GET_SIZE(kws) != m) {
            if (kws != NULL) {
                PyErr_Format(PyExc_ValueError,
                             "parallel_apply: the number of modules (%zd) is not equal to the "
                             "number of kwargs_tup entries (%zd)", m, PySequence_Fast_GET_SIZE(kws));
            }
            m = 0;
            goto fail;
        }
    }
    if (cdevs != NULL) {
        if (ncdevs != m) {
            PyErr_Format(PyExc_ValueError,
                         "parallel_apply: the number of modules (%zd) is not equal to the "
                         "number of devices (%zd)", m, ncdevs);
            m = 0;
            goto fail;
        }
    } else if (devices != NULL && devices != Py_None) {
        devseq = PySequence_Fast(devices, "parallel_apply: devices must be a sequence of devices");
        if (devseq == NULL || PySequence_Fast_GET_SIZE(devseq) != m) {
            if (devseq != NULL) {
                PyErr_Format(PyExc_ValueError,
                             "parallel_apply: the number of modules (%zd) is not equal to the "
                             "number of devices (%zd)", m, PySequence_Fast_GET_SIZE(devseq));
            }
            m = 0;
            goto fail;
        }
    }
    if (m > DP_SMALL_JOBS) {
        jobs = PyMem_Calloc((size_t)m, sizeof *jobs);
        if (jobs == NULL) {
            jobs = small;
            m = 0;
            PyErr_NoMemory();
            goto fail;
        }
    } else {
        memset(small, 0, sizeof small);
    }
    for (Py_ssize_t i = 0; i < m; i++) {
        apply_job *job = &jobs[i];
        job->module = Py_NewRef(PySequence_Fast_GET_ITEM(mods, i));
        job->args = input_as_args(PySequence_Fast_GET_ITEM(ins, i));
        if (job->args == NULL) {
            goto fail;
        }
        if (kws != NULL &&
            kwargs_as_dict(PySequence_Fast_GET_ITEM(kws, i), "kwargs_tup", i, &job->kwargs) < 0) {
            goto fail;
        }
        PyObject *dev = devseq ? PySequence_Fast_GET_ITEM(devseq, i) : Py_None;
        if (cdevs != NULL) {
            job->dev = cdevs[i];
        } else if (dev != Py_None) {
            char name[40];
            snprintf(name, sizeof name, "devices[%zd]", i);
            if (dp_device_from_object(st, dev, name, 0, &job->dev) < 0) {
                goto fail;
            }
        } else if (auto_device(st, job->args, i, &defaults, &ndefaults, &job->dev) < 0) {
            goto fail;
        }
    }
    result = run_jobs(st, jobs, m);
fail:
    for (Py_ssize_t i = 0; i < m; i++) {
        Py_XDECREF(jobs[i].module);
        Py_XDECREF(jobs[i].args);
        Py_XDECREF(jobs[i].kwargs);
        Py_XDECREF(jobs[i].ctx);
        Py_XDECREF(jobs[i].result);
        Py_XDECREF(jobs[i].exc);
    }
    if (jobs != small) {
        PyMem_Free(jobs);
    }
    PyMem_Free(defaults);
    Py_XDECREF(mods);
    Py_XDECREF(ins);
    Py_XDECREF(kws);
    Py_XDECREF(devseq);
    return result;
}

/* ------------------------------------------------------------------ */
/* Helpers: forward                                                    */
/* ------------------------------------------------------------------ */

/* DataParallel.forward with the C steps (the exact type, and
 * data_parallel): spec §2 in order. args: tuple; kwargs: dict or NULL. */
static PyObject *forward_core(dp_state *st, PyObject *module, PyObject *args, PyObject *kwargs,
                              const dp_device *devs, Py_ssize_t ndev, dp_device out_dev,
                              int dim, int strict)
{
    PyObject *inputs = NULL, *kws = NULL, *replicas = NULL, *outputs = NULL, *res = NULL;

    if (dp_scatter_kwargs(st, args, kwargs, devs, ndev, dim, strict, &inputs, &kws) < 0) {
        return NULL;
    }
    if (fix_empty_call(&inputs, &kws) < 0) {
        goto fail;
    }
    if (ndev == 1) {
        res = call_first(module, inputs, kws);
        goto fail;
    }
    Py_ssize_t k = PyTuple_GET_SIZE(inputs);
    Py_ssize_t nrep = k < ndev ? k : ndev;
    replicas = replicate_core(st, module, devs, nrep);
    if (replicas == NULL) {
        goto fail;
    }
    outputs = parallel_apply_run(st, replicas, inputs, kws, NULL, devs, nrep);
    if (outputs == NULL) {
        goto fail;
    }
    res = dp_gather_outputs(st, outputs, out_dev, dim);
fail:
    Py_XDECREF(inputs);
    Py_XDECREF(kws);
    Py_XDECREF(replicas);
    Py_XDECREF(outputs);
    return res;
}

static int check_initialised(dp_DataParallelObject *self)
{
    if (self->devs == NULL) {
        PyErr_Format(PyExc_RuntimeError,
                     "%.100s: DataParallel.__init__() was not called (a subclass __init__ "
                     "must call super().__init__(module, ...))", Py_TYPE(self)->tp_name);
        return -1;
    }
    return 0;
}

/* forward on a Python subclass: each step through attribute lookup. */
static PyObject *forward_generic(dp_DataParallelObject *self, dp_state *st,
                                 PyObject *args, PyObject *kwargs)
{
    PyObject *kw = NULL, *ids = NULL, *pair = NULL, *inputs = NULL, *kws = NULL;
    PyObject *used = NULL, *replicas = NULL, *outputs = NULL, *outdev = NULL, *res = NULL;

    kw = kwargs ? Py_NewRef(kwargs) : PyDict_New();
    ids = device_list(st, self->devs, self->ndev);
    if (kw == NULL || ids == NULL) {
        goto fail;
    }
    pair = PyObject_CallMethod((PyObject *)self, "scatter", "OOO", args, kw, ids);
    if (pair == NULL) {
        goto fail;
    }
    if (!PyTuple_Check(pair) || PyTuple_GET_SIZE(pair) != 2) {
        PyErr_Format(PyExc_TypeError,
                     "DataParallel.forward: scatter() must return (inputs, kwargs), got %.100s",
                     Py_TYPE(pair)->tp_name);
        goto fail;
    }
    inputs = PySequence_Tuple(PyTuple_GET_ITEM(pair, 0));
    kws = PySequence_Tuple(PyTuple_GET_ITEM(pair, 1));
    if (inputs == NULL || kws == NULL || fix_empty_call(&inputs, &kws) < 0) {
        goto fail;
    }
    if (self->ndev == 1) {
        PyObject *module = Py_NewRef(self->module);   /* bug 8 */
        res = call_first(module, inputs, kws);
        Py_DECREF(module);
        goto fail;
    }
    used = PyList_GetSlice(ids, 0, PyTuple_GET_SIZE(inputs));
    if (used == NULL) {
        goto fail;
    }
    replicas = PyObject_CallMethod((PyObject *)self, "replicate", "OO", self->module, used);
    if (replicas == NULL) {
        goto fail;
    }
    outputs = PyObject_CallMethod((PyObject *)self, "parallel_apply", "OOO", replicas, inputs, kws);
    if (outputs == NULL) {
        goto fail;
    }
    outdev = dp_device_to_object(st, self->output_device);
    if (outdev == NULL) {
        goto fail;
    }
    res = PyObject_CallMethod((PyObject *)self, "gather", "OO", outputs, outdev);
fail:
    Py_XDECREF(kw);
    Py_XDECREF(ids);
    Py_XDECREF(pair);
    Py_XDECREF(inputs);
    Py_XDECREF(kws);
    Py_XDECREF(used);
    Py_XDECREF(replicas);
    Py_XDECREF(outputs);
    Py_XDECREF(outdev);
    return res;
}

/* A PyMem_Malloc'ed copy of self's device list (MemoryError -> NULL): what a
 * call uses while the GIL may be released or Python code may run, since either
 * can let dp.device_ids be replaced and the old array freed (bug 8). */
static dp_device *copy_devices(dp_DataParallelObject *self)
{
    dp_device *devs = PyMem_Malloc((size_t)self->ndev * sizeof(dp_device));
    if (devs == NULL) {
        PyErr_NoMemory();
        return NULL;
    }
    memcpy(devs, self->devs, (size_t)self->ndev * sizeof(dp_device));
    return devs;
}

static PyObject *forward_dispatch(dp_DataParallelObject *self, PyObject *args, PyObject *kwargs)
{
    dp_state *st = dp_state_from_type(Py_TYPE(self));
    if (st == NULL || check_initialised(self) < 0) {
        return NULL;
    }
    if (Py_TYPE(self) == st->DataParallelType) {
        if (kwargs != NULL && PyDict_GET_SIZE(kwargs) == 0) {
            kwargs = NULL;
        }
        /* Work on a strong reference to the module and a private copy of the
         * device list: the GIL is released during the call (copies, waiting on
         * replicas) and replicas run Python, so another thread or a replica can
         * set dp.module / dp.device_ids meanwhile, which freed what a borrowed
         * pointer still used (reliability.md, bug 8). */
        dp_device *devs = copy_devices(self);
        if (devs == NULL) {
            return NULL;
        }
        PyObject *module = Py_NewRef(self->module);
        PyObject *res = forward_core(st, module, args, kwargs, devs, self->ndev,
                                     self->output_device, self->dim, self->strict);
        Py_DECREF(module);
        PyMem_Free(devs);
        return res;
    }
    return forward_generic(self, st, args, kwargs);
}

/* ------------------------------------------------------------------ */
/* Public functions: the DataParallel type                             */
/* ------------------------------------------------------------------ */

static PyObject *DataParallel_new(PyTypeObject *type, PyObject *args, PyObject *kwargs)
{
    /* Arguments are parsed by __init__, so subclasses may change the
     * constructor's signature. */
    dp_DataParallelObject *self = (dp_DataParallelObject *)type->tp_alloc(type, 0);
    if (self == NULL) {
        return NULL;
    }
    self->module = Py_NewRef(Py_None);
    self->devs = NULL;
    self->ndev = 0;
    self->output_device.kind = DP_HOST;
    self->output_device.index = -1;
    self->dim = 0;
    self->strict = 0;
    return (PyObject *)self;
}

static int DataParallel_init(dp_DataParallelObject *self, PyObject *args, PyObject *kwargs)
{
    static char *kwlist[] = {"module", "device_ids", "output_device", "dim", "strict", NULL};
    PyObject *module, *ids = Py_None, *out = Py_None, *dimobj = NULL;
    int strict = 0, dim = 0;
    dp_device *devs = NULL, outdev;
    Py_ssize_t ndev = 0;
    dp_state *st = dp_state_from_type(Py_TYPE(self));

    if (st == NULL ||
        !PyArg_ParseTupleAndKeywords(args, kwargs, "O|OOOp:DataParallel", kwlist,
                                     &module, &ids, &out, &dimobj, &strict)) {
        return -1;
    }
    if (!PyCallable_Check(module)) {
        PyErr_Format(PyExc_TypeError, "DataParallel: module must be callable, got %.100s",
                     Py_TYPE(module)->tp_name);
        return -1;
    }
    if (ids == Py_None) {
        if (dp_default_devices(st, &devs, &ndev) < 0) {
            return -1;
        }
    } else if (dp_device_list_from_object(st, ids, "device_ids", &devs, &ndev) < 0) {
        return -1;
    }
    if (out == Py_None) {
        outdev = devs[0];
    } else if (parse_target_device(st, out, "output_device", &outdev) < 0) {
        goto fail;
    }
    if (dimobj != NULL && dp_int_from_object(dimobj, "dim", &dim) < 0) {
        goto fail;
    }
    Py_SETREF(self->module, Py_NewRef(module));
    PyMem_Free(self->devs);
    self->devs = devs;
    self->ndev = ndev;
    self->output_device = outdev;
    self->dim = dim;
    self->strict = strict;
    return 0;
fail:
    PyMem_Free(devs);
    return -1;
}

static int DataParallel_traverse(dp_DataParallelObject *self, visitproc visit, void *arg)
{
    Py_VISIT(Py_TYPE(self));
    Py_VISIT(self->module);
    Py_VISIT(self->dict);
    return 0;
}

static int DataParallel_clear(dp_DataParallelObject *self)
{
    /* module stays a valid object (None) for finalizers that still run. */
    if (self->module != NULL && self->module != Py_None) {
        Py_SETREF(self->module, Py_NewRef(Py_None));
    }
    Py_CLEAR(self->dict);
    return 0;
}

static void DataParallel_dealloc(dp_DataParallelObject *self)
{
    PyTypeObject *tp = Py_TYPE(self);
    PyObject_GC_UnTrack(self);
    if (self->weakreflist != NULL) {
        PyObject_ClearWeakRefs((PyObject *)self);
    }
    DataParallel_clear(self);
    Py_CLEAR(self->module);
    PyMem_Free(self->devs);
    self->devs = NULL;
    tp->tp_free((PyObject *)self);
    Py_DECREF(tp);
}

static PyObject *DataParallel_call(dp_DataParallelObject *self, PyObject *args, PyObject *kwargs)
{
    dp_state *st = dp_state_from_type(Py_TYPE(self));
    if (st == NULL) {
        return NULL;
    }
    if (Py_TYPE(self) == st->DataParallelType) {
        return forward_dispatch(self, args, kwargs);
    }
    PyObject *fwd = PyObject_GetAttrString((PyObject *)self, "forward");
    if (fwd == NULL) {
        return NULL;
    }
    PyObject *res = PyObject_Call(fwd, args, kwargs);
    Py_DECREF(fwd);
    return res;
}

static PyObject *DataParallel_repr(dp_DataParallelObject *self)
{
    PyObject *parts = NULL, *sep = NULL, *ids = NULL, *res = NULL;
    const char *name = Py_TYPE(self)->tp_name;
    const char *dot = strrchr(name, '.');
    char buf[32];
    int rc = Py_ReprEnter((PyObject *)self);

    if (rc != 0) {
        return rc > 0 ? PyUnicode_FromFormat("%s(...)", dot ? dot + 1 : name) : NULL;
    }
    if (dot != NULL) {
        name = dot + 1;
    }
    if (self->devs == NULL) {
        res = PyUnicode_FromFormat("%s(<not initialised>)", name);
        goto done;
    }
    parts = PyList_New(self->ndev);
    sep = PyUnicode_FromString(", ");
    if (parts == NULL || sep == NULL) {
        goto done;
    }
    for (Py_ssize_t i = 0; i < self->ndev; i++) {
        dp_device_format(self->devs[i], buf, sizeof buf);
        PyObject *s = PyUnicode_FromFormat("'%s'", buf);
        if (s == NULL) {
            goto done;
        }
        PyList_SET_ITEM(parts, i, s);
    }
    ids = PyUnicode_Join(sep, parts);
    if (ids == NULL) {
        goto done;
    }
    dp_device_format(self->output_device, buf, sizeof buf);
    res = PyUnicode_FromFormat("%s(module=%R, device_ids=[%U], output_device='%s', dim=%d%s)",
                               name, self->module, ids, buf, self->dim,
                               self->strict ? ", strict=True" : "");
done:
    Py_ReprLeave((PyObject *)self);
    Py_XDECREF(parts);
    Py_XDECREF(sep);
    Py_XDECREF(ids);
    return res;
}

/* --- attributes --- */

static int refuse_delete(PyObject *value, const char *name)
{
    if (value == NULL) {
        PyErr_Format(PyExc_AttributeError, "cannot delete DataParallel.%s", name);
        return -1;
    }
    return 0;
}

static PyObject *DataParallel_get_module(dp_DataParallelObject *self, void *c)
{
    return Py_NewRef(self->module);
}

static int DataParallel_set_module(dp_DataParallelObject *self, PyObject *value, void *c)
{
    if (refuse_delete(value, "module") < 0) {
        return -1;
    }
    if (!PyCallable_Check(value)) {
        PyErr_Format(PyExc_TypeError, "DataParallel.module: expected a callable, got %.100s",
                     Py_TYPE(value)->tp_name);
        return -1;
    }
    Py_SETREF(self->module, Py_NewRef(value));
    return 0;
}

static PyObject *DataParallel_get_device_ids(dp_DataParallelObject *self, void *c)
{
    dp_state *st = dp_state_from_type(Py_TYPE(self));
    if (st == NULL) {
        return NULL;
    }
    return device_list(st, self->devs, self->devs ? self->ndev : 0);
}

static int DataParallel_set_device_ids(dp_DataParallelObject *self, PyObject *value, void *c)
{
    dp_state *st = dp_state_from_type(Py_TYPE(self));
    dp_device *devs;
    Py_ssize_t n;
    if (st == NULL || refuse_delete(value, "device_ids") < 0 ||
        dp_device_list_from_object(st, value, "device_ids", &devs, &n) < 0) {
        return -1;
    }
    PyMem_Free(self->devs);
    self->devs = devs;
    self->ndev = n;
    return 0;
}

static PyObject *DataParallel_get_output_device(dp_DataParallelObject *self, void *c)
{
    dp_state *st = dp_state_from_type(Py_TYPE(self));
    if (st == NULL) {
        return NULL;
    }
    return dp_device_to_object(st, self->output_device);
}

static int DataParallel_set_output_device(dp_DataParallelObject *self, PyObject *value, void *c)
{
    dp_state *st = dp_state_from_type(Py_TYPE(self));
    dp_device d;
    if (st == NULL || refuse_delete(value, "output_device") < 0 ||
        parse_target_device(st, value, "output_device", &d) < 0) {
        return -1;
    }
    self->output_device = d;
    return 0;
}

static PyObject *DataParallel_get_dim(dp_DataParallelObject *self, void *c)
{
    return PyLong_FromLong(self->dim);
}

static int DataParallel_set_dim(dp_DataParallelObject *self, PyObject *value, void *c)
{
    int dim;
    if (refuse_delete(value, "dim") < 0 || dp_int_from_object(value, "dim", &dim) < 0) {
        return -1;
    }
    self->dim = dim;
    return 0;
}

static PyObject *DataParallel_get_strict(dp_DataParallelObject *self, void *c)
{
    return PyBool_FromLong(self->strict);
}

static int DataParallel_set_strict(dp_DataParallelObject *self, PyObject *value, void *c)
{
    if (refuse_delete(value, "strict") < 0) {
        return -1;
    }
    int v = PyObject_IsTrue(value);
    if (v < 0) {
        return -1;
    }
    self->strict = v;
    return 0;
}

/* --- methods --- */

PyDoc_STRVAR(forward_doc,
"forward(*args, **kwargs)\n--\n\n"
"Run the module data-parallel over device_ids (PyTorch DataParallel.forward,\n"
"spec §2), in order:\n"
"  inputs, kwargs = self.scatter(args, kwargs, self.device_ids)\n"
"  no arguments at all -> inputs, kwargs = ((),), ({},)\n"
"  one device -> return module(*inputs[0], **kwargs[0])  (no gather, spec 2.5)\n"
"  replicas = self.replicate(self.module, self.device_ids[:len(inputs)])\n"
"  outputs = self.parallel_apply(replicas, inputs, kwargs)\n"
"  return self.gather(outputs, self.output_device)\n"
"Arrays (numpy.ndarray leaves of args/kwargs) are split along dim into\n"
"ceil(n/k)-row chunks; the replica count is the smallest chunk count over all\n"
"array leaves (dpmini's fix of PyTorch issue #31460). Subclasses may override\n"
"any of the four steps. Unlike PyTorch, the module's arrays may live anywhere:\n"
"they are broadcast from where they are (no device check, spec 2.2).\n"
"Errors: those of the steps; a replica's exception is re-raised as\n"
"'Caught T in replica i on device d.' (spec 6.5).");

static PyObject *DataParallel_forward(dp_DataParallelObject *self, PyObject *args, PyObject *kwargs)
{
    return forward_dispatch(self, args, kwargs);
}

PyDoc_STRVAR(scatter_doc,
"scatter(inputs, kwargs=None, device_ids=None)\n--\n\n"
"Returns (inputs_tuple, kwargs_tuple).\n"
"Split positional inputs (a tuple; a list is taken as a tuple) and kwargs (a\n"
"dict or None) over device_ids along self.dim (PyTorch scatter_kwargs, spec\n"
"2.3, 2.7, §3). Returns two tuples of equal length k (the replica count): k\n"
"tuples of positional arguments and k dicts. Both are empty when there are\n"
"no arguments. Chunk counts that differ warn dpmini.SplitWarning, or raise\n"
"ValueError when self.strict. device_ids None means self.device_ids.\n"
"Errors: TypeError for inputs/kwargs of the wrong type, ValueError for bad\n"
"devices or 0-dim arrays, IndexError for a dim out of range.");

static PyObject *DataParallel_scatter(dp_DataParallelObject *self, PyObject *args, PyObject *kwargs)
{
    static char *kwlist[] = {"inputs", "kwargs", "device_ids", NULL};
    PyObject *inputs, *kw = Py_None, *ids = Py_None, *in = NULL, *ins = NULL, *kws = NULL;
    PyObject *res = NULL;
    dp_device *devs = NULL;
    Py_ssize_t ndev = 0;
    dp_state *st = dp_state_from_type(Py_TYPE(self));

    if (st == NULL || check_initialised(self) < 0 ||
        !PyArg_ParseTupleAndKeywords(args, kwargs, "O|OO:scatter", kwlist, &inputs, &kw, &ids)) {
        return NULL;
    }
    if (inputs == Py_None) {
        in = PyTuple_New(0);
    } else if (PyTuple_Check(inputs) || PyList_Check(inputs)) {
        in = PySequence_Tuple(inputs);
    } else {
        PyErr_Format(PyExc_TypeError, "scatter: inputs must be a tuple of positional "
                     "arguments, got %.100s", Py_TYPE(inputs)->tp_name);
    }
    if (in == NULL) {
        goto fail;
    }
    if (kw != Py_None && !PyDict_Check(kw)) {
        PyErr_Format(PyExc_TypeError, "scatter: kwargs must be a dict or None, got %.100s",
                     Py_TYPE(kw)->tp_name);
        goto fail;
    }
    if (ids != Py_None &&
        dp_device_list_from_object(st, ids, "device_ids", &devs, &ndev) < 0) {
        goto fail;
    }
    if (devs == NULL) {   /* bug 8: not self->devs, which may be freed meanwhile */
        ndev = self->ndev;
        if ((devs = copy_devices(self)) == NULL) {
            goto fail;
        }
    }
    if (dp_scatter_kwargs(st, in, kw == Py_None ? NULL : kw, devs,
                          ndev, self->dim, self->strict, &ins, &kws) < 0) {
        goto fail;
    }
    res = PyTuple_Pack(2, ins, kws);
fail:
    PyMem_Free(devs);
    Py_XDECREF(in);
    Py_XDECREF(ins);
    Py_XDECREF(kws);
    return res;
}

PyDoc_STRVAR(replicate_doc,
"replicate(module, devices, detach=False)\n--\n\n"
"Returns a list of replicas.\n"
"One replica of module per device, in order (PyTorch replicate, spec §5).\n"
"devices: a sequence of devices ('cpu:N', 'cuda:N', int, dpmini.Device); an\n"
"empty sequence gives []. Arrays reachable from module through instance\n"
"__dict__ attributes, lists, tuples, dicts and sub-objects (depth <= 64) are\n"
"broadcast with one broadcast_coalesced call (10 MiB buckets); replica d is a\n"
"shallow copy (copy.copy; lists/dicts/tuples rebuilt) of every object on a\n"
"path to an array, with the arrays replaced by device d's copies. Objects\n"
"with no array below them are shared, and an object reachable twice is one\n"
"object in each replica. A module holding no arrays (functions, builtins,\n"
"bound methods, plain objects) is returned as the same object for every\n"
"device. The replica on devices[0] holds the original arrays where they\n"
"already live there (spec 5.6). detach is accepted for PyTorch\n"
"compatibility and ignored. Errors: ValueError/TypeError for bad devices;\n"
"TypeError when an object with arrays cannot be copied.");

static PyObject *replicate_common(dp_state *st, PyObject *module, PyObject *devices)
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

PyDoc_STRVAR(dp_replicate_doc,
"replicate(module, device_ids)\n--\n\n"
"dpmini.replicate(module, device_ids): one replica of module per device, as\n"
"a list (shallow copies holding each device's copies of the module's arrays;\n"
"the module itself when it holds none). See dpmini.replicate.");

static PyObject *DataParallel_replicate(dp_DataParallelObject *self, PyObject *args, PyObject *kwargs)
{
    static char *kwlist[] = {"module", "device_ids", NULL};
    PyObject *module, *devices;
    dp_state *st = dp_state_from_type(Py_TYPE(self));
    if (st == NULL ||
        !PyArg_ParseTupleAndKeywords(args, kwargs, "OO:replicate", kwlist, &module, &devices)) {
        return NULL;
    }
    return replicate_common(st, module, devices);
}

PyDoc_STRVAR(dp_parallel_apply_doc,
"parallel_apply(replicas, inputs, kwargs=None)\n--\n\n"
"dpmini.parallel_apply(replicas, inputs, kwargs, self.device_ids[:len(replicas)]):\n"
"replica i runs as replicas[i](*inputs[i], **kwargs[i]) on device_ids[i]'s\n"
"worker thread; results in replica order. See dpmini.parallel_apply.");

static PyObject *DataParallel_parallel_apply(dp_DataParallelObject *self, PyObject *args,
                                             PyObject *kwargs)
{
    static char *kwlist[] = {"replicas", "inputs", "kwargs", NULL};
    PyObject *replicas, *inputs, *kw = Py_None;
    dp_state *st = dp_state_from_type(Py_TYPE(self));
    if (st == NULL || check_initialised(self) < 0 ||
        !PyArg_ParseTupleAndKeywords(args, kwargs, "OO|O:parallel_apply", kwlist,
                                     &replicas, &inputs, &kw)) {
        return NULL;
    }
    Py_ssize_t m = PyObject_Length(replicas);
    if (m < 0) {
        return NULL;
    }
    dp_device *devs = copy_devices(self);   /* bug 8 */
    if (devs == NULL) {
        return NULL;
    }
    PyObject *res = parallel_apply_run(st, replicas, inputs, kw, NULL, devs,
                                       m < self->ndev ? m : self->ndev);
    PyMem_Free(devs);
    return res;
}

PyDoc_STRVAR(gather_doc,
"gather(outputs, output_device=None)\n--\n\n"
"Combine the per-replica outputs onto output_device along self.dim (PyTorch\n"
"gather, spec §4, with dpmini's rules in docs/design.md). output_device:\n"
"'cpu' or -1 for the host (-1 warns FutureWarning), 'cpu:N', 'cuda:N', an int\n"
"or a Device; None means self.output_device. Errors: TypeError/ValueError\n"
"naming the output path for mismatched structures or shapes.");

static PyObject *DataParallel_gather(dp_DataParallelObject *self, PyObject *args, PyObject *kwargs)
{
    static char *kwlist[] = {"outputs", "output_device", NULL};
    PyObject *outputs, *out = Py_None;
    dp_device d = self->output_device;
    dp_state *st = dp_state_from_type(Py_TYPE(self));
    if (st == NULL ||
        !PyArg_ParseTupleAndKeywords(args, kwargs, "O|O:gather", kwlist, &outputs, &out)) {
        return NULL;
    }
    if (out != Py_None && parse_target_device(st, out, "output_device", &d) < 0) {
        return NULL;
    }
    return dp_gather_outputs(st, outputs, d, self->dim);
}

static PyMethodDef DataParallel_methods[] = {
    {"forward", (PyCFunction)(void (*)(void))DataParallel_forward,
     METH_VARARGS | METH_KEYWORDS, forward_doc},
    {"scatter", (PyCFunction)(void (*)(void))DataParallel_scatter,
     METH_VARARGS | METH_KEYWORDS, scatter_doc},
    {"replicate", (PyCFunction)(void (*)(void))DataParallel_replicate,
     METH_VARARGS | METH_KEYWORDS, dp_replicate_doc},
    {"parallel_apply", (PyCFunction)(void (*)(void))DataParallel_parallel_apply,
     METH_VARARGS | METH_KEYWORDS, dp_parallel_apply_doc},
    {"gather", (PyCFunction)(void (*)(void))DataParallel_gather,
     METH_VARARGS | METH_KEYWORDS, gather_doc},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef DataParallel_getset[] = {
    {"module", (getter)DataParallel_get_module, (setter)DataParallel_set_module,
     "The wrapped callable (any callable object).", NULL},
    {"device_ids", (getter)DataParallel_get_device_ids, (setter)DataParallel_set_device_ids,
     "The devices, as a new list of dpmini.Device on each read; set with any\n"
     "non-empty sequence of non-host devices.", NULL},
    {"output_device", (getter)DataParallel_get_output_device,
     (setter)DataParallel_set_output_device,
     "Where forward gathers the outputs (a dpmini.Device; may be the host).", NULL},
    {"dim", (getter)DataParallel_get_dim, (setter)DataParallel_set_dim,
     "The scatter/gather dimension (an int; negative dims wrap per array).", NULL},
    {"strict", (getter)DataParallel_get_strict, (setter)DataParallel_set_strict,
     "True: arrays with different chunk counts raise ValueError instead of\n"
     "warning dpmini.SplitWarning.", NULL},
    {"__dict__", PyObject_GenericGetDict, PyObject_GenericSetDict, NULL, NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyMemberDef DataParallel_members[] = {
    {"__dictoffset__", T_PYSSIZET, offsetof(dp_DataParallelObject, dict), READONLY, NULL},
    {"__weaklistoffset__", T_PYSSIZET, offsetof(dp_DataParallelObject, weakreflist),
     READONLY, NULL},
    {NULL, 0, 0, 0, NULL},
};

PyDoc_STRVAR(DataParallel_doc,
"DataParallel(module, device_ids=None, output_device=None, dim=0, strict=False)\n--\n\n"
"Run module data-parallel over devices, as torch.nn.DataParallel does for\n"
"tensors (spec §1-§2), with NumPy arrays as the tensors.\n"
"module: any callable (TypeError otherwise). device_ids: a non-empty\n"
"sequence of devices ('cpu:N', 'cuda:N', int N, dpmini.Device; the host is\n"
"refused); None means every CUDA device, else cpu:0..cpu_device_count()-1.\n"
"output_device: where outputs are gathered; None means device_ids[0]; 'cpu'\n"
"or -1 is the host (-1 warns FutureWarning). dim: the int dimension to split\n"
"and gather along. strict: raise ValueError instead of warning\n"
"dpmini.SplitWarning when arrays split into different chunk counts.\n"
"Calling the object runs forward(*args, **kwargs). Subclasses may override\n"
"forward, scatter, replicate, parallel_apply and gather, and may add\n"
"attributes. The module's arrays are not required to be on device_ids[0]\n"
"(documented difference from PyTorch's device check, spec 2.2).");

static PyType_Slot DataParallel_slots[] = {
    {Py_tp_doc, (void *)DataParallel_doc},
    {Py_tp_new, DataParallel_new},
    {Py_tp_init, DataParallel_init},
    {Py_tp_dealloc, DataParallel_dealloc},
    {Py_tp_traverse, DataParallel_traverse},
    {Py_tp_clear, DataParallel_clear},
    {Py_tp_call, DataParallel_call},
    {Py_tp_repr, DataParallel_repr},
    {Py_tp_methods, DataParallel_methods},
    {Py_tp_getset, DataParallel_getset},
    {Py_tp_members, DataParallel_members},
    {0, NULL},
};

PyType_Spec dp_dataparallel_spec = {
    .name = "dpmini.DataParallel",
    .basicsize = sizeof(dp_DataParallelObject),
    .itemsize = 0,
    .flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_BASETYPE | Py_TPFLAGS_HAVE_GC,
    .slots = DataParallel_slots,
};

/* ------------------------------------------------------------------ */
/* Public functions: module level                                      */
/* ------------------------------------------------------------------ */

static PyObject *dp_replicate(PyObject *mod, PyObject *args, PyObject *kwargs)
{
    static char *kwlist[] = {"module", "devices", "detach", NULL};
    PyObject *module, *devices;
    int detach = 0;
    dp_state *st = dp_state_from_module(mod);
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "OO|p:replicate", kwlist,
                                     &module, &devices, &detach)) {
        return NULL;
    }
    return replicate_common(st, module, devices);
}

PyDoc_STRVAR(parallel_apply_doc,
"parallel_apply(modules, inputs, kwargs_tup=None, devices=None)\n--\n\n"
"Returns a list with one result per module.\n"
"Call modules[i](*inputs[i], **kwargs_tup[i]) for every i, each on the\n"
"persistent worker thread of devices[i] (PyTorch parallel_apply, spec §6);\n"
"return the results as a list in index order (spec 6.4).\n"
"inputs[i]: a list or tuple is unpacked, anything else is passed as the one\n"
"positional argument. kwargs_tup: None (no keywords) or one dict per module.\n"
"devices: None, or one device per module (None entries allowed); a missing\n"
"device is that of the first array among inputs[i]'s top-level items when\n"
"it lives on a device, else entry i of the default device list.\n"
"Each worker holds the GIL while it runs Python code and enters a copy of\n"
"the caller's contextvars context (numpy.errstate etc. apply, like PyTorch\n"
"copying grad mode, spec 6.2). With one module, or when called from inside\n"
"a replica running on a worker, the calls run inline in the caller thread.\n"
"Replicas sharing a device (e.g. ['cpu:0', 'cpu:0']) run one after another\n"
"on that device's worker. Ctrl-C while waiting raises KeyboardInterrupt in\n"
"the running replicas, waits for them, and re-raises it.\n"
"Errors: ValueError 'parallel_apply: the number of modules (M) is not equal\n"
"to the number of inputs (N)' (likewise kwargs_tup and devices); the first\n"
"failing replica (lowest index) is re-raised with its type and the message\n"
"'Caught T in replica i on device d.\\nOriginal Traceback (most recent call\n"
"last):\\n...', the original exception as __cause__ (RuntimeError when T\n"
"cannot be built from one string).");

static PyObject *dp_parallel_apply(PyObject *mod, PyObject *args, PyObject *kwargs)
{
    static char *kwlist[] = {"modules", "inputs", "kwargs_tup", "devices", NULL};
    PyObject *modules, *inputs, *kw = Py_None, *devices = Py_None;
    dp_state *st = dp_state_from_module(mod);
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "OO|OO:parallel_apply", kwlist,
                                     &modules, &inputs, &kw, &devices)) {
        return NULL;
    }
    return parallel_apply_run(st, modules, inputs, kw, devices, NULL, 0);
}

PyDoc_STRVAR(data_parallel_doc,
"data_parallel(module, inputs, device_ids=None, output_device=None, dim=0, module_kwargs=None)\n"
"--\n\n"
"Functional DataParallel (PyTorch data_parallel, spec 2.9): the same steps\n"
"as DataParallel.forward (scatter, empty-call fix, one-device fast path,\n"
"replicate, parallel_apply, gather). inputs: a tuple of positional arguments;\n"
"anything else is one argument (a list counts as ONE argument), None means\n"
"none. module_kwargs: None or a dict. device_ids/output_device/dim as for\n"
"DataParallel. Errors: as DataParallel.");

static PyObject *dp_data_parallel(PyObject *mod, PyObject *args, PyObject *kwargs)
{
    static char *kwlist[] = {"module", "inputs", "device_ids", "output_device", "dim",
                             "module_kwargs", NULL};
    PyObject *module, *inputs, *ids = Py_None, *out = Py_None, *dimobj = NULL;
    PyObject *mkw = Py_None, *in = NULL, *res = NULL;
    dp_device *devs = NULL, outdev;
    Py_ssize_t ndev = 0;
    int dim = 0;
    dp_state *st = dp_state_from_module(mod);

    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "OO|OOOO:data_parallel", kwlist, &module,
                                     &inputs, &ids, &out, &dimobj, &mkw)) {
        return NULL;
    }
    if (!PyCallable_Check(module)) {
        PyErr_Format(PyExc_TypeError, "data_parallel: module must be callable, got %.100s",
                     Py_TYPE(module)->tp_name);
        return NULL;
    }
    if (mkw != Py_None && !PyDict_Check(mkw)) {
        PyErr_Format(PyExc_TypeError, "data_parallel: module_kwargs must be a dict or None, "
                     "got %.100s", Py_TYPE(mkw)->tp_name);
        return NULL;
    }
    if (dimobj != NULL && dp_int_from_object(dimobj, "dim", &dim) < 0) {
        return NULL;
    }
    if (ids == Py_None) {
        if (dp_default_devices(st, &devs, &ndev) < 0) {
            return NULL;
        }
    } else if (dp_device_list_from_object(st, ids, "device_ids", &devs, &ndev) < 0) {
        return NULL;
    }
    if (out == Py_None) {
        outdev = devs[0];
    } else if (parse_target_device(st, out, "output_device", &outdev) < 0) {
        goto fail;
    }
    if (inputs == Py_None) {
        in = PyTuple_New(0);
    } else if (PyTuple_Check(inputs)) {
        in = PySequence_Tuple(inputs);
    } else {
        in = PyTuple_Pack(1, inputs);
    }
    if (in == NULL) {
        goto fail;
    }
    res = forward_core(st, module, in, (mkw == Py_None || PyDict_GET_SIZE(mkw) == 0) ? NULL : mkw,
                       devs, ndev, outdev, dim, 0);
fail:
    Py_XDECREF(in);
    PyMem_Free(devs);
    return res;
}

PyMethodDef dp_dataparallel_methods[] = {
    {"replicate", (PyCFunction)(void (*)(void))dp_replicate, METH_VARARGS | METH_KEYWORDS,
     replicate_doc},
    {"parallel_apply", (PyCFunction)(void (*)(void))dp_parallel_apply,
     METH_VARARGS | METH_KEYWORDS, parallel_apply_doc},
    {"data_parallel", (PyCFunction)(void (*)(void))dp_data_parallel,
     METH_VARARGS | METH_KEYWORDS, data_parallel_doc},
    {NULL, NULL, 0, NULL},
};
