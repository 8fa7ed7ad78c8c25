/*
 * tree.c - the engine's tree of modules as a Python type: Tree (tw_tree).
 */
#include "tree.h"

#include "call.h"

#include <limits.h>
#include <string.h>

/* ================================================================= Tree */

/* A non-negative int that fits uint64; -1 with ValueError naming `what`. */
static int
tt_uint64_arg(PyObject *value, const char *what, Py_ssize_t i, uint64_t *out)
{
    unsigned long long u;

    if (PyBool_Check(value) || !PyLong_Check(value))
        goto bad;
    u = PyLong_AsUnsignedLongLong(value);
    if (u == (unsigned long long)-1 && PyErr_Occurred()) {
        PyErr_Clear();
        goto bad;
    }
    *out = (uint64_t)u;
    return 0;
bad:
    PyErr_Format(PyExc_ValueError, "modules[%zd]: %s must be an int >= 0, not %R", i, what,
                 value);
    return -1;
}

static PyObject *
tt_tree_new(PyTypeObject *type, PyObject *args, PyObject *kwargs)
{
    static char *kwlist[] = {"modules", NULL};
    PyObject *modules_arg;       /* borrowed */
    PyObject *modules = NULL;    /* new reference: a tuple */
    TtTree *self = NULL;
    TtState *st = (TtState *)PyType_GetModuleState(type);
    Py_ssize_t i, n;
    tw_error err;
    tw_code code;

    memset(&err, 0, sizeof(err));
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "O:Tree", kwlist, &modules_arg))
        goto error;
    modules = tt_sequence_tuple(modules_arg, "modules must be a sequence of (path, calls, time_ns)");
    if (modules == NULL)
        goto error;
    if ((self = (TtTree *)type->tp_alloc(type, 0)) == NULL)
        goto error;
    if ((self->tree = tw_tree_create(NULL, &err)) == NULL) {
        tt_raise_code(st, TW_ENOMEM, err.msg, NULL);
        goto error;
    }
    n = PySequence_Fast_GET_SIZE(modules);
    for (i = 0; i < n; i++) {
        PyObject *item = PySequence_Fast_GET_ITEM(modules, i); /* borrowed */
        const char *path;
        Py_ssize_t path_len;
        uint64_t calls, time_ns;

        if (!PyTuple_Check(item) || PyTuple_GET_SIZE(item) != 3 ||
            !PyUnicode_Check(PyTuple_GET_ITEM(item, 0))) {
            PyErr_Format(PyExc_TypeError,
                         "modules[%zd] must be a (path: str, calls: int, time_ns: int) tuple", i);
            goto error;
        }
        if ((path = PyUnicode_AsUTF8AndSize(PyTuple_GET_ITEM(item, 0), &path_len)) == NULL)
            goto error;
        if ((Py_ssize_t)strlen(path) != path_len) {
            PyErr_Format(PyExc_ValueError, "modules[%zd]: the path contains a NUL character", i);
            goto error;
        }
        if (tt_uint64_arg(PyTuple_GET_ITEM(item, 1), "calls", i, &calls) < 0 ||
            tt_uint64_arg(PyTuple_GET_ITEM(item, 2), "time_ns", i, &time_ns) < 0)
            goto error;
        code = tw_tree_add(self->tree, path, calls, time_ns, NULL, &err);
        if (code != TW_OK) {
            char msg[TW_MSG_SIZE + 32];
            snprintf(msg, sizeof(msg), "modules[%zd]: %s", i, err.msg);
            tt_raise_code(st, code, msg, NULL);
            goto error;
        }
    }
    code = tw_tree_finish(self->tree, &err);
    if (code != TW_OK) {
        tt_raise_code(st, code, err.msg, NULL);
        goto error;
    }
    Py_DECREF(modules);
    return (PyObject *)self;
error:
    Py_XDECREF(modules);
    Py_XDECREF(self);
    return NULL;
}

static void
tt_tree_dealloc(TtTree *self)
{
    PyTypeObject *tp = Py_TYPE(self);

    tw_tree_destroy(self->tree);
    tp->tp_free((PyObject *)self);
    Py_DECREF(tp);
}

static Py_ssize_t
tt_tree_len(TtTree *self)
{
    return (Py_ssize_t)tw_tree_size(self->tree);
}

/* A node index below n_nodes from an int; -1 with IndexError/TypeError. Tree
 * and Result index the same nodes, so they reject the same numbers alike. */
int
tt_node_index(PyObject *arg, size_t n_nodes, size_t *out)
{
    Py_ssize_t i = PyNumber_AsSsize_t(arg, PyExc_IndexError);

    if (i == -1 && PyErr_Occurred())
        return -1;
    if (i < 0 || (size_t)i >= n_nodes) {
        PyErr_Format(PyExc_IndexError, "node index %zd out of range for a tree of %zu nodes", i,
                     n_nodes);
        return -1;
    }
    *out = (size_t)i;
    return 0;
}

/* What the per-node methods of Tree read; one reader so that each checks its
 * index the same way. */
