"""The correctness check: structure, NaN/Inf, dtype-fitting tolerance."""

from __future__ import annotations

import pytest
import torch

from torch_tweak._core.correctness import MismatchError, check


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


def test_a_reference_with_no_finite_value_accepts_nothing():
    # a forged file's stored outputs all NaN: the check skipped every position and compared nothing
    for fill in (float("nan"), float("inf"), float("-inf")):
        ref = torch.full((4, 8), fill)
        with pytest.raises(MismatchError, match="no finite value .* compares too little"):
            check(torch.randn(4, 8), ref)
        with pytest.raises(MismatchError, match="no finite value"):
            check(ref.clone(), ref)  # even the same NaN everywhere: nothing was compared
    few = torch.full((1000,), float("nan"))
    few[:5] = 1.0  # 0.5 % finite, under MIN_FINITE_SHARE
    with pytest.raises(MismatchError, match="only 5 finite values of 1000"):
        check(few.clone(), few)
    with pytest.raises(MismatchError, match="no finite value"):
        check({"a": torch.ones(2), "b": (torch.full((3,), float("nan")),)},
              {"a": torch.ones(2), "b": (torch.full((3,), float("nan")),)})


def test_non_finite_reference_positions_must_match_in_kind():
    # a masked attention score keeps its -inf: the same -inf passes, anything else there fails
    scores = torch.randn(2, 6, 6)
    masked = scores.masked_fill(torch.ones(6, 6, dtype=torch.bool).triu(1), float("-inf"))
    assert check(masked + 1e-6, masked) < 1e-3
    with pytest.raises(MismatchError, match="differ where the original is NaN or Inf"):
        check(scores, masked)  # finite values where the original was masked
    with pytest.raises(MismatchError, match="differ where the original is NaN or Inf"):
        check(masked.masked_fill(torch.isinf(masked), float("inf")), masked)  # +inf for -inf
    with pytest.raises(MismatchError, match="differ where the original is NaN or Inf"):
        check(masked.masked_fill(torch.isinf(masked), float("nan")), masked)  # NaN for -inf
    ref = torch.tensor([1.0, float("nan"), 3.0])
    with pytest.raises(MismatchError, match="differ where the original is NaN or Inf"):
        check(torch.tensor([1.0, 2.0, 3.0]), ref)


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
