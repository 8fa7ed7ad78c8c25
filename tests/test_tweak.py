"""tt.tweak end to end on the CPU."""

from __future__ import annotations

import logging

import pytest
import torch

import torch_tweak as tt
from support import FAST, BrokenBackend, CountingBackend, Slow, pause
from test_api import assert_unchanged, snapshot


def test_dry_run_counts_modules_and_builds_nothing(mlp, mlp_data):
    before = snapshot(mlp)
    CountingBackend.builds = 0
    result = tt.tweak(mlp, mlp_data, dry_run=True, strategy=tt.OneBackendStrategy(CountingBackend()), progress=False)
    assert [(r.depth, r.modules) for r in result.rows] == [(0, 1), (1, 3)]  # max_depth's default is 1
    every = tt.tweak(mlp, mlp_data, max_depth=None, dry_run=True, progress=False)
    assert [(r.depth, r.modules) for r in every.rows] == [(0, 1), (1, 3), (2, 7)]
    assert CountingBackend.builds == 0 and result.selected_depth is None
    assert "dry run" in str(result)
    assert_unchanged(mlp, before)


@pytest.mark.slow
def test_tweak_with_a_strategy_tunes_each_module_once(mlp, mlp_data):
    CountingBackend.builds = 0
    with torch.no_grad():
        expected = mlp(mlp_data[0], scale=2.0)
    result = tt.tweak(mlp, [((x,), {"scale": 2.0}) for x in mlp_data], max_depth=2,
                      strategy=tt.OneBackendStrategy(CountingBackend()), progress=False, measure=FAST)
    # depth 0: root; depth 1: blocks.0, blocks.1, head; depth 2: 6 block children, head reused
    assert CountingBackend.builds == 1 + 3 + 6
    assert len(result.rows) == 3 and result.baseline_ms > 0
    text = str(result)
    assert "untuned" in text and text.count("\n") >= 4
    if result.selected_depth is not None:
        assert tt.installed(mlp) and result.speedup > 1.0
    else:
        assert not tt.installed(mlp) and result.tuned_ms == result.baseline_ms
    with torch.no_grad():
        assert torch.allclose(mlp(mlp_data[0], scale=2.0), expected)


def test_depth_where_every_module_fails_is_skipped_with_its_error(mlp, mlp_data):
    before = snapshot(mlp)
    result = tt.tweak(mlp, mlp_data, strategy=tt.OneBackendStrategy(BrokenBackend()), progress=False, measure=FAST)
    assert result.selected_depth is None and result.speedup == pytest.approx(1.0)
    assert all(r.latency_ms is None and "cannot build" in r.error for r in result.rows)
    assert result.modules["head"].backend is None
    assert_unchanged(mlp, before)  # untuned: nothing stays wrapped


def test_time_budget_stops_new_depths(mlp, mlp_data):
    result = tt.tweak(mlp, mlp_data, strategy=tt.OneBackendStrategy(CountingBackend()),
                      time_budget=0, progress=False, measure=FAST)
    assert [r.error for r in result.rows] == ["time budget used up"] * 2


def test_one_settings_value_is_checked_hashed_and_passed_on(mlp, mlp_data, monkeypatch):
    """The depth search's settings are checked once, by the engine's rules, and that one value,
    in the engine's forms, is what the tuning cache hashes and what the engine gets."""
    from torch_tweak import _C
    from torch_tweak._store import tuning_cache

    checked, hashed, passed = [], [], []
    check, search, key_parts = _C.check_tweak_config, _C.tweak, tuning_cache.key_parts
    monkeypatch.setattr(_C, "check_tweak_config", lambda **kw: checked.append(check(**kw)) or checked[-1])
    monkeypatch.setattr(_C, "tweak", lambda tree, **kw: passed.append(kw) or search(tree, **kw))
    monkeypatch.setattr(tuning_cache, "key_parts",
                        lambda *args: hashed.append(args[-1]) or key_parts(*args))
    tt.tweak(mlp, mlp_data, strategy=tt.OneBackendStrategy(CountingBackend()), tie_tolerance=0, time_budget=0,
             progress=False, measure=FAST)
    (settings,) = checked
    assert settings == {"min_depth": 0, "max_depth": 1, "tie_tolerance": 0.0, "time_budget": 0.0}
    assert type(settings["tie_tolerance"]) is float
    assert hashed == [dict(settings, measure=FAST, tolerance="measured")]
    assert {k: passed[0][k] for k in settings} == settings


def test_interrupt_leaves_model_unchanged(mlp, mlp_data):
    class Interrupting(CountingBackend):
        def build(self, module, samples, device):
            raise KeyboardInterrupt

    before = snapshot(mlp)
    with pytest.raises(KeyboardInterrupt):
        tt.tweak(mlp, mlp_data, strategy=tt.OneBackendStrategy(Interrupting()), progress=False, measure=FAST)
    assert_unchanged(mlp, before)


