"""A build never changes the model: training flags, parameters and buffers are as they were after
every candidate, and after a tweak, however it ends (torch_tweak.model_state)."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import torch_tweak as tt
from torch_tweak import model_state
from torch_tweak.backends import Backend, TorchEagerBackend
from support import FAST


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.norm = nn.BatchNorm1d(8)
        self.register_buffer("scale", torch.full((8,), 2.0))

    def forward(self, x):
        return self.norm(self.lin(x)) * self.scale


class MeddlingBackend(Backend):
    """Changes everything a build must not: flips training, writes a parameter in place (through
    .data, which no version counter sees), moves and casts a buffer, replaces a parameter
    object, turns off requires_grad, adds a buffer; then runs the module as it is."""

    name = "Meddling"

    def build(self, module, samples, device):
        module.train(not module.training)
        block = next(m for m in module.modules() if isinstance(m, Block))
        block.lin.weight.data.mul_(3.0)
        block.scale = block.scale.to(torch.float64)
        block.lin.bias = nn.Parameter(torch.zeros(8))
        block.norm.weight.requires_grad_(False)
        block.register_buffer("extra", torch.ones(1))
        return lambda *args, **kwargs: module(*args, **kwargs)


class InterruptedBackend(MeddlingBackend):
    name = "Interrupted"

    def build(self, module, samples, device):
        super().build(module, samples, device)
        raise KeyboardInterrupt


def _state(model):
    return {
        "flags": [m.training for m in model.modules()],
        "objects": {name: t for name, t in list(model.named_parameters()) + list(model.named_buffers())},
        "values": {name: t.detach().clone() for name, t in model.state_dict().items()},
        "grads": {name: p.requires_grad for name, p in model.named_parameters()},
    }


def _assert_same(model, before):
    after = _state(model)
    assert after["flags"] == before["flags"]
    assert after["objects"].keys() == before["objects"].keys()
    for name, tensor in before["objects"].items():
        assert after["objects"][name] is tensor, name
        assert tensor.dtype == before["values"][name].dtype and tensor.device == before["values"][name].device
    for name, value in before["values"].items():
        assert torch.equal(after["values"][name], value), name
    assert after["grads"] == before["grads"]


def test_a_meddling_build_leaves_the_model_as_it_was(tuning_cache_folder):
    torch.manual_seed(0)
    model = nn.Sequential(Block(), nn.ReLU(), Block()).eval()
    before = _state(model)
    data = [torch.randn(4, 8) for _ in range(2)]
    result = tt.tweak(model, data, max_depth=1, progress=False, cache=False, measure=FAST,
                      strategy=tt.HighestThroughputStrategy([MeddlingBackend(), TorchEagerBackend()]))
    _assert_same(model, before)
    log = next(tuning_cache_folder.glob("logs/Sequential/0/*/Meddling.log")).read_text()
    assert "restored" in log and "written in place; its values put back" in log
    assert "training flag set back to False" in log and "replaced; the original object put back" in log
    assert result.modules["0"].signatures  # the tweak went on


def test_an_interrupted_build_leaves_the_model_as_it_was():
    torch.manual_seed(0)
    model = nn.Sequential(Block(), nn.ReLU(), Block()).eval()
    before = _state(model)
    with pytest.raises(KeyboardInterrupt):
        tt.tweak(model, [torch.randn(4, 8)], max_depth=0, progress=False, cache=False, measure=FAST,
                 strategy=tt.HighestThroughputStrategy([InterruptedBackend(), TorchEagerBackend()]))
    _assert_same(model, before)


def test_a_train_mode_tweak_moves_no_batch_norm_statistics():
    torch.manual_seed(0)
    model = nn.Sequential(Block(), nn.ReLU(), Block()).train()
    before = _state(model)
    reference = copy.deepcopy(model)
    data = [torch.randn(4, 8) for _ in range(3)]
    with pytest.raises(ValueError, match="training mode"):  # stopped before anything ran
        tt.tweak(model, data, max_depth=1, progress=False, cache=False, measure=FAST,
                 strategy=tt.OneBackendStrategy(TorchEagerBackend()))
    _assert_same(model, before)
    assert model.training and all(m.training for m in model.modules())
    assert torch.equal(model[0].norm.running_mean, reference[0].norm.running_mean)
    assert int(model[0].norm.num_batches_tracked) == 0


def test_a_snapshot_puts_back_what_it_can_and_says_what_it_cannot():
    module = nn.Linear(4, 4)
    small = model_state.snapshot(module)
    with torch.no_grad():
        module.weight.add_(1.0)
    assert small.restore() == ["Linear.weight: written in place; its values put back"]
    large = model_state.snapshot(module, param_copy_limit=0)  # parameters not copied
    with torch.no_grad():
        module.weight.add_(1.0)
    assert large.restore() == ["Linear.weight: written in place; NOT put back (parameters over 256 MiB are not copied)"]
    assert model_state.snapshot(module).restore() == []
