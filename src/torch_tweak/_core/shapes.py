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
from typing import Any, Sequence

import torch
import torch.utils._pytree as pytree

from . import settings
from ._samples import Call
from .layout import CallLayout, layout_of


POSITION_FIELDS = ("max_position_embeddings", "n_positions", "max_sequence_length", "n_ctx")
"""The fields of a model's config (transformers') that say how many positions it takes."""
POSITION_TABLES = ("position_embeddings", "position_embedding", "pos_embed", "pos_embedding", "wpe",
                   "embed_positions")
"""The names (a module path's last part) of a learned position table: an nn.Embedding of one row
per position (BERT's position_embeddings, GPT-2's wpe, OPT's, BART's, Whisper's and Marian's
embed_positions)."""

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
        if hi > settings.SHAPE_LIMITS[name]:
            raise ValueError(f"shapes[{name!r}] = ({lo}, {hi}): max may be at most {settings.SHAPE_LIMITS[name]}")
        ranges[name] = (lo, hi)
    return Shapes(**ranges)


def _rows_before(module: torch.nn.Embedding) -> tuple[int, str]:
    """(the rows of a position table before its first position, why): OPT's and BART's tables
    look position p up at row p + offset (2); RoBERTa's keep rows up to their padding row."""
    offset = getattr(module, "offset", 0)
    if isinstance(offset, int) and not isinstance(offset, bool) and 0 < offset < module.num_embeddings:
        return offset, f" less its offset {offset}"
    if module.padding_idx is not None and module.padding_idx >= 0:
        return module.padding_idx + 1, f" less {module.padding_idx + 1} rows up to its padding_idx {module.padding_idx}"
    return 0, ""


def position_limit(model: torch.nn.Module) -> tuple[int, str, bool] | None:
    """(how many positions the model takes, where that was read, whether a position table says
    so), or None when nothing says (rotary or relative positions and no POSITION_FIELDS: any
    length): the smallest of its config's POSITION_FIELDS and of the usable rows of its
    position tables (an nn.Embedding named as in POSITION_TABLES, less the rows before its first
    position). The one reader of a model's positions: shapes= at tweak (check_model), the
    declared shapes and the padded max_length at tt.load (positions)."""
    found: list[tuple[int, str, bool]] = []
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Embedding) and name.rpartition(".")[2] in POSITION_TABLES:
            before, why = _rows_before(module)
            found.append((module.num_embeddings - before, f"{name}.num_embeddings = {module.num_embeddings}{why}", True))
    config = getattr(model, "config", None)
    for field in POSITION_FIELDS:
        value = getattr(config, field, None) if config is not None else None
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            found.append((value, f"config.{field} = {value}", False))
    if not found:
        return None
    usable = min(value for value, _, _ in found)
    at_least = [(where, table) for value, where, table in found if value == usable]
    tables = [where for where, table in at_least if table][:1]  # one of an encoder's and a decoder's equal tables
    where = ", ".join(tables + [where for where, table in at_least if not table])
    return usable, where, bool(tables)


def position_table(model: torch.nn.Module) -> tuple[int, str] | None:
    """position_limit's (positions, where that was read), as a call's layout keeps it
    (CallLayout.positions: the padded range's upper end); None when nothing says."""
    limit = position_limit(model)
    return None if limit is None else (limit[0], limit[1])


def check_model(shapes: Shapes, model: torch.nn.Module) -> None:
    """The declared lengths fit the model's positions (position_limit); ValueError saying how
    many positions the model takes, where that was read, and the range to declare, before
    anything is built."""
    limit = position_limit(model) if shapes.length is not None else None
    if limit is None:
        return
    usable, where, table = limit
    lo, hi = shapes.length  # type: ignore[misc]
    if hi > usable:
        holds = "position table holds" if table else "config takes at most"
        fits = f"shapes={{'length': ({min(lo, usable)}, {usable})}}"
        raise ValueError(f"shapes['length'] = ({lo}, {hi}): the model's {holds} {usable} positions ({where}), so "
                         f"no call longer than {usable} can run on it; declare a length of at most {usable}, e.g. "
                         f"{fits}")


def _axes_of(call: Call, params: Sequence[str | None], shapes: Shapes, where: str) -> CallLayout:
    """The layout of one call (layout.layout_of: the batch-axis and length rules), checking
    that it has the axes `shapes` declares; ValueError naming what is missing."""
    layout = layout_of([call], params)
    if not layout.slots:
        raise ValueError(f"shapes= declares sizes, but {where} passes no tensor")
    if shapes.batch is not None and not layout.batch:
        sizes = ", ".join(f"{s.name or f'tensor {k}'}: {s.shape}" for k, s in enumerate(layout.slots))
        raise ValueError(f"shapes['batch'] is {AXES['batch']}, but the tensor arguments of {where} do not share "
                         f"one axis-0 size ({sizes}); leave 'batch' out of shapes= for this model")
    if shapes.length is not None and layout.mask is None:
        raise ValueError(f"shapes['length'] is {AXES['length']}, but {where} passes no 2-d integer or bool "
                         "attention_mask; leave 'length' out of shapes= for this model")
    return layout


def check_calls(shapes: Shapes, calls: Sequence[Call], params: Sequence[str | None]) -> None:
    """Each of the dataset's calls has the declared axes, at sizes within the declared
    ranges; ValueError saying which call and what to change (before anything runs)."""
    for k, call in enumerate(calls):
        batch, length = _axes_of(call, params, shapes, f"call {k} of the dataset").sizes()
        sizes = {"batch": batch, "length": length}
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
    layout = _axes_of(call, params, shapes, "the dataset's first call")
    out = pytree.tree_leaves(call)
    for slot in layout.slots:
        if shapes.length is not None and slot.length:
            out[slot.leaf] = _resized(out[slot.leaf], 1, shapes.length[end], pad_zeros=True)
        if shapes.batch is not None:
            out[slot.leaf] = _resized(out[slot.leaf], 0, shapes.batch[end], pad_zeros=False)
    return pytree.tree_unflatten(out, layout.spec)


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
    """How many positions the model takes (position_limit); None when nothing says (a length
    past it is no call of this model: tt.load's bounds)."""
    limit = position_limit(model)
    return None if limit is None else limit[0]


def mask_lengths(calls: Sequence[Call], params: Sequence[str | None]) -> list[int]:
    """Each call's length along its attention_mask (axis 1; the layout's length rule), for the
    calls that have one."""
    lengths = []
    for call in calls:
        length = layout_of([call], params).sizes()[1]
        if length is not None:
            lengths.append(length)
    return lengths
