/*
 * graph.c - the replay path of the device-graph backend: GraphReplay.
 *
 * A GraphReplay holds one recorded device graph and the static tensors it
 * reads and writes. A call checks that its arguments fit the recording (the
 * dispatcher's Signature), copies each input tensor into its static buffer,
 * launches the graph on the current stream and returns copies of the static
 * outputs; a call that does not fit runs the original module instead.
 *
 * Two ways to launch:
 * - driver: the CUDA driver through cuda.c's shim. Copies are
 *   cuMemcpyDtoDAsync and the launch cuGraphLaunch, both on torch's current
 *   stream of the graph's device.
 * - callable: a Python replay() (an XPU graph, or a torch without the raw exec
 *   handle); copies and output copies are then torch's copy_ and clone.
 *
 * How outputs come back. A GraphReplay holds one or two recordings of the
 * same call, reading the same static inputs:
 * - the copying recording: its static outputs never leave this object; a call
 *   returns fresh copies of them, made on the current stream after the launch.
 * - the lending recording (optional): a call returns aliases of its static
 *   outputs (no copy), but only while nothing of what the last lending call
 *   returned is still alive. Aliveness is the storage's use count (torch's
 *   own counter, which every tensor and view of that memory raises), compared
 *   with the count this object alone accounts for. When the caller still
 *   holds any of it, the call replays the copying recording instead.
 * So no later call ever overwrites a tensor the caller holds.
 */
#include "graph.h"

#include "cuda.h"
#include "signature.h"

#include <string.h>

/* Sets RuntimeError for a failed driver call; returns -1. */
static int
tt_cuda_raise(TtCuResult rc, const char *what)
{
    const char *name, *text;

    tt_cuda_describe(rc, &name, &text);
    PyErr_Format(PyExc_RuntimeError, "GraphReplay: %s failed: %s (%d): %s", what,
                 name != NULL ? name : "CUDA error", rc, text != NULL ? text : "no description");
    return -1;
}

/* ========================================================= GraphReplay */

typedef struct TtGraphInput {
    Py_ssize_t pos;       /* positional index, or -1 for a keyword argument */
    PyObject *name;       /* keyword: the interned name; else NULL */
    Py_ssize_t item;      /* index in a tuple/list argument, or -1 */
    PyObject *buffer;     /* the static tensor */
    TtCuDevicePtr dst;    /* its data_ptr() */
    size_t nbytes;
} TtGraphInput;

typedef struct TtGraphLeaf {
    PyObject *value;      /* a static output tensor, or a plain value returned as is */
    PyObject *storage;    /* lent: its storage object, held so the count below stays known */
    PyObject *cdata;      /* lent: the storage's address, for torch._C._storage_Use_Count */
    unsigned long long uses; /* lent: the storage's use count while no alias of it is out */
    int is_tensor;
    int dense;            /* contiguous: copied byte for byte */
    TtCuDevicePtr src;
    size_t nbytes;
} TtGraphLeaf;

/* One recording of the call: the graph and the static outputs it writes. */
typedef struct TtGraphRec {
    TtCuGraphExec exec;   /* driver mode */
    PyObject *replay;     /* callable mode: called to launch */
    PyObject *outputs;    /* as given: a tensor, a tuple, or a list */
    TtGraphLeaf *leaves;  /* nleaves of them */
    int lends;            /* some leaf is lent (cdata set): the recording is in use */
} TtGraphRec;

enum { TT_REC_COPY = 0, TT_REC_LEND = 1, TT_RECS = 2 };

enum { TT_OUT_TENSOR = 0, TT_OUT_TUPLE = 1, TT_OUT_LIST = 2, TT_OUT_REBUILD = 3 };

typedef struct {
    PyObject_HEAD
    vectorcallfunc vectorcall;
    TtState *state;
    PyObject *signature;   /* a Signature */
    PyObject *original;    /* called for inputs that do not fit */
    PyObject *on_fallback; /* NULL, or called once at the first fallback after it was set */
    PyObject *rebuild;     /* NULL, or called with the list of output copies */
    PyObject *keep;        /* kept alive with the graph (the graph object, its pool) */
    PyObject *device;      /* driver mode: the device index as an int */
    Py_ssize_t ninputs;
    TtGraphInput *inputs;
    Py_ssize_t nleaves;    /* per recording: the same call has the same outputs */
    TtGraphRec recs[TT_RECS];
    int out_kind;
    int driver;            /* launches through the CUDA driver */
    int busy;              /* a call is in progress: another one falls back */
    TtCuDevice cu_device;
    TtCuContext ctx;       /* the device's primary context, retained */
    TtCuStream last_stream;
    int launched;          /* last_stream is meaningful */
    TtCuEvent event;       /* created the first time the stream changes */
    unsigned long long replays;
    unsigned long long lent;
    unsigned long long fallbacks;
} TtGraphReplay;

/* ------------------------------------------------------------ helpers */

