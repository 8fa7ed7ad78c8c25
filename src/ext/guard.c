/*
 * guard.c - what the dispatcher checks before it lets a backend run a call:
 * the lock of an entry whose backend is not thread-safe, and the grad rule
 * (a backend that returns no autograd outputs must not serve a call that
 * autograd would record).
 */
#include "guard.h"

/* The lock of a serialised entry (see guard.h). */
struct TtEntryLock {
    PyThread_type_lock lock;
    unsigned long owner;
    long depth;
};

static const char tt_entry_lock_name[] = "torch_tweak._C.EntryLock";

static void
tt_entry_lock_free(PyObject *capsule)
{
    TtEntryLock *l = PyCapsule_GetPointer(capsule, tt_entry_lock_name);

    if (l != NULL) {
        PyThread_free_lock(l->lock);
        PyMem_Free(l);
    }
}

PyObject *
tt_entry_lock_new(void)
{
    TtEntryLock *l = PyMem_Calloc(1, sizeof(TtEntryLock));
    PyObject *capsule = NULL;

    if (l == NULL) {
        PyErr_NoMemory();
        goto cleanup;
    }
    if ((l->lock = PyThread_allocate_lock()) == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "cannot allocate a lock");
        goto cleanup;
    }
    capsule = PyCapsule_New(l, tt_entry_lock_name, tt_entry_lock_free);
    if (capsule != NULL)
        l = NULL;
cleanup:
    if (l != NULL) {
        if (l->lock != NULL)
            PyThread_free_lock(l->lock);
        PyMem_Free(l);
    }
    return capsule;
}

TtEntryLock *
tt_entry_lock_get(PyObject *capsule)
{
    return PyCapsule_GetPointer(capsule, tt_entry_lock_name);
}

/* The holder may need the GIL to finish, so the wait happens without it, in
 * slices, so that Ctrl-C still reaches the main thread. */
int
tt_entry_lock_acquire(TtEntryLock *l)
{
    unsigned long me = PyThread_get_thread_ident();
    PyLockStatus got = PY_LOCK_FAILURE;
    int rc = -1;

    if (l->depth > 0 && l->owner == me) {
        l->depth++;
        rc = 0;
        goto cleanup;
    }
    if (!PyThread_acquire_lock(l->lock, NOWAIT_LOCK)) {
        while (got != PY_LOCK_ACQUIRED) {
            Py_BEGIN_ALLOW_THREADS
            got = PyThread_acquire_lock_timed(l->lock, 50000, 1);
            Py_END_ALLOW_THREADS
            if (got != PY_LOCK_ACQUIRED && PyErr_CheckSignals() < 0)
                goto cleanup;
        }
    }
    l->owner = me;
    l->depth = 1;
    rc = 0;
cleanup:
    return rc;
}

void
tt_entry_lock_release(TtEntryLock *l)
{
    if (--l->depth == 0) {
        l->owner = 0;
        PyThread_release_lock(l->lock);
    }
}

/* 1 when `obj`, a tensor or a tuple/list holding one, requires grad; 0 when
 * not; -1 on error. */
static int
tt_requires_grad(TtState *st, PyTypeObject *tensor_type, PyObject *obj, int depth)
{
    PyObject *flag = NULL; /* new reference */
    Py_ssize_t i, n;
    int rc = 0;

    if (PyObject_TypeCheck(obj, tensor_type)) {
        flag = tt_tensor_attr(st, obj, &st->tensor_requires_grad, st->str_requires_grad);
        rc = flag == NULL ? -1 : PyObject_IsTrue(flag);
    }
    else if (depth == 0 && (PyTuple_Check(obj) || PyList_Check(obj))) {
        n = PySequence_Fast_GET_SIZE(obj);
        for (i = 0; i < n && rc == 0 && i < PySequence_Fast_GET_SIZE(obj); i++) {
            PyObject *item = Py_NewRef(PySequence_Fast_GET_ITEM(obj, i));
            rc = tt_requires_grad(st, tensor_type, item, 1);
            Py_DECREF(item);
        }
    }
    Py_XDECREF(flag);
    return rc;
}

