/*
 * padded_layout.c - a PaddedReplay's recorded layout: set once from the
 * recorded call (_pad_layout: its positional count, keywords, plain values,
 * the tensor slots and what is padded in each, the output leaves' cuts), and
 * whether a call fits it (the same layout and plain values, each slot's
 * tensor a torch.Tensor of the recorded dtype, device and rank, sizes equal
 * to the recorded ones but on the padded axes, one batch and one length
 * among them). See padded.c for the design.
 */
#include "padded_replay.h"

/* ------------------------------------------------------- fitting */

/* The argument of recorded parameter p in the call, borrowed, and its index
 * in the call's vector in *at; NULL when the call lacks it. */
static PyObject *
tt_pad_param(TtPaddedReplay *self, Py_ssize_t p, PyObject *const *args, Py_ssize_t nargs,
             PyObject *kwnames, Py_ssize_t *at)
{
    PyObject *name;
    Py_ssize_t k, nkw = kwnames != NULL ? PyTuple_GET_SIZE(kwnames) : 0;

    if (p < self->nargs) {
        *at = p;
        return args[p];
    }
    name = PyTuple_GET_ITEM(self->kwnames, p - self->nargs);
    for (k = 0; k < nkw; k++)
        if (PyTuple_GET_ITEM(kwnames, k) == name)
            goto found;
    /* names that are equal but not the same object: compare the text */
    for (k = 0; k < nkw; k++)
        if (PyUnicode_Compare(PyTuple_GET_ITEM(kwnames, k), name) == 0)
            goto found;
    if (PyErr_Occurred())
        PyErr_Clear();
    return NULL;
found:
    *at = nargs + k;
    return args[nargs + k];
}

/* 1 when tensor `t` fits slot `s`, with the batch and length it brings
 * checked against (or set into) *b and *n; 0 when not; -1 on error. */
static int
tt_pad_fit_tensor(TtPaddedReplay *self, const TtPadSlot *s, PyObject *t, Py_ssize_t *b,
                  Py_ssize_t *n)
{
    TtState *st = self->state;
    PyObject *dtype = NULL, *device = NULL, *shape = NULL; /* new references */
    Py_ssize_t axis, ndim, size;
    int rc = -1, same;

    if (Py_TYPE(t) != st->tensor_type) { /* a subclass may override what a copy does */
        rc = 0;
        goto cleanup;
    }
    if ((dtype = tt_tensor_attr(st, t, &st->tensor_dtype, st->str_dtype)) == NULL)
        goto cleanup;
    if (dtype != s->dtype) {
        rc = 0;
        goto cleanup;
    }
    if ((device = tt_tensor_attr(st, t, &st->tensor_device, st->str_device)) == NULL)
        goto cleanup;
    if ((same = PyObject_RichCompareBool(device, s->device, Py_EQ)) <= 0) {
        rc = same;
        goto cleanup;
    }
    if ((shape = tt_tensor_attr(st, t, &st->tensor_shape, st->str_shape)) == NULL)
        goto cleanup;
    if (!PyTuple_Check(shape) || (ndim = PyTuple_GET_SIZE(shape)) != PyTuple_GET_SIZE(s->shape)) {
        rc = 0;
        goto cleanup;
    }
    for (axis = 0; axis < ndim; axis++) {
        if ((size = tt_pad_size(shape, axis)) < 0)
            goto cleanup;
        if (axis == 0 && s->batch) {
            if (*b < 0)
                *b = size;
            else if (size != *b)
                break;
        }
        else if (axis == 1 && s->seq) {
            if (*n < 0)
                *n = size;
            else if (size != *n)
                break;
        }
        else {
            Py_ssize_t want = tt_pad_size(s->shape, axis);

            if (want < 0)
                goto cleanup;
            if (size != want)
                break;
        }
    }
    rc = axis == ndim;
cleanup:
    Py_XDECREF(dtype);
    Py_XDECREF(device);
    Py_XDECREF(shape);
    return rc;
}

