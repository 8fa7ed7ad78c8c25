"""Samples and datasets in every form API.md allows."""

from __future__ import annotations

import pytest
import torch

from torch_tweak._core._samples import as_call, load_dataset


def test_every_sample_form():
    x = torch.ones(1)
    assert as_call(x, 0) == ((x,), {})
    assert as_call((x, 2), 0) == ((x, 2), {})
    assert as_call([x], 0) == ((x,), {})
    assert as_call({"input": x}, 0) == ((), {"input": x})
    assert as_call(((x,), {"mask": None}), 0) == ((x,), {"mask": None})
    with pytest.raises(TypeError, match="sample 3 is a int"):
        as_call(5, 3)


def test_iterables_and_generators_are_datasets():
    calls = load_dataset(torch.ones(2) for _ in range(3))
    assert len(calls) == 3
    with pytest.raises(ValueError, match="empty"):
        load_dataset(iter([]))
    with pytest.raises(TypeError, match="not a dict"):
        load_dataset({"x": torch.ones(1)})
