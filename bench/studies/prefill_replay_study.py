"""A study for the generate issue: why a recorded prefill's replay differs from the eager prefill
on some families (Phi-3, Mistral) and not on others (Llama, Qwen).

The decode loop records the prompt's forward as one device graph and keeps it only when its
replay gives the eager forward's logits bit for bit (torch_tweak/_runtime/decode/prefill.py). On the
H200 at 0873eec the Phi-3-mini and Mistral-7B rows refused their recordings on that check. Per
family (the configs of generate_bench.FAMILIES, random weights, bf16, a 32-token prompt on a
static cache, the attention masks made as the loop makes them), this runs:

    eager-eager   two eager forwards: are they themselves equal?
    replay        the forward recorded as the loop records it (decode.model.record_graph) and
                  replayed, against an eager forward
    first module  where they differ: every module's output kept (a hook clones it, inside the
                  graph while recording), the first module in call order whose outputs differ

and the same under variants that switch one thing: the masks made as eagerly while recording
(prefill.masks_as_eager, the loop's recording since this study), one attention backend only,
cuDNN's attention off, cuBLAS in place of cuBLASLt, the recording without own_blas_workspace,
one layer. For the base recording and masks_as_eager's, the kernels the eager forward and the
replay launch are listed (the profiler's names): the kernels only one of them launches say
which code ran differently.

    python bench/studies/prefill_replay_study.py [--models phi3mini,mistral7b,llama1b] [--layers 2] [--json PATH]
"""

from __future__ import annotations

import argparse
import contextlib
import inspect
import json
import traceback
from typing import Any, Callable

import torch

import common  # noqa: E402  (puts bench/ on the path)
import generate_bench as gb  # noqa: E402

from torch_tweak._runtime.decode import model as decode_model, prefill  # noqa: E402


def build(name: str, layers: int) -> torch.nn.Module:
    import transformers

    torch.manual_seed(0)
    if name in gb.FAMILIES:
        _, model_class, config_class, config = gb.FAMILIES[name]
        config = getattr(transformers, config_class)(**{**config, "num_hidden_layers": layers})
        default = torch.get_default_dtype()
        torch.set_default_dtype(torch.bfloat16)
        try:
            with torch.device("cuda"):
                model = getattr(transformers, model_class)(config)
        finally:
            torch.set_default_dtype(default)
        return model.eval()
    model = gb.build_shape(name, torch.bfloat16, "cuda", False)
    model.model.layers = model.model.layers[:layers]
    model.config.num_hidden_layers = layers
    return model


def masks(model: torch.nn.Module, cache: Any, ids: torch.Tensor, positions: torch.Tensor) -> Any:
    """The attention masks the decode loop passes a prefill (decode.inputs.StepInputs.attention)."""
    from transformers import masking_utils

    make = getattr(model, "create_masks_for_generate", masking_utils.create_masks_for_generate)
    named = "cache" if "cache" in inspect.signature(make).parameters else "past_key_values"
    out = make(config=model.config, inputs_embeds=torch.empty((1, ids.shape[1], 0), dtype=model.dtype, device=ids.device),
               attention_mask=None, position_ids=positions, block_sequence_ids=None, token_type_ids=None,
               mm_token_type_ids=None, is_first_iteration=True, **{named: cache})
    if isinstance(out, dict):
        return {k: v.contiguous() if isinstance(v, torch.Tensor) else v for k, v in out.items()}
    return out.contiguous() if isinstance(out, torch.Tensor) else out


def describe_mask(mask: Any) -> Any:
    if isinstance(mask, dict):
        return {k: describe_mask(v) for k, v in mask.items()}
    if isinstance(mask, torch.Tensor):
        return f"tensor {list(mask.shape)} {mask.dtype}"
    return repr(mask)


