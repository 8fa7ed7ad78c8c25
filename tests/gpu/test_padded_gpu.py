"""Padded graphs on a GPU: calls of varying sizes against the untuned model's answers."""

from __future__ import annotations

import copy
import random
import threading

import pytest
import torch
from torch import nn

import torch_tweak as tt
from torch_tweak.backends import PaddedGraphBackend
from torch_tweak._runtime.module import installed


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 16)).cuda().eval()


def tune_padded(model, data, **options):
    (w,) = tt.wrap(model, [""], strategy=tt.OneBackendStrategy(PaddedGraphBackend(**options)))
    tt.tune(model, data)
    (group,) = [g for g in w.tt_signatures if g.varying]
    assert group.backend is not None, group.error
    return w, group.backend


@pytest.mark.parametrize("compile", [False, True])
def test_batches_padded_to_buckets_give_the_untuned_answers(compile):
    model = mlp()
    untuned = copy.deepcopy(model)
    data = [torch.randn(b, 64, device="cuda") for b in (3, 5, 1, 8, 6, 2)]
    w, backend = tune_padded(model, data, compile=compile)
    stats = backend.describe()
    assert stats["graphs"] >= 4 and stats["batch_range"][1] >= 33  # what the card's memory holds
    assert "what memory holds" in stats["range_from"]["batch"]
    with torch.inference_mode():
        for b in (1, 2, 3, 4, 7, 9, 12, 16, 17, 33):  # 9-33: new buckets, recorded and checked beside the calls
            x = torch.randn(b, 64, device="cuda")
            torch.testing.assert_close(model(x), untuned(x), rtol=1e-4, atol=1e-4)
            torch.testing.assert_close(model(x), untuned(x), rtol=1e-4, atol=1e-4)
    after = backend.describe()
    # 9 and 12 fall into bucket 12, 16 into 16; a new bucket's first call is answered by the target
    assert after["buckets"]["12"] >= 3 and after["buckets"]["16"] >= 1 and after["buckets"]["40"] >= 1
    assert after["outside_range"] == 0 and after["refused_buckets"] == 0 and after["checked_buckets"] >= 4
    assert sum(w.tt_untuned.values()) == 0
    assert backend.callable.fast_calls >= 8  # the calls of ready buckets were served in C, from graphs


def test_a_batch_statistic_refuses_padding():
    class Centre(nn.Module):
        def forward(self, x):
            return x - x.mean(0, keepdim=True)

    model = nn.Sequential(nn.Linear(8, 8), Centre()).cuda().eval()
    data = [torch.randn(b, 8, device="cuda") for b in (3, 5, 6)]
    (w,) = tt.wrap(model, [""], strategy=tt.OneBackendStrategy(PaddedGraphBackend(compile=False)))
    tt.tune(model, data)
    (group,) = [g for g in w.tt_signatures if g.varying]
    assert group.backend is None and "rows are not independent" in group.error


def bert_requests(n, seed, batches=(1, 2, 4), lengths=range(5, 60)):
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        rows = [rng.choice(list(lengths)) for _ in range(rng.choice(batches))]
        width = max(rows)
        ids = torch.randint(1, 100, (len(rows), width))
        mask = torch.zeros(len(rows), width, dtype=torch.long)
        for r, length in enumerate(rows):
            mask[r, :length] = 1
        out.append({"input_ids": (ids * mask).cuda(), "attention_mask": mask.cuda()})
    return out


def tiny_bert():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.BertConfig(vocab_size=100, hidden_size=64, num_hidden_layers=2, num_attention_heads=2,
                                     intermediate_size=128, max_position_embeddings=128)
    return transformers.BertModel(config).cuda().eval()


def same_valid(got, want, mask):
    valid = mask.bool()
    torch.testing.assert_close(got.last_hidden_state[valid], want.last_hidden_state[valid], rtol=2e-3, atol=2e-3)
    torch.testing.assert_close(got.pooler_output, want.pooler_output, rtol=2e-3, atol=2e-3)


@pytest.mark.parametrize("compile", [False, True])
def test_padded_batches_of_a_transformer_give_the_untuned_answers_on_valid_positions(compile):
    model = tiny_bert()
    untuned = copy.deepcopy(model)
    w, backend = tune_padded(model, bert_requests(8, 0), compile=compile)
    with torch.inference_mode():
        for request in bert_requests(30, 1, batches=(1, 2, 3, 4, 8), lengths=range(3, 70)):
            same_valid(model(**request), untuned(**request), request["attention_mask"])
    stats = backend.describe()
    assert stats["graphs"] >= 2 and stats["length_range"] is not None and stats["refused_buckets"] == 0
    assert backend.callable.fast_calls > 0


def test_hostile_calls_of_a_padded_graph_get_the_untuned_answers_or_its_error():
    model = mlp()
    untuned = copy.deepcopy(model)
    w, backend = tune_padded(model, [torch.randn(b, 64, device="cuda") for b in (3, 5, 1, 8, 6, 2)], compile=False)
    cases = [torch.randn(64, 6, device="cuda").t(), torch.randn(4, 64, device="cuda", dtype=torch.float64),
             torch.randn(4, 64), torch.randn(3, 64, device="cuda", dtype=torch.bfloat16)]
    with torch.inference_mode():
        for x in cases:
            for fn in (model, backend.callable):
                try:
                    want = untuned(x)
                except Exception as exc:  # the original's own refusal
                    with pytest.raises(type(exc)):
                        fn(x)
                    continue
                torch.testing.assert_close(fn(x), want, rtol=1e-4, atol=1e-4)
        x = torch.randn(3, 64, device="cuda")
        torch.testing.assert_close(model(x), untuned(x), rtol=1e-4, atol=1e-4)


