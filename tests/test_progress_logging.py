"""What the user sees: the progress display and the library's log records are separate
channels, each line once; records at their levels; tables that keep their shape."""

from __future__ import annotations

import io
import logging
import re

import torch
from torch import nn

import torch_tweak as tt
from torch_tweak._view.progress import Progress
from support import FAST, Slow


class Skip(tt.Backend):
    """Runs a Slow layer's inner layer: a real speedup, for a tweak that keeps a depth."""

    name = "Skip"

    def build(self, module, samples, device):
        return getattr(module, "inner", module)


class Verbose(tt.Backend):
    """Fails with a long error of several lines."""

    name = "Verbose"

    def build(self, module, samples, device):
        raise RuntimeError("first line of a long story " + "word " * 40 + "\nsecond line\nthird line")


def build() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(Slow(nn.Linear(16, 16)), Slow(nn.Linear(16, 4))).eval()


DATA = [torch.randn(8, 16, generator=torch.Generator().manual_seed(i)) for i in range(2)]


def tweak(model, progress, **kwargs):
    kwargs.setdefault("strategy", tt.FirstWinsStrategy([Verbose(), Skip()]))
    return tt.tweak(model, DATA, progress=progress, measure=FAST, cache=False, **kwargs)


def untuned_outputs():
    with torch.no_grad():
        model = build()
        return [model(x) for x in DATA]


def test_progress_and_logging_are_separate_and_each_line_appears_once(caplog, capsys, fake_clock):
    caplog.set_level(logging.DEBUG, logger="torch_tweak")
    model = build()
    result = tweak(model, True)
    shown = capsys.readouterr().err.splitlines()
    records = [r for r in caplog.records if r.name == "torch_tweak"]
    texts = [r.getMessage() for r in records]
    # the last line: the counter at its total ("the counter stops at 8/10" was all a log showed)
    assert shown and re.match(r"torch-tweak: \[(\d+)/\1\] tuned in ", shown[-1]) and "kept depth 1" in shown[-1]
    assert any("about" in line and "left" in line for line in shown)  # an estimate once a step is done
    assert all(line.startswith("torch-tweak: ") for line in shown)  # plain lines: stderr is not a terminal
    assert not any(text in line for text in texts for line in shown)  # no record is also a progress line
    assert len(texts) == len(set(texts))  # each record once
    debug = [r.getMessage() for r in records if r.levelno == logging.DEBUG]
    info = [r.getMessage() for r in records if r.levelno == logging.INFO]
    warning = [r.getMessage() for r in records if r.levelno == logging.WARNING]
    assert any("Verbose failed" in m for m in debug) and any("Skip built in" in m for m in debug)
    assert any(m.startswith("depth 0: 1 modules") for m in info) and any(m.startswith("depth 1:") for m in info)
    assert sum(m.startswith("tweak of Sequential: kept depth 1") for m in info) == 1
    # nothing fell back (a busy machine may make the side-by-side check say its load changed:
    # a figure of the machine, not a fallback)
    assert not [m for m in warning if "the machine's load changed" not in m], warning
    with torch.no_grad():
        assert all(torch.allclose(model(x), e) for x, e in zip(DATA, untuned_outputs()))
    assert result.selected_depth == 1


def test_progress_false_leaves_logging_alone(caplog, capsys):
    caplog.set_level(logging.INFO, logger="torch_tweak")
    tweak(build(), False)
    assert capsys.readouterr().err == ""
    assert any(r.getMessage().startswith("depth 1:") for r in caplog.records)
    assert any(r.getMessage().startswith("tweak of Sequential") for r in caplog.records)


def test_fallbacks_are_warnings(caplog):
    caplog.set_level(logging.INFO, logger="torch_tweak")
    model = build()
    result = tweak(model, False, strategy=tt.OneBackendStrategy(Verbose()))
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert result.selected_depth is None and not tt.installed(model)
    assert any("keeps its forward" in m for m in warnings)
    assert all("\n" not in line for m in warnings for line in [m.split(":", 1)[0]])


def test_tables_hold_their_shape():
    model = build()
    result = tweak(model, False)
    table = str(result.modules)
    lines = table.splitlines()
    assert all("second line" not in line for line in lines)  # multi-line errors folded
    assert any(line.rstrip().endswith("...") for line in lines)
    assert "errors in full: print(result.modules['0'])" in table or "errors in full: print(result.modules[''])" in table
    detail = str(result.modules["0"])
    assert "errors in full:" in detail and "second line" in detail and "third line" in detail
    header = lines[0]
    assert all(len(line) < 200 for line in lines) and header.startswith("module")


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_on_a_terminal_updates_one_line():
    now = [0.0]
    screen = Terminal()
    shown = Progress(True, screen, clock=lambda: now[0])
    shown.plan(4)
    shown.start_depth(0, 1, 2, 1, 1)
    shown.step("blocks.0", "building TorchInductor")
    now[0] = 30.0
    shown.finish_module("blocks.0", "chose TorchInductor")
    shown.step("blocks.1", "building OpenVINO")
    now[0] = 45.0
    shown.phase("depth 0: measuring the whole model")
    now[0] = 61.0
    shown.finish("kept depth 0, 1.50x faster than untuned (measured side by side)")
    text = screen.getvalue()
    assert "\r\x1b[2K[0/4] depth 0 (1/2): blocks.0: building TorchInductor | 0:00 elapsed" in text
    assert "[1/4] depth 0 (1/2): blocks.1: building OpenVINO | 0:30 elapsed, about 1:30 left" in text
    assert "[1/4] depth 0 (1/2): blocks.0: chose TorchInductor (0:30, about 1:30 left)\n" in text
    assert text.endswith("tuned in 61.0 s: kept depth 0, 1.50x faster than untuned (measured side by side)\n")
    assert "torch-tweak: " not in text  # a terminal gets no prefix


