"""Workloads: tuning a model for what a callable does with it, generate() above all.

``tt.tweak(model, workload=lambda m: m.generate(ids, max_new_tokens=64))`` tunes the
model for that callable instead of for a list of forward calls: tweak runs it to find the
modules it calls and to record their calls (a decoder's prefill and its decode steps become
separate input signatures), and what it measures per depth is one whole run of the
callable. When the callable calls ``generate()`` of a transformers model, tweak also tries
its own decode loop (torch_tweak._runtime.decode; the search of a loop and the check of the
calls are _search/loop_search.py's), and the result speaks in tokens: tokens per second and
time to first token, per depth and untuned. Here: the workload run, its generate() calls and
their untuned tokens recorded, the time to first token.
"""

from __future__ import annotations

import dataclasses
import logging
import statistics
import time
from typing import Any, Callable

import torch
from torch import nn

from .._core import decode_numerics, settings
from .._core._samples import synchronizer
from .decode import call as decode_call, model as decode_model
from .decode.inputs import describe_argument
from .decode.loop import can_generate

logger = logging.getLogger("torch_tweak")


@dataclasses.dataclass
class GenerateCall:
    """One generate() call of the workload: its arguments and the untuned model's tokens."""

    args: tuple
    kwargs: dict
    tokens: torch.Tensor
    prompt: int
    others: tuple = ()  # other tokens a later untuned call gave for it (its runs disagree)
    reference: Any = None  # the measured rule's teacher-forced reference (decode_numerics.StepReference)


@dataclasses.dataclass(frozen=True)
class TokenRow:
    """Tokens per second and time to first token of one configuration; status: "kept", or why
    it was not ("slower than ...", "refused: ...", "not kept: ..."); measured: the moment its
    figures come from, the one its status speaks of ("loop choice", "depth search", "side by
    side", "paired rounds, busy"; "" when nothing was measured)."""

    label: str
    latency_ms: float | None
    tokens_per_s: float | None
    ttft_ms: float | None
    kept: bool = False
    status: str = ""
    measured: str = ""


