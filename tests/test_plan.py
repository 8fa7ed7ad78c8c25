"""One Plan, one apply: a tuned model's plan applied to a fresh copy answers as the tuned model
does; a failure halfway leaves the model as it was; the tuning cache and tt.load apply alike."""

from __future__ import annotations

import copy
import re
from pathlib import Path

import pytest
import torch
from torch import nn

import torch_tweak as tt
from torch_tweak._core import records
from torch_tweak._search import plan as planning
from torch_tweak.backends import Backend
from torch_tweak._runtime.module import MODE_ORIGINAL, MODE_RECORD, is_wrapped
from support import FAST, BrokenBackend, SlowNet
from test_api import assert_unchanged, snapshot

pytestmark = pytest.mark.usefixtures("fake_clock")  # speed verdicts on the fake clock (conftest)


class DoubleBackend(Backend):
    """Runs a Slow layer's inner layer in float64, without the wait: faster than the original,
    and its answers differ from float32's in the last bits (close, not equal)."""

    name = "Double"
    builds = 0

    def build(self, module, samples, device):
        type(self).builds += 1
        inner = copy.deepcopy(getattr(module, "inner", module)).double()

        def run(x: torch.Tensor) -> torch.Tensor:
            return inner(x.double()).float()

        return run


class InterruptedBackend(Backend):
    name = "Interrupted"

    def build(self, module, samples, device):
        raise KeyboardInterrupt


def fresh_net() -> SlowNet:
    torch.manual_seed(0)
    return SlowNet().eval()


@pytest.fixture
def tuned(mlp_data):
    model = fresh_net()
    result = tt.tweak(model, mlp_data, max_depth=1, strategy=tt.OneBackendStrategy(DoubleBackend()),
                      progress=False, measure=FAST, cache=False)
    assert result.selected_depth == 1 and sorted(tt.installed(model)) == ["a", "b"]
    return model


def answers(model: nn.Module, data) -> list[torch.Tensor]:
    with torch.no_grad():
        return [model(x) for x in data]


def assert_as_it_was(model: nn.Module, before, outputs, data) -> None:
    assert_unchanged(model, before)
    assert not any(is_wrapped(m) for m in model.modules())
    assert all(torch.equal(a, b) for a, b in zip(answers(model, data), outputs))


def test_plan_applied_to_a_fresh_copy_answers_as_the_tuned_model(tuned, mlp_data):
    untuned = answers(fresh_net(), mlp_data)
    expected = answers(tuned, mlp_data)
    plan = planning.plan_of(tuned)
    assert plan.depth == 1 and plan.paths == ["a", "b"]
    assert [[g.backend.name for g in m.groups] for m in plan.modules] == [["Double"], ["Double"]]
    assert all(g.backend.state == "new" and g.samples and len(g.samples) == len(g.outputs)
               for m in plan.modules for g in m.groups)

    builds = DoubleBackend.builds
    copies = [fresh_net(), fresh_net()]
    for model in copies:  # a plan is data: applying it twice builds twice and changes nothing in it
        assert planning.apply(model, plan, device=torch.device("cpu")) == []
    assert DoubleBackend.builds - builds == 4
    assert all(g.backend.state == "new" for m in plan.modules for g in m.groups)
    for model in copies:
        wrappers = tt.installed(model)
        assert sorted(wrappers) == ["a", "b"] and all(w.tt_active for w in wrappers.values())
        assert wrappers["a"].tt_backend is not tt.installed(tuned)["a"].tt_backend  # built again, not shared
        got = answers(model, mlp_data)
        assert all(torch.equal(g, e) for g, e in zip(got, expected))  # the same backend on the same weights
        assert all(torch.allclose(g, u, rtol=1e-5, atol=1e-6) for g, u in zip(got, untuned))  # the differential check
        assert not all(torch.equal(g, u) for g, u in zip(got, untuned))  # and the backend really ran
        assert sum(w._tt_calls for w in wrappers.values()) == 2 * len(mlp_data)
        assert all(not any(w.tt_untuned.values()) for w in wrappers.values())
        assert records.of(model).depth == 1

    planning.revert(copies[0])
    assert not tt.installed(copies[0])
    assert all(torch.equal(g, u) for g, u in zip(answers(copies[0], mlp_data), untuned))


@pytest.mark.parametrize("strict", [True, False])
def test_apply_failing_halfway_leaves_the_model_as_it_was(tuned, mlp_data, strict):
    plan = planning.plan_of(tuned)
    plan.modules[1].groups[0].backend = InterruptedBackend()  # "a" builds, then "b" is interrupted
    model = fresh_net()
    before, outputs = snapshot(model), answers(model, mlp_data)
    with pytest.raises(KeyboardInterrupt):
        planning.apply(model, plan, device=torch.device("cpu"), strict=strict)
    assert_as_it_was(model, before, outputs, mlp_data)
    assert not records.of(model).decided and not records.of(model).wrappers


def test_strict_apply_whose_rebuild_fails_leaves_the_model_as_it_was(tuned, mlp_data):
    plan = planning.plan_of(tuned)
    plan.modules[1].groups[0].backend = BrokenBackend()
    model = fresh_net()
    before, outputs = snapshot(model), answers(model, mlp_data)
    with pytest.raises(planning.RebuildFailed, match="the rebuilt Broken failed: RuntimeError") as caught:
        planning.apply(model, plan, device=torch.device("cpu"))
    assert caught.value.path == "b" and caught.value.backend.name == "Broken"
    assert_as_it_was(model, before, outputs, mlp_data)


