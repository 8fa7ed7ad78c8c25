"""A bounded reader of the zip archives tt.save writes (checkpoint.py decides what they hold).

Python's zipfile builds an object for every entry its central directory declares before a
caller can look at one (a file of a few MiB can declare a million), and reading through it
copies each member's bytes more than once. This reader:

- finds the end-of-central-directory record (zip64 too) at the file's very end, and refuses a
  directory of more than `max_entries` entries or `max_directory_bytes` bytes from that
  record alone, before anything is read or built;
- parses each directory entry (name, flags, method, CRC, sizes, local header offset) and
  checks its local header against it; members must follow each other with no gap and no
  overlap, and the directory must follow the last one: the layout zipfile writes;
- reads the file once, in order, every byte exactly once: each member's bytes go straight
  to the place its Sink gives them (a capped inflater for JSON, the tensors' own memory for
  safetensors, nothing for a member only hashed), and every byte into the sha256 (and the
  HMAC) of the file's body. Bytes read while parsing (headers, directory) are read again in
  that pass and must be the same: what is checked is what is used, even if the file changes.

So reading a file costs its members' kept bytes plus constant buffers, never a copy of the
whole file. Errors are ArchiveError (a ValueError) saying what is wrong, without the path.
"""

from __future__ import annotations

import abc
import ctypes
import hashlib
import hmac
import json
import os
import struct
import sys
import zlib
from dataclasses import dataclass, field
from typing import Callable, Mapping

import torch

from .._core import settings
from .._core.storage import open_regular

_EOCD = struct.Struct("<4s4H2LH")
_EOCD64 = struct.Struct("<4sQ2H2L4Q")
_LOCATOR = struct.Struct("<4sLQL")
_CENTRAL = struct.Struct("<4s4B4HL2L5H2L")
_LOCAL = struct.Struct("<4s2B4HL2L2H")
_MAX_COMMENT = 0xFFFF


class ArchiveError(ValueError):
    """A file that is not a zip archive of the shape tt.save writes, or that is damaged."""


class TooLarge(ArchiveError):
    """A zip directory with more entries or bytes than allowed: refused from its end record."""


@dataclass
class Entry:
    """One member as its central directory and local header declare it."""

    name: str
    flags: int
    method: int
    crc: int
    compressed: int
    size: int
    header_offset: int
    header: bytes = b""  # the local header's bytes, name and extra field included
    data_offset: int = 0


@dataclass
class Read:
    """What a pass over the file found: the comment, the sha256 (and HMAC-SHA256 with a key)
    of every byte before it, per member the sha256 of its (inflated) bytes and what its sink
    kept, and the members whose sink refused their content (raised once the caller has
    checked the hashes: a damaged file is reported as damaged first)."""

    comment: bytes
    names: list[str]
    body_sha256: str
    body_hmac: str | None
    digests: dict[str, str] = field(default_factory=dict)
    values: dict[str, object] = field(default_factory=dict)
    errors: dict[str, str] = field(default_factory=dict)


class Sink(abc.ABC):
    """Where one member's bytes go. `take(fill, entry)` is called once per member; fill(view)
    reads the next len(view) bytes of the member's (inflated) content into `view`, hashing
    them, and raises ArchiveError past its end; `take` returns what the caller keeps.
    After `take` returns, the rest of the member is read and hashed, and must be empty when
    the sink says it reads the whole member (exact)."""

    exact = True

    @abc.abstractmethod
    def take(self, fill: Callable[[memoryview], None], entry: Entry) -> object:
        """What the caller keeps of the member."""


class Skip(Sink):
    """Hashes the member, keeps nothing."""

    exact = False

    def take(self, fill, entry):
        return None


