"""A study for the generate() issue: tweak's sampler (sampling.TopSampler) against transformers'
processors inside the same compiled decode loop, side by side in one process.

Per model shape (bench/generate_bench.py's Llama-1B and Qwen-0.5B, bf16, random weights), one
model, one compile: transformers' compiled forward is shared by every way below, so only the
choice of the next token differs between the two loop ways. A sampling call (temperature 0.7,
top-k 50, top-p 0.9, a static cache, 128 new tokens, batch 1 and 4, prompt 32), and the greedy
call beside it, each way in turn per round, the order rotated per round:

    static       transformers' own generate() (its static path, compiled)
    loop         tweak's compiled loop with its sampler (sampling calls; top_sampler=True),
                 its choice of a token recorded as a device graph (sampling.RecordedDraw)
    loop-eager   the same sampler run eagerly, kernel by kernel (record_draws=False)
    loop-plain   the same loop with transformers' processors (top_sampler=False)
    loop-prefill-eager  "loop" with its prefill run eagerly, kernel by kernel, as before
                 prefill.RecordedPrefill (Prefills.record=False); every other way records it

(At 049b1da, where the runs in bench/results/runs/sampler-ab-049b1da.json come from, the
sampler served every call it could and loop-plain turned it off through sampling.DEVICES:
the same two ways; the sampler then ran eagerly, so its "loop" is what "loop-eager" is now.)

Prints tokens per second (median of --rounds) and whether each way's tokens equal the static
path's under the same seed.

    python bench/studies/sampler_ab_study.py [--models llama1b,qwen05b] [--rounds 7] [--batches 1,4]
        [--prompts 32] [--calls sampling,greedy] [--new 128] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

import common  # noqa: E402  (puts bench/ on the path)
import generate_bench as gb  # noqa: E402

from torch_tweak._runtime.decode import loop as decode_loop  # noqa: E402

CALLS = {"sampling": dict(do_sample=True, temperature=0.7, top_k=50, top_p=0.9), "greedy": dict(do_sample=False)}


def study(name: str, rounds: int, new: int, batches: list[int], prompts: list[int], calls: list[str]) -> list[dict]:
    model = gb.build_shape(name, torch.bfloat16, "cuda", False)
    loop = decode_loop.DecodeLoop(model, "compiled", top_sampler=True)
    decode_loop.install(model, loop)
    rows = []
    for batch, length in [(b, p) for b in batches for p in prompts]:
        torch.manual_seed(1)
        ids = torch.randint(100, 500, (batch, length), device="cuda")
        for call in calls:
            settings = CALLS[call]
            kwargs = dict(settings, max_new_tokens=new, cache_implementation="static")

            def run(way: str) -> tuple[float, torch.Tensor]:
                loop.top_sampler = way in ("loop", "loop-eager", "loop-prefill-eager")
                loop.choice.record_draws = way in ("loop", "loop-prefill-eager")
                loop.prefills.record = way != "loop-prefill-eager"
                fn = loop.original if way == "static" else model.generate
                torch.manual_seed(7)
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                with torch.no_grad():
                    out = fn(ids, **kwargs)
                torch.cuda.synchronize()
                return time.perf_counter() - t0, out

            ways = ["static", "loop", "loop-prefill-eager"] + (["loop-eager", "loop-plain"] if call == "sampling" else [])
            for way in ways:  # the compile, and every cache shape, before the timed rounds
                run(way)
                run(way)
            times: dict[str, list[float]] = {w: [] for w in ways}
            tokens: dict[str, torch.Tensor] = {}
            for r in range(rounds):
                for way in ways[r % len(ways):] + ways[: r % len(ways)]:
                    seconds, tokens[way] = run(way)
                    times[way].append(seconds)
            row = {"model": name, "batch": batch, "prompt": length, "call": call, "new_tokens": new,
                   "resampled": loop.resampled, "recorded_prefills": len(loop.prefills.recorded),
                   "unrecorded_prefills": list(loop.prefills.unrecorded.values()),
                   "ways": {w: {"tokens_per_s": batch * new / statistics.median(t),
                                "spread": (max(t) - min(t)) / statistics.median(t),
                                "same_as_static": bool(torch.equal(tokens[w], tokens["static"]))}
                            for w, t in times.items()}}
            rows.append(row)
            print(json.dumps(row), flush=True)
    decode_loop.uninstall(model)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--models", default="llama1b,qwen05b")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--new", type=int, default=128)
    parser.add_argument("--batches", default="1,4")
    parser.add_argument("--prompts", default="32")
    parser.add_argument("--calls", default="sampling,greedy")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    run = {"torch": torch.__version__, "device": torch.cuda.get_device_name(),
           "commit": common.commit(), "rows": []}
    for name in args.models.split(","):
        run["rows"] += study(name, args.rounds, args.new, [int(b) for b in args.batches.split(",")],
                             [int(p) for p in args.prompts.split(",")], args.calls.split(","))
        torch.cuda.empty_cache()
        if args.json:
            common.write_run(args.json, run)


if __name__ == "__main__":
    main()
