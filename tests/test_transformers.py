"""transformers models end to end on the CPU: outputs (ModelOutput, key/value caches) are
values, compared by their tensors and kept in saved files. Models are built from small
configs with random weights; nothing is downloaded."""

from __future__ import annotations

import collections
import dataclasses
import importlib.util
import json
import os
import subprocess
import sys
import warnings
import zipfile

import pytest
import torch

import torch_tweak as tt
from torch_tweak._core import correctness
from torch_tweak._store import serial
from torch_tweak._core._samples import CacheRecord

transformers = pytest.importorskip("transformers")
TESTS = os.path.dirname(os.path.abspath(__file__))


def build_gpt2():
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=2, vocab_size=512, n_positions=64,
                                     tie_word_embeddings=True)
    return transformers.GPT2LMHeadModel(config).eval()  # use_cache=True, as by default


IDS = [torch.randint(0, 512, (1, 12), generator=torch.Generator().manual_seed(i)) for i in range(2)]
EAGER = tt.OneBackendStrategy(tt.backends.TorchEagerBackend())


def layers_of(cache):
    return [(layer.keys, layer.values) for layer in cache.layers]


@pytest.fixture(scope="module")
def tuned_gpt2():
    """A GPT-2 tuned at its root (wrap and tune: the same check as a tweak, no measurement)."""
    model = build_gpt2()
    with torch.no_grad():
        expected = [model(input_ids=ids) for ids in IDS]
    tt.wrap(model, [""], strategy=EAGER)
    assert tt.tune(model, [{"input_ids": ids} for ids in IDS]) == {"": "TorchEager"}
    return model, expected


@pytest.mark.slow
def test_a_decoder_with_its_default_cache_passes_the_check():
    model = build_gpt2()
    result = tt.tweak(model, [{"input_ids": ids} for ids in IDS], max_depth=0, strategy=EAGER, progress=False,
                      cache=False)
    root = result.modules[""]
    assert root.backend == "TorchEager" and not root.error  # the cache in the output is compared as a value


def test_the_tuned_decoder_answers_as_the_untuned(tuned_gpt2):
    model, expected = tuned_gpt2
    with torch.no_grad():
        for ids, e in zip(IDS, expected):
            got = model(input_ids=ids)
            assert type(got) is type(e) and torch.equal(got.logits, e.logits)
            for (k, v), (ek, ev) in zip(layers_of(got.past_key_values), layers_of(e.past_key_values)):
                assert torch.equal(k, ek) and torch.equal(v, ev)


def test_caches_are_compared_by_their_tensors(tuned_gpt2):
    _, expected = tuned_gpt2
    with torch.no_grad():
        model = build_gpt2()
        again = model(input_ids=IDS[0]).past_key_values
    ref = expected[0].past_key_values
    assert again is not ref and correctness.check(again, ref) == 0.0
    layers = layers_of(ref)
    record = CacheRecord("DynamicCache", tuple((k, v) for k, v in layers))
    assert correctness.check(again, record) == 0.0
    with pytest.raises(correctness.MismatchError, match="DynamicCache of 1 layers"):
        correctness.check(again, CacheRecord("DynamicCache", ((layers[0][0], layers[0][1]),)))
    shifted = CacheRecord("DynamicCache", tuple((k + 1, v) for k, v in layers))
    with pytest.raises(correctness.MismatchError, match="layer 0 keys: relative error"):
        correctness.check(again, shifted)
    with pytest.raises(correctness.MismatchError, match="expected a DynamicCache"):
        correctness.check(torch.ones(2), ref)


