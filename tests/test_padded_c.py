"""The padded backend's steady per-call path in C (_C.PaddedReplay, the base type of
backends.padded.PaddedCall): whether a call fits is decided there (held call for call to the
rule Python had before, the oracle below), a call of a ready bucket is found, copied in, run
and cut back in C, a call that does not fit or falls outside the range runs the target there;
a call that fits whose bucket is not ready comes back to Python (_slow). On a CPU the bucket
runs the module on its buffers (graph=False; tests/gpu/test_padded_gpu.py replays graphs).

Every test compares the tuned model (or its backend's callable) with an untuned copy taken
before tuning."""

from __future__ import annotations

import collections
import copy
import random

import pytest
import torch
import torch.utils._pytree as pytree
from torch import nn

import torch_tweak as tt
from torch_tweak import _C
from torch_tweak.backends import PaddedGraphBackend
from torch_tweak._core.layout import layout_of
from torch_tweak.backends import padded as padded_module
from support import FAST, in_threads
from test_varying import Pool, mlp, requests


def tune(model, data, **options):
    (w,) = tt.wrap(model, [""], strategy=tt.OneBackendStrategy(
        PaddedGraphBackend(graph=False, compile=False, **options)))
    tt.tune(model, data, measure=FAST)
    (group,) = [g for g in w.tt_signatures if g.varying]
    assert group.backend is not None, group.error
    call = group.backend.callable
    assert isinstance(call, _C.PaddedReplay) and call.serves_here
    return w, call


def same_or_both_raise(tuned, untuned):
    """tuned() gives untuned()'s answer, or both raise."""
    try:
        want = untuned()
    except Exception as exc:  # the original's own refusal
        with pytest.raises(type(exc)):
            tuned()
        return
    torch.testing.assert_close(tuned(), want)


def test_batches_padded_in_c_give_the_untuned_answers():
    model = mlp()
    untuned = copy.deepcopy(model)
    w, call = tune(model, [torch.randn(b, 16) for b in (3, 5, 1, 8, 6)])
    before = call.slow_calls
    with torch.inference_mode():
        for b in (1, 3, 4, 5, 7, 8, 8, 6, 1, 3):  # every one inside a recorded bucket (1, 4, 8)
            x = torch.randn(b, 16)
            torch.testing.assert_close(model(x), untuned(x))
    assert call.fast_calls == 10 and call.slow_calls == before
    assert sum(w.tt_untuned.values()) == 0


def test_lengths_padded_in_c_are_zeroed_past_each_call():
    # long calls then short ones in the same buckets: positions a short call does not have
    # hold the last long call's tokens unless the C path zeroes them (the mask there too)
    torch.manual_seed(0)
    model = Pool(True).eval()
    untuned = copy.deepcopy(model)
    w, call = tune(model, requests(8, 0, batches=(1, 2, 4), lengths=range(5, 40)))
    stream = requests(40, 1, batches=(1, 2, 4), lengths=range(2, 40))
    stream = sorted(stream, key=lambda r: -r["input_ids"].shape[1])
    with torch.inference_mode():
        for r in stream:
            torch.testing.assert_close(model(**r), untuned(**r))
    assert call.fast_calls >= 30
    assert sum(w.tt_untuned.values()) == 0


@pytest.mark.slow
def test_a_transformer_padded_in_c_gives_the_untuned_answers_on_valid_positions():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.BertConfig(vocab_size=50, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                                     intermediate_size=64, max_position_embeddings=64)
    model = transformers.BertModel(config, add_pooling_layer=False).eval()
    untuned = copy.deepcopy(model)
    w, call = tune(model, requests(8, 0, batches=(1, 2, 4), lengths=range(5, 40)))
    with torch.inference_mode():
        for r in requests(20, 2, batches=(1, 2, 3, 4), lengths=range(3, 40)):
            got, want = model(**r).last_hidden_state, untuned(**r).last_hidden_state
            valid = r["attention_mask"].bool()
            torch.testing.assert_close(got[valid], want[valid], rtol=1e-4, atol=1e-5)
    assert call.fast_calls > 0


