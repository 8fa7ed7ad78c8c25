"""The measured rule on generate() calls (the numbers; decode_check runs the calls): a decode
step's logits held to the rule against a higher-precision forward of the same sequence
(StepReference), where greedy tokens may part from the untuned ones (near ties: Parting), a
sampling call's processed distributions (total variation), and whether two outputs are the
same tokens. The rule itself, the error measure and the bounds are correctness.py's."""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Sequence

import torch

from . import error_groups, settings
from .correctness import Finding, MismatchError, judge_groups, tolerance_for, worst


@dataclasses.dataclass
class StepReference:
    """The measured rule for one generate() call, teacher-forced on the untuned tokens: per
    decode step, the logits of a higher-precision run of the model on the same prefix (high,
    ``[batch, vocab]``), the untuned call's own error against them (own: gathered per row and
    column, error_groups.Groups) and, per sequence, the untuned call's largest error in logits
    (spread); unreferenced: per step, where the higher-precision logits are NaN or Inf and the
    untuned ones finite, those positions and the untuned values there (None where there are
    none); for a sampling call, per step the total variation between the distributions
    transformers' processors make of the untuned logits and of the higher-precision ones
    (own_tv); precision: the dtype the model computes its logits in (its floating weights'),
    whose floor and cap the rule uses: the logits themselves come as float32, and a bfloat16
    model's are no closer than bfloat16 allows. outputs-like: `high` is None when there is no
    reference, and why says why."""

    high: list[torch.Tensor] | None
    own: list[error_groups.Groups] = dataclasses.field(default_factory=list)
    spread: list[torch.Tensor] = dataclasses.field(default_factory=list)
    own_tv: list[float] | None = None
    why: str = ""
    unreferenced: list[tuple[torch.Tensor, torch.Tensor] | None] = dataclasses.field(default_factory=list)
    precision: torch.dtype | None = None

    @property
    def measured(self) -> bool:
        return self.high is not None


def step_reference(own_logits: Sequence[torch.Tensor], high_logits: Sequence[torch.Tensor],
                   own_tv: list[float] | None = None, precision: torch.dtype | None = None) -> StepReference:
    """The StepReference of a call whose untuned run gave `own_logits` and whose higher-precision
    teacher-forced run gave `high_logits`, step by step, of a model that computes in `precision`."""
    own, spread, high, odd = [], [], [], []
    for mine, theirs in zip(own_logits, high_logits):
        theirs = theirs.detach().to(mine.device, torch.float32)
        finite = torch.isfinite(mine) & torch.isfinite(theirs)
        own.append(error_groups.groups_of(mine, theirs, finite))
        gap = (mine.double() - theirs.double()).abs().where(finite, 0.0)
        spread.append(gap.reshape(gap.shape[0], -1).max(dim=-1).values.float())
        high.append(theirs)
        where = torch.isfinite(mine) & ~torch.isfinite(theirs)
        odd.append((where, mine.detach().where(where, 0.0)) if bool(where.any()) else None)
    return StepReference(high, own, spread, own_tv, unreferenced=odd, precision=precision)


def check_steps(got: Sequence[torch.Tensor], reference: StepReference, where: str) -> Finding:
    """Raises MismatchError unless each decode step's logits `got` (teacher-forced on the
    untuned tokens) are within the measured rule of the higher-precision ones; returns the
    finding that uses most of its bound."""
    if len(got) < len(reference.high):
        raise MismatchError(f"{where}: {len(got)} decode steps where the untuned call made {len(reference.high)}")
    findings = []
    for step, (mine, high, own) in enumerate(zip(got, reference.high, reference.own)):
        mine = mine.detach()
        finite = torch.isfinite(high).to(mine.device)
        if bool((finite & ~torch.isfinite(mine)).any()):
            raise MismatchError(f"{where} step {step}: NaN or Inf logits where the higher-precision run has none")
        odd = reference.unreferenced[step] if step < len(reference.unreferenced) else None
        if odd is not None:
            _held_to_untuned(mine, odd, f"{where} step {step} logits")
        found = error_groups.groups_of(mine, high.to(mine.device), finite & torch.isfinite(mine))
        findings.append(judge_groups(found, own, settings.MULTIPLIER, reference.precision or mine.dtype,
                                     f"{where} step {step} logits",
                                     "against a float32 run of the model on the same prefix"))
    return worst(findings)


def _held_to_untuned(mine: torch.Tensor, odd: tuple[torch.Tensor, torch.Tensor], where: str) -> None:
    """Where the higher-precision logits are NaN or Inf and the untuned ones finite (`odd`: those
    positions, the untuned values), the candidate's logits within the fixed rule's tolerance of
    the untuned ones (each value relative to its size), never skipped."""
    at, untuned = (t.to(mine.device) for t in odd)
    if bool((at & ~torch.isfinite(mine)).any()):
        raise MismatchError(f"{where}: NaN or Inf logits where the untuned call's are finite")
    error = float(error_groups.relative_errors(mine, untuned, at).max())
    limit = tolerance_for(torch.float32, bounded=True)
    if error > limit:
        raise MismatchError(f"{where}: at the {int(at.sum())} logits where the higher-precision run is NaN or Inf, "
                            f"the error against the untuned call's is {error:.3g}, more than the fixed rule's {limit:.3g}",
                            error, limit)


