"""generate() workloads on the CPU: tt.tweak(model, workload=...), tweak's decode loop and its
fallbacks. Every check compares greedy tokens with an untuned copy of the model. Models
are tiny decoders built from configs with random weights; nothing is downloaded."""

from __future__ import annotations

import contextlib
import copy
import logging
import pickle
import re

import pytest
import torch
from torch import nn

import torch_tweak as tt
from torch_tweak._runtime.decode import call as decode_call, choice, graph as decode_graph, loop as decode_loop
from torch_tweak._runtime.decode import model as decode_model
from torch_tweak.backends.base import Backend
from torch_tweak._core import correctness, records
from torch_tweak._core.correctness import MismatchError
from torch_tweak._runtime.workload import Workload
from torch_tweak._search import decode_check, loop_search, plan as planning

transformers = pytest.importorskip("transformers")

EAGER = tt.OneBackendStrategy(tt.backends.TorchEagerBackend())
QUICK = {"rounds_max": 6, "time_cap": 1.0}


def build(kind: str = "llama", eos: int | None = None):
    """A tiny decoder with random weights: "llama" (tied embeddings, as Llama-3.2-1B and 3B ship),
    "gpt2" (tied, as GPT-2 ships) or "llama-untied", only for the tests that need a random
    model's tokens to vary and tie: a tied one's logits favour its input token (the embedding's
    product with itself) by a wide margin, so its greedy tokens repeat and it has no near tie."""
    torch.manual_seed(0)
    if kind in ("llama", "llama-untied"):
        config = transformers.LlamaConfig(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                          num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                                          tie_word_embeddings=kind == "llama")
        model = transformers.LlamaForCausalLM(config)
    else:
        config = transformers.GPT2Config(vocab_size=256, n_embd=32, n_layer=2, n_head=2, n_positions=128,
                                         tie_word_embeddings=True)
        model = transformers.GPT2LMHeadModel(config)
    if eos is not None:
        model.generation_config.eos_token_id = eos
        model.generation_config.pad_token_id = 0
    return model.eval()


def prompt(batch: int = 1, seed: int = 0, length: int = 6) -> torch.Tensor:
    return torch.randint(3, 256, (batch, length), generator=torch.Generator().manual_seed(seed))


def generate(model, ids, cache=None, **kwargs):
    with torch.no_grad():
        return model.generate(ids, max_new_tokens=10, do_sample=False, cache_implementation=cache, **kwargs)


# ------------------------------------------------------------- the loop alone


@pytest.mark.parametrize("kind", ["llama", "gpt2", "llama-untied"])  # untied: tokens that vary (see build)
@pytest.mark.parametrize("cache", [None, "static"])
@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.slow
def test_the_loop_gives_transformers_tokens(kind, cache, batch):
    model = build(kind)
    ids = prompt(batch)
    expected = generate(model, ids, cache)
    loop = decode_loop.DecodeLoop(model, "loop")
    decode_loop.install(model, loop)
    got = generate(model, ids, cache)
    assert loop.calls == 1 and not loop.fallbacks  # the loop ran, not transformers'
    assert torch.equal(got, expected)


@pytest.mark.slow
def test_each_part_of_the_loop_keeps_the_state_its_constructor_set(monkeypatch):
    """DecodeLoop composes its parts (tests/test_layers.py checks the sources): after greedy and
    sampling calls (through the top-k sampler, widened to the CPU), dynamic and static caches and a
    teacher-forced check, neither the loop nor any part holds an attribute its constructor did
    not set, and the greedy tokens are the untuned model's."""
    monkeypatch.setattr(choice, "DEVICES", frozenset({"cuda", "cpu"}))
    model = build("llama")
    untuned = copy.deepcopy(model)
    for kind in ("loop", "compiled"):
        loop = decode_loop.DecodeLoop(model, kind, top_sampler=True)
        objects = {"loop": loop, **{name: part for name, part in vars(loop).items()
                                    if type(part).__module__.startswith("torch_tweak._runtime.decode.")}}
        assert set(objects) == {"loop", "caches", "inputs", "prefills", "choice", "stopping", "source", "steps",
                                "graph"}
        before = {name: set(vars(part)) for name, part in objects.items()}
        decode_loop.install(model, loop)
        try:
            for cache in (None, "static"):
                ids = prompt(2)
                assert torch.equal(generate(model, ids, cache), generate(untuned, ids, cache)), (kind, cache)
                kwargs = dict(max_new_tokens=4, do_sample=True, top_k=5, cache_implementation=cache)
                for subject in (model, untuned):
                    with torch.no_grad(), decode_call.same_draws(subject, (ids,), kwargs):
                        subject.generate(ids, **kwargs)
                tokens = generate(untuned, ids, cache)
                decode_check.teacher_forced(model, (ids,), dict(max_new_tokens=10, do_sample=False,
                                                                 cache_implementation=cache), tokens, processed=True)
        finally:
            decode_loop.uninstall(model)
        assert not loop.fallbacks and loop.calls == 6, loop.fallbacks
        assert {name: set(vars(part)) for name, part in objects.items()} == before


@pytest.mark.slow
def test_the_graph_loop_off_a_cuda_device_runs_its_steps_one_by_one():
    """The graph loop records a step only on CUDA with a static cache: elsewhere it serves the
    call step by step, with the untuned tokens; what a recorded step could not replay is named
    (processors reading the sequence so far), and score-only sampling is recorded."""
    model = build("llama")
    untuned = copy.deepcopy(model)
    loop = decode_loop.DecodeLoop(model, "graph")
    decode_loop.install(model, loop)
    ids = prompt(2)
    for cache in (None, "static"):
        assert torch.equal(generate(model, ids, cache), generate(untuned, ids, cache)), cache
    assert loop.calls == 2 and not loop.fallbacks and not loop.graph.graphs
    call = decode_call.greedy_call(model, (ids,), dict(max_new_tokens=4, cache_implementation="static",
                                                      repetition_penalty=1.2))
    assert loop.graph.problem(call) is None  # not recorded on a CPU: nothing to refuse
    loop.graph.records = lambda c: True  # as on a CUDA device
    why = loop.graph.problem(call)
    assert why is not None and "RepetitionPenaltyLogitsProcessor" in why, why
    sampled = decode_call.greedy_call(model, (ids,), dict(max_new_tokens=4, cache_implementation="static",
                                                         do_sample=True, temperature=0.7, top_k=5, top_p=0.9))
    assert loop.graph.problem(sampled) is None  # temperature, top-k, top-p: recorded with the draw


