/* numpy_allocator.c - NumPy's data allocator for replicas on virtual CPU
 * devices: while replica i runs on its worker (parallel_apply.c), the arrays
 * NumPy creates there take their memory from device cpu:i's caching
 * allocator (host_memory.c, alloc.h), as a PyTorch replica on a GPU takes
 * its tensors from the CUDA caching allocator.
 *
 * Why: a replica's temporaries are large (a step on a (2048, 2048) float32
 * shard makes several 16 MiB arrays) and glibc gives blocks that large
 * fresh from mmap at every call, so each call pays a page fault per 4 KiB
 * page and the kernel zeroing it; two replicas fault at once in one
 * process. Measured here on a (4096, 2048) elementwise step: 2,112 faults
 * and 25 ms of its 63 ms in the kernel for plain NumPy. Cached blocks are
 * faulted in once and reused.
 *
 * The handler is NumPy's PyDataMem_Handler (NEP 49), set with
 * PyDataMem_SetHandler in the replica's own context copy, so it never
 * reaches the caller's context. Every block carries a 64-byte header (its
 * device, its size), so free and realloc need nothing from NumPy and a
 * block may be freed on any thread, with or without the GIL, long after the
 * call (an array kept by the replica, or returned). Blocks below
 * NPALLOC_CACHE_MIN come from malloc (glibc's thread arenas are quick there).
 *
 * Off: DPMINI_NUMPY_ALLOCATOR=0 in the environment (read at every call).
 */
#include "dpmini.h"
#include "env.h"
#include "host_memory.h"
#include "pool.h"

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if NPY_FEATURE_VERSION >= NPY_1_22_API_VERSION
#define NPALLOC_AVAILABLE 1
#else
#define NPALLOC_AVAILABLE 0
#endif

#define NPALLOC_HEADER 64                      /* keeps the data 64-byte aligned */
#define NPALLOC_CACHE_MIN ((size_t)256 << 10)  /* smaller blocks: malloc */
#define NPALLOC_MAGIC 0x6470616cu              /* "dpal": a header of ours */

typedef struct {
    size_t rounded;   /* the block's size (header included); 0: from malloc */
    size_t capacity;  /* bytes usable after the header                      */
    int32_t device;   /* virtual CPU device index (cached blocks)           */
    uint32_t magic;
} npalloc_header;

_Static_assert(sizeof(npalloc_header) <= NPALLOC_HEADER, "header fits its slot");

#if NPALLOC_AVAILABLE

/* One handler per device, never freed: an array holds a reference to its
 * handler's capsule, and the capsule points here. */
static PyDataMem_Handler handlers[DP_POOL_MAX_INDEX];

static npalloc_header *header_of(void *data)
{
    return (npalloc_header *)((char *)data - NPALLOC_HEADER);
}

static void *npalloc_malloc(void *ctx, size_t size)
{
    int device = (int)(intptr_t)ctx;
    if (size > SIZE_MAX - NPALLOC_HEADER) {
        return NULL;
    }
    size_t total = size + NPALLOC_HEADER;
    void *block = NULL;
    size_t rounded = 0;
    if (total < NPALLOC_CACHE_MIN) {
        if (posix_memalign(&block, NPALLOC_HEADER, total) != 0) {
            return NULL;
        }
        rounded = 0;
    } else {
        block = dp_vcpu_heap_alloc(device, total, &rounded);
        if (block == NULL) {
            return NULL;
        }
    }
    npalloc_header *h = block;
    h->rounded = rounded;
    h->capacity = rounded != 0 ? rounded - NPALLOC_HEADER : size;
    h->device = device;
    h->magic = NPALLOC_MAGIC;
    return (char *)block + NPALLOC_HEADER;
}

static void npalloc_free(void *ctx, void *data, size_t size)
{
    (void)ctx;
    (void)size;   /* the header knows: after a realloc NumPy's figure may differ */
    if (data == NULL) {
        return;
    }
    npalloc_header *h = header_of(data);
    if (h->rounded == 0) {
        free(h);
    } else {
        dp_vcpu_heap_free(h->device, h, h->rounded);
    }
}

