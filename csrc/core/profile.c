/* profile.c - the span recorder (profile.h). */
#define _GNU_SOURCE
#include "profile.h"

#include <stdlib.h>
#include <string.h>
#include <time.h>
#if defined(__linux__)
#include <sys/syscall.h>
#include <unistd.h>
#else
#include <pthread.h>
#endif

struct dp_prof_session {
    int refs;                /* atomic                                      */
    uint32_t capacity;
    uint32_t next;           /* atomic: slots taken (may pass capacity)     */
    uint64_t dropped;        /* atomic                                      */
    uint32_t next_call;      /* atomic                                      */
    dp_prof_event *events;
};

int dp_prof_threads_recording;

static __thread dp_prof_session *thread_session;
static __thread uint32_t thread_call;
static __thread int16_t thread_phase = -1;
static __thread uint64_t thread_os_id;

uint64_t dp_prof_now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}

uint64_t dp_prof_thread_id(void)
{
    if (thread_os_id == 0) {
#if defined(__linux__)
        thread_os_id = (uint64_t)syscall(SYS_gettid);
#else
        thread_os_id = (uint64_t)(uintptr_t)pthread_self();
#endif
    }
    return thread_os_id;
}

dp_prof_session *dp_prof_session_new(uint32_t capacity)
{
    if (capacity == 0) {
        return NULL;
    }
    dp_prof_session *s = calloc(1, sizeof *s);
    if (s == NULL) {
        return NULL;
    }
    /* touched now, so that recording never faults a page in mid-call */
    s->events = calloc(capacity, sizeof *s->events);
    if (s->events == NULL) {
        free(s);
        return NULL;
    }
    s->refs = 1;
    s->capacity = capacity;
    return s;
}

void dp_prof_session_retain(dp_prof_session *s)
{
    __atomic_add_fetch(&s->refs, 1, __ATOMIC_RELAXED);
}

void dp_prof_session_release(dp_prof_session *s)
{
    if (s != NULL && __atomic_sub_fetch(&s->refs, 1, __ATOMIC_ACQ_REL) == 0) {
        free(s->events);
        free(s);
    }
}

uint32_t dp_prof_session_count(const dp_prof_session *s)
{
    uint32_t n = __atomic_load_n(&s->next, __ATOMIC_ACQUIRE);
    return n < s->capacity ? n : s->capacity;
}

uint64_t dp_prof_session_dropped(const dp_prof_session *s)
{
    return __atomic_load_n(&s->dropped, __ATOMIC_RELAXED);
}

const dp_prof_event *dp_prof_session_events(const dp_prof_session *s)
{
    return s->events;
}

dp_prof_session *dp_prof_thread_push(dp_prof_session *s)
{
    dp_prof_session *prev = thread_session;
    if (prev == NULL && s != NULL) {
        __atomic_add_fetch(&dp_prof_threads_recording, 1, __ATOMIC_RELAXED);
    }
    thread_session = s;
    thread_call = 0;
    thread_phase = -1;
    return prev;
}

void dp_prof_thread_pop(dp_prof_session *prev)
{
    if (thread_session != NULL && prev == NULL) {
        __atomic_sub_fetch(&dp_prof_threads_recording, 1, __ATOMIC_RELAXED);
    }
    thread_session = prev;
    thread_call = 0;
    thread_phase = -1;
}

dp_prof_ctx dp_prof_current_thread(void)
{
    dp_prof_ctx c = {NULL, 0, -1};
    if (thread_session != NULL) {
        c.s = thread_session;
        c.call = thread_call;
        c.phase = thread_phase;
    }
    return c;
}

/* Take a slot and write ev there; a full buffer counts a drop. A slot's
 * `ready` is set (release) after its write, so a reader skips a slot whose
 * writer has not finished (a replica abandoned after Ctrl-C). */
void dp_prof_record(const dp_prof_ctx *ctx, const dp_prof_event *ev)
{
    dp_prof_session *s = ctx->s;
    if (s == NULL) {
        return;
    }
    uint32_t slot = __atomic_fetch_add(&s->next, 1, __ATOMIC_RELAXED);
    if (slot >= s->capacity) {
        __atomic_fetch_sub(&s->next, 1, __ATOMIC_RELAXED);   /* never wraps */
        __atomic_add_fetch(&s->dropped, 1, __ATOMIC_RELAXED);
        return;
    }
    dp_prof_event *e = &s->events[slot];
    uint8_t *ready = &e->ready;
    *e = *ev;
    e->ready = 0;
    __atomic_store_n(ready, 1, __ATOMIC_RELEASE);
}

void dp_prof_record_span(const dp_prof_ctx *ctx, int kind, int dev_kind, int dev_index,
                         uint64_t start_ns, uint64_t end_ns, uint64_t bytes, int path,
                         int strided, const char *label)
{
    if (ctx->s == NULL) {
        return;
    }
    dp_prof_event ev;
    memset(&ev, 0, sizeof ev);
    ev.start_ns = start_ns;
    ev.end_ns = end_ns;
    ev.bytes = bytes;
    ev.thread = dp_prof_thread_id();
    ev.call = ctx->call;
    ev.kind = (int16_t)kind;
    ev.phase = ctx->phase;
    ev.dev_kind = (int16_t)dev_kind;
    ev.dev_index = (int16_t)dev_index;
    ev.path = (uint8_t)path;
    ev.strided = strided != 0;
    if (label != NULL) {
        strncpy(ev.label, label, DP_PROF_LABEL - 1);
    }
    dp_prof_record(ctx, &ev);
}

void dp_prof_record_since(const dp_prof_ctx *ctx, int kind, int dev_kind, int dev_index,
                          uint64_t start_ns, const char *label)
{
    if (ctx->s != NULL) {
        dp_prof_record_span(ctx, kind, dev_kind, dev_index, start_ns, dp_prof_now(), 0,
                            DP_PROF_PATH_NONE, 0, label);
    }
}

void dp_prof_begin_thread(dp_prof_span *sp, int kind)
{
    sp->ctx = dp_prof_current_thread();
    if (sp->ctx.s == NULL) {
        return;
    }
    sp->opened_call = thread_call == 0;
    if (sp->opened_call) {
        thread_call = __atomic_add_fetch(&sp->ctx.s->next_call, 1, __ATOMIC_RELAXED);
    }
    sp->prev_phase = thread_phase;
    thread_phase = (int16_t)kind;
    sp->ctx.call = thread_call;
    sp->ctx.phase = (int16_t)kind;
    sp->start_ns = dp_prof_now();
}

void dp_prof_end_thread(dp_prof_span *sp, const char *label)
{
    if (sp->ctx.s == NULL || thread_session != sp->ctx.s) {
        return;   /* not recording, or the session ended inside the span */
    }
    dp_prof_event ev;
    memset(&ev, 0, sizeof ev);
    ev.end_ns = dp_prof_now();
    ev.start_ns = sp->start_ns;
    ev.thread = dp_prof_thread_id();
    ev.call = sp->ctx.call;
    ev.kind = sp->ctx.phase;
    ev.phase = sp->ctx.phase;
    ev.dev_kind = -1;
    ev.dev_index = -1;
    ev.root = (uint8_t)sp->opened_call;
    if (label != NULL) {
        strncpy(ev.label, label, DP_PROF_LABEL - 1);
    }
    dp_prof_record(&sp->ctx, &ev);
    thread_phase = sp->prev_phase;
    if (sp->opened_call) {
        thread_call = 0;
    }
}
