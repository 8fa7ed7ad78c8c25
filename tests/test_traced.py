"""Models traced for another runtime (OpenVINO's convert_model, ONNX Runtime with either
exporter) keep one path through the module's Python: the branch their example took. Every
answer here is compared with an untuned deep copy of the module:

- a branch on the call's sizes (``if x.shape[0] % 2``) inside a shape class: a size no check ran
  on is answered by the module and checked against the trace once; a size whose check failed
  is answered by the module from then on, counted in tt.status ("trace fell back") and said
  once; a size whose check passed is served by the trace;
- a branch on the call's values (``if y.abs().max() > 3``): the build is refused, naming the line;
- a call the trace cannot take (a patch merge traced on even lengths, at an odd one): the
  module answers it, counted, never an exception the untuned model does not raise.

(backends._traced; the conversions are shared per module and backend: a few seconds each.)"""

from __future__ import annotations

import copy
import logging

import pytest
import torch
import torch.nn.functional as F
import torch.utils._pytree as pytree
from torch import nn

import torch_tweak as tt
from torch_tweak.backends import ONNXRuntimeBackend, OpenVINOBackend
from torch_tweak.backends import _traced as traced
from support import FAST

FELL_BACK = "trace fell back"


class Parity(nn.Module):
    """Adds one where the batch is odd: a branch on a size."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lin(x)
        if x.shape[0] % 2:
            h = h + 1
        return h


class Clip(nn.Module):
    """Scales large outputs down: a branch on the values."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.lin(x)
        if y.abs().max() > 3:
            y = y / y.abs().max()
        return y


