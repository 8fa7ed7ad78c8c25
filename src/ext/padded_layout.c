/*
 * padded_layout.c - a PaddedReplay's recorded layout: set once from the
 * recorded call (_pad_layout: its positional count, keywords, plain values,
 * the containers that hold tensors, the tensor slots and what is padded in
 * each, the output leaves' cuts, the range), and whether a call fits it (the
 * same layout and plain values, each container of the recorded exact type
 * and size (a dict: its str keys in the recorded order), each slot's tensor a
 * torch.Tensor of the recorded dtype, device and rank, sizes equal to the
 * recorded ones but on the padded axes, one batch and one length among them).
 * A tensor in a container of another kind (or past TT_PAD_MAX_DEPTH) is no
 * slot: the layout is refused. See padded.c for the design.
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

/* 1 when `value` is the recorded `want` (itself, or of its exact type and
 * equal: 1, 1.0 and True stay distinct, as a Signature keeps them), else 0. */
static int
tt_pad_same_value(PyObject *value, PyObject *want)
{
    int same;

    if (value == want)
        return 1;
    if (want == NULL || Py_TYPE(value) != Py_TYPE(want))
        return 0;
    if ((same = PyObject_RichCompareBool(value, want, Py_EQ)) < 0) {
        PyErr_Clear(); /* values that cannot say whether they are equal: not the recorded one */
        same = 0;
    }
    return same;
}

static int tt_pad_fit_node(const TtPadNode *node, PyObject *value, PyObject **tensors);

/* A tuple, list or namedtuple of the recorded exact type and size, item by
 * item. 1, 0 or -1. */
static int
tt_pad_fit_seq(const TtPadNode *node, PyObject *value, PyObject **tensors)
{
    Py_ssize_t i;
    int list = PyList_CheckExact(value), fits = 1;

    if ((PyObject *)Py_TYPE(value) != node->value ||
        (list ? PyList_GET_SIZE(value) : PyTuple_GET_SIZE(value)) != node->count)
        return 0;
    for (i = 0; fits > 0 && i < node->count; i++) {
        PyObject *item; /* new reference: another thread may change a list meanwhile */

        if (list && i >= PyList_GET_SIZE(value))
            return 0;
        item = Py_NewRef(list ? PyList_GET_ITEM(value, i) : PyTuple_GET_ITEM(value, i));
        fits = tt_pad_fit_node(&node->items[i], item, tensors);
        Py_DECREF(item);
    }
    return fits;
}

/* A dict whose keys are the recorded ones in the recorded order, item by item.
 * 1, 0 or -1. */
static int
tt_pad_fit_dict(const TtPadNode *node, PyObject *value, PyObject **tensors)
{
    PyObject *key, *item; /* borrowed */
    Py_ssize_t pos = 0, i = 0;
    int fits = 1;

    if (!PyDict_CheckExact(value) || PyDict_GET_SIZE(value) != node->count)
        return 0;
    while (PyDict_Next(value, &pos, &key, NULL)) { /* no Python code runs in this loop */
        PyObject *want;

        if (i >= node->count)
            return 0;
        want = PyTuple_GET_ITEM(node->value, i++);
        if (key != want && (!PyUnicode_CheckExact(key) || PyUnicode_Compare(key, want) != 0))
            return 0;
    }
    for (i = 0; fits > 0 && i < node->count; i++) {
        if ((item = PyDict_GetItemWithError(value, PyTuple_GET_ITEM(node->value, i))) == NULL) {
            PyErr_Clear(); /* the dict changed meanwhile */
            return 0;
        }
        Py_INCREF(item);
        fits = tt_pad_fit_node(&node->items[i], item, tensors);
        Py_DECREF(item);
    }
    return fits;
}

/* Whether `value` fits the recorded place `node`; a tensor is taken into its
 * slot (a new reference), checked later by tt_pad_fit_tensor. 1, 0 or -1. */