def test_lenient_apply_runs_the_original_where_a_rebuild_fails(tuned, mlp_data):
    plan = planning.plan_of(tuned)
    plan.modules[1].groups[0].backend = BrokenBackend()
    model = fresh_net()
    untuned = answers(fresh_net(), mlp_data)
    failures = planning.apply(model, plan, device=torch.device("cpu"), strict=False)
    assert [(f.path, f.backend.name) for f in failures] == [("b", "Broken")]
    wrappers = tt.installed(model)
    assert wrappers["a"].tt_active and not wrappers["b"].tt_active and wrappers["b"].tt_backend is None
    assert "the rebuilt Broken failed" in wrappers["b"].tt_error
    assert not wrappers["b"].tt_signatures[0].samples  # a failed signature keeps no recorded calls
    got = answers(model, mlp_data)
    assert all(torch.allclose(g, u, rtol=1e-5, atol=1e-6) for g, u in zip(got, untuned))


def test_plan_of_other_calls_is_refused_and_the_model_left_as_it_was(tuned, mlp_data):
    plan = planning.plan_of(tuned)
    model = fresh_net()
    before, outputs = snapshot(model), answers(model, mlp_data)
    other = [((torch.randn(2, 16),), {})]  # another batch size: another signature than the plan's
    with pytest.raises(planning.PlanError, match="a was called with other signatures"):
        planning.apply(model, plan, device=torch.device("cpu"), calls=other)
    assert_as_it_was(model, before, outputs, mlp_data)


def test_apply_onto_a_wrapped_module_changes_nothing(tuned, mlp_data):
    plan = planning.plan_of(tuned)
    model = fresh_net()
    tt.wrap(model, ["b"])
    with pytest.raises(ValueError, match="already wrapped"):
        planning.apply(model, plan, device=torch.device("cpu"))
    assert list(tt.installed(model)) == ["b"] and not is_wrapped(model.a)


def test_the_cache_and_tt_load_go_through_the_one_apply(mlp_data, tmp_path, monkeypatch, steady_figures):
    applied = []
    real = planning.apply

    def spy(model, plan, **kwargs):
        applied.append((plan.paths, plan.depth, kwargs.get("calls") is not None, kwargs.get("bounded", False)))
        return real(model, plan, **kwargs)

    monkeypatch.setattr(planning, "apply", spy)
    strategy = tt.OneBackendStrategy(DoubleBackend())
    first = fresh_net()
    tt.tweak(first, mlp_data, max_depth=1, strategy=strategy, progress=False, measure=FAST)
    expected = answers(first, mlp_data)
    assert applied == []  # a tweak that measured applies nothing again
    hit = fresh_net()
    assert tt.tweak(hit, mlp_data, max_depth=1, strategy=strategy, progress=False, measure=FAST).cached
    assert applied == [(["a", "b"], 1, True, False)]  # the cache records the dataset again
    tt.save(hit, tmp_path / "net.tt")
    loaded = fresh_net()
    assert tt.load(loaded, tmp_path / "net.tt", backends=[DoubleBackend()]) == {"a": "Double", "b": "Double"}
    assert applied[1] == (["a", "b"], 1, False, True)  # the file's own calls; tolerances from a file are capped
    for model in (hit, loaded):
        assert all(torch.equal(g, e) for g, e in zip(answers(model, mlp_data), expected))


def test_the_wrapper_state_is_set_by_the_tuned_module_type_alone():
    package = Path(tt.__file__).parent
    setters = [p.relative_to(package).as_posix() for p in sorted(package.rglob("*.py"))
               if re.search(r"\._tt_mode\s*=[^=]", p.read_text())]
    assert setters == ["_runtime/module.py"]


def test_recording_puts_the_state_back_however_it_ends(mlp, mlp_data):
    wrapper, = tt.wrap(mlp, ["head"])
    seen = []
    with pytest.raises(RuntimeError, match="stop"):
        with wrapper.tt_record_with(lambda *a, **k: seen.append(a) or torch.zeros(8, 4)):
            assert wrapper._tt_mode == MODE_RECORD
            with torch.no_grad():
                mlp(mlp_data[0])
            raise RuntimeError("stop")
    assert len(seen) == 1 and wrapper._tt_mode == MODE_ORIGINAL
    with torch.no_grad():
        mlp(mlp_data[0])
    assert len(seen) == 1  # the recorder is gone with the block
    assert not wrapper.tt_activate() and not wrapper.tt_active  # no backend: nothing to switch to


def test_an_empty_plan_runs_nothing_and_keeps_the_model_untuned(mlp_data):
    model = fresh_net()
    calls = []
    model.register_forward_pre_hook(lambda module, args: calls.append(args))
    before, outputs = snapshot(model), answers(model, mlp_data)
    calls.clear()
    assert planning.apply(model, planning.Plan(None), device=torch.device("cpu"),
                          calls=[((x,), {}) for x in mlp_data]) == []
    assert calls == []  # nothing to record: the dataset is not run
    assert records.of(model).decided and records.of(model).depth is None  # what tt.save writes: an empty plan
    assert_unchanged(model, before)
    assert all(torch.equal(a, b) for a, b in zip(answers(model, mlp_data), outputs))
