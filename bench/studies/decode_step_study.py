"""tweak's own decode step (src/torch_tweak/_runtime/fused_step.py) against the memory floor, on
one GPU, for the shipped (tied) shapes of Llama-3.2-1B and Qwen2.5-0.5B: random weights (seed 0),
bf16, prompt PROMPT, NEW new tokens, batch 1 (and 4 and 8).

Per model and batch, every figure measured on this card (none written in):

    tune       the Triton step made on a fresh cache of each bucket: the seconds it takes (its
               kernels compiled at once and their configs measured; a larger bucket takes the
               products' configs of the first) and the config chosen per product and attention
    products   per product shape of a layer (q/k/v, o, gate/up, down) and the output projection:
               cuBLAS (F.linear on each weight, as the model lays them out) and the step's Triton
               kernel at each config of fused_tuning.product_configs (with its prologue and
               epilogue): us and GB/s of the weights' bytes (one weight timed again and again:
               the small ones partly from the L2 cache); last of all, Inductor with coordinate
               descent tuning (the same F.linear calls compiled, one compile each)
    step       the whole decode step (the step's work and the argmax) recorded as one CUDA graph,
               per implementation: torch ops eager (cuBLAS), torch ops compiled by Inductor with
               coordinate descent tuning, Triton kernels: ms a token and % of the floor (the
               weight bytes a step reads over the card's bandwidth: 3.35 TB/s H100, 4.8 TB/s H200,
               named from torch.cuda.get_device_name)
    parts      which part of a step costs what, each recorded alone: the embedding, the products
               (as the implementation runs them: Triton's with their norms fused; torch's with
               the norms, silu and residual adds as their own ops), cuBLAS's F.linear calls
               alone, the attention (rotary, cache write, attention), the choice (argmax; the
               chat call's sampling); for the torch ops also their norms alone and their rotary
               embeddings alone (what Triton's kernels fuse)
    sampling   the step with the chat call's choice (T 0.8, top-k 50, top-p 0.9, repetition
               penalty 1.1) inside the graph against the step with the argmax
    generate   one call of NEW tokens: the model's own prefill, then NEW - 1 replays of the step
               and its choice (the token fed back, the position moved on, the output written, all
               inside the graph), in tokens per second
    check      the step's logits teacher-forced on the untuned greedy tokens, held to the measured
               rule (fused_check.check): the worst error as a multiple of the untuned model's

The Triton rows come first, then Inductor's (its step, then its products: the compiles). A
section that would run past --budget seconds is skipped and says so; each section's seconds
are in the file (`section_s`). With --smoke the same
sections run on the CPU on tiny models of both shapes (torch ops; eager timings, not graphs), in
seconds: the script's own check.

    python bench/studies/decode_step_study.py [--smoke] [--batches 1,4,8] [--json PATH]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
import traceback
from typing import Any, Callable

import common
import decode_anatomy
import torch
import torch.nn.functional as F

PROMPT, NEW = 32, 128
CARDS = {"H100": 3.35e12, "H200": 4.8e12}
CHAT = dict(do_sample=True, temperature=0.8, top_k=50, top_p=0.9, repetition_penalty=1.1)


def bandwidth() -> tuple[str, float | None]:
    """The card's name and its datasheet bandwidth (None for a card not listed: no % of floor)."""
    if not torch.cuda.is_available():
        return "cpu", None
    name = torch.cuda.get_device_name()
    return name, next((bw for card, bw in CARDS.items() if card in name), None)


