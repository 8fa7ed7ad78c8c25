/*
 * result.c - the result of a tweak as a Python type: Result (tw_result), the
 * engine's result model read into dicts, and one module's search result as a
 * dict (tune_module's answer).
 */
#include "result.h"

#include "call.h"
#include "tree.h"

#include <math.h>
#include <string.h>

/* =============================================================== Result */

/* d[key] = value, stealing value (which may be NULL: an error already set).
 * -1 on error. */
static int
tt_dict_set_new(PyObject *d, const char *key, PyObject *value)
{
    int rc = value == NULL ? -1 : PyDict_SetItemString(d, key, value);

    Py_XDECREF(value);
    return rc;
}

typedef struct {
    PyObject_HEAD
    tw_result *result; /* owned */
    size_t n_nodes;    /* of the tree it was computed on */
} TtResult;

const char *
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
    char figure[32];
    PyObject *tuned = NULL, *untuned = NULL, *share = NULL; /* new references */
    PyObject *result = NULL;

    (void)closure;
    tw_result_confirmation(self->result, &c);
    if (!c.measured)
        Py_RETURN_NONE;
    if ((tuned = tt_stats_to_dict(&c.tuned)) == NULL ||
        (untuned = tt_stats_to_dict(&c.untuned)) == NULL ||
        (share = c.others_share < 0.0 ? Py_NewRef(Py_None) : PyFloat_FromDouble(c.others_share)) == NULL)
        goto cleanup;
    tw_result_confirmed_figure(self->result, figure, sizeof(figure));
    result = Py_BuildValue("{s:i,s:O,s:O,s:O,s:d,s:d,s:d,s:s,s:I,s:O,s:d,s:d,s:O,s:O,s:I,s:I,s:d,"
                           "s:d,s:O,s:s}", "depth",
                           c.depth, "confirmed", c.confirmed ? Py_True : Py_False, "tuned", tuned,
                           "untuned", untuned, "speedup", c.speedup, "speedup_low",
                           c.speedup_low, "speedup_high", c.speedup_high, "quality",
                           tw_quality_name(c.quality), "tries", (unsigned int)c.tries,
                           "from_search", c.from_search ? Py_True : Py_False, "side_speedup",
                           c.side_speedup, "search_speedup", c.search_speedup, "agreed",
                           c.agreed ? Py_True : Py_False, "others_share", share,
                           "paired_rounds", (unsigned int)c.paired_rounds, "paired_wins",
                           (unsigned int)c.paired_wins, "busy_budget_wanted",
                           (double)c.busy_budget_wanted_ns / 1e9, "time_budget_wanted",
                           (double)c.time_budget_wanted_ns / 1e9, "rounds_ran_out",
                           c.rounds_ran_out ? Py_True : Py_False, "figure", figure);
cleanup:
    Py_XDECREF(tuned);
    Py_XDECREF(untuned);
    Py_XDECREF(share);
    return result;
}

static PyObject *
tt_result_get_quality(TtResult *self, void *closure)
{
    (void)closure;
    return PyUnicode_FromString(tw_quality_name(tw_result_quality(self->result)));
}

static PyObject *
tt_result_get_others_share(TtResult *self, void *closure)
{
    double share = tw_result_others_share(self->result);

    (void)closure;
    if (share < 0.0)
        Py_RETURN_NONE;
    return PyFloat_FromDouble(share);
}

static PyObject *
tt_result_get_busy_stopped(TtResult *self, void *closure)
{
    (void)closure;
    return PyBool_FromLong(tw_result_busy_stopped(self->result));
}

static PyObject *
tt_result_get_busy(TtResult *self, void *closure)
{
    (void)closure;
    return PyBool_FromLong(tw_result_busy(self->result));
}

