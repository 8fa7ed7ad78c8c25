"""tweak's own decode step (fused_step.py) on tiny decoders of the families it reads, each built with
the tie flag its released checkpoints use (Llama-3.2, Qwen2.5 and Qwen3 small models tie their
embeddings; Mistral does not; one untied Llama too), random norms and biases (a unit norm or a
zero bias would hide a wrong one), fp32 (float64 reference):

- the model is read as it is: nothing copied, nothing changed, and what it does not serve is
  refused with the reason;
- teacher-forced along the untuned greedy tokens, the step's logits keep the measured rule
  against a float64 run of the whole sequence, with the torch ops and with the Triton kernels
  (under Triton's interpreter on the CPU);
- greedy tokens through the step are the untuned model's generate() tokens at batches 1, 2,
  3, 4 and 8 (buckets 1, 2, 4, 4, 8), from one reading of the model;
- a deliberately broken step (k and v swapped in the fused weight, the rotary position shifted
  by one) is refused by the rule, with the step and its error as a multiple of the untuned one.
"""

from __future__ import annotations

import re

import pytest
import torch

from torch_tweak._core import settings
from torch_tweak._core.correctness import MismatchError
from torch_tweak._core.model_state import snapshot
from torch_tweak._runtime.decode import fused_triton, model as decode_model
from torch_tweak._search import decode_check, fused_check
from torch_tweak._runtime.decode.fused_kernels import Product
from torch_tweak._runtime.decode.fused_step import FusedDecoder, bucket

transformers = pytest.importorskip("transformers")

VOCAB = 256
COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, max_position_embeddings=256, initializer_range=0.3)
"""initializer_range 0.3: at the default 0.02 a tiny random decoder repeats one token from the
first step on, and its tokens would say little."""
LLAMA_32_ROPE = {"rope_type": "llama3", "factor": 32.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                 "original_max_position_embeddings": 64, "rope_theta": 500000.0}
"""Llama-3.2's rope scaling (its original length shortened to the tiny model's positions)."""


def family(name: str) -> torch.nn.Module:
    T = transformers
    torch.manual_seed(0)
    if name == "llama":  # as Llama-3.2-1B ships: tied, llama3 rope scaling
        model = T.LlamaForCausalLM(T.LlamaConfig(**COMMON, tie_word_embeddings=True, rope_parameters=LLAMA_32_ROPE))
    elif name == "llama_untied":
        model = T.LlamaForCausalLM(T.LlamaConfig(**COMMON, tie_word_embeddings=False, attention_bias=True,
                                                 mlp_bias=True))
    elif name == "qwen2":  # as Qwen2.5-0.5B ships: tied, q/k/v biases
        model = T.Qwen2ForCausalLM(T.Qwen2Config(**COMMON, tie_word_embeddings=True))
    elif name == "mistral":  # untied, no sliding window (as Mistral-7B-v0.3 ships)
        model = T.MistralForCausalLM(T.MistralConfig(**COMMON, sliding_window=None))
    elif name == "qwen3":  # as Qwen3-0.6B ships: tied, q_norm and k_norm
        model = T.Qwen3ForCausalLM(T.Qwen3Config(**COMMON, tie_word_embeddings=True))
    else:
        raise ValueError(name)
    with torch.no_grad():  # norms and biases away from 1 and 0, so a wrong one shows
        for n, p in model.named_parameters():
            if n.endswith("norm.weight"):
                p.normal_(1.0, 0.2)
            elif n.endswith("bias"):
                p.normal_(0.0, 0.1)
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model.eval()


FAMILIES = ["llama", "llama_untied", "qwen2", "mistral", "qwen3"]
_BUILT: dict[str, tuple] = {}


def shared(name: str) -> tuple[torch.nn.Module, FusedDecoder]:
    """One model and its reading per family for the whole module."""
    if name not in _BUILT:
        model = family(name)
        decoder = FusedDecoder.of(model)
        assert isinstance(decoder, FusedDecoder), decoder
        _BUILT[name] = model, decoder
    return _BUILT[name]


