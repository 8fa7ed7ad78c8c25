/*
 * padded.c - the PaddedReplay type, the base type of the padded backend's
 * callable (torch_tweak.backends.padded.PaddedCall): the steady per-call
 * path of a call of varying sizes.
 *
 * A call is served here when it fits the recorded layout (the same
 * positional count and keywords, the same plain values, each input tensor
 * a torch.Tensor of the recorded dtype, device and rank, sizes equal to the
 * recorded ones but on the padded axes) and a ready bucket's range holds its
 * batch and length. Then, for that bucket: each input is copied into the
 * bucket's buffer (its first rows; the length axis past the call's length
 * zeroed in those rows, so a mask there is zero), the bucket's device graph
 * is launched through its GraphReplay (graph.h: the launch alone), or, with
 * no graph, the target runs on the buffers, and each output is cut back to
 * the call's batch and length and copied out, so a later call never
 * changes what a caller holds. The bucket counts the call (hits, valid and
 * served elements).
 *
 * Any other call goes back to Python, to the subclass's _slow method: a new
 * bucket's first sight, recording, a call outside every range, or one that
 * does not fit (another dtype or device, a tensor subclass...). A call made
 * while another is inside this object, here or in _slow (the dispatcher
 * serialises a backend that is not thread-safe: this is a call made from
 * inside one, or past the dispatcher) runs the target on its own arguments,
 * never the buffers.
 *
 * Which buckets exist, their ranges and what they hold are Python's
 * decisions (backends/padded.py), set through _pad_bucket; nothing of the
 * bucket rule is repeated here.
 */
#include "padded.h"

#include "graph.h"
#include "signature.h"

#include <string.h>

/* One input tensor of the call. */
typedef struct TtPadSlot {
    Py_ssize_t param; /* its index among the call's parameters: positional, then keyword */
    int batch;        /* axis 0 is the batch: padded (rows of earlier calls) */
    int seq;          /* axis 1 is the length: padded with zeros */
    PyObject *dtype;  /* the recorded dtype, device and torch.Size */
    PyObject *device;
    PyObject *shape;
} TtPadSlot;

/* A bucket: its sizes, the range of calls it takes, what a call runs. Its
 * counters live as long as this object; the rest is set when it is ready. */
typedef struct TtPadBucket {
    Py_ssize_t b, n;         /* the bucket's batch and length (n 0: no length axis) */
    Py_ssize_t low_b, low_n; /* the smallest call it takes */
    PyObject *buffers;       /* a tuple: the static input of each slot; NULL: not ready */
    PyObject *graph;         /* a GraphReplay, or NULL: the target runs on the buffers */
    PyObject *outputs;       /* graph: the list of its static output leaves */
    PyObject *rebuild;       /* the result from the list of leaves; NULL: the one leaf */
    unsigned long long hits, valid, served;
} TtPadBucket;

typedef struct {
    PyObject_HEAD
    vectorcallfunc vectorcall;
    TtState *state;
    PyObject *target;      /* runs a bucket without a graph; and a call made while busy */
    PyObject *flatten;     /* a target's result into its list of leaves */
    Py_ssize_t nargs;      /* the recorded layout: positional arguments */
    PyObject *kwnames;     /* keywords, interned, in the recorded order */
    Py_ssize_t nparams;    /* nargs + keywords; 0: no call is served here */
    Py_ssize_t nplain;     /* the length of plain and slot_of */
    PyObject **plain;      /* per parameter: its recorded value, or NULL for a tensor slot */
    Py_ssize_t *slot_of;   /* per parameter: its slot, or -1 */
    Py_ssize_t nslots;
    TtPadSlot *slots;
    Py_ssize_t nouts;
    int *out_batch;        /* per output leaf: axis 0 is cut to the call's batch */
    int *out_length;       /* per output leaf: axis 1 is cut to the call's length */
    int length;            /* the length axis is padded: a call's n counts */
    int laid_out;          /* _pad_layout was called */
    Py_ssize_t nbuckets, room;
    TtPadBucket **buckets; /* each allocated once, freed with this object */
    Py_ssize_t last;       /* the bucket of the last call served here */
    int busy;
    unsigned long long fast, slow;
} TtPaddedReplay;

/* ---------------------------------------------------------- helpers */

