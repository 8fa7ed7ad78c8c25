"""The correctness check every backend passes before it is accepted.

A backend's outputs on the recorded samples must have the same structure as the
original module's (the same nesting of tuples, lists and dicts, tensors of the
same shape and dtype, equal plain values), no NaN or Inf where the original has
none, the same NaN or Inf where the original has one (NaN where NaN, +Inf where
+Inf, -Inf where -Inf), and values within a tolerance that fits the dtype.

The error of a floating-point tensor is relative to its scale:
``max|out - ref| / max(max|ref|, 1e-6)``, taken over the positions where the
reference is finite. A floating reference tensor with fewer than MIN_FINITE_SHARE
of its values finite (or none) compares too little to accept anything: every
backend is refused for it (a file whose stored outputs are NaN is one). Integer
and bool tensors must be equal. The defaults per
dtype are in ``TOLERANCES``; change one for the whole process with
``torch_tweak._core.correctness.TOLERANCES[torch.float32] = 1e-2``, or give a backend
config its own ``tolerance``.
"""

from __future__ import annotations

from typing import Any

import torch

from ._samples import cache_layers

TOLERANCES: dict[torch.dtype, float] = {
    torch.float64: 1e-6,
    torch.float32: 1e-3,
    torch.float16: 1e-2,
    torch.bfloat16: 3e-2,
}
"""Default relative tolerance per floating dtype; others (fp8...) use 0.1."""

MAX_TOLERANCES: dict[torch.dtype, float] = {
    torch.float64: 1e-3,
    torch.float32: 0.05,
    torch.float16: 0.05,
    torch.bfloat16: 0.1,
}
"""The most a tolerance read from a saved file may allow per dtype (others: 0.1): a file
cannot widen the check past what TorchAO's quantization needs."""


MIN_FINITE_SHARE = 0.01
"""The least share of a floating reference tensor's values that must be finite (and at least
one) for a check against it to accept a backend. Positions where the reference is NaN or Inf
are compared in kind only, so a reference made mostly of them compares almost nothing; a real
module's output with masked positions (-Inf attention scores, causal or padded) keeps far
more than 1 % of its values finite."""


class MismatchError(Exception):
    """A backend's output does not match the original module's.

    error and tolerance: the relative error found and the limit it broke, when the
    mismatch is one of values (None for one of structure, NaN or Inf).
    """

    def __init__(self, message: str, error: float | None = None, tolerance: float | None = None) -> None:
        super().__init__(message)
        self.error = error
        self.tolerance = tolerance


def tolerance_for(dtype: torch.dtype, override: float | None = None, bounded: bool = False) -> float:
    """The tolerance for `dtype`: `override` or the default; at most MAX_TOLERANCES when bounded."""
    limit = TOLERANCES.get(dtype, 0.1) if override is None else override
    return min(limit, MAX_TOLERANCES.get(dtype, 0.1)) if bounded else limit


def check(out: Any, ref: Any, tolerance: float | None = None, where: str = "output", bounded: bool = False) -> float:
    """Raises MismatchError when `out` does not match `ref`; returns the largest error seen.

    A transformers key/value cache (or its CacheRecord from a file) matches one of the same
    class with as many layers and matching tensors in each: caches are values, never
    compared by identity. bounded: the tolerance came from a file, capped by MAX_TOLERANCES."""
    if isinstance(ref, torch.Tensor):
        return check_tensor(out, ref, tolerance, where, bounded)
    cache = cache_layers(ref)
    if cache is not None:
        return check_cache(out, cache, tolerance, where, bounded)
    if isinstance(ref, dict):
        if not isinstance(out, dict) or list(out.keys()) != list(ref.keys()):
            raise MismatchError(f"{where}: expected a dict with keys {list(ref.keys())}, got {describe(out)}")
        return max((check(out[k], ref[k], tolerance, f"{where}[{k!r}]", bounded) for k in ref), default=0.0)
    if isinstance(ref, (tuple, list)):
        if not isinstance(out, (tuple, list)) or len(out) != len(ref):
            raise MismatchError(f"{where}: expected a {type(ref).__name__} of {len(ref)}, got {describe(out)}")
        return max((check(o, r, tolerance, f"{where}[{i}]", bounded) for i, (o, r) in enumerate(zip(out, ref))),
                   default=0.0)
    if type(out) is not type(ref):
        raise MismatchError(f"{where}: expected {type(ref).__name__}, got {describe(out)}")
    try:
        equal = bool(out == ref)
    except Exception:  # objects without a plain equality count as equal by type
        equal = True
    if not equal:
        raise MismatchError(f"{where}: expected {ref!r}, got {out!r}")
    return 0.0


