"""The measured rule on models as they are shipped: an output projection tied to the input
embedding (GPT-2, Llama-3.2-1B/3B, Qwen2.5, Gemma, BERT's masked-LM head, T5) and any other
parameter two modules share. torch.func.functional_call refused them ("got multiple values for
keys [...] which are tied"), the reference was dropped, and the fixed rule (or, for decode loops,
the exact tokens) judged without a word. Each model is built from a transformers config with
the tie flag its released checkpoints use, with tiny sizes and random weights; where a reference
still cannot be made, the result names the rule that judged and why."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import torch_tweak as tt
from torch_tweak._core import correctness
from torch_tweak._search import decode_check
from torch_tweak._runtime.workload import Workload

transformers = pytest.importorskip("transformers")

EAGER = tt.OneBackendStrategy(tt.backends.TorchEagerBackend())
QUICK = {"warmup_min": 1, "warmup_max": 3, "rounds_min": 3, "rounds_max": 5, "time_cap": 0.5}


def gpt2():
    return transformers.GPT2LMHeadModel(transformers.GPT2Config(
        vocab_size=128, n_embd=32, n_layer=2, n_head=2, n_positions=64, tie_word_embeddings=True))


def llama():  # Llama-3.2-1B's shape in small: grouped-query attention, tied embeddings
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=True))


def qwen2():  # Qwen2.5-0.5B to 3B tie their embeddings
    return transformers.Qwen2ForCausalLM(transformers.Qwen2Config(
        vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=True))


def bert_mlm():
    return transformers.BertForMaskedLM(transformers.BertConfig(
        vocab_size=128, hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64,
        max_position_embeddings=64, tie_word_embeddings=True))


class Shared(nn.Module):
    """One Linear called by two parents, and a Parameter two modules hold."""

    def __init__(self):
        super().__init__()
        inner = nn.Linear(16, 16)
        self.a = nn.Sequential(inner, nn.GELU())
        self.b = nn.Sequential(inner, nn.Tanh())
        self.c = nn.Linear(16, 16)
        self.d = nn.Linear(16, 16)
        self.d.weight = self.c.weight

    def forward(self, x):
        return self.d(self.c(self.a(x) + self.b(x)))


def built(make):
    torch.manual_seed(0)
    return make().eval()


@pytest.mark.parametrize("make", [gpt2, llama, qwen2, bert_mlm, Shared], ids=lambda m: m.__name__)
def test_the_reference_of_a_model_with_shared_weights_is_the_model_at_higher_precision(make):
    model = built(make)
    if make is not Shared:
        assert model.get_output_embeddings().weight is model.get_input_embeddings().weight  # tied, as released
    before = dict(model.state_dict(keep_vars=True))  # the tensors themselves: put back as they were
    x = torch.randn(4, 16) if make is Shared else torch.randint(0, 128, (2, 12))
    calls = [((x,), {} if make is Shared else {"use_cache": False, "return_dict": False} if make is not bert_mlm
              else {"return_dict": False})]
    with torch.no_grad():
        outputs = [model(*a, **k) for a, k in calls]
        found = correctness.reference(model, calls, outputs)
        wide = copy.deepcopy(model).double()(*(a.double() if a.is_floating_point() else a for a in calls[0][0]),
                                             **calls[0][1])
    assert found.measured, found.why
    assert found.dtype == torch.float64 and all(o is not None for o in found.own)
    for high, exact in zip(found.outputs[0], correctness.tensor_leaves(wide)):
        assert high is not None and torch.equal(high, exact)  # the tied weight at float64, one copy
    assert all(v is before[k] and v.dtype == torch.float32 for k, v in model.state_dict(keep_vars=True).items())
    if make is not Shared:
        assert model.get_output_embeddings().weight is model.get_input_embeddings().weight  # still tied


@pytest.mark.slow
def test_tweak_on_a_tied_model_is_judged_by_the_measured_rule_and_shows_the_multiple():
    model = built(gpt2)
    untuned = copy.deepcopy(model)
    data = [((torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(i)),), {"use_cache": False})
            for i in range(2)]
    result = tt.tweak(model, data, strategy=EAGER, max_depth=1, measure=QUICK, progress=False)
    rows = [c for r in result.modules.values() for c in r.candidates]
    assert rows and all(c["own_error"] is not None and not c.get("rule") for c in rows), rows
    text = str(result.modules)
    assert "x the original's error" in text and "relative error" not in text, text
    with torch.inference_mode():
        for args, kwargs in data:
            assert torch.equal(model(*args, **kwargs).logits, untuned(*args, **kwargs).logits)


class NoWide(nn.Module):
    """A module whose forward refuses float64: its reference cannot be made."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(16, 16)

    def forward(self, x):
        if x.dtype == torch.float64:
            raise RuntimeError("this block runs in float32 only")
        return self.lin(x)


