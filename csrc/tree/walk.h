/* walk.h - what tree/ offers the layers above it (dp/, module/): the
 * scatter and gather walkers over nested Python structures
 * (scatter.c, gather.c), their argument checks (tree_common.c)
 * and the method tables of dpmini.scatter/gather/explain. The walkers' own
 * helpers are in tree.h.
 *
 * Conventions as in dpmini.h: int results are 0 or -1 with an exception set;
 * PyObject* results are new references or NULL with an exception set.
 */
#ifndef DPMINI_WALK_H
#define DPMINI_WALK_H

#include <stdint.h>
#include "dpmini.h"

/* 0, or -1 with TypeError "inputs: a ... cannot be scattered: ..." when inputs,
 * a tuple to be taken as the argument tuple, is a namedtuple whose fields share
 * no batch dimension (a torch PackedSequence): unpacked as arguments, its
 * fields would be split one by one into pieces that do not fit together. */
int dp_refuse_unsplittable_inputs(PyObject *inputs);

/* DataParallel's scatter_kwargs (docs/spec.md 2.3, 2.7, 3.x) with dpmini's rules:
 * the replica count is the smallest chunk count over the array leaves of
 * inputs and kwargs together (non-array leaves never add replicas); with no
 * array leaf every device gets a replica. Different chunk counts warn
 * dpmini.SplitWarning, or raise ValueError when strict. inputs is a tuple
 * (or NULL), kwargs a dict (or NULL). Sets *inputs_out to a tuple of k
 * tuples and *kwargs_out to a tuple of k dicts (k >= 1 unless both are
 * empty, then both are empty tuples). */
int dp_scatter_kwargs(dp_state *st, PyObject *inputs, PyObject *kwargs,
                      const dp_device *devs, Py_ssize_t ndev, int dim, int strict,
                      PyObject **inputs_out, PyObject **kwargs_out);

/* How one scatter splits its array leaves (dpmini's extensions; all
 * pointers borrowed and owned by the caller).
 *   in_dims: NULL or None: every array leaf is split along dim (PyTorch).
 *     Otherwise a structure mirroring the arguments (JAX pmap's in_axes):
 *     an int splits along that dim, None broadcasts the leaf whole to every
 *     replica, a tuple/list/dict mirrors a container (a prefix of a tuple or
 *     list, a subset of a dict's keys; what it leaves out uses dim), and an
 *     int or None given for a container applies to every leaf under it. At
 *     the top of dp_scatter_kwargs_ex a tuple/list addresses the positional
 *     arguments and a dict addresses them by position (int keys) and name
 *     (str keys, the keyword arguments). Broadcast leaves never change the
 *     replica count.
 *   chunk_sizes: ndev explicit sizes (>= 0) for every split leaf, or NULL.
 *   weights: ndev weights for dp_weighted_sizes (plan.h), or NULL.
 *   At most one of chunk_sizes and weights is set. */
typedef struct {
    int dim;                    /* default split dim, wrapped per array      */
    int strict;                 /* 1: different chunk counts raise           */
    PyObject *in_dims;          /* see above; may be NULL                    */
    const int64_t *chunk_sizes; /* ndev entries, or NULL                     */
    const double *weights;      /* ndev entries, or NULL                     */
} dp_split_opts;

/* dp_scatter_kwargs with in_dims, chunk_sizes and weights (opts). Errors in
 * in_dims name its path (e.g. "in_dims[1]['x']"). */
int dp_scatter_kwargs_ex(dp_state *st, PyObject *inputs, PyObject *kwargs,
                         const dp_device *devs, Py_ssize_t ndev,
                         const dp_split_opts *opts,
                         PyObject **inputs_out, PyObject **kwargs_out);

/* Parse the chunk_sizes= and weights= arguments (each None or a sequence of
 * ndev numbers; at most one given) into caller arrays of DP_MAX_DEVICES
 * entries, and point opts->chunk_sizes / opts->weights at them (NULL when
 * not given). ValueError/TypeError naming the argument and entry. */
/* scatter_kwargs' per-replica positional arguments (a tuple of tuples,
 * stolen) in the container inputs came in: each replica's tuple made a list
 * when inputs is a non-empty list, as PyTorch's scatter_kwargs gives ([x]
 * -> [x_i] per replica; [] -> () as for no inputs); else per_replica
 * itself. New reference, NULL on error (tree_args.c). */
PyObject *dp_inputs_as_lists(PyObject *inputs, PyObject *per_replica);

int dp_parse_split_sizes(PyObject *chunk_sizes, PyObject *weights, Py_ssize_t ndev,
                         int64_t *sizes_buf, double *weights_buf,
                         dp_split_opts *opts);

/* Check the leaf types of an in_dims (is_out 0) or out_dims (is_out 1)
 * structure: ints, None, "sum" (out_dims only), and tuples, lists and
 * dicts of them. TypeError/ValueError naming the path, e.g. "out_dims['x']". */
int dp_check_dims_spec(PyObject *spec, const char *argname, int is_out);

/* dp_gather_outputs with out_dims (NULL or None: dim everywhere, PyTorch).
 * out_dims mirrors the outputs: an int gathers along that dim; None
 * returns replica 0's value after checking every replica returned an equal
 * one; "sum" adds the replicas' values (reduce_add onto target for arrays);
 * a tuple/list/dict mirrors a container (prefix / subset of keys; the rest
 * uses dim); int, None and "sum" apply to every leaf under a container. */
PyObject *dp_gather_outputs_ex(dp_state *st, PyObject *outputs, dp_device target,
                               int dim, PyObject *out_dims);

/* DataParallel's gather (docs/spec.md 4, with dpmini's rules for dataclasses,
 * None/array mixes, str and number leaves). outputs: a sequence, one
 * entry per replica. */
PyObject *dp_gather_outputs(dp_state *st, PyObject *outputs, dp_device target,
                            int dim);

/* Method tables (module/module.c adds them). */
extern PyMethodDef dp_scatter_methods[];      /* scatter.c */
extern PyMethodDef dp_gather_methods[];       /* gather.c */
extern PyMethodDef dp_plan_methods[];         /* explain.c  */

#endif
