"""Files whose numbers would take tt.load past its bounds, and the child process that loads them.

tests/test_forged_files.py makes a genuine file of each model kind here (in its own process),
forges one or two numbers of it, then runs ``python bounded_load.py KIND:PATH ...``: a child
under a memory limit that loads each file into a fresh model of its kind and prints one JSON
line per file (what tt.load did, how long it took, whether the model answers as an untuned
one), so that a file that hangs or eats memory is caught by the parent's time bound.

Models: "table", masked self-attention over token and position embeddings (a position table
of POSITIONS rows); "free", the same attention with no position table (only the stated
growth bound holds it); "mlp", a small MLP for ONNX Runtime."""

from __future__ import annotations

import json
import math
import random
import sys
import time
import warnings

import torch
from torch import nn

POSITIONS = 64
MEMORY_LIMIT = 8 << 30  # the child's address space: a million-position attention fails fast instead of swapping


class Attend(nn.Module):
    """One head of self-attention over the valid positions (a mask of zeros hides padding);
    quadratic in the length, as a transformer's attention is."""

    def __init__(self, table: bool) -> None:
        super().__init__()
        self.embed = nn.Embedding(50, 16)
        self.position_embeddings = nn.Embedding(POSITIONS, 16) if table else None
        self.proj = nn.Linear(16, 16)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        h = self.embed(input_ids)
        if self.position_embeddings is not None:
            h = h + self.position_embeddings(torch.arange(input_ids.shape[1], device=input_ids.device))
        scores = h @ h.transpose(1, 2) / math.sqrt(16)
        scores = scores.masked_fill(attention_mask[:, None, :] == 0, float("-inf"))
        return self.proj(torch.softmax(scores, -1) @ h)


def build(kind: str) -> nn.Module:
    torch.manual_seed(0)
    if kind == "mlp":
        return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4)).eval()
    return Attend(table=kind == "table").eval()


def calls(kind: str, n: int = 4, seed: int = 0) -> list:
    """Calls of the model: batches of 8 rows for the MLP; requests of 2 or 3 rows of 10 to 20
    valid positions for the attention models."""
    g = torch.Generator().manual_seed(seed)
    if kind == "mlp":
        return [((torch.randn(8, 16, generator=g),), {}) for _ in range(n)]
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        rows = [rng.randrange(10, 21) for _ in range(rng.choice((2, 3)))]
        ids = torch.randint(1, 50, (len(rows), max(rows)), generator=g)
        mask = torch.zeros(len(rows), max(rows), dtype=torch.long)
        for r, length in enumerate(rows):
            mask[r, :length] = 1
        out.append(((), {"input_ids": ids * mask, "attention_mask": mask}))
    return out


def answers(model: nn.Module, untuned: nn.Module, kind: str) -> bool:
    """Whether the model answers fresh calls as the untuned one (valid positions only)."""
    with torch.no_grad():
        for args, kwargs in calls(kind, 3, seed=7):
            got, want = model(*args, **kwargs), untuned(*args, **kwargs)
            if kind != "mlp":
                keep = kwargs["attention_mask"].bool()
                got, want = got[keep], want[keep]
            if not torch.allclose(got, want, rtol=1e-4, atol=1e-5):
                return False
    return True


def load_one(kind: str, path: str) -> dict:
    import torch_tweak as tt

    model, untuned = build(kind), build(kind)
    start = time.monotonic()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            loaded = tt.load(model, path)
    except tt.CheckpointError as exc:
        return {"outcome": "error", "message": str(exc), "seconds": time.monotonic() - start,
                "unchanged": not tt.installed(model) and answers(model, untuned, kind)}
    except Exception as exc:  # anything else is a finding
        return {"outcome": f"raised {type(exc).__name__}", "message": str(exc)[:500],
                "seconds": time.monotonic() - start}
    seconds = time.monotonic() - start
    return {"outcome": "loaded", "backends": sorted({str(b) for b in loaded.values()}), "seconds": seconds,
            "same": answers(model, untuned, kind)}


def main() -> None:
    import resource

    import bounded_load  # the models by the name they were saved under, not __main__'s

    resource.setrlimit(resource.RLIMIT_AS, (MEMORY_LIMIT, MEMORY_LIMIT))
    torch.set_num_threads(1)
    for item in sys.argv[1:]:
        kind, _, path = item.partition(":")
        print(json.dumps({"start": path}), flush=True)
        print(json.dumps({"path": path, **bounded_load.load_one(kind, path)}), flush=True)


if __name__ == "__main__":
    main()
