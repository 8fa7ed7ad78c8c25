/*
 * steps.h - a decode loop's steady state from Python (steps.c): replay_steps,
 * METH_VARARGS | METH_KEYWORDS.
 */
#ifndef TT_STEPS_H
#define TT_STEPS_H

#include "state.h"

PyObject *tt_py_replay_steps(PyObject *module, PyObject *args, PyObject *kwargs);

#endif /* TT_STEPS_H */
