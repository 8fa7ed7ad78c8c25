"""The fused loop on the CPU: generate() calls decoded by tweak's own decode step and its choice
(torch_tweak._runtime.decode.fused_loop), tried, checked and kept by tt.tweak(model,
workload=...) as docs/generate.md shows it.

The decoders are tiny random-weight transformers models built with the tie flag their released
checkpoints use (Llama-3.2 and Qwen2.5 small models tie their embeddings; one untied Llama where
a test is about untied weights), at initializer_range=0.2: at the default 0.02 a tied random
decoder's logits favour its input token by a wide margin, so it repeats its last prompt token
and its tokens compare little (each tuning checks that its greedy tokens vary). Every verdict
on speed is the fake clock's: a run of the workload through the fused loop costs 1 ms, any
other 3 ms. Tunings are shared by the tests of this module (a few seconds each on two cores).
"""

from __future__ import annotations

import copy
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import support
import torch_tweak as tt
from torch_tweak._runtime.decode import call as decode_call, fused_loop, loop as decode_loop
from torch_tweak._runtime.decode.fused_kernels import Product
from torch_tweak._runtime.decode.fused_step import FusedDecoder
from torch_tweak._search import decode_check, fused_check

transformers = pytest.importorskip("transformers")

TESTS = str(Path(__file__).resolve().parent)
EAGER = tt.OneBackendStrategy(tt.backends.TorchEagerBackend())
QUICK = {"warmup_min": 1, "warmup_max": 2, "rounds_min": 3, "rounds_max": 4, "time_cap": 0.5}
VOCAB = 256
COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, max_position_embeddings=256, initializer_range=0.2)
GREEDY = dict(max_new_tokens=8, do_sample=False, cache_implementation="static")
CHAT = dict(do_sample=True, temperature=0.8, top_k=50, top_p=0.9, repetition_penalty=1.1, min_new_tokens=4,
            eos_token_id=3, pad_token_id=0, max_new_tokens=8, cache_implementation="static")
"""The chat call the issue measures, with min_new_tokens and an end token."""


def build(kind: str = "llama") -> torch.nn.Module:
    """A tiny decoder: "llama" and "qwen2" tied as released, "llama-untied"."""
    T = transformers
    torch.manual_seed(0)
    if kind == "qwen2":
        model = T.Qwen2ForCausalLM(T.Qwen2Config(**COMMON, tie_word_embeddings=True))
    else:
        model = T.LlamaForCausalLM(T.LlamaConfig(**COMMON, tie_word_embeddings=kind == "llama"))
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model.eval()


def prompt(batch: int = 1, seed: int = 0, length: int = 6) -> torch.Tensor:
    return torch.randint(4, VOCAB, (batch, length), generator=torch.Generator().manual_seed(seed))


def generate(model: torch.nn.Module, ids: torch.Tensor, settings: dict = GREEDY, seed: int | None = None):
    if seed is not None:
        torch.manual_seed(seed)
    with torch.no_grad():
        return model.generate(ids, **settings)


def workload(ids: torch.Tensor, settings: dict, clock):
    def run(m):
        loop = decode_loop.loop_of(m)
        clock.advance(1_000_000 if loop is not None and loop.kind == "fused" else 3_000_000)
        return m.generate(ids, **settings)
    return run


def tweak(model: torch.nn.Module, ids: torch.Tensor, settings: dict, clock):
    """tt.tweak on one call, its verdicts the fake clock's (conftest's fake_clock fixture)."""
    return tt.tweak(model, workload=workload(ids, settings, clock), strategy=EAGER, max_depth=0, measure=QUICK,
                    progress=False)


_TUNED: dict[tuple, tuple] = {}


def tuned(clock, kind: str = "llama", call: str = "greedy") -> tuple:
    """(the model tuned on one batch-1 call, an untuned copy, the prompt, the result), once per
    family and call for the module."""
    if (kind, call) not in _TUNED:
        model = build(kind)
        untuned = copy.deepcopy(model)
        ids = prompt(1, seed=1)
        settings = GREEDY if call == "greedy" else CHAT
        if call == "greedy":  # a random tied decoder repeats its input token at the default scale (module docs)
            assert len(set(generate(untuned, ids)[0, 6:].tolist())) >= 5
        _TUNED[kind, call] = model, untuned, ids, tweak(model, ids, settings, clock)
    return _TUNED[kind, call]


