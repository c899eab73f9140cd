/* replicate_map.c - replicate's bookkeeping: the map from object address to
 * walk node, and the walk state's node and edge buffers (replicate.h).
 */
#include "dpmini.h"
#include "dataparallel.h"
#include "tree.h"
#include "replicate.h"

#include <string.h>

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

Py_ssize_t ptrmap_get(const ptrmap *m, PyObject *key)
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

void rep_walk_init(rep_walk *w, dp_state *st)
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

void rep_walk_free(rep_walk *w)
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

int rep_reserve(rep_walk *w, Py_ssize_t more)
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

Py_ssize_t rep_add_node(rep_walk *w, PyObject *obj, int kind)
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
int rep_add_edge(rep_walk *w, Py_ssize_t parent, Py_ssize_t child,
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