def model_of(shape: str, smoke: bool, device: torch.device) -> torch.nn.Module:
    import transformers as T

    torch.manual_seed(0)
    if shape == "llama-1b":
        dims = dict(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                    num_attention_heads=32, num_key_value_heads=8, head_dim=64)
        small = dict(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, head_dim=32)
        config = T.LlamaConfig(**(small if smoke else dims), max_position_embeddings=4096, rope_theta=500000.0,
                               tie_word_embeddings=True)
        model = T.LlamaForCausalLM(config)
    else:  # Qwen2.5-0.5B: 7 query heads per key/value head, q/k/v biases
        dims = dict(vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                    num_attention_heads=14, num_key_value_heads=2, head_dim=64)
        small = dict(vocab_size=512, hidden_size=112, intermediate_size=224, num_hidden_layers=2,
                     num_attention_heads=7, num_key_value_heads=1, head_dim=16)
        config = T.Qwen2Config(**(small if smoke else dims), max_position_embeddings=4096, rope_theta=1000000.0,
                               tie_word_embeddings=True, rms_norm_eps=1e-6)
        model = T.Qwen2ForCausalLM(config)
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model.eval().to(device, torch.float32 if smoke else torch.bfloat16)


def timed_ms(fn: Callable[[], Any], device: torch.device, calls: int = 1) -> float:
    """ms of one call of `fn` (which makes `calls` calls of what is measured): on CUDA recorded as
    one graph and replayed (decode_anatomy.replay_ms); on the CPU the median of 3 eager calls."""
    if device.type == "cuda":
        graph, _ = common.graphed(fn, fork_rng=True)
        return decode_anatomy.replay_ms(graph) / calls
    fn()
    rounds = []
    for _ in range(3):
        start = time.perf_counter()
        fn()
        rounds.append((time.perf_counter() - start) * 1e3)
    return statistics.median(rounds) / calls


class Budget:
    def __init__(self, seconds: float) -> None:
        self.end = time.monotonic() + seconds

    def left(self) -> float:
        return self.end - time.monotonic()


def section(out: dict, name: str, budget: Budget, need: float, fn: Callable[[], Any]) -> None:
    """out[name] = fn(), or why not (an error, or the time budget left below `need` seconds)."""
    if budget.left() < need:
        out[name] = {"skipped": f"time budget: {budget.left():.0f} s left, about {need:.0f} s needed"}
        return
    start = time.monotonic()
    try:
        out[name] = fn()
    except Exception as exc:  # keep the other sections' figures
        traceback.print_exc()
        out[name] = {"error": f"{type(exc).__name__}: {str(exc).splitlines()[0][:300] if str(exc) else ''}"}
    out.setdefault("section_s", {})[name] = round(time.monotonic() - start, 1)  # what the budget's needs are from
    print(name, out[name], flush=True)


def figure(ms: float, nbytes: int) -> dict:
    return {"us": round(ms * 1e3, 2), "GB/s": round(nbytes / (ms * 1e-3) / 1e9, 1)}


def kernel_names(device: torch.device) -> list[str]:
    """The step's implementations that run here: Triton's only on CUDA (the interpreter is a
    check, not a timing)."""
    from torch_tweak._runtime.decode import fused_kernels

    names = ["torch"]
    if device.type == "cuda" and fused_kernels.triton_problem(device) is None:
        names.append("triton")
    return names


def product_specs(decoder: Any) -> dict:
    layer = decoder.layers[0]
    return {"qkv": layer.qkv, "o": layer.o, "gate_up": layer.gate_up, "down": layer.down, "lm_head": decoder.final}


def products(decoder: Any, batch: int, device: torch.device) -> dict:
    """Per product shape: cuBLAS and the step's Triton kernel at each of its candidate configs."""
    from torch_tweak._runtime.decode import fused_kernels, fused_step, fused_tuning

    rows = fused_step.bucket(batch)
    found: dict[str, Any] = {}
    triton = fused_kernels.TritonKernels(device) if "triton" in kernel_names(device) else None
    for name, spec in product_specs(decoder).items():
        x = torch.randn(rows, 2 * spec.k if spec.glu else spec.k, device=device, dtype=decoder.weight_dtype)
        y = torch.zeros(rows, spec.n, device=device, dtype=decoder.weight_dtype)
        nbytes = sum(w.numel() * w.element_size() for w in spec.weights)
        plain = x[:, :spec.k].contiguous()
        row: dict[str, Any] = {"n": spec.n, "k": spec.k, "weights": len(spec.weights), "bytes": nbytes}
        row["cublas"] = figure(timed_ms(lambda: [F.linear(plain, w) for w in spec.weights], device), nbytes)
        if triton is not None:
            row["triton"] = {}
            for config in fused_tuning.product_configs(rows, spec.n, spec.k, triton.sms):
                try:
                    ms = timed_ms(lambda c=config: triton._product(spec, x, y, c), device)
                    row["triton"][repr(config)] = figure(ms, nbytes)
                except Exception as exc:  # a config the card cannot run
                    row["triton"][repr(config)] = f"{type(exc).__name__}"
        found[name] = row
    return found


