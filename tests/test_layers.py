"""The package's shape, checked from its source with ast: no import circle among its modules
(function-level imports included), no module importing one above it in ARCHITECTURE.md's order,
every module importable on its own in a fresh interpreter, generic modules naming no concrete
backend, and no function over MAX_FUNCTION_LINES (80) lines."""

from __future__ import annotations

import ast
import re
import os
import subprocess
import sys
from pathlib import Path

import pytest

import torch
import torch_tweak
import torch_tweak.backends as tt_backends

PACKAGE = Path(torch_tweak.__file__).parent
ARCHITECTURE = Path(__file__).resolve().parents[1] / "ARCHITECTURE.md"


def modules() -> dict[str, Path]:
    """Dotted name -> source file of every module of the package."""
    out = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def imports(name: str, path: Path, known: set[str]) -> set[str]:
    """The package's modules `name` imports anywhere in its file (module level, functions,
    TYPE_CHECKING blocks): `from .x import y` counts as x.y when that is a module, else x."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[:len(base) - (node.level - 1)]
                stem = ".".join(base + ([node.module] if node.module else []))
            else:
                stem = node.module or ""
            targets = [f"{stem}.{alias.name}" if f"{stem}.{alias.name}" in known else stem for alias in node.names]
        else:
            continue
        for target in targets:
            while target and target not in known:
                target = target.rpartition(".")[0]
            if target and target != name:
                found.add(target)
    return found


def graph() -> dict[str, set[str]]:
    found = modules()
    # torch_tweak._C: its build (installed) or its stubs (an editable install runs the sources)
    native = {f"{PACKAGE.name}.{path.name.split('.')[0]}" for pattern in ("*.so", "*.pyd", "*.pyi")
              for path in PACKAGE.glob(pattern)}
    edges = {name: imports(name, path, set(found) | native) for name, path in found.items()}
    for name, path in found.items():  # a package that imports its modules by discovery (backends/)
        if path.name == "__init__.py" and "pkgutil.iter_modules" in path.read_text():
            edges[name] |= {m for m in found if m.rpartition(".")[0] == name} - {name}
    return edges


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Every strongly connected group of more than one module (Tarjan), sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    groups = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(edges.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                groups.append(sorted(group))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return sorted(groups)


def test_the_scan_finds_a_circle_and_the_package_has_none():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]  # the scan itself
    edges = graph()
    assert "torch_tweak.backends.base" in edges["torch_tweak.backends.eager"]
    # the package face re-exports everything: a module importing it (for __version__, say) closes a circle
    assert cycles(edges) == []


def package_order(text: str) -> list[str]:
    """A package's own written order, from the bottom up, read from its __init__.py: the entries
    of the indented list that follows the sentence with "from the bottom up" in its docstring
    (a module's name, then what it holds; continuation lines further in), up to the first line
    that is neither."""
    block = text.split("from the bottom up", 1)[1]
    names: list[str] = []
    for line in block.split("\n\n", 1)[1].splitlines():
        entry = re.match(r"^    ([a-z_]+)  +\S", line)
        if entry:
            names.append(entry.group(1))
        elif not (names and re.match(r"^      +\S", line)):
            break
    return names


def written_order() -> list[str]:
    """The modules in ARCHITECTURE.md's order of the Python package, from the bottom up
    (`backends/*`: every backend's file, the modules of backends/ the order does not name, each
    after the backend files it imports; another `folder/*`: that package's own written order,
    package_order, then the package itself)."""
    block = ARCHITECTURE.read_text().split("<!-- python order -->", 1)[1].split("```", 2)[1]
    names = [m.replace("/", ".") for m in block.split() if not m.endswith(":")]
    full = [PACKAGE.name if m == "__init__" else f"{PACKAGE.name}.{m.removesuffix('.__init__')}" for m in names]
    edges = graph()
    left = sorted(m for m in edges if m.startswith(f"{PACKAGE.name}.backends.") and m not in full)
    files: list[str] = []  # the backends' files, each after those it builds on (graph.py on inductor.py)
    while left:
        ready = next((m for m in left if not edges[m] & set(left)), left[0])
        files.append(ready)
        left.remove(ready)
    out = []
    for m in full:
        if m == f"{PACKAGE.name}.backends.*":
            out += files
        elif m.endswith(".*"):
            package = m.removesuffix(".*")
            text = modules()[package].read_text()
            out += [f"{package}.{name}" for name in package_order(text)] + [package]
        else:
            out.append(m)
    return out


def order_problems(order: list[str], edges: dict[str, set[str]], package: str) -> list[str]:
    """What breaks a package's written order (its modules' dotted names, from the bottom up),
    for `edges` (module -> the modules it imports): a module of the package the order does not
    name, a name with no module, a name given twice, a module importing one of the package's
    listed after it."""
    inside = {m for m in edges if m.startswith(package + ".")}
    problems = [f"{m} is named twice in the order" for m in sorted(set(order)) if order.count(m) > 1]
    problems += [f"{m} has no place in the order" for m in sorted(inside - set(order))]
    problems += [f"the order names {m}, which is no module" for m in order if m not in edges]
    place: dict[str, int] = {}
    for i, m in enumerate(order):
        place.setdefault(m, i)
    problems += [f"{m} imports {d}, which is above it in the order" for m in order
                 for d in sorted(edges.get(m, ())) if d in place and place[d] > place[m]]
    return problems


DECODE = f"{PACKAGE.name}._runtime.decode"


def test_the_order_check_finds_what_breaks_it():
    text = "\n".join(['"""A package.', "", "The modules, from the bottom up:", "",
                      "    low     the low one", "    mid     the middle one, whose text", "            goes on",
                      "    high    the top", "Not an entry.", "", "    other   not an entry either", '"""'])
    assert package_order(text) == ["low", "mid", "high"]
    order = [f"p.{m}" for m in package_order(text)]
    good = {"p": set(), "p.low": set(), "p.mid": {"p.low"}, "p.high": {"p.mid", "p.low"}}
    assert order_problems(order, good, "p") == []
    bad = dict(good, **{"p.low": {"p.high"}, "p.extra": set()})
    assert order_problems(order + ["p.mid", "p.gone"], bad, "p") == [
        "p.mid is named twice in the order", "p.extra has no place in the order",
        "the order names p.gone, which is no module", "p.low imports p.high, which is above it in the order"]


