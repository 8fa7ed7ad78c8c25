"""Backends: each runs a module one way and has a config object.

Every module of this package but the support modules (``base``: the contract; ``variants``:
the variant fields; ``registry``; ``axes`` and ``strategy``: a module's candidates made of the
registrations) and the private helpers (a name starting with ``_``: ``_traced``, ``_ov_shapes``,
``_padded_buckets``, ``_ov_cache``) is one backend's file: it is imported here, registers its backend
(``registry.register``), and this package exports the registered class and its config class by
their names. Adding a backend is its file (with its registration) and its tests."""

import importlib
import pkgutil

from . import registry
from .._core.schema import Count, DType, Flag, Fraction, Name, OneOf, Supplied
from .base import Backend, BackendConfig, BackendUnavailable, ShapesVary
from .variants import VariantConfig

_SUPPORT = ("axes", "base", "registry", "strategy", "variants")
"""The modules every backend builds on, and those that make candidates of the backends; the
others are backends' files."""

for _module in sorted(m.name for m in pkgutil.iter_modules(__path__)):
    if _module not in _SUPPORT and not _module.startswith("_"):
        importlib.import_module(f"{__name__}.{_module}")

BUILT_IN = registry.built_in()
"""torch-tweak's own backends: the only classes tt.load builds from a name in a file."""

for _cls in BUILT_IN:
    globals()[_cls.__name__] = _cls
    globals()[_cls.config_class.__name__] = _cls.config_class

__all__ = sorted(["Backend", "BackendConfig", "BackendUnavailable", "ShapesVary", "VariantConfig",
                  "Count", "DType", "Flag", "Fraction", "Name", "OneOf", "Supplied",  # a config's SCHEMA
                  *(c.__name__ for c in BUILT_IN), *(c.config_class.__name__ for c in BUILT_IN)])
"""The base classes every backend builds on, the specs of a config's SCHEMA, and each built-in
backend with its config class."""
