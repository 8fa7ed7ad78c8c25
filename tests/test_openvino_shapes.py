"""OpenVINO's models per exact call shape (backends._ov_shapes.StaticShapes), on the CPU: a
module converted with dynamic sizes compiles the recorded calls' shapes when it is built, and
hands another shape to a compiling thread once its calls have taken a compile's time (not
before its second call; most tests here make that time 0, patience=0); the first call after
a compile is checked against the module before the shape's model serves. Every call here is
compared with the module itself (an untuned copy); a model that answers wrong is refused, a
cap holds, eight threads share the models, a fork waits for a compile."""

from __future__ import annotations

import copy
import itertools
import time
from pathlib import Path

import pytest
import torch
from torch import nn

import support
import torch_tweak as tt
from torch_tweak.backends import OpenVINOBackend
from torch_tweak.backends import _ov_shapes as ov_shapes
from support import in_threads

pytest.importorskip("openvino", reason="OpenVINO not installed: pip install torch-tweak[openvino]")
CPU = torch.device("cpu")


class Masked(nn.Module):
    """Token ids and their attention mask, of any batch and length."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(50, 16)
        self.mix = nn.Linear(16, 16)
        self.head = nn.Linear(16, 8)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.mix(self.embed(input_ids)))
        h = h * attention_mask.unsqueeze(-1).to(h.dtype)
        return self.head(h.cumsum(1))


def call(batch: int, length: int, seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"input_ids": torch.randint(0, 50, (batch, length), generator=g),
            "attention_mask": torch.ones(batch, length, dtype=torch.long)}


@pytest.fixture(scope="module")
def module():
    torch.manual_seed(0)
    return Masked().eval()


RECORDED = {((2, 5), (2, 5)), ((3, 7), (3, 7))}


def build(module, patience: float = 0.0, **config):
    samples = [((), call(2, 5, 0)), ((), call(3, 7, 1))]  # sizes that vary: converted dynamic
    run = OpenVINOBackend(**config).build(module, samples, CPU)
    if run.static_shapes is not None:
        run.static_shapes.patience = patience
    return run


def same(run, module, kwargs) -> None:
    with torch.no_grad():
        torch.testing.assert_close(run(**kwargs), module(**kwargs), rtol=1e-5, atol=1e-5)


def test_a_shapes_model_is_compiled_off_the_call_path_and_checked_before_it_serves(module):
    run = build(module)
    special = run.static_shapes
    assert set(special.compiled) == RECORDED and not special.ready  # the recorded shapes: compiled at build
    same(run, module, call(2, 5, 7))  # checked against the module, then answered by the model
    assert set(special.ready) == {((2, 5), (2, 5))} and special.served == 1
    same(run, module, call(4, 9, 0))
    same(run, module, call(4, 9, 1))  # the second call: handed to the compiling thread
    special.wait()
    assert set(special.compiled) == {((4, 9), (4, 9)), ((3, 7), (3, 7))}
    same(run, module, call(4, 9, 2))  # checked, then answered by the model
    assert ((4, 9), (4, 9)) in special.ready and special.served == 2
    for seed in (3, 4):
        same(run, module, call(4, 9, seed))
    assert special.served == 4
    same(run, module, call(1, 3, 9))  # a shape seen once: not compiled
    special.wait()
    assert set(special.ready) == {((2, 5), (2, 5)), ((4, 9), (4, 9))} and not special.refused
    assert set(special.compiled) == {((3, 7), (3, 7))}
    assert "static shapes for 2 call shapes (of at most 32), 4 calls served" in special.describe()["line"]


def test_a_new_shape_gets_its_model_once_its_calls_took_a_compiles_time(module, monkeypatch):
    """The rule a service's traffic meets: a shape's calls on the dynamic model are timed, and
    the shape is handed over once they add up to one compile's time (the compiles' mean so
    far): a shape seen a few times costs no compile, one that keeps coming gets its model.
    Here the default patience's compiles are made to count as 50 ms and each dynamic call to
    take 20 ms: the third call hands the shape over, not the second."""
    run = build(module, patience=tt.settings.OV_PATIENCE)
    special = run.static_shapes
    assert special.compiles[0] == 2 and special.compile_s > 0  # the recorded shapes' compiles, timed
    special.compiles = (1, 0.05 / tt.settings.OV_PATIENCE)  # at the default patience, 50 ms of calls
    ticks = itertools.count()
    monkeypatch.setattr(ov_shapes, "_clock", lambda: next(ticks) * 0.02)  # every timed call: 20 ms
    handed = []
    real = ov_shapes.StaticShapes._hand
    monkeypatch.setattr(ov_shapes.StaticShapes, "_hand", lambda self, key: handed.append(key) or real(self, key))
    for seed in range(2):
        same(run, module, call(5, 6, seed))
    assert handed == [] and special.seen[((5, 6), (5, 6))][0] == 2
    same(run, module, call(5, 6, 2))
    assert handed == [((5, 6), (5, 6))]
    special.wait()
    same(run, module, call(5, 6, 3))
    assert ((5, 6), (5, 6)) in special.ready


@pytest.mark.slow
def test_a_model_that_answers_wrong_is_refused_and_the_shape_stays_dynamic(module, monkeypatch):
    """The shape's model is compiled from another module's weights: its check against the
    module fails, the dynamic model answers, and the shape is not compiled again."""
    run = build(module)
    special = run.static_shapes
    other = copy.deepcopy(module)
    with torch.no_grad():
        other.head.bias.add_(0.5)
    special.model = build(other).static_shapes.model  # what the shape's compile starts from
    handed = []
    real = ov_shapes.StaticShapes._hand
    monkeypatch.setattr(ov_shapes.StaticShapes, "_hand", lambda self, key: handed.append(key) or real(self, key))
    for seed in range(6):
        same(run, module, call(2, 6, seed))
        special.wait()
    assert not special.ready and list(special.refused) == [((2, 6), (2, 6))]
    assert "MismatchError" in special.refused[((2, 6), (2, 6))] and special.served == 0
    assert handed == [((2, 6), (2, 6))]
    assert "1 refused" in special.describe()["line"]


def test_a_compile_that_fails_leaves_the_shape_on_the_dynamic_model(module, monkeypatch):
    run = build(module)
    special = run.static_shapes

    class Broken:
        def compile_model(self, *args):
            raise RuntimeError("no compile here")

    monkeypatch.setattr(special, "ov", type("OV", (), {"Core": Broken, "PartialShape": special.ov.PartialShape}))
    for seed in range(4):
        same(run, module, call(3, 4, seed))
        special.wait()
    assert special.refused[((3, 4), (3, 4))] == "RuntimeError: no compile here" and not special.ready


@pytest.mark.slow
def test_the_count_cap_and_the_memory_cap_hold(module):
    run = build(module, static_shapes=3)  # the two recorded shapes, and one more
    for length in (4, 5, 6, 7):
        for seed in range(3):
            same(run, module, call(1, length, seed))
            run.static_shapes.wait()
    # the 4-token length: handed over at its second call, checked and serving at its third;
    # the other lengths find no room (the recorded shapes hold theirs, though never called)
    assert set(run.static_shapes.compiled) == RECORDED and set(run.static_shapes.ready) == {((1, 4), (1, 4))}
    assert set(build(module, static_shapes=1).static_shapes.compiled) == {((2, 5), (2, 5))}
    assert build(module, static_memory_mb=0).static_shapes is None  # no room for one model
    assert build(module, static_shapes=0).static_shapes is None
    samples = [((), call(2, 5, 0))] * 2  # one shape: converted static, nothing to add
    assert OpenVINOBackend().build(module, samples, CPU).static_shapes is None
    capped = build(module)
    capped.static_shapes.seen.update({((9, k), (9, k)): [1, 0.0] for k in range(tt.settings.OV_SEEN_MAX)})
    same(capped, module, call(1, 5, 0))
    seen = capped.static_shapes.seen
    assert list(seen) == [((1, 5), (1, 5))] and seen[((1, 5), (1, 5))][0] == 1  # the counts start again, bounded
    for bad in (-1, True, 1.5):
        with pytest.raises(ValueError, match="static_shapes must be an int >= 0"):
            OpenVINOBackend(static_shapes=bad)


@pytest.mark.slow
def test_eight_threads_of_mixed_shapes_get_the_modules_answers(module):
    run = build(module)
    shapes = [(1, 4), (2, 8), (3, 5), (4, 11)]
    # 96 calls over 8 threads, each its own prompt, the shapes mixed in every thread
    in_threads(96, lambda i: same(run, module, call(*shapes[(i // 8 + i) % len(shapes)], i)))
    run.static_shapes.wait()
    for b, n in shapes:  # a shape compiled after the threads' last call of it is checked here
        same(run, module, call(b, n, 7))
    assert set(run.static_shapes.ready) == {(s, s) for s in shapes}
    assert run.static_shapes.served > 0 and not run.static_shapes.refused


class Outer(nn.Module):
    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, **kwargs) -> torch.Tensor:
        return self.inner(**kwargs) * 2


def until(condition, seconds: float = 30.0) -> bool:
    end = time.monotonic() + seconds
    while not condition():
        if time.monotonic() > end:
            return False
        time.sleep(0.01)
    return True


@pytest.mark.slow
def test_a_dropped_model_is_freed_and_an_idle_compiling_thread_ends(module, monkeypatch):
    """Found by an attack: the compiling thread held its model for good, so a service that
    reloaded its model, or a notebook that tuned again, kept every earlier model's weights and
    compiled models and one thread each. The thread holds the model only while it compiles:
    dropped, the model is freed, and its thread ends; a thread with nothing to compile ends
    after OV_IDLE_SECONDS, and the next shape handed over starts another."""
    import gc
    import weakref

    monkeypatch.setattr(tt.settings, "OV_IDLE_SECONDS", 0.2)
    run = build(copy.deepcopy(module))
    special = run.static_shapes
    for seed in range(2):
        same(run, module, call(4, 9, seed))  # the second call hands the shape over
    first = special.worker
    assert first is not None and until(lambda: ((4, 9), (4, 9)) in special.compiled)
    assert until(lambda: not first.is_alive()) and special.worker is None  # idle: ended
    for seed in range(3):
        same(run, module, call(5, 3, seed))  # a new shape starts another thread; checked, then served
        until(lambda: not special.pending)
    assert ((5, 3), (5, 3)) in special.ready and special.served >= 1
    for seed in range(2):
        same(run, module, call(6, 2, seed))
    second = special.worker
    assert second is not None and second is not first and until(lambda: not special.pending)
    owner = weakref.ref(special)
    weights = weakref.ref(special.module.mix.weight)
    del run, special
    gc.collect()
    assert owner() is None and weights() is None  # nothing the thread holds keeps them
    assert until(lambda: not second.is_alive())


@pytest.mark.slow
def test_a_tuned_module_serves_through_them_and_status_says_so(module):
    model = Outer(copy.deepcopy(module))
    untuned = copy.deepcopy(model)
    data = [call(b, n, s) for s, (b, n) in enumerate([(1, 4), (2, 6), (4, 9), (2, 6)])]
    (w,) = tt.wrap(model, ["inner"], strategy=tt.OneBackendStrategy(OpenVINOBackend()))
    tt.tune(model, data, measure={"rounds_max": 5, "time_cap": 0.5})
    assert w.tt_backend is not None and w.tt_backend.name == "OpenVINO", w.tt_error
    special = w.tt_backend.callable.static_shapes
    # the recorded shapes were compiled at the build and checked by tuning's own calls
    assert set(special.ready) == {((1, 4), (1, 4)), ((2, 6), (2, 6)), ((4, 9), (4, 9))}, special.refused
    served = special.served
    special.patience = 0.0  # a new shape is handed over at its second call
    for seed in range(5):
        for b, n in ((2, 6), (3, 10)):  # a recorded shape and one tuning never saw
            kwargs = call(b, n, 50 + seed)
            with torch.no_grad():
                torch.testing.assert_close(model(**kwargs), untuned(**kwargs), rtol=1e-5, atol=1e-5)
        special.wait()
    text = str(tt.status(model))
    assert "inner" in text and "OpenVINO models of static shapes for 4 call shapes" in text, text
    assert ((3, 10), (3, 10)) in special.ready and special.served >= served + 5 + 3


@pytest.mark.slow
def test_a_fork_waits_for_the_compile_in_progress_and_the_child_starts_clean(module):
    """The isolated builds of tuning fork: the child gets no half-held compile lock and no
    compiling thread of its parent's; it hands shapes to a thread of its own."""
    import os
    run = build(module)
    special = run.static_shapes
    for seed in range(2):
        same(run, module, call(2, 3, seed))  # handed over: a compile may be running now
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            # as tuning's isolated builds do (_search/isolation.py): the parent's OpenMP team is
            # not in this process, and torch's next parallel op would wait for it forever
            torch.set_num_threads(1)
            assert special.worker is None and not special.pending
            for seed in range(2):
                same(run, module, call(1, 7, seed))
            special.wait()
            code = 0 if ((1, 7), (1, 7)) in {**special.compiled, **special.ready} else 2
        finally:
            os._exit(code)
    status = support.wait_child(pid, 120)
    assert status == 0, f"the forked child ended with {status}"
    special.wait()
    assert ((2, 3), (2, 3)) in special.compiled


