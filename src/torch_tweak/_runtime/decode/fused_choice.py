"""The choice of the next token inside tweak's own decode step (fused_step.py), as fixed work per
step: no read of the device, no shape that grows, so a step with its choice is recorded once
as a device graph and replayed per token.

transformers' processors that read only the scores (temperature, top-k, top-p, min-p) are
already fixed work: their own objects run unchanged. Those that read the sequence so far are
written here as fixed work with the same arithmetic:

- ``SeenPenalty`` for ``RepetitionPenaltyLogitsProcessor``: a [batch, vocab] mask of the tokens
  seen (the prompt past its ignored length, then each new token as it is chosen), and the
  penalty where it is set: score * penalty where the score is negative, score / penalty
  elsewhere, applied once per token, as transformers' gather and scatter apply it;
- ``LengthFloor`` for ``MinLengthLogitsProcessor`` and ``MinNewTokensLengthLogitsProcessor``:
  the end-of-sequence tokens at -inf while the sequence's length, a counter on the device, is
  below the floor.

The draw is transformers': torch.multinomial on the softmax of the processed scores (on CUDA,
sampling.TopSampler's processing and draw_one where they serve the call: the top-k + margin
scores alone, the same draw under the same seed). Greedy: the argmax. A finished sequence (an
end-of-sequence token chosen) is given the pad token from then on, as transformers gives it.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from . import choice as sampling

SCORES_ONLY = frozenset({"TemperatureLogitsWarper", "TopKLogitsWarper", "TopPLogitsWarper", "MinPLogitsWarper"})
"""transformers' processors that read only the scores: run as they are."""

SEQUENCE = frozenset({"RepetitionPenaltyLogitsProcessor", "MinLengthLogitsProcessor",
                      "MinNewTokensLengthLogitsProcessor"})
"""transformers' processors that read the sequence so far: run as fixed work (SeenPenalty,
LengthFloor)."""


class SeenPenalty:
    """RepetitionPenaltyLogitsProcessor as fixed work (module docs)."""

    def __init__(self, penalty: float, ignore: Any) -> None:
        self.penalty = penalty
        self.ignore = ignore  # the processor's prompt_ignore_length: None, an int, or one per row
        self.seen: torch.Tensor | None = None  # [batch, vocab + 1]: the last column takes ids past the vocabulary

    def start(self, ids: torch.Tensor, vocab: int) -> None:
        """The prompt's tokens seen (past the ignored length)."""
        ids = ids.clamp(max=vocab)
        if isinstance(self.ignore, int):
            ids = ids[:, self.ignore:]
        elif isinstance(self.ignore, torch.Tensor):
            place = torch.arange(ids.shape[1], device=ids.device)
            ids = ids.masked_fill(place[None, :] < self.ignore.to(ids.device)[:, None], vocab)
        shape = (ids.shape[0], vocab + 1)
        if self.seen is None or tuple(self.seen.shape) != shape or self.seen.device != ids.device:
            self.seen = torch.zeros(shape, dtype=torch.bool, device=ids.device)
        else:  # in place: a recorded step keeps reading this mask
            self.seen.zero_()
        self.seen.scatter_(1, ids, True)

    def __call__(self, scores: torch.Tensor, length: torch.Tensor) -> torch.Tensor:
        assert self.seen is not None
        penalized = torch.where(scores < 0, scores * self.penalty, scores / self.penalty)
        return torch.where(self.seen[:, :scores.shape[-1]], penalized, scores)

    def advance(self, token: torch.Tensor) -> None:
        assert self.seen is not None
        self.seen.scatter_(1, token.clamp(max=self.seen.shape[1] - 1)[:, None], True)


class LengthFloor:
    """MinLengthLogitsProcessor (skip 0) or MinNewTokensLengthLogitsProcessor (skip: the prompt
    length it counts from) as fixed work: the eos tokens at -inf while length - skip < floor."""

    def __init__(self, eos: torch.Tensor, floor: int, skip: int) -> None:
        self.end_ids = eos
        self.floor = floor
        self.skip = skip
        self.banned: torch.Tensor | None = None

    def start(self, ids: torch.Tensor, vocab: int) -> None:
        if self.banned is None or self.banned.shape[0] != vocab or self.banned.device != ids.device:
            self.banned = torch.isin(torch.arange(vocab, device=ids.device), self.end_ids.to(ids.device))

    def __call__(self, scores: torch.Tensor, length: torch.Tensor) -> torch.Tensor:
        assert self.banned is not None
        below = (length - self.skip) < self.floor
        return torch.where(self.banned & below, -math.inf, scores)

    def advance(self, token: torch.Tensor) -> None:
        pass


FIXED = (SeenPenalty, LengthFloor)


def _fixed(processor: Any) -> Any:
    name = type(processor).__name__
    if name == "RepetitionPenaltyLogitsProcessor":
        return SeenPenalty(processor.penalty, processor.prompt_ignore_length)
    if name == "MinLengthLogitsProcessor":
        return LengthFloor(processor.eos_token_id, int(processor.min_length), 0)
    return LengthFloor(processor.eos_token_id, int(processor.min_new_tokens), int(processor.prompt_length_to_skip))


