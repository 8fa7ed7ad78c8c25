/*
 * measure.c - the engine's measurements seen from Python: measure, compare and
 * choose, and the argument checks every engine binding shares. Each parses its
 * arguments, holds its own references to every callable for the whole call (a
 * callback may clear the caller's list), and runs the engine through the
 * trampolines of call.c.
 */
#include "measure.h"

#include "call.h"
#include "config.h"

#include <string.h>

/* ===================================================== argument checking */

/* 0 when obj is callable (or None and may_be_none); -1 with TypeError. */
int
tt_check_callable(PyObject *obj, const char *what, int may_be_none)
{
    if ((may_be_none && obj == Py_None) || PyCallable_Check(obj))
        return 0;
    PyErr_Format(PyExc_TypeError, "%s must be callable%s, not %.100s", what,
                 may_be_none ? " or None" : "", Py_TYPE(obj)->tp_name);
    return -1;
}

int
tt_check_n_samples(Py_ssize_t n)
{
    if (n >= 0)
        return 0;
    PyErr_Format(PyExc_ValueError, "n_samples must be >= 0, not %zd", n);
    return -1;
}

/* The arguments measure, compare and choose share, checked in one order so
 * that the three name the same bad argument first. */
int
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

/* ======================================================= measure_paired */

/* A paired rounds count from `value` into *out; -1 with ValueError naming the
 * value as it was given when it is no count of rounds at all (negative, past
 * what the engine's config holds), so that no message names a value the caller
 * never gave. The rule on the range is the engine's (tw_paired_config_check). */
static int
tt_paired_rounds_read(PyObject *value, const char *name, uint32_t *out)
{
    long long n;
    int overflow = 0;

    n = PyLong_AsLongLongAndOverflow(value, &overflow);
    if (n == -1 && !overflow && PyErr_Occurred())
        return -1;
    if (overflow || n < 0 || n > (long long)UINT32_MAX) {
        PyErr_Format(PyExc_ValueError, "paired %s (%R) is not a number of rounds: give a whole "
                     "number from %u to %u", name, value, (unsigned)TW_PAIRED_ROUNDS_MIN,
                     (unsigned)TW_PAIRED_ROUNDS_MAX);
        return -1;
    }
    *out = (uint32_t)n;
    return 0;
}

/* The paired rounds' settings from rounds_min, rounds_max and width (each None:
 * the engine's default), checked by the engine. -1 with ValueError. */
static int
tt_paired_config_read(PyObject *rounds_min, PyObject *rounds_max, PyObject *width,
                      tw_paired_config *pcfg)
{
    tw_error err;

    memset(&err, 0, sizeof(err));
    tw_paired_config_default(pcfg);
    if (rounds_min != Py_None &&
        tt_paired_rounds_read(rounds_min, "rounds_min", &pcfg->rounds_min) < 0)
        return -1;
    if (rounds_max != Py_None &&
        tt_paired_rounds_read(rounds_max, "rounds_max", &pcfg->rounds_max) < 0)
        return -1;
    if (width != Py_None && (pcfg->width = PyFloat_AsDouble(width)) == -1.0 && PyErr_Occurred())
        return -1;
    if (tw_paired_config_check(pcfg, &err) != TW_OK) {
        PyErr_SetString(PyExc_ValueError, err.msg);
        return -1;
    }
    return 0;
}

PyObject *
tt_py_measure_paired(PyObject *module, PyObject *args, PyObject *kwargs)
{
    static char *kwlist[] = {"first", "second", "n_samples", "sync", "config", "clock",
                             "rounds_min", "rounds_max", "width", NULL};
    PyObject *runs[2], *sync = Py_None, *config = Py_None, *clock = Py_None; /* borrowed */
    PyObject *rounds_min = Py_None, *rounds_max = Py_None, *width = Py_None; /* borrowed */
    PyObject *held[2] = {NULL, NULL}; /* new references: the runs, for the whole call */
    PyObject *result = NULL;
    Py_ssize_t n_samples;
    tw_measure_config cfg;
    tw_paired_config pcfg;
    tw_runner runners[2];
    tw_paired paired;
    tw_error err;
    tw_code code;
    TtCall call;
    TtRun ctxs[2];
    int i;

    tt_call_init(&call, (TtState *)PyModule_GetState(module), Py_None, Py_None);
    memset(&err, 0, sizeof(err));
    memset(&paired, 0, sizeof(paired));
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "OOn|$OOOOOO:measure_paired", kwlist, &runs[0],
                                     &runs[1], &n_samples, &sync, &config, &clock, &rounds_min,
                                     &rounds_max, &width))
        goto cleanup;
    if (tt_check_callable(runs[0], "first", 0) < 0 || tt_check_callable(runs[1], "second", 0) < 0 ||
        tt_check_measure_args(sync, clock, n_samples, config, &cfg) < 0 ||
        tt_paired_config_read(rounds_min, rounds_max, width, &pcfg) < 0)
        goto cleanup;
    tt_call_init(&call, call.st, clock, sync);
    for (i = 0; i < 2; i++) {
        held[i] = Py_NewRef(runs[i]);
        ctxs[i].call = &call;
        ctxs[i].run = held[i];
        ctxs[i].build = NULL;
        tt_runner_init(&runners[i], &ctxs[i], (size_t)n_samples);
    }
    code = tw_measure_paired(&call.host, runners, &cfg, &pcfg, &paired, &err);
    if (tt_call_check(&call, code, &err) < 0)
        goto cleanup;
    result = Py_BuildValue("{s:d,s:d,s:d,s:I,s:I}", "ratio", paired.ratio, "low", paired.low,
                           "high", paired.high, "rounds", paired.rounds, "wins", paired.wins);
