/*
 * guard.c - what the dispatcher checks before it lets a backend run a call:
 * the lock of an entry whose backend is not thread-safe, the train rule (no
 * backend serves a module while it or a submodule is in train mode), the grad
 * rule (a backend that returns no autograd outputs must not serve a call that
 * autograd would record), both read on the module tree as it is at the call,
 * and the weights check of a converted model (weight_change).
 */
#include "guard.h"

#include <string.h>

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

/* The walk's stack: a few entries on the C stack, more on the heap. */
#define TT_WALK_LOCAL 64
#define TT_WALK_MOST (1 << 20)

/* Room for one more entry in *stack (which is `local` or from the heap). 0, or -1
 * with MemoryError. */
static int
tt_walk_room(PyObject ***stack, PyObject **local, Py_ssize_t *room)
{
    PyObject **grown;
    Py_ssize_t more = *room * 2;

    if (*stack == local) {
        grown = PyMem_New(PyObject *, more);
        if (grown != NULL)
            memcpy(grown, local, sizeof(PyObject *) * (size_t)*room);
    }
    else {
        grown = *stack;
        PyMem_Resize(grown, PyObject *, more);
    }
    if (grown == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    *stack = grown;
    *room = more;
    return 0;
}

/* Pushes a new reference to each submodule of `dict`'s module. No Python code
 * runs while its _modules is read. 0, or -1 with an exception. */
static int
tt_walk_push(TtState *st, PyObject *dict, PyObject ***stack, PyObject **local, Py_ssize_t *top,
             Py_ssize_t *room)
{
    PyObject *children = PyDict_GetItemWithError(dict, st->str_modules); /* borrowed */
    PyObject *key, *child;                                                /* borrowed */
    Py_ssize_t pos = 0;

    if (children == NULL)
        return PyErr_Occurred() ? -1 : 0;
    if (!PyDict_Check(children))
        return 0;
    while (PyDict_Next(children, &pos, &key, &child)) {
        if (child == Py_None)
            continue;
        if (*top == *room && tt_walk_room(stack, local, room) < 0)
            return -1;
        (*stack)[(*top)++] = Py_NewRef(child);
    }
    return 0;
}

int
tt_module_walk(TtState *st, PyObject *module, tt_module_visit visit, void *ctx)
{
    PyObject *local[TT_WALK_LOCAL];
    PyObject **stack = local;
    PyObject *at, *dict; /* new references */
    Py_ssize_t top = 0, room = TT_WALK_LOCAL, visits = 0;
    int rc = 0;

    stack[top++] = Py_NewRef(module);
    while (top > 0 && rc == 0) {
        at = stack[--top];
        dict = NULL;
        if (++visits > TT_WALK_MOST) {
            PyErr_SetString(PyExc_RecursionError, "a tuned module's submodules were walked 2**20 "
                                                  "times: its module tree contains itself");
            rc = -1;
        }
        else if ((dict = PyObject_GenericGetDict(at, NULL)) == NULL) {
            rc = -1;
        }
        else if ((rc = visit(st, at, dict, ctx)) == 0) {
            rc = tt_walk_push(st, dict, &stack, local, &top, &room);
        }
        Py_XDECREF(dict);
        Py_DECREF(at);
    }
    while (top > 0)
        Py_DECREF(stack[--top]);
    if (stack != local)
        PyMem_Free(stack);
    return rc;
}

static int
tt_visit_training(TtState *st, PyObject *module, PyObject *dict, void *ctx)
{
    PyObject *flag = PyDict_GetItemWithError(dict, st->str_training); /* borrowed */
    int rc;

    (void)ctx;
    if (TT_LIKELY(flag == Py_False))
        return 0;
    if (flag == Py_True)
        return 1;
    if (flag == NULL) {
        if (PyErr_Occurred())
            return -1;
        flag = PyObject_GetAttr(module, st->str_training); /* a property, or the class's */
        if (flag == NULL)
            return -1;
    }
    else {
        Py_INCREF(flag);
    }
    rc = PyObject_IsTrue(flag);
    Py_DECREF(flag);
    return rc;
}

int
tt_in_train_mode(TtState *st, PyObject *module)
{
    return tt_module_walk(st, module, tt_visit_training, NULL);
}

static int
tt_visit_params(TtState *st, PyObject *module, PyObject *dict, void *ctx)
{
    PyObject *params = PyDict_GetItemWithError(dict, st->str_parameters); /* borrowed */
    PyObject *key, *value;                                                 /* borrowed */
    Py_ssize_t pos = 0;
    int rc = 0;

    (void)module;
    if (params == NULL)
        return PyErr_Occurred() ? -1 : 0;
    if (!PyDict_Check(params))
        return 0;
    Py_INCREF(params);
    while (rc == 0 && PyDict_Next(params, &pos, &key, &value)) {
        Py_INCREF(value);
        if (value != Py_None)
            rc = tt_requires_grad(st, (PyTypeObject *)ctx, value, 1);
        Py_DECREF(value);
    }
    Py_DECREF(params);
    return rc;
}

int
tt_needs_grad(TtState *st, PyObject *module, PyObject *const *args, Py_ssize_t n)
{
    PyTypeObject *tensor_type = tt_state_tensor_type(st); /* borrowed */
    PyObject *torch = NULL;   /* new reference */
    PyObject *on = NULL;      /* new reference */
    Py_ssize_t i;
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
    if (rc == 0 && module != NULL)
        rc = tt_module_walk(st, module, tt_visit_params, tensor_type);
cleanup:
    Py_XDECREF(torch);
    Py_XDECREF(on);
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

/* 1 when `live` no longer holds what `saved` holds (a key's value is another
 * object, or a key is gone; with exact, also a key added), 0 when it does, -1
 * on error. */
static int
tt_dict_differs(PyObject *live, PyObject *saved, int exact)
{
    PyObject *key, *value, *now; /* borrowed */
    Py_ssize_t pos = 0;
    int rc = 0;

    if (exact && PyDict_GET_SIZE(live) != PyDict_GET_SIZE(saved))
        return 1;
    Py_INCREF(saved); /* held: a key's __eq__ may run Python */
    while (rc == 0 && PyDict_Next(saved, &pos, &key, &value)) {
        now = PyDict_GetItemWithError(live, key);
        if (now == NULL && PyErr_Occurred())
            rc = -1;
        else if (now != value)
            rc = 1;
    }
    Py_DECREF(saved);
    return rc;
}

PyObject *
tt_py_dict_change(PyObject *module, PyObject *pairs)
{
    PyObject *pair; /* new reference */
    Py_ssize_t i;
    int rc = 0;

    (void)module;
    if (!PyList_Check(pairs)) {
        PyErr_SetString(PyExc_TypeError, "dict_change: a list of (live dict, saved dict, exact)");
        return NULL;
    }
    for (i = 0; i < PyList_GET_SIZE(pairs) && rc == 0; i++) {
        pair = Py_NewRef(PyList_GET_ITEM(pairs, i));
        if (!PyTuple_Check(pair) || PyTuple_GET_SIZE(pair) != 3 ||
            !PyDict_Check(PyTuple_GET_ITEM(pair, 0)) || !PyDict_Check(PyTuple_GET_ITEM(pair, 1))) {
            PyErr_SetString(PyExc_TypeError, "dict_change: each entry must be a tuple (live dict, "
                                             "saved dict, exact)");
            rc = -1;
        }
        else if ((rc = PyObject_IsTrue(PyTuple_GET_ITEM(pair, 2))) >= 0) {
            rc = tt_dict_differs(PyTuple_GET_ITEM(pair, 0), PyTuple_GET_ITEM(pair, 1), rc);
        }
        Py_DECREF(pair);
    }
    if (rc < 0)
        return NULL;
    if (rc > 0)
        return PyLong_FromSsize_t(i - 1);
    Py_RETURN_NONE;
}
