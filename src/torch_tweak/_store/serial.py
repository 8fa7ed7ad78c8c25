"""Plain-JSON forms of what a saved plan and a tuning-cache entry hold.

Values (recorded calls, their outputs, backend configs) become JSON trees: a tensor is a
reference into a tensor table, tuples, dicts, dtypes and devices are tagged objects. A
backend config is stored through its class's closed schema (torch_tweak._core.schema): values the
schema refuses are kept only as fingerprints. Nothing here imports a module or builds an
object other than tensors, dtypes, devices, plain values, and a backend that is either one
of torch-tweak's own (built from schema-checked values) or one the caller passed.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import platform
import sys
from typing import Any, Sequence

import torch

from .._core import settings
from .._core._samples import CacheRecord, cache_layers
from ..backends.base import Backend, BackendConfig
from .._core.schema import FINGERPRINT, SUPPLIED as SUPPLIED_SPEC, fingerprint, is_fingerprint, spec_of





def loads(data: bytes | bytearray | str, max_depth: int | None = None, max_values: int | None = None) -> Any:
    """json.loads that refuses nesting deeper than max_depth, and more than max_values values
    (counted from the text before anything is built: every value but the first follows a
    comma or opens a container; None: settings.MAX_JSON_DEPTH, MAX_JSON_VALUES); ValueError for
    anything wrong."""
    max_depth = settings.MAX_JSON_DEPTH if max_depth is None else max_depth
    max_values = settings.MAX_JSON_VALUES if max_values is None else max_values
    marks = ("[", "{", ",") if isinstance(data, str) else (b"[", b"{", b",")
    if sum(data.count(mark) for mark in marks) + 1 > max_values:
        raise ValueError(f"JSON of more than {max_values} values")
    try:
        tree = json.loads(data)
    except RecursionError:
        raise ValueError(f"JSON nested deeper than {max_depth} levels") from None
    todo = [(tree, 1)]
    while todo:
        node, depth = todo.pop()
        if type(node) is dict:
            children = node.values()
        elif type(node) is list:
            children = node
        else:
            continue
        if depth > max_depth:
            raise ValueError(f"JSON nested deeper than {max_depth} levels")
        todo.extend((child, depth + 1) for child in children)
    return tree


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
    cache = cache_layers(value)
    if cache is not None:
        return {"cache": {"class": cache[0], "layers": [[encode(t, tensors) for t in layer] for layer in cache[1]]}}
    if isinstance(value, tuple) and (type(getattr(type(value), "_fields", None)) is tuple
                                     or type(type(value).__dict__.get("n_fields")) is int):  # torch.return_types
        return {"named": {"class": class_path(type(value)), "items": [encode(v, tensors) for v in value]}}
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        fields = {f.name: encode(getattr(value, f.name), tensors) for f in dataclasses.fields(value)}
        return {"object": {"class": class_path(type(value)), "fields": fields, "mapping": isinstance(value, dict)}}
    raise Unstorable(type(value).__name__)


def known_types(given: Sequence[type] = ()) -> dict[str, type]:
    """The classes a stored output or call may be rebuilt as, by "module:QualName": the
    caller's `given`, torch.return_types, and transformers' ModelOutput subclasses when
    transformers is already imported. Nothing is imported for a name a file holds."""
    found: dict[str, type] = {class_path(t): t for t in vars(torch.return_types).values() if isinstance(t, type)}
    utils = sys.modules.get("transformers.utils")
    base = getattr(utils, "ModelOutput", None)
    todo = [base] if isinstance(base, type) else []
    while todo:
        cls = todo.pop()
        found.setdefault(class_path(cls), cls)
        todo.extend(cls.__subclasses__())
    found.update({class_path(t): t for t in given})
    return found


def decode(tree: Any, tensors: list[torch.Tensor] | None = None, place: Any = None,
           types: dict[str, type] | None = None) -> Any:
    """The value of a JSON tree made by encode; ValueError for anything else.

    place(tensor, recorded device) -> tensor puts each referenced tensor where it goes.
    types (known_types()): the classes a named tuple or dataclass may be rebuilt as; one not
    among them comes back as a plain tuple, or a dict of its set fields when it is a mapping
    (a ModelOutput), and a cache as a CacheRecord: what the correctness check compares."""
    if tree is None or type(tree) in (bool, int, float, str):
        return tree
    if type(tree) is list:
        return [decode(v, tensors, place, types) for v in tree]
    if type(tree) is not dict or len(tree) not in (1, 2):
        raise ValueError(f"not a stored value: {str(tree)[:60]}")
    if "tensor" in tree:
        index = tree["tensor"]
        if tensors is None or type(index) is not int or not 0 <= index < len(tensors):
            raise ValueError(f"a reference to tensor {index!r}, which the file does not hold")
        return tensors[index] if place is None else place(tensors[index], str(tree.get("device", "cpu")))
    (tag, inner), = tree.items()
    if tag == "tuple" and type(inner) is list:
        return tuple(decode(v, tensors, place, types) for v in inner)
    if tag == "dict" and type(inner) is dict:
        return {k: decode(v, tensors, place, types) for k, v in inner.items()}
    if tag in ("cache", "named", "object") and type(inner) is dict and type(inner.get("class")) is str:
        return _decode_object(tag, inner, tensors, place, types or {})
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


def _decode_object(tag: str, inner: dict, tensors: Any, place: Any, types: dict[str, type]) -> Any:
    name = inner["class"]
    if tag == "cache":
        layers = inner.get("layers")
        if type(layers) is not list or not all(type(layer) is list for layer in layers):
            raise ValueError(f"a stored {name[:40]} has no list of layers")
        decoded = tuple(tuple(decode(t, tensors, place) for t in layer) for layer in layers)
        if not all(isinstance(t, torch.Tensor) for layer in decoded for t in layer):
            raise ValueError(f"a stored {name[:40]} holds something else than tensors")
        return CacheRecord(name[:60], decoded)
    cls = types.get(name)
    if tag == "named":
        items = inner.get("items")
        if type(items) is not list:
            raise ValueError(f"a stored {name[:60]} has no list of items")
        values = tuple(decode(v, tensors, place, types) for v in items)
        if cls is None or not issubclass(cls, tuple):
            return values
        return cls(*values) if hasattr(cls, "_fields") else cls(values)  # a named tuple, or a structseq
    fields = inner.get("fields")
    if type(fields) is not dict:
        raise ValueError(f"a stored {name[:60]} has no fields")
    values = {k: decode(v, tensors, place, types) for k, v in fields.items()}
    if cls is not None and dataclasses.is_dataclass(cls):
        return cls(**values)
    if inner.get("mapping") is True:
        return {k: v for k, v in values.items() if v is not None}  # what a ModelOutput's keys() show
    raise ValueError(f"the file holds a {name[:80]}, a class tt.load does not know: pass it, "
                     f"tt.load(model, path, types=[{name.rpartition(':')[2][:40]}])")


def dumps(tree: Any) -> bytes:
    """Canonical JSON (sorted keys, no NaN): equal trees give equal bytes."""
    return json.dumps(tree, sort_keys=True, allow_nan=False, separators=(",", ":")).encode("utf-8")


def class_path(cls: type) -> str:
    return f"{cls.__module__}:{cls.__qualname__}"


def stored_value(config_class: type, name: str, value: Any) -> Any:
    """The JSON form of one config field: the value when its schema accepts it, else its fingerprint."""
    if spec_of(config_class, name).accepts(value):
        try:
            return encode(value)
        except Unstorable:
            pass
    return {FINGERPRINT: fingerprint(value)}


def config_tree(config: BackendConfig) -> dict:
    return {f.name: stored_value(type(config), f.name, getattr(config, f.name)) for f in dataclasses.fields(config)}


def describe_backend(backend: Backend) -> dict:
    """{"name", "class", "config"} of a backend: what a plan names it by."""
    return {"name": backend.name, "class": class_path(type(backend)), "config": config_tree(backend.config)}


def _normalized(cls: type[Backend], config: dict) -> dict:
    """A stored config as config_tree would store it now (a file of format 1 may hold a
    free-form value itself, which is compared by its fingerprint)."""
    out = {}
    for name, tree in config.items():
        if not is_fingerprint(tree) and not spec_of(cls.config_class, name).accepts(decode(tree)):
            tree = {FINGERPRINT: fingerprint(decode(tree))}
        out[name] = tree
    return out


def build_backend(tree: Any, given: Sequence[Backend] = ()) -> Backend:
    """A new backend from its describe_backend form; ValueError naming what is wrong.

    A backend in `given` (the caller's) whose class and stored config are the file's is
    copied. Otherwise the class must be one of torch-tweak's own (backends.BUILT_IN), not
    opt-in, and every field must hold a value its schema accepts: a fingerprint (a value the
    file may not hold) asks the caller for the backend. No class is imported by name."""
    from ..backends import BUILT_IN

    if (type(tree) is not dict or type(tree.get("class")) is not str or type(tree.get("config")) is not dict
            or not all(type(k) is str for k in tree["config"])):
        raise ValueError(f"not a stored backend: {str(tree)[:80]}")
    name, config = tree["class"], tree["config"]
    builtin = {class_path(cls): cls for cls in BUILT_IN}
    short = name.rpartition(":")[2][:60]
    differ: set[str] = set()
    for backend in given:
        cls = type(backend)
        if class_path(cls) == name:
            names = {f.name for f in dataclasses.fields(cls.config_class)}
            mine = json.loads(dumps(config_tree(backend.config)))
            theirs = _normalized(cls, {k: v for k, v in config.items() if k in names})
            try:  # a field the file does not name (a file older than the field) has its default
                default = json.loads(dumps(config_tree(cls.config_class())))
            except Exception:
                default = {}
            theirs = {**{k: default[k] for k in names - set(config) if k in default}, **theirs}
            if set(config) <= names and theirs == mine:
                return backend.fresh()
            differ |= {k for k in set(mine) | set(config) if mine.get(k) != theirs.get(k)}
    cls = builtin.get(name)
    if cls is None and differ:
        raise ValueError(f"the {short} passed in backends= has another config than the file's (its "
                         f"{', '.join(sorted(k[:40] for k in differ)[:4])}); pass it as it was saved")
    if cls is None:
        raise ValueError(f"the backend class {name[:80]} is not one of torch-tweak's; tt.load never builds a class a "
                         f"file names: pass the backend, tt.load(model, path, backends=[{short}(...)])")
    if cls.opt_in:
        raise ValueError(f"{short} changes results on purpose and is opt-in: pass it to load this file, "
                         f"tt.load(model, path, backends=[tt.backends.{short}(...)])")
    fields = {f.name for f in dataclasses.fields(cls.config_class)}
    unknown = sorted(set(config) - fields)
    if unknown:
        raise ValueError(f"{short}: its config has no field {', '.join(k[:40] for k in unknown[:3])}")
    values = {}
    for key, stored in config.items():
        spec = spec_of(cls.config_class, key)
        if is_fingerprint(stored):
            raise ValueError(f"{short}: the file holds only a fingerprint of its {key} ({stored[FINGERPRINT][:12]}): "
                             f"tt.load takes no {key} from a file; pass the backend with the same {key}, "
                             f"tt.load(model, path, backends=[tt.backends.{short}({key}=...)])")
        value = decode(stored)
        if not spec.accepts(value):
            if spec is SUPPLIED_SPEC:
                raise ValueError(f"{short}: tt.load takes no {key} from a file; pass the backend with the same "
                                 f"{key}, tt.load(model, path, backends=[tt.backends.{short}({key}=...)])")
            raise ValueError(f"{short}: {key}={str(value)[:40]} is not {spec.describe()}")
        values[key] = value
    try:
        config = cls.config_class(**values)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{short}: {exc}") from None
    if config.lowers_precision():  # the one rule (BackendConfig.lowers_precision): never on a file's word
        lowered = ", ".join(f"{k}={v!r}"[:40] for k, v in values.items() if k != "tolerance"
                            and v != getattr(cls.config_class(), k, None))
        raise ValueError(f"{short} with lower precision ({lowered or str(tree.get('name', short))[:60]}) is opt-in: "
                         f"tt.load never lowers precision on a file's word; pass it to load this file, "
                         f"tt.load(model, path, backends=[tt.backends.{short}({lowered}, tolerance=...)]) as it was "
                         "tuned, or backends=tt.precision_backends(device, {policy: tolerance}) for tt.tweak's "
                         "precision= variants")
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
