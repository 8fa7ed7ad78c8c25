/*
 * call.c - what every binding of an engine call (measure, compare, choose,
 * tweak) shares: the call context, the trampolines from engine callbacks into
 * Python, engine codes raised as Python exceptions, statistics as dicts.
 *
 * The GIL is held throughout since every callback is Python. A callback that
 * raises an Exception fails that one step (TW_ECALLBACK, "ExcType: message");
 * one that raises anything else (KeyboardInterrupt, SystemExit) is stashed,
 * the engine is told TW_EINTERRUPT so it cleans up, and the stashed exception
 * is raised again, unchanged, once the engine has returned.
 */
#include "call.h"

#include <string.h>

/* ====================================================== callback context */

static uint64_t tt_clock_now(void *ctx);

/* A callback may drop the caller's last reference to clock or sync (a
 * **kwargs dict a C caller passed through): the call holds its own. Released
 * by tt_call_release. */
void
tt_call_init(TtCall *call, TtState *st, PyObject *clock, PyObject *sync)
{
    memset(call, 0, sizeof(*call));
    call->st = st;
    call->clock = clock == Py_None ? NULL : Py_NewRef(clock);
    call->sync = sync == Py_None ? NULL : Py_NewRef(sync);
    call->host.ctx = call;
    call->host.now_ns = call->clock != NULL ? tt_clock_now : NULL;
}

/* The engine's log lines, passed to the tweak's log(level, text) callable. A
 * logger that fails loses that line, never the tweak. */
void
tt_call_log(void *ctx, int level, const char *msg)
{
    TtCall *call = (TtCall *)ctx;
    PyObject *out; /* new reference */

    if (call->log == NULL || call->stash != NULL)
        return;
    out = PyObject_CallFunction(call->log, "is", level, msg);
    if (out == NULL)
        PyErr_Clear();
    Py_XDECREF(out);
}

void
tt_call_release(TtCall *call)
{
    Py_CLEAR(call->stash);
    Py_CLEAR(call->failure);
    Py_CLEAR(call->clock);
    Py_CLEAR(call->sync);
    Py_CLEAR(call->log);
}

/* "ExcType: message" (or "ExcType" when the message is empty). New reference;
 * NULL with an exception set on failure. */
static PyObject *
tt_exception_describe(TtState *st, PyObject *exc)
{
    PyObject *name = NULL; /* new reference */
    PyObject *text = NULL; /* new reference */
    PyObject *result = NULL;

    if ((name = PyObject_GetAttr((PyObject *)Py_TYPE(exc), st->str_name)) == NULL)
        goto cleanup;
    if ((text = PyObject_Str(exc)) == NULL)
        goto cleanup;
    if (PyUnicode_GetLength(text) > 0)
        result = PyUnicode_FromFormat("%S: %U", name, text);
    else
        result = PyUnicode_FromFormat("%S", name);
cleanup:
    Py_XDECREF(name);
    Py_XDECREF(text);
    return result;
}

/* Called with the exception of a failed callback set: clears it and turns it
 * into the callback's code. */
tw_code
tt_call_fail(TtCall *call, tw_error *err)
{
    PyObject *exc = tt_exception_fetch(); /* new reference */
    PyObject *text = NULL;                /* new reference */
    const char *utf8 = NULL;
    tw_code code;

    if (TT_UNLIKELY(exc == NULL)) {
        code = tw_error_set(err, TW_ECALLBACK, "a callback failed without an exception");
        goto cleanup;
    }
    if (!PyErr_GivenExceptionMatches(exc, PyExc_Exception)) {
        code = tw_error_set(err, TW_EINTERRUPT, "interrupted by %s", Py_TYPE(exc)->tp_name);
        if (call->stash == NULL) { /* the first one wins; later ones are dropped */
            call->stash = exc;
            exc = NULL;
        }
        goto cleanup;
    }
    text = tt_exception_describe(call->st, exc);
    if (text != NULL)
        utf8 = PyUnicode_AsUTF8(text);
    if (utf8 == NULL) {
        PyErr_Clear(); /* an unprintable exception still fails its step */
        utf8 = Py_TYPE(exc)->tp_name;
    }
    code = tw_error_set(err, TW_ECALLBACK, "%s", utf8);
    Py_XSETREF(call->failure, exc);
    exc = NULL;
cleanup:
    Py_XDECREF(exc);
    Py_XDECREF(text);
    return code;
}

/* Calls func(*args). always: call it even after an interrupt (leave()). */
tw_code
tt_call_invoke(TtCall *call, PyObject *func, PyObject *const *args, size_t nargs, int always,
               tw_error *err)
{
    PyObject *res; /* new reference */

    if (TT_UNLIKELY(call->stash != NULL) && !always)
        return tw_error_set(err, TW_EINTERRUPT, "interrupted");
    res = PyObject_Vectorcall(func, args, nargs, NULL);
    if (TT_UNLIKELY(res == NULL))
        return tt_call_fail(call, err);
    Py_DECREF(res);
    return TW_OK;
}

