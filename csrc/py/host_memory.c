/* host_memory.c - device memory on the host side: the caching allocator's
 * host glue (mmap'ed blocks, per-device heaps, the allocation test hook),
 * dpmini._Buffer (the owner of every dpmini allocation, pinned buffers and
 * imported memory; the arrays over it are device_arrays.c's), and the module functions
 * over memory (memory_allocated, memory_reserved, empty_cache; registered in
 * device_module.c's table); the counters and the allocation hook that
 * dpmini._testing reaches through py/test_hooks.c.
 *
 * Devices: the host (ordinary process memory, what NumPy uses), virtual CPU
 * devices "cpu:N" (their own allocations, accounted per device), and CUDA
 * devices (their memory is gpu.c's).
 */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE 1 /* the same spelling as pyconfig.h, which may define it too */
#endif
#include "dpmini.h"
#include "gpu.h"
#include "env.h"

#include <errno.h>
#include <sched.h>
#include <stdlib.h>
#include <string.h>
#include <search.h>
#include <sys/mman.h>
#ifdef __GLIBC__
#include <malloc.h>
#endif

#include "alloc.h"
#include "host_memory.h"
#include "pool.h"

/* ------------------------------------------------------------------ */
/* Caching allocator                                                   */
/* ------------------------------------------------------------------ */

/* Freed blocks are kept per device by the caching allocator (alloc.h: size
 * classes, a bound of min($DPMINI_CACHE_LIMIT, peak allocated bytes +
 * 32 MiB) per device, one mutex per device). This file gives it host memory: blocks of
 * DP_MMAP_MIN bytes and more are mapped and unmapped directly, so that
 * evicted blocks and empty_cache() hand memory back to the system (glibc's
 * heap would keep it: its mmap threshold grows as large blocks are freed). */

#define DP_ALIGN 64
#define DP_HUGE_ALIGN ((size_t)2 << 20)            /* 2 MiB: transparent huge pages */
#define DP_MMAP_MIN ((size_t)256 << 10)            /* blocks this large are mmap'ed */
#define DP_CACHE_LIMIT_DEFAULT ((size_t)1 << 30)   /* bytes cached per device at most; the
                                                      $DPMINI_CACHE_LIMIT default */
#define DP_CACHE_SLACK ((size_t)32 << 20)          /* cached above the peak (alloc.h) */

/* Slot 0 is the host; 1 + index for virtual CPU devices. CUDA memory has
 * its own caches in gpu.c. */
static dp_cache heaps[1 + DP_POOL_MAX_INDEX];
static pthread_once_t heaps_once = PTHREAD_ONCE_INIT;
/* Set once, with the GIL held, by the first dp_buffer_new. */
static size_t cache_limit = DP_CACHE_LIMIT_DEFAULT;
static int cache_limit_read;

static int host_block_alloc(void *ctx, size_t size, void **out, void *err)
{
    (void)ctx;
    (void)err;
    if (size < DP_MMAP_MIN) {
        return posix_memalign(out, DP_ALIGN, size) == 0 ? DP_ALLOC_OK : DP_ALLOC_OOM;
    }
    /* Class sizes from DP_MMAP_MIN up are multiples of 64 KiB, so of the
     * page size. From DP_HUGE_ALIGN up, map 2 MiB more and unmap the ends so
     * that the block starts on a huge-page boundary. */
    size_t extra = size >= DP_HUGE_ALIGN ? DP_HUGE_ALIGN : 0;
    char *base = mmap(NULL, size + extra, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS,
                      -1, 0);
    if (base == MAP_FAILED) {
        return DP_ALLOC_OOM;
    }
    char *p = base;
    if (extra) {
        p = (char *)(((uintptr_t)base + DP_HUGE_ALIGN - 1) & ~(uintptr_t)(DP_HUGE_ALIGN - 1));
        if (p > base) {
            (void)munmap(base, (size_t)(p - base));
        }
        if (p + size < base + size + extra) {
            (void)munmap(p + size, (size_t)(base + size + extra - (p + size)));
        }
#ifdef MADV_HUGEPAGE
        (void)madvise(p, size, MADV_HUGEPAGE); /* a hint: fewer page faults */
#endif
    }
    *out = p;
    return DP_ALLOC_OK;
}

