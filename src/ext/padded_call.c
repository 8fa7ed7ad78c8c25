/*
 * padded_call.c - one call of a PaddedReplay: when it fits the layout and a
 * ready bucket holds it, the copies into the bucket's buffers (the length
 * axis past the call's zeroed), the bucket's graph launched through its
 * GraphReplay (graph_call.h: the launch alone) or the target run on the
 * buffers, the outputs cut back to the call's sizes and copied out, the
 * bucket's counters; a call that does not fit, or falls outside the range,
 * run by the target; any other call handed to _slow with its bucket and
 * sizes. Python's own calls of a bucket (_pad_fit, _pad_run, _pad_filled)
 * take the same steps. See padded.c for the design.
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

/* Copies each slot's tensor into its buffer (`buffers`, a tuple): its first
 * b rows where its slot's batch is set, and where its seq is set its first n
 * positions along axis 1, the rest of those rows zeroed; bb and bn: the
 * buffers' batch and length. The one copy-in rule. -1 on error. */
static int
tt_pad_copy_in(TtPaddedReplay *self, PyObject *buffers, PyObject *const *found, Py_ssize_t b,
               Py_ssize_t n, Py_ssize_t bb, Py_ssize_t bn)
{
    TtState *st = self->state;
    Py_ssize_t s;

    for (s = 0; s < self->nslots; s++) {
        PyObject *view = Py_NewRef(PyTuple_GET_ITEM(buffers, s)); /* new reference */
        PyObject *next = NULL, *tail = NULL;                       /* new references */
        int ok = 0;

        if (self->slots[s].batch && b < bb) {
            if ((next = tt_pad_narrow(st, view, 0, 0, b)) == NULL)
                goto next_slot;
            Py_SETREF(view, next);
        }
        if (self->slots[s].seq && n < bn) {
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

/* The run of a bucket without a graph: the target on the call with each
 * slot's tensor replaced by its buffer, in the recorded layout; the list of
 * its output leaves. New reference, or NULL. */
static PyObject *
tt_pad_run_target(TtPaddedReplay *self, PyObject *buffers, PyObject *rebuild, PyObject *const *args,
                  const TtPadFound *found)
{
    PyObject *result = NULL, *leaves = NULL, *flat = NULL; /* new references */
    PyObject **bound;
    Py_ssize_t p;
    TtStack stack;

    stack.heap = NULL;
    stack.room = 0;
    if ((bound = tt_stack_reserve(&stack, self->nparams)) == NULL ||
        tt_pad_bind_buffers(self, buffers, args, found, bound + 1) < 0)
        goto cleanup;
    result = PyObject_Vectorcall(self->target, bound + 1,
                                 (size_t)self->nargs | PY_VECTORCALL_ARGUMENTS_OFFSET,
                                 PyTuple_GET_SIZE(self->kwnames) > 0 ? self->kwnames : NULL);
    for (p = 0; p < self->nparams; p++)
        Py_DECREF(bound[1 + p]);
    if (result == NULL)
        goto cleanup;
    if (rebuild == NULL) {
        leaves = PyList_New(1);
        if (leaves != NULL)
            PyList_SET_ITEM(leaves, 0, Py_NewRef(result));
    }
    else if ((flat = PyObject_CallOneArg(self->flatten, result)) != NULL) {
        leaves = PySequence_List(flat);
    }
    if (leaves != NULL && PyList_GET_SIZE(leaves) != self->nouts) {
        PyErr_Format(PyExc_RuntimeError, "PaddedReplay: the module returned %zd output leaves "
                     "on a bucket, %zd when it was recorded", PyList_GET_SIZE(leaves), self->nouts);
        Py_CLEAR(leaves);
    }
cleanup:
    Py_XDECREF(result);
    Py_XDECREF(flat);
    if (stack.heap != NULL)
        PyMem_Free(stack.heap);
    return leaves;
}

/* Each of the leaves of `leaves` (a list of nouts) as a call returns it: a
 * tensor cut back to the call's b rows where out_batch[j] (bb: the bucket's)
 * and its first n positions along axis 1 where out_length[j] (bn), and
 * copied, so a later call never changes what a caller holds; other leaves as
 * they are. The one cut-out rule. A new list, or NULL. */
static PyObject *
tt_pad_cut(TtPaddedReplay *self, PyObject *leaves, Py_ssize_t b, Py_ssize_t n, Py_ssize_t bb,
           Py_ssize_t bn)
{
    TtState *st = self->state;
    PyObject *outs = PyList_New(self->nouts); /* new reference */
    Py_ssize_t j;

    if (outs == NULL)
        return NULL;
    for (j = 0; j < self->nouts; j++) {
        PyObject *leaf = Py_NewRef(PyList_GET_ITEM(leaves, j)); /* new reference */
        PyObject *next;

        if (PyObject_TypeCheck(leaf, st->tensor_type)) {
            if (self->out_batch[j] && b < bb) {
                next = tt_pad_narrow(st, leaf, 0, 0, b);
                Py_SETREF(leaf, next);
            }
            if (leaf != NULL && self->out_length[j] && n < bn) {
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

/* A call that fits bucket `bk` (ready or not), through it: the copies in, the
 * launch or the target, the cuts out; counted (hits only when `hit`). New
 * reference, or NULL. */
static PyObject *
tt_pad_through(TtPaddedReplay *self, TtPadBucket *bk, const TtPadFound *found,
               PyObject *const *args, int hit)
{
    /* held across the call: Python code run by torch may set or drop this bucket */
    PyObject *buffers = Py_NewRef(bk->buffers);
    PyObject *graph = Py_XNewRef(bk->graph);
    PyObject *outputs = Py_XNewRef(bk->outputs);
    PyObject *rebuild = Py_XNewRef(bk->rebuild);
    PyObject *leaves = NULL, *outs = NULL; /* new references */
    PyObject *result = NULL;
    Py_ssize_t bb = bk->b, bn = bk->n;
    TtCuStream stream = NULL;

    if (graph != NULL && tt_graph_launch_begin(graph, &stream) < 0)
        goto cleanup;
    if (tt_pad_copy_in(self, buffers, found->tensors, found->b, found->n, bb, bn) < 0)
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
    else if ((leaves = tt_pad_run_target(self, buffers, rebuild, args, found)) == NULL) {
        goto cleanup;
    }
    if ((outs = tt_pad_cut(self, leaves, found->b, found->n, bb, bn)) == NULL)
        goto cleanup;
    result = rebuild == NULL ? Py_NewRef(PyList_GET_ITEM(outs, 0)) : PyObject_CallOneArg(rebuild, outs);
    if (result == NULL)
        goto cleanup;
    bk->hits += hit != 0;
    bk->valid += (unsigned long long)found->b * (unsigned long long)(self->length ? found->n : 1);
    bk->served += (unsigned long long)bb * (unsigned long long)(self->length ? bn : 1);
cleanup:
    Py_DECREF(buffers);
    Py_XDECREF(graph);
    Py_XDECREF(outputs);
    Py_XDECREF(rebuild);
    Py_XDECREF(leaves);
    Py_XDECREF(outs);
    return result;
}

/* A call that fits but no ready bucket holds: self._slow(bucket_b, bucket_n,
 * b, n, *args, **kwargs). New reference, or NULL. */
static PyObject *
tt_pad_hand_back(TtPaddedReplay *self, Py_ssize_t bb, Py_ssize_t bn, const TtPadFound *found,
                 PyObject *const *args, size_t nargsf, PyObject *kwnames)
{
    Py_ssize_t nargs = PyVectorcall_NARGS(nargsf), total, i;
    PyObject *go = NULL, *result = NULL; /* new references */
    PyObject **stack_args = NULL;
    Py_ssize_t sizes[4] = {bb, bn, found->b, found->n};
    TtStack stack;

    stack.heap = NULL;
    stack.room = 0;
    total = nargs + (kwnames != NULL ? PyTuple_GET_SIZE(kwnames) : 0);
    if ((stack_args = tt_stack_reserve(&stack, total + 4)) == NULL)
        goto cleanup;
    for (i = 0; i < 4; i++)
        stack_args[i] = NULL;
    for (i = 0; i < 4; i++)
        if ((stack_args[i] = PyLong_FromSsize_t(sizes[i])) == NULL)
            goto cleanup;
    memcpy(stack_args + 4, args, sizeof(PyObject *) * (size_t)total);
    if ((go = PyObject_GetAttr((PyObject *)self, self->state->str_slow)) == NULL)
        goto cleanup;
    if (Py_EnterRecursiveCall(" in a padded call"))
        goto cleanup;
    result = PyObject_Vectorcall(go, stack_args, (size_t)(nargs + 4), kwnames);
    Py_LeaveRecursiveCall();
cleanup:
    for (i = 0; stack_args != NULL && i < 4; i++)
        Py_XDECREF(stack_args[i]);
    Py_XDECREF(go);
    if (stack.heap != NULL)
        PyMem_Free(stack.heap);
    return result;
}

/* Room for what tt_pad_fit finds of a call: in the frame for a few slots and
 * parameters, else on the heap. -1 with MemoryError. */
typedef struct TtPadRoom {
    PyObject *tensors_small[TT_SMALL_STACK];
    Py_ssize_t at_small[TT_SMALL_STACK];
    PyObject **tensors_heap;
    Py_ssize_t *at_heap;
} TtPadRoom;

static int
tt_pad_room(TtPaddedReplay *self, TtPadRoom *room, TtPadFound *found)
{
    size_t ns = (size_t)self->nslots + 1, np = (size_t)self->nparams + 1;

    room->tensors_heap = NULL;
    room->at_heap = NULL;
    found->tensors = ns <= TT_SMALL_STACK ? room->tensors_small
                                          : (room->tensors_heap = PyMem_Calloc(ns, sizeof(PyObject *)));
    if (found->tensors == room->tensors_small)
        memset(found->tensors, 0, sizeof(PyObject *) * ns);
    found->at = np <= TT_SMALL_STACK ? room->at_small
                                     : (room->at_heap = PyMem_Calloc(np, sizeof(Py_ssize_t)));
    if (found->tensors == NULL || found->at == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    return 0;
}

static void
tt_pad_room_free(TtPaddedReplay *self, TtPadRoom *room, TtPadFound *found)
{
    if (found->tensors != NULL)
        tt_pad_found_release(self, found);
    PyMem_Free(room->tensors_heap);
    PyMem_Free(room->at_heap);
}

/* A call that came in while this object is busy, or before a layout: the
 * target on the call as it is. New reference, or NULL. */
static PyObject *
tt_pad_as_is(TtPaddedReplay *self, PyObject *const *args, size_t nargsf, PyObject *kwnames)
{
    if (self->target == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "PaddedReplay has no layout, or has been cleared");
        return NULL;
    }
    return PyObject_Vectorcall(self->target, args, nargsf, kwnames);
}

PyObject *
tt_pad_vectorcall(PyObject *callable, PyObject *const *args, size_t nargsf, PyObject *kwnames)
{
    TtPaddedReplay *self = (TtPaddedReplay *)callable;
    PyObject *result = NULL;
    TtPadFound found = {NULL, NULL, 0, 0};
    TtPadRoom room = {{NULL}, {0}, NULL, NULL};
    TtPadBucket *bk = NULL;
    Py_ssize_t bb = 0, bn = 0;
    int fits;

    Py_INCREF(self); /* a callback may drop the caller's reference */
    if (TT_UNLIKELY(self->busy || self->nparams == 0)) {
        result = tt_pad_as_is(self, args, nargsf, kwnames);
        goto done;
    }
    /* taken before the fit, which can run Python (a plain value's __eq__) and so let another
     * thread in: that call runs the target, never the buffers */
    self->busy = 1;
    if (tt_pad_room(self, &room, &found) < 0 ||
        (fits = tt_pad_fit(self, args, PyVectorcall_NARGS(nargsf), kwnames, &found)) < 0)
        goto cleanup;
    if (fits && (bk = tt_pad_find(self, found.b, found.n)) != NULL) {
        self->serving = bk; /* _pad_drop leaves it while a call replays it */
        result = tt_pad_through(self, bk, &found, args, 1);
        self->serving = NULL;
        self->fast += result != NULL;
    }
    else if (!fits || !tt_pad_key(self, found.b, found.n, &bb, &bn)) {
        self->outside++; /* another layout, dtype, device or size, or outside the range */
        result = tt_pad_as_is(self, args, nargsf, kwnames);
    }
    else {
        /* _slow writes buffers too (recording, a first sight's check): busy stays set, so a
         * call that comes in meanwhile runs the target */
        self->slow++;
        tt_pad_found_release(self, &found); /* not held while Python runs */
        result = tt_pad_hand_back(self, bb, bn, &found, args, nargsf, kwnames);
    }
cleanup:
    self->busy = 0;
    tt_pad_room_free(self, &room, &found);
done:
    Py_DECREF(self);
    return result;
}


/* ------------------------------------------- Python's calls of a bucket */

/* Fits Python's (args, kwargs) call: its vector in `vector` (borrowed items
 * of args and kwargs), its keywords in *kwnames (a new reference, or NULL).
 * 1, 0 or -1 as tt_pad_fit. */
static int
tt_pad_fit_py(TtPaddedReplay *self, PyObject *call, TtStack *stack, PyObject **kwnames,
              TtPadFound *found, PyObject ***vector)
{
    PyObject *cargs, *ckwargs, *key, *value; /* borrowed */
    Py_ssize_t nargs, pos = 0, i;

    *kwnames = NULL;
    if (!PyArg_ParseTuple(call, "O!O!", &PyTuple_Type, &cargs, &PyDict_Type, &ckwargs))
        return -1;
    nargs = PyTuple_GET_SIZE(cargs);
    if ((*vector = tt_stack_reserve(stack, nargs + PyDict_GET_SIZE(ckwargs))) == NULL ||
        (*kwnames = PyTuple_New(PyDict_GET_SIZE(ckwargs))) == NULL)
        return -1;
    for (i = 0; i < nargs; i++)
        (*vector)[i] = PyTuple_GET_ITEM(cargs, i);
    for (i = 0; PyDict_Next(ckwargs, &pos, &key, &value); i++) {
        PyTuple_SET_ITEM(*kwnames, i, Py_NewRef(key));
        (*vector)[nargs + i] = value;
    }
    if (self->nparams == 0) {
        PyErr_SetString(PyExc_RuntimeError, "PaddedReplay: no layout (_pad_layout)");
        return -1;
    }
    return tt_pad_fit(self, *vector, nargs, PyTuple_GET_SIZE(*kwnames) > 0 ? *kwnames : NULL, found);
}

/* Python's call (args, kwargs): fitted, its bucket found (held, ready or
 * not), then what `then` makes of it. New reference, or NULL. */
typedef PyObject *(*TtPadThen)(TtPaddedReplay *self, TtPadBucket *bk, const TtPadFound *found,
                               PyObject *const *vector, int flag);

static PyObject *
tt_pad_with_bucket(TtPaddedReplay *self, PyObject *call, TtPadThen then, int flag)
{
    PyObject *kwnames = NULL, *result = NULL; /* new references */
    PyObject **vector = NULL;
    TtPadFound found = {NULL, NULL, 0, 0};
    TtPadRoom room = {{NULL}, {0}, NULL, NULL};
    TtPadBucket *bk;
    TtStack stack;
    Py_ssize_t bb, bn;
    int fits;

    stack.heap = NULL;
    stack.room = 0;
    if (tt_pad_room(self, &room, &found) < 0 ||
        (fits = tt_pad_fit_py(self, call, &stack, &kwnames, &found, &vector)) < 0)
        goto cleanup;
    if (!fits || !tt_pad_key(self, found.b, found.n, &bb, &bn)) {
        PyErr_SetString(PyExc_ValueError, "PaddedReplay: the call does not fit the layout, or "
                        "falls outside the range");
        goto cleanup;
    }
    if ((bk = tt_pad_held(self, bb, bn)) == NULL) {
        PyErr_Format(PyExc_LookupError, "PaddedReplay: bucket %zd x %zd holds nothing", bb, bn);
        goto cleanup;
    }
    result = then(self, bk, &found, vector, flag);
cleanup:
    tt_pad_room_free(self, &room, &found);
    Py_XDECREF(kwnames);
    if (stack.heap != NULL)
        PyMem_Free(stack.heap);
    return result;
}

/* _pad_run's work: tt_pad_through. */
static PyObject *
tt_pad_then_run(TtPaddedReplay *self, TtPadBucket *bk, const TtPadFound *found,
                PyObject *const *vector, int hit)
{
    return tt_pad_through(self, bk, found, vector, hit);
}

/* _pad_filled's work: the copies in, then the call with the buffers in place
 * as (args, kwargs) of the recorded layout. */
static PyObject *
tt_pad_then_fill(TtPaddedReplay *self, TtPadBucket *bk, const TtPadFound *found,
                 PyObject *const *vector, int unused)
{
    PyObject *buffers = Py_NewRef(bk->buffers); /* held: Python code may set the bucket */
    PyObject *bound[TT_SMALL_STACK], **heap = NULL, **use = bound;
    PyObject *cargs = NULL, *ckwargs = NULL, *result = NULL; /* new references */
    Py_ssize_t p;

    (void)unused;
    if ((size_t)self->nparams + 1 > TT_SMALL_STACK &&
        (use = heap = PyMem_Calloc((size_t)self->nparams + 1, sizeof(PyObject *))) == NULL) {
        PyErr_NoMemory();
        goto cleanup;
    }
    if (tt_pad_copy_in(self, buffers, found->tensors, found->b, found->n, bk->b, bk->n) < 0 ||
        tt_pad_bind_buffers(self, buffers, vector, found, use) < 0)
        goto cleanup;
    if ((cargs = PyTuple_New(self->nargs)) != NULL && (ckwargs = PyDict_New()) != NULL) {
        for (p = 0; p < self->nparams; p++) {
            if (p < self->nargs)
                PyTuple_SET_ITEM(cargs, p, Py_NewRef(use[p]));
            else if (PyDict_SetItem(ckwargs, PyTuple_GET_ITEM(self->kwnames, p - self->nargs), use[p]) < 0)
                break;
        }
        if (p == self->nparams)
            result = PyTuple_Pack(2, cargs, ckwargs);
    }
    for (p = 0; p < self->nparams; p++)
        Py_DECREF(use[p]);
cleanup:
    Py_DECREF(buffers);
    Py_XDECREF(cargs);
    Py_XDECREF(ckwargs);
    PyMem_Free(heap);
    return result;
}

PyObject *
tt_pad_py_run(TtPaddedReplay *self, PyObject *args)
{
    PyObject *call;
    int hit = 0;

    if (!PyArg_ParseTuple(args, "O!|p:_pad_run", &PyTuple_Type, &call, &hit))
        return NULL;
    return tt_pad_with_bucket(self, call, tt_pad_then_run, hit);
}

PyObject *
tt_pad_py_filled(TtPaddedReplay *self, PyObject *args)
{
    PyObject *call;

    if (!PyArg_ParseTuple(args, "O!:_pad_filled", &PyTuple_Type, &call))
        return NULL;
    return tt_pad_with_bucket(self, call, tt_pad_then_fill, 0);
}

PyObject *
tt_pad_py_fit(TtPaddedReplay *self, PyObject *args)
{
    PyObject *call, *kwnames = NULL, *tensors = NULL, *key = NULL, *result = NULL; /* new refs */
    PyObject **vector = NULL;
    TtPadFound found = {NULL, NULL, 0, 0};
    TtPadRoom room = {{NULL}, {0}, NULL, NULL};
    TtStack stack;
    Py_ssize_t bb, bn, s;
    int fits;

    stack.heap = NULL;
    stack.room = 0;
    if (!PyArg_ParseTuple(args, "O!:_pad_fit", &PyTuple_Type, &call) ||
        tt_pad_room(self, &room, &found) < 0 ||
        (fits = tt_pad_fit_py(self, call, &stack, &kwnames, &found, &vector)) < 0)
        goto cleanup;
    if (!fits) {
        result = Py_NewRef(Py_None);
        goto cleanup;
    }
    if ((tensors = PyTuple_New(self->nslots)) == NULL)
        goto cleanup;
    for (s = 0; s < self->nslots; s++)
        PyTuple_SET_ITEM(tensors, s, Py_NewRef(found.tensors[s]));
    key = tt_pad_key(self, found.b, found.n, &bb, &bn) ? Py_BuildValue("(nn)", bb, bn) : Py_NewRef(Py_None);
    if (key != NULL)
        result = Py_BuildValue("(nnOO)", found.b, found.n, key, tensors);
cleanup:
    tt_pad_room_free(self, &room, &found);
    Py_XDECREF(kwnames);
    Py_XDECREF(tensors);
    Py_XDECREF(key);
    if (stack.heap != NULL)
        PyMem_Free(stack.heap);
    return result;
}
