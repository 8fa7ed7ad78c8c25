"""Per-call cost of a converted model's check (backends.base.Baked.changed) on a 4-layer BERT.

OpenVINO and ONNX Runtime check, before every call they serve, that the module is still what
they took in at the build (extension baked.c). This times that check on the weights, attributes
and classes of transformers' BertModel with 4 layers (hidden 768), and its parts:

    check, before sampled bytes   Baked.changed() with every weight's sampled bytes and the
                                  classes' check left out: what the check read before they came
    check                         Baked.changed() as it is: version counters, sampled bytes,
                                  attributes and tables, classes and their forward
    weights, version counters     _C.weight_change on entries without sampled bytes
    weights, sampled bytes too    _C.weight_change on the check's own entries
    attributes and tables         _C.dict_change
    classes and their forward     _C.class_change
    ..., after a cache sweep      the check (before sampled bytes, and as it is) right after
                                  writing a buffer of --sweep MiB, the time of the sweep alone
                                  taken off: what the check reads comes from memory, as after a
                                  call that ran through other data

The cases are timed round-robin (repeat 1 of every case, then repeat 2...), so a busy moment of
a shared machine falls on every case alike; each figure is the median of the repeats, in
microseconds of this thread's CPU time per check (time.thread_time: time other processes
take is not counted, though they still share the caches and memory). Usage:
    python bench/baked_check_bench.py [--number N] [--repeat R] [--sweep MIB] [--out PATH]
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
import timeit

import torch

from torch_tweak import _C
from torch_tweak.backends.base import Baked


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "")
    except OSError:
        return platform.processor() or platform.machine()


def bert() -> torch.nn.Module:
    from transformers import BertConfig, BertModel

    torch.manual_seed(0)
    return BertModel(BertConfig(num_hidden_layers=4)).eval()


def cases(baked: Baked, before: Baked, sweep: bytearray) -> dict:
    unsampled = before.weights

    def swept() -> None:
        sweep[::64] = bytes(len(sweep) // 64)  # one write per cache line

    def swept_check() -> None:
        swept()
        baked.changed()

    def swept_before() -> None:
        swept()
        before.changed()

    return {
        "check, before sampled bytes": before.changed,
        "check": baked.changed,
        "weights, version counters": lambda: _C.weight_change(unsampled, True),
        "weights, sampled bytes too": lambda: _C.weight_change(baked.weights, True),
        "attributes and tables": lambda: _C.dict_change(baked.tables),
        "classes and their forward": lambda: _C.class_change(getattr(baked, "classes", [])),
        "(sweep alone)": swept,
        "check before sampled bytes, after a cache sweep": swept_before,
        "check after a cache sweep": swept_check,
    }


def measure(runs: dict, number: int, repeat: int) -> dict[str, list[float]]:
    """Microseconds per call of each case, `repeat` times, round-robin."""
    times: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(repeat):
        for name, fn in runs.items():
            n = max(1, number // 20) if "sweep" in name else number
            times[name].append(timeit.Timer(fn, timer=time.thread_time).timeit(number=n) / n * 1e6)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--number", type=int, default=2000, help="checks per timed loop")
    parser.add_argument("--repeat", type=int, default=15, help="timed loops per case")
    parser.add_argument("--sweep", type=int, default=32, help="MiB written between checks in the sweep case")
    parser.add_argument("--out", default=None, help="write the table in Markdown here")
    args = parser.parse_args()
    torch.set_num_threads(1)
    model = bert()
    baked = Baked(model, "bench")
    before = Baked(model, "bench")
    if hasattr(before, "classes"):  # this check; the code before it (run there) has neither
        before.weights = [entry[:6] + (0, None) for entry in before.weights]
        before.classes, before.class_what = [], []
    assert not baked.changed() and not before.changed()
    sampled = [entry for entry in baked.weights if len(entry) > 6 and entry[6]]
    facts = (f"{len(list(model.modules()))} modules, {len(baked.weights)} weights ({len(sampled)} with sampled "
             f"bytes, {sum(len(e[7]) for e in sampled)} bytes in all), {len(baked.tables)} tables, "
             f"{len(getattr(baked, 'classes', []))} class entries; weights {sum(e[6] for e in sampled) / 2**20:.0f} MiB")
    runs = cases(baked, before, bytearray(args.sweep << 20))
    if not hasattr(_C, "class_change"):  # the code before the sampled bytes: its own check only
        runs = {name: fn for name, fn in runs.items() if "before" in name or name in (
            "weights, version counters", "attributes and tables", "(sweep alone)")}
    times = measure(runs, args.number, args.repeat)
    sweep = statistics.median(times.get("(sweep alone)", [0.0]))
    rows = []
    for name, values in times.items():
        median = statistics.median(values)
        if name.endswith("after a cache sweep"):
            median -= sweep
        spread = (max(values) - min(values)) / statistics.median(values)
        rows.append(f"| {name} | {median:.2f} | {spread:.0%} |")
    lines = [f"- model: transformers BertModel, 4 layers, hidden 768: {facts}",
             f"- CPU: {cpu_name()}, {os.cpu_count()} cores; Python "
             f"{sys.version.split()[0]}; torch {torch.__version__}; {time.strftime('%Y-%m-%d')}",
             f"- timing: median of {args.repeat} loops of {args.number} checks (sweep cases: {args.number // 20})",
             "", "| case | us per check | range |", "|---|---:|---:|", *rows]
    print("\n".join(lines))
    if args.out:
        with open(args.out, "w") as f:
            f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
