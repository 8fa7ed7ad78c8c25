"""The ONNX Runtime backend on the CPU (an optional package: these tests skip without it, but
for the one that checks what it says then): exported with either exporter, new batch sizes
served by a dynamic export, saved and loaded, refusals, and bad configs."""

from __future__ import annotations

import copy
import importlib.util
import subprocess
import sys

import pytest
import torch

import torch_tweak as tt
from torch_tweak.backends import ONNXRuntimeBackend, TorchEagerBackend
from support import FAST
from test_backends import CPU, expected, relative_error, tune_one  # noqa: F401 (expected: a fixture)


def needs_ort():
    for name in ("onnxruntime", "onnx"):
        pytest.importorskip(name, reason="ONNX Runtime not installed: pip install torch-tweak[onnxruntime]")


@pytest.mark.parametrize("exporter", ["dynamo", "torchscript"])
@pytest.mark.slow
def test_onnxruntime_runs_on_the_cpu_and_serves_new_batch_sizes(mlp, mlp_data, expected, exporter):
    needs_ort()
    if exporter == "dynamo":
        pytest.importorskip("onnxscript", reason="the dynamo exporter needs onnxscript")
    # six batch sizes of one shape class: one group (signatures.merge_varying), exported once
    # with a dynamic batch dimension
    g = torch.Generator().manual_seed(2)
    data = mlp_data[:1] + [torch.randn(b, 16, generator=g) for b in (7, 6, 5, 4, 2)]
    untuned = copy.deepcopy(mlp)
    w = tune_one(mlp, data, ONNXRuntimeBackend(exporter=exporter, intra_op_threads=1))
    assert [s.backend.name if s.backend else s.error for s in w.tt_signatures] == ["ONNXRuntime"]
    assert w.tt_signatures[0].varying
    assert relative_error(mlp, mlp_data, expected) < 1e-4
    w.tt_reset_untuned()
    with torch.no_grad():
        for x in data + [torch.randn(3, 16, generator=g)]:
            torch.testing.assert_close(mlp(x), untuned(x), rtol=1e-4, atol=1e-4)
    assert sum(w.tt_untuned.values()) == 0  # batch 3 too: the dynamic export serves it


@pytest.mark.slow
def test_onnxruntime_export_prints_nothing_about_packages_the_user_does_not_have():
    # In a fresh interpreter: torch's exporter logs through its own handler to the process's
    # stderr, which pytest's capture does not see reliably.
    needs_ort()
    pytest.importorskip("onnxscript", reason="the dynamo exporter needs onnxscript")
    if importlib.util.find_spec("torchvision") is not None:
        pytest.skip("torchvision is installed: the exporter has nothing to say about it")
    code = """
import copy, torch, torch_tweak as tt
from torch import nn
from torch_tweak.backends import ONNXRuntimeBackend
torch.manual_seed(0)
m = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4)).eval()
untuned = copy.deepcopy(m)
data = [torch.randn(b, 16) for b in (2, 3, 4)]
(w,) = tt.wrap(m, ["0"], strategy=tt.OneBackendStrategy(ONNXRuntimeBackend(exporter="dynamo")))
tt.tune(m, data)
assert w.tt_backend is not None and w.tt_backend.name == "ONNXRuntime", w.tt_error
with torch.no_grad():
    for x in data:
        torch.testing.assert_close(m(x), untuned(x), rtol=1e-4, atol=1e-4)
"""
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "is not installed. Skipping" not in proc.stderr, proc.stderr[-3000:]


def test_onnxruntime_a_tuned_model_saved_and_loaded_exports_again(mlp, mlp_data, expected, tmp_path):
    needs_ort()
    untuned = copy.deepcopy(mlp)
    tune_one(mlp, mlp_data, ONNXRuntimeBackend(exporter="torchscript", graph_optimization_level="extended"))
    tt.save(mlp, tmp_path / "m.tt")
    fresh = copy.deepcopy(untuned)
    tt.load(fresh, tmp_path / "m.tt")
    w = tt.installed(fresh)["blocks.0"]
    assert w.tt_backend.name == "ONNXRuntime"
    assert w.tt_backend.config.graph_optimization_level == "extended"
    with torch.no_grad():
        for x in mlp_data:
            torch.testing.assert_close(fresh(x), untuned(x), rtol=1e-4, atol=1e-4)
    assert sum(w.tt_untuned.values()) == 0


def test_onnxruntime_not_installed_reports_it_and_strategies_move_on(mlp, mlp_data, monkeypatch):
    monkeypatch.setitem(sys.modules, "onnxruntime", None)  # import onnxruntime now raises ImportError
    assert ONNXRuntimeBackend().unavailable(CPU) == "not installed (pip install torch-tweak[onnxruntime])"
    (w,) = tt.wrap(mlp, ["head"], strategy=tt.FirstWinsStrategy([ONNXRuntimeBackend(), TorchEagerBackend()]))
    assert tt.tune(mlp, mlp_data, measure=FAST) == {"head": "TorchEager"}
    assert "not installed" in w.tt_report[0]["error"] and w.tt_report[0]["reason"] == "unavailable"


def test_onnxruntime_refuses_other_devices_and_bfloat16(mlp):
    needs_ort()
    assert "not on cuda" in ONNXRuntimeBackend().unavailable(torch.device("cuda"))
    with pytest.raises(ValueError, match="bfloat16"):
        ONNXRuntimeBackend().prepare(copy.deepcopy(mlp).bfloat16(), [((torch.randn(2, 16).bfloat16(),), {})], CPU)


@pytest.mark.parametrize("make, error, match", [
    (lambda: ONNXRuntimeBackend(graph_optimization_level="max"), ValueError, "graph_optimization_level must be one of"),
    (lambda: ONNXRuntimeBackend(intra_op_threads=-1), ValueError, "intra_op_threads must be a whole number"),
    (lambda: ONNXRuntimeBackend(inter_op_threads=True), ValueError, "inter_op_threads must be a whole number"),
    (lambda: ONNXRuntimeBackend(execution_mode="fast"), ValueError, "execution_mode must be one of"),
    (lambda: ONNXRuntimeBackend(exporter="onnx"), ValueError, "exporter must be one of dynamo"),
    (lambda: ONNXRuntimeBackend(providers=["CUDA"]), TypeError, "ONNXRuntimeBackend has no option providers"),
])
def test_bad_configs_name_what_is_wrong(make, error, match):
    with pytest.raises(error, match=match):
        make()