class Keep:
    """Forward hooks that keep a clone of every module's first tensor output, in call order."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.on = False
        self.kept: list[tuple[str, torch.Tensor]] = []
        self.handles = [m.register_forward_hook(self._hook(n)) for n, m in model.named_modules() if n]

    def _hook(self, name: str) -> Callable:
        def hook(module: Any, args: Any, out: Any) -> None:
            if not self.on:
                return
            t = out if isinstance(out, torch.Tensor) else next(
                (o for o in (out if isinstance(out, (tuple, list)) else []) if isinstance(o, torch.Tensor)), None)
            if t is not None:
                self.kept.append((name, t.detach().clone()))
        return hook

    def take(self) -> list[tuple[str, torch.Tensor]]:
        kept, self.kept = self.kept, []
        return kept

    def remove(self) -> None:
        for h in self.handles:
            h.remove()


def first_difference(graph: list, eager: list) -> dict:
    for (name, a), (other, b) in zip(graph, eager):
        if name != other or a.shape != b.shape:
            return {"module": name, "why": f"call order differs ({name} / {other}) or shapes {list(a.shape)} / {list(b.shape)}"}
        if not torch.equal(a, b):
            diff = (a.float() - b.float()).abs()
            return {"module": name, "max_abs": float(diff.max()), "differing": int((a != b).sum()),
                    "of": a.numel(), "shape": list(a.shape)}
    return {"module": None, "compared": min(len(graph), len(eager))}


def trial(model: torch.nn.Module, variant: str) -> dict:
    from transformers import StaticCache

    ids = torch.randint(3, model.config.vocab_size, (1, 32), device="cuda",
                        generator=torch.Generator("cuda").manual_seed(1))
    positions = torch.arange(32, device="cuda")[None]
    cache = StaticCache(config=model.config, max_cache_len=160)
    with torch.no_grad():
        model(input_ids=ids, past_key_values=cache, position_ids=positions, use_cache=True)  # the cache's lazy state
    cache.reset()
    mask = masks(model, cache, ids, positions)

    def run() -> torch.Tensor:
        cache.reset()
        return model(input_ids=ids, past_key_values=cache, position_ids=positions, attention_mask=mask,
                     use_cache=True).logits

    contexts = {
        "base": contextlib.nullcontext,
        "no cudnn attention": lambda: _flags(cudnn=False),
        "math attention only": lambda: _only("MATH"),
        "efficient attention only": lambda: _only("EFFICIENT_ATTENTION"),
        "cudnn attention only": lambda: _only("CUDNN_ATTENTION"),
        "flash attention only": lambda: _only("FLASH_ATTENTION"),
        "cublas not cublaslt": lambda: _blas("cublas"),
        "one layer": contextlib.nullcontext,
    }
    context = contexts.get(variant, contextlib.nullcontext)
    keep = Keep(model)
    out: dict = {"variant": variant, "mask": describe_mask(mask)}
    try:
        with torch.no_grad(), context():
            a = run().clone()
            b = run().clone()
            out["eager_eager_equal"] = bool(torch.equal(a, b))
            if variant == "no own workspace":
                graph, logits = common.graphed(run)
            elif variant == "masks as eager":  # the loop's recording since this study
                graph, logits = decode_model.record_graph(_kept(run, keep), torch.device("cuda"), warmups=2,
                                                          context=lambda: prefill.masks_as_eager(cache))
            else:
                # each call starts the list afresh: after the recording it holds the graph's tensors
                graph, logits = decode_model.record_graph(_kept(run, keep), torch.device("cuda"), warmups=2)
            recorded = keep.take()
            keep.on = True
            expected = run().clone()
            keep.on = False
            eager = keep.take()
            if variant in ("base", "masks as eager"):
                out["kernels_eager"], out["kernels_replay"] = common.kernels(run), common.kernels(
                    lambda: decode_model.replay(graph, torch.device("cuda")))
                out["kernels_only_eager"] = sorted(set(out["kernels_eager"]) - set(out["kernels_replay"]))
                out["kernels_only_replay"] = sorted(set(out["kernels_replay"]) - set(out["kernels_eager"]))
                expected = run().clone()
            decode_model.replay(graph, torch.device("cuda"))
            torch.cuda.synchronize()
            out["replay_equal"] = bool(torch.equal(logits, expected))
            out["replay_max_abs"] = float((logits.float() - expected.float()).abs().max())
            if recorded and not out["replay_equal"]:
                out["first_difference"] = first_difference(recorded, eager)
    except Exception as exc:  # noqa: BLE001 - a study: the error is the finding
        out["error"] = f"{type(exc).__name__}: {exc}"
        out["trace"] = traceback.format_exc()[-1500:]
    finally:
        keep.remove()
    return out


def _kept(run: Callable, keep: Keep) -> Callable:
    def recorded() -> torch.Tensor:
        keep.kept = []
        keep.on = True
        try:
            return run()
        finally:
            keep.on = False
    return recorded



@contextlib.contextmanager
def _only(backend: str) -> Any:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel([getattr(SDPBackend, backend)]):
        yield


@contextlib.contextmanager
def _flags(cudnn: bool = True) -> Any:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    allowed = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
    if cudnn:
        allowed.append(SDPBackend.CUDNN_ATTENTION)
    with sdpa_kernel(allowed):
        yield


@contextlib.contextmanager
def _blas(library: str) -> Any:
    before = torch.backends.cuda.preferred_blas_library()
    torch.backends.cuda.preferred_blas_library(library)
    try:
        yield
    finally:
        torch.backends.cuda.preferred_blas_library(before)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="phi3mini,mistral7b,llama1b")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--variants", default="base,masks as eager,no cudnn attention,math attention only,efficient attention only,"
                        "cudnn attention only,flash attention only,cublas not cublaslt,no own workspace,one layer")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    variants = [v.strip() for v in args.variants.split(",")]
    results = {"torch": torch.__version__, "device": torch.cuda.get_device_name(), "layers": args.layers, "rows": []}
    for name in args.models.split(","):
        model = build(name, args.layers)
        for variant in variants:
            m = build(name, 1) if variant == "one layer" else model
            row = {"model": name, **trial(m, variant)}
            print(json.dumps({k: v for k, v in row.items() if k not in ("trace", "kernels_eager", "kernels_replay")}),
                  flush=True)
            results["rows"].append(row)
        del model
        torch.cuda.empty_cache()
    if args.json:
        common.write_run(args.json, results)


if __name__ == "__main__":
    main()
