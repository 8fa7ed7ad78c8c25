"""A decode loop's forward calls laid out as the workload's own generate() called the model:
the keyword arguments in the recorded order, the position ids and the attention masks
transformers would pass (one mask, or one per layer type).
"""

from __future__ import annotations

import inspect
from typing import Any

import torch

from .decode_call import Greedy
from .decode_model import DEFAULT_LAYOUTS, LayoutError


class StepInputs:
    """The part of DecodeLoop that lays out its forward calls (its state is set in
    DecodeLoop.__init__: layouts, given, cache_arg, _mask_types, _takes_positions, _takes_mask)."""


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
            config = self.model.config.get_text_config(decoder=True) \
                if hasattr(self.model.config, "get_text_config") else self.model.config
            types = getattr(config, "layer_types", None)
            self._mask_types = () if types is None else tuple(sorted(set(types)))
        return {t: mask for t in self._mask_types} if self._mask_types else mask

    def _positions(self, call: Greedy) -> torch.Tensor | None:
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

    def _attention(self, call: Greedy, cache: Any, mask: torch.Tensor | None, positions: torch.Tensor | None,
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
        if isinstance(out, dict):
            return {k: v.contiguous() if isinstance(v, torch.Tensor) else v for k, v in out.items()}
        return out.contiguous() if isinstance(out, torch.Tensor) else out

    def _kwargs(self, phase: str, ids: torch.Tensor, cache: Any, positions: torch.Tensor | None,
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