/* `obj.method()` as a new reference, or NULL. */
static PyObject *
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

/* obj.data_ptr() into *ptr. -1 on error. */
static int
tt_graph_data_ptr(TtGraphReplay *self, PyObject *tensor, TtCuDevicePtr *ptr)
{
    return tt_graph_take_u64(tt_graph_call0(tensor, self->state->str_data_ptr), ptr);
}

/* 1 when tensor.is_contiguous(), 0 when not, -1 on error. */
static int
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

/* tensor.nbytes into *nbytes. -1 on error. */
static int
tt_graph_nbytes(PyObject *tensor, size_t *nbytes)
{
    unsigned long long n;

    if (tt_graph_take_u64(PyObject_GetAttrString(tensor, "nbytes"), &n) < 0)
        return -1;
    *nbytes = (size_t)n;
    return 0;
}

/* The argument an input slot reads from the call: borrowed, or NULL without
 * an exception when the call does not have it (then it does not fit). */
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
            return tt_cuda_raise(rc, "cuEventCreate");
    }
    rc = tt_cuda.EventRecord(self->event, self->last_stream);
    if (rc != 0)
        return tt_cuda_raise(rc, "cuEventRecord");
    rc = tt_cuda.StreamWaitEvent(stream, self->event, 0);
    if (rc != 0)
        return tt_cuda_raise(rc, "cuStreamWaitEvent");
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
        return tt_cuda_raise(rc, "cuCtxGetCurrent");
    if (TT_LIKELY(current == self->ctx))
        return 0;
    rc = tt_cuda.CtxPushCurrent(self->ctx);
    if (rc != 0)
        return tt_cuda_raise(rc, "cuCtxPushCurrent");
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

/* The use count of a lent leaf's storage, into *uses. -1 on error. */
static int
tt_graph_uses(TtGraphReplay *self, const TtGraphLeaf *leaf, unsigned long long *uses)
{
    return tt_graph_take_u64(PyObject_CallOneArg(self->state->storage_use_count, leaf->cdata), uses);
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

        if (leaf->cdata == NULL)
            continue;
        if (tt_graph_uses(self, leaf, &uses) < 0)
            return -1;
        if (uses != leaf->uses)
            return 0;
    }
    return 1;
}

/* What a call returns from `rec`, leaf by leaf: plain values as they are, aliases of lent outputs, and for copied outputs either
 * a fresh tensor whose address goes in dst[i] (driver mode, contiguous) or
 * the static output as a placeholder that tt_graph_clone_rest replaces.
 * New reference, or NULL. */
