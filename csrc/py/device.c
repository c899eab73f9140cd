/* device.c - the device model: dpmini.Device, device parsing, and device
 * memory (dpmini._Buffer and its caching allocator).
 *
 * Devices: the host (ordinary process memory, what NumPy uses), virtual CPU
 * devices "cpu:N" (their own allocations, accounted per device, and their
 * own worker thread in pool.c), and CUDA devices (none until the CUDA
 * backend is built; parsing them gives a clear error meanwhile).
 */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE 1 /* the same spelling as pyconfig.h, which may define it too */
#endif
#include "dpmini.h"
#include "gpu.h"
#include "env.h"
#include "plan.h"
#include "pool.h"

#include <errno.h>
#include <sched.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#ifdef __GLIBC__
#include <malloc.h>
#endif

#include "alloc.h"

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

/* Test hook (dpmini._dpmini._fail_alloc_after, docs/reliability.md): when
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

/* Allocate nbytes on d; NULL when the system is out of memory (no Python
 * error is set, callers raise MemoryError). */
static void *raw_alloc(dp_device d, size_t nbytes, size_t *rounded)
{
    dp_cache *h = heap_of(d);
    void *p = NULL;
    if (h == NULL || fail_alloc_now()) {
        return NULL;
    }
    if (dp_cache_alloc(h, nbytes, &p, rounded, NULL) != DP_ALLOC_OK) {
        return NULL;
    }
    return p;
}

