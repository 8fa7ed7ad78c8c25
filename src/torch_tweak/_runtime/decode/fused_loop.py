"""The fused loop (the "fused" kind): generate() calls decoded by tweak's own decode step
(fused_step.FusedDecoder) and its choice (fused_choice.StepChoice).

- ``Fused``, the kind's step source: the model read once for the step (its modules as shipped;
  tuned modules are taken out while it is read, the step reads the same tensors), read again
  where a weight moved; the step's kernels ("torch", "triton", "inductor": fused_step.Step);
  which calls it serves (``problem``): no padding in the prompt, at most FUSED_BUCKETS[-1] rows, the
  processors StepChoice runs as fixed work, the model on the inputs' device. One measurement
  serves every batch of 1 to 8 rows (``kind``): each runs the same step in its bucket.
- ``FusedSteps``, the loop's part that decodes a call: the prompt through the model's own
  forward (the Prefills part: the tuned modules, and on CUDA its recorded prefill) into a
  StaticCache of the call's bucket (decoder.cache; the rows past the batch copies of its last
  row, computed and cut), then each new token from the step's logits of the batch's rows and
  the call's StepChoice, fed back and written out, stopping as steps.Stopping says. On CUDA
  the step, the choice, the token's write and the position's move are recorded as one device
  graph per batch, cache length and settings (FusedGraph) and replayed per token from C
  (_C.replay_steps, as the graph loop does); elsewhere, and while the loop's choice is watched
  (teacher forcing, the check's captured scores), the same work runs step by step.

A dynamic-cache call is served too: the loop uses its own static cache. The caches are kept per
bucket, length and grad mode (at most FUSED_CACHES), so that a step's buffers, its kernels'
launch settings and its recorded graph serve the next call of that shape.

``read_model`` and ``choice_for`` are the module's two makers of what a candidate runs (the
model's reading, a call's choice): tests replace them to make broken candidates.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any, Callable

import torch
from torch import nn

from ..._core import settings
from .call import Greedy
from .choice import Choice, rng_state, set_rng_state
from .fused_choice import StepChoice
from .fused_kernels import triton_problem
from .fused_step import FusedDecoder, Step, bucket
from .model import bounded, plain_model, record_graph, replay
from .prefill import RECORDS as PREFILL_RECORDS, Prefills
from .steps import Stopping

logger = logging.getLogger("torch_tweak")

KERNELS = ("torch", "triton", "inductor")
"""The kernels a fused loop's step runs (fused_step.FusedDecoder.runner)."""

RECORDS = frozenset({"cuda"})
"""The device types whose fused steps are recorded as device graphs (elsewhere step by step)."""


def read_model(model: nn.Module) -> FusedDecoder | str:
    """The model read for the step, its tuned modules taken out meanwhile (the step reads the
    same tensors), or why it is not served."""
    with plain_model(model):
        return FusedDecoder.of(model)


def choice_for(call: Greedy, top: bool) -> StepChoice | str:
    """The call's choice of the next token as fixed work (with `top`, the top-k sampler where it
    serves the call's device), or why its processors are not."""
    device = call.input_ids.device if top else None
    return StepChoice.of(call.processors, call.sample, call.eos, call.pad, device)


class Fused:
    """The "fused" kind's step source (module docs). Like steps.Forward it says which calls it
    serves and what its steps run; its steps are FusedSteps'."""

    compiled = False  # the model's own forward serves the prefill; modules are tuned under it

    def __init__(self, model: nn.Module, kernels: str = "torch") -> None:
        if kernels not in KERNELS:
            raise ValueError(f"kernels must be one of {', '.join(KERNELS)}, not {kernels!r}")
        self.model = model
        self.kernels = kernels
        read = read_model(model)
        self.refused = read if isinstance(read, str) else ""
        self.decoder: FusedDecoder | None = None if isinstance(read, str) else read

    def problem(self, call: Greedy) -> str | None:
        """Why the fused step cannot decode this call (transformers' generate() then runs it),
        or None."""
        if self.decoder is None:
            return f"a model the fused step does not serve ({self.refused})"
        ids = call.input_ids
        if ids.shape[0] > settings.FUSED_BUCKETS[-1]:
            return f"a batch of {ids.shape[0]} rows (the fused step serves 1 to {settings.FUSED_BUCKETS[-1]})"
        if call.mask is not None:
            return "padding in the prompt, which the fused step does not serve"
        where = self.decoder.device_problem(ids.device)
        if where is not None:
            return where
        if self.kernels == "triton":
            why = triton_problem(ids.device)
            if why is not None:
                return f"the fused step's Triton kernels ({why})"
        choice = choice_for(call, False)
        return f"{choice}, which the fused step's choice does not serve" if isinstance(choice, str) else None

    def compiles(self, call: Greedy, cache: Any) -> bool:
        return False

    def forward(self, call: Greedy) -> Callable:
        return self.model

    @staticmethod
    def kind(call: Greedy) -> tuple:
        """The kind of call a measurement of this source speaks for: every batch of 1 to 8 rows
        (one step, run in the batch's bucket: the kind says so of the batch), with the call's
        cache."""
        return (f"1 to {settings.FUSED_BUCKETS[-1]}", bool(call.static))

    def runner(self, cache: Any) -> Step:
        """The step's work on `cache` with the source's kernels; the model read again first where
        a weight was replaced or moved since (its steps are then made again)."""
        assert self.decoder is not None, self.refused
        if self.decoder.moved():
            read = read_model(self.model)
            if isinstance(read, str):
                raise RuntimeError(f"the model changed: the fused step does not serve it now ({read})")
            self.decoder = read
        return self.decoder.runner(cache, self.kernels)

    def cache(self, batch: int, length: int) -> Any:
        assert self.decoder is not None, self.refused
        return self.decoder.cache(batch, length)

    def vocab(self) -> int:
        assert self.decoder is not None, self.refused
        return self.decoder.vocab_size()


