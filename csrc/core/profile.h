/* profile.h - the span recorder behind dpmini.profile(), as pure C.
 *
 * No Python.h. A session is a preallocated buffer of events that any thread
 * may append to (one atomic add a span); when it is full, recording stops
 * and the session counts the spans it dropped. A thread that opens a
 * session records its calls into it; the threads that work for such a call
 * (copy workers, replica workers) record into the same session through the
 * dp_prof_ctx the call hands them. Outside any session the cost on a hot
 * path is one relaxed atomic load (dp_prof_current).
 *
 * Times are CLOCK_MONOTONIC nanoseconds (Python's time.monotonic_ns and
 * time.perf_counter_ns on Linux read the same clock).
 */
#ifndef DPMINI_PROFILE_H
#define DPMINI_PROFILE_H

#include <stddef.h>
#include <stdint.h>

/* What a span measures. A phase span (CALL .. REDUCE) is recorded on the
 * calling thread around one step of a call; the others on the thread that
 * did the work. */
enum dp_prof_kind {
    DP_PROF_CALL = 0,      /* one DataParallel / data_parallel call          */
    DP_PROF_SCATTER = 1,   /* phase: scatter (walk + copies)                 */
    DP_PROF_REPLICATE = 2, /* phase: replicate (walk + broadcast copies)     */
    DP_PROF_APPLY = 3,     /* phase: parallel_apply (start replicas, wait)   */
    DP_PROF_GATHER = 4,    /* phase: gather (walk + copies)                  */
    DP_PROF_BROADCAST = 5, /* phase: comm.broadcast / broadcast_coalesced    */
    DP_PROF_REDUCE = 6,    /* phase: comm.reduce_add / reduce_add_coalesced  */
    DP_PROF_COPY = 7,      /* copies run by one thread for one device        */
    DP_PROF_REPLICA = 8,   /* one replica's run                              */
    DP_PROF_WAIT = 9,      /* a thread waiting (for the GIL, for replicas)   */
    DP_PROF_SUM = 10,      /* the sums of a reduction                        */
    DP_PROF_BLAS = 11,     /* setting or restoring BLAS thread limits        */
    DP_PROF_USER = 12,     /* recorded from Python (dpmini._profile.span)    */
    DP_PROF_DEVICE = 13,   /* a device the call may use (no duration)        */
    DP_PROF_NKINDS = 14
};

/* How a copy span copied. */
enum dp_prof_path {
    DP_PROF_PATH_NONE = 0,
    DP_PROF_PATH_INLINE = 1,   /* on the calling thread, ordinary stores       */
    DP_PROF_PATH_WORKER = 2,   /* on a device worker, ordinary stores           */
    DP_PROF_PATH_STREAM = 3,   /* on a device worker, streaming stores          */
    DP_PROF_PATH_FEED = 4,     /* the feed of a broadcast, streaming stores     */
    DP_PROF_PATH_GPU = 5,      /* through the GPU copy paths (host-side time)   */
    DP_PROF_NPATHS = 6
};

/* Device kinds as in dpmini.h's dp_device (0 host, 1 virtual CPU, 2 CUDA). */
#define DP_PROF_LABEL 24

typedef struct {
    uint64_t start_ns, end_ns;
    uint64_t bytes;          /* bytes copied (copy spans), 0 otherwise       */
    uint64_t thread;         /* the OS thread id (gettid) that recorded it   */
    uint32_t call;           /* the call it belongs to (1, 2, ...; 0 none)   */
    int16_t kind;            /* dp_prof_kind                                 */
    int16_t phase;           /* the phase it ran in (a phase kind)           */
    int16_t dev_kind;        /* the device it concerns; -1 none              */
    int16_t dev_index;
    uint8_t path;            /* dp_prof_path                                 */
    uint8_t strided;         /* a copy with a non-contiguous side            */
    uint8_t root;            /* the span that opened its call: its wall time */
    uint8_t ready;           /* set (atomic, release) once the slot is written */
    char label[DP_PROF_LABEL]; /* a name (call, replica index, user span)    */
} dp_prof_event;

typedef struct dp_prof_session dp_prof_session;

