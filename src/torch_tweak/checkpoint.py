"""tt.save and tt.load: a tuned model's plan in one file, for production.

The file is a zip archive (docs/deployment.md):
- ``manifest.json``: format, versions, device, model class, creation time, and the sha256
  of every other member, checked on load;
- ``plan.json``: the depth kept and, per wrapped module, its class, its parameter and buffer
  shapes, and per input signature the backend (class and config) and the recorded calls
  and original outputs, with tensors as references into
- ``samples.safetensors``: those tensors (safetensors: reading it executes nothing);
- ``artifacts/inductor.bin`` (optional): Inductor's compiled-code cache
  (torch.compiler.save_cache_artifacts). It holds compiled code and pickled data, so
  tt.load applies it only with ``trust_artifacts=True``.

Loading builds each backend again on the stored calls and checks it against the stored
outputs; a signature whose rebuilt backend fails runs the original forward, with a warning.
"""

from __future__ import annotations

import datetime
import hashlib
import json
import os
import warnings
import zipfile
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ._samples import resolve_device
from .cache import atomic_file
from .backends import InductorGraphBackend, TorchAOBackend, TorchInductorBackend
from .module import MODE_ACTIVE, arm_untuned, installed, make_wrapper, install, resolve_paths, unwrap
from .serial import Unstorable, build_backend, class_path, decode, describe_backend, device_name, dumps, encode
from .signatures import OTHER, SignatureGroup, forward_params, make_signature
from .tuning import apply_groups, model_class_name, rebuild_group

FORMAT = "torch-tweak"
VERSION = 1
MANIFEST = "manifest.json"
PLAN = "plan.json"
SAMPLES = "samples.safetensors"
ARTIFACTS = "artifacts/inductor.bin"
MAX_JSON_BYTES = 64 << 20
"""manifest.json and plan.json larger than this are refused before they are read."""


class CheckpointError(ValueError):
    """A file tt.load cannot use: not a torch-tweak file, damaged, or for another model or machine."""


# ------------------------------------------------------------------ save


def save(model: nn.Module, path: str | os.PathLike) -> None:
    """Writes the tuned model's plan, recorded calls and artifacts to `path`, atomically.

    The file is written to a temporary file in the same folder, synced, then renamed over
    `path`: an interrupted save leaves any earlier file at `path` as it was.
    """
    from . import __version__
    from .tweak import SELECTED_DEPTHS

    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, not {type(model).__name__}")
    wrappers = installed(model)
    if not wrappers and model not in SELECTED_DEPTHS:
        raise ValueError("nothing to save: the model has no torch-tweak wrappers; tune it first (tt.tweak)")
    device = resolve_device(model, None)
    tensors: list[torch.Tensor] = []
    modules = []
    inductor = False
    for name, wrapper in sorted(wrappers.items()):
        signatures = []
        for group in wrapper.tt_signatures:
            entry: dict[str, Any] = {"text": group.text, "key": group.key, "backend": None, "samples": [],
                                     "outputs": []}
            if group.backend is not None:
                entry["backend"] = describe_backend(group.backend)
                inductor |= _uses_inductor(group.backend)
                for sample, output in zip(group.samples, group.outputs):
                    if not group.backend.can_store(sample):
                        continue
                    mark = len(tensors)
                    try:
                        stored = encode(sample, tensors), encode(output, tensors)
                    except Unstorable:
                        del tensors[mark:]
                        continue
                    entry["samples"].append(stored[0])
                    entry["outputs"].append(stored[1])
            signatures.append(entry)
        modules.append({"path": name, "class": class_path(type(wrapper._tt_original)),
                        "params": _params(wrapper._tt_original), "signatures": signatures})
    plan = {"depth": SELECTED_DEPTHS.get(model) if wrappers else None, "modules": modules}
    members = {PLAN: dumps(plan), SAMPLES: _tensor_bytes(tensors)}
    if inductor:
        artifacts = torch.compiler.save_cache_artifacts()
        if artifacts is not None:
            members[ARTIFACTS] = bytes(artifacts[0])
    manifest = {
        "format": FORMAT, "version": VERSION, "torch": torch.__version__, "torch_tweak": __version__,
        "device": {"type": device.type, "name": device_name(device)},
        "model": class_path(getattr(type(model), "_tt_root_class", type(model))),
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "members": {name: hashlib.sha256(data).hexdigest() for name, data in members.items()},
    }
    _write_atomically(Path(path), {MANIFEST: dumps(manifest), **members})


