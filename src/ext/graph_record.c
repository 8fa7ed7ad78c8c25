/*
 * graph_record.c - what a GraphReplay holds of its recordings, set once when
 * it is made: the static inputs, each recording's outputs (and which of the
 * lending recording's may be lent), and in driver mode the device's context
 * and torch's functions a call needs. See graph.c for the design.
 */
#include "graph_replay.h"

int
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
        if (in->item < -1) {
            PyErr_Format(PyExc_ValueError,
                         "GraphReplay: input %zd's item must be an index >= 0, or -1 for none", i);
            goto cleanup;
        }
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
            if (tt_graph_nbytes(buffer, &in->nbytes) < 0 ||
                tt_graph_span(self, buffer, in->nbytes, &in->dst, &in->memory) < 0)
                goto cleanup;
        }
    }
    rc = 0;
cleanup:
    Py_XDECREF(seq);
    return rc;
}

int
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
        if (leaf->dense && (tt_graph_nbytes(value, &leaf->nbytes) < 0 ||
                            tt_graph_span(self, value, leaf->nbytes, &leaf->src,
                                          &leaf->memory) < 0))
            return -1;
    }
    return 0;
}

/* 1 when `storage` is a torch storage, at `address`, and the storage of the
 * tensor `value`; 0 when not, with ValueError saying which; -1 on error.
 * Nothing a replay reads of a lent leaf comes from the caller but through
 * this check: the address passed to torch._C._storage_Use_Count is always
 * read back from a storage this object holds. */
static int
tt_graph_lend_storage_ok(TtGraphReplay *self, Py_ssize_t i, PyObject *value, PyObject *storage,
                         PyObject *address)
{
    PyObject *own = NULL;       /* new reference: the tensor's storage */
    PyObject *at = NULL;        /* new reference: storage's address */
    PyObject *own_at = NULL;    /* new reference: own's address */
    const char *why = NULL;
    int rc = -1, same;

    if (!PyObject_TypeCheck(storage, (PyTypeObject *)self->state->storage_type)) {
        why = "its storage is not a torch storage";
        rc = 0;
        goto cleanup;
    }
    if ((at = tt_graph_storage_address(self, storage)) == NULL)
        goto cleanup;
    if ((same = PyObject_RichCompareBool(at, address, Py_EQ)) < 0)
        goto cleanup;
    if (!same || !PyLong_CheckExact(address)) {
        why = "its address is not that storage's _cdata";
        rc = 0;
        goto cleanup;
    }
    if ((own = tt_graph_storage_of(self, value)) == NULL ||
        (own_at = tt_graph_storage_address(self, own)) == NULL)
        goto cleanup;
    if ((same = PyObject_RichCompareBool(own_at, at, Py_EQ)) < 0)
        goto cleanup;
    if (!same) {
        why = "the storage is not the output's own (untyped_storage())";
        rc = 0;
        goto cleanup;
    }
    rc = 1;
cleanup:
    if (why != NULL)
        PyErr_Format(PyExc_ValueError,
                     "GraphReplay: lend item %zd must be (output.untyped_storage(), its _cdata, "
                     "use count): %s", i, why);
    Py_XDECREF(own);
    Py_XDECREF(at);
    Py_XDECREF(own_at);
    return rc;
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
        if (tt_graph_lend_storage_ok(self, i, leaf->value, PyTuple_GET_ITEM(spec, 0),
                                     PyTuple_GET_ITEM(spec, 1)) <= 0)
            goto cleanup;
        leaf->storage = Py_NewRef(PyTuple_GET_ITEM(spec, 0));
        /* the count must hold now, with nothing lent yet; a leaf off it is copied */
        if (tt_graph_uses(self, leaf, &now) < 0)
            goto cleanup;
        if (now != uses) {
            Py_CLEAR(leaf->storage);
            continue;
        }
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

int
tt_graph_storage_api(TtState *st)
{
    PyObject *base = NULL; /* new reference: torch._C.StorageBase */
    PyObject *tensor = NULL; /* new reference: torch._C.TensorBase */
    int rc = -1;

    if (st->storage_type != NULL) {
        rc = 0;
        goto cleanup;
    }
    if (tt_graph_torch_function(&base, "torch._C", "StorageBase") < 0 ||
        tt_graph_torch_function(&tensor, "torch._C", "TensorBase") < 0)
        goto cleanup;
    if (!PyType_Check(base)) {
        PyErr_SetString(PyExc_TypeError, "GraphReplay: torch._C.StorageBase is not a type");
        goto cleanup;
    }
    /* the descriptors themselves, read on the types: called with the object,
     * they run torch's own code whatever the object's class says */
    if ((st->storage_cdata = PyObject_GetAttrString(base, "_cdata")) == NULL ||
        (st->storage_data_ptr = PyObject_GetAttrString(base, "data_ptr")) == NULL ||
        (st->storage_nbytes = PyObject_GetAttrString(base, "nbytes")) == NULL ||
        (st->tensor_storage = PyObject_GetAttrString(tensor, "untyped_storage")) == NULL)
        goto cleanup;
    if (Py_TYPE(st->storage_cdata)->tp_descr_get == NULL) {
        PyErr_SetString(PyExc_TypeError, "GraphReplay: torch._C.StorageBase._cdata is not a "
                        "descriptor");
        goto cleanup;
    }
    st->storage_type = Py_NewRef(base);
    rc = 0;
cleanup:
    if (rc < 0 && st->storage_type == NULL) {
        Py_CLEAR(st->storage_cdata);
        Py_CLEAR(st->storage_data_ptr);
        Py_CLEAR(st->storage_nbytes);
        Py_CLEAR(st->tensor_storage);
    }
    Py_XDECREF(base);
    Py_XDECREF(tensor);
    return rc;
}

int
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
        tt_graph_raise_cuda(cu, "cuDeviceGet");
        goto cleanup;
    }
    cu = tt_cuda.DevicePrimaryCtxRetain(&self->ctx, self->cu_device);
    if (cu != 0) {
        self->ctx = NULL;
        tt_graph_raise_cuda(cu, "cuDevicePrimaryCtxRetain");
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

int
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
