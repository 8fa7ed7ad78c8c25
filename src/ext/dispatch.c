/*
 * dispatch.c - the per-call path of a tuned module.
 *
 * Signature: what one call looked like (argument count, keyword names, per
 * argument a tensor's dtype/device/shape or a plain value), and a check that
 * another call fits it.
 * Dispatcher: the base type of torch_tweak.TunedModule. Its vectorcall is the
 * only code that runs between a caller and the chosen backend, so it reads
 * nothing it does not need and allocates nothing itself.
 *
 * Matching never fails a call: an Exception raised while reading an argument
 * or comparing a value counts as a mismatch (the original module then runs
 * and raises whatever it raises); only a BaseException that is not an
 * Exception (KeyboardInterrupt...) propagates.
 */
#include "ext.h"

#include <string.h>

/* ============================================================ Signature */

enum {
    TT_ARG_VALUE = 0,  /* compared with `is`, then same type and == */
    TT_ARG_TENSOR = 1, /* dtype by identity, shape per axis, device type and index */
    TT_ARG_SEQ = 2     /* a tuple or list: same exact type, length, items */
};

typedef struct TtArgSpec {
    int kind;
    PyObject *value;         /* VALUE: the value; TENSOR: the dtype; SEQ: the exact type */
    PyObject *device;        /* TENSOR: the torch.device */
    PyObject *device_flag;   /* TENSOR: "is_<device type>" when torch.Tensor has it, else
                              * NULL and the device is compared with == */
    TtGetter flag_get;       /* TENSOR: device_flag's getter on torch.Tensor */
    long device_index;       /* TENSOR: the device's index; -1 when it has none (cpu) */
    Py_ssize_t ndim;         /* TENSOR: dimensions; SEQ: items */
    Py_ssize_t *shape;       /* TENSOR: ndim sizes, -1 for a dynamic axis */
    struct TtArgSpec *items; /* SEQ: ndim item specs */
} TtArgSpec;

typedef struct {
    PyObject_HEAD
    TtState *state;     /* of the owning module; outlives the type, so this object */
    Py_ssize_t nargs;   /* positional arguments */
    PyObject *kwnames;  /* tuple of str in the recorded order */
    Py_ssize_t nspecs;  /* nargs + len(kwnames); 0 after tp_clear */
    TtArgSpec *specs;   /* positional, then keyword in kwnames order */
    /* The names of forward's leading parameters that take a position (None
     * for a positional-only one), so that a call binds by name: () when
     * unknown, then only keywords are re-ordered. */
    PyObject *params;
} TtSignature;

/* Room for a call laid out again in a signature's recorded order: slot 0 is
 * free for PY_VECTORCALL_ARGUMENTS_OFFSET, the arguments follow. A call of
 * up to TT_SMALL_STACK - 1 arguments uses the array in the caller's frame. */
#define TT_SMALL_STACK 16

typedef struct TtStack {
    PyObject *small[TT_SMALL_STACK];
    PyObject **heap;  /* NULL until a call needs more than small */
    Py_ssize_t room;  /* slots of heap */
} TtStack;

/* A buffer of at least n + 1 slots, owned by stack; NULL with MemoryError. */
static PyObject **
tt_stack_reserve(TtStack *stack, Py_ssize_t n)
{
    PyObject **mem = NULL;

    if (TT_LIKELY(n + 1 <= TT_SMALL_STACK)) {
        mem = stack->small;
        goto cleanup;
    }
    if (stack->heap != NULL && stack->room >= n + 1) {
        mem = stack->heap;
        goto cleanup;
    }
    mem = PyMem_Realloc(stack->heap, sizeof(PyObject *) * (size_t)(n + 1));
    if (mem == NULL) {
        PyErr_NoMemory();
        goto cleanup;
    }
    stack->heap = mem;
    stack->room = n + 1;
cleanup:
    return mem;
}

/* Keyword names are str (the interpreter checks), usually the same interned
 * objects: identity first. */
static inline int
tt_name_eq(PyObject *a, PyObject *b)
{
    return a == b || (PyUnicode_GET_LENGTH(a) == PyUnicode_GET_LENGTH(b) &&
                      PyUnicode_Compare(a, b) == 0);
}

/* The index of `name` among the first n items of `names` (str or None), or -1. */
static Py_ssize_t
tt_names_find(PyObject *names, Py_ssize_t n, PyObject *name)
{
    Py_ssize_t i;

    for (i = 0; i < n; i++) {
        PyObject *known = PyTuple_GET_ITEM(names, i); /* borrowed */
        if (known != Py_None && tt_name_eq(known, name))
            return i;
    }
    return -1;
}

/* An Exception while matching is a mismatch (0); anything else stops (-1). */
static int
tt_match_soft_error(void)
{
    if (PyErr_ExceptionMatches(PyExc_Exception)) {
        PyErr_Clear();
        return 0;
    }
    return -1;
}

static void
tt_spec_release(TtArgSpec *spec)
{
    Py_ssize_t i;

    Py_CLEAR(spec->value);
    Py_CLEAR(spec->device);
    Py_CLEAR(spec->device_flag);
    PyMem_Free(spec->shape);
    spec->shape = NULL;
    if (spec->items != NULL) {
        for (i = 0; i < spec->ndim; i++)
            tt_spec_release(&spec->items[i]);
        PyMem_Free(spec->items);
        spec->items = NULL;
    }
    spec->ndim = 0;
}

