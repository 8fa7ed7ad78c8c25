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
one ValueError on every rank naming each setting and every rank's value. Then, before the
model first runs, the calls themselves (their structure, dtypes and sizes: ``Ranks.same_calls``,
a digest first, the calls' forms only when the digests differ): the model's own collectives
would pair tensors of different sizes, and gloo aborts the process ("Received data size
doesn't match").

The agreement waits no longer than the user's group allows. Every rank first meets the others
(``_meet``, as a Ranks is made) within the group's own timeout (init_process_group's or new_group's
``timeout=``, ``timeout_of``): a rank that never comes (it passed ``group=False``, or never called)
leaves the others with one ``RanksTimedOut`` at that timeout, naming what to pass, before
anything changed; the rank that tunes alone gets a note on its own error when its model's
collectives time out (``noted_alone``). Each agreement after that waits at most
AGREEMENT_TIMEOUTS times the group's timeout: long enough for a rank held in one of the
model's collectives to leave it at the group's timeout and bring its failure to the agreement.
"""

from __future__ import annotations

import contextlib
import contextvars
import datetime
import hashlib
import os
import socket
import time
from typing import Any, Callable, Iterator, TypeVar

import torch

from . import settings
from . import cpu_load

T = TypeVar("T")

_CURRENT: contextvars.ContextVar["Ranks | None"] = contextvars.ContextVar("torch_tweak_ranks", default=None)
_CONTROL: dict[Any, Any] = {}  # a user's group -> torch-tweak's own gloo group of its ranks
_BROKEN: dict[Any, str] = {}  # a user's group -> how its agreement timed out (gloo then closed its connections)




class RankFailed(Exception):
    """A step that failed on another rank; this rank's own failure is raised as it was."""


class RanksTimedOut(RuntimeError):
    """The other ranks did not reach torch-tweak's agreement in time (see the module's docs)."""


def _dist() -> Any:
    import torch.distributed as dist

    return dist


def resolve(group: Any, call: str = "tt.tweak") -> "Ranks | None":
    """The Ranks tt.tweak / tt.load decide with, from their ``group=``: None (the default)
    takes torch.distributed's default group when it is initialised with more than one
    process; False: this process alone; a ProcessGroup: that group. None when this process
    decides alone. call: what the ranks call (for messages); RanksTimedOut when the other
    ranks do not meet this one within the group's timeout."""
    if group is False:
        return None
    available = torch.distributed.is_available()
    if group is None:
        if not available or not torch.distributed.is_initialized() or torch.distributed.get_world_size() < 2:
            return None
        return Ranks(_dist().group.WORLD, call)
    if group is True:
        raise TypeError("group must be None (the default group when torch.distributed is initialised), False "
                        "(this process alone) or a torch.distributed ProcessGroup, not True")
    if not available or not isinstance(group, _dist().ProcessGroup):
        raise TypeError(f"group must be None, False or a torch.distributed ProcessGroup, not {type(group).__name__}")
    if _dist().get_rank(group) < 0:
        raise ValueError("this process is not a member of the group passed as group=: tweak only on its ranks")
    return Ranks(group, call)


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


def timeout_of(group: Any) -> datetime.timedelta:
    """The process group's own timeout (init_process_group's or new_group's ``timeout=``), read
    from its backend; torch's default for its backend where the group does not say."""
    dist = _dist()
    for device in getattr(group, "_device_types", ()):
        try:
            value = getattr(getattr(group._get_backend(device), "options", None), "_timeout", None)
        except Exception:  # a backend of no such device, or a torch that keeps it elsewhere
            continue
        if isinstance(value, datetime.timedelta) and value.total_seconds() > 0:
            return value
    try:
        return dist.distributed_c10d._get_default_timeout(dist.get_backend(group))
    except Exception:
        return dist.default_pg_timeout


def _control_of(group: Any, timeout: datetime.timedelta) -> Any:
    """torch-tweak's own gloo group of `group`'s ranks, for the agreement alone (made once per
    group, by its ranks alone: use_local_synchronization; the other processes of the default
    group take no part), whose collectives wait at most `timeout`."""
    dist = _dist()
    if group not in _CONTROL:
        _CONTROL[group] = dist.new_group(ranks=dist.get_process_group_ranks(group), backend="gloo",
                                         use_local_synchronization=True, timeout=timeout)
    return _CONTROL[group]


def _set_timeout(group: Any, timeout: datetime.timedelta) -> None:
    """The timeout of `group`'s collectives from now on, where torch lets it be set (else the
    one it was made with stays)."""
    setter = getattr(_dist().distributed_c10d, "_set_pg_timeout", None)
    if setter is not None:
        setter(timeout, group)


@contextlib.contextmanager
def _waiting(ranks: "Ranks", what: str, timeout: datetime.timedelta) -> Iterator[None]:
    """A collective of the ranks' agreement: torch's error when another rank never joined it (a
    timeout, a rank gone) becomes one RanksTimedOut saying what every rank must do; the group's
    agreement is closed from then on (gloo closed its connections)."""
    start = time.monotonic()
    try:
        yield
    except RuntimeError as exc:  # torch.distributed's DistError and gloo's errors are RuntimeErrors
        _BROKEN[ranks.group] = f"{ranks.call}, {what}"
        said = str(exc).strip().splitlines()[0][:300] if str(exc).strip() else type(exc).__name__
        raise RanksTimedOut(
            f"torch-tweak's agreement of the {ranks.size} ranks timed out {what} (rank {ranks.rank} waited "
            f"{time.monotonic() - start:.0f} s of at most {timeout.total_seconds():g} s; the group's timeout is "
            f"{ranks.timeout.total_seconds():g} s): every rank must call {ranks.call} at the same point of its "
            "program, with the same group= (a rank that passes group=False tunes alone, and the others wait for "
            f"it) and the same settings; torch said: {said}") from exc


def _meet(ranks: "Ranks") -> Any:
    """torch-tweak's own group of `ranks`' group (_control_of), once every rank has reached it
    within the group's timeout (RanksTimedOut else); its agreements then wait at most
    AGREEMENT_TIMEOUTS times that timeout."""
    if ranks.group in _BROKEN:
        raise RanksTimedOut(f"torch-tweak's agreement of these ranks timed out earlier in this process "
                            f"({_BROKEN[ranks.group]}), and torch closed its connections: start the ranks again "
                            f"(torchrun) to call {ranks.call} together")
    with _waiting(ranks, "meeting the other ranks", ranks.timeout):
        control = _control_of(ranks.group, ranks.timeout)
        _dist().monitored_barrier(group=control, timeout=ranks.timeout, wait_all_ranks=True)
    _set_timeout(control, settings.AGREEMENT_TIMEOUTS * ranks.timeout)
    return control


def _calls_differ(every: list[list[str]], what: str, call: str) -> str:
    """What to say when the ranks' calls differ (Ranks.same_calls): the first call that
    differs, every rank's form of it."""
    k = next((i for i in range(max(map(len, every))) if len({tuple(f[i:i + 1]) for f in every}) > 1), 0)
    shown = "; ".join(f"rank {r} " + (f[k][:300] if k < len(f) else f"none (it has {len(f)} calls)")
                      for r, f in enumerate(every))
    return (f"the ranks call {call} with different inputs: call {k} {what} is {shown}; every rank must pass calls "
            "of the same structure, dtypes and sizes, in the same order (the model's collectives pair them: "
            "tensors of different sizes in one all_reduce abort the process); nothing was changed")


class Ranks:
    """The ranks of one process group deciding together (see the module's docs).

    rank, size: this process's rank in the group and the group's size; backend: the group's
    backend ("gloo", "nccl"...); peers: the process ids of the other ranks on this host."""

    def __init__(self, group: Any, call: str = "tt.tweak") -> None:
        dist = _dist()
        self.group, self.call = group, call
        self.rank: int = dist.get_rank(group)
        self.size: int = dist.get_world_size(group)
        self.backend = str(dist.get_backend(group))
        self.timeout = timeout_of(group)
        self.pending: Exception | None = None
        self.control = _meet(self)  # never the user's group: it would pair with the model's collectives
        hosts = self.gather((socket.gethostname(), os.getpid()))
        here = hosts[self.rank][0]
        self.peers = tuple(pid for host, pid in hosts if host == here and pid != os.getpid())
        self.t0 = time.monotonic_ns()  # just after a collective: the ranks' clocks start together

    # ----------------------------------------------------------- collectives

    def _reduce(self, values: list[float], op: Any) -> list[float]:
        tensor = torch.tensor(values, dtype=torch.float64)
        with _waiting(self, "in an all_reduce", settings.AGREEMENT_TIMEOUTS * self.timeout):
            _dist().all_reduce(tensor, op=op, group=self.control)
        return tensor.tolist()

    def gather(self, value: Any) -> list[Any]:
        """Every rank's `value` (picklable), by rank."""
        out: list[Any] = [None] * self.size
        with _waiting(self, "in an all_gather", settings.AGREEMENT_TIMEOUTS * self.timeout):
            _dist().all_gather_object(out, value, group=self.control)
        return out

    def any(self, flag: bool) -> bool:
        """True on every rank when `flag` is true on any."""
        return self._reduce([float(bool(flag))], _dist().ReduceOp.MAX)[0] > 0

    def all(self, flag: bool) -> bool:
        """True on every rank when `flag` is true on all."""
        return self._reduce([float(bool(flag))], _dist().ReduceOp.MIN)[0] > 0

    def barrier(self) -> None:
        with _waiting(self, "in a barrier", settings.AGREEMENT_TIMEOUTS * self.timeout):
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
        try:
            flags = self._reduce(flags, _dist().ReduceOp.SUM)
        except RanksTimedOut as lost:
            if failure is None:
                raise
            if hasattr(failure, "add_note"):  # this rank's own failure stays the error, the others' silence noted
                failure.add_note(f"torch-tweak: {what} failed on this rank ({self.rank}), and then {lost}")
            raise failure
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

    def same_calls(self, forms: list[str], what: str) -> None:
        """Returns when every rank holds calls of equal forms (`forms`: each call's structure,
        dtypes and sizes, signatures.call_form); else ValueError on every rank naming the first
        call that differs and every rank's form of it. A digest is compared first, the forms
        only when the digests differ. Called before the model first runs on them: its own
        collectives would pair tensors of different sizes, and gloo aborts the process.
        what: where the calls come from ("of the dataset")."""
        digest = hashlib.sha256("\n".join(forms).encode("utf-8", "surrogatepass")).hexdigest()
        if all(d == digest for d in self.gather(digest)):
            return
        raise ValueError(_calls_differ(self.gather(forms), what, self.call))

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
        with _waiting(self, "reading the ranks' clock", settings.AGREEMENT_TIMEOUTS * self.timeout):
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


def saved_ranks_problem(saved: tuple[int, int] | None, where: tuple[int, int] | None) -> str | None:
    """Why a file saved by rank saved[0] of saved[1] processes (None: a single process) cannot
    load in this process (`where`: its rank and world size; None: it runs alone), as words that
    follow the file's path; None when it can: a plan holds for the shard it was tuned on."""
    if saved is None:
        if where is None:
            return None
        return (f"was saved by a single process, and this is rank {where[0]} of {where[1]} processes "
                "(torch.distributed): a plan holds for the shard it was tuned on; tune under torchrun (tt.tweak "
                "on every rank) and save one file per rank, or load with group=False when every rank holds the "
                "whole model")
    rank, size = saved
    if where is None:
        return (f"was saved by rank {rank} of {size} processes (torch.distributed), and this process runs alone: "
                f"load it on rank {rank} of a run of {size} processes (torchrun --nproc-per-node {size}), after "
                "torch.distributed.init_process_group, into that rank's shard of the model")
    if where != (rank, size):
        return (f"was saved by rank {rank} of {size} processes, and this is rank {where[0]} of {where[1]} "
                f"processes: each rank loads the file its own rank saved, in a run of as many processes ({size}); "
                f"for {where[1]} processes, tune again under that run (tt.tweak on every rank)")
    return None


@contextlib.contextmanager
def noted_alone(group: Any, call: str) -> Iterator[None]:
    """`call` on a process that passed group=False while torch.distributed runs several: when
    it fails on a collective that timed out (the model's, waiting for ranks that do not run
    it with this one), a note on the error says so and what to pass."""
    try:
        yield
    except Exception as exc:
        if group is False and hasattr(exc, "add_note") and _timed_out(exc):
            exc.add_note(f"torch-tweak: this process called {call} with group=False (alone) while torch.distributed "
                         f"runs {_dist().get_world_size()} processes, and a collective timed out: the other ranks do "
                         f"not run the model with this one. A model whose modules call collectives is tuned and "
                         f"loaded by every rank together: pass the same group= on every rank (None, the default)")
        raise


def _timed_out(exc: BaseException) -> bool:
    """Whether `exc` or an error that caused it is torch.distributed's (a collective that timed
    out or lost its peer), while this process is one of several."""
    if not torch.distributed.is_available() or not torch.distributed.is_initialized():
        return False
    if _dist().get_world_size() < 2:
        return False
    seen: BaseException | None = exc
    for _ in range(16):  # a bounded walk of the causes
        if seen is None:
            return False
        if isinstance(seen, getattr(_dist(), "DistError", ())) or "Timed out" in str(seen):
            return True
        seen = seen.__cause__ or seen.__context__
    return False


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
