/*
 * depth.h - the engine's depth search from Python (depth.c): tweak and the
 * check of its settings, each METH_VARARGS | METH_KEYWORDS.
 */
#ifndef TT_DEPTH_H
#define TT_DEPTH_H

#include "state.h"

PyObject *tt_py_check_tweak_config(PyObject *module, PyObject *args, PyObject *kwargs);
PyObject *tt_py_tweak(PyObject *module, PyObject *args, PyObject *kwargs);

#endif /* TT_DEPTH_H */
