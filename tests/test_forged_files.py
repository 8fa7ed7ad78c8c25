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
import warnings

import pytest
import torch

from torch_tweak._store import checkpoint

pytestmark = pytest.mark.slow  # each tunes and saves a model in a child process, then forges its file

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


# ------------------------------------------------------------------ checks that compare something


class Scaled(torch.nn.Module):
    """A module with a plain argument: a backend that bakes plain values in (OpenVINO) serves
    another value wrongly unless the check saw it."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(16, 16)

    def forward(self, x: torch.Tensor, scale: float) -> torch.Tensor:
        return self.lin(x) * scale


def scaled() -> Scaled:
    torch.manual_seed(0)
    return Scaled().eval()


def test_a_file_whose_reference_outputs_are_nan_builds_nothing_on_them(tmp_path):
    """A forger without the weights stores NaN as every reference output of an "any other call"
    group whose OpenVINO build bakes in scale=3.0: the check compared nothing, and a call of
    scale 2.0 got the answer for 3.0. Now a reference with no finite value accepts no backend:
    the group runs the original forward, with a warning saying why."""
    pytest.importorskip("openvino")
    import torch_tweak as tt
    from torch_tweak._core.signatures import OTHER, SignatureGroup

    x8, x5 = torch.randn(8, 16), torch.randn(5, 16)
    model = scaled()
    tt.wrap(model, [""], strategy=tt.OneBackendStrategy(tt.backends.TorchEagerBackend()))
    tt.tune(model, [(x8, 2.0)] * 2)
    forged = SignatureGroup(None, OTHER, "other", backend=tt.backends.OpenVINOBackend())
    forged.samples.append(((x5, 3.0), {}))
    forged.outputs.append(torch.full((5, 16), float("nan")))
    tt.installed(model)[""].tt_signatures.append(forged)
    path = tmp_path / "nan.tt"
    tt.save(model, path)
    fresh = scaled()
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        tt.load(fresh, path)
    with torch.no_grad():
        untuned = scaled()
        for x, scale in ((x5, 2.0), (x5, 3.0), (x8, 2.0)):
            assert torch.equal(fresh(x, scale), untuned(x, scale)), (tuple(x.shape), scale)
    assert any("any other call" in str(w.message) and "no finite value" in str(w.message) for w in seen)


@pytest.mark.parametrize("precision", ["bf16", "f16"])
def test_a_file_lowering_openvino_precision_is_refused_unless_passed(tmp_path, precision):
    """A file set OpenVINO's inference_precision to bf16 or f16 with a widened tolerance, and
    tt.load built it (relative errors of 3.6e-3 against float32's 1e-3): lower precision is
    opt-in by one rule (BackendConfig.lowers_precision), so the file is refused unless the
    caller passes that backend."""
    pytest.importorskip("openvino")
    import forgery
    import torch_tweak as tt

    plain, _ = forgery.genuine(tmp_path)

    def edit(plan):
        for module in plan["modules"]:
            for sig in module["signatures"]:
                sig["backend"] = {"name": "OpenVINO", "class": "torch_tweak.backends.openvino:OpenVINOBackend",
                                  "config": {"inference_precision": precision, "tolerance": 0.05}}
    path = forgery.with_plan(tmp_path, "lowered", forgery.members(plain), edit)
    model = forgery.build()
    before = forgery.state_of(model)
    with pytest.raises(tt.CheckpointError, match=f"lower precision \\(inference_precision='{precision}'\\) is opt-in"):
        tt.load(model, path)
    assert forgery.unchanged(model, before)
    given = [tt.backends.OpenVINOBackend()]  # OpenVINO at its own precision does not unlock the file's
    with pytest.raises(tt.CheckpointError, match="is opt-in"):
        tt.load(model, path, backends=given)
    assert forgery.unchanged(model, before)
    asked = tt.backends.OpenVINOBackend(inference_precision=precision, tolerance=0.05)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        loaded = tt.load(model, path, backends=[asked])  # the caller's own choice: it loads
    assert set(loaded.values()) <= {"OpenVINO", None}
    with torch.no_grad():
        for x, expected in zip(forgery.INPUTS, forgery.EXPECTED):
            assert (model(x) - expected).abs().max() <= 0.05 * expected.abs().max()
