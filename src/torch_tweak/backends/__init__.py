"""Backends: each runs a module one way and has a config object."""

from .base import Backend, BackendConfig, BackendUnavailable
from .eager import TorchEagerBackend, TorchEagerBackendConfig
from .graph import (DeviceGraphBackend, DeviceGraphBackendConfig, InductorGraphBackend,
                    InductorGraphBackendConfig)
from .inductor import TorchInductorBackend, TorchInductorBackendConfig
from .onnxruntime import ONNXRuntimeBackend, ONNXRuntimeBackendConfig
from .openvino import OpenVINOBackend, OpenVINOBackendConfig
from .padded import PaddedGraphBackend, PaddedGraphBackendConfig
from .torchao import TorchAOBackend, TorchAOBackendConfig

BUILT_IN = (TorchEagerBackend, TorchInductorBackend, DeviceGraphBackend, InductorGraphBackend, OpenVINOBackend,
            TorchAOBackend, ONNXRuntimeBackend, PaddedGraphBackend)
"""torch-tweak's own backends: the only classes tt.load builds from a name in a file."""

__all__ = [
    "Backend",
    "BackendConfig",
    "BackendUnavailable",
    "DeviceGraphBackend",
    "DeviceGraphBackendConfig",
    "InductorGraphBackend",
    "InductorGraphBackendConfig",
    "ONNXRuntimeBackend",
    "ONNXRuntimeBackendConfig",
    "OpenVINOBackend",
    "OpenVINOBackendConfig",
    "PaddedGraphBackend",
    "PaddedGraphBackendConfig",
    "TorchAOBackend",
    "TorchAOBackendConfig",
    "TorchEagerBackend",
    "TorchEagerBackendConfig",
    "TorchInductorBackend",
    "TorchInductorBackendConfig",
]
