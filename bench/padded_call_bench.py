"""The padded backend's own cost per call, beside the work it runs (on this machine's CPU).

A call of a padded module finds its bucket, copies the call into the bucket's buffers (zeros
past the call's length), runs the bucket's work, cuts the outputs back to the call's sizes and
copies them out. On a GPU the work is a graph replay; here (graph=False, compile=False) it is
the module itself on the padded call. What is measured, per module, on the same stream of calls
(each call's sizes inside a recorded bucket):

    work      the module on the call already padded to its bucket (what the padding adds to)
    backend   the backend's callable on the call (bucket, copies, work, cuts, copies out)
    model     the tuned model called as a user does (the dispatcher, then the backend)

The per-call cost of the padding is backend - work, and model - work with the dispatcher.
Median over --rounds passes of the stream (the three take turns, pass by pass), microseconds
of this thread's CPU time per call (torch runs on one thread here): on a machine other
processes share, CPU time moves less with their load than wall time does.

    python bench/padded_call_bench.py [--rounds 30] [--json bench/results/runs/padded-call-<commit>.json]
    python bench/padded_call_bench.py --report RUN.json [...] [--out bench/results/padded_call.md]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import sys
import time
from typing import Any, Callable

import torch
import torch.utils._pytree as pytree

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from gpu_bench import run_file_name, source_commit  # noqa: E402


def mlp_case() -> tuple[torch.nn.Module, list[dict], list[dict]]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.GELU(), torch.nn.Linear(128, 16)).eval()
    rng = random.Random(0)
    tune = [{"x": torch.randn(b, 64)} for b in (1, 2, 3, 4, 5, 8)]
    stream = [{"x": torch.randn(rng.choice((1, 2, 3, 4, 5, 6, 7, 8)), 64)} for _ in range(64)]
    return _Kw(model), tune, stream


class _Kw(torch.nn.Module):
    def __init__(self, inner: torch.nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, x):
        return self.inner(x)


def text(n: int, seed: int, batches: tuple, lengths: range, vocab: int) -> list[dict]:
    rng = random.Random(seed)
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        rows = [rng.choice(list(lengths)) for _ in range(rng.choice(batches))]
        ids = torch.randint(1, vocab, (len(rows), max(rows)), generator=g)
        mask = torch.zeros(len(rows), max(rows), dtype=torch.long)
        for r, length in enumerate(rows):
            mask[r, :length] = 1
        out.append({"input_ids": ids * mask, "attention_mask": mask})
    return out


def bert_case() -> tuple[torch.nn.Module, list[dict], list[dict]]:
    import transformers
    torch.manual_seed(0)
    config = transformers.BertConfig(vocab_size=100, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                                     intermediate_size=64, max_position_embeddings=64)
    model = transformers.BertModel(config, add_pooling_layer=False).eval()
    tune = text(12, 0, (1, 2, 4), range(4, 33), 100)
    top = max(int(t["input_ids"].shape[1]) for t in tune)
    stream = text(64, 1, (1, 2, 4), range(2, top + 1), 100)
    return model, tune, stream


CASES: dict[str, Callable[[], tuple]] = {"mlp": mlp_case, "bert": bert_case}


def per_call(fns: list[tuple[Callable[[dict], Any], list]], rounds: int) -> list[float]:
    """Per (function, stream): the median over rounds of the stream's mean seconds per call; the
    functions take turns round by round, so that a change in the machine's load meets them all."""
    times: list[list[float]] = [[] for _ in fns]
    with torch.inference_mode():
        for fn, stream in fns:
            for _ in range(3):
                for c in stream:
                    fn(c)
        for _ in range(rounds):
            for k, (fn, stream) in enumerate(fns):
                t0 = time.thread_time()
                for c in stream:
                    fn(c)
                times[k].append((time.thread_time() - t0) / len(stream))
    return [statistics.median(t) for t in times]


def padded_call(call: Any, plan: Any, kwargs: dict) -> dict:
    """The call padded to its bucket, as the backend hands it to the module (its sizes and
    bucket as the C type finds them: _pad_fit)."""
    b, n, (bb, bn), _ = call._pad_fit(((), kwargs))
    leaves, spec = pytree.tree_flatten(((), kwargs))
    for slot, (batch, length) in zip(plan.layout.slots, plan.axes):
        x = leaves[slot.leaf]
        shape = list(x.shape)
        shape[0] = bb if batch else shape[0]
        if length:
            shape[1] = bn
        buf = torch.zeros(shape, dtype=x.dtype)
        view = buf[:b] if batch else buf
        (view[:, :n] if length else view).copy_(x)
        leaves[slot.leaf] = buf
    return pytree.tree_unflatten(leaves, spec)[1]


