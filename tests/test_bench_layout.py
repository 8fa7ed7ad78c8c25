"""bench/'s layout: the benchmarks a user runs at its top, the one-off studies in bench/studies/
sharing one helper module (bench/studies/common.py), each study named in a results file that
quotes it, and every bench script a document, a results file, a test or a script names still
where it says."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "bench"
STUDIES = BENCH / "studies"


def studies() -> list[Path]:
    return sorted(p for p in STUDIES.glob("*.py") if p.name != "common.py")


def test_studies_live_in_their_folder_and_benchmarks_at_the_top():
    assert len(studies()) >= 10  # the folder was read at all
    at_top = sorted(p.name for p in BENCH.glob("*.py"))
    assert "dispatch_bench.py" in at_top
    assert [name for name in at_top if "study" in name] == []


def test_each_study_is_named_in_the_results_file_that_quotes_it():
    results = "\n".join(p.read_text() for p in (BENCH / "results").glob("*.md"))
    unnamed = [p.name for p in studies() if f"bench/studies/{p.name}" not in results]
    assert unnamed == []


def test_studies_share_the_helper_module():
    """Every study imports bench/studies/common.py and leaves the path and the run file's writing
    to it: none puts a folder on sys.path itself or writes its run file with its own json.dump."""
    offenders = []
    for path in studies():
        tree = ast.parse(path.read_text())
        imported = {alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names}
        if "common" not in imported:
            offenders.append(f"{path.name}: does not import common")
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and (
                    (node.value.id, node.attr) in (("sys", "path"), ("json", "dump"))):
                offenders.append(f"{path.name}:{node.lineno}: {node.value.id}.{node.attr}")
    assert offenders == []


def named_scripts(text: str) -> set[str]:
    """The bench scripts `text` names by their path from the root (bench/x.py, bench/studies/x.py)."""
    return set(re.findall(r"\bbench/(?:[\w-]+/)*[\w-]+\.py\b", text))


def test_named_bench_scripts_exist():
    assert named_scripts("see `bench/studies/x_study.py` and bench/y.py") == {"bench/studies/x_study.py", "bench/y.py"}
    texts = [ROOT / "README.md", ROOT / "ARCHITECTURE.md", ROOT / "CONTRIBUTING.md", *ROOT.glob("docs/*.md"),
             *BENCH.glob("results/*.md"), *BENCH.rglob("*.py"), *ROOT.glob("tests/*.py"), *ROOT.glob("scripts/*")]
    missing = sorted(f"{path.relative_to(ROOT)}: {name}" for path in texts
                     if path.is_file() and path != Path(__file__).resolve()
                     for name in named_scripts(path.read_text()) if not (ROOT / name).exists())
    assert missing == []
