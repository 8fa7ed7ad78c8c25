/*
 * call.h - the context of one engine call and what its bindings share
 * (call.c). Used by tree.c, result.c, measure.c, search.c and depth.c.
 */
#ifndef TT_CALL_H
#define TT_CALL_H

#include "state.h"
#include "tweak.h"

/* What one engine call (measure, compare, choose, tweak) shares between its
 * trampolines. Lives on the C stack of the binding. */
typedef struct TtCall {
    TtState *st;
    PyObject *clock;   /* new reference; NULL: the engine's monotonic clock */
    PyObject *sync;    /* new reference; NULL: nothing to wait for */
    PyObject *stash;   /* new reference: stops everything, raised at the end */
    PyObject *failure; /* new reference: the latest Exception of a callback */
    uint64_t last_ns;  /* the clock's last reading, returned after a failure */
    PyObject *log;     /* new reference; NULL: the engine's lines go nowhere */
    tw_host host;
} TtCall;

/* A runner's context: one callable to run samples (and one to build, for a
 * candidate). Borrowed references, held by the binding for the whole call
 * (never by the caller's list, which a callback may clear). */
typedef struct TtRun {
    TtCall *call;
    PyObject *run;
    PyObject *build;
} TtRun;

/* Fills `call` for st; clock and sync may be Py_None (then NULL). Holds its
 * own references to clock and sync; tt_call_release drops them. */
void tt_call_init(TtCall *call, TtState *st, PyObject *clock, PyObject *sync);
/* Releases what the call holds: the stash, the failure, clock, sync and log. */
void tt_call_release(TtCall *call);
/* The host's log(): the engine's lines, passed to call->log (level, text). */
void tt_call_log(void *ctx, int level, const char *msg);
/* With the exception of a failed callback set: clears it and returns the
 * callback's code (TW_EINTERRUPT for a BaseException, else TW_ECALLBACK). */
tw_code tt_call_fail(TtCall *call, tw_error *err);
/* Calls func(*args); always: even after an interrupt (leave()). */
tw_code tt_call_invoke(TtCall *call, PyObject *func, PyObject *const *args, size_t nargs,
                       int always, tw_error *err);
/* Calls func(index). */
tw_code tt_call_invoke_index(TtCall *call, PyObject *func, size_t index, tw_error *err);
/* A candidate's build(): calls run->build(). */
tw_code tt_run_build(void *ctx, tw_error *err);
/* runner for `run`: run->run per sample, call->sync between when there is one. */
void tt_runner_init(tw_runner *runner, TtRun *run, size_t n_samples);
/* Raises for an engine code with its message (ValueError, MemoryError, else
 * EngineError with `cause`, may be NULL, as __cause__). No call context. */
void tt_raise_code(TtState *st, tw_code code, const char *msg, PyObject *cause);
/* After the engine returned: 0 when all went well, else -1 with the stashed
 * exception raised again, or the engine's error raised. */
int tt_call_check(TtCall *call, tw_code code, const tw_error *err);

/* A stop rule's name in a stats dict ("spread", "rounds", "time", "decided";
 * "unknown" out of range). */
const char *tt_stop_name(tw_stop stop);
/* The dict of `s`. New reference. */
PyObject *tt_stats_to_dict(const tw_stats *s);
/* The dict of `s` when it was measured, else None. New reference. */
PyObject *tt_stats_or_none(const tw_stats *s, int measured);

#endif /* TT_CALL_H */