def read(path: str | os.PathLike, limit: int, sinks: Mapping[str, Sink], *, max_entries: int,
         max_directory_bytes: int, methods: Callable[[str], tuple[int, ...]],
         key: bytes | None = None) -> Read:
    """Reads the zip archive at `path` (a regular file of at most `limit` bytes, else
    storage.NotRegular) whose member names are the keys of `sinks`, each member's content
    going to its sink. methods(name): the compression methods allowed for that member
    (0 stored, 8 deflated). ArchiveError for anything else."""
    with open_regular(path, limit) as (f, size):
        comment, entries, tail = _layout(f, size, max_entries, max_directory_bytes)
        for entry in entries:
            if entry.name not in sinks:
                raise ArchiveError(f"it holds {entry.name[:60]!r}, which tt.save never writes (its members are "
                                   "not the ones its manifest lists)")
            if entry.method not in methods(entry.name) or entry.flags & ~0x0806:
                raise ArchiveError(f"{entry.name} is encrypted or compressed in a way tt.save never uses")
        return _pass(f, size, comment, entries, tail, sinks, key)


# ------------------------------------------------------------------ layout


def _pread(f, offset: int, length: int) -> bytes:
    data = os.pread(f.fileno(), length, offset)
    if len(data) != length:
        raise ArchiveError("it is shorter than its zip directory says (truncated while read?)")
    return data


def _layout(f, size: int, max_entries: int, max_directory_bytes: int) -> tuple[bytes, list[Entry], tuple]:
    """(the comment, the entries in file order, (offset of the directory, the bytes from
    there to the end)): the archive's end record, directory and local headers, checked."""
    if size < _EOCD.size:
        raise ArchiveError(f"it is {size} bytes, too short for a zip archive")
    window = _pread(f, size - min(size, _EOCD.size + _MAX_COMMENT), min(size, _EOCD.size + _MAX_COMMENT))
    at = len(window)
    while True:  # the last end record whose comment ends exactly at the file's end
        at = window.rfind(b"PK\x05\x06", 0, at)
        if at < 0:
            raise ArchiveError("it has no zip end record at its end (not a zip archive, or truncated)")
        if at + _EOCD.size <= len(window) and _EOCD.unpack_from(window, at)[-1] == len(window) - at - _EOCD.size:
            break
    end_at = size - (len(window) - at)
    _, disk, cd_disk, on_disk, count, cd_size, cd_offset, clen = _EOCD.unpack_from(window, at)
    comment = window[at + _EOCD.size:]
    directory_end = end_at
    if 0xFFFF in (disk, cd_disk, on_disk, count) or 0xFFFFFFFF in (cd_size, cd_offset):
        if end_at < _LOCATOR.size:
            raise ArchiveError("its zip64 end record is missing")
        sig, disk64, at64, disks = _LOCATOR.unpack(_pread(f, end_at - _LOCATOR.size, _LOCATOR.size))
        if sig != b"PK\x06\x07" or disk64 != 0 or disks != 1 or at64 + _EOCD64.size != end_at - _LOCATOR.size:
            raise ArchiveError("its zip64 end record locator is damaged")
        (sig, record, _, _, disk, cd_disk, on_disk, count, cd_size, cd_offset) = _EOCD64.unpack(
            _pread(f, at64, _EOCD64.size))
        if sig != b"PK\x06\x06" or record != _EOCD64.size - 12:
            raise ArchiveError("its zip64 end record is damaged")
        directory_end = at64
    if disk != 0 or cd_disk != 0 or on_disk != count:
        raise ArchiveError("it spans several disks, which tt.save never writes")
    if count > max_entries:
        raise TooLarge(f"its zip directory declares {count} entries; tt.save writes at most {max_entries}")
    if cd_size > max_directory_bytes:
        raise TooLarge(f"its zip directory is {cd_size} bytes; tt.save's is at most {max_directory_bytes}")
    if cd_offset + cd_size != directory_end:
        raise ArchiveError("its zip directory is not where its end record says")
    directory = _pread(f, cd_offset, cd_size)
    entries = _entries(directory, count)
    entries.sort(key=lambda e: e.header_offset)
    at = 0
    for entry in entries:
        if entry.header_offset != at:
            raise ArchiveError(f"{entry.name} is not where the previous member ends (a gap or an overlap)")
        _local(f, entry, cd_offset)
        at = entry.data_offset + entry.compressed
    if at != cd_offset:
        raise ArchiveError("its zip directory does not follow its last member")
    return comment, entries, (cd_offset, _pread(f, cd_offset, size - cd_offset))


