"""A decode step's choice of the next token, as transformers' _sample makes it: the argmax, or
transformers' processors (or the top-k sampler's) and a draw; under teacher forcing, the forced
token, the step's logits kept for the measured rule (decode_check)."""

from __future__ import annotations

import torch
from torch import nn

from . import sampling
from .decode_call import Greedy


class Choice:
    """The part of DecodeLoop that chooses tokens (its state is set in DecodeLoop.__init__:
    forcing, forced_logits, captured)."""


    def _choose(self, call: Greedy, logits: torch.Tensor, seq: torch.Tensor | None,
                sampler: "sampling.TopSampler | sampling.RecordedDraw | None" = None) -> torch.Tensor:
        """The next token from a forward's logits, as transformers' _sample chooses it (under
        teacher forcing: the forced token, the logits kept)."""
        if self.forcing is not None:
            return self._forced(call, logits, seq, sampler)
        if call.processors is None and not call.sample:
            return logits[:, -1, :].argmax(-1)
        if isinstance(sampler, sampling.RecordedDraw):
            return sampler(logits[:, -1])
        if sampler is not None:
            scores = sampler.process(logits[:, -1].to(copy=True, dtype=torch.float32))
        else:
            scores = self._process(call, logits, seq)
        if self.captured is not None:
            self.captured.append(scores.clone())
        if call.sample:
            return torch.multinomial(nn.functional.softmax(scores, dim=-1), num_samples=1).squeeze(1)
        return torch.argmax(scores, dim=-1)

    def _forced(self, call: Greedy, logits: torch.Tensor, seq: torch.Tensor | None,
                sampler: "sampling.TopSampler | sampling.RecordedDraw | None") -> torch.Tensor:
        """Teacher forcing: the step's raw logits (and, while captured, its processed scores:
        the top-k sampler's where it serves the call) kept, the forced token returned (past the
        forced ones, the argmax)."""
        step = len(self.forced_logits)
        self.forced_logits.append(logits[:, -1].detach().to(copy=True, dtype=torch.float32))
        if self.captured is not None:
            if isinstance(sampler, sampling.TopSampler):
                self.captured.append(sampler.process(logits[:, -1].to(copy=True, dtype=torch.float32)))
            else:
                self.captured.append(self._process(call, logits, seq))
        if step < self.forcing.shape[1]:
            return self.forcing[:, step].to(logits.device)
        return logits[:, -1].argmax(-1)

    @staticmethod
    def _process(call: Greedy, logits: torch.Tensor, seq: torch.Tensor | None) -> torch.Tensor:
        """The processed next-token scores: the last logits in float32 through transformers'
        processors for the call, given the sequence so far."""
        scores = logits[:, -1].to(copy=True, dtype=torch.float32)
        if call.processors is not None:
            scores = call.processors(seq, scores)
        return scores
