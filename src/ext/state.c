/*
 * state.c - the per-module state: its strings and references, finding it
 * from a type, and torch.Tensor found once per module.
 */
#include "state.h"

/* Set once by module.c before the first module exists; the same definition
 * for every interpreter. */
static PyModuleDef *tt_state_def;

void
tt_state_use_def(PyModuleDef *def)
{
    tt_state_def = def;
}

static PyObject *
tt_intern(const char *s)
{
    return PyUnicode_InternFromString(s); /* new reference */
}

int
tt_state_init(TtState *st)
{
    int rc = -1;

    if ((st->str_dtype = tt_intern("dtype")) == NULL ||
        (st->str_shape = tt_intern("shape")) == NULL ||
        (st->str_device = tt_intern("device")) == NULL ||
        (st->str_name = tt_intern("__name__")) == NULL ||
        (st->str_tensor = tt_intern("Tensor")) == NULL ||
        (st->str_torch = tt_intern("torch")) == NULL ||
        (st->str_get_device = tt_intern("get_device")) == NULL ||
        (st->str_requires_grad = tt_intern("requires_grad")) == NULL ||
        (st->str_data_ptr = tt_intern("data_ptr")) == NULL ||
        (st->str_is_contiguous = tt_intern("is_contiguous")) == NULL ||
        (st->str_copy_ = tt_intern("copy_")) == NULL ||
        (st->str_clone = tt_intern("clone")) == NULL ||
        (st->str_detach = tt_intern("detach")) == NULL ||
        (st->str_narrow = tt_intern("narrow")) == NULL ||
        (st->str_zero_ = tt_intern("zero_")) == NULL ||
        (st->str_slow = tt_intern("_slow")) == NULL ||
        (st->str_training = tt_intern("training")) == NULL ||
        (st->str_version = tt_intern("_version")) == NULL ||
        (st->str_modules = tt_intern("_modules")) == NULL ||
        (st->str_parameters = tt_intern("_parameters")) == NULL)
        goto error;
    rc = 0;
error:
    return rc;
}

int
tt_state_traverse(TtState *st, visitproc visit, void *arg)
{
    Py_VISIT(st->EngineError);
    Py_VISIT(st->TreeType);
    Py_VISIT(st->ResultType);
    Py_VISIT(st->SignatureType);
    Py_VISIT(st->DispatcherType);
    Py_VISIT(st->GraphReplayType);
    Py_VISIT(st->PaddedReplayType);
    Py_VISIT(st->tensor_type);
    Py_VISIT(st->grad_enabled);
    Py_VISIT(st->cuda_raw_stream);
    Py_VISIT(st->empty_like);
    Py_VISIT(st->storage_use_count);
    Py_VISIT(st->storage_type);
    Py_VISIT(st->storage_cdata);
    Py_VISIT(st->storage_data_ptr);
    Py_VISIT(st->storage_nbytes);
    Py_VISIT(st->tensor_storage);
    Py_VISIT(st->value_keyer);
    return 0;
}

