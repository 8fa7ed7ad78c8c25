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

import pytest

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