def test_a_call_outside_the_range_runs_the_target_in_c():
    model = mlp()
    untuned = copy.deepcopy(model)
    w, call = tune(model, [torch.randn(b, 16) for b in (3, 5, 1, 8, 6)], max_batch=16)
    top = call.describe()["batch_range"][1]
    slow = call.slow_calls
    with torch.inference_mode():
        for b in (top + 1, top + 40):
            x = torch.randn(b, 16)
            torch.testing.assert_close(model(x), untuned(x))
    assert call.slow_calls == slow and call.outside_calls == 2 and call.describe()["outside_range"] == 2


def test_eight_threads_calling_with_mixed_shapes():
    torch.manual_seed(0)
    model = Pool(True).eval()
    untuned = copy.deepcopy(model)
    _, call = tune(model, requests(8, 0, batches=(1, 2, 4), lengths=range(5, 40)))
    stream = requests(96, 4, batches=(1, 2, 3, 4), lengths=range(2, 40))
    with torch.inference_mode():
        wanted = [untuned(**r) for r in stream]
    in_threads(len(stream), lambda i: torch.testing.assert_close(model(**stream[i]), wanted[i]))
    assert call.fast_calls > 0


@pytest.mark.slow
def test_eight_threads_calling_the_backend_itself():
    # past the dispatcher's lock: a call while another is inside runs the target on its own
    # arguments, never on the buffers another call is writing
    model = mlp()
    untuned = copy.deepcopy(model)
    _, call = tune(model, [torch.randn(b, 16) for b in (3, 5, 1, 8, 6)])
    xs = [torch.randn(1 + i % 8, 16) for i in range(160)]
    with torch.inference_mode():
        wanted = [untuned(x) for x in xs]
    in_threads(len(xs), lambda i: torch.testing.assert_close(call(xs[i]), wanted[i]))


@pytest.mark.slow
@pytest.mark.parametrize("through", ["model", "backend"])
def test_hostile_calls_get_the_original_answer_or_its_error(through):
    model = mlp()
    untuned = copy.deepcopy(model)
    _, call = tune(model, [torch.randn(b, 16) for b in (3, 5, 1, 8, 6)])
    fn = model if through == "model" else call
    wide = torch.randn(16, 6)
    cases = {
        "non-contiguous": wide.t(),                           # a transposed view, batch 6
        "strided rows": torch.randn(10, 16)[::2],             # every other row, batch 5
        "float64": torch.randn(4, 16, dtype=torch.float64),   # the recorded dtype is float32
        "int64": torch.ones(4, 16, dtype=torch.long),
        "meta": torch.empty(4, 16, device="meta"),            # another device
        "wrong width": torch.randn(4, 12),
        "a subclass": nn.Parameter(torch.randn(3, 16), requires_grad=False),
    }
    with torch.inference_mode():
        for name, x in cases.items():
            same_or_both_raise(lambda: fn(x), lambda: untuned(x))
        # and the buffers were left fit for the next call
        x = torch.randn(3, 16)
        torch.testing.assert_close(fn(x), untuned(x))
    assert call.describe()["refused_buckets"] == 0


@pytest.mark.slow
def test_a_call_outside_inference_mode_after_a_bucket_seen_inside_it():
    # a bucket first seen under inference_mode: its buffers are plain tensors, so a later call
    # under no_grad can still write them
    model = mlp()
    untuned = copy.deepcopy(model)
    _, call = tune(model, [torch.randn(b, 16) for b in (3, 5, 1, 8, 6)])
    x = torch.randn(12, 16)
    with torch.inference_mode():
        torch.testing.assert_close(model(x), untuned(x))  # first sight of bucket 12
    with torch.no_grad():
        for _ in range(2):
            torch.testing.assert_close(model(x), untuned(x))
    assert call.describe()["buckets"]["12"] == 2