static int
tt_pad_fit_node(const TtPadNode *node, PyObject *value, PyObject **tensors)
{
    switch (node->kind) {
    case TT_PAD_TENSOR:
        Py_XSETREF(tensors[node->slot], Py_NewRef(value));
        return 1;
    case TT_PAD_SEQ:
        return tt_pad_fit_seq(node, value, tensors);
    case TT_PAD_DICT:
        return tt_pad_fit_dict(node, value, tensors);
    default:
        return tt_pad_same_value(value, node->value);
    }
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
        Py_ssize_t *seen = axis == 0 && s->batch ? b : axis == 1 && s->seq ? n : NULL;
        Py_ssize_t want;

        if ((size = tt_pad_size(shape, axis)) < 0)
            goto cleanup;
        want = seen == NULL ? tt_pad_size(s->shape, axis) : *seen < 0 ? size : *seen;
        if (want < 0 && PyErr_Occurred())
            goto cleanup;
        if (size != want)
            break;
        if (seen != NULL)
            *seen = size;
    }
    rc = axis == ndim;
cleanup:
    Py_XDECREF(dtype);
    Py_XDECREF(device);
    Py_XDECREF(shape);
    return rc;
}

/* padded_replay.h */
void
tt_pad_found_release(TtPaddedReplay *self, TtPadFound *found)
{
    Py_ssize_t s;

    for (s = 0; s < self->nslots; s++)
        Py_CLEAR(found->tensors[s]);
}

/* padded_replay.h */
int
tt_pad_fit(TtPaddedReplay *self, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames,
           TtPadFound *found)
{
    Py_ssize_t p, s, nkw = kwnames != NULL ? PyTuple_GET_SIZE(kwnames) : 0;
    int fits;

    if (self->nparams == 0 || nargs != self->nargs || nkw != PyTuple_GET_SIZE(self->kwnames))
        return 0;
    for (p = 0; p < self->nparams; p++) {
        PyObject *arg = tt_pad_param(self, p, args, nargs, kwnames, &found->at[p]); /* borrowed */

        if (arg == NULL)
            return 0;
        if ((fits = tt_pad_fit_node(&self->params[p], arg, found->tensors)) <= 0)
            return fits;
    }
    found->b = found->n = -1;
    for (s = 0; s < self->nslots; s++) {
        fits = tt_pad_fit_tensor(self, &self->slots[s], found->tensors[s], &found->b, &found->n);
        if (fits <= 0)
            return fits;
    }
    if (found->b < 0) { /* no batch axis: the first tensor's own axis 0 (1 for a 0-d one) */
        found->b = PyTuple_GET_SIZE(self->slots[0].shape) > 0 ? tt_pad_size(self->slots[0].shape, 0) : 1;
        if (found->b < 0)
            return -1;
    }
    if (found->n < 0)
        found->n = 0;
    return 1;
}

/* ------------------------------------------------ a call on buffers */

static PyObject *tt_pad_rebuild(const TtPadNode *node, PyObject *value, PyObject *buffers);

/* A container like `value` (node: SEQ or DICT) with each slot's tensor
 * replaced by its buffer. New reference, or NULL. */
