"""Untuned calls are counted per module and reason, and the first one per (module, reason)
logs one warning (issue 12); tt.status(model) shows them per module and summed."""

from __future__ import annotations

import importlib.util
import logging

import pytest
import torch
from torch import nn

import torch_tweak as tt
from torch_tweak.backends import OpenVINOBackend, TorchEagerBackend

from support import MLP

HAS_OPENVINO = importlib.util.find_spec("openvino") is not None
ZERO = {"no signature matched": 0, "grad mode": 0, "train mode": 0, "device graph fell back": 0,
        "trace fell back": 0}


def tuned_mlp(backend=TorchEagerBackend):
    torch.manual_seed(0)
    model = MLP().eval()
    tt.wrap(model, ["blocks.0", "blocks.1", "head"])
    tt.tune(model, [torch.randn(8, 16)], strategy=tt.OneBackendStrategy(backend()))
    return model


def warnings_of(caplog):
    return [r.getMessage() for r in caplog.records if r.name == "torch_tweak" and r.levelno == logging.WARNING]


def test_tuning_own_calls_are_not_counted_and_matching_calls_are_not_either():
    model = tuned_mlp()
    with torch.no_grad():
        model(torch.randn(8, 16))
    status = tt.status(model)
    assert set(status) == {"blocks.0", "blocks.1", "head"}
    assert all(s.untuned == ZERO and s.backend == "TorchEager" and s.active for s in status.values())
    assert status.untuned == ZERO


def test_a_call_of_no_recorded_signature_is_counted_and_logged_once_per_module(caplog):
    model = tuned_mlp()
    caplog.set_level(logging.WARNING, logger="torch_tweak")
    with torch.no_grad():
        for _ in range(3):
            model(torch.randn(5, 16))  # another batch size
    status = tt.status(model)
    assert [status[p].untuned["no signature matched"] for p in ("blocks.0", "blocks.1", "head")] == [3, 3, 3]
    assert status.untuned["no signature matched"] == 9
    messages = warnings_of(caplog)
    assert len(messages) == 3  # one per module, not one per call
    assert all("no signature matched" in m and "tt.status" in m for m in messages)
    assert {m.split(" ran ")[0].rsplit(" ", 1)[-1] for m in messages} == {"blocks.0", "blocks.1", "head"}
    text = str(status)
    assert "no signature matched" in text.splitlines()[0] and "blocks.0" in text


def test_a_new_tune_starts_the_counts_and_the_warnings_again(caplog):
    model = tuned_mlp()
    caplog.set_level(logging.WARNING, logger="torch_tweak")
    with torch.no_grad():
        model(torch.randn(5, 16))
    wrapper = tt.installed(model)["head"]
    assert wrapper.tt_untuned["no signature matched"] == 1
    tt.tune(model, [torch.randn(8, 16)], strategy=tt.OneBackendStrategy(TorchEagerBackend()))
    assert wrapper.tt_untuned == ZERO
    with torch.no_grad():
        model(torch.randn(5, 16))
    assert len(warnings_of(caplog)) == 6


def test_deactivated_calls_are_not_untuned():
    model = tuned_mlp()
    tt.deactivate(model)
    with torch.no_grad():
        model(torch.randn(5, 16))
    status = tt.status(model)
    assert status.untuned == ZERO and not status["head"].active
    assert status["head"].calls >= 1


@pytest.mark.skipif(not HAS_OPENVINO, reason="openvino is not installed")
@pytest.mark.slow
def test_grad_mode_calls_of_a_backend_without_autograd_are_counted_and_logged(caplog):
    model = tuned_mlp(OpenVINOBackend)
    caplog.set_level(logging.WARNING, logger="torch_tweak")
    x = torch.randn(8, 16)
    for _ in range(2):
        out = model(x)  # grad mode on, weights require grad: the original runs
        assert out.requires_grad
    with torch.inference_mode():
        assert not model(x).requires_grad
    status = tt.status(model)
    assert status["head"].untuned["grad mode"] == 2 and status["head"].backend == "OpenVINO"
    grad_warnings = [m for m in warnings_of(caplog) if "grad mode" in m]
    assert len(grad_warnings) == 3 and "torch.inference_mode()" in grad_warnings[0]


def test_status_of_a_model_without_wrappers_is_empty():
    model = nn.Linear(2, 2)
    assert tt.status(model) == {} and str(tt.status(model)) == "no tuned modules"
    with pytest.raises(TypeError):
        tt.status("model")


def test_the_fast_path_passes_the_callers_arguments_untouched():
    seen = []

    class Probe(nn.Module):
        def forward(self, x, *, scale=1.0):
            return x * scale

    model = nn.Sequential(Probe()).eval()
    tt.wrap(model, ["0"])
    x = torch.randn(2, 3)
    tt.tune(model, [((x,), {})], strategy=tt.OneBackendStrategy(TorchEagerBackend()))
    wrapper = tt.installed(model)["0"]
    backend = wrapper._tt_entries[0][1]

    def spy(*args, **kwargs):
        seen.append((args, kwargs))
        return backend(*args, **kwargs)

    wrapper._tt_set_entries([(wrapper._tt_entries[0][0], spy)])
    with torch.no_grad():
        model(x)
    assert seen[0][0][0] is x and seen[0][1] == {}


class NoAutograd(TorchEagerBackend):
    """Eager, declared without autograd: in grad mode the dispatcher runs the original."""

    name = "NoAutograd"
    supports_autograd = False


