"""One record per tuned model (torch_tweak._core.records): its wrappers, the depth kept, the
declared shapes, the rule it was judged by and its busy figure in one place, which tt.status,
tt.save, the tuning cache and tt.load read; the only table keyed by models in the package; gone
with its model."""

from __future__ import annotations

import ast
import copy
import gc
import weakref
from pathlib import Path

import pytest
import torch

import torch_tweak as tt
from torch_tweak._core import correctness, records
from support import FAST
from test_plan import DoubleBackend, answers, fresh_net

pytestmark = pytest.mark.usefixtures("fake_clock")  # speed verdicts on the fake clock (conftest)

PACKAGE = Path(tt.__file__).parent
WEAK_TABLES = ("WeakKeyDictionary", "WeakValueDictionary")


def model_tables(source: str) -> list[str]:
    """The module-level tables of a source keyed by objects: weak dictionaries, and any table
    whose annotation names a module (nn.Module, torch.nn.Module)."""
    found = []
    for st in ast.parse(source).body:
        if isinstance(st, ast.AnnAssign) and isinstance(st.target, ast.Name):
            name, value, note = st.target.id, st.value, ast.unparse(st.annotation)
        elif isinstance(st, ast.Assign) and len(st.targets) == 1 and isinstance(st.targets[0], ast.Name):
            name, value, note = st.targets[0].id, st.value, ""
        else:
            continue
        called = ast.unparse(value.func) if isinstance(value, ast.Call) else ""
        if called.split(".")[-1] in WEAK_TABLES or any(w in note for w in WEAK_TABLES) or "Module" in note:
            found.append(name)
    return found


def test_the_scan_finds_tables_keyed_by_models():
    source = ('import weakref\nA = weakref.WeakKeyDictionary()\nB: "weakref.WeakKeyDictionary[nn.Module, int]" = '
              'weakref.WeakKeyDictionary()\nC: dict[nn.Module, str] = {}\nD: dict[str, int] = {}\n'
              'E = weakref.WeakSet()\n')
    assert model_tables(source) == ["A", "B", "C"]


def test_the_record_is_the_only_table_of_models():
    found = {path.relative_to(PACKAGE).as_posix(): names for path in sorted(PACKAGE.rglob("*.py"))
             if (names := model_tables(path.read_text()))}
    assert found == {"_core/records.py": ["_RECORDS"]}


@pytest.fixture
def tuned(mlp_data):
    model = fresh_net()
    result = tt.tweak(model, mlp_data, max_depth=1, strategy=tt.OneBackendStrategy(DoubleBackend()),
                      progress=False, measure=FAST, cache=False, tolerance=0.01)
    assert result.selected_depth == 1
    return model


def test_the_record_holds_what_a_tweak_decided_and_save_and_load_read_it(tuned, mlp_data, tmp_path):
    record = records.of(tuned)
    assert sorted(record.wrappers) == ["a", "b"] and record.wrappers == tt.installed(tuned)
    assert (record.depth, record.decided, record.shapes, record.rule) == (1, True, None, correctness.Rule(0.01))
    assert tt.status(tuned).busy is None and record.busy is None

    tt.save(tuned, tmp_path / "m.tt")
    fresh = fresh_net()
    untuned = answers(fresh_net(), mlp_data)
    tt.load(fresh, tmp_path / "m.tt", backends=[DoubleBackend()])
    loaded = records.of(fresh)
    assert sorted(loaded.wrappers) == ["a", "b"] and loaded.wrappers == tt.installed(fresh)
    assert (loaded.depth, loaded.decided, loaded.rule) == (1, True, correctness.Rule(0.01))
    got = answers(fresh, mlp_data)  # the differential check: the loaded model answers as the untuned one
    assert all(torch.allclose(g, u, rtol=1e-5, atol=1e-6) for g, u in zip(got, untuned))
    assert not all(torch.equal(g, u) for g, u in zip(got, untuned))  # and its backends ran

    tt.unwrap(fresh)  # the wrappers leave the record; what the tweak decided stays
    assert not loaded.wrappers and records.of(fresh) is loaded and loaded.decided
    assert tt.status(fresh) == {} and all(torch.equal(a, b) for a, b in zip(answers(fresh, mlp_data), untuned))


def test_a_model_kept_untuned_copies_and_pickles_without_its_record(mlp_data, tmp_path):
    model = fresh_net()
    result = tt.tweak(model, mlp_data, max_depth=1, strategy=tt.OneBackendStrategy(tt.backends.TorchEagerBackend()),
                      progress=False, measure=FAST, cache=False)
    assert result.selected_depth is None and records.of(model).decided and not tt.installed(model)
    twin = copy.deepcopy(model)
    torch.save(model, tmp_path / "plain.pt")
    back = torch.load(tmp_path / "plain.pt", weights_only=False)
    assert records.of(twin) is None and records.of(back) is None  # nothing of torch-tweak travels
    tt.save(model, tmp_path / "untuned.tt")  # the untuned outcome is saved: the record says one was decided


def test_the_record_goes_with_its_model(mlp_data):
    model = fresh_net()
    tt.tweak(model, mlp_data, max_depth=1, strategy=tt.OneBackendStrategy(DoubleBackend()), progress=False,
             measure=FAST, cache=False)
    record = records.of(model)
    assert record is not None and record.wrappers
    gone, gone_record = weakref.ref(model), weakref.ref(record)
    del model, record
    gc.collect()
    assert gone() is None and gone_record() is None
