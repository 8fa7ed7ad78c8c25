/*
 * baked.c - whether what a converted model took in at its build changed since
 * (see baked.h): its weights (weight_change, with the bytes weight_sample
 * took of each), its attributes and tables (dict_change), its modules'
 * classes and their forward (class_change). Each reads only what it was
 * given, first difference first, so that the usual call, where nothing
 * changed, costs a pass over the lists.
 */
#include "baked.h"

#include <stdint.h>
#include <string.h>

#define TT_SAMPLE_WHOLE (TT_SAMPLE_PIECES * TT_SAMPLE_PIECE)

/* Nonzero when the TT_SAMPLE_PIECE bytes at `a` and `b` differ: compared eight
 * bytes at a time, without a branch or a call. */
static TT_INLINE uint64_t
tt_piece_differs(const char *a, const char *b)
{
    uint64_t x, y, diff = 0;
    size_t k;

    for (k = 0; k < TT_SAMPLE_PIECE; k += sizeof(uint64_t)) {
        memcpy(&x, a + k, sizeof(x));
        memcpy(&y, b + k, sizeof(y));
        diff |= x ^ y;
    }
    return diff;
}

/* The sampled bytes of the `span` bytes at `at`: copied into `to` (cmp NULL),
 * or compared with `cmp` (to NULL): 1 when they differ, else 0. A span of more
 * than TT_SAMPLE_WHOLE bytes gives TT_SAMPLE_PIECES pieces, piece i at
 * i * (span - TT_SAMPLE_PIECE) / (TT_SAMPLE_PIECES - 1) (spread evenly, the
 * last at the end; computed without overflow). */
static int
tt_sample(const char *at, size_t span, char *to, const char *cmp)
{
    size_t i, room = span - TT_SAMPLE_PIECE, last = TT_SAMPLE_PIECES - 1;
    size_t step = room / last, rest = room % last;
    const char *piece[TT_SAMPLE_PIECES];
    uint64_t diff = 0;

    if (span <= TT_SAMPLE_WHOLE) {
        if (cmp != NULL)
            return memcmp(at, cmp, span) != 0;
        memcpy(to, at, span);
        return 0;
    }
    for (i = 0; i < TT_SAMPLE_PIECES; i++) {
        piece[i] = at + step * i + rest * i / last;
#if defined(__GNUC__) || defined(__clang__)
        /* far apart, each likely out of the caches: asked for at once, their
         * reads from memory overlap instead of following one another */
        __builtin_prefetch(piece[i]);
#endif
    }
    for (i = 0; i < TT_SAMPLE_PIECES; i++) {
        if (cmp != NULL)
            diff |= tt_piece_differs(piece[i], cmp + i * TT_SAMPLE_PIECE);
        else
            memcpy(to + i * TT_SAMPLE_PIECE, piece[i], TT_SAMPLE_PIECE);
    }
    return diff != 0;
}

/* tensor.data_ptr() into *at. 0, or -1 with an exception. */
static int
tt_address(TtState *st, PyObject *tensor, const char **at)
{
    PyObject *ptr = PyObject_CallMethodNoArgs(tensor, st->str_data_ptr); /* new reference */
    void *p;

    if (ptr == NULL)
        return -1;
    p = PyLong_AsVoidPtr(ptr);
    Py_DECREF(ptr);
    if (p == NULL && PyErr_Occurred())
        return -1;
    *at = p;
    return 0;
}

PyObject *
tt_py_weight_sample(PyObject *module, PyObject *args)
{
    TtState *st = (TtState *)PyModule_GetState(module);
    PyObject *tensor, *out = NULL; /* borrowed; new reference */
    const char *at = NULL;
    Py_ssize_t span;

    if (!PyArg_ParseTuple(args, "On:weight_sample", &tensor, &span))
        goto cleanup;
    if (span < 0) {
        PyErr_SetString(PyExc_ValueError, "weight_sample: span must be 0 or more bytes");
        goto cleanup;
    }
    if (tt_address(st, tensor, &at) < 0)
        goto cleanup;
    if (at == NULL && span > 0) {
        PyErr_SetString(PyExc_ValueError, "weight_sample: the tensor has no memory (data_ptr() is 0)");
        goto cleanup;
    }
    out = PyBytes_FromStringAndSize(NULL, span <= TT_SAMPLE_WHOLE ? span : TT_SAMPLE_WHOLE);
    if (out != NULL && span > 0)
        tt_sample(at, (size_t)span, PyBytes_AS_STRING(out), NULL);
cleanup:
    return out;
}

