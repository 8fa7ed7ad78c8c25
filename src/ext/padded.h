/*
 * padded.h - the PaddedReplay type, the per-call path of the padded backend
 * (padded.c): a call of varying sizes served from the bucket whose range
 * holds its sizes.
 */
#ifndef TT_PADDED_H
#define TT_PADDED_H

#include "state.h"

/* Adds PaddedReplay to the module and fills st->PaddedReplayType. -1 on error. */
int tt_padded_exec(PyObject *module, TtState *st);

#endif /* TT_PADDED_H */
