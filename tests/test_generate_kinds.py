"""tweak's decode loop on the decoder families people use and on the generate() calls they
make: each test compares the loop's tokens with transformers' own generate() on the same model
(an untuned copy where tt.tweak tunes), greedy tokens identical, sampled tokens identical under
the same torch.manual_seed. Models are tiny configs with random weights; nothing is downloaded,
nothing compiles (the step-by-step loop; the CUDA graph loop is the GPU tests')."""

from __future__ import annotations

import copy

import pytest
import torch

import torch_tweak as tt
from torch_tweak._runtime.decode import call as decode_call, loop as decode_loop
from torch_tweak._runtime.decode.choice import Choice
from torch_tweak._search import decode_check

pytestmark = pytest.mark.slow  # tiny decoders of eight families, each generating

transformers = pytest.importorskip("transformers")

VOCAB = 200
COMMON = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=128)


def family(name: str):
    """A tiny decoder of one family; sliding windows (4 positions) shorter than the calls below."""
    torch.manual_seed(0)
    T = transformers
    if name == "qwen2":  # the attention mask a dict, one mask per layer type
        model = T.Qwen2ForCausalLM(T.Qwen2Config(**COMMON, tie_word_embeddings=True))  # as Qwen2.5-0.5B to 3B
    elif name == "qwen3":
        model = T.Qwen3ForCausalLM(T.Qwen3Config(**COMMON, head_dim=8, tie_word_embeddings=True))  # 0.6B to 4B
    elif name == "mistral":  # every layer a sliding window
        model = T.MistralForCausalLM(T.MistralConfig(**COMMON, sliding_window=4, tie_word_embeddings=False))
    elif name == "gemma2":  # sliding and full layers, soft-capping of attention and logits
        model = T.Gemma2ForCausalLM(T.Gemma2Config(**COMMON, head_dim=8, sliding_window=4, tie_word_embeddings=True))
    elif name == "gemma3":
        model = T.Gemma3ForCausalLM(T.Gemma3TextConfig(**COMMON, head_dim=8, sliding_window=4,
                                                       tie_word_embeddings=True))
    elif name == "phi3":
        model = T.Phi3ForCausalLM(T.Phi3Config(**COMMON, pad_token_id=0, eos_token_id=2, bos_token_id=1,
                                               tie_word_embeddings=False))
    elif name == "qwen2moe":
        model = T.Qwen2MoeForCausalLM(T.Qwen2MoeConfig(**COMMON, moe_intermediate_size=32, num_experts=4,
                                                       num_experts_per_tok=2, shared_expert_intermediate_size=32,
                                                       tie_word_embeddings=False))
    elif name == "mixtral":
        model = T.MixtralForCausalLM(T.MixtralConfig(**COMMON, num_local_experts=4, num_experts_per_tok=2,
                                                     tie_word_embeddings=False))
    else:
        raise ValueError(name)
    return model.eval()


FAMILIES = ["qwen2", "qwen3", "mistral", "gemma2", "gemma3", "phi3", "qwen2moe", "mixtral"]
_BUILT: dict[str, torch.nn.Module] = {}


def shared(name: str):
    """One model per family for the whole module (built once: a few hundred ms each)."""
    if name not in _BUILT:
        _BUILT[name] = family(name)
    return _BUILT[name]


def prompt(batch: int = 2, seed: int = 0, length: int = 6) -> torch.Tensor:
    return torch.randint(3, VOCAB, (batch, length), generator=torch.Generator().manual_seed(seed))


def both(model, ids, seed: int = 3, recorded: bool = False, **kwargs):
    """(transformers' tokens, the loop's tokens, the loop) for one call, each after
    torch.manual_seed(seed): a sampling call draws from the same generator state. recorded:
    the loop lays out the forward's arguments as the call's own generate() did (what tt.tweak
    gives it: the dict of masks, the sliding window's mask), not its defaults."""
    from torch_tweak._runtime.workload import Workload

    assert decode_loop.loop_of(model) is None
    torch.manual_seed(seed)
    with torch.no_grad():
        expected = model.generate(ids, **kwargs)
    layouts = None
    if recorded:
        job = Workload(model, lambda m: m.generate(ids, **kwargs), torch.device("cpu"))
        job.record()
        layouts = job.layouts
        assert layouts is not None
    loop = decode_loop.DecodeLoop(model, "loop", layouts)
    decode_loop.install(model, loop)
    try:
        torch.manual_seed(seed)
        with torch.no_grad():
            got = model.generate(ids, **kwargs)
    finally:
        decode_loop.uninstall(model)
    return expected, got, loop


