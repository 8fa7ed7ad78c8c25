"""The backends torch-tweak knows. Each backend's file registers its class here, with what
generic code needs to know of it, so that no generic module names a concrete backend:

- devices: the device types it can run on (its unavailable() says why not, per machine);
- defaults: the device types on which it is a default backend, each with its place in that
  device's default order (tt.default_backends, lower first; the baseline is last);
- baseline: the backend HighestThroughputStrategy always measures (the module as it is);
- extra and packages: the optional install (``pip install torch-tweak[extra]``) and the
  distributions it brings, the first being the backend's own, whose version is part of a
  tuning-cache key (pyproject.toml's extras must name them: tests/test_backends.py checks);
- variants: what it offers to tt.tweak's effort= and precision= (backends.variants.Variant).

backends.BUILT_IN (the classes tt.load builds from a name in a file), default_backends,
the tuning cache's optional packages and the tests' lists of backends are read from here.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping

import torch

from .base import Backend
from .variants import Variant


@dataclasses.dataclass(frozen=True)
class Registration:
    """One built-in backend, as its file declares it (see the module docstring)."""

    cls: type[Backend]
    devices: tuple[str, ...]
    defaults: Mapping[str, int] = dataclasses.field(default_factory=dict)
    baseline: bool = False
    extra: str | None = None
    packages: tuple[str, ...] = ()
    variants: tuple[Variant, ...] = ()

    @property
    def name(self) -> str:
        return self.cls.name


_REGISTERED: dict[type[Backend], Registration] = {}


def register(cls: type[Backend], **declared: Any) -> type[Backend]:
    """Declares `cls` a built-in backend (keywords: Registration's fields); returns `cls`."""
    if not (isinstance(cls, type) and issubclass(cls, Backend)):
        raise TypeError(f"register takes a Backend subclass, got {cls!r}")
    if cls in _REGISTERED:
        raise ValueError(f"{cls.__name__} is registered twice")
    registration = Registration(cls, **declared)
    if registration.extra is not None and not registration.packages:
        raise ValueError(f"{cls.__name__}: an optional backend names the packages its extra installs")
    if not set(registration.defaults) <= set(registration.devices):
        raise ValueError(f"{cls.__name__}: a default on a device it does not run on")
    _REGISTERED[cls] = registration
    return cls


def registrations() -> list[Registration]:
    """Every registered backend, in the order they were registered."""
    return list(_REGISTERED.values())


def registration_of(cls: type) -> Registration | None:
    """The registration of `cls` or of the nearest registered class it derives from."""
    for base in getattr(cls, "__mro__", ()):
        if base in _REGISTERED:
            return _REGISTERED[base]
    return None


def built_in() -> tuple[type[Backend], ...]:
    return tuple(_REGISTERED)


def baseline() -> type[Backend]:
    return next(r.cls for r in _REGISTERED.values() if r.baseline)


def optional_packages() -> tuple[str, ...]:
    """The distribution of each backend on an optional install (the first of its packages)."""
    return tuple(r.packages[0] for r in _REGISTERED.values() if r.extra is not None)


def device_type(device: Any) -> str:
    try:
        return torch.device(device).type
    except (RuntimeError, TypeError) as exc:
        raise ValueError(f"unknown device {device!r}: {exc}") from None


def default_backends(device: Any) -> list[Backend]:
    """A new list of the default backends for `device`, in the order FirstWins tries them
    (each registration's place for the device; the baseline last)."""
    kind = device_type(device)
    chosen = [r for r in _REGISTERED.values() if kind in r.defaults]
    if not chosen:
        kinds = sorted({k for r in _REGISTERED.values() for k in r.defaults})
        named = ", ".join(repr(k) for k in kinds[:-1]) + f" or {kinds[-1]!r}" if len(kinds) > 1 else repr(kinds[0])
        raise ValueError(f"torch-tweak has no backends for device {kind!r}; use {named}")
    chosen.sort(key=lambda r: (r.baseline, r.defaults[kind]))
    return [r.cls() for r in chosen]
