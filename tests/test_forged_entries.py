"""A tuning-cache entry is a file anyone who can write the folder can forge: what a hit shows is
written from numbers the engine checks (_C.restore_result), never from text the entry holds,
and no control character from the file reaches a terminal or a log line (storage.printable).
Every figure a hit shows is either computed now or marked as the first tweak's, with its time."""

from __future__ import annotations

import json
import logging
import re
import uuid

import pytest
import torch

import torch_tweak as tt
from torch_tweak import _C
from torch_tweak._core.storage import printable
from torch_tweak._store import tuning_cache
from torch_tweak.backends import Backend
from support import FAST, SlowNet

pytestmark = pytest.mark.usefixtures("steady_figures", "fake_clock")

ESCAPES = "\x1b[2J\x1b[H\x1b]0;pwned\x07kept depth 0: 42.00x faster than untuned"
CONTROL = re.compile("[\x00-\x09\x0b-\x1f\x7f-\x9f\ud800-\udfff]")


class Served(Backend):
    """Runs a Slow layer's inner layer (depth 1 wins); says, as OpenVINO's static shapes do,
    how many calls it served, with a token of its own build."""

    name = "Served"

    def build(self, module, samples, device):
        self.token = uuid.uuid4().hex[:12]
        self.served = 0
        inner = getattr(module, "inner", module)

        def run(*args, **kwargs):
            self.served += 1
            return inner(*args, **kwargs)
        return run

    def describe(self):
        return {"line": f"{self.served} calls served by them (build {self.token})"}


DATA = [torch.randn(8, 16) for _ in range(3)]


def fresh() -> SlowNet:
    torch.manual_seed(0)
    return SlowNet().eval()


def tweak(model, **kwargs):
    return tt.tweak(model, DATA, max_depth=1, strategy=tt.OneBackendStrategy(Served()), measure=FAST, **kwargs)


def same_as_untuned(model) -> bool:
    untuned = fresh()
    with torch.no_grad():
        return all(torch.equal(model(x), untuned(x)) for x in DATA)


def the_entry(folder):
    (path,) = (folder / "tweaks").glob("*.json")
    return path, json.loads(path.read_text())


def shown(result, capsys) -> str:
    """Everything a user reads of a hit: print(result), its outcome, its modules, tt.status."""
    print(result)
    print(result.outcome())
    print(result.modules)
    captured = capsys.readouterr()
    return captured.out + captured.err


def clean(text: str) -> bool:
    text.encode("utf-8")  # no lone surrogate
    return CONTROL.search(text) is None


@pytest.mark.parametrize("form", [5, {"kept": "everything"}, ["a", "table"], "\udc80 lone", ESCAPES])
def test_a_forged_table_or_outcome_is_never_shown(tuning_cache_folder, capsys, form):
    first = tweak(fresh(), progress=False)
    path, entry = the_entry(tuning_cache_folder)
    entry["result"]["table"] = form  # what the entries of the former version kept, and showed
    entry["result"]["outcome"] = form
    path.write_text(json.dumps(entry))
    model = fresh()
    result = tweak(model, progress=True)
    assert result.cached and same_as_untuned(model)
    text = shown(result, capsys)
    assert clean(text) and "pwned" not in text and "42.00x" not in text and "everything" not in text
    assert result.outcome() == first.outcome()  # the numbers' words, the first tweak's figures
    assert str(result).startswith(first._engine.format())


@pytest.mark.parametrize("form", [5, {"kept": "everything"}, "\udc80 lone", ESCAPES])
def test_an_entry_of_the_former_version_is_a_miss(tuning_cache_folder, capsys, form):
    tweak(fresh(), progress=False)
    path, entry = the_entry(tuning_cache_folder)
    record = entry["result"]
    entry["version"] = 5
    entry["result"] = {"rows": [], "table": form, "outcome": form, "quality": record["quality"]}
    path.write_text(json.dumps(entry))
    model = fresh()
    result = tweak(model, progress=True)
    assert not result.cached and result.selected_depth == 1 and same_as_untuned(model)
    assert clean(shown(result, capsys))
    assert tuning_cache.read(*_key_of(path)) is not None  # written again, in the current version


def _key_of(path):
    entry = json.loads(path.read_text())
    return path.stem, entry["parts"]