def inductor_products(decoder: Any, batch: int, device: torch.device) -> dict:
    """Per product shape: Inductor with coordinate descent tuning (the F.linear calls compiled)."""
    from torch_tweak._runtime.decode import fused_step

    rows = fused_step.bucket(batch)
    found: dict[str, Any] = {}
    for name, spec in product_specs(decoder).items():
        plain = torch.randn(rows, spec.k, device=device, dtype=decoder.weight_dtype)
        nbytes = sum(w.numel() * w.element_size() for w in spec.weights)
        fn = torch.compile(lambda a, ws=spec.weights: [F.linear(a, w) for w in ws], fullgraph=True,
                           options={"coordinate_descent_tuning": True, "triton.cudagraphs": False})
        found[name] = figure(timed_ms(lambda: fn(plain), device), nbytes)
    return found


def tune(decoder: Any, batch: int) -> dict:
    """The Triton step made on a fresh cache of the batch's bucket: the seconds it takes (its
    kernels compiled and their configs measured, or taken from an earlier bucket's), and the
    config chosen per product and for the attention."""
    from torch_tweak._runtime.decode import fused_step

    cache = decoder.cache(batch, PROMPT + NEW)
    start = time.perf_counter()
    step = decoder.runner(cache, "triton")
    seconds = time.perf_counter() - start
    layer, rows = decoder.layers[0], fused_step.bucket(batch)
    named = dict(product_specs(decoder), attention=layer.attention)
    return {"seconds": round(seconds, 2),
            "configs": {name: repr(step.kernels.configs.get((id(spec), rows))) for name, spec in named.items()}}


def prompt(batch: int, vocab: int, device: torch.device) -> torch.Tensor:
    return torch.randint(3, vocab, (batch, PROMPT), generator=torch.Generator().manual_seed(batch)).to(device)


