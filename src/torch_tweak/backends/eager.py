"""Torch Eager: the module as it is, optionally under autocast. The baseline of the others."""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Sequence

import torch

from .._samples import Call
from .base import Backend, BackendConfig


@dataclasses.dataclass
class TorchEagerBackendConfig(BackendConfig):
    """autocast_dtype: run under torch.autocast with this dtype (None: no autocast)."""

    autocast_dtype: torch.dtype | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.autocast_dtype is not None and not isinstance(self.autocast_dtype, torch.dtype):
            raise ValueError(f"autocast_dtype must be a torch.dtype, got {self.autocast_dtype!r}")


class TorchEagerBackend(Backend):
    name = "TorchEager"
    config_class = TorchEagerBackendConfig

    def build(self, module: torch.nn.Module, samples: Sequence[Call], device: torch.device) -> Callable[..., Any]:
        dtype = self.config.autocast_dtype
        if dtype is None:
            return module

        def run(*args: Any, **kwargs: Any) -> Any:
            with torch.autocast(device.type, dtype=dtype):
                return module(*args, **kwargs)

        return run
