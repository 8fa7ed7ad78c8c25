"""The published GPU report is what its run files give: bench/results/gpu.md names the run files
it was merged from, and merging copies of them again writes it byte for byte (its hand-written
notes are bench/results/gpu-notes.md, appended by the merge). A report edited by hand, or a run
file changed or lost, fails here."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(ROOT, "bench", "results")


def test_gpu_report_is_regenerated_from_the_run_files_it_names(tmp_path):
    with open(os.path.join(RESULTS, "gpu.md")) as f:
        published = f.read()
    line = next(ln for ln in published.splitlines() if ln.startswith("Run files, relative to this report"))
    named = re.findall(r"`([^`]+\.json)`", line)
    assert len(named) >= 2 and all(os.path.exists(os.path.join(RESULTS, p)) for p in named), named
    for p in named + ["gpu-notes.md"]:  # the same layout as bench/results, in a folder of the test's
        os.makedirs(os.path.dirname(tmp_path / p), exist_ok=True)
        shutil.copy(os.path.join(RESULTS, p), tmp_path / p)
    out = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "gpu_bench.py"), "--merge", *named,
                          "--out-dir", "."], cwd=tmp_path, capture_output=True, text=True, timeout=300,
                         env=dict(os.environ, MPLBACKEND="Agg"))
    assert out.returncode == 0, out.stderr[-2000:]
    assert "appended: ./gpu-notes.md" in out.stdout
    again = (tmp_path / "gpu.md").read_text()
    assert again == published, "gpu.md is not what its run files give: regenerate it with gpu_bench.py --merge"


def test_knob_study_report_is_regenerated_from_its_run_files(tmp_path):
    with open(os.path.join(RESULTS, "knobs.md")) as f:
        published = f.read()
    line = next(ln for ln in published.splitlines() if ln.startswith("Produced by"))
    named = re.findall(r"`([^`]+\.json)`", line)
    assert named and all(os.path.exists(os.path.join(RESULTS, p)) for p in named), named
    for p in named:
        os.makedirs(os.path.dirname(tmp_path / p), exist_ok=True)
        shutil.copy(os.path.join(RESULTS, p), tmp_path / p)
    out = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "inductor_knobs.py"), "--report", *named,
                          "--out", "knobs.md"], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert (tmp_path / "knobs.md").read_text() == published, \
        "knobs.md is not what its run files give: regenerate it with inductor_knobs.py --report"
