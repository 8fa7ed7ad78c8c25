"""The choice inside tweak's own decode step (fused_choice.StepChoice) against transformers' own
processors, built for each call by transformers' generate() rules (decode_call.greedy_call): the
same processed scores bit for bit on the same logits and sequence, step after step, for the
repetition penalty (a seen mask instead of the sequence), min_new_tokens and min_length (a
length counter instead of the sequence's length), temperature, top-k and top-p; the same draws
under the same seed; and through the fused step, the untuned generate()'s sampled tokens. A
choice that ignores top-p, or applies the repetition penalty twice, is refused by the check with
the step named."""

from __future__ import annotations

import pytest
import torch

from torch_tweak._core.correctness import MismatchError
from torch_tweak._runtime.decode import call as decode_call, choice as sampling
from torch_tweak._search import fused_check
from torch_tweak._runtime.decode.fused_choice import SeenPenalty, StepChoice

from test_fused_step import made, own_logits, prompt, shared

transformers = pytest.importorskip("transformers")

CHAT = dict(do_sample=True, temperature=0.8, top_k=50, top_p=0.9, repetition_penalty=1.1)
"""The chat call the issue measures."""

CALLS = {
    "repetition_penalty": dict(repetition_penalty=1.6),
    "min_new_tokens": dict(min_new_tokens=6, eos_token_id=[17, 40], pad_token_id=0),
    "min_length": dict(min_length=10, eos_token_id=17, pad_token_id=0),
    "temperature": dict(do_sample=True, temperature=0.7, top_k=0),
    "top_k": dict(do_sample=True, top_k=20),
    "top_p": dict(do_sample=True, top_p=0.8, top_k=0),
    "chat": CHAT,
}


def call_of(model, ids, settings, new=8):
    call = decode_call.greedy_call(model, (ids,), dict(settings, max_new_tokens=new))
    assert not isinstance(call, str), call
    return call


def choice_of(call, device=torch.device("cpu")) -> StepChoice:
    choice = StepChoice.of(call.processors, call.sample, call.eos, call.pad, device)
    assert isinstance(choice, StepChoice), choice
    return choice


@pytest.mark.parametrize("kind", sorted(CALLS))
def test_the_processed_scores_are_transformers_bit_for_bit(kind):
    """Each step's processed scores on the untuned logits and tokens: equal to what transformers'
    processors give on the sequence so far."""
    model, _ = shared("llama")
    ids, tokens, _ = made("llama")
    logits = own_logits("llama")
    call = call_of(model, ids, CALLS[kind])
    choice = choice_of(call)
    assert fused_check.check_choice(choice, call.processors, logits, tokens, ids.shape[1]) == 0.0
    choice.start(ids, logits[0].shape[-1])
    for step, scores in enumerate(logits):
        theirs = call.processors(tokens[:, :6 + step], scores.clone())
        assert torch.equal(choice.scores(scores), theirs), step
        choice.advance(tokens[:, 6 + step])


def test_the_penalty_ignores_the_left_padding_as_transformers_does():
    """With a left-padded prompt transformers' penalty skips each row's padding (its
    prompt_ignore_length per row); the seen mask does too."""
    T = transformers
    ids = prompt(3, length=7)
    mask = torch.ones_like(ids)
    mask[0, :3] = 0
    mask[2, :1] = 0
    processor = T.RepetitionPenaltyLogitsProcessor(1.5, prompt_ignore_length=(mask != 0).int().argmax(dim=1))
    part = SeenPenalty(processor.penalty, processor.prompt_ignore_length)
    part.start(ids, 256)
    scores = torch.randn(3, 256, generator=torch.Generator().manual_seed(4))
    assert torch.equal(part(scores.clone(), torch.tensor(7)), processor(ids, scores.clone()))


