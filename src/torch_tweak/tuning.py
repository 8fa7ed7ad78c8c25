"""Recording samples for wrapped modules, and tuning each one with its strategy."""

from __future__ import annotations

import contextlib
import logging
import time
from typing import Any, Callable, Iterable, Iterator, Sequence

import torch
from torch import nn

from . import _C, isolation, model_state
from ._samples import Call, clone, fresh, load_dataset, resolve_device, synchronizer, unstorable
from .backends.base import Backend, BackendUnavailable
from .buildlog import BuildLog, capture_build, log_path
from .correctness import MismatchError, check
from .module import MODE_ACTIVE, MODE_ORIGINAL, MODE_RECORD, TunedModule, arm_untuned, installed
from .progress import Progress
from .report import fold
from .signatures import MAX_CALLS_PER_SIGNATURE, SignatureGroup, forward_params, group_for
from .strategy import Strategy, default_backends, default_strategy

logger = logging.getLogger("torch_tweak")


class TuneError(Exception):
    """No backend of the strategy built and passed the check for a module."""


def record(wrappers: Iterable[TunedModule], run_dataset: Callable[[], None]) -> None:
    """Runs the dataset once with `wrappers` recording their calls and original outputs,
    grouped by input signature (see torch_tweak.signatures)."""
    wrappers = list(wrappers)
    previous = [w._tt_mode for w in wrappers]
    try:
        for wrapper in wrappers:
            release(wrapper, keep_chosen=False)
            wrapper.tt_signatures.clear()
            wrapper._tt_set_recorder(_recorder(wrapper))
            wrapper._tt_mode = MODE_RECORD
        run_dataset()
    finally:
        for wrapper, mode in zip(wrappers, previous):
            wrapper._tt_mode = mode
            wrapper._tt_set_recorder(None)


def _recorder(wrapper: TunedModule) -> Callable[..., Any]:
    original = wrapper._tt_original
    groups = wrapper.tt_signatures
    samples = wrapper.tt_samples
    outputs = wrapper.tt_outputs
    params = forward_params(original)

    def recorder(*args: Any, **kwargs: Any) -> Any:
        # the call is copied before it runs: a key/value cache passed in grows during it
        before = fresh((args, kwargs)) if unstorable((args, kwargs)) is not None else None
        out = original(*args, **kwargs)
        group = group_for(groups, args, kwargs, params)  # the caller's own objects: what later calls match
        if before is not None:
            args, kwargs = before
        if group.signature is not None:  # stored as the backend will be called: the recorded layout
            args, kwargs = group.signature.bind(args, kwargs)
        if len(group.samples) < MAX_CALLS_PER_SIGNATURE:
            sample, result = (clone(args), clone(kwargs)), clone(out)
            group.samples.append(sample)
            group.outputs.append(result)
            samples.append(sample)
            outputs.append(result)
        return out

    return recorder


@contextlib.contextmanager
def build_scopes(backends: Sequence[Backend], static: bool) -> Iterator[None]:
    """Every distinct Backend.build_scope of `backends`, entered once each."""
    with contextlib.ExitStack() as stack:
        for scope in dict.fromkeys(type(b).build_scope for b in backends):
            stack.enter_context(scope(static))
        yield


OUT_OF_MEMORY = getattr(torch, "OutOfMemoryError", torch.cuda.OutOfMemoryError)


def _reason(exc: BaseException) -> str:
    if isinstance(exc, OUT_OF_MEMORY):
        return "out of memory"
    if isinstance(exc, BackendUnavailable):
        return "unavailable"
    if isinstance(exc, isolation.BuildCrashed):
        return "crashed"
    if isinstance(exc, MismatchError):
        return "mismatch"
    if str(exc).startswith("dynamic shapes"):
        return "dynamic shapes"
    return "build failed"