class FusedGraph:
    """One fused decode step recorded as a device graph, for one cache, batch and choice: the
    step's logits of the batch's rows, the choice of the next token, the token fed back and
    written out, the position moved on."""

    def __init__(self, step: Step, choice: StepChoice, ids: torch.Tensor, length: int, vocab: int) -> None:
        batch, device = ids.shape[0], ids.device
        self.step = step
        self.choice = choice
        self.token = torch.zeros(batch, dtype=torch.int64, device=device)
        self.tokens = torch.zeros(batch, length + 1, dtype=torch.int64, device=device)
        self.index = torch.zeros(1, dtype=torch.int64, device=device)
        self.position = torch.zeros((), dtype=torch.int64, device=device)
        self.device = device

        def body() -> None:
            nxt = choice(step(self.token, self.position))
            self.token.copy_(nxt)
            self.tokens.index_copy_(1, self.index, nxt.view(batch, 1))
            self.index.add_(1)
            self.position.add_(1)

        # the warm-ups write a step into the cache at position 0: the call's prefill empties it
        choice.start(ids, vocab)
        self.graph, _ = record_graph(body, device, warmups=3)

    def run(self, ids: torch.Tensor, logits: torch.Tensor, max_new: int, stopping: Stopping,
            eos: torch.Tensor | None) -> torch.Tensor:
        """The new tokens of the prompt `ids` from its prefill's last `logits` (the batch's rows):
        the first chosen here, the choice started on the call, then tokens 1..max_new-1 by
        replays; the first `max_new` columns of the tokens buffer, or fewer where every row
        ended."""
        self.choice.start(ids, logits.shape[-1])
        first = self.choice(logits)
        self.token.copy_(first)
        self.tokens[:, 0].copy_(first)
        self.index.fill_(1)
        self.position.fill_(ids.shape[1])
        done = stopping.replay(lambda: replay(self.graph, self.device), max_new, self.tokens,
                               None if eos is None else eos.to(torch.int64))
        return self.tokens[:, :done].to(ids.dtype)