static void raw_free(dp_device d, void *p, size_t size)
{
    dp_cache_free(heap_of(d), p, size);
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
    s = dpc_host_alloc(nbytes, &p);
    Py_END_ALLOW_THREADS
    if (s.code != 0) {
        dp_gpu_raise(st, s, "pin_memory: allocate page-locked host memory");
        return NULL;
    }
    BufferImpl *self = PyObject_New(BufferImpl, st->BufferType);
    if (self == NULL) {
        (void)dpc_host_free(p);
        return NULL;
    }
    self->base.dev.kind = DP_HOST;
    self->base.dev.index = -1;
    self->base.nbytes = nbytes;
    self->base.ptr = p;
    self->base.exported = 0;
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
        (void)dpc_host_free(self->base.ptr);
        Py_END_ALLOW_THREADS
    } else if (self->base.dev.kind == DP_CUDA) {
        if (self->base.ptr != NULL && self->base.exported) {
            Py_BEGIN_ALLOW_THREADS /* waits for the consumer's kernels */
            dp_gpu_free_exported(self->base.dev.index, self->base.ptr, self->rounded);
            Py_END_ALLOW_THREADS
        } else if (self->base.ptr != NULL) {
            dp_gpu_free(self->base.dev.index, self->base.ptr, self->rounded);
        }
    } else if (self->base.ptr != NULL) {
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

PyArrayObject *dp_empty(dp_state *st, dp_device d, PyArray_Descr *descr, int nd,
                        const npy_intp *shape, const npy_intp *strides)
{
    size_t nbytes = (size_t)PyDataType_ELSIZE(descr);
    for (int i = 0; i < nd; i++) {
        if (shape[i] < 0) {
            Py_DECREF(descr);
            PyErr_Format(PyExc_ValueError, "shape[%d] is %zd: dimensions must be >= 0",
                         i, (Py_ssize_t)shape[i]);
            return NULL;
        }
        if (shape[i] != 0 && nbytes > SIZE_MAX / (size_t)shape[i]) {
            Py_DECREF(descr);
            PyErr_SetString(PyExc_ValueError, "array is too big: its byte count overflows");
            return NULL;
        }
        nbytes *= (size_t)shape[i];
    }
    /* NumPy's limit; larger sizes also reach malloc as "negative" ones
     * (found by valgrind; reliability.md, bug 9). */
    if (nbytes > (size_t)NPY_MAX_INTP) {
        Py_DECREF(descr);
        PyErr_SetString(PyExc_ValueError, "array is too big: its byte count overflows");
        return NULL;
    }
    PyObject *buf = dp_buffer_new(st, d, nbytes);
    if (buf == NULL) {
        Py_DECREF(descr);
        return NULL;
    }
    PyObject *arr = PyArray_NewFromDescr(&PyArray_Type, descr, nd, (npy_intp *)shape,
                                         (npy_intp *)strides,
                                         ((dp_BufferObject *)buf)->ptr,
                                         NPY_ARRAY_WRITEABLE | NPY_ARRAY_ALIGNED, NULL);
    if (arr == NULL) {
        Py_DECREF(buf);
        return NULL;
    }
    if (PyArray_SetBaseObject((PyArrayObject *)arr, buf) < 0) { /* steals buf */
        Py_DECREF(arr);
        return NULL;
    }
    return (PyArrayObject *)arr;
}

dp_device dp_array_device(dp_state *st, PyArrayObject *a)
{
    PyObject *b = (PyObject *)a;
    while (PyArray_Check(b) && PyArray_BASE((PyArrayObject *)b) != NULL) {
        b = PyArray_BASE((PyArrayObject *)b);
    }
    if (Py_IS_TYPE(b, st->BufferType)) {
        return ((dp_BufferObject *)b)->dev;
    }
    dp_device host = {DP_HOST, -1};
    return host;
}

/* ------------------------------------------------------------------ */
/* Device counts                                                       */
/* ------------------------------------------------------------------ */

int dp_cuda_device_count(void)
{
    return dpc_device_count(); /* 0 without a GPU, a driver or a CUDA build */
}

int dp_cpu_device_count(void)
{
    unsigned long long v;
    if (dp_env_uint("DPMINI_CPU_DEVICES", 1, DP_POOL_MAX_INDEX, &v) == DP_ENV_OK) {
        return (int)v;   /* env.h's rule, as for every DPMINI_ number */
    }
    int n = 0;
#ifdef CPU_COUNT
    cpu_set_t set;
    if (sched_getaffinity(0, sizeof set, &set) == 0) {
        n = CPU_COUNT(&set);
    }
#endif
    return n < 2 ? 2 : (n > DP_POOL_MAX_INDEX ? DP_POOL_MAX_INDEX : n);
}

/* dp_cpu_device_count, warning RuntimeWarning when $DPMINI_CPU_DEVICES is
 * set but not an int in 1..DP_POOL_MAX_INDEX (GIL held). -1 if the warning
 * raised (warnings turned into errors). */
static int cpu_device_count_checked(int *out)
{
    int n = dp_cpu_device_count();
    unsigned long long v;
    if (dp_env_uint("DPMINI_CPU_DEVICES", 1, DP_POOL_MAX_INDEX, &v) == DP_ENV_INVALID) {
        if (PyErr_WarnFormat(PyExc_RuntimeWarning, 1,
                             "DPMINI_CPU_DEVICES=%.50s is not an int in 1..%d; using %d "
                             "virtual CPU devices (the usable cores, at least 2) instead",
                             getenv("DPMINI_CPU_DEVICES"), DP_POOL_MAX_INDEX, n) < 0) {
            return -1;
        }
    }
    *out = n;
    return 0;
}

int dp_default_devices(dp_state *st, dp_device **out, Py_ssize_t *n)
{
    int ncuda = dp_cuda_device_count();
    int count = ncuda;
    char why[512];
    if (ncuda <= 0 && dp_cuda_unusable(why, sizeof why) &&
        PyErr_WarnFormat(PyExc_RuntimeWarning, 1, "CUDA is unusable, so the default devices "
                         "are virtual CPU devices: %s", why) < 0) {
        return -1;
    }
    if (ncuda <= 0 && cpu_device_count_checked(&count) < 0) {
        return -1;
    }
    dp_device *devs = PyMem_Malloc(sizeof(dp_device) * (size_t)count);
    if (devs == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    for (int i = 0; i < count; i++) {
        devs[i].kind = ncuda > 0 ? DP_CUDA : DP_VCPU;
        devs[i].index = i;
    }
    *out = devs;
    *n = count;
    return 0;
}

/* ------------------------------------------------------------------ */
/* Parsing                                                             */
/* ------------------------------------------------------------------ */

void dp_device_format(dp_device d, char *buf, size_t size)
{
    if (d.kind == DP_HOST) {
        snprintf(buf, size, "cpu");
    } else {
        snprintf(buf, size, "%s:%d", d.kind == DP_VCPU ? "cpu" : "cuda", d.index);
    }
}

static const char DEVICE_FORMS[] =
    "'cpu' (the host), 'cpu:N' (virtual CPU device, 0 <= N < 256), 'cuda:N', "
    "an int (CUDA device; -1 is the host) or a dpmini.Device; strings exactly as "
    "str(Device) prints them (no spaces, signs or leading zeros)";

static int check_cuda_index(long index, const char *argname)
{
    int count = dp_cuda_device_count();
    if (index >= count) {
        char why[512];
        if (count == 0 && dp_cuda_unusable(why, sizeof why)) {
            PyErr_Format(PyExc_ValueError, "%s: CUDA device %ld requested, but CUDA is "
                         "unusable: %s", argname, index, why);
        } else if (count == 0) {
            PyErr_Format(PyExc_ValueError,
                         "%s: CUDA device %ld requested, but dpmini sees no CUDA device "
                         "(built without CUDA, or no GPU or driver); use virtual CPU "
                         "devices such as 'cpu:0', 'cpu:1'", argname, index);
        } else {
            PyErr_Format(PyExc_ValueError,
                         "%s: CUDA device %ld requested, but only %d CUDA device(s) exist "
                         "(valid: 0..%d)", argname, index, count, count - 1);
        }
        return -1;
    }
    return 0;
}

/* UTF-8 text of a device string (NULL with an exception set on failure). A
 * string with an embedded NUL becomes "?", which no device matches, instead
 * of being read up to the NUL ("cpu:1\0junk" was cpu:1; reliability.md, bug 6). */
static const char *device_utf8(PyObject *obj)
{
    Py_ssize_t n;
    const char *s = PyUnicode_AsUTF8AndSize(obj, &n);
    if (s == NULL && PyErr_ExceptionMatches(PyExc_UnicodeEncodeError)) {
        PyErr_Clear();   /* lone surrogates ('cpu:\ud800'): no device has them */
        return "?";
    }
    return (s != NULL && (size_t)n != strlen(s)) ? "?" : s;
}

/* Parse "cpu", "cpu:N", "cuda", "cuda:N"; -1 when the text is none of them.
 * Only the canonical spelling, the one str(Device) prints: N is written in
 * decimal digits without a sign, spaces or leading zeros ("cpu:00",
 * " cpu:0", "cpu:+1" are refused), so a string names a device exactly when
 * it equals that device's str(), and equal devices hash alike. */
static int parse_device_text(const char *s, dp_device *out)
{
    const char *rest;
    int kind;
    if (strncmp(s, "cpu", 3) == 0) {
        kind = DP_VCPU;
        rest = s + 3;
    } else if (strncmp(s, "cuda", 4) == 0) {
        kind = DP_CUDA;
        rest = s + 4;
    } else {
        return -1;
    }
    if (*rest == '\0') {
        out->kind = kind == DP_VCPU ? DP_HOST : DP_CUDA;
        out->index = kind == DP_VCPU ? -1 : 0;
        return 0;
    }
    if (*rest != ':' || rest[1] < '0' || rest[1] > '9' || (rest[1] == '0' && rest[2] != '\0')) {
        return -1;
    }
    char *end;
    long v = strtol(rest + 1, &end, 10);
    if (*end != '\0' || v < 0 || v >= DP_POOL_MAX_INDEX) {
        return -1;
    }
    out->kind = kind;
    out->index = (int)v;
    return 0;
}

static int device_from_object(dp_state *st, PyObject *obj, const char *argname,
                              int flags, dp_device *out);

int dp_device_from_object(dp_state *st, PyObject *obj, const char *argname,
                          int flags, dp_device *out)
{
    if (PyLong_Check(obj) || !dp_is_index_like(obj)) {
        return device_from_object(st, obj, argname, flags, out);
    }
    /* NumPy integers name CUDA devices as ints do (convert.c's rule) */
    PyObject *idx = PyNumber_Index(obj);
    if (idx == NULL) {
        return -1;
    }
    int r = device_from_object(st, idx, argname, flags, out);
    Py_DECREF(idx);
    return r;
}

static int device_from_object(dp_state *st, PyObject *obj, const char *argname,
                              int flags, dp_device *out)
{
    dp_device d;
    if (PyObject_TypeCheck(obj, st->DeviceType)) {
        d = ((dp_DeviceObject *)obj)->dev;
        if (d.kind == DP_CUDA && check_cuda_index(d.index, argname) < 0) {
            return -1;
        }
    } else if (PyLong_Check(obj) && !PyBool_Check(obj)) {
        int overflow;
        long v = PyLong_AsLongAndOverflow(obj, &overflow);
        if (v == -1 && PyErr_Occurred()) {
            return -1;
        }
        if (overflow || v < -1) {
            PyErr_Format(PyExc_ValueError,
                         "%s: expected a non-negative CUDA device index or -1 (the host), got %R",
                         argname, obj);
            return -1;
        }
        d.kind = v == -1 ? DP_HOST : DP_CUDA;
        d.index = (int)(v == -1 ? -1 : (v > INT32_MAX ? INT32_MAX : v));
        if (d.kind == DP_CUDA && check_cuda_index(v, argname) < 0) {
            return -1;
        }
    } else if (PyUnicode_Check(obj)) {
        const char *s = device_utf8(obj);
        if (s == NULL) {
            return -1;
        }
        if (parse_device_text(s, &d) < 0) {
            PyErr_Format(PyExc_ValueError, "%s: unknown device %R; expected %s",
                         argname, obj, DEVICE_FORMS);
            return -1;
        }
        if (d.kind == DP_CUDA && check_cuda_index(d.index, argname) < 0) {
            return -1;
        }
    } else {
        PyErr_Format(PyExc_TypeError, "%s: expected a device (%s), got %.100s",
                     argname, DEVICE_FORMS, Py_TYPE(obj)->tp_name);
        return -1;
    }
    if (d.kind == DP_HOST && !(flags & DP_DEV_ALLOW_HOST)) {
        PyErr_Format(PyExc_ValueError,
                     "%s: expected a non-host device ('cpu:N' or 'cuda:N'), got %R; the "
                     "host ('cpu' or -1) can only be an output_device or destination "
                     "(PyTorch: 'Expected a non cpu device')", argname, obj);
        return -1;
    }
    *out = d;
    return 0;
}

int dp_device_list_from_object(dp_state *st, PyObject *obj, const char *argname,
                               dp_device **out, Py_ssize_t *n)
{
    if (PyUnicode_Check(obj) || PyLong_Check(obj) || PyObject_TypeCheck(obj, st->DeviceType)) {
        PyErr_Format(PyExc_TypeError, "%s: expected a list of devices, got a single %.100s",
                     argname, Py_TYPE(obj)->tp_name);
        return -1;
    }
    PyObject *seq = PySequence_Fast(obj, "");
    if (seq == NULL) {
        PyErr_Format(PyExc_TypeError, "%s: expected a list of devices, got %.100s",
                     argname, Py_TYPE(obj)->tp_name);
        return -1;
    }
    Py_ssize_t count = PySequence_Fast_GET_SIZE(seq);
    if (count == 0) {
        Py_DECREF(seq);
        PyErr_Format(PyExc_ValueError, "%s: expected at least one device, got an empty list",
                     argname);
        return -1;
    }
    if (count > DP_MAX_DEVICES) {
        Py_DECREF(seq);
        PyErr_Format(PyExc_ValueError, "%s: at most %d devices, got %zd", argname,
                     DP_MAX_DEVICES, count);
        return -1;
    }
    dp_device *devs = PyMem_Malloc(sizeof(dp_device) * (size_t)count);
    if (devs == NULL) {
        Py_DECREF(seq);
        PyErr_NoMemory();
        return -1;
    }
    for (Py_ssize_t i = 0; i < count; i++) {
        char name[128];
        snprintf(name, sizeof name, "%s[%zd]", argname, i);
        if (dp_device_from_object(st, PySequence_Fast_GET_ITEM(seq, i), name, 0, &devs[i]) < 0) {
            PyMem_Free(devs);
            Py_DECREF(seq);
            return -1;
        }
    }
    Py_DECREF(seq);
    *out = devs;
    *n = count;
    return 0;
}

/* ------------------------------------------------------------------ */
/* dpmini.Device                                                       */
/* ------------------------------------------------------------------ */

PyObject *dp_device_to_object(dp_state *st, dp_device d)
{
    dp_DeviceObject *self = PyObject_New(dp_DeviceObject, st->DeviceType);
    if (self != NULL) {
        self->dev = d;
    }
    return (PyObject *)self;
}

static PyObject *device_new(PyTypeObject *type, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"spec", NULL};
    PyObject *spec;
    dp_device d;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "O:Device", kwlist, &spec)) {
        return NULL;
    }
    dp_state *st = dp_state_from_type(type);
    if (st == NULL) {
        return NULL;
    }
    /* A Device may name a CUDA device that is absent (as torch.device does);
     * using it is what fails. */
    if (PyUnicode_Check(spec)) {
        const char *s = device_utf8(spec);
        if (s == NULL) {
            return NULL;
        }
        if (parse_device_text(s, &d) < 0) {
            PyErr_Format(PyExc_ValueError, "spec: unknown device %R; expected %s", spec,
                         DEVICE_FORMS);
            return NULL;
        }
    } else if (dp_is_index_like(spec)) {   /* ints, NumPy integers (convert.c) */
        long long v;
        if (dp_index_from_object(spec, "spec", LLONG_MIN, LLONG_MAX, &v) < 0) {
            return NULL;
        }
        if (v < -1 || v >= DP_POOL_MAX_INDEX) {
            PyErr_Format(PyExc_ValueError, "spec: device index out of range: %lld", v);
            return NULL;
        }
        d.kind = v == -1 ? DP_HOST : DP_CUDA;
        d.index = (int)v;
    } else if (dp_device_from_object(st, spec, "spec", DP_DEV_ALLOW_HOST, &d) < 0) {
        return NULL;
    }
    dp_DeviceObject *self = (dp_DeviceObject *)type->tp_alloc(type, 0);
    if (self != NULL) {
        self->dev = d;
    }
    return (PyObject *)self;
}

