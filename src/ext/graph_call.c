/*
 * graph_call.c - one call of a GraphReplay: whether it fits the recording,
 * the copies in, the launch (through the CUDA driver or a Python replay()),
 * and what it returns (copies, or aliases of the lending recording's
 * outputs while the caller holds none of the last ones); and the tensor
 * queries the recordings share. See graph.c for the design.
 */
#include "graph_call.h"

#include "graph_replay.h"

int
tt_graph_raise_cuda(TtCuResult rc, const char *what)
{
    const char *name, *text;

    tt_cuda_describe(rc, &name, &text);
    PyErr_Format(PyExc_RuntimeError, "GraphReplay: %s failed: %s (%d): %s", what,
                 name != NULL ? name : "CUDA error", rc, text != NULL ? text : "no description");
    return -1;
}

/* ------------------------------------------------------------ helpers */

PyObject *
tt_graph_call0(PyObject *obj, PyObject *method)
{
    PyObject *self = obj;

    return PyObject_VectorcallMethod(method, &self, 1 | PY_VECTORCALL_ARGUMENTS_OFFSET, NULL);
}

/* The int `value` (a new reference, consumed; NULL: the call that made it
 * failed) into *out. -1 on error. */
static int
tt_graph_take_u64(PyObject *value, unsigned long long *out)
{
    int rc = -1;

    if (value == NULL)
        goto cleanup;
    *out = PyLong_AsUnsignedLongLong(value);
    if (*out == (unsigned long long)-1 && PyErr_Occurred())
        goto cleanup;
    rc = 0;
cleanup:
    Py_XDECREF(value);
    return rc;
}

int
tt_graph_data_ptr(TtGraphReplay *self, PyObject *tensor, TtCuDevicePtr *ptr)
{
    return tt_graph_take_u64(tt_graph_call0(tensor, self->state->str_data_ptr), ptr);
}

int
tt_graph_is_dense(TtGraphReplay *self, PyObject *tensor)
{
    PyObject *value = tt_graph_call0(tensor, self->state->str_is_contiguous); /* new reference */
    int rc = -1;

    if (value == NULL)
        goto cleanup;
    rc = PyObject_IsTrue(value);
cleanup:
    Py_XDECREF(value);
    return rc;
}

int
tt_graph_nbytes(PyObject *tensor, size_t *nbytes)
{
    unsigned long long n;

    if (tt_graph_take_u64(PyObject_GetAttrString(tensor, "nbytes"), &n) < 0)
        return -1;
    *nbytes = (size_t)n;
    return 0;
}

PyObject *
tt_graph_storage_of(TtGraphReplay *self, PyObject *tensor)
{
    PyObject *storage = PyObject_CallOneArg(self->state->tensor_storage, tensor);

    if (storage != NULL && !PyObject_TypeCheck(storage, (PyTypeObject *)self->state->storage_type)) {
        PyErr_Format(PyExc_TypeError, "GraphReplay: a tensor's untyped_storage() gave a %.100s, "
                     "not a torch storage", Py_TYPE(storage)->tp_name);
        Py_CLEAR(storage);
    }
    return storage;
}

PyObject *
tt_graph_storage_address(TtGraphReplay *self, PyObject *storage)
{
    PyObject *get = self->state->storage_cdata; /* a getset descriptor of StorageBase */

    return Py_TYPE(get)->tp_descr_get(get, storage, self->state->storage_type);
}

