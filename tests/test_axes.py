"""Axes of a candidate beyond its backend (torch_tweak.backends.axes): channels-last, SDPA kernels,
max-autotune for heavy modules, opt-in precision. Each variant is built, checked against the
untuned outputs and measured like a backend, labelled in the result, and kept by tt.save /
tt.load; none is tried unless asked for."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from torch import nn

import torch_tweak as tt
from support import FAST, pause
from torch_tweak.backends import axes
from torch_tweak.backends import TorchEagerBackend, TorchInductorBackend

EAGER = [TorchEagerBackend()]


class ConvNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.ReLU(), nn.Conv2d(16, 16, 3, padding=1))
        self.head = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(16, 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.stem(x))


class Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(32, 96)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).view(x.shape[0], x.shape[1], 3, 2, 16).permute(2, 0, 3, 1, 4)
        return nn.functional.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(x.shape)


def conv_net() -> ConvNet:
    torch.manual_seed(0)
    return ConvNet().eval()


def images() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return [torch.randn(2, 3, 16, 16, generator=g) for _ in range(2)]


def outputs(model: nn.Module, data: list) -> list[torch.Tensor]:
    with torch.no_grad():
        return [model(x) for x in data]


def names(backends) -> list[str]:
    return [b.name for b in backends]


@pytest.mark.slow
def test_no_variant_unless_asked(encoder_tweak):
    model, data, expected, result = encoder_tweak
    tried = {c["backend"] for m in result.modules.values() for c in m.candidates}
    assert tried == {"TorchInductor", "OpenVINO", "TorchEager"}  # the defaults, no axis, no lower precision
    assert not result.lower_precision and "lower precision" not in str(result)
    assert all(torch.allclose(a, b, rtol=1e-3, atol=1e-4) for a, b in zip(outputs(model, data), expected))


def test_variants_per_device_and_module():
    cpu = tt.default_strategy("cpu").with_axes(tt.Axes("high", heavy=frozenset()))
    listed = names(cpu.candidates("cpu"))
    assert listed[:3] == ["TorchInductor", "OpenVINO", "TorchEager"]
    assert {"TorchInductor [channels_last]", "TorchEager [channels_last]", "TorchInductor [max-autotune]"} <= set(listed)
    assert not any("sdpa" in n or "tf32" in n or "autocast" in n for n in listed)  # no SDPA kernels on a CPU
    cuda = names(tt.default_strategy("cuda").with_axes(tt.Axes("high")).candidates("cuda"))
    assert {f"InductorGraph [sdpa={k}]" for k in ("flash", "efficient", "cudnn", "math")} <= set(cuda)
    assert "InductorGraph [max-autotune]" in cuda
    assert "InductorGraph [combo kernels]" in cuda and not any("combo" in n for n in listed)  # CUDA only

    net, attention = conv_net(), Attention().eval()
    x = ((torch.randn(2, 8, 32),), {})
    light = names(cpu.candidates_for(net, [((images()[0],), {})], torch.device("cpu")))
    assert light == listed[:3]  # a light module gets the backends alone: effort goes where the time is
    heavy = tt.default_strategy("cpu").with_axes(
        tt.Axes("high", heavy=frozenset({axes.module_key(attention), axes.module_key(net)})))
    for_net = names(heavy.candidates_for(net, [((images()[0],), {})], torch.device("cpu")))
    assert {"TorchEager [channels_last]", "TorchInductor [max-autotune]"} <= set(for_net)
    for_attention = names(heavy.candidates_for(attention, [x], torch.device("cpu")))
    assert "TorchInductor [max-autotune]" in for_attention and not any("channels_last" in n for n in for_attention)
    on_cuda = tt.default_strategy("cuda").with_axes(tt.Axes("high"))
    assert "DeviceGraph [sdpa=flash]" in names(on_cuda.candidates_for(attention, [x], torch.device("cuda")))
    assert not any("sdpa" in n for n in names(on_cuda.candidates_for(net, [((images()[0],), {})],
                                                                       torch.device("cuda"))))
    light_cuda = tt.default_strategy("cuda").with_axes(tt.Axes("high", heavy=frozenset()))
    assert not any("combo" in n or "max-autotune" in n
                   for n in names(light_cuda.candidates_for(attention, [x], torch.device("cuda"))))
    (layout,) = [b for b in heavy.candidates_for(net, [((images()[0],), {})], torch.device("cpu"))
                 if b.name == "TorchEager [channels_last]"]
    data = images()
    fn = layout.prepare(net, [((x,), {}) for x in data], torch.device("cpu"))
    with torch.no_grad():  # the variant gives the module's answers, and the module is unchanged
        assert all(torch.allclose(fn(x), y, rtol=1e-4, atol=1e-5) for x, y in zip(data, outputs(conv_net(), data)))
    assert all(p.is_contiguous() for p in net.parameters())


def test_lower_precision_is_opt_in_and_labelled():
    plain = tt.default_strategy("cpu").with_axes(tt.Axes("high"))
    assert not any(b.opt_in for b in plain.candidates("cpu"))
    asked = tt.precision_backends("cpu", {"bf16": 0.05, "int8": 0.1})
    assert names(asked) == ["TorchInductor [bf16 autocast]", "TorchEager [bf16 autocast]", "TorchAO [int8_weight_only]"]
    assert all(b.opt_in for b in asked) and [b.check_tolerance() for b in asked] == [0.05, 0.05, 0.1]
    assert all(b.config.lowers_precision() for b in asked)
    net, data = conv_net(), images()
    fn = asked[1].prepare(net, [((x,), {}) for x in data], torch.device("cpu"))
    with torch.no_grad():  # float32 out as before, within the tolerance asked for
        for x, y in zip(data, outputs(conv_net(), data)):
            out = fn(x)
            assert out.dtype == torch.float32 and 0 < (out - y).abs().max() <= 0.05 * y.abs().max()
    assert not any(b.config.lowers_precision() for b in plain.candidates("cpu"))


def test_one_rule_says_which_configs_lower_precision():
    """BackendConfig.lowers_precision: the axes (tf32, autocast), OpenVINO's inference precision
    other than f32 (a field or the property), every TorchAO mode; a candidate that does is opt-in."""
    from torch_tweak.backends import (OpenVINOBackend, TorchAOBackend, TorchEagerBackend, TorchInductorBackend)

    lower = [TorchEagerBackend(autocast_dtype=torch.bfloat16), TorchInductorBackend(tf32=True),
             OpenVINOBackend(inference_precision="bf16"), OpenVINOBackend(inference_precision="f16"),
             OpenVINOBackend(properties={"INFERENCE_PRECISION_HINT": "bf16"}),
             TorchAOBackend(mode="int8_weight_only"), TorchAOBackend(mode="int8_dynamic")]
    same = [TorchEagerBackend(), TorchEagerBackend(memory_format="channels_last"), TorchInductorBackend(mode="max-autotune"),
            OpenVINOBackend(), OpenVINOBackend(inference_precision="f32"),
            OpenVINOBackend(properties={"INFERENCE_PRECISION_HINT": "f32", "PERFORMANCE_HINT": "LATENCY"})]
    assert [b.config.lowers_precision() for b in lower] == [True] * len(lower)
    assert [b.config.lowers_precision() for b in same] == [False] * len(same)
    assert all(b.opt_in for b in lower) and not any(b.opt_in for b in same)
    assert all(b.fresh().opt_in for b in lower)


@pytest.mark.parametrize("call, error, match", [
    (lambda m, d: tt.tweak(m, d, effort="max"), ValueError, "effort must be 'default' or 'high'"),
    (lambda m, d: tt.tweak(m, d, precision=["bf16"]), TypeError, r"precision=\{'bf16': 0.03\}"),
    (lambda m, d: tt.tweak(m, d, precision={"int4": 0.1}), ValueError, "unknown precision policy 'int4'"),
    (lambda m, d: tt.tweak(m, d, precision={"bf16": 0}), ValueError, "above 0 and at most 1"),
    (lambda m, d: tt.tweak(m, d, precision={"tf32": 0.01}), ValueError, "'tf32' runs on CUDA only"),
    (lambda m, d: tt.tweak(m, d, precision={"fp8": 0.1}), ValueError, "compute capability 8.9"),
    (lambda m, d: tt.tweak(m, d, effort="high", strategy=tt.FirstWinsStrategy()), ValueError,
     "HighestThroughputStrategy"),
    (lambda m, d: TorchEagerBackend(memory_format="nhwc"), ValueError, "memory_format must be None or 'channels_last'"),
    (lambda m, d: TorchInductorBackend(sdpa_kernel="fast"), ValueError, "sdpa_kernel must be one of"),
])
def test_bad_options_are_named_before_anything_changes(call, error, match):
    model, data = conv_net(), images()
    before = outputs(model, data)
    with pytest.raises(error, match=match):
        call(model, data)
    assert not tt.installed(model)
    assert all(torch.equal(a, b) for a, b in zip(outputs(model, data), before))


@pytest.mark.slow
def test_channels_last_is_measured_against_the_plain_backend():
    model, data = conv_net(), images()
    before = outputs(model, data)
    result = tt.tweak(model, data, max_depth=1, strategy=tt.HighestThroughputStrategy(EAGER), effort="high",
                      progress=False, measure=FAST, cache=False)
    root = {c["backend"]: c for c in result.modules[""].candidates}
    stem = {c["backend"] for c in result.modules["stem"].candidates}
    assert root["TorchEager [channels_last]"]["state"] == "measured" and root["TorchEager [channels_last]"]["max_error"] < 1e-3
    assert "TorchEager [channels_last]" in stem
    assert not any("channels_last" in c["backend"] for c in result.modules["head"].candidates)  # no Conv2d there
    for module in result.modules.values():  # the fastest measured candidate is the one chosen
        for sig in module.signatures:
            measured = {c["backend"]: c["latency_ms"] for c in sig.candidates if c["latency_ms"] is not None}
            assert sig.backend == min(measured, key=measured.get)
    after = outputs(model, data)
    assert all(torch.allclose(a, b, rtol=1e-4, atol=1e-5) for a, b in zip(after, before))


@pytest.mark.slow
def test_max_autotune_goes_to_the_heavy_modules(mlp, mlp_data):
    before = outputs(mlp, mlp_data)
    result = tt.tweak(mlp, mlp_data, max_depth=1, strategy=tt.HighestThroughputStrategy([TorchInductorBackend()]),
                      effort="high", progress=False, measure=FAST, cache=False)
    root = {c["backend"]: c for c in result.modules[""].candidates}
    assert root["TorchInductor [max-autotune]"]["state"] == "measured"  # the model itself is always heavy
    assert root["TorchInductor [max-autotune]"]["max_error"] <= 1e-3
    tree = result.tree
    for path, module in result.modules.items():
        tried = any(c["backend"] == "TorchInductor [max-autotune]" for c in module.candidates)
        assert tried == (path == "" or tree.time_ms(path) >= tt.settings.HEAVY_SHARE * tree.time_ms("")), path
    after = outputs(mlp, mlp_data)
    assert all(torch.allclose(a, b, rtol=1e-3, atol=1e-4) for a, b in zip(after, before))


@pytest.mark.slow
def test_precision_is_checked_against_the_users_tolerance(mlp, mlp_data):
    before = outputs(mlp, mlp_data)
    tight = tt.tweak(mlp, mlp_data, max_depth=0, strategy=tt.HighestThroughputStrategy(EAGER),
                     precision={"bf16": 1e-6}, progress=False, measure=FAST, cache=False)
    (bf16,) = [c for c in tight.modules[""].candidates if c["backend"] == "TorchEager [bf16 autocast]"]
    assert bf16["reason"] == "mismatch" and bf16["tolerance"] == 1e-6  # rejected by the check, not by speed
    assert not tight.lower_precision
    tt.unwrap(mlp)
    assert all(torch.equal(a, b) for a, b in zip(outputs(mlp, mlp_data), before))

    loose = tt.tweak(mlp, mlp_data, max_depth=0, strategy=tt.HighestThroughputStrategy(EAGER),
                     precision={"bf16": 0.05, "int8": 0.05}, progress=False, measure=FAST, cache=False)
    found = {c["backend"]: c for c in loose.modules[""].candidates}
    assert found["TorchEager [bf16 autocast]"]["state"] == "measured"
    assert 0 < found["TorchEager [bf16 autocast]"]["max_error"] <= 0.05
    assert found["TorchAO [int8_weight_only]"]["state"] == "measured"
    assert 0 < found["TorchAO [int8_weight_only]"]["max_error"] <= 0.05
    if loose.lower_precision:  # chosen only when measured faster; then it says so
        assert "lower precision, as asked: (root) runs" in str(loose)
    after = outputs(mlp, mlp_data)
    assert all(torch.allclose(a, b, rtol=0.05, atol=0.05 * b.abs().max().item()) for a, b in zip(after, before))


LOAD = """
import sys, torch, torch_tweak as tt
sys.path.insert(0, {tests!r})
from test_axes import conv_net, images
model = conv_net()
backends = tt.precision_backends("cpu", {{"bf16": 0.05}}) if {precision!r} else None
chosen = tt.load(model, {path!r}, backends=backends)
print(chosen)
with torch.no_grad():
    torch.save([model(x) for x in images()], {out!r})
