/*
 * module.c - torch_tweak._C: module definition (multi-phase init), per-module
 * state, and the helpers that the bindings and the dispatcher share.
 */
#include "ext.h"

/* ------------------------------------------------------------ exceptions */

PyObject *
tt_exception_fetch(void)
{
    PyObject *exc = NULL; /* new reference */
#if PY_VERSION_HEX >= 0x030C0000
    exc = PyErr_GetRaisedException();
#else
    PyObject *type = NULL, *value = NULL, *tb = NULL;

    PyErr_Fetch(&type, &value, &tb);
    if (type == NULL)
        goto cleanup;
    PyErr_NormalizeException(&type, &value, &tb);
    if (tb != NULL && value != NULL)
        PyException_SetTraceback(value, tb);
    exc = value;
    value = NULL;
cleanup:
    Py_XDECREF(type);
    Py_XDECREF(value);
    Py_XDECREF(tb);
#endif
    return exc;
}

void
tt_exception_restore(PyObject *exc)
{
#if PY_VERSION_HEX >= 0x030C0000
    PyErr_SetRaisedException(exc);
#else
    PyObject *type = (PyObject *)Py_TYPE(exc);
    PyObject *tb = PyException_GetTraceback(exc); /* new reference */

    Py_INCREF(type);
    PyErr_Restore(type, exc, tb); /* steals all three */
#endif
}

/* ------------------------------------------------------------- sequences */

PyObject *
tt_sequence_tuple(PyObject *seq, const char *msg)
{
    PyObject *fast = PySequence_Fast(seq, msg); /* new reference: a list or a tuple */

    if (fast != NULL && !PyTuple_CheckExact(fast))
        Py_SETREF(fast, PySequence_Tuple(fast));
    return fast;
}

/* ----------------------------------------------------------------- state */

static TtState *
tt_state_from_module(PyObject *module)
{
    return (TtState *)PyModule_GetState(module);
}

TtState *
tt_state_from_type(PyTypeObject *tp)
{
    TtState *st = NULL;
#if PY_VERSION_HEX >= 0x030B0000
    PyObject *module = PyType_GetModuleByDef(tp, &tt_module_def); /* borrowed */

    if (module != NULL)
        st = tt_state_from_module(module);
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
        if (module != NULL && PyModule_GetDef(module) == &tt_module_def)
            st = tt_state_from_module(module);
    }
    if (st == NULL)
        PyErr_Format(PyExc_TypeError, "type '%s' does not come from torch_tweak._C",
                     tp->tp_name);
#endif
    return st;
}

