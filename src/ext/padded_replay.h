/*
 * padded_replay.h - the PaddedReplay object, shared by the files that make it
 * up (private to them), in this order: padded_layout.c (the recorded layout
 * and whether a call fits it), padded_bucket.c (the buckets: which one holds
 * a call, what Python sets in them, their counters), padded_call.c (a call:
 * copies in, the launch or the target, the cuts and copies out) and padded.c
 * (the Python type; its design). The rest of the extension includes padded.h.
 */
#ifndef TT_PADDED_REPLAY_H
#define TT_PADDED_REPLAY_H

#include "state.h"

/* One input tensor of the call. */
typedef struct TtPadSlot {
    Py_ssize_t param; /* its index among the call's parameters: positional, then keyword */
    int batch;        /* axis 0 is the batch: padded (rows of earlier calls) */
    int seq;          /* axis 1 is the length: padded with zeros */
    PyObject *dtype;  /* the recorded dtype, device and torch.Size */
    PyObject *device;
    PyObject *shape;
} TtPadSlot;

/* A bucket: its sizes, the range of calls it takes, what a call runs. Its
 * counters live as long as this object; the rest is set when it is ready. */
typedef struct TtPadBucket {
    Py_ssize_t b, n;         /* the bucket's batch and length (n 0: no length axis) */
    Py_ssize_t low_b, low_n; /* the smallest call it takes */
    PyObject *buffers;       /* a tuple: the static input of each slot; NULL: not ready */
    PyObject *graph;         /* a GraphReplay, or NULL: the target runs on the buffers */
    PyObject *outputs;       /* graph: the list of its static output leaves */
    PyObject *rebuild;       /* the result from the list of leaves; NULL: the one leaf */
    unsigned long long hits, valid, served;
} TtPadBucket;

typedef struct {
    PyObject_HEAD
    vectorcallfunc vectorcall;
    TtState *state;
    PyObject *target;      /* runs a bucket without a graph; and a call made while busy */
    PyObject *flatten;     /* a target's result into its list of leaves */
    Py_ssize_t nargs;      /* the recorded layout: positional arguments */
    PyObject *kwnames;     /* keywords, interned, in the recorded order */
    Py_ssize_t nparams;    /* nargs + keywords; 0: no call is served here */
    Py_ssize_t nplain;     /* the length of plain and slot_of */
    PyObject **plain;      /* per parameter: its recorded value, or NULL for a tensor slot */
    Py_ssize_t *slot_of;   /* per parameter: its slot, or -1 */
    Py_ssize_t nslots;
    TtPadSlot *slots;
    Py_ssize_t nouts;
    int *out_batch;        /* per output leaf: axis 0 is cut to the call's batch */
    int *out_length;       /* per output leaf: axis 1 is cut to the call's length */
    int length;            /* the length axis is padded: a call's n counts */
    int laid_out;          /* _pad_layout was called */
    Py_ssize_t nbuckets, room;
    TtPadBucket **buckets; /* each allocated once, freed with this object */
    Py_ssize_t last;       /* the bucket of the last call served here */
    int busy;
    unsigned long long fast, slow;
} TtPaddedReplay;

/* The size of axis `axis` of a torch.Size, or -1 with an exception. */
static inline Py_ssize_t
tt_pad_size(PyObject *shape, Py_ssize_t axis)
{
    return PyLong_AsSsize_t(PyTuple_GET_ITEM(shape, axis));
}

/* ---------------------------------------------------- padded_layout.c */

/* 1 when the call fits the recorded layout: found[s] (borrowed) and at[s]
 * (its index in the call's vector) per slot, the call's batch in *b and
 * length in *n (0 with no length axis); 0 when not; -1 on error. */
int tt_pad_fit(TtPaddedReplay *self, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames,
               PyObject **found, Py_ssize_t *at, Py_ssize_t *b, Py_ssize_t *n);
/* _pad_layout(call, slots, outputs, length, target, flatten): set once. */
PyObject *tt_pad_layout(TtPaddedReplay *self, PyObject *args, PyObject *kwargs);

/* ---------------------------------------------------- padded_bucket.c */

/* The bucket rule, static methods of the type for Python (backends/padded.py
 * asks them; padded.c's method table says what each returns). */
PyObject *tt_pad_py_batch_bucket(PyObject *unused, PyObject *args);
PyObject *tt_pad_py_key(PyObject *unused, PyObject *args);
PyObject *tt_pad_py_lower(PyObject *unused, PyObject *args);
/* The ready bucket whose range holds (b, n), or NULL (no exception). */
TtPadBucket *tt_pad_find(TtPaddedReplay *self, Py_ssize_t b, Py_ssize_t n);
/* The methods that set and read the buckets: _pad_bucket, _pad_count,
 * _pad_counts, reset_counts, _pad_ready (padded.c's method table says what
 * each does). */
PyObject *tt_pad_set_bucket(TtPaddedReplay *self, PyObject *args, PyObject *kwargs);
PyObject *tt_pad_count(TtPaddedReplay *self, PyObject *args);
PyObject *tt_pad_counts(TtPaddedReplay *self, PyObject *unused);
PyObject *tt_pad_reset_counts(TtPaddedReplay *self, PyObject *unused);
PyObject *tt_pad_ready(TtPaddedReplay *self, PyObject *unused);

/* ------------------------------------------------------ padded_call.c */

/* The copy-in and cut-out rules, for the per-call path and for Python's calls
 * of a bucket (padded.c's _pad_copy_in and _pad_cut): see padded_call.c. Of a
 * slot, only batch and seq are read. */
int tt_pad_copy_in_as(TtState *st, PyObject *buffers, PyObject *const *found, Py_ssize_t count,
                      const TtPadSlot *slots, Py_ssize_t b, Py_ssize_t n, Py_ssize_t bb,
                      Py_ssize_t bn);
PyObject *tt_pad_cut_as(TtState *st, PyObject *leaves, Py_ssize_t count, const int *batch,
                        const int *length, Py_ssize_t b, Py_ssize_t n, Py_ssize_t bb,
                        Py_ssize_t bn);
/* _pad_copy_in and _pad_cut (padded.c's method table says what each does). */
PyObject *tt_pad_py_copy_in(TtPaddedReplay *self, PyObject *args);
PyObject *tt_pad_py_cut(TtPaddedReplay *self, PyObject *args);
/* A call: served from a ready bucket when it fits, else handed to _slow. */
PyObject *tt_pad_vectorcall(PyObject *callable, PyObject *const *args, size_t nargsf,
                            PyObject *kwnames);

#endif /* TT_PADDED_REPLAY_H */