/* 1 when `now` (a new reference, consumed; NULL with an exception) is not
 * equal to `then`; 0 when equal; -1 on error. */
static int
tt_differs(PyObject *now, PyObject *then)
{
    int rc;

    if (now == NULL)
        return -1;
    rc = PyObject_RichCompareBool(now, then, Py_NE);
    Py_DECREF(now);
    return rc;
}

/* What `table` (a dict, or a list or tuple) holds at `name` (a key; an index):
 * borrowed, NULL when nothing (an index out of range included); -1 with an
 * exception, else 0. */
static int
tt_table_item(PyObject *table, PyObject *name, PyObject **now)
{
    Py_ssize_t i;

    *now = NULL;
    if (PyDict_Check(table)) {
        *now = PyDict_GetItemWithError(table, name);
        return *now == NULL && PyErr_Occurred() ? -1 : 0;
    }
    if (!PyLong_Check(name)) {
        PyErr_SetString(PyExc_TypeError, "weight_change: a list's or tuple's entry names an index");
        return -1;
    }
    i = PyLong_AsSsize_t(name);
    if (i == -1 && PyErr_Occurred())
        return -1;
    if (i >= 0 && i < PySequence_Fast_GET_SIZE(table))
        *now = PySequence_Fast_GET_ITEM(table, i);
    return 0;
}

/* 1 when the bytes at `at` no longer hold the entry's sample (span, sample
 * from the entry); 0 when they do or the entry has none; -1 with an
 * exception. */
static int
tt_sample_differs(const char *at, PyObject *span_obj, PyObject *sample)
{
    Py_ssize_t span = PyLong_AsSsize_t(span_obj);

    if (span == -1 && PyErr_Occurred())
        return -1;
    if (span <= 0)
        return 0;
    if (!PyBytes_Check(sample) ||
        PyBytes_GET_SIZE(sample) != (span <= TT_SAMPLE_WHOLE ? span : TT_SAMPLE_WHOLE) || at == NULL) {
        PyErr_SetString(PyExc_ValueError, "weight_change: an entry's sample is not weight_sample's "
                                          "of its span at its address");
        return -1;
    }
    return tt_sample(at, (size_t)span, NULL, PyBytes_AS_STRING(sample));
}

/* The kind of change of one weights_of entry (see baked.h): -1 none, 0
 * replaced, 1 other memory, 2 written in place, 3 written behind its version
 * counter; -2 on error (an exception set). */
static int
tt_weight_entry_change(TtState *st, PyObject *entry, int in_place)
{
    PyObject *table, *tensor, *version; /* borrowed from entry */
    PyObject *now;                      /* borrowed from table */
    const char *at = NULL;
    void *then;
    int rc;

    if (!PyTuple_Check(entry) || PyTuple_GET_SIZE(entry) != 8 ||
        !(PyDict_Check(PyTuple_GET_ITEM(entry, 0)) || PyList_Check(PyTuple_GET_ITEM(entry, 0)) ||
          PyTuple_Check(PyTuple_GET_ITEM(entry, 0))) ||
        !PyLong_Check(PyTuple_GET_ITEM(entry, 4)) || !PyLong_Check(PyTuple_GET_ITEM(entry, 6))) {
        PyErr_SetString(PyExc_TypeError, "weight_change: each entry must be a tuple (table, path, name, "
                                         "tensor, address, version, span, sample) as weights_of makes");
        return -2;
    }
    table = PyTuple_GET_ITEM(entry, 0);
    tensor = PyTuple_GET_ITEM(entry, 3);
    version = PyTuple_GET_ITEM(entry, 5);
    if (tt_table_item(table, PyTuple_GET_ITEM(entry, 2), &now) < 0)
        return -2;
    if (now != tensor)
        return 0;
    if (tt_address(st, tensor, &at) < 0)
        return -2;
    then = PyLong_AsVoidPtr(PyTuple_GET_ITEM(entry, 4));
    if (then == NULL && PyErr_Occurred())
        return -2;
    if ((const char *)then != at)
        return 1;
    if (!in_place)
        return -1;
    if (version != Py_None) {
        rc = tt_differs(PyObject_GetAttr(tensor, st->str_version), version);
        if (rc != 0)
            return rc < 0 ? -2 : 2;
    }
    rc = tt_sample_differs(at, PyTuple_GET_ITEM(entry, 6), PyTuple_GET_ITEM(entry, 7));
    return rc < 0 ? -2 : rc ? 3 : -1;
}

