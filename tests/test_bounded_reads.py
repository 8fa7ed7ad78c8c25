"""tt.load's memory is bounded by the file it reads (docs/deployment.md, "exhaust memory"):
reading and checking a file of S bytes, up to the first backend built, grows the process's
peak memory by at most S + READ_SLACK, at several sizes; a zip whose directory declares
hundreds of thousands of entries is refused from its end record, at once and in constant
memory. Each read runs in a process of its own (tests/read_memory.py) whose peak RSS is
measured; the files stay under 40 MiB each, in a temporary folder."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import zipfile

import pytest
import torch

import torch_tweak as tt
from torch_tweak._store import checkpoint

pytestmark = pytest.mark.slow  # files of up to 40 MiB built and read, some in child processes

TESTS = os.path.dirname(os.path.abspath(__file__))
MIB = 1 << 20
READ_SLACK = 24 * MIB
"""The constant of the stated bound: buffers, the JSON members, the tensors' headers."""


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, os.path.join(TESTS, "read_memory.py"), *args], capture_output=True,
                          text=True, timeout=120, cwd=TESTS)


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    if not sys.platform.startswith("linux"):
        pytest.skip("peak RSS in bytes of ru_maxrss KiB: Linux")
    folder = tmp_path_factory.mktemp("reads")
    made = run("make", str(folder))
    assert made.returncode == 0, made.stderr[-3000:]
    return folder


def measured(step: str, path) -> dict:
    done = run(step, str(path))
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("mib", [1, 8, 32])
def test_reading_a_file_costs_its_size_and_a_constant(files, mib):
    found = measured("read", files / f"valid-{mib}.tt")
    assert found["outcome"] == "read", found
    assert found["size"] >= mib * MIB * 0.9
    assert found["growth"] <= found["size"] + READ_SLACK, found


def test_a_million_entry_directory_is_refused_from_its_end_record(files):
    found = measured("load", files / "many-entries.tt")
    assert found["outcome"].startswith("CheckpointError") and "declares 700000 entries" in found["outcome"], found
    assert found["growth"] <= READ_SLACK, found
    assert found["seconds"] < 30, found  # a bound against building every entry, not a timing


def test_a_plan_of_millions_of_values_is_refused_before_it_is_parsed(files):
    found = measured("load", files / "many-values.tt")
    assert found["outcome"].startswith("CheckpointError") and "values" in found["outcome"], found
    assert found["growth"] <= found["size"] + READ_SLACK, found


def _members(path) -> dict[str, bytes]:
    with zipfile.ZipFile(path) as archive:
        return {n: archive.read(n) for n in archive.namelist()}


def _write(path, members: dict[str, bytes], zip64: bool = False) -> None:
    with zipfile.ZipFile(path, "w") as archive:
        for name, data in members.items():
            info = zipfile.ZipInfo(name, (1980, 1, 1, 0, 0, 0))
            info.compress_type = zipfile.ZIP_DEFLATED if name.endswith(".json") else zipfile.ZIP_STORED
            with archive.open(info, "w", force_zip64=zip64) as f:
                f.write(data)
    path.write_bytes(checkpoint._seal(path.read_bytes(), None))


def test_zip64_members_load_and_a_forged_layout_is_refused(files, tmp_path):
    """Members written with zip64 local headers (as zipfile writes members over 4 GiB) load and
    answer as the untuned model; a local header that is not its directory entry's, and a
    member moved away from where the previous one ends, are refused with the model unchanged."""
    from read_memory import build
    from test_api import assert_unchanged, snapshot

    members = _members(files / "valid-1.tt")
    x = torch.randn(5, 256)
    with torch.no_grad():
        expected = build()(x)
    path = tmp_path / "zip64.tt"
    _write(path, members, zip64=True)
    model = build()
    tt.load(model, path)
    with torch.no_grad():
        assert torch.equal(model(x), expected)
    good = (files / "valid-1.tt").read_bytes()
    renamed = good.replace(b"plan.json", b"plan.jsox", 1)  # the first: the local header's
    forged_local = tmp_path / "local.tt"
    forged_local.write_bytes(checkpoint._seal(renamed[:-checkpoint._SEAL_LENGTH], None))
    gap = tmp_path / "gap.tt"
    with zipfile.ZipFile(gap, "w") as archive:
        for name, data in members.items():
            archive.writestr(name, data)
            archive.fp.write(b"\0" * 16)  # bytes between members, which zipfile itself skips
            archive.start_dir = archive.fp.tell()
    gap.write_bytes(checkpoint._seal(gap.read_bytes(), None))
    for path, match in ((forged_local, "local header does not match"), (gap, "gap or an overlap")):
        model = build()
        before = snapshot(model)
        with pytest.raises(tt.CheckpointError, match=match):
            tt.load(model, path)
        assert_unchanged(model, before)
