"""A decode loop's prefill: the prompt through the model, and on a cache kept between calls,
the prompt shape's prefill recorded as a device graph at its RECORD_AFTER-th call and replayed
after (prefill.RecordedPrefill)."""

from __future__ import annotations

import logging
from typing import Any

import torch

from . import prefill
from .decode_call import Greedy
from .decode_model import Plain, bounded, logits_of

logger = logging.getLogger("torch_tweak")


class Prefills:
    """The part of DecodeLoop that runs and records its prefills (its state is set in
    DecodeLoop.__init__: record_prefills, _prefills, _prefill_calls, unrecorded_prefills)."""


    def _first_logits(self, call: Greedy, cache: Any, kept: tuple) -> torch.Tensor:
        """The prompt's logits on a cache kept between calls (`kept`: its key), the cache reset
        first: from the prompt shape's recorded prefill where there is one (made at the
        shape's RECORD_AFTER-th call, prefill.RecordedPrefill), else eagerly. A prefill that
        cannot be recorded or replayed is said once and runs eagerly from then on."""
        batch, prompt = call.input_ids.shape
        key = kept + (prompt,)
        recorded = self._prefills.pop(key, None) if self.record_prefills else None
        if recorded is None and self.record_prefills and key not in self.unrecorded_prefills and \
                prefill.RecordedPrefill.eligible(batch, prompt, call.mask is not None):
            calls = self._prefill_calls.pop(key, 0) + 1
            if calls < prefill.RECORD_AFTER:
                bounded(self._prefill_calls, key, calls)
            else:
                try:
                    recorded = self._record_prefill(call, cache)
                except Exception as exc:  # this shape's prefills run eagerly
                    self._unrecorded_prefill(key, batch, prompt, f"{type(exc).__name__}: {exc}")
        if recorded is not None:
            try:
                logits = recorded(call.input_ids)
            except prefill.Moved:  # dropped: recorded again at the shape's next calls
                pass
            except prefill.Stale as exc:
                self._unrecorded_prefill(key, batch, prompt, str(exc))
            else:
                while len(self._prefills) >= prefill.PREFILL_GRAPHS:
                    self._prefills.pop(next(iter(self._prefills)))
                self._prefills[key] = recorded  # the newest last
                return logits
        cache.reset()
        return self._prefill(call, cache)

    def _record_prefill(self, call: Greedy, cache: Any) -> prefill.RecordedPrefill:
        """The call's prefill on `cache` recorded: the untuned forward on a buffer of the prompt,
        with the position ids and attention mask of a prompt with no padding (they depend only
        on its shape), the cache reset first."""
        ids = call.input_ids.clone()
        positions = self._positions(call)
        cache.reset()
        attention = self._attention(call, cache, None, positions, ids.shape[1], True)
        kwargs = self._kwargs("prefill", ids, cache, positions, attention)
        model = self.model

        def run() -> torch.Tensor:
            cache.reset()
            return logits_of(model(**kwargs))

        return prefill.RecordedPrefill(run, ids, cache, lambda: Plain(model), model)

    def _unrecorded_prefill(self, key: tuple, batch: int, prompt: int, why: str) -> None:
        if not self.unrecorded_prefills:
            logger.warning("torch-tweak: the decode loop could not record its prefill for a prompt of %d x %d "
                           "tokens (%s); such prompts run eagerly", batch, prompt, why)
        bounded(self.unrecorded_prefills, key, why)

    def _prefill(self, call: Greedy, cache: Any) -> torch.Tensor:
        """The prompt through the model; returns its logits."""
        ids = call.input_ids
        positions = self._positions(call)
        attention = self._attention(call, cache, call.mask, positions, ids.shape[1], True)
        return logits_of(self.model(**self._kwargs("prefill", ids, cache, positions, attention)))
