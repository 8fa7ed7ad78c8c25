"""How the launch settings of the decode step's Triton kernels (fused_triton.py) are chosen on a
card: the candidates per shape and their measurement.

- **Candidates** (``Config``): for a product, the configs that served each of the Llama-3.2-1B
  and Qwen2.5-0.5B product shapes best on an H100 (a probe of a plain product kernel, weights
  rotated past the L2 cache): four tl.dot configs, and for a bucket of one row three of the sum
  layout; where few column blocks would read a long K (K >= 4096 and fewer than two blocks a
  multiprocessor), split-K forms of the two dot configs that keep the least shared memory a
  program, cut into enough parts for two programs a multiprocessor. For the attention: two
  block lengths, and for caches of 1024 positions and more the same cut into slices of the
  positions (flash-decoding) for enough programs to fill the card.
- **Measurement** (``choose``): every candidate of every shape still to measure is compiled
  first, all at once on a thread pool (Triton's asynchronous compile: the compiler's native
  passes and ptxas run beside each other), then each is timed with CUDA events over launches
  recorded in one CUDA graph (no launch gaps between them) across every layer of the shape, each
  layer on its own weights (as the step reads them: from memory, not from the L2 cache after a
  first launch). The fastest is kept per card and shape for the process. A product shape is
  measured once, at the first bucket asked (a batch-1 call's one row); a larger bucket takes the
  best tl.dot config measured there (the probe's best dot config was the same for 1 to 8 rows)
  without a measurement. No triton.autotune: the step launches one fixed kernel per shape, so it
  can be recorded. Under Triton's interpreter nothing is measured: a fixed config runs.
"""

from __future__ import annotations

import dataclasses
import os
import statistics
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable

import torch

from ..._core import settings


@dataclasses.dataclass(frozen=True)
class Config:
    """A Triton kernel's launch settings: a product's (block_n, block_k, dot: the tl.dot layout,
    else the sum layout) or the attention's block_l; `split` parts of K (a product) or of the
    positions (the attention), each its own program; the warps of a program and Triton's
    pipeline stages (num_stages; 0: Triton's default)."""

    block_n: int = 0
    block_k: int = 0
    dot: bool = False
    block_l: int = 0
    warps: int = 4
    stages: int = 0
    split: int = 1


DOT_CONFIGS = (Config(16, 512, True, warps=4, stages=4), Config(32, 256, True, warps=4, stages=4),
               Config(64, 128, True, warps=4, stages=3), Config(64, 256, True, warps=4, stages=4))
"""The tl.dot configs measured for every product shape and bucket."""

SUM_CONFIGS = (Config(4, 1024, warps=8), Config(4, 512, warps=4), Config(8, 256, warps=4))
"""The sum layout's configs, measured for a bucket of one row only (it reads the weight once a
row: slower than tl.dot for more)."""

SPLIT_BASES = (DOT_CONFIGS[1], DOT_CONFIGS[2])
"""The dot configs cut along K: the two of least shared memory a program (more fit on a
multiprocessor, which is what the parts are for)."""

ATTENTION_CONFIGS = (Config(block_l=32, warps=2), Config(block_l=64, warps=4))
"""The attention's blocks of positions (each tile [block_l, head_dim])."""


def _floor_pow2(n: int) -> int:
    return 1 << (max(1, n).bit_length() - 1)


