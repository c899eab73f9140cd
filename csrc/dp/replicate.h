/* replicate.h - internal: the replicate walk's types and the functions the
 * replicate files share: replicate_map.c (the node map and walk state),
 * replicate_walk.c (the walk over a module's structure) and replicate.c
 * (the per-device build and the entry points). Not part of dpmini.h;
 * include after it.
 *
 * Conventions as in dpmini.h: int results are 0 or -1 with an exception set.
 * The symbols below are hidden: they do not widen what the extension module
 * exports.
 */
#ifndef DPMINI_REPLICATE_H
#define DPMINI_REPLICATE_H

#include "dpmini.h"
#include "tree.h"

#pragma GCC visibility push(hidden)

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

/* ------------------------------------------------------------------ */
/* Functions                                                           */
/* ------------------------------------------------------------------ */

/* replicate_map.c: an empty walk over st (nothing allocated yet). */
void rep_walk_init(rep_walk *w, dp_state *st);
/* replicate_map.c: release everything the walk holds. */
void rep_walk_free(rep_walk *w);
/* replicate_map.c: the node index of key, or -1 when it has none. */
Py_ssize_t ptrmap_get(const ptrmap *m, PyObject *key);
/* replicate_map.c: a new node for obj (borrowed) of kind; its index or -1. */
/* Room for `more` nodes and edges beyond those added (one allocation for a
 * list's or tuple's children instead of a doubling every few). */
int rep_reserve(rep_walk *w, Py_ssize_t more);
Py_ssize_t rep_add_node(rep_walk *w, PyObject *obj, int kind);
/* replicate_map.c: an edge parent -> child; key: borrowed, or NULL for a position. */
int rep_add_edge(rep_walk *w, Py_ssize_t parent, Py_ssize_t child,
                 Py_ssize_t index, PyObject *key);
/* replicate_walk.c: walk o (depth: containers above it). Returns its node
 * index, RK_LEAF when it is not a node, RK_ERROR with an exception set. */
Py_ssize_t rep_walk_obj(rep_walk *w, PyObject *o, int depth);
/* replicate_walk.c: after the walk, mark every node with an array below it
 * and group the edges that lead to arrays by parent (w->sorted). */
int rep_link(rep_walk *w);

/* "module.layers[1]['w']": the path of w->path[1..depth] (new str). */
PyObject *rep_path(rep_walk *w, int depth);

#pragma GCC visibility pop

#endif
