"""Axes of a candidate beyond its backend: memory layout, attention kernel, kernel
autotuning and precision. A candidate is a backend plus its axis settings; tuning builds,
checks and measures each candidate like any other and keeps the fastest.

The axis settings are fields of the backend's config (Torch Eager, Torch Inductor, the
device graphs), so they have a closed schema (torch_tweak._core.schema) and survive tt.save,
tt.load and the tuning cache like the rest of the config (their fields, checks and build
wrapper: torch_tweak.backends.variants):

    memory_format   None, or "channels_last": the module runs on a channels-last copy of
                    itself, its 4-D tensor inputs are made channels-last and its 4-D
                    outputs contiguous again (modules with a Conv2d only)
    sdpa_kernel     None, or "flash", "efficient", "cudnn", "math": the module runs under
                    torch.nn.attention.sdpa_kernel with that kernel only (CUDA; modules
                    that call scaled_dot_product_attention)
    tf32            True: float32 matmuls and convolutions in TF32 (CUDA; lower precision)
    autocast_dtype  None, or torch.bfloat16 / torch.float16: under torch.autocast, floating
                    outputs cast back to the dtypes the module gives without it (lower
                    precision)

Kernel autotuning is Inductor's own ``mode="max-autotune-no-cudagraphs"``, a field the
Inductor configs already have; fewer kernels per replay is Inductor's combo_kernels option,
the ``combo_kernels`` field of Inductor-in-a-device-graph configs. A strategy's Axes
(below) says which variants it adds to its backends, and to which modules; tt.tweak builds
it from ``effort`` and ``precision``. A variant that lowers precision is opt-in: never a
default, checked against the tolerance the user gave, labelled in every result, and built
from a file only when the caller passes it to tt.load (see precision_backends).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Sequence

import torch
import torch.utils._pytree as pytree

from .._core import settings
from .._core._samples import Call
from . import registry
from .variants import VariantConfig

EFFORTS = ("default", "high")
"""tt.tweak(effort=...): "default" tries the backends alone (today's tuning time); "high" also
tries, for the heavy modules (HEAVY_SHARE), channels-last variants where they have convolutions,
every SDPA kernel where they call scaled_dot_product_attention (CUDA only), Inductor's
max-autotune, and Inductor in a device graph with combo kernels (CUDA only)."""

PRECISIONS = ("tf32", "bf16", "int8", "fp8")
"""tt.tweak(precision={policy: tolerance}): "tf32" (float32 matmuls in TF32; CUDA), "bf16"
(bfloat16 autocast), "int8" (TorchAO int8 weight-only, compiled), "fp8" (TorchAO float8; CUDA
of compute capability 8.9 or newer)."""


EFFORT_RULES = ("conv", "sdpa", "heavy")
"""The rules of effort="high"'s variants: each applies to heavy modules only."""

# ------------------------------------------------------------------ which modules


def has_conv(module: torch.nn.Module) -> bool:
    return any(isinstance(m, torch.nn.Conv2d) for m in module.modules())


def has_linear(module: torch.nn.Module) -> bool:
    return any(isinstance(m, torch.nn.Linear) for m in module.modules())


def float32_inside(module: torch.nn.Module, samples: Sequence[Call]) -> bool:
    """Whether the module computes in float32: a float32 weight, or a float32 input."""
    if any(t.dtype == torch.float32 for t in list(module.parameters()) + list(module.buffers())):
        return True
    return any(isinstance(t, torch.Tensor) and t.dtype == torch.float32 for s in samples[:1]
               for t in pytree.tree_leaves(s))


def calls_sdpa(module: torch.nn.Module, samples: Sequence[Call]) -> bool:
    """Whether one recorded call of the module calls scaled_dot_product_attention (watched
    with a TorchFunctionMode; the module's state is put back afterwards)."""
    from torch.overrides import TorchFunctionMode

    from .._core import model_state
    from .._core._samples import fresh

    target = torch.nn.functional.scaled_dot_product_attention
    seen = []

    class Watch(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            if func is target:
                seen.append(True)
            return func(*args, **(kwargs or {}))

    state = model_state.snapshot(module)
    try:
        args, kwargs = fresh(samples[0])
        with torch.no_grad(), Watch():
            module(*args, **kwargs)
    except Exception:
        return False
    finally:
        state.restore()
    return bool(seen)


# ------------------------------------------------------------------ policies


def check_effort(effort: Any) -> None:
    if effort not in EFFORTS:
        raise ValueError(f"effort must be 'default' or 'high', got {effort!r}")


def check_precision(precision: Any, device: torch.device) -> dict[str, float]:
    """The policies asked for, {policy: tolerance}; ValueError or TypeError saying what is wrong."""
    if precision is None:
        return {}
    if isinstance(precision, (str, list, tuple, set)):
        raise TypeError("precision takes each policy with the relative tolerance you accept for it, "
                        "e.g. precision={'bf16': 0.03}; a lower precision is never used without one")
    if not isinstance(precision, dict):
        raise TypeError(f"precision must be a dict {{policy: tolerance}}, not {type(precision).__name__}")
    for policy, tolerance in precision.items():
        if policy not in PRECISIONS:
            raise ValueError(f"unknown precision policy {policy!r}; the policies are {', '.join(PRECISIONS)}")
        if (not isinstance(tolerance, (int, float)) or isinstance(tolerance, bool) or not math.isfinite(tolerance)
                or not 0 < tolerance <= 1):
            raise ValueError(f"precision[{policy!r}] must be a relative tolerance above 0 and at most 1 "
                             f"(0.03 is 3 %), got {tolerance!r}")
        if policy == "tf32" and device.type != "cuda":
            raise ValueError(f"precision 'tf32' runs on CUDA only, and the model is on {device.type}: leave it out")
        for v in (v for r in registry.registrations() for v in r.variants if v.asked == policy and v.refusal):
            reason = v.refusal(device)
            if reason is not None:
                raise ValueError(f"precision {policy!r}: {reason}")
    return {p: float(t) for p, t in precision.items()}


@dataclasses.dataclass(frozen=True)
class Axes:
    """Which variants a strategy adds to its backends, and to which modules.

    effort: "default" or "high" (see EFFORTS). precision: ((policy, tolerance), ...) (see
    PRECISIONS), opt-in. heavy: module_key of the modules that get effort="high"'s variants
    (None: every module)."""

    effort: str = "default"
    precision: tuple[tuple[str, float], ...] = ()
    heavy: frozenset[int] | None = None

    def __bool__(self) -> bool:
        return self.effort != "default" or bool(self.precision)

    def variants(self, backends: Sequence[Any], device: torch.device) -> list[tuple[Any, str]]:
        """(new backend, the rule of the modules it applies to) per variant of `backends`: the
        variants each backend's registration offers (torch_tweak.backends.registry) for what
        was asked, on this device; a backend already set apart (a variant field, a lower
        precision, a mode of its own) gets none. Ordered by what was asked (effort first, then
        each precision policy), then the variant's order, then the backends' order."""
        asked = (["high"] if self.effort == "high" else []) + [policy for policy, _ in self.precision]
        tolerances = dict(self.precision)

        def offered(v: Any) -> bool:
            return v.asked in asked and (not v.devices or device.type in v.devices)

        def fields(v: Any) -> dict[str, Any]:  # a precision policy's variant takes its tolerance
            return dict(v.fields, **({"tolerance": tolerances[v.asked]} if v.asked in tolerances else {}))

        found: list[tuple[tuple[int, int, int], Any, str]] = []
        for index, b in enumerate(backends):
            registration = registry.registration_of(type(b))
            if registration is None or not isinstance(b.config, VariantConfig) or not b.config.takes_variants():
                continue
            found += [((asked.index(v.asked), v.order, index), type(b)(dataclasses.replace(b.config, **fields(v))),
                       v.rule) for v in registration.variants if not v.alone and offered(v)]
        for registration in registry.registrations():
            found += [((asked.index(v.asked), v.order, len(backends)), registration.cls(**fields(v)), v.rule)
                      for v in registration.variants if v.alone and offered(v)]
        found.sort(key=lambda item: item[0])
        return [(backend, rule) for _, backend, rule in found]

    def applies(self, rule: str, module: torch.nn.Module, samples: Sequence[Call]) -> bool:
        if rule in EFFORT_RULES and not (self.heavy is None or module_key(module) in self.heavy):
            return False  # effort goes where the time is: a light module's variants could gain little
        if rule == "conv":
            return has_conv(module)
        if rule == "sdpa":
            return calls_sdpa(module, samples)
        if rule == "fp32":
            return float32_inside(module, samples)
        if rule == "linear":
            return has_linear(module)
        return True


def module_key(module: torch.nn.Module) -> int:
    """What names one module across its tuned-module views: a wrapped module's original (what
    backends build on) is another object of its class sharing its __dict__."""
    return id(module.__dict__)


def heavy_modules(model: torch.nn.Module, tree: Any, share: float | None = None) -> frozenset[int]:
    """module_key of the modules whose inspected time is at least `share` (settings.HEAVY_SHARE) of the model's."""
    share = settings.HEAVY_SHARE if share is None else share
    total = tree.time_ms("")
    keys = set()
    for path in tree.paths:
        if path == "" or (total > 0 and tree.time_ms(path) >= share * total):
            keys.add(module_key(model.get_submodule(path) if path else model))
    return frozenset(keys)


def precision_backends(device: Any, precision: dict[str, float]) -> list[Any]:
    """The lower-precision candidates tt.tweak(precision=...) tries on `device`: pass them to
    tt.load(model, path, backends=...) to load a file tuned with those policies (tt.load never
    lowers precision on a file's word alone)."""
    device = torch.device(device)
    axes = Axes(precision=tuple(check_precision(precision, device).items()))
    bases = registry.default_backends(device)
    return [b for b, _ in axes.variants(bases, device)]
