"""The tuning cache: a second tt.tweak of the same model reuses what the first measured.

An entry is a JSON file ``<cache>/tweaks/<key>.json`` (the cache folder is
``$TORCH_TWEAK_CACHE``, else ``~/.cache/torch-tweak``). Its key is the hash of
everything that can change a tweak's result (see key_parts); the entry repeats those
parts, and an entry whose parts differ from the tweak's is never used. A hit wraps the
cached depth's modules, records the dataset once, builds each chosen backend again on
it (Inductor's own cache makes the compile fast; a device graph records again) and
checks it against the original outputs, with no measurement. Entries hold plain JSON
only, and a hit builds only backends of the tweak's own strategy.

It is a cache: an entry that cannot be read, parsed or applied (damaged, a FIFO, a link to
a device, nested too deep, of another shape) is a miss, dropped and written again; never an
error and never a hang. An entry records how good its figures were (the result's
measurement_quality): one whose side-by-side figures never agreed with the search's, or that
kept the model untuned, is never replayed (the next tweak measures again: each may have
been a busy moment); one measured while other processes took more than a quarter of the
CPUs ("busy", its figure from paired rounds) is replayed, marked busy, only while the
machine is still busy (cpu_load.share_now), and measured again as soon as it is quiet (or
its load unknown); one with a failed module or depth is reused for at most CACHE_RETRY_AFTER
seconds, then tuned again.
"""

from __future__ import annotations

import datetime
import hashlib
import importlib.metadata
import json
import logging
import math
import time
import warnings
from pathlib import Path
from typing import Any, Sequence

import torch
from torch import nn

from .. import _C
from .._core import cpu_load, settings
from .._core._samples import Call
from ..backends import registry
from .._core.storage import cache_dir, listed_cached, printable, read_cached, remove_cached, write_cached
from .._search import plan as planning
from .._search.plan import ModulePlan, Plan, PlanError, RebuildFailed, plan_of
from .._view.report import ModuleResult, ModuleResults, SignatureResult
from .._view.result import TweakResult
from .._core.schema import fingerprint
from .serial import Unstorable, class_path, describe_backend, device_name, dumps, loads
from .._core.signatures import SignatureGroup, describe_call
from ..backends.strategy import Strategy, default_strategy

ENTRY_VERSION = 6
"""6: an entry keeps the numbers of its result (the engine's, per depth, and per module), never
its table or outcome as text: a hit has the engine build the result again from them, checked
(_C.restore_result), and its text is written again from them; 5 kept the text, which a forged
entry could make anything. 4: the calls of one shape class whose sizes vary are one group
(signatures.merge_varying). An entry of an older version is a miss."""
OPTIONAL_PACKAGES = registry.optional_packages()
"""The packages of the backends on an optional install (their registrations'): their presence
changes which default backends build, so their versions are in the key."""
REPLAYED = ("consistent", "remeasured")
"""The measurement qualities (TweakResult.measurement_quality) of an entry that is replayed:
not "inconsistent", "busy" (replayed only while the machine is busy: busy_replayed) or
"unchecked"."""


def busy_replayed() -> bool:
    """Whether an entry measured busy is replayed now: only while other processes still take
    more than the engine's busy share of the CPUs. A quiet machine, or a load that cannot be
    read, measures it again, so that a quiet figure replaces it."""
    share = cpu_load.share_now()
    return share is not None and share > _C.BUSY_SHARE
_SCALARS = (bool, int, float, str, type(None))
logger = logging.getLogger("torch_tweak")


def folder() -> Path:
    return cache_dir() / "tweaks"


