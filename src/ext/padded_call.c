/*
 * padded_call.c - one call of a PaddedReplay: when it fits the layout and a
 * ready bucket holds it, the copies into the bucket's buffers (the length
 * axis past the call's zeroed), the bucket's graph launched through its
 * GraphReplay (graph_call.h: the launch alone) or the target run on the
 * buffers, the outputs cut back to the call's sizes and copied out, the
 * bucket's counters; any other call handed to _slow. See padded.c for the
 * design.
 */
#include "padded_replay.h"

#include "graph_call.h"
#include "signature.h"

#include <string.h>

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

/* ------------------------------------------------------------ a call */

/* Copies each of `count` tensors into its buffer (`buffers`, a tuple): its
 * first b rows where its slot's batch is set, and where its seq is set its
 * first n positions along axis 1, the rest of those rows zeroed; bb and bn:
 * the buffers' batch and length. The one copy-in rule: the per-call path's
 * and the Python path's (_pad_copy_in). -1 on error. */
int
tt_pad_copy_in_as(TtState *st, PyObject *buffers, PyObject *const *found, Py_ssize_t count,
                  const TtPadSlot *slots, Py_ssize_t b, Py_ssize_t n, Py_ssize_t bb, Py_ssize_t bn)
{
    Py_ssize_t s;

    for (s = 0; s < count; s++) {
        PyObject *view = Py_NewRef(PyTuple_GET_ITEM(buffers, s)); /* new reference */
        PyObject *next = NULL, *tail = NULL;                       /* new references */
        int ok = 0;

        if (slots[s].batch && b < bb) {
            if ((next = tt_pad_narrow(st, view, 0, 0, b)) == NULL)
                goto next_slot;
            Py_SETREF(view, next);
        }
        if (slots[s].seq && n < bn) {
            if ((tail = tt_pad_narrow(st, view, 1, n, bn - n)) == NULL ||
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
            return -1;
    }
    return 0;
}

/* The copies in of a call that fits bucket `bk` (its slots' axes). -1 on error. */
static int
tt_pad_copy_in(TtPaddedReplay *self, const TtPadBucket *bk, PyObject *buffers, PyObject **found,
               Py_ssize_t b, Py_ssize_t n)
{
    return tt_pad_copy_in_as(self->state, buffers, found, self->nslots, self->slots, b, n, bk->b,
                             bk->n);
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

/* Each of the `count` leaves of `leaves` (a list) as a call returns it: a
 * tensor cut back to the call's b rows where batch[j] (bb: the bucket's) and
 * its first n positions along axis 1 where length[j] (bn), and copied, so a
 * later call never changes what a caller holds; other leaves as they are. The
 * one cut-out rule: the per-call path's and the Python path's (_pad_cut). A
 * new list, or NULL. */
PyObject *
tt_pad_cut_as(TtState *st, PyObject *leaves, Py_ssize_t count, const int *batch,
              const int *length, Py_ssize_t b, Py_ssize_t n, Py_ssize_t bb, Py_ssize_t bn)
{
    PyObject *outs = PyList_New(count); /* new reference */
    Py_ssize_t j;

    if (outs == NULL)
        return NULL;
    for (j = 0; j < count; j++) {
        PyObject *leaf = Py_NewRef(PyList_GET_ITEM(leaves, j)); /* new reference */
        PyObject *next;

        if (PyObject_TypeCheck(leaf, st->tensor_type)) {
            if (batch[j] && b < bb) {
                next = tt_pad_narrow(st, leaf, 0, 0, b);
                Py_SETREF(leaf, next);
            }
            if (leaf != NULL && length[j] && n < bn) {
                next = tt_pad_narrow(st, leaf, 1, 0, n);
                Py_SETREF(leaf, next);
            }
            if (leaf != NULL) {
                next = PyObject_VectorcallMethod(st->str_clone, &leaf,
                                                 1 | PY_VECTORCALL_ARGUMENTS_OFFSET, NULL);
                Py_SETREF(leaf, next);
            }
            if (leaf == NULL) {
                Py_DECREF(outs);
                return NULL;
            }
        }
        PyList_SET_ITEM(outs, j, leaf);
    }
    return outs;
}

/* What the call returns: its leaves cut out (tt_pad_cut_as) and rebuilt. New
 * reference, or NULL. */
static PyObject *
tt_pad_copy_out(TtPaddedReplay *self, const TtPadBucket *bk, PyObject *leaves, PyObject *rebuild,
                Py_ssize_t b, Py_ssize_t n)
{
    PyObject *outs = tt_pad_cut_as(self->state, leaves, self->nouts, self->out_batch,
                                   self->out_length, b, n, bk->b, bk->n); /* new reference */
    PyObject *result = NULL;

    if (outs == NULL)
        return NULL;
    if (rebuild == NULL)
        result = Py_NewRef(PyList_GET_ITEM(outs, 0));
    else
        result = PyObject_CallOneArg(rebuild, outs);
    Py_DECREF(outs);
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

PyObject *
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


/* ------------------------------------------- Python's calls of a bucket */

/* Per item of `axes` (a sequence of `count` pairs of truth values), its two
 * flags into first[] and second[]. -1 with an exception. */
static int
tt_pad_read_axes(PyObject *axes, Py_ssize_t count, int *first, int *second, const char *what)
{
    PyObject *fast = PySequence_Fast(axes, what); /* new reference */
    Py_ssize_t i;
    int rc = -1;

    if (fast == NULL)
        return -1;
    if (PySequence_Fast_GET_SIZE(fast) != count) {
        PyErr_Format(PyExc_ValueError, "%s: %zd axis pairs for %zd tensors", what,
                     PySequence_Fast_GET_SIZE(fast), count);
        goto cleanup;
    }
    for (i = 0; i < count; i++) {
        PyObject *pair = PySequence_Fast_GET_ITEM(fast, i); /* borrowed */

        if (!PyTuple_Check(pair) || PyTuple_GET_SIZE(pair) != 2) {
            PyErr_Format(PyExc_TypeError, "%s: each axis pair must be a (batch, length) tuple",
                         what);
            goto cleanup;
        }
        if ((first[i] = PyObject_IsTrue(PyTuple_GET_ITEM(pair, 0))) < 0 ||
            (second[i] = PyObject_IsTrue(PyTuple_GET_ITEM(pair, 1))) < 0)
            goto cleanup;
    }
    rc = 0;
cleanup:
    Py_DECREF(fast);
    return rc;
}

/* torch.Tensor, looked up once (st->tensor_type set), or NULL with an
 * exception: torch not imported. */
static PyTypeObject *
tt_pad_tensor_type(TtState *st, const char *what)
{
    PyTypeObject *tensor_type = tt_state_tensor_type(st); /* borrowed */

    if (tensor_type == NULL && !PyErr_Occurred())
        PyErr_Format(PyExc_TypeError, "%s: torch is not imported", what);
    return tensor_type;
}

/* 0 when every item of the tuple is a torch.Tensor, else -1 with a TypeError. */
static int
tt_pad_all_tensors(TtState *st, PyObject *tuple, const char *what)
{
    PyTypeObject *tensor_type = tt_pad_tensor_type(st, what); /* borrowed */
    Py_ssize_t i;

    if (tensor_type == NULL)
        return -1;
    for (i = 0; i < PyTuple_GET_SIZE(tuple); i++) {
        if (!PyObject_TypeCheck(PyTuple_GET_ITEM(tuple, i), tensor_type)) {
            PyErr_Format(PyExc_TypeError, "%s: item %zd is %s, not a torch.Tensor", what, i,
                         Py_TYPE(PyTuple_GET_ITEM(tuple, i))->tp_name);
            return -1;
        }
    }
    return 0;
}

/* 0 when the sizes can be a call of a bucket (0 <= b <= bb, 0 <= n <= bn),
 * else -1 with a ValueError. */
static int
tt_pad_check_sizes(Py_ssize_t b, Py_ssize_t n, Py_ssize_t bb, Py_ssize_t bn, const char *what)
{
    if (b < 0 || n < 0 || b > bb || n > bn) {
        PyErr_Format(PyExc_ValueError, "%s: a call of batch %zd, length %zd does not fit a "
                     "bucket of %zd x %zd", what, b, n, bb, bn);
        return -1;
    }
    return 0;
}

PyObject *
tt_pad_py_copy_in(TtPaddedReplay *self, PyObject *args)
{
    PyObject *buffers, *tensors, *axes;              /* borrowed */
    PyObject *buffers_t = NULL, *tensors_t = NULL;  /* new references */
    TtPadSlot *slots = NULL;
    Py_ssize_t b, n, bb, bn, count, s;
    int *batch = NULL, *seq = NULL;
    PyObject *result = NULL;

    if (!PyArg_ParseTuple(args, "OOOnnnn:_pad_copy_in", &buffers, &tensors, &axes, &b, &n, &bb,
                          &bn))
        return NULL;
    if ((buffers_t = PySequence_Tuple(buffers)) == NULL ||
        (tensors_t = PySequence_Tuple(tensors)) == NULL)
        goto cleanup;
    count = PyTuple_GET_SIZE(buffers_t);
    if (PyTuple_GET_SIZE(tensors_t) != count) {
        PyErr_Format(PyExc_ValueError, "_pad_copy_in: %zd buffers for %zd tensors", count,
                     PyTuple_GET_SIZE(tensors_t));
        goto cleanup;
    }
    if (tt_pad_all_tensors(self->state, buffers_t, "_pad_copy_in buffers") < 0 ||
        tt_pad_all_tensors(self->state, tensors_t, "_pad_copy_in tensors") < 0 ||
        tt_pad_check_sizes(b, n, bb, bn, "_pad_copy_in") < 0)
        goto cleanup;
    slots = PyMem_Calloc((size_t)count + 1, sizeof(*slots));
    batch = PyMem_Calloc((size_t)count + 1, sizeof(*batch));
    seq = PyMem_Calloc((size_t)count + 1, sizeof(*seq));
    if (slots == NULL || batch == NULL || seq == NULL) {
        PyErr_NoMemory();
        goto cleanup;
    }
    if (tt_pad_read_axes(axes, count, batch, seq, "_pad_copy_in") < 0)
        goto cleanup;
    for (s = 0; s < count; s++) {
        slots[s].batch = batch[s];
        slots[s].seq = seq[s];
    }
    if (tt_pad_copy_in_as(self->state, buffers_t, PySequence_Fast_ITEMS(tensors_t), count, slots,
                          b, n, bb, bn) < 0)
        goto cleanup;
    result = Py_NewRef(Py_None);
cleanup:
    PyMem_Free(slots);
    PyMem_Free(batch);
    PyMem_Free(seq);
    Py_XDECREF(buffers_t);
    Py_XDECREF(tensors_t);
    return result;
}

PyObject *
tt_pad_py_cut(TtPaddedReplay *self, PyObject *args)
{
    PyObject *leaves, *axes;   /* borrowed */
    PyObject *list = NULL;     /* new reference */
    Py_ssize_t b, n, bb, bn, count;
    int *batch = NULL, *length = NULL;
    PyObject *result = NULL;

    if (!PyArg_ParseTuple(args, "OOnnnn:_pad_cut", &leaves, &axes, &b, &n, &bb, &bn))
        return NULL;
    if (tt_pad_tensor_type(self->state, "_pad_cut") == NULL ||
        (list = PySequence_List(leaves)) == NULL || tt_pad_check_sizes(b, n, bb, bn, "_pad_cut") < 0)
        goto cleanup;
    count = PyList_GET_SIZE(list);
    batch = PyMem_Calloc((size_t)count + 1, sizeof(*batch));
    length = PyMem_Calloc((size_t)count + 1, sizeof(*length));
    if (batch == NULL || length == NULL) {
        PyErr_NoMemory();
        goto cleanup;
    }
    if (tt_pad_read_axes(axes, count, batch, length, "_pad_cut") < 0)
        goto cleanup;
    result = tt_pad_cut_as(self->state, list, count, batch, length, b, n, bb, bn);
cleanup:
    PyMem_Free(batch);
    PyMem_Free(length);
    Py_XDECREF(list);
    return result;
}
