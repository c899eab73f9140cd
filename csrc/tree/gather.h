/* gather.h - internal: what the gather files share (gather_tree.c,
 * gather_values.c, gather_containers.c, gather_out_dims.c). Include after
 * dpmini.h and tree.h. The public entry points (dp_gather_outputs,
 * dp_gather_outputs_ex) stay in dpmini.h.
 *
 * Conventions as in tree.h: int results are 0 or -1 with an exception set
 * unless said otherwise; PyObject* results are new references or NULL with
 * an exception set. vals[i] is replica i's value at the position (borrowed,
 * n >= 1), seg its path. The symbols below are hidden.
 */
#ifndef DPMINI_GATHER_H
#define DPMINI_GATHER_H

#include "tree.h"

#pragma GCC visibility push(hidden)

/* What gather does at a leaf (out_dims; OUT_CAT is PyTorch's rule). */
enum {
    OUT_CAT = 0,   /* concatenate arrays along dim (the rules of spec 4)  */
    OUT_SAME,      /* out_dims None: every replica's value must be equal  */
    OUT_SUM        /* out_dims "sum": add the replicas' values            */
};

typedef struct {
    dp_state *st;
    dp_device target;   /* where arrays are gathered                      */
    int dim;            /* as given; wrapped per array position           */
    int mode;           /* OUT_*, from out_dims; OUT_CAT by default       */
    dp_slab *slab;      /* the call's buffers for small results (shared by
                           the copies of g made for out_dims entries)     */
} gather_ctx;

/* What gather does with the value at one position (outputs[0]'s kind picks
 * the rule; every replica must have the same kind). */
enum {
    G_ARRAY,       /* concatenate along dim                               */
    G_NONE,        /* None                                                */
    G_DICT,        /* key by key, replica 0's order and type              */
    G_NAMEDTUPLE,  /* field by field, type(out)._make                     */
    G_DATACLASS,   /* field by field, rebuilt with the class              */
    G_SEQ,         /* list/tuple: position by position, same length       */
    G_VALUE,       /* str, bytes, numbers: one value if all are equal     */
    G_OTHER        /* anything else: the same object from every replica   */
};

/* What join_each shows of each replica's value. */
enum { SHOW_TYPE, SHOW_REPR, SHOW_NDIM, SHOW_LEN, SHOW_DTYPE };

/* ------------------------------------------------------------------ */
/* gather_tree.c: the walk                                             */
/* ------------------------------------------------------------------ */

/* ", ".join of one item per value (SHOW_*), for error messages. */
PyObject *join_each(PyObject *const *vals, Py_ssize_t n, int show);
/* Probing a value's kind raised: re-raise it naming seg. Returns -1. */
int kind_error_at(gather_ctx *g, const path_seg *seg);
/* The gathered value of one position; spec: its out_dims entry (NULL:
 * g->mode and g->dim, inherited), sseg the entry's path. */
PyObject *gather_map(gather_ctx *g, PyObject *const *vals, Py_ssize_t n,
                     const path_seg *seg, PyObject *spec, const path_seg *sseg);

/* ------------------------------------------------------------------ */
/* gather_values.c: leaves                                             */
/* ------------------------------------------------------------------ */

/* A Python number (int, float, complex, bool; not a NumPy scalar)? 1 or 0. */
int is_py_number(PyObject *o);
/* A NumPy scalar or Python number as a new 0-dim ndarray; NULL with no
 * exception set for anything else. */
PyObject *scalar_as_array(PyObject *o);
/* The n ndarrays can be gathered into arrs[0]'s dtype without losing data;
 * else TypeError naming cpath and every replica's dtype. */
int check_dtypes(PyObject *const *arrs, Py_ssize_t n, const char *cpath);
/* Arrays: concatenated along g->dim onto g->target (spec 4.5-4.8). */
PyObject *gather_leaf(gather_ctx *g, PyObject *const *vals, Py_ssize_t n,
                      const path_seg *seg);
/* Two floats/complexes equal but for NaN in the same places? 1 or 0. */
int same_nan_value(PyObject *a, PyObject *b);
/* str, bytes, numbers: vals[0] when every replica's value is equal. */
PyObject *gather_value(gather_ctx *g, PyObject *const *vals, Py_ssize_t n,
                       const path_seg *seg);
/* Any other object: vals[0] when every replica returns the same one (or
 * equal values of one type hashed by value). */
PyObject *gather_same(gather_ctx *g, PyObject *const *vals, Py_ssize_t n,
                      const path_seg *seg);

/* ------------------------------------------------------------------ */
/* gather_containers.c: containers rebuilt                             */
/* ------------------------------------------------------------------ */

/* Dicts key by key, in replica 0's key order and type (spec 4.1, R14). */
PyObject *gather_dict(gather_ctx *g, PyObject *const *vals, Py_ssize_t n,
                      const path_seg *seg, PyObject *spec, const path_seg *sseg);
/* Lists, tuples, namedtuples (kind G_SEQ / G_NAMEDTUPLE) position by
 * position, same length everywhere (R18). */
PyObject *gather_seq(gather_ctx *g, PyObject *const *vals, Py_ssize_t n,
                     int kind, const path_seg *seg, PyObject *spec,
                     const path_seg *sseg);
/* Dataclass instances field by field, without running __init__ (R17). */
PyObject *gather_dataclass(gather_ctx *g, PyObject *const *vals, Py_ssize_t n,
                           const path_seg *seg, PyObject *spec,
                           const path_seg *sseg);

/* ------------------------------------------------------------------ */
/* gather_out_dims.c: out_dims None and "sum"                          */
/* ------------------------------------------------------------------ */

/* out_dims "sum" at a number: v0 + v1 + ... in replica order. */
PyObject *gather_sum_values(gather_ctx *g, PyObject *const *vals, Py_ssize_t n,
                            const path_seg *seg);
/* out_dims None at a str/number/other object: vals[0] when all are equal. */
PyObject *gather_equal_values(gather_ctx *g, PyObject *const *vals, Py_ssize_t n,
                              const path_seg *seg);
/* An array position, gathered by g->mode, handed back in the leaves'
 * array library. */
PyObject *gather_array_position(gather_ctx *g, PyObject *const *vals, Py_ssize_t n,
                                const path_seg *seg);

#pragma GCC visibility pop

#endif