def _uses_inductor(backend: Any) -> bool:
    if isinstance(backend, TorchAOBackend):
        return backend.config.compile
    return isinstance(backend, (TorchInductorBackend, InductorGraphBackend))


def _params(module: nn.Module) -> dict[str, list]:
    return {name: [list(t.shape), str(t.dtype).removeprefix("torch.")]
            for name, t in list(module.named_parameters()) + list(module.named_buffers())}


def _tensor_bytes(tensors: list[torch.Tensor]) -> bytes:
    from safetensors.torch import save as save_tensors

    # Copies: safetensors wants contiguous tensors on the CPU that share no storage.
    return save_tensors({f"t{i}": t.detach().to("cpu").contiguous().clone() for i, t in enumerate(tensors)})


def _write_atomically(path: Path, members: dict[str, bytes]) -> None:
    with atomic_file(path) as f, zipfile.ZipFile(f, "w") as archive:
        for name, data in members.items():
            compress = zipfile.ZIP_DEFLATED if name.endswith(".json") else zipfile.ZIP_STORED
            archive.writestr(zipfile.ZipInfo(name, (1980, 1, 1, 0, 0, 0)), data, compress_type=compress)


# ------------------------------------------------------------------ reading


def _read(path: str | os.PathLike) -> tuple[dict, dict, dict[str, bytes]]:
    """(manifest, plan, the other members' bytes) of a file whose every hash matches."""
    try:
        archive = zipfile.ZipFile(path)
    except FileNotFoundError:
        raise
    except (zipfile.BadZipFile, OSError, EOFError, ValueError) as exc:
        raise CheckpointError(f"{path} is not a torch-tweak file, or it is truncated or damaged: {exc}") from None
    with archive:
        infos = archive.infolist()
        names = [i.filename for i in infos]
        if len(set(names)) != len(names):
            raise CheckpointError(f"{path} is damaged: a member appears twice")
        if MANIFEST not in names:
            raise CheckpointError(f"{path} is not a torch-tweak file (it has no {MANIFEST}); a file written by "
                                  "torch.save is not one: save with tt.save")
        sizes = {i.filename: i.file_size for i in infos}
        manifest = _json(archive, MANIFEST, sizes, path)
        if type(manifest) is not dict or manifest.get("format") != FORMAT:
            raise CheckpointError(f"{path} is not a torch-tweak file (its manifest is not one)")
        if manifest.get("version") != VERSION:
            raise CheckpointError(f"{path} is a torch-tweak file of format version {manifest.get('version')!r}; "
                                  f"this torch-tweak reads version {VERSION}")
        hashes = manifest.get("members")
        if type(hashes) is not dict or set(hashes) != set(names) - {MANIFEST} or PLAN not in hashes:
            raise CheckpointError(f"{path} is damaged: its members are not the ones its manifest lists")
        data: dict[str, bytes] = {}
        for name in sorted(hashes):
            if name.endswith(".json") and sizes[name] > MAX_JSON_BYTES:
                raise CheckpointError(f"{path}: {name} is larger than {MAX_JSON_BYTES} bytes")
            try:
                data[name] = archive.read(name)
            except (zipfile.BadZipFile, OSError, EOFError, ValueError, NotImplementedError) as exc:
                raise CheckpointError(f"{path} is truncated or damaged: {name}: {exc}") from None
            if hashlib.sha256(data[name]).hexdigest() != hashes[name]:
                raise CheckpointError(f"{path} is damaged or was changed: the sha256 of {name} does not match "
                                      "its manifest")
    try:
        plan = json.loads(data.pop(PLAN))
    except ValueError as exc:
        raise CheckpointError(f"{path}: {PLAN} is not JSON: {exc}") from None
    if type(plan) is not dict or type(plan.get("modules")) is not list:
        raise CheckpointError(f"{path}: {PLAN} is not a torch-tweak plan")
    return manifest, plan, data


def _json(archive: zipfile.ZipFile, name: str, sizes: dict[str, int], path: Any) -> Any:
    if sizes[name] > MAX_JSON_BYTES:
        raise CheckpointError(f"{path}: {name} is larger than {MAX_JSON_BYTES} bytes")
    try:
        return json.loads(archive.read(name))
    except (zipfile.BadZipFile, OSError, EOFError, NotImplementedError) as exc:
        raise CheckpointError(f"{path} is truncated or damaged: {name}: {exc}") from None
    except ValueError as exc:  # UnicodeDecodeError and JSONDecodeError are ValueErrors
        raise CheckpointError(f"{path} is not a torch-tweak file: {name} is not JSON ({exc})") from None