def test_public_namespace_holds_only_the_api():
    names = dir(tt)
    assert not {"Any", "annotations", "nn", "torch"} & set(names)
    assert set(tt.__all__) <= set(names) and "tweak" in names and "__version__" in names
    assert all(hasattr(tt, name) for name in names)
    # the result types live in tt.results; their old names at the top are the same classes, not listed
    types = ("DepthResult", "ModelStatus", "ModuleResult", "ModuleResults", "ModuleStatus", "ModuleTree",
             "SignatureResult", "TweakResult")
    new = ("LoadResult", "Rebuilt")  # named in tt.results only: they had no old name at the top
    assert sorted(tt.results.__all__) == sorted(types + new) and "results" in names
    assert all(getattr(tt, t) is getattr(tt.results, t) and t not in names for t in types)
    assert not any(hasattr(tt, t) for t in new)


def test_the_time_left_is_estimated_per_kind_of_step_and_weight():
    """"about 0:03 left" after the untuned model's measurement, then 46 s of compiling, then
    "about 3:03 left": the estimate took the measurement's seconds for a module's. Now no
    estimate until a module is tuned, a module's time scales with the modules it holds (the
    whole model at depth 0 weighs what depth 1's modules weigh together), and the counter ends at
    its total."""
    now = [0.0]
    log = io.StringIO()
    shown = Progress(True, log, clock=lambda: now[0])
    layers = {f"layers.{i}": 8 for i in range(4)}
    shown.plan(1 + 4 + 1 + 2 + 2, {"": 34, **layers, "norm": 1})  # 6 modules, 4 measurements
    shown.phase("measuring the untuned model")
    now[0] = 2.0
    shown.start_depth(0, 1, 2, 1, 1)
    shown.end_phase()
    assert "left" not in log.getvalue()  # one measurement says nothing of a compile
    now[0] = 62.0  # the whole model: 34 units in 60 s
    shown.finish_module("", "chose OpenVINO")
    # 33 units of modules at 60/34 s each, and 3 measurements at 2 s: 64 s
    assert log.getvalue().splitlines()[-1].endswith("(root): chose OpenVINO (1:02, about 1:04 left)")
    shown.phase("depth 0: measuring the whole model")
    now[0] = 64.0
    shown.end_phase()
    for i in range(4):
        now[0] += 14.0
        shown.finish_module(f"layers.{i}", "chose OpenVINO")
    now[0] += 2.0
    shown.finish_module("norm", "chose OpenVINO")
    # the modules took 60 + 58 s for 67 units; the last two measurements are left, at 2 s each
    assert log.getvalue().splitlines()[-1].endswith("norm: chose OpenVINO (2:02, about 0:04 left)")
    shown.phase("depth 1: measuring the whole model")
    now[0] += 2.0
    shown.phase("depth 0: measuring it side by side with the untuned model")
    now[0] += 2.0
    shown.finish("kept depth 0")
    assert log.getvalue().splitlines()[-1] == "torch-tweak: [10/10] tuned in 126.0 s: kept depth 0"


WARNED = """
import torch
from torch import nn
import torch_tweak as tt

class Broken(tt.Backend):
    name = "Broken"
    def build(self, module, samples, device):
        raise RuntimeError("this backend cannot build anything")

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(16, 16), nn.Linear(16, 4)).eval()
tt.tweak(model, [torch.randn(8, 16)], strategy=tt.OneBackendStrategy(Broken()), max_depth=0, cache=False,
         measure={"rounds_min": 3, "rounds_max": 5, "warmup_min": 1, "warmup_max": 2, "time_cap": 0.5})
"""


def test_a_warning_during_a_tweak_is_a_line_of_its_progress():
    """With no logging handler configured, logging's last resort printed torch_tweak's warnings
    (a module that keeps its forward, a busy machine) bare between the progress lines; they are
    progress lines now, with its prefix."""
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", WARNED], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stderr.splitlines()
    warned = [line for line in lines if "keeps its forward: no backend passed" in line or "depth 0 skipped" in line]
    assert len(warned) == 2 and all(line.startswith("torch-tweak: ") for line in warned), done.stderr[-3000:]