class PatchMerge(nn.Module):
    """Merges neighbouring tokens, as a Swin stage does: an odd length is padded by one first."""

    def __init__(self) -> None:
        super().__init__()
        self.reduce = nn.Linear(32, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, c = x.shape
        if n % 2:
            x = F.pad(x, (0, 0, 0, 1))
        return self.reduce(x.reshape(b, (n + 1) // 2, 2 * c))


BACKENDS = {"openvino": lambda: OpenVINOBackend(),
            "onnxruntime-dynamo": lambda: ONNXRuntimeBackend(exporter="dynamo", intra_op_threads=1),
            "onnxruntime-torchscript": lambda: ONNXRuntimeBackend(exporter="torchscript", intra_op_threads=1)}
SLOW = {"onnxruntime-dynamo"}  # its exports take about a second each
NEEDS = {"openvino": ("openvino",), "onnxruntime-dynamo": ("onnxruntime", "onnx", "onnxscript"),
         "onnxruntime-torchscript": ("onnxruntime", "onnx")}
DATA = {Parity: [torch.randn(b, 16, generator=torch.Generator().manual_seed(b)) for b in (2, 4, 6, 8)],
        Clip: [0.05 * torch.randn(b, 16, generator=torch.Generator().manual_seed(b)) for b in (2, 4, 6, 8)],
        PatchMerge: [torch.randn(2, n, 16, generator=torch.Generator().manual_seed(n)) for n in (4, 6, 8, 10)]}


def tuned(kind: str, cls: type) -> tuple[nn.Module, nn.Module]:
    """`cls` tuned with one backend on DATA[cls], and an untuned deep copy of it."""
    for name in NEEDS[kind]:
        pytest.importorskip(name, reason=f"{name} not installed: pip install torch-tweak[{kind.split('-')[0]}]")
    torch.manual_seed(0)
    model = cls().eval()
    untuned = copy.deepcopy(model)
    tt.wrap(model, [""], strategy=tt.OneBackendStrategy(BACKENDS[kind]()))
    tt.tune(model, DATA[cls], measure=FAST)
    return model, untuned


@pytest.fixture(scope="module", params=[pytest.param(kind, marks=[pytest.mark.slow] if kind in SLOW else [])
                                        for kind in BACKENDS])
def backend(request):
    return request.param


@pytest.fixture(scope="module")
def parity(backend):
    return tuned(backend, Parity)


def same(model: nn.Module, untuned: nn.Module, x: torch.Tensor) -> None:
    with torch.inference_mode():
        torch.testing.assert_close(model(x), untuned(x), rtol=1e-4, atol=1e-4)


@pytest.mark.slow
def test_a_size_whose_branch_the_trace_fixed_runs_the_module_counted_and_said_once(parity, caplog):
    model, untuned = parity
    assert tt.status(model)[""].backend is not None  # a branch on a size: the trace is built
    g = torch.Generator().manual_seed(9)
    with caplog.at_level(logging.WARNING, logger="torch_tweak"):
        for b in (3, 5, 7, 3, 5):  # odd: the trace took the even branch
            same(model, untuned, torch.randn(b, 16, generator=g))
    assert tt.status(model).untuned[FELL_BACK] == 5
    said = [r for r in caplog.records if FELL_BACK in r.getMessage()]
    assert len(said) == 1 and "at sizes [[3, 16]] gave another answer than the module" in said[0].getMessage()


def test_a_new_size_the_trace_holds_at_is_checked_once_then_served(parity):
    model, untuned = parity
    g = torch.Generator().manual_seed(10)
    before = tt.status(model).untuned[FELL_BACK]
    for _ in range(3):
        same(model, untuned, torch.randn(10, 16, generator=g))  # even, never recorded: checked at first sight
    wrapper = tt._runtime.module.installed(model)[""]
    (proof,) = wrapper._tt_traces()
    assert (torch.Size([10, 16]),) in proof.proven and tt.status(model).untuned[FELL_BACK] == before
    assert "checked at first sight" in tt.status(model)[""].shapes[wrapper.tt_signatures[0].text]["line"]


def test_a_branch_on_values_refuses_the_trace_and_names_the_line(backend):
    model, untuned = tuned(backend, Clip)
    (group,) = tt._runtime.module.installed(model)[""].tt_signatures
    assert group.backend is None
    assert "turns a tensor computed from its inputs' values into a Python value" in group.error
    assert "test_traced.py" in group.error and "if y.abs().max() > 3:" in group.error
    same(model, untuned, 100 * torch.randn(4, 16))  # large values: the other branch


@pytest.mark.slow
def test_a_call_the_trace_cannot_take_runs_the_module_counted(backend, caplog):
    model, untuned = tuned(backend, PatchMerge)
    assert tt.status(model)[""].backend is not None
    g = torch.Generator().manual_seed(11)
    with caplog.at_level(logging.WARNING, logger="torch_tweak"):
        for n in (5, 7, 5, 12):  # odd lengths: the trace's reshape fails; 12: served after its check
            same(model, untuned, torch.randn(2, n, 16, generator=g))
    assert tt.status(model).untuned[FELL_BACK] == 3
    assert sum(FELL_BACK in r.getMessage() for r in caplog.records) == 1


class Stage(nn.Module):
    """A Swin-like stage: a projection, a patch merge (tuned alone), a norm."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(16, 16)
        self.merge = PatchMerge()
        self.norm = nn.LayerNorm(16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(self.merge(self.proj(x)))


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["openvino", "onnxruntime-torchscript"])
def test_a_patch_merge_in_a_model_saved_and_loaded_answers_odd_lengths_as_the_module(kind, tmp_path):
    """Issue 49, item 8: a patch merge tuned on even lengths raised a reshape error at odd ones
    under OpenVINO and ONNX Runtime, where the untuned model answers. Inside a model, and after
    tt.save / tt.load, each odd length is the module's own forward's, counted."""
    for name in NEEDS[kind]:
        pytest.importorskip(name, reason=f"{name} not installed")
    torch.manual_seed(0)
    model = Stage().eval()
    untuned = copy.deepcopy(model)
    tt.wrap(model, ["merge"], strategy=tt.OneBackendStrategy(BACKENDS[kind]()))
    tt.tune(model, [torch.randn(2, n, 16, generator=torch.Generator().manual_seed(n)) for n in (4, 6, 8, 10)],
            measure=FAST)
    assert tt.status(model)["merge"].backend is not None, tt._runtime.module.installed(model)["merge"].tt_error
    tt.save(model, tmp_path / "stage.tt")
    loaded = copy.deepcopy(untuned)
    tt.load(loaded, tmp_path / "stage.tt", backends=[BACKENDS[kind]()])
    g = torch.Generator().manual_seed(12)
    for served in (model, loaded):
        for n in (5, 9, 5, 3, 12):  # odd: the module's; 12, even: proven at first sight, then served
            same(served, untuned, torch.randn(2, n, 16, generator=g))
        assert tt.status(served).untuned[FELL_BACK] == 4


@pytest.mark.slow
def test_a_recorded_size_the_trace_does_not_hold_at_refuses_it_whatever_a_shape_s_own_model_says():
    # OpenVINO compiles a model per recorded call shape, from the same trace: at batch 3 it fails
    # its own check too, and must not answer the build's check with the module's answer in its place
    pytest.importorskip("openvino", reason="OpenVINO not installed: pip install torch-tweak[openvino]")
    torch.manual_seed(0)
    model = Parity().eval()
    untuned = copy.deepcopy(model)
    (wrapper,) = tt.wrap(model, [""], strategy=tt.OneBackendStrategy(OpenVINOBackend()))
    tt.tune(model, [torch.randn(b, 16) for b in (2, 3, 4)], measure=FAST)
    (group,) = wrapper.tt_signatures
    assert group.backend is None and "sample 1 output: " in group.error and "x the original's error" in group.error
    same(model, untuned, torch.randn(3, 16))


class Every4th(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(16, 64), nn.Linear(64, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.down(torch.relu(self.up(x)))
        if x.shape[0] % 4 == 3:
            h = h + 1
        return h


@pytest.mark.slow
def test_through_wrap_tune_save_and_load_the_sizes_the_trace_fixed_stay_right(tmp_path):
    pytest.importorskip("openvino", reason="OpenVINO not installed: pip install torch-tweak[openvino]")
    torch.manual_seed(0)
    model = Every4th().eval()
    untuned = copy.deepcopy(model)
    tt.wrap(model, [""], strategy=tt.OneBackendStrategy(OpenVINOBackend()))
    tt.tune(model, [torch.randn(b, 16) for b in (2, 4, 6, 8, 10, 12)], measure=FAST)
    assert tt.status(model)[""].backend == "OpenVINO"
    tt.save(model, tmp_path / "tuned.tt")
    loaded = copy.deepcopy(untuned)
    tt.load(loaded, tmp_path / "tuned.tt")
    for served in (model, loaded):
        for b in (3, 7, 11, 3, 9):
            same(served, untuned, torch.randn(b, 16))
        assert tt.status(served).untuned[FELL_BACK] == 4  # 3, 7, 11, 3; 9 proven at first sight


# ---------------------------------------------------------------- the parts, without a runtime

def _trace(module: nn.Module, *example: torch.Tensor) -> None:
    with traced.watch_values("Trace", len(example)):
        torch.jit.trace(module, example, check_trace=False)


class OnSize(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = [x[i] * 2 for i in range(x.shape[0])]  # a size turned into a Python int
        picked = x[torch.tensor([0, 1])]  # integer indices: their own size, whatever x holds
        return torch.stack(rows) if len(x) > 1 and x.numel() and picked.shape[0] > 1 and len(list(x)) else x


class OnWeight(nn.Linear):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) + (1 if self.weight.sum() > 0 else 0)  # the weights: kept, watched by Baked


@pytest.mark.parametrize("branch", [
    lambda x: x * 2 if x.sum() > 0 else x,
    lambda x: x[: int(x.abs().argmax()) + 1],
    lambda x: x * x.max().item(),
    lambda x: x + torch.tensor(x.tolist()),
    lambda x: x * 2 if torch.equal(x, x.clamp(0)) else x,
    lambda x: x * 2 if x[x > 0].shape[0] > 3 else x,  # the size of a mask's selection
    lambda x: x * 2 if len(x.nonzero()) > 3 else x,
    lambda x: x + sum(row.sum() for row in x.nonzero()),  # a loop as long as a count of values
])
def test_a_python_value_of_the_inputs_values_is_a_value_branch(branch):
    class Module(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return branch(x)

    with pytest.raises(traced.ValueBranch, match=r"Trace: the module turns a tensor computed from its inputs' "
                                                   r"values into a Python value \(\w+ at test_traced.py:\d+"):
        _trace(Module(), torch.randn(4, 3))


def test_a_python_value_of_sizes_or_of_weights_is_no_value_branch():
    _trace(OnSize(), torch.randn(4, 3))
    _trace(OnWeight(3, 3), torch.randn(4, 3))


def test_served_checks_a_new_size_once_and_keeps_the_model_s_own_exceptions():
    module = nn.Linear(4, 4).eval()
    calls = []

    def trace(flat, args, kwargs):
        calls.append(args[0].shape[0])
        if args[0].shape[0] == 5:
            raise RuntimeError("cannot reshape")
        return module(*args) + (1 if args[0].shape[0] == 3 else 0)

    samples = [((torch.randn(b, 4),), {}) for b in (2, 6)]  # a class; and a call of another layout, not its to serve
    served = traced.Served("Trace", module, None, samples + [((), {"x": torch.randn(3, 4)})],
                           pytree.tree_flatten(samples[0])[1], [0])
    told = []
    served.strict, served.on_fallback = False, told.append
    with torch.no_grad():
        for b in (2, 3, 3, 4, 4, 5, 5):
            x = torch.randn(b, 4)
            torch.testing.assert_close(served(trace, [x], (x,), {}), module(x))
        assert calls == [2, 3, 4, 4, 5]  # each new size checked once; a refused size never again
        assert served.checked == {(torch.Size([2, 4]),), (torch.Size([6, 4]),)}
        assert served.fallbacks == 4 and len(told) == 1 and "at sizes [[3, 4]] gave another answer" in told[0]
        with pytest.raises(RuntimeError, match="mat1 and mat2 shapes cannot be multiplied"):
            y = torch.randn(2, 3)
            served(trace, [y], (y,), {})  # the module's own error
