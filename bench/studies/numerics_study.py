"""The measured correctness rule on real models: how far the original is from a higher-precision
run of itself, how far the candidates tweak builds are, whether float32 is a sound reference
for a bfloat16 model, and what the bound per row and column (correctness.judge_groups) keeps and
refuses against the one before it (4x the original's worst row and worst value per tensor).

For each model (transformers BERT, GPT-2 and Llama with tied embeddings as they ship, ViT, a
small convolution net, each with random weights, float32 and bfloat16, on this machine's CPU)
and each output tensor, the study prints:

    own        the original's error against the reference (rms, peak: correctness.deviation)
    inductor   torch.compile's error: as multiples of the original's by the tensor-wide measure
               (rms, peak), and by the groups (the worst group's multiple of the original's in
               that group, and the share of its bound it uses: over 1 is refused)
    rounded    the module run at float32 and rounded back once, likewise
    f32 vs f64 (bfloat16 rows) the float32 reference's own error against a float64 run, as a
               share of the original's: how much of the original's error the reference
               itself could hide
    ref s      the reference's time (all recorded calls) against one forward of the original
    check ms   one check of the Inductor candidate: the groups' rule, and the tensor-wide one

then wrong candidates (the attention mask dropped and positions shifted by one on BERT,
positions shifted on GPT-2 and Llama) and the cancelling cases of issue 53 (an ordinary channel
30 % and 10 % wrong, a batch row 3 % wrong, each beside one that cancels), each with the verdict
of the groups' rule, the tensor-wide bound before it and the fixed rule.

    python bench/studies/numerics_study.py [--json PATH]

Quoted in bench/results/numerics.md.
"""

from __future__ import annotations

import argparse
import copy
import time

import common
import torch
from torch import nn

from torch_tweak._core import correctness as C
from torch_tweak._core import error_groups as G
from torch_tweak._core import settings as S


def bert(dtype: torch.dtype):
    import transformers
    cfg = transformers.BertConfig(hidden_size=128, num_hidden_layers=4, num_attention_heads=4, intermediate_size=512,
                                  vocab_size=1000)
    model = transformers.BertModel(cfg).eval().to(dtype)
    ids = torch.randint(0, 1000, (4, 64), generator=torch.Generator().manual_seed(1))
    mask = torch.ones(4, 64, dtype=torch.long)
    mask[1, 40:] = 0
    return model, [((), {"input_ids": ids, "attention_mask": mask, "return_dict": False})]


def gpt2(dtype: torch.dtype):
    import transformers
    cfg = transformers.GPT2Config(n_embd=128, n_layer=4, n_head=4, vocab_size=2000, n_positions=128,
                                  tie_word_embeddings=True)
    model = transformers.GPT2LMHeadModel(cfg).eval().to(dtype)
    ids = torch.randint(0, 2000, (2, 48), generator=torch.Generator().manual_seed(1))
    return model, [((ids,), {"use_cache": False, "return_dict": False})]


def llama(dtype: torch.dtype):
    import transformers
    cfg = transformers.LlamaConfig(hidden_size=128, intermediate_size=384, num_hidden_layers=3, num_attention_heads=4,
                                   num_key_value_heads=2, vocab_size=2000, tie_word_embeddings=True)
    model = transformers.LlamaForCausalLM(cfg).eval().to(dtype)
    ids = torch.randint(0, 2000, (2, 48), generator=torch.Generator().manual_seed(1))
    return model, [((ids,), {"use_cache": False, "return_dict": False})]


def vit(dtype: torch.dtype):
    import transformers
    cfg = transformers.ViTConfig(hidden_size=128, num_hidden_layers=4, num_attention_heads=4, intermediate_size=512,
                                 image_size=64, patch_size=8)
    model = transformers.ViTModel(cfg).eval().to(dtype)
    pixels = torch.randn(4, 3, 64, 64, generator=torch.Generator().manual_seed(1)).to(dtype)
    return model, [((pixels,), {"return_dict": False})]


def convnet(dtype: torch.dtype):
    model = nn.Sequential(nn.Conv2d(3, 32, 3, padding=1), nn.BatchNorm2d(32), nn.ReLU(), nn.Conv2d(32, 64, 3, stride=2),
                          nn.BatchNorm2d(64), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(64, 10))
    for m in model.modules():
        if isinstance(m, nn.BatchNorm2d):
            m.running_mean.uniform_(-1, 1)
            m.running_var.uniform_(0.5, 2)
    model = model.eval().to(dtype)
    return model, [((torch.randn(8, 3, 32, 32, generator=torch.Generator().manual_seed(1)).to(dtype),), {})]


