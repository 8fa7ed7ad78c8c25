"""The build log kept for every module, signature and backend a tuning tries.

A build log is ``<cache>/logs/<model class>/<module path>/<signature key>/<backend>.log``
(``<cache>``: storage.cache_dir()): the outcome of the build and the correctness check,
the warnings and log records raised while it ran, and the traceback of its exception. The
root module's path is ``_root``.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import time
import traceback
import warnings
from pathlib import Path
from typing import Iterator

from .._core.storage import cache_dir, printable, write_cached


def _safe(part: str) -> str:
    safe = re.sub(r"[^A-Za-z0-9._+-]", "_", part)
    return "_" if safe in ("", ".", "..") else safe


def log_path(model_class: str, module_path: str, signature_key: str, backend: str) -> Path:
    return (cache_dir() / "logs" / _safe(model_class) / (_safe(module_path) if module_path else "_root")
            / _safe(signature_key) / f"{_safe(backend)}.log")


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        try:
            self.lines.append(f"{record.levelname} {record.name}: {record.getMessage()}")
        except Exception:  # a record whose message cannot be formatted is still a line
            self.lines.append(f"{record.levelname} {record.name}: {record.msg!r}")


class BuildLog:
    """What one build said; written to its file when the build ends."""

    def __init__(self, path: Path, title: str) -> None:
        self.path = path
        self.title = title
        self.outcome = ""
        self.notes: list[str] = []
        """What tuning did around the build: the isolated child, state it put back."""

    def write(self, lines: list[str], error: BaseException | None, seconds: float) -> None:
        text = [self.title, f"time: {seconds:.3f} s"]
        text.append(f"outcome: {self.outcome or ('failed' if error is not None else 'built')}")
        if self.notes:
            text.append("")
            text.append("notes:")
            text.extend(f"  {line}" for line in self.notes)
        if lines:
            text.append("")
            text.append("warnings and log records:")
            text.extend(f"  {line}" for line in lines)
        if error is not None:
            text.append("")
            text.extend(traceback.format_exception(type(error), error, error.__traceback__))
        body = "\n".join(printable(line.rstrip("\n")) for line in text) + "\n"
        try:  # never through a link planted in the folder (storage.write_cached)
            write_cached(self.path, body.encode("utf-8"), "the build log")
        except (OSError, ValueError) as exc:  # a read-only home must not fail a tuning
            warnings.warn(f"torch-tweak could not write the build log {self.path}: {exc}", stacklevel=3)


@contextlib.contextmanager
def capture_build(path: Path, title: str) -> Iterator[BuildLog]:
    """Captures warnings and WARNING+ log records of the build inside; writes the log at exit.

    Warnings are recorded, not shown, while the build runs; the exception, if any,
    propagates after it is written down.
    """
    log = BuildLog(path, title)
    handler = _Records()
    root = logging.getLogger()
    root.addHandler(handler)
    start = time.monotonic()
    error: BaseException | None = None
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                yield log
            except BaseException as exc:
                error = exc
                raise
            finally:
                root.removeHandler(handler)
    finally:
        # written once the capture is over, so a failure to write it warns the caller
        lines = [f"{w.category.__name__}: {w.message} ({os.path.basename(w.filename)}:{w.lineno})" for w in caught]
        log.write(lines + handler.lines, error, time.monotonic() - start)