def prompt(batch: int, seed: int = 0, length: int = 6) -> torch.Tensor:
    return torch.randint(3, VOCAB, (batch, length), generator=torch.Generator().manual_seed(seed))


_REFERENCES: dict[tuple, tuple] = {}


def made(name: str, batch: int = 2, new: int = 8) -> tuple[torch.Tensor, torch.Tensor, tuple]:
    """(the prompt, the untuned greedy tokens, reference()'s result), once per family and batch."""
    key = (name, batch, new)
    if key not in _REFERENCES:
        ids = prompt(batch)
        _REFERENCES[key] = ids, fused_check.reference(shared(name)[0], ids, new)
    ids, ref = _REFERENCES[key]
    return ids, ref[0], ref


def own_logits(name: str, batch: int = 2, new: int = 8) -> list[torch.Tensor]:
    """The untuned model's own logits (float32) at each step of its greedy tokens (made)."""
    ids, tokens, _ = made(name, batch, new)
    kwargs = {"max_new_tokens": new, "min_new_tokens": new, "do_sample": False, "cache_implementation": "static"}
    return decode_check.teacher_forced(shared(name)[0], (ids,), kwargs, tokens)[0]


def triton_or_skip() -> None:
    """These models are on the CPU: their Triton step runs under Triton's interpreter only."""
    if fused_triton.triton is None:
        pytest.skip("Triton is not installed (scripts/setup.sh installs it for the CPU)")
    if not fused_triton.INTERPRETED:
        pytest.skip("Triton's interpreter is off (conftest.py turns it on where there is no CUDA)")


# ------------------------------------------------------------------ reading


@pytest.mark.parametrize("name", FAMILIES)
def test_the_model_is_read_as_it_is_shipped(name):
    """The products read the model's own tensors (q/k/v and gate/up as the model holds them: no
    fused copy), and reading it and stepping through it change nothing of the model."""
    model = family(name)
    state = snapshot(model)
    before = {k: v.data_ptr() for k, v in model.state_dict().items()}
    decoder = FusedDecoder.of(model)
    assert isinstance(decoder, FusedDecoder), decoder
    layer, attn, mlp = decoder.layers[0], model.model.layers[0].self_attn, model.model.layers[0].mlp
    assert all(a is b for a, b in zip(layer.qkv.weights, (attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight)))
    assert all(a is b for a, b in zip(layer.gate_up.weights, (mlp.gate_proj.weight, mlp.up_proj.weight)))
    assert decoder.final.weights[0] is model.lm_head.weight
    assert (decoder.final.weights[0] is decoder.embed) == (name != "llama_untied" and name != "mistral")
    ids = prompt(2)
    fused_check.generate(decoder, ids, 4)
    assert snapshot(model) is not None and state.restore() == []  # nothing of the model changed
    assert {k: v.data_ptr() for k, v in model.state_dict().items()} == before  # nothing new, nothing moved


def refused(name: str, **config) -> str:
    T = transformers
    torch.manual_seed(0)
    classes = {"mistral": (T.MistralForCausalLM, T.MistralConfig), "qwen2": (T.Qwen2ForCausalLM, T.Qwen2Config),
               "llama": (T.LlamaForCausalLM, T.LlamaConfig), "mixtral": (T.MixtralForCausalLM, T.MixtralConfig),
               "gemma": (T.GemmaForCausalLM, T.GemmaConfig)}
    model_class, config_class = classes[name]
    found = FusedDecoder.of(model_class(config_class(**{**COMMON, **config})).eval())
    assert isinstance(found, str)
    return found


def test_what_is_not_served_is_refused_with_the_reason():
    assert "sliding-window" in refused("mistral", sliding_window=4)
    assert "sliding-window" in refused("qwen2", use_sliding_window=True, sliding_window=4, max_window_layers=0)
    assert "activation 'gelu'" in refused("llama", hidden_act="gelu")
    assert "MixtralForCausalLM" in refused("mixtral", num_local_experts=2, num_experts_per_tok=1)
    assert "GemmaForCausalLM" in refused("gemma")  # its norm adds one to the weight


