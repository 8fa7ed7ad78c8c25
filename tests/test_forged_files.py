"""Hundreds of forged, damaged and hostile files against tt.load, each category in processes of
its own (tests/forgery.py): none runs code, none hangs, none grows memory past the stated cap,
every one is a tt.CheckpointError that leaves the model unchanged (or, where a forgery
changes nothing that matters, loads a model that answers exactly as the untuned one), and
none loads with the key the deployment signs with."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from torch_tweak import checkpoint

TESTS = os.path.dirname(os.path.abspath(__file__))
CATEGORIES = ("options", "tolerances", "classes", "sizes", "paths", "damage", "pickles", "tree")
COUNTS = {}


def run(step: str, category: str, folder) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, os.path.join(TESTS, "forgery.py"), step, category, str(folder)],
                          capture_output=True, text=True, timeout=300, cwd=TESTS)


@pytest.mark.parametrize("category", CATEGORIES)
def test_forged_files(category, tmp_path):
    made = run("make", category, tmp_path)
    assert made.returncode == 0, made.stderr[-3000:]
    loaded = run("load", category, tmp_path)
    lines = [json.loads(line) for line in loaded.stdout.splitlines() if line.startswith("{")]
    started = [line["start"] for line in lines if "start" in line]
    assert loaded.returncode == 0, f"died in case {started[-1] if started else None}: {loaded.stderr[-3000:]}"
    cases = [line for line in lines if "case" in line]
    assert cases and len(cases) == len(started)
    bad = []
    for case in cases:
        allowed = ("error", "correct") if case["expected"] == "either" else (case["expected"],)
        if (case["outcome"] not in allowed or case["code_ran"] or not case.get("unchanged", True)
                or case["keyed"]["outcome"] != "error" or not case["keyed"]["unchanged"] or case["keyed"]["code_ran"]):
            bad.append(case)
    assert not bad, json.dumps(bad[:5], indent=1)
    errors = [c for c in cases if c["outcome"] == "error"]
    assert all("CheckpointError" not in c["message"] and c["message"] for c in errors)  # one plain message each
    memory = lines[-1]
    cap = 4 * memory["model_bytes"] + checkpoint.SLACK_BYTES  # the cap docs/deployment.md states
    assert memory["peak_growth_bytes"] <= cap, memory
    assert not (tmp_path / "marker").exists()
    COUNTS[category] = len(cases)


def test_several_hundred_cases_ran():
    if set(COUNTS) != set(CATEGORIES):
        pytest.skip("runs after every category (pytest runs this file in order)")
    assert sum(COUNTS.values()) >= 500, COUNTS
