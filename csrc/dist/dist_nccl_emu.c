/* dist_nccl_emu.c - NCCL and the CUDA runtime calls of dist_nccl.h,
 * emulated over MPI on host memory, so that the GPU collectives of
 * dpmini.distributed (communicator set-up, the guard, the stream polling,
 * errors, timeouts, aborts) run in CI on the emulated build of dpmini.
 *
 * What it keeps from NCCL:
 *   - ncclGetUniqueId / ncclCommInitRank: a communicator per rank, made
 *     from rank 0's id (checked); it duplicates the MPI communicator given
 *     by dist_nccl_emu_set_parent (real NCCL connects through the id).
 *   - Asynchrony: a collective only posts non-blocking MPI operations and
 *     returns; the work completes while cudaStreamQuery is polled
 *     (cudaErrorNotReady until then), as a kernel queued on a stream.
 *   - Streams per device: NCCL queues on the stream it is given, and the
 *     legacy default stream (0) is the one of the communicator's device;
 *     cudaMemcpy2DAsync and cudaStreamQuery / cudaStreamSynchronize on
 *     stream 0 mean the legacy stream of the calling thread's current
 *     device (cudaSetDevice, per thread, 0 at start). A query of another
 *     device's stream 0 sees none of the communicator's work, as on a GPU.
 *   - Semantics: ncclAllReduce / ncclReduce (sum, prod, max, min, avg) on
 *     the ten NCCL dtypes (float16 and bfloat16 combined in double, rounded
 *     to nearest even), ncclBroadcast (root's sendbuff copied to its
 *     recvbuff), ncclSend / ncclRecv, result codes (ncclInvalidArgument for
 *     a bad dtype, op, root, count or a buffer on another device).
 *   - Device pointers: the emulated build of dpmini gives "cuda:N" memory
 *     addresses with bit 55 set and the device in bits 48..54 (see
 *     csrc/backend/cuda_emulate.c); they are decoded here, and a buffer on
 *     another device than the communicator's is refused. Addresses without
 *     that tag are used as host memory.
 *   - Devices of a host: cudaDeviceGetPCIBusId maps an ordinal through
 *     $CUDA_VISIBLE_DEVICES (a list of integers) to a physical GPU, so that
 *     ranks that each see one GPU as cuda:0 are told apart as on a SLURM or
 *     torchrun node; cudaDevAttrMaxPitch is $DPMINI_EMULATE_MAX_PITCH
 *     (default 2^31 - 1, as on current GPUs) and cudaMemcpy2DAsync refuses
 *     a larger pitch (cudaErrorInvalidPitchValue).
 *   - Faults, from $DPMINI_DIST_NCCL_FAULT at each collective: "fail" (the
 *     call returns ncclSystemError), "error" (the call is queued but never
 *     completes and ncclCommGetAsyncError reports ncclRemoteError, as when a
 *     peer dies), "hang" (never completes, no error: the timeout path),
 *     "init_hang" (ncclCommInitRank never returns, as when a rank died
 *     before connecting).
 * What it does not keep: GPU memory, NVLink or network speed, NCCL's
 * blocking ncclCommInitRank across machines (MPI_Comm_dup here).
 */
#define _POSIX_C_SOURCE 200809L
#include "dist_nccl.h"

#include <limits.h>
#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#define EMU_TAG ((uintptr_t)1 << 55)
#define EMU_DEV_SHIFT 48
#define EMU_ADDR_MASK (((uintptr_t)1 << EMU_DEV_SHIFT) - 1)
#define EMU_ID_MAGIC "dpmini-emulated-nccl-id"
#define EMU_TAG_P2P 7201

/* One queued operation: an MPI request of a communicator, or (comm NULL)
 * a 2D copy that runs once every operation queued before it is done. */
typedef struct emu_op {
    struct emu_op *next;
    struct dp_nccl_comm *comm;
    dist_stream_t stream;   /* the stream it was queued on ...         */
    int dev;                /* ... and, for stream 0, whose legacy one  */
    MPI_Request req;
    int never;              /* a fault: never completes                 */
    int reduce;             /* combine `scratch` into recv on completion */
    void *scratch, *recv;
    size_t count;
    int dtype, op, nranks;
    const char *src;        /* a 2D copy                                */
    size_t dpitch, spitch, width, height;
} emu_op;

struct dp_nccl_comm {
    MPI_Comm comm;
    int rank, size, dev, async_error;
};

