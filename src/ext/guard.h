/*
 * guard.h - what the dispatcher checks before a backend runs a call
 * (guard.c): the lock of an entry whose backend is not thread-safe, and the
 * grad rule.
 */
#ifndef TT_GUARD_H
#define TT_GUARD_H

#include "state.h"

/* The lock of a serialised entry, in a capsule of the entries tuple: a call
 * that holds the tuple holds the lock object. Re-entrant for the thread that
 * holds it (a backend that calls its own module again must not deadlock);
 * owner and depth are read and written with the GIL held. */
typedef struct TtEntryLock TtEntryLock;

/* A capsule of a new lock. New reference; NULL with an exception. */
PyObject *tt_entry_lock_new(void);
/* The lock in a capsule made by tt_entry_lock_new. Borrowed from the capsule;
 * NULL with an exception when it is not one. */
TtEntryLock *tt_entry_lock_get(PyObject *capsule);
/* Takes the lock; 0, or -1 with an exception (a signal while waiting). */
int tt_entry_lock_acquire(TtEntryLock *l);
/* Gives back one acquire. */
void tt_entry_lock_release(TtEntryLock *l);

/* 1 when autograd would record the original's work on this call: grad mode
 * is on and an argument (or a tensor in a tuple/list argument) or a
 * parameter of the module requires grad; 0 when not; -1 on error. Read only
 * for an entry whose backend returns no autograd outputs. module_params:
 * NULL, or a tuple of the module's parameter dicts (borrowed; held while
 * read). */
int tt_needs_grad(TtState *st, PyObject *module_params, PyObject *const *args, Py_ssize_t n);

/* weight_change(weights, in_place) -> None or (index, kind): the first entry
 * of `weights` (a list of (table, path, name, tensor, address, version), as
 * torch_tweak._core.model_state.weights_of lists them) whose tensor changed
 * since: kind 0, table[name] is no longer the tensor (replaced); 1, its
 * data_ptr() is no longer address (other memory); 2, with in_place true and a
 * version that is not None, its _version is no longer version (written in
 * place). Read per call of a converted model and per prefill replay. */
PyObject *tt_py_weight_change(PyObject *module, PyObject *args);

#endif /* TT_GUARD_H */
