"""Every numeric knob lives in one module, torch_tweak._core.settings (tt.settings), with its
unit and why; docs/settings.md is written from it (`python tests/test_settings.py` writes it
again); no other module of the package defines a numeric constant but the format and
protocol numbers named here; code reads ``settings.NAME`` where it uses the knob, so a value
set at run time is seen."""

from __future__ import annotations

import ast
import io
import re
import textwrap
import tokenize
from pathlib import Path

import torch_tweak as tt
from torch_tweak._core import settings

PACKAGE = Path(tt.__file__).parent
SOURCE = Path(settings.__file__)
DOCS = Path(__file__).resolve().parents[1] / "docs" / "settings.md"

ALLOWED = {
    "_store/checkpoint.py": {"VERSION": "the file format tt.save writes", "READABLE": "the formats tt.load reads"},
    "_store/tuning_cache.py": {"ENTRY_VERSION": "the format of a cache entry: an older one is a miss"},
    "_search/verdicts.py": {"VERSION": "the format of a stored verdict"},
    "_store/archive.py": {"_MAX_COMMENT": "the zip format's own bound (a comment's length is 16 bits)"},
    "_core/cpu_load.py": {"_BUSY_FIELDS": "which fields of /proc/stat's cpu line are busy time: the kernel's format"},
    "_core/storage.py": {"KEY_BYTES": "the seal key file's length: a file of another length is not a key we wrote"},
    "_search/isolation.py": {"PR_SET_PDEATHSIG": "Linux's prctl option number"},
    "cli.py": {"EXIT_USAGE": "the command's exit status for a usage mistake (the shell's convention)"},
}
"""The numeric module-level constants allowed outside settings: file format versions and protocol
numbers. Changing one is not tuning a knob: it changes what a file or the kernel means."""

CONSTANT = re.compile(r"^_?[A-Z][A-Z0-9_]*$")
GROUP = re.compile(r"^# == (.+) ==$")


def _numeric(node: ast.AST) -> bool:
    """A number, an expression of numbers, a tuple of them, a dict of them, or float()/int() of anything."""
    if isinstance(node, ast.Constant):
        return isinstance(node.value, (int, float)) and not isinstance(node.value, bool)
    if isinstance(node, ast.UnaryOp):
        return _numeric(node.operand)
    if isinstance(node, ast.BinOp):
        return _numeric(node.left) and _numeric(node.right)
    if isinstance(node, ast.Tuple):
        return bool(node.elts) and all(_numeric(e) for e in node.elts)
    if isinstance(node, ast.Dict):
        return bool(node.values) and all(_numeric(v) for v in node.values)
    return isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("float", "int")


def _assignments(tree: ast.Module) -> list[tuple[int, str, ast.AST, str | None]]:
    """(line, name, value, the docstring under it) of each module-level assignment to one name."""
    out = []
    for i, st in enumerate(tree.body):
        if isinstance(st, ast.Assign) and len(st.targets) == 1 and isinstance(st.targets[0], ast.Name):
            name, value = st.targets[0].id, st.value
        elif isinstance(st, ast.AnnAssign) and isinstance(st.target, ast.Name) and st.value is not None:
            name, value = st.target.id, st.value
        else:
            continue
        after = tree.body[i + 1] if i + 1 < len(tree.body) else None
        doc = (after.value.value if isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant)
               and isinstance(after.value.value, str) else None)
        out.append((st.lineno, name, value, doc))
    return out


def numeric_constants(source: str) -> set[str]:
    return {name for _, name, value, _ in _assignments(ast.parse(source)) if CONSTANT.match(name) and _numeric(value)}


def knobs() -> list[dict]:
    """Each setting of settings.py in order: its group, name, value as written, unit and why."""
    text = SOURCE.read_text()
    comments = {tok.start[0]: tok.string for tok in tokenize.generate_tokens(io.StringIO(text).readline)
                if tok.type == tokenize.COMMENT}
    groups = sorted((line, m.group(1)) for line, c in comments.items() if (m := GROUP.match(c)))
    out = []
    for line, name, value, doc in _assignments(ast.parse(text)):
        group = [g for at, g in groups if at < line]
        unit = comments.get(line, "").lstrip("# ").strip()
        out.append({"group": group[-1] if group else None, "name": name, "value": ast.unparse(value),
                    "unit": unit, "why": " ".join(textwrap.dedent(doc or "").split())})
    return out


