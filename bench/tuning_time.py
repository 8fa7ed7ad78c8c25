"""Where tt.tweak's tuning time goes, on one GPU, against torch.compile's compile time.

For each model and dtype (the models and inputs of gpu_bench.py), cold (a fresh Inductor
and Triton cache folder, dynamo reset, tweak's tuning cache off):

    reduce-overhead  wall time of the first three calls of torch.compile(mode="reduce-overhead")
    tweak            wall time of tt.tweak(model, data), split into
                     build: each candidate backend's build (compile, capture), by backend
                     check: the correctness check of each built candidate on the samples
                     rest:  recording, measuring candidates and depths, bookkeeping
    tweak, per depth the seconds spent tuning the modules first tuned at that depth

``--dynamic-auto`` shares compiles but leaves ``dynamic=None`` to torch (automatic dynamic
shapes) instead of compiling static shapes for static signatures. ``--no-share`` adds a tweak, run before the other one, whose Inductor candidates compile each
module on their own (no shared compile) with dynamic=None as given (no static shapes for
static signatures): what this release's compile sharing saves.

    python bench/tuning_time.py [--models encoder,resnet50] [--dtypes fp32,bf16] [--no-share]
                                [--dynamic-auto] [--json PATH] [--md PATH]
    python bench/tuning_time.py --merge a.json b.json ... [--md PATH]
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import os
import sys
import time
from collections import defaultdict
from typing import Any

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from gpu_bench import DTYPES, build, cold_compiler, compiled, environment  # noqa: E402


def compile_metrics() -> dict[str, list[float]]:
    """Dynamo's and Inductor's timed phases so far: {phase: [count, seconds]}."""
    from torch._dynamo.utils import compilation_time_metrics
    return {k: [len(v), float(sum(v))] for k, v in compilation_time_metrics.items()}


def compile_counters() -> dict[str, int]:
    from torch._dynamo.utils import counters
    keep = {"stats": ("unique_graphs",), "frames": ("total", "ok"),
            "inductor": ("fxgraph_cache_hit", "fxgraph_cache_miss")}
    return {f"{group}.{name}": int(counters[group][name]) for group, names in keep.items() for name in names}


def profiled_tweak(model: torch.nn.Module, data: list, share: bool, static: bool = True,
                   **tweak_args: Any) -> dict[str, Any]:
    """tt.tweak on a copy of `model`, cold, with its wall time split (see the module docstring)."""
    import torch_tweak as tt
    from torch_tweak._search import tuning
    tweak_module = sys.modules["torch_tweak.tweak"]  # the module, not the function tt.tweak
    from torch_tweak.backends.base import Backend

    detail: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))  # module -> part -> s
    current = [""]  # the module being tuned
    started = [0.0]  # when the engine began its search
    record_s = [0.0]
    real_prepare, real_check = Backend.prepare, tuning.check
    real_groups, real_tuned = tuning.ModuleSearch.groups, tweak_module._Session.tuned
    real_enter = tweak_module._Session.enter
    real_scope = tuning.build_scopes

    def timed(real: Any, charge: Any) -> Any:
        """`real`, with its wall time passed to charge(seconds, *args) after every call."""
        def call(*args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return real(*args, **kwargs)
            finally:
                charge(time.perf_counter() - t0, *args)
        return call

    def start_module(search: Any, node: int) -> Any:
        """The engine starts a module's search (ModuleSearch.groups)."""
        current[0] = search.wrapper_of(node).tt_name
        started[0] = time.perf_counter()
        return real_groups(search, node)

    def end_module(session: Any, node: int) -> Any:
        """The engine has committed the module's last group (_Session.tuned)."""
        detail[session.wrappers[node].tt_name]["total"] += time.perf_counter() - started[0]
        return real_tuned(session, node)

    def charge_build(seconds: float, backend: Any, *_: Any) -> None:
        detail[current[0]][backend.name] += seconds

    def charge_check(seconds: float, *_: Any) -> None:
        detail[current[0]]["check"] += seconds

    def charge_record(seconds: float, *_: Any) -> None:
        record_s[0] += seconds

    prepare, check = timed(real_prepare, charge_build), timed(real_check, charge_check)
    enter = timed(real_enter, charge_record)

    mine = copy.deepcopy(model)
    cold_compiler("tweak")
    torch._dynamo.reset()  # cold_compiler leaves dynamo be; an earlier tweak's compiled code would serve this one
    metrics0, counters0 = compile_metrics(), compile_counters()
    Backend.prepare, tuning.check = prepare, check  # type: ignore
    tuning.ModuleSearch.groups, tweak_module._Session.tuned = start_module, end_module  # type: ignore
    tweak_module._Session.enter = enter  # type: ignore[method-assign]
    if not share:
        tuning.build_scopes = lambda backends, static: contextlib.nullcontext()  # type: ignore[assignment]
    elif not static:  # shared, but dynamic=None left to torch (automatic dynamic shapes)
        tuning.build_scopes = lambda backends, static: real_scope(backends, static=False)  # type: ignore
    try:
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        result = tt.tweak(mine, data, progress=False, cache=False, **tweak_args)
        torch.cuda.synchronize()
        total = time.perf_counter() - t0
    finally:
        Backend.prepare, tuning.check = real_prepare, real_check  # type: ignore
        tuning.ModuleSearch.groups, tweak_module._Session.tuned = real_groups, real_tuned  # type: ignore
        tweak_module._Session.enter = real_enter  # type: ignore[method-assign]
        tuning.build_scopes = real_scope  # type: ignore[assignment]
    metrics1, counters1 = compile_metrics(), compile_counters()
    phases = {k: [v[0] - metrics0.get(k, [0, 0.0])[0], round(v[1] - metrics0.get(k, [0, 0.0])[1], 3)]
              for k, v in metrics1.items()}
    depth_of: dict[str, int] = {}
    for depth in range(result.tree.max_depth + 1):
        for path in result.tree.cut(depth):
            depth_of.setdefault(path, depth)
    by_depth: dict[int, float] = defaultdict(float)
    builds: dict[str, float] = defaultdict(float)
    for path, parts in detail.items():
        by_depth[depth_of.get(path, -1)] += parts["total"]
        for part, seconds in parts.items():
            if part not in ("total", "check"):
                builds[part] += seconds
    check_s = sum(parts["check"] for parts in detail.values())
    build_total = sum(builds.values())
    return {"total_s": total, "build_s": dict(builds), "check_s": check_s,
            "rest_s": total - build_total - check_s, "tune_by_depth_s": dict(by_depth),
            "modules_tuned": len(detail), "selected_depth": result.selected_depth,
            "record_s": record_s[0], "tweak_args": dict(tweak_args),
            "per_module": {path: {k: round(v, 3) for k, v in parts.items()} for path, parts in detail.items()},
            "compile_phases": {k: v for k, v in sorted(phases.items(), key=lambda kv: -kv[1][1]) if v[0]},
            "counters": {k: v - counters0.get(k, 0) for k, v in counters1.items()},
            "chosen": {path: m.backend for path, m in result.modules.items()},
            "table": str(result)}


