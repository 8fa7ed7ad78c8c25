/*
 * search.c - the engine's module search seen from Python: tune_module (one
 * module's search over its signature groups and candidates), with the
 * trampolines from the engine's module callbacks into Python; the depth search
 * (depth.c) uses the same trampolines. tune_module parses its arguments, holds
 * its own references to every callable for the whole call (a callback may clear
 * the caller's list or rebind a method), and runs the engine through call.c.
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

static const char *const tt_module_methods[] = {"groups", "group", "build", "run", "commit"};

/* Fetches the callbacks of `modules`; -1 with TypeError naming the one that is
 * missing or not callable. */
int
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

void
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
    PyMem_Free(m->flags);
    m->flags = NULL;
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

/* The candidates' flags from group()'s optional fifth item (a tuple of ints,
 * one per name, of CANDIDATE_VARIANT and CANDIDATE_LOWERS_PRECISION) into
 * m->flags; -1 with an exception. */
static int
tt_group_flags_from(TtModules *m, PyObject *flags, Py_ssize_t n)
{
    Py_ssize_t i;
    long v;

    PyMem_Free(m->flags);
    m->flags = NULL;
    if (!PyTuple_Check(flags) || PyTuple_GET_SIZE(flags) != n) {
        PyErr_Format(PyExc_TypeError, "group(): flags must be a tuple of %zd ints, one per name",
                     n);
        return -1;
    }
    if ((m->flags = PyMem_Calloc((size_t)n + 1, sizeof(unsigned))) == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    for (i = 0; i < n; i++) {
        PyObject *item = PyTuple_GET_ITEM(flags, i);

        v = PyLong_Check(item) ? PyLong_AsLong(item) : -1;
        if (v < 0 || v > (long)(TW_CAND_VARIANT | TW_CAND_LOWERS_PRECISION)) {
            PyErr_Clear();
            PyErr_Format(PyExc_ValueError, "group(): flags[%zd] must be CANDIDATE_VARIANT, "
                         "CANDIDATE_LOWERS_PRECISION, both or 0, not %R", i, item);
            return -1;
        }
        m->flags[i] = (unsigned)v;
    }
    return 0;
}

/* info from group()'s (text, kind, names, n_samples[, flags]); -1 with an
 * exception. */
static int
tt_group_info_from(TtModules *m, PyObject *res, tw_group_info *info)
{
    PyObject *names;  /* borrowed from m->info */
    Py_ssize_t n, i, n_samples;
    tw_strategy_kind kind;

    if (!PyTuple_Check(res) || PyTuple_GET_SIZE(res) < 4 || PyTuple_GET_SIZE(res) > 5 ||
        !PyUnicode_Check(PyTuple_GET_ITEM(res, 0)) || !PyTuple_Check(PyTuple_GET_ITEM(res, 2))) {
        PyErr_Format(PyExc_TypeError,
                     "group() must return (text: str, kind: str, names: tuple of str, "
                     "n_samples: int[, flags: tuple of int]), not %.100s",
                     Py_TYPE(res)->tp_name);
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
    if (PyTuple_GET_SIZE(res) == 5) {
        if (tt_group_flags_from(m, PyTuple_GET_ITEM(res, 4), n) < 0)
            return -1;
    } else {
        PyMem_Free(m->flags);
        m->flags = NULL;
    }
    if ((info->text = PyUnicode_AsUTF8(PyTuple_GET_ITEM(res, 0))) == NULL)
        return -1;
    info->kind = kind;
    info->n_candidates = (size_t)n;
    info->names = m->names;
    info->flags = m->flags;
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

/* *out from a float or int; anything else, or one out of range, leaves it. */
static void
tt_fact_number(PyObject *value, double *out)
{
    double d;

    if (PyFloat_Check(value) || PyLong_Check(value)) {
        d = PyFloat_AsDouble(value);
        if (d == -1.0 && PyErr_Occurred())
            PyErr_Clear();
        else
            *out = d;
    }
}

/* facts from a (reason: str, max_error: float | None, tolerance: float | None
 * [, own_error: float | None]) tuple: what build() returned, or its
 * exception's tt_facts. Anything else, or
 * a reason the engine does not know, says nothing (an unknown reason: the
 * engine's "build failed"). Never raises. */
static void
tt_facts_from(PyObject *given, tw_build_facts *facts)
{
    PyObject *reason, *max_error, *tolerance; /* borrowed */
    const char *text;
    int r;

    if (given == NULL || !PyTuple_Check(given) ||
        (PyTuple_GET_SIZE(given) != 3 && PyTuple_GET_SIZE(given) != 4))
        goto cleanup;
    reason = PyTuple_GET_ITEM(given, 0);
    max_error = PyTuple_GET_ITEM(given, 1);
    tolerance = PyTuple_GET_ITEM(given, 2);
    text = PyUnicode_Check(reason) ? PyUnicode_AsUTF8(reason) : NULL;
    for (r = 0; text != NULL && r < TW_REASON_COUNT; r++) {
        if (strcmp(text, tw_reason_name((tw_reason)r)) == 0) {
            facts->reason = (tw_reason)r;
            break;
        }
    }
    PyErr_Clear();
    tt_fact_number(max_error, &facts->max_error);
    tt_fact_number(tolerance, &facts->tolerance);
    if (PyTuple_GET_SIZE(given) == 4)
        tt_fact_number(PyTuple_GET_ITEM(given, 3), &facts->own_error);
cleanup:
    return;
}

/* build(node, group, candidate): returns None or its facts (see
 * tt_facts_from); a failing build's exception may carry them as tt_facts. */
static tw_code
tt_modules_build(void *ctx, size_t node, size_t group, size_t cand, tw_build_facts *facts,
                 tw_error *err)
{
    TtModules *m = (TtModules *)ctx;
    PyObject *args[3] = {NULL, NULL, NULL}; /* new references */
    PyObject *res = NULL, *given = NULL;    /* new references */
    tw_code code = TW_OK;
    size_t i;

    if (TT_UNLIKELY(m->call->stash != NULL)) {
        code = tw_error_set(err, TW_EINTERRUPT, "interrupted");
        goto cleanup;
    }
    if ((args[0] = PyLong_FromSize_t(node)) == NULL ||
        (args[1] = PyLong_FromSize_t(group)) == NULL ||
        (args[2] = PyLong_FromSize_t(cand)) == NULL) {
        code = tt_call_fail(m->call, err);
        goto cleanup;
    }
    res = PyObject_Vectorcall(m->build, args, 3, NULL);
    if (res != NULL) {
        tt_facts_from(res, facts);
        goto cleanup;
    }
    code = tt_call_fail(m->call, err);
    if (code == TW_ECALLBACK && m->call->failure != NULL) {
        given = PyObject_GetAttrString(m->call->failure, "tt_facts");
        PyErr_Clear();
        tt_facts_from(given, facts);
    }
cleanup:
    for (i = 0; i < 3; i++)
        Py_XDECREF(args[i]);
    Py_XDECREF(res);
    Py_XDECREF(given);
    return code;
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

void
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
