"""Axes of a candidate beyond its backend: memory layout, attention kernel, kernel
autotuning and precision. A candidate is a backend plus its axis settings; tuning builds,
checks and measures each candidate like any other and keeps the fastest.

The axis settings are fields of the backend's config (Torch Eager, Torch Inductor, the
device graphs), so they have a closed schema (torch_tweak.schema) and survive tt.save,
tt.load and the tuning cache like the rest of the config:

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

import contextlib
import dataclasses
import math
from typing import Any, Callable, Iterator, Sequence

import torch
import torch.utils._pytree as pytree

from ._samples import Call
from .schema import DType, Flag, OneOf

LAYOUTS = (None, "channels_last")
SDPA_KERNELS = (None, "flash", "efficient", "cudnn", "math")
AUTOCAST_DTYPES = (torch.float16, torch.bfloat16)
AUTOTUNE_MODE = "max-autotune-no-cudagraphs"

EFFORTS = ("default", "high")
"""tt.tweak(effort=...): "default" tries the backends alone (today's tuning time); "high" also
tries, for the heavy modules (HEAVY_SHARE), channels-last variants where they have convolutions,
every SDPA kernel where they call scaled_dot_product_attention (CUDA only), Inductor's
max-autotune, and Inductor in a device graph with combo kernels (CUDA only)."""

PRECISIONS = ("tf32", "bf16", "int8", "fp8")
"""tt.tweak(precision={policy: tolerance}): "tf32" (float32 matmuls in TF32; CUDA), "bf16"
(bfloat16 autocast), "int8" (TorchAO int8 weight-only, compiled), "fp8" (TorchAO float8; CUDA
of compute capability 8.9 or newer)."""

HEAVY_SHARE = 0.2
"""A module is heavy, and gets effort="high"'s variants (channels-last, SDPA kernels,
max-autotune), when its time in the inspected run is at least this share of the whole model's
(the model itself always is). A light module's variant could gain at most its own small share,
and each costs a build (often a compile): the tuning time of effort="high" then grows with the
few heavy modules, not with the model's many small ones."""

EFFORT_RULES = ("conv", "sdpa", "heavy")
"""The rules of effort="high"'s variants: each applies to heavy modules only."""

AXIS_SCHEMA = {"memory_format": OneOf(LAYOUTS), "sdpa_kernel": OneOf(SDPA_KERNELS), "tf32": Flag(),
               "autocast_dtype": DType(AUTOCAST_DTYPES)}
"""What a saved file may hold of each axis field: every value the fields accept."""

_SHORT = {torch.bfloat16: "bf16", torch.float16: "fp16"}


def check_fields(config: Any) -> None:
    """ValueError naming the axis field of `config` whose value is not allowed."""
    if config.memory_format not in LAYOUTS:
        raise ValueError(f"memory_format must be None or 'channels_last'; got {config.memory_format!r}")
    if config.sdpa_kernel not in SDPA_KERNELS:
        raise ValueError(f"sdpa_kernel must be one of {', '.join(map(str, SDPA_KERNELS))}; got {config.sdpa_kernel!r}")
    if not isinstance(config.tf32, bool):
        raise ValueError(f"tf32 must be True or False, got {config.tf32!r}")
    dtype = config.autocast_dtype
    if dtype is not None and (not isinstance(dtype, torch.dtype) or dtype not in AUTOCAST_DTYPES):
        raise ValueError(f"autocast_dtype must be a torch.dtype, torch.bfloat16 or torch.float16 (or None); "
                         f"got {dtype!r}")


def has_axes(config: Any) -> bool:
    return any(getattr(config, name, None) not in (None, False) for name in AXIS_SCHEMA)


def label_parts(config: Any) -> list[str]:
    """What a candidate's name shows of its axes: "channels_last", "sdpa=flash", "max-autotune",
    "tf32", "bf16 autocast"."""
    parts = []
    if getattr(config, "memory_format", None):
        parts.append(config.memory_format)
    if getattr(config, "sdpa_kernel", None):
        parts.append(f"sdpa={config.sdpa_kernel}")
    if getattr(config, "mode", None) in ("max-autotune", AUTOTUNE_MODE):
        parts.append("max-autotune")
    if getattr(config, "combo_kernels", False):
        parts.append("combo kernels")
    if getattr(config, "tf32", False):
        parts.append("tf32")
    if getattr(config, "autocast_dtype", None) is not None:
        parts.append(f"{_SHORT[config.autocast_dtype]} autocast")
    return parts


