/*
 * bindings.c - the engine (tweak.h) seen from Python: Tree, Result, measure,
 * compare, choose, tweak and default_measure_config.
 *
 * Engine callbacks are trampolines into Python callables; the GIL is held
 * throughout since every callback is Python. A callback that raises an
 * Exception fails that one step (TW_ECALLBACK, "ExcType: message"); one that
 * raises anything else (KeyboardInterrupt, SystemExit) is stashed, the
 * engine is told TW_EINTERRUPT so it cleans up, and the stashed exception is
 * raised again, unchanged, once the engine has returned.
 */
#include "ext.h"

#include <limits.h>
#include <math.h>
#include <string.h>

/* ====================================================== callback context */

/* What one engine call (measure, compare, choose, tweak) shares between its
 * trampolines. Lives on the C stack of the binding. */
typedef struct TtCall {
    TtState *st;
    PyObject *clock;   /* new reference; NULL: the engine's monotonic clock */
    PyObject *sync;    /* new reference; NULL: nothing to wait for */
    PyObject *stash;   /* new reference: stops everything, raised at the end */
    PyObject *failure; /* new reference: the latest Exception of a callback */
    uint64_t last_ns;  /* the clock's last reading, returned after a failure */
    PyObject *log;     /* new reference; NULL: the engine's lines go nowhere */
    tw_host host;
} TtCall;

/* A runner's context: one callable to run samples (and one to build, for a
 * candidate). Borrowed references, held by the binding for the whole call
 * (never by the caller's list, which a callback may clear). */
typedef struct TtRun {
    TtCall *call;
    PyObject *run;
    PyObject *build;
} TtRun;

static uint64_t tt_clock_now(void *ctx);

/* A callback may drop the caller's last reference to clock or sync (a
 * **kwargs dict a C caller passed through): the call holds its own. Released
 * by tt_call_release. */
static void
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
static void
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

static void
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
static tw_code
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
static tw_code
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
static tw_code
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

static tw_code
tt_run_build(void *ctx, tw_error *err)
{
    TtRun *run = (TtRun *)ctx;

    return tt_call_invoke(run->call, run->build, NULL, 0, 0, err);
}

static void
tt_runner_init(tw_runner *runner, TtRun *run, size_t n_samples)
{
    runner->ctx = run;
    runner->n_samples = n_samples;
    runner->run = tt_run_sample;
    runner->sync = run->call->sync != NULL ? tt_run_sync : NULL;
    runner->round = NULL;
}

/* Raises for an engine code with its message; no call context. */
static void
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
static int
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

/* ================================================================ config */

enum { TT_KEY_U32, TT_KEY_FRACTION, TT_KEY_SECONDS, TT_KEY_BOOL };

typedef struct TtConfigKey {
    const char *name;
    int kind;
    size_t offset;
} TtConfigKey;

static const TtConfigKey tt_config_keys[] = {
    {"warmup_min", TT_KEY_U32, offsetof(tw_measure_config, warmup_min)},
    {"warmup_max", TT_KEY_U32, offsetof(tw_measure_config, warmup_max)},
    {"warmup_patience", TT_KEY_U32, offsetof(tw_measure_config, warmup_patience)},
    {"warmup_gain", TT_KEY_FRACTION, offsetof(tw_measure_config, warmup_gain)},
    {"rounds_min", TT_KEY_U32, offsetof(tw_measure_config, rounds_min)},
    {"rounds_max", TT_KEY_U32, offsetof(tw_measure_config, rounds_max)},
    {"rel_spread", TT_KEY_FRACTION, offsetof(tw_measure_config, rel_spread)},
    {"time_cap", TT_KEY_SECONDS, offsetof(tw_measure_config, time_cap_ns)},
    {"stop_when_decided", TT_KEY_BOOL, offsetof(tw_measure_config, stop_when_decided)},
};
#define TT_CONFIG_KEYS (sizeof(tt_config_keys) / sizeof(tt_config_keys[0]))

/* A finite number >= 0 from an int or float (not a bool); -1 with ValueError
 * naming `what` otherwise. */
static int
tt_number_nonneg(PyObject *value, const char *what, double *out)
{
    double v;

    if (PyBool_Check(value) || !(PyLong_Check(value) || PyFloat_Check(value))) {
        PyErr_Format(PyExc_ValueError, "%s must be a number, not %.100s", what,
                     Py_TYPE(value)->tp_name);
        return -1;
    }
    v = PyFloat_AsDouble(value);
    if (v == -1.0 && PyErr_Occurred())
        return -1;
    if (!isfinite(v) || v < 0) {
        PyErr_Format(PyExc_ValueError, "%s must be a finite number >= 0, not %R", what, value);
        return -1;
    }
    *out = v;
    return 0;
}

/* Seconds (an int or float >= 0) as whole nanoseconds, rounded; -1 with
 * ValueError naming `what` when it is not a number or does not fit uint64. */
static int
tt_seconds_to_ns(PyObject *value, const char *what, uint64_t *out)
{
    double v;

    if (tt_number_nonneg(value, what, &v) < 0)
        return -1;
    if (v * 1e9 >= 18446744073709551615.0) {
        PyErr_Format(PyExc_ValueError, "%s is too large: %R seconds", what, value);
        return -1;
    }
    *out = (uint64_t)(v * 1e9 + 0.5);
    return 0;
}

static int
tt_config_set(const TtConfigKey *key, PyObject *value, tw_measure_config *cfg)
{
    char what[64];
    char *field = (char *)cfg + key->offset;
    unsigned long long u;
    double v;
    int rc = -1;

    snprintf(what, sizeof(what), "config['%s']", key->name);
    switch (key->kind) {
    case TT_KEY_U32:
        if (PyBool_Check(value) || !PyLong_Check(value)) {
            PyErr_Format(PyExc_ValueError, "%s must be an int, not %.100s", what,
                         Py_TYPE(value)->tp_name);
            goto cleanup;
        }
        u = PyLong_AsUnsignedLongLong(value);
        if ((u == (unsigned long long)-1 && PyErr_Occurred()) || u > UINT32_MAX) {
            PyErr_Clear();
            PyErr_Format(PyExc_ValueError, "%s must be an int in [0, %lu], not %R", what,
                         (unsigned long)UINT32_MAX, value);
            goto cleanup;
        }
        *(uint32_t *)(void *)field = (uint32_t)u;
        break;
    case TT_KEY_FRACTION:
        if (tt_number_nonneg(value, what, &v) < 0)
            goto cleanup;
        *(double *)(void *)field = v;
        break;
    case TT_KEY_BOOL:
        if (!PyBool_Check(value)) {
            PyErr_Format(PyExc_ValueError, "%s must be True or False, not %R", what, value);
            goto cleanup;
        }
        *(uint32_t *)(void *)field = value == Py_True;
        break;
    default: /* TT_KEY_SECONDS */
        if (tt_seconds_to_ns(value, what, (uint64_t *)(void *)field) < 0)
            goto cleanup;
        break;
    }
    rc = 0;
cleanup:
    return rc;
}

