"""The correctness check: structure, NaN/Inf, dtype-fitting tolerance."""

from __future__ import annotations

import pytest
import torch

from torch_tweak.correctness import MismatchError, check


def test_values_within_tolerance_pass_and_report_error():
    ref = torch.ones(4, 4)
    assert check(ref + 1e-5, ref) == pytest.approx(1e-5, rel=0.05)


def test_values_beyond_tolerance_fail():
    with pytest.raises(MismatchError, match="relative error"):
        check(torch.ones(4) * 1.01, torch.ones(4))
    check(torch.ones(4).bfloat16() * 1.01, torch.ones(4).bfloat16())  # bf16 allows more


def test_nan_where_original_has_none_fails_but_shared_nan_passes():
    ref = torch.tensor([1.0, float("nan"), 3.0])
    check(ref.clone(), ref)
    with pytest.raises(MismatchError, match="NaN or Inf"):
        check(torch.tensor([float("inf"), float("nan"), 3.0]), ref)


def test_structure_shape_dtype_and_plain_values():
    ref = {"a": (torch.ones(2), 3), "b": [torch.zeros(1)]}
    check({"a": (torch.ones(2), 3), "b": [torch.zeros(1)]}, ref)
    with pytest.raises(MismatchError, match="keys"):
        check({"a": (torch.ones(2), 3)}, ref)
    with pytest.raises(MismatchError, match=r"\(2,\)"):
        check({"a": (torch.ones(3), 3), "b": [torch.zeros(1)]}, ref)
    with pytest.raises(MismatchError, match="expected 3"):
        check({"a": (torch.ones(2), 4), "b": [torch.zeros(1)]}, ref)
    with pytest.raises(MismatchError, match="float64"):
        check(torch.ones(2, dtype=torch.float64), torch.ones(2))
    with pytest.raises(MismatchError, match="values differ"):
        check(torch.tensor([1, 2]), torch.tensor([1, 3]))
