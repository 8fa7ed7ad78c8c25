"""The tuning cache and tt.save / tt.load on examples/Tweak's encoder, in one run.

1. tweak a freshly built encoder with an empty tuning cache and an empty Inductor cache
   (both in a temporary folder), timed;
2. tweak a second freshly built encoder: a cache hit, timed (target: at most 10 % of 1);
3. save the tuned model, load it into a freshly built encoder in a new process, and
   measure the tuned model here and the loaded one there with the engine's protocol,
   taking turns (tuned, loaded, tuned, loaded...; the lowest median of each counts, so a
   burst of load on the machine does not fall on one side), and compare their outputs.

Writes bench/results/cache_<device>.md. Usage:
    python bench/cache_bench.py [--device cpu|cuda] [--max-depth 2] [--out PATH]
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "examples", "Tweak"))


def latency_ms(model, dataset, device: str) -> dict:
    """The engine's measurement of the model over the dataset: median and quartiles per call, ms."""
    import torch
    from torch_tweak import _C
    from torch_tweak._core._samples import synchronizer

    def run(i: int) -> None:
        model(dataset[i])

    with torch.no_grad():
        stats = _C.measure(run, len(dataset), sync=synchronizer(torch.device(device)))
    return {k: stats[k + "_ns"] / 1e6 for k in ("median", "q25", "q75")}


def medians(runs: list[dict]) -> str:
    return ", ".join(f"{r['median']:.2f}" for r in runs)


