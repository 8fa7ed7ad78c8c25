"""Per-signature choices: each input signature of a module gets its own strategy copy and
backend; the C dispatcher picks by signature; an unseen signature runs the original."""

from __future__ import annotations

import torch

import torch_tweak as tt
from torch_tweak._core import signatures
from torch_tweak._core._samples import load_dataset
from torch_tweak._search.tuning import dataset_runner, record
from torch_tweak.backends import Backend, TorchEagerBackend
from support import FAST


class WideOnlyBackend(Backend):
    """Refuses any call whose batch is not 8; counts the calls it serves."""

    name = "WideOnly"

    def build(self, module, samples, device):
        if any(args[0].shape[0] != 8 for args, _ in samples):
            raise RuntimeError("WideOnly serves batches of 8 only")
        self.calls = 0

        def run(*args, **kwargs):
            self.calls += 1
            return module(*args, **kwargs)

        return run


def test_two_signatures_get_different_backends(mlp, monkeypatch):
    monkeypatch.setattr(signatures, "MERGE_VARYING", False)  # the exact signatures alone (test_varying.py: with)
    data = [torch.randn(8, 16), torch.randn(2, 16), torch.randn(8, 16), torch.randn(2, 16)]
    strategy = tt.FirstWinsStrategy([WideOnlyBackend(), TorchEagerBackend()])
    (w,) = tt.wrap(mlp, ["head"], strategy=strategy)
    assert tt.tune(mlp, data, measure=FAST) == {"head": "WideOnly"}
    groups = w.tt_signatures
    assert [g.text for g in groups] == ["(float32[8, 16])", "(float32[2, 16])"]
    assert [g.backend.name for g in groups] == ["WideOnly", "TorchEager"]
    assert w.tt_backend is groups[0].backend
    assert groups[0].backend is not strategy.backends[0]  # a fresh copy per signature
    assert groups[0].report[1]["state"] == "not tried"  # first-wins stopped at WideOnly for batch 8
    assert "serves batches of 8 only" in groups[1].report[0]["error"]
    assert len(w._tt_entries) == 2
    wide = groups[0].backend
    calls, fallbacks = wide.calls, w._tt_fallbacks
    with torch.no_grad():
        mlp(torch.randn(8, 16))
        assert wide.calls == calls + 1
        mlp(torch.randn(2, 16))  # the second signature: Eager, not WideOnly
        assert wide.calls == calls + 1 and w._tt_fallbacks == fallbacks
        mlp(torch.randn(5, 16))  # never recorded: the original module
        assert w._tt_fallbacks == fallbacks + 1


def test_signatures_are_capped_and_the_rest_share_one_group(mlp, monkeypatch):
    monkeypatch.setattr(signatures, "MERGE_VARYING", False)  # "any other call" as it is without the class group
    sizes = list(range(1, signatures.MAX_SIGNATURES + 4))
    data = [torch.randn(n, 16) for n in sizes] + [torch.randn(1, 16)] * (signatures.MAX_CALLS_PER_SIGNATURE + 2)
    (w,) = tt.wrap(mlp, ["head"], strategy=tt.OneBackendStrategy(TorchEagerBackend()))
    tt.tune(mlp, data, measure=FAST)
    groups = w.tt_signatures
    assert len(groups) == signatures.MAX_SIGNATURES + 1
    assert groups[-1].signature is None and groups[-1].text == signatures.OTHER
    assert groups[-1].backend is not None
    # the last entry is the shape class of the other group's calls (batches 5 to 7), its batch
    # axis free: it serves a call of another batch size, and no call of another rank or dtype
    (served,) = groups[-1].serves
    assert w._tt_entries[-1] == (served, groups[-1].backend.callable)
    fallbacks = w._tt_fallbacks
    with torch.no_grad():
        mlp(torch.randn(40, 16))
        assert w._tt_fallbacks == fallbacks
        mlp(torch.randn(40, 16).double().float()[None])
        assert w._tt_fallbacks == fallbacks + 1


def test_recording_keeps_a_capped_number_of_calls_per_signature(mlp):
    data = [torch.randn(3, 16)] * (signatures.MAX_CALLS_PER_SIGNATURE + 5)
    (w,) = tt.wrap(mlp, ["head"])
    record([w], dataset_runner(mlp, load_dataset(data)))
    (group,) = w.tt_signatures
    assert len(group.samples) == signatures.MAX_CALLS_PER_SIGNATURE == len(w.tt_samples)


def test_plain_values_split_signatures(mlp):
    x = torch.randn(4, 16)
    data = [((x,), {"scale": 1.0}), ((x,), {"scale": 2.0})]
    (w,) = tt.wrap(mlp, [""], strategy=tt.OneBackendStrategy(TorchEagerBackend()))
    tt.tune(mlp, data, measure=FAST)
    assert [g.text for g in w.tt_signatures] == ["(float32[4, 16], scale=1.0)", "(float32[4, 16], scale=2.0)"]
    assert len({g.key for g in w.tt_signatures}) == 2