def test_a_step_graph_that_cannot_be_recorded_leaves_its_calls_step_by_step(monkeypatch, caplog):
    """The graph loop's step recording fails (as a capture can on a device): the call is served
    step by step with the untuned tokens, said once, and that shape is not tried again."""
    import logging

    model = build("llama")
    untuned = copy.deepcopy(model)
    loop = decode_loop.DecodeLoop(model, "graph")
    loop.graph.records = lambda c: True  # as on a CUDA device
    tries = []

    def fail(*args, **kwargs):
        tries.append(1)
        raise RuntimeError("operation not permitted when stream is capturing")

    monkeypatch.setattr(decode_graph, "StepGraph", fail)
    decode_loop.install(model, loop)
    with caplog.at_level(logging.WARNING, logger="torch_tweak"):
        for seed in range(3):
            ids = prompt(2, seed)
            assert torch.equal(generate(model, ids, "static"), generate(untuned, ids, "static")), seed
    assert len(tries) == 1 and not loop.graph.graphs and not loop.fallbacks and loop.calls == 3
    assert list(loop.graph.unrecorded.values()) == ["RuntimeError: operation not permitted when stream is capturing"]
    assert sum("could not record its decode step" in r.getMessage() for r in caplog.records) == 1
    assert "its decode step not recorded for 1 shape(s), run step by step" in str(tt.status(model))


def test_a_step_graph_recorded_on_weights_that_moved_is_recorded_again(monkeypatch):
    """A weight replaced after the graph loop recorded its step (a new Parameter, or data moved
    by model.to): the recording read the old memory, so the shape's step is recorded again on
    the new weights, and every call gives the tokens of an untuned copy with the same weights.
    On the CPU the "graph" replays the step eagerly; what is checked is that the stale
    recording is dropped (a device replay of it would read freed memory)."""
    model = build("llama")
    untuned = copy.deepcopy(model)
    loop = decode_loop.DecodeLoop(model, "graph")
    loop.graph.records = lambda c: True  # as on a CUDA device
    recorded = []

    class Eager:  # the recorded step, run eagerly in its context
        def __init__(self, fn, context):
            self.fn, self.context = fn, context

        def replay(self):
            with self.context():
                self.fn()

    def record(fn, device, warmups, context=contextlib.nullcontext):
        recorded.append(1)
        with context():
            for _ in range(warmups):
                fn()
        return Eager(fn, context), None

    monkeypatch.setattr(decode_graph, "record_graph", record)
    decode_loop.install(model, loop)
    ids = prompt(2, 0)
    for seed in range(2):
        assert torch.equal(generate(model, prompt(2, seed), "static"), generate(untuned, prompt(2, seed), "static"))
    assert len(recorded) == 1
    for m in (model, untuned):  # the same new weight in both, as a new Parameter
        with torch.no_grad():
            m.lm_head.weight = nn.Parameter(m.lm_head.weight * 1.5)
    for seed in (2, 3):
        assert torch.equal(generate(model, prompt(2, seed), "static"), generate(untuned, prompt(2, seed), "static"))
    assert len(recorded) == 2 and len(loop.graph.graphs) == 1
    model.float()  # the same tensors, moved in place: nothing to record again
    assert torch.equal(generate(model, ids, "static"), generate(untuned, ids, "static"))
    assert len(recorded) == 2


@pytest.mark.slow
def test_the_compiled_loop_keeps_a_cache_per_grad_mode_and_alternating_modes_give_the_untuned_tokens():
    """The compiled loop keeps its static cache between calls (its steps' device graphs read
    it in place). A cache first made in inference mode cannot be reset outside it: a call in
    inference mode, then one under no_grad, then inference mode again each give the untuned
    tokens, through two caches."""
    model = build("llama")
    untuned = copy.deepcopy(model)
    loop = decode_loop.DecodeLoop(model, "compiled")
    loop.eager = True  # its steps run the plain forward: the caches are what is checked here
    decode_loop.install(model, loop)
    ids = prompt(2)
    expected = generate(untuned, ids, "static")
    for mode in (torch.inference_mode, torch.no_grad, torch.inference_mode):
        with mode():
            assert torch.equal(generate(model, ids, "static"), expected), mode
    assert loop.calls == 3 and not loop.fallbacks and len(loop.caches.kept) == 2


@pytest.mark.parametrize("cache", [None, "static"])
@pytest.mark.slow
def test_the_loop_stops_and_pads_as_transformers_does(cache):
    model = build("llama")
    ids = prompt(2)
    free = generate(model, ids, cache)
    eos = int(free[0, ids.shape[1] + 3])  # a token the first sequence generates at step 3
    model.generation_config.eos_token_id = eos
    model.generation_config.pad_token_id = 0
    expected = generate(model, ids, cache)
    loop = decode_loop.DecodeLoop(model, "loop")
    decode_loop.install(model, loop)
    got = generate(model, ids, cache)
    assert loop.calls == 1 and torch.equal(got, expected)
    one = prompt(1)
    stop_early = generate(model, one, cache)  # one sequence: the output ends at its end-of-sequence
    decode_loop.uninstall(model)
    assert torch.equal(stop_early, generate(model, one, cache))


@pytest.mark.parametrize("why, kwargs", [
    ("beams", {"num_beams": 2}),
    ("a processor the loop does not run", {"suppress_tokens": [5, 6]}),
    ("a warper the loop does not run", {"do_sample": True, "typical_p": 0.9}),
    ("a stopping criterion", {"max_time": 30.0}),
    ("a logits processor", {"logits_processor": "processors"}),
    ("scores asked for", {"return_dict_in_generate": True, "output_scores": True}),
])
@pytest.mark.slow
def test_calls_the_loop_does_not_serve_run_transformers_loop(why, kwargs):
    model = build("llama")
    ids = prompt(2)
    if kwargs.get("logits_processor") == "processors":
        kwargs = dict(kwargs, logits_processor=transformers.LogitsProcessorList(
            [transformers.MinLengthLogitsProcessor(3, eos_token_id=2)]))
    torch.manual_seed(5)
    expected = model.generate(ids, max_new_tokens=6, **kwargs)
    loop = decode_loop.DecodeLoop(model, "loop")
    decode_loop.install(model, loop)
    torch.manual_seed(5)
    got = model.generate(ids, max_new_tokens=6, **kwargs)
    assert loop.calls == 0 and sum(loop.fallbacks.values()) == 1, (why, loop.fallbacks)
    assert "transformers' loop ran 1 for" in str(tt.status(model))
    if isinstance(expected, torch.Tensor):
        assert torch.equal(got, expected)
    else:
        assert torch.equal(got.sequences, expected.sequences)


