"""What tt.save writes, tt.load reads: round trips into a new process.

tt.save wrote a file tt.load refused ("the stored calls of (root) are damaged: at most 8 stored
calls per signature"): with shapes=, 7 or more calls of one shape class left the class's group
8 calls of the traffic and the 2 at the declared ends. Here every combination of shapes= (none,
batch, length, both) and of dataset sizes at the edges of the bound (1, 7, 8, 9 and 32 calls
per shape class, in two shape classes) is tuned, saved, and loaded in one fresh interpreter,
with Torch Eager where the point is the file, and once with each other backend this machine
has (Torch Inductor, OpenVINO, ONNX Runtime); the tuning cache's round (an entry written, then
replayed on a fresh model, then saved) too. The child builds the model afresh, loads each file
with no warning, and must give the untuned model's outputs, the same signature groups and
backends as the tuned model, and run the original forward for the same calls.

The tweaks run on the fake clock (conftest.FakeClock): each backend is built, while tuning
only, on the model's inner layer, skipping its 2 ms wait (support.pause), so the tweak keeps
depth 0 on any machine. The file names the built-in backend as a user's does, and the child
builds it on the whole model, as tt.load does."""

from __future__ import annotations

import contextlib
import copy
import functools
import json
import os
import subprocess
import sys
import warnings

import pytest
import torch
from torch import nn

import torch_tweak as tt
import support
from support import FAST
from test_varying import requests

pytestmark = pytest.mark.slow  # a child interpreter, and tens of tweaks

TESTS = os.path.dirname(os.path.abspath(__file__))

SHAPES = {"none": None, "batch": {"batch": (1, 32)}, "length": {"length": (4, 48)},
          "both": {"batch": (1, 32), "length": (4, 48)}}
SIZES = (1, 7, 8, 9, 32)
"""Calls per shape class: one, the bound's edges (8 of the traffic per group), and many."""
CACHED = (1, 8, 9, 32)
"""The dataset sizes whose tuning-cache round is saved too, for every shapes=."""


class Pool(nn.Module):
    """Token embeddings averaged over the valid positions, after a 2 ms wait (support.pause)."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = Inner()

    def forward(self, input_ids, attention_mask):
        support.pause(0.002)
        return self.inner(input_ids, attention_mask)


class Inner(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(50, 8)
        self.out = nn.Linear(8, 4)

    def forward(self, input_ids, attention_mask):
        m = attention_mask.unsqueeze(-1).to(torch.float32)
        return self.out((self.embed(input_ids) * m).sum(1) / m.sum(1).clamp(min=1))


def pool() -> Pool:
    torch.manual_seed(0)
    return Pool().eval()


def dataset(n: int) -> list[dict]:
    """n calls of each of two shape classes (an int64 mask, a bool one), sizes within every
    declared range (batch 1 to 3, length 6 to 29)."""
    longs = requests(n, n, batches=(1, 2, 3), lengths=range(6, 30))
    bools = [{"input_ids": r["input_ids"], "attention_mask": r["attention_mask"].bool()}
             for r in requests(n, 100 + n, batches=(1, 2, 3), lengths=range(6, 30))]
    return [call for pair in zip(longs, bools) for call in pair]


def probes(n: int, shapes: str) -> list[dict]:
    """The dataset's calls, then calls at the declared ranges' ends and within them."""
    batch = (SHAPES[shapes] or {}).get("batch", (1, 3))
    length = (SHAPES[shapes] or {}).get("length", (6, 29))
    edges = [{"input_ids": torch.ones(b, t, dtype=torch.long), "attention_mask": torch.ones(b, t, dtype=torch.long)}
             for b, t in ((batch[0], length[0]), (batch[1], length[1]))]
    inside = requests(4, 7, batches=range(batch[0], batch[1] + 1), lengths=range(length[0], length[1] + 1))
    return dataset(n) + edges + inside


def served(model: nn.Module, calls: list[dict]) -> tuple[list[torch.Tensor], int]:
    """The model's outputs on `calls`, and how many ran an original forward."""
    with torch.inference_mode():
        outputs = [model(**call) for call in calls]
    return outputs, sum(sum(w.tt_untuned.values()) for w in tt.installed(model).values())