def _old_deviation(out: torch.Tensor, ref: torch.Tensor, finite: torch.Tensor) -> tuple[float, float]:
    """The tensor-wide measure before the groups: each row's (last axis, never gathered) root mean
    square of the relative errors, the worst row's; and the largest value."""
    errors = G.relative_errors(out, ref, finite)
    width = errors.shape[-1] if errors.dim() >= 2 and errors.shape[-1] > 0 else max(errors.numel(), 1)
    rows = errors.reshape(-1, width)
    counts = finite.reshape(-1, width).sum(dim=-1).clamp(min=1)
    return float(((rows * rows).sum(dim=-1) / counts).sqrt().max()), float(errors.max())


def old_rule(got: torch.Tensor, out: torch.Tensor, high: torch.Tensor) -> tuple[bool, float, float]:
    """(kept, rms multiple, peak multiple) by the bound before the groups: 4x the original's worst
    row rms and worst value per tensor plus one ulp, capped; positions where the reference is NaN
    or Inf skipped."""
    finite = torch.isfinite(out) & torch.isfinite(high) & torch.isfinite(got)
    own, found = _old_deviation(out, high, finite), _old_deviation(got, high, finite)
    floor, cap = C.floor_for(out.dtype), S.MAX_TOLERANCES.get(out.dtype, 0.1)
    kept = found[0] <= min(4 * own[0] + floor, cap) and found[1] <= min(4 * own[1] + floor, 10 * cap)
    return kept, found[0] / own[0] if own[0] else float("inf"), found[1] / own[1] if own[1] else float("inf")


def new_rule(got: torch.Tensor, out: torch.Tensor, high: torch.Tensor) -> tuple[bool, float | None, float]:
    """(kept, the worst group's multiple of the original's there, the share of its bound it uses)."""
    try:
        found = C.check(got, out, high=[high])
        return True, found.multiple, found.share
    except C.MismatchError as exc:
        return False, (exc.error / exc.own if exc.own else None), (exc.error / exc.tolerance if exc.tolerance else 0.0)


def verdicts(got, out, high) -> dict:
    """Every rule's verdict on one wrong candidate's first output tensor."""
    got, out, high = (C.tensor_leaves(v)[0] for v in (got, out, high))
    new, old = new_rule(got, out, high), old_rule(got, out, high)
    try:
        C.check(got, out, tolerance=S.TOLERANCES[out.dtype])
        fixed = True
    except C.MismatchError:
        fixed = False
    return {"groups": new, "tensor-wide": old, "fixed": fixed}


def _outputs(model, calls, ref, dtype) -> list[dict]:
    """Per output tensor of the first call: the original's own error, Inductor's and the rounded
    module's by both measures, and the float32 reference's own share (bfloat16)."""
    a, k = calls[0]
    outs = C.tensor_leaves(model(*a, **k))
    compiled = torch.compile(model)
    compiled(*a, **k)  # compiles
    ind = C.tensor_leaves(compiled(*a, **k))
    wide = copy.deepcopy(model).float()
    wide_a, wide_k = C._cast((a, k), torch.float32, torch.device("cpu"), {})
    rounded = [t.to(dtype) if t.is_floating_point() else t for t in C.tensor_leaves(wide(*wide_a, **wide_k))]
    ref64 = None
    if dtype != torch.float32:
        saved = C.REFERENCE_DTYPES[dtype]
        C.REFERENCE_DTYPES[dtype] = torch.float64
        ref64 = C.reference(model, calls, [model(*a, **k)])
        C.REFERENCE_DTYPES[dtype] = saved
    found = []
    for j, (o, h) in enumerate(zip(outs, ref.outputs[0])):
        if h is None:
            continue
        finite = torch.isfinite(o) & torch.isfinite(h)
        own = C.deviation(o, h, finite)
        entry = {"output": j, "shape": list(o.shape), "own": own}
        for name, cand in (("inductor", ind[j]), ("rounded", rounded[j])):
            old = old_rule(cand, o, h)
            entry[name] = {"tensor-wide": list(old[1:]), "tensor-wide kept": old[0], "groups": new_rule(cand, o, h)}
        start = time.perf_counter()
        new_rule(ind[j], o, h)
        middle = time.perf_counter()
        old_rule(ind[j], o, h)
        entry["check_ms"] = [(middle - start) * 1e3, (time.perf_counter() - middle) * 1e3]
        if ref64 is not None:
            hd = C.deviation(h, ref64.outputs[0][j], torch.isfinite(h))
            entry["f32_vs_f64_share"] = [x / y if y else None for x, y in zip(hd, own)]
        found.append(entry)
    return found


def _wrong(name: str, model, calls, ref) -> dict:
    a, k = calls[0]
    out = model(*a, **k)
    if name == "bert":
        shifted = dict(k, position_ids=torch.arange(1, 65).expand(4, 64))
        cases = {"mask dropped": (a, dict(k, attention_mask=None)), "positions +1": (a, shifted)}
    elif name in ("gpt2", "llama"):
        length = a[0].shape[1]
        cases = {"positions +1": (a, dict(k, position_ids=torch.arange(1, length + 1).expand(a[0].shape[0], length)))}
    else:
        return {}
    return {label: verdicts(model(*ca, **ck), out, ref.outputs[0]) for label, (ca, ck) in cases.items()}