static void *npalloc_calloc(void *ctx, size_t nelem, size_t elsize)
{
    if (elsize != 0 && nelem > SIZE_MAX / elsize) {
        return NULL;
    }
    size_t size = nelem * elsize;
    void *data = npalloc_malloc(ctx, size);
    if (data != NULL) {
        memset(data, 0, size);   /* a cached block holds its last user's bytes */
    }
    return data;
}

static void *npalloc_realloc(void *ctx, void *data, size_t size)
{
    if (data == NULL) {
        return npalloc_malloc(ctx, size);
    }
    npalloc_header *h = header_of(data);
    if (size <= h->capacity && size >= h->capacity / 2) {
        return data;   /* fits the block it has; a large shrink moves */
    }
    void *moved = npalloc_malloc(ctx, size);
    if (moved == NULL) {
        return NULL;   /* the old block stays valid, as realloc's contract says */
    }
    size_t keep = h->capacity < size ? h->capacity : size;
    memcpy(moved, data, keep);
    npalloc_free(ctx, data, 0);
    return moved;
}

/* The capsule of device index's handler, made on first use and kept in
 * st->numpy_handlers (a list indexed by device). Borrowed; NULL on error. */
static PyObject *handler_capsule(dp_state *st, int index)
{
    if (st->numpy_handlers == NULL) {
        st->numpy_handlers = PyList_New(DP_POOL_MAX_INDEX);
        if (st->numpy_handlers == NULL) {
            return NULL;
        }
        for (Py_ssize_t i = 0; i < DP_POOL_MAX_INDEX; i++) {
            PyList_SET_ITEM(st->numpy_handlers, i, Py_NewRef(Py_None));
        }
    }
    PyObject *cap = PyList_GET_ITEM(st->numpy_handlers, index);
    if (cap != Py_None) {
        return cap;
    }
    PyDataMem_Handler *h = &handlers[index];
    if (h->version == 0) {   /* GIL held: no other thread fills it meanwhile */
        snprintf(h->name, sizeof h->name, "dpmini cpu:%d caching allocator", index);
        h->allocator.ctx = (void *)(intptr_t)index;
        h->allocator.malloc = npalloc_malloc;
        h->allocator.calloc = npalloc_calloc;
        h->allocator.realloc = npalloc_realloc;
        h->allocator.free = npalloc_free;
        h->version = 1;
    }
    cap = PyCapsule_New(h, "mem_handler", NULL);   /* the name NumPy checks */
    if (cap == NULL) {
        return NULL;
    }
    PyList_SetItem(st->numpy_handlers, index, cap);   /* steals; drops None */
    return cap;
}

#endif /* NPALLOC_AVAILABLE */

PyObject *dp_numpy_allocator(dp_state *st, dp_device dev)
{
#if NPALLOC_AVAILABLE
    if (dev.kind != DP_VCPU || dev.index < 0 || dev.index >= DP_POOL_MAX_INDEX) {
        return Py_NewRef(Py_None);
    }
    unsigned long long on = 1;
    if (dp_env_uint("DPMINI_NUMPY_ALLOCATOR", 0, 1, &on) == DP_ENV_INVALID) {
        on = 1;   /* as DPMINI_BLAS_LIMIT: only 0 turns it off */
    }
    if (!on) {
        return Py_NewRef(Py_None);
    }
    if (dp_host_memory_ready() < 0) {
        return NULL;
    }
    PyObject *cap = handler_capsule(st, dev.index);
    return cap != NULL ? Py_NewRef(cap) : NULL;
#else
    (void)st;
    (void)dev;
    return Py_NewRef(Py_None);
#endif
}

int dp_numpy_allocator_enter(PyObject *handler)
{
#if NPALLOC_AVAILABLE
    if (handler == NULL || handler == Py_None) {
        return 0;
    }
    PyObject *old = PyDataMem_SetHandler(handler);
    if (old == NULL) {
        return -1;
    }
    Py_DECREF(old);
#else
    (void)handler;
#endif
    return 0;
}