def groups_of(model: nn.Module) -> dict[str, list]:
    return {path: [[g.text, None if g.backend is None else g.backend.name] for g in w.tt_signatures]
            for path, w in tt.installed(model).items()}


@contextlib.contextmanager
def tuning(folder, backends):
    """The fake clock for every measurement (conftest.fake_clock, for a module's fixture), a
    cache folder of its own, and each of `backends` built on the model's inner layer."""
    from support import CLOCKED, FakeClock
    from torch_tweak import _C
    from torch_tweak._store import tuning_cache

    clock = FakeClock()

    def clocked(real, *args, **kwargs):
        kwargs.setdefault("clock", clock)
        return real(*args, **kwargs)

    with pytest.MonkeyPatch.context() as patch:
        for name in CLOCKED:
            patch.setattr(_C, name, functools.partial(clocked, getattr(_C, name)))
        patch.setattr(support, "CLOCK", clock)
        patch.setenv("TORCH_TWEAK_CACHE", str(folder))
        patch.setattr(tuning_cache, "REPLAYED", ("consistent", "remeasured", "inconsistent"))
        for cls in backends:
            build = cls.build
            patch.setattr(cls, "build", lambda self, module, samples, device, build=build:
                          build(self, getattr(module, "inner", module), samples, device))
        yield


def tweak(backend, n: int, shapes: str, cache: bool = False):
    model = pool()
    result = tt.tweak(model, dataset(n), strategy=tt.OneBackendStrategy(backend), max_depth=0, progress=False,
                      measure=FAST, cache=cache, shapes=SHAPES[shapes])
    return model, result


def case(folder, name: str, model: nn.Module, n: int, shapes: str, backend: str) -> dict:
    """Saves the tuned `model` as `name`, with what the child must find on loading it."""
    path = folder / f"{name}.tt"
    tt.save(model, path)
    outputs, untuned = served(model, probes(n, shapes))
    reference = pool()
    with torch.inference_mode():
        error = max(float((o - reference(**c)).abs().max()) for o, c in zip(outputs, probes(n, shapes)))
    return {"name": name, "file": str(path), "n": n, "shapes": shapes, "backend": backend,
            "groups": groups_of(model), "untuned": untuned, "tuned_error": error}


CHILD = r"""
import json, sys, warnings
sys.path.insert(0, {tests!r})
import torch, torch_tweak as tt, support
import test_round_trips as rt

class Free:  # the model's wait costs nothing here: it is no measurement
    def advance(self, ns):
        pass

support.CLOCK = Free()
results = {{}}
for case in json.load(open({cases!r})):
    got = {{}}
    try:
        model = rt.pool()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            got["loaded"] = tt.load(model, case["file"])
        got["warnings"] = [str(w.message)[:300] for w in caught]
        calls = rt.probes(case["n"], case["shapes"])
        outputs, got["untuned"] = rt.served(model, calls)
        reference = rt.pool()
        with torch.inference_mode():
            got["error"] = max(float((o - reference(**c)).abs().max()) for o, c in zip(outputs, calls))
        got["groups"] = rt.groups_of(model)
    except Exception as exc:
        got["refused"] = f"{{type(exc).__name__}}: {{exc}}"
    results[case["name"]] = got
json.dump(results, open({out!r}, "w"))
"""


def loaded_elsewhere(folder, cases: list[dict], timeout: float) -> dict:
    """Each case's file loaded in one fresh interpreter: {name: what it found}."""
    (folder / "cases.json").write_text(json.dumps(cases))
    out = folder / "results.json"
    code = CHILD.format(tests=TESTS, cases=str(folder / "cases.json"), out=str(out))
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def eager_round_trips(tmp_path_factory):
    """Every shapes= and dataset size with Torch Eager, and the cache's round of CACHED: saved
    here, loaded in one child."""
    folder = tmp_path_factory.mktemp("round-trips")
    cases = []
    with tuning(folder / "cache", [tt.backends.TorchEagerBackend]), warnings.catch_warnings():
        warnings.simplefilter("error")  # tt.save and tweak say nothing about these files
        for shapes in SHAPES:
            for n in SIZES:
                model, result = tweak(tt.backends.TorchEagerBackend(), n, shapes, cache=n in CACHED)
                assert result.selected_depth == 0, (shapes, n, str(result))
                cases.append(case(folder, f"eager-{shapes}-{n}", model, n, shapes, "TorchEager"))
                if n in CACHED:
                    model, result = tweak(tt.backends.TorchEagerBackend(), n, shapes, cache=True)
                    assert result.cached and result.selected_depth == 0, (shapes, n)
                    cases.append(case(folder, f"cached-{shapes}-{n}", model, n, shapes, "TorchEager"))
    return {c["name"]: c for c in cases}, loaded_elsewhere(folder, cases, timeout=600)


