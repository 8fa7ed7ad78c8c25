"""A decode loop's steps one by one (or through transformers' compiled forward, or the tuned
loop's build of it), as transformers' decoding loop makes them, and how it stops."""

from __future__ import annotations

import logging
from typing import Any, Callable

import torch

from . import sampling
from .decode_call import Greedy, plain_causal
from .decode_graph import CHECK_EVERY
from .decode_model import compile_config, contiguous, decode_context, logits_of, tuned_settings

logger = logging.getLogger("torch_tweak")


def finished_rows(tokens: torch.Tensor, eos: torch.Tensor) -> torch.Tensor:
    """Per sequence: whether an end-of-sequence token is among `tokens`."""
    return torch.isin(tokens, eos).any(dim=1)


def stop_after_eos(tokens: torch.Tensor, eos: torch.Tensor | None, pad: int | None) -> torch.Tensor:
    """transformers' stopping rule on tokens decoded past it: after a sequence's first
    end-of-sequence token, pad; the output ends at the step where the last sequence ended."""
    if eos is None or tokens.shape[1] == 0:
        return tokens
    hit = torch.isin(tokens, eos)
    ended = hit.cumsum(dim=1) > 0
    after = ended.clone()
    after[:, 1:] = ended[:, :-1]
    after[:, 0] = False
    tokens = torch.where(after, torch.full_like(tokens, pad if pad is not None else 0), tokens)
    if bool(ended[:, -1].all()):
        last = int(hit.float().argmax(dim=1).max())  # the step at which the last sequence ended
        tokens = tokens[:, :last + 1]
    return tokens



