"""Peak memory of reading torch-tweak files, each measured in a process of its own.

Run by tests/test_bounded_reads.py: ``python read_memory.py make FOLDER`` writes genuine files
of about 1, 8 and 32 MiB (a tuned Linear whose recorded calls are large) and a forged file
whose zip directory declares 700 000 entries, and one whose plan.json is
15 MiB of empty lists (5 million values once parsed); ``python read_memory.py read FILE`` then reads
one of them as tt.load reads it before it builds any backend (checkpoint._read, then the
tensors placed), and ``python read_memory.py load FILE`` runs tt.load whole. Each prints one
JSON line with the file's size, the growth of the process's peak RSS (resource.getrusage)
over what it was before the read, the seconds it took, and the outcome.
"""

from __future__ import annotations

import hashlib
import json
import resource
import struct
import sys
import time
import zipfile
from pathlib import Path

import torch
from torch import nn

import torch_tweak as tt
from torch_tweak._store import checkpoint
from torch_tweak.backends import TorchEagerBackend
from support import FAST

SIZES_MIB = (1, 8, 32)
FEATURES = 256
ENTRIES = 700_000


def build() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(FEATURES, FEATURES)).eval()


def make(folder: Path) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    for mib in SIZES_MIB:
        model = build()
        tt.wrap(model, ["0"], strategy=tt.OneBackendStrategy(TorchEagerBackend()))
        rows = (mib << 20) // (2 * 4 * FEATURES)  # each row: its input and its output, float32
        calls = [torch.randn(rows, FEATURES, generator=torch.Generator().manual_seed(i)) for i in range(1)]
        tt.tune(model, calls, measure=FAST)
        tt.save(model, folder / f"valid-{mib}.tt")
    forged(folder / "many-entries.tt")
    with zipfile.ZipFile(folder / "valid-1.tt") as archive:
        members = {n: archive.read(n) for n in archive.namelist()}
    members["plan.json"] = b"[" + b"[]," * (5 << 20) + b"[]]"  # 15 MiB, 5 million lists once parsed
    meta = json.loads(members["manifest.json"])
    meta["members"] = {n: hashlib.sha256(d).hexdigest() for n, d in members.items() if n != "manifest.json"}
    members["manifest.json"] = json.dumps(meta).encode()
    with zipfile.ZipFile(folder / "many-values.tt", "w") as archive:
        for name, data in members.items():
            archive.writestr(name, data, compress_type=zipfile.ZIP_DEFLATED if name.endswith(".json")
                             else zipfile.ZIP_STORED)
    path = folder / "many-values.tt"
    path.write_bytes(checkpoint._seal(path.read_bytes(), None))


def forged(path: Path) -> None:
    """A zip whose directory declares ENTRIES empty-named entries (zip64 end records), sealed
    as a forger without the key seals: about 32 MiB, Python's zipfile builds every entry."""
    entry = struct.pack("<4s4B4HL2L5H2L", b"PK\x01\x02", 20, 3, 20, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0)
    directory = entry * ENTRIES
    end64 = struct.pack("<4sQ2H2L4Q", b"PK\x06\x06", 44, 45, 45, 0, 0, ENTRIES, ENTRIES, len(directory), 0)
    locator = struct.pack("<4sLQL", b"PK\x06\x07", 0, len(directory), 1)
    end = struct.pack("<4s4H2LH", b"PK\x05\x06", 0, 0, 0xFFFF, 0xFFFF, 0xFFFFFFFF, 0xFFFFFFFF, 0)
    path.write_bytes(checkpoint._seal(directory + end64 + locator + end, None))


def peak() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux


def measure(step: str, path: Path) -> None:
    model = build()
    limit = checkpoint.default_max_bytes(model)
    before = peak()
    start = time.monotonic()
    outcome = "read"
    try:
        if step == "read":
            _, _, data = checkpoint._read(path, limit, None)
            checkpoint._stored(data, torch.device("cpu"), path)
        else:
            tt.load(model, path)
    except tt.CheckpointError as exc:
        outcome = f"CheckpointError: {exc}"
    print(json.dumps({"size": path.stat().st_size, "growth": peak() - before, "seconds": time.monotonic() - start,
                      "outcome": outcome}), flush=True)


if __name__ == "__main__":
    if sys.argv[1] == "make":
        make(Path(sys.argv[2]))
    else:
        measure(sys.argv[1], Path(sys.argv[2]))
