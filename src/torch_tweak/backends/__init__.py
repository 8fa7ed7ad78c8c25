"""Backends: each runs a module one way and has a config object."""

from .base import Backend, BackendConfig, BackendUnavailable
from .eager import TorchEagerBackend, TorchEagerBackendConfig
from .graph import (DeviceGraphBackend, DeviceGraphBackendConfig, InductorGraphBackend,
                    InductorGraphBackendConfig)
from .inductor import TorchInductorBackend, TorchInductorBackendConfig
from .openvino import OpenVINOBackend, OpenVINOBackendConfig
from .torchao import TorchAOBackend, TorchAOBackendConfig

__all__ = [
    "Backend",
    "BackendConfig",
    "BackendUnavailable",
    "DeviceGraphBackend",
    "DeviceGraphBackendConfig",
    "InductorGraphBackend",
    "InductorGraphBackendConfig",
    "OpenVINOBackend",
    "OpenVINOBackendConfig",
    "TorchAOBackend",
    "TorchAOBackendConfig",
    "TorchEagerBackend",
    "TorchEagerBackendConfig",
    "TorchInductorBackend",
    "TorchInductorBackendConfig",
]
