"""The "any other call" group is only as general as what it was checked on: its backend
serves only calls of the shape classes of its recorded calls (plain values, structure,
dtypes, ranks and devices fixed; sizes free only on the axes that varied among them), and
any other call runs the original forward, counted; the same after tt.save / tt.load.

Every test compares the tuned model with an untuned copy taken before tuning."""

from __future__ import annotations

import copy
import logging
import warnings

import pytest
import torch
from torch import nn

import torch_tweak as tt
from torch_tweak import _C
from torch_tweak._core import signatures
from torch_tweak.backends import Backend, OpenVINOBackend
from support import FAST


class Inner(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(16, 8)

    def forward(self, x: torch.Tensor, scale: float) -> torch.Tensor:
        return torch.tanh(self.lin(x)) * scale


class Outer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner = Inner()

    def forward(self, x: torch.Tensor, scale: float = 2.0) -> torch.Tensor:
        return self.inner(x, scale) + 1.0


@pytest.fixture(autouse=True)
def two_signatures(monkeypatch):
    """Two signatures of their own, then "any other call" (fewer builds: OpenVINO's are slow);
    no isolated child (what is tested here is the dispatch, not a crash). The calls of one
    shape class whose sizes vary get a group of their own by default (signatures.merge_varying,
    tested with the same backends in test_varying.py); here "any other call" is what serves them."""
    monkeypatch.setattr(tt.settings, "MAX_SIGNATURES", 2)
    monkeypatch.setattr(signatures, "MERGE_VARYING", False)
    monkeypatch.setenv("TORCH_TWEAK_ISOLATION", "off")


def build() -> Outer:
    torch.manual_seed(0)
    return Outer().eval()


def calls(sizes, scale=2.0):
    g = torch.Generator().manual_seed(3)
    return [((torch.randn(n, 16, generator=g), scale), {}) for n in sizes]


def plain_values(args, kwargs):
    return [a for a in args if not isinstance(a, torch.Tensor)], {k: v for k, v in kwargs.items()
                                                                   if not isinstance(v, torch.Tensor)}


class BakingBackend(Backend):
    """What a compiler that specialises does, in plain Python: the plain values of the first
    recorded call are baked in (a call with others gets the baked answer, silently);
    `raises`: a call whose plain values (or, with "shape", tensor shapes) differ from the
    first recorded call's raises instead, as a static-shape artifact does."""

    name = "Baking"
    raises: str | None = None

    def build(self, module, samples, device):
        args0, kwargs0 = samples[0]
        baked = plain_values(args0, kwargs0)
        shapes = [tuple(a.shape) for a in args0 if isinstance(a, torch.Tensor)]
        self.calls = 0

        def run(*args, **kwargs):
            if self.raises == "value" and plain_values(args, kwargs) != baked:
                raise RuntimeError("compiled for other plain values")
            if self.raises == "shape" and [tuple(a.shape) for a in args if isinstance(a, torch.Tensor)] != shapes:
                raise RuntimeError("compiled for a static shape")
            self.calls += 1
            args = tuple(a if isinstance(a, torch.Tensor) else args0[i] for i, a in enumerate(args))
            kwargs = {k: v if isinstance(v, torch.Tensor) else kwargs0[k] for k, v in kwargs.items()}
            return module(*args, **kwargs)

        return run


class RaisingOnValueBackend(BakingBackend):
    name = "RaisingOnValue"
    raises = "value"


class StaticShapeBackend(BakingBackend):
    name = "StaticShape"
    raises = "shape"


def openvino():
    pytest.importorskip("openvino", reason="OpenVINO not installed: pip install torch-tweak[openvino]")
    tt.settings.MAX_SIGNATURES = 0  # every call is "any other call": one conversion (the fixture puts it back)
    return OpenVINOBackend()


BACKENDS = {"baking": BakingBackend, "raising": RaisingOnValueBackend, "static": StaticShapeBackend,
            "openvino": openvino}


def tuned(backend: Backend, sizes, scale=2.0):
    """(tuned model, untuned copy, inner's wrapper)."""
    model = build()
    reference = copy.deepcopy(model)
    (wrapper,) = tt.wrap(model, ["inner"], strategy=tt.OneBackendStrategy(backend))
    tt.tune(model, calls(sizes, scale), measure=FAST)
    assert wrapper.tt_signatures[-1].text == signatures.OTHER and wrapper.tt_signatures[-1].backend is not None
    return model, reference, wrapper


def same(model, reference, x, scale):
    with torch.no_grad():
        got, want = model(x, scale), reference(x, scale)
    torch.testing.assert_close(got, want, rtol=1e-3, atol=1e-4)


def untuned(model) -> int:
    return tt.status(model).untuned["no signature matched"]


def saved_and_loaded(model, reference, tmp_path, backend: Backend):
    path = tmp_path / "tuned.tt"
    tt.save(model, path)
    fresh = copy.deepcopy(reference)
    tt.load(fresh, path, backends=[backend])
    return fresh


def check_served(model, reference, caplog):
    """Calls with the recorded plain value on new sizes of the varied axis are served; any
    other plain value runs the original, counted and logged once."""
    g = torch.Generator().manual_seed(9)
    before = untuned(model)
    for n in (5, 7, 11):
        same(model, reference, torch.randn(n, 16, generator=g), 2.0)
    assert untuned(model) == before  # proven over the batch axis: served
    with caplog.at_level(logging.WARNING, logger="torch_tweak"):
        for n, scale in [(5, 3.0), (7, 3.0), (6, 0.5), (9, -1.0)]:
            same(model, reference, torch.randn(n, 16, generator=g), scale)
    assert untuned(model) == before + 4
    assert sum("ran its original forward" in r.getMessage() for r in caplog.records) == 1


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["baking", "raising", "openvino"])
def test_other_group_serves_only_the_plain_values_it_was_checked_on(kind, tmp_path, caplog):
    backend = BACKENDS[kind]()
    model, reference, wrapper = tuned(backend, [1, 2, 5, 6, 1, 2])  # 5 and 6: "any other call"
    check_served(model, reference, caplog)
    caplog.clear()
    check_served(saved_and_loaded(model, reference, tmp_path, backend.fresh()), reference, caplog)
    (served,) = wrapper.tt_signatures[-1].serves
    assert served.matches((torch.randn(40, 16), 2.0), {}) and not served.matches((torch.randn(40, 16), 3.0), {})


