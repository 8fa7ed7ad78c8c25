"""A shared cache folder cannot be turned against its users: a symbolic link someone planted
inside it (at a tuning-cache entry's path, a build log's, a verdict's, or as a folder on the
way) is never written through, and never makes tweak create the file it names
(storage.write_cached); the tweak still tunes, and its outputs equal an untuned copy's."""

from __future__ import annotations

import json
import logging
import os
import threading
from pathlib import Path

import pytest
import torch

import torch_tweak as tt
from torch_tweak._core import storage
from torch_tweak._search import verdicts
from torch_tweak._store import tuning_cache
from torch_tweak.backends import Backend
from support import FAST, CountingBackend, SlowNet

pytestmark = pytest.mark.usefixtures("steady_figures", "fake_clock")


class Fast(CountingBackend):
    """Runs a Slow layer's inner layer without its wait, so depth 1 wins."""

    name = "Fast"

    def build(self, module, samples, device):
        return getattr(module, "inner", module)


class Isolated(Backend):
    """Built in an isolated child first (a verdict, no crash, and the child's time are written
    to the folder), then here, where its outputs fail the correctness check."""

    name = "Isolated"
    isolate_build = True

    def build(self, module, samples, device):
        return lambda *args, **kwargs: module(*args, **kwargs) + 1.0


def fresh() -> SlowNet:
    torch.manual_seed(0)
    return SlowNet().eval()


DATA = [torch.randn(8, 16) for _ in range(3)]


def tweak(model):
    strategy = tt.HighestThroughputStrategy([Isolated(), Fast()])
    return tt.tweak(model, DATA, max_depth=1, strategy=strategy, measure=FAST, progress=False)


def same_as_untuned(model) -> bool:
    untuned = fresh()
    with torch.no_grad():
        return all(torch.equal(model(x), untuned(x)) for x in DATA + [torch.randn(8, 16)])


def written(folder: Path) -> list[Path]:
    """The files a tweak wrote under `folder`, relative to it."""
    return sorted(p.relative_to(folder) for p in folder.rglob("*") if p.is_file() and not p.name.endswith(".tmp"))


