"""A study for issue 29's prompt-512 rows: transformers' static path does not repeat its own
greedy tokens from one call to the next (Llama-1B shape, bf16, random weights: two runs
after the compiling one parted at new token 91). Where does that come from: the eager
prefill, the compiled decode step, or the history of calls?

One process per setting (--deterministic runs with torch.use_deterministic_algorithms and
CUBLAS_WORKSPACE_CONFIG=:4096:8, set before CUDA starts). In the process, the bench's
--calls prompt (seed 1, ids 100 to 500, batch 1) and:

- prefill: the model's forward on the prompt with a fresh static cache, REPEATS times: how
  many distinct logits (bit for bit) and caches;
- step: the first decode step through transformers' compiled forward (the call generate()
  makes), each after a fresh prefill, REPEATS times: distinct logits;
- generate: generate(ids, max_new_tokens=128, static cache, greedy) REPEATS times after the
  compiling one: distinct sequences, and each one's first new token that differs from the
  first's.

    python bench/studies/repeat_study.py [--shape llama1b] [--prompt 512] [--deterministic] [--mode default]
                                 [--json PATH]
"""
from __future__ import annotations

import argparse
import json
import os

import common  # no torch: CUBLAS_WORKSPACE_CONFIG is set before CUDA starts

REPEATS = 8


def distinct(tensors: list) -> int:
    import torch

    kept: list = []
    for t in tensors:
        if not any(torch.equal(t, k) for k in kept):
            kept.append(t)
    return len(kept)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--shape", default="llama1b")
    parser.add_argument("--prompt", type=int, default=512)
    parser.add_argument("--deterministic", action="store_true")
    parser.add_argument("--json", default=None)
    parser.add_argument("--smoke", action="store_true", help="on the CPU, a tiny config: does it run")
    parser.add_argument("--mode", default=None, help="transformers' compile mode for the static path (default: "
                        "its CompileConfig's, reduce-overhead: Inductor's device graphs)")
    args = parser.parse_args()
    if args.deterministic:
        os.environ["CUBLAS_WORKSPACE_CONFIG"] = ":4096:8"
    import torch

    if args.deterministic:
        torch.use_deterministic_algorithms(True, warn_only=True)
    from generate_bench import build_shape
    from transformers import StaticCache

    device = "cpu" if args.smoke else "cuda"
    model = build_shape(args.shape, torch.bfloat16, device, args.smoke)
    torch.manual_seed(1)
    ids = torch.randint(100, 500, (1, args.prompt), device=device)
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    if args.mode is not None:
        from transformers.generation.configuration_utils import CompileConfig

        model.generation_config.compile_config = CompileConfig(mode=args.mode)
    out: dict = {"shape": args.shape, "prompt": args.prompt, "deterministic": args.deterministic, "mode": args.mode,
                 "torch": torch.__version__, "repeats": REPEATS}

    def fresh_cache():
        return StaticCache(config=model.config, max_cache_len=args.prompt + 128)

    positions = torch.arange(args.prompt, device=device)
    with torch.no_grad():
        logits, caches = [], []
        for _ in range(REPEATS):
            cache = fresh_cache()
            o = model(input_ids=ids, past_key_values=cache, cache_position=positions, use_cache=True)
            logits.append(o.logits[:, -1].clone())
            caches.append(torch.cat([cache.layers[0].keys.flatten(), cache.layers[-1].values.flatten()]).clone())
        out["prefill_distinct_logits"] = distinct(logits)
        out["prefill_distinct_caches"] = distinct(caches)

        # the first decode step through transformers' compiled forward, on one prefilled cache
        compiled = model.get_compiled_call(model.generation_config.compile_config)
        step_position = torch.tensor([args.prompt], device=device)
        steps = []
        for _ in range(REPEATS + 2):  # the first two compile and warm
            # a fresh prefill each time: a cache keeps a count of its positions on the host
            cache = fresh_cache()
            o = model(input_ids=ids, past_key_values=cache, cache_position=positions, use_cache=True)
            token = o.logits[:, -1:].argmax(-1)
            s = compiled(input_ids=token, past_key_values=cache, cache_position=step_position, use_cache=True,
                         return_dict=True)
            steps.append(s.logits[:, -1].clone())
        out["step_distinct_logits"] = distinct(steps[2:])

        def generate():
            r = model.generate(ids, max_new_tokens=128, do_sample=False, cache_implementation="static")
            sync()
            return r[0, args.prompt:].clone()

        generate()  # the compiling call
        runs = [generate() for _ in range(REPEATS)]
        out["generate_distinct"] = distinct(runs)
        firsts = []
        for r in runs:
            bad = (r != runs[0]).nonzero()
            firsts.append(None if bad.numel() == 0 else int(bad[0]))
        out["generate_first_difference"] = firsts
    print(json.dumps(out), flush=True)
    common.write_run(args.json, out)


if __name__ == "__main__":
    main()