class StepChoice:
    """The next token of each row from a step's logits, with the call's processors as fixed
    work (module docs). Make one with `of`; `start` it on a call's prompt; then each step
    `choice(logits)` (scores, pick, advance)."""

    def __init__(self, parts: list, sample: bool, eos: tuple[int, ...], pad: int | None,
                 top: "sampling.TopSampler | None") -> None:
        self.parts = parts  # fixed-work parts and transformers' score-only processors, in the call's order
        self.draws = sample
        self.end_ids = eos
        self.pad_id = pad
        self.top = top  # the top-k sampler in place of the warpers that end the list, where it serves
        self.length: torch.Tensor | None = None
        self.finished: torch.Tensor | None = None
        self._eos: torch.Tensor | None = None

    @classmethod
    def of(cls, processors: Any, sample: bool, eos: tuple[int, ...] = (), pad: int | None = None,
           device: torch.device | None = None) -> "StepChoice | str":
        """The choice for a call's processors (transformers' LogitsProcessorList, or None), or why
        one of them is not fixed work here."""
        parts = []
        for p in processors or ():
            name = type(p).__name__
            if not type(p).__module__.startswith("transformers."):
                return f"the logits processor {name}, which is not transformers' own"
            if name in SEQUENCE:
                parts.append(_fixed(p))
            elif name in SCORES_ONLY:
                parts.append(p)
            else:
                return f"the logits processor {name}"
        if eos and pad is None:
            return "end-of-sequence tokens without a pad token"
        top = None
        tail = [p for p in parts if type(p).__name__ in SCORES_ONLY]
        if sample and device is not None and tail and parts[-len(tail):] == tail:
            top = sampling.TopSampler.of(tail, True, device)
            if top is not None:
                parts = parts[:-len(tail)]
        return cls(parts, sample, tuple(eos), pad, top)

    def start(self, ids: torch.Tensor, vocab: int) -> None:
        """Before a call's first token: its prompt ([batch, length], the rows the call chooses for).
        A choice started again on a prompt of the same batch and device keeps its tensors (set in
        place), so a step recorded with it replays for the new call."""
        batch, device = ids.shape[0], ids.device
        if self.finished is None or self.finished.shape[0] != batch or self.finished.device != device:
            self.length = torch.zeros((), dtype=torch.int64, device=device)
            self.finished = torch.zeros(batch, dtype=torch.bool, device=device)
            self._eos = torch.tensor(self.end_ids, dtype=torch.int64, device=device)
        assert self.length is not None
        self.length.fill_(ids.shape[1])
        self.finished.zero_()
        if self.top is not None:
            self.top.start(batch, device)
        for part in self.parts:
            if isinstance(part, FIXED):
                part.start(ids, vocab)

    def scores(self, logits: torch.Tensor) -> torch.Tensor:
        """The processed scores (float32) of a step's logits ([batch, vocab]), as transformers'
        processors give them on the sequence so far; the state is unchanged."""
        assert self.length is not None, "start() the choice on the call's prompt first"
        scores = logits.to(copy=True, dtype=torch.float32)
        for part in self.parts:
            scores = part(scores, self.length) if isinstance(part, FIXED) else part(None, scores)
        if self.top is not None:
            scores = self.top.process(scores)
        return scores

    def pick(self, scores: torch.Tensor) -> torch.Tensor:
        """The token of each row from processed scores: the argmax, or transformers' draw."""
        if not self.draws:
            return torch.argmax(scores, dim=-1)
        probs = nn.functional.softmax(scores, dim=-1)
        if self.top is not None and sampling.exact_draws(scores.device):
            return self.top.pick(probs)
        return torch.multinomial(probs, num_samples=1).squeeze(1)

    def advance(self, token: torch.Tensor) -> torch.Tensor:
        """The token as the sequence takes it (the pad token for a finished row), the state moved
        on by it (seen tokens, length, finished rows)."""
        assert self.finished is not None and self.length is not None and self._eos is not None
        if self.pad_id is not None:
            token = torch.where(self.finished, self.pad_id, token)
        if self.end_ids:
            self.finished |= torch.isin(token, self._eos)
        for part in self.parts:
            if isinstance(part, FIXED):
                part.advance(token)
        self.length += 1
        return token

    def __call__(self, logits: torch.Tensor) -> torch.Tensor:
        """The next token of each row from a step's logits ([batch, vocab])."""
        return self.advance(self.pick(self.scores(logits)))

    def unfinished(self) -> torch.Tensor | None:
        """Which rows have not ended yet (a device tensor, not read here); None when the call has
        no end-of-sequence token."""
        if not self.end_ids or self.finished is None:
            return None
        return ~self.finished

    def overflowed(self) -> bool:
        """Whether the top-k sampler met a step it could not serve since start (reads the
        device: once per call; the call is then made again with transformers' processors)."""
        return self.top is not None and self.top.overflowed()
