"""Which Inductor settings make a whole model faster inside tweak's device graph, on one GPU.

A study for effort="high": each knob set is one candidate, tt.tweak at depth 0 with
tt.OneBackendStrategy(InductorGraphBackend(options=...)) (what the default tweak keeps
on most rows of bench/results/gpu.md), built cold (fresh Inductor and Triton caches, dynamo
reset), checked by tweak against the untuned model, then measured with gpu_bench's protocol
(warm-up, median of interleaved rounds of one synchronised call), beside eager and the
plain InductorGraph candidate of the same run.

    python bench/inductor_knobs.py --rows encoder:bf16,gpt2:bf16 --json knobs.json
    python bench/inductor_knobs.py --report runs/knobs-*.json --out knobs.md   # the table

Knob sets (--knobs, comma list; "+" joins knobs into one set):
    base      no options (Inductor's defaults)
    pdl       triton.enable_pdl: programmatic dependent launch (Hopper and newer), the
              next kernel's launch overlaps the end of the one before
    combo     combo_kernels: independent small kernels fused side by side into one
    cdt       coordinate_descent_tuning: each kernel's block sizes tuned by measurement
    freezing  freezing: weights taken as constants (folds, e.g., a batch norm into its conv)
    cl        the candidate's memory_format="channels_last" (models with convolutions)
A knob this torch does not have is reported as that candidate's error.
"""

from __future__ import annotations

import argparse
import copy
import gc
import json
import os
import sys
import time
import traceback
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import gpu_bench  # noqa: E402

KNOBS = {"pdl": {"triton.enable_pdl": True}, "combo": {"combo_kernels": True},
         "cdt": {"coordinate_descent_tuning": True}, "freezing": {"freezing": True}}