int
tt_graph_span(TtGraphReplay *self, PyObject *tensor, size_t nbytes, TtCuDevicePtr *ptr,
              PyObject **memory)
{
    PyObject *storage = NULL; /* new reference */
    unsigned long long base, size;
    int rc = -1;

    *memory = NULL;
    if (tt_graph_data_ptr(self, tensor, ptr) < 0)
        goto cleanup;
    if ((storage = tt_graph_storage_of(self, tensor)) == NULL)
        goto cleanup;
    /* the storage's own memory, read through StorageBase: no subclass or
     * torch function can change these two */
    if (tt_graph_take_u64(PyObject_CallOneArg(self->state->storage_data_ptr, storage), &base) < 0 ||
        tt_graph_take_u64(PyObject_CallOneArg(self->state->storage_nbytes, storage), &size) < 0)
        goto cleanup;
    if (*ptr < base || nbytes > size || *ptr - base > size - nbytes) {
        PyErr_Format(PyExc_ValueError,
                     "GraphReplay: a tensor's data_ptr() %llu and %zu bytes from it do not lie "
                     "in its storage (at %llu, %llu bytes); give plain tensors", *ptr, nbytes,
                     base, size);
        goto cleanup;
    }
    *memory = storage;
    storage = NULL;
    rc = 0;
cleanup:
    Py_XDECREF(storage);
    return rc;
}

/* The argument an input slot reads from the call: borrowed, or NULL with
 * RuntimeError when the call does not have it (the signature matched it, so
 * it cannot happen). */
static PyObject *
tt_graph_input_arg(const TtGraphInput *in, PyObject *const *args, Py_ssize_t nargs,
                   PyObject *kwnames)
{
    PyObject *arg = NULL; /* borrowed */
    Py_ssize_t i, nkw;

    if (in->pos >= 0) {
        if (in->pos < nargs)
            arg = args[in->pos];
    }
    else {
        nkw = kwnames != NULL ? PyTuple_GET_SIZE(kwnames) : 0;
        for (i = 0; i < nkw && arg == NULL; i++)
            if (PyTuple_GET_ITEM(kwnames, i) == in->name)
                arg = args[nargs + i];
        /* names that are equal but not the same object: compare the text */
        for (i = 0; i < nkw && arg == NULL; i++)
            if (PyUnicode_Compare(PyTuple_GET_ITEM(kwnames, i), in->name) == 0)
                arg = args[nargs + i];
        if (PyErr_Occurred())
            PyErr_Clear();
    }
    if (arg != NULL && in->item >= 0) {
        if (PyTuple_Check(arg) && in->item < PyTuple_GET_SIZE(arg))
            arg = PyTuple_GET_ITEM(arg, in->item);
        else if (PyList_Check(arg) && in->item < PyList_GET_SIZE(arg))
            arg = PyList_GET_ITEM(arg, in->item);
        else
            arg = NULL;
    }
    if (TT_UNLIKELY(arg == NULL))
        PyErr_SetString(PyExc_RuntimeError,
                        "GraphReplay: an input the signature matched is missing");
    return arg;
}

/* Makes `stream` wait for the work the last call queued on another stream, so
 * the static buffers are never written while an earlier replay still reads
 * them. Costs nothing while the stream stays the same. -1 on error. */
static int
tt_graph_order_streams(TtGraphReplay *self, TtCuStream stream)
{
    TtCuResult rc;

    if (TT_LIKELY(!self->launched || stream == self->last_stream))
        return 0;
    if (self->event == NULL) {
        rc = tt_cuda.EventCreate(&self->event, TT_CU_EVENT_DISABLE_TIMING);
        if (rc != 0)
            return tt_graph_raise_cuda(rc, "cuEventCreate");
    }
    rc = tt_cuda.EventRecord(self->event, self->last_stream);
    if (rc != 0)
        return tt_graph_raise_cuda(rc, "cuEventRecord");
    rc = tt_cuda.StreamWaitEvent(stream, self->event, 0);
    if (rc != 0)
        return tt_graph_raise_cuda(rc, "cuStreamWaitEvent");
    return 0;
}

