"""Choosing tweak's decode loop for a generate() workload, beside the module search: which
loops are worth a measurement, each one's check (its tokens and distributions against the
untuned generate()'s: decode_check), the engine's choice among them and transformers' own
generate(); and the check of a depth's generate() calls before it is measured."""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch import nn

from .. import _C
from .._core import correctness, noise
from .._runtime.decode import call as decode_call, model as decode_model
from .._runtime.decode.choice import TopSampler
from .._runtime.decode.fused_kernels import triton_problem
from .._runtime.decode.fused_loop import read_model
from .._runtime.decode.loop import FUSED, DecodeLoop, install, loop_name, uninstall
from .._runtime.workload import Workload
from . import decode_check

logger = logging.getLogger("torch_tweak")


def record(job: Workload) -> None:
    """Runs the workload once, untuned (Workload.record), then makes each recorded generate()
    call's reference for the measured rule (decode_check.reference) on the untuned model; one
    that cannot be made is said once (its call's tokens must then be the untuned ones exactly)."""
    job.record()
    for i, call in enumerate(job.generate_calls):
        call.reference = decode_check.reference(job.model, call.args, call.kwargs, call.tokens)
        if not call.reference.measured and correctness.rule().measured:
            logger.warning("torch-tweak: generate call %d has no higher-precision reference (%s): a candidate "
                           "must give its untuned tokens exactly", i, noise.without_advice(call.reference.why))


def check_generate(job: Workload) -> str:
    """Raises MismatchError unless every recorded generate() call of the model as it is now
    keeps the correctness rule (decode_check.check_call); returns what was found, per call."""
    return " | ".join(decode_check.check_call(job.model, i, call.args, call.kwargs, (call.tokens,) + call.others,
                                              call.reference) for i, call in enumerate(job.generate_calls))


def check_depth(job: Workload, depth: int) -> None:
    """Before a depth is measured: its generate() calls must keep the correctness rule (a
    backend within tolerance can still turn an argmax: check_generate), then its time to
    first token."""
    job.numerics[depth] = check_generate(job)
    job.measure_ttft(depth)


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
    if device.type == "cuda" and not isinstance(call, str) and not call.static:
        workload.hint = ("generate() used a DynamicCache: with cache_implementation=\"static\" transformers compiles "
                         "the decode steps and tweak's loop runs them without transformers' per-token work "
                         "(docs/generate.md)")
    else:
        workload.hint = ""
    # a device graph replay of a step does what the plain loop does with no launches from the
    # host: where it can run, the plain loop is not worth a measurement (each is a whole run).
    # Where transformers compiles the decode steps, the untuned tokens are its compiled
    # kernels': only its own compiled forward gives them (the tuned loop: its own, checked)
    if static and decode_model.transformers_compiles(model, call, decode_model.probe_cache(model, call)):
        return ["compiled", "tuned"] if high and tuned_applies(model, device, workload) else ["compiled"]
    if device.type == "cuda" and static and \
            DecodeLoop(model, "graph", workload.layouts).graph.problem(call) is None:
        return ["graph"]
    return ["loop"]  # no graph loop here, or a call whose step it does not record: step by step


def fused_kernels(workload: Workload, device: torch.device, high: bool) -> list[str]:
    """The kernels tweak's own decode step (the fused loop) is tried with, where it reads the
    model (fused_step.FusedDecoder): on CUDA the Triton kernels (where Triton imports) and the
    torch ops (cuBLAS's products), with `high` (effort="high") also the torch ops compiled by
    Inductor (a long compile); elsewhere the torch ops alone."""
    if isinstance(read_model(workload.model), str):
        return []
    if device.type != "cuda":
        return ["torch"]
    return (["triton"] if triton_problem(device) is None else []) + ["torch"] + (["inductor"] if high else [])


