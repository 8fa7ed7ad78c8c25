/*
 * padded.c - the PaddedReplay type, the base type of the padded backend's
 * callable (torch_tweak.backends.padded.PaddedCall): the steady per-call
 * path of a call of varying sizes.
 *
 * A call is served here when it fits the recorded layout (the same
 * positional count and keywords, the same plain values, each container that
 * holds a tensor of the recorded exact type and size, each input tensor a
 * torch.Tensor of the recorded dtype, device and rank, sizes equal to the
 * recorded ones but on the padded axes, one batch and one length among them)
 * and a ready bucket's range holds its batch and length. Then, for that
 * bucket: each input is copied into the bucket's buffer (its first rows; the
 * length axis past the call's length zeroed in those rows, so a mask there is
 * zero), the bucket's device graph is launched through its GraphReplay
 * (graph_call.h: the launch alone), or, with no graph, the target runs on the
 * buffers, and each output is cut back to the call's batch and length and
 * copied out, so a later call never changes what a caller holds. The bucket
 * counts the call (hits, valid and served elements).
 *
 * Whether a call fits is this type's decision alone: a call that does not
 * fit (another dtype, device, structure or plain value, a tensor subclass...)
 * or whose sizes fall outside the range runs the target on its own
 * arguments, counted (outside_calls). A call that fits, in the range, whose
 * bucket is not ready goes back to Python, to the subclass's
 * _slow(bucket_b, bucket_n, b, n, *args, **kwargs): recording, a new
 * bucket's first sight. A call made while another is inside this object, here
 * or in _slow (the dispatcher serialises a backend that is not thread-safe:
 * this is a call made from inside one, or past the dispatcher) runs the
 * target on its own arguments, never the buffers.
 *
 * Which buckets exist, what they hold and when they serve are Python's
 * decisions (backends/padded.py), set through _pad_bucket, _pad_serve and
 * _pad_drop (which leaves a bucket a call is being served from). The bucket
 * rule itself (a call's bucket, a bucket's range) is C's alone
 * (padded_bucket.c): Python asks it through _pad_key, _pad_lower and
 * _pad_batch_bucket. So are the fit, the copies in and the cuts out: the
 * calls Python makes of a bucket (recording, a first sight's check) fit,
 * copy and cut through _pad_fit, _pad_filled and _pad_run.
 *
 * The type is four files sharing padded_replay.h, in this order:
 * padded_layout.c (the recorded layout, whether a call fits it),
 * padded_bucket.c (the buckets and their counters), padded_call.c (a call)
 * and this file (construction, lifetime, the Python API).
 */
#include "padded.h"

#include "padded_replay.h"

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

/* ------------------------------------------------------------ lifetime */

static int
tt_pad_traverse(TtPaddedReplay *self, visitproc visit, void *arg)
{
    Py_ssize_t i;

    Py_VISIT(Py_TYPE(self));
    Py_VISIT(self->target);
    Py_VISIT(self->flatten);
    Py_VISIT(self->kwnames);
    if ((i = tt_pad_nodes_visit(self, visit, arg)) != 0)
        return (int)i;
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
    tt_pad_nodes_free(self);
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
    PyMem_Free(self->params);
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
    {"slow_calls", tt_get_counter, NULL, "Calls that fit, in the range, handed to _slow.",
     TT_FIELD(TtPaddedReplay, slow)},
    {"outside_calls", tt_get_counter, NULL,
     "Calls run by the target: they do not fit the layout, or fall outside the range.",
     TT_FIELD(TtPaddedReplay, outside)},
    {"serves_here", (getter)tt_pad_get_served_here, NULL,
     "True when a call of the recorded layout can be served here (_pad_layout set it).",
     NULL},
    {NULL, NULL, NULL, NULL, NULL}};