static PyObject *
tt_graph_results(TtGraphReplay *self, const TtGraphRec *rec, TtCuDevicePtr *dst)
{
    PyObject *results = PyList_New(self->nleaves);
    Py_ssize_t i;

    if (results == NULL)
        return NULL;
    for (i = 0; i < self->nleaves; i++) {
        const TtGraphLeaf *leaf = &rec->leaves[i];
        PyObject *item;

        if (leaf->cdata != NULL)
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
        if (dst != NULL && leaf->cdata == NULL && leaf->is_tensor && leaf->dense &&
            tt_graph_data_ptr(self, item, &dst[i]) < 0)
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

        if (!leaf->is_tensor || leaf->cdata != NULL || (self->driver && leaf->dense))
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

/* One replay of `rec` through the driver. New reference, or NULL. */
static PyObject *
tt_graph_run_driver(TtGraphReplay *self, const TtGraphRec *rec, PyObject *const *args,
                    Py_ssize_t nargs, PyObject *kwnames)
{
    PyObject *stream_obj = NULL; /* new reference */
    PyObject *results = NULL;    /* new reference: list of what the call returns */
    PyObject *result = NULL;
    TtCuStream stream;
    PyObject **held = NULL;      /* per input: the argument (new reference) until the launch */
    TtCuDevicePtr *src = NULL;   /* per input: where to copy from, 0 to skip */
    TtCuDevicePtr *dst = NULL;   /* per leaf: where its copy goes, 0 for none */
    TtCuResult rc;
    Py_ssize_t i;
    int pushed = 0, entered = 0;

    stream_obj = PyObject_CallOneArg(self->state->cuda_raw_stream, self->device);
    if (stream_obj == NULL)
        goto cleanup;
    stream = (TtCuStream)PyLong_AsVoidPtr(stream_obj);
    if (stream == NULL && PyErr_Occurred())
        goto cleanup;
    src = PyMem_Calloc((size_t)self->ninputs + 1, sizeof(*src));
    held = PyMem_Calloc((size_t)self->ninputs + 1, sizeof(*held));
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
        pushed = 0;
        if (rc != 0)
            goto cleanup;
    }
    /* Python calls (pointers, torch copies for strided inputs, allocations)
     * never run inside a pushed context: torch may change the current context
     * under it. */
    for (i = 0; i < self->ninputs; i++) {
        TtGraphInput *in = &self->inputs[i];
        PyObject *arg = tt_graph_input_arg(in, args, nargs, kwnames); /* borrowed */
        PyObject *done;
        int dense;

        if (TT_UNLIKELY(arg == NULL)) {
            PyErr_SetString(PyExc_RuntimeError,
                            "GraphReplay: an input the signature matched is missing");
            goto cleanup;
        }
        if (arg == in->buffer)
            continue;
        /* an item of a list argument: Python code below may take it out of
         * the list, and its memory must stay until the copy is queued */
        held[i] = Py_NewRef(arg);
        dense = tt_graph_is_dense(self, arg);
        if (dense < 0)
            goto cleanup;
        if (TT_LIKELY(dense)) {
            if (tt_graph_data_ptr(self, arg, &src[i]) < 0)
                goto cleanup;
            continue;
        }
        /* a strided view: torch's copy_ lays it out, on the same stream */
        done = PyObject_CallMethodOneArg(in->buffer, self->state->str_copy_, arg);
        if (done == NULL)
            goto cleanup;
        Py_DECREF(done);
    }
    /* the launch first; what is returned is made while the device runs */
    if (tt_graph_enter_context(self, &pushed) < 0)
        goto cleanup;
    entered = 1;
    for (i = 0; i < self->ninputs; i++) {
        if (src[i] == 0 || src[i] == self->inputs[i].dst || self->inputs[i].nbytes == 0)
            continue;
        rc = tt_cuda.MemcpyDtoDAsync(self->inputs[i].dst, src[i], self->inputs[i].nbytes, stream);
        if (rc != 0) {
            tt_cuda_raise(rc, "cuMemcpyDtoDAsync (input)");
            goto cleanup;
        }
    }
    rc = tt_cuda.GraphLaunch(rec->exec, stream);
    if (rc != 0) {
        tt_cuda_raise(rc, "cuGraphLaunch");
        goto cleanup;
    }
    self->last_stream = stream;
    self->launched = 1;
    tt_graph_leave_context(pushed);
    entered = 0;
    if ((results = tt_graph_results(self, rec, dst)) == NULL)
        goto cleanup;
    for (i = 0; i < self->nleaves; i++) {
        if (dst[i] == 0 || rec->leaves[i].nbytes == 0)
            continue;
        if (!entered) {
            if (tt_graph_enter_context(self, &pushed) < 0)
                goto cleanup;
            entered = 1;
        }
        rc = tt_cuda.MemcpyDtoDAsync(dst[i], rec->leaves[i].src, rec->leaves[i].nbytes, stream);
        if (rc != 0) {
            tt_cuda_raise(rc, "cuMemcpyDtoDAsync (output)");
            goto cleanup;
        }
    }
    if (entered) {
        tt_graph_leave_context(pushed);
        entered = 0;
    }
    if (tt_graph_clone_rest(self, rec, results) < 0)
        goto cleanup;
    result = tt_graph_pack(self, results);
cleanup:
    if (entered)
        tt_graph_leave_context(pushed);
    for (i = 0; held != NULL && i < self->ninputs; i++)
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

        if (TT_UNLIKELY(arg == NULL)) {
            PyErr_SetString(PyExc_RuntimeError,
                            "GraphReplay: an input the signature matched is missing");
            goto cleanup;
        }
        if (arg == in->buffer)
            continue;
        Py_INCREF(arg); /* held across copy_, which may run Python code */
        done = PyObject_CallMethodOneArg(in->buffer, self->state->str_copy_, arg);
        Py_DECREF(arg);
        if (done == NULL)
            goto cleanup;
        Py_CLEAR(done);
    }
    if ((results = tt_graph_results(self, rec, NULL)) == NULL)
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

static PyObject *
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
     * must not touch the static buffers, so it runs the original */
    if (TT_LIKELY(!self->busy && self->signature != NULL)) {
        fits = tt_signature_fits(self->signature, args, nargs, kwnames);
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
        original = Py_NewRef(self->original);
        result = PyObject_Vectorcall(original, args, nargsf, kwnames);
        Py_DECREF(original);
        goto cleanup;
    }
    self->busy = 1;
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

/* ------------------------------------------------------- construction */

/* Fills self->inputs from a sequence of (position or keyword name, item or -1,
 * static tensor). -1 on error. */
static int
tt_graph_set_inputs(TtGraphReplay *self, PyObject *inputs)
{
    PyObject *seq = NULL; /* new reference */
    Py_ssize_t i, n;
    int rc = -1;

    /* a tuple of our own: __index__ and data_ptr() may run Python code */
    seq = tt_sequence_tuple(inputs, "GraphReplay: inputs must be a sequence");
    if (seq == NULL)
        goto cleanup;
    n = PySequence_Fast_GET_SIZE(seq);
    self->inputs = PyMem_Calloc((size_t)n + 1, sizeof(TtGraphInput));
    if (self->inputs == NULL) {
        PyErr_NoMemory();
        goto cleanup;
    }
    for (i = 0; i < n; i++) {
        PyObject *slot = PySequence_Fast_GET_ITEM(seq, i); /* borrowed */
        TtGraphInput *in = &self->inputs[i];
        PyObject *key, *buffer; /* borrowed */

        if (!PyTuple_Check(slot) || PyTuple_GET_SIZE(slot) != 3) {
            PyErr_Format(PyExc_TypeError,
                         "GraphReplay: input %zd must be a (position or name, item, tensor) tuple",
                         i);
            goto cleanup;
        }
        key = PyTuple_GET_ITEM(slot, 0);
        buffer = PyTuple_GET_ITEM(slot, 2);
        self->ninputs = i + 1;
        in->pos = -1;
        if (PyUnicode_Check(key)) {
            Py_INCREF(key);
            PyUnicode_InternInPlace(&key);
            in->name = key;
        }
        else {
            in->pos = PyNumber_AsSsize_t(key, PyExc_OverflowError);
            if (in->pos == -1 && PyErr_Occurred())
                goto cleanup;
            if (in->pos < 0) {
                PyErr_Format(PyExc_ValueError, "GraphReplay: input %zd has a negative position", i);
                goto cleanup;
            }
        }
        in->item = PyNumber_AsSsize_t(PyTuple_GET_ITEM(slot, 1), PyExc_OverflowError);
        if (in->item == -1 && PyErr_Occurred())
            goto cleanup;
        if (!PyObject_TypeCheck(buffer, self->state->tensor_type)) {
            PyErr_Format(PyExc_TypeError, "GraphReplay: input %zd's buffer must be a tensor", i);
            goto cleanup;
        }
        Py_INCREF(buffer);
        in->buffer = buffer;
        if (self->driver) {
            int dense = tt_graph_is_dense(self, buffer);

            if (dense < 0)
                goto cleanup;
            if (!dense) {
                PyErr_Format(PyExc_ValueError,
                             "GraphReplay: input %zd's static buffer must be contiguous", i);
                goto cleanup;
            }
            if (tt_graph_data_ptr(self, buffer, &in->dst) < 0 ||
                tt_graph_nbytes(buffer, &in->nbytes) < 0)
                goto cleanup;
        }
    }
    rc = 0;
cleanup:
    Py_XDECREF(seq);
    return rc;
}

/* Fills rec->leaves from the outputs: a tensor, or a tuple or list of tensors
 * and plain values (with rebuild: a list). The first recording sets
 * self->out_kind and self->nleaves; a second must match them. -1 on error. */
static int
tt_graph_set_outputs(TtGraphReplay *self, TtGraphRec *rec, PyObject *outputs, PyObject *rebuild)
{
    PyTypeObject *tensor_type = self->state->tensor_type;
    Py_ssize_t i, n;
    int kind;

    if (rebuild != NULL) {
        if (!PyList_CheckExact(outputs)) {
            PyErr_SetString(PyExc_TypeError, "GraphReplay: with rebuild, outputs must be a list");
            return -1;
        }
        kind = TT_OUT_REBUILD;
    }
    else if (PyObject_TypeCheck(outputs, tensor_type)) {
        kind = TT_OUT_TENSOR;
    }
    else if (PyTuple_CheckExact(outputs)) {
        kind = TT_OUT_TUPLE;
    }
    else if (PyList_CheckExact(outputs)) {
        kind = TT_OUT_LIST;
    }
    else {
        PyErr_Format(PyExc_TypeError,
                     "GraphReplay: outputs must be a tensor, a tuple or a list (or a list with "
                     "rebuild), not %.100s", Py_TYPE(outputs)->tp_name);
        return -1;
    }
    if (kind != TT_OUT_TENSOR) {
        /* a private copy: the caller's list may change later */
        outputs = kind == TT_OUT_TUPLE ? PySequence_List(outputs)
                                       : PyList_GetSlice(outputs, 0, PY_SSIZE_T_MAX);
        if (outputs == NULL)
            return -1;
    }
    else {
        Py_INCREF(outputs);
    }
    rec->outputs = outputs;
    n = kind == TT_OUT_TENSOR ? 1 : PyList_GET_SIZE(outputs);
    if (rec != &self->recs[0] && (kind != self->out_kind || n != self->nleaves)) {
        PyErr_SetString(PyExc_ValueError,
                        "GraphReplay: the lending recording's outputs must have the same "
                        "structure as the first recording's");
        return -1;
    }
    self->out_kind = kind;
    self->nleaves = n;
    rec->leaves = PyMem_Calloc((size_t)n + 1, sizeof(TtGraphLeaf));
    if (rec->leaves == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    for (i = 0; i < n; i++) {
        TtGraphLeaf *leaf = &rec->leaves[i];
        PyObject *value = kind == TT_OUT_TENSOR ? outputs : PyList_GET_ITEM(outputs, i);

        Py_INCREF(value);
        leaf->value = value;
        leaf->is_tensor = PyObject_TypeCheck(value, tensor_type);
        if (!leaf->is_tensor || !self->driver)
            continue;
        leaf->dense = tt_graph_is_dense(self, value);
        if (leaf->dense < 0)
            return -1;
        if (leaf->dense && (tt_graph_data_ptr(self, value, &leaf->src) < 0 ||
                            tt_graph_nbytes(value, &leaf->nbytes) < 0))
            return -1;
    }
    return 0;
}

/* Marks the lending recording's leaves that may be lent, from `lend`: per
 * leaf None (copied), or (storage, address, use count) for a tensor whose
 * storage nothing else holds. A leaf whose storage is not at that count now
 * is copied. -1 on error. */
static int
tt_graph_set_lend(TtGraphReplay *self, TtGraphRec *rec, PyObject *lend)
{
    PyObject *seq = NULL; /* new reference */
    Py_ssize_t i;
    int rc = -1;

    seq = tt_sequence_tuple(lend, "GraphReplay: lent's lend must be a sequence");
    if (seq == NULL)
        goto cleanup;
    if (PySequence_Fast_GET_SIZE(seq) != self->nleaves) {
        PyErr_Format(PyExc_ValueError, "GraphReplay: lent's lend must have one item per output "
                     "(%zd), not %zd", self->nleaves, PySequence_Fast_GET_SIZE(seq));
        goto cleanup;
    }
    for (i = 0; i < self->nleaves; i++) {
        PyObject *spec = PySequence_Fast_GET_ITEM(seq, i); /* borrowed */
        TtGraphLeaf *leaf = &rec->leaves[i];
        unsigned long long uses, now;

        if (spec == Py_None)
            continue;
        if (!leaf->is_tensor || !PyTuple_Check(spec) || PyTuple_GET_SIZE(spec) != 3) {
            PyErr_Format(PyExc_ValueError, "GraphReplay: lend item %zd must be None or, for a "
                         "tensor output, a (storage, address, use count) tuple", i);
            goto cleanup;
        }
        uses = PyLong_AsUnsignedLongLong(PyTuple_GET_ITEM(spec, 2));
        if (uses == (unsigned long long)-1 && PyErr_Occurred())
            goto cleanup;
        leaf->cdata = Py_NewRef(PyTuple_GET_ITEM(spec, 1));
        /* the count must hold now, with nothing lent yet; a leaf off it is copied */
        if (tt_graph_uses(self, leaf, &now) < 0)
            goto cleanup;
        if (now != uses) {
            Py_CLEAR(leaf->cdata);
            continue;
        }
        leaf->storage = Py_NewRef(PyTuple_GET_ITEM(spec, 0));
        leaf->uses = uses;
        rec->lends = 1;
    }
    rc = 0;
cleanup:
    Py_XDECREF(seq);
    return rc;
}

/* *slot = attribute `name` of module `modname` (imported), once per module
 * state: every GraphReplay of the module shares it. -1 on error. */
static int
tt_graph_torch_function(PyObject **slot, const char *modname, const char *name)
{
    PyObject *mod = NULL; /* new reference */
    int rc = -1;

    if (*slot != NULL) {
        rc = 0;
        goto cleanup;
    }
    if ((mod = PyImport_ImportModule(modname)) == NULL)
        goto cleanup;
    if ((*slot = PyObject_GetAttrString(mod, name)) == NULL)
        goto cleanup;
    rc = 0;
cleanup:
    Py_XDECREF(mod);
    return rc;
}

/* Driver mode: loads the driver, retains the device's primary context and
 * looks up what a call needs from torch. -1 on error. */
static int
tt_graph_set_driver(TtGraphReplay *self, unsigned long long exec, PyObject *device)
{
    const char *why;
    long index;
    int rc = -1;
    TtCuResult cu;

    why = tt_cuda_load();
    if (why != NULL) {
        PyErr_Format(PyExc_RuntimeError, "GraphReplay: %s", why);
        goto cleanup;
    }
    index = PyLong_AsLong(device);
    if (index == -1 && PyErr_Occurred())
        goto cleanup;
    if (index < 0 || index > 1 << 20) {
        PyErr_SetString(PyExc_ValueError, "GraphReplay: device must be a CUDA device index >= 0");
        goto cleanup;
    }
    cu = tt_cuda.DeviceGet(&self->cu_device, (int)index);
    if (cu != 0) {
        tt_cuda_raise(cu, "cuDeviceGet");
        goto cleanup;
    }
    cu = tt_cuda.DevicePrimaryCtxRetain(&self->ctx, self->cu_device);
    if (cu != 0) {
        self->ctx = NULL;
        tt_cuda_raise(cu, "cuDevicePrimaryCtxRetain");
        goto cleanup;
    }
    self->recs[TT_REC_COPY].exec = (TtCuGraphExec)(uintptr_t)exec;
    Py_INCREF(device);
    self->device = device;
    if (tt_graph_torch_function(&self->state->cuda_raw_stream, "torch._C",
                                "_cuda_getCurrentRawStream") < 0 ||
        tt_graph_torch_function(&self->state->empty_like, "torch", "empty_like") < 0)
        goto cleanup;
    rc = 0;
cleanup:
    return rc;
}

/* The lending recording from `lent`: (exec handle or 0, replay or None,
 * outputs, lend), launched the same way as the first. -1 on error. */
static int
tt_graph_set_lent(TtGraphReplay *self, PyObject *lent)
{
    TtGraphRec *rec = &self->recs[TT_REC_LEND];
    PyObject *replay; /* borrowed */
    unsigned long long exec;
    int rc = -1;

    if (!PyTuple_Check(lent) || PyTuple_GET_SIZE(lent) != 4) {
        PyErr_SetString(PyExc_TypeError,
                        "GraphReplay: lent must be an (exec handle, replay, outputs, lend) tuple");
        goto cleanup;
    }
    exec = PyLong_AsUnsignedLongLong(PyTuple_GET_ITEM(lent, 0));
    if (exec == (unsigned long long)-1 && PyErr_Occurred())
        goto cleanup;
    replay = PyTuple_GET_ITEM(lent, 1);
    if ((exec != 0) != self->driver || (replay != Py_None) == self->driver ||
        (replay != Py_None && !PyCallable_Check(replay))) {
        PyErr_SetString(PyExc_ValueError, "GraphReplay: the lending recording must be launched "
                        "like the first: an exec handle, or a callable replay");
        goto cleanup;
    }
    if (tt_graph_torch_function(&self->state->storage_use_count, "torch._C",
                                "_storage_Use_Count") < 0)
        goto cleanup;
    rec->exec = (TtCuGraphExec)(uintptr_t)exec;
    rec->replay = replay != Py_None ? Py_NewRef(replay) : NULL;
    if (tt_graph_set_outputs(self, rec, PyTuple_GET_ITEM(lent, 2), self->rebuild) < 0 ||
        tt_graph_set_lend(self, rec, PyTuple_GET_ITEM(lent, 3)) < 0)
        goto cleanup;
    rc = 0;
cleanup:
    return rc;
}

static PyObject *
tt_graph_new(PyTypeObject *type, PyObject *args, PyObject *kwargs)
{
    static char *kwlist[] = {"exec_handle", "device", "signature", "inputs", "outputs",
                             "original", "rebuild", "replay", "keep", "lent", NULL};
    unsigned long long exec = 0;
    PyObject *device, *signature, *inputs, *outputs, *original; /* borrowed */
    PyObject *rebuild = Py_None, *replay = Py_None, *keep = Py_None; /* borrowed */
    PyObject *lent = Py_None;                                        /* borrowed */
    TtGraphReplay *self = NULL;
    TtState *st;

    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "KOOOOO|$OOOO:GraphReplay", kwlist, &exec,
                                     &device, &signature, &inputs, &outputs, &original,
                                     &rebuild, &replay, &keep, &lent))
        goto error;
    if ((st = tt_state_from_type(type)) == NULL)
        goto error;
    if (tt_state_tensor_type(st) == NULL) {
        if (!PyErr_Occurred())
            PyErr_SetString(PyExc_RuntimeError, "GraphReplay needs torch imported");
        goto error;
    }
    if (!PyObject_TypeCheck(signature, st->SignatureType)) {
        PyErr_Format(PyExc_TypeError, "GraphReplay: signature must be a Signature, not %.100s",
                     Py_TYPE(signature)->tp_name);
        goto error;
    }
    if (!PyCallable_Check(original)) {
        PyErr_SetString(PyExc_TypeError, "GraphReplay: original must be callable");
        goto error;
    }
    if ((exec == 0) == (replay == Py_None)) {
        PyErr_SetString(PyExc_ValueError,
                        "GraphReplay: give either an exec handle (not 0) or replay, not both");
        goto error;
    }
    if ((replay != Py_None && !PyCallable_Check(replay)) ||
        (rebuild != Py_None && !PyCallable_Check(rebuild))) {
        PyErr_SetString(PyExc_TypeError, "GraphReplay: replay and rebuild must be callable or None");
        goto error;
    }
    self = (TtGraphReplay *)type->tp_alloc(type, 0);
    if (self == NULL)
        goto error;
    self->vectorcall = tt_graph_vectorcall;
    self->state = st;
    self->driver = exec != 0;
    if (self->driver && tt_graph_set_driver(self, exec, device) < 0)
        goto error;
    self->signature = Py_NewRef(signature);
    self->original = Py_NewRef(original);
    if (replay != Py_None)
        self->recs[TT_REC_COPY].replay = Py_NewRef(replay);
    if (rebuild != Py_None)
        self->rebuild = Py_NewRef(rebuild);
    self->keep = Py_NewRef(keep);
    if (tt_graph_set_inputs(self, inputs) < 0)
        goto error;
    if (tt_graph_set_outputs(self, &self->recs[TT_REC_COPY], outputs, self->rebuild) < 0)
        goto error;
    if (lent != Py_None && tt_graph_set_lent(self, lent) < 0)
        goto error;
    return (PyObject *)self;
error:
    Py_XDECREF(self);
    return NULL;
}

