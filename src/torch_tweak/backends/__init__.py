"""Backends: each runs a module one way and has a config object."""

from .base import Backend, BackendConfig, BackendUnavailable
from .eager import TorchEagerBackend, TorchEagerBackendConfig
from .graph import (DeviceGraphBackend, DeviceGraphBackendConfig, InductorGraphBackend,
                    InductorGraphBackendConfig)
from .inductor import TorchInductorBackend, TorchInductorBackendConfig

__all__ = [
    "Backend",
    "BackendConfig",
    "BackendUnavailable",
    "DeviceGraphBackend",
    "DeviceGraphBackendConfig",
    "InductorGraphBackend",
    "InductorGraphBackendConfig",
    "TorchEagerBackend",
    "TorchEagerBackendConfig",
    "TorchInductorBackend",
    "TorchInductorBackendConfig",
]
