"""Plain-JSON forms of what a saved plan and a tuning-cache entry hold.

Values (recorded calls, their outputs, backend configs) become JSON trees: a tensor is a
reference into a tensor table, tuples, dicts, dtypes and devices are tagged objects. Nothing
here imports a module or builds an object other than tensors, dtypes, devices, plain values
and the config dataclass of a backend class already imported in this process.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import platform
from typing import Any

import torch

from .backends.base import Backend, BackendConfig


class Unstorable(Exception):
    """A value that has no JSON form (a live object such as a key/value cache)."""


def encode(value: Any, tensors: list[torch.Tensor] | None = None) -> Any:
    """The JSON tree of `value`; tensors are appended to `tensors` (Unstorable when None)."""
    if isinstance(value, torch.Tensor):
        if tensors is None:
            raise Unstorable("a tensor")
        tensors.append(value)
        return {"tensor": len(tensors) - 1, "device": str(value.device)}
    if value is None or type(value) in (bool, int, str):
        return value
    if type(value) is float:
        return value if math.isfinite(value) else {"float": repr(value)}
    if isinstance(value, torch.dtype):
        return {"dtype": str(value).removeprefix("torch.")}
    if isinstance(value, torch.device):
        return {"device": str(value)}
    if type(value) is tuple:
        return {"tuple": [encode(v, tensors) for v in value]}
    if type(value) is list:
        return [encode(v, tensors) for v in value]
    if type(value) is dict and all(type(k) is str for k in value):
        return {"dict": {k: encode(v, tensors) for k, v in value.items()}}
    raise Unstorable(type(value).__name__)


def decode(tree: Any, tensors: list[torch.Tensor] | None = None, place: Any = None) -> Any:
    """The value of a JSON tree made by encode; ValueError for anything else.

    place(tensor, recorded device) -> tensor puts each referenced tensor where it goes."""
    if tree is None or type(tree) in (bool, int, float, str):
        return tree
    if type(tree) is list:
        return [decode(v, tensors, place) for v in tree]
    if type(tree) is not dict or len(tree) not in (1, 2):
        raise ValueError(f"not a stored value: {str(tree)[:60]}")
    if "tensor" in tree:
        index = tree["tensor"]
        if tensors is None or type(index) is not int or not 0 <= index < len(tensors):
            raise ValueError(f"a reference to tensor {index!r}, which the file does not hold")
        return tensors[index] if place is None else place(tensors[index], str(tree.get("device", "cpu")))
    (tag, inner), = tree.items()
    if tag == "tuple" and type(inner) is list:
        return tuple(decode(v, tensors, place) for v in inner)
    if tag == "dict" and type(inner) is dict:
        return {k: decode(v, tensors, place) for k, v in inner.items()}
    if tag == "float" and inner in ("inf", "-inf", "nan"):
        return float(inner)
    if tag == "dtype" and type(inner) is str:
        dtype = getattr(torch, inner, None)
        if isinstance(dtype, torch.dtype):
            return dtype
    if tag == "device" and type(inner) is str:
        try:
            return torch.device(inner)
        except RuntimeError:
            pass
    raise ValueError(f"not a stored value: {str(tree)[:60]}")


def dumps(tree: Any) -> bytes:
    """Canonical JSON (sorted keys, no NaN): equal trees give equal bytes."""
    return json.dumps(tree, sort_keys=True, allow_nan=False, separators=(",", ":")).encode("utf-8")


def class_path(cls: type) -> str:
    return f"{cls.__module__}:{cls.__qualname__}"


def config_tree(config: BackendConfig) -> dict:
    return {f.name: encode(getattr(config, f.name)) for f in dataclasses.fields(config)}


def describe_backend(backend: Backend) -> dict:
    """{"name", "class", "config"} of a backend: what a plan names it by."""
    return {"name": backend.name, "class": class_path(type(backend)), "config": config_tree(backend.config)}


def backend_classes() -> dict[str, type[Backend]]:
    """Every Backend subclass already imported in this process, by "module:QualName".

    A saved plan can name only these: loading never imports a module a file names.
    A name that two different classes share is left out (ambiguous)."""
    found: dict[str, type[Backend]] = {}
    ambiguous: set[str] = set()
    todo = list(Backend.__subclasses__())
    while todo:
        cls = todo.pop()
        todo.extend(cls.__subclasses__())
        if getattr(cls, "__abstractmethods__", None):
            continue
        key = class_path(cls)
        if key in found and found[key] is not cls:
            ambiguous.add(key)
        found[key] = cls
    for key in ambiguous:
        del found[key]
    return found


def build_backend(tree: dict) -> Backend:
    """A new backend from its describe_backend form; ValueError naming what is wrong."""
    if type(tree) is not dict or not isinstance(tree.get("class"), str) or type(tree.get("config")) is not dict:
        raise ValueError(f"not a stored backend: {str(tree)[:80]}")
    cls = backend_classes().get(tree["class"])
    if cls is None:
        raise ValueError(f"the backend class {tree['class']} is not a torch-tweak backend imported in this "
                         "process; import the module that defines it before loading")
    names = {f.name for f in dataclasses.fields(cls.config_class)}
    unknown = sorted(set(tree["config"]) - names)
    if unknown:
        raise ValueError(f"{tree['class']}: its config has no field {', '.join(unknown)}")
    config = cls.config_class(**{k: decode(v) for k, v in tree["config"].items()})
    return cls(config)


def device_name(device: torch.device) -> str:
    """The accelerator's name (torch.cuda.get_device_name...), or the CPU's model name."""
    if device.type == "cuda" and torch.cuda.is_available():
        return torch.cuda.get_device_name(device)
    if device.type == "xpu" and hasattr(torch, "xpu") and torch.xpu.is_available():
        return torch.xpu.get_device_name(device)
    if device.type == "cpu" and os.path.exists("/proc/cpuinfo"):
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine() or device.type
