/*
 * argspec.c - one argument of a recorded call (a tensor's dtype, shape and
 * device, a tuple or list of such, or a plain value) and the check that an
 * argument of another call fits it.
 *
 * Matching never fails a call: an Exception raised while reading an argument
 * or comparing a value counts as a mismatch (the original module then runs
 * and raises whatever it raises); only a BaseException that is not an
 * Exception (KeyboardInterrupt...) propagates.
 */
#include "argspec.h"

#include <string.h>

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

void
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

int
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
 * from the end, or True for every axis) as -1 in a tensor spec. `where` names
 * the argument in errors. */
static int
tt_spec_mark_dynamic(TtArgSpec *spec, PyObject *dynamic, PyObject *where)
{
    PyObject *axes = NULL; /* new reference */
    Py_ssize_t i, n;
    int rc = -1;

    if (dynamic == Py_True) {
        for (i = 0; i < spec->ndim; i++)
            spec->shape[i] = -1;
        return 0;
    }
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

/* Whether `obj` is a value no keyer is asked about (None, a bool, int, float
 * or str): the common plain arguments cost no call. */
static int
tt_spec_plain(PyObject *obj)
{
    return obj == Py_None || PyBool_Check(obj) || PyLong_CheckExact(obj) || PyFloat_CheckExact(obj) ||
           PyUnicode_CheckExact(obj);
}

/* For a tuple or list argument of n items: whether `dynamic` (a tuple) gives
 * one entry per item (None or axes) rather than axes for every item, that is
 * whether an entry is None or itself a sequence. -1 with ValueError when it
 * does but not one per item. */
static int
tt_spec_per_item(PyObject *dynamic, Py_ssize_t n, PyObject *where)
{
    Py_ssize_t i, m = PyTuple_GET_SIZE(dynamic);

    for (i = 0; i < m; i++) {
        PyObject *entry = PyTuple_GET_ITEM(dynamic, i); /* borrowed */

        if (entry == Py_None || entry == Py_True || PyTuple_Check(entry) || PyList_Check(entry)) {
            if (m != n) {
                PyErr_Format(PyExc_ValueError,
                             "dynamic axes of %U give %zd entries for its %zd items", where, m, n);
                return -1;
            }
            return 1;
        }
    }
    return 0;
}

/* Fills `spec` for a tuple or list argument `obj`: its exact type and one
 * item spec per item. dynamic: NULL, True, the same axes for each tensor item,
 * or one entry (None, True or axes) per item. */
static int
tt_spec_build_seq(TtState *st, TtArgSpec *spec, PyObject *obj, PyObject *dynamic,
                  PyObject *where)
{
    PyObject *each = NULL; /* new reference: the dynamic entries, as a tuple */
    Py_ssize_t i, n;
    int rc = -1, per_item = 0;

    spec->kind = TT_ARG_SEQ;
    spec->value = (PyObject *)Py_TYPE(obj);
    Py_INCREF(spec->value);
    n = PyTuple_Check(obj) ? PyTuple_GET_SIZE(obj) : PyList_GET_SIZE(obj);
    if (dynamic != NULL && dynamic != Py_True) {
        /* a tuple of our own: an axis's __index__ may change the caller's list */
        each = tt_sequence_tuple(dynamic, "dynamic axes must be a sequence");
        if (each == NULL || (per_item = tt_spec_per_item(each, n, where)) < 0)
            goto cleanup;
    }
    spec->items = PyMem_Calloc((size_t)(n ? n : 1), sizeof(TtArgSpec));
    if (spec->items == NULL) {
        PyErr_NoMemory();
        goto cleanup;
    }
    for (i = 0; i < n; i++) {
        PyObject *item; /* borrowed, kept alive by obj */
        PyObject *axes = per_item ? PyTuple_GET_ITEM(each, i) : dynamic; /* borrowed */
        int item_rc;

        if (PyList_Check(obj) && i >= PyList_GET_SIZE(obj))
            break; /* Python code run by a tensor's getattr shrank the list */
        if (axes == Py_None)
            axes = NULL;
        item = PyTuple_Check(obj) ? PyTuple_GET_ITEM(obj, i) : PyList_GET_ITEM(obj, i);
        Py_INCREF(item);
        spec->ndim = i + 1;
        item_rc = tt_spec_build(st, &spec->items[i], item, 1, NULL, where);
        if (item_rc == 0 && axes != NULL && spec->items[i].kind == TT_ARG_TENSOR)
            item_rc = tt_spec_mark_dynamic(&spec->items[i], axes, where);
        else if (item_rc == 0 && per_item && axes != NULL && axes != Py_True &&
                 spec->items[i].kind != TT_ARG_TENSOR && PyObject_Length(axes) != 0) {
            if (!PyErr_Occurred())
                PyErr_Format(PyExc_ValueError,
                             "dynamic axes given for item %zd of %U, which is not a tensor",
                             i, where);
            item_rc = -1;
        }
        Py_DECREF(item);
        if (item_rc < 0)
            goto cleanup;
    }
    spec->ndim = i;
    rc = 0;
cleanup:
    Py_XDECREF(each);
    return rc;
}

/* Fills `spec` for a value that is neither a tensor nor a tuple or list
 * argument: KEYED when the state's value keyer gives it a key, else VALUE.
 * dynamic: NULL or True (a plain value has no tensor), or empty. */
static int
tt_spec_build_value(TtState *st, TtArgSpec *spec, PyObject *obj, PyObject *dynamic,
                    PyObject *where)
{
    PyObject *keyer = NULL; /* new reference */
    PyObject *key = NULL;   /* new reference */
    int rc = -1;

    /* True: whatever tensors the argument holds; a plain value has none */
    if (dynamic != NULL && dynamic != Py_True && PyObject_Length(dynamic) != 0) {
        if (!PyErr_Occurred())
            PyErr_Format(PyExc_ValueError,
                         "dynamic axes given for %U, which is not a tensor", where);
        goto cleanup;
    }
    if (st->value_keyer != NULL && !tt_spec_plain(obj)) {
        /* held: the keyer may replace itself (set_value_keyer) while it runs */
        keyer = Py_NewRef(st->value_keyer);
        if ((key = PyObject_CallOneArg(keyer, obj)) == NULL)
            goto cleanup;
        if (key != Py_None) {
            spec->kind = TT_ARG_KEYED;
            spec->value = key;
            spec->device = keyer; /* the references move here */
            key = keyer = NULL;
            rc = 0;
            goto cleanup;
        }
    }
    spec->kind = TT_ARG_VALUE;
    spec->value = Py_NewRef(obj);
    rc = 0;
cleanup:
    Py_XDECREF(keyer);
    Py_XDECREF(key);
    return rc;
}

/* Fills `spec` for `obj`; depth 0 is an argument, depth 1 an item of a tuple
 * or list argument. dynamic: NULL, True (every axis of every tensor in it),
 * or the axes to mark dynamic; for a tuple or list, the same axes for each
 * tensor item, or one entry (None, True or axes) per item. */
int
tt_spec_build(TtState *st, TtArgSpec *spec, PyObject *obj, int depth, PyObject *dynamic,
              PyObject *where)
{
    PyTypeObject *tensor_type = tt_state_tensor_type(st); /* borrowed */
    int rc = -1;

    memset(spec, 0, sizeof(*spec));
    if (tensor_type == NULL && PyErr_Occurred())
        goto cleanup;
    if (tensor_type != NULL && PyObject_TypeCheck(obj, tensor_type)) {
        if (tt_spec_build_tensor(st, spec, obj) < 0)
            goto cleanup;
        if (dynamic != NULL && tt_spec_mark_dynamic(spec, dynamic, where) < 0)
            goto cleanup;
        rc = 0;
    }
    else if (depth == 0 && (PyTuple_Check(obj) || PyList_Check(obj)))
        rc = tt_spec_build_seq(st, spec, obj, dynamic, where);
    else
        rc = tt_spec_build_value(st, spec, obj, dynamic, where);
cleanup:
    return rc;
}

/* Whether a tensor `arg` is on spec's device: its is_<type> flag and index
 * when torch.Tensor has the flag, else its device compared with ==. 1, 0,
 * -1 on a BaseException. */
static TT_INLINE int
tt_spec_match_device(TtState *st, const TtArgSpec *spec, PyObject *arg)
{
    PyObject *attr = NULL; /* new reference: the flag, the index or the device */
    int rc = 0;

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
soft_error:
    rc = tt_match_soft_error();
cleanup:
    Py_XDECREF(attr);
    return rc;
}

/* Whether `arg` is a tensor of spec's dtype, shape (its fixed axes) and
 * device. 1, 0, -1 on a BaseException. */
static TT_INLINE int
tt_spec_match_tensor(TtState *st, const TtArgSpec *spec, PyObject *arg)
{
    PyObject *attr = NULL; /* new reference: dtype or shape */
    Py_ssize_t i, size;
    int rc = 0;

    if (TT_UNLIKELY(spec->value == NULL) || !PyObject_TypeCheck(arg, st->tensor_type))
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
        if (spec->shape[i] < 0)
            continue;
        size = PyLong_AsSsize_t(PyTuple_GET_ITEM(attr, i));
        if (TT_UNLIKELY(size == -1 && PyErr_Occurred()))
            goto soft_error; /* a symbolic size under tracing: no match */
        if (size != spec->shape[i])
            goto cleanup;
    }
    Py_CLEAR(attr);
    rc = tt_spec_match_device(st, spec, arg);
    goto cleanup;
soft_error:
    rc = tt_match_soft_error();
cleanup:
    Py_XDECREF(attr);
    return rc;
}

