"""Workloads: tuning a model for what a callable does with it, generate() above all.

``tt.tweak(model, workload=lambda m: m.generate(ids, max_new_tokens=64))`` tunes the
model for that callable instead of for a list of forward calls: tweak runs it to find the
modules it calls and to record their calls (a decoder's prefill and its decode steps become
separate input signatures), and what it measures per depth is one whole run of the
callable. When the callable calls ``generate()`` of a transformers model, tweak also tries
its own greedy decode loop (torch_tweak._runtime.generation) on the kept depth, and the result speaks
in tokens: tokens per second and time to first token, per depth and untuned.
"""

from __future__ import annotations

import dataclasses
import logging
import statistics
import time
from typing import Any, Callable

import torch
from torch import nn

from .. import _C
from . import decode_call, decode_check, decode_model, generation, sampling
from .._core import correctness, decode_numerics, noise
from .._core._samples import synchronizer

logger = logging.getLogger("torch_tweak")

MAX_GENERATE_CALLS = 4
"""generate() calls of the workload kept to check a decode loop's tokens against."""

TTFT_RUNS = 5
"""Timed prefills per measurement of the time to first token (their median is kept)."""


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
        self.loop: str | None = None  # the decode loop kept (decode_call.LOOPS), once chosen
        self.loop_report: list[dict] = []
        self.numerics: dict[Any, str] = {}  # configuration label -> what its check found (check_generate)
        self.hint = ""  # what the user could change for a faster loop (docs/generate.md)

    def run(self) -> Any:
        return self.fn(self.model)

    def record(self) -> None:
        """Runs the workload once, untuned, keeping its generate() calls and their tokens."""
        model = self.model
        can = generation.can_generate(model)
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
                layout = tuple((k, decode_model.describe_argument(v)) for k, v in inputs.items())
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
                    if len(calls) < MAX_GENERATE_CALLS:
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
            self._references()
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

    def _references(self) -> None:
        """Each recorded call's reference for the measured rule (decode_check.reference), made on the
        untuned model; one that cannot be made is said once (its call's tokens must then be the
        untuned ones exactly)."""
        for i, call in enumerate(self.generate_calls):
            call.reference = decode_check.reference(self.model, call.args, call.kwargs, call.tokens)
            if not call.reference.measured and correctness.rule().measured:
                logger.warning("torch-tweak: generate call %d has no higher-precision reference (%s): a candidate "
                               "must give its untuned tokens exactly", i, noise.without_advice(call.reference.why))

    def check_generate(self) -> str:
        """Raises MismatchError unless every recorded generate() call of the model as it is now
        keeps the correctness rule (decode_check.check_call); returns what was found, per call."""
        return " | ".join(decode_check.check_call(self.model, i, call.args, call.kwargs, (call.tokens,) + call.others,
                                             call.reference) for i, call in enumerate(self.generate_calls))

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
                for _ in range(TTFT_RUNS + 1):
                    self._wait()
                    start = time.perf_counter_ns()
                    self.model.generate(*call.args, **kwargs)
                    self._wait()
                    times.append(time.perf_counter_ns() - start)
                per_call.append(statistics.median(times[1:]))  # the first warms up
        self.ttft[label] = sum(per_call) / len(per_call) / 1e6

    def check_depth(self, depth: int) -> None:
        """Before a depth is measured: its generate() calls must keep the correctness rule (a
        backend within tolerance can still turn an argmax: check_generate), then its time to
        first token."""
        self.numerics[depth] = self.check_generate()
        self.measure_ttft(depth)

    def tokens_per_s(self, latency_ms: float | None) -> float | None:
        if latency_ms is None or latency_ms <= 0 or not self.tokens:
            return None
        return self.tokens / (latency_ms / 1e3)



def _hint(model: nn.Module, device: torch.device, call: Any) -> str:
    if device.type != "cuda" or isinstance(call, str):
        return ""
    if not call.static:
        return ("generate() used a DynamicCache: with cache_implementation=\"static\" transformers compiles the "
                "decode steps and tweak's loop runs them without transformers' per-token work (docs/generate.md)")
    return ""