/* cfg from the defaults and a dict of any subset of the keys (None: none). */
static int
tt_config_from_dict(PyObject *dict, tw_measure_config *cfg)
{
    PyObject *key, *value; /* borrowed */
    Py_ssize_t pos = 0;
    size_t k;
    int rc = -1;

    tw_measure_config_default(cfg);
    if (dict == NULL || dict == Py_None) {
        rc = 0;
        goto cleanup;
    }
    if (!PyDict_Check(dict)) {
        PyErr_Format(PyExc_TypeError, "config must be a dict or None, not %.100s",
                     Py_TYPE(dict)->tp_name);
        goto cleanup;
    }
    while (PyDict_Next(dict, &pos, &key, &value)) {
        const char *name = PyUnicode_Check(key) ? PyUnicode_AsUTF8(key) : NULL;
        const TtConfigKey *found = NULL;

        if (name == NULL && PyErr_Occurred())
            goto cleanup;
        for (k = 0; name != NULL && k < TT_CONFIG_KEYS && found == NULL; k++)
            if (strcmp(name, tt_config_keys[k].name) == 0)
                found = &tt_config_keys[k];
        if (found == NULL) {
            PyErr_Format(PyExc_ValueError,
                         "unknown measure config key %R; the keys are warmup_min, warmup_max, "
                         "warmup_patience, warmup_gain, rounds_min, rounds_max, rel_spread, "
                         "time_cap, stop_when_decided",
                         key);
            goto cleanup;
        }
        if (tt_config_set(found, value, cfg) < 0)
            goto cleanup;
    }
    rc = 0;
cleanup:
    return rc;
}

PyObject *
tt_py_default_measure_config(PyObject *module, PyObject *unused)
{
    tw_measure_config cfg;
    PyObject *dict = NULL;
    PyObject *value = NULL; /* new reference */
    size_t k;

    (void)module;
    (void)unused;
    tw_measure_config_default(&cfg);
    if ((dict = PyDict_New()) == NULL)
        goto error;
    for (k = 0; k < TT_CONFIG_KEYS; k++) {
        const char *field = (const char *)&cfg + tt_config_keys[k].offset;

        switch (tt_config_keys[k].kind) {
        case TT_KEY_U32:
            value = PyLong_FromUnsignedLong(*(const uint32_t *)(const void *)field);
            break;
        case TT_KEY_FRACTION:
            value = PyFloat_FromDouble(*(const double *)(const void *)field);
            break;
        case TT_KEY_BOOL:
            value = PyBool_FromLong(*(const uint32_t *)(const void *)field != 0);
            break;
        default:
            value = PyFloat_FromDouble((double)*(const uint64_t *)(const void *)field / 1e9);
            break;
        }
        if (value == NULL || PyDict_SetItemString(dict, tt_config_keys[k].name, value) < 0)
            goto error;
        Py_CLEAR(value);
    }
    return dict;
error:
    Py_XDECREF(value);
    Py_XDECREF(dict);
    return NULL;
}

/* ================================================================= stats */

static const char *
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
static PyObject *
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
static PyObject *
tt_stats_or_none(const tw_stats *s, int measured)
{
    if (!measured)
        Py_RETURN_NONE;
    return tt_stats_to_dict(s);
}

/* ===================================================== argument checking */

/* 0 when obj is callable (or None and may_be_none); -1 with TypeError. */
static int
tt_check_callable(PyObject *obj, const char *what, int may_be_none)
{
    if ((may_be_none && obj == Py_None) || PyCallable_Check(obj))
        return 0;
    PyErr_Format(PyExc_TypeError, "%s must be callable%s, not %.100s", what,
                 may_be_none ? " or None" : "", Py_TYPE(obj)->tp_name);
    return -1;
}

static int
tt_check_n_samples(Py_ssize_t n)
{
    if (n >= 0)
        return 0;
    PyErr_Format(PyExc_ValueError, "n_samples must be >= 0, not %zd", n);
    return -1;
}

/* The arguments measure, compare and choose share, checked in one order so
 * that the three name the same bad argument first. */
static int
tt_check_measure_args(PyObject *sync, PyObject *clock, Py_ssize_t n_samples, PyObject *config,
                      tw_measure_config *cfg)
{
    if (tt_check_callable(sync, "sync", 1) < 0 || tt_check_callable(clock, "clock", 1) < 0 ||
        tt_check_n_samples(n_samples) < 0 || tt_config_from_dict(config, cfg) < 0)
        return -1;
    return 0;
}

/* ============================================================== measure */

PyObject *
tt_py_measure(PyObject *module, PyObject *args, PyObject *kwargs)
{
    static char *kwlist[] = {"run", "n_samples", "sync", "config", "clock", NULL};
    PyObject *run, *sync = Py_None, *config = Py_None, *clock = Py_None; /* borrowed */
    PyObject *held = NULL; /* new reference: run, for the whole call */
    PyObject *result = NULL;
    Py_ssize_t n_samples;
    tw_measure_config cfg;
    tw_runner runner;
    tw_stats stats;
    tw_error err;
    tw_code code;
    TtCall call;
    TtRun r;

    tt_call_init(&call, (TtState *)PyModule_GetState(module), Py_None, Py_None);
    memset(&err, 0, sizeof(err));
    memset(&stats, 0, sizeof(stats));
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "On|$OOO:measure", kwlist, &run, &n_samples,
                                     &sync, &config, &clock))
        goto cleanup;
    if (tt_check_callable(run, "run", 0) < 0 ||
        tt_check_measure_args(sync, clock, n_samples, config, &cfg) < 0)
        goto cleanup;
    tt_call_init(&call, call.st, clock, sync);
    held = Py_NewRef(run);
    r.call = &call;
    r.run = held;
    r.build = NULL;
    tt_runner_init(&runner, &r, (size_t)n_samples);
    code = tw_measure(&call.host, &runner, &cfg, &stats, &err);
    if (tt_call_check(&call, code, &err) < 0)
        goto cleanup;
    result = tt_stats_to_dict(&stats);
cleanup:
    tt_call_release(&call);
    Py_XDECREF(held);
    return result;
}

/* ============================================================== compare */

