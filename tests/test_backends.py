"""Every backend on the CPU, on tiny modules: OpenVINO (both conversions), TorchAO, Eager under
autocast, Inductor's config passed through, the documented user backend, samples a backend
cannot store, and bad configs."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

import torch_tweak as tt
from torch_tweak.backends import OpenVINOBackend, TorchAOBackend, TorchEagerBackend, TorchInductorBackend
from torch_tweak.backends.base import NeedsStorableSamples
from support import FAST, CountingBackend
from test_api import assert_unchanged, snapshot

CPU = torch.device("cpu")


def tune_one(model, data, backend, path="blocks.0"):
    (w,) = tt.wrap(model, [path], strategy=tt.OneBackendStrategy(backend))
    tt.tune(model, data, measure=FAST)
    return w


def relative_error(model, data, expected):
    with torch.no_grad():
        return max(float((model(x) - e).abs().max() / e.abs().max()) for x, e in zip(data, expected))


@pytest.fixture
def expected(mlp, mlp_data):
    with torch.no_grad():
        return [mlp(x) for x in mlp_data]


# ---------------------------------------------------------------- OpenVINO

@pytest.mark.parametrize("conversion", ["convert_model", "torch_compile"])
@pytest.mark.slow
def test_openvino_runs_on_the_cpu(mlp, mlp_data, expected, conversion):
    pytest.importorskip("openvino", reason="OpenVINO not installed: pip install torch-tweak[openvino]")
    w = tune_one(mlp, mlp_data, OpenVINOBackend(conversion=conversion, performance_hint="THROUGHPUT"))
    assert w.tt_backend is not None, w.tt_error
    assert w.tt_backend.name == "OpenVINO" and w.tt_signatures[0].report[0]["max_error"] < 1e-3
    assert relative_error(mlp, mlp_data, expected) < 1e-3


def test_openvino_properties_follow_the_config(mlp):
    samples = [((torch.randn(2, 16),), {})]
    assert OpenVINOBackend().properties(samples, mlp) == {"PERFORMANCE_HINT": "LATENCY", "INFERENCE_PRECISION_HINT": "f32"}
    props = OpenVINOBackend(performance_hint="THROUGHPUT", inference_precision="bf16",
                            properties={"NUM_STREAMS": 2}).properties(samples, mlp)
    assert props == {"PERFORMANCE_HINT": "THROUGHPUT", "INFERENCE_PRECISION_HINT": "bf16", "NUM_STREAMS": 2}
    assert OpenVINOBackend().ov_device(torch.device("xpu")) == "GPU"
    assert OpenVINOBackend(ov_device="GPU.1").ov_device(CPU) == "GPU.1"


def test_openvino_not_installed_reports_it_and_strategies_move_on(mlp, mlp_data, monkeypatch):
    monkeypatch.setitem(sys.modules, "openvino", None)  # import openvino now raises ImportError
    assert OpenVINOBackend().unavailable(CPU) == "not installed (pip install torch-tweak[openvino])"
    (w,) = tt.wrap(mlp, ["head"], strategy=tt.FirstWinsStrategy([OpenVINOBackend(), TorchEagerBackend()]))
    assert tt.tune(mlp, mlp_data, measure=FAST) == {"head": "TorchEager"}
    assert "not installed" in w.tt_report[0]["error"] and w.tt_report[0]["reason"] == "unavailable"
    assert [type(b).__name__ for b in tt.default_backends("cpu")] == [
        "TorchInductorBackend", "OpenVINOBackend", "TorchEagerBackend"]


def test_openvino_refuses_cuda():
    pytest.importorskip("openvino", reason="OpenVINO not installed: pip install torch-tweak[openvino]")
    assert "not on cuda" in OpenVINOBackend().unavailable(torch.device("cuda"))


# ---------------------------------------------------------------- TorchAO

@pytest.mark.parametrize("mode", ["int8_weight_only", "int8_dynamic"])
@pytest.mark.slow
def test_torchao_quantizes_a_copy_within_its_tolerance(mlp, mlp_data, expected, mode):
    pytest.importorskip("torchao", reason="torchao not installed: pip install torch-tweak[torchao]")
    weight = mlp.blocks[0][0].weight
    before = weight.detach().clone()
    w = tune_one(mlp, mlp_data, TorchAOBackend(mode=mode))
    assert w.tt_backend is not None, w.tt_error
    report = w.tt_signatures[0].report[0]
    assert 0 < report["max_error"] < 0.05  # quantized: close, not equal
    assert 0 < relative_error(mlp, mlp_data, expected) < 0.05
    assert type(weight) is nn.Parameter and weight is tt.installed(mlp)["blocks.0"]._tt_original[0].weight
    assert torch.equal(weight, before)  # the model keeps its own weights; the copy was quantized


def test_torchao_has_its_own_default_tolerance():
    assert TorchAOBackend().check_tolerance() == 0.05 == TorchAOBackend().config.tolerance
    assert TorchAOBackend(tolerance=0.2).check_tolerance() == 0.2


def test_torchao_fp8_on_a_device_that_cannot_run_it_is_refused(mlp, mlp_data):
    before = snapshot(mlp)
    strategy = tt.OneBackendStrategy(TorchAOBackend(mode="fp8"))
    with pytest.raises(ValueError, match="TorchAO fp8 needs a CUDA GPU of compute capability 8.9 or newer; cpu"):
        tt.tweak(mlp, mlp_data, strategy=strategy, progress=False)
    assert_unchanged(mlp, before)
    tt.wrap(mlp, ["head"], strategy=strategy)
    with pytest.raises(ValueError, match="TorchAO fp8 .* cpu cannot run it"):
        tt.tune(mlp, mlp_data)
    assert tt.installed(mlp)["head"].tt_backend is None


def test_torchao_not_installed_reports_it(monkeypatch):
    monkeypatch.setitem(sys.modules, "torchao", None)
    monkeypatch.setitem(sys.modules, "torchao.quantization", None)
    assert TorchAOBackend().unavailable(CPU) == "not installed (pip install torch-tweak[torchao])"


@pytest.mark.slow
def test_torchao_rejects_a_module_without_linear_layers():
    pytest.importorskip("torchao", reason="torchao not installed: pip install torch-tweak[torchao]")
    with pytest.raises(ValueError, match="has none"):
        TorchAOBackend().prepare(nn.ReLU(), [((torch.ones(2),), {})], CPU)


# ---------------------------------------------------------------- Eager and Inductor

def test_eager_under_autocast(mlp, mlp_data, expected):
    w = tune_one(mlp, mlp_data, TorchEagerBackend(autocast_dtype=torch.bfloat16), path="")
    assert w.tt_backend is not None, w.tt_error
    with torch.no_grad():
        got = mlp(mlp_data[0])
    assert got.dtype == torch.float32  # cast back: the code around the module sees what it saw
    error = relative_error(mlp, mlp_data, expected)
    assert 0 < error < tt.TOLERANCES[torch.bfloat16]  # it did compute in bfloat16
    assert TorchEagerBackend(autocast_dtype=torch.bfloat16).check_tolerance() == tt.TOLERANCES[torch.bfloat16]


def test_inductor_passes_its_whole_config_to_torch_compile(monkeypatch):
    seen = []

    def fake_compile(module, **kwargs):
        seen.append(kwargs)
        return module

    monkeypatch.setattr(torch, "compile", fake_compile)
    samples = [((torch.ones(2, 3),), {})]
    TorchInductorBackend(mode="max-autotune", dynamic=True, fullgraph=True).prepare(nn.ReLU(), samples, CPU)
    TorchInductorBackend(options={"epilogue_fusion": False}, dynamic=False).prepare(nn.ReLU(), samples, CPU)
    assert seen == [
        {"backend": "inductor", "mode": "max-autotune", "options": None, "dynamic": True, "fullgraph": True},
        {"backend": "inductor", "mode": None, "options": {"epilogue_fusion": False}, "dynamic": False,
         "fullgraph": False},
    ]


def test_candidates_with_the_same_effective_compile_share_it(monkeypatch):
    from torch_tweak.backends.inductor import compile_module, shared_compiles

    seen = []

    def fake_compile(module, **kwargs):
        seen.append(kwargs)
        return lambda *a, **k: module(*a, **k)

    monkeypatch.setattr(torch, "compile", fake_compile)
    relu, samples = nn.ReLU(), [((torch.ones(2, 3),), {})] * 2
    with shared_compiles(static=True):
        plain = compile_module(relu, samples)  # what TorchInductorBackend() compiles
        graphed = compile_module(relu, samples[:1], options={"triton.cudagraphs": False}, dynamic=False)
        other_mode = compile_module(relu, samples, mode="max-autotune")
        other_module = compile_module(nn.ReLU(), samples)
    assert graphed is plain and other_mode is not plain and other_module is not plain
    assert [kw["dynamic"] for kw in seen] == [False, False, False]  # a static signature: static shapes
    compile_module(relu, samples)  # outside a scope nothing is shared, and dynamic stays as given
    assert len(seen) == 4 and seen[-1]["dynamic"] is None
    with shared_compiles(static=False):  # "any other call": torch decides
        compile_module(relu, samples)
        compile_module(relu, samples, dynamic=True)
    assert [kw["dynamic"] for kw in seen[4:]] == [None, True]
    seen[4:] = []

    class Untraceable(nn.Module):
        def forward(self, x):
            raise RuntimeError("cannot trace this")

    broken = Untraceable()
    with shared_compiles(static=True):
        for _ in range(2):
            with pytest.raises(RuntimeError, match="cannot trace this"):
                compile_module(broken, samples)
    assert len(seen) == 5  # the failure is shared too: compiled once


@pytest.mark.slow
def test_tuning_compiles_a_module_once_for_two_inductor_candidates(mlp, mlp_data, monkeypatch):
    seen = []
    real = torch.compile

    def counting_compile(module, **kwargs):
        seen.append(kwargs)
        return real(module, backend="eager")

    monkeypatch.setattr(torch, "compile", counting_compile)
    strategy = tt.HighestThroughputStrategy([TorchInductorBackend(), TorchInductorBackend(dynamic=False),
                                             TorchInductorBackend(mode="max-autotune")])
    tt.wrap(mlp, [""])
    try:
        tt.tune(mlp, mlp_data, strategy=strategy, measure=FAST)
    finally:
        tt.unwrap(mlp)
    assert [kw["mode"] for kw in seen] == [None, "max-autotune"]


@pytest.mark.slow
def test_sibling_modules_past_the_recompile_limit_are_each_compiled(monkeypatch):
    """Dynamo's limit of compiles per forward (8) would hand the 9th sibling its eager code
    under Inductor's name; compile_module lifts it for its own compiles only."""
    import torch._dynamo
    from torch._dynamo.utils import counters
    from torch_tweak.backends.inductor import _limit_names, compile_module, shared_compiles

    real = torch.compile
    monkeypatch.setattr(torch, "compile", lambda module, **kw: real(module, backend="eager", dynamic=False))

    class Block(nn.Module):  # one forward, many sizes: one code object in dynamo's cache
        def __init__(self, width):
            super().__init__()
            self.linear = nn.Linear(width, width)

        def forward(self, x):
            return torch.relu(self.linear(x)) + x

    def graphs_compiled(compile_one):
        torch._dynamo.reset()
        before = counters["stats"]["unique_graphs"]
        for width in range(4, 16):  # 12 siblings, past the limit of 8
            block = Block(width)
            compile_one(block, [((torch.randn(2, width),), {})])
        return counters["stats"]["unique_graphs"] - before

    import torch._dynamo.config as dynamo_config
    limits = {name: getattr(dynamo_config, name) for name in _limit_names()}
    assert limits and limits[_limit_names()[0]] < 12

    def plain(block, samples):
        fn = real(block, backend="eager", dynamic=False)
        for args, kwargs in samples:
            fn(*args, **kwargs)

    assert graphs_compiled(plain) < 12  # what torch.compile alone does: the limit bites

    def shared(block, samples):
        with shared_compiles(static=True):
            compile_module(block, samples)

    assert graphs_compiled(shared) == 12
    assert {name: getattr(dynamo_config, name) for name in limits} == limits  # the limit is back
    torch._dynamo.reset()


