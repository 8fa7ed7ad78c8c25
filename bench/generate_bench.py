"""generate() on one GPU: tokens per second and time to first token, tweak against the
ways a user runs a decoder today, with greedy decoding, batch 1, from one run.

Columns (each on its own copy of the same random-weight model):
    eager         model.generate(ids, max_new_tokens=N), transformers' default DynamicCache
    static        transformers' static-cache path: cache_implementation="static", which on
                  CUDA compiles the forward itself (its first call is its compile time)
    manual        the manual recipe: model.forward = torch.compile(model.forward,
                  mode="reduce-overhead") with a static cache (errors are reported)
    tweak         tt.tweak(model, workload=lambda m: m.generate(ids, max_new_tokens=N,
                  cache_implementation="static", disable_compile=True)) with default
                  settings, then that same call; its first-call time is the tuning time
    tweak-compiled
                  tt.tweak on the static column's own call (transformers compiles its decode
                  steps), then that call: the untuned tokens are then those of transformers'
                  compiled kernels, and tweak's "compiled" loop runs that same compiled forward

Per column: the first call's wall time (compile or tuning), tokens per second (median of
ROUNDS timed generate() calls, the device synchronised around each), time to first token
(median of generate() with one new token), and whether its tokens equal the untuned model's
tokens for the same call (for tweak: the untuned static-cache call without transformers'
compile; for tweak-compiled: the static column's, the untuned model on that same call; for
the others: eager's) and eager's tokens. Every compiling column starts cold.

    python bench/generate_bench.py [--models gpt2,llama] [--dtypes bf16,fp32] [--new 128]
                                   [--prompt 32] [--json PATH]
    python bench/generate_bench.py --merge a.json ... [--out bench/results/generate.md]

The calls people make (issue 29): --calls runs, per model shape, per call (greedy; sampling
with temperature 0.7, top-k 50, top-p 0.9), batch size and prompt length, transformers' static
path (cache_implementation="static": on CUDA it compiles the decode steps) against tweak on
that same call (tt.tweak(model, workload=that call), then the call), bf16, random weights:

    python bench/generate_bench.py --calls --models llama1b,qwen05b --dtypes bf16 --new 128 \
        --batches 1,4 --prompts 32,512 --json generate-calls.json

The issue's other families run the same way from their public configs (FAMILIES: gpt2,
qwen3_06b, gemma3_1b, gemma2_2b, phi3mini, mistral7b, qwen2moe), e.g.
--calls --models gemma3_1b --call-kinds greedy --batches 1 --prompts 32; a mixture of experts'
floor counts the experts one token is routed to.

Per row: tokens per second (batch x new tokens / median run), the memory floor (weight bytes
read once per step, a tied embedding once, at the card's datasheet bandwidth by its name: 3.35
TB/s H100, 4.8 TB/s H200, the H200's for another card; batch / (bytes / bandwidth) tokens per
second) and the share of it each column reaches, the decode loop tweak kept (as its tokens
table names it: "fused, triton"), time to first token, the first call (compile
or tuning), and whether tweak's tokens equal the static path's: exactly for greedy, and for
sampling under the same torch.manual_seed before each call. The two columns are built one
after the other (each its first call: compile or tuning), then their timed calls interleave,
round by round in rotated order (rows before commit 2fcddfb timed each column apart, and
the static column's figure moved by a third between runs). --smoke runs the same on the CPU
with tiny configs and 8 new tokens (a check that the script runs, not a measurement).

Call kinds: greedy; sampling (above); chat (do_sample, temperature 0.8, top-k 50, top-p 0.9,
repetition penalty 1.1). --serve-batches 4,8: after each row's tuning (at its own batch), the
tuned model's tokens/s at those batches, no tuning again, against the static path at the same
batch, and whether any of tweak's calls fell back to transformers' loop (and why). --budget
SECONDS: a row (or a served batch) that its estimate (ROW_ESTIMATE_S; a shape that has run: its
own last row's time) says cannot finish in what is left is skipped, and its row in the JSON says
so. --calls times CALL_ROUNDS (3) interleaved rounds per column (--rounds). The issue-56 set, in
about 270 s on an H100 (three rows of about 75 to 85 s each: tuning, the static path's
compile, 3 rounds; the two served batches about 12 s each), one process (--rows: the rows in
order, each "model:call:batch[:served batches]"; the budget leaves 15 s of the 270 to the
process's start: imports, the models' builds):

    python bench/generate_bench.py --calls --dtypes bf16 --prompts 32 --budget 255 \
        --rows "llama1b:greedy:1:4,8;qwen05b:greedy:1;llama1b:chat:1" --json generate-calls-56.json
"""

from __future__ import annotations

import argparse
import collections
import copy
import gc
import json
import os
import platform
import statistics
import tempfile
import time
import traceback
from typing import Any, Callable

import torch

