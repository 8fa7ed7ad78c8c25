"""Serving a stream of requests whose shapes vary: torch-tweak against the one-line alternatives.

A service does not see the shapes a model was tuned on: a vision service sees every batch
size its batcher forms, an embedding service every batch size and every padded length. Each
row here is such a stream, with random weights built from configs:

    resnet50  torchvision ResNet-50, 224x224, 100 requests of batch 1-16
    vit       timm ViT-B/16, 224x224, 100 requests of batch 1-16
    bert      BERT-base without its pooler, 120 requests of batch 1/2/4/8, each row a random
              length 8-256, the batch padded to its longest row (padding id 0) with its
              attention mask
    bert-pooler  the same with its pooler, as BertModel(BertConfig()) builds it: its tanh
              output is checked too (the error of both outputs is shown)
    (--cpu: resnet18 at 112x112, 24 requests of batch 1-8, and a 4-layer BERT of width 256,
    24 requests of batch 1/2/4 and lengths 8-128: a table for this machine's CPU, with
    OpenVINO's dynamic shapes; a few minutes on 2 cores)

Columns, each on a copy of the same model and the same requests:

    eager            the model as it is
    compile          torch.compile, default mode (torch's automatic dynamic shapes; cuda, or
                     --columns on the CPU)
    dynamic          torch.compile(dynamic=True)
    reduce-overhead  torch.compile(mode="reduce-overhead") (cuda)
    openvino         openvino.convert_model with dynamic shapes, compiled for the CPU at the row's
                     own precision (INFERENCE_PRECISION_HINT f32 for fp32 rows) (--cpu)
    openvino-default the same at OpenVINO's default precision, which is bf16 on a CPU with bf16
                     instructions (--cpu): shown with its error, not counted as the best other
                     column, since tweak holds its candidates to the row's own tolerance
    tweak            tt.tweak on the first 8 requests of the stream (the samples a user has),
                     its defaults, cache=False; on the CPU with shapes= declaring the ranges of
                     both streams (vision: batch 1-16; bert: batch 1-4, length 8-128), as a
                     user who knows the traffic would (--no-shapes: without), and depth 0
                     only, so that a run takes minutes on 2 cores (--max-depth 1: tweak's default)

Passes, per column, one after the other (a column's passes run before the next column is
built; dynamo is reset and the compiler caches are fresh before each build, as a user's first
run is):

    cold   the build (compile, tuning) plus the stream served once: what a user waits for
           before the service is warm; tweak's tuning time is also given alone
    warm   the same stream again (median of --rounds passes)
    new    a stream of shapes the first did not have (vision: batch 17-24 outside the range
           seen; bert: lengths the first stream never padded to), first sight and warm

Then the warm passes are measured again side by side (--sequential: not): every column kept
built, each serves both streams once more, and in each of --rounds rounds (at least 3) every
column in turn serves the stream and the new stream, the order rotated per round; the medians
are the warm and new-warm figures, so a drift of the machine's speed between two columns'
passes falls on all of them alike.

Each request is timed whole, the device synchronised after it (a service waits for each
answer); a pass's figure is the sum over its requests. Every column's output is checked
against eager's on the valid positions (bert: the rows' unpadded tokens; last_hidden_state),
as the largest absolute difference over eager's largest magnitude, over both streams.

    python bench/serving_bench.py [--rows resnet50:bf16,bert:bf16] [--columns ...] [--rounds 3]
                                  [--json bench/results/runs/serving-<commit>.json]
    python bench/serving_bench.py --cpu [--rows resnet18:fp32,bert:fp32] [--no-shapes]
    python bench/serving_bench.py --cpu --smoke   # tiny models and streams, every column checked, no figures
                                                  # (minutes on 2 cores, most of it compiling)

On the CPU each row also records the load average before and after each column, and the share
of the CPUs other processes took during it (torch_tweak._core.cpu_load: this process and its compile
workers are not others): the machine may be shared, and a figure measured beside other work is
not the model's alone.
    python bench/serving_bench.py --report RUN.json [...] [--out bench/results/serving.md]

--fresh is issue 57's measurement (docs/serving.md), prepared to finish within 8 minutes on one
H100: stock BERT (pooler on, bf16) and ResNet-50, tuned on the first 8 requests of their streams;
each column (BERT: eager, tweak, reduce-overhead, a CUDA graph per request shape, dynamic,
compile; ResNet-50: eager, tweak, reduce-overhead) serves the stream cold and warm, then a fresh
stream of shapes no request had (BERT: batches 1-16 of lengths 1 to the position table;
ResNet-50: the batch sizes the stream never had) first and warm, tweak's new buckets waited for
between the two. Each row's verdict sets tweak against the best other column (warm and fresh,
targets 3x for BERT and 1.2x for ResNet-50), its fresh first pass against eager's warm pass of
it (at most 1.5x), and its tuning plus first pass against the cold pass of the column it is set
against (at most 1.5x); for ResNet-50 a per-batch breakdown (ms, kernel time by kind, the rest:
launch and host, tweak's bucket and padding) names the largest gap to reduce-overhead. Columns
that would start past FRESH_BUDGET_S are skipped and said so.
    python bench/serving_bench.py --fresh [--json bench/results/runs/serving-fresh-<commit>-cuda.json]
    python bench/serving_bench.py --fresh --smoke   # tiny models on the CPU: under a minute of its work
"""

from __future__ import annotations

