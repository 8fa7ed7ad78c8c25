/*
 * search.c - the engine's searches seen from Python: tune_module (one module's
 * search over its signature groups and candidates), tweak (the depth search)
 * and the check of a tweak's settings, with the trampolines from the engine's
 * module and tweak callbacks into Python. Each parses its arguments, holds its
 * own references to every callable for the whole call (a callback may clear the
 * caller's list or rebind a method), and runs the engine through call.c.
 */
#include "search.h"

#include "call.h"
#include "config.h"
#include "measure.h"
#include "result.h"
#include "tree.h"

#include <limits.h>
#include <math.h>
#include <string.h>

/* ======================================================== module search */

/* The module search's callbacks: the bound methods of a `modules` object,
 * fetched once and held for the whole call (a callback may rebind them). */
typedef struct TtModules {
    TtCall *call;
    PyObject *groups, *group, *build, *run, *commit; /* new references */
    PyObject *info;        /* new reference: group()'s answer, held while its
                            * strings are the engine's */
    const char **names;    /* PyMem: the names of the group in progress */
} TtModules;

static const char *const tt_module_methods[] = {"groups", "group", "build", "run", "commit"};

/* Fetches the callbacks of `modules`; -1 with TypeError naming the one that is
 * missing or not callable. */
static int
tt_modules_init(TtModules *m, TtCall *call, PyObject *modules)
{
    PyObject **slots[] = {&m->groups, &m->group, &m->build, &m->run, &m->commit};
    size_t k;

    memset(m, 0, sizeof(*m));
    m->call = call;
    for (k = 0; k < sizeof(slots) / sizeof(slots[0]); k++) {
        *slots[k] = PyObject_GetAttrString(modules, tt_module_methods[k]);
        if (*slots[k] == NULL || !PyCallable_Check(*slots[k])) {
            PyErr_Clear();
            PyErr_Format(PyExc_TypeError,
                         "modules must have callable groups, group, build, run and commit "
                         "methods; %.100s has no callable %s",
                         Py_TYPE(modules)->tp_name, tt_module_methods[k]);
            return -1;
        }
    }
    return 0;
}

static void
tt_modules_release(TtModules *m)
{
    Py_CLEAR(m->groups);
    Py_CLEAR(m->group);
    Py_CLEAR(m->build);
    Py_CLEAR(m->run);
    Py_CLEAR(m->commit);
    Py_CLEAR(m->info);
    PyMem_Free(m->names);
    m->names = NULL;
}

/* func(ints[0], ..., ints[n - 1]). always: even after an interrupt (commit). */
static tw_code
tt_call_invoke_ints(TtCall *call, PyObject *func, const Py_ssize_t *ints, size_t n, int always,
                    tw_error *err)
{
    PyObject *args[4] = {NULL, NULL, NULL, NULL}; /* new references */
    tw_code code;
    size_t i;

    if (TT_UNLIKELY(call->stash != NULL) && !always) {
        code = tw_error_set(err, TW_EINTERRUPT, "interrupted");
        goto cleanup;
    }
    for (i = 0; i < n; i++) {
        if ((args[i] = PyLong_FromSsize_t(ints[i])) == NULL) {
            code = tt_call_fail(call, err);
            goto cleanup;
        }
    }
    code = tt_call_invoke(call, func, args, n, always, err);
cleanup:
    for (i = 0; i < n; i++)
        Py_XDECREF(args[i]);
    return code;
}