"""


@pytest.mark.parametrize("backend, precision", [
    (TorchEagerBackend(memory_format="channels_last"), False),
    (TorchInductorBackend(memory_format="channels_last"), False),
    (TorchEagerBackend(autocast_dtype=torch.bfloat16, tolerance=0.05), True),
])
@pytest.mark.slow
def test_axes_survive_save_and_load_in_a_new_process(tmp_path, backend, precision):
    model, data = conv_net(), images()
    before = outputs(model, data)
    tt.wrap(model, ["stem"], strategy=tt.OneBackendStrategy(backend))
    assert tt.tune(model, data, measure=FAST) == {"stem": backend.name}
    tuned = outputs(model, data)
    tolerance = 0.05 if precision else 1e-4
    assert all(torch.allclose(a, b, rtol=tolerance, atol=tolerance) for a, b in zip(tuned, before))
    path = tmp_path / "m.tt"
    tt.save(model, path)
    if precision:
        with pytest.raises(ValueError, match="lower precision .* is opt-in"):
            tt.load(conv_net(), path)
    script = LOAD.format(tests=str(__import__("os").path.dirname(__file__)), path=str(path), precision=precision,
                         out=str(tmp_path / "out.pt"))
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert f"{{'stem': '{backend.name}'}}" in done.stdout
    loaded = torch.load(tmp_path / "out.pt")
    assert all(torch.equal(a, b) for a, b in zip(loaded, tuned))  # the same candidate, the same answers



class WaitsWithoutAutocast(nn.Module):
    """An MLP that waits 2 ms unless it runs under autocast: its bf16 candidate is faster for
    sure, so the tweak keeps it and says so."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not torch.is_autocast_enabled("cpu"):
            pause(0.002)
        return self.body(x)


