/*
 * dispatcher.c - the Dispatcher type, the base type of
 * torch_tweak.TunedModule. Its vectorcall is the only code that runs between
 * a caller and the chosen backend, so it reads nothing it does not need and
 * allocates nothing itself.
 */
#include "dispatcher.h"

#include "entries.h"
#include "guard.h"

#include <string.h>

/* =========================================================== Dispatcher */

enum { TT_MODE_ORIGINAL = 0, TT_MODE_ACTIVE = 1, TT_MODE_RECORD = 2 };

/* Why a call in active mode ran the original. */
enum { TT_UNTUNED_NO_MATCH = 0, TT_UNTUNED_GRAD = 1, TT_UNTUNED_TRAIN = 2 };
static const char *const tt_untuned_reasons[] = {"no signature matched", "grad mode", "train mode"};

typedef struct {
    PyObject_HEAD
    vectorcallfunc vectorcall;
    TtState *state;      /* of the owning module; outlives the type, so this object */
    PyObject *original;  /* NULL until _tt_bind */
    PyObject *recorder;  /* NULL when none */
    PyObject *entries;   /* the entry table (entries.h) */
    PyObject *module;    /* NULL, or the module whose tree the train and grad rules read */
    PyObject *notify;    /* NULL, or called with a reason on its first untuned call */
    Py_ssize_t last;     /* index of the last matching entry */
    int mode;
    int notified;        /* bit per TT_UNTUNED_* reason already notified */
    unsigned long long calls;
    unsigned long long fallbacks;      /* TT_UNTUNED_NO_MATCH */
    unsigned long long grad_fallbacks; /* TT_UNTUNED_GRAD */
    unsigned long long train_fallbacks; /* TT_UNTUNED_TRAIN */
} TtDispatcher;

/* Counts a call that ran the original for `reason`, and tells notify the
 * first time (after _tt_set_notify or _tt_reset_untuned). -1 when notify
 * raised a BaseException that is not an Exception; an Exception is reported
 * as unraisable, so logging never fails a call. */
static int
tt_dispatcher_untuned(TtDispatcher *self, int reason)
{
    PyObject *notify = NULL; /* new reference */
    PyObject *text = NULL;   /* new reference */
    PyObject *done = NULL;   /* new reference */
    int rc = 0;

    if (reason == TT_UNTUNED_GRAD)
        self->grad_fallbacks++;
    else if (reason == TT_UNTUNED_TRAIN)
        self->train_fallbacks++;
    else
        self->fallbacks++;
    if (TT_LIKELY(self->notify == NULL || (self->notified & (1 << reason))))
        goto cleanup;
    self->notified |= 1 << reason;
    notify = Py_NewRef(self->notify);
    if ((text = PyUnicode_FromString(tt_untuned_reasons[reason])) != NULL)
        done = PyObject_CallOneArg(notify, text);
    if (done == NULL) {
        if (PyErr_ExceptionMatches(PyExc_Exception))
            PyErr_WriteUnraisable(notify);
        else
            rc = -1;
    }
cleanup:
    Py_XDECREF(notify);
    Py_XDECREF(text);
    Py_XDECREF(done);
    return rc;
}

/* 1 when the module or a submodule is in train mode (tt_in_train_mode), 0 when
 * none is, -1 on an error. */
static int
tt_dispatcher_training(TtDispatcher *self)
{
    PyObject *module = Py_NewRef(self->module); /* held: the walk may run Python */
    int rc = tt_in_train_mode(self->state, module);

    Py_DECREF(module);
    return rc;
}

/* The rules of the flags of the entry that took a call: a backend whose outputs
 * carry no autograd history leaves a call that needs grad to the original
 * (counted; *found becomes -2), and a backend that is not thread-safe takes
 * its entry's lock (*lock, released by the caller). -1 on an error. */
static int
tt_dispatcher_flags(TtDispatcher *self, const TtHit *hit, int *found, TtEntryLock **lock)
{
    PyObject *module = NULL; /* new reference */
    TtEntryLock *l;
    int grad, rc = -1;

    if (hit->flags & TT_ENTRY_NO_AUTOGRAD) {
        module = Py_XNewRef(self->module); /* held while read */
        grad = tt_needs_grad(self->state, module, hit->args, hit->n);
        if (grad < 0)
            goto cleanup;
        if (grad) {
            if (tt_dispatcher_untuned(self, TT_UNTUNED_GRAD) < 0)
                goto cleanup;
            *found = -2; /* the original runs, so the outputs keep autograd */
        }
    }
    if (*found == 1 && hit->lock != NULL) {
        l = tt_entry_lock_get(hit->lock);
        if (l == NULL || tt_entry_lock_acquire(l) < 0)
            goto cleanup;
        *lock = l;
    }
    rc = 0;
cleanup:
    Py_XDECREF(module);
    return rc;
}

