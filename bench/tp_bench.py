"""Tensor-parallel models under torchrun: tt.tweak tuning every rank together, against the
same sharded model untuned and compiled, each figure the slowest rank's.

Rows (each model sharded over every rank of the run, one process per GPU):
    llama     a Llama-3-8B shape (4096 wide, 32 layers, 32 heads, 8 key/value heads, MLP
              14336, vocabulary 128256; random weights, bf16), sharded by transformers' own
              tensor parallelism (from_pretrained(tp_plan="auto"), DTensor weights, NCCL),
              generating: greedy generate() of --new tokens after a --prompt token prompt,
              batch 1; figure: tokens per second
    encoder   a BERT-large shape encoder (1024 wide, 24 layers, 16 heads, MLP 4096; bf16),
              sharded by hand (Megatron style: column-parallel query/key/value and up
              projection, row-parallel output and down projection, each ending in an
              all_reduce), on batch 8 x 512 tokens; figure: milliseconds per call

Columns:
    untuned   the sharded model as it is
    compile   torch.compile(model) (default mode) on every rank
    tweak     tt.tweak(model, dataset) on every rank together (torch_tweak._core.distributed: every
              candidate built and checked on all ranks, timed by the slowest, one plan kept);
              for llama the dataset is the forward calls one generate() makes (prefill and
              decode steps, recorded with copies of their key/value cache); its tuning time

Every figure is the slowest rank's: each timed call starts after a barrier and its time is
the largest over the ranks (all_reduce MAX), and the median of --rounds rounds counts
(columns interleaved round by round). Each row also says whether every rank kept the same
plan (the digest of the installed plan, gathered) and whether the tuned outputs equal the
untuned ones (llama: the generated tokens; encoder: the outputs within bf16's tolerance).

    torchrun --nproc-per-node 2 bench/tp_bench.py [--rows llama,encoder] [--json PATH]
    python bench/tp_bench.py --smoke      # two processes on the CPU (gloo), tiny shapes: checks it runs

--smoke spawns two processes itself (or runs under torchrun --nproc-per-node 2 with --smoke),
uses gloo and tiny shapes of both rows, and a short tweak; its figures mean nothing.
"""

from __future__ import annotations

import argparse
import copy
import datetime
import json
import os
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

LLAMA_8B = dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=8192, rope_theta=500000.0)
LLAMA_TINY = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
ENCODER_LARGE = dict(width=1024, layers=24, heads=16, ffn=4096, batch=8, tokens=512)
ENCODER_TINY = dict(width=32, layers=2, heads=4, ffn=64, batch=2, tokens=8)


# ------------------------------------------------------------------ the ranks


def slowest(fn: Callable[[], Any], sync: Callable[[], None]) -> float:
    """Seconds of one call of fn, the slowest rank's: a barrier first, the device synchronised
    after, the largest time over the ranks."""
    dist.barrier()
    start = time.perf_counter()
    fn()
    sync()
    took = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
    dist.all_reduce(took, op=dist.ReduceOp.MAX, group=CONTROL)
    return float(took.item())


CONTROL: Any = None  # a gloo group of every rank: the bench's own timings, on CPU tensors


def same_on_every_rank(value: str) -> bool:
    values: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(values, value, group=CONTROL)
    return all(v == values[0] for v in values)


def say(*parts: Any) -> None:
    if dist.get_rank() == 0:
        print(*parts, flush=True)


# ------------------------------------------------------------------- encoder


