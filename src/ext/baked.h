/*
 * baked.h - what a model converted for another runtime (OpenVINO, ONNX
 * Runtime) took in at its build, and whether it changed since (baked.c): the
 * module's weights (replaced, given other memory, written in place, written
 * behind their version counter), its attributes and tables, its modules'
 * classes and their forward. Read per call of a converted model (Python's
 * backends.base.Baked) and per prefill replay (weight_change alone).
 */
#ifndef TT_BAKED_H
#define TT_BAKED_H

#include "state.h"

/* A weight's sampled bytes: the whole span when it is at most
 * TT_SAMPLE_PIECES * TT_SAMPLE_PIECE bytes, else TT_SAMPLE_PIECES pieces of
 * TT_SAMPLE_PIECE bytes spread evenly over it, the first at its start and the
 * last at its end. */
#define TT_SAMPLE_PIECES 16
#define TT_SAMPLE_PIECE 64

/* weight_sample(tensor, span) -> bytes: the sampled bytes of the `span` bytes
 * from tensor.data_ptr(). The caller vouches that those bytes are the
 * tensor's, in the host's memory (backends.base.Baked: a strided CPU tensor,
 * span within its storage); span 0 gives b"". */
PyObject *tt_py_weight_sample(PyObject *module, PyObject *args);

/* weight_change(weights, in_place) -> None or (index, kind): the first entry
 * of `weights` (a list of (table, path, name, tensor, address, version, span,
 * sample), as torch_tweak._core.model_state.weights_of lists them) whose
 * tensor changed since: kind 0, table[name] is no longer the tensor
 * (replaced; table is a dict, or a list or tuple and name an index); 1, its
 * data_ptr() is no longer address (other memory); with in_place, 2, its
 * _version is no longer version (written in place; not read where version is
 * None), 3, the bytes at address no longer hold `sample` (weight_sample's of
 * `span` bytes; not read where span is 0): written behind its version
 * counter (numpy, a storage's copy_, another tensor over its memory). The
 * bytes are read only while data_ptr() is still address: the entry holds the
 * tensor, whose storage keeps that memory (a storage resized moves). */
PyObject *tt_py_weight_change(PyObject *module, PyObject *args);

/* dict_change(pairs) -> None or (index, key): the first (live, saved, size,
 * by_value) of the list `pairs` whose dict `live` no longer holds what `saved`
 * (a copy taken earlier) holds, and the first key that differs: one whose
 * value is another object (with by_value, one that is also not equal) or is
 * gone; or None when only the number of keys is no longer `size` (-1: not
 * read). By value, lists and tuples (of one type) are compared item by item,
 * and a tensor is equal only to itself (never its __eq__). What a converted
 * model took in when it was built (its module's plain attributes, tables of
 * submodules, weights and hooks), per call. */
PyObject *tt_py_dict_change(PyObject *module, PyObject *pairs);

/* class_change(entries) -> None or index: the first (obj, name, expected) of
 * the list `entries` that no longer holds: with name None, type(obj) is
 * expected (a module's class); else getattr(obj, name) == expected (a class's
 * forward, compared as functions and bound methods compare). */
PyObject *tt_py_class_change(PyObject *module, PyObject *entries);

#endif /* TT_BAKED_H */
