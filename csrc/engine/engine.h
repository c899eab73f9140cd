/* engine.h - what engine/ offers the layers above it (tree/, dp/, module/):
 * copies between devices (copy_engine.c, copy_broadcast.c), reduce_add
 * (reduce.c) and the method tables of dpmini.comm and dpmini.asarray
 * (comm.c, asarray.c). engine/'s own helpers are in copy_engine.h and
 * comm.h.
 *
 * Conventions as in dpmini.h: int results are 0 or -1 with an exception set;
 * PyObject* results are new references or NULL with an exception set.
 */
#ifndef DPMINI_ENGINE_H
#define DPMINI_ENGINE_H

#include <stdint.h>
#include "dpmini.h"

/* One array to scatter (all pointers borrowed, except out). */
typedef struct {
    PyArrayObject *src;
    int dim;                 /* already wrapped, 0 <= dim < ndim         */
    int nchunks;             /* chunks to make (<= ndev)                 */
    const int64_t *sizes;    /* nchunks sizes along dim, sum <= shape[dim]
                                (a prefix is allowed: truncation)        */
    PyObject **out;          /* nchunks slots; receive new references    */
} dp_scatter_item;

/* Scatter several arrays in one pass: chunk j of every item goes to devs[j].
 * A chunk whose device is the array's own device is a view (docs/spec.md 3.4);
 * others are copied into fresh device memory (dense layouts keep their
 * strides, others become C-contiguous). The copies of all items run on the
 * device worker threads with the GIL released (inline below a size
 * threshold). On failure every out slot is NULL. */
int dp_scatter_run(dp_state *st, dp_scatter_item *items, int nitems,
                   const dp_device *devs);

/* Concatenate parts along dim onto dest (comm.gather rules, docs/spec.md 4.6-4.8).
 * out (may be NULL) receives the result in place and is returned (new ref).
 * argname prefixes error messages (e.g. "tensors" or "out['loss']"). */
PyObject *dp_gather_arrays(dp_state *st, PyArrayObject **parts, Py_ssize_t n,
                           int dim, dp_device dest, PyArrayObject *out,
                           const char *argname);
/* dp_gather_arrays with a fresh result carved from slab (dp_empty_slab:
 * the small results of one gather share buffers; NULL: its own buffer). */
PyObject *dp_gather_arrays_slab(dp_state *st, PyArrayObject **parts, Py_ssize_t n,
                                int dim, dp_device dest, PyArrayObject *out,
                                const char *argname, dp_slab *slab);

/* comm.broadcast_coalesced on a list of arrays: returns a new list of ndev
 * lists; list 0 holds the inputs themselves where they already live on
 * devs[0], copies elsewhere. */
PyObject *dp_broadcast_coalesced(dp_state *st, PyObject *arrays,
                                 const dp_device *devs, Py_ssize_t ndev,
                                 size_t buffer_size);

/* Sum same-shaped arrays onto dest (comm.reduce_add). */
PyObject *dp_reduce_add(dp_state *st, PyObject *arrays, dp_device dest,
                        const char *argname);

/* A copy of src (any device) on dev, synchronously; new shadow/ndarray. */
PyObject *dp_copy_to_device(dp_state *st, PyArrayObject *src, dp_device dev);

/* Method tables (module/module.c adds them): the functions on the main
 * module (asarray.c) and the dpmini.comm submodule's (comm.c). */
extern PyMethodDef dp_comm_methods[];
extern PyMethodDef dp_comm_submodule_methods[];

#endif
