/*
 * signature.c - the Signature type: what one call looked like (argument
 * count, keyword names, per argument an argspec), and a check that another
 * call fits it.
 */
#include "signature.h"

#include <string.h>

/* 1 when `sig` fits the call (vectorcall layout) once bound to its recorded
 * layout, 0 when not, -1 on error. */
static int
tt_signature_match(TtSignature *sig, PyObject *const *args, Py_ssize_t nargs,
                   PyObject *kwnames)
{
    TtStack stack;
    PyObject *const *bound = NULL;
    int rc;

    stack.heap = NULL;
    stack.room = 0;
    rc = tt_signature_bind(sig, args, nargs, kwnames, &stack, &bound);
    if (rc == 1)
        rc = tt_signature_match_bound(sig, bound);
    PyMem_Free(stack.heap);
    return rc;
}

/* tt_signature_match for the other files of the extension (signature.h). */
int
tt_signature_fits(PyObject *sig, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames)
{
    return tt_signature_match((TtSignature *)sig, args, nargs, kwnames);
}


int
tt_signature_overlap(const TtSignature *a, const TtSignature *b)
{
    Py_ssize_t i, j, nkw;

    if (a->specs == NULL || b->specs == NULL)
        return 1; /* cleared by the GC: unsure */
    if (a->nspecs != b->nspecs)
        return 0;
    if (a->nargs != b->nargs) /* unsure when a call can bind to either layout */
        return PyTuple_GET_SIZE(a->params) > 0 || PyTuple_GET_SIZE(b->params) > 0;
    for (i = 0; i < a->nargs; i++)
        if (!tt_spec_overlap(&a->specs[i], &b->specs[i]))
            return 0;
    nkw = a->nspecs - a->nargs;
    for (i = 0; i < nkw; i++) {
        PyObject *name = PyTuple_GET_ITEM(a->kwnames, i);
        int found = 0;

        for (j = 0; j < nkw && !found; j++) {
            int eq = PyUnicode_Compare(name, PyTuple_GET_ITEM(b->kwnames, j)) == 0;
            if (eq) {
                found = 1;
                if (!tt_spec_overlap(&a->specs[a->nargs + i], &b->specs[b->nargs + j]))
                    return 0;
            }
        }
        if (!found)
            return 0;
    }
    return 1;
}

/* self->params from `params` (None or a sequence of str or None), checked:
 * distinct names, and none that the recorded call gave both by position and
 * by keyword. -1 on error. */
static int
tt_signature_set_params(TtSignature *self, PyObject *params)
{
    PyObject *seq = NULL;   /* new reference */
    PyObject *names = NULL; /* new reference */
    Py_ssize_t i, n;
    int rc = -1;

    if (params == Py_None) {
        names = PyTuple_New(0);
        if (names == NULL)
            goto cleanup;
        goto done;
    }
    seq = tt_sequence_tuple(params, "Signature: params must be a sequence of str or None");
    if (seq == NULL)
        goto cleanup;
    n = PySequence_Fast_GET_SIZE(seq);
    if ((names = PyTuple_New(n)) == NULL)
        goto cleanup;
    for (i = 0; i < n; i++) {
        PyObject *name = PySequence_Fast_GET_ITEM(seq, i); /* borrowed */

        if (name != Py_None && !PyUnicode_CheckExact(name)) {
            PyErr_Format(PyExc_TypeError, "Signature: params[%zd] must be a str or None, not %.100s",
                         i, Py_TYPE(name)->tp_name);
            goto cleanup;
        }
        Py_INCREF(name);
        if (name != Py_None)
            PyUnicode_InternInPlace(&name);
        PyTuple_SET_ITEM(names, i, name);
        if (name != Py_None && tt_names_find(names, i, name) >= 0) {
            PyErr_Format(PyExc_ValueError, "Signature: parameter %R is named twice", name);
            goto cleanup;
        }
        if (name != Py_None && i < self->nargs &&
            tt_names_find(self->kwnames, PyTuple_GET_SIZE(self->kwnames), name) >= 0) {
            PyErr_Format(PyExc_ValueError,
                         "Signature: parameter %R is given both by position and by keyword", name);
            goto cleanup;
        }
    }
done:
    Py_XSETREF(self->params, names);
    names = NULL;
    rc = 0;
cleanup:
    Py_XDECREF(seq);
    Py_XDECREF(names);
    return rc;
}

/* self's spec of argument i (of call_args, then of items, kwargs' (name,
 * value) pairs, whose names become self->kwnames), its free axes `axes` (None,
 * True or a sequence; borrowed, NULL for none). -1 on an error naming the
 * argument. */
