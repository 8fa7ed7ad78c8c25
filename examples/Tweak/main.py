"""Tweak a four-layer transformer encoder: a dry run, the tweak, its table, a check, and a
save loaded into a freshly built encoder in a new process.

    python examples/Tweak/main.py            # on the GPU when there is one, else the CPU

The calls it tunes on: batches of 8 sequences on the GPU; on the CPU, single requests (batch 1),
as a service sends them. On a CPU of a few cores a batch of 8 is bound by the matrix products,
which every backend computes the same way, and no backend is much faster there; a single
request is where the framework's own overhead is a large part of the time, and tweak's gain
shows (`--batch 8` to see the other case).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import encoder  # noqa: E402

import torch_tweak as tt  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--max-depth", type=int, help="the deepest cut to try (default: tt.tweak's)")
    parser.add_argument("--time-budget", type=float, help="seconds; no new depth starts after it (default: none)")
    parser.add_argument("--busy-budget", type=float, default=120.0, metavar="SECONDS",
                        help="tt.tweak's busy_budget=: on a busy machine (others taking over a quarter of the "
                             "CPUs), the seconds tuning and its paired rounds may take (default %(default).0f); "
                             "when the result says busy_budget=N buys the rounds, pass --busy-budget N")
    parser.add_argument("--batch", type=int, help="sequences per call (default: 8 on the GPU, 1 on the CPU)")
    args = parser.parse_args()
    if args.batch is not None and args.batch < 1:
        parser.error(f"--batch must be 1 or more sequences per call, not {args.batch}")
    if not args.busy_budget >= 0:
        parser.error(f"--busy-budget must be 0 or more seconds, not {args.busy_budget}")
    batch = args.batch or (1 if args.device == "cpu" else 8)

    model = encoder.build(args.device)
    dataset = encoder.samples(args.device, batch=batch)
    with torch.no_grad():
        expected = [model(x) for x in dataset]

    print(f"torch-tweak {tt.__version__}, torch {torch.__version__}, device {args.device}, batch {batch}")
    print(tt.inspect(model, dataset))

    plan = tt.tweak(model, dataset, max_depth=None, dry_run=True, progress=False)
    print("\nDry run: modules each depth of the model would wrap")
    print(plan)

    depth = {} if args.max_depth is None else {"max_depth": args.max_depth}
    start = time.perf_counter()
    result = tt.tweak(model, dataset, time_budget=args.time_budget, busy_budget=args.busy_budget, **depth)
    print(f"\nTweak took {time.perf_counter() - start:.1f} s")
    print(result)
    if not result.kept:
        print("\nNothing kept, nothing saved: the model runs as it did")
        return 0
    print(f"\nKept depth {result.selected_depth}; the backend of each module it runs:")
    for path, module in result.modules.items():
        if module.kept:
            print(f"  {path or '(root)'}: {module.backend or 'original (' + module.error + ')'}")

    with torch.no_grad():
        got = [model(x) for x in dataset]
    worst = max(float((g - e).abs().max() / e.abs().max()) for g, e in zip(got, expected))
    print(f"\nTuned output against untuned: largest relative error {worst:.2e}")
    if worst > tt.TOLERANCES[torch.float32]:
        print("FAILED: the tuned model's output does not match the untuned one")
        return 1
    print("OK: the tuned model's output matches the untuned one")
    return check_saved(model, dataset, args.device)


LOAD_AND_RUN = """
import sys, torch
sys.path.insert(0, sys.argv[1])
import encoder, torch_tweak as tt
from safetensors.torch import load_file, save_file
model = encoder.build(sys.argv[2])                    # freshly built: same seed, same weights
loaded = tt.load(model, sys.argv[3])
print("  loaded:", dict(loaded))
print(" ", loaded.summary())                          # what the load cost and what it built again
inputs = load_file(sys.argv[4], device=sys.argv[2])
with torch.no_grad():
    outputs = {k: model(x) for k, x in inputs.items()}
save_file({k: v.cpu() for k, v in outputs.items()}, sys.argv[5])
"""


def check_saved(model: torch.nn.Module, dataset: list, device: str) -> int:
    """Saves the tuned model, loads it into a freshly built one in a new process, compares outputs."""
    from safetensors.torch import load_file, save_file

    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, "encoder.tt")
        tt.save(model, path)
        print(f"\nSaved the tuned model ({os.path.getsize(path) / 1e6:.1f} MB); loading it in a new process")
        inputs, outputs = os.path.join(folder, "in.safetensors"), os.path.join(folder, "out.safetensors")
        save_file({f"x{i}": x.cpu() for i, x in enumerate(dataset)}, inputs)
        here = os.path.dirname(os.path.abspath(__file__))
        subprocess.run([sys.executable, "-c", LOAD_AND_RUN, here, device, path, inputs, outputs], check=True)
        loaded = load_file(outputs)
    with torch.no_grad():
        tuned = [model(x).cpu() for x in dataset]
    worst = max(float((loaded[f"x{i}"] - t).abs().max() / t.abs().max()) for i, t in enumerate(tuned))
    print(f"Loaded in a new process against tuned: largest relative error {worst:.2e}")
    if worst > tt.TOLERANCES[torch.float32]:
        print("FAILED: the loaded model's output does not match the tuned one")
        return 1
    print("OK: the loaded model's output matches the tuned one")
    return 0


if __name__ == "__main__":
    sys.exit(main())