static void host_block_release(void *ctx, void *p, size_t size)
{
    (void)ctx;
    if (size < DP_MMAP_MIN) {
        free(p);
    } else {
        (void)munmap(p, size);
    }
}

static void init_heaps(void)
{
    dp_alloc_backend be = {host_block_alloc, host_block_release, NULL};
    for (size_t i = 0; i < sizeof heaps / sizeof heaps[0]; i++) {
        /* a default mutex attribute cannot fail on Linux */
        (void)dp_cache_init(&heaps[i], be, cache_limit, DP_CACHE_SLACK);
    }
}

static dp_cache *heap_of(dp_device d)
{
    pthread_once(&heaps_once, init_heaps);
    if (d.kind == DP_HOST) {
        return &heaps[0];
    }
    if (d.kind == DP_VCPU && d.index >= 0 && d.index < DP_POOL_MAX_INDEX) {
        return &heaps[1 + d.index];
    }
    return NULL;
}

/* Test hook (dpmini._testing.fail_alloc_after, docs/reliability.md): when
 * >= 0, that many more allocations succeed and the next one fails as if the
 * system were out of memory; -1 is off. */
static long fail_alloc_countdown = -1;

/* True when the test hook says this allocation must fail. */
static int fail_alloc_now(void)
{
    long left = __atomic_load_n(&fail_alloc_countdown, __ATOMIC_RELAXED);
    while (left >= 0) {
        long next = left == 0 ? -1 : left - 1;
        if (__atomic_compare_exchange_n(&fail_alloc_countdown, &left, next, 0,
                                        __ATOMIC_RELAXED, __ATOMIC_RELAXED)) {
            return left == 0;
        }
    }
    return 0;
}

/* A block of h; when the system is out of memory (dp_cache_alloc has
 * already emptied h and tried again), every host and virtual CPU cache is
 * emptied and it tries once more: they all hold the same RAM, so blocks
 * cached for another device may be what is missing. NULL if still out. */
static void *heap_alloc(dp_cache *h, size_t nbytes, size_t *rounded)
{
    void *p = NULL;
    if (dp_cache_alloc(h, nbytes, &p, rounded, NULL) == DP_ALLOC_OK) {
        return p;
    }
    for (size_t i = 0; i < sizeof heaps / sizeof heaps[0]; i++) {
        dp_cache_empty(&heaps[i]);
    }
    if (dp_cache_alloc(h, nbytes, &p, rounded, NULL) == DP_ALLOC_OK) {
        return p;
    }
    return NULL;
}

/* Allocate nbytes on d; NULL when the system is out of memory (no Python
 * error is set, callers raise MemoryError). */
static void *raw_alloc(dp_device d, size_t nbytes, size_t *rounded)
{
    dp_cache *h = heap_of(d);
    if (h == NULL || fail_alloc_now()) {
        return NULL;
    }
    return heap_alloc(h, nbytes, rounded);
}

static void raw_free(dp_device d, void *p, size_t size)
{
    dp_cache_free(heap_of(d), p, size);
}

void *dp_vcpu_heap_alloc(int index, size_t nbytes, size_t *rounded)
{
    dp_device d = {DP_VCPU, index};
    dp_cache *h = heap_of(d);
    return h != NULL ? heap_alloc(h, nbytes, rounded) : NULL;
}

void dp_vcpu_heap_free(int index, void *p, size_t rounded)
{
    dp_device d = {DP_VCPU, index};
    dp_cache_free(heap_of(d), p, rounded);
}

/* ------------------------------------------------------------------ */
/* dpmini._Buffer                                                       */
/* ------------------------------------------------------------------ */

typedef struct {
    dp_BufferObject base;
    size_t rounded;   /* size of the block taken from the heap */
    PyObject *owner;  /* borrowed memory (imports): kept alive, never freed
                         here; NULL when the buffer owns ptr */
    int pinned;       /* host memory from dpc_host_alloc (pin_memory=True) */
} BufferImpl;

PyObject *dp_buffer_wrap(dp_state *st, dp_device d, void *ptr, size_t nbytes, PyObject *owner)
{
    BufferImpl *self = PyObject_New(BufferImpl, st->BufferType);
    if (self == NULL) {
        return NULL;
    }
    self->base.dev = d;
    self->base.nbytes = nbytes;
    self->base.ptr = ptr;
    self->base.exported = 0;
    self->base.export_stream = NULL;
    self->rounded = 0;
    self->pinned = 0;
    self->owner = Py_NewRef(owner);
    return (PyObject *)self;
}

