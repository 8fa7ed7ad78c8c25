/*
 * measure.h - the module functions that measure through the engine, and the
 * argument checks every engine binding shares (measure.c).
 */
#ifndef TT_MEASURE_H
#define TT_MEASURE_H

#include "state.h"
#include "tweak.h"

/* measure, compare and choose; each is METH_VARARGS | METH_KEYWORDS. */
PyObject *tt_py_measure(PyObject *module, PyObject *args, PyObject *kwargs);
/* measure_paired(first, second, n_samples, *, sync, config, clock, rounds_min,
 * rounds_max, width) -> {ratio, low, high, rounds, wins}: tw_measure_paired. */
PyObject *tt_py_measure_paired(PyObject *module, PyObject *args, PyObject *kwargs);
PyObject *tt_py_compare(PyObject *module, PyObject *args, PyObject *kwargs);
PyObject *tt_py_choose(PyObject *module, PyObject *args, PyObject *kwargs);

/* 0 when obj is callable (or None and may_be_none); -1 with TypeError naming
 * `what`. */
int tt_check_callable(PyObject *obj, const char *what, int may_be_none);
/* 0 when n >= 0; -1 with ValueError. */
int tt_check_n_samples(Py_ssize_t n);
/* sync and clock callable or None, n_samples >= 0, cfg from the config dict
 * (None: the defaults), checked in that order so that every binding names the
 * same bad argument first. -1 with an exception. */
int tt_check_measure_args(PyObject *sync, PyObject *clock, Py_ssize_t n_samples,
                          PyObject *config, tw_measure_config *cfg);
/* The strategy named `kind` (a str), by the engine's own names; -1 with
 * TypeError or ValueError. */
int tt_strategy_parse(PyObject *kind, tw_strategy_kind *out);

#endif /* TT_MEASURE_H */