/* The target of a call in active mode (borrowed, kept alive by *entries or
 * self): the backend of the entry that takes the call, with the call bound to
 * its recorded layout (*args, *nargsf, *kwnames, in *stack), or the original,
 * counted by why. *entries holds the entry table from its walk until the call
 * returns; *lock is the entry's lock when it takes one. 0, or -1 on an error. */
static TT_INLINE int
tt_dispatcher_choose(TtDispatcher *self, PyObject *const **args, size_t *nargsf,
                     PyObject **kwnames, TtStack *stack, PyObject **entries,
                     TtEntryLock **lock, PyObject **target)
{
    TtHit hit = {0}; /* filled by a match; zeroed for the compiler, which cannot tell */
    int found = 0, training, rc = -1;

    *target = self->original;
    if (TT_UNLIKELY(self->module != NULL)) {
        /* every backend was built and checked in eval mode: a module in train mode
         * (dropout, batch norm's statistics) runs the original */
        training = tt_dispatcher_training(self);
        if (training < 0)
            goto cleanup;
        if (TT_UNLIKELY(training)) {
            rc = tt_dispatcher_untuned(self, TT_UNTUNED_TRAIN);
            goto cleanup;
        }
    }
    if (TT_LIKELY(self->entries != NULL)) { /* NULL: cleared by the GC, called by a finalizer */
        *entries = Py_NewRef(self->entries);
        found = tt_entries_find(*entries, &self->last, *args, *nargsf, *kwnames, stack, &hit);
    }
    if (TT_UNLIKELY(found < 0))
        goto cleanup;
    if (TT_UNLIKELY(found == 1 && hit.backend == Py_None))
        found = 0; /* a signature kept on the original: counted as unmatched */
    if (TT_UNLIKELY(found && hit.flags != 0) && tt_dispatcher_flags(self, &hit, &found, lock) < 0)
        goto cleanup;
    if (TT_UNLIKELY(found == 0) && tt_dispatcher_untuned(self, TT_UNTUNED_NO_MATCH) < 0)
        goto cleanup;
    if (TT_LIKELY(found == 1)) {
        *target = hit.backend;
        *args = hit.args;
        *nargsf = hit.nargsf;
        *kwnames = hit.kwnames;
    }
    rc = 0;
cleanup:
    return rc;
}

static PyObject *
tt_dispatcher_vectorcall(PyObject *callable, PyObject *const *args, size_t nargsf,
                         PyObject *kwnames)
{
    TtDispatcher *self = (TtDispatcher *)callable;
    PyObject *entries = NULL; /* held while walking and calling, see TtDispatcher.entries */
    PyObject *target = NULL;  /* borrowed; held while it runs */
    PyObject *result = NULL;
    TtEntryLock *lock = NULL; /* held: released at cleanup */
    TtStack stack;

    stack.heap = NULL;
    stack.room = 0;
    self->calls++;
    if (TT_LIKELY(self->mode == TT_MODE_ACTIVE)) {
        if (tt_dispatcher_choose(self, &args, &nargsf, &kwnames, &stack, &entries, &lock,
                                 &target) < 0)
            goto cleanup;
    }
    else {
        target = self->mode == TT_MODE_RECORD ? self->recorder : self->original;
    }
    if (TT_UNLIKELY(target == NULL)) {
        PyErr_SetString(PyExc_RuntimeError,
                        self->mode == TT_MODE_RECORD
                            ? "Dispatcher in record mode has no recorder (_tt_set_recorder)"
                            : "Dispatcher has no original module (_tt_bind)");
        goto cleanup;
    }
    /* a chain of callables that leads back here (a backend that calls this
     * module) is a RecursionError, never an overflow of the C stack */
    if (TT_UNLIKELY(Py_EnterRecursiveCall(" in a tuned module's dispatcher")))
        goto cleanup;
    Py_INCREF(target);
    result = PyObject_Vectorcall(target, args, nargsf, kwnames);
    Py_DECREF(target);
    Py_LeaveRecursiveCall();
cleanup:
    if (TT_UNLIKELY(lock != NULL))
        tt_entry_lock_release(lock);
    if (TT_UNLIKELY(stack.heap != NULL))
        PyMem_Free(stack.heap);
    Py_XDECREF(entries);
    return result;
}

