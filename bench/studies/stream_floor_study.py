"""A study for the serving issue: how far from its device floor each serving stream is.

For a row of bench/serving_bench.py (the same model, random weights, and the same two
streams), each distinct request shape is served by the model's eager forward recorded as one
device graph at exactly that shape (no padding, no Python per request), then:

    device   the graph's replay on the device alone (CUDA events, median of --replays)
    request  one request as a service pays it: the inputs copied in, the replay, the device
             synchronised (perf_counter, median of --replays)

A stream's floor is the sum over its requests of its shape's figure: what a column that pads
nothing, launches nothing from Python and keeps eager's kernels could reach. A column's warm
figure over the floor says how much of the stream is overhead (host work, padding, slower
kernels) and how much is the kernels' own work; a target of N times a column is reachable with
these kernels only where that column is at least N times the floor. Vision rows are also
measured in channels-last memory (the input converted inside the graph).

    python bench/studies/stream_floor_study.py [--rows bert:bf16,resnet50:bf16,vit:bf16] [--json PATH]
"""

from __future__ import annotations

import argparse
import statistics
import time
import traceback
from typing import Any

import torch

import common  # noqa: E402  (puts bench/ on the path)
import serving_bench as sb  # noqa: E402


def tensors_of(r: sb.Request) -> list[torch.Tensor]:
    return list(r.args) + [v for v in r.kwargs.values() if isinstance(v, torch.Tensor)]


def shape_key(r: sb.Request) -> tuple:
    return tuple(tuple(t.shape) for t in tensors_of(r))


def graph_for(model: torch.nn.Module, r: sb.Request, channels_last: bool) -> tuple[torch.cuda.CUDAGraph, list]:
    """The forward at `r`'s shape recorded as one device graph, and its static inputs."""
    static = [t.clone() for t in tensors_of(r)]

    def forward() -> Any:
        args = static[: len(r.args)]
        if channels_last:
            args = [a.contiguous(memory_format=torch.channels_last) for a in args]
        kwargs = dict(zip(r.kwargs, static[len(r.args):]))
        return model(*args, **kwargs)

    with torch.no_grad():
        graph, out = common.graphed(forward)
    static.append(out)  # kept alive with the graph
    return graph, static


def per_shape(model: torch.nn.Module, requests: list[sb.Request], replays: int,
              channels_last: bool) -> dict[tuple, dict]:
    """Per distinct shape: the replay's device ms and one request's ms (copy in, replay, sync)."""
    figures: dict[tuple, dict] = {}
    for r in requests:
        key = shape_key(r)
        if key in figures:
            continue
        graph, static = graph_for(model, r, channels_last)
        inputs = tensors_of(r)
        device, whole = [], []
        for _ in range(replays):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for s, t in zip(static, inputs):
                s.copy_(t)
            start.record()
            graph.replay()
            end.record()
            torch.cuda.synchronize()
            whole.append((time.perf_counter() - t0) * 1e3)
            device.append(start.elapsed_time(end))
        figures[key] = {"device_ms": statistics.median(device), "request_ms": statistics.median(whole)}
        del graph, static
    return figures


def floor(requests: list[sb.Request], figures: dict[tuple, dict], what: str) -> float:
    return sum(figures[shape_key(r)][what] for r in requests) / 1e3


def study_row(name: str, dtype_name: str, replays: int) -> dict:
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[dtype_name]
    model, stream, new, what, _ = sb.build(name, dtype, 0)
    row: dict[str, Any] = {"row": f"{name}:{dtype_name}", "what": what, "layouts": {}}
    layouts = ["contiguous"] + (["channels_last"] if name in ("resnet50", "resnet18") else [])
    for layout in layouts:
        m = model
        if layout == "channels_last":
            m = model.to(memory_format=torch.channels_last)
        t0 = time.perf_counter()
        figures = per_shape(m, stream + new, replays, layout == "channels_last")
        row["layouts"][layout] = {
            "shapes": len(figures), "record_s": round(time.perf_counter() - t0, 1),
            "stream": {"device_s": floor(stream, figures, "device_ms"),
                       "request_s": floor(stream, figures, "request_ms"), "requests": len(stream)},
            "new": {"device_s": floor(new, figures, "device_ms"),
                    "request_s": floor(new, figures, "request_ms"), "requests": len(new)},
            "per_shape": {str(k): v for k, v in figures.items()},
        }
        s, n = row["layouts"][layout]["stream"], row["layouts"][layout]["new"]
        print(f"{row['row']} [{layout}] {len(figures)} shapes: stream floor {s['device_s']:.4f} s device, "
              f"{s['request_s']:.4f} s as requests; new {n['device_s']:.4f} / {n['request_s']:.4f} s", flush=True)
    return row


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", default="bert:bf16,resnet50:bf16,vit:bf16")
    parser.add_argument("--replays", type=int, default=10)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    run: dict[str, Any] = {"torch": torch.__version__, "device": torch.cuda.get_device_name(),
                           "commit": common.commit(), "rows": []}
    for spec in args.rows.split(","):
        name, dtype_name = spec.split(":")
        try:
            run["rows"].append(study_row(name, dtype_name, args.replays))
        except Exception as exc:  # one row's failure is reported and the others still run
            traceback.print_exc()
            run["rows"].append({"row": spec, "error": f"{type(exc).__name__}: {exc}"})
        torch.cuda.empty_cache()
        if args.json:
            common.write_run(args.json, run)


if __name__ == "__main__":
    main()
