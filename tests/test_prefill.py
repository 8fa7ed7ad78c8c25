"""The decode loop's recorded prefill (prefill.RecordedPrefill) on the CPU, where the same
buffers run eagerly in place of a device graph: which prompt shapes are recorded and when,
that a later prompt of a recorded shape is its own (the buffer is refilled), the LRU bound,
the host-state guard and the check of a recording against the eager prefill. Every call is
compared with transformers' generate() on an untuned copy. tests/gpu/test_generate_gpu.py
checks the replayed graphs' bits on CUDA."""

from __future__ import annotations

import copy
import logging
import threading
import time

import pytest
import torch

import torch_tweak as tt
from torch_tweak._core.model_state import weights_moved, weights_of
from torch_tweak._runtime.decode import loop as decode_loop, prefill
from support import in_threads

transformers = pytest.importorskip("transformers")

VOCAB = 200
COMMON = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=128)


def build(name: str = "llama"):
    torch.manual_seed(0)
    if name == "llama":
        return transformers.LlamaForCausalLM(transformers.LlamaConfig(**COMMON, tie_word_embeddings=True)).eval()
    # every layer a sliding window of 4 positions: its static cache counts positions in Python
    return transformers.MistralForCausalLM(transformers.MistralConfig(**COMMON, sliding_window=4,
                                                                      tie_word_embeddings=False)).eval()


def prompt(batch: int, length: int, seed: int) -> torch.Tensor:
    return torch.randint(3, VOCAB, (batch, length), generator=torch.Generator().manual_seed(seed))


def generate(model, ids, n: int = 8, **kwargs):
    with torch.no_grad():
        return model.generate(ids, max_new_tokens=n, do_sample=False, cache_implementation="static", **kwargs)


def kept_loop(model, layouts=None):
    """The compiled loop's static caches, kept between calls, with its steps eager (on a CPU
    transformers compiles nothing): the loop kind whose prefills are recorded."""
    loop = decode_loop.DecodeLoop(model, "compiled", layouts)
    loop.eager = True
    decode_loop.install(model, loop)
    return loop


def layouts_of(model, ids):
    from torch_tweak._runtime.workload import Workload

    job = Workload(model, lambda m: generate(m, ids), torch.device("cpu"))
    job.record()
    return job.layouts


@pytest.mark.slow
def test_a_shape_is_recorded_at_its_second_call_and_serves_other_prompts_of_it():
    """Each call a new prompt (another seed): a recorded shape's buffer is refilled, so every
    call gives its own untuned tokens. A shape seen once is not recorded."""
    model = build()
    untuned = copy.deepcopy(model)
    loop = kept_loop(model)
    calls = [(2, 6, 0), (2, 6, 1), (2, 6, 2), (2, 6, 4), (1, 9, 3)]
    for batch, length, seed in calls:
        ids = prompt(batch, length, seed)
        assert torch.equal(generate(model, ids), generate(untuned, ids)), (batch, length, seed)
    assert not loop.fallbacks and not loop.prefills.unrecorded
    recorded = {key[1:3] + key[-1:]: p for key, p in loop.prefills.recorded.items()}
    assert list(recorded) == [(2, 13, 6)]  # (batch, cache length, prompt): the 9-token prompt was seen once
    # the recording's check replayed it once; then the second, third and fourth calls did
    assert recorded[(2, 13, 6)].replays == 4
    assert list(loop.prefills.waiting.values()) == [1]


@pytest.mark.slow
def test_prompts_that_are_padded_or_too_long_are_not_recorded(monkeypatch):
    model = build()
    untuned = copy.deepcopy(model)
    loop = kept_loop(model)
    monkeypatch.setattr(tt.settings, "PREFILL_TOKENS", 10)
    ids = prompt(2, 6, 0)  # 12 tokens
    padded = prompt(1, 4, 1)
    mask = torch.tensor([[0, 1, 1, 1]])
    for _ in range(3):
        assert torch.equal(generate(model, ids), generate(untuned, ids))
        assert torch.equal(generate(model, padded, attention_mask=mask), generate(untuned, padded, attention_mask=mask))
    assert not loop.prefills.recorded and not loop.prefills.waiting and not loop.prefills.unrecorded


