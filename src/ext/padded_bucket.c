/*
 * padded_bucket.c - a PaddedReplay's buckets: the bucket rule (the bucket of
 * a call's batch and length, the range of calls a bucket takes; the padded
 * backend's Python asks it through _pad_key, _pad_lower and
 * _pad_batch_bucket; the per-call path asks tt_pad_key), which ready
 * bucket's range holds a call, the buckets Python sets (_pad_bucket: its
 * buffers, graph and outputs; _pad_serve: it serves from now on; _pad_drop:
 * its contents released, unless a call is being served from it) and their
 * counters (hits, valid and served elements). Which buckets are made, and
 * when one serves, are Python's decisions (backends/padded.py). See padded.c
 * for the design.
 */
#include "padded_replay.h"

/* ------------------------------------------------------- the bucket rule */

/* Batch buckets: powers of two up to TT_PAD_POW2_UP_TO; past it, steps of a
 * quarter of the power of two below (9-16 by 4, 17-32 by 4, 33-64 by 8,
 * 65-128 by 16...): there the work is arithmetic more than launches, and at
 * most a fifth of a call's rows are padding. */
#define TT_PAD_POW2_UP_TO 8

/* The number of bits of x >= 0 (Python's int.bit_length). */
static Py_ssize_t
tt_pad_bit_length(Py_ssize_t x)
{
    Py_ssize_t bits = 0;

    while (x > 0) {
        bits++;
        x >>= 1;
    }
    return bits;
}

/* a // d, rounded down (Python's //), for d > 0. */
static Py_ssize_t
tt_pad_floor_div(Py_ssize_t a, Py_ssize_t d)
{
    Py_ssize_t q = a / d;

    return (a % d != 0 && a < 0) ? q - 1 : q;
}

/* The step of the batch buckets past TT_PAD_POW2_UP_TO around batch b. */
static Py_ssize_t
tt_pad_batch_step(Py_ssize_t b)
{
    Py_ssize_t quarter = ((Py_ssize_t)1 << (tt_pad_bit_length(b - 1) - 1)) / 4;

    return quarter > 4 ? quarter : 4;
}

/* The batch bucket of batch b (b >= 0). */
static Py_ssize_t
tt_pad_batch_bucket(Py_ssize_t b)
{
    Py_ssize_t step;

    if (b <= TT_PAD_POW2_UP_TO)
        return (Py_ssize_t)1 << tt_pad_bit_length(b > 1 ? b - 1 : 0);
    step = tt_pad_batch_step(b);
    return -tt_pad_floor_div(-b, step) * step;
}

/* Reads a bucket rule's sizes (b, n >= 0) and step (>= 1) from Python's
 * arguments. -1 with ValueError naming the bad one. */
static int
tt_pad_rule_args(Py_ssize_t b, Py_ssize_t n, Py_ssize_t step, const char *who)
{
    if (b < 0 || n < 0 || step < 1) {
        PyErr_Format(PyExc_ValueError, "%s: sizes must be >= 0 and the length step >= 1, "
                     "got batch %zd, length %zd, step %zd", who, b, n, step);
        return -1;
    }
    return 0;
}

/* padded_replay.h */
PyObject *
tt_pad_py_batch_bucket(PyObject *unused, PyObject *args)
{
    Py_ssize_t b;

    (void)unused;
    if (!PyArg_ParseTuple(args, "n:_pad_batch_bucket", &b) ||
        tt_pad_rule_args(b, 0, 1, "_pad_batch_bucket") < 0)
        return NULL;
    return PyLong_FromSsize_t(tt_pad_batch_bucket(b));
}

/* The bucket rule: 1 with the bucket (*bb, *bn) of a call of batch b and
 * length n, 0 outside the range. */