/* Makes the graph's context current if it is not; *pushed says whether to pop. */
static int
tt_graph_enter_context(TtGraphReplay *self, int *pushed)
{
    TtCuContext current = NULL;
    TtCuResult rc;

    *pushed = 0;
    rc = tt_cuda.CtxGetCurrent(&current);
    if (rc != 0)
        return tt_graph_raise_cuda(rc, "cuCtxGetCurrent");
    if (TT_LIKELY(current == self->ctx))
        return 0;
    rc = tt_cuda.CtxPushCurrent(self->ctx);
    if (rc != 0)
        return tt_graph_raise_cuda(rc, "cuCtxPushCurrent");
    *pushed = 1;
    return 0;
}

static void
tt_graph_leave_context(int pushed)
{
    TtCuContext popped = NULL;

    if (pushed)
        (void)tt_cuda.CtxPopCurrent(&popped);
}

/* Builds the result from a list of leaves (copies and plain values). New reference. */
static PyObject *
tt_graph_pack(TtGraphReplay *self, PyObject *copies)
{
    PyObject *result = NULL;

    switch (self->out_kind) {
    case TT_OUT_TENSOR:
        result = PyList_GET_ITEM(copies, 0);
        Py_INCREF(result);
        break;
    case TT_OUT_TUPLE:
        result = PyList_AsTuple(copies);
        break;
    case TT_OUT_LIST:
        result = copies;
        Py_INCREF(result);
        break;
    default:
        result = PyObject_CallOneArg(self->rebuild, copies);
        break;
    }
    return result;
}

/* ----------------------------------------------------------- the call */

int
tt_graph_uses(TtGraphReplay *self, const TtGraphLeaf *leaf, unsigned long long *uses)
{
    PyObject *address = tt_graph_storage_address(self, leaf->storage); /* new reference */
    int rc = -1;

    if (address == NULL)
        goto cleanup;
    rc = tt_graph_take_u64(PyObject_CallOneArg(self->state->storage_use_count, address), uses);
cleanup:
    Py_XDECREF(address);
    return rc;
}

/* 1 when nothing the last lending call returned from `rec` is alive (every
 * lent storage is back at the use count this object accounts for), 0 when
 * the caller still holds some of it, -1 on error. */
static int
tt_graph_rec_free(TtGraphReplay *self, const TtGraphRec *rec)
{
    unsigned long long uses;
    Py_ssize_t i;

    for (i = 0; i < self->nleaves; i++) {
        const TtGraphLeaf *leaf = &rec->leaves[i];

        if (leaf->storage == NULL)
            continue;
        if (tt_graph_uses(self, leaf, &uses) < 0)
            return -1;
        if (uses != leaf->uses)
            return 0;
    }
    return 1;
}

/* What a call returns from `rec`, leaf by leaf: plain values as they are,
 * aliases of lent outputs, and for copied outputs either a fresh tensor whose
 * address goes in dst[i] and whose storage in memory[i] (a new reference:
 * it keeps that memory alive until the copy is queued) (driver mode,
 * contiguous) or the static output as a placeholder that tt_graph_clone_rest
 * replaces. New reference, or NULL. */
static PyObject *
tt_graph_results(TtGraphReplay *self, const TtGraphRec *rec, TtCuDevicePtr *dst,
                 PyObject **memory)
{
    PyObject *results = PyList_New(self->nleaves);
    Py_ssize_t i;

    if (results == NULL)
        return NULL;
    for (i = 0; i < self->nleaves; i++) {
        const TtGraphLeaf *leaf = &rec->leaves[i];
        PyObject *item;

        if (leaf->storage != NULL)
            item = tt_graph_call0(leaf->value, self->state->str_detach);
        else if (dst != NULL && leaf->is_tensor && leaf->dense)
            item = PyObject_CallOneArg(self->state->empty_like, leaf->value);
        else {
            item = leaf->value;
            Py_INCREF(item);
        }
        if (item == NULL)
            goto error;
        PyList_SET_ITEM(results, i, item);
        if (dst != NULL && leaf->storage == NULL && leaf->is_tensor && leaf->dense &&
            tt_graph_span(self, item, leaf->nbytes, &dst[i], &memory[i]) < 0)
            goto error;
    }
    return results;
error:
    Py_DECREF(results);
    return NULL;
}