import argparse
import copy
import gc
import json
import os
import random
import statistics
import sys
import tempfile
import time
import traceback
from typing import Any, Callable

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from gpu_bench import cold_compiler, first_tensor, run_file_name, source_commit  # noqa: E402  (one cold cache and commit stamp for every bench)

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
CUDA_COLUMNS = ("eager", "compile", "dynamic", "reduce-overhead", "tweak")
CPU_COLUMNS = ("eager", "dynamic", "openvino", "openvino-default", "tweak")
COLUMN_ORDER = ("eager", "compile", "dynamic", "reduce-overhead", "openvino", "openvino-default", "tweak")
LOWER_PRECISION = frozenset({"openvino-default"})
"""Columns that may compute in a lower precision than the row's dtype: shown with their error,
never the best other column tweak is compared with (tweak holds its candidates to the row's
own tolerance)."""
OV_PRECISION = {"fp32": "f32", "bf16": "bf16"}
"""The report's column order (tweak last, beside its ratio)."""
N_TUNE = 8
DEVICE = "cuda"
SMOKE = False
"""--smoke: tiny models and streams, one round: checks that every column serves and matches eager."""
MAX_DEPTH: int | None = None
INTERLEAVE = True  # --sequential: the warm figures of each column's own passes only
"""tweak's max_depth: None is its default (cuda); --cpu: 0 unless --max-depth says otherwise."""
SMOKE_TOLERANCE = 1e-3
"""--smoke: the largest error against eager a column may have (fp32, relative to eager's largest value)."""


def sync() -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()


# ------------------------------------------------------------------ streams


class Request:
    """One call: its keyword or positional arguments and, for masked rows, the mask of the
    valid positions of its first output."""

    def __init__(self, args: tuple, kwargs: dict, valid: torch.Tensor | None = None) -> None:
        self.args, self.kwargs, self.valid = args, kwargs, valid

    def shape(self) -> tuple:
        t = self.args[0] if self.args else self.kwargs["input_ids"]
        return tuple(t.shape)


def vision_stream(n: int, sizes: list[int], side: int, dtype: torch.dtype, seed: int) -> list[Request]:
    rng = random.Random(seed)
    g = torch.Generator().manual_seed(seed)
    return [Request((torch.randn(rng.choice(sizes), 3, side, side, generator=g).to(DEVICE, dtype),), {})
            for _ in range(n)]


def text_stream(n: int, batches: list[int], lengths: list[int], vocab: int, seed: int) -> list[Request]:
    """Batches of rows of random lengths, padded to the batch's longest with id 0, with their
    attention mask; the valid positions are the rows' own tokens."""
    rng = random.Random(seed)
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        rows = [rng.choice(lengths) for _ in range(rng.choice(batches))]
        width = max(rows)
        ids = torch.randint(1, vocab, (len(rows), width), generator=g)
        mask = torch.zeros(len(rows), width, dtype=torch.long)
        for r, length in enumerate(rows):
            mask[r, :length] = 1
        ids = ids * mask
        out.append(Request((), {"input_ids": ids.to(DEVICE), "attention_mask": mask.to(DEVICE)},
                           mask.to(DEVICE).bool()))
    return out


class BasicBlock(torch.nn.Module):
    """ResNet's basic block (two 3x3 convolutions and a shortcut), as torchvision's."""

    def __init__(self, inp: int, out: int, stride: int) -> None:
        super().__init__()
        nn = torch.nn
        self.conv1, self.bn1 = nn.Conv2d(inp, out, 3, stride, 1, bias=False), nn.BatchNorm2d(out)
        self.conv2, self.bn2 = nn.Conv2d(out, out, 3, 1, 1, bias=False), nn.BatchNorm2d(out)
        self.downsample = (nn.Sequential(nn.Conv2d(inp, out, 1, stride, bias=False), nn.BatchNorm2d(out))
                           if stride != 1 or inp != out else nn.Identity())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.relu(self.bn1(self.conv1(x)))
        return torch.relu(self.bn2(self.conv2(y)) + self.downsample(x))


def resnet18_here() -> torch.nn.Module:
    """ResNet-18's architecture (torchvision's layers, widths and strides), for a machine
    without torchvision."""
    nn = torch.nn
    stages, inp = [], 64
    for out, stride in ((64, 1), (128, 2), (256, 2), (512, 2)):
        stages.append(nn.Sequential(BasicBlock(inp, out, stride), BasicBlock(out, out, 1)))
        inp = out
    return nn.Sequential(nn.Conv2d(3, 64, 7, 2, 3, bias=False), nn.BatchNorm2d(64), nn.ReLU(), nn.MaxPool2d(3, 2, 1),
                         *stages, nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(512, 1000))


def vision_model(name: str) -> torch.nn.Module:
    """torchvision's model by name (random weights); ResNet-18 built here when torchvision is
    not installed (the CPU rows need only torch)."""
    try:
        import torchvision
    except Exception:  # not installed, or built for another torch
        if name == "resnet18":
            return resnet18_here()
        raise
    return getattr(torchvision.models, name)(weights=None)


