/*
 * graph.h - the GraphReplay type, the replay path of the device-graph backend
 * (graph.c). The launch alone, for a caller that writes the static inputs
 * itself, is graph_call.h's.
 */
#ifndef TT_GRAPH_H
#define TT_GRAPH_H

#include "state.h"

/* Adds GraphReplay to the module and fills st->GraphReplayType. -1 on error. */
int tt_graph_exec(PyObject *module, TtState *st);

#endif /* TT_GRAPH_H */