# ------------------------------------------------------------------ families


@pytest.mark.parametrize("cache", [None, "static"])
@pytest.mark.parametrize("name", FAMILIES)
def test_each_family_gets_transformers_greedy_tokens(name, cache):
    """Qwen2/3, Gemma 2/3 and Qwen2-MoE take a dict of masks (one per layer type) with a static
    cache, Mistral one sliding-window mask: the loop refused them. 14 new tokens pass the
    4-position windows."""
    expected, got, loop = both(shared(name), prompt(), recorded=cache == "static", max_new_tokens=14, do_sample=False,
                               cache_implementation=cache)
    assert loop.calls == 1 and not loop.fallbacks, loop.fallbacks  # the loop served it
    assert torch.equal(got, expected)


@pytest.mark.parametrize("name", ["qwen2", "gemma2", "mistral"])
def test_each_family_serves_a_left_padded_batch(name):
    """Left padding with its attention mask, on the static cache: the masks (sliding windows
    too) are transformers' own mask functions on the padded mask, the positions counted from it."""
    model = shared(name)
    ids, mask = padded()
    for cache in (None, "static"):
        expected, got, loop = both(model, ids, recorded=True, attention_mask=mask, max_new_tokens=10,
                                   do_sample=False, cache_implementation=cache, pad_token_id=0)
        assert loop.calls == 1 and not loop.fallbacks, loop.fallbacks
        assert torch.equal(got, expected), cache


def padded():
    ids = prompt(3, seed=1, length=7)
    mask = torch.ones_like(ids)
    mask[0, :3] = 0
    mask[1, :1] = 0
    ids = ids.masked_fill(mask == 0, 0)
    return ids, mask


# ------------------------------------------------------------------ call kinds

KINDS = {
    "min_new_tokens": dict(min_new_tokens=12),
    "repetition_penalty": dict(repetition_penalty=1.6),
    "no_repeat_ngram_size": dict(no_repeat_ngram_size=2),
    "bad_words_ids": dict(bad_words_ids="made by the plain call"),
    "several_eos": dict(eos_token_id=list(range(3, 40)), pad_token_id=0),
    "pad_in_prompt": dict(pad_token_id=0, input="padded"),  # transformers infers the mask from the pad tokens
    "attention_mask": dict(pad_token_id=0, input="padded", attention_mask="padded"),
    "sampling": dict(do_sample=True, temperature=0.7, top_k=50, top_p=0.9),
    "min_p": dict(do_sample=True, min_p=0.05),
    "sampling_defaults": dict(do_sample=True),  # transformers' defaults (top_k=50) fill the rest
    "num_return_sequences": dict(do_sample=True, num_return_sequences=2, top_p=0.8),
    "sampling_processors_padding": dict(do_sample=True, repetition_penalty=1.3, no_repeat_ngram_size=3,
                                        min_new_tokens=4, eos_token_id=[5, 7], pad_token_id=0, input="padded",
                                        attention_mask="padded"),
}


DYNAMIC = ("attention_mask", "num_return_sequences", "sampling_processors_padding")
"""The kinds also tried with transformers' default DynamicCache (the 2-D mask passed on as it
is); every kind runs with a static cache (transformers' mask functions, a dict of masks)."""


@pytest.mark.parametrize("kind, cache", [(k, "static") for k in KINDS] + [(k, None) for k in DYNAMIC])
def test_each_call_kind_gets_transformers_tokens(kind, cache):
    """Each kind of call is served by the loop (transformers' own processors on the sequence
    so far, the draw torch.multinomial makes) and gives transformers' tokens: greedy calls
    exactly; sampling calls exactly under the same torch.manual_seed (both draw from the same
    CPU generator, once per step, from the same probabilities)."""
    model = shared("qwen2")
    kwargs = dict(KINDS[kind])
    ids, mask = padded() if kwargs.pop("input", None) == "padded" else (prompt(3), None)
    if kwargs.pop("attention_mask", None) == "padded":
        kwargs["attention_mask"] = mask
    if "bad_words_ids" in kwargs:
        kwargs["bad_words_ids"] = bad_words(model, ids)
    expected, got, loop = both(model, ids, recorded=cache == "static", max_new_tokens=12, cache_implementation=cache,
                               **{"do_sample": False, **kwargs})
    assert loop.calls == 1 and not loop.fallbacks, loop.fallbacks
    assert got.shape == expected.shape and torch.equal(got, expected), (got, expected)