static pthread_mutex_t emu_mu = PTHREAD_MUTEX_INITIALIZER;
static emu_op *emu_queue;   /* the one emulated stream, in order */
static MPI_Comm emu_parent = MPI_COMM_NULL;
static __thread int emu_device;
static dist_nccl_api emu_api;

void dist_nccl_emu_set_parent(MPI_Comm parent)
{
    emu_parent = parent;
}

/* ------------------------------------------------------------------ */
/* Element arithmetic: the ten NCCL dtypes read as uint64 (integers,    */
/* wrapping as on a GPU) or double (floating; float16 and bfloat16      */
/* converted by hand, rounded to nearest even), and the reduction of    */
/* every rank's contribution in rank order (sum, prod, max, min, avg).  */
/* ------------------------------------------------------------------ */

/* Bytes of an NCCL dtype, 0 when it is none. */
static size_t dtype_size(int t)
{
    static const size_t sizes[] = {1, 1, 4, 4, 8, 8, 2, 4, 8, 2};
    return t >= 0 && t <= NCCL_T_BFLOAT16 ? sizes[t] : 0;
}

static double half_to_double(uint16_t h)
{
    int e = (h >> 10) & 0x1f, m = h & 0x3ff;
    double v = e == 0 ? ldexp(m, -24) : e == 31 ? (m ? NAN : INFINITY) : ldexp(m + 1024, e - 25);
    return (h & 0x8000) ? -v : v;
}

static uint16_t half_from_double(double d)
{
    float f = (float)d;
    uint32_t x, m, h, rem, mid;
    memcpy(&x, &f, 4);
    uint16_t sign = (uint16_t)((x >> 16) & 0x8000);
    int e = (int)((x >> 23) & 0xff) - 127 + 15;
    m = x & 0x7fffff;
    if (((x >> 23) & 0xff) == 0xff)
        return sign | 0x7c00 | (m ? 0x200 : 0);
    if (e >= 31)
        return sign | 0x7c00;
    if (e <= 0) {                     /* a half subnormal, or zero */
        if (e < -10)
            return sign;
        m |= 0x800000;
        int shift = 14 - e;
        h = m >> shift;
        rem = m & ((1u << shift) - 1);
        mid = 1u << (shift - 1);
    } else {
        h = ((uint32_t)e << 10) | (m >> 13);
        rem = m & 0x1fff;
        mid = 0x1000;
    }
    if (rem > mid || (rem == mid && (h & 1)))
        h++;                          /* a carry rounds up into the exponent */
    return (uint16_t)(sign | h);
}

static double bf16_to_double(uint16_t b)
{
    uint32_t x = (uint32_t)b << 16;
    float f;
    memcpy(&f, &x, 4);
    return f;
}

static uint16_t bf16_from_double(double d)
{
    float f = (float)d;
    uint32_t x;
    memcpy(&x, &f, 4);
    if ((x & 0x7fffffff) > 0x7f800000)
        return (uint16_t)((x >> 16) | 0x40);
    return (uint16_t)((x + 0x7fff + ((x >> 16) & 1)) >> 16);
}

static int is_float(int t)
{
    return t >= NCCL_T_FLOAT16;
}

static int is_signed(int t)
{
    return t == NCCL_T_INT8 || t == NCCL_T_INT32 || t == NCCL_T_INT64;
}

/* Integers as uint64 (wrapping arithmetic, as on a GPU), floats as double. */
static uint64_t load_int(const char *p, int t)
{
    switch (t) {
    case NCCL_T_INT8: return (uint64_t)(int64_t)*(const int8_t *)p;
    case NCCL_T_UINT8: return *(const uint8_t *)p;
    case NCCL_T_INT32: return (uint64_t)(int64_t)*(const int32_t *)p;
    case NCCL_T_UINT32: return *(const uint32_t *)p;
    default: { uint64_t v; memcpy(&v, p, 8); return v; }
    }
}

static void store_int(char *p, int t, uint64_t v)
{
    switch (t) {
    case NCCL_T_INT8: case NCCL_T_UINT8: *(uint8_t *)p = (uint8_t)v; break;
    case NCCL_T_INT32: case NCCL_T_UINT32: { uint32_t w = (uint32_t)v; memcpy(p, &w, 4); break; }
    default: memcpy(p, &v, 8);
    }
}

