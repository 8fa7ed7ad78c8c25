"""Tuning inside a torch.distributed process group: every rank takes every decision together.

Under torchrun a model too large for one device runs sharded, one process per device, and
its modules call collectives (an all_reduce after a row-parallel Linear) that every rank
must reach together. A rank that builds, checks or times something the others do not, or
keeps another backend, makes the ranks run different code around those collectives and the
job hangs. tt.tweak and tt.load therefore run every step on every rank, in the same order,
and agree after each one through a ``Ranks`` (docs/tweak.md, "Tensor-parallel models"):

- a step that can fail on one rank only (tt.tweak's arguments, entering a cut, a module's
  signature groups, a candidate's build and each of its checked calls, committing a
  choice) is followed by one collective saying which ranks failed (``Ranks.step``): a step
  that failed on any rank fails on every rank, with that rank's message;
- the engine's clock is the ranks' clock (``Ranks.clock``): each reading is the largest
  time since the common start over all ranks, so every rank's engine reads the same
  figures and takes the same decisions (warm-up and measured rounds, winners, the depth,
  the time budget), and a call's latency is the slowest rank's;
- a call the engine times that fails on one rank fails on all (``Ranks.deferred`` keeps
  the failure until the ``sync`` that follows every timed call, which agrees on it);
- the machine's load is read by every rank and summed (``Ranks.load``); the other ranks'
  processes on this host count as the tweak's own work, never as load;
- what must be equal (a module's signatures, its candidates, the cuts, the installed
  plan) is compared across ranks (``Ranks.same``), and a difference is an error on every
  rank.

The agreement's collectives run on torch-tweak's own gloo group of the same ranks (made by
those ranks alone the first time they tune together on a group, never the user's group, even
a gloo one), on CPU tensors: they never pair with the model's own collectives. A rank whose
model raised before its own collective goes to the next agreement while the others wait in
the model's collective; they leave it at the process group's timeout (no host can reach into
it), with that error, and every rank then raises (a note on each rank's own error names the
other ranks' failures). On the user's group, that agreement would have paired with the
model's collective, and gloo aborted the process.

Before any collective whose sequence depends on them, the settings that decide that sequence
(tt.tweak's depths, tie tolerance, time budget, shapes, correctness rule, effort and
precision, the strategy and its backends, the measurement settings, the number of calls,
caching; tt.tune's likewise) are compared (``Ranks.same_settings``): ranks that differ raise
one ValueError on every rank naming each setting and every rank's value.
"""

from __future__ import annotations

import contextlib
import contextvars
import os
import socket
import time
from typing import Any, Callable, Iterator, TypeVar

import torch

from . import cpu_load

T = TypeVar("T")

_CURRENT: contextvars.ContextVar["Ranks | None"] = contextvars.ContextVar("torch_tweak_ranks", default=None)
_CONTROL: dict[Any, Any] = {}  # a user's group -> torch-tweak's own gloo group of its ranks


class RankFailed(Exception):
    """A step that failed on another rank; this rank's own failure is raised as it was."""


def _dist() -> Any:
    import torch.distributed as dist

    return dist


def resolve(group: Any) -> "Ranks | None":
    """The Ranks tt.tweak / tt.load decide with, from their ``group=``: None (the default)
    takes torch.distributed's default group when it is initialised with more than one
    process; False: this process alone; a ProcessGroup: that group. None when this process
    decides alone."""
    if group is False:
        return None
    available = torch.distributed.is_available()
    if group is None:
        if not available or not torch.distributed.is_initialized() or torch.distributed.get_world_size() < 2:
            return None
        return Ranks(_dist().group.WORLD)
    if group is True:
        raise TypeError("group must be None (the default group when torch.distributed is initialised), False "
                        "(this process alone) or a torch.distributed ProcessGroup, not True")
    if not available or not isinstance(group, _dist().ProcessGroup):
        raise TypeError(f"group must be None, False or a torch.distributed ProcessGroup, not {type(group).__name__}")
    if _dist().get_rank(group) < 0:
        raise ValueError("this process is not a member of the group passed as group=: tweak only on its ranks")
    return Ranks(group)


def position(group: Any) -> tuple[int, int] | None:
    """(rank, world size) of this process in the group ``group=`` names (see resolve), with no
    collective; None when this process runs alone."""
    if group is False:
        return None
    if group is None:
        if not torch.distributed.is_available() or not torch.distributed.is_initialized():
            return None
        group = _dist().group.WORLD
    elif not torch.distributed.is_available() or not isinstance(group, _dist().ProcessGroup):
        raise TypeError(f"group must be None, False or a torch.distributed ProcessGroup, not {type(group).__name__}")
    size = _dist().get_world_size(group)
    return None if size < 2 else (_dist().get_rank(group), size)