static int
tt_pad_key_as(Py_ssize_t b, Py_ssize_t n, int batch, int length, Py_ssize_t max_batch,
              Py_ssize_t max_length, Py_ssize_t step, Py_ssize_t *bb, Py_ssize_t *bn)
{
    if ((batch && b > max_batch) || (length && n > max_length))
        return 0;
    *bb = batch ? tt_pad_batch_bucket(b) : b;
    *bn = n;
    if (length) {
        *bn = -tt_pad_floor_div(-n, step) * step;
        if (*bn > max_length)
            *bn = max_length;
    }
    return 1;
}

/* The smallest batch and length that fall into bucket (b, n). */
static void
tt_pad_lower_as(Py_ssize_t b, Py_ssize_t n, int batch, int length, Py_ssize_t step,
                Py_ssize_t *low_b, Py_ssize_t *low_n)
{
    *low_b = b;
    if (batch && b > 1)
        *low_b = b <= TT_PAD_POW2_UP_TO ? b / 2 + 1 : b - tt_pad_batch_step(b) + 1;
    *low_n = length ? tt_pad_floor_div(n - 1, step) * step + 1 : n;
    if (*low_n > n)
        *low_n = n;
    if (*low_n < 1)
        *low_n = 1;
}

/* padded_replay.h */
int
tt_pad_key(const TtPaddedReplay *self, Py_ssize_t b, Py_ssize_t n, Py_ssize_t *bb, Py_ssize_t *bn)
{
    return tt_pad_key_as(b, n, self->batch, self->length, self->max_batch, self->max_length,
                         self->step, bb, bn);
}

/* padded_replay.h */
PyObject *
tt_pad_py_key(PyObject *unused, PyObject *args)
{
    Py_ssize_t b, n, max_batch, max_length, step, bb, bn;
    int batch, length;

    (void)unused;
    if (!PyArg_ParseTuple(args, "nnppnnn:_pad_key", &b, &n, &batch, &length, &max_batch,
                          &max_length, &step) ||
        tt_pad_rule_args(b, n, step, "_pad_key") < 0)
        return NULL;
    if (!tt_pad_key_as(b, n, batch, length, max_batch, max_length, step, &bb, &bn))
        Py_RETURN_NONE;
    return Py_BuildValue("(nn)", bb, bn);
}

/* padded_replay.h */
PyObject *
tt_pad_py_lower(PyObject *unused, PyObject *args)
{
    Py_ssize_t b, n, step, low_b, low_n;
    int batch, length;

    (void)unused;
    if (!PyArg_ParseTuple(args, "nnppn:_pad_lower", &b, &n, &batch, &length, &step) ||
        tt_pad_rule_args(b, n, step, "_pad_lower") < 0)
        return NULL;
    tt_pad_lower_as(b, n, batch, length, step, &low_b, &low_n);
    return Py_BuildValue("(nn)", low_b, low_n);
}

/* padded_replay.h */
TtPadBucket *
tt_pad_find(TtPaddedReplay *self, Py_ssize_t b, Py_ssize_t n)
{
    Py_ssize_t k, i;

    for (k = 0; k <= self->nbuckets; k++) {
        TtPadBucket *bk;

        i = k == 0 ? self->last : k - 1;
        if (i >= self->nbuckets)
            continue;
        bk = self->buckets[i];
        if (bk->ready && bk->low_b <= b && b <= bk->b && bk->low_n <= n && n <= bk->n) {
            self->last = i;
            return bk;
        }
    }
    return NULL;
}

/* padded_replay.h */
TtPadBucket *
tt_pad_held(TtPaddedReplay *self, Py_ssize_t b, Py_ssize_t n)
{
    Py_ssize_t i;

    for (i = 0; i < self->nbuckets; i++)
        if (self->buckets[i]->b == b && self->buckets[i]->n == n)
            return self->buckets[i]->buffers != NULL ? self->buckets[i] : NULL;
    return NULL;
}

/* The bucket of sizes (b, n), made (counters only) when there is none.
 * Borrowed from this object; NULL with MemoryError. */
