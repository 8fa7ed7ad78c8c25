"""A study for issue 29 (generate() near the memory floor): the decode step compiled with
Inductor's coordinate descent tuning, under which Inductor lowers a one-row matrix product
(every linear layer of a batch-1 decode step) to its own reduction kernel, tuned for the
memory bandwidth, instead of a cuBLAS product.

Per case (Llama-3.2-1B shape, bf16, random weights, 128 new tokens), three ways to run the
same generate() call with a static cache:
    static   transformers' static path (it compiles the decode step: mode="reduce-overhead")
    loop     tweak's "compiled" decode loop on transformers' compiled forward (the same kernels)
    cdt      tweak's "tuned" loop: transformers' forward compiled with the same settings plus
             coordinate_descent_tuning (other kernels: the tokens are checked, not assumed)
Prints, per way: the first call's seconds (its compile), tokens per second (median of 5),
and whether its tokens equal the static path's (the first differing new token if not).

    python bench/studies/decode_kernels_study.py [--json PATH] [--cases greedy32,sampling32,greedy512]
"""
import argparse
import copy
import json
import statistics
import sys
import time

import common
import torch
import transformers

from torch_tweak._runtime.decode import loop as decode_loop


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--json", default="decode-kernels.json")
    parser.add_argument("--cases", default="greedy32,sampling32,greedy512")
    parser.add_argument("--ways", default="static,loop,cdt")
    args = parser.parse_args()
    base = common.llama_1b(max_positions=8192, generate=True)
    seen, weight = set(), 0
    for p in base.parameters():
        if p.data_ptr() not in seen:
            seen.add(p.data_ptr())
            weight += p.numel() * p.element_size()
    floor = common.H200_BYTES_PER_S / weight
    out = {"torch": torch.__version__, "transformers": transformers.__version__,
           "device": torch.cuda.get_device_name(), "weight_bytes": weight, "floor_tokens_per_s": floor, "rows": []}
    models = {}
    for way in args.ways.split(","):
        m = copy.deepcopy(base)
        if way in ("loop", "cdt"):
            decode_loop.install(m, decode_loop.DecodeLoop(m, "compiled" if way == "loop" else "tuned"))
        models[way] = m
    for case in args.cases.split(","):
        sample = case.startswith("sampling")
        prompt = int(case.lstrip("greedysampling"))
        settings = dict(max_new_tokens=128, cache_implementation="static", do_sample=sample)
        if sample:
            settings.update(temperature=0.7, top_k=50, top_p=0.9)
        prompts = [torch.randint(100, 5000, (1, prompt), device="cuda", generator=torch.Generator("cuda").manual_seed(s))
                   for s in (1, 2, 3)]
        tokens: dict = {}
        for way, m in models.items():
            def call(ids):
                torch.manual_seed(7)
                with torch.no_grad():
                    got = m.generate(ids, **settings)
                torch.cuda.synchronize()
                return got
            start = time.perf_counter()
            tokens[way] = [call(prompts[0])]
            first = time.perf_counter() - start
            tokens[way] += [call(ids) for ids in prompts[1:]]
            runs = []
            for _ in range(5):
                start = time.perf_counter()
                call(prompts[0])
                runs.append(time.perf_counter() - start)
            rate = 128 / statistics.median(runs)
            row = {"case": case, "way": way, "first_call_s": first, "tokens_per_s": rate, "of_floor": rate / floor,
                   "spread": (max(runs) - min(runs)) / statistics.median(runs)}
            if way != "static" and "static" in tokens:
                diffs = []
                for got, ref in zip(tokens[way], tokens["static"]):
                    new_got, new_ref = got[0, prompt:], ref[0, prompt:]
                    bad = (new_got != new_ref).nonzero()
                    diffs.append(None if bad.numel() == 0 else int(bad[0]))
                row["first_difference"] = diffs  # per prompt: None where every token is equal
            out["rows"].append(row)
            print(json.dumps(row), flush=True)
            common.write_run(args.json, out)


if __name__ == "__main__":
    sys.exit(main())