static void device_dealloc(PyObject *op)
{
    PyTypeObject *tp = Py_TYPE(op);
    tp->tp_free(op);
    Py_DECREF(tp);
}

static PyObject *device_str(PyObject *op)
{
    char name[32];
    dp_device_format(((dp_DeviceObject *)op)->dev, name, sizeof name);
    return PyUnicode_FromString(name);
}

static PyObject *device_repr(PyObject *op)
{
    char name[32];
    dp_device_format(((dp_DeviceObject *)op)->dev, name, sizeof name);
    return PyUnicode_FromFormat("dpmini.Device('%s')", name);
}

/* hash(d) == hash(str(d)), since d == str(d): a dict or set keyed by
 * devices finds them by their spelling too. */
static Py_hash_t device_hash(PyObject *op)
{
    PyObject *s = device_str(op);
    if (s == NULL) {
        return -1;
    }
    Py_hash_t h = PyObject_Hash(s);
    Py_DECREF(s);
    return h;
}

static PyObject *device_richcompare(PyObject *a, PyObject *b, int op)
{
    if (op != Py_EQ && op != Py_NE) {
        Py_RETURN_NOTIMPLEMENTED;
    }
    dp_device da = ((dp_DeviceObject *)a)->dev, db;
    if (Py_TYPE(b) == Py_TYPE(a) || PyObject_TypeCheck(b, Py_TYPE(a))) {
        db = ((dp_DeviceObject *)b)->dev;
    } else if (PyUnicode_Check(b)) {
        /* Only the canonical spelling str(a) is equal, so that equal objects
         * hash equal ("cuda" names cuda:0 but is not == Device('cuda:0')). */
        PyObject *s = device_str(a);
        if (s == NULL) {
            return NULL;
        }
        int eq = PyUnicode_Compare(s, b) == 0;
        Py_DECREF(s);
        if (PyErr_Occurred()) {
            return NULL;
        }
        return PyBool_FromLong(op == Py_EQ ? eq : !eq);
    } else {
        Py_RETURN_NOTIMPLEMENTED;
    }
    int eq = dp_device_eq(da, db);
    return PyBool_FromLong(op == Py_EQ ? eq : !eq);
}