PyObject *dp_buffer_new_pinned(dp_state *st, size_t nbytes)
{
    void *p = NULL;
    dpc_status s;
    Py_BEGIN_ALLOW_THREADS
    s = dpc_host_alloc(-1, nbytes, &p);
    Py_END_ALLOW_THREADS
    if (s.code != 0) {
        dp_gpu_raise(st, s, "pin_memory: allocate page-locked host memory");
        return NULL;
    }
    BufferImpl *self = PyObject_New(BufferImpl, st->BufferType);
    if (self == NULL) {
        (void)dpc_host_free(-1, p);
        return NULL;
    }
    self->base.dev.kind = DP_HOST;
    self->base.dev.index = -1;
    self->base.nbytes = nbytes;
    self->base.ptr = p;
    self->base.exported = 0;
    self->base.export_stream = NULL;
    self->rounded = 0;
    self->pinned = 1;
    self->owner = NULL;
    return (PyObject *)self;
}

/* $DPMINI_CACHE_LIMIT: bytes each device's cache may hold (a non-negative
 * decimal integer, env.h's rule; 0 disables caching). Read once; an invalid value warns
 * RuntimeWarning and keeps the default. GIL held. -1 if the warning raised. */
static int read_cache_limit(void)
{
    if (cache_limit_read) {
        return 0;
    }
    cache_limit_read = 1;
    unsigned long long v;
    int r = dp_env_uint("DPMINI_CACHE_LIMIT", 0, SIZE_MAX, &v);
    if (r == DP_ENV_UNSET) {
        return 0;
    }
    if (r == DP_ENV_INVALID) {
        return PyErr_WarnFormat(PyExc_RuntimeWarning, 1,
                                "DPMINI_CACHE_LIMIT=%.50s is not a byte count (a non-negative "
                                "integer); using the default, %zu bytes (1 GiB)",
                                getenv("DPMINI_CACHE_LIMIT"), (size_t)DP_CACHE_LIMIT_DEFAULT);
    }
    cache_limit = (size_t)v;
    pthread_once(&heaps_once, init_heaps);
    for (size_t i = 0; i < sizeof heaps / sizeof heaps[0]; i++) {
        dp_cache_set_limit(&heaps[i], cache_limit);
    }
    return 0;
}

int dp_host_memory_ready(void)
{
    return cache_limit_read ? 0 : read_cache_limit();
}

/* ------------------------------------------------------------------ */
/* Live virtual-device buffers by address                              */
/* ------------------------------------------------------------------ */

/* The live _Buffers of virtual CPU devices, in a search tree keyed by their
 * address range (live blocks never overlap), so that memory reached through
 * another library (a torch tensor over a shard, whose DLPack chain hides
 * the _Buffer) can be told to be on its device (device_of). Changed and
 * read with the GIL held (buffers are made and freed with it). */
typedef struct {
    const char *start;
    size_t nbytes;
    dp_device dev;
} live_range;

static void *live_root;   /* only blocks of at least one byte */

static int range_cmp(const void *a, const void *b)
{
    const live_range *x = a, *y = b;
    if (x->start + x->nbytes <= y->start) {
        return -1;
    }
    if (y->start + y->nbytes <= x->start) {
        return 1;
    }
    return 0;   /* overlapping: the same live block */
}

/* Record a live block; a failure to record only means device_of says host. */
static void live_add(const void *p, size_t nbytes, dp_device d)
{
    live_range *r = PyMem_RawMalloc(sizeof *r);
    if (r == NULL) {
        return;
    }
    r->start = p;
    r->nbytes = nbytes;
    r->dev = d;
    live_range **slot = tsearch(r, &live_root, range_cmp);
    if (slot == NULL || *slot != r) {
        PyMem_RawFree(r);   /* out of memory, or already there */
    }
}

static void live_remove(const void *p)
{
    live_range key = {p, 1, {DP_HOST, -1}};
    live_range **slot = tfind(&key, &live_root, range_cmp);
    if (slot == NULL) {
        return;
    }
    live_range *r = *slot;
    tdelete(&key, &live_root, range_cmp);
    PyMem_RawFree(r);
}

