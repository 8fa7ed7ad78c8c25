"""A padded class after tuning, as a service meets it (issue 57, on the CPU): every length up to
the model's position table and every batch memory holds is served, each new bucket recorded and
checked in its first call, after that call was answered; a bucket that failed its check never
serves; past the caps the least used bucket is evicted, with eight threads calling. Padding runs without device graphs here (graph=False: the target on the padded call);
tests/gpu/test_padded_gpu.py records graphs.

Every call is compared with an untuned copy taken before tuning, by the correctness rule a new
bucket is checked by (torch_tweak._core.correctness.check, with the module's own errors)."""

from __future__ import annotations

import copy
import random
import threading

import pytest
import torch
from torch import nn

import torch_tweak as tt
from torch_tweak._core.correctness import check
from torch_tweak.backends import PaddedGraphBackend
from torch_tweak.backends import padded as padded_module
from support import in_threads
from test_padded_c import tune
from test_varying import requests


class Tagger(nn.Module):
    """Token and position embeddings, a layer, a mask: a plain module of the shape of an encoder
    (its position table: 48 positions)."""

    def __init__(self, positions: int = 48, width: int = 16) -> None:
        super().__init__()
        self.tokens = nn.Embedding(50, width)
        self.position_embeddings = nn.Embedding(positions, width)
        self.out = nn.Linear(width, 8)

    def forward(self, input_ids, attention_mask):
        h = self.tokens(input_ids) + self.position_embeddings(torch.arange(input_ids.shape[1]))
        return self.out(torch.tanh(h)) * attention_mask.unsqueeze(-1)


def tiny_bert():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.BertConfig(vocab_size=50, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                                     intermediate_size=64, max_position_embeddings=64,
                                     tie_word_embeddings=True)  # as BERT's released checkpoints tie them
    return transformers.BertModel(config).eval()  # the pooler on


def one_request(b: int, n: int, seed: int) -> dict:
    """b rows of at most n tokens, the first row n long (so the call's length is n)."""
    g = torch.Generator().manual_seed(seed)
    lengths = [n] + [int(x) for x in torch.randint(1, n + 1, (b - 1,), generator=g)]
    mask = torch.zeros(b, n, dtype=torch.long)
    for r, length in enumerate(lengths):
        mask[r, :length] = 1
    return {"input_ids": torch.randint(1, 50, (b, n), generator=g) * mask, "attention_mask": mask}


def same(got, want, call, where):
    """got is want by the rule a new bucket is checked by (the module's own errors allowed)."""
    check(got, want, where=where, own=call.own)


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["bert", "plain"])
def test_every_length_to_the_position_table_is_served_each_bucket_checked_first(kind):
    model = tiny_bert() if kind == "bert" else Tagger().eval()
    torch.manual_seed(0)
    untuned = copy.deepcopy(model)
    table = 64 if kind == "bert" else 48
    w, call = tune(model, requests(8, 0, batches=(1, 2, 4), lengths=range(5, 25)))
    stats = call.describe()
    assert stats["length_range"] == (1, table) and "position table" in stats["range_from"]["length"]
    assert stats["batch_range"][1] > 8 and "what memory holds" in stats["range_from"]["batch"]
    ready = set(call._pad_ready())
    new = set()
    with torch.inference_mode():
        for n in range(1, table + 1):
            r = one_request(1 + n % 5, n, n)
            fit = call._pad_fit(((), r))  # the sizes and bucket the C type finds for the call
            assert fit is not None and fit[2] is not None
            if fit[2] not in ready:
                new.add(fit[2])
            same(model(**r), untuned(**r), call, f"a call of length {n}")
            ready = set(call._pad_ready())
            assert fit[2] in ready
            same(model(**r), untuned(**r), call, f"the call of length {n} again, from its bucket")
    stats = call.describe()
    assert stats["outside_range"] == 0 and stats["refused_buckets"] == 0 and sum(w.tt_untuned.values()) == 0
    assert stats["checked_buckets"] == len(new) > 3  # each new bucket checked once, at its first call
    assert stats["unready_calls"] == len(new)  # only that first call was served without its bucket
    assert "length 1-%d (the model's position table" % table in str(tt.status(model))


