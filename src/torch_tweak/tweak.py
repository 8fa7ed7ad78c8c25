"""tt.tweak: tune every cut of a model and keep the fastest."""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import logging
import weakref
from typing import Any, Iterator, Literal

import torch
from torch import nn

from . import _C
from .backends import axes
from ._core import correctness, distributed, model_state, noise
from ._runtime import decode_call, generation
from ._store import tuning_cache
from ._core import cpu_load
from ._core._samples import load_dataset, resolve_device, synchronizer
from ._runtime.inspecting import ModuleTree, trace
from ._runtime.module import TunedModule, arm_untuned, install, installed, make_wrapper, uninstall, unwrap
from ._search.plan import SELECTED_DEPTHS, plan_of
from ._view.progress import Progress
from ._view.report import ModuleResults, fold, module_result
from .backends.strategy import Strategy, default_backends, default_strategy
from ._store.serial import Unstorable
from ._view.status import BUSY_FIGURES, status
from ._core.shapes import DECLARED, check_calls, check_model, check_shapes, edge_calls
from ._core.signatures import forward_params, label_pairs
from ._search.tuning import (GivenCalls, ModuleSearch, absorb, check_measure, dataset_runner, measure_for,
                             model_class_name, record, release)
from ._runtime.workload import TokenRow, Workload, choose_loop, depths_cannot_match

_DEFAULTS = _C.default_tweak_config()  # the engine owns every default of the depth search

DEFAULT_MAX_DEPTH: int = _DEFAULTS["max_depth"]
"""The deepest cut tweak tries unless told: 1, the model and its children. Depth 2 was the
fastest on none of the benchmarked models (the GPU run that searched it,
bench/results/runs/gpu-d149c65.json, and the CPU example) and took a third of the tuning
time on ResNet-50 (bench/results/tuning_time.md); max_depth=2, or None for every depth,
searches deeper."""
DEFAULT_BUSY_BUDGET: float = _C.BUSY_BUDGET
"""The busy budget in seconds (tt.tweak's busy_budget, the engine's TW_BUSY_BUDGET_NS): 120."""

Effort = Literal["default", "high"]
"""The values of tt.tweak's ``effort``."""

DEFAULT_TIE_TOLERANCE: float = _DEFAULTS["tie_tolerance"]
"""A depth within 2 % of the fastest counts as a tie; the shallowest tie wins."""


@dataclasses.dataclass(frozen=True)
class DepthResult:
    """One row of a tweak: a depth, or the untuned model (depth None)."""

    depth: int | None
    modules: int
    failed: int
    latency_ms: float | None
    speedup: float | None
    error: str
    selected: bool