cleanup:
    tt_call_release(&call);
    Py_XDECREF(held[0]);
    Py_XDECREF(held[1]);
    return result;
}

/* =============================================================== choose */

/* The strategy named `kind`, by the engine's own names; -1 with ValueError. */
int
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
                           tw_candidate_state_name(report->state), "error",
                           report->state == TW_CAND_FAILED ? report->msg : "", "stats", stats);
cleanup:
    Py_XDECREF(stats);
    return result;
}

/* Candidate i of choose's own tuple `cands`, a (name, build, run) tuple, read
 * into the engine's *candidate and its context *ctx (for `call`): the name,
 * build and run are borrowed from the tuple, which cands holds. -1 on an error
 * that says which candidate and what it must be. */
static int
tt_candidate_read(PyObject *cands, Py_ssize_t i, TtCall *call, Py_ssize_t n_samples,
                  tw_candidate *candidate, TtRun *ctx)
{
    PyObject *item = PySequence_Fast_GET_ITEM(cands, i); /* borrowed */
    PyObject *name;                                       /* borrowed */
    int rc = -1;

    if (!PyTuple_Check(item) || PyTuple_GET_SIZE(item) != 3) {
        PyErr_Format(PyExc_TypeError, "candidates[%zd] must be a (name, build, run) tuple", i);
        goto cleanup;
    }
    name = PyTuple_GET_ITEM(item, 0);
    if (!PyUnicode_Check(name)) {
        PyErr_Format(PyExc_TypeError, "candidates[%zd]: the name must be a str", i);
        goto cleanup;
    }
    if ((candidate->name = PyUnicode_AsUTF8(name)) == NULL)
        goto cleanup;
    ctx->call = call;
    ctx->build = PyTuple_GET_ITEM(item, 1);
    ctx->run = PyTuple_GET_ITEM(item, 2);
    if (tt_check_callable(ctx->build, "a candidate's build", 0) < 0 ||
        tt_check_callable(ctx->run, "a candidate's run", 0) < 0)
        goto cleanup;
    candidate->ctx = ctx;
    candidate->build = tt_run_build;
    tt_runner_init(&candidate->runner, ctx, (size_t)n_samples);
    rc = 0;
cleanup:
    return rc;
}

/* The engine's reports of the candidates of `cands` as a list of dicts, in
 * their order. New reference. */
static PyObject *
tt_reports_list(PyObject *cands, const tw_candidate_report *reports)
{
    Py_ssize_t i, n = PySequence_Fast_GET_SIZE(cands);
    PyObject *list = PyList_New(n);
    PyObject *result = NULL;

    if (list == NULL)
        goto cleanup;
    for (i = 0; i < n; i++) {
        PyObject *name = PyTuple_GET_ITEM(PySequence_Fast_GET_ITEM(cands, i), 0);
        PyObject *d = tt_report_to_dict(name, &reports[i]);
        if (d == NULL)
            goto cleanup;
        PyList_SET_ITEM(list, i, d);
    }
    result = Py_NewRef(list);
cleanup:
    Py_XDECREF(list);
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
    for (i = 0; i < n; i++)
        if (tt_candidate_read(cands, i, &call, n_samples, &candidates[i], &ctxs[i]) < 0)
            goto cleanup;
    code = tw_strategy_choose(&call.host, strategy, candidates, (size_t)n, &cfg, &chosen,
                              reports, &err);
    if (tt_call_check(&call, code, &err) < 0)
        goto cleanup;
    if ((reports_list = tt_reports_list(cands, reports)) == NULL)
        goto cleanup;
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