static int
tt_signature_build_spec(TtSignature *self, Py_ssize_t i, PyObject *call_args, PyObject *items,
                        PyObject *axes)
{
    PyObject *value;        /* borrowed from call_args or items */
    PyObject *where = NULL; /* new reference: the argument's name for errors */
    int rc = -1;

    if (i < self->nargs) {
        value = PyTuple_GET_ITEM(call_args, i);
        where = PyUnicode_FromFormat("argument %zd", i);
    }
    else {
        PyObject *pair = PyList_GET_ITEM(items, i - self->nargs);
        PyObject *key = PyTuple_GET_ITEM(pair, 0);

        value = PyTuple_GET_ITEM(pair, 1);
        if (!PyUnicode_CheckExact(key)) {
            PyErr_SetString(PyExc_TypeError, "Signature: keyword names must be str");
            goto cleanup;
        }
        Py_INCREF(key);
        PyUnicode_InternInPlace(&key);
        PyTuple_SET_ITEM(self->kwnames, i - self->nargs, key);
        where = PyUnicode_FromFormat("keyword argument '%U'", key);
    }
    if (where == NULL)
        goto cleanup;
    self->nspecs = i + 1;
    if (tt_spec_build(self->state, &self->specs[i], value, 0, axes, where) < 0)
        goto cleanup;
    rc = 0;
cleanup:
    Py_XDECREF(where);
    return rc;
}

static PyObject *
tt_signature_new(PyTypeObject *type, PyObject *args, PyObject *kwargs)
{
    static char *kwlist[] = {"args", "kwargs", "dynamic", "params", NULL};
    PyObject *call_args, *call_kwargs, *dynamic = Py_None, *params = Py_None; /* borrowed */
    PyObject *items = NULL; /* new reference: kwargs' (name, value) pairs */
    PyObject *dyn = NULL;   /* new reference: dynamic as a tuple of our own */
    TtSignature *self = NULL;
    TtState *st;
    Py_ssize_t i, nkw = 0, ndyn = 0;

    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "O!O|OO:Signature", kwlist, &PyTuple_Type,
                                     &call_args, &call_kwargs, &dynamic, &params))
        goto error;
    if (call_kwargs != Py_None) {
        if (!PyDict_Check(call_kwargs)) {
            PyErr_SetString(PyExc_TypeError, "Signature: kwargs must be a dict or None");
            goto error;
        }
        /* a snapshot: reading a tensor's metadata may run Python code */
        if ((items = PyDict_Items(call_kwargs)) == NULL)
            goto error;
        nkw = PyList_GET_SIZE(items);
    }
    if ((st = tt_state_from_type(type)) == NULL)
        goto error;
    self = (TtSignature *)type->tp_alloc(type, 0);
    if (self == NULL)
        goto error;
    self->state = st;
    self->nargs = PyTuple_GET_SIZE(call_args);
    if ((self->kwnames = PyTuple_New(nkw)) == NULL)
        goto error;
    if (dynamic != Py_None && dynamic != Py_True) {
        /* reading a tensor's metadata may run Python code that changes a list */
        dyn = tt_sequence_tuple(dynamic, "Signature: dynamic must be a sequence or None");
        if (dyn == NULL)
            goto error;
        ndyn = PySequence_Fast_GET_SIZE(dyn);
        if (ndyn > self->nargs + nkw) {
            PyErr_Format(PyExc_ValueError,
                         "Signature: dynamic has %zd entries for %zd arguments", ndyn,
                         self->nargs + nkw);
            goto error;
        }
    }
    self->specs = PyMem_Calloc((size_t)(self->nargs + nkw + 1), sizeof(TtArgSpec));
    if (self->specs == NULL) {
        PyErr_NoMemory();
        goto error;
    }
    for (i = 0; i < self->nargs + nkw; i++) {
        PyObject *axes = NULL; /* borrowed */

        if (dynamic == Py_True)
            axes = Py_True;
        else if (i < ndyn && PySequence_Fast_GET_ITEM(dyn, i) != Py_None)
            axes = PySequence_Fast_GET_ITEM(dyn, i);
        if (tt_signature_build_spec(self, i, call_args, items, axes) < 0)
            goto error;
    }
    if (tt_signature_set_params(self, params) < 0)
        goto error;
    Py_XDECREF(items);
    Py_XDECREF(dyn);
    return (PyObject *)self;
error:
    Py_XDECREF(items);
    Py_XDECREF(dyn);
    Py_XDECREF(self);
    return NULL;
}

