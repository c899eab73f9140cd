/* interop.h - what interop.c shares with interop_origin.c (internal to py/). */
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

#pragma GCC visibility pop

#endif
