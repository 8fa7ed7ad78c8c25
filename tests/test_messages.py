"""What tweak says, against the exact cases users met: the generate() table agrees with what
was kept and has a row per candidate measured; nothing kept says nothing saved; swapped
arguments, label pairs and declared shapes past a model's position table are refused with
what to write instead; counts agree after tt.load."""

from __future__ import annotations

import types

import pytest

from torch_tweak._view.result import DepthResult, TweakResult, _token_rows, tokens_table

# ------------------------------------------------------------------ the generate() table


def _job(report: list[dict], tokens: int = 24) -> types.SimpleNamespace:
    return types.SimpleNamespace(loop_report=report, tokens=tokens, ttft={"untuned": 9.0, "loop": 8.0, 0: 7.0, 1: 6.0},
                                 tokens_per_s=lambda ms: None if ms is None else tokens / (ms / 1e3),
                                 numerics={}, hint="")


def _result(rows: list[DepthResult], *, confirmation=None, quality="consistent", share=None) -> TweakResult:
    result = object.__new__(TweakResult)
    result.rows = rows
    chosen = next((r for r in rows if r.selected), None)
    result.selected_depth = None if chosen is None else chosen.depth
    result.confirmation = confirmation
    result.measurement_quality = quality
    result.others_share = share
    return result


def _loop(name: str, ms: float | None, kept: bool, state: str = "measured", error: str = "") -> dict:
    return {"candidate": name, "state": state, "error": error, "latency_ms": ms, "numerics": "", "kept": kept}


def test_a_depth_faster_than_the_kept_loop_says_why_it_was_not_kept():
    """The issue's case: on a busy machine "depth 1 + decode loop 22.4 tokens/s" beside "kept:
    untuned + decode loop 14.4": depth 1 was not kept because the machine was busy, and its row
    says so; the kept row is the loop's own, with its own figure; the loop that was refused has
    its row."""
    report = [_loop("generate", 2400.0, False), _loop("decode loop (loop)", 1666.7, True),
              _loop("decode loop (loop, top-k sampler)", None, False, "failed", "MismatchError: token 3 parts")]
    rows = [DepthResult(0, 1, 0, 1500.0, 1.1, "", False), DepthResult(1, 3, 0, 1071.4, 1.5, "", False)]
    side = {"depth": 1, "confirmed": False, "speedup": 1.1, "speedup_low": 0.9, "speedup_high": 1.4,
            "paired_rounds": 40}
    result = _result(rows, confirmation=side, quality="busy", share=0.8)
    tokens = _token_rows(result, _job(report))
    by_label = {r.label: r for r in tokens}
    assert [r.label for r in tokens if r.kept] == ["untuned + decode loop (loop)"]
    kept = by_label["untuned + decode loop (loop)"]
    assert kept.status == "kept (measured on a busy machine: other processes took 80% of the CPUs)"
    assert kept.latency_ms == 1666.7
    assert by_label["untuned"].status == "slower than untuned + decode loop (loop)"
    assert by_label["untuned + decode loop (loop, top-k sampler)"].status == "refused: MismatchError: token 3 parts"
    depth1 = by_label["depth 1 + decode loop (loop)"]
    assert depth1.status.startswith("not kept: the machine was busy") and \
        "paired rounds put it at 1.10x, 99% interval 0.90x to 1.40x" in depth1.status, depth1.status
    assert by_label["depth 0 + decode loop (loop)"].status == \
        "slower than depth 1 + decode loop (loop) in the depth search (22.4 tokens/s there), itself not kept"
    assert [r.measured for r in tokens] == ["loop choice", "loop choice", "", "depth search", "depth search"]
    result.tokens, result.tokens_per_run, result.numerics, result.hint = tokens, 24, {}, ""
    table = tokens_table(result)
    assert "status" in table.splitlines()[2]
    starred = [line for line in table.splitlines() if line.startswith("*")]
    assert len(starred) == 1 and "untuned + decode loop (loop)" in starred[0] and "14.4" in starred[0]
    assert "not kept: the machine was busy" in table


def test_a_loop_that_lost_to_transformers_loop_has_its_row():
    """The decode loop that lost to transformers' loop had no row at all (only
    result.loop_report said why): it has one, saying it was slower."""
    report = [_loop("generate", 100.0, True), _loop("decode loop (loop)", 140.0, False)]
    rows = [DepthResult(0, 1, 0, 80.0, 1.25, "", True)]
    result = _result(rows, confirmation={"depth": 0, "confirmed": True, "speedup": 1.25, "speedup_low": 1.1,
                                         "speedup_high": 1.4})
    tokens = _token_rows(result, _job(report))
    assert [(r.label, r.kept) for r in tokens] == [("untuned", False), ("untuned + decode loop (loop)", False),
                                                   ("depth 0", True)]
    assert tokens[0].status == "depth 0 kept over it (below)"
    assert tokens[1].status == "slower than untuned"
    assert tokens[2].status == "kept: 1.25x faster than untuned side by side"