static PyObject *
tt_dispatcher_new(PyTypeObject *type, PyObject *args, PyObject *kwargs)
{
    TtDispatcher *self;

    (void)args;
    (void)kwargs; /* they are the subclass's __init__'s */
    self = (TtDispatcher *)type->tp_alloc(type, 0);
    if (self == NULL)
        goto error;
    if ((self->state = tt_state_from_type(type)) == NULL)
        goto error;
    self->vectorcall = tt_dispatcher_vectorcall;
    if ((self->entries = PyTuple_New(0)) == NULL)
        goto error;
    self->mode = TT_MODE_ORIGINAL;
    return (PyObject *)self;
error:
    Py_XDECREF(self);
    return NULL;
}

static int
tt_dispatcher_traverse(TtDispatcher *self, visitproc visit, void *arg)
{
    Py_VISIT(Py_TYPE(self));
    Py_VISIT(self->original);
    Py_VISIT(self->recorder);
    Py_VISIT(self->entries);
    Py_VISIT(self->module);
    Py_VISIT(self->notify);
    return 0;
}

static int
tt_dispatcher_clear(TtDispatcher *self)
{
    Py_CLEAR(self->original);
    Py_CLEAR(self->recorder);
    Py_CLEAR(self->entries);
    Py_CLEAR(self->module);
    Py_CLEAR(self->notify);
    /* a call after clear (from a finalizer) falls back and finds no original */
    self->mode = TT_MODE_ORIGINAL;
    return 0;
}

static void
tt_dispatcher_dealloc(TtDispatcher *self)
{
    PyTypeObject *tp = Py_TYPE(self);

    PyObject_GC_UnTrack(self);
    tt_dispatcher_clear(self);
    tp->tp_free((PyObject *)self);
    Py_DECREF(tp);
}

/* One link of the walk below: 1 when `o` is `self`; else queues `o` when it
 * is a Dispatcher not queued before; 0, or -1 on error. */
static int
tt_dispatcher_visit(TtDispatcher *self, PyObject *o, PyObject *todo, PyObject *seen)
{
    PyObject *key = NULL; /* new reference */
    int rc = -1, known;

    if (o == (PyObject *)self) {
        rc = 1;
        goto cleanup;
    }
    if (o == NULL || !PyObject_TypeCheck(o, self->state->DispatcherType)) {
        rc = 0;
        goto cleanup;
    }
    if ((key = PyLong_FromVoidPtr(o)) == NULL || (known = PySet_Contains(seen, key)) < 0)
        goto cleanup;
    if (!known && (PySet_Add(seen, key) < 0 || PyList_Append(todo, o) < 0))
        goto cleanup;
    rc = 0;
cleanup:
    Py_XDECREF(key);
    return rc;
}

/* 1 when a call of `start` may call `self` again through Dispatchers alone
 * (an original, a recorder or an entry's backend that is a Dispatcher, whose
 * own original... is this one), 0 when not, -1 on error. Reads only the
 * objects' fields and entry tuples: no Python code runs while it walks. */
static int
tt_dispatcher_reaches(TtDispatcher *self, PyObject *start)
{
    PyObject *todo = NULL; /* new reference: Dispatchers still to read */
    PyObject *seen = NULL; /* new reference: the addresses of those ever queued */
    TtDispatcher *d;       /* held while read: a reference taken from todo */
    Py_ssize_t n, i;
    int rc = -1;

    if ((todo = PyList_New(0)) == NULL || (seen = PySet_New(NULL)) == NULL)
        goto cleanup;
    rc = tt_dispatcher_visit(self, start, todo, seen);
    while (rc == 0 && (n = PyList_GET_SIZE(todo)) > 0) {
        d = (TtDispatcher *)Py_NewRef(PyList_GET_ITEM(todo, n - 1));
        rc = PyList_SetSlice(todo, n - 1, n, NULL);
        if (rc == 0)
            rc = tt_dispatcher_visit(self, d->original, todo, seen);
        if (rc == 0)
            rc = tt_dispatcher_visit(self, d->recorder, todo, seen);
        for (i = 0; rc == 0 && d->entries != NULL && i < PyTuple_GET_SIZE(d->entries); i++)
            rc = tt_dispatcher_visit(self, PyTuple_GET_ITEM(PyTuple_GET_ITEM(d->entries, i), 1),
                                     todo, seen);
        Py_DECREF(d);
    }
cleanup:
    Py_XDECREF(todo);
    Py_XDECREF(seen);
    return rc;
}