PyObject *
tt_py_weight_change(PyObject *module, PyObject *args)
{
    TtState *st = (TtState *)PyModule_GetState(module);
    PyObject *weights, *entry; /* borrowed */
    Py_ssize_t i;
    int in_place, kind;

    if (!PyArg_ParseTuple(args, "O!p:weight_change", &PyList_Type, &weights, &in_place))
        return NULL;
    for (i = 0; i < PyList_GET_SIZE(weights); i++) {
        entry = Py_NewRef(PyList_GET_ITEM(weights, i)); /* held: a call below may run Python */
        kind = tt_weight_entry_change(st, entry, in_place);
        Py_DECREF(entry);
        if (kind == -2)
            return NULL;
        if (kind >= 0)
            return Py_BuildValue("(ni)", i, kind);
    }
    Py_RETURN_NONE;
}

/* 1 when `now` is `then` or equal to it, 0 when not, -1 on error. Lists and
 * tuples are equal only to one of the same type, item by item (to a depth),
 * and a tensor is equal only to itself: its __eq__ gives a tensor, which has
 * no truth beyond one value. `tensor_type` NULL: torch is not imported. */
static int
tt_same_value(PyTypeObject *tensor_type, PyObject *now, PyObject *then, int depth)
{
    PyObject *a, *b; /* new references */
    Py_ssize_t i;
    int rc = 1;

    if (now == then)
        return 1;
    if (tensor_type != NULL && (PyObject_TypeCheck(now, tensor_type) || PyObject_TypeCheck(then, tensor_type)))
        return 0;
    if (!(PyList_Check(now) || PyTuple_Check(now) || PyList_Check(then) || PyTuple_Check(then)))
        return PyObject_RichCompareBool(now, then, Py_EQ);
    if (Py_TYPE(now) != Py_TYPE(then))
        return 0; /* a list where a tuple was, a subclass: another value, never items' __eq__ */
    if (depth >= 8)
        return PyObject_RichCompareBool(now, then, Py_EQ);
    if (PySequence_Fast_GET_SIZE(now) != PySequence_Fast_GET_SIZE(then))
        return 0;
    /* a list may change while an item's __eq__ runs: its size is read again */
    for (i = 0; rc == 1 && i < PySequence_Fast_GET_SIZE(then); i++) {
        if (i >= PySequence_Fast_GET_SIZE(now))
            return 0;
        a = Py_NewRef(PySequence_Fast_GET_ITEM(now, i));
        b = Py_NewRef(PySequence_Fast_GET_ITEM(then, i));
        rc = tt_same_value(tensor_type, a, b, depth + 1);
        Py_DECREF(a);
        Py_DECREF(b);
    }
    if (rc == 1 && PySequence_Fast_GET_SIZE(now) != PySequence_Fast_GET_SIZE(then))
        rc = 0;
    return rc;
}

/* What `live` no longer holds of `saved`: NULL with *key NULL when it holds it
 * all; else *key is the first key whose value is another object (by_value:
 * another object that is not the same value, tt_same_value) or is gone, or
 * Py_None when only the size differs from `size` (>= 0). *key is a new
 * reference. -1 on error, else 0. */
static int
tt_dict_differs(PyTypeObject *tensor_type, PyObject *live, PyObject *saved, Py_ssize_t size,
                int by_value, PyObject **key)
{
    PyObject *name, *value, *now; /* borrowed */
    Py_ssize_t pos = 0;
    int rc = 0, same;

    *key = NULL;
    Py_INCREF(saved); /* held: a key's __eq__, a value's __eq__ may run Python */
    while (rc == 0 && *key == NULL && PyDict_Next(saved, &pos, &name, &value)) {
        now = PyDict_GetItemWithError(live, name);
        if (now == NULL) {
            if (PyErr_Occurred())
                rc = -1;
            else
                *key = Py_NewRef(name);
        }
        else if (now != value) {
            Py_INCREF(now);
            Py_INCREF(value);
            same = by_value ? tt_same_value(tensor_type, now, value, 0) : 0;
            Py_DECREF(now);
            Py_DECREF(value);
            if (same < 0)
                rc = -1;
            else if (!same)
                *key = Py_NewRef(name);
        }
    }
    Py_DECREF(saved);
    if (rc == 0 && *key == NULL && size >= 0 && PyDict_GET_SIZE(live) != size)
        *key = Py_NewRef(Py_None);
    return rc;
}