/* t.narrow(dim, start, length). New reference, or NULL. */
static PyObject *
tt_pad_narrow(TtState *st, PyObject *t, int dim, Py_ssize_t start, Py_ssize_t length)
{
    PyObject *stack[4] = {t, NULL, NULL, NULL};
    PyObject *result = NULL;
    int i;

    if ((stack[1] = PyLong_FromLong(dim)) == NULL || (stack[2] = PyLong_FromSsize_t(start)) == NULL ||
        (stack[3] = PyLong_FromSsize_t(length)) == NULL)
        goto cleanup;
    result = PyObject_VectorcallMethod(st->str_narrow, stack, 4 | PY_VECTORCALL_ARGUMENTS_OFFSET, NULL);
cleanup:
    for (i = 1; i < 4; i++)
        Py_XDECREF(stack[i]);
    return result;
}

/* t.method() or t.method(arg): the result dropped. -1 on error. */
static int
tt_pad_inplace(PyObject *t, PyObject *method, PyObject *arg)
{
    PyObject *stack[2] = {t, arg};
    PyObject *done = PyObject_VectorcallMethod(method, stack, (arg != NULL ? 2 : 1) |
                                               PY_VECTORCALL_ARGUMENTS_OFFSET, NULL);

    if (done == NULL)
        return -1;
    Py_DECREF(done);
    return 0;
}

/* The size of axis `axis` of a torch.Size, or -1 with an exception. */
static Py_ssize_t
tt_pad_size(PyObject *shape, Py_ssize_t axis)
{
    return PyLong_AsSsize_t(PyTuple_GET_ITEM(shape, axis));
}

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

/* 1 when the call fits the recorded layout: found[s] (borrowed) and at[s]
 * (its index in the call's vector) per slot, the call's batch in *b and
 * length in *n (0 with no length axis); 0 when not; -1 on error. */
static int
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

/* The ready bucket whose range holds (b, n), or NULL (no exception). */
static TtPadBucket *
tt_pad_find(TtPaddedReplay *self, Py_ssize_t b, Py_ssize_t n)
{
    Py_ssize_t k, i;

    for (k = 0; k <= self->nbuckets; k++) {
        TtPadBucket *bk;

        i = k == 0 ? self->last : k - 1;
        if (i >= self->nbuckets)
            continue;
        bk = self->buckets[i];
        if (bk->buffers != NULL && bk->low_b <= b && b <= bk->b && bk->low_n <= n && n <= bk->n) {
            self->last = i;
            return bk;
        }
    }
    return NULL;
}

/* ------------------------------------------------------------ a call */

/* Copies each slot's tensor into the bucket's buffer: its first b rows, and
 * along a length axis its first n positions, the rest of those rows zeroed.
 * -1 on error. */
static int
tt_pad_copy_in(TtPaddedReplay *self, const TtPadBucket *bk, PyObject *buffers, PyObject **found,
               Py_ssize_t b, Py_ssize_t n)
{
    TtState *st = self->state;
    Py_ssize_t s;
    int rc = -1;

    for (s = 0; s < self->nslots; s++) {
        const TtPadSlot *slot = &self->slots[s];
        PyObject *view = Py_NewRef(PyTuple_GET_ITEM(buffers, s)); /* new reference */
        PyObject *next = NULL, *tail = NULL;                       /* new references */
        int ok = 0;

        if (slot->batch && b < bk->b) {
            if ((next = tt_pad_narrow(st, view, 0, 0, b)) == NULL)
                goto next_slot;
            Py_SETREF(view, next);
        }
        if (slot->seq && n < bk->n) {
            if ((tail = tt_pad_narrow(st, view, 1, n, bk->n - n)) == NULL ||
                tt_pad_inplace(tail, st->str_zero_, NULL) < 0 ||
                (next = tt_pad_narrow(st, view, 1, 0, n)) == NULL)
                goto next_slot;
            Py_SETREF(view, next);
        }
        ok = tt_pad_inplace(view, st->str_copy_, found[s]) == 0;
next_slot:
        Py_XDECREF(tail);
        Py_DECREF(view);
        if (!ok)
            goto cleanup;
    }
    rc = 0;
cleanup:
    return rc;
}

/* The run of a bucket without a graph: the target on the call with each
 * slot's tensor replaced by its buffer; the list of its output leaves. New
 * reference, or NULL. */
