"""The tuning cache: a second tweak reuses the first's choices; any other key tunes afresh."""

from __future__ import annotations

import json
import time

import pytest
import torch
from torch import nn

import torch_tweak as tt
from torch_tweak import _C, tuning_cache
from support import FAST, MLP, CountingBackend


class Slow(nn.Module):
    """A layer whose forward waits 2 ms before its inner layer: what the Fast backend skips."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        time.sleep(0.002)
        return self.inner(x)


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = Slow(nn.Linear(16, 16))
        self.b = Slow(nn.Linear(16, 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.a(x))


class Fast(CountingBackend):
    """Counts builds and runs a Slow layer's inner layer without the wait, so depth 1 wins."""

    name = "Fast"
    wrong = False

    def build(self, module, samples, device):
        type(self).builds += 1
        inner = getattr(module, "inner", module)
        if type(self).wrong:
            return lambda *a, **k: inner(*a, **k) + 1.0
        return inner


def fresh_net() -> Net:
    torch.manual_seed(0)
    return Net().eval()


def fresh_mlp() -> MLP:
    torch.manual_seed(0)
    return MLP().eval()


def tweak(model, data, **kwargs):
    kwargs.setdefault("strategy", tt.OneBackendStrategy(Fast()))
    return tt.tweak(model, data, max_depth=1, progress=False, measure=FAST, **kwargs)


def entries(folder) -> list:
    return sorted(p.name for p in (folder / "tweaks").glob("*.json")) if (folder / "tweaks").is_dir() else []


def test_second_tweak_reuses_the_first(mlp_data, tuning_cache_folder, monkeypatch):
    model = fresh_net()
    first = tweak(model, mlp_data)
    assert first.selected_depth == 1
    assert not first.cached and len(entries(tuning_cache_folder)) == 1
    with torch.no_grad():
        expected = [model(x) for x in mlp_data]
    kept = {p: [g.backend.name if g.backend else None for g in w.tt_signatures] for p, w in tt.installed(model).items()}
    assert kept == {"a": ["Fast"], "b": ["Fast"]}
    builds = Fast.builds
    again = fresh_net()
    with monkeypatch.context() as m:
        m.setattr(_C, "choose", lambda *a, **k: pytest.fail("measured on a cache hit"))
        m.setattr(_C, "tweak", lambda *a, **k: pytest.fail("measured on a cache hit"))
        second = tweak(again, mlp_data)
    assert second.cached and "from the tuning cache" in str(second)
    assert Fast.builds - builds == 2  # one rebuild per kept module and signature, no more
    assert second.selected_depth == first.selected_depth and second.rows == first.rows
    assert second.baseline_ms == first.baseline_ms and second.speedup == first.speedup
    assert str(second.modules) == str(first.modules)
    assert {p: [g.backend.name if g.backend else None for g in w.tt_signatures]
            for p, w in tt.installed(again).items()} == kept
    with torch.no_grad():
        for x, e in zip(mlp_data, expected):
            assert torch.equal(again(x), e)


def test_other_inputs_config_or_settings_do_not_reuse(mlp_data, tuning_cache_folder):
    tweak(fresh_net(), mlp_data)
    builds = Fast.builds
    other_shape = [torch.randn(4, 16) for _ in mlp_data]
    assert not tweak(fresh_net(), other_shape).cached
    assert not tweak(fresh_net(), mlp_data, strategy=tt.OneBackendStrategy(Fast(tolerance=0.5))).cached
    assert not tweak(fresh_net(), mlp_data, tie_tolerance=0.1).cached
    widened = fresh_net()
    widened.b.inner = nn.Linear(16, 4, bias=False)
    assert not tweak(widened, mlp_data).cached
    assert len(entries(tuning_cache_folder)) == 5
    assert Fast.builds - builds >= 4 * 3  # each tuned afresh (3 modules at depths 0 and 1)
    assert tweak(fresh_net(), other_shape).cached  # and each has its own entry


def test_cache_false_neither_reads_nor_writes(mlp_data, tuning_cache_folder):
    assert not tweak(fresh_net(), mlp_data, cache=False).cached
    assert entries(tuning_cache_folder) == []
    tweak(fresh_net(), mlp_data)
    assert not tweak(fresh_net(), mlp_data, cache=False).cached
    with pytest.raises(TypeError, match="cache must be True or False"):
        tweak(fresh_net(), mlp_data, cache="clear")


def test_clear_cache(mlp_data, tuning_cache_folder):
    tweak(fresh_net(), mlp_data)
    assert tt.clear_cache() == 1
    assert entries(tuning_cache_folder) == []
    assert not tweak(fresh_net(), mlp_data).cached
    assert tt.clear_cache() == 1 and tt.clear_cache() == 0


def test_entry_whose_parts_differ_is_not_used(mlp_data, tuning_cache_folder):
    tweak(fresh_net(), mlp_data)
    path = (tuning_cache_folder / "tweaks").glob("*.json").__next__()
    entry = json.loads(path.read_text())
    entry["parts"]["torch"] = "0.0.1"  # same file name, another key inside
    path.write_text(json.dumps(entry))
    assert not tweak(fresh_net(), mlp_data).cached
    path.write_text("{ damaged")
    assert not tweak(fresh_net(), mlp_data).cached


def test_rebuild_that_fails_the_check_drops_the_entry(mlp_data, tuning_cache_folder, monkeypatch):
    tweak(fresh_net(), mlp_data)
    monkeypatch.setattr(Fast, "wrong", True)
    model = fresh_net()
    result = tweak(model, mlp_data)
    assert not result.cached  # tuned afresh: Fast now fails its check everywhere
    assert result.selected_depth is None and not tt.installed(model)


def test_cached_tweak_saves_and_loads(mlp_data, tmp_path):
    tweak(fresh_net(), mlp_data)
    model = fresh_net()
    assert tweak(model, mlp_data).cached
    tt.save(model, tmp_path / "m.tt")
    loaded = fresh_net()
    assert tt.load(loaded, tmp_path / "m.tt", backends=[Fast()]) == {p: w.tt_backend.name
                                                                     for p, w in tt.installed(model).items()}
    with torch.no_grad():
        assert torch.equal(loaded(mlp_data[0]), model(mlp_data[0]))


def test_key_parts_cover_what_changes_a_result(mlp_data):
    device = torch.device("cpu")
    calls = [((x,), {}) for x in mlp_data]
    settings = {"min_depth": 0, "max_depth": 1, "tie_tolerance": 0.02, "time_budget": None, "measure": None}
    parts = tuning_cache.key_parts(fresh_mlp(), calls, device, None, settings)
    assert set(parts) >= {"torch", "device", "modules", "tensors", "inputs", "strategy", "settings"}
    assert parts["device"]["name"] and parts["inputs"][0] == "(float32[8, 16])"
    assert ["head", "torch.nn.modules.linear:Linear", {"in_features": 16, "out_features": 4, "training": False}] \
        in parts["modules"]
    assert ["head.weight", [4, 16], "torch.float32", "cpu"] in parts["tensors"]
    names = [b["name"] for b in parts["strategy"]["backends"]]
    assert names[0] == "TorchInductor" and names[-1] == "TorchEager"  # the defaults, when strategy is None
    assert tuning_cache.key_of(parts) != tuning_cache.key_of(dict(parts, settings=dict(settings, max_depth=2)))