def test_the_processors_change_the_tokens_so_the_kinds_above_test_something():
    """Every processor above changes what plain greedy decoding gives on the prompt used."""
    model = shared("qwen2")
    ids = prompt(3)
    with torch.no_grad():
        plain = model.generate(ids, max_new_tokens=16, do_sample=False)
        for kind in ("min_new_tokens", "repetition_penalty", "no_repeat_ngram_size", "bad_words_ids"):
            kwargs = dict(KINDS[kind])
            if kind == "bad_words_ids":
                kwargs["bad_words_ids"] = bad_words(model, ids)
            if kind == "min_new_tokens":  # an end-of-sequence the plain call reaches early
                kwargs["eos_token_id"] = int(plain[0, ids.shape[1] + 2])
                kwargs["pad_token_id"] = 0
                base = model.generate(ids, max_new_tokens=16, do_sample=False, eos_token_id=kwargs["eos_token_id"],
                                      pad_token_id=0)
            else:
                base = plain
            other = model.generate(ids, max_new_tokens=16, do_sample=False, **kwargs)
            assert not torch.equal(other, base), kind


def bad_words(model, ids):
    """Words of one, two and three tokens that plain greedy decoding makes on `ids`."""
    with torch.no_grad():
        new = model.generate(ids, max_new_tokens=16, do_sample=False)[0, ids.shape[1]:].tolist()
    return [new[1:2], new[4:6], new[8:11]]


def test_min_new_tokens_holds_back_an_end_of_sequence_as_transformers_does():
    model = shared("qwen2")
    ids = prompt(3)
    with torch.no_grad():
        free = model.generate(ids, max_new_tokens=16, do_sample=False)
    eos = int(free[0, ids.shape[1] + 1])  # what sequence 0 makes second: an early end
    for cache in (None, "static"):
        expected, got, loop = both(model, ids, max_new_tokens=16, do_sample=False, cache_implementation=cache,
                                   eos_token_id=eos, pad_token_id=0, min_new_tokens=6)
        assert loop.calls == 1 and torch.equal(got, expected)
        expected, got, loop = both(model, ids, max_new_tokens=16, do_sample=False, cache_implementation=cache,
                                   eos_token_id=eos, pad_token_id=0)
        assert loop.calls == 1 and torch.equal(got, expected)


def test_a_seed_gives_the_same_draws_and_another_seed_others():
    """The sampled tokens follow torch's generator: the loop's call after manual_seed(s) equals
    transformers' after manual_seed(s), and differs from the loop's after another seed."""
    model = shared("qwen2")
    ids = prompt(3)
    kwargs = dict(max_new_tokens=16, do_sample=True, temperature=1.5)
    expected, got, loop = both(model, ids, seed=11, **kwargs)
    assert loop.calls == 1 and torch.equal(got, expected)
    _, other, _ = both(model, ids, seed=12, **kwargs)
    assert not torch.equal(other, got)


def test_a_sampling_call_is_checked_with_a_forked_seeded_generator():
    """same_draws: a sampling call's check draws the same tokens every time, and leaves the
    caller's generator where it was."""
    model = shared("qwen2")
    ids = prompt(2)
    kwargs = dict(max_new_tokens=8, do_sample=True)
    torch.manual_seed(123)
    state = torch.get_rng_state()
    runs = []
    for _ in range(2):
        with decode_call.same_draws(model, (ids,), kwargs), torch.no_grad():
            runs.append(model.generate(ids, **kwargs))
    assert torch.equal(runs[0], runs[1])
    assert torch.equal(torch.get_rng_state(), state)


