"""Torch Eager: the module as it is, optionally under autocast. The baseline of the others."""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Sequence

import torch
import torch.utils._pytree as pytree

from .._samples import Call
from ..correctness import tolerance_for
from ..schema import DType
from .base import Backend, BackendConfig


@dataclasses.dataclass
class TorchEagerBackendConfig(BackendConfig):
    """autocast_dtype: run under torch.autocast with this dtype (None: no autocast)."""

    autocast_dtype: torch.dtype | None = None

    SCHEMA = {**BackendConfig.SCHEMA, "autocast_dtype": DType((torch.float16, torch.bfloat16))}

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.autocast_dtype is not None and not isinstance(self.autocast_dtype, torch.dtype):
            raise ValueError(f"autocast_dtype must be a torch.dtype, got {self.autocast_dtype!r}")


class TorchEagerBackend(Backend):
    """The module as it is. Under ``autocast_dtype`` its floating outputs are cast back to
    the dtypes the module gives without autocast, so the code around it sees what it saw
    before; the check then uses that dtype's tolerance (unless the config sets one)."""

    name = "TorchEager"
    config_class = TorchEagerBackendConfig

    def check_tolerance(self) -> float | None:
        dtype = self.config.autocast_dtype
        if self.config.tolerance is None and dtype is not None:
            return tolerance_for(dtype)
        return self.config.tolerance

    def build(self, module: torch.nn.Module, samples: Sequence[Call], device: torch.device) -> Callable[..., Any]:
        dtype = self.config.autocast_dtype
        if dtype is None:
            return module
        args, kwargs = samples[0]
        with torch.no_grad():
            plain = [t.dtype if isinstance(t, torch.Tensor) else None
                     for t in pytree.tree_leaves(module(*args, **kwargs))]

        def run(*args: Any, **kwargs: Any) -> Any:
            with torch.autocast(device.type, dtype=dtype):
                out = module(*args, **kwargs)
            leaves, spec = pytree.tree_flatten(out)
            if len(leaves) == len(plain):
                leaves = [t.to(want) if isinstance(t, torch.Tensor) and want is not None and t.dtype != want
                          and t.is_floating_point() else t for t, want in zip(leaves, plain)]
            return pytree.tree_unflatten(leaves, spec)

        return run