@pytest.mark.slow
def test_torchao_compile_option_compiles_the_quantized_copy(monkeypatch):
    pytest.importorskip("torchao", reason="torchao not installed: pip install torch-tweak[torchao]")
    compiled = []
    monkeypatch.setattr(torch, "compile", lambda module, **kw: compiled.append(module) or module)
    module = nn.Sequential(nn.Linear(4, 4))
    TorchAOBackend(compile=True).prepare(module, [((torch.ones(2, 4),), {})], CPU)
    assert len(compiled) == 1 and compiled[0] is not module


# ---------------------------------------------------------------- bad configs

@pytest.mark.parametrize("make, error, match", [
    (lambda: OpenVINOBackend(hint="LATENCY"), TypeError, "OpenVINOBackend has no option hint"),
    (lambda: OpenVINOBackend(performance_hint="FAST"), ValueError, "performance_hint must be one of LATENCY"),
    (lambda: OpenVINOBackend(conversion="onnx"), ValueError, "conversion must be one of convert_model"),
    (lambda: OpenVINOBackend(inference_precision="int4"), ValueError, "inference_precision"),
    (lambda: TorchAOBackend(mode="int4"), ValueError, "mode must be one of int8_weight_only"),
    (lambda: TorchAOBackend(compile="yes"), ValueError, "compile must be a bool"),
    (lambda: TorchAOBackend(bits=8), TypeError, "TorchAOBackend has no option bits"),
    (lambda: TorchEagerBackend(autocast_dtype="bf16"), ValueError, "autocast_dtype must be a torch.dtype"),
    (lambda: tt.backends.DeviceGraphBackend(lend_outputs=1), ValueError, "lend_outputs must be a bool"),
    (lambda: tt.HighestThroughputStrategy([]), ValueError, "needs at least one backend"),
])
def test_bad_configs_name_what_is_wrong(make, error, match):
    with pytest.raises(error, match=match):
        make()


