/*
 * rootcall.h - the call of a module tuned in place (rootcall.c): the
 * __call__ of the subclass a tuned module's class becomes, which sends the
 * call to the module's wrapper.
 */
#ifndef TT_ROOTCALL_H
#define TT_ROOTCALL_H

#include "state.h"

/* Adds root_call, the one RootCall object, to the module. -1 on error. */
int tt_root_call_exec(PyObject *module, TtState *st);

#endif /* TT_ROOTCALL_H */
