/* host_memory.h - the module functions over memory that host_memory.c
 * defines and device_module.c lists in dp_device_methods (their docstrings
 * are in that table). */
#ifndef DPMINI_HOST_MEMORY_H
#define DPMINI_HOST_MEMORY_H

#include "dpmini.h"

PyObject *dp_py_memory_allocated(PyObject *m, PyObject *arg);
PyObject *dp_py_memory_reserved(PyObject *m, PyObject *arg);
PyObject *dp_py_cache_stats(PyObject *m, PyObject *arg);
PyObject *dp_py_empty_cache(PyObject *m, PyObject *unused);
PyObject *dp_py_fail_alloc_after(PyObject *m, PyObject *arg);

#endif