static PyObject *
tt_pad_rebuild_items(const TtPadNode *node, PyObject *value, PyObject *buffers)
{
    PyObject *made = node->kind == TT_PAD_DICT ? PyDict_New() : PyList_New(node->count);
    PyObject *result = NULL;
    Py_ssize_t i;

    if (made == NULL)
        return NULL;
    for (i = 0; i < node->count; i++) {
        PyObject *key = node->kind == TT_PAD_DICT ? PyTuple_GET_ITEM(node->value, i) : NULL;
        PyObject *item = key != NULL ? PyDict_GetItemWithError(value, key)
                         : PyList_CheckExact(value) ? (i < PyList_GET_SIZE(value) ? PyList_GET_ITEM(value, i)
                                                                                 : NULL)
                                                    : PyTuple_GET_ITEM(value, i); /* borrowed */
        PyObject *rebuilt = NULL;

        if (item == NULL) {
            if (!PyErr_Occurred())
                PyErr_SetString(PyExc_RuntimeError, "PaddedReplay: a container of the call changed "
                                "while it ran");
            goto cleanup;
        }
        Py_INCREF(item);
        rebuilt = tt_pad_rebuild(&node->items[i], item, buffers);
        Py_DECREF(item);
        if (rebuilt == NULL || (key != NULL && PyDict_SetItem(made, key, rebuilt) < 0)) {
            Py_XDECREF(rebuilt);
            goto cleanup;
        }
        if (key == NULL)
            PyList_SET_ITEM(made, i, rebuilt);
        else
            Py_DECREF(rebuilt);
    }
    if (node->kind == TT_PAD_DICT || node->value == (PyObject *)&PyList_Type)
        result = Py_NewRef(made);
    else if (node->value == (PyObject *)&PyTuple_Type)
        result = PyList_AsTuple(made);
    else /* a namedtuple */
        result = PyObject_CallMethod(node->value, "_make", "O", made);
cleanup:
    Py_DECREF(made);
    return result;
}

/* `value` (the call's, at place `node`) with each slot's tensor replaced by
 * its buffer. New reference, or NULL. */
static PyObject *
tt_pad_rebuild(const TtPadNode *node, PyObject *value, PyObject *buffers)
{
    if (node->kind == TT_PAD_TENSOR)
        return Py_NewRef(PyTuple_GET_ITEM(buffers, node->slot));
    if (node->kind == TT_PAD_VALUE)
        return Py_NewRef(value);
    return tt_pad_rebuild_items(node, value, buffers);
}

/* padded_replay.h */
int
tt_pad_bind_buffers(TtPaddedReplay *self, PyObject *buffers, PyObject *const *args,
                    const TtPadFound *found, PyObject **bound)
{
    Py_ssize_t p, q;

    for (p = 0; p < self->nparams; p++) {
        if ((bound[p] = tt_pad_rebuild(&self->params[p], args[found->at[p]], buffers)) == NULL) {
            for (q = 0; q < p; q++)
                Py_CLEAR(bound[q]);
            return -1;
        }
    }
    return 0;
}

/* ------------------------------------------------------- the layout */

/* Whether `value` is a tensor, or a container the layout takes (a tuple, a
 * list, a namedtuple, a dict of str keys) that holds one, within `depth`. */
static int
tt_pad_holds_tensor(TtState *st, PyObject *value, int depth)
{
    PyObject *key, *item; /* borrowed */
    Py_ssize_t i, pos = 0;

    if (PyObject_TypeCheck(value, st->tensor_type))
        return 1;
    if (depth >= TT_PAD_MAX_DEPTH)
        return 0;
    if (PyList_CheckExact(value) || PyTuple_CheckExact(value) ||
        (PyTuple_Check(value) && PyObject_HasAttrString((PyObject *)Py_TYPE(value), "_make"))) {
        for (i = 0; i < PySequence_Fast_GET_SIZE(value); i++)
            if (tt_pad_holds_tensor(st, PySequence_Fast_GET_ITEM(value, i), depth + 1))
                return 1;
        return 0;
    }
    if (!PyDict_CheckExact(value))
        return 0;
    while (PyDict_Next(value, &pos, &key, &item))
        if (PyUnicode_CheckExact(key) && tt_pad_holds_tensor(st, item, depth + 1))
            return 1;
    return 0;
}

/* Slot *next of the layout from tensor `t`: its axes (flags: (batch, length)
 * pairs per slot, a tuple) and its recorded dtype, device and shape. -1 on an
 * error that names the slot. */
