/*
 * tree.h - the Tree type (tree.c), and what Result shares with it.
 */
#ifndef TT_TREE_H
#define TT_TREE_H

#include "state.h"
#include "tweak.h"

typedef struct {
    PyObject_HEAD
    tw_tree *tree; /* owned, finished */
} TtTree;

/* A node index below n_nodes from an int; -1 with IndexError/TypeError. Tree
 * and Result index the same nodes, so they reject the same numbers alike. */
int tt_node_index(PyObject *arg, size_t n_nodes, size_t *out);
/* A str from a tw_*_format string (NULL: the error in err is raised), which it
 * frees. New reference. */
PyObject *tt_take_formatted(TtState *st, char *text, const tw_error *err);
/* Adds Tree to the module and fills st->TreeType. -1 on error. */
int tt_tree_exec(PyObject *module, TtState *st);

#endif /* TT_TREE_H */