static int
tt_spec_traverse(const TtArgSpec *spec, visitproc visit, void *arg)
{
    Py_ssize_t i;

    Py_VISIT(spec->value);
    Py_VISIT(spec->device);
    if (spec->items != NULL) {
        for (i = 0; i < spec->ndim; i++) {
            int rc = tt_spec_traverse(&spec->items[i], visit, arg);
            if (rc)
                return rc;
        }
    }
    return 0;
}

/* Marks the axes named in `dynamic` (a sequence of ints, negative counting
 * from the end) as -1 in a tensor spec. `where` names the argument in errors. */
static int
tt_spec_mark_dynamic(TtArgSpec *spec, PyObject *dynamic, PyObject *where)
{
    PyObject *axes = NULL; /* new reference */
    Py_ssize_t i, n;
    int rc = -1;

    /* a tuple of our own: an axis's __index__ may change the caller's list */
    axes = tt_sequence_tuple(dynamic, "dynamic axes must be a sequence of ints");
    if (axes == NULL)
        goto cleanup;
    n = PySequence_Fast_GET_SIZE(axes);
    for (i = 0; i < n; i++) {
        Py_ssize_t given = PyNumber_AsSsize_t(PySequence_Fast_GET_ITEM(axes, i), NULL);
        Py_ssize_t axis = given;

        if (given == -1 && PyErr_Occurred())
            goto cleanup;
        if (axis < 0)
            axis += spec->ndim;
        if (axis < 0 || axis >= spec->ndim) {
            PyErr_Format(PyExc_ValueError,
                         "dynamic axis %zd of %U is out of range for a tensor of %zd dims",
                         given, where, spec->ndim);
            goto cleanup;
        }
        spec->shape[axis] = -1;
    }
    rc = 0;
cleanup:
    Py_XDECREF(axes);
    return rc;
}

/* How to check the device cheaply: reading a tensor's .device makes a new
 * torch.device and == on it costs about as much as dtype and shape together,
 * while is_cpu / is_cuda... are bool getters, and get_device() gives the
 * index as a small int. Falls back to == for a type without an is_<type>. */
static int
tt_spec_build_device(TtState *st, TtArgSpec *spec)
{
    PyObject *type = NULL;  /* new reference: device.type */
    PyObject *index = NULL; /* new reference: device.index */
    PyObject *flag = NULL;  /* new reference: "is_<type>" */
    int rc = -1;

    spec->device_index = -1;
    if ((type = PyObject_GetAttrString(spec->device, "type")) == NULL ||
        (index = PyObject_GetAttrString(spec->device, "index")) == NULL)
        goto cleanup;
    if (index != Py_None) {
        spec->device_index = PyLong_AsLong(index);
        if (spec->device_index == -1 && PyErr_Occurred())
            goto cleanup;
    }
    if ((flag = PyUnicode_FromFormat("is_%S", type)) == NULL)
        goto cleanup;
    PyUnicode_InternInPlace(&flag);
    if (tt_getter_find(st->tensor_type, flag, &spec->flag_get) < 0) {
        if (!PyErr_ExceptionMatches(PyExc_AttributeError))
            goto cleanup;
        PyErr_Clear(); /* no is_<type>: compare the device with == */
    }
    else {
        spec->device_flag = flag;
        flag = NULL;
    }
    rc = 0;
cleanup:
    Py_XDECREF(type);
    Py_XDECREF(index);
    Py_XDECREF(flag);
    return rc;
}

static int
tt_spec_build_tensor(TtState *st, TtArgSpec *spec, PyObject *obj)
{
    PyObject *shape = NULL; /* new reference */
    Py_ssize_t i;
    int rc = -1;

    spec->kind = TT_ARG_TENSOR;
    if ((spec->value = PyObject_GetAttr(obj, st->str_dtype)) == NULL)
        goto cleanup;
    if ((spec->device = PyObject_GetAttr(obj, st->str_device)) == NULL)
        goto cleanup;
    if (tt_spec_build_device(st, spec) < 0)
        goto cleanup;
    if ((shape = PyObject_GetAttr(obj, st->str_shape)) == NULL)
        goto cleanup;
    if (!PyTuple_Check(shape)) {
        PyErr_SetString(PyExc_TypeError, "a tensor's shape is not a tuple");
        goto cleanup;
    }
    spec->ndim = PyTuple_GET_SIZE(shape);
    spec->shape = PyMem_Malloc(sizeof(Py_ssize_t) * (size_t)(spec->ndim ? spec->ndim : 1));
    if (spec->shape == NULL) {
        PyErr_NoMemory();
        goto cleanup;
    }
    for (i = 0; i < spec->ndim; i++) {
        spec->shape[i] = PyNumber_AsSsize_t(PyTuple_GET_ITEM(shape, i), PyExc_OverflowError);
        if (spec->shape[i] == -1 && PyErr_Occurred())
            goto cleanup;
    }
    rc = 0;
cleanup:
    Py_XDECREF(shape);
    return rc;
}

