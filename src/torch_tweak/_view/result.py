"""What tt.tweak returns and shows: a TweakResult (its table, its one-line outcome, its
record in the tuning cache) with a DepthResult per row, and a generate() workload's table in
tokens per second, one row per configuration measured or refused."""

from __future__ import annotations

import dataclasses
import logging
import weakref
from typing import Any

from torch import nn

from .._core import settings
from .. import _C
from .._core.storage import printable
from .._runtime.inspecting import ModuleTree
from .._runtime.workload import TokenRow, Workload
from .report import ModuleResults, cache_note, fold
from .status import status

logger = logging.getLogger("torch_tweak")


@dataclasses.dataclass(frozen=True)
class DepthResult:
    """One row of a tweak: a depth, or the untuned model (depth None). latency_ms and speedup
    are the depth search's (speedup: the search's untuned latency over this row's, the table's
    "search" column); confirmed: on the row of the depth measured against the untuned model side
    by side (or in paired rounds on a busy machine), the figure that decided whether it is kept
    (confirmation["speedup"], the table's "confirmed" column; result.speedup when kept), else None."""

    depth: int | None
    modules: int
    failed: int
    latency_ms: float | None
    speedup: float | None
    error: str
    selected: bool
    confirmed: float | None = None


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
    "agreed", "others_share", "paired_rounds", "paired_wins", "busy_budget_wanted",
    "time_budget_wanted", "rounds_ran_out", "figure"}, or None when no depth beat the untuned
    model in the search;
    "figure" is "speedup" as the table writes it, "busy_budget_wanted" the busy_budget that buys
    the paired rounds a busy verdict lacked for time (else 0).
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
    rows: a DepthResult per depth (the depth search's figures, and on the row of the depth
    measured against the untuned model the confirmed figure: the table's "search" and
    "confirmed" columns); untuned: the DepthResult of the untuned model (the search's).
    modules: a ModuleResult per tuned module, by path; ``print(result.modules)`` shows, per
    module and input signature, every candidate backend's latency or why it lost.
    kept: True when a depth or a decode loop was kept; False: nothing kept, nothing to save.
    cached: True when the result came from the tuning cache (no depth was measured again);
    measured_at: then, when its figures were measured (UTC, ISO 8601), else None.
    tokens: for a workload that calls generate(), a TokenRow (tokens per second, time to
    first token, the moment its figures come from) for the untuned model, each loop, each depth
    and the kept configuration; else None.
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
        side = self.confirmation
        rows = []
        for i, row in enumerate(engine.rows):
            stats = row["stats"]
            latency = None if stats is None else stats["median_ns"] / 1e6
            speedup = None if latency is None or self.baseline_ms is None or latency <= 0 else self.baseline_ms / latency
            confirmed = side["speedup"] if side is not None and side["depth"] == row["depth"] and latency else None
            rows.append(DepthResult(row["depth"], row["modules"], row["failed"], latency, speedup,
                                    row["error"], i == chosen, confirmed))
        self.rows = rows
        self.selected_depth = rows[chosen].depth if chosen >= 0 else None
        self.untuned = DepthResult(None, 0, 0, self.baseline_ms, None if base is None else 1.0, "", chosen < 0)
        self.tuned_ms = rows[chosen].latency_ms if chosen >= 0 else self.baseline_ms
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
        # the engine knows depths only: with a decode loop kept, what stays untuned is the modules
        table = self._engine.format(untuned=untuned_words(self.decode_loop))
        lines = self.precision_lines()
        if self.cached:  # the figures above are the first tweak's, with their time; the lines below, now's
            lines.append(self.cache_note())
        lines += self.shapes_lines()
        return table + "".join("\n" + line for line in lines) + tokens_table(self)

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
        """What a result from the tuning cache says about its figures (report.cache_note)."""
        return cache_note(self.measured_at)

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
        text = self._engine.outcome(untuned=untuned_words(self.decode_loop))
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
    """The generate() table: tokens per second and time to first token per configuration, and
    the moment each row's figures come from (the one its status speaks of)."""
    if not self.tokens:
        return ""
    width = max(len(r.label) for r in self.tokens)
    moment = max([len("measured")] + [len(r.measured) for r in self.tokens])
    lines = ["", f"generate(): {self.tokens_per_run} new tokens per run of the workload",
             f"  {'configuration':<{width}}  {'tokens/s':>10}  {'first token ms':>14}  {'measured':<{moment}}  status"]
    for r in self.tokens:
        rate = "-" if r.tokens_per_s is None else f"{r.tokens_per_s:,.1f}"
        ttft = "-" if r.ttft_ms is None else f"{r.ttft_ms:.3f}"
        lines.append(f"{'*' if r.kept else ' '} {r.label:<{width}}  {rate:>10}  {ttft:>14}  "
                     f"{r.measured or '-':<{moment}}  {r.status}".rstrip())
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
    """The result as plain JSON (what the tuning cache keeps): the engine's numbers, in the forms
    its getters give (_C.restore_result builds the result again from them, checked), and the
    quality they gave. No text: the table and the outcome are written again from the numbers."""
    engine = self._engine
    return {"rows": engine.rows, "selected": engine.selected, "baseline": engine.baseline,
            "confirmation": engine.confirmation, "others_share": engine.others_share,
            "busy_stopped": engine.busy_stopped, "budgets": engine.budgets, "quality": engine.quality}




def from_record(record: dict, tree: ModuleTree, modules: ModuleResults, measured_at: str | None = None) -> TweakResult:
    """The result a cache entry recorded, marked cached; measured_at: the entry's time. The
    engine builds it again from the entry's numbers, checked (_C.restore_result: TypeError or
    ValueError for numbers no tweak gives), so its table and outcome say only what the numbers
    do; a row's error, text from the file, is made printable first."""
    if type(record) is not dict or type(record.get("rows")) is not list:
        raise TypeError("a cache entry's result is a dict with its rows")
    rows = [dict(row, error=_row_error(row.get("error"))) if type(row) is dict else row for row in record["rows"]]
    self = TweakResult(_C.restore_result(dict(record, rows=rows)), tree, modules)
    if self.measurement_quality != record.get("quality"):
        raise ValueError(f"a cache entry's quality ({printable(str(record.get('quality')))[:20]}) is not the one "
                         f"its figures give ({self.measurement_quality})")
    self.cached = True
    self.measured_at = measured_at if isinstance(measured_at, str) else None
    modules.measured_at = self.measured_at  # its latencies are the first tweak's too: print(result.modules) says so
    modules.cached = True
    return self


def _row_error(error: Any) -> Any:
    if type(error) is not str:
        return error  # refused by restore_result
    return printable(error).encode("utf-8")[:settings.ROW_ERROR_BYTES].decode("utf-8", "ignore")


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
    tried (choose_loop's measurement), then each depth under the loop kept (the depth search's,
    or for the depth measured against the untuned model, that measurement's: the figure its
    verdict used); one is the configuration kept, every other says why it was not."""
    chosen = next((r for r in job.loop_report if r.get("kept")), None)
    on = "" if chosen is None or chosen["candidate"] == "generate" else f" + {chosen['candidate']}"
    depth = result.selected_depth
    kept_label = f"untuned{on}" if depth is None else f"depth {depth}{on}"
    rows = [_loop_row(result, job, report, chosen, on, kept_label) for report in job.loop_report]
    for row in result.rows:
        if row.latency_ms is None and not row.error:
            continue  # a dry run's or a cut not tried: nothing to say
        rows.append(_depth_row(result, job, row, on))
    return rows


def _loop_row(result: TweakResult, job: Workload, report: dict, chosen: dict | None, on: str,
              kept_label: str) -> TokenRow:
    """A loop's row: transformers' own or a decode loop tweak tried, with choose_loop's figure."""
    name = report["candidate"]
    label = "untuned" if name == "generate" else f"untuned + {name}"
    winner = "untuned" if chosen is None or chosen["candidate"] == "generate" else f"untuned + {chosen['candidate']}"
    depth = result.selected_depth
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
    return TokenRow(label, latency, job.tokens_per_s(latency), ttft, label == kept_label, status,
                    "" if latency is None else "loop choice")


def _depth_row(result: TweakResult, job: Workload, row: DepthResult, on: str) -> TokenRow:
    """A depth's row under the loop kept: the figure and the moment its verdict used (the
    measurement against the untuned model for the depth it confirmed, else the depth search's)."""
    side = result.confirmation
    label = f"depth {row.depth}{on}"
    if row.latency_ms is None:
        return TokenRow(label, None, None, job.ttft.get(row.depth), False, f"refused: {fold(row.error, 90)}")
    latency, measured = row.latency_ms, "depth search"
    if side is not None and side["depth"] == row.depth and not side.get("from_search") and side.get("tuned"):
        latency = side["tuned"]["median_ns"] / 1e6
        measured = "paired rounds, busy" if result.measurement_quality == "busy" else "side by side"
    if row.selected and side is not None and side["depth"] == row.depth:
        how = "in paired rounds" if result.measurement_quality == "busy" else \
            "by the search's figure" if side.get("from_search") else "side by side"
        status = f"kept: {confirmed_figure(side)} faster than untuned{on} {how}{_there(side, job)}" + \
            _busy_note(result)
    elif row.selected:
        status = "kept" + _busy_note(result)
    else:
        status = _depth_not_kept(result, row, on, job)
    return TokenRow(label, latency, job.tokens_per_s(latency), job.ttft.get(row.depth), row.selected, status,
                    measured)


def _there(side: dict, job: Workload) -> str:
    """The untuned configuration's tokens per second in the measurement that confirmed a depth,
    for the depth's row: " (N tokens/s there)", or "" when it is not known."""
    rate = job.tokens_per_s(side["untuned"]["median_ns"] / 1e6) if side.get("untuned") else None
    return "" if rate is None or side.get("from_search") else f" ({rate:,.1f} tokens/s there)"


def confirmed_figure(side: dict) -> str:
    """The confirmation's figure as the engine's table and last line write it ("1.54x"; a busy
    keep just above 1 with the digit that shows it, "1.003x"): the binding's "figure"."""
    return side.get("figure") or f"{side['speedup']:.2f}x"


def _busy_note(result: TweakResult) -> str:
    share = result.others_share or 0
    return (f" (measured on a busy machine: other processes took {100 * share:.0f}% of the CPUs)"
            if result.measurement_quality == "busy" else "")


def _depth_not_kept(result: TweakResult, row: DepthResult, on: str, job: Workload) -> str:
    """Why a depth that was measured is not the one kept (its row of the generate() table); a
    comparison with another depth names the depth search's figure it was made on."""
    side = result.confirmation
    if side is not None and side["depth"] == row.depth:
        if result.measurement_quality == "busy":
            return (f"not kept: the machine was busy (other processes took {100 * (result.others_share or 0):.0f}% "
                    f"of the CPUs): its paired rounds put it at {confirmed_figure(side)}, 99% interval "
                    f"{side['speedup_low']:.2f}x to {side['speedup_high']:.2f}x{_there(side, job)}")
        verdict = "slower than" if side["speedup_high"] < 1.0 else "within noise of"
        how = "by the search's figure" if side.get("from_search") else "side by side"
        return f"not kept: {verdict} untuned{on} {how} ({confirmed_figure(side)}){_there(side, job)}"
    kept = next((r for r in result.rows if r.selected), None)
    other = kept if kept is not None and kept.latency_ms is not None else None
    if other is None and side is not None:
        other = next((r for r in result.rows if r.depth == side["depth"] and r.latency_ms is not None), None)
    if other is not None:
        rate = job.tokens_per_s(other.latency_ms)
        there = f"depth {other.depth}{on} in the depth search" + ("" if rate is None else f" ({rate:,.1f} tokens/s there)")
        if kept is not None and row.latency_ms is not None and row.latency_ms < kept.latency_ms:
            return f"not kept: within the tie tolerance of {there}, the shallower is kept"
        return f"slower than {there}" + ("" if kept is not None else ", itself not kept")
    return f"slower than untuned{on}" + (f" ({fold(row.error, 60)})" if row.error else "")