static int
tt_pad_set_slot(TtPaddedReplay *self, PyObject *t, PyObject *flags, Py_ssize_t *next)
{
    TtState *st = self->state;
    Py_ssize_t s = *next;
    TtPadSlot *slot = &self->slots[s];
    PyObject *pair; /* borrowed */

    if (Py_TYPE(t) != st->tensor_type) {
        PyErr_Format(PyExc_ValueError, "_pad_layout: tensor %zd of the call is a %s, a subclass of "
                     "torch.Tensor", s, Py_TYPE(t)->tp_name);
        return -1;
    }
    if (s >= self->nslots) {
        PyErr_Format(PyExc_ValueError, "_pad_layout: the call holds more tensors than the %zd "
                     "slots given", self->nslots);
        return -1;
    }
    pair = PyTuple_GET_ITEM(flags, s);
    if (!PyTuple_Check(pair) || PyTuple_GET_SIZE(pair) != 2 ||
        (slot->batch = PyObject_IsTrue(PyTuple_GET_ITEM(pair, 0))) < 0 ||
        (slot->seq = PyObject_IsTrue(PyTuple_GET_ITEM(pair, 1))) < 0) {
        if (!PyErr_Occurred())
            PyErr_SetString(PyExc_TypeError, "_pad_layout: each slot must be a (batch, length) tuple");
        return -1;
    }
    if ((slot->dtype = PyObject_GetAttr(t, st->str_dtype)) == NULL ||
        (slot->device = PyObject_GetAttr(t, st->str_device)) == NULL ||
        (slot->shape = PyObject_GetAttr(t, st->str_shape)) == NULL)
        return -1;
    if (!PyTuple_Check(slot->shape) || (slot->batch && PyTuple_GET_SIZE(slot->shape) < 1) ||
        (slot->seq && PyTuple_GET_SIZE(slot->shape) < 2)) {
        PyErr_Format(PyExc_ValueError, "_pad_layout: slot %zd's tensor has no axis to pad", s);
        return -1;
    }
    self->batch |= slot->batch;
    *next = s + 1;
    return 0;
}

static int tt_pad_node_of(TtPaddedReplay *self, TtPadNode *node, PyObject *value, int depth,
                          PyObject *flags, Py_ssize_t *next);

/* Node `node` of a container `value` that holds a tensor: its kind, type or
 * keys, and a node per item. -1 on error. */