def test_a_changed_model_is_refused_with_the_reason():
    import torch_tweak as tt

    model = family("llama")
    model.train()
    assert "train mode" in FusedDecoder.of(model)
    model = family("llama")

    class Quantized(torch.nn.Linear):  # what a quantization library puts in place of a Linear
        pass

    old = model.model.layers[1].self_attn.k_proj
    model.model.layers[1].self_attn.k_proj = Quantized(old.in_features, old.out_features, bias=False)
    assert "Quantized" in FusedDecoder.of(model)
    model = family("llama")
    model.model.layers[0].mlp.up_proj.to(torch.float16)
    assert "several dtypes" in FusedDecoder.of(model) or "plain" in FusedDecoder.of(model)
    model = family("llama")
    model(torch.tensor([[5, 6]]), output_hidden_states=True)  # transformers' own capturing hooks: served
    assert isinstance(FusedDecoder.of(model), FusedDecoder)
    handle = model.model.layers[1].mlp.register_forward_hook(lambda m, i, o: o * 2)
    assert FusedDecoder.of(model) == "forward hooks on model.layers.1.mlp (the step would not run them)"
    handle.remove()
    tt.wrap(model, ["model.layers.0.mlp"])
    try:
        assert "tuned by torch-tweak" in FusedDecoder.of(model)
    finally:
        tt.unwrap(model)


def test_a_cache_or_a_batch_it_does_not_serve_is_refused():
    model, decoder = shared("llama")
    with pytest.raises(ValueError, match="StaticCache"):
        decoder.step(torch.tensor([5]), torch.tensor(3), transformers.DynamicCache())
    with pytest.raises(ValueError, match="1 to 8 rows"):
        decoder.cache(9, 16)
    cache = decoder.cache(3, 16)
    assert cache.layers[0].keys.shape[0] == 4  # the bucket's rows
    with pytest.raises(ValueError, match=r"a \[batch\] tensor of 1 to 4 rows"):
        decoder.step(torch.tensor([5] * 5), torch.tensor(3), cache)
    assert [bucket(b) for b in range(1, 9)] == [1, 2, 4, 4, 8, 8, 8, 8] and settings.FUSED_BUCKETS == (1, 2, 4, 8)


def test_eight_threads_on_one_reading_get_their_own_tokens():
    """Eight calls at once through one decoder, each on its own cache: each gets the tokens it
    gets alone (the steps' work and the tables are made under a lock; the buffers are per cache)."""
    import threading

    model, decoder = shared("llama")
    prompts = [prompt(1 + i % 3, seed=100 + i) for i in range(8)]
    alone = [fused_check.generate(decoder, ids, 6) for ids in prompts]
    got: list = [None] * 8

    def run(i: int) -> None:
        got[i] = fused_check.generate(decoder, prompts[i], 6)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert all(torch.equal(a, b) for a, b in zip(got, alone))


def test_a_position_past_the_cache_is_refused():
    _, decoder = shared("llama")
    cache = decoder.cache(1, 16)
    with pytest.raises(ValueError, match="position 16 of a cache of 16 positions"):
        decoder.step(torch.tensor([5]), torch.tensor(16), cache)


def test_weights_replaced_after_reading_are_not_read():
    model = family("llama")
    decoder = FusedDecoder.of(model)
    assert not decoder.moved()
    with torch.no_grad():
        model.model.layers[0].self_attn.q_proj.weight = torch.nn.Parameter(torch.randn(64, 64))
    assert decoder.moved()
    with pytest.raises(ValueError, match="read it again"):
        decoder.step(torch.tensor([5]), torch.tensor(3), decoder.cache(1, 16))


def test_a_dynamic_rope_table_is_the_model_s_own_step_by_step_and_leaves_it_as_it_was():
    """A dynamic rope grows its frequencies with the longest position of a call: the table is
    made as the decode steps call the module, one position at a time, and the module's
    frequencies are put back after."""
    T = transformers
    torch.manual_seed(0)
    config = T.LlamaConfig(**{**COMMON, "max_position_embeddings": 8},
                           rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0})
    model = T.LlamaForCausalLM(config).eval()
    decoder = FusedDecoder.of(model)
    rotary = model.model.rotary_emb
    inv_freq = rotary.inv_freq
    cos, sin = decoder.table(20, torch.device("cpu"))
    assert rotary.inv_freq is inv_freq and rotary.max_seq_len_cached == 8
    x = torch.zeros(1)
    for p in (3, 12, 19):  # past the original 8 positions the frequencies differ per position
        want_cos, want_sin = rotary(x, torch.tensor([[p]]))
        assert torch.equal(cos[p], want_cos[0, 0]) and torch.equal(sin[p], want_sin[0, 0])
    rotary(x, torch.tensor([[0]]))  # back to the original frequencies


