"""A busy machine: other processes' CPU time while tweak measures is read (torch_tweak._core.cpu_load),
the result says the machine was busy and claims no speedup, and the tuning cache does not
replay it. The share computed from fake /proc snapshots, a fake load through the whole tweak,
and a real one: busy-loop processes beside the tweak."""

from __future__ import annotations

import copy
import os
import signal
import subprocess
import sys
import time

import pytest
import torch
from torch import nn

import torch_tweak as tt
from torch_tweak import _C
from torch_tweak._core import cpu_load as load
from support import FAST, CountingBackend
from torch_tweak._core.cpu_load import reading as REAL_READING  # the real one: conftest's load_unknown replaces load.reading

ME = 100


def cpu_line(user, nice, system, idle, iowait=0, irq=0, softirq=0, steal=0, guest=0):
    return (f"cpu  {user} {nice} {system} {idle} {iowait} {irq} {softirq} {steal} {guest} 0\n"
            f"cpu0 1 2 3 4 5 6 7 8 9 10\nintr 12345 0 0\nctxt 99\n")


def proc(pid, ppid, utime, stime=0, cutime=0, cstime=0, comm="python"):
    # the fields of /proc/<pid>/stat: pid (comm) state ppid pgrp session tty tpgid flags minflt cminflt majflt
    # cmajflt utime stime cutime cstime priority nice ...
    return f"{pid} ({comm}) S {ppid} {pid} {pid} 0 -1 4194560 10 0 0 0 {utime} {stime} {cutime} {cstime} 20 0 1 0"


def share(before, after):
    """What the engine computes from two readings (tw_load_window): others' share of the capacity."""
    return (after[0] - before[0]) / (after[1] - before[1])


def test_the_share_of_other_processes_from_proc_snapshots():
    # 2 cores for 1 s at 100 ticks/s: a capacity of 200 ticks. This process (its threads) took
    # 60 ticks, its compile worker (a child) 30, that worker's own child 20, and an isolation child that
    # ended and was waited for 10 (now in this process's cutime); an unrelated process took 50.
    before = load.reading_of(cpu_line(1000, 0, 500, 8000, steal=0),
                             [proc(ME, 1, 300), proc(101, ME, 40), proc(102, 101, 5), proc(103, ME, 7),
                              proc(500, 1, 1000)], ME)
    after = load.reading_of(cpu_line(1000 + 120, 0, 500 + 40, 8000 + 30, iowait=0, steal=10),
                            [proc(ME, 1, 340, 20, cutime=17), proc(101, ME, 70), proc(102, 101, 25),
                             proc(500, 1, 1050)], ME)
    # busy grew by 120 + 40 + 10 (steal) = 170 of 200; own by 60 + 10 + 30 + 20 = 120: others 50
    assert after[1] - before[1] == pytest.approx(2.0)  # CPU-seconds: 2 cores for 1 s
    assert share(before, after) == pytest.approx(50 / 200)
    # the descendants' and the ended child's ticks would count as others if they were not excluded
    assert load.own_ticks(ME, [(ME, 1, 5), (101, ME, 7), (102, 101, 11), (103, 42, 13)]) == 5 + 7 + 11


def test_the_fields_that_count_as_busy_and_capacity():
    # user nice system idle iowait irq softirq steal guest: guest is already in user, idle and iowait are not busy
    busy, total = load.cpu_ticks(cpu_line(10, 20, 30, 40, iowait=50, irq=60, softirq=70, steal=80, guest=90))
    assert busy == 10 + 20 + 30 + 60 + 70 + 80
    assert total == busy + 40 + 50
    # a command name with spaces and parentheses
    assert load.process_ticks(proc(7, 3, 11, 12, 13, 14, comm="a (b) c")) == (7, 3, 11 + 12 + 13 + 14)
    assert load.process_ticks("garbage") is None
    assert load.cpu_ticks("intr 1 2\n") is None
    assert load.reading_of("no cpu line\n", [], ME) is None


def test_no_proc_stat_reads_as_unknown(tmp_path, monkeypatch):
    monkeypatch.setattr(load, "PROC", str(tmp_path / "nothing"))
    assert REAL_READING() is None  # e.g. macOS or Windows: the engine then changes nothing


def fake_proc(tmp_path, stat_path_maker):
    """A /proc with this process's stat, and a stat made by stat_path_maker(path)."""
    folder = tmp_path / "proc"
    (folder / str(os.getpid())).mkdir(parents=True)
    (folder / str(os.getpid()) / "stat").write_text(proc(os.getpid(), 1, 10))
    stat_path_maker(folder / "stat")
    return folder


