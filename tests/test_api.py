"""The public surface on the CPU: inspect, wrap, tune, activate/deactivate, strategies, bad input."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import torch_tweak as tt
from torch_tweak._runtime.module import is_wrapped
from torch_tweak.backends import TorchEagerBackend, TorchInductorBackend
from support import FAST, BrokenBackend, CountingBackend, NaNBackend, NoisyBackend


def snapshot(model: nn.Module):
    """What 'the model is left exactly as it was' means: the same objects, class and forward."""
    return (type(model), [(p, id(m), type(m), m.__dict__.get("forward")) for p, m in model.named_modules()],
            {k: v.clone() for k, v in model.state_dict().items()})


def assert_unchanged(model: nn.Module, before) -> None:
    cls, modules, state = before
    assert type(model) is cls
    assert [(p, id(m), type(m), m.__dict__.get("forward")) for p, m in model.named_modules()] == modules
    after = model.state_dict()
    assert list(after) == list(state)
    for key, value in state.items():
        assert torch.equal(after[key], value), key
    assert not tt.installed(model)


@pytest.mark.slow
def test_inspect_depths_through_module_lists(mlp, mlp_data):
    tree = tt.inspect(mlp, mlp_data)
    assert tree.depth("") == 0
    assert tree.depth("blocks.0") == 1  # the ModuleList is never called and adds no level
    assert tree.depth("blocks.0.0") == 2
    assert tree.depth("head") == 1
    assert "unused" not in tree.paths
    assert tree.calls("blocks.1.2") == len(mlp_data)
    assert tree.cut(1) == ["blocks.0", "blocks.1", "head"]
    # the cut at 2 keeps the shallower leaf "head"
    assert tree.cut(2) == ["blocks.0.0", "blocks.0.1", "blocks.0.2", "blocks.1.0", "blocks.1.1", "blocks.1.2", "head"]
    assert tree.depths() == [0, 1, 2]
    text = str(tree)
    assert "blocks.0.2" in text and "(root)" in text


def test_wrap_tune_activate_deactivate(mlp, mlp_data):
    with torch.no_grad():
        expected = mlp(mlp_data[0])
    keys = list(mlp.state_dict())
    wrappers = tt.wrap(mlp, ["blocks.0", mlp.head], strategy=tt.OneBackendStrategy(CountingBackend()))
    assert [w.tt_name for w in wrappers] == ["blocks.0", "head"]
    head = mlp.head
    assert is_wrapped(mlp.blocks[0]) and head.__dict__["_tt_root"] is wrappers[1]  # tuned in place
    assert isinstance(head, nn.Linear) and type(head) is not nn.Linear
    assert list(mlp.state_dict()) == keys  # wrappers share parameters: keys unchanged
    chosen = tt.tune(mlp, mlp_data, measure=FAST)
    assert chosen == {"blocks.0": "Counting", "head": "Counting"}
    backend = wrappers[1].tt_backend
    calls = backend.calls
    with torch.no_grad():
        got = mlp(mlp_data[0])
    assert torch.allclose(got, expected)
    assert backend.calls == calls + 1  # the call went through the backend
    for _ in range(3):
        assert tt.deactivate(mlp) == 2
        with torch.no_grad():
            mlp(mlp_data[0])
        assert backend.calls == calls + 1  # the original forward ran
        assert tt.activate(mlp) == 2
    tt.unwrap(mlp)
    assert type(mlp.head) is nn.Linear and mlp.head is head and not tt.installed(mlp) and not is_wrapped(head)


def test_wrap_root_keeps_identity(mlp, mlp_data):
    cls = type(mlp)
    (root,) = tt.wrap(mlp, [""], strategy=tt.OneBackendStrategy(CountingBackend()))
    assert isinstance(mlp, cls) and root.tt_name == ""
    tt.tune(mlp, mlp_data, measure=FAST)
    calls = root.tt_backend.calls
    with torch.no_grad():
        mlp(mlp_data[1])
    assert root.tt_backend.calls == calls + 1
    tt.unwrap(mlp)
    assert type(mlp) is cls and "_tt_root" not in mlp.__dict__


def test_first_wins_skips_failures_and_reports_them(mlp, mlp_data):
    strategy = tt.FirstWinsStrategy([BrokenBackend(), NoisyBackend(), NaNBackend(), TorchEagerBackend()])
    (w,) = tt.wrap(mlp, ["head"], strategy=strategy)
    tt.tune(mlp, mlp_data, measure=FAST)
    assert w.tt_backend.name == "TorchEager"
    states = {r["backend"]: r for r in w.tt_report}
    assert states["Broken"]["state"] == "failed" and "cannot build" in states["Broken"]["error"]
    assert "x the original's error" in states["Noisy"]["error"]
    assert "NaN or Inf" in states["NaN"]["error"]


def test_module_whose_backends_all_fail_keeps_its_forward(mlp, mlp_data):
    (w,) = tt.wrap(mlp, ["head"], strategy=tt.OneBackendStrategy(NoisyBackend()))
    assert tt.tune(mlp, mlp_data, measure=FAST) == {"head": None}
    assert w._tt_mode == 0 and "x the original's error" in w.tt_error
    with torch.no_grad():
        tt.deactivate(mlp)
        a = mlp(mlp_data[0])
    tt.unwrap(mlp)
    with torch.no_grad():
        assert torch.equal(a, mlp(mlp_data[0]))


def test_highest_throughput_measures_eager_too(mlp, mlp_data):
    (w,) = tt.wrap(mlp, ["blocks.0"], strategy=tt.HighestThroughputStrategy([CountingBackend()]))
    tt.tune(mlp, mlp_data, measure=FAST)
    names = [r["backend"] for r in w.tt_report]
    assert names == ["Counting", "TorchEager"]
    assert all(r["state"] == "measured" and r["latency_ms"] > 0 for r in w.tt_report)


def test_strategy_is_a_template_copied_per_module(mlp, mlp_data):
    template = tt.OneBackendStrategy(CountingBackend())
    wrappers = tt.wrap(mlp, ["blocks.0", "blocks.1"], strategy=template)
    tt.tune(mlp, mlp_data, measure=FAST)
    a, b = (w.tt_backend for w in wrappers)
    assert a is not b and a is not template.backends[0]
    assert template.backends[0].state == "new"


def test_default_backends_per_device():
    for device in ("cpu", "cuda", "xpu", "cuda:1"):
        first = tt.default_backends(device)
        assert [type(b) for b in first][-1] is TorchEagerBackend
        assert any(isinstance(b, TorchInductorBackend) for b in first)
        assert first is not tt.default_backends(device)  # a new list each call
    names = {d: [b.name for b in tt.default_backends(d)] for d in ("cpu", "cuda", "xpu")}
    assert names["cpu"] == ["TorchInductor", "OpenVINO", "TorchEager"]
    assert names["xpu"] == ["DeviceGraph", "TorchInductor", "OpenVINO", "TorchEager"]
    assert "OpenVINO" not in names["cuda"] and not any("TorchAO" in n for n in sum(names.values(), []))
    with pytest.raises(ValueError, match="mps"):
        tt.default_backends("mps")
    with pytest.raises(ValueError, match="unknown device"):
        tt.default_backends("not-a-device")
    s1, s2 = tt.default_strategy("cpu"), tt.default_strategy("cpu")
    assert isinstance(s1, tt.HighestThroughputStrategy) and s1 is not s2


def test_backend_options_are_checked():
    with pytest.raises(TypeError, match="no option"):
        TorchInductorBackend(modes="max-autotune")
    with pytest.raises(ValueError, match="mode must be one of"):
        TorchInductorBackend(mode="fastest")
    with pytest.raises(ValueError, match="at least one backend"):
        tt.FirstWinsStrategy([])


@pytest.mark.parametrize(
    "call, error",
    [
        (lambda m, d: tt.tweak(m, [], progress=False), "dataset is empty"),
        (lambda m, d: tt.tweak(m, 42, progress=False), "sequence or iterable"),
        (lambda m, d: tt.tweak(m, d[0], progress=False), "single Tensor"),
        (lambda m, d: tt.tweak(m, [torch.randn(8, 3)], progress=False), "sample 0 was rejected"),
        (lambda m, d: tt.tweak(m, d, min_depth=3, max_depth=1, progress=False), "min_depth \\(3\\) is greater"),
        (lambda m, d: tt.tweak(m, d, tie_tolerance=-0.1, progress=False), "tie_tolerance"),
        (lambda m, d: tt.tweak(m, d, time_budget=-1, progress=False), "time_budget"),
        (lambda m, d: tt.tweak(m, d, device="mps", progress=False), "no backends for device 'mps'"),
        (lambda m, d: tt.tweak(m, d, device="gpu0", progress=False), "unknown device"),
        pytest.param(lambda m, d: tt.tweak(m, d, device="cuda", progress=False), "sees no cuda device",
                     marks=pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")),
        (lambda m, d: tt.tweak(m, d, measure={"rounds": 3}, progress=False), "unknown measurement setting"),
        (lambda m, d: tt.tweak(m, d, measure={"stop_when_decided": 1}, progress=False),
         "stop_when_decided.*True or False"),
        (lambda m, d: tt.tweak(m, d, measure={"settle": 101}, progress=False), "settle \\(101\\) is more than 100"),
        (lambda m, d: tt.wrap(m, ["blocks.7"]), "not a module of this model"),
        (lambda m, d: tt.wrap(m, ["blocks.0", "blocks.0.1"]), "overlap"),
        (lambda m, d: tt.wrap(m, [nn.Linear(2, 2)]), "not a module of this model"),
        (lambda m, d: tt.tune(m, d), "no wrapped modules"),
    ],
)
def test_bad_input_is_refused_and_model_unchanged(mlp, mlp_data, call, error):
    before = snapshot(mlp)
    with pytest.raises((ValueError, TypeError), match=error):
        call(mlp, mlp_data)
    assert_unchanged(mlp, before)


def test_wrap_failure_midway_leaves_model_unchanged(mlp, mlp_data):
    tt.wrap(mlp, ["head"])
    with pytest.raises(ValueError, match="already wrapped"):
        tt.wrap(mlp, ["blocks.0", "head"])
    assert list(tt.installed(mlp)) == ["head"]
    assert not is_wrapped(mlp.blocks[0]) and type(mlp.blocks[0]) is nn.Sequential


def test_wrapping_inside_a_wrapped_module_says_to_unwrap_first(mlp):
    tt.wrap(mlp, [""])
    with pytest.raises(ValueError, match="wrapped already .*tt.unwrap\\(model\\) first"):
        tt.wrap(mlp, ["blocks.0"])
    assert list(tt.installed(mlp)) == [""]


@pytest.mark.slow
def test_a_reference_held_from_before_the_tweak_runs_the_tuned_backend(mlp, mlp_data):
    held_block, held_head = mlp.blocks[0], mlp.head  # taken before tuning, as user code does
    with torch.no_grad():
        expected = [held_block(x) for x in mlp_data]
    CountingBackend.builds = 0
    result = tt.tweak(mlp, mlp_data, min_depth=1, max_depth=1, strategy=tt.OneBackendStrategy(CountingBackend()),
                      progress=False, measure=FAST, cache=False)
    wrappers = tt.installed(mlp)
    if result.selected_depth is None:  # not kept: the held references are plain modules again
        assert not wrappers and not is_wrapped(held_block)
        tt.wrap(mlp, ["blocks.0", "blocks.1", "head"], strategy=tt.OneBackendStrategy(CountingBackend()))
        tt.tune(mlp, mlp_data, measure=FAST)
        wrappers = tt.installed(mlp)
    assert mlp.blocks[0] is held_block and mlp.head is held_head  # the same objects, in place
    backend = wrappers["blocks.0"].tt_backend
    calls = backend.calls
    with torch.no_grad():
        got = [held_block(x) for x in mlp_data]
    assert backend.calls == calls + len(mlp_data)  # the held reference went through the backend
    assert all(torch.equal(g, e) for g, e in zip(got, expected))
    tt.deactivate(mlp)
    with torch.no_grad():
        held_block(mlp_data[0])
    assert backend.calls == calls + len(mlp_data)  # deactivated: the original forward


def test_a_tuned_model_refuses_to_be_copied_with_a_clear_error(mlp, mlp_data):
    import copy
    import io
    tt.wrap(mlp, ["blocks.0", "head"], strategy=tt.OneBackendStrategy(CountingBackend()))
    tt.tune(mlp, mlp_data, measure=FAST)
    for attempt in (lambda: copy.deepcopy(mlp), lambda: torch.save(mlp, io.BytesIO())):
        with pytest.raises(TypeError, match="tuned by torch-tweak.*tt.save\\(model, path\\).*tt.unwrap\\(model\\)"):
            attempt()
    tt.unwrap(mlp)
    twin = copy.deepcopy(mlp)  # untuned again: copies as any module
    with torch.no_grad():
        assert torch.equal(twin(mlp_data[0]), mlp(mlp_data[0]))
    torch.save(mlp, io.BytesIO())


# ------------------------------------------------------------- first-page traps (issue 30)


@pytest.mark.slow
def test_calling_the_tweak_result_says_that_tweak_works_in_place(mlp, mlp_data):
    import copy
    untuned = copy.deepcopy(mlp)
    result = tt.tweak(mlp, mlp_data, max_depth=0, strategy=tt.OneBackendStrategy(TorchEagerBackend()),
                      progress=False, measure=FAST, cache=False)
    with pytest.raises(TypeError, match="tunes the model in place.*call(ing)? the model itself"):
        result(mlp_data[0])  # model = tt.tweak(...); model(x): the user's mistake
    with torch.no_grad():
        assert all(torch.equal(mlp(x), untuned(x)) for x in mlp_data)  # the model itself answers as before


def test_load_without_the_model_says_what_to_pass(mlp, tmp_path):
    path = tmp_path / "tuned.tt"
    with pytest.raises(TypeError, match=r"tt.load\(model, path\).*build the model"):
        tt.load(str(path))
    with pytest.raises(TypeError, match=r"tt.load\(model, path\)"):
        tt.load(path)
    before = snapshot(mlp)
    with pytest.raises(TypeError, match=r"needs the file.*tt.load\(model, path\)"):
        tt.load(mlp)
    assert_unchanged(mlp, before)


def test_effort_and_speedup_are_typed():
    import typing
    from torch_tweak.results import TweakResult
    assert typing.get_type_hints(tt.tweak)["effort"] == typing.Literal["default", "high"]
    hints = typing.get_type_hints(TweakResult)
    assert hints["speedup"] == (float | None) and hints["baseline_ms"] == (float | None)


@pytest.mark.parametrize("train", ["", "blocks.1"])
@pytest.mark.slow
def test_train_mode_stops_the_tweak_before_any_build_and_leaves_the_model_as_it_was(mlp, mlp_data, train):
    import copy
    import warnings
    mlp.eval()
    mlp.get_submodule(train).train()
    untuned = copy.deepcopy(mlp)
    before = snapshot(mlp)
    modes = [(p, m.training) for p, m in mlp.named_modules()]
    CountingBackend.builds = 0
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # one message: the error, no warning before it
        with pytest.raises(ValueError, match=r"training mode.*model\.eval\(\) before tt\.tweak") as raised:
            tt.tweak(mlp, mlp_data, max_depth=1, strategy=tt.OneBackendStrategy(CountingBackend()),
                     progress=False, measure=FAST, cache=False)
    assert (repr(train) in str(raised.value)) == bool(train)  # a submodule in train mode is named
    assert CountingBackend.builds == 0
    assert_unchanged(mlp, before)
    assert [(p, m.training) for p, m in mlp.named_modules()] == modes
    mlp.eval()
    untuned.eval()
    result = tt.tweak(mlp, mlp_data, max_depth=1, strategy=tt.OneBackendStrategy(CountingBackend()),
                      progress=False, measure=FAST, cache=False)
    assert CountingBackend.builds > 0 and result.rows
    with torch.no_grad():
        assert all(torch.equal(mlp(x), untuned(x)) for x in mlp_data)  # after model.eval() it tunes