def tuned_applies(model: nn.Module, device: torch.device, workload: Workload) -> bool:
    """Whether the "tuned" loop is worth its build: on CUDA (coordinate descent tuning tunes
    Triton kernels; a CPU build would be transformers' own), every recorded call one sequence
    (the steps' matrix products have one row: what it turns into bandwidth-tuned reductions;
    at more rows they stay cuBLAS products) and compiled with Inductor."""
    if device.type != "cuda":
        return False
    for recorded in workload.generate_calls:
        call = decode_call.greedy_call(model, recorded.args, recorded.kwargs)
        if isinstance(call, str) or call.input_ids.shape[0] != 1 or \
                decode_model.tuned_settings(decode_model.compile_config(model, call)) is None:
            return False
    return True


def _loop_kinds(workload: Workload, device: torch.device, high: bool) -> list[str]:
    """The decode loops worth trying for the workload's first generate() call (and the hint
    for the user, set on the workload)."""
    model = workload.model
    first = workload.generate_calls[0]
    call = decode_call.greedy_call(model, first.args, first.kwargs)
    static = not isinstance(call, str) and call.static  # device graphs need a static cache
    workload.hint = _hint(model, device, call)
    # a device graph replay of a step does what the plain loop does with no launches from the
    # host: where it can run, the plain loop is not worth a measurement (each is a whole run).
    # Where transformers compiles the decode steps, the untuned tokens are its compiled
    # kernels': only its own compiled forward gives them (the tuned loop: its own, checked)
    if static and decode_model.transformers_compiles(model, call, decode_model.probe_cache(model, call)):
        return ["compiled", "tuned"] if high and tuned_applies(model, device, workload) else ["compiled"]
    if device.type == "cuda" and static and \
            generation.DecodeLoop(model, "graph", workload.layouts).graph_problem(call) is None:
        return ["graph"]
    return ["loop"]  # no graph loop here, or a call whose step it does not record: step by step