# ------------------------------------------------------------- kept, judged by the measured rule


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["llama", "qwen2", "llama-untied"])
def test_the_fused_loop_is_kept_and_judged_by_the_measured_rule(fake_clock, kind):
    model, untuned, ids, result = tuned(fake_clock, kind)
    assert result.decode_loop == "fused", str(result)
    (kept,) = [row for row in result.tokens if row.kept]
    assert kept.label == "untuned + decode loop (fused, torch)", [row.label for row in result.tokens]
    found = result.numerics["decode loop (fused, torch)"]
    assert re.fullmatch(r"call 0: [\d.]+x the original's error, the untuned tokens", found), found
    assert f"  correctness, decode loop (fused, torch): {found}" in str(result)
    assert torch.equal(generate(model, ids), generate(untuned, ids))
    assert "generate(): tweak's decode loop (fused, torch) served 1 call" in str(tt.status(model))
    loop = decode_loop.loop_of(model)
    assert loop.figures()["kernels"] == "torch" and loop.kinds == {("1 to 8", True)}


@pytest.mark.slow
@pytest.mark.parametrize("batch", [2, 3, 4, 8])
def test_batches_after_a_batch_one_tuning_give_the_untuned_tokens_with_no_fallback(fake_clock, batch):
    """One tuning at batch 1 serves every batch of 1 to 8 rows: a batch of 3 runs in the bucket
    of 4, its fourth row a copy of the third, cut from the output."""
    model, untuned, _, _ = tuned(fake_clock)
    loop = decode_loop.loop_of(model)
    calls = loop.calls
    for seed in range(2):
        ids = prompt(batch, seed=10 * batch + seed)
        assert torch.equal(generate(model, ids), generate(untuned, ids)), seed
    assert loop.calls == calls + 2 and not loop.fallbacks, loop.fallbacks


@pytest.mark.slow
@pytest.mark.parametrize("batch", [1, 3])
def test_a_chat_call_gives_transformers_draws_under_the_same_seed(fake_clock, batch):
    """Temperature 0.8, top-k 50, top-p 0.9, a repetition penalty of 1.1, min_new_tokens and an
    end token, tuned at batch 1: after the same torch.manual_seed, the untuned model's draws."""
    model, untuned, _, result = tuned(fake_clock, "llama", "chat")
    assert result.decode_loop == "fused", str(result)
    loop = decode_loop.loop_of(model)
    calls = loop.calls
    for seed in range(3):
        ids = prompt(batch, seed=20 + seed)
        assert torch.equal(generate(model, ids, CHAT, seed), generate(untuned, ids, CHAT, seed)), seed
    assert loop.calls == calls + 3 and not loop.fallbacks


# ------------------------------------------------------------- broken candidates


def _kv_swapped(decoder: FusedDecoder) -> FusedDecoder:
    layer = decoder.layers[0]
    q, k, v = layer.qkv.weights
    layer.qkv = Product((q, v, k), None, layer.qkv.norm, layer.qkv.eps)
    return decoder


def _rotary_shifted(decoder: FusedDecoder) -> FusedDecoder:
    table = decoder.table
    decoder.table = lambda length, device: tuple(t.roll(-1, 0) for t in table(length, device))  # p reads p + 1
    return decoder


def _no_top_p(choice):
    choice.parts = [p for p in choice.parts if type(p).__name__ != "TopPLogitsWarper"]
    return choice


def _penalty_twice(choice):
    at = next(i for i, p in enumerate(choice.parts) if type(p).__name__ == "SeenPenalty")
    choice.parts.insert(at, choice.parts[at])
    return choice


BROKEN = {"k and v swapped": ("read_model", _kv_swapped, GREEDY),
          "rotary position shifted": ("read_model", _rotary_shifted, GREEDY),
          "a sampler that ignores top-p": ("choice_for", _no_top_p, CHAT),
          "a repetition penalty applied twice": ("choice_for", _penalty_twice, CHAT)}

