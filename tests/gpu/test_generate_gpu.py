"""tweak's decode loop on CUDA: each decode step a device graph replay with a static cache.
Its tokens are compared with transformers' own generate() on an untuned copy."""

from __future__ import annotations

import copy

import pytest
import torch

import torch_tweak as tt
from torch_tweak._runtime.decode import call as decode_call, loop as decode_loop

transformers = pytest.importorskip("transformers")


def build(kind: str, dtype=torch.float32):
    torch.manual_seed(0)
    if kind == "llama":
        config = transformers.LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                          num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                                          tie_word_embeddings=True)  # as Llama-3.2-1B and 3B ship
        model = transformers.LlamaForCausalLM(config)
    else:
        model = transformers.GPT2LMHeadModel(transformers.GPT2Config(vocab_size=256, n_embd=64, n_layer=2, n_head=2,
                                                                     n_positions=256, tie_word_embeddings=True))
    return model.eval().to("cuda", dtype)


def generate(model, ids, n=40, **kwargs):
    with torch.no_grad():
        return model.generate(ids, max_new_tokens=n, do_sample=False, cache_implementation="static",
                              disable_compile=True, **kwargs)


@pytest.mark.parametrize("kind", ["llama", "gpt2"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_step_graph_gives_transformers_tokens(kind, dtype):
    model = build(kind, dtype)
    untuned = copy.deepcopy(model)
    loop = decode_loop.DecodeLoop(model, "graph")
    decode_loop.install(model, loop)
    for batch, length, seed in ((1, 7, 0), (2, 7, 1), (1, 7, 2), (1, 11, 3)):
        ids = torch.randint(3, 256, (batch, length), device="cuda", generator=torch.Generator("cuda").manual_seed(seed))
        assert torch.equal(generate(model, ids), generate(untuned, ids)), (batch, length)
    assert loop.calls == 4 and not loop.fallbacks
    # one graph per (batch, cache length): the third call reused the first's
    assert 2 <= len(loop.graph.graphs) <= 3


def test_the_step_graph_stops_at_the_end_of_sequence():
    model = build("llama")
    ids = torch.randint(3, 256, (2, 6), device="cuda", generator=torch.Generator("cuda").manual_seed(4))
    free = generate(model, ids)
    eos = int(free[0, 6 + 20])  # past the first check (16 steps): the rule is read every 16
    expected = generate(model, ids, eos_token_id=eos, pad_token_id=0)
    decode_loop.install(model, decode_loop.DecodeLoop(model, "graph"))
    assert torch.equal(generate(model, ids, eos_token_id=eos, pad_token_id=0), expected)
    one = ids[:1]
    decode_loop.uninstall(model)
    expected = generate(model, one, eos_token_id=eos, pad_token_id=0)
    decode_loop.install(model, decode_loop.DecodeLoop(model, "graph"))
    assert torch.equal(generate(model, one, eos_token_id=eos, pad_token_id=0), expected)


def test_a_generate_workload_keeps_the_graph_loop_on_cuda():
    model = build("gpt2")
    untuned = copy.deepcopy(model)
    ids = torch.randint(3, 256, (1, 8), device="cuda", generator=torch.Generator("cuda").manual_seed(5))
    result = tt.tweak(model, workload=lambda m: generate(m, ids, 32), max_depth=0, progress=False,
                      measure={"rounds_max": 8, "time_cap": 1.0},
                      strategy=tt.OneBackendStrategy(tt.backends.TorchEagerBackend()))
    assert result.decode_loop == "graph", str(result)
    other = torch.randint(3, 256, (1, 8), device="cuda", generator=torch.Generator("cuda").manual_seed(6))
    assert torch.equal(generate(model, other, 32), generate(untuned, other, 32))
    assert any(row.label.startswith("untuned + decode loop (graph)") for row in result.tokens)


def compiled_generate(model, ids, n=40, **kwargs):
    """The static-cache call as a user writes it: transformers compiles its decode steps."""
    with torch.no_grad():
        return model.generate(ids, max_new_tokens=n, do_sample=False, cache_implementation="static", **kwargs)


def test_the_compiled_loop_gives_the_tokens_of_transformers_compiled_steps():
    import torch._dynamo.utils as dynamo_utils

    model = build("llama", torch.bfloat16)
    untuned = copy.deepcopy(model)
    loop = decode_loop.DecodeLoop(model, "compiled")
    decode_loop.install(model, loop)
    graphs = None
    for batch, length, seed in ((1, 7, 0), (1, 7, 1), (2, 7, 2), (1, 7, 3)):
        ids = torch.randint(3, 256, (batch, length), device="cuda", generator=torch.Generator("cuda").manual_seed(seed))
        assert torch.equal(compiled_generate(model, ids), compiled_generate(untuned, ids)), (batch, length, seed)
        if seed == 2:
            graphs = dynamo_utils.counters["stats"]["unique_graphs"]
    # the last call had the first's shapes: the compiled forward's guards held, nothing compiled again
    assert dynamo_utils.counters["stats"]["unique_graphs"] == graphs
    assert loop.calls == 4 and not loop.fallbacks
    # an end-of-sequence past the first read of the stopping rule
    ids = torch.randint(3, 256, (2, 7), device="cuda", generator=torch.Generator("cuda").manual_seed(4))
    eos = int(compiled_generate(untuned, ids)[0, 7 + 20])
    assert torch.equal(compiled_generate(model, ids, eos_token_id=eos, pad_token_id=0),
                       compiled_generate(untuned, ids, eos_token_id=eos, pad_token_id=0))


def test_a_compiled_static_workload_keeps_the_compiled_loop_and_saves_it(tmp_path, monkeypatch):
    """The fused loop left out (it is faster here, and kept: the fused tests hold it), the
    compiled loop against transformers' compiled steps: kept, saved, loaded, the same tokens."""
    from torch_tweak._search import loop_search

    monkeypatch.setattr(loop_search, "fused_kernels", lambda *a, **k: [])
    model = build("llama", torch.bfloat16)
    untuned = copy.deepcopy(model)
    ids = torch.randint(3, 256, (1, 8), device="cuda", generator=torch.Generator("cuda").manual_seed(5))
    result = tt.tweak(model, workload=lambda m: compiled_generate(m, ids, 32), progress=False,
                      measure={"rounds_max": 8, "time_cap": 1.0})
    assert result.decode_loop == "compiled", str(result)
    assert all(row.latency_ms is None and "compiled forward" in row.error for row in result.rows)
    other = torch.randint(3, 256, (1, 8), device="cuda", generator=torch.Generator("cuda").manual_seed(6))
    assert torch.equal(compiled_generate(model, other, 32), compiled_generate(untuned, other, 32))
    tt.save(model, tmp_path / "decoder.tt")
    fresh = copy.deepcopy(untuned)
    tt.load(fresh, tmp_path / "decoder.tt")
    assert decode_loop.loop_of(fresh) is not None and decode_loop.loop_of(fresh).kind == result.decode_loop
    assert torch.equal(compiled_generate(fresh, other, 32), compiled_generate(untuned, other, 32))


def family(name: str, dtype=torch.bfloat16):
    """Tiny decoders of the families issue 29 names (sliding windows of 8 positions)."""
    torch.manual_seed(0)
    common = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=256)
    T = transformers
    if name == "qwen2":
        model = T.Qwen2ForCausalLM(T.Qwen2Config(**common, tie_word_embeddings=True))  # as Qwen2.5-0.5B to 3B
    elif name == "mistral":
        model = T.MistralForCausalLM(T.MistralConfig(**common, sliding_window=8, tie_word_embeddings=False))
    elif name == "gemma2":
        model = T.Gemma2ForCausalLM(T.Gemma2Config(**common, head_dim=16, sliding_window=8, tie_word_embeddings=True))
    else:
        model = T.Qwen2MoeForCausalLM(T.Qwen2MoeConfig(**common, moe_intermediate_size=64, num_experts=4,
                                                       num_experts_per_tok=2, shared_expert_intermediate_size=64,
                                                       tie_word_embeddings=False))
    return model.eval().to("cuda", dtype)


@pytest.mark.parametrize("name", ["qwen2", "mistral", "gemma2", "qwen2moe"])
def test_each_family_through_the_compiled_and_the_graph_loop(name):
    """The compiled loop serves every family with transformers' compiled tokens; the graph
    loop records Qwen2's and the MoE's step (one causal mask, its dict made by the loop) and
    leaves a sliding window's (Mistral, Gemma 2) to transformers, with the reason."""
    model = family(name)
    untuned = copy.deepcopy(model)
    ids = torch.randint(3, 256, (2, 7), device="cuda", generator=torch.Generator("cuda").manual_seed(0))
    loop = decode_loop.DecodeLoop(model, "compiled")
    decode_loop.install(model, loop)
    assert torch.equal(compiled_generate(model, ids, 24), compiled_generate(untuned, ids, 24))
    assert loop.calls == 1 and not loop.fallbacks
    decode_loop.uninstall(model)
    loop = decode_loop.DecodeLoop(model, "graph")
    decode_loop.install(model, loop)
    assert torch.equal(generate(model, ids, 24), generate(untuned, ids, 24))
    if name in ("mistral", "gemma2"):
        assert loop.calls == 0 and any("graph loop does not record" in why for why in loop.fallbacks)
    else:
        assert loop.calls == 1 and not loop.fallbacks


def assert_same_draws(untuned, model, ids, settings, seeds):
    """After the same torch.manual_seed, the tuned model's sampling call gives the untuned one's tokens."""
    for seed in seeds:
        outs = []
        for subject in (untuned, model):
            torch.manual_seed(seed)
            with torch.no_grad():
                outs.append(subject.generate(ids, **settings))
        assert torch.equal(outs[0], outs[1]), seed


@pytest.mark.parametrize("kind", ["compiled", "loop"])
def test_seeded_sampling_on_the_gpu_equals_transformers(kind):
    """The seed rule on a GPU: after the same torch.manual_seed, a sampling call through the
    loop draws transformers' tokens (compiled: its compiled forward; loop: eager steps)."""
    model = build("llama", torch.bfloat16)
    untuned = copy.deepcopy(model)
    loop = decode_loop.DecodeLoop(model, kind)
    decode_loop.install(model, loop)
    ids = torch.randint(3, 256, (4, 7), device="cuda", generator=torch.Generator("cuda").manual_seed(1))
    settings = dict(max_new_tokens=32, do_sample=True, temperature=0.7, top_k=50, top_p=0.9,
                    repetition_penalty=1.1, cache_implementation="static", disable_compile=kind == "loop")
    assert_same_draws(untuned, model, ids, settings, seeds=(0, 1))
    assert loop.calls == 2 and not loop.fallbacks


def test_seeded_sampling_inside_a_step_graph_equals_transformers():
    """Temperature, top-k and top-p sampling recorded inside the step graph: after the same
    torch.manual_seed, the replays draw transformers' tokens; a processor that reads the
    sequence so far (a repetition penalty) is left to transformers, with the reason."""
    model = build("llama", torch.bfloat16)
    untuned = copy.deepcopy(model)
    loop = decode_loop.DecodeLoop(model, "graph")
    decode_loop.install(model, loop)
    ids = torch.randint(3, 256, (4, 7), device="cuda", generator=torch.Generator("cuda").manual_seed(1))
    settings = dict(max_new_tokens=32, do_sample=True, temperature=0.7, top_k=50, top_p=0.9,
                    cache_implementation="static", disable_compile=True)
    assert_same_draws(untuned, model, ids, settings, seeds=(0, 1, 2))
    assert loop.calls == 3 and not loop.fallbacks and len(loop.graph.graphs) == 1
    torch.manual_seed(0)
    with torch.no_grad():
        penalised = model.generate(ids, repetition_penalty=1.1, **settings)
    torch.manual_seed(0)
    with torch.no_grad():
        assert torch.equal(penalised, untuned.generate(ids, repetition_penalty=1.1, **settings))
    assert any("RepetitionPenaltyLogitsProcessor" in why for why in loop.fallbacks)


def test_the_top_sampler_gives_transformers_processed_scores_on_cuda():
    """On CUDA, with no change to torch.sort (the order it gives ties is what the sampler
    reproduces): the processed scores of bf16 logits of the Llama-3 vocabulary, ties at the
    k-th and across the top-p cut, equal transformers' processors'. A row may differ only
    where a running sum lies within float32's last bits of 1 - top_p (the sampler's docstring):
    at most one row of the 240 here."""
    from torch_tweak._runtime.decode import choice as sampling

    T = transformers
    differing = 0
    for temperature, top_k, top_p in ((0.7, 50, 0.9), (1.0, 50, None), (1.3, 200, 0.5), (0.7, 8, 0.95)):
        chain = [T.TemperatureLogitsWarper(temperature), T.TopKLogitsWarper(top_k)]
        chain += [T.TopPLogitsWarper(top_p)] if top_p is not None else []
        chain = T.LogitsProcessorList(chain)
        for seed in range(15):
            g = torch.Generator("cuda").manual_seed(seed)
            logits = (torch.randn(4, 128256, device="cuda", generator=g) * (0.5, 2.0, 8.0)[seed % 3]).bfloat16()
            sampler = sampling.TopSampler.of(chain, True, torch.device("cuda"))
            got = sampler.process(logits.float())
            expected = chain(None, logits.float())
            differing += int((got != expected).any(-1).sum())
            assert not sampler.overflowed()
    assert differing <= 1, differing


@pytest.mark.parametrize("kind", ["compiled", "loop"])
@pytest.mark.parametrize("record", [True, False])
def test_seeded_top_k_top_p_sampling_through_the_top_sampler_equals_transformers(kind, record, monkeypatch):
    """Through the top-k sampler, its choice recorded as a device graph (sampling.RecordedDraw)
    or run eagerly: after the same torch.manual_seed, transformers' tokens, every step served
    by the sampler."""
    from torch_tweak._runtime.decode import choice as sampling

    served = []
    process = sampling.TopSampler.process
    monkeypatch.setattr(sampling.TopSampler, "process", lambda self, s: served.append(1) or process(self, s))
    model = build("llama", torch.bfloat16)
    untuned = copy.deepcopy(model)
    loop = decode_loop.DecodeLoop(model, kind, top_sampler=True)
    loop.choice.record_draws = record
    decode_loop.install(model, loop)
    ids = torch.randint(3, 256, (4, 7), device="cuda", generator=torch.Generator("cuda").manual_seed(1))
    settings = dict(max_new_tokens=32, do_sample=True, temperature=0.7, top_k=50, top_p=0.9,
                    cache_implementation="static", disable_compile=kind == "loop")
    assert_same_draws(untuned, model, ids, settings, seeds=(0, 1, 2))
    assert loop.calls == 3 and not loop.fallbacks and loop.resampled == 0
    if record:  # recorded once (two warm-up runs, then the recording), then replayed at every step
        (draw,) = loop.choice.draws.values()
        assert draw.graph is not None and draw.replays == 3 * 32 and len(served) == 3, (draw.replays, len(served))
    else:
        assert len(served) == 3 * 32 and not loop.choice.draws


def test_a_recorded_draw_that_overflows_makes_the_call_again_with_transformers_tokens():
    """Every logit 0 (a zeroed head): every score ties with the k-th, past the margin. The
    recorded draw flags it on the device, the call is made again with transformers' processors
    from the same generator state, and its tokens are transformers'; the flag is cleared for
    the next call, and a call of another batch size records a draw of its own."""
    model = build("llama", torch.bfloat16)
    with torch.no_grad():
        model.lm_head.weight.zero_()
    untuned = copy.deepcopy(model)
    loop = decode_loop.DecodeLoop(model, "compiled", top_sampler=True)
    decode_loop.install(model, loop)
    settings = dict(max_new_tokens=16, do_sample=True, temperature=0.7, top_k=50, top_p=0.9,
                    cache_implementation="static")
    for batch in (1, 3):
        ids = torch.randint(3, 256, (batch, 7), device="cuda", generator=torch.Generator("cuda").manual_seed(batch))
        assert_same_draws(untuned, model, ids, settings, seeds=(0, 1))
    assert loop.calls == 4 and loop.resampled == 4 and not loop.fallbacks
    draws = loop.choice.draws
    assert sorted(k[0] for k in draws) == [1, 3] and all(d.graph is not None for d in draws.values())


@pytest.mark.parametrize("kind", ["compiled", "graph"])
def test_a_recorded_prefill_gives_the_eager_prefills_bits_and_the_untuned_tokens(kind):
    """A prompt shape's prefill is recorded at its second call and replayed after: every call
    (a new prompt each) gives the untuned tokens, and on prompts the recording never saw the
    replay's logits and cache are the eager prefill's, bit for bit."""
    from torch_tweak._runtime.decode import prefill

    model = build("llama", torch.bfloat16)
    untuned = copy.deepcopy(model)
    loop = decode_loop.DecodeLoop(model, kind)
    decode_loop.install(model, loop)
    run = compiled_generate if kind == "compiled" else generate
    shapes = [(1, 7), (1, 7), (2, 7), (2, 7), (1, 7), (2, 7), (1, 7)]
    for seed, (batch, length) in enumerate(shapes):
        ids = torch.randint(3, 256, (batch, length), device="cuda", generator=torch.Generator("cuda").manual_seed(seed))
        assert torch.equal(run(model, ids), run(untuned, ids)), (seed, batch, length)
    assert not loop.fallbacks and not loop.prefills.unrecorded, loop.prefills.unrecorded
    recorded = list(loop.prefills.recorded.values())
    assert len(recorded) == 2 and all(p.graph is not None and p.replays >= 2 for p in recorded)
    assert "prefill recorded as a device graph for 2 prompt shapes" in str(tt.status(model))
    for p in recorded:
        batch, length = p.ids.shape
        for seed in range(10, 13):
            ids = torch.randint(3, 256, (batch, length), device="cuda",
                                generator=torch.Generator("cuda").manual_seed(seed))
            call = decode_call.greedy_call(model, (ids,), dict(max_new_tokens=40, do_sample=False,
                                                                cache_implementation="static"))
            with torch.no_grad():
                p.cache.reset()
                eager = loop.prefills.run(call, p.cache).clone()
                eager_cache = prefill.prompt_part(p.cache, length)
                got = p(ids).clone()
            assert torch.equal(got, eager), (batch, seed)
            assert all(torch.equal(a, b) for a, b in zip(prefill.prompt_part(p.cache, length), eager_cache))


@pytest.mark.parametrize("name", ["mistral", "gemma2"])
def test_a_sliding_window_cache_is_counted_as_eagerly_after_a_replayed_prefill(name):
    """A sliding window's static cache counts its positions in Python, which a replay does not:
    the cache is reset on the host before the replay and its count set after it as the eager
    prefill sets it. Prompts longer (12) and shorter (6) than the window (8), a new prompt each
    call: every call gives transformers' compiled tokens, and both shapes are recorded and
    replayed (the masks made as eagerly while recording: prefill.masks_as_eager)."""
    model = family(name)
    untuned = copy.deepcopy(model)
    loop = decode_loop.DecodeLoop(model, "compiled")
    decode_loop.install(model, loop)
    for seed in range(8):
        length = 12 if seed % 2 else 6
        ids = torch.randint(3, 256, (2, length), device="cuda", generator=torch.Generator("cuda").manual_seed(seed))
        assert torch.equal(compiled_generate(model, ids, 24), compiled_generate(untuned, ids, 24)), seed
    assert not loop.fallbacks and not loop.prefills.unrecorded, loop.prefills.unrecorded
    # the cache never shrinks (transformers' rule): the 6-token prompts after the first have the
    # 12-token prompts' cache, so they are recorded at seed 4 and the 12-token ones at seed 3; a
    # recording call replays twice (the recording's check, then the call)
    replays = {p.ids.shape[1]: p.replays for p in loop.prefills.recorded.values() if p.graph is not None}
    assert replays == {6: 3, 12: 4}, replays


def test_recorded_graphs_outlive_dropped_blas_workspaces():
    """torch.compile's device graphs drop cuBLAS's workspaces (and empty the cache) around each
    of their recordings. A graph recorded by record_graph (the loop's prefill, its step, the
    draw) has a workspace of its own in its pool: after a drop, and the freed memory taken by
    other tensors, its replays give the eager products and write nothing outside the pool.
    The products are one-row ones with a long inner axis, which cuBLAS splits over its
    workspace. (Last in the file: a graph that wrote freed memory could fault the device for
    the tests after it.)"""
    from torch_tweak._runtime.decode.model import record_graph

    g = torch.Generator("cuda").manual_seed(0)
    x = torch.randn(1, 16384, device="cuda", dtype=torch.bfloat16, generator=g)
    ws = [torch.randn(16384, n, device="cuda", dtype=torch.bfloat16, generator=g) for n in (256, 1024, 2048)]
    device = torch.device("cuda", torch.cuda.current_device())

    def products():
        return [x @ w for w in ws]

    expected = [p.clone() for p in products()]
    graph, out = record_graph(products, device, warmups=2)
    torch._C._cuda_clearCublasWorkspaces()
    torch.cuda.empty_cache()
    filler = [torch.full((1 << 20,), 7.0, device="cuda") for _ in range(256)]  # takes the freed memory
    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize()
    assert all(torch.equal(a, b) for a, b in zip(out, expected))
    assert all(bool((f == 7.0).all()) for f in filler)


# ------------------------------------------------------------- the fused loop (tweak's own decode step)


def fused_model(dtype=torch.float32):
    """A tiny Llama tied as Llama-3.2 ships, at initializer_range=0.2 (a tied random decoder at
    the default scale repeats its input token: its tokens would compare little)."""
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                      max_position_embeddings=256, initializer_range=0.2, tie_word_embeddings=True)
    model = transformers.LlamaForCausalLM(config).eval().to("cuda", dtype)
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model