PyObject *
tt_py_compare(PyObject *module, PyObject *args, PyObject *kwargs)
{
    static char *kwlist[] = {"runs", "n_samples", "sync", "config", "clock", NULL};
    PyObject *runs_arg, *sync = Py_None, *config = Py_None, *clock = Py_None; /* borrowed */
    PyObject *runs = NULL; /* new reference: a tuple of runs, held while they are called */
    PyObject *list = NULL;
    PyObject *result = NULL;
    Py_ssize_t n_samples, n = 0, i;
    tw_measure_config cfg;
    tw_runner *runners = NULL;
    tw_stats *stats = NULL;
    TtRun *ctxs = NULL;
    tw_error err;
    tw_code code;
    TtCall call;

    tt_call_init(&call, (TtState *)PyModule_GetState(module), Py_None, Py_None);
    memset(&err, 0, sizeof(err));
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "On|$OOO:compare", kwlist, &runs_arg,
                                     &n_samples, &sync, &config, &clock))
        goto cleanup;
    if ((runs = tt_sequence_tuple(runs_arg, "runs must be a sequence of callables")) == NULL)
        goto cleanup;
    n = PySequence_Fast_GET_SIZE(runs);
    for (i = 0; i < n; i++)
        if (tt_check_callable(PySequence_Fast_GET_ITEM(runs, i), "each of runs", 0) < 0)
            goto cleanup;
    if (tt_check_measure_args(sync, clock, n_samples, config, &cfg) < 0)
        goto cleanup;
    runners = PyMem_Calloc((size_t)n + 1, sizeof(tw_runner));
    stats = PyMem_Calloc((size_t)n + 1, sizeof(tw_stats));
    ctxs = PyMem_Calloc((size_t)n + 1, sizeof(TtRun));
    if (runners == NULL || stats == NULL || ctxs == NULL) {
        PyErr_NoMemory();
        goto cleanup;
    }
    tt_call_init(&call, call.st, clock, sync);
    for (i = 0; i < n; i++) {
        ctxs[i].call = &call;
        ctxs[i].run = PySequence_Fast_GET_ITEM(runs, i);
        tt_runner_init(&runners[i], &ctxs[i], (size_t)n_samples);
    }
    code = tw_measure_compare(&call.host, runners, (size_t)n, &cfg, stats, &err);
    if (tt_call_check(&call, code, &err) < 0)
        goto cleanup;
    if ((list = PyList_New(n)) == NULL)
        goto cleanup;
    for (i = 0; i < n; i++) {
        PyObject *d = tt_stats_to_dict(&stats[i]);
        if (d == NULL)
            goto cleanup;
        PyList_SET_ITEM(list, i, d);
    }
    result = list;
    list = NULL;
cleanup:
    tt_call_release(&call);
    PyMem_Free(runners);
    PyMem_Free(stats);
    PyMem_Free(ctxs);
    Py_XDECREF(runs);
    Py_XDECREF(list);
    return result;
}

/* =============================================================== choose */

static const char *
tt_candidate_state_name(tw_candidate_state state)
{
    switch (state) {
    case TW_CAND_NOT_TRIED:
        return "not tried";
    case TW_CAND_FAILED:
        return "failed";
    case TW_CAND_BUILT:
        return "built";
    case TW_CAND_MEASURED:
        return "measured";
    }
    return "unknown";
}

/* The strategy named `kind`, by the engine's own names; -1 with ValueError. */
static int
tt_strategy_parse(PyObject *kind, tw_strategy_kind *out)
{
    const char *name = PyUnicode_Check(kind) ? PyUnicode_AsUTF8(kind) : NULL;
    int k;

    if (name == NULL) {
        if (!PyErr_Occurred())
            PyErr_Format(PyExc_TypeError, "kind must be a str, not %.100s",
                         Py_TYPE(kind)->tp_name);
        return -1;
    }
    for (k = TW_STRATEGY_FIRST_WINS; k <= TW_STRATEGY_ONE_BACKEND; k++) {
        const char *known = tw_strategy_name((tw_strategy_kind)k);
        if (known != NULL && strcmp(name, known) == 0) {
            *out = (tw_strategy_kind)k;
            return 0;
        }
    }
    PyErr_Format(PyExc_ValueError,
                 "unknown strategy kind %R; the kinds are 'first-wins', "
                 "'highest-throughput' and 'one-backend'",
                 kind);
    return -1;
}

static PyObject *
tt_report_to_dict(PyObject *name, const tw_candidate_report *report)
{
    PyObject *stats = NULL; /* new reference */
    PyObject *result = NULL;

    if ((stats = tt_stats_or_none(&report->stats, report->state == TW_CAND_MEASURED)) == NULL)
        goto cleanup;
    result = Py_BuildValue("{s:O,s:s,s:s,s:O}", "name", name, "state",
                           tt_candidate_state_name(report->state), "error",
                           report->state == TW_CAND_FAILED ? report->msg : "", "stats", stats);
cleanup:
    Py_XDECREF(stats);
    return result;
}