int dp_vcpu_device_of_ptr(const void *p, dp_device *out)
{
    live_range key = {p, 1, {DP_HOST, -1}};
    live_range **slot = p != NULL ? tfind(&key, &live_root, range_cmp) : NULL;
    if (slot == NULL) {
        return 0;
    }
    *out = (*slot)->dev;
    return 1;
}

PyObject *dp_buffer_new(dp_state *st, dp_device d, size_t nbytes)
{
    if (!cache_limit_read && read_cache_limit() < 0) {
        return NULL;
    }
    BufferImpl *self = PyObject_New(BufferImpl, st->BufferType);
    if (self == NULL) {
        return NULL;
    }
    self->base.dev = d;
    self->base.nbytes = nbytes;
    self->base.exported = 0;
    self->base.export_stream = NULL;
    self->owner = NULL;
    self->pinned = 0;
    if (d.kind == DP_CUDA) {
        dpc_status s;
        Py_BEGIN_ALLOW_THREADS
        s = dp_gpu_alloc(d.index, nbytes, &self->base.ptr, &self->rounded);
        Py_END_ALLOW_THREADS
        if (s.code != 0) {
            char op[96];
            self->base.ptr = NULL;
            Py_DECREF(self);
            snprintf(op, sizeof op, "allocate %zu bytes", nbytes);
            dp_gpu_raise(st, s, op);
            return NULL;
        }
        return (PyObject *)self;
    }
    self->base.ptr = raw_alloc(d, nbytes, &self->rounded);
    if (self->base.ptr == NULL) {
        char name[32];
        dp_device_format(d, name, sizeof name);
        /* Keep dealloc from freeing a block that was never taken. */
        self->rounded = 0;
        Py_DECREF(self);
        PyErr_Format(PyExc_MemoryError,
                     "dpmini: cannot allocate %zu bytes on device %s", nbytes, name);
        return NULL;
    }
    if (d.kind == DP_VCPU && self->rounded > 0 && nbytes > 0) {
        live_add(self->base.ptr, nbytes, d);
    }
    return (PyObject *)self;
}

static void buffer_dealloc(PyObject *op)
{
    BufferImpl *self = (BufferImpl *)op;
    PyTypeObject *tp = Py_TYPE(op);
    if (self->owner != NULL) {
        Py_CLEAR(self->owner);
    } else if (self->pinned) {
        /* cudaFreeHost synchronises the device: not with the GIL held */
        Py_BEGIN_ALLOW_THREADS
        (void)dpc_host_free(-1, self->base.ptr);
        Py_END_ALLOW_THREADS
    } else if (self->base.dev.kind == DP_CUDA) {
        if (self->base.ptr != NULL && self->base.exported) {
            void *consumer = self->base.exported == 1 ? self->base.export_stream : NULL;
            Py_BEGIN_ALLOW_THREADS /* the consumer's kernels finish first */
            dp_gpu_free_exported(self->base.dev.index, self->base.ptr, self->rounded, consumer);
            Py_END_ALLOW_THREADS
        } else if (self->base.ptr != NULL) {
            /* the cache may evict blocks: cudaFree synchronises the device */
            Py_BEGIN_ALLOW_THREADS
            dp_gpu_free(self->base.dev.index, self->base.ptr, self->rounded);
            Py_END_ALLOW_THREADS
        }
    } else if (self->base.ptr != NULL) {
        if (self->base.dev.kind == DP_VCPU && self->rounded > 0 && self->base.nbytes > 0) {
            live_remove(self->base.ptr);
        }
        raw_free(self->base.dev, self->base.ptr, self->rounded);
    }
    PyObject_Free(op);
    Py_DECREF(tp);
}

static PyObject *buffer_repr(PyObject *op)
{
    dp_BufferObject *self = (dp_BufferObject *)op;
    char name[32];
    dp_device_format(self->dev, name, sizeof name);
    return PyUnicode_FromFormat("<dpmini._Buffer %zu bytes on %s>", self->nbytes, name);
}

static PyObject *buffer_get_device(PyObject *op, void *closure)
{
    dp_state *st = dp_state_from_type(Py_TYPE(op));
    return st ? dp_device_to_object(st, ((dp_BufferObject *)op)->dev) : NULL;
}

