"""Torch Inductor: torch.compile with its modes and options."""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import sys
from typing import Any, Callable, Iterator, Sequence

import torch

from .._core._samples import Call
from .._core.schema import Flag, OneOf
from .base import Backend, NeedsStorableSamples
from .registry import register
from .variants import AUTOTUNE_MODE, CHANNELS_LAST, LOWER_PRECISION, MAX_AUTOTUNE, VariantConfig

MODES = (None, "default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")


@dataclasses.dataclass
class TorchInductorBackendConfig(VariantConfig):
    """The arguments of torch.compile: mode, options, dynamic, fullgraph; and the candidate's
    variant, memory_format, sdpa_kernel, tf32, autocast_dtype (backends.variants.VariantConfig).

    dynamic=None (the default) compiles static shapes for a module's recorded input
    signatures (tweak serves each one its own build) and lets torch decide for the "any
    other call" group, which serves calls of any shape."""

    mode: str | None = None
    options: dict[str, Any] | None = None
    dynamic: bool | None = None
    fullgraph: bool = False

    # options reach Inductor's compiler command lines: never taken from a file
    SCHEMA = {**VariantConfig.SCHEMA, "mode": OneOf(MODES), "dynamic": OneOf((None, True, False)),
              "fullgraph": Flag()}

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {', '.join(map(str, MODES))}; got {self.mode!r}")
        if self.mode is not None and self.options:
            raise ValueError("torch.compile takes either mode or options, not both")
        if self.options is not None and not isinstance(self.options, dict):
            raise ValueError(f"options must be a dict, got {type(self.options).__name__}")

    def own_label_parts(self) -> list[str]:
        return ["max-autotune"] if self.mode in ("max-autotune", AUTOTUNE_MODE) else []

    def takes_variants(self) -> bool:
        return super().takes_variants() and self.mode in (None, "default")


@dataclasses.dataclass
class _Scope:
    static: bool
    compiled: dict = dataclasses.field(default_factory=dict)


_SCOPE: contextvars.ContextVar[_Scope | None] = contextvars.ContextVar("torch_tweak_compiles", default=None)


@contextlib.contextmanager
def shared_compiles(static: bool) -> Iterator[None]:
    """Builds for one module and one input signature: within it, backends that compile the
    module with the same effective settings share one torch.compile (and one failure), so
    Inductor and Inductor-in-a-graph candidates compile it once, not twice.

    static: every call the builds will serve has the recorded shapes (the dispatcher routes
    only calls that fit the signature), so ``dynamic=None`` compiles with dynamic=False:
    no recompile with symbolic shapes when sibling modules of one class differ in size."""
    token = _SCOPE.set(_Scope(static))
    try:
        yield
    finally:
        _SCOPE.reset(token)


def _settings_key(module: torch.nn.Module, mode: str | None, options: dict | None, dynamic: bool | None,
                  fullgraph: bool, variant: tuple = ()) -> tuple:
    mode = None if mode == "default" else mode
    effective = dict(options or {})
    if mode is None:
        import torch._inductor.config as inductor_config
        effective.setdefault("triton.cudagraphs", bool(inductor_config.triton.cudagraphs))
    return (id(module), mode, repr(sorted(effective.items())), dynamic, bool(fullgraph), variant)


def _limit_names() -> list[str]:
    """Dynamo's per-code-object and accumulated recompile limits, by this torch's names."""
    import torch._dynamo.config as dynamo_config
    pairs = (("recompile_limit", "cache_size_limit"), ("accumulated_recompile_limit", "accumulated_cache_size_limit"))
    return [next(n for n in pair if hasattr(dynamo_config, n)) for pair in pairs
            if any(hasattr(dynamo_config, n) for n in pair)]


@contextlib.contextmanager
def _own_compile() -> Iterator[None]:
    """No recompile limit while tweak compiles one module for its recorded calls.

    Dynamo counts every compile of one forward (one module class) in the process against
    its limit (8); past it, it silently runs the eager code. Tweak compiles sibling modules
    of one class on their own (a ResNet's blocks of different sizes, a second tweak in the
    same process), so the limit would hand a module its eager code under the name Inductor.
    The compiles here are bounded (one per recorded call), and the limit is back as it was
    afterwards: a later call that misses every compiled entry still meets it."""
    import torch._dynamo.config as dynamo_config
    with dynamo_config.patch({name: sys.maxsize for name in _limit_names()}):
        yield


def compile_module(module: torch.nn.Module, samples: Sequence[Call], *, mode: str | None = None,
                   options: dict | None = None, dynamic: bool | None = None,
                   fullgraph: bool = False, variant: tuple = ()) -> Callable[..., Any]:
    """torch.compile(module, backend="inductor", ...) compiled now on every sample, so no
    compile lands in a measurement. Inside shared_compiles(), the same settings on the same
    module give the same compiled module (or raise the same error) without compiling
    again, and dynamic=None means dynamic=False for a static signature. variant: the axes
    the compile runs under (VariantConfig.label_parts), part of what must agree to share."""
    scope = _SCOPE.get()
    key = None
    if scope is not None:
        if dynamic is None and scope.static:
            dynamic = False
        key = _settings_key(module, mode, options, dynamic, fullgraph, variant)
        if key in scope.compiled:
            done = scope.compiled[key]
            if isinstance(done, BaseException):
                raise done
            return done
    compiled = torch.compile(module, backend="inductor", mode=mode, options=options, dynamic=dynamic,
                             fullgraph=fullgraph)
    try:
        with _own_compile():
            for args, kwargs in samples:
                compiled(*args, **kwargs)
    except Exception as exc:
        if key is not None:
            scope.compiled[key] = exc
        raise
    if key is not None:
        scope.compiled[key] = compiled
    return compiled


class TorchInductorBackend(NeedsStorableSamples, Backend):
    """Torch Inductor: torch.compile(module) with the config's mode, options, dynamic and
    fullgraph, compiled on every recorded call at build time so no compile lands in a
    measurement. Wins on fusible element-wise work; fails on code dynamo cannot trace."""

    name = "TorchInductor"
    config_class = TorchInductorBackendConfig
    writes_back = True  # torch.compile writes a mutated input back into the caller's tensor
    compiles_with_inductor = True
    build_scope = staticmethod(shared_compiles)

    def build(self, module: torch.nn.Module, samples: Sequence[Call], device: torch.device) -> Callable[..., Any]:
        cfg = self.config
        variant = tuple(cfg.label_parts())
        return cfg.build(module, samples, device, lambda m, s: compile_module(
            m, s, mode=cfg.mode, options=cfg.options, dynamic=cfg.dynamic, fullgraph=cfg.fullgraph, variant=variant))


register(TorchInductorBackend, devices=("cpu", "cuda", "xpu"), defaults={"cpu": 0, "cuda": 1, "xpu": 1},
         variants=(CHANNELS_LAST, MAX_AUTOTUNE, *LOWER_PRECISION))
