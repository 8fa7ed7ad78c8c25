"""The command line: clear messages without a traceback for every mistake, and a real tweak."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from torch_tweak.cli import CliError, main, parse_input

HERE = os.path.dirname(os.path.abspath(__file__))
FACTORY = os.path.join(HERE, "cli_factory.py")


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "torch_tweak", *args], capture_output=True, text=True,
                          timeout=600, cwd=HERE)


def test_shapes_specs_are_tweaks_shapes():
    from torch_tweak.cli import parse_shapes

    assert parse_shapes("length=8:512,batch=1:16") == {"length": (8, 512), "batch": (1, 16)}
    assert parse_shapes(" batch = 2 : 4 ") == {"batch": (2, 4)}


def test_input_specs():
    assert parse_input("8x64x256") == (None, (8, 64, 256), None, None)
    assert parse_input("input_ids=1x128:int64:30522") == ("input_ids", (1, 128), "int64", 30522)
    assert parse_input("2x3:bf16") == (None, (2, 3), "bfloat16", None)
    for bad in ("8xx2", "8x0", "2x3:float99", "2x3:float32:10", "x"):
        with pytest.raises(CliError):
            parse_input(bad)


@pytest.mark.parametrize(
    "args, message",
    [
        (["tweak", "no_such_module:build", "--input", "2x8"], "cannot import no_such_module"),
        (["tweak", f"{FACTORY}:nope", "--input", "2x8"], "has no function 'nope'"),
        (["tweak", f"{FACTORY}:not_a_module", "--input", "2x8"], "returned a int, not a torch.nn.Module"),
        (["tweak", "missing_file.py:build", "--input", "2x8"], "does not exist"),
        (["tweak", "nocolon", "--input", "2x8"], "must be MODULE:FACTORY"),
        (["tweak", f"{FACTORY}:tiny", "--input", "2x8y"], "malformed input spec"),
        (["tweak", f"{FACTORY}:tiny", "--input", "2x8", "--device", "tpu"], "unknown device 'tpu'"),
        (["tweak", f"{FACTORY}:tiny", "--input", "2x8", "--device", "mps"], "no backends for device 'mps'"),
        (["tweak", f"{FACTORY}:tiny", "--input", "2x8", "--out", "/no/such/folder/m.tt"], "cannot write"),
        (["tweak", f"{FACTORY}:tiny", "--input", "2x3"], "sample 0 was rejected"),
        (["tweak", f"{FACTORY}:tiny", "--input", "2x8", "--max-depth", "-1"], "max_depth must be an int >= 0"),
        (["tweak", f"{FACTORY}:tiny", "--input", "2x8", "--min-depth", "3"], "greater than max_depth (1)"),
        (["tweak", f"{FACTORY}:tiny", "--input", "2x8", "--busy-budget", "-1"],
         "busy_budget must be a number of seconds >= 0 or None, got -1.0"),
        (["show", "no_such_file.tt"], "does not exist"),
        (["tweak", f"{FACTORY}:tiny", "--input", "2x8", "--tolerance", "loose"], "give measured, dtype or a number"),
        (["tweak", f"{FACTORY}:tiny", "--input", "2x8", "--tolerance", "2"], "tolerance must be"),
        # found by an attack: these ended in a traceback (the last one after the whole tuning)
        (["tweak", f"{FACTORY}:tiny", "--input", "2x8", "--seed", str(10**23)], "give a seed from 0"),
        (["tweak", f"{FACTORY}:tiny", "--input", "99999999999999999999x8"], "elements is more than one input"),
        (["tweak", f"{FACTORY}:tiny", "--input", "100000x100000x100000"], "elements is more than one input"),
        (["tweak", f"{FACTORY}:tiny", "--input", "2x8:int64:99999999999999999999"], "upper bound must be below"),
        (["tweak", f"{FACTORY}:tiny", "--input", "2x8:int64:0"], "upper bound must be at least 1"),
        (["tweak", f"{FACTORY}:exits", "--input", "2x8"], "exited (sys.exit(0)) instead of returning a model"),
        (["tweak", f"{os.path.join(HERE, 'cli_exits_factory.py')}:build", "--input", "2x8"], "exited (sys.exit(3))"),
        (["tweak", f"{os.path.join(os.path.dirname(HERE), 'README.md')}:build", "--input", "2x8"],
         "is not a Python file"),
        (["tweak", f"{FACTORY}:tiny", "--input", "2x8", "--out", "a" * 300 + ".tt"], "file name is too long"),
        # --shapes: tt.tweak's shapes= on the command line, its mistakes tt.tweak's own
        (["tweak", f"{FACTORY}:tiny", "--input", "2x8", "--shapes", "batch=1-32"], "malformed --shapes 'batch=1-32'"),
        (["tweak", f"{FACTORY}:tiny", "--input", "2x8", "--shapes", "batch=1:4,batch=1:8"], "names 'batch' twice"),
        (["tweak", f"{FACTORY}:tiny", "--input", "2x8", "--shapes", "rows=1:4"], "shapes has an unknown axis 'rows'"),
        (["tweak", f"{FACTORY}:tiny", "--input", "4x8", "--shapes", "batch=1:2"],
         "call 0 of the dataset has batch 4, outside shapes['batch'] = (1, 2)"),
        (["tweak", f"{FACTORY}:tiny", "--input", "4x8", "--shapes", "length=8:512"], "passes no 2-d integer or bool "
         "attention_mask"),
    ],
)
def test_mistakes_get_one_clear_line(args, message, capsys):
    assert main(args) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err
    assert err.startswith("torch-tweak: error:")


@pytest.mark.slow
def test_help_for_each_command():
    for args in (["--help"], ["tweak", "--help"], ["show", "--help"]):
        done = run_cli(*args)
        assert done.returncode == 0 and "usage: torch-tweak" in done.stdout


@pytest.mark.slow
def test_tweak_from_a_factory_saves_shows_and_plots(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    chart, saved = tmp_path / "chart.png", tmp_path / "sleepy.tt"
    # in this process, where the machine's load reads as unknown (conftest): a kept depth, and
    # so a file, whatever else the machine runs (a tweak that keeps nothing saves nothing)
    assert main(["tweak", f"{FACTORY}:sleepy", "--input", "4x8", "--samples", "2",
                 "--quiet", "--plot", str(chart), "--out", str(saved)]) == 0
    out = capsys.readouterr().out
    assert "untuned" in out and "depth" in out
    assert f"saved to {saved}" in out and saved.is_file(), out
    shown = run_cli("show", str(saved))
    assert shown.returncode == 0, shown.stderr
    for field in ("model:", "device:      cpu", "torch:", "depth:"):
        assert field in shown.stdout
    assert "_Sleepy" in shown.stdout
    bad = tmp_path / "bad.tt"
    bad.write_bytes(saved.read_bytes()[:200])
    broken = run_cli("show", str(bad))
    assert broken.returncode == 2 and "Traceback" not in broken.stderr and "error" in broken.stderr
    from PIL import Image

    with Image.open(chart) as image:
        image.verify()
        assert image.format == "PNG" and image.size[0] > 100


def test_a_tweak_that_keeps_nothing_saves_nothing(tmp_path, capsys):
    """Nothing kept (here a time budget of 0): the command says so and writes no file, rather
    than "tuned model saved to ...; in production: ... tt.load(...)" for an untuned model."""
    saved = tmp_path / "tiny.tt"
    assert main(["tweak", f"{FACTORY}:tiny", "--input", "4x8", "--samples", "2", "--quiet", "--time-budget", "0",
                 "--out", str(saved)]) == 0
    out = capsys.readouterr().out
    assert f"nothing kept, nothing saved: the model runs as it did (no file written to {saved})" in out
    assert "saved to" not in out and "tt.load" not in out and not saved.exists()