def tune_group(wrapper: TunedModule, group: SignatureGroup, strategy: Strategy, device: torch.device,
               measure: dict | None, progress: Progress | None, model_class: str) -> None:
    """Picks a backend for the recorded calls of one signature: group.backend, or group.error."""
    samples: Sequence[Call] = group.samples
    refs = group.outputs
    module = wrapper._tt_original
    backends = strategy.fresh().candidates_for(module, samples, device)
    sync = synchronizer(device)
    notes: list[dict] = [{} for _ in backends]
    state = model_state.snapshot(module)
    label = wrapper.tt_name if len(wrapper.tt_signatures) == 1 else f"{wrapper.tt_name} {group.text}"

    def build_of(i: int, backend: Backend):
        def build() -> None:
            if progress is not None:
                progress.step(label, f"building {backend.name}")
            path = log_path(model_class, wrapper.tt_name, group.key, backend.name)
            title = f"{backend!r} for {wrapper.tt_name or '(root)'} of {model_class}, signature {group.text}"
            started = time.monotonic()
            with capture_build(path, title) as log:
                try:
                    worst = build_checked(backend, module, samples, refs, device, state, log)
                except Exception as exc:
                    notes[i]["build_s"] = time.monotonic() - started
                    notes[i]["reason"] = _reason(exc)
                    if isinstance(exc, OUT_OF_MEMORY) and torch.cuda.is_initialized():
                        torch.cuda.empty_cache()  # what the failed build cached goes back to the next candidate
                    if isinstance(exc, MismatchError):
                        notes[i]["max_error"], notes[i]["tolerance"] = exc.error, exc.tolerance
                        log.outcome = f"failed the correctness check: {exc}"
                    raise
                notes[i]["max_error"] = worst
                notes[i]["build_s"] = time.monotonic() - started
                log.outcome = f"built; passed the correctness check (largest relative error {worst:.3g})"
        return build

    stateful = any(unstorable(s) is not None for s in samples)  # a cache passed in: copied per call

    def run_of(backend: Backend):
        def run(i: int) -> None:
            args, kwargs = fresh(samples[i]) if stateful else samples[i]
            backend.callable(*args, **kwargs)
        return run

    candidates = [(b.name, build_of(i, b), run_of(b)) for i, b in enumerate(backends)]
    try:
        with torch.no_grad(), build_scopes(backends, static=group.signature is not None):
            index, reports = _C.choose(strategy.kind, candidates, len(samples), sync=sync, config=measure)
    finally:
        state.restore()  # measuring a train-mode module moves its batch-norm statistics
    group.report = [candidate_report(b, r, n) for b, r, n in zip(backends, reports, notes)]
    for report, note in zip(group.report, notes):
        logger.debug("%s: %s %s%s%s", label or "(root)", report["backend"], report["state"],
                  f" in {note['build_s']:.2f} s" if "build_s" in note else "",
                  f", {report['latency_ms']:.3f} ms" if report["latency_ms"] is not None
                  else f": {fold(report['error'])}" if report["error"] else "")
    if index < 0:
        group.backend = None
        group.error = "no backend passed (" + "; ".join(
            f"{r['backend']}: {r['error'] or r['state']}" for r in group.report) + ")"
        return
    group.backend = backends[index]
    group.error = ""
    group.unstorable = sum(not group.backend.can_store(s) for s in samples)


def tune_wrapper(wrapper: TunedModule, strategy: Strategy, device: torch.device,
                 measure: dict | None = None, progress: Progress | None = None,
                 model_class: str = "Module") -> None:
    """Picks a backend per recorded signature of one wrapper; raises TuneError when none passes.

    On success the wrapper's dispatcher holds one entry (signature, backend) per
    signature that found a backend; a call of any other signature runs the original
    module. tt_backend is the first signature's backend. On failure the wrapper keeps
    calling its original forward.
    """
    name = wrapper.tt_name or "(root)"
    groups: list[SignatureGroup] = wrapper.tt_signatures
    if not groups:
        raise TuneError(f"the dataset never called {name}; there is nothing to tune it on")
    for group in groups:
        tune_group(wrapper, group, strategy, device, measure, progress, model_class)
    several = len(groups) > 1
    wrapper.tt_report = [dict(r, signature=g.text) for g in groups for r in g.report]
    chosen = apply_groups(wrapper)
    wrapper.tt_error = "; ".join(f"{g.text}: {g.error}" if several else g.error for g in groups if g.error)
    if not chosen:
        raise TuneError(f"{name}: {wrapper.tt_error}")