class TweakResult:
    """What tt.tweak did. ``print(result)`` shows a table, one row per depth.

    selected_depth: the depth kept, or None when the model stays untuned.
    baseline_ms: latency of the untuned model per call: measured side by side with the
    kept depth when one was confirmed (see confirmation), else the lower of its
    measurements during the search (also when the side-by-side figures disagreed with the
    search's and the search's speedup was the smaller).
    tuned_ms: latency of the kept depth, from the same measurement as baseline_ms (the
    baseline when none is kept).
    speedup: baseline_ms / tuned_ms (1.0 when the model stays untuned): never a figure that
    disagrees with the search's (see measurement_quality); on a busy machine (busy), the
    median ratio of the paired rounds (confirmation["speedup"], its 99 % interval
    confirmation["speedup_low"] to ["speedup_high"]), a figure measured busy.
    confirmation: the best depth measured side by side with the untuned model, interleaved
    (docs/tweak.md): {"depth", "confirmed", "tuned", "untuned", "speedup", "speedup_low",
    "speedup_high", "quality", "tries", "from_search", "side_speedup", "search_speedup",
    "agreed", "others_share", "paired_rounds", "paired_wins"}, or None when no depth beat the
    untuned model in the search.
    measurement_quality: how the side-by-side figures held against the search's own for
    the same configurations: "consistent"; "remeasured" (they disagreed, the machine's load
    changed, and agreed when measured again); "inconsistent" (they never agreed: the smaller
    speedup is reported, and the depth kept only when even that is a gain); "busy" (other
    processes took more than a quarter of the CPUs while measuring: the fastest depth and
    the untuned model were measured in paired rounds, the depth kept when their 99 % interval
    lies above 1, its figure marked busy; docs/tweak.md, "A busy machine"); "unchecked"
    (nothing was measured side by side: no depth beat the untuned model, or a dry run).
    noisy: True when no speedup was confirmed and a measurement spread more than 25 % (a
    busy machine may have hidden one).
    others_share: the share of the machine's CPUs other processes took while the figures
    were measured (0..1: the untuned model's measurements and the side-by-side one, the
    larger), None where it cannot be read (not Linux); busy: True when it is above
    torch_tweak._C.BUSY_SHARE (0.25); busy_stopped: True when the busy budget
    (tt.tweak's busy_budget) stopped the search before every depth was tried.
    rows: a DepthResult per depth; untuned: the DepthResult of the untuned model.
    modules: a ModuleResult per tuned module, by path; ``print(result.modules)`` shows, per
    module and input signature, every candidate backend's latency or why it lost.
    kept: True when a depth or a decode loop was kept; False: nothing kept, nothing to save.
    cached: True when the result came from the tuning cache (no depth was measured again);
    measured_at: then, when its figures were measured (UTC, ISO 8601), else None.
    tokens: for a workload that calls generate(), a TokenRow (tokens per second, time to
    first token) for the untuned model, each depth and the kept configuration; else None.
    decode_loop: the decode loop kept behind generate() (torch_tweak._runtime.generation.LOOPS), or None;
    loop_report: each decode-loop candidate's latency or why it lost, and "numerics": what
    the correctness rule found on its generate() calls (its error as a multiple of the untuned
    call's, where its tokens part and the margin there); numerics: the same per candidate
    (loops, and depths as "depth N"), printed under the generate() table.
    """

    selected_depth: int | None
    baseline_ms: float | None
    tuned_ms: float | None
    speedup: float | None
    cached = False
    measured_at: str | None = None
    time_budget: float | None = None
    tokens: "list[TokenRow] | None" = None
    tokens_per_run = 0
    decode_loop: str | None = None
    loop_report: "list[dict] | None" = None
    numerics: "dict[str, str] | None" = None  # per generate() candidate, what the correctness rule found
    hint = ""
    refused = ""  # why no depth was searched (each row then failed with it), else ""
    _model: "weakref.ref[nn.Module] | None" = None  # the tuned model, for its buckets (shapes_lines)

    def __init__(self, engine: "_C.Result", tree: ModuleTree, modules: ModuleResults) -> None:
        self._engine = engine
        self.tree = tree
        self.modules = modules
        base = engine.baseline
        self.baseline_ms = None if base is None else base["median_ns"] / 1e6
        self.confirmation = engine.confirmation
        self.measurement_quality: str = engine.quality
        self.noisy = engine.noisy
        self.others_share: float | None = engine.others_share
        self.busy: bool = engine.busy
        self.busy_stopped: bool = engine.busy_stopped
        chosen = engine.selected
        rows = []
        for i, row in enumerate(engine.rows):
            stats = row["stats"]
            latency = None if stats is None else stats["median_ns"] / 1e6
            speedup = None if latency is None or self.baseline_ms is None or latency <= 0 else self.baseline_ms / latency
            rows.append(DepthResult(row["depth"], row["modules"], row["failed"], latency, speedup,
                                    row["error"], i == chosen))
        self.rows = rows
        self.selected_depth = rows[chosen].depth if chosen >= 0 else None
        self.untuned = DepthResult(None, 0, 0, self.baseline_ms, None if base is None else 1.0, "", chosen < 0)
        self.tuned_ms = rows[chosen].latency_ms if chosen >= 0 else self.baseline_ms
        side = self.confirmation
        if side is not None and side["confirmed"] and not side["from_search"]:
            # else the search's figures were the smaller of two that disagree: they stay
            self.baseline_ms = side["untuned"]["median_ns"] / 1e6
            self.tuned_ms = side["tuned"]["median_ns"] / 1e6
        self.speedup = self._speedup()

    def _speedup(self) -> float | None:
        """baseline_ms / tuned_ms; on a busy machine with a depth kept, the paired rounds' figure."""
        side = self.confirmation
        if self.measurement_quality == "busy" and side is not None and side["confirmed"]:
            return side["speedup"]
        return self.baseline_ms / self.tuned_ms if self.baseline_ms is not None and self.tuned_ms else None

    def __str__(self) -> str:
        if not self.cached:
            # the engine knows depths only: with a decode loop kept, what stays untuned is the modules
            table = self._engine.format(untuned=f"its modules stay untuned; generate() runs tweak's decode "
                                        f"loop ({self.decode_loop})" if self.decode_loop else None)
            lines = self.precision_lines() + self.shapes_lines()
            return table + "".join("\n" + line for line in lines) + \
                self._tokens_table()
        return self._table + "".join("\n" + line for line in self.shapes_lines()) + f"\n{self.cache_note()}"

    @property
    def kept(self) -> bool:
        """Whether the tweak kept anything: a depth, or tweak's decode loop behind generate().
        False: the model runs as it did, and there is nothing worth saving (tt.save would write
        a file that changes nothing)."""
        return self.selected_depth is not None or self.decode_loop is not None

    def shapes_lines(self) -> list[str]:
        """The declared shapes, and per padded group of the tuned model its buckets, their calls
        since tuning, the padding waste, the graphs and their memory (tt.status's lines)."""
        model = self._model() if self._model is not None else None
        return [] if model is None else status(model).shapes_lines()

    def cache_note(self) -> str:
        """What a result from the tuning cache says about its figures."""
        when = tuning_cache.measured_when(self.measured_at)
        return (f"(from the tuning cache: the figures were measured {when}; tt.tweak(..., cache=False) "
                f"measures again)")

    @property
    def lower_precision(self) -> dict[str, str]:
        """{path: candidate} of the kept modules that run at a lower precision (precision=...,
        or a TorchAO backend you passed): those whose chosen config lowers precision
        (BackendConfig.lowers_precision), e.g. "TorchInductor [bf16 autocast]"."""
        found = {}
        for path, module in self.modules.items():
            if module.kept and module.backend and any(c.get("lowers_precision") for s in module.signatures
                                                      for c in s.candidates if c["backend"] == s.backend):
                found[path] = module.backend
        return found

    def precision_lines(self) -> list[str]:
        """One line per kept module at a lower precision, with the largest error of its check."""
        lines = []
        for path, label in self.lower_precision.items():
            errors = [c.get("max_error") for s in self.modules[path].signatures
                      for c in s.candidates if c["backend"] == s.backend]
            worst = max((e for e in errors if e is not None), default=None)
            shown = "" if worst is None else f" (largest relative error {worst:.3g})"
            lines.append(f"lower precision, as asked: {path or '(root)'} runs {label}{shown}")
        return lines

    def _tokens_table(self) -> str:
        if not self.tokens:
            return ""
        width = max(len(r.label) for r in self.tokens)
        lines = ["", f"generate(): {self.tokens_per_run} new tokens per run of the workload",
                 f"  {'configuration':<{width}}  {'tokens/s':>10}  {'first token ms':>14}  status"]
        for r in self.tokens:
            rate = "-" if r.tokens_per_s is None else f"{r.tokens_per_s:,.1f}"
            ttft = "-" if r.ttft_ms is None else f"{r.ttft_ms:.3f}"
            lines.append(f"{'*' if r.kept else ' '} {r.label:<{width}}  {rate:>10}  {ttft:>14}  {r.status}".rstrip())
        for label, found in (self.numerics or {}).items():  # the correctness rule's finding, per candidate
            lines.append(f"  correctness, {label}: {fold(found, 140)}")
        if self.hint:
            lines.append(f"note: {self.hint}")
        return "\n".join(lines)

    def to_record(self) -> dict:
        """The result as plain JSON (what the tuning cache keeps)."""
        return {"rows": [dataclasses.asdict(r) for r in self.rows], "baseline_ms": self.baseline_ms,
                "tuned_ms": self.tuned_ms, "search_baseline_ms": self.untuned.latency_ms,
                "confirmation": self.confirmation, "quality": self.measurement_quality, "noisy": self.noisy,
                "others_share": self.others_share, "busy": self.busy, "busy_stopped": self.busy_stopped,
                "table": str(self)}

    @classmethod
    def from_record(cls, record: dict, tree: ModuleTree, modules: ModuleResults,
                    measured_at: str | None = None) -> "TweakResult":
        """The result a cache entry recorded, marked cached; measured_at: the entry's time."""
        self = object.__new__(cls)
        self._engine = None
        self._table = record["table"]
        self.cached = True
        self.measured_at = measured_at if isinstance(measured_at, str) else None
        self.measurement_quality = str(record["quality"])
        self.tree = tree
        self.modules = modules
        self.baseline_ms = record["baseline_ms"]
        self.confirmation = record["confirmation"]
        self.noisy = bool(record["noisy"])
        share = record.get("others_share")
        self.others_share = float(share) if type(share) in (int, float) else None
        self.busy = bool(record.get("busy", False))
        self.rows = [DepthResult(**row) for row in record["rows"]]
        chosen = next((r for r in self.rows if r.selected), None)
        self.selected_depth = None if chosen is None else chosen.depth
        search = record["search_baseline_ms"]  # the untuned model as the search measured it
        self.untuned = DepthResult(None, 0, 0, search, None if search is None else 1.0, "", chosen is None)
        self.tuned_ms = record["tuned_ms"]
        self.busy_stopped = bool(record.get("busy_stopped", False))
        self.speedup = self._speedup()
        return self

    def outcome(self) -> str:
        """One line: what the tweak kept, and by how much (side by side)."""
        if self.rows and all(r.latency_ms is None and not r.error for r in self.rows):
            return "dry run: nothing built or measured"
        side = self.confirmation
        loop = f"; generate() runs tweak's decode loop ({self.decode_loop})" if self.decode_loop else ""
        stays = "its modules stay untuned" if self.decode_loop else "the model stays untuned"
        quality = self.measurement_quality
        how = ("the smaller of two figures that disagree" if quality == "inconsistent"
               else "measured side by side again after the load changed" if quality == "remeasured"
               else "measured side by side")
        if quality == "busy" and side is not None:
            return self._busy_outcome(side, stays, loop)
        if self.selected_depth is not None:
            how = how if side is not None and side["confirmed"] else "measured in turn"
            return f"kept depth {self.selected_depth}, {self.speedup:.2f}x faster than untuned ({how}){loop}"
        if side is not None:
            verdict = "slower than" if side["speedup_high"] < 1.0 else "within noise of"
            return (f"depth {side['depth']} was {verdict} the untuned model ({side['speedup']:.2f}x, {how}): "
                    f"{stays}{loop}")
        if self.refused and self.rows and all(r.latency_ms is None for r in self.rows):
            return f"no depth was searched: {self.refused}: {stays}{loop}"
        if self.rows and all(r.error == "time budget used up" for r in self.rows):
            why = "was 0" if self.time_budget == 0 else "was used up before the first depth"
            return f"no depth was tried: the time budget {why}: {stays}{loop}"
        if self.busy:
            return (f"no depth beat the untuned model: {stays}{loop}; other processes took "
                    f"{100 * (self.others_share or 0):.0f}% of the CPUs while it was measured (a busy machine): "
                    f"tweak again on a quiet machine")
        return f"no depth beat the untuned model: {stays}{loop}"

    def _busy_outcome(self, side: dict, stays: str, loop: str) -> str:
        """outcome() for figures measured busy: the paired rounds' figure, marked busy."""
        busy = (f"measured busy: other processes took {100 * (self.others_share or 0):.0f}% of the CPUs; "
                f"{side.get('paired_rounds', 0)} paired rounds, 99% interval {side['speedup_low']:.2f}x to "
                f"{side['speedup_high']:.2f}x")
        stopped = "; the busy budget stopped the search early" if self.busy_stopped else ""
        if self.selected_depth is not None:
            return (f"kept depth {self.selected_depth}, {side['speedup']:.2f}x faster than untuned ({busy}; tweak "
                    f"again on a quiet machine for a quiet figure){stopped}{loop}")
        verdict = "slower than" if side["speedup_high"] < 1.0 else "within noise of"
        return (f"depth {side['depth']} was {verdict} the untuned model ({side['speedup']:.2f}x, {busy}): "
                f"{stays}{stopped}{loop}")

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        raise TypeError("tt.tweak tunes the model in place and returns its report, not a model: keep calling "
                        "the model itself (result = tt.tweak(model, dataset), then y = model(x)); "
                        "print(result) shows what it did")

    def plot(self, path: Any, alternatives: dict[str, float] | None = None) -> str:
        """Writes a PNG chart of latency per depth against the untuned model (and any
        `alternatives` you measured, {label: ms}) to `path`; returns the path. Needs matplotlib."""
        from ._view.plotting import plot_result

        return plot_result(self, path, alternatives)

    def __repr__(self) -> str:
        return (f"<TweakResult selected_depth={self.selected_depth} baseline_ms={self.baseline_ms} "
                f"tuned_ms={self.tuned_ms}>")