/* What a call hands to the threads that work for it. s NULL: not recorded. */
typedef struct {
    dp_prof_session *s;
    uint32_t call;
    int16_t phase;
} dp_prof_ctx;

/* An open phase span on the calling thread (dp_prof_begin/dp_prof_end). */
typedef struct {
    dp_prof_ctx ctx;         /* ctx.s NULL: nothing to record                */
    uint64_t start_ns;
    int16_t prev_phase;
    int opened_call;         /* this span opened the thread's call           */
} dp_prof_span;

/* CLOCK_MONOTONIC in nanoseconds. */
uint64_t dp_prof_now(void);
/* The calling thread's OS id (gettid on Linux). */
uint64_t dp_prof_thread_id(void);

/* Sessions. new: a buffer of `capacity` events (>= 1); NULL when out of
 * memory. A new session has one reference. */
dp_prof_session *dp_prof_session_new(uint32_t capacity);
void dp_prof_session_retain(dp_prof_session *s);
void dp_prof_session_release(dp_prof_session *s);
/* Slots taken so far (at most the capacity) and spans dropped. A slot is
 * complete when its `ready` reads 1 (__atomic_load_n, acquire); every slot
 * of a call that returned is. */
uint32_t dp_prof_session_count(const dp_prof_session *s);
uint64_t dp_prof_session_dropped(const dp_prof_session *s);
const dp_prof_event *dp_prof_session_events(const dp_prof_session *s);

/* The calling thread's session: push makes s the thread's (returns the one
 * it replaces, to pop back later), pop restores prev. The session must stay
 * referenced while it is the thread's. */
dp_prof_session *dp_prof_thread_push(dp_prof_session *s);
void dp_prof_thread_pop(dp_prof_session *prev);

/* How many threads have a session: the one flag the hot paths read
 * (relaxed) before anything else. */
extern int dp_prof_threads_recording;

/* The calling thread's context (dp_prof_current past the flag). */
dp_prof_ctx dp_prof_current_thread(void);

/* The calling thread's recording context: s NULL outside any session (one
 * relaxed atomic load when no thread has a session). */
static inline dp_prof_ctx dp_prof_current(void)
{
    if (__atomic_load_n(&dp_prof_threads_recording, __ATOMIC_RELAXED) == 0) {
        dp_prof_ctx none = {NULL, 0, -1};
        return none;
    }
    return dp_prof_current_thread();
}

/* Append one span to ctx's session (nothing when ctx->s is NULL). */
void dp_prof_record(const dp_prof_ctx *ctx, const dp_prof_event *ev);
/* A span of `kind` in ctx's call and phase, on device (dev_kind, dev_index)
 * (dev_kind -1: none), recorded by this thread; label may be NULL. */
void dp_prof_record_span(const dp_prof_ctx *ctx, int kind, int dev_kind, int dev_index,
                         uint64_t start_ns, uint64_t end_ns, uint64_t bytes, int path,
                         int strided, const char *label);

/* dp_prof_record_span of a span from start_ns to now, no bytes, no path. */
void dp_prof_record_since(const dp_prof_ctx *ctx, int kind, int dev_kind, int dev_index,
                          uint64_t start_ns, const char *label);

/* Phase spans on the calling thread: begin opens a call when the thread has
 * none open (a standalone scatter is its own call), makes `kind` the
 * thread's phase and reads the clock; end records the span (label may be
 * NULL) and restores both. Nothing but a flag check outside a session. */
void dp_prof_begin_thread(dp_prof_span *sp, int kind);
void dp_prof_end_thread(dp_prof_span *sp, const char *label);

static inline void dp_prof_begin(dp_prof_span *sp, int kind)
{
    if (__atomic_load_n(&dp_prof_threads_recording, __ATOMIC_RELAXED) == 0) {
        sp->ctx.s = NULL;
        return;
    }
    dp_prof_begin_thread(sp, kind);
}

static inline void dp_prof_end(dp_prof_span *sp, const char *label)
{
    if (sp->ctx.s != NULL) {
        dp_prof_end_thread(sp, label);
    }
}

#endif
