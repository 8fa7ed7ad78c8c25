/*
 * error.c - error reporting, code names, and the host's defaults.
 */
#if !defined(_WIN32) && !defined(_POSIX_C_SOURCE)
#define _POSIX_C_SOURCE 200809L /* clock_gettime under -std=c11 */
#endif

#include <stdarg.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "internal.h"

/* ------------------------------------------------------------------ error */

tw_code tw_error_set(tw_error *err, tw_code code, const char *fmt, ...)
{
    va_list ap;

    if (err == NULL) {
        goto cleanup;
    }
    err->code = code;
    err->msg[0] = '\0';
    if (fmt != NULL) {
        va_start(ap, fmt);
        /* vsnprintf truncates and always terminates: messages never overflow */
        vsnprintf(err->msg, sizeof err->msg, fmt, ap);
        va_end(ap);
        tw_utf8_trim(err->msg);
    }
cleanup:
    return code;
}

void tw_error_clear(tw_error *err)
{
    err->code = TW_OK;
    err->msg[0] = '\0';
}

tw_code tw_error_forward(tw_error *err, tw_code code, const tw_error *cb_err,
                         const char *what)
{
    char msg[TW_MSG_SIZE];

    if (cb_err != NULL && cb_err->msg[0] != '\0') {
        /* a copy first: err and cb_err may be the same slot */
        memcpy(msg, cb_err->msg, sizeof msg);
        msg[sizeof msg - 1] = '\0';
        tw_error_set(err, code, "%s", msg);
    } else {
        tw_error_set(err, code, "%s failed (%s) without a message", what,
                     tw_code_name(code));
    }
    return code;
}

const char *tw_code_name(tw_code code)
{
    const char *name = "unknown error";

    switch (code) {
    case TW_OK: name = "ok"; break;
    case TW_EINVAL: name = "invalid argument"; break;
    case TW_ENOMEM: name = "out of memory"; break;
    case TW_ECALLBACK: name = "callback failed"; break;
    case TW_EINTERRUPT: name = "interrupted"; break;
    case TW_EBUDGET: name = "time budget used up"; break;
    case TW_ESTATE: name = "call out of order"; break;
    }
    return name;
}

/* ------------------------------------------------------------------- host */

static uint64_t tw_default_now_ns(void *ctx)
{
    uint64_t ns = 0;
    struct timespec ts;

    (void)ctx;
#if defined(CLOCK_MONOTONIC)
    if (clock_gettime(CLOCK_MONOTONIC, &ts) == 0) {
        ns = (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
    }
#else
    /* Without a monotonic clock the wall clock is the best there is. */
    if (timespec_get(&ts, TIME_UTC) == TIME_UTC) {
        ns = (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
    }
#endif
    return ns;
}

static void *tw_default_alloc(void *ctx, size_t size)
{
    (void)ctx;
    /* malloc(0) may return NULL, which would read as a failure */
    return malloc(size == 0 ? 1 : size);
}

static void tw_default_release(void *ctx, void *ptr)
{
    (void)ctx;
    free(ptr);
}

void tw_host_resolve(const tw_host *in, tw_host *out)
{
    tw_host none = {NULL, NULL, NULL, NULL, NULL};

    *out = (in != NULL) ? *in : none;
    if (out->now_ns == NULL) {
        out->now_ns = tw_default_now_ns;
    }
    if (out->alloc == NULL || out->release == NULL) {
        out->alloc = tw_default_alloc;
        out->release = tw_default_release;
    }
}

void *tw_host_alloc(const tw_host *host, size_t size)
{
    return host->alloc(host->ctx, size);
}

void *tw_host_alloc_array(const tw_host *host, size_t count, size_t size)
{
    void *ptr = NULL;

    if (size != 0 && count > (size_t)-1 / size) {
        goto cleanup;
    }
    ptr = host->alloc(host->ctx, count * size);
cleanup:
    return ptr;
}

void tw_host_release(const tw_host *host, void *ptr)
{
    if (ptr != NULL) {
        host->release(host->ctx, ptr);
    }
}

uint64_t tw_host_now(const tw_host *host)
{
    return host->now_ns(host->ctx);
}

void tw_host_logf(const tw_host *host, int level, const char *fmt, ...)
{
    char msg[TW_MSG_SIZE];
    va_list ap;

    if (host->log == NULL) {
        goto cleanup;
    }
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    host->log(host->ctx, level, msg);
cleanup:
    return;
}

char *tw_host_strdup(const tw_host *host, const char *s)
{
    size_t len = strlen(s);
    char *copy = tw_host_alloc(host, len + 1);

    if (copy != NULL) {
        memcpy(copy, s, len + 1);
    }
    return copy;
}

/* ----------------------------------------------------------------- tw_free */

/* The header keeps the block aligned for any type and says how to free it. */
typedef union tw_free_header {
    struct {
        void (*release)(void *ctx, void *ptr);
        void *ctx;
    } owner;
    max_align_t align;
} tw_free_header;

void *tw_free_alloc(const tw_host *host, size_t size)
{
    tw_free_header *head = NULL;
    void *ptr = NULL;

    if (size > (size_t)-1 - sizeof *head) {
        goto cleanup;
    }
    head = tw_host_alloc(host, sizeof *head + size);
    if (head == NULL) {
        goto cleanup;
    }
    head->owner.release = host->release;
    head->owner.ctx = host->ctx;
    ptr = head + 1;
cleanup:
    return ptr;
}

void tw_free(void *ptr)
{
    tw_free_header *head;

    if (ptr == NULL) {
        goto cleanup;
    }
    head = (tw_free_header *)ptr - 1;
    head->owner.release(head->owner.ctx, head);
cleanup:
    return;
}

#ifdef TW_CHECK_INVARIANTS
/* Debug and sanitizer builds only (internal.h): a broken invariant of the
 * engine's own code stops the test process at the cause. */
void tw_invariant_failed(const char *cond, const char *file, int line)
{
    fprintf(stderr, "tweak engine: invariant broken at %s:%d: %s\n", file, line, cond);
    fflush(stderr);
    abort();
}
#endif
