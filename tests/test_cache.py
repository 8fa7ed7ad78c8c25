"""The tuning cache: a second tweak reuses the first's choices; any other key tunes afresh."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import time

import pytest
import torch
from torch import nn

import torch_tweak as tt
from torch_tweak import _C
from torch_tweak._store import tuning_cache
from support import FAST, MLP, BrokenBackend, CountingBackend, Slow, SlowNet as Net

pytestmark = pytest.mark.usefixtures("steady_figures", "fake_clock")  # the quality rule: test_figures.py; verdicts on the fake clock


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
    # a hit says when its figures were measured, and how to measure again
    assert second.measured_at is not None and "the figures were measured on " in str(second)
    assert "(just now); tt.tweak(..., cache=False) measures again" in str(second)
    assert Fast.builds - builds == 2  # one rebuild per kept module and signature, no more
    assert second.selected_depth == first.selected_depth and second.rows == first.rows
    assert second.baseline_ms == first.baseline_ms and second.speedup == first.speedup
    assert second.outcome() == first.outcome() and second.outcome() in str(second)  # the engine's words, kept
    # the module table's latencies are the first tweak's too, and it says so, with their time
    assert str(second.modules) == str(first.modules) + "\n" + second.cache_note()
    assert {p: [g.backend.name if g.backend else None for g in w.tt_signatures]
            for p, w in tt.installed(again).items()} == kept
    with torch.no_grad():
        for x, e in zip(mlp_data, expected):
            assert torch.equal(again(x), e)


@pytest.mark.slow
def test_other_inputs_config_or_settings_do_not_reuse(mlp_data, tuning_cache_folder):
    tweak(fresh_net(), mlp_data)
    builds = Fast.builds
    other_shape = [torch.randn(4, 16) for _ in mlp_data]
    assert not tweak(fresh_net(), other_shape).cached
    assert not tweak(fresh_net(), mlp_data, strategy=tt.OneBackendStrategy(Fast(tolerance=0.5))).cached
    assert not tweak(fresh_net(), mlp_data, tie_tolerance=0.1).cached
    widened = fresh_net()
    widened.b.inner = nn.Linear(16, 4, bias=False).eval()  # a new module is in training mode: tweak would refuse it
    assert not tweak(widened, mlp_data).cached
    assert len(entries(tuning_cache_folder)) == 5
    assert Fast.builds - builds >= 4 * 3  # each tuned afresh (3 modules at depths 0 and 1)
    assert tweak(fresh_net(), other_shape).cached  # and each has its own entry


@pytest.mark.slow
def test_cache_false_neither_reads_nor_writes(mlp_data, tuning_cache_folder):
    assert not tweak(fresh_net(), mlp_data, cache=False).cached
    assert entries(tuning_cache_folder) == []
    tweak(fresh_net(), mlp_data)
    assert not tweak(fresh_net(), mlp_data, cache=False).cached
    with pytest.raises(TypeError, match="cache must be True or False"):
        tweak(fresh_net(), mlp_data, cache="clear")


@pytest.mark.slow
def test_clear_cache(mlp_data, tuning_cache_folder):
    tweak(fresh_net(), mlp_data)
    assert tt.clear_cache() == 1
    assert entries(tuning_cache_folder) == []
    assert not tweak(fresh_net(), mlp_data).cached
    assert tt.clear_cache() == 1 and tt.clear_cache() == 0


@pytest.mark.slow
def test_entry_whose_parts_differ_is_not_used(mlp_data, tuning_cache_folder):
    tweak(fresh_net(), mlp_data)
    path = (tuning_cache_folder / "tweaks").glob("*.json").__next__()
    entry = json.loads(path.read_text())
    entry["parts"]["torch"] = "0.0.1"  # same file name, another key inside
    path.write_text(json.dumps(entry))
    assert not tweak(fresh_net(), mlp_data).cached
    path.write_text("{ damaged")
    assert not tweak(fresh_net(), mlp_data).cached


@pytest.mark.slow
def test_rebuild_that_fails_the_check_drops_the_entry(mlp_data, tuning_cache_folder, monkeypatch):
    tweak(fresh_net(), mlp_data)
    monkeypatch.setattr(Fast, "wrong", True)
    model = fresh_net()
    result = tweak(model, mlp_data)
    assert not result.cached  # tuned afresh: Fast now fails its check everywhere
    assert result.selected_depth is None and not tt.installed(model)


@pytest.mark.slow
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


# ------------------------------------------------------------------ a cache is a cache


class Dropping(Net):
    """Net with dropout in its layers: in train mode their outputs vary, so every backend fails the check."""

    def __init__(self) -> None:
        super().__init__()
        self.a = Slow(nn.Sequential(nn.Linear(16, 16), nn.Dropout(0.5)))


def fresh_dropping() -> Dropping:
    torch.manual_seed(0)
    return Dropping().eval()


def untuned_outputs(build, data) -> list[torch.Tensor]:
    with torch.no_grad():
        model = build()
        return [model(x) for x in data]


def answers_as_untuned(model, build, data) -> bool:
    with torch.no_grad():
        return all(torch.equal(model(x), e) for x, e in zip(data, untuned_outputs(build, data)))


@contextlib.contextmanager
def deadline(seconds: int):
    """Fails the test instead of hanging it."""
    def expired(*_):
        raise TimeoutError(f"still running after {seconds} s")
    previous = signal.signal(signal.SIGALRM, expired)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def entry_path(folder):
    (path,) = (folder / "tweaks").glob("*.json")
    return path


def damages(path, valid: dict):
    """Every way an entry can be broken, each applied to the entry's path in turn."""
    def write(text):
        return lambda: path.write_text(text)

    def replace_with(make):
        def do():
            path.unlink()
            make()
        return do

    def shape(change):
        def do():
            entry = json.loads(json.dumps(valid))
            change(entry)
            path.write_text(json.dumps(entry))
        return do

    yield "nested 100k deep", write("[" * 100000 + "]" * 100000)
    yield "nested 200 deep in a valid entry", shape(lambda e: e.__setitem__("result", json.loads("[" * 200 + "]" * 200)))
    yield "binary junk", lambda: path.write_bytes(os.urandom(4096))
    yield "empty", write("")
    yield "17 MiB of spaces", write(" " * (17 << 20))
    yield "a FIFO", replace_with(lambda: os.mkfifo(path))
    yield "a link to /dev/zero", replace_with(lambda: path.symlink_to("/dev/zero"))
    yield "a link to itself", replace_with(lambda: path.symlink_to(path))
    yield "an empty folder", replace_with(lambda: path.mkdir())
    yield "result of another shape", shape(lambda e: e.__setitem__("result", 5))
    yield "rows of another shape", shape(lambda e: e["result"].__setitem__("rows", [{"depth": "x"}]))
    yield "modules of another shape", shape(lambda e: e.__setitem__("modules", {"a": 1}))
    yield "a plan naming no module", shape(lambda e: e.__setitem__("plan", [{"path": "nowhere", "signatures": []}]))
    yield "a plan of another shape", shape(lambda e: e.__setitem__("plan", [5]))
    yield "a plan naming another backend", shape(
        lambda e: e["plan"][0]["signatures"][0].__setitem__("backend", {"class": "os:system", "config": {}}))
    yield "retry_after not a number", shape(lambda e: e.__setitem__("retry_after", "never"))
    yield "no rows", shape(lambda e: e["result"].pop("rows"))
    yield "a latency not a number", shape(lambda e: e["result"]["baseline"].__setitem__("median_ns", "fast"))
    yield "a negative latency", shape(lambda e: e["result"]["rows"][0]["stats"].__setitem__("median_ns", -1.0))
    yield "a kept depth its numbers do not keep", shape(lambda e: e["result"].__setitem__("selected", -1))
    yield "a candidate of another shape", shape(lambda e: e["modules"][0]["candidates"].append(5))
    yield "an entry of the former version", shape(lambda e: e.__setitem__("version", 5))


