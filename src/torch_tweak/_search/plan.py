"""A Plan: what tuning decided for a model, and the one way to apply it and to take it out.

A Plan holds the depth kept, the declared shapes (tt.tweak's shapes=) and, per tuned module
(by its dotted path), its input signatures in order, each with the backend chosen for it (an
unbuilt Backend: its class and config are the choice; None: the signature runs the original
forward) and the recorded calls and original outputs it is built on again and checked against;
and tweak's decode loop behind generate() (LoopPlan). The tuning cache and tt.save /
tt.load each store a Plan, each in its own encoding (tuning_cache.py, checkpoint.py); both
apply it with apply(), and revert() takes it out.

apply never measures and never chooses: it wraps the plan's modules in place, builds each
chosen backend again, checks it against the recorded outputs, and only then gives the
wrappers their dispatcher entries and switches them to their backends. On any error the
model is left as it was.
"""

from __future__ import annotations

import dataclasses
import time
import warnings
from typing import Any, Sequence

import torch
from torch import nn

from .._core import correctness, records, settings
from .._core._samples import Call
from .._runtime.decode.call import check_bounds, greedy_call
from .._runtime.decode.loop import loop_of, uninstall as uninstall_loop
from ..backends.base import Backend
from .._runtime.module import TunedModule, arm_untuned, install_all, installed, unwrap
from .._core.shapes import Shapes, edge_calls, position_table
from .._core.signatures import SignatureGroup, forward_params, is_other, lay_out
from .decode_check import apply_loop
from .tuning import apply_groups, dataset_runner, model_class_name, rebuild_group, record, release

class PlanError(Exception):
    """A plan that cannot be applied to this model; the model is as it was."""


class RebuildFailed(PlanError):
    """A chosen backend failed to build again, or its outputs did not match the recorded ones.

    path: the module's path; group: its signature group; backend: the backend that failed;
    cause: what it raised (None when there was no recorded call to build it on)."""

    def __init__(self, path: str, group: SignatureGroup, backend: Backend, reason: str,
                 cause: BaseException | None = None) -> None:
        super().__init__(reason)
        self.path = path
        self.group = group
        self.backend = backend
        self.cause = cause


@dataclasses.dataclass(eq=False)
class ModulePlan:
    """One tuned module: its path, its signature groups in recording order (each with its
    signature, text, key, backend or None, recorded calls and outputs, and what tuning said
    of it: error, report, unstorable), and the module's own error and candidate report."""

    path: str
    groups: list[SignatureGroup]
    error: str = ""
    report: list[dict] = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class LoopPlan:
    """tweak's decode loop behind generate() as a Plan keeps it: its kind (and the fused loop's
    kernels), the layouts of its forward calls (None: the defaults) and the generate() calls it is checked on before it is
    installed again (tt.load: decode_check.apply_loop), each with the untuned
    tokens it gave where it was tuned. The check compares the loop with the untuned generate()
    run here, never with those stored tokens (a file's word); each call is bounded
    (MAX_CHECK_NEW_TOKENS, MAX_CHECK_TOKENS)."""

    kind: str
    layouts: dict | None
    checks: list[tuple[tuple, dict, torch.Tensor]]
    top_sampler: bool = False  # DecodeLoop.top_sampler
    kernels: str | None = None  # the fused loop's step kernels (DecodeLoop.kernels); None for every other kind


def plan_loop(model: nn.Module) -> LoopPlan | None:
    """The loop installed on `model` as a Plan keeps it, its check calls bounded: a call asking
    more than MAX_CHECK_NEW_TOKENS new tokens is kept with that many (greedy tokens are a
    prefix of a longer call's), one decoding more than MAX_CHECK_TOKENS is left out."""
    loop = loop_of(model)
    if loop is None:
        return None
    checks = []
    for args, kwargs, tokens in loop.checks:
        call = greedy_call(model, args, kwargs)
        if not isinstance(call, str) and call.max_new > settings.MAX_CHECK_NEW_TOKENS:
            kwargs = {k: v for k, v in kwargs.items() if k != "max_length"}
            kwargs["max_new_tokens"] = settings.MAX_CHECK_NEW_TOKENS
            tokens = tokens[:, :call.input_ids.shape[1] + settings.MAX_CHECK_NEW_TOKENS]
        if check_bounds(model, args, kwargs) is None:
            checks.append((args, kwargs, tokens))
    return LoopPlan(loop.kind, loop.layouts, checks, loop.top_sampler, loop.kernels)


