"""A call's layout: what the calls of one shape class look like, as one value.

The calls of a shape class (signatures.shape_class) share their structure, plain values,
dtypes, ranks and devices; their sizes may vary. What every reader of such calls needs to know
of them is made once, where the signatures are grouped (signatures.lay_out, after
merge_varying), kept in the group (SignatureGroup.layout) and handed to the backends that build
for it (Backend.layout):

- the structure (torch's pytree spec of the call as (args, kwargs)) and its tensor slots, in
  the order of the call's leaves: each slot's leaf, the argument it came from, its dtype,
  device and sizes in the first call, and the axes whose size varied among the calls;
- the batch-axis rule (written here once): the batch is axis 0 of every tensor argument, when
  every tensor has one and each call has one size there;
- the length rule (written here once): the mask is an argument named in MASK_NAMES, 2-d, of
  integers or booleans; the length inputs are the tensors whose first two axes are the mask's
  in every call (the mask itself, the token ids, the token types), and their length is axis 1;
- the model's own limit on that length: the positions its learned position table holds (read
  by the recording, the way tt.tweak's shapes= is checked against it), or None where the model
  has none (rotary or relative positions) or none was read.

Its readers: the padded backend (what it pads, and the layout its C type fits calls to),
OpenVINO's declared bounds, and tt.tweak's declared shapes (their checks and the calls at their
ends).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import torch
import torch.utils._pytree as pytree

from ._samples import Call

MASK_NAMES = ("attention_mask",)
"""Argument names taken as a mask of valid positions along axis 1 (transformers' name)."""


@dataclasses.dataclass(frozen=True)
class Slot:
    """One tensor of the calls: its place among a call's leaves, the argument it came from
    (None: a positional one forward does not name), its recorded dtype, device and sizes (the
    first call's), the axes whose size varied among the calls, and whether it is a length
    input (its first two axes are the mask's)."""

    leaf: int
    name: str | None
    dtype: torch.dtype
    device: torch.device
    shape: tuple[int, ...]
    varies: tuple[int, ...]
    length: bool


@dataclasses.dataclass(frozen=True)
class CallLayout:
    """The layout of a shape class's calls (see the module docs). mask: the index among
    `slots` of the attention mask, or None; batches and lengths: each call's batch (empty
    without a batch axis) and length (empty without a mask); positions: the model's position
    table (how long a call's length may be) and where it was read, or None."""

    spec: Any
    slots: tuple[Slot, ...]
    batch: bool
    mask: int | None
    batches: tuple[int, ...] = ()
    lengths: tuple[int, ...] = ()
    positions: tuple[int, str] | None = None

    @property
    def leaves(self) -> list[int]:
        """Each slot's index among a call's leaves."""
        return [s.leaf for s in self.slots]

    def sizes(self) -> tuple[int | None, int | None]:
        """The first call's batch (None without a batch axis) and length (None without a mask)."""
        return (self.batches[0] if self.batches else None, self.lengths[0] if self.lengths else None)


def named_leaves(call: Call, params: Sequence[str | None]) -> tuple[list, Any, dict[int, str]]:
    """The call's leaves, its structure, and the name of the argument each leaf came from
    ({leaf index: name}; params: the names of forward's positional parameters)."""
    args, kwargs = call
    leaves, spec = pytree.tree_flatten(call)
    named: dict[int, str] = {}
    position = 0
    for i, value in enumerate(list(args) + list(kwargs.values())):
        name = (params[i] if i < len(args) and i < len(params) else
                list(kwargs)[i - len(args)] if i >= len(args) else None)
        for _ in pytree.tree_leaves(value):
            if name is not None:
                named[position] = name
            position += 1
    return leaves, spec, named


def layout_of(calls: Sequence[Call], params: Sequence[str | None],
              positions: tuple[int, str] | None = None) -> CallLayout:
    """The layout of `calls` (one structure; ValueError when they differ; no slots when they
    pass no tensor).
    params: the names of forward's positional parameters (signatures.forward_params)."""
    if not calls:
        raise ValueError("a layout needs at least one call")
    first, spec, named = named_leaves(calls[0], params)
    flats = [first] + [pytree.tree_flatten(c)[0] for c in calls[1:]]
    if any(pytree.tree_flatten(c)[1] != spec for c in calls[1:]):
        raise ValueError("the calls differ in structure")
    leaves = [i for i, leaf in enumerate(first) if isinstance(leaf, torch.Tensor)]
    if any(not isinstance(f[i], torch.Tensor) or (f[i].dtype, f[i].device, f[i].dim()) !=
           (first[i].dtype, first[i].device, first[i].dim()) for f in flats for i in leaves):
        raise ValueError("the calls pass tensors of other dtypes, devices or ranks, or no tensor, in one place")
    batch = bool(leaves) and all(f[i].dim() >= 1 for f in flats for i in leaves) and all(
        len({int(f[i].shape[0]) for i in leaves}) == 1 for f in flats)
    mask = next((k for k, i in enumerate(leaves) if named.get(i) in MASK_NAMES and first[i].dim() == 2
                 and not first[i].is_floating_point()), None)
    slots = []
    for i in leaves:
        x = first[i]
        along = mask is not None and all(
            f[i].dim() >= 2 and tuple(f[i].shape[:2]) == tuple(f[leaves[mask]].shape) for f in flats)
        varies = tuple(a for a in range(x.dim()) if len({int(f[i].shape[a]) for f in flats}) > 1)
        slots.append(Slot(i, named.get(i), x.dtype, x.device, tuple(int(s) for s in x.shape), varies, along))
    batches = tuple(int(f[leaves[0]].shape[0]) for f in flats) if batch else ()
    lengths = tuple(int(f[leaves[mask]].shape[1]) for f in flats) if mask is not None else ()
    return CallLayout(spec, tuple(slots), batch, mask, batches, lengths, positions)
