"""The padded backend's steady per-call path in C (_C.PaddedReplay, the base type of
backends.padded.PaddedCall): a call of a ready bucket is found, copied in, run and cut back
in C; anything else comes back to Python (_slow). On a CPU the bucket runs the module on its
buffers (graph=False; tests/gpu/test_padded_gpu.py replays graphs).

Every test compares the tuned model (or its backend's callable) with an untuned copy taken
before tuning; the C path's counters with the Python path's on the same calls."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import torch_tweak as tt
from torch_tweak import _C
from torch_tweak.backends import PaddedGraphBackend
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


def counted(monkeypatch, c_path: bool):
    """A Pool tuned with the padded backend, the C path on or off, and the stream's describe()."""
    if not c_path:
        monkeypatch.setattr(padded_module, "_slots", lambda plan, sample: None)
    torch.manual_seed(0)
    model = Pool(True).eval()
    untuned = copy.deepcopy(model)
    _, call = tune_any(model)
    with torch.inference_mode():
        for r in requests(30, 3, batches=(1, 2, 3, 4), lengths=range(2, 40)):
            torch.testing.assert_close(model(**r), untuned(**r))
    monkeypatch.undo()
    return call, call.describe()


def tune_any(model):
    (w,) = tt.wrap(model, [""], strategy=tt.OneBackendStrategy(PaddedGraphBackend(graph=False, compile=False)))
    tt.tune(model, requests(8, 0, batches=(1, 2, 4), lengths=range(5, 40)), measure=FAST)
    (group,) = [g for g in w.tt_signatures if g.varying]
    return w, group.backend.callable


def test_the_c_path_counts_what_the_python_path_counted(monkeypatch):
    fast, in_c = counted(monkeypatch, c_path=True)
    slow, in_python = counted(monkeypatch, c_path=False)
    assert fast.fast_calls > 0 and not slow.serves_here and slow.fast_calls == 0
    assert in_c == in_python
    assert sum(in_c["buckets"].values()) > 0 and in_c["padding_waste"] > 0


def test_a_call_outside_every_bucket_goes_back_to_python():
    model = mlp()
    untuned = copy.deepcopy(model)
    w, call = tune(model, [torch.randn(b, 16) for b in (3, 5, 1, 8, 6)])
    top = call.describe()["batch_range"][1]
    slow = call.slow_calls
    with torch.inference_mode():
        for b in (top + 1, top + 40):
            x = torch.randn(b, 16)
            torch.testing.assert_close(model(x), untuned(x))
    assert call.slow_calls == slow + 2 and call.describe()["outside_range"] == 2


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


def test_bad_layouts_and_buckets_are_refused():
    class Bare(_C.PaddedReplay):
        pass

    x = torch.randn(4, 16)
    bare = Bare()
    with pytest.raises(TypeError, match="call must be an"):
        bare._pad_layout([x], [(0, True, False)], [(True, False)], False, len, list)
    fresh = Bare()
    with pytest.raises(ValueError, match="names no argument"):
        fresh._pad_layout(((x,), {}), [(3, True, False)], [(True, False)], False, len, list)
    with pytest.raises(RuntimeError, match="set once"):
        fresh._pad_layout(((x,), {}), [(0, True, False)], [(True, False)], False, len, list)
    good = Bare()
    good._pad_layout(((x,), {}), [(0, True, False)], [(True, False)], False, lambda t: t * 2, list)
    with pytest.raises(ValueError, match="is not a bucket's"):
        good._pad_bucket(4, 0, 5, 0, [torch.zeros(4, 16)], None, None, None)
    with pytest.raises(ValueError, match="1 slots"):
        good._pad_bucket(4, 0, 3, 0, [], None, None, None)
    with pytest.raises(ValueError, match="dtype"):
        good._pad_bucket(4, 0, 3, 0, [torch.zeros(4, 16, dtype=torch.float64)], None, None, None)
    with pytest.raises(TypeError, match="GraphReplay"):
        good._pad_bucket(4, 0, 3, 0, [torch.zeros(4, 16)], object(), [], None)
    good._pad_bucket(4, 0, 3, 0, [torch.zeros(4, 16)], None, None, None)
    y = torch.randn(3, 16)
    torch.testing.assert_close(good(y), y * 2)  # served in C: the target on the buffer, cut back
    assert good.fast_calls == 1 and good._pad_counts() == {(4, 0): (1, 3, 4)}
    with pytest.raises(AttributeError):  # a call no bucket takes goes to _slow, which Bare lacks
        good(torch.randn(5, 16))


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
    plan = padded_module.Plan(None, [0], True, True, 0, set(), [], [], 40, 64, 16)
    assert plan.key(9, 17) == (12, 32) and plan.lower((12, 32)) == (9, 17) and plan.key(41, 1) is None
    with pytest.raises(ValueError, match="sizes must be >= 0"):
        rule._pad_key(-1, 0, True, False, 8, 0, 1)
    with pytest.raises(ValueError, match="step >= 1"):
        rule._pad_lower(4, 4, True, True, 0)


