"""The padded backend's buckets after tuning: recorded and checked off the calls' path, evicted
least frequently used (backends/padded.py's PaddedCall uses these).

A call whose bucket is not ready yet is served by what serves it without the bucket (the
module compiled for dynamic shapes, or the module), and the bucket is handed to a worker
thread, one per padded module: the thread records it (its buffers, and on a GPU its graph,
captured on a stream of the thread's own in a memory pool of the bucket's own), runs it on a
copy of that call, and checks its answer against the original's for that call. The bucket
serves the calls of its range from the call after the check passed; one that failed (a
recording that raised, an answer that differs) is refused with its reason, and its calls keep
being served as they were. No call waits for a recording; while the thread records, it takes
a core (or the card's time) from the calls being served.

The buckets' count and memory stay under the caps (max_graphs, max_graph_memory_mb): before a
new bucket is added, the least useful one is evicted, the one whose calls were fewest since
tuning ended (least frequently used, as AITune's cache of graphs does; of two alike, the older),
never the one a call is being served from; its buffers, graph and pool are let go. A bucket
evicted and needed again is recorded and checked again.

One thread per padded module, started on the first bucket handed to it, ended after PADDED_IDLE_SECONDS with
nothing to do. It holds the module only while it works: a tuned model its user drops is freed
with its buckets, and the thread ends at its next look. At exit the job in progress is waited
for and the others dropped; a fork waits for the job in progress (tuning's isolated builds fork)
and the child starts without its parent's threads.
"""

from __future__ import annotations

import atexit
import logging
import os
import queue
import threading
import time
import weakref
from typing import Any, Callable

import torch

from .._core import settings

logger = logging.getLogger("torch_tweak")

_WORKING = threading.Lock()
"""Held by a worker around each job: a fork waits for it (register_at_fork)."""
_LIVE: "weakref.WeakSet[Worker]" = weakref.WeakSet()


class Bucket:
    """The static inputs of one bucket shape, its recording (or None), its outputs and the
    memory it holds (graph and pool on a device, else its buffers); its counters are kept by
    the C part of PaddedCall. pool: the graph's memory pool, the bucket's own."""

    __slots__ = ("key", "buffers", "graph", "replay", "outputs", "memory", "pool")

    def __init__(self, key: tuple[int, int]) -> None:
        self.key = key
        self.buffers: list[torch.Tensor] = []
        self.graph: Any = None
        self.replay: Any = None    # the graph as a _C.GraphReplay, whose launch the C path uses
        self.outputs: list = []
        self.memory = 0
        self.pool: Any = None


def fill_unlike(buffer: torch.Tensor, b: int) -> None:
    """A new bucket's padded rows (b:), filled unlike the call's rows. Served, they hold rows
    of earlier calls (ext/padded_call.c), anything at all: the proof and a new bucket's first
    call are checked with rows that move any statistic over the batch, so that a module whose
    valid rows depend on them fails there. Copies of a row of the call would not: a max or a
    min over the batch does not see a duplicate. Floating point: infinities of alternating
    sign, beyond every value of any call; other dtypes (token ids, masks: values the module
    takes; a value outside them could fail an index) the call's own rows reversed along their
    last axis, which a statistic over the batch of integer inputs (the largest id) does not
    see: such a module is not caught here."""
    valid, pad = buffer[:b], buffer[b:]
    if buffer.is_floating_point():
        signs = torch.arange(pad.numel(), device=buffer.device).reshape(pad.shape) % 2 * 2 - 1
        pad.copy_(signs * float("inf"))
        return
    source = valid.flip(-1) if valid.dim() >= 2 else valid.flip(0)
    rows = torch.arange(pad.shape[0], device=buffer.device) % b
    pad.copy_(source[rows])


def free_bytes(device: torch.device) -> int | None:
    """The device's free memory in bytes (the CPU's: its free pages), or None where it cannot be read."""
    try:
        if device.type == "cuda":
            return int(torch.cuda.mem_get_info(device)[0])
        if device.type == "cpu":
            return int(os.sysconf("SC_AVPHYS_PAGES")) * int(os.sysconf("SC_PAGE_SIZE"))
    except (RuntimeError, ValueError, OSError, AttributeError):
        return None
    return None


Key = tuple[int, int]


def _elements(key: Key) -> int:
    """A bucket's rows times its length (1 where the length is not padded: n 0)."""
    return key[0] * max(key[1], 1)


