"""The C twin of tests/test_layers.py, checked from the sources: every file of the extension
(src/ext) has its place in the written order at the top of src/ext/common.h, no file includes
the header of a file below it in that order, and no C function of the extension or the engine
is over MAX_FUNCTION_LINES (80) lines. Each rule is a function of the text it reads, checked
on a made-up tree first (so the scan can fail) and then on the real one."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
EXT = ROOT / "src" / "ext"
ENGINE = ROOT / "engine"
MAX_FUNCTION_LINES = 80


# ---------------------------------------------------------------- the written order


def written_order(common_h: str) -> list[tuple[str, str]]:
    """The order's entries, from the bottom up: (file stem, the entry's text with its
    continuation lines), read from the list that follows the paragraph starting 'The files of
    the extension' and ends at the line starting 'Every name'."""
    block = common_h.split("The files of the extension", 1)[1].split(" * Every name", 1)[0]
    listing = block.split("\n *\n", 1)[1]  # past the introduction's paragraph
    entries: list[tuple[str, str]] = []
    for line in listing.splitlines():
        entry = re.match(r"^ \* ([a-z_]+)(\s.*)?$", line)
        if entry:
            entries.append((entry.group(1), (entry.group(2) or "").strip()))
        elif entries and line.startswith(" *   "):
            stem, text = entries[-1]
            entries[-1] = (stem, text + " " + line[2:].strip())
    return entries


def ranks(order: list[tuple[str, str]]) -> dict[str, int]:
    """The place of each file and header: a stem's .c and .h at its entry; a private header
    (no file of its own) at the first entry that names it."""
    place: dict[str, int] = {}
    for i, (stem, text) in enumerate(order):
        place.setdefault(f"{stem}.c", i)
        place.setdefault(f"{stem}.h", i)
        for header in re.findall(r"\b([a-z_]+\.h)\b", text):
            if header.removesuffix(".h") not in {s for s, _ in order}:
                place.setdefault(header, i)
    return place


def order_problems(order: list[tuple[str, str]], files: dict[str, str]) -> list[str]:
    """What breaks the order, for `files` (name -> text of every .c and .h of the extension):
    a file the order does not name, an entry with no file, a stem named twice, a header of
    ours that has no place, a file that includes the header of a file below it."""
    stems = [stem for stem, _ in order]
    problems = [f"{stem} is named twice in the order" for stem in sorted(set(stems)) if stems.count(stem) > 1]
    sources = {name.removesuffix(".c") for name in files if name.endswith(".c")}
    problems += [f"{name}.c has no place in the order" for name in sorted(sources - set(stems))]
    problems += [f"the order names {stem}, which has no .c file" for stem in stems if stem not in sources]
    place = ranks(order)
    problems += [f"{name} has no place in the order" for name in sorted(files)
                 if name.endswith(".h") and name not in place]
    for name, text in sorted(files.items()):
        for header in re.findall(r'^\s*#\s*include\s+"([^"]+)"', text, re.M):
            if header not in files or name not in place or header not in place:
                continue  # the engine's tweak.h, or a file reported above
            if place[header] > place[name]:
                problems.append(f"{name} includes {header}, which is below it in the order")
    return problems


def extension_files() -> dict[str, str]:
    return {path.name: path.read_text() for path in sorted(EXT.iterdir()) if path.suffix in (".c", ".h")}


def test_the_order_check_finds_what_breaks_it():
    order = [("common", "macros"), ("low", "the low one (low.h); shares the private low_private.h"),
             ("high", "the high one (high.h)")]
    good = {"common.c": "", "common.h": "", "low.c": '#include "low_private.h"\n#include "common.h"',
            "low.h": '#include "common.h"', "low_private.h": '#include "low.h"',
            "high.c": '#include "high.h"\n#include "low.h"\n#include <Python.h>', "high.h": ""}
    assert order_problems(order, good) == []
    missing = dict(good, **{"extra.c": ""})
    assert order_problems(order, missing) == ["extra.c has no place in the order"]
    upward = dict(good, **{"low.c": '#include "high.h"'})
    assert order_problems(order, upward) == ["low.c includes high.h, which is below it in the order"]
    stray = dict(good, **{"stray.h": ""})
    assert order_problems(order, stray) == ["stray.h has no place in the order"]
    assert order_problems(order[:2], good) == ["high.c has no place in the order", "high.h has no place in the order"]


def test_every_file_has_its_place_and_includes_only_files_above_it():
    order = written_order((EXT / "common.h").read_text())
    stems = [stem for stem, _ in order]
    assert stems[0] == "common" and stems[-1] == "module"  # the list was read at all
    assert "steps" in stems and "dispatcher" in stems
    assert order_problems(order, extension_files()) == []


# ---------------------------------------------------------------- function lengths


def c_functions(text: str) -> list[tuple[str, int]]:
    """(name, lines) of each function defined in C source `text`, its signature (from the
    first line after a blank line, a comment or a preprocessor line) to its closing brace; in
    this code base a function's body opens with '{' at the start of a line and closes with
    '}' at the start of a line, and nothing else does."""
    lines = text.splitlines()
    out = []
    start = None
    for i, line in enumerate(lines):
        if line.startswith("{") and start is None:
            j = i
            while j > 0 and lines[j - 1].strip() and not lines[j - 1].rstrip().endswith(("*/", ";", "}")) \
                    and not lines[j - 1].lstrip().startswith(("#", "/*", "*", "//")):
                j -= 1
            names = re.findall(r"(\w+)\s*\(", "\n".join(lines[j:i]))
            start = (j, names[0] if names else "?")
        elif line.startswith("}") and start is not None:
            out.append((start[1], i - start[0] + 1))
            start = None
    return out


def long_functions(paths: list[Path], limit: int = MAX_FUNCTION_LINES) -> list[str]:
    return sorted(f"{path.relative_to(ROOT)}: {name} ({n} lines)" for path in paths
                  for name, n in c_functions(path.read_text()) if n > limit)


def c_sources() -> list[Path]:
    return sorted([*EXT.glob("*.c"), *EXT.glob("*.h"), *(ENGINE / "src").glob("*.[ch]"),
                   *(ENGINE / "include").glob("*.h")])


def test_the_function_scan_measures_functions():
    text = "/* a comment */\nstatic int\nf(int a,\n  int b)\n{\n" + "    a++;\n" * 5 + "    return a;\n}\n" \
           "\ntypedef struct { int x; } T;\nstatic const int table[] = {\n    1,\n};\nvoid g(void)\n{\n}\n"
    assert c_functions(text) == [("f", 11), ("g", 3)]


def test_no_c_function_is_longer_than_80_lines():
    paths = c_sources()
    assert long_functions(paths, 10**6) == [] and long_functions(paths, 3) != []  # the scan sees functions
    assert long_functions(paths) == []
