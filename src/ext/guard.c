/*
 * guard.c - what the dispatcher checks before it lets a backend run a call:
 * the lock of an entry whose backend is not thread-safe, the train rule (no
 * backend serves a module while it or a submodule is in train mode), the grad
 * rule (a backend that returns no autograd outputs must not serve a call that
 * autograd would record), both read on the module tree as it is at the call.
 * What a converted model took in at its build is baked.c's to check.
 */
#include "guard.h"

#include <stdint.h>
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

/* A walk's modules, each visited once: a stack of the modules still to visit
 * and a set of those visited (open addressing on the object's address), both
 * holding new references; a few entries in place, more on the heap. */
#define TT_WALK_LOCAL 64

typedef struct {
    PyObject **stack, **seen;
    Py_ssize_t top, room, count, size; /* seen has `size` slots (a power of 2), `count` used */
    PyObject *stack_local[TT_WALK_LOCAL];
    PyObject *seen_local[2 * TT_WALK_LOCAL];
} TtWalk;

static Py_ssize_t
tt_walk_slot(PyObject *const *seen, Py_ssize_t size, PyObject *obj)
{
    Py_ssize_t i = (Py_ssize_t)(((uintptr_t)obj >> 4) & (uintptr_t)(size - 1));

    while (seen[i] != NULL && seen[i] != obj)
        i = (i + 1) & (size - 1);
    return i;
}

/* Marks `obj` (a new reference, taken) visited: 1, or 0 when it was already
 * (the reference is then released), -1 with MemoryError. */
static int
tt_walk_mark(TtWalk *w, PyObject *obj)
{
    Py_ssize_t i;

    if (2 * (w->count + 1) > w->size) { /* at most half full */
        Py_ssize_t size = 2 * w->size, j;
        PyObject **grown = PyMem_Calloc((size_t)size, sizeof(PyObject *));

        if (grown == NULL) {
            Py_DECREF(obj);
            PyErr_NoMemory();
            return -1;
        }
        for (j = 0; j < w->size; j++)
            if (w->seen[j] != NULL)
                grown[tt_walk_slot(grown, size, w->seen[j])] = w->seen[j];
        if (w->seen != w->seen_local)
            PyMem_Free(w->seen);
        w->seen = grown;
        w->size = size;
    }
    i = tt_walk_slot(w->seen, w->size, obj);
    if (w->seen[i] == obj) {
        Py_DECREF(obj);
        return 0;
    }
    w->seen[i] = obj;
    w->count++;
    return 1;
}

/* Pushes `obj` (a new reference, taken). 0, or -1 with MemoryError. */
static int
tt_walk_push(TtWalk *w, PyObject *obj)
{
    if (w->top == w->room) {
        PyObject **grown;

        if (w->stack == w->stack_local) {
            grown = PyMem_New(PyObject *, 2 * w->room);
            if (grown != NULL)
                memcpy(grown, w->stack_local, sizeof(w->stack_local));
        }
        else {
            grown = w->stack;
            PyMem_Resize(grown, PyObject *, 2 * w->room);
        }
        if (grown == NULL) {
            Py_DECREF(obj);
            PyErr_NoMemory();
            return -1;
        }
        w->stack = grown;
        w->room *= 2;
    }
    w->stack[w->top++] = obj;
    return 0;
}

/* Pushes each submodule of `dict`'s module. No Python code runs while its
 * _modules is read. 0, or -1 with an exception. */
static int
tt_walk_children(TtState *st, TtWalk *w, PyObject *dict)
{
    PyObject *children = PyDict_GetItemWithError(dict, st->str_modules); /* borrowed */
    PyObject *key, *child;                                                /* borrowed */
    Py_ssize_t pos = 0;

    if (children == NULL)
        return PyErr_Occurred() ? -1 : 0;
    if (!PyDict_Check(children))
        return 0;
    while (PyDict_Next(children, &pos, &key, &child))
        if (child != Py_None && tt_walk_push(w, Py_NewRef(child)) < 0)
            return -1;
    return 0;
}

int
tt_module_walk(TtState *st, PyObject *module, tt_module_visit visit, void *ctx)
{
    TtWalk w;
    PyObject *at, *dict; /* new references */
    Py_ssize_t i;
    int rc = 0;

    w.stack = w.stack_local;
    w.room = TT_WALK_LOCAL;
    w.top = 0;
    w.seen = w.seen_local;
    w.size = 2 * TT_WALK_LOCAL;
    w.count = 0;
    memset(w.seen_local, 0, sizeof(w.seen_local));
    rc = tt_walk_push(&w, Py_NewRef(module));
    while (w.top > 0 && rc == 0) {
        at = w.stack[--w.top];
        if ((rc = tt_walk_mark(&w, Py_NewRef(at))) <= 0) { /* visited before, or no memory */
            Py_DECREF(at);
            continue;
        }
        rc = 0;
        dict = PyObject_GenericGetDict(at, NULL);
        if (dict == NULL) {
            PyErr_Format(PyExc_TypeError, "torch-tweak: a submodule of a tuned module is a %.100s, "
                         "which is not a module (no __dict__); its train flag cannot be read",
                         Py_TYPE(at)->tp_name);
            rc = -1;
        }
        else if ((rc = visit(st, at, dict, ctx)) == 0) {
            rc = tt_walk_children(st, &w, dict);
        }
        Py_XDECREF(dict);
        Py_DECREF(at);
    }
    while (w.top > 0)
        Py_DECREF(w.stack[--w.top]);
    for (i = 0; i < w.size; i++)
        Py_XDECREF(w.seen[i]);
    if (w.stack != w.stack_local)
        PyMem_Free(w.stack);
    if (w.seen != w.seen_local)
        PyMem_Free(w.seen);
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
