"""Declared shapes: the ranges of the sizes that vary in a model's traffic (tt.tweak's shapes=).

The recorded calls show the sizes a dataset has; a service sees more. ``shapes=`` names the
range of each varying axis the tuned model must serve, in the spirit of torch.export's
``Dim(min=, max=)`` and TensorRT's optimization profiles (min and max; the dataset's calls are
the "opt" sizes, measured as the traffic):

    tt.tweak(model, dataset, shapes={"batch": (1, 32), "length": (8, 512)})

- ``"batch"``: axis 0 of every tensor argument of a call (each call has one batch size);
- ``"length"``: axis 1 of the ``attention_mask`` argument and of every tensor argument shaped
  like it (the token ids, the token types); positions past a call's own are masked (zeros).

These are the axes the padded backend pads (backends/padded.py). From the dataset's first call,
tweak makes one call at the smallest sizes of every declared range and one at the largest
(edge_calls: rows cut or repeated, positions cut or padded with a zero mask), records them with
the dataset's calls, and adds them to the group of their shape class in every module: each
candidate of that group is then built on them and checked against the original on them, and
the group's signature leaves the declared axes free. They are not measured: what tweak
measures stays the dataset's traffic. The padded backend takes the declared maxima as its
range (Backend.for_shapes) unless its config sets its own.
"""

from __future__ import annotations

import dataclasses
import weakref
from typing import Any, Sequence

import torch
import torch.utils._pytree as pytree

from ._samples import Call

MASK_NAMES = ("attention_mask",)
"""Argument names taken as a mask of valid positions along axis 1 (transformers' name)."""

LIMITS = {"batch": 1 << 16, "length": 1 << 20}
"""The largest size each axis may declare (what a saved padded config may hold)."""

POSITION_FIELDS = ("max_position_embeddings", "n_positions", "max_sequence_length", "n_ctx")
"""The fields of a model's config (transformers') that say how many positions it takes."""
POSITION_TABLES = ("position_embeddings", "position_embedding", "pos_embed", "pos_embedding", "wpe",
                   "embed_positions")
"""The names (a module path's last part) of a learned position table (an nn.Embedding of one row
per position) in a model."""

AXES = {"batch": "axis 0 of every tensor argument",
        "length": "axis 1 of attention_mask and of the tensor arguments shaped like it"}

EXAMPLE = "shapes={'batch': (1, 32), 'length': (8, 512)}"


@dataclasses.dataclass(frozen=True)
class Shapes:
    """Declared ranges, each (min, max) inclusive, or None for an axis not declared."""

    batch: tuple[int, int] | None = None
    length: tuple[int, int] | None = None

    def as_dict(self) -> dict[str, list[int]]:
        """The plain JSON form ({"batch": [1, 32]}), as tt.save and the tuning cache key keep it."""
        return {name: list(r) for name, r in (("batch", self.batch), ("length", self.length)) if r is not None}

    def __str__(self) -> str:
        return ", ".join(f"{name} {lo}-{hi}" for name, (lo, hi) in self.as_dict().items())


DECLARED: "weakref.WeakKeyDictionary[torch.nn.Module, Shapes]" = weakref.WeakKeyDictionary()
"""model -> the shapes its last tweak (or tt.load) declared: what tt.save writes and tt.status shows."""


def check_shapes(shapes: Any) -> Shapes | None:
    """`shapes` as a Shapes (None stays None); TypeError or ValueError saying what is wrong and
    what to write instead."""
    if shapes is None or isinstance(shapes, Shapes):
        return shapes
    if not isinstance(shapes, dict):
        raise TypeError(f"shapes must be a dict of axis ranges, e.g. {EXAMPLE}, not {type(shapes).__name__}")
    if not shapes:
        raise ValueError(f"shapes is empty: name at least one axis, e.g. {EXAMPLE}, or leave shapes=None")
    ranges = {}
    for name, value in shapes.items():
        if name not in AXES:
            known = "; ".join(f"'{a}' ({what})" for a, what in AXES.items())
            raise ValueError(f"shapes has an unknown axis {name!r}; the axes are {known}")
        if (not isinstance(value, (tuple, list)) or len(value) != 2
                or any(not isinstance(v, int) or isinstance(v, bool) for v in value)):
            raise ValueError(f"shapes[{name!r}] must be (min, max), two ints, e.g. (1, 32); got {value!r}")
        lo, hi = value
        if not 1 <= lo <= hi:
            raise ValueError(f"shapes[{name!r}] = ({lo}, {hi}): it needs 1 <= min <= max")
        if hi > LIMITS[name]:
            raise ValueError(f"shapes[{name!r}] = ({lo}, {hi}): max may be at most {LIMITS[name]}")
        ranges[name] = (lo, hi)
    return Shapes(**ranges)


