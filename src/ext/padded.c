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
 * Which buckets exist and what they hold are Python's decisions
 * (backends/padded.py), set through _pad_bucket. The bucket rule itself (a
 * call's bucket, a bucket's range) is C's alone (padded_bucket.c): Python
 * asks it through _pad_key, _pad_lower and _pad_batch_bucket. So are the
 * copies in and the cuts out (padded_call.c): the calls Python makes of a
 * bucket (recording, a first sight's check, a layout this type cannot take)
 * copy and cut through _pad_copy_in and _pad_cut.
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
    {"_pad_copy_in", (PyCFunction)tt_pad_py_copy_in, METH_VARARGS,
     "_pad_copy_in(buffers, tensors, axes, b, n, bucket_b, bucket_n): each tensor copied\n"
     "into its buffer as a call of the bucket is (axes: (batch, length) per tensor): its\n"
     "first b rows, and along a length axis its first n positions, the rest of those\n"
     "rows zeroed. The per-call path's rule, for the calls Python makes of a bucket."},
    {"_pad_cut", (PyCFunction)tt_pad_py_cut, METH_VARARGS,
     "_pad_cut(leaves, axes, b, n, bucket_b, bucket_n) -> list: each tensor leaf cut\n"
     "back to the call's batch and length (axes: (batch, length) per leaf) and copied,\n"
     "other leaves as they are. The per-call path's rule, for Python's calls."},
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