/* Whether a tuple or list `arg` has spec's exact type, length and items. */
static int
tt_spec_match_seq(TtState *st, const TtArgSpec *spec, PyObject *arg)
{
    Py_ssize_t i, n;
    int rc = 0;

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
cleanup:
    return rc;
}

/* Whether spec's keyer gives `arg` a key equal to spec's. */
static int
tt_spec_match_keyed(const TtArgSpec *spec, PyObject *arg)
{
    PyObject *key = NULL; /* new reference */
    int rc = 0;

    if (TT_UNLIKELY(spec->device == NULL || spec->value == NULL))
        goto cleanup;
    /* the keyer may run any Python: it reads the value's structure, never its identity */
    if ((key = PyObject_CallOneArg(spec->device, arg)) == NULL)
        goto soft_error;
    if (key == Py_None)
        goto cleanup;
    rc = PyObject_RichCompareBool(key, spec->value, Py_EQ);
    if (rc < 0)
        goto soft_error;
    goto cleanup;
soft_error:
    rc = tt_match_soft_error();
cleanup:
    Py_XDECREF(key);
    return rc;
}

/* Whether `arg` is spec's value, or of its exact type and equal to it. */
static int
tt_spec_match_value(const TtArgSpec *spec, PyObject *arg)
{
    int rc = 0;

    if (arg == spec->value) {
        rc = 1;
        goto cleanup;
    }
    /* same type first, so that 1, 1.0 and True stay distinct */
    if (TT_UNLIKELY(spec->value == NULL) || Py_TYPE(arg) != Py_TYPE(spec->value))
        goto cleanup;
    rc = PyObject_RichCompareBool(arg, spec->value, Py_EQ);
    if (rc < 0)
        rc = tt_match_soft_error();
cleanup:
    return rc;
}

