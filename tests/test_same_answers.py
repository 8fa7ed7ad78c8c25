"""The same answers as the untuned model, every call (issue 12): a differential harness.

For every registered backend that keeps the answers (torch_tweak.backends.registry) and runs here
(Torch Eager, Torch Inductor, OpenVINO and ONNX Runtime when installed; on
a CUDA machine also the device graph and Inductor in a device graph, on the GPU) a model is
tuned with tt.wrap + tt.tune + tt.OneBackendStrategy(backend) on keyword calls,
then called in many ways: keyword order, positional/keyword mix, non-contiguous inputs,
new shapes, dtypes and plain values, grad mode, and 8 threads x 500 calls. Every output is
compared with an untuned copy of the model called the same way. One tuned model per
backend is shared by the tests of this file (Inductor compiles on a small CPU are slow).
"""

from __future__ import annotations

import copy
import time

import pytest
import torch
from torch import nn

import torch_tweak as tt
from support import in_threads
from torch_tweak.backends import Backend, registry

NO_CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
pytestmark = pytest.mark.slow  # one tuned model per backend (compiles, exports), 8 threads x 500 calls


def device_of(backend_class: type) -> torch.device:
    """Where a backend's harness runs: the CPU, or CUDA for a backend that does not run on it."""
    registration = registry.registration_of(backend_class)  # None: a test's own backend, on the CPU
    return torch.device("cpu" if registration is None or "cpu" in registration.devices else "cuda")


def _param(r: registry.Registration):
    """One built-in backend, skipped where it cannot run (a package not installed, no CUDA)."""
    device = device_of(r.cls)
    if device.type == "cuda":
        return pytest.param(r.cls, id=r.name, marks=NO_CUDA)
    reason = r.cls().unavailable(device)
    return pytest.param(r.cls, id=r.name, marks=pytest.mark.skipif(reason is not None, reason=str(reason)))


BACKENDS = [_param(r) for r in registry.registrations()
            if not r.cls.opt_in and not getattr(r.cls, "needs_varying_sizes", False)]
"""Every registered backend that keeps the module's answers (an opt-in one changes them on purpose),
tuned here on calls of one shape (the padded one serves calls whose sizes vary: test_varying.py)."""
EXACT = ("TorchEager", "TorchInductor", "DeviceGraph")
"""Backends held to 1e-5; any other to 1e-4 (a runtime of its own, Inductor's fusion in a graph)."""


def on(device: torch.device, *tensors: torch.Tensor):
    return tuple(t.to(device) for t in tensors)

THREADS, CALLS_PER_THREAD = 8, 500


class Pair(nn.Module):
    """Not symmetric in a and b, so a swapped argument changes the answer by far more than
    any tolerance."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, a: torch.Tensor, b: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
        return (self.lin(a.float()) - 3.0 * b.float()) * scale


class Encoder(nn.Module):
    """Shaped like a transformers model: forward(input_ids, attention_mask=None)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(50, 8)
        self.lin = nn.Linear(8, 8)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        h = self.lin(self.embed(input_ids))
        if attention_mask is not None:
            h = h * attention_mask.unsqueeze(-1).to(h.dtype) + (1 - attention_mask).unsqueeze(-1) * 5.0
        return h


def tuned(model: nn.Module, samples: list, backend_class: type) -> tuple[nn.Module, nn.Module]:
    """(the model tuned with one backend at its root, an untuned copy of it)."""
    torch.manual_seed(0)
    model.to(device_of(backend_class))
    reference = copy.deepcopy(model).eval()
    model.eval()
    tt.wrap(model, [""])
    chosen = tt.tune(model, samples, strategy=tt.OneBackendStrategy(backend_class()))
    assert chosen == {"": backend_class.name}, tt.installed(model)[""].tt_error
    return model, reference


def close(got, want, backend_class) -> None:
    tol = 1e-5 if backend_class.name in EXACT else 1e-4
    torch.testing.assert_close(got, want, rtol=tol, atol=tol)
    assert got.requires_grad == want.requires_grad


