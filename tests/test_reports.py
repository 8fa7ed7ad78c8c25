"""Why a backend lost (per module and signature), build logs in the cache folder, weights a
backend moved put back, and tolerances set globally and per backend."""

from __future__ import annotations

import warnings

import pytest
import torch

import torch_tweak as tt
from torch_tweak._search import buildlog
from torch_tweak._core import signatures, storage
from torch_tweak.backends import Backend, TorchEagerBackend
from support import FAST, BrokenBackend, NoisyBackend


class MissingBackend(Backend):
    name = "Missing"

    def unavailable(self, device):
        return "not installed (pip install missing)"

    def build(self, module, samples, device):
        raise AssertionError("an unavailable backend is never built")


class StaticOnlyBackend(Backend):
    name = "StaticOnly"

    def build(self, module, samples, device):
        raise tt.backends.ShapesVary("argument 0 axis 0 varies")


class SaysDynamicBackend(Backend):
    """Its error's text reads like a reason: the text decides nothing, the class does."""
    name = "SaysDynamic"

    def build(self, module, samples, device):
        raise RuntimeError("dynamic shapes: argument 0 axis 0 varies")


class WarningBackend(Backend):
    name = "Warning"

    def build(self, module, samples, device):
        warnings.warn("this backend has something to say")
        return module


class OffsetBackend(Backend):
    """Outputs off by 1e-3 relative to a reference scale of 1: between the fp32 default and 1e-2."""

    name = "Offset"

    def build(self, module, samples, device):
        def run(*args, **kwargs):
            out = module(*args, **kwargs)
            return out + 1e-3 * out.abs().max()
        return run


class MovingBackend(Backend):
    """Moves the module's weights away while it builds, as OpenVINO does with a GPU module."""

    name = "Moving"

    def build(self, module, samples, device):
        module.to("meta")
        return module


@pytest.mark.slow
def test_result_shows_every_candidates_latency_or_why_it_lost(mlp, mlp_data):
    strategy = tt.HighestThroughputStrategy([MissingBackend(), BrokenBackend(), NoisyBackend(),
                                             StaticOnlyBackend(), SaysDynamicBackend(),
                                             TorchEagerBackend()])
    result = tt.tweak(mlp, mlp_data, max_depth=1, min_depth=1, strategy=strategy, progress=False, measure=FAST)
    head = result.modules["head"]
    (sig,) = head.signatures
    assert sig.text == "(float32[8, 16])" and sig.backend == head.backend == "TorchEager"
    by_name = {c["backend"]: c for c in sig.candidates}
    assert by_name["Missing"]["reason"] == "unavailable" and "not installed" in by_name["Missing"]["error"]
    assert by_name["Broken"]["reason"] == "build failed"
    assert by_name["Noisy"]["reason"] == "mismatch" and by_name["Noisy"]["max_error"] > 0.001
    # the measured rule: its bound is a few times the original's own error against float64, far
    # under the fixed float32 tolerance, and the candidate's error shows as a multiple of it
    noisy = by_name["Noisy"]
    assert 0 < noisy["own_error"] < noisy["tolerance"] < tt.TOLERANCES[torch.float32]
    assert noisy["max_error"] / noisy["own_error"] > 100
    assert by_name["StaticOnly"]["reason"] == "dynamic shapes"
    assert by_name["SaysDynamic"]["reason"] == "build failed"
    # Torch Eager runs the original: its error against the float64 run is the original's own
    eager = by_name["TorchEager"]
    assert eager["latency_ms"] > 0 and eager["max_error"] == pytest.approx(eager["own_error"], rel=1e-6)
    text = str(result.modules)
    for expected in ("module", "signature", "latency ms", "blocks.0", "head", "(float32[8, 16])",
                     "not installed (pip install missing)", "failed to build: RuntimeError: this backend cannot",
                     "failed the correctness check: ", "x the original's error, more than the", "rejected for dynamic shapes: argument 0 axis 0 varies",
                     "chosen" if result.selected_depth == 1 else "fastest here; its depth was not kept",
                     "depth 1 (kept)" if result.selected_depth == 1 else "depth 1 (not kept)"):
        assert expected in text, (expected, text)
    table, errors = str(head).split("\n\nerrors in full:\n")
    assert table.splitlines()[1].startswith("head") and len(table.splitlines()) == 7
    assert "Broken (float32[8, 16]):" in errors and "this backend cannot" in errors
    assert text.count("TorchEager") == 3  # one row per module


class LongWordedBackend(Backend):
    """Its build error is longer than the engine's message slot and not ASCII: the slot's cut
    falls inside a character."""
    name = "LongWorded"

    def build(self, module, samples, device):
        raise RuntimeError("x" + "\u20ac" * 400)


