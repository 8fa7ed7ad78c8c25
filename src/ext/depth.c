/*
 * depth.c - the engine's depth search seen from Python: tweak, and the check of
 * a tweak's settings, with the trampolines from the engine's tweak callbacks
 * into Python (the module callbacks are search.c's). tweak parses its
 * arguments, holds its own references to every callable for the whole call (a
 * callback may clear the caller's list or rebind a method), and runs the engine
 * through call.c.
 */
#include "depth.h"

#include "call.h"
#include "config.h"
#include "measure.h"
#include "result.h"
#include "search.h"
#include "tree.h"

#include <limits.h>
#include <math.h>
#include <string.h>

/* ============================================================ arguments */

/* The Python forms of a tweak's settings into cfg (which holds the defaults):
 * what cannot be said in the engine's types is refused here; the rules on the
 * values are the engine's (tw_tweak_config_check), applied after. Each
 * argument is borrowed and may be NULL (not given). -1 with ValueError. */
/* A budget in seconds (a number >= 0) into *ns; 0 s becomes 1 ns, since 0 ns
 * reads as "no budget" to the engine: a budget of 0 s is used up at once. */
static int
tt_budget_seconds(PyObject *budget, const char *name, uint64_t *ns)
{
    double d = PyLong_Check(budget) || PyFloat_Check(budget) ? PyFloat_AsDouble(budget) : NAN;

    if (!(d >= 0)) { /* not a number, negative or NaN */
        PyErr_Clear();
        PyErr_Format(PyExc_ValueError, "%s must be a number of seconds >= 0 or None, got %R",
                     name, budget);
        return -1;
    }
    if (PyBool_Check(budget)) {
        PyObject *f = PyFloat_FromDouble(d); /* new reference: True is 1 second */
        int rc = f == NULL ? -1 : tt_seconds_to_ns(f, name, ns);
        Py_XDECREF(f);
        if (rc < 0)
            return -1;
    } else if (tt_seconds_to_ns(budget, name, ns) < 0) {
        return -1;
    }
    if (*ns == 0)
        *ns = 1;
    return 0;
}

/* The busy budget: absent, the engine's default; None, none. */
static int
tt_busy_budget(PyObject *busy, tw_tweak_config *cfg)
{
    if (busy == NULL)
        return 0;
    if (busy == Py_None) {
        cfg->busy_budget_ns = 0;
        return 0;
    }
    return tt_budget_seconds(busy, "busy_budget", &cfg->busy_budget_ns);
}

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
    if (budget != NULL && budget != Py_None &&
        tt_budget_seconds(budget, "time_budget", &cfg->time_budget_ns) < 0)
        return -1;
    return 0;
}

/* cfg from the defaults and the settings, checked by the engine's rules. */
static int
tt_tweak_config(TtState *st, PyObject *min_depth, PyObject *max_depth, PyObject *tie,
                PyObject *budget, PyObject *busy, int dry_run, PyObject *config,
                tw_tweak_config *cfg)
{
    tw_error err;
    tw_code code;

    memset(&err, 0, sizeof(err));
    tw_tweak_config_default(cfg);
    if (tt_tweak_settings(min_depth, max_depth, tie, budget, cfg) < 0 ||
        tt_busy_budget(busy, cfg) < 0 || tt_config_from_dict(config, &cfg->measure) < 0)
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
    PyObject *seconds, *deepest; /* new references, given to the dict */
    tw_tweak_config cfg;

    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "|$OOOOO:check_tweak_config", kwlist,
                                     &min_depth, &max_depth, &tie, &budget, &config))
        return NULL;
    if (tt_tweak_config((TtState *)PyModule_GetState(module), min_depth, max_depth, tie, budget,
                        NULL, 0, config, &cfg) < 0)
        return NULL;
    /* the settings as the engine reads them: the one value a tweak hashes and passes on */
    if (budget == NULL || budget == Py_None)
        seconds = Py_NewRef(Py_None);
    else if ((seconds = PyNumber_Float(budget)) == NULL)
        return NULL;
    if (cfg.max_depth < 0)
        deepest = Py_NewRef(Py_None);
    else if ((deepest = PyLong_FromLong(cfg.max_depth)) == NULL) {
        Py_DECREF(seconds);
        return NULL;
    }
    return Py_BuildValue("{s:i,s:N,s:d,s:N}", "min_depth", cfg.min_depth, "max_depth", deepest,
                         "tie_tolerance", cfg.tie_tolerance, "time_budget", seconds);
}

/* ================================================================ tweak */

