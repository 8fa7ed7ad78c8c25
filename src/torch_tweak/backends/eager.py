"""Torch Eager: the module as it is, optionally under autocast. The baseline of the others."""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Sequence

import torch

from .._core._samples import Call
from .base import Backend
from .registry import register
from .variants import CHANNELS_LAST, LOWER_PRECISION, VariantConfig


@dataclasses.dataclass
class TorchEagerBackendConfig(VariantConfig):
    """autocast_dtype: run under torch.autocast with this dtype (None: no autocast).
    memory_format, sdpa_kernel, tf32: the candidate's variant (backends.variants.VariantConfig)."""


class TorchEagerBackend(Backend):
    """The module as it is, with its variant (backends.variants): under ``autocast_dtype`` its
    floating outputs are cast back to the dtypes the module gives without autocast, so the
    code around it sees what it saw before; the check then uses that dtype's tolerance
    (unless the config sets one). With channels_last it runs a channels-last copy."""

    name = "TorchEager"
    writes_back = True
    config_class = TorchEagerBackendConfig

    def build(self, module: torch.nn.Module, samples: Sequence[Call], device: torch.device) -> Callable[..., Any]:
        return self.config.build(module, samples, device, lambda m, s: m)


register(TorchEagerBackend, devices=("cpu", "cuda", "xpu"), defaults={"cpu": 0, "cuda": 0, "xpu": 0},
         baseline=True, variants=(CHANNELS_LAST, *LOWER_PRECISION))
