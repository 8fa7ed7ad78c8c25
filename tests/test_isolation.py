"""Native crash isolation: a backend whose build crashes the process is rejected, the tweak goes
on, and the verdict is kept on disk (torch_tweak.isolation, torch_tweak.verdicts)."""

from __future__ import annotations

import _thread
import copy
import os
import signal
import threading
import time

import pytest
import torch
from torch import nn

import torch_tweak as tt
from torch_tweak import isolation, verdicts
from torch_tweak.backends import Backend, TorchEagerBackend
from support import FAST, MLP

PARENT = int(os.environ.setdefault("TT_TEST_PARENT_PID", str(os.getpid())))
"""The test process; a spawned child imports this file with the same value."""


class SegfaultBackend(Backend):
    """Dies by a real SIGSEGV while building, in a child process. In the test process itself it
    raises instead, so a broken isolation fails the test rather than killing pytest."""

    name = "Segfault"
    isolate_build = True

    def die(self) -> None:
        os.kill(os.getpid(), signal.SIGSEGV)

    def build(self, module, samples, device):
        if os.getpid() != PARENT:
            self.die()
        raise AssertionError("the parent built a backend whose child died")


class ExitBackend(SegfaultBackend):
    """Native code calling exit(3) in the middle of a build."""

    name = "Exit"

    def die(self) -> None:
        os._exit(3)


class SleepingBackend(SegfaultBackend):
    name = "Sleeping"

    def die(self) -> None:
        time.sleep(60)


class RaisingBackend(Backend):
    """An ordinary exception is no crash: the parent's build reports it."""

    name = "Raising"
    isolate_build = True

    def build(self, module, samples, device):
        raise RuntimeError("cannot build this")


@pytest.fixture
def children(monkeypatch):
    """Counts the isolated children started."""
    started = []
    real = isolation._run_child

    def counted(*args, **kwargs):
        started.append(args[0])
        return real(*args, **kwargs)

    monkeypatch.setattr(isolation, "_run_child", counted)
    return started


def _candidate(result, path, name):
    return next(c for s in result.modules[path].signatures for c in s.candidates if c["backend"] == name)


def _tweak(model, data, backends):
    return tt.tweak(model, data, max_depth=0, strategy=tt.HighestThroughputStrategy(backends), measure=FAST,
                    progress=False, cache=False)


@pytest.mark.parametrize("backend, words", [(SegfaultBackend, "signal 11, SIGSEGV"), (ExitBackend, "exit status 3")])
def test_a_crashing_build_is_rejected_and_its_verdict_kept(backend, words, children):
    torch.manual_seed(0)
    model = MLP().eval()
    untuned = copy.deepcopy(model)
    data = [torch.randn(8, 16) for _ in range(3)]
    result = _tweak(model, data, [backend(), TorchEagerBackend()])
    crashed = _candidate(result, "", backend.name)
    assert crashed["reason"] == "crashed"
    assert f"{backend.name} crashed while compiling ({words})" in crashed["error"]
    assert _candidate(result, "", "TorchEager")["state"] == "measured"
    assert result.modules[""].backend == "TorchEager"
    assert children == ["fork", "spawn"]  # a crash in a forked child is confirmed in a fresh interpreter
    with torch.no_grad():
        for x in data + [torch.randn(8, 16)]:
            torch.testing.assert_close(model(x), untuned(x))
    # a second tweak of the same module and signature: the stored verdict, no child
    again = _tweak(copy.deepcopy(untuned), data, [backend(), TorchEagerBackend()])
    assert len(children) == 2
    stored = _candidate(again, "", backend.name)
    assert stored["reason"] == "crashed" and words in stored["error"] and "stored verdict" in stored["error"]


def test_an_exception_in_the_child_is_no_crash(children):
    data = [torch.randn(4, 16)]
    result = _tweak(MLP().eval(), data, [RaisingBackend(), TorchEagerBackend()])
    raised = _candidate(result, "", "Raising")
    assert raised["reason"] == "build failed" and "cannot build this" in raised["error"]
    assert len(children) == 1
    _tweak(MLP().eval(), data, [RaisingBackend(), TorchEagerBackend()])
    assert len(children) == 1  # its verdict (no crash) is stored too


