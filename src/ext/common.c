/*
 * common.c - helpers that need nothing of the extension: exceptions,
 * sequences held while Python code runs, getters of fields.
 */
#include "common.h"

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

/* ------------------------------------------------------------- descriptors */

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
