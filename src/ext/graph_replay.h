/*
 * graph_replay.h - the GraphReplay object, shared by the files that make it
 * up (private to them): graph_call.c (a call: checking it fits, the replay,
 * what it returns), graph_record.c (the recordings it holds, set when it is
 * made) and graph.c (the Python type). The rest of the extension includes
 * graph.h (the type) and graph_call.h (the launch alone) only.
 */
#ifndef TT_GRAPH_REPLAY_H
#define TT_GRAPH_REPLAY_H

#include "cuda.h"
#include "signature.h"

typedef struct TtGraphInput {
    Py_ssize_t pos;       /* positional index, or -1 for a keyword argument */
    PyObject *name;       /* keyword: the interned name; else NULL */
    Py_ssize_t item;      /* index in a tuple/list argument, or -1 */
    PyObject *buffer;     /* the static tensor */
    PyObject *memory;     /* driver mode: its storage, which holds the memory dst points into */
    TtCuDevicePtr dst;    /* its data_ptr(), checked to lie in memory */
    size_t nbytes;
} TtGraphInput;

typedef struct TtGraphLeaf {
    PyObject *value;      /* a static output tensor, or a plain value returned as is */
    PyObject *storage;    /* lent: the value's storage object, held so the count below stays
                           * known; its address (read from it, never given) is what
                           * torch._C._storage_Use_Count reads. NULL: not lent */
    unsigned long long uses; /* lent: the storage's use count while no alias of it is out */
    PyObject *memory;     /* driver mode, dense: the storage src points into */
    int is_tensor;
    int dense;            /* contiguous: copied byte for byte */
    TtCuDevicePtr src;    /* checked to lie in memory */
    size_t nbytes;
} TtGraphLeaf;

/* One recording of the call: the graph and the static outputs it writes. */
typedef struct TtGraphRec {
    TtCuGraphExec exec;   /* driver mode */
    PyObject *replay;     /* callable mode: called to launch */
    PyObject *outputs;    /* as given: a tensor, a tuple, or a list */
    TtGraphLeaf *leaves;  /* nleaves of them */
    int lends;            /* some leaf is lent (storage set): the recording is in use */
} TtGraphRec;

enum { TT_REC_COPY = 0, TT_REC_LEND = 1, TT_RECS = 2 };

enum { TT_OUT_TENSOR = 0, TT_OUT_TUPLE = 1, TT_OUT_LIST = 2, TT_OUT_REBUILD = 3 };

typedef struct {
    PyObject_HEAD
    vectorcallfunc vectorcall;
    TtState *state;
    PyObject *signature;   /* a Signature */
    PyObject *original;    /* called for inputs that do not fit */
    PyObject *on_fallback; /* NULL, or called once at the first fallback after it was set */
    PyObject *rebuild;     /* NULL, or called with the list of output copies */
    PyObject *keep;        /* kept alive with the graph (the graph object, its pool) */
    PyObject *device;      /* driver mode: the device index as an int */
    Py_ssize_t ninputs;
    TtGraphInput *inputs;
    Py_ssize_t nleaves;    /* per recording: the same call has the same outputs */
    TtGraphRec recs[TT_RECS];
    int out_kind;
    int driver;            /* launches through the CUDA driver */
    int busy;              /* a call is in progress: another one falls back */
    TtCuDevice cu_device;
    TtCuContext ctx;       /* the device's primary context, retained */
    TtCuStream last_stream;
    int launched;          /* last_stream is meaningful */
    TtCuEvent event;       /* created the first time the stream changes */
    unsigned long long replays;
    unsigned long long lent;
    unsigned long long fallbacks;
} TtGraphReplay;

/* ------------------------------------------------------- graph_call.c */

/* Sets RuntimeError for a failed driver call; returns -1. */
int tt_graph_raise_cuda(TtCuResult rc, const char *what);
/* `obj.method()` as a new reference, or NULL. */
PyObject *tt_graph_call0(PyObject *obj, PyObject *method);
/* obj.data_ptr() into *ptr. -1 on error. */
int tt_graph_data_ptr(TtGraphReplay *self, PyObject *tensor, TtCuDevicePtr *ptr);
/* 1 when tensor.is_contiguous(), 0 when not, -1 on error. */
int tt_graph_is_dense(TtGraphReplay *self, PyObject *tensor);
/* tensor.nbytes into *nbytes. -1 on error. */
int tt_graph_nbytes(PyObject *tensor, size_t *nbytes);
/* Looks up, once, what a replay reads of a storage through torch's own types
 * (StorageBase, TensorBase), never through a subclass. -1 on error. */
int tt_graph_storage_api(TtState *st);
/* The storage of `tensor` (TensorBase.untyped_storage), checked to be a torch
 * storage. New reference, or NULL. */
PyObject *tt_graph_storage_of(TtGraphReplay *self, PyObject *tensor);
/* The address of a torch storage (StorageBase._cdata): a new reference, or NULL. */
PyObject *tt_graph_storage_address(TtGraphReplay *self, PyObject *storage);
/* tensor.data_ptr() into *ptr, checked so that `nbytes` bytes from it lie in
 * the memory of the tensor's storage; that storage (it keeps the memory
 * alive) into *memory, a new reference. The only way a device address gets
 * into a GraphReplay. -1 with ValueError when they do not lie in it. */
int tt_graph_span(TtGraphReplay *self, PyObject *tensor, size_t nbytes, TtCuDevicePtr *ptr,
                  PyObject **memory);
/* The use count of a lent leaf's storage, into *uses. -1 on error. */
int tt_graph_uses(TtGraphReplay *self, const TtGraphLeaf *leaf, unsigned long long *uses);
/* A call: the replay when it fits the recording, else the original. */
PyObject *tt_graph_vectorcall(PyObject *callable, PyObject *const *args, size_t nargsf,
                              PyObject *kwnames);

/* ----------------------------------------------------- graph_record.c */

/* Fills self->inputs from a sequence of (position or keyword name, item or -1,
 * static tensor). -1 on error. */
int tt_graph_set_inputs(TtGraphReplay *self, PyObject *inputs);
/* Fills rec->leaves from the outputs: a tensor, or a tuple or list of tensors
 * and plain values (with rebuild: a list). The first recording sets
 * self->out_kind and self->nleaves; a second must match them. -1 on error. */
int tt_graph_set_outputs(TtGraphReplay *self, TtGraphRec *rec, PyObject *outputs, PyObject *rebuild);
/* Driver mode: loads the driver, retains the device's primary context and
 * looks up what a call needs from torch. -1 on error. */
int tt_graph_set_driver(TtGraphReplay *self, unsigned long long exec, PyObject *device);
/* The lending recording from `lent`: (exec handle or 0, replay or None,
 * outputs, lend), launched the same way as the first. -1 on error. */
int tt_graph_set_lent(TtGraphReplay *self, PyObject *lent);

#endif /* TT_GRAPH_REPLAY_H */