enum { TT_NODE_PATH, TT_NODE_DEPTH, TT_NODE_PARENT, TT_NODE_CHILD_COUNT, TT_NODE_CALLS,
       TT_NODE_TIME_NS };

/* Field `what` of node `arg`. New reference; NULL with an exception. */
static PyObject *
tt_tree_node_field(TtTree *self, PyObject *arg, int what)
{
    PyObject *result = NULL;
    size_t i;

    if (tt_node_index(arg, tw_tree_size(self->tree), &i) < 0)
        goto cleanup;
    switch (what) {
    case TT_NODE_PATH:
        result = PyUnicode_FromString(tw_tree_path(self->tree, i));
        break;
    case TT_NODE_DEPTH:
        result = PyLong_FromLong(tw_tree_depth(self->tree, i));
        break;
    case TT_NODE_PARENT:
        result = PyLong_FromLong(tw_tree_parent(self->tree, i));
        break;
    case TT_NODE_CHILD_COUNT:
        result = PyLong_FromSize_t(tw_tree_child_count(self->tree, i));
        break;
    case TT_NODE_CALLS:
        result = PyLong_FromUnsignedLongLong(tw_tree_calls(self->tree, i));
        break;
    default: /* TT_NODE_TIME_NS */
        result = PyLong_FromUnsignedLongLong(tw_tree_time_ns(self->tree, i));
        break;
    }
cleanup:
    return result;
}

/* Tree's per-node getters, each tt_tree_node_field of its field. */
#define TT_NODE_GETTER(name, what)                                                          \
    static PyObject *tt_tree_##name(TtTree *self, PyObject *arg)                            \
    {                                                                                       \
        return tt_tree_node_field(self, arg, what);                                         \
    }
TT_NODE_GETTER(path, TT_NODE_PATH)
TT_NODE_GETTER(depth, TT_NODE_DEPTH)
TT_NODE_GETTER(parent, TT_NODE_PARENT)
TT_NODE_GETTER(child_count, TT_NODE_CHILD_COUNT)
TT_NODE_GETTER(calls, TT_NODE_CALLS)
TT_NODE_GETTER(time_ns, TT_NODE_TIME_NS)
#undef TT_NODE_GETTER

static PyObject *
tt_tree_find(TtTree *self, PyObject *arg)
{
    const char *path;
    Py_ssize_t len;

    if (!PyUnicode_Check(arg)) {
        PyErr_Format(PyExc_TypeError, "find: the path must be a str, not %.100s",
                     Py_TYPE(arg)->tp_name);
        return NULL;
    }
    if ((path = PyUnicode_AsUTF8AndSize(arg, &len)) == NULL)
        return NULL;
    if ((Py_ssize_t)strlen(path) != len)
        return PyLong_FromLong(-1); /* no path holds a NUL */
    return PyLong_FromLong(tw_tree_find(self->tree, path));
}

/* The `count` numbers the engine wrote into `out` (size_t when `nodes`, else
 * int depths) as a list, once `count` is checked against the `cap` it was
 * given. New reference; NULL with an exception. */
static PyObject *
tt_tree_list(TtState *st, const void *out, size_t count, size_t cap, int nodes,
             const char *what)
{
    PyObject *list = NULL;
    PyObject *result = NULL;
    PyObject *v;
    size_t i;

    if (count > cap) {
        PyErr_Format(st->EngineError, "%s: the engine returned more %s than the tree has", what,
                     nodes ? "nodes" : "depths");
        goto cleanup;
    }
    if ((list = PyList_New((Py_ssize_t)count)) == NULL)
        goto cleanup;
    for (i = 0; i < count; i++) {
        v = nodes ? PyLong_FromSize_t(((const size_t *)out)[i])
                  : PyLong_FromLong(((const int *)out)[i]);
        if (v == NULL)
            goto cleanup;
        PyList_SET_ITEM(list, (Py_ssize_t)i, v);
    }
    result = list;
    list = NULL;
cleanup:
    Py_XDECREF(list);
    return result;
}

static PyObject *
tt_tree_cut(TtTree *self, PyObject *arg)
{
    TtState *st = (TtState *)PyType_GetModuleState(Py_TYPE(self));
    size_t cap = tw_tree_size(self->tree) + 1, count = 0;
    size_t *out = NULL;
    PyObject *result = NULL;
    long depth;
    tw_error err;
    tw_code code;

    memset(&err, 0, sizeof(err));
    depth = PyLong_AsLong(arg);
    if (depth == -1 && PyErr_Occurred())
        goto cleanup;
    if (depth < INT_MIN || depth > INT_MAX) {
        PyErr_Format(PyExc_ValueError, "cut: depth %ld is out of range", depth);
        goto cleanup;
    }
    /* a cut holds at most every node, so one call is enough */
    if ((out = PyMem_Calloc(cap, sizeof(size_t))) == NULL) {
        PyErr_NoMemory();
        goto cleanup;
    }
    code = tw_tree_cut(self->tree, (int)depth, out, cap, &count, &err);
    if (code != TW_OK) {
        tt_raise_code(st, code, err.msg, NULL);
        goto cleanup;
    }
    result = tt_tree_list(st, out, count, cap, 1, "cut");
cleanup:
    PyMem_Free(out);
    return result;
}