static PyObject *device_get_type(PyObject *op, void *closure)
{
    return PyUnicode_FromString(((dp_DeviceObject *)op)->dev.kind == DP_CUDA ? "cuda" : "cpu");
}

static PyObject *device_get_index(PyObject *op, void *closure)
{
    dp_device d = ((dp_DeviceObject *)op)->dev;
    if (d.kind == DP_HOST) {
        Py_RETURN_NONE;
    }
    return PyLong_FromLong(d.index);
}

static PyObject *device_reduce(PyObject *op, PyObject *unused)
{
    PyObject *s = device_str(op);
    if (s == NULL) {
        return NULL;
    }
    return Py_BuildValue("O(N)", (PyObject *)Py_TYPE(op), s);
}

static PyGetSetDef device_getset[] = {
    {"type", device_get_type, NULL, "'cpu' (host or virtual CPU device) or 'cuda'.", NULL},
    {"index", device_get_index, NULL, "Device index; None for the host.", NULL},
    {NULL},
};

static PyMethodDef device_methods_tbl[] = {
    {"__reduce__", device_reduce, METH_NOARGS,
     "__reduce__()\n--\n\nSupport for copy.copy, copy.deepcopy and pickle: a Device is rebuilt\n"
     "from its canonical spelling, Device(str(self)) ('cpu', 'cpu:1', 'cuda:0'), so a\n"
     "copy compares equal to the original. Unpickling a CUDA device where that GPU does not\n"
     "exist raises ValueError, as Device('cuda:N') does."},
    {NULL},
};