def child(args: argparse.Namespace) -> int:
    """The new process: build, load, measure, write outputs."""
    import torch
    from safetensors.torch import load_file, save_file

    import encoder
    import torch_tweak as tt

    model = encoder.build(args.device)
    start = time.perf_counter()
    chosen = tt.load(model, args.child[0])
    load_s = time.perf_counter() - start
    inputs = load_file(args.child[1], device=args.device)
    dataset = [inputs[f"x{i}"] for i in range(len(inputs))]
    with torch.no_grad():
        save_file({f"y{i}": model(x).cpu() for i, x in enumerate(dataset)}, args.child[2])
    print(json.dumps({"load_s": load_s, "modules": sum(b is not None for b in chosen.values())}), flush=True)
    for line in sys.stdin:  # one measurement per request, taking turns with the parent
        if line.strip() != "measure":
            break
        print(json.dumps(latency_ms(model, dataset, args.device)), flush=True)
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default=None)
    parser.add_argument("--max-depth", type=int, default=2)
    parser.add_argument("--out", default=None)
    parser.add_argument("--turns", type=int, default=3, help="measurements of each model, taking turns")
    parser.add_argument("--child", nargs=3, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        return child(args)

    work = tempfile.mkdtemp(prefix="tt-cache-bench-")
    os.environ["TORCH_TWEAK_CACHE"] = os.path.join(work, "tt-cache")
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(work, "inductor")  # a cold first tweak
    import torch
    from safetensors.torch import load_file, save_file

    import encoder
    import torch_tweak as tt
    from torch_tweak._store.serial import device_name

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    dataset = encoder.samples(device)

    model = encoder.build(device)
    start = time.perf_counter()
    first = tt.tweak(model, dataset, max_depth=args.max_depth, progress=False)
    first_s = time.perf_counter() - start
    print(first)
    print(f"first tweak: {first_s:.1f} s")

    again = encoder.build(device)
    start = time.perf_counter()
    second = tt.tweak(again, dataset, max_depth=args.max_depth, progress=False)
    second_s = time.perf_counter() - start
    print(f"second tweak: {second_s:.2f} s (cached: {second.cached})")
    second_cached = second.cached

    del again, second  # one tuned model in this process, as in the fresh one
    gc.collect()

    path = os.path.join(work, "encoder.tt")
    tt.save(model, path)
    inputs, outputs = os.path.join(work, "in.safetensors"), os.path.join(work, "out.safetensors")
    save_file({f"x{i}": x.cpu() for i, x in enumerate(dataset)}, inputs)
    env = dict(os.environ, PYTHONPATH=os.path.join(HERE, "..", "examples", "Tweak"))
    other = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--device", device, "--child", path,
                              inputs, outputs], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
    loaded = json.loads(other.stdout.readline())
    tuned_runs, loaded_runs = [], []
    for _ in range(args.turns):
        tuned_runs.append(latency_ms(model, dataset, device))
        other.stdin.write("measure\n")
        other.stdin.flush()
        loaded_runs.append(json.loads(other.stdout.readline()))
    other.stdin.close()
    if other.wait() != 0:
        raise SystemExit("the loading process failed")
    with torch.no_grad():
        tuned_out = [model(x).cpu() for x in dataset]
    loaded_out = load_file(outputs)
    error = max(float((loaded_out[f"y{i}"] - t).abs().max() / t.abs().max()) for i, t in enumerate(tuned_out))

    tuned = min(tuned_runs, key=lambda r: r["median"])
    best = min(loaded_runs, key=lambda r: r["median"])
    lines = [
        f"# Tuning cache and save/load: examples/Tweak encoder on {device}",
        "",
        f"Device: {device_name(torch.device(device))}; torch {torch.__version__}; torch-tweak {tt.__version__}; "
        f"Python {platform.python_version()}. Dataset: {len(dataset)} samples of {tuple(dataset[0].shape)}; "
        f"max_depth {args.max_depth}; default strategy. Generated by `python bench/cache_bench.py"
        f"{' --device ' + device if args.device else ''}`.",
        "",
        "## A second tweak of the same model",
        "",
        "| tweak | time s | from the cache |",
        "|---|---:|---|",
        f"| first (empty tuning and Inductor caches) | {first_s:.2f} | {first.cached} |",
        f"| second (a freshly built model) | {second_s:.2f} | {second_cached} |",
        "",
        f"Second / first: **{second_s / first_s:.1%}** (target: at most 10 %). The second tweak records the "
        "dataset once and builds the cached choices again (Inductor from its warm cache), with no measurement.",
        "",
        f"Selected depth {first.selected_depth}; untuned {first.baseline_ms:.3f} ms, tuned {first.tuned_ms:.3f} ms "
        "as the tweak measured it.",
        "",
        "## The tuned model against the model loaded in a fresh process",
        "",
        f"Measured in this run with the engine's protocol (median of rounds over the dataset, ms per call), "
        f"taking turns {args.turns} times: the tuned model in this process, then the loaded one in its own. "
        "The row is the turn with the lowest median; every median is listed.",
        "",
        "| model | median ms | q25 ms | q75 ms | every turn's median |",
        "|---|---:|---:|---:|---|",
        f"| tuned, this process | {tuned['median']:.3f} | {tuned['q25']:.3f} | {tuned['q75']:.3f} | "
        f"{medians(tuned_runs)} |",
        f"| loaded, fresh process | {best['median']:.3f} | {best['q25']:.3f} | {best['q75']:.3f} | "
        f"{medians(loaded_runs)} |",
        "",
        f"Loaded / tuned: {best['median'] / tuned['median']:.3f}. "
        f"tt.load took {loaded['load_s']:.2f} s ({loaded['modules']} modules built again, Inductor's cache warm). "
        f"File size {os.path.getsize(path) / 1e6:.2f} MB. Largest relative error of the loaded model's outputs "
        f"against the tuned model's: {error:.2e}.",
        "",
    ]
    out = args.out or os.path.join(HERE, "results", f"cache_{device}.md")
    os.makedirs(os.path.dirname(out), exist_ok=True)
    with open(out, "w", encoding="utf-8") as f:
        f.write("\n".join(lines))
    print("\n".join(lines))
    return 0 if error <= tt.TOLERANCES[torch.float32] else 1


if __name__ == "__main__":
    sys.exit(main())