def test_the_spawned_child_isolates_too(monkeypatch, children):
    monkeypatch.setenv(isolation.ISOLATION_ENV, "spawn")
    model = nn.Sequential(nn.Linear(16, 8), nn.ReLU()).eval()
    result = _tweak(model, [torch.randn(4, 16)], [SegfaultBackend(), TorchEagerBackend()])
    assert children == ["spawn"]
    assert "signal 11, SIGSEGV" in _candidate(result, "", "Segfault")["error"]


def test_a_module_that_cannot_be_sent_builds_without_isolation(monkeypatch, children, tuning_cache_folder):
    monkeypatch.setenv(isolation.ISOLATION_ENV, "spawn")

    class Local(nn.Module):  # a local class cannot be pickled for a spawned child
        def forward(self, x):
            return x * 2

    result = _tweak(Local().eval(), [torch.randn(4, 16)], [RaisingBackend(), TorchEagerBackend()])
    assert _candidate(result, "", "Raising")["reason"] == "build failed"
    log = next(tuning_cache_folder.glob("logs/Local/_root/*/Raising.log")).read_text()
    assert "could not be sent to a child; built without isolation" in log


def test_ctrl_c_while_a_child_runs_kills_it(children):
    stop = threading.Event()

    def press_ctrl_c() -> None:  # once the child runs, however long a busy machine takes to start it
        while not stop.is_set():
            if children:
                time.sleep(0.5)  # the child is asleep in its build by now
                _thread.interrupt_main()
                return
            time.sleep(0.05)

    presser = threading.Thread(target=press_ctrl_c, daemon=True)
    presser.start()
    start = time.monotonic()
    try:
        with pytest.raises(KeyboardInterrupt):
            _tweak(MLP().eval(), [torch.randn(4, 16)], [SleepingBackend(), TorchEagerBackend()])
    finally:
        stop.set()
        presser.join()
    assert time.monotonic() - start < 30
    assert children == ["fork"]
    with pytest.raises(ChildProcessError):
        os.waitpid(-1, os.WNOHANG)  # the child is dead and reaped


def _parts():
    module = nn.Linear(4, 4)
    return verdicts.parts_of(SegfaultBackend(), module, [((torch.randn(2, 4),), {})], torch.device("cpu"))


def _read_within(parts, seconds=5.0):
    found = []
    reader = threading.Thread(target=lambda: found.append(verdicts.read(parts)), daemon=True)
    reader.start()
    reader.join(seconds)
    assert not reader.is_alive(), "reading a verdict hung"
    return found[0]


@pytest.mark.parametrize("kind", ["garbage", "fifo", "huge", "other parts", "folder"])
def test_a_bad_verdict_file_is_a_miss_and_is_written_again(kind):
    parts = _parts()
    path = verdicts.path_of(verdicts.key_of(parts))
    path.parent.mkdir(parents=True, exist_ok=True)
    if kind == "garbage":
        path.write_bytes(b"\x00\xff{not json")
    elif kind == "fifo":
        os.mkfifo(path)
    elif kind == "huge":
        path.write_text('{"crashed": false, "parts": ' + " " * verdicts.MAX_BYTES + "{}}")
    elif kind == "other parts":
        verdicts.write(dict(parts, cpu="another"), verdicts.Verdict(False))
        os.replace(verdicts.path_of(verdicts.key_of(dict(parts, cpu="another"))), path)
    else:
        path.mkdir()
    assert _read_within(parts) is None
    written = verdicts.write(parts, verdicts.Verdict(True, "Segfault crashed while compiling (signal 11, SIGSEGV)"))
    if kind == "folder":
        assert not written  # a folder in the way is left alone: the child simply runs again
        return
    assert written and path.is_file()
    assert _read_within(parts) == verdicts.Verdict(True, "Segfault crashed while compiling (signal 11, SIGSEGV)")