PyDoc_STRVAR(device_doc,
"Device(spec)\n--\n\n"
"A place where arrays live and replicas run.\n\n"
"spec: 'cpu' or -1 (the host: ordinary NumPy memory); 'cpu:N' (virtual CPU\n"
"device N, 0 <= N < 256: its own allocations and its own worker thread);\n"
"'cuda', 'cuda:N' or an int N >= 0 (CUDA device N). A Device may name a CUDA\n"
"device that does not exist; using it raises ValueError.\n\n"
"Attributes: type ('cpu' or 'cuda'), index (int, None for the host).\n"
"Compares equal to another Device or to its spec string ('cpu:1'), and\n"
"hashes as that string. Strings are accepted only in that canonical\n"
"spelling (plus 'cuda' for cuda:0): 'cpu:00', ' cpu:0', 'cpu:+1' raise\n"
"ValueError, so a string names a device exactly when it equals it. NumPy\n"
"integers are accepted where ints are.\n"
"Raises ValueError for an unknown spec, TypeError for a wrong type.\n"
"Rule source: torch.device strings; 'cpu:N' is dpmini's virtual device.");

static PyType_Slot device_slots[] = {
    {Py_tp_new, device_new},
    {Py_tp_dealloc, device_dealloc},
    {Py_tp_str, device_str},
    {Py_tp_repr, device_repr},
    {Py_tp_hash, device_hash},
    {Py_tp_richcompare, device_richcompare},
    {Py_tp_getset, device_getset},
    {Py_tp_methods, device_methods_tbl},
    {Py_tp_doc, (void *)device_doc},
    {0, NULL},
};

