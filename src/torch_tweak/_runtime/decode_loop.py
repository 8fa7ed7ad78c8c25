"""tweak's decode loop, installed as a transformers model's ``generate``: the call parsed
(decode_call), its prefill (decode_prefills), its steps one by one (decode_steps) or replayed
from a recorded graph (decode_graph), each token chosen as transformers chooses it
(decode_choice), with forward calls laid out as the workload's own (decode_inputs)."""

from __future__ import annotations

import collections
import inspect
import logging
import threading
import time
from typing import Any, Callable

import torch
from torch import nn

from . import prefill, sampling
from .decode_call import COMPILED_LOOPS, LOOPS, Greedy, call_kind, greedy_call
from .decode_choice import Choice
from .decode_graph import GraphSteps, StepGraph
from .decode_inputs import StepInputs
from . import decode_call, decode_model
from .decode_model import DEFAULT_LAYOUTS, cache_arg_of, new_cache
from .decode_prefills import Prefills
from .decode_steps import Steps, finished_rows, stop_after_eos

logger = logging.getLogger("torch_tweak")


class DecodeLoop(StepInputs, Prefills, Choice, GraphSteps, Steps):


    """tweak's greedy decode loop, installed as the model's ``generate`` (an attribute of the
    instance: ``tt.unwrap`` removes it). ``kind`` is one of LOOPS."""

    def __init__(self, model: nn.Module, kind: str, layouts: dict | None = None, top_sampler: bool = False) -> None:
        if kind not in LOOPS:
            raise ValueError(f"kind must be one of {', '.join(LOOPS)}, not {kind!r}")
        self.model = model
        self.kind = kind
        self.top_sampler = top_sampler  # a sampling call's scores from sampling.TopSampler where it serves
        self.given = layouts
        self.layouts = layouts if layouts is not None else DEFAULT_LAYOUTS["dynamic"]
        self.cache_arg = next((k for k, spec in self.layouts["decode"] if spec[0] == "cache"), None)
        if self.cache_arg is None or layouts is None:
            self.cache_arg = cache_arg_of(model)
        self.original = type(model).generate.__get__(model)
        self._mask_types: tuple | None = None  # the layer types a dict of masks is keyed by (mask_form)
        self.captured: list[torch.Tensor] | None = None  # set by distribution_difference: the processed scores
        # teacher forcing (forcing.teacher_forced): each step's token is taken from `forcing` ([batch, steps])
        # instead of chosen, and its raw logits kept in `forced_logits` (processed scores in `captured`)
        self.forcing: torch.Tensor | None = None
        self.forced_logits: list[torch.Tensor] = []
        try:
            params = inspect.signature(model.forward).parameters
        except (TypeError, ValueError):
            params = {}
        self._takes_positions = "position_ids" in params
        self._takes_mask = "attention_mask" in params
        self.fallbacks: collections.Counter[str] = collections.Counter()
        self.calls = 0
        self.resampled = 0  # calls made again with transformers' processors (sampling.TopSampler.overflowed)
        self._checks: list[tuple[tuple, dict, torch.Tensor]] = []
        self.kinds: frozenset | None = None  # the call kinds served (call_kind); None: every kind
        self._graphs: dict[tuple, StepGraph] = {}
        self.unrecorded_steps: dict[tuple, str] = {}  # a step whose recording failed: why (run step by step)
        self._caches: dict[tuple, Any] = {}  # the compiled loop's static caches, per shape
        self.record_draws = True  # a top-k sampler's choice of the next token recorded (sampling.RecordedDraw)
        self._draws: dict[tuple, sampling.RecordedDraw] = {}  # the recorded draws, the newest last
        self.unrecorded: dict[tuple, str] = {}  # a draw whose recording failed: why (its calls run eagerly)
        self.record_prefills = True  # a kept cache's prefill recorded per prompt shape (prefill.RecordedPrefill)
        self._prefills: dict[tuple, prefill.RecordedPrefill] = {}  # the recorded prefills, the newest last
        self._prefill_calls: dict[tuple, int] = {}  # calls per prompt shape not recorded yet (prefill.RECORD_AFTER)
        self.unrecorded_prefills: dict[tuple, str] = {}  # a prefill not recorded or not replayed: why
        self._lock = threading.Lock()
        self._previous_len: int = -1
        self.eager = False  # set by uncompiled(): the compiled loop's steps run the plain forward
        self._tuned: tuple[Any, Callable] | None = None  # the "tuned" loop's (compile config, compiled forward)
        self.deadline: float | None = None  # a time.monotonic() value: set while apply_loop checks it

    def _in_time(self) -> None:
        if self.deadline is not None and time.monotonic() > self.deadline:
            raise TimeoutError(f"its check took longer than {decode_call.LOOP_CHECK_SECONDS:g} s (LOOP_CHECK_SECONDS)")

    _tt_decode_loop = True  # what tt.unwrap looks for

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
                kinds.add(call_kind(call))
        self.kinds = frozenset(kinds) if self._checks else None

    def __reduce__(self) -> Any:
        raise TypeError("a model with torch-tweak's decode loop cannot be pickled: save it with tt.save(model, "
                        "path), or call tt.unwrap(model) first")

    def __repr__(self) -> str:
        top = ", top-k sampler" if self.top_sampler else ""
        return f"<torch-tweak decode loop ({self.kind}{top}) of {type(self.model).__name__}.generate>"

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        call = greedy_call(self.model, args, kwargs)
        why = call if isinstance(call, str) else \
            self.unmeasured(call) or self.layout_problem(call) or self.graph_problem(call) or self.tuned_problem(call)
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
        if self.kinds is None or call_kind(call) in self.kinds:
            return None
        batch, static = call_kind(call)
        measured = ", ".join(f"batch {b} with a {'static' if s else 'dynamic'} cache" for b, s in sorted(self.kinds))
        return (f"a call tweak did not measure (batch {batch} with a {'static' if static else 'dynamic'} cache; "
                f"measured: {measured}): tune with a workload that makes such calls")

    def decode(self, call: Greedy) -> torch.Tensor:
        ids = call.input_ids
        batch, prompt = ids.shape
        device = ids.device
        eos = torch.tensor(call.eos, dtype=ids.dtype, device=device) if call.eos else None
        length = self._static_length(call) if call.static else 0
        # the graph loop's step runs one by one where its processed scores are read (the check
        # of a sampling call's distribution)
        graphs = self.captured is None and self.forcing is None and self.records(call)
        # what is kept between calls is kept per grad mode: a cache made in inference mode
        # cannot be written outside it
        mode = torch.is_inference_mode_enabled()
        kept: tuple | None = None  # the key of a cache kept between calls (reset by _first_logits)
        step = (batch, length, device, ids.dtype, mode, self._sampling_key(call))
        entry = self._step_graph(call, step) if graphs else None
        graphs = entry is not None
        if entry is not None:
            kept = ("graph",) + step
            cache = entry.cache
        elif self.kind in COMPILED_LOOPS and call.static:
            # one cache per shape, reset between calls: its tensors keep their addresses, so the
            # compiled forward's device graphs replay instead of recording again
            kept = ("cache", batch, length, device, ids.dtype, mode)
            cache = self._caches.get(kept[1:])
            if cache is None:
                cache = self._caches[kept[1:]] = new_cache(self.model, True, length)
        else:
            cache = new_cache(self.model, call.static, length)
        compiled = self.kind in COMPILED_LOOPS and not self.eager and decode_model.transformers_compiles(self.model, call, cache)
        logits = self._prefill(call, cache) if kept is None else self._first_logits(call, cache, kept)
        if graphs:
            def finished(n: int) -> bool:
                self._in_time()
                return eos is not None and bool(finished_rows(entry.tokens[:, :n], eos).all())

            first = self._choose(call, logits, ids if call.processors is not None else None)
            tokens = entry.run(first, prompt, call.max_new, finished)
        else:
            sampler = self._sampler(call, logits.shape[-1]) if self.top_sampler else None
            state = sampling.rng_state(device) if sampler is not None else None
            mark = None if self.captured is None else len(self.captured)
            forced = len(self.forced_logits)
            tokens = self._steps(logits, cache, call, eos, length, compiled, sampler)
            if sampler is not None and sampler.overflowed():
                # a step the sampler could not serve: the call again, from the same generator
                # state, with transformers' processors (what the first run captured is dropped)
                self.resampled += 1
                if mark is not None:
                    del self.captured[mark:]
                del self.forced_logits[forced:]
                sampling.set_rng_state(device, state)
                if kept is not None:
                    logits = self._first_logits(call, cache, kept)
                else:
                    cache = new_cache(self.model, call.static, length)
                    logits = self._prefill(call, cache)
                tokens = self._steps(logits, cache, call, eos, length, compiled, None)
        return torch.cat([ids, stop_after_eos(tokens, eos, call.pad)], dim=1)