/* -1 with ValueError when calling `target` from this dispatcher (as its
 * `what`) could call it again without end; 0 when it cannot. */
static int
tt_dispatcher_refuse_cycle(TtDispatcher *self, PyObject *target, const char *what)
{
    int reaches = tt_dispatcher_reaches(self, target);

    if (reaches > 0)
        PyErr_Format(PyExc_ValueError,
                     "%s: the %s %s this Dispatcher%s, so a call of it would never end; "
                     "a Dispatcher may not call itself", what,
                     strcmp(what, "_tt_set_entries") == 0 ? "backend" : "callable",
                     target == (PyObject *)self ? "is" : "leads back to",
                     target == (PyObject *)self ? "" : " through other Dispatchers");
    return reaches != 0 ? -1 : 0;
}

static PyObject *
tt_dispatcher_bind(TtDispatcher *self, PyObject *original)
{
    if (!PyCallable_Check(original)) {
        PyErr_Format(PyExc_TypeError, "_tt_bind: the original must be callable, not %.100s",
                     Py_TYPE(original)->tp_name);
        return NULL;
    }
    if (tt_dispatcher_refuse_cycle(self, original, "_tt_bind") < 0)
        return NULL;
    Py_INCREF(original);
    Py_XSETREF(self->original, original);
    Py_RETURN_NONE;
}

static PyObject *
tt_dispatcher_set_recorder(TtDispatcher *self, PyObject *recorder)
{
    if (recorder != Py_None && !PyCallable_Check(recorder)) {
        PyErr_Format(PyExc_TypeError,
                     "_tt_set_recorder: the recorder must be callable or None, not %.100s",
                     Py_TYPE(recorder)->tp_name);
        return NULL;
    }
    if (recorder != Py_None && tt_dispatcher_refuse_cycle(self, recorder, "_tt_set_recorder") < 0)
        return NULL;
    if (recorder == Py_None) {
        Py_CLEAR(self->recorder);
    }
    else {
        Py_INCREF(recorder);
        Py_XSETREF(self->recorder, recorder);
    }
    Py_RETURN_NONE;
}

static PyObject *
tt_dispatcher_set_entries(TtDispatcher *self, PyObject *arg)
{
    TtState *st = tt_state_from_type(Py_TYPE(self)); /* borrowed */
    PyObject *entries;                               /* new reference */

    Py_ssize_t i;

    if (st == NULL || (entries = tt_entries_new(st, arg)) == NULL)
        return NULL;
    for (i = 0; i < PyTuple_GET_SIZE(entries); i++) {
        if (tt_dispatcher_refuse_cycle(self, PyTuple_GET_ITEM(PyTuple_GET_ITEM(entries, i), 1),
                                       "_tt_set_entries") < 0) {
            Py_DECREF(entries);
            return NULL;
        }
    }
    Py_XSETREF(self->entries, entries);
    self->last = 0;
    Py_RETURN_NONE;
}

/* The module the rules read (NULL for None: no rule is read). */
static PyObject *
tt_dispatcher_set_module(TtDispatcher *self, PyObject *module)
{
    Py_XSETREF(self->module, module == Py_None ? NULL : Py_NewRef(module));
    Py_RETURN_NONE;
}

static PyObject *
tt_dispatcher_set_notify(TtDispatcher *self, PyObject *notify)
{
    if (notify != Py_None && !PyCallable_Check(notify)) {
        PyErr_Format(PyExc_TypeError, "_tt_set_notify: a callable or None, not %.100s",
                     Py_TYPE(notify)->tp_name);
        return NULL;
    }
    Py_XSETREF(self->notify, notify == Py_None ? NULL : Py_NewRef(notify));
    self->notified = 0;
    Py_RETURN_NONE;
}

static PyObject *
tt_dispatcher_reset_untuned(TtDispatcher *self, PyObject *unused)
{
    (void)unused;
    self->fallbacks = 0;
    self->grad_fallbacks = 0;
    self->train_fallbacks = 0;
    self->notified = 0;
    Py_RETURN_NONE;
}

static PyObject *
tt_dispatcher_get_mode(TtDispatcher *self, void *closure)
{
    (void)closure;
    return PyLong_FromLong(self->mode);
}