def build(name: str, dtype: torch.dtype, seed: int) -> tuple[torch.nn.Module, list[Request], list[Request], str, dict]:
    """The model (random weights, eval), the stream, the new-shapes stream, their description,
    and the ranges both streams take (what tweak's shapes= declares on the CPU)."""
    torch.manual_seed(0)
    if name in ("resnet50", "resnet18", "vit"):
        if name == "vit":
            import timm
            model = timm.create_model("vit_base_patch16_224", pretrained=False)
        else:
            model = vision_model(name)
        label = name + (" (ResNet-18's layers built here: torchvision not installed)"
                        if isinstance(model, torch.nn.Sequential) else "")
        side = 224 if DEVICE == "cuda" or name == "vit" else 32 if SMOKE else 112
        top = 16 if DEVICE == "cuda" else 4 if SMOKE else 8
        model = model.to(DEVICE, dtype).eval()
        stream = vision_stream(100 if DEVICE == "cuda" else 8 if SMOKE else 24, list(range(1, top + 1)), side, dtype,
                               seed)
        new = vision_stream(len(stream) // 2, list(range(top + 1, top + 9)), side, dtype, seed + 1)
        what = f"{label}, {side}x{side}, {len(stream)} requests of batch 1-{top}; new: batch {top + 1}-{top + 8}"
        ranges = {"batch": (1, top + 8)}
    elif name in ("bert", "bert-pooler"):
        import transformers
        if DEVICE == "cuda":
            config, batches, top, n = transformers.BertConfig(), [1, 2, 4, 8], 256, 120
        elif SMOKE:
            config = transformers.BertConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=2,
                                             intermediate_size=128, vocab_size=1000)
            batches, top, n = [1, 2, 4], 32, 8
        else:
            config = transformers.BertConfig(hidden_size=256, num_hidden_layers=4, num_attention_heads=4,
                                             intermediate_size=1024)
            batches, top, n = [1, 2, 4], 128, 24
        model = transformers.BertModel(config, add_pooling_layer=name == "bert-pooler").to(DEVICE, dtype).eval()
        rng = random.Random(seed)
        seen = sorted(rng.sample(range(8, top + 1), (top - 7) // 2))
        unseen = sorted(set(range(8, top + 1)) - set(seen))
        stream = text_stream(n, batches, seen, config.vocab_size, seed)
        widths = {r.shape()[1] for r in stream}
        new = [r for r in text_stream(4 * n, batches, unseen, config.vocab_size, seed + 1)
               if r.shape()[1] not in widths][: n // 2]
        what = (f"BERT {config.num_hidden_layers} layers, width {config.hidden_size}, {len(stream)} requests of batch "
                f"{'/'.join(map(str, batches))}, rows of length 8-{top} padded to the longest (attention mask); "
                f"new: {len(new)} requests padded to lengths the stream never had")
        ranges = {"batch": (1, max(batches)), "length": (8, top)}
    else:
        raise ValueError(f"unknown row {name!r}")
    return model, stream, new, what, ranges


def call(fn: Callable[..., Any], r: Request) -> Any:
    return fn(*r.args, **r.kwargs)


# ------------------------------------------------------------------ columns


def compiled(model: torch.nn.Module, **options: Any) -> Callable[..., Any]:
    return torch.compile(copy.deepcopy(model), **options)


def openvino_dynamic(model: torch.nn.Module, sample: Request, precision: str | None) -> Callable[..., Any]:
    """openvino.convert_model with every input dimension dynamic, compiled for the CPU with the
    latency hint and the inference precision `precision` (None: OpenVINO's own default, which is
    bf16 on a CPU with bf16 instructions); returns the outputs as torch tensors in the model's
    output order."""
    import openvino as ov
    example = sample.kwargs if sample.kwargs else sample.args
    names = list(sample.kwargs) if sample.kwargs else None
    ranks = [t.dim() for t in (sample.kwargs.values() if sample.kwargs else sample.args)]
    shapes = [ov.PartialShape([-1] * r) for r in ranks]
    inputs = list(zip(names, shapes)) if names else shapes
    converted = ov.convert_model(copy.deepcopy(model), example_input=example, input=inputs)
    config = {"PERFORMANCE_HINT": "LATENCY"}
    if precision is not None:
        config["INFERENCE_PRECISION_HINT"] = precision
    compiled_model = ov.Core().compile_model(converted, "CPU", config)
    request = compiled_model.create_infer_request()

    def run(*args: Any, **kwargs: Any) -> Any:
        feed = [t.numpy() for t in (kwargs.values() if kwargs else args)]
        out = request.infer(feed)
        return tuple(torch.from_numpy(out[o]) for o in compiled_model.outputs)

    return run


def serve(fn: Callable[..., Any], stream: list[Request]) -> float:
    """Seconds to serve the stream: each request timed whole, the device synchronised after it."""
    total = 0.0
    with torch.no_grad():
        for r in stream:
            sync()
            t0 = time.perf_counter()
            call(fn, r)
            sync()
            total += time.perf_counter() - t0
    return total


def outputs_of(out: Any) -> list[torch.Tensor]:
    """The tensors of a call's output: the first (a hidden state, logits) and, for a model
    with a pooler, its pooled output."""
    found = [first_tensor(out)]
    pooled = getattr(out, "pooler_output", None)
    if isinstance(pooled, torch.Tensor):
        found.append(pooled)
    return found


def references(model: torch.nn.Module, streams: list[list[Request]]) -> list[list[list[torch.Tensor]]]:
    with torch.no_grad():
        return [[[t.float().clone() for t in outputs_of(call(model, r))] for r in s] for s in streams]


def error_of(fn: Callable[..., Any], streams: list[list[Request]], refs: list[list[list[torch.Tensor]]]) -> float:
    """Largest |out - eager| over eager's largest magnitude, per output tensor, on the valid
    positions of every request (a hidden state's unpadded tokens; a pooled output's rows)."""
    worst = 0.0
    with torch.no_grad():
        for s, rs in zip(streams, refs):
            for r, refs_of_call in zip(s, rs):
                for out, ref in zip(outputs_of(call(fn, r)), refs_of_call):
                    out = out.float().to(ref.device)
                    diff = (out - ref).abs()
                    if r.valid is not None and diff.dim() == 3:
                        diff, ref = diff[r.valid], ref[r.valid]
                    worst = max(worst, (diff.max() / ref.abs().max().clamp_min(1e-30)).item())
    sync()
    return worst


def load_average() -> float | None:
    """The 1-minute load average (None where the system has none)."""
    try:
        return round(os.getloadavg()[0], 2)
    except (AttributeError, OSError):
        return None


def others_share(before: tuple[float, float] | None, after: tuple[float, float] | None) -> float | None:
    """The share of the machine's CPUs other processes took between two readings of
    torch_tweak._core.cpu_load (this process and its compile workers are not others); None unknown."""
    if before is None or after is None or after[1] <= before[1]:
        return None
    return round(max(0.0, (after[0] - before[0]) / (after[1] - before[1])), 3)


def tweak_column(model: torch.nn.Module, stream: list[Request], ranges: dict | None, row: dict) -> Any:
    """tt.tweak on a copy of the model and the stream's first N_TUNE requests (shapes=ranges on
    the CPU); its table and the ranges go in the row."""
    import torch_tweak as tt

    fn = copy.deepcopy(model)
    tuned = [r.kwargs if r.kwargs else r.args[0] for r in stream[:N_TUNE]]
    options: dict[str, Any] = {"shapes": ranges} if ranges else {}
    if MAX_DEPTH is not None:
        options["max_depth"] = MAX_DEPTH
    if SMOKE:
        options.update(measure={"rounds_max": 5, "time_cap": 0.5})
    # the time the correctness rule's higher-precision reference takes, part of the tuning time
    from torch_tweak._search import tuning
    made = tuning.reference_of
    spent = [0.0]

    def timed(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return made(*args, **kwargs)
        finally:
            spent[0] += time.perf_counter() - start

    tuning.reference_of = timed
    try:
        result = tt.tweak(fn, tuned, progress=False, cache=False, **options)
    finally:
        tuning.reference_of = made
    row["tweak_reference_s"] = spent[0]
    row["tweak_modules"] = str(result.modules)
    row["tweak_table"] = str(result)
    row["tweak_shapes"] = ranges
    row["tweak_max_depth"] = MAX_DEPTH
    row["tweak_kept"] = result.selected_depth
    return fn


def cold_start(column: str) -> None:
    """Before a column is built: dynamo reset, memory collected, the compiler caches fresh, as a
    user's first run is."""
    torch._dynamo.reset()
    gc.collect()
    if DEVICE == "cuda":
        torch.cuda.empty_cache()
    cold_compiler(column)


def bench_row(name: str, dtype_name: str, columns: list[str], rounds: int, seed: int,
              partial: Callable[[dict], None] = lambda row: None, declare: bool = True) -> dict:
    dtype = DTYPES[dtype_name]
    model, stream, new, what, ranges = build(name, dtype, seed)
    refs = references(model, [stream, new])
    row: dict[str, Any] = {"model": name, "dtype": dtype_name, "stream": what, "device": DEVICE,
                           "shapes": len({r.shape() for r in stream}), "new_shapes": len({r.shape() for r in new}),
                           "cold_s": {}, "warm_s": {}, "new_first_s": {}, "new_s": {}, "error": {}, "errors": {},
                           "first_sight": True}  # run files before this key: see report()
    from torch_tweak._core import cpu_load
    if DEVICE == "cpu":
        row["load"], row["others_share"] = {}, {}
    alive: dict[str, Callable[..., Any]] = {}  # the columns that served, for the interleaved rounds
    for column in columns:
        print(f"  {name} {dtype_name}: {column}", flush=True)
        before, reading = load_average(), cpu_load.reading()
        cold_start(column)
        try:
            sync()
            t0 = time.perf_counter()
            if column == "eager":
                fn: Callable[..., Any] = model
            elif column == "compile":
                fn = compiled(model)
            elif column == "dynamic":
                fn = compiled(model, dynamic=True)
            elif column == "reduce-overhead":
                fn = compiled(model, mode="reduce-overhead")
            elif column == "openvino":
                fn = openvino_dynamic(model, stream[0], OV_PRECISION[dtype_name])
            elif column == "openvino-default":
                fn = openvino_dynamic(model, stream[0], None)
            elif column == "tweak":
                fn = tweak_column(model, stream, ranges if DEVICE == "cpu" and declare else None, row)
                sync()
                row["tune_s"] = time.perf_counter() - t0
            else:
                raise ValueError(f"unknown column {column!r}")
            row["cold_s"][column] = time.perf_counter() - t0 + serve(fn, stream)
            row["warm_s"][column] = statistics.median(serve(fn, stream) for _ in range(rounds))
            row["new_first_s"][column] = serve(fn, new)  # first sight: nothing before served these shapes
            row["new_s"][column] = statistics.median(serve(fn, new) for _ in range(rounds))
            # checked last: the check serves both streams, the new one's shapes included
            row["error"][column] = error_of(fn, [stream, new], refs) if column != "eager" else 0.0
            if column == "tweak":
                import torch_tweak as tt
                row["tweak_status"] = str(tt.status(fn))
            if INTERLEAVE:
                alive[column] = fn
        except Exception as exc:  # a column that cannot serve the stream is reported, not fatal
            traceback.print_exc()
            row["errors"][column] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:300] if str(exc) else ''}"
        finally:
            fn = None  # type: ignore[assignment]
            if "load" in row:
                row["load"][column] = [before, load_average()]
                row["others_share"][column] = others_share(reading, cpu_load.reading())
        print(f"    {json.dumps({k: row[k].get(column) for k in ('cold_s', 'warm_s', 'new_first_s', 'new_s', 'error')})}",
              flush=True)
        partial(row)
    if INTERLEAVE and len(alive) > 1:
        interleaved(row, alive, stream, new, rounds)
        partial(row)
    return row


def interleaved(row: dict, alive: dict[str, Callable[..., Any]], stream: list[Request], new: list[Request],
                rounds: int) -> None:
    """The warm figures measured again side by side: every built column kept, one warm-up pass
    of each stream per column (a compiled column built before dynamo's reset for the next
    column compiles again here), then `rounds` rounds in which each column in turn serves the
    stream and the new stream, the order rotated each round. The medians replace the
    sequential warm figures (kept as warm_seq_s, new_seq_s): a drift of the machine's speed
    over the minutes between two columns' passes then falls on every column alike."""
    order = list(alive)
    for fn in alive.values():
        serve(fn, stream)
        serve(fn, new)
    warm: dict[str, list[float]] = {c: [] for c in order}
    fresh: dict[str, list[float]] = {c: [] for c in order}
    for r in range(max(rounds, 3)):
        for column in order[r % len(order):] + order[:r % len(order)]:
            warm[column].append(serve(alive[column], stream))
            fresh[column].append(serve(alive[column], new))
    row["warm_seq_s"], row["new_seq_s"] = dict(row["warm_s"]), dict(row["new_s"])
    for column in order:
        row["warm_s"][column] = statistics.median(warm[column])
        row["new_s"][column] = statistics.median(fresh[column])
    row["interleaved"] = max(rounds, 3)
    print(f"    interleaved: warm {json.dumps(row['warm_s'])}, new {json.dumps(row['new_s'])}", flush=True)


# ------------------------------------------------------------------ report


def cell(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds:.3f}"


def commit_of(run: dict) -> str:
    return run["environment"].rsplit(" at ", 1)[-1].split(",")[0]


def report(paths: list[str], out: str) -> None:
    """serving.md from run files: per pass, one table of every row's columns, and tweak's
    ratio to the best other column of the same run."""
    runs = [json.load(open(p)) for p in paths]
    lines = ["# Serving streams of varying shapes", "",
             "Written by `bench/serving_bench.py --report` from the run files below; the protocol is the script's "
             "docstring. Seconds for the whole stream (each request synchronised), lower is better; *vs best* is the "
             "best other column over tweak, in the same run (the cold pass: tweak over the slowest compiling column); "
             "openvino-default (OpenVINO's own inference precision, bf16 on a CPU with bf16 instructions) is shown "
             "with its error and never counted as the best other. Each row names the commit it ran at.", ""]
    for run in runs:
        lines.append(f"- `runs/{os.path.basename(run['path'])}`: {run['environment']}")
    for key, title in (("cold_s", "Cold: build (compile, tuning) and the stream served once"),
                       ("warm_s", "Warm: the same stream again (median of rounds)"),
                       ("new_first_s", "New shapes, first sight"), ("new_s", "New shapes, warm")):
        lines += ["", f"## {title}", ""]
        columns = sorted({c for run in runs for row in run["rows"] for c in row[key]},
                         key=lambda c: COLUMN_ORDER.index(c))
        last = "tweak over the slowest other (target: at most 3x)" if key == "cold_s" else "tweak vs best other"
        lines.append("| row | " + " | ".join(columns) + f" | {last} |")
        lines.append("|---|" + "---:|" * (len(columns) + 1))
        if key == "new_first_s":
            lines[-2:-2] = ["Rows marked *second sight* ran before the outputs check moved after the passes: "
                            "that check had served the new shapes once before this pass, so every column had "
                            "already seen them (compiled, recorded).", ""]
        for run in runs:
            for row in run["rows"]:
                got = row[key]
                others = {c: v for c, v in got.items()
                          if c != "tweak" and c not in LOWER_PRECISION and (key != "cold_s" or c != "eager")}
                ratio = "-"
                if "tweak" in got and others:
                    pick = (max if key == "cold_s" else min)(others, key=others.__getitem__)
                    x = got["tweak"] / others[pick] if key == "cold_s" else others[pick] / got["tweak"]
                    ratio = f"{x:.2f}x ({pick})"
                if key == "new_first_s" and not row.get("first_sight"):
                    ratio += " (second sight)"
                lines.append(f"| {row['model']} {row['dtype']} ({row['device']}, {commit_of(run)}) | "
                             + " | ".join(cell(got.get(c)) for c in columns) + f" | {ratio} |")
    lines += ["", "## Rows, errors and tuning", ""]
    for run in runs:
        for row in run["rows"]:
            errs = ", ".join(f"{c} {e:.1e}" for c, e in row["error"].items() if c != "eager")
            lines.append(f"- **{row['model']} {row['dtype']} ({row['device']}, {commit_of(run)})**: {row['stream']}; {row['shapes']} "
                         f"shapes, {row['new_shapes']} new. Largest error against eager on valid positions: {errs}. "
                         + (f"tweak's tuning alone: {row['tune_s']:.1f} s. " if "tune_s" in row else "")
                         + (f"Warm figures side by side: {row['interleaved']} interleaved rounds. "
                            if row.get("interleaved") else "")
                         + (f"tweak's shapes=: {row['tweak_shapes']}. " if row.get("tweak_shapes") else "")
                         + "".join(f"{c} failed: {e}. " for c, e in row["errors"].items())
                         + ("Load average (1 min) before and after each column (the bench's own compiles "
                            "included): " + ", ".join(f"{c} {b}-{a}" for c, (b, a) in row["load"].items()) + ". "
                            if row.get("load") else "")
                         + ("Other processes' share of the CPUs during each column: " + ", ".join(
                             f"{c} -" if v is None else f"{c} {v:.0%}" for c, v in row["others_share"].items()) + ". "
                            if row.get("others_share") else ""))
    with open(out, "w") as f:
        f.write("\n".join(lines) + "\n")
    print(f"wrote {out}")


# ------------------------------------------------------------------ --fresh: shapes never seen at tuning


FRESH_COLUMNS = {"bert-pooler": ("eager", "tweak", "reduce-overhead", "graph", "dynamic", "compile"),
                 "resnet50": ("eager", "tweak", "reduce-overhead")}
"""--fresh: the columns of each row, most needed first (a run past its budget drops the last)."""
FRESH_BUDGET_S = 450.0
"""--fresh: the run's budget (the lead's limit is 8 minutes on one H100): a column that would
start past it is skipped, and said so in the run file."""


class PerShapeGraph:
    """The "graph" column: a CUDA graph per request shape, recorded at its first call (three
    warm-up calls and the recording on a side stream, bench/studies/common.graphed), replayed
    on static copies of the inputs: each shape's eager kernels without their launches."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model, self.graphs = model, {}

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if DEVICE != "cuda":
            raise RuntimeError("the graph column needs CUDA")
        given = list(args) + list(kwargs.values())
        key = tuple((tuple(t.shape), t.dtype) for t in given)
        held = self.graphs.get(key)
        if held is None:
            static = [t.clone() for t in given]
            sargs, skwargs = tuple(static[:len(args)]), dict(zip(kwargs, static[len(args):]))
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for _ in range(3):
                    self.model(*sargs, **skwargs)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, stream=side):
                    out = self.model(*sargs, **skwargs)
            torch.cuda.current_stream().wait_stream(side)
            held = self.graphs[key] = (graph, static, out)
        graph, static, out = held
        for buffer, t in zip(static, given):
            buffer.copy_(t)
        graph.replay()
        return out


def fresh_stream(name: str, stream: list[Request], model: torch.nn.Module, dtype: torch.dtype, seed: int,
                 count: int) -> tuple[list[Request], str]:
    """`count` requests of shapes no request of `stream` had: BERT, batches 1-16 of rows padded to
    a length from 1 to the model's position table; vision, batches 1-24 (16 past the stream's)."""
    rng = random.Random(seed + 7)
    seen = {r.shape() for r in stream}
    if name.startswith("bert"):
        top, most = int(model.config.max_position_embeddings), 16
        if SMOKE:  # seconds on a CPU
            top, most = 64, 4
        shapes = [(b, n) for b in range(1, most + 1) for n in range(1, top + 1) if (b, n) not in seen]
        out = []
        for b, n in rng.sample(shapes, count):
            made = text_stream(1, [b], [n], model.config.vocab_size, rng.randrange(1 << 30))[0]
            out.append(made)
        return out, f"{count} requests of batch 1-{most} and length 1-{top}, none of the stream's shapes"
    side = stream[0].args[0].shape[-1]
    sizes = [b for b in range(1, 25) if (b, 3, side, side) not in seen] or list(range(17, 25))
    return (vision_stream(count, sizes, side, dtype, seed + 7),
            f"{count} requests of batch {min(sizes)}-{max(sizes)} (sizes the stream never had)")


def padded_calls(fn: Any) -> list[Any]:
    """The padded backend's callables of a tuned model (tt.installed), those that serve."""
    import torch_tweak as tt
    from torch_tweak.backends.padded import PaddedCall

    found = []
    for wrapper in tt.installed(fn).values():
        for group in wrapper.tt_signatures:
            backend = group.backend
            if backend is not None and isinstance(getattr(backend, "callable", None), PaddedCall):
                found.append(backend.callable)
    return found


def fresh_column(column: str, model: torch.nn.Module, stream: list[Request], row: dict) -> Callable[..., Any]:
    """The column's callable, built (tweak: tuned on the stream's first N_TUNE requests)."""
    if column == "eager":
        return model
    if column == "graph":
        return PerShapeGraph(model)
    if column in ("compile", "dynamic", "reduce-overhead"):
        options = {"compile": {}, "dynamic": {"dynamic": True}, "reduce-overhead": {"mode": "reduce-overhead"}}
        return compiled(model, **options[column])
    if DEVICE == "cuda":
        return tweak_column(model, stream, None, row)
    import torch_tweak as tt  # --smoke on the CPU: the padded backend alone, at depth 0, in seconds

    fn = copy.deepcopy(model)
    backend = tt.backends.PaddedGraphBackend(graph=False, compile=False)
    (wrapper,) = tt.wrap(fn, [""], strategy=tt.OneBackendStrategy(backend))
    tt.tune(fn, [r.kwargs if r.kwargs else r.args[0] for r in stream[:N_TUNE]],
            measure={"rounds_max": 5, "time_cap": 0.5})
    row["tweak_modules"] = str(wrapper.tt_signatures[0].text if wrapper.tt_signatures else "")
    return fn


def fresh_passes(column: str, fn: Callable[..., Any], stream: list[Request], fresh: list[Request], rounds: int,
                 row: dict, t0: float) -> None:
    """The column's passes: cold (its build and the stream once), warm, the fresh stream's first
    pass (tweak: each new bucket recorded and checked in the call that first needs it), the fresh
    stream warm."""
    row["cold_s"][column] = time.perf_counter() - t0 + serve(fn, stream)
    row["warm_s"][column] = statistics.median(serve(fn, stream) for _ in range(rounds))
    row["new_first_s"][column] = serve(fn, fresh)
    row["new_s"][column] = statistics.median(serve(fn, fresh) for _ in range(rounds))


def fresh_row(name: str, dtype_name: str, rounds: int, seed: int, started: float,
              partial: Callable[[dict], None]) -> dict:
    """One row of --fresh (see fresh_verdict for what it decides)."""
    dtype = DTYPES[dtype_name]
    model, stream, _, what, _ = build(name, dtype, seed)
    fresh, fresh_what = fresh_stream(name, stream, model, dtype, seed, 6 if SMOKE else 64)
    refs = references(model, [stream, fresh])
    row: dict[str, Any] = {"model": name, "dtype": dtype_name, "stream": what, "fresh": fresh_what, "device": DEVICE,
                           "shapes": len({r.shape() for r in stream}), "new_shapes": len({r.shape() for r in fresh}),
                           "cold_s": {}, "warm_s": {}, "new_first_s": {}, "new_s": {}, "error": {}, "errors": {},
                           "skipped": {}, "first_sight": True}
    columns = [c for c in FRESH_COLUMNS.get(name, ("eager", "tweak")) if DEVICE == "cuda" or c in ("eager", "tweak")]
    alive: dict[str, Callable[..., Any]] = {}
    for column in columns:
        if time.perf_counter() - started > FRESH_BUDGET_S:
            row["skipped"][column] = f"past the run's budget of {FRESH_BUDGET_S:.0f} s"
            continue
        print(f"  {name} {dtype_name}: {column}", flush=True)
        cold_start(column)
        try:
            sync()
            t0 = time.perf_counter()
            fn = fresh_column(column, model, stream, row)
            sync()
            if column == "tweak":
                row["tune_s"] = time.perf_counter() - t0
            fresh_passes(column, fn, stream, fresh, rounds, row, t0)
            row["error"][column] = error_of(fn, [stream, fresh], refs) if column != "eager" else 0.0
            if column == "tweak":
                import torch_tweak as tt
                row["tweak_status"] = str(tt.status(fn))
                row["tweak_buckets"] = [c.describe() for c in padded_calls(fn)]
            alive[column] = fn
        except Exception as exc:  # a column that cannot serve the streams is reported, not fatal
            traceback.print_exc()
            row["errors"][column] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:300] if str(exc) else ''}"
        print(f"    {json.dumps({k: row[k].get(column) for k in ('cold_s', 'warm_s', 'new_first_s', 'new_s', 'error')})}",
              flush=True)
        partial(row)
    if not name.startswith("bert") and alive:
        row["per_batch"] = per_batch(alive, fresh + stream, dtype)
        row["levers"] = levers(row["per_batch"], stream + fresh)
    row["verdict"] = fresh_verdict(row)
    partial(row)
    return row


