"""Recording samples for wrapped modules, and tuning each one with its strategy."""

from __future__ import annotations

from typing import Any, Callable, Iterable, Sequence

import torch
from torch import nn

from . import _C
from ._samples import Call, clone, load_dataset, resolve_device, synchronizer
from .correctness import check
from .module import MODE_ACTIVE, MODE_ORIGINAL, MODE_RECORD, TunedModule, installed
from .progress import Progress
from .strategy import Strategy, default_backends, default_strategy

MAX_RECORDED_CALLS = 16
"""Calls recorded per module: the first ones; they are what backends build and are checked on."""


class TuneError(Exception):
    """No backend of the strategy built and passed the check for a module."""


def record(wrappers: Iterable[TunedModule], run_dataset: Callable[[], None]) -> None:
    """Runs the dataset once with `wrappers` recording their calls and original outputs."""
    wrappers = list(wrappers)
    previous = [w._tt_mode for w in wrappers]
    try:
        for wrapper in wrappers:
            wrapper.tt_samples.clear()
            wrapper.tt_outputs.clear()
            wrapper._tt_set_recorder(_recorder(wrapper))
            wrapper._tt_mode = MODE_RECORD
        run_dataset()
    finally:
        for wrapper, mode in zip(wrappers, previous):
            wrapper._tt_mode = mode
            wrapper._tt_set_recorder(None)


def _recorder(wrapper: TunedModule) -> Callable[..., Any]:
    original = wrapper._tt_original
    samples = wrapper.tt_samples
    outputs = wrapper.tt_outputs

    def recorder(*args: Any, **kwargs: Any) -> Any:
        out = original(*args, **kwargs)
        if len(samples) < MAX_RECORDED_CALLS:
            samples.append((clone(args), clone(kwargs)))
            outputs.append(clone(out))
        return out

    return recorder


def tune_wrapper(wrapper: TunedModule, strategy: Strategy, device: torch.device,
                 measure: dict | None = None, progress: Progress | None = None) -> None:
    """Picks a backend for one recorded wrapper; raises TuneError when none passes.

    On success the wrapper holds the backend (tt_backend) and dispatches to it once
    activated; on failure it keeps calling its original forward.
    """
    samples: Sequence[Call] = wrapper.tt_samples
    refs = wrapper.tt_outputs
    name = wrapper.tt_name or "(root)"
    if not samples:
        raise TuneError(f"the dataset never called {name}; there is nothing to tune it on")
    module = wrapper._tt_original
    backends = strategy.fresh().candidates(device)
    sync = synchronizer(device)

    def build_of(backend):
        def build() -> None:
            if progress is not None:
                progress.step(wrapper.tt_name, f"building {backend.name}")
            fn = backend.prepare(module, samples, device)
            for i, (args, kwargs) in enumerate(samples):
                check(fn(*args, **kwargs), refs[i], backend.config.tolerance, where=f"sample {i}")
        return build

    def run_of(backend):
        def run(i: int) -> None:
            args, kwargs = samples[i]
            backend.callable(*args, **kwargs)
        return run

    candidates = [(b.name, build_of(b), run_of(b)) for b in backends]
    with torch.no_grad():
        index, reports = _C.choose(strategy.kind, candidates, len(samples), sync=sync, config=measure)
    wrapper.tt_report = [_report(b, r) for b, r in zip(backends, reports)]
    if index < 0:
        wrapper.tt_backend = None
        wrapper._tt_set_entries([])
        reasons = "; ".join(f"{r['backend']}: {r['error'] or r['state']}" for r in wrapper.tt_report)
        wrapper.tt_error = f"no backend passed ({reasons})"
        raise TuneError(f"{name}: {wrapper.tt_error}")
    chosen = backends[index]
    wrapper.tt_backend = chosen
    wrapper.tt_error = ""
    wrapper._tt_set_entries([(None, chosen.callable)])
    if progress is not None:
        progress.step(wrapper.tt_name, f"chose {chosen.name}")


def _report(backend, report: dict) -> dict:
    stats = report.get("stats")
    return {
        "backend": backend.name,
        "state": report["state"],
        "latency_ms": None if stats is None else stats["median_ns"] / 1e6,
        "error": report.get("error", ""),
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


def dataset_runner(model: nn.Module, calls: Sequence[Call]) -> Callable[[], None]:
    def run_all() -> None:
        with torch.no_grad():
            for args, kwargs in calls:
                model(*args, **kwargs)
    return run_all


def tune(model: nn.Module, dataset: Any, *, strategy: Strategy | None = None, device: Any = None,
         measure: dict | None = None, progress: bool = False) -> dict[str, str | None]:
    """Records samples for every wrapped module of `model` by running `dataset`, then tunes each.

    Returns {path: chosen backend name, or None when the module keeps its original forward}.
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
    calls = load_dataset(dataset, device)
    shown = Progress(progress)
    record(wrappers.values(), dataset_runner(model, calls))
    chosen: dict[str, str | None] = {}
    for path, wrapper in wrappers.items():
        template = strategy if strategy is not None else getattr(wrapper, "tt_strategy", None)
        template = template if template is not None else default_strategy(device)
        try:
            tune_wrapper(wrapper, template, device, measure, shown)
            wrapper._tt_mode = MODE_ACTIVE
            chosen[path] = wrapper.tt_backend.name
        except TuneError:
            wrapper._tt_mode = MODE_ORIGINAL
            chosen[path] = None
        finally:
            release(wrapper)
    shown.close()
    return chosen


def release(wrapper: TunedModule) -> None:
    """Drops what tuning recorded, once no backend needs it."""
    wrapper.tt_samples.clear()
    wrapper.tt_outputs.clear()