@pytest.mark.parametrize("kind", ["fifo", "dev-zero", "folder", "huge-zeros"])
def test_an_odd_proc_stat_reads_as_unknown_at_once(tmp_path, monkeypatch, kind):
    """A FIFO (nobody writes it: an unbounded open or read would block), /dev/zero (endless), a
    folder, or a 3 GiB file: the reading is None (load unknown), at once and without reading it whole."""
    def make(path):
        if kind == "fifo":
            os.mkfifo(path)
        elif kind == "dev-zero":
            os.symlink("/dev/zero", path)
        elif kind == "folder":
            path.mkdir()
        else:
            with open(path, "wb") as f:
                f.truncate(3 << 30)  # sparse: 3 GiB of zeros, no cpu line

    monkeypatch.setattr(load, "PROC", str(fake_proc(tmp_path, make)))
    start = time.monotonic()
    assert REAL_READING() is None
    assert time.monotonic() - start < 2.0


def test_a_huge_proc_stat_is_read_only_as_far_as_its_bound(tmp_path, monkeypatch):
    """A genuine cpu line followed by 3 GiB: the reading takes the line from the first bytes
    (LOAD_STAT_BYTES) and reads no further; a process's stat past LOAD_PROCESS_BYTES likewise."""
    def make(path):
        with open(path, "wb") as f:
            f.write(cpu_line(100, 0, 50, 850).encode())
            f.truncate(3 << 30)

    monkeypatch.setattr(load, "PROC", str(fake_proc(tmp_path, make)))
    reads = []
    real_read = os.read
    def counted(fd, n):
        data = real_read(fd, n)
        reads.append(len(data))
        return data

    monkeypatch.setattr(load.os, "read", counted)
    start = time.monotonic()
    got = REAL_READING()
    assert time.monotonic() - start < 2.0
    assert got is not None and got[1] == pytest.approx(1000 / os.sysconf("SC_CLK_TCK"))
    assert sum(reads) <= tt.settings.LOAD_STAT_BYTES + tt.settings.LOAD_PROCESS_BYTES


def test_a_reading_past_its_time_is_unknown(tmp_path, monkeypatch):
    """A slow /proc (here: a reading given no time at all) is load unknown."""
    monkeypatch.setattr(load, "PROC", str(fake_proc(tmp_path, lambda p: p.write_text(cpu_line(1, 0, 1, 8)))))
    assert REAL_READING() is not None
    monkeypatch.setattr(tt.settings, "LOAD_READING_SECONDS", -1.0)
    assert REAL_READING() is None


class Costly(nn.Module):
    """Its forward costs `cost` ns on the fake clock before its inner layer; the tuned path
    (Skip) costs `tuned`."""

    def __init__(self, clock, cost: float, tuned: float) -> None:
        super().__init__()
        self.inner = nn.Linear(16, 16)
        self.clock = clock
        self.cost = cost
        self.tuned = tuned

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.clock.advance(self.cost)
        return self.inner(x)


class Skip(CountingBackend):
    """The tuned path: a cheaper call, then the inner layer: the same outputs. Its build costs
    `build_ns` on the fake clock (a compile's time)."""

    name = "Skip"
    build_ns = 0

    def build(self, module, samples, device):
        module.clock.advance(self.build_ns)

        def run(x):
            module.clock.advance(module.tuned)
            return module.inner(x)

        return run


def fresh(clock, cost=2_000_000, tuned=1_300_000) -> Costly:
    torch.manual_seed(0)
    return Costly(clock, cost, tuned).eval()


def tweak(model, data, backend=None, **kwargs):
    return tt.tweak(model, data, max_depth=kwargs.pop("max_depth", 0), progress=False, measure=FAST,
                    strategy=tt.OneBackendStrategy(backend or Skip()), **kwargs)


def assert_untuned_answers(model, data):
    """Differential: the model answers as an untuned deep copy of a fresh one does."""
    untuned = copy.deepcopy(fresh(model.clock, model.cost, model.tuned))
    with torch.no_grad():
        for x in data:
            assert torch.equal(model(x), untuned(x))


def last_line(result) -> str:
    return str(result).rstrip("\n").splitlines()[-1]


