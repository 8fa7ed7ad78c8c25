"""OpenVINO's models per exact call shape (backends.openvino.StaticShapes), on the CPU: a
module converted with dynamic sizes gets, at a shape's second call, a model compiled for that
shape, checked against the module on that call before it serves. Every call here is compared
with the module itself (an untuned copy); a model that answers wrong is refused, a cap holds,
eight threads share the models."""

from __future__ import annotations

import copy
import threading

import pytest
import torch
from torch import nn

import torch_tweak as tt
from torch_tweak.backends import OpenVINOBackend
from torch_tweak.backends import openvino as ovb

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


def build(module, **config):
    samples = [((), call(2, 5, 0)), ((), call(3, 7, 1))]  # sizes that vary: converted dynamic
    return OpenVINOBackend(**config).build(module, samples, CPU)


def same(run, module, kwargs) -> None:
    with torch.no_grad():
        torch.testing.assert_close(run(**kwargs), module(**kwargs), rtol=1e-5, atol=1e-5)


def test_a_shapes_second_call_compiles_its_model_which_serves_its_later_calls(module):
    run = build(module)
    special = run.static_shapes
    for seed in range(4):  # four calls of one shape, each another prompt
        same(run, module, call(4, 9, seed))
    same(run, module, call(1, 3, 9))  # a shape seen once: not compiled
    assert list(special.ready) == [((4, 9), (4, 9))]
    assert special.served == 3  # the second call (checked, then answered by it), the third and the fourth
    assert not special.refused
    assert "models for 1 exact call shapes (of at most 32), 3 calls served" in special.describe()["line"]


def test_a_model_that_answers_wrong_is_refused_and_the_shape_stays_dynamic(module, monkeypatch):
    """The shape's model is compiled from another module's weights: its check against the
    module fails, the dynamic model answers, and the shape is not compiled again."""
    run = build(module)
    special = run.static_shapes
    other = copy.deepcopy(module)
    with torch.no_grad():
        other.head.bias.add_(0.5)
    special.model = build(other).static_shapes.model  # what the shape's compile starts from
    compiles = []
    real = ovb.StaticShapes._specialise
    monkeypatch.setattr(ovb.StaticShapes, "_specialise", lambda self, *a: compiles.append(1) or real(self, *a))
    for seed in range(5):
        same(run, module, call(2, 6, seed))
    assert not special.ready and list(special.refused) == [((2, 6), (2, 6))]
    assert "MismatchError" in special.refused[((2, 6), (2, 6))] and special.served == 0
    assert len(compiles) == 1
    assert "1 refused" in special.describe()["line"]


def test_the_count_cap_and_the_memory_cap_hold(module):
    run = build(module, static_shapes=2)
    for length in (4, 5, 6, 7):
        for seed in range(2):
            same(run, module, call(1, length, seed))
    assert len(run.static_shapes.ready) == 2
    assert build(module, static_memory_mb=0).static_shapes is None  # no room for one model
    assert build(module, static_shapes=0).static_shapes is None
    samples = [((), call(2, 5, 0))] * 2  # one shape: converted static, nothing to add
    assert OpenVINOBackend().build(module, samples, CPU).static_shapes is None
    for bad in (-1, True, 1.5):
        with pytest.raises(ValueError, match="static_shapes must be an int >= 0"):
            OpenVINOBackend(static_shapes=bad)


def test_eight_threads_of_mixed_shapes_get_the_modules_answers(module):
    run = build(module)
    shapes = [(1, 4), (2, 8), (3, 5), (4, 11)]
    errors: list = []

    def serve(t: int) -> None:
        try:
            for i in range(12):
                b, n = shapes[(t + i) % len(shapes)]
                same(run, module, call(b, n, 100 * t + i))
        except Exception as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=serve, args=(t,)) for t in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors[0]
    assert run.static_shapes.ready and set(run.static_shapes.ready) <= {(s, s) for s in shapes}
    for b, n in shapes:  # a shape whose second calls all met another thread's compile: compiled now
        same(run, module, call(b, n, 7))
    assert set(run.static_shapes.ready) == {(s, s) for s in shapes}
    assert run.static_shapes.served > 0 and not run.static_shapes.refused


class Outer(nn.Module):
    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, **kwargs) -> torch.Tensor:
        return self.inner(**kwargs) * 2


def test_a_tuned_module_serves_through_them_and_status_says_so(module):
    model = Outer(copy.deepcopy(module))
    untuned = copy.deepcopy(model)
    data = [call(b, n, s) for s, (b, n) in enumerate([(1, 4), (2, 6), (4, 9), (2, 6)])]
    (w,) = tt.wrap(model, ["inner"], strategy=tt.OneBackendStrategy(OpenVINOBackend()))
    tt.tune(model, data, measure={"rounds_max": 5, "time_cap": 0.5})
    assert w.tt_backend is not None and w.tt_backend.name == "OpenVINO", w.tt_error
    for seed in range(3):
        kwargs = call(3, 10, 50 + seed)  # a shape tuning never saw: its second call compiles its model
        with torch.no_grad():
            torch.testing.assert_close(model(**kwargs), untuned(**kwargs), rtol=1e-5, atol=1e-5)
    text = str(tt.status(model))
    assert "inner" in text and "OpenVINO models for" in text and "exact call shapes" in text, text
