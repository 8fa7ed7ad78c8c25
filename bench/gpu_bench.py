"""torch-tweak against the alternatives on one GPU, model by model, in fp32 and bf16.

For each model and dtype, every column gets the same inputs (a dataset of a few random
calls of one shape, cycled), the same warm-up and the same statistic: the median over
interleaved rounds (A, B, C, then B, C, A, then C, A, B...) of one call, the device synchronised before and
after it (what a caller waits for, host overhead included).

    eager            the model as it is
    graph            a whole-model CUDA graph of eager (torch.cuda.CUDAGraph): copy the
                     input into the static buffer, replay, return the static output
    compile          torch.compile, default mode
    reduce-overhead  torch.compile(mode="reduce-overhead"); its compile time is the wall
                     time of its first three calls (compile, warm-up, recording)
    max-autotune     torch.compile(mode="max-autotune"): autotuned kernels and CUDA graphs;
                     compile time as reduce-overhead's (first three calls)
    max-autotune-no-cudagraphs
                     torch.compile(mode="max-autotune-no-cudagraphs")
    tweak            the model tt.tweak returns (default settings), with its tuning time
    tweak-high       tt.tweak(effort="high"): channels-last, SDPA kernels, max-autotune for
                     heavy modules (with --tweak-variants high)
    tweak-tf32, tweak-bf16
                     tt.tweak(precision={"tf32": 1e-2}) / {"bf16": 0.05}: opt-in lower
                     precision, fp32 rows only (with --tweak-variants tf32,bf16)

--columns runs only the columns named, in that order (eager always runs; tweak-high,
tweak-tf32 and tweak-bf16 may be named there too). Each column, once built, is measured at
once beside eager (5 warm-up calls, 20 interleaved rounds), and the run file is written after
every column, so a run stopped at its time limit keeps the compile times and these first
latencies it has (the row marked "partial"; --merge shows those latencies, marked). Once a
row's columns are all built they are measured together, interleaved, for its figures.

A compiling column that has not finished within --compile-timeout seconds (the tweak
columns: --tweak-timeout) is stopped (an alarm raised in the compiling thread;
dynamo is reset before the next column) and reported as "did not finish compiling in N s".

Roofline: per row, the FLOPs of one call (torch.utils.flop_counter.FlopCounterMode) and the
bytes one call must move at the least (every parameter and buffer read once, the inputs read
once, the outputs written once: a perfectly fused model), and also op by op (every aten op's
tensor inputs read and outputs written, no fusion). The floor is max(FLOPs / peak compute,
least bytes / peak bandwidth) against the H200's peaks: 989 TFLOP/s dense bf16/fp16 tensor,
494 TFLOP/s TF32 tensor, 67 TFLOP/s fp32 without tensor cores, 4.8 TB/s HBM3e. An fp32 row's
FLOPs count at the peak of the numerics torch gives them by default: its convolutions at the
TF32 peak (cuDNN's default, torch.backends.cudnn.allow_tf32), its matrix products at the fp32
one (torch.backends.cuda.matmul.allow_tf32 is off). Each column's roofline fraction is the
floor over its latency.

Every compiling column (compile, reduce-overhead, max-autotune, tweak) starts cold, as a
user's first run does: a fresh Inductor and Triton cache folder, Inductor's in-memory caches
cleared, and tweak's own tuning cache off (cache=False). Each torch.compile column is a new
torch.compile, whose code dynamo hands to no other; a tweak column also resets dynamo, since
tweak's candidates share their backend from one tweak to the next.

Weights are random, built from configs: nothing is downloaded. Writes JSON per run and,
with --merge, bench/results/gpu.md (tables, targets) and gpu.png (if matplotlib is there).
A row may come from several runs (one with the max-autotune columns, one with tweak's
variants, when both do not fit one run's time limit): the main tables take, per model and
dtype, the run with the most alternative columns measured; the variants table takes every
run's variants, each against the default tweak measured interleaved with it in its own run;
a column the main row lacks, measured in another run beside that run's tweak (say
--columns tweak,max-autotune-no-cudagraphs for one slow compile), shows in a table of its own
against that tweak.

    python bench/gpu_bench.py [--models encoder,bert,gpt2,vit,resnet50] [--dtypes fp32,bf16]
                              [--rows encoder:fp32,bert:bf16] [--quick] [--max-autotune]
                              [--compile-timeout S] [--tweak-variants high,tf32,bf16]
                              [--tweak-timeout S] [--variant-budget S|auto] [--columns C,C...] [--mark-step]
                              [--json PATH]
    python bench/gpu_bench.py --cpu --rows encoder:fp32 --quick ...   # smoke run on the CPU
    python bench/gpu_bench.py --merge a.json b.json ... [--out-dir bench/results]
    python bench/gpu_bench.py --cpu --roofline-of a.json ...   # the roofline of earlier runs' rows
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import gc
import json
import os
import platform
import signal
import statistics
import sys
import time
import timeit
import traceback
from typing import Any, Callable

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "examples", "Tweak"))

MODELS = ("encoder", "bert", "gpt2", "vit", "resnet50")
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
COLUMNS = ("eager", "graph", "compile", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs", "tweak",
           "tweak-high", "tweak-tf32", "tweak-bf16")
ALTERNATIVES = ("eager", "graph", "compile", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")
TWEAK_VARIANTS = {"high": {"effort": "high"}, "tf32": {"precision": {"tf32": 1e-2}},
                  "bf16": {"precision": {"bf16": 0.05}}}
PEAK_FLOPS = {"bf16": 989e12, "fp16": 989e12, "tf32": 494e12, "fp32": 67e12}
"""H200 SXM dense peaks, FLOP/s: bf16/fp16 tensor cores, TF32 tensor cores, fp32 without them."""
PEAK_BYTES = 4.8e12
"""H200 HBM3e bandwidth, bytes/s."""
DEVICE = "cuda"
SIZES = {
    "encoder": "batch 8, seq 64, d 256, 4 layers",
    "bert": "BERT-base, batch 1, seq 128",
    "gpt2": "GPT-2 small, batch 1, seq 128",
    "vit": "ViT-B/16, batch 8, 224x224",
    "resnet50": "ResNet-50, batch 8, 224x224",
}
N_SAMPLES = 4

# ------------------------------------------------------------------ models


def cold_compiler(tag: str) -> str:
    """A fresh Inductor/Triton cache folder for the next compile and Inductor's in-memory
    caches cleared: no column compiles from another's work. Dynamo is not reset here: that
    would drop the code of the columns compiled before, and measuring them would compile
    them again (a max-autotune column autotuned twice, the second time uncounted). Each
    column is its own torch.compile, and dynamo reuses compiled code only for the backend
    that compiled it; the recompile limit is raised so that every column's entry fits."""
    import tempfile
    folder = tempfile.mkdtemp(prefix=f"tt-bench-{tag}-")
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = folder
    os.environ["TRITON_CACHE_DIR"] = os.path.join(folder, "triton")
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
    try:
        from torch._inductor.utils import clear_caches
        clear_caches()
    except ImportError:  # older torch: the fresh folder alone
        pass
    return folder