def test_the_decode_package_keeps_its_written_order():
    """The decode loop's package (_runtime/decode) has its own order, in its __init__.py, as
    the extension's is in common.h: every module named once, none importing one after it."""
    order = [f"{DECODE}.{m}" for m in package_order(modules()[DECODE].read_text())]
    assert order[0] == f"{DECODE}.call" and order[-1] == f"{DECODE}.loop"
    assert order_problems(order, graph(), DECODE) == []


@pytest.mark.slow
def test_no_module_imports_one_above_it_in_the_written_order():
    order = written_order()
    edges = graph()
    assert sorted(order) == sorted(edges)  # every module has its place, once
    place = {name: i for i, name in enumerate(order)}
    upward = [f"{m} -> {d}" for m in order for d in sorted(edges[m]) if d in place and place[d] > place[m]]
    assert upward == []


@pytest.mark.slow
def test_generic_modules_name_no_concrete_backend():
    """Outside backends/, no module names a built-in backend class or its config class: policy,
    strategies and persistence read the registry (torch_tweak.backends.registry)."""
    concrete = {cls.__name__ for cls in tt_backends.BUILT_IN} | {cls.config_class.__name__ for cls in tt_backends.BUILT_IN}
    offenders = []
    for name, path in modules().items():
        if name.startswith("torch_tweak.backends"):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            ident = node.id if isinstance(node, ast.Name) else node.attr if isinstance(node, ast.Attribute) else (
                node.name if isinstance(node, ast.alias) else None)
            if ident in concrete:
                offenders.append(f"{name}:{node.lineno}: {ident}")
    assert offenders == []


@pytest.mark.skipif(not hasattr(os, "fork"), reason="imports each module in a forked child")
@pytest.mark.slow
def test_every_module_imports_on_its_own():
    """Each module imported first, in a fresh child of an interpreter that has imported torch
    only: an import order that works only because another module was imported first fails."""
    names = [n for n in modules() if not n.endswith("__main__")]
    script = (
        "import os, sys, importlib, torch\n"
        "failed = []\n"
        f"for name in {names!r}:\n"
        "    pid = os.fork()\n"
        "    if pid == 0:\n"
        "        try:\n"
        "            importlib.import_module(name)\n"
        "        except BaseException as exc:\n"
        "            print(name, type(exc).__name__, exc, flush=True)\n"
        "            os._exit(1)\n"
        "        os._exit(0)\n"
        "    if os.waitpid(pid, 0)[1] != 0:\n"
        "        failed.append(name)\n"
        "print('FAILED', failed)\n"
        "sys.exit(1 if failed else 0)\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr


def _self_attr(node: ast.AST) -> str | None:
    """`x` of an expression `self.x`, else None."""
    if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "self":
        return node.attr
    return None


def _lineage(name: str, classes: dict[str, ast.ClassDef]) -> list[ast.ClassDef]:
    """A class and its bases defined in the same module, nearest first."""
    out, todo = [], [name]
    while todo:
        cls = classes.get(todo.pop(0))
        if cls is not None and cls not in out:
            out.append(cls)
            todo += [b.id for b in cls.bases if isinstance(b, ast.Name)]
    return out


def _state(cls: ast.ClassDef) -> set[str]:
    """The attributes a class's constructor sets on self (`self.x = ...`, annotated or not)."""
    init = next((n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name == "__init__"), None)
    return set() if init is None else {
        a for node in ast.walk(init) if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store)
        and (a := _self_attr(node)) is not None}