/* Replaces each placeholder tt_graph_results left with a clone of the static
 * output, queued after the launch (copied outputs that are strided, or all
 * copied outputs in callable mode). -1 on error. */
static int
tt_graph_clone_rest(TtGraphReplay *self, const TtGraphRec *rec, PyObject *results)
{
    Py_ssize_t i;

    for (i = 0; i < self->nleaves; i++) {
        const TtGraphLeaf *leaf = &rec->leaves[i];
        PyObject *copy, *old;

        if (!leaf->is_tensor || leaf->storage != NULL || (self->driver && leaf->dense))
            continue;
        copy = tt_graph_call0(leaf->value, self->state->str_clone);
        if (copy == NULL)
            return -1;
        old = PyList_GET_ITEM(results, i);
        PyList_SET_ITEM(results, i, copy);
        Py_DECREF(old);
    }
    return 0;
}

/* Where each input of a call is copied from (src[i], 0 to skip: the argument
 * is the static input itself, or a strided view already copied in by torch's
 * copy_), holding each argument and its storage in held[2 i], held[2 i + 1]
 * until the copies are queued. Runs Python, so never inside a pushed context.
 * -1 on error. */
static int
tt_graph_read_inputs(TtGraphReplay *self, PyObject *const *args, Py_ssize_t nargs,
                     PyObject *kwnames, TtCuDevicePtr *src, PyObject **held)
{
    Py_ssize_t i;
    int rc = -1;

    for (i = 0; i < self->ninputs; i++) {
        TtGraphInput *in = &self->inputs[i];
        PyObject *arg = tt_graph_input_arg(in, args, nargs, kwnames); /* borrowed */
        PyObject *done;
        int dense;

        if (TT_UNLIKELY(arg == NULL))
            goto cleanup;
        if (arg == in->buffer)
            continue;
        /* an item of a list argument: Python code below may take it out of
         * the list, and its memory must stay until the copy is queued */
        held[2 * i] = Py_NewRef(arg);
        dense = tt_graph_is_dense(self, arg);
        if (dense < 0)
            goto cleanup;
        if (TT_LIKELY(dense)) {
            /* the copy reads nbytes from there: they must be the argument's */
            if (tt_graph_span(self, arg, self->inputs[i].nbytes, &src[i], &held[2 * i + 1]) < 0)
                goto cleanup;
            continue;
        }
        /* a strided view: torch's copy_ lays it out, on the same stream */
        done = PyObject_CallMethodOneArg(in->buffer, self->state->str_copy_, arg);
        if (done == NULL)
            goto cleanup;
        Py_DECREF(done);
    }
    rc = 0;
cleanup:
    return rc;
}

/* Queues on `stream`, inside the graph's context, the copies of the inputs
 * (from src) into the static inputs and the launch of `rec`. -1 on error. */
static int
tt_graph_launch_copies(TtGraphReplay *self, const TtGraphRec *rec, const TtCuDevicePtr *src,
                       TtCuStream stream)
{
    TtCuResult cu;
    Py_ssize_t i;
    int pushed = 0, rc = -1;

    if (tt_graph_enter_context(self, &pushed) < 0)
        goto cleanup; /* nothing pushed */
    for (i = 0; i < self->ninputs; i++) {
        if (src[i] == 0 || src[i] == self->inputs[i].dst || self->inputs[i].nbytes == 0)
            continue;
        cu = tt_cuda.MemcpyDtoDAsync(self->inputs[i].dst, src[i], self->inputs[i].nbytes, stream);
        if (cu != 0) {
            tt_graph_raise_cuda(cu, "cuMemcpyDtoDAsync (input)");
            goto cleanup;
        }
    }
    cu = tt_cuda.GraphLaunch(rec->exec, stream);
    if (cu != 0) {
        tt_graph_raise_cuda(cu, "cuGraphLaunch");
        goto cleanup;
    }
    self->last_stream = stream;
    self->launched = 1;
    rc = 0;
cleanup:
    tt_graph_leave_context(pushed);
    return rc;
}

