"""The model's side of a decode loop, as transformers' generate() makes it: its caches,
whether transformers compiles a call's steps and with what settings, the model as it was before
tuning (``Plain``), and the layout of one forward call's arguments.
"""

from __future__ import annotations

import contextlib
import inspect
from typing import Any, Callable

import torch
from torch import nn

from .decode_call import Greedy, greedy_call
from .module import install as install_wrapper, installed, uninstall as uninstall_wrapper


def new_cache(model: nn.Module, static: bool, length: int) -> Any:
    """A new cache as generate() makes one: a StaticCache of `length` positions, or a
    DynamicCache (a static cache allocates its tensors on first use)."""
    dynamic_class, static_class = _cache_classes(model)
    config = model.config.get_text_config(decoder=True) if hasattr(model.config, "get_text_config") else model.config
    return static_class(config=config, max_cache_len=length) if static else dynamic_class(config=config)


def probe_cache(model: nn.Module, call: Greedy) -> Any:
    """A cache of the kind the call uses, for transformers_compiles to look at."""
    return new_cache(model, call.static, call.input_ids.shape[1] + call.max_new)


def transformers_compiles(model: nn.Module, call: Greedy, cache: Any) -> bool:
    """Whether transformers' generate() would run this call's decode steps through its
    compiled forward (its own rule, asked of the model: a compileable cache, a device it
    compiles on, no disable_compile...)."""
    if not call.static or call.config is None:
        return False
    rule = getattr(model, "_valid_auto_compile_criteria", None)
    if rule is None or not callable(getattr(model, "get_compiled_call", None)):
        return False
    try:
        return bool(rule({"cache": cache, "past_key_values": cache}, call.config))
    except Exception:  # a transformers whose rule reads other arguments: not a call the loop compiles
        return False


def tuned_settings(config: Any) -> dict | None:
    """torch.compile's arguments for the "tuned" loop: transformers' compile config (its
    CompileConfig, as its get_compiled_call passes it) with Inductor's coordinate descent
    tuning added to its mode's options, or None when the config does not compile with Inductor
    (the option is Inductor's)."""
    try:
        settings = dict(config.to_dict())
    except Exception:  # not a CompileConfig
        return None
    if settings.get("backend", "inductor") != "inductor":
        return None
    mode = settings.pop("mode", None)
    from torch._inductor import list_mode_options

    options = dict(list_mode_options(mode)) if mode else {}  # no mode: no mode's options (not every mode's)
    options.update(settings.get("options") or {})
    options["coordinate_descent_tuning"] = True
    settings["options"] = options
    return settings


def compile_config(model: nn.Module, call: Greedy) -> Any:
    """The compile config transformers' get_compiled_call uses for the call: the call's, else
    the model's default."""
    config = getattr(call.config, "compile_config", None)
    if config is None:
        default = getattr(model, "_default_compile_config", None)
        config = default() if callable(default) else None
    return config


def compiled_by_transformers(model: nn.Module, args: tuple, kwargs: dict) -> bool:
    """Whether transformers' generate() runs this call's decode steps through its compiled
    forward. Its first such call compiles that forward, and on the H200 the first call's
    tokens are not those of its later calls (Llama-1B shape, bf16, prompt 512: every later
    call, and the compiled loop, left the first call's tokens at new token 100;
    bench/studies/first_call_study.py), so the untuned tokens of such a call are read from a later
    call (Workload._warm_tokens, apply_loop)."""
    call = greedy_call(model, args, kwargs)
    return not isinstance(call, str) and transformers_compiles(model, call, probe_cache(model, call))


def cache_arg_of(model: nn.Module) -> str | None:
    try:
        params = inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return None
    for name in ("cache", "past_key_values"):
        if name in params:
            return name
    return None


def _cache_classes(model: nn.Module) -> tuple[Any, Any]:
    """transformers' DynamicCache and StaticCache, from the module the model's class lives in."""
    import transformers  # only reached for a transformers model, which has imported it

    return transformers.DynamicCache, transformers.StaticCache