# ------------------------------------------------------------------ the rule


@pytest.mark.parametrize("name", FAMILIES)
def test_teacher_forced_logits_keep_the_measured_rule(name):
    """Torch ops: the model's own arithmetic but for the attention's order of sums."""
    model, decoder = shared(name)
    ids, _, ref = made(name)
    found = fused_check.check(decoder, ids, 8, "torch", made=ref)
    assert found.multiple is not None and found.multiple <= 4


@pytest.mark.slow  # Triton's interpreter: seconds per step
@pytest.mark.parametrize("name", FAMILIES)
def test_the_triton_step_keeps_the_measured_rule(name):
    triton_or_skip()
    model, decoder = shared(name)
    ids, _, ref = made(name)
    found = fused_check.check(decoder, ids, 8, "triton", made=ref)
    assert found.multiple is not None and found.multiple <= 4


@pytest.mark.slow  # an Inductor compile
def test_the_inductor_candidate_keeps_the_rule_with_one_compile_per_shape():
    """The torch ops compiled by Inductor (on CUDA with coordinate descent tuning's kernels): the
    check's cache and the call's are other tensors of the same shapes, and take one compile."""
    model, decoder = shared("qwen3")
    ids, tokens, ref = made("qwen3")
    found = fused_check.check(decoder, ids, 8, "inductor", made=ref)
    assert found.multiple is not None and found.multiple <= 4
    assert torch.equal(fused_check.generate(decoder, ids, 8, "inductor"), tokens)
    assert len(decoder._compiled) == 1