PyObject *
tt_py_choose(PyObject *module, PyObject *args, PyObject *kwargs)
{
    static char *kwlist[] = {"kind", "candidates", "n_samples", "sync", "config", "clock",
                             NULL};
    PyObject *kind, *cands_arg, *sync = Py_None, *config = Py_None, *clock = Py_None;
    PyObject *cands = NULL; /* new reference: a tuple of the candidates, held while they run */
    PyObject *reports_list = NULL;
    PyObject *result = NULL;
    Py_ssize_t n_samples, n = 0, i;
    tw_strategy_kind strategy = TW_STRATEGY_FIRST_WINS;
    tw_measure_config cfg;
    tw_candidate *candidates = NULL;
    tw_candidate_report *reports = NULL;
    TtRun *ctxs = NULL;
    long chosen = -1;
    tw_error err;
    tw_code code;
    TtCall call;

    tt_call_init(&call, (TtState *)PyModule_GetState(module), Py_None, Py_None);
    memset(&err, 0, sizeof(err));
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "OOn|$OOO:choose", kwlist, &kind, &cands_arg,
                                     &n_samples, &sync, &config, &clock))
        goto cleanup;
    if (tt_strategy_parse(kind, &strategy) < 0)
        goto cleanup;
    cands = tt_sequence_tuple(cands_arg, "candidates must be a sequence of (name, build, run)");
    if (cands == NULL)
        goto cleanup;
    n = PySequence_Fast_GET_SIZE(cands);
    candidates = PyMem_Calloc((size_t)n + 1, sizeof(tw_candidate));
    reports = PyMem_Calloc((size_t)n + 1, sizeof(tw_candidate_report));
    ctxs = PyMem_Calloc((size_t)n + 1, sizeof(TtRun));
    if (candidates == NULL || reports == NULL || ctxs == NULL) {
        PyErr_NoMemory();
        goto cleanup;
    }
    if (tt_check_measure_args(sync, clock, n_samples, config, &cfg) < 0)
        goto cleanup;
    tt_call_init(&call, call.st, clock, sync);
    for (i = 0; i < n; i++) {
        /* the tuple is held by cands (our own tuple, not the caller's list),
         * and its name, build and run by the tuple */
        PyObject *item = PySequence_Fast_GET_ITEM(cands, i);
        PyObject *name;

        if (!PyTuple_Check(item) || PyTuple_GET_SIZE(item) != 3) {
            PyErr_Format(PyExc_TypeError, "candidates[%zd] must be a (name, build, run) tuple",
                         i);
            goto cleanup;
        }
        name = PyTuple_GET_ITEM(item, 0);
        if (!PyUnicode_Check(name)) {
            PyErr_Format(PyExc_TypeError, "candidates[%zd]: the name must be a str", i);
            goto cleanup;
        }
        if ((candidates[i].name = PyUnicode_AsUTF8(name)) == NULL)
            goto cleanup;
        ctxs[i].call = &call;
        ctxs[i].build = PyTuple_GET_ITEM(item, 1);
        ctxs[i].run = PyTuple_GET_ITEM(item, 2);
        if (tt_check_callable(ctxs[i].build, "a candidate's build", 0) < 0 ||
            tt_check_callable(ctxs[i].run, "a candidate's run", 0) < 0)
            goto cleanup;
        candidates[i].ctx = &ctxs[i];
        candidates[i].build = tt_run_build;
        tt_runner_init(&candidates[i].runner, &ctxs[i], (size_t)n_samples);
    }
    code = tw_strategy_choose(&call.host, strategy, candidates, (size_t)n, &cfg, &chosen,
                              reports, &err);
    if (tt_call_check(&call, code, &err) < 0)
        goto cleanup;
    if ((reports_list = PyList_New(n)) == NULL)
        goto cleanup;
    for (i = 0; i < n; i++) {
        PyObject *name = PyTuple_GET_ITEM(PySequence_Fast_GET_ITEM(cands, i), 0);
        PyObject *d = tt_report_to_dict(name, &reports[i]);
        if (d == NULL)
            goto cleanup;
        PyList_SET_ITEM(reports_list, i, d);
    }
    result = Py_BuildValue("(lO)", chosen, reports_list);
cleanup:
    tt_call_release(&call);
    PyMem_Free(candidates);
    PyMem_Free(reports);
    PyMem_Free(ctxs);
    Py_XDECREF(cands);
    Py_XDECREF(reports_list);
    return result;
}

/* ================================================================= Tree */

typedef struct {
    PyObject_HEAD
    tw_tree *tree; /* owned, finished */
} TtTree;

/* A non-negative int that fits uint64; -1 with ValueError naming `what`. */
static int
tt_uint64_arg(PyObject *value, const char *what, Py_ssize_t i, uint64_t *out)
{
    unsigned long long u;

    if (PyBool_Check(value) || !PyLong_Check(value))
        goto bad;
    u = PyLong_AsUnsignedLongLong(value);
    if (u == (unsigned long long)-1 && PyErr_Occurred()) {
        PyErr_Clear();
        goto bad;
    }
    *out = (uint64_t)u;
    return 0;
bad:
    PyErr_Format(PyExc_ValueError, "modules[%zd]: %s must be an int >= 0, not %R", i, what,
                 value);
    return -1;
}

static PyObject *
tt_tree_new(PyTypeObject *type, PyObject *args, PyObject *kwargs)
{
    static char *kwlist[] = {"modules", NULL};
    PyObject *modules_arg;       /* borrowed */
    PyObject *modules = NULL;    /* new reference: a tuple */
    TtTree *self = NULL;
    TtState *st = (TtState *)PyType_GetModuleState(type);
    Py_ssize_t i, n;
    tw_error err;
    tw_code code;

    memset(&err, 0, sizeof(err));
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "O:Tree", kwlist, &modules_arg))
        goto error;
    modules = tt_sequence_tuple(modules_arg, "modules must be a sequence of (path, calls, time_ns)");
    if (modules == NULL)
        goto error;
    if ((self = (TtTree *)type->tp_alloc(type, 0)) == NULL)
        goto error;
    if ((self->tree = tw_tree_create(NULL, &err)) == NULL) {
        tt_raise_code(st, TW_ENOMEM, err.msg, NULL);
        goto error;
    }
    n = PySequence_Fast_GET_SIZE(modules);
    for (i = 0; i < n; i++) {
        PyObject *item = PySequence_Fast_GET_ITEM(modules, i); /* borrowed */
        const char *path;
        Py_ssize_t path_len;
        uint64_t calls, time_ns;

        if (!PyTuple_Check(item) || PyTuple_GET_SIZE(item) != 3 ||
            !PyUnicode_Check(PyTuple_GET_ITEM(item, 0))) {
            PyErr_Format(PyExc_TypeError,
                         "modules[%zd] must be a (path: str, calls: int, time_ns: int) tuple", i);
            goto error;
        }
        if ((path = PyUnicode_AsUTF8AndSize(PyTuple_GET_ITEM(item, 0), &path_len)) == NULL)
            goto error;
        if ((Py_ssize_t)strlen(path) != path_len) {
            PyErr_Format(PyExc_ValueError, "modules[%zd]: the path contains a NUL character", i);
            goto error;
        }
        if (tt_uint64_arg(PyTuple_GET_ITEM(item, 1), "calls", i, &calls) < 0 ||
            tt_uint64_arg(PyTuple_GET_ITEM(item, 2), "time_ns", i, &time_ns) < 0)
            goto error;
        code = tw_tree_add(self->tree, path, calls, time_ns, NULL, &err);
        if (code != TW_OK) {
            char msg[TW_MSG_SIZE + 32];
            snprintf(msg, sizeof(msg), "modules[%zd]: %s", i, err.msg);
            tt_raise_code(st, code, msg, NULL);
            goto error;
        }
    }
    code = tw_tree_finish(self->tree, &err);
    if (code != TW_OK) {
        tt_raise_code(st, code, err.msg, NULL);
        goto error;
    }
    Py_DECREF(modules);
    return (PyObject *)self;
error:
    Py_XDECREF(modules);
    Py_XDECREF(self);
    return NULL;
}

static void
tt_tree_dealloc(TtTree *self)
{
    PyTypeObject *tp = Py_TYPE(self);

    tw_tree_destroy(self->tree);
    tp->tp_free((PyObject *)self);
    Py_DECREF(tp);
}

static Py_ssize_t
tt_tree_len(TtTree *self)
{
    return (Py_ssize_t)tw_tree_size(self->tree);
}