/* padded_replay.h */
int
tt_pad_fit(TtPaddedReplay *self, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames,
           PyObject **found, Py_ssize_t *at, Py_ssize_t *b, Py_ssize_t *n)
{
    Py_ssize_t p, s, where, nkw = kwnames != NULL ? PyTuple_GET_SIZE(kwnames) : 0;
    int fits;

    if (self->nparams == 0 || nargs != self->nargs || nkw != PyTuple_GET_SIZE(self->kwnames))
        return 0;
    for (p = 0; p < self->nparams; p++) {
        PyObject *arg = tt_pad_param(self, p, args, nargs, kwnames, &where); /* borrowed */

        if (arg == NULL)
            return 0;
        if (self->slot_of[p] >= 0) {
            found[self->slot_of[p]] = arg;
            at[self->slot_of[p]] = where;
            continue;
        }
        if (arg == self->plain[p])
            continue;
        fits = PyObject_RichCompareBool(arg, self->plain[p], Py_EQ);
        if (fits <= 0) {
            if (fits < 0) /* values that cannot say whether they are equal: not the recorded one */
                PyErr_Clear();
            return 0;
        }
    }
    *b = -1;
    *n = -1;
    for (s = 0; s < self->nslots; s++) {
        fits = tt_pad_fit_tensor(self, &self->slots[s], found[s], b, n);
        if (fits <= 0)
            return fits;
    }
    if (*b < 0) { /* no batch axis: the first tensor's own axis 0, as Python counts it */
        *b = PyTuple_GET_SIZE(self->slots[0].shape) > 0 ? tt_pad_size(self->slots[0].shape, 0) : 1;
        if (*b < 0)
            return -1;
    }
    if (*n < 0)
        *n = 0;
    return 1;
}

/* ------------------------------------------------------- the layout */

/* Slot s of the layout from `spec`, a (position or keyword name, batch,
 * length) tuple naming a torch.Tensor argument of the recorded call (cargs,
 * ckwargs; self->kwnames set): its parameter, what is padded, the recorded
 * dtype, device and shape. -1 on an error that names the slot. */
static int
tt_pad_set_slot(TtPaddedReplay *self, Py_ssize_t s, PyObject *spec, PyObject *cargs,
                PyObject *ckwargs)
{
    TtState *st = self->state;
    PyObject *where, *tensor; /* borrowed */
    TtPadSlot *slot = &self->slots[s];
    Py_ssize_t p;
    int batch, seq, rc = -1;

    if (!PyTuple_Check(spec) || PyTuple_GET_SIZE(spec) != 3 ||
        (batch = PyObject_IsTrue(PyTuple_GET_ITEM(spec, 1))) < 0 ||
        (seq = PyObject_IsTrue(PyTuple_GET_ITEM(spec, 2))) < 0) {
        if (!PyErr_Occurred())
            PyErr_SetString(PyExc_TypeError, "_pad_layout: each slot must be a (position or "
                            "keyword name, batch, length) tuple");
        goto cleanup;
    }
    where = PyTuple_GET_ITEM(spec, 0);
    slot->param = -1;
    if (PyLong_Check(where)) {
        p = PyLong_AsSsize_t(where);
        if (p == -1 && PyErr_Occurred())
            goto cleanup;
        if (p >= 0 && p < self->nargs)
            slot->param = p;
    }
    else if (PyUnicode_Check(where)) {
        for (p = 0; p < PyTuple_GET_SIZE(self->kwnames); p++)
            if (PyUnicode_Compare(PyTuple_GET_ITEM(self->kwnames, p), where) == 0)
                slot->param = self->nargs + p;
        if (PyErr_Occurred())
            goto cleanup;
    }
    if (slot->param < 0 || self->slot_of[slot->param] >= 0) {
        PyErr_Format(PyExc_ValueError, "_pad_layout: slot %zd names no argument of the call, "
                     "or one another slot names", s);
        goto cleanup;
    }
    tensor = slot->param < self->nargs
                 ? PyTuple_GET_ITEM(cargs, slot->param)
                 : PyDict_GetItemWithError(ckwargs, PyTuple_GET_ITEM(self->kwnames,
                                                                     slot->param - self->nargs));
    if (tensor == NULL || Py_TYPE(tensor) != st->tensor_type) {
        if (!PyErr_Occurred())
            PyErr_Format(PyExc_TypeError, "_pad_layout: slot %zd's argument must be a "
                         "torch.Tensor", s);
        goto cleanup;
    }
    self->slot_of[slot->param] = s;
    self->nslots = s + 1;
    slot->batch = batch;
    slot->seq = seq;
    if ((slot->dtype = PyObject_GetAttr(tensor, st->str_dtype)) == NULL ||
        (slot->device = PyObject_GetAttr(tensor, st->str_device)) == NULL ||
        (slot->shape = PyObject_GetAttr(tensor, st->str_shape)) == NULL)
        goto cleanup;
    if (!PyTuple_Check(slot->shape) || (batch && PyTuple_GET_SIZE(slot->shape) < 1) ||
        (seq && PyTuple_GET_SIZE(slot->shape) < 2)) {
        PyErr_Format(PyExc_ValueError, "_pad_layout: slot %zd's tensor has no axis to pad", s);
        goto cleanup;
    }
    rc = 0;
cleanup:
    return rc;
}