def test_a_bucket_whose_check_fails_never_serves():
    class LongForgets(Tagger):
        """Ignores its mask on calls longer than 36: padding a call of 33 to the bucket of 40
        changes its answer, which only that bucket's first check can see."""

        def forward(self, input_ids, attention_mask):
            if input_ids.shape[1] > 36:
                attention_mask = torch.ones_like(attention_mask)
            return super().forward(input_ids, attention_mask)

    torch.manual_seed(0)
    model = LongForgets().eval()
    untuned = copy.deepcopy(model)
    w, call = tune(model, requests(8, 0, batches=(1, 2), lengths=range(5, 25)))
    with torch.inference_mode():
        for _ in range(3):  # length 30: a new bucket (32) that holds; 33: one (40) that does not
            for n in (30, 33):
                r = one_request(2, n, n)
                r["attention_mask"][1, 1:] = 0  # a short row: padding it past 36 unmasks it
                same(model(**r), untuned(**r), call, f"a call of length {n}")
    stats = call.describe()
    assert stats["refused_buckets"] == 1 and stats["checked_buckets"] == 2
    assert (2, 32) in call._pad_ready() and (2, 40) not in call._pad_ready()
    assert stats["unready_calls"] == 4  # 32's first call, and each of 40's: the module answered
    assert "another answer than the original" in call.table.refused[(2, 40)]
    assert "1 new buckets refused" in str(tt.status(model))


def test_a_new_bucket_is_checked_in_its_first_call_serves_the_next_and_no_thread_is_started(monkeypatch):
    """The first call of a new bucket is answered by the module, then the bucket is recorded and
    checked in that same call (never on a thread beside the calls: a device graph being recorded
    there forbids the service's own synchronize, and a recompile there patches every thread's
    module calls); the next call of its range is served from it."""
    torch.manual_seed(0)
    model = Tagger().eval()
    untuned = copy.deepcopy(model)
    w, call = tune(model, requests(8, 0, batches=(1, 2), lengths=range(5, 25)))
    seen = []
    prove = padded_module.PaddedCall._prove_new

    def watched(self, key, job_call, reference):
        seen.append((key, threading.current_thread() is threading.main_thread(), self.fast_calls))
        return prove(self, key, job_call, reference)

    monkeypatch.setattr(padded_module.PaddedCall, "_prove_new", watched)
    threads, fast = threading.active_count(), call.fast_calls
    r = one_request(2, 40, 1)
    with torch.inference_mode():
        same(model(**r), untuned(**r), call, "the first call of a new bucket")
        assert seen == [((2, 40), True, fast)] and call.describe()["checked_buckets"] == 1
        for i in range(3):
            same(model(**r), untuned(**r), call, "a call of the checked bucket")
    assert call.fast_calls == fast + 3 and len(seen) == 1 and call.describe()["unready_calls"] == 1
    assert threading.active_count() == threads


def test_a_recording_that_raises_refuses_its_bucket_and_calls_stay_served(monkeypatch):
    torch.manual_seed(0)
    model = Tagger().eval()
    untuned = copy.deepcopy(model)
    w, call = tune(model, requests(8, 0, batches=(1, 2), lengths=range(5, 25)))

    def broken(self, key, job_call):
        raise RuntimeError("out of graph memory (a test)")

    monkeypatch.setattr(padded_module.PaddedCall, "_record", broken)
    with torch.inference_mode():
        for n in (30, 40, 30):
            r = one_request(2, n, n)
            same(model(**r), untuned(**r), call, f"a call of length {n}")
    stats = call.describe()
    assert stats["refused_buckets"] == 2 and "out of graph memory" in call.table.refused[(2, 32)]
    assert (2, 32) not in call._pad_ready() and stats["unready_calls"] == 3