/* A node index below n_nodes from an int; -1 with IndexError/TypeError. Tree
 * and Result index the same nodes, so they reject the same numbers alike. */
static int
tt_node_index(PyObject *arg, size_t n_nodes, size_t *out)
{
    Py_ssize_t i = PyNumber_AsSsize_t(arg, PyExc_IndexError);

    if (i == -1 && PyErr_Occurred())
        return -1;
    if (i < 0 || (size_t)i >= n_nodes) {
        PyErr_Format(PyExc_IndexError, "node index %zd out of range for a tree of %zu nodes", i,
                     n_nodes);
        return -1;
    }
    *out = (size_t)i;
    return 0;
}

/* What the per-node methods of Tree read; one reader so that each checks its
 * index the same way. */
enum { TT_NODE_PATH, TT_NODE_DEPTH, TT_NODE_PARENT, TT_NODE_CHILD_COUNT, TT_NODE_CALLS,
       TT_NODE_TIME_NS };

/* Field `what` of node `arg`. New reference; NULL with an exception. */
static PyObject *
tt_tree_node_field(TtTree *self, PyObject *arg, int what)
{
    PyObject *result = NULL;
    size_t i;

    if (tt_node_index(arg, tw_tree_size(self->tree), &i) < 0)
        goto cleanup;
    switch (what) {
    case TT_NODE_PATH:
        result = PyUnicode_FromString(tw_tree_path(self->tree, i));
        break;
    case TT_NODE_DEPTH:
        result = PyLong_FromLong(tw_tree_depth(self->tree, i));
        break;
    case TT_NODE_PARENT:
        result = PyLong_FromLong(tw_tree_parent(self->tree, i));
        break;
    case TT_NODE_CHILD_COUNT:
        result = PyLong_FromSize_t(tw_tree_child_count(self->tree, i));
        break;
    case TT_NODE_CALLS:
        result = PyLong_FromUnsignedLongLong(tw_tree_calls(self->tree, i));
        break;
    default: /* TT_NODE_TIME_NS */
        result = PyLong_FromUnsignedLongLong(tw_tree_time_ns(self->tree, i));
        break;
    }
cleanup:
    return result;
}

static PyObject *
tt_tree_path(TtTree *self, PyObject *arg)
{
    return tt_tree_node_field(self, arg, TT_NODE_PATH);
}

static PyObject *
tt_tree_depth(TtTree *self, PyObject *arg)
{
    return tt_tree_node_field(self, arg, TT_NODE_DEPTH);
}

static PyObject *
tt_tree_parent(TtTree *self, PyObject *arg)
{
    return tt_tree_node_field(self, arg, TT_NODE_PARENT);
}

static PyObject *
tt_tree_child_count(TtTree *self, PyObject *arg)
{
    return tt_tree_node_field(self, arg, TT_NODE_CHILD_COUNT);
}

static PyObject *
tt_tree_calls(TtTree *self, PyObject *arg)
{
    return tt_tree_node_field(self, arg, TT_NODE_CALLS);
}

static PyObject *
tt_tree_time_ns(TtTree *self, PyObject *arg)
{
    return tt_tree_node_field(self, arg, TT_NODE_TIME_NS);
}

static PyObject *
tt_tree_find(TtTree *self, PyObject *arg)
{
    const char *path;
    Py_ssize_t len;

    if (!PyUnicode_Check(arg)) {
        PyErr_Format(PyExc_TypeError, "find: the path must be a str, not %.100s",
                     Py_TYPE(arg)->tp_name);
        return NULL;
    }
    if ((path = PyUnicode_AsUTF8AndSize(arg, &len)) == NULL)
        return NULL;
    if ((Py_ssize_t)strlen(path) != len)
        return PyLong_FromLong(-1); /* no path holds a NUL */
    return PyLong_FromLong(tw_tree_find(self->tree, path));
}

static PyObject *
tt_tree_cut(TtTree *self, PyObject *arg)
{
    TtState *st = (TtState *)PyType_GetModuleState(Py_TYPE(self));
    size_t cap = tw_tree_size(self->tree) + 1, count = 0, i;
    size_t *out = NULL;
    PyObject *list = NULL;
    PyObject *result = NULL;
    long depth;
    tw_error err;
    tw_code code;

    memset(&err, 0, sizeof(err));
    depth = PyLong_AsLong(arg);
    if (depth == -1 && PyErr_Occurred())
        goto cleanup;
    if (depth < INT_MIN || depth > INT_MAX) {
        PyErr_Format(PyExc_ValueError, "cut: depth %ld is out of range", depth);
        goto cleanup;
    }
    /* a cut holds at most every node, so one call is enough */
    if ((out = PyMem_Calloc(cap, sizeof(size_t))) == NULL) {
        PyErr_NoMemory();
        goto cleanup;
    }
    code = tw_tree_cut(self->tree, (int)depth, out, cap, &count, &err);
    if (code != TW_OK) {
        tt_raise_code(st, code, err.msg, NULL);
        goto cleanup;
    }
    if (count > cap) {
        PyErr_SetString(st->EngineError, "cut: the engine returned more nodes than the tree has");
        goto cleanup;
    }
    if ((list = PyList_New((Py_ssize_t)count)) == NULL)
        goto cleanup;
    for (i = 0; i < count; i++) {
        PyObject *v = PyLong_FromSize_t(out[i]);
        if (v == NULL)
            goto cleanup;
        PyList_SET_ITEM(list, (Py_ssize_t)i, v);
    }
    result = list;
    list = NULL;
cleanup:
    PyMem_Free(out);
    Py_XDECREF(list);
    return result;
}

static PyObject *
tt_tree_distinct_depths(TtTree *self, PyObject *args, PyObject *kwargs)
{
    static char *kwlist[] = {"min_depth", "max_depth", NULL};
    TtState *st = (TtState *)PyType_GetModuleState(Py_TYPE(self));
    int min_depth = 0, max_depth = -1;
    size_t cap, count = 0, i;
    int *out = NULL;
    PyObject *list = NULL;
    PyObject *result = NULL;
    tw_error err;
    tw_code code;

    memset(&err, 0, sizeof(err));
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "|ii:distinct_depths", kwlist, &min_depth,
                                     &max_depth))
        goto cleanup;
    /* distinct cuts are at distinct depths, and depths go to max_depth */
    cap = (size_t)(tw_tree_max_depth(self->tree) + 2);
    if ((out = PyMem_Calloc(cap, sizeof(int))) == NULL) {
        PyErr_NoMemory();
        goto cleanup;
    }
    code = tw_tree_distinct_depths(self->tree, min_depth, max_depth, out, cap, &count, &err);
    if (code != TW_OK) {
        tt_raise_code(st, code, err.msg, NULL);
        goto cleanup;
    }
    if (count > cap) {
        PyErr_SetString(st->EngineError,
                        "distinct_depths: the engine returned more depths than the tree has");
        goto cleanup;
    }
    if ((list = PyList_New((Py_ssize_t)count)) == NULL)
        goto cleanup;
    for (i = 0; i < count; i++) {
        PyObject *v = PyLong_FromLong(out[i]);
        if (v == NULL)
            goto cleanup;
        PyList_SET_ITEM(list, (Py_ssize_t)i, v);
    }
    result = list;
    list = NULL;
