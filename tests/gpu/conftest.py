"""GPU tests: skipped without CUDA. `eager_guard` fails a test in which the original
forward of a watched module ran when it should not have, so a silent fallback cannot pass
for a replay."""

from __future__ import annotations

import contextlib

import pytest
import torch


@pytest.fixture(autouse=True)
def _needs_cuda():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")


class EagerGuard:
    """Counts calls of watched modules' forward once armed; every call must be expected."""

    def __init__(self) -> None:
        self.calls = 0
        self.expected = 0
        self.armed = False
        self.handles = []

    def watch(self, module: torch.nn.Module) -> None:
        self.handles.append(module.register_forward_pre_hook(self._count))

    def _count(self, module, args) -> None:
        if self.armed:
            self.calls += 1

    def arm(self) -> None:
        """From now on, every run of a watched forward must be inside expect()."""
        self.armed = True

    def disarm(self) -> None:
        """Stop counting (before a tweak, which runs the untuned model on purpose)."""
        self.armed = False

    @contextlib.contextmanager
    def expect(self, n: int = 1):
        """The block runs a watched forward exactly n times (a fallback, a deactivated model)."""
        before = self.calls
        yield
        ran = self.calls - before
        assert ran == n, f"the original forward ran {ran} times here, expected {n}"
        self.expected += n

    def close(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles.clear()


@pytest.fixture
def eager_guard():
    guard = EagerGuard()
    yield guard
    guard.close()
    unexpected = guard.calls - guard.expected
    assert unexpected == 0, f"the original forward ran {unexpected} times where the device graph should have"