@pytest.mark.parametrize("kind", ["static", "openvino"])
def test_other_group_of_one_shape_never_raises_for_another(kind, tmp_path):
    """Every recorded call of "any other call" has one shape (OpenVINO converts it with a
    static shape): a call of another shape, which the untuned model answers, runs the
    original instead of raising."""
    backend = BACKENDS[kind]()
    model, reference, wrapper = tuned(backend, [5, 5] if kind == "openvino" else [1, 2, 5, 5])
    loaded = saved_and_loaded(model, reference, tmp_path, backend.fresh())
    g = torch.Generator().manual_seed(4)
    for m in (model, loaded):
        before = untuned(m)
        same(m, reference, torch.randn(5, 16, generator=g), 2.0)  # the checked shape: served
        assert untuned(m) == before
        for n in (6, 7, 13):
            same(m, reference, torch.randn(n, 16, generator=g), 2.0)
        assert untuned(m) == before + 3


def test_a_backend_that_fails_on_a_recorded_shape_is_refused_for_the_group():
    """Checked on every recorded call: a static-shape backend fails on the group's second
    shape and is not chosen; the group runs the original."""
    model = build()
    reference = copy.deepcopy(model)
    (wrapper,) = tt.wrap(model, ["inner"], strategy=tt.OneBackendStrategy(StaticShapeBackend()))
    tt.tune(model, calls([1, 2, 5, 6]), measure=FAST)
    other = wrapper.tt_signatures[-1]
    assert other.backend is None and "static shape" in other.report[0]["error"]
    g = torch.Generator().manual_seed(5)
    for n in (5, 6, 7):
        same(model, reference, torch.randn(n, 16, generator=g), 2.0)


class WrongForOneRowBackend(Backend):
    """Off by far more than any tolerance for a batch of one row, right otherwise."""

    name = "WrongForOneRow"

    def build(self, module, samples, device):
        return lambda x, *a, **k: module(x, *a, **k) + (5.0 if x.shape[0] == 1 else 0.0)


def test_a_signature_kept_on_the_original_is_not_served_by_the_other_group(tmp_path):
    """Batch 1 failed the check, so tuning kept it on the original: "any other call", proven
    on batches 5 and 6, does not serve it. A file stores no call of such a signature, so
    after tt.load the other group serves only the sizes it recorded."""
    model, reference, wrapper = tuned(WrongForOneRowBackend(), [1, 2, 5, 6])
    assert wrapper.tt_signatures[0].backend is None and wrapper.tt_signatures[1].backend is not None
    loaded = saved_and_loaded(model, reference, tmp_path, WrongForOneRowBackend())
    g = torch.Generator().manual_seed(6)
    for m in (model, loaded):
        before = untuned(m)
        same(m, reference, torch.randn(1, 16, generator=g), 2.0)
        assert untuned(m) == before + 1
        same(m, reference, torch.randn(5, 16, generator=g), 2.0)  # recorded in the other group
        assert untuned(m) == before + 1
        same(m, reference, torch.randn(9, 16, generator=g), 2.0)  # a size its batch axis was proven on
        assert untuned(m) == before + (1 if m is model else 2)


