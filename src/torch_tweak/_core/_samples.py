"""Datasets and samples: what one call of the model looks like.

A sample is one call of the model exactly as the user makes it: a Tensor (one
positional argument), a tuple or list (positional arguments), a dict (keyword
arguments), or a pair ``(args_tuple, kwargs_dict)``.
"""

from __future__ import annotations

import copy
import dataclasses
from typing import Any, Callable, Iterable

import torch

Call = tuple[tuple, dict]


def as_call(sample: Any, index: int) -> Call:
    """The (args, kwargs) of one sample; TypeError naming the sample otherwise."""
    if isinstance(sample, torch.Tensor):
        return (sample,), {}
    if isinstance(sample, dict):
        return (), dict(sample)
    if isinstance(sample, (tuple, list)):
        if len(sample) == 2 and isinstance(sample[0], tuple) and isinstance(sample[1], dict):
            return tuple(sample[0]), dict(sample[1])
        return tuple(sample), {}
    raise TypeError(
        f"sample {index} is a {type(sample).__name__}; a sample is a Tensor, a tuple or list "
        "of positional arguments, a dict of keyword arguments, or a pair (args_tuple, kwargs_dict)"
    )


def load_dataset(dataset: Any, device: torch.device | None = None) -> list[Call]:
    """Every sample of the dataset as (args, kwargs), copies of its tensors on `device`."""
    if isinstance(dataset, torch.Tensor):
        raise TypeError(
            "the dataset is a single Tensor; pass a sequence of samples instead, e.g. [x] "
            "for one call of model(x)"
        )
    if isinstance(dataset, (dict, str, bytes)) or not isinstance(dataset, Iterable):
        raise TypeError(
            f"the dataset must be a sequence or iterable of samples, not a {type(dataset).__name__}; "
            "e.g. [x1, x2] or [(x, mask)] or [{'input_ids': ids}]"
        )
    calls = [as_call(sample, i) for i, sample in enumerate(dataset)]
    if not calls:
        raise ValueError("the dataset is empty; pass at least one sample, e.g. [x]")
    if device is not None:
        calls = [(move(args, device), move(kwargs, device)) for args, kwargs in calls]
    # copies: tuning runs the model on each call many times, and a model that writes into its
    # input (x.mul_(), ReLU(inplace=True) on an argument) must neither change the caller's
    # tensors nor be called with values it changed
    return [(clone(args), clone(kwargs)) for args, kwargs in calls]


def move(value: Any, device: torch.device) -> Any:
    """`value` with every tensor in it on `device` (tuples, named tuples, lists and dicts
    followed, each kept of its own type)."""
    if isinstance(value, torch.Tensor):
        return value if value.device == device else value.to(device)
    return _rebuilt(value, lambda v: move(v, device))


def _rebuilt(value: Any, each: Callable[[Any], Any]) -> Any:
    """`value`, a container, with each(item) for its items, of the same type (a named tuple,
    a ModelOutput, an OrderedDict, a dataclass stay what they are); anything else as it is."""
    if isinstance(value, tuple):
        items = [each(v) for v in value]
        return type(value)(*items) if hasattr(value, "_fields") else tuple(items)
    if isinstance(value, list):
        return [each(v) for v in value] if type(value) is list else type(value)(each(v) for v in value)
    if isinstance(value, dict):
        if type(value) is dict:
            return {k: each(v) for k, v in value.items()}
        copied = copy.copy(value)
        for k, v in value.items():
            copied[k] = each(v)
        return copied
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        copied = copy.copy(value)
        for field in dataclasses.fields(value):
            if hasattr(value, field.name):
                object.__setattr__(copied, field.name, each(getattr(value, field.name)))
        return copied
    return value


def clone(value: Any) -> Any:
    """A copy of `value` whose tensors a later in-place operation cannot change; a key/value
    cache is copied whole (the model appends to it in place). Containers keep their types, a
    tensor subclass its attributes, and a tensor found twice is copied once (a call given the
    same tensor twice is given one copy twice)."""
    return _copied(value, True, {})


def fresh(value: Any) -> Any:
    """`value` with every key/value cache in it copied, the rest shared: a recorded call to
    replay, which leaves the recording as it was (a cache passed in grows at every call)."""
    return _copied(value, False, {})


def _copied(value: Any, tensors: bool, memo: dict[int, Any]) -> Any:
    key = id(value)
    if key in memo:
        return memo[key]
    if isinstance(value, torch.Tensor):
        copied = value
        if tensors:
            copied = value.detach().clone()
            if type(value) not in (torch.Tensor, torch.nn.Parameter) and getattr(value, "__dict__", None):
                copied.__dict__.update(value.__dict__)  # a subclass's own attributes
    elif kv_cache_class(value) is not None:
        copied = copy.deepcopy(value)
    else:
        copied = _rebuilt(value, lambda v: _copied(v, tensors, memo))
    memo[key] = copied
    return copied


