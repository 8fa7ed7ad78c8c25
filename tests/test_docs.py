"""Every Python snippet of the README and docs/ runs as written on the CPU, so the docs cannot rot.

Each snippet runs alone, in a namespace of its own, as a reader pastes it; and the snippets
of one file run in order in one namespace, as a reader follows the page. A snippet that
continues the one before it (it uses what that one built, and the page says so) is marked
with the line `<!-- snippet: continues -->` just above it and runs only in order. A snippet
that needs hardware CI lacks is marked `<!-- snippet: needs cuda -->` and runs only where
that device exists; an outline that names objects the reader brings (`model`, `dataset`) is
marked `<!-- snippet: outline -->` and is only compiled.
"""

from __future__ import annotations

import os
import re
import sys
import types

import pytest
import torch

pytestmark = pytest.mark.slow  # every snippet runs a tweak or a compile: minutes in all

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


MARKERS = (None, "outline", "needs cuda", "continues")


def _namespace(tmp_path, monkeypatch) -> dict:
    """A fresh namespace in a fresh folder, with its own torch-tweak cache: a reader's session."""
    monkeypatch.chdir(tmp_path)  # snippets that write files write them here
    monkeypatch.setenv("TORCH_TWEAK_CACHE", str(tmp_path / "cache"))
    module = types.ModuleType("doc_snippet")  # a real module: dataclasses in a snippet look it up
    monkeypatch.setitem(sys.modules, module.__name__, module)
    return module.__dict__


def _run(path: str, i: int, code: str, namespace: dict, how: str) -> None:
    try:
        exec(compile(code, f"{path} snippet {i + 1}", "exec"), namespace)
    except Exception as exc:
        raise AssertionError(f"{path}, snippet {i + 1} failed {how}: {type(exc).__name__}: {exc}\n{code}") from exc


@pytest.mark.parametrize("path", FILES)
def test_snippets_run(path, tmp_path, monkeypatch):
    blocks = snippets(path)
    if not blocks:
        pytest.skip(f"{path} has no Python snippet")
    namespace = _namespace(tmp_path, monkeypatch)
    for i, (needs, code) in enumerate(blocks):
        assert needs in MARKERS, f"{path}: unknown snippet marker {needs!r}"
        assert not (needs == "continues" and i == 0), f"{path}: its first snippet continues nothing"
        if needs == "outline":
            compile(code, f"{path} snippet {i + 1}", "exec")
            continue
        if needs == "needs cuda" and not torch.cuda.is_available():
            continue
        _run(path, i, code, namespace, "in order")


ALONE = [pytest.param(path, i, id=f"{path}-{i + 1}") for path in FILES
         for i, (needs, _) in enumerate(snippets(path)) if needs in (None, "needs cuda") and i > 0]
"""Each snippet but a page's first: the first already runs alone, in the fresh namespace that
test_snippets_run starts each page with (running it twice would only double a tweak)."""


@pytest.mark.parametrize("path, i", ALONE)
def test_each_snippet_runs_alone(path, i, tmp_path, monkeypatch):
    """As a reader pastes it into a fresh interpreter: every import it needs is in it."""
    needs, code = snippets(path)[i]
    if needs == "needs cuda" and not torch.cuda.is_available():
        pytest.skip("needs cuda")
    _run(path, i, code, _namespace(tmp_path, monkeypatch), "alone")
