"""tt.tweak's shapes=: declared ranges of the sizes that vary (torch_tweak._core.shapes).

The calls at both ends of each declared range are recorded with the dataset's, checked on and
never measured; the class group's signature leaves the declared axes free; the padded backend
serves the declared range; tt.save/tt.load and the tuning cache keep the declaration. On a CPU
padding runs without device graphs (graph=False, compile=False; tests/gpu records them).

The backends here skip a 2 ms sleep of the model they wrap (support.Slow), so that the tweak
keeps its depth on any machine; every test compares with an untuned copy taken before tuning."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import torch_tweak as tt
from torch_tweak._core import records, shapes as declared_shapes
from torch_tweak.backends import Backend, PaddedGraphBackend
from support import FAST, Slow, pause
from test_varying import requests

pytestmark = pytest.mark.usefixtures("fake_clock")  # speed verdicts on the fake clock (conftest)


class PaddedSkip(PaddedGraphBackend):
    """Padding around the module's inner layer (what the sleep wraps)."""

    def build(self, module, samples, device):
        return super().build(getattr(module, "inner", module), samples, device)


class InnerBackend(Backend):
    """The inner layer as it is; remembers the batch sizes it was built on."""

    name = "Inner"

    def build(self, module, samples, device):
        self.built_on = sorted({int(a[0].shape[0]) for a, _ in samples})
        return getattr(module, "inner", module)


class WrongAtOneRow(InnerBackend):
    """Right on every batch but one row, where it answers zeros: only a call at batch 1 shows it."""

    name = "WrongAtOneRow"

    def build(self, module, samples, device):
        inner = super().build(module, samples, device)
        return lambda x: torch.zeros_like(inner(x)) if x.shape[0] == 1 else inner(x)


