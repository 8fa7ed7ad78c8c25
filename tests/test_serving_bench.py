"""bench/serving_bench.py --fresh (issue 57's measurement on a GPU) is known to run: its --smoke,
tiny models on the CPU, every column and figure of a run file there."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "bench"


@pytest.mark.slow
def test_the_fresh_shapes_bench_runs_in_smoke_mode(tmp_path):
    pytest.importorskip("transformers")
    out = tmp_path / "fresh.json"
    done = subprocess.run([sys.executable, str(BENCH / "serving_bench.py"), "--fresh", "--smoke", "--json", str(out)],
                          capture_output=True, text=True, timeout=1200)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = {row["model"]: row for row in json.loads(out.read_text())["rows"]}
    assert set(rows) == {"bert-pooler", "resnet18"}
    for row in rows.values():
        assert not row["errors"] and not row["skipped"], (row["errors"], row["skipped"])
        assert set(row["warm_s"]) == set(row["new_first_s"]) == {"eager", "tweak"}
        assert row["error"]["tweak"] < 1e-3 and "tune_s" in row
        assert {"warm_s", "new_s", "first_pass_vs_eager_warm", "cold_vs_beaten_column"} <= set(row["verdict"])
        (padded,) = row["tweak_buckets"]
        assert padded["outside_range"] == 0 and padded["refused_buckets"] == 0
    vision = rows["resnet18"]
    assert vision["per_batch"] and {"eager", "tweak", "bucket", "padding"} <= set(vision["per_batch"][0])
    assert vision["levers"]["largest"] in vision["levers"]["gaps_ms"]
