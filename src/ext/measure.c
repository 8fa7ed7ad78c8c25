/*
 * measure.c - the engine's calls seen from Python: measure, compare, choose
 * and tweak. Each parses its arguments, holds its own references to every
 * callable for the whole call (a callback may clear the caller's list), and
 * runs the engine through the trampolines of call.c.
 */
#include "measure.h"

#include "call.h"
#include "config.h"
#include "tree.h"

#include <math.h>
#include <string.h>

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
    result = tt_result_new(st, out, tw_tree_size(((TtTree *)tw.tree)->tree));
    out = NULL; /* stolen, even on failure */
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