def test_the_first_grad_mode_call_of_a_tuned_model_warns_once_on_the_warnings_channel():
    import warnings
    model = tuned_mlp(NoAutograd)
    torch.manual_seed(0)
    untuned = MLP().eval()
    x = torch.randn(8, 16)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")  # what is shown once is issued once
        outs = [model(x) for _ in range(3)]  # grad mode: the README's first call, without inference_mode
    grad = [w for w in caught if "grad mode" in str(w.message)]
    assert len(grad) == 1, [str(w.message) for w in caught]  # once for the model, not per module or call
    assert issubclass(grad[0].category, UserWarning)
    assert "torch.inference_mode()" in str(grad[0].message) and "tuned path" in str(grad[0].message)
    assert all(torch.equal(o, untuned(x)) for o in outs)
    with torch.inference_mode():
        assert torch.equal(model(x), untuned(x))
    assert tt.status(model)["head"].untuned["grad mode"] == 3


class SkipWait(TorchEagerBackend):
    """Runs a Slow layer's inner layer without its wait: depth 1 is truly faster."""

    name = "SkipWait"

    def build(self, module, samples, device):
        return module.inner


def test_status_counts_calls_from_the_end_of_tuning(fake_clock):
    from support import FAST, SlowNet
    torch.manual_seed(0)
    model = SlowNet().eval()
    torch.manual_seed(0)
    untuned = SlowNet().eval()
    data = [torch.randn(4, 16) for _ in range(3)]
    result = tt.tweak(model, data, max_depth=1, strategy=tt.OneBackendStrategy(SkipWait()), progress=False,
                      measure=FAST, cache=False)
    assert result.selected_depth == 1
    status = tt.status(model)
    assert {p: s.calls for p, s in status.items()} == {"a": 0, "b": 0}  # tweak's own calls are not counted
    with torch.inference_mode():
        for x in data:
            assert torch.equal(model(x), untuned(x))
    status = tt.status(model)
    assert {p: s.calls for p, s in status.items()} == {"a": 3, "b": 3}
    assert status.untuned == ZERO


class EvalCopy(TorchEagerBackend):
    """What a converting or recording backend does (OpenVINO, ONNX Runtime, a device graph):
    it runs the module as it was built, in eval mode, whatever its flag says later."""

    name = "EvalCopy"

    def build(self, module, samples, device):
        def run(*args, **kwargs):
            was = module.training
            module.eval()
            try:
                return module(*args, **kwargs)
            finally:
                module.train(was)
        return run


class Noisy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Linear(16, 16)
        self.block = nn.Sequential(nn.Linear(16, 16), nn.BatchNorm1d(16), nn.Dropout(0.5))
        self.head = nn.Linear(16, 4)

    def forward(self, x):
        return self.head(self.block(self.stem(x)))


def test_a_tuned_module_in_train_mode_runs_its_original(caplog):
    """Found by an attack: after model.train(), OpenVINO's model still ran the eval-mode
    forward (no dropout, batch norm's running statistics, which it never updated), counted as
    a served call. Every backend is built and checked in eval mode: in train mode a tuned
    module runs its original (counted and said once, "train mode"), and model.eval() brings
    the tuned path back. The differential: an untuned copy, the same draws."""
    import copy

    torch.manual_seed(0)
    model = Noisy().eval()
    untuned = copy.deepcopy(model)
    tt.wrap(model, ["block", "head"])
    tt.tune(model, [torch.randn(8, 16)], strategy=tt.OneBackendStrategy(EvalCopy()))
    assert all(s.backend == "EvalCopy" for s in tt.status(model).values())
    caplog.set_level(logging.WARNING, logger="torch_tweak")
    model.train()
    untuned.train()
    x = torch.randn(8, 16)
    for _ in range(2):
        with torch.no_grad():
            torch.manual_seed(1)
            got = model(x)
            torch.manual_seed(1)
            want = untuned(x)
        assert torch.equal(got, want)  # dropout drew the same, batch norm used the batch's statistics
    bn, bn_untuned = model.block[1], untuned.block[1]
    assert int(bn.num_batches_tracked) == int(bn_untuned.num_batches_tracked) == 2
    assert torch.equal(bn.running_mean, bn_untuned.running_mean)
    status = tt.status(model)
    assert status["block"].untuned["train mode"] == 2 and status["head"].untuned["train mode"] == 2
    assert sum("train mode" in m and "model.eval()" in m for m in warnings_of(caplog)) == 2  # once per module
    assert "train mode" in str(status).splitlines()[0]
    model.eval()
    untuned.eval()
    with torch.no_grad():
        assert torch.equal(model(x), untuned(x))
    assert tt.status(model)["block"].untuned["train mode"] == 2  # the tuned path again
    model.block.train()  # one tuned module alone
    with torch.no_grad():
        model(x)
    assert tt.status(model)["block"].untuned["train mode"] == 3 and tt.status(model)["head"].untuned["train mode"] == 2
    # found by an attack on the first version of this rule: a submodule inside a tuned module
    # (MC dropout), a flag set directly, and tt.deactivate/tt.activate in train mode
    model.eval()
    untuned.load_state_dict(model.state_dict())  # the call above moved the tuned model's statistics alone
    for switch in (lambda: model.block[2].train(), lambda: setattr(model.block[1], "training", True),
                   lambda: (model.train(), tt.deactivate(model), tt.activate(model))):
        model.eval()
        untuned.eval()
        switch()
        for m, u in zip(model.modules(), untuned.modules()):
            u.training = m.training
        before = tt.status(model)["block"].untuned["train mode"]
        with torch.no_grad():
            torch.manual_seed(2)
            got = model(x)
            torch.manual_seed(2)
            want = untuned(x)
        assert torch.equal(got, want), (switch, [m.training for m in model.modules()])
        assert tt.status(model)["block"].untuned["train mode"] == before + 1
