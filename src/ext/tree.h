/*
 * tree.h - the Tree and Result types (tree.c).
 */
#ifndef TT_TREE_H
#define TT_TREE_H

#include "state.h"
#include "tweak.h"

typedef struct {
    PyObject_HEAD
    tw_tree *tree; /* owned, finished */
} TtTree;

/* A Result owning `result` (stolen, also on failure), computed on a tree of
 * n_nodes nodes. New reference. */
PyObject *tt_result_new(TtState *st, tw_result *result, size_t n_nodes);
/* What one module's search found, as a dict: {"path", "state", "error",
 * "groups": [{"text", "strategy", "samples", "chosen", "error", "candidates":
 * [{"name", "state", "verdict", "error", "stats"}]}]}. New reference. */
PyObject *tt_module_result_to_dict(const tw_module_result *module);
/* Adds Tree and Result to the module and fills their slots in st. -1 on error. */
int tt_tree_exec(PyObject *module, TtState *st);

#endif /* TT_TREE_H */