class SlowPool(nn.Module):
    """Token embeddings averaged over the valid positions, after a 2 ms sleep."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = _Pool()

    def forward(self, input_ids, attention_mask):
        pause(0.002)
        return self.inner(input_ids, attention_mask)


class _Pool(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(50, 8)

    def forward(self, input_ids, attention_mask):
        m = attention_mask.unsqueeze(-1).to(torch.float32)
        return (self.embed(input_ids) * m).sum(1) / m.sum(1).clamp(min=1)


def slow_linear():
    torch.manual_seed(0)
    return Slow(nn.Linear(16, 4)).eval()


def tweak(model, data, backend, **options):
    return tt.tweak(model, data, strategy=tt.OneBackendStrategy(backend), max_depth=0, progress=False,
                    measure=FAST, cache=options.pop("cache", False), **options)


def test_a_declared_batch_range_beyond_the_recorded_calls_is_served_by_the_padded_backend():
    model = slow_linear()
    untuned = copy.deepcopy(model)
    data = [torch.randn(8, 16) for _ in range(3)]  # one batch size only
    result = tweak(model, data, PaddedSkip(graph=False, compile=False), shapes={"batch": (1, 32)})
    assert result.selected_depth == 0
    (group,) = tt.installed(model)[""].tt_signatures
    assert group.varying and group.text == "(float32[1-32, 16])" and group.declared == 2
    assert group.backend.describe()["batch_range"] == (1, 32)
    with torch.inference_mode():
        for b in (1, 3, 8, 20, 32, 32, 40):
            x = torch.randn(b, 16)
            torch.testing.assert_close(model(x), untuned(x))
    stats = group.backend.describe()
    assert stats["buckets"]["1"] == 1 and stats["buckets"]["32"] == 2  # recorded at tuning, from the edges
    assert stats["outside_range"] == 1 and sum(tt.installed(model)[""].tt_untuned.values()) == 0
    shown = str(result)  # print(result) shows the buckets, as tt.status does
    assert "declared shapes: batch 1-32" in shown
    assert "(root) (float32[1-32, 16]): buckets (calls) 1: 1, 4: 0, 8: 1, 20: 0, 32: 2" in shown
    assert "padding waste" in shown and "1 calls outside the range" in shown
    assert "declared shapes: batch 1-32" in str(tt.status(model))


def test_without_shapes_the_same_calls_run_the_original_forward():
    # the difference shapes= makes: the dataset's one size is all a signature serves
    model = slow_linear()
    untuned = copy.deepcopy(model)
    tweak(model, [torch.randn(8, 16) for _ in range(3)], InnerBackend())
    with torch.inference_mode():
        for b in (1, 20):
            x = torch.randn(b, 16)
            torch.testing.assert_close(model(x), untuned(x))
    assert tt.installed(model)[""].tt_untuned["no signature matched"] == 2
    assert "declared shapes" not in str(tt.status(model))


def test_the_class_group_leaves_a_declared_axis_free_for_any_backend():
    # the CPU path: no padding, the class group's signature serves the range (and beyond)
    model = slow_linear()
    untuned = copy.deepcopy(model)
    backend = InnerBackend()
    tweak(model, [torch.randn(8, 16) for _ in range(3)], backend, shapes={"batch": (2, 24)})
    (group,) = tt.installed(model)[""].tt_signatures
    assert group.text == "(float32[2-24, 16])" and group.declared == 2
    assert group.backend.built_on == [2, 8, 24]  # built and checked on both ends
    with torch.inference_mode():
        for b in (2, 5, 24):
            x = torch.randn(b, 16)
            torch.testing.assert_close(model(x), untuned(x))
    assert sum(tt.installed(model)[""].tt_untuned.values()) == 0


def test_a_backend_wrong_at_a_declared_end_is_refused_and_the_answers_stay_the_originals():
    model = slow_linear()
    untuned = copy.deepcopy(model)
    result = tweak(model, [torch.randn(8, 16) for _ in range(3)], WrongAtOneRow(), shapes={"batch": (1, 16)})
    assert result.selected_depth is None and not tt.installed(model)
    assert "mismatch" in str(result.modules) or "correctness" in str(result.modules)
    with torch.inference_mode():
        x = torch.randn(1, 16)
        torch.testing.assert_close(model(x), untuned(x))


def test_a_declared_length_range_pads_along_the_mask():
    torch.manual_seed(0)
    model = SlowPool().eval()
    untuned = copy.deepcopy(model)
    data = requests(4, 0, batches=(2, 3), lengths=range(10, 20))
    result = tweak(model, data, PaddedSkip(graph=False, compile=False), shapes={"batch": (1, 4), "length": (4, 48)})
    assert result.selected_depth == 0
    (group,) = tt.installed(model)[""].tt_signatures
    stats = group.backend.describe()
    assert stats["batch_range"] == (1, 4) and stats["length_range"] == (1, 48)
    with torch.inference_mode():
        for r in requests(12, 3, batches=(1, 2, 4), lengths=range(2, 49)):
            torch.testing.assert_close(model(**r), untuned(**r))
    assert sum(tt.installed(model)[""].tt_untuned.values()) == 0
    assert "declared shapes: batch 1-4, length 4-48" in str(result)


NOT_CHANGED = "the model was not changed"


@pytest.mark.parametrize("shapes, error, message", [
    ([1, 32], TypeError, "shapes must be a dict of axis ranges, e.g. shapes={'batch': (1, 32)"),
    ({}, ValueError, "shapes is empty: name at least one axis"),
    ({"seq": (1, 8)}, ValueError, "shapes has an unknown axis 'seq'; the axes are 'batch' (axis 0"),
    ({"batch": 32}, ValueError, "shapes['batch'] must be (min, max), two ints, e.g. (1, 32); got 32"),
    ({"batch": (1, 8, 32)}, ValueError, "must be (min, max), two ints"),
    ({"batch": (1.0, 32)}, ValueError, "must be (min, max), two ints"),
    ({"batch": (True, 32)}, ValueError, "must be (min, max), two ints"),
    ({"batch": (0, 32)}, ValueError, "shapes['batch'] = (0, 32): it needs 1 <= min <= max"),
    ({"batch": (16, 4)}, ValueError, "it needs 1 <= min <= max"),
    ({"batch": (1, 1 << 17)}, ValueError, "max may be at most 65536"),
    ({"batch": (1, 4)}, ValueError, "call 0 of the dataset has batch 8, outside shapes['batch'] = (1, 4): declare a "
                                    "range that holds the calls you tune on"),
    ({"length": (1, 64)}, ValueError, "passes no 2-d integer or bool attention_mask; leave 'length' out"),
])
def test_bad_shapes_are_refused_before_anything_changes(shapes, error, message):
    model = slow_linear()
    untuned = copy.deepcopy(model)
    before = type(model)
    with pytest.raises(error) as caught:
        tweak(model, [torch.randn(8, 16)], InnerBackend(), shapes=shapes)
    assert message in str(caught.value)
    assert type(model) is before and not tt.installed(model) and records.of(model) is None
    x = torch.randn(8, 16)
    with torch.inference_mode():
        torch.testing.assert_close(model(x), untuned(x))


def test_a_batch_axis_the_arguments_do_not_share_is_refused():
    class Two(nn.Module):
        def forward(self, x, y):
            return x.sum() + y.sum()

    model = Two().eval()
    with pytest.raises(ValueError, match=r"do not share one axis-0 size \(x: \(8, 4\), y: \(3, 4\)\)"):
        tweak(model, [(torch.randn(8, 4), torch.randn(3, 4))], InnerBackend(), shapes={"batch": (1, 8)})
    assert not tt.installed(model)


def test_save_and_load_keep_the_declared_shapes(tmp_path):
    model = slow_linear()
    untuned = copy.deepcopy(model)
    tweak(model, [torch.randn(8, 16) for _ in range(3)], PaddedSkip(graph=False, compile=False),
          shapes={"batch": (1, 32)})
    path = tmp_path / "shapes.tt"
    tt.save(model, path)
    fresh = copy.deepcopy(untuned)
    tt.load(fresh, path, backends=[PaddedSkip(graph=False, compile=False, max_batch=32)])
    assert records.of(fresh).shapes == declared_shapes.Shapes(batch=(1, 32))
    (group,) = tt.installed(fresh)[""].tt_signatures
    assert group.text == "(float32[1-32, 16])" and group.backend.describe()["batch_range"] == (1, 32)
    assert {"1", "32"} <= set(group.backend.describe()["buckets"])  # the edges' buckets, recorded again
    with torch.inference_mode():
        for b in (1, 12, 32):
            x = torch.randn(b, 16)
            torch.testing.assert_close(fresh(x), untuned(x))
    assert sum(tt.installed(fresh)[""].tt_untuned.values()) == 0
    assert "declared shapes: batch 1-32" in str(tt.status(fresh))


def test_the_tuning_cache_keys_on_the_declared_shapes(steady_figures):
    data = [torch.randn(8, 16) for _ in range(3)]
    first = slow_linear()
    tweak(first, data, InnerBackend(), shapes={"batch": (1, 32)}, cache=True)
    again = slow_linear()
    untuned = copy.deepcopy(again)
    hit = tweak(again, data, InnerBackend(), shapes={"batch": (1, 32)}, cache=True)
    assert hit.cached and records.of(again).shapes == declared_shapes.Shapes(batch=(1, 32))
    (group,) = tt.installed(again)[""].tt_signatures
    assert group.text == "(float32[1-32, 16])"
    with torch.inference_mode():
        x = torch.randn(20, 16)
        torch.testing.assert_close(again(x), untuned(x))
    other = slow_linear()
    assert not tweak(other, data, InnerBackend(), shapes={"batch": (1, 16)}, cache=True).cached
    assert not tweak(slow_linear(), data, InnerBackend(), cache=True).cached


@pytest.mark.slow
def test_openvino_converts_for_the_declared_range():
    pytest.importorskip("openvino")
    from torch_tweak.backends import OpenVINOBackend

    class OpenVINOInner(OpenVINOBackend):
        def build(self, module, samples, device):
            return super().build(getattr(module, "inner", module), samples, device)

    model = slow_linear()
    untuned = copy.deepcopy(model)
    result = tweak(model, [torch.randn(8, 16) for _ in range(2)], OpenVINOInner(), shapes={"batch": (1, 32)})
    assert result.selected_depth == 0
    (group,) = tt.installed(model)[""].tt_signatures
    assert group.backend.callable.input_shapes == ["[1..32,16]"]  # the declared bounds, not a dynamic batch
    with torch.inference_mode():
        for b in (1, 7, 32, 33):  # one converted model for the declared range; past it, the module itself
            x = torch.randn(b, 16)
            torch.testing.assert_close(model(x), untuned(x), rtol=1e-4, atol=1e-5)
    assert sum(tt.installed(model)[""].tt_untuned.values()) == 0


@pytest.mark.slow
def test_openvino_converts_a_declared_length_along_the_mask():
    pytest.importorskip("openvino")
    from torch_tweak.backends import OpenVINOBackend

    class OpenVINOInner(OpenVINOBackend):
        def build(self, module, samples, device):
            return super().build(getattr(module, "inner", module), samples, device)

    torch.manual_seed(0)
    model = SlowPool().eval()
    untuned = copy.deepcopy(model)
    data = requests(4, 0, batches=(2, 3), lengths=range(10, 20))
    result = tweak(model, data, OpenVINOInner(), shapes={"batch": (1, 4), "length": (4, 48)})
    assert result.selected_depth == 0
    (group,) = tt.installed(model)[""].tt_signatures
    assert group.backend.callable.input_shapes == ["[1..4,4..48]", "[1..4,4..48]"]
    with torch.inference_mode():
        for r in requests(8, 3, batches=(1, 2, 4, 5), lengths=range(2, 60)):  # some past the bounds
            torch.testing.assert_close(model(**r), untuned(**r), rtol=1e-4, atol=1e-5)
    assert sum(tt.installed(model)[""].tt_untuned.values()) == 0


@pytest.mark.parametrize("forged", [{"batch": [0, 4]}, {"seq": [1, 8]}, "batch", {"batch": [1, 1 << 40]},
                                    {"batch": [1, {"float": "nan"}]}, {}])
def test_a_file_whose_declared_shapes_are_not_valid_is_refused(tmp_path, forged):
    import forgery

    model = slow_linear()
    untuned = copy.deepcopy(model)
    tweak(model, [torch.randn(8, 16) for _ in range(3)], PaddedSkip(graph=False, compile=False),
          shapes={"batch": (1, 32)})
    tt.save(model, tmp_path / "genuine.tt")
    assert forgery.members(tmp_path / "genuine.tt")["plan.json"].count(b'"shapes"') == 1

    def edit(plan):
        plan["shapes"] = forged

    path = forgery.with_plan(tmp_path, "forged", forgery.members(tmp_path / "genuine.tt"), edit)
    fresh = copy.deepcopy(untuned)
    before = forgery.state_of(fresh)
    with pytest.raises(tt.CheckpointError, match="its declared shapes are not valid"):
        tt.load(fresh, path, backends=[PaddedSkip(graph=False, compile=False, max_batch=32)])
    assert forgery.unchanged(fresh, before) and records.of(fresh) is None


def test_every_module_of_a_depth_is_checked_on_the_declared_ends():
    torch.manual_seed(0)
    model = nn.Sequential(Slow(nn.Linear(16, 16)), Slow(nn.Linear(16, 4))).eval()
    untuned = copy.deepcopy(model)
    backend = InnerBackend()
    result = tt.tweak(model, [torch.randn(8, 16) for _ in range(3)], strategy=tt.OneBackendStrategy(backend),
                      min_depth=1, max_depth=1, progress=False, measure=FAST, cache=False,
                      shapes={"batch": (1, 32)})
    assert result.selected_depth == 1
    for path in ("0", "1"):
        (group,) = tt.installed(model)[path].tt_signatures
        assert group.varying and group.declared == 2 and group.text.startswith("(float32[1-32, ")
    with torch.inference_mode():
        for b in (1, 13, 32):
            x = torch.randn(b, 16)
            torch.testing.assert_close(model(x), untuned(x))
    assert all(sum(w.tt_untuned.values()) == 0 for w in tt.installed(model).values())


# ------------------------------------------------------------------ the model's positions


def _seq_model(family):
    """A tiny transformers model of `family`, 64 positions, tied as its released checkpoints
    are: OPT and BART look position p up at row p + 2 of a 66-row embed_positions; Marian's
    sinusoidal embed_positions holds exactly 64."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    sizes = dict(vocab_size=100, max_position_embeddings=64, tie_word_embeddings=True)
    if family == "opt":
        return transformers.OPTModel(transformers.OPTConfig(hidden_size=16, word_embed_proj_dim=16, ffn_dim=32,
                                                            num_hidden_layers=1, num_attention_heads=2, **sizes))
    layers = dict(d_model=16, encoder_layers=1, decoder_layers=1, encoder_attention_heads=2,
                  decoder_attention_heads=2, encoder_ffn_dim=32, decoder_ffn_dim=32)
    if family == "bart":
        return transformers.BartModel(transformers.BartConfig(**layers, **sizes))
    return transformers.MarianModel(transformers.MarianConfig(**layers, decoder_start_token_id=1, pad_token_id=1,
                                                              **sizes))