# ---------------------------------------------------------------- samples a backend cannot store

DynamicCache = type("DynamicCache", (), {"__module__": "transformers.cache_utils"})
"""Looks like transformers' DynamicCache to anything that reads its class name and module."""


class Storeless(NeedsStorableSamples, CountingBackend):
    name = "Storeless"


def test_backends_do_not_store_samples_holding_a_cache():
    x = torch.ones(2)
    plain, cached, nested = ((x,), {}), ((x, DynamicCache()), {}), ((x,), {"past": [DynamicCache()]})
    for backend in (TorchInductorBackend(), TorchAOBackend(), OpenVINOBackend(conversion="torch_compile")):
        assert backend.can_store(plain) and not backend.can_store(cached) and not backend.can_store(nested)
    for backend in (TorchEagerBackend(), OpenVINOBackend()):
        assert backend.can_store(cached)
    look_alike = type("DynamicCache", (), {})()  # same name, not from transformers
    assert TorchInductorBackend().can_store(((x, look_alike), {}))


def test_result_marks_a_backend_that_compiles_on_first_call(mlp_data):
    class Head(nn.Module):
        def __init__(self):
            super().__init__()
            self.linear = nn.Linear(16, 4)

        def forward(self, x, cache=None):
            return self.linear(x)

    cache = DynamicCache()  # an empty cache in every call: one structure, so one signature
    data = [((x,), {"cache": cache}) for x in mlp_data]
    result = tt.tweak(Head().eval(), data, max_depth=0, strategy=tt.OneBackendStrategy(Storeless()),
                      progress=False, measure=FAST)
    (sig,) = result.modules[""].signatures
    assert sig.text == "(float32[8, 16], cache=DynamicCache(0 layers, empty))"
    assert sig.unstorable == 3 and "3 recorded calls not storable: compiles on first call" in str(result.modules)