def made_step(decoder: Any, kernels: str, batch: int) -> tuple[Any, Any, torch.Tensor]:
    """(a cache prefilled with a prompt, the step on it, the prompt), the position in the middle of
    the call's new tokens."""
    ids = prompt(batch, decoder.vocab, decoder.weight_device)
    cache = decoder.cache(batch, PROMPT + NEW)
    decoder.prefill(ids, cache)
    step = decoder.runner(cache, kernels)
    step.position.fill_(PROMPT + NEW // 2)
    return cache, step, ids


def chat_choice(decoder: Any, ids: torch.Tensor) -> Any:
    from torch_tweak._runtime.decode import call as decode_call
    from torch_tweak._runtime.decode.fused_choice import StepChoice

    call = decode_call.greedy_call(decoder.model, (ids,), dict(CHAT, max_new_tokens=NEW))
    choice = StepChoice.of(call.processors, True, call.eos, call.pad, ids.device)
    choice.start(ids, decoder.vocab)
    return choice


def whole_step(decoder: Any, kernels: str, batch: int, floor_ms: float | None) -> dict:
    _, step, ids = made_step(decoder, kernels, batch)
    greedy = timed_ms(lambda: step.forward()[:batch].argmax(-1), decoder.weight_device)
    choice = chat_choice(decoder, ids)
    sampled = timed_ms(lambda: choice(step.forward()[:batch]), decoder.weight_device)
    found = {"ms": round(greedy, 4), "tokens/s": round(batch * 1e3 / greedy, 1), "sampling_ms": round(sampled, 4)}
    if floor_ms is not None:
        found["of_floor"] = round(floor_ms / greedy, 4)
    return found


def parts(decoder: Any, kernels: str, batch: int) -> dict:
    """Which part of a step costs what: each part of the step recorded alone, in ms."""
    _, step, ids = made_step(decoder, kernels, batch)
    k, dev = step.kernels, decoder.weight_device
    layers = list(zip(decoder.layers, step.caches))

    def products() -> None:
        for layer, _ in layers:
            k.product(layer.qkv, step.hidden, step.qkv)
            k.product(layer.o, step.attn, step.hidden)
            k.product(layer.gate_up, step.hidden, step.gate_up)
            k.product(layer.down, step.gate_up, step.hidden)
        k.product(decoder.final, step.hidden, step.logits)

    inputs = {w.shape[1]: torch.randn(step.rows, w.shape[1], device=dev, dtype=decoder.weight_dtype)
              for layer in decoder.layers for p in (layer.qkv, layer.o, layer.gate_up, layer.down) for w in p.weights}
    weights = [w for layer in decoder.layers for p in (layer.qkv, layer.o, layer.gate_up, layer.down)
               for w in p.weights] + [decoder.final.weights[0]]
    inputs[decoder.final.k] = torch.randn(step.rows, decoder.final.k, device=dev, dtype=decoder.weight_dtype)

    def attention() -> None:
        for layer, (keys, values, length) in layers:
            k.attention(layer.attention, step.qkv, step.attn, keys, values, step.cos, step.sin, step.position, length)

    choice = chat_choice(decoder, ids)
    found = {} if kernels != "torch" else elementwise(decoder, step)
    embed = timed_ms(lambda: torch.index_select(decoder.embed, 0, step.tokens, out=step.hidden), dev)
    return found | {"embedding": embed,
            "products": timed_ms(products, dev),
            "cublas_linear_alone": timed_ms(lambda: [F.linear(inputs[w.shape[1]], w) for w in weights], dev),
            "attention": timed_ms(attention, dev),
            "choice_greedy": timed_ms(lambda: step.logits[:batch].argmax(-1), dev),
            "choice_chat": timed_ms(lambda: choice(step.logits[:batch]), dev)}


def elementwise(decoder: Any, step: Any) -> dict:
    """The torch ops' norms (two a layer and the last) and rotary embeddings (q and k of every
    layer) recorded alone: what the Triton kernels fuse into the products and the attention."""
    from torch_tweak._runtime.decode.fused_kernels import rms_norm, rotate_half

    norms = [p for layer in decoder.layers for p in (layer.qkv, layer.gate_up)] + [decoder.final]
    a = decoder.layers[0].attention
    c, s = step.cos[:1], step.sin[:1]

    def rotary() -> None:
        for _ in decoder.layers:
            q, k = step.qkv[:, :a.heads * a.head_dim], step.qkv[:, a.heads * a.head_dim:(a.heads + a.kv_heads) * a.head_dim]
            for x in (q, k):
                x = x.view(step.rows, -1, a.head_dim)
                (x * c) + (rotate_half(x) * s)

    return {"norms_alone": timed_ms(lambda: [rms_norm(step.hidden, p.norm, p.eps) for p in norms], decoder.weight_device),
            "rotary_alone": timed_ms(rotary, decoder.weight_device)}


def generate(decoder: Any, kernels: str, batch: int, chat: bool) -> dict:
    """One call of NEW tokens through the step and its choice recorded together (module docs)."""
    cache, step, ids = made_step(decoder, kernels, batch)
    choice = chat_choice(decoder, ids) if chat else None
    out = torch.zeros(batch, NEW, dtype=torch.int64, device=decoder.weight_device)
    index = torch.zeros(1, dtype=torch.int64, device=decoder.weight_device)

    def one() -> None:
        logits = step.forward()[:batch]
        token = choice(logits) if choice is not None else logits.argmax(-1)
        out.index_copy_(1, index, token[:, None])
        index.add_(1)
        step.tokens[:batch].copy_(token)
        step.position.add_(1)

    graph = common.graphed(one)[0] if decoder.weight_device.type == "cuda" else None

    def call() -> None:
        logits = decoder.prefill(ids, cache)
        if choice is not None:
            choice.start(ids, decoder.vocab)
        first = choice(logits) if choice is not None else logits.argmax(-1)
        out[:, 0] = first
        index.fill_(1)
        step.tokens[:batch].copy_(first)
        step.position.fill_(PROMPT)
        for _ in range(NEW - 1):
            graph.replay() if graph is not None else one()
        if decoder.weight_device.type == "cuda":
            torch.cuda.synchronize()

    call()
    seconds = []
    for _ in range(3):
        start = time.perf_counter()
        call()
        seconds.append(time.perf_counter() - start)
    s = statistics.median(seconds)
    return {"tokens/s": round(batch * NEW / s, 1), "ms/token": round(s * 1e3 / NEW, 4),
            "first_tokens": out[0, :8].tolist()}


def check(decoder: Any, kernels: str, ids: torch.Tensor, made: Any) -> dict:
    from torch_tweak._search import fused_check

    found = fused_check.check(decoder, ids, made[0].shape[1] - ids.shape[1], kernels, made=made)
    return {"multiple": None if found.multiple is None else round(found.multiple, 3), "error": float(found)}


def one_model(shape: str, args: argparse.Namespace, budget: Budget, device: torch.device) -> dict:
    """Every section for one shape at batch 1; the step, the call and the check at the other
    batches; the torch ops' rows, then the Triton kernels' (tuned first, the time it takes said)."""
    from torch_tweak._search import fused_check
    from torch_tweak._runtime.decode.fused_step import FusedDecoder

    with device:
        model = model_of(shape, args.smoke, device)
    decoder = FusedDecoder.of(model)
    if isinstance(decoder, str):
        return {"refused": decoder}
    nbytes = decoder_anatomy_bytes(model)
    _, bw = bandwidth()
    floor_ms = None if bw is None else nbytes / bw * 1e3
    found: dict[str, Any] = {"weight_bytes": nbytes, "floor_ms": floor_ms, "batches": {}}
    names = kernel_names(device)
    for batch in args.batches:
        at: dict[str, Any] = found["batches"].setdefault(str(batch), {})
        ids = prompt(batch, decoder.vocab, device)
        made = fused_check.reference(model, ids, args.check_tokens)
        for kernels in names:
            if kernels == "triton":
                section(at, "tune triton", budget, 60 if batch == args.batches[0] else 10, lambda: tune(decoder, batch))
                if "configs" not in at["tune triton"]:  # its rows would tune it, past the budget or failing again
                    continue
            section(at, f"check {kernels}", budget, 5, lambda: check(decoder, kernels, ids, made))
            section(at, f"step {kernels}", budget, 10, lambda: whole_step(decoder, kernels, batch, floor_ms))
            section(at, f"generate {kernels} greedy", budget, 5, lambda: generate(decoder, kernels, batch, False))
            if batch == args.batches[0]:
                section(at, f"parts {kernels}", budget, 10, lambda: parts(decoder, kernels, batch))
                section(at, f"generate {kernels} chat", budget, 5, lambda: generate(decoder, kernels, batch, True))
    found["decoder"] = decoder
    return found


def decoder_anatomy_bytes(model: torch.nn.Module) -> int:
    """The weight bytes a step reads at the least (decode_anatomy.weight_bytes: each linear weight
    once, the tied output projection once, one embedding row, the norms)."""
    return decode_anatomy.weight_bytes(model)


def extras(shape: str, found: dict, args: argparse.Namespace, budget: Budget, device: torch.device) -> None:
    """After every shape's core rows: the products per config (no compile), then Inductor's
    step (a compile), its check and its call."""
    decoder = found.get("decoder")
    if decoder is None:
        return
    batch = args.batches[0]
    at = found["batches"][str(batch)]
    section(at, "products", budget, 20 if device.type == "cuda" else 5, lambda: products(decoder, batch, device))
    if device.type == "cuda":
        ids = prompt(batch, decoder.vocab, device)
        made = fused_check_reference(decoder.model, ids, args.check_tokens)
        section(at, "step inductor", budget, 90, lambda: whole_step(decoder, "inductor", batch, found["floor_ms"]))
        section(at, "check inductor", budget, 10, lambda: check(decoder, "inductor", ids, made))
        section(at, "generate inductor greedy", budget, 10, lambda: generate(decoder, "inductor", batch, False))


def last(shape: str, found: dict, args: argparse.Namespace, budget: Budget, device: torch.device) -> None:
    """At the end, what takes the most compiles for the least: Inductor's products one by one."""
    decoder = found.pop("decoder", None)
    if decoder is not None and device.type == "cuda":
        batch = args.batches[0]
        section(found["batches"][str(batch)], "products inductor", budget, 60,
                lambda: inductor_products(decoder, batch, device))


def fused_check_reference(model: torch.nn.Module, ids: torch.Tensor, new: int) -> Any:
    from torch_tweak._search import fused_check

    return fused_check.reference(model, ids, new)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="tiny models on the CPU, in seconds")
    parser.add_argument("--shapes", default="llama-1b,qwen2.5-0.5b")
    parser.add_argument("--batches", default="1,4,8")
    parser.add_argument("--check-tokens", type=int, default=16)
    parser.add_argument("--budget", type=float, default=420.0, help="seconds; later sections are skipped past it")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    args.batches = [int(b) for b in args.batches.split(",")]
    if args.smoke:  # seconds on a CPU: a short call, two batches (one padded into its bucket)
        global PROMPT, NEW
        PROMPT, NEW = 8, 12
        args.check_tokens = min(args.check_tokens, 4)
        args.batches = [1, 3]
    device = torch.device("cuda" if torch.cuda.is_available() and not args.smoke else "cpu")
    budget = Budget(args.budget)
    card, bw = bandwidth()
    import transformers

    run: dict[str, Any] = {"card": card, "bandwidth": bw, "torch": torch.__version__,
                           "transformers": transformers.__version__, "triton": triton_version(),
                           "commit": common.commit(), "smoke": args.smoke, "prompt": PROMPT, "new": NEW, "models": {}}
    shapes = args.shapes.split(",")
    with torch.no_grad():
        for shape in shapes:
            run["models"][shape] = one_model(shape, args, budget, device)
        for shape in shapes:
            extras(shape, run["models"][shape], args, budget, device)
        for shape in shapes:
            last(shape, run["models"][shape], args, budget, device)
    run["seconds"] = round(args.budget - budget.left(), 1)
    common.write_run(args.json, run)
    summary(run)


