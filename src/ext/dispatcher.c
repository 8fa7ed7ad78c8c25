/*
 * dispatcher.c - the Dispatcher type, the base type of
 * torch_tweak.TunedModule. Its vectorcall is the only code that runs between
 * a caller and the chosen backend, so it reads nothing it does not need and
 * allocates nothing itself.
 */
#include "dispatcher.h"

#include "signature.h"

#include <string.h>

/* =========================================================== Dispatcher */

enum { TT_MODE_ORIGINAL = 0, TT_MODE_ACTIVE = 1, TT_MODE_RECORD = 2 };

/* Per entry, what its backend cannot do (_tt_set_entries' flags). */
enum {
    TT_ENTRY_SERIALIZE = 1,   /* not thread-safe: one call at a time, under the entry's lock */
    TT_ENTRY_NO_AUTOGRAD = 2, /* outputs carry no autograd history */
    TT_ENTRY_LAYOUT_ONLY = 4  /* the backend checks the values itself: only bind the layout */
};

/* Why a call in active mode ran the original. */
enum { TT_UNTUNED_NO_MATCH = 0, TT_UNTUNED_GRAD = 1 };
static const char *const tt_untuned_reasons[] = {"no signature matched", "grad mode"};

/* The lock of a serialised entry, in a capsule of the entries tuple: a call
 * that holds the tuple holds the lock object. Re-entrant for the thread that
 * holds it (a backend that calls its own module again must not deadlock);
 * owner and depth are read and written with the GIL held. */
typedef struct TtEntryLock {
    PyThread_type_lock lock;
    unsigned long owner;
    long depth;
} TtEntryLock;

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

/* A capsule of a new lock. New reference. */
static PyObject *
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

/* Takes the lock; 0, or -1 with an exception (a signal while waiting). The
 * holder may need the GIL to finish, so the wait happens without it, in
 * slices, so that Ctrl-C still reaches the main thread. */
static int
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

static void
tt_entry_lock_release(TtEntryLock *l)
{
    if (--l->depth == 0) {
        l->owner = 0;
        PyThread_release_lock(l->lock);
    }
}

typedef struct {
    PyObject_HEAD
    vectorcallfunc vectorcall;
    TtState *state;      /* of the owning module; outlives the type, so this object */
    PyObject *original;  /* NULL until _tt_bind */
    PyObject *recorder;  /* NULL when none */
    /* A tuple of (signature or None, backend, cacheable, flags, lock or None)
     * tuples. cacheable: no earlier entry can match a call this one matches,
     * so trying it first keeps first-match semantics. flags: TT_ENTRY_*, an
     * int, None for 0 (one compare on the hot path); lock: a capsule of a TtEntryLock for TT_ENTRY_SERIALIZE. Replaced
     * whole, never mutated: a call holds a reference while it walks, so a
     * backend may set new entries. */
    PyObject *entries;
    PyObject *params;    /* NULL, or a tuple of the module's parameter dicts */
    PyObject *notify;    /* NULL, or called with a reason on its first untuned call */
    Py_ssize_t last;     /* index of the last matching entry */
    int mode;
    int notified;        /* bit per TT_UNTUNED_* reason already notified */
    unsigned long long calls;
    unsigned long long fallbacks;      /* TT_UNTUNED_NO_MATCH */
    unsigned long long grad_fallbacks; /* TT_UNTUNED_GRAD */
} TtDispatcher;

/* The entry a call goes to: its backend (borrowed from the entries the caller
 * holds) and the call laid out for it. */
typedef struct TtHit {
    PyObject *backend;
    PyObject *const *args;
    size_t nargsf;
    PyObject *kwnames;
    Py_ssize_t n;        /* arguments in args */
    long flags;
    PyObject *lock;      /* the capsule, or NULL */
} TtHit;