cleanup:
    PyMem_Free(out);
    Py_XDECREF(list);
    return result;
}

/* A str from a tw_*_format string, which it frees. New reference. */
static PyObject *
tt_take_formatted(TtState *st, char *text, const tw_error *err)
{
    PyObject *result = NULL;

    if (text == NULL) {
        tt_raise_code(st, err->code != TW_OK ? err->code : TW_ENOMEM, err->msg, NULL);
        goto cleanup;
    }
    result = PyUnicode_DecodeUTF8(text, (Py_ssize_t)strlen(text), "replace");
cleanup:
    tw_free(text);
    return result;
}

static PyObject *
tt_tree_format(TtTree *self, PyObject *unused)
{
    TtState *st = (TtState *)PyType_GetModuleState(Py_TYPE(self));
    tw_error err;

    (void)unused;
    memset(&err, 0, sizeof(err));
    return tt_take_formatted(st, tw_tree_format(self->tree, &err), &err);
}

static PyObject *
tt_tree_get_max_depth(TtTree *self, void *closure)
{
    (void)closure;
    return PyLong_FromLong(tw_tree_max_depth(self->tree));
}

static PyMethodDef tt_tree_methods[] = {
    {"path", (PyCFunction)tt_tree_path, METH_O, "path(i) -> str"},
    {"depth", (PyCFunction)tt_tree_depth, METH_O, "depth(i) -> int"},
    {"parent", (PyCFunction)tt_tree_parent, METH_O, "parent(i) -> int; -1 for the root"},
    {"child_count", (PyCFunction)tt_tree_child_count, METH_O, "child_count(i) -> int"},
    {"calls", (PyCFunction)tt_tree_calls, METH_O, "calls(i) -> int"},
    {"time_ns", (PyCFunction)tt_tree_time_ns, METH_O, "time_ns(i) -> int"},
    {"find", (PyCFunction)tt_tree_find, METH_O, "find(path) -> int; -1 when absent"},
    {"cut", (PyCFunction)tt_tree_cut, METH_O, "cut(depth) -> [node index]"},
    {"distinct_depths", (PyCFunction)(void (*)(void))tt_tree_distinct_depths,
     METH_VARARGS | METH_KEYWORDS, "distinct_depths(min_depth=0, max_depth=-1) -> [depth]"},
    {"format", (PyCFunction)tt_tree_format, METH_NOARGS, "format() -> str"},
    {NULL, NULL, 0, NULL}};

static PyGetSetDef tt_tree_getset[] = {
    {"max_depth", (getter)tt_tree_get_max_depth, NULL, "Deepest depth of any node.", NULL},
    {NULL, NULL, NULL, NULL, NULL}};

static PyType_Slot tt_tree_slots[] = {
    {Py_tp_doc, "Tree(modules): the tree of called modules; modules is a sequence of\n"
                "(path, calls, time_ns), the root being \"\"."},
    {Py_tp_new, tt_tree_new},
    {Py_tp_dealloc, tt_tree_dealloc},
    {Py_tp_methods, tt_tree_methods},
    {Py_tp_getset, tt_tree_getset},
    {Py_sq_length, tt_tree_len},
    {0, NULL}};

static PyType_Spec tt_tree_spec = {
    .name = "torch_tweak._C.Tree",
    .basicsize = sizeof(TtTree),
    .flags = Py_TPFLAGS_DEFAULT,
    .slots = tt_tree_slots,
};

/* =============================================================== Result */

typedef struct {
    PyObject_HEAD
    tw_result *result; /* owned */
    size_t n_nodes;    /* of the tree it was computed on */
} TtResult;

static const char *
tt_row_state_name(tw_row_state state)
{
    switch (state) {
    case TW_ROW_MEASURED:
        return "measured";
    case TW_ROW_SKIPPED:
        return "skipped";
    case TW_ROW_BUDGET:
        return "budget";
    case TW_ROW_DRY:
        return "dry";
    }
    return "unknown";
}

static void
tt_result_dealloc(TtResult *self)
{
    PyTypeObject *tp = Py_TYPE(self);

    tw_result_destroy(self->result);
    tp->tp_free((PyObject *)self);
    Py_DECREF(tp);
}

static PyObject *
tt_result_get_rows(TtResult *self, void *closure)
{
    TtState *st = (TtState *)PyType_GetModuleState(Py_TYPE(self));
    size_t n = tw_result_row_count(self->result), i;
    PyObject *list = NULL;
    PyObject *stats = NULL; /* new reference */
    PyObject *result = NULL;
    tw_error err;
    tw_row row;
    tw_code code;

    (void)closure;
    memset(&err, 0, sizeof(err));
    if ((list = PyList_New((Py_ssize_t)n)) == NULL)
        goto cleanup;
    for (i = 0; i < n; i++) {
        PyObject *d;

        memset(&row, 0, sizeof(row));
        if ((code = tw_result_row(self->result, i, &row, &err)) != TW_OK) {
            tt_raise_code(st, code, err.msg, NULL);
            goto cleanup;
        }
        if ((stats = tt_stats_or_none(&row.stats, row.state == TW_ROW_MEASURED)) == NULL)
            goto cleanup;
        d = Py_BuildValue("{s:i,s:n,s:n,s:s,s:s,s:O}", "depth", row.depth, "modules",
                          (Py_ssize_t)row.modules, "failed", (Py_ssize_t)row.failed, "state",
                          tt_row_state_name(row.state), "error",
                          row.error != NULL ? row.error : "", "stats", stats);
        Py_CLEAR(stats);
        if (d == NULL)
            goto cleanup;
        PyList_SET_ITEM(list, (Py_ssize_t)i, d);
    }
    result = list;
    list = NULL;
cleanup:
    Py_XDECREF(stats);
    Py_XDECREF(list);
    return result;
}

static PyObject *
tt_result_get_selected(TtResult *self, void *closure)
{
    (void)closure;
    return PyLong_FromLong(tw_result_selected(self->result));
}