def check_cache(out: Any, ref: tuple[str, list], tolerance: float | None, where: str, bounded: bool) -> float:
    name, layers = ref
    got = cache_layers(out)
    if got is None or got[0] != name or len(got[1]) != len(layers):
        raise MismatchError(f"{where}: expected a {name} of {len(layers)} layers, got "
                            + (describe(out) if got is None else f"a {got[0]} of {len(got[1])} layers"))
    worst = 0.0
    for i, (mine, theirs) in enumerate(zip(got[1], layers)):
        if len(mine) != len(theirs):
            raise MismatchError(f"{where}: layer {i} holds {len(mine)} tensors, expected {len(theirs)}")
        for j, (o, r) in enumerate(zip(mine, theirs)):
            worst = max(worst, check_tensor(o, r, tolerance, f"{where} layer {i} {('keys', 'values')[j % 2]}",
                                            bounded))
    return worst


def check_tensor(out: Any, ref: torch.Tensor, tolerance: float | None, where: str, bounded: bool = False) -> float:
    if not isinstance(out, torch.Tensor):
        raise MismatchError(f"{where}: expected a tensor, got {describe(out)}")
    if out.shape != ref.shape or out.dtype != ref.dtype:
        raise MismatchError(
            f"{where}: expected {tuple(ref.shape)} {ref.dtype}, got {tuple(out.shape)} {out.dtype}"
        )
    if out.numel() == 0:
        return 0.0
    out = out.detach()
    ref = ref.detach().to(out.device)
    if not ref.is_floating_point() and not ref.is_complex():
        if not torch.equal(out, ref):
            raise MismatchError(f"{where}: {int((out != ref).sum())} of {ref.numel()} values differ")
        return 0.0
    finite = torch.isfinite(ref)
    count = int(finite.sum())
    if count == 0 or count < MIN_FINITE_SHARE * ref.numel():
        found = "no finite value" if count == 0 else f"only {count} finite values of {ref.numel()}"
        raise MismatchError(f"{where}: the original's output has {found} (the rest NaN or Inf), so a check "
                            f"against it compares too little (at least {MIN_FINITE_SHARE:.0%} must be finite): "
                            "no backend is accepted for it, and it runs the original forward")
    bad = finite & ~torch.isfinite(out)
    if bool(bad.any()):
        raise MismatchError(f"{where}: {int(bad.sum())} NaN or Inf values where the original has none")
    if count < ref.numel():
        other = ~finite
        got, want = out[other], ref[other]
        if ref.is_complex():
            same = ~torch.isfinite(got)
        else:
            same = (torch.isnan(got) & torch.isnan(want)) | (got == want)
        if not bool(same.all()):
            raise MismatchError(f"{where}: {int((~same).sum())} values differ where the original is NaN or Inf "
                                "(a backend must give the same NaN or Inf there)")
    a = out[finite].double()
    b = ref[finite].double()
    scale = max(float(b.abs().max()), 1e-6)
    error = float((a - b).abs().max()) / scale
    limit = tolerance_for(ref.dtype, tolerance, bounded)
    if error > limit:
        raise MismatchError(f"{where}: relative error {error:.3g} exceeds the tolerance {limit:.3g} for {ref.dtype}",
                            error, limit)
    return error


def describe(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"a tensor {tuple(value.shape)} {value.dtype}"
    if isinstance(value, (tuple, list)):
        return f"a {type(value).__name__} of {len(value)}"
    return type(value).__name__
