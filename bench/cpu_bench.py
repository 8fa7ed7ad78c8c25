"""torch-tweak against the alternatives on this machine's CPU, model by model, fp32.

Every column gets the same inputs (a few random calls of one shape, cycled), the same
warm-up and the same statistic: the median of 30 timed calls (what a caller waits for, Python
overhead included), taken in blocks of 5 consecutive calls of one column, each opened by 2
untimed calls, the blocks interleaved (A, B, C, then B, C, A...) so that drift falls on all
columns alike and no call is timed in the wake of another column; the interquartile range is
the spread.

    eager        the model as it is
    compile      torch.compile, default mode; its compile time is the wall time of its
                 first three calls
    openvino     the whole model through torch-tweak's OpenVINOBackend (convert_model,
                 LATENCY hint, the model's precision); its build time as compile time
    onnxruntime  the whole model through torch-tweak's ONNXRuntimeBackend (the dynamo
                 exporter, TorchScript where it fails; the CPU provider, its defaults); its
                 export and session time as compile time
    tweak        tt.tweak with its defaults
    tweak-ort    tt.tweak with the default backends plus ONNX Runtime: what ONNX Runtime
                 would bring as a default, and what it costs in tuning time
    tweak-cl     tt.tweak with the default backends plus their channels-last variants
                 (Inductor, Eager): what channels-last alone costs in tuning time
                 (models with a Conv2d only)
    tweak-high   tt.tweak(effort="high"): channels-last, max-autotune for heavy modules
    tweak-bf16   tt.tweak(precision={"bf16": 0.05}): opt-in, lower precision
    tweak-int8   tt.tweak(precision={"int8": 0.05}): opt-in, TorchAO int8 weight-only

Every compiling column starts cold: a fresh Inductor cache folder, Inductor's in-memory caches
cleared, tweak's tuning cache off, and before each tweak column a dynamo reset (tweak's
candidates share their backend from one tweak to the next, and dynamo would hand a later tweak
an earlier one's compiled code). Each column's error is the largest
relative error (max|out - eager| / max|eager|) of its first output tensor over the samples.

Weights are random, built from configs: nothing is downloaded.

    python bench/cpu_bench.py [--models resnet18,bert,encoder] [--columns ...] [--rounds 30]
                              [--json bench/results/runs/cpu-<commit>.json]
    python bench/cpu_bench.py --report RUN.json [RUN2.json ...] [--out bench/results/cpu.md]
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import platform
import statistics
import sys
import time
import traceback
from typing import Any, Callable

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "examples", "Tweak"))
sys.path.insert(0, HERE)
from gpu_bench import call_of, cold_compiler, first_tensor, source_commit  # noqa: E402  (one cold cache, one commit stamp and one sample convention for both benches)

MODELS = ("resnet18", "bert", "encoder")
COLUMNS = ("eager", "compile", "openvino", "onnxruntime", "tweak", "tweak-ort", "tweak-cl", "tweak-high", "tweak-bf16",
           "tweak-int8")
SIZES = {
    "resnet18": "ResNet-18 (torchvision's, or the same architecture defined here), batch 1, 224x224",
    "bert": "BERT 4 layers, hidden 256, 4 heads, batch 1, seq 128",
    "encoder": "examples/Tweak encoder: batch 8, seq 64, d 256, 4 layers",
}
N_SAMPLES = 4


def build(name: str) -> tuple[torch.nn.Module, list]:
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    if name == "resnet18":
        try:
            import torchvision
            model = torchvision.models.resnet18(weights=None).eval()
        except (ImportError, RuntimeError):  # no torchvision, or one built for another torch
            model = ResNet18().eval()
        data = [torch.randn(1, 3, 224, 224, generator=g) for _ in range(N_SAMPLES)]
    elif name == "bert":
        import transformers
        config = transformers.BertConfig(num_hidden_layers=4, hidden_size=256, num_attention_heads=4,
                                         intermediate_size=1024)
        model = transformers.BertModel(config).eval()
        data = [{"input_ids": torch.randint(0, config.vocab_size, (1, 128), generator=g)} for _ in range(N_SAMPLES)]
    elif name == "encoder":
        import encoder
        model = encoder.build("cpu", torch.float32)
        data = encoder.samples("cpu", torch.float32, count=N_SAMPLES)
    else:
        raise ValueError(f"unknown model {name!r}; one of {', '.join(MODELS)}")
    return model, data


class _Block(torch.nn.Module):
    def __init__(self, cin: int, cout: int, stride: int) -> None:
        super().__init__()
        nn = torch.nn
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.relu = nn.ReLU(inplace=True)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.downsample = (nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))
                           if stride != 1 or cin != cout else None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        return self.relu(self.bn2(self.conv2(out)) + identity)


class ResNet18(torch.nn.Module):
    """torchvision's resnet18 (BasicBlock, layers 2-2-2-2, the same modules and names), for a
    machine whose torchvision cannot be imported with its torch."""

    def __init__(self, classes: int = 1000) -> None:
        super().__init__()
        nn = torch.nn
        self.conv1 = nn.Conv2d(3, 64, 7, 2, 3, bias=False)
        self.bn1 = nn.BatchNorm2d(64)
        self.relu = nn.ReLU(inplace=True)
        self.maxpool = nn.MaxPool2d(3, 2, 1)
        widths, cin = (64, 128, 256, 512), 64
        for i, width in enumerate(widths):
            stride = 1 if i == 0 else 2
            setattr(self, f"layer{i + 1}", nn.Sequential(_Block(cin, width, stride), _Block(width, width, 1)))
            cin = width
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(512, classes)
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return self.fc(torch.flatten(self.avgpool(x), 1))


def runner(fn: Callable[..., Any], data: list) -> Callable[[int], Any]:
    def run(i: int) -> Any:
        a, k = call_of(data[i % len(data)])
        return fn(*a, **k)
    return run


# ----------------------------------------------------------------- columns


def compiled(model: torch.nn.Module, data: list) -> tuple[Callable[..., Any], float]:
    cold_compiler("compile")
    fn = torch.compile(copy.deepcopy(model))
    t0 = time.perf_counter()
    for i in range(3):
        a, k = call_of(data[i % len(data)])
        fn(*a, **k)
    return fn, time.perf_counter() - t0


def preload() -> None:
    """Inductor and OpenVINO started once, untimed, before any column: the first compile of a
    process pays their start-up (imports, worker pools), which would otherwise fall on
    whichever column comes first."""
    import gpu_bench
    gpu_bench.DEVICE = "cpu"
    gpu_bench.preload_inductor()
    lin = torch.nn.Linear(8, 8).eval()
    with torch.no_grad():
        try:
            openvino(lin, [torch.randn(2, 8)])
        except Exception:  # no OpenVINO here: its column reports that itself
            pass


def openvino(model: torch.nn.Module, data: list) -> tuple[Callable[..., Any], float]:
    from torch_tweak.backends import OpenVINOBackend
    t0 = time.perf_counter()
    fn = OpenVINOBackend().prepare(copy.deepcopy(model), [call_of(d) for d in data], torch.device("cpu"))
    return fn, time.perf_counter() - t0


def onnxruntime(model: torch.nn.Module, data: list) -> tuple[Callable[..., Any], float]:
    from torch_tweak.backends import ONNXRuntimeBackend
    t0 = time.perf_counter()
    fn = ONNXRuntimeBackend().prepare(copy.deepcopy(model), [call_of(d) for d in data], torch.device("cpu"))
    return fn, time.perf_counter() - t0


def tweaked(model: torch.nn.Module, data: list, column: str) -> tuple[Callable[..., Any], float, Any]:
    import torch_tweak as tt
    mine = copy.deepcopy(model)
    options: dict[str, Any] = {}
    if column == "tweak-cl":
        from torch_tweak.backends import TorchEagerBackend, TorchInductorBackend
        options["strategy"] = tt.HighestThroughputStrategy(
            tt.default_backends("cpu") + [TorchInductorBackend(memory_format="channels_last"),
                                          TorchEagerBackend(memory_format="channels_last")])
    elif column == "tweak-ort":
        from torch_tweak.backends import ONNXRuntimeBackend
        options["strategy"] = tt.HighestThroughputStrategy(tt.default_backends("cpu") + [ONNXRuntimeBackend()])
    elif column == "tweak-high":
        options["effort"] = "high"
    elif column == "tweak-bf16":
        options["precision"] = {"bf16": 0.05}
    elif column == "tweak-int8":
        options["precision"] = {"int8": 0.05}
    cold_compiler(column)
    # dynamo reset too: an earlier tweak column's Inductor candidates share their backend, and
    # dynamo would hand this tweak their compiled code (ResNet-18: 62.6 s cold, 22.7 s the
    # second time in one process); the columns built before recompile at their next call
    torch._dynamo.reset()
    t0 = time.perf_counter()
    result = tt.tweak(mine, data, progress=False, cache=False, **options)
    return mine, time.perf_counter() - t0, result


def has_conv(model: torch.nn.Module) -> bool:
    return any(isinstance(m, torch.nn.Conv2d) for m in model.modules())


# ---------------------------------------------------------------- measuring


BLOCK = 5
"""Timed calls of one column in a row, after SETTLE untimed ones."""
SETTLE = 2
"""Untimed calls that open each block: on a 2-core machine what ran just before (torch's OpenMP
threads still spinning after eager, OpenVINO's workers) slows a call by up to 1.5x, and more
than one call later (two identical OpenVINO tweaks of BERT measured 5.0 and 6.8 ms interleaved
call by call with eager, 4.5 and 4.5 ms without it)."""


def measure(runs: dict[str, Callable[[int], Any]], warmup: int, rounds: int) -> dict[str, dict]:
    """`rounds` timed calls per column, in blocks of BLOCK consecutive calls of one column,
    each opened by SETTLE untimed calls; the blocks interleaved (A, B, C, A, B, C...), the
    order rotated by one each time, so that drift falls on all columns alike and none is
    timed in the wake of another."""
    times: dict[str, list[float]] = {name: [] for name in runs}
    names = list(runs)
    with torch.no_grad():
        for run in runs.values():
            for i in range(warmup):
                run(i)
        i = 0
        while min(len(t) for t in times.values()) < rounds:
            for name in names[i % len(names):] + names[:i % len(names)]:
                run = runs[name]
                for j in range(SETTLE):
                    run(i + j)
                for j in range(min(BLOCK, rounds - len(times[name]))):
                    t0 = time.perf_counter_ns()
                    run(i + j)
                    times[name].append((time.perf_counter_ns() - t0) / 1e6)
            i += 1
    out = {}
    for name, ts in times.items():
        q = statistics.quantiles(ts, n=4)
        out[name] = {"ms": statistics.median(ts), "q25": q[0], "q75": q[2], "min": min(ts), "max": max(ts)}
    return out


def bench_one(name: str, columns: list[str], args: argparse.Namespace) -> dict:
    row: dict[str, Any] = {"model": name, "size": SIZES[name], "ms": {}, "spread": {}, "compile_s": {},
                           "errors": {}, "max_error": {}, "tweak": {}}
    model, data = build(name)
    with torch.no_grad():
        refs = [first_tensor(model(*call_of(d)[0], **call_of(d)[1])) for d in data]
    fns: dict[str, Callable[..., Any]] = {"eager": model}
    for column in columns:
        if column == "eager":
            continue
        if column == "tweak-cl" and not has_conv(model):
            continue  # channels-last applies to Conv2d modules only
        if column == "tweak-int8" and has_conv(model):
            continue  # int8 weight-only quantizes nn.Linear; a convolution net has one (its head): not worth the run
        print(f"  {name}: {column}", flush=True)
        try:
            with torch.no_grad():
                if column == "compile":
                    fns[column], row["compile_s"][column] = compiled(model, data)
                elif column == "openvino":
                    fns[column], row["compile_s"][column] = openvino(model, data)
                elif column == "onnxruntime":
                    fns[column], row["compile_s"][column] = onnxruntime(model, data)
                else:
                    fns[column], row["compile_s"][column], result = tweaked(model, data, column)
                    row["tweak"][column] = {
                        "depth": result.selected_depth, "speedup_side_by_side": result.speedup,
                        "chosen": {p: m.backend for p, m in result.modules.items() if m.kept and m.backend},
                        "lower_precision": result.lower_precision, "table": str(result)}
        except Exception as exc:
            row["errors"][column] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:300]}"
            traceback.print_exc()
    with torch.no_grad():
        for column, fn in fns.items():
            worst = 0.0
            for d, ref in zip(data, refs):
                a, k = call_of(d)
                out = first_tensor(fn(*a, **k))
                worst = max(worst, ((out.float() - ref).abs().max() / ref.abs().max()).item())
            row["max_error"][column] = worst
    print(f"  {name}: measuring {', '.join(fns)}", flush=True)
    load = os.getloadavg()
    stats = measure({c: runner(fn, data) for c, fn in fns.items()}, args.warmup, args.rounds)
    row["loadavg"] = [load, os.getloadavg()]
    for column, s in stats.items():
        row["ms"][column] = s["ms"]
        row["spread"][column] = [s["q25"], s["q75"], s["min"], s["max"]]
    return row


def environment() -> dict:
    import torch_tweak
    from torch_tweak._store.serial import device_name
    info = {"cpu": device_name(torch.device("cpu")), "cores": os.cpu_count(), "torch_threads": torch.get_num_threads(),
            "torch": torch.__version__, "python": platform.python_version(), "torch_tweak": torch_tweak.__version__,
            "commit": source_commit()}
    for mod in ("transformers", "torchvision", "openvino", "torchao", "onnxruntime"):
        try:
            info[mod] = __import__(mod).__version__
        except Exception:
            info[mod] = "missing"
    return info


# ------------------------------------------------------------------- report


def report(paths: list[str], out: str) -> None:
    runs = [json.load(open(p)) for p in paths]
    run = runs[0]
    env = run["environment"]
    by_model: dict[str, dict] = {}
    for one in runs:  # a later run's row of a model replaces an earlier one's
        for r in one["rows"]:
            by_model[r["model"]] = r
    rows = [by_model[m] for m in MODELS if m in by_model] + [r for m, r in by_model.items() if m not in MODELS]
    kept = [(p, one, [r["model"] for r in one["rows"] if by_model[r["model"]] is r]) for p, one in zip(paths, runs)]
    cols = [c for c in COLUMNS if any(c in r["ms"] or c in r["errors"] for r in rows)]
    md = ["# torch-tweak on the CPU", "",
          f"Produced by `python bench/cpu_bench.py` on {env['cpu']} ({env['cores']} cores, torch using "
          f"{env['torch_threads']} threads; torch {env['torch']}, Python {env['python']}, transformers "
          f"{env['transformers']}, torchvision {env['torchvision']}, OpenVINO {env['openvino']}, TorchAO "
          f"{env['torchao']}{', ONNX Runtime ' + env['onnxruntime'] if env.get('onnxruntime') else ''}; torch-tweak at commit {env['commit']}), "
          + ", ".join(f"[{os.path.relpath(p, os.path.dirname(os.path.abspath(out)))}]"
                      f"({os.path.relpath(p, os.path.dirname(os.path.abspath(out)))}) ({', '.join(models)}, at "
                      f"{one['environment']['commit']})" for p, one, models in kept if models)
          + " (each row from one run, its columns measured interleaved in that run), "
          f"fp32, random weights, {run['settings']['samples']} random calls per model cycled; per column "
          f"{run['settings']['warmup']} warm-up calls, then {run['settings']['rounds']} timed calls "
          f"{'in interleaved blocks of ' + str(run['settings']['block']) + ' (each after 2 untimed calls)' if run['settings'].get('block') else 'in interleaved rounds of one call'}: "
          "the median, and the spread as the interquartile range over the median.", "",
          "The machine is shared: other work ran on its cores during the run (load average before and after "
          "each model's measurement below), so read the figures as ratios within a row, measured interleaved, "
          "not as absolute latencies.", "",
          "## Latency (ms per call, median; spread) and speedup against eager", ""]
    md.append("| model | " + " | ".join(cols) + " |")
    md.append("|---|" + "---:|" * len(cols))
    for r in rows:
        cells = []
        for c in cols:
            if c in r["ms"]:
                q25, q75 = r["spread"][c][:2]
                cells.append(f"{r['ms'][c]:.2f} ({(q75 - q25) / r['ms'][c] * 100:.0f}%)")
            else:
                cells.append("failed" if c in r["errors"] else "-")
        md.append(f"| {r['model']} | " + " | ".join(cells) + " |")
    md += ["", "| model | " + " | ".join(f"{c} vs eager" for c in cols[1:]) + " | load avg (1 min) |",
           "|---|" + "---:|" * len(cols)]
    for r in rows:
        e = r["ms"].get("eager")
        cells = [f"{e / r['ms'][c]:.2f}x" if c in r["ms"] and e else "-" for c in cols[1:]]
        load = r.get("loadavg")
        md.append(f"| {r['model']} | " + " | ".join(cells) + (f" | {load[0][0]:.1f} to {load[1][0]:.1f} |"
                                                                 if load else " | - |"))
    md += ["", "## Compile and tuning time (s), cold caches", "",
           "| model | " + " | ".join(cols[1:]) + " |", "|---|" + "---:|" * (len(cols) - 1)]
    for r in rows:
        md.append(f"| {r['model']} | " + " | ".join(f"{r['compile_s'][c]:.1f}" if c in r["compile_s"] else "-"
                                                    for c in cols[1:]) + " |")
    md += ["", "## Largest relative error against eager (first output tensor, every sample)", "",
           "| model | " + " | ".join(cols[1:]) + " |", "|---|" + "---:|" * (len(cols) - 1)]
    for r in rows:
        md.append(f"| {r['model']} | " + " | ".join(f"{r['max_error'][c]:.2g}" if c in r["max_error"] else "-"
                                                    for c in cols[1:]) + " |")
    md += ["", "## What each tweak kept", "", "| model | column | depth | side-by-side speedup | backends kept |",
           "|---|---|---:|---:|---|"]
    for r in rows:
        for c, t in r["tweak"].items():
            kinds: dict[str, int] = {}
            for b in t["chosen"].values():
                kinds[b] = kinds.get(b, 0) + 1
            picks = ", ".join(f"{k} x{v}" for k, v in sorted(kinds.items())) or "none (untuned)"
            speed = f"{t['speedup_side_by_side']:.2f}x" if t["speedup_side_by_side"] else "-"
            md.append(f"| {r['model']} | {c} | {t['depth'] if t['depth'] is not None else '-'} | {speed} | {picks} |")
    errors = [(r["model"], c, e) for r in rows for c, e in r["errors"].items()]
    if errors:
        md += ["", "## Columns that failed", ""] + [f"- {m} {c}: {e}" for m, c, e in errors]
    md += ["", "## tweak's tables", ""]
    for r in rows:
        for c, t in r["tweak"].items():
            md += [f"{r['model']} {c}:", "```", t["table"], "```", ""]
    with open(out, "w") as f:
        f.write("\n".join(md) + "\n")
    print(f"written: {out}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--columns", default=",".join(COLUMNS))
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--json", default=None)
    parser.add_argument("--report", metavar="JSON", nargs="+", help="write cpu.md from run files")
    parser.add_argument("--out", default=os.path.join(HERE, "results", "cpu.md"))
    args = parser.parse_args()
    if args.report:
        report(args.report, args.out)
        return
    path = args.json or os.path.join(HERE, "results", "runs", f"cpu-{source_commit().replace('+', '-')}.json")
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    columns = [c for c in args.columns.split(",") if c]
    unknown = sorted(set(columns) - set(COLUMNS))
    if unknown:
        sys.exit(f"unknown column {', '.join(unknown)}; the columns are {', '.join(COLUMNS)}")
    out = {"environment": environment(), "settings": {"warmup": args.warmup, "rounds": args.rounds, "block": BLOCK,
                                                       "samples": N_SAMPLES, "columns": columns}, "rows": []}
    preload()
    for name in [m for m in args.models.split(",") if m]:
        t0 = time.perf_counter()
        try:
            row = bench_one(name, columns, args)
        except Exception as exc:
            traceback.print_exc()
            row = {"model": name, "size": SIZES.get(name, ""), "ms": {}, "spread": {}, "compile_s": {},
                   "errors": {"all": f"{type(exc).__name__}: {exc}"}, "max_error": {}, "tweak": {}}
        row["wall_s"] = time.perf_counter() - t0
        out["rows"].append(row)
        print(json.dumps({k: row.get(k) for k in ("model", "ms", "compile_s", "errors", "wall_s")}), flush=True)
        with open(path, "w") as f:
            json.dump(out, f, indent=1)
    print(f"written: {path}")


if __name__ == "__main__":
    main()
