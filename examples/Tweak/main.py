"""Tweak a four-layer transformer encoder: a dry run, the tweak, its table, and a check.

    python examples/Tweak/main.py            # on the GPU when there is one, else the CPU
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import encoder  # noqa: E402

import torch_tweak as tt  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--max-depth", type=int, default=2)
    args = parser.parse_args()

    model = encoder.build(args.device)
    dataset = encoder.samples(args.device)
    with torch.no_grad():
        expected = [model(x) for x in dataset]

    print(f"torch-tweak {tt.__version__}, torch {torch.__version__}, device {args.device}")
    print(tt.inspect(model, dataset))

    plan = tt.tweak(model, dataset, max_depth=args.max_depth, dry_run=True, progress=False)
    print("\nDry run: modules each depth would wrap")
    print(plan)

    start = time.perf_counter()
    result = tt.tweak(model, dataset, max_depth=args.max_depth)
    print(f"\nTweak took {time.perf_counter() - start:.1f} s")
    print(result)
    for path, module in result.modules.items():
        print(f"  {path or '(root)'}: {module.backend or 'original (' + module.error + ')'}")

    with torch.no_grad():
        got = [model(x) for x in dataset]
    worst = max(float((g - e).abs().max() / e.abs().max()) for g, e in zip(got, expected))
    print(f"\nTuned output against untuned: largest relative error {worst:.2e}")
    if worst > tt.TOLERANCES[torch.float32]:
        print("FAILED: the tuned model's output does not match the untuned one")
        return 1
    print("OK: the tuned model's output matches the untuned one")
    return 0


if __name__ == "__main__":
    sys.exit(main())