static PyObject *
tt_pad_run_target(TtPaddedReplay *self, PyObject *buffers, PyObject *rebuild,
                  PyObject *const *args, size_t nargsf, PyObject *kwnames, const Py_ssize_t *at)
{
    Py_ssize_t nargs = PyVectorcall_NARGS(nargsf), total, s;
    PyObject *result = NULL, *leaves = NULL; /* new references */
    PyObject **bound;
    TtStack stack;

    stack.heap = NULL;
    stack.room = 0;
    total = nargs + (kwnames != NULL ? PyTuple_GET_SIZE(kwnames) : 0);
    if ((bound = tt_stack_reserve(&stack, total)) == NULL)
        goto cleanup;
    memcpy(bound + 1, args, sizeof(PyObject *) * (size_t)total);
    for (s = 0; s < self->nslots; s++)
        bound[1 + at[s]] = PyTuple_GET_ITEM(buffers, s); /* borrowed: buffers is held */
    result = PyObject_Vectorcall(self->target, bound + 1,
                                 (size_t)nargs | PY_VECTORCALL_ARGUMENTS_OFFSET, kwnames);
    if (result == NULL)
        goto cleanup;
    if (rebuild == NULL) {
        leaves = PyList_New(1);
        if (leaves == NULL)
            goto cleanup;
        PyList_SET_ITEM(leaves, 0, result);
        result = NULL;
    }
    else {
        PyObject *flat = PyObject_CallOneArg(self->flatten, result); /* new reference */

        if (flat == NULL)
            goto cleanup;
        leaves = PySequence_List(flat);
        Py_DECREF(flat);
        if (leaves == NULL)
            goto cleanup;
    }
    if (PyList_GET_SIZE(leaves) != self->nouts) {
        PyErr_Format(PyExc_RuntimeError, "PaddedReplay: the module returned %zd output leaves "
                     "on a bucket, %zd when it was recorded", PyList_GET_SIZE(leaves), self->nouts);
        Py_CLEAR(leaves);
    }
cleanup:
    Py_XDECREF(result);
    if (stack.heap != NULL)
        PyMem_Free(stack.heap);
    return leaves;
}

/* What the call returns: each tensor leaf cut back to the call's batch and
 * length and copied, plain leaves as they are, rebuilt. New reference. */
static PyObject *
tt_pad_copy_out(TtPaddedReplay *self, const TtPadBucket *bk, PyObject *leaves, PyObject *rebuild,
                Py_ssize_t b, Py_ssize_t n)
{
    TtState *st = self->state;
    PyObject *outs = PyList_New(self->nouts); /* new reference */
    PyObject *result = NULL;
    Py_ssize_t j;

    if (outs == NULL)
        goto cleanup;
    for (j = 0; j < self->nouts; j++) {
        PyObject *leaf = Py_NewRef(PyList_GET_ITEM(leaves, j)); /* new reference */
        PyObject *next;

        if (PyObject_TypeCheck(leaf, st->tensor_type)) {
            if (self->out_batch[j] && b < bk->b) {
                next = tt_pad_narrow(st, leaf, 0, 0, b);
                Py_SETREF(leaf, next);
            }
            if (leaf != NULL && self->out_length[j] && n < bk->n) {
                next = tt_pad_narrow(st, leaf, 1, 0, n);
                Py_SETREF(leaf, next);
            }
            if (leaf != NULL) {
                next = PyObject_VectorcallMethod(st->str_clone, &leaf,
                                                 1 | PY_VECTORCALL_ARGUMENTS_OFFSET, NULL);
                Py_SETREF(leaf, next);
            }
            if (leaf == NULL)
                goto cleanup;
        }
        PyList_SET_ITEM(outs, j, leaf);
    }
    if (rebuild == NULL)
        result = Py_NewRef(PyList_GET_ITEM(outs, 0));
    else
        result = PyObject_CallOneArg(rebuild, outs);
cleanup:
    Py_XDECREF(outs);
    return result;
}

