"""torch-tweak: automatic inference tuning for PyTorch.

    import torch_tweak as tt
    result = tt.tweak(model, dataset)   # tunes `model` in place, keeps the fastest cut
    print(result)

The engine and every per-call path are C (torch_tweak._C); this package is the
door into torch.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from . import backends, results
from .backends.axes import Axes, precision_backends
from .backends import Backend, BackendConfig
from ._store.checkpoint import CheckpointError, load, read_summary, save
from ._core import settings
from ._runtime.inspecting import inspect
from ._runtime.module import TunedModule, install_all, installed, resolve_paths, set_mode, unwrap
from .backends.strategy import (FirstWinsStrategy, HighestThroughputStrategy, OneBackendStrategy, Strategy,
                                default_backends, default_strategy)
from ._search.tuning import tune
from ._store.tuning_cache import clear_cache
from ._view.status import status
from .tweak import tweak
# the result types, at the top of the package as before: aliases of tt.results' names, kept for one release
from .results import (DepthResult, ModelStatus, ModuleResult, ModuleResults, ModuleStatus,  # noqa: F401
                      ModuleTree, SignatureResult, TweakResult)
from ._version import __version__

TOLERANCES = settings.TOLERANCES  # the same dict: tt.TOLERANCES[dtype] = ... is seen by every check


def wrap(model: nn.Module, modules: Any, *, strategy: Strategy | None = None) -> list[TunedModule]:
    """Gives each given module (paths or module objects) a tuned-module wrapper, in place:
    the module stays the same object where it is, and its calls (also through a reference
    taken before) go to the wrapper.

    The wrappers run the original forward until tt.tune tunes them. Every path is
    checked before anything changes. Returns the wrappers, in the order given.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, not {type(model).__name__}")
    if strategy is not None and not isinstance(strategy, Strategy):
        raise TypeError(f"strategy must be a torch_tweak strategy, not {type(strategy).__name__}")
    wrappers = install_all(model, resolve_paths(model, modules))
    for wrapper in wrappers:
        wrapper.__dict__["tt_strategy"] = strategy
    return wrappers


def activate(model: nn.Module) -> int:
    """Switches every tuned wrapper of `model` to its backend; returns how many."""
    return set_mode(model, True)


def deactivate(model: nn.Module) -> int:
    """Switches every tuned wrapper of `model` back to its original forward; returns how many."""
    return set_mode(model, False)


__all__ = [
    "Axes", "Backend", "BackendConfig", "CheckpointError", "FirstWinsStrategy", "HighestThroughputStrategy",
    "OneBackendStrategy", "Strategy", "TOLERANCES", "TunedModule", "activate", "backends", "clear_cache",
    "deactivate", "default_backends", "default_strategy", "inspect", "installed", "load", "precision_backends",
    "read_summary", "results", "save", "settings", "status", "tune", "tweak", "unwrap", "wrap",
]
"""What users name. The result types live in tt.results (their names at the top are aliases kept for
one release, left out of dir(tt))."""


def __dir__() -> list[str]:
    """The public API only (dir(tt) and completion), not the names this module imports."""
    return sorted(__all__ + ["__version__"])