logger = logging.getLogger("torch_tweak")


def _engine_log(level: int, text: str) -> None:
    """The engine's lines: per-depth results at INFO, a depth skipped or not kept at WARNING."""
    logger.log(logging.WARNING if level else logging.INFO, text)


class _Session:
    """The engine's callbacks for one tweak: enter, activate and leave a cut; the module
    search's are ``search`` (tuning.ModuleSearch)."""

    def __init__(self, model: nn.Module, tree: ModuleTree, run_dataset, strategy: Strategy | None,
                 device: torch.device, measure: dict | None, progress: Progress, depths: list[int]) -> None:
        self.model = model
        self.tree = tree
        self.run_dataset = run_dataset
        self.strategy = strategy
        self.device = device
        self.measure = measure
        self.progress = progress
        self.depths = depths
        self.wrappers: dict[int, TunedModule] = {}
        self.entered: list[int] = []
        self.shown: set[int] = set()
        self.depth = -1
        self.measuring = False  # a depth's end-to-end measurement was announced
        self.applied = False    # the kept depth is entered again: what follows is the confirmation
        self.model_class = model_class_name(model)
        self.on_measure = None  # called with the depth before its first measurement (a workload's TTFT)
        self.refuse = ""  # why no depth can be tuned (each is then skipped with it)
        self.run_edges = None  # runs the calls at the declared shapes' ends (tt.tweak's shapes=)
        self.search = ModuleSearch(lambda node: self.wrappers[node],
                                   lambda node: strategy if strategy is not None else default_strategy(device),
                                   device, progress, self.model_class, done=self.tuned)

    def enter(self, nodes: list[int], tune: list[bool]) -> None:
        depth = max(self.tree.tree.depth(n) for n in nodes) if nodes else 0
        self.depth = depth
        self.progress.end_phase()
        if depth in self.shown:
            self.applied = True
        else:
            self.shown.add(depth)
            position = self.depths.index(depth) + 1 if depth in self.depths else len(self.depths)
            self.progress.start_depth(depth, position, len(self.depths), len(nodes), sum(tune))
        if self.refuse:
            raise RuntimeError(self.refuse)
        try:
            for node in nodes:
                wrapper = self.wrappers.get(node)
                if wrapper is None:
                    wrapper = make_wrapper(self.model, self.tree.tree.path(node))
                    self.wrappers[node] = wrapper
                install(self.model, wrapper)
                self.entered.append(node)
            fresh = [self.wrappers[n] for n, t in zip(nodes, tune) if t]
            if fresh:
                self.progress.step("", f"recording {len(fresh)} modules")
                record(fresh, self.run_dataset, self.run_edges)
        except BaseException:
            self.leave()
            raise

    def tuned(self, node: int) -> None:
        """The engine's search of this module is done (ModuleSearch.done)."""
        wrapper = self.wrappers[node]
        release(wrapper)
        chosen = wrapper.tt_backend.name if wrapper.tt_backend is not None else None
        self.progress.finish_module(wrapper.tt_name, f"chose {chosen}" if chosen else "keeps its forward")

    def activate(self) -> None:
        first = not self.applied and not self.measuring
        if first:
            self.measuring = True
            self.progress.phase(f"depth {self.depth}: measuring the whole model")
        for node in self.entered:
            self.wrappers[node].tt_activate()
        if first and self.on_measure is not None:
            self.on_measure(self.depth)

    def deactivate(self) -> None:
        """The entered cut back to the original forward, still wrapped: the untuned side of
        the engine's side-by-side confirmation."""
        if not self.measuring:
            self.measuring = True
            self.progress.phase(f"depth {self.depth}: measuring it side by side with the untuned model")
        for node in self.entered:
            self.wrappers[node].tt_deactivate()

    def leave(self) -> None:
        self.measuring = False
        self.progress.end_phase()
        for node in reversed(self.entered):
            uninstall(self.model, self.wrappers[node])
        self.entered.clear()

    def module_results(self, engine: "_C.Result", kept_depth: int | None) -> ModuleResults:
        """The engine's result per module, read into the wrappers (see tuning.absorb) and into
        the ModuleResults the user reads."""
        results = ModuleResults()
        results.kept_depth = kept_depth
        for report in engine.modules:
            node = report["node"]
            wrapper = self.wrappers[node]
            absorb(wrapper, report)
            signatures = [(g.text, g.key, g.report, g.unstorable) for g in wrapper.tt_signatures]
            results[wrapper.tt_name] = module_result(report, signatures)
        return results