/* The recorded value of each parameter that is not a slot (self->plain), from
 * the recorded call (cargs, ckwargs). -1 on error. */
static int
tt_pad_set_plain(TtPaddedReplay *self, PyObject *cargs, PyObject *ckwargs, Py_ssize_t nparams)
{
    PyObject *value; /* borrowed */
    Py_ssize_t p;
    int rc = -1;

    for (p = 0; p < nparams; p++) {
        if (self->slot_of[p] >= 0)
            continue;
        value = p < self->nargs ? PyTuple_GET_ITEM(cargs, p)
                                : PyDict_GetItemWithError(ckwargs,
                                                          PyTuple_GET_ITEM(self->kwnames, p - self->nargs));
        if (value == NULL) {
            if (!PyErr_Occurred())
                PyErr_SetString(PyExc_RuntimeError, "_pad_layout: a keyword went missing");
            goto cleanup;
        }
        self->plain[p] = Py_NewRef(value);
    }
    rc = 0;
cleanup:
    return rc;
}

/* Reads the recorded call (args, kwargs) and the slots into self. -1 on error. */
static int
tt_pad_set_call(TtPaddedReplay *self, PyObject *call, PyObject *slots)
{
    TtState *st = self->state;
    PyObject *cargs, *ckwargs, *key, *value; /* borrowed */
    Py_ssize_t p, s, pos = 0, nparams;
    int rc = -1;

    if (!PyTuple_Check(call) || PyTuple_GET_SIZE(call) != 2 ||
        !PyTuple_Check(cargs = PyTuple_GET_ITEM(call, 0)) ||
        !PyDict_Check(ckwargs = PyTuple_GET_ITEM(call, 1))) {
        PyErr_SetString(PyExc_TypeError, "_pad_layout: call must be an (args tuple, kwargs dict) "
                        "tuple, or None");
        goto cleanup;
    }
    self->nargs = PyTuple_GET_SIZE(cargs);
    nparams = self->nargs + PyDict_GET_SIZE(ckwargs);
    if ((self->kwnames = PyTuple_New(PyDict_GET_SIZE(ckwargs))) == NULL)
        goto cleanup;
    self->plain = PyMem_Calloc((size_t)nparams + 1, sizeof(*self->plain));
    self->slot_of = PyMem_Calloc((size_t)nparams + 1, sizeof(*self->slot_of));
    self->slots = PyMem_Calloc((size_t)PyTuple_GET_SIZE(slots) + 1, sizeof(*self->slots));
    if (self->plain == NULL || self->slot_of == NULL || self->slots == NULL) {
        PyErr_NoMemory();
        goto cleanup;
    }
    self->nplain = nparams;
    for (p = 0; p < nparams; p++)
        self->slot_of[p] = -1;
    p = 0;
    while (PyDict_Next(ckwargs, &pos, &key, &value)) {
        if (!PyUnicode_Check(key)) {
            PyErr_SetString(PyExc_TypeError, "_pad_layout: keyword names must be str");
            goto cleanup;
        }
        Py_INCREF(key);
        PyUnicode_InternInPlace(&key);
        PyTuple_SET_ITEM(self->kwnames, p, key);
        p++;
    }
    for (s = 0; s < PyTuple_GET_SIZE(slots); s++)
        if (tt_pad_set_slot(self, s, PyTuple_GET_ITEM(slots, s), cargs, ckwargs) < 0)
            goto cleanup;
    if (self->nslots == 0) {
        PyErr_SetString(PyExc_ValueError, "_pad_layout: a call with no tensor slot");
        goto cleanup;
    }
    if (tt_pad_set_plain(self, cargs, ckwargs, nparams) < 0)
        goto cleanup;
    self->nparams = nparams;
    rc = 0;
cleanup:
    return rc;
}