def _entries(directory: bytes, count: int) -> list[Entry]:
    entries, at, seen = [], 0, set()
    for _ in range(count):
        if at + _CENTRAL.size > len(directory):
            raise ArchiveError("its zip directory is shorter than its entry count")
        (sig, _, _, _, _, flags, method, _, _, crc, compressed, size, nlen, elen, clen, disk, _, _,
         offset) = _CENTRAL.unpack_from(directory, at)
        if sig != b"PK\x01\x02" or disk != 0:
            raise ArchiveError("its zip directory is damaged")
        start = at + _CENTRAL.size
        at = start + nlen + elen + clen
        if at > len(directory):
            raise ArchiveError("its zip directory is damaged (an entry runs past its end)")
        name = _name(directory[start:start + nlen])
        if name in seen:
            raise ArchiveError(f"a member appears twice ({name[:60]!r})")
        seen.add(name)
        size, compressed, offset = _zip64(directory[start + nlen:start + nlen + elen], name,
                                          (size, compressed, offset))
        entries.append(Entry(name, flags, method, crc, compressed, size, offset))
    if at != len(directory):
        raise ArchiveError("its zip directory holds more than its entries")
    return entries


def _name(raw: bytes) -> str:
    try:
        name = raw.decode("ascii")
    except UnicodeDecodeError:
        raise ArchiveError(f"it holds a member whose name is not plain text ({raw[:40]!r})") from None
    if not name.isprintable():
        raise ArchiveError(f"it holds a member whose name is not plain text ({name[:40]!r})")
    return name


def _zip64(extra: bytes, name: str, values: tuple[int, ...]) -> tuple[int, ...]:
    """The entry's sizes (and offset) with those set to 0xFFFFFFFF read from its zip64 extra field."""
    wanted = [i for i, v in enumerate(values) if v == 0xFFFFFFFF]
    found = None
    at = 0
    while at < len(extra):
        if at + 4 > len(extra):
            raise ArchiveError(f"{name}: its extra field is damaged")
        tag, length = struct.unpack_from("<2H", extra, at)
        if at + 4 + length > len(extra):
            raise ArchiveError(f"{name}: its extra field is damaged")
        if tag == 1:
            if found is not None:
                raise ArchiveError(f"{name}: two zip64 extra fields")
            found = extra[at + 4:at + 4 + length]
        at += 4 + length
    if not wanted:
        return values
    if found is None or len(found) < 8 * len(wanted):
        raise ArchiveError(f"{name}: its zip64 sizes are missing")
    out = list(values)
    for k, i in enumerate(wanted):
        out[i] = struct.unpack_from("<Q", found, 8 * k)[0]
    return tuple(out)


def _local(f, entry: Entry, limit: int) -> None:
    """Reads and checks the entry's local header: the directory's name, flags, method, CRC and sizes."""
    if entry.header_offset + _LOCAL.size > limit:
        raise ArchiveError(f"{entry.name}'s local header is past the zip directory")
    fixed = _pread(f, entry.header_offset, _LOCAL.size)
    sig, _, _, flags, method, _, _, crc, compressed, size, nlen, elen = _LOCAL.unpack(fixed)
    if sig != b"PK\x03\x04" or entry.header_offset + _LOCAL.size + nlen + elen > limit:
        raise ArchiveError(f"{entry.name}'s local header is damaged")
    rest = _pread(f, entry.header_offset + _LOCAL.size, nlen + elen)
    size, compressed = _zip64(rest[nlen:], entry.name, (size, compressed))
    if (rest[:nlen] != entry.name.encode("ascii") or flags != entry.flags or method != entry.method
            or crc != entry.crc or size != entry.size or compressed != entry.compressed):
        raise ArchiveError(f"{entry.name}'s local header does not match the zip directory")
    entry.header = fixed + rest
    entry.data_offset = entry.header_offset + len(entry.header)
    if entry.method == 0 and entry.size != entry.compressed:
        raise ArchiveError(f"{entry.name} is stored with two sizes")
    if entry.data_offset + entry.compressed > limit:
        raise ArchiveError(f"{entry.name} runs past the zip directory")


