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

from torch_tweak._core import settings

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
    cap = 4 * memory["model_bytes"] + settings.LOAD_SLACK_BYTES  # the cap docs/deployment.md states
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


# ------------------------------------------------------------------ bounds on what a file sets


def load_bounded(items: list[tuple[str, object]], timeout: float = 240.0) -> dict[str, dict]:
    """tt.load of each (model kind, file) in one child under a memory limit (tests/bounded_load.py);
    {file name: what it did}. A file that hangs the load fails here, at the timeout."""
    try:
        done = subprocess.run([sys.executable, os.path.join(TESTS, "bounded_load.py"),
                               *(f"{kind}:{path}" for kind, path in items)],
                              capture_output=True, text=True, timeout=timeout, cwd=TESTS)
    except subprocess.TimeoutExpired as exc:
        started = [json.loads(line)["start"] for line in (exc.stdout or b"").decode().splitlines() if '"start"' in line]
        raise AssertionError(f"tt.load was still running after {timeout:.0f} s, on {started[-1:]}") from None
    lines = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    started = [line["start"] for line in lines if "start" in line]
    assert done.returncode == 0, f"the child died loading {started[-1:]}: {done.stderr[-3000:]}"
    return {os.path.basename(line["path"]): line for line in lines if "path" in line}


def genuine_padded(folder, kind: str):
    import bounded_load
    import forgery
    import torch_tweak as tt

    model = bounded_load.build(kind)
    tt.wrap(model, [""], strategy=tt.OneBackendStrategy(tt.backends.PaddedGraphBackend(graph=False, compile=False)))
    assert tt.tune(model, bounded_load.calls(kind)) == {"": "PaddedGraph"}
    path = folder / f"{kind}.tt"
    tt.save(model, path)
    return path, forgery.members(path)


def padded_forgeries(folder, kind: str, base: dict) -> dict[str, object]:
    """The attack's files: one or two numbers of the genuine one changed, no weights, no key."""
    import forgery

    def config(**fields):
        def edit(plan):
            for sig in plan["modules"][0]["signatures"]:
                sig["backend"]["config"].update(fields)
        return edit

    def declared(plan):
        plan["shapes"] = {"length": [1, 1 << 20]}

    edits = {"million_one_bucket": config(max_length=1 << 20, length_buckets=1),
             "million_64_buckets": config(max_length=1 << 20, length_buckets=64),
             "max_length_65536": config(max_length=1 << 16), "declared_million": declared}
    return {name: forgery.with_plan(folder, f"{kind}_{name}", base, edit) for name, edit in edits.items()}


PADDED_REFUSALS = {  # per model kind and forgery, what the refusal names: the field, its value, the bound
    "table": {"million_one_bucket": ["max_length=1048576", "position table (64 positions)"],
              "million_64_buckets": ["max_length=1048576", "position table (64 positions)"],
              "max_length_65536": ["max_length=65536", "position table (64 positions)"],
              "declared_million": ["declared shapes", "length (1, 1048576)", "position table (64 positions)"]},
    "free": {"million_one_bucket": ["max_length=1048576", "length_buckets=1", "16 x the longest stored call"],
             "million_64_buckets": ["max_length=1048576", "length_buckets=64", "steps of 16384"],
             "max_length_65536": ["max_length=65536", "length_buckets=8", "steps of 8192"],
             "declared_million": ["max_length=1048576", "16 x the longest stored call"]},
}