typedef struct TtTweak {
    TtCall *call;
    /* new references, held for the whole call; deactivate may be NULL */
    PyObject *enter, *activate, *deactivate, *leave;
    PyObject *load; /* may be NULL: the machine's load is unknown */
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

/* load(): None (unknown) or (others, capacity), two running totals of
 * CPU-seconds (see tw_load). An Exception, or another answer, counts as unknown; an
 * interrupt stops the tweak. */
static tw_code
tt_tweak_load(void *ctx, tw_load *out, tw_error *err)
{
    TtTweak *tw = (TtTweak *)ctx;
    PyObject *res = NULL; /* new reference */
    double others, capacity;
    tw_code code = TW_OK;

    memset(out, 0, sizeof(*out));
    if (TT_UNLIKELY(tw->call->stash != NULL)) {
        code = tw_error_set(err, TW_EINTERRUPT, "interrupted");
        goto cleanup;
    }
    res = PyObject_CallNoArgs(tw->load);
    if (res == NULL) {
        if (PyErr_ExceptionMatches(PyExc_Exception)) {
            PyErr_Clear(); /* the load is unknown; the tweak goes on */
            goto cleanup;
        }
        code = tt_call_fail(tw->call, err);
        goto cleanup;
    }
    if (!PyTuple_Check(res) || PyTuple_GET_SIZE(res) != 2)
        goto cleanup;
    others = PyFloat_AsDouble(PyTuple_GET_ITEM(res, 0));
    capacity = PyFloat_AsDouble(PyTuple_GET_ITEM(res, 1));
    if (PyErr_Occurred()) {
        PyErr_Clear();
        goto cleanup;
    }
    out->known = 1;
    out->others = others;
    out->capacity = capacity;
cleanup:
    Py_XDECREF(res);
    return code;
}

/* Checks tweak's arguments that PyArg_Parse* cannot: the required keywords
 * given (`required`: enter, modules, activate, leave, run, n_samples; the
 * callbacks among them callable), n_samples an int in range (*n_samples), the
 * optional callbacks (`optional`: sync, clock, deactivate, log, load) None or
 * callable. -1 on an error that names the argument. */
static int
tt_tweak_check_args(PyObject *const *required, PyObject *const *optional, Py_ssize_t *n_samples)
{
    static const char *names[] = {"enter", "modules", "activate", "leave", "run", "n_samples"};
    static const char *optional_names[] = {"sync", "clock", "deactivate", "log", "load"};
    PyObject *n_obj = required[5];
    size_t k;
    int rc = -1;

    /* keyword-only and required: PyArg_Parse* has no format for that */
    for (k = 0; k < 6; k++) {
        if (required[k] == NULL) {
            PyErr_Format(PyExc_TypeError,
                         "tweak() missing required keyword argument '%s'", names[k]);
            goto cleanup;
        }
        if (k != 1 && k < 5 && tt_check_callable(required[k], names[k], 0) < 0)
            goto cleanup;
    }
    if (PyBool_Check(n_obj) || !PyLong_Check(n_obj)) {
        PyErr_Format(PyExc_TypeError, "n_samples must be an int, not %.100s",
                     Py_TYPE(n_obj)->tp_name);
        goto cleanup;
    }
    *n_samples = PyLong_AsSsize_t(n_obj);
    if ((*n_samples == -1 && PyErr_Occurred()) || tt_check_n_samples(*n_samples) < 0)
        goto cleanup;
    for (k = 0; k < 5; k++)
        if (tt_check_callable(optional[k], optional_names[k], 1) < 0)
            goto cleanup;
    rc = 0;
cleanup:
    return rc;
}

/* The engine's tweak callbacks for `tw`, whose references are set; the
 * optional ones only when tw has them. */
static void
tt_tweak_ops_init(tw_tweak_ops *ops, TtTweak *tw, Py_ssize_t n_samples)
{
    memset(ops, 0, sizeof(*ops));
    ops->ctx = tw;
    ops->enter = tt_tweak_enter;
    tt_module_ops_init(&ops->modules, &tw->modules);
    ops->activate = tt_tweak_activate;
    ops->deactivate = tw->deactivate != NULL ? tt_tweak_deactivate : NULL;
    ops->leave = tt_tweak_leave;
    ops->load = tw->load != NULL ? tt_tweak_load : NULL;
    tt_runner_init(&ops->model, &tw->model, (size_t)n_samples);
}

PyObject *
tt_py_tweak(PyObject *module, PyObject *args, PyObject *kwargs)
{
    static char *kwlist[] = {"tree", "enter", "modules", "activate", "leave", "run", "n_samples",
                             "sync", "min_depth", "max_depth", "tie_tolerance", "time_budget",
                             "dry_run", "config", "clock", "deactivate", "log", "load",
                             "busy_budget", NULL};
    TtState *st = (TtState *)PyModule_GetState(module);
    PyObject *tree = NULL, *enter = NULL, *modules = NULL, *activate = NULL, *leave = NULL;
    PyObject *run = NULL, *n_obj = NULL, *sync = Py_None, *min_depth = NULL, *max_depth = NULL;
    PyObject *tie = NULL, *budget = NULL, *config = Py_None, *clock = Py_None;
    PyObject *deactivate = Py_None, *log = Py_None, *load = Py_None; /* all borrowed */
    PyObject *busy = NULL;                                          /* borrowed */
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
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "O!|$OOOOOOOOOOOpOOOOOO:tweak", kwlist,
                                     st->TreeType, &tree, &enter, &modules, &activate, &leave,
                                     &run, &n_obj, &sync, &min_depth, &max_depth, &tie, &budget,
                                     &dry_run, &config, &clock, &deactivate, &log, &load,
                                     &busy))
        goto cleanup;
    {
        PyObject *required[] = {enter, modules, activate, leave, run, n_obj};
        PyObject *optional[] = {sync, clock, deactivate, log, load};

        if (tt_tweak_check_args(required, optional, &n_samples) < 0)
            goto cleanup;
    }
    if (tt_tweak_config(st, min_depth, max_depth, tie, budget, busy, dry_run, config, &cfg) < 0)
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
    tw.load = load == Py_None ? NULL : Py_NewRef(load);
    tw.run = Py_NewRef(run);
    tw.tree = Py_NewRef(tree);
    tw.model.call = &call;
    tw.model.run = tw.run;
    tw.model.build = NULL;
    tt_tweak_ops_init(&ops, &tw, n_samples);

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
    Py_XDECREF(tw.load);
    Py_XDECREF(tw.run);
    Py_XDECREF(tw.tree);
    return result;
}
