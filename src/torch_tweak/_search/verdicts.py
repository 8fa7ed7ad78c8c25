"""The verdict store: whether a backend's build crashed in its isolated child, kept on disk.

A verdict is a small JSON file ``<cache>/verdicts/<key>.json`` (the cache folder is
``$TORCH_TWEAK_CACHE``, else ``~/.cache/torch-tweak``). Its key is the hash of everything
the crash can depend on (see parts_of): the backend's class and config, the module's
classes and its parameter and buffer shapes and dtypes, the recorded calls' signature,
the device, the CPU's instruction set (see cpu_isa: the machine, torch's CPU capability
and the CPU's feature flags, not its model name: two hosts both called "AMD EPYC" can
differ in AVX-512, and a build that works on one can segfault on the other), and the
builds of torch, torch-tweak and the backend's own packages (versions and build
identity, see builds). The file repeats those parts and is used only when they are equal,
so a new OpenVINO, another CPU or a verdict of an older format runs the child again.

A verdict decides whether a backend's native build runs in the tuning process, and the cache
folder may be shared (a team's ``$TORCH_TWEAK_CACHE``): each verdict is sealed with this
user's key (storage.seal: an HMAC over its parts, crashed and reason), and one whose seal
does not hold (edited by hand, written by another user, or unsealed because no key could be
made) is a miss, so the child runs again.

Reading never fails and never blocks: a file that is not a regular file (a FIFO, a
folder, a device), that is larger than VERDICT_MAX_BYTES, or that cannot be read or parsed is a
miss, and the verdict found by the next child is written over it (atomically).
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.metadata
import functools
import json
import platform
from pathlib import Path
from typing import Any, Sequence

import torch
from torch import nn

from .._core import settings
from .._core._samples import Call
from .._core.storage import (cache_dir, listed_cached, printable, read_cached, remove_cached, seal, unseal,
                             write_cached)
from .._core.signatures import describe_call

VERSION = 2
"""2: the CPU by its instruction set and the libraries by their builds (1 named the CPU model)."""
CPUINFO = "/proc/cpuinfo"


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


def _digest(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8", errors="replace")).hexdigest()[:16]


def cpu_isa() -> dict[str, Any]:
    """What a native build's crash can depend on in the CPU: the machine (x86_64, aarch64),
    torch's CPU capability (DEFAULT, AVX2, AVX512...) and a digest of the CPU's feature flags
    (/proc/cpuinfo's "flags" or "Features" line, sorted; None where there is none)."""
    try:
        capability = torch.backends.cpu.get_cpu_capability()
    except Exception:
        capability = None
    flags = None
    try:
        with open(CPUINFO, encoding="utf-8", errors="replace") as f:
            for line in f:
                name, sep, value = line.partition(":")
                if sep and name.strip() in ("flags", "Features"):
                    flags = _digest(" ".join(sorted(value.split())))
                    break
    except OSError:
        pass
    return {"machine": platform.machine(), "capability": capability, "flags": flags}


@functools.lru_cache(maxsize=None)
def _build_of(name: str) -> str | None:
    """The identity of an installed distribution's build: a digest of its RECORD (every file
    with its hash), so a rebuilt wheel of the same version differs; None when unknown."""
    try:
        record = importlib.metadata.distribution(name).read_text("RECORD")
    except Exception:
        return None
    return _digest(record) if record else None


def builds(names: Sequence[str]) -> dict[str, Any]:
    """The version and build of torch (its git revision and build configuration), of torch-tweak
    and of each distribution in `names` (None for one not installed)."""
    from .._version import __version__

    try:
        config = _digest(torch.__config__.show())
    except Exception:
        config = None
    found: dict[str, Any] = {
        "torch": [torch.__version__, getattr(torch.version, "git_version", None), config],
        "torch_tweak": [__version__, _build_of("torch-tweak")],
    }
    for name in names:
        try:
            found[name] = [importlib.metadata.version(name), _build_of(name)]
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
        "cpu": cpu_isa(),
        "versions": builds(getattr(backend, "packages", ())),
    }
    return json.loads(json.dumps(parts, sort_keys=True, default=repr))