def study(name: str, make, dtype: torch.dtype) -> dict:
    torch.manual_seed(0)
    model, calls = make(dtype)
    row: dict = {"model": name, "dtype": str(dtype).replace("torch.", "")}
    with torch.no_grad():
        start = time.perf_counter()
        outs = [model(*a, **k) for a, k in calls]
        row["forward_s"] = time.perf_counter() - start
        ref = C.reference(model, calls, outs)
        row["reference_s"] = ref.seconds
        if not ref.measured:
            row["no_reference"] = ref.why
            return row
        row["outputs"] = _outputs(model, calls, ref, dtype)
        row["wrong"] = _wrong(name, model, calls, ref)
    return row


class Cancelling(nn.Module):
    """A linear layer with one channel (or one batch row) through (h + offset) - offset."""

    def __init__(self, along: str, offset: float):
        super().__init__()
        self.lin = nn.Linear(64, 64)
        self.along, self.offset = along, offset

    def forward(self, x, scale=None):
        h = self.lin(x)
        off = torch.zeros_like(h)
        if self.along == "channel":
            off[..., 5] = self.offset
        else:
            off[1] = self.offset
        h = (h + off) - off
        if scale is not None:
            h = h.clone()
            if self.along == "channel":
                h[..., 9] *= scale
            else:
                h[3] *= scale
        return h


def cancelling() -> dict:
    """Issue 53's cases: a wrong candidate and a right one (the module itself) beside a value
    that cancels, by each rule."""
    found = {}
    for label, along, offset, scale in (("channel 30 % wrong", "channel", 4e6, 1.3),
                                        ("channel 10 % wrong", "channel", 4e6, 1.1),
                                        ("batch row 3 % wrong", "row", 5e5, 1.03)):
        torch.manual_seed(0)
        model = Cancelling(along, offset).eval()
        x = torch.randn(8, 16, 64)
        with torch.no_grad():
            out = model(x)
            ref = C.reference(model, [((x,), {})], [out])
            found[label] = verdicts(model(x, scale=scale), out, ref.outputs[0])
            found[label.split(" ")[0] + " right"] = verdicts(model(x), out, ref.outputs[0])
    return found


def _verdict(v) -> str:
    kept, multiple, share = v
    text = "-" if multiple is None else f"{multiple:.2g}x"
    return f"{'kept' if kept else 'refused'} ({text}, {share:.2f} of its bound)"


def show(rows: list[dict], cases: dict) -> None:
    print("| model | dtype | output | own rms | own peak | Inductor tensor-wide (rms, peak) | Inductor by groups | "
          "rounded by groups | f32 ref's share of own | ref s / forward s | check ms (groups, tensor-wide) |")
    print("|---|---|---:|---:|---:|---|---|---|---|---|---|")
    for r in rows:
        for o in r.get("outputs", []):
            share = o.get("f32_vs_f64_share")
            ind = o["inductor"]
            print(f"| {r['model']} | {r['dtype']} | {o['output']} | {o['own'][0]:.2g} | {o['own'][1]:.2g} | "
                  f"{ind['tensor-wide'][0]:.2f}x, {ind['tensor-wide'][1]:.2f}x | {_verdict(ind['groups'])} | "
                  f"{_verdict(o['rounded']['groups'])} | "
                  f"{'-' if share is None else f'{share[0]:.1e}, {share[1]:.1e}'} | "
                  f"{r['reference_s']:.3f} / {r['forward_s']:.3f} | {o['check_ms'][0]:.1f}, {o['check_ms'][1]:.1f} |")
        if "no_reference" in r:
            print(f"| {r['model']} | {r['dtype']} | - | no reference: {r['no_reference']} |")
    wrong = [(f"{r['model']} {r['dtype']}, {label}", v) for r in rows for label, v in r.get("wrong", {}).items()]
    for label, v in wrong + [(f"cancelling, {k}", v) for k, v in cases.items()]:
        old = v["tensor-wide"]
        print(f"- {label}: groups {_verdict(v['groups'])}; tensor-wide {'kept' if old[0] else 'refused'} "
              f"({old[1]:.2g}x, {old[2]:.2g}x); fixed rule {'kept' if v['fixed'] else 'refused'}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json")
    args = parser.parse_args()
    torch.set_num_threads(1)
    rows = [study(name, make, dtype)
            for name, make in (("bert", bert), ("gpt2", gpt2), ("llama", llama), ("vit", vit), ("convnet", convnet))
            for dtype in (torch.float32, torch.bfloat16)]
    cases = cancelling()
    show(rows, cases)
    common.write_run(args.json, {"commit": common.commit(), "torch": torch.__version__, "models": rows,
                                 "cancelling": cases})


if __name__ == "__main__":
    main()
