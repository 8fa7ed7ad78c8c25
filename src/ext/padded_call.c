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

