/* dist.h - dpmini._dist: dpmini's collectives across MPI processes.
 *
 * Layering: csrc/plan.c (the chunk rule, pure C) <- csrc/dist/ (this folder,
 * MPI + CPython) <- dpmini/distributed.py (the thin Python API).
 *
 * Every data collective runs in two phases on a private duplicate of the
 * user's communicator:
 *   1. agreement (dist_guard.c): every rank sends a fixed-size record
 *      (dist_meta: kind, call number, root, dim, op, dtype, shape, the
 *      split arguments, and any local argument error) to every other rank
 *      with non-blocking point-to-point messages, polled against the
 *      deadline with the GIL released. Every rank then holds every record
 *      and reaches the same verdict: go, the same ValueError everywhere, or
 *      a TimeoutError naming the ranks that did not arrive.
 *   2. data (dist_move.c, dist_reduce.c): non-blocking MPI operations
 *      polled against the same deadline. A small piece travels inside the
 *      record's message and a piece up to DIST_FOLLOW_BYTES in its own
 *      message right behind it (both before the verdict, as one exchange
 *      with the agreement); a rank keeps them only when every rank agrees,
 *      and takes them into scratch memory otherwise. Larger data moves
 *      only after agreement.
 */
#ifndef DPMINI_DIST_H
#define DPMINI_DIST_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <pythread.h>
#include <mpi.h>
#include <stdint.h>

#define NPY_NO_DEPRECATED_API NPY_1_22_API_VERSION
#define PY_ARRAY_UNIQUE_SYMBOL dpmini_dist_ARRAY_API
#ifndef DIST_IMPORT_ARRAY
#define NO_IMPORT_ARRAY
#endif
#include <numpy/arrayobject.h>

#define DIST_MAX_NDIM 32
#define DIST_MAGIC 0x64706d696e693133LL /* "dpmini13": the record gained follow_to */
#define DIST_TAG_META 7101
#define DIST_TAG_DATA 7102
#define DIST_TAG_FOLLOW 7103

enum dist_kind {
    DIST_BARRIER = 1, DIST_SCATTER, DIST_GATHER, DIST_ALL_GATHER,
    DIST_BROADCAST, DIST_ALL_REDUCE, DIST_REDUCE
};
enum dist_op { DIST_OP_NONE = 0, DIST_OP_SUM, DIST_OP_MEAN, DIST_OP_MAX, DIST_OP_MIN };

/* One rank's description of the call it is making (phase 1). Plain bytes
 * on the wire: every rank runs the same build, so the layout agrees. */
typedef struct {
    int64_t magic;
    int64_t call;          /* 1, 2, ... per communicator                    */
    int64_t kind;          /* enum dist_kind                                */
    int64_t root;          /* -1 when the kind has no root                  */
    int64_t dim;           /* as given (scatter) or wrapped (gather kinds)  */
    int64_t op;            /* enum dist_op                                  */
    int64_t ndim;          /* -1: no array on this rank                     */
    int64_t itemsize;
    int64_t is_object;     /* broadcast of a pickled object                 */
    uint64_t split_hash;   /* chunk_sizes / weights, 0 when neither         */
    uint64_t fields_hash;  /* a structured dtype's names, formats, offsets   */
    int64_t dev_kind;      /* DIST_DEV_*: where this rank's array lives     */
    int64_t dev_id;        /* the CUDA device of a GPU array, else -1       */
    int64_t nccl_state;    /* 0 no NCCL communicator, 1 one, 2 aborted      */
    int64_t fused_len;     /* payload bytes after the record, -1 none       */
    int64_t fused_to;      /* the rank the payload went to, -1 every rank   */
    int64_t follow_to;     /* data behind the record (dist_send): -2 none,
                              -1 to every other rank, else to that rank    */
    int64_t has_tag;       /* 1 tag= given, 0 None, -1 a bad one (an error) */
    uint64_t tag_hash;     /* repr(tag), hashed                             */
    uint64_t ctx_hash;     /* the context text, hashed (0: none)            */
    int64_t shape[DIST_MAX_NDIM];
    char dtype[24];        /* numpy dtype.str, e.g. "<f8"                   */
    char dtype_name[24];   /* str(dtype), e.g. "float64", for messages      */
    char split_text[56];   /* the split argument, for messages              */
    char err[200];         /* a local argument error, "" when none          */
    char lib[16];          /* a GPU array's library ("torch", "cupy", ...)  */
    char tag_text[40];     /* repr(tag), for messages                       */
    char ctx_text[64];     /* options that change the arithmetic, for messages */
} dist_meta;