# ------------------------------------------------------------------ the chart


def _busy_untuned_result() -> TweakResult:
    """The issue's chart: the search measured untuned at 782 ms (a burst) and depth 1 at 96 ms,
    side by side the two were 155.5 and 96 ms (1.62x), on a busy machine: nothing kept."""
    rows = [DepthResult(0, 1, 0, 120.0, 6.5, "", False), DepthResult(1, 4, 0, 96.0, 8.1, "", False)]
    side = {"depth": 1, "confirmed": False, "from_search": False, "speedup": 1.62, "speedup_low": 1.3,
            "speedup_high": 1.9, "busy_keep": 4.89, "untuned": {"median_ns": 155.5e6}, "tuned": {"median_ns": 96e6}}
    result = _result(rows, confirmation=side, quality="busy", share=0.8)
    result.untuned = DepthResult(None, 0, 0, 782.0, 1.0, "", True)
    return result


def test_the_chart_draws_the_side_by_side_figure_on_a_busy_machine():
    from torch_tweak._view.plotting import bars

    labels, values, _, skipped, title = bars(_busy_untuned_result())
    assert labels == ["untuned", "depth 1"] and values[0] / values[1] == pytest.approx(1.62, abs=0.01)
    assert skipped == ["depth 0: 120 ms in the depth search (another load: not drawn)"]
    assert "side by side, on a busy machine" in title


def test_the_chart_title_fits_the_image():
    plt = pytest.importorskip("matplotlib.pyplot")
    from torch_tweak._view.plotting import figure

    fig = figure(_busy_untuned_result(), None, plt)
    try:
        fig.canvas.draw()
        box, edge = fig.axes[0].title.get_window_extent(), fig.bbox
        assert box.x0 >= edge.x0 and box.x1 <= edge.x1 and box.y1 <= edge.y1, (box, edge)
    finally:
        plt.close(fig)


# ------------------------------------------------------------------ small messages


def _mlp():
    import torch
    from torch import nn

    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4)).eval()


def test_swapped_load_arguments_say_so_and_show_the_right_call(tmp_path):
    import copy

    import torch
    import torch_tweak as tt

    model = _mlp()
    before = copy.deepcopy(model.state_dict())
    with pytest.raises(TypeError) as caught:
        tt.load(str(tmp_path / "m.tt"), model)
    assert str(caught.value) == f"tt.load's arguments are swapped: the model comes first, then the file: " \
                                f"tt.load(model, {str(tmp_path / 'm.tt')!r})"
    assert not tt.installed(model)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_label_pairs_are_named_before_the_models_own_error():
    """A training loader's [(x, y)] gave the model's own "forward() takes 2 positional arguments
    but 3 were given"; tweak says what the samples look like and what to pass."""
    import copy

    import torch
    import torch_tweak as tt

    model = _mlp()
    untuned = copy.deepcopy(model)
    pairs = [(torch.randn(4, 8), torch.randint(0, 4, (4,))) for _ in range(2)]
    with pytest.raises(TypeError) as caught:
        tt.tweak(model, pairs, progress=False, cache=False)
    message = str(caught.value)
    assert message.startswith("the dataset's samples look like (input, label) pairs (")
    assert "Pass the inputs only, e.g. tt.tweak(model, [x for x, _ in pairs])" in message
    assert "workload=lambda m: [m(x) for x, _ in pairs]" in message
    assert not tt.installed(model)
    x = pairs[0][0]
    with torch.no_grad():
        assert torch.equal(model(x), untuned(x))


def test_two_arguments_a_model_takes_are_no_label_pairs():
    import torch
    from torch import nn

    from torch_tweak._core.signatures import label_pairs

    class Two(nn.Module):
        def forward(self, x, mask):
            return x * mask

    calls = [((torch.randn(2, 3), torch.ones(2, 3)), {})]
    assert label_pairs(Two(), calls) is None
    assert label_pairs(_mlp(), calls) is not None
    assert label_pairs(_mlp(), [((torch.randn(2, 8),), {})]) is None


def _one_argument(self, x):
    """What the wrapped forwards below say they are: one argument."""
    return self.lin(x)