def test_a_greedy_call_is_read_as_transformers_reads_it():
    model = build("llama")
    ids = prompt(1)
    call = decode_call.greedy_call(model, (ids,), {"max_new_tokens": 4, "cache_implementation": "static"})
    assert call.max_new == 4 and call.static and call.input_ids is ids
    assert decode_call.greedy_call(model, (ids,), {"max_length": 9}).max_new == 3  # max_length counts the prompt
    assert "no new token" in decode_call.greedy_call(model, (ids,), {"max_length": 6})
    assert "not a 2-D tensor" in decode_call.greedy_call(model, (ids[0],), {})
    assert "inputs given twice" in decode_call.greedy_call(model, (ids,), {"input_ids": ids})
    assert "streamer" in decode_call.greedy_call(model, (ids,), {"streamer": object()})


def test_a_loop_refuses_pickling_and_unwrap_takes_it_out():
    model = build("llama")
    decode_loop.install(model, decode_loop.DecodeLoop(model, "loop"))
    with pytest.raises(TypeError, match="tt.save"):
        pickle.dumps(model.__dict__["generate"])
    tt.unwrap(model)
    assert "generate" not in model.__dict__ and decode_loop.loop_of(model) is None


# ------------------------------------------------------------- tt.tweak(workload=)


@pytest.fixture(scope="module")
def tweaked():
    """One tiny Llama tuned for a static-cache generate() workload, and its untuned copy."""
    model = build("llama")
    untuned = copy.deepcopy(model)
    ids = prompt(2)

    def workload(m):
        return m.generate(ids, max_new_tokens=8, do_sample=False, cache_implementation="static")

    with without_fused_loop():
        result = tt.tweak(model, workload=workload, strategy=EAGER, max_depth=0, measure=QUICK, progress=False)
    return model, untuned, ids, result