static int
tt_dispatcher_set_mode(TtDispatcher *self, PyObject *value, void *closure)
{
    long mode;

    (void)closure;
    if (value == NULL) {
        PyErr_SetString(PyExc_AttributeError, "_tt_mode cannot be deleted");
        return -1;
    }
    mode = PyLong_AsLong(value);
    if (mode == -1 && PyErr_Occurred())
        return -1;
    if (mode < TT_MODE_ORIGINAL || mode > TT_MODE_RECORD) {
        PyErr_Format(PyExc_ValueError,
                     "_tt_mode must be 0 (original), 1 (active) or 2 (record), not %ld", mode);
        return -1;
    }
    self->mode = (int)mode;
    return 0;
}

static PyObject *
tt_dispatcher_get_entries(TtDispatcher *self, void *closure)
{
    (void)closure;
    return tt_entries_pairs(self->entries);
}

static PyObject *
tt_dispatcher_get_entry_flags(TtDispatcher *self, void *closure)
{
    (void)closure;
    return tt_entries_flags(self->entries);
}

static PyGetSetDef tt_dispatcher_getset[] = {
    {"_tt_mode", (getter)tt_dispatcher_get_mode, (setter)tt_dispatcher_set_mode,
     "0 original, 1 active (backends by signature), 2 record.", NULL},
    {"_tt_original", tt_get_object_or_none, NULL,
     "The original module (None before _tt_bind); read-only.",
     TT_FIELD(TtDispatcher, original)},
    {"_tt_entries", (getter)tt_dispatcher_get_entries, NULL,
     "A list of (signature or None, backend), as set.", NULL},
    {"_tt_entry_flags", (getter)tt_dispatcher_get_entry_flags, NULL,
     "A list of each entry's ENTRY_* flags (0 for none), as set.", NULL},
    {"_tt_calls", tt_get_counter, NULL, "Calls of this dispatcher, in every mode.",
     TT_FIELD(TtDispatcher, calls)},
    {"_tt_fallbacks", tt_get_counter, NULL,
     "Calls in active mode that no entry matched, so the original ran.",
     TT_FIELD(TtDispatcher, fallbacks)},
    {"_tt_grad_fallbacks", tt_get_counter, NULL,
     "Calls in active mode that matched an entry without autograd while autograd\n"
     "would record the call (see ENTRY_NO_AUTOGRAD), so the original ran.",
     TT_FIELD(TtDispatcher, grad_fallbacks)},
    {"_tt_train_fallbacks", tt_get_counter, NULL,
     "Calls in active mode while the module or a submodule (_tt_set_module) was in\n"
     "train mode, so the original ran.",
     TT_FIELD(TtDispatcher, train_fallbacks)},
    {NULL, NULL, NULL, NULL, NULL}};

static PyMethodDef tt_dispatcher_methods[] = {
    {"_tt_bind", (PyCFunction)tt_dispatcher_bind, METH_O,
     "_tt_bind(original): the callable for mode 0 and for fallbacks."},
    {"_tt_set_entries", (PyCFunction)tt_dispatcher_set_entries, METH_O,
     "_tt_set_entries([(signature or None, backend[, flags]), ...]); flags: ENTRY_* bits."},
    {"_tt_set_notify", (PyCFunction)tt_dispatcher_set_notify, METH_O,
     "_tt_set_notify(callable or None): called with the reason of the first untuned\n"
     "call per reason (\"no signature matched\", \"grad mode\", \"train mode\") from now on."},
    {"_tt_set_module", (PyCFunction)tt_dispatcher_set_module, METH_O,
     "_tt_set_module(module or None): the module whose tree, as it is at each call, the\n"
     "rules read: in active mode a call while it or a submodule is in train mode runs\n"
     "the original (_tt_train_fallbacks), and so does a call of an ENTRY_NO_AUTOGRAD\n"
     "entry in grad mode while one of their parameters requires grad."},
    {"_tt_reset_untuned", (PyCFunction)tt_dispatcher_reset_untuned, METH_NOARGS,
     "_tt_reset_untuned(): the untuned counters to 0, every reason notified again."},
    {"_tt_set_recorder", (PyCFunction)tt_dispatcher_set_recorder, METH_O,
     "_tt_set_recorder(recorder or None): the callable for mode 2."},
    {NULL, NULL, 0, NULL}};