/* 1 when `entry` takes the call, filling *hit; 0 when not; -1 on error. */
static TT_INLINE int
tt_entry_take(PyObject *entry, PyObject *const *args, size_t nargsf, PyObject *kwnames,
              TtStack *stack, TtHit *hit)
{
    PyObject *sig = PyTuple_GET_ITEM(entry, 0);   /* borrowed */
    PyObject *flag = PyTuple_GET_ITEM(entry, 3);  /* borrowed: None for no flags */
    PyObject *const *bound = args;
    long flags = TT_LIKELY(flag == Py_None) ? 0 : PyLong_AsLong(flag);
    int rc = 1;

    if (sig != Py_None) {
        rc = tt_signature_bind((TtSignature *)sig, args, PyVectorcall_NARGS(nargsf), kwnames,
                               stack, &bound);
        if (TT_LIKELY(rc == 1) && !(flags & TT_ENTRY_LAYOUT_ONLY))
            rc = tt_signature_match_bound((TtSignature *)sig, bound);
        if (rc != 1)
            goto cleanup;
    }
    hit->backend = PyTuple_GET_ITEM(entry, 1);
    hit->flags = flags;
    hit->lock = TT_LIKELY(flags == 0) ? NULL : PyTuple_GET_ITEM(entry, 4);
    if (hit->lock == Py_None)
        hit->lock = NULL;
    if (TT_LIKELY(bound == args)) {
        /* the caller's args, offset flag included, go through untouched */
        hit->args = args;
        hit->nargsf = nargsf;
        hit->kwnames = kwnames;
        hit->n = PyVectorcall_NARGS(nargsf) + (kwnames != NULL ? PyTuple_GET_SIZE(kwnames) : 0);
    }
    else {
        hit->args = bound;
        hit->nargsf = (size_t)((TtSignature *)sig)->nargs | PY_VECTORCALL_ARGUMENTS_OFFSET;
        hit->kwnames = PyTuple_GET_SIZE(((TtSignature *)sig)->kwnames) > 0
                           ? ((TtSignature *)sig)->kwnames : NULL;
        hit->n = ((TtSignature *)sig)->nspecs;
    }
cleanup:
    return rc;
}

