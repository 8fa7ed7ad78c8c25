"""Calls whose sizes vary: one group per shape class (signatures.merge_varying), and the
padding backend (backends/padded.py) proven or refused per module, new buckets on first
sight, declared ranges, save/load, threads. Padding runs here without device graphs (a CPU
has none; tests/gpu/test_padded_gpu.py records them): what is tested is the padding, the
proof and the dispatch.

Every test compares the tuned model with an untuned copy taken before tuning."""

from __future__ import annotations

import copy
import random

import pytest
import torch
from torch import nn

import torch_tweak as tt
from torch_tweak._core import signatures
from torch_tweak.backends import PaddedGraphBackend
from support import FAST, in_threads
from test_other_group import BakingBackend, build, calls


def padded(**options) -> PaddedGraphBackend:
    return PaddedGraphBackend(graph=False, compile=False, **options)


def tune(model, data, backend):
    (w,) = tt.wrap(model, [""], strategy=tt.OneBackendStrategy(backend))
    tt.tune(model, data, measure=FAST)
    (group,) = [g for g in w.tt_signatures if g.varying]
    return w, group


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4)).eval()


class Centre(nn.Module):
    """A statistic over the batch: its rows are not independent."""

    def forward(self, x):
        return x - x.mean(0, keepdim=True)


class Pool(nn.Module):
    """Token embeddings averaged over the valid positions (honours_mask) or over all."""

    def __init__(self, honours_mask: bool) -> None:
        super().__init__()
        self.embed = nn.Embedding(50, 8)
        self.honours_mask = honours_mask

    def forward(self, input_ids, attention_mask):
        if not self.honours_mask:
            return self.embed(input_ids).mean(1)
        m = attention_mask.unsqueeze(-1).to(torch.float32)
        return (self.embed(input_ids) * m).sum(1) / m.sum(1).clamp(min=1)


def requests(n, seed, batches=(1, 2, 4), lengths=range(5, 40)):
    rng = random.Random(seed)
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        rows = [rng.choice(list(lengths)) for _ in range(rng.choice(batches))]
        ids = torch.randint(1, 50, (len(rows), max(rows)), generator=g)
        mask = torch.zeros(len(rows), max(rows), dtype=torch.long)
        for r, length in enumerate(rows):
            mask[r, :length] = 1
        out.append({"input_ids": ids * mask, "attention_mask": mask})
    return out


def test_calls_of_one_class_with_several_sizes_are_one_group():
    model = mlp()
    data = [torch.randn(b, 16) for b in (3, 5, 1, 8, 6, 3)]
    (w,) = tt.wrap(model, ["0"], strategy=tt.OneBackendStrategy(padded()))
    tt.tune(model, data, measure=FAST)
    (group,) = w.tt_signatures
    assert group.varying and group.text == "(float32[1-8, 16])" and len(group.samples) == 6
    assert group.backend is not None, group.error


def test_batches_padded_to_buckets_give_the_untuned_answers():
    model = mlp()
    untuned = copy.deepcopy(model)
    w, group = tune(model, [torch.randn(b, 16) for b in (3, 5, 1, 8, 6)], padded())
    assert group.backend is not None, group.error
    call = group.backend.callable
    with torch.no_grad():
        for b in (1, 2, 3, 7, 9, 12, 16, 17, 40):  # 9-40: new buckets, inside the range memory allows
            x = torch.randn(b, 16)
            torch.testing.assert_close(model(x), untuned(x))
            torch.testing.assert_close(model(x), untuned(x))
    stats = group.backend.describe()
    assert stats["batch_range"][1] >= 40 and "what memory holds" in stats["range_from"]["batch"]
    # batch 9 and 12, twice each, fall into bucket 12, 16 into 16; the first call of each new
    # bucket (2, 12, 16, 20, 40) was answered by the module, the bucket checked on a copy of it
    assert set(stats["buckets"]) >= {"1", "2", "4", "8", "12", "16", "20", "40"}
    assert stats["buckets"]["12"] == 3 and stats["buckets"]["16"] == 1 and stats["checked_buckets"] == 5
    assert stats["outside_range"] == 0 and stats["unready_calls"] == 5 and stats["refused_buckets"] == 0
    assert 0 < stats["padding_waste"] < 0.5
    assert sum(w.tt_untuned.values()) == 0
    shown = str(tt.status(model))
    assert "(root) (float32[1-8, 16]): buckets (calls)" in shown and "0 calls outside the range" in shown