REFUSED = {"read_model": r"^generate call 0 step \d+ logits: [^:]*: ?[\d.e+]+x the original's error",
           "choice_for": r"generate call 0 \(the loop's processing\) step \d+: the processed next-token distribution "
                         r"is [\d.e+-]+ \(total variation\) from the reference's, [\d.e+]+x the "}


@pytest.mark.slow
@pytest.mark.parametrize("how", sorted(BROKEN))
def test_a_broken_candidate_is_refused_by_the_loop_check_with_the_step_and_the_multiple(monkeypatch, fake_clock,
                                                                                        how):
    """A candidate step made wrong through the module's makers (the test's hook): tt.tweak's
    loop check refuses it, its row saying the step and the multiple; generate() stays as it was
    for the workload's call."""
    hook, breaks, settings = BROKEN[how]
    made = getattr(fused_loop, hook)
    monkeypatch.setattr(fused_loop, hook, lambda *args: breaks(made(*args)))
    model = build("llama")
    untuned = copy.deepcopy(model)
    ids = prompt(1, seed=1)
    result = tweak(model, ids, settings, fake_clock)
    (row,) = [r for r in result.loop_report if r["candidate"] == "decode loop (fused, torch)"]
    assert row["state"] == "failed" and not row["kept"], row
    found = result.numerics["decode loop (fused, torch)"]
    assert found.startswith("refused: ") and re.search(REFUSED[hook], found.removeprefix("refused: ")), found
    assert row["error"] == "MismatchError: " + found.removeprefix("refused: ")
    assert result.decode_loop != "fused"
    (shown,) = [r for r in result.tokens if r.label == "untuned + decode loop (fused, torch)"]
    assert shown.status.startswith("refused: MismatchError: generate call 0") and " step " in shown.status, shown.status
    assert "  correctness, decode loop (fused, torch): refused: generate call 0" in str(result)
    assert torch.equal(generate(model, ids, settings, 0), generate(untuned, ids, settings, 0))


# ------------------------------------------------------------- the loop's parts


def test_teacher_forcing_runs_through_the_fused_step():
    """The measured rule's teacher forcing of a fused loop is the step's own: the logits of the
    untuned tokens fed to it, each step's from the fused step."""
    model = build("llama")
    untuned = copy.deepcopy(model)
    ids = prompt(2, seed=3)
    tokens = generate(untuned, ids)
    loop = decode_loop.DecodeLoop(model, "fused")
    decode_loop.install(model, loop)
    raw, processed = decode_check.teacher_forced(model, (ids,), GREEDY, tokens)
    decoder = FusedDecoder.of(untuned)
    want = fused_check.teacher_forced(decoder, ids, tokens)
    assert processed is None and len(raw) == len(want) == 8 and loop.calls == 1 and not loop.fallbacks
    for got, expected in zip(raw, want):
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("why, ids, settings", [
    ("padding in the prompt", torch.tensor([[0, 0, 9, 10, 11, 12], [5, 6, 7, 8, 9, 10]]), GREEDY),
    ("the logits processor NoRepeatNGramLogitsProcessor", prompt(1), dict(GREEDY, no_repeat_ngram_size=2)),
    ("a batch of 9 rows", prompt(9), GREEDY),
])
def test_a_call_the_fused_step_does_not_serve_runs_transformers_loop_with_its_reason(why, ids, settings):
    model = build("llama")
    untuned = copy.deepcopy(model)
    loop = decode_loop.DecodeLoop(model, "fused")
    decode_loop.install(model, loop)
    assert torch.equal(generate(model, ids, settings), generate(untuned, ids, settings))
    assert loop.calls == 0 and len(loop.fallbacks) == 1 and why in next(iter(loop.fallbacks)), loop.fallbacks


def test_a_model_the_fused_step_does_not_read_is_not_tried():
    """GPT-2: its own loops are tried, the fused one is not (its reason when installed anyway)."""
    from torch_tweak._search import loop_search
    from torch_tweak._runtime.workload import Workload

    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=1, n_head=2,
                                                                 n_positions=64, tie_word_embeddings=True)).eval()
    job = Workload(model, lambda m: m.generate(prompt(1), max_new_tokens=3, do_sample=False), torch.device("cpu"))
    job.record()
    assert loop_search.fused_kernels(job, torch.device("cpu"), high=True) == []
    loop = decode_loop.DecodeLoop(model, "fused")
    assert "GPT2LMHeadModel" in loop.problem(decode_call.greedy_call(model, (prompt(1),), GREEDY))


