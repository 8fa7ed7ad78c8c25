"""The tuning cache and tt.save / tt.load on examples/Tweak's encoder, as the example runs it
(batch 1 on the CPU, 8 on a GPU; tt.tweak's default depths), in one run.

1. tweak a freshly built encoder with empty caches (torch-tweak's folder and Inductor's, both
   in a temporary folder), timed;
2. in a new process, as the example run a second time (its dry run, then its tweak), tweak a
   freshly built encoder: a cache hit, timed (wall and CPU seconds, and per step), with the
   OpenVINO models the first tweak converted kept in torch-tweak's folder; then again with
   that folder emptied: the conversions the kept models save;
3. where the time of an OpenVINO build of the encoder goes: ov.convert_model, its model read
   back from torch-tweak's folder, Core.compile_model, and a compiled blob exported and
   imported (what OpenVINO's own model cache, CACHE_DIR, would keep instead);
4. save the tuned model, load it into a freshly built encoder in a new process (its
   LoadResult says what it cost and what it built again), and measure the tuned model here
   and the loaded one there with the engine's protocol, taking turns (tuned, loaded, tuned,
   loaded...; the lowest median of each counts, so a burst of load on the machine does not
   fall on one side), and compare their outputs.

The machine's load average is written beside each figure: on a machine other processes use,
a wall-clock second is longer than a quiet one's. Writes bench/results/cache_<device>.md.
Usage:
    python bench/cache_bench.py [--device cpu|cuda] [--batch N] [--max-depth N] [--out PATH]
"""

from __future__ import annotations

import argparse
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
    start, cpu = time.perf_counter(), time.process_time()
    loaded = tt.load(model, args.child[0])
    load_s, load_cpu = time.perf_counter() - start, time.process_time() - cpu
    inputs = load_file(args.child[1], device=args.device)
    dataset = [inputs[f"x{i}"] for i in range(len(inputs))]
    with torch.no_grad():
        save_file({f"y{i}": model(x).cpu() for i, x in enumerate(dataset)}, args.child[2])
    summary = loaded.summary().replace(args.child[0], os.path.basename(args.child[0]))  # no temporary folder named
    print(json.dumps({"load_s": load_s, "load_cpu": load_cpu, "summary": summary,
                      "loadavg": os.getloadavg()[0]}), flush=True)
    for line in sys.stdin:  # one measurement per request, taking turns with the parent
        if line.strip() != "measure":
            break
        print(json.dumps(latency_ms(model, dataset, args.device)), flush=True)
    return 0


ROOT = "(root)"


def timed(what):
    """(what(), wall seconds, CPU seconds of this process, the machine's 1-minute load average)."""
    start, cpu = time.perf_counter(), time.process_time()
    out = what()
    return out, time.perf_counter() - start, time.process_time() - cpu, os.getloadavg()[0]


class Parts:
    """Wall and CPU seconds spent in some of torch-tweak's steps while it is entered: where a
    cache hit's time goes."""

    STEPS = [("_search.plan", "record", "recording the dataset (and the declared ends)"),
             ("_core.correctness", "reference", "the reference: the module at a higher precision (measured rule)"),
             ("backends.base", "Backend.prepare", "the backends' builds"),
             ("_search.tuning", "check", "the checks of the rebuilt backends' outputs"),
             ("_core.model_state", "Snapshot.restore", "the module's state checked and put back after each step")]

    def __enter__(self):
        import importlib

        self.spent, self.undo = {}, []
        for module, name, label in self.STEPS:
            owner = importlib.import_module(f"torch_tweak.{module}")
            holder, attr = (getattr(owner, name.split(".")[0]), name.split(".")[1]) if "." in name else (owner, name)
            real = getattr(holder, attr)
            self.spent[label] = [0.0, 0.0]
            setattr(holder, attr, self._timed(real, self.spent[label]))
            self.undo.append((holder, attr, real))
        return self

    @staticmethod
    def _timed(real, into):
        def timed_call(*args, **kwargs):
            start, cpu = time.perf_counter(), time.process_time()
            try:
                return real(*args, **kwargs)
            finally:
                into[0] += time.perf_counter() - start
                into[1] += time.process_time() - cpu
        return timed_call

    def __exit__(self, *exc):
        for holder, attr, real in self.undo:
            setattr(holder, attr, real)