def build(name: str, dtype: torch.dtype) -> tuple[torch.nn.Module, list]:
    """The model (random weights, eval, on cuda in `dtype`) and N_SAMPLES calls of it."""
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    dev = DEVICE
    if name == "encoder":
        import encoder
        model = encoder.build(dev, dtype)
        data = encoder.samples(dev, dtype, count=N_SAMPLES)
    elif name in ("bert", "gpt2"):
        import transformers
        if name == "bert":
            model = transformers.BertModel(transformers.BertConfig())
        else:
            model = transformers.GPT2Model(transformers.GPT2Config(use_cache=False))
        vocab = model.config.vocab_size
        data = [{"input_ids": torch.randint(0, vocab, (1, 128), generator=g).to(dev)} for _ in range(N_SAMPLES)]
        model = model.to(dev, dtype).eval()
    elif name == "vit":
        import timm
        model = timm.create_model("vit_base_patch16_224", pretrained=False).to(dev, dtype).eval()
        data = [torch.randn(8, 3, 224, 224, generator=g).to(dev, dtype) for _ in range(N_SAMPLES)]
    elif name == "resnet50":
        import torchvision
        model = torchvision.models.resnet50(weights=None).to(dev, dtype).eval()
        data = [torch.randn(8, 3, 224, 224, generator=g).to(dev, dtype) for _ in range(N_SAMPLES)]
    else:
        raise ValueError(f"unknown model {name!r}; one of {', '.join(MODELS)}")
    return model, data


def call_of(sample: Any) -> tuple[tuple, dict]:
    """A sample as (args, kwargs): a dict is keyword arguments, anything else the one argument."""
    if isinstance(sample, dict):
        return (), sample
    return (sample,), {}


def first_tensor(out: Any) -> torch.Tensor:
    """The first tensor of an output, whatever holds it (a tuple, a dict, a ModelOutput)."""
    import torch.utils._pytree as pytree

    return next(t for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor))


def sync() -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()


class CompileTimeout(Exception):
    pass


class deadline:
    """Raises CompileTimeout in this (the main) thread when `seconds` pass, and again every
    0.5 s until the block is left (tt.tweak's engine turns an exception in a build into that
    candidate's failure and goes on: the repeats end it); any exception the block ends with
    after the deadline, or none, becomes CompileTimeout. A compile that does not finish is
    reported, not waited for."""

    def __init__(self, seconds: float | None, what: str) -> None:
        self.seconds = seconds
        self.message = f"{what} did not finish compiling in {seconds or 0:.0f} s"
        self.rang = False

    def _ring(self, signum: int, frame: Any) -> None:
        self.rang = True
        raise CompileTimeout(self.message)

    def __enter__(self) -> "deadline":
        if self.seconds:
            self.previous = signal.signal(signal.SIGALRM, self._ring)
            signal.setitimer(signal.ITIMER_REAL, self.seconds, 0.5)
        return self

    def __exit__(self, kind: Any, exc: Any, tb: Any) -> bool:
        if not self.seconds:
            return False
        while True:  # a ring can land here too: stop the timer before anything else
            try:
                signal.setitimer(signal.ITIMER_REAL, 0)
                break
            except CompileTimeout:
                continue
        signal.signal(signal.SIGALRM, self.previous)
        if self.rang:
            raise CompileTimeout(self.message) from exc
        return False


def preload_inductor() -> None:
    """Imports Inductor's compiler and kernel modules and compiles a tiny function, with no
    deadline: a compile stopped by one must not leave a module half imported (a later
    compile then fails on it, e.g. "duplicate template name")."""
    import importlib
    import pkgutil
    import torch._inductor.compile_fx  # noqa: F401
    import torch._inductor.kernel as kernels
    for info in pkgutil.walk_packages(kernels.__path__, kernels.__name__ + "."):
        try:
            importlib.import_module(info.name)
        except Exception:  # a kernel this machine cannot import is one no compile will use
            pass
    lin = torch.nn.Linear(8, 8).to(DEVICE)
    with torch.no_grad():
        torch.compile(lin)(torch.randn(2, 8, device=DEVICE))
    torch._dynamo.reset()


# ----------------------------------------------------------------- roofline


def roofline(model: torch.nn.Module, data: list, dtype_name: str) -> dict:
    """FLOPs and bytes of one call, and the time floor they set on an H200 (module docs)."""
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils.flop_counter import FlopCounterMode
    import torch.utils._pytree as pytree

    def nbytes(tree: Any) -> int:
        seen, total = set(), 0
        for t in pytree.tree_leaves(tree):
            if isinstance(t, torch.Tensor) and t.device.type != "meta":
                key = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape))
                if key not in seen:
                    seen.add(key)
                    total += t.numel() * t.element_size()
        return total

    class OpBytes(TorchDispatchMode):
        total = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if func not in (torch.ops.aten.view.default, torch.ops.aten._unsafe_view.default,
                            torch.ops.aten.t.default, torch.ops.aten.detach.default):
                OpBytes.total += nbytes((args, kwargs)) + nbytes(out)
            return out

    a, k = call_of(data[0])
    counter = FlopCounterMode(display=False)
    # on a CPU, attention runs a fused kernel the counter has no formula for: the math
    # kernel's matrix products count the same FLOPs (its op-by-op bytes then include the
    # attention matrix, which a fused kernel never writes)
    attention = contextlib.nullcontext()
    if DEVICE == "cpu":
        from torch.nn.attention import SDPBackend, sdpa_kernel
        attention = sdpa_kernel(SDPBackend.MATH)
    with torch.no_grad(), attention:
        with counter:
            out = model(*a, **k)
        with OpBytes():
            model(*a, **k)
    flops = counter.get_total_flops()
    conv = sum(n for op, n in counter.get_flop_counts().get("Global", {}).items() if "convolution" in str(op))
    weights = sum(t.numel() * t.element_size() for t in list(model.parameters()) + list(model.buffers()))
    least = weights + nbytes((a, k)) + nbytes(out)
    peak = PEAK_FLOPS[dtype_name]
    out_ = {"flops": flops, "flops_conv": conv, "bytes_least": least, "bytes_weights": weights,
            "bytes_op_by_op": OpBytes.total, "peak_flops": peak, "peak_bytes": PEAK_BYTES,
            # torch's defaults: an fp32 convolution runs in TF32 (cuDNN), an fp32 matrix product does not
            "conv_tf32": dtype_name == "fp32" and torch.backends.cudnn.allow_tf32,
            "matmul_tf32": dtype_name == "fp32" and torch.backends.cuda.matmul.allow_tf32,
            "floor_ms_tf32": max(flops / PEAK_FLOPS["tf32"], least / PEAK_BYTES) * 1e3,
            "intensity": flops / least if least else None}
    return dict(out_, **floor_of(out_))


def floor_of(f: dict) -> dict:
    """floor_ms and bound of a roofline: the FLOPs at the peak of the numerics torch runs them in
    by default (conv_tf32 / matmul_tf32: a convolution / the other FLOPs at the TF32 peak), against
    the least bytes at peak bandwidth."""
    conv = f.get("flops_conv", 0)
    conv_peak = PEAK_FLOPS["tf32"] if f.get("conv_tf32") else f["peak_flops"]
    rest_peak = PEAK_FLOPS["tf32"] if f.get("matmul_tf32") else f["peak_flops"]
    compute_s = conv / conv_peak + (f["flops"] - conv) / rest_peak
    memory_s = f["bytes_least"] / f["peak_bytes"]
    return {"floor_ms": max(compute_s, memory_s) * 1e3, "bound": "compute" if compute_s >= memory_s else "memory"}


# ----------------------------------------------------------------- columns


def whole_graph(model: torch.nn.Module, data: list) -> Callable[[int], Any]:
    """A CUDA graph of the whole eager model: the usual static-input pattern."""
    args, kwargs = call_of(data[0])
    static = {k: v.clone() for k, v in kwargs.items()} if kwargs else None
    static_x = args[0].clone() if args else None
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            model(static_x) if static is None else model(**static)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = model(static_x) if static is None else model(**static)

    def run(i: int) -> Any:
        a, k = call_of(data[i % len(data)])
        if static is None:
            static_x.copy_(a[0])
        else:
            for key, value in k.items():
                static[key].copy_(value)
        graph.replay()
        return out

    run.keep = graph  # type: ignore[attr-defined]
    return run