@pytest.mark.slow
def test_progress_lines_when_not_a_terminal(mlp, mlp_data, capsys):
    tt.tweak(mlp, mlp_data, max_depth=1, strategy=tt.OneBackendStrategy(CountingBackend()), measure=FAST)
    err = capsys.readouterr().err
    assert "] depth 0 (1/2)" in err and "] depth 1 (2/2)" in err and err.startswith("torch-tweak: [0/")
    tt.unwrap(mlp)
    tt.tweak(mlp, mlp_data, max_depth=1, strategy=tt.OneBackendStrategy(CountingBackend()), measure=FAST,
             progress=False)
    assert capsys.readouterr().err == ""


def test_encoder_tweak_with_inductor(encoder_tweak):
    model, data, expected, result = encoder_tweak
    assert [r.depth for r in result.rows] == [0, 1]  # max_depth's default
    assert [r.modules for r in result.rows] == [1, 5]
    text = str(result)
    assert "untuned" in text and all(f"  {d}  " in text or f" {d} " in text for d in (0, 1))
    for row in result.rows:
        assert row.latency_ms is not None or row.error, row
    # every tuned module reports every default backend's latency or error, per signature
    defaults = [b.name for b in tt.default_backends("cpu")]
    assert defaults == ["TorchInductor", "OpenVINO", "TorchEager"]
    assert len(result.modules) == 1 + 5  # the root and depth 1
    for module in result.modules.values():
        (signature,) = module.signatures  # every call of a module has one shape here
        assert [c["backend"] for c in signature.candidates] == defaults
        for c in signature.candidates:
            assert c["latency_ms"] is not None or c["error"], (module.path, c)
    table = str(result.modules)
    assert table.splitlines()[0].split() == ["module", "signature", "backend", "latency", "ms", "result"]
    headers = [line for line in table.splitlines() if line.startswith("depth ")]
    assert headers == [f"depth 0 ({'kept' if result.selected_depth == 0 else 'not kept'})",
                       f"depth 1 ({'kept' if result.selected_depth == 1 else 'not kept'})"]
    assert len(table.splitlines()) == 1 + 2 + 3 * len(result.modules) and "(float32[8, 64, 256])" in table
    with torch.no_grad():
        for x, want in zip(data, expected):
            got = model(x)
            assert float((got - want).abs().max() / want.abs().max()) < tt.TOLERANCES[torch.float32]


def test_encoder_tweak_selection_rule(encoder_tweak):
    _, _, _, result = encoder_tweak
    measured = [r for r in result.rows if r.latency_ms is not None]
    faster = [r for r in measured if r.speedup > 1.0]  # against the search's own untuned measurement
    if not faster:
        assert result.selected_depth is None and result.confirmation is None
        return
    best = min(r.latency_ms for r in faster)
    tied = [r.depth for r in faster if r.latency_ms <= best * 1.02]
    side = result.confirmation  # the candidate, measured side by side with the untuned model
    assert side["depth"] == min(tied)
    assert result.selected_depth == (side["depth"] if side["confirmed"] else None)
    assert side["confirmed"] == (side["speedup_low"] > 1.0)