def test_the_verdict_key_holds_the_library_versions():
    parts = _parts()
    assert set(parts["versions"]) == {"torch", "torch_tweak"}
    assert parts["backend"].endswith("SegfaultBackend") and parts["tensors"][0][1] == [4, 4]
    verdicts.write(parts, verdicts.Verdict(False))
    newer = dict(parts, versions=dict(parts["versions"], torch="99.0"))
    assert verdicts.read(newer) is None and verdicts.read(parts) == verdicts.Verdict(False)


class ThreeBlockMLP(nn.Module):
    """The model of issue 12: OpenVINO's compile_model segfaulted on it (LATENCY, f32, a static
    shape) on a CPU with AVX-512 BF16."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 32)) for _ in range(3))
        self.head = nn.Linear(32, 4)

    def forward(self, x):
        for block in self.blocks:
            x = x + block(x)
        return self.head(x)


def test_the_issue_mlp_with_openvino_finishes_and_matches(children, tuning_cache_folder):
    pytest.importorskip("openvino")
    from torch_tweak.backends import OpenVINOBackend

    torch.manual_seed(0)
    model = ThreeBlockMLP().eval()
    untuned = copy.deepcopy(model)
    data = [torch.randn(4, 32) for _ in range(4)]
    result = tt.tweak(model, data, strategy=tt.HighestThroughputStrategy([OpenVINOBackend(), TorchEagerBackend()]),
                      measure=FAST, progress=False, cache=False)
    with torch.no_grad():
        for x in data:
            torch.testing.assert_close(model(x), untuned(x), rtol=1e-4, atol=1e-5)
    # one child per distinct module and signature: the root, one block (the three are alike), the head;
    # and a fresh interpreter for each crash a forked child saw, to confirm it
    crashes = sum(_candidate(result, p, "OpenVINO")["reason"] == "crashed" for p in result.modules)
    assert children.count("fork") == 3 and children.count("spawn") == crashes
    for path in result.modules:
        candidate = _candidate(result, path, "OpenVINO")
        # on this 2-core AMD EPYC the root's compile does segfault (OpenVINO 2026.4.1): rejected, not fatal
        assert candidate["state"] in ("measured", "built") or (
            candidate["reason"] == "crashed"
            and "OpenVINO crashed while compiling (signal 11, SIGSEGV)" in candidate["error"]), candidate
    log = next(tuning_cache_folder.glob("logs/ThreeBlockMLP/_root/*/OpenVINO.log")).read_text()
    assert "isolation: fork child ran in" in log


class ForkOnlyAbort(Backend):
    """Aborts in a forked child only, as a library whose threads a fork left half-alive does;
    builds in a fresh interpreter and in the tuning process."""

    name = "ForkOnlyAbort"
    isolate_build = True

    def build(self, module, samples, device):
        if os.getpid() != PARENT and os.environ.get("TT_FRESH") != "1":
            os.abort()
        return module



def test_a_crash_only_a_fork_sees_is_not_believed(monkeypatch, children):
    monkeypatch.setenv("TT_FRESH", "0")
    real = isolation._run_child

    def run(how, *args):  # the spawned child is a fresh interpreter: it builds without the fork's hazard
        monkeypatch.setenv("TT_FRESH", "1" if how == "spawn" else "0")
        return real(how, *args)

    monkeypatch.setattr(isolation, "_run_child", run)
    torch.manual_seed(0)
    model = MLP().eval()
    untuned = copy.deepcopy(model)
    data = [torch.randn(8, 16) for _ in range(2)]
    result = _tweak(model, data, [ForkOnlyAbort(), TorchEagerBackend()])
    assert children[:2] == ["fork", "spawn"]
    assert _candidate(result, "", "ForkOnlyAbort")["reason"] != "crashed"  # the fresh interpreter built it
    with torch.no_grad():
        for x in data:
            torch.testing.assert_close(model(x), untuned(x))
