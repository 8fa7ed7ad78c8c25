"""A study for the generate() issue: what choosing a sampled token costs a decode step, on the
host and on the device, run eagerly (as tweak's compiled loop runs transformers' processors
after each step) and recorded as one device graph.

The choice is transformers' own for a sampling call (temperature 0.7, top-k 50, top-p 0.9, the
softmax in float32, torch.multinomial), on logits of the Llama-3 vocabulary (128,256) in bf16;
the greedy choice (the argmax) beside it, and the same sampling call through tweak's
sampling.TopSampler (the processed scores from the top scores alone), then torch.multinomial
("top-sampler") or its own draw over the top scores alone (TopSampler.draw, "top-sampler-draw",
what the loop's recorded draw runs). Per way and batch:

    host_us    seconds the host spends issuing one choice (perf_counter over --n calls, no
               synchronisation inside; the device kept busy by a long kernel first, so that
               the host never waits for it)
    device_us  the device's time for one choice (CUDA events around --n back-to-back choices)

and, for the recorded sampler, whether its draws equal the eager draws under the same seed
(torch's generator advances the same in a replay as in eager calls).

    python bench/studies/sampling_step_study.py [--json PATH]
"""

from __future__ import annotations

import argparse
import time
from typing import Callable

import common
import torch
import transformers

VOCAB = 128256


def processors() -> transformers.LogitsProcessorList:
    return transformers.LogitsProcessorList([
        transformers.TemperatureLogitsWarper(0.7), transformers.TopKLogitsWarper(50),
        transformers.TopPLogitsWarper(0.9)])


def choosers(logits: torch.Tensor) -> dict[str, Callable[[], torch.Tensor]]:
    warpers = processors()

    def greedy() -> torch.Tensor:
        return logits[:, -1, :].argmax(-1)

    def sample() -> torch.Tensor:
        scores = warpers(None, logits[:, -1].to(copy=True, dtype=torch.float32))
        return torch.multinomial(torch.nn.functional.softmax(scores, dim=-1), num_samples=1).squeeze(1)

    from torch_tweak._runtime.decode import choice as sampling
    sampler = sampling.TopSampler.of(warpers, True, logits.device)

    def top_sampler() -> torch.Tensor:
        scores = sampler.process(logits[:, -1].to(copy=True, dtype=torch.float32))
        return torch.multinomial(torch.nn.functional.softmax(scores, dim=-1), num_samples=1).squeeze(1)

    drawing = sampling.TopSampler.of(warpers, True, logits.device)

    def top_sampler_draw() -> torch.Tensor:  # the loop's draw since it was recorded: sampling.TopSampler.draw
        return drawing.draw(logits[:, -1].to(copy=True, dtype=torch.float32))

    return {"greedy": greedy, "sampling": sample, "top-sampler": top_sampler, "top-sampler-draw": top_sampler_draw}


def busy() -> None:
    """A long device kernel, so that the host's issuing is measured alone."""
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    for _ in range(20):
        a @ a


def host_and_device(fn: Callable[[], object], n: int) -> tuple[float, float]:
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    busy()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    host = (time.perf_counter() - t0) / n * 1e6
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(n):
        fn()
    end.record()
    torch.cuda.synchronize()
    return host, start.elapsed_time(end) / n * 1e3


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--n", type=int, default=200)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    run = {"torch": torch.__version__, "transformers": transformers.__version__,
           "device": torch.cuda.get_device_name(), "commit": common.commit(), "rows": []}
    for batch in (1, 4):
        torch.manual_seed(0)
        logits = torch.randn(batch, 1, VOCAB, device="cuda", dtype=torch.bfloat16) * 2
        fns = choosers(logits)
        for way, fn in fns.items():
            host, device = host_and_device(fn, args.n)
            row = {"batch": batch, "way": way, "eager_host_us": round(host, 1), "eager_device_us": round(device, 1)}
            graph, out = common.graphed(fn, fork_rng=True)
            host_g, device_g = host_and_device(graph.replay, args.n)
            row.update(graph_host_us=round(host_g, 1), graph_device_us=round(device_g, 1))
            if way.startswith("top-sampler"):  # its draws against transformers' processors' under the same seeds
                same = 0
                for seed in range(20):
                    torch.manual_seed(seed)
                    theirs = [fns["sampling"]().clone() for _ in range(4)]
                    torch.manual_seed(seed)
                    same += all(torch.equal(a, fn()) for a in theirs)
                row["same_as_transformers_of_20_seeds"] = same
            if way != "greedy":
                same = 0
                for seed in range(20):
                    torch.manual_seed(seed)
                    eager = [fn().clone() for _ in range(4)]
                    torch.manual_seed(seed)
                    replayed = []
                    for _ in range(4):
                        graph.replay()
                        replayed.append(out.clone())
                    same += all(torch.equal(a, b) for a, b in zip(eager, replayed))
                row["same_draws_of_20_seeds"] = same
            run["rows"].append(row)
            print(row, flush=True)
    if args.json:
        common.write_run(args.json, run)


if __name__ == "__main__":
    main()