@pytest.mark.slow
def test_damaged_entries_are_misses_and_rewritten(mlp_data, tuning_cache_folder):
    tweak(fresh_net(), mlp_data)
    path = entry_path(tuning_cache_folder)
    valid = json.loads(path.read_text())
    for name, damage in damages(path, valid):
        damage()
        model = fresh_net()
        with deadline(60):
            result = tweak(model, mlp_data)
        assert not result.cached, name
        assert result.selected_depth == 1 and answers_as_untuned(model, fresh_net, mlp_data), name
        assert path.is_file() and not path.is_symlink(), name  # written again, a plain file
        again = fresh_net()
        assert tweak(again, mlp_data).cached, name  # and used by the next tweak
        assert answers_as_untuned(again, fresh_net, mlp_data), name


def test_train_then_eval_tunes_again(mlp_data, tuning_cache_folder):
    model = fresh_dropping().train()
    with pytest.raises(ValueError, match=r"training mode.*model\.eval\(\)"):
        tweak(model, mlp_data)
    assert not entries(tuning_cache_folder) and not tt.installed(model)  # stopped before anything ran
    model.eval()
    second = tweak(model, mlp_data)
    assert not second.cached and second.selected_depth == 1
    assert second.modules["a"].backend == "Fast" and not second.modules["a"].error
    assert answers_as_untuned(model, fresh_dropping, mlp_data)
    assert len(entries(tuning_cache_folder)) == 1


