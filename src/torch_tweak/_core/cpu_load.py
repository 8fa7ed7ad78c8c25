"""The machine's load while tweak measures: the CPU time other processes took (Linux).

tt.tweak gives ``reading`` to the engine (``_C.tweak(load=...)``), which reads it before
and after each measurement of the untuned model and each side-by-side measurement, and
takes the difference: (others after - others before) / (capacity after - capacity
before) is the share of the machine's CPUs that other processes took during that
measurement. Above the engine's ``_C.BUSY_SHARE`` (a quarter) the machine was busy: no
speedup is claimed and the result is not cached (docs/tweak.md, "A busy machine").

A reading is two running totals of CPU-seconds (clock ticks over the clock's rate):

- others: the CPUs' busy time (``/proc/stat``, all CPUs: user + nice + system + irq +
  softirq + steal) minus the CPU time of this process and of its descendants (each one's
  ``/proc/<pid>/stat`` utime + stime + cutime + cstime: its threads, Inductor's compile
  workers, the isolation children, and the children that ended and were waited for);
- capacity: the CPUs' whole time (every field, idle and iowait too), cores x wall time.

What this process starts (a subprocess, a worker pool) is a descendant, so its work is
the tweak's own, never load. Where there is no ``/proc/stat`` (not Linux) the reading is
None: the load is unknown and nothing depends on it.

Every read is bounded (``read_bounded``): opened without blocking, a regular file only (a
FIFO, a device such as ``/dev/zero`` or a folder put over the path is refused, not read), at
most LOAD_STAT_BYTES bytes of ``/proc/stat`` (its aggregate line is the first) and LOAD_PROCESS_BYTES of
a process's, and the whole reading within LOAD_READING_SECONDS. An unreadable or odd file, or a
reading past its time, is "load unknown" (None).
"""

from __future__ import annotations

import os
import stat as _stat
import time
from typing import Iterable

from . import settings


PROC = "/proc"
_BUSY_FIELDS = (0, 1, 2, 5, 6, 7)
"""/proc/stat's cpu line: user nice system idle iowait irq softirq steal guest guest_nice;
the busy ones. guest and guest_nice are already counted in user and nice."""


def cpu_ticks(stat: str) -> tuple[int, int] | None:
    """(busy, total) clock ticks of all CPUs from the text of /proc/stat; None when it has
    no aggregate "cpu" line."""
    for line in stat.splitlines():
        fields = line.split()
        if fields and fields[0] == "cpu":
            try:
                ticks = [int(f) for f in fields[1:9]]
            except ValueError:
                return None
            if len(ticks) < 4:
                return None
            return sum(ticks[i] for i in _BUSY_FIELDS if i < len(ticks)), sum(ticks)
    return None


def process_ticks(stat: str) -> tuple[int, int, int] | None:
    """(pid, ppid, utime + stime + cutime + cstime) from the text of /proc/<pid>/stat; None
    when it is not one. The command name may hold spaces and parentheses: the fields
    start after its last ')'."""
    try:
        pid = int(stat[:stat.index(" ")])
        rest = stat[stat.rindex(")") + 2:].split()
        return pid, int(rest[1]), sum(int(rest[i]) for i in (11, 12, 13, 14))
    except (ValueError, IndexError):
        return None


def own_ticks(me: int, processes: Iterable[tuple[int, int, int]], also: Iterable[int] = ()) -> int:
    """The ticks of process `me` and of every descendant of it among `processes`
    ((pid, ppid, ticks), as process_ticks gives them); the processes in `also` (the other
    ranks of a torch.distributed tweak on this host) and their descendants count too."""
    ticks: dict[int, int] = {}
    children: dict[int, list[int]] = {}
    for pid, ppid, used in processes:
        ticks[pid] = used
        children.setdefault(ppid, []).append(pid)
    total, todo, seen = 0, [me, *also], set()
    while todo:
        pid = todo.pop()
        if pid in seen:
            continue
        seen.add(pid)
        total += ticks.get(pid, 0)
        todo.extend(children.get(pid, ()))
    return total


