"""tweak's own decode step (fused_step.py) and its choice (fused_choice.py) run and held to the
measured rule, as every candidate of a decode loop is (decode_check.py; the numbers are
_core/decode_numerics.py's):

- ``reference``: the untuned model's greedy tokens and per-step logits, from its own forward with
  a StaticCache step by step, and the same steps' logits from one forward of the whole sequence
  at higher precision (a copy of the model at float32 for bf16/fp16, float64 for float32: tied
  weights stay tied in the copy);
- ``teacher_forced``: the fused step fed the untuned tokens (the prompt through the model's own
  prefill), each step's logits;
- ``check``: those logits within the measured rule of the higher-precision ones, step by step;
  a broken step is refused with the step and its error as a multiple of the untuned model's;
- ``check_choice``: the choice's processed distributions against transformers' own processors
  on the same logits and sequence, within decode_numerics.TV_FLOOR;
- ``generate``: a whole call through the step, greedy or with a choice.
"""

from __future__ import annotations

import copy
import inspect
from typing import Any

import torch
from torch import nn

from .._core import correctness, decode_numerics
from .._runtime.decode.fused_choice import StepChoice
from .._runtime.decode.fused_step import FusedDecoder


def _cache_keyword(model: nn.Module) -> str:
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def untuned(model: nn.Module, ids: torch.Tensor, new: int) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """The model's own greedy run of `new` tokens after `ids` (no padding, no end token), its
    forward with a transformers StaticCache step by step: (the tokens, prompt included; each
    step's logits in float32, [batch, vocab])."""
    from transformers import StaticCache

    batch, prompt = ids.shape
    cache = StaticCache(config=model.config, max_cache_len=prompt + new)
    name = _cache_keyword(model)
    logits, tokens = [], [ids]
    with torch.no_grad():
        out = model(input_ids=ids, position_ids=torch.arange(prompt, device=ids.device)[None].expand(batch, -1),
                    use_cache=True, **{name: cache})
        for step in range(new):
            logits.append(out.logits[:, -1].to(copy=True, dtype=torch.float32))
            token = logits[-1].argmax(-1)
            tokens.append(token[:, None])
            if step + 1 < new:
                position = torch.full((batch, 1), prompt + step, device=ids.device)
                out = model(input_ids=token[:, None], position_ids=position, use_cache=True, **{name: cache})
    return torch.cat(tokens, 1), logits


def high_logits(model: nn.Module, tokens: torch.Tensor, prompt: int) -> list[torch.Tensor]:
    """Each decode step's logits from one forward of the whole sequence `tokens` on a copy of the
    model at higher precision (correctness.REFERENCE_DTYPES)."""
    dtype = model.get_input_embeddings().weight.dtype
    high = copy.deepcopy(model).to(correctness.REFERENCE_DTYPES[dtype])
    with torch.no_grad():
        logits = high(input_ids=tokens, use_cache=False).logits
    return [logits[:, prompt - 1 + step].float() for step in range(tokens.shape[1] - prompt)]


def reference(model: nn.Module, ids: torch.Tensor, new: int) -> tuple[torch.Tensor, decode_numerics.StepReference]:
    """(the untuned greedy tokens, the measured rule's reference of their steps)."""
    tokens, own = untuned(model, ids, new)
    return tokens, decode_numerics.step_reference(own, high_logits(model, tokens, ids.shape[1]))


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
    (`tokens`), within decode_numerics.TV_FLOOR; returns the largest distance."""
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
