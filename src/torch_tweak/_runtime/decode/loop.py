"""tweak's decode loop (DecodeLoop), installed as a transformers model's ``generate``: the parts
composed (the package's docstring says what each does), the loops' kinds (KINDS: a step source
each, and whether its step is recorded), and the loop's place on a model (install, uninstall,
loop_of, arm, uncompiled)."""

from __future__ import annotations

import collections
import contextlib
import logging
import threading
from typing import Any

import torch
from torch import nn

from .call import Greedy, config_class, greedy_call
from .choice import Choice, rng_state, set_rng_state
from .fused_loop import Fused, FusedSteps
from .graph import GraphSteps
from .inputs import StepInputs
from .model import Caches, cache_arg_of, new_cache
from .prefill import Prefills
from .steps import Compiled, Forward, Steps, Stopping, Tuned

logger = logging.getLogger("torch_tweak")


KINDS = {"loop": (Forward, False), "graph": (Forward, True), "compiled": (Compiled, False), "tuned": (Tuned, False),
         "fused": (Fused, False)}
"""The decode loops tweak tries, by name: a step source each (steps.Forward, Compiled, Tuned say
what each runs; fused_loop.Fused is tweak's own decode step, whose calls fused_loop.FusedSteps
decodes) and whether its step is recorded as a device graph (the "graph" loop: CUDA and a
static cache only; elsewhere its steps run one by one). A new kind is a step source and its
entry here."""

FUSED = "fused"
"""The kind whose step source takes the step's kernels (fused_loop.KERNELS)."""

LOOPS = tuple(KINDS)

COMPILED_LOOPS = frozenset(kind for kind, (source, _) in KINDS.items() if source.compiled)
"""The loops whose decode steps run a compiled forward (steps.Forward.compiled)."""