/* GPU: moved by NCCL; GPU_STAGED: a GPU array the wrapper copied to the
 * host (no __cuda_array_interface__, e.g. JAX). */
enum dist_dev { DIST_DEV_NONE = 0, DIST_DEV_HOST = 1, DIST_DEV_GPU = 2, DIST_DEV_GPU_STAGED = 3 };

/* The Comm object: a duplicate of the user's communicator plus the state
 * the guard needs. */
typedef struct {
    PyObject_HEAD
    MPI_Comm comm;         /* MPI_COMM_NULL once freed                      */
    int rank, size;
    int64_t calls;
    double timeout;        /* seconds, > 0                                  */
    int broken;            /* a TimeoutError left messages in flight        */
    char broken_why[160];
    PyThread_type_lock lock;
    dist_meta *peers;      /* size records                                  */
    MPI_Request *reqs;     /* 3 * size requests for the agreement: records
                              received, records sent, data that follows     */
    int *done;             /* 3 * size flags                                */
    void *nccl;            /* this rank's NCCL communicator (dist_gpu.c)    */
    int nccl_dev;          /* its CUDA device                               */
    long long nccl_max_pitch; /* the smallest cudaDevAttrMaxPitch of the ranks */
    char nccl_broken[160]; /* why GPU collectives are off, "" when they work */
    char *wire;            /* size receive slots of wire_stride bytes       */
    char *wire_out;        /* this rank's record (+ payload) being sent     */
    size_t wire_stride;    /* sizeof(dist_meta) + DIST_FUSE_BYTES, or less  */
    PyObject *follow_keep; /* borrowed: the buffer of this call's follow sends */
} dist_comm;

/* dist_guard.c ---------------------------------------------------------- */
const char *dist_kind_name(int64_t kind);
const char *dist_op_name(int64_t op);
double dist_now(void);
/* Poll n requests until all complete or the deadline passes. Called with
 * the GIL held; releases it while polling (taking it back every 50 ms to
 * run signal handlers). done[i] is set for completed requests.
 * Returns 0 all done, 1 deadline passed, -1 exception set (MPI error or
 * KeyboardInterrupt). */
int dist_poll(MPI_Request *reqs, int n, int *done, double deadline);
/* dist_poll for the data of a collective every rank has agreed on: it
 * yields without sleeping for the first second (MPI moves the data only
 * inside MPI_Test; a 50-500 us nap per test stalled a 16 MiB all_reduce
 * 5x), then naps as dist_poll does. */
int dist_poll_data(MPI_Request *reqs, int n, int *done, double deadline);
/* One pause of a polling loop run with the GIL released (*ts saved):
 * 1 the deadline has passed, -1 a signal handler raised (the GIL is taken
 * for it every 50 ms, *next_signals), else 0 after a yield or a short
 * sleep (longer once nothing has progressed since last_progress). */
int dist_poll_pause(PyThreadState **ts, double deadline, double last_progress,
                    double *next_signals);
/* Set a RuntimeError from an MPI error code; returns -1. */
int dist_mpi_error(int code, const char *what);
/* Record the pending Python exception as the local error of `mine`
 * (cleared; kept in *saved to re-raise on this rank). */
