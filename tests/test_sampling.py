"""The decode loop's sampler for temperature, top-k and top-p (sampling.TopSampler), against
transformers' own processors: the same processed scores from the top scores alone, and, through
the loop, transformers' tokens under the same seed. It serves CUDA only, where the sort of the
vocabulary keeps ties in index order; here the CPU's sort is made stable for the reference
(what CUDA's gives), and the sampler widened to the CPU, to check its arithmetic."""

from __future__ import annotations

import pytest
import torch

import torch_tweak as tt
from torch_tweak._runtime.decode import choice as sampling, loop as decode_loop

transformers = pytest.importorskip("transformers")


@pytest.fixture
def as_on_cuda(monkeypatch):
    """torch.sort keeps ties in index order (CUDA's sort of a row this long does) and the
    sampler serves the CPU."""
    sort = torch.sort

    def stable(*args, **kwargs):
        kwargs.setdefault("stable", True)
        return sort(*args, **kwargs)

    monkeypatch.setattr(torch, "sort", stable)
    monkeypatch.setattr(sampling, "DEVICES", frozenset({"cuda", "cpu"}))


def processors(temperature, top_k, top_p=None, keep=1):
    T = transformers
    chain = [T.TemperatureLogitsWarper(temperature)] if temperature is not None else []
    chain.append(T.TopKLogitsWarper(top_k))
    if top_p is not None:
        chain.append(T.TopPLogitsWarper(top_p, min_tokens_to_keep=keep))
    return T.LogitsProcessorList(chain)


SETTINGS = [(0.7, 50, 0.9, 1), (None, 50, None, 1), (1.3, 7, 0.5, 1), (0.7, 200, 0.95, 1), (0.7, 1, 0.9, 1),
            (1.0, 40, 0.3, 5)]


@pytest.mark.parametrize("temperature, top_k, top_p, keep", SETTINGS)
def test_the_processed_scores_are_transformers_on_tied_scores(as_on_cuda, temperature, top_k, top_p, keep):
    """Scores of bf16 logits (many equal values: ties at the k-th and across the top-p cut),
    at three spreads: the sampler's processed scores equal the processors' exactly, -inf
    included, and nothing overflows."""
    cpu = torch.device("cpu")
    ties = 0
    for seed in range(60):
        g = torch.Generator().manual_seed(seed)
        scores = (torch.randn(3, 3000, generator=g) * (0.5, 2.0, 8.0)[seed % 3]).bfloat16().float()
        chain = processors(temperature, top_k, top_p, keep)
        sampler = sampling.TopSampler.of(chain, True, cpu)
        assert sampler is not None
        expected = chain(None, scores.clone())
        got = sampler.process(scores.clone())
        assert torch.equal(got, expected), (seed, (got != expected).sum())
        assert not sampler.overflowed()
        kth = torch.topk(scores, min(top_k, 3000)).values[:, -1:]
        ties += int(((scores == kth).sum(-1) > 1).sum())
    assert ties > 0  # the k-th score was tied in some rows: the case a plain top-k of k would get wrong


def test_ties_past_the_margin_and_nan_are_flagged(as_on_cuda):
    cpu = torch.device("cpu")
    sampler = sampling.TopSampler.of(processors(0.7, 50, 0.9), True, cpu)
    sampler.process(torch.randn(2, 3000))
    assert not sampler.overflowed()
    sampler.process(torch.zeros(2, 3000))  # every score ties with the k-th
    assert sampler.overflowed()
    other = sampling.TopSampler.of(processors(0.7, 50, 0.9), True, cpu)
    scores = torch.randn(2, 3000)
    scores[1, 17] = float("nan")
    other.process(scores)
    assert other.overflowed()


def test_it_serves_only_the_chains_it_reproduces():
    T = transformers
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert sampling.TopSampler.of(processors(0.7, 50, 0.9), True, cuda) is not None
    assert sampling.TopSampler.of(processors(0.7, 50, 0.9), True, cpu) is None  # the CPU's sort: ties unordered
    assert sampling.TopSampler.of(processors(0.7, 50, 0.9), False, cuda) is None  # greedy
    assert sampling.TopSampler.of(None, True, cuda) is None
    others = [
        [T.TemperatureLogitsWarper(0.7), T.TopPLogitsWarper(0.9)],  # top-p without top-k: the whole row is sorted
        [T.TopPLogitsWarper(0.9), T.TopKLogitsWarper(50)],  # another order
        [T.RepetitionPenaltyLogitsProcessor(1.3), T.TopKLogitsWarper(50)],
        [T.TopKLogitsWarper(50), T.MinPLogitsWarper(0.05)],
        [T.TopKLogitsWarper(50, filter_value=-1e4)],
    ]
    for chain in others:
        assert sampling.TopSampler.of(T.LogitsProcessorList(chain), True, cuda) is None, chain