def tweak(model: nn.Module, dataset: Any = None, *, workload: Any = None, min_depth: int = 0,
          max_depth: int | None = DEFAULT_MAX_DEPTH, strategy: Strategy | None = None,
          tie_tolerance: float = DEFAULT_TIE_TOLERANCE, time_budget: float | None = None, dry_run: bool = False, device: Any = None,
          progress: bool | None = None, measure: dict | None = None, cache: bool = True, effort: Effort = "default",
          precision: dict[str, float] | None = None, shapes: dict[str, tuple[int, int]] | None = None,
          group: Any = None, tolerance: float | str = "measured",
          busy_budget: float | None = DEFAULT_BUSY_BUDGET) -> TweakResult:
    """Tunes `model` in place at every depth from min_depth to max_depth and keeps the fastest.
    Returns a TweakResult, a report: keep calling the model itself, under
    torch.inference_mode() (in grad mode a backend without autograd runs the original
    forward). A model with any module in training mode is refused (ValueError) before
    anything runs: call model.eval() first.

    See the module docs and docs/tweak.md for the rules. ``measure`` overrides the
    engine's measurement settings (keys of torch_tweak._C.default_measure_config()).
    ``cache``: reuse and keep the result in the tuning cache (docs/cache.md); False neither
    reads nor writes it. ``workload``: instead of a dataset, a callable that runs the model,
    e.g. ``lambda m: m.generate(ids, max_new_tokens=64)`` (docs/generate.md); what tweak
    measures is then one run of it, and a workload is never cached. ``effort``: "default", or
    "high" to also try, on the heavy modules (the model and those taking at least 20 % of its
    time), channels-last, every SDPA kernel (CUDA), max-autotune and combo kernels (CUDA)
    (torch_tweak.backends.axes).
    ``precision``: {policy: tolerance} of lower-precision candidates you allow ("tf32",
    "bf16", "int8", "fp8"), each checked against its tolerance; None (the default): none.
    Once ``time_budget`` is used up, the variants of either not built yet are left out.
    ``shapes``: ranges the traffic's sizes take beyond the dataset's, ``{"batch": (1, 32), "length": (8, 512)}``:
    candidates are also checked at both ends; the padded backend serves them (docs/serving.md).
    ``group``: under torch.distributed (torchrun, a tensor-parallel model), the ranks that
    tune together, each its own shard, every decision taken by all of them (the slowest
    rank's latency counts; every rank keeps the same plan): None (the default) is the
    default group when one is initialised with several processes, False tunes this process
    alone, or a ProcessGroup (docs/tweak.md, "Tensor-parallel models").
    ``progress``: the progress display on stderr: None (the default) shows it, under
    torch.distributed on rank 0 alone; True shows it on this rank whatever its rank; a tweak
    that does not show it prints nothing (logging's last resort, which prints warnings where no
    handler is configured, does not print torch_tweak's during it; your handlers get them).
    ``tolerance``: how a candidate's outputs are judged against the original's (docs/tweak.md,
    "What "the same answers" means"): "measured" (the default: its error against a
    higher-precision run of the module within 4x the original's own, per output tensor; for
    generate(), greedy tokens may part only at a near-tie), "dtype" (a fixed relative tolerance
    per dtype, torch_tweak.TOLERANCES), or a number from 0 to 1 (that relative tolerance for
    every output; 0: bit-identical outputs and tokens). A backend config's own tolerance and the
    precision= policies keep theirs.
    ``busy_budget``: seconds a tweak may take once the machine is found busy (other processes
    taking more than a quarter of the CPUs while the untuned model is measured): depths not
    started by then are not tried, and the result says so (docs/tweak.md, "A busy machine");
    None: only time_budget bounds it.
    """
    rule = correctness.check_rule(tolerance)
    _check_busy_budget(busy_budget)
    ranks = distributed.resolve(group)
    if progress not in (None, True, False):
        raise TypeError(f"progress must be True, False or None (rank 0 alone under torch.distributed), not {progress!r}")
    speaks = progress if progress is not None else ranks is None or ranks.rank == 0
    with distributed.using(ranks), _silent(not speaks), _own_runs():
        device, measuring, asked, job, calls, limits = distributed.step(lambda: _checked(
            model, dataset, workload=workload, strategy=strategy, device=device, measure=measure, cache=cache,
            effort=effort, precision=precision, min_depth=min_depth, max_depth=max_depth,
            tie_tolerance=tie_tolerance, time_budget=time_budget), "checking tt.tweak's arguments")
        if ranks is not None:  # before any collective whose sequence they decide
            ranks.same_settings(dict(limits, shapes=_shapes_setting(shapes), tolerance=rule.tolerance, asked=asked,
                                     strategy=_strategy_setting(strategy, device), measure=measuring,
                                     calls=len(calls) if job is None else "a workload", cache=cache,
                                     dry_run=bool(dry_run), device=device.type), "tt.tweak")
        strategy, declared, edges = distributed.step(
            lambda: _declared(model, shapes, calls, job, strategy, device), "checking shapes=")
        # Tracing, recording and measuring run the model; anything they or a build changed is put
        # back when the tweak ends, however it ends.
        with model_state.kept(model), correctness.ruling(rule):
            result = _tweak(model, calls, job, device, measuring, asked, strategy=strategy,
                            progress=speaks, dry_run=dry_run,
                            cache=cache, limits=limits,
                            settings={"measure": measure, "effort": effort, "busy_budget": busy_budget},
                            declared=declared, edges=edges)
            if ranks is not None and not dry_run:
                _same_plan(model, ranks)
            return result