int
tt_getter_find(PyTypeObject *tp, PyObject *name, TtGetter *g)
{
    PyObject *descr = PyObject_GetAttr((PyObject *)tp, name); /* new reference */

    g->get = NULL;
    g->closure = NULL;
    if (descr == NULL)
        return -1;
    if (Py_IS_TYPE(descr, &PyGetSetDescr_Type) &&
        PyType_IsSubtype(tp, PyDescr_TYPE(descr))) {
        g->get = ((PyGetSetDescrObject *)descr)->d_getset->get;
        g->closure = ((PyGetSetDescrObject *)descr)->d_getset->closure;
    }
    Py_DECREF(descr);
    return 0;
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

/* --------------------------------------------------------------- getters */

PyObject *
tt_get_counter(PyObject *self, void *offset)
{
    const char *field = (const char *)self + (uintptr_t)offset;

    return PyLong_FromUnsignedLongLong(*(const unsigned long long *)(const void *)field);
}

PyObject *
tt_get_object_or_none(PyObject *self, void *offset)
{
    const char *field = (const char *)self + (uintptr_t)offset;
    PyObject *value = *(PyObject *const *)(const void *)field; /* borrowed */

    if (value == NULL)
        value = Py_None;
    Py_INCREF(value);
    return value;
}

/* ---------------------------------------------------------------- module */

static PyObject *
tt_intern(const char *s)
{
    return PyUnicode_InternFromString(s); /* new reference */
}

static int
tt_module_exec(PyObject *module)
{
    TtState *st = tt_state_from_module(module);
    int rc = -1;

    if ((st->str_dtype = tt_intern("dtype")) == NULL ||
        (st->str_shape = tt_intern("shape")) == NULL ||
        (st->str_device = tt_intern("device")) == NULL ||
        (st->str_name = tt_intern("__name__")) == NULL ||
        (st->str_tensor = tt_intern("Tensor")) == NULL ||
        (st->str_torch = tt_intern("torch")) == NULL ||
        (st->str_get_device = tt_intern("get_device")) == NULL ||
        (st->str_requires_grad = tt_intern("requires_grad")) == NULL)
        goto error;

    st->EngineError = PyErr_NewExceptionWithDoc(
        "torch_tweak._C.EngineError",
        "An engine call failed for a reason other than a bad argument or memory:\n"
        "a callback failed, a call out of order, or the time budget.",
        PyExc_RuntimeError, NULL);
    if (st->EngineError == NULL)
        goto error;
    if (PyModule_AddObjectRef(module, "EngineError", st->EngineError) < 0)
        goto error;
    if (tt_bindings_exec(module, st) < 0)
        goto error;
    if (tt_dispatch_exec(module, st) < 0)
        goto error;
    if (tt_graph_exec(module) < 0)
        goto error;
    rc = 0;
error:
    return rc;
}

static int
tt_module_traverse(PyObject *module, visitproc visit, void *arg)
{
    TtState *st = tt_state_from_module(module);

    Py_VISIT(st->EngineError);
    Py_VISIT(st->TreeType);
    Py_VISIT(st->ResultType);
    Py_VISIT(st->SignatureType);
    Py_VISIT(st->DispatcherType);
    Py_VISIT(st->tensor_type);
    Py_VISIT(st->grad_enabled);
    return 0;
}

static int
tt_module_clear(PyObject *module)
{
    TtState *st = tt_state_from_module(module);

    Py_CLEAR(st->EngineError);
    Py_CLEAR(st->TreeType);
    Py_CLEAR(st->ResultType);
    Py_CLEAR(st->SignatureType);
    Py_CLEAR(st->DispatcherType);
    Py_CLEAR(st->tensor_type);
    Py_CLEAR(st->str_dtype);
    Py_CLEAR(st->str_shape);
    Py_CLEAR(st->str_device);
    Py_CLEAR(st->str_name);
    Py_CLEAR(st->str_tensor);
    Py_CLEAR(st->str_torch);
    Py_CLEAR(st->str_get_device);
    Py_CLEAR(st->str_requires_grad);
    Py_CLEAR(st->grad_enabled);
    return 0;
}

static void
tt_module_free(void *module)
{
    tt_module_clear((PyObject *)module);
}

static PyMethodDef tt_module_methods[] = {
    {"default_measure_config", (PyCFunction)tt_py_default_measure_config, METH_NOARGS,
     "The engine's default measurement config as a dict."},
    {"measure", (PyCFunction)(void (*)(void))tt_py_measure, METH_VARARGS | METH_KEYWORDS,
     "measure(run, n_samples, *, sync=None, config=None, clock=None) -> stats"},
    {"compare", (PyCFunction)(void (*)(void))tt_py_compare, METH_VARARGS | METH_KEYWORDS,
     "compare(runs, n_samples, *, sync=None, config=None, clock=None) -> [stats]"},
    {"choose", (PyCFunction)(void (*)(void))tt_py_choose, METH_VARARGS | METH_KEYWORDS,
     "choose(kind, candidates, n_samples, *, sync=None, config=None, clock=None)\n"
     "-> (winner or -1, reports)"},
    {"tweak", (PyCFunction)(void (*)(void))tt_py_tweak, METH_VARARGS | METH_KEYWORDS,
     "tweak(tree, *, enter, tune, activate, leave, run, n_samples, ...) -> Result"},
    {"enable_vectorcall", (PyCFunction)tt_py_enable_vectorcall, METH_O,
     "enable_vectorcall(cls) -> bool\n\n"
     "Sets the vectorcall flag on a Python subclass of Dispatcher whose __call__\n"
     "is still Dispatcher's (Python < 3.12 does not inherit it for heap types).\n"
     "Returns whether calls of cls's instances now use vectorcall."},
    {NULL, NULL, 0, NULL}};

static PyModuleDef_Slot tt_module_slots[] = {
    {Py_mod_exec, (void *)tt_module_exec},
    {0, NULL}};

PyModuleDef tt_module_def = {
    PyModuleDef_HEAD_INIT,
    .m_name = "torch_tweak._C",
    .m_doc = "torch-tweak's C extension: the engine's bindings and the dispatcher.",
    .m_size = sizeof(TtState),
    .m_methods = tt_module_methods,
    .m_slots = tt_module_slots,
    .m_traverse = tt_module_traverse,
    .m_clear = tt_module_clear,
    .m_free = tt_module_free,
};

PyMODINIT_FUNC
PyInit__C(void)
{
    return PyModuleDef_Init(&tt_module_def);
}