def served_in_eight_threads(model, untuned, requests):
    """Each request served by `model` from one of eight threads, its answer the untuned model's."""
    with torch.inference_mode():
        wanted = [untuned(**r) for r in requests]
    errors = []

    def serve(k):
        try:
            with torch.inference_mode():
                for i in range(k, len(requests), 8):
                    same_valid(model(**requests[i]), wanted[i], requests[i]["attention_mask"])
        except Exception as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=serve, args=(k,)) for k in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors[0]
    return wanted


def test_eight_threads_with_mixed_shapes():
    model = tiny_bert()
    untuned = copy.deepcopy(model)
    tune_padded(model, bert_requests(8, 0), compile=False)
    served_in_eight_threads(model, untuned, bert_requests(64, 2))


def test_tweak_with_the_defaults_serves_varying_batches():
    model = tiny_bert()
    untuned = copy.deepcopy(model)
    result = tt.tweak(model, bert_requests(8, 0), cache=False, progress=False)
    print(result)
    print(tt.status(model))
    with torch.inference_mode():
        for request in bert_requests(20, 3):
            same_valid(model(**request), untuned(**request), request["attention_mask"])
    assert any(g.varying for w in installed(model).values() for g in w.tt_signatures) or result.selected_depth is None


def test_declared_shapes_record_the_graphs_of_both_ends_at_tuning():
    # tt.tweak(shapes=...): the dataset has one batch size; the declared range's ends are
    # recorded as graphs at tuning and every size within it is served by a graph
    import time

    class Slow(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inner = mlp()

        def forward(self, x):
            time.sleep(0.002)
            return self.inner(x)

    class PaddedInner(PaddedGraphBackend):
        def build(self, module, samples, device):
            return super().build(module.inner, samples, device)

    model = Slow().eval()
    untuned = copy.deepcopy(model)
    data = [torch.randn(8, 64, device="cuda") for _ in range(3)]
    result = tt.tweak(model, data, strategy=tt.OneBackendStrategy(PaddedInner(compile=False)), max_depth=0,
                      progress=False, cache=False, shapes={"batch": (1, 32)})
    assert result.selected_depth == 0
    (group,) = installed(model)[""].tt_signatures
    stats = group.backend.describe()
    assert stats["batch_range"] == (1, 32) and {"1", "8", "32"} <= set(stats["buckets"]) and stats["graphs"] >= 3
    with torch.inference_mode():
        for b in (1, 5, 8, 20, 32, 32, 40):
            x = torch.randn(b, 64, device="cuda")
            torch.testing.assert_close(model(x), untuned(x), rtol=1e-4, atol=1e-4)
    assert sum(installed(model)[""].tt_untuned.values()) == 0
    assert "declared shapes: batch 1-32" in str(result) and "graphs" in str(result)


def test_new_buckets_are_recorded_beside_eight_threads_and_evicted_under_the_caps():
    """Eight threads calling while new buckets are recorded in the calls that first need them,
    each into a pool of its own; past max_graphs the least used is evicted (its graph and pool
    let go once its last replay ended), and every answer is the untuned model's."""
    model = tiny_bert()
    untuned = copy.deepcopy(model)
    w, backend = tune_padded(model, bert_requests(8, 0), compile=False, max_graphs=6)
    call = backend.callable
    rng = random.Random(3)
    requests = [bert_requests(1, 100 + i, batches=(rng.randint(1, 16),), lengths=range(1, 128))[0] for i in range(96)]
    wanted = served_in_eight_threads(model, untuned, requests)
    stats = backend.describe()
    assert len(call.table.snapshot()[0]) <= 6 and stats["evicted_buckets"] > 0 and stats["refused_buckets"] == 0
    assert stats["outside_range"] == 0 and stats["length_range"] == (1, 128)
    with torch.inference_mode():
        for r, want in zip(requests[:16], wanted[:16]):
            same_valid(model(**r), want, r["attention_mask"])


def test_a_service_that_synchronizes_between_calls_meets_no_recording_in_progress():
    """A service's own torch.cuda.synchronize() between calls of new buckets: a recording in
    progress on any thread would forbid it ("operation not permitted when stream is capturing")
    and spoil the recording; new buckets are recorded in the call that needs them, so none is."""
    model = tiny_bert()
    untuned = copy.deepcopy(model)
    w, backend = tune_padded(model, bert_requests(8, 0), compile=True)
    rng = random.Random(5)
    with torch.inference_mode():
        for i in range(24):
            r = bert_requests(1, 200 + i, batches=(rng.randint(1, 16),), lengths=range(1, 128))[0]
            got = model(**r)
            torch.cuda.synchronize()
            same_valid(got, untuned(**r), r["attention_mask"])
    stats = backend.describe()
    assert stats["refused_buckets"] == 0 and stats["checked_buckets"] > 0 and backend.callable.fast_calls > 0
    x = torch.randn(4, 4, device="cuda")  # the process's random numbers are not left in a capture's state
    torch.testing.assert_close(x @ torch.eye(4, device="cuda"), x)