def _shapes_setting(shapes: Any) -> Any:
    """shapes= as the ranks compare it: its checked form, or as given when it is not valid (the
    step that checks it then fails on every rank)."""
    try:
        declared = check_shapes(shapes)
    except (TypeError, ValueError):
        return repr(shapes)
    return None if declared is None else declared.as_dict()


def _strategy_setting(strategy: Strategy | None, device: torch.device) -> str:
    """The strategy as the ranks compare it: its class and backends (the defaults by name: an
    optional backend installed on one host only changes the candidates)."""
    if strategy is not None:
        return repr(strategy)
    return "the defaults: " + ", ".join(b.name for b in default_backends(device))


RECOMPILES = {"recompile_limit": 64, "accumulated_recompile_limit": 1024}
"""Dynamo's recompile limits during a tweak's own runs, at least (the user's, when higher, stay):
a tweak runs the model on more call shapes than its traffic has (a generate() workload's
prefill, decode steps and checks over the whole sequence; the declared shapes' ends), and a
torch.compile inside the model (transformers' compiled forward) would otherwise meet its
limit of 8, print "torch._dynamo hit config.recompile_limit", and run eagerly from then on."""
RECOMPILE_LINE = {"torch._dynamo.convert_frame": ("torch._dynamo hit config.",)}
"""That line, dropped during a tweak's own runs should they still reach the raised limit."""


@contextlib.contextmanager
def _own_runs() -> Iterator[None]:
    """Inside a tweak: dynamo's recompile limits raised (RECOMPILES) and its limit line dropped;
    both as the user had them afterwards."""
    import torch._dynamo.config as dynamo_config

    raised = {name: max(limit, getattr(dynamo_config, name)) for name, limit in RECOMPILES.items()
              if hasattr(dynamo_config, name)}
    with dynamo_config.patch(raised), noise.dropped(RECOMPILE_LINE):
        yield


@contextlib.contextmanager
def _silent(silent: bool) -> Iterator[None]:
    """A tweak that does not speak (progress=False, or a rank other than 0 under
    torch.distributed) prints nothing: where no handler takes torch_tweak's records, logging's
    last resort would print its warnings (a depth not kept, a busy machine) on stderr, on every
    rank; a NullHandler takes them while it runs. Handlers you configured get them as always."""
    if not silent or logger.hasHandlers():
        yield
        return
    quiet = logging.NullHandler()
    logger.addHandler(quiet)
    try:
        yield
    finally:
        logger.removeHandler(quiet)


def _tweak(model: nn.Module, calls: Any, job: Workload | None, device: torch.device, measuring: dict | None,
           asked: Any, *, strategy: Strategy | None, progress: bool, dry_run: bool, cache: bool,
           limits: dict, settings: dict, declared: Any, edges: list) -> TweakResult:
    """tt.tweak once its arguments passed: the tuning cache, else the engine's search.
    limits: the depth search's settings as checked (the engine's forms)."""
    min_depth, max_depth, time_budget = limits["min_depth"], limits["max_depth"], limits["time_budget"]
    speaks_tokens = False
    if job is not None:
        job.record()
        speaks_tokens = job.generates and not dry_run
    shown = Progress(progress)
    if speaks_tokens:
        # the decode loop first: the depths are then tuned and measured under it, and a
        # loop's decode steps replay the untuned model, so module tuning serves the prefill
        _choose_loop(job, device, measuring, shown, high=bool(asked) and asked.effort == "high")
    compiled_loop = job is not None and job.loop in decode_call.COMPILED_LOOPS
    kept = GivenCalls(calls) if job is None else None
    with generation.uncompiled(model):  # hooks traced into transformers' compiled forward compile it again
        tree = ModuleTree(model, distributed.step(lambda: trace(model, calls, job.run if job is not None else None),
                                                  "running the dataset"))
    if kept is not None and kept.written(calls):
        calls = kept  # the model writes into its inputs: every later run gets the calls as they were given
    depths = tree.depths(min_depth, max_depth)
    ranks = distributed.current()
    if ranks is not None:
        ranks.same([tree.tree.path(n) for n in range(len(tree.tree))], "the modules the dataset called")
    if asked:  # the axes' variants, max-autotune for the modules that take most of the time
        strategy = (strategy if strategy is not None else default_strategy(device)).with_axes(
            dataclasses.replace(asked, heavy=axes.heavy_modules(model, tree)))
    key = parts = None
    if cache and not dry_run and job is None:
        # the settings as checked, the engine's forms, and the correctness rule
        wanted = dict(limits, measure=settings["measure"], tolerance=correctness.rule().tolerance)
        if declared:
            wanted["shapes"] = declared.as_dict()
        if asked:
            wanted.update(effort=settings["effort"], precision=[list(p) for p in asked.precision])
        if ranks is not None:  # each rank its own entry: its shard, its rank's plan
            wanted.update(ranks=[ranks.rank, ranks.size])
        key, parts = _cache_key(model, calls, device, strategy, wanted)
        if ranks is not None and not ranks.all(key is not None):
            key = parts = None  # a rank that cannot cache: none does
        if key is not None:
            result = _from_cache(model, tree, calls, device, strategy, key, parts, shown)
            if result is not None:  # plan.apply kept the strategy's shapes (DECLARED), as the entry was tuned
                arm_untuned(model)
                generation.arm(model)
                return result
    session = _session(model, tree, calls, job, strategy, device, measuring, shown, depths, dry_run=dry_run,
                       speaks_tokens=speaks_tokens, compiled_loop=compiled_loop, edges=edges)
    engine = _search(model, session, calls, job, shown, device, **limits, dry_run=dry_run, config=measuring,
                     busy_budget=settings.get("busy_budget", DEFAULT_BUSY_BUDGET))
    result = _kept(model, engine, tree, session, time_budget, dry_run, declared)
    if speaks_tokens:
        _speak_tokens(result, job)
    if key is not None:
        tuning_cache.write(key, tuning_cache.entry_of(parts, result.to_record(), result.modules, model,
                                                      result.selected_depth))
    outcome = result.outcome()
    _mark_busy(model, result)
    logger.info("tweak of %s: %s", session.model_class, outcome)
    shown.finish(outcome)
    arm_untuned(model)
    generation.arm(model)
    return result


