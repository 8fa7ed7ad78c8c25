"""The measured correctness rule on real models: how far the original is from a higher-precision
run of itself, how far the candidates tweak builds are, and whether float32 is a sound reference
for a bfloat16 model.

For each model (transformers BERT and Llama, a small convolution net, each with random weights,
float32 and bfloat16, on this machine's CPU) and each output tensor, the study prints:

    own        the original's error against the reference (rms, peak: correctness.deviation)
    inductor   torch.compile's, as a multiple of the original's (rms, peak)
    rounded    the module run at float32 and rounded back once, as a multiple
    f32 vs f64 (bfloat16 rows) the float32 reference's own error against a float64 run, as a
               share of the original's: how much of the original's error the reference
               itself could hide
    ref s      the reference's time (all recorded calls) against one forward of the original

and then two wrong candidates per model and dtype (the attention mask dropped, positions
shifted by one; BERT only), with the verdict of the measured rule and of the old fixed rule.

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


def bert(dtype: torch.dtype):
    import transformers
    cfg = transformers.BertConfig(hidden_size=128, num_hidden_layers=4, num_attention_heads=4, intermediate_size=512,
                                  vocab_size=1000)
    model = transformers.BertModel(cfg).eval().to(dtype)
    ids = torch.randint(0, 1000, (4, 64), generator=torch.Generator().manual_seed(1))
    mask = torch.ones(4, 64, dtype=torch.long)
    mask[1, 40:] = 0
    return model, [((), {"input_ids": ids, "attention_mask": mask, "return_dict": False})]


def llama(dtype: torch.dtype):
    import transformers
    cfg = transformers.LlamaConfig(hidden_size=128, intermediate_size=384, num_hidden_layers=3, num_attention_heads=4,
                                   num_key_value_heads=2, vocab_size=2000)
    model = transformers.LlamaForCausalLM(cfg).eval().to(dtype)
    ids = torch.randint(0, 2000, (2, 48), generator=torch.Generator().manual_seed(1))
    return model, [((ids,), {"use_cache": False, "return_dict": False})]


def convnet(dtype: torch.dtype):
    model = nn.Sequential(nn.Conv2d(3, 32, 3, padding=1), nn.BatchNorm2d(32), nn.ReLU(), nn.Conv2d(32, 64, 3, stride=2),
                          nn.BatchNorm2d(64), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(64, 10))
    for m in model.modules():
        if isinstance(m, nn.BatchNorm2d):
            m.running_mean.uniform_(-1, 1)
            m.running_var.uniform_(0.5, 2)
    model = model.eval().to(dtype)
    return model, [((torch.randn(8, 3, 32, 32, generator=torch.Generator().manual_seed(1)).to(dtype),), {})]


def verdict(got, out, high, fixed: bool) -> str:
    try:
        found = C.check(got, out, tolerance=C.TOLERANCES[C.tensor_leaves(out)[0].dtype] if fixed else None, high=high)
        return "kept (" + C.describe_finding(found) + ")"
    except C.MismatchError as exc:
        return "refused (" + str(exc).split(": ", 1)[-1][:60] + ")"


def study(name: str, make, dtype: torch.dtype) -> dict:
    torch.manual_seed(0)
    model, calls = make(dtype)
    row: dict = {"model": name, "dtype": str(dtype).replace("torch.", ""), "outputs": []}
    with torch.no_grad():
        start = time.perf_counter()
        outs = [model(*a, **k) for a, k in calls]
        forward_s = time.perf_counter() - start
        ref = C.reference(model, calls, outs)
        row["reference_s"], row["forward_s"] = ref.seconds, forward_s
        compiled = torch.compile(model)
        ind = [compiled(*a, **k) for a, k in calls]
        wide = copy.deepcopy(model).float()
        rounded = []
        for a, k in calls:  # the module at float32, its outputs rounded back once
            wide_a, wide_k = C._cast((a, k), torch.float32, torch.device("cpu"), {})
            rounded.append([t.to(dtype) if t.is_floating_point() else t
                            for t in C.tensor_leaves(wide(*wide_a, **wide_k))])
        if dtype != torch.float32:
            saved = C.REFERENCE_DTYPES[dtype]
            C.REFERENCE_DTYPES[dtype] = torch.float64
            ref64 = C.reference(model, calls, outs)
            C.REFERENCE_DTYPES[dtype] = saved
        for j, (o, h) in enumerate(zip(C.tensor_leaves(outs[0]), ref.outputs[0])):
            if h is None:
                continue
            own = C.deviation(o, h)
            cand = C.deviation(C.tensor_leaves(ind[0])[j], h)
            rnd = C.deviation(rounded[0][j], h)
            entry = {"output": j, "own": own, "inductor": [c / o if o else None for c, o in zip(cand, own)],
                     "rounded": [c / o if o else None for c, o in zip(rnd, own)]}
            if dtype != torch.float32:
                hd = C.deviation(h, ref64.outputs[0][j])
                entry["f32_vs_f64_share"] = [a / b if b else None for a, b in zip(hd, own)]
            row["outputs"].append(entry)
        if name == "bert":
            a, k = calls[0]
            wrong = {"mask dropped": dict(k, attention_mask=None),
                     "positions +1": dict(k, position_ids=torch.arange(1, 65).expand(4, 64))}
            row["wrong"] = {label: {"measured": verdict(model(*a, **kw), outs[0], ref.outputs[0], False),
                                    "fixed": verdict(model(*a, **kw), outs[0], None, True)}
                            for label, kw in wrong.items()}
    return row


def show(rows: list[dict]) -> None:
    print("| model | dtype | output | own rms | own peak | Inductor (rms, peak) | rounded (rms, peak) | "
          "f32 ref's share of own | ref s / forward s |")
    print("|---|---|---:|---:|---:|---|---|---|---|")
    for r in rows:
        for o in r["outputs"]:
            share = o.get("f32_vs_f64_share")
            print(f"| {r['model']} | {r['dtype']} | {o['output']} | {o['own'][0]:.2g} | {o['own'][1]:.2g} | "
                  f"{o['inductor'][0]:.2f}x, {o['inductor'][1]:.2f}x | {o['rounded'][0]:.2f}x, {o['rounded'][1]:.2f}x"
                  f" | {'-' if share is None else f'{share[0]:.1e}, {share[1]:.1e}'} | "
                  f"{r['reference_s']:.3f} / {r['forward_s']:.3f} |")
    for r in rows:
        for label, v in r.get("wrong", {}).items():
            print(f"- {r['model']} {r['dtype']}, {label}: measured rule {v['measured']}; fixed rule {v['fixed']}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json")
    args = parser.parse_args()
    torch.set_num_threads(1)
    rows = [study(name, make, dtype) for name, make in (("bert", bert), ("llama", llama), ("convnet", convnet))
            for dtype in (torch.float32, torch.bfloat16)]
    show(rows)
    common.write_run(args.json, rows)


if __name__ == "__main__":
    main()