PyObject *
tt_py_dict_change(PyObject *module, PyObject *pairs)
{
    TtState *st = (TtState *)PyModule_GetState(module);
    PyTypeObject *tensor_type;   /* borrowed */
    PyObject *pair, *key = NULL; /* new references */
    Py_ssize_t i, size = -1;
    int rc = 0, by_value;

    if (!PyList_Check(pairs)) {
        PyErr_SetString(PyExc_TypeError,
                        "dict_change: a list of (live dict, saved dict, size, by value)");
        return NULL;
    }
    tensor_type = tt_state_tensor_type(st);
    if (tensor_type == NULL && PyErr_Occurred())
        return NULL;
    for (i = 0; i < PyList_GET_SIZE(pairs) && rc == 0 && key == NULL; i++) {
        pair = Py_NewRef(PyList_GET_ITEM(pairs, i));
        if (!PyTuple_Check(pair) || PyTuple_GET_SIZE(pair) != 4 ||
            !PyDict_Check(PyTuple_GET_ITEM(pair, 0)) || !PyDict_Check(PyTuple_GET_ITEM(pair, 1)) ||
            !PyLong_Check(PyTuple_GET_ITEM(pair, 2))) {
            PyErr_SetString(PyExc_TypeError, "dict_change: each entry must be a tuple (live dict, "
                                             "saved dict, size or -1, by value)");
            rc = -1;
        }
        else if ((size = PyLong_AsSsize_t(PyTuple_GET_ITEM(pair, 2))) == -1 && PyErr_Occurred()) {
            rc = -1;
        }
        else if ((by_value = PyObject_IsTrue(PyTuple_GET_ITEM(pair, 3))) < 0) {
            rc = -1;
        }
        else {
            rc = tt_dict_differs(tensor_type, PyTuple_GET_ITEM(pair, 0), PyTuple_GET_ITEM(pair, 1),
                                 size, by_value, &key);
        }
        Py_DECREF(pair);
    }
    if (rc < 0)
        return NULL;
    if (key == NULL)
        Py_RETURN_NONE;
    return Py_BuildValue("(nN)", i - 1, key);
}

/* 1 when one class_change entry no longer holds, 0 when it does, -1 with an
 * exception. */
static int
tt_class_entry_change(PyObject *entry)
{
    PyObject *obj, *name, *expected; /* borrowed from entry */
    PyObject *now;                   /* new reference */
    int same;

    if (!PyTuple_Check(entry) || PyTuple_GET_SIZE(entry) != 3 ||
        !(PyTuple_GET_ITEM(entry, 1) == Py_None || PyUnicode_Check(PyTuple_GET_ITEM(entry, 1)))) {
        PyErr_SetString(PyExc_TypeError, "class_change: each entry must be a tuple (module, None, its "
                                         "class) or (class, attribute name, its value)");
        return -1;
    }
    obj = PyTuple_GET_ITEM(entry, 0);
    name = PyTuple_GET_ITEM(entry, 1);
    expected = PyTuple_GET_ITEM(entry, 2);
    if (name == Py_None)
        return (PyObject *)Py_TYPE(obj) != expected;
    now = PyObject_GetAttr(obj, name);
    if (now == NULL) {
        if (!PyErr_ExceptionMatches(PyExc_AttributeError))
            return -1;
        PyErr_Clear(); /* gone: changed */
        return 1;
    }
    same = PyObject_RichCompareBool(now, expected, Py_EQ);
    Py_DECREF(now);
    return same < 0 ? -1 : !same;
}

PyObject *
tt_py_class_change(PyObject *module, PyObject *entries)
{
    PyObject *entry; /* new reference */
    Py_ssize_t i;
    int rc;

    (void)module;
    if (!PyList_Check(entries)) {
        PyErr_SetString(PyExc_TypeError, "class_change: a list of (object, attribute name or None, "
                                         "expected)");
        return NULL;
    }
    for (i = 0; i < PyList_GET_SIZE(entries); i++) {
        entry = Py_NewRef(PyList_GET_ITEM(entries, i)); /* held: a getattr may run Python */
        rc = tt_class_entry_change(entry);
        Py_DECREF(entry);
        if (rc < 0)
            return NULL;
        if (rc)
            return PyLong_FromSsize_t(i);
    }
    Py_RETURN_NONE;
}
