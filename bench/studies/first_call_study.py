"""A study for issue 29's prompt-512 mismatch: does transformers' static path give the same
greedy tokens on its first (cold, compiling) call as on later calls, and after calls of one
new token (what tt.tweak's time-to-first-token measurement makes)? Llama-1B shape, bf16,
random weights, batch 1, 128 new tokens. Prints, per call, the first new token that differs
from the first call's (None: all equal).

    python bench/studies/first_call_study.py [--prompt 512]
"""
import argparse
import copy

import common
import torch

from generate_bench import build_shape
from torch_tweak._runtime.decode import loop as decode_loop


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--prompt", type=int, default=512)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    model = build_shape("llama1b", torch.bfloat16, "cuda", False)
    torch.manual_seed(1)
    ids = torch.randint(100, 500, (1, args.prompt), device="cuda")

    def call(m, n=128):
        with torch.no_grad():
            out = m.generate(ids, max_new_tokens=n, do_sample=False, cache_implementation="static")
        torch.cuda.synchronize()
        return out

    def first_difference(got, ref):
        bad = (got[0, args.prompt:] != ref[0, args.prompt:]).nonzero()
        return None if bad.numel() == 0 else int(bad[0])

    spare = copy.deepcopy(model)
    rows = {}
    first = call(model)
    rows["second call"] = first_difference(call(model), first)
    for _ in range(3):
        call(model, 1)
    rows["after three calls of one new token"] = first_difference(call(model), first)
    decode_loop.install(model, decode_loop.DecodeLoop(model, "compiled"))
    rows["compiled loop"] = first_difference(call(model), first)
    decode_loop.uninstall(model)
    # a copy whose first call is a call of one new token (the decode steps compile later)
    for _ in range(2):
        call(spare, 1)
    rows["a copy whose first calls made one new token"] = first_difference(call(spare), first)
    for k, v in rows.items():
        print(f"{k}: first difference {v}", flush=True)
    common.write_run(args.json, {"prompt": args.prompt, "first_difference": rows})


if __name__ == "__main__":
    main()