static PyObject *
tt_result_get_baseline(TtResult *self, void *closure)
{
    tw_stats stats;
    int measured = 0;

    (void)closure;
    memset(&stats, 0, sizeof(stats));
    tw_result_baseline(self->result, &stats, &measured);
    return tt_stats_or_none(&stats, measured);
}

static PyObject *
tt_result_get_confirmation(TtResult *self, void *closure)
{
    tw_confirmation c;
    PyObject *tuned = NULL, *untuned = NULL; /* new references */
    PyObject *result = NULL;

    (void)closure;
    tw_result_confirmation(self->result, &c);
    if (!c.measured)
        Py_RETURN_NONE;
    if ((tuned = tt_stats_to_dict(&c.tuned)) == NULL ||
        (untuned = tt_stats_to_dict(&c.untuned)) == NULL)
        goto cleanup;
    result = Py_BuildValue("{s:i,s:O,s:O,s:O,s:d,s:d,s:d}", "depth", c.depth, "confirmed",
                           c.confirmed ? Py_True : Py_False, "tuned", tuned, "untuned", untuned,
                           "speedup", c.speedup, "speedup_low", c.speedup_low, "speedup_high",
                           c.speedup_high);
cleanup:
    Py_XDECREF(tuned);
    Py_XDECREF(untuned);
    return result;
}

static PyObject *
tt_result_get_noisy(TtResult *self, void *closure)
{
    (void)closure;
    return PyBool_FromLong(tw_result_noisy(self->result));
}

static PyObject *
tt_result_module(TtResult *self, PyObject *arg)
{
    const char *error = NULL;
    size_t node;
    int state;

    if (tt_node_index(arg, self->n_nodes, &node) < 0)
        return NULL;
    state = tw_result_module(self->result, node, &error);
    return Py_BuildValue("(is)", state, error != NULL ? error : "");
}

static PyObject *
tt_result_format(TtResult *self, PyObject *unused)
{
    TtState *st = (TtState *)PyType_GetModuleState(Py_TYPE(self));
    tw_error err;

    (void)unused;
    memset(&err, 0, sizeof(err));
    return tt_take_formatted(st, tw_result_format(self->result, &err), &err);
}

static PyObject *
tt_result_str(TtResult *self)
{
    return tt_result_format(self, NULL);
}

static PyMethodDef tt_result_methods[] = {
    {"module", (PyCFunction)tt_result_module, METH_O,
     "module(node) -> (1 tuned, -1 failed, 0 never tuned; error)"},
    {"format", (PyCFunction)tt_result_format, METH_NOARGS, "format() -> the result table"},
    {NULL, NULL, 0, NULL}};

static PyGetSetDef tt_result_getset[] = {
    {"rows", (getter)tt_result_get_rows, NULL, "One dict per depth.", NULL},
    {"selected", (getter)tt_result_get_selected, NULL,
     "Index into rows, or -1 when the model stays untuned.", NULL},
    {"confirmation", (getter)tt_result_get_confirmation, NULL,
     "The kept depth measured side by side with the untuned model: a dict (depth, confirmed, "
     "tuned, untuned, speedup, speedup_low, speedup_high), or None when none was measured.",
     NULL},
    {"noisy", (getter)tt_result_get_noisy, NULL,
     "True when no speedup was confirmed and a measurement spread more than the engine's noisy "
     "limit (a busy machine may have hidden one).", NULL},
    {"baseline", (getter)tt_result_get_baseline, NULL,
     "The untuned model's statistics; None on a dry run.", NULL},
    {NULL, NULL, NULL, NULL, NULL}};

static PyType_Slot tt_result_slots[] = {
    {Py_tp_doc, "The result of tweak(); str() is the engine's table."},
    {Py_tp_dealloc, tt_result_dealloc},
    {Py_tp_methods, tt_result_methods},
    {Py_tp_getset, tt_result_getset},
    {Py_tp_str, tt_result_str},
    {0, NULL}};

static PyType_Spec tt_result_spec = {
    .name = "torch_tweak._C.Result",
    .basicsize = sizeof(TtResult),
    .flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_DISALLOW_INSTANTIATION,
    .slots = tt_result_slots,
};

/* ================================================================ tweak */

typedef struct TtTweak {
    TtCall *call;
    /* new references, held for the whole call; deactivate may be NULL */
    PyObject *enter, *tune, *activate, *deactivate, *leave;
    PyObject *run;
    PyObject *tree;
    TtRun model;
} TtTweak;

static tw_code
tt_tweak_enter(void *ctx, const size_t *nodes, const int *tune, size_t n, tw_error *err)
{
    TtTweak *tw = (TtTweak *)ctx;
    PyObject *args[2] = {NULL, NULL}; /* new references: nodes, tune */
    size_t i;
    tw_code code;

    if (TT_UNLIKELY(tw->call->stash != NULL)) {
        code = tw_error_set(err, TW_EINTERRUPT, "interrupted");
        goto cleanup;
    }
    if ((args[0] = PyList_New((Py_ssize_t)n)) == NULL ||
        (args[1] = PyList_New((Py_ssize_t)n)) == NULL)
        goto fail;
    for (i = 0; i < n; i++) {
        PyObject *node = PyLong_FromSize_t(nodes[i]);
        PyObject *flag = tune[i] ? Py_True : Py_False;

        if (node == NULL)
            goto fail;
        PyList_SET_ITEM(args[0], (Py_ssize_t)i, node);
        Py_INCREF(flag);
        PyList_SET_ITEM(args[1], (Py_ssize_t)i, flag);
    }
    code = tt_call_invoke(tw->call, tw->enter, args, 2, 0, err);
    goto cleanup;
fail:
    code = tt_call_fail(tw->call, err);
cleanup:
    Py_XDECREF(args[0]);
    Py_XDECREF(args[1]);
    return code;
}

static tw_code
tt_tweak_tune(void *ctx, size_t node, tw_error *err)
{
    TtTweak *tw = (TtTweak *)ctx;

    return tt_call_invoke_index(tw->call, tw->tune, node, err);
}

static tw_code
tt_tweak_activate(void *ctx, tw_error *err)
{
    TtTweak *tw = (TtTweak *)ctx;

    return tt_call_invoke(tw->call, tw->activate, NULL, 0, 0, err);
}

static tw_code
tt_tweak_deactivate(void *ctx, tw_error *err)
{
    TtTweak *tw = (TtTweak *)ctx;

    return tt_call_invoke(tw->call, tw->deactivate, NULL, 0, 0, err);
}

static tw_code
tt_tweak_leave(void *ctx, tw_error *err)
{
    TtTweak *tw = (TtTweak *)ctx;

    /* even after an interrupt: leave() is what puts the user's model back */
    return tt_call_invoke(tw->call, tw->leave, NULL, 0, 1, err);
}