@pytest.mark.slow
def test_a_kept_lower_precision_module_is_named_in_the_result(mlp_data, fake_clock):
    torch.manual_seed(0)
    model = WaitsWithoutAutocast().eval()
    before = outputs(model, mlp_data)
    result = tt.tweak(model, mlp_data, max_depth=0, strategy=tt.HighestThroughputStrategy(EAGER),
                      precision={"bf16": 0.05}, progress=False, measure=FAST, cache=False)
    assert result.selected_depth == 0 and result.lower_precision == {"": "TorchEager [bf16 autocast]"}
    error = result.modules[""].signatures[0].candidates[1]["max_error"]
    assert f"lower precision, as asked: (root) runs TorchEager [bf16 autocast] (largest relative error {error:.3g})" \
        in str(result)
    after = outputs(model, mlp_data)
    assert all(a.dtype == b.dtype and torch.allclose(a, b, rtol=0.05, atol=0.05 * b.abs().max().item())
               for a, b in zip(after, before))


class SlowToBuild(TorchEagerBackend):
    """Torch Eager whose build takes a while, like a compile: the clock moves during a depth."""

    name = "SlowToBuild"
    delay = 1.5

    def build(self, module, samples, device):
        pause(self.delay)
        return super().build(module, samples, device)


@pytest.mark.parametrize("budget, variant_built", [(1.0, False), (600.0, True)])
@pytest.mark.slow
def test_no_variant_is_built_once_the_time_budget_is_used_up(budget, variant_built, fake_clock):
    """effort= and precision= variants can each cost a long compile (max-autotune: minutes on a
    GPU); once time_budget is used up, the depth in progress still finishes, but with the
    strategy's backends only. A budget that is not used up builds every variant as before. The
    budget is counted on the fake clock, which the slow build moves by 1.5 s: a loaded machine's
    slow measurements cannot use it up first."""
    model, data = conv_net(), images()
    before = outputs(model, data)
    started = fake_clock.now
    result = tt.tweak(model, data, max_depth=1, strategy=tt.HighestThroughputStrategy([SlowToBuild(), EAGER[0]]),
                      effort="high", time_budget=budget, progress=False, measure=FAST, cache=False)
    took = (fake_clock.now - started) / 1e9  # on the fake clock: the slow builds, and 1 us per timed call
    root = {c["backend"]: c for c in result.modules[""].candidates}
    assert root["SlowToBuild"]["state"] == "measured" and root["TorchEager"]["state"] == "measured"
    layout = root["TorchEager [channels_last]"]
    if variant_built:
        assert layout["state"] == "measured" and layout["max_error"] < 1e-3
        assert result.rows[1].depth == 1 and result.rows[1].error == ""  # depth 1 ran too
    else:
        # the slow build used the budget up: the variant after it was not built, nor depth 1 started
        assert layout["state"] == "failed" and layout["reason"] == "time budget"
        assert "not built: the time budget was used up first" in str(result.modules[""])
        assert result.rows[1].depth == 1 and result.rows[1].error == "time budget used up"
        assert took < 2 * SlowToBuild.delay  # one slow build at depth 0, nothing after the budget
    after = outputs(model, data)  # kept or not, the same answers
    assert all(torch.allclose(a, b, rtol=1e-4, atol=1e-5) for a, b in zip(after, before))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="Inductor in a device graph needs CUDA")
def test_combo_kernels_give_the_models_answers_and_survive_save_and_load(tmp_path):
    from torch_tweak.backends import InductorGraphBackend

    torch.manual_seed(0)
    model = nn.Sequential(Attention(), nn.LayerNorm(32), nn.Linear(32, 32), nn.GELU()).cuda().eval()
    data = [torch.randn(2, 8, 32, device="cuda") for _ in range(2)]
    before = outputs(model, data)
    backend = InductorGraphBackend(combo_kernels=True)
    tt.wrap(model, ["0", "2"], strategy=tt.OneBackendStrategy(backend))
    assert tt.tune(model, data, measure=FAST) == {"0": backend.name, "2": backend.name}
    tuned = outputs(model, data)
    assert all(torch.allclose(a, b, rtol=1e-4, atol=1e-5) for a, b in zip(tuned, before))
    tt.save(model, tmp_path / "m.tt")
    torch.manual_seed(0)
    fresh = nn.Sequential(Attention(), nn.LayerNorm(32), nn.Linear(32, 32), nn.GELU()).cuda().eval()
    assert tt.load(fresh, tmp_path / "m.tt") == {"0": backend.name, "2": backend.name}
    assert all(torch.equal(a, b) for a, b in zip(outputs(fresh, data), tuned))