def _control_of(group: Any) -> Any:
    """torch-tweak's own gloo group of `group`'s ranks, for the agreement alone (made once per
    group, by its ranks alone: use_local_synchronization; the other processes of the default
    group take no part)."""
    dist = _dist()
    if group not in _CONTROL:
        _CONTROL[group] = dist.new_group(ranks=dist.get_process_group_ranks(group), backend="gloo",
                                         use_local_synchronization=True)
    return _CONTROL[group]


class Ranks:
    """The ranks of one process group deciding together (see the module's docs).

    rank, size: this process's rank in the group and the group's size; backend: the group's
    backend ("gloo", "nccl"...); peers: the process ids of the other ranks on this host."""

    def __init__(self, group: Any) -> None:
        dist = _dist()
        self.group = group
        self.rank: int = dist.get_rank(group)
        self.size: int = dist.get_world_size(group)
        self.backend = str(dist.get_backend(group))
        self.control = _control_of(group)  # never the user's group: it would pair with the model's collectives
        self.pending: Exception | None = None
        hosts = self.gather((socket.gethostname(), os.getpid()))
        here = hosts[self.rank][0]
        self.peers = tuple(pid for host, pid in hosts if host == here and pid != os.getpid())
        self.t0 = time.monotonic_ns()  # just after a collective: the ranks' clocks start together

    # ----------------------------------------------------------- collectives

    def _reduce(self, values: list[float], op: Any) -> list[float]:
        tensor = torch.tensor(values, dtype=torch.float64)
        _dist().all_reduce(tensor, op=op, group=self.control)
        return tensor.tolist()

    def gather(self, value: Any) -> list[Any]:
        """Every rank's `value` (picklable), by rank."""
        out: list[Any] = [None] * self.size
        _dist().all_gather_object(out, value, group=self.control)
        return out

    def any(self, flag: bool) -> bool:
        """True on every rank when `flag` is true on any."""
        return self._reduce([float(bool(flag))], _dist().ReduceOp.MAX)[0] > 0

    def all(self, flag: bool) -> bool:
        """True on every rank when `flag` is true on all."""
        return self._reduce([float(bool(flag))], _dist().ReduceOp.MIN)[0] > 0

    def barrier(self) -> None:
        _dist().barrier(group=self.control)

    # ------------------------------------------------------------- agreement

    def agree(self, failure: BaseException | None, what: str, first: bool = False) -> None:
        """Returns when no rank failed `what`; else raises on every rank: this rank's own
        failure as it was (with a note naming the other ranks' failures), or RankFailed naming
        the first rank that failed and its message. first: a rank whose own failure followed
        an earlier rank's (a timeout in the model's collective after the first rank raised
        before it) raises RankFailed naming the first rank's too, with its own as the cause."""
        flags = [0.0] * self.size
        flags[self.rank] = float(failure is not None)
        flags = self._reduce(flags, _dist().ReduceOp.SUM)
        if not any(flags):
            return
        messages = self.gather(None if failure is None else f"{type(failure).__name__}: {failure}"[:500])
        failed = [r for r, flag in enumerate(flags) if flag]
        if failure is not None and first and failed[0] != self.rank:
            raise RankFailed(f"{what} failed on rank {failed[0]}: {messages[failed[0]]} (and then on this rank, "
                             f"{self.rank}: {messages[self.rank]})") from failure
        if failure is not None:
            others = [r for r in failed if r != self.rank]
            if others and hasattr(failure, "add_note"):  # e.g. a timeout in the model's collective, after another
                failure.add_note(f"torch-tweak: {what} failed on this rank ({self.rank}) and on rank"  # rank's error
                                 f"{'s' if len(others) > 1 else ''} "
                                 + "; ".join(f"{r}: {messages[r]}" for r in others))
            raise failure
        also = f" (and on ranks {', '.join(map(str, failed[1:]))})" if len(failed) > 1 else ""
        raise RankFailed(f"{what} failed on rank {failed[0]}{also}: {messages[failed[0]]}")

    def step(self, thunk: Callable[[], T], what: str) -> T:
        """thunk() on this rank, then agreement (see agree): its value when it passed on
        every rank. Only an Exception is agreed on: Ctrl-C stops this rank at once."""
        failure = None
        value = None
        try:
            value = thunk()
        except Exception as exc:
            failure = exc
        self.agree(failure, what)
        return value  # type: ignore[return-value]

    def same(self, value: T, what: str) -> T:
        """`value` when every rank holds an equal one; else ValueError on every rank."""
        values = self.gather(value)
        if all(v == values[0] for v in values):
            return value
        shown = "; ".join(f"rank {r}: {str(v)[:200]}" for r, v in enumerate(values))
        raise ValueError(f"the ranks differ in {what} ({shown}); every rank must run the same model code on the "
                         "same inputs (each its own shard), in the same order")

    def same_settings(self, settings: dict[str, Any], what: str) -> None:
        """Returns when every rank holds equal `settings` ({name: plain value}); else ValueError on
        every rank naming each setting that differs and every rank's value of it. Called before
        any collective whose sequence the settings decide."""
        values = self.gather({k: repr(v)[:200] for k, v in settings.items()})
        differ = [k for k in settings if any(v.get(k) != values[0].get(k) for v in values)]
        if not differ:
            return
        shown = "; ".join(f"{k}: " + ", ".join(f"rank {r} {v.get(k)}" for r, v in enumerate(values))
                          for k in differ)
        raise ValueError(f"the ranks call {what} with different settings ({shown}): they decide the sequence of "
                         "the ranks' agreement, so every rank must pass the same ones; nothing was changed")

    # ------------------------------------------------ the engine's callbacks

    def clock(self) -> int:
        """The engine's clock: the largest of the ranks' nanoseconds since the common start."""
        tensor = torch.tensor([time.monotonic_ns() - self.t0], dtype=torch.int64)
        _dist().all_reduce(tensor, op=_dist().ReduceOp.MAX, group=self.control)
        return int(tensor.item())

    def deferred(self, fn: Callable[..., Any]) -> Callable[..., None]:
        """`fn` as a timed call: a failure is kept (the first one) until the next sync, so
        that this rank makes the same calls as the others meanwhile."""

        def call(*args: Any) -> None:
            try:
                fn(*args)
            except Exception as exc:
                if self.pending is None:
                    self.pending = exc

        return call

    def sync_with(self, device_sync: Callable[[], Any] | None) -> Callable[[], None]:
        """The engine's sync: waits for the device, then agrees on whether a call since the
        last sync failed on any rank (raised on every rank when one did)."""

        def sync() -> None:
            failure = None
            if device_sync is not None:
                try:
                    device_sync()
                except Exception as exc:
                    failure = exc
            failure, self.pending = self.pending or failure, None
            self.agree(failure, "a measured call", first=True)

        return sync

    def load(self) -> tuple[float, float] | None:
        """The engine's load: the ranks' readings summed (the other ranks on this host count
        as this tweak's work); None on every rank when any rank cannot read its own."""
        reading = cpu_load.reading(self.peers)
        total = self._reduce([1.0 if reading is not None else 0.0, *(reading or (0.0, 0.0))],
                             _dist().ReduceOp.SUM)
        return (total[1], total[2]) if total[0] == self.size else None

    def agreeing(self, search: Any, path_of: Callable[[int], str]) -> None:
        """Makes the engine's module search callbacks (a tuning.ModuleSearch: the engine reads
        them from the object) agreed on by every rank: the signatures and candidates compared,
        opening and committing a group agreed, the timed calls' failures kept for the sync.
        The build agrees on each of its steps itself (tuning.build_checked). path_of(node):
        the module's path, for messages."""
        groups, group, commit, run = search.groups, search.group, search.commit, search.run
        search.groups = lambda node: self.same(self.step(lambda: groups(node), "recording a module's calls"),
                                               f"the number of signatures of module {path_of(node)!r}")
        search.group = lambda node, g: self.same(self.step(lambda: group(node, g), "opening a signature"),
                                                 "a signature's candidates")
        search.commit = lambda node, g, chosen: self.step(lambda: commit(node, g, chosen),
                                                          "installing a module's choice")
        search.run = self.deferred(run)

    def describe(self) -> dict[str, int]:
        """What a saved file says of the ranks."""
        return {"rank": self.rank, "world_size": self.size}