static int
tt_signature_traverse(TtSignature *self, visitproc visit, void *arg)
{
    Py_ssize_t i;

    Py_VISIT(Py_TYPE(self));
    Py_VISIT(self->kwnames);
    Py_VISIT(self->params);
    for (i = 0; i < self->nspecs; i++) {
        int rc = tt_spec_traverse(&self->specs[i], visit, arg);
        if (rc)
            return rc;
    }
    return 0;
}

static int
tt_signature_clear(TtSignature *self)
{
    Py_ssize_t i;
    TtArgSpec *specs = self->specs;
    Py_ssize_t n = self->nspecs;

    /* detach first: a value's finalizer may look at this signature */
    self->specs = NULL;
    self->nspecs = 0;
    for (i = 0; i < n; i++)
        tt_spec_release(&specs[i]);
    PyMem_Free(specs);
    Py_CLEAR(self->kwnames);
    Py_CLEAR(self->params);
    return 0;
}

static void
tt_signature_dealloc(TtSignature *self)
{
    PyTypeObject *tp = Py_TYPE(self);

    PyObject_GC_UnTrack(self);
    tt_signature_clear(self);
    tp->tp_free((PyObject *)self);
    Py_DECREF(tp);
}

/* (args, kwargs) in the recorded layout: a tuple and a dict in sig->kwnames'
 * order, from bound arguments. New reference. */
static PyObject *
tt_signature_pack(const TtSignature *sig, PyObject *const *bound)
{
    PyObject *args = NULL;   /* new reference */
    PyObject *kwargs = NULL; /* new reference */
    PyObject *result = NULL;
    Py_ssize_t i;

    if ((args = PyTuple_New(sig->nargs)) == NULL || (kwargs = PyDict_New()) == NULL)
        goto cleanup;
    for (i = 0; i < sig->nargs; i++)
        PyTuple_SET_ITEM(args, i, Py_NewRef(bound[i]));
    for (i = sig->nargs; i < sig->nspecs; i++)
        if (PyDict_SetItem(kwargs, PyTuple_GET_ITEM(sig->kwnames, i - sig->nargs), bound[i]) < 0)
            goto cleanup;
    result = PyTuple_Pack(2, args, kwargs);
cleanup:
    Py_XDECREF(args);
    Py_XDECREF(kwargs);
    return result;
}

/* Signature.matches(args, kwargs) (bind 0) and Signature.bind(args, kwargs)
 * (bind 1): the dict is laid out as a vectorcall. */
static PyObject *
tt_signature_call(TtSignature *self, PyObject *const *args, Py_ssize_t nargs, int bind)
{
    PyObject *call_args, *call_kwargs; /* borrowed */
    PyObject **stack = NULL;
    PyObject *kwnames = NULL; /* new reference */
    PyObject *key, *value;    /* borrowed */
    PyObject *const *bound = NULL;
    PyObject *result = NULL;
    TtStack room;
    Py_ssize_t n, nkw = 0, pos = 0, i = 0;
    int rc;

    room.heap = NULL;
    room.room = 0;
    if (nargs != 2) {
        PyErr_Format(PyExc_TypeError, "%s() takes 2 arguments (%zd given)",
                     bind ? "bind" : "matches", nargs);
        goto cleanup;
    }
    call_args = args[0];
    call_kwargs = args[1];
    if (!PyTuple_Check(call_args) ||
        (call_kwargs != Py_None && !PyDict_Check(call_kwargs))) {
        PyErr_Format(PyExc_TypeError, "%s(args, kwargs): a tuple and a dict",
                     bind ? "bind" : "matches");
        goto cleanup;
    }
    n = PyTuple_GET_SIZE(call_args);
    if (call_kwargs != Py_None)
        nkw = PyDict_GET_SIZE(call_kwargs);
    stack = PyMem_Malloc(sizeof(PyObject *) * (size_t)(n + nkw + 1));
    if (stack == NULL) {
        PyErr_NoMemory();
        goto cleanup;
    }
    for (i = 0; i < n; i++)
        stack[i] = PyTuple_GET_ITEM(call_args, i);
    if (nkw > 0) {
        if ((kwnames = PyTuple_New(nkw)) == NULL)
            goto cleanup;
        /* items are held by kwnames and the tuple, so the dict may change below */
        for (i = 0; PyDict_Next(call_kwargs, &pos, &key, &value) && i < nkw; i++) {
            Py_INCREF(key);
            PyTuple_SET_ITEM(kwnames, i, key);
            stack[n + i] = value;
        }
    }
    for (i = n; i < n + nkw; i++)
        Py_INCREF(stack[i]);
    rc = tt_signature_bind(self, stack, n, kwnames, &room, &bound);
    if (rc == 1 && !bind)
        rc = tt_signature_match_bound(self, bound);
    if (rc == 1 && bind)
        result = tt_signature_pack(self, bound);
    else if (rc >= 0)
        result = bind ? Py_NewRef(Py_None) : PyBool_FromLong(rc);
    for (i = n; i < n + nkw; i++)
        Py_DECREF(stack[i]);
cleanup:
    PyMem_Free(stack);
    PyMem_Free(room.heap);
    Py_XDECREF(kwnames);
    return result;
}

