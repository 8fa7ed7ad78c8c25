"""The padded backend's buckets after tuning: the table of those held and refused, evicted
least frequently used (backends/padded.py's PaddedCall uses these).

A call whose bucket is not ready yet is answered by what serves it without the bucket (the
module compiled for dynamic shapes, or the module); then, in that same call, the bucket is
recorded (its buffers, and on a GPU its graph, in a memory pool of the bucket's own), run on
that call and checked against the original's answer for it. The bucket serves the calls of its
range from the next call on; one that failed (a recording that raised, an answer that differs)
is refused with its reason, and its calls keep being served as they were.

The buckets' count and memory stay under the caps (max_graphs, max_graph_memory_mb): before a
new bucket is added, the least useful one is evicted, the one whose calls were fewest since
tuning ended (least frequently used, as AITune's cache of graphs does; of two alike, the older),
never the one a call is being served from; its buffers, graph and pool are let go. A bucket
evicted and needed again is recorded and checked again.
"""

from __future__ import annotations

import os
import threading
from typing import Any, Callable

import torch


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
    and why; the caps on their count and memory, kept by evicting the least used. Every read
    and write under `lock` (status reads it from any thread)."""

    def __init__(self, max_buckets: int, max_bytes: int) -> None:
        self.max_buckets, self.max_bytes = max_buckets, max_bytes
        self.buckets: dict[Key, Bucket] = {}
        self.refused: dict[Key, str] = {}
        self.lock = threading.RLock()
        self.evicted = 0

    def add(self, bucket: Bucket) -> None:
        with self.lock:
            self.buckets[bucket.key] = bucket

    def refuse(self, key: Key, why: str) -> None:
        """`key` serves nothing from now on (and is not held), for the reason `why`."""
        with self.lock:
            self.buckets.pop(key, None)
            self.refused[key] = why

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

    def snapshot(self) -> tuple[list[Bucket], int]:
        """(the buckets held, how many are refused)."""
        with self.lock:
            return list(self.buckets.values()), len(self.refused)