void dist_meta_fail(dist_meta *mine, PyObject **saved);
/* Phase 1. `mine` is this rank's record (call number filled in here).
 * Returns 0 when every rank agrees, -1 with the exception set (ValueError,
 * TimeoutError, or this rank's own saved error). Steals *saved. */
int dist_agree(dist_comm *c, dist_meta *mine, PyObject **saved, double deadline);
/* Phase 1 carrying the data of a small collective (`payload`, `len` bytes,
 * to rank `to` or, -1, to every rank) in the same messages as the record,
 * so that a small all_reduce or broadcast costs one exchange, as raw MPI's
 * does. Sent only when len <= dist_fuse_limit(c) and this rank has no
 * argument error (else the record says fused_len = -1). After agreement,
 * rank r's payload is at dist_fused_payload(c, r) (valid until the next
 * collective). */
#define DIST_FUSE_BYTES (64 << 10)
#define DIST_FUSE_RANKS 16
int dist_agree_fused(dist_comm *c, dist_meta *mine, PyObject **saved, double deadline,
                     const void *payload, int64_t len, int to);
/* Phase 1 with data that follows the record as its own message, straight
 * from the caller's buffer (no copy), sent before the verdict so that a
 * broadcast, scatter or gather costs one message per piece, as raw MPI's
 * does. Every rank learns from the records which ranks send it such data:
 * when the call is agreed the caller receives it (source r, tag
 * DIST_TAG_FOLLOW) and waits for its own sends (dist_follow_take); on any
 * disagreement or error the guard receives it into scratch memory and waits
 * for this rank's sends before raising, so no message outlives the call. */
typedef struct {
    const void *buf;
    int count;
    MPI_Datatype type;
} dist_piece;
typedef struct {
    const void *fused;          /* bytes carried inside the record's message */
    int64_t fused_len;          /* -1: none                                  */
    int fused_to;               /* -1: every rank                            */
    int follow_to;              /* -2 none, -1 every other rank, or a rank   */
    const dist_piece *piece;    /* piece[r] for rank r (each), else piece[0] */
    int each;
    PyObject *keep;             /* what MPI reads: leaked if the comm breaks */
} dist_send;
#define DIST_SEND_NONE {NULL, -1, -1, -2, NULL, 0, NULL}
int dist_agree_send(dist_comm *c, dist_meta *mine, PyObject **saved, double deadline,
                    const dist_send *s);
/* After an agreed dist_agree_send: this rank's pending follow sends moved
 * into reqs/done (room for size entries); returns their number. */
int dist_follow_take(dist_comm *c, MPI_Request *reqs, int *done);
/* Whether rank r's agreed record sends data that follows to rank `to`. */
int dist_follows_to(const dist_meta *m, int r, int to);
/* A failure after an agreed dist_agree_send (the caller could not receive):
 * receive what was sent to this rank into scratch memory and wait for this
 * rank's own follow sends, so that the next call pairs (the exception stays
 * set; on a timeout the communicator is marked broken). */
void dist_follow_drain(dist_comm *c, double deadline);
/* Largest data message that follows a record: past it the data moves after
 * the verdict (a rank that disagrees must take any message sent to it). */
#define DIST_FOLLOW_BYTES ((int64_t)4 << 20)
int64_t dist_fuse_limit(const dist_comm *c);
const char *dist_fused_payload(const dist_comm *c, int r);
/* Fill shape/dtype fields of `m` from an ndarray. */
void dist_meta_array(dist_meta *m, PyObject *arr);
/* The dtype whose numpy str is `str` (new reference, or NULL with the
 * exception set): one of the last few seen when it can (parsing the string
 * costs a small collective's time; a structured dtype's fields are not in
 * its str, so those are never taken from the cache). */
PyArray_Descr *dist_descr_of(const char *str);
/* dist_args.c: root / dim / op of a collective. A bad one does not fail
 * here: its exception goes to *argerr (the first one kept; obj NULL: *out
 * unchanged), and the collective raises it at its guard with
 * dist_arg_error, so that every rank raises. */
