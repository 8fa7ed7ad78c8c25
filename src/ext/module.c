/*
 * module.c - torch_tweak._C: the module definition (multi-phase init). Its
 * exec makes the per-module state and calls each type's exec function; no
 * other file calls into this one.
 */
#include "state.h"

#include "baked.h"
#include "config.h"
#include "dispatcher.h"
#include "graph.h"
#include "guard.h"
#include "measure.h"
#include "padded.h"
#include "record.h"
#include "result.h"
#include "rootcall.h"
#include "depth.h"
#include "search.h"
#include "signature.h"
#include "steps.h"
#include "tree.h"

static PyModuleDef tt_module_def;

static int
tt_module_exec(PyObject *module)
{
    TtState *st = (TtState *)PyModule_GetState(module);
    int rc = -1;

    if (tt_state_init(st) < 0)
        goto error;
    st->EngineError = PyErr_NewExceptionWithDoc(
        "torch_tweak._C.EngineError",
        "An engine call failed for a reason other than a bad argument or memory:\n"
        "a callback failed, a call out of order, or the time budget.",
        PyExc_RuntimeError, NULL);
    if (st->EngineError == NULL)
        goto error;
    if (PyModule_AddObjectRef(module, "EngineError", st->EngineError) < 0)
        goto error;
    if (tt_tree_exec(module, st) < 0 || tt_result_exec(module, st) < 0 ||
        tt_signature_exec(module, st) < 0 || tt_dispatcher_exec(module, st) < 0 ||
        tt_graph_exec(module, st) < 0 || tt_padded_exec(module, st) < 0 ||
        tt_root_call_exec(module, st) < 0)
        goto error;
    rc = 0;
error:
    return rc;
}

static int
tt_module_traverse(PyObject *module, visitproc visit, void *arg)
{
    return tt_state_traverse((TtState *)PyModule_GetState(module), visit, arg);
}

static int
tt_module_clear(PyObject *module)
{
    tt_state_clear((TtState *)PyModule_GetState(module));
    return 0;
}

static void
tt_module_free(void *module)
{
    tt_module_clear((PyObject *)module);
}