/* ------------------------------------------------------------ lifetime */

static int
tt_graph_finalizing(void)
{
#if PY_VERSION_HEX >= 0x030D0000
    return Py_IsFinalizing();
#else
    return _Py_IsFinalizing();
#endif
}

static int
tt_graph_traverse(TtGraphReplay *self, visitproc visit, void *arg)
{
    Py_ssize_t i;
    int r;

    Py_VISIT(Py_TYPE(self));
    Py_VISIT(self->signature);
    Py_VISIT(self->original);
    Py_VISIT(self->on_fallback);
    Py_VISIT(self->rebuild);
    Py_VISIT(self->keep);
    for (i = 0; i < self->ninputs; i++)
        Py_VISIT(self->inputs[i].buffer);
    for (r = 0; r < TT_RECS; r++) {
        TtGraphRec *rec = &self->recs[r];

        Py_VISIT(rec->outputs);
        Py_VISIT(rec->replay);
        for (i = 0; rec->leaves != NULL && i < self->nleaves; i++) {
            Py_VISIT(rec->leaves[i].value);
            Py_VISIT(rec->leaves[i].storage);
        }
    }
    return 0;
}

static int
tt_graph_clear(TtGraphReplay *self)
{
    TtGraphInput *inputs = self->inputs;
    TtGraphRec recs[TT_RECS];
    Py_ssize_t i, ninputs = self->ninputs, nleaves = self->nleaves;
    TtCuContext popped = NULL;
    int r, pushed = 0;

    /* The last replay may still run on the device: the graph and its buffers
     * go back to torch's allocator only once it is done. */
    if (self->driver && self->launched && !tt_graph_finalizing()) {
        pushed = tt_cuda.CtxPushCurrent(self->ctx) == 0;
        (void)tt_cuda.StreamSynchronize(self->last_stream);
        if (pushed)
            (void)tt_cuda.CtxPopCurrent(&popped);
    }
    self->launched = 0;
    if (self->event != NULL) {
        (void)tt_cuda.EventDestroy(self->event);
        self->event = NULL;
    }
    /* detach everything first: a decref below may run code that calls us */
    memcpy(recs, self->recs, sizeof(recs));
    memset(self->recs, 0, sizeof(self->recs));
    self->inputs = NULL;
    self->ninputs = 0;
    self->nleaves = 0;
    for (i = 0; i < ninputs; i++) {
        Py_CLEAR(inputs[i].name);
        Py_CLEAR(inputs[i].buffer);
    }
    PyMem_Free(inputs);
    for (r = 0; r < TT_RECS; r++) {
        for (i = 0; recs[r].leaves != NULL && i < nleaves; i++) {
            Py_CLEAR(recs[r].leaves[i].value);
            Py_CLEAR(recs[r].leaves[i].storage);
            Py_CLEAR(recs[r].leaves[i].cdata);
        }
        PyMem_Free(recs[r].leaves);
        Py_CLEAR(recs[r].outputs);
        Py_CLEAR(recs[r].replay);
    }
    Py_CLEAR(self->signature);
    Py_CLEAR(self->original);
    Py_CLEAR(self->on_fallback);
    Py_CLEAR(self->rebuild);
    Py_CLEAR(self->keep);
    return 0;
}