def key_parts(model: nn.Module, calls: Sequence[Call], device: torch.device, strategy: Strategy | None,
              options: dict[str, Any]) -> dict[str, Any]:
    """Everything a tweak's result depends on, as JSON; Unstorable when a backend config has
    a value with no JSON form (that tweak is not cached)."""
    from .._version import __version__

    template = strategy if strategy is not None else default_strategy(device)
    packages = {}
    for name in OPTIONAL_PACKAGES:
        try:
            packages[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            packages[name] = None
    tensors = [[name, list(t.shape), str(t.dtype), t.device.type]
               for name, t in list(model.named_parameters()) + list(model.named_buffers())]
    parts = {
        "version": ENTRY_VERSION,
        "torch_tweak": __version__,
        "torch": torch.__version__,
        "device": {"type": device.type, "name": device_name(device)},
        "modules": [[path, class_path(type(m)), module_state(m)] for path, m in model.named_modules()],
        "tensors": tensors,
        "inputs": [describe_call(args, kwargs) for args, kwargs in calls],
        "strategy": {"class": class_path(type(template)), "kind": template.kind,
                     "backends": [describe_backend(b) for b in template.candidates(device)]},
        "settings": options,
        "tolerances": {str(k): v for k, v in settings.TOLERANCES.items()},
        "packages": packages,
    }
    return json.loads(dumps(_plain(parts)))  # the form an entry read back has


def module_state(module: nn.Module) -> dict[str, Any]:
    """What in a module changes its behaviour beyond its weights: its ``training`` flag and
    other plain attributes (scalars, tuples of them: eps, p, stride...), and a fingerprint of
    its ``config`` object (transformers' config.to_dict(): use_cache, attention kind...)."""
    state: dict[str, Any] = {}
    for name, value in vars(module).items():
        if name.startswith("_"):
            continue
        if type(value) in _SCALARS or (type(value) in (tuple, list) and all(type(v) in _SCALARS for v in value)
                                       and len(value) <= 16):
            state[name] = value
    config = getattr(module, "config", None)
    if config is not None and not isinstance(config, (torch.Tensor, nn.Module)):
        to_dict = getattr(config, "to_dict", None)
        try:
            shown = to_dict() if callable(to_dict) else vars(config)
        except Exception:  # a config that cannot describe itself: its repr
            shown = repr(config)
        state["config"] = fingerprint(shown)
    return state


def _plain(value: Any) -> Any:
    """`value` with non-finite floats as strings, so canonical JSON can hold it."""
    if type(value) is float and not math.isfinite(value):
        return repr(value)
    if type(value) in (tuple, list):
        return [_plain(v) for v in value]
    if type(value) is dict:
        return {str(k): _plain(v) for k, v in value.items()}
    return value


def key_of(parts: dict[str, Any]) -> str:
    return hashlib.sha256(dumps(parts)).hexdigest()[:32]


def read(key: str, parts: dict[str, Any]) -> dict | None:
    """The entry for `key` when its parts are exactly `parts` and it may still be reused;
    None otherwise. Whatever is wrong with the entry, the answer is a miss."""
    path = folder() / f"{key}.json"
    try:
        entry = loads(read_cached(path, settings.CACHE_MAX_ENTRY_BYTES))
    except FileNotFoundError:
        return None
    except Exception:  # a FIFO, a device, too large, not JSON, too deep...: tune afresh and write it again
        drop(key)
        return None
    if type(entry) is not dict or entry.get("version") != ENTRY_VERSION or entry.get("parts") != parts:
        return None
    busy = entry.get("quality") == "busy" and type(entry.get("kept_depth")) is int
    if busy and busy_replayed():
        logger.info("tuning cache entry %s measured busy, replayed: the machine is still busy", key)
    elif entry.get("quality") not in REPLAYED or type(entry.get("kept_depth")) is not int:
        # figures from a busy moment, or a model kept untuned (perhaps for one): measured again
        why = ("kept the model untuned" if type(entry.get("kept_depth")) is not int
               else "was measured on a busy machine, and the machine is quiet now (or its load unknown)"
               if entry.get("quality") == "busy"
               else "has inconsistent figures")
        logger.info("tuning cache entry %s not replayed: it %s; measuring again", key, why)
        drop(key)
        return None
    retry = entry.get("retry_after")
    if retry is not None and not (type(retry) in (int, float) and time.time() < retry):
        drop(key)  # a result with failures is tried again
        return None
    return entry


def write(key: str, entry: dict) -> None:
    """Writes an entry atomically, never through a link planted in the folder
    (storage.write_cached); a failure only warns."""
    target = folder() / f"{key}.json"
    try:
        write_cached(target, json.dumps(entry, indent=1).encode("utf-8"), "the tuning cache entry")
    except OSError as exc:
        warnings.warn(f"torch-tweak could not write the tuning cache entry {target}: {exc}", stacklevel=3)


def drop(key: str) -> None:
    """Removes an entry: a link is removed, not what it points to; an empty folder in its place too."""
    remove_cached(folder() / f"{key}.json")


def clear_cache() -> int:
    """Removes every tuning-cache entry (not the build logs); returns how many."""
    removed = 0
    for name in listed_cached(folder()):
        if name.endswith((".json", ".tmp")) and remove_cached(folder() / name):
            removed += name.endswith(".json")
    return removed


def entry_of(parts: dict, record_: dict, modules: ModuleResults, model: nn.Module,
             kept_depth: int | None = None) -> dict:
    """The entry of a finished tweak: its result, its module table, what the model kept, and
    how good its figures were (read() replays only an entry with a kept depth whose figures
    agreed with the search's)."""
    plan = [{"path": m.path, "signatures": [
                {"key": g.key, "text": g.text, "backend": None if g.backend is None else describe_backend(g.backend)}
                for g in m.groups]}
            for m in plan_of(model).modules]
    failed = (not plan or any(m.error for m in modules.values())
              or any(row.get("error") for row in record_.get("rows", [])))
    return {"version": ENTRY_VERSION, "parts": parts,
            "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "retry_after": time.time() + settings.CACHE_RETRY_AFTER if failed else None,
            "quality": record_.get("quality"), "kept_depth": kept_depth,
            "result": record_, "modules": [module_tree(m) for m in modules.values()], "plan": plan}


def module_tree(result: ModuleResult) -> dict:
    return {"path": result.path, "backend": result.backend, "error": result.error,
            "candidates": list(result.candidates), "depths": list(result.depths), "kept": result.kept,
            "signatures": [{"text": s.text, "key": s.key, "backend": s.backend, "error": s.error,
                            "candidates": list(s.candidates), "unstorable": s.unstorable}
                           for s in result.signatures]}


def module_results(entry: dict) -> ModuleResults:
    """The entry's module table, every value checked (ValueError for one of another shape) and
    every text made printable: a file's text reaches no terminal as it is."""
    results = ModuleResults()
    kept = entry["kept_depth"]
    results.kept_depth = kept if type(kept) is int else None
    if type(entry["modules"]) is not list:
        raise ValueError("an entry's modules are a list")
    for m in entry["modules"]:
        signatures = tuple(SignatureResult(_text(s["text"]), _text(s["key"]), _text_or_none(s["backend"]),
                                           _text(s["error"]), tuple(_candidate(c) for c in _list(s["candidates"])),
                                           _count(s["unstorable"])) for s in _list(m["signatures"]))
        depths = _list(m["depths"])
        if not all(type(d) is int for d in depths) or type(m["kept"]) is not bool:
            raise ValueError("a module's depths are ints, and whether it was kept a bool")
        results[_text(m["path"])] = ModuleResult(
            _text(m["path"]), _text_or_none(m["backend"]), _text(m["error"]),
            tuple(_candidate(c) for c in _list(m["candidates"])), signatures, tuple(depths), m["kept"])
    return results


_CANDIDATE_TEXTS = ("backend", "state", "error", "reason", "signature")
_CANDIDATE_NUMBERS = ("latency_ms", "max_error", "tolerance", "own_error")


def _candidate(found: Any) -> dict:
    """A candidate's dict of an entry (report.SignatureResult's form), its keys checked: texts
    printable, numbers finite (or None), lowers_precision a bool."""
    if type(found) is not dict or not all(type(found.get(k)) is str for k in _CANDIDATE_TEXTS[:4]):
        raise ValueError("a candidate is a dict with its backend, state, error and reason")
    checked: dict[str, Any] = {k: _text(found[k]) for k in _CANDIDATE_TEXTS if k in found}
    for k in _CANDIDATE_NUMBERS:
        value = found.get(k)
        if value is not None and not (type(value) in (int, float) and math.isfinite(value)):
            raise ValueError(f"a candidate's {k} is a finite number or None")
        checked[k] = value
    if type(found.get("lowers_precision", False)) is not bool:
        raise ValueError("a candidate's lowers_precision is a bool")
    checked["lowers_precision"] = found.get("lowers_precision", False)
    return checked


def _text(value: Any) -> str:
    if type(value) is not str:
        raise ValueError(f"a text of an entry is {type(value).__name__}")
    return printable(value)


def _text_or_none(value: Any) -> str | None:
    return None if value is None else _text(value)


def _list(value: Any) -> list:
    if type(value) is not list:
        raise ValueError(f"a list of an entry is {type(value).__name__}")
    return value


def _count(value: Any) -> int:
    if type(value) is not int or value < 0:
        raise ValueError("a count of an entry is an int >= 0")
    return value


def result_of(entry: dict, tree: Any) -> TweakResult:
    """The entry's TweakResult, marked cached (measured_at: the entry's time): built again by
    the engine from its numbers (TweakResult.from_record), its modules checked (module_results);
    ValueError or TypeError for an entry whose parts are of another shape, or whose kept depth
    and quality are not the ones its numbers give."""
    result = TweakResult.from_record(entry["result"], tree, module_results(entry), entry.get("created"))
    if result.selected_depth != entry["kept_depth"] or result.measurement_quality != entry.get("quality"):
        raise ValueError("an entry's kept depth or quality is not the one its figures give")
    return result


def _matching(strategy: Strategy, device: torch.device, wanted: dict):
    """The strategy's own candidate that the entry names, or None."""
    for backend in strategy.fresh().candidates(device):
        try:
            if json.loads(dumps(describe_backend(backend))) == wanted:
                return backend
        except Unstorable:
            continue
    return None


def plan_of_entry(entry: dict, strategy: Strategy | None, device: torch.device) -> Plan:
    """The entry's Plan, each backend one of the tweak's own strategy's candidates with the
    cached config (PlanError when the strategy has none). It holds no recorded calls: the
    dataset is recorded again when it is applied."""
    template = strategy if strategy is not None else default_strategy(device)
    reports = {m["path"]: m for m in entry["modules"]}
    modules = []
    for item in entry["plan"]:
        report = reports.get(item["path"], {"candidates": [], "error": "", "signatures": []})
        stored = {s["key"]: s for s in report["signatures"]}
        groups = []
        for want in item["signatures"]:
            backend = None
            if want["backend"] is not None:
                backend = _matching(template, device, want["backend"])
                if backend is None:
                    raise PlanError(f"the strategy has no backend {printable(str(want['backend'].get('class')))[:200]} "
                                    "with the cached config")
            info = stored.get(want["key"], {})
            groups.append(SignatureGroup(None, _text(want["text"]), _text(want["key"]), backend=backend,
                                         error=_text(info.get("error", "")),
                                         report=[_candidate(c) for c in _list(info.get("candidates", []))],
                                         unstorable=_count(info.get("unstorable", 0))))
        modules.append(ModulePlan(item["path"], groups, _text(report["error"]),
                                  [_candidate(c) for c in _list(report["candidates"])]))
    return Plan(module_results(entry).kept_depth, modules, shapes=template.shapes)  # shapes: part of the key


def apply(entry: dict, model: nn.Module, calls: Sequence[Call], device: torch.device,
          strategy: Strategy | None) -> str | None:
    """Applies the entry's plan (plan.apply: its modules wrapped, the dataset recorded once,
    each backend built again and checked, no measurement); None when that worked, else why
    not (the model is then as it was)."""
    try:
        planning.apply(model, plan_of_entry(entry, strategy, device), device=device, calls=calls)
    except RebuildFailed as failure:
        return (f"{failure.backend.name} for {failure.path or '(root)'} failed when built again: "
                f"{failure.cause if failure.cause is not None else failure}")
    except PlanError as exc:
        return str(exc)
    except Exception as exc:  # whatever went wrong, a fresh tweak follows
        return f"{type(exc).__name__}: {exc}"
    return None