def lowers_precision(config: Any) -> bool:
    """Whether the axes of `config` lower precision (tf32, autocast_dtype): the axes' part of
    BackendConfig.lowers_precision, which every reader asks instead of this."""
    return bool(getattr(config, "tf32", False)) or getattr(config, "autocast_dtype", None) is not None


TF32_TOLERANCE = 1e-2
"""The check's tolerance for a TF32 candidate whose config sets none (a 10-bit mantissa:
about 1e-3 per product, adding up through a block)."""


def tolerance(config: Any) -> float | None:
    """The config's tolerance; when it sets none, the autocast dtype's, or TF32's."""
    if config.tolerance is not None or not config.lowers_precision():
        return config.tolerance
    if getattr(config, "autocast_dtype", None) is not None:
        from .correctness import tolerance_for
        return tolerance_for(config.autocast_dtype)
    if getattr(config, "tf32", False):
        return TF32_TOLERANCE
    return None


def unavailable(config: Any, device: torch.device) -> str | None:
    """Why the axes of `config` cannot run on `device`, or None."""
    if getattr(config, "sdpa_kernel", None) and device.type != "cuda":
        return f"the SDPA kernel choice runs on CUDA only, not on {device.type}"
    if getattr(config, "sdpa_kernel", None) and _sdpa_backend(config.sdpa_kernel) is None:
        return f"this torch ({torch.__version__}) has no SDPA kernel {config.sdpa_kernel!r}"
    if getattr(config, "tf32", False) and device.type != "cuda":
        return f"TF32 runs on CUDA only, not on {device.type}"
    return None


def _sdpa_backend(kernel: str) -> Any:
    try:
        from torch.nn.attention import SDPBackend
    except ImportError:
        return None
    return getattr(SDPBackend, {"flash": "FLASH_ATTENTION", "efficient": "EFFICIENT_ATTENTION",
                                "cudnn": "CUDNN_ATTENTION", "math": "MATH"}[kernel], None)


@contextlib.contextmanager
def entered(config: Any, device: torch.device) -> Iterator[None]:
    """The contexts the axes of `config` run under (the SDPA kernel, TF32, autocast)."""
    with contextlib.ExitStack() as stack:
        if getattr(config, "sdpa_kernel", None):
            from torch.nn.attention import sdpa_kernel
            stack.enter_context(sdpa_kernel([_sdpa_backend(config.sdpa_kernel)]))
        if getattr(config, "tf32", False):
            stack.enter_context(_tf32())
        if getattr(config, "autocast_dtype", None) is not None:
            stack.enter_context(torch.autocast(device.type, dtype=config.autocast_dtype))
        yield


@contextlib.contextmanager
def _tf32() -> Iterator[None]:
    """TF32 for matmuls and cuDNN convolutions, put back as it was afterwards (process-wide
    flags: another thread's matmul at that moment would also run in TF32)."""
    matmul, cudnn = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = matmul, cudnn


def _to_layout(value: Any) -> Any:
    return (value.contiguous(memory_format=torch.channels_last)
            if isinstance(value, torch.Tensor) and value.dim() == 4 else value)


def _contiguous(value: Any) -> Any:
    return value.contiguous() if isinstance(value, torch.Tensor) and value.dim() == 4 else value