/* Queues on `stream` the copies of the static outputs of `rec` into the
 * outputs made for them (dst, 0 for none), entering the graph's context only
 * when there is one. -1 on error. */
static int
tt_graph_copy_out(TtGraphReplay *self, const TtGraphRec *rec, const TtCuDevicePtr *dst,
                  TtCuStream stream)
{
    TtCuResult cu;
    Py_ssize_t i;
    int pushed = 0, entered = 0, rc = -1;

    for (i = 0; i < self->nleaves; i++) {
        if (dst[i] == 0 || rec->leaves[i].nbytes == 0)
            continue;
        if (!entered) {
            if (tt_graph_enter_context(self, &pushed) < 0)
                goto cleanup;
            entered = 1;
        }
        cu = tt_cuda.MemcpyDtoDAsync(dst[i], rec->leaves[i].src, rec->leaves[i].nbytes, stream);
        if (cu != 0) {
            tt_graph_raise_cuda(cu, "cuMemcpyDtoDAsync (output)");
            goto cleanup;
        }
    }
    rc = 0;
cleanup:
    if (entered)
        tt_graph_leave_context(pushed);
    return rc;
}

/* One replay of `rec` through the driver. New reference, or NULL. */
static PyObject *
tt_graph_run_driver(TtGraphReplay *self, const TtGraphRec *rec, PyObject *const *args,
                    Py_ssize_t nargs, PyObject *kwnames)
{
    PyObject *stream_obj = NULL; /* new reference */
    PyObject *results = NULL;    /* new reference: list of what the call returns */
    PyObject *result = NULL;
    TtCuStream stream;
    PyObject **held = NULL;      /* per input: the argument and its storage (new references)
                                  * until the copies are queued; then per leaf the storage of
                                  * its copy */
    TtCuDevicePtr *src = NULL;   /* per input: where to copy from, 0 to skip */
    TtCuDevicePtr *dst = NULL;   /* per leaf: where its copy goes, 0 for none */
    Py_ssize_t nheld = 2 * self->ninputs + self->nleaves;
    TtCuResult rc;
    Py_ssize_t i;
    int pushed = 0;

    stream_obj = PyObject_CallOneArg(self->state->cuda_raw_stream, self->device);
    if (stream_obj == NULL)
        goto cleanup;
    stream = (TtCuStream)PyLong_AsVoidPtr(stream_obj);
    if (stream == NULL && PyErr_Occurred())
        goto cleanup;
    src = PyMem_Calloc((size_t)self->ninputs + 1, sizeof(*src));
    held = PyMem_Calloc((size_t)nheld + 1, sizeof(*held));
    dst = PyMem_Calloc((size_t)self->nleaves + 1, sizeof(*dst));
    if (src == NULL || held == NULL || dst == NULL) {
        PyErr_NoMemory();
        goto cleanup;
    }
    if (TT_UNLIKELY(self->launched && stream != self->last_stream)) {
        if (tt_graph_enter_context(self, &pushed) < 0)
            goto cleanup;
        rc = tt_graph_order_streams(self, stream);
        tt_graph_leave_context(pushed);
        if (rc != 0)
            goto cleanup;
    }
    /* Python calls (pointers, torch copies for strided inputs, allocations)
     * never run inside a pushed context: torch may change the current context
     * under it. */
    if (tt_graph_read_inputs(self, args, nargs, kwnames, src, held) < 0)
        goto cleanup;
    /* the launch first; what is returned is made while the device runs */
    if (tt_graph_launch_copies(self, rec, src, stream) < 0)
        goto cleanup;
    if ((results = tt_graph_results(self, rec, dst, held + 2 * self->ninputs)) == NULL)
        goto cleanup;
    if (tt_graph_copy_out(self, rec, dst, stream) < 0)
        goto cleanup;
    if (tt_graph_clone_rest(self, rec, results) < 0)
        goto cleanup;
    result = tt_graph_pack(self, results);
cleanup:
    for (i = 0; held != NULL && i < nheld; i++)
        Py_XDECREF(held[i]);
    PyMem_Free(held);
    PyMem_Free(src);
    PyMem_Free(dst);
    Py_XDECREF(stream_obj);
    Py_XDECREF(results);
    return result;
}

