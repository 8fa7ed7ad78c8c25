"""A decode loop's forward calls laid out as the workload's own generate() called the model:
the keyword arguments in the recorded order (its layouts, read from a file too), the position
ids and the attention masks transformers would pass (one mask, or one per layer type), and
whether the loop can make its masks itself (plain_causal).
"""

from __future__ import annotations

import inspect
from typing import Any, Callable

import torch
from torch import nn

from .call import Greedy
from .model import cache_arg_of, text_config


_PLAIN_STEP = (("input_ids", ("tensor", "torch.int64", 2)), ("cache", ("cache",)), ("use_cache", ("value", True)),
               ("return_dict", ("value", True)))


DEFAULT_LAYOUTS = {
    "dynamic": {"prefill": _PLAIN_STEP, "decode": _PLAIN_STEP},
    "static": {"prefill": _PLAIN_STEP,
               "decode": _PLAIN_STEP[:2] + (("attention_mask", ("tensor", "torch.bool", 4)),) + _PLAIN_STEP[2:]},
}
"""The arguments the loop passes the model when it knows no better, per cache: what
transformers passes a decoder for one sequence. tt.tweak gives the loop the layout the
workload's own generate() calls used (Workload.layouts), so that the calls fit the
signatures tuned on them."""


def describe_argument(value: Any) -> tuple:
    """One argument of a forward call as a layout holds it (plain JSON)."""
    from ..._core._samples import kv_cache_class

    if isinstance(value, torch.Tensor):
        return ("tensor", str(value.dtype), value.dim())
    if value is None or isinstance(value, (bool, int, float, str)):
        return ("value", value)
    if kv_cache_class(value) is not None:
        return ("cache",)
    return ("other", type(value).__name__)


class LayoutError(Exception):
    """A forward call the loop cannot lay out as the workload's generate() did."""


def check_layouts(layouts: Any) -> dict | None:
    """Layouts read from a file, as plain tuples, or ValueError: only names, kinds and plain
    values, bounded."""
    if layouts is None:
        return None
    if type(layouts) is not dict or set(layouts) != {"prefill", "decode"}:
        raise ValueError("layouts name the prefill and decode calls")
    out = {}
    for phase, layout in layouts.items():
        if type(layout) is not list or len(layout) > 32:
            raise ValueError("a layout is a list of at most 32 arguments")
        items = []
        for item in layout:
            if type(item) is not list or len(item) != 2 or type(item[0]) is not str or len(item[0]) > 64 \
                    or type(item[1]) is not list or not item[1] or len(item[1]) > 3:
                raise ValueError("an argument is [name, [kind, ...]]")
            spec = item[1]
            if spec[0] not in ("tensor", "value", "cache", "positional", "other") or \
                    not all(v is None or type(v) in (bool, int, float, str) for v in spec) or \
                    any(type(v) is str and len(v) > 64 for v in spec):
                raise ValueError("an argument's kind is a short plain value")
            items.append((item[0], tuple(spec)))
        out[phase] = tuple(items)
    return out


def contiguous(value: Any) -> Any:
    """A forward call's argument contiguous, as transformers makes them (a dict of masks too)."""
    if isinstance(value, torch.Tensor):
        return value.contiguous()
    if isinstance(value, dict):
        return {k: v.contiguous() if isinstance(v, torch.Tensor) else v for k, v in value.items()}
    return value


def plain_causal(model: nn.Module) -> bool:
    """Whether every attention layer of `model` takes one boolean causal mask over the whole
    static cache (SDPA, no sliding window, no chunks, transformers' own mask functions): the
    mask the loop then makes itself, with no read of the device (a graph step needs it)."""
    config = text_config(model)
    if getattr(config, "_attn_implementation", None) != "sdpa" or hasattr(model, "create_masks_for_generate"):
        return False
    types = getattr(config, "layer_types", None)
    if types is not None:
        return all(t == "full_attention" for t in types)
    return getattr(config, "sliding_window", None) is None and getattr(config, "attention_chunk_size", None) is None