def build(config: Any, module: torch.nn.Module, samples: Sequence[Call], device: torch.device,
          make: Callable[[torch.nn.Module, Sequence[Call]], Callable[..., Any]]) -> Callable[..., Any]:
    """The callable of a backend with the axes of `config`: `make(module, samples)` builds the
    backend's own callable (compiles, warms up) on the module as the axes change it and on
    samples as the axes lay them out, under the axes' contexts; the result runs every call
    under those contexts. Without axes, `make(module, samples)` as it is.

    A build does not change `module`: channels-last runs on a copy."""
    if not has_axes(config):
        return make(module, samples)
    layout = config.memory_format == "channels_last"
    if layout:
        if not any(isinstance(m, torch.nn.Conv2d) for m in module.modules()):
            raise ValueError("channels_last: the module has no Conv2d")
        from .backends.base import copy_module
        module = copy_module(module).to(memory_format=torch.channels_last)
        samples = [pytree.tree_map(_to_layout, s) for s in samples]
    plain = None
    if config.autocast_dtype is not None:
        args, kwargs = samples[0]
        with torch.no_grad():
            plain = [t.dtype if isinstance(t, torch.Tensor) else None for t in pytree.tree_leaves(module(*args, **kwargs))]
    with entered(config, device):
        inner = make(module, samples)

    def run(*args: Any, **kwargs: Any) -> Any:
        if layout:
            args, kwargs = pytree.tree_map(_to_layout, (args, kwargs))
        with entered(config, device):
            out = inner(*args, **kwargs)
        if plain is None and not layout:
            return out
        leaves, spec = pytree.tree_flatten(out)
        if plain is not None and len(leaves) == len(plain):
            leaves = [t.to(want) if isinstance(t, torch.Tensor) and want is not None and t.dtype != want
                      and t.is_floating_point() else t for t, want in zip(leaves, plain)]
        if layout:
            leaves = [_contiguous(t) for t in leaves]
        return pytree.tree_unflatten(leaves, spec)

    run.inner = inner  # type: ignore[attr-defined]
    return run


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

    from . import model_state
    from ._samples import fresh

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
        if policy == "fp8":
            from .backends.torchao import device_refusal
            reason = device_refusal("fp8", device)
            if reason is not None:
                raise ValueError(f"precision 'fp8': {reason}")
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
        """(new backend, the rule of the modules it applies to) per variant of `backends`."""
        from .backends import (DeviceGraphBackend, InductorGraphBackend, TorchAOBackend, TorchEagerBackend,
                               TorchInductorBackend)
        from .backends.graph import INDUCTOR_GRAPH_MODES

        out: list[tuple[Any, str]] = []
        cuda = device.type == "cuda"
        axis_kinds = (TorchEagerBackend, TorchInductorBackend, DeviceGraphBackend)
        plain = [b for b in backends if isinstance(b, axis_kinds) and not has_axes(b.config)
                 and not b.config.lowers_precision() and getattr(b.config, "mode", None) in (None, "default")
                 and not getattr(b.config, "combo_kernels", False)]

        def variant(b: Any, rule: str, **fields: Any) -> None:
            out.append((type(b)(dataclasses.replace(b.config, **fields)), rule))

        if self.effort == "high":
            for b in plain:
                if not isinstance(b, DeviceGraphBackend) or isinstance(b, InductorGraphBackend):
                    variant(b, "conv", memory_format="channels_last")
            for b in plain:
                if isinstance(b, TorchInductorBackend) or (isinstance(b, InductorGraphBackend)
                                                           and AUTOTUNE_MODE in INDUCTOR_GRAPH_MODES):
                    variant(b, "heavy", mode=AUTOTUNE_MODE, options=None)
            for b in plain:  # fewer kernels per replay: what the small-batch rows pay for (bench/results/knobs.md)
                if isinstance(b, InductorGraphBackend) and cuda:
                    variant(b, "heavy", combo_kernels=True)
            if cuda:
                for kernel in SDPA_KERNELS[1:]:
                    for b in plain:
                        if isinstance(b, DeviceGraphBackend):  # the device graph and Inductor in one
                            variant(b, "sdpa", sdpa_kernel=kernel)
        for policy, tolerance in self.precision:
            if policy == "tf32":
                for b in plain:
                    variant(b, "fp32", tf32=True, tolerance=tolerance)
            elif policy == "bf16":
                for b in plain:
                    variant(b, "fp32", autocast_dtype=torch.bfloat16, tolerance=tolerance)
            else:
                mode = "int8_weight_only" if policy == "int8" else "fp8"
                out.append((TorchAOBackend(mode=mode, compile=True, tolerance=tolerance), "linear"))
        return out

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


def heavy_modules(model: torch.nn.Module, tree: Any, share: float = HEAVY_SHARE) -> frozenset[int]:
    """module_key of the modules whose inspected time is at least `share` of the model's."""
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
    from .backends import BUILT_IN
    from .strategy import default_backends

    device = torch.device(device)
    axes = Axes(precision=tuple(check_precision(precision, device).items()))
    bases = [b for b in default_backends(device) if type(b) in BUILT_IN]
    return [b for b, _ in axes.variants(bases, device)]