def current() -> Ranks | None:
    """The Ranks of the tweak or load in progress in this thread, or None."""
    return _CURRENT.get()


@contextlib.contextmanager
def using(ranks: Ranks | None) -> Iterator[None]:
    """Makes `ranks` current (see current) for the block."""
    token = _CURRENT.set(ranks)
    try:
        yield
    finally:
        _CURRENT.reset(token)


def step(thunk: Callable[[], T], what: str) -> T:
    """thunk(), agreed on by the current ranks (Ranks.step); alone, simply thunk()."""
    ranks = current()
    return thunk() if ranks is None else ranks.step(thunk, what)


def enter_build(backend: Any) -> str | None:
    """Before a candidate's build under the current ranks: None when it may go on (after
    every rank reached it, for a backend that records a device graph), else why it is not
    built. Alone: None."""
    ranks = current()
    if ranks is None:
        return None
    if getattr(backend, "isolate_build", False):
        return ("not built under torch.distributed: its build runs first in a child process, which is not one "
                "of the ranks and cannot take part in the model's collectives")
    if getattr(backend, "records_graph", False):
        if ranks.backend != "nccl":
            return (f"not recorded under torch.distributed with the {ranks.backend} backend: a device graph records "
                    "the collectives only of NCCL, which runs on the device's streams; with another backend the "
                    "graph would replay without them")
        ranks.barrier()  # every rank begins the recording together: NCCL's kernels pair across ranks
    return None