static TtPadBucket *
tt_pad_bucket_of(TtPaddedReplay *self, Py_ssize_t b, Py_ssize_t n)
{
    TtPadBucket *bk = NULL, **grown;
    Py_ssize_t i;

    for (i = 0; i < self->nbuckets; i++)
        if (self->buckets[i]->b == b && self->buckets[i]->n == n)
            return self->buckets[i];
    if (self->nbuckets == self->room) {
        grown = PyMem_Realloc(self->buckets, sizeof(*grown) * (size_t)(2 * self->room + 8));
        if (grown == NULL)
            goto error;
        self->buckets = grown;
        self->room = 2 * self->room + 8;
    }
    if ((bk = PyMem_Calloc(1, sizeof(*bk))) == NULL)
        goto error;
    bk->b = bk->low_b = b;
    bk->n = bk->low_n = n;
    self->buckets[self->nbuckets++] = bk;
    return bk;
error:
    PyErr_NoMemory();
    return NULL;
}

/* Whether buffer s (a torch.Tensor) is of its slot's dtype and the bucket's
 * shape (bb, bn on the padded axes, the recorded sizes elsewhere). -1 with an
 * exception that names the buffer when not. */
static int
tt_pad_check_buffer(TtPaddedReplay *self, Py_ssize_t s, PyObject *buffer, Py_ssize_t bb,
                    Py_ssize_t bn)
{
    TtState *st = self->state;
    const TtPadSlot *slot = &self->slots[s];
    PyObject *dtype = NULL, *shape = NULL; /* new references */
    Py_ssize_t axis, want, size;
    int rc = -1;

    if (Py_TYPE(buffer) != st->tensor_type) {
        PyErr_Format(PyExc_TypeError, "_pad_bucket: buffer %zd must be a torch.Tensor", s);
        goto cleanup;
    }
    if ((dtype = PyObject_GetAttr(buffer, st->str_dtype)) == NULL ||
        (shape = PyObject_GetAttr(buffer, st->str_shape)) == NULL)
        goto cleanup;
    if (dtype != slot->dtype) {
        PyErr_Format(PyExc_ValueError, "_pad_bucket: buffer %zd is not of its slot's dtype", s);
        goto cleanup;
    }
    if (!PyTuple_Check(shape) || PyTuple_GET_SIZE(shape) != PyTuple_GET_SIZE(slot->shape))
        goto bad_shape;
    for (axis = 0; axis < PyTuple_GET_SIZE(shape); axis++) {
        want = axis == 0 && slot->batch ? bb : axis == 1 && slot->seq ? bn : tt_pad_size(slot->shape, axis);
        if ((size = tt_pad_size(shape, axis)) < 0 || want < 0)
            goto cleanup;
        if (size != want)
            goto bad_shape;
    }
    rc = 0;
    goto cleanup;
bad_shape:
    PyErr_Format(PyExc_ValueError, "_pad_bucket: buffer %zd is not of the bucket's shape", s);
cleanup:
    Py_XDECREF(dtype);
    Py_XDECREF(shape);
    return rc;
}

/* Whether (b, n) is a bucket of the rule (the bucket of its own smallest
 * call) and `held` (a tuple) holds a buffer per slot that fits it; the
 * bucket's range in *low_b, *low_n. -1 with an exception when not. */
