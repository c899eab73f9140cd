/* tree.h - internal: what the tree walkers share (tree_common.c,
 * tree_containers.c, tree_dims.c, tree_args.c, scatter.c,
 * gather.c, explain.c). The public entry points
 * (dp_scatter_kwargs_ex, dp_gather_outputs_ex, dp_check_dims_spec,
 * dp_parse_split_sizes) are in walk.h.
 *
 * Conventions as in dpmini.h: int results are 0 or -1 with an exception set
 * unless said otherwise; PyObject* results are new references or NULL with
 * an exception set. The symbols below are hidden: they do not widen what the
 * extension module exports.
 */
#ifndef DPMINI_TREE_H
#define DPMINI_TREE_H

#include "dpmini.h"

#pragma GCC visibility push(hidden)

/* ------------------------------------------------------------------ */
/* Types                                                               */
/* ------------------------------------------------------------------ */

typedef enum { SEG_ROOT, SEG_INDEX, SEG_KEY, SEG_ATTR } seg_kind;

/* One step of a path such as kwargs['batch'][2] or out.logits. */
typedef struct path_seg {
    const struct path_seg *up;  /* the parent; NULL only for SEG_ROOT      */
    seg_kind kind;
    const char *root;           /* SEG_ROOT: "args", "kwargs", "inputs", "out" */
    Py_ssize_t index;           /* SEG_INDEX: position in a tuple or list  */
    PyObject *name;             /* SEG_KEY: the dict key, shown with repr;
                                   SEG_ATTR: the field name (a str).
                                   Borrowed: the walker holds a reference. */
    int depth;                  /* containers above this step: 0 at the root */
} path_seg;

/* How deep the walkers go (levels of tuples, lists, dicts, namedtuples,
 * dataclasses and in_dims / out_dims entries below the root). Deeper
 * structures raise RecursionError naming the path (check_depth). A fixed
 * bound of dpmini's own: CPython's recursion guard alone does not protect
 * the C stack once sys.setrecursionlimit() is raised (a 30,000-deep tuple
 * would overflow it), and staying well under the default limit of 1000
 * leaves room for the caller's frames, so a self-referencing container
 * gets this message (naming the path) rather than CPython's. */
#define DP_MAX_NESTING 512

/* What the scatter rules (docs/spec.md 3.1) do with an object. */
enum {
    S_SHARED,      /* every replica gets the same object                  */
    S_ARRAY,       /* split into chunks                                   */
    S_TUPLE,       /* non-empty tuple: one plain tuple per replica        */
    S_LIST,        /* non-empty list: one list per replica                */
    S_NAMEDTUPLE,  /* non-empty namedtuple: type(obj)(*fields) per replica */
    S_DICT         /* non-empty dict: rebuild_mapping per replica         */
};

/* One step of a leaf's path kept by pass (a) (the path_seg chain lives on
 * the C stack only while the walk is under it): the text is made only when
 * a message or _plan needs it (leaf_path). */
typedef struct {
    int up;                     /* the parent node, -1 at the root          */
    seg_kind kind;
    const char *root;
    Py_ssize_t index;
    PyObject *name;             /* strong, or NULL                          */
    const path_seg *seg;        /* the step on the stack: valid only while
                                   its container is being walked           */
} path_node;

/* One array leaf found by pass (a). */
typedef struct {
    PyObject *obj;        /* the leaf as found in the structure (strong)   */
    PyArrayObject *arr;   /* dp_as_array(obj): what is split (strong)      */
    PyObject *origin;     /* dp_array_origin(obj): the way back into obj's
                             library for its chunks, or None (strong)      */
    int node;             /* its path: c->nodes[node] and up               */
    PyObject *path;       /* str, e.g. "args[1]['img']", made by leaf_path;
                             NULL until then                               */
    int bcast;            /* 1: in_dims None: the whole array goes to every
                             replica (dim, count, sizes unused)            */
    int dim;              /* wrapped against arr's rank: 0 <= dim < ndim   */
    int count;            /* chunks it makes on its own, 1..ndev           */
    int64_t *sizes;       /* ndev chunk sizes along dim (elements, PyMem);
                             entries from `count` on are 0; NULL if bcast  */
} scatter_leaf;