def _members(cls: ast.ClassDef) -> set[str]:
    """What a class's body defines: its methods, properties and class attributes."""
    out = set()
    for node in cls.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            out.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            out |= {t.id for t in targets if isinstance(t, ast.Name)}
    return out


def _root(node: ast.AST) -> str | None:
    while isinstance(node, ast.Attribute):
        node = node.value
    return node.id if isinstance(node, ast.Name) else None


GENERIC = frozenset(dir(torch.Tensor)) | frozenset(dir(torch.cuda.Event))
"""Attribute names every tensor or device event has (.device, .dtype, .record): a part's state
of such a name is not told from a tensor's by reading the source, so the scan leaves them out."""


def part_problems(sources: dict[str, str]) -> list[str]:
    """Where the parts of a package (its modules' classes) share state, for `sources` (module
    name -> text): a class that subclasses a class of another module (a mixin); a method that
    reads `self.x` its class's constructor (or a base's in its module) does not set, or sets
    `self.x` outside the constructor when the constructor does not set it; and a module that
    reads or sets, on anything but `self` (or a module it imports), an attribute that is the
    state (or a private member) of a class of another module and of no class of its own."""
    trees = {m: ast.parse(text) for m, text in sources.items()}
    classes = {m: {c.name: c for c in tree.body if isinstance(c, ast.ClassDef)} for m, tree in trees.items()}
    state = {(m, n): set().union(*map(_state, _lineage(n, cs))) for m, cs in classes.items() for n in cs}
    members = {(m, n): set().union(*map(_members, _lineage(n, cs))) for m, cs in classes.items() for n in cs}
    problems = []
    for m, cs in classes.items():
        others = {n for o, ocs in classes.items() if o != m for n in ocs}
        for name, cls in cs.items():
            problems += [f"{m}.{name} subclasses {_root(b)}, a class of another module" for b in cls.bases
                         if _root(b) in others or (isinstance(b, ast.Attribute) and b.attr in others)]
            for method in (n for n in cls.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))):
                for node in ast.walk(method):
                    attr = _self_attr(node)
                    if attr is None:
                        continue
                    if isinstance(node.ctx, ast.Load) and attr not in state[m, name] | members[m, name]:
                        problems.append(f"{m}.{name}.{method.name} reads self.{attr}, which its constructor does not set")
                    elif isinstance(node.ctx, ast.Store) and method.name != "__init__" and attr not in state[m, name]:
                        problems.append(f"{m}.{name}.{method.name} sets self.{attr} outside its constructor")
    for m, tree in trees.items():
        own = set().union(set(), *(state[m, n] | members[m, n] for n in classes[m]))
        foreign: dict[str, str] = {}
        for (o, n), attrs in state.items():
            if o != m:
                private = {a for a in members[o, n] if a.startswith("_") and not a.startswith("__")}
                foreign.update((a, f"{o}.{n}") for a in attrs | private)
        imported = {alias.asname or alias.name.split(".")[0] for node in ast.walk(tree)
                    if isinstance(node, (ast.Import, ast.ImportFrom)) for alias in node.names}
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and node.attr in foreign and node.attr not in own | GENERIC and \
                    not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")) and \
                    _root(node) not in imported:
                problems.append(f"{m}:{node.lineno} reads or sets .{node.attr}, the state of {foreign[node.attr]}: "
                                "ask it through a method")
    return problems


