"""The examples run as a user runs them, and say they succeeded."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow  # each example tunes a model in a child process: minutes in all

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")


def run_example(path: str, *args: str, cache: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONUNBUFFERED="1", TORCH_TWEAK_CACHE=cache)
    return subprocess.run([sys.executable, os.path.join(ROOT, path), *args], capture_output=True, text=True,
                          timeout=1800, cwd=ROOT, env=env)


def test_minimal(tmp_path):
    done = run_example("examples/Minimal/main.py", cache=str(tmp_path))
    assert done.returncode == 0, done.stderr[-3000:]
    assert "untuned" in done.stdout and "selected depth" in done.stdout


def test_tweak_example_on_the_cpu(tmp_path):
    done = run_example("examples/Tweak/main.py", "--device", "cpu", cache=str(tmp_path))
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    out = done.stdout
    assert "Dry run" in out and "untuned" in out
    # a child process reads the machine's real load: on a busy machine the tweak may keep
    # nothing, and then says so and stops (test_tweak_example_that_keeps_nothing_saves_nothing)
    kept = "Nothing kept, nothing saved" not in out
    assert not kept or ("OK: the tuned model's output matches the untuned one" in out
                        and "OK: the loaded model's output matches the tuned one" in out), out[-3000:]
    # tt.load says what it cost and what it built again (its LoadResult's summary)
    assert not kept or ("tt.load of " in out and " built again and checked on its stored calls: " in out), out[-3000:]


def test_tweak_example_that_keeps_nothing_saves_nothing(tmp_path):
    """A tweak that keeps nothing (here a time budget of 0; on a busy machine, a depth not
    confirmed) says so, lists no backend per module and saves no file."""
    done = run_example("examples/Tweak/main.py", "--device", "cpu", "--time-budget", "0", cache=str(tmp_path))
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    out = done.stdout
    assert "Nothing kept, nothing saved: the model runs as it did" in out
    assert "(root):" not in out and "Saved the tuned model" not in out and "loaded:" not in out


def test_tweak_example_refuses_a_batch_of_none(tmp_path):
    done = run_example("examples/Tweak/main.py", "--device", "cpu", "--batch", "0", cache=str(tmp_path))
    assert done.returncode == 2 and "--batch must be 1 or more sequences per call, not 0" in done.stderr
    assert "Dry run" not in done.stdout  # refused before anything is built or tuned


def test_tweak_example_takes_the_busy_budget_its_verdict_may_name(tmp_path):
    """The verdict of a busy tweak may name busy_budget=N: the example takes it as --busy-budget N
    (and refuses a negative one before anything is built)."""
    done = run_example("examples/Tweak/main.py", "--device", "cpu", "--busy-budget", "-5", cache=str(tmp_path))
    assert done.returncode == 2 and "--busy-budget must be 0 or more seconds, not -5.0" in done.stderr
    assert "Dry run" not in done.stdout
    done = run_example("examples/Tweak/main.py", "--help", cache=str(tmp_path))
    assert "--busy-budget SECONDS" in done.stdout and "busy_budget=N" in done.stdout