KERNEL_KINDS = (("cudnn", ("cudnn", "xmma", "implicit_convolve", "implicit_gemm", "conv2d_", "nhwc", "nchw")),
                ("inductor", ("triton",)), ("cublas", ("gemm", "cutlass", "cublas")), ("copies", ("memcpy", "memset")))
"""How a kernel's name says who wrote it (the first kind whose words it holds, else "other")."""


def kernel_kind(name: str) -> str:
    lower = name.lower()
    return next((kind for kind, words in KERNEL_KINDS if any(w in lower for w in words)), "other")


def profiled(fn: Callable[[], Any], calls: int) -> tuple[float, dict, list]:
    """`calls` calls of fn under torch.profiler: (the device time per call in ms, per kernel kind,
    the five longest kernels with their kind and ms per call)."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CUDA] if DEVICE == "cuda" else [ProfilerActivity.CPU]
    with profile(activities=activities) as prof:
        for _ in range(calls):
            fn()
        sync()
    per: dict[str, float] = {}
    kinds: dict[str, float] = {}
    for e in prof.key_averages():
        ms = float(getattr(e, "self_device_time_total", 0.0) or getattr(e, "self_cuda_time_total", 0.0) or 0.0) / 1e3
        if DEVICE != "cuda":
            ms = float(e.self_cpu_time_total) / 1e3
        if ms <= 0:
            continue
        per[e.key] = per.get(e.key, 0.0) + ms / calls
        kinds[kernel_kind(e.key)] = kinds.get(kernel_kind(e.key), 0.0) + ms / calls
    top = sorted(per.items(), key=lambda kv: -kv[1])[:5]
    return sum(per.values()), kinds, [[k[:100], kernel_kind(k), round(v, 4)] for k, v in top]


def per_batch(alive: dict[str, Callable[..., Any]], requests: list[Request], dtype: torch.dtype) -> list[dict]:
    """Per batch size of the streams, per column: ms a call (median of 10, synchronised), the
    device's kernel time and what is left (launch, host), the kernels by kind and the longest;
    for tweak the bucket the batch is padded to and its padding share."""
    from torch_tweak import _C

    sizes = sorted({r.shape()[0] for r in requests})[:2 if SMOKE else None]
    shape = requests[0].shape()[1:]
    out = []
    for b in sizes:
        x = torch.randn(b, *shape).to(DEVICE, dtype)
        entry: dict[str, Any] = {"batch": b, "bucket": _C.PaddedReplay._pad_batch_bucket(b)}
        entry["padding"] = round(1 - b / entry["bucket"], 3)
        with torch.no_grad():
            for column, fn in alive.items():
                for _ in range(3):
                    fn(x)
                times = []
                for _ in range(10):
                    sync()
                    t0 = time.perf_counter()
                    fn(x)
                    sync()
                    times.append((time.perf_counter() - t0) * 1e3)
                ms = statistics.median(times)
                kernel_ms, kinds, top = profiled(lambda: fn(x), 3)
                entry[column] = {"ms": round(ms, 4), "kernel_ms": round(kernel_ms, 4),
                                 "rest_ms": round(max(0.0, ms - kernel_ms), 4),
                                 "kinds": {k: round(v, 4) for k, v in kinds.items()}, "top": top}
        out.append(entry)
    return out


def levers(rows: list[dict], requests: list[Request]) -> dict:
    """Over the streams' batch sizes (as often as they come), where tweak's time goes against
    reduce-overhead's: padding (tweak's ms times the padded share of its rows), what is not
    kernels (launch, host), and the kernels by kind; the largest gap first."""
    count: dict[int, int] = {}
    for r in requests:
        count[r.shape()[0]] = count.get(r.shape()[0], 0) + 1
    other = "reduce-overhead" if all("reduce-overhead" in e for e in rows) else "eager"
    total = {"padding_ms": 0.0, "tweak_rest_ms": 0.0, f"{other}_rest_ms": 0.0}
    kinds: dict[str, float] = {}
    for e in rows:
        if "tweak" not in e or other not in e:
            continue
        n = count.get(e["batch"], 0)
        total["padding_ms"] += n * e["tweak"]["ms"] * e["padding"]
        total["tweak_rest_ms"] += n * e["tweak"]["rest_ms"]
        total[f"{other}_rest_ms"] += n * e[other]["rest_ms"]
        for kind in set(e["tweak"]["kinds"]) | set(e[other]["kinds"]):
            kinds[kind] = kinds.get(kind, 0.0) + n * (e["tweak"]["kinds"].get(kind, 0.0) - e[other]["kinds"].get(kind, 0.0))
    gaps = {"padding": total["padding_ms"], "launch and host": total["tweak_rest_ms"] - total[f"{other}_rest_ms"],
            **{f"{k} kernels": v for k, v in kinds.items()}}
    return {"against": other, "totals_ms": {k: round(v, 3) for k, v in total.items()},
            "gaps_ms": {k: round(v, 3) for k, v in sorted(gaps.items(), key=lambda kv: -kv[1])},
            "largest": max(gaps, key=gaps.__getitem__) if gaps else None}


def fresh_verdict(row: dict) -> dict:
    """Issue 57's figures of a row: tweak against the best other column warm and on the fresh
    stream warm (targets: BERT 3x, ResNet-50 1.2x), tweak's first pass of the fresh stream against
    eager's warm pass of it (at most 1.5x), and tweak's tuning plus its first pass of the stream
    against the cold pass of the column it is set against warm (at most 1.5x)."""
    out: dict[str, Any] = {}
    target = 3.0 if row["model"].startswith("bert") else 1.2
    for key in ("warm_s", "new_s"):
        got = row[key]
        others = {c: v for c, v in got.items() if c != "tweak"}
        if "tweak" in got and others:
            best = min(others, key=others.__getitem__)
            out[key] = {"best_other": best, "speedup": round(others[best] / got["tweak"], 3), "target": target}
    if "tweak" in row["new_first_s"] and "eager" in row["new_s"]:
        out["first_pass_vs_eager_warm"] = {"ratio": round(row["new_first_s"]["tweak"] / row["new_s"]["eager"], 3),
                                           "target_at_most": 1.5}
    best = out.get("warm_s", {}).get("best_other")
    if best is not None and best in row["cold_s"] and "tweak" in row["cold_s"]:
        out["cold_vs_beaten_column"] = {"column": best, "ratio": round(row["cold_s"]["tweak"] / row["cold_s"][best], 3),
                                        "target_at_most": 1.5}
    return out


def run_fresh(rows: list[list[str]], rounds: int, seed: int, path: str, run: dict) -> None:
    """--fresh: every row, the run file written after each column."""
    started = time.perf_counter()

    def save(row: dict | None = None) -> None:
        with open(path, "w") as f:
            json.dump(dict(run, rows=run["rows"] + ([row] if row else [])), f, indent=1)

    for name, dtype_name in rows:
        run["rows"].append(fresh_row(name, dtype_name, rounds, seed, started, save))
        save()
        print(f"  verdict {name}: {json.dumps(run['rows'][-1]['verdict'])}", flush=True)
    run["seconds"] = round(time.perf_counter() - started, 1)
    save()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="")
    parser.add_argument("--columns", default="")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--cpu", action="store_true")
    parser.add_argument("--smoke", action="store_true", help="tiny CPU rows, one round, every column checked "
                        "against eager; writes no figures into bench/results")
    parser.add_argument("--no-shapes", action="store_true", help="tweak on the CPU without shapes=")
    parser.add_argument("--max-depth", type=int, default=None, help="tweak's max_depth (default: tweak's own on "
                        "cuda, 0 on the CPU)")
    parser.add_argument("--sequential", action="store_true", help="warm figures from each column's own passes, "
                        "not measured again side by side (every column then stays built to the end)")
    parser.add_argument("--fresh", action="store_true", help="issue 57's protocol: stock BERT (pooler, bf16) and "
                        "ResNet-50 tuned on the first 8 requests, then their stream warm and a stream of shapes never "
                        "seen, with a per-batch breakdown of ResNet-50's time (in 8 minutes on one H100; with --smoke: "
                        "tiny models on the CPU, seconds)")
    parser.add_argument("--budget", type=float, default=None, help="--fresh: the run's budget in seconds "
                        "(default: FRESH_BUDGET_S): a column that would start past it is skipped and said so")
    parser.add_argument("--json", default=None)
    parser.add_argument("--report", nargs="+", metavar="JSON")
    parser.add_argument("--out", default=os.path.join(HERE, "results", "serving.md"))
    args = parser.parse_args()
    if args.report:
        report(args.report, args.out)
        return
    global DEVICE, SMOKE, MAX_DEPTH, INTERLEAVE, FRESH_BUDGET_S
    INTERLEAVE = not args.sequential
    if args.smoke:
        SMOKE, args.cpu, args.rounds = True, True, 1
    if args.cpu:
        DEVICE = "cpu"
    elif not torch.cuda.is_available():
        sys.exit("serving_bench needs a CUDA device (or --cpu)")
    MAX_DEPTH = args.max_depth if args.max_depth is not None else 0 if args.cpu else None
    default_rows = "resnet18:fp32,bert:fp32" if args.cpu else "resnet50:bf16,bert:bf16,vit:bf16,resnet50:fp32,bert:fp32"
    if args.budget is not None:
        FRESH_BUDGET_S = args.budget
    if args.fresh:
        default_rows = "bert-pooler:fp32,resnet18:fp32" if args.cpu else "bert-pooler:bf16,resnet50:bf16"
        args.rounds = 1 if SMOKE else 2
    rows = [r.split(":") for r in (args.rows or default_rows).split(",") if r]
    columns = [c for c in args.columns.split(",") if c] or list(CPU_COLUMNS if args.cpu else CUDA_COLUMNS)
    kind = "serving-fresh" if args.fresh else "serving"
    path = args.json or (os.path.join(tempfile.gettempdir(), f"{kind}-smoke.json") if SMOKE else
                         os.path.join(HERE, "results", "runs", f"{kind}-{source_commit()}-{DEVICE}.json"))
    import platform

    import torch_tweak
    run = {"path": run_file_name(path), "environment": f"{torch.cuda.get_device_name() if DEVICE == 'cuda' else platform.processor() or 'CPU'}"
           f", torch {torch.__version__}, torch-tweak {torch_tweak.__version__} at {source_commit()}", "rows": []}
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    def save(row: dict | None = None) -> None:  # after every column: a run stopped at its limit keeps them
        with open(path, "w") as f:
            json.dump(dict(run, rows=run["rows"] + ([row] if row else [])), f, indent=1)

    if DEVICE == "cpu":
        run["environment"] += f", {os.cpu_count()} CPUs"
    if args.fresh:
        run_fresh(rows, args.rounds, args.seed, path, run)
        print(f"wrote {path}")
        return
    for name, dtype_name in rows:
        run["rows"].append(bench_row(name, dtype_name, columns, args.rounds, args.seed, save, not args.no_shapes))
        save()
    print(f"wrote {path}")
    if SMOKE:
        sys.exit(smoke_verdict(run["rows"]))


def smoke_verdict(rows: list[dict]) -> int:
    """--smoke: 0 when every column served both streams within SMOKE_TOLERANCE of eager (a column
    whose package is not installed is skipped), else 1; one line per row."""
    failed = False
    for row in rows:
        missing = {c: e for c, e in row["errors"].items() if "No module named" in e}
        broken = {c: e for c, e in row["errors"].items() if c not in missing}
        off = {c: e for c, e in row["error"].items() if e > SMOKE_TOLERANCE}
        failed |= bool(broken or off)
        kept = row.get("tweak_kept")
        print(f"smoke {row['model']}: " + ("ok" if not broken and not off else "FAILED") +
              ("" if "tweak_table" not in row else f"; tweak kept depth {kept}" if kept is not None
               else f"; tweak kept the model untuned ({row['tweak_table'].strip().splitlines()[-1][:160]})") +
              "".join(f"; {c} failed: {e}" for c, e in broken.items()) +
              "".join(f"; {c} is {e:.1e} from eager" for c, e in off.items()) +
              "".join(f"; {c} skipped ({e})" for c, e in missing.items()))
    return 1 if failed else 0


if __name__ == "__main__":
    main()
