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

/* For numpy_allocator.c: a block of at least nbytes from virtual CPU device
 * index's cache (its size in *rounded), or NULL when out of memory; no
 * Python calls, any thread. The test hook of _fail_alloc_after does not
 * apply. */
void *dp_vcpu_heap_alloc(int index, size_t nbytes, size_t *rounded);
/* Give a dp_vcpu_heap_alloc block back (any thread). */
void dp_vcpu_heap_free(int index, void *p, size_t rounded);
/* The virtual CPU device whose live _Buffer holds address p: 1 with *out
 * set, 0 when none does (GIL held). */
int dp_vcpu_device_of_ptr(const void *p, dp_device *out);
/* Reads $DPMINI_CACHE_LIMIT once (GIL held); -1 if its warning raised. */
int dp_host_memory_ready(void);

#pragma GCC visibility pop

#endif