PyObject *
tt_pad_layout(TtPaddedReplay *self, PyObject *args, PyObject *kwargs)
{
    static char *kwlist[] = {"call", "slots", "outputs", "length", "target", "flatten", NULL};
    PyObject *call, *slots, *outputs, *target, *flatten; /* borrowed */
    PyObject *slot_seq = NULL, *out_seq = NULL;          /* new references */
    PyObject *result = NULL;
    Py_ssize_t j;
    int length;

    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "OOOpOO:_pad_layout", kwlist, &call, &slots,
                                     &outputs, &length, &target, &flatten))
        goto cleanup;
    if (self->laid_out) {
        PyErr_SetString(PyExc_RuntimeError, "_pad_layout: the layout is set once");
        goto cleanup;
    }
    if (tt_state_tensor_type(self->state) == NULL) {
        if (!PyErr_Occurred())
            PyErr_SetString(PyExc_RuntimeError, "PaddedReplay needs torch imported");
        goto cleanup;
    }
    if (!PyCallable_Check(target) || !PyCallable_Check(flatten)) {
        PyErr_SetString(PyExc_TypeError, "_pad_layout: target and flatten must be callable");
        goto cleanup;
    }
    if ((slot_seq = tt_sequence_tuple(slots, "_pad_layout: slots must be a sequence")) == NULL ||
        (out_seq = tt_sequence_tuple(outputs, "_pad_layout: outputs must be a sequence")) == NULL)
        goto cleanup;
    self->laid_out = 1;
    self->target = Py_NewRef(target);
    self->flatten = Py_NewRef(flatten);
    self->length = length;
    self->nouts = PyTuple_GET_SIZE(out_seq);
    self->out_batch = PyMem_Calloc((size_t)self->nouts + 1, sizeof(int));
    self->out_length = PyMem_Calloc((size_t)self->nouts + 1, sizeof(int));
    if (self->out_batch == NULL || self->out_length == NULL) {
        PyErr_NoMemory();
        goto cleanup;
    }
    for (j = 0; j < self->nouts; j++) {
        PyObject *spec = PyTuple_GET_ITEM(out_seq, j); /* borrowed */

        if (!PyTuple_Check(spec) || PyTuple_GET_SIZE(spec) != 2 ||
            (self->out_batch[j] = PyObject_IsTrue(PyTuple_GET_ITEM(spec, 0))) < 0 ||
            (self->out_length[j] = PyObject_IsTrue(PyTuple_GET_ITEM(spec, 1))) < 0) {
            if (!PyErr_Occurred())
                PyErr_SetString(PyExc_TypeError, "_pad_layout: each output must be a (batch, length) "
                                "tuple");
            goto cleanup;
        }
    }
    if (call != Py_None && tt_pad_set_call(self, call, slot_seq) < 0)
        goto cleanup;
    result = Py_NewRef(Py_None);
cleanup:
    Py_XDECREF(slot_seq);
    Py_XDECREF(out_seq);
    return result;
}