@pytest.mark.parametrize("why, kwargs", [
    ("a processor the loop does not run", {"suppress_tokens": [5, 6]}),
    ("typical sampling", {"do_sample": True, "typical_p": 0.9}),
    ("a stopping criterion", {"max_time": 30.0}),
    ("a forced end-of-sequence", {"forced_eos_token_id": 5}),
])
def test_calls_the_loop_cannot_serve_run_transformers_generate_untouched(why, kwargs):
    model = shared("qwen2")
    expected, got, loop = both(model, prompt(2), max_new_tokens=6, **kwargs)
    assert loop.calls == 0 and sum(loop.fallbacks.values()) == 1, (why, loop.fallbacks)
    if isinstance(expected, torch.Tensor):
        assert torch.equal(got, expected)


def test_the_default_length_is_transformers_twenty_new_tokens():
    """No max_length anywhere: transformers makes 20 new tokens (capped by the positions)."""
    model = copy.deepcopy(shared("qwen2"))
    model.generation_config.max_length = None
    expected, got, loop = both(model, prompt(1), do_sample=False)
    assert loop.calls == 1 and torch.equal(got, expected) and got.shape[1] == 6 + 20


# ------------------------------------------------------------------ tt.tweak


def test_a_sampling_workload_keeps_its_seeded_tokens():
    """tt.tweak on a sampling, repetition-penalised, left-padded workload on a Qwen2 (a dict of
    masks): the loop is checked on the workload's calls under a forked seeded generator and
    kept only when faster; either way a seeded call gives the untuned model's tokens."""
    model = family("qwen2")
    untuned = copy.deepcopy(model)
    ids, mask = padded()
    kwargs = dict(attention_mask=mask, max_new_tokens=5, do_sample=True, top_p=0.9, repetition_penalty=1.2,
                  pad_token_id=0, cache_implementation="static")
    result = tt.tweak(model, workload=lambda m: m.generate(ids, **kwargs), max_depth=0,
                      strategy=tt.OneBackendStrategy(tt.backends.TorchEagerBackend()),
                      measure={"rounds_max": 6, "time_cap": 0.5}, progress=False)
    loop_row = result.loop_report[1]
    assert loop_row["candidate"] == "decode loop (loop)" and loop_row["state"] != "failed", result.loop_report
    for seed in (0, 5):
        torch.manual_seed(seed)
        with torch.no_grad():
            expected = untuned.generate(ids, **kwargs)
        torch.manual_seed(seed)
        with torch.no_grad():
            got = model.generate(ids, **kwargs)
        assert torch.equal(got, expected), seed


def test_a_workload_the_loop_cannot_serve_refuses_it_before_running_it():
    """A call the loop would leave to transformers: the loop's candidate fails at once with the
    reason, without a run of the workload through it (the untuned generate() stays)."""
    model = family("qwen2")
    ids = prompt(2)
    runs = []

    def workload(m):
        runs.append(1)
        return m.generate(ids, max_new_tokens=6, do_sample=False, suppress_tokens=[5])

    result = tt.tweak(model, workload=workload, max_depth=0,
                      strategy=tt.OneBackendStrategy(tt.backends.TorchEagerBackend()),
                      measure={"rounds_max": 6, "time_cap": 0.5}, progress=False)
    report = {r["candidate"]: r for r in result.loop_report}
    assert "not ones the loop serves (the generation setting suppress_tokens=[5])" in report["decode loop (loop)"]["error"]
    assert result.decode_loop is None and decode_loop.loop_of(model) is None


def test_the_processed_distribution_is_checked_against_transformers_processors(monkeypatch):
    """distribution_difference, run by tt.tweak on a sampling call's loop: the loop's processed
    next-token distribution at every step against transformers' own (output_scores) on the same
    prefixes; a loop whose processing is off by 1 % of a temperature is named at its first step."""
    model = shared("qwen2")
    ids, mask = padded()
    kwargs = dict(attention_mask=mask, max_new_tokens=6, do_sample=True, temperature=0.8, top_p=0.95,
                  repetition_penalty=1.3, pad_token_id=0)
    loop = decode_loop.DecodeLoop(model, "loop")
    decode_loop.install(model, loop)
    try:
        assert decode_check.distribution_difference(model, loop, (ids,), kwargs) is None
        assert decode_check.distribution_difference(model, loop, (ids,), dict(kwargs, do_sample=False)) is None
        process = Choice.process
        monkeypatch.setattr(Choice, "process",
                            staticmethod(lambda call, logits, seq: process(call, logits, seq) / 1.01))
        problem = decode_check.distribution_difference(model, loop, (ids,), kwargs)
    finally:
        decode_loop.uninstall(model)
    assert problem is not None and problem.startswith("step 0: the processed next-token distribution"), problem
    assert loop.choice.captured is None