void
tt_state_clear(TtState *st)
{
    Py_CLEAR(st->EngineError);
    Py_CLEAR(st->TreeType);
    Py_CLEAR(st->ResultType);
    Py_CLEAR(st->SignatureType);
    Py_CLEAR(st->DispatcherType);
    Py_CLEAR(st->GraphReplayType);
    Py_CLEAR(st->PaddedReplayType);
    Py_CLEAR(st->tensor_type);
    Py_CLEAR(st->grad_enabled);
    Py_CLEAR(st->cuda_raw_stream);
    Py_CLEAR(st->empty_like);
    Py_CLEAR(st->storage_use_count);
    Py_CLEAR(st->storage_type);
    Py_CLEAR(st->storage_cdata);
    Py_CLEAR(st->storage_data_ptr);
    Py_CLEAR(st->storage_nbytes);
    Py_CLEAR(st->tensor_storage);
    Py_CLEAR(st->value_keyer);
    Py_CLEAR(st->str_dtype);
    Py_CLEAR(st->str_shape);
    Py_CLEAR(st->str_device);
    Py_CLEAR(st->str_name);
    Py_CLEAR(st->str_tensor);
    Py_CLEAR(st->str_torch);
    Py_CLEAR(st->str_get_device);
    Py_CLEAR(st->str_requires_grad);
    Py_CLEAR(st->str_data_ptr);
    Py_CLEAR(st->str_is_contiguous);
    Py_CLEAR(st->str_copy_);
    Py_CLEAR(st->str_clone);
    Py_CLEAR(st->str_detach);
    Py_CLEAR(st->str_narrow);
    Py_CLEAR(st->str_zero_);
    Py_CLEAR(st->str_slow);
    Py_CLEAR(st->str_training);
    Py_CLEAR(st->str_version);
    Py_CLEAR(st->str_modules);
    Py_CLEAR(st->str_parameters);
}

TtState *
tt_state_from_type(PyTypeObject *tp)
{
    TtState *st = NULL;
#if PY_VERSION_HEX >= 0x030B0000
    PyObject *module = PyType_GetModuleByDef(tp, tt_state_def); /* borrowed */

    if (module != NULL)
        st = (TtState *)PyModule_GetState(module);
#else
    /* 3.10 has no PyType_GetModuleByDef: walk the MRO for a heap type that
     * this module created. */
    PyObject *mro = tp->tp_mro; /* borrowed */
    Py_ssize_t i, n;

    n = mro != NULL ? PyTuple_GET_SIZE(mro) : 0;
    for (i = 0; i < n && st == NULL; i++) {
        PyTypeObject *base = (PyTypeObject *)PyTuple_GET_ITEM(mro, i);
        PyObject *module;

        if (!(base->tp_flags & Py_TPFLAGS_HEAPTYPE))
            continue;
        module = ((PyHeapTypeObject *)base)->ht_module; /* borrowed */
        if (module != NULL && PyModule_GetDef(module) == tt_state_def)
            st = (TtState *)PyModule_GetState(module);
    }
    if (st == NULL)
        PyErr_Format(PyExc_TypeError, "type '%s' does not come from torch_tweak._C",
                     tp->tp_name);
#endif
    return st;
}

PyTypeObject *
tt_state_tensor_type(TtState *st)
{
    PyObject *torch = NULL;  /* new reference */
    PyObject *tensor = NULL; /* new reference */
    PyTypeObject *result = NULL;

    if (TT_LIKELY(st->tensor_type != NULL))
        return st->tensor_type;
    /* Not importing torch here: when nobody has imported it, no argument can be
     * a tensor, and the extension stays usable without torch. */
    torch = PyImport_GetModule(st->str_torch);
    if (torch == NULL)
        goto cleanup;
    tensor = PyObject_GetAttr(torch, st->str_tensor);
    if (tensor == NULL)
        goto cleanup;
    if (!PyType_Check(tensor)) {
        PyErr_SetString(PyExc_TypeError, "torch.Tensor is not a type");
        goto cleanup;
    }
    if (tt_getter_find((PyTypeObject *)tensor, st->str_dtype, &st->tensor_dtype) < 0 ||
        tt_getter_find((PyTypeObject *)tensor, st->str_shape, &st->tensor_shape) < 0 ||
        tt_getter_find((PyTypeObject *)tensor, st->str_device, &st->tensor_device) < 0 ||
        tt_getter_find((PyTypeObject *)tensor, st->str_requires_grad,
                       &st->tensor_requires_grad) < 0)
        goto cleanup;
    st->tensor_type = (PyTypeObject *)tensor;
    tensor = NULL;
    result = st->tensor_type;
cleanup:
    Py_XDECREF(torch);
    Py_XDECREF(tensor);
    return result;
}