static void
tt_graph_dealloc(TtGraphReplay *self)
{
    PyTypeObject *tp = Py_TYPE(self);

    PyObject_GC_UnTrack(self);
    tt_graph_clear(self);
    if (self->ctx != NULL) {
        (void)tt_cuda.DevicePrimaryCtxRelease(self->cu_device);
        self->ctx = NULL;
    }
    Py_CLEAR(self->device);
    tp->tp_free((PyObject *)self);
    Py_DECREF(tp);
}

/* ------------------------------------------------------------ Python API */

static PyObject *
tt_graph_get_driver(TtGraphReplay *self, void *closure)
{
    (void)closure;
    return PyBool_FromLong(self->driver);
}

static PyObject *
tt_graph_driver_error(PyObject *cls, PyObject *unused)
{
    const char *why = tt_cuda_load();

    (void)cls;
    (void)unused;
    if (why == NULL)
        Py_RETURN_NONE;
    return PyUnicode_FromString(why);
}

static PyObject *
tt_graph_get_on_fallback(TtGraphReplay *self, void *closure)
{
    (void)closure;
    return Py_NewRef(self->on_fallback != NULL ? self->on_fallback : Py_None);
}

static int
tt_graph_set_on_fallback(TtGraphReplay *self, PyObject *value, void *closure)
{
    (void)closure;
    if (value != NULL && value != Py_None && !PyCallable_Check(value)) {
        PyErr_SetString(PyExc_TypeError, "on_fallback must be a callable or None");
        return -1;
    }
    Py_XSETREF(self->on_fallback, value == NULL || value == Py_None ? NULL : Py_NewRef(value));
    return 0;
}