void dist_int_arg(PyObject *obj, const char *name, int *out, PyObject **argerr);
void dist_op_arg(PyObject *obj, const char **out, PyObject **argerr);
/* The guard's keywords that every collective takes (keyword-only):
 *   tag: None, an int or a str naming the call (a training step); every
 *        rank must pass the same, so a rank that skipped a call is a
 *        ValueError naming the tags instead of a pairing with the next call;
 *   error: an exception the Python wrapper met on this rank (a torch tensor
 *        that requires grad, a bad gradient): raised here at the guard,
 *        quoted by every other rank;
 *   context: a str naming options that change the arithmetic and that the
 *        guard cannot see in the arrays (reduce_gradients' weights mode);
 *        the same on every rank. */
#define DIST_GUARD_KWLIST "tag", "error", "context"
typedef struct { PyObject *tag, *error, *context; } dist_guard_kw;
/* Into m (tag and context) and *argerr (error first, then a bad tag or context). */
void dist_guard_kw_read(const dist_guard_kw *k, dist_meta *m, PyObject **argerr);
/* FNV-1a of n bytes. */
uint64_t dist_hash(const void *p, size_t n);
/* Set *argerr as the pending exception and clear it: 1, or 0 when none. */
int dist_arg_error(PyObject **argerr);
/* numpy.ma.MaskedArray and numpy.matrix: -1 with TypeError naming `name`
 * (a mask would be dropped, * would change meaning), else 0. */
int dist_refuse_subclass(PyObject *x, const char *name);
/* Refuse a call on a broken or busy communicator; takes the lock. */
int dist_enter(dist_comm *c);
void dist_leave(dist_comm *c);

/* dist_split.c ----------------------------------------------------------- */
typedef struct {
    int mode;          /* 0 chunk rule, 1 chunk_sizes, 2 weights */
    int64_t *sizes;    /* P explicit sizes (mode 1)              */
    double *weights;   /* P weights (mode 2)                     */
} split_args;
/* Read chunk_sizes / weights (None or P entries) into s; records their
 * hash and text in m. -1 with an exception set on bad input. */
int dist_read_split(PyObject *cs, PyObject *w, int P, split_args *s, dist_meta *m);
/* The rows of every rank for n rows (plan.c). -1 with ValueError. */
int dist_plan_rows(const split_args *s, int64_t n, int P, int64_t *sizes);

/* dist_move.c ------------------------------------------------------------ */
/* Phase 2: poll the data requests against the deadline. On a timeout or
 * error the requests are abandoned, the communicator is marked broken and
 * `keep` (the buffers MPI may still touch) is leaked on purpose. */
int dist_wait_data(dist_comm *c, MPI_Request *reqs, int *done, int n, double deadline,
                   int64_t call, int64_t kind, PyObject *keep1, PyObject *keep2,
                   PyObject *keep3);
/* x as a C-contiguous aligned ndarray (in native byte order too when `native`);
 * refuses object dtypes and more than DIST_MAX_NDIM dimensions. Before any
 * copy of an ndarray view: MPI's int counts (split_dim: the dimension split
 * or joined, whose blocks, rows and row bytes must each be < 2**31; or
 * DIST_WHOLE: the element count) and the memory the copy needs. */
#define DIST_WHOLE INT32_MIN
PyObject *dist_as_array(PyObject *x, const char *name, int native, int split_dim);
/* An empty ndarray shaped like the record's array with shape[dim] = rows
 * (dim < 0: unchanged), of dtype `like`'s or, when NULL, the record's. */
PyObject *dist_empty_like_meta(const dist_meta *m, int dim, int64_t rows, PyArrayObject *like);
PyObject *dist_scatter(dist_comm *c, PyObject *args, PyObject *kw);
PyObject *dist_gather(dist_comm *c, PyObject *args, PyObject *kw);
PyObject *dist_all_gather(dist_comm *c, PyObject *args, PyObject *kw);
PyObject *dist_broadcast(dist_comm *c, PyObject *args, PyObject *kw);
PyObject *dist_split_sizes(PyObject *m, PyObject *args, PyObject *kw);