/* A call that fits bucket `bk`. New reference, or NULL. */
static PyObject *
tt_pad_serve(TtPaddedReplay *self, TtPadBucket *bk, PyObject **found, const Py_ssize_t *at,
             Py_ssize_t b, Py_ssize_t n, PyObject *const *args, size_t nargsf, PyObject *kwnames)
{
    /* held across the call: Python code run by torch may set this bucket again */
    PyObject *buffers = Py_NewRef(bk->buffers);
    PyObject *graph = Py_XNewRef(bk->graph);
    PyObject *outputs = Py_XNewRef(bk->outputs);
    PyObject *rebuild = Py_XNewRef(bk->rebuild);
    PyObject *leaves = NULL; /* new reference */
    PyObject *result = NULL;
    TtCuStream stream = NULL;

    if (graph != NULL && tt_graph_launch_begin(graph, &stream) < 0)
        goto cleanup;
    if (tt_pad_copy_in(self, bk, buffers, found, b, n) < 0)
        goto cleanup;
    if (graph != NULL) {
        if (outputs == NULL) {
            PyErr_SetString(PyExc_RuntimeError, "PaddedReplay: a graph bucket without outputs");
            goto cleanup;
        }
        if (tt_graph_launch(graph, stream) < 0)
            goto cleanup;
        leaves = Py_NewRef(outputs);
    }
    else if ((leaves = tt_pad_run_target(self, buffers, rebuild, args, nargsf, kwnames, at)) ==
             NULL) {
        goto cleanup;
    }
    if ((result = tt_pad_copy_out(self, bk, leaves, rebuild, b, n)) == NULL)
        goto cleanup;
    bk->hits++;
    bk->valid += (unsigned long long)b * (unsigned long long)(self->length ? n : 1);
    bk->served += (unsigned long long)bk->b * (unsigned long long)(self->length ? bk->n : 1);
    self->fast++;
cleanup:
    Py_DECREF(buffers);
    Py_XDECREF(graph);
    Py_XDECREF(outputs);
    Py_XDECREF(rebuild);
    Py_XDECREF(leaves);
    return result;
}

static PyObject *
tt_pad_vectorcall(PyObject *callable, PyObject *const *args, size_t nargsf, PyObject *kwnames)
{
    TtPaddedReplay *self = (TtPaddedReplay *)callable;
    Py_ssize_t nargs = PyVectorcall_NARGS(nargsf), b = 0, n = 0;
    PyObject *result = NULL;
    PyObject *go = NULL; /* new reference: where a call that is not served here goes */
    PyObject **found = NULL;      /* each slot's tensor of the call: in the frame when few */
    Py_ssize_t *at = NULL;        /* each slot's place among the arguments */
    Py_ssize_t at_small[TT_SMALL_STACK];
    Py_ssize_t *at_heap = NULL;
    TtStack stack;
    TtPadBucket *bk = NULL;
    int fits = 0, busy = 0; /* busy: this call set self->busy */

    stack.heap = NULL;
    stack.room = 0;
    Py_INCREF(self); /* a callback may drop the caller's reference */
    if (TT_UNLIKELY(self->busy)) {
        if (self->target == NULL) {
            PyErr_SetString(PyExc_RuntimeError, "PaddedReplay has been cleared");
            goto cleanup;
        }
        go = Py_NewRef(self->target);
    }
    else {
        /* taken before the fit, which can run Python (a plain value's __eq__) and so let
         * another thread in: that call runs the target, never the buffers */
        self->busy = busy = 1;
    }
    if (busy && self->nparams > 0) {
        /* no allocation per call for up to TT_SMALL_STACK - 1 tensors */
        if ((found = tt_stack_reserve(&stack, self->nslots)) == NULL)
            goto cleanup;
        if (self->nslots + 1 <= TT_SMALL_STACK)
            at = at_small;
        else if ((at = at_heap = PyMem_Malloc(sizeof(*at) * ((size_t)self->nslots + 1))) == NULL) {
            PyErr_NoMemory();
            goto cleanup;
        }
        memset(found, 0, sizeof(*found) * ((size_t)self->nslots + 1));
        memset(at, 0, sizeof(*at) * ((size_t)self->nslots + 1));
        fits = tt_pad_fit(self, args, nargs, kwnames, found, at, &b, &n);
        if (fits < 0)
            goto cleanup;
        if (fits)
            bk = tt_pad_find(self, b, n);
    }
    if (bk != NULL) {
        result = tt_pad_serve(self, bk, found, at, b, n, args, nargsf, kwnames);
        goto cleanup;
    }
    self->slow++;
    /* _slow writes buffers too (recording, a first sight's check): busy stays set, so a
     * call that comes in meanwhile runs the target */
    if (go == NULL && (go = PyObject_GetAttr(callable, self->state->str_slow)) == NULL)
        goto cleanup;
    if (Py_EnterRecursiveCall(" in a padded call"))
        goto cleanup;
    result = PyObject_Vectorcall(go, args, nargsf, kwnames);
    Py_LeaveRecursiveCall();
cleanup:
    if (busy)
        self->busy = 0;
    if (stack.heap != NULL)
        PyMem_Free(stack.heap);
    PyMem_Free(at_heap);
    Py_XDECREF(go);
    Py_DECREF(self);
    return result;
}