static int
tt_pad_check_bucket(TtPaddedReplay *self, Py_ssize_t b, Py_ssize_t n, PyObject *held,
                    Py_ssize_t *low_b, Py_ssize_t *low_n)
{
    Py_ssize_t s, kb = -1, kn = -1;

    if (self->nparams == 0) {
        PyErr_SetString(PyExc_RuntimeError, "_pad_bucket: no call layout (_pad_layout)");
        return -1;
    }
    tt_pad_lower_as(b, n, self->batch, self->length, self->step, low_b, low_n);
    if (b < 1 || n < 0 || (!self->length && n != 0) ||
        !tt_pad_key(self, *low_b, self->length ? *low_n : 0, &kb, &kn) || kb != b || kn != n) {
        PyErr_Format(PyExc_ValueError, "_pad_bucket: %zd x %zd is not a bucket's size", b, n);
        return -1;
    }
    if (!self->length)
        *low_n = 0;
    if (PyTuple_GET_SIZE(held) != self->nslots) {
        PyErr_Format(PyExc_ValueError, "_pad_bucket: %zd buffers for %zd slots",
                     PyTuple_GET_SIZE(held), self->nslots);
        return -1;
    }
    for (s = 0; s < self->nslots; s++)
        if (tt_pad_check_buffer(self, s, PyTuple_GET_ITEM(held, s), b, n) < 0)
            return -1;
    return 0;
}

/* The bucket (b, n) of this object's buckets, or NULL with KeyError. */
static TtPadBucket *
tt_pad_named(TtPaddedReplay *self, PyObject *args, const char *format)
{
    Py_ssize_t b, n, i;

    if (!PyArg_ParseTuple(args, format, &b, &n))
        return NULL;
    for (i = 0; i < self->nbuckets; i++)
        if (self->buckets[i]->b == b && self->buckets[i]->n == n)
            return self->buckets[i];
    PyErr_Format(PyExc_KeyError, "no bucket %zd x %zd", b, n);
    return NULL;
}

PyObject *
tt_pad_set_bucket(TtPaddedReplay *self, PyObject *args, PyObject *kwargs)
{
    static char *kwlist[] = {"b", "n", "buffers", "graph", "outputs", "rebuild", NULL};
    TtState *st = self->state;
    Py_ssize_t b, n, low_b, low_n;
    PyObject *buffers, *graph, *outputs, *rebuild; /* borrowed */
    PyObject *held = NULL;                         /* new reference: a tuple of the buffers */
    TtPadBucket *bk;
    PyObject *result = NULL;

    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "nnOOOO:_pad_bucket", kwlist, &b, &n, &buffers,
                                     &graph, &outputs, &rebuild))
        goto cleanup;
    if ((held = tt_sequence_tuple(buffers, "_pad_bucket: buffers must be a sequence")) == NULL ||
        tt_pad_check_bucket(self, b, n, held, &low_b, &low_n) < 0)
        goto cleanup;
    if (graph != Py_None && !PyObject_TypeCheck(graph, st->GraphReplayType)) {
        PyErr_SetString(PyExc_TypeError, "_pad_bucket: graph must be a GraphReplay or None");
        goto cleanup;
    }
    if (graph != Py_None && (!PyList_CheckExact(outputs) || PyList_GET_SIZE(outputs) != self->nouts)) {
        PyErr_Format(PyExc_ValueError, "_pad_bucket: a graph's outputs must be a list of its %zd "
                     "output leaves", self->nouts);
        goto cleanup;
    }
    if (rebuild != Py_None ? !PyCallable_Check(rebuild) : self->nouts != 1) {
        PyErr_SetString(PyExc_ValueError, "_pad_bucket: rebuild must be callable, or None for "
                        "one output leaf");
        goto cleanup;
    }
    if ((bk = tt_pad_bucket_of(self, b, n)) == NULL)
        goto cleanup;
    bk->ready = 0; /* set anew: it serves again only once _pad_serve says so */
    bk->low_b = low_b;
    bk->low_n = low_n;
    Py_CLEAR(bk->buffers);
    Py_XSETREF(bk->graph, graph != Py_None ? Py_NewRef(graph) : NULL);
    Py_XSETREF(bk->outputs, graph != Py_None ? PyList_GetSlice(outputs, 0, self->nouts) : NULL);
    Py_XSETREF(bk->rebuild, rebuild != Py_None ? Py_NewRef(rebuild) : NULL);
    if (graph != Py_None && bk->outputs == NULL)
        goto cleanup;
    bk->buffers = held; /* last: the bucket is held */
    held = NULL;
    result = Py_NewRef(Py_None);
