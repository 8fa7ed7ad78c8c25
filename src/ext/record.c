/*
 * record.c - restore_result: a Result built again from the numbers a caller
 * kept of one (a tuning-cache entry), in the forms Result's getters give. The
 * binding parses those forms into the engine's record and leaves every rule on
 * the numbers to the engine (tw_result_restore). It runs no Python code while
 * it reads, and holds the rows' sequence while it does.
 */
#include "record.h"

#include "call.h"
#include "config.h"
#include "result.h"

#include <limits.h>
#include <string.h>

/* d[key], borrowed; NULL with TypeError when d is no dict or lacks key. */
static PyObject *
tt_item(PyObject *d, const char *where, const char *key)
{
    PyObject *value;

    if (!PyDict_Check(d)) {
        PyErr_Format(PyExc_TypeError, "%s must be a dict, not %.100s", where,
                     Py_TYPE(d)->tp_name);
        return NULL;
    }
    value = PyDict_GetItemString(d, key);
    if (value == NULL)
        PyErr_Format(PyExc_TypeError, "%s has no \"%s\"", where, key);
    return value;
}

/* A number (int or float, not bool) as a double; -1 with TypeError. */
static int
tt_number(PyObject *d, const char *where, const char *key, double *out)
{
    PyObject *value = tt_item(d, where, key);

    if (value == NULL)
        return -1;
    if (PyBool_Check(value) || !(PyFloat_Check(value) || PyLong_Check(value))) {
        PyErr_Format(PyExc_TypeError, "%s[\"%s\"] must be a number, not %.100s", where, key,
                     Py_TYPE(value)->tp_name);
        return -1;
    }
    *out = PyFloat_AsDouble(value);
    return *out == -1.0 && PyErr_Occurred() ? -1 : 0;
}

/* A whole number (int, not bool) within lo..hi; -1 with TypeError or a
 * ValueError naming the value given. */
static int
tt_whole(PyObject *d, const char *where, const char *key, long long lo, long long hi,
         long long *out)
{
    PyObject *value = tt_item(d, where, key);
    int overflow = 0;

    if (value == NULL)
        return -1;
    if (PyBool_Check(value) || !PyLong_Check(value)) {
        PyErr_Format(PyExc_TypeError, "%s[\"%s\"] must be an int, not %.100s", where, key,
                     Py_TYPE(value)->tp_name);
        return -1;
    }
    *out = PyLong_AsLongLongAndOverflow(value, &overflow);
    if (*out == -1 && !overflow && PyErr_Occurred())
        return -1;
    if (overflow || *out < lo || *out > hi) {
        PyErr_Format(PyExc_ValueError, "%s[\"%s\"] (%R) is out of range: %lld to %lld", where,
                     key, value, lo, hi);
        return -1;
    }
    return 0;
}

/* A count of rounds (0..UINT32_MAX). */
static int
tt_u32(PyObject *d, const char *where, const char *key, uint32_t *out)
{
    long long n;

    if (tt_whole(d, where, key, 0, (long long)UINT32_MAX, &n) < 0)
        return -1;
    *out = (uint32_t)n;
    return 0;
}

/* A name among names(0..count - 1): its index; -1 with ValueError. */
static int
tt_named(PyObject *d, const char *where, const char *key, const char *(*names)(int),
         int count, int *out)
{
    PyObject *value = tt_item(d, where, key);
    const char *name;
    int k;

    if (value == NULL)
        return -1;
    if (!PyUnicode_Check(value) || (name = PyUnicode_AsUTF8(value)) == NULL) {
        if (!PyErr_Occurred())
            PyErr_Format(PyExc_TypeError, "%s[\"%s\"] must be a str, not %.100s", where, key,
                         Py_TYPE(value)->tp_name);
        return -1;
    }
    for (k = 0; k < count; k++) {
        if (strcmp(name, names(k)) == 0) {
            *out = k;
            return 0;
        }
    }
    PyErr_Format(PyExc_ValueError, "%s[\"%s\"] (%R) is no name the engine gives", where, key,
                 value);
    return -1;
}

static const char *
tt_stop_at(int k)
{
    return tt_stop_name((tw_stop)k);
}

static const char *
tt_row_state_at(int k)
{
    return tt_row_state_name((tw_row_state)k);
}

static const char *
tt_quality_at(int k)
{
    return tw_quality_name((tw_quality)k);
}