static PyObject *buffer_get_nbytes(PyObject *op, void *closure)
{
    return PyLong_FromSize_t(((dp_BufferObject *)op)->nbytes);
}

static PyGetSetDef buffer_getset[] = {
    {"device", buffer_get_device, NULL, "Device that owns this memory.", NULL},
    {"nbytes", buffer_get_nbytes, NULL, "Size in bytes.", NULL},
    {NULL},
};

static PyType_Slot buffer_slots[] = {
    {Py_tp_dealloc, buffer_dealloc},
    {Py_tp_repr, buffer_repr},
    {Py_tp_getset, buffer_getset},
    {Py_tp_doc, "Memory owned by one dpmini device; the base of every array dpmini "
                "allocates on a device. Not created directly."},
    {0, NULL},
};

PyType_Spec dp_buffer_spec = {
    .name = "dpmini._Buffer",
    .basicsize = sizeof(BufferImpl),
    .flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_IMMUTABLETYPE | Py_TPFLAGS_DISALLOW_INSTANTIATION,
    .slots = buffer_slots,
};

/* ------------------------------------------------------------------ */
/* Module functions over memory                                       */
/* ------------------------------------------------------------------ */

/* CUDA devices: 1 with *alloc and *reserved filled; 0 for other devices. */
static int gpu_memory_arg(dp_state *st, PyObject *obj, size_t *alloc, size_t *reserved)
{
    dp_device d;
    if (dp_device_from_object(st, obj, "device", DP_DEV_ALLOW_HOST, &d) < 0) {
        return -1;
    }
    if (d.kind != DP_CUDA) {
        return 0;
    }
    dp_gpu_memory(d.index, alloc, reserved);
    return 1;
}

static int heap_arg(dp_state *st, PyObject *obj, dp_cache **out)
{
    dp_device d;
    if (dp_device_from_object(st, obj, "device", DP_DEV_ALLOW_HOST, &d) < 0) {
        return -1;
    }
    *out = heap_of(d);
    if (*out == NULL) {
        PyErr_SetString(PyExc_ValueError, "device: CUDA memory is not accounted here");
        return -1;
    }
    return 0;
}

PyObject *py_memory_allocated(PyObject *m, PyObject *arg)
{
    dp_cache *h;
    size_t ga, gr;
    int g = gpu_memory_arg(dp_state_from_module(m), arg, &ga, &gr);
    if (g != 0) {
        return g < 0 ? NULL : PyLong_FromSize_t(ga);
    }
    if (heap_arg(dp_state_from_module(m), arg, &h) < 0) {
        return NULL;
    }
    return PyLong_FromSize_t(dp_cache_get_stats(h).allocated);
}

PyObject *py_memory_reserved(PyObject *m, PyObject *arg)
{
    dp_cache *h;
    size_t ga, gr;
    int g = gpu_memory_arg(dp_state_from_module(m), arg, &ga, &gr);
    if (g != 0) {
        return g < 0 ? NULL : PyLong_FromSize_t(gr);
    }
    if (heap_arg(dp_state_from_module(m), arg, &h) < 0) {
        return NULL;
    }
    dp_cache_stats cs = dp_cache_get_stats(h);
    return PyLong_FromSize_t(cs.allocated + cs.cached);
}

/* The counters of a host or "cpu:N" heap, for dpmini._testing
 * (test_hooks.c); -1 with an exception set. */
int dp_host_cache_stats(dp_state *st, PyObject *device, dp_cache_stats *out)
{
    dp_cache *h;
    if (heap_arg(st, device, &h) < 0) {
        return -1;
    }
    *out = dp_cache_get_stats(h);
    return 0;
}

PyObject *py_empty_cache(PyObject *m, PyObject *unused)
{
    pthread_once(&heaps_once, init_heaps);
    Py_BEGIN_ALLOW_THREADS
    for (size_t i = 0; i < sizeof heaps / sizeof heaps[0]; i++) {
        dp_cache_empty(&heaps[i]);
    }
#ifdef __GLIBC__
    malloc_trim(0);   /* blocks below DP_MMAP_MIN came from glibc's heap */
#endif
    dp_gpu_empty_cache();
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

long dp_host_fail_alloc_after(long n)
{
    return __atomic_exchange_n(&fail_alloc_countdown, n < 0 ? -1 : n, __ATOMIC_RELAXED);
}