def test_a_dynamic_cache_call_is_served_from_the_loop_s_own_static_cache():
    model = build("llama")
    untuned = copy.deepcopy(model)
    decode_loop.install(model, loop := decode_loop.DecodeLoop(model, "fused"))
    dynamic = dict(GREEDY, cache_implementation=None)
    for batch in (1, 3):
        ids = prompt(batch, seed=batch)
        assert torch.equal(generate(model, ids, dynamic), generate(untuned, ids, dynamic))
    assert loop.calls == 2 and not loop.fallbacks


def test_weights_replaced_after_the_loop_read_them_are_read_again():
    model = build("llama")
    untuned = copy.deepcopy(model)
    decode_loop.install(model, loop := decode_loop.DecodeLoop(model, "fused"))
    ids = prompt(1, seed=4)
    assert torch.equal(generate(model, ids), generate(untuned, ids))
    for m in (model, untuned):  # the same new weight in both, as a new Parameter
        with torch.no_grad():
            m.model.layers[1].mlp.down_proj.weight = torch.nn.Parameter(m.model.layers[1].mlp.down_proj.weight * 1.5)
    assert torch.equal(generate(model, ids), generate(untuned, ids))
    assert loop.calls == 2 and not loop.fallbacks


@pytest.mark.slow
def test_eight_threads_share_a_fused_loop_and_each_gets_its_untuned_tokens():
    model = build("llama")
    untuned = copy.deepcopy(model)
    prompts = [prompt(1 + i, seed=i, length=4 + i % 3) for i in range(8)]
    expected = [generate(untuned, p) for p in prompts]
    decode_loop.install(model, loop := decode_loop.DecodeLoop(model, "fused"))

    def check(i: int) -> None:
        for _ in range(3):
            assert torch.equal(generate(model, prompts[i]), expected[i]), f"prompt {i}"

    support.in_threads(8, check, mode=torch.no_grad)
    assert loop.calls == 24 and not loop.fallbacks


# ------------------------------------------------------------- kept and loaded


@pytest.mark.slow
def test_a_saved_fused_loop_gives_the_same_tokens_in_a_new_process(tmp_path, fake_clock):
    model, untuned, ids, _ = tuned(fake_clock)
    path = tmp_path / "decoder.tt"
    tt.save(model, path, strict=True)
    prompts = [ids, prompt(3, seed=5), prompt(8, seed=6, length=9)]
    torch.save({"prompts": prompts, "expected": [generate(untuned, p) for p in prompts]}, tmp_path / "expected.pt")
    script = f"""
import sys, torch, torch_tweak as tt
sys.path.insert(0, {TESTS!r})
from test_fused_loop import build, generate
model = build("llama")
tt.load(model, {str(path)!r})
data = torch.load({str(tmp_path / 'expected.pt')!r})
assert all(torch.equal(generate(model, p), e) for p, e in zip(data["prompts"], data["expected"])), "tokens differ"
print(tt.status(model))
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "generate(): tweak's decode loop (fused, torch) served 3 calls" in done.stdout, done.stdout
    assert "transformers' loop ran" not in done.stdout, done.stdout


@pytest.mark.slow
@pytest.mark.parametrize("edit, why", [
    (lambda g: g.pop("kernels"), "names its kernels"),
    (lambda g: g.update(kernels="cuda graphs of a stranger"), "names its kernels"),
    (lambda g: g.update(kind="loop"), "names its kernels"),  # kernels on a loop of another kind
])
def test_a_forged_fused_loop_entry_is_refused_whole(tmp_path, fake_clock, edit, why):
    import forgery

    model, _, _, _ = tuned(fake_clock)
    path = tmp_path / "decoder.tt"
    tt.save(model, path)
    fresh = build("llama")
    forged = forgery.with_plan(tmp_path, "forged", forgery.members(path), lambda plan: edit(plan["generate"]))
    with pytest.raises(tt.CheckpointError, match=why):
        tt.load(fresh, forged)
    assert decode_loop.loop_of(fresh) is None and not tt.installed(fresh)