# ------------------------------------------------------------------ the pass


class _Hashes:
    def __init__(self, key: bytes | None) -> None:
        self.sha = hashlib.sha256()
        self.mac = None if key is None else hmac.new(key, digestmod=hashlib.sha256)

    def update(self, data) -> None:
        self.sha.update(data)
        if self.mac is not None:
            self.mac.update(data)


def _read_exact(f, view: memoryview) -> None:
    done = 0
    while done < len(view):
        got = f.readinto(view[done:])
        if not got:
            raise ArchiveError("it is shorter than its zip directory says (truncated while read?)")
        done += got


def _pass(f, size: int, comment: bytes, entries: list[Entry], tail: tuple[int, bytes],
          sinks: Mapping[str, Sink], key: bytes | None) -> Read:
    f.seek(0)
    body = _Hashes(key)
    body_end = size - len(comment)
    result = Read(comment, [e.name for e in entries], "", None)
    for entry in entries:
        header = bytearray(len(entry.header))
        _read_exact(f, memoryview(header))
        if header != entry.header:
            raise ArchiveError(f"{entry.name}'s local header changed while it was read")
        body.update(header)
        member = _Member(f, entry, body)
        try:
            result.values[entry.name] = sinks[entry.name].take(member.fill, entry)
            member.finish(sinks[entry.name].exact)
        except ArchiveError as exc:
            result.errors[entry.name] = str(exc)
            member.drain()
            continue
        result.digests[entry.name] = member.sha.hexdigest()
    cd_offset, rest = tail
    again = bytearray(len(rest))
    _read_exact(f, memoryview(again))
    if again != rest:
        raise ArchiveError("its zip directory changed while it was read")
    body.update(memoryview(again)[:body_end - cd_offset])
    result.body_sha256 = body.sha.hexdigest()
    result.body_hmac = None if body.mac is None else body.mac.hexdigest()
    return result