static PyObject *
tt_tree_distinct_depths(TtTree *self, PyObject *args, PyObject *kwargs)
{
    static char *kwlist[] = {"min_depth", "max_depth", NULL};
    TtState *st = (TtState *)PyType_GetModuleState(Py_TYPE(self));
    int min_depth = 0, max_depth = -1;
    size_t cap, count = 0;
    int *out = NULL;
    PyObject *result = NULL;
    tw_error err;
    tw_code code;

    memset(&err, 0, sizeof(err));
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "|ii:distinct_depths", kwlist, &min_depth,
                                     &max_depth))
        goto cleanup;
    /* distinct cuts are at distinct depths, and depths go to max_depth */
    cap = (size_t)(tw_tree_max_depth(self->tree) + 2);
    if ((out = PyMem_Calloc(cap, sizeof(int))) == NULL) {
        PyErr_NoMemory();
        goto cleanup;
    }
    code = tw_tree_distinct_depths(self->tree, min_depth, max_depth, out, cap, &count, &err);
    if (code != TW_OK) {
        tt_raise_code(st, code, err.msg, NULL);
        goto cleanup;
    }
    result = tt_tree_list(st, out, count, cap, 0, "distinct_depths");
cleanup:
    PyMem_Free(out);
    return result;
}

/* A str from a tw_*_format string, which it frees. New reference. */
PyObject *
tt_take_formatted(TtState *st, char *text, const tw_error *err)
{
    PyObject *result = NULL;

    if (text == NULL) {
        tt_raise_code(st, err->code != TW_OK ? err->code : TW_ENOMEM, err->msg, NULL);
        goto cleanup;
    }
    result = PyUnicode_DecodeUTF8(text, (Py_ssize_t)strlen(text), "replace");
cleanup:
    tw_free(text);
    return result;
}

static PyObject *
tt_tree_format(TtTree *self, PyObject *unused)
{
    TtState *st = (TtState *)PyType_GetModuleState(Py_TYPE(self));
    tw_error err;

    (void)unused;
    memset(&err, 0, sizeof(err));
    return tt_take_formatted(st, tw_tree_format(self->tree, &err), &err);
}

static PyObject *
tt_tree_get_max_depth(TtTree *self, void *closure)
{
    (void)closure;
    return PyLong_FromLong(tw_tree_max_depth(self->tree));
}

static PyMethodDef tt_tree_methods[] = {
    {"path", (PyCFunction)tt_tree_path, METH_O, "path(i) -> str"},
    {"depth", (PyCFunction)tt_tree_depth, METH_O, "depth(i) -> int"},
    {"parent", (PyCFunction)tt_tree_parent, METH_O, "parent(i) -> int; -1 for the root"},
    {"child_count", (PyCFunction)tt_tree_child_count, METH_O, "child_count(i) -> int"},
    {"calls", (PyCFunction)tt_tree_calls, METH_O, "calls(i) -> int"},
    {"time_ns", (PyCFunction)tt_tree_time_ns, METH_O, "time_ns(i) -> int"},
    {"find", (PyCFunction)tt_tree_find, METH_O, "find(path) -> int; -1 when absent"},
    {"cut", (PyCFunction)tt_tree_cut, METH_O, "cut(depth) -> [node index]"},
    {"distinct_depths", (PyCFunction)(void (*)(void))tt_tree_distinct_depths,
     METH_VARARGS | METH_KEYWORDS, "distinct_depths(min_depth=0, max_depth=-1) -> [depth]"},
    {"format", (PyCFunction)tt_tree_format, METH_NOARGS, "format() -> str"},
    {NULL, NULL, 0, NULL}};

static PyGetSetDef tt_tree_getset[] = {
    {"max_depth", (getter)tt_tree_get_max_depth, NULL, "Deepest depth of any node.", NULL},
    {NULL, NULL, NULL, NULL, NULL}};

static PyType_Slot tt_tree_slots[] = {
    {Py_tp_doc, "Tree(modules): the tree of called modules; modules is a sequence of\n"
                "(path, calls, time_ns), the root being \"\"."},
    {Py_tp_new, tt_tree_new},
    {Py_tp_dealloc, tt_tree_dealloc},
    {Py_tp_methods, tt_tree_methods},
    {Py_tp_getset, tt_tree_getset},
    {Py_sq_length, tt_tree_len},
    {0, NULL}};

static PyType_Spec tt_tree_spec = {
    .name = "torch_tweak._C.Tree",
    .basicsize = sizeof(TtTree),
    .flags = Py_TPFLAGS_DEFAULT,
    .slots = tt_tree_slots,
};

/* ================================================================ module */

int
tt_tree_exec(PyObject *module, TtState *st)
{
    int rc = -1;

    st->TreeType = (PyTypeObject *)PyType_FromModuleAndSpec(module, &tt_tree_spec, NULL);
    if (st->TreeType == NULL)
        goto error;
    if (PyModule_AddObjectRef(module, "Tree", (PyObject *)st->TreeType) < 0)
        goto error;
    rc = 0;
error:
    return rc;
}