def test_where_no_reference_can_be_made_the_result_names_the_rule_and_why():
    torch.manual_seed(0)
    model = nn.Sequential(NoWide(), nn.ReLU()).eval()
    untuned = copy.deepcopy(model)
    data = [torch.randn(4, 16) for _ in range(2)]
    result = tt.tweak(model, data, strategy=EAGER, measure=QUICK, progress=False)
    module = result.modules["0"]
    (candidate,) = module.candidates
    assert candidate["own_error"] is None and candidate["rule"].startswith(
        "the fixed rule: no higher-precision reference (the higher-precision run failed (RuntimeError: this block")
    assert "relative error 0, by the fixed rule: no higher-precision" in str(result.modules)  # its row, folded
    assert "correctness:\n" in str(module) and "judged by the fixed rule: no higher-precision reference (the " \
        "higher-precision run failed (RuntimeError: this block runs in float32 only))" in str(module), str(module)
    with torch.inference_mode():
        for x in data:
            assert torch.equal(model(x), untuned(x))
    # the run raised with the higher-precision weights in place: the module's own are back
    weights = dict(model.state_dict(keep_vars=True))
    found = correctness.reference(model[0], [((data[0],), {})], [model[0](data[0])])
    assert not found.measured and "this block runs in float32 only" in found.why
    assert all(v is weights[k] and isinstance(v, nn.Parameter) for k, v in model.state_dict(keep_vars=True).items())


def _generate(ids):
    return lambda m: m.generate(ids, max_new_tokens=6, do_sample=False)


@pytest.mark.slow
@pytest.mark.parametrize("make", [llama, qwen2, gpt2], ids=lambda m: m.__name__)
def test_the_decode_check_of_a_tied_decoder_is_the_measured_rule(make):
    model = built(make)
    ids = torch.randint(3, 128, (2, 6), generator=torch.Generator().manual_seed(0))
    job = Workload(model, _generate(ids), torch.device("cpu"))
    job.record()
    (call,) = job.generate_calls
    assert call.reference.measured, call.reference.why  # was: the reference run failed (ValueError: ... tied)
    assert job.check_generate().startswith("call 0: 1x the original's error, the untuned tokens")


@pytest.mark.slow
def test_the_generate_table_says_exact_tokens_and_why_where_no_reference_can_be_made(monkeypatch):
    model = built(llama)
    untuned = copy.deepcopy(model)
    ids = torch.randint(3, 128, (1, 6), generator=torch.Generator().manual_seed(0))

    def fails(*args, **kwargs):
        raise RuntimeError("out of host memory")

    monkeypatch.setattr(decode_check, "_high_logits", fails)
    workload = _generate(ids)
    result = tt.tweak(model, workload=workload, strategy=EAGER, max_depth=0, measure=QUICK, progress=False)
    said = "call 0: exact tokens: the reference run failed (RuntimeError: out of host memory)"
    assert result.numerics and all(found == said for found in result.numerics.values()), result.numerics
    text = str(result)
    assert f"  correctness, depth 0: {said}" in text and f"  correctness, decode loop (loop): {said}" in text, text
    with torch.no_grad():
        assert torch.equal(workload(model), workload(untuned))