static PyObject *
tt_result_get_budgets(TtResult *self, void *closure)
{
    uint64_t time_ns = 0, busy_ns = 0;

    (void)closure;
    tw_result_budgets(self->result, &time_ns, &busy_ns);
    return Py_BuildValue("{s:K,s:K}", "time_budget_ns", (unsigned long long)time_ns,
                         "busy_budget_ns", (unsigned long long)busy_ns);
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

/* A float, or None for NaN (not known). New reference. */
static PyObject *
tt_float_or_none(double value)
{
    return isnan(value) ? Py_NewRef(Py_None) : PyFloat_FromDouble(value);
}

/* One candidate of a group as a dict, with its build's facts. New reference. */
static PyObject *
tt_candidate_to_dict(const tw_module_result *module, size_t g, size_t c, long chosen)
{
    PyObject *stats = NULL, *max_error = NULL, *tolerance = NULL, *own_error = NULL; /* new */
    PyObject *build_s = NULL;                                                      /* new */
    PyObject *result = NULL;
    const char *reason;
    tw_candidate_report report;
    const char *name = NULL;
    tw_error err;

    memset(&err, 0, sizeof(err));
    if (tw_module_result_candidate(module, g, c, &name, &report, &err) != TW_OK) {
        PyErr_SetString(PyExc_IndexError, err.msg);
        goto cleanup;
    }
    if ((stats = tt_stats_or_none(&report.stats, report.state == TW_CAND_MEASURED)) == NULL)
        goto cleanup;
    reason = tw_reason_name(report.facts.reason);
    if ((max_error = tt_float_or_none(report.facts.max_error)) == NULL ||
        (tolerance = tt_float_or_none(report.facts.tolerance)) == NULL ||
        (own_error = tt_float_or_none(report.facts.own_error)) == NULL)
        goto cleanup;
    if (report.state == TW_CAND_NOT_TRIED) {
        build_s = Py_NewRef(Py_None);
    } else if ((build_s = PyFloat_FromDouble((double)report.build_ns / 1e9)) == NULL) {
        goto cleanup;
    }
    result = Py_BuildValue("{s:s,s:s,s:s,s:s,s:O,s:s,s:O,s:O,s:O,s:O,s:N,s:N}", "name",
                           name != NULL ? name : "(unnamed)", "state",
                           tw_candidate_state_name(report.state), "verdict",
                           tw_candidate_verdict(&report, (long)c == chosen), "error",
                           report.state == TW_CAND_FAILED ? report.msg : "", "stats", stats,
                           "reason", reason != NULL ? reason : "", "max_error", max_error,
                           "tolerance", tolerance, "own_error", own_error, "build_s", build_s,
                           "variant",
                           PyBool_FromLong((report.flags & TW_CAND_VARIANT) != 0),
                           "lowers_precision",
                           PyBool_FromLong((report.flags & TW_CAND_LOWERS_PRECISION) != 0));
cleanup:
    Py_XDECREF(stats);
    Py_XDECREF(max_error);
    Py_XDECREF(tolerance);
    Py_XDECREF(own_error);
    Py_XDECREF(build_s);
    return result;
}

/* One group as a dict. New reference. */
static PyObject *
tt_group_to_dict(const tw_module_result *module, size_t g)
{
    PyObject *cands = NULL; /* new reference */
    PyObject *result = NULL;
    tw_group_report group;
    tw_error err;
    size_t c;

    memset(&err, 0, sizeof(err));
    if (tw_module_result_group(module, g, &group, &err) != TW_OK) {
        PyErr_SetString(PyExc_IndexError, err.msg);
        goto cleanup;
    }
    if ((cands = PyList_New((Py_ssize_t)group.n_candidates)) == NULL)
        goto cleanup;
    for (c = 0; c < group.n_candidates; c++) {
        PyObject *d = tt_candidate_to_dict(module, g, c, group.chosen);

        if (d == NULL)
            goto cleanup;
        PyList_SET_ITEM(cands, (Py_ssize_t)c, d);
    }
    result = Py_BuildValue("{s:s,s:s,s:n,s:l,s:s,s:O}", "text", group.text, "strategy",
                           tw_strategy_name(group.kind) != NULL ? tw_strategy_name(group.kind)
                                                                : "",
                           "samples", (Py_ssize_t)group.n_samples, "chosen", group.chosen,
                           "error", group.error, "candidates", cands);
cleanup:
    Py_XDECREF(cands);
    return result;
}

PyObject *
tt_module_result_to_dict(const tw_module_result *module)
{
    PyObject *groups = NULL; /* new reference */
    PyObject *result = NULL;
    size_t n = tw_module_result_group_count(module), g;

    if ((groups = PyList_New((Py_ssize_t)n)) == NULL)
        goto cleanup;
    for (g = 0; g < n; g++) {
        PyObject *d = tt_group_to_dict(module, g);

        if (d == NULL)
            goto cleanup;
        PyList_SET_ITEM(groups, (Py_ssize_t)g, d);
    }
    result = Py_BuildValue("{s:s,s:i,s:s,s:O}", "path", tw_module_result_path(module), "state",
                           tw_module_result_state(module), "error",
                           tw_module_result_error(module), "groups", groups);
cleanup:
    Py_XDECREF(groups);
    return result;
}

/* Every searched module, in node order, with the depths whose cut holds it
 * and whether the model runs it now. New reference. */
static PyObject *
tt_result_get_modules(TtResult *self, void *closure)
{
    PyObject *list = NULL;
    PyObject *depths = NULL; /* new reference */
    PyObject *d = NULL;      /* new reference */
    PyObject *result = NULL;
    size_t rows = tw_result_row_count(self->result), node, i;
    int rc;
    long selected = tw_result_selected(self->result);
    const tw_module_result *module;
    tw_row row;

    (void)closure;
    if ((list = PyList_New(0)) == NULL)
        goto cleanup;
    for (node = 0; node < self->n_nodes; node++) {
        if ((module = tw_result_module_search(self->result, node)) == NULL)
            continue;
        if ((depths = PyList_New(0)) == NULL)
            goto cleanup;
        for (i = 0; i < rows; i++) {
            PyObject *depth; /* new reference */

            if (!tw_result_row_has(self->result, i, node) ||
                tw_result_row(self->result, i, &row, NULL) != TW_OK)
                continue;
            if ((depth = PyLong_FromLong(row.depth)) == NULL)
                goto cleanup;
            rc = PyList_Append(depths, depth);
            Py_DECREF(depth);
            if (rc < 0)
                goto cleanup;
        }
        if ((d = tt_module_result_to_dict(module)) == NULL)
            goto cleanup;
        if (tt_dict_set_new(d, "node", PyLong_FromSize_t(node)) < 0)
            goto cleanup;
        rc = tt_dict_set_new(d, "depths", depths);
        depths = NULL; /* stolen, also on failure */
        if (rc < 0 || tt_dict_set_new(d, "kept",
                                      PyBool_FromLong(selected >= 0 &&
                                                      tw_result_row_has(self->result,
                                                                        (size_t)selected,
                                                                        node))) < 0)
            goto cleanup;
        if (PyList_Append(list, d) < 0)
            goto cleanup;
        Py_CLEAR(d);
    }
    result = list;
    list = NULL;
cleanup:
    Py_XDECREF(list);
    Py_XDECREF(depths);
    Py_XDECREF(d);
    return result;
}

/* The result table (or its outcome lines alone), `untuned` (NULL: the engine's
 * words) ending its summary line when no depth is kept. */
static PyObject *
tt_result_text(TtResult *self, const char *untuned, int outcome_only)
{
    TtState *st = (TtState *)PyType_GetModuleState(Py_TYPE(self));
    tw_error err;

    memset(&err, 0, sizeof(err));
    return tt_take_formatted(st, outcome_only ? tw_result_outcome_as(self->result, untuned, &err)
                                              : tw_result_format_as(self->result, untuned, &err),
                             &err);
}

static PyObject *
tt_result_format(TtResult *self, PyObject *args, PyObject *kwargs)
{
    static char *keywords[] = {"untuned", NULL};
    const char *untuned = NULL;

    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "|z:format", keywords, &untuned)) {
        return NULL;
    }
    return tt_result_text(self, untuned, 0);
}

