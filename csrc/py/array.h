/* array.h - what the files of dpmini.Array share among themselves (array.c
 * the type, array_import.c the CAI/DLPack imports, array_dlpack.c the DLPack
 * export, array_module.c the module functions). The public entry points
 * (dp_export, dp_device_object_meta, dp_array_spec, ...) stay in dpmini.h.
 * The functions keep the names they had as file-local helpers before the
 * split; hidden visibility keeps them out of the extension's exports. */
#ifndef DPMINI_ARRAY_H
#define DPMINI_ARRAY_H

#include "dpmini.h"

#pragma GCC visibility push(hidden)

/* Mark the buffer that owns a's memory as exported (array.c's file comment;
 * gpu_export.c waits before its block is reused): known 1 with the stream a
 * DLPack consumer named (its release waits on that stream), 0 for none (a
 * device sync shared with other such blocks). array.c. */
void mark_exported(dp_state *st, PyArrayObject *a, int known, void *stream);

/* dpmini.Array.__dlpack__ and __dlpack_device__ (array_dlpack.c), in the
 * type's method table (array.c). */
PyObject *array_dlpack(PyObject *op, PyObject *args, PyObject *kw);
PyObject *array_dlpack_device(PyObject *op, PyObject *unused);

/* (device_type, device_id) from obj.__dlpack_device__(), or -1 with no error
 * set (none, or it raised). array_import.c. */
int dlpack_device(PyObject *obj, int *type, int *id);

#pragma GCC visibility pop

#endif
