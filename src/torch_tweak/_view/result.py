"""What tt.tweak returns and shows: a TweakResult (its table, its one-line outcome, its
record in the tuning cache) with a DepthResult per row, and a generate() workload's table in
tokens per second, one row per configuration measured or refused."""

from __future__ import annotations

import dataclasses
import datetime
import logging
import weakref
from typing import Any

from torch import nn

from .. import _C
from .._runtime.inspecting import ModuleTree
from .._runtime.workload import TokenRow, Workload
from .report import ModuleResults, fold
from .status import status

logger = logging.getLogger("torch_tweak")


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
    decode_loop: the decode loop kept behind generate() (torch_tweak._runtime.decode.loop.LOOPS), or None;
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
            table = self._engine.format(untuned=untuned_words(self.decode_loop))
            lines = self.precision_lines() + self.shapes_lines()
            return table + "".join("\n" + line for line in lines) + \
                tokens_table(self)
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
        when = measured_when(self.measured_at)
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

    def to_record(self) -> dict:
        """The result as plain JSON (what the tuning cache keeps): record_of."""
        return record_of(self)

    @classmethod
    def from_record(cls, record: dict, tree: ModuleTree, modules: ModuleResults,
                    measured_at: str | None = None) -> "TweakResult":
        """The result a cache entry recorded, marked cached (from_record)."""
        return from_record(record, tree, modules, measured_at)

    def outcome(self) -> str:
        """One line: what the tweak kept and by how much (or why nothing was), then the notes on
        the machine, joined by "; ": the engine's words, the lines that end the table (a cache
        entry keeps them), with the decode loop kept behind generate() named."""
        text = self._outcome if self.cached else self._engine.outcome(untuned=untuned_words(self.decode_loop))
        lines = [line for line in text.splitlines() if line]
        if self.decode_loop and self.selected_depth is not None and lines:
            lines[0] += f"; generate() runs tweak's decode loop ({self.decode_loop})"
        return "; ".join(lines)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        raise TypeError("tt.tweak tunes the model in place and returns its report, not a model: keep calling "
                        "the model itself (result = tt.tweak(model, dataset), then y = model(x)); "
                        "print(result) shows what it did")

    def plot(self, path: Any, alternatives: dict[str, float] | None = None) -> str:
        """Writes a PNG chart of latency per depth against the untuned model (and any
        `alternatives` you measured, {label: ms}) to `path`; returns the path. Needs matplotlib."""
        from .plotting import plot_result

        return plot_result(self, path, alternatives)

    def __repr__(self) -> str:
        return (f"<TweakResult selected_depth={self.selected_depth} baseline_ms={self.baseline_ms} "
                f"tuned_ms={self.tuned_ms}>")


def tokens_table(self: TweakResult) -> str:
    """The generate() table: tokens per second and time to first token per configuration."""
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


def untuned_words(decode_loop: str | None) -> str | None:
    """What stays untuned when no depth is kept, for the engine's last line (None: the model)."""
    if not decode_loop:
        return None
    return f"its modules stay untuned; generate() runs tweak's decode loop ({decode_loop})"


def record_of(self: TweakResult) -> dict:
    """The result as plain JSON (what the tuning cache keeps)."""
    return {"rows": [dataclasses.asdict(r) for r in self.rows], "baseline_ms": self.baseline_ms,
            "tuned_ms": self.tuned_ms, "search_baseline_ms": self.untuned.latency_ms,
            "confirmation": self.confirmation, "quality": self.measurement_quality, "noisy": self.noisy,
            "others_share": self.others_share, "busy": self.busy, "busy_stopped": self.busy_stopped,
            "table": str(self), "outcome": self._engine.outcome(untuned=untuned_words(self.decode_loop))}

def from_record(record: dict, tree: ModuleTree, modules: ModuleResults, measured_at: str | None = None) -> TweakResult:
    """The result a cache entry recorded, marked cached; measured_at: the entry's time."""
    self = object.__new__(TweakResult)
    self._engine = None
    self._table = record["table"]
    self._outcome = record["outcome"]
    if not isinstance(self._outcome, str):
        raise TypeError(f"a cache entry's outcome is {type(self._outcome).__name__}, not text")
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


def speak_tokens(result: TweakResult, job: Workload) -> None:
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
                    f"of the CPUs): its paired rounds put it at {side['speedup']:.2f}x, 99% interval "
                    f"{side['speedup_low']:.2f}x to {side['speedup_high']:.2f}x")
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


def measured_when(created: Any) -> str:
    """An entry's "created" as a reader wants it: "on 2026-12-02 at 21:51 UTC (3 hours ago)"."""
    try:
        then = datetime.datetime.fromisoformat(created)
        if then.tzinfo is None:
            raise ValueError("no time zone")
    except (TypeError, ValueError):
        return "at a time the entry does not say"
    then = then.astimezone(datetime.timezone.utc)
    seconds = (datetime.datetime.now(datetime.timezone.utc) - then).total_seconds()
    ago = ("just now" if seconds < 60 else f"{seconds / 60:.0f} minutes ago" if seconds < 5400
           else f"{seconds / 3600:.0f} hours ago" if seconds < 2 * 86400 else f"{seconds / 86400:.0f} days ago")
    return f"on {then:%Y-%m-%d} at {then:%H:%M} UTC ({ago})"