def test_recording_under_transformers_compiled_forward_is_never_traced():
    """A static-cache call transformers compiles (here with dynamo's eager backend: no Inductor)
    that the loop leaves to transformers: the depth search records the tuned modules' calls
    inside that compiled forward. The recorder was traced by dynamo and compiled again at every
    call until dynamo's recompile limit ("torch._dynamo hit config.recompile_limit ... function
    'torch_dynamo_resume_in_recorder_at_...' (tuning.py)"); now it is never traced. Nor are the
    module trace's timing hooks (inspecting.py), which broke the compiled forward's graph at
    time.perf_counter_ns where no loop is kept (seen on the H200, Llama-1B shape, prompt 512)."""
    import logging

    from transformers.generation.configuration_utils import CompileConfig

    torch._dynamo.reset()
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=128, tie_word_embeddings=True)).eval()
    config = CompileConfig(backend="eager", fullgraph=False)
    config._compile_all_devices = True
    model.generation_config.compile_config = config
    untuned = copy.deepcopy(model)
    ids = prompt(1)

    def workload(m):
        return m.generate(ids, max_new_tokens=12, do_sample=False, cache_implementation="static", suppress_tokens=[5])

    seen: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            seen.append(record.getMessage())

    keep = Keep(logging.WARNING)
    dynamo = logging.getLogger("torch._dynamo")  # its own handlers: not propagated to pytest's
    dynamo.addHandler(keep)
    counters = torch._dynamo.utils.counters
    counters.clear()
    try:
        tt.tweak(model, workload=workload, max_depth=1, strategy=tt.OneBackendStrategy(tt.backends.TorchEagerBackend()),
                 measure={"rounds_max": 6, "time_cap": 0.5}, progress=False)
    finally:
        dynamo.removeHandler(keep)
        torch._dynamo.reset()  # what it compiled must not count against later compiles of the same code
    limits = [m for m in seen if "recompile_limit" in m]
    assert not limits, limits
    hooks = [m for m in counters["graph_break"] if "perf_counter" in m]
    assert not hooks, hooks
    with torch.no_grad():
        assert torch.equal(workload(model), workload(untuned))


def test_a_saved_sampling_loop_is_checked_under_the_seed_and_installed_again(tmp_path):
    """tt.save keeps a sampling, padded, processed call (its mask, its bad words); tt.load runs
    it untuned and through the loop, each under the forked seeded generator, and installs the
    loop when they draw the same tokens; a seeded call then gives the untuned model's tokens."""
    from torch_tweak._core import records
    from torch_tweak._runtime.workload import Workload

    model = family("qwen2")
    ids, mask = padded()
    kwargs = dict(attention_mask=mask, max_new_tokens=6, do_sample=True, top_p=0.9, repetition_penalty=1.2,
                  pad_token_id=0, cache_implementation="static", bad_words_ids=[[5], [6, 7]])
    job = Workload(model, lambda m: m.generate(ids, **kwargs), torch.device("cpu"))
    job.record()
    loop = decode_loop.DecodeLoop(model, "loop", job.layouts)
    loop.checks = [(c.args, c.kwargs, c.tokens) for c in job.generate_calls]
    decode_loop.install(model, loop)
    records.made(model).decided = True  # the depth tweak kept: none, the loop alone
    tt.save(model, tmp_path / "sampler.tt", strict=True)
    fresh = family("qwen2")
    tt.load(fresh, tmp_path / "sampler.tt")
    assert decode_loop.loop_of(fresh) is not None
    outs = []
    for subject in (family("qwen2"), fresh):
        torch.manual_seed(9)
        with torch.no_grad():
            outs.append(subject.generate(ids, **kwargs))
    assert torch.equal(outs[0], outs[1])
    assert decode_loop.loop_of(fresh).calls == 1