def openvino_parts(device: str, batch: int) -> list[tuple[str, float, float]] | None:
    """(part, wall s, CPU s) of an OpenVINO build of the whole encoder; None without OpenVINO."""
    try:
        import openvino as ov
    except ImportError:
        return None
    import io

    import numpy as np
    import torch

    import encoder

    model, x = encoder.build("cpu"), encoder.samples("cpu", batch=batch)[0]
    core = ov.Core()
    props = {"PERFORMANCE_HINT": "LATENCY", "INFERENCE_PRECISION_HINT": "f32"}
    with torch.no_grad():
        ov.convert_model(model, example_input=(x,), input=[tuple(x.shape)])  # its imports, once
        converted, *convert = timed(lambda: ov.convert_model(model, example_input=(x,), input=[tuple(x.shape)]))
    with tempfile.TemporaryDirectory() as scratch:
        ov.save_model(converted, os.path.join(scratch, "m.xml"), compress_to_fp16=False)
        xml, weights = (open(os.path.join(scratch, name), "rb").read() for name in ("m.xml", "m.bin"))
    _, *read = timed(lambda: core.read_model(xml, ov.Tensor(np.frombuffer(weights, dtype=np.uint8).copy())))
    compiled, *compile_ = timed(lambda: core.compile_model(converted, "CPU", props))
    blob = io.BytesIO()
    compiled.export_model(blob)
    _, *imported = timed(lambda: core.import_model(io.BytesIO(blob.getvalue()), "CPU", props))
    return [("ov.convert_model (the module traced and converted)", *convert[:2]),
            ("its converted model read back from bytes (torch-tweak's folder)", *read[:2]),
            ("Core.compile_model", *compile_[:2]),
            ("a compiled blob imported (what CACHE_DIR keeps)", *imported[:2])]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default=None)
    parser.add_argument("--batch", type=int, default=None, help="sequences per call (the example's: 1 on the CPU)")
    parser.add_argument("--max-depth", type=int, default=None, help="the deepest cut (default: tt.tweak's)")
    parser.add_argument("--out", default=None)
    parser.add_argument("--turns", type=int, default=3, help="measurements of each model, taking turns")
    parser.add_argument("--child", nargs=3, help=argparse.SUPPRESS)
    parser.add_argument("--hit", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        return child(args)
    if args.hit:
        return hit(args)

    work = tempfile.mkdtemp(prefix="tt-cache-bench-")
    os.environ["TORCH_TWEAK_CACHE"] = os.path.join(work, "tt-cache")
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(work, "inductor")  # a cold first tweak
    import shutil

    import torch

    import encoder
    import torch_tweak as tt
    from torch_tweak._store.serial import device_name

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    batch = args.batch or (1 if device == "cpu" else 8)
    dataset = encoder.samples(device, batch=batch)
    depth = {} if args.max_depth is None else {"max_depth": args.max_depth}
    tt.tweak(encoder.build(device), dataset, dry_run=True, progress=False)  # torch's compiler imported, as the example

    model = encoder.build(device)
    first, first_s, first_cpu, first_load = timed(lambda: tt.tweak(model, dataset, progress=False, **depth))
    print(first)
    hits = []
    for kept in (True, False):  # each in a new process, as the example run a second time
        if not kept:
            shutil.rmtree(os.path.join(work, "tt-cache", "openvino"), ignore_errors=True)
        command = [sys.executable, os.path.abspath(__file__), "--hit", "--device", device, "--batch", str(batch)]
        command += [] if args.max_depth is None else ["--max-depth", str(args.max_depth)]
        env = dict(os.environ, PYTHONPATH=os.path.join(HERE, "..", "examples", "Tweak"))
        found = json.loads(subprocess.run(command, check=True, capture_output=True, text=True,
                                          env=env).stdout.splitlines()[-1])
        hits.append((found["cached"], found["wall"], found["cpu"], found["loadavg"], found["parts"]))
        print(f"cache hit ({'OpenVINO models kept' if kept else 'converted again'}): {found['wall']:.2f} s")
    parts = openvino_parts(device, batch)
    loaded, error, tuned_runs, loaded_runs, path = load_elsewhere(args, model, dataset, device, work)
    lines = report(args, device, batch, dataset, first, (first_s, first_cpu, first_load), hits, parts, loaded,
                   error, tuned_runs, loaded_runs, path, tt, device_name(torch.device(device)))
    out = args.out or os.path.join(HERE, "results", f"cache_{device}.md")
    os.makedirs(os.path.dirname(out), exist_ok=True)
    with open(out, "w", encoding="utf-8") as f:
        f.write("\n".join(lines))
    print("\n".join(lines))
    return 0 if error <= tt.TOLERANCES[torch.float32] else 1


def hit(args: argparse.Namespace) -> int:
    """A new process: the example's dry run, then its tweak (a cache hit), timed, its steps too."""
    import encoder
    import torch_tweak as tt

    dataset = encoder.samples(args.device, batch=args.batch)
    depth = {} if args.max_depth is None else {"max_depth": args.max_depth}
    tt.tweak(encoder.build(args.device), dataset, dry_run=True, progress=False)  # as the example does first
    model = encoder.build(args.device)
    with Parts() as parts:
        result, wall, cpu, load = timed(lambda: tt.tweak(model, dataset, progress=False, **depth))
    print(json.dumps({"cached": result.cached, "wall": wall, "cpu": cpu, "loadavg": load, "parts": parts.spent}))
    return 0


def load_elsewhere(args, model, dataset, device: str, work: str):
    """The tuned model saved, loaded in a new process, both measured taking turns: (what the
    child said of its load, the largest relative error against the tuned model, the tuned
    model's runs, the loaded one's, the file)."""
    import torch
    import torch_tweak as tt
    from safetensors.torch import load_file, save_file

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
    return loaded, error, tuned_runs, loaded_runs, path


def report(args, device, batch, dataset, first, first_figures, hits, parts, loaded, error, tuned_runs, loaded_runs,
           path, tt, name) -> list[str]:
    import torch

    first_s, first_cpu, first_load = first_figures
    tuned = min(tuned_runs, key=lambda r: r["median"])
    best = min(loaded_runs, key=lambda r: r["median"])
    kept = {p: m.backend for p, m in first.modules.items() if m.kept}
    lines = [
        f"# Tuning cache and save/load: examples/Tweak encoder on {device}",
        "",
        f"Device: {name}; torch {torch.__version__}; torch-tweak {tt.__version__}; Python {platform.python_version()}. "
        f"Dataset: {len(dataset)} samples of {tuple(dataset[0].shape)} (the example's batch {batch}); "
        f"{'max_depth ' + str(args.max_depth) if args.max_depth is not None else 'the default depths'}; default "
        f"strategy. Generated by `python bench/cache_bench.py{' --device ' + device if args.device else ''}`. "
        "Wall seconds beside the CPU seconds of the process and the machine's 1-minute load average at the end "
        "of each step (the machine has " + str(os.cpu_count()) + " CPUs: a load above that is other work).",
        "",
        "## A second tweak of the same model",
        "",
        "| tweak | wall s | CPU s | load average | from the cache |",
        "|---|---:|---:|---:|---|",
        f"| first (empty caches) | {first_s:.2f} | {first_cpu:.2f} | {first_load:.1f} | {first.cached} |",
        f"| second: a new process (the example run again: its dry run, then the tweak), OpenVINO's converted models kept | {hits[0][1]:.2f} | {hits[0][2]:.2f} | "
        f"{hits[0][3]:.1f} | {hits[0][0]} |",
        f"| again, torch-tweak's OpenVINO folder emptied (converted again) | {hits[1][1]:.2f} | {hits[1][2]:.2f} | "
        f"{hits[1][3]:.1f} | {hits[1][0]} |",
        "",
        "Where the two hits' time went (wall s / CPU s; the steps overlap: a build's check runs inside it, and "
        "each step's state is put back inside it):",
        "",
        "| step | kept: wall s | kept: CPU s | converted again: wall s | CPU s |",
        "|---|---:|---:|---:|---:|",
        *(f"| {step} | {hits[0][4][step][0]:.2f} | {hits[0][4][step][1]:.2f} | {hits[1][4][step][0]:.2f} | "
          f"{hits[1][4][step][1]:.2f} |" for step in hits[0][4]),
        "",
        f"Kept depth {first.selected_depth} ({', '.join(f'{p or ROOT}: {b}' for p, b in kept.items())}); "
        f"untuned {first.baseline_ms:.3f} ms, tuned {first.tuned_ms:.3f} ms as the tweak measured it. A hit records "
        "the dataset once, builds each kept backend again and checks it on the recorded calls (against the module "
        "at float64, the measured rule), with no measurement.",
        "",
    ]
    if parts is not None:
        lines += ["## Where an OpenVINO build of the encoder goes", "",
                  "| part | wall s | CPU s |", "|---|---:|---:|"]
        lines += [f"| {part} | {wall:.3f} | {cpu:.3f} |" for part, wall, cpu in parts]
        lines += ["", "Converting is the build; a compiled blob imports in about what compiling takes on the CPU, so "
                  "OpenVINO's own model cache (CACHE_DIR) would save little: torch-tweak keeps the converted model "
                  "instead (torch_tweak/backends/_ov_cache.py), sealed, in its folder.", ""]
    lines += [
        "## The tuned model against the model loaded in a fresh process",
        "",
        f"tt.load took {loaded['load_s']:.2f} s ({loaded['load_cpu']:.2f} s of CPU, load average "
        f"{loaded['loadavg']:.1f}) on the machine that tuned it; it said: \"{loaded['summary']}\". File size "
        f"{os.path.getsize(path) / 1e6:.2f} MB.",
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
        f"Loaded / tuned: {best['median'] / tuned['median']:.3f}. Largest relative error of the loaded model's "
        f"outputs against the tuned model's: {error:.2e}.",
        "",
    ]
    return lines


if __name__ == "__main__":
    sys.exit(main())