/* A stats dict (tt_stats_to_dict's form) into *out. */
static int
tt_stats_read(PyObject *d, const char *where, tw_stats *out)
{
    int stop = 0;

    memset(out, 0, sizeof(*out));
    if (tt_number(d, where, "median_ns", &out->median_ns) < 0 ||
        tt_number(d, where, "q25_ns", &out->q25_ns) < 0 ||
        tt_number(d, where, "q75_ns", &out->q75_ns) < 0 ||
        tt_number(d, where, "min_ns", &out->min_ns) < 0 ||
        tt_number(d, where, "spread", &out->spread) < 0 ||
        tt_u32(d, where, "warmup_rounds", &out->warmup_rounds) < 0 ||
        tt_u32(d, where, "rounds", &out->rounds) < 0 ||
        tt_named(d, where, "stopped_by", tt_stop_at, (int)TW_STOP_DECIDED + 1, &stop) < 0)
        return -1;
    out->stopped_by = (tw_stop)stop;
    return 0;
}

/* d[key]: stats, or None (*measured 0). */
static int
tt_stats_or_none_read(PyObject *d, const char *where, const char *key, tw_stats *out,
                      int *measured)
{
    PyObject *value = tt_item(d, where, key);

    memset(out, 0, sizeof(*out));
    *measured = 0;
    if (value == NULL)
        return -1;
    if (value == Py_None)
        return 0;
    *measured = 1;
    return tt_stats_read(value, key, out);
}

/* One row dict (the rows getter's form) into *row; its error borrowed from d. */
static int
tt_row_read(PyObject *d, tw_row *row)
{
    long long depth, modules, failed;
    PyObject *error;
    int state = 0, measured = 0;

    memset(row, 0, sizeof(*row));
    if (tt_whole(d, "a row", "depth", INT_MIN, INT_MAX, &depth) < 0 ||
        tt_whole(d, "a row", "modules", 0, PY_SSIZE_T_MAX, &modules) < 0 ||
        tt_whole(d, "a row", "failed", 0, PY_SSIZE_T_MAX, &failed) < 0 ||
        tt_named(d, "a row", "state", tt_row_state_at, (int)TW_ROW_DRY + 1, &state) < 0 ||
        tt_stats_or_none_read(d, "a row", "stats", &row->stats, &measured) < 0 ||
        (error = tt_item(d, "a row", "error")) == NULL)
        return -1;
    if (!PyUnicode_Check(error)) {
        PyErr_Format(PyExc_TypeError, "a row's \"error\" must be a str, not %.100s",
                     Py_TYPE(error)->tp_name);
        return -1;
    }
    if ((row->error = PyUnicode_AsUTF8(error)) == NULL)
        return -1;
    if (measured != (state == TW_ROW_MEASURED)) {
        PyErr_SetString(PyExc_ValueError, "a row has stats exactly when it was measured");
        return -1;
    }
    row->depth = (int)depth;
    row->modules = (size_t)modules;
    row->failed = (size_t)failed;
    row->state = (tw_row_state)state;
    return 0;
}

/* A busy confirmation's budgets wanted (seconds, as the getter gives them) and
 * whether its rounds ran out. */
static int
tt_wanted_read(PyObject *d, tw_confirmation *c)
{
    const char *where = "the confirmation";
    PyObject *busy, *time, *ran_out; /* borrowed */

    if ((busy = tt_item(d, where, "busy_budget_wanted")) == NULL ||
        (time = tt_item(d, where, "time_budget_wanted")) == NULL ||
        (ran_out = tt_item(d, where, "rounds_ran_out")) == NULL)
        return -1;
    if (PyBool_Check(busy) || PyBool_Check(time) || !PyBool_Check(ran_out)) {
        PyErr_SetString(PyExc_TypeError, "the confirmation's budgets wanted are seconds, and "
                        "rounds_ran_out a bool");
        return -1;
    }
    if (tt_seconds_to_ns(busy, "the confirmation's busy_budget_wanted",
                         &c->busy_budget_wanted_ns) < 0 ||
        tt_seconds_to_ns(time, "the confirmation's time_budget_wanted",
                         &c->time_budget_wanted_ns) < 0)
        return -1;
    c->rounds_ran_out = ran_out == Py_True;
    return 0;
}