PyType_Spec dp_device_spec = {
    .name = "dpmini.Device",
    .basicsize = sizeof(dp_DeviceObject),
    .flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_IMMUTABLETYPE,
    .slots = device_slots,
};

/* ------------------------------------------------------------------ */
/* Module functions                                                    */
/* ------------------------------------------------------------------ */

static PyObject *py_device_count(PyObject *m, PyObject *unused)
{
    return PyLong_FromLong(dp_cuda_device_count());
}

static PyObject *py_cpu_device_count(PyObject *m, PyObject *unused)
{
    int n;
    if (cpu_device_count_checked(&n) < 0) {
        return NULL;
    }
    return PyLong_FromLong(n);
}

static PyObject *py_device_of(PyObject *m, PyObject *arg)
{
    dp_state *st = dp_state_from_module(m);
    if (!PyArray_Check(arg) && dp_is_device_object(st, arg)) {
        PyArrayObject *meta = dp_device_object_meta(st, arg, "array");
        if (meta == NULL) {
            return NULL;
        }
        PyObject *r = dp_device_to_object(st, dp_array_device(st, meta));
        Py_DECREF(meta);
        return r;
    }
    if (!PyArray_Check(arg)) {
        PyErr_Format(PyExc_TypeError, "array: expected a numpy.ndarray or a GPU array, got "
                     "%.100s", Py_TYPE(arg)->tp_name);
        return NULL;
    }
    return dp_device_to_object(st, dp_array_device(st, (PyArrayObject *)arg));
}

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