class ShardedEncoderLayer(nn.Module):
    """A post-norm transformer encoder layer, this rank's heads and MLP columns."""

    def __init__(self, width: int, heads: int, ffn: int, world: int) -> None:
        super().__init__()
        self.heads, self.head_dim = heads // world, width // heads
        local = self.heads * self.head_dim
        self.qkv = nn.Linear(width, 3 * local)
        self.out = nn.Linear(local, width, bias=False)
        self.out_bias = nn.Parameter(torch.zeros(width))
        self.up = nn.Linear(width, ffn // world)
        self.down = nn.Linear(ffn // world, width, bias=False)
        self.down_bias = nn.Parameter(torch.zeros(width))
        self.norm1, self.norm2 = nn.LayerNorm(width), nn.LayerNorm(width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.heads, self.head_dim).permute(2, 0, 3, 1, 4)
        attn = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, t, -1)
        y = self.out(attn)
        dist.all_reduce(y)
        x = self.norm1(x + y + self.out_bias)
        z = self.down(F.gelu(self.up(x)))
        dist.all_reduce(z)
        return self.norm2(x + z + self.down_bias)


def encoder(shape: dict, device: torch.device, dtype: torch.dtype) -> tuple[nn.Module, list]:
    torch.manual_seed(dist.get_rank())  # each rank its own shard (random weights)
    model = nn.Sequential(*[ShardedEncoderLayer(shape["width"], shape["heads"], shape["ffn"], dist.get_world_size())
                            for _ in range(shape["layers"])]).to(device, dtype).eval()
    torch.manual_seed(1234)  # the same inputs on every rank
    data = [torch.randn(shape["batch"], shape["tokens"], shape["width"], device=device, dtype=dtype)
            for _ in range(2)]
    return model, data


# --------------------------------------------------------------------- llama


def llama(shape: dict, folder: Path, device: torch.device, dtype: torch.dtype) -> nn.Module:
    """A random-weight Llama of `shape`, saved once by rank 0, loaded sharded by transformers."""
    from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

    if dist.get_rank() == 0 and not (folder / "config.json").exists():
        torch.manual_seed(0)
        with torch.device("cpu"):
            LlamaForCausalLM(LlamaConfig(**shape)).to(dtype).save_pretrained(folder)
    dist.barrier()
    return AutoModelForCausalLM.from_pretrained(folder, tp_plan="auto", dtype=dtype).eval()


def generate_calls(model: nn.Module, ids: torch.Tensor, new: int) -> list:
    """The forward calls one greedy generate() makes, each copied as it was called (its
    key/value cache as it stood then): tweak's dataset for the llama row."""
    calls = []

    def hook(module: nn.Module, args: tuple, kwargs: dict) -> None:
        calls.append((copy.deepcopy(args), copy.deepcopy(kwargs)))

    handle = model.register_forward_pre_hook(hook, with_kwargs=True)
    try:
        with torch.inference_mode():
            model.generate(ids, max_new_tokens=new, do_sample=False)
    finally:
        handle.remove()
    return calls


# ------------------------------------------------------------------- columns


def tweak(model: nn.Module, data: list, smoke: bool) -> tuple[float, str]:
    """tt.tweak on every rank together: (its tuning time, the slowest rank's; the plan's digest)."""
    import torch_tweak as tt
    from torch_tweak.tweak import plan_digest

    settings = dict(cache=False, progress=dist.get_rank() == 0)
    if smoke:
        settings.update(strategy=tt.FirstWinsStrategy([tt.backends.TorchEagerBackend()]), max_depth=1,
                        measure={"warmup_max": 3, "rounds_min": 3, "rounds_max": 6, "time_cap": 1.0})
    took = slowest(lambda: say(tt.tweak(model, data, **settings)), lambda: None)
    return took, plan_digest(model)


def measure(columns: dict[str, Callable[[], Any]], rounds: int, sync: Callable[[], None]) -> dict[str, float]:
    """The median seconds per call of each column, the slowest rank's, columns interleaved."""
    for fn in columns.values():  # warm-up (a compile's first calls)
        for _ in range(3):
            fn()
    times: dict[str, list[float]] = {name: [] for name in columns}
    for _ in range(rounds):
        for name, fn in columns.items():
            times[name].append(slowest(fn, sync))
    return {name: statistics.median(t) for name, t in times.items()}


def encoder_row(args: argparse.Namespace, device: torch.device, dtype: torch.dtype, sync: Callable) -> dict:
    shape = ENCODER_TINY if args.smoke else ENCODER_LARGE
    untuned, data = encoder(shape, device, dtype)
    tuned, _ = encoder(shape, device, dtype)
    compiled = torch.compile(encoder(shape, device, dtype)[0])
    tuning_s, digest = tweak(tuned, data, args.smoke)
    x = data[0]
    with torch.inference_mode():
        ms = measure({"untuned": lambda: untuned(x), "compile": lambda: compiled(x), "tweak": lambda: tuned(x)},
                     args.rounds, sync)
        equal = all(torch.allclose(tuned(d), untuned(d), atol=2e-2, rtol=2e-2) for d in data)
    return {"row": "encoder", "shape": shape, "ms": {k: 1e3 * v for k, v in ms.items()}, "tuning_s": tuning_s,
            "same_plan": same_on_every_rank(digest), "outputs_equal": equal}


def llama_row(args: argparse.Namespace, device: torch.device, dtype: torch.dtype, sync: Callable) -> dict:
    shape = LLAMA_TINY if args.smoke else LLAMA_8B
    folder = Path(args.weights) / ("llama-tiny" if args.smoke else "llama-8b")
    untuned = llama(shape, folder, device, dtype)
    tuned = llama(shape, folder, device, dtype)
    compiled = llama(shape, folder, device, dtype)
    compiled.forward = torch.compile(compiled.forward)
    torch.manual_seed(1234)
    ids = torch.randint(0, shape["vocab_size"], (1, args.prompt), device=device)
    tuning_s, digest = tweak(tuned, generate_calls(tuned, ids, args.new), args.smoke)

    def run(model: nn.Module) -> Callable[[], torch.Tensor]:
        return lambda: model.generate(ids, max_new_tokens=args.new, min_new_tokens=args.new, do_sample=False)

    with torch.inference_mode():
        s = measure({"untuned": run(untuned), "compile": run(compiled), "tweak": run(tuned)}, args.rounds, sync)
        equal = torch.equal(run(tuned)(), run(untuned)())
    return {"row": "llama", "shape": shape, "new_tokens": args.new,
            "tokens_per_s": {k: args.new / v for k, v in s.items()}, "tuning_s": tuning_s,
            "same_plan": same_on_every_rank(digest), "outputs_equal": equal}


# ---------------------------------------------------------------------- main


def run(args: argparse.Namespace) -> None:
    global CONTROL
    smoke = args.smoke
    backend = "gloo" if smoke or not torch.cuda.is_available() else "nccl"
    dist.init_process_group(backend, timeout=datetime.timedelta(minutes=30))
    CONTROL = dist.new_group(backend="gloo")
    try:
        if backend == "nccl":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", dist.get_rank())))
            device, dtype, sync = torch.device("cuda"), torch.bfloat16, torch.cuda.synchronize
        else:
            device, dtype, sync = torch.device("cpu"), torch.float32, (lambda: None)
            torch.set_num_threads(1)
        rows = []
        for name in args.rows.split(","):
            say(f"--- {name} on {dist.get_world_size()} ranks ({backend})")
            row = {"llama": llama_row, "encoder": encoder_row}[name](args, device, dtype, sync)
            row["ranks"] = dist.get_world_size()
            rows.append(row)
            say(json.dumps(row))
        if args.json and dist.get_rank() == 0:
            Path(args.json).write_text(json.dumps({"rows": rows, "backend": backend, "torch": torch.__version__},
                                                  indent=1) + "\n")
    finally:
        dist.destroy_process_group()


def _spawned(rank: int, argv: list[str], port: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2",
                      LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE="2")
    run(parse(argv))


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", default="llama,encoder")
    parser.add_argument("--new", type=int, default=None, help="new tokens per generate() (default 128; smoke 4)")
    parser.add_argument("--prompt", type=int, default=None, help="prompt tokens (default 128; smoke 6)")
    parser.add_argument("--rounds", type=int, default=None, help="timed rounds per column (default 10; smoke 2)")
    parser.add_argument("--weights", default=None, help="where rank 0 saves the random-weight Llama once")
    parser.add_argument("--json", default=None)
    parser.add_argument("--smoke", action="store_true", help="CPU, gloo, tiny shapes: checks that it runs")
    args = parser.parse_args(argv)
    args.new = args.new or (4 if args.smoke else 128)
    args.prompt = args.prompt or (6 if args.smoke else 128)
    args.rounds = args.rounds or (2 if args.smoke else 10)
    args.weights = args.weights or os.path.join(tempfile.gettempdir(), "tp_bench_weights")
    return args


def main() -> None:
    args = parse(sys.argv[1:])
    if "RANK" in os.environ:  # under torchrun
        run(args)
        return
    if not args.smoke:
        sys.exit("run it under torchrun --nproc-per-node N (or with --smoke, which starts two CPU processes)")
    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_spawned, args=(sys.argv[1:], port), nprocs=2)


if __name__ == "__main__":
    main()