def choose_loop(workload: Workload, device: torch.device, measure: dict | None, *,
                high: bool = False) -> tuple[str | None, list[dict]]:
    """Tries tweak's decode loops on the model as tuned, keeps the fastest of them and
    transformers' own generate() whose tokens are the untuned ones; returns the kept loop's
    kind (None: transformers' loop) and a report per candidate. `high` (effort="high") adds
    the tuned loop where it applies (tuned_applies): one more compile, about 55 s for the
    Llama-1B shape on the H200, for other kernels whose tokens must still be the untuned ones."""
    model = workload.model
    kinds = _loop_kinds(workload, device, high)
    # the sampler's option where a loop's steps take it without another compile (not the graph
    # loop's recorded step, nor the tuned loop's build of its own). Both options of a kind are
    # one loop, its sampler switched per run: one set of static caches, whose addresses the
    # compiled forward's device graphs were recorded on
    served = top_sampler_serves(workload, device)
    options = [(k, False) for k in kinds] + [(k, True) for k in kinds if served and k in ("loop", "compiled")]
    loops: dict[tuple[str, bool], generation.DecodeLoop] = {}
    found: dict[Any, str] = {}  # option -> what its check found (Workload.check_generate)

    def build_of(option: tuple[str, bool] | None):
        def build() -> None:
            generation.uninstall(model)
            if option is None:
                return
            loop = loops.get((option[0], not option[1])) or generation.DecodeLoop(model, option[0], workload.layouts)
            loop.top_sampler = option[1]
            # fail fast: a recorded call the loop would leave to transformers refuses it before
            # anything runs (the reason is what the loop itself would say)
            for recorded in workload.generate_calls:
                served = decode_call.greedy_call(model, recorded.args, recorded.kwargs)
                why = served if isinstance(served, str) else loop.layout_problem(served) or loop.graph_problem(served)
                if why is not None:
                    raise RuntimeError(f"the workload's generate() calls are not ones the loop serves ({why})")
            generation.install(model, loop)
            try:
                found[option] = workload.check_generate()
                for recorded in workload.generate_calls:  # without a reference: the exact distributions
                    if recorded.reference is not None and recorded.reference.measured:
                        continue
                    problem = decode_check.distribution_difference(model, loop, recorded.args, recorded.kwargs)
                    if problem is not None:
                        raise correctness.MismatchError(problem)
                if loop.fallbacks:
                    reason = next(iter(loop.fallbacks))
                    raise RuntimeError(f"the workload's generate() calls are not ones the loop serves ({reason})")
            except BaseException:
                generation.uninstall(model)
                raise
            loops[option] = loop
        return build

    def run_of(option: tuple[str, bool] | None):
        def run(i: int) -> None:
            if option is None:
                generation.uninstall(model)
            else:
                generation.install(model, loops[option])
                loops[option].top_sampler = option[1]
            workload.run()
        return run

    names = ["generate"] + [f"decode loop ({k}{', top-k sampler' if top else ''})" for k, top in options]
    candidates = [(name, build_of(option), run_of(option)) for name, option in zip(names, [None] + options)]
    try:
        with torch.no_grad():
            index, reports = _C.choose("highest-throughput", candidates, 1, sync=workload.sync, config=measure)
    finally:
        generation.uninstall(model)
    kept = None if index <= 0 else options[index - 1]
    if kept is not None:
        loops[kept].top_sampler = kept[1]
        loops[kept].checks = [(c.args, c.kwargs, c.tokens) for c in workload.generate_calls]  # what tt.save keeps
        generation.install(model, loops[kept])
    out = []
    for i, (name, report, option) in enumerate(zip(names, reports, [None] + options)):
        stats = report.get("stats")
        out.append({"candidate": name, "state": report["state"], "error": report.get("error", ""),
                    "latency_ms": None if stats is None else stats["median_ns"] / 1e6,
                    "numerics": found.get(option, ""), "kept": i == max(index, 0)})
    return (None if kept is None else kept[0]), out


def depths_cannot_match(workload: Workload) -> str:
    """Why no depth is searched once the decode loops were tried, or "". A call transformers
    compiles gets its untuned tokens from its compiled forward's kernels, and the "compiled"
    loop runs that same forward. Where the loop was held to those tokens and gave others, the
    untuned tokens turn on near ties that the same kernels decide either way, and a depth,
    which changes kernels, would be held to them too: the loop's failure says so in the time
    of a few runs, where the depth search spends minutes. On the H200 (Llama-1B shape, bf16,
    prompt 512; bench/results/generate.md) the search then took 6.5x the static path's first
    call: depth 1 failed the same check and depth 0, which passed it, was 1.01x."""
    if correctness.rule().measured:  # near ties are allowed: a parting of the compiled loop is no near tie
        return ""
    for row in workload.loop_report:
        if row["candidate"] == "decode loop (compiled)" and row["state"] == "failed" and \
                row["error"].startswith("MismatchError: generate call"):
            mismatch = row["error"].removeprefix("MismatchError: ")
            return ("the decode loop that runs transformers' own compiled forward, whose kernels give the "
                    f"untuned tokens, gave other tokens ({mismatch}): the untuned tokens turn on near ties the "
                    "same kernels decide either way, so the depths, which change kernels, are not searched")
    return ""


def top_sampler_serves(workload: Workload, device: torch.device) -> bool:
    """Whether a recorded generate() call is a sampling call sampling.TopSampler serves on
    `device` (temperature, top-k, top-p): the loop is then measured with it and without it.
    It spares the device a sort of the vocabulary per token but launches more kernels, so
    which is faster depends on whether the step waits for the device or for the host."""
    for recorded in workload.generate_calls:
        call = decode_call.greedy_call(workload.model, recorded.args, recorded.kwargs)
        if not isinstance(call, str) and sampling.TopSampler.of(call.processors, call.sample, device) is not None:
            return True
    return False