static PyMemberDef tt_dispatcher_members[] = {
    {"__vectorcalloffset__", Py_T_PYSSIZET, offsetof(TtDispatcher, vectorcall), Py_READONLY,
     NULL},
    {NULL, 0, 0, 0, NULL}};

static PyType_Slot tt_dispatcher_slots[] = {
    {Py_tp_doc, "Base type of torch_tweak.TunedModule: its __call__ is the per-call path\n"
                "of a tuned module (vectorcall). Mode 0 calls the original, mode 1 the\n"
                "backend of the first entry whose signature fits (None fits every call)\n"
                "with the call laid out as that signature was recorded, or else the\n"
                "original (counted in _tt_fallbacks; also when that entry's backend is\n"
                "None), mode 2 the recorder. An entry's\n"
                "flags: ENTRY_SERIALIZE (one call at a time), ENTRY_NO_AUTOGRAD (the\n"
                "original runs when autograd would record the call; _tt_grad_fallbacks),\n"
                "ENTRY_LAYOUT_ONLY (bind the layout, the backend checks the values).\n"
                "A call in mode 1 while the _tt_set_module tree is in train mode runs\n"
                "the original (_tt_train_fallbacks)."},
    {Py_tp_new, tt_dispatcher_new},
    {Py_tp_dealloc, tt_dispatcher_dealloc},
    {Py_tp_traverse, tt_dispatcher_traverse},
    {Py_tp_clear, tt_dispatcher_clear},
    {Py_tp_call, PyVectorcall_Call},
    {Py_tp_methods, tt_dispatcher_methods},
    {Py_tp_getset, tt_dispatcher_getset},
    {Py_tp_members, tt_dispatcher_members},
    {0, NULL}};

static PyType_Spec tt_dispatcher_spec = {
    .name = "torch_tweak._C.Dispatcher",
    .basicsize = sizeof(TtDispatcher),
    .flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_BASETYPE | Py_TPFLAGS_HAVE_GC |
             Py_TPFLAGS_HAVE_VECTORCALL,
    .slots = tt_dispatcher_slots,
};

/* ============================================================== module */

PyObject *
tt_py_enable_vectorcall(PyObject *module, PyObject *cls)
{
    TtState *st = (TtState *)PyModule_GetState(module);
    PyTypeObject *tp, *base;

    if (!PyType_Check(cls) ||
        !PyType_IsSubtype((PyTypeObject *)cls, st->DispatcherType)) {
        PyErr_SetString(PyExc_TypeError, "enable_vectorcall: cls must be a subclass of Dispatcher");
        return NULL;
    }
    tp = (PyTypeObject *)cls;
    base = st->DispatcherType;
    if (tp->tp_flags & Py_TPFLAGS_HAVE_VECTORCALL)
        Py_RETURN_TRUE;
    /* Only when cls's __call__ is still ours: a subclass that overrides
     * __call__ must go through it. */
    if (tp->tp_call != base->tp_call || tp->tp_vectorcall_offset != base->tp_vectorcall_offset)
        Py_RETURN_FALSE;
    tp->tp_flags |= Py_TPFLAGS_HAVE_VECTORCALL;
    Py_RETURN_TRUE;
}

int
tt_dispatcher_exec(PyObject *module, TtState *st)
{
    int rc = -1;

    st->DispatcherType =
        (PyTypeObject *)PyType_FromModuleAndSpec(module, &tt_dispatcher_spec, NULL);
    if (st->DispatcherType == NULL)
        goto error;
    if (PyModule_AddObjectRef(module, "Dispatcher", (PyObject *)st->DispatcherType) < 0)
        goto error;
    if (PyModule_AddIntConstant(module, "ENTRY_SERIALIZE", TT_ENTRY_SERIALIZE) < 0 ||
        PyModule_AddIntConstant(module, "ENTRY_NO_AUTOGRAD", TT_ENTRY_NO_AUTOGRAD) < 0 ||
        PyModule_AddIntConstant(module, "ENTRY_LAYOUT_ONLY", TT_ENTRY_LAYOUT_ONLY) < 0 ||
        PyModule_AddIntConstant(module, "MODE_ORIGINAL", TT_MODE_ORIGINAL) < 0 ||
        PyModule_AddIntConstant(module, "MODE_ACTIVE", TT_MODE_ACTIVE) < 0 ||
        PyModule_AddIntConstant(module, "MODE_RECORD", TT_MODE_RECORD) < 0)
        goto error;
    rc = 0;
error:
    return rc;
}