typedef struct {
    dp_state *st;
    const dp_device *devs;    /* borrowed, ndev entries                     */
    int ndev;                 /* 1..DP_MAX_DEVICES                          */
    int dim;                  /* as given; wrapped per leaf                 */
    const int64_t *chunk_sizes;  /* ndev explicit sizes, or NULL (borrowed) */
    const double *weights;    /* ndev weights, or NULL (borrowed)           */
    int plan;                 /* _plan: no copies; record shared paths and
                                 the first caller error instead of raising */
    scatter_leaf *leaves;     /* PyMem, nleaves used of cap                 */
    Py_ssize_t nleaves, cap;
    PyObject *shared;         /* plan only: list of paths of shared leaves  */
    PyObject *error;          /* plan only: first caller error (str) or NULL */
    int k;                    /* replica count, from pass (b)               */
    int mismatch;             /* a split leaf loses rows (SplitWarning/strict) */
    PyObject **chunks;        /* nleaves * k new references from pass (c);
                                 a slot is NULL once pass (d) took it       */
    Py_ssize_t cursor;        /* pass (d): the next leaf to hand out        */
    path_node *nodes;         /* PyMem: the leaves' path steps, nnodes used */
    Py_ssize_t nnodes, ncap;
    int node_top;             /* the node of the container being walked, -1 */
} scatter_ctx;

/* ------------------------------------------------------------------ */
/* tree_common.c: paths in messages                                    */
/* ------------------------------------------------------------------ */

/* The root of a path ("args", "kwargs", "in_dims", "out", ...). */
path_seg seg_root(const char *root);
/* A child step below up: an index, a dict key or an attribute name. */
path_seg seg_child(const path_seg *up, seg_kind kind, Py_ssize_t index,
                   PyObject *name);
/* The path as a new str, e.g. "args[1]['img']"; iterative, and a path of
 * more than 40 steps shows its first 32 and "...(N more)". */
PyObject *path_str(const path_seg *seg);
/* The path as C text: in buf (cap bytes) when it is a short plain-ASCII
 * path, else the UTF-8 of a path_str kept in *owned (the caller releases
 * it). NULL with an exception on failure. For paths that only errors show. */
const char *path_text(const path_seg *seg, char *buf, size_t cap, PyObject **owned);
/* A dict key as paths show it: repr(key), or "<type key>" when repr fails
 * with an Exception (new str). */
PyObject *path_key_repr(PyObject *key);
/* 0 while seg is at most DP_MAX_NESTING levels deep; else RecursionError
 * "<path prefix>: nested deeper than ..." and -1. what: "inputs", ... */
int check_depth(const path_seg *seg, const char *what);
/* Take the pending exception (new reference, NULL when none) and clear it. */
PyObject *take_exception(void);
/* Turn a failed constructor call's exception into a TypeError naming the path. */
void raise_rebuild_error(const path_seg *seg, PyTypeObject *tp,
                         const char *how, const char *hint);
/* sep.join(list); the list holds str. */
PyObject *join_str(const char *sep, PyObject *list);
/* Append a new str to list, stealing it (NULL: an error is already set). */
int append_steal(PyObject *list, PyObject *item);
/* "(5, 3)" for an array's shape. */
PyObject *shape_repr(PyArrayObject *a);
/* Is the pending exception a caller mistake that _plan reports as text? */
int is_caller_error(void);
/* Raise exc with "<path of seg>: <fmt...>". Always returns -1. */
int raise_at(PyObject *exc, const path_seg *seg, const char *fmt, ...);

/* ------------------------------------------------------------------ */
/* tree_containers.c: container tests and snapshots                    */
/* ------------------------------------------------------------------ */

/* A dict subclass rebuilt as copy.copy(obj) with copy[key] = value for each
 * pair of pairs (a list of (key, value) 2-tuples); TypeError naming seg. */
PyObject *rebuild_mapping(dp_state *st, PyObject *obj, PyObject *pairs,
                          const path_seg *seg);
/* A namedtuple (tuple subclass with _fields and _asdict)? 1, 0 or -1. */
int is_namedtuple(PyObject *obj);
/* 0 for a namedtuple that may be walked; -1 with TypeError "[<path>: ]a <type>
 * cannot be <verb>: <why>" for one whose fields share no batch dimension (a
 * torch PackedSequence or a subclass), or with the error of looking its type up. */