def plain_model(model: nn.Module) -> "Plain":
    """A context inside which `model` is as it was before any tuning (see Plain)."""
    return Plain(model)


class Plain:
    """Inside the block the model is as it was before any tuning: its tuned modules are taken
    out and put back after, in the mode they were in. What a device graph records must not
    itself replay graphs, and Inductor must see plain modules."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.wrappers = list(installed(model).values())
        self.active: list[bool] = []

    def __enter__(self) -> None:
        self.active = [w.tt_active for w in self.wrappers]
        for w in reversed(self.wrappers):
            uninstall_wrapper(self.model, w)

    def __exit__(self, *exc: Any) -> None:
        for w, active in zip(self.wrappers, self.active):
            install_wrapper(self.model, w)
            if active:
                w.tt_activate()


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
    from .._core._samples import kv_cache_class

    if isinstance(value, torch.Tensor):
        return ("tensor", str(value.dtype), value.dim())
    if value is None or isinstance(value, (bool, int, float, str)):
        return ("value", value)
    if kv_cache_class(value) is not None:
        return ("cache",)
    return ("other", type(value).__name__)


class LayoutError(Exception):
    """A forward call the loop cannot lay out as the workload's generate() did."""


def lay_out(layout: tuple, cache_arg: str, ids: torch.Tensor, cache: Any, start: Any, total: int | None,
            mask: Callable[[], torch.Tensor] | None) -> dict:
    """The keyword arguments of one forward call as `layout` says. start: the position of
    ids' first token (an int, or a 0-d tensor inside a device graph); total: the length of the
    sequence so far (a 2-D attention mask's width); mask: makes the 4-D boolean mask (or the dict
    of them per layer type, as the model takes it)."""
    batch, width = ids.shape
    kwargs: dict[str, Any] = {}
    for key, spec in layout:
        kind = spec[0]
        if key in ("input_ids",) and kind == "tensor":
            kwargs[key] = ids
        elif key == cache_arg and kind == "cache":
            kwargs[key] = cache
        elif key == "position_ids" and kind == "tensor" and spec[2] == 2:
            kwargs[key] = (torch.arange(width, device=ids.device) + start).view(1, width).expand(batch, width)
        elif key == "attention_mask" and kind == "tensor" and spec[2] == 2 and total is not None:
            kwargs[key] = torch.ones(batch, total, dtype=getattr(torch, spec[1].split(".")[-1]), device=ids.device)
        elif key == "attention_mask" and mask is not None and (
                (kind == "tensor" and spec[2] == 4 and spec[1] == "torch.bool") or spec == ("other", "dict")):
            kwargs[key] = mask()
        elif kind == "value":
            kwargs[key] = spec[1]
        else:
            raise LayoutError(f"the argument {key} ({'/'.join(map(str, spec))})")
    return kwargs


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


def logits_of(out: Any) -> torch.Tensor:
    logits = getattr(out, "logits", None)
    if logits is None:
        logits = out[0] if isinstance(out, (tuple, list)) else out["logits"]
    return logits


KEPT_KEYS = 64
"""The most prompt shapes a decode loop keeps a count or a reason for (the oldest dropped)."""


def bounded(table: dict, key: tuple, value: Any) -> None:
    """table[key] = value, the oldest entry dropped past KEPT_KEYS."""
    table.pop(key, None)
    if len(table) >= KEPT_KEYS:
        table.pop(next(iter(table)))
    table[key] = value


def contiguous(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.contiguous()
    if isinstance(value, dict):
        return {k: v.contiguous() if isinstance(v, torch.Tensor) else v for k, v in value.items()}
    return value


def decode_context(model: nn.Module) -> Any:
    """What transformers' decoding loop enters around its decode steps (after the prefill):
    for a mixture of experts on a GPU, another experts kernel (_optimize_model_for_decode)."""
    decoding = getattr(model, "_optimize_model_for_decode", None)
    return decoding() if callable(decoding) else contextlib.nullcontext()