static tw_code
tt_modules_groups(void *ctx, size_t node, size_t *count, tw_error *err)
{
    TtModules *m = (TtModules *)ctx;
    PyObject *arg = NULL, *res = NULL; /* new references */
    Py_ssize_t n;
    tw_code code = TW_OK;

    if (TT_UNLIKELY(m->call->stash != NULL)) {
        code = tw_error_set(err, TW_EINTERRUPT, "interrupted");
        goto cleanup;
    }
    if ((arg = PyLong_FromSize_t(node)) == NULL ||
        (res = PyObject_Vectorcall(m->groups, &arg, 1, NULL)) == NULL)
        goto fail;
    n = PyLong_Check(res) ? PyLong_AsSsize_t(res) : -1;
    if (n < 0) {
        if (!PyErr_Occurred())
            PyErr_Format(PyExc_TypeError, "groups() must return an int >= 0, not %R", res);
        goto fail;
    }
    *count = (size_t)n;
    goto cleanup;
fail:
    code = tt_call_fail(m->call, err);
cleanup:
    Py_XDECREF(arg);
    Py_XDECREF(res);
    return code;
}

/* info from group()'s (text, kind, names, n_samples); -1 with an exception. */
static int
tt_group_info_from(TtModules *m, PyObject *res, tw_group_info *info)
{
    PyObject *names;  /* borrowed from m->info */
    Py_ssize_t n, i, n_samples;
    tw_strategy_kind kind;

    if (!PyTuple_Check(res) || PyTuple_GET_SIZE(res) != 4 ||
        !PyUnicode_Check(PyTuple_GET_ITEM(res, 0)) || !PyTuple_Check(PyTuple_GET_ITEM(res, 2))) {
        PyErr_Format(PyExc_TypeError,
                     "group() must return (text: str, kind: str, names: tuple of str, "
                     "n_samples: int), not %.100s", Py_TYPE(res)->tp_name);
        return -1;
    }
    if (tt_strategy_parse(PyTuple_GET_ITEM(res, 1), &kind) < 0)
        return -1;
    n_samples = PyLong_Check(PyTuple_GET_ITEM(res, 3)) ? PyLong_AsSsize_t(PyTuple_GET_ITEM(res, 3))
                                                        : -1;
    if (n_samples < 0) {
        if (!PyErr_Occurred())
            PyErr_SetString(PyExc_TypeError, "group(): n_samples must be an int >= 0");
        return -1;
    }
    names = PyTuple_GET_ITEM(res, 2);
    n = PyTuple_GET_SIZE(names);
    PyMem_Free(m->names);
    if ((m->names = PyMem_Calloc((size_t)n + 1, sizeof(const char *))) == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    for (i = 0; i < n; i++) {
        PyObject *name = PyTuple_GET_ITEM(names, i);

        if (!PyUnicode_Check(name)) {
            PyErr_Format(PyExc_TypeError, "group(): names[%zd] must be a str", i);
            return -1;
        }
        /* cached in the str, which m->info holds until the next group() */
        if ((m->names[i] = PyUnicode_AsUTF8(name)) == NULL)
            return -1;
    }
    if ((info->text = PyUnicode_AsUTF8(PyTuple_GET_ITEM(res, 0))) == NULL)
        return -1;
    info->kind = kind;
    info->n_candidates = (size_t)n;
    info->names = m->names;
    info->n_samples = (size_t)n_samples;
    return 0;
}

static tw_code
tt_modules_group(void *ctx, size_t node, size_t group, tw_group_info *info, tw_error *err)
{
    TtModules *m = (TtModules *)ctx;
    PyObject *args[2] = {NULL, NULL}; /* new references */
    PyObject *res = NULL;
    tw_code code = TW_OK;

    if (TT_UNLIKELY(m->call->stash != NULL)) {
        code = tw_error_set(err, TW_EINTERRUPT, "interrupted");
        goto cleanup;
    }
    if ((args[0] = PyLong_FromSize_t(node)) == NULL ||
        (args[1] = PyLong_FromSize_t(group)) == NULL ||
        (res = PyObject_Vectorcall(m->group, args, 2, NULL)) == NULL)
        goto fail;
    Py_XSETREF(m->info, res); /* the engine copies the strings before the next call */
    res = NULL;
    if (tt_group_info_from(m, m->info, info) < 0) {
        memset(info, 0, sizeof(*info));
        goto fail;
    }
    goto cleanup;
fail:
    code = tt_call_fail(m->call, err);
cleanup:
    Py_XDECREF(args[0]);
    Py_XDECREF(args[1]);
    Py_XDECREF(res);
    return code;
}

static tw_code
tt_modules_build(void *ctx, size_t node, size_t group, size_t cand, tw_error *err)
{
    TtModules *m = (TtModules *)ctx;
    Py_ssize_t ints[3] = {(Py_ssize_t)node, (Py_ssize_t)group, (Py_ssize_t)cand};

    return tt_call_invoke_ints(m->call, m->build, ints, 3, 0, err);
}

static tw_code
tt_modules_run(void *ctx, size_t node, size_t group, size_t cand, size_t sample, tw_error *err)
{
    TtModules *m = (TtModules *)ctx;
    Py_ssize_t ints[4] = {(Py_ssize_t)node, (Py_ssize_t)group, (Py_ssize_t)cand,
                          (Py_ssize_t)sample};

    return tt_call_invoke_ints(m->call, m->run, ints, 4, 0, err);
}

static tw_code
tt_modules_sync(void *ctx, tw_error *err)
{
    TtModules *m = (TtModules *)ctx;

    return tt_call_invoke(m->call, m->call->sync, NULL, 0, 0, err);
}

static tw_code
tt_modules_commit(void *ctx, size_t node, size_t group, long chosen, tw_error *err)
{
    TtModules *m = (TtModules *)ctx;
    Py_ssize_t ints[3] = {(Py_ssize_t)node, (Py_ssize_t)group, (Py_ssize_t)chosen};

    /* even after an interrupt: commit is where the host releases the group */
    return tt_call_invoke_ints(m->call, m->commit, ints, 3, 1, err);
}

static void
tt_module_ops_init(tw_module_ops *ops, TtModules *m)
{
    ops->ctx = m;
    ops->groups = tt_modules_groups;
    ops->group = tt_modules_group;
    ops->build = tt_modules_build;
    ops->run = tt_modules_run;
    ops->sync = m->call->sync != NULL ? tt_modules_sync : NULL;
    ops->commit = tt_modules_commit;
}

PyObject *
tt_py_tune_module(PyObject *module, PyObject *args, PyObject *kwargs)
{
    static char *kwlist[] = {"modules", "node", "path", "sync", "config", "clock", NULL};
    PyObject *modules, *sync = Py_None, *config = Py_None, *clock = Py_None; /* borrowed */
    PyObject *result = NULL;
    const char *path = "";
    Py_ssize_t node;
    tw_measure_config cfg;
    tw_module_ops ops;
    tw_module_result *out = NULL;
    tw_error err;
    tw_code code;
    TtModules m;
    TtCall call;

    tt_call_init(&call, (TtState *)PyModule_GetState(module), Py_None, Py_None);
    memset(&m, 0, sizeof(m));
    memset(&err, 0, sizeof(err));
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "On|$sOOO:tune_module", kwlist, &modules,
                                     &node, &path, &sync, &config, &clock))
        goto cleanup;
    if (node < 0) {
        PyErr_Format(PyExc_ValueError, "node must be >= 0, not %zd", node);
        goto cleanup;
    }
    if (tt_check_measure_args(sync, clock, 0, config, &cfg) < 0)
        goto cleanup;
    tt_call_init(&call, call.st, clock, sync);
    if (tt_modules_init(&m, &call, modules) < 0)
        goto cleanup;
    tt_module_ops_init(&ops, &m);
    code = tw_tune_module(&call.host, &ops, (size_t)node, path, &cfg, &out, &err);
    if (tt_call_check(&call, code, &err) < 0)
        goto cleanup;
    result = tt_module_result_to_dict(out);