class DecodeLoop:
    """tweak's decode loop, installed as the model's ``generate`` (an attribute of the
    instance: ``tt.unwrap`` removes it). ``kind`` is one of LOOPS; ``layouts`` the workload's
    forward calls (None: the defaults); ``top_sampler``: a sampling call's scores from
    choice.TopSampler where it serves; ``kernels``: the fused kind's (fused_loop.KERNELS, by
    default "torch"), None for every other kind."""

    _tt_decode_loop = True  # what tt.unwrap looks for

    def __init__(self, model: nn.Module, kind: str, layouts: dict | None = None, top_sampler: bool = False,
                 kernels: str | None = None) -> None:
        if kind not in KINDS:
            raise ValueError(f"kind must be one of {', '.join(LOOPS)}, not {kind!r}")
        if kernels is not None and kind != FUSED:
            raise ValueError(f"kernels are the {FUSED} loop's, not the {kind} loop's")
        source, records = KINDS[kind]
        self.model = model
        self.kind = kind
        self.layouts = layouts  # as a Plan keeps them
        self.top_sampler = top_sampler
        self.kernels = kernels if kernels is not None or kind != FUSED else "torch"
        self.original = type(model).generate.__get__(model)
        self.fallbacks: collections.Counter[str] = collections.Counter()
        self.calls = 0
        self.resampled = 0  # calls made again with transformers' processors (choice.TopSampler.overflowed)
        self._checks: list[tuple[tuple, dict, torch.Tensor]] = []
        self.kinds: frozenset | None = None  # the call kinds served (call_kind); None: every kind
        self._lock = threading.Lock()
        self.eager = False  # set by uncompiled(): a compiled source's steps run the plain forward
        self.caches = Caches(model)
        self.inputs = StepInputs(model, layouts)
        self.prefills = Prefills(model, self.inputs)
        self.choice = Choice()
        self.stopping = Stopping()
        self.source = source(model) if kind != FUSED else Fused(model, self.kernels)
        self.steps = Steps(model, self.inputs, self.choice, self.stopping, self.source)
        self.graph = GraphSteps(model, self.inputs, self.prefills, self.choice, self.stopping, records)
        # tweak's own decode step: the whole call is its (fused_loop)
        self.fused = FusedSteps(model, self.prefills, self.choice, self.stopping, self.source) \
            if isinstance(self.source, Fused) else None

    @property
    def checks(self) -> list[tuple[tuple, dict, torch.Tensor]]:
        """The generate() calls the loop was measured and checked on, (args, kwargs, untuned
        tokens): what tt.save keeps. Once set, the loop serves only calls of their kinds
        (call_kind): a kind no measurement showed faster runs transformers' generate()."""
        return self._checks

    @checks.setter
    def checks(self, checks: list[tuple[tuple, dict, torch.Tensor]]) -> None:
        self._checks = list(checks)
        kinds = set()
        for args, kwargs, _ in self._checks:
            call = greedy_call(self.model, args, kwargs)
            if not isinstance(call, str):
                kinds.add(self.source.kind(call))
        self.kinds = frozenset(kinds) if self._checks else None

    def __reduce__(self) -> Any:
        raise TypeError("a model with torch-tweak's decode loop cannot be pickled: save it with tt.save(model, "
                        "path), or call tt.unwrap(model) first")

    def __repr__(self) -> str:
        return f"<torch-tweak decode loop ({self.name()}) of {type(self.model).__name__}.generate>"

    def name(self) -> str:
        """The loop as the tables name it: its kind, its kernels, its sampler ("fused, triton")."""
        return loop_name(self.kind, self.top_sampler, self.kernels)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        call = greedy_call(self.model, args, kwargs)
        why = call if isinstance(call, str) else self.unmeasured(call) or self.problem(call)
        if why is not None:
            if why not in self.fallbacks:
                logger.warning("torch-tweak: generate() ran transformers' own loop for %s; further such calls "
                               "are counted in the model's decode loop (.fallbacks)", why)
            self.fallbacks[why] += 1
            return self.original(*args, **kwargs)
        # one call at a time: the step graphs, the compiled loop's caches and the cache-length
        # rule are shared by every call of the model
        with self._lock, torch.no_grad():
            self.calls += 1
            return self.decode(call)

    def unmeasured(self, call: Greedy) -> str | None:
        """Why the loop leaves a call of a kind tweak did not measure to transformers (it might
        be slower there: the loop is kept for the kinds it was measured faster on), or None."""
        if self.kinds is None or self.source.kind(call) in self.kinds:
            return None
        batch, static = self.source.kind(call)
        measured = ", ".join(f"batch {b} with a {'static' if s else 'dynamic'} cache" for b, s in sorted(self.kinds))
        return (f"a call tweak did not measure (batch {batch} with a {'static' if static else 'dynamic'} cache; "
                f"measured: {measured}): tune with a workload that makes such calls")

    def problem(self, call: Greedy) -> str | None:
        """Why the loop cannot serve this call (its layouts, its recorded step, its step source),
        or None."""
        return self.inputs.layout_problem(call) or self.graph.problem(call) or self.source.problem(call)

    def decode(self, call: Greedy) -> torch.Tensor:
        ids = call.input_ids
        eos = self.stopping.eos(call)
        length = self.caches.static_length(call) if call.static else 0
        # what is kept between calls is kept per grad mode: a cache made in inference mode
        # cannot be written outside it
        mode = torch.is_inference_mode_enabled()
        tokens = None
        # a recorded step's choices are not watched: where they are (teacher forcing, the check
        # of a sampling call's distribution) the steps run one by one
        if self.fused is not None:
            tokens = self.fused.run(call, eos, length, self.top_sampler)
        elif not self.choice.watched() and self.graph.records(call):
            key = (ids.shape[0], length, ids.device, ids.dtype, mode, self.choice.key(call))
            tokens = self.graph.run(call, key, eos)
        if tokens is None:
            tokens = self._stepped(call, eos, length, mode)
        return torch.cat([ids, self.stopping.cut(tokens, eos, call.pad)], dim=1)

    def _stepped(self, call: Greedy, eos: torch.Tensor | None, length: int, mode: bool) -> torch.Tensor:
        """The call's new tokens step by step; where the top-k sampler could not serve a step,
        the call again, from the same generator state, with transformers' processors (what the
        first run kept is dropped)."""
        ids = call.input_ids
        device = ids.device
        kept: tuple | None = None  # the key of a cache kept between calls (reset by first_logits)
        if self.source.compiled and call.static:
            # one cache per shape, reset between calls: its tensors keep their addresses, so the
            # compiled forward's device graphs replay instead of recording again
            kept = ("cache", ids.shape[0], length, device, ids.dtype, mode)
            cache = self.caches.kept_cache(kept[1:], length)
        else:
            cache = new_cache(self.model, call.static, length)
        compiled = not self.eager and self.source.compiles(call, cache)
        logits = self.prefills.run(call, cache) if kept is None else self.prefills.first_logits(call, cache, kept)
        sampler = self.choice.sampler_for(call, logits.shape[-1]) if self.top_sampler else None
        state = rng_state(device) if sampler is not None else None
        mark = self.choice.mark()
        tokens = self.steps.run(logits, cache, call, eos, length, compiled, sampler)
        if sampler is not None and sampler.overflowed():
            self.resampled += 1
            self.choice.rewind(mark)
            set_rng_state(device, state)
            if kept is not None:
                logits = self.prefills.first_logits(call, cache, kept)
            else:
                cache = new_cache(self.model, call.static, length)
                logits = self.prefills.run(call, cache)
            tokens = self.steps.run(logits, cache, call, eos, length, compiled, None)
        return tokens

    def figures(self) -> dict:
        """What tt.status says of the loop: its kind, its calls and fallbacks, what it recorded."""
        figures = {"kind": self.kind, "kernels": self.kernels, "calls": self.calls, "fallbacks": dict(self.fallbacks),
                   "top_sampler": self.top_sampler, "resampled": self.resampled,
                   **self.choice.figures(), **self.graph.figures(), **self.prefills.figures()}
        if self.fused is not None:
            fused = self.fused.figures()
            figures.update(fused, resampled=self.resampled + fused["resampled"])
        return figures


def loop_name(kind: str, top_sampler: bool = False, kernels: str | None = None) -> str:
    """A loop as the tables and tt.status name it: "compiled, top-k sampler", "fused, triton"."""
    return kind + (f", {kernels}" if kernels else "") + (", top-k sampler" if top_sampler else "")


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