/* Fills `spec` for `obj`; depth 0 is an argument, depth 1 an item of a tuple
 * or list argument. dynamic: NULL or the axes to mark dynamic. */
static int
tt_spec_build(TtState *st, TtArgSpec *spec, PyObject *obj, int depth, PyObject *dynamic,
              PyObject *where)
{
    PyTypeObject *tensor_type = tt_state_tensor_type(st); /* borrowed */
    Py_ssize_t i, n;
    int rc = -1;

    memset(spec, 0, sizeof(*spec));
    if (tensor_type == NULL && PyErr_Occurred())
        goto cleanup;
    if (tensor_type != NULL && PyObject_TypeCheck(obj, tensor_type)) {
        if (tt_spec_build_tensor(st, spec, obj) < 0)
            goto cleanup;
        if (dynamic != NULL && tt_spec_mark_dynamic(spec, dynamic, where) < 0)
            goto cleanup;
    }
    else if (depth == 0 && (PyTuple_Check(obj) || PyList_Check(obj))) {
        spec->kind = TT_ARG_SEQ;
        spec->value = (PyObject *)Py_TYPE(obj);
        Py_INCREF(spec->value);
        n = PyTuple_Check(obj) ? PyTuple_GET_SIZE(obj) : PyList_GET_SIZE(obj);
        spec->items = PyMem_Calloc((size_t)(n ? n : 1), sizeof(TtArgSpec));
        if (spec->items == NULL) {
            PyErr_NoMemory();
            goto cleanup;
        }
        for (i = 0; i < n; i++) {
            PyObject *item; /* borrowed, kept alive by obj */
            int item_rc;

            if (PyList_Check(obj) && i >= PyList_GET_SIZE(obj))
                break; /* Python code run by a tensor's getattr shrank the list */
            item = PyTuple_Check(obj) ? PyTuple_GET_ITEM(obj, i) : PyList_GET_ITEM(obj, i);
            Py_INCREF(item);
            spec->ndim = i + 1;
            item_rc = tt_spec_build(st, &spec->items[i], item, 1, NULL, where);
            if (item_rc == 0 && dynamic != NULL && spec->items[i].kind == TT_ARG_TENSOR)
                item_rc = tt_spec_mark_dynamic(&spec->items[i], dynamic, where);
            Py_DECREF(item);
            if (item_rc < 0)
                goto cleanup;
        }
        spec->ndim = i;
    }
    else {
        if (dynamic != NULL && PyObject_Length(dynamic) != 0) {
            if (!PyErr_Occurred())
                PyErr_Format(PyExc_ValueError,
                             "dynamic axes given for %U, which is not a tensor", where);
            goto cleanup;
        }
        spec->kind = TT_ARG_VALUE;
        spec->value = obj;
        Py_INCREF(obj);
    }
    rc = 0;
cleanup:
    return rc;
}

/* 1 when `arg` fits `spec`, 0 when not, -1 on a BaseException. */
static int
tt_spec_match(TtState *st, const TtArgSpec *spec, PyObject *arg)
{
    PyObject *attr = NULL; /* new reference: dtype, device or shape */
    Py_ssize_t i, n;
    int rc = 0;

    switch (spec->kind) {
    case TT_ARG_TENSOR:
        if (TT_UNLIKELY(spec->value == NULL) ||
            !PyObject_TypeCheck(arg, st->tensor_type))
            goto cleanup;
        /* dtypes are singletons: identity is equality */
        if (TT_UNLIKELY((attr = tt_tensor_attr(st, arg, &st->tensor_dtype, st->str_dtype)) == NULL))
            goto soft_error;
        if (attr != spec->value)
            goto cleanup;
        Py_DECREF(attr);
        if (TT_UNLIKELY((attr = tt_tensor_attr(st, arg, &st->tensor_shape, st->str_shape)) == NULL))
            goto soft_error;
        if (TT_UNLIKELY(!PyTuple_Check(attr)) || PyTuple_GET_SIZE(attr) != spec->ndim)
            goto cleanup;
        for (i = 0; i < spec->ndim; i++) {
            Py_ssize_t size;

            if (spec->shape[i] < 0)
                continue;
            size = PyLong_AsSsize_t(PyTuple_GET_ITEM(attr, i));
            if (TT_UNLIKELY(size == -1 && PyErr_Occurred()))
                goto soft_error; /* a symbolic size under tracing: no match */
            if (size != spec->shape[i])
                goto cleanup;
        }
        Py_DECREF(attr);
        if (TT_LIKELY(spec->device_flag != NULL)) {
            /* the type by its is_<type> bool, then the index when it has one */
            attr = tt_tensor_attr(st, arg, &spec->flag_get, spec->device_flag);
            if (TT_UNLIKELY(attr == NULL))
                goto soft_error;
            if (attr != Py_True)
                goto cleanup;
            if (spec->device_index < 0) {
                rc = 1;
                goto cleanup;
            }
            Py_DECREF(attr);
            attr = PyObject_VectorcallMethod(st->str_get_device, &arg, 1, NULL);
            if (TT_UNLIKELY(attr == NULL))
                goto soft_error;
            rc = PyLong_AsLong(attr) == spec->device_index;
            if (TT_UNLIKELY(PyErr_Occurred()))
                goto soft_error;
            goto cleanup;
        }
        /* torch.device is a fresh object per read; its == compares type and index */
        if (TT_UNLIKELY((attr = tt_tensor_attr(st, arg, &st->tensor_device, st->str_device)) == NULL))
            goto soft_error;
        rc = PyObject_RichCompareBool(attr, spec->device, Py_EQ);
        if (TT_UNLIKELY(rc < 0))
            goto soft_error;
        goto cleanup;
    case TT_ARG_SEQ:
        if (TT_UNLIKELY(spec->value == NULL) || (PyObject *)Py_TYPE(arg) != spec->value)
            goto cleanup;
        n = PyTuple_Check(arg) ? PyTuple_GET_SIZE(arg) : PyList_GET_SIZE(arg);
        if (n != spec->ndim)
            goto cleanup;
        for (i = 0; i < n; i++) {
            PyObject *item; /* borrowed, then held across the match */

            if (PyTuple_Check(arg)) {
                item = PyTuple_GET_ITEM(arg, i);
            }
            else {
                if (i >= PyList_GET_SIZE(arg))
                    goto cleanup; /* an item's __eq__ shrank the list */
                item = PyList_GET_ITEM(arg, i);
            }
            Py_INCREF(item);
            rc = tt_spec_match(st, &spec->items[i], item);
            Py_DECREF(item);
            if (rc != 1)
                goto cleanup;
        }
        rc = 1;
        goto cleanup;
    default: /* TT_ARG_VALUE */
        if (arg == spec->value) {
            rc = 1;
            goto cleanup;
        }
        /* same type first, so that 1, 1.0 and True stay distinct */
        if (TT_UNLIKELY(spec->value == NULL) || Py_TYPE(arg) != Py_TYPE(spec->value))
            goto cleanup;
        rc = PyObject_RichCompareBool(arg, spec->value, Py_EQ);
        if (rc < 0)
            goto soft_error;
        goto cleanup;
    }
soft_error:
    rc = tt_match_soft_error();
cleanup:
    Py_XDECREF(attr);
    return rc;
}

