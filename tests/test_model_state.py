"""A build never changes the model: training flags, parameters and buffers are as they were after
every candidate, and after a tweak, however it ends (torch_tweak._core.model_state)."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import torch_tweak as tt
from torch_tweak._core import model_state
from torch_tweak.backends import Backend, TorchEagerBackend
from torch_tweak.backends.base import copy_module
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


@pytest.mark.slow
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


# ------------------------------------------------------------------ structure


class Inner(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.register_buffer("scale", torch.full((8,), 2.0))

    def forward(self, x):
        return self.lin(x) * self.scale


class Net(nn.Module):
    """The tuned module is `block`; its structure is what the damaging builds change."""

    def __init__(self) -> None:
        super().__init__()
        self.block = Inner()
        self.head = nn.Linear(8, 4)

    def forward(self, x):
        return self.head(torch.relu(self.block(x)))


def _forward_hook(module):
    module.lin.register_forward_hook(lambda m, args, out: out + 1.0)  # one level down


def _pre_hook(module):
    module.register_forward_pre_hook(lambda m, args: (args[0] * 2.0,))


def _forward_replaced(module):
    module.forward = lambda x: module.lin(x) * 0.5


def _submodule_replaced(module):
    module.lin = nn.Linear(8, 8)


def _buffer_to_attribute(module):
    scale = module.scale
    del module.scale
    module.scale = scale * 3.0  # a plain attribute now: no longer in _buffers


def _parameter_replaced(module):
    weight = module.lin.weight
    del module.lin.weight
    module.lin.weight = weight.detach() * -1.0  # a plain tensor where the parameter was


DAMAGE = {"forward hook": _forward_hook, "pre-hook": _pre_hook, "forward replaced": _forward_replaced,
          "submodule replaced": _submodule_replaced, "buffer made a plain attribute": _buffer_to_attribute,
          "parameter replaced": _parameter_replaced}


class Damaging(Backend):
    """Changes the structure of the module it builds for, then raises ("raises"), returns a
    callable off by 1 ("wrong") or returns a right one that needs nothing of the module: a copy
    taken before the damage ("right")."""

    name = "Damaging"

    def __init__(self, damage, outcome: str) -> None:
        super().__init__()
        self.damage, self.outcome = damage, outcome

    def build(self, module, samples, device):
        clean = copy_module(module)
        self.damage(module)
        if self.outcome == "raises":
            raise RuntimeError("rejected after changing the module")
        if self.outcome == "wrong":
            return lambda *args, **kwargs: clean(*args, **kwargs) + 1.0
        return clean


def _structure(model):
    """Which module object sits at each path, each one's class, which object sits at each name of
    its instance dict, and the contents of torch's tables (hooks, parameters, buffers...)."""
    out = {}
    for path, m in model.named_modules(remove_duplicate=False):
        attrs = {k: id(v) for k, v in m.__dict__.items()}
        tables = {k: [(key, id(value)) for key, value in v.items()] if isinstance(v, dict) else sorted(v)
                  for k, v in m.__dict__.items() if isinstance(v, (dict, set))}
        out[path] = (id(m), type(m), attrs, tables)
    return out


def _answers(model, inputs):
    with torch.no_grad():
        return [model(x) for x in inputs]


def _assert_answers(model, reference, inputs):
    for got, want in zip(_answers(model, inputs), _answers(reference, inputs)):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("outcome", ["raises", "wrong", "right"])
@pytest.mark.parametrize("case", list(DAMAGE))
def test_a_build_that_changes_the_structure_leaves_it_as_it_was(case, outcome):
    torch.manual_seed(0)
    model = Net().eval()
    reference = copy.deepcopy(model)
    before = _structure(model)
    data = [torch.randn(4, 8), torch.randn(4, 8)]
    other = [torch.randn(3, 8)]  # another shape: no signature matches, the original forward runs
    tt.wrap(model, ["block"])
    chosen = tt.tune(model, data, strategy=tt.OneBackendStrategy(Damaging(DAMAGE[case], outcome)), measure=FAST)
    # rejected, or kept: a build is checked on the module as the user has it, put back first
    assert chosen == {"block": "Damaging" if outcome == "right" else None}
    _assert_answers(model, reference, data + other)
    tt.unwrap(model)
    assert _structure(model) == before
    _assert_answers(model, reference, data + other)


