"""tweak's own decode step (fused_step.py) and its choice (fused_choice.py) on their own, outside a
generate() call: what the fused step's study (bench/studies/decode_step_study.py) and its unit
tests run. A fused loop behind generate() is judged like every candidate, by
decode_check.check_call (teacher forcing on the untuned tokens through the loop itself); the
reference here is decode_check's too, and the rule decode_numerics':

- ``reference``: the untuned model's greedy tokens (its generate() with a static cache) and the
  measured rule's reference of their steps (decode_check.reference);
- ``teacher_forced``: the step alone fed the untuned tokens (the prompt through the model's own
  prefill), each step's logits;
- ``check``: those logits within the measured rule, step by step; a broken step is refused
  with the step and its error as a multiple of the untuned model's;
- ``check_choice``: a choice's processed distributions against transformers' own processors
  on the same logits and sequence, within TV_FLOOR;
- ``generate``: a whole call through the step, greedy or with a choice.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from .._core import correctness, decode_numerics, settings
from .._runtime.decode.fused_choice import StepChoice
from .._runtime.decode.fused_step import FusedDecoder
from . import decode_check


def reference(model: nn.Module, ids: torch.Tensor, new: int) -> tuple[torch.Tensor, decode_numerics.StepReference]:
    """(the untuned greedy tokens of `new` tokens after `ids`, prompt included; the measured
    rule's reference of their steps: decode_check.reference). RuntimeError where the reference
    cannot be made (its reason)."""
    kwargs = {"max_new_tokens": new, "min_new_tokens": new, "do_sample": False, "cache_implementation": "static"}
    with torch.no_grad():
        tokens = model.generate(ids, **kwargs)
    made = decode_check.reference(model, (ids,), kwargs, tokens)
    if not made.measured:
        raise RuntimeError(f"no reference for the fused step's check: {made.why}")
    return tokens, made


def teacher_forced(decoder: FusedDecoder, ids: torch.Tensor, tokens: torch.Tensor,
                   kernels: str = "torch") -> list[torch.Tensor]:
    """The step's logits (float32) fed `tokens` after the prompt `ids`: the first from the
    model's own prefill, each next from the fused step."""
    batch, prompt = ids.shape
    new = tokens.shape[1] - prompt
    cache = decoder.cache(batch, prompt + new)
    out = [decoder.prefill(ids, cache).to(copy=True, dtype=torch.float32)]
    for step in range(1, new):
        position = torch.tensor(prompt + step - 1, device=ids.device)
        logits = decoder.step(tokens[:, prompt + step - 1], position, cache, kernels)
        out.append(logits.to(copy=True, dtype=torch.float32))
    return out


def check(decoder: FusedDecoder, ids: torch.Tensor, new: int, kernels: str = "torch",
          made: tuple[torch.Tensor, decode_numerics.StepReference] | None = None) -> correctness.Finding:
    """Raises MismatchError unless the fused step's logits, teacher-forced on the untuned greedy
    tokens, keep the measured rule at every step; returns the finding that uses most of its
    bound. `made`: reference()'s result, where it is shared by several checks."""
    tokens, ref = made if made is not None else reference(decoder.model, ids, new)
    got = teacher_forced(decoder, ids, tokens, kernels)
    return decode_numerics.check_steps(got, ref, f"the fused step ({kernels})")


def check_choice(choice: StepChoice, processors: Any, logits: list[torch.Tensor], tokens: torch.Tensor,
                 prompt: int, where: str = "the fused choice") -> float:
    """Raises MismatchError unless, at every step, the choice's processed distribution of a
    step's `logits` is transformers' `processors`' on the same logits and the sequence so far
    (`tokens`), within TV_FLOOR; returns the largest distance."""
    choice.start(tokens[:, :prompt], logits[0].shape[-1])
    mine, theirs = [], []
    for step, scores in enumerate(logits):
        mine.append(choice.scores(scores))
        expected = scores.to(copy=True, dtype=torch.float32)
        theirs.append(processors(tokens[:, :prompt + step], expected) if processors is not None else expected)
        if prompt + step < tokens.shape[1]:
            choice.advance(tokens[:, prompt + step])
    return decode_numerics.check_distributions(mine, theirs, decode_numerics.StepReference(None), where)


def generate(decoder: FusedDecoder, ids: torch.Tensor, new: int, kernels: str = "torch",
             choice: StepChoice | None = None) -> torch.Tensor:
    """`new` tokens after the prompt `ids` ([batch, length], no padding) through the fused step:
    the argmax, or `choice` (started here); the tokens, prompt included."""
    batch, prompt = ids.shape
    cache = decoder.cache(batch, prompt + new)
    logits = decoder.prefill(ids, cache)
    if choice is not None:
        choice.start(ids, decoder.vocab)
    tokens = [ids]
    for step in range(new):
        token = choice(logits) if choice is not None else logits.float().argmax(-1)
        tokens.append(token[:, None])
        if step + 1 < new:
            logits = decoder.step(token, torch.tensor(prompt + step, device=ids.device), cache, kernels)
    return torch.cat(tokens, 1)