/* The call laid out as `sig` was recorded: sig->nargs positional arguments,
 * then the keywords in sig->kwnames' order. 1 with *out = args when the
 * caller used that layout (nothing copied: the fast path), or *out = one
 * slot past the start of a buffer of `stack` holding the arguments
 * (borrowed) in the recorded order, an argument passed by position bound to
 * the keyword of its parameter's name and back (sig->params); 0 when the
 * call does not lay out so (other names or counts); -1 on MemoryError. */
static TT_INLINE int
tt_signature_bind(const TtSignature *sig, PyObject *const *args, Py_ssize_t nargs,
                  PyObject *kwnames, TtStack *stack, PyObject *const **out)
{
    Py_ssize_t nkw = kwnames != NULL ? PyTuple_GET_SIZE(kwnames) : 0;
    Py_ssize_t nparams, i, at;
    PyObject **buf;
    int rc = 0;

    if (TT_UNLIKELY(sig->specs == NULL) || nargs + nkw != sig->nspecs)
        goto cleanup;
    if (TT_LIKELY(nargs == sig->nargs)) {
        for (i = 0; i < nkw; i++)
            if (!tt_name_eq(PyTuple_GET_ITEM(kwnames, i), PyTuple_GET_ITEM(sig->kwnames, i)))
                break;
        if (TT_LIKELY(i == nkw)) {
            *out = args;
            rc = 1;
            goto cleanup;
        }
    }
    if ((buf = tt_stack_reserve(stack, sig->nspecs)) == NULL) {
        rc = -1;
        goto cleanup;
    }
    nparams = PyTuple_GET_SIZE(sig->params);
    /* The constructor checked that no recorded keyword names a parameter the
     * recorded call filled by position, so each recorded slot takes a
     * different argument of the call, and with equal counts every one. */
    for (i = 0; i < sig->nspecs; i++) {
        PyObject *value = NULL; /* borrowed */
        PyObject *name;         /* borrowed */

        if (i < sig->nargs) {
            if (i < nargs) {
                value = args[i];
            }
            else if (i < nparams && (name = PyTuple_GET_ITEM(sig->params, i)) != Py_None) {
                if ((at = tt_names_find(kwnames, nkw, name)) >= 0)
                    value = args[nargs + at];
            }
        }
        else {
            name = PyTuple_GET_ITEM(sig->kwnames, i - sig->nargs);
            if ((at = tt_names_find(kwnames, nkw, name)) >= 0)
                value = args[nargs + at];
            else if ((at = tt_names_find(sig->params, nparams < nargs ? nparams : nargs,
                                         name)) >= 0)
                value = args[at];
        }
        if (value == NULL)
            goto cleanup; /* rc 0 */
        buf[i + 1] = value;
    }
    *out = buf + 1;
    rc = 1;
cleanup:
    return rc;
}

/* 1 when the bound arguments (recorded layout) fit every spec, 0 when not,
 * -1 on a BaseException. */
static TT_INLINE int
tt_signature_match_bound(const TtSignature *sig, PyObject *const *bound)
{
    Py_ssize_t i;
    int rc = 1;

    for (i = 0; i < sig->nspecs && rc == 1; i++)
        rc = tt_spec_match(sig->state, &sig->specs[i], bound[i]);
    return rc;
}

