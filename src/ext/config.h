/*
 * config.h - the engine's measurement config seen from Python (config.c).
 */
#ifndef TT_CONFIG_H
#define TT_CONFIG_H

#include "common.h"
#include "tweak.h"

/* Seconds (an int or float >= 0) as whole nanoseconds, rounded; -1 with
 * ValueError naming `what` when it is not a number or does not fit uint64. */
int tt_seconds_to_ns(PyObject *value, const char *what, uint64_t *out);
/* cfg from the defaults and a dict of any subset of the keys (None or NULL:
 * none). -1 with ValueError or TypeError naming the bad key or value. */
int tt_config_from_dict(PyObject *dict, tw_measure_config *cfg);
/* default_tweak_config() -> dict: the engine's tweak defaults and strategy kind names (METH_NOARGS). */
PyObject *tt_py_default_tweak_config(PyObject *module, PyObject *unused);
/* default_measure_config() -> dict (METH_NOARGS). */
PyObject *tt_py_default_measure_config(PyObject *module, PyObject *unused);

#endif /* TT_CONFIG_H */
