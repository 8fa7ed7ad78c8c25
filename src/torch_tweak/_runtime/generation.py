"""tweak's own decode loop, behind a transformers model's ``generate()``.

Most of a generated token's time on a fast device is spent outside the model: transformers'
loop prepares the inputs, runs the logits processors and the stopping criteria (which read
the device every step), and keeps its books on the cache. For the calls people make of a
decoder-only model (greedy or sampling, the common logits processors, several end-of-sequence
ids, left-padded batches; docs/generate.md has the table), this module runs the same steps
itself:

- the prompt (prefill) goes through the model as the user's code would call it, so a tuned
  model serves it with its tuned backends; on a static cache the loop keeps between calls (a
  CUDA device), a prompt shape's prefill is recorded as a device graph of the untuned forward
  at its second call and replayed after (prefill.RecordedPrefill: the same kernels, checked
  bit for bit at recording);
- every decode step feeds the previous token and chooses the next as transformers does:
  transformers' own logits processors for the call (SERVED_PROCESSORS) on the sequence so
  far (a sampling call with temperature, top-k and top-p on CUDA: the same processed scores
  from the top scores alone, sampling.TopSampler), then the argmax, or a draw of
  ``torch.multinomial``, with the cache the user's call
  would have used (a ``DynamicCache``, or a ``StaticCache`` when the call asks for
  ``cache_implementation="static"``, sized by transformers' own rule), the position ids and
  the attention masks (one per layer type where the model has several) made as transformers
  makes them;
- with a static cache on a device with graphs (CUDA), a greedy decode step with no
  processing (forward, argmax, the next input and the token's place in the output) is
  recorded once as a device graph and replayed per token by the extension's loop
  (``_C.replay_steps``: no Python runs per token); the stopping rule is read every
  ``CHECK_EVERY`` steps, and tokens after an end-of-sequence are replaced by the pad token
  exactly as transformers does;
- when transformers itself would compile the decode steps (a static cache on CUDA without
  ``disable_compile=True``), the ``compiled`` loop runs every decode step through the very
  compiled forward transformers uses (``model.get_compiled_call``), so its kernels, and its
  tokens, are those of the untuned call; only transformers' per-token bookkeeping goes.

Any other call (beams, a processor it does not know, a streamer, stopping criteria, a cache
passed in, an encoder-decoder model...) runs transformers' ``generate`` unchanged; the reason
is logged once and counted (``DecodeLoop.fallbacks``). tt.tweak keeps a loop only when it gave
exactly the tokens of the untuned ``generate`` on every recorded call (a sampling call under
the same seed: same_draws) and measured faster end to end (see docs/generate.md).
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any

import torch
from torch import nn

from .decode_call import MAX_CHECK_NEW_TOKENS, check_bounds, config_class, greedy_call
from .decode_loop import DecodeLoop
from .decode_model import cache_arg_of


@dataclasses.dataclass
class LoopPlan:
    """A decode loop as a Plan keeps it: its kind, the layouts of its forward calls (None: the
    defaults) and the generate() calls it is checked on before it is installed again (tt.load,
    the tuning cache), each with the untuned tokens it gave where it was tuned. The check
    compares the loop with the untuned generate() run here, never with those stored tokens
    (a file's word); each call is bounded (MAX_CHECK_NEW_TOKENS, MAX_CHECK_TOKENS)."""

    kind: str
    layouts: dict | None
    checks: list[tuple[tuple, dict, torch.Tensor]]
    top_sampler: bool = False  # DecodeLoop.top_sampler


def plan_loop(model: nn.Module) -> LoopPlan | None:
    """The loop installed on `model` as a Plan keeps it, its check calls bounded: a call asking
    more than MAX_CHECK_NEW_TOKENS new tokens is kept with that many (greedy tokens are a
    prefix of a longer call's), one decoding more than MAX_CHECK_TOKENS is left out."""
    loop = loop_of(model)
    if loop is None:
        return None
    checks = []
    for args, kwargs, tokens in loop.checks:
        call = greedy_call(model, args, kwargs)
        if not isinstance(call, str) and call.max_new > MAX_CHECK_NEW_TOKENS:
            kwargs = {k: v for k, v in kwargs.items() if k != "max_length"}
            kwargs["max_new_tokens"] = MAX_CHECK_NEW_TOKENS
            tokens = tokens[:, :call.input_ids.shape[1] + MAX_CHECK_NEW_TOKENS]
        if check_bounds(model, args, kwargs) is None:
            checks.append((args, kwargs, tokens))
    return LoopPlan(loop.kind, loop.given, checks, loop.top_sampler)


@contextlib.contextmanager
def uncompiled(model: nn.Module) -> Any:
    """Inside the block, the model's compiled loop (if any) runs its decode steps through the
    plain forward: for hooks that must not be traced into transformers' compiled forward."""
    loop = loop_of(model)
    if loop is None:
        yield
        return
    loop.eager = True
    try:
        yield
    finally:
        loop.eager = False


def arm(model: nn.Module) -> None:
    """Inference starts: the model's decode loop (if any) counts its calls and fallbacks from 0
    (tuning's own generate() calls are not counted)."""
    loop = loop_of(model)
    if loop is not None:
        loop.calls = 0
        loop.fallbacks.clear()


def loop_of(model: nn.Module) -> DecodeLoop | None:
    """The decode loop installed on `model`, or None."""
    loop = model.__dict__.get("generate")
    return loop if isinstance(loop, DecodeLoop) else None


def install(model: nn.Module, loop: DecodeLoop) -> None:
    object.__setattr__(model, "generate", loop)


def uninstall(model: nn.Module) -> None:
    if loop_of(model) is not None:
        del model.__dict__["generate"]


def can_generate(model: nn.Module) -> bool:
    """Whether `model` is a transformers model with a generate() the loop may stand behind."""
    generate = getattr(type(model), "generate", None)
    return callable(generate) and config_class(model) is not None and cache_arg_of(model) is not None
