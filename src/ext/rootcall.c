/*
 * rootcall.c - root_call: the __call__ of a module tuned in place. A tuned
 * module keeps its identity; its class becomes a subclass (module.py,
 * _root_class) whose __call__ is this one object. A call of the module,
 * module(*args, **kwargs), reaches it as root_call(module, *args, **kwargs)
 * and becomes module.__dict__["_tt_root"](*args, **kwargs): the wrapper's
 * dispatcher, called through vectorcall with the caller's arguments as they
 * came, without a Python frame, tuple or dict in between.
 *
 * It is a method descriptor (Py_TPFLAGS_METHOD_DESCRIPTOR), as a Python
 * function is: the type's call slot and the interpreter call it unbound with
 * the module first; read as an attribute of a module it binds like a method.
 */
#include "rootcall.h"

typedef struct {
    PyObject_HEAD
    PyObject *key; /* new reference: "_tt_root", interned */
    vectorcallfunc vectorcall;
} TtRootCall;

static PyObject *
tt_root_call_vectorcall(PyObject *callable, PyObject *const *args, size_t nargsf,
                        PyObject *kwnames)
{
    TtRootCall *self = (TtRootCall *)callable;
    Py_ssize_t nargs = PyVectorcall_NARGS(nargsf);
    PyObject *dict = NULL; /* new reference: the module's __dict__ */
    PyObject *root = NULL; /* new reference: a call may take it out of the dict */
    PyObject *result = NULL;

    if (TT_UNLIKELY(nargs < 1)) {
        PyErr_SetString(PyExc_TypeError,
                        "root_call() missing 1 required positional argument: 'self'");
        goto cleanup;
    }
    if ((dict = PyObject_GenericGetDict(args[0], NULL)) == NULL)
        goto cleanup;
    root = PyDict_GetItemWithError(dict, self->key); /* borrowed */
    if (TT_UNLIKELY(root == NULL)) {
        /* as self.__dict__["_tt_root"] raises it */
        if (!PyErr_Occurred())
            PyErr_SetObject(PyExc_KeyError, self->key);
        goto cleanup;
    }
    Py_INCREF(root);
    if (TT_UNLIKELY(root == args[0])) {
        PyErr_SetString(PyExc_ValueError,
                        "root_call: the module's _tt_root is the module itself, so a call would "
                        "never end; _tt_root must be its wrapper");
        goto cleanup;
    }
    /* a _tt_root that leads back to the module is a RecursionError, never an
     * overflow of the C stack */
    if (TT_UNLIKELY(Py_EnterRecursiveCall(" in root_call")))
        goto cleanup;
    /* args[0] is the caller's, not ours to lend: no PY_VECTORCALL_ARGUMENTS_OFFSET */
    result = PyObject_Vectorcall(root, args + 1, (size_t)(nargs - 1), kwnames);
    Py_LeaveRecursiveCall();
cleanup:
    Py_XDECREF(root);
    Py_XDECREF(dict);
    return result;
}

/* Read on a module: a bound method, as a function's is; on the class: itself. */
static PyObject *
tt_root_call_get(PyObject *self, PyObject *obj, PyObject *type)
{
    (void)type;
    if (obj == NULL || obj == Py_None)
        return Py_NewRef(self);
    return PyMethod_New(self, obj);
}

static void
tt_root_call_dealloc(TtRootCall *self)
{
    PyTypeObject *tp = Py_TYPE(self);

    Py_XDECREF(self->key);
    tp->tp_free((PyObject *)self);
    Py_DECREF(tp);
}

static PyMemberDef tt_root_call_members[] = {
    {"__vectorcalloffset__", Py_T_PYSSIZET, offsetof(TtRootCall, vectorcall), Py_READONLY,
     NULL},
    {NULL, 0, 0, 0, NULL}};

static PyType_Slot tt_root_call_slots[] = {
    {Py_tp_doc, "root_call(module, *args, **kwargs): module.__dict__[\"_tt_root\"](*args, "
                "**kwargs),\nthe __call__ of a module tuned in place."},
    {Py_tp_dealloc, tt_root_call_dealloc},
    {Py_tp_call, PyVectorcall_Call},
    {Py_tp_descr_get, tt_root_call_get},
    {Py_tp_members, tt_root_call_members},
    {0, NULL}};

static PyType_Spec tt_root_call_spec = {
    .name = "torch_tweak._C.RootCall",
    .basicsize = sizeof(TtRootCall),
    .flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_VECTORCALL | Py_TPFLAGS_METHOD_DESCRIPTOR |
             Py_TPFLAGS_DISALLOW_INSTANTIATION,
    .slots = tt_root_call_slots,
};

int
tt_root_call_exec(PyObject *module, TtState *st)
{
    PyTypeObject *type = NULL; /* new reference */
    TtRootCall *self = NULL;
    int rc = -1;

    (void)st;
    type = (PyTypeObject *)PyType_FromModuleAndSpec(module, &tt_root_call_spec, NULL);
    if (type == NULL)
        goto error;
    if ((self = (TtRootCall *)type->tp_alloc(type, 0)) == NULL)
        goto error;
    self->vectorcall = tt_root_call_vectorcall;
    if ((self->key = PyUnicode_InternFromString("_tt_root")) == NULL)
        goto error;
    if (PyModule_AddObjectRef(module, "root_call", (PyObject *)self) < 0)
        goto error;
    rc = 0;
error:
    Py_XDECREF(self);
    Py_XDECREF(type);
    return rc;
}