/* One replay of `rec` through a Python replay(): torch's copy_ in, clone out. */
static PyObject *
tt_graph_run_callable(TtGraphReplay *self, const TtGraphRec *rec, PyObject *const *args,
                      Py_ssize_t nargs, PyObject *kwnames)
{
    PyObject *results = NULL; /* new reference */
    PyObject *done = NULL;    /* new reference */
    PyObject *result = NULL;
    Py_ssize_t i;

    for (i = 0; i < self->ninputs; i++) {
        TtGraphInput *in = &self->inputs[i];
        PyObject *arg = tt_graph_input_arg(in, args, nargs, kwnames); /* borrowed */

        if (TT_UNLIKELY(arg == NULL))
            goto cleanup;
        if (arg == in->buffer)
            continue;
        Py_INCREF(arg); /* held across copy_, which may run Python code */
        done = PyObject_CallMethodOneArg(in->buffer, self->state->str_copy_, arg);
        Py_DECREF(arg);
        if (done == NULL)
            goto cleanup;
        Py_CLEAR(done);
    }
    if ((results = tt_graph_results(self, rec, NULL, NULL)) == NULL)
        goto cleanup;
    if ((done = PyObject_CallNoArgs(rec->replay)) == NULL)
        goto cleanup;
    if (tt_graph_clone_rest(self, rec, results) < 0)
        goto cleanup;
    result = tt_graph_pack(self, results);
cleanup:
    Py_XDECREF(done);
    Py_XDECREF(results);
    return result;
}

/* Calls on_fallback once and forgets it. -1 when it raised a BaseException
 * that is not an Exception; an Exception is reported as unraisable. */
static int
tt_graph_notify(TtGraphReplay *self)
{
    PyObject *notify = self->on_fallback; /* the reference moves here */
    PyObject *done;                       /* new reference */
    int rc = 0;

    self->on_fallback = NULL;
    done = PyObject_CallNoArgs(notify);
    if (done == NULL) {
        if (PyErr_ExceptionMatches(PyExc_Exception))
            PyErr_WriteUnraisable(notify);
        else
            rc = -1;
    }
    Py_XDECREF(done);
    Py_DECREF(notify);
    return rc;
}

