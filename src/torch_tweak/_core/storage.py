"""Where torch-tweak keeps files, and how it writes and reads them safely.

The folder is ``$TORCH_TWEAK_CACHE``, else ``~/.cache/torch-tweak``: the tuning cache
(tuning_cache), the build logs (buildlog) and the isolation verdicts (verdicts) live there.
Writes are atomic (a temporary file, synced, then renamed); reads of files that anyone could
have put there are bounded and never block (open_regular, read_regular).

The folder may be shared by a team, so anyone who can write there can plant a symbolic link
at a path a teammate's next tweak writes. Every write and removal inside it (write_cached,
remove_cached, listed_cached) walks the folders below the root one by one without following
a link (the root itself is the user's choice, and may be one), creates its temporary file
anew (never through a link) and renames it over the final name, which replaces a link there
rather than writing through it; a folder on the way that is a link skips the write, with one
log line naming it. Text read from any file (a cache entry, a saved file,
a verdict) is shown only through printable, which no terminal obeys.

What decides whether native code runs in this process (an isolation verdict) is sealed with
a per-user key (seal, unseal): an HMAC-SHA256 with 32 random bytes kept in
``$XDG_CONFIG_HOME/torch-tweak/seal.key`` (else ``~/.config/torch-tweak/seal.key``), made
0600 at first use, outside the cache folder, which a team may share. A key file that is not
a regular file of this user's, readable by no one else, is not used: nothing is then sealed,
and nothing sealed is honoured.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import hmac
import logging
import os
import re
import secrets
import stat
import tempfile
import threading
from pathlib import Path
from typing import IO, Iterator

CACHE_ENV = "TORCH_TWEAK_CACHE"
KEY_NAME = "seal.key"
KEY_BYTES = 32
logger = logging.getLogger("torch_tweak")


def cache_dir() -> Path:
    """The cache folder (not created here)."""
    value = os.environ.get(CACHE_ENV)
    return Path(value).expanduser() if value else Path.home() / ".cache" / "torch-tweak"


class NotRegular(OSError):
    """A path that is not a regular file (a FIFO, a device, a folder), or one too large."""


@contextlib.contextmanager
def open_regular(path: Path | str, limit: int, dir_fd: int | None = None,
                 follow: bool = True) -> Iterator[tuple[IO[bytes], int]]:
    """(an unbuffered binary file, its size) of a regular file of at most `limit` bytes;
    NotRegular for anything else. Opened without blocking (a FIFO answers at once) and checked
    after opening (a link to /dev/zero is refused, not read). dir_fd: `path` is a name in that
    folder; follow=False: a link at `path` is refused (OSError), not followed."""
    nofollow = 0 if follow else getattr(os, "O_NOFOLLOW", 0)
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | nofollow | getattr(os, "O_CLOEXEC", 0), dir_fd=dir_fd)
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            kind = ("a folder" if stat.S_ISDIR(info.st_mode) else "a FIFO" if stat.S_ISFIFO(info.st_mode)
                    else "a device" if stat.S_ISCHR(info.st_mode) or stat.S_ISBLK(info.st_mode) else "a special file")
            raise NotRegular(f"{path} is {kind}, not a regular file")
        if info.st_size > limit:
            raise NotRegular(f"{path} is {info.st_size} bytes, more than the {limit} allowed here")
        f = os.fdopen(fd, "rb", buffering=0)
    except BaseException:
        os.close(fd)
        raise
    with f:
        yield f, info.st_size


def read_regular(path: Path | str, limit: int, dir_fd: int | None = None, follow: bool = True) -> bytes:
    """The bytes of a regular file of at most `limit` bytes (open_regular); reading stops
    past `limit` even if the file grows. For small files (JSON entries); archive.py reads
    a torch-tweak file without holding its bytes whole."""
    with open_regular(path, limit, dir_fd, follow) as (f, size):
        out = bytearray(size + 1)
        view = memoryview(out)
        total = 0
        while True:
            if total == len(out):
                if total > limit:
                    raise NotRegular(f"{path} grew past the {limit} bytes allowed here while it was read")
                view.release()
                out.extend(bytes(min(1 << 20, limit + 1 - total)))
                view = memoryview(out)
            got = f.readinto(view[total:])
            if not got:
                break
            total += got
        view.release()
        if total > limit:
            raise NotRegular(f"{path} grew past the {limit} bytes allowed here while it was read")
        del out[total:]
        return bytes(out)


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
    the mode a plain open() would give it (the umask, or the mode of the file it replaces).
    A symbolic link is written through, as open() writes: its target gets the new file and
    the link stays (a rename over the link would have replaced it with a file)."""
    if os.path.islink(path):
        path = Path(os.path.realpath(path))
    if os.path.isdir(path):  # found before anything is written (the rename would name the temporary file)
        raise IsADirectoryError(f"{path} is a folder: give the path of a file to write, e.g. {Path(path) / 'model.tt'}")
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


