"""The measured correctness rule's measure (correctness.py holds the rule): each value's error
relative to its own size, gathered in groups so that each part of an output is held to the
original's own error in that same part.

A value's error is ``|out - ref| / (|ref| + m)``, ``m`` the tensor's typical magnitude (see
relative_errors). The errors of one tensor, laid out as rows along its last axis (a token's
hidden state, a row of logits, a line of an image), are gathered twice:

- per **row** (every value of one row), and
- per **column** (one index of the last axis across every row: a channel of a hidden state).

Each group gives its root mean square and its largest value. A value that cancels (the
difference of two large numbers, as ``(h + 4e6) - 4e6`` or a naive ``E[x^2] - E[x]^2`` makes)
has a large error of its own in the original, and so in any right candidate: it raises the own
error of its row and of its column, and of no other group. Every other value of its row is in a
column of its own, every other value of its column in a row of its own, each held to the
original's error there. A group holds at least MIN_GROUP values: where the last axis is shorter,
consecutive rows are gathered into one group, and where there are fewer rows, consecutive
columns; so no group is one value, whose own error can be near 0 by chance.
"""

from __future__ import annotations

import dataclasses

import torch

from . import settings


def relative_errors(out: torch.Tensor, ref: torch.Tensor, compared: torch.Tensor) -> torch.Tensor:
    """Each value's error ``|out - ref| / (|ref| + m)`` (float64, 0 where `compared` is False),
    `out` and `ref` floating tensors of one shape. m is the typical magnitude of ``ref`` over the
    compared positions: the median of ``|ref|``, at least a tenth of the mean (an output mostly of
    zeros, after a ReLU), the smallest normal number when both are 0. The median, not the mean:
    one massive channel (thousands of times the others, as language models' hidden states have)
    cannot raise it past the ordinary values; and a value near 0 is judged against the typical
    one, where cancellation makes any relative error meaningless."""
    out = out.detach().to(torch.float64)
    ref = ref.detach().to(device=out.device, dtype=torch.float64)
    compared = compared.to(out.device)
    count = int(compared.sum())
    if count == 0:
        return torch.zeros_like(out)
    size = ref.abs().where(compared, 0.0)
    typical = max(float(size[compared].median()), 0.1 * float(size.sum()) / count)
    if not typical > 0:
        typical = float(torch.finfo(torch.float64).tiny)
    return ((out - ref).abs().where(compared, 0.0) / (size + typical)).where(compared, 0.0)


@dataclasses.dataclass(frozen=True)
class Family:
    """One way of gathering a tensor's errors: per group its rms, its peak and how many values
    it compares (three float64 tensors of the groups' count); block: rows (or columns) per group."""

    name: str
    rms: torch.Tensor
    peak: torch.Tensor
    count: torch.Tensor
    block: int

    def typical(self) -> tuple[float, float]:
        """(rms, peak) of the median group among those that compare a value (0, 0 for none)."""
        used = self.count > 0
        if not bool(used.any()):
            return 0.0, 0.0
        return float(self.rms[used].median()), float(self.peak[used].median())


@dataclasses.dataclass(frozen=True)
class Groups:
    """One tensor's errors gathered per row and per column (see the module's docstring);
    shape: the tensor's."""

    shape: tuple[int, ...]
    rows: Family
    columns: Family

    @property
    def families(self) -> tuple[Family, Family]:
        return self.rows, self.columns

    def typical(self) -> tuple[float, float]:
        """The tensor's typical (rms, peak): the smaller of the two families' medians. No single
        group decides it, nor a column that cancels in every row (it is in every row's group,
        and in one column's), nor a row that cancels (in every column's group, one row's)."""
        a, b = self.rows.typical(), self.columns.typical()
        return min(a[0], b[0]), min(a[1], b[1])

    def worst(self) -> tuple[float, float]:
        """(the largest row rms, the largest peak): the whole tensor's worst."""
        rms = float(self.rows.rms.max()) if self.rows.rms.numel() else 0.0
        peak = float(self.rows.peak.max()) if self.rows.peak.numel() else 0.0
        return rms, peak

    def name(self, family: Family, g: int) -> str:
        """Which values group g of `family` holds, as a user reads it."""
        lead = self.shape[:-1] if len(self.shape) >= 2 else ()
        if family.name == "column":
            if not lead:
                return f"values {g * family.block}-{(g + 1) * family.block - 1}"
            if family.block == 1:
                return f"column {g} (index {g} of the last axis in every row)"
            return f"columns {g * family.block}-{(g + 1) * family.block - 1} of the last axis"
        if not lead:
            return "the whole tensor" if len(self.shape) < 2 else f"row {g}"
        if family.block == 1:
            return f"row {tuple(int(i) for i in torch.unravel_index(torch.tensor(g), lead))}".replace(",)", ")")
        first = g * family.block
        return f"rows {first}-{first + family.block - 1} (counted over the leading axes {tuple(lead)})"


def _family(name: str, errors: torch.Tensor, compared: torch.Tensor, block: int) -> Family:
    """errors, compared: [groups of `block` lines, line length] laid flat per line; pads the
    lines to a multiple of block and gathers each block of lines into one group."""
    lines, width = errors.shape
    groups = -(-lines // block) if lines else 0
    pad = groups * block - lines
    if pad:
        errors = torch.cat([errors, errors.new_zeros(pad, width)])
        compared = torch.cat([compared, compared.new_zeros(pad, width)])
    errors = errors.reshape(groups, block * width)
    count = compared.reshape(groups, block * width).sum(dim=-1).to(torch.float64)
    rms = ((errors * errors).sum(dim=-1) / count.clamp(min=1)).sqrt()
    peak = errors.max(dim=-1).values if errors.numel() else errors.new_zeros(groups)
    return Family(name, rms, peak, count, block)


def gather(errors: torch.Tensor, compared: torch.Tensor) -> Groups:
    """`errors` (relative_errors' values, 0 where not compared) gathered per row and column."""
    shape = tuple(errors.shape)
    width = shape[-1] if len(shape) >= 2 and shape[-1] > 0 else max(errors.numel(), 1)
    flat = errors.reshape(-1, width)
    seen = compared.to(errors.device).reshape(-1, width)
    lines = flat.shape[0]
    least = settings.MIN_GROUP
    rows = _family("row", flat, seen, max(1, -(-least // width)))
    columns = _family("column", flat.t().contiguous(), seen.t().contiguous(), max(1, -(-least // max(lines, 1))))
    return Groups(shape, rows, columns)


def groups_of(out: torch.Tensor, ref: torch.Tensor, compared: torch.Tensor) -> Groups:
    """`out`'s errors against `ref` over the positions `compared`, gathered."""
    return gather(relative_errors(out, ref, compared), compared)
