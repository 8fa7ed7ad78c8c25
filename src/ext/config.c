/*
 * config.c - the engine's measurement config as a dict: parsing a config
 * dict, the defaults as one, and seconds as nanoseconds.
 */
#include "config.h"

#include <math.h>
#include <string.h>

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
    {"settle", TT_KEY_U32, offsetof(tw_measure_config, settle)},
    {"round_min", TT_KEY_SECONDS, offsetof(tw_measure_config, round_min_ns)},
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
int
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
int
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
                         "time_cap, stop_when_decided, settle, round_min",
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
tt_py_default_tweak_config(PyObject *module, PyObject *unused)
{
    tw_tweak_config cfg;
    PyObject *kinds = NULL; /* new reference */
    PyObject *result = NULL;
    const char *name;
    int k;

    (void)module;
    (void)unused;
    tw_tweak_config_default(&cfg);
    for (k = 0; tw_strategy_name((tw_strategy_kind)k) != NULL; k++) {
    }
    if ((kinds = PyTuple_New(k)) == NULL)
        goto cleanup;
    for (k = 0; (name = tw_strategy_name((tw_strategy_kind)k)) != NULL; k++) {
        PyObject *item = PyUnicode_FromString(name); /* new reference, stolen by the tuple */

        if (item == NULL)
            goto cleanup;
        PyTuple_SET_ITEM(kinds, k, item);
    }
    result = Py_BuildValue("{s:i,s:i,s:d,s:O}", "min_depth", cfg.min_depth, "max_depth", cfg.max_depth,
                           "tie_tolerance", cfg.tie_tolerance, "strategies", kinds);
cleanup:
    Py_XDECREF(kinds);
    return result;
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
