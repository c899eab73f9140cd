/* host_memory.h - the module functions over memory that host_memory.c
 * defines and device_module.c lists in dp_device_methods (their docstrings
 * are in that table). Like every function of the extension they are hidden
 * (setup.py: -fvisibility=hidden); only PyInit__dpmini is exported. */
#ifndef DPMINI_HOST_MEMORY_H
#define DPMINI_HOST_MEMORY_H

#include "dpmini.h"
#include "alloc.h"

PyObject *py_memory_allocated(PyObject *m, PyObject *arg);
PyObject *py_memory_reserved(PyObject *m, PyObject *arg);
PyObject *py_empty_cache(PyObject *m, PyObject *unused);
/* For dpmini._testing (test_hooks.c): the heap counters of a host or
 * "cpu:N" device (-1 with an exception set), and the allocation hook (n
 * more host allocations succeed, then one fails; -1 off; returns the
 * previous countdown). */
int dp_host_cache_stats(dp_state *st, PyObject *device, dp_cache_stats *out);
long dp_host_fail_alloc_after(long n);

/* For numpy_allocator.c: a block of at least nbytes from virtual CPU device
 * index's cache (its size in *rounded), or NULL when out of memory; no
 * Python calls, any thread. The test hook dp_host_fail_alloc_after does not
 * apply. */
void *dp_vcpu_heap_alloc(int index, size_t nbytes, size_t *rounded);
/* Give a dp_vcpu_heap_alloc block back (any thread). */
void dp_vcpu_heap_free(int index, void *p, size_t rounded);
/* The virtual CPU device whose live _Buffer holds address p: 1 with *out
 * set, 0 when none does (GIL held). */
int dp_vcpu_device_of_ptr(const void *p, dp_device *out);
/* Reads $DPMINI_CACHE_LIMIT once (GIL held); -1 if its warning raised. */
int dp_host_memory_ready(void);

#endif
