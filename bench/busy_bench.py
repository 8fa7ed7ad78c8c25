"""A tweak on a busy CPU, checked afterwards on the quiet machine.

Issue 54's check, as one script: the README quick start's residual MLP and the example's
encoder (examples/Tweak, batch 1) are each tuned `--runs` times beside `--loops` busy loops
(processes that only spin) and `--jobs` more CPU-bound jobs (processes that multiply matrices on
one thread, as a compile or a test run beside would), every one started as another process, not
this one's child (tweak counts its own descendants' CPU time as its own work). After each busy
tweak the load is stopped, and on the quiet machine the model tuned busy is measured against an
untuned build of the same model in paired, interleaved rounds (the engine's paired rounds,
_C.measure_paired: the median of the per-round ratios and its 99 % sign-test interval): is the
depth kept under load faster when the load is gone? Each busy tweak uses a tuning cache folder
of its own; after the runs, a quiet tweak in the last run's folder must measure again (a busy
entry is replayed only while the machine is busy), and it names the depth that is faster on the
quiet machine: the busy runs should keep it in at least 4 of 5.

    python bench/busy_bench.py --json bench/results/runs/busy-<commit>.json       # 5 runs of each model
    python bench/busy_bench.py --models quickstart --runs 1 --rounds 30           # a short look

The figures are this machine's: ratios only, each tweak's load as tweak read it. Run it on a
machine nothing else uses: the quiet checks need the load gone.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
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

SPIN = "while True: pass"
"""A busy loop."""

JOB = "import torch\ntorch.set_num_threads(1)\na = torch.randn(384, 384)\nwhile True:\n    a = torch.tanh(a @ a)"
"""One more CPU-bound job: matrix products on one thread, its caches and memory traffic too."""


def other_processes(code: str, count: int) -> list[int]:
    """The pids of `count` processes running `code` until killed: other processes, not this one's
    children (started from a shell that exits at once, so init adopts them)."""
    pids = []
    for _ in range(count):
        shell = subprocess.run(["sh", "-c", f"'{sys.executable}' -c \"$0\" >/dev/null 2>&1 & echo $!", code],
                               capture_output=True, text=True, check=True)
        pids.append(int(shell.stdout.strip()))
    return pids


def stop(pids: list[int]) -> None:
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


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


def samples(name: str) -> list[torch.Tensor]:
    """The README quick start's dataset, or the example's on the CPU (batch 1)."""
    if name == "example":
        return encoder.samples(batch=1)
    generator = torch.Generator().manual_seed(1)
    return [torch.randn(32, 64, generator=generator) for _ in range(4)]


def summary(result: "tt.TweakResult", seconds: float) -> dict:
    """What a tweak kept and how it measured it."""
    side = result.confirmation or {}
    return {"kept": result.kept, "depth": result.selected_depth, "cached": result.cached,
            "quality": result.measurement_quality, "speedup": result.speedup, "confirmed_depth": side.get("depth"),
            "figure": side.get("figure"), "low": side.get("speedup_low"), "high": side.get("speedup_high"),
            "paired_rounds": side.get("paired_rounds"), "busy_budget_wanted": side.get("busy_budget_wanted"),
            "others_share": result.others_share, "busy": result.busy, "busy_stopped": result.busy_stopped,
            "seconds": seconds, "outcome": result.outcome()}


def tweak(name: str, dataset: list, label: str, busy_budget: float) -> tuple[torch.nn.Module, dict]:
    """A fresh build of the model tuned on `dataset` (the tuning cache: $TORCH_TWEAK_CACHE)."""
    model = build(name)
    start = time.perf_counter()
    result = tt.tweak(model, dataset, progress=False, busy_budget=busy_budget)
    row = summary(result, time.perf_counter() - start)
    print(f"{label}: {row['outcome']} ({row['seconds']:.0f} s)", flush=True)
    return model, row


@torch.no_grad()
def paired(tuned: torch.nn.Module, untuned: torch.nn.Module, dataset: list, rounds: int) -> dict:
    """The tuned and the untuned model in `rounds` paired rounds: the engine's own measurement on
    a busy machine (_C.measure_paired), its median ratio (untuned over tuned) and 99 % interval."""
    result = _C.measure_paired(lambda i: untuned(dataset[i]), lambda i: tuned(dataset[i]), len(dataset),
                               rounds_min=rounds, rounds_max=rounds)
    return {"rounds": result["rounds"], "speedup": result["ratio"], "low": result["low"], "high": result["high"]}


def busy_run(name: str, dataset: list, args: argparse.Namespace, k: int) -> dict:
    """One tweak beside the load, in a cache folder of its own, then its quiet check."""
    os.environ["TORCH_TWEAK_CACHE"] = tempfile.mkdtemp(prefix="busy-bench-")
    load = other_processes(SPIN, args.loops) + other_processes(JOB, args.jobs)
    try:
        time.sleep(2)
        tuned, row = tweak(name, dataset, f"{name} run {k + 1}, beside {args.loops} busy loops and "
                           f"{args.jobs} more jobs", args.busy_budget)
    finally:
        stop(load)
    time.sleep(args.settle)
    if row["kept"]:
        row["quiet_check"] = paired(tuned, build(name), dataset, args.rounds)
        print("  on the quiet machine, tuned busy against untuned: {speedup:.2f}x ({low:.2f}x to {high:.2f}x, "
              "{rounds} paired rounds)".format(**row["quiet_check"]), flush=True)
    row["cache"] = os.environ["TORCH_TWEAK_CACHE"]
    return row


def bench(name: str, args: argparse.Namespace) -> dict:
    """--runs busy runs of one model, then a quiet tweak in the last run's cache folder: the depth
    faster on the quiet machine, and whether the busy runs kept it."""
    torch.set_grad_enabled(False)
    dataset = samples(name)
    runs = [busy_run(name, dataset, args, k) for k in range(args.runs)]
    os.environ["TORCH_TWEAK_CACHE"] = runs[-1]["cache"]
    _, quiet = tweak(name, dataset, f"{name}, quiet, the last run's cache folder", args.busy_budget)
    for row in runs:
        shutil.rmtree(row.pop("cache"), ignore_errors=True)
    kept_faster = sum(1 for r in runs if r["kept"] and r["depth"] == quiet["depth"] and quiet["kept"]
                      and r.get("quiet_check", {}).get("low", 0) > 1.0)
    print(f"{name}: {kept_faster} of {len(runs)} busy runs kept the depth faster on the quiet machine "
          f"(depth {quiet['depth']}), and measured it faster there", flush=True)
    return {"runs": runs, "quiet": quiet, "kept_faster": kept_faster}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", choices=("quickstart", "example"), default=["quickstart", "example"])
    parser.add_argument("--runs", type=int, default=5, help="busy tweaks of each model (5)")
    parser.add_argument("--loops", type=int, default=2, help="busy loops beside each busy tweak (2)")
    parser.add_argument("--jobs", type=int, default=1, help="more CPU-bound jobs beside them (1)")
    parser.add_argument("--busy-budget", type=float, default=120.0, help="tt.tweak's busy_budget (120 s)")
    parser.add_argument("--rounds", type=int, default=300, help="paired rounds of each quiet check (8 to 1000)")
    parser.add_argument("--settle", type=float, default=5.0, help="seconds to wait once the load is stopped")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    if args.runs < 1:
        parser.error(f"--runs must be 1 or more, not {args.runs}")
    from gpu_bench import source_commit

    run = {"commit": source_commit(), "loops": args.loops, "jobs": args.jobs, "busy_budget": args.busy_budget,
           "cpus": os.cpu_count(), "torch": torch.__version__, "torch_tweak": tt.__version__,
           "models": {name: bench(name, args) for name in args.models}}
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(run, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