def snapshot(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.fixture
def layout(tuning_cache_folder, monkeypatch):
    """The paths a tweak of `fresh()` writes (entry, build logs, verdict, the children's times),
    learnt in a first folder; the test then gets another, empty one (TORCH_TWEAK_CACHE)."""
    first = tweak(fresh())
    assert first.selected_depth == 1
    paths = written(tuning_cache_folder)
    kinds = {p.parts[0] for p in paths}
    assert kinds == {"tweaks", "logs", "verdicts"}, paths
    assert any(p.name == verdicts.TIMES for p in paths)
    folder = tuning_cache_folder.parent / "shared-cache"
    folder.mkdir()
    monkeypatch.setenv("TORCH_TWEAK_CACHE", str(folder))
    return folder, paths


def victims(tmp_path: Path, n: int) -> tuple[Path, list[Path]]:
    home = tmp_path / "victim"
    home.mkdir()
    files = []
    for i in range(n):
        path = home / ("settings.json" if i == 0 else f"notes-{i}.txt")
        path.write_text(json.dumps({"theme": "dark", "n": i}) if i == 0 else f"my notes {i}\n")
        path.chmod(0o644)
        files.append(path)
    return home, files


def test_links_at_every_path_tweak_writes_leave_their_targets_alone(layout, tmp_path):
    folder, paths = layout
    home, files = victims(tmp_path, len(paths))
    before = snapshot(home)
    for relative, victim in zip(paths, files):  # an entry's path, each build log's, the verdict's, times.json
        (folder / relative).parent.mkdir(parents=True, exist_ok=True)
        (folder / relative).symlink_to(victim)
    model = fresh()
    result = tweak(model)
    assert not result.cached and result.selected_depth == 1 and same_as_untuned(model)
    assert snapshot(home) == before  # every victim byte-identical
    for relative in paths:  # each link replaced by the file tweak wrote, never followed
        assert (folder / relative).is_file() and not (folder / relative).is_symlink(), relative
    times = json.loads((folder / "verdicts" / verdicts.TIMES).read_text())
    assert "theme" not in times  # nothing a link named was read and copied into the folder
    again = fresh()
    assert tweak(again).cached and same_as_untuned(again)  # the entry written in its place serves


def test_dangling_links_create_nothing_where_they_point(layout, tmp_path):
    folder, paths = layout
    nowhere = tmp_path / "victim"
    nowhere.mkdir()
    for i, relative in enumerate(paths):
        (folder / relative).parent.mkdir(parents=True, exist_ok=True)
        (folder / relative).symlink_to(nowhere / f"made-{i}")
    model = fresh()
    assert tweak(model).selected_depth == 1 and same_as_untuned(model)
    assert list(nowhere.iterdir()) == []
    assert all((folder / relative).is_file() and not (folder / relative).is_symlink() for relative in paths)


@pytest.mark.parametrize("which", ["logs", "tweaks", "verdicts", "all"])
def test_a_link_as_a_folder_on_the_way_is_not_written_through(layout, tmp_path, caplog, which):
    """logs/<Model> -> elsewhere (or tweaks/, verdicts/): nothing is written there, one log line
    names the link, and the tweak still tunes."""
    folder, paths = layout
    home, _ = victims(tmp_path, 3)
    model_folder = next(p for p in paths if p.parts[0] == "logs").parts[:2]  # logs/<Model>
    links = {"logs": [model_folder], "tweaks": [("tweaks",)], "verdicts": [("verdicts",)]}
    planted = [p for k, v in links.items() if which in (k, "all") for p in v]
    for parts in planted:
        (folder / Path(*parts)).parent.mkdir(parents=True, exist_ok=True)
        (folder / Path(*parts)).symlink_to(home, target_is_directory=True)
    before = snapshot(home)
    model = fresh()
    with caplog.at_level(logging.WARNING, logger="torch_tweak"):
        result = tweak(model)
    assert result.selected_depth == 1 and same_as_untuned(model)
    assert snapshot(home) == before and sorted(os.listdir(home)) == sorted(before)
    lines = [r.getMessage() for r in caplog.records if "never follows inside its folder" in r.getMessage()]
    for parts in planted:  # one line per planted link, however many writes it stopped
        named = [line for line in lines if f"{folder / Path(*parts)} is a symbolic link" in line]
        assert len(named) == 1, (parts, lines)
    assert all((folder / Path(*parts)).is_symlink() for parts in planted)  # left for its owner to see
    if which in ("tweaks", "all"):
        assert tt.clear_cache() == 0 and snapshot(home) == before  # nor removed through


def test_eight_threads_writing_entries_at_once_while_links_are_planted(tuning_cache_folder, tmp_path):
    home, files = victims(tmp_path, 2)
    before = snapshot(home)
    keys = [f"{i:032x}" for i in range(4)]
    stop = threading.Event()
    errors: list[BaseException] = []

    def plant():  # someone keeps putting a link where the next entry goes
        while not stop.is_set():
            for key in keys:
                path = tuning_cache.folder() / f"{key}.json"
                try:
                    os.symlink(files[0], path)
                except OSError:
                    pass

    def writer(n):
        try:
            for round_ in range(25):
                key = keys[(n + round_) % len(keys)]
                tuning_cache.write(key, {"version": tuning_cache.ENTRY_VERSION, "writer": n, "round": round_,
                                         "padding": "x" * 4096})
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    tuning_cache.write(keys[0], {"first": True})
    planter = threading.Thread(target=plant)
    planter.start()
    threads = [threading.Thread(target=writer, args=(n,)) for n in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    stop.set()
    planter.join()
    assert not errors, errors
    assert snapshot(home) == before
    for key in keys:  # each a whole entry, or a link still standing from the last plant
        path = tuning_cache.folder() / f"{key}.json"
        if path.is_symlink():
            os.unlink(path)
            continue
        entry = json.loads(path.read_text())
        assert entry["padding"] == "x" * 4096 and 0 <= entry["writer"] < 8
    assert not [p for p in tuning_cache.folder().iterdir() if p.name.endswith(".tmp")]


def test_the_root_folder_may_itself_be_a_link(tmp_path, monkeypatch):
    """The folder is the user's choice: $TORCH_TWEAK_CACHE naming a link is written through."""
    real = tmp_path / "real-cache"
    real.mkdir()
    (tmp_path / "cache-link").symlink_to(real, target_is_directory=True)
    monkeypatch.setenv("TORCH_TWEAK_CACHE", str(tmp_path / "cache-link"))
    model = fresh()
    assert tweak(model).selected_depth == 1 and same_as_untuned(model)
    assert list((real / "tweaks").glob("*.json"))
    assert tweak(fresh()).cached


def test_writes_and_removals_refuse_paths_outside_the_folder(tuning_cache_folder, tmp_path):
    with pytest.raises(ValueError):
        storage.write_cached(tmp_path / "elsewhere.json", b"{}")
    with pytest.raises(ValueError):
        storage.write_cached(tuning_cache_folder / "tweaks" / ".." / ".." / "escape.json", b"{}")
    assert not (tmp_path / "escape.json").exists()


def test_a_verdict_behind_a_planted_link_is_neither_read_nor_written_through(tuning_cache_folder, tmp_path):
    module = torch.nn.Linear(4, 4)
    parts = verdicts.parts_of(Isolated(), module, [((torch.randn(2, 4),), {})], torch.device("cpu"))
    path = verdicts.path_of(verdicts.key_of(parts))
    path.parent.mkdir(parents=True)
    genuine = tmp_path / "a-verdict-of-mine.json"
    assert verdicts.write(parts, verdicts.Verdict(True, "crashed"))
    os.replace(path, genuine)  # a sealed verdict, reachable only through a link
    path.symlink_to(genuine)
    before = genuine.read_bytes()
    assert verdicts.read(parts) is None  # not followed
    assert verdicts.write(parts, verdicts.Verdict(False))
    assert genuine.read_bytes() == before and not path.is_symlink()
    assert verdicts.read(parts) == verdicts.Verdict(False)