def test_python_calls_of_a_bucket_copy_and_cut_by_the_c_rule():
    """_pad_copy_in and _pad_cut (what PaddedCall._run uses for the calls Python makes of a
    bucket) against the rule written out with slices: rows past b untouched, a length axis
    zeroed past n in the call's rows, outputs cut and copied; bad input refused by name."""
    replay = _C.PaddedReplay()
    torch.manual_seed(0)
    buffers = [torch.full((8, 16, 3), 7.0), torch.full((8, 5), 7.0), torch.full((4,), 7.0)]
    tensors = [torch.randn(3, 10, 3), torch.randn(3, 5), torch.randn(4)]
    axes = [(True, True), (True, False), (False, False)]
    want = [b.clone() for b in buffers]
    want[0][:3, 10:] = 0
    want[0][:3, :10] = tensors[0]
    want[1][:3] = tensors[1]
    want[2][:] = tensors[2]
    assert replay._pad_copy_in(buffers, tensors, axes, 3, 10, 8, 16) is None
    for got, expected in zip(buffers, want):
        assert torch.equal(got, expected)
    assert torch.equal(buffers[0][3:], torch.full((5, 16, 3), 7.0))  # rows past the call's: as they were
    leaves = [torch.arange(8 * 16.0).reshape(8, 16), "plain", torch.ones(8, 2), None]
    out = replay._pad_cut(leaves, [(True, True), (False, False), (True, False), (False, False)], 3, 10, 8, 16)
    assert torch.equal(out[0], leaves[0][:3, :10]) and out[1] == "plain" and out[3] is None
    assert torch.equal(out[2], leaves[2][:3])
    assert out[0].data_ptr() != leaves[0].data_ptr()  # copied: a later call cannot change it
    with pytest.raises(ValueError, match="2 buffers for 3 tensors"):
        replay._pad_copy_in(buffers[:2], tensors, axes, 3, 10, 8, 16)
    with pytest.raises(ValueError, match="2 axis pairs for 3 tensors"):
        replay._pad_copy_in(buffers, tensors, axes[:2], 3, 10, 8, 16)
    with pytest.raises(TypeError, match="item 1 is str, not a torch.Tensor"):
        replay._pad_copy_in(buffers, [tensors[0], "x", tensors[2]], axes, 3, 10, 8, 16)
    with pytest.raises(ValueError, match="batch 9, length 10 does not fit a bucket of 8 x 16"):
        replay._pad_copy_in(buffers, tensors, axes, 9, 10, 8, 16)
    with pytest.raises(TypeError, match="axis pair must be a"):
        replay._pad_cut(leaves, [True] * 4, 3, 10, 8, 16)
    with pytest.raises(ValueError, match="length 17 does not fit"):
        replay._pad_cut(leaves, [(True, True)] * 4, 3, 17, 8, 16)