def triton_version() -> str | None:
    try:
        import triton
    except ImportError:
        return None
    return triton.__version__


def summary(run: dict) -> None:
    """The step's rows, the Triton step's tuning (its time, the config chosen per product) and
    which part of a step costs what."""
    print(f"{run['card']}, {run['seconds']} s")
    for shape, found in run["models"].items():
        for batch, at in found.get("batches", {}).items():
            for name, value in at.items():
                if isinstance(value, dict) and ("ms" in value or "tokens/s" in value):
                    share = f"  {value['of_floor']:.1%} of the floor" if "of_floor" in value else ""
                    print(f"{shape} batch {batch} {name}: {value.get('ms', value.get('ms/token'))} ms a token, "
                          f"{value['tokens/s']} tok/s{share}")
            tuned = at.get("tune triton", {})
            if "configs" in tuned:
                print(f"{shape} batch {batch} triton tuned in {tuned['seconds']} s:")
                for part, config in tuned["configs"].items():
                    print(f"    {part}: {config}")
            for name in ("parts torch", "parts triton"):
                if isinstance(at.get(name), dict) and "products" in at[name]:
                    print(f"{shape} batch {batch} {name} (ms): " +
                          ", ".join(f"{k} {v:.3f}" for k, v in at[name].items() if isinstance(v, float)))


if __name__ == "__main__":
    main()
