/*
 * entries.h - a dispatcher's entry table and how a call finds its entry
 * (entries.c). The finding runs on every tuned call, so it is inline here.
 */
#ifndef TT_ENTRIES_H
#define TT_ENTRIES_H

#include "signature.h"

/* Per entry, what its backend cannot do (_tt_set_entries' flags). */
enum {
    TT_ENTRY_SERIALIZE = 1,   /* not thread-safe: one call at a time, under the entry's lock */
    TT_ENTRY_NO_AUTOGRAD = 2, /* outputs carry no autograd history */
    TT_ENTRY_LAYOUT_ONLY = 4  /* the backend checks the values itself: only bind the layout */
};

/* An entry table is a tuple of (signature or None, backend, cacheable, flags,
 * lock or None) tuples. backend None: the calls the signature fits run the
 * original, counted as unmatched (a signature tuning kept on the original,
 * which a later, wider entry must not serve). cacheable: no earlier entry can match a call this one
 * matches, so trying it first keeps first-match semantics. flags: TT_ENTRY_*,
 * an int, None for 0 (one compare on the hot path); lock: a capsule of a
 * TtEntryLock (guard.h) for TT_ENTRY_SERIALIZE. A table is replaced whole,
 * never mutated: a call holds a reference while it walks, so a backend may
 * set new entries. */

/* The entry a call goes to: its backend (borrowed from the entries the caller
 * holds) and the call laid out for it. */
typedef struct TtHit {
    PyObject *backend;
    PyObject *const *args;
    size_t nargsf;
    PyObject *kwnames;
    Py_ssize_t n;        /* arguments in args */
    long flags;
    PyObject *lock;      /* the capsule, or NULL */
} TtHit;

/* 1 when `entry` takes the call, filling *hit; 0 when not; -1 on error. */
static TT_INLINE int
tt_entry_take(PyObject *entry, PyObject *const *args, size_t nargsf, PyObject *kwnames,
              TtStack *stack, TtHit *hit)
{
    PyObject *sig = PyTuple_GET_ITEM(entry, 0);   /* borrowed */
    PyObject *flag = PyTuple_GET_ITEM(entry, 3);  /* borrowed: None for no flags */
    PyObject *const *bound = args;
    long flags = TT_LIKELY(flag == Py_None) ? 0 : PyLong_AsLong(flag);
    int rc = 1;

    if (sig != Py_None) {
        rc = tt_signature_bind((TtSignature *)sig, args, PyVectorcall_NARGS(nargsf), kwnames,
                               stack, &bound);
        if (TT_LIKELY(rc == 1) && !(flags & TT_ENTRY_LAYOUT_ONLY))
            rc = tt_signature_match_bound((TtSignature *)sig, bound);
        if (rc != 1)
            goto cleanup;
    }
    hit->backend = PyTuple_GET_ITEM(entry, 1);
    hit->flags = flags;
    hit->lock = TT_LIKELY(flags == 0) ? NULL : PyTuple_GET_ITEM(entry, 4);
    if (hit->lock == Py_None)
        hit->lock = NULL;
    if (TT_LIKELY(bound == args)) {
        /* the caller's args, offset flag included, go through untouched */
        hit->args = args;
        hit->nargsf = nargsf;
        hit->kwnames = kwnames;
        hit->n = PyVectorcall_NARGS(nargsf) + (kwnames != NULL ? PyTuple_GET_SIZE(kwnames) : 0);
    }
    else {
        hit->args = bound;
        hit->nargsf = (size_t)((TtSignature *)sig)->nargs | PY_VECTORCALL_ARGUMENTS_OFFSET;
        hit->kwnames = PyTuple_GET_SIZE(((TtSignature *)sig)->kwnames) > 0
                           ? ((TtSignature *)sig)->kwnames : NULL;
        hit->n = ((TtSignature *)sig)->nspecs;
    }
cleanup:
    return rc;
}

/* 1 and *hit when an entry fits; 0 when none does; -1 on error. *last: the
 * index of the last entry that fitted, tried first (and updated). */
static inline int
tt_entries_find(PyObject *entries, Py_ssize_t *last, PyObject *const *args, size_t nargsf,
                PyObject *kwnames, TtStack *stack, TtHit *hit)
{
    Py_ssize_t n = PyTuple_GET_SIZE(entries);
    Py_ssize_t tried = *last, i;
    PyObject *entry; /* borrowed */
    int rc = 0;

    if (TT_LIKELY(tried < n)) {
        entry = PyTuple_GET_ITEM(entries, tried);
        if (PyTuple_GET_ITEM(entry, 2) == Py_True) {
            rc = tt_entry_take(entry, args, nargsf, kwnames, stack, hit);
            if (TT_LIKELY(rc != 0))
                goto cleanup;
        }
        else {
            tried = -1;
        }
    }
    for (i = 0; i < n; i++) {
        if (i == tried)
            continue;
        rc = tt_entry_take(PyTuple_GET_ITEM(entries, i), args, nargsf, kwnames, stack, hit);
        if (rc == 1)
            *last = i;
        if (rc != 0)
            goto cleanup;
    }
    rc = 0;
cleanup:
    return rc;
}

/* The entry table of `arg`, a sequence of (signature or None, backend[,
 * flags]) tuples; errors name the method, "_tt_set_entries". New reference;
 * NULL with an exception. */
PyObject *tt_entries_new(TtState *st, PyObject *arg);

/* A list of every entry's (signature or None, backend), in order. entries may
 * be NULL (an empty list). New reference. */
PyObject *tt_entries_pairs(PyObject *entries);
/* A list of every entry's flags as an int, 0 where none were given. New
 * reference. */
PyObject *tt_entries_flags(PyObject *entries);

#endif /* TT_ENTRIES_H */
