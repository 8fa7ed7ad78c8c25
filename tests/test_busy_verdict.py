"""A busy machine reaches a verdict, and every table agrees with it.

On the fake clock, the README quick start's and the example's kind of model (their own
modules; each block's call costs fake time, and a compiled depth costs less of it) are tuned
beside a fake load of two busy loops and one more CPU-bound job: every call slowed at random
(FakeLoad). The builds take most of the busy budget: the paired rounds must still get the
rounds their 99 % interval needs, and the faster depth (the whole model compiled) is kept in at
least 4 of 5 seeded runs. When the rounds cannot decide for lack of time, the verdict names the
one setting that buys them. Every table's selected row, its last line, result.speedup and
result.outcome() give one number, and the search's figures are in the search's columns."""

from __future__ import annotations

import contextlib
import copy
import os
import random
import re
import types

import pytest
import torch
from torch import nn

import torch_tweak as tt
from torch_tweak.backends import Backend
from support import FAST, encoder

MS = 1_000_000  # ns


@pytest.fixture(autouse=True)
def one_thread():
    """torch on one thread: the fake clock decides every figure here, and on a loaded machine
    two threads spin (a small matrix product took 20x longer), which only slows the suite."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


class FakeLoad:
    """What a call costs on the fake clock beside other work: with `busy`, as beside two busy
    loops and one more CPU-bound job on 2 cores (the engine's fake model_loaded): half the calls
    run unhindered, most others wait up to 3 times their length more, one in 20 ten times its
    length; quiet, a cost moves by up to `jitter` of itself. Seeded: each run is exact."""

    def __init__(self, clock, seed: int, busy: bool = True, jitter: float = 0.0) -> None:
        self.clock = clock
        self.rng = random.Random(seed)
        self.busy = busy
        self.jitter = jitter
        self.silent = 0

    def charge(self, ns: float) -> None:
        if self.silent:
            return
        factor = 1.0 + self.jitter * (2.0 * self.rng.random() - 1.0)
        if self.busy:
            u = self.rng.random()
            factor *= 1.0 if u < 0.5 else 1.0 + 3.0 * self.rng.random() if u < 0.95 else 10.0
        self.clock.advance(ns * factor)

    @contextlib.contextmanager
    def quiet_inside(self):
        """A compiled module's call: its own cost was charged; its modules cost nothing more."""
        self.silent += 1
        try:
            yield
        finally:
            self.silent -= 1


def costly(module: nn.Module, load: FakeLoad, ns: float) -> nn.Module:
    """`module` whose every eager call charges `ns` to the load (a subclass of its own class,
    so the model keeps its modules, names and weights)."""
    base = type(module)

    def forward(self, *args, **kwargs):
        load.charge(ns)
        return base.forward(self, *args, **kwargs)

    module.__class__ = type(f"Costly{base.__name__}", (base,), {"forward": forward})
    module.unit_ns = ns
    return module


class QuickBlock(nn.Module):
    """The README quick start's residual MLP block."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm, self.up, self.down = nn.LayerNorm(width), nn.Linear(width, 2 * width), nn.Linear(2 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(nn.functional.gelu(self.up(self.norm(x))))


KINDS = {
    # the README quick start: about 1 ms a call on a quiet 2-core CPU; depth 0 (one compiled
    # model) 1.4x, depth 1 (each block compiled) 1.15x; builds under load of 50 s and 7 x 12 s:
    # with the measurements, more than the whole busy budget (120 s)
    "quickstart": {"unit_ms": 0.15, "whole": 1.4, "part": 1.15, "root_build_s": 50, "part_build_s": 12},
    # the example's encoder at batch 1: about 5 ms a call; 1.6x and 1.25x; 60 s and 5 x 14 s
    "example": {"unit_ms": 1.0, "whole": 1.6, "part": 1.25, "root_build_s": 60, "part_build_s": 14},
}


def build(kind: str, load: FakeLoad) -> tuple[nn.Module, list[torch.Tensor]]:
    """The model of `kind` (its units charging their fake cost) and its dataset, as the README
    quick start and the example build them."""
    unit = KINDS[kind]["unit_ms"] * MS
    if kind == "quickstart":
        torch.manual_seed(0)
        model = nn.Sequential(*[QuickBlock(64) for _ in range(6)], nn.Linear(64, 8)).eval()
        units = list(model)
        data = [torch.randn(32, 64) for _ in range(4)]
    else:
        model = encoder.build()
        units = [*model.layers, model.norm]
        data = encoder.samples(batch=1, seq=8)  # the example at batch 1; a short sequence: the fake clock decides
    for module in units:
        costly(module, load, unit)
    return model, data


def units_of(module: nn.Module) -> float:
    """The eager cost of one call of `module`: its own unit's, or its units' together."""
    return sum(m.unit_ns for m in module.modules() if hasattr(m, "unit_ns"))


class FakeCompiled(Backend):
    """A compiled module as the fake clock sees it: a call costs its units' eager cost over the
    kind's gain (`whole` for the model, `part` for one block), the build `root_build_s` or
    `part_build_s` fake seconds; its outputs are the module's own."""

    name = "FakeCompiled"

    def __init__(self, load: FakeLoad, kind: dict) -> None:
        super().__init__()
        self.load, self.kind = load, kind

    def build(self, module, samples, device):
        whole = sum(1 for m in module.modules() if hasattr(m, "unit_ns")) > 1
        self.load.clock.advance((self.kind["root_build_s"] if whole else self.kind["part_build_s"]) * 1e9)
        cost = units_of(module) / (self.kind["whole"] if whole else self.kind["part"])
        load = self.load

        def run(*args, **kwargs):
            load.charge(cost)
            with load.quiet_inside():
                return type(module).forward(module, *args, **kwargs)

        return run


def tweak_of(kind: str, clock, seed: int, busy: bool = True, gains: dict | None = None, **kwargs):
    """One tweak of the kind's model beside the fake load (`gains`: other figures of KINDS'):
    (model, data, result)."""
    load = FakeLoad(clock, seed, busy=busy, jitter=kwargs.pop("jitter", 0.0))
    model, data = build(kind, load)
    with torch.no_grad():
        expected = [model(x) for x in data]  # the untuned outputs (their fake cost spent before the tweak)
    backend = FakeCompiled(load, dict(KINDS[kind], **(gains or {})))
    result = tt.tweak(model, data, progress=False, cache=False, strategy=tt.OneBackendStrategy(backend), **kwargs)
    with torch.no_grad():  # differential: the tuned model answers as the untuned one did
        for x, want in zip(data, expected):
            assert torch.equal(model(x), want)
    return model, data, result


# ------------------------------------------------------------------ the tables


def table_row(text: str, depth: int | None) -> dict:
    """The row of the engine's table for `depth` (None: the untuned model), by its columns."""
    lines = text.splitlines()
    header = next(i for i, line in enumerate(lines) if line.strip().startswith("depth  modules"))
    assert lines[header].split() == ["depth", "modules", "failed", "search", "ms", "spread", "search", "confirmed",
                                     "status"], lines[header]
    name = "untuned" if depth is None else str(depth)
    for line in lines[header + 2:]:
        fields = line.split()
        if fields and fields[0] == ">":
            fields = fields[1:]
        if fields and fields[0] == name:
            return {"selected": line.startswith(">"), "search_ms": fields[3], "search": fields[5],
                    "confirmed": fields[6], "status": " ".join(fields[7:])}
    raise AssertionError(f"no row for depth {depth} in\n{text}")


def verdict_of(result) -> str:
    """The line of the table that gives the verdict ("kept depth N: ..." or "depth N was ..."),
    which result.outcome() begins with."""
    line = next(line for line in str(result).splitlines() if re.match(r"(kept depth|depth \d+ was) ", line))
    assert result.outcome().startswith(line), (line, result.outcome())
    return line


def figure_in(line: str) -> str:
    """The speedup a verdict line gives: the first "N.NNx"."""
    return re.search(r"\d+\.\d+x", line).group(0)


def assert_tables_agree(result) -> None:
    """The selected row's confirmed column, the table's verdict line, result.outcome() and
    result.speedup are one number; the selected row's search column is the search's own
    figure (the search's untuned latency over the row's), and every other row's confirmed
    column is empty."""
    text = str(result)
    side = result.confirmation
    row = table_row(text, side["depth"])
    figure = side["figure"]
    assert row["confirmed"] == figure, text
    assert figure_in(verdict_of(result)) == figure, result.outcome()
    kept = result.selected_depth is not None
    assert row["selected"] == kept
    if kept:
        assert f"{result.speedup:.{len(figure) - 3}f}x" == figure
        depth = next(r for r in result.rows if r.selected)
        assert depth.confirmed == side["speedup"] and row["search"] == f"{depth.speedup:.2f}x"
    for other in result.rows:
        if other.depth != side["depth"] and other.latency_ms is not None:
            assert table_row(text, other.depth)["confirmed"] == "-" and other.confirmed is None
    assert table_row(text, None)["confirmed"] == "-"


def test_a_quiet_tables_selected_row_says_the_figure_its_verdict_used(fake_clock, busy_machine):
    """Quiet, with calls moving by up to 10 %: the search put depth 0 at one figure, the side
    by side at another; the selected row shows both, each in its own column, and the confirmed
    one is the last line's and result.speedup."""
    busy_machine(0.0)
    _, _, result = tweak_of("quickstart", fake_clock, seed=3, busy=False, jitter=0.1, measure=FAST)
    assert result.measurement_quality in ("consistent", "remeasured") and result.selected_depth == 0
    assert_tables_agree(result)
    row = table_row(str(result), 0)
    assert row["status"] == "selected, measured side by side"
    assert row["search"] != row["confirmed"], str(result)  # two moments, two figures, two columns


def test_a_busy_tables_selected_row_says_the_paired_figure(fake_clock, busy_machine):
    """Busy: the selected row's search figures are from a moment of the load (its latency may
    be far from the untuned model's); the paired rounds' figure, which decided, is in the
    confirmed column, the last line, the outcome and result.speedup."""
    busy_machine(0.7)
    _, _, result = tweak_of("quickstart", fake_clock, seed=1, measure=FAST)
    assert result.measurement_quality == "busy" and result.selected_depth == 0, str(result)
    assert_tables_agree(result)
    assert table_row(str(result), 0)["status"] == "selected, measured busy in paired rounds"


# ------------------------------------------------------------------ a busy machine's verdict


@pytest.mark.slow
@pytest.mark.parametrize("kind", list(KINDS))
def test_a_busy_machine_keeps_the_faster_depth(kind, fake_clock, busy_machine):
    """Beside two busy loops and one more job, builds taking most of the 120 s busy budget: the
    paired rounds keep their share of it and decide, and the faster depth (0) is kept in at least
    4 of 5 seeded runs, each table agreeing with its verdict. (Before the budget was split, the
    builds took it all, 10 pairs ran, and their interval, the smallest to the largest pair, held 1.)"""
    busy_machine(0.7)
    kept = []
    for seed in range(5):
        _, _, result = tweak_of(kind, fake_clock, seed)
        side = result.confirmation
        assert result.measurement_quality == "busy" and side is not None, str(result)
        kept.append(result.selected_depth)
        if result.selected_depth is not None:
            assert_tables_agree(result)
        elif side["busy_budget_wanted"]:  # undecided for lack of time: the one setting that buys it
            assert f"busy_budget={side['busy_budget_wanted']:.0f} buys them" in result.outcome()
    assert kept.count(0) >= 4, kept


@pytest.mark.slow
def test_rounds_that_ran_out_name_the_busy_budget_that_buys_them(fake_clock, busy_machine):
    """A busy budget of 1.5 s, of which the paired rounds of a 1.2x depth get 0.75 s, too few
    for their interval: the verdict says so and names busy_budget (the command's words:
    --busy-budget), with the seconds that buy the rounds; tuning again with it keeps the depth."""
    from torch_tweak.cli import in_options

    busy_machine(0.7)
    _, _, result = tweak_of("quickstart", fake_clock, seed=1, gains={"whole": 1.2}, busy_budget=1.5, max_depth=0)
    side = result.confirmation
    assert side["quality"] == "busy" and not side["confirmed"] and side["speedup"] > 1.0, str(result)
    wanted = side["busy_budget_wanted"]
    assert wanted > 1 and side["time_budget_wanted"] == 0 and side["rounds_ran_out"]
    words = f"the busy budget (1.5 s) ran out before the rounds could decide: busy_budget={wanted:.0f} buys them"
    assert verdict_of(result).endswith(words), result.outcome()
    assert "rounds_max" not in str(result)  # one setting, not two
    assert in_options(words).endswith(f"--busy-budget {wanted:.0f} buys them")
    assert_tables_agree(result)
    _, _, again = tweak_of("quickstart", fake_clock, seed=1, gains={"whole": 1.2}, busy_budget=wanted, max_depth=0)
    assert again.selected_depth == 0 and again.confirmation["paired_rounds"] > side["paired_rounds"], str(again)


def test_the_command_names_its_own_options():
    from torch_tweak.cli import in_options

    assert in_options("stopped at its busy budget (120 s) (busy_budget= raises it)") == \
        "stopped at its busy budget (120 s) (--busy-budget raises it)"
    assert in_options("the time budget (60 s) ran out: time_budget=200 buys them") == \
        "the time budget (60 s) ran out: --time-budget 200 buys them"
    assert in_options("my_busy_budget=3") == "my_busy_budget=3"


# ------------------------------------------------------------------ the generate() table


def loop_job(loop_ms: float) -> types.SimpleNamespace:
    """A generate() workload's choice of loop, as choose_loop leaves it: transformers' loop and
    tweak's decode loop (kept), measured at their own moment, 16 new tokens a run."""
    report = [{"candidate": "generate", "state": "measured", "error": "", "latency_ms": 1.5 * loop_ms,
               "numerics": "", "kept": False},
              {"candidate": "decode loop (loop)", "state": "measured", "error": "", "latency_ms": loop_ms,
               "numerics": "", "kept": True}]
    return types.SimpleNamespace(loop_report=report, tokens=16, loop="loop", numerics={}, hint="",
                                 ttft={"untuned": 2.0, "loop": 1.5, 0: 1.0, 1: 1.2},
                                 tokens_per_s=lambda ms: None if ms is None else 16 / (ms / 1e3))


@pytest.mark.parametrize("busy", [False, True], ids=["quiet", "busy"])
def test_the_generate_table_agrees_with_its_verdict(busy, fake_clock, busy_machine):
    """The tokens table of a tweak whose depths ran under a decode loop: the kept depth's row
    shows the figure its verdict used (the side-by-side or paired rounds' tuned latency, in
    tokens/s) and the speedup the engine's last line and result.speedup give; every other row
    says the moment its figure is from (the loop choice, the depth search), and a comparison
    with the kept depth names the search's figure it was made on."""
    from torch_tweak._view.result import speak_tokens, tokens_table

    busy_machine(0.7 if busy else 0.0)
    _, _, result = tweak_of("quickstart", fake_clock, seed=1 if busy else 3, busy=busy, jitter=0.0 if busy else 0.1,
                            measure=FAST)
    assert result.selected_depth == 0, str(result)
    side = result.confirmation
    speak_tokens(result, loop_job(0.9))
    rows = {r.label: r for r in result.tokens}
    kept = [r for r in result.tokens if r.kept]
    assert [r.label for r in kept] == ["depth 0 + decode loop (loop)"]
    figure = side["figure"]
    assert kept[0].status.startswith(f"kept: {figure} faster than untuned + decode loop (loop) "
                                      f"{'in paired rounds' if busy else 'side by side'}"), kept[0].status
    assert figure_in(verdict_of(result)) == figure and f"{result.speedup:.{len(figure) - 3}f}x" == figure
    assert kept[0].measured == ("paired rounds, busy" if busy else "side by side")
    assert kept[0].latency_ms == side["tuned"]["median_ns"] / 1e6  # the figure the verdict used
    assert rows["untuned"].measured == rows["untuned + decode loop (loop)"].measured == "loop choice"
    depth1 = rows["depth 1 + decode loop (loop)"]
    search0 = 16 / (result.rows[0].latency_ms / 1e3)
    assert depth1.measured == "depth search" and depth1.latency_ms == result.rows[1].latency_ms
    assert f"depth 0 + decode loop (loop) in the depth search ({search0:,.1f} tokens/s there)" in depth1.status
    table = tokens_table(result).splitlines()
    assert table[2].split()[-2:] == ["measured", "status"]
    starred = [line for line in table if line.startswith("*")]
    assert len(starred) == 1 and figure in starred[0] and f"{kept[0].tokens_per_s:,.1f}" in starred[0]


def test_the_commands_progress_lines_name_its_options_too(monkeypatch, capsys):
    """The last progress line tt.tweak writes says which setting buys more rounds; under the
    command it says the command's option, as the printed table does."""
    import torch_tweak as tt
    from torch_tweak._view.progress import Progress
    from torch_tweak.cli import main

    def tweak(model, dataset, **options):
        Progress(True).finish("depth 0 not kept: the busy budget (1.5 s) ran out before the rounds could decide: "
                              "busy_budget=300 buys them")
        raise ValueError("stopped here (a test)")

    monkeypatch.setattr(tt, "tweak", tweak)
    factory = os.path.join(os.path.dirname(os.path.abspath(__file__)), "cli_factory.py")
    assert main(["tweak", f"{factory}:tiny", "--input", "2x8"]) != 0
    err = capsys.readouterr().err
    assert "--busy-budget 300 buys them" in err and "busy_budget" not in err, err