def position_table(model: torch.nn.Module) -> tuple[int, str, bool] | None:
    """(the most positions a call of the model may take, where that was read, whether a learned
    position table holds them), or None when neither a table nor its config says (rotary or
    relative positions with no config take any length). The one bound of a declared length:
    tt.tweak's check (check_model) and tt.load's (positions) both read it. It is the smallest
    of the usable rows of its position tables (an nn.Embedding named as in POSITION_TABLES; one
    with a padding row before its positions, RoBERTa's padding_idx 1, holds that many fewer) and
    of its config's POSITION_FIELDS."""
    found: list[tuple[int, str]] = []
    table = False
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Embedding) and name.rsplit(".", 1)[-1] in POSITION_TABLES:
            usable = module.num_embeddings - (0 if module.padding_idx is None else module.padding_idx + 1)
            found.append((usable, f"{name}.num_embeddings = {module.num_embeddings}"))
            table = True
    config = getattr(model, "config", None)
    for field in POSITION_FIELDS:
        value = getattr(config, field, None) if config is not None else None
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            found.append((value, f"config.{field} = {value}"))
    if not found:
        return None
    return min(n for n, _ in found), ", ".join(where for _, where in found), table


def check_model(shapes: Shapes, model: torch.nn.Module) -> None:
    """The declared lengths fit the model's positions (position_table); ValueError saying how
    many and the range to declare, before anything is built."""
    table = position_table(model) if shapes.length is not None else None
    if table is None:
        return
    most, where, learned = table
    lo, hi = shapes.length  # type: ignore[misc]
    if hi > most:
        fits = f"shapes={{'length': ({min(lo, most)}, {most})}}"
        holds = "the model's position table holds" if learned else "the model's config gives it"
        raise ValueError(f"shapes['length'] = ({lo}, {hi}): {holds} {most} positions ({where}), so no call "
                         f"longer than {most} can run on it; declare a length of at most {most}, e.g. {fits}")


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


def find_mask(leaves: list, tensors: Sequence[int], named: dict[int, str]) -> int | None:
    """The index of the call's mask among its leaves: an argument named in MASK_NAMES, 2-d, of
    integers or booleans; None when it has none."""
    return next((i for i in tensors if named.get(i) in MASK_NAMES and leaves[i].dim() == 2
                 and not leaves[i].is_floating_point()), None)


def length_inputs(calls: Sequence[list], tensors: Sequence[int], mask: int | None) -> set[int]:
    """The axis rule, written once: the tensors whose first two axes are the mask's in every
    one of `calls` (their leaves) are length inputs, padded or bounded along axis 1 with the
    mask; none without a mask."""
    if mask is None:
        return set()
    return {i for i in tensors if all(c[i].dim() >= 2 and tuple(c[i].shape[:2]) == tuple(c[mask].shape)
                                      for c in calls)}


def _axes_of(call: Call, params: Sequence[str | None], shapes: Shapes, where: str) -> tuple[list, Any, list, int | None]:
    """(leaves, structure, tensor slots, mask slot) of a call, checking that it has the axes
    `shapes` declares; ValueError naming what is missing."""
    leaves, spec, named = named_leaves(call, params)
    tensors = [i for i, leaf in enumerate(leaves) if isinstance(leaf, torch.Tensor)]
    if not tensors:
        raise ValueError(f"shapes= declares sizes, but {where} passes no tensor")
    if shapes.batch is not None and (any(leaves[i].dim() == 0 for i in tensors)
                                     or len({int(leaves[i].shape[0]) for i in tensors}) != 1):
        sizes = ", ".join(f"{named.get(i, f'tensor {k}')}: {tuple(leaves[i].shape)}" for k, i in enumerate(tensors))
        raise ValueError(f"shapes['batch'] is {AXES['batch']}, but the tensor arguments of {where} do not share "
                         f"one axis-0 size ({sizes}); leave 'batch' out of shapes= for this model")
    mask = find_mask(leaves, tensors, named)
    if shapes.length is not None and mask is None:
        raise ValueError(f"shapes['length'] is {AXES['length']}, but {where} passes no 2-d integer or bool "
                         "attention_mask; leave 'length' out of shapes= for this model")
    return leaves, spec, tensors, mask