@dataclasses.dataclass(eq=False)
class Plan:
    """The depth kept (None: the model stays untuned) and the tuned modules."""

    depth: int | None
    modules: list[ModulePlan] = dataclasses.field(default_factory=list)
    generate: LoopPlan | None = None  # tweak's decode loop behind generate() (docs/generate.md)
    shapes: Shapes | None = None  # the declared ranges (tt.tweak's shapes=, torch_tweak._core.shapes)
    tolerance: str | float = "measured"  # the correctness rule it was tuned under (correctness.Rule)

    @property
    def paths(self) -> list[str]:
        return [m.path for m in self.modules]


@dataclasses.dataclass(frozen=True)
class Rebuilt:
    """One backend apply built again: the module's path, the signature's text, the backend's
    name, the seconds its build and its check on the recorded calls took, and what its build
    said of itself (Backend.build_note: e.g. a converted model read from torch-tweak's folder)."""

    path: str
    signature: str
    backend: str
    seconds: float
    note: str = ""

    def __str__(self) -> str:
        return (f"{self.path or '(root)'} {self.signature[:80]}: {self.backend} in {self.seconds:.2f} s"
                + (f" ({self.note})" if self.note else ""))


class LoadResult(dict):
    """What tt.load returns: {module path: the backend of its first signature, or None}, as
    before, and what the load cost: ``seconds`` (the whole call), ``read_seconds`` (the file
    read and checked), ``rebuilt`` (a Rebuilt per backend built again and checked on its stored
    calls, in order) and ``summary()``, the line tt.load logs (INFO, logger torch_tweak)."""

    def __init__(self, chosen: dict, path: Any, seconds: float, read_seconds: float,
                 rebuilt: Sequence[Rebuilt]) -> None:
        super().__init__(chosen)
        self.path, self.seconds, self.read_seconds, self.rebuilt = path, seconds, read_seconds, list(rebuilt)

    def summary(self) -> str:
        """e.g. "tt.load of model.tt: 0.84 s: the file read and checked in 0.05 s; 1 backend
        built again and checked on its stored calls: (root) (float32[1, 64, 256]): OpenVINO in
        0.72 s (its converted model read from torch-tweak's folder, not converted again)"."""
        built = len(self.rebuilt)
        text = (f"tt.load of {self.path}: {self.seconds:.2f} s: the file read and checked in "
                f"{self.read_seconds:.2f} s; ")
        if not built:
            return text + "no backend built (nothing tuned in it)"
        return (text + f"{built} backend{'s' if built > 1 else ''} built again and checked on its stored calls: "
                + "; ".join(map(str, self.rebuilt)))


def _copy(group: SignatureGroup, backend: Backend | None) -> SignatureGroup:
    """A group of its own (its lists copied, not its tensors) with `backend`."""
    return dataclasses.replace(group, backend=backend, samples=list(group.samples), outputs=list(group.outputs),
                               report=list(group.report))


def plan_of(model: nn.Module) -> Plan:
    """The plan `model` runs now: per wrapper installed in it, by path, its signature groups
    with an unbuilt copy of each chosen backend and the recorded calls and outputs that tuning
    kept (see tuning.release), and what its record says of it (depth, shapes, rule). Shares
    nothing mutable with the model's wrappers."""
    modules = [ModulePlan(path, [_copy(g, None if g.backend is None else g.backend.fresh())
                                 for g in wrapper.tt_signatures], wrapper.tt_error, list(wrapper.tt_report))
               for path, wrapper in sorted(installed(model).items())]
    record = records.of(model) or records.Record()
    return Plan(record.depth if modules else None, modules, plan_loop(model), record.shapes if modules else None,
                record.rule.tolerance)


def apply(model: nn.Module, plan: Plan, *, device: torch.device, calls: Sequence[Call] | None = None,
          bounded: bool = False, strict: bool = True, rebuilt: list[Rebuilt] | None = None) -> list[RebuildFailed]:
    """Applies `plan` to `model`, with no measurement; returns the rebuilds that failed
    (always empty when strict).

    Each module of the plan gets a wrapper in place (none may be wrapped already). With
    `calls` (the dataset, as calls) the wrappers record them first, and each module must have
    been called with the plan's signatures, in order (else PlanError); without, the plan's own
    recorded calls are used. Each chosen backend is built again (an unbuilt copy: the plan is
    not changed and can be applied again) on its calls and checked against the recorded
    outputs; bounded: its tolerance came from a file (capped, see settings.MAX_TOLERANCES).
    A group with no recorded call ("any other call" too: its backend serves only the calls
    it was checked on, see signatures.proven_signatures) fails to rebuild.

    A rebuild that fails raises RebuildFailed when strict; else that signature runs the
    original forward, with the reason in its group's error and in the list returned; one that
    builds is appended to `rebuilt` (a Rebuilt: its time and its build's note). Then
    every wrapper gets its dispatcher entries, those with a backend are switched to it, the
    model's record keeps the plan's depth, shapes and rule (what tt.save writes), and untuned calls
    count from 0.

    On any error (the ones above, a KeyboardInterrupt...) every wrapper apply installed is
    taken out and the error raised: the model is as it was. Recording runs the model: a caller
    whose model is in training mode keeps its state (model_state.kept), as tt.tweak does."""
    with correctness.ruling(correctness.Rule(plan.tolerance)):
        return _apply(model, plan, device, calls, bounded, strict, [] if rebuilt is None else rebuilt)