static PyObject *
tt_result_outcome(TtResult *self, PyObject *args, PyObject *kwargs)
{
    static char *keywords[] = {"untuned", NULL};
    const char *untuned = NULL;

    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "|z:outcome", keywords, &untuned)) {
        return NULL;
    }
    return tt_result_text(self, untuned, 1);
}

static PyObject *
tt_result_str(TtResult *self)
{
    return tt_result_text(self, NULL, 0);
}

static PyMethodDef tt_result_methods[] = {
    {"module", (PyCFunction)tt_result_module, METH_O,
     "module(node) -> (1 tuned, -1 failed, 0 never tuned; error)"},
    {"format", (PyCFunction)(void (*)(void))tt_result_format, METH_VARARGS | METH_KEYWORDS,
     "format(untuned=None) -> the result table; untuned: what its last line says stays untuned "
     "when no depth is kept (None: \"it stays untuned\")"},
    {"outcome", (PyCFunction)(void (*)(void))tt_result_outcome, METH_VARARGS | METH_KEYWORDS,
     "outcome(untuned=None) -> the lines that end the table, alone: what was kept and by how "
     "much, then the notes on the machine"},
    {NULL, NULL, 0, NULL}};

static PyGetSetDef tt_result_getset[] = {
    {"rows", (getter)tt_result_get_rows, NULL, "One dict per depth.", NULL},
    {"selected", (getter)tt_result_get_selected, NULL,
     "Index into rows, or -1 when the model stays untuned.", NULL},
    {"confirmation", (getter)tt_result_get_confirmation, NULL,
     "The kept depth measured side by side with the untuned model: a dict (depth, confirmed, "
     "tuned, untuned, speedup, speedup_low, speedup_high, quality, tries, from_search, "
     "side_speedup, search_speedup, agreed, others_share, paired_rounds, paired_wins, "
     "busy_budget_wanted, time_budget_wanted, rounds_ran_out, figure), or None "
     "when none was measured. "
     "speedup is the figure reported: side by side, or the smaller of it and the search's when "
     "they disagree, or on a busy machine (quality \"busy\") the median ratio of paired "
     "rounds, speedup_low and speedup_high its 99 % interval; others_share: what other "
     "processes took of the CPUs during the last side-by-side measurement or the paired rounds "
     "(None: unknown); paired_rounds, paired_wins: on a busy machine, the pairs measured and "
     "those the depth won (else 0); busy_budget_wanted, time_budget_wanted: on a busy machine "
     "whose paired rounds leaned faster but ran out of the budget in force before they could "
     "decide, the busy_budget (or time_budget) in seconds that buys the rounds (else 0); "
     "rounds_ran_out: those rounds stopped at their time cap undecided; "
     "figure: speedup as the table's confirmed column and its last line write it (\"1.54x\").",
     NULL},
    {"quality", (getter)tt_result_get_quality, NULL,
     "How the side-by-side figures held against the search's: \"consistent\", "
     "\"remeasured\" (agreed when measured again), \"inconsistent\" (never agreed: the "
     "smaller figure counts), \"busy\" (other processes took more than the engine's busy share "
     "of the CPUs: the figure comes from paired rounds, measured busy) or \"unchecked\" (nothing was measured side by side).",
     NULL},
    {"others_share", (getter)tt_result_get_others_share, NULL,
     "The share of the machine's CPUs other processes took while the figures were measured "
     "(0..1), or None when unknown.", NULL},
    {"busy", (getter)tt_result_get_busy, NULL,
     "True when others_share is above the engine's busy share (BUSY_SHARE).", NULL},
    {"busy_stopped", (getter)tt_result_get_busy_stopped, NULL,
     "True when the busy budget stopped the search: a depth was not tried on a busy machine.",
     NULL},
    {"budgets", (getter)tt_result_get_budgets, NULL,
     "The budgets the result was computed under: {\"time_budget_ns\", \"busy_budget_ns\"} (0: none).",
     NULL},
    {"noisy", (getter)tt_result_get_noisy, NULL,
     "True when no speedup was confirmed and a measurement spread more than the engine's noisy "
     "limit (a busy machine may have hidden one).", NULL},
    {"baseline", (getter)tt_result_get_baseline, NULL,
     "The untuned model's statistics; None on a dry run.", NULL},
    {"modules", (getter)tt_result_get_modules, NULL,
     "Every searched module, in node order: a dict (node, path, state, error, depths, kept, "
     "groups) per module; per group (text, strategy, samples, chosen, error, candidates); per "
     "candidate (name, state, verdict, error, stats).", NULL},
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

/* ================================================================ module */

PyObject *
tt_result_new(TtState *st, tw_result *result, size_t n_nodes)
{
    TtResult *self = (TtResult *)st->ResultType->tp_alloc(st->ResultType, 0);

    if (self == NULL) {
        tw_result_destroy(result);
        return NULL;
    }
    self->result = result;
    self->n_nodes = n_nodes;
    return (PyObject *)self;
}

/* module.name = value; -1 with an exception on failure. */
static int
tt_add_float(PyObject *module, const char *name, double value)
{
    PyObject *obj = PyFloat_FromDouble(value); /* new reference */
    int rc = obj == NULL ? -1 : PyModule_AddObjectRef(module, name, obj);

    Py_XDECREF(obj);
    return rc;
}

int
tt_result_exec(PyObject *module, TtState *st)
{
    int rc = -1;

    st->ResultType = (PyTypeObject *)PyType_FromModuleAndSpec(module, &tt_result_spec, NULL);
    if (st->ResultType == NULL)
        goto error;
    if (PyModule_AddObjectRef(module, "Result", (PyObject *)st->ResultType) < 0 ||
        tt_add_float(module, "BUSY_SHARE", TW_BUSY_SHARE) < 0 ||
        tt_add_float(module, "BUSY_BUDGET", TW_BUSY_BUDGET_NS / 1e9) < 0 ||
        PyModule_AddIntConstant(module, "CANDIDATE_VARIANT", TW_CAND_VARIANT) < 0 ||
        PyModule_AddIntConstant(module, "CANDIDATE_LOWERS_PRECISION", TW_CAND_LOWERS_PRECISION) < 0)
        goto error;
    rc = 0;
error:
    return rc;
}