@pytest.mark.slow
def test_record_prefills_off_records_nothing_and_replays_nothing():
    model = build()
    untuned = copy.deepcopy(model)
    loop = kept_loop(model)
    loop.prefills.record = False
    for seed in range(3):
        ids = prompt(1, 5, seed)
        assert torch.equal(generate(model, ids), generate(untuned, ids))
    assert not loop.prefills.recorded and not loop.prefills.waiting
    loop.prefills.record = True
    for seed in range(3, 5):
        ids = prompt(1, 5, seed)
        assert torch.equal(generate(model, ids), generate(untuned, ids))
    (recorded,) = loop.prefills.recorded.values()
    loop.prefills.record = False  # a recorded prefill is kept, but not replayed
    for seed in range(5, 7):
        ids = prompt(1, 5, seed)
        assert torch.equal(generate(model, ids), generate(untuned, ids))
    assert recorded.replays == 2  # the recording's check and the fifth call


@pytest.mark.slow
def test_recorded_prefills_are_bounded_least_recently_used_first(monkeypatch):
    monkeypatch.setattr(tt.settings, "PREFILL_GRAPHS", 2)
    model = build()
    untuned = copy.deepcopy(model)
    loop = kept_loop(model)
    for length in (4, 5, 6, 5, 7):  # each shape twice: recorded at its second call
        for seed in (0, 1):
            ids = prompt(1, length, seed + length)
            assert torch.equal(generate(model, ids), generate(untuned, ids)), length
    # the cache length never shrinks (transformers' rule): 4 + 7 = 11, then 14 for the 7-token prompt
    assert [key[-1] for key in loop.prefills.recorded] == [5, 7]


def graph_like(monkeypatch):
    """The CPU's eager replay made to leave Python's values as a device graph's replay does:
    the forward's device work is done, the cache's host-side values are as before the replay."""
    plain = prefill.RecordedPrefill._replay

    def replay(self):
        before = prefill.host_state(self.cache)
        out = plain(self)
        prefill.set_host_state(self.cache, before)
        return out

    monkeypatch.setattr(prefill.RecordedPrefill, "_replay", replay)


def sliding_window_loop(monkeypatch):
    """Mistral with a window of 4 positions, its tuned copy on the kept-cache loop with the
    graph-like replay, and an untuned copy."""
    graph_like(monkeypatch)
    model = build("mistral")
    untuned = copy.deepcopy(model)
    return model, untuned, kept_loop(model, layouts_of(model, prompt(2, 6, 0)))


@pytest.mark.slow
def test_a_cache_that_counts_positions_on_the_host_is_reset_and_counted_as_eagerly(monkeypatch):
    """A sliding window's static cache keeps its count of positions in Python, which a replay
    does not set: a call's cache is reset on the host first, and after the replay its count is
    set to what the eager prefill leaves. With a replay that leaves Python's values alone (as a
    device graph's does), every call's tokens are the untuned ones, prompts longer than the
    window included; without the count set, the steps after the prefill would read a count of 0."""
    model, untuned, loop = sliding_window_loop(monkeypatch)
    for seed in range(5):
        ids = prompt(2, 6, seed)
        assert torch.equal(generate(model, ids), generate(untuned, ids)), seed
    assert not loop.fallbacks and not loop.prefills.unrecorded
    (recorded,) = loop.prefills.recorded.values()
    assert recorded.replays == 5  # the recording's check at the second call, then the second to fifth
    assert recorded.before != recorded.after  # the count: 0 after a reset, 6 after the prefill


@pytest.mark.slow
def test_a_cache_whose_reset_leaves_other_host_state_is_not_replayed(monkeypatch, caplog):
    """A value on the host that the cache's reset does not set back (here a layer's attribute
    set after the recording): the recorded forward's Python may have read it, so the replay is
    refused, said once, and the shape runs eagerly after, with the untuned tokens."""
    model, untuned, loop = sliding_window_loop(monkeypatch)
    for seed in range(2):
        assert torch.equal(generate(model, prompt(2, 6, seed)), generate(untuned, prompt(2, 6, seed)))
    (recorded,) = loop.prefills.recorded.values()
    recorded.cache.layers[0].window_moved = 1
    with caplog.at_level(logging.WARNING, logger="torch_tweak"):
        for seed in range(2, 5):
            ids = prompt(2, 6, seed)
            assert torch.equal(generate(model, ids), generate(untuned, ids)), seed
    assert not loop.fallbacks and not loop.prefills.recorded
    reasons = list(loop.prefills.unrecorded.values())
    assert len(reasons) == 1 and "keeps state on the host" in reasons[0]
    assert sum("could not record its prefill" in r.getMessage() for r in caplog.records) == 1
    assert "its prefill not recorded for 1 prompt shape(s), run eagerly (the cache keeps state" in str(tt.status(model))


