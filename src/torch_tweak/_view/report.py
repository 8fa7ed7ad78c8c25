"""Why a backend won or lost: per module and signature, every candidate's latency or error.

``print(result.modules)`` after a tweak prints one table; ``print(result.modules[path])``
prints the rows of one module.
"""

from __future__ import annotations

import dataclasses
import datetime
from typing import Any


@dataclasses.dataclass(frozen=True)
class SignatureResult:
    """One input signature of a module: the backend chosen for it and every candidate.

    candidates: one dict per candidate backend: "backend", "state" ("measured", "built",
    "failed", "not tried"), "latency_ms" (None unless measured), "error", "reason" ("",
    "unavailable", "build failed", "crashed", "dynamic shapes", "mismatch", "out of memory",
    "time budget": a variant of effort= or precision= not built because tt.tweak's time_budget
    was used up first), "max_error" (the correctness check's error that used most of its bound,
    or None), "tolerance" (the bound it was held to), "own_error" (under the measured rule, the
    original's own error by the same measure: max_error / own_error is the candidate's error
    as a multiple of the original's; None under a fixed tolerance), "lowers_precision" (its
    config lowers precision: BackendConfig.lowers_precision), and where the measured rule is in
    force but the signature had no higher-precision reference, "rule" (the rule that judged it
    instead and why: "the fixed rule: no higher-precision reference (...)").
    unstorable: recorded calls the chosen backend cannot store; they compile on first call.
    """

    text: str
    key: str
    backend: str | None
    error: str
    candidates: tuple[dict, ...]
    unstorable: int = 0


@dataclasses.dataclass(frozen=True)
class ModuleResult:
    """What tuning did to one module: per signature, the backend chosen and every candidate.

    backend: the chosen backend's name (names joined by ", " when signatures differ), or None.
    candidates: every signature's candidate dicts, each with its "signature" text.
    depths: the depths whose cut holds this module (a tweak's); kept: the model runs it now
    (its depth was kept). A module of a depth not kept had a fastest backend, not a chosen one.
    """

    path: str
    backend: str | None
    error: str
    candidates: tuple[dict, ...]
    signatures: tuple[SignatureResult, ...] = ()
    depths: tuple[int, ...] = ()
    kept: bool = True

    def rows(self) -> list[list[str]]:
        """The table rows, every result folded to one line."""
        rows = []
        for s in self.signatures:
            for i, c in enumerate(s.candidates):
                text = status(c, c["backend"] == s.backend, s.unstorable)
                if not self.kept and c["backend"] == s.backend:
                    text = text.replace("chosen", "fastest here; its depth was not kept", 1)
                rows.append([self.path or "(root)" if not rows else "", s.text if i == 0 else "",
                             c["backend"], "-" if c["latency_ms"] is None else f"{c['latency_ms']:.3f}",
                             fold(text)])
            if not s.candidates:
                rows.append([self.path or "(root)" if not rows else "", s.text, "-", "-", fold(s.error)])
        return rows

    def errors(self) -> list[str]:
        """Every candidate's error in full, one entry per candidate that has one."""
        found = []
        for s in self.signatures:
            for c in s.candidates:
                if c["error"]:
                    found.append(f"{c['backend']} {s.text}:\n  " + c["error"].strip().replace("\n", "\n  "))
            if not s.candidates and s.error:
                found.append(f"{s.text}:\n  " + s.error.strip().replace("\n", "\n  "))
        return found

    def rules(self) -> list[str]:
        """Per signature judged by another rule than the measured one in force, which and why."""
        found = []
        for s in self.signatures:
            rule = next((c["rule"] for c in s.candidates if c.get("rule")), "")
            if rule:
                found.append(f"{s.text}: judged by {rule}")
        return found

    def __str__(self) -> str:
        """The module's table, then every error in full, then the rule of each signature that
        was not judged by the measured rule."""
        text = table([HEADER] + self.rows())
        errors, rules = self.errors(), self.rules()
        text += "\n\nerrors in full:\n" + "\n".join(errors) if errors else ""
        return text + ("\n\ncorrectness:\n" + "\n".join(rules) if rules else "")


def candidates_of(group: dict) -> list[dict]:
    """The candidate dicts of one signature group of the engine's result (a ``_C`` module
    report's group, whose candidates carry their builds' facts: reason, max_error, tolerance,
    lowers_precision), in the form SignatureResult.candidates documents."""
    found = []
    for candidate in group["candidates"]:
        stats = candidate["stats"]
        found.append({"backend": candidate["name"], "state": candidate["state"],
                      "latency_ms": None if stats is None else stats["median_ns"] / 1e6,
                      "error": candidate["error"], "reason": candidate["reason"],
                      "max_error": candidate["max_error"], "tolerance": candidate["tolerance"],
                      "own_error": candidate.get("own_error"),
                      "lowers_precision": candidate["lowers_precision"]})
    return found


