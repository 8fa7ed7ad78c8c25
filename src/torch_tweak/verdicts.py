"""The verdict store: whether a backend's build crashed in its isolated child, kept on disk.

A verdict is a small JSON file ``<cache>/verdicts/<key>.json`` (the cache folder is
``$TORCH_TWEAK_CACHE``, else ``~/.cache/torch-tweak``). Its key is the hash of everything
the crash can depend on (see parts_of): the backend's class and config, the module's
classes and its parameter and buffer shapes and dtypes, the recorded calls' signature,
the device and CPU, and the versions of torch, torch-tweak and the backend's own
packages. The file repeats those parts and is used only when they are equal, so a new
OpenVINO, say, runs the child again.

Reading never fails and never blocks: a file that is not a regular file (a FIFO, a
folder, a device), that is larger than MAX_BYTES, or that cannot be read or parsed is a
miss, and the verdict found by the next child is written over it (atomically).
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.metadata
import json
import os
import stat
from pathlib import Path
from typing import Any, Sequence

import torch
from torch import nn

from ._samples import Call
from .storage import atomic_file, cache_dir
from .serial import device_name
from .signatures import describe_call

VERSION = 1
MAX_BYTES = 64 * 1024
"""A verdict is a few hundred bytes; anything larger is not one."""


@dataclasses.dataclass(frozen=True)
class Verdict:
    """crashed: the child died (a signal, or an exit before it finished); reason: why, for
    the report, e.g. "OpenVINO crashed while compiling (signal 11, SIGSEGV)"."""

    crashed: bool
    reason: str = ""


def folder() -> Path:
    return cache_dir() / "verdicts"


def _class_path(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def _versions(names: Sequence[str]) -> dict[str, str | None]:
    from . import __version__

    found: dict[str, str | None] = {"torch": torch.__version__, "torch_tweak": __version__}
    for name in names:
        try:
            found[name] = importlib.metadata.version(name)
        except (importlib.metadata.PackageNotFoundError, ValueError):
            found[name] = None
    return found


def parts_of(backend: Any, module: nn.Module, samples: Sequence[Call], device: torch.device) -> dict[str, Any]:
    """Everything a build's crash can depend on, as plain JSON."""
    config = backend.config
    config = dataclasses.asdict(config) if dataclasses.is_dataclass(config) else repr(config)
    parts = {
        "version": VERSION,
        "backend": _class_path(type(backend)),
        "config": config,
        "modules": [_class_path(type(m)) for m in module.modules()],
        "tensors": [[name, list(t.shape), str(t.dtype)]
                    for name, t in list(module.named_parameters()) + list(module.named_buffers())],
        "calls": sorted({describe_call(args, kwargs) for args, kwargs in samples}),
        "device": str(device),
        "cpu": device_name(torch.device("cpu")),
        "versions": _versions(getattr(backend, "packages", ())),
    }
    return json.loads(json.dumps(parts, sort_keys=True, default=repr))


def key_of(parts: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode("utf-8")).hexdigest()[:32]


def path_of(key: str) -> Path:
    return folder() / f"{key}.json"


def read(parts: dict[str, Any]) -> Verdict | None:
    """The stored verdict for `parts`, or None (a miss) for anything else."""
    try:
        path = path_of(key_of(parts))
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0))
    except Exception:
        return None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode) or info.st_size > MAX_BYTES:
            return None
        data = b""
        while len(data) <= MAX_BYTES:
            chunk = os.read(fd, MAX_BYTES + 1 - len(data))
            if not chunk:
                break
            data += chunk
        if len(data) > MAX_BYTES:
            return None
        entry = json.loads(data.decode("utf-8"))
        if not isinstance(entry, dict) or entry.get("parts") != parts or not isinstance(entry.get("crashed"), bool):
            return None
        reason = entry.get("reason", "")
        return Verdict(entry["crashed"], reason if isinstance(reason, str) else "")
    except Exception:
        return None
    finally:
        os.close(fd)


def write(parts: dict[str, Any], verdict: Verdict) -> bool:
    """Stores `verdict` atomically (over whatever was there); False when it could not."""
    path = path_of(key_of(parts))
    text = json.dumps({"parts": parts, "crashed": verdict.crashed, "reason": verdict.reason}, sort_keys=True)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with atomic_file(path, "w", encoding="utf-8") as f:
            f.write(text)
    except OSError:
        return False
    return True


def clear() -> int:
    """Removes every stored verdict; returns how many."""
    removed = 0
    try:
        entries = list(folder().glob("*.json"))
    except OSError:
        return 0
    for path in entries:
        try:
            path.unlink()
            removed += 1
        except OSError:
            pass
    return removed