def _check_busy_budget(busy_budget: Any) -> None:
    """busy_budget= is a number of seconds >= 0 or None (ValueError before anything runs)."""
    if busy_budget is None:
        return
    if isinstance(busy_budget, bool) or not isinstance(busy_budget, (int, float)) or not busy_budget >= 0 \
            or busy_budget == float("inf"):
        raise ValueError(f"busy_budget must be a number of seconds >= 0 or None, got {busy_budget!r} (the "
                         "model was not changed)")


def _mark_busy(model: nn.Module, result: TweakResult) -> None:
    """tt.status shows a kept figure measured on a busy machine as such (BUSY_FIGURES)."""
    if result.measurement_quality == "busy" and result.selected_depth is not None:
        BUSY_FIGURES[model] = result.outcome()
    else:
        BUSY_FIGURES.pop(model, None)


def plan_digest(model: nn.Module) -> str:
    """What the installed plan decided, as one line per tuned module: its path and, per
    signature, the backend kept (its label) or "original"; what the ranks compare."""
    lines = [f"depth {SELECTED_DEPTHS.get(model)}"]
    for planned in plan_of(model).modules:
        chosen = ", ".join(f"{g.text}: {g.backend!r}" if g.backend is not None else f"{g.text}: original"
                           for g in planned.groups)
        lines.append(f"{planned.path or '(root)'} [{chosen}]")
    return "\n".join(lines)


def _same_plan(model: nn.Module, ranks: "distributed.Ranks") -> None:
    """Every rank installed the same plan, or the model is unwrapped on every rank and the
    difference raised."""
    digests = ranks.gather(hashlib.sha256(plan_digest(model).encode()).hexdigest())
    if len(set(digests)) == 1:
        return
    mine = plan_digest(model)
    unwrap(model)
    raise RuntimeError(f"the ranks installed different plans (digests {', '.join(d[:12] for d in digests)}); "
                       f"every rank's model is untuned again. This rank ({ranks.rank}) had:\n{mine}")


