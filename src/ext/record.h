/*
 * record.h - a Result built again from the numbers a caller kept of one
 * (record.c): restore_result, the engine's tw_result_restore from Python.
 */
#ifndef TT_RECORD_H
#define TT_RECORD_H

#include "state.h"
#include "tweak.h"

/* restore_result(record) -> Result (METH_O). `record` is a dict in the forms
 * Result's getters give: {"rows": [row dicts], "selected", "baseline",
 * "confirmation" (a dict or None), "others_share" (None: unknown),
 * "busy_stopped", "budgets": {"time_budget_ns", "busy_budget_ns"}}; keys
 * beyond those the engine reads are ignored. TypeError for a value of another
 * type or a missing key, ValueError with the engine's words for numbers no
 * tweak gives (tw_result_restore). */
PyObject *tt_py_restore_result(PyObject *module, PyObject *record);

#endif /* TT_RECORD_H */
