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

/* Called by tt_module_walk per module with its __dict__ (borrowed): > 0 stops
 * the walk and is its result, 0 goes on, < 0 is an error (an exception set). */
typedef int (*tt_module_visit)(TtState *st, PyObject *module, PyObject *dict, void *ctx);

/* Visits `module` and every submodule as they are now (nn.Module._modules,
 * followed from each module's __dict__, depth first), each once however many
 * places it is registered at (shared layers, a tree that contains itself):
 * what a submodule added or replaced since tuning holds is read too. Returns
 * the first visit's result > 0, else 0; -1 on error (TypeError for a
 * submodule that has no __dict__). */
int tt_module_walk(TtState *st, PyObject *module, tt_module_visit visit, void *ctx);

/* 1 when `module` or a submodule is in train mode: its training flag, from its
 * __dict__ or else its class (a property), is true (1, numpy's True and a true
 * tensor count, as they do for dropout and batch norm); 0 when none is; -1 on
 * error. */
int tt_in_train_mode(TtState *st, PyObject *module);

/* 1 when autograd would record the original's work on this call: grad mode
 * is on and an argument (or a tensor in a tuple/list argument) or a
 * parameter of `module` or of a submodule (NULL: none) requires grad; 0 when
 * not; -1 on error. Read only for an entry whose backend returns no autograd
 * outputs. */
int tt_needs_grad(TtState *st, PyObject *module, PyObject *const *args, Py_ssize_t n);

#endif /* TT_GUARD_H */