/* ------------------------------------------------------- construction */

static PyObject *
tt_pad_new(PyTypeObject *type, PyObject *args, PyObject *kwargs)
{
    TtPaddedReplay *self;

    (void)args;
    (void)kwargs; /* they are the subclass's __init__'s; _pad_layout sets the layout */
    self = (TtPaddedReplay *)type->tp_alloc(type, 0);
    if (self == NULL)
        goto error;
    if ((self->state = tt_state_from_type(type)) == NULL)
        goto error;
    self->vectorcall = tt_pad_vectorcall;
    return (PyObject *)self;
error:
    Py_XDECREF(self);
    return NULL;
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
    for (s = 0; s < PyTuple_GET_SIZE(slots); s++) {
        PyObject *spec = PyTuple_GET_ITEM(slots, s), *where, *tensor; /* borrowed */
        TtPadSlot *slot = &self->slots[s];
        int batch, seq;

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
    }
    if (self->nslots == 0) {
        PyErr_SetString(PyExc_ValueError, "_pad_layout: a call with no tensor slot");
        goto cleanup;
    }
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
    self->nparams = nparams;
    rc = 0;
cleanup:
    return rc;
}

static PyObject *
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

/* The bucket of sizes (b, n), made (counters only) when there is none.
 * Borrowed from this object; NULL with MemoryError. */
static TtPadBucket *
tt_pad_bucket_of(TtPaddedReplay *self, Py_ssize_t b, Py_ssize_t n)
{
    TtPadBucket *bk = NULL, **grown;
    Py_ssize_t i;

    for (i = 0; i < self->nbuckets; i++)
        if (self->buckets[i]->b == b && self->buckets[i]->n == n)
            return self->buckets[i];
    if (self->nbuckets == self->room) {
        grown = PyMem_Realloc(self->buckets, sizeof(*grown) * (size_t)(2 * self->room + 8));
        if (grown == NULL)
            goto error;
        self->buckets = grown;
        self->room = 2 * self->room + 8;
    }
    if ((bk = PyMem_Calloc(1, sizeof(*bk))) == NULL)
        goto error;
    bk->b = bk->low_b = b;
    bk->n = bk->low_n = n;
    self->buckets[self->nbuckets++] = bk;
    return bk;
error:
    PyErr_NoMemory();
    return NULL;
}