def compiled(model: torch.nn.Module, data: list, mode: str | None, timeout: float | None = None,
             mark_step: bool = False) -> tuple[Callable[[int], Any], float]:
    """torch.compile of a copy of the model; (run, seconds of its first three calls), cold.
    CompileTimeout when those calls take more than `timeout` seconds. mark_step: a mode with
    CUDA graph trees is told that each measured call begins a new step
    (torch.compiler.cudagraph_mark_step_begin), as torch advises when several compiled
    functions share the trees."""
    cold_compiler(mode or "default")
    fn = torch.compile(copy.deepcopy(model), mode=mode)
    t0 = time.perf_counter()
    with deadline(timeout, f"torch.compile(mode={mode!r})"):  # a stopped compile leaves no entry
        for i in range(3):
            a, k = call_of(data[i % len(data)])
            fn(*a, **k)
        sync()
    seconds = time.perf_counter() - t0

    step = mark_step and mode in ("reduce-overhead", "max-autotune")

    def run(i: int) -> Any:
        a, k = call_of(data[i % len(data)])
        if step:
            torch.compiler.cudagraph_mark_step_begin()
        return fn(*a, **k)

    return run, seconds


def tweaked(model: torch.nn.Module, data: list, budget: float | None, options: dict | None = None,
            timeout: float | None = None) -> tuple[Callable[[int], Any], float, Any, torch.nn.Module]:
    import torch_tweak as tt
    mine = copy.deepcopy(model)
    cold_compiler("tweak")
    # dynamo reset too: tweak's Inductor candidates of an earlier tweak column share their
    # backend, so dynamo would hand this tweak their compiled code and its tuning time would
    # not be a first run's (ResNet-18 on a CPU: 62.6 s cold, 22.7 s the second time). The
    # columns built before recompile at their next call, in the warm-up, uncounted.
    torch._dynamo.reset()
    sync()
    t0 = time.perf_counter()
    with deadline(timeout, f"tt.tweak({options or ''})"):  # tweak unwraps the model when stopped
        result = tt.tweak(mine, data, progress=False, time_budget=budget, cache=False, **(options or {}))
    sync()
    seconds = time.perf_counter() - t0

    def run(i: int) -> Any:
        a, k = call_of(data[i % len(data)])
        return mine(*a, **k)

    return run, seconds, result, mine


# ---------------------------------------------------------------- measuring


def output_error(reference: Callable[[int], Any], run: Callable[[int], Any]) -> float:
    """Largest absolute difference of `run`'s first output tensor from `reference`'s, on the
    first sample, over the reference's largest magnitude; the device synchronised after."""
    with torch.no_grad():
        ref = first_tensor(reference(0)).float().clone()
        out = first_tensor(run(0)).float()
        error = ((out - ref).abs().max() / ref.abs().max()).item()
    sync()
    return error


def measure(runs: dict[str, Callable[[int], Any]], n_data: int, warmup: int, rounds: int) -> dict[str, dict]:
    """Median (and quartiles) of one synchronised call per round, the columns interleaved, the
    order rotated by one each round."""
    times: dict[str, list[float]] = {name: [] for name in runs}
    with torch.no_grad():
        for name, run in runs.items():
            for i in range(warmup):
                run(i)
        sync()
        names = list(runs)
        for r in range(rounds):  # each round starts one column further on: none always follows the same one
            for name in names[r % len(names):] + names[:r % len(names)]:
                sync()
                t0 = time.perf_counter_ns()
                runs[name](r)
                sync()
                times[name].append((time.perf_counter_ns() - t0) / 1e6)
    out = {}
    for name, ts in times.items():
        q = statistics.quantiles(ts, n=4)
        out[name] = {"ms": statistics.median(ts), "q25": q[0], "q75": q[2]}
    return out


def dispatcher_overhead(model: torch.nn.Module, data: list) -> list[dict]:
    """Per tuned module: ns per call through its dispatcher minus ns per call of the same
    callable directly, both with the module's real arguments and a no-op backend in place
    of each entry's backend (the entries' signatures kept), so only the dispatcher's own
    work, its signature check included, is left in the difference."""
    import torch_tweak as tt
    from torch_tweak._search.tuning import dataset_runner, record, release

    wrappers = tt.installed(model)
    active = {p: w for p, w in wrappers.items() if w.tt_backend is not None}
    if not active:
        return []
    record(active.values(), dataset_runner(model, [call_of(d) for d in data[:1]]))
    rows = []

    def noop(*args: Any, **kwargs: Any) -> None:
        return None

    for path, w in active.items():
        if not w.tt_samples:
            continue
        args, kwargs = w.tt_samples[0]
        saved = w._tt_entries
        flags = w._tt_entry_flags  # kept: what the real path does (layout only, locks, the grad rule)
        w._tt_set_entries([(sig, noop, f) for (sig, _), f in zip(saved, flags)])
        try:
            env = {"w": w, "f": noop, "a": args, "k": kwargs}
            n = 20000
            with torch.no_grad():  # inference, as the latencies: the grad rule would send calls to the original
                through = min(timeit.repeat("w(*a, **k)", globals=env, number=n, repeat=5)) / n * 1e9
                direct = min(timeit.repeat("f(*a, **k)", globals=env, number=n, repeat=5)) / n * 1e9
        finally:
            w._tt_set_entries([(sig, fn, f) for (sig, fn), f in zip(saved, flags)])
            release(w)
        rows.append({"module": path or "(root)", "backend": w.tt_backend.name,
                     "signatures": sum(sig is not None for sig, _ in saved),
                     "through_ns": through, "direct_ns": direct, "overhead_ns": through - direct})
    return rows


def replay_path_probe() -> list[dict]:
    """CPU cost per call of replaying a tiny graph (GPU time negligible): torch_tweak's C
    path against the same work done from Python with torch's CUDAGraph."""
    from torch_tweak.backends import DeviceGraphBackend
    lin = torch.nn.Linear(16, 16).cuda().eval()
    x = torch.randn(4, 16, device="cuda")
    with torch.no_grad():
        replay = DeviceGraphBackend().prepare(lin, [((x,), {})], torch.device("cuda"))
        copying = DeviceGraphBackend(lend_outputs=False).prepare(lin, [((x,), {})], torch.device("cuda"))
        static_x = x.clone()
        graph = torch.cuda.CUDAGraph()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            lin(static_x)
        torch.cuda.current_stream().wait_stream(side)
        with torch.cuda.graph(graph):
            static_y = lin(static_x)

        def py_clone(v):
            static_x.copy_(v)
            graph.replay()
            return static_y.clone()

        def py_static(v):
            static_x.copy_(v)
            graph.replay()
            return static_y

        held: list = []

        def copying_while_held(v):
            held[:] = [replay(v)]  # the last output is still held at the next call
            return None

        cases = [("GraphReplay, lending (C: check, copy in, launch, alias out)", replay),
                 ("GraphReplay, last output held (C: check, copy in, launch, copy out)", copying_while_held),
                 ("GraphReplay, lend_outputs=False (C: check, copy in, launch, copy out)", copying),
                 ("Python: copy_, CUDAGraph.replay(), clone()", py_clone),
                 ("Python: copy_, CUDAGraph.replay(), static output", py_static),
                 ("eager nn.Linear", lin)]
        rows = []
        for name, fn in cases:
            n = 5000
            fn(x)
            torch.cuda.synchronize()
            best = float("inf")
            for _ in range(5):
                t0 = time.perf_counter_ns()
                for _ in range(n):
                    fn(x)
                torch.cuda.synchronize()
                best = min(best, (time.perf_counter_ns() - t0) / n / 1e3)
            rows.append({"case": name, "us": best})
    return rows