cleanup:
    tw_module_result_destroy(out);
    tt_modules_release(&m);
    tt_call_release(&call);
    return result;
}

/* ============================================================ arguments */

/* The Python forms of a tweak's settings into cfg (which holds the defaults):
 * what cannot be said in the engine's types is refused here; the rules on the
 * values are the engine's (tw_tweak_config_check), applied after. Each
 * argument is borrowed and may be NULL (not given). -1 with ValueError. */
static int
tt_tweak_settings(PyObject *min_depth, PyObject *max_depth, PyObject *tie, PyObject *budget,
                  tw_tweak_config *cfg)
{
    long v;
    double d;

    if (min_depth != NULL) {
        v = PyLong_Check(min_depth) ? PyLong_AsLong(min_depth) : -1;
        if ((v == -1 && PyErr_Occurred()) || !PyLong_Check(min_depth) || v < INT_MIN ||
            v > INT_MAX) {
            PyErr_Clear();
            PyErr_Format(PyExc_ValueError, "min_depth must be an int >= 0, got %R", min_depth);
            return -1;
        }
        cfg->min_depth = (int)v;
    }
    if (max_depth != NULL) {
        v = max_depth == Py_None ? -1 : PyLong_Check(max_depth) ? PyLong_AsLong(max_depth) : -2;
        if (max_depth != Py_None && (v < 0 || v > INT_MAX)) {
            PyErr_Clear();
            PyErr_Format(PyExc_ValueError, "max_depth must be an int >= 0 or None, got %R",
                         max_depth);
            return -1;
        }
        cfg->max_depth = (int)v;
    }
    if (tie != NULL) {
        d = PyLong_Check(tie) || PyFloat_Check(tie) ? PyFloat_AsDouble(tie) : -1.0;
        if (!(PyLong_Check(tie) || PyFloat_Check(tie)) || (d == -1.0 && PyErr_Occurred())) {
            PyErr_Clear();
            PyErr_Format(PyExc_ValueError,
                         "tie_tolerance must be a fraction >= 0 (0.02 is 2 %%), got %R", tie);
            return -1;
        }
        cfg->tie_tolerance = d;
    }
    if (budget != NULL && budget != Py_None) {
        d = PyLong_Check(budget) || PyFloat_Check(budget) ? PyFloat_AsDouble(budget) : NAN;
        if (!(d >= 0)) { /* not a number, negative or NaN */
            PyErr_Clear();
            PyErr_Format(PyExc_ValueError,
                         "time_budget must be a number of seconds >= 0 or None, got %R", budget);
            return -1;
        }
        if (PyBool_Check(budget)) {
            PyObject *f = PyFloat_FromDouble(d); /* new reference: True is 1 second */
            int rc = f == NULL ? -1 : tt_seconds_to_ns(f, "time_budget", &cfg->time_budget_ns);
            Py_XDECREF(f);
            if (rc < 0)
                return -1;
        } else if (tt_seconds_to_ns(budget, "time_budget", &cfg->time_budget_ns) < 0) {
            return -1;
        }
        /* 0 ns would read as "no budget" to the engine; a budget of 0 s is one
         * that is used up before the first depth */
        if (cfg->time_budget_ns == 0)
            cfg->time_budget_ns = 1;
    }
    return 0;
}