static PyObject *
tt_pad_set_bucket(TtPaddedReplay *self, PyObject *args, PyObject *kwargs)
{
    static char *kwlist[] = {"b", "n", "low_b", "low_n", "buffers", "graph", "outputs",
                             "rebuild", NULL};
    TtState *st = self->state;
    Py_ssize_t b, n, low_b, low_n, s;
    PyObject *buffers, *graph, *outputs, *rebuild; /* borrowed */
    PyObject *held = NULL;                         /* new reference: a tuple of the buffers */
    TtPadBucket *bk;
    PyObject *result = NULL;

    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "nnnnOOOO:_pad_bucket", kwlist, &b, &n, &low_b,
                                     &low_n, &buffers, &graph, &outputs, &rebuild))
        goto cleanup;
    if (self->nparams == 0) {
        PyErr_SetString(PyExc_RuntimeError, "_pad_bucket: no call layout to serve (_pad_layout "
                        "with a call)");
        goto cleanup;
    }
    if (low_b < 1 || low_b > b || low_n < 0 || low_n > n || (self->length && low_n < 1) ||
        (!self->length && n != 0)) {
        PyErr_Format(PyExc_ValueError, "_pad_bucket: the range %zd-%zd x %zd-%zd is not a bucket's",
                     low_b, b, low_n, n);
        goto cleanup;
    }
    if ((held = tt_sequence_tuple(buffers, "_pad_bucket: buffers must be a sequence")) == NULL)
        goto cleanup;
    if (PyTuple_GET_SIZE(held) != self->nslots) {
        PyErr_Format(PyExc_ValueError, "_pad_bucket: %zd buffers for %zd slots",
                     PyTuple_GET_SIZE(held), self->nslots);
        goto cleanup;
    }
    for (s = 0; s < self->nslots; s++) {
        PyObject *buffer = PyTuple_GET_ITEM(held, s); /* borrowed */
        PyObject *dtype;                             /* new reference */
        int same;

        if (Py_TYPE(buffer) != st->tensor_type) {
            PyErr_Format(PyExc_TypeError, "_pad_bucket: buffer %zd must be a torch.Tensor", s);
            goto cleanup;
        }
        if ((dtype = PyObject_GetAttr(buffer, st->str_dtype)) == NULL)
            goto cleanup;
        same = dtype == self->slots[s].dtype;
        Py_DECREF(dtype);
        if (!same) {
            PyErr_Format(PyExc_ValueError, "_pad_bucket: buffer %zd is not of its slot's dtype", s);
            goto cleanup;
        }
    }
    if (graph != Py_None && !PyObject_TypeCheck(graph, st->GraphReplayType)) {
        PyErr_SetString(PyExc_TypeError, "_pad_bucket: graph must be a GraphReplay or None");
        goto cleanup;
    }
    if (graph != Py_None && (!PyList_CheckExact(outputs) || PyList_GET_SIZE(outputs) != self->nouts)) {
        PyErr_Format(PyExc_ValueError, "_pad_bucket: a graph's outputs must be a list of its %zd "
                     "output leaves", self->nouts);
        goto cleanup;
    }
    if (rebuild != Py_None ? !PyCallable_Check(rebuild) : self->nouts != 1) {
        PyErr_SetString(PyExc_ValueError, "_pad_bucket: rebuild must be callable, or None for "
                        "one output leaf");
        goto cleanup;
    }
    if ((bk = tt_pad_bucket_of(self, b, n)) == NULL)
        goto cleanup;
    bk->low_b = low_b;
    bk->low_n = low_n;
    Py_XSETREF(bk->graph, graph != Py_None ? Py_NewRef(graph) : NULL);
    Py_XSETREF(bk->outputs, graph != Py_None ? PyList_GetSlice(outputs, 0, self->nouts) : NULL);
    Py_XSETREF(bk->rebuild, rebuild != Py_None ? Py_NewRef(rebuild) : NULL);
    if (graph != Py_None && bk->outputs == NULL) {
        Py_CLEAR(bk->buffers);
        goto cleanup;
    }
    Py_XSETREF(bk->buffers, held); /* last: the bucket is ready */
    held = NULL;
    result = Py_NewRef(Py_None);
cleanup:
    Py_XDECREF(held);
    return result;
}

static PyObject *
tt_pad_count(TtPaddedReplay *self, PyObject *args)
{
    Py_ssize_t b, n;
    unsigned long long hits, valid, served;
    TtPadBucket *bk;

    if (!PyArg_ParseTuple(args, "nnKKK:_pad_count", &b, &n, &hits, &valid, &served))
        return NULL;
    if ((bk = tt_pad_bucket_of(self, b, n)) == NULL)
        return NULL;
    bk->hits += hits;
    bk->valid += valid;
    bk->served += served;
    Py_RETURN_NONE;
}

static PyObject *
tt_pad_counts(TtPaddedReplay *self, PyObject *unused)
{
    PyObject *result = PyDict_New(); /* new reference */
    Py_ssize_t i;

    (void)unused;
    for (i = 0; result != NULL && i < self->nbuckets; i++) {
        const TtPadBucket *bk = self->buckets[i];
        PyObject *key = Py_BuildValue("(nn)", bk->b, bk->n);
        PyObject *value = Py_BuildValue("(KKK)", bk->hits, bk->valid, bk->served);

        if (key == NULL || value == NULL || PyDict_SetItem(result, key, value) < 0)
            Py_CLEAR(result);
        Py_XDECREF(key);
        Py_XDECREF(value);
    }
    return result;
}