class Planted(torch.nn.Module):
    """Sleeps whenever its root runs unwrapped: a slow moment planted on every untuned
    measurement of the search, while its tuned form (SleepyBackend) is, truly, slower."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if "_tt_root" not in self.__dict__:
            pause(0.003)
        return self.lin(x)


class SleepyBackend(CountingBackend):
    """Runs the module after a millisecond's sleep: slower than the untuned call by far more
    than a machine's jitter (with a tuned form exactly as fast, a side-by-side check can read
    noise as a speedup: a fresh-clone CI run once measured 26 against 33 us)."""

    def build(self, module, samples, device):
        run = super().build(module, samples, device)

        def slower(*args, **kwargs):
            pause(0.001)
            return run(*args, **kwargs)

        return slower


def test_a_planted_slow_baseline_claims_no_speedup(mlp_data, caplog, fake_clock):
    torch.manual_seed(0)
    model = Planted().eval()
    before = snapshot(model)
    with torch.no_grad():
        expected = [model(x) for x in mlp_data]
    with caplog.at_level(logging.INFO, logger="torch_tweak"):
        result = tt.tweak(model, mlp_data, max_depth=0, strategy=tt.OneBackendStrategy(SleepyBackend()),
                          progress=False, measure=FAST, cache=False)
    assert result.rows[0].speedup > 2  # the search alone would have kept depth 0...
    side = result.confirmation
    assert side is not None and side["depth"] == 0 and not side["confirmed"]  # ...side by side it is noise
    assert side["speedup_low"] <= 1.0
    assert result.selected_depth is None and result.speedup == 1.0 and result.tuned_ms == result.baseline_ms
    # the planted slowness is a burst of load on the search: the figures never agree
    assert result.measurement_quality == "inconsistent" and side["quality"] == "inconsistent"
    assert side["tries"] == 3 and "the figures disagree" in str(result)
    verdict = "slower" if side["speedup_high"] < 1.0 else "within noise"  # an interval below 1 is slower
    assert verdict in str(result) and ">" not in str(result).split("\n", 2)[2]
    assert_unchanged(model, before)
    with torch.no_grad():
        assert all(torch.equal(model(x), e) for x, e in zip(mlp_data, expected))
    warned = [r for r in caplog.records if r.levelno == logging.WARNING and verdict in r.getMessage()]
    assert len(warned) == 1  # the engine's own line, once, through logging


def test_a_real_speedup_is_confirmed_side_by_side(mlp_data, fake_clock):
    torch.manual_seed(0)
    model = torch.nn.Sequential(Slow(torch.nn.Linear(16, 16))).eval()

    class SkipSleep(CountingBackend):
        name = "SkipSleep"

        def build(self, module, samples, device):
            return getattr(module, "inner", module)

    result = tt.tweak(model, mlp_data, strategy=tt.OneBackendStrategy(SkipSleep()), progress=False, measure=FAST,
                      cache=False)
    side = result.confirmation
    assert side["confirmed"] and side["speedup_low"] > 1.0 and result.selected_depth == side["depth"]
    assert result.speedup == pytest.approx(side["speedup"]) and tt.installed(model)
    # the search's figure and the side-by-side one agree, or (a busy moment in either) the text
    # says which it kept: a 2 ms sleep against a bare product is a speedup either way
    assert "kept depth" in str(result)
    assert "measured side by side" in str(result) or "the smaller of two figures that disagree" in str(result)


def test_module_table_is_grouped_by_depth_with_the_kept_depth_marked(mlp_data, fake_clock):
    class SkipSleep(CountingBackend):
        name = "SkipSleep"

        def build(self, module, samples, device):
            return getattr(module, "inner", module)

    torch.manual_seed(0)
    model = torch.nn.Sequential(Slow(torch.nn.Linear(16, 16)), Slow(torch.nn.Linear(16, 4))).eval()
    with torch.no_grad():
        expected = [model(x) for x in mlp_data]
    result = tt.tweak(model, mlp_data, strategy=tt.OneBackendStrategy(SkipSleep()), progress=False, measure=FAST,
                      cache=False)
    assert result.selected_depth == 1
    lines = str(result.modules).splitlines()
    assert lines[1].startswith("depth 0 (not kept)") and "fastest here; its depth was not kept" in lines[2]
    kept = lines.index(next(line for line in lines if line.startswith("depth 1")))
    assert lines[kept].startswith("depth 1 (kept)") and all("chosen" in line for line in lines[kept + 1:])
    assert not result.modules[""].kept and result.modules[""].depths == (0,)
    assert result.modules["0"].kept and result.modules["1"].depths == (1,)
    with torch.no_grad():
        assert all(torch.allclose(model(x), e) for x, e in zip(mlp_data, expected))


@pytest.mark.parametrize("settings, message", [
    ({"min_depth": -1}, "min_depth must be an int >= 0, got -1"),
    ({"min_depth": 1.5}, "min_depth must be an int >= 0, got 1.5"),
    ({"max_depth": -1}, "max_depth must be an int >= 0 or None, got -1"),
    ({"min_depth": 3, "max_depth": 1}, "min_depth (3) is greater than max_depth (1): lower min_depth or raise max_depth"),
    ({"tie_tolerance": -0.1}, "tie_tolerance must be a fraction >= 0 (0.02 is 2 %), got -0.1"),
    ({"tie_tolerance": "2%"}, "tie_tolerance must be a fraction >= 0 (0.02 is 2 %), got '2%'"),
    ({"time_budget": -1}, "time_budget must be a number of seconds >= 0 or None, got -1"),
])
def test_bad_settings_raise_the_engines_message_before_anything_runs(mlp, mlp_data, settings, message, monkeypatch):
    import sys

    tweak_module = sys.modules["torch_tweak.tweak"]  # the module, not the function tt.tweak
    monkeypatch.setattr(tweak_module, "trace", lambda *a: pytest.fail("traced before the settings were checked"))
    with pytest.raises(ValueError) as caught:
        tt.tweak(mlp, mlp_data, progress=False, **settings)
    assert str(caught.value) == message
    assert not tt.installed(mlp)


def test_interrupt_in_a_build_leaves_the_model_as_it_was(mlp, mlp_data):
    """A KeyboardInterrupt inside a candidate's build: the engine commits the open group (its
    build scopes close, grad mode comes back), leaves the cut, and the interrupt propagates."""
    from torch_tweak._runtime.module import is_wrapped

    class Interrupting(tt.Backend):
        name = "Interrupting"

        def build(self, module, samples, device):
            raise KeyboardInterrupt("stop the tweak")

    untuned = [mlp(x).detach() for x in mlp_data]
    with pytest.raises(KeyboardInterrupt, match="stop the tweak"):
        tt.tweak(mlp, mlp_data, strategy=tt.FirstWinsStrategy([Interrupting()]), progress=False, measure=FAST,
                 cache=False)
    assert torch.is_grad_enabled()
    assert not tt.installed(mlp) and not any(is_wrapped(m) for m in mlp.modules())
    with torch.no_grad():
        assert all(torch.allclose(mlp(x), e) for x, e in zip(mlp_data, untuned))