static PyObject *
tt_signature_matches(TtSignature *self, PyObject *const *args, Py_ssize_t nargs)
{
    return tt_signature_call(self, args, nargs, 0);
}

static PyObject *
tt_signature_bind_py(TtSignature *self, PyObject *const *args, Py_ssize_t nargs)
{
    return tt_signature_call(self, args, nargs, 1);
}

static PyObject *
tt_signature_repr(TtSignature *self)
{
    return PyUnicode_FromFormat("<%s nargs=%zd kwargs=%R>", Py_TYPE(self)->tp_name,
                                self->nargs,
                                self->kwnames != NULL ? self->kwnames : Py_None);
}

static PyMethodDef tt_signature_methods[] = {
    {"matches", (PyCFunction)(void (*)(void))tt_signature_matches, METH_FASTCALL,
     "matches(args, kwargs) -> bool: whether a call with these arguments fits, once\n"
     "bound to the recorded layout."},
    {"bind", (PyCFunction)(void (*)(void))tt_signature_bind_py, METH_FASTCALL,
     "bind(args, kwargs) -> (args, kwargs) or None: the call laid out as recorded\n"
     "(positional count, keyword order), or None when it cannot be; values unchecked."},
    {NULL, NULL, 0, NULL}};

static PyObject *
tt_signature_get_params(TtSignature *self, void *closure)
{
    (void)closure;
    return Py_NewRef(self->params != NULL ? self->params : Py_None);
}

static PyGetSetDef tt_signature_getset[] = {
    {"params", (getter)tt_signature_get_params, NULL,
     "The names of forward's parameters by position (None: positional-only).", NULL},
    {NULL, NULL, NULL, NULL, NULL}};

static PyType_Slot tt_signature_slots[] = {
    {Py_tp_doc, "Signature(args, kwargs, dynamic=None, params=None)\n\n"
                "What one call looked like: positional count, keyword names in order,\n"
                "and per argument a tensor's dtype, device and shape, or a plain\n"
                "value (same type and ==). Tuples and lists are followed one level.\n"
                "A call fits once bound to that layout: keywords in any order, and,\n"
                "with params (the names of forward's parameters by position, None for\n"
                "a positional-only one), an argument by position or by keyword alike.\n"
                "dynamic[i]: axes of argument i (positional, then keyword in kwargs\n"
                "order) that match any size; for a tuple/list, of every tensor in it,\n"
                "or one entry (None, True or axes) per item; True: every axis.\n"
                "dynamic=True: every axis of every tensor (the call's shape class:\n"
                "structure, plain values, dtypes, ranks and devices fixed)."},
    {Py_tp_getset, tt_signature_getset},
    {Py_tp_new, tt_signature_new},
    {Py_tp_dealloc, tt_signature_dealloc},
    {Py_tp_traverse, tt_signature_traverse},
    {Py_tp_clear, tt_signature_clear},
    {Py_tp_repr, tt_signature_repr},
    {Py_tp_methods, tt_signature_methods},
    {0, NULL}};

static PyType_Spec tt_signature_spec = {
    .name = "torch_tweak._C.Signature",
    .basicsize = sizeof(TtSignature),
    .flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .slots = tt_signature_slots,
};

/* ============================================================== module */

PyObject *
tt_py_set_value_keyer(PyObject *module, PyObject *keyer)
{
    TtState *st = (TtState *)PyModule_GetState(module);

    if (st == NULL)
        return NULL;
    if (keyer != Py_None && !PyCallable_Check(keyer)) {
        PyErr_SetString(PyExc_TypeError, "set_value_keyer takes a callable or None");
        return NULL;
    }
    Py_XSETREF(st->value_keyer, keyer == Py_None ? NULL : Py_NewRef(keyer));
    Py_RETURN_NONE;
}

int
tt_signature_exec(PyObject *module, TtState *st)
{
    int rc = -1;

    st->SignatureType =
        (PyTypeObject *)PyType_FromModuleAndSpec(module, &tt_signature_spec, NULL);
    if (st->SignatureType == NULL)
        goto error;
    if (PyModule_AddObjectRef(module, "Signature", (PyObject *)st->SignatureType) < 0)
        goto error;
    rc = 0;
error:
    return rc;
}