static PyGetSetDef tt_graph_getset[] = {
    {"on_fallback", (getter)tt_graph_get_on_fallback, (setter)tt_graph_set_on_fallback,
     "None, or called with no arguments at the next fallback, once (then None again).", NULL},
    {"replays", tt_get_counter, NULL, "Calls that replayed a recording.",
     TT_FIELD(TtGraphReplay, replays)},
    {"lent", tt_get_counter, NULL,
     "Replays that returned the lending recording's outputs without a copy.",
     TT_FIELD(TtGraphReplay, lent)},
    {"fallbacks", tt_get_counter, NULL,
     "Calls that did not fit the recording and ran the original.",
     TT_FIELD(TtGraphReplay, fallbacks)},
    {"driver", (getter)tt_graph_get_driver, NULL,
     "True when launches go through the CUDA driver, False through replay().", NULL},
    {"original", tt_get_object_or_none, NULL, "The original module.",
     TT_FIELD(TtGraphReplay, original)},
    {"signature", tt_get_object_or_none, NULL, "The recorded call's Signature.",
     TT_FIELD(TtGraphReplay, signature)},
    {NULL, NULL, NULL, NULL, NULL}};

static PyMethodDef tt_graph_methods[] = {
    {"driver_error", (PyCFunction)tt_graph_driver_error, METH_NOARGS | METH_CLASS,
     "driver_error() -> str or None: why the CUDA driver cannot be used (loads it the\n"
     "first time), or None when it can."},
    {NULL, NULL, 0, NULL}};