class _Member:
    """One member's content, read in order from the file (inflated when deflated), hashed."""

    def __init__(self, f, entry: Entry, body: _Hashes) -> None:
        self.f, self.entry, self.body = f, entry, body
        self.raw_left = entry.compressed  # bytes of the file still to read
        self.out = 0  # content bytes given so far
        self.sha = hashlib.sha256()
        self.crc = 0
        self.inflater = zlib.decompressobj(-15) if entry.method == 8 else None
        self.pending = b""  # inflated bytes not given yet

    def _raw(self, view: memoryview) -> None:
        _read_exact(self.f, view)
        self.body.update(view)
        self.raw_left -= len(view)

    def _content(self, data) -> None:
        self.sha.update(data)
        self.crc = zlib.crc32(data, self.crc)
        self.out += len(data)

    def fill(self, view: memoryview) -> None:
        if self.out + len(view) > self.entry.size:
            raise ArchiveError(f"{self.entry.name} holds fewer bytes than its content needs")
        if self.inflater is None:
            self._raw(view)
            self._content(view)
            return
        done = 0
        while done < len(view):
            if not self.pending:
                self.pending = self._inflate(len(view) - done)
                if not self.pending:
                    raise ArchiveError(f"{self.entry.name} inflates to fewer bytes than its directory says")
            take = self.pending[:len(view) - done]
            view[done:done + len(take)] = take
            self._content(take)
            self.pending = self.pending[len(take):]
            done += len(take)

    def _inflate(self, want: int) -> bytes:
        """The next inflated bytes (at most ARCHIVE_CHUNK_BYTES), b"" once the stream has ended."""
        while not self.inflater.eof:
            if self.inflater.unconsumed_tail:
                chunk = self.inflater.unconsumed_tail
            elif self.raw_left:
                buffer = bytearray(min(settings.ARCHIVE_CHUNK_BYTES, self.raw_left))
                self._raw(memoryview(buffer))
                chunk = bytes(buffer)
            else:
                raise ArchiveError(f"{self.entry.name} is truncated or damaged (its compressed data ends early)")
            try:
                out = self.inflater.decompress(chunk, min(max(want, 1), settings.ARCHIVE_CHUNK_BYTES))
            except zlib.error as exc:
                raise ArchiveError(f"{self.entry.name} is damaged: {exc}") from None
            if out:
                return out
        return b""

    def finish(self, exact: bool) -> None:
        """Reads the rest of the member, hashing it; when exact, there must be none. Then
        its size and CRC-32 must be its directory's."""
        if self.inflater is None:
            if exact and self.raw_left:
                raise ArchiveError(f"{self.entry.name} holds more bytes than its content")
            buffer = bytearray(min(settings.ARCHIVE_CHUNK_BYTES, self.raw_left))
            while self.raw_left:
                view = memoryview(buffer)[:min(settings.ARCHIVE_CHUNK_BYTES, self.raw_left)]
                self._raw(view)
                self._content(view)
        else:
            while True:
                if self.pending:
                    if exact or self.out + len(self.pending) > self.entry.size:
                        raise ArchiveError(f"{self.entry.name} inflates to more than its directory's "
                                           f"{self.entry.size} bytes")
                    self._content(self.pending)
                self.pending = self._inflate(settings.ARCHIVE_CHUNK_BYTES)
                if not self.pending:
                    break
            if self.raw_left or self.inflater.unused_data:
                raise ArchiveError(f"{self.entry.name} is damaged (bytes follow its compressed data)")
        if self.out != self.entry.size or self.crc != self.entry.crc:
            raise ArchiveError(f"{self.entry.name} is damaged (its size or CRC-32 is not its directory's)")

    def drain(self) -> None:
        """Reads the rest of the member's bytes into the file's hash only (its content was refused)."""
        buffer = bytearray(min(settings.ARCHIVE_CHUNK_BYTES, self.raw_left))
        while self.raw_left:
            self._raw(memoryview(buffer)[:min(settings.ARCHIVE_CHUNK_BYTES, self.raw_left)])


# ------------------------------------------------------------------ safetensors


DTYPES = {name: getattr(torch, attr) for name, attr in (
    ("F64", "float64"), ("F32", "float32"), ("F16", "float16"), ("BF16", "bfloat16"), ("I64", "int64"),
    ("I32", "int32"), ("I16", "int16"), ("I8", "int8"), ("U8", "uint8"), ("BOOL", "bool"),
    ("F8_E4M3", "float8_e4m3fn"), ("F8_E5M2", "float8_e5m2"), ("C64", "complex64"), ("U64", "uint64"),
    ("U32", "uint32"), ("U16", "uint16")) if hasattr(torch, attr)}
"""The safetensors dtypes a stored tensor may have (those safetensors.torch.save writes)."""