class Planted(OSError):
    """A folder inside torch-tweak's folder that is a symbolic link: perhaps someone else's,
    never written, read or removed through."""


_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
_FOLDER = os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | getattr(os, "O_NOFOLLOW", 0) | _CLOEXEC
_REPORTED: set[str] = set()
_REPORTED_LOCK = threading.Lock()


def _inside(path: Path) -> tuple[Path, tuple[str, ...]]:
    """(the cache folder, the names below it that lead to `path`); ValueError for a path that
    is not inside the folder, or whose names are not plain ones (no "..")."""
    root = cache_dir()
    parts = Path(path).relative_to(root).parts
    if not parts or any(p in (".", "..") or "/" in p or "\0" in p for p in parts):
        raise ValueError(f"{path} is not a file inside torch-tweak's folder {root}")
    return root, parts


def _walk(root: Path, names: tuple[str, ...], create: bool) -> int:
    """The descriptor of root/names..., each folder below the root opened without following a
    link (and made, when `create`, if missing); Planted for a link on the way,
    NotADirectoryError for a file there, FileNotFoundError for a missing one when not `create`."""
    if create:
        os.makedirs(root, exist_ok=True)  # the root and what leads to it: the user's choice
    fd = os.open(root, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | _CLOEXEC)
    try:
        for i, name in enumerate(names):
            try:
                if create:
                    with contextlib.suppress(FileExistsError):  # there already, or made meanwhile
                        os.mkdir(name, 0o777, dir_fd=fd)
                below = os.open(name, _FOLDER, dir_fd=fd)
            except OSError as exc:
                if exc.errno in (errno.ELOOP, errno.ENOTDIR, errno.EMLINK):
                    where = root.joinpath(*names[:i + 1])
                    if os.path.islink(where):
                        raise Planted(exc.errno, f"{where} is a symbolic link", str(where)) from None
                    raise NotADirectoryError(exc.errno, f"{where} is not a folder", str(where)) from None
                raise
            os.close(fd)
            fd = below
    except BaseException:
        os.close(fd)
        raise
    return fd


def _skipped(what: str, path: Path, exc: Planted) -> None:
    """One log line per planted path and process: what was not written, and why."""
    where = exc.filename or str(path)
    with _REPORTED_LOCK:
        if where in _REPORTED:
            return
        _REPORTED.add(where)
    logger.warning("torch-tweak did not write %s %s: %s, which torch-tweak never follows inside its folder "
                   "(someone who can write there may have put it there); remove it to have it written again",
                   what, printable(str(path)), printable(exc.strerror or str(exc)))


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]
    os.fsync(fd)


def write_cached(path: Path, data: bytes, what: str = "the file") -> bool:
    """Writes `data` to `path` inside the cache folder, atomically and never through a link
    planted there (see the module docs): a new temporary file in the final folder, synced, then
    renamed over the final name (a link there is replaced, never followed). False, with one log
    line, when a folder on the way is a link; other OSErrors (a file where a folder goes, a
    read-only folder) are raised."""
    root, parts = _inside(path)
    try:
        folder = _walk(root, parts[:-1], create=True)
    except Planted as exc:
        _skipped(what, path, exc)
        return False
    name = parts[-1]
    temporary = f".{name}.{secrets.token_hex(8)}.tmp"
    try:
        try:
            old = os.stat(name, dir_fd=folder, follow_symlinks=False)
            mode = stat.S_IMODE(old.st_mode) if stat.S_ISREG(old.st_mode) else 0o666 & ~_umask()
        except FileNotFoundError:
            mode = 0o666 & ~_umask()
        fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0) | _CLOEXEC,
                     mode, dir_fd=folder)
        try:
            os.fchmod(fd, mode)
            _write_all(fd, data)
        finally:
            os.close(fd)
        try:
            os.replace(temporary, name, src_dir_fd=folder, dst_dir_fd=folder)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(temporary, dir_fd=folder)
            raise
        with contextlib.suppress(OSError):  # the rename itself is durable once the folder is synced
            os.fsync(folder)
    finally:
        os.close(folder)
    return True