def _wrapped_forwards():
    """Models whose forward is functools.wraps(_one_argument) around a function of two
    arguments, named (x, b) or taken as *args: model(x, b) runs, after a 2 ms pause (what
    the backend below skips)."""
    import functools

    import torch
    from torch import nn

    from support import pause

    class Named(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(8, 8)

        @functools.wraps(_one_argument)
        def forward(self, x, b):
            pause(0.002)
            return self.lin(x) + b

    class Passed(Named):
        @functools.wraps(_one_argument)
        def forward(self, *args):
            x, b = args
            pause(0.002)
            return self.lin(x) * b

    torch.manual_seed(0)
    return Named().eval(), Passed().eval()


@pytest.mark.parametrize("which", [0, 1])
def test_a_forward_wrapped_around_two_arguments_is_tuned_not_taken_for_label_pairs(fake_clock, which):
    """functools.wraps makes inspect.signature report the wrapped function's one argument: a
    model called as m(x, b) was refused with "W.forward takes one argument"."""
    import copy

    import torch
    import torch_tweak as tt
    from torch_tweak.backends import Backend

    from support import FAST

    class Skip(Backend):  # the model's answer without its pause
        name = "Skip"

        def build(self, module, samples, device):
            two = type(module).__name__ == "Named"
            return lambda x, b: (module.lin(x) + b) if two else (module.lin(x) * b)

    model = _wrapped_forwards()[which]
    untuned = copy.deepcopy(model)
    pairs = [(torch.randn(4, 8), torch.randn(4, 8)) for _ in range(3)]
    result = tt.tweak(model, pairs, strategy=tt.OneBackendStrategy(Skip()), max_depth=0, progress=False,
                      cache=False, measure=FAST)
    assert result.selected_depth == 0 and tt.installed(model)
    with torch.inference_mode():
        for x, b in pairs + [(torch.randn(4, 8), torch.randn(4, 8))]:
            assert torch.equal(model(x, b), untuned(x, b))
    assert sum(tt.installed(model)[""].tt_untuned.values()) == 0


def test_the_signature_a_wrapped_forward_is_called_with():
    import functools

    import torch
    from torch import nn

    from torch_tweak._core.signatures import forward_params, label_pairs

    named, passed = _wrapped_forwards()
    assert forward_params(named) == ("x", "b")  # its own names, not the wrapped function's
    pairs = [((torch.randn(2, 8), torch.randn(2, 8)), {})]
    assert label_pairs(named, pairs) is None and label_pairs(passed, pairs) is None

    class Decorated(nn.Module):  # a pass-through decorator: the wrapped function's names bind the call
        @torch.no_grad()
        def forward(self, x, scale=1.0):
            return x * scale

    assert forward_params(Decorated()) == ("x", "scale")

    class Honest(nn.Module):  # the honest case keeps its message, also under a wraps that names one argument
        @functools.wraps(_one_argument)
        def forward(self, x):
            return x

    assert label_pairs(Honest(), pairs).startswith("the dataset's samples look like (input, label) pairs")
    assert label_pairs(_mlp(), pairs).startswith("the dataset's samples look like (input, label) pairs")


# ------------------------------------------------------------------ shapes= against the model


def _bert():
    import torch

    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.BertConfig(vocab_size=100, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                                     intermediate_size=32, max_position_embeddings=64)
    return transformers.BertModel(config).eval()


def test_a_length_past_the_position_table_is_refused_before_anything_is_built():
    """shapes={"length": (8, 2048)} on a BERT of 512 positions ended in torch's "The expanded
    size of the tensor (2048) must match the existing size (512)" in every depth's row."""
    import copy

    import torch
    import torch_tweak as tt

    model = _bert()
    before = copy.deepcopy(model.state_dict())
    ids = torch.randint(0, 100, (2, 16))
    data = [{"input_ids": ids, "attention_mask": torch.ones_like(ids)}]
    with pytest.raises(ValueError) as caught:
        tt.tweak(model, data, shapes={"length": (8, 128)}, max_depth=0, progress=False, cache=False,
                 strategy=tt.OneBackendStrategy(tt.backends.TorchEagerBackend()), measure={"rounds_max": 3})
    assert str(caught.value) == (
        "shapes['length'] = (8, 128): the model's position table holds 64 positions "
        "(embeddings.position_embeddings.num_embeddings = 64, config.max_position_embeddings = 64), so no call "
        "longer than 64 can run on it; declare a length of at most 64, e.g. shapes={'length': (8, 64)}")
    assert not tt.installed(model)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_a_length_past_a_rotary_models_config_is_refused_as_tt_load_refuses_it(tmp_path):
    """tt.tweak took shapes={"length": (8, 128)} on a Llama of 64 positions (no learned table),
    and tt.load refused the file it saved: "its declared shapes are refused: length (8, 128) is
    past the model's position table (64 positions) ... tt.save never writes such a range". One
    bound now (shapes.position_table), read by both."""
    import torch
    import torch_tweak as tt
    from torch_tweak._core import shapes
    from torch_tweak._store import checkpoint

    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                      num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=64,
                                      tie_word_embeddings=True)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).eval()
    ids = torch.randint(0, 64, (2, 16))
    with pytest.raises(ValueError) as caught:
        tt.tweak(model, [{"input_ids": ids, "attention_mask": torch.ones_like(ids)}], shapes={"length": (8, 128)},
                 max_depth=0, progress=False, cache=False, strategy=tt.OneBackendStrategy(tt.backends.TorchEagerBackend()))
    assert str(caught.value) == (
        "shapes['length'] = (8, 128): the model's config takes at most 64 positions (config.max_position_embeddings = "
        "64), so no call longer than 64 can run on it; declare a length of at most 64, e.g. "
        "shapes={'length': (8, 64)}")
    assert not tt.installed(model)
    declared = shapes.Shapes(length=(8, 64))
    shapes.check_model(declared, model)  # what tt.tweak takes, tt.load takes
    assert checkpoint._shapes_of({"shapes": declared.as_dict()}, tmp_path / "f.tt", model) == declared