def entry_flags(backend: Backend) -> int:
    """The dispatcher's flags for an entry of `backend`: serialised when it is not
    thread-safe, the original for calls autograd would record when it returns no
    autograd outputs (see Backend.thread_safe, Backend.supports_autograd)."""
    flags = 0
    if not backend.thread_safe:
        flags |= _C.ENTRY_SERIALIZE
    if not backend.supports_autograd:
        flags |= _C.ENTRY_NO_AUTOGRAD
    return flags


def apply_groups(wrapper: TunedModule) -> list[SignatureGroup]:
    """Gives the wrapper's dispatcher one (signature, callable, flags) entry per signature
    group that has a backend, and sets tt_backend (the first one's); returns those groups.

    A lone entry whose backend checks its inputs itself only has its call laid out by its
    signature: the values are checked once, by the backend, instead of twice. The
    untuned counters start again from 0 (see TunedModule.tt_untuned)."""
    chosen = [g for g in wrapper.tt_signatures if g.backend is not None]
    if len(chosen) == 1 and chosen[0].backend.checks_inputs:
        group = chosen[0]
        flags = entry_flags(group.backend)
        if group.signature is not None:
            flags |= _C.ENTRY_LAYOUT_ONLY
        wrapper._tt_set_entries([(group.signature, group.backend.callable, flags)])
    else:
        wrapper._tt_set_entries([(g.signature, g.backend.callable, entry_flags(g.backend)) for g in chosen])
    wrapper._tt_set_params(tuple(m._parameters for m in wrapper._tt_original.modules()))
    wrapper.tt_backend = chosen[0].backend if chosen else None
    wrapper.tt_reset_untuned()
    return chosen


def candidate_report(backend: Backend, report: dict, note: dict) -> dict:
    stats = report.get("stats")
    return {
        "backend": backend.name,
        "state": report["state"],
        "latency_ms": None if stats is None else stats["median_ns"] / 1e6,
        "error": report.get("error", ""),
        "reason": note.get("reason", ""),
        "max_error": note.get("max_error"),
        "tolerance": note.get("tolerance"),
    }


def check_measure(measure: dict | None) -> None:
    """A measurement override names only known settings (values are checked by the engine)."""
    if measure is None:
        return
    if not isinstance(measure, dict):
        raise TypeError(f"measure must be a dict of measurement settings, not {type(measure).__name__}")
    known = _C.default_measure_config()
    unknown = sorted(set(measure) - set(known))
    if unknown:
        raise ValueError(f"unknown measurement setting {', '.join(unknown)}; known: {', '.join(sorted(known))}")


def model_class_name(model: nn.Module) -> str:
    """The model's own class name (a wrapped root's class is a subclass of the same name)."""
    return getattr(type(model), "_tt_root_class", type(model)).__name__


def dataset_runner(model: nn.Module, calls: Sequence[Call]) -> Callable[[], None]:
    def run_all() -> None:
        with torch.no_grad():
            for args, kwargs in calls:
                model(*args, **kwargs)
    return run_all