@pytest.mark.slow
def test_a_process_that_exits_during_a_warm_up_drops_the_shapes_still_waiting(tmp_path):
    """At exit the compile in progress ends and the shapes still waiting are not compiled (a
    process would otherwise wait for every one of them, with the rests between them)."""
    import subprocess
    import sys

    script = tmp_path / "exits.py"
    script.write_text(
        "import atexit, sys\n"
        "late = []\n"  # registered before torch_tweak's own handler: runs after it
        "atexit.register(lambda: print('compiled by the end', len(late[0].compiled) + len(late[0].ready)))\n"
        "import torch\n"
        f"sys.path.insert(0, {str(Path(__file__).parent)!r})\n"
        "from test_openvino_shapes import Masked, build, call\n"
        "torch.manual_seed(0)\n"
        "run = build(Masked().eval())\n"
        "late.append(run.static_shapes)\n"
        "for n in range(2, 42):\n"
        "    for seed in range(2):\n"
        "        run(**call(1, n, seed))\n"
        "s = run.static_shapes\n"
        "print('compiled at exit', len(s.compiled) + len(s.ready), 'waiting', s.jobs.qsize(), flush=True)\n")
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    words = out.stdout.split()
    at_exit, waiting, by_end = int(words[3]), int(words[5]), int(words[-1])
    assert waiting >= 10, out.stdout  # a backlog was there to drop
    assert by_end <= at_exit + 1, out.stdout  # the one in progress at most


@pytest.mark.slow
def test_status_counts_the_same_calls_as_the_shapes_line_after_tune_and_load(tmp_path):
    """tt.status said "calls 3" beside "6 calls served" after tt.load: the shapes' models
    counted the build's and tt.load's own checks. Both count the user's calls only."""
    def fresh() -> nn.Module:
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 8)).eval()

    data = [torch.randn(b, 8) for b in (2, 4, 6)]
    model, untuned = fresh(), fresh()
    tt.wrap(model, [""], strategy=tt.OneBackendStrategy(OpenVINOBackend()))
    tt.tune(model, data)
    assert "0 calls served by them" in tt.status(model).shapes_lines()[0] and tt.status(model)[""].calls == 0
    tt.save(model, tmp_path / "m.tt")
    loaded = fresh()
    tt.load(loaded, tmp_path / "m.tt")
    with torch.inference_mode():
        for x in data:
            assert torch.allclose(loaded(x), untuned(x), rtol=1e-4, atol=1e-5)
    status = tt.status(loaded)
    assert status[""].calls == 3
    assert "3 call shapes (of at most 32), 3 calls served by them" in status.shapes_lines()[0], status.shapes_lines()