def _apply(model: nn.Module, plan: Plan, device: torch.device, calls: Sequence[Call] | None, bounded: bool,
           strict: bool, rebuilt: list[Rebuilt]) -> list[RebuildFailed]:
    model_class = model_class_name(model)
    failures: list[RebuildFailed] = []
    edges = edge_calls(plan.shapes, calls, forward_params(model)) if calls is not None else []
    wrappers = install_all(model, plan.paths)
    try:
        if calls is not None and wrappers:  # the declared shapes' ends too: the groups were formed with them
            record(wrappers, dataset_runner(model, calls), dataset_runner(model, edges) if edges else None, model)
        for wrapper, module in zip(wrappers, plan.modules):
            if calls is None:
                wrapper.tt_signatures[:] = [_copy(g, None) for g in module.groups]
                lay_out(wrapper.tt_signatures, forward_params(wrapper._tt_original), position_table(model))
            elif [g.key for g in wrapper.tt_signatures] != [g.key for g in module.groups]:
                raise PlanError(f"{module.path or '(root)'} was called with other signatures")
            errors = [module.error]
            for group, planned in zip(wrapper.tt_signatures, module.groups):
                group.error, group.report, group.unstorable = planned.error, list(planned.report), planned.unstorable
                if planned.backend is None:
                    continue
                backend = planned.backend.fresh()
                if plan.shapes is not None:
                    backend = backend.for_shapes(plan.shapes)
                start = time.perf_counter()
                try:
                    _build(wrapper, group, backend, device, model_class, bounded)
                except RebuildFailed as failure:
                    if strict:
                        raise
                    group.error = str(failure)
                    group.release()
                    failures.append(failure)
                    errors.append(group.error)
                    continue
                group.backend = backend
                rebuilt.append(Rebuilt(module.path, group.text, backend.name, time.perf_counter() - start,
                                       backend.build_note))
            apply_groups(wrapper)
            wrapper.tt_error = "; ".join(e for e in errors if e)
            wrapper.tt_report = list(module.report)
            release(wrapper)
        for wrapper in wrappers:
            wrapper.tt_activate()
        if plan.generate is not None:
            problem = apply_loop(model, plan.generate)
            if problem is not None:
                if strict:
                    raise PlanError(f"tweak's decode loop: {problem}")
                warnings.warn(f"tweak's decode loop is not installed ({problem}): generate() runs transformers' "
                              "own loop", stacklevel=3)
    except BaseException:
        unwrap(model, plan.paths)
        if plan.generate is not None:
            uninstall_loop(model)
        raise
    records.made(model).keep(plan.depth, plan.shapes, correctness.Rule(plan.tolerance))
    arm_untuned(model)
    return failures


def revert(model: nn.Module) -> None:
    """Takes every wrapper out of `model`: each module is its original self again."""
    unwrap(model)


def _build(wrapper: TunedModule, group: SignatureGroup, backend: Backend, device: torch.device, model_class: str,
           bounded: bool) -> None:
    """Builds `backend` for one group on its recorded calls and checks it; RebuildFailed when
    it fails to build or to match."""
    if not group.samples:
        what = ("the file holds no recorded call of it (tt.save warned: its calls held live state such as "
                "a key/value cache passed in), and a backend is rebuilt and checked on one")
        if is_other(group):
            what += " and serves only the calls of the shapes and values it was checked on"
        raise RebuildFailed(wrapper.tt_name, group, backend,
                            what + "; tune this signature again here, or save from calls that pass no cache")
    try:
        rebuild_group(wrapper, group, backend, device, model_class, bounded=bounded)
    except Exception as exc:
        raise RebuildFailed(wrapper.tt_name, group, backend,
                            f"the rebuilt {backend.name} failed: {type(exc).__name__}: {exc}", exc) from exc
