/* copy_engine.h - internal: the copy engine's jobs and helpers, shared by
 * copy_engine.c (owner), comm.c (the dpmini.comm functions) and reduce.c.
 * The engine's public entry points (dp_scatter_run, dp_gather_arrays,
 * dp_copy_to_device, dp_broadcast_coalesced, dp_reduce_add) are in engine.h.
 *
 * Conventions as in dpmini.h: int results are 0 or -1 with an exception set;
 * PyObject* results are new references or NULL with an exception set. The
 * symbols below are hidden: they do not widen what the extension module
 * exports.
 */
#ifndef DPMINI_COPY_ENGINE_H
#define DPMINI_COPY_ENGINE_H

#include "dpmini.h"
#include "copy.h"

#pragma GCC visibility push(hidden)

/* ------------------------------------------------------------------ */
/* Types                                                               */
/* ------------------------------------------------------------------ */

typedef struct {
    dp_copy_desc desc;  /* simplified                                       */
    char *dst;
    const char *src;
    dp_device exec;     /* whose worker runs it; the host means the caller  */
    dp_device src_dev, dst_dev; /* where each side lives (CUDA: device memory) */
} copy_job;

/* Where a copy goes: its two sides, and the device whose worker runs it (a
 * CUDA side when there is one, so GPU copies run on a GPU's worker). */
typedef struct {
    dp_device src, dst, exec;
} copy_route;

typedef struct {
    copy_job *jobs;     /* PyMem_Malloc'ed */
    Py_ssize_t n, cap;
    size_t bytes;       /* total bytes to copy */
} job_list;

/* ------------------------------------------------------------------ */
/* Functions (all in copy_engine.c)                                    */
/* ------------------------------------------------------------------ */

/* Free a job list's storage and reset it to empty (jobs not run are dropped). */
void jobs_free(job_list *l);
/* Queue dst[...] = src[...] for `shape` (strides in bytes) along `route`. */
int jobs_add(job_list *l, int nd, const npy_intp *shape, size_t itemsize,
             char *dst, const npy_intp *dst_strides,
             const char *src, const npy_intp *src_strides, copy_route route);
/* Refuse an out= array that overlaps itself or any of srcs: ValueError naming argname. */
int check_out_overlap(PyArrayObject *dst, PyArrayObject *const *srcs, Py_ssize_t nsrc,
                      const char *argname, const char *srcname);
/* Refuse out[i] and out[j] (i < j) sharing memory: ValueError. */
int check_outs_disjoint(PyArrayObject *const *outs, Py_ssize_t n);
/* Run every queued job on the device workers (GIL released; small totals inline). */
int jobs_run(job_list *l);
/* The route of a copy between src and dst (which device's worker runs it). */
copy_route exec_device(dp_device src, dp_device dst);
/* ValueError "<argname>: Expected at least one device to scatter to"; NULL. */
PyObject *devices_error(const char *argname);
/* "[5, 3]"-style str of a shape, for messages. */
PyObject *shape_str(int nd, const npy_intp *shape);
/* A sequence of arrays as a PyMem array of new references (*out, *n). */
int arrays_from_sequence(dp_state *st, PyObject *obj, const char *argname,
                         int min_ndim, PyArrayObject ***out, Py_ssize_t *n);
/* Release what arrays_from_sequence returned. */
void arrays_free(PyArrayObject **arrs, Py_ssize_t n);
/* Queue a copy of all of src into a fresh array on dev; new reference. */
PyObject *copy_to(dp_state *st, job_list *jobs, PyArrayObject *src, dp_device dev);

#pragma GCC visibility pop

#endif