class FusedSteps:
    """A fused loop's decoding of a call (module docs), from its step source."""

    def __init__(self, model: nn.Module, prefills: Prefills, choice: Choice, stopping: Stopping,
                 source: Fused) -> None:
        self.model = model
        self.prefills = prefills
        self.choice = choice
        self.stopping = stopping
        self.source = source
        self.caches: dict[tuple, Any] = {}  # (rows, length, device, mode) -> StaticCache, the newest last
        self.choices: dict[tuple, StepChoice] = {}  # (batch, device, top, settings) -> a call's choice, step by step
        self.graphs: dict[tuple, FusedGraph] = {}
        self.unrecorded: dict[tuple, str] = {}  # a step whose recording failed: why (its calls run step by step)
        self.resampled = 0  # calls made again without the top-k sampler (StepChoice.overflowed)

    def run(self, call: Greedy, eos: torch.Tensor | None, length: int, top: bool) -> torch.Tensor:
        """The call's new tokens ([batch, new]); `length`: its static cache's length by
        transformers' rule (0: a dynamic-cache call); `top`: the top-k sampler where it serves.
        Where the sampler met a step it could not serve, the call is made again from the same
        generator state without it (what the first run kept is dropped)."""
        ids = call.input_ids
        prompt = ids.shape[1]
        if not length:
            step = settings.FUSED_DYNAMIC_LENGTH
            length = -(-(prompt + call.max_new - 1) // step) * step
        key = (bucket(ids.shape[0]), length, ids.device, torch.is_inference_mode_enabled())
        cache = self._cache(key)
        state = rng_state(ids.device) if top and call.sample else None
        mark = self.choice.mark()
        tokens, choice = self._tokens(call, key, cache, top, eos)
        if state is not None and choice.overflowed():
            self.resampled += 1
            self.choice.rewind(mark)
            set_rng_state(ids.device, state)
            tokens, _ = self._tokens(call, key, cache, False, eos)
        return tokens

    def _cache(self, key: tuple) -> Any:
        cache = self.caches.pop(key, None)
        if cache is None:
            if len(self.caches) >= settings.FUSED_CACHES:
                old = next(iter(self.caches))
                del self.caches[old]
                self.graphs = {k: g for k, g in self.graphs.items() if k[:4] != old}
            cache = self.source.cache(key[0], key[1])
        self.caches[key] = cache  # the newest last
        return cache

    def _choice(self, call: Greedy, top: bool) -> StepChoice:
        """The call's choice, one per batch, device and settings (a recorded step reads its
        tensors, which start() sets in place)."""
        ids = call.input_ids
        key = (ids.shape[0], ids.device, top, call.eos, call.pad, Choice.key(call))
        choice = self.choices.pop(key, None)
        if choice is None:
            made = choice_for(call, top)
            if isinstance(made, str):  # Fused.problem refused such a call before
                raise RuntimeError(made)
            choice = made
            if len(self.choices) >= settings.FUSED_CHOICES:
                del self.choices[next(iter(self.choices))]
        self.choices[key] = choice
        return choice

    def _tokens(self, call: Greedy, key: tuple, cache: Any, top: bool,
                eos: torch.Tensor | None) -> tuple[torch.Tensor, StepChoice]:
        """The call's new tokens from the recorded step where there is one (CUDA, the choice not
        watched), else step by step; and the choice that made them."""
        ids = call.input_ids
        if ids.device.type in RECORDS and not self.choice.watched():
            graph = self._graph(call, key, cache, top)
            if graph is not None:
                return graph.run(ids, self._first(call, key, cache), call.max_new, self.stopping, eos), graph.choice
        choice = self._choice(call, top)
        return self._stepped(call, key, cache, choice), choice

    def _first(self, call: Greedy, key: tuple, cache: Any) -> torch.Tensor:
        """The prompt through the model's own forward into the cache (emptied first), its rows
        past the batch copies of the last; the last position's logits of the batch's rows."""
        ids = call.input_ids
        batch, rows = ids.shape[0], key[0]
        padded = call
        if rows > batch:
            padded = dataclasses.replace(call, input_ids=torch.cat([ids, ids[-1:].expand(rows - batch, -1)]))
        if ids.device.type in PREFILL_RECORDS:
            logits = self.prefills.first_logits(padded, cache, ("fused",) + key)
        else:
            cache.reset()
            logits = self.prefills.run(padded, cache)
        return logits[:batch, -1]

    def _stepped(self, call: Greedy, key: tuple, cache: Any, choice: StepChoice) -> torch.Tensor:
        """The call's new tokens step by step (module docs)."""
        ids = call.input_ids
        step = self.source.runner(cache)
        logits = self._first(call, key, cache)
        choice.start(ids, logits.shape[-1])
        tokens = torch.empty(ids.shape[0], call.max_new, dtype=ids.dtype, device=ids.device)
        position = torch.tensor(ids.shape[1], dtype=torch.int64, device=ids.device)
        nxt = self._choose(choice, logits)
        done = 0
        while True:
            tokens[:, done] = nxt
            done += 1
            if self.stopping.ended(done, call.max_new, choice.unfinished()):
                break
            logits = step(nxt.to(torch.int64), position)
            position += 1
            nxt = self._choose(choice, logits)
        return tokens[:, :done]

    def _choose(self, choice: StepChoice, logits: torch.Tensor) -> torch.Tensor:
        """The next token from a step's logits ([batch, vocab]): the choice's, or while the
        loop's choice is watched, the forced token (the logits and processed scores kept)."""
        forced, scores = self.choice.watched_step(logits, choice.scores)
        if forced is not None:
            return choice.advance(forced.to(torch.int64))
        if scores is not None:
            return choice.advance(choice.pick(scores))
        return choice(logits)

    def _graph(self, call: Greedy, key: tuple, cache: Any, top: bool) -> FusedGraph | None:
        """The recorded step of the call's cache, batch and choice, with a choice of its own,
        recorded at its first call (again where the step was made again: its weights moved);
        None where its recording failed (said once: such calls run step by step)."""
        ids = call.input_ids
        gkey = key + (ids.shape[0], top, call.eos, call.pad, Choice.key(call))
        step = self.source.runner(cache)
        entry = self.graphs.pop(gkey, None)
        if (entry is None or entry.step is not step) and gkey not in self.unrecorded:
            made = choice_for(call, top)
            if isinstance(made, str):  # Fused.problem refused such a call before
                raise RuntimeError(made)
            try:
                entry = FusedGraph(step, made, ids, key[1], self.source.vocab())
            except Exception as exc:  # this shape's calls run step by step
                if not self.unrecorded:
                    logger.warning("torch-tweak: the fused loop could not record its decode step for batch %d (%s: "
                                   "%s); such calls run step by step", ids.shape[0], type(exc).__name__, exc)
                bounded(self.unrecorded, gkey, f"{type(exc).__name__}: {exc}")
                return None
        if entry is None:
            return None
        if len(self.graphs) >= settings.FUSED_GRAPHS:
            del self.graphs[next(iter(self.graphs))]
        self.graphs[gkey] = entry  # the newest last
        return entry

    def figures(self) -> dict:
        """What tt.status says of the fused loop's recorded steps."""
        return {"recorded_steps": len(self.graphs), "unrecorded_steps": list(self.unrecorded.values()),
                "resampled": self.resampled}