# --------------------------------------------------------------------- run


def budget_of(given: str | None, row: dict) -> float | None:
    """A --tweak-budget / --variant-budget as seconds: a number, or "auto" for 3x the row's
    reduce-overhead compile time (None when that column was not built before)."""
    if given == "auto":
        ro = row["compile_s"].get("reduce-overhead")
        return None if ro is None else 3 * ro
    return None if given is None else float(given)


def columns_of(args: argparse.Namespace, dtype_name: str) -> list[str]:
    """The columns of a row, in the order they are built: --columns as given, or the
    alternatives, tweak, --tweak-variants, then the max-autotune ones (with --max-autotune).
    Lower-precision variants are for fp32 rows only, tf32 for CUDA only."""
    if args.columns:
        wanted = [c for c in args.columns if c != "eager"]
    else:
        # max-autotune last: a tweak column resets dynamo, and a column built before it compiles
        # again at its next call (for max-autotune: autotunes again, minutes of wall time)
        wanted = [c for c in ALTERNATIVES[1:] if not c.startswith("max-autotune")]
        wanted += ["tweak"] + [f"tweak-{v}" for v in (args.tweak_variants or "").split(",") if v]
        wanted += [c for c in ALTERNATIVES if c.startswith("max-autotune") and args.max_autotune]
    keep = []
    for c in wanted:
        if c in ("tweak-tf32", "tweak-bf16") and dtype_name != "fp32":
            continue
        if c == "tweak-tf32" and DEVICE != "cuda":
            continue
        keep.append(c)
    return keep