class Table:
    """The buckets one padded module holds (recorded, in the order they were), those refused
    and why, those handed to its worker; the caps on their count and memory, kept by evicting
    the least used. Shared by the callers and the worker: every read and write under `lock`."""

    def __init__(self, max_buckets: int, max_bytes: int) -> None:
        self.max_buckets, self.max_bytes = max_buckets, max_bytes
        self.buckets: dict[Key, Bucket] = {}
        self.refused: dict[Key, str] = {}
        self.pending: set[Key] = set()
        self.lock = threading.RLock()
        self.evicted = 0

    def add(self, bucket: Bucket) -> None:
        with self.lock:
            self.buckets[bucket.key] = bucket

    def take(self, key: Key) -> bool:
        """Whether `key` is to be handed to the worker now (and is, from now on, pending): not
        refused, not pending already, and fewer than max_buckets pending."""
        with self.lock:
            if key in self.refused or key in self.pending or len(self.pending) >= self.max_buckets:
                return False
            self.pending.add(key)
            return True

    def done(self, key: Key, refused: str | None = None) -> None:
        """`key` is no longer pending; refused: why it serves nothing (then it is not held)."""
        with self.lock:
            self.pending.discard(key)
            if refused is not None:
                self.buckets.pop(key, None)
                self.refused[key] = refused

    def estimate(self, key: Key) -> int:
        """The memory a bucket of `key` is likely to take: the most an element (a row, times
        its length where the length is padded) took in those held."""
        with self.lock:
            each = max((b.memory / _elements(b.key) for b in self.buckets.values()), default=0.0)
        return int(each * _elements(key))

    def make_room(self, key: Key, memory: int, counts: dict, drop: Callable[[int, int], bool],
                  retire: Callable[[Bucket], None]) -> None:
        """Evicts the least used buckets until one more (`key`, of `memory` bytes) fits the caps:
        the fewest calls first (counts: the C type's {(b, n): (hits, valid, served)}), then the
        oldest; drop(b, n) takes one out of the calls' path, False while a call is served from
        it (it stays); retire(bucket) is given each one taken out, before it is let go (a
        device waits there for its last replay). RuntimeError when no eviction makes room
        (`key` alone past the memory cap)."""
        while True:
            with self.lock:
                held = [k for k in self.buckets if k != key]
                used = sum(self.buckets[k].memory for k in held)
            if len(held) < self.max_buckets and used + memory <= self.max_bytes:
                return
            order = {k: i for i, k in enumerate(held)}
            for victim in sorted(held, key=lambda k: (counts.get(k, (0,))[0], order[k])):
                if drop(*victim):
                    with self.lock:
                        gone = self.buckets.pop(victim, None)
                        self.evicted += 1
                    if gone is not None:
                        retire(gone)
                    break
            else:
                raise RuntimeError(f"a bucket of {memory / 2**20:.1f} MiB does not fit max_graph_memory_mb="
                                   f"{self.max_bytes // 2**20}")

    def snapshot(self) -> tuple[list[Bucket], int, int]:
        """(the buckets held, how many are refused, how many pending)."""
        with self.lock:
            return list(self.buckets.values()), len(self.refused), len(self.pending)


class Worker:
    """The thread that records and checks one padded module's new buckets (see the module
    docs). hand(job) queues a job for owner._prove_new(job); settle() waits for the jobs."""

    def __init__(self, owner: Any, name: str) -> None:
        self.owner = weakref.ref(owner)
        self.name = name
        self.jobs: queue.Queue | None = None
        self.thread: threading.Thread | None = None
        self.start = threading.Lock()
        self.stopping = False
        _LIVE.add(self)

    def hand(self, job: Any) -> None:
        with self.start:
            if self.thread is None or not self.thread.is_alive():
                self.jobs = queue.Queue()
                self.thread = threading.Thread(target=_work, args=(self, self.jobs), daemon=True, name=self.name)
                self.thread.start()
            assert self.jobs is not None
            self.jobs.put(job)

    def settle(self, timeout: float = 60.0) -> bool:
        """Waits until the jobs handed so far are done; False when `timeout` passed first."""
        jobs = self.jobs
        if jobs is None:
            return True
        end = time.monotonic() + timeout
        with jobs.all_tasks_done:
            while jobs.unfinished_tasks:
                left = end - time.monotonic()
                if left <= 0:
                    return False
                jobs.all_tasks_done.wait(left)
        return True


_IDLE = object()


def _work(worker: Worker, jobs: queue.Queue) -> None:
    """A worker's thread: each job run by its owner (held only while it runs); ends when its
    owner is gone, at exit, or after PADDED_IDLE_SECONDS with nothing to do."""
    while True:
        try:
            job = jobs.get(timeout=settings.PADDED_IDLE_SECONDS)
        except queue.Empty:
            job = _IDLE
        if job is _IDLE:
            with worker.start:  # hand() starts a thread where this one is gone
                if jobs.empty():
                    worker.thread = None
                    return
            continue
        try:
            owner = worker.owner()
            if owner is not None and not worker.stopping:
                with _WORKING:
                    owner._prove_new(job)
        except Exception:  # noqa: BLE001 - _prove_new refuses what fails; a worker outlives the rest
            logger.exception("torch-tweak: a padded bucket's recording failed unexpectedly")
        finally:
            owner = None  # not held while waiting for the next job
            job = None
            jobs.task_done()
        if worker.owner() is None or worker.stopping:
            _drain(jobs)
            return


def _drain(jobs: queue.Queue) -> None:
    """The jobs left, dropped (each marked done for settle())."""
    while True:
        try:
            jobs.get_nowait()
        except queue.Empty:
            return
        jobs.task_done()


def _stop_all() -> None:
    """At exit: the job in progress ends, the others are dropped."""
    for worker in list(_LIVE):
        worker.stopping = True
        if worker.jobs is not None:
            _drain(worker.jobs)
        thread = worker.thread
        if thread is not None and thread.is_alive():
            thread.join(timeout=30.0)


def _after_fork_in_child() -> None:
    _WORKING.release()
    for worker in list(_LIVE):  # the threads are the parent's, and what they were handed
        worker.thread, worker.jobs = None, None
        owner = worker.owner()
        if owner is not None:
            owner.table.pending.clear()


atexit.register(_stop_all)
if hasattr(os, "register_at_fork"):
    os.register_at_fork(before=_WORKING.acquire, after_in_parent=_WORKING.release,
                        after_in_child=_after_fork_in_child)
