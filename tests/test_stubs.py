"""The extension's stubs (torch_tweak/_C.pyi) name exactly what torch_tweak._C has, so
editors and type checkers see its real types."""

from __future__ import annotations

import ast
import os

import torch_tweak
from torch_tweak import _C


def stub_tree() -> ast.Module:
    path = os.path.join(os.path.dirname(torch_tweak.__file__), "_C.pyi")
    assert os.path.isfile(path), "the stubs are not installed with the package"
    with open(path, encoding="utf-8") as f:
        return ast.parse(f.read())


def test_package_is_marked_typed():
    assert os.path.isfile(os.path.join(os.path.dirname(torch_tweak.__file__), "py.typed"))


def test_stubs_name_every_public_member_and_nothing_else():
    tree = stub_tree()
    stubbed = {node.name for node in tree.body if isinstance(node, (ast.FunctionDef, ast.ClassDef))}
    constants = {node.target.id: ast.unparse(node.annotation) for node in tree.body if isinstance(node, ast.AnnAssign)}
    stubbed |= set(constants)
    # each stubbed constant exists, of the type its stub says (ENTRY_* ints, BUSY_SHARE a float)
    wrong = {n: t for n, t in constants.items() if type(getattr(_C, n, None)).__name__ != t}
    assert not wrong, f"stubbed constants the extension lacks, or of another type: {wrong}"
    public = {name for name in dir(_C) if not name.startswith("_")}
    assert stubbed - {"Stats"} >= public, f"not in the stubs: {sorted(public - stubbed)}"
    assert not {n for n in stubbed if not hasattr(_C, n)}, "stubs of names the extension lacks"
    for node in tree.body:
        if isinstance(node, ast.ClassDef):
            real = getattr(_C, node.name)
            for item in node.body:
                if isinstance(item, (ast.FunctionDef, ast.AnnAssign)):
                    name = item.name if isinstance(item, ast.FunctionDef) else item.target.id
                    if name.startswith("__") and name != "__call__":
                        continue
                    assert hasattr(real, name), f"{node.name}.{name} is in the stubs but not in the extension"
            members = {item.name if isinstance(item, ast.FunctionDef) else item.target.id
                       for item in node.body if isinstance(item, (ast.FunctionDef, ast.AnnAssign))}
            if isinstance(real, type):
                missing = {n for n in vars(real) if not n.startswith("_")} - members
                assert not missing, f"{node.name} members not in the stubs: {sorted(missing)}"