def tune(model: nn.Module, dataset: Any, *, strategy: Strategy | None = None, device: Any = None,
         measure: dict | None = None, progress: bool = False) -> dict[str, str | None]:
    """Records samples for every wrapped module of `model` by running `dataset`, then tunes each.

    Returns {path: chosen backend name (of its first signature), or None when the module
    keeps its original forward}.
    Modules whose tuning fails keep their original forward; their reason is in
    ``wrapper.tt_error`` and ``wrapper.tt_report``.
    """
    wrappers = installed(model)
    if not wrappers:
        raise ValueError("the model has no wrapped modules: call tt.wrap(model, modules) first")
    device = resolve_device(model, device)
    default_backends(device)  # an unknown device fails here, before anything changes
    if strategy is not None and not isinstance(strategy, Strategy):
        raise TypeError(f"strategy must be a torch_tweak strategy, not {type(strategy).__name__}")
    check_measure(measure)
    templates = {path: strategy if strategy is not None else getattr(wrapper, "tt_strategy", None)
                 for path, wrapper in wrappers.items()}
    for template in templates.values():
        if template is not None:
            template.check_device(device)  # a backend this device cannot run fails here
    calls = load_dataset(dataset, device)
    shown = Progress(progress)
    with model_state.kept(model):  # recording a train-mode model moves its batch-norm statistics
        record(wrappers.values(), dataset_runner(model, calls))
        chosen: dict[str, str | None] = {}
        model_class = model_class_name(model)
        for path, wrapper in wrappers.items():
            template = templates[path] if templates[path] is not None else default_strategy(device)
            try:
                tune_wrapper(wrapper, template, device, measure, shown, model_class)
                wrapper._tt_mode = MODE_ACTIVE
                chosen[path] = wrapper.tt_backend.name
            except TuneError:
                wrapper._tt_mode = MODE_ORIGINAL
                chosen[path] = None
            finally:
                release(wrapper)
    shown.close()
    arm_untuned(model)
    return chosen


def release(wrapper: TunedModule, keep_chosen: bool = True) -> None:
    """Drops what tuning recorded, once no backend needs it (the signatures and reports stay).

    The recorded calls and outputs of a signature whose backend was chosen stay unless
    keep_chosen is False: tt.save stores them, for the backend to be built on again at
    load and checked against the outputs."""
    wrapper.tt_samples.clear()
    wrapper.tt_outputs.clear()
    for group in wrapper.tt_signatures:
        if group.backend is None or not keep_chosen:
            group.release()


def rebuild_group(wrapper: TunedModule, group: SignatureGroup, backend: Backend, device: torch.device,
                  model_class: str, bounded: bool = False) -> float:
    """Builds `backend` again for one signature on its recorded calls, with no measurement
    (a saved plan or a tuning-cache entry chose it), and checks it against the recorded
    outputs. Raises when it fails to build or to match; returns the largest error.
    bounded: the backend's tolerance came from a file (capped, see correctness.MAX_TOLERANCES)."""
    module = wrapper._tt_original
    state = model_state.snapshot(module)
    path = log_path(model_class, wrapper.tt_name, group.key, backend.name)
    title = f"{backend!r} for {wrapper.tt_name or '(root)'} of {model_class}, signature {group.text} (rebuilt)"
    with capture_build(path, title) as log, torch.no_grad(), build_scopes([backend], group.signature is not None):
        worst = build_checked(backend, module, group.samples, group.outputs, device, state, log, bounded)
        log.outcome = f"rebuilt; passed the correctness check (largest relative error {worst:.3g})"
    return worst


def build_checked(backend: Backend, module: nn.Module, samples: Sequence[Call], refs: Sequence[Any],
                  device: torch.device, state: model_state.Snapshot, log: BuildLog, bounded: bool = False) -> float:
    """Builds `backend` for `module` (first in an isolated child when the backend asks for it)
    and checks it on `samples` against `refs`; returns the largest error. Whatever the build
    and the check changed in the module (training flags, parameters, buffers) is put back,
    also when they raise, and written in the build log. bounded: the tolerance came from a file."""
    if backend.isolate_build:
        isolation.check(backend, module, samples, device, log.notes)  # raises BuildCrashed
    try:
        try:
            # a key/value cache in a call grows at every call: each use gets its own copy
            fn = backend.prepare(module, [fresh(s) for s in samples], device)
        finally:
            put_back(state, log)  # before the check: weights a backend moved are back on their device
        worst = 0.0
        for j, sample in enumerate(samples):
            args, kwargs = fresh(sample)
            worst = max(worst, check(fn(*args, **kwargs), refs[j], backend.check_tolerance(), where=f"sample {j}",
                                     bounded=bounded))
    finally:
        put_back(state, log)
    return worst


def put_back(state: model_state.Snapshot, log: BuildLog) -> None:
    changes = state.restore()
    if changes:
        log.notes.append(f"restored {len(changes)} changes the build made to the module:")
        log.notes.extend(f"  {line}" for line in changes)
