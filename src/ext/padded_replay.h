/*
 * padded_replay.h - the PaddedReplay object, shared by the files that make it
 * up (private to them), in this order: padded_layout.c (the recorded layout
 * and whether a call fits it), padded_bucket.c (the bucket rule and the
 * buckets: which one holds a call, what Python sets in them, their counters),
 * padded_call.c (a call: copies in, the launch or the target, the cuts and
 * copies out) and padded.c (the Python type; its design). The rest of the
 * extension includes padded.h.
 */
#ifndef TT_PADDED_REPLAY_H
#define TT_PADDED_REPLAY_H

#include "state.h"

/* How deep a recorded call's containers may nest around a tensor. */
#define TT_PAD_MAX_DEPTH 16

/* What a call must pass at one place of the recorded call. */
enum { TT_PAD_VALUE, TT_PAD_TENSOR, TT_PAD_SEQ, TT_PAD_DICT }; /* a zeroed node is a VALUE of NULL */

/* One place of the recorded call: a parameter, or an item of a container
 * (a tuple, a list, a namedtuple or a dict of str keys) that holds a tensor. */
typedef struct TtPadNode {
    int kind;
    Py_ssize_t slot;         /* TENSOR: its slot */
    PyObject *value;         /* VALUE: the recorded value; SEQ: the container's exact type;
                              * DICT: a tuple of its keys, in order */
    Py_ssize_t count;        /* SEQ, DICT: its items */
    struct TtPadNode *items; /* SEQ, DICT: one node per item */
} TtPadNode;

/* One input tensor of the call. */
typedef struct TtPadSlot {
    int batch;        /* axis 0 is the batch: padded (rows of earlier calls) */
    int seq;          /* axis 1 is the length: padded with zeros */
    PyObject *dtype;  /* the recorded dtype, device and torch.Size */
    PyObject *device;
    PyObject *shape;
} TtPadSlot;

/* A bucket: its sizes, the range of calls it takes, what a call runs. Its
 * counters live as long as this object; the rest is set by Python. */
typedef struct TtPadBucket {
    Py_ssize_t b, n;         /* the bucket's batch and length (n 0: no length axis) */
    Py_ssize_t low_b, low_n; /* the smallest call it takes */
    PyObject *buffers;       /* a tuple: the static input of each slot; NULL: none set */
    PyObject *graph;         /* a GraphReplay, or NULL: the target runs on the buffers */
    PyObject *outputs;       /* graph: the list of its static output leaves */
    PyObject *rebuild;       /* the result from the list of leaves; NULL: the one leaf */
    int ready;               /* the per-call path serves its calls */
    unsigned long long hits, valid, served;
} TtPadBucket;

typedef struct {
    PyObject_HEAD
    vectorcallfunc vectorcall;
    TtState *state;
    PyObject *target;      /* runs a bucket without a graph, and every call not served here */
    PyObject *flatten;     /* a target's result into its list of leaves */
    Py_ssize_t nargs;      /* the recorded layout: positional arguments */
    PyObject *kwnames;     /* keywords, interned, in the recorded order */
    Py_ssize_t nparams;    /* nargs + keywords; 0: no layout yet */
    Py_ssize_t nnodes;     /* the length of params (set before its nodes are) */
    TtPadNode *params;     /* per parameter: what a call passes there */
    int nested;            /* a tensor sits inside a container argument */
    Py_ssize_t nslots;
    TtPadSlot *slots;
    Py_ssize_t nouts;
    int *out_batch;        /* per output leaf: axis 0 is cut to the call's batch */
    int *out_length;       /* per output leaf: axis 1 is cut to the call's length */
    int batch, length;     /* the batch, the length axis is padded */
    Py_ssize_t max_batch, max_length, step; /* the range and the length buckets' step */
    int laid_out;          /* _pad_layout was called */
    Py_ssize_t nbuckets, room;
    TtPadBucket **buckets; /* each allocated once, freed with this object */
    Py_ssize_t last;       /* the bucket of the last call served here */
    TtPadBucket *serving;  /* the bucket a call is being served from, or NULL */
    int busy;
    unsigned long long fast, slow, outside;
} TtPaddedReplay;

/* What tt_pad_fit finds of a call: per slot its tensor (a new reference), per
 * parameter its index in the call's vector, its batch and length. */
typedef struct TtPadFound {
    PyObject **tensors;
    Py_ssize_t *at;
    Py_ssize_t b, n;
} TtPadFound;

