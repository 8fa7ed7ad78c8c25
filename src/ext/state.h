/*
 * state.h - what one module object of torch_tweak._C owns (state.c), and
 * torch.Tensor's getters read through it.
 */
#ifndef TT_STATE_H
#define TT_STATE_H

#include "common.h"

/* What one module object owns. Strings are interned at module exec so that
 * attribute lookups on the hot path hit the type's method cache; torch's
 * functions are looked up the first time they are needed (NULL until then),
 * so the extension imports without torch. */
typedef struct TtState {
    PyObject *EngineError;        /* torch_tweak._C.EngineError(RuntimeError) */
    PyTypeObject *TreeType;
    PyTypeObject *ResultType;
    PyTypeObject *SignatureType;
    PyTypeObject *DispatcherType;
    PyTypeObject *GraphReplayType;
    PyTypeObject *PaddedReplayType;
    PyTypeObject *tensor_type;    /* torch.Tensor; NULL until first needed */
    TtGetter tensor_dtype;        /* torch.Tensor's getters of dtype, shape, device */
    TtGetter tensor_shape;
    TtGetter tensor_device;
    TtGetter tensor_requires_grad;
    PyObject *grad_enabled;       /* torch._C.is_grad_enabled */
    PyObject *cuda_raw_stream;    /* torch._C._cuda_getCurrentRawStream */
    PyObject *empty_like;         /* torch.empty_like */
    PyObject *storage_use_count;  /* torch._C._storage_Use_Count */
    PyObject *storage_type;       /* torch._C.StorageBase, and what a replay reads of a storage */
    PyObject *storage_cdata;      /* through it, never through a subclass: StorageBase._cdata */
    PyObject *storage_data_ptr;   /* StorageBase.data_ptr */
    PyObject *storage_nbytes;     /* StorageBase.nbytes */
    PyObject *tensor_storage;     /* torch._C.TensorBase.untyped_storage */
    PyObject *value_keyer;        /* set_value_keyer's callable, or NULL: the structure key of a
                                   * stateful plain value (a key/value cache), see argspec.h */
    PyObject *str_dtype;
    PyObject *str_shape;
    PyObject *str_device;
    PyObject *str_name;           /* "__name__" */
    PyObject *str_tensor;         /* "Tensor" */
    PyObject *str_torch;          /* "torch" */
    PyObject *str_get_device;     /* "get_device" */
    PyObject *str_requires_grad;  /* "requires_grad" */
    PyObject *str_data_ptr;       /* tensor methods a replay calls */
    PyObject *str_is_contiguous;
    PyObject *str_copy_;
    PyObject *str_clone;
    PyObject *str_detach;
    PyObject *str_narrow;         /* tensor methods a padded call calls */
    PyObject *str_zero_;
    PyObject *str_slow;           /* "_slow": a padded call's way back to Python */
    PyObject *str_training;       /* "training": a module's train mode, in its __dict__ */
    PyObject *str_version;        /* "_version": a tensor's version counter */
    PyObject *str_modules;        /* "_modules": a module's submodules, in its __dict__ */
    PyObject *str_parameters;     /* "_parameters": a module's parameters, in its __dict__ */
} TtState;

/* The module definition that tt_state_from_type looks for; module.c tells it
 * once, before the first module is made. */
void tt_state_use_def(PyModuleDef *def);

/* Interns the state's strings. -1 on error (what was made is released by
 * tt_state_clear). */
int tt_state_init(TtState *st);
int tt_state_traverse(TtState *st, visitproc visit, void *arg);
void tt_state_clear(TtState *st);

/* The state of the module that owns type `tp` or one of its bases (a Python
 * subclass of Dispatcher has no module of its own). Borrowed; NULL with an
 * exception set when none is found. */
TtState *tt_state_from_type(PyTypeObject *tp);

/* torch.Tensor, looked up in sys.modules the first time it is needed. Borrowed;
 * NULL without an exception when torch is not imported (then nothing can be a
 * tensor); NULL with an exception when the lookup itself failed. */
PyTypeObject *tt_state_tensor_type(TtState *st);

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

#endif /* TT_STATE_H */