static double load_float(const char *p, int t)
{
    uint16_t h;
    float f;
    double d;
    switch (t) {
    case NCCL_T_FLOAT16: memcpy(&h, p, 2); return half_to_double(h);
    case NCCL_T_BFLOAT16: memcpy(&h, p, 2); return bf16_to_double(h);
    case NCCL_T_FLOAT32: memcpy(&f, p, 4); return f;
    default: memcpy(&d, p, 8); return d;
    }
}

static void store_float(char *p, int t, double v)
{
    uint16_t h;
    float f = (float)v;
    switch (t) {
    case NCCL_T_FLOAT16: h = half_from_double(v); memcpy(p, &h, 2); break;
    case NCCL_T_BFLOAT16: h = bf16_from_double(v); memcpy(p, &h, 2); break;
    case NCCL_T_FLOAT32: memcpy(p, &f, 4); break;
    default: memcpy(p, &v, 8);
    }
}

static int int_less(uint64_t a, uint64_t b, int t)
{
    return is_signed(t) ? (int64_t)a < (int64_t)b : a < b;
}

/* recv[i] = op over the nranks rows of scratch (count elements each), in rank
 * order. */
static void combine(const void *scratch, void *recv, size_t count, int dtype, int op,
                    int nranks)
{
    size_t w = dtype_size(dtype), row = count * w;
    const char *s = scratch;
    char *out = recv;
    for (size_t i = 0; i < count; i++) {
        if (is_float(dtype)) {
            double acc = load_float(s + i * w, dtype);
            for (int r = 1; r < nranks; r++) {
                double v = load_float(s + (size_t)r * row + i * w, dtype);
                acc = op == NCCL_PROD ? acc * v : op == NCCL_MAX ? (v > acc ? v : acc)
                    : op == NCCL_MIN ? (v < acc ? v : acc) : acc + v;
            }
            store_float(out + i * w, dtype, op == NCCL_AVG ? acc / nranks : acc);
        } else {
            uint64_t acc = load_int(s + i * w, dtype);
            for (int r = 1; r < nranks; r++) {
                uint64_t v = load_int(s + (size_t)r * row + i * w, dtype);
                acc = op == NCCL_PROD ? acc * v
                    : op == NCCL_MAX ? (int_less(acc, v, dtype) ? v : acc)
                    : op == NCCL_MIN ? (int_less(v, acc, dtype) ? v : acc) : acc + v;
            }
            if (op == NCCL_AVG)
                acc = is_signed(dtype) ? (uint64_t)((int64_t)acc / nranks) : acc / (uint64_t)nranks;
            store_int(out + i * w, dtype, acc);
        }
    }
}

/* ------------------------------------------------------------------ */
/* Queued work                                                         */
/* ------------------------------------------------------------------ */

/* The host address of a buffer of `comm`'s device; -1 when it is on
 * another emulated device. */
static int host_of(const struct dp_nccl_comm *c, const void *p, void **host)
{
    uintptr_t u = (uintptr_t)p;
    if (u & EMU_TAG) {
        if ((int)((u >> EMU_DEV_SHIFT) & 0x7f) != c->dev)
            return -1;
        u &= EMU_ADDR_MASK;
    }
    *host = (void *)u;
    return 0;
}

/* The fault asked for at this call: 0 none, 1 fail, 2 error, 3 hang. */
static int fault_now(void)
{
    const char *f = getenv("DPMINI_DIST_NCCL_FAULT");
    if (f == NULL || !*f)
        return 0;
    return strcmp(f, "fail") == 0 ? 1 : strcmp(f, "error") == 0 ? 2 : strcmp(f, "hang") == 0 ? 3 : 0;
}

/* Whether `o` is queued on stream `st` as named by a thread whose current
 * device is `dev` (stream 0: that device's legacy stream). */
static int on_stream(const emu_op *o, dist_stream_t st, int dev)
{
    return o->stream == st && (st != NULL || o->dev == dev);
}

static void append(emu_op *o)
{
    pthread_mutex_lock(&emu_mu);
    emu_op **tail = &emu_queue;
    while (*tail != NULL)
        tail = &(*tail)->next;
    *tail = o;
    pthread_mutex_unlock(&emu_mu);
}

