"""TorchAO: the module's nn.Linear layers quantized by torchao. Opt-in only, never a default:
quantization changes results, so it is checked against its own, wider tolerance.

An optional dependency: ``pip install torch-tweak[torchao]`` (torchao 0.13 or newer: 0.18 with
a CUDA torch, 0.13 with a CPU one, where it imports without a line; docs/backends.md). The backend quantizes a copy of the module; the original
module and its weights stay as they are.

Modes: "int8_weight_only" (int8 weights, activations in their dtype), "int8_dynamic" (int8
weights and activations quantized per call), "fp8" (float8 weights and activations; a CUDA
GPU of compute capability 8.9 or newer: Ada, Hopper, Blackwell).
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
from typing import Any, Callable, Sequence

import torch

from .._core import settings
from .._core import noise
from .._core._samples import Call
from .._core.schema import Flag, OneOf
from .base import Backend, BackendConfig, NeedsStorableSamples, copy_module
from .registry import register
from .variants import Variant

MODES = ("int8_weight_only", "int8_dynamic", "fp8")


TORCHAO_IMPORT = {"torchao": ("Failed to load",),
                  "torch.utils._pytree": ("is an Enum subclass and is now natively supported",)}
"""What importing a torchao that does not match the installed torch says (dropped while it runs,
torch_tweak._core.noise): "Failed to load" for each of its native libraries it cannot load (its CUDA
kernels on a CPU machine), and the Enum types its import registers, which this torch logs as
deprecated. torch-tweak imports torchao only when TorchAO is asked for (TorchAOBackend,
precision={"int8"|"fp8": ...})."""

_CONFIGS = {
    "int8_weight_only": "Int8WeightOnlyConfig",
    "int8_dynamic": "Int8DynamicActivationInt8WeightConfig",
    "fp8": "Float8DynamicActivationFloat8WeightConfig",
}


@dataclasses.dataclass
class TorchAOBackendConfig(BackendConfig):
    """mode: "int8_weight_only", "int8_dynamic" or "fp8". compile: torch.compile the
    quantized module (the fast path of torchao's kernels; costs a compile per signature).
    tolerance: defaults to TORCHAO_TOLERANCE (0.05), not the per-dtype defaults."""

    tolerance: float | None = dataclasses.field(default_factory=lambda: settings.TORCHAO_TOLERANCE)
    mode: str = "int8_weight_only"
    compile: bool = False

    SCHEMA = {**BackendConfig.SCHEMA, "mode": OneOf(MODES), "compile": Flag()}

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {', '.join(MODES)}; got {self.mode!r}")
        if not isinstance(self.compile, bool):
            raise ValueError(f"compile must be a bool, got {self.compile!r}")

    def lowers_precision(self) -> bool:
        """Every mode quantizes (int8, fp8 weights)."""
        return True


def _import_torchao() -> Any:
    try:
        with noise.dropped(TORCHAO_IMPORT):
            return importlib.import_module("torchao.quantization")
    except ImportError:
        return None


def device_refusal(mode: str, device: torch.device) -> str | None:
    """Why `device` can never run TorchAO in `mode`, or None when it can."""
    if device.type not in ("cpu", "cuda", "xpu"):
        return f"TorchAO runs on cpu, cuda and xpu, not on {device.type}"
    if mode != "fp8":
        return None
    if device.type != "cuda":
        return (f"TorchAO fp8 needs a CUDA GPU of compute capability 8.9 or newer; {device.type} cannot run it "
                "(use mode='int8_weight_only' or 'int8_dynamic')")
    if not torch.cuda.is_available():
        return "TorchAO fp8 needs a CUDA GPU, and torch sees none"
    capability = torch.cuda.get_device_capability(device)
    if capability < (8, 9):
        name = torch.cuda.get_device_name(device)
        return (f"TorchAO fp8 needs a CUDA GPU of compute capability 8.9 or newer; {name} ({device}) has "
                f"{capability[0]}.{capability[1]} (use mode='int8_weight_only' or 'int8_dynamic')")
    return None


class TorchAOBackend(NeedsStorableSamples, Backend):
    """TorchAO: a quantized copy of the module (int8 weight-only, int8 dynamic, or fp8 where
    the device supports it). Opt-in only, never a default: quantization changes results, so
    it is checked against its own, looser tolerance."""

    name = "TorchAO"
    config_class = TorchAOBackendConfig
    opt_in = True

    @property
    def compiles_with_inductor(self) -> bool:  # type: ignore[override]
        return self.config.compile
    # Gradients would flow into the quantized copy, never into the model's own weights.
    supports_autograd = False

    def label_parts(self) -> list[str]:
        """The mode is the candidate's precision: "TorchAO [int8_weight_only]"."""
        return [self.config.mode]

    def check_device(self, device: torch.device) -> None:
        reason = device_refusal(self.config.mode, device)
        if reason is not None:
            raise ValueError(reason)

    def unavailable(self, device: torch.device) -> str | None:
        if _import_torchao() is None:
            return "not installed (pip install torch-tweak[torchao])"
        return device_refusal(self.config.mode, device)

    def build(self, module: torch.nn.Module, samples: Sequence[Call], device: torch.device) -> Callable[..., Any]:
        quantization = _import_torchao()
        if not any(isinstance(m, torch.nn.Linear) for m in module.modules()):
            raise ValueError("TorchAO quantizes nn.Linear layers, and this module has none")
        quantized = copy_module(module)
        quantization.quantize_(quantized, getattr(quantization, _CONFIGS[self.config.mode])())
        fn: Callable[..., Any] = quantized
        if self.config.compile:
            fn = torch.compile(quantized)
        for args, kwargs in samples:  # compile or lazily initialise now, not in a measurement
            fn(*args, **kwargs)
        return fn


register(TorchAOBackend, devices=("cpu", "cuda", "xpu"), extra="torchao", packages=("torchao",), variants=(
    Variant("int8", "linear", (("mode", "int8_weight_only"), ("compile", True)), alone=True),
    Variant("fp8", "linear", (("mode", "fp8"), ("compile", True)), alone=True,
            refusal=functools.partial(device_refusal, "fp8"))))