/* cfg from the defaults and the settings, checked by the engine's rules. */
static int
tt_tweak_config(TtState *st, PyObject *min_depth, PyObject *max_depth, PyObject *tie,
                PyObject *budget, int dry_run, PyObject *config, tw_tweak_config *cfg)
{
    tw_error err;
    tw_code code;

    memset(&err, 0, sizeof(err));
    tw_tweak_config_default(cfg);
    if (tt_tweak_settings(min_depth, max_depth, tie, budget, cfg) < 0 ||
        tt_config_from_dict(config, &cfg->measure) < 0)
        return -1;
    cfg->dry_run = dry_run;
    code = tw_tweak_config_check(cfg, &err);
    if (code != TW_OK) {
        tt_raise_code(st, code, err.msg, NULL);
        return -1;
    }
    return 0;
}

PyObject *
tt_py_check_tweak_config(PyObject *module, PyObject *args, PyObject *kwargs)
{
    static char *kwlist[] = {"min_depth", "max_depth", "tie_tolerance", "time_budget", "config",
                             NULL};
    PyObject *min_depth = NULL, *max_depth = NULL, *tie = NULL, *budget = NULL;
    PyObject *config = Py_None; /* all borrowed */
    tw_tweak_config cfg;

    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "|$OOOOO:check_tweak_config", kwlist,
                                     &min_depth, &max_depth, &tie, &budget, &config))
        return NULL;
    if (tt_tweak_config((TtState *)PyModule_GetState(module), min_depth, max_depth, tie, budget,
                        0, config, &cfg) < 0)
        return NULL;
    Py_RETURN_NONE;
}