def test_forged_padding_is_refused_before_anything_is_built(tmp_path):
    """Issue 49 (6): a padded max_length of 2^20 in one bucket (or 64), of 65536, or a declared
    length range to 2^20, padded every stored call to thousands or a million positions and ran
    attention on them: tt.load hung. Each is refused at once, naming the field, its value and
    the bound (the model's position table where it has one, else 16 x the longest stored call),
    and the genuine file loads and answers as the untuned model."""
    items, expected = [], {}
    for kind in ("table", "free"):
        genuine, base = genuine_padded(tmp_path, kind)
        items.append((kind, genuine))
        for name, path in padded_forgeries(tmp_path, kind, base).items():
            items.append((kind, path))
            expected[path.name] = PADDED_REFUSALS[kind][name]
    found = load_bounded(items)
    for kind in ("table", "free"):
        got = found[f"{kind}.tt"]
        assert got["outcome"] == "loaded" and got["backends"] == ["PaddedGraph"] and got["same"], got
    for name, words in expected.items():
        got = found[name]
        assert got["outcome"] == "error" and got["unchanged"], (name, got)
        assert all(w in got["message"] for w in words), (name, words, got["message"])
        assert got["seconds"] < 5.0, (name, got)  # refused before anything is built


def test_forged_onnxruntime_threads_are_refused(tmp_path):
    """Issue 49 (6): ONNX Runtime with 1,024 intra- and inter-op threads from a file: tt.load
    made those thread pools on a 2-core machine. A file's thread count is at most this
    machine's CPUs."""
    pytest.importorskip("onnxruntime")
    pytest.importorskip("onnx")
    import bounded_load
    import forgery
    import torch_tweak as tt

    model = bounded_load.build("mlp")
    tt.wrap(model, [""], strategy=tt.OneBackendStrategy(tt.backends.ONNXRuntimeBackend()))
    assert tt.tune(model, bounded_load.calls("mlp")) == {"": "ONNXRuntime"}
    genuine = tmp_path / "mlp.tt"
    tt.save(model, genuine)

    def threads(plan):
        for sig in plan["modules"][0]["signatures"]:
            sig["backend"]["config"].update(intra_op_threads=1024, inter_op_threads=1024)

    forged = forgery.with_plan(tmp_path, "threads", forgery.members(genuine), threads)
    found = load_bounded([("mlp", genuine), ("mlp", forged)], timeout=120.0)
    assert found["mlp.tt"]["outcome"] == "loaded" and found["mlp.tt"]["backends"] == ["ONNXRuntime"], found
    assert found["mlp.tt"]["same"], found
    got = found["threads.tt"]
    assert got["outcome"] == "error" and got["unchanged"], got
    assert "intra_op_threads=1024" in got["message"] and "this machine's CPUs" in got["message"], got["message"]
    assert got["seconds"] < 5.0, got


def test_the_callers_own_backend_is_not_bounded_but_the_files_shapes_are(tmp_path):
    """A backend the caller passes is the caller's choice, not bounded; the file's declared
    shapes still are, also where they would widen the caller's backend."""
    import bounded_load
    import forgery
    import torch_tweak as tt
    _, base = genuine_padded(tmp_path, "free")
    declared = padded_forgeries(tmp_path, "free", base)["declared_million"]
    model = bounded_load.build("free")
    plain = tt.backends.PaddedGraphBackend(graph=False, compile=False)
    with pytest.raises(tt.CheckpointError, match=r"max_length=1048576 .*16 x the longest stored call"):
        tt.load(model, declared, backends=[plain])
    assert not tt.installed(model)

    def wide(plan):
        plan["modules"][0]["signatures"][0]["backend"]["config"].update(max_length=1024, length_buckets=1)

    chosen = forgery.with_plan(tmp_path, "chosen", base, wide)
    with pytest.raises(tt.CheckpointError, match="max_length=1024 with length_buckets=1 pads to steps of 1024"):
        tt.load(bounded_load.build("free"), chosen)
    fresh, untuned = bounded_load.build("free"), bounded_load.build("free")
    own = tt.backends.PaddedGraphBackend(graph=False, compile=False, max_length=1024, length_buckets=1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert tt.load(fresh, chosen, backends=[own]) == {"": "PaddedGraph"}  # the caller's own choice loads
    assert bounded_load.answers(fresh, untuned, "free")
    from torch_tweak._core.shapes import positions

    assert positions(bounded_load.build("table")) == bounded_load.POSITIONS
    assert positions(bounded_load.build("free")) is None