/* A new queued op, or NULL (the caller returns its code in *rc). */
static emu_op *queue(struct dp_nccl_comm *c, int dtype, size_t count, dist_stream_t st,
                     int *rc)
{
    *rc = NCCL_OK;
    if (c == NULL || c->comm == MPI_COMM_NULL) {
        *rc = NCCL_INVALID_ARGUMENT;
        return NULL;
    }
    int f = fault_now();
    if (f == 1) {
        *rc = NCCL_SYSTEM;
        return NULL;
    }
    if (dtype_size(dtype) == 0 || count * dtype_size(dtype) > (size_t)INT_MAX / (size_t)c->size) {
        *rc = NCCL_INVALID_ARGUMENT;
        return NULL;
    }
    emu_op *o = calloc(1, sizeof *o);
    if (o == NULL) {
        *rc = NCCL_SYSTEM;
        return NULL;
    }
    o->req = MPI_REQUEST_NULL;
    o->stream = st;
    o->dev = c->dev;   /* NCCL launches on its communicator's device */
    o->dtype = dtype;
    o->count = count;
    o->nranks = c->size;
    o->never = f >= 2;
    o->comm = c;
    if (f == 2)
        c->async_error = NCCL_REMOTE;
    append(o);
    return o;
}

static int posted(int mpi_rc)
{
    return mpi_rc == MPI_SUCCESS ? NCCL_OK : NCCL_SYSTEM;
}

static int emu_all_reduce_or_reduce(const void *send, void *recv, size_t count, int dtype, int op,
                                    int root, dist_ncclComm_t c, dist_stream_t st, int all)
{
    void *s = NULL, *r = NULL;
    if (op < NCCL_SUM || op > NCCL_AVG || (!all && (root < 0 || root >= c->size)))
        return NCCL_INVALID_ARGUMENT;
    if (host_of(c, send, &s) < 0 || ((all || c->rank == root) && host_of(c, recv, &r) < 0))
        return NCCL_INVALID_ARGUMENT;
    int rc;
    emu_op *o = queue(c, dtype, count, st, &rc);
    if (o == NULL || o->never)
        return rc;
    int bytes = (int)(count * dtype_size(dtype));
    o->op = op;
    o->recv = r;
    o->reduce = all || c->rank == root;
    if (o->reduce && (o->scratch = malloc((size_t)bytes * (size_t)c->size + 1)) == NULL) {
        o->reduce = 0;   /* completes at once, touching nothing */
        return NCCL_SYSTEM;
    }
    rc = all ? MPI_Iallgather(s, bytes, MPI_BYTE, o->scratch, bytes, MPI_BYTE, c->comm, &o->req)
             : MPI_Igather(s, bytes, MPI_BYTE, o->scratch, bytes, MPI_BYTE, root, c->comm, &o->req);
    if (rc != MPI_SUCCESS)
        o->reduce = 0;
    return posted(rc);
}

static int emu_all_reduce(const void *send, void *recv, size_t count, int dtype, int op,
                          dist_ncclComm_t c, dist_stream_t st)
{
    return emu_all_reduce_or_reduce(send, recv, count, dtype, op, 0, c, st, 1);
}

static int emu_reduce(const void *send, void *recv, size_t count, int dtype, int op, int root,
                      dist_ncclComm_t c, dist_stream_t st)
{
    return emu_all_reduce_or_reduce(send, recv, count, dtype, op, root, c, st, 0);
}

static int emu_broadcast(const void *send, void *recv, size_t count, int dtype, int root,
                         dist_ncclComm_t c, dist_stream_t st)
{
    void *s = NULL, *r = NULL;
    if (root < 0 || root >= c->size || host_of(c, recv, &r) < 0 ||
        (c->rank == root && host_of(c, send, &s) < 0))
        return NCCL_INVALID_ARGUMENT;
    int rc;
    emu_op *o = queue(c, dtype, count, st, &rc);
    if (o == NULL || o->never)
        return rc;
    size_t bytes = count * dtype_size(dtype);
    if (c->rank == root && s != r && bytes > 0)
        memmove(r, s, bytes);
    return posted(MPI_Ibcast(r, (int)bytes, MPI_BYTE, root, c->comm, &o->req));
}

static int emu_send(const void *send, size_t count, int dtype, int peer, dist_ncclComm_t c,
                    dist_stream_t st)
{
    void *s = NULL;
    if (peer < 0 || peer >= c->size || host_of(c, send, &s) < 0)
        return NCCL_INVALID_ARGUMENT;
    int rc;
    emu_op *o = queue(c, dtype, count, st, &rc);
    if (o == NULL || o->never)
        return rc;
    return posted(MPI_Isend(s, (int)(count * dtype_size(dtype)), MPI_BYTE, peer, EMU_TAG_P2P,
                            c->comm, &o->req));
}