MODELS = {
    "gpt2": "GPT-2 small (12 layers, 768 wide)",
    "llama": "Llama-style, 8 layers, hidden 1024, 16 heads, 4 KV heads, MLP 2816",
}
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
COLUMNS = ("eager", "static", "manual", "tweak", "tweak-compiled")
ROUNDS = 7


SHAPES = {
    # the two decoders, as their configs lay them out (random weights)
    "llama1b": "Llama-3.2-1B shape (16 layers, hidden 2048, 32 heads, 8 KV heads, MLP 8192, vocab 128,256)",
    "qwen05b": "Qwen2.5-0.5B shape (24 layers, hidden 896, 14 heads, 2 KV heads, MLP 4864, vocab 151,936)",
}
FAMILIES = {
    # the other families of the issue, each as one public checkpoint's config lays it out (random
    # weights, built on the device in the row's dtype): name -> (description, model class, config
    # class, config)
    "gpt2": ("GPT-2 small (12 layers, 768 wide, vocab 50,257)", "GPT2LMHeadModel", "GPT2Config", {}),
    "qwen3_06b": ("Qwen3-0.6B shape (28 layers, hidden 1024, 16 heads, 8 KV heads, head 128, MLP 3072, vocab 151,936)",
                  "Qwen3ForCausalLM", "Qwen3Config",
                  dict(vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                       num_attention_heads=16, num_key_value_heads=8, head_dim=128, tie_word_embeddings=True)),
    "gemma3_1b": ("Gemma-3-1B shape (26 layers, 5 of each 6 a 512-position sliding window, hidden 1152, 4 heads, "
                  "1 KV head, head 256, MLP 6912, vocab 262,144)", "Gemma3ForCausalLM", "Gemma3TextConfig",
                  dict(vocab_size=262144, hidden_size=1152, intermediate_size=6912, num_hidden_layers=26,
                       num_attention_heads=4, num_key_value_heads=1, head_dim=256, sliding_window=512,
                       query_pre_attn_scalar=256, tie_word_embeddings=True)),
    "gemma2_2b": ("Gemma-2-2B shape (26 layers alternating a 4,096-position sliding window, soft-capped attention "
                  "and logits, hidden 2304, 8 heads, 4 KV heads, head 256, MLP 9216, vocab 256,000)",
                  "Gemma2ForCausalLM", "Gemma2Config",
                  dict(vocab_size=256000, hidden_size=2304, intermediate_size=9216, num_hidden_layers=26,
                       num_attention_heads=8, num_key_value_heads=4, head_dim=256, sliding_window=4096,
                       query_pre_attn_scalar=256, attn_logit_softcapping=50.0, final_logit_softcapping=30.0,
                       tie_word_embeddings=True)),
    "phi3mini": ("Phi-3-mini shape (32 layers, hidden 3072, 32 heads, MLP 8192, vocab 32,064)",
                 "Phi3ForCausalLM", "Phi3Config",
                 dict(vocab_size=32064, hidden_size=3072, intermediate_size=8192, num_hidden_layers=32,
                      num_attention_heads=32, num_key_value_heads=32, max_position_embeddings=4096,
                      pad_token_id=0, bos_token_id=1, eos_token_id=2)),
    "mistral7b": ("Mistral-7B-v0.1 shape (32 layers, every one a 4,096-position sliding window, hidden 4096, 32 heads, "
                  "8 KV heads, MLP 14336, vocab 32,000)", "MistralForCausalLM", "MistralConfig",
                  dict(vocab_size=32000, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                       num_attention_heads=32, num_key_value_heads=8, sliding_window=4096)),
    "qwen2moe": ("Qwen1.5-MoE-A2.7B shape (24 layers, 60 experts of MLP 1408 and 4 routed a token, a shared expert "
                 "of MLP 5632, hidden 2048, 16 heads, vocab 151,936)", "Qwen2MoeForCausalLM", "Qwen2MoeConfig",
                 dict(vocab_size=151936, hidden_size=2048, intermediate_size=5632, num_hidden_layers=24,
                      num_attention_heads=16, num_key_value_heads=16, moe_intermediate_size=1408,
                      shared_expert_intermediate_size=5632, num_experts=60, num_experts_per_tok=4)),
}
TINY = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, sliding_window=16, moe_intermediate_size=32,
            shared_expert_intermediate_size=64, num_experts=4, num_experts_per_tok=2)
