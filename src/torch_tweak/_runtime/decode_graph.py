"""The graph loop: one decode step recorded as a device graph per static cache shape and
replayed per token by the extension's loop (_C.replay_steps), no Python per token."""

from __future__ import annotations

import contextlib
import logging
from typing import Any, Callable

import torch

from .. import _C
from . import prefill, sampling
from .decode_call import GRAPH_PROCESSORS, Greedy, plain_causal
from .decode_model import Plain, bounded, decode_context, lay_out, logits_of, new_cache

logger = logging.getLogger("torch_tweak")


CHECK_EVERY = 16
"""Graph replays between two reads of the stopping rule (each read waits for the device)."""


class StepGraph:
    """One decode step recorded as a device graph, for one static cache (batch, length): the
    untuned forward with the workload's layout, the choice of the next token (the argmax, or
    GRAPH_PROCESSORS and a draw), the next input and the token's place in the output."""

    def __init__(self, loop: Any, cache: Any, batch: int, length: int, device: torch.device,
                 prompt: Greedy) -> None:
        self.cache = cache
        self.length = length
        self.token = torch.zeros(batch, 1, dtype=prompt.input_ids.dtype, device=device)
        self.tokens = torch.zeros(batch, length + 1, dtype=prompt.input_ids.dtype, device=device)
        self.step = torch.zeros(1, dtype=torch.int64, device=device)
        self.position = torch.zeros((), dtype=torch.int64, device=device)
        self.arange = torch.arange(length, device=device)
        shape = (batch, 1, 1, length)

        def mask() -> Any:
            return loop.mask_form((self.arange <= self.position).view(1, 1, 1, length).expand(shape))

        forward = loop.model

        def step() -> None:
            kwargs = lay_out(loop.layouts["decode"], loop.cache_arg, self.token, cache, self.position, None, mask)
            nxt = loop._choose(prompt, logits_of(forward(**kwargs)), None)
            self.token.copy_(nxt.view(batch, 1))
            self.tokens.index_copy_(1, self.step, nxt.view(batch, 1))
            self.step.add_(1)
            self.position.add_(1)

        @contextlib.contextmanager
        def plain() -> Any:
            with Plain(loop.model), decode_context(loop.model):
                yield

        # the warm-up runs write a step into the cache: the caller resets it afterwards
        self.graph, _ = sampling.record_graph(step, device, warmups=3, context=plain)
        self.weights = prefill.weights_of(loop.model)  # what the graph reads of the model, by address

    def run(self, first: torch.Tensor, prompt_len: int, max_new: int, finished: Callable[[int], bool]) -> torch.Tensor:
        """Tokens 1..max_new-1 after `first`; returns the tokens buffer's first `max_new` columns
        (or fewer when `finished` says every sequence ended)."""
        self.token.copy_(first.view(-1, 1))
        self.tokens[:, 0].copy_(first)
        self.step.fill_(1)
        self.position.fill_(prompt_len)
        done = _C.replay_steps(self.graph.replay, 1, max_new, CHECK_EVERY, finished)
        return self.tokens[:, :done]



class GraphSteps:
    """The part of DecodeLoop that records and keeps its step graphs (its state is set in
    DecodeLoop.__init__: _graphs, unrecorded_steps)."""

    def graph_problem(self, call: Greedy) -> str | None:
        """Why a graph loop cannot record this call's decode step, or None. A recorded step
        replays fixed work: the argmax or a draw after processors that read only the scores
        (GRAPH_PROCESSORS), no padding, and masks the loop makes itself (plain_causal: a sliding
        window's static cache keeps its place in Python). A call with no static cache or not on
        CUDA runs its steps one by one."""
        if self.kind != "graph" or not self.records(call):
            return None
        other = [type(p).__name__ for p in (call.processors or ()) if type(p).__name__ not in GRAPH_PROCESSORS]
        if other:
            return f"logits processing that reads the sequence so far ({', '.join(other)}), which a graph loop " \
                   "does not record"
        if call.mask is not None:
            return "padding in the prompt, which the graph loop does not record"
        if not plain_causal(self.model):
            return "attention other than one causal mask (a sliding window, chunks, not SDPA): the graph loop " \
                   "does not record it"
        return None

    def records(self, call: Greedy) -> bool:
        """Whether this loop records the call's decode step as a device graph."""
        return self.kind == "graph" and call.static and call.input_ids.device.type == "cuda"

    def _step_graph(self, call: Greedy, key: tuple) -> StepGraph | None:
        """The recorded decode step of the call's shape and settings (`key`), recorded at its
        first call; None where its recording failed (said once: such calls run step by step)."""
        entry = self._graphs.get(key)
        if entry is not None and prefill.weights_moved(entry.weights):
            # a weight replaced or moved since the recording (model.to, a new Parameter): the
            # graph would read the old memory, so the step is recorded again on the new
            del self._graphs[key]
            entry = None
        if entry is None and key not in self.unrecorded_steps:
            batch, length, device = key[:3]
            cache = new_cache(self.model, call.static, length)
            try:
                self._prefill(call, cache)  # lays the cache out before the step is recorded
                entry = StepGraph(self, cache, batch, length, device, call)
            except Exception as exc:  # this shape's calls run step by step
                if not self.unrecorded_steps:
                    logger.warning("torch-tweak: the graph loop could not record its decode step for batch %d (%s: "
                                   "%s); such calls run step by step", batch, type(exc).__name__, exc)
                bounded(self.unrecorded_steps, key, f"{type(exc).__name__}: {exc}")
                return None
            self._graphs[key] = entry
        return entry