static int emu_recv(void *recv, size_t count, int dtype, int peer, dist_ncclComm_t c,
                    dist_stream_t st)
{
    void *r = NULL;
    if (peer < 0 || peer >= c->size || host_of(c, recv, &r) < 0)
        return NCCL_INVALID_ARGUMENT;
    int rc;
    emu_op *o = queue(c, dtype, count, st, &rc);
    if (o == NULL || o->never)
        return rc;
    return posted(MPI_Irecv(r, (int)(count * dtype_size(dtype)), MPI_BYTE, peer, EMU_TAG_P2P,
                            c->comm, &o->req));
}

static int emu_group(void)
{
    return NCCL_OK;   /* non-blocking MPI needs no grouping to avoid deadlock */
}

static void copy_2d(const emu_op *o)
{
    for (size_t row = 0; row < o->height && o->width > 0; row++)
        memmove((char *)o->recv + row * o->dpitch, o->src + row * o->spitch, o->width);
}

/* Progress the ops that `in` selects (stream st named from device dev, or
 * every op of communicator `of`); CUDA_NOT_READY while one is pending. MPI
 * operations are posted when queued; a copy runs once every op queued
 * before it on its stream is done. */
typedef struct {
    dist_stream_t st;
    int dev;
    const struct dp_nccl_comm *of;
} emu_selection;

static int selected(const emu_op *o, const emu_selection *in)
{
    return in->of != NULL ? o->comm == in->of : on_stream(o, in->st, in->dev);
}

static int progress(const emu_selection *in)
{
    int pending = 0, err = 0;
    pthread_mutex_lock(&emu_mu);
    emu_op **link = &emu_queue;
    while (*link != NULL) {
        emu_op *o = *link;
        if (!selected(o, in)) {
            link = &o->next;
            continue;
        }
        int flag = 0;
        if (o->comm == NULL)
            flag = !pending;
        else if (!o->never && MPI_Test(&o->req, &flag, MPI_STATUS_IGNORE) != MPI_SUCCESS)
            err = 1;
        if (!flag || o->never) {
            pending = 1;
            link = &o->next;
            continue;
        }
        if (o->comm == NULL)
            copy_2d(o);
        else if (o->reduce)
            combine(o->scratch, o->recv, o->count, o->dtype, o->op, o->nranks);
        *link = o->next;
        free(o->scratch);
        free(o);
    }
    pthread_mutex_unlock(&emu_mu);
    return err ? 999 : pending ? CUDA_NOT_READY : CUDA_OK;
}

static int emu_stream_query(dist_stream_t st)
{
    emu_selection in = {st, emu_device, NULL};
    return progress(&in);
}

/* cudaDevAttrMaxPitch of every emulated device. */
static long long emu_max_pitch(void)
{
    const char *v = getenv("DPMINI_EMULATE_MAX_PITCH");
    long long p = v != NULL && *v ? atoll(v) : 0;
    return p > 0 ? p : INT_MAX;
}

/* cudaMemcpy2DAsync on the emulated stream (any kind: every emulated
 * address is host memory once decoded). */
static int emu_memcpy_2d(void *dst, size_t dpitch, const void *src, size_t spitch, size_t width,
                         size_t height, int kind, dist_stream_t st)
{
    if (width > dpitch || width > spitch)
        return 1;   /* cudaErrorInvalidValue */
    if (height > 1 && (dpitch > (size_t)emu_max_pitch() || spitch > (size_t)emu_max_pitch()))
        return CUDA_INVALID_PITCH;
    emu_op *o = calloc(1, sizeof *o);
    if (o == NULL)
        return 2;   /* cudaErrorMemoryAllocation */
    o->recv = (void *)((uintptr_t)dst & (((uintptr_t)dst & EMU_TAG) ? EMU_ADDR_MASK : ~(uintptr_t)0));
    o->src = (const char *)((uintptr_t)src &
                            (((uintptr_t)src & EMU_TAG) ? EMU_ADDR_MASK : ~(uintptr_t)0));
    o->req = MPI_REQUEST_NULL;
    o->stream = st;
    o->dev = emu_device;   /* stream 0: the current device's legacy stream */
    o->dpitch = dpitch;
    o->spitch = spitch;
    o->width = width;
    o->height = height;
    append(o);
    emu_stream_query(st);   /* runs now when nothing is queued before it */
    return CUDA_OK;
}

