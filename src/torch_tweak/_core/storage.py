"""Where torch-tweak keeps files, and how it writes and reads them safely.

The folder is ``$TORCH_TWEAK_CACHE``, else ``~/.cache/torch-tweak``: the tuning cache
(tuning_cache), the build logs (buildlog) and the isolation verdicts (verdicts) live there.
Writes are atomic (a temporary file, synced, then renamed); reads of files that anyone could
have put there are bounded and never block (open_regular, read_regular).

What decides whether native code runs in this process (an isolation verdict) is sealed with
a per-user key (seal, unseal): an HMAC-SHA256 with 32 random bytes kept in
``$XDG_CONFIG_HOME/torch-tweak/seal.key`` (else ``~/.config/torch-tweak/seal.key``), made
0600 at first use, outside the cache folder, which a team may share. A key file that is not
a regular file of this user's, readable by no one else, is not used: nothing is then sealed,
and nothing sealed is honoured.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import os
import secrets
import stat
import tempfile
from pathlib import Path
from typing import IO, Iterator

CACHE_ENV = "TORCH_TWEAK_CACHE"
KEY_NAME = "seal.key"
KEY_BYTES = 32


def cache_dir() -> Path:
    """The cache folder (not created here)."""
    value = os.environ.get(CACHE_ENV)
    return Path(value).expanduser() if value else Path.home() / ".cache" / "torch-tweak"


class NotRegular(OSError):
    """A path that is not a regular file (a FIFO, a device, a folder), or one too large."""


@contextlib.contextmanager
def open_regular(path: Path | str, limit: int) -> Iterator[tuple[IO[bytes], int]]:
    """(an unbuffered binary file, its size) of a regular file of at most `limit` bytes;
    NotRegular for anything else. Opened without blocking (a FIFO answers at once) and checked
    after opening (a link to /dev/zero is refused, not read)."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
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


def read_regular(path: Path | str, limit: int) -> bytes:
    """The bytes of a regular file of at most `limit` bytes (open_regular); reading stops
    past `limit` even if the file grows. For small files (JSON entries); archive.py reads
    a torch-tweak file without holding its bytes whole."""
    with open_regular(path, limit) as (f, size):
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