def warm_process() -> None:
    """One tiny compile first, so the process's one-time start of the compiler (imports,
    worker pool) is charged to no row."""
    cold_compiler("start")
    fn = torch.compile(torch.nn.Linear(8, 8).cuda())
    fn(torch.randn(2, 8, device="cuda"))
    torch.cuda.synchronize()


def run(args: argparse.Namespace) -> dict:
    out: dict[str, Any] = {"environment": environment(), "rows": []}
    warm_process()
    for name in args.models.split(","):
        for dtype_name in args.dtypes.split(","):
            model, data = build(name, DTYPES[dtype_name])
            row: dict[str, Any] = {"model": name, "dtype": dtype_name}
            with torch.no_grad():
                _, row["reduce_overhead_s"] = compiled(model, data, "reduce-overhead")
            if args.no_share:  # first: a later tweak in the same process can only gain from warm state
                row["tweak_no_share"] = profiled_tweak(model, data, share=False)
            row["tweak"] = profiled_tweak(model, data, share=True, static=not args.dynamic_auto,
                                          **json.loads(args.tweak_args))
            row["dynamic_auto"] = args.dynamic_auto
            row["extra"] = [profiled_tweak(model, data, share=True, static=not args.dynamic_auto, **json.loads(extra))
                            for extra in args.extra or []]
            out["rows"].append(row)
            print(json.dumps({k: v for k, v in row.items() if k != "tweak"}, default=str)[:2000], flush=True)
            print(json.dumps({k: v for k, v in row["tweak"].items() if k != "table"}), flush=True)
            del model, data
            torch.cuda.empty_cache()
    return out


def depth_latencies(table: str) -> str:
    """'d0 1.07*, d1 1.19, d2 1.39' from a TweakResult table (* the selected depth)."""
    cells = []
    for line in table.splitlines():
        words = line.replace(">", " ").split()
        if len(words) >= 4 and words[0].isdigit():
            cells.append(f"d{words[0]} {words[3]}" + ("*" if line.lstrip().startswith(">") else ""))
    return ", ".join(cells)


def tweak_runs(row: dict) -> list[tuple[str, dict]]:
    """(what differs, profile) for every tweak of a row, in the order they ran."""
    runs = []
    if row.get("tweak_no_share"):
        runs.append(("no shared compile", row["tweak_no_share"]))
    main_kind = "dynamic=None left to torch" if row.get("dynamic_auto") else ""
    for t in [row["tweak"]] + row.get("extra", []):
        args = ", ".join(f"{k}={v}" for k, v in t.get("tweak_args", {}).items())
        defaults = f"defaults (max_depth {row['tweak_max_depth']})" if "tweak_max_depth" in row else "defaults"
        runs.append(("; ".join(x for x in (main_kind, args) if x) or defaults, t))
    return runs


