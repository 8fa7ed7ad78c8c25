/*
 * argspec.h - one argument of a recorded call and its check (argspec.c).
 */
#ifndef TT_ARGSPEC_H
#define TT_ARGSPEC_H

#include "state.h"

enum {
    TT_ARG_VALUE = 0,  /* compared with `is`, then same type and == */
    TT_ARG_TENSOR = 1, /* dtype by identity, shape per axis, device type and index */
    TT_ARG_SEQ = 2,    /* a tuple or list: same exact type, length, items */
    TT_ARG_KEYED = 3   /* a value the state's value_keyer gave a key for (a key/value
                        * cache): another value fits when the keyer gives an equal key */
};

typedef struct TtArgSpec {
    int kind;
    PyObject *value;         /* VALUE: the value; TENSOR: the dtype; SEQ: the exact type;
                              * KEYED: the key */
    PyObject *device;        /* TENSOR: the torch.device; KEYED: the keyer */
    PyObject *device_flag;   /* TENSOR: "is_<device type>" when torch.Tensor has it, else
                              * NULL and the device is compared with == */
    TtGetter flag_get;       /* TENSOR: device_flag's getter on torch.Tensor */
    long device_index;       /* TENSOR: the device's index; -1 when it has none (cpu) */
    Py_ssize_t ndim;         /* TENSOR: dimensions; SEQ: items */
    Py_ssize_t *shape;       /* TENSOR: ndim sizes, -1 for a dynamic axis */
    struct TtArgSpec *items; /* SEQ: ndim item specs */
} TtArgSpec;

/* Fills `spec` for `obj`; depth 0 is an argument, depth 1 an item of a tuple
 * or list argument. dynamic: NULL or the axes to mark dynamic; where: the
 * argument's name for errors. -1 on error (what was filled is released by
 * tt_spec_release). */
int tt_spec_build(TtState *st, TtArgSpec *spec, PyObject *obj, int depth, PyObject *dynamic,
                  PyObject *where);
void tt_spec_release(TtArgSpec *spec);
int tt_spec_traverse(const TtArgSpec *spec, visitproc visit, void *arg);
/* 1 when `arg` fits `spec`, 0 when not, -1 on a BaseException. */
int tt_spec_match(TtState *st, const TtArgSpec *spec, PyObject *arg);
/* Whether some call could fit both specs (1) or surely not (0). */
int tt_spec_overlap(const TtArgSpec *a, const TtArgSpec *b);

#endif /* TT_ARGSPEC_H */