def test_position_tables_found_and_not_found():
    from torch import nn

    from torch_tweak._core.shapes import position_limit

    assert position_limit(_bert())[0] == 64

    class Roberta(nn.Module):  # a padding row before the positions: 2 fewer usable
        def __init__(self):
            super().__init__()
            self.position_embeddings = nn.Embedding(514, 8, padding_idx=1)

    assert position_limit(Roberta()) == (512, "position_embeddings.num_embeddings = 514 less 2 rows up to its "
                                               "padding_idx 1", True)
    assert position_limit(_mlp()) is None  # no table, no config: any length


@pytest.mark.slow
def test_no_recompile_limit_line_from_tweaks_own_runs_and_the_limit_restored():
    """A generate() tuning printed torch's "torch._dynamo hit config.recompile_limit (8) ...
    size mismatch at index 1. expected 24, actual 1": tweak runs the model on more call shapes
    than the traffic has. Here a torch.compile inside the model meets 11 shapes."""
    import logging

    import torch
    import torch._dynamo.config as dynamo_config
    from torch import nn

    import torch_tweak as tt

    inner = torch.compile(lambda x: x * 2 + 1, backend="eager", dynamic=False)

    class Compiles(nn.Module):
        def forward(self, x):
            return inner(x)

    said = []

    class Said(logging.Handler):
        def emit(self, record):
            said.append(record.getMessage())

    handler = Said()
    logging.getLogger("torch._dynamo").addHandler(handler)
    data = [torch.randn(b, 3) for b in range(1, 12)]
    model = Compiles().eval()
    try:
        tt.tweak(model, data, max_depth=0, progress=False, cache=False,
                 strategy=tt.OneBackendStrategy(tt.backends.TorchEagerBackend()),
                 measure={"rounds_min": 2, "rounds_max": 3})
    finally:
        logging.getLogger("torch._dynamo").removeHandler(handler)
    assert not [line for line in said if "recompile_limit" in line], said
    assert dynamo_config.recompile_limit == 8  # the user's setting, as it was
    with torch.no_grad():
        for x in data:
            assert torch.equal(model(x), x * 2 + 1)


def test_no_message_passes_on_torchs_advice_to_untie_the_weights(tmp_path, monkeypatch):
    """The tied-weights fallback's only explanation was torch's functional_call error, ending
    "Consider using tie_weights=False": read as advice to untie the model, whose checkpoint ties
    them. No message a user reads passes it on; what it means is said instead."""
    import torch
    import torch_tweak as tt
    from torch_tweak._core import noise

    torch_says = ("the higher-precision run failed (ValueError: functional_call got multiple values for keys "
                  "['lm_head.weight', 'transformer.wte.weight'], which are tied. Consider using tie_weights=False)")
    said = noise.without_advice(torch_says)
    assert "tie_weights" not in said and "which are tied)" in said
    assert said.endswith("the model's weights are tied (one tensor under two names), as its checkpoint has them: "
                         "nothing to change, the fixed rule checks this signature instead")
    assert noise.without_advice("another error") == "another error"

    transformers = pytest.importorskip("transformers")
    monkeypatch.setenv("TORCH_TWEAK_CACHE", str(tmp_path))
    config = transformers.GPT2Config(vocab_size=64, n_embd=32, n_layer=1, n_head=2, n_positions=64,
                                     tie_word_embeddings=True)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(config).eval()
    tt.wrap(model, [""], strategy=tt.OneBackendStrategy(tt.backends.TorchEagerBackend()))
    tt.tune(model, [{"input_ids": torch.randint(0, 64, (2, 16))}], measure={"rounds_min": 3, "rounds_max": 3})
    logs = [p.read_text() for p in tmp_path.glob("logs/**/*.log")]
    assert logs and not any("tie_weights" in text for text in logs)
