/* numpy_allocator.c - NumPy's data allocator for replicas on virtual CPU
 * devices: while replica i runs on its worker (parallel_apply.c), the large
 * arrays NumPy creates there take their memory from device cpu:i's caching
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
 * reaches the caller's context. What it does:
 *   - malloc of NPALLOC_CACHE_MIN bytes or more: a block of the device's
 *     cache, recorded in a table (pointer -> device, block size), so free
 *     and realloc need nothing from NumPy (its size argument is not always
 *     the size it asked for) and the block keeps its exact size class;
 *   - smaller mallocs, every calloc (np.zeros: the kernel's lazily zeroed
 *     pages beat writing zeros over a cached block) and the blocks that
 *     are not in the table: NumPy's own default handler, as if this one
 *     were not set.
 * A cached block may be freed on any thread, long after the call (an array
 * kept by the replica, or returned).
 *
 * Off: DPMINI_NUMPY_ALLOCATOR=0 in the environment (read at every call).
 */
#include "dpmini.h"
#include "env.h"
#include "host_memory.h"
#include "pool.h"

#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if NPY_FEATURE_VERSION >= NPY_1_22_API_VERSION
#define NPALLOC_AVAILABLE 1
#else
#define NPALLOC_AVAILABLE 0
#endif

#define NPALLOC_CACHE_MIN ((size_t)256 << 10)  /* smaller: NumPy's default handler */

#if NPALLOC_AVAILABLE

/* ------------------------------------------------------------------ */
/* The table of cached blocks handed out                               */
/* ------------------------------------------------------------------ */

/* Open addressing with linear probing, at most half full; deletion moves
 * later entries of the probe run back (no tombstones). */
typedef struct {
    void *ptr;          /* NULL: empty slot */
    size_t rounded;     /* the block's size in the device's cache */
    int device;
} block_entry;

static pthread_mutex_t table_mu = PTHREAD_MUTEX_INITIALIZER;
static block_entry *table;
static size_t table_cap;     /* a power of two, or 0 */
static size_t table_count;

static size_t slot_of(const void *p, size_t cap)
{
    uint64_t h = (uint64_t)(uintptr_t)p >> 6;   /* blocks are 64-byte aligned */
    h *= 0x9e3779b97f4a7c15ull;
    return (size_t)(h >> 17) & (cap - 1);
}

static void table_put(block_entry *t, size_t cap, block_entry e)
{
    size_t i = slot_of(e.ptr, cap);
    while (t[i].ptr != NULL) {
        i = (i + 1) & (cap - 1);
    }
    t[i] = e;
}

/* Record e; 0, or -1 when the table cannot grow (out of memory). */
static int table_add(block_entry e)
{
    pthread_mutex_lock(&table_mu);
    if (2 * (table_count + 1) > table_cap) {
        size_t cap = table_cap ? 2 * table_cap : 256;
        block_entry *t = calloc(cap, sizeof *t);
        if (t == NULL) {
            pthread_mutex_unlock(&table_mu);
            return -1;
        }
        for (size_t i = 0; i < table_cap; i++) {
            if (table[i].ptr != NULL) {
                table_put(t, cap, table[i]);
            }
        }
        free(table);
        table = t;
        table_cap = cap;
    }
    table_put(table, table_cap, e);
    __atomic_store_n(&table_count, table_count + 1, __ATOMIC_RELEASE);  /* read unlocked */
    pthread_mutex_unlock(&table_mu);
    return 0;
}

/* Find p: its entry in *out, removed from the table when take is set; 1 if
 * found, 0 if p is not a block of ours. */