def tiny_llama(zero_head: bool = False):
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=500, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                                      tie_word_embeddings=True)  # as Llama-3.2-1B and 3B ship
    model = transformers.LlamaForCausalLM(config).eval()
    if zero_head:  # every logit 0: every score ties with the k-th
        with torch.no_grad():
            model.lm_head.weight.zero_()
    return model


def loop_and_transformers(model, cache, **kwargs):
    """transformers' tokens and the step-by-step loop's, each after torch.manual_seed(3), and
    the loop and how many steps the sampler processed."""
    ids = torch.randint(3, 500, (2, 5), generator=torch.Generator().manual_seed(1))
    kwargs = dict(max_new_tokens=12, do_sample=True, cache_implementation=cache, **kwargs)
    torch.manual_seed(3)
    with torch.no_grad():
        expected = model.generate(ids, **kwargs)
    served = []
    process = sampling.TopSampler.process

    def counted(self, scores):
        served.append(scores.shape)
        return process(self, scores)

    loop = decode_loop.DecodeLoop(model, "loop", top_sampler=True)
    decode_loop.install(model, loop)
    try:
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(sampling.TopSampler, "process", counted)
            torch.manual_seed(3)
            with torch.no_grad():
                got = model.generate(ids, **kwargs)
    finally:
        decode_loop.uninstall(model)
    return expected, got, loop, len(served)


QUICK = {"warmup_min": 1, "warmup_max": 2, "rounds_min": 3, "rounds_max": 4, "time_cap": 0.5}


def sampling_workload(max_new=8, **settings):
    ids = torch.randint(3, 500, (2, 5), generator=torch.Generator().manual_seed(1))
    settings = {"temperature": 0.7, "top_k": 50, "top_p": 0.9, **settings}
    return lambda m: m.generate(ids, max_new_tokens=max_new, do_sample=True, cache_implementation="static", **settings)


def tweaked(model, workload):
    """tt.tweak on the workload (depth 0, a short measurement); its loop report by candidate."""
    import torch_tweak as tt

    from torch_tweak._search import loop_search

    # the loops of the model's own forward and their sampler: the fused loop's sampling is
    # tests/test_fused_loop.py's (it would be tried here too, where its step reads the model)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(loop_search, "fused_kernels", lambda *args, **kwargs: [])
        result = tt.tweak(model, workload=workload, max_depth=0, progress=False, measure=QUICK)
    return result, {r["candidate"]: r for r in result.loop_report}


def assert_untuned_draws(model, untuned, workload, seed):
    """After the same torch.manual_seed, the tuned model's call gives the untuned one's tokens."""
    outs = []
    for subject in (model, untuned):
        torch.manual_seed(seed)
        with torch.no_grad():
            outs.append(workload(subject))
    assert torch.equal(outs[0], outs[1]), (seed, outs)


@pytest.mark.parametrize("cache", ["static", None])
@pytest.mark.parametrize("settings", [dict(temperature=0.7, top_k=50, top_p=0.9), dict(top_k=20),
                                      dict(temperature=1.5, top_k=100, top_p=0.5)])
@pytest.mark.slow
def test_the_loop_draws_transformers_tokens_through_the_sampler(as_on_cuda, cache, settings):
    expected, got, loop, served = loop_and_transformers(tiny_llama(), cache, **settings)
    assert loop.calls == 1 and not loop.fallbacks and loop.resampled == 0
    assert served == 12  # every new token's scores came from the sampler
    assert torch.equal(got, expected), (got, expected)


@pytest.mark.slow
@pytest.mark.parametrize("cache", ["static", None])
def test_a_call_the_sampler_cannot_serve_is_made_again_with_transformers_processors(as_on_cuda, cache):
    """Every logit equal: top-k keeps the whole vocabulary, more ties than the margin. The
    call is made again from the same generator state with transformers' processors, and its
    tokens are transformers'."""
    expected, got, loop, served = loop_and_transformers(tiny_llama(zero_head=True), cache, temperature=0.7,
                                                        top_k=50, top_p=0.9)
    assert loop.calls == 1 and loop.resampled == 1 and not loop.fallbacks
    assert served == 12  # the first run went through the sampler; the second did not
    assert torch.equal(got, expected), (got, expected)