# ---------------------------------------------------------------- your own backend (docs)

def test_the_documented_user_backend_runs():
    text = (Path(__file__).parent.parent / "docs" / "backends.md").read_text()
    section = text[text.index("## Your own backend"):]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    scope: dict = {}
    exec(compile(code, "docs/backends.md", "exec"), scope)
    backend_class, strategy = scope["ChannelsLastBackend"], scope["strategy"]
    model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.ReLU(), nn.Conv2d(8, 4, 3)).eval()
    data = [torch.randn(2, 3, 12, 12) for _ in range(2)]
    with torch.no_grad():
        expected = [model(x) for x in data]
    (w,) = tt.wrap(model, [""], strategy=strategy)
    tt.tune(model, data, measure=FAST)
    assert {r["backend"] for r in w.tt_report} == {"ChannelsLast", "TorchEager"}
    assert w.tt_report[0]["state"] == "measured", w.tt_report
    assert model[0].weight.is_contiguous()  # the backend converted a copy; the model is as it was
    assert relative_error(model, data, expected) < 1e-3
    with pytest.raises(TypeError, match="no option channels"):
        backend_class(channels=3)
    assert "no channels-last kernels on xpu" == backend_class().unavailable(torch.device("xpu"))


@pytest.mark.slow
def test_torchao_is_imported_only_for_torchao_and_quietly():
    """A plain tweak never imports torchao; the TorchAO backend's import of it prints none of
    the lines a torchao built for another torch logs ("Failed to load", deprecations) (issue 30)."""
    import importlib.util
    import subprocess

    if importlib.util.find_spec("torchao") is None:
        pytest.skip("torchao not installed: pip install torch-tweak[torchao]")
    code = ("import sys, torch, torch_tweak as tt\n"
            "tt.default_strategy('cpu'); tt.precision_backends('cpu', {'bf16': 0.05})\n"
            "assert 'torchao' not in sys.modules, 'imported without TorchAO asked for'\n"
            "from torch_tweak.backends import TorchAOBackend\n"
            "assert TorchAOBackend(mode='int8_weight_only').unavailable(torch.device('cpu')) is None\n"
            "assert 'torchao' in sys.modules\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "Failed to load" not in done.stderr and "Enum subclass" not in done.stderr, done.stderr[-2000:]