def test_masks_are_made_as_eagerly_while_a_prefill_is_recorded(monkeypatch):
    """Recording a graph is tracing to transformers' mask functions: for a prompt on an empty
    static cache they build an explicit mask where the eager forward passes none (SDPA's
    is_causal), and the two are other kernels. Inside masks_as_eager the recording thread gets
    the eager forward's mask (none); another thread still gets the traced one; after it, the
    mask functions and the cache are as they were."""
    from transformers import StaticCache, masking_utils

    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)  # as during a recording
    model = build()
    cache = StaticCache(config=model.config, max_cache_len=16)
    with torch.no_grad():
        model(input_ids=prompt(1, 5, 0), past_key_values=cache)
    cache.reset()
    embeds = torch.zeros(1, 5, COMMON["hidden_size"])
    positions = torch.arange(5)[None]

    def mask():
        return masking_utils.create_causal_mask(model.config, embeds, None, cache, position_ids=positions)

    own = masking_utils.is_tracing
    assert isinstance(mask(), torch.Tensor)  # what a recording got
    other: list = []
    with prefill.masks_as_eager(cache):
        assert mask() is None and cache.get_query_offset(0) == 0
        t = threading.Thread(target=lambda: other.append(masking_utils.is_tracing()))
        t.start()
        t.join()
        with prefill.masks_as_eager(cache):  # nested (two recordings at once): undone by the last out
            pass
        assert masking_utils.is_tracing is not own and not masking_utils.is_tracing()
    assert other == [True]
    assert masking_utils.is_tracing is own and "get_query_offset" not in vars(cache)
    assert isinstance(mask(), torch.Tensor)


@pytest.mark.slow
def test_eight_threads_recording_at_once_each_get_eager_masks_and_leave_none_patched(monkeypatch):
    """Eight threads, each with its own cache, enter and leave masks_as_eager at once, over
    and over (eight loops recording their prefills together): inside, each thread's mask is
    the eager forward's; a thread outside, at the same moment, still gets the traced one; when
    the last leaves, the mask functions are transformers' own again."""
    from transformers import StaticCache, masking_utils

    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    own = masking_utils.is_tracing
    model = build()
    embeds = torch.zeros(1, 5, COMMON["hidden_size"])
    positions = torch.arange(5)[None]
    caches = []
    for _ in range(8):
        cache = StaticCache(config=model.config, max_cache_len=16)
        with torch.no_grad():
            model(input_ids=prompt(1, 5, 0), past_key_values=cache)
        cache.reset()
        caches.append(cache)

    def mask(cache):
        return masking_utils.create_causal_mask(model.config, embeds, None, cache, position_ids=positions)

    def check(i):
        cache = caches[i % 8]
        with prefill.masks_as_eager(cache):
            time.sleep(0.001)  # the others enter and leave meanwhile
            assert mask(cache) is None and not masking_utils.is_tracing()  # (5.17 reads the latter)
        if i % 8 == 0:  # outside: traced, whoever is inside now
            assert masking_utils.is_tracing()

    in_threads(400, check, mode=torch.no_grad)
    assert masking_utils.is_tracing is own and prefill._PATCH.own is None and prefill._PATCH.recordings == 0
    assert all("get_query_offset" not in vars(c) for c in caches)


