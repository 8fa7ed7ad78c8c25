/*
 * common.h - the lowest layer of torch_tweak._C: macros and helpers that need
 * nothing of the extension (common.c). Includes no other header of ours.
 *
 * The files of the extension, each depending only on files listed before it
 * (a file includes only the headers of files above it, or its own; a type
 * made of several files shares one private header among them, named here at
 * the first of them). tests/test_c_layers.py checks this list against the
 * files and their includes.
 *
 * common        this file: macros, exceptions, sequences, getters
 * cuda          the CUDA driver shim, with no Python in it (cuda.h)
 * state         the per-module state and torch.Tensor's getters (state.h)
 * call          the context of one engine call (call.h)
 * config        the engine's measurement config as a dict (config.h)
 * tree          the Tree type (tree.h)
 * result        the Result type: the engine's result model read (result.h)
 * record        restore_result: a Result built again from the numbers a
 *               caller kept of one (record.h)
 * measure       measure, compare, choose; the argument checks every engine
 *               binding shares (measure.h)
 * search        tune_module, the module callbacks' trampolines (search.h)
 * depth         tweak and the check of its settings (depth.h)
 * argspec       one argument of a recorded call and its check (argspec.h)
 * signature     the Signature type (signature.h)
 * guard         entry locks and the grad rule (guard.h)
 * baked         what a converted model took in at its build, and whether it
 *               changed since: weights (their sampled bytes too), attributes,
 *               classes (baked.h)
 * entries       the entry table and how a call finds its entry (entries.h)
 * dispatcher    the Dispatcher type, the per-call path (dispatcher.h)
 * rootcall      root_call: the __call__ of a module tuned in place (rootcall.h)
 * graph_call    a call of a GraphReplay: does it fit, the copies, the
 *               launch, what it returns; the launch alone for a caller that
 *               writes the static inputs itself (graph_call.h). The
 *               GraphReplay's three files share the private graph_replay.h
 * graph_record  the recordings a GraphReplay holds, set when it is made
 * graph         the GraphReplay type, the device-graph replay path (graph.h)
 * padded_layout a PaddedReplay's recorded layout (tensors inside containers
 *               too) and whether a call fits it. The PaddedReplay's four
 *               files share the private padded_replay.h
 * padded_bucket the bucket rule and the buckets: which one holds a call,
 *               what Python sets in them and drops, their counters
 * padded_call   a call: a bucket's copies in, its graph launched through
 *               graph_call.h (or the target), the outputs cut back
 * padded        the PaddedReplay type, the padded backend's per-call path
 *               (padded.h)
 * steps         replay_steps, the graph decode loop's per-token loop
 *               (steps.h)
 * module        module definition and init: calls every file's exec function
 *
 * Every name carries the prefix tt_ (TT_ for macros); structs are CamelCase.
 */
#ifndef TT_COMMON_H
#define TT_COMMON_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h>

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

/* g from tp's attribute `name` when that is a getset descriptor of a base of
 * tp; left NULL (generic lookup) otherwise. -1 on error, AttributeError
 * included. */
int tt_getter_find(PyTypeObject *tp, PyObject *name, TtGetter *g);

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

#endif /* TT_COMMON_H */