def read_summary(path: str | os.PathLike) -> dict:
    """{"manifest": ..., "plan": ...} of a torch-tweak file, every hash checked; loads no tensor."""
    manifest, plan, _ = _read(path)
    return {"manifest": manifest, "plan": plan}


# ------------------------------------------------------------------ load


def load(model: nn.Module, path: str | os.PathLike, *, device: Any = None,
         trust_artifacts: bool = False) -> dict[str, str | None]:
    """Applies a file written by tt.save to a freshly built `model`, with no tuning.

    Every check (hashes, versions, device, module paths, classes and parameter shapes,
    backend classes) runs before the model changes; any failure raises CheckpointError and
    leaves the model as it was. Then each module of the plan is wrapped and each backend
    built again on the stored calls and checked against the stored outputs; a signature
    whose backend fails to build or to match runs the original forward (a warning says
    why). Load the weights (state_dict) before tt.load: backends are built on them.

    device: where to build (default: where the model's weights are); its kind must be the
    file's. trust_artifacts: apply the file's compiled-code artifacts (Inductor's cache,
    which holds pickled data) so compiles are fast; only for files you trust.
    Returns {path: the backend of its first signature, or None}.
    """
    from .tweak import SELECTED_DEPTHS

    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, not {type(model).__name__}")
    if installed(model):
        raise ValueError("the model already has torch-tweak wrappers; load into a freshly built model "
                         "(or tt.unwrap(model) first)")
    manifest, plan, data = _read(path)
    target = _target_device(model, device, manifest, path)
    steps = _check_plan(model, plan, path)
    groups = _groups(plan, data, target, path, model)
    artifacts = data.get(ARTIFACTS)
    if trust_artifacts and artifacts is not None:
        if manifest.get("torch") == torch.__version__:
            torch.compiler.load_cache_artifacts(artifacts)
        else:
            warnings.warn(f"{path}: its artifacts are for torch {manifest.get('torch')}, not {torch.__version__}; "
                          "they are not applied and the backends compile from scratch", stacklevel=2)
    model_class = model_class_name(model)
    chosen: dict[str, str | None] = {}
    wrappers = []
    try:
        for (name, backends), module_groups in zip(steps, groups):
            wrapper = make_wrapper(model, name)
            install(model, wrapper)
            wrappers.append(wrapper)
            for group, backend in zip(module_groups, backends):
                wrapper.tt_signatures.append(group)
                if backend is None:
                    continue
                failure = _rebuild(wrapper, group, backend, target, model_class)
                if failure is None:
                    group.backend = backend
                else:
                    group.error = failure
                    group.release()
                    warnings.warn(f"tt.load: {name or '(root)'} {group.text}: {failure}; these calls run the "
                                  "original forward", stacklevel=2)
            apply_groups(wrapper)
            wrapper.tt_error = "; ".join(g.error for g in wrapper.tt_signatures if g.error)
            chosen[name] = wrapper.tt_backend.name if wrapper.tt_backend is not None else None
        for wrapper in wrappers:
            if wrapper.tt_backend is not None:
                wrapper._tt_mode = MODE_ACTIVE
    except BaseException:
        unwrap(model)
        raise
    SELECTED_DEPTHS[model] = plan.get("depth")
    arm_untuned(model)
    return chosen


def _rebuild(wrapper: Any, group: SignatureGroup, backend: Any, device: torch.device, model_class: str) -> str | None:
    """None when the backend was built again and matches the stored outputs, else why not."""
    if not group.samples:
        if group.key != "other" or group.text != OTHER:
            return "no recorded call of it could be stored, and a signature is rebuilt from one"
        _build_on_first_call(wrapper, group, backend, device)
        return None
    try:
        rebuild_group(wrapper, group, backend, device, model_class)
    except Exception as exc:
        return f"the rebuilt {backend.name} failed: {type(exc).__name__}: {exc}"
    return None


def _build_on_first_call(wrapper: Any, group: SignatureGroup, backend: Any, device: torch.device) -> None:
    """A backend whose calls could not be stored builds on the first call it serves."""
    module = wrapper._tt_original

    def first(*args: Any, **kwargs: Any) -> Any:
        fn = backend.callable
        if fn is None or fn is first:
            fn = backend.prepare(module, [(args, kwargs)], device)
        return fn(*args, **kwargs)

    backend.callable = first
    backend.state = "built"