class Bare(_C.PaddedReplay):
    pass


def laid_out(call, axes, length=False, target=lambda t: t * 2, max_batch=64, max_length=64, step=8):
    bare = Bare()
    bare._pad_layout(call, axes, [(True, length)], length, target, list, max_batch, max_length, step)
    return bare


def test_bad_layouts_and_buckets_are_refused():
    x = torch.randn(4, 16)
    with pytest.raises(TypeError, match="call must be an"):
        laid_out([x], [(True, False)])
    with pytest.raises(ValueError, match="holds 1 tensors .* 2 slots were given"):
        laid_out(((x,), {}), [(True, False), (True, False)])
    with pytest.raises(ValueError, match="subclass of torch.Tensor"):
        laid_out(((nn.Parameter(x),), {}), [(True, False)])
    with pytest.raises(ValueError, match="holds 0 tensors"):  # a tensor in a container the fit cannot walk
        laid_out(((collections.OrderedDict(x=x),), {}), [(True, False)])
    with pytest.raises(ValueError, match="max_batch and step must be >= 1"):
        laid_out(((x,), {}), [(True, False)], step=0)
    good = laid_out(((x,), {}), [(True, False)])
    with pytest.raises(RuntimeError, match="set once"):
        good._pad_layout(((x,), {}), [(True, False)], [(True, False)], False, len, list, 8, 8, 1)
    with pytest.raises(ValueError, match="5 x 0 is not a bucket's size"):
        good._pad_bucket(5, 0, [torch.zeros(5, 16)], None, None, None)
    with pytest.raises(ValueError, match="1 slots"):
        good._pad_bucket(4, 0, [], None, None, None)
    with pytest.raises(ValueError, match="dtype"):
        good._pad_bucket(4, 0, [torch.zeros(4, 16, dtype=torch.float64)], None, None, None)
    with pytest.raises(ValueError, match="the bucket's shape"):
        good._pad_bucket(4, 0, [torch.zeros(4, 17)], None, None, None)
    with pytest.raises(TypeError, match="GraphReplay"):
        good._pad_bucket(4, 0, [torch.zeros(4, 16)], object(), [], None)
    with pytest.raises(ValueError, match="holds nothing to serve"):
        good._pad_bucket(8, 0, [torch.zeros(8, 16)], None, None, None)
        assert good._pad_drop(8, 0)
        good._pad_serve(8, 0)
    good._pad_bucket(4, 0, [torch.zeros(4, 16)], None, None, None)
    y = torch.randn(3, 16)
    with pytest.raises(AttributeError):  # held, not ready: a call that fits goes to _slow, which Bare lacks
        good(y)
    good._pad_serve(4, 0)
    torch.testing.assert_close(good(y), y * 2)  # served in C: the target on the buffer, cut back
    assert good.fast_calls == 1 and good._pad_counts()[(4, 0)] == (1, 3, 4)
    z = torch.randn(65, 16)  # past max_batch: the target on the call as it is, counted
    torch.testing.assert_close(good(z), z * 2)
    assert good.outside_calls == 1 and good.slow_calls == 1
    assert good._pad_drop(4, 0) and good._pad_ready() == []


class ManyInputs(nn.Module):
    """More tensors per call than the C path keeps in its frame (its arrays go to the heap)."""

    def __init__(self, count: int = 20) -> None:
        super().__init__()
        self.weights = nn.Parameter(torch.randn(count, 16), requires_grad=False)

    def forward(self, *xs):
        return sum(x * w for x, w in zip(xs, self.weights))


def test_a_call_of_many_tensors_is_served_in_c():
    torch.manual_seed(0)
    model = ManyInputs().eval()
    untuned = copy.deepcopy(model)
    _, call = tune(model, [tuple(torch.randn(b, 16) for _ in range(20)) for b in (3, 5, 1, 8, 6)])
    before = call.fast_calls
    with torch.inference_mode():
        for b in (3, 7, 1, 8):  # each inside a recorded bucket (1, 4, 8)
            xs = tuple(torch.randn(b, 16) for _ in range(20))
            torch.testing.assert_close(model(*xs), untuned(*xs))
    assert call.fast_calls == before + 4


