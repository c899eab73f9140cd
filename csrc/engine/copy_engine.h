/* copy_engine.h - internal: the copy engine's jobs and helpers, shared by
 * the engine's files: copy_jobs.c (the jobs, jobs_launch's feed),
 * copy_overlap.c (out= checks),
 * copy_engine.c (scatter, gather), copy_broadcast.c, comm.c and
 * comm_broadcast.c (the dpmini.comm functions) and reduce.c.
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
#include "profile.h"

#pragma GCC visibility push(hidden)

/* ------------------------------------------------------------------ */
/* Types                                                               */
/* ------------------------------------------------------------------ */

/* Dims a queued copy keeps in its job; a simplified copy (copy.h) rarely
 * has more, and one that has keeps its descriptor on the heap. */
#define JOB_DIMS 8

typedef struct {
    /* the simplified copy (dp_copy_simplify), compact: a full dp_copy_desc
     * holds DP_MAXDIMS dims (1.5 KB), and a call can queue tens of
     * thousands of jobs */
    int ndim;
    size_t itemsize;
    uint64_t bytes;     /* numel * itemsize                                  */
    int64_t shape[JOB_DIMS], src_strides[JOB_DIMS], dst_strides[JOB_DIMS];
    dp_copy_desc *big;  /* PyMem: the descriptor when ndim > JOB_DIMS, else NULL */
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
    copy_job *jobs;     /* PyMem_Malloc'ed, or `fixed`                      */
    Py_ssize_t n, cap;
    size_t bytes;       /* total bytes to copy */
    copy_job *fixed;    /* caller storage the list started in (never freed
                           here; see jobs_init_fixed), or NULL              */
    Py_ssize_t launched;     /* jobs [0, launched) already handed to the
                                workers by jobs_launch                      */
    size_t launched_bytes;   /* their bytes                                 */
    struct job_feed *feed;   /* the consumers jobs_launch started (copy_jobs.c), or NULL */
} job_list;


/* ------------------------------------------------------------------ */
/* Functions                                                           */
/* ------------------------------------------------------------------ */

/* copy_jobs.c: free a job list's storage and reset it to empty (jobs not run are dropped). */
void jobs_free(job_list *l);
/* copy_jobs.c: an empty list whose first `cap` jobs go into the caller's
 * `buf` (a call that queues a few jobs allocates nothing); buf must outlive it. */
void jobs_init_fixed(job_list *l, copy_job *buf, Py_ssize_t cap);
/* copy_jobs.c: make room for `more` jobs beyond those queued (one allocation). */
int jobs_reserve(job_list *l, Py_ssize_t more);
/* copy_jobs.c: queue dst[...] = src[...] for `shape` (strides in bytes) along `route`. */
int jobs_add(job_list *l, int nd, const npy_intp *shape, size_t itemsize,
             char *dst, const npy_intp *dst_strides,
             const char *src, const npy_intp *src_strides, copy_route route);
/* copy_jobs.c: queue all of src into dst (src's shape and item size) along `route`. */
int jobs_add_array(job_list *l, PyArrayObject *dst, PyArrayObject *src, copy_route route);
/* copy_overlap.c: refuse an out= array that overlaps itself or any of srcs:
 * ValueError naming argname. */
int check_out_overlap(PyArrayObject *dst, PyArrayObject *const *srcs, Py_ssize_t nsrc,
                      const char *argname, const char *srcname);
/* copy_overlap.c: refuse out[i] and out[j] (i < j) sharing memory: ValueError. */
int check_outs_disjoint(PyArrayObject *const *outs, Py_ssize_t n);
/* copy_jobs.c: run every queued job on the device workers (GIL released; small totals inline). */
int jobs_run(job_list *l);
/* copy_jobs.c: start the jobs queued since the last launch on the device
 * workers now, while the caller goes on queuing (GIL held): copies between
 * host and virtual CPU memory only, and only in a list that will not move
 * (jobs_reserve'd for all its jobs). The first call starts one consumer per
 * core; later calls hand them the new jobs. 1 when started, 0 when left
 * for jobs_run, -1 on error. jobs_run (or jobs_free, on an error path)
 * waits for them. */
int jobs_launch(job_list *l);
/* copy_engine.c: the route of a copy between src and dst (which device's worker runs it). */
copy_route exec_device(dp_device src, dp_device dst);
/* copy_engine.c: ValueError "<argname>: Expected at least one device to scatter to"; NULL. */
PyObject *devices_error(const char *argname);
/* copy_engine.c: "[5, 3]"-style str of a shape, for messages. */
PyObject *shape_str(int nd, const npy_intp *shape);
/* copy_arrays.c: a sequence of arrays as a PyMem array of new references (*out, *n). */
int arrays_from_sequence(dp_state *st, PyObject *obj, const char *argname,
                         int min_ndim, PyArrayObject ***out, Py_ssize_t *n);
/* copy_arrays.c: release what arrays_from_sequence returned. */
void arrays_free(PyArrayObject **arrs, Py_ssize_t n);
/* copy_broadcast.c: queue a copy of all of src into a fresh array on dev; new reference. */
PyObject *copy_to(dp_state *st, job_list *jobs, PyArrayObject *src, dp_device dev);
/* copy_engine.c: a fresh array on dev for a copy of the strided region
 * (data of src's dtype, shape, strides): a dense region keeps its layout
 * (PyTorch's memory_format=preserve), anything else becomes C-contiguous. */
PyArrayObject *empty_like_region(dp_state *st, dp_device dev, PyArrayObject *src,
                                 const npy_intp *shape, const npy_intp *strides);

#pragma GCC visibility pop

#endif