/* Wait for the selected ops. */
static int sync_selection(const emu_selection *in)
{
    for (;;) {
        int rc = progress(in);
        if (rc != CUDA_NOT_READY)
            return rc;
        int never = 0;
        pthread_mutex_lock(&emu_mu);
        for (emu_op *o = emu_queue; o != NULL; o = o->next)
            never |= o->never && selected(o, in);
        pthread_mutex_unlock(&emu_mu);
        if (never)
            return 999;   /* cudaErrorUnknown rather than waiting forever */
        struct timespec nap = {0, 100000};
        nanosleep(&nap, NULL);
    }
}

static int emu_stream_sync(dist_stream_t st)
{
    emu_selection in = {st, emu_device, NULL};
    return sync_selection(&in);
}

/* ------------------------------------------------------------------ */
/* Communicators                                                       */
/* ------------------------------------------------------------------ */

static int emu_get_unique_id(dist_ncclUniqueId *id)
{
    memset(id, 0, sizeof *id);
    snprintf(id->internal, sizeof id->internal, "%s %ld %ld", EMU_ID_MAGIC, (long)getpid(),
             (long)time(NULL));
    return NCCL_OK;
}

static int emu_comm_init_rank(dist_ncclComm_t *out, int nranks, dist_ncclUniqueId id, int rank)
{
    *out = NULL;
    const char *f = getenv("DPMINI_DIST_NCCL_FAULT");
    while (f != NULL && strcmp(f, "init_hang") == 0) {
        struct timespec nap = {0, 10000000};
        nanosleep(&nap, NULL);   /* a peer that never connects */
    }
    if (strncmp(id.internal, EMU_ID_MAGIC, strlen(EMU_ID_MAGIC)) != 0 || emu_parent == MPI_COMM_NULL)
        return NCCL_INVALID_ARGUMENT;
    struct dp_nccl_comm *c = calloc(1, sizeof *c);
    if (c == NULL)
        return NCCL_SYSTEM;
    if (MPI_Comm_dup(emu_parent, &c->comm) != MPI_SUCCESS) {
        free(c);
        return NCCL_SYSTEM;
    }
    MPI_Comm_rank(c->comm, &c->rank);
    MPI_Comm_size(c->comm, &c->size);
    if (c->rank != rank || c->size != nranks) {
        MPI_Comm_free(&c->comm);
        free(c);
        return NCCL_INVALID_ARGUMENT;
    }
    c->dev = emu_device;
    *out = c;
    return NCCL_OK;
}

static int emu_get_async_error(dist_ncclComm_t c, int *err)
{
    *err = c != NULL ? c->async_error : NCCL_INVALID_ARGUMENT;
    return NCCL_OK;
}

/* Its ops off the queue (and the copies queued after them, which would
 * wait for ever). `abort`: ops that MPI may still complete are leaked (an
 * MPI collective cannot be cancelled), as is the MPI communicator. */
static int emu_release(dist_ncclComm_t c, int abort)
{
    if (c == NULL)
        return NCCL_INVALID_ARGUMENT;
    emu_selection mine_only = {NULL, 0, c};
    if (!abort && sync_selection(&mine_only) != CUDA_OK)
        abort = 1;
    int in_flight = 0, mine = 0;
    pthread_mutex_lock(&emu_mu);
    emu_op **link = &emu_queue;
    while (*link != NULL) {
        emu_op *o = *link;
        if (o->comm == c)
            mine = 1;
        if (o->comm != c && !(o->comm == NULL && mine)) {
            link = &o->next;
            continue;
        }
        *link = o->next;
        if (o->comm != NULL && !o->never)
            in_flight = 1;   /* leaked: MPI may still write its buffers */
        else
            free(o);
    }
    pthread_mutex_unlock(&emu_mu);
    int finalized = 1;
    MPI_Finalized(&finalized);
    if (!in_flight && !finalized)
        MPI_Comm_free(&c->comm);
    if (!in_flight)
        free(c);
    return NCCL_OK;
}

static int emu_comm_abort(dist_ncclComm_t c)
{
    return emu_release(c, 1);
}