def check_calls(shapes: Shapes, calls: Sequence[Call], params: Sequence[str | None]) -> None:
    """Each of the dataset's calls has the declared axes, at sizes within the declared
    ranges; ValueError saying which call and what to change (before anything runs)."""
    for k, call in enumerate(calls):
        leaves, _, tensors, mask = _axes_of(call, params, shapes, f"call {k} of the dataset")
        sizes = {"batch": int(leaves[tensors[0]].shape[0]) if shapes.batch is not None else None,
                 "length": int(leaves[mask].shape[1]) if mask is not None else None}
        for name, (lo, hi) in shapes.as_dict().items():
            if not lo <= sizes[name] <= hi:
                raise ValueError(f"call {k} of the dataset has {name} {sizes[name]}, outside shapes[{name!r}] = "
                                 f"({lo}, {hi}): declare a range that holds the calls you tune on")


def _resized(x: torch.Tensor, axis: int, size: int, pad_zeros: bool) -> torch.Tensor:
    """`x` cut to `size` along `axis`, or grown to it: zeros (pad_zeros), else its rows repeated."""
    have = int(x.shape[axis])
    if size <= have:
        return x.narrow(axis, 0, size).contiguous()
    if pad_zeros:
        extra = list(x.shape)
        extra[axis] = size - have
        return torch.cat([x, x.new_zeros(extra)], axis)
    return x.index_select(axis, torch.arange(size, device=x.device) % have)


def edge_call(call: Call, params: Sequence[str | None], shapes: Shapes, end: int) -> Call:
    """`call` at the smallest (end 0) or largest (end 1) size of every declared range: rows cut
    or repeated along the batch axis, positions cut or padded along the length axis (a zero
    mask past the call's own positions)."""
    leaves, spec, tensors, mask = _axes_of(call, params, shapes, "the dataset's first call")
    out = list(leaves)
    if shapes.length is not None:
        assert mask is not None
        n = shapes.length[end]
        for i in length_inputs([leaves], tensors, mask):
            out[i] = _resized(out[i], 1, n, pad_zeros=True)
    if shapes.batch is not None:
        b = shapes.batch[end]
        for i in tensors:
            out[i] = _resized(out[i], 0, b, pad_zeros=False)
    return pytree.tree_unflatten(out, spec)


def edge_calls(shapes: Shapes | None, calls: Sequence[Call], params: Sequence[str | None]) -> list[Call]:
    """The calls at the two ends of the declared ranges, made from the first of `calls`
    (none without shapes, or when both ends are that call's own sizes)."""
    if shapes is None or not calls:
        return []
    def sizes(call: Call) -> list[tuple[int, ...]]:
        return [tuple(t.shape) for t in pytree.tree_leaves(call) if isinstance(t, torch.Tensor)]

    seen = [sizes(calls[0])]
    made = []
    for end in (0, 1):
        call = edge_call(calls[0], params, shapes, end)
        if sizes(call) not in seen:
            seen.append(sizes(call))
            made.append(call)
    return made


def positions(model: torch.nn.Module) -> int | None:
    """How many positions the model takes (position_table's bound, the one tt.tweak's shapes=
    is checked against); None when nothing says (a length past it is no call of this model:
    tt.load's bounds)."""
    table = position_table(model)
    return None if table is None else table[0]


def mask_lengths(calls: Sequence[Call], params: Sequence[str | None]) -> list[int]:
    """Each call's length along its attention_mask (axis 1; find_mask), for the calls that have one."""
    lengths = []
    for call in calls:
        leaves, _, named = named_leaves(call, params)
        tensors = [i for i, leaf in enumerate(leaves) if isinstance(leaf, torch.Tensor)]
        mask = find_mask(leaves, tensors, named)
        if mask is not None:
            lengths.append(int(leaves[mask].shape[1]))
    return lengths
