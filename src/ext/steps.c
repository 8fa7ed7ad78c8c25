/*
 * steps.c - replay_steps: the per-token loop of tweak's graph decode loop.
 *
 * Each decode step is recorded once as a device graph (Python records it:
 * _runtime/decode/graph.py). Generating then means replaying that step once
 * per token and, every few tokens, asking whether every sequence has ended (a
 * read of the device, so not after every token; when, and the question, are
 * the Python stopping rule's: _runtime/decode/steps.py, Stopping.replay). That
 * loop runs here, not in Python: per token, one call of the replay and a check
 * for signals.
 */
#include "steps.h"

/* replay(), `count` times, checking for signals before each (a long decode
 * stays interruptible). 0, or -1 with the exception set. */
static int
tt_steps_burst(PyObject *replay, Py_ssize_t count)
{
    PyObject *res; /* new reference */
    Py_ssize_t i;

    for (i = 0; i < count; i++) {
        if (PyErr_CheckSignals() < 0)
            return -1;
        res = PyObject_CallNoArgs(replay);
        if (res == NULL)
            return -1;
        Py_DECREF(res);
    }
    return 0;
}

PyObject *
tt_py_replay_steps(PyObject *module, PyObject *args, PyObject *kwargs)
{
    static char *kwlist[] = {"replay", "start", "stop", "every", "finished", NULL};
    PyObject *replay, *finished;
    PyObject *res, *arg; /* new references */
    Py_ssize_t start, stop, every, done, burst;
    int ended;

    (void)module;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "OnnnO:replay_steps", kwlist, &replay, &start,
                                     &stop, &every, &finished))
        return NULL;
    if (!PyCallable_Check(replay))
        return PyErr_Format(PyExc_TypeError, "replay_steps: replay must be callable, not %.100s",
                            Py_TYPE(replay)->tp_name);
    if (!PyCallable_Check(finished))
        return PyErr_Format(PyExc_TypeError, "replay_steps: finished must be callable, not %.100s",
                            Py_TYPE(finished)->tp_name);
    if (start < 0 || stop < 0)
        return PyErr_Format(PyExc_ValueError,
                            "replay_steps: start and stop count tokens and must be >= 0, got %zd and %zd",
                            start, stop);
    if (every < 1)
        return PyErr_Format(PyExc_ValueError,
                            "replay_steps: every must be >= 1 (replays between two checks), got %zd",
                            every);
    done = start;
    while (done < stop) {
        burst = stop - done < every ? stop - done : every;
        if (tt_steps_burst(replay, burst) < 0)
            return NULL;
        done += burst;
        if ((arg = PyLong_FromSsize_t(done)) == NULL)
            return NULL;
        res = PyObject_CallOneArg(finished, arg);
        Py_DECREF(arg);
        if (res == NULL)
            return NULL;
        ended = PyObject_IsTrue(res);
        Py_DECREF(res);
        if (ended < 0)
            return NULL;
        if (ended)
            break;
    }
    return PyLong_FromSsize_t(done);
}