def test_a_long_non_ascii_error_cut_to_its_slot_reads_whole(mlp, mlp_data):
    strategy = tt.HighestThroughputStrategy([LongWordedBackend(), TorchEagerBackend()])
    untuned = __import__("copy").deepcopy(mlp)
    result = tt.tweak(mlp, mlp_data, max_depth=1, min_depth=1, strategy=strategy, progress=False, measure=FAST)
    (sig,) = result.modules["head"].signatures
    error = {c["backend"]: c for c in sig.candidates}["LongWorded"]["error"]
    assert "\u20ac" * 100 in error and error.rstrip(".").endswith("\u20ac")
    assert "LongWorded" in str(result.modules)
    with torch.inference_mode():
        for x in mlp_data:
            torch.testing.assert_close(mlp(x), untuned(x))


def test_build_logs_in_the_cache_folder(mlp, mlp_data, cache_folder, monkeypatch):
    monkeypatch.setenv("TORCH_TWEAK_CACHE", str(cache_folder / "logs-test"))
    (w,) = tt.wrap(mlp, ["head"], strategy=tt.FirstWinsStrategy([BrokenBackend(), WarningBackend()]))
    tt.tune(mlp, mlp_data, measure=FAST)
    (group,) = w.tt_signatures
    folder = cache_folder / "logs-test" / "logs" / "MLP" / "head" / group.key
    assert group.key == signatures.key_of(group.text) and len(group.key) == 12
    broken = (folder / "Broken.log").read_text()
    assert "outcome: failed" in broken and "Traceback" in broken and "this backend cannot build anything" in broken
    said = (folder / "Warning.log").read_text()
    assert "UserWarning: this backend has something to say" in said and "passed the correctness check" in said
    assert storage.cache_dir() == cache_folder / "logs-test"


def test_cache_folder_default(monkeypatch):
    monkeypatch.delenv("TORCH_TWEAK_CACHE", raising=False)
    assert str(storage.cache_dir()).endswith("/.cache/torch-tweak")
    assert buildlog.log_path("M", "", "k", "B").parts[-3:] == ("_root", "k", "B.log")


@pytest.mark.slow
def test_weights_a_backend_moved_are_back_on_their_device(mlp, mlp_data):
    weight = mlp.head.weight
    before = weight.detach().clone()
    result = tt.tweak(mlp, mlp_data, max_depth=1, strategy=tt.OneBackendStrategy(MovingBackend()),
                      progress=False, measure=FAST)
    assert all(r.latency_ms is not None for r in result.rows)  # every depth ran on real weights
    assert mlp.head.weight is weight and weight.device.type == "cpu" and torch.equal(weight, before)
    assert all(t.device.type == "cpu" for t in mlp.state_dict().values())


def test_tolerance_per_backend_and_global(mlp, mlp_data, monkeypatch):
    def tune_with(backend, tolerance="measured"):
        tt.unwrap(mlp)
        (w,) = tt.wrap(mlp, ["head"], strategy=tt.OneBackendStrategy(backend))
        tt.tune(mlp, mlp_data, measure=FAST, tolerance=tolerance)
        return w

    w = tune_with(OffsetBackend())  # the measured rule: thousands of times float32's own rounding
    assert w.tt_backend is None and "x the original's error" in w.tt_error
    w = tune_with(OffsetBackend(), "dtype")  # the fp32 default 1e-3 rejects an error of 1e-3 relative to ~1
    assert w.tt_backend is None and "exceeds the tolerance 0.001" in w.tt_error
    assert tune_with(OffsetBackend(tolerance=1e-2)).tt_backend is not None  # a backend's own: the fixed rule
    assert tune_with(OffsetBackend(), 1e-2).tt_backend is not None  # tt.tune's for every backend
    monkeypatch.setitem(tt.TOLERANCES, torch.float32, 1e-2)
    assert tune_with(OffsetBackend(), "dtype").tt_backend is not None  # the per-dtype table, changed
    assert tune_with(OffsetBackend()).tt_backend is None  # the measured rule does not read it
    w = tune_with(OffsetBackend(tolerance=1e-5), "dtype")  # a backend's own tolerance wins over the global one
    assert w.tt_backend is None and "tolerance 1e-05" in w.tt_error


def test_invalid_tolerance_is_refused():
    with pytest.raises(ValueError, match="tolerance must be a fraction"):
        TorchEagerBackend(tolerance=-1)