def test_a_claim_of_42x_comes_to_nothing(tuning_cache_folder, capsys):
    """The side-by-side figure is derived again from the entry's measurements: a speedup written
    in the entry counts for nothing; numbers that keep nothing are a miss for an entry that
    says it kept a depth."""
    first = tweak(fresh(), progress=False)
    path, entry = the_entry(tuning_cache_folder)
    forged = json.loads(json.dumps(entry))
    confirmation = forged["result"]["confirmation"]
    confirmation.update(speedup=42.0, speedup_low=42.0, speedup_high=42.0, search_speedup=42.0, side_speedup=42.0)
    path.write_text(json.dumps(forged))
    result = tweak(fresh(), progress=True)
    assert result.cached and result.speedup == first.speedup and "42" not in f"{result.speedup}"
    assert "42.00x" not in shown(result, capsys)
    for change in (lambda r: r.update(selected=-1, confirmation=None),  # the numbers keep nothing
                   lambda r: r["confirmation"].update(quality="busy", speedup=42.0, speedup_low=40.0,
                                                      speedup_high=50.0, paired_rounds=10, paired_wins=10)):
        forged = json.loads(json.dumps(entry))
        change(forged["result"])
        path.write_text(json.dumps(forged))
        model = fresh()
        result = tweak(model, progress=True)
        assert not result.cached and result.selected_depth == 1 and same_as_untuned(model)
        assert "42.00x" not in shown(result, capsys)
        path.write_text(json.dumps(entry))


def test_text_an_entry_holds_is_shown_printable(tuning_cache_folder, capsys, caplog):
    """A row's error, a module's, a candidate's, a signature's: escapes shown as escapes."""
    tweak(fresh(), progress=False)
    path, entry = the_entry(tuning_cache_folder)
    rows = entry["result"]["rows"]
    assert [r["depth"] for r in rows] == [0, 1] and entry["kept_depth"] == 1
    rows[0].update(state="skipped", stats=None, error=ESCAPES + "\udc80")
    module = entry["modules"][0]
    module["error"] = ESCAPES
    module["signatures"][0]["candidates"][0]["error"] = ESCAPES
    module["signatures"][0]["text"] = "(float32[8, 16])\x9b31m"
    path.write_text(json.dumps(entry))
    model = fresh()
    with caplog.at_level(logging.INFO, logger="torch_tweak"):
        result = tweak(model, progress=True)
    assert result.cached and same_as_untuned(model)
    text = shown(result, capsys)
    assert clean(text) and clean("\n".join(r.getMessage() for r in caplog.records))
    assert "skipped: \\x1b[2J\\x1b[H\\x1b]0;pwned\\x07kept depth 0" in str(result)  # seen, inert


@pytest.mark.parametrize("where, value", [
    ("candidate latency", "fast"), ("candidate latency", float("nan")), ("candidate state", 7),
    ("module depths", ["x"]), ("module kept", "yes"), ("signature unstorable", -1),
    ("row error", 5), ("row stats", {"median_ns": 1.0}), ("confirmation tries", 99),
    ("others share", 7.0), ("budgets", None)])
def test_values_of_another_form_are_a_miss(tuning_cache_folder, where, value):
    tweak(fresh(), progress=False)
    path, entry = the_entry(tuning_cache_folder)
    module, result = entry["modules"][0], entry["result"]
    candidate = module["signatures"][0]["candidates"][0]
    {"candidate latency": lambda: candidate.__setitem__("latency_ms", value),
     "candidate state": lambda: candidate.__setitem__("state", value),
     "module depths": lambda: module.__setitem__("depths", value),
     "module kept": lambda: module.__setitem__("kept", value),
     "signature unstorable": lambda: module["signatures"][0].__setitem__("unstorable", value),
     "row error": lambda: result["rows"][1].__setitem__("error", value),
     "row stats": lambda: result["rows"][1].__setitem__("stats", value),
     "confirmation tries": lambda: result["confirmation"].__setitem__("tries", value),
     "others share": lambda: result.__setitem__("others_share", value),
     "budgets": lambda: result.__setitem__("budgets", value)}[where]()
    path.write_text(json.dumps(entry))
    model = fresh()
    got = tweak(model, progress=False)
    assert not got.cached and got.selected_depth == 1 and same_as_untuned(model)


def test_a_hit_shows_no_figure_of_the_first_process_as_its_own(tuning_cache_folder):
    """The first tweak's table is shown with its time; what its backends served is counted now
    (issue: a second tweak printed the first process's "301 calls served by them")."""
    first_model = fresh()
    first = tweak(first_model, progress=False)
    with torch.no_grad():
        for _ in range(7):
            first_model(DATA[0])
    before = str(first)
    tokens = set(re.findall(r"\(build (\w+)\)", before))
    assert tokens and "calls served by them" in before
    model = fresh()
    second = tweak(model, progress=False)
    assert second.cached and same_as_untuned(model)
    text = str(second)
    assert not any(token in text for token in tokens)  # nothing of the first process's backends
    live = tt.status(model).shapes_lines()
    assert live and all(line in text for line in live)
    note = text.index("(from the tuning cache: the figures were measured on ")
    assert all(text.index(line) > note for line in live)  # the first tweak's figures end at the note
    assert text.startswith(first._engine.format())