def _python_rule(b, n, batch, length, max_batch, max_length, step):
    """The bucket rule as backends/padded.py wrote it before the C type owned it: the reference
    the C rule is held to, call for call."""
    def next_pow2(x):
        return 1 << max(0, x - 1).bit_length()

    def batch_step(x):
        return max(4, (1 << (x - 1).bit_length() - 1) // 4)

    def bucket(x):
        return next_pow2(x) if x <= 8 else -(-x // batch_step(x)) * batch_step(x)

    key = None
    if not ((batch and b > max_batch) or (length and n > max_length)):
        key = (bucket(b) if batch else b, min(-(-n // step) * step, max_length) if length else n)
    low_b = (b // 2 + 1 if b <= 8 else b - batch_step(b) + 1) if batch and b > 1 else b
    low_n = ((n - 1) // step) * step + 1 if length else n
    return bucket(b), key, (low_b, max(1, min(low_n, n)))


def test_the_bucket_rule_is_the_c_types_and_gives_what_python_gave():
    rule = _C.PaddedReplay
    for batch, length, max_batch, max_length, step in ((True, False, 64, 0, 1), (True, True, 200, 96, 8),
                                                       (False, True, 1, 512, 24), (True, True, 1000, 300, 40)):
        for b in range(0, 260, 1):
            for n in (0, 1, 7, 8, 9, 23, 24, 25, 95, 96, 97, 300, 301, 511, 512, 513):
                want_bucket, want_key, want_lower = _python_rule(b, n, batch, length, max_batch, max_length, step)
                assert rule._pad_batch_bucket(b) == want_bucket, b
                assert rule._pad_key(b, n, batch, length, max_batch, max_length, step) == want_key, (b, n)
                assert rule._pad_lower(b, n, batch, length, step) == want_lower, (b, n)
    with pytest.raises(ValueError, match="sizes must be >= 0"):
        rule._pad_key(-1, 0, True, False, 8, 0, 1)
    with pytest.raises(ValueError, match="step >= 1"):
        rule._pad_lower(4, 4, True, True, 0)


def test_python_calls_of_a_bucket_copy_and_cut_by_the_c_rule():
    """_pad_filled and _pad_run (the calls Python makes of a bucket: recording, a new bucket's
    check) against the rule written out with slices: rows past b untouched, a length axis
    zeroed past n in the call's rows, outputs cut and copied; bad calls refused."""
    torch.manual_seed(0)
    recorded = ((torch.randn(2, 9, 3), torch.randn(2, 5), torch.randn(4)), {})
    bare = Bare()
    bare._pad_layout(recorded, [(True, True), (True, False), (False, False)],
                     [(True, True), (False, False), (True, False), (False, False)], True,
                     lambda a, b, c: (a * 1, "plain", b * 1, None), list, 64, 64, 16)
    buffers = [torch.full((4, 16, 3), 7.0), torch.full((4, 5), 7.0), torch.full((4,), 7.0)]
    bare._pad_bucket(4, 16, buffers, None, None, tuple)
    call = ((torch.randn(3, 10, 3), torch.randn(3, 5), torch.randn(4)), {})
    want = [b.clone() for b in buffers]
    want[0][:3, 10:] = 0
    want[0][:3, :10] = call[0][0]
    want[1][:3] = call[0][1]
    want[2][:] = call[0][2]
    args, kwargs = bare._pad_filled(call)
    assert kwargs == {} and all(got is buffer for got, buffer in zip(args, buffers))
    for got, expected in zip(buffers, want):
        assert torch.equal(got, expected)
    assert torch.equal(buffers[0][3:], torch.full((1, 16, 3), 7.0))  # rows past the call's: as they were
    out = bare._pad_run(call, True)
    assert torch.equal(out[0], call[0][0]) and out[1] == "plain" and out[3] is None
    assert torch.equal(out[2], call[0][1])
    assert out[0].data_ptr() != buffers[0].data_ptr()  # copied: a later call cannot change it
    assert bare._pad_counts()[(4, 16)] == (1, 30, 64)
    with pytest.raises(ValueError, match="does not fit the layout"):
        bare._pad_run(((torch.randn(3, 10, 3), torch.randn(3, 6), torch.randn(4)), {}))
    with pytest.raises(LookupError, match="bucket 8 x 16 holds nothing"):
        bare._pad_run(((torch.randn(5, 10, 3), torch.randn(5, 5), torch.randn(4)), {}))
    with pytest.raises(TypeError):
        bare._pad_run(([call[0]], {}))


# ------------------------------------------------- the fit, held to the former rule


def _former_fit(recorded, params, call):
    """Plan.fits and _sizes as backends/padded.py wrote them before the C type owned the fit
    (the oracle the C fit is held to, call for call), with the three places the C fit is
    meant to differ written out: a plain value of the call must be the recorded one (of its
    exact type and equal: the former rule looked at tensors only, and a graph keeps the plain
    values it was recorded with), a tensor must be a torch.Tensor itself (not a subclass,
    which may change what a copy does), and keyword arguments are taken by name, as a call
    takes them (the former rule compared their order too)."""
    leaves, spec = pytree.tree_flatten(recorded)
    named = {}
    position = 0
    for i, value in enumerate(list(recorded[0]) + list(recorded[1].values())):
        name = params[i] if i < len(recorded[0]) else list(recorded[1])[i - len(recorded[0])]
        for _ in pytree.tree_leaves(value):
            named[position] = name
            position += 1
    tensors = [i for i, leaf in enumerate(leaves) if isinstance(leaf, torch.Tensor)]
    mask = next(i for i in tensors if named.get(i) == "attention_mask")
    seq_inputs = {i for i in tensors if leaves[i].dim() >= 2 and leaves[i].shape[:2] == leaves[mask].shape}
    meta = {i: (leaves[i].dtype, leaves[i].device, tuple(leaves[i].shape)) for i in tensors}
    args, kwargs = call
    if set(kwargs) == set(recorded[1]):  # by name: the recorded order
        kwargs = {k: kwargs[k] for k in recorded[1]}
    got, got_spec = pytree.tree_flatten((args, kwargs))
    # --- the former rule, as it was
    if got_spec != spec:
        return None
    for i in tensors:
        x = got[i]
        dtype, device, shape = meta[i]
        if not isinstance(x, torch.Tensor) or x.dtype != dtype or x.device != device or x.dim() != len(shape):
            return None
    b = n = None
    for i in tensors:
        for axis, size in enumerate(got[i].shape):
            if axis == 0:
                b = size if b is None else b
                if size != b:
                    return None
            elif axis == 1 and i in seq_inputs:
                n = size if n is None else n
                if size != n:
                    return None
            elif size != meta[i][2][axis]:
                return None
    sizes = (int(got[tensors[0]].shape[0]), int(got[mask].shape[1]))
    # --- where the C fit is meant to be stricter
    for i, (want, leaf) in enumerate(zip(leaves, got)):
        if i in meta:
            if type(leaf) is not torch.Tensor:
                return None
        elif type(leaf) is not type(want) or leaf != want:
            return None
    return sizes


Pair = collections.namedtuple("Pair", "left right")


def _recorded_call(b, n):
    ids = torch.randint(1, 9, (b, n))
    return ((ids, (torch.randn(b, n, 4), [torch.randn(b, 3), 2.0]), {"pooled": torch.randn(b, 6), "tag": "s"}),
            {"attention_mask": torch.ones(b, n, dtype=torch.long), "extra": Pair(torch.randn(b, 2), None), "k": 3})


def _mutated(rng, call):
    """`call` with one random change (or none) that the fit must see, or must let pass."""
    args, kwargs = call
    ids, (hidden, [rows, scale]), table = args
    kwargs = dict(kwargs)
    change = rng.randrange(24)
    if change == 0:
        hidden = hidden.double()
    elif change == 1:
        rows = torch.empty(rows.shape, device="meta")
    elif change == 2:
        table = {**table, "pooled": table["pooled"].unsqueeze(-1)}
    elif change == 3:
        rows = rows[:-1] if rows.shape[0] > 1 else torch.cat([rows, rows])
    elif change == 4:
        hidden = hidden[:, :-1] if hidden.shape[1] > 1 else torch.cat([hidden, hidden], 1)
    elif change == 5:
        rows = torch.randn(rows.shape[0], 4)
    elif change == 6:
        return (ids, (hidden, (rows, scale)), table), kwargs
    elif change == 7:
        return (ids, (hidden, [rows, scale, 1]), table), kwargs
    elif change == 8:
        table = {"tag": table["tag"], "pooled": table["pooled"]}
    elif change == 9:
        table = {"pooled": table["pooled"], "name": table["tag"]}
    elif change == 10:
        scale = 3.0
    elif change == 11:
        scale = 2
    elif change == 12:
        scale = torch.tensor(2.0)
    elif change == 13:
        ids = 7
    elif change == 14:
        kwargs = {k: kwargs[k] for k in reversed(list(kwargs))}
    elif change == 15:
        kwargs.pop("k")
    elif change == 16:
        kwargs["more"] = 1
    elif change == 17:
        return (ids, (hidden, [rows, scale])), kwargs
    elif change == 18:
        kwargs["extra"] = (kwargs["extra"][0], None)
    elif change == 19:
        kwargs["extra"] = Pair(nn.Parameter(kwargs["extra"][0], requires_grad=False), None)
    elif change == 20:
        kwargs["attention_mask"] = kwargs["attention_mask"].bool()
    elif change == 21:
        kwargs["extra"] = Pair(kwargs["extra"][0][:, :1], None)
    return (ids, (hidden, [rows, scale]), table), kwargs


def test_the_c_fit_is_the_former_rule_call_for_call():
    """Many generated calls of a layout with tensors in a tuple, a list, a dict and a
    namedtuple: right ones of every size, and each with one thing wrong (dtype, device, rank,
    a batch or a length that differs among the tensors, a container's type, size or keys, a
    plain value, a keyword): the C type's fit (_pad_fit) says what the former Python rule
    says, and finds the same batch, length and tensors."""
    rng = random.Random(0)
    torch.manual_seed(0)
    params = ("input_ids", "pair", "table")
    recorded = _recorded_call(2, 5)
    layout = layout_of([recorded], params)
    assert [s.length for s in layout.slots] == [True, True, False, False, True, False]
    bare = Bare()
    bare._pad_layout(recorded, [(True, s.length) for s in layout.slots], [(True, True)], True,
                     lambda *a, **k: a[0], pytree.tree_leaves, 64, 64, 8)
    agreed = {"fits": 0, "refused": 0}
    for _ in range(1200):
        call = _mutated(rng, _recorded_call(rng.randint(1, 12), rng.randint(1, 40)))
        want = _former_fit(recorded, params, call)
        got = bare._pad_fit(call)
        assert (got is None) == (want is None), (call, want, got)
        if got is not None:
            assert got[:2] == want and got[2] == _C.PaddedReplay._pad_key(*want, True, True, 64, 64, 8)
            args, kwargs = call
            ordered = (args, {k: kwargs[k] for k in recorded[1]})  # the C fit finds keywords by name
            found = [t for t in pytree.tree_leaves(ordered) if isinstance(t, torch.Tensor)]
            assert len(got[3]) == len(found) and all(a is b for a, b in zip(got[3], found))
        agreed["fits" if got is not None else "refused"] += 1
    assert agreed["fits"] > 100 and agreed["refused"] > 400, agreed