PyObject *
tt_py_tweak(PyObject *module, PyObject *args, PyObject *kwargs)
{
    static char *kwlist[] = {"tree", "enter", "tune", "activate", "leave", "run", "n_samples",
                             "sync", "min_depth", "max_depth", "tie_tolerance", "time_budget",
                             "dry_run", "config", "clock", "deactivate", "log", NULL};
    TtState *st = (TtState *)PyModule_GetState(module);
    PyObject *tree = NULL, *enter = NULL, *tune = NULL, *activate = NULL, *leave = NULL;
    PyObject *run = NULL, *n_obj = NULL, *sync = Py_None, *budget = Py_None;
    PyObject *config = Py_None, *clock = Py_None, *deactivate = Py_None;
    PyObject *log = Py_None; /* all borrowed */
    TtResult *res_obj = NULL;
    PyObject *result = NULL;
    Py_ssize_t n_samples = 0;
    tw_tweak_config cfg;
    tw_tweak_ops ops;
    tw_result *out = NULL;
    tw_error err;
    tw_code code;
    TtCall call;
    TtTweak tw;

    tt_call_init(&call, st, Py_None, Py_None);
    memset(&tw, 0, sizeof(tw));
    memset(&err, 0, sizeof(err));
    tw_tweak_config_default(&cfg);
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "O!|$OOOOOOOiidOpOOOO:tweak", kwlist,
                                     st->TreeType, &tree, &enter, &tune, &activate, &leave,
                                     &run, &n_obj, &sync, &cfg.min_depth, &cfg.max_depth,
                                     &cfg.tie_tolerance, &budget, &cfg.dry_run, &config, &clock,
                                     &deactivate, &log))
        goto cleanup;
    {
        /* keyword-only and required: PyArg_Parse* has no format for that */
        PyObject *required[] = {enter, tune, activate, leave, run, n_obj};
        const char *names[] = {"enter", "tune", "activate", "leave", "run", "n_samples"};
        size_t k;

        for (k = 0; k < sizeof(required) / sizeof(required[0]); k++) {
            if (required[k] == NULL) {
                PyErr_Format(PyExc_TypeError,
                             "tweak() missing required keyword argument '%s'", names[k]);
                goto cleanup;
            }
            if (k < 5 && tt_check_callable(required[k], names[k], 0) < 0)
                goto cleanup;
        }
    }
    if (PyBool_Check(n_obj) || !PyLong_Check(n_obj)) {
        PyErr_Format(PyExc_TypeError, "n_samples must be an int, not %.100s",
                     Py_TYPE(n_obj)->tp_name);
        goto cleanup;
    }
    n_samples = PyLong_AsSsize_t(n_obj);
    if ((n_samples == -1 && PyErr_Occurred()) || tt_check_n_samples(n_samples) < 0)
        goto cleanup;
    if (tt_check_callable(sync, "sync", 1) < 0 || tt_check_callable(clock, "clock", 1) < 0 ||
        tt_check_callable(deactivate, "deactivate", 1) < 0 || tt_check_callable(log, "log", 1) < 0)
        goto cleanup;
    if (cfg.min_depth < 0) {
        PyErr_Format(PyExc_ValueError, "min_depth must be >= 0, not %d", cfg.min_depth);
        goto cleanup;
    }
    if (!isfinite(cfg.tie_tolerance) || cfg.tie_tolerance < 0) {
        PyErr_SetString(PyExc_ValueError, "tie_tolerance must be a finite number >= 0");
        goto cleanup;
    }
    if (budget != Py_None) {
        if (tt_seconds_to_ns(budget, "time_budget", &cfg.time_budget_ns) < 0)
            goto cleanup;
        /* 0 ns would read as "no budget" to the engine; a budget of 0 s is one
         * that is used up before the first depth */
        if (cfg.time_budget_ns == 0)
            cfg.time_budget_ns = 1;
    }
    if (tt_config_from_dict(config, &cfg.measure) < 0)
        goto cleanup;

    tt_call_init(&call, st, clock, sync);
    call.log = log == Py_None ? NULL : Py_NewRef(log);
    call.host.log = tt_call_log;
    tw.call = &call;
    tw.enter = Py_NewRef(enter);
    tw.tune = Py_NewRef(tune);
    tw.activate = Py_NewRef(activate);
    tw.deactivate = deactivate == Py_None ? NULL : Py_NewRef(deactivate);
    tw.leave = Py_NewRef(leave);
    tw.run = Py_NewRef(run);
    tw.tree = Py_NewRef(tree);
    tw.model.call = &call;
    tw.model.run = tw.run;
    tw.model.build = NULL;
    memset(&ops, 0, sizeof(ops));
    ops.ctx = &tw;
    ops.enter = tt_tweak_enter;
    ops.tune = tt_tweak_tune;
    ops.activate = tt_tweak_activate;
    ops.deactivate = tw.deactivate != NULL ? tt_tweak_deactivate : NULL;
    ops.leave = tt_tweak_leave;
    tt_runner_init(&ops.model, &tw.model, (size_t)n_samples);

    code = tw_tweak_run(&call.host, ((TtTree *)tw.tree)->tree, &cfg, &ops, &out, &err);
    if (tt_call_check(&call, code, &err) < 0)
        goto cleanup;
    if ((res_obj = (TtResult *)st->ResultType->tp_alloc(st->ResultType, 0)) == NULL)
        goto cleanup;
    res_obj->result = out;
    res_obj->n_nodes = tw_tree_size(((TtTree *)tw.tree)->tree);
    out = NULL;
    result = (PyObject *)res_obj;
cleanup:
    tw_result_destroy(out);
    tt_call_release(&call);
    Py_XDECREF(tw.enter);
    Py_XDECREF(tw.tune);
    Py_XDECREF(tw.activate);
    Py_XDECREF(tw.deactivate);
    Py_XDECREF(tw.leave);
    Py_XDECREF(tw.run);
    Py_XDECREF(tw.tree);
    return result;
}

/* ================================================================ module */

int
tt_bindings_exec(PyObject *module, TtState *st)
{
    int rc = -1;

    st->TreeType = (PyTypeObject *)PyType_FromModuleAndSpec(module, &tt_tree_spec, NULL);
    if (st->TreeType == NULL)
        goto error;
    if (PyModule_AddObjectRef(module, "Tree", (PyObject *)st->TreeType) < 0)
        goto error;
    st->ResultType = (PyTypeObject *)PyType_FromModuleAndSpec(module, &tt_result_spec, NULL);
    if (st->ResultType == NULL)
        goto error;
    if (PyModule_AddObjectRef(module, "Result", (PyObject *)st->ResultType) < 0)
        goto error;
    rc = 0;
error:
    return rc;
}