@pytest.fixture(scope="module", params=BACKENDS)
def pair_model(request):
    backend_class = request.param
    torch.manual_seed(0)
    a, b = on(device_of(backend_class), torch.randn(4, 8), torch.randn(4, 8))
    model, reference = tuned(Pair(), [{"a": a, "b": b}, {"a": a + 1, "b": b - 1}], backend_class)
    return backend_class, model, reference


def started(pair_model, seed: int):
    """(backend class, tuned model, untuned copy, its wrapper with fresh counts, a seeded
    generator, the backend's device)."""
    backend_class, model, reference = pair_model
    wrapper = tt.installed(model)[""]
    wrapper.tt_reset_untuned()
    return backend_class, model, reference, wrapper, torch.Generator().manual_seed(seed), device_of(backend_class)


def layouts(a, b):
    """Every way to pass a and b: (args, kwargs)."""
    return [((), {"a": a, "b": b}), ((), {"b": b, "a": a}), ((a, b), {}), ((a,), {"b": b})]


def test_every_layout_gives_the_same_answer_and_is_tuned(pair_model):
    backend_class, model, reference, wrapper, g, device = started(pair_model, 1)
    with torch.no_grad():
        for _ in range(20):
            a, b = on(device, torch.randn(4, 8, generator=g), torch.randn(4, 8, generator=g))
            for args, kwargs in layouts(a, b):
                close(model(*args, **kwargs), reference(*args, **kwargs), backend_class)
    # all 80 calls went to the backend: f(a, b), f(a, b=b) and f(b=b, a=a) are one signature
    assert wrapper.tt_untuned == {"no signature matched": 0, "grad mode": 0, "train mode": 0,
                                  "device graph fell back": 0, "trace fell back": 0}


def test_calls_the_backend_cannot_take_run_the_original_and_are_counted(pair_model):
    backend_class, model, reference, wrapper, g, device = started(pair_model, 2)
    a, b, wide, a6, b6 = on(device, torch.randn(4, 8, generator=g), torch.randn(4, 8, generator=g),
                            torch.randn(8, 16, generator=g), torch.randn(6, 8, generator=g),
                            torch.randn(6, 8, generator=g))
    calls = [
        ((wide[:4, ::2],), {"b": b}),                  # non-contiguous, the recorded shape: tuned
        ((), {"b": wide[::2, 8:].t().t(), "a": a}),   # strided too
        ((a6,), {"b": b6}),                            # new shape
        ((a.double(), b.double()), {}),                # new dtype
        ((a, b), {"scale": 2.0}),                      # a plain value never recorded
        ((a, b, 1.0), {}),                             # the default, given: another layout
    ]
    with torch.no_grad():
        for args, kwargs in calls:
            close(model(*args, **kwargs), reference(*args, **kwargs), backend_class)
    assert not calls[0][0][0].is_contiguous()
    # four calls ran the original: no signature matched them (a device graph checks its own
    # inputs, and counts them as its fallbacks)
    assert sum(wrapper.tt_untuned.values()) == 4 and wrapper.tt_untuned["grad mode"] == 0


def test_grad_mode_keeps_autograd_outputs_and_gradients(pair_model):
    backend_class, model, reference, wrapper, g, device = started(pair_model, 3)
    for args, kwargs in layouts(*on(device, torch.randn(4, 8, generator=g), torch.randn(4, 8, generator=g))):
        got, want = model(*args, **kwargs), reference(*args, **kwargs)  # grad mode on, weights need grad
        close(got, want, backend_class)
        assert got.requires_grad and got.grad_fn is not None
        got.sum().backward()
        want.sum().backward()
        torch.testing.assert_close(tt.installed(model)[""].lin.weight.grad, reference.lin.weight.grad)
        model.zero_grad()
        reference.zero_grad()
    a = torch.randn(4, 8, generator=g).to(device).requires_grad_()
    b = torch.randn(4, 8, generator=g).to(device)
    with torch.no_grad():
        close(model(a, b), reference(a, b), backend_class)  # no_grad: the backend serves it
    grad_calls = wrapper.tt_untuned["grad mode"]
    assert grad_calls == (0 if backend_class.supports_autograd else 4)


