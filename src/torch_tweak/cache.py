"""The cache folder, and the build log kept there for every module, signature and backend.

The folder is ``$TORCH_TWEAK_CACHE``, else ``~/.cache/torch-tweak``. A build log is
``<cache>/logs/<model class>/<module path>/<signature key>/<backend>.log``: the outcome
of the build and the correctness check, the warnings and log records raised while it
ran, and the traceback of its exception. The root module's path is ``_root``.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import stat
import tempfile
import time
import traceback
import warnings
from pathlib import Path
from typing import IO, Iterator

CACHE_ENV = "TORCH_TWEAK_CACHE"


def cache_dir() -> Path:
    """The cache folder (not created here)."""
    value = os.environ.get(CACHE_ENV)
    return Path(value).expanduser() if value else Path.home() / ".cache" / "torch-tweak"


class NotRegular(OSError):
    """A path that is not a regular file (a FIFO, a device, a folder), or one too large."""


def read_regular(path: Path | str, limit: int) -> bytes:
    """The bytes of a regular file of at most `limit` bytes; NotRegular for anything else.

    Opened without blocking (a FIFO answers at once) and checked after opening (a link to
    /dev/zero is refused, not read); reading stops past `limit` even if the file grows."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            kind = ("a folder" if stat.S_ISDIR(info.st_mode) else "a FIFO" if stat.S_ISFIFO(info.st_mode)
                    else "a device" if stat.S_ISCHR(info.st_mode) or stat.S_ISBLK(info.st_mode) else "a special file")
            raise NotRegular(f"{path} is {kind}, not a regular file")
        if info.st_size > limit:
            raise NotRegular(f"{path} is {info.st_size} bytes, more than the {limit} allowed here")
        chunks, total = [], 0
        while True:
            chunk = os.read(fd, min(1 << 20, limit + 1 - total))
            if not chunk:
                break
            chunks.append(chunk)
            total += len(chunk)
            if total > limit:
                raise NotRegular(f"{path} grew past the {limit} bytes allowed here while it was read")
        return b"".join(chunks)
    finally:
        os.close(fd)


def _umask() -> int:
    """The process's umask, read without changing it where the system tells (Linux)."""
    try:
        with open("/proc/self/status", encoding="ascii", errors="replace") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    mask = os.umask(0o022)  # elsewhere: read by setting it, then put it back at once
    os.umask(mask)
    return mask


def _new_file_mode(path: Path) -> int:
    """The mode open() would give `path`: that of the file it replaces, else 0o666 less the umask."""
    try:
        return stat.S_IMODE(os.stat(path).st_mode)
    except OSError:
        return 0o666 & ~_umask()


@contextlib.contextmanager
def atomic_file(path: Path, mode: str = "wb", **open_args) -> Iterator[IO]:
    """A file to write `path` through: a temporary file in the same folder, flushed, synced
    and renamed over `path` when the block ends without an exception, removed when it
    raises. So an interrupted write leaves any earlier file at `path` intact. The file gets
    the mode a plain open() would give it (the umask, or the mode of the file it replaces)."""
    folder = path.parent if str(path.parent) else Path(".")
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=f".{path.name}.", suffix=".tmp")
    try:
        os.fchmod(fd, _new_file_mode(path))
        with os.fdopen(fd, mode, **open_args) as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    with contextlib.suppress(OSError):  # the rename itself is durable once the folder is synced
        dir_fd = os.open(folder, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)


def _safe(part: str) -> str:
    return re.sub(r"[^A-Za-z0-9._+-]", "_", part) or "_"


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
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self.path.write_text("\n".join(line.rstrip("\n") for line in text) + "\n", encoding="utf-8")
        except OSError as exc:  # a read-only home must not fail a tuning
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