cleanup:
    Py_XDECREF(held);
    return result;
}

PyObject *
tt_pad_serve_bucket(TtPaddedReplay *self, PyObject *args)
{
    TtPadBucket *bk = tt_pad_named(self, args, "nn:_pad_serve");

    if (bk == NULL)
        return NULL;
    if (bk->buffers == NULL) {
        PyErr_Format(PyExc_ValueError, "_pad_serve: bucket %zd x %zd holds nothing to serve", bk->b, bk->n);
        return NULL;
    }
    bk->ready = 1;
    Py_RETURN_NONE;
}

PyObject *
tt_pad_drop(TtPaddedReplay *self, PyObject *args)
{
    TtPadBucket *bk = tt_pad_named(self, args, "nn:_pad_drop");

    if (bk == NULL) {
        if (!PyErr_ExceptionMatches(PyExc_KeyError))
            return NULL;
        PyErr_Clear(); /* no such bucket: nothing to let go */
        Py_RETURN_TRUE;
    }
    if (bk == self->serving) /* a call is replaying it: it stays */
        Py_RETURN_FALSE;
    bk->ready = 0;
    Py_CLEAR(bk->buffers);
    Py_CLEAR(bk->graph);
    Py_CLEAR(bk->outputs);
    Py_CLEAR(bk->rebuild);
    Py_RETURN_TRUE;
}

PyObject *
tt_pad_set_range(TtPaddedReplay *self, PyObject *args)
{
    Py_ssize_t max_batch, max_length;

    if (!PyArg_ParseTuple(args, "nn:_pad_range", &max_batch, &max_length))
        return NULL;
    if (self->nparams == 0 || max_batch < 1 || (self->length && max_length < 1)) {
        PyErr_SetString(PyExc_ValueError, "_pad_range: a laid-out PaddedReplay, max_batch >= 1 and "
                        "max_length >= 1 when the length is padded");
        return NULL;
    }
    self->max_batch = max_batch;
    self->max_length = max_length;
    Py_RETURN_NONE;
}

PyObject *
tt_pad_counts(TtPaddedReplay *self, PyObject *unused)
{
    PyObject *result = PyDict_New(); /* new reference */
    Py_ssize_t i;

    (void)unused;
    for (i = 0; result != NULL && i < self->nbuckets; i++) {
        const TtPadBucket *bk = self->buckets[i];
        PyObject *key = Py_BuildValue("(nn)", bk->b, bk->n);
        PyObject *value = Py_BuildValue("(KKK)", bk->hits, bk->valid, bk->served);

        if (key == NULL || value == NULL || PyDict_SetItem(result, key, value) < 0)
            Py_CLEAR(result);
        Py_XDECREF(key);
        Py_XDECREF(value);
    }
    return result;
}

PyObject *
tt_pad_reset_counts(TtPaddedReplay *self, PyObject *unused)
{
    Py_ssize_t i;

    (void)unused;
    for (i = 0; i < self->nbuckets; i++)
        self->buckets[i]->hits = self->buckets[i]->valid = self->buckets[i]->served = 0;
    self->fast = self->slow = self->outside = 0;
    Py_RETURN_NONE;
}

PyObject *
tt_pad_ready(TtPaddedReplay *self, PyObject *unused)
{
    PyObject *result = PyList_New(0); /* new reference */
    Py_ssize_t i;

    (void)unused;
    for (i = 0; result != NULL && i < self->nbuckets; i++) {
        const TtPadBucket *bk = self->buckets[i];
        PyObject *key;

        if (!bk->ready)
            continue;
        key = Py_BuildValue("(nn)", bk->b, bk->n);
        if (key == NULL || PyList_Append(result, key) < 0)
            Py_CLEAR(result);
        Py_XDECREF(key);
    }
    return result;
}
