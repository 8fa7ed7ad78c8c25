"""OpenVINO's converted models kept in torch-tweak's folder (backends/_ov_cache.py): a second
build of a module (a tuning-cache hit, tt.load) reads the converted model instead of converting
again, and tt.load says what it cost and what it built again.

A hit on examples/Tweak took 4.5 to 5.3 s on a quiet machine, most of it ov.convert_model
rebuilding the OpenVINO model the first tweak had converted (bench/results/cache_cpu.md); these
tests count conversions, never seconds. Builds run in this process (TORCH_TWEAK_ISOLATION=off):
an isolated child converts and keeps the model as the process itself does."""

from __future__ import annotations

import copy
import json

import pytest
import torch
from torch import nn

import torch_tweak as tt
from support import FAST, Slow

pytestmark = pytest.mark.slow  # OpenVINO conversions, a few seconds each on a 2-core machine
openvino = pytest.importorskip("openvino")
from torch_tweak.backends import OpenVINOBackend, _ov_cache  # noqa: E402


class OpenVINOInner(OpenVINOBackend):
    """OpenVINO on the Slow layer's inner layer: a tweak on the fake clock keeps it."""

    def build(self, module, samples, device):
        return super().build(getattr(module, "inner", module), samples, device)


@pytest.fixture
def conversions(monkeypatch):
    """How many times ov.convert_model ran; builds in this process."""
    monkeypatch.setenv("TORCH_TWEAK_ISOLATION", "off")
    count = {"n": 0}
    real = openvino.convert_model

    def counted(*args, **kwargs):
        count["n"] += 1
        return real(*args, **kwargs)

    monkeypatch.setattr(openvino, "convert_model", counted)
    return count


def mlp(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 8)).eval()


DATA = [torch.randn(4, 16, generator=torch.Generator().manual_seed(i)) for i in range(3)]


def tuned(model: nn.Module) -> nn.Module:
    tt.wrap(model, [""], strategy=tt.OneBackendStrategy(OpenVINOBackend()))
    assert tt.tune(model, DATA, measure=FAST) == {"": "OpenVINO"}
    return model


def same(model: nn.Module, untuned: nn.Module) -> None:
    with torch.inference_mode():
        for x in DATA + [torch.randn(4, 16)]:
            torch.testing.assert_close(model(x), untuned(x), rtol=1e-4, atol=1e-5)


def entries(folder) -> list:
    return sorted((folder / "openvino").glob("*.ovm"))


def test_a_second_build_reads_the_converted_model(conversions, tuning_cache_folder):
    first = tuned(mlp())
    assert conversions["n"] == 1 and len(entries(tuning_cache_folder)) == 1
    assert tt.installed(first)[""].tt_backend.build_note.startswith("converted in ")
    again = tuned(mlp())
    assert conversions["n"] == 1  # read, not converted
    assert tt.installed(again)[""].tt_backend.build_note.startswith("its converted model read from")
    same(again, mlp())
    other = tuned(mlp(seed=1))  # other weights: another key, converted
    assert conversions["n"] == 2 and len(entries(tuning_cache_folder)) == 2
    same(other, mlp(seed=1))


def test_a_cache_hit_of_a_tweak_converts_nothing(conversions, fake_clock, steady_figures):
    """The second identical tweak (a tuning-cache hit) builds OpenVINO again from the model the
    first one converted."""
    def tweak(model):
        return tt.tweak(model, DATA, strategy=tt.OneBackendStrategy(OpenVINOInner()), max_depth=0, measure=FAST,
                        progress=False)

    model = Slow(mlp()).eval()
    untuned = copy.deepcopy(model)
    assert tweak(model).selected_depth == 0
    converted = conversions["n"]
    assert converted >= 1
    again = copy.deepcopy(untuned)
    hit = tweak(again)
    assert hit.cached and hit.selected_depth == 0
    assert conversions["n"] == converted
    same(again, untuned)