def resolve_device(model: torch.nn.Module, device: Any) -> torch.device:
    """The device to tune on: `device`, else that of the model's first parameter or buffer, else cpu."""
    if device is not None:
        try:
            device = torch.device(device)
        except (RuntimeError, TypeError) as exc:
            raise ValueError(f"unknown device {device!r}: {exc}") from None
        module = getattr(torch, device.type, None) if device.type in ("cuda", "xpu") else None
        if module is not None and not (hasattr(module, "is_available") and module.is_available()):
            raise ValueError(f"device {str(device)!r} was asked for, but this torch sees no {device.type} device; "
                             "use device='cpu' or install a torch build for it")
        return device
    for tensor in model.parameters():
        return tensor.device
    for tensor in model.buffers():
        return tensor.device
    return torch.device("cpu")


def synchronizer(device: torch.device):
    """A callable that waits for `device`, or None when there is nothing to wait for."""
    if device.type == "cuda":
        return torch.cuda.synchronize
    if device.type == "xpu" and hasattr(torch, "xpu"):
        return torch.xpu.synchronize
    return None


UNSTORABLE_CLASSES = frozenset({"DynamicCache", "StaticCache", "HybridCache", "SlidingWindowCache",
                                "EncoderDecoderCache", "QuantizedCache", "OffloadedCache"})
"""transformers' key/value caches, found by class name (transformers is never imported)."""


def kv_cache_class(value: Any) -> str | None:
    """The class name of a transformers key/value cache (a DynamicCache, say), or None.

    Found by class name and module, so transformers is never imported here."""
    if isinstance(value, (torch.Tensor, tuple, list, dict)) or value is None:
        return None
    for cls in type(value).__mro__:
        if cls.__name__ in UNSTORABLE_CLASSES and (cls.__module__ or "").split(".")[0] == "transformers":
            return type(value).__name__
    return None


@dataclasses.dataclass(frozen=True)
class CacheRecord:
    """A key/value cache written down: its class name and, per layer, its tensors. What a
    saved file keeps of a cache in a module's outputs, compared by its tensors on load."""

    cls: str
    layers: tuple[tuple[torch.Tensor, ...], ...]


def cache_layers(value: Any) -> tuple[str, list[tuple[torch.Tensor, ...]]] | None:
    """(class name, per layer its key and value tensors) of a transformers cache or a
    CacheRecord; None for anything else. Layers not filled yet have no tensors."""
    if isinstance(value, CacheRecord):
        return value.cls, list(value.layers)
    name = kv_cache_class(value)
    if name is None:
        return None
    parts = [getattr(value, a) for a in ("self_attention_cache", "cross_attention_cache") if hasattr(value, a)]
    layers: list[tuple[torch.Tensor, ...]] = []
    for part in parts or [value]:
        if hasattr(part, "layers"):  # transformers 4.54 and later: one object per layer
            layers.extend(tuple(t for t in (getattr(layer, "keys", None), getattr(layer, "values", None))
                                if isinstance(t, torch.Tensor)) for layer in part.layers)
        else:  # earlier releases: parallel lists
            layers.extend(tuple(t for t in pair if isinstance(t, torch.Tensor))
                          for pair in zip(getattr(part, "key_cache", []), getattr(part, "value_cache", [])))
    return name, layers


def structure_key(value: Any) -> tuple | None:
    """What a signature matches a key/value cache by: its class and, per layer, the shape,
    dtype and device of each tensor (a layer not filled yet has none). None for any other
    value, which a signature compares as itself."""
    layers = cache_layers(value) if kv_cache_class(value) is not None else None
    if layers is None:
        return None
    name, tensors = layers
    return (name, tuple(tuple((tuple(t.shape), str(t.dtype), str(t.device)) for t in layer) for layer in tensors))


def describe_cache(value: Any) -> str | None:
    """A cache as a signature shows it: ``StaticCache(2 layers, bfloat16[1, 4, 160, 64])``."""
    key = structure_key(value)
    if key is None:
        return None
    name, layers = key
    shapes = list(dict.fromkeys(f"{dtype.replace('torch.', '')}[{', '.join(map(str, shape))}]"
                                for layer in layers for shape, dtype, _ in layer))
    inner = f"{len(layers)} layers" + (", " + ", ".join(shapes[:2]) if shapes else ", empty")
    return f"{name}({inner}{', ...' if len(shapes) > 2 else ''})"


def unstorable(value: Any) -> str | None:
    """The class name of an object in `value` that a backend cannot store, or None.

    Such objects (a transformers DynamicCache, say) hold live state: a sample that
    contains one cannot be written to a file and replayed later. Tuples, lists and
    dicts are followed; a class counts when it, or a base, is one of
    UNSTORABLE_CLASSES and comes from a module under ``transformers``.
    """
    if isinstance(value, torch.Tensor) or value is None or isinstance(value, (bool, int, float, str)):
        return None
    if isinstance(value, (tuple, list)):
        return next((n for n in map(unstorable, value) if n is not None), None)
    if isinstance(value, dict):
        return next((n for n in map(unstorable, value.values()) if n is not None), None)
    return kv_cache_class(value)