static PyObject *
tt_pad_reset_counts(TtPaddedReplay *self, PyObject *unused)
{
    Py_ssize_t i;

    (void)unused;
    for (i = 0; i < self->nbuckets; i++)
        self->buckets[i]->hits = self->buckets[i]->valid = self->buckets[i]->served = 0;
    self->fast = self->slow = 0;
    Py_RETURN_NONE;
}

static PyObject *
tt_pad_ready(TtPaddedReplay *self, PyObject *unused)
{
    PyObject *result = PyList_New(0); /* new reference */
    Py_ssize_t i;

    (void)unused;
    for (i = 0; result != NULL && i < self->nbuckets; i++) {
        const TtPadBucket *bk = self->buckets[i];
        PyObject *key;

        if (bk->buffers == NULL)
            continue;
        key = Py_BuildValue("(nn)", bk->b, bk->n);
        if (key == NULL || PyList_Append(result, key) < 0)
            Py_CLEAR(result);
        Py_XDECREF(key);
    }
    return result;
}

/* ------------------------------------------------------------ lifetime */

static int
tt_pad_traverse(TtPaddedReplay *self, visitproc visit, void *arg)
{
    Py_ssize_t i;

    Py_VISIT(Py_TYPE(self));
    Py_VISIT(self->target);
    Py_VISIT(self->flatten);
    Py_VISIT(self->kwnames);
    for (i = 0; self->plain != NULL && i < self->nplain; i++)
        Py_VISIT(self->plain[i]);
    for (i = 0; self->slots != NULL && i < self->nslots; i++) {
        Py_VISIT(self->slots[i].dtype);
        Py_VISIT(self->slots[i].device);
        Py_VISIT(self->slots[i].shape);
    }
    for (i = 0; i < self->nbuckets; i++) {
        Py_VISIT(self->buckets[i]->buffers);
        Py_VISIT(self->buckets[i]->graph);
        Py_VISIT(self->buckets[i]->outputs);
        Py_VISIT(self->buckets[i]->rebuild);
    }
    return 0;
}

/* Drops every reference; the arrays stay until dealloc (a finalizer may call
 * this object after, and finds no layout: its calls go to _slow). */
static int
tt_pad_clear(TtPaddedReplay *self)
{
    Py_ssize_t i;

    self->nparams = 0;
    for (i = 0; self->plain != NULL && i < self->nplain; i++)
        Py_CLEAR(self->plain[i]);
    for (i = 0; self->slots != NULL && i < self->nslots; i++) {
        Py_CLEAR(self->slots[i].dtype);
        Py_CLEAR(self->slots[i].device);
        Py_CLEAR(self->slots[i].shape);
    }
    for (i = 0; i < self->nbuckets; i++) {
        Py_CLEAR(self->buckets[i]->buffers);
        Py_CLEAR(self->buckets[i]->graph);
        Py_CLEAR(self->buckets[i]->outputs);
        Py_CLEAR(self->buckets[i]->rebuild);
    }
    Py_CLEAR(self->target);
    Py_CLEAR(self->flatten);
    Py_CLEAR(self->kwnames);
    return 0;
}

static void
tt_pad_dealloc(TtPaddedReplay *self)
{
    PyTypeObject *tp = Py_TYPE(self);
    Py_ssize_t i;

    PyObject_GC_UnTrack(self);
    tt_pad_clear(self);
    for (i = 0; i < self->nbuckets; i++)
        PyMem_Free(self->buckets[i]);
    PyMem_Free(self->buckets);
    PyMem_Free(self->plain);
    PyMem_Free(self->slot_of);
    PyMem_Free(self->slots);
    PyMem_Free(self->out_batch);
    PyMem_Free(self->out_length);
    tp->tp_free((PyObject *)self);
    Py_DECREF(tp);
}

/* ------------------------------------------------------------ Python API */

static PyObject *
tt_pad_get_served_here(TtPaddedReplay *self, void *closure)
{
    (void)closure;
    return PyBool_FromLong(self->nparams > 0);
}

