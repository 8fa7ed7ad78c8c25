/*
 * result.h - the Result type: the engine's result model read into Python
 * (result.c).
 */
#ifndef TT_RESULT_H
#define TT_RESULT_H

#include "state.h"
#include "tweak.h"

/* A Result owning `result` (stolen, also on failure), computed on a tree of
 * n_nodes nodes. New reference. */
PyObject *tt_result_new(TtState *st, tw_result *result, size_t n_nodes);
/* What one module's search found, as a dict: {"path", "state", "error",
 * "groups": [{"text", "strategy", "samples", "chosen", "error", "candidates":
 * [{"name", "state", "verdict", "error", "stats"}]}]}. New reference. */
PyObject *tt_module_result_to_dict(const tw_module_result *module);
/* A row state's name in a row dict ("measured", "skipped", "budget", "dry";
 * "unknown" out of range). */
const char *tt_row_state_name(tw_row_state state);
/* Adds Result to the module and fills st->ResultType. -1 on error. */
int tt_result_exec(PyObject *module, TtState *st);

#endif /* TT_RESULT_H */