class Workload:
    """A callable the model is tuned for; ``fn(model)`` runs it once."""

    def __init__(self, model: nn.Module, fn: Callable[[nn.Module], Any], device: torch.device) -> None:
        if not callable(fn):
            raise TypeError(f"workload must be a callable taking the model, e.g. lambda m: m.generate(ids), "
                            f"not {type(fn).__name__}")
        self.model = model
        self.fn = fn
        self.sync = synchronizer(device)  # None on a CPU (what the engine takes)
        self._wait = self.sync if self.sync is not None else (lambda: None)
        self.generate_calls: list[GenerateCall] = []
        self.tokens = 0  # new tokens per run, from the recorded generate() calls
        self.ttft: dict[Any, float] = {}  # configuration label -> ms
        self.layouts: dict | None = None  # the forward calls of the first generate(): prefill, decode
        self.loop: str | None = None  # the decode loop kept (decode.loop.LOOPS), once chosen
        self.loop_report: list[dict] = []
        self.numerics: dict[Any, str] = {}  # configuration label -> what its check found (loop_search.check_generate)
        self.hint = ""  # what the user could change for a faster loop (docs/generate.md)

    def run(self) -> Any:
        return self.fn(self.model)

    def record(self) -> None:
        """Runs the workload once, untuned, keeping its generate() calls and their tokens."""
        model = self.model
        can = can_generate(model)
        original = type(model).generate.__get__(model) if can else None
        calls = self.generate_calls
        tokens = 0
        forwards: list[tuple] = []  # the first generate()'s first two forward calls, described
        prepare = getattr(model, "prepare_inputs_for_generation", None) if can else None
        own = model.__dict__.get("prepare_inputs_for_generation")  # one the user set on the instance

        def spy(*args: Any, **kwargs: Any) -> Any:
            # the forward's arguments as generate() prepares them; it adds return_dict=True to
            # the call. Read here, not by a hook on the model: a hook would be traced into the
            # forward that transformers compiles for a static cache, and compiled again
            # once removed
            inputs = prepare(*args, **kwargs)
            if len(forwards) < 2 and inside and isinstance(inputs, dict):
                layout = tuple((k, describe_argument(v)) for k, v in inputs.items())
                if "return_dict" not in inputs:
                    layout += (("return_dict", ("value", True)),)
                forwards.append(layout)
            return inputs

        inside = False

        def recorder(*args: Any, **kwargs: Any) -> Any:
            nonlocal tokens, inside
            inside = not calls
            try:
                with decode_call.same_draws(model, args, kwargs):  # a sampling call: tokens another run can check
                    out = original(*args, **kwargs)
            finally:
                inside = False
            if isinstance(out, torch.Tensor) and out.dim() == 2:
                prompt = decode_call.prompt_length(args, kwargs)
                if prompt is not None:
                    tokens += out.shape[0] * max(out.shape[1] - prompt, 0)
                    if len(calls) < settings.MAX_GENERATE_CALLS:
                        calls.append(GenerateCall(args, dict(kwargs), out.clone(), prompt))
            return out

        if can:
            object.__setattr__(model, "generate", recorder)
            if callable(prepare):
                object.__setattr__(model, "prepare_inputs_for_generation", spy)
        try:
            with torch.no_grad():
                self.run()
        except Exception as exc:
            raise ValueError(f"the workload failed on the untuned model ({type(exc).__name__}: {exc}); "
                             "check that it runs as `workload(model)`") from exc
        finally:
            if can:
                model.__dict__.pop("generate", None)
                model.__dict__.pop("prepare_inputs_for_generation", None)
                if own is not None:
                    object.__setattr__(model, "prepare_inputs_for_generation", own)
        if can:
            self._warm_tokens()
        self.tokens = tokens
        if len(forwards) == 2:
            self.layouts = {"prefill": forwards[0], "decode": forwards[1]}

    def _warm_tokens(self) -> None:
        """The untuned tokens of a call transformers compiles, read from a second and a third
        call: the recorded one may have compiled transformers' forward, and a first call's
        tokens need not be its later calls' (decode_model.compiled_by_transformers). Where the
        second and third differ, the untuned model does not repeat its own tokens (a near tie
        that its kernels decide one way or the other from run to run): a candidate is then held
        to giving the tokens of either, and it is said once."""
        with torch.no_grad():
            for i, call in enumerate(self.generate_calls):
                if decode_model.compiled_by_transformers(self.model, call.args, call.kwargs):
                    runs = []
                    for _ in range(2):
                        with decode_call.same_draws(self.model, call.args, call.kwargs):
                            runs.append(self.model.generate(*call.args, **call.kwargs).clone())
                    call.tokens = runs[0]
                    differ = decode_numerics.token_difference(i, runs[1], runs[0], call.prompt)
                    if differ is not None:
                        call.others = (runs[1],)
                        logger.warning("torch-tweak: the untuned model's generate() does not repeat its own tokens "
                                       "(two runs after the first: %s); a candidate is held to the tokens of either",
                                       differ)

    @property
    def generates(self) -> bool:
        return bool(self.generate_calls) and self.tokens > 0

    def measure_ttft(self, label: Any) -> None:
        """The time to first token of the model as it is now: each recorded generate() call
        with one new token, median of TTFT_RUNS, averaged over the calls."""
        if not self.generates:
            return
        per_call = []
        with torch.no_grad():
            for call in self.generate_calls:
                kwargs = dict(call.kwargs, max_new_tokens=1)
                kwargs.pop("max_length", None)
                times = []
                for _ in range(settings.TTFT_RUNS + 1):
                    self._wait()
                    start = time.perf_counter_ns()
                    self.model.generate(*call.args, **kwargs)
                    self._wait()
                    times.append(time.perf_counter_ns() - start)
                per_call.append(statistics.median(times[1:]))  # the first warms up
        self.ttft[label] = sum(per_call) / len(per_call) / 1e6

    def tokens_per_s(self, latency_ms: float | None) -> float | None:
        if latency_ms is None or latency_ms <= 0 or not self.tokens:
            return None
        return self.tokens / (latency_ms / 1e3)


