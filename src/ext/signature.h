/*
 * signature.h - what one call looked like, and whether another call fits it
 * (signature.c). The binding and matching of the per-call path are inline
 * here, so that the dispatcher's vectorcall keeps them in its own code.
 */
#ifndef TT_SIGNATURE_H
#define TT_SIGNATURE_H

#include "argspec.h"

typedef struct {
    PyObject_HEAD
    TtState *state;     /* of the owning module; outlives the type, so this object */
    Py_ssize_t nargs;   /* positional arguments */
    PyObject *kwnames;  /* tuple of str in the recorded order */
    Py_ssize_t nspecs;  /* nargs + len(kwnames); 0 after tp_clear */
    TtArgSpec *specs;   /* positional, then keyword in kwnames order */
    /* The names of forward's leading parameters that take a position (None
     * for a positional-only one), so that a call binds by name: () when
     * unknown, then only keywords are re-ordered. */
    PyObject *params;
} TtSignature;

/* Room for a call laid out again in a signature's recorded order: slot 0 is
 * free for PY_VECTORCALL_ARGUMENTS_OFFSET, the arguments follow. A call of
 * up to TT_SMALL_STACK - 1 arguments uses the array in the caller's frame. */
#define TT_SMALL_STACK 16

typedef struct TtStack {
    PyObject *small[TT_SMALL_STACK];
    PyObject **heap;  /* NULL until a call needs more than small */
    Py_ssize_t room;  /* slots of heap */
} TtStack;

/* A buffer of at least n + 1 slots, owned by stack; NULL with MemoryError. */
static TT_INLINE PyObject **
tt_stack_reserve(TtStack *stack, Py_ssize_t n)
{
    PyObject **mem = NULL;

    if (TT_LIKELY(n + 1 <= TT_SMALL_STACK)) {
        mem = stack->small;
        goto cleanup;
    }
    if (stack->heap != NULL && stack->room >= n + 1) {
        mem = stack->heap;
        goto cleanup;
    }
    mem = PyMem_Realloc(stack->heap, sizeof(PyObject *) * (size_t)(n + 1));
    if (mem == NULL) {
        PyErr_NoMemory();
        goto cleanup;
    }
    stack->heap = mem;
    stack->room = n + 1;
cleanup:
    return mem;
}


/* Keyword names are str (the interpreter checks), usually the same interned
 * objects: identity first. */
static TT_INLINE int
tt_name_eq(PyObject *a, PyObject *b)
{
    return a == b || (PyUnicode_GET_LENGTH(a) == PyUnicode_GET_LENGTH(b) &&
                      PyUnicode_Compare(a, b) == 0);
}

/* The index of `name` among the first n items of `names` (str or None), or -1. */
static TT_INLINE Py_ssize_t
tt_names_find(PyObject *names, Py_ssize_t n, PyObject *name)
{
    Py_ssize_t i;

    for (i = 0; i < n; i++) {
        PyObject *known = PyTuple_GET_ITEM(names, i); /* borrowed */
        if (known != Py_None && tt_name_eq(known, name))
            return i;
    }
    return -1;
}


/* The call laid out as `sig` was recorded: sig->nargs positional arguments,
 * then the keywords in sig->kwnames' order. 1 with *out = args when the
 * caller used that layout (nothing copied: the fast path), or *out = one
 * slot past the start of a buffer of `stack` holding the arguments
 * (borrowed) in the recorded order, an argument passed by position bound to
 * the keyword of its parameter's name and back (sig->params); 0 when the
 * call does not lay out so (other names or counts); -1 on MemoryError. */
static TT_INLINE int
tt_signature_bind(const TtSignature *sig, PyObject *const *args, Py_ssize_t nargs,
                  PyObject *kwnames, TtStack *stack, PyObject *const **out)
{
    Py_ssize_t nkw = kwnames != NULL ? PyTuple_GET_SIZE(kwnames) : 0;
    Py_ssize_t nparams, i, at;
    PyObject **buf;
    int rc = 0;

    if (TT_UNLIKELY(sig->specs == NULL) || nargs + nkw != sig->nspecs)
        goto cleanup;
    if (TT_LIKELY(nargs == sig->nargs)) {
        for (i = 0; i < nkw; i++)
            if (!tt_name_eq(PyTuple_GET_ITEM(kwnames, i), PyTuple_GET_ITEM(sig->kwnames, i)))
                break;
        if (TT_LIKELY(i == nkw)) {
            *out = args;
            rc = 1;
            goto cleanup;
        }
    }
    if ((buf = tt_stack_reserve(stack, sig->nspecs)) == NULL) {
        rc = -1;
        goto cleanup;
    }
    nparams = PyTuple_GET_SIZE(sig->params);
    /* The constructor checked that no recorded keyword names a parameter the
     * recorded call filled by position, so each recorded slot takes a
     * different argument of the call, and with equal counts every one. */
    for (i = 0; i < sig->nspecs; i++) {
        PyObject *value = NULL; /* borrowed */
        PyObject *name;         /* borrowed */

        if (i < sig->nargs) {
            if (i < nargs) {
                value = args[i];
            }
            else if (i < nparams && (name = PyTuple_GET_ITEM(sig->params, i)) != Py_None) {
                if ((at = tt_names_find(kwnames, nkw, name)) >= 0)
                    value = args[nargs + at];
            }
        }
        else {
            name = PyTuple_GET_ITEM(sig->kwnames, i - sig->nargs);
            if ((at = tt_names_find(kwnames, nkw, name)) >= 0)
                value = args[nargs + at];
            else if ((at = tt_names_find(sig->params, nparams < nargs ? nparams : nargs,
                                         name)) >= 0)
                value = args[at];
        }
        if (value == NULL)
            goto cleanup; /* rc 0 */
        buf[i + 1] = value;
    }
    *out = buf + 1;
    rc = 1;
cleanup:
    return rc;
}

/* 1 when the bound arguments (recorded layout) fit every spec, 0 when not,
 * -1 on a BaseException. */
static TT_INLINE int
tt_signature_match_bound(const TtSignature *sig, PyObject *const *bound)
{
    Py_ssize_t i;
    int rc = 1;

    for (i = 0; i < sig->nspecs && rc == 1; i++)
        rc = tt_spec_match(sig->state, &sig->specs[i], bound[i]);
    return rc;
}


/* 1 when `sig` (a Signature, unchecked) fits the call given in vectorcall
 * layout, 0 when not, -1 on a BaseException that is not an Exception. */
int tt_signature_fits(PyObject *sig, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames);
/* Whether some call could fit both (1) or surely not (0). */
int tt_signature_overlap(const TtSignature *a, const TtSignature *b);
/* Adds Signature to the module and fills st->SignatureType. -1 on error. */
int tt_signature_exec(PyObject *module, TtState *st);

/* set_value_keyer(fn or None): fn(value) -> a hashable key of the value's
 * structure, or None for a value compared as itself. Signatures made after the
 * call describe a value fn keys by its key (see TT_ARG_KEYED). */
PyObject *tt_py_set_value_keyer(PyObject *module, PyObject *keyer);

#endif /* TT_SIGNATURE_H */