def why(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {str(exc).splitlines()[0][:300] if str(exc) else ''}"


def candidate(spec: str) -> Any:
    from torch_tweak.backends import InductorGraphBackend

    options: dict[str, Any] = {}
    layout = None
    for knob in spec.split("+"):
        if knob == "base":
            continue
        if knob == "cl":
            layout = "channels_last"
            continue
        options.update(KNOBS[knob])
    return InductorGraphBackend(options=options or None, memory_format=layout)


def study(name: str, dtype_name: str, specs: list[str], warmup: int, rounds: int) -> dict:
    import torch_tweak as tt
    row: dict[str, Any] = {"model": name, "dtype": dtype_name, "size": gpu_bench.SIZES[name], "build_s": {},
                           "errors": {}, "kept": {}, "error": {}}
    torch._dynamo.reset()
    gc.collect()
    torch.cuda.empty_cache()
    model, data = gpu_bench.build(name, gpu_bench.DTYPES[dtype_name])

    def eager(i: int) -> Any:
        a, k = gpu_bench.call_of(data[i % len(data)])
        return model(*a, **k)

    runs = {"eager": eager}
    for spec in specs:
        print(f"  {name} {dtype_name}: {spec}", flush=True)
        mine = copy.deepcopy(model)
        gpu_bench.cold_compiler(spec)
        torch._dynamo.reset()
        try:
            backend = candidate(spec)
            t0 = time.perf_counter()
            result = tt.tweak(mine, data, strategy=tt.OneBackendStrategy(backend), max_depth=0, progress=False,
                              cache=False)
            gpu_bench.sync()
            row["build_s"][spec] = time.perf_counter() - t0
            module = result.modules.get("")
            row["kept"][spec] = None if module is None else module.backend
            if result.selected_depth is None or module is None or not module.backend:
                why = (module.error if module is not None and module.error else str(result).splitlines()[-1])
                row["errors"][spec] = "not kept: " + why[:300]
                continue
        except Exception as exc:
            traceback.print_exc()
            row["errors"][spec] = why(exc)
            continue

        def run(i: int, mine: torch.nn.Module = mine) -> Any:
            a, k = gpu_bench.call_of(data[i % len(data)])
            return mine(*a, **k)

        try:
            row["error"][spec] = gpu_bench.output_error(eager, run)
            runs[spec] = run
        except Exception as exc:
            row["errors"][spec] = why(exc)
            if "CUDA error" in str(exc):
                raise
    print(f"  {name} {dtype_name}: measuring {', '.join(runs)}", flush=True)
    stats = gpu_bench.measure(runs, len(data), warmup, rounds)
    row["ms"] = {k: v["ms"] for k, v in stats.items()}
    row["spread"] = {k: [v["q25"], v["q75"]] for k, v in stats.items()}
    base = row["ms"].get("base")
    if base:
        row["vs_base"] = {k: base / v for k, v in row["ms"].items()}
    return row


def report(paths: list[str], out: str) -> None:
    """knobs.md from run files: per row, each knob set's latency, its speedup over the plain
    candidate of the same run, its build time and its error against eager."""
    runs = [json.load(open(p)) for p in paths]
    env = runs[0]["environment"]
    md = ["# Inductor settings inside tweak's device graph", "",
          f"Produced by `python bench/inductor_knobs.py` on one {env['gpu']} (torch {env['torch']}, CUDA "
          f"{env['cuda']}; torch-tweak at {', '.join(sorted({r['environment']['commit'] for r in runs}))}) from "
          + ", ".join(f"`{os.path.relpath(p, os.path.dirname(out) or '.')}`" for p in paths) + ". The same "
          "command on them writes this report again.", "",
          "Each knob set is one candidate: tt.tweak at depth 0 with "
          "tt.OneBackendStrategy(InductorGraphBackend(options=...)), built cold, checked by tweak against the "
          "untuned model, then measured with gpu_bench's protocol (warm-up calls, then the median of interleaved "
          "rounds of one synchronised call) beside eager and the plain candidate (base) of the same run. "
          "Knobs: pdl = triton.enable_pdl, combo = combo_kernels, cdt = coordinate_descent_tuning, "
          "freezing = freezing, cl = memory_format channels_last.", "",
          "| model | dtype | knobs | ms | vs base | build s | error | note |",
          "|---|---|---|---:|---:|---:|---:|---|"]
    best = []
    for run in runs:
        for r in run["rows"]:
            ms = r.get("ms", {})
            for spec in [s for s in r.get("build_s", {})] + [s for s in r.get("errors", {})
                                                             if s not in r.get("build_s", {})]:
                note = r.get("errors", {}).get(spec, "")
                cells = (f"{ms[spec]:.3f} | {ms['base'] / ms[spec]:.2f}x" if spec in ms and "base" in ms
                         else "- | -")
                build = f"{r['build_s'][spec]:.1f}" if spec in r.get("build_s", {}) else "-"
                err = r.get("error", {}).get(spec)
                md.append(f"| {r['model']} | {r['dtype']} | {spec} | {cells} | {build} | "
                          f"{'-' if err is None else f'{err:.2g}'} | {note} |")
            others = {s: ms["base"] / v for s, v in ms.items() if s not in ("eager", "base") and "base" in ms}
            if others:
                top = max(others, key=others.get)
                best.append(f"{r['model']} {r['dtype']}: {top} {others[top]:.2f}x")
    md += ["", "Best knob set per row, against the plain candidate: " + "; ".join(best) + "."]
    with open(out, "w") as f:
        f.write("\n".join(md) + "\n")
    print("written:", out)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--report", nargs="+", metavar="JSON", help="write --out from run files instead of running")
    p.add_argument("--out", default="knobs.md")
    p.add_argument("--rows", help="model:dtype pairs, e.g. encoder:bf16,gpt2:bf16")
    p.add_argument("--knobs", default="base,pdl,combo,cdt,freezing,pdl+combo+cdt+freezing",
                   help="comma list of knob sets (module docs)")
    p.add_argument("--conv-knobs", default="cl,cl+pdl+combo+cdt+freezing",
                   help="knob sets added for models with convolutions")
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--rounds", type=int, default=100)
    p.add_argument("--json")
    args = p.parse_args()
    if args.report:
        report(args.report, args.out)
        return
    if not args.rows or not args.json:
        p.error("--rows and --json are needed for a run (or --report to write the table)")
    settings = {k: v for k, v in vars(args).items() if k in ("rows", "knobs", "conv_knobs", "warmup", "rounds")}
    out: dict[str, Any] = {"environment": gpu_bench.environment(), "settings": settings, "rows": []}
    gpu_bench.preload_inductor()
    for pair in args.rows.split(","):
        name, dtype_name = pair.split(":", 1)
        specs = args.knobs.split(",")
        if name == "resnet50":
            specs += [s for s in args.conv_knobs.split(",") if s]
        t0 = time.perf_counter()
        try:
            row = study(name, dtype_name, specs, args.warmup, args.rounds)
        except Exception as exc:
            traceback.print_exc()
            row = {"model": name, "dtype": dtype_name, "errors": {"all": why(exc)}}
        row["wall_s"] = time.perf_counter() - t0
        out["rows"].append(row)
        print(json.dumps({k: row.get(k) for k in ("model", "dtype", "ms", "vs_base", "build_s", "error", "errors")}),
              flush=True)
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
        if "CUDA error" in str(row.get("errors", {}).get("all", "")):
            break
    print("written:", args.json)


if __name__ == "__main__":
    main()