"""A family's config made tiny for --smoke: only the keys its config already sets."""
CALLS = {
    "greedy": {"do_sample": False},
    "sampling": {"do_sample": True, "temperature": 0.7, "top_k": 50, "top_p": 0.9},
    "chat": {"do_sample": True, "temperature": 0.8, "top_k": 50, "top_p": 0.9, "repetition_penalty": 1.1},
}
BANDWIDTHS = {"H100": 3.35e12, "H200": 4.8e12}
"""Bytes per second of each card's memory by its datasheet: the floor's rate, by the card's name."""
BANDWIDTH = BANDWIDTHS["H200"]
"""The rate of a card not in BANDWIDTHS (the row says which card and rate it used)."""
CALL_ROUNDS = 3
"""--calls: the interleaved rounds of timed calls per column (few: a row's tuning is what costs)."""
ROW_ESTIMATE_S = {"llama1b": 85.0, "qwen05b": 75.0}
"""--budget: the seconds a --calls row of a shape is expected to take on an H100 before one of that
shape has run (its tuning, the static path's compile, CALL_ROUNDS rounds of 128 tokens; from the
old generate rows, 60 to 90 s with 7 rounds on the H200, and the decode step's per-part figures in
bench/results/decode-step.md: the fused loop's two candidates cost a Triton config choice of a
few seconds more); other shapes DEFAULT_ROW_S. A shape that has run gives its own figure."""
DEFAULT_ROW_S = 120.0
SERVE_ESTIMATE_S = 12.0
"""--budget: the seconds one --serve-batches batch is expected to take (the static path's compile
of the new batch and CALL_ROUNDS rounds of both columns)."""


def bandwidth_of(card: str) -> tuple[float, str]:
    """The floor's rate for a card by its name, and what it is ("H100 datasheet", or the H200's for
    a card not in BANDWIDTHS)."""
    for name, rate in BANDWIDTHS.items():
        if name in card:
            return rate, f"{name} datasheet, {rate / 1e12:g} TB/s"
    return BANDWIDTH, f"unknown card {card!r}: the H200's {BANDWIDTH / 1e12:g} TB/s"


def build_shape(name: str, dtype: torch.dtype, device: str, smoke: bool) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    if name in FAMILIES:
        model = build_family(name, dtype, device, smoke)
    elif smoke:  # the same classes, tiny
        small = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024)
        model = (LlamaForCausalLM(LlamaConfig(**small, tie_word_embeddings=True)) if name == "llama1b"
                 else Qwen2ForCausalLM(Qwen2Config(**small, tie_word_embeddings=True)))
    elif name == "llama1b":
        model = LlamaForCausalLM(LlamaConfig(
            vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
            num_key_value_heads=8, head_dim=64, max_position_embeddings=8192, rope_theta=500000.0,
            tie_word_embeddings=True))
    elif name == "qwen05b":
        model = Qwen2ForCausalLM(Qwen2Config(
            vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
            num_key_value_heads=2, max_position_embeddings=8192, rope_theta=1000000.0, tie_word_embeddings=True))
    else:
        raise SystemExit(f"unknown model shape {name!r}: one of {', '.join(list(SHAPES) + list(FAMILIES))}")
    model.generation_config.eos_token_id = None  # random weights: every call makes all its new tokens
    model.generation_config.pad_token_id = 0
    return model.eval().to(device, dtype)