/* 1 when `sig` fits the call (vectorcall layout) once bound to its recorded
 * layout, 0 when not, -1 on error. */
static int
tt_signature_match(TtSignature *sig, PyObject *const *args, Py_ssize_t nargs,
                   PyObject *kwnames)
{
    TtStack stack;
    PyObject *const *bound = NULL;
    int rc;

    stack.heap = NULL;
    stack.room = 0;
    rc = tt_signature_bind(sig, args, nargs, kwnames, &stack, &bound);
    if (rc == 1)
        rc = tt_signature_match_bound(sig, bound);
    PyMem_Free(stack.heap);
    return rc;
}

/* tt_signature_match for the other files of the extension (ext.h). */
int
tt_signature_fits(PyObject *sig, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames)
{
    return tt_signature_match((TtSignature *)sig, args, nargs, kwnames);
}

/* Whether some call could fit both specs (1) or surely not (0). Used once per
 * _tt_set_entries, so it may be slow; when unsure it says 1. */
static int
tt_spec_overlap(const TtArgSpec *a, const TtArgSpec *b)
{
    Py_ssize_t i;
    int rc;

    if (a->kind != b->kind)
        return 0; /* a value is never a tensor or a top-level tuple/list */
    if (a->value == NULL || b->value == NULL)
        return 1;
    switch (a->kind) {
    case TT_ARG_TENSOR:
        if (a->value != b->value || a->ndim != b->ndim)
            return 0;
        for (i = 0; i < a->ndim; i++)
            if (a->shape[i] >= 0 && b->shape[i] >= 0 && a->shape[i] != b->shape[i])
                return 0;
        rc = PyObject_RichCompareBool(a->device, b->device, Py_EQ);
        if (rc < 0) {
            PyErr_Clear();
            return 1;
        }
        return rc;
    case TT_ARG_SEQ:
        if (a->value != b->value || a->ndim != b->ndim)
            return 0;
        for (i = 0; i < a->ndim; i++)
            if (!tt_spec_overlap(&a->items[i], &b->items[i]))
                return 0;
        return 1;
    default:
        if (a->value == b->value)
            return 1;
        if (Py_TYPE(a->value) != Py_TYPE(b->value))
            return 0;
        rc = PyObject_RichCompareBool(a->value, b->value, Py_EQ);
        if (rc < 0) {
            PyErr_Clear();
            return 1;
        }
        return rc;
    }
}

static int
tt_signature_overlap(const TtSignature *a, const TtSignature *b)
{
    Py_ssize_t i, j, nkw;

    if (a->specs == NULL || b->specs == NULL)
        return 1; /* cleared by the GC: unsure */
    if (a->nspecs != b->nspecs)
        return 0;
    if (a->nargs != b->nargs) /* unsure when a call can bind to either layout */
        return PyTuple_GET_SIZE(a->params) > 0 || PyTuple_GET_SIZE(b->params) > 0;
    for (i = 0; i < a->nargs; i++)
        if (!tt_spec_overlap(&a->specs[i], &b->specs[i]))
            return 0;
    nkw = a->nspecs - a->nargs;
    for (i = 0; i < nkw; i++) {
        PyObject *name = PyTuple_GET_ITEM(a->kwnames, i);
        int found = 0;

        for (j = 0; j < nkw && !found; j++) {
            int eq = PyUnicode_Compare(name, PyTuple_GET_ITEM(b->kwnames, j)) == 0;
            if (eq) {
                found = 1;
                if (!tt_spec_overlap(&a->specs[a->nargs + i], &b->specs[b->nargs + j]))
                    return 0;
            }
        }
        if (!found)
            return 0;
    }
    return 1;
}

/* self->params from `params` (None or a sequence of str or None), checked:
 * distinct names, and none that the recorded call gave both by position and
 * by keyword. -1 on error. */
static int
tt_signature_set_params(TtSignature *self, PyObject *params)
{
    PyObject *seq = NULL;   /* new reference */
    PyObject *names = NULL; /* new reference */
    Py_ssize_t i, n;
    int rc = -1;

    if (params == Py_None) {
        names = PyTuple_New(0);
        if (names == NULL)
            goto cleanup;
        goto done;
    }
    seq = tt_sequence_tuple(params, "Signature: params must be a sequence of str or None");
    if (seq == NULL)
        goto cleanup;
    n = PySequence_Fast_GET_SIZE(seq);
    if ((names = PyTuple_New(n)) == NULL)
        goto cleanup;
    for (i = 0; i < n; i++) {
        PyObject *name = PySequence_Fast_GET_ITEM(seq, i); /* borrowed */

        if (name != Py_None && !PyUnicode_CheckExact(name)) {
            PyErr_Format(PyExc_TypeError, "Signature: params[%zd] must be a str or None, not %.100s",
                         i, Py_TYPE(name)->tp_name);
            goto cleanup;
        }
        Py_INCREF(name);
        if (name != Py_None)
            PyUnicode_InternInPlace(&name);
        PyTuple_SET_ITEM(names, i, name);
        if (name != Py_None && tt_names_find(names, i, name) >= 0) {
            PyErr_Format(PyExc_ValueError, "Signature: parameter %R is named twice", name);
            goto cleanup;
        }
        if (name != Py_None && i < self->nargs &&
            tt_names_find(self->kwnames, PyTuple_GET_SIZE(self->kwnames), name) >= 0) {
            PyErr_Format(PyExc_ValueError,
                         "Signature: parameter %R is given both by position and by keyword", name);
            goto cleanup;
        }
    }
done:
    Py_XSETREF(self->params, names);
    names = NULL;
    rc = 0;
cleanup:
    Py_XDECREF(seq);
    Py_XDECREF(names);
    return rc;
}

