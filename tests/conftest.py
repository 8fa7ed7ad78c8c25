"""Shared fixtures: a small model, and one Inductor tweak of examples/Tweak shared by the tests
that need it (Inductor compiles on a CPU are slow)."""

from __future__ import annotations

import pytest
import torch

import torch_tweak as tt
from support import FAST, MLP, encoder


@pytest.fixture
def mlp() -> MLP:
    torch.manual_seed(0)
    return MLP().eval()


@pytest.fixture
def mlp_data() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return [torch.randn(8, 16, generator=g) for _ in range(3)]


@pytest.fixture(scope="session")
def encoder_tweak():
    """One tweak of examples/Tweak's encoder with the default (Inductor, Eager) backends."""
    model = encoder.build()
    data = encoder.samples(count=2)
    with torch.no_grad():
        expected = [model(x) for x in data]
    result = tt.tweak(model, data, progress=False, measure=FAST)
    return model, data, expected, result