class Configured(Net):
    """A model whose behaviour depends on a config object, as a transformers model's does."""

    class Config:
        def __init__(self) -> None:
            self.double = False

        def to_dict(self) -> dict:
            return {"double": self.double}

    def __init__(self) -> None:
        super().__init__()
        self.config = self.Config()
        self.scale = 1.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = super().forward(x) * self.scale
        return y * 2 if self.config.double else y


def fresh_configured() -> Configured:
    torch.manual_seed(0)
    return Configured().eval()


@pytest.mark.slow
def test_config_or_attribute_change_tunes_again(mlp_data, tuning_cache_folder):
    tweak(fresh_configured(), mlp_data)
    assert tweak(fresh_configured(), mlp_data).cached
    changed = fresh_configured()
    changed.config.double = True  # like use_cache=False on a transformers model
    assert not tweak(changed, mlp_data).cached
    scaled = fresh_configured()
    scaled.scale = 2.0
    assert not tweak(scaled, mlp_data).cached
    def built():
        m = fresh_configured()
        m.scale = 2.0
        return m
    assert answers_as_untuned(scaled, built, mlp_data)
    assert len(entries(tuning_cache_folder)) == 3


class HalfBroken(Fast):
    """Fast for every module but b, which keeps its forward: depth 1 is kept with a failure."""

    name = "HalfBroken"

    def build(self, module, samples, device):
        inner = getattr(module, "inner", None)
        if inner is not None and inner.out_features == 4:
            raise RuntimeError("cannot build b")
        return super().build(module, samples, device)


@pytest.mark.slow
def test_untuned_result_is_measured_again_and_a_failed_one_reused_for_a_while(mlp_data, tuning_cache_folder,
                                                                             monkeypatch):
    strategy = tt.OneBackendStrategy(BrokenBackend())
    assert tweak(fresh_net(), mlp_data, strategy=strategy).selected_depth is None
    assert len(entries(tuning_cache_folder)) == 1
    # a result that kept the model untuned (perhaps for a busy moment) is never replayed
    assert not tweak(fresh_net(), mlp_data, strategy=strategy).cached
    strategy = tt.OneBackendStrategy(HalfBroken())
    first = tweak(fresh_net(), mlp_data, strategy=strategy)
    assert first.selected_depth == 1 and first.modules["b"].error
    assert tweak(fresh_net(), mlp_data, strategy=strategy).cached  # a failure: reused within CACHE_RETRY_AFTER
    later = time.time() + tt.settings.CACHE_RETRY_AFTER + 1
    monkeypatch.setattr(tuning_cache.time, "time", lambda: later)
    assert not tweak(fresh_net(), mlp_data, strategy=strategy).cached  # then tried again
    tweak(fresh_net(), mlp_data)  # a result with no failure...
    assert tweak(fresh_net(), mlp_data).cached  # ...is reused whenever
    entry = json.loads(sorted((tuning_cache_folder / "tweaks").glob("*.json"), key=os.path.getmtime)[-1].read_text())
    assert entry["retry_after"] is None and entry["kept_depth"] == 1
