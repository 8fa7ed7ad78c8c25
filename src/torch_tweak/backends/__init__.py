"""Backends: each runs a module one way and has a config object."""

from .base import Backend, BackendConfig, BackendUnavailable
from .eager import TorchEagerBackend, TorchEagerBackendConfig
from .inductor import TorchInductorBackend, TorchInductorBackendConfig

__all__ = [
    "Backend",
    "BackendConfig",
    "BackendUnavailable",
    "TorchEagerBackend",
    "TorchEagerBackendConfig",
    "TorchInductorBackend",
    "TorchInductorBackendConfig",
]