/* ================================================================ tweak */

typedef struct TtTweak {
    TtCall *call;
    /* new references, held for the whole call; deactivate may be NULL */
    PyObject *enter, *activate, *deactivate, *leave;
    PyObject *run;
    PyObject *tree;
    TtModules modules;
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
    static char *kwlist[] = {"tree", "enter", "modules", "activate", "leave", "run", "n_samples",
                             "sync", "min_depth", "max_depth", "tie_tolerance", "time_budget",
                             "dry_run", "config", "clock", "deactivate", "log", NULL};
    TtState *st = (TtState *)PyModule_GetState(module);
    PyObject *tree = NULL, *enter = NULL, *modules = NULL, *activate = NULL, *leave = NULL;
    PyObject *run = NULL, *n_obj = NULL, *sync = Py_None, *min_depth = NULL, *max_depth = NULL;
    PyObject *tie = NULL, *budget = NULL, *config = Py_None, *clock = Py_None;
    PyObject *deactivate = Py_None, *log = Py_None; /* all borrowed */
    PyObject *result = NULL;
    Py_ssize_t n_samples = 0;
    int dry_run = 0;
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
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "O!|$OOOOOOOOOOOpOOOO:tweak", kwlist,
                                     st->TreeType, &tree, &enter, &modules, &activate, &leave,
                                     &run, &n_obj, &sync, &min_depth, &max_depth, &tie, &budget,
                                     &dry_run, &config, &clock, &deactivate, &log))
        goto cleanup;
    {
        /* keyword-only and required: PyArg_Parse* has no format for that */
        PyObject *required[] = {enter, modules, activate, leave, run, n_obj};
        const char *names[] = {"enter", "modules", "activate", "leave", "run", "n_samples"};
        size_t k;

        for (k = 0; k < sizeof(required) / sizeof(required[0]); k++) {
            if (required[k] == NULL) {
                PyErr_Format(PyExc_TypeError,
                             "tweak() missing required keyword argument '%s'", names[k]);
                goto cleanup;
            }
            if (k != 1 && k < 5 && tt_check_callable(required[k], names[k], 0) < 0)
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
    if (tt_tweak_config(st, min_depth, max_depth, tie, budget, dry_run, config, &cfg) < 0)
        goto cleanup;

    tt_call_init(&call, st, clock, sync);
    call.log = log == Py_None ? NULL : Py_NewRef(log);
    call.host.log = tt_call_log;
    if (tt_modules_init(&tw.modules, &call, modules) < 0)
        goto cleanup;
    tw.call = &call;
    tw.enter = Py_NewRef(enter);
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
    tt_module_ops_init(&ops.modules, &tw.modules);
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
    tt_modules_release(&tw.modules);
    tt_call_release(&call);
    Py_XDECREF(tw.enter);
    Py_XDECREF(tw.activate);
    Py_XDECREF(tw.deactivate);
    Py_XDECREF(tw.leave);
    Py_XDECREF(tw.run);
    Py_XDECREF(tw.tree);
    return result;
}