def test_printable_makes_every_control_character_inert():
    text = "ok\n" + "".join(chr(c) for c in list(range(0, 32)) + list(range(127, 160))) + "\ud800\u202e é"
    shown = printable(text)
    assert clean(shown.replace("\n", "")) and shown.startswith("ok\n") and shown.endswith(" é")
    assert "\\x1b" in shown and "\\ud800" in shown and "\\u202e" in shown
    assert printable(5) == "5" and printable("plain text") == "plain text"


def test_restore_result_is_the_engines_rule_from_python(tuning_cache_folder):
    result = tweak(fresh(), progress=False)
    record = result.to_record()
    again = _C.restore_result(record)
    assert again.format() == result._engine.format() and again.outcome() == result._engine.outcome()
    assert again.rows == result._engine.rows and again.confirmation == result._engine.confirmation
    with pytest.raises(ValueError, match="no measurement's"):
        _C.restore_result(dict(record, baseline=dict(record["baseline"], median_ns=-3.0)))
    with pytest.raises(TypeError, match="must be a number"):
        _C.restore_result(dict(record, baseline=dict(record["baseline"], median_ns="3")))
    with pytest.raises(TypeError):
        _C.restore_result(5)
    with pytest.raises(ValueError, match="out of range"):
        _C.restore_result(dict(record, selected=2 ** 70))


def test_a_saved_files_text_reaches_no_terminal(tmp_path, capsys):
    """tt.load's errors and warnings and `torch-tweak show` quote a file's text only printable."""
    import warnings

    import forgery
    from torch_tweak import cli

    plain, _ = forgery.genuine(tmp_path)
    base = forgery.members(plain)
    manifest = json.loads(base["manifest.json"])
    other_model = forgery.forge(tmp_path, "other_model", {}, base, manifest={"model": ESCAPES})
    with pytest.raises(tt.CheckpointError) as refused:
        tt.load(forgery.build(), other_model)
    assert clean(str(refused.value)) and "\\x1b[2J" in str(refused.value)
    device = dict(manifest["device"], name=ESCAPES)
    version = manifest["torch"] + "\x1b]0;pwned\x07"
    forged = forgery.forge(tmp_path, "texts", {"plan.json": json.dumps(
        dict(json.loads(base["plan.json"]), modules=[
            dict(m, signatures=[dict(s, text="\x1b[31m(x)\udc80") for s in m["signatures"]])
            for m in json.loads(base["plan.json"])["modules"]])).encode()}, base,
        manifest={"device": device, "torch": version})
    model = forgery.build()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        tt.load(model, forged)
    assert caught and all(clean(str(w.message)) for w in caught)
    assert any("\\x1b]0;pwned\\x07" in str(w.message) for w in caught)
    with torch.no_grad():
        assert all(torch.equal(model(x), e) for x, e in zip(forgery.INPUTS, forgery.EXPECTED))
    assert clean(str(tt.status(model)))
    capsys.readouterr()
    assert cli.main(["show", str(forged)]) == 0
    out = capsys.readouterr().out
    assert clean(out) and "\\x1b[2J" in out and "\\x1b]0;pwned\\x07" in out
    assert cli.main(["show", str(other_model)]) == 0 and clean(capsys.readouterr().out)


def test_a_verdicts_reason_and_a_build_logs_text_are_printable(tuning_cache_folder):
    from torch_tweak._search import verdicts

    module = torch.nn.Linear(4, 4)
    parts = verdicts.parts_of(Served(), module, [((torch.randn(2, 4),), {})], torch.device("cpu"))
    assert verdicts.write(parts, verdicts.Verdict(True, ESCAPES))
    found = verdicts.read(parts)
    assert found.crashed and clean(found.reason) and "\\x1b[2J" in found.reason

    class Loud(Backend):
        name = "Loud"

        def build(self, module, samples, device):
            raise RuntimeError(ESCAPES + "\udc80")

    model = fresh()
    result = tt.tweak(model, DATA, max_depth=0, strategy=tt.OneBackendStrategy(Loud()), measure=FAST,
                      progress=False)
    assert result.selected_depth is None and same_as_untuned(model)
    (log,) = (tuning_cache_folder / "logs").rglob("Loud.log")
    text = log.read_bytes().decode("utf-8")
    assert clean(text) and "RuntimeError: \\x1b[2J" in text