/* The size of axis `axis` of a torch.Size, or -1 with an exception. */
static inline Py_ssize_t
tt_pad_size(PyObject *shape, Py_ssize_t axis)
{
    return PyLong_AsSsize_t(PyTuple_GET_ITEM(shape, axis));
}

/* ---------------------------------------------------- padded_layout.c */

/* 1 when the call fits the recorded layout (the same parameters, plain values
 * and containers; each tensor of its slot's type, dtype, device and rank, its
 * sizes the recorded ones but on the padded axes, one batch and one length
 * among them): found filled, its tensors new references (release them with
 * tt_pad_found_release, also on 0 and -1); 0 when not; -1 on error. */
int tt_pad_fit(TtPaddedReplay *self, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames,
               TtPadFound *found);
void tt_pad_found_release(TtPaddedReplay *self, TtPadFound *found);
/* The call's arguments in the recorded layout with each slot's tensor
 * replaced by its buffer (`buffers`, a tuple), the containers around them
 * made anew: bound[p] a new reference per parameter. -1 on error (bound
 * holds nothing then). */
int tt_pad_bind_buffers(TtPaddedReplay *self, PyObject *buffers, PyObject *const *args,
                        const TtPadFound *found, PyObject **bound);
/* _pad_layout(call, slots, outputs, length, target, flatten, max_batch,
 * max_length, step): set once. */
PyObject *tt_pad_layout(TtPaddedReplay *self, PyObject *args, PyObject *kwargs);
/* Releases the nodes of the layout (their references and arrays). */
void tt_pad_nodes_free(TtPaddedReplay *self);
int tt_pad_nodes_visit(TtPaddedReplay *self, visitproc visit, void *arg);

/* ---------------------------------------------------- padded_bucket.c */

/* The bucket rule, static methods of the type for Python (backends/padded.py
 * asks them; padded.c's method table says what each returns). */
PyObject *tt_pad_py_batch_bucket(PyObject *unused, PyObject *args);
PyObject *tt_pad_py_key(PyObject *unused, PyObject *args);
PyObject *tt_pad_py_lower(PyObject *unused, PyObject *args);
/* 1 with the bucket (*bb, *bn) of a call of batch b and length n, 0 when
 * the call is outside the range. */
int tt_pad_key(const TtPaddedReplay *self, Py_ssize_t b, Py_ssize_t n, Py_ssize_t *bb,
               Py_ssize_t *bn);
/* The ready bucket whose range holds (b, n), or NULL (no exception). */
TtPadBucket *tt_pad_find(TtPaddedReplay *self, Py_ssize_t b, Py_ssize_t n);
/* The bucket (b, n) with its contents set, ready or not; NULL (no exception). */
TtPadBucket *tt_pad_held(TtPaddedReplay *self, Py_ssize_t b, Py_ssize_t n);
/* The methods that set and read the buckets and the range: _pad_bucket,
 * _pad_serve, _pad_drop, _pad_range, _pad_counts, reset_counts, _pad_ready (padded.c's method table
 * says what each does). */
PyObject *tt_pad_set_bucket(TtPaddedReplay *self, PyObject *args, PyObject *kwargs);
PyObject *tt_pad_serve_bucket(TtPaddedReplay *self, PyObject *args);
PyObject *tt_pad_drop(TtPaddedReplay *self, PyObject *args);
PyObject *tt_pad_set_range(TtPaddedReplay *self, PyObject *args);
PyObject *tt_pad_counts(TtPaddedReplay *self, PyObject *unused);
PyObject *tt_pad_reset_counts(TtPaddedReplay *self, PyObject *unused);
PyObject *tt_pad_ready(TtPaddedReplay *self, PyObject *unused);

/* ------------------------------------------------------ padded_call.c */

/* _pad_fit, _pad_run and _pad_filled (padded.c's method table says what each
 * does). */
PyObject *tt_pad_py_fit(TtPaddedReplay *self, PyObject *args);
PyObject *tt_pad_py_run(TtPaddedReplay *self, PyObject *args);
PyObject *tt_pad_py_filled(TtPaddedReplay *self, PyObject *args);
/* A call: served from a ready bucket when it fits; the target when it does
 * not, or falls outside the range; else handed to _slow. */
PyObject *tt_pad_vectorcall(PyObject *callable, PyObject *const *args, size_t nargsf,
                            PyObject *kwnames);

#endif /* TT_PADDED_REPLAY_H */