@pytest.mark.slow
def test_tweak_measures_the_loop_with_and_without_the_sampler_and_a_saved_choice_loads(as_on_cuda, tmp_path,
                                                                                      fake_clock):
    """A sampling workload the sampler serves: tt.tweak measures the loop both ways (which is
    faster depends on whether a step waits for the device or the host), keeps a loop whose
    draws are the untuned ones, and tt.save / tt.load keep whether it samples with it. The
    verdict is the fake clock's (a run costs 3 ms through transformers' loop, 1 ms through
    tweak's), never the machine's speed: a busy machine cannot turn it."""
    import copy
    import warnings

    import torch_tweak as tt

    model = tiny_llama()
    untuned = copy.deepcopy(model)
    sampled = sampling_workload()

    def workload(m):
        fake_clock.advance(3_000_000 if decode_loop.loop_of(m) is None else 1_000_000)
        return sampled(m)

    built = []
    init = decode_loop.DecodeLoop.__init__

    def counted(self, *args, **kwargs):
        built.append(args[1] if len(args) > 1 else kwargs.get("kind"))
        init(self, *args, **kwargs)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(decode_loop.DecodeLoop, "__init__", counted)
        result, report = tweaked(model, workload)
    assert list(report) == ["generate", "decode loop (loop)", "decode loop (loop, top-k sampler)"], list(report)
    # both options are one loop, its sampler switched per run: one set of static caches
    assert built.count("loop") == 1, built
    assert all(r["state"] != "failed" for r in report.values()), report
    loop = decode_loop.loop_of(model)
    assert loop is not None and result.decode_loop == "loop"
    for seed in (0, 1):
        assert_untuned_draws(model, untuned, workload, seed)
    for top in (loop.top_sampler, not loop.top_sampler):  # what tuning kept, then the other way
        loop.top_sampler = top
        path = tmp_path / f"top-{top}.tt"
        with warnings.catch_warnings():  # a depth kept at the root: its calls hold the live cache, not stored
            warnings.simplefilter("ignore")
            tt.save(model, path, strict=False)
        fresh = tiny_llama()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            tt.load(fresh, path)
        loaded = decode_loop.loop_of(fresh)
        assert loaded is not None and loaded.top_sampler is top, (top, loaded)
        assert_untuned_draws(fresh, untuned, workload, 2)
    # a file whose loop says anything but true or false is refused whole, the model untouched
    import forgery

    def forged(plan):
        plan["generate"]["top_sampler"] = "yes"

    bad = forgery.with_plan(tmp_path, "forged", forgery.members(path), forged)
    fresh = tiny_llama()
    before = forgery.state_of(fresh)
    with pytest.raises(tt.CheckpointError, match=r"decode loop of its plan is refused \(its top_sampler is true or false\)"):
        tt.load(fresh, bad)
    assert decode_loop.loop_of(fresh) is None and forgery.unchanged(fresh, before)


@pytest.mark.slow
def test_a_workload_the_sampler_cannot_serve_still_passes_the_distribution_check(as_on_cuda):
    """Every logit equal: every call through the sampler is made again with transformers'
    processors. The check of the loop's distributions at tuning compares the second run's
    (the first run's are dropped), so the sampler's candidate is not refused for it, and the
    tuned model draws the untuned tokens."""
    import copy

    import torch_tweak as tt

    model = tiny_llama(zero_head=True)
    untuned = copy.deepcopy(model)
    workload = sampling_workload(max_new=6)
    _, report = tweaked(model, workload)
    assert report["decode loop (loop, top-k sampler)"]["state"] != "failed", report
    loop = decode_loop.loop_of(model)
    if loop is None:  # a busy machine measured transformers' loop as fast: the loop, as tt.load would install it
        loop = decode_loop.DecodeLoop(model, "loop")
        decode_loop.install(model, loop)
    loop.top_sampler = True  # whichever was kept: tt.status says so, and counts the calls made again
    made_again = loop.resampled
    assert_untuned_draws(model, untuned, workload, 5)
    assert loop.resampled == made_again + 1
    status = str(tt.status(model))
    assert "decode loop (loop, top-k sampler) served" in status and \
        f"{made_again + 1} made again with transformers' processors" in status, status