@pytest.mark.slow  # a subprocess: tens of seconds
def test_the_study_runs_in_its_smoke_mode(tmp_path):
    """bench/studies/decode_step_study.py --smoke: tiny models of both shapes on the CPU."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    study = Path(__file__).resolve().parents[1] / "bench" / "studies" / "decode_step_study.py"
    out = tmp_path / "run.json"
    done = subprocess.run([sys.executable, str(study), "--smoke", "--json", str(out)], capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    run = json.loads(out.read_text())
    for shape in ("llama-1b", "qwen2.5-0.5b"):
        batches = run["models"][shape]["batches"]
        assert sorted(batches) == ["1", "3"]
        assert batches["1"]["check torch"]["multiple"] <= 4, batches["1"]
        assert batches["3"]["step torch"]["ms"] > 0 and "generate torch chat" in batches["1"]
        assert set(batches["1"]["parts torch"]) >= {"products", "attention", "choice_greedy", "choice_chat"}


def broken(decoder: FusedDecoder, how: str) -> FusedDecoder:
    """A copy of the reading whose step is wrong in one way (the test's own hook: no user sees it)."""
    bad = FusedDecoder.of(decoder.model)
    assert isinstance(bad, FusedDecoder)
    if how == "k and v swapped":
        layer = bad.layers[0]
        q, k, v = layer.qkv.weights
        biases = None if layer.qkv.biases is None else (layer.qkv.biases[0], layer.qkv.biases[2], layer.qkv.biases[1])
        layer.qkv = Product((q, v, k), biases, layer.qkv.norm, layer.qkv.eps)
    else:  # the rotary position shifted by one: the table's row p is position p + 1's
        cos, sin = bad.table(14, torch.device("cpu"))
        bad._tables[(14, "cpu")] = (cos.roll(-1, 0), sin.roll(-1, 0))
    return bad


@pytest.mark.parametrize("kernels", ["torch", pytest.param("triton", marks=pytest.mark.slow)])
@pytest.mark.parametrize("how", ["k and v swapped", "rotary position shifted"])
def test_a_broken_step_is_refused_with_the_step_and_the_multiple(how, kernels):
    if kernels == "triton":
        triton_or_skip()
    model, decoder = shared("llama")
    ids, _, ref = made("llama")
    with pytest.raises(MismatchError) as caught:
        fused_check.check(broken(decoder, how), ids, 8, kernels, made=ref)
    message = str(caught.value)
    # the step and the multiple, and the group of values that broke the bound (a row, or columns)
    assert re.search(rf"the fused step \({kernels}\) step [1-7] logits: (\w[\w ()-]*: )?[\d.e+]+x the original's error",
                     message), message


# ------------------------------------------------------------------ tokens


@pytest.mark.parametrize("batch", [1, 2, 3, 4, 8])
def test_greedy_tokens_are_the_untuned_generate_tokens_at_every_batch(batch):
    """One reading of the model serves every batch, each in its bucket (3 rows in a cache of 4,
    the fourth computed and ignored)."""
    model, decoder = shared("llama")
    ids = prompt(batch, seed=batch)
    with torch.no_grad():
        want = model.generate(ids, max_new_tokens=10, do_sample=False, cache_implementation="static")
    assert torch.equal(fused_check.generate(decoder, ids, 10), want)


@pytest.mark.slow  # Triton's interpreter: seconds per step
@pytest.mark.parametrize("name,batch", [("llama", 3), ("qwen2", 1), ("qwen3", 2)])
def test_greedy_tokens_through_the_triton_step(name, batch):
    triton_or_skip()
    model, decoder = shared(name)
    ids = prompt(batch, seed=batch)
    with torch.no_grad():
        want = model.generate(ids, max_new_tokens=6, do_sample=False)
    assert torch.equal(fused_check.generate(decoder, ids, 6, "triton"), want)


@pytest.mark.slow  # Triton's interpreter: seconds per step
def test_the_triton_step_split_along_k_and_positions_gives_the_untuned_tokens(monkeypatch):
    """Every product cut into two parts along K (the last part of each column block sums them)
    and every attention into two slices of the positions (the last slice of a head combines
    them): the greedy tokens of a tied Qwen2 (seven query heads a group here: 7 over 1) are the
    untuned generate()'s."""
    triton_or_skip()
    from torch_tweak._runtime.decode import fused_tuning

    split = {"product": fused_tuning.Config(16, 32, True, split=2),
             "attention": fused_tuning.Config(block_l=4, split=2)}
    monkeypatch.setattr(fused_tuning, "fixed", lambda kind, rows, interpreted: split[kind])
    T = transformers
    torch.manual_seed(0)
    model = T.Qwen2ForCausalLM(T.Qwen2Config(**{**COMMON, "num_attention_heads": 7, "num_key_value_heads": 1,
                                                  "head_dim": 8}, tie_word_embeddings=True)).eval()
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    decoder = FusedDecoder.of(model)
    ids = prompt(2, seed=3)
    with torch.no_grad():
        want = model.generate(ids, max_new_tokens=6, do_sample=False)
    assert torch.equal(fused_check.generate(decoder, ids, 6, "triton"), want)
    step = decoder.runner(decoder.cache(2, 16), "triton")
    assert set(step.kernels.configs.values()) == set(split.values())


def test_the_model_s_own_forward_continues_the_step_s_cache():
    """Each step sets the cache layers' own count, so the model's forward can take over."""
    model, decoder = shared("qwen2")
    ids, tokens, _ = made("qwen2")
    cache = decoder.cache(2, 14)
    decoder.prefill(ids, cache)
    for step in range(3):
        decoder.step(tokens[:, 6 + step], torch.tensor(6 + step), cache)
    assert int(cache.get_seq_length()) == 9
    with torch.no_grad():
        out = model(input_ids=tokens[:, 9:10], position_ids=torch.full((2, 1), 9), use_cache=True,
                    **{decode_model.cache_arg_of(model): cache})
    expected = own_logits("qwen2")[4]
    torch.testing.assert_close(out.logits[:, -1].float(), expected, rtol=1e-4, atol=1e-4)