static PyGetSetDef tt_pad_getset[] = {
    {"fast_calls", tt_get_counter, NULL, "Calls served here, from a ready bucket.",
     TT_FIELD(TtPaddedReplay, fast)},
    {"slow_calls", tt_get_counter, NULL, "Calls handed to _slow (or to the target while busy).",
     TT_FIELD(TtPaddedReplay, slow)},
    {"serves_here", (getter)tt_pad_get_served_here, NULL,
     "True when a call of the recorded layout can be served here (_pad_layout had a call).",
     NULL},
    {NULL, NULL, NULL, NULL, NULL}};

static PyMethodDef tt_pad_methods[] = {
    {"_pad_layout", (PyCFunction)(void (*)(void))tt_pad_layout, METH_VARARGS | METH_KEYWORDS,
     "_pad_layout(call, slots, outputs, length, target, flatten): set once.\n"
     "call: the recorded (args, kwargs), or None (every call goes to _slow);\n"
     "slots: (position or keyword name, batch, length) per input tensor, each a\n"
     "torch.Tensor argument of call; outputs: (batch, length) per output leaf;\n"
     "length: the length axis is padded; target: runs a bucket without a graph,\n"
     "and a call made while another is inside; flatten(result) -> its leaves."},
    {"_pad_bucket", (PyCFunction)(void (*)(void))tt_pad_set_bucket, METH_VARARGS | METH_KEYWORDS,
     "_pad_bucket(b, n, low_b, low_n, buffers, graph, outputs, rebuild): bucket (b, n)\n"
     "serves the calls of batch low_b..b and length low_n..n from now on."},
    {"_pad_count", (PyCFunction)tt_pad_count, METH_VARARGS,
     "_pad_count(b, n, hits, valid, served): adds to bucket (b, n)'s counters."},
    {"_pad_counts", (PyCFunction)tt_pad_counts, METH_NOARGS,
     "_pad_counts() -> {(b, n): (hits, valid, served)}"},
    {"_pad_ready", (PyCFunction)tt_pad_ready, METH_NOARGS,
     "_pad_ready() -> [(b, n)]: the buckets served here."},
    {"reset_counts", (PyCFunction)tt_pad_reset_counts, METH_NOARGS,
     "reset_counts(): every bucket's counters, fast_calls and slow_calls to 0."},
    {NULL, NULL, 0, NULL}};

static PyMemberDef tt_pad_members[] = {
    {"__vectorcalloffset__", Py_T_PYSSIZET, offsetof(TtPaddedReplay, vectorcall), Py_READONLY,
     NULL},
    {NULL, 0, 0, 0, NULL}};

static PyType_Slot tt_pad_slots[] = {
    {Py_tp_doc,
     "Base type of the padded backend's callable: the steady per-call path of a\n"
     "call of varying sizes. A call of the layout set by _pad_layout whose batch\n"
     "and length fall in a ready bucket's range (_pad_bucket) is copied into the\n"
     "bucket's buffers (the length axis past the call's zeroed), runs the bucket's\n"
     "graph (or the target on the buffers), and returns copies of the outputs cut\n"
     "back to the call's sizes; any other call goes to self._slow(*args, **kwargs)."},
    {Py_tp_new, tt_pad_new},
    {Py_tp_dealloc, tt_pad_dealloc},
    {Py_tp_traverse, tt_pad_traverse},
    {Py_tp_clear, tt_pad_clear},
    {Py_tp_call, PyVectorcall_Call},
    {Py_tp_methods, tt_pad_methods},
    {Py_tp_getset, tt_pad_getset},
    {Py_tp_members, tt_pad_members},
    {0, NULL}};

static PyType_Spec tt_pad_spec = {
    .name = "torch_tweak._C.PaddedReplay",
    .basicsize = sizeof(TtPaddedReplay),
    .flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_BASETYPE | Py_TPFLAGS_HAVE_GC |
             Py_TPFLAGS_HAVE_VECTORCALL,
    .slots = tt_pad_slots,
};

int
tt_padded_exec(PyObject *module, TtState *st)
{
    int rc = -1;

    st->PaddedReplayType = (PyTypeObject *)PyType_FromModuleAndSpec(module, &tt_pad_spec, NULL);
    if (st->PaddedReplayType == NULL)
        goto error;
    if (PyModule_AddObjectRef(module, "PaddedReplay", (PyObject *)st->PaddedReplayType) < 0)
        goto error;
    rc = 0;
error:
    return rc;
}
