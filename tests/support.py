"""Shared test helpers: a small model, fake backends and a short measurement."""

from __future__ import annotations

import os
import sys
import threading
import time

import torch
from torch import nn

import torch_tweak as tt
from torch_tweak.backends import Backend

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "examples", "Tweak"))
import encoder  # noqa: E402


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 16)) for _ in range(2))
        self.head = nn.Linear(16, 4)
        self.unused = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
        for block in self.blocks:
            x = x + block(x)
        return self.head(x) * scale


CLOCK = None
"""The fake clock while a test uses the fake_clock fixture (conftest.FakeClock), else None."""


def pause(seconds: float) -> None:
    """What a test model's call costs: `seconds` on the fake clock when the test runs on one
    (fake_clock: its verdicts then never turn on the machine's speed or load), else a real sleep."""
    if CLOCK is not None:
        CLOCK.advance(seconds * 1e9)
    else:
        time.sleep(seconds)


FAST = {"warmup_min": 1, "warmup_max": 3, "rounds_min": 3, "rounds_max": 5, "time_cap": 0.5}
"""A short measurement for tests that only check decisions, not speed."""


class Slow(nn.Module):
    """A layer whose forward waits 2 ms before its inner layer: what a backend that runs
    only the inner layer skips, for a tweak that truly gets faster."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        pause(0.002)
        return self.inner(x)


class SlowNet(nn.Module):
    """Two Slow layers: a backend that runs their inner layers makes depth 1 truly faster."""

    def __init__(self) -> None:
        super().__init__()
        self.a = Slow(nn.Linear(16, 16))
        self.b = Slow(nn.Linear(16, 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.a(x))


class CountingBackend(Backend):
    """Runs the module as it is and counts builds and calls."""

    name = "Counting"
    builds = 0

    def build(self, module, samples, device):
        type(self).builds += 1
        self.calls = 0

        def run(*args, **kwargs):
            self.calls += 1
            return module(*args, **kwargs)

        return run


class NoisyBackend(Backend):
    """Builds, but its outputs are off by far more than any tolerance."""

    name = "Noisy"

    def build(self, module, samples, device):
        return lambda *a, **k: module(*a, **k) + 1.0


class NaNBackend(Backend):
    name = "NaN"

    def build(self, module, samples, device):
        return lambda *a, **k: module(*a, **k) * float("nan")


class BrokenBackend(Backend):
    name = "Broken"

    def build(self, module, samples, device):
        raise RuntimeError("this backend cannot build anything")


def run_in_child(code: str, timeout: float = 120) -> None:
    """Runs `code` in a fresh interpreter and fails unless it exits 0: a case that used to
    crash the process (a segfault) fails the test instead of killing pytest."""
    import subprocess

    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, (
        f"exit code {proc.returncode} (negative: killed by that signal)\n{proc.stdout[-2000:]}\n"
        f"{proc.stderr[-3000:]}")


def wait_child(pid: int, timeout: float) -> int:
    """The exit code of a forked child, waited for at most `timeout` seconds: a child that has
    not ended by then is killed and the test fails, instead of the suite waiting forever."""
    import os
    import signal
    import time

    end = time.monotonic() + timeout
    while time.monotonic() < end:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        time.sleep(0.05)
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    raise AssertionError(f"the forked child had not ended after {timeout:.0f} s (killed)")


def in_threads(n, check, threads=8, mode=torch.inference_mode):
    """check(i) for i in range(n), spread over `threads` threads, each under `mode`; the
    first failure is raised here."""
    errors: list[BaseException] = []

    def serve(k: int) -> None:
        try:
            with mode():
                for i in range(k, n, threads):
                    check(i)
        except BaseException as exc:  # reported below
            errors.append(exc)

    started = [threading.Thread(target=serve, args=(k,)) for k in range(threads)]
    for t in started:
        t.start()
    for t in started:
        t.join()
    assert not errors, errors[0]


class FakeClock:
    """The engine's clock for a test that needs a speed verdict: it reads `now` (ns), which
    moves only when the test's model or backend says what a call costs (advance), so every
    latency, and every decision made on it, is exact whatever else the machine runs."""

    TICK = 1000
    """Each reading moves the clock by this much (ns) after it is read: every timed call costs
    at least 1 us, as a real one does, so a path that costs nothing more is not read as 0."""

    def __init__(self) -> None:
        self.now = 0

    def __call__(self) -> int:
        now = self.now
        self.now += self.TICK
        return now

    def advance(self, ns: float) -> None:
        self.now += int(ns)


CLOCKED = ("tweak", "tune_module", "choose", "compare", "measure")
"""The engine's bindings that measure: the fake_clock fixture gives each its clock."""