int
tt_needs_grad(TtState *st, PyObject *module_params, PyObject *const *args, Py_ssize_t n)
{
    PyTypeObject *tensor_type = tt_state_tensor_type(st); /* borrowed */
    PyObject *torch = NULL;   /* new reference */
    PyObject *on = NULL;      /* new reference */
    PyObject *params = NULL;  /* new reference: held while reading */
    PyObject *key, *value;    /* borrowed */
    Py_ssize_t i, pos;
    int rc = -1;

    if (tensor_type == NULL) {
        rc = PyErr_Occurred() ? -1 : 0; /* torch not imported: nothing is a tensor */
        goto cleanup;
    }
    if (TT_UNLIKELY(st->grad_enabled == NULL)) {
        PyObject *c; /* new reference: torch._C */

        if ((torch = PyImport_GetModule(st->str_torch)) == NULL) {
            if (!PyErr_Occurred())
                PyErr_SetString(PyExc_RuntimeError, "torch is not imported");
            goto cleanup;
        }
        if ((c = PyObject_GetAttrString(torch, "_C")) == NULL)
            goto cleanup;
        st->grad_enabled = PyObject_GetAttrString(c, "is_grad_enabled");
        Py_DECREF(c);
        if (st->grad_enabled == NULL)
            goto cleanup;
    }
    if ((on = PyObject_CallNoArgs(st->grad_enabled)) == NULL)
        goto cleanup;
    rc = 0;
    if (TT_LIKELY(on != Py_True))
        goto cleanup; /* no_grad, inference_mode: the usual inference call */
    for (i = 0; i < n && rc == 0; i++)
        rc = tt_requires_grad(st, tensor_type, args[i], 0);
    params = Py_XNewRef(module_params);
    for (i = 0; params != NULL && i < PyTuple_GET_SIZE(params) && rc == 0; i++) {
        PyObject *dict = PyTuple_GET_ITEM(params, i); /* borrowed, held by params */

        pos = 0;
        while (rc == 0 && PyDict_Next(dict, &pos, &key, &value)) {
            Py_INCREF(value);
            if (value != Py_None)
                rc = tt_requires_grad(st, tensor_type, value, 1);
            Py_DECREF(value);
        }
    }
cleanup:
    Py_XDECREF(torch);
    Py_XDECREF(on);
    Py_XDECREF(params);
    return rc;
}

/* 1 when `now` (a new reference, consumed; NULL with an exception) is not
 * equal to `then`; 0 when equal; -1 on error. */
static int
tt_differs(PyObject *now, PyObject *then)
{
    int rc;

    if (now == NULL)
        return -1;
    rc = PyObject_RichCompareBool(now, then, Py_NE);
    Py_DECREF(now);
    return rc;
}

/* The kind of change of one weights_of entry: -1 none, 0 replaced, 1 other
 * memory, 2 written in place; -2 on error (an exception set). */
static int
tt_weight_entry_change(TtState *st, PyObject *entry, int in_place)
{
    PyObject *table, *name, *tensor, *address, *version; /* borrowed from entry */
    PyObject *now;                                       /* borrowed from table */
    int rc;

    if (!PyTuple_Check(entry) || PyTuple_GET_SIZE(entry) != 6 ||
        !PyDict_Check(PyTuple_GET_ITEM(entry, 0))) {
        PyErr_SetString(PyExc_TypeError, "weight_change: each entry must be a tuple (table, path, "
                                         "name, tensor, address, version) as weights_of makes");
        return -2;
    }
    table = PyTuple_GET_ITEM(entry, 0);
    name = PyTuple_GET_ITEM(entry, 2);
    tensor = PyTuple_GET_ITEM(entry, 3);
    address = PyTuple_GET_ITEM(entry, 4);
    version = PyTuple_GET_ITEM(entry, 5);
    now = PyDict_GetItemWithError(table, name);
    if (now == NULL && PyErr_Occurred())
        return -2;
    if (now != tensor)
        return 0;
    rc = tt_differs(PyObject_CallMethodNoArgs(tensor, st->str_data_ptr), address);
    if (rc != 0)
        return rc < 0 ? -2 : 1;
    if (!in_place || version == Py_None)
        return -1;
    rc = tt_differs(PyObject_GetAttr(tensor, st->str_version), version);
    return rc < 0 ? -2 : rc ? 2 : -1;
}

PyObject *
tt_py_weight_change(PyObject *module, PyObject *args)
{
    TtState *st = (TtState *)PyModule_GetState(module);
    PyObject *weights, *entry; /* borrowed */
    Py_ssize_t i;
    int in_place, kind;

    if (!PyArg_ParseTuple(args, "O!p:weight_change", &PyList_Type, &weights, &in_place))
        return NULL;
    for (i = 0; i < PyList_GET_SIZE(weights); i++) {
        entry = Py_NewRef(PyList_GET_ITEM(weights, i)); /* held: a call below may run Python */
        kind = tt_weight_entry_change(st, entry, in_place);
        Py_DECREF(entry);
        if (kind == -2)
            return NULL;
        if (kind >= 0)
            return Py_BuildValue("(ni)", i, kind);
    }
    Py_RETURN_NONE;
}