class Steps:
    """The part of DecodeLoop that runs its decode steps (its state is set in DecodeLoop.__init__:
    _tuned, _draws, unrecorded, record_draws, _previous_len)."""

    # -------------------------------------------------------------- decoding
    def _static_length(self, call: Greedy) -> int:
        # transformers' rule: prompt + new tokens - 1, never shorter than an earlier call's,
        # at least generation_config.max_cache_len
        length = call.input_ids.shape[1] + call.max_new - 1
        if call.max_cache_len is not None:
            length = max(length, call.max_cache_len)
        length = max(length, self._previous_len)
        self._previous_len = length
        return length

    def _steps(self, logits: torch.Tensor, cache: Any, call: Greedy, eos: torch.Tensor | None, length: int,
               compiled: bool, sampler: "sampling.TopSampler | sampling.RecordedDraw | None" = None) -> torch.Tensor:
        """Every new token after the prefill's `logits`, step by step, as transformers' decoding
        loop makes them: its logits processors on the sequence so far, then the argmax or a draw
        of torch.multinomial from the softmax, with finished sequences fed the pad token. With
        `compiled`, the steps run transformers' compiled forward (the one its generate() would
        call: compiled once per model and compile config, kept on the model), the arguments
        contiguous as transformers lays them out, so that its guards hold and nothing compiles
        again. No step reads the device, but the stopping rule every CHECK_EVERY steps. A
        `sampler` processes the scores in place of the processors (sampling.TopSampler)."""
        model = self.model
        forward = self.compiled_forward(call) if compiled else model
        ids = call.input_ids
        batch, prompt = ids.shape
        device = ids.device
        seq = ids if call.processors is not None else None  # the sequence so far, for the processors
        mask = call.mask
        positions = self._positions(call)
        last = None if positions is None else positions[..., -1:]
        own = call.static and call.mask is None and plain_causal(model)
        arange = torch.arange(length, device=device) if own else None
        unfinished = torch.ones(batch, dtype=torch.long, device=device) if eos is not None else None
        tokens = torch.empty(batch, call.max_new, dtype=ids.dtype, device=device)
        nxt = self._choose(call, logits, seq, sampler)
        done = 0
        with decode_context(model):
            while True:
                if unfinished is not None:
                    nxt = nxt * unfinished + call.pad * (1 - unfinished)
                    unfinished = unfinished & ~torch.isin(nxt, eos)
                tokens[:, done] = nxt
                done += 1
                if seq is not None:
                    seq = torch.cat([seq, nxt[:, None]], dim=-1)
                if mask is not None:
                    mask = torch.cat([mask, mask.new_ones((batch, 1))], dim=-1)
                if done >= call.max_new:
                    break
                self._in_time()
                if unfinished is not None and done % CHECK_EVERY == 0 and not bool(unfinished.any()):
                    break
                position = prompt + done - 1  # the place in the cache of the token fed now
                step_positions = None if last is None else last + done
                if own:
                    attention = self.mask_form((arange <= position).view(1, 1, 1, length).expand(batch, 1, 1, length))
                else:
                    attention = self._attention(call, cache, mask, step_positions, 1, False)
                kwargs = self._kwargs("decode", nxt.view(batch, 1), cache, step_positions, attention)
                if compiled:  # contiguous as transformers makes them (a dict of masks too): its guards hold
                    kwargs = {k: contiguous(v) for k, v in kwargs.items()}
                # the logits are read (copied) before the next call reuses the output's memory
                nxt = self._choose(call, logits_of(forward(**kwargs)), seq, sampler)
        return tokens[:, :done]

    def compiled_forward(self, call: Greedy) -> Callable:
        """The compiled forward a compiled loop's steps run: transformers' own (the "compiled"
        loop: compiled once per model and compile config, kept on the model), or the "tuned"
        loop's build of the same forward with tuned_settings (kept on the loop, built again when
        the call's compile config changes, as transformers does)."""
        if self.kind == "compiled":
            return self.model.get_compiled_call(getattr(call.config, "compile_config", None))
        config = compile_config(self.model, call)
        if self._tuned is None or self._tuned[0] != config:
            settings = tuned_settings(config)
            if settings is None:
                raise RuntimeError("the call's compile config does not compile with Inductor, whose option the "
                                   "tuned loop adds")
            self._tuned = (config, torch.compile(self.model.__call__, **settings))
        return self._tuned[1]

    def tuned_problem(self, call: Greedy) -> str | None:
        """Why the tuned loop cannot build its forward for this call (a compile config that
        does not compile with Inductor), or None."""
        if self.kind != "tuned" or not call.static:
            return None
        config = compile_config(self.model, call)
        if (self._tuned is not None and self._tuned[0] == config) or tuned_settings(config) is not None:
            return None  # built for this config already, or buildable
        return "a compile config whose backend is not Inductor, whose option the tuned loop adds"

    def _sampler(self, call: Greedy, vocab: int) -> "sampling.TopSampler | sampling.RecordedDraw | None":
        """The sampler of a call's choices (None where it does not serve): recorded as a device
        graph once per batch, vocabulary and settings (sampling.RecordedDraw), but where the
        loop's processed scores are read (the distribution check) or record_draws is off."""
        batch, device = call.input_ids.shape[0], call.input_ids.device
        sampler = sampling.TopSampler.of(call.processors, call.sample, device)
        if sampler is None or self.captured is not None or not self.record_draws:
            return sampler
        key = sampling.RecordedDraw.key(sampler, batch, vocab, device)
        if key in self.unrecorded:
            return sampler
        draw = self._draws.pop(key, None)
        if draw is None:
            if len(self._draws) >= sampling.RECORDED_DRAWS:
                self._draws.pop(next(iter(self._draws)))
            try:
                draw = sampling.RecordedDraw(sampler, batch, vocab, device)
            except Exception as exc:  # the call is served eagerly, and so are later ones of this shape
                self.unrecorded[key] = f"{type(exc).__name__}: {exc}"
                logger.warning("torch-tweak: the decode loop could not record its sampler's choice for batch %d "
                               "(%s); such calls choose their tokens kernel by kernel", batch, self.unrecorded[key])
                sampler.flag = None  # RecordedDraw gave it a buffer of its own
                return sampler
        self._draws[key] = draw  # the newest last
        draw.reset()
        return draw

    @staticmethod
    def _sampling_key(call: Greedy) -> tuple:
        """What of a call's choice of the next token a recorded step bakes in: whether it draws,
        and each processor's settings (its plain attributes)."""
        processors = tuple((type(p).__name__, tuple(sorted((k, v) for k, v in vars(p).items()
                                                           if isinstance(v, (bool, int, float, str)))))
                           for p in (call.processors or ()))
        return (call.sample, processors)
