/*
 * search.h - the module functions that run the engine's searches (search.c):
 * one module's search, the depth search and the check of its settings; each
 * is METH_VARARGS | METH_KEYWORDS.
 */
#ifndef TT_SEARCH_H
#define TT_SEARCH_H

#include "state.h"

PyObject *tt_py_tune_module(PyObject *module, PyObject *args, PyObject *kwargs);
PyObject *tt_py_check_tweak_config(PyObject *module, PyObject *args, PyObject *kwargs);
PyObject *tt_py_tweak(PyObject *module, PyObject *args, PyObject *kwargs);

#endif /* TT_SEARCH_H */