static PyObject *
tt_signature_new(PyTypeObject *type, PyObject *args, PyObject *kwargs)
{
    static char *kwlist[] = {"args", "kwargs", "dynamic", "params", NULL};
    PyObject *call_args, *call_kwargs, *dynamic = Py_None, *params = Py_None; /* borrowed */
    PyObject *items = NULL; /* new reference: kwargs' (name, value) pairs */
    PyObject *dyn = NULL;   /* new reference: dynamic as a tuple of our own */
    PyObject *where = NULL; /* new reference: the argument's name for errors */
    TtSignature *self = NULL;
    TtState *st;
    Py_ssize_t i, nkw = 0, ndyn = 0;

    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "O!O|OO:Signature", kwlist, &PyTuple_Type,
                                     &call_args, &call_kwargs, &dynamic, &params))
        goto error;
    if (call_kwargs != Py_None) {
        if (!PyDict_Check(call_kwargs)) {
            PyErr_SetString(PyExc_TypeError, "Signature: kwargs must be a dict or None");
            goto error;
        }
        /* a snapshot: reading a tensor's metadata may run Python code */
        if ((items = PyDict_Items(call_kwargs)) == NULL)
            goto error;
        nkw = PyList_GET_SIZE(items);
    }
    if ((st = tt_state_from_type(type)) == NULL)
        goto error;
    self = (TtSignature *)type->tp_alloc(type, 0);
    if (self == NULL)
        goto error;
    self->state = st;
    self->nargs = PyTuple_GET_SIZE(call_args);
    if ((self->kwnames = PyTuple_New(nkw)) == NULL)
        goto error;
    if (dynamic != Py_None) {
        /* reading a tensor's metadata may run Python code that changes a list */
        dyn = tt_sequence_tuple(dynamic, "Signature: dynamic must be a sequence or None");
        if (dyn == NULL)
            goto error;
        ndyn = PySequence_Fast_GET_SIZE(dyn);
        if (ndyn > self->nargs + nkw) {
            PyErr_Format(PyExc_ValueError,
                         "Signature: dynamic has %zd entries for %zd arguments", ndyn,
                         self->nargs + nkw);
            goto error;
        }
    }
    self->specs = PyMem_Calloc((size_t)(self->nargs + nkw + 1), sizeof(TtArgSpec));
    if (self->specs == NULL) {
        PyErr_NoMemory();
        goto error;
    }
    for (i = 0; i < self->nargs + nkw; i++) {
        PyObject *value; /* borrowed from call_args or items */
        PyObject *axes = NULL; /* borrowed */

        if (i < self->nargs) {
            value = PyTuple_GET_ITEM(call_args, i);
            where = PyUnicode_FromFormat("argument %zd", i);
        }
        else {
            PyObject *pair = PyList_GET_ITEM(items, i - self->nargs);
            PyObject *key = PyTuple_GET_ITEM(pair, 0);

            value = PyTuple_GET_ITEM(pair, 1);
            if (!PyUnicode_CheckExact(key)) {
                PyErr_SetString(PyExc_TypeError, "Signature: keyword names must be str");
                goto error;
            }
            Py_INCREF(key);
            PyUnicode_InternInPlace(&key);
            PyTuple_SET_ITEM(self->kwnames, i - self->nargs, key);
            where = PyUnicode_FromFormat("keyword argument '%U'", key);
        }
        if (where == NULL)
            goto error;
        if (i < ndyn && PySequence_Fast_GET_ITEM(dyn, i) != Py_None)
            axes = PySequence_Fast_GET_ITEM(dyn, i);
        self->nspecs = i + 1;
        if (tt_spec_build(st, &self->specs[i], value, 0, axes, where) < 0)
            goto error;
        Py_CLEAR(where);
    }
    if (tt_signature_set_params(self, params) < 0)
        goto error;
    Py_XDECREF(items);
    Py_XDECREF(dyn);
    return (PyObject *)self;
error:
    Py_XDECREF(items);
    Py_XDECREF(dyn);
    Py_XDECREF(where);
    Py_XDECREF(self);
    return NULL;
}

static int
tt_signature_traverse(TtSignature *self, visitproc visit, void *arg)
{
    Py_ssize_t i;

    Py_VISIT(Py_TYPE(self));
    Py_VISIT(self->kwnames);
    Py_VISIT(self->params);
    for (i = 0; i < self->nspecs; i++) {
        int rc = tt_spec_traverse(&self->specs[i], visit, arg);
        if (rc)
            return rc;
    }
    return 0;
}