int refuse_unsplittable(PyObject *obj, const char *path, const char *verb);
/* An instance (not a class) of a dataclass? 1, 0 or -1. */
int is_dataclass_instance(PyObject *obj);
/* type(obj)._fields when a tuple of n str, else NULL with no exception set. */
PyObject *namedtuple_names(PyObject *obj, Py_ssize_t n);
/* A tuple or list's items as a tuple (new reference), safe from resizing. */
PyObject *seq_snapshot(PyObject *seq);
/* A dict's items() as a list of (key, value) 2-tuples. */
PyObject *dict_pairs(PyObject *d);
/* A dict's items as one tuple (k0, v0, k1, v1, ...); PyDict_Next for an
 * exact dict, items() for a subclass. */
PyObject *dict_flat(PyObject *d);
/* An empty dict presized for n keys. */
PyObject *dict_new_sized(Py_ssize_t n);

/* ------------------------------------------------------------------ */
/* tree_dims.c: in_dims / out_dims                                     */
/* ------------------------------------------------------------------ */

/* Is spec a container entry of in_dims / out_dims (tuple, list or dict)? */
int spec_is_container(PyObject *spec);
/* The entry of a container spec for child i (borrowed in *child; NULL: not listed). */
int spec_child(PyObject *spec, const path_seg *up, Py_ssize_t i, PyObject *key,
               PyObject **child, path_seg *sseg);
/* A container spec where the value is not a matching container: TypeError. */
int spec_mismatch(const path_seg *sseg, PyObject *spec, const path_seg *seg,
                  const char *what, const char *fix);
/* Check that a container spec addresses only children that exist. */
int spec_check_children(PyObject *spec, const path_seg *sseg, const path_seg *seg,
                        Py_ssize_t n, PyObject *keys_of, PyObject *names);

/* in_dims / out_dims as one call walks them: checked, and copied into
 * containers the call owns (lists, tuples, plain dicts), so user code run
 * during the walk (a dict subclass's items(), __eq__, a replica) cannot
 * change or free an entry being walked; a change made meanwhile applies
 * from the next call. *out: a new reference, NULL for NULL or None (the
 * default). */
int dims_take(PyObject *spec, const char *argname, int is_out, PyObject **out);

/* ------------------------------------------------------------------ */
/* tree_args.c: arguments of the Python functions                      */
/* ------------------------------------------------------------------ */

/* dim argument: 0 when absent. */
int parse_dim(PyObject *obj, int *dim);
/* scatter_kwargs' inputs: None -> (), a tuple as is, a list as a tuple,
 * else (inputs,). New reference. */
PyObject *normalize_inputs(PyObject *inputs);
/* kwargs: None -> NULL (no kwargs); a dict as is (borrowed). */
int normalize_kwargs(PyObject *kwargs, PyObject **out);

/* ------------------------------------------------------------------ */
/* scatter.c: scatter passes (a) and (b), for explain.c too           */
/* ------------------------------------------------------------------ */

/* Set up c for ndev devices (plan: _plan mode, no copies); ctx_clear frees it. */
int ctx_init(scatter_ctx *c, dp_state *st, const dp_device *devs,
             Py_ssize_t ndev, int dim, int plan);
/* Release everything c holds (safe after a failed ctx_init). */
void ctx_clear(scatter_ctx *c);
/* The key of child i of an S_DICT walked through container_items (borrowed). */
#define container_key(items, i) PyTuple_GET_ITEM((items), 2 * (i))
/* The path of leaf lf as a str (borrowed from lf, made on first use). */
PyObject *leaf_path(scatter_ctx *c, scatter_leaf *lf);
/* Plan mode: keep the first caller error as text (0); else leave it pending (-1). */
int absorb_error(scatter_ctx *c);
/* Pass (a): record the array leaves under obj; spec: its in_dims entry or NULL. */
int collect(scatter_ctx *c, PyObject *obj, const path_seg *seg,
            PyObject *spec, const path_seg *sseg);
/* Pass (b): the replica count c->k and whether the leaves disagree. */
void scatter_count(scatter_ctx *c);
/* The strict=True error text: every array path, shape, dim and size. */
PyObject *strict_message(scatter_ctx *c);
/* The SplitWarning text, or *out = NULL when no row is dropped. */
int truncation_message(scatter_ctx *c, PyObject **out);
/* The top of in_dims split into the positional and keyword entries. */
int split_top_spec(PyObject *in_dims, Py_ssize_t nin, PyObject *kwargs,
                   PyObject **args_spec, PyObject **kw_spec, PyObject **own);
/* Pass (a) for the positional arguments, each with its args_spec entry. */
int collect_args(scatter_ctx *c, PyObject *inputs, PyObject *args_spec);

#pragma GCC visibility pop

#endif