def test_a_load_says_what_it_built_and_reads_the_converted_model(conversions, tuning_cache_folder, tmp_path, caplog):
    path = tmp_path / "mlp.tt"
    tt.save(tuned(mlp()), path)
    fresh = mlp()
    with caplog.at_level("INFO", logger="torch_tweak"):
        loaded = tt.load(fresh, path)
    assert loaded == {"": "OpenVINO"} and isinstance(loaded, tt.results.LoadResult)
    assert conversions["n"] == 1  # the tuning's conversion, read at load
    (rebuilt,) = loaded.rebuilt
    assert (rebuilt.path, rebuilt.backend, rebuilt.signature) == ("", "OpenVINO", "(float32[4, 16])")
    assert rebuilt.note.startswith("its converted model read from torch-tweak's folder")
    assert loaded.seconds >= loaded.read_seconds + rebuilt.seconds > 0
    summary = loaded.summary()
    assert summary.startswith(f"tt.load of {path}: ") and "the file read and checked in " in summary
    assert "1 backend built again and checked on its stored calls: (root) (float32[4, 16]): OpenVINO in " in summary
    assert summary in [r.getMessage() for r in caplog.records]
    same(fresh, mlp())
    for entry in entries(tuning_cache_folder):
        entry.unlink()
    elsewhere = mlp()  # a machine that never converted it: converted at load, and said
    assert tt.load(elsewhere, path).rebuilt[0].note.startswith("converted in ")
    assert conversions["n"] == 2


def test_an_entry_not_sealed_by_this_user_or_of_another_key_is_converted_again(conversions, tuning_cache_folder):
    """An entry planted in a shared folder (sealed with another key, or none), damaged, or moved
    under another module's key is never read: the module is converted, and the entry written again."""
    tuned(mlp())
    (entry,) = entries(tuning_cache_folder)
    genuine = entry.read_bytes()
    header_end = genuine.index(b"\n", len(_ov_cache.MAGIC))
    header = json.loads(genuine[len(_ov_cache.MAGIC):header_end])
    forged_seal = dict(header, seal="0" * 64)
    damaged = bytearray(genuine)
    damaged[-10] ^= 0xFF
    for planted in (genuine[:len(_ov_cache.MAGIC)] + json.dumps(forged_seal).encode() + genuine[header_end:],
                    bytes(damaged), genuine[:100], b"not an entry"):
        entry.write_bytes(planted)
        before = conversions["n"]
        same(tuned(mlp()), mlp())
        assert conversions["n"] == before + 1
        tuned(mlp())  # written again, sealed: read
        assert conversions["n"] == before + 1
    other = tuned(mlp(seed=1))  # another module's entry under this one's name: its key is in the entry
    (other_entry,) = [e for e in entries(tuning_cache_folder) if e != entry]
    entry.write_bytes(other_entry.read_bytes())
    before = conversions["n"]
    same(tuned(mlp()), mlp())
    assert conversions["n"] == before + 1
    same(other, mlp(seed=1))


def test_a_model_read_that_is_not_the_modules_is_converted_again(conversions, tuning_cache_folder, monkeypatch):
    """Code the key does not see (a helper a forward calls) changed: the model read gives another
    answer on the first recorded call, and the module is converted again."""
    monkeypatch.setattr(_ov_cache, "key", lambda *args, **kwargs: "0" * 64)  # every module one key
    tuned(mlp(seed=1))
    assert conversions["n"] == 1
    model = tuned(mlp())  # reads seed 1's model: wrong, found, converted
    assert conversions["n"] == 2
    assert tt.installed(model)[""].tt_backend.build_note.startswith("converted in ")
    same(model, mlp())


def test_without_a_sealing_key_nothing_is_kept(conversions, tuning_cache_folder, monkeypatch):
    monkeypatch.setattr(_ov_cache, "seal", lambda data: None)
    tuned(mlp())
    tuned(mlp())
    assert conversions["n"] == 2 and entries(tuning_cache_folder) == []


def test_the_folder_is_kept_under_its_bound(conversions, tuning_cache_folder, monkeypatch):
    tuned(mlp(seed=0))
    (first,) = entries(tuning_cache_folder)
    monkeypatch.setattr(tt.settings, "OV_CACHE_FOLDER_BYTES", first.stat().st_size + 1)
    tuned(mlp(seed=1))
    kept = entries(tuning_cache_folder)
    assert len(kept) == 1 and kept != [first]  # the one used longest ago went