static int
tt_signature_clear(TtSignature *self)
{
    Py_ssize_t i;
    TtArgSpec *specs = self->specs;
    Py_ssize_t n = self->nspecs;

    /* detach first: a value's finalizer may look at this signature */
    self->specs = NULL;
    self->nspecs = 0;
    for (i = 0; i < n; i++)
        tt_spec_release(&specs[i]);
    PyMem_Free(specs);
    Py_CLEAR(self->kwnames);
    Py_CLEAR(self->params);
    return 0;
}

static void
tt_signature_dealloc(TtSignature *self)
{
    PyTypeObject *tp = Py_TYPE(self);

    PyObject_GC_UnTrack(self);
    tt_signature_clear(self);
    tp->tp_free((PyObject *)self);
    Py_DECREF(tp);
}

/* (args, kwargs) in the recorded layout: a tuple and a dict in sig->kwnames'
 * order, from bound arguments. New reference. */
static PyObject *
tt_signature_pack(const TtSignature *sig, PyObject *const *bound)
{
    PyObject *args = NULL;   /* new reference */
    PyObject *kwargs = NULL; /* new reference */
    PyObject *result = NULL;
    Py_ssize_t i;

    if ((args = PyTuple_New(sig->nargs)) == NULL || (kwargs = PyDict_New()) == NULL)
        goto cleanup;
    for (i = 0; i < sig->nargs; i++)
        PyTuple_SET_ITEM(args, i, Py_NewRef(bound[i]));
    for (i = sig->nargs; i < sig->nspecs; i++)
        if (PyDict_SetItem(kwargs, PyTuple_GET_ITEM(sig->kwnames, i - sig->nargs), bound[i]) < 0)
            goto cleanup;
    result = PyTuple_Pack(2, args, kwargs);
cleanup:
    Py_XDECREF(args);
    Py_XDECREF(kwargs);
    return result;
}

/* Signature.matches(args, kwargs) (bind 0) and Signature.bind(args, kwargs)
 * (bind 1): the dict is laid out as a vectorcall. */
static PyObject *
tt_signature_call(TtSignature *self, PyObject *const *args, Py_ssize_t nargs, int bind)
{
    PyObject *call_args, *call_kwargs; /* borrowed */
    PyObject **stack = NULL;
    PyObject *kwnames = NULL; /* new reference */
    PyObject *key, *value;    /* borrowed */
    PyObject *const *bound = NULL;
    PyObject *result = NULL;
    TtStack room;
    Py_ssize_t n, nkw = 0, pos = 0, i = 0;
    int rc;

    room.heap = NULL;
    room.room = 0;
    if (nargs != 2) {
        PyErr_Format(PyExc_TypeError, "%s() takes 2 arguments (%zd given)",
                     bind ? "bind" : "matches", nargs);
        goto cleanup;
    }
    call_args = args[0];
    call_kwargs = args[1];
    if (!PyTuple_Check(call_args) ||
        (call_kwargs != Py_None && !PyDict_Check(call_kwargs))) {
        PyErr_Format(PyExc_TypeError, "%s(args, kwargs): a tuple and a dict",
                     bind ? "bind" : "matches");
        goto cleanup;
    }
    n = PyTuple_GET_SIZE(call_args);
    if (call_kwargs != Py_None)
        nkw = PyDict_GET_SIZE(call_kwargs);
    stack = PyMem_Malloc(sizeof(PyObject *) * (size_t)(n + nkw + 1));
    if (stack == NULL) {
        PyErr_NoMemory();
        goto cleanup;
    }
    for (i = 0; i < n; i++)
        stack[i] = PyTuple_GET_ITEM(call_args, i);
    if (nkw > 0) {
        if ((kwnames = PyTuple_New(nkw)) == NULL)
            goto cleanup;
        /* items are held by kwnames and the tuple, so the dict may change below */
        for (i = 0; PyDict_Next(call_kwargs, &pos, &key, &value) && i < nkw; i++) {
            Py_INCREF(key);
            PyTuple_SET_ITEM(kwnames, i, key);
            stack[n + i] = value;
        }
    }
    for (i = n; i < n + nkw; i++)
        Py_INCREF(stack[i]);
    rc = tt_signature_bind(self, stack, n, kwnames, &room, &bound);
    if (rc == 1 && !bind)
        rc = tt_signature_match_bound(self, bound);
    if (rc == 1 && bind)
        result = tt_signature_pack(self, bound);
    else if (rc >= 0)
        result = bind ? Py_NewRef(Py_None) : PyBool_FromLong(rc);
    for (i = n; i < n + nkw; i++)
        Py_DECREF(stack[i]);
cleanup:
    PyMem_Free(stack);
    PyMem_Free(room.heap);
    Py_XDECREF(kwnames);
    return result;
}

static PyObject *
tt_signature_matches(TtSignature *self, PyObject *const *args, Py_ssize_t nargs)
{
    return tt_signature_call(self, args, nargs, 0);
}

static PyObject *
tt_signature_bind_py(TtSignature *self, PyObject *const *args, Py_ssize_t nargs)
{
    return tt_signature_call(self, args, nargs, 1);
}

static PyObject *
tt_signature_repr(TtSignature *self)
{
    return PyUnicode_FromFormat("<%s nargs=%zd kwargs=%R>", Py_TYPE(self)->tp_name,
                                self->nargs,
                                self->kwnames != NULL ? self->kwnames : Py_None);
}