/* The confirmation dict (the confirmation getter's form), or None. */
static int
tt_confirmation_read(PyObject *d, tw_confirmation *c)
{
    const char *where = "the confirmation";
    PyObject *share;
    long long depth;
    int quality = 0, measured = 0;

    memset(c, 0, sizeof(*c));
    if (d == Py_None)
        return 0;
    if (tt_whole(d, where, "depth", INT_MIN, INT_MAX, &depth) < 0 ||
        tt_stats_or_none_read(d, where, "tuned", &c->tuned, &measured) < 0 || !measured ||
        tt_stats_or_none_read(d, where, "untuned", &c->untuned, &measured) < 0 || !measured ||
        tt_number(d, where, "speedup", &c->speedup) < 0 ||
        tt_number(d, where, "speedup_low", &c->speedup_low) < 0 ||
        tt_number(d, where, "speedup_high", &c->speedup_high) < 0 ||
        tt_named(d, where, "quality", tt_quality_at, (int)TW_QUALITY_BUSY + 1, &quality) < 0 ||
        tt_u32(d, where, "tries", &c->tries) < 0 ||
        tt_u32(d, where, "paired_rounds", &c->paired_rounds) < 0 ||
        tt_u32(d, where, "paired_wins", &c->paired_wins) < 0 ||
        (share = tt_item(d, where, "others_share")) == NULL) {
        if (!PyErr_Occurred())
            PyErr_SetString(PyExc_TypeError, "the confirmation's tuned and untuned are stats");
        return -1;
    }
    c->others_share = -1.0;
    if ((share != Py_None && tt_number(d, where, "others_share", &c->others_share) < 0) ||
        tt_wanted_read(d, c) < 0)
        return -1;
    c->measured = 1;
    c->depth = (int)depth;
    c->quality = (tw_quality)quality;
    return 0;
}

/* Everything of the record but its rows. */
static int
tt_record_read(PyObject *d, tw_result_record *rec)
{
    PyObject *confirmation, *share, *flag, *budgets;
    long long selected, time_ns, busy_ns;

    if (tt_whole(d, "the record", "selected", LONG_MIN, LONG_MAX, &selected) < 0 ||
        tt_stats_or_none_read(d, "the record", "baseline", &rec->baseline,
                              &rec->baseline_measured) < 0 ||
        (confirmation = tt_item(d, "the record", "confirmation")) == NULL ||
        tt_confirmation_read(confirmation, &rec->confirmation) < 0 ||
        (share = tt_item(d, "the record", "others_share")) == NULL ||
        (flag = tt_item(d, "the record", "busy_stopped")) == NULL ||
        (budgets = tt_item(d, "the record", "budgets")) == NULL ||
        tt_whole(budgets, "the budgets", "time_budget_ns", 0, LLONG_MAX, &time_ns) < 0 ||
        tt_whole(budgets, "the budgets", "busy_budget_ns", 0, LLONG_MAX, &busy_ns) < 0)
        return -1;
    rec->others_share = -1.0;
    if (share != Py_None && tt_number(d, "the record", "others_share", &rec->others_share) < 0)
        return -1;
    if (!PyBool_Check(flag)) {
        PyErr_Format(PyExc_TypeError, "the record's \"busy_stopped\" must be a bool, not %.100s",
                     Py_TYPE(flag)->tp_name);
        return -1;
    }
    rec->selected = (long)selected;
    rec->busy_stopped = flag == Py_True;
    rec->time_budget_ns = (uint64_t)time_ns;
    rec->busy_budget_ns = (uint64_t)busy_ns;
    return 0;
}

PyObject *
tt_py_restore_result(PyObject *module, PyObject *record)
{
    TtState *st = (TtState *)PyModule_GetState(module);
    PyObject *rows = NULL; /* new reference: the rows, held while they are read */
    PyObject *result = NULL;
    tw_result_record rec;
    tw_result *out = NULL;
    tw_row *parsed = NULL;
    Py_ssize_t n = 0, i;
    tw_error err;
    tw_code code;

    memset(&rec, 0, sizeof(rec));
    memset(&err, 0, sizeof(err));
    if (tt_item(record, "the record", "rows") == NULL ||
        (rows = tt_sequence_tuple(PyDict_GetItemString(record, "rows"),
                                  "the record's \"rows\" must be a list of row dicts")) == NULL)
        goto cleanup;
    n = PySequence_Fast_GET_SIZE(rows);
    rec.row_count = (size_t)n;
    if ((size_t)n <= TW_RESULT_MAX_ROWS) { /* more: the engine refuses them, unread */
        if ((parsed = PyMem_Calloc((size_t)n + 1, sizeof(tw_row))) == NULL) {
            PyErr_NoMemory();
            goto cleanup;
        }
        for (i = 0; i < n; i++)
            if (tt_row_read(PySequence_Fast_GET_ITEM(rows, i), &parsed[i]) < 0)
                goto cleanup;
        rec.rows = parsed;
    }
    if (tt_record_read(record, &rec) < 0)
        goto cleanup;
    code = tw_result_restore(NULL, &rec, &out, &err);
    if (code != TW_OK) {
        tt_raise_code(st, code, err.msg, NULL);
        goto cleanup;
    }
    result = tt_result_new(st, out, 0); /* steals out, also on failure */
cleanup:
    PyMem_Free(parsed);
    Py_XDECREF(rows);
    return result;
}
