"""Torch Inductor: torch.compile with its modes and options."""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Sequence

import torch

from .._samples import Call
from .base import Backend, BackendConfig, NeedsStorableSamples

MODES = (None, "default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")


@dataclasses.dataclass
class TorchInductorBackendConfig(BackendConfig):
    """The arguments of torch.compile: mode, options, dynamic, fullgraph."""

    mode: str | None = None
    options: dict[str, Any] | None = None
    dynamic: bool | None = None
    fullgraph: bool = False

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {', '.join(map(str, MODES))}; got {self.mode!r}")
        if self.mode is not None and self.options:
            raise ValueError("torch.compile takes either mode or options, not both")
        if self.options is not None and not isinstance(self.options, dict):
            raise ValueError(f"options must be a dict, got {type(self.options).__name__}")


class TorchInductorBackend(NeedsStorableSamples, Backend):
    """Torch Inductor: torch.compile(module) with the config's mode, options, dynamic and
    fullgraph, compiled on every recorded call at build time so no compile lands in a
    measurement. Wins on fusible element-wise work; fails on code dynamo cannot trace."""

    name = "TorchInductor"
    config_class = TorchInductorBackendConfig

    def build(self, module: torch.nn.Module, samples: Sequence[Call], device: torch.device) -> Callable[..., Any]:
        cfg = self.config
        compiled = torch.compile(
            module, backend="inductor", mode=cfg.mode, options=cfg.options,
            dynamic=cfg.dynamic, fullgraph=cfg.fullgraph,
        )
        # Compile now, on every recorded signature, so no compile lands in a measurement.
        for args, kwargs in samples:
            compiled(*args, **kwargs)
        return compiled
