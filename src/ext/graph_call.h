/*
 * graph_call.h - one call of a GraphReplay (graph_call.c): what the rest of
 * the extension may ask of it, the launch alone. The call itself is the
 * type's vectorcall (graph.h, the type; graph_replay.h, shared by its files).
 */
#ifndef TT_GRAPH_CALL_H
#define TT_GRAPH_CALL_H

#include "cuda.h"
#include "state.h"

/* For a caller that writes a GraphReplay's static inputs itself (padded: a
 * bucket's buffers, written in part) and reads its static outputs itself:
 * the launch alone, with no copy in and none out. Call begin before writing
 * the static inputs: it reads torch's current stream of the graph's device
 * into *stream and, when the last launch was on another stream, makes the
 * current one wait for it (so the inputs are never written while an earlier
 * replay reads them). Then launch queues the copying recording on that
 * stream (driver mode) or calls its replay() (callable mode; *stream is
 * NULL). `replay` must be a GraphReplay (borrowed). -1 with an exception:
 * a failed driver call, or RuntimeError for a cleared GraphReplay. */
int tt_graph_launch_begin(PyObject *replay, TtCuStream *stream);
int tt_graph_launch(PyObject *replay, TtCuStream stream);

#endif /* TT_GRAPH_CALL_H */