@pytest.mark.slow
def test_save_and_load_keep_transformers_outputs(tuned_gpt2, tmp_path):
    model, expected = tuned_gpt2
    path = tmp_path / "gpt2.tt"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        tt.save(model, path, strict=True)  # every call stored: nothing to warn about
    plan = json.loads(zipfile.ZipFile(path).read("plan.json"))
    (sig,) = plan["modules"][0]["signatures"]
    assert len(sig["samples"]) == 2 and "object" in sig["outputs"][0]
    fields = sig["outputs"][0]["object"]["fields"]  # the cache's field name changed across transformers releases
    (cache,) = [v["cache"] for v in fields.values() if isinstance(v, dict) and "cache" in v]
    assert cache["class"] == "DynamicCache" and len(cache["layers"]) == 2
    script = f"""
import torch, torch_tweak as tt, sys
sys.path.insert(0, {TESTS!r})
from test_transformers import IDS, build_gpt2
model = build_gpt2()
print(tt.load(model, {str(path)!r}))
with torch.no_grad():
    out = model(input_ids=IDS[0])
torch.save(out.logits, {str(tmp_path / 'logits.pt')!r})
print(type(out).__name__)
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "{'': 'TorchEager'}" in done.stdout and type(expected[0]).__name__ in done.stdout
    assert torch.equal(torch.load(tmp_path / "logits.pt"), expected[0].logits)


def test_a_cache_passed_in_is_named_when_it_cannot_be_saved(tmp_path):
    model = build_gpt2()
    with torch.no_grad():
        past = model(input_ids=IDS[0]).past_key_values
    step = torch.randint(0, 512, (1, 1), generator=torch.Generator().manual_seed(9))
    tt.wrap(model, ["transformer.h.0"], strategy=EAGER)
    tt.tune(model, [{"input_ids": step, "past_key_values": past}])
    with pytest.warns(UserWarning, match=r"transformer\.h\.0 .*DynamicCache.*runs the original forward"):
        tt.save(model, tmp_path / "decode.tt")
    with pytest.raises(ValueError, match="DynamicCache.*strict=False"):
        tt.save(model, tmp_path / "strict.tt", strict=True)
    assert not (tmp_path / "strict.tt").exists()


Pair = collections.namedtuple("Pair", "low high")


@dataclasses.dataclass
class Scored:
    score: torch.Tensor
    label: str


def test_named_tuples_dataclasses_and_outputs_round_trip_by_an_allow_list(tmp_path):
    tensors: list[torch.Tensor] = []
    out = transformers.modeling_outputs.BaseModelOutput(last_hidden_state=torch.ones(2, 3))
    value = (torch.max(torch.arange(4.0), 0), Pair(torch.zeros(1), 2), Scored(torch.ones(1), "a"), out)
    tree = json.loads(serial.dumps(serial.encode(value, tensors)))
    known = serial.known_types([Pair, Scored])
    back = serial.decode(tree, tensors, types=known)
    assert type(back[0]) is type(value[0]) and back[0].indices == 3
    assert type(back[1]) is Pair and back[1].high == 2
    assert type(back[2]) is Scored and back[2].label == "a"
    assert type(back[3]) is type(out) and list(back[3].keys()) == ["last_hidden_state"]
    pair, output = serial.decode({"tuple": [tree["tuple"][1], tree["tuple"][3]]}, tensors, types={})
    assert type(pair) is tuple and pair == tuple(back[1])  # stand-ins where the class is not known
    assert type(output) is dict and list(output) == ["last_hidden_state"]
    assert correctness.check(out, output) == 0.0  # a ModelOutput checks against its stand-in
    with pytest.raises(ValueError, match="a class tt.load does not know: pass it, .*types=\\[Scored\\]"):
        serial.decode(tree, tensors, types={})  # a dataclass that is not a mapping: no stand-in
    forged = {"object": {"class": "os:system", "fields": {"command": "touch x"}, "mapping": True}}
    assert serial.decode(forged, tensors, types=known) == {"command": "touch x"}  # data, never a call


@pytest.mark.skipif(importlib.util.find_spec("openvino") is None, reason="OpenVINO is not installed")
@pytest.mark.slow
def test_an_openvino_build_of_a_transformers_model_prints_no_loss_type_line():
    """OpenVINO's conversion traces the module, which reads every attribute, and reading
    transformers' loss_function logs a `loss_type=None` line about no loss at all (issue 30)."""
    import logging

    import transformers.utils.logging as transformers_logging

    transformers_logging.warning_once.cache_clear()  # a line logged earlier in this process is logged again
    lines = []

    class Keep(logging.Handler):
        def emit(self, record):
            lines.append(record.getMessage())

    keep = Keep()
    logging.getLogger("transformers.modeling_utils").addHandler(keep)
    try:
        model = build_gpt2()
        untuned = build_gpt2()
        wrapped = tt.wrap(model, [""], strategy=tt.OneBackendStrategy(tt.backends.OpenVINOBackend()))
        chosen = tt.tune(model, [{"input_ids": IDS[0], "use_cache": False}])  # no cache: OpenVINO returns tensors
    finally:
        logging.getLogger("transformers.modeling_utils").removeHandler(keep)
    assert not [line for line in lines if "loss_type" in line], lines
    # the build traced the model (OpenVINO may then refuse GPT-2's aten::diff): either way the
    # model answers as the untuned one
    assert wrapped and chosen in ({"": "OpenVINO"}, {"": None})
    with torch.inference_mode():
        got, expected = model(input_ids=IDS[0], use_cache=False), untuned(input_ids=IDS[0], use_cache=False)
    assert torch.allclose(got.logits, expected.logits, rtol=1e-3, atol=1e-4)
    assert untuned.loss_function is not None  # the property still works: only the line is dropped
