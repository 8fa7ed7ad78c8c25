"""Where a batch-1 decode step's time goes, against its memory floor (one GPU).

The model: the Llama-3.2-1B shape (hidden 2048, 16 layers, 32 heads, 8 KV heads, MLP 8192,
vocabulary 128256, tied embeddings), random weights, bf16, one sequence, a static cache of
PROMPT + NEW positions. Every part below is recorded as one device graph and replayed
REPEAT times; its figure is the median over ROUNDS of the mean replay time:

    floor          the weight bytes one token must read (every linear weight once, the
                   embedding row, the norms) over 4.8 TB/s
    gemv           every linear layer of the model applied to one token, one after the
                   other (F.linear on a [1, 1, in] input), nothing else: cuBLAS's
                   matrix-vector products alone
    gemv-fused     the same bytes in fewer, larger products: per layer q, k and v as one
                   weight, gate and up as one (what a fused projection would read)
    lm_head        the output projection alone (a quarter of the weight bytes)
    step-eager     the whole decode step as tweak's graph loop records it: the model's
                   forward with the static cache, then argmax and the token's copy
    step-compiled  the same step with the forward compiled by Inductor (default mode,
                   inside the same device graph)

and per step the number of kernels one step launches (the profiler, outside the graph), so
that what is left above the GEMVs can be laid at kernels per step or at the products
themselves.

    python bench/studies/decode_anatomy.py [--json PATH]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
import traceback
from typing import Any, Callable

import common
import torch
import torch.nn.functional as F

PROMPT, NEW = 32, 128
REPEAT, ROUNDS = 50, 7


def replay_ms(graph: torch.cuda.CUDAGraph) -> float:
    rounds = []
    for _ in range(ROUNDS):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(REPEAT):
            graph.replay()
        torch.cuda.synchronize()
        rounds.append((time.perf_counter() - t0) / REPEAT * 1e3)
    return statistics.median(rounds)


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes one token reads at the least: each linear weight once (the tied output projection
    counted once, as the lm_head), one embedding row, the norms' weights."""
    total = 0
    for m in model.modules():
        if isinstance(m, torch.nn.Linear):
            total += m.weight.numel() * m.weight.element_size()
        elif "RMSNorm" in type(m).__name__:
            total += m.weight.numel() * m.weight.element_size()
    emb = model.get_input_embeddings().weight
    return total + emb.shape[1] * emb.element_size()


def fused(model: torch.nn.Module, x: dict) -> Callable[[], Any]:
    weights = []
    for layer in model.model.layers:
        a, m = layer.self_attn, layer.mlp
        weights += [torch.cat([a.q_proj.weight, a.k_proj.weight, a.v_proj.weight]), a.o_proj.weight,
                    torch.cat([m.gate_proj.weight, m.up_proj.weight]), m.down_proj.weight]
    weights.append(model.lm_head.weight)
    return lambda: [F.linear(x[w.shape[1]], w) for w in weights]


def step_of(model: torch.nn.Module, forward: Callable[..., Any]) -> Callable[[], Any]:
    from transformers import StaticCache
    length = PROMPT + NEW
    cache = StaticCache(config=model.config, max_cache_len=length)
    token = torch.zeros(1, 1, dtype=torch.long, device="cuda")
    position = torch.full((1,), PROMPT, dtype=torch.long, device="cuda")
    arange = torch.arange(length, device="cuda")

    def step() -> None:
        mask = (arange <= position).view(1, 1, 1, length)
        out = forward(input_ids=token, past_key_values=cache, cache_position=position, attention_mask=mask,
                      position_ids=position.view(1, 1), use_cache=True)
        token.copy_(out.logits[:, -1, :].argmax(-1).view(1, 1))

    return step


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--parts", default="gemv,gemv-fused,lm_head,step-eager,step-compiled")
    parser.add_argument("--json", default=os.path.join(common.RUNS, f"decode-anatomy-{common.commit()}.json"))
    args = parser.parse_args()
    model = common.llama_1b()
    wb = weight_bytes(model)
    out: dict[str, Any] = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
                           "commit": common.commit(), "weight_bytes": wb, "floor_ms": wb / common.H200_BYTES_PER_S * 1e3,
                           "ms": {}, "kernels": {}, "errors": {}}
    import transformers
    out["transformers"] = transformers.__version__
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    with torch.no_grad():
        x = {m.in_features: torch.randn(1, 1, m.in_features, device="cuda", dtype=torch.bfloat16) for m in linears}
        parts: dict[str, Callable[[], Callable[[], Any]]] = {
            "gemv": lambda: (lambda: [F.linear(x[m.in_features], m.weight) for m in linears]),
            "gemv-fused": lambda: fused(model, x),
            "lm_head": lambda: (lambda: F.linear(x[model.lm_head.in_features], model.lm_head.weight)),
            "step-eager": lambda: step_of(model, model),
            "step-compiled": lambda: step_of(model, torch.compile(model)),
        }
        for name, make in parts.items():
            if name not in args.parts.split(","):
                continue
            try:
                fn = make()
                out["kernels"][name] = len(common.kernels(fn, warm=True))
                out["ms"][name] = replay_ms(common.graphed(fn)[0])
            except Exception as exc:
                traceback.print_exc()
                out["errors"][name] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:300]}"
            print(name, out["ms"].get(name), out["kernels"].get(name), flush=True)
    for name, ms in out["ms"].items():
        print(f"{name:14s} {ms:7.3f} ms  {out['floor_ms'] / ms:6.1%} of the floor  {1e3 / ms:7.0f} tok/s  "
              f"{out['kernels'].get(name, '-')} kernels")
    print(f"floor {out['floor_ms']:.3f} ms ({1e3 / out['floor_ms']:.0f} tok/s), {wb / 1e9:.2f} GB a token")
    common.write_run(args.json, out)


if __name__ == "__main__":
    main()