class Mixer(nn.Module):
    """Hidden states and a mask, with a position table: buckets of a few hundred KiB each, so
    the memory cap binds before the count does."""

    def __init__(self) -> None:
        super().__init__()
        self.position_embeddings = nn.Embedding(64, 64)
        self.mix = nn.Linear(64, 64)

    def forward(self, hidden, attention_mask):
        h = hidden + self.position_embeddings(torch.arange(hidden.shape[1]))
        return self.mix(h) * attention_mask.unsqueeze(-1)


@pytest.mark.slow
def test_eviction_keeps_the_buckets_under_the_caps_with_eight_threads_and_a_thousand_shapes():
    torch.manual_seed(0)
    model = Mixer().eval()
    untuned = copy.deepcopy(model)
    data = [{"hidden": torch.randn(b, n, 64), "attention_mask": torch.ones(b, n, dtype=torch.long)}
            for b, n in ((1, 8), (2, 20), (4, 33), (3, 40), (1, 17), (2, 9), (4, 25), (1, 12))]
    w, call = tune(model, data, max_graphs=6, max_graph_memory_mb=1)
    rng = random.Random(0)
    shapes = rng.sample([(b, n) for b in range(1, 17) for n in range(1, 65)], 1000)
    stream = [{"hidden": torch.randn(b, n, 64), "attention_mask": torch.ones(b, n, dtype=torch.long)}
              for b, n in shapes]
    with torch.inference_mode():
        wanted = [untuned(**r) for r in stream]
    seen = {"count": 0, "bytes": 0}
    stop = threading.Event()

    def watch():
        while not stop.is_set():
            held = call.table.snapshot()[0]
            seen["count"] = max(seen["count"], len(held))
            seen["bytes"] = max(seen["bytes"], sum(b.memory for b in held))
            stop.wait(0.001)

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        in_threads(len(stream), lambda i: same(model(**stream[i]), wanted[i], call, f"call {i}"))
    finally:
        stop.set()
        watcher.join()
    stats = call.describe()
    assert seen["count"] <= 6 and seen["bytes"] <= 2**20, seen
    assert stats["evicted_buckets"] > 10 and stats["checked_buckets"] > 10 and stats["refused_buckets"] == 0
    assert stats["outside_range"] == 0 and call.fast_calls > 0 and sum(w.tt_untuned.values()) == 0
    with torch.inference_mode():  # what is left serves right
        for r, want in zip(stream[:50], wanted[:50]):
            same(model(**r), want, call, "a call after the stream")


def test_a_stale_file_serves_no_bucket_and_a_genuine_one_only_proven_ones(tmp_path):
    torch.manual_seed(0)
    model = Tagger().eval()
    untuned = copy.deepcopy(model)
    tune(model, requests(8, 0, batches=(1, 2), lengths=range(5, 25)))
    path = tmp_path / "tagger.tt"
    tt.save(model, path)
    stale = copy.deepcopy(untuned)
    with torch.no_grad():
        stale.out.bias.add_(0.5)  # other weights: the file's calls and outputs are not this module's
    with pytest.warns(UserWarning, match="recorded outputs are not this module's"):
        assert tt.load(stale, path, backends=[PaddedGraphBackend(graph=False, compile=False)])[""] is None
    fresh = copy.deepcopy(untuned)
    assert tt.load(fresh, path, backends=[PaddedGraphBackend(graph=False, compile=False)]) == {"": "PaddedGraph"}
    (group,) = tt.installed(fresh)[""].tt_signatures
    call = group.backend.callable
    stored = {call._pad_fit(s)[2] for s in group.samples} if group.samples else None
    assert stored is None or set(call._pad_ready()) == stored  # proven at load, on the stored calls
    r = one_request(2, 40, 3)
    with torch.inference_mode():
        for _ in range(2):
            same(fresh(**r), untuned(**r), call, "a new bucket after tt.load")
    assert call.describe()["checked_buckets"] == 1 and (2, 40) in call._pad_ready()