static PyMemberDef tt_graph_members[] = {
    {"__vectorcalloffset__", Py_T_PYSSIZET, offsetof(TtGraphReplay, vectorcall), Py_READONLY,
     NULL},
    {NULL, 0, 0, 0, NULL}};

static PyType_Slot tt_graph_slots[] = {
    {Py_tp_doc,
     "GraphReplay(exec_handle, device, signature, inputs, outputs, original, *,\n"
     "            rebuild=None, replay=None, keep=None, lent=None)\n\n"
     "Replays a recorded device graph. A call whose arguments fit `signature`\n"
     "copies each input tensor into its static buffer, launches the graph on the\n"
     "current stream and returns fresh copies of the static outputs; any other\n"
     "call runs original(*args, **kwargs).\n\n"
     "exec_handle: the graph's cudaGraphExec_t as an int, launched with the CUDA\n"
     "  driver on torch's current stream of CUDA device `device` (an int); 0 to\n"
     "  launch with replay() instead (then copies use torch's copy_ and clone).\n"
     "inputs: (position or keyword name, item index in a tuple/list argument or\n"
     "  -1, static tensor) per input tensor of the recorded call.\n"
     "outputs: the static outputs: a tensor, or a tuple or list of tensors and\n"
     "  plain values; with rebuild, a list of them, and a call returns\n"
     "  rebuild(list of copies).\n"
     "keep: anything that must live as long as the graph (the graph object).\n"
     "lent: a second recording of the same call on the same static inputs,\n"
     "  (exec_handle or 0, replay or None, outputs, lend), whose outputs are\n"
     "  returned as aliases, without a copy, whenever nothing the last such call\n"
     "  returned is alive; else the first recording runs and copies. lend holds\n"
     "  per output None (copied) or (storage, storage._cdata, use count): the\n"
     "  storage's torch._C._storage_Use_Count with no alias of it out."},
    {Py_tp_new, tt_graph_new},
    {Py_tp_dealloc, tt_graph_dealloc},
    {Py_tp_traverse, tt_graph_traverse},
    {Py_tp_clear, tt_graph_clear},
    {Py_tp_call, PyVectorcall_Call},
    {Py_tp_methods, tt_graph_methods},
    {Py_tp_getset, tt_graph_getset},
    {Py_tp_members, tt_graph_members},
    {0, NULL}};

static PyType_Spec tt_graph_spec = {
    .name = "torch_tweak._C.GraphReplay",
    .basicsize = sizeof(TtGraphReplay),
    .flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_HAVE_VECTORCALL,
    .slots = tt_graph_slots,
};

int
tt_graph_exec(PyObject *module, TtState *st)
{
    int rc = -1;

    st->GraphReplayType = (PyTypeObject *)PyType_FromModuleAndSpec(module, &tt_graph_spec, NULL);
    if (st->GraphReplayType == NULL)
        goto error;
    if (PyModule_AddObjectRef(module, "GraphReplay", (PyObject *)st->GraphReplayType) < 0)
        goto error;
    rc = 0;
error:
    return rc;
}
