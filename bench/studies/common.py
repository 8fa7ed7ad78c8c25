"""What the studies share: where the benchmarks and the run files are, the commit a run names,
a run file's writing, the 1B Llama shape the decode studies measure, a CUDA graph recorded on a
side stream, and the device kernels a call launches.

A study is a one-off measurement behind a finding in bench/results/*.md (the file that quotes
it names it); the benchmarks a user runs are the scripts of bench/ itself. A study imports
this module first (`import common`, run from any folder: Python puts the study's own folder on
the path), which puts bench/ on the path too, so a study can build on a benchmark's helpers
(`import generate_bench`).
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any, Callable

STUDIES = os.path.dirname(os.path.abspath(__file__))
BENCH = os.path.dirname(STUDIES)
RUNS = os.path.join(BENCH, "results", "runs")
if BENCH not in sys.path:
    sys.path.insert(0, BENCH)

H200_BYTES_PER_S = 4.8e12
"""An H200's memory bandwidth: the floor a decode step's weight bytes are held against."""


def commit() -> str:
    """The commit a run names: TT_BENCH_COMMIT when set (a copied tree), else the checkout's
    (gpu_bench.source_commit, with "+changes" for a changed tree)."""
    from gpu_bench import source_commit

    return source_commit()


def write_run(path: str | None, run: Any) -> None:
    """A run's figures (a dict or a list) as JSON at `path` (nothing when None), its folder made."""
    if not path:
        return
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(run, f, indent=1)


def llama_1b(max_positions: int = 4096, generate: bool = False) -> Any:
    """The Llama-3.2-1B shape (hidden 2048, 16 layers, 32 heads, 8 KV heads, MLP 8192, vocabulary
    128256, tied embeddings), random weights (seed 0), bf16 on the GPU, in eval mode. generate:
    set for generate() calls that run to max_new_tokens (no end token, pad 0)."""
    import torch
    import transformers

    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
        num_key_value_heads=8, head_dim=64, max_position_embeddings=max_positions, rope_theta=500000.0,
        tie_word_embeddings=True)
    model = transformers.LlamaForCausalLM(config).eval().to("cuda", torch.bfloat16)
    if generate:
        model.generation_config.eos_token_id = None
        model.generation_config.pad_token_id = 0
    return model


def graphed(fn: Callable[[], Any], fork_rng: bool = False) -> tuple[Any, Any]:
    """(a CUDA graph of `fn`, what the recorded call returned): three warm-up calls and the
    recording on a side stream, the current stream then waiting for it. fork_rng: the warm-up
    and the recording leave the device's random state as it was."""
    import contextlib

    import torch

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    rng = torch.random.fork_rng(devices=[torch.cuda.current_device()]) if fork_rng else contextlib.nullcontext()
    with rng, torch.cuda.stream(stream):
        for _ in range(3):
            fn()
        stream.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            out = fn()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    return graph, out


def kernels(fn: Callable[[], Any], warm: bool = False) -> list[str]:
    """The names of the device kernels one call of `fn` launches (a graph's replay included), in
    their order, from the profiler. warm: one untimed call first (a compile, a cache)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    if warm:
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    events = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    return [e.name[:120] for e in sorted(events, key=lambda e: e.time_range.start)]