static int table_find(const void *p, int take, block_entry *out)
{
    if (__atomic_load_n(&table_count, __ATOMIC_ACQUIRE) == 0) {
        return 0;   /* the common case of a small array's free: no lock */
    }
    pthread_mutex_lock(&table_mu);
    if (table_cap == 0) {
        pthread_mutex_unlock(&table_mu);
        return 0;
    }
    size_t i = slot_of(p, table_cap);
    while (table[i].ptr != NULL && table[i].ptr != p) {
        i = (i + 1) & (table_cap - 1);
    }
    if (table[i].ptr == NULL) {
        pthread_mutex_unlock(&table_mu);
        return 0;
    }
    *out = table[i];
    if (take) {
        /* Backward-shift deletion: move up each later entry of the run
         * whose home slot is not between the hole and it (cyclically). */
        size_t hole = i, j = i;
        for (;;) {
            j = (j + 1) & (table_cap - 1);
            if (table[j].ptr == NULL) {
                break;
            }
            size_t home = slot_of(table[j].ptr, table_cap);
            int stays = hole <= j ? (hole < home && home <= j) : (hole < home || home <= j);
            if (!stays) {
                table[hole] = table[j];
                hole = j;
            }
        }
        table[hole].ptr = NULL;
        __atomic_store_n(&table_count, table_count - 1, __ATOMIC_RELEASE);
    }
    pthread_mutex_unlock(&table_mu);
    return 1;
}

/* ------------------------------------------------------------------ */
/* The handler                                                         */
/* ------------------------------------------------------------------ */

/* NumPy's default handler, read once (GIL held) before any handler of ours
 * is handed out. */
static PyDataMemAllocator numpy_default;

/* One handler per device, never freed: an array holds a reference to its
 * handler's capsule, and the capsule points here. */
static PyDataMem_Handler handlers[DP_POOL_MAX_INDEX];

static void *npalloc_malloc(void *ctx, size_t size)
{
    if (size < NPALLOC_CACHE_MIN) {
        return numpy_default.malloc(numpy_default.ctx, size);
    }
    int device = (int)(intptr_t)ctx;
    size_t rounded = 0;
    void *p = dp_vcpu_heap_alloc(device, size, &rounded);
    if (p == NULL) {
        return NULL;
    }
    block_entry e = {p, rounded, device};
    if (table_add(e) < 0) {
        dp_vcpu_heap_free(device, p, rounded);
        return NULL;
    }
    return p;
}

static void npalloc_free(void *ctx, void *p, size_t size)
{
    (void)ctx;
    block_entry e;
    if (p != NULL && table_find(p, 1, &e)) {
        dp_vcpu_heap_free(e.device, p, e.rounded);
    } else {
        numpy_default.free(numpy_default.ctx, p, size);
    }
}

static void *npalloc_calloc(void *ctx, size_t nelem, size_t elsize)
{
    (void)ctx;
    return numpy_default.calloc(numpy_default.ctx, nelem, elsize);
}

static void *npalloc_realloc(void *ctx, void *p, size_t size)
{
    block_entry e;
    if (p == NULL) {
        return npalloc_malloc(ctx, size);
    }
    if (!table_find(p, 0, &e)) {
        /* NumPy's block: it stays NumPy's (its size is not known here) */
        return numpy_default.realloc(numpy_default.ctx, p, size);
    }
    if (size <= e.rounded && size >= e.rounded / 2) {
        return p;   /* fits the block it has; a large shrink moves */
    }
    void *moved = npalloc_malloc(ctx, size);
    if (moved == NULL) {
        return NULL;   /* the old block stays valid, as realloc's contract says */
    }
    memcpy(moved, p, e.rounded < size ? e.rounded : size);
    npalloc_free(ctx, p, 0);
    return moved;
}

/* The capsule of device index's handler, made on first use and kept in
 * st->numpy_handlers (a list indexed by device). Borrowed; NULL on error. */
static PyObject *handler_capsule(dp_state *st, int index)
{
    if (numpy_default.malloc == NULL) {
        PyDataMem_Handler *def = PyCapsule_GetPointer(PyDataMem_DefaultHandler, "mem_handler");
        if (def == NULL) {
            return NULL;
        }
        numpy_default = def->allocator;
    }
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

int dp_numpy_allocator_enabled(void)
{
#if NPALLOC_AVAILABLE
    unsigned long long on = 1;
    if (dp_env_uint("DPMINI_NUMPY_ALLOCATOR", 0, 1, &on) == DP_ENV_INVALID) {
        on = 1;   /* as DPMINI_BLAS_LIMIT: only 0 turns it off */
    }
    return on != 0;
#else
    return 0;
#endif
}

PyObject *dp_numpy_allocator(dp_state *st, dp_device dev)
{
#if NPALLOC_AVAILABLE
    if (dev.kind != DP_VCPU || dev.index < 0 || dev.index >= DP_POOL_MAX_INDEX) {
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