def test_the_part_scan_finds_state_shared_between_parts():
    sources = {
        "p.low": "class Low:\n"
                 "    def __init__(self):\n        self.count = 0\n        self._seen = []\n"
                 "    def add(self):\n        self.count += 1\n        self.later = 1\n        return self.missing\n"
                 "    def _private(self):\n        return self.count\n",
        "p.high": "import torch\nfrom .low import Low\n"
                  "class High:\n    def __init__(self, low):\n        self.low = low\n"
                  "    def run(self):\n        self.low.add()\n        torch.cuda.count\n"
                  "        return self.low.count + len(self.low._seen)\n"
                  "class Mixed(Low):\n    pass\n",
    }
    assert part_problems(sources) == [
        "p.low.Low.add sets self.later outside its constructor",
        "p.low.Low.add reads self.missing, which its constructor does not set",
        "p.high.Mixed subclasses Low, a class of another module",
        "p.high:9 reads or sets .count, the state of p.low.Low: ask it through a method",
        "p.high:9 reads or sets ._seen, the state of p.low.Low: ask it through a method"]


def test_no_part_of_the_decode_loop_reads_another_parts_state():
    """The decode loop's parts (_runtime/decode) are composed, not mixed in: each class's
    state is set in its own constructor and read by its own methods; another module's part is
    asked through its methods (DecodeLoop has no bases)."""
    from torch_tweak._runtime.decode.loop import DecodeLoop

    assert DecodeLoop.__bases__ == (object,)
    sources = {name: path.read_text() for name, path in modules().items() if name.startswith(DECODE + ".")}
    assert len(sources) >= 8
    assert part_problems(sources) == []


MAX_FUNCTION_LINES = 80


def long_functions(limit: int = MAX_FUNCTION_LINES) -> list[str]:
    """Every function (method, nested function) of the package longer than `limit` lines,
    its signature and docstring included."""
    out = []
    for name, path in modules().items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1
                if lines > limit:
                    out.append(f"{name}.{node.name} ({lines} lines)")
    return sorted(out)


@pytest.mark.slow
def test_no_function_is_longer_than_80_lines():
    assert long_functions(10**6) == [] and long_functions(3) != []  # the scan sees functions at all
    assert long_functions() == []


MAX_CLASS_LINES = 200
MAX_FILE_LINES = 800


def long_classes(limit: int = MAX_CLASS_LINES) -> list[str]:
    """Every class of the package longer than `limit` lines, its decorators excluded."""
    out = []
    for name, path in modules().items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef) and node.end_lineno - node.lineno + 1 > limit:
                out.append(f"{name}.{node.name} ({node.end_lineno - node.lineno + 1} lines)")
    return sorted(out)


def long_files(limit: int = MAX_FILE_LINES) -> list[str]:
    return sorted(f"{name} ({n} lines)" for name, path in modules().items()
                  if (n := len(path.read_text().splitlines())) > limit)


def test_no_class_is_longer_than_200_lines_and_no_file_than_800():
    """A class a newcomer reads whole, a file whose name says what it holds: split by concept
    past these (DecodeLoop was 510 lines, generation.py 1,339)."""
    assert long_classes(10) != [] and long_files(10) != []  # the scans see classes and files at all
    assert long_classes() == []
    assert long_files() == []


def folder_of(name: str) -> str:
    """The folder of the package a module's file lies in ('' for the package's own folder)."""
    path = modules()[name]
    return path.parent.relative_to(PACKAGE).as_posix() if path.parent != PACKAGE else ""


@pytest.mark.slow
def test_each_folder_is_one_layer_of_the_written_order():
    """The folders are the layers: a folder's modules (its subfolders' too) stand together in
    the written order, so a module put into another layer's folder breaks its folder's block.
    The package's own folder holds only the door and the version."""
    order = written_order()
    folders = {name: folder_of(name) for name in order}
    split = []
    for folder in sorted(set(folders.values()) - {""}):
        places = [i for i, name in enumerate(order) if (folders[name] + "/").startswith(folder + "/")]
        if places != list(range(places[0], places[-1] + 1)):
            split.append(folder)
    assert split == [], f"folders split by another folder's modules: {split}"
    door = {f"{PACKAGE.name}.{m}" if m else PACKAGE.name for m in ("", "_version", "tweak", "results", "cli", "__main__")}
    assert {name for name in modules() if folder_of(name) == ""} == door


def test_the_docs_import_nothing_private():
    """A user imports from torch_tweak and torch_tweak.backends: no snippet of the docs, the
    README or the examples imports a module of a private folder (a constant may be named where
    it lives, as a reference)."""
    root = ARCHITECTURE.parent
    texts = [*root.glob("docs/*.md"), root / "README.md", *root.glob("examples/**/*.py")]
    private = [f"{path.relative_to(root)}:{n}: {line.strip()}" for path in texts
               for n, line in enumerate(path.read_text().splitlines(), 1)
               if re.search(r"\b(from|import)\s+torch_tweak\._(?!C\b)", line)]
    assert private == []