static uint64_t
tt_clock_now(void *ctx)
{
    TtCall *call = (TtCall *)ctx;
    PyObject *res = NULL; /* new reference */
    unsigned long long ns;

    if (TT_UNLIKELY(call->stash != NULL))
        goto cleanup;
    if ((res = PyObject_CallNoArgs(call->clock)) == NULL)
        goto fail;
    if (!PyLong_Check(res)) {
        PyErr_Format(PyExc_TypeError, "clock() must return an int of nanoseconds, not %.100s",
                     Py_TYPE(res)->tp_name);
        goto fail;
    }
    ns = PyLong_AsUnsignedLongLong(res);
    if (ns == (unsigned long long)-1 && PyErr_Occurred())
        goto fail;
    call->last_ns = ns;
    goto cleanup;
fail:
    /* The engine cannot hear a clock fail: stash it, and the next callback
     * reports TW_EINTERRUPT so the engine stops and cleans up. */
    Py_XSETREF(call->stash, tt_exception_fetch());
cleanup:
    Py_XDECREF(res);
    return call->last_ns;
}

/* Calls func(index), the one-int call of both a sample run and a tune; a
 * failure to make the int fails the step like the call itself would. */
tw_code
tt_call_invoke_index(TtCall *call, PyObject *func, size_t index, tw_error *err)
{
    PyObject *arg = NULL; /* new reference */
    tw_code code;

    if (TT_UNLIKELY(call->stash != NULL)) {
        code = tw_error_set(err, TW_EINTERRUPT, "interrupted");
        goto cleanup;
    }
    if ((arg = PyLong_FromSize_t(index)) == NULL) {
        code = tt_call_fail(call, err);
        goto cleanup;
    }
    code = tt_call_invoke(call, func, &arg, 1, 0, err);
cleanup:
    Py_XDECREF(arg);
    return code;
}

static tw_code
tt_run_sample(void *ctx, size_t sample, tw_error *err)
{
    TtRun *run = (TtRun *)ctx;

    return tt_call_invoke_index(run->call, run->run, sample, err);
}

static tw_code
tt_run_sync(void *ctx, tw_error *err)
{
    TtRun *run = (TtRun *)ctx;

    return tt_call_invoke(run->call, run->call->sync, NULL, 0, 0, err);
}

tw_code
tt_run_build(void *ctx, tw_error *err)
{
    TtRun *run = (TtRun *)ctx;

    return tt_call_invoke(run->call, run->build, NULL, 0, 0, err);
}

void
tt_runner_init(tw_runner *runner, TtRun *run, size_t n_samples)
{
    runner->ctx = run;
    runner->n_samples = n_samples;
    runner->run = tt_run_sample;
    runner->sync = run->call->sync != NULL ? tt_run_sync : NULL;
    runner->round = NULL;
}

/* Raises for an engine code with its message; no call context. */
void
tt_raise_code(TtState *st, tw_code code, const char *msg, PyObject *cause)
{
    PyObject *exc; /* new reference */

    if (msg == NULL || msg[0] == '\0')
        msg = tw_code_name(code);
    switch (code) {
    case TW_EINVAL:
        PyErr_SetString(PyExc_ValueError, msg);
        break;
    case TW_ENOMEM:
        PyErr_SetString(PyExc_MemoryError, msg);
        break;
    default:
        PyErr_SetString(st->EngineError, msg);
        if (cause != NULL) {
            exc = tt_exception_fetch();
            Py_INCREF(cause);
            PyException_SetCause(exc, cause); /* steals cause */
            tt_exception_restore(exc);
        }
        break;
    }
}

/* After the engine returned: 0 when all went well, else -1 with the stashed
 * exception raised again, or the engine's error raised. */
int
tt_call_check(TtCall *call, tw_code code, const tw_error *err)
{
    if (TT_UNLIKELY(call->stash != NULL)) {
        tt_exception_restore(call->stash); /* steals */
        call->stash = NULL;
        return -1;
    }
    if (TT_LIKELY(code == TW_OK))
        return 0;
    tt_raise_code(call->st, code, err->msg, code == TW_ECALLBACK ? call->failure : NULL);
    return -1;
}

/* ================================================================= stats */

const char *
tt_stop_name(tw_stop stop)
{
    switch (stop) {
    case TW_STOP_SPREAD:
        return "spread";
    case TW_STOP_ROUNDS:
        return "rounds";
    case TW_STOP_TIME:
        return "time";
    case TW_STOP_DECIDED:
        return "decided";
    }
    return "unknown";
}

/* New reference. */
PyObject *
tt_stats_to_dict(const tw_stats *s)
{
    return Py_BuildValue("{s:d,s:d,s:d,s:d,s:d,s:I,s:I,s:s}", "median_ns", s->median_ns,
                         "q25_ns", s->q25_ns, "q75_ns", s->q75_ns, "min_ns", s->min_ns,
                         "spread", s->spread, "warmup_rounds", (unsigned int)s->warmup_rounds,
                         "rounds", (unsigned int)s->rounds, "stopped_by",
                         tt_stop_name(s->stopped_by));
}

/* The dict of `s` when it was measured, else None: a report, a row and the
 * baseline all show "not measured" the same way. New reference. */
PyObject *
tt_stats_or_none(const tw_stats *s, int measured)
{
    if (!measured)
        Py_RETURN_NONE;
    return tt_stats_to_dict(s);
}
