/*
 * entries.c - a dispatcher's entry table: made from what Python gives
 * (_tt_set_entries), and read back as lists.
 */
#include "entries.h"

#include "guard.h"

/* Checks entry i of what Python gave, a (signature or None, backend[, flags])
 * tuple, and reads its flags into *bits (0 when it has none). -1 on an error
 * that says which entry and what it must be. */
static int
tt_entry_check(TtState *st, PyObject *item, Py_ssize_t i, long *bits)
{
    PyObject *sig, *backend; /* borrowed */
    int rc = -1;

    *bits = 0;
    if (!PyTuple_Check(item) || PyTuple_GET_SIZE(item) < 2 || PyTuple_GET_SIZE(item) > 3) {
        PyErr_Format(PyExc_TypeError,
                     "_tt_set_entries: entry %zd must be a (signature or None, backend[, "
                     "flags]) tuple", i);
        goto cleanup;
    }
    sig = PyTuple_GET_ITEM(item, 0);
    backend = PyTuple_GET_ITEM(item, 1);
    if (PyTuple_GET_SIZE(item) == 3) {
        *bits = PyLong_Check(PyTuple_GET_ITEM(item, 2)) ? PyLong_AsLong(PyTuple_GET_ITEM(item, 2))
                                                        : -1;
        if (*bits == -1 && PyErr_Occurred())
            goto cleanup;
        if (*bits < 0 || *bits > (TT_ENTRY_SERIALIZE | TT_ENTRY_NO_AUTOGRAD |
                                  TT_ENTRY_LAYOUT_ONLY)) {
            PyErr_Format(PyExc_ValueError,
                         "_tt_set_entries: entry %zd: flags must be an int of ENTRY_* bits", i);
            goto cleanup;
        }
    }
    if (sig != Py_None && !PyObject_TypeCheck(sig, st->SignatureType)) {
        PyErr_Format(PyExc_TypeError,
                     "_tt_set_entries: entry %zd: the signature must be a Signature or "
                     "None, not %.100s", i, Py_TYPE(sig)->tp_name);
        goto cleanup;
    }
    if (backend != Py_None && !PyCallable_Check(backend)) {
        PyErr_Format(PyExc_TypeError,
                     "_tt_set_entries: entry %zd: the backend must be callable or None, not %.100s",
                     i, Py_TYPE(backend)->tp_name);
        goto cleanup;
    }
    rc = 0;
cleanup:
    return rc;
}

/* The table's entry i, (signature, backend, cacheable, flags or None, lock or
 * None), from a checked item: cacheable when no entry before it (entries[:i])
 * can take a call it takes. New reference. */
static PyObject *
tt_entry_make(PyObject *entries, Py_ssize_t i, PyObject *item, long bits)
{
    PyObject *sig = PyTuple_GET_ITEM(item, 0);     /* borrowed */
    PyObject *backend = PyTuple_GET_ITEM(item, 1); /* borrowed */
    PyObject *flags = NULL;                        /* new reference */
    PyObject *lock = NULL;                         /* new reference */
    PyObject *entry = NULL;
    Py_ssize_t j;
    int cacheable = 1;

    for (j = 0; j < i && cacheable; j++) {
        PyObject *earlier = PyTuple_GET_ITEM(PyTuple_GET_ITEM(entries, j), 0);
        if (earlier == Py_None || sig == Py_None ||
            tt_signature_overlap((TtSignature *)earlier, (TtSignature *)sig))
            cacheable = 0;
    }
    if ((flags = bits == 0 ? Py_NewRef(Py_None) : PyLong_FromLong(bits)) == NULL)
        goto cleanup;
    if ((lock = (bits & TT_ENTRY_SERIALIZE) ? tt_entry_lock_new() : Py_NewRef(Py_None)) == NULL)
        goto cleanup;
    entry = PyTuple_Pack(5, sig, backend, cacheable ? Py_True : Py_False, flags, lock);
cleanup:
    Py_XDECREF(flags);
    Py_XDECREF(lock);
    return entry;
}

PyObject *
tt_entries_new(TtState *st, PyObject *arg)
{
    PyObject *seq = NULL;     /* new reference */
    PyObject *entries = NULL; /* new reference */
    PyObject *result = NULL;
    PyObject *entry;
    Py_ssize_t i, n;
    long bits;

    /* a tuple of our own: comparing signatures may run an __eq__ */
    seq = tt_sequence_tuple(arg, "_tt_set_entries: entries must be a sequence");
    if (seq == NULL)
        goto cleanup;
    n = PySequence_Fast_GET_SIZE(seq);
    if ((entries = PyTuple_New(n)) == NULL)
        goto cleanup;
    for (i = 0; i < n; i++) {
        PyObject *item = PySequence_Fast_GET_ITEM(seq, i); /* borrowed */

        if (tt_entry_check(st, item, i, &bits) < 0)
            goto cleanup;
        if ((entry = tt_entry_make(entries, i, item, bits)) == NULL)
            goto cleanup;
        PyTuple_SET_ITEM(entries, i, entry);
    }
    result = entries;
    entries = NULL;
cleanup:
    Py_XDECREF(seq);
    Py_XDECREF(entries);
    return result;
}

/* One entry's (signature or None, backend). New reference. */
static PyObject *
tt_entry_pair(PyObject *entry)
{
    return PyTuple_Pack(2, PyTuple_GET_ITEM(entry, 0), PyTuple_GET_ITEM(entry, 1));
}

/* One entry's flags as an int, 0 where none were given (see entries.h). New
 * reference. */
static PyObject *
tt_entry_flags(PyObject *entry)
{
    PyObject *flags = PyTuple_GET_ITEM(entry, 3); /* borrowed */

    return flags == Py_None ? PyLong_FromLong(0) : Py_NewRef(flags);
}

/* A list of pick(entry) for every entry, in order. New reference. */
static PyObject *
tt_entries_list(PyObject *entries, PyObject *(*pick)(PyObject *entry))
{
    PyObject *list = NULL;
    Py_ssize_t i, n;

    n = entries != NULL ? PyTuple_GET_SIZE(entries) : 0;
    if ((list = PyList_New(n)) == NULL)
        goto error;
    for (i = 0; i < n; i++) {
        PyObject *item = pick(PyTuple_GET_ITEM(entries, i)); /* new reference, stolen by the list */

        if (item == NULL)
            goto error;
        PyList_SET_ITEM(list, i, item);
    }
    return list;
error:
    Py_XDECREF(list);
    return NULL;
}

PyObject *
tt_entries_pairs(PyObject *entries)
{
    return tt_entries_list(entries, tt_entry_pair);
}

PyObject *
tt_entries_flags(PyObject *entries)
{
    return tt_entries_list(entries, tt_entry_flags);
}