def run_case(name: str, rounds: int) -> dict:
    import torch_tweak as tt
    from torch_tweak.backends import PaddedGraphBackend

    module, tune, stream = CASES[name]()
    (w,) = tt.wrap(module, [""], strategy=tt.OneBackendStrategy(PaddedGraphBackend(graph=False, compile=False)))
    tt.tune(module, tune, measure={"rounds_max": 5, "time_cap": 0.5})
    (group,) = [g for g in w.tt_signatures if g.varying]
    backend = group.backend
    assert backend is not None, group.error
    callable_ = backend.callable
    plan = callable_.plan
    original = w._tt_original
    padded = [padded_call(callable_, plan, c) for c in stream]
    with torch.inference_mode():  # every call of the stream inside a recorded bucket: no first sight while timed
        for c in stream:
            module(**c)
    backend_describe_before = backend.describe()
    work, through_backend, through_model = per_call(
        [(lambda c: original(**c), padded), (lambda c: callable_(**c), stream), (lambda c: module(**c), stream)],
        rounds)
    with torch.inference_mode():
        worst = max(float((a - b).abs().max()) for a, b in
                    ((pytree.tree_leaves(module(**c))[0], pytree.tree_leaves(original(**c))[0]) for c in stream))
    from torch_tweak import _C
    in_c = isinstance(callable_, getattr(_C, "PaddedReplay", ())) and callable_.fast_calls > 0
    return {"case": name, "calls": len(stream), "c_path": in_c,
            "fast_calls": getattr(callable_, "fast_calls", None), "slow_calls": getattr(callable_, "slow_calls", None),
            "work_us": work * 1e6, "backend_us": through_backend * 1e6, "model_us": through_model * 1e6,
            "padding_us": (through_backend - work) * 1e6, "padding_dispatch_us": (through_model - work) * 1e6,
            "largest_error": worst, "buckets": backend_describe_before["buckets"]}


def report(paths: list[str], out: str) -> None:
    runs = [json.load(open(p)) for p in paths]
    lines = ["# The padded backend's cost per call", "",
             "Written by `bench/padded_call_bench.py --report` from the run files below; the protocol is the script's "
             "docstring. Microseconds of CPU time per call (median over rounds of a stream of 64 calls inside recorded buckets, one thread), on "
             "the CPU with graph=False, compile=False: *work* is the module on the call already padded, *padding* the "
             "backend's callable less the work, *with dispatch* the tuned model less the work.", ""]
    for run in runs:
        lines.append(f"- `runs/{os.path.basename(run['path'])}`: {run['environment']}")
    lines += ["", "| case | per-call path | work | backend | padding | tuned model | padding with dispatch |",
              "|---|---|---:|---:|---:|---:|---:|"]
    for run in runs:
        for row in run["rows"]:
            lines.append(f"| {row['case']} ({run['commit']}) | {'C' if row['c_path'] else 'Python'} | "
                         f"{row['work_us']:.1f} | {row['backend_us']:.1f} | {row['padding_us']:.1f} | "
                         f"{row['model_us']:.1f} | {row['padding_dispatch_us']:.1f} |")
    with open(out, "w") as f:
        f.write("\n".join(lines) + "\n")
    print(f"wrote {out}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--cases", default="mlp,bert")
    parser.add_argument("--json", default=None)
    parser.add_argument("--report", nargs="+", metavar="JSON")
    parser.add_argument("--out", default=os.path.join(HERE, "results", "padded_call.md"))
    args = parser.parse_args()
    if args.report:
        report(args.report, args.out)
        return
    torch.set_num_threads(1)
    import torch_tweak
    commit = source_commit()
    path = args.json or os.path.join(HERE, "results", "runs", f"padded-call-{commit}.json")
    run = {"path": run_file_name(path), "commit": commit,
           "environment": f"{platform.processor() or 'CPU'}, torch {torch.__version__}, torch-tweak "
                          f"{torch_tweak.__version__} at {commit}, {os.cpu_count()} CPUs, 1 thread", "rows": []}
    for name in args.cases.split(","):
        row = run_case(name, args.rounds)
        print(json.dumps(row), flush=True)
        run["rows"].append(row)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(run, f, indent=1)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