def _target_device(model: nn.Module, device: Any, manifest: dict, path: Any) -> torch.device:
    saved = manifest.get("device") if type(manifest.get("device")) is dict else {}
    target = resolve_device(model, device)
    if target.type != saved.get("type"):
        raise CheckpointError(
            f"{path} was tuned on {saved.get('type')} ({saved.get('name')}), and this model is to run on "
            f"{target.type}: a plan holds only for the device kind it was measured on; tune again here (tt.tweak) "
            + ("or move the model there first" if device is None else ""))
    here = device_name(target)
    if saved.get("name") != here:
        warnings.warn(f"{path} was tuned on {saved.get('name')}, this is {here}: the plan still runs, but it may "
                      "not be the fastest here", stacklevel=3)
    saved_torch = str(manifest.get("torch"))
    if saved_torch != torch.__version__:
        if saved_torch.split(".")[:2] != torch.__version__.split(".")[:2]:
            raise CheckpointError(f"{path} was saved with torch {saved_torch}, this is torch {torch.__version__}: "
                                  "backends and their configs belong to one torch release; tune again here")
        warnings.warn(f"{path} was saved with torch {saved_torch}, this is torch {torch.__version__}: the "
                      "backends are built again and checked against the stored outputs", stacklevel=3)
    return target


def _check_plan(model: nn.Module, plan: dict, path: Any) -> list[tuple[str, list]]:
    """[(module path, [backend or None per signature])]: the plan checked against the model."""
    steps = []
    try:
        resolve_paths(model, [m.get("path") if type(m) is dict else None for m in plan["modules"]])
    except (ValueError, TypeError) as exc:
        raise CheckpointError(f"{path} is for another model: {exc}") from None
    for item in plan["modules"]:
        name = item["path"]
        module = model.get_submodule(name) if name else model
        cls = class_path(getattr(type(module), "_tt_root_class", type(module)))
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
        if type(item.get("signatures")) is not list:
            raise CheckpointError(f"{path}: {PLAN} is not a torch-tweak plan")
        for sig in item["signatures"]:
            try:
                backends.append(None if sig.get("backend") is None else build_backend(sig["backend"]))
            except (ValueError, TypeError) as exc:
                raise CheckpointError(f"{path}: {name or '(root)'}: {exc}") from None
        steps.append((name, backends))
    return steps


def _shape(value: Any) -> str:
    return "absent" if value is None else f"{value[1]}{value[0]}"


def _groups(plan: dict, data: dict[str, bytes], device: torch.device, path: Any,
            model: nn.Module) -> list[list[SignatureGroup]]:
    """The stored calls and outputs of every signature, tensors on `device`."""
    from safetensors import SafetensorError
    from safetensors.torch import load as load_tensors

    try:
        table = load_tensors(data.get(SAMPLES, b""))
    except (SafetensorError, ValueError, RuntimeError, TypeError) as exc:
        raise CheckpointError(f"{path}: {SAMPLES} is not a safetensors file: {exc}") from None
    tensors = [table.get(f"t{i}") for i in range(len(table))]
    if any(t is None for t in tensors):
        raise CheckpointError(f"{path}: {SAMPLES} does not hold the tensors its plan refers to")

    def place(tensor: torch.Tensor, recorded: str) -> torch.Tensor:
        return tensor.to(device) if torch.device(recorded).type == device.type else tensor

    result = []
    for item in plan["modules"]:
        groups = []
        for sig in item["signatures"]:
            try:
                samples = [_call(decode(s, tensors, place)) for s in sig.get("samples", [])]
                outputs = [decode(o, tensors, place) for o in sig.get("outputs", [])]
                text, key = str(sig["text"]), str(sig["key"])
                if len(samples) != len(outputs):
                    raise ValueError("as many outputs as calls are needed")
                params = forward_params(model.get_submodule(item["path"]) if item["path"] else model)
                signature = None if key == "other" and text == OTHER else (
                    make_signature(*samples[0], params) if samples else False)
            except (ValueError, TypeError, KeyError, RuntimeError) as exc:
                raise CheckpointError(f"{path}: the stored calls of {item['path'] or '(root)'} are damaged: "
                                      f"{exc}") from None
            group = SignatureGroup(signature if signature is not False else None, text, key)
            group.samples.extend(samples)
            group.outputs.extend(outputs)
            groups.append(group)
        result.append(groups)
    return result


def _call(value: Any) -> tuple[tuple, dict]:
    if type(value) is not tuple or len(value) != 2 or type(value[0]) is not tuple or type(value[1]) is not dict:
        raise ValueError("a stored call is a pair (args, kwargs)")
    return value