class UnstorableBakingBackend(BakingBackend):
    """Its recorded calls cannot be stored: a file holds none of them."""

    name = "UnstorableBaking"

    def can_store(self, sample):
        return False


def test_other_group_without_stored_calls_runs_the_original_after_load(tmp_path):
    """Nothing to check it on, nothing proven: after tt.load the group runs the original
    (it used to be built on its first call and then serve every call with that call's
    plain values)."""
    backend = UnstorableBakingBackend()
    model, reference, wrapper = tuned(backend, [1, 2, 5, 6])
    path = tmp_path / "tuned.tt"
    with pytest.warns(UserWarning, match="cannot be stored"):
        tt.save(model, path)
    fresh = copy.deepcopy(reference)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        tt.load(fresh, path, backends=[UnstorableBakingBackend()])
    g = torch.Generator().manual_seed(7)
    for scale in (3.0, 2.0, 3.0):
        same(fresh, reference, torch.randn(7, 16, generator=g), scale)
    assert any("serves only the calls" in str(w.message) for w in caught)


# --------------------------------------------------------------- shape classes in C

def test_a_shape_class_fixes_everything_but_sizes():
    x, y = torch.randn(2, 3), torch.randn(4, 5, 6)
    cls = signatures.shape_class((x, (y, 7)), {"scale": 2.0})
    assert cls.matches((torch.randn(9, 1), (torch.randn(1, 1, 1), 7)), {"scale": 2.0})
    for args, kwargs in [((torch.randn(9, 1), (torch.randn(1, 1, 1), 7)), {"scale": 3.0}),  # a plain value
                         ((torch.randn(9, 1), (torch.randn(1, 1, 1), 8)), {"scale": 2.0}),  # an item's value
                         ((torch.randn(9), (torch.randn(1, 1, 1), 7)), {"scale": 2.0}),  # a rank
                         ((torch.randn(9, 1).double(), (y, 7)), {"scale": 2.0}),  # a dtype
                         ((x, [y, 7]), {"scale": 2.0}),  # the structure
                         ((x, (y, 7, 1)), {"scale": 2.0}),
                         ((x, (y, 7)), {})]:
        assert not cls.matches(args, kwargs)


def test_dynamic_axes_per_item_of_a_tuple():
    a, b = torch.randn(2, 3), torch.randn(4, 5)
    sig = _C.Signature(((a, b),), {}, [[(0,), None]])
    assert sig.matches(((torch.randn(7, 3), b),), {})
    assert not sig.matches(((a, torch.randn(7, 5)),), {}) and not sig.matches(((torch.randn(2, 4), b),), {})
    sig = _C.Signature(((a, b),), {}, [[None, True]])
    assert sig.matches(((a, torch.randn(1, 1)),), {}) and not sig.matches(((torch.randn(7, 3), b),), {})
    with pytest.raises(ValueError, match="2 items"):
        _C.Signature(((a, b),), {}, [[(0,)]])
    with pytest.raises(ValueError, match="not a tensor"):
        _C.Signature(((a, 3),), {}, [[None, (0,)]])
    with pytest.raises(ValueError, match="out of range"):
        _C.Signature(((a, b),), {}, [[(2,), None]])


def test_proven_signatures_free_only_the_axes_that_varied():
    def call(n, m, scale=2.0):
        return (torch.randn(n, 4), (torch.randn(m, 3), torch.randn(2, 2))), {"scale": scale}

    served = signatures.proven_signatures([call(1, 5), call(2, 5), call(3, 5, 4.0), call(3, 6, 4.0), call(3, 7, 1.0)])
    assert len(served) == 3
    first, second, single = served
    assert first.matches(*call(8, 5)) and not first.matches(*call(8, 6)) and not first.matches(*call(8, 5, 4.0))
    assert second.matches(*call(3, 9, 4.0)) and not second.matches(*call(4, 9, 4.0))
    assert single.matches(*call(3, 7, 1.0)) and not single.matches(*call(3, 8, 1.0))
    assert signatures.proven_signatures([]) == ()


def test_an_entry_without_a_backend_runs_the_original_counted():
    model = build()
    (wrapper,) = tt.wrap(model, ["inner"])
    x = torch.randn(3, 16)
    wrapper._tt_set_entries([(signatures.make_signature((x, 2.0), {}), None),
                             (signatures.shape_class((x, 2.0), {}), lambda *a: "backend")])
    wrapper._tt_mode = _C.MODE_ACTIVE
    try:
        with torch.no_grad():
            assert torch.equal(wrapper(x, 2.0), wrapper._tt_original(x, 2.0))
            assert wrapper._tt_fallbacks == 1
            assert wrapper(torch.randn(5, 16), 2.0) == "backend"
    finally:
        tt.unwrap(model)
