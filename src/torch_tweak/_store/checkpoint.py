"""tt.save and tt.load: a tuned model's plan in one file, for production.

The file is a zip archive (docs/deployment.md):
- ``manifest.json``: format, versions, device, model class, creation time, and the sha256
  of every other member, checked on load;
- ``plan.json``: the depth kept and, per wrapped module, its class, its parameter and buffer
  shapes, and per input signature the backend (class and schema-checked config, free-form
  values only as fingerprints) and the recorded calls and original outputs, with tensors as
  references into
- ``samples.safetensors``: those tensors (safetensors: reading it executes nothing);
- ``artifacts/inductor.bin`` (optional): Inductor's compiled-code cache
  (torch.compiler.save_cache_artifacts). It holds compiled code and pickled data, so
  tt.load applies it only with ``trust_artifacts=True``.
The zip comment, last in the file, holds the sha256 of every byte before it and, for a file
saved with a key, their HMAC-SHA256.

Loading reads the file once, bounded, checks it whole, then applies its plan (plan.apply): each
backend is built again on the stored calls and checked against the stored outputs; a signature
whose rebuilt backend fails runs the original forward, with a warning.
"""

from __future__ import annotations

import datetime
import hashlib
import hmac
import io
import logging
import os
import re
import time
import warnings
import zipfile
from pathlib import Path
from typing import Any, Sequence

import torch
from torch import nn

from .._core._samples import resolve_device, unstorable
from ..backends import Backend
from . import archive
from .._core import correctness, distributed, records, settings
from .._core.storage import NotRegular, atomic_file, printable
from .._runtime.module import installed, own_class, resolve_paths
from .._search import plan as planning
from .._runtime.decode.call import check_bounds
from .._runtime.decode.inputs import check_layouts
from .._runtime.decode.fused_loop import KERNELS
from .._runtime.decode.loop import FUSED, LOOPS
from .._search.plan import LoadResult, LoopPlan, ModulePlan, Plan, Rebuilt, plan_of
from .._core.shapes import Shapes, check_shapes, positions
from .serial import (Unstorable, build_backend, class_path, decode, describe_backend,
                     device_name, dumps, encode, known_types, loads)
from .._core import signatures
from .._core.signatures import OTHER, SignatureGroup, call_form, forward_params, make_signature, proven_signatures
from .._version import __version__

FORMAT = "torch-tweak"
VERSION = 2
READABLE = (1, 2)
"""Format 2 adds the sealed zip comment; files of format 1 (no comment) still load."""
MANIFEST = "manifest.json"
PLAN = "plan.json"
SAMPLES = "samples.safetensors"
ARTIFACTS = "artifacts/inductor.bin"
MEMBERS = (MANIFEST, PLAN, SAMPLES, ARTIFACTS)
_SEAL = re.compile(rb"torch-tweak sha256=([0-9a-f]{64}) hmac=([0-9a-f]{64}|-{64})")
_SEAL_LENGTH = len(b"torch-tweak sha256= hmac=") + 128
logger = logging.getLogger("torch_tweak")


class CheckpointError(ValueError):
    """A file tt.load cannot use: not a torch-tweak file, damaged, forged, unsigned when a
    key was given, or for another model or machine. The model is left as it was. Its message
    quotes the file's own text only printable (storage.printable)."""

    def __init__(self, message: str = "") -> None:
        super().__init__(printable(message))


def _key_bytes(key: Any) -> bytes | None:
    if key is None:
        return None
    if isinstance(key, str):
        key = key.encode("utf-8")
    if not isinstance(key, (bytes, bytearray)):
        raise TypeError(f"key must be bytes or str (a secret of your deployment), not {type(key).__name__}")
    if len(key) == 0:
        raise ValueError("key is empty; use a secret of at least 16 random bytes, e.g. os.urandom(32)")
    return bytes(key)


def _seal(data: bytes, key: bytes | None) -> bytes:
    """A zip archive's bytes with its comment set to the seal of every byte before it."""
    archive = io.BytesIO(data)
    with zipfile.ZipFile(archive, "a") as z:
        z.comment = b"-" * _SEAL_LENGTH
    data = archive.getvalue()
    body = data[:-_SEAL_LENGTH]
    mac = b"-" * 64 if key is None else hmac.new(key, body, hashlib.sha256).hexdigest().encode()
    return body + b"torch-tweak sha256=" + hashlib.sha256(body).hexdigest().encode() + b" hmac=" + mac


def model_bytes(model: nn.Module) -> int:
    """The bytes of the model's parameters and buffers."""
    return sum(t.numel() * t.element_size() for t in list(model.parameters()) + list(model.buffers()))


def default_max_bytes(model: nn.Module) -> int:
    """The largest file tt.load reads for `model` unless told: 4 x its weights + 256 MiB."""
    return 4 * model_bytes(model) + settings.LOAD_SLACK_BYTES


# ------------------------------------------------------------------ save


