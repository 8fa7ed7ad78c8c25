"""A busy machine: other processes' CPU time while tweak measures is read (torch_tweak._core.cpu_load),
the result says the machine was busy and claims no speedup, and the tuning cache does not
replay it. The share computed from fake /proc snapshots, a fake load through the whole tweak,
and a real one: busy-loop processes beside the tweak."""

from __future__ import annotations

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


class Sleepy(nn.Module):
    """Its forward sleeps `pause` s before its inner layer; the tuned path (Skip) sleeps `tuned`."""

    def __init__(self, pause: float, tuned: float) -> None:
        super().__init__()
        self.inner = nn.Linear(16, 16)
        self.pause = pause
        self.tuned = tuned

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        time.sleep(self.pause)
        return self.inner(x)


class Skip(CountingBackend):
    """The tuned path: a shorter sleep, then the inner layer: the same outputs."""

    name = "Skip"

    def build(self, module, samples, device):
        def run(x):
            time.sleep(module.tuned)
            return module.inner(x)

        return run


def fresh(pause=0.002, tuned=0.0013) -> Sleepy:
    torch.manual_seed(0)
    return Sleepy(pause, tuned).eval()


def tweak(model, data, **kwargs):
    return tt.tweak(model, data, max_depth=0, strategy=tt.OneBackendStrategy(Skip()), progress=False,
                    measure=FAST, **kwargs)


def untuned_outputs(model_args, data):
    model = fresh(*model_args)
    with torch.no_grad():
        return [model(x) for x in data]


def fake_load(others_share: float):
    """A reading whose every window shows other processes taking `others_share` of the CPUs."""
    totals = [0.0, 0.0]

    def reading():  # each window: 1 s of 2 cores
        totals[0] += 2.0 * others_share
        totals[1] += 2.0
        return totals[0], totals[1]

    return reading


def last_line(result) -> str:
    return str(result).rstrip("\n").splitlines()[-1]


def test_a_lasting_load_claims_no_speedup_and_keeps_no_small_gain(mlp_data, monkeypatch, tuning_cache_folder):
    monkeypatch.setattr(load, "reading", fake_load(0.6))
    model = fresh()  # tuned about 1.5x faster: under the 2.5x that others at 60 % ask (1 / (1 - 0.6))
    result = tweak(model, mlp_data)
    assert result.measurement_quality == "busy" and result.busy
    assert result.others_share == pytest.approx(0.6)
    assert result.confirmation["quality"] == "busy" and result.confirmation["others_share"] == pytest.approx(0.6)
    assert result.confirmation["busy_keep"] == pytest.approx(2.5)
    assert result.speedup is None and result.selected_depth is None and not tt.installed(model)
    line = last_line(result)
    assert line.startswith("the machine was busy: other processes took 60% of the CPUs while measuring, so no "
                           "speedup is claimed and depth 0 is not kept"), str(result)
    assert "faster than untuned" not in str(result)
    assert result.outcome().startswith("the machine was busy (other processes took 60% of the CPUs while measuring): "
                                       "no speedup is claimed and depth 0 is not kept")
    with torch.no_grad():  # differential: the model answers as an untuned copy does
        for x, want in zip(mlp_data, untuned_outputs((0.002, 0.0013), mlp_data)):
            assert torch.equal(model(x), want)
    # the same under a quiet fake load: kept, with its figure
    monkeypatch.setattr(load, "reading", fake_load(0.1))
    quiet = tweak(fresh(), mlp_data, cache=False)
    assert not quiet.busy and quiet.others_share == pytest.approx(0.1)
    assert quiet.measurement_quality != "busy" and "no speedup is claimed" not in str(quiet)


def test_a_wide_gain_is_kept_on_a_busy_machine_without_a_figure_and_not_replayed(mlp_data, monkeypatch,
                                                                                  tuning_cache_folder):
    monkeypatch.setattr(load, "reading", fake_load(0.6))
    model = fresh(0.004, 0.0)  # the tuned path skips the whole sleep: far above 2.5x
    result = tweak(model, mlp_data)
    assert result.measurement_quality == "busy" and result.selected_depth == 0 and tt.installed(model)
    assert result.speedup is None
    assert last_line(result).startswith("kept depth 0, but the machine was busy: other processes took 60% of the "
                                        "CPUs while measuring, so no speedup is claimed"), str(result)
    with torch.no_grad():
        for x, want in zip(mlp_data, untuned_outputs((0.004, 0.0), mlp_data)):
            assert torch.equal(model(x), want)
    from torch_tweak._view.plotting import bars

    assert "x)" not in bars(result)[4] and "a busy machine: no speedup claimed" in bars(result)[4]  # nor the chart
    # the entry is written with its quality, and the next tweak measures again
    entry = next((tuning_cache_folder / "tweaks").glob("*.json")).read_text()
    assert '"quality": "busy"' in entry
    monkeypatch.setattr(load, "reading", fake_load(0.0))
    second = tweak(fresh(0.004, 0.0), mlp_data)
    assert not second.cached and second.measurement_quality in ("consistent", "remeasured")
    assert second.speedup is not None and second.speedup > 1


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


@pytest.mark.skipif(not os.path.exists("/proc/stat"), reason="the load is read from Linux's /proc")
def test_busy_loops_beside_the_tweak_make_the_machine_busy(mlp_data, real_load, tuning_cache_folder):
    hogs = start_hogs(os.cpu_count() or 2, 60)  # one per CPU: /proc/stat counts every CPU
    try:
        # calls of 6 ms: windows long enough to judge (capacity >= TW_LOAD_MIN_CAPACITY) on 2 cores
        model = fresh(0.006, 0.004)
        result = tweak(model, mlp_data)
        assert load.reading is REAL_READING
        assert result.busy and result.measurement_quality == "busy", str(result)
        assert result.others_share > _C.BUSY_SHARE
        assert result.speedup is None and "no speedup is claimed" in last_line(result)
        with torch.no_grad():
            for x, want in zip(mlp_data, untuned_outputs((0.006, 0.004), mlp_data)):
                assert torch.equal(model(x), want)
        again = tweak(fresh(0.006, 0.004), mlp_data)
        assert not again.cached  # the busy result is not replayed
    finally:
        stop(hogs)


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