def build_family(name: str, dtype: torch.dtype, device: str, smoke: bool) -> torch.nn.Module:
    """One of FAMILIES, its weights made on the device in the row's dtype (a 7B model's random
    initialisation on the host takes minutes)."""
    import transformers

    _, model_class, config_class, config = FAMILIES[name]
    if smoke:
        config = {**config, **{k: v for k, v in TINY.items() if k in config}}
        if name == "gpt2":
            config = dict(n_layer=2, n_embd=64, n_head=4, vocab_size=512)
    config = getattr(transformers, config_class)(**config)
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            return getattr(transformers, model_class)(config)
    finally:
        torch.set_default_dtype(default)


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of the weights a decode step reads once for one token: a tied embedding counted
    once, and of a mixture of experts only the experts a token is routed to (top-k of E)."""
    config = getattr(model, "config", None)
    experts = getattr(config, "num_experts", None) or getattr(config, "num_local_experts", None)
    routed = getattr(config, "num_experts_per_tok", None)
    seen, total = set(), 0.0
    for name, p in model.named_parameters():
        if p.data_ptr() not in seen:
            seen.add(p.data_ptr())
            share = routed / experts if experts and routed and ".experts." in name + "." else 1.0
            total += p.numel() * p.element_size() * share
    return int(total)


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def call_row(name: str, dtype_name: str, call: str, batch: int, prompt: int, new: int, device: str, smoke: bool,
             tweak_kwargs: dict, serve: tuple[int, ...] = (), deadline: float = float("inf")) -> dict:
    """One row of --calls: transformers' static path and tweak on the same call; with `serve`, the
    tuned model at those batches after (serve_rows: no tuning again) until `deadline`
    (time.perf_counter())."""
    import torch_tweak as tt

    base = build_shape(name, DTYPES[dtype_name], device, smoke)
    torch.manual_seed(1)
    ids = torch.randint(100, 500, (batch, prompt), device=device)
    settings = dict(CALLS[call], cache_implementation="static")
    rate, rate_of = bandwidth_of(torch.cuda.get_device_name() if device == "cuda" else "CPU (smoke)")
    floor_s = weight_bytes(base) / rate
    out: dict = {"model": name, "dtype": dtype_name, "call": call, "batch": batch, "prompt": prompt,
                 "new_tokens": new, "weight_bytes": weight_bytes(base), "bandwidth": rate_of,
                 "floor_tokens_per_s": batch / floor_s, "columns": {}}

    def generate(model, n):
        torch.manual_seed(7)  # sampling: the same draws in every column
        with torch.no_grad():
            return model.generate(ids, max_new_tokens=n, **settings)

    def timed_call(fn):
        sync()
        start = time.perf_counter()
        value = fn()
        sync()
        return time.perf_counter() - start, value

    # each column built (compiled, tuned) and its first call timed, one after the other; then
    # their timed calls interleaved, round by round in rotated order, so that a drift of the
    # machine's speed falls on both columns alike (the static column's figure moved by a third
    # between runs when the columns were timed one after the other)
    labels = ("static", "tweak-compiled")
    subjects: dict = {}
    for label in labels:
        subject = copy.deepcopy(base)
        if not smoke:
            cold()
        entry: dict = {}
        out["columns"][label] = entry
        try:
            start = time.perf_counter()
            if label == "tweak-compiled":
                result = tt.tweak(subject, workload=lambda m: generate(m, new), progress=False, **tweak_kwargs)
                out["tweak_result"] = str(result)
                out["decode_loop"] = result.decode_loop
                # each loop option measured (with and without the top-k sampler), and the one kept
                # with the correctness rule's finding per call: its error as a multiple of the untuned
                # call's, and where its tokens part from the untuned ones (step, margin)
                out["loop_report"] = [{k: r.get(k) for k in ("candidate", "state", "latency_ms", "numerics", "error")}
                                      for r in result.loop_report]
                out["loop_kept"] = repr(getattr(subject, "generate", None))
                out["loop"] = loop_label(subject)
                print(result, out["loop_report"], out["loop_kept"], flush=True)
            timed_call(lambda: generate(subject, new))
            entry["first_call_s"] = time.perf_counter() - start  # tuning (tweak) and the first call
            subjects[label] = subject
        except Exception as exc:
            entry["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:300]}"
            traceback.print_exc()
    # a later column's cold() reset the compiler: an earlier column compiles again here,
    # untimed, and transformers' first compiled call gives tokens of its own
    # (bench/studies/first_call_study.py): two untimed calls each
    runs: dict = {label: [] for label in subjects}
    firsts: dict = {label: [] for label in subjects}
    tokens: dict = {}
    seen: dict = {}  # every timed call's tokens, per column
    try:
        for label, subject in subjects.items():
            timed_call(lambda: generate(subject, new))
            timed_call(lambda: generate(subject, new))
        order = list(subjects)
        for r in range(CALL_ROUNDS):
            for label in order[r % len(order):] + order[: r % len(order)]:
                seconds, tokens[label] = timed_call(lambda: generate(subjects[label], new))
                seen.setdefault(label, []).append(tokens[label])
                runs[label].append(seconds)
                firsts[label].append(timed_call(lambda: generate(subjects[label], 1))[0])
    except Exception as exc:
        for label in subjects:
            out["columns"][label]["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:300]}"
        traceback.print_exc()
        runs = {}
    for label, times in runs.items():
        entry = out["columns"][label]
        median = statistics.median(times)
        entry.update(tokens_per_s=batch * new / median, run_ms=median * 1e3,
                     ttft_ms=statistics.median(firsts[label]) * 1e3, spread=(max(times) - min(times)) / median,
                     of_floor=batch * new / median / out["floor_tokens_per_s"], interleaved_rounds=CALL_ROUNDS)
        if label != "static" and "static" in tokens:  # the last timed call of each
            entry["same_as_static"] = bool(torch.equal(tokens[label], tokens["static"]))
            # where the static path does not repeat its own tokens from one call to the next
            # (near ties at prompt 512): how many sequences its timed calls gave, and whether
            # each of this column's calls gave one of them
            variants = []
            for t in seen["static"]:
                if not any(torch.equal(t, v) for v in variants):
                    variants.append(t)
            entry["static_sequences"] = len(variants)
            entry["each_among_static"] = all(any(torch.equal(t, v) for v in variants) for t in seen[label])
    for label in labels:
        print(name, dtype_name, call, f"batch {batch} prompt {prompt}", label, json.dumps(out["columns"][label]),
              flush=True)
    if serve and len(subjects) == 2 and runs:
        out["served"] = serve_rows(subjects, base, settings, prompt, new, serve, out["floor_tokens_per_s"] / batch,
                                   deadline, device)
    subjects = None
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return out


def loop_label(model: torch.nn.Module) -> str:
    """The decode loop a tuned model kept, as the tokens table names it ("fused, triton"), or
    "transformers" where generate() is transformers' own."""
    from torch_tweak._runtime.decode.loop import loop_of

    loop = loop_of(model)
    return "transformers" if loop is None else loop.name()


