/*
 * ext.h - internals shared by the files of torch_tweak._C.
 *
 * module.c   module definition, per-module state, helpers shared by the rest
 * bindings.c the engine's bindings: Tree, Result, measure, compare, choose, tweak
 * dispatch.c the per-call path of a tuned module: Signature and Dispatcher
 * graph.c    the replay path of the device-graph backend: GraphReplay
 *
 * Every name here carries the prefix tt_ (TT_ for macros); structs are CamelCase.
 */
#ifndef TT_EXT_H
#define TT_EXT_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h>

#include "tweak.h"

#if PY_VERSION_HEX < 0x030C0000
/* 3.12 moved the member types into Python.h under new names. */
#define Py_T_PYSSIZET T_PYSSIZET
#define Py_READONLY READONLY
#endif

#if defined(__GNUC__) || defined(__clang__)
#define TT_LIKELY(x) __builtin_expect(!!(x), 1)
#define TT_UNLIKELY(x) __builtin_expect(!!(x), 0)
/* for the few helpers of the per-call path that the compiler would keep out of line */
#define TT_INLINE inline __attribute__((always_inline))
#else
#define TT_INLINE inline
#define TT_LIKELY(x) (x)
#define TT_UNLIKELY(x) (x)
#endif

/* A getset descriptor's getter, found once on torch.Tensor. get NULL: read
 * the attribute with PyObject_GetAttr. */
typedef struct TtGetter {
    getter get;
    void *closure;
} TtGetter;

/* What one module object owns. Strings are interned at module exec so that
 * attribute lookups on the hot path hit the type's method cache. */
typedef struct TtState {
    PyObject *EngineError;        /* torch_tweak._C.EngineError(RuntimeError) */
    PyTypeObject *TreeType;
    PyTypeObject *ResultType;
    PyTypeObject *SignatureType;
    PyTypeObject *DispatcherType;
    PyTypeObject *tensor_type;    /* torch.Tensor; NULL until first needed */
    TtGetter tensor_dtype;        /* torch.Tensor's getters of dtype, shape, device */
    TtGetter tensor_shape;
    TtGetter tensor_device;
    TtGetter tensor_requires_grad;
    PyObject *grad_enabled;       /* torch._C.is_grad_enabled; NULL until first needed */
    PyObject *str_dtype;
    PyObject *str_shape;
    PyObject *str_device;
    PyObject *str_name;           /* "__name__" */
    PyObject *str_tensor;         /* "Tensor" */
    PyObject *str_torch;          /* "torch" */
    PyObject *str_get_device;     /* "get_device" */
    PyObject *str_requires_grad;  /* "requires_grad" */
} TtState;

extern PyModuleDef tt_module_def;

/* The state of the module that owns type `tp` or one of its bases (a Python
 * subclass of Dispatcher has no module of its own). Borrowed; NULL with an
 * exception set when none is found. */
TtState *tt_state_from_type(PyTypeObject *tp);

/* torch.Tensor, looked up in sys.modules the first time it is needed. Borrowed;
 * NULL without an exception when torch is not imported (then nothing can be a
 * tensor); NULL with an exception when the lookup itself failed. */
PyTypeObject *tt_state_tensor_type(TtState *st);

/* g from tp's attribute `name` when that is a getset descriptor of a base of
 * tp; left NULL (generic lookup) otherwise. -1 on error, AttributeError
 * included. */
int tt_getter_find(PyTypeObject *tp, PyObject *name, TtGetter *g);

/* Attribute `name` of `obj`, read through `g` when obj is exactly torch.Tensor:
 * the same getter PyObject_GetAttr would reach, without the generic lookup.
 * New reference. */
static inline PyObject *
tt_tensor_attr(const TtState *st, PyObject *obj, const TtGetter *g, PyObject *name)
{
    if (TT_LIKELY(g->get != NULL && Py_TYPE(obj) == st->tensor_type))
        return g->get(obj, g->closure);
    return PyObject_GetAttr(obj, name);
}

/* Getters for a read-only getset entry whose closure is the field's offset
 * in the object, (void *)offsetof(Type, field): the unsigned long long
 * counter there, and the object there or None while it is NULL (before it is
 * set, after tp_clear). Every type's counters and references read alike.
 * New references. */
#define TT_FIELD(type, field) ((void *)offsetof(type, field))
PyObject *tt_get_counter(PyObject *self, void *offset);
PyObject *tt_get_object_or_none(PyObject *self, void *offset);

/* `seq` as a tuple that the caller owns: the same tuple when it is one, else a
 * copy of the list or iterable. Items read from it stay alive while Python
 * code runs, even when that code clears or mutates the caller's list. `msg`
 * is the TypeError when seq is not iterable. New reference. */
PyObject *tt_sequence_tuple(PyObject *seq, const char *msg);

/* The exception being raised, normalized with its traceback attached, cleared
 * from the thread state. New reference; NULL when none is set. */
PyObject *tt_exception_fetch(void);
/* Raises `exc` again, stealing the reference. */
void tt_exception_restore(PyObject *exc);

/* Adds Tree and Result to the module and fills their slots in st. -1 on error. */
int tt_bindings_exec(PyObject *module, TtState *st);
/* Adds Signature and Dispatcher. -1 on error. */
int tt_dispatch_exec(PyObject *module, TtState *st);
/* 1 when `sig` (a Signature, unchecked) fits the call given in vectorcall
 * layout, 0 when not, -1 on a BaseException that is not an Exception. */
int tt_signature_fits(PyObject *sig, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames);
/* Adds GraphReplay, the device-graph replay path (graph.c). -1 on error. */
int tt_graph_exec(PyObject *module);

/* Module-level functions; METH_VARARGS | METH_KEYWORDS unless said otherwise. */
PyObject *tt_py_default_measure_config(PyObject *module, PyObject *unused);
PyObject *tt_py_measure(PyObject *module, PyObject *args, PyObject *kwargs);
PyObject *tt_py_compare(PyObject *module, PyObject *args, PyObject *kwargs);
PyObject *tt_py_choose(PyObject *module, PyObject *args, PyObject *kwargs);
PyObject *tt_py_tweak(PyObject *module, PyObject *args, PyObject *kwargs);
PyObject *tt_py_enable_vectorcall(PyObject *module, PyObject *cls); /* METH_O */

#endif /* TT_EXT_H */
