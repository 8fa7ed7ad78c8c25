/*
 * measure.h - the module functions that run the engine (measure.c); each is
 * METH_VARARGS | METH_KEYWORDS.
 */
#ifndef TT_MEASURE_H
#define TT_MEASURE_H

#include "state.h"

PyObject *tt_py_measure(PyObject *module, PyObject *args, PyObject *kwargs);
PyObject *tt_py_compare(PyObject *module, PyObject *args, PyObject *kwargs);
PyObject *tt_py_choose(PyObject *module, PyObject *args, PyObject *kwargs);
PyObject *tt_py_tune_module(PyObject *module, PyObject *args, PyObject *kwargs);
PyObject *tt_py_check_tweak_config(PyObject *module, PyObject *args, PyObject *kwargs);
PyObject *tt_py_tweak(PyObject *module, PyObject *args, PyObject *kwargs);

#endif /* TT_MEASURE_H */
