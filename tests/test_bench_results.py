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

import pytest

pytestmark = pytest.mark.slow  # each regenerates a report from its run files in a child process

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


def regenerated(tmp_path, report: str, script: str, named: list[str]) -> str:
    """`report` written again by `script --report` from copies of the run files it names."""
    assert named and all(os.path.exists(os.path.join(RESULTS, p)) for p in named), named
    for p in named:
        os.makedirs(os.path.dirname(tmp_path / p), exist_ok=True)
        shutil.copy(os.path.join(RESULTS, p), tmp_path / p)
    out = subprocess.run([sys.executable, os.path.join(ROOT, "bench", script), "--report", *named,
                          "--out", report], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    return (tmp_path / report).read_text()


def test_knob_study_report_is_regenerated_from_its_run_files(tmp_path):
    with open(os.path.join(RESULTS, "knobs.md")) as f:
        published = f.read()
    line = next(ln for ln in published.splitlines() if ln.startswith("Produced by"))
    named = re.findall(r"`([^`]+\.json)`", line)
    assert regenerated(tmp_path, "knobs.md", "inductor_knobs.py", named) == published, \
        "knobs.md is not what its run files give: regenerate it with inductor_knobs.py --report"


def test_a_column_measured_in_another_run_shows_against_that_runs_tweak(tmp_path):
    """A run of a row's missing max-autotune column beside its own tweak: the report shows it in
    its own table, its ratio taken within that run, and counts whether tweak was faster there."""
    import json

    with open(os.path.join(RESULTS, "runs", "gpu-5c15d42-b-roofline.json")) as f:
        main = json.load(f)
    row = next(r for r in main["rows"] if (r["model"], r["dtype"]) == ("resnet50", "fp32"))
    alone = {"environment": dict(main["environment"], commit="abc1234"), "settings": main["settings"],
             "rows": [{"model": "resnet50", "dtype": "fp32", "size": row["size"], "errors": {},
                       "compile_s": {"max-autotune-no-cudagraphs": 250.0}, "tune_s": 20.0,
                       "ms": {"eager": 3.5, "tweak": 1.0, "max-autotune-no-cudagraphs": 1.5}}]}
    slower = json.loads(json.dumps(alone))
    slower["rows"][0]["ms"] = {"eager": 3.5, "tweak": 1.1, "max-autotune-no-cudagraphs": 0.9}
    slower["environment"]["commit"] = "def5678"
    paths = []
    for name, run in (("main.json", main), ("alone.json", alone), ("slower.json", slower)):
        (tmp_path / name).write_text(json.dumps(run))
        paths.append(name)
    out = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "gpu_bench.py"), "--merge", *paths,
                          "--out-dir", "."], cwd=tmp_path, capture_output=True, text=True, timeout=300,
                         env=dict(os.environ, MPLBACKEND="Agg"))
    assert out.returncode == 0, out.stderr[-2000:]
    md = (tmp_path / "gpu.md").read_text()
    lines = [ln for ln in md.splitlines() if ln.startswith("| resnet50 | fp32 | max-autotune-no-cudagraphs |")]
    # two runs measured it: the later one in the merge is shown, its ratio from its own tweak
    assert lines == ["| resnet50 | fp32 | max-autotune-no-cudagraphs | 0.900 | 1.100 | 0.82x | 250.0 | def5678 |"]
    assert "tweak is faster than 0 of 1 beside it in their run." in md
    # the main table still takes the run with the most columns; the lone run does not replace it
    main_line = next(ln for ln in md.splitlines() if ln.startswith("| resnet50 | fp32 | 3.676"))
    assert main_line.endswith("| 5c15d42 |")


def test_serving_report_is_regenerated_from_its_run_files(tmp_path):
    with open(os.path.join(RESULTS, "serving.md")) as f:
        published = f.read()
    named = re.findall(r"^- `(runs/[^`]+\.json)`", published, flags=re.M)
    assert regenerated(tmp_path, "serving.md", "serving_bench.py", named) == published, \
        "serving.md is not what its run files give: regenerate it with serving_bench.py --report"