static int
tt_pad_container_of(TtPaddedReplay *self, TtPadNode *node, PyObject *value, int depth,
                    PyObject *flags, Py_ssize_t *next)
{
    PyObject *key; /* borrowed */
    Py_ssize_t i, pos = 0, count = PyDict_Check(value) ? PyDict_GET_SIZE(value) : PySequence_Fast_GET_SIZE(value);

    node->kind = PyDict_Check(value) ? TT_PAD_DICT : TT_PAD_SEQ;
    if ((node->items = PyMem_Calloc((size_t)count + 1, sizeof(*node->items))) == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    node->count = count;
    if (node->kind == TT_PAD_SEQ) {
        node->value = Py_NewRef((PyObject *)Py_TYPE(value));
        for (i = 0; i < count; i++)
            if (tt_pad_node_of(self, &node->items[i], PySequence_Fast_GET_ITEM(value, i), depth + 1,
                               flags, next) < 0)
                return -1;
        return 0;
    }
    if ((node->value = PyTuple_New(count)) == NULL)
        return -1;
    for (i = 0; PyDict_Next(value, &pos, &key, NULL); i++) {
        if (!PyUnicode_CheckExact(key)) {
            PyErr_SetString(PyExc_ValueError, "_pad_layout: a dict holding a tensor has a key that "
                            "is not a str");
            return -1;
        }
        PyTuple_SET_ITEM(node->value, i, Py_NewRef(key));
    }
    for (i = 0; i < count; i++)
        if (tt_pad_node_of(self, &node->items[i], PyDict_GetItem(value, PyTuple_GET_ITEM(node->value, i)),
                           depth + 1, flags, next) < 0)
            return -1;
    return 0;
}

/* Node `node` from the recorded `value`: a tensor's slot, a container that
 * holds one, or a plain value. -1 on error. */
static int
tt_pad_node_of(TtPaddedReplay *self, TtPadNode *node, PyObject *value, int depth, PyObject *flags,
               Py_ssize_t *next)
{
    TtState *st = self->state;

    if (PyObject_TypeCheck(value, st->tensor_type)) {
        node->kind = TT_PAD_TENSOR;
        node->slot = *next;
        return tt_pad_set_slot(self, value, flags, next);
    }
    if (tt_pad_holds_tensor(st, value, depth)) {
        self->nested = 1;
        return tt_pad_container_of(self, node, value, depth, flags, next);
    }
    node->kind = TT_PAD_VALUE;
    node->value = Py_NewRef(value);
    return 0;
}

/* Reads the recorded call (args, kwargs) and the slots' flags into self. -1 on error. */
static int
tt_pad_set_call(TtPaddedReplay *self, PyObject *call, PyObject *flags)
{
    PyObject *cargs, *ckwargs, *key, *value; /* borrowed */
    Py_ssize_t p, pos = 0, nparams, next = 0;

    if (!PyTuple_Check(call) || PyTuple_GET_SIZE(call) != 2 ||
        !PyTuple_Check(cargs = PyTuple_GET_ITEM(call, 0)) ||
        !PyDict_Check(ckwargs = PyTuple_GET_ITEM(call, 1))) {
        PyErr_SetString(PyExc_TypeError, "_pad_layout: call must be an (args tuple, kwargs dict) tuple");
        return -1;
    }
    self->nargs = PyTuple_GET_SIZE(cargs);
    nparams = self->nargs + PyDict_GET_SIZE(ckwargs);
    if ((self->kwnames = PyTuple_New(PyDict_GET_SIZE(ckwargs))) == NULL)
        return -1;
    self->params = PyMem_Calloc((size_t)nparams + 1, sizeof(*self->params));
    self->slots = PyMem_Calloc((size_t)PyTuple_GET_SIZE(flags) + 1, sizeof(*self->slots));
    if (self->params == NULL || self->slots == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    self->nnodes = nparams;
    self->nslots = PyTuple_GET_SIZE(flags);
    for (p = 0; PyDict_Next(ckwargs, &pos, &key, &value); p++) {
        if (!PyUnicode_Check(key)) {
            PyErr_SetString(PyExc_TypeError, "_pad_layout: keyword names must be str");
            return -1;
        }
        Py_INCREF(key);
        PyUnicode_InternInPlace(&key);
        PyTuple_SET_ITEM(self->kwnames, p, key);
    }
    for (p = 0; p < nparams; p++) {
        value = p < self->nargs ? PyTuple_GET_ITEM(cargs, p)
                                : PyDict_GetItem(ckwargs, PyTuple_GET_ITEM(self->kwnames, p - self->nargs));
        if (value == NULL || tt_pad_node_of(self, &self->params[p], value, 0, flags, &next) < 0) {
            if (!PyErr_Occurred())
                PyErr_SetString(PyExc_RuntimeError, "_pad_layout: a keyword went missing");
            return -1;
        }
    }
    if (next != self->nslots || next == 0) {
        PyErr_Format(PyExc_ValueError, "_pad_layout: the call holds %zd tensors in places a call "
                     "can be fitted to (arguments, tuples, lists, namedtuples, dicts of str keys), "
                     "%zd slots were given", next, self->nslots);
        return -1;
    }
    self->nparams = nparams;
    return 0;
}

/* The output leaves' cuts from `outputs`, a tuple of (batch, length) pairs. -1 on error. */
static int
tt_pad_set_outputs(TtPaddedReplay *self, PyObject *outputs)
{
    Py_ssize_t j;

    self->nouts = PyTuple_GET_SIZE(outputs);
    self->out_batch = PyMem_Calloc((size_t)self->nouts + 1, sizeof(int));
    self->out_length = PyMem_Calloc((size_t)self->nouts + 1, sizeof(int));
    if (self->out_batch == NULL || self->out_length == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    for (j = 0; j < self->nouts; j++) {
        PyObject *spec = PyTuple_GET_ITEM(outputs, j); /* borrowed */

        if (!PyTuple_Check(spec) || PyTuple_GET_SIZE(spec) != 2 ||
            (self->out_batch[j] = PyObject_IsTrue(PyTuple_GET_ITEM(spec, 0))) < 0 ||
            (self->out_length[j] = PyObject_IsTrue(PyTuple_GET_ITEM(spec, 1))) < 0) {
            if (!PyErr_Occurred())
                PyErr_SetString(PyExc_TypeError, "_pad_layout: each output must be a (batch, length) "
                                "tuple");
            return -1;
        }
    }
    return 0;
}

PyObject *
tt_pad_layout(TtPaddedReplay *self, PyObject *args, PyObject *kwargs)
{
    static char *kwlist[] = {"call", "slots", "outputs", "length", "target", "flatten",
                             "max_batch", "max_length", "step", NULL};
    PyObject *call, *slots, *outputs, *target, *flatten; /* borrowed */
    PyObject *slot_seq = NULL, *out_seq = NULL;          /* new references */
    PyObject *result = NULL;
    int length;

    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "OOOpOOnnn:_pad_layout", kwlist, &call, &slots,
                                     &outputs, &length, &target, &flatten, &self->max_batch,
                                     &self->max_length, &self->step))
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
    if (self->step < 1 || self->max_batch < 1 || (length && self->max_length < 1)) {
        PyErr_SetString(PyExc_ValueError, "_pad_layout: max_batch and step must be >= 1, and "
                        "max_length too when the length is padded");
        goto cleanup;
    }
    if ((slot_seq = tt_sequence_tuple(slots, "_pad_layout: slots must be a sequence")) == NULL ||
        (out_seq = tt_sequence_tuple(outputs, "_pad_layout: outputs must be a sequence")) == NULL)
        goto cleanup;
    self->laid_out = 1;
    self->target = Py_NewRef(target);
    self->flatten = Py_NewRef(flatten);
    self->length = length;
    if (tt_pad_set_outputs(self, out_seq) < 0 || tt_pad_set_call(self, call, slot_seq) < 0)
        goto cleanup;
    result = Py_NewRef(Py_None);
cleanup:
    Py_XDECREF(slot_seq);
    Py_XDECREF(out_seq);
    return result;
}

/* ------------------------------------------------------- lifetime */

static void
tt_pad_node_free(TtPadNode *node)
{
    Py_ssize_t i;

    for (i = 0; node->items != NULL && i < node->count; i++)
        tt_pad_node_free(&node->items[i]);
    PyMem_Free(node->items);
    node->items = NULL;
    node->count = 0;
    Py_CLEAR(node->value);
}

/* padded_replay.h */
void
tt_pad_nodes_free(TtPaddedReplay *self)
{
    Py_ssize_t p;

    for (p = 0; self->params != NULL && p < self->nnodes; p++)
        tt_pad_node_free(&self->params[p]);
}

static int
tt_pad_node_visit(const TtPadNode *node, visitproc visit, void *arg)
{
    Py_ssize_t i;
    int rc;

    Py_VISIT(node->value);
    for (i = 0; node->items != NULL && i < node->count; i++)
        if ((rc = tt_pad_node_visit(&node->items[i], visit, arg)) != 0)
            return rc;
    return 0;
}

/* padded_replay.h */
int
tt_pad_nodes_visit(TtPaddedReplay *self, visitproc visit, void *arg)
{
    Py_ssize_t p;
    int rc;

    for (p = 0; self->params != NULL && p < self->nnodes; p++)
        if ((rc = tt_pad_node_visit(&self->params[p], visit, arg)) != 0)
            return rc;
    return 0;
}