def fused_kernels_or_skip(kernels: str) -> None:
    from torch_tweak._runtime.decode.fused_kernels import triton_problem

    if kernels == "triton" and triton_problem(torch.device("cuda")) is not None:
        pytest.skip(triton_problem(torch.device("cuda")))


@pytest.mark.parametrize("kernels", ["torch", "triton"])
def test_the_fused_loop_gives_the_untuned_tokens_at_batches_one_and_three(kernels):
    """One recorded step per batch bucket and cache length, replayed from C; a batch of 3 runs in
    the bucket of 4, its extra row cut; no call falls back to transformers' loop."""
    fused_kernels_or_skip(kernels)
    model = fused_model()
    untuned = copy.deepcopy(model)
    loop = decode_loop.DecodeLoop(model, "fused", kernels=kernels)
    decode_loop.install(model, loop)
    for batch, seed in ((1, 0), (3, 1), (1, 2)):
        ids = torch.randint(3, 256, (batch, 7), device="cuda", generator=torch.Generator("cuda").manual_seed(seed))
        assert torch.equal(generate(model, ids, 24), generate(untuned, ids, 24)), batch
    figures = loop.figures()
    assert loop.calls == 3 and not loop.fallbacks and figures["recorded_steps"] >= 2, figures
    assert not figures["unrecorded_steps"], figures