/* dist_reduce.c ---------------------------------------------------------- */
PyObject *dist_barrier(dist_comm *c, PyObject *args, PyObject *kw);
PyObject *dist_all_reduce(dist_comm *c, PyObject *args, PyObject *kw);
PyObject *dist_reduce(dist_comm *c, PyObject *args, PyObject *kw);

/* dist_gpu.c ------------------------------------------------------------- */
/* A GPU array as NCCL reads it (from its __cuda_array_interface__). */
typedef struct {
    PyObject *obj;         /* borrowed: the caller's array                  */
    uintptr_t ptr;
    size_t count;          /* elements                                      */
    int nccl_type;
    int dev;
    intptr_t stream;       /* the library's current stream, 0: the default  */
    PyObject *out;         /* the result array (new reference) or NULL      */
    uintptr_t out_ptr;
} dist_gpu_arg;
/* Fill `m` (shape, dtype, device) and `g` from x and the wrapper's
 * gpu=(device, library, stream); allocate the result like x when `alloc`.
 * -1 with an exception set (a local argument error). */
int dist_gpu_read(dist_comm *c, PyObject *x, PyObject *gpu, int alloc, dist_meta *m,
                  dist_gpu_arg *g);
void dist_gpu_arg_clear(dist_gpu_arg *g);
/* The NCCL op for a dpmini op on this dtype; -1 with TypeError. */
int dist_gpu_op(const dist_meta *m, int op);
/* Phase 2 of all_reduce / reduce (root < 0: all_reduce) and broadcast on
 * GPU arrays, after the agreement. New reference: the result, None off
 * root (reduce), or NULL with the exception set. */
PyObject *dist_gpu_reduce(dist_comm *c, const dist_meta *mine, dist_gpu_arg *g, int nccl_op,
                          int root, double deadline);
PyObject *dist_gpu_broadcast(dist_comm *c, const dist_meta *rm, dist_gpu_arg *g, int root,
                             double deadline);
/* Shared with dist_gpu_move.c: a new C-contiguous array of `lib` shaped
 * like m's on cuda:dev and its pointer (NULL with the exception set); this
 * rank's NCCL communicator on dev (-1: the current device), collective;
 * the wait for a queued NCCL call (rc: its result), which on failure
 * aborts the NCCL communicator and leaks keep1..3 (buffers a peer may
 * still touch). */
PyObject *dist_gpu_alloc(const char *lib, const dist_meta *m, int dev, uintptr_t *ptr);
int dist_gpu_comm(dist_comm *c, int dev, double deadline, int64_t kind);
int dist_gpu_finish(dist_comm *c, int rc, void *stream, double deadline, const char *what,
                    int64_t call, PyObject *keep1, PyObject *keep2, PyObject *keep3);
/* The communicator's device made current while a collective queues and
 * waits (stream 0 is the legacy stream of the current device, for NCCL's
 * launch, the 2D copies and the completion poll alike): returns the
 * caller's device for dist_gpu_leave, or -2 with a RuntimeError set. */
int dist_gpu_enter(const dist_comm *c);
void dist_gpu_leave(const dist_comm *c, int prev);
/* dist_gpu_move.c: scatter, gather, all_gather of GPU arrays through NCCL
 * send/recv (sizes: the rows of every rank; root < 0: all_gather). */
PyObject *dist_gpu_scatter(dist_comm *c, const dist_meta *rm, dist_gpu_arg *g,
                           const int64_t *sizes, int dim, int root, double deadline);
PyObject *dist_gpu_gather(dist_comm *c, const dist_meta *mine, dist_gpu_arg *g, int dim,
                          int root, double deadline);
/* Destroy (abort: after an error) this rank's NCCL communicator. */
void dist_gpu_free(dist_comm *c, int abort);

#endif