static PyMethodDef tt_signature_methods[] = {
    {"matches", (PyCFunction)(void (*)(void))tt_signature_matches, METH_FASTCALL,
     "matches(args, kwargs) -> bool: whether a call with these arguments fits, once\n"
     "bound to the recorded layout."},
    {"bind", (PyCFunction)(void (*)(void))tt_signature_bind_py, METH_FASTCALL,
     "bind(args, kwargs) -> (args, kwargs) or None: the call laid out as recorded\n"
     "(positional count, keyword order), or None when it cannot be; values unchecked."},
    {NULL, NULL, 0, NULL}};

static PyObject *
tt_signature_get_params(TtSignature *self, void *closure)
{
    (void)closure;
    return Py_NewRef(self->params != NULL ? self->params : Py_None);
}

static PyGetSetDef tt_signature_getset[] = {
    {"params", (getter)tt_signature_get_params, NULL,
     "The names of forward's parameters by position (None: positional-only).", NULL},
    {NULL, NULL, NULL, NULL, NULL}};

static PyType_Slot tt_signature_slots[] = {
    {Py_tp_doc, "Signature(args, kwargs, dynamic=None, params=None)\n\n"
                "What one call looked like: positional count, keyword names in order,\n"
                "and per argument a tensor's dtype, device and shape, or a plain\n"
                "value (same type and ==). Tuples and lists are followed one level.\n"
                "A call fits once bound to that layout: keywords in any order, and,\n"
                "with params (the names of forward's parameters by position, None for\n"
                "a positional-only one), an argument by position or by keyword alike.\n"
                "dynamic[i]: axes of argument i (positional, then keyword in kwargs\n"
                "order) that match any size; for a tuple/list, of every tensor in it."},
    {Py_tp_getset, tt_signature_getset},
    {Py_tp_new, tt_signature_new},
    {Py_tp_dealloc, tt_signature_dealloc},
    {Py_tp_traverse, tt_signature_traverse},
    {Py_tp_clear, tt_signature_clear},
    {Py_tp_repr, tt_signature_repr},
    {Py_tp_methods, tt_signature_methods},
    {0, NULL}};

static PyType_Spec tt_signature_spec = {
    .name = "torch_tweak._C.Signature",
    .basicsize = sizeof(TtSignature),
    .flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .slots = tt_signature_slots,
};

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
    TtHit hit;
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

/* The entries as given: a list of (signature or None, backend). New reference. */
static PyObject *
tt_dispatcher_get_entries(TtDispatcher *self, void *closure)
{
    PyObject *entries = self->entries; /* borrowed */
    PyObject *list = NULL;
    Py_ssize_t i, n;

    (void)closure;
    n = entries != NULL ? PyTuple_GET_SIZE(entries) : 0;
    if ((list = PyList_New(n)) == NULL)
        goto error;
    for (i = 0; i < n; i++) {
        PyObject *entry = PyTuple_GET_ITEM(entries, i);
        PyObject *pair = PyTuple_Pack(2, PyTuple_GET_ITEM(entry, 0), PyTuple_GET_ITEM(entry, 1));
        if (pair == NULL)
            goto error;
        PyList_SET_ITEM(list, i, pair);
    }
    return list;
error:
    Py_XDECREF(list);
    return NULL;
}

static PyGetSetDef tt_dispatcher_getset[] = {
    {"_tt_mode", (getter)tt_dispatcher_get_mode, (setter)tt_dispatcher_set_mode,
     "0 original, 1 active (backends by signature), 2 record.", NULL},
    {"_tt_original", tt_get_object_or_none, NULL,
     "The original module (None before _tt_bind); read-only.",
     TT_FIELD(TtDispatcher, original)},
    {"_tt_entries", (getter)tt_dispatcher_get_entries, NULL,
     "A list of (signature or None, backend), as set.", NULL},
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
tt_dispatch_exec(PyObject *module, TtState *st)
{
    int rc = -1;

    st->SignatureType =
        (PyTypeObject *)PyType_FromModuleAndSpec(module, &tt_signature_spec, NULL);
    if (st->SignatureType == NULL)
        goto error;
    if (PyModule_AddObjectRef(module, "Signature", (PyObject *)st->SignatureType) < 0)
        goto error;
    st->DispatcherType =
        (PyTypeObject *)PyType_FromModuleAndSpec(module, &tt_dispatcher_spec, NULL);
    if (st->DispatcherType == NULL)
        goto error;
    if (PyModule_AddObjectRef(module, "Dispatcher", (PyObject *)st->DispatcherType) < 0)
        goto error;
    if (PyModule_AddIntConstant(module, "ENTRY_SERIALIZE", TT_ENTRY_SERIALIZE) < 0 ||
        PyModule_AddIntConstant(module, "ENTRY_NO_AUTOGRAD", TT_ENTRY_NO_AUTOGRAD) < 0 ||
        PyModule_AddIntConstant(module, "ENTRY_LAYOUT_ONLY", TT_ENTRY_LAYOUT_ONLY) < 0)
        goto error;
    rc = 0;
error:
    return rc;
}