def test_a_declared_range_sends_calls_past_it_to_the_target():
    model = mlp()
    untuned = copy.deepcopy(model)
    w, group = tune(model, [torch.randn(b, 16) for b in (3, 5, 1, 8, 6)], padded(max_batch=16))
    with torch.no_grad():
        for b in (17, 40, 12):
            x = torch.randn(b, 16)
            torch.testing.assert_close(model(x), untuned(x))
    stats = group.backend.describe()
    assert stats["batch_range"] == (1, 16) and stats["range_from"]["batch"] == "declared"
    assert stats["outside_range"] == 2 and "12" in stats["buckets"]
    assert "2 calls outside the range" in str(tt.status(model))


class MaxCentre(nn.Module):
    """A statistic over the batch that a duplicate row does not move (found by an attack:
    padded rows that copied the call's first row let it through the proof, and served, the
    rows of an earlier call changed its answer)."""

    def forward(self, x):
        return x - x.amax(0, keepdim=True)


def test_a_max_over_large_half_precision_rows_is_refused_too():
    """Found by an attack on the first fill: large finite values were capped at a fraction of
    float16's range, below calls of 1e4 to 2e4, so the max did not move; infinities do."""
    model = nn.Sequential(MaxCentre()).eval()
    data = [torch.rand(b, 16, dtype=torch.float16) * 1e4 + 1e4 for b in (3, 5)]
    w, group = tune(model, data, padded())
    assert group.backend is None and "rows are not independent" in group.error


@pytest.mark.parametrize("statistic", [Centre, MaxCentre])
def test_rows_that_are_not_independent_refuse_padding_and_keep_the_original_answers(statistic):
    model = nn.Sequential(nn.Linear(16, 16), statistic()).eval()
    untuned = copy.deepcopy(model)
    # one recorded call per bucket: no padded row the proof sees holds another call's rows
    w, group = tune(model, [torch.randn(b, 16) for b in (3, 5)], padded())
    assert group.backend is None and "rows are not independent" in group.error
    with torch.no_grad():
        for b in (4, 2, 3, 7, 3):  # large rows first: an earlier call's rows are what padding holds
            x = torch.randn(b, 16) * (100 if b == 4 else 1)
            torch.testing.assert_close(model(x), untuned(x))


@pytest.mark.parametrize("honours_mask", [False, True])
def test_lengths_are_padded_only_through_a_mask_the_module_honours(honours_mask):
    torch.manual_seed(0)
    model = Pool(honours_mask).eval()
    untuned = copy.deepcopy(model)
    w, group = tune(model, requests(6, 0, batches=(2,)), padded())
    if honours_mask:
        assert group.backend is not None, group.error
        assert group.backend.describe()["length_range"] == (1, max(len(r["input_ids"][0]) for r in requests(6, 0, (2,))))
    else:
        assert group.backend is None and "does not honour its attention_mask" in group.error
    with torch.no_grad():
        for r in requests(12, 1, batches=(2,)):
            torch.testing.assert_close(model(**r), untuned(**r))


def test_declared_ranges_serve_traffic_the_samples_did_not_show():
    model = mlp()
    untuned = copy.deepcopy(model)
    w, group = tune(model, [torch.randn(b, 16) for b in (2, 3)], padded(max_batch=64))
    assert group.backend.describe()["batch_range"] == (1, 64)
    with torch.no_grad():
        for b in (40, 64, 65):
            x = torch.randn(b, 16)
            torch.testing.assert_close(model(x), untuned(x))
    stats = group.backend.describe()
    assert "40" in stats["buckets"] and "64" in stats["buckets"] and stats["outside_range"] == 1