static PyMethodDef tt_module_methods[] = {
    {"default_measure_config", (PyCFunction)tt_py_default_measure_config, METH_NOARGS,
     "The engine's default measurement config as a dict."},
    {"default_tweak_config", (PyCFunction)tt_py_default_tweak_config, METH_NOARGS,
     "The engine's tweak defaults (min_depth, max_depth, tie_tolerance) and its strategy kinds."},
    {"measure", (PyCFunction)(void (*)(void))tt_py_measure, METH_VARARGS | METH_KEYWORDS,
     "measure(run, n_samples, *, sync=None, config=None, clock=None) -> stats"},
    {"compare", (PyCFunction)(void (*)(void))tt_py_compare, METH_VARARGS | METH_KEYWORDS,
     "compare(runs, n_samples, *, sync=None, config=None, clock=None) -> [stats]"},
    {"measure_paired", (PyCFunction)(void (*)(void))tt_py_measure_paired,
     METH_VARARGS | METH_KEYWORDS,
     "measure_paired(first, second, n_samples, *, sync=None, config=None, clock=None,\n"
     "rounds_min=None, rounds_max=None, width=None) -> {ratio, low, high, rounds, wins}:\n"
     "paired rounds (ratio: first's round over second's, its median; low, high: its 99 %\n"
     "interval), the engine's own measurement on a busy machine"},
    {"choose", (PyCFunction)(void (*)(void))tt_py_choose, METH_VARARGS | METH_KEYWORDS,
     "choose(kind, candidates, n_samples, *, sync=None, config=None, clock=None)\n"
     "-> (winner or -1, reports)"},
    {"tune_module", (PyCFunction)(void (*)(void))tt_py_tune_module, METH_VARARGS | METH_KEYWORDS,
     "tune_module(modules, node, *, path='', sync=None, config=None, clock=None) -> dict"},
    {"check_tweak_config", (PyCFunction)(void (*)(void))tt_py_check_tweak_config,
     METH_VARARGS | METH_KEYWORDS,
     "check_tweak_config(*, min_depth, max_depth, tie_tolerance, time_budget, config)"},
    {"tweak", (PyCFunction)(void (*)(void))tt_py_tweak, METH_VARARGS | METH_KEYWORDS,
     "tweak(tree, *, enter, modules, activate, leave, run, n_samples, ...) -> Result"},
    {"restore_result", (PyCFunction)tt_py_restore_result, METH_O,
     "restore_result(record) -> Result\n\n"
     "The Result of the numbers a caller kept of one, in the forms Result's getters give\n"
     "(rows, selected, baseline, confirmation, others_share, busy_stopped, budgets), checked\n"
     "by the engine (tw_result_restore): its table and outcome are written from them."},
    {"set_value_keyer", (PyCFunction)tt_py_set_value_keyer, METH_O,
     "set_value_keyer(fn or None)\n\n"
     "fn(value) -> a key of the value's structure, or None. Signatures made afterwards\n"
     "match a value fn keys (a key/value cache) by an equal key, not by identity."},
    {"replay_steps", (PyCFunction)(void (*)(void))tt_py_replay_steps, METH_VARARGS | METH_KEYWORDS,
     "replay_steps(replay, start, stop, every, finished) -> int\n\n"
     "A decode loop's tokens start..stop-1: replay() once per token, in bursts of\n"
     "`every`; after each burst, finished(tokens so far) ends the loop\n"
     "when true. Returns the tokens so far (stop, or fewer when finished said so)."},
    {"weight_sample", (PyCFunction)tt_py_weight_sample, METH_VARARGS,
     "weight_sample(tensor, span) -> bytes\n\n"
     "The sampled bytes of the span bytes from tensor.data_ptr(): all of them up to 1 KiB,\n"
     "else 16 pieces of 64 bytes spread over them. The caller vouches for the span\n"
     "(a strided CPU tensor's own bytes)."},
    {"weight_change", (PyCFunction)tt_py_weight_change, METH_VARARGS,
     "weight_change(weights, in_place) -> None or (index, kind)\n\n"
     "The first entry of weights (model_state.weights_of's list) whose tensor changed:\n"
     "kind 0 replaced in its module (or list), 1 given other memory; with in_place,\n"
     "2 written in place (for a tensor that keeps a version counter), 3 written behind\n"
     "its version counter (its sampled bytes differ; for an entry with a sample)."},
    {"dict_change", (PyCFunction)tt_py_dict_change, METH_O,
     "dict_change(pairs) -> None or (index, key)\n\n"
     "The first (live, saved, size, by_value) of pairs whose dict live no longer holds\n"
     "what saved holds, and the first key that differs: a value that is another object\n"
     "(with by_value, one also not equal: lists and tuples item by item, a tensor equal\n"
     "only to itself), a key gone; key None when only the number of keys is no longer\n"
     "size (-1: not read)."},
    {"class_change", (PyCFunction)tt_py_class_change, METH_O,
     "class_change(entries) -> None or index\n\n"
     "The first (obj, name, expected) of entries that no longer holds: name None,\n"
     "type(obj) is expected; else getattr(obj, name) == expected."},
    {"enable_vectorcall", (PyCFunction)tt_py_enable_vectorcall, METH_O,
     "enable_vectorcall(cls) -> bool\n\n"
     "Sets the vectorcall flag on a Python subclass of Dispatcher whose __call__\n"
     "is still Dispatcher's (Python < 3.12 does not inherit it for heap types).\n"
     "Returns whether calls of cls's instances now use vectorcall."},
    {NULL, NULL, 0, NULL}};

static PyModuleDef_Slot tt_module_slots[] = {
    {Py_mod_exec, (void *)tt_module_exec},
    {0, NULL}};

static PyModuleDef tt_module_def = {
    PyModuleDef_HEAD_INIT,
    .m_name = "torch_tweak._C",
    .m_doc = "torch-tweak's C extension: the engine's bindings and the dispatcher.",
    .m_size = sizeof(TtState),
    .m_methods = tt_module_methods,
    .m_slots = tt_module_slots,
    .m_traverse = tt_module_traverse,
    .m_clear = tt_module_clear,
    .m_free = tt_module_free,
};

PyMODINIT_FUNC
PyInit__C(void)
{
    tt_state_use_def(&tt_module_def);
    return PyModuleDef_Init(&tt_module_def);
}
