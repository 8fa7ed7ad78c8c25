/*
 * graph.c - the GraphReplay type, the replay path of the device-graph
 * backend: its construction, lifetime and Python API. A call is in
 * graph_call.c, the recordings it holds in graph_record.c (graph_replay.h).
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

#include "graph_replay.h"

#include <string.h>

/* ------------------------------------------------------- construction */

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
    if (tt_graph_storage_api(st) < 0)
        goto error;
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
    for (i = 0; i < self->ninputs; i++) {
        Py_VISIT(self->inputs[i].buffer);
        Py_VISIT(self->inputs[i].memory);
    }
    for (r = 0; r < TT_RECS; r++) {
        TtGraphRec *rec = &self->recs[r];

        Py_VISIT(rec->outputs);
        Py_VISIT(rec->replay);
        for (i = 0; rec->leaves != NULL && i < self->nleaves; i++) {
            Py_VISIT(rec->leaves[i].value);
            Py_VISIT(rec->leaves[i].storage);
            Py_VISIT(rec->leaves[i].memory);
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
        Py_CLEAR(inputs[i].memory);
    }
    PyMem_Free(inputs);
    for (r = 0; r < TT_RECS; r++) {
        for (i = 0; recs[r].leaves != NULL && i < nleaves; i++) {
            Py_CLEAR(recs[r].leaves[i].value);
            Py_CLEAR(recs[r].leaves[i].storage);
            Py_CLEAR(recs[r].leaves[i].memory);
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

