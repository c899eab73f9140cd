/* interop.h - what interop.c shares with interop_origin.c, and the DLPack
 * capsules shared by array.c and host_dlpack.c (internal to py/). */
#ifndef DPMINI_INTEROP_H
#define DPMINI_INTEROP_H

#include <Python.h>
#include "dpmini.h"
#include "dlpack.h"

#pragma GCC visibility push(hidden)

/* The top-level module name of obj's type ("torch" for torch.Tensor); "" when
 * unknown. New reference; NULL only on memory errors. */
PyObject *dp_top_module(PyObject *obj);
/* module.attr when it is callable, else NULL with no exception (a pending
 * KeyboardInterrupt is kept). */
PyObject *dp_import_attr_quiet(const char *module, const char *attr);

/* The NumPy dtype of a DLPack dtype (new reference): NumPy's own, or
 * ml_dtypes' (bfloat16, the float8 kinds, complex32; ml_dtypes imported on
 * first need). NULL with no exception when there is none
 * (interop_dtype.c). */
PyArray_Descr *dp_descr_from_dl(DLDataType t);
/* The DLPack dtype of d: 0, or -1 (no exception) when DLPack has none or d
 * is not in native byte order (interop_dtype.c). */
int dp_dl_from_descr(PyArray_Descr *d, DLDataType *t);

/* obj's CPU DLPack tensor as an ndarray over its memory, for the dtypes
 * NumPy's from_dlpack refuses (host_dlpack.c). NULL with an exception when
 * __dlpack__ fails or the tensor is not in host memory; NULL with no
 * exception when no NumPy dtype (NumPy's or ml_dtypes') matches. */
PyArrayObject *dp_host_dlpack_import(PyObject *obj, const char *argname);
/* A _HostDLPack over arr: __dlpack__/__dlpack_device__ for a host ndarray
 * whose dtype NumPy's own __dlpack__ refuses (host_dlpack.c). */
PyObject *dp_host_dlpack_export(dp_state *st, PyArrayObject *arr);

/* cap, what __dlpack__ returned, opened: *t its tensor (still the
 * capsule's), *readonly from a versioned capsule's flags. 0, or -1 with
 * BufferError naming argname (not a DLPack capsule, or a newer major
 * version) (dlpack_capsule.c). */
int dp_dlpack_open(PyObject *cap, const char *argname, DLTensor **t, int *readonly);
/* cap taken, as the DLPack Python specification says a consumer does:
 * renamed "used_..." and its tensor handed to the capsule returned (new
 * reference), whose destructor runs the producer's deleter; make it the
 * base of the arrays over the memory. NULL with an exception, cap then still
 * owning the tensor (dlpack_capsule.c). */
PyObject *dp_dlpack_take(PyObject *cap);
/* t's shape into shape, and its strides (in items) in bytes into strides:
 * returns strides, or NULL when t has none (C-contiguous). t->ndim <=
 * NPY_MAXDIMS (dlpack_capsule.c). */
npy_intp *dp_dlpack_shape(const DLTensor *t, npy_intp itemsize, npy_intp *shape,
                          npy_intp *strides);

/* Called with the GIL when a consumer releases an exported tensor it took
 * (not when the capsule dies unused): owner and stream as given to
 * dp_dlpack_capsule. */
typedef void (*dp_dlpack_release)(PyObject *owner, void *stream);
/* A DLPack capsule over a's memory on dev ("dltensor_versioned" with flags,
 * read-only added when a is not writeable, if versioned; else "dltensor"),
 * holding a reference to owner (what keeps the memory alive) until the
 * consumer's deleter runs or the capsule dies unused. NULL with BufferError
 * when a's dtype or strides have no DLPack form (dlpack_capsule.c). */
PyObject *dp_dlpack_capsule(PyArrayObject *a, PyObject *owner, DLDevice dev, int versioned,
                            uint64_t flags, dp_dlpack_release on_release, void *stream);

#pragma GCC visibility pop

#endif