def key_of(parts: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode("utf-8")).hexdigest()[:32]


def path_of(key: str) -> Path:
    return folder() / f"{key}.json"


def read(parts: dict[str, Any]) -> Verdict | None:
    """The stored verdict for `parts`, or None (a miss) for anything else."""
    try:
        entry = _read_json(path_of(key_of(parts)))
    except Exception:
        return None
    if not isinstance(entry, dict) or entry.get("parts") != parts or not isinstance(entry.get("crashed"), bool):
        return None
    reason = entry.get("reason", "")
    if not isinstance(reason, str) or not unseal(_sealed_text(parts, entry["crashed"], reason), entry.get("seal")):
        return None  # edited, another user's, or never sealed: the child runs again
    return Verdict(entry["crashed"], printable(reason))  # shown in the report: no terminal obeys it


def _sealed_text(parts: dict[str, Any], crashed: bool, reason: str) -> bytes:
    """What a verdict's seal covers."""
    return json.dumps({"parts": parts, "crashed": crashed, "reason": reason}, sort_keys=True).encode("utf-8")


def write(parts: dict[str, Any], verdict: Verdict) -> bool:
    """Stores `verdict` atomically (over whatever was there); False when it could not."""
    path = path_of(key_of(parts))
    sealed = seal(_sealed_text(parts, verdict.crashed, verdict.reason))
    if sealed is None:
        return False  # no key: an unsealed verdict would never be honoured
    text = json.dumps({"parts": parts, "crashed": verdict.crashed, "reason": verdict.reason, "seal": sealed},
                      sort_keys=True)
    try:
        return write_cached(path, text.encode("utf-8"), "the isolated build's verdict")
    except OSError:
        return False


TIMES = "times.json"
"""How long finished isolated children took, per backend class and child kind (isolation's bound)."""


def _read_json(path: Path) -> Any:
    """The JSON in `path`, or None: never fails and never blocks (see the module docs); a link
    planted in the folder is not followed (storage.read_cached)."""
    try:
        return json.loads(read_cached(path, settings.VERDICT_MAX_BYTES).decode("utf-8"))
    except Exception:
        return None


def _times_key(backend: Any, how: str) -> str:
    return f"{_class_path(type(backend))} {how}"


def rates(backend: Any, how: str) -> list[float]:
    """Seconds per unit of size (see isolation.size_units) that the last finished children of
    this backend class and child kind ("fork", "spawn") took; empty when none is recorded."""
    found = _read_json(folder() / TIMES)
    if not isinstance(found, dict):
        return []
    kept = found.get(_times_key(backend, how))
    if not isinstance(kept, list):
        return []
    return [float(r) for r in kept if isinstance(r, (int, float)) and not isinstance(r, bool) and 0 <= r < 1e6]


def record_rate(backend: Any, how: str, rate: float) -> bool:
    """Adds a finished child's seconds per unit of size to the record (the last VERDICT_KEPT_TIMES per
    backend class and child kind); False when it could not be stored."""
    path = folder() / TIMES
    found = _read_json(path)
    if not isinstance(found, dict):
        found = {}
    key = _times_key(backend, how)
    found[key] = (rates(backend, how) + [round(float(rate), 6)])[-settings.VERDICT_KEPT_TIMES:]
    while len(json.dumps(found)) > settings.VERDICT_MAX_BYTES // 2 and len(found) > 1:  # the oldest classes go first
        del found[next(k for k in found if k != key)]
    try:
        return write_cached(path, json.dumps(found, sort_keys=True).encode("utf-8"), "the isolated builds' times")
    except OSError:
        return False


def clear() -> int:
    """Removes every stored verdict; returns how many."""
    removed = 0
    for name in listed_cached(folder()):
        if name.endswith(".json") and remove_cached(folder() / name):
            removed += name != TIMES
    return removed