class StepInputs:
    """A loop's forward calls laid out: `layouts` are the workload's (None: DEFAULT_LAYOUTS,
    chosen per call by its cache)."""

    def __init__(self, model: nn.Module, layouts: dict | None) -> None:
        self.model = model
        self.given = layouts
        self.layouts = layouts if layouts is not None else DEFAULT_LAYOUTS["dynamic"]
        self.cache_arg = next((k for k, spec in self.layouts["decode"] if spec[0] == "cache"), None)
        if self.cache_arg is None or layouts is None:
            self.cache_arg = cache_arg_of(model)
        self._mask_types: tuple | None = None  # the layer types a dict of masks is keyed by (mask_form)
        try:
            params = inspect.signature(model.forward).parameters
        except (TypeError, ValueError):
            params = {}
        self._takes_positions = "position_ids" in params
        self._takes_mask = "attention_mask" in params

    def layout_problem(self, call: Greedy) -> str | None:
        """Why the loop cannot make this call's forward calls as its layouts say, or None."""
        if self.cache_arg is None:
            return "the model's forward takes no cache"
        if self.given is None:
            self.layouts = DEFAULT_LAYOUTS["static" if call.static else "dynamic"]
            if self.cache_arg != "cache":
                self.layouts = {phase: tuple((self.cache_arg if k == "cache" else k, spec) for k, spec in layout)
                                for phase, layout in self.layouts.items()}
        for phase in ("prefill", "decode"):
            for key, spec in self.layouts[phase]:
                if not (key in ("attention_mask", "position_ids") or spec[0] == "value"
                        or (key == "input_ids" and spec[0] == "tensor") or (key == self.cache_arg and spec[0] == "cache")):
                    return f"the argument {key} ({'/'.join(map(str, spec))}) of the {phase} calls"
        return None

    def mask_form(self, mask: torch.Tensor) -> Any:
        """The loop's own causal mask in the form the model takes: one tensor, or one per
        layer type when the model's config names them (transformers' create_masks_for_generate)."""
        if self._mask_types is None:
            types = getattr(text_config(self.model), "layer_types", None)
            self._mask_types = () if types is None else tuple(sorted(set(types)))
        return {t: mask for t in self._mask_types} if self._mask_types else mask

    def positions(self, call: Greedy) -> torch.Tensor | None:
        """The prompt's position ids as transformers' generate() makes them (from the attention
        mask when there is one), or None when the forward takes none."""
        if not self._takes_positions:
            return None
        mask = call.mask
        if mask is None and self._takes_mask:  # transformers counts them from a mask of ones: one row per sequence
            mask = torch.ones(call.input_ids.shape, dtype=torch.long, device=call.input_ids.device)
        if mask is not None:
            return (mask.long().cumsum(-1) - 1).masked_fill(mask == 0, 0)
        return torch.arange(call.input_ids.shape[1], dtype=torch.long, device=call.input_ids.device).unsqueeze(0)

    def attention(self, call: Greedy, cache: Any, mask: torch.Tensor | None, positions: torch.Tensor | None,
                   width: int, first: bool) -> Any:
        """The attention mask transformers' prepare_inputs_for_generation passes the forward: for
        a static cache, transformers' own mask functions (one mask, or one per layer type) on the
        2-D mask so far; otherwise that 2-D mask (None: no padding)."""
        if not call.static:
            return mask
        from transformers import masking_utils

        make = getattr(self.model, "create_masks_for_generate", masking_utils.create_masks_for_generate)
        batch = call.input_ids.shape[0]
        # the cache's argument is `cache` in newer transformers, `past_key_values` before (5.17)
        try:
            named = "cache" if "cache" in inspect.signature(make).parameters else "past_key_values"
        except (TypeError, ValueError):
            named = "cache"
        out = make(config=self.model.config,
                   inputs_embeds=torch.empty((batch, width, 0), dtype=self.model.dtype, device=call.input_ids.device),
                   attention_mask=mask, position_ids=positions, block_sequence_ids=None,
                   token_type_ids=None, mm_token_type_ids=None, is_first_iteration=first, **{named: cache})
        return contiguous(out)

    def kwargs(self, phase: str, ids: torch.Tensor, cache: Any, positions: torch.Tensor | None,
                attention: Any) -> dict:
        """One forward call's keyword arguments, in the order of the layout recorded from the
        workload's own generate() (so that they fit the signatures tuned on them), with the
        position ids and the attention mask transformers would pass."""
        kwargs: dict[str, Any] = {}
        for key, spec in self.layouts[phase]:
            if key == "input_ids" and spec[0] == "tensor":
                kwargs[key] = ids
            elif key == self.cache_arg and spec[0] == "cache":
                kwargs[key] = cache
            elif key == "position_ids":
                if positions is not None:
                    kwargs[key] = positions
            elif key == "attention_mask":
                if attention is not None:
                    kwargs[key] = attention
            elif spec[0] == "value":
                kwargs[key] = spec[1]
            else:
                raise LayoutError(f"the argument {key} ({'/'.join(map(str, spec))})")
        if positions is not None and "position_ids" not in kwargs:
            kwargs["position_ids"] = positions
        if attention is not None and "attention_mask" not in kwargs:
            kwargs["attention_mask"] = attention
        return kwargs

    def step_kwargs(self, ids: torch.Tensor, cache: Any, start: Any, mask: Callable[[], Any]) -> dict:
        """The keyword arguments of a recorded decode step as the decode layout says (what a
        device graph records: no value read from the device). start: the position of ids'
        first token (a 0-d tensor); mask: makes the 4-D boolean mask (or the dict of them per
        layer type, as the model takes it)."""
        batch, width = ids.shape
        kwargs: dict[str, Any] = {}
        for key, spec in self.layouts["decode"]:
            kind = spec[0]
            if key == "input_ids" and kind == "tensor":
                kwargs[key] = ids
            elif key == self.cache_arg and kind == "cache":
                kwargs[key] = cache
            elif key == "position_ids" and kind == "tensor" and spec[2] == 2:
                kwargs[key] = (torch.arange(width, device=ids.device) + start).view(1, width).expand(batch, width)
            elif key == "attention_mask" and (
                    (kind == "tensor" and spec[2] == 4 and spec[1] == "torch.bool") or spec == ("other", "dict")):
                kwargs[key] = mask()
            elif kind == "value":
                kwargs[key] = spec[1]
            else:
                raise LayoutError(f"the argument {key} ({'/'.join(map(str, spec))})")
        return kwargs
