"""Every Python snippet of the README and docs/ runs as written on the CPU, so the docs cannot rot.

The snippets of one file run in order in one namespace (a later snippet may use what an
earlier one built). A snippet that needs hardware CI lacks is marked with the line
`<!-- snippet: needs cuda -->` just above it, and runs only where that device exists; an
outline that names objects the reader brings (`model`, `dataset`) is marked
`<!-- snippet: outline -->` and is only compiled.
"""

from __future__ import annotations

import os
import re
import sys
import types

import pytest
import torch

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
BLOCK = re.compile(r"(?:<!-- snippet: (?P<needs>[\w ]+) -->\s*\n)?```python\n(?P<code>.*?)```", re.S)
FILES = ["README.md"] + sorted(os.path.join("docs", f) for f in os.listdir(os.path.join(ROOT, "docs"))
                               if f.endswith(".md"))


def snippets(path: str) -> list[tuple[str | None, str]]:
    with open(os.path.join(ROOT, path), encoding="utf-8") as f:
        return [(m["needs"], m["code"]) for m in BLOCK.finditer(f.read())]


def test_every_guide_opens_with_a_snippet():
    for path in FILES:
        if path.startswith("docs"):
            with open(os.path.join(ROOT, path), encoding="utf-8") as f:
                text = f.read()
            first_block = text.find("```")
            assert first_block >= 0 and text[first_block:].startswith("```python"), path
            assert text.count("\n", 0, first_block) < 6, f"{path}: the runnable snippet should come first"


@pytest.mark.parametrize("path", FILES)
def test_snippets_run(path, tmp_path, monkeypatch):
    blocks = snippets(path)
    if not blocks:
        pytest.skip(f"{path} has no Python snippet")
    monkeypatch.chdir(tmp_path)  # snippets that write files write them here
    monkeypatch.setenv("TORCH_TWEAK_CACHE", str(tmp_path / "cache"))
    module = types.ModuleType("doc_snippet")  # a real module: dataclasses in a snippet look it up
    monkeypatch.setitem(sys.modules, module.__name__, module)
    namespace = module.__dict__
    for i, (needs, code) in enumerate(blocks):
        if needs == "outline":
            compile(code, f"{path} snippet {i + 1}", "exec")
            continue
        if needs == "needs cuda" and not torch.cuda.is_available():
            continue
        assert needs is None, f"{path}: unknown snippet marker {needs!r}"
        try:
            exec(compile(code, f"{path} snippet {i + 1}", "exec"), namespace)
        except Exception as exc:
            raise AssertionError(f"{path}, snippet {i + 1} failed: {type(exc).__name__}: {exc}\n{code}") from exc