def test_a_lasting_load_keeps_a_faster_depth_measured_busy(mlp_data, fake_clock, busy_machine):
    """Other processes take 60 % of the CPUs: the depth and the untuned model are measured in
    paired rounds, and a depth 1.54x faster is kept, its figure and 99 % interval marked busy
    in the table, the outcome, result.confirmation and tt.status."""
    busy_machine(0.6)
    model = fresh(fake_clock)
    result = tweak(model, mlp_data)
    assert result.measurement_quality == "busy" and result.busy and not result.busy_stopped
    assert result.others_share == pytest.approx(0.6)
    side = result.confirmation
    assert side["quality"] == "busy" and side["confirmed"] and side["others_share"] == pytest.approx(0.6)
    assert side["paired_rounds"] >= 10 and side["paired_wins"] == side["paired_rounds"]
    assert side["speedup_low"] > 1.0 and result.speedup == pytest.approx(2.0 / 1.3, rel=1e-3)
    assert result.selected_depth == 0 and tt.installed(model)
    assert last_line(result).startswith("kept depth 0: 1.54x faster than untuned, measured busy (other processes "
                                        "took 60% of the CPUs) in "), str(result)
    assert "1.54x  selected, measured busy" in str(result)
    assert result.outcome() == last_line(result)  # the table's own words: the one place they are written
    assert str(tt.status(model)).splitlines()[-1].startswith("kept depth 0: 1.54x faster than untuned, measured busy")
    from torch_tweak._view.plotting import bars

    assert "measured busy" in bars(result)[4]
    assert_untuned_answers(model, mlp_data)
    # a later tweak measured quiet clears the mark
    busy_machine(0.0)
    tt.unwrap(model)
    quiet = tweak(model, mlp_data, cache=False)
    assert not quiet.busy and quiet.measurement_quality in ("consistent", "remeasured")
    assert "measured busy" not in str(tt.status(model))


def test_under_load_a_depth_no_faster_is_not_kept(mlp_data, fake_clock, busy_machine):
    """Paired rounds whose 99 % interval holds 1 (the tuned path costs what the original does):
    not kept, the model answers as an untuned copy, and the table says it was measured busy."""
    busy_machine(0.6)
    model = fresh(fake_clock, 2_000_000, 2_000_000)
    result = tweak(model, mlp_data)
    side = result.confirmation
    assert result.measurement_quality == "busy" and not side["confirmed"]
    assert side["speedup_low"] <= 1.0 <= side["speedup_high"]
    assert result.selected_depth is None and not tt.installed(model)
    assert "within noise of the untuned model, measured busy (other processes took 60% of the CPUs)" in \
        last_line(result), str(result)
    assert "within noise in paired rounds (busy)" in str(result)
    assert "measured busy" in result.outcome() and "was within noise" in result.outcome()
    assert_untuned_answers(model, mlp_data)


def test_a_busy_entry_is_replayed_while_busy_and_measured_again_when_quiet(mlp_data, fake_clock, busy_machine,
                                                                            tuning_cache_folder):
    busy_machine(0.6)
    first = tweak(fresh(fake_clock), mlp_data)
    assert first.measurement_quality == "busy" and first.selected_depth == 0
    entry = next((tuning_cache_folder / "tweaks").glob("*.json")).read_text()
    assert '"quality": "busy"' in entry
    # still busy: the entry is replayed, marked busy
    model = fresh(fake_clock)
    again = tweak(model, mlp_data)
    assert again.cached and again.busy and again.measurement_quality == "busy"
    assert "measured busy" in again.outcome() and again.speedup == pytest.approx(first.speedup)
    assert "measured busy" in str(tt.status(model))
    assert "(from the tuning cache: the figures were measured on " in str(tt.status(model))  # the first tweak's
    assert_untuned_answers(model, mlp_data)
    # quiet now: measured again, a quiet figure replaces it
    busy_machine(0.0)
    quiet = tweak(fresh(fake_clock), mlp_data)
    assert not quiet.cached and quiet.measurement_quality in ("consistent", "remeasured")
    assert quiet.speedup == pytest.approx(2.0 / 1.3, rel=1e-3)
    assert '"quality": "busy"' not in next((tuning_cache_folder / "tweaks").glob("*.json")).read_text()
    # a load that cannot be read counts as quiet: a busy entry is measured again
    tt.clear_cache()
    busy_machine(0.6)
    assert tweak(fresh(fake_clock), mlp_data).measurement_quality == "busy"
    busy_machine(None)
    assert not tweak(fresh(fake_clock), mlp_data).cached


