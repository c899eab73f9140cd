/* dataparallel_type.h - internal to csrc/dp/dataparallel.c (the type, its
 * construction and forward) and csrc/dp/dataparallel_attrs.c (its repr,
 * attributes and pickling): the object layout and the helpers both use.
 */
#ifndef DPMINI_DATAPARALLEL_TYPE_H
#define DPMINI_DATAPARALLEL_TYPE_H

#include "dpmini.h"

#pragma GCC visibility push(hidden)

typedef struct {
    PyObject_HEAD
    PyObject *module;          /* the wrapped callable; Py_None before __init__ */
    dp_device *devs;           /* device_ids, PyMem_Malloc'ed; NULL before __init__ */
    Py_ssize_t ndev;           /* len(device_ids); >= 1 once devs is set */
    dp_device output_device;   /* gather target; may be the host */
    int dim;                   /* scatter/gather dim as given (wrapped per array) */
    int strict;                /* 1: different chunk counts raise (scatter.c) */
    PyObject *in_dims;         /* owned; None: dim for every input (scatter.c,
                                  dp_split_opts); types checked on set */
    PyObject *out_dims;        /* owned; None: dim for every output */
    PyObject *chunk_sizes;     /* owned; None or a tuple of ints >= 0 */
    PyObject *weights;         /* owned; None or a tuple of numbers > 0;
                                  never both set; lengths are checked
                                  against device_ids on each call */
    struct dp_snapshot *active;  /* the calls running now, innermost first (see
                                    "Helpers: one call's options"); NULL when none */
    PyObject *dict;            /* instance __dict__ (tp_dictoffset); may be NULL */
    PyObject *weakreflist;     /* weak references (tp_weaklistoffset); may be NULL */
} dp_DataParallelObject;

/* The split and gather options of one call (all borrowed; Py_None when not
 * given). See dp_split_opts and dp_gather_outputs_ex in dpmini.h. */
typedef struct {
    int dim;
    int strict;
    PyObject *in_dims;
    PyObject *out_dims;
    PyObject *chunk_sizes;
    PyObject *weights;
} call_opts;

/* What one call uses of a DataParallel's settings. User code run during the
 * call (a dict subclass's items(), a replica, another thread while the GIL
 * is released) may reassign dp.module or dp.device_ids; the call keeps its
 * own reference and its own copy of the device list, so it neither reads
 * freed memory nor mixes old and new settings. */
#define DP_SNAP_INLINE 16
typedef struct dp_snapshot {
    struct dp_snapshot *next;  /* the call below it in self->active          */
    unsigned long thread;      /* PyThread_get_thread_ident() of its caller  */
    int claimed;               /* taken by forward (see call_begin)          */
    PyObject *module;          /* owned                                      */
    dp_device *devs;           /* inline_devs or PyMem_Malloc'ed; ndev items */
    Py_ssize_t ndev;
    dp_device output_device;
    int dim;
    int strict;
    PyObject *in_dims;         /* owned; the extension options (docs/spec.md 12-14) */
    PyObject *out_dims;        /* owned                                      */
    PyObject *chunk_sizes;     /* owned                                      */
    PyObject *weights;         /* owned                                      */
    dp_device inline_devs[DP_SNAP_INLINE];
} dp_snapshot;


/* The helpers below are in dataparallel_call.c. */

/* a gather target: "cpu"/-1 (host; -1 warns FutureWarning,
 * docs/spec.md 4.3) or a device. 0, or -1 with an exception naming argname. */
int dp_parse_target_device(dp_state *st, PyObject *obj, const char *argname,
                           dp_device *out);
/* a new list of dpmini.Device for devs[0..n). */
PyObject *dp_device_list_new(dp_state *st, const dp_device *devs, Py_ssize_t n);
/* -1 with RuntimeError when __init__ was not called. */
int dp_check_initialised(dp_DataParallelObject *self);
/* check in_dims, out_dims, chunk_sizes and weights as given
 * to a constructor (ndev devices); chunk_sizes / weights become tuples (new
 * references in *cs_out / *w_out). */
int dp_check_call_opts(PyObject *in_dims, PyObject *out_dims, PyObject *cs, PyObject *w,
                       Py_ssize_t ndev, PyObject **cs_out, PyObject **w_out);

/* scatter_kwargs with the options o over devs[0..ndev). */
int dp_scatter_with(dp_state *st, PyObject *args, PyObject *kwargs, const dp_device *devs,
                    Py_ssize_t ndev, const call_opts *o, PyObject **inputs, PyObject **kws);
/* the C forward on the exact type: scatter, replicate, parallel_apply, gather. */
PyObject *dp_forward_core(dp_state *st, PyObject *module, PyObject *args, PyObject *kwargs,
                          const dp_device *devs, Py_ssize_t ndev, dp_device output_device,
                          const call_opts *o);
/* forward: the C path on the exact type, the overridable steps on a subclass. */
PyObject *dp_forward_dispatch(dp_DataParallelObject *self, PyObject *args, PyObject *kwargs);
/* the settings of one call: take (0, or -1 with MemoryError), view, release */
int dp_snapshot_take(dp_DataParallelObject *self, dp_snapshot *s);
call_opts dp_snap_opts(const dp_snapshot *s);
void dp_snapshot_release(dp_snapshot *s);
/* the calls running on self, innermost first */
void dp_call_push(dp_DataParallelObject *self, dp_snapshot *s, int claimed);
void dp_call_pop(dp_DataParallelObject *self, dp_snapshot *s);
/* the options a step method called from inside forward uses */
int dp_step_options(dp_DataParallelObject *self, dp_snapshot *buf, int *borrowed);

/* dataparallel_attrs.c: tp_repr, tp_getset, __reduce__ and its docstring. */
PyObject *dp_DataParallel_repr(dp_DataParallelObject *self);
extern PyGetSetDef dp_DataParallel_getset[];
PyObject *dp_DataParallel_reduce(dp_DataParallelObject *self, PyObject *unused);
extern const char dp_DataParallel_reduce_doc[];

#pragma GCC visibility pop

#endif
