/* host_memory.h - the module functions over memory that host_memory.c
 * defines and device_module.c lists in dp_device_methods (their docstrings
 * are in that table).
 * The functions keep the names they had as file-local helpers before the
 * split; hidden visibility keeps them out of the extension's exports. */
#ifndef DPMINI_HOST_MEMORY_H
#define DPMINI_HOST_MEMORY_H

#include "dpmini.h"

#pragma GCC visibility push(hidden)

PyObject *py_memory_allocated(PyObject *m, PyObject *arg);
PyObject *py_memory_reserved(PyObject *m, PyObject *arg);
PyObject *py_cache_stats(PyObject *m, PyObject *arg);
PyObject *py_empty_cache(PyObject *m, PyObject *unused);
PyObject *py_fail_alloc_after(PyObject *m, PyObject *arg);

#pragma GCC visibility pop

#endif