@pytest.mark.slow
def test_recordings_ending_while_another_begins_leave_transformers_own_is_tracing():
    """Found by an attack: a recording that began while the last one in progress ended could
    read tweak's own is_tracing as transformers', keep it, and put it back at its end: the
    mask functions were then never told of tracing again, and the next recording's saved
    function called itself. Eight threads enter and leave over and over with thread switches
    forced often; after each round transformers' own function is back and answers as before."""
    import sys

    from transformers import masking_utils

    own = masking_utils.is_tracing

    def churn():
        for _ in range(1500):
            with prefill.masks_as_eager(object()):
                pass

    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        for _ in range(3):
            threads = [threading.Thread(target=churn) for _ in range(8)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            assert masking_utils.is_tracing is own and prefill._PATCH.own is None and prefill._PATCH.recordings == 0
    finally:
        sys.setswitchinterval(interval)
    with prefill.masks_as_eager(object()):
        assert prefill._PATCH.own is own  # the next recording keeps transformers' own, not tweak's
    assert masking_utils.is_tracing() == own()


@pytest.mark.slow
def test_a_recording_whose_replay_differs_is_not_kept(monkeypatch, caplog):
    """The recording's check compares one replay with the eager prefill, bit for bit: a replay
    one ulp off is refused and the shape runs eagerly, with the untuned tokens."""
    model = build()
    untuned = copy.deepcopy(model)
    loop = kept_loop(model)
    plain = prefill.RecordedPrefill._replay

    def off(self):
        return torch.nextafter(plain(self), torch.tensor(float("inf")))

    monkeypatch.setattr(prefill.RecordedPrefill, "_replay", off)
    with caplog.at_level(logging.WARNING, logger="torch_tweak"):
        for seed in range(4):
            ids = prompt(1, 6, seed)
            assert torch.equal(generate(model, ids), generate(untuned, ids)), seed
    assert not loop.prefills.recorded
    assert list(loop.prefills.unrecorded.values()) == ["Mismatch: its replay's logits are not the eager prefill's"]
    assert sum("could not record its prefill" in r.getMessage() for r in caplog.records) == 1


@pytest.mark.slow
def test_a_recording_that_fails_leaves_the_call_eager(monkeypatch):
    model = build()
    untuned = copy.deepcopy(model)
    loop = kept_loop(model)

    def fail(*args, **kwargs):
        raise RuntimeError("operation not permitted when stream is capturing")

    monkeypatch.setattr(prefill.RecordedPrefill, "__init__", fail)
    for seed in range(3):
        ids = prompt(1, 6, seed)
        assert torch.equal(generate(model, ids), generate(untuned, ids))
    assert list(loop.prefills.unrecorded.values()) == ["RuntimeError: operation not permitted when stream is capturing"]
    assert list(loop.prefills.waiting) == []  # tried once at the second call, not again


@pytest.mark.slow
def test_eight_threads_with_mixed_prompt_shapes_each_get_their_untuned_tokens():
    model = build()
    untuned = copy.deepcopy(model)
    loop = kept_loop(model)
    shapes = [(1, 5), (2, 5), (1, 7), (2, 7)]
    jobs = [(shapes[i % 4], i) for i in range(24)]
    expected = {seed: generate(untuned, prompt(b, n, seed)) for (b, n), seed in jobs}
    got: dict[int, torch.Tensor] = {}
    errors: list[BaseException] = []

    def work(part):
        try:
            for (b, n), seed in part:
                got[seed] = generate(model, prompt(b, n, seed))
        except BaseException as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(jobs[i::8],)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert all(torch.equal(got[seed], expected[seed]) for seed in expected)
    assert loop.calls == 24 and len(loop.prefills.recorded) >= 2 and not loop.prefills.unrecorded


@pytest.mark.slow
def test_a_weight_replaced_after_recording_drops_the_recording_and_records_again():
    """A graph reads the weights where they were at recording. A parameter replaced by another
    tensor (here the output head, scaled, on the tuned and the untuned copy alike) drops the
    recording at the next call, which runs eagerly with the new weight; the shape is recorded
    again at its next call, and every call gives the untuned copy's tokens."""
    model = build()
    untuned = copy.deepcopy(model)
    loop = kept_loop(model)
    for seed in range(3):
        ids = prompt(1, 6, seed)
        assert torch.equal(generate(model, ids), generate(untuned, ids)), seed
    (first,) = loop.prefills.recorded.values()
    for m in (model, untuned):
        m.lm_head.weight = torch.nn.Parameter(m.lm_head.weight.detach() * -3.0)
    for seed in range(3, 6):
        ids = prompt(1, 6, seed)
        assert torch.equal(generate(model, ids), generate(untuned, ids)), seed
    (again,) = loop.prefills.recorded.values()
    assert again is not first and first.replays == 3 and again.replays == 2  # recorded at seed 4, replayed at 5
    assert not loop.prefills.unrecorded


def test_weights_moved_sees_a_replaced_tensor_and_data_moved_in_place():
    """What model.to(...) does (a parameter's data moved, the same Parameter) and what an
    assignment does (another Parameter) are both seen; a call that leaves them is not."""
    model = build()
    weights = weights_of(model)
    assert not weights_moved(weights)
    model.model.norm.weight.data = model.model.norm.weight.data.clone()
    assert weights_moved(weights)
    weights = weights_of(model)
    model.model.layers[0].mlp.up_proj.weight = torch.nn.Parameter(model.model.layers[0].mlp.up_proj.weight.detach())
    assert weights_moved(weights)
    weights = weights_of(model)
    generate(model, prompt(1, 5, 0))
    assert not weights_moved(weights)
