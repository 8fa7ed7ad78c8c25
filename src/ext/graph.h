/*
 * graph.h - the GraphReplay type, the replay path of the device-graph backend
 * (graph.c).
 */
#ifndef TT_GRAPH_H
#define TT_GRAPH_H

#include "state.h"

/* Adds GraphReplay to the module and fills st->GraphReplayType. -1 on error. */
int tt_graph_exec(PyObject *module, TtState *st);

#endif /* TT_GRAPH_H */