def test_caps_on_graphs_send_the_rest_to_the_dynamic_target():
    model = mlp()
    untuned = copy.deepcopy(model)
    w, group = tune(model, [torch.randn(b, 16) for b in (3, 5)], PaddedGraphBackend(
        graph=False, compile=False, max_graphs=1, max_batch=32))
    assert group.backend is not None, group.error
    with torch.no_grad():
        for b in (1, 2, 20, 30):
            x = torch.randn(b, 16)
            torch.testing.assert_close(model(x), untuned(x))


def test_save_and_load_keep_the_groups_and_their_buckets(tmp_path):
    torch.manual_seed(0)
    model = Pool(True).eval()
    untuned = copy.deepcopy(model)
    data = requests(6, 0)
    w, group = tune(model, data, padded())
    before = group.backend.describe()
    path = tmp_path / "padded.tt"
    tt.save(model, path)
    fresh = copy.deepcopy(untuned)
    assert tt.load(fresh, path, backends=[padded()]) == {"": "PaddedGraph"}
    (loaded,) = tt.installed(fresh)[""].tt_signatures
    assert loaded.varying and loaded.text == group.text
    after = loaded.backend.describe()
    assert after["batch_range"] == before["batch_range"] and after["length_range"] == before["length_range"]
    assert set(after["buckets"]) == set(before["buckets"])
    with torch.no_grad():
        for r in requests(12, 5, batches=(1, 2, 3, 4)):
            torch.testing.assert_close(fresh(**r), untuned(**r))


def test_eight_threads_calling_with_mixed_shapes():
    torch.manual_seed(0)
    model = Pool(True).eval()
    untuned = copy.deepcopy(model)
    tune(model, requests(6, 0), padded())
    stream = requests(160, 7, batches=(1, 2, 3, 4, 6, 8), lengths=range(2, 45))
    with torch.no_grad():
        wanted = [untuned(**r) for r in stream]
    in_threads(len(stream), lambda i: torch.testing.assert_close(model(**stream[i]), wanted[i]), mode=torch.no_grad)


def test_the_class_group_serves_only_the_plain_values_it_was_checked_on():
    # the attack's first defect, for the class group: a backend that bakes in a plain value
    model = build()
    reference = copy.deepcopy(model)
    (w,) = tt.wrap(model, ["inner"], strategy=tt.OneBackendStrategy(BakingBackend()))
    tt.tune(model, calls([1, 2, 5, 6]), measure=FAST)
    (group,) = w.tt_signatures
    assert group.varying and group.backend is not None
    with torch.no_grad():
        for scale in (2.0, 3.0):
            for n in (3, 9):
                x = torch.randn(n, 16)
                torch.testing.assert_close(model(x, scale), reference(x, scale))
    assert w.tt_untuned["no signature matched"] == 2  # the two calls with scale 3.0


def test_merging_is_left_out_for_calls_with_live_state():
    # calls passing a key/value cache (prefill, then decode) keep one group per signature
    transformers = pytest.importorskip("transformers")
    calls = [((torch.randn(n, 4),), {"past_key_values": transformers.DynamicCache()}) for n in (2, 3)]
    groups = []
    for call in calls:
        signatures.group_for(groups, *call).samples.append(call)
        groups[-1].outputs.append(call[0][0])
    assert len(groups) == 2
    merged = signatures.merge_varying(groups, calls, [a[0] for a, _ in calls])
    assert merged == groups and not any(g.varying for g in merged)
    # the same calls without the cache are one shape class
    plain = [((a[0],), {}) for a, _ in calls]
    groups = []
    for call in plain:
        signatures.group_for(groups, *call).samples.append(call)
        groups[-1].outputs.append(call[0][0])
    (merged,) = signatures.merge_varying(groups, plain, [a[0] for a, _ in plain])
    assert merged.varying and merged.text == "(float32[2-3, 4])"