def _checked(model: nn.Module, dataset: Any, *, workload: Any, strategy: Strategy | None, device: Any,
             measure: dict | None, cache: Any, effort: Any, precision: Any, min_depth: int, max_depth: int | None,
             tie_tolerance: float, time_budget: float | None) -> tuple:
    """tt.tweak's arguments checked before anything runs: (device, the measurement config, the
    axes asked for, the workload or None, the dataset's calls or None, the depth search's
    settings as the engine checked them: the one value the cache hashes and the engine gets)."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, not {type(model).__name__}")
    # the engine's rules, raised before anything runs
    limits = _C.check_tweak_config(min_depth=min_depth, max_depth=max_depth, tie_tolerance=tie_tolerance,
                                   time_budget=time_budget)
    if not isinstance(cache, bool):
        raise TypeError(f"cache must be True or False, not {cache!r}; tt.clear_cache() empties the cache")
    if strategy is not None and not isinstance(strategy, Strategy):
        raise TypeError(f"strategy must be a torch_tweak strategy (e.g. tt.FirstWinsStrategy()), "
                        f"not {type(strategy).__name__}")
    if installed(model):
        raise ValueError("the model already has torch-tweak wrappers; call tt.unwrap(model) before a new tweak")
    _refuse_training(model)
    device = resolve_device(model, device)
    default_backends(device)  # an unknown device fails here, before anything changes
    if strategy is not None:
        strategy.check_device(device)  # so does a backend this device can never run
    check_measure(measure)
    measuring = measure_for(device, measure)
    axes.check_effort(effort)
    asked = axes.Axes(effort, tuple(sorted(axes.check_precision(precision, device).items())))
    if asked:
        (strategy if strategy is not None else default_strategy(device)).with_axes(asked)  # raises when it cannot
    if workload is not None:
        if distributed.current() is not None:
            raise ValueError("a workload (generate()) is not tuned under torch.distributed yet: pass a dataset of the "
                             "model's forward calls (the same on every rank), or group=False to tune each process "
                             "alone")
        if dataset is not None:
            raise TypeError("pass a dataset or a workload, not both: a workload is a callable that runs the model, "
                            "e.g. workload=lambda m: m.generate(ids, max_new_tokens=64)")
        return device, measuring, asked, Workload(model, workload, device), None, limits
    if dataset is None:
        raise TypeError("tt.tweak needs a dataset, e.g. tt.tweak(model, [x1, x2]), or a workload, "
                        "e.g. tt.tweak(model, workload=lambda m: m.generate(ids, max_new_tokens=64))")
    calls = load_dataset(dataset, device)
    pairs = label_pairs(model, calls)
    if pairs is not None:
        raise TypeError(pairs)
    return device, measuring, asked, None, calls, limits


def _declared(model: nn.Module, shapes: Any, calls: Any, job: Workload | None, strategy: Strategy | None,
              device: torch.device) -> tuple:
    """(the strategy, given the declared shapes; the declared shapes or None; the calls at their
    ends): shapes= checked against the dataset's calls before anything runs (TypeError or
    ValueError; the model is untouched)."""
    declared = check_shapes(shapes)
    if declared is None:
        return strategy, None, []
    if job is not None:
        raise TypeError("shapes= declares the sizes of a dataset's calls; a workload (generate()) tunes its own "
                        "calls: leave shapes=None, or pass a dataset")
    check_model(declared, model)
    params = forward_params(model)
    check_calls(declared, calls, params)
    strategy = (strategy if strategy is not None else default_strategy(device)).with_shapes(declared)
    return strategy, declared, edge_calls(declared, calls, params)


def _session(model: nn.Module, tree: ModuleTree, calls: Any, job: Workload | None, strategy: Strategy | None,
             device: torch.device, measuring: dict, shown: Progress, depths: list, *, dry_run: bool,
             speaks_tokens: bool, compiled_loop: bool, edges: list = ()) -> "_Session":
    """The callbacks of one tweak's engine search, with its progress planned; edges: the calls
    at the declared shapes' ends, recorded with the dataset's."""
    run_dataset = dataset_runner(model, calls) if job is None else job.run
    session = _Session(model, tree, run_dataset, strategy, device, measuring, shown, depths)
    session.run_edges = dataset_runner(model, edges) if edges else None
    modules = {n for d in depths for n in tree.tree.cut(d)}
    shown.plan(len(modules) + len(depths) + 2)  # each module tuned once, each measurement
    if not dry_run:
        shown.phase("measuring the untuned model")
    if speaks_tokens:
        session.on_measure = job.check_depth
    if compiled_loop:
        session.refuse = (f"the decode steps run transformers' compiled forward (decode loop \"{job.loop}\"), "
                          "which must see the model's own modules to give the untuned tokens")
    elif speaks_tokens:
        session.refuse = depths_cannot_match(job)
    return session


def _cache_key(model: nn.Module, calls: Any, device: torch.device, strategy: Strategy | None,
               settings: dict) -> tuple[str | None, dict | None]:
    """(the tuning cache's key, its parts), or (None, None) when a backend config has no JSON form."""
    try:
        parts = tuning_cache.key_parts(model, calls, device, strategy, settings)
        return tuning_cache.key_of(parts), parts
    except (Unstorable, ValueError, TypeError) as exc:
        logger.info("not cached: a backend config has no JSON form (%s)", exc)
        return None, None


def _search(model: nn.Module, session: "_Session", calls: Any, job: Workload | None, shown: Progress,
            device: torch.device, **limits: Any) -> Any:
    """The engine's depth search (_C.tweak) over the session's callbacks; on any failure the
    model is unwrapped (as it was, the decode loop too) and the error raised."""

    def run(i: int) -> None:
        args, kwargs = calls[i]
        model(*args, **kwargs)

    limits["dry_run"] = bool(limits["dry_run"])
    hooks = dict(enter=session.enter, activate=session.activate, leave=session.leave,
                 deactivate=session.deactivate, run=run if job is None else lambda i: job.run(),
                 sync=synchronizer(device), load=cpu_load.reading)
    ranks = distributed.current()
    if ranks is not None:
        hooks = _together(ranks, session, hooks)
    try:
        with torch.no_grad():
            return _C.tweak(session.tree.tree, modules=session.search, log=_engine_log,
                            n_samples=len(calls) if job is None else 1, **hooks, **limits)
    except BaseException:
        unwrap(model)  # whatever happened, the model is as it was (the decode loop too)
        raise
    finally:
        shown.close()


def _together(ranks: "distributed.Ranks", session: "_Session", hooks: dict) -> dict:
    """The engine's callbacks when the ranks tune together (torch_tweak._core.distributed): each
    step agreed on by every rank, the timed calls' failures agreed at the sync that follows
    them, the ranks' clock and load; the module search's likewise (Ranks.agreeing)."""
    ranks.agreeing(session.search, session.tree.tree.path)

    def agreed(name: str, what: str) -> Any:
        fn = hooks[name]
        return lambda *args: ranks.step(lambda: fn(*args), what)

    return dict(hooks, enter=agreed("enter", "entering a cut"), activate=agreed("activate", "activating a cut"),
                leave=agreed("leave", "leaving a cut"), deactivate=agreed("deactivate", "deactivating a cut"),
                run=ranks.deferred(hooks["run"]), sync=ranks.sync_with(hooks["sync"]), load=ranks.load,
                clock=ranks.clock)


def _kept(model: nn.Module, engine: Any, tree: ModuleTree, session: "_Session", time_budget: float | None,
          dry_run: bool, declared: Any = None) -> "TweakResult":
    """The result of the engine's search; the wrappers of the cuts not kept release their calls;
    a kept depth keeps the declared shapes (tt.save writes them, tt.status shows them)."""
    selected = engine.selected
    kept_depth = engine.rows[selected]["depth"] if selected >= 0 else None
    result = TweakResult(engine, tree, session.module_results(engine, kept_depth))
    result.time_budget = time_budget
    result.refused = session.refuse
    result._model = weakref.ref(model)
    if not dry_run:
        DECLARED.pop(model, None)
        if declared is not None and result.selected_depth is not None:
            DECLARED[model] = declared
    kept = installed(model)
    for wrapper in session.wrappers.values():
        if kept.get(wrapper.tt_name) is not wrapper:
            release(wrapper, keep_chosen=False)  # only the kept cut's calls are worth saving
    if not dry_run:
        SELECTED_DEPTHS[model] = result.selected_depth
        correctness.RULES[model] = correctness.rule()
    return result


def _refuse_training(model: nn.Module) -> None:
    """Train mode stops a tweak before anything runs: dropout and batch norm make every
    output differ from the recorded one, so every backend would fail its check (and batch
    norm's statistics would move). The model is not touched."""
    training = [name for name, module in model.named_modules() if module.training]
    if not training:
        return
    which = "the model is" if training[0] == "" else f"module {training[0]!r} of the model is"
    raise ValueError(f"{which} in training mode: tweak tunes for inference, and dropout and batch norm in "
                     "training mode change every output, so no backend could pass the correctness check; "
                     "call model.eval() before tt.tweak (the model was not changed)")


def _choose_loop(job: Workload, device: torch.device, measure: dict | None, shown: Progress, *,
                 high: bool = False) -> None:
    """A generate() workload: tweak's decode loops tried on the untuned model (with `high`,
    effort="high", also the ones that cost a compile of their own); the kept one stays
    installed (tt.unwrap takes it out)."""
    with torch.no_grad():
        job.measure_ttft("untuned")
    shown.phase("generate(): trying tweak's decode loops on the untuned model")
    try:
        job.loop, job.loop_report = choose_loop(job, device, measure, high=high)
    finally:
        shown.end_phase()
    if job.loop is not None:
        with torch.no_grad():
            job.measure_ttft("loop")
        logger.info("generate(): tweak's decode loop (%s) kept", job.loop)


def _speak_tokens(result: TweakResult, job: Workload) -> None:
    """The result's rows in tokens per second and time to first token (_token_rows)."""
    result.tokens = _token_rows(result, job)
    result.tokens_per_run = job.tokens
    result.decode_loop = job.loop
    result.loop_report = job.loop_report
    result.numerics = {r["candidate"]: r["numerics"] for r in job.loop_report if r.get("numerics")}
    result.numerics.update((f"depth {d}", found) for d, found in job.numerics.items())
    result.hint = job.hint
    logger.info("generate(): kept %s", next(r.label for r in result.tokens if r.kept))


def _token_rows(result: TweakResult, job: Workload) -> list[TokenRow]:
    """One row per configuration measured or refused: transformers' loop and each decode loop
    tried (choose_loop's measurement), then each depth under the loop kept (the depth
    search's); one is the configuration kept, every other says why it was not."""
    chosen = next((r for r in job.loop_report if r.get("kept")), None)
    on = "" if chosen is None or chosen["candidate"] == "generate" else f" + {chosen['candidate']}"
    depth = result.selected_depth
    kept_label = f"untuned{on}" if depth is None else f"depth {depth}{on}"
    winner = "untuned" if chosen is None or chosen["candidate"] == "generate" else f"untuned + {chosen['candidate']}"
    rows = []
    for report in job.loop_report:
        name = report["candidate"]
        label = "untuned" if name == "generate" else f"untuned + {name}"
        if label == kept_label:
            status = "kept" + _busy_note(result)
        elif report is chosen:
            status = f"its loop kept, with depth {depth} (below)" if on else f"depth {depth} kept over it (below)"
        elif report["state"] == "measured":
            status = f"slower than {winner}"
        else:
            status = f"{'refused' if report['state'] == 'failed' else report['state']}: {fold(report['error'], 90)}"
        ttft = job.ttft.get("untuned" if name == "generate" else "loop" if report is chosen else None)
        latency = report["latency_ms"]
        rows.append(TokenRow(label, latency, job.tokens_per_s(latency), ttft, label == kept_label, status))
    for row in result.rows:
        if row.latency_ms is None and not row.error:
            continue  # a dry run's or a cut not tried: nothing to say
        status = ("kept" + _busy_note(result) if row.selected else
                  f"refused: {fold(row.error, 90)}" if row.latency_ms is None else _depth_not_kept(result, row, on))
        rows.append(TokenRow(f"depth {row.depth}{on}", row.latency_ms, job.tokens_per_s(row.latency_ms),
                             job.ttft.get(row.depth), row.selected, status))
    return rows


def _busy_note(result: TweakResult) -> str:
    share = result.others_share or 0
    return (f" (measured on a busy machine: other processes took {100 * share:.0f}% of the CPUs)"
            if result.measurement_quality == "busy" else "")


def _depth_not_kept(result: TweakResult, row: DepthResult, on: str) -> str:
    """Why a depth that was measured is not the one kept (its row of the generate() table)."""
    side = result.confirmation
    if side is not None and side["depth"] == row.depth:
        if result.measurement_quality == "busy":
            return (f"not kept: the machine was busy (other processes took {100 * (result.others_share or 0):.0f}% "
                    f"of the CPUs): a depth must be {side.get('busy_keep', 0.0):.2f}x faster at its spread's low "
                    f"end, it was {side['speedup_low']:.2f}x")
        verdict = "slower than" if side["speedup_high"] < 1.0 else "within noise of"
        return f"not kept: {verdict} untuned{on} side by side ({side['speedup']:.2f}x)"
    kept = next((r for r in result.rows if r.selected), None)
    if kept is not None and kept.latency_ms is not None:
        if row.latency_ms is not None and row.latency_ms < kept.latency_ms:
            return f"not kept: within the tie tolerance of depth {kept.depth}{on}, the shallower is kept"
        return f"slower than depth {kept.depth}{on}"
    if side is not None:
        return f"slower than depth {side['depth']}{on}, itself not kept"
    return f"slower than untuned{on}" + (f" ({fold(row.error, 60)})" if row.error else "")


def _from_cache(model: nn.Module, tree: ModuleTree, calls: list, device: torch.device, strategy: Strategy | None,
                key: str, parts: dict, shown: Progress) -> TweakResult | None:
    """The cached result, its backends built again and active; None on a miss (or a
    rebuild that fails, whose entry is dropped)."""
    entry = tuning_cache.read(key, parts)
    ranks = distributed.current()
    if ranks is not None and not ranks.all(entry is not None):
        return None  # a hit on some ranks only: every rank tunes afresh
    if entry is None:
        return None
    shown.line(f"tuning cache hit {key}: building the cached choices again, no measurement")
    try:
        result = TweakResult.from_record(entry["result"], tree, tuning_cache.module_results(entry),
                                         entry.get("created"))
    except Exception:  # an entry of another shape is a miss like any other
        result = None
    whole = result is not None if ranks is None else ranks.all(result is not None)
    if not whole:
        failure = "the entry is damaged" if result is None else "another rank's entry is damaged"
    else:
        failure = tuning_cache.apply(entry, model, calls, device, strategy)
    if ranks is not None and not ranks.all(failure is None) and failure is None:
        unwrap(model)  # another rank could not apply its entry: none keeps its own
        failure = "another rank's entry could not be applied"
    if failure is not None:
        logger.warning("tuning cache entry %s dropped (%s); tuning afresh", key, failure)
        tuning_cache.drop(key)
        return None
    result._model = weakref.ref(model)
    _mark_busy(model, result)
    shown.finish(f"{result.outcome()} {result.cache_note()}")
    logger.info("tweak: %s %s", result.outcome(), result.cache_note())
    return result