def reading_of(stat: str, process_stats: Iterable[str], me: int, hz: int = 100,
               also: Iterable[int] = ()) -> tuple[float, float] | None:
    """(others, capacity) in CPU-seconds from the texts of /proc/stat and of every
    /proc/<pid>/stat (see the module's docs), whose clock ticks `hz` a second; None when
    /proc/stat says nothing. also: processes whose time is the tweak's own (see own_ticks)."""
    cpus = cpu_ticks(stat)
    if cpus is None:
        return None
    busy, total = cpus
    processes = [p for p in map(process_ticks, process_stats) if p is not None]
    return (busy - own_ticks(me, processes, also)) / hz, total / hz


class Unreadable(OSError):
    """A file of /proc that is not a regular file, or a reading past its time: load unknown."""


def read_bounded(path: str, limit: int, deadline: float) -> str:
    """The text of a regular file, at most its first `limit` bytes, read before `deadline`
    (time.monotonic()); Unreadable for a FIFO, a device, a folder or a read past the deadline.
    Opened without blocking, so a FIFO answers at once."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    try:
        if not _stat.S_ISREG(os.fstat(fd).st_mode):
            raise Unreadable(f"{path} is not a regular file")
        chunks, total = [], 0
        while total < limit:
            if time.monotonic() > deadline:
                raise Unreadable(f"reading {path} took too long")
            chunk = os.read(fd, min(limit - total, 16384))
            if not chunk:
                break
            chunks.append(chunk)
            total += len(chunk)
        return b"".join(chunks).decode("ascii", errors="replace")
    finally:
        os.close(fd)


def process_stats(deadline: float | None = None) -> list[str]:
    """The text of every /proc/<pid>/stat that can be read now (a process that ends
    meanwhile is left out: its ticks are its parent's cutime once waited for); Unreadable
    once `deadline` (time.monotonic()) has passed."""
    deadline = time.monotonic() + settings.LOAD_READING_SECONDS if deadline is None else deadline
    texts = []
    for name in os.listdir(PROC):
        if name.isdigit():
            try:
                texts.append(read_bounded(os.path.join(PROC, name, "stat"), settings.LOAD_PROCESS_BYTES, deadline))
            except Unreadable:
                raise
            except (OSError, ValueError):
                continue
        if time.monotonic() > deadline:
            raise Unreadable(f"reading {PROC}'s processes took too long")
    return texts


def reading(also: Iterable[int] = ()) -> tuple[float, float] | None:
    """The reading now (see reading_of), or None where the load cannot be read (no
    /proc/stat, or an odd one: see read_bounded). also: the process ids of the other ranks on
    this host (torch_tweak._core.distributed), whose time is the tweak's own. Never raises."""
    try:
        deadline = time.monotonic() + settings.LOAD_READING_SECONDS
        text = read_bounded(os.path.join(PROC, "stat"), settings.LOAD_STAT_BYTES, deadline)
        return reading_of(text, process_stats(deadline), os.getpid(), os.sysconf("SC_CLK_TCK"), also)
    except Exception:
        return None


def usable_cpus() -> int:
    """The CPUs this process may run on (its affinity where the system tells, else the count)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return max(1, os.cpu_count() or 1)


def host_memory() -> int | None:
    """The machine's physical memory in bytes, or None where the system does not tell."""
    try:
        return int(os.sysconf("SC_PAGE_SIZE")) * int(os.sysconf("SC_PHYS_PAGES"))
    except (AttributeError, OSError, ValueError):
        return None


def share_now(seconds: float | None = None) -> float | None:
    """The share of the CPUs other processes take now: two readings `seconds` apart (None: long
    enough for 0.35 CPU-seconds, at least 0.25 s), or None when the load is unknown or the
    window too short to tell (under 0.3 CPU-seconds, as the engine's TW_LOAD_MIN_CAPACITY).
    What the tuning cache asks before it replays a figure measured busy."""
    if seconds is None:
        seconds = max(0.25, 0.35 / (os.cpu_count() or 1))
    before = reading()
    if before is None:
        return None
    time.sleep(seconds)
    after = reading()
    if after is None or not after[1] - before[1] >= 0.3:
        return None
    return min(max((after[0] - before[0]) / (after[1] - before[1]), 0.0), 1.0)
