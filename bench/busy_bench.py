"""A tweak on a busy CPU, checked afterwards on the quiet machine.

Issue 48's check, as one script: the example's encoder (examples/Tweak; or the README quick
start's residual MLP, `--model quickstart`) is tuned beside
`--loops` busy loops (processes that only spin), with a tuning cache folder of its own. The
loops are then stopped, and on the quiet machine

  1. the model tuned busy is measured against an untuned build of the same model in paired,
     interleaved rounds (the engine's paired rounds, _C.measure_paired: the median of the
     per-round ratios and its 99 % sign-test interval):
     is the depth kept under load faster when the load is gone?
  2. tt.tweak runs again on a fresh build with the same cache folder: the busy entry must be
     measured again, not replayed;
  3. and once more without the cache: is the quiet figure within the spread of a re-run?

    python bench/busy_bench.py --loops 2 --batch 1 --seq 64 --json bench/results/runs/busy-<commit>.json

The figures are this machine's: ratios only, each phase's load as tweak read it.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "examples", "Tweak"))
import encoder  # noqa: E402

import torch_tweak as tt  # noqa: E402
from torch_tweak import _C  # noqa: E402


def busy_loops(count: int) -> list[int]:
    """The pids of `count` processes that spin until killed: other processes, not this one's
    children (tweak counts its own descendants' CPU time as its own, not as others')."""
    pids = []
    for _ in range(count):
        shell = subprocess.run(["sh", "-c", f"'{sys.executable}' -c 'while True: pass' >/dev/null 2>&1 & echo $!"],
                               capture_output=True, text=True, check=True)
        pids.append(int(shell.stdout.strip()))
    return pids


class Block(torch.nn.Module):
    """The README quick start's residual MLP block."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm, self.up = torch.nn.LayerNorm(width), torch.nn.Linear(width, 2 * width)
        self.down = torch.nn.Linear(2 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.nn.functional.gelu(self.up(self.norm(x))))


def build(name: str) -> torch.nn.Module:
    """A fresh build of the model, the same weights each time."""
    if name == "example":
        return encoder.build()
    torch.manual_seed(0)
    return torch.nn.Sequential(*[Block(64) for _ in range(6)], torch.nn.Linear(64, 8)).eval()


def samples(name: str, batch: int, seq: int) -> list[torch.Tensor]:
    if name == "example":
        return encoder.samples(batch=batch, seq=seq)
    generator = torch.Generator().manual_seed(1)
    return [torch.randn(32, 64, generator=generator) for _ in range(4)]


def summary(result: "tt.TweakResult", seconds: float) -> dict:
    """What a tweak kept and how it measured it."""
    side = result.confirmation or {}
    return {"kept": result.kept, "depth": result.selected_depth, "cached": result.cached,
            "quality": result.measurement_quality, "speedup": result.speedup,
            "low": side.get("speedup_low"), "high": side.get("speedup_high"),
            "paired_rounds": side.get("paired_rounds"), "others_share": result.others_share,
            "busy": result.busy, "seconds": seconds, "outcome": result.outcome()}


def tweak(name: str, dataset: list, seconds_label: str) -> tuple[torch.nn.Module, dict]:
    """A fresh build of the model tuned on `dataset`."""
    model = build(name)
    start = time.perf_counter()
    result = tt.tweak(model, dataset, progress=False)
    row = summary(result, time.perf_counter() - start)
    print(f"{seconds_label}: {row['outcome']} ({row['seconds']:.0f} s)", flush=True)
    return model, row


@torch.no_grad()
def paired(tuned: torch.nn.Module, untuned: torch.nn.Module, dataset: list, rounds: int) -> dict:
    """The tuned and the untuned model in `rounds` paired rounds: the engine's own measurement on
    a busy machine (_C.measure_paired), its median ratio (untuned over tuned) and 99 % interval."""
    result = _C.measure_paired(lambda i: untuned(dataset[i]), lambda i: tuned(dataset[i]), len(dataset),
                               rounds_min=rounds, rounds_max=rounds)
    return {"rounds": result["rounds"], "speedup": result["ratio"], "low": result["low"], "high": result["high"]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=("example", "quickstart"), default="example")
    parser.add_argument("--loops", type=int, default=2, help="busy loops beside the first tweak")
    parser.add_argument("--batch", type=int, default=1, help="the example's batch (the quick start's is 32)")
    parser.add_argument("--seq", type=int, default=64, help="the example's sequence length")
    parser.add_argument("--rounds", type=int, default=300, help="paired rounds of the quiet check (8 to 1000)")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    torch.set_grad_enabled(False)
    dataset = samples(args.model, args.batch, args.seq)
    from gpu_bench import source_commit

    run = {"commit": source_commit(), "model": args.model, "loops": args.loops, "batch": args.batch, "seq": args.seq, "cpus": os.cpu_count(),
           "torch": torch.__version__, "torch_tweak": tt.__version__}
    with tempfile.TemporaryDirectory() as folder:
        os.environ["TORCH_TWEAK_CACHE"] = folder
        loops = busy_loops(args.loops)
        try:
            time.sleep(2)
            tuned, run["busy"] = tweak(args.model, dataset, f"beside {args.loops} busy loops")
        finally:
            for pid in loops:
                os.kill(pid, signal.SIGKILL)
        time.sleep(5)
        run["quiet_check"] = paired(tuned, build(args.model), dataset, args.rounds)
        print("quiet check of the model tuned busy: {speedup:.2f}x ({low:.2f}x to {high:.2f}x, "
              "{rounds} paired rounds)".format(**run["quiet_check"]), flush=True)
        _, run["quiet"] = tweak(args.model, dataset, "quiet, same cache")
        del os.environ["TORCH_TWEAK_CACHE"]
        model = build(args.model)
        start = time.perf_counter()
        result = tt.tweak(model, dataset, progress=False, cache=False)
        run["rerun"] = summary(result, time.perf_counter() - start)
        print(f"quiet re-run without the cache: {run['rerun']['outcome']}", flush=True)
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(run, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