INTRO = """\
# Settings

```python
import torch_tweak as tt

print(tt.settings.MULTIPLIER)            # 4.0: the measured rule's bound, in times the original's own error
before = tt.settings.REFERENCE_SECONDS
tt.settings.REFERENCE_SECONDS = 120.0    # a signature's higher-precision reference may now take two minutes
tt.settings.REFERENCE_SECONDS = before   # as it was
```

Every number torch-tweak decides by (a bound, a limit, a multiple, a time) is a setting of
`tt.settings`, listed here with its value, its unit and why it is what it is. Each is read
where it is used, so a value set in a process is seen by the next tweak, check, load or call
that uses it. The values are the ones measured or reasoned for: change one to trade what its
text says, not to make a tweak pass. The tolerances are also `tt.TOLERANCES` (the same dict), and
the only settings in the tuning cache's key; no setting is written into a saved file.

This page is written from `src/torch_tweak/_core/settings.py` (`python tests/test_settings.py`
writes it again; a test fails when the two differ).
"""


def page() -> str:
    lines = [INTRO.rstrip("\n")]
    group = None
    for k in knobs():
        if k["group"] != group:
            group = k["group"]
            lines.append(f"\n## {group}\n")
        lines.append(f"- **`{k['name']}`** = `{k['value']}` ({k['unit']}): {k['why']}")
    return "\n".join(lines) + "\n"


def test_every_setting_has_a_group_a_unit_and_why():
    found = knobs()
    assert len(found) > 40
    for k in found:
        assert k["group"] and k["unit"] and len(k["why"]) > 20, k
        assert CONSTANT.match(k["name"]) and not k["name"].startswith("_"), k
        assert hasattr(settings, k["name"])
    assert len({k["name"] for k in found}) == len(found)
    source = ast.parse(SOURCE.read_text())
    assert {n for _, n, _, _ in _assignments(source)} == {k["name"] for k in found}


def test_the_docs_page_is_the_settings_module():
    assert DOCS.read_text() == page(), "docs/settings.md differs from settings.py: python tests/test_settings.py"


def test_the_scan_finds_numeric_constants():
    source = ("A = 1\nB: int = 2 << 3\nC = (1, 2)\nD = {'x': 1.0}\nE = float('6')\nF = 'text'\n"
              "G = (None, 1)\n_H = -1\nstate = 0\nI = True\n")
    assert numeric_constants(source) == {"A", "B", "C", "D", "E", "_H"}


def test_no_numeric_constant_outside_settings_but_the_named_ones():
    wrong = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        where = path.relative_to(PACKAGE).as_posix()
        if where == "_core/settings.py":
            continue
        found = numeric_constants(path.read_text())
        extra = found - set(ALLOWED.get(where, {}))
        if extra:
            wrong[where] = sorted(extra)
    assert not wrong, f"numeric knobs outside torch_tweak/_core/settings.py (move them there): {wrong}"
    for where, names in ALLOWED.items():  # the allowances name what is there, nothing more
        assert set(names) <= numeric_constants((PACKAGE / where).read_text()), where


def test_settings_are_read_where_they_are_used():
    """Never ``from settings import NAME`` (a value set at run time would not be seen); every
    ``settings.NAME`` the package reads exists; every setting is read somewhere."""
    read: set[str] = set()
    for path in sorted(PACKAGE.rglob("*.py")):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and (node.module or "").endswith("settings"):
                raise AssertionError(f"{path.relative_to(PACKAGE)}: imports names from settings; read settings.NAME")
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "settings" \
                    and CONSTANT.match(node.attr):  # not a local dict named settings (tt.tweak's arguments)
                read.add(node.attr)
                assert hasattr(settings, node.attr), f"{path.relative_to(PACKAGE)}: settings.{node.attr}"
    assert {k["name"] for k in knobs()} <= read
    assert tt.settings is settings and tt.TOLERANCES is settings.TOLERANCES


if __name__ == "__main__":
    DOCS.write_text(page())