def check(expected: dict, got: dict, tolerance: float) -> None:
    assert "refused" not in got, got["refused"]
    assert got["warnings"] == []  # no rebuild failed, nothing runs the original that did not before
    assert got["loaded"] == {"": expected["backend"]}
    assert got["groups"] == expected["groups"]
    assert got["untuned"] == expected["untuned"]
    assert got["error"] <= tolerance and expected["tuned_error"] <= tolerance, (got["error"], expected["tuned_error"])


@pytest.mark.parametrize("shapes", SHAPES)
@pytest.mark.parametrize("n", SIZES)
def test_an_eager_file_loads_in_a_new_process(eager_round_trips, shapes, n):
    cases, results = eager_round_trips
    name = f"eager-{shapes}-{n}"
    check(cases[name], results[name], 0.0)
    if SHAPES[shapes] is not None:  # the declared ends widen the first class's group, stored and read back
        (text,) = [t for t, _ in cases[name]["groups"][""] if "attention_mask=int64" in t]
        assert ("input_ids=int64[1-32, " in text) == ("batch" in SHAPES[shapes]), text
        assert ("4-48]" in text) == ("length" in SHAPES[shapes]), text


@pytest.mark.parametrize("shapes", SHAPES)
@pytest.mark.parametrize("n", CACHED)
def test_a_file_of_a_cache_hit_loads_in_a_new_process(eager_round_trips, shapes, n):
    cases, results = eager_round_trips
    check(cases[f"cached-{shapes}-{n}"], results[f"cached-{shapes}-{n}"], 0.0)
    assert cases[f"cached-{shapes}-{n}"]["groups"] == cases[f"eager-{shapes}-{n}"]["groups"]


def _other_backends() -> list[tuple[str, type]]:
    found = [("TorchInductor", tt.backends.TorchInductorBackend)]
    for name, cls, package in (("OpenVINO", tt.backends.OpenVINOBackend, "openvino"),
                               ("ONNXRuntime", tt.backends.ONNXRuntimeBackend, "onnxruntime")):
        try:
            __import__(package)
        except ImportError:
            continue
        found.append((name, cls))
    return found


@pytest.fixture(scope="module")
def other_round_trips(tmp_path_factory):
    """Each other backend of this machine on the case that was refused (shapes= both, 9 calls per
    class), and OpenVINO's cache round: saved here, loaded in one child."""
    folder = tmp_path_factory.mktemp("round-trips-backends")
    backends = _other_backends()
    cases = []
    with tuning(folder / "cache", [cls for _, cls in backends]):
        for name, cls in backends:
            model, result = tweak(cls(), 9, "both", cache=cls is tt.backends.OpenVINOBackend)
            assert result.selected_depth == 0, (name, str(result))
            cases.append(case(folder, name, model, 9, "both", model_backend(model)))
            if cls is tt.backends.OpenVINOBackend:
                model, result = tweak(cls(), 9, "both", cache=True)
                assert result.cached and result.selected_depth == 0
                cases.append(case(folder, f"cached-{name}", model, 9, "both", model_backend(model)))
    return {c["name"]: c for c in cases}, loaded_elsewhere(folder, cases, timeout=900)


def model_backend(model: nn.Module) -> str:
    return tt.installed(model)[""].tt_backend.name


@pytest.mark.parametrize("name", ["TorchInductor", "OpenVINO", "ONNXRuntime", "cached-OpenVINO"])
def test_a_file_of_each_backend_loads_in_a_new_process(other_round_trips, name):
    cases, results = other_round_trips
    if name not in cases:
        pytest.skip(f"{name.removeprefix('cached-')} is not installed")
    got = copy.deepcopy(results[name])  # the backends' packages may warn of their own; tt.load says nothing
    got["warnings"] = [w for w in got.get("warnings", []) if "tt.load" in w or cases[name]["file"] in w]
    check(cases[name], got, 1e-4)
