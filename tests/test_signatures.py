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
    sizes = list(range(1, tt.settings.MAX_SIGNATURES + 4))
    data = [torch.randn(n, 16) for n in sizes] + [torch.randn(1, 16)] * (tt.settings.MAX_CALLS_PER_SIGNATURE + 2)
    (w,) = tt.wrap(mlp, ["head"], strategy=tt.OneBackendStrategy(TorchEagerBackend()))
    tt.tune(mlp, data, measure=FAST)
    groups = w.tt_signatures
    assert len(groups) == tt.settings.MAX_SIGNATURES + 1
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
    data = [torch.randn(3, 16)] * (tt.settings.MAX_CALLS_PER_SIGNATURE + 5)
    (w,) = tt.wrap(mlp, ["head"])
    record([w], dataset_runner(mlp, load_dataset(data)))
    (group,) = w.tt_signatures
    assert len(group.samples) == tt.settings.MAX_CALLS_PER_SIGNATURE == len(w.tt_samples)


def test_plain_values_split_signatures(mlp):
    x = torch.randn(4, 16)
    data = [((x,), {"scale": 1.0}), ((x,), {"scale": 2.0})]
    (w,) = tt.wrap(mlp, [""], strategy=tt.OneBackendStrategy(TorchEagerBackend()))
    tt.tune(mlp, data, measure=FAST)
    assert [g.text for g in w.tt_signatures] == ["(float32[4, 16], scale=1.0)", "(float32[4, 16], scale=2.0)"]
    assert len({g.key for g in w.tt_signatures}) == 2


class Twice(torch.nn.Module):
    """Calls its inner module twice per call: once on its input, once on its first half of rows."""

    def __init__(self, inner: torch.nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, x):
        return self.inner(x).sum() + self.inner(x[: max(1, x.shape[0] // 2)]).sum()


def _classes(rng):
    """One to eight shape classes of a module taking one tensor: (rank, dtype)."""
    every = [(rank, dtype) for rank in (1, 2, 3, 4) for dtype in (torch.float32, torch.float64, torch.int64)]
    return rng.sample(every, rng.randint(1, 8))


def _calls(rng, classes, n):
    """n calls of the given classes, sizes 1 to 6 (rank 1: up to 40)."""
    calls = []
    for _ in range(n):
        rank, dtype = rng.choice(classes)
        calls.append(torch.ones(*[rng.randint(1, 40 if rank == 1 else 6) for _ in range(rank)], dtype=dtype))
    return calls


def test_recording_stays_within_the_bounds_a_file_is_read_with():
    """tt.save wrote a file tt.load refused: merge_varying kept 8 calls of the traffic and the 2
    declared ends in one group (10), and could leave 8 groups, where the reader took 8 and 5.
    stored_bounds is the one bound of both: random mixes of calls (several shape classes, "any
    other call", declared ends, a module called twice per call) never leave more."""
    import random

    most_groups, most_calls = signatures.stored_bounds()
    assert (most_groups, most_calls) == (tt.settings.MAX_SIGNATURES + tt.settings.MAX_CALLS_PER_SIGNATURE,
                                         tt.settings.MAX_CALLS_PER_SIGNATURE + tt.settings.MAX_DECLARED_CALLS)
    seen_calls = 0
    for seed in range(40):
        rng = random.Random(seed)
        model = Twice(torch.nn.Identity()).eval()
        (w,) = tt.wrap(model, ["inner"])
        classes = _classes(rng)
        calls, edges = _calls(rng, classes, rng.randint(1, 40)), _calls(rng, classes, rng.randint(0, 3))
        record([w], dataset_runner(model, load_dataset(calls)),
               dataset_runner(model, load_dataset(edges)) if edges else None)
        groups = w.tt_signatures
        assert len(groups) <= most_groups, (seed, [g.text for g in groups])
        for g in groups:
            assert len(g.samples) == len(g.outputs) <= most_calls, (seed, g.text, len(g.samples))
            assert g.declared <= tt.settings.MAX_DECLARED_CALLS
            assert len(g.samples) - g.declared <= tt.settings.MAX_CALLS_PER_SIGNATURE
        seen_calls = max(seen_calls, *(len(g.samples) for g in groups))
        tt.unwrap(model)
    assert seen_calls == most_calls  # the bound is reached (eight groups: test_a_file_of_more_groups_than_signatures_loads)


def test_a_module_called_twice_per_call_keeps_its_smallest_and_largest_end():
    model = Twice(torch.nn.Identity()).eval()
    (w,) = tt.wrap(model, ["inner"])
    traffic = [torch.randn(8, 4) for _ in range(9)]
    ends = [torch.randn(2, 4), torch.randn(32, 4)]  # inner sees rows 2, 1 and 32, 16
    record([w], dataset_runner(model, load_dataset(traffic)), dataset_runner(model, load_dataset(ends)))
    (group,) = w.tt_signatures
    assert group.varying and group.declared == 2 and group.text == "(float32[1-32, 4])"
    assert [a[0].shape[0] for a, _ in group.samples] == [8, 4] * 4 + [1, 32]


def test_a_file_of_more_groups_than_signatures_loads(tmp_path):
    """Four signatures of four shape classes, then "any other call" holding four more classes of
    two sizes each: recording leaves eight groups, and tt.load refused more than five."""
    class Double(torch.nn.Module):
        def forward(self, x):
            return x * 2

    calls = [torch.randn(3), torch.randn(3, 2), torch.randn(3, 2, 2), torch.randn(3, 2, 2, 2)]
    for dtype in (torch.float64, torch.float16, torch.bfloat16, torch.int64):
        calls += [torch.ones(2, dtype=dtype), torch.ones(5, dtype=dtype)]
    model = Double().eval()
    (w,) = tt.wrap(model, [""], strategy=tt.OneBackendStrategy(TorchEagerBackend()))
    tt.tune(model, calls, measure=FAST)
    assert len(w.tt_signatures) == 8 and all(g.backend is not None for g in w.tt_signatures)
    tt.save(model, tmp_path / "groups.tt")
    assert tt.read_summary(tmp_path / "groups.tt")["refused"] is None
    fresh = Double().eval()
    assert tt.load(fresh, tmp_path / "groups.tt") == {"": "TorchEager"}
    assert [g.text for g in tt.installed(fresh)[""].tt_signatures] == [g.text for g in w.tt_signatures]
    with torch.inference_mode():
        for x in calls + [torch.ones(7, dtype=torch.float16)]:
            assert torch.equal(fresh(x), x * 2)
    assert sum(tt.installed(fresh)[""].tt_untuned.values()) == 0