@pytest.mark.slow
def test_a_sampler_that_crashes_at_tuning_is_refused_and_the_untuned_draws_stay(as_on_cuda, monkeypatch):
    """The sampler raising in every step: its candidate fails at tuning with the error, the
    loop without it is measured, and the tuned model draws the untuned tokens."""
    import copy

    def broken(self, scores):
        raise RuntimeError("the sampler broke")

    monkeypatch.setattr(sampling.TopSampler, "process", broken)
    model = tiny_llama()
    untuned = copy.deepcopy(model)
    workload = sampling_workload()
    _, report = tweaked(model, workload)
    failed = report["decode loop (loop, top-k sampler)"]
    assert failed["state"] == "failed" and "the sampler broke" in failed["error"], failed
    assert report["decode loop (loop)"]["state"] != "failed", report
    loop = decode_loop.loop_of(model)
    assert loop is None or not loop.top_sampler
    assert_untuned_draws(model, untuned, workload, 4)


@pytest.mark.slow
def test_eight_threads_sample_through_one_loop_with_the_sampler(as_on_cuda):
    """Eight threads share one loop with the sampler. Top-k 1 leaves one token to draw, so a
    call's tokens do not depend on the shared generator: each must be the untuned call's for
    its own prompt, whatever the other threads do."""
    import copy

    import support

    model = tiny_llama()
    untuned = copy.deepcopy(model)
    prompts = [torch.randint(3, 500, (1 + i % 3, 4 + i % 4), generator=torch.Generator().manual_seed(i))
               for i in range(16)]
    settings = dict(max_new_tokens=6, do_sample=True, temperature=0.7, top_k=1, top_p=0.9,
                    cache_implementation="static")
    with torch.no_grad():
        expected = [untuned.generate(p, **settings) for p in prompts]
    loop = decode_loop.DecodeLoop(model, "loop", top_sampler=True)
    decode_loop.install(model, loop)
    try:
        def check(i):
            got = model.generate(prompts[i], **settings)
            assert torch.equal(got, expected[i]), i

        support.in_threads(len(prompts), check)
    finally:
        decode_loop.uninstall(model)
    assert loop.calls == len(prompts) and not loop.fallbacks and loop.resampled == 0


@pytest.mark.slow
def test_recorded_draws_are_kept_per_shape_and_setting_and_each_call_starts_unflagged(as_on_cuda, monkeypatch):
    """The loop keeps one recorded draw per batch size and sampler setting (at most
    RECORDED_DRAWS, the oldest dropped) and reuses it across calls: every call's seeded tokens
    are still transformers', a call that overflowed does not make the next call of the same
    draw run again, and a call in inference mode gets a draw of its own (its buffers could not
    be written outside it)."""
    import copy

    monkeypatch.setattr(tt.settings, "RECORDED_DRAWS", 3)
    model = tiny_llama()
    untuned = copy.deepcopy(model)
    loop = decode_loop.DecodeLoop(model, "loop", top_sampler=True)
    decode_loop.install(model, loop)
    prompt = {b: torch.randint(3, 500, (b, 5), generator=torch.Generator().manual_seed(b)) for b in (1, 2)}
    calls = [(1, 50), (2, 50), (1, 50), (2, 20), (1, 7), (1, 50), (2, 50)]
    try:
        for i, (batch, top_k) in enumerate(calls):
            settings = dict(max_new_tokens=6, do_sample=True, temperature=0.7, top_k=top_k, top_p=0.9,
                            cache_implementation="static")
            outs = []
            for subject in (model, untuned):
                torch.manual_seed(i)
                with torch.no_grad():
                    outs.append(subject.generate(prompt[batch], **settings))
            assert torch.equal(outs[0], outs[1]), (i, outs)
            assert len(loop.choice.draws) <= 3
        keys = [(k[0], k[5]) for k in loop.choice.draws]
        assert keys == [(1, 7), (1, 50), (2, 50)], keys  # each use makes a draw the newest
        assert loop.resampled == 0 and not loop.fallbacks
        # an overflowing call, then a plain one through the same draw: only the first is made again
        draw = loop.choice.draws[next(k for k in loop.choice.draws if k[0] == 2 and k[5] == 50)]
        before = draw.replays
        draw.sampler.flag |= True  # as if a step of an earlier call had overflowed
        torch.manual_seed(9)
        with torch.no_grad():
            got = model.generate(prompt[2], **settings)
        torch.manual_seed(9)
        with torch.no_grad():
            assert torch.equal(got, untuned.generate(prompt[2], **settings))
        assert loop.resampled == 0 and draw.replays == before + 6
        # a draw first made in inference mode, then the same setting outside it
        settings["top_k"] = 33
        for seed, mode in ((10, torch.inference_mode), (11, torch.no_grad)):
            torch.manual_seed(seed)
            with mode():
                got = model.generate(prompt[2], **settings)
            torch.manual_seed(seed)
            with torch.no_grad():
                assert torch.equal(got, untuned.generate(prompt[2], **settings)), seed
        assert sorted(k[3] for k in loop.choice.draws if k[5] == 33) == [False, True]
    finally:
        decode_loop.uninstall(model)