def test_a_chat_call_through_the_fused_loop_gives_transformers_draws():
    model = fused_model()
    untuned = copy.deepcopy(model)
    loop = decode_loop.DecodeLoop(model, "fused", top_sampler=True)
    decode_loop.install(model, loop)
    settings = dict(do_sample=True, temperature=0.8, top_k=50, top_p=0.9, repetition_penalty=1.1, min_new_tokens=4,
                    max_new_tokens=24, cache_implementation="static")
    ids = torch.randint(3, 256, (2, 7), device="cuda", generator=torch.Generator("cuda").manual_seed(3))
    assert_same_draws(untuned, model, ids, settings, seeds=(0, 1))
    assert loop.calls == 2 and not loop.fallbacks


def test_tt_tweak_tries_the_fused_loop_and_serves_other_batches_without_fallback():
    model = fused_model()
    untuned = copy.deepcopy(model)
    ids = torch.randint(3, 256, (1, 8), device="cuda", generator=torch.Generator("cuda").manual_seed(5))
    result = tt.tweak(model, workload=lambda m: generate(m, ids, 32), max_depth=0, progress=False,
                      measure={"rounds_max": 8, "time_cap": 1.0},
                      strategy=tt.OneBackendStrategy(tt.backends.TorchEagerBackend()))
    tried = [row["candidate"] for row in result.loop_report]
    assert "decode loop (fused, torch)" in tried, tried
    for batch, seed in ((1, 6), (3, 7), (8, 8)):
        other = torch.randint(3, 256, (batch, 8), device="cuda", generator=torch.Generator("cuda").manual_seed(seed))
        assert torch.equal(generate(model, other, 32), generate(untuned, other, 32)), batch
    loop = decode_loop.loop_of(model)
    if result.decode_loop == "fused":  # one tuning at batch 1 serves batches 1 to 8
        assert not loop.fallbacks, loop.fallbacks
