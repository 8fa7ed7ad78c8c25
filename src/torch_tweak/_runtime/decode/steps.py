"""A decode loop's steps one by one, as transformers' decoding loop makes them (Steps), from one
step source: where a step's logits come from (Forward, Compiled, Tuned); and how a loop stops
(Stopping: the end-of-sequence rule, finished sequences fed the pad token, the read of the
rule every CHECK_EVERY steps, what _C.replay_steps is told, the time a loaded loop's check may
take)."""

from __future__ import annotations

import time
from typing import Any, Callable

import torch
from torch import nn

from ... import _C
from ..._core import settings
from .call import Greedy, call_kind
from .choice import Choice, RecordedDraw, TopSampler
from .inputs import StepInputs, contiguous, plain_causal
from .model import compile_config, decode_context, logits_of, transformers_compiles, tuned_settings


class Stopping:
    """How a loop stops: after `max_new` tokens, or once every sequence has ended (an
    end-of-sequence token, read every CHECK_EVERY steps; a finished sequence is fed the pad
    token meanwhile, and its tokens after the end are cut as transformers cuts them), or past
    the deadline of a loaded loop's check."""

    def __init__(self) -> None:
        self.deadline: float | None = None  # a time.monotonic() value: set while decode_check.apply_loop checks it

    def in_time(self) -> None:
        if self.deadline is not None and time.monotonic() > self.deadline:
            raise TimeoutError(f"its check took longer than {settings.LOOP_CHECK_SECONDS:g} s (LOOP_CHECK_SECONDS)")

    @staticmethod
    def eos(call: Greedy) -> torch.Tensor | None:
        """The call's end-of-sequence ids on its device, or None when it has none."""
        ids = call.input_ids
        return torch.tensor(call.eos, dtype=ids.dtype, device=ids.device) if call.eos else None

    @staticmethod
    def feed(nxt: torch.Tensor, unfinished: torch.Tensor | None, eos: torch.Tensor | None,
             pad: int | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """transformers' rule: a finished sequence is fed the pad token. Returns the tokens fed
        and which sequences are still unfinished after them (None: no end-of-sequence ids)."""
        if unfinished is None:
            return nxt, None
        nxt = nxt * unfinished + pad * (1 - unfinished)
        return nxt, unfinished & ~torch.isin(nxt, eos)

    def ended(self, done: int, max_new: int, unfinished: torch.Tensor | None) -> bool:
        """After `done` steps: whether the loop stops (the device is read every CHECK_EVERY)."""
        if done >= max_new:
            return True
        self.in_time()
        return unfinished is not None and done % settings.CHECK_EVERY == 0 and not bool(unfinished.any())

    def replay(self, step: Callable[[], Any], max_new: int, tokens: torch.Tensor, eos: torch.Tensor | None) -> int:
        """Tokens 1..max_new-1 made by replaying `step` (a recorded step that writes its token
        into `tokens`) from C, which asks every CHECK_EVERY replays whether every sequence has an
        end-of-sequence token among its tokens so far; returns how many tokens there are."""

        def finished(n: int) -> bool:
            self.in_time()
            return eos is not None and bool(torch.isin(tokens[:, :n], eos).any(dim=1).all())

        return _C.replay_steps(step, 1, max_new, settings.CHECK_EVERY, finished)

    @staticmethod
    def cut(tokens: torch.Tensor, eos: torch.Tensor | None, pad: int | None) -> torch.Tensor:
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


class Forward:
    """A step source: where a decode step's logits come from. This one is the model's own
    forward: the steps of the "loop" kind, and the step the "graph" kind records."""

    compiled = False
    """Whether the source's forward is compiled: it serves only the calls transformers
    compiles (compiles), a loop keeps their static cache per shape (its tensors keep their
    addresses, so the compiled forward's device graphs replay), and the model's modules are
    left untuned (tt.tweak searches no depth under such a loop)."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model

    def problem(self, call: Greedy) -> str | None:
        """Why the source cannot make this call's steps (transformers' generate() then runs it),
        or None."""
        return None

    def compiles(self, call: Greedy, cache: Any) -> bool:
        """Whether the call's steps run the source's forward (else the model's plain forward)."""
        return False

    def forward(self, call: Greedy) -> Callable:
        """The forward the call's steps run, where compiles says so."""
        return self.model

    @staticmethod
    def kind(call: Greedy) -> tuple:
        """The kind of call a measurement of this source speaks for (call.call_kind: the batch
        size and the cache): a loop serves only the kinds it was measured on."""
        return call_kind(call)


class Compiled(Forward):
    """transformers' own compiled forward (the "compiled" kind): for the calls its generate()
    compiles (transformers_compiles), the very forward it would call, compiled once per model
    and compile config and kept on the model; the untuned tokens are then those of its kernels."""

    compiled = True

    def compiles(self, call: Greedy, cache: Any) -> bool:
        return transformers_compiles(self.model, call, cache)

    def forward(self, call: Greedy) -> Callable:
        return self.model.get_compiled_call(getattr(call.config, "compile_config", None))


class Tuned(Compiled):
    """The "tuned" kind: transformers' forward compiled again with transformers' settings plus
    Inductor's coordinate descent tuning (tuned_settings), kept on the source and built again
    when the call's compile config changes, as transformers does. On CUDA a one-row matrix
    product, each linear layer of a batch-1 step, becomes a reduction kernel tuned for the
    memory's bandwidth instead of a cuBLAS product: other kernels, so its tokens are checked
    against the untuned call's like any candidate's. Two step graphs of Inductor kernels were
    tried and dropped: a separate build of an eager call (its tokens differed from the untuned
    eager model's within a few steps), and transformers' compiled forward built again without
    Inductor's own graphs and recorded with the argmax (the compiled tokens, but no faster than
    the compiled loop: its kernels alone take 1.50 ms a token on the Llama-1B shape,
    bench/results/decode-anatomy.md)."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self._built: tuple[Any, Callable] | None = None  # (compile config, compiled forward)

    def problem(self, call: Greedy) -> str | None:
        """Why the forward cannot be built for this call (a compile config that does not
        compile with Inductor), or None."""
        if not call.static:
            return None
        config = compile_config(self.model, call)
        if (self._built is not None and self._built[0] == config) or tuned_settings(config) is not None:
            return None  # built for this config already, or buildable
        return "a compile config whose backend is not Inductor, whose option the tuned loop adds"

    def forward(self, call: Greedy) -> Callable:
        config = compile_config(self.model, call)
        if self._built is None or self._built[0] != config:
            settings = tuned_settings(config)
            if settings is None:
                raise RuntimeError("the call's compile config does not compile with Inductor, whose option the "
                                   "tuned loop adds")
            self._built = (config, torch.compile(self.model.__call__, **settings))
        return self._built[1]


class Steps:
    """A loop's decode steps one by one, as transformers' decoding loop makes them, each step's
    logits from the step source."""

    def __init__(self, model: nn.Module, inputs: StepInputs, choice: Choice, stopping: Stopping,
                 source: Forward) -> None:
        self.model = model
        self.inputs = inputs
        self.choice = choice
        self.stopping = stopping
        self.source = source

    def run(self, logits: torch.Tensor, cache: Any, call: Greedy, eos: torch.Tensor | None, length: int,
            compiled: bool, sampler: "TopSampler | RecordedDraw | None" = None) -> torch.Tensor:
        """Every new token after the prefill's `logits`, step by step, as transformers' decoding
        loop makes them: its logits processors on the sequence so far, then the argmax or a draw
        of torch.multinomial from the softmax, with finished sequences fed the pad token. With
        `compiled`, the steps run the source's forward (transformers' compiled one, the one its
        generate() would call), the arguments contiguous as transformers lays them out, so that
        its guards hold and nothing compiles again. No step reads the device, but the stopping
        rule every CHECK_EVERY steps. A `sampler` processes the scores in place of the processors
        (choice.TopSampler)."""
        model = self.model
        forward = self.source.forward(call) if compiled else model
        ids = call.input_ids
        batch, prompt = ids.shape
        device = ids.device
        seq = ids if call.processors is not None else None  # the sequence so far, for the processors
        mask = call.mask
        positions = self.inputs.positions(call)
        last = None if positions is None else positions[..., -1:]
        own = call.static and call.mask is None and plain_causal(model)
        arange = torch.arange(length, device=device) if own else None
        unfinished = torch.ones(batch, dtype=torch.long, device=device) if eos is not None else None
        tokens = torch.empty(batch, call.max_new, dtype=ids.dtype, device=device)
        nxt = self.choice.choose(call, logits, seq, sampler)
        done = 0
        with decode_context(model):
            while True:
                nxt, unfinished = self.stopping.feed(nxt, unfinished, eos, call.pad)
                tokens[:, done] = nxt
                done += 1
                if seq is not None:
                    seq = torch.cat([seq, nxt[:, None]], dim=-1)
                if mask is not None:
                    mask = torch.cat([mask, mask.new_ones((batch, 1))], dim=-1)
                if self.stopping.ended(done, call.max_new, unfinished):
                    break
                position = prompt + done - 1  # the place in the cache of the token fed now
                step_positions = None if last is None else last + done
                if own:
                    attention = self.inputs.mask_form((arange <= position).view(1, 1, 1, length)
                                                      .expand(batch, 1, 1, length))
                else:
                    attention = self.inputs.attention(call, cache, mask, step_positions, 1, False)
                kwargs = self.inputs.kwargs("decode", nxt.view(batch, 1), cache, step_positions, attention)
                if compiled:  # contiguous as transformers makes them (a dict of masks too): its guards hold
                    kwargs = {k: contiguous(v) for k, v in kwargs.items()}
                # the logits are read (copied) before the next call reuses the output's memory
                nxt = self.choice.choose(call, logits_of(forward(**kwargs)), seq, sampler)
        return tokens[:, :done]