@pytest.mark.parametrize("batch", [1, 3])
def test_draws_under_the_same_seed_are_transformers(batch):
    """The chat call with min_new_tokens and an end token, through the fused step: the untuned
    generate()'s sampled tokens under the same torch.manual_seed."""
    model, decoder = shared("llama")
    ids = prompt(batch, seed=10 + batch)
    settings = dict(CHAT, min_new_tokens=4, eos_token_id=3, pad_token_id=0)
    call = call_of(model, ids, settings, new=12)
    for seed in range(3):
        torch.manual_seed(seed)
        with torch.no_grad():
            want = model.generate(ids, **settings, max_new_tokens=12)
        torch.manual_seed(seed)
        got = fused_check.generate(decoder, ids, 12, choice=choice_of(call))
        assert torch.equal(got[:, :want.shape[1]], want), seed
        assert bool((got[:, want.shape[1]:] == 0).all())  # after every row ended: the pad token


def test_finished_rows_get_the_pad_token_and_min_new_tokens_holds_the_end_back():
    """Greedy, the end token set to a token the untuned run gives at its third step: with
    min_new_tokens 5 it cannot come before the fifth; transformers' tokens either way."""
    model, decoder = shared("llama")
    ids, tokens, _ = made("llama")
    eos = int(tokens[0, 6 + 2])
    for settings in (dict(eos_token_id=eos, pad_token_id=0), dict(eos_token_id=eos, pad_token_id=0, min_new_tokens=5)):
        with torch.no_grad():
            want = model.generate(ids, **settings, max_new_tokens=8, do_sample=False)
        got = fused_check.generate(decoder, ids, 8, choice=choice_of(call_of(model, ids, settings)))
        assert torch.equal(got[:, :want.shape[1]], want)
        assert ("min_new_tokens" in settings) != bool((want[0, 6 + 3:] == 0).all())  # row 0 ended at step 2, or not
        assert bool((got[:, want.shape[1]:] == 0).all())


def test_the_top_k_sampler_serves_where_it_applies(monkeypatch):
    """Where sampling.TopSampler serves (CUDA; widened here to the CPU with CUDA's stable sort, as
    tests/test_sampling.py does), the warpers that end the call are its: the same distribution."""
    sort = torch.sort
    monkeypatch.setattr(torch, "sort", lambda *a, **k: sort(*a, **{"stable": True, **k}))
    monkeypatch.setattr(sampling, "DEVICES", frozenset({"cuda", "cpu"}))
    model, _ = shared("llama")
    ids, tokens, _ = made("llama")
    logits = own_logits("llama")
    call = call_of(model, ids, CHAT)
    choice = choice_of(call)
    assert choice.top is not None and [type(p).__name__ for p in choice.parts] == ["SeenPenalty"]
    assert fused_check.check_choice(choice, call.processors, logits, tokens, 6) <= 1e-6
    assert not choice.overflowed()


def test_a_broken_choice_is_refused_with_the_step():
    """A sampler that ignores top-p; a repetition penalty applied twice."""
    model, _ = shared("llama")
    ids, tokens, _ = made("llama")
    logits = own_logits("llama")
    call = call_of(model, ids, CHAT)
    no_top_p = choice_of(call)
    no_top_p.parts = [p for p in no_top_p.parts if type(p).__name__ != "TopPLogitsWarper"]
    with pytest.raises(MismatchError, match=r"the fused choice step \d+: the processed next-token distribution"):
        fused_check.check_choice(no_top_p, call.processors, logits, tokens, 6)
    twice = choice_of(call)
    twice.parts.insert(0, twice.parts[0])
    assert type(twice.parts[0]).__name__ == "SeenPenalty"
    with pytest.raises(MismatchError, match=r"the fused choice step \d+: the processed next-token distribution"):
        fused_check.check_choice(twice, call.processors, logits, tokens, 6)


def test_what_is_not_fixed_work_is_refused_with_the_reason():
    model, _ = shared("llama")
    ids = prompt(2)
    call = call_of(model, ids, dict(no_repeat_ngram_size=2))
    assert StepChoice.of(call.processors, False) == "the logits processor NoRepeatNGramLogitsProcessor"
    assert StepChoice.of(None, False, eos=(3,)) == "end-of-sequence tokens without a pad token"
    greedy = StepChoice.of(None, False)
    assert isinstance(greedy, StepChoice) and greedy.parts == [] and greedy.top is None