@pytest.mark.slow
@pytest.mark.parametrize("temperature, top_k, top_p, keep", SETTINGS[:4])
def test_the_sampler_draws_torch_multinomials_token_from_the_candidates_alone(as_on_cuda, temperature, top_k,
                                                                              top_p, keep):
    """TopSampler.draw takes torch.multinomial's exponential variates and divisions but the
    argmax over the top scores alone: under the same seed its tokens are torch.multinomial's on
    the processed scores' softmax, on tie-heavy bf16 scores (equal probabilities among the
    kept), and the generator ends where torch.multinomial leaves it."""
    cpu = torch.device("cpu")
    assert sampling.exact_draws(cpu)
    for seed in range(40):
        g = torch.Generator().manual_seed(seed)
        scores = (torch.randn(3, 3000, generator=g) * (0.5, 2.0, 8.0)[seed % 3]).bfloat16().float()
        sampler = sampling.TopSampler.of(processors(temperature, top_k, top_p, keep), True, cpu)
        probs = torch.nn.functional.softmax(sampler.process(scores.clone()), dim=-1)
        torch.manual_seed(seed)
        expected = torch.multinomial(probs, num_samples=1).squeeze(1)
        after = torch.rand(1)
        torch.manual_seed(seed)
        got = sampler.draw(scores.clone())
        assert torch.equal(got, expected), (seed, got, expected)
        assert torch.equal(torch.rand(1), after)


@pytest.mark.slow
def test_where_the_candidates_draw_is_not_torchs_the_sampler_draws_with_torch_multinomial(as_on_cuda, monkeypatch):
    """exact_draws false (a torch whose multinomial draws another way): TopSampler.draw calls
    torch.multinomial itself, and the loop's seeded tokens stay transformers'."""
    monkeypatch.setitem(sampling._EXACT, "cpu", False)
    called = []
    multinomial = torch.multinomial
    monkeypatch.setattr(torch, "multinomial", lambda *a, **k: called.append(1) or multinomial(*a, **k))
    expected, got, loop, served = loop_and_transformers(tiny_llama(), "static", temperature=0.7, top_k=50, top_p=0.9)
    assert served == 12 and len(called) >= 2 * 12 and torch.equal(got, expected)


def test_a_draw_that_cannot_be_recorded_is_served_eagerly_and_not_tried_again(as_on_cuda, monkeypatch, caplog):
    """Recording the choice failing (a capture error, memory): the call's seeded tokens are
    still transformers', chosen kernel by kernel through the sampler, with one warning; later
    calls of that shape do not try to record again."""
    import copy
    import logging

    tries = []

    def broken(self, device):
        tries.append(device)
        raise RuntimeError("capture failed")

    monkeypatch.setattr(sampling.RecordedDraw, "RECORDS", frozenset({"cuda", "cpu"}))
    monkeypatch.setattr(sampling.RecordedDraw, "_record", broken)
    model = tiny_llama()
    untuned = copy.deepcopy(model)
    loop = decode_loop.DecodeLoop(model, "loop", top_sampler=True)
    decode_loop.install(model, loop)
    workload = sampling_workload()
    try:
        with caplog.at_level(logging.WARNING, logger="torch_tweak"):
            for seed in (0, 1, 2):
                assert_untuned_draws(model, untuned, workload, seed)
    finally:
        decode_loop.uninstall(model)
    assert len(tries) == 1 and loop.calls == 3 and loop.resampled == 0 and not loop.fallbacks
    assert list(loop.choice.unrecorded.values()) == ["RuntimeError: capture failed"] and not loop.choice.draws
    warned = [r for r in caplog.records if "could not record its sampler's choice" in r.getMessage()]
    assert len(warned) == 1 and "capture failed" in warned[0].getMessage()
    import torch_tweak as tt

    decode_loop.install(model, loop)
    try:
        status = str(tt.status(model))
    finally:
        decode_loop.uninstall(model)
    assert "its choice of a token not recorded for 1 shape(s), chosen kernel by kernel (RuntimeError: capture failed)" \
        in status, \
        status
    assert "recorded as a device graph" not in status, status  # on the CPU nothing is ever recorded