static PyObject *py_memory_allocated(PyObject *m, PyObject *arg)
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

static PyObject *py_memory_reserved(PyObject *m, PyObject *arg)
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

static PyObject *py_cache_stats(PyObject *m, PyObject *arg)
{
    dp_cache *h;
    if (heap_arg(dp_state_from_module(m), arg, &h) < 0) {
        return NULL;
    }
    dp_cache_stats cs = dp_cache_get_stats(h);
    return Py_BuildValue("{snsnsnsnsnsnsKsKsK}", "allocated", (Py_ssize_t)cs.allocated,
                         "cached", (Py_ssize_t)cs.cached, "peak", (Py_ssize_t)cs.peak,
                         "blocks", (Py_ssize_t)cs.nblocks, "limit", (Py_ssize_t)cs.limit,
                         "slack", (Py_ssize_t)cs.slack, "hits", cs.hits,
                         "misses", cs.misses, "evictions", cs.evictions);
}

static PyObject *py_empty_cache(PyObject *m, PyObject *unused)
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

static PyObject *py_fail_alloc_after(PyObject *m, PyObject *arg)
{
    long n = PyLong_AsLong(arg);
    if (n == -1 && PyErr_Occurred()) {
        return NULL;
    }
    return PyLong_FromLong(__atomic_exchange_n(&fail_alloc_countdown, n < 0 ? -1 : n,
                                               __ATOMIC_RELAXED));
}

