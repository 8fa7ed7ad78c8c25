"""OpenVINO's converted models kept in torch-tweak's folder: a second build of the same module
(a tuning-cache hit, tt.load, another tweak) reads the model ``ov.convert_model`` made
instead of converting it again.

Converting is most of an OpenVINO build: on examples/Tweak's encoder it took 1.74 s of CPU,
reading its model back from bytes 0.02 s, and compiling 0.12 s (bench/results/cache_cpu.md).
OpenVINO's own model cache (``CACHE_DIR``) keeps the compiled blob, and importing it took
about what compiling takes on the CPU (0.08 s); it never skips the conversion. So the
converted model is what is kept here, and the compile runs as before.

An entry is one file, ``<cache folder>/openvino/<key>.ovm``: a first line naming the format,
a JSON line (the key, the sizes of the two parts, their seal), then the model's IR as
``ov.save_model`` writes it (the XML, then the weights, uncompressed). The key is a sha256 of
what the conversion depends on (key): OpenVINO's, torch's and torch-tweak's versions; per
module of the subtree its class, its forward's code and its plain attributes; every weight's
and buffer's name, dtype, shape and bytes; the traced call's layout, its constants, its
tensors' shapes and dtypes, and the input shapes given to the converter (static, or the
declared bounds).

Written safely: through storage.atomic_file (a temporary file, synced, renamed), sealed
with the per-user key (storage.seal), so that an entry planted in a folder others can write
is never read (without a key nothing is kept). Read bounded (storage.read_regular), its seal
checked, and OpenVINO reads the model from those bytes, never from the path. Whatever is
wrong with an entry (missing, unsealed, damaged, of another key, one OpenVINO cannot read)
is a miss: the module is converted as before and the entry written again. A model read from
an entry is checked against the module on the first recorded call before it is used (a
mismatch, which only code the key does not see can cause, drops the entry and converts),
then by the build's own check, as a converted one. The folder is kept under OV_CACHE_FOLDER_BYTES:
the entries used longest ago go first.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile
from pathlib import Path
from typing import Any, Sequence

import torch

from .._core import settings
from .._core.storage import atomic_file, cache_dir, read_regular, seal, unseal

MAGIC = b"torch-tweak openvino model 1\n"
_SCALARS = (bool, int, float, str, type(None))
logger = logging.getLogger("torch_tweak")


def folder() -> Path:
    return cache_dir() / "openvino"


def _weights_bytes(module: torch.nn.Module) -> int:
    return sum(t.numel() * t.element_size() for t in list(module.parameters()) + list(module.buffers()))


def _code_of(cls: type) -> bytes:
    """The bytes of a module class's forward: its bytecode, names and constants (nested functions'
    the same way), b"" when it has none. Not marshal's bytes, which a profiler changes."""
    def flat(code: Any) -> bytes:
        consts = [flat(c) if hasattr(c, "co_code") else repr(c).encode() for c in code.co_consts]
        return b"\0".join([code.co_code, repr(code.co_names).encode(), repr(code.co_varnames).encode(), *consts])

    code = getattr(getattr(cls, "forward", None), "__code__", None)
    return flat(code) if code is not None else b""


def key(module: torch.nn.Module, versions: dict[str, str], layout: Any, constants: Sequence[Any],
        example: Sequence[torch.Tensor], shapes: Any) -> str:
    """The entry's key: a sha256 of what ov.convert_model's model depends on (see the module docs)."""
    digest = hashlib.sha256()

    def add(*parts: Any) -> None:
        for part in parts:
            digest.update(part if isinstance(part, bytes) else repr(part).encode())
            digest.update(b"\0")

    add(sorted(versions.items()), repr(layout), [repr(c) for c in constants],
        [(tuple(t.shape), str(t.dtype)) for t in example], shapes)
    for path, sub in module.named_modules():
        cls = type(sub)
        plain = sorted((k, v) for k, v in vars(sub).items() if not k.startswith("_") and type(v) in _SCALARS)
        add(path, f"{cls.__module__}.{cls.__qualname__}", _code_of(cls), plain)
    with torch.no_grad():
        for name, tensor in list(module.named_parameters()) + list(module.named_buffers()):
            data = tensor.detach().to("cpu").contiguous()
            add(name, str(data.dtype), tuple(data.shape))
            if data.numel():
                digest.update(data.reshape(-1).view(torch.uint8).numpy())  # the bytes, not a copy of them
    return digest.hexdigest()


