/* interop.h - what interop.c shares with interop_origin.c (internal to py/). */
#ifndef DPMINI_INTEROP_H
#define DPMINI_INTEROP_H

#include <Python.h>

#pragma GCC visibility push(hidden)

/* The top-level module name of obj's type ("torch" for torch.Tensor); "" when
 * unknown. New reference; NULL only on memory errors. */
PyObject *dp_top_module(PyObject *obj);
/* module.attr when it is callable, else NULL with no exception (a pending
 * KeyboardInterrupt is kept). */
PyObject *dp_import_attr_quiet(const char *module, const char *attr);

#pragma GCC visibility pop

#endif