def module_result(report: dict, signatures: list[tuple[str, str, list[dict], int]]) -> ModuleResult:
    """The ModuleResult of one module of the engine's result (a ``_C.Result.modules`` entry).
    signatures: per group, what only Python knows: (text, key, candidate dicts from
    candidates_of, unstorable count)."""
    groups = []
    for found, (text, key, candidates, unstorable) in zip(report["groups"], signatures):
        chosen = found["chosen"]
        groups.append(SignatureResult(text, key, candidates[chosen]["backend"] if chosen >= 0 else None,
                                      found["error"], tuple(candidates), unstorable))
    names = list(dict.fromkeys(s.backend for s in groups if s.backend is not None))
    return ModuleResult(report["path"], ", ".join(names) or None, report["error"],
                        tuple(dict(c, signature=s.text) for s in groups for c in s.candidates), tuple(groups),
                        tuple(report.get("depths", ())), bool(report.get("kept", True)))


def numerics(candidate: dict) -> str:
    """A candidate's error as a user reads it: "1.3x the original's error" under the measured
    rule, "relative error 0.004" under a fixed tolerance (with the rule and why where the
    measured rule was in force but had no reference); "" when not known."""
    error, own = candidate.get("max_error"), candidate.get("own_error")
    if error is None:
        return ""
    if own is None:
        rule = candidate.get("rule")
        return f"relative error {error:.2g}" + (f", by {rule}" if rule else "")
    if own > 0:
        return f"{error / own:.2g}x the original's error"
    return "exact, as the original" if error == 0 else f"error {error:.2g} where the original is exact"


def status(candidate: dict, chosen: bool, unstorable: int) -> str:
    shown = numerics(candidate)
    if chosen:
        notes = [f"{unstorable} recorded calls not storable: compiles on first call"] if unstorable else []
        if shown:
            notes.append(shown)
        return "chosen" + (f" ({'; '.join(notes)})" if notes else "")
    if candidate["state"] == "measured":
        return "slower" + (f" ({shown})" if shown else "")
    if candidate["state"] == "not tried":
        return "not tried"
    reason = candidate.get("reason", "")
    error = candidate["error"]
    if reason == "mismatch" and candidate.get("max_error") is not None:
        if candidate.get("own_error") is not None and candidate["own_error"] > 0:
            allowed = candidate["tolerance"] / candidate["own_error"]
            return f"failed the correctness check: {shown}, more than the {allowed:.2g}x allowed"
        return f"failed the correctness check: error {candidate['max_error']:.3g} > {candidate['tolerance']:.3g}"
    if reason == "dynamic shapes":
        return "rejected for dynamic shapes: " + error.split(": ", 1)[-1].removeprefix("dynamic shapes: ")
    if reason == "unavailable":
        return error.removeprefix("BackendUnavailable: ")
    if reason == "crashed":
        return error.removeprefix("BuildCrashed: ")
    if reason == "build failed":
        return f"failed to build: {error}"
    if reason == "out of memory":
        return f"ran out of device memory: {error}"
    if reason == "time budget":
        return "not built: the time budget was used up first"
    return error or candidate["state"]


def fold(text: str, width: int = 100) -> str:
    """`text` on one line for a table: its first line, cut at a word before `width`."""
    line = " ".join(text.split("\n", 1)[0].split())
    if len(text.strip()) > len(line) or len(line) > width:
        cut = line[:width - 4].rsplit(" ", 1)[0] if len(line) > width - 4 else line
        return cut + " ..."
    return line


HEADER = ["module", "signature", "backend", "latency ms", "result"]


def table(rows: list[list[str]]) -> str:
    widths = [max(len(r[i]) for r in rows) for i in range(len(HEADER) - 1)]
    lines = []
    for r in rows:
        cells = [r[0].ljust(widths[0]), r[1].ljust(widths[1]), r[2].ljust(widths[2]), r[3].rjust(widths[3]), r[4]]
        lines.append("  ".join(cells).rstrip())
    return "\n".join(lines)


class ModuleResults(dict):
    """{path: ModuleResult}; ``str()`` is one table of every module, signature and candidate,
    grouped by depth with the kept depth marked (kept_depth: None when none was kept); from the
    tuning cache (cached), it ends with when its figures were measured (measured_at)."""

    kept_depth: int | None = None
    cached = False
    measured_at: str | None = None

    def __str__(self) -> str:
        rows = [HEADER]
        depths = sorted({d for r in self.values() for d in r.depths})
        for depth in depths:
            rows.append([f"depth {depth}" + (" (kept)" if depth == self.kept_depth else " (not kept)"), "", "",
                         "", ""])
            for result in self.values():
                if result.depths and result.depths[0] == depth:  # each module once, at its first depth
                    rows.extend(result.rows())
        for result in self.values():
            if not result.depths:
                rows.extend(result.rows())
        if len(rows) == 1:
            return "no module was tuned"
        folded = [p for p, r in self.items() if any(" ..." in row[4] for row in r.rows())]
        hint = f"\n(errors in full: print(result.modules[{folded[0]!r}]))" if folded else ""
        return table(rows) + hint + (f"\n{cache_note(self.measured_at)}" if self.cached else "")


def cache_note(measured_at: str | None) -> str:
    """What a result from the tuning cache says about its figures: when they were measured."""
    return (f"(from the tuning cache: the figures were measured {measured_when(measured_at)}; "
            "tt.tweak(..., cache=False) measures again)")


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