/* 1 and *hit when an entry fits; 0 when none does; -1 on error. */
static int
tt_dispatcher_find(TtDispatcher *self, PyObject *entries, PyObject *const *args,
                   size_t nargsf, PyObject *kwnames, TtStack *stack, TtHit *hit)
{
    Py_ssize_t n = PyTuple_GET_SIZE(entries);
    Py_ssize_t tried = self->last, i;
    PyObject *entry; /* borrowed */
    int rc = 0;

    if (TT_LIKELY(tried < n)) {
        entry = PyTuple_GET_ITEM(entries, tried);
        if (PyTuple_GET_ITEM(entry, 2) == Py_True) {
            rc = tt_entry_take(entry, args, nargsf, kwnames, stack, hit);
            if (TT_LIKELY(rc != 0))
                goto cleanup;
        }
        else {
            tried = -1;
        }
    }
    for (i = 0; i < n; i++) {
        if (i == tried)
            continue;
        rc = tt_entry_take(PyTuple_GET_ITEM(entries, i), args, nargsf, kwnames, stack, hit);
        if (rc == 1)
            self->last = i;
        if (rc != 0)
            goto cleanup;
    }
    rc = 0;
cleanup:
    return rc;
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

/* 1 when autograd would record the original's work on this call: grad mode
 * is on and an argument (or a tensor in a tuple/list argument) or a
 * parameter of the module requires grad; 0 when not; -1 on error. Read only
 * for an entry whose backend returns no autograd outputs. */
static int
tt_dispatcher_needs_grad(TtDispatcher *self, PyObject *const *args, Py_ssize_t n)
{
    TtState *st = self->state;
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
    params = Py_XNewRef(self->params);
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

static PyObject *
tt_dispatcher_vectorcall(PyObject *callable, PyObject *const *args, size_t nargsf,
                         PyObject *kwnames)
{
    TtDispatcher *self = (TtDispatcher *)callable;
    PyObject *entries = NULL; /* held while walking and calling, see TtDispatcher.entries */
    PyObject *target = NULL;  /* new reference */
    PyObject *result = NULL;
    TtEntryLock *lock = NULL; /* held: released at cleanup */
    TtStack stack;
    TtHit hit = {0}; /* filled by a match; zeroed for the compiler, which cannot tell */
    int found, grad;

    stack.heap = NULL;
    stack.room = 0;
    self->calls++;
    if (TT_LIKELY(self->mode == TT_MODE_ACTIVE)) {
        entries = self->entries;
        if (TT_UNLIKELY(entries == NULL)) { /* cleared by the GC, called by a finalizer */
            found = 0;
        }
        else {
            Py_INCREF(entries);
            found = tt_dispatcher_find(self, entries, args, nargsf, kwnames, &stack, &hit);
        }
        if (TT_UNLIKELY(found < 0))
            goto cleanup;
        if (TT_UNLIKELY(found && hit.flags != 0)) {
            if (hit.flags & TT_ENTRY_NO_AUTOGRAD) {
                grad = tt_dispatcher_needs_grad(self, hit.args, hit.n);
                if (grad < 0)
                    goto cleanup;
                if (grad) {
                    if (tt_dispatcher_untuned(self, TT_UNTUNED_GRAD) < 0)
                        goto cleanup;
                    found = -2; /* the original runs, so the outputs keep autograd */
                }
            }
            if (found == 1 && hit.lock != NULL) {
                TtEntryLock *l = PyCapsule_GetPointer(hit.lock, tt_entry_lock_name);
                if (l == NULL || tt_entry_lock_acquire(l) < 0)
                    goto cleanup;
                lock = l;
            }
        }
        if (TT_UNLIKELY(found == 0) && tt_dispatcher_untuned(self, TT_UNTUNED_NO_MATCH) < 0)
            goto cleanup;
        if (TT_LIKELY(found == 1)) {
            target = hit.backend;
            args = hit.args;
            nargsf = hit.nargsf;
            kwnames = hit.kwnames;
        }
        else {
            target = self->original;
        }
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
    Py_INCREF(target);
    result = PyObject_Vectorcall(target, args, nargsf, kwnames);
    Py_DECREF(target);
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
    Py_VISIT(self->params);
    Py_VISIT(self->notify);
    return 0;
}

static int
tt_dispatcher_clear(TtDispatcher *self)
{
    Py_CLEAR(self->original);
    Py_CLEAR(self->recorder);
    Py_CLEAR(self->entries);
    Py_CLEAR(self->params);
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

static PyObject *
tt_dispatcher_bind(TtDispatcher *self, PyObject *original)
{
    if (!PyCallable_Check(original)) {
        PyErr_Format(PyExc_TypeError, "_tt_bind: the original must be callable, not %.100s",
                     Py_TYPE(original)->tp_name);
        return NULL;
    }
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
    PyObject *seq = NULL;     /* new reference */
    PyObject *entries = NULL; /* new reference */
    PyObject *result = NULL;
    Py_ssize_t i, j, n;

    if (st == NULL)
        goto cleanup;
    /* a tuple of our own: comparing signatures may run an __eq__ */
    seq = tt_sequence_tuple(arg, "_tt_set_entries: entries must be a sequence");
    if (seq == NULL)
        goto cleanup;
    n = PySequence_Fast_GET_SIZE(seq);
    if ((entries = PyTuple_New(n)) == NULL)
        goto cleanup;
    for (i = 0; i < n; i++) {
        PyObject *item = PySequence_Fast_GET_ITEM(seq, i); /* borrowed */
        PyObject *sig, *backend;                           /* borrowed */
        PyObject *flags = NULL;                            /* new reference */
        PyObject *lock = NULL;                             /* new reference */
        PyObject *entry;
        long bits = 0;
        int cacheable = 1;

        if (!PyTuple_Check(item) || PyTuple_GET_SIZE(item) < 2 || PyTuple_GET_SIZE(item) > 3) {
            PyErr_Format(PyExc_TypeError,
                         "_tt_set_entries: entry %zd must be a (signature or None, backend[, "
                         "flags]) tuple", i);
            goto cleanup;
        }
        sig = PyTuple_GET_ITEM(item, 0);
        backend = PyTuple_GET_ITEM(item, 1);
        if (PyTuple_GET_SIZE(item) == 3) {
            bits = PyLong_Check(PyTuple_GET_ITEM(item, 2)) ? PyLong_AsLong(PyTuple_GET_ITEM(item, 2))
                                                           : -1;
            if (bits == -1 && PyErr_Occurred())
                goto cleanup;
            if (bits < 0 || bits > (TT_ENTRY_SERIALIZE | TT_ENTRY_NO_AUTOGRAD |
                                    TT_ENTRY_LAYOUT_ONLY)) {
                PyErr_Format(PyExc_ValueError,
                             "_tt_set_entries: entry %zd: flags must be an int of ENTRY_* bits", i);
                goto cleanup;
            }
        }
        if (sig != Py_None && !PyObject_TypeCheck(sig, st->SignatureType)) {
            PyErr_Format(PyExc_TypeError,
                         "_tt_set_entries: entry %zd: the signature must be a Signature or "
                         "None, not %.100s", i, Py_TYPE(sig)->tp_name);
            goto cleanup;
        }
        if (!PyCallable_Check(backend)) {
            PyErr_Format(PyExc_TypeError,
                         "_tt_set_entries: entry %zd: the backend must be callable, not %.100s",
                         i, Py_TYPE(backend)->tp_name);
            goto cleanup;
        }
        for (j = 0; j < i && cacheable; j++) {
            PyObject *earlier = PyTuple_GET_ITEM(PyTuple_GET_ITEM(entries, j), 0);
            if (earlier == Py_None || sig == Py_None ||
                tt_signature_overlap((TtSignature *)earlier, (TtSignature *)sig))
                cacheable = 0;
        }
        if ((flags = bits == 0 ? Py_NewRef(Py_None) : PyLong_FromLong(bits)) == NULL)
            goto cleanup;
        lock = (bits & TT_ENTRY_SERIALIZE) ? tt_entry_lock_new() : Py_NewRef(Py_None);
        entry = lock == NULL ? NULL
                             : PyTuple_Pack(5, sig, backend, cacheable ? Py_True : Py_False,
                                            flags, lock);
        Py_DECREF(flags);
        Py_XDECREF(lock);
        if (entry == NULL)
            goto cleanup;
        PyTuple_SET_ITEM(entries, i, entry);
    }
    Py_XSETREF(self->entries, entries);
    entries = NULL;
    self->last = 0;
    result = Py_None;
    Py_INCREF(result);
cleanup:
    Py_XDECREF(seq);
    Py_XDECREF(entries);
    return result;
}

static PyObject *
tt_dispatcher_set_params(TtDispatcher *self, PyObject *params)
{
    Py_ssize_t i;

    if (params != Py_None) {
        if (!PyTuple_Check(params))
            goto bad;
        for (i = 0; i < PyTuple_GET_SIZE(params); i++)
            if (!PyDict_Check(PyTuple_GET_ITEM(params, i)))
                goto bad;
    }
    Py_XSETREF(self->params, params == Py_None ? NULL : Py_NewRef(params));
    Py_RETURN_NONE;
bad:
    PyErr_SetString(PyExc_TypeError,
                    "_tt_set_params: a tuple of the module's parameter dicts, or None");
    return NULL;
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

/* One entry's (signature or None, backend). New reference. */
static PyObject *
tt_entry_pair(PyObject *entry)
{
    return PyTuple_Pack(2, PyTuple_GET_ITEM(entry, 0), PyTuple_GET_ITEM(entry, 1));
}

/* One entry's flags as an int, 0 where none were given (see TtDispatcher.entries). New reference. */
static PyObject *
tt_entry_flags(PyObject *entry)
{
    PyObject *flags = PyTuple_GET_ITEM(entry, 3); /* borrowed */

    return flags == Py_None ? PyLong_FromLong(0) : Py_NewRef(flags);
}

/* A list of pick(entry) for every entry, in order. New reference. */
static PyObject *
tt_dispatcher_entries_list(TtDispatcher *self, PyObject *(*pick)(PyObject *entry))
{
    PyObject *entries = self->entries; /* borrowed */
    PyObject *list = NULL;
    Py_ssize_t i, n;

    n = entries != NULL ? PyTuple_GET_SIZE(entries) : 0;
    if ((list = PyList_New(n)) == NULL)
        goto error;
    for (i = 0; i < n; i++) {
        PyObject *item = pick(PyTuple_GET_ITEM(entries, i)); /* new reference, stolen by the list */

        if (item == NULL)
            goto error;
        PyList_SET_ITEM(list, i, item);
    }
    return list;
error:
    Py_XDECREF(list);
    return NULL;
}

static PyObject *
tt_dispatcher_get_entries(TtDispatcher *self, void *closure)
{
    (void)closure;
    return tt_dispatcher_entries_list(self, tt_entry_pair);
}

static PyObject *
tt_dispatcher_get_entry_flags(TtDispatcher *self, void *closure)
{
    (void)closure;
    return tt_dispatcher_entries_list(self, tt_entry_flags);
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
    {NULL, NULL, NULL, NULL, NULL}};

static PyMethodDef tt_dispatcher_methods[] = {
    {"_tt_bind", (PyCFunction)tt_dispatcher_bind, METH_O,
     "_tt_bind(original): the callable for mode 0 and for fallbacks."},
    {"_tt_set_entries", (PyCFunction)tt_dispatcher_set_entries, METH_O,
     "_tt_set_entries([(signature or None, backend[, flags]), ...]); flags: ENTRY_* bits."},
    {"_tt_set_params", (PyCFunction)tt_dispatcher_set_params, METH_O,
     "_tt_set_params(tuple of dicts or None): the module's parameter dicts, read for\n"
     "ENTRY_NO_AUTOGRAD entries while grad mode is on."},
    {"_tt_set_notify", (PyCFunction)tt_dispatcher_set_notify, METH_O,
     "_tt_set_notify(callable or None): called with the reason of the first untuned\n"
     "call per reason (\"no signature matched\", \"grad mode\") from now on."},
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
                "original (counted in _tt_fallbacks), mode 2 the recorder. An entry's\n"
                "flags: ENTRY_SERIALIZE (one call at a time), ENTRY_NO_AUTOGRAD (the\n"
                "original runs when autograd would record the call; _tt_grad_fallbacks),\n"
                "ENTRY_LAYOUT_ONLY (bind the layout, the backend checks the values)."},
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