def serve_rows(subjects: dict, base: torch.nn.Module, settings: dict, prompt: int, new: int, batches: tuple[int, ...],
               floor_per_row: float, deadline: float, device: str) -> list[dict]:
    """--serve-batches: after the row's tuning (at its own batch), the tuned model's tokens/s at
    each of `batches` (no tuning again) against the static path at the same batch, CALL_ROUNDS
    interleaved rounds; whether any of tweak's calls fell back to transformers' loop (and why),
    whether its tokens are the static path's; a batch past `deadline` is skipped and says so."""
    from torch_tweak._runtime.decode.loop import loop_of

    rows = []
    for batch in batches:
        entry: dict = {"batch": batch, "floor_tokens_per_s": floor_per_row * batch}
        rows.append(entry)
        if time.perf_counter() + SERVE_ESTIMATE_S > deadline:
            entry["skipped"] = f"--budget: about {SERVE_ESTIMATE_S:g} s more than the budget had left"
            continue
        torch.manual_seed(2 + batch)
        ids = torch.randint(100, 500, (batch, prompt), device=device)
        loop = loop_of(subjects["tweak-compiled"])
        before = collections.Counter(loop.fallbacks) if loop is not None else collections.Counter()

        def generate(model):
            torch.manual_seed(7)
            with torch.no_grad():
                return model.generate(ids, max_new_tokens=new, **settings)

        try:
            times: dict = {label: [] for label in subjects}
            tokens = {label: [generate(s), generate(s)][-1] for label, s in subjects.items()}  # compiles, records
            order = list(subjects)
            for r in range(CALL_ROUNDS):
                for label in order[r % len(order):] + order[: r % len(order)]:
                    sync()
                    start = time.perf_counter()
                    tokens[label] = generate(subjects[label])
                    sync()
                    times[label].append(time.perf_counter() - start)
        except Exception as exc:
            entry["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:300]}"
            traceback.print_exc()
            continue
        static, tuned = (batch * new / statistics.median(times[k]) for k in ("static", "tweak-compiled"))
        fell = (collections.Counter(loop.fallbacks) - before) if loop is not None else {}
        entry.update(static_tokens_per_s=static, tweak_tokens_per_s=tuned, vs_static=tuned / static,
                     of_floor=tuned / entry["floor_tokens_per_s"], fallbacks=dict(fell), fell_back=bool(fell),
                     same_as_static=bool(torch.equal(tokens["static"], tokens["tweak-compiled"])),
                     interleaved_rounds=CALL_ROUNDS)
        print("served at batch", batch, json.dumps(entry), flush=True)
    return rows


def _same(column: dict) -> str:
    """The same-tokens cell: the last timed calls equal, or each of tweak's calls one of the
    sequences the static path's own calls gave (when it gave more than one)."""
    if column.get("same_as_static"):
        return "yes"
    n = column.get("static_sequences", 1)
    if n > 1 and column.get("each_among_static"):
        return f"each call one of the static path's own {n} sequences"
    return "no"


def calls_table(rows: list[dict]) -> list[str]:
    """The --calls rows as a table (merge); a row --budget skipped says so, and the batches a
    tuned model served after its tuning (--serve-batches) follow it."""
    lines = ["## The calls people make (issue 29)", "",
             "Memory floor: the weights read once per step at the card's datasheet bandwidth (3.35 TB/s H100, "
             "4.8 TB/s H200; rows written before it: 4.8 TB/s), batch / step time. Sampling: temperature 0.7, "
             "top-k 50, top-p 0.9; chat: temperature 0.8, top-k 50, top-p 0.9, repetition penalty 1.1; their "
             "tokens compared under the same torch.manual_seed.", "",
             "| model | call | batch | prompt | floor tok/s | static tok/s | tweak tok/s | tweak / static | "
             "tweak % of floor | first token ms (static / tweak) | tuning / static first call | same tokens | loop kept |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|---|---:|---|---|"]
    for r in rows:
        if "skipped" in r:
            lines.append(f"| {r['model']} {r['dtype']} | {r['call']} | {r['batch']} | {r['prompt']} | "
                         f"skipped: {r['skipped']} | | | | | | | | |")
            continue
        s, t = r["columns"].get("static", {}), r["columns"].get("tweak-compiled", {})
        head = f"| {r['model']} {r['dtype']} | {r['call']} | {r['batch']} | {r['prompt']} | {r['floor_tokens_per_s']:,.0f} |"
        if "tokens_per_s" not in s or "tokens_per_s" not in t:
            why = (s.get("error") or t.get("error") or "not measured")[:80]
            lines.append(head + f" failed: {why} | | | | | | | | |")
            continue
        lines.append(head + f" {s['tokens_per_s']:,.0f} | {t['tokens_per_s']:,.0f} | "
                     f"{t['tokens_per_s'] / s['tokens_per_s']:.2f}x | {100 * t['of_floor']:.0f} % | "
                     f"{s['ttft_ms']:.2f} / {t['ttft_ms']:.2f} | {t['first_call_s'] / s['first_call_s']:.1f}x | "
                     f"{_same(t)} | {r.get('loop', r.get('decode_loop') or 'transformers')} |")
        lines += _served_lines(r)
    return lines + [""]


def _served_lines(r: dict) -> list[str]:
    """A row's --serve-batches batches: the tuned model of that row at another batch, no tuning."""
    lines = []
    for b in r.get("served", []):
        head = f"| {r['model']} {r['dtype']} | {r['call']}, tuned at batch {r['batch']} | {b['batch']} | {r['prompt']} | "
        if "tweak_tokens_per_s" not in b:
            lines.append(head + f"{b['floor_tokens_per_s']:,.0f} | {b.get('skipped') or b.get('error', '')} "
                         "| | | | | | | |")
            continue
        fell = ("fell back: " + ", ".join(b["fallbacks"])) if b["fell_back"] else "no fallback"
        lines.append(head + f"{b['floor_tokens_per_s']:,.0f} | {b['static_tokens_per_s']:,.0f} | "
                     f"{b['tweak_tokens_per_s']:,.0f} | {b['vs_static']:.2f}x | {100 * b['of_floor']:.0f} % | - | "
                     f"no tuning | {'yes' if b['same_as_static'] else 'no'} | {fell} |")
    return lines


def build(name: str, dtype: torch.dtype) -> torch.nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    if name == "gpt2":
        model = GPT2LMHeadModel(GPT2Config())
    else:
        model = LlamaForCausalLM(LlamaConfig(vocab_size=32000, hidden_size=1024, intermediate_size=2816,
                                             num_hidden_layers=8, num_attention_heads=16, num_key_value_heads=4,
                                             max_position_embeddings=2048))
    return model.eval().to("cuda", dtype)


def cold() -> None:
    folder = tempfile.mkdtemp(prefix="tt-gen-bench-")
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = folder
    os.environ["TRITON_CACHE_DIR"] = os.path.join(folder, "triton")
    torch._dynamo.reset()
    try:
        from torch._inductor.utils import clear_caches
        clear_caches()
    except ImportError:
        pass


def timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    torch.cuda.synchronize()
    start = time.perf_counter()
    out = fn()
    torch.cuda.synchronize()
    return time.perf_counter() - start, out


def measure(generate: Callable[..., Any], new: int) -> dict:
    """tokens/s and TTFT of a warmed generate()."""
    runs = [timed(lambda: generate(new))[0] for _ in range(ROUNDS)]
    firsts = [timed(lambda: generate(1))[0] for _ in range(ROUNDS)]
    median = statistics.median(runs)
    return {"tokens_per_s": new / median, "run_ms": median * 1e3, "ttft_ms": statistics.median(firsts) * 1e3,
            "spread": (max(runs) - min(runs)) / median}


def row(name: str, dtype_name: str, new: int, prompt: int, tweak_kwargs: dict) -> dict:
    import torch_tweak as tt

    dtype = DTYPES[dtype_name]
    torch.manual_seed(1)
    ids = torch.randint(100, 1000, (1, prompt), device="cuda")
    out: dict = {"model": name, "dtype": dtype_name, "new_tokens": new, "prompt": prompt, "columns": {}}
    base = build(name, dtype)
    reference = None

    def column(label: str, prepare: Callable[[torch.nn.Module], Callable[[int], Any]], ref_call=None) -> None:
        nonlocal reference
        subject = copy.deepcopy(base)
        cold()
        entry: dict = {}
        generate = None
        try:
            first_s, generate = timed(lambda: prepare(subject))
            t, tokens = timed(lambda: generate(new))
            entry["first_call_s"] = first_s + t
            entry.update(measure(generate, new))
            if reference is None:
                reference = tokens
            entry["same_as_eager"] = bool(torch.equal(tokens, reference))
            if ref_call is not None:
                untuned = ref_call()
                entry["same_as_untuned"] = bool(torch.equal(tokens, untuned))
        except Exception as exc:
            entry["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:300]}"
            traceback.print_exc()
        out["columns"][label] = entry
        print(name, dtype_name, label, json.dumps(entry), flush=True)
        subject = generate = None  # the copy goes before the next column
        gc.collect()
        torch.cuda.empty_cache()

    def eager(model):
        return lambda n: model.generate(ids, max_new_tokens=n, do_sample=False)

    static_tokens: dict = {}

    def static(model):
        def call(n):
            tokens = model.generate(ids, max_new_tokens=n, do_sample=False, cache_implementation="static")
            static_tokens.setdefault(n, tokens)
            return tokens
        return call

    def manual(model):
        model.forward = torch.compile(model.forward, mode="reduce-overhead")
        return lambda n: model.generate(ids, max_new_tokens=n, do_sample=False, cache_implementation="static",
                                        disable_compile=True)

    untuned_tokens: dict = {}

    def tweak(model):
        def call(m, n=new):
            return m.generate(ids, max_new_tokens=n, do_sample=False, cache_implementation="static",
                              disable_compile=True)
        untuned_tokens["t"] = call(copy.deepcopy(base))
        result = tt.tweak(model, workload=call, **tweak_kwargs)
        out["tweak_result"] = str(result)
        out["decode_loop"] = result.decode_loop
        print(result, flush=True)
        return lambda n: call(model, n)

    def tweak_compiled(model):
        def call(m, n=new):
            return m.generate(ids, max_new_tokens=n, do_sample=False, cache_implementation="static")
        result = tt.tweak(model, workload=call, **tweak_kwargs)
        out["tweak_compiled_result"] = str(result)
        out["decode_loop_compiled"] = result.decode_loop
        print(result, flush=True)
        return lambda n: call(model, n)

    column("eager", eager)
    column("static", static)
    column("manual", manual)
    column("tweak", tweak, ref_call=lambda: untuned_tokens["t"])
    if new in static_tokens:
        column("tweak-compiled", tweak_compiled, ref_call=lambda: static_tokens[new])
    return out


def merge(paths: list[str], path_out: str) -> None:
    rows = []
    meta = None
    for p in paths:
        with open(p) as f:
            data = json.load(f)
        meta = meta or data.get("meta")
        rows.extend(data["rows"])
    call_rows = [r for r in rows if "call" in r]
    rows = [r for r in rows if "call" not in r]
    lines = ["# generate(): tokens per second on one GPU", "",
             "Written by `bench/generate_bench.py --merge` from " + ", ".join(f"`{os.path.basename(p)}`" for p in paths)
             + ". Greedy decoding, batch 1, random weights; every compiling column starts cold.", ""]
    if meta:
        lines += [f"Machine: {meta.get('gpu')}, torch {meta.get('torch')}, transformers {meta.get('transformers')}.", ""]
    lines += ["| model | dtype | column | tokens/s | vs eager | vs static | first token ms | first call s | "
              "same tokens |", "|---|---|---|---:|---:|---:|---:|---:|---|"]
    for r in rows:
        cols = r["columns"]
        eager = cols.get("eager", {}).get("tokens_per_s")
        static = cols.get("static", {}).get("tokens_per_s")
        for label in COLUMNS:
            c = cols.get(label, {})
            if "error" in c:
                lines.append(f"| {r['model']} | {r['dtype']} | {label} | failed: {c['error'][:80]} | | | | | |")
                continue
            if "tokens_per_s" not in c:
                continue
            rate = c["tokens_per_s"]
            same = "yes" if c.get("same_as_untuned", c.get("same_as_eager")) else "no"
            if "same_as_untuned" in c:
                same += f" (eager: {'yes' if c['same_as_eager'] else 'no'})"
            lines.append(f"| {r['model']} | {r['dtype']} | {label} | {rate:,.0f} | "
                         f"{rate / eager:.2f}x | " + (f"{rate / static:.2f}x" if static else "-") +
                         f" | {c['ttft_ms']:.2f} | {c['first_call_s']:.1f} | {same} |")
    lines += ["", "Targets (issue 16), per row: tweak's tokens/s against transformers' static-cache path (2x in "
              "bf16) and eager (5x in bf16); tuning time (tweak's first call) against the static path's "
              "first call (at most 3x); identical tokens.", "",
              "| model | dtype | column | vs static | vs eager | tuning / static first call | identical tokens |",
              "|---|---|---|---:|---:|---:|---|"]
    for r in rows:
        cols = r["columns"]
        for label in ("tweak", "tweak-compiled"):
            t, s, e = cols.get(label, {}), cols.get("static", {}), cols.get("eager", {})
            if not all("tokens_per_s" in c for c in (t, s, e)):
                continue
            lines.append(f"| {r['model']} | {r['dtype']} | {label} | {t['tokens_per_s'] / s['tokens_per_s']:.2f}x | "
                         f"{t['tokens_per_s'] / e['tokens_per_s']:.2f}x | "
                         f"{t['first_call_s'] / s['first_call_s']:.1f}x | {'yes' if t.get('same_as_untuned') else 'no'} |")
    lines.append("")
    for r in rows:
        for key, label in (("tweak_result", "tweak"), ("tweak_compiled_result", "tweak-compiled")):
            if key in r:
                lines += [f"{label}'s result for {r['model']} {r['dtype']}:", "", "```", r[key], "```", ""]
    if call_rows:
        lines += calls_table(call_rows)
    with open(path_out, "w") as f:
        f.write("\n".join(lines))
    print("\n".join(lines))


def calls_main(args: argparse.Namespace, transformers: Any) -> None:
    """--calls (and --smoke): a row per model, dtype, call kind, batch and prompt, within --budget."""
    global ROUNDS, CALL_ROUNDS
    smoke = args.smoke
    device = "cpu" if smoke else "cuda"
    card = "CPU (smoke)" if smoke else torch.cuda.get_device_name()
    meta = {"gpu": card, "bandwidth": bandwidth_of(card)[1], "torch": torch.__version__,
            "transformers": transformers.__version__, "python": platform.python_version(), "budget_s": args.budget}
    models = args.models if args.models != "gpt2,llama" else ",".join(SHAPES)
    tweak_kwargs = json.loads(args.tweak)
    CALL_ROUNDS = args.rounds
    if smoke:
        ROUNDS = CALL_ROUNDS = 2
        tweak_kwargs.setdefault("measure", {"rounds_max": 6, "time_cap": 0.5})
        tweak_kwargs.setdefault("max_depth", 0)
    new = 8 if smoke else args.new
    serve = tuple(int(b) for b in args.serve_batches.split(",") if b)
    start = time.perf_counter()
    deadline = start + (args.budget if args.budget is not None else float("inf"))
    taken: dict = {}  # shape -> seconds its last row took
    rows = []
    for name, dtype_name, call, batch, prompt, served in row_specs(args, models, serve):
        estimate = taken.get(name, ROW_ESTIMATE_S.get(name, DEFAULT_ROW_S))
        left = deadline - time.perf_counter()
        if estimate > left:
            rows.append({"model": name, "dtype": dtype_name, "call": call, "batch": batch, "prompt": prompt,
                         "new_tokens": new, "skipped": f"--budget: about {estimate:.0f} s, {max(left, 0):.0f} s left"})
            print("skipped", rows[-1], flush=True)
        else:
            began = time.perf_counter()
            rows.append(call_row(name, dtype_name, call, batch, prompt, new, device, smoke, tweak_kwargs, served,
                                 deadline))
            taken[name] = time.perf_counter() - began - SERVE_ESTIMATE_S * len(rows[-1].get("served", []))
        meta["elapsed_s"] = time.perf_counter() - start
        with open(args.json, "w") as f:
            json.dump({"meta": meta, "rows": rows}, f, indent=1)
    print("\n".join(calls_table(rows)))


def row_specs(args: argparse.Namespace, models: str, serve: tuple[int, ...]) -> list[tuple]:
    """The --calls rows in order: (model, dtype, call, batch, prompt, batches served after its
    tuning); --rows lists them ("llama1b:greedy:1:4,8;qwen05b:greedy:1": model, call, batch and
    the batches served, in the first --dtypes and --prompts), else every combination of --models,
    --dtypes, --call-kinds, --batches and --prompts, each with --serve-batches."""
    dtypes = ["fp32"] if args.smoke else args.dtypes.split(",")
    prompts = [8] if args.smoke else [int(p) for p in args.prompts.split(",")]
    if args.rows:
        specs = []
        for spec in args.rows.split(";"):
            name, call, batch, *rest = spec.split(":")
            if call not in CALLS:
                raise SystemExit(f"--rows {spec!r}: the call is one of {', '.join(CALLS)}")
            specs.append((name, dtypes[0], call, int(batch), prompts[0],
                          tuple(int(b) for b in rest[0].split(",") if b) if rest else ()))
        return specs
    return [(name, dtype_name, call, int(batch), prompt, serve) for name in models.split(",") for dtype_name in dtypes
            for call in args.call_kinds.split(",") for batch in args.batches.split(",") for prompt in prompts]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="gpt2,llama")
    parser.add_argument("--dtypes", default="bf16,fp32")
    parser.add_argument("--new", type=int, default=128)
    parser.add_argument("--prompt", type=int, default=32)
    parser.add_argument("--tweak", default="{}", help="tt.tweak keyword arguments as JSON")
    parser.add_argument("--json", default="generate.json")
    parser.add_argument("--merge", nargs="*")
    parser.add_argument("--calls", action="store_true", help="the calls people make: --models llama1b,qwen05b")
    parser.add_argument("--call-kinds", default="greedy,sampling")
    parser.add_argument("--batches", default="1,4")
    parser.add_argument("--prompts", default="32,512")
    parser.add_argument("--smoke", action="store_true", help="--calls on the CPU, tiny configs: does it run")
    parser.add_argument("--serve-batches", default="",
                        help="--calls: after each row's tuning, the tuned model at these batches too (e.g. 4,8)")
    parser.add_argument("--budget", type=float, default=None,
                        help="--calls: seconds; a row (or served batch) it cannot finish is skipped, said in the JSON")
    parser.add_argument("--rows", default="", help='--calls: the rows, "model:call:batch[:served batches];..."')
    parser.add_argument("--rounds", type=int, default=CALL_ROUNDS, help="--calls: interleaved rounds per column")
    parser.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "generate.md"))
    args = parser.parse_args()
    if args.merge:
        merge(args.merge, args.out)
        return
    import transformers
    if args.calls or args.smoke:
        calls_main(args, transformers)
        return
    meta = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "transformers": transformers.__version__,
            "python": platform.python_version()}
    rows = []
    for name in args.models.split(","):
        for dtype_name in args.dtypes.split(","):
            rows.append(row(name, dtype_name, args.new, args.prompt, json.loads(args.tweak)))
            with open(args.json, "w") as f:
                json.dump({"meta": meta, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