def _token_calls(n, length, model):
    g = torch.Generator().manual_seed(3)
    calls = []
    for _ in range(n):
        ids = torch.randint(3, 100, (2, length), generator=g)
        call = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
        if isinstance(model, SlowSeq) and model.decoder_ids:
            call["decoder_input_ids"] = ids
        calls.append(call)
    return calls


class SlowSeq(nn.Module):
    """A transformers model's last hidden state after a 2 ms sleep (what InnerSeq skips)."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner
        self.decoder_ids = type(inner).__name__ == "MarianModel"  # Marian does not shift its own

    def forward(self, input_ids, attention_mask, decoder_input_ids=None):
        pause(0.002)
        extra = {} if decoder_input_ids is None else {"decoder_input_ids": decoder_input_ids}
        return self.inner(input_ids=input_ids, attention_mask=attention_mask, **extra).last_hidden_state


class InnerSeq(Backend):
    name = "InnerSeq"
    builds = 0

    def build(self, module, samples, device):
        type(self).builds += 1
        inner = module.inner

        def run(input_ids, attention_mask, decoder_input_ids=None):
            extra = {} if decoder_input_ids is None else {"decoder_input_ids": decoder_input_ids}
            return inner(input_ids=input_ids, attention_mask=attention_mask, **extra).last_hidden_state

        return run


@pytest.mark.parametrize("family, where", [
    ("opt", "decoder.embed_positions.num_embeddings = 66 less its offset 2, config.max_position_embeddings = 64"),
    ("bart", "encoder.embed_positions.num_embeddings = 66 less its offset 2, config.max_position_embeddings = 64"),
    ("marian", "encoder.embed_positions.num_embeddings = 64, config.max_position_embeddings = 64"),
])
def test_a_length_past_an_embed_positions_table_is_refused_before_anything_is_built(family, where):
    """OPT, BART, Whisper, M2M100 and Marian name their table embed_positions: shapes= past it
    went through unchecked (tt.load refused the same range in the file tt.save wrote)."""
    model = _seq_model(family).eval()
    cls, before = type(model), copy.deepcopy(model.state_dict())
    InnerSeq.builds = 0
    with pytest.raises(ValueError) as caught:
        tweak(model, _token_calls(2, 16, SlowSeq(model)), InnerSeq(), shapes={"length": (8, 200)})
    assert str(caught.value) == (
        f"shapes['length'] = (8, 200): the model's position table holds 64 positions ({where}), so no call "
        "longer than 64 can run on it; declare a length of at most 64, e.g. shapes={'length': (8, 64)}")
    assert InnerSeq.builds == 0 and not tt.installed(model) and type(model) is cls
    assert model.state_dict().keys() == before.keys()
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert declared_shapes.positions(model) == 64  # the bound tt.load puts on a file's range: the same reader


@pytest.mark.parametrize("family", ["opt", "bart", "marian"])
def test_a_length_within_an_embed_positions_table_tunes_and_answers_as_the_untuned_model(family):
    model = SlowSeq(_seq_model(family)).eval()
    untuned = copy.deepcopy(model)
    result = tweak(model, _token_calls(3, 16, model), InnerSeq(), shapes={"length": (8, 64)})
    assert result.selected_depth == 0 and "declared shapes: length 8-64" in str(result)
    with torch.inference_mode():
        for length in (8, 16, 37, 64):
            (call,) = _token_calls(1, length, model)
            call["attention_mask"][1, length // 2:] = 0  # a shorter second row
            torch.testing.assert_close(model(**call), untuned(**call), rtol=0, atol=0)
    assert sum(tt.installed(model)[""].tt_untuned.values()) == 0