int
tt_spec_match(TtState *st, const TtArgSpec *spec, PyObject *arg)
{
    int rc;

    switch (spec->kind) {
    case TT_ARG_TENSOR:
        rc = tt_spec_match_tensor(st, spec, arg);
        break;
    case TT_ARG_SEQ:
        rc = tt_spec_match_seq(st, spec, arg);
        break;
    case TT_ARG_KEYED:
        rc = tt_spec_match_keyed(spec, arg);
        break;
    default: /* TT_ARG_VALUE */
        rc = tt_spec_match_value(spec, arg);
        break;
    }
    return rc;
}


/* a == b as Python says, for tt_spec_overlap: 1 or 0; when they cannot be
 * compared (== raised), 1: a call might fit both. */
static int
tt_equal_or_unsure(PyObject *a, PyObject *b)
{
    int rc = PyObject_RichCompareBool(a, b, Py_EQ);

    if (rc < 0) {
        PyErr_Clear();
        return 1;
    }
    return rc;
}

/* Whether some call could fit both specs (1) or surely not (0). Used once per
 * _tt_set_entries, so it may be slow; when unsure it says 1. */
int
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
        return tt_equal_or_unsure(a->device, b->device);
    case TT_ARG_SEQ:
        if (a->value != b->value || a->ndim != b->ndim)
            return 0;
        for (i = 0; i < a->ndim; i++)
            if (!tt_spec_overlap(&a->items[i], &b->items[i]))
                return 0;
        return 1;
    case TT_ARG_KEYED:
        return tt_equal_or_unsure(a->value, b->value);
    default:
        if (a->value == b->value)
            return 1;
        if (Py_TYPE(a->value) != Py_TYPE(b->value))
            return 0;
        return tt_equal_or_unsure(a->value, b->value);
    }
}