static PyMethodDef tt_pad_methods[] = {
    {"_pad_layout", (PyCFunction)(void (*)(void))tt_pad_layout, METH_VARARGS | METH_KEYWORDS,
     "_pad_layout(call, slots, outputs, length, target, flatten, max_batch, max_length, step):\n"
     "set once. call: the recorded (args, kwargs); slots: (batch, length) per tensor of the\n"
     "call, in the order of its leaves (torch's pytree), each an argument or inside a tuple,\n"
     "list, namedtuple or dict of str keys; outputs: (batch, length) per output leaf;\n"
     "length: the length axis is padded; target: runs a bucket without a graph, and every\n"
     "call not served here; flatten(result) -> its leaves; the range and the length step."},
    {"_pad_fit", (PyCFunction)tt_pad_py_fit, METH_VARARGS,
     "_pad_fit((args, kwargs)) -> (b, n, bucket, tensors), or None when the call does not fit\n"
     "the layout: its batch and length (n 0 without a length axis), its bucket ((b, n), None\n"
     "outside the range) and its tensor per slot. The per-call path's fit."},
    {"_pad_bucket", (PyCFunction)(void (*)(void))tt_pad_set_bucket, METH_VARARGS | METH_KEYWORDS,
     "_pad_bucket(b, n, buffers, graph, outputs, rebuild): bucket (b, n) holds these (a buffer\n"
     "per slot of its shape, a GraphReplay or None); it serves no call until _pad_serve."},
    {"_pad_serve", (PyCFunction)tt_pad_serve_bucket, METH_VARARGS,
     "_pad_serve(b, n): bucket (b, n) serves the calls of its range from now on."},
    {"_pad_drop", (PyCFunction)tt_pad_drop, METH_VARARGS,
     "_pad_drop(b, n) -> bool: bucket (b, n) serves no more and lets go of what it held\n"
     "(True, also when there is no such bucket); False (and nothing done) while a call is\n"
     "being served from it."},
    {"_pad_range", (PyCFunction)tt_pad_set_range, METH_VARARGS,
     "_pad_range(max_batch, max_length): the range of the calls served from now on."},
    {"_pad_run", (PyCFunction)tt_pad_py_run, METH_VARARGS,
     "_pad_run((args, kwargs), hit=False): the call through the bucket its sizes fall into\n"
     "(held, ready or not): copies in, graph or target, cuts out; counted, a hit if hit."},
    {"_pad_filled", (PyCFunction)tt_pad_py_filled, METH_VARARGS,
     "_pad_filled((args, kwargs)) -> (args, kwargs): the call copied into its bucket's\n"
     "buffers, and the call of the recorded layout with the buffers in its tensors' places."},
    {"_pad_counts", (PyCFunction)tt_pad_counts, METH_NOARGS,
     "_pad_counts() -> {(b, n): (hits, valid, served)}"},
    {"_pad_ready", (PyCFunction)tt_pad_ready, METH_NOARGS,
     "_pad_ready() -> [(b, n)]: the buckets served here."},
    {"_pad_batch_bucket", (PyCFunction)tt_pad_py_batch_bucket, METH_VARARGS | METH_STATIC,
     "_pad_batch_bucket(b) -> the batch bucket of batch b: a power of two up to 8, past it\n"
     "a multiple of a quarter of the power of two below (at least 4)."},
    {"_pad_key", (PyCFunction)tt_pad_py_key, METH_VARARGS | METH_STATIC,
     "_pad_key(b, n, batch, length, max_batch, max_length, step) -> (bucket b, bucket n),\n"
     "or None outside the range: the batch bucket when the batch is padded, the length\n"
     "rounded up to a multiple of step (at most max_length) when the length is."},
    {"_pad_lower", (PyCFunction)tt_pad_py_lower, METH_VARARGS | METH_STATIC,
     "_pad_lower(b, n, batch, length, step) -> (low_b, low_n): the smallest batch and\n"
     "length that fall into bucket (b, n)."},
    {"reset_counts", (PyCFunction)tt_pad_reset_counts, METH_NOARGS,
     "reset_counts(): every bucket's counters, fast_calls, slow_calls and outside_calls to 0."},
    {NULL, NULL, 0, NULL}};

static PyMemberDef tt_pad_members[] = {
    {"__vectorcalloffset__", Py_T_PYSSIZET, offsetof(TtPaddedReplay, vectorcall), Py_READONLY,
     NULL},
    {NULL, 0, 0, 0, NULL}};

static PyType_Slot tt_pad_slots[] = {
    {Py_tp_doc,
     "Base type of the padded backend's callable: the steady per-call path of a\n"
     "call of varying sizes. A call of the layout set by _pad_layout whose batch\n"
     "and length fall in a ready bucket's range (_pad_serve) is copied into the\n"
     "bucket's buffers (the length axis past the call's zeroed), runs the bucket's\n"
     "graph (or the target on the buffers), and returns copies of the outputs cut\n"
     "back to the call's sizes; a call that does not fit, or is outside the range,\n"
     "runs the target; any other goes to self._slow(bb, bn, b, n, *args, **kwargs)."},
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
