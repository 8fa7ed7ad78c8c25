/*
 * buf.c - a growing string for the text views (tree and result tables).
 */
#include <stdarg.h>
#include <stdio.h>
#include <string.h>

#include "internal.h"

void tw_buf_init(tw_buf *buf, const tw_host *host)
{
    buf->host = host;
    buf->data = NULL;
    buf->len = 0;
    buf->cap = 0;
    buf->failed = 0;
}

/* Makes room for `extra` more characters and the terminator. */
static int tw_buf_reserve(tw_buf *buf, size_t extra)
{
    size_t need;
    size_t cap;
    char *data = NULL;
    int ok = 0;

    if (buf->failed || extra > (size_t)-1 / 4 - buf->len) {
        goto error;
    }
    need = buf->len + extra + 1;
    if (need <= buf->cap) {
        ok = 1;
        goto cleanup;
    }
    cap = buf->cap < 256 ? 256 : buf->cap;
    while (cap < need) {
        cap *= 2;
    }
    /* The host has no realloc, so growing is a copy. */
    data = tw_free_alloc(buf->host, cap);
    if (data == NULL) {
        goto error;
    }
    if (buf->data != NULL) {
        memcpy(data, buf->data, buf->len + 1);
        tw_free(buf->data);
    } else {
        data[0] = '\0';
    }
    buf->data = data;
    buf->cap = cap;
    TW_ASSERT(buf->len < buf->cap && buf->data[buf->len] == '\0');
    ok = 1;
    goto cleanup;
error:
    buf->failed = 1;
cleanup:
    return ok;
}

void tw_buf_appendf(tw_buf *buf, const char *fmt, ...)
{
    va_list ap;
    int n;

    /* measure first, then write: a va_list cannot be read twice */
    va_start(ap, fmt);
    n = vsnprintf(NULL, 0, fmt, ap);
    va_end(ap);
    if (n < 0) {
        buf->failed = 1;
        goto cleanup;
    }
    if (!tw_buf_reserve(buf, (size_t)n)) {
        goto cleanup;
    }
    va_start(ap, fmt);
    vsnprintf(buf->data + buf->len, (size_t)n + 1, fmt, ap);
    va_end(ap);
    buf->len += (size_t)n;
cleanup:
    return;
}

void tw_buf_append_line(tw_buf *buf, const char *s, size_t width)
{
    size_t n = strcspn(s, "\r\n");
    int cut = s[n] != '\0' && s[n + strspn(s + n, "\r\n")] != '\0';
    size_t i;

    if (width < 8) {
        width = 8;
    }
    if (n > width) {
        /* cut at the last space that leaves room for " ...", never mid-word when one exists */
        for (i = width - 4; i > 0 && s[i] != ' '; i--) {
        }
        n = i > 0 ? i : width - 4;
        cut = 1;
    }
    if (!tw_buf_reserve(buf, n + 4)) {
        goto cleanup;
    }
    for (i = 0; i < n; i++) {
        unsigned char c = (unsigned char)s[i];
        buf->data[buf->len + i] = (c < 0x20 || c == 0x7f) ? ' ' : (char)c;
    }
    buf->len += n;
    if (cut) {
        memcpy(buf->data + buf->len, " ...", 4);
        buf->len += 4;
    }
    buf->data[buf->len] = '\0';
cleanup:
    return;
}

char *tw_buf_take(tw_buf *buf)
{
    char *data = NULL;

    if (buf->failed) {
        goto cleanup;
    }
    /* An empty text is still a string, not a failure. */
    if (buf->data == NULL && !tw_buf_reserve(buf, 0)) {
        goto cleanup;
    }
    data = buf->data;
    buf->data = NULL;
cleanup:
    tw_buf_dispose(buf);
    return data;
}

void tw_buf_dispose(tw_buf *buf)
{
    tw_free(buf->data);
    buf->data = NULL;
    buf->len = 0;
    buf->cap = 0;
}

void tw_utf8_trim(char *s)
{
    size_t n = strlen(s), i = n, tail = 0, want;
    unsigned char lead;

    while (i > 0 && tail < 3 && ((unsigned char)s[i - 1] & 0xC0) == 0x80) {
        i--;
        tail++;
    }
    if (i == 0) {
        goto cleanup;
    }
    lead = (unsigned char)s[i - 1];
    if (lead < 0xC0) {
        goto cleanup; /* ASCII, or continuation bytes with no lead: not a cut */
    }
    want = lead >= 0xF0 ? 4 : lead >= 0xE0 ? 3 : 2;
    if (tail + 1 < want) {
        s[i - 1] = '\0';
    }
cleanup:
    return;
}
