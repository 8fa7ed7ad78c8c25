/*
 * search.h - the engine's module search from Python (search.c): tune_module
 * (METH_VARARGS | METH_KEYWORDS), and the module callbacks the depth search
 * (depth.c) hands the engine too.
 */
#ifndef TT_SEARCH_H
#define TT_SEARCH_H

#include "call.h"
#include "state.h"

/* The module search's callbacks: the bound methods of a `modules` object,
 * fetched once and held for the whole call (a callback may rebind them). */
typedef struct TtModules {
    TtCall *call;
    PyObject *groups, *group, *build, *run, *commit; /* new references */
    PyObject *info;        /* new reference: group()'s answer, held while its
                            * strings are the engine's */
    const char **names;    /* PyMem: the names of the group in progress */
    unsigned *flags;       /* PyMem: their TW_CAND_* flags, NULL when group() gave none */
} TtModules;

/* Fetches the callbacks of `modules` into m; -1 with TypeError naming the one
 * that is missing or not callable. Release m afterwards either way. */
int tt_modules_init(TtModules *m, TtCall *call, PyObject *modules);
/* Drops what m holds; safe on a zeroed or failed m. */
void tt_modules_release(TtModules *m);
/* The engine's module callbacks, with m as their context. */
void tt_module_ops_init(tw_module_ops *ops, TtModules *m);

PyObject *tt_py_tune_module(PyObject *module, PyObject *args, PyObject *kwargs);

#endif /* TT_SEARCH_H */