def test_a_backend_out_of_memory_is_rejected_and_the_next_one_tried(mlp, mlp_data):
    class Hungry(tt.Backend):
        name = "Hungry"

        def build(self, module, samples, device):
            raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 80.00 GiB")

    strategy = tt.FirstWinsStrategy([Hungry(), TorchEagerBackend()])
    (w,) = tt.wrap(mlp, ["head"], strategy=strategy)
    assert tt.tune(mlp, mlp_data) == {"head": "TorchEager"}
    hungry = next(r for r in w.tt_report if r["backend"] == "Hungry")
    assert hungry["reason"] == "out of memory" and "80.00 GiB" in hungry["error"]


@pytest.mark.slow
def test_result_modules_are_the_engines_result_read_once(mlp, mlp_data):
    """result.modules is the engine's per-module model (_C.Result.modules) plus what only Python
    knows of a build; nothing is rebuilt from the wrappers."""
    untuned = [mlp(x).detach() for x in mlp_data]
    strategy = tt.HighestThroughputStrategy([BrokenBackend(), NoisyBackend(), TorchEagerBackend()])
    result = tt.tweak(mlp, mlp_data, min_depth=1, max_depth=1, strategy=strategy, progress=False, measure=FAST,
                      cache=False)
    engine = {m["path"]: m for m in result._engine.modules}
    assert set(engine) == set(result.modules) == {"blocks.0", "blocks.1", "head"}
    for path, module in result.modules.items():
        found = engine[path]
        assert module.error == found["error"] == ""
        assert module.depths == tuple(found["depths"]) == (1,)
        assert module.kept == found["kept"] == (result.selected_depth == 1)
        (group,) = found["groups"]
        (sig,) = module.signatures
        assert sig.text == group["text"] and group["strategy"] == "highest-throughput"
        assert [c["backend"] for c in sig.candidates] == [c["name"] for c in group["candidates"]]
        assert [c["state"] for c in sig.candidates] == [c["state"] for c in group["candidates"]]
        assert [c["verdict"] for c in group["candidates"]] == ["failed", "failed", "chosen"]
        assert sig.candidates[2]["latency_ms"] == group["candidates"][2]["stats"]["median_ns"] / 1e6
        assert sig.candidates[1]["reason"] == "mismatch"  # Python's note, joined to the engine's row
        wrapper = tt.installed(mlp).get(path)
        if wrapper is not None:  # the kept cut's wrappers carry the same
            assert wrapper.tt_report == list(module.candidates) and wrapper.tt_error == module.error
    with torch.no_grad():
        assert all(torch.allclose(mlp(x), e) for x, e in zip(mlp_data, untuned))


def test_tune_goes_through_the_engines_module_search(mlp, mlp_data, monkeypatch):
    """tt.tune has no loop of its own over groups or candidates: one engine search per module."""
    from torch_tweak import _C
    from torch_tweak._search import tuning

    untuned = [mlp(x).detach() for x in mlp_data]
    searched = []
    real = _C.tune_module

    def spy(modules, node, **kwargs):
        found = real(modules, node, **kwargs)
        searched.append((kwargs["path"], found))
        return found

    monkeypatch.setattr(tuning._C, "tune_module", spy)
    tt.wrap(mlp, ["blocks.0", "head"])
    chosen = tt.tune(mlp, mlp_data, strategy=tt.FirstWinsStrategy([BrokenBackend(), TorchEagerBackend()]),
                     measure=FAST)
    assert chosen == {"blocks.0": "TorchEager", "head": "TorchEager"}
    assert [path for path, _ in searched] == ["blocks.0", "head"]
    for path, found in searched:
        w = tt.installed(mlp)[path]
        assert found["state"] == 1 and [c["verdict"] for c in found["groups"][0]["candidates"]] == ["failed", "chosen"]
        assert [r["state"] for r in w.tt_report] == ["failed", "built"] and w.tt_report[0]["reason"] == "build failed"
        assert w.tt_signatures[0].error == "" and w.tt_active
    with torch.no_grad():
        assert all(torch.allclose(mlp(x), e) for x, e in zip(mlp_data, untuned))


def test_tune_failure_is_the_engines_explanation(mlp, mlp_data):
    untuned = [mlp(x).detach() for x in mlp_data]
    tt.wrap(mlp, ["head"])
    chosen = tt.tune(mlp, mlp_data, strategy=tt.FirstWinsStrategy([BrokenBackend()]), measure=FAST)
    w = tt.installed(mlp)["head"]
    assert chosen == {"head": None} and not w.tt_active
    assert w.tt_error.startswith("no backend passed (Broken: RuntimeError: this backend cannot")
    assert w.tt_signatures[0].error == w.tt_error
    with torch.no_grad():
        assert all(torch.allclose(mlp(x), e) for x, e in zip(mlp_data, untuned))