@dataclasses.dataclass(frozen=True)
class Parting:
    """Where a candidate's free-running tokens first part from the untuned ones in one
    sequence: the step, the sequence, both tokens, the higher-precision logits' margin between
    them, and the window the measured error allows (2 x MULTIPLIER x the untuned call's
    largest logit error at that step)."""

    step: int
    row: int
    got: int
    want: int
    margin: float
    window: float

    @property
    def near_tie(self) -> bool:
        return self.margin <= self.window

    def describe(self) -> str:
        kind = "a near tie" if self.near_tie else "not a near tie"
        return (f"token {self.step} of sequence {self.row} is {self.got}, untuned {self.want}: their margin in the "
                f"higher-precision logits is {self.margin:.3g}, {kind} (the measured error allows {self.window:.3g})")


def partings(got: torch.Tensor, want: torch.Tensor, reference: StepReference, prompt: int) -> list[Parting]:
    """Per sequence whose new tokens `got` part from the untuned `want` (two [batch, length]
    tensors), where they first part. After that step a sequence's prefixes differ, and nothing
    more of it is compared."""
    found = []
    steps = min(got.shape[1], want.shape[1]) - prompt
    differ = (got[:, prompt:prompt + steps] != want[:, prompt:prompt + steps]).cpu()
    for row in range(got.shape[0]):
        where = differ[row].nonzero()
        if not where.numel():
            continue
        step = int(where[0])
        mine, theirs = int(got[row, prompt + step]), int(want[row, prompt + step])
        if step < len(reference.high):
            high = reference.high[step][row].double()
            margin = float(high[theirs] - high[mine])
            window = 2 * settings.MULTIPLIER * float(reference.spread[step][row])
        else:
            margin, window = math.inf, 0.0
        found.append(Parting(step, row, mine, theirs, margin, window))
    return found


def total_variation(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Per row, the total variation distance between softmax(a) and softmax(b) (processed
    scores, -inf where a processor removed a token)."""
    p = torch.softmax(a.double(), dim=-1)
    q = torch.softmax(b.double().to(a.device), dim=-1)
    return 0.5 * (p - q).abs().sum(dim=-1)


def check_distributions(got: Sequence[torch.Tensor], high: Sequence[torch.Tensor], reference: StepReference,
                        where: str) -> float:
    """A sampling call, teacher-forced: each step's processed distribution (`got`) within
    MULTIPLIER times the untuned one's total variation from the higher-precision one (`high`,
    the processors run on the higher-precision logits), plus TV_FLOOR; returns the largest
    distance. Without own_tv (no reference), within TV_FLOOR of `high` (then the untuned one's)."""
    worst_tv = 0.0
    for step, (mine, theirs) in enumerate(zip(got, high)):
        distance = float(total_variation(mine, theirs).max())
        own = reference.own_tv[step] if reference.own_tv is not None and step < len(reference.own_tv) else 0.0
        bound = settings.MULTIPLIER * own + settings.TV_FLOOR
        if not distance <= bound:
            raise MismatchError(f"{where} step {step}: the processed next-token distribution is {distance:.2e} "
                                f"(total variation) from the reference's, {distance / bound:.3g}x the {bound:.2e} "
                                f"allowed ({settings.MULTIPLIER:g}x the untuned call's own {own:.2e}, "
                                f"plus {settings.TV_FLOOR:g})",
                                distance, bound)
        worst_tv = max(worst_tv, distance)
    return worst_tv


def token_difference(i: int, got: Any, expected: torch.Tensor, prompt: int | None) -> str | None:
    """How generate call i's output differs from the tokens it must give (the first
    differing token, counted from the first new one), or None when they are the same."""
    if not isinstance(got, torch.Tensor) or got.shape != expected.shape:
        return (f"generate call {i}: {tuple(expected.shape)} tokens expected, got "
                f"{tuple(getattr(got, 'shape', ()))}")
    differ = (got != expected).nonzero()
    if not differ.numel():
        return None
    row, col = (int(v) for v in differ[0])
    return (f"generate call {i}: token {col - (prompt or 0)} of sequence {row} is {int(got[row, col])}, "
            f"untuned {int(expected[row, col])}")


def untuned_difference(i: int, got: Any, untuned: Sequence[torch.Tensor], prompt: int | None) -> str | None:
    """None where generate call i's output equals one of the untuned runs' tokens (several
    where the untuned model does not repeat its own: Workload._warm_tokens), else how it
    differs from the first's."""
    problem = token_difference(i, got, untuned[0], prompt)
    if problem is not None and any(token_difference(i, got, other, prompt) is None for other in untuned[1:]):
        return None
    return problem