@contextlib.contextmanager
def without_fused_loop():
    """choose_loop without the fused loop: these tests are of the loops of the model's own
    forward, whose decode steps the depth search records (the fused loop's are
    tests/test_fused_loop.py's; where its step reads the model, it would be tried too)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(loop_search, "fused_kernels", lambda *args, **kwargs: [])
        yield


@pytest.mark.slow
def test_a_tuned_decoder_generates_the_untuned_tokens(tweaked):
    model, untuned, ids, result = tweaked
    for batch, seed in ((2, 0), (2, 7), (1, 3)):  # the recorded prompt, another one, another batch
        other = prompt(batch, seed)
        assert torch.equal(generate(model, other, "static"), generate(untuned, other, "static"))
    assert torch.equal(generate(model, ids), generate(untuned, ids))  # a DynamicCache call too


def test_a_generate_workload_speaks_in_tokens(tweaked):
    model, untuned, ids, result = tweaked
    assert result.tokens_per_run == 2 * 8
    labels = [row.label for row in result.tokens]
    assert labels[:2] == ["untuned", "untuned + decode loop (loop)"]  # every loop measured has its row
    assert [row.status for row in result.tokens if row.kept] == ["kept"]
    assert all(row.status for row in result.tokens)  # each row not kept says why
    assert all(row.tokens_per_s is None or row.tokens_per_s > 0 for row in result.tokens)
    assert all(row.ttft_ms is not None and row.ttft_ms > 0 for row in result.tokens
               if row.kept or not row.label.startswith("untuned + "))  # a loop not kept: no TTFT taken
    text = str(result)
    assert "tokens/s" in text and "first token ms" in text and "16 new tokens per run" in text
    assert result.decode_loop in decode_loop.LOOPS + (None,)
    assert [r["candidate"] for r in result.loop_report] == ["generate", "decode loop (loop)"]  # no graphs on a CPU
    # the tied Llama is judged by the measured rule (its reference once failed on the tied weights,
    # and the exact tokens judged without a word), the multiple shown in the table's correctness lines
    assert set(result.numerics) == {"decode loop (loop)", "depth 0"}, result.numerics
    assert all(found.startswith("call 0: 1x the original's error") for found in result.numerics.values()), \
        result.numerics
    assert "  correctness, decode loop (loop): call 0: 1x the original's error" in text, text


def test_decode_steps_of_a_static_cache_share_one_signature(tweaked):
    model, untuned, ids, result = tweaked
    root = result.modules[""]
    texts = [s.text for s in root.signatures]
    assert len(texts) == 2, texts  # the prefill and every decode step: the cache matched by its structure
    assert all("StaticCache(2 layers" in t for t in texts)


class NegatedLogits(Backend):
    """Passes any check (its tolerance is huge) and turns every argmax into an argmin."""

    name = "NegatedLogits"

    def check_tolerance(self):
        return 1e9

    def build(self, module, samples, device):
        def run(*args, **kwargs):
            out = module(*args, **kwargs)
            out["logits"] = -out["logits"]
            return out
        return run


@pytest.mark.slow
def test_a_depth_whose_tokens_differ_is_rejected():
    model = build("gpt2")
    untuned = copy.deepcopy(model)
    ids = prompt(1)
    result = tt.tweak(model, workload=lambda m: m.generate(ids, max_new_tokens=5, do_sample=False), max_depth=0,
                      strategy=tt.OneBackendStrategy(NegatedLogits()), measure=QUICK, progress=False)
    row = result.rows[0]
    # the first token that differs is the first one a negated step made: the prefill, whose
    # empty cache fits no recorded signature, runs the original (no catch-all serves a call
    # its backend was never checked on)
    assert row.latency_ms is None and re.search(r"token \d+ of sequence 0 is \d+, untuned \d+", row.error), row.error
    assert result.selected_depth is None
    assert torch.equal(generate(model, ids), generate(untuned, ids))


def test_workload_arguments_are_checked():
    model = build("llama")
    before = copy.deepcopy(model.state_dict())
    with pytest.raises(TypeError, match="not both"):
        tt.tweak(model, [prompt()], workload=lambda m: None)
    with pytest.raises(TypeError, match="needs a dataset"):
        tt.tweak(model)
    with pytest.raises(TypeError, match="callable taking the model"):
        tt.tweak(model, workload=42)

    def broken(m):
        raise RuntimeError("the workload is broken")

    with pytest.raises(ValueError, match="the workload failed on the untuned model.*broken"):
        tt.tweak(model, workload=broken, progress=False)
    assert not tt.installed(model) and "generate" not in model.__dict__
    after = model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)


@pytest.fixture
def exact_tokens():
    """The bit-identical rule (tt.tweak's tolerance=0): the tests below are about which untuned
    tokens a candidate is held to, whatever logits give them."""
    with correctness.ruling(correctness.Rule(0.0)):
        yield


def test_token_check_names_the_first_difference(exact_tokens):
    model = build("llama")
    ids = prompt(1)
    job = Workload(model, lambda m: m.generate(ids, max_new_tokens=4, do_sample=False), torch.device("cpu"))
    loop_search.record(job)
    assert job.tokens == 4 and len(job.generate_calls) == 1
    loop_search.check_generate(job)  # the untuned model gives its own tokens
    job.generate_calls[0].tokens[0, -2] += 1
    with pytest.raises(MismatchError, match="token 2 of sequence 0"):
        loop_search.check_generate(job)


@pytest.mark.slow
def test_the_untuned_tokens_of_a_call_transformers_compiles_come_from_a_later_call(monkeypatch, exact_tokens):
    """transformers' first call of a compiled static path compiles its forward, and on the H200
    its tokens were not its later calls' (bench/studies/first_call_study.py). A model whose first
    generate() gives other tokens than its later ones stands for it here: for a call
    transformers compiles, the recorded untuned tokens are a later call's, which every
    candidate can give; for a call it does not compile, the recorded call's own."""
    model = build("llama")
    ids = prompt(1)
    real = type(model).generate
    made = []

    def cold_then_warm(self, *args, **kwargs):
        out = real(self, *args, **kwargs)
        made.append(out.clone())
        if len(made) == 1:  # the first call: a token no later call gives
            out = out.clone()
            out[0, -1] = (out[0, -1] + 1) % 256
        return out

    monkeypatch.setattr(type(model), "generate", cold_then_warm)
    workload = lambda m: m.generate(ids, max_new_tokens=6, do_sample=False, cache_implementation="static")  # noqa: E731
    monkeypatch.setattr(decode_model, "transformers_compiles", lambda *a: True)
    job = Workload(model, workload, torch.device("cpu"))
    loop_search.record(job)
    assert len(made) == 3  # the recorded call, then two later ones (equal: no other tokens)
    assert torch.equal(job.generate_calls[0].tokens, made[1]) and not job.generate_calls[0].others
    loop_search.check_generate(job)  # later calls give them: a candidate is held to what it can give
    monkeypatch.setattr(decode_model, "transformers_compiles", lambda *a: False)
    made.clear()
    job = Workload(model, workload, torch.device("cpu"))
    loop_search.record(job)
    assert len(made) == 1 and not torch.equal(job.generate_calls[0].tokens, made[0])  # the first call's own
    with pytest.raises(MismatchError, match="token 5 of sequence 0"):
        loop_search.check_generate(job)
    # a loaded loop's check: the untuned generate() run there is warmed first, so the loop
    # (which gives the later calls' tokens) is installed
    plan = planning.LoopPlan("loop", None, [(c.args, c.kwargs, c.tokens) for c in job.generate_calls])
    monkeypatch.setattr(decode_model, "transformers_compiles", lambda *a: True)
    made.clear()
    assert decode_check.apply_loop(model, plan) is None and decode_loop.loop_of(model) is not None
    assert len(made) == 3  # the compiling call, then the two whose tokens a loop must give
    decode_loop.uninstall(model)
    made.clear()
    monkeypatch.setattr(decode_model, "transformers_compiles", lambda *a: False)  # one run: its cold token
    assert "token 5 of sequence 0" in decode_check.apply_loop(model, plan) and decode_loop.loop_of(model) is None


@pytest.mark.slow
def test_an_untuned_model_that_does_not_repeat_its_tokens_holds_a_candidate_to_either(monkeypatch, caplog,
                                                                                    exact_tokens):
    """On the H200, Llama-1B at prompt 512 gave either of two tokens at step 91 from one untuned
    run to another (bench/results/generate.md), and every candidate failed a check against one
    run. A model whose later generate() calls alternate between two last tokens stands for it:
    the two runs after the compiling one disagree, it is said once, and a candidate giving
    either is kept; one giving a third is not. A loaded loop's check does the same."""
    model = build("llama")
    ids = prompt(1)
    real = type(model).generate
    made = []

    def alternating(self, *args, **kwargs):
        out = real(self, *args, **kwargs).clone()
        made.append(out)
        out[0, -1] = (out[0, -1] + (len(made) % 2) + (len(made) == 1)) % 256  # 1st: +2, then +0, +1, +0...
        return out

    monkeypatch.setattr(type(model), "generate", alternating)
    monkeypatch.setattr(decode_model, "transformers_compiles", lambda *a: True)
    workload = lambda m: m.generate(ids, max_new_tokens=6, do_sample=False, cache_implementation="static")  # noqa: E731
    job = Workload(model, workload, torch.device("cpu"))
    with caplog.at_level(logging.WARNING, logger="torch_tweak"):
        loop_search.record(job)
    (call,) = job.generate_calls
    assert len(made) == 3 and len(call.others) == 1 and not torch.equal(call.tokens, call.others[0])
    assert sum("does not repeat its own tokens" in r.getMessage() for r in caplog.records) == 1
    for _ in range(2):
        loop_search.check_generate(job)  # the next calls give one, then the other
    def third(self, *args, **kwargs):
        out = real(self, *args, **kwargs).clone()
        out[0, -1] = (out[0, -1] + 3) % 256
        return out

    monkeypatch.setattr(type(model), "generate", third)
    with pytest.raises(MismatchError, match="token 5 of sequence 0"):
        loop_search.check_generate(job)
    monkeypatch.setattr(type(model), "generate", alternating)
    plan = planning.LoopPlan("loop", None, [(call.args, call.kwargs, call.tokens)])
    made[:] = [None]  # the load's runs: +0 (compiling), then +1 and +0: the first kept is the one the loop does not give
    assert decode_check.apply_loop(model, plan) is None and decode_loop.loop_of(model) is not None
    decode_loop.uninstall(model)


@pytest.mark.slow
def test_when_the_compiled_loop_gives_other_tokens_no_depth_is_searched(monkeypatch, exact_tokens):
    """On the H200 (Llama-1B shape, prompt 512) the "compiled" loop, which runs transformers'
    own compiled forward, gave other tokens than the untuned calls, and every depth then failed
    the same check after minutes of builds. A model whose generate() gives one last token the
    loop's steps do not stands for it (transformers' compiled forward is its plain forward
    here, so nothing compiles): the loop fails its check, no depth is entered or built, the
    result says why, and generate() gives the untuned copy's tokens. A depth whose check is
    the eager loop's (a call transformers does not compile) is still searched."""
    model = build("llama")
    untuned = copy.deepcopy(model)
    ids = prompt(1)
    real = type(model).generate

    def shifted(self, *args, **kwargs):
        out = real(self, *args, **kwargs).clone()
        out[0, -1] = (out[0, -1] + 1) % 256
        return out

    monkeypatch.setattr(type(model), "generate", shifted)
    monkeypatch.setattr(type(model), "get_compiled_call", lambda self, config=None: self.__call__, raising=False)
    monkeypatch.setattr(decode_model, "transformers_compiles", lambda *a: True)
    built = []
    build_eager = tt.backends.TorchEagerBackend.build
    monkeypatch.setattr(tt.backends.TorchEagerBackend, "build",
                        lambda self, *a, **k: built.append(a) or build_eager(self, *a, **k))
    workload = lambda m: m.generate(ids, max_new_tokens=6, do_sample=False, cache_implementation="static")  # noqa: E731
    result = tt.tweak(model, workload=workload, strategy=EAGER, measure=QUICK, progress=False, tolerance=0)
    (loop,) = [r for r in result.loop_report if r["candidate"] == "decode loop (compiled)"]
    assert loop["state"] == "failed" and "token 5 of sequence 0" in loop["error"], loop
    assert result.decode_loop is None and result.selected_depth is None and not built
    assert result.rows and all(r.latency_ms is None and "gave other tokens (generate call 0: token 5" in r.error and "not searched" in r.error
                               for r in result.rows), [r.error for r in result.rows]
    assert result.outcome().startswith("every depth was skipped: RuntimeError: the decode loop that runs transformers' own"), \
        result.outcome()
    with torch.no_grad():
        assert torch.equal(workload(model), workload(untuned))
    # the same model, but a call transformers does not compile: the eager loop's failure says
    # nothing of the depths, which are searched (through this generate(), a depth gives its
    # tokens: built, checked and measured)
    monkeypatch.setattr(decode_model, "transformers_compiles", lambda *a: False)
    result = tt.tweak(model, workload=workload, strategy=EAGER, measure=QUICK, max_depth=0, progress=False)
    assert not result.refused and "every depth was skipped" not in result.outcome(), result.outcome()
    assert built and result.rows[0].latency_ms is not None, result.rows[0]  # built, checked and measured
    with torch.no_grad():
        assert torch.equal(workload(model), workload(untuned))


# ------------------------------------------------------------- tt.save / tt.load

TESTS = __import__("os").path.dirname(__import__("os").path.abspath(__file__))


def with_loop(kind: str = "llama"):
    """A decoder with tweak's loop behind generate(), as tt.tweak leaves one that kept it
    (the loop's checks are the workload's generate() calls and their untuned tokens)."""
    model = build(kind)
    ids = prompt(2)
    job = Workload(model, lambda m: m.generate(ids, max_new_tokens=8, do_sample=False, cache_implementation="static"),
                   torch.device("cpu"))
    loop_search.record(job)
    loop = decode_loop.DecodeLoop(model, "loop", job.layouts)
    loop.checks = [(c.args, c.kwargs, c.tokens) for c in job.generate_calls]
    decode_loop.install(model, loop)
    records.made(model).decided = True  # the depth tweak kept: none, the loop alone
    return model, ids


@pytest.mark.slow
def test_a_saved_decode_loop_gives_the_untuned_tokens_in_a_new_process(tmp_path):
    import subprocess
    import sys

    model, ids = with_loop()
    path = tmp_path / "decoder.tt"
    tt.save(model, path, strict=True)
    others = [prompt(2, 11), prompt(1, 12, length=9)]  # the measured kind (batch 2), and one not measured
    expected = [generate(build("llama"), p, "static") for p in [ids] + others]
    torch.save({"prompts": [ids] + others, "expected": expected}, tmp_path / "expected.pt")
    script = f"""
import sys, torch, torch_tweak as tt
sys.path.insert(0, {TESTS!r})
from test_generate import build, generate
model = build("llama")
tt.load(model, {str(path)!r})
data = torch.load({str(tmp_path / 'expected.pt')!r})
got = [generate(model, p, "static") for p in data["prompts"]]
assert all(torch.equal(g, e) for g, e in zip(got, data["expected"])), "tokens differ"
print(tt.status(model))
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    # installed again: it served the calls of the kind it was measured on (batch 2, static cache);
    # the batch-1 call, a kind no measurement showed faster, ran transformers' loop
    assert "decode loop (loop) served 2 calls; transformers' loop ran 1 for a call tweak did not measure" \
        in done.stdout, done.stdout


@pytest.mark.slow
def test_a_kept_loop_serves_only_the_kinds_of_call_it_was_measured_on():
    """Tuned on batch-2 static-cache calls: a batch-1 call, or one with a dynamic cache, was
    never measured (it might be slower through the loop) and runs transformers' generate()."""
    model, ids = with_loop()
    untuned = build("llama")
    loop = decode_loop.loop_of(model)
    assert torch.equal(generate(model, prompt(2, 5), "static"), generate(untuned, prompt(2, 5), "static"))
    assert loop.calls == 1 and not loop.fallbacks  # a measured kind, another prompt: the loop
    for other, cache in ((prompt(1, 3), "static"), (prompt(3, 4), "static"), (prompt(2, 6), None)):
        assert torch.equal(generate(model, other, cache), generate(untuned, other, cache))
    assert loop.calls == 1 and sum(loop.fallbacks.values()) == 3
    assert all(why.startswith("a call tweak did not measure") for why in loop.fallbacks), loop.fallbacks
    assert "batch 1 with a static cache" in str(tt.status(model))
    assert loop.kinds == {(2, True)}


@pytest.mark.slow
def test_a_loaded_loop_is_checked_against_the_untuned_generate_not_the_stored_tokens(tmp_path):

    model, ids = with_loop()
    fresh = build("llama")
    loop_plan = planning.plan_loop(model)
    loop_plan.checks[0][2][0, -1] += 1  # stored tokens are a file's word: not what the loop is compared with
    planning.apply(fresh, planning.Plan(None, [], loop_plan), device=torch.device("cpu"), strict=True)
    assert decode_loop.loop_of(fresh) is not None
    assert torch.equal(generate(fresh, ids, "static"), generate(build("llama"), ids, "static"))
    args, kwargs, tokens = decode_loop.loop_of(fresh).checks[0]  # what a new save stores: the tokens given here
    with torch.no_grad():
        assert torch.equal(tokens, build("llama").generate(*args, **kwargs))
    tt.unwrap(fresh)
    decode_loop.uninstall(fresh)
    with pytest.raises(planning.PlanError, match="decode loop"):  # a loop that gives other tokens than here
        forged = planning.LoopPlan("loop", FORGED_LAYOUTS, loop_plan.checks)
        planning.apply(fresh, planning.Plan(None, [], forged), device=torch.device("cpu"), strict=True)
    assert decode_loop.loop_of(fresh) is None


FORGED_LAYOUTS = {phase: (("input_ids", ("tensor", "torch.int64", 2)), ("past_key_value", ("cache",)),
                          ("use_cache", ("value", True)), ("return_dict", ("value", True)))
                  for phase in ("prefill", "decode")}
"""A decode loop that passes the cache under a keyword the decoder accepts and ignores: every
step sees one token and no past, so its tokens are not the untuned ones."""


@pytest.mark.slow
def test_a_forged_loop_storing_its_own_tokens_is_not_installed(tmp_path):
    """A file's loop passed the cache under an ignored keyword and stored its own tokens as the
    "untuned" ones; tt.load compared the loop with the file and installed it, changing what
    generate() returns. Now the loop is compared with transformers' generate() run here. Untied
    weights: the forged loop's tokens must differ from the untuned ones (see build)."""
    model = build("llama-untied")
    ids = prompt(2)
    loop = decode_loop.DecodeLoop(model, "loop", FORGED_LAYOUTS)
    decode_loop.install(model, loop)
    kwargs = {"max_new_tokens": 8, "do_sample": False}
    loop.checks = [((ids,), kwargs, model.generate(ids, **kwargs))]  # the forged loop's own tokens
    records.made(model).decided = True  # the depth tweak kept: none, the loop alone
    path = tmp_path / "forged.tt"
    tt.save(model, path)
    fresh = build("llama-untied")
    import warnings

    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        tt.load(fresh, path)
    with torch.no_grad():
        assert torch.equal(fresh.generate(ids, **kwargs), build("llama-untied").generate(ids, **kwargs)), \
            "tokens differ"
    assert decode_loop.loop_of(fresh) is None
    assert any("decode loop is not installed" in str(w.message) and "untuned" in str(w.message) for w in seen)


@pytest.mark.slow
def test_a_loop_check_past_its_time_bound_leaves_generate_as_it_was(monkeypatch):

    model, ids = with_loop()
    fresh = build("llama")
    monkeypatch.setattr(tt.settings, "LOOP_CHECK_SECONDS", 1e-6)
    with pytest.warns(UserWarning, match="decode loop is not installed .*took longer than"):
        planning.apply(fresh, planning.Plan(None, [], planning.plan_loop(model)), device=torch.device("cpu"),
                       strict=False)
    assert decode_loop.loop_of(fresh) is None and not tt.installed(fresh)


def test_a_saved_loop_bounds_the_calls_it_is_checked_on():
    model, ids = with_loop()
    loop = decode_loop.loop_of(model)
    args, kwargs, tokens = loop.checks[0]
    loop.checks = [(args, dict(kwargs, max_new_tokens=1000), tokens),
                   ((prompt(64, length=1100),), dict(kwargs, max_new_tokens=8), tokens)]
    (args, stored, _), = planning.plan_loop(model).checks  # the second decodes 64 x 1108 tokens: left out
    assert stored["max_new_tokens"] == tt.settings.MAX_CHECK_NEW_TOKENS


@pytest.mark.parametrize("ask", [{"max_new_tokens": 10 ** 6}, {"max_length": 10 ** 6}, {"num_beams": 2}])
@pytest.mark.slow
def test_a_file_asking_a_huge_loop_check_is_refused_quickly(tmp_path, ask):
    """A forged loop check asked for max_new_tokens=10**6 and tt.load decoded until killed: a
    file may ask at most MAX_CHECK_NEW_TOKENS, refused before anything is decoded."""
    import subprocess
    import sys

    import forgery

    model, ids = with_loop()
    path = tmp_path / "decoder.tt"
    tt.save(model, path)

    def edit(plan):
        settings = plan["generate"]["checks"][0]["call"]["tuple"][1]["dict"]
        settings.pop("max_new_tokens")
        settings.update(ask)
    forged = forgery.with_plan(tmp_path, "forged", forgery.members(path), edit)
    script = f"""
import sys, torch_tweak as tt
sys.path.insert(0, {TESTS!r})
from test_generate import build
model = build("llama")
try:
    tt.load(model, {str(forged)!r})
except tt.CheckpointError as exc:
    print("refused:", exc)
print("installed:", bool(tt.installed(model)) or "generate" in model.__dict__)
"""
    try:
        done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    except subprocess.TimeoutExpired:
        pytest.fail("tt.load of a file asking a huge loop check did not finish within 120 s")
    assert done.returncode == 0, done.stderr[-2000:]
    assert "refused:" in done.stdout and "decode loop of its plan is refused" in done.stdout, done.stdout
    assert "installed: False" in done.stdout


@pytest.mark.parametrize("edit", [
    lambda g: g.update(kind="compiled by a stranger"),
    lambda g: g.update(checks=[g["checks"][0]] * 9),
    lambda g: g.update(layouts={"prefill": [["input_ids", ["tensor", "x" * 500, 2]]], "decode": []}),
    lambda g: g.update(layouts={"prefill": [["input_ids", ["__import__('os')", 2]]], "decode": []}),
    lambda g: g["checks"][0].update(tokens={"tensor": 10**9}),
    lambda g: g.update(checks="all of them"),
])
@pytest.mark.slow
def test_a_forged_decode_loop_entry_is_refused_whole(tmp_path, edit):
    import forgery

    model, ids = with_loop()
    path = tmp_path / "decoder.tt"
    tt.save(model, path)
    fresh = build("llama")
    forged = forgery.with_plan(tmp_path, "forged", forgery.members(path), lambda plan: edit(plan["generate"]))
    with pytest.raises(tt.CheckpointError, match="decode loop|damaged"):
        tt.load(fresh, forged)
    assert decode_loop.loop_of(fresh) is None and not tt.installed(fresh)


@pytest.mark.slow
def test_eight_threads_share_a_decode_loop_and_each_gets_its_untuned_tokens():
    """Calls of different batch sizes and prompt lengths from eight threads at once: the
    static cache length rule, and the graphs and caches a loop keeps, are shared by every
    call; each thread must still get exactly the untuned tokens of its own prompt."""
    import threading

    model = build("llama")
    prompts = [prompt(1 + i % 2, seed=i, length=4 + i % 5) for i in range(8)]
    expected = [generate(model, p, "static") for p in prompts]
    loop = decode_loop.DecodeLoop(model, "loop")
    decode_loop.install(model, loop)
    wrong, errors = [], []

    def work(i: int) -> None:
        try:
            for _ in range(5):
                if not torch.equal(generate(model, prompts[i], "static"), expected[i]):
                    wrong.append(i)
        except Exception as exc:  # noqa: BLE001 - every failure is reported below
            errors.append(repr(exc))

    threads = [threading.Thread(target=work, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and not wrong, (errors[:2], wrong)
    assert loop.calls == 40 and not loop.fallbacks


# ------------------------------------------------- transformers' compiled decode steps


def test_the_tuned_loop_compiles_with_transformers_settings_plus_coordinate_descent():
    """The "tuned" loop's torch.compile arguments: transformers' compile config, its mode's
    options spelled out (torch.compile takes a mode or options, not both) and the user's
    options kept, coordinate descent tuning added; a config that does not compile with
    Inductor (the option is Inductor's) or no config at all gives none."""
    from transformers.generation.configuration_utils import CompileConfig

    got = decode_model.tuned_settings(CompileConfig())  # transformers' default: reduce-overhead
    assert "mode" not in got and got["backend"] == "inductor"
    assert got["options"] == {"triton.cudagraphs": True, "coordinate_descent_tuning": True}
    assert decode_model.tuned_settings(CompileConfig(mode="max-autotune"))["options"] == {
        "max_autotune": True, "triton.cudagraphs": True, "coordinate_descent_tuning": True}
    got = decode_model.tuned_settings(CompileConfig(mode=None, options={"epilogue_fusion": False}, fullgraph=True))
    assert got["options"] == {"epilogue_fusion": False, "coordinate_descent_tuning": True} and got["fullgraph"]
    assert decode_model.tuned_settings(CompileConfig(backend="eager")) is None
    assert decode_model.tuned_settings(None) is None and decode_model.tuned_settings({"mode": "default"}) is None


@pytest.mark.slow
def test_the_tuned_loop_is_tried_only_on_cuda_for_one_sequence():
    """tweak offers the tuned loop beside the compiled one only where it can differ: on CUDA
    (coordinate descent tuning tunes Triton kernels) and for calls of one sequence (a step's
    matrix products of one row are what it turns into bandwidth-tuned reductions)."""
    from transformers.generation.configuration_utils import CompileConfig

    from torch_tweak._search.loop_search import tuned_applies

    model = build("llama")

    def workload_of(batch, **kwargs):
        job = Workload(model, lambda m: m.generate(prompt(batch), max_new_tokens=4, do_sample=False,
                                                   cache_implementation="static", **kwargs),
                       torch.device("cpu"))
        loop_search.record(job)
        return job

    one, two = workload_of(1), workload_of(2)
    assert tuned_applies(model, torch.device("cuda"), one)
    assert not tuned_applies(model, torch.device("cpu"), one)
    assert not tuned_applies(model, torch.device("cuda"), two)
    model.generation_config.compile_config = CompileConfig(backend="eager")
    assert not tuned_applies(model, torch.device("cuda"), workload_of(1))


@pytest.mark.slow
def test_the_tuned_loop_gives_the_untuned_compiled_tokens_and_builds_once(monkeypatch):
    """The tuned loop on a call transformers compiles (on a CPU through the compile config's
    _compile_all_devices: Inductor's C++ kernels, which coordinate descent tuning leaves as
    they are, so the tokens must be transformers' compiled ones): its forward is built once
    with tuned_settings, serves later calls without compiling again, and a call whose compile
    config is not Inductor's runs transformers' own generate(), counted."""
    import torch._dynamo.utils as dynamo_utils
    from transformers.generation.configuration_utils import CompileConfig

    model = build("llama")
    config = CompileConfig(mode="default")
    config._compile_all_devices = True
    model.generation_config.compile_config = config
    untuned = copy.deepcopy(model)
    builds = []
    real_compile = torch.compile

    def spying(fn, **kwargs):
        builds.append(kwargs)
        return real_compile(fn, **kwargs)

    monkeypatch.setattr(torch, "compile", spying)
    loop = decode_loop.DecodeLoop(model, "tuned")
    decode_loop.install(model, loop)
    ids = prompt(1)
    with torch.no_grad():
        got = model.generate(ids, max_new_tokens=12, do_sample=False, cache_implementation="static")
        graphs = dynamo_utils.counters["stats"]["unique_graphs"]
        again = model.generate(prompt(1, seed=1), max_new_tokens=12, do_sample=False, cache_implementation="static")
        assert dynamo_utils.counters["stats"]["unique_graphs"] == graphs  # the same build serves it
    tuned_builds = [b for b in builds if b.get("options", {}).get("coordinate_descent_tuning")]
    assert len(tuned_builds) == 1 and "mode" not in tuned_builds[0], builds
    with torch.no_grad():
        assert torch.equal(got, untuned.generate(ids, max_new_tokens=12, do_sample=False,
                                                 cache_implementation="static"))
        assert torch.equal(again, untuned.generate(prompt(1, seed=1), max_new_tokens=12, do_sample=False,
                                                   cache_implementation="static"))
    assert loop.calls == 2 and not loop.fallbacks
    other = CompileConfig(backend="eager")
    other._compile_all_devices = True
    with torch.no_grad():
        theirs = model.generate(ids, max_new_tokens=12, do_sample=False, cache_implementation="static",
                                compile_config=other)
        assert torch.equal(theirs, untuned.generate(ids, max_new_tokens=12, do_sample=False,
                                                    cache_implementation="static", compile_config=other))
    assert loop.calls == 2 and sum(loop.fallbacks.values()) == 1
    assert "not Inductor" in next(iter(loop.fallbacks))


@pytest.mark.slow
def test_a_call_transformers_compiles_keeps_the_compiled_loop_and_its_tokens(tmp_path, fake_clock):
    """A static-cache call that transformers compiles (here on a CPU, through its compile
    config's _compile_all_devices): the untuned tokens are those of its compiled forward;
    tweak's "compiled" loop runs that same forward, so the tokens match, nothing compiles
    twice, and no module is tuned under it. One Inductor build per model, shared by the
    checks below (they are slow on a CPU)."""
    import torch._dynamo.utils as dynamo_utils
    from transformers.generation.configuration_utils import CompileConfig

    def compiling(model):
        config = CompileConfig(mode="default")
        config._compile_all_devices = True
        model.generation_config.compile_config = config
        return model

    model = compiling(build("llama"))
    untuned = copy.deepcopy(model)
    ids = prompt(2)

    def workload(m):
        # the verdict is the fake clock's: a run through transformers' loop costs 3 ms, through
        # tweak's 1 ms (the machine's speed or load never turns it)
        fake_clock.advance(3_000_000 if decode_loop.loop_of(m) is None else 1_000_000)
        return m.generate(ids, max_new_tokens=32, do_sample=False, cache_implementation="static")

    with without_fused_loop():
        result = tt.tweak(model, workload=workload, measure={"rounds_max": 16, "time_cap": 3.0}, progress=False)
    assert result.decode_loop == "compiled", str(result)
    assert [r["candidate"] for r in result.loop_report] == ["generate", "decode loop (compiled)"]
    assert all(row.latency_ms is None and "transformers' compiled forward" in row.error for row in result.rows)
    assert "generate() runs tweak's decode loop (compiled)" in result.outcome()
    table = str(result)  # the depth table's last line says what is kept, not "it stays untuned"
    assert "it stays untuned" not in table and "its modules stay untuned; generate() runs" in table, table
    graphs = dynamo_utils.counters["stats"]["unique_graphs"]
    with torch.no_grad():
        assert torch.equal(workload(model), workload(untuned))  # untuned: transformers' loop, compiled steps
    assert dynamo_utils.counters["stats"]["unique_graphs"] == graphs  # the loop's calls fit what was compiled
    # an end-of-sequence the first sequence reaches after the first read of the stopping rule
    free = workload(untuned)
    eos = int(free[0, ids.shape[1] + 17])
    with torch.no_grad():
        stop = dict(max_new_tokens=32, do_sample=False, cache_implementation="static", eos_token_id=eos,
                    pad_token_id=0)
        assert torch.equal(model.generate(ids, **stop), untuned.generate(ids, **stop))
    assert dynamo_utils.counters["stats"]["unique_graphs"] == graphs
    # the same call told not to compile: transformers runs eager steps, and so does the loop
    with torch.no_grad():
        eager = dict(max_new_tokens=32, do_sample=False, cache_implementation="static", disable_compile=True)
        assert torch.equal(model.generate(ids, **eager), untuned.generate(ids, **eager))
    assert dynamo_utils.counters["stats"]["unique_graphs"] == graphs
    # saved, then loaded in a new process: the loop is checked and installed again there, and
    # the forward it calls is that process's own compile of transformers' forward
    import subprocess
    import sys

    path = tmp_path / "decoder.tt"
    tt.save(model, path, strict=True)
    torch.save({"ids": ids, "expected": free}, tmp_path / "expected.pt")
    script = f"""
import sys, torch, torch_tweak as tt
sys.path.insert(0, {TESTS!r})
from transformers.generation.configuration_utils import CompileConfig
from test_generate import build
model = build("llama")
config = CompileConfig(mode="default")
config._compile_all_devices = True
model.generation_config.compile_config = config
tt.load(model, {str(path)!r})
data = torch.load({str(tmp_path / 'expected.pt')!r})
with torch.no_grad():
    got = model.generate(data["ids"], max_new_tokens=32, do_sample=False, cache_implementation="static")
assert torch.equal(got, data["expected"]), "tokens differ"
print(tt.status(model))
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "decode loop (compiled) served 1 call" in done.stdout, done.stdout  # the load checked it, then it served ours


# ------------------------------------------------------------- the measured rule for decode loops


def _biased(model, token: int, by: float):
    """A candidate: the model with `by` added to one token's logit at every step."""
    def hook(module, args, out):
        out = out.clone()
        out[..., token] += by
        return out
    return model.lm_head.register_forward_hook(hook)


@pytest.mark.slow
def test_tokens_may_part_only_at_a_near_tie_and_every_step_is_judged_teacher_forced():
    """bfloat16 Llama with random weights: the untuned call's own logits are within about 0.002
    of a float32 run, and two tokens are closer than that at a few steps. A candidate that
    nudges one token's logit by 0.002 turns such a near tie (kept, with the step and margin
    said), one that adds 1.0 to a token turns a step whose margin is wide (refused, naming the
    step and the margin); both against the untuned call, teacher-forced and free-running. Untied
    weights: a tied random model has no near tie (see build); tied ones are test_tied.py's."""
    model = build("llama-untied").bfloat16()
    ids = prompt(2, length=8)
    job = Workload(model, lambda m: m.generate(ids, max_new_tokens=12, do_sample=False), torch.device("cpu"))
    loop_search.record(job)
    (call,) = job.generate_calls
    reference = call.reference
    assert reference.measured and len(reference.high) == 12
    assert loop_search.check_generate(job).startswith("call 0: 1x the original's error, the untuned tokens")
    # the nearest tie of the call: the step and sequence whose two best tokens are closest
    margins = [(float(h.topk(2).values[r, 0] - h.topk(2).values[r, 1]), s, r)
               for s, h in enumerate(reference.high) for r in range(2)]
    margin, step, row = min(margins)
    window = 2 * tt.settings.MULTIPLIER * float(reference.spread[step][row])
    assert margin < window / 2  # the model has a near tie to turn
    second = int(reference.high[step][row].topk(2).indices[1])
    handle = _biased(model, second, 1.5 * margin)
    try:
        with torch.no_grad():
            got = model.generate(ids, max_new_tokens=12, do_sample=False)
        if not torch.equal(got, call.tokens):  # the near tie turned: kept, said with its margin
            found = loop_search.check_generate(job)
            assert f"token {step} of sequence {row}" in found and "a near tie" in found, found
    finally:
        handle.remove()
    worst = int(reference.high[0][0].argmin())
    handle = _biased(model, worst, 1000.0)
    try:
        with pytest.raises(MismatchError, match=r"generate call 0: token 0 of sequence 0 is \d+, untuned \d+: "
                                                r"their margin .* is [\d.]+, not a near tie"):
            loop_search.check_generate(job)
    finally:
        handle.remove()
    spread = min(float((h.max(-1).values - h[:, worst]).min()) for h in reference.high)
    handle = _biased(model, worst, spread / 3)  # no token turns, but every step's logits are wrong
    try:
        with torch.no_grad():
            assert torch.equal(model.generate(ids, max_new_tokens=12, do_sample=False), call.tokens)
        # named by its row (the one wrong logit, the row's largest error) or by the columns holding it
        with pytest.raises(MismatchError, match=r"generate call 0 step 0 logits: (row \(\d\)|columns? [\d-]+ of "
                                                r"the last axis): .*x the original's error"):
            loop_search.check_generate(job)
    finally:
        handle.remove()
    assert loop_search.check_generate(job).startswith("call 0: 1x")  # as it was


def test_without_a_reference_the_tokens_must_be_the_untuned_ones():
    model = build("llama")
    ids = prompt(1)
    with correctness.ruling(correctness.Rule(0.0)):
        job = Workload(model, lambda m: m.generate(ids, max_new_tokens=4, do_sample=False), torch.device("cpu"))
        loop_search.record(job)
    (call,) = job.generate_calls
    assert not call.reference.measured and "bit-identical" in call.reference.why
    assert loop_search.check_generate(job) == "call 0: exact tokens: the bit-identical rule was asked for"