def test_eight_threads_get_their_own_answers(pair_model):
    backend_class, model, reference, wrapper, g, device = started(pair_model, 4)
    inputs = [[on(device, torch.randn(4, 8, generator=g), torch.randn(4, 8, generator=g)) for _ in range(10)]
              for _ in range(THREADS)]
    with torch.no_grad():
        expected = [[reference(a, b) for a, b in mine] for mine in inputs]
    wrong = []

    def check(k: int) -> None:  # thread k % THREADS, its call k // THREADS
        t, i = k % THREADS, k // THREADS
        a, b = inputs[t][i % 10]
        args, kwargs = layouts(a, b)[i % 4]
        if not torch.allclose(model(*args, **kwargs), expected[t][i % 10], rtol=1e-4, atol=1e-4):
            wrong.append((t, i))

    in_threads(THREADS * CALLS_PER_THREAD, check, threads=THREADS, mode=torch.no_grad)  # any error fails
    assert wrong == []
    assert sum(wrapper.tt_untuned.values()) == 0  # every call was tuned


@pytest.mark.parametrize("backend_class", BACKENDS)
def test_a_transformers_like_forward_binds_by_name(backend_class):
    torch.manual_seed(0)
    device = device_of(backend_class)
    ids = torch.randint(0, 50, (2, 6), device=device)
    mask = torch.ones(2, 6, dtype=torch.int64, device=device)
    mask[:, 4:] = 0
    model, reference = tuned(Encoder(), [{"input_ids": ids, "attention_mask": mask}], backend_class)
    wrapper = tt.installed(model)[""]
    wrapper.tt_reset_untuned()
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for _ in range(5):
            ids, mask = on(device, torch.randint(0, 50, (2, 6), generator=g), torch.randint(0, 2, (2, 6), generator=g))
            for args, kwargs in [((), {"input_ids": ids, "attention_mask": mask}),
                                 ((), {"attention_mask": mask, "input_ids": ids}),
                                 ((ids, mask), {}), ((ids,), {"attention_mask": mask})]:
                close(model(*args, **kwargs), reference(*args, **kwargs), backend_class)
        close(model(ids), reference(ids), backend_class)  # no mask: not recorded, runs the original
    assert sum(wrapper.tt_untuned.values()) == 1


class SharedSlotBackend(Backend):
    """Keeps each call's input in one shared slot and reads it back after a pause: right
    answers only while calls come one at a time, which thread_safe = False asks for."""

    name = "SharedSlot"
    thread_safe = False

    def build(self, module, samples, device):
        slot = {}

        def run(a, b):
            slot["a"], slot["b"] = a, b
            time.sleep(0)  # lets another thread in, were it allowed
            return module(slot["a"], slot["b"])

        return run


def test_a_backend_that_is_not_thread_safe_is_serialised():
    torch.manual_seed(0)
    a, b = torch.randn(4, 8), torch.randn(4, 8)
    model, reference = tuned(Pair(), [((a, b), {})], SharedSlotBackend)
    g = torch.Generator().manual_seed(6)
    inputs = [(torch.randn(4, 8, generator=g), torch.randn(4, 8, generator=g)) for _ in range(THREADS)]
    with torch.no_grad():
        expected = [reference(x, y) for x, y in inputs]
    wrong = []

    def check(k: int) -> None:  # thread k % THREADS, on its own inputs
        t = k % THREADS
        if not torch.equal(model(*inputs[t]), expected[t]):
            wrong.append(t)

    in_threads(THREADS * CALLS_PER_THREAD, check, threads=THREADS, mode=torch.no_grad)
    assert wrong == []