def split_configs(n: int, k: int, sms: int) -> list[Config]:
    """The split-K candidates of a product of n x k on a card of `sms` multiprocessors."""
    if k < settings.FUSED_SPLIT_MIN_K or sms <= 0:
        return []
    found = []
    for base in SPLIT_BASES:
        blocks = -(-n // base.block_n)
        if blocks >= 2 * sms:
            continue
        split = 2
        while blocks * split < 2 * sms:
            split *= 2
        split = min(split, _floor_pow2(k // (2 * base.block_k)))  # each part two blocks of K at the least
        if split >= 2:
            found.append(dataclasses.replace(base, split=split))
    return found


def product_configs(rows: int, n: int = 0, k: int = 0, sms: int = 0) -> list[Config]:
    """The configs measured for a product of n x k at a bucket of `rows` rows on a card of `sms`
    multiprocessors (without n, k and sms: no split-K form)."""
    dot = list(DOT_CONFIGS) + split_configs(n, k, sms)
    return list(SUM_CONFIGS) + dot if rows == 1 else dot


def attention_configs(length: int, programs: int, sms: int) -> list[Config]:
    """The attention's configs for a cache of `length` positions and `programs` (row, query head)
    programs on a card of `sms` multiprocessors: the blocks, and for long caches the blocks cut
    into a power of two of slices (at least 256 positions a slice at the cache's middle)."""
    configs = list(ATTENTION_CONFIGS)
    if length < settings.FUSED_SPLIT_MIN_LENGTH or sms <= 0:
        return configs
    split = 2
    while programs * split < sms and split < 16 and length // (4 * split) >= 256:
        split *= 2
    return configs + [dataclasses.replace(c, split=split) for c in configs]


def fixed(kind: str, rows: int, interpreted: bool) -> Config:
    """The config where none was measured. Under the interpreter large blocks (its time goes by
    programs and operations, not by bytes), and the tl.dot layout for buckets of 4 and more, so
    both layouts run (fused_kernels' tests run every candidate too); on a card, a dot config."""
    if kind == "attention":
        return Config(block_l=64)
    if interpreted:
        return Config(64, 128, rows >= 4)
    return DOT_CONFIGS[1]


@dataclasses.dataclass(eq=False)
class Shape:
    """One kernel shape to choose a config for: its `key` (without the card), the `rows` of its
    bucket, its candidate `configs`, `launches` (how many launches one `run` makes: the shape's
    layers), and `make_run`, which makes (on scratch buffers) the function that runs one config
    over them: run(config, warm) with warm=True compiles it and launches nothing."""

    key: tuple
    rows: int
    configs: list[Config]
    launches: int
    make_run: Callable[[], Callable[[Config, bool], Any]]

    @property
    def product(self) -> bool:
        return self.key[0] == "product"


CHOSEN: dict[tuple, Config] = {}
"""The config measured best per card, shape and bucket, for the process (a second decoder of the
same shapes measures nothing)."""

BEST_DOT: dict[tuple, Config] = {}
"""Per card and product shape, the best tl.dot config of its first measurement: what the larger
buckets take."""


def known(card: str, shape: Shape) -> Config | None:
    """The config already chosen for `shape` on `card`, or None."""
    found = CHOSEN.get((card, shape.key, shape.rows))
    if found is None and shape.product and shape.rows > 1:
        found = BEST_DOT.get((card, shape.key))
    return found


def choose(shapes: list[Shape], device: torch.device, interpreted: bool) -> list[Config]:
    """The config of each shape: measured on the card (module docs), or the fixed one where
    nothing is measured (not CUDA, or the interpreter)."""
    if device.type != "cuda" or interpreted:
        return [fixed(s.key[0], s.rows, interpreted) for s in shapes]
    card = torch.cuda.get_device_name(device)
    return measure(shapes, card, lambda fn, launches: graph_ms(fn, device, launches), compile_all)


def measure(shapes: list[Shape], card: str, timer: Callable[[Callable[[], Any], int], float],
            compiler: Callable[[list[Callable[[], Any]]], None]) -> list[Config]:
    """choose's measurement with its clock (`timer(fn, launches)`: ms of one call of fn) and its
    compiler (`compiler(jobs)`: runs each job, a warm run of one config) given: the shapes not
    chosen yet have all their candidates compiled by one call of `compiler`, then each is timed;
    a config that fails (does not compile, or too many registers or too much shared memory for
    the card) is no candidate."""
    found = [known(card, s) for s in shapes]
    todo = [(i, s, s.make_run()) for i, s in enumerate(shapes) if found[i] is None]
    compiler([(lambda run=run, c=c: run(c, True)) for _, s, run in todo for c in s.configs])
    for i, shape, run in todo:
        timings = {}
        for config in shape.configs:
            try:
                timings[config] = timer(lambda c=config: run(c, False), shape.launches)
            except Exception:  # not a candidate on this card
                continue
        if not timings:
            raise RuntimeError(f"no Triton config ran for {shape.key} at {shape.rows} rows")
        found[i] = CHOSEN[(card, shape.key, shape.rows)] = min(timings, key=timings.get)
        dots = [c for c in timings if c.dot]
        if shape.product and dots:
            BEST_DOT.setdefault((card, shape.key), min(dots, key=timings.get))
    return found


def compile_all(jobs: list[Callable[[], Any]]) -> None:
    """Runs every job (a warm run: the kernel compiled, nothing launched) with Triton's
    asynchronous compile on a thread pool, so the compiles run at once; returns when all are
    done. A job that fails is left to fail again at its timing. Where this Triton has no
    asynchronous compile, each kernel compiles at its first launch instead."""
    try:
        from triton.runtime._async_compile import AsyncCompileMode
    except ImportError:
        return
    if not jobs:
        return
    workers = max(1, min(len(jobs), os.cpu_count() or 1, 32))
    with ThreadPoolExecutor(workers, thread_name_prefix="tweak-compile") as pool:
        with AsyncCompileMode(pool, ignore_errors=True):
            for job in jobs:
                try:
                    job()
                except Exception:  # timed (and refused) later
                    continue


def graph_ms(fn: Callable[[], Any], device: torch.device, launches: int) -> float:
    """ms of one call of `fn` (which makes `launches` launches) on the card: called once (its
    kernels loaded, its scratch made), then called enough times for about FUSED_REPEAT_LAUNCHES
    launches in one CUDA graph, replayed: the median of 5 replays timed with CUDA events. (The
    graph is recorded with capture_begin/capture_end: torch.cuda.graph would collect garbage
    and empty the allocator's cache for each config.)"""
    repeat = max(1, -(-settings.FUSED_REPEAT_LAUNCHES // max(1, launches)))
    with torch.cuda.device(device):
        stream = torch.cuda.Stream(device)
        stream.wait_stream(torch.cuda.current_stream(device))
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.stream(stream):
            fn()
            stream.synchronize()
            graph.capture_begin(capture_error_mode="thread_local")
            try:
                for _ in range(repeat):
                    fn()
            finally:
                graph.capture_end()
        torch.cuda.current_stream(device).wait_stream(stream)
        graph.replay()
        rounds = []
        for _ in range(5):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            graph.replay()
            end.record()
            end.synchronize()
            rounds.append(start.elapsed_time(end) / repeat)
    return statistics.median(rounds)