PyMethodDef dp_device_methods[] = {
    {"_fail_alloc_after", py_fail_alloc_after, METH_O,
     "_fail_alloc_after(n) -> int\n\nTest hook: let n more device allocations succeed, "
     "then fail the next one (MemoryError); n < 0 turns it off. Returns the previous "
     "count (-1 when none was pending, e.g. once the failure has fired)."},
    {"_cache_stats", py_cache_stats, METH_O,
     "_cache_stats(device) -> dict\n\nFor tests and benchmarks: the caching allocator's counters "
     "for a host or virtual CPU device: allocated, cached, peak, limit, slack (bytes), blocks (cached), "
     "hits, misses, evictions. Errors: as memory_allocated; ValueError for a CUDA device."},
    {"device_count", py_device_count, METH_NOARGS,
     "device_count()\n--\n\nReturns an int: the number of CUDA devices dpmini can use (0 without a GPU, a "
     "driver, or a CUDA build). Never raises. Source: torch.cuda.device_count."},
    {"cpu_device_count", py_cpu_device_count, METH_NOARGS,
     "cpu_device_count()\n--\n\nReturns an int: the number of virtual CPU devices ('cpu:0'..) that "
     "DataParallel uses when device_ids is None and there is no GPU: $DPMINI_CPU_DEVICES "
     "when set (1..256), else the number of usable cores, at least 2. An invalid\n"
     "$DPMINI_CPU_DEVICES warns RuntimeWarning naming it and the count used instead."},
    {"device_of", py_device_of, METH_O,
     "device_of(array)\n--\n\nReturns a dpmini.Device: the device that owns an array's memory.\n"
     "A numpy.ndarray: the dpmini device for arrays dpmini allocated (and views of them),\n"
     "else the host ('cpu'). A GPU array: a dpmini.Array, or any object with\n"
     "__cuda_array_interface__ or a CUDA __dlpack_device__() (CuPy, PyTorch CUDA tensors,\n"
     "Numba): its CUDA device, e.g. Device('cuda:1'), read through the same zero-copy\n"
     "import dpmini uses for arguments (no data is copied).\n"
     "Rule source: torch.Tensor.device (a view lives where its base's memory lives).\n"
     "Raises TypeError when array is neither a numpy.ndarray nor a GPU array (a list,\n"
     "a NumPy scalar), and the producer's own error (or TypeError/BufferError naming\n"
     "'array') when a GPU object's protocol fails."},
    {"memory_allocated", py_memory_allocated, METH_O,
     "memory_allocated(device)\n--\n\nReturns an int: bytes (rounded to the allocator's block sizes) "
     "held by live dpmini arrays on a device ('cpu' counts dpmini's host allocations "
     "only). device: 'cpu' or -1 (the host), 'cpu:N', 'cuda:N', an int or a dpmini.Device.\n"
     "Errors: TypeError for a device of the wrong type (a float, a list); ValueError for\n"
     "an unknown spelling, a virtual device index outside 0..255, or a CUDA device that\n"
     "does not exist (the message says when dpmini sees no GPU at all).\n"
     "Source: torch.cuda.memory_allocated."},
    {"memory_reserved", py_memory_reserved, METH_O,
     "memory_reserved(device)\n--\n\nReturns an int: memory_allocated plus the bytes the caching "
     "allocator keeps for reuse on that device. device: as for memory_allocated.\n"
     "Errors: TypeError for a device of the wrong type; ValueError for an unknown spelling,\n"
     "an index out of range or a missing CUDA device. Source: torch.cuda.memory_reserved."},
    {"empty_cache", py_empty_cache, METH_NOARGS,
     "empty_cache()\n--\n\nReturn every cached block of every device (virtual CPU devices, the\n"
     "host's gathered outputs, CUDA devices) to the system; returns None. Live arrays are\n"
     "not touched. Errors: none (takes no argument; TypeError if given one).\n"
     "Source: torch.cuda.empty_cache."},
    {NULL},
};
