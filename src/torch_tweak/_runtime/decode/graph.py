"""The graph loop: one decode step recorded as a device graph per static cache shape and
replayed per token by the extension's loop (_C.replay_steps, told by steps.Stopping), no
Python per token."""

from __future__ import annotations

import contextlib
import logging
from typing import Any

import torch
from torch import nn

from ..._core.model_state import weights_moved, weights_of
from .call import Greedy
from .choice import Choice
from .inputs import StepInputs, plain_causal
from .model import bounded, decode_context, logits_of, new_cache, plain_model, record_graph
from .prefill import Prefills
from .steps import Stopping

logger = logging.getLogger("torch_tweak")


GRAPH_PROCESSORS = frozenset({"TemperatureLogitsWarper", "TopKLogitsWarper", "TopPLogitsWarper",
                              "MinPLogitsWarper"})
"""The processors a recorded step runs: those that read only the scores (never the sequence so
far, whose length grows, nor its length), so the same recorded work serves every step."""


class StepGraph:
    """One decode step recorded as a device graph, for one static cache (batch, length): the
    untuned forward with the workload's layout, the choice of the next token (the argmax, or
    GRAPH_PROCESSORS and a draw), the next input and the token's place in the output."""

    def __init__(self, model: nn.Module, inputs: StepInputs, choice: Choice, cache: Any, length: int,
                 call: Greedy) -> None:
        batch, device = call.input_ids.shape[0], call.input_ids.device
        self.cache = cache
        self.token = torch.zeros(batch, 1, dtype=call.input_ids.dtype, device=device)
        self.tokens = torch.zeros(batch, length + 1, dtype=call.input_ids.dtype, device=device)
        self.step = torch.zeros(1, dtype=torch.int64, device=device)
        self.position = torch.zeros((), dtype=torch.int64, device=device)
        self.arange = torch.arange(length, device=device)
        shape = (batch, 1, 1, length)

        def mask() -> Any:
            return inputs.mask_form((self.arange <= self.position).view(1, 1, 1, length).expand(shape))

        def step() -> None:
            kwargs = inputs.step_kwargs(self.token, cache, self.position, mask)
            nxt = choice.choose(call, logits_of(model(**kwargs)), None)
            self.token.copy_(nxt.view(batch, 1))
            self.tokens.index_copy_(1, self.step, nxt.view(batch, 1))
            self.step.add_(1)
            self.position.add_(1)

        @contextlib.contextmanager
        def plain() -> Any:
            with plain_model(model), decode_context(model):
                yield

        # the warm-up runs write a step into the cache: the caller resets it afterwards
        self.graph, _ = record_graph(step, device, warmups=3, context=plain)
        self.weights = weights_of(model)  # what the graph reads of the model, by address

    def run(self, first: torch.Tensor, prompt_len: int, max_new: int, stopping: Stopping,
            eos: torch.Tensor | None) -> torch.Tensor:
        """Tokens 1..max_new-1 after `first`; returns the tokens buffer's first `max_new` columns
        (or fewer where the stopping rule says every sequence ended)."""
        self.token.copy_(first.view(-1, 1))
        self.tokens[:, 0].copy_(first)
        self.step.fill_(1)
        self.position.fill_(prompt_len)
        done = stopping.replay(self.graph.replay, max_new, self.tokens, eos)
        return self.tokens[:, :done]


class GraphSteps:
    """A loop's recorded decode steps, one per static cache shape and choice (`on`: the loop's
    kind records them)."""

    def __init__(self, model: nn.Module, inputs: StepInputs, prefills: Prefills, choice: Choice,
                 stopping: Stopping, on: bool) -> None:
        self.model = model
        self.inputs = inputs
        self.prefills = prefills
        self.choice = choice
        self.stopping = stopping
        self.on = on
        self.graphs: dict[tuple, StepGraph] = {}
        self.unrecorded: dict[tuple, str] = {}  # a step whose recording failed: why (run step by step)

    def problem(self, call: Greedy) -> str | None:
        """Why a graph loop cannot record this call's decode step, or None. A recorded step
        replays fixed work: the argmax or a draw after processors that read only the scores
        (GRAPH_PROCESSORS), no padding, and masks the loop makes itself (plain_causal: a sliding
        window's static cache keeps its place in Python). A call with no static cache or not on
        CUDA runs its steps one by one."""
        if not self.records(call):
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
        return self.on and call.static and call.input_ids.device.type == "cuda"

    def run(self, call: Greedy, key: tuple, eos: torch.Tensor | None) -> torch.Tensor | None:
        """The call's new tokens from the recorded step of its shape and choice (`key`: batch,
        length, device...), its prefill first on the step's cache; None where the step could not
        be recorded (the call then runs step by step)."""
        entry = self._entry(call, key)
        if entry is None:
            return None
        logits = self.prefills.first_logits(call, entry.cache, ("graph",) + key)
        first = self.choice.choose(call, logits, call.input_ids if call.processors is not None else None)
        return entry.run(first, call.input_ids.shape[1], call.max_new, self.stopping, eos)

    def _entry(self, call: Greedy, key: tuple) -> StepGraph | None:
        """The recorded decode step of `key`, recorded at its first call; None where its
        recording failed (said once: such calls run step by step)."""
        entry = self.graphs.get(key)
        if entry is not None and weights_moved(entry.weights):
            # a weight replaced or moved since the recording (model.to, a new Parameter): the
            # graph would read the old memory, so the step is recorded again on the new
            del self.graphs[key]
            entry = None
        if entry is None and key not in self.unrecorded:
            batch, length = key[:2]
            cache = new_cache(self.model, call.static, length)
            try:
                self.prefills.run(call, cache)  # lays the cache out before the step is recorded
                entry = StepGraph(self.model, self.inputs, self.choice, cache, length, call)
            except Exception as exc:  # this shape's calls run step by step
                if not self.unrecorded:
                    logger.warning("torch-tweak: the graph loop could not record its decode step for batch %d (%s: "
                                   "%s); such calls run step by step", batch, type(exc).__name__, exc)
                bounded(self.unrecorded, key, f"{type(exc).__name__}: {exc}")
                return None
            self.graphs[key] = entry
        return entry

    def figures(self) -> dict:
        """What tt.status says of the recorded steps: how many shapes, and why others run step by
        step."""
        return {"recorded_steps": len(self.graphs), "unrecorded_steps": list(self.unrecorded.values())}