def save(model: nn.Module, path: str | os.PathLike, *, key: bytes | str | None = None,
         strict: bool = False, group: Any = None) -> None:
    """Writes the tuned model's plan, recorded calls and artifacts to `path`, atomically.

    The file is written to a temporary file in the same folder, synced, then renamed over
    `path`: an interrupted save leaves any earlier file at `path` as it was. key: a secret;
    the file then carries an HMAC-SHA256 of all its bytes, and tt.load(..., key=key) refuses
    any file not sealed with it. Calls and outputs are stored with their tensors, tuples,
    lists, dicts, named tuples, dataclasses (transformers' ModelOutputs) and key/value caches
    in outputs; a recorded call that cannot be stored (a cache passed in is live state) is
    named in a warning, or a ValueError with strict=True, before anything is written.
    Under torch.distributed (``group``: None, the default group when one is initialised;
    False: none; or a ProcessGroup) the file says this process's rank and the world size, and
    tt.load takes it only on that rank of a run as large: save one file per rank.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, not {type(model).__name__}")
    secret = _key_bytes(key)
    if not isinstance(strict, bool):
        raise TypeError(f"strict must be True or False, not {strict!r}")
    where = distributed.position(group)  # (rank, world size) under torch.distributed, else None
    tuned = plan_of(model)
    record = records.of(model)
    if not tuned.modules and (record is None or not record.decided):  # an untuned outcome is saved too
        raise ValueError("nothing to save: the model has no torch-tweak wrappers; tune it first (tt.tweak)")
    device = resolve_device(model, None)
    tensors: list[torch.Tensor] = []
    modules = []
    inductor = False
    skipped: dict[tuple[str, str], set[str]] = {}
    for planned in tuned.modules:
        name = planned.path
        signatures = []
        for group in planned.groups:
            signatures.append(_signature_entry(name, group, tensors, skipped))
            inductor |= group.backend is not None and group.backend.compiles_with_inductor
        module = model.get_submodule(name) if name else model
        modules.append({"path": name, "class": class_path(own_class(module)), "params": _params(module),
                        "signatures": signatures})
    if skipped:
        lines = "; ".join(f"{where or '(root)'} {text}: {', '.join(sorted(kinds))}"
                          for (where, text), kinds in sorted(skipped.items()))
        message = (f"some recorded calls cannot be stored in {path}, because they hold values that are live "
                   f"state or have no stored form ({lines}); after tt.load, a signature with no stored call "
                   "runs the original forward")
        if strict:
            raise ValueError(message + "; save with strict=False to write the file anyway")
        warnings.warn(message, stacklevel=2)
    plan = {"depth": tuned.depth, "modules": modules}
    if tuned.tolerance != "measured":
        plan["tolerance"] = tuned.tolerance
    if tuned.shapes is not None:
        plan["shapes"] = tuned.shapes.as_dict()
    if tuned.generate is not None:
        plan["generate"] = _loop_entry(tuned.generate, tensors, path, strict)
    members = {PLAN: dumps(plan), SAMPLES: _tensor_bytes(tensors)}
    if inductor:
        artifacts = torch.compiler.save_cache_artifacts()
        if artifacts is not None:
            members[ARTIFACTS] = bytes(artifacts[0])
    manifest = {
        "format": FORMAT, "version": VERSION, "torch": torch.__version__, "torch_tweak": __version__,
        "device": {"type": device.type, "name": device_name(device)},
        "model": class_path(own_class(model)),
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "members": {name: hashlib.sha256(data).hexdigest() for name, data in members.items()},
    }
    if where is not None:
        manifest["ranks"] = {"rank": where[0], "world_size": where[1]}
    data = _seal(_zip({MANIFEST: dumps(manifest), **members}), secret)
    with atomic_file(Path(path)) as f:
        f.write(data)
    if len(data) > default_max_bytes(model):
        warnings.warn(f"{path} is {len(data)} bytes, more than tt.load reads by default for this model "
                      f"({default_max_bytes(model)}: 4 x its weights + 256 MiB); load it with "
                      f"tt.load(model, path, max_bytes={len(data)})", stacklevel=2)


def _signature_entry(name: str, group: Any, tensors: list[torch.Tensor],
                     skipped: dict[tuple[str, str], set[str]]) -> dict[str, Any]:
    """The plan's entry of one signature group of the module at `name`: its backend and the
    recorded calls and outputs it can keep (their tensors appended to `tensors`); a call that
    cannot be stored is named in `skipped` instead."""
    entry: dict[str, Any] = {"text": group.text, "key": group.key, "backend": None, "samples": [],
                             "outputs": []}
    if group.varying:
        entry["varying"] = True  # one shape class, the axes that varied left free
    if group.backend is not None:
        entry["backend"] = describe_backend(group.backend)
        for sample, output in zip(group.samples, group.outputs):
            live = unstorable(sample)  # a cache passed in is live state: no call replays it
            if live is not None or not group.backend.can_store(sample):
                skipped.setdefault((name, group.text), set()).add(live or "a value its backend cannot keep")
                continue
            mark = len(tensors)
            try:
                stored = encode(sample, tensors), encode(output, tensors)
            except Unstorable as exc:
                del tensors[mark:]
                skipped.setdefault((name, group.text), set()).add(str(exc))
                continue
            entry["samples"].append(stored[0])
            entry["outputs"].append(stored[1])
    return entry


def _loop_entry(loop: LoopPlan, tensors: list[torch.Tensor], path: Any, strict: bool) -> dict:
    """The decode loop as the plan's JSON: its kind, layouts and the generate() calls (with
    their tokens) it is checked on again at load."""
    checks = []
    for args, kwargs, tokens in loop.checks:
        mark = len(tensors)
        try:
            checks.append({"call": encode((tuple(args), dict(kwargs)), tensors), "tokens": encode(tokens, tensors)})
        except Unstorable as exc:
            del tensors[mark:]
            message = (f"a generate() call of tweak's decode loop cannot be stored in {path} ({exc}); tt.load "
                       "checks the loop on the stored calls and installs it only when one is stored")
            if strict:
                raise ValueError(message + "; save with strict=False to write the file anyway") from None
            warnings.warn(message, stacklevel=3)
    layouts = None if loop.layouts is None else {
        phase: [[name, list(spec)] for name, spec in layout] for phase, layout in loop.layouts.items()}
    entry = {"kind": loop.kind, "layouts": layouts, "checks": checks}
    if loop.top_sampler:  # absent in files of a loop without it, and in files written before it
        entry["top_sampler"] = True
    if loop.kernels is not None:  # the fused loop's alone (absent in files written before it)
        entry["kernels"] = loop.kernels
    return entry


def _params(module: nn.Module) -> dict[str, list]:
    return {name: [list(t.shape), str(t.dtype).removeprefix("torch.")]
            for name, t in list(module.named_parameters()) + list(module.named_buffers())}


def _tensor_bytes(tensors: list[torch.Tensor]) -> bytes:
    from safetensors.torch import save as save_tensors

    # Copies: safetensors wants contiguous tensors on the CPU that share no storage.
    return save_tensors({f"t{i}": t.detach().to("cpu").contiguous().clone() for i, t in enumerate(tensors)})


def _zip(members: dict[str, bytes]) -> bytes:
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w") as archive:
        for name, data in members.items():
            compress = zipfile.ZIP_DEFLATED if name.endswith(".json") else zipfile.ZIP_STORED
            archive.writestr(zipfile.ZipInfo(name, (1980, 1, 1, 0, 0, 0)), data, compress_type=compress)
    return out.getvalue()


# ------------------------------------------------------------------ reading


def _read(path: str | os.PathLike, limit: int, key: bytes | None, *, tensors: bool = True,
          artifacts: bool = False) -> tuple[dict, dict, dict[str, Any]]:
    """(manifest, plan, the other members) of a file whose seal and hashes match: SAMPLES as
    {name: tensor} (with `tensors`), ARTIFACTS as bytes (with `artifacts`).

    archive.read reads the file once, bounded by `limit`: its zip directory is checked (at
    most 4 entries, MAX_DIRECTORY_BYTES) before anything is built, each member's real
    inflated size is capped while it is read whatever the archive declares, the tensors are
    read straight into their own memory, and a member not wanted is only hashed."""
    json_cap = min(limit, settings.MAX_JSON_BYTES)
    sinks = {MANIFEST: archive.Inflated(json_cap), PLAN: archive.Inflated(json_cap),
             SAMPLES: archive.Tensors(json_cap, loads) if tensors else archive.Skip(),
             ARTIFACTS: archive.Inflated(limit) if artifacts else archive.Skip()}
    try:
        got = archive.read(path, limit, sinks, max_entries=len(MEMBERS),
                           max_directory_bytes=settings.MAX_DIRECTORY_BYTES,
                           methods=_methods, key=key)
    except FileNotFoundError:
        raise
    except NotRegular as exc:
        raise CheckpointError(f"{exc}; tt.load reads only files written by tt.save (a larger file you trust: "
                              "max_bytes=)") from None
    except archive.TooLarge as exc:
        raise CheckpointError(f"{path} is not a torch-tweak file: {exc} (a file written by torch.save is not one: "
                              "save with tt.save)") from None
    except archive.ArchiveError as exc:
        raise CheckpointError(f"{path} is not a torch-tweak file, or it is truncated or damaged: {exc}") from None
    except OSError as exc:
        raise CheckpointError(f"{path} cannot be read: {exc}") from None
    if MANIFEST not in got.names:
        raise CheckpointError(f"{path} is not a torch-tweak file (it has no {MANIFEST}); a file written by "
                              "torch.save is not one: save with tt.save")
    sealed = _check_seal(got, key, path)  # a sealed file's bytes are checked before any member is parsed
    if MANIFEST in got.errors:
        raise CheckpointError(f"{path} is not a torch-tweak file, or it is damaged: {got.errors[MANIFEST]}")
    manifest = _json(got.values[MANIFEST], MANIFEST, path, settings.MAX_MANIFEST_VALUES)
    if type(manifest) is not dict or manifest.get("format") != FORMAT:
        raise CheckpointError(f"{path} is not a torch-tweak file (its manifest is not one)")
    version = manifest.get("version")
    if type(version) is not int or version not in READABLE:
        raise CheckpointError(f"{path} is a torch-tweak file of format version {str(version)[:20]}; "
                              f"this torch-tweak reads versions {', '.join(map(str, READABLE))}")
    if not sealed and version >= 2:
        raise CheckpointError(f"{path} is damaged: its seal (the zip comment) is missing or altered")
    if not sealed and key is not None:
        raise CheckpointError(f"{path} is not signed (it was saved before torch-tweak sealed its files); "
                              "save it again with tt.save(model, path, key=...)")
    hashes = manifest.get("members")
    if type(hashes) is not dict or set(hashes) != set(got.names) - {MANIFEST} or PLAN not in hashes:
        raise CheckpointError(f"{path} is damaged: its members are not the ones its manifest lists")
    for name in sorted(hashes):
        if type(hashes[name]) is not str or got.digests.get(name, hashes[name]) != hashes[name]:
            raise CheckpointError(f"{path} is damaged or was changed: the sha256 of {name} does not match "
                                  "its manifest")
        if name in got.errors:
            raise CheckpointError(f"{path}: {got.errors[name]}")
    plan = _json(got.values.pop(PLAN), PLAN, path)
    depth = plan.get("depth") if type(plan) is dict else None
    if type(plan) is not dict or type(plan.get("modules")) is not list or not (
            depth is None or (type(depth) is int and 0 <= depth <= 1000)):
        raise CheckpointError(f"{path}: {PLAN} is not a torch-tweak plan")
    return manifest, plan, {n: v for n, v in got.values.items() if n != MANIFEST and v is not None}


def _methods(name: str) -> tuple[int, ...]:
    """The compression tt.save uses: JSON deflated (or stored), everything else stored."""
    return (zipfile.ZIP_STORED, zipfile.ZIP_DEFLATED) if name.endswith(".json") else (zipfile.ZIP_STORED,)


def _check_seal(got: archive.Read, key: bytes | None, path: Any) -> bool:
    """Whether the file is sealed (its comment holds the seal, which must match its bytes,
    and its HMAC with `key` when given); False for a file with no comment (format 1)."""
    if not got.comment:
        return False
    seal = _SEAL.fullmatch(got.comment)
    if seal is None:
        raise CheckpointError(f"{path} is damaged: its seal (the zip comment) is missing or altered")
    if not hmac.compare_digest(got.body_sha256.encode(), seal[1]):
        raise CheckpointError(f"{path} is damaged or was changed: the sha256 of its bytes does not match its seal")
    if key is None:
        return True
    if seal[2] == b"-" * 64:
        raise CheckpointError(f"{path} is not signed, and a key was given: load only files saved with "
                              "tt.save(model, path, key=...)")
    if not hmac.compare_digest(str(got.body_hmac).encode(), seal[2]):
        raise CheckpointError(f"{path} was not signed with this key: it was written by someone without it, or "
                              "changed since")
    return True


def _json(data: bytes | bytearray, name: str, path: Any, max_values: int | None = None) -> Any:
    try:
        return loads(data, max_values=max_values)
    except ValueError as exc:  # UnicodeDecodeError and JSONDecodeError are ValueErrors
        raise CheckpointError(f"{path} is not a torch-tweak file: {name} is not JSON it can read "
                              f"({str(exc)[:200]})") from None


def read_summary(path: str | os.PathLike, *, key: bytes | str | None = None,
                 max_bytes: int = 1 << 32) -> dict:
    """{"manifest": ..., "plan": ..., "refused": ...} of a torch-tweak file, its seal and hashes
    checked; loads no tensor. refused: why tt.load refuses its plan's layout (its modules'
    signatures and stored calls past what tt.save writes: _layout_problem), else None."""
    try:
        manifest, plan, _ = _read(path, max_bytes, _key_bytes(key), tensors=False)
    except (CheckpointError, FileNotFoundError, TypeError):
        raise
    except Exception as exc:
        raise CheckpointError(f"{path} could not be read: {type(exc).__name__}: {str(exc)[:200]}; "
                              f"{_unwritten(None)}") from None
    problem = _layout_problem(plan)
    return {"manifest": manifest, "plan": plan,
            "refused": None if problem is None else f"{problem}: {_unwritten(manifest)}"}


def _unwritten(manifest: dict | None) -> str:
    """Why a file whose bytes match its seal holds what tt.load refuses: the version that wrote
    it (from its manifest), or, for one this version wrote, a change after tt.save."""
    saved = None if manifest is None else manifest.get("torch_tweak")
    if type(saved) is str and saved != __version__:
        saved = saved[:40]
        return (f"the file was written by torch-tweak {saved}, and this is torch-tweak {__version__}: save it "
                "again with this version (tune the model again here)")
    return ("torch-tweak's tt.save does not write that: the file was changed after it was saved (and its seal "
            "written again), or forged; if tt.save of this version wrote it unchanged, that is a bug of "
            "torch-tweak's to report")


def _layout_problem(plan: dict) -> str | None:
    """What in the plan's module list is past what tt.save writes (signatures.stored_bounds: the
    signatures per module, the stored calls per signature, as many outputs as calls), or None."""
    most_groups, most_calls = signatures.stored_bounds()
    for item in plan.get("modules", []):
        where = (item.get("path") if type(item) is dict and type(item.get("path")) is str else None) or "(root)"
        listed = item.get("signatures") if type(item) is dict else None
        if type(listed) is not list or not all(type(s) is dict for s in listed):
            return f"{where}'s signatures are not a list of signatures"
        if len(listed) > most_groups:
            return f"{where} has {len(listed)} signatures; tt.save writes at most {most_groups} per module"
        for sig in listed:
            calls, outputs = sig.get("samples", []), sig.get("outputs", [])
            if type(calls) is not list or type(outputs) is not list:
                return f"{where}'s stored calls and outputs are not lists"
            if len(calls) > most_calls:
                return (f"{where} has {len(calls)} stored calls for one signature; tt.save writes at most "
                        f"{most_calls} ({settings.MAX_CALLS_PER_SIGNATURE} of the traffic and "
                        f"{settings.MAX_DECLARED_CALLS} at the declared shapes' ends)")
            if len(calls) != len(outputs):
                return f"{where} has {len(calls)} stored calls and {len(outputs)} outputs for one signature"
    return None


# ------------------------------------------------------------------ load


def load(model: nn.Module, path: str | os.PathLike | None = None, *, device: Any = None, trust_artifacts: bool = False,
         backends: Sequence[Backend] | None = None, key: bytes | str | None = None,
         max_bytes: int | None = None, types: Sequence[type] = (), group: Any = None) -> LoadResult:
    """Applies a file written by tt.save to a freshly built `model`, with no tuning.

    Every check (seal and hashes, versions, device, model class, module paths, classes and
    parameter shapes, backends and their configs) runs before the model changes; any failure
    raises CheckpointError and leaves the model as it was. Then each module of the plan is
    wrapped and each backend built again on the stored calls and checked against the stored
    outputs; a signature whose backend fails to build or to match runs the original forward
    (a warning says why). Load the weights (state_dict) before tt.load: backends are built
    on them.

    device: where to build (default: where the model's weights are); its kind must be the
    file's. trust_artifacts: apply the file's compiled-code artifacts (Inductor's cache,
    which holds pickled data) so compiles are fast; only for files you trust.
    backends: the backends the file may use beyond torch-tweak's own with schema-checked
    configs: your own backend classes, opt-in ones (TorchAO), and any backend whose config
    has free-form values (Inductor options, OpenVINO properties), which a file never holds.
    key: refuse the file unless tt.save sealed it with this key (HMAC-SHA256).
    max_bytes: the largest file to read (default: 4 x the model's weights + 256 MiB).
    types: classes of your own (named tuples, dataclasses) that the stored calls and outputs
    may be rebuilt as; transformers' ModelOutputs and torch.return_types need no listing.
    group: under torch.distributed, the ranks that load together (None: the default group
    when one is initialised; False: this process alone; or a ProcessGroup): every rank loads
    the file its own rank saved, in a run of the same world size (else CheckpointError), and
    the backends are built again on every rank together, each step agreed on (a failure on
    one rank is a failure on all). A file saved by a single process loads only alone.
    Returns {path: the backend of its first signature, or None}, a LoadResult that also says
    what the load cost and what it built again (``seconds``, ``rebuilt``, ``summary()``: the
    line it logs at INFO on the logger torch_tweak).
    """
    start = time.perf_counter()
    ranks = distributed.resolve(group, "tt.load")
    with distributed.noted_alone(group, "tt.load"), distributed.using(ranks):
        target, manifest, plan, data, steps, groups, loop, shapes, tolerance = distributed.step(lambda: _opened(
            model, path, device=device, trust_artifacts=trust_artifacts, backends=backends, key=key,
            max_bytes=max_bytes, types=types, where=None if ranks is None else (ranks.rank, ranks.size)),
            "reading the file")
        if ranks is not None:  # before the modules run on them: their collectives pair the calls' tensors
            ranks.same_calls([f"{name or '(root)'} {g.text}: {call_form(call)}" for (name, _), module_groups
                              in zip(steps, groups) for g in module_groups for call in g.samples],
                             "stored in the files")
        read_s = time.perf_counter() - start
        rebuilt: list[Rebuilt] = []
        chosen = _applied(model, path, target, manifest, plan, data, steps, groups, loop, shapes, tolerance,
                          trust_artifacts, rebuilt)
    loaded = LoadResult(chosen, path, time.perf_counter() - start, read_s, rebuilt)
    logger.info("%s", loaded.summary())
    return loaded


def _opened(model: nn.Module, path: Any, *, device: Any, trust_artifacts: bool, backends: Any, key: Any,
            max_bytes: Any, types: Sequence[type], where: tuple[int, int] | None) -> tuple:
    """tt.load's arguments and file checked, before the model changes: (the device, the
    manifest, the plan, the members, the backends per module, the signature groups, the loop,
    the declared shapes, the correctness rule's tolerance)."""
    if path is None and isinstance(model, (str, os.PathLike)):
        raise TypeError("tt.load(model, path) applies a saved file to a model you build first: build the model as "
                        "you did before tt.save (same class, weights loaded), then tt.load(model, "
                        f"{os.fspath(model)!r}); the file holds the tuning decisions, not the model")
    if isinstance(model, (str, os.PathLike)) and isinstance(path, nn.Module):
        raise TypeError(f"tt.load's arguments are swapped: the model comes first, then the file: "
                        f"tt.load(model, {os.fspath(model)!r})")
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, not {type(model).__name__}")
    if path is None:
        raise TypeError("tt.load needs the file to read: tt.load(model, path), path as tt.save wrote it")
    secret = _key_bytes(key)
    given = _given_backends(backends)
    if max_bytes is not None and (type(max_bytes) is not int or max_bytes < 1):
        raise ValueError(f"max_bytes must be a positive int, got {max_bytes!r}")
    if not all(isinstance(t, type) for t in types):
        raise TypeError("types must be a list of classes (named tuples, dataclasses)")
    if installed(model):
        raise ValueError("the model already has torch-tweak wrappers; load into a freshly built model "
                         "(or tt.unwrap(model) first)")
    target = resolve_device(model, device)  # a bad device= fails here, as the caller's mistake
    manifest = None
    try:
        manifest, plan, data = _read(path, default_max_bytes(model) if max_bytes is None else max_bytes, secret,
                                     artifacts=trust_artifacts)
        _check_target(model, target, device is None, manifest, path)
        _check_ranks(manifest, where, path)
        steps = _check_plan(model, plan, given, path, manifest)
        shapes = _shapes_of(plan, path, model)
        tolerance = _rule_of(plan, path).tolerance
        stored = _stored(data, target, path)
        groups = _groups(plan, stored, path, model, known_types(types), manifest)
        _check_bounds(model, steps, groups, shapes, given, path)
        loop = _loop_plan(plan, stored, path, known_types(types), model, manifest)
    except (CheckpointError, FileNotFoundError):
        raise
    except Exception as exc:  # whatever else a file makes a reader raise is one error, and the model is as it was
        raise CheckpointError(f"{path} could not be read: {type(exc).__name__}: {str(exc)[:200]}; "
                              f"{_unwritten(manifest)}") from None
    return target, manifest, plan, data, steps, groups, loop, shapes, tolerance


def _rule_of(plan: dict, path: Any) -> "correctness.Rule":
    """The correctness rule the file was tuned under ("measured" when it names none); a fixed
    tolerance read from it is capped at load (settings.MAX_TOLERANCES)."""
    try:
        return correctness.check_rule(plan.get("tolerance", "measured"))
    except (TypeError, ValueError) as exc:
        raise CheckpointError(f"{path}: its correctness rule is not valid ({exc})") from None


def _applied(model: nn.Module, path: Any, target: torch.device, manifest: dict, plan: dict, data: dict,
             steps: list, groups: list, loop: Any, shapes: Shapes | None, tolerance: str | float,
             trust_artifacts: bool, rebuilt: list[Rebuilt]) -> dict[str, str | None]:
    """The checked file applied to the model (tt.load's second half)."""
    artifacts = data.get(ARTIFACTS)
    if trust_artifacts and artifacts is not None:
        if manifest.get("torch") == torch.__version__:
            torch.compiler.load_cache_artifacts(bytes(artifacts))
        else:
            warnings.warn(printable(f"{path}: its artifacts are for torch {str(manifest.get('torch'))[:40]}, not "
                                    f"{torch.__version__}; they are not applied and the backends compile from "
                                    "scratch"), stacklevel=2)
    modules = []
    for (name, backends), module_groups in zip(steps, groups):
        for group, backend in zip(module_groups, backends):
            group.backend = backend
        modules.append(ModulePlan(name, module_groups))
    failures = planning.apply(model, Plan(plan.get("depth"), modules, loop, shapes, tolerance), device=target,
                              bounded=True, strict=False, rebuilt=rebuilt)
    for failure in failures:
        warnings.warn(printable(f"tt.load: {failure.path or '(root)'} {failure.group.text}: {failure}; these calls "
                                "run the original forward"), stacklevel=2)
    wrappers = installed(model)
    return {m.path: None if wrappers[m.path].tt_backend is None else wrappers[m.path].tt_backend.name
            for m in modules}


def _shapes_of(plan: dict, path: Any, model: nn.Module) -> Shapes | None:
    """The declared shapes the file keeps (tt.tweak's shapes=), checked as tt.tweak checks them,
    and a declared length within the model's positions (shapes.positions)."""
    try:
        shapes = check_shapes(plan.get("shapes"))
    except (TypeError, ValueError) as exc:
        raise CheckpointError(f"{path}: its declared shapes are not valid ({exc})") from None
    table = positions(model)
    if shapes is not None and shapes.length is not None and table is not None and shapes.length[1] > table:
        raise CheckpointError(f"{path}: its declared shapes are refused: length {shapes.length} is past the model's "
                              f"position table ({table} positions); the bound is the model's positions, and tt.save "
                              "never writes such a range")
    return shapes


def _check_bounds(model: nn.Module, steps: list, groups: list, shapes: Shapes | None, given: list[Backend],
                  path: Any) -> None:
    """Every backend whose config came from the file (or that the file's declared shapes
    changed) within its load bound (Backend.load_bound), before anything is built: a file's
    numbers never take a load past its stated memory and time (docs/deployment.md)."""
    for (name, backends), module_groups in zip(steps, groups):
        module = model.get_submodule(name) if name else model
        for backend, group in zip(backends, module_groups):
            if backend is None:
                continue
            effective = backend.for_shapes(shapes) if shapes is not None else backend
            if effective.config == backend.config and any(
                    type(g) is type(backend) and g.config == backend.config for g in given):
                continue  # the caller's own backend, as the caller configured it
            problem = effective.load_bound(module, group.samples, model)
            if problem is not None:
                raise CheckpointError(
                    f"{path}: {name or '(root)'} {group.text[:200]}: its {backend.name}'s {problem}; tt.load refuses a "
                    "file past a bound before building anything (tt.save never writes one for this model): tune "
                    "again here, or pass the backend you mean, tt.load(model, path, backends=[...])")


def _given_backends(backends: Any) -> list[Backend]:
    if backends is None:
        return []
    if isinstance(backends, Backend):
        backends = [backends]
    try:
        items = list(backends)
    except TypeError:
        raise TypeError(f"backends must be a list of backends, not {type(backends).__name__}") from None
    for item in items:
        if not isinstance(item, Backend):
            raise TypeError(f"backends must hold torch_tweak backends (e.g. tt.backends.TorchInductorBackend("
                            f"options=...)), not {type(item).__name__}")
    return items


def _check_ranks(manifest: dict, where: tuple[int, int] | None, path: Any) -> None:
    """The file's rank and world size (tt.save under torch.distributed; none: a single process)
    against this process's (`where`; None: it runs alone): distributed.saved_ranks_problem."""
    saved = manifest.get("ranks")
    ranks = (saved.get("rank"), saved.get("world_size")) if type(saved) is dict else (None, None)
    if saved is not None and not (type(ranks[0]) is int and type(ranks[1]) is int and 0 <= ranks[0] < ranks[1]):
        raise CheckpointError(f"{path}: its manifest's ranks are not a rank and a world size; {_unwritten(manifest)}")
    problem = distributed.saved_ranks_problem(None if saved is None else ranks, where)
    if problem is not None:
        raise CheckpointError(f"{path} {problem}")


def _check_target(model: nn.Module, target: torch.device, implicit: bool, manifest: dict, path: Any) -> None:
    """The file's device kind, torch release and model class against this model's."""
    saved = manifest.get("device") if type(manifest.get("device")) is dict else {}
    if target.type != saved.get("type"):
        raise CheckpointError(
            f"{path} was tuned on {str(saved.get('type'))[:20]} ({str(saved.get('name'))[:60]}), and this model is "
            f"to run on {target.type}: a plan holds only for the device kind it was measured on; tune again here "
            "(tt.tweak)" + (" or move the model there first" if implicit else ""))
    root = class_path(own_class(model))
    if manifest.get("model") != root:
        raise CheckpointError(f"{path} is for another model: it was saved from a {str(manifest.get('model'))[:80]}, "
                              f"this is a {root}")
    here = device_name(target)
    if saved.get("name") != here:
        warnings.warn(printable(f"{path} was tuned on {str(saved.get('name'))[:80]}, this is {here}: the plan still "
                                "runs, but it may not be the fastest here"), stacklevel=3)
    saved_torch = str(manifest.get("torch"))[:40]
    if saved_torch != torch.__version__:
        if saved_torch.split(".")[:2] != torch.__version__.split(".")[:2]:
            raise CheckpointError(f"{path} was saved with torch {saved_torch}, this is torch {torch.__version__}: "
                                  "backends and their configs belong to one torch release; tune again here")
        warnings.warn(printable(f"{path} was saved with torch {saved_torch}, this is torch {torch.__version__}: "
                                "the backends are built again and checked against the stored outputs"),
                      stacklevel=3)


def _check_plan(model: nn.Module, plan: dict, given: list[Backend], path: Any,
                manifest: dict) -> list[tuple[str, list]]:
    """[(module path, [backend or None per signature])]: the plan checked against the model."""
    steps = []
    modules = plan["modules"]
    if len(modules) > sum(1 for _ in model.modules()) or not all(type(m) is dict for m in modules):
        raise CheckpointError(f"{path}: {PLAN} is not a torch-tweak plan for this model (its module list)")
    if not all(type(m.get("path")) is str for m in modules):
        raise CheckpointError(f"{path}: {PLAN} is not a torch-tweak plan (a module path is not a string)")
    problem = _layout_problem(plan)
    if problem is not None:
        raise CheckpointError(f"{path}: tt.load refuses its plan: {problem}; {_unwritten(manifest)}")
    try:
        resolve_paths(model, [m["path"] for m in modules])
    except (ValueError, TypeError) as exc:
        raise CheckpointError(f"{path} is for another model, or forged: {str(exc)[:300]}") from None
    for item in modules:
        name = item["path"]
        module = model.get_submodule(name) if name else model
        cls = class_path(own_class(module))
        if item.get("class") != cls:
            raise CheckpointError(f"{path} is for another model: {name or '(root)'} is a {item.get('class')} "
                                  f"there, a {cls} here")
        params = _params(module)
        if item.get("params") != params:
            saved = item.get("params") if type(item.get("params")) is dict else {}
            diff = next((k for k in sorted(set(saved) | set(params)) if saved.get(k) != params.get(k)), "?")
            raise CheckpointError(f"{path} is for another model: {name or '(root)'}.{diff} is "
                                  f"{_shape(saved.get(diff))} there, {_shape(params.get(diff))} here")
        backends = []
        for sig in item["signatures"]:
            try:
                backends.append(None if sig.get("backend") is None else build_backend(sig["backend"], given))
            except (ValueError, TypeError) as exc:
                raise CheckpointError(f"{path}: {name or '(root)'}: {exc}") from None
        steps.append((name, backends))
    return steps


def _shape(value: Any) -> str:
    return "absent" if value is None else f"{value[1]}{value[0]}"


def _stored(data: dict[str, Any], device: torch.device, path: Any) -> tuple[list[torch.Tensor], Any]:
    """The file's stored tensors (read by _read), and how a decoded tensor is placed on `device`."""
    table = data.get(SAMPLES)
    if type(table) is not dict:
        raise CheckpointError(f"{path}: it holds no {SAMPLES}")
    tensors = [table.get(f"t{i}") for i in range(len(table))]
    if any(t is None for t in tensors):
        raise CheckpointError(f"{path}: {SAMPLES} does not hold the tensors its plan refers to")

    def place(tensor: torch.Tensor, recorded: str) -> torch.Tensor:
        return tensor.to(device) if torch.device(recorded).type == device.type else tensor

    return tensors, place


def _loop_plan(plan: dict, stored: tuple, path: Any, types: dict[str, type], model: nn.Module,
               manifest: dict) -> LoopPlan | None:
    """The plan's decode loop, checked: a known kind, plain layouts, at most
    MAX_GENERATE_CALLS stored calls of (tensor ids, plain settings) and their tokens, each
    one the decode loop serves on this model, within the check's bounds (check_bounds)."""
    entry = plan.get("generate")
    if entry is None:
        return None
    tensors, place = stored
    try:
        if type(entry) is not dict or entry.get("kind") not in LOOPS:
            raise ValueError("its kind is not one of torch-tweak's decode loops")
        checks = entry.get("checks")
        if type(checks) is not list or len(checks) > settings.MAX_GENERATE_CALLS or \
                not all(type(c) is dict for c in checks):
            raise ValueError(f"at most {settings.MAX_GENERATE_CALLS} stored generate() calls, in a list")
        calls = []
        for check in checks:
            args, kwargs = _call(decode(check.get("call"), tensors, place, types))
            tokens = decode(check.get("tokens"), tensors, place, types)
            if not isinstance(tokens, torch.Tensor) or tokens.dim() != 2:
                raise ValueError("a stored generate() call's tokens are a 2-D tensor")
            calls.append((args, kwargs, tokens))
        top_sampler = entry.get("top_sampler", False)
        if type(top_sampler) is not bool:
            raise ValueError("its top_sampler is true or false")
        kernels = entry.get("kernels")
        if (kernels is not None or entry["kind"] == FUSED) and (entry["kind"] != FUSED or kernels not in KERNELS):
            raise ValueError(f"the {FUSED} loop names its kernels ({', '.join(KERNELS)}), no other loop does")
        loop = LoopPlan(entry["kind"], check_layouts(entry.get("layouts")), calls, top_sampler, kernels)
    except (ValueError, TypeError, KeyError, RuntimeError) as exc:
        raise CheckpointError(f"{path}: the decode loop of its plan is refused ({str(exc)[:200]}); "
                              f"{_unwritten(manifest)}") from None
    for args, kwargs, _ in loop.checks:  # what a file may ask the check to decode, before anything runs
        problem = check_bounds(model, args, kwargs)
        if problem is not None:
            raise CheckpointError(f"{path}: the decode loop of its plan is refused: {problem[:300]}; tt.save never "
                                  "writes such a call")
    return loop


def _groups(plan: dict, stored: tuple, path: Any, model: nn.Module, types: dict[str, type],
            manifest: dict) -> list[list[SignatureGroup]]:
    """The stored calls and outputs of every signature, tensors on their device (their number
    checked by _check_plan against signatures.stored_bounds, the bound tt.save writes within)."""
    tensors, place = stored
    result = []
    for item in plan["modules"]:
        groups = []
        for sig in item["signatures"]:
            try:
                stored, results = sig.get("samples", []), sig.get("outputs", [])
                if type(sig.get("text")) is not str or type(sig.get("key")) is not str:
                    raise ValueError("a signature's text and key are strings")
                samples = [_call(decode(s, tensors, place, types)) for s in stored]
                outputs = [decode(o, tensors, place, types) for o in results]
                text, key = printable(sig["text"][:400]), sig["key"][:40]  # the text is shown (tt.status)
                if len(samples) != len(outputs):
                    raise ValueError("as many outputs as calls are needed")
                params = forward_params(model.get_submodule(item["path"]) if item["path"] else model)
                varying = sig.get("varying", False) is True
                signature = None if key == "other" and text == OTHER else (
                    False if not samples else next(iter(proven_signatures(samples, params)), False) if varying
                    else make_signature(*samples[0], params))
            except (ValueError, TypeError, KeyError, RuntimeError) as exc:
                raise CheckpointError(f"{path}: the stored calls of {item['path'] or '(root)'} are refused "
                                      f"({str(exc)[:200]}); {_unwritten(manifest)}") from None
            group = SignatureGroup(signature if signature is not False else None, text, key, varying=varying)
            group.samples.extend(samples)
            group.outputs.extend(outputs)
            groups.append(group)
        result.append(groups)
    return result


def _call(value: Any) -> tuple[tuple, dict]:
    if type(value) is not tuple or len(value) != 2 or type(value[0]) is not tuple or type(value[1]) is not dict:
        raise ValueError("a stored call is a pair (args, kwargs)")
    return value