PyObject *
tt_graph_vectorcall(PyObject *callable, PyObject *const *args, size_t nargsf,
                    PyObject *kwnames)
{
    TtGraphReplay *self = (TtGraphReplay *)callable;
    Py_ssize_t nargs = PyVectorcall_NARGS(nargsf);
    const TtGraphRec *rec;
    PyObject *original; /* new reference: held across a fallback call */
    PyObject *result = NULL;
    int fits = 0, lend = 0;

    /* busy: a torch call inside a replay let another thread in; that call
     * must not touch the static buffers, so it runs the original. Taken
     * before the match, which can run Python (a plain value's __eq__) and so
     * let another thread in between a test and a set */
    if (TT_LIKELY(!self->busy && self->signature != NULL)) {
        self->busy = 1;
        fits = tt_signature_fits(self->signature, args, nargs, kwnames);
        if (TT_UNLIKELY(fits <= 0))
            self->busy = 0;
        if (TT_UNLIKELY(fits < 0))
            goto cleanup;
    }
    if (TT_UNLIKELY(!fits)) {
        self->fallbacks++;
        if (TT_UNLIKELY(self->on_fallback != NULL) && tt_graph_notify(self) < 0)
            goto cleanup;
        if (self->original == NULL) {
            PyErr_SetString(PyExc_RuntimeError, "GraphReplay has been cleared");
            goto cleanup;
        }
        /* an original that leads back here is a RecursionError, not a stack overflow */
        if (TT_UNLIKELY(Py_EnterRecursiveCall(" in a GraphReplay's fallback")))
            goto cleanup;
        original = Py_NewRef(self->original);
        result = PyObject_Vectorcall(original, args, nargsf, kwnames);
        Py_DECREF(original);
        Py_LeaveRecursiveCall();
        goto cleanup;
    }
    /* a reference held across the call: a callback may clear this object */
    Py_INCREF(self);
    if (self->recs[TT_REC_LEND].lends)
        lend = tt_graph_rec_free(self, &self->recs[TT_REC_LEND]);
    if (lend >= 0) {
        rec = &self->recs[lend ? TT_REC_LEND : TT_REC_COPY];
        result = self->driver ? tt_graph_run_driver(self, rec, args, nargs, kwnames)
                              : tt_graph_run_callable(self, rec, args, nargs, kwnames);
    }
    if (result != NULL) {
        self->replays++;
        self->lent += lend > 0;
    }
    self->busy = 0;
    Py_DECREF(self);
cleanup:
    return result;
}

/* -------------------------------------- the launch alone (graph_call.h) */

int
tt_graph_launch_begin(PyObject *replay, TtCuStream *stream)
{
    TtGraphReplay *self = (TtGraphReplay *)replay;
    PyObject *stream_obj = NULL; /* new reference */
    int rc = -1, pushed = 0;

    *stream = NULL;
    if (TT_UNLIKELY(self->signature == NULL)) {
        PyErr_SetString(PyExc_RuntimeError, "GraphReplay has been cleared");
        goto cleanup;
    }
    if (!self->driver) {
        rc = 0;
        goto cleanup;
    }
    stream_obj = PyObject_CallOneArg(self->state->cuda_raw_stream, self->device);
    if (stream_obj == NULL)
        goto cleanup;
    *stream = (TtCuStream)PyLong_AsVoidPtr(stream_obj);
    if (*stream == NULL && PyErr_Occurred())
        goto cleanup;
    if (TT_UNLIKELY(self->launched && *stream != self->last_stream)) {
        if (tt_graph_enter_context(self, &pushed) < 0)
            goto cleanup;
        rc = tt_graph_order_streams(self, *stream);
        tt_graph_leave_context(pushed);
        if (rc != 0) {
            rc = -1;
            goto cleanup;
        }
    }
    rc = 0;
cleanup:
    Py_XDECREF(stream_obj);
    return rc;
}

int
tt_graph_launch(PyObject *replay, TtCuStream stream)
{
    TtGraphReplay *self = (TtGraphReplay *)replay;
    const TtGraphRec *rec = &self->recs[TT_REC_COPY];
    PyObject *done; /* new reference */
    TtCuResult cu;
    int rc = -1, pushed = 0;

    if (TT_UNLIKELY(self->signature == NULL || (rec->exec == NULL && rec->replay == NULL))) {
        PyErr_SetString(PyExc_RuntimeError, "GraphReplay has been cleared");
        goto cleanup;
    }
    if (!self->driver) {
        done = PyObject_CallNoArgs(rec->replay);
        if (done == NULL)
            goto cleanup;
        Py_DECREF(done);
    }
    else {
        if (tt_graph_enter_context(self, &pushed) < 0)
            goto cleanup;
        cu = tt_cuda.GraphLaunch(rec->exec, stream);
        tt_graph_leave_context(pushed);
        if (cu != 0) {
            tt_graph_raise_cuda(cu, "cuGraphLaunch");
            goto cleanup;
        }
        self->last_stream = stream;
        self->launched = 1;
    }
    self->replays++;
    rc = 0;
cleanup:
    return rc;
}