def test_the_busy_budget_stops_tuning_under_load(mlp_data, fake_clock, busy_machine):
    """Builds of 1000 s (fake) on a busy machine: with busy_budget=100, depth 1 is not tried, the
    table and the outcome say so, and depth 0 is still confirmed in paired rounds. Quiet, the
    same budget bounds nothing."""
    slow = Skip()
    slow.build_ns = 1000 * 10**9
    busy_machine(0.6)
    model = fresh(fake_clock)
    result = tweak(model, mlp_data, slow, max_depth=1, busy_budget=100)
    assert result.busy_stopped and [r.error for r in result.rows] == ["", "busy budget used up"]
    assert "the machine was busy: tuning stopped at its busy budget (100 s)" in str(result)
    assert "tuning stopped at its busy budget (100 s)" in result.outcome()
    assert result.selected_depth == 0 and result.confirmation["paired_rounds"] >= 10
    assert_untuned_answers(model, mlp_data)
    busy_machine(0.0)
    quiet = tweak(fresh(fake_clock), mlp_data, slow, max_depth=1, busy_budget=100, cache=False)
    assert not quiet.busy_stopped and "budget" not in quiet.rows[1].error  # tried (Skip cannot serve a Linear)
    with pytest.raises(ValueError, match="busy_budget must be a number of seconds >= 0 or None"):
        tweak(fresh(fake_clock), mlp_data, busy_budget=-1)


HOG = """
import os, sys, time
pid = os.fork()
if pid:
    print(pid, flush=True)
    os._exit(0)
os.setsid()
null = os.open(os.devnull, os.O_RDWR)
for fd in (0, 1, 2):
    os.dup2(null, fd)
end = time.monotonic() + float(sys.argv[1])
while time.monotonic() < end:
    pass
"""
"""A busy loop that is not a descendant of the test: started through a child that exits at
once, so its parent becomes init; it ends by itself after argv[1] seconds."""


def start_hogs(count: int, seconds: float) -> list[int]:
    pids = []
    for _ in range(count):
        out = subprocess.run([sys.executable, "-c", HOG, str(seconds)], capture_output=True, text=True,
                             timeout=30, check=True)
        pids.append(int(out.stdout.split()[0]))
    return pids


def stop(pids: list[int]) -> None:
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


@pytest.mark.slow
@pytest.mark.skipif(not os.path.exists("/proc/stat"), reason="the load is read from Linux's /proc")
def test_busy_loops_beside_the_tweak_make_the_machine_busy(mlp_data, real_load, tuning_cache_folder):
    """The real load: busy loops beside the tweak are read as busy, and whatever the paired rounds
    decide (a real measurement: this test asserts no verdict), the figure is marked busy and the
    model answers as an untuned copy or as its tuned path, which gives the same outputs."""
    hogs = start_hogs(os.cpu_count() or 2, 60)  # one per CPU: /proc/stat counts every CPU
    try:
        # calls of 6 ms: windows long enough to judge (capacity >= TW_LOAD_MIN_CAPACITY) on 2 cores
        model = Sleepy().eval()
        untuned = copy.deepcopy(model)
        result = tt.tweak(model, mlp_data, max_depth=0, progress=False, measure=FAST, busy_budget=60,
                          strategy=tt.OneBackendStrategy(SleepySkip()))
        assert load.reading is REAL_READING
        assert result.busy and result.measurement_quality == "busy", str(result)
        assert result.others_share > _C.BUSY_SHARE
        assert "measured busy" in last_line(result) and result.confirmation["paired_rounds"] >= 10
        with torch.no_grad():
            for x in mlp_data:
                assert torch.equal(model(x), untuned(x))
    finally:
        stop(hogs)


class Sleepy(nn.Module):
    """A forward that sleeps 6 ms (real time) before its inner layer."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inner = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        time.sleep(0.006)
        return self.inner(x)


class SleepySkip(CountingBackend):
    name = "SleepySkip"

    def build(self, module, samples, device):
        def run(x):
            time.sleep(0.004)
            return module.inner(x)

        return run


@pytest.mark.skipif(not os.path.exists("/proc/stat"), reason="the load is read from Linux's /proc")
def test_a_child_of_the_tuning_process_is_its_own_work():
    """A process this one started (a compile worker, an isolation child, or a busy loop the user
    runs from it) is a descendant: its CPU time is the tweak's own, never load."""
    me = os.getpid()
    runner = subprocess.Popen([sys.executable, "-c", "import time\nend = time.monotonic() + 3\n"
                               "while time.monotonic() < end: pass"])
    try:
        time.sleep(0.5)
        processes = [p for p in map(load.process_ticks, load.process_stats()) if p is not None]
        theirs = dict((pid, ticks) for pid, _, ticks in processes)[runner.pid]
        others = [p for p in processes if p[0] != runner.pid]
        assert theirs > 0
        assert load.own_ticks(me, processes) == load.own_ticks(me, others) + theirs
    finally:
        runner.kill()
        runner.wait()
