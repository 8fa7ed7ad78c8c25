/*
 * dispatcher.h - the Dispatcher type, the per-call path of a tuned module
 * (dispatcher.c).
 */
#ifndef TT_DISPATCHER_H
#define TT_DISPATCHER_H

#include "state.h"

/* enable_vectorcall(cls) -> bool (METH_O). */
PyObject *tt_py_enable_vectorcall(PyObject *module, PyObject *cls);
/* Adds Dispatcher and the ENTRY_* flags; fills st->DispatcherType. -1 on error. */
int tt_dispatcher_exec(PyObject *module, TtState *st);

#endif /* TT_DISPATCHER_H */