def test_a_tweak_keeps_a_candidate_whose_build_changed_the_structure_and_leaves_the_structure(tuning_cache_folder):
    torch.manual_seed(0)
    model = Net().eval()
    reference = copy.deepcopy(model)
    before = _structure(model)
    data = [torch.randn(4, 8), torch.randn(4, 8)]

    def everything(module):
        for damage in DAMAGE.values():
            damage(module)

    result = tt.tweak(model, data, min_depth=1, max_depth=1, progress=False, cache=False, measure=FAST,
                      strategy=tt.OneBackendStrategy(Damaging(everything, "right")))
    assert result.modules["block"].signatures
    _assert_answers(model, reference, data + [torch.randn(3, 8)])
    log = next(tuning_cache_folder.glob("logs/Net/block/*/Damaging.log")).read_text()
    assert "forward: attribute set by the build removed" in log and "lin: submodule replaced" in log
    tt.unwrap(model)
    assert _structure(model) == before
    _assert_answers(model, reference, data)


def test_a_load_whose_rebuild_changes_the_structure_leaves_it_as_it_was(tmp_path):
    torch.manual_seed(0)
    model = Net().eval()
    data = [torch.randn(4, 8)]
    tt.wrap(model, ["block"])
    tt.tune(model, data, strategy=tt.OneBackendStrategy(Damaging(_submodule_replaced, "right")), measure=FAST)
    tt.save(model, tmp_path / "net.tt")
    fresh = Net().eval()
    fresh.load_state_dict(model.state_dict())
    reference = copy.deepcopy(fresh)
    before = _structure(fresh)
    assert tt.load(fresh, tmp_path / "net.tt", backends=[Damaging(_pre_hook, "right")]) == {"block": "Damaging"}
    _assert_answers(fresh, reference, data + [torch.randn(3, 8)])
    tt.unwrap(fresh)
    assert _structure(fresh) == before


def test_a_snapshot_puts_back_every_hook_attribute_and_registration():
    torch.manual_seed(0)
    model = Net()
    before = _structure(model)
    state = model_state.snapshot(model)
    block = model.block
    block.register_forward_hook(lambda m, a, k, o: o, with_kwargs=True, always_call=True)
    block.register_forward_pre_hook(lambda m, a, k: None, with_kwargs=True)
    block.lin.register_full_backward_hook(lambda m, gi, go: None)
    block.lin.register_full_backward_pre_hook(lambda m, go: None)
    model.register_state_dict_pre_hook(lambda m, prefix, keep_vars: None)
    model.head._register_state_dict_hook(lambda m, sd, prefix, local: None)
    model.register_load_state_dict_post_hook(lambda m, keys: None)
    block.register_buffer("scale", block.scale, persistent=False)
    block.note = "set by a build"
    model._modules = dict(reversed(list(model._modules.items())))  # a new table, in another order
    model.head.__class__ = type("Other", (nn.Linear,), {})
    model.block.__dict__["lin"] = nn.Identity()  # a module as a plain attribute shadowing the registered one
    changes = state.restore()
    assert _structure(model) == before
    assert "block.note: attribute set by the build removed" in changes
    assert "block: which buffers are persistent set back (0 entries; the build left 1)" in changes
    assert any(line.startswith("head: class changed to Other") for line in changes)
    assert model_state.snapshot(model).restore() == []
    assert "scale" in model.block.state_dict()


def test_the_whole_run_block_keeps_the_wrappers_installed_inside_it():
    """The whole-run block (model_state.kept) puts back weights, not structure: the wrappers a
    tweak installs stay."""
    model = Net().eval()
    with model_state.kept(model):
        tt.wrap(model, ["block"])
    assert list(tt.installed(model)) == ["block"]
    tt.unwrap(model)