def read_cached(path: Path, limit: int) -> bytes:
    """The bytes of `path` inside the cache folder (read_regular), reached without following a
    link below the root: a link there, at the file or a folder on the way, is an OSError, so
    nothing a link names is read (and copied into the folder by a write that follows)."""
    root, parts = _inside(path)
    folder = _walk(root, parts[:-1], create=False)
    try:
        return read_regular(parts[-1], limit, dir_fd=folder, follow=False)
    finally:
        os.close(folder)


def remove_cached(path: Path) -> bool:
    """Removes `path` inside the cache folder (a link there is removed, not what it names; an
    empty folder too), never through a folder on the way that is a link; False when nothing
    was removed."""
    root, parts = _inside(path)
    try:
        folder = _walk(root, parts[:-1], create=False)
    except OSError:
        return False
    try:
        try:
            os.unlink(parts[-1], dir_fd=folder)
        except IsADirectoryError:
            os.rmdir(parts[-1], dir_fd=folder)
        except PermissionError:  # some systems answer so for a folder
            os.rmdir(parts[-1], dir_fd=folder)
    except OSError:
        return False
    finally:
        os.close(folder)
    return True


def listed_cached(folder: Path) -> list[str]:
    """The names in `folder` inside the cache folder, reached without following a link; empty
    when it is missing, a link or not a folder."""
    root, parts = _inside(folder)
    try:
        fd = _walk(root, parts, create=False)
    except OSError:
        return []
    try:
        return os.listdir(fd)
    except OSError:
        return []
    finally:
        os.close(fd)


_UNPRINTABLE = re.compile("[\x00-\x09\x0b-\x1f\x7f-\x9f\u061c\u200e\u200f\u2028-\u202e\u2066-\u2069"
                          "\ud800-\udfff]")


def printable(text: str) -> str:
    """`text` (from a file: a cache entry, a saved file, a verdict, a log) as it may reach a
    terminal or a log line: every control character (C0 but the newline, DEL, C1, so ESC and
    the sequences it starts), lone surrogate and direction override written as its escape
    ("\\x1b"), inert; anything not text is its repr."""
    if not isinstance(text, str):
        text = repr(text)
    return _UNPRINTABLE.sub(lambda m: ascii(m.group())[1:-1], text)


def key_path() -> Path:
    """The per-user key's file (see the module docs)."""
    base = os.environ.get("XDG_CONFIG_HOME")
    folder = Path(base).expanduser() if base and os.path.isabs(os.path.expanduser(base)) else Path.home() / ".config"
    return folder / "torch-tweak" / KEY_NAME


_KEYS: dict[str, bytes | None] = {}


def seal_key() -> bytes | None:
    """This user's sealing key, made at first use (0600, in a folder made 0700); None when it
    cannot be made or read, or its file is not a regular file of this user's that no one else
    can read or write (another user's key seals nothing of ours)."""
    path = key_path()
    if str(path) in _KEYS:
        return _KEYS[str(path)]
    key = None
    try:
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), 0o600)
        except FileExistsError:
            pass
        else:
            try:
                os.write(fd, secrets.token_bytes(KEY_BYTES))
                os.fsync(fd)
            finally:
                os.close(fd)
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0))
        try:
            info = os.fstat(fd)
            if (stat.S_ISREG(info.st_mode) and info.st_size == KEY_BYTES and not info.st_mode & 0o077
                    and (not hasattr(os, "getuid") or info.st_uid == os.getuid())):
                data = os.read(fd, KEY_BYTES + 1)
                key = data if len(data) == KEY_BYTES else None
        finally:
            os.close(fd)
    except OSError:
        key = None
    if key is not None:  # a key not found is looked for again (it may be made meanwhile)
        _KEYS[str(path)] = key
    return key


def seal(data: bytes) -> str | None:
    """The seal of `data` under this user's key (hex), or None when there is no key."""
    key = seal_key()
    return None if key is None else hmac.new(key, data, hashlib.sha256).hexdigest()


def unseal(data: bytes, found: object) -> bool:
    """Whether `found` is the seal of `data` under this user's key (False without a key)."""
    want = seal(data)
    return want is not None and isinstance(found, str) and hmac.compare_digest(want, found)