def choose_loop(workload: Workload, device: torch.device, measure: dict | None, *,
                high: bool = False) -> tuple[str | None, list[dict]]:
    """Tries tweak's decode loops on the model as tuned, keeps the fastest of them and
    transformers' own generate() whose tokens are the untuned ones; returns the kept loop's
    kind (None: transformers' loop) and a report per candidate. `high` (effort="high") adds
    the tuned loop where it applies (tuned_applies): one more compile, about 55 s for the
    Llama-1B shape on the H200, for other kernels whose tokens must still be the untuned ones.
    Where tweak's own decode step reads the model, the fused loop is tried too, once per kernels
    (fused_kernels)."""
    model = workload.model
    kinds = _loop_kinds(workload, device, high)
    # the sampler's option where a loop's steps take it without another compile (not the graph
    # loop's recorded step, nor the tuned loop's build of its own). Both options of a kind are
    # one loop, its sampler switched per run: one set of static caches, whose addresses the
    # compiled forward's device graphs were recorded on. The fused loop records its whole step,
    # the choice in it, where launches cost nothing: it takes the sampler wherever it serves
    served = top_sampler_serves(workload, device)
    options = [(k, False, None) for k in kinds] + [(k, True, None) for k in kinds
                                                   if served and k in ("loop", "compiled")]
    options += [(FUSED, served, kernels) for kernels in fused_kernels(workload, device, high)]
    loops: dict[tuple[str, bool, str | None], DecodeLoop] = {}
    found: dict[Any, str] = {}  # option -> what its check found (check_generate)

    def build_of(option: tuple[str, bool, str | None] | None):
        def build() -> None:
            uninstall(model)
            if option is None:
                return
            kind, top, kernels = option
            loop = loops.get((kind, not top, kernels)) or DecodeLoop(model, kind, workload.layouts, kernels=kernels)
            loop.top_sampler = top
            # fail fast: a recorded call the loop would leave to transformers refuses it before
            # anything runs (the reason is what the loop itself would say)
            for recorded in workload.generate_calls:
                served = decode_call.greedy_call(model, recorded.args, recorded.kwargs)
                why = served if isinstance(served, str) else loop.problem(served)
                if why is not None:
                    raise RuntimeError(f"the workload's generate() calls are not ones the loop serves ({why})")
            install(model, loop)
            try:
                found[option] = check_generate(workload)
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
                uninstall(model)
                raise
            loops[option] = loop
        return build

    def run_of(option: tuple[str, bool, str | None] | None):
        def run(i: int) -> None:
            if option is None:
                uninstall(model)
            else:
                install(model, loops[option])
                loops[option].top_sampler = option[1]
            workload.run()
        return run

    names = ["generate"] + [f"decode loop ({loop_name(*option)})" for option in options]
    candidates = [(name, build_of(option), run_of(option)) for name, option in zip(names, [None] + options)]
    try:
        with torch.no_grad():
            index, reports = _C.choose("highest-throughput", candidates, 1, sync=workload.sync, config=measure)
    finally:
        uninstall(model)
    kept = None if index <= 0 else options[index - 1]
    if kept is not None:
        loops[kept].top_sampler = kept[1]
        loops[kept].checks = [(c.args, c.kwargs, c.tokens) for c in workload.generate_calls]  # what tt.save keeps
        install(model, loops[kept])
    return (None if kept is None else kept[0]), _loop_rows(names, reports, [None] + options, found, index)


def _loop_rows(names: list[str], reports: list[dict], options: list, found: dict, index: int) -> list[dict]:
    """choose_loop's report per candidate: its state, latency, what its check found (where the
    rule refused it: the step and the multiple) and whether it was kept."""
    out = []
    for i, (name, report, option) in enumerate(zip(names, reports, options)):
        stats = report.get("stats")
        error = report.get("error", "")
        numerics = found.get(option, "")
        if not numerics and error.startswith("MismatchError: "):  # the rule refused it: the step and multiple
            numerics = "refused: " + error.removeprefix("MismatchError: ")
        out.append({"candidate": name, "state": report["state"], "error": error,
                    "latency_ms": None if stats is None else stats["median_ns"] / 1e6,
                    "numerics": numerics, "kept": i == max(index, 0)})
    return out


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
    """Whether a recorded generate() call is a sampling call choice.TopSampler serves on
    `device` (temperature, top-k, top-p): the loop is then measured with it and without it.
    It spares the device a sort of the vocabulary per token but launches more kernels, so
    which is faster depends on whether the step waits for the device or for the host."""
    for recorded in workload.generate_calls:
        call = decode_call.greedy_call(workload.model, recorded.args, recorded.kwargs)
        if not isinstance(call, str) and TopSampler.of(call.processors, call.sample, device) is not None:
            return True
    return False