static int emu_comm_destroy(dist_ncclComm_t c)
{
    return emu_release(c, 0);
}

static const char *emu_error_string(int rc)
{
    switch (rc) {
    case NCCL_OK: return "no error";
    case NCCL_UNHANDLED_CUDA: return "unhandled cuda error (run with NCCL_DEBUG=INFO for details)";
    case NCCL_SYSTEM: return "unhandled system error (run with NCCL_DEBUG=INFO for details)";
    case NCCL_INTERNAL: return "internal error - please report this issue to the NCCL developers";
    case NCCL_INVALID_ARGUMENT: return "invalid argument (run with NCCL_DEBUG=WARN for details)";
    case NCCL_INVALID_USAGE: return "invalid usage (run with NCCL_DEBUG=WARN for details)";
    case NCCL_REMOTE: return "remote process exited or there was a network error";
    case NCCL_IN_PROGRESS: return "NCCL operation in progress";
    default: return "unknown result code";
    }
}

static int emu_set_device(int dev)
{
    if (dev < 0 || dev > 0x7f)
        return 101;   /* cudaErrorInvalidDevice */
    emu_device = dev;
    return CUDA_OK;
}

static int emu_get_device(int *dev)
{
    *dev = emu_device;
    return CUDA_OK;
}

static const char *emu_cuda_error_string(int rc)
{
    return rc == CUDA_OK ? "no error" : rc == CUDA_NOT_READY ? "device not ready"
         : rc == 101 ? "invalid device ordinal"
         : rc == CUDA_INVALID_PITCH ? "invalid pitch argument" : "unknown error";
}

static int emu_device_attribute(int *value, int attr, int dev)
{
    if (dev < 0 || dev > 0x7f)
        return 101;
    if (attr != CUDA_ATTR_MAX_PITCH)
        return 1;   /* cudaErrorInvalidValue: the emulation knows this one only */
    *value = (int)emu_max_pitch();
    return CUDA_OK;
}

/* The physical GPU behind ordinal `dev`: its entry of $CUDA_VISIBLE_DEVICES
 * when that lists integers, else the ordinal itself. */
static int emu_physical(int dev)
{
    const char *v = getenv("CUDA_VISIBLE_DEVICES");
    if (v == NULL || *v == '\0')
        return dev;
    for (int i = 0; *v != '\0'; i++) {
        char *end = NULL;
        long id = strtol(v, &end, 10);
        if (end == v)
            return dev;
        if (i == dev)
            return (int)id;
        v = *end == ',' ? end + 1 : end;
        if (*end != ',')
            break;
    }
    return dev;
}

static int emu_pci_bus_id(char *out, int len, int dev)
{
    if (dev < 0 || dev > 0x7f)
        return 101;
    if (len > 0)
        snprintf(out, (size_t)len, "00000000:%02X:00.0", 0x10 + emu_physical(dev));
    return CUDA_OK;
}

const dist_nccl_api *dist_nccl_emu_table(void)
{
    snprintf(emu_api.desc, sizeof emu_api.desc, "emulated NCCL over MPI on host memory "
             "(csrc/dist/dist_nccl_emu.c)");
    emu_api.emulated = 1;
    emu_api.GetUniqueId = emu_get_unique_id;
    emu_api.CommInitRank = emu_comm_init_rank;
    emu_api.AllReduce = emu_all_reduce;
    emu_api.Broadcast = emu_broadcast;
    emu_api.Reduce = emu_reduce;
    emu_api.Send = emu_send;
    emu_api.Recv = emu_recv;
    emu_api.GroupStart = emu_group;
    emu_api.GroupEnd = emu_group;
    emu_api.CommGetAsyncError = emu_get_async_error;
    emu_api.CommAbort = emu_comm_abort;
    emu_api.CommDestroy = emu_comm_destroy;
    emu_api.GetErrorString = emu_error_string;
    emu_api.SetDevice = emu_set_device;
    emu_api.GetDevice = emu_get_device;
    emu_api.StreamQuery = emu_stream_query;
    emu_api.StreamSynchronize = emu_stream_sync;
    emu_api.CudaErrorString = emu_cuda_error_string;
    emu_api.Memcpy2DAsync = emu_memcpy_2d;
    emu_api.DeviceGetAttribute = emu_device_attribute;
    emu_api.DeviceGetPCIBusId = emu_pci_bus_id;
    return &emu_api;
}