def markdown(out: dict, runs: int = 1) -> str:
    env = out["environment"]
    md = ["# Where tweak's tuning time goes", "",
          f"Produced by `python bench/tuning_time.py` on one {env['gpu']} (torch {env['torch']}, CUDA "
          f"{env['cuda']}), {runs} run(s) merged with --merge (each run a machine of that kind, not "
          "necessarily the same one: compare ratios within a run, not seconds across runs). Every compile "
          "starts cold (fresh Inductor and Triton cache folder, dynamo reset, tweak's tuning cache off), after "
          "one tiny compile that starts the compiler for the process. Seconds of wall time; latencies of each "
          "depth's whole model in ms (* selected). Rows of one model and dtype in one run ran in the order "
          "shown, in one process.", "",
          "*settings*: what differs from tt.tweak's defaults of that commit. *no shared compile*: each "
          "Inductor candidate compiles on its own, with `dynamic=None` passed as given. *dynamic=None left to "
          "torch*: shared compiles, but automatic dynamic shapes instead of static ones for static signatures.",
          "",
          "| commit | model | dtype | settings | reduce-overhead compile | tweak | tweak / reduce-overhead | "
          "builds (by backend) | checks | rest (record, measure) | by depth first tuned | depth latencies |",
          "|---|---|---|---|---:|---:|---:|---|---:|---:|---|---|"]
    for r in out["rows"]:
        for settings, t in tweak_runs(r):
            builds = ", ".join(f"{k} {v:.1f}" for k, v in sorted(t["build_s"].items(), key=lambda kv: -kv[1]))
            depths = ", ".join(f"d{k} {v:.1f}" for k, v in sorted(t["tune_by_depth_s"].items()))
            md.append(f"| {r.get('commit', env.get('commit', '?'))} | {r['model']} | {r['dtype']} | {settings} | "
                      f"{r['reduce_overhead_s']:.1f} | {t['total_s']:.1f} | {t['total_s'] / r['reduce_overhead_s']:.2f} | "
                      f"{builds} | {t['check_s']:.1f} | {t['rest_s']:.1f} | {depths} | "
                      f"{depth_latencies(t.get('table', ''))} |")
    phases = ("_compile.compile_inner", "bytecode_tracing", "GraphLowering.codegen", "async_compile.wait",
              "CachingAutotuner.benchmark_all_configs")
    profiled = [(r, settings, t) for r in out["rows"] for settings, t in tweak_runs(r) if t.get("compile_phases")]
    if profiled:
        md += ["", "## Inside the compiles", "",
               "Seconds in dynamo's and Inductor's timed phases during the tweak (from "
               "`torch._dynamo.utils.compilation_time_metrics`; phases nest: `_compile.compile_inner` is a "
               "whole compile, `async_compile.wait` waits for Triton's kernel compiles) and the graphs compiled.",
               "", "| commit | model | dtype | settings | graphs compiled | " + " | ".join(f"`{p}`" for p in phases) + " |",
               "|---|---|---|---|---:|" + "---:|" * len(phases)]
        for r, settings, t in profiled:
            cells = [f"{t['compile_phases'].get(p, [0, 0.0])[1]:.1f}" for p in phases]
            md.append(f"| {r.get('commit', env.get('commit', '?'))} | {r['model']} | {r['dtype']} | {settings} | "
                      f"{t['counters'].get('stats.unique_graphs', '-')} | " + " | ".join(cells) + " |")
    return "\n".join(md) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="encoder,resnet50")
    parser.add_argument("--dtypes", default="fp32,bf16")
    parser.add_argument("--no-share", action="store_true", help="also tweak without shared compiles")
    parser.add_argument("--dynamic-auto", action="store_true",
                        help="shared compiles that leave dynamic=None to torch instead of static shapes")
    parser.add_argument("--tweak-args", default="{}", metavar="JSON",
                        help='keyword arguments of tt.tweak, e.g. \'{"max_depth": 1}\'')
    parser.add_argument("--extra", action="append", metavar="JSON",
                        help="another tweak of each row after the first, with these tt.tweak arguments")
    parser.add_argument("--json", default=os.path.join(HERE, "results", "tuning_time.json"))
    parser.add_argument("--md", default=os.path.join(HERE, "results", "tuning_time.md"))
    parser.add_argument("--merge", nargs="+", metavar="JSON", help="write --md from run files")
    args = parser.parse_args()
    if args.merge:
        runs = [json.load(open(path)) for path in args.merge]
        merged = {"environment": runs[0]["environment"],
                  "rows": [dict(r, commit=run["environment"].get("commit", "?"),
                                **{k: v for k, v in run["environment"].items() if k == "tweak_max_depth"})
                           for run in runs for r in run["rows"]]}
        with open(args.md, "w") as f:
            f.write(markdown(merged, len(runs)))
        print(f"written: {args.md}")
        return
    if not torch.cuda.is_available():
        sys.exit("tuning_time needs a CUDA device")
    out = run(args)
    with open(args.json, "w") as f:
        json.dump(out, f, indent=1)
    with open(args.md, "w") as f:
        f.write(markdown(out))
    print(markdown(out))


if __name__ == "__main__":
    main()
