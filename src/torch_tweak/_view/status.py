"""What a tuned model does at inference: per wrapped module, its backend and the calls that
ran the original forward instead, by reason.

    import torch_tweak as tt
    print(tt.status(model))            # one row per tuned module
    tt.status(model).untuned            # {reason: calls} summed over the model
"""

from __future__ import annotations

import dataclasses

from torch import nn

from .._runtime.decode.loop import loop_name, loop_of
from .._runtime.module import UNTUNED_REASONS, installed
from .._core import records
from .._core.shapes import Shapes


def _table(rows: list[list[str]]) -> str:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.ljust(w) if i < 3 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths))).rstrip()
                     for r in rows)


@dataclasses.dataclass(frozen=True)
class ModuleStatus:
    """One wrapped module at inference.

    backend: its backends' names (joined by ", " when signatures differ), or None when it
    runs its original forward. active: False after tt.deactivate. calls: calls of the
    module since tuning (or loading) ended, in every mode (tweak's own calls are not counted). untuned: calls since tuning (or loading) that
    ran the original forward while active, by reason: "no signature matched", "grad mode",
    "train mode", "device graph fell back", "trace fell back" (see docs/backends.md).
    shapes: per group of calls whose sizes vary that a backend serves shape by shape, {its
    text: its backend's describe()}: the padded backend's buckets and their calls, the padding
    waste, the graphs recorded and their memory, the calls outside the range, the new buckets
    checked, refused and evicted, and the range with where each end came from; OpenVINO's
    models per call shape on the CPU; a traced model's call shapes proven and refused
    (backends._traced.Served); each with the "line" status prints (see
    docs/serving.md); empty otherwise.
    """

    path: str
    backend: str | None
    active: bool
    calls: int
    untuned: dict
    shapes: dict = dataclasses.field(default_factory=dict)


class ModelStatus(dict):
    """{module path: ModuleStatus}; ``str()`` is a table, ``untuned`` the model's totals.
    decode_loop: tweak's decode loop behind generate() (docs/generate.md), or None: its kind,
    the calls it served and, by reason, those it left to transformers; whether it samples with
    its top-k sampler, and how many calls it made again without it."""

    decode_loop: dict | None = None
    declared: Shapes | None = None  # the ranges tt.tweak's shapes= (or tt.load) declared
    busy: str | None = None  # the kept figure, measured on a busy machine (its record's busy), else None

    @property
    def untuned(self) -> dict[str, int]:
        return {reason: sum(s.untuned.get(reason, 0) for s in self.values()) for reason in UNTUNED_REASONS}

    def __str__(self) -> str:
        rows = [["module", "backend", "active", "calls", *UNTUNED_REASONS]]
        for path, s in sorted(self.items()):
            rows.append([path or "(root)", s.backend or "original", "yes" if s.active else "no", str(s.calls),
                         *(str(s.untuned.get(reason, 0)) for reason in UNTUNED_REASONS)])
        text = _table(rows) if len(rows) > 1 else "no tuned modules"
        if self.busy:
            text += f"\n{self.busy}"  # the outcome, which says "measured busy"
        text += "".join("\n" + line for line in self.shapes_lines())
        loop = self.decode_loop
        if loop is not None:
            calls = f"{loop['calls']} call" + ("" if loop["calls"] == 1 else "s")
            name = loop_name(loop["kind"], bool(loop.get("top_sampler")), loop.get("kernels"))
            again = (f"; {loop['resampled']} made again with transformers' processors (ties past the sampler's "
                     "margin, or a NaN score)") if loop.get("resampled") else ""
            again += _recorded("its decode step", "shape", "run step by step",
                               loop.get("recorded_steps", 0), loop.get("unrecorded_steps", []))
            again += _recorded("its choice of a token", "shape", "chosen kernel by kernel",
                               loop.get("recorded_draws", 0), loop.get("unrecorded", []))
            again += _recorded("its prefill", "prompt shape", "run eagerly",
                               loop.get("recorded_prefills", 0), loop.get("unrecorded_prefills", []))
            text += (f"\ngenerate(): tweak's decode loop ({name}) served {calls}{again}" +
                     "".join(f"; transformers' loop ran {n} for {why}" for why, n in loop["fallbacks"].items()))
        return text


    def shapes_lines(self) -> list[str]:
        """The declared shapes, then per padded group its buckets and their calls, the padding
        waste, the graphs and their memory, the calls outside the range (print(result) shows
        them too)."""
        lines = [f"declared shapes: {self.declared}"] if self.declared is not None else []
        for path, s in sorted(self.items()):
            for signature, d in s.shapes.items():  # each backend words its own line (describe())
                lines.append(f"{path or '(root)'} {signature}: {d['line']}")
        return lines


def _recorded(what: str, shape: str, otherwise: str, n: int, refused: list[str]) -> str:
    """What of the decode loop's work is recorded as device graphs, for how many shapes, and how
    many shapes were refused (the first one's reason)."""
    text = f"; {what} recorded as a device graph for {n} {shape}{'' if n == 1 else 's'}" if n else ""
    if refused:
        text += f"; {what} not recorded for {len(refused)} {shape}(s), {otherwise} ({refused[0]})"
    return text


def status(model: nn.Module) -> ModelStatus:
    """The status of every wrapped module of `model` (see ModuleStatus); empty when none."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, not {type(model).__name__}")
    result = ModelStatus()
    record = records.of(model)
    if record is not None and record.wrappers:  # unwrapped: nothing serves the declared shapes
        result.declared, result.busy = record.shapes, record.busy
    loop = loop_of(model)
    if loop is not None:
        result.decode_loop = loop.figures()
    for path, wrapper in installed(model).items():
        names = list(dict.fromkeys(g.backend.name for g in wrapper.tt_signatures if g.backend is not None))
        if not names and wrapper.tt_backend is not None:
            names = [wrapper.tt_backend.name]
        described = ((g.text, getattr(g.backend, "describe", lambda: None)()) for g in wrapper.tt_signatures)
        shapes = {text: d for text, d in described if d is not None}
        result[path] = ModuleStatus(path, ", ".join(names) or None, wrapper.tt_active, wrapper.tt_calls,
                                    wrapper.tt_untuned, shapes)
    return result