class Tensors(Sink):
    """A safetensors member read straight into its tensors: its 8-byte header length, its JSON
    header (at most `header_cap` bytes, every entry checked as safetensors checks it: a known
    dtype, a shape, offsets that tile the data exactly), then each tensor's bytes read from
    the file into that tensor's own memory. Keeps {name: tensor}."""

    def __init__(self, header_cap: int, loads: Callable[[bytes], object] = json.loads) -> None:
        self.header_cap = header_cap
        self.loads = loads

    def take(self, fill, entry):
        if entry.size < 8:
            raise ArchiveError(f"{entry.name} is not a safetensors file: {entry.size} bytes")
        head = bytearray(8)
        fill(memoryview(head))
        length = int.from_bytes(head, "little")
        if length > min(self.header_cap, entry.size - 8):
            raise ArchiveError(f"{entry.name} is not a safetensors file: it declares a header of {length} bytes")
        header = bytearray(length)
        fill(memoryview(header))
        try:
            table = self.loads(bytes(header))
        except ValueError as exc:
            raise ArchiveError(f"{entry.name} is not a safetensors file: its header is not JSON ({str(exc)[:80]})") \
                from None
        layout = _tensor_layout(table, entry.name, entry.size - 8 - length)
        tensors = {}
        for name, dtype, shape, nbytes in layout:
            tensor = torch.empty(shape, dtype=dtype)
            if nbytes:
                fill(memoryview((ctypes.c_ubyte * nbytes).from_address(tensor.data_ptr())).cast("B"))
                if sys.byteorder != "little" and tensor.element_size() > 1:
                    tensor = tensor.view(torch.uint8).view(-1, tensor.element_size()).flip(-1).contiguous() \
                        .view(dtype).view(shape)
            tensors[name] = tensor
        return tensors


def _tensor_layout(table: object, member: str, data_bytes: int) -> list[tuple[str, torch.dtype, list[int], int]]:
    """[(name, dtype, shape, bytes)] in data order; ArchiveError unless the header describes
    tensors that tile the `data_bytes` after it exactly."""
    bad = f"{member} is not a safetensors file"
    if type(table) is not dict:
        raise ArchiveError(f"{bad}: its header is not a JSON object")
    items = []
    for name, info in table.items():
        if name == "__metadata__":
            if type(info) is not dict or not all(type(v) is str for v in info.values()):
                raise ArchiveError(f"{bad}: its metadata is not text")
            continue
        if type(info) is not dict or set(info) != {"dtype", "shape", "data_offsets"}:
            raise ArchiveError(f"{bad}: the entry of {name[:40]!r} is not a tensor's")
        dtype, shape, offsets = DTYPES.get(info["dtype"]) if type(info["dtype"]) is str else None, \
            info["shape"], info["data_offsets"]
        if dtype is None:
            raise ArchiveError(f"{bad}: {name[:40]!r} has the dtype {str(info['dtype'])[:20]!r}")
        if type(shape) is not list or len(shape) > 64 or not all(type(d) is int and d >= 0 for d in shape):
            raise ArchiveError(f"{bad}: {name[:40]!r} has no valid shape")
        if (type(offsets) is not list or len(offsets) != 2 or not all(type(o) is int for o in offsets)
                or not 0 <= offsets[0] <= offsets[1]):
            raise ArchiveError(f"{bad}: {name[:40]!r} has no valid offsets")
        count = 1
        for d in shape:
            count *= d
        nbytes = count * dtype.itemsize
        if offsets[1] - offsets[0] != nbytes:
            raise ArchiveError(f"{bad}: {name[:40]!r} holds {offsets[1] - offsets[0]} bytes, its shape needs {nbytes}")
        items.append((offsets[0], offsets[1], name, dtype, shape, nbytes))
    items.sort(key=lambda item: (item[0], item[1]))
    at = 0
    for begin, end, name, *_ in items:
        if begin != at:
            raise ArchiveError(f"{bad}: the data of {name[:40]!r} does not follow the previous tensor's")
        at = end
    if at != data_bytes:
        raise ArchiveError(f"{bad}: its tensors hold {at} bytes, its data is {data_bytes}")
    return [(name, dtype, shape, nbytes) for _, _, name, dtype, shape, nbytes in items]


class Inflated(Sink):
    """The member's content (inflated when deflated), at most `cap` bytes, in one bytearray;
    refused from its declared size, and again while it is inflated."""

    def __init__(self, cap: int) -> None:
        self.cap = cap

    def take(self, fill, entry):
        if entry.size > self.cap:
            raise ArchiveError(f"{entry.name} inflates to more than {self.cap} bytes")
        out = bytearray(entry.size)
        fill(memoryview(out))
        return out
