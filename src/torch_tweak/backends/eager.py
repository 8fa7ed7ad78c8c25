"""Torch Eager: the module as it is, optionally under autocast. The baseline of the others."""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Sequence

import torch

from .._samples import Call
from . import variants
from .base import Backend, BackendConfig


@dataclasses.dataclass
class TorchEagerBackendConfig(BackendConfig):
    """autocast_dtype: run under torch.autocast with this dtype (None: no autocast).
    memory_format, sdpa_kernel, tf32: the candidate's axes (torch_tweak.axes)."""

    autocast_dtype: torch.dtype | None = None
    memory_format: str | None = None
    sdpa_kernel: str | None = None
    tf32: bool = False

    SCHEMA = {**BackendConfig.SCHEMA, **variants.AXIS_SCHEMA}

    def __post_init__(self) -> None:
        super().__post_init__()
        variants.check_fields(self)


class TorchEagerBackend(Backend):
    """The module as it is, with its axes (torch_tweak.axes): under ``autocast_dtype`` its
    floating outputs are cast back to the dtypes the module gives without autocast, so the
    code around it sees what it saw before; the check then uses that dtype's tolerance
    (unless the config sets one). With channels_last it runs a channels-last copy."""

    name = "TorchEager"
    config_class = TorchEagerBackendConfig

    def check_tolerance(self) -> float | None:
        return variants.tolerance(self.config)

    def unavailable(self, device: torch.device) -> str | None:
        return variants.unavailable(self.config, device)

    def build(self, module: torch.nn.Module, samples: Sequence[Call], device: torch.device) -> Callable[..., Any]:
        return variants.build(self.config, module, samples, device, lambda m, s: m)
