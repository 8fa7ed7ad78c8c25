"""What a saved file or a tuning-cache entry may say about a backend config: a closed schema.

Every config class declares ``SCHEMA``, one ``Spec`` per field it lets a file carry: its
type and its range. A value its spec accepts is stored as it is; any other value (free-form
options that reach a compiler or a runtime, a field the class left out of its schema, a
value outside the declared range) is stored only as a fingerprint, and tt.load takes it from
the caller, never from the file (docs/deployment.md).
"""

from __future__ import annotations

import abc
import hashlib
import json
import math
import re
from typing import Any, Iterable

import torch


class Spec(abc.ABC):
    """What one stored config field may hold."""

    @abc.abstractmethod
    def accepts(self, value: Any) -> bool:
        """Whether a file may hold `value` as it is."""

    @abc.abstractmethod
    def describe(self) -> str:
        """What it accepts, for an error message."""


class OneOf(Spec):
    """One of a fixed set of plain values (strings, None)."""

    def __init__(self, values: Iterable[Any]) -> None:
        self.values = tuple(values)

    def accepts(self, value: Any) -> bool:
        return any(type(value) is type(v) and value == v for v in self.values)

    def describe(self) -> str:
        return "one of " + ", ".join(map(repr, self.values))


class Flag(Spec):
    def accepts(self, value: Any) -> bool:
        return type(value) is bool

    def describe(self) -> str:
        return "True or False"


class Count(Spec):
    """An int (not a bool) from lo to hi, or None when optional."""

    def __init__(self, lo: int, hi: int, optional: bool = False) -> None:
        self.lo, self.hi, self.optional = lo, hi, optional

    def accepts(self, value: Any) -> bool:
        if value is None:
            return self.optional
        return type(value) is int and self.lo <= value <= self.hi

    def describe(self) -> str:
        return f"an int from {self.lo} to {self.hi}" + (" or None" if self.optional else "")


class Fraction(Spec):
    """A finite number from lo to hi, or None when optional."""

    def __init__(self, lo: float, hi: float, optional: bool = True) -> None:
        self.lo, self.hi, self.optional = lo, hi, optional

    def accepts(self, value: Any) -> bool:
        if value is None:
            return self.optional
        return type(value) in (int, float) and math.isfinite(value) and self.lo <= value <= self.hi

    def describe(self) -> str:
        return f"a number from {self.lo} to {self.hi}" + (" or None" if self.optional else "")


class Name(Spec):
    """A short string matching a pattern, or None."""

    def __init__(self, pattern: str) -> None:
        self.pattern = re.compile(pattern)

    def accepts(self, value: Any) -> bool:
        return value is None or (type(value) is str and len(value) <= 64 and self.pattern.fullmatch(value) is not None)

    def describe(self) -> str:
        return f"None or a name matching {self.pattern.pattern}"


class DType(Spec):
    """One of some torch dtypes, or None."""

    def __init__(self, dtypes: Iterable[torch.dtype]) -> None:
        self.dtypes = tuple(dtypes)

    def accepts(self, value: Any) -> bool:
        return value is None or (isinstance(value, torch.dtype) and value in self.dtypes)

    def describe(self) -> str:
        return "None or one of " + ", ".join(str(d).removeprefix("torch.") for d in self.dtypes)


class Supplied(Spec):
    """A free-form value (compiler options, runtime properties): a file may hold only its
    absence (None or empty); any other value is stored as a fingerprint and must come
    from the caller."""

    def accepts(self, value: Any) -> bool:
        return value is None or (type(value) in (dict, list, tuple) and len(value) == 0)

    def describe(self) -> str:
        return "given by the caller"


SUPPLIED = Supplied()
"""The spec of every field a config class leaves out of its SCHEMA."""

FINGERPRINT = "fingerprint"


def fingerprint(value: Any) -> str:
    """A stable hash of a config value: what a file keeps of a value it may not hold."""
    try:
        text = json.dumps(value, sort_keys=True, default=repr, allow_nan=True)
    except (TypeError, ValueError):  # keys that are not strings, say
        text = repr(value)
    return hashlib.sha256(text.encode("utf-8", "replace")).hexdigest()[:32]


def spec_of(config_class: type, name: str) -> Spec:
    return getattr(config_class, "SCHEMA", {}).get(name, SUPPLIED)


def is_fingerprint(tree: Any) -> bool:
    return type(tree) is dict and len(tree) == 1 and type(tree.get(FINGERPRINT)) is str
