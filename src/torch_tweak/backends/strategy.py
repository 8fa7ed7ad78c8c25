"""Strategies: the rule that picks one backend for one module.

The decision rules themselves are the engine's (tw_strategy_choose); a strategy
here holds its backends and hands them to the engine as candidates.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

from .. import _C
from .axes import Axes
from .base import Backend
from . import registry
from .._core.shapes import Shapes


def default_backends(device: Any) -> list[Backend]:
    """A new list of the default backends for `device`, in the order FirstWins tries them.

    cpu: Torch Inductor, OpenVINO, Torch Eager. cuda: device graph, Torch Inductor, Inductor
    inside a device graph, padded graphs (calls whose sizes vary: backends/padded.py), Torch Eager.
    xpu: device graph, Torch Inductor, OpenVINO, Torch Eager.
    OpenVINO reports "not installed" when its package is missing, and strategies move on.
    TorchAO is never a default: quantization changes results. Each backend's registration says
    where it stands (torch_tweak.backends.registry).
    """
    return registry.default_backends(device)


class Strategy:
    """Picks a backend for one module from those that build and pass the check.

    A strategy given to tweak, wrap or tune is a template: it is copied per module
    with ``fresh()``, so no state leaks from one module to the next.
    """

    kind = ""
    axes: Axes | None = None
    """The variants this strategy adds to its backends (torch_tweak.backends.axes.Axes); None: none.
    tt.tweak sets it from effort= and precision=; with_axes() gives a copy with other axes."""
    shapes: Shapes | None = None
    """The declared ranges of the sizes that vary (tt.tweak's shapes=, torch_tweak._core.shapes): each
    backend is given them (Backend.for_shapes); with_shapes() gives a copy with others."""
    measures = False
    """True for a strategy that measures every candidate and keeps the fastest: only such a
    strategy can choose between variants of a backend."""

    def __init__(self, backends: Sequence[Backend] | None = None) -> None:
        if backends is not None:
            backends = list(backends)
            if not backends:
                raise ValueError(f"{type(self).__name__} needs at least one backend; pass None for the defaults")
            for backend in backends:
                if not isinstance(backend, Backend):
                    raise TypeError(f"{type(self).__name__}: {backend!r} is not a torch_tweak Backend")
        self.backends: list[Backend] | None = backends

    def check_device(self, device: Any) -> None:
        """Raises ValueError when a backend given to this strategy can never run on `device`."""
        for backend in self.backends or ():
            backend.check_device(torch.device(device))

    def candidates(self, device: torch.device) -> list[Backend]:
        """Fresh, unbuilt copies of this strategy's backends, and every variant its axes add
        to them (for any module: candidates_for keeps those that apply to one)."""
        return [b for b, _ in self._candidates(device)]

    def _bases(self, device: torch.device) -> list[Backend]:
        backends = self.backends if self.backends is not None else default_backends(device)
        if self.shapes is not None:
            return [b.fresh().for_shapes(self.shapes) for b in backends]
        return [b.fresh() for b in backends]

    def _candidates(self, device: torch.device) -> list[tuple[Backend, str]]:
        """(candidate, the rule of the modules it applies to; "" for every module)."""
        bases = self._bases(device)
        fresh = [(b, "") for b in bases]
        if not self.axes:
            return fresh
        return fresh + self.axes.variants(bases, torch.device(device))

    def candidates_for(self, module: torch.nn.Module, samples: Sequence[Any],
                       device: torch.device) -> list[Backend]:
        """The candidates for one module and its recorded calls: every backend, and the variants
        of the axes that apply to it (channels-last for a module with a Conv2d, an SDPA kernel
        for one that calls scaled_dot_product_attention, max-autotune for a heavy one...)."""
        return [b for b, _ in self.variants_marked_for(module, samples, device)]

    def variants_marked_for(self, module: torch.nn.Module, samples: Sequence[Any],
                            device: torch.device) -> list[tuple[Backend, bool]]:
        """candidates_for's list, each with whether it is a variant an axis added (effort or
        precision) rather than one of the strategy's backends: the backends come first."""
        if not self.axes:
            return [(b, False) for b in self.candidates(device)]
        return [(b, bool(rule)) for b, rule in self._candidates(device)
                if not rule or self.axes.applies(rule, module, samples)]

    def with_axes(self, axes: Axes | None) -> "Strategy":
        """A copy of this strategy that adds the variants of `axes` to its backends."""
        if axes and not self.measures:
            raise ValueError(f"{type(self).__name__} does not measure its candidates, so it cannot choose between "
                             "variants (effort, precision): use tt.HighestThroughputStrategy(...) or leave "
                             "strategy=None")
        clone = self.fresh()
        clone.axes = axes if axes else None
        return clone

    def with_shapes(self, shapes: Shapes | None) -> "Strategy":
        """A copy of this strategy whose backends serve the declared ranges `shapes`."""
        clone = self.fresh()
        clone.shapes = shapes
        return clone

    def fresh(self) -> "Strategy":
        clone = object.__new__(type(self))
        clone.__dict__.update(self.__dict__)
        clone.backends = None if self.backends is None else [b.fresh() for b in self.backends]
        return clone

    def __repr__(self) -> str:
        names = "defaults" if self.backends is None else ", ".join(b.name for b in self.backends)
        more = (f", axes={self.axes}" if self.axes else "") + (f", shapes={self.shapes}" if self.shapes else "")
        return f"{type(self).__name__}({names}{more})"


class FirstWinsStrategy(Strategy):
    """Keeps the first backend, in order, that builds and passes the correctness check."""

    kind = _C.default_tweak_config()["strategies"][0]  # the engine's names


class HighestThroughputStrategy(Strategy):
    """Builds and measures every backend (Torch Eager included) and keeps the fastest."""

    kind = _C.default_tweak_config()["strategies"][1]
    measures = True

    def _bases(self, device: torch.device) -> list[Backend]:
        backends = super()._bases(device)
        baseline = registry.baseline()  # Torch Eager: the module as it is
        if not any(isinstance(b, baseline) for b in backends):
            backends.append(baseline())
        return backends


class OneBackendStrategy(Strategy):
    """Uses one backend; the module keeps its original forward when that backend fails."""

    kind = _C.default_tweak_config()["strategies"][2]

    def __init__(self, backend: Backend) -> None:
        if isinstance(backend, (list, tuple)):
            raise TypeError("OneBackendStrategy takes one backend, not a list; use FirstWinsStrategy for several")
        super().__init__([backend])


def default_strategy(device: Any) -> Strategy:
    """HighestThroughputStrategy(default_backends(device)); a new instance on every call."""
    return HighestThroughputStrategy(default_backends(device))