def _path(entry: str) -> Path:
    return folder() / f"{entry}.ovm"


def read(ov: Any, entry: str, module: torch.nn.Module) -> Any:
    """The converted model of the entry, or None (a miss: see the module docs)."""
    path = _path(entry)
    try:
        data = read_regular(path, 4 * _weights_bytes(module) + (64 << 20))
    except FileNotFoundError:
        return None
    except OSError as exc:  # too large, not a regular file...
        logger.info("OpenVINO's converted model %s not read: %s", path, exc)
        return None
    try:
        if not data.startswith(MAGIC):
            raise ValueError("not an entry of this format")
        end = data.index(b"\n", len(MAGIC), len(MAGIC) + settings.OV_CACHE_HEADER_BYTES)
        header = json.loads(data[len(MAGIC):end])
        xml_size, bin_size = header["xml"], header["bin"]
        body = memoryview(data)[end + 1:]
        if header["key"] != entry or type(xml_size) is not int or type(bin_size) is not int \
                or xml_size < 0 or bin_size < 0 or xml_size + bin_size != len(body):
            raise ValueError("its sizes or key are not its own")
        if not unseal(entry.encode() + b"\0" + bytes(body), header.get("seal")):
            raise ValueError("its seal is not this user's")
        import numpy as np

        weights = ov.Tensor(np.frombuffer(body[xml_size:], dtype=np.uint8).copy())
        model = ov.Core().read_model(bytes(body[:xml_size]), weights)
    except Exception as exc:  # noqa: BLE001 - whatever is wrong with an entry, it is converted again
        logger.info("OpenVINO's converted model %s not used (%s: %s); converting again", path,
                    type(exc).__name__, str(exc)[:200])
        drop(entry)
        return None
    try:
        os.utime(path)  # used now: the last to be removed when the folder is full
    except OSError:
        pass
    return model


def write(ov: Any, entry: str, model: Any) -> None:
    """Keeps the converted model as the entry (nothing without a per-user key); a failure only
    logs: the build goes on with the model it converted."""
    try:
        folder().mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(prefix=".scratch-", dir=folder()) as scratch:  # in the folder, as all it writes
            xml = Path(scratch) / "model.xml"
            ov.save_model(model, str(xml), compress_to_fp16=False)  # the weights as converted
            xml_bytes, bin_bytes = xml.read_bytes(), xml.with_suffix(".bin").read_bytes()
        sealed = seal(entry.encode() + b"\0" + xml_bytes + bin_bytes)
        if sealed is None:
            return
        header = json.dumps({"key": entry, "xml": len(xml_bytes), "bin": len(bin_bytes), "seal": sealed})
        with atomic_file(_path(entry)) as f:
            f.write(MAGIC + header.encode() + b"\n")
            f.write(xml_bytes)
            f.write(bin_bytes)
        _trim()
    except Exception as exc:  # noqa: BLE001 - the cache is an optimisation: a full disk costs a conversion
        logger.info("OpenVINO's converted model not kept in %s: %s: %s", folder(), type(exc).__name__, exc)


def drop(entry: str) -> None:
    try:
        _path(entry).unlink()
    except OSError:
        pass


def _trim() -> None:
    """Removes the entries used longest ago while the folder holds more than OV_CACHE_FOLDER_BYTES."""
    entries = []
    for path in folder().glob("*.ovm"):
        try:
            info = path.lstat()
        except OSError:
            continue
        entries.append((info.st_mtime, info.st_size, path))
    total = sum(size for _, size, _ in entries)
    for _, size, path in sorted(entries):
        if total <= settings.OV_CACHE_FOLDER_BYTES:
            break
        try:
            path.unlink()
            total -= size
        except OSError:
            pass