def bench_one(name: str, dtype_name: str, args: argparse.Namespace,
              partial: Callable[[dict], None] = lambda row: None) -> dict:
    dtype = DTYPES[dtype_name]
    row: dict[str, Any] = {"model": name, "dtype": dtype_name, "size": SIZES[name], "ms": {}, "spread": {},
                           "errors": {}, "compile_s": {}}
    torch._dynamo.reset()
    gc.collect()
    if DEVICE == "cuda":
        torch.cuda.empty_cache()
    model, data = build(name, dtype)
    runs: dict[str, Callable[[int], Any]] = {}
    try:
        row["roofline"] = roofline(model, data, dtype_name)
    except Exception as exc:
        row["errors"]["roofline"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"

    def eager(i: int) -> Any:
        a, k = call_of(data[i % len(data)])
        return model(*a, **k)

    runs["eager"] = eager
    timeout = args.compile_timeout
    makers: dict[str, Callable[[], Any]] = {
        "graph": lambda: whole_graph(model, data),
        "compile": lambda: compiled(model, data, None, timeout),
        "reduce-overhead": lambda: compiled(model, data, "reduce-overhead", timeout, args.mark_step),
        "max-autotune": lambda: compiled(model, data, "max-autotune", timeout, args.mark_step),
        "max-autotune-no-cudagraphs": lambda: compiled(model, data, "max-autotune-no-cudagraphs", timeout),
    }
    mine = None
    for column in columns_of(args, dtype_name):
        print(f"  {name} {dtype_name}: {column}", flush=True)
        try:
            if column == "graph" and DEVICE != "cuda":
                raise RuntimeError("skipped: a CUDA graph needs CUDA (--cpu smoke run)")
            if column == "tweak":
                row["tweak_budget_s"] = budget_of(args.tweak_budget, row)
                runs["tweak"], row["tune_s"], result, mine = tweaked(model, data, row["tweak_budget_s"],
                                                                     timeout=args.tweak_timeout)
                row["tweak_depth"] = result.selected_depth
                row["tweak_table"] = str(result)
                row["tweak_modules"] = {p: m.backend for p, m in result.modules.items()}
                if result.selected_depth is not None:
                    row["tweak_selected"] = {p: row["tweak_modules"].get(p)
                                             for p in result.tree.cut(result.selected_depth)}
            elif column.startswith("tweak-"):
                options = TWEAK_VARIANTS[column[len("tweak-"):]]
                budget = budget_of(args.variant_budget, row)
                runs[column], row["compile_s"][column], res, _ = tweaked(model, data, budget, options,
                                                                         args.tweak_timeout)
                row.setdefault("variants", {})[column] = {"budget_s": budget,
                    "depth": res.selected_depth, "table": str(res), "lower_precision": res.lower_precision,
                    "chosen": {p: m.backend for p, m in res.modules.items() if m.kept and m.backend}}
            else:
                with torch.no_grad():
                    made = makers[column]()
                if isinstance(made, tuple):
                    runs[column], row["compile_s"][column] = made
                else:
                    runs[column] = made
        except Exception as exc:  # a column that cannot run is reported, not fatal
            row["errors"][column] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
            if column.startswith("tweak"):
                traceback.print_exc()
            sync()
        if column in runs:  # a first latency now, paired with eager: a row cut short keeps it
            try:
                first = measure({"eager": eager, column: runs[column]}, len(data), 5, 20)
                row.setdefault("early", {})[column] = {"ms": first[column]["ms"], "eager_ms": first["eager"]["ms"],
                                                       "error": output_error(eager, runs[column])}
            except Exception as exc:
                row["errors"][f"{column} early"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
        partial(row)
    row["max_error"] = {}
    for column, run in runs.items():  # every column's error against eager, each synchronised: a
        try:                          # device error is laid at the column that raised it
            row["max_error"][column] = output_error(eager, run)
        except Exception as exc:
            row["errors"][f"{column} error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0]}"
    partial(row)
    print(f"  {name} {dtype_name}: measuring {', '.join(runs)}", flush=True)
    stats = measure(runs, len(data), args.warmup, args.rounds)
    for column, s in stats.items():
        row["ms"][column] = s["ms"]
        row["spread"][column] = [s["q25"], s["q75"]]
        if "roofline" in row:
            row.setdefault("roofline_fraction", {})[column] = row["roofline"]["floor_ms"] / s["ms"]
    if mine is not None and DEVICE == "cuda":
        try:
            row["dispatch"] = dispatcher_overhead(mine, data)
        except Exception as exc:
            row["errors"]["dispatch"] = f"{type(exc).__name__}: {exc}"
    del runs, model, mine
    return row


def add_roofline(paths: list[str], only: set[tuple[str, str]] | None = None) -> None:
    """For each run file, the same file with every row's roofline computed here (the FLOPs and
    bytes of one call depend on the model and its inputs, not on the device that counts them)
    and each measured column's roofline fraction from the run's own latencies; written beside
    it as NAME-roofline.json, or over it when it is such a file already. only: (model, dtype)
    of the rows to count again (--rows); the others keep what they have."""
    for path in paths:
        with open(path) as f:
            data = json.load(f)
        for row in data["rows"]:
            if row.get("model") not in SIZES or row.get("dtype") not in DTYPES:
                continue
            if only is not None and (row["model"], row["dtype"]) not in only:
                continue
            model, rows_data = build(row["model"], DTYPES[row["dtype"]])
            try:
                row["roofline"] = roofline(model, rows_data, row["dtype"])
            except Exception as exc:
                row.setdefault("errors", {})["roofline"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
                continue
            row["roofline"]["counted_on"] = f"{DEVICE} at {source_commit()}, after the run"
            row["roofline_fraction"] = {c: row["roofline"]["floor_ms"] / ms for c, ms in row.get("ms", {}).items()}
            print(row["model"], row["dtype"], json.dumps({k: v for k, v in row["roofline"].items()}), flush=True)
            del model, rows_data
            gc.collect()
        out = path if path.endswith("-roofline.json") else os.path.splitext(path)[0] + "-roofline.json"
        with open(out, "w") as f:
            json.dump(data, f, indent=1)
        print("written:", out)


def source_commit() -> str:
    """The commit of this checkout (with "+changes" when the tree differs from it), or "unknown".
    TT_BENCH_COMMIT names it instead, for a copied tree whose git metadata is not its own."""
    import subprocess
    if os.environ.get("TT_BENCH_COMMIT"):
        return os.environ["TT_BENCH_COMMIT"]
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=HERE, capture_output=True,
                              text=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=HERE,
                               capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return head + ("+changes" if dirty else "")


def run_file_name(path: str) -> str:
    """What a run file calls itself: its path relative to the repository, or its bare name
    when it lies outside (a machine's own folders stay out of the file)."""
    where = os.path.relpath(os.path.abspath(path), os.path.dirname(HERE))
    return where if not where.startswith("..") else os.path.basename(path)


def environment() -> dict:
    import torch_tweak
    info = {"gpu": torch.cuda.get_device_name() if DEVICE == "cuda" else "CPU (smoke run)", "torch": torch.__version__,
            "cuda": torch.version.cuda,
            "python": platform.python_version(), "torch_tweak": torch_tweak.__version__,
            "commit": source_commit(), "tweak_max_depth": sys.modules["torch_tweak.tweak"].DEFAULT_MAX_DEPTH}
    for mod in ("transformers", "timm", "torchvision"):
        try:
            info[mod] = __import__(mod).__version__
        except Exception:
            info[mod] = "missing"
    return info


def run(args: argparse.Namespace) -> None:
    models = [m for m in args.models.split(",") if m]
    dtypes = [d for d in args.dtypes.split(",") if d]
    pairs = [(m, d) for m in models for d in dtypes]
    if args.rows:
        pairs = [tuple(r.split(":", 1)) for r in args.rows.split(",") if r]
    out = {"environment": environment(), "settings": {"warmup": args.warmup, "rounds": args.rounds,
                                                       "samples": N_SAMPLES, "tweak_budget": args.tweak_budget,
                                                       "compile_timeout": args.compile_timeout,
                                                       "tweak_timeout": args.tweak_timeout,
                                                       "tweak_variants": args.tweak_variants,
                                                       "variant_budget": args.variant_budget,
                                                       "mark_step": args.mark_step},
           "rows": []}
    preload_inductor()
    if args.probe:
        out["replay_path"] = replay_path_probe()
    for name, dtype_name in pairs:
        if True:
            t0 = time.perf_counter()

            last: dict[str, dict] = {}

            def partial(row: dict) -> None:  # a run stopped at its limit keeps the compile times it has
                last["row"] = row
                with open(args.json, "w") as f:
                    json.dump(dict(out, rows=out["rows"] + [dict(row, partial=True)]), f, indent=1)

            dead = False
            try:
                row = bench_one(name, dtype_name, args, partial)
            except Exception as exc:  # what the row had built and measured so far is kept
                traceback.print_exc()
                row = dict(last.get("row") or {"model": name, "dtype": dtype_name, "size": SIZES.get(name, ""),
                                               "compile_s": {}, "errors": {}}, partial=True, ms={})
                row["errors"] = dict(row.get("errors", {}), all=f"{type(exc).__name__}: {str(exc).splitlines()[0]}")
                # a device error is sticky: nothing after it in this process can run
                dead = DEVICE == "cuda" and "CUDA error" in str(exc)
            row["wall_s"] = time.perf_counter() - t0
            out["rows"].append(row)
            print(json.dumps({k: row.get(k) for k in ("model", "dtype", "ms", "compile_s", "tune_s", "errors",
                                                       "tweak_depth", "wall_s")}), flush=True)
            with open(args.json, "w") as f:  # after every row: a run stopped at its limit keeps what it did
                json.dump(out, f, indent=1)
            if dead:
                print("the device is in an error state: the rows left need a new process", flush=True)
                break
    print(f"written: {args.json}")


# ------------------------------------------------------------------- report


def targets(row: dict) -> dict:
    ms = row.get("ms", {})
    alts = {c: ms[c] for c in ALTERNATIVES if c in ms}
    t: dict[str, Any] = {}
    if "tweak" in ms and alts:
        best_name = min(alts, key=alts.get)
        t["best_alt"] = best_name
        t["le_best"] = ms["tweak"] <= alts[best_name]
        t["lt_best"] = ms["tweak"] < alts[best_name]
    ro = row.get("compile_s", {}).get("reduce-overhead")
    if ro and row.get("tune_s") is not None:
        t["tune_ratio"] = row["tune_s"] / ro
    d = row.get("dispatch") or []
    if d:
        t["dispatch_max_ns"] = max(x["overhead_ns"] for x in d)
    return t


def variant_floor_ms(row: dict, column: str) -> float | None:
    """The roofline floor of a tweak column in the numerics it runs in: the row's own floor for
    the default tweak and effort="high" (same numerics), the TF32 peak for tweak-tf32, the bf16
    peak for tweak-bf16 (autocast: bf16 tensor-core math; the weights are still read as they
    are stored, so the least bytes stay the row's)."""
    f = row.get("roofline")
    if not f:
        return None
    if column == "tweak-tf32":
        return f["floor_ms_tf32"]
    if column == "tweak-bf16":
        return max(f["flops"] / PEAK_FLOPS["bf16"], f["bytes_least"] / f["peak_bytes"]) * 1e3
    return f["floor_ms"]


def first_only(row: dict) -> None:
    """A row its run's time limit cut short has no interleaved figures: its columns' first
    latencies (each measured beside eager right after its build) stand in, eager's the median
    of its pairings, and the row is marked."""
    if row.get("ms") or not row.get("early"):
        return
    early = row["early"]
    row["ms"] = {c: e["ms"] for c, e in early.items()}
    row["ms"]["eager"] = statistics.median(e["eager_ms"] for e in early.values())
    row["first_only"] = True
    for c, e in early.items():
        if e.get("error") is not None:
            row.setdefault("max_error", {}).setdefault(c, e["error"])
    if row.get("roofline"):
        row["roofline_fraction"] = {c: row["roofline"]["floor_ms"] / ms for c, ms in row["ms"].items()}


def row_order(row: dict) -> tuple[int, int]:
    return (MODELS.index(row["model"]) if row["model"] in MODELS else len(MODELS),
            list(DTYPES).index(row["dtype"]) if row["dtype"] in DTYPES else len(DTYPES))


def weight(row: dict) -> tuple[int, bool]:
    """How much a row says: its measured alternative columns, then whether its figures are
    the final interleaved ones."""
    return sum(c in row.get("ms", {}) for c in ALTERNATIVES), not row.get("first_only")


def main_rows(rows: list[dict]) -> list[dict]:
    """One row per model and dtype for the main tables: of the runs that measured it, the one
    with the most alternative columns measured (the later run on a tie). Another run of the
    same row (e.g. one for tweak's variants) shows in the variants table, its ratios taken
    within that run."""
    best: dict[tuple[str, str], dict] = {}
    for r in rows:
        key = (r["model"], r["dtype"])
        if key not in best or weight(r) >= weight(best[key]):
            best[key] = r
    return sorted(best.values(), key=row_order)


def elsewhere(every: list[dict], rows: list[dict]) -> list[tuple[dict, str]]:
    """(run row, column) for each alternative column that a main row lacks and another run of the
    same model and dtype measured beside its own tweak (e.g. a run of the max-autotune columns
    alone): shown in a table of their own, each against the tweak of its run."""
    main = {(r["model"], r["dtype"]): r for r in rows}
    out = []
    for r in sorted(every, key=row_order):
        m = main.get((r["model"], r["dtype"]))
        if m is None or r is m or "tweak" not in r.get("ms", {}):
            continue
        same = [x for x in every if x is not r and (x["model"], x["dtype"]) == (r["model"], r["dtype"])
                and "tweak" in x.get("ms", {})]
        out += [(r, c) for c in ALTERNATIVES[1:] if c in r["ms"] and c not in m.get("ms", {})
                and not any(c in x["ms"] and out_later(x, r, every) for x in same)]
    return out


def out_later(x: dict, r: dict, every: list[dict]) -> bool:
    """Whether run row x, rather than r, is the one to show for a column both measured: the
    one whose figures are final interleaved ones, then the later in the merge."""
    return (not x.get("first_only"), every.index(x)) > (not r.get("first_only"), every.index(r))


def floor_cell(floor_ms: float | None, ms: float) -> str:
    return "-" if floor_ms is None else f"{floor_ms / ms * 100:.3g}% ({floor_ms:.3f})"


def commits_of(rows: list[dict]) -> str:
    """'commits 5c15d42 (7 rows) and f052825 (3 rows)', or 'commit 5c15d42': the commits that
    measured these rows, in order of first use."""
    count: dict[str, int] = {}
    for r in rows:
        count[r["commit"]] = count.get(r["commit"], 0) + 1
    if len(count) == 1:
        return f"commit {next(iter(count))}"
    each = [f"{c} ({n} row{'s' if n > 1 else ''})" for c, n in count.items()]
    return "commits " + ", ".join(each[:-1]) + " and " + each[-1]


def merge(paths: list[str], out_dir: str, notes: str | None = None) -> None:
    """gpu.md and gpu.png from run files. Each row keeps its run's commit and settings; the main
    tables take, per model and dtype, the run with the most alternative columns. NOTES, a
    markdown file of hand-written findings (default: gpu-notes.md in OUT_DIR, if there is one),
    is appended as it is."""
    runs = [json.load(open(p)) for p in paths]
    for run_ in runs:
        for r in run_["rows"]:
            r.setdefault("commit", run_["environment"].get("commit", "unknown"))
            r.setdefault("run_settings", run_["settings"])
    every = [r for run in runs for r in run["rows"]]
    for r in every:
        first_only(r)
    rows = main_rows(every)
    env = runs[0]["environment"]
    settings = runs[0]["settings"]
    protocols = sorted({(r["run_settings"]["warmup"], r["run_settings"]["rounds"]) for r in rows})
    protocol = " or ".join(f"{w} warm-up calls, then the median of {n} interleaved rounds" for w, n in protocols)
    probe = next((r["replay_path"] for r in runs if r.get("replay_path")), None)
    md = ["# torch-tweak on the GPU", "",
          f"Produced by `python bench/gpu_bench.py` on one {env['gpu']} (torch {env['torch']}, CUDA {env['cuda']}, "
          f"Python {env['python']}, transformers {env['transformers']}, timm {env['timm']}, "
          f"torchvision {env['torchvision']}; torch-tweak at {commits_of(rows)}: the run column names each "
          f"row's), {len(paths)} run(s) merged with `--merge` (each run a machine of "
          f"that kind, not necessarily the same one: compare columns within a row). Random weights, "
          f"{settings['samples']} random calls per model cycled; per column {protocol} of one synchronised "
          f"call (each run's choice is in its file's settings).", "",
          "Run files, relative to this report, in the order `--merge` took them (the same command on them "
          "writes this report again): " + ", ".join(f"`{os.path.relpath(p, out_dir)}`" for p in paths)
          + ".", "", "Every compiling column (compile, reduce-overhead, max-autotune, tweak) starts cold: a fresh "
          "Inductor and Triton cache folder, dynamo reset (before each tweak column; each torch.compile "
          "column is its own), Inductor's in-memory caches cleared, tweak's "
          "tuning cache off. The first compile of the run (the first row's compile column) also pays the "
          "compiler's one-time start in the process.", "",
          "The graph column returns its static output (the next call overwrites it, held or not); tweak's "
          "device graphs lend their outputs without a copy while the caller holds nothing from the last "
          "call (the case here: each output is dropped) and copy them otherwise "
          "(docs/device-graph.md).", "",
          "## Latency (ms per call, median) and speedup against eager", ""]
    cols = [c for c in COLUMNS if any(c in r.get("ms", {}) or c in r.get("errors", {}) for r in rows)]
    md.append("| model | dtype | " + " | ".join(cols) + " | tweak vs eager | tweak vs best other | run |")
    md.append("|---|---|" + "---:|" * len(cols) + "---:|---:|---|")
    for r in rows:
        ms = r.get("ms", {})
        cells = []
        for c in cols:
            if c in ms:
                cells.append(f"{ms[c]:.3f}")
            elif c in r.get("errors", {}):
                cells.append("not compiled in time" if r["errors"][c].startswith("CompileTimeout") else "failed")
            else:
                cells.append("-")
        t = targets(r)
        vs_eager = f"{ms['eager'] / ms['tweak']:.2f}x" if "tweak" in ms and "eager" in ms else "-"
        vs_best = (f"{ms[t['best_alt']] / ms['tweak']:.2f}x ({t['best_alt']})" if "best_alt" in t else "-")
        mark = " *" if r.get("first_only") else ""
        md.append(f"| {r['model']}{mark} | {r['dtype']} | " + " | ".join(cells) + f" | {vs_eager} | {vs_best} | "
                  f"{r['commit']} |")
    if any(r.get("first_only") for r in rows):
        md += ["", "\\* a row its run's time limit stopped before the final measurement: each latency is the "
               "column's first one, measured beside eager right after its build (5 warm-up calls, 20 interleaved "
               "rounds); eager's is the median of its pairings. Columns left empty were not reached."]
    extra = elsewhere(every, rows)
    if extra:
        md += ["", "### Columns measured in another run", "",
               "A column a row above lacks, measured in another run of the same model and dtype, beside that "
               "run's own tweak (the ratio is within that run).", "",
               "| model | dtype | column | ms | tweak ms (same run) | tweak vs it | compile s | run |",
               "|---|---|---|---:|---:|---:|---:|---|"]
        for r, c in extra:
            ms = r["ms"]
            cs = r.get("compile_s", {}).get(c)
            md.append(f"| {r['model']}{' *' if r.get('first_only') else ''} | {r['dtype']} | {c} | {ms[c]:.3f} | "
                      f"{ms['tweak']:.3f} | {ms[c] / ms['tweak']:.2f}x | {'-' if cs is None else f'{cs:.1f}'} | "
                      f"{r['commit']} |")
    md += ["", "## Tuning and compile time (s)", "",
           "Compile time: the wall time of the first three calls. tweak budget: the time_budget given to "
           "tt.tweak (none: its defaults; with --tweak-budget auto, 3x reduce-overhead's compile time; "
           "the depth in progress when it runs out still finishes). tt.tweak runs with its other defaults"
           + (f" (max_depth {env['tweak_max_depth']})." if "tweak_max_depth" in env else "."), "",
           "| model | dtype | compile | reduce-overhead | max-autotune | max-autotune-no-cudagraphs | tweak budget | tweak tuning | tweak / reduce-overhead | tweak depth | backends at that depth |",
           "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    for r in rows:
        cs = r.get("compile_s", {})
        t = targets(r)
        selected = r.get("tweak_selected")
        if selected is None and r.get("tweak_depth") == 0 and "" in (r.get("tweak_modules") or {}):
            selected = {"": r["tweak_modules"][""]}  # runs before tweak_selected was written
        chosen: dict[str, int] = {}
        for b in (selected or {}).values():
            chosen[str(b)] = chosen.get(str(b), 0) + 1
        cells = [f"{cs[c]:.1f}" if c in cs else ("timeout" if r.get("errors", {}).get(c, "").startswith("CompileTimeout")
                                                  else "-")
                 for c in ("compile", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")]
        tune = f"{r['tune_s']:.1f}" if r.get("tune_s") is not None else "-"
        ratio = f"{t['tune_ratio']:.2f}" if "tune_ratio" in t else "-"
        picks = ", ".join(f"{k} x{v}" for k, v in sorted(chosen.items()))
        budget = f"{r['tweak_budget_s']:.1f}" if r.get("tweak_budget_s") is not None else "none"
        md.append(f"| {r['model']} | {r['dtype']} | {' | '.join(cells)} | {budget} | {tune} | {ratio} | "
                  f"{r.get('tweak_depth', '-')} | {picks} |")
    variants = [(r, c, v) for r in sorted(every, key=row_order) for c, v in (r.get("variants") or {}).items()]
    if variants:
        md += ["", "## tweak with the new axes and precision policies", "",
               "tweak-high: effort=\"high\"; tweak-tf32 / tweak-bf16: the opt-in precision policy, with its "
               "tolerance; tuning s: the variant's, with the time_budget it was given if any (--variant-budget); "
               "tweak ms and tuning s: the default tweak of the same run, measured interleaved with "
               "the variant; error: the largest relative error of the first output against eager; of floor: the "
               "roofline floor of the numerics the column runs in (the row's own for tweak-high, the TF32 peak for "
               "tweak-tf32, the bf16 peak for tweak-bf16; the least bytes always the row's) over its latency.", "",
               "| model | dtype | column | ms | tweak ms | vs tweak | tuning s | tweak tuning s | error | kept depth "
               "| lower precision kept | of floor (floor ms) | run |",
               "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---|---:|---|"]
        for r, c, v in variants:
            ms = r.get("ms", {})
            mark = " *" if r.get("first_only") else ""
            if c not in ms:
                md.append(f"| {r['model']}{mark} | {r['dtype']} | {c} | failed | - | - | - | - | - | - | - | - | "
                          f"{r['commit']} |")
                continue
            plain = f"{ms['tweak']:.3f}" if "tweak" in ms else "-"
            vs = f"{ms['tweak'] / ms[c]:.2f}x" if "tweak" in ms else "-"
            err = r.get("max_error", {}).get(c)
            tune = f"{r['tune_s']:.1f}" if r.get("tune_s") is not None else "-"
            given = v.get("budget_s")
            md.append(f"| {r['model']}{mark} | {r['dtype']} | {c} | {ms[c]:.3f} | {plain} | {vs} | "
                      f"{r['compile_s'].get(c, 0):.1f}{'' if given is None else f' (budget {given:.0f})'} | {tune} | {'-' if err is None else f'{err:.2g}'} | "
                      f"{v['depth']} | {', '.join(sorted(set(v['lower_precision'].values()))) or 'none'} | "
                      f"{floor_cell(variant_floor_ms(r, c), ms[c])} | {r['commit']} |")
        high = [(r, r["ms"]["tweak"] / r["ms"]["tweak-high"]) for r, c, _ in variants
                if c == "tweak-high" and "tweak" in r.get("ms", {}) and "tweak-high" in r.get("ms", {})]
        if high:
            md += ["", f"effort=\"high\" is at least 1.25x faster than the default tweak of its run on "
                       f"{sum(x >= 1.25 for _, x in high)} of {len(high)} rows (target: half of the bench's "
                       f"{len(MODELS) * len(DTYPES)}; it ran {min(x for _, x in high):.2f}x to "
                       f"{max(x for _, x in high):.2f}x); its tuning took "
                       f"{min(r['compile_s']['tweak-high'] for r, _ in high):.0f} "
                       f"to {max(r['compile_s']['tweak-high'] for r, _ in high):.0f} s"
                       + (f", {min(r['compile_s']['tweak-high'] / r['tune_s'] for r, _ in high):.1f}x to "
                          f"{max(r['compile_s']['tweak-high'] / r['tune_s'] for r, _ in high):.1f}x the default's"
                          if all(r.get("tune_s") for r, _ in high) else "") + "."]
    roof = [r for r in rows if r.get("roofline")]
    if roof:
        md += ["", "## Distance to the hardware (roofline)", "",
               "FLOPs per call from torch.utils.flop_counter.FlopCounterMode; least bytes: every parameter and "
               "buffer read once, the inputs read once and the outputs written once (op by op: every aten op's "
               "tensor inputs read and outputs written, no fusion). Floor: max(FLOPs / peak compute, least bytes / "
               "4.8 TB/s) with peak compute 989 TFLOP/s for bf16; for fp32, torch's default numerics: matrix products "
               "at 67 TFLOP/s (no tensor cores), convolutions at the TF32 peak of 494 TFLOP/s (cuDNN's default; the "
               "conv GFLOP column) (the floor with every FLOP in TF32 is in the run file). Each column: the floor "
               "over its median latency, in percent.", "",
               "| model | dtype | GFLOP | least MB | op-by-op MB | bound | floor ms | "
               + " | ".join(cols) + " |", "|---|---|---:|---:|---:|---|---:|" + "---:|" * len(cols)]
        for r in roof:
            f = r["roofline"]
            frac = r.get("roofline_fraction", {})
            md.append(f"| {r['model']} | {r['dtype']} | {f['flops'] / 1e9:.1f} | {f['bytes_least'] / 1e6:.0f} | "
                      f"{f['bytes_op_by_op'] / 1e6:.0f} | {f['bound']} | {f['floor_ms']:.3f} | "
                      + " | ".join(f"{frac[c] * 100:.3g}%" if c in frac else "-" for c in cols) + " |")
    md += ["", "## Targets", "",
           "| model | dtype | tweak <= best other | tweak < best other | tuning <= 3x reduce-overhead compile | dispatcher < 500 ns/module (max) |",
           "|---|---|---|---|---|---|"]
    n_lt = n_rows = 0
    for r in rows:
        t = targets(r)
        if "le_best" in t:
            n_rows += 1
            n_lt += bool(t["lt_best"])
        yes = lambda v: "-" if v is None else ("yes" if v else "NO")  # noqa: E731
        md.append(f"| {r['model']}{' *' if r.get('first_only') else ''} | {r['dtype']} | {yes(t.get('le_best'))} | "
                  f"{yes(t.get('lt_best'))} | "
                  f"{yes(t['tune_ratio'] <= 3 if 'tune_ratio' in t else None)}"
                  f"{' (%.2fx)' % t['tune_ratio'] if 'tune_ratio' in t else ''} | "
                  f"{yes(t['dispatch_max_ns'] < 500 if 'dispatch_max_ns' in t else None)}"
                  f"{' (%.0f ns)' % t['dispatch_max_ns'] if 'dispatch_max_ns' in t else ''}"
                  f"{'' if all('signatures' in x for x in r.get('dispatch') or []) else ', no signature check'} |")
    md += ["", f"tweak is strictly faster than the best other column on {n_lt} of {n_rows} model/dtype rows "
               f"(target: at least half)."]
    if extra:
        faster = sum(r["ms"]["tweak"] < r["ms"][c] for r, c in extra)
        md += ["", f"Of the columns measured in another run, tweak is faster than {faster} of {len(extra)} "
                   f"beside it in their run."]
    md += [""]
    errors = [(r["model"], r["dtype"], c, e) for r in rows for c, e in r.get("errors", {}).items()]
    if errors:
        md += ["## Columns that failed", ""] + [f"- {m} {d} {c}: {e}" for m, d, c, e in errors] + [""]
    md += ["## Dispatcher overhead per tuned module", "",
           "ns per call through the module's dispatcher minus ns per call of the same no-op backend "
           "called directly, under torch.no_grad, with the module's real arguments and the dispatcher's "
           "entries and their flags as tuning set "
           "them (their signature checks included); best of 5 timeit loops of 20000 calls.", "",
           "| model | dtype | modules | signature checks | median ns | max ns |", "|---|---|---:|---|---:|---:|"]
    for r in rows:
        d = r.get("dispatch") or []
        if d:
            o = [x["overhead_ns"] for x in d]
            # runs before the dispatcher matched by signature measured entries without one
            checks = "yes" if all("signatures" in x for x in d) else "no (entry signature None)"
            md.append(f"| {r['model']} | {r['dtype']} | {len(o)} | {checks} | {statistics.median(o):.0f} | "
                      f"{max(o):.0f} |")
    if probe:
        md += ["", "## Replay path, CPU cost per call", "",
               "A tiny graph (nn.Linear(16, 16), batch 4) called 5000 times between two synchronisations, "
               "best of 5: the host cost of one replay.", "", "| path | us per call |", "|---|---:|"]
        md += [f"| {p['case']} | {p['us']:.2f} |" for p in probe]
    md += ["", "## tweak's tables", ""]
    for r in rows:
        if r.get("tweak_table"):
            md += [f"{r['model']} {r['dtype']}:", "```", r["tweak_table"], "```", ""]
    if notes is None and os.path.exists(os.path.join(out_dir, "gpu-notes.md")):
        notes = os.path.join(out_dir, "gpu-notes.md")
    if notes:
        with open(notes) as f:
            md += ["", f.read().rstrip()]
        print(f"appended: {notes}")
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "gpu.md"), "w") as f:
        f.write("\n".join(md) + "\n")
    print(f"written: {os.path.join(out_dir, 'gpu.md')}")
    chart(rows, cols, os.path.join(out_dir, "gpu.png"))


def chart(rows: list[dict], cols: list[str], path: str) -> None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no chart (gpu.png not written)")
        return
    labels = [f"{r['model']}\n{r['dtype']}" for r in rows]
    shown = [c for c in cols if c != "eager"]
    fig, ax = plt.subplots(figsize=(max(8, 1.2 * len(rows)), 4.5))
    width = 0.8 / max(1, len(shown))
    for j, c in enumerate(shown):
        ys = [r["ms"]["eager"] / r["ms"][c] if c in r.get("ms", {}) and "eager" in r["ms"] else 0 for r in rows]
        ax.bar([i + (j - (len(shown) - 1) / 2) * width for i in range(len(rows))], ys, width, label=c)
    ax.axhline(1.0, color="gray", linewidth=0.8)
    ax.set_xticks(range(len(rows)))
    ax.set_xticklabels(labels, fontsize=8)
    ax.set_ylabel("speedup against eager (higher is better)")
    ax.legend(fontsize=8, ncol=3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"written: {path}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--dtypes", default=",".join(DTYPES))
    parser.add_argument("--rows", default="", help="model:dtype pairs instead of --models x --dtypes, "
                        "e.g. encoder:fp32,bert:bf16")
    parser.add_argument("--quick", action="store_true", help="fewer warm-up calls and rounds")
    parser.add_argument("--columns", default="", help="only these columns, built in this order (eager always "
                        "runs), e.g. reduce-overhead,tweak,max-autotune,tweak-high")
    parser.add_argument("--max-autotune", action="store_true",
                        help="add torch.compile mode max-autotune and max-autotune-no-cudagraphs")
    parser.add_argument("--compile-timeout", type=float, default=600.0,
                        help="seconds a compiling column may take before it is reported as not finished")
    parser.add_argument("--mark-step", action="store_true", help="call torch.compiler.cudagraph_mark_step_begin() "
                        "before each measured call of reduce-overhead and max-autotune (their CUDA graph trees)")
    parser.add_argument("--tweak-variants", default="", help="comma list of high, tf32, bf16: tt.tweak with "
                        "effort='high' / precision (fp32 rows)")
    parser.add_argument("--tweak-timeout", type=float, default=None, help="seconds each tweak column may take")
    parser.add_argument("--cpu", action="store_true", help="smoke run on the CPU (no CUDA graph column, no figures "
                        "to compare): checks the code runs")
    parser.add_argument("--tweak-budget", default=None,
                        help="tt.tweak(time_budget=...): seconds, or 'auto' for 3x reduce-overhead's compile time")
    parser.add_argument("--variant-budget", default=None,
                        help="time_budget of the tweak-high / tweak-tf32 / tweak-bf16 columns: seconds, or 'auto' "
                             "for 3x reduce-overhead's compile time (that column built before them); the variants "
                             "not built when it runs out are left out")
    parser.add_argument("--probe", action="store_true", help="also time the replay path on a tiny graph")
    parser.add_argument("--json", default=os.path.join(HERE, "results", "gpu.json"))
    parser.add_argument("--merge", nargs="+", metavar="JSON", help="write gpu.md and gpu.png from run files")
    parser.add_argument("--roofline-of", nargs="+", metavar="JSON", help="add the roofline to earlier run files "
                        "(counted on this machine, with --cpu on the CPU; with --rows, those rows only): writes "
                        "NAME-roofline.json beside each, or over it when it is one")
    parser.add_argument("--notes", default=None, help="with --merge: a markdown file appended to gpu.md "
                        "(default: gpu-notes.md in --out-dir, if there is one)")
    parser.add_argument("--out-dir", default=os.path.join(HERE, "results"))
    args = parser.parse_args()
    args.warmup, args.rounds = (10, 30) if args.quick else (20, 100)
    args.columns = [c for c in args.columns.split(",") if c]
    unknown = sorted(set(args.columns) - set(COLUMNS))
    if unknown:
        sys.exit(f"unknown column {', '.join(unknown)}; the columns are {', '.join(COLUMNS)}")
    autotuned = [i for i, c in enumerate(args.columns) if c.startswith("max-autotune")]
    if autotuned and any(c.startswith("tweak") for c in args.columns[autotuned[0]:]):
        sys.exit("--columns: put the max-autotune columns after the tweak ones (a tweak column resets dynamo, "
                 "and a max-autotune column built before it would autotune again when next called)")
    if args.merge:
        merge(args.merge, args.out_dir, args.notes)
        return
    unknown = sorted(set(v for v in args.tweak_variants.split(",") if v) - set(TWEAK_VARIANTS))
    if unknown:
        sys.exit(f"unknown tweak variant {', '.join(unknown)}; the variants are {', '.join(TWEAK_VARIANTS)}")
    if args.cpu:
        global DEVICE
        DEVICE = "cpu"
    elif not torch.cuda.is_available():
        sys.exit("gpu_bench needs a CUDA device (or --cpu for a smoke run)")
    if args.roofline_of:
        add_roofline(args.roofline_of, {tuple(r.split(":", 1)) for r in args.rows.split(",") if r}
                     if args.rows else None)
        return
    os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
    run(args)


if __name__ == "__main__":
    main()
