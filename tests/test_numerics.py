"""The measured correctness rule: each candidate's error against a higher-precision run of the
module, within a multiple of the original's own error, per output tensor.

Every case tunes a module with one candidate backend (tt.wrap + tt.tune) and compares the model
afterwards with an untuned deep copy: a refused candidate leaves the original forward, which
must answer exactly as the copy does; a kept one answers within the rule. Each refusal must name
the output and the multiple. Where the old fixed rule (relative error against the output's
largest value, per dtype) decided the other way, the case says so by tuning again with
tolerance="dtype".
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import torch_tweak as tt
from torch_tweak._core import correctness, error_groups, records
from torch_tweak._runtime.module import installed
from torch_tweak.backends import Backend
from support import FAST


class Candidate(Backend):
    """A candidate that runs `fn(module, *args, **kwargs)` in place of the module."""

    name = "Candidate"

    def __init__(self, fn=None, **options):
        super().__init__(**options)
        self.fn = fn

    def fresh(self):
        made = super().fresh()
        made.fn = self.fn
        return made

    def build(self, module, samples, device):
        return lambda *args, **kwargs: self.fn(module, *args, **kwargs)


def tuned(model, path, fn, data, tolerance="measured"):
    """`model` with `path` tuned to the candidate `fn` alone; returns its wrapper."""
    tt.unwrap(model)
    (w,) = tt.wrap(model, [path], strategy=tt.OneBackendStrategy(Candidate(fn)))
    tt.tune(model, data, measure=FAST, tolerance=tolerance)
    return w


def same_as_untuned(model, untuned, data):
    with torch.inference_mode():
        for x in data:
            got, want = model(x), untuned(x)
            for g, w in zip(correctness.tensor_leaves(got), correctness.tensor_leaves(want)):
                assert torch.equal(g, w)


def refused(w, *parts):
    assert w.tt_backend is None, w.tt_report
    for part in parts:
        assert part in w.tt_error, (part, w.tt_error)


class Head(nn.Module):
    """A hidden state and a small-valued output beside it (a normalised embedding)."""

    def __init__(self, width=64, massive=None):
        super().__init__()
        self.up = nn.Linear(width, width)
        self.norm = nn.LayerNorm(width)
        self.out = nn.Linear(width, width)
        self.register_buffer("massive", massive)

    def forward(self, x):
        h = self.out(nn.functional.gelu(self.norm(self.up(x))))
        if self.massive is not None:
            h = h + self.massive
        return h, nn.functional.normalize(h, dim=-1) * 1e-3


class Model(nn.Module):
    def __init__(self, width=64, massive=None):
        super().__init__()
        self.head = Head(width, massive)

    def forward(self, x):
        return self.head(x)


def model_and_data(dtype=torch.float32, massive=None, batch=8, width=64):
    torch.manual_seed(0)
    model = Model(width, massive).eval().to(dtype)
    data = [torch.randn(batch, 16, width, dtype=dtype) for _ in range(2)]
    return model, copy.deepcopy(model), data


def test_a_candidate_that_drops_a_bias_is_refused_naming_the_output_and_the_multiple():
    model, untuned, data = model_and_data()

    def no_bias(m, x):
        h = nn.functional.linear(nn.functional.gelu(m.norm(m.up(x))), m.out.weight)
        return h, nn.functional.normalize(h, dim=-1) * 1e-3

    w = tuned(model, "head", no_bias, data)
    refused(w, "sample 0 output[0]", "x the original's error", "float64 run of the module")
    same_as_untuned(model, untuned, data)


def test_wrong_ordinary_channels_next_to_a_massive_one_are_refused_where_the_fixed_rule_kept_them():
    # language models' hidden states carry a few channels hundreds of times the others: an error
    # relative to the largest value let a candidate 250 % wrong on every ordinary channel pass
    massive = torch.zeros(64)
    massive[3] = 1000.0
    model, untuned, data = model_and_data(torch.bfloat16, massive)

    def wrong(m, x):
        h, small = m(x)
        ordinary = torch.ones_like(h)
        ordinary[..., 3] = 0
        h = h + (2.5 * (h - m.massive.to(h.dtype))) * ordinary
        return h, small

    w = tuned(model, "head", wrong, data)
    refused(w, "output[0]", "x the original's error")
    same_as_untuned(model, untuned, data)
    kept = tuned(model, "head", wrong, data, tolerance="dtype")
    assert kept.tt_backend is not None, kept.tt_error  # the fixed rule: 2.5 * ~3 / 1000 < 0.03


def test_a_wrong_small_valued_output_is_refused_beside_a_right_large_one():
    model, untuned, data = model_and_data()

    def wrong_small(m, x):
        h, small = m(x)
        return h, small * 1.01

    w = tuned(model, "head", wrong_small, data)
    refused(w, "output[1]", "x the original's error")
    same_as_untuned(model, untuned, data)


class Attention(nn.Module):
    """One head of attention with a padding mask; its scores are sharp, so the mask matters."""

    def __init__(self, width=32):
        super().__init__()
        self.qkv = nn.Linear(width, 3 * width)
        with torch.no_grad():
            self.qkv.weight[:width] *= 6.0

    def forward(self, x, mask, ignore=False):
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        scores = q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5
        if not ignore:
            scores = scores.masked_fill(~mask[:, None, :], float("-inf"))
        return scores.softmax(-1) @ v


class Masked(nn.Module):
    def __init__(self):
        super().__init__()
        self.attn = Attention()

    def forward(self, x, mask):
        return self.attn(x, mask)


def test_a_candidate_that_ignores_the_attention_mask_is_refused():
    torch.manual_seed(0)
    model = Masked().eval()
    untuned = copy.deepcopy(model)
    mask = torch.ones(4, 12, dtype=torch.bool)
    mask[1, 9:] = False  # one padded sequence of four
    data = [(torch.randn(4, 12, 32), mask) for _ in range(2)]
    tt.unwrap(model)
    (w,) = tt.wrap(model, ["attn"], strategy=tt.OneBackendStrategy(
        Candidate(lambda m, x, mask: m(x, mask, ignore=True))))
    tt.tune(model, [((x, m), {}) for x, m in data], measure=FAST)
    refused(w, "x the original's error")
    with torch.inference_mode():
        for x, m in data:
            assert torch.equal(model(x, m), untuned(x, m))


def test_a_float16_overflow_to_inf_is_refused():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 16), nn.Softmax(-1)).eval().half()
    untuned = copy.deepcopy(model)
    data = [torch.randn(4, 16).half() * 8 for _ in range(2)]

    def unstable(m, x):  # exp before the max is taken out: float16 overflows past 11
        z = m(x).new_zeros(()) + m[0](x)
        return torch.exp(z) / torch.exp(z).sum(-1, keepdim=True)

    w = tuned(model, "", unstable, data)
    refused(w, "NaN or Inf")
    same_as_untuned(model, untuned, data)


class Positions(nn.Module):
    def __init__(self):
        super().__init__()
        self.tokens = nn.Embedding(100, 32)
        self.positions = nn.Embedding(64, 32)
        self.mix = nn.Linear(32, 32)

    def forward(self, ids, shift=0):
        where = torch.arange(ids.shape[1]) + shift
        return self.mix(self.tokens(ids) + self.positions(where))


def test_a_candidate_that_shifts_position_ids_by_one_is_refused():
    torch.manual_seed(0)
    model = nn.Sequential(Positions()).eval()
    untuned = copy.deepcopy(model)
    data = [torch.randint(0, 100, (2, 20)) for _ in range(2)]
    w = tuned(model, "0", lambda m, ids: m(ids, shift=1), data)
    refused(w, "x the original's error")
    same_as_untuned(model, untuned, data)


class Normed(nn.Module):
    def __init__(self):
        super().__init__()
        self.block = nn.Sequential(nn.Linear(64, 64), nn.LayerNorm(64), nn.Linear(64, 64))

    def forward(self, x):
        return self.block(x)


@pytest.mark.parametrize("how", ["eps", "half"])
def test_float32_changes_the_fixed_rule_let_pass_are_refused(how):
    # a LayerNorm's eps from 1e-5 to 1e-4, or one layer run in float16: errors of 1e-4 to 5e-4,
    # under the fixed float32 tolerance of 1e-3, thousands of times float32's own rounding
    torch.manual_seed(0)
    model = Normed().eval()
    untuned = copy.deepcopy(model)
    data = [torch.randn(8, 64) for _ in range(2)]

    def changed(m, x):
        lin, norm, out = m.block
        h = lin(x)
        if how == "eps":
            h = nn.functional.layer_norm(h, norm.normalized_shape, norm.weight, norm.bias, 1e-4)
            return out(h)
        return nn.functional.linear(norm(h).half(), out.weight.half(), out.bias.half()).float()

    w = tuned(model, "", changed, data)
    refused(w, "sample 0 output", "x the original's error", "float64 run")
    same_as_untuned(model, untuned, data)
    assert tuned(model, "", changed, data, tolerance="dtype").tt_backend is not None


class Rounding(nn.Module):
    """Elementwise work rounded at every step: in bfloat16 its own error reaches several
    percent of its largest value."""

    def __init__(self):
        super().__init__()
        self.scale = nn.Parameter(torch.linspace(0.9, 1.1, 64))

    def forward(self, x):
        y = x
        for _ in range(40):
            y = y * self.scale + 0.05 * x
            y = y - 0.02 * y.mean(-1, keepdim=True)
        return y


def test_a_candidate_more_accurate_than_the_original_is_kept_where_the_fixed_rule_refused_it():
    torch.manual_seed(0)
    model = nn.Sequential(Rounding()).eval().bfloat16()
    untuned = copy.deepcopy(model)
    data = [torch.randn(16, 64).bfloat16() for _ in range(2)]

    def in_float32(m, x):  # the module at float32, rounded back once
        y = x.float()
        scale = m.scale.float()
        for _ in range(40):
            y = y * scale + 0.05 * x.float()
            y = y - 0.02 * y.mean(-1, keepdim=True)
        return y.bfloat16()

    fixed = tuned(model, "0", in_float32, data, tolerance="dtype")
    refused(fixed, "relative error", "exceeds the tolerance 0.03")
    w = tuned(model, "0", in_float32, data)
    assert w.tt_backend is not None, w.tt_error
    (row,) = w.tt_report
    assert row["max_error"] < row["own_error"]  # more accurate than the original
    x = data[0]
    with torch.inference_mode():
        got, want = model(x), untuned(x)
    assert not torch.equal(got, want)  # another answer, and a better one:
    exact = in_float32(untuned[0].float(), x.float())
    assert (got.float() - exact).abs().mean() < (want.float() - exact).abs().mean()


def test_the_rule_is_shown_as_a_multiple_in_the_result():
    model, untuned, data = model_and_data(torch.bfloat16)
    w = tuned(model, "head", lambda m, x: m(x), data)
    (row,) = w.tt_report  # the module itself as the candidate: exactly the original's error
    assert row["max_error"] == row["own_error"] > 0
    from torch_tweak._view.report import numerics, status
    assert numerics(row) == "1x the original's error" and status(row, True, 0) == "chosen (1x the original's error)"
    failing = dict(row, state="failed", reason="mismatch", max_error=0.5, tolerance=0.03, own_error=0.01)
    assert status(failing, False, 0) == "failed the correctness check: 50x the original's error, more than the 3x allowed"


def test_no_reference_falls_back_to_the_fixed_rule_and_says_why():
    # a float64 module has nothing higher to run at
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8)).eval().double()
    data = [torch.randn(4, 8, dtype=torch.float64)]
    found = correctness.reference(model, [((x,), {}) for x in data], [model(x) for x in data])
    assert not found.measured and "float64" in found.why
    w = tuned(model, "", lambda m, x: m(x) * (1 + 1e-7), data)
    assert w.tt_backend is not None
    assert tuned(model, "", lambda m, x: m(x) * (1 + 1e-5), data).tt_backend is None


def test_tolerance_zero_asks_for_bit_identical_outputs():
    model, untuned, data = model_and_data()
    nudged = lambda m, x: tuple(t + 1e-9 * t.abs().max() for t in m(x))  # noqa: E731
    assert tuned(model, "head", nudged, data).tt_backend is not None  # within float32's own rounding
    refused(tuned(model, "head", nudged, data, tolerance=0), "exceeds the tolerance 0")
    assert tuned(model, "head", lambda m, x: m(x), data, tolerance=0).tt_backend is not None


@pytest.mark.parametrize("bad", [-0.1, 1.5, "loose", True, float("nan")])
def test_a_bad_tolerance_is_refused_before_anything_runs(bad):
    model, untuned, data = model_and_data()
    with pytest.raises(ValueError, match="tolerance must be"):
        tt.tweak(model, data, tolerance=bad, progress=False)
    assert not installed(model)


def test_the_measure_is_per_row_and_column_and_relative_to_each_value():
    ref = torch.ones(32, 16)
    ref[:, 0] = 1000.0
    out = ref.clone()
    out[2, 1:] *= 3.5  # one row, ordinary channels 250 % wrong
    everywhere = torch.ones_like(ref, dtype=torch.bool)
    groups = error_groups.groups_of(out, ref, everywhere)
    typical = ref.mean().item() / 10  # the median (1) is under a tenth of the mean
    value = 2.5 / (1 + typical)
    assert groups.rows.block == 1 and groups.columns.block == 1  # 16 values a row, 32 a column
    assert groups.rows.rms[2] == pytest.approx(value * (15 / 16) ** 0.5) and groups.rows.rms[3] == 0
    assert groups.columns.rms[1] == pytest.approx(value / 32 ** 0.5) and groups.columns.rms[0] == 0
    assert groups.columns.peak[5] == pytest.approx(value) and groups.name(groups.rows, 2) == "row (2)"
    out = ref.clone()
    out[:, 0] += 1.0  # the massive channel off by 0.1 %
    groups = error_groups.groups_of(out, ref, everywhere)
    assert groups.columns.peak[0] == pytest.approx(1.0 / (1000 + typical)) and groups.columns.rms[1] == 0
    # a short last axis: rows gathered in twos (16 values), a few rows: columns in fours
    short = error_groups.groups_of(torch.ones(4, 8) * 1.5, torch.ones(4, 8), torch.ones(4, 8, dtype=torch.bool))
    assert (short.rows.block, short.columns.block) == (2, 4) and short.rows.rms.shape == (2,)
    assert short.name(short.columns, 1) == "columns 4-7 of the last axis"
    assert correctness.deviation(torch.zeros(3), torch.zeros(3)) == (0.0, 0.0)


class Scaled(Backend):
    """Outputs scaled by (1 + by): a fixed small error, a multiple of float32's own rounding."""

    name = "Scaled"

    def build(self, module, samples, device):
        by = 2e-7 if self.config.tolerance is None else 0.0
        return lambda *args, **kwargs: tuple(t * (1 + by) for t in module(*args, **kwargs))


@pytest.mark.slow
def test_save_and_load_keep_the_rule_and_judge_the_stored_calls_by_it(tmp_path):
    model, untuned, data = model_and_data()
    tt.unwrap(model)
    tt.wrap(model, ["head"], strategy=tt.OneBackendStrategy(Scaled()))
    tt.tune(model, data, measure=FAST, tolerance=0.01)
    path = tmp_path / "fixed.tt"
    tt.save(model, path)
    fresh = copy.deepcopy(untuned)
    assert tt.load(fresh, path, backends=[Scaled()])["head"] == "Scaled"
    assert records.of(fresh).rule == correctness.Rule(0.01)
    # the measured rule (the default): the file names no rule, and the stored calls are judged by
    # the measured rule against the module's own outputs, run at load
    tt.unwrap(model)
    tt.wrap(model, ["head"], strategy=tt.OneBackendStrategy(Scaled()))
    tt.tune(model, data, measure=FAST)
    assert installed(model)["head"].tt_backend is not None
    path = tmp_path / "measured.tt"
    tt.save(model, path)
    fresh = copy.deepcopy(untuned)
    assert tt.load(fresh, path, backends=[Scaled()])["head"] == "Scaled"
    assert records.of(fresh).rule == correctness.Rule()
    with torch.inference_mode():
        for x in data:
            for got, want in zip(fresh(x), untuned(x)):
                assert torch.allclose(got, want, rtol=1e-6, atol=0)
    other = copy.deepcopy(untuned)
    with torch.no_grad():
        other.head.out.bias.add_(0.5)  # other weights: the file's outputs are not this module's
    with pytest.warns(UserWarning, match="recorded outputs are not this module's"):
        assert tt.load(other, path, backends=[Scaled()])["head"] is None


# ------------------------------------------------------------- no single value loosens the bound


class Cancelling(nn.Module):
    """A linear layer with one channel (or one batch row) that cancels: it goes through
    ``(h + offset) - offset``, as a large-offset residual does, and float32 keeps only a few
    bits of it. The original's own error there is thousands of times its error elsewhere."""

    def __init__(self, along: str, offset: float):
        super().__init__()
        self.lin = nn.Linear(64, 64)
        self.along, self.offset = along, offset

    def forward(self, x, scale=None, wide=False):
        if wide:  # the module at float64, rounded once: more accurate than the original everywhere
            h = nn.functional.linear(x.double(), self.lin.weight.double(), self.lin.bias.double())
        else:
            h = self.lin(x)
        off = torch.zeros_like(h)
        if self.along == "channel":
            off[..., 5] = self.offset
        else:
            off[1] = self.offset
        h = (h + off) - off
        if scale is not None:
            h = h.clone()
            if self.along == "channel":
                h[..., 9] *= scale
            else:
                h[3] *= scale
        return h.to(x.dtype)


@pytest.mark.parametrize("along, offset, scale, group", [
    ("channel", 4e6, 1.3, "column 9"),  # an ordinary channel 30 % wrong beside one that cancels
    ("channel", 4e6, 1.1, "column 9"),  # 10 % wrong
    ("row", 5e5, 1.03, "row (3, "),  # a batch row 3 % wrong beside one that cancels
])
def test_one_cancelling_channel_or_row_loosens_the_bound_of_no_other(along, offset, scale, group):
    # the bound was 4x the original's worst row and worst value: the cancelling channel's own
    # error (0.03) let an ordinary channel 30 % wrong pass at 0.039
    torch.manual_seed(0)
    model = nn.Sequential(Cancelling(along, offset)).eval()
    untuned = copy.deepcopy(model)
    data = [torch.randn(8, 16, 64) for _ in range(2)]
    with torch.no_grad():
        own = correctness.reference(model[0], [((x,), {}) for x in data], [model(x) for x in data])
    assert own.measured, own.why  # the cancellation stays within what rounding explains
    w = tuned(model, "0", lambda m, x: m(x, scale=scale), data)
    refused(w, "sample 0 output", group, "x the original's error", "float64 run of the module")
    same_as_untuned(model, untuned, data)
    for right in (lambda m, x: m(x), lambda m, x: m(x, wide=True)):  # the same as the original; more accurate
        w = tuned(model, "0", right, data)
        assert w.tt_backend is not None, w.tt_error
        with torch.inference_mode():
            for x in data:  # the candidate answers: within float32's rounding, and the cancelling one's ulp
                assert torch.allclose(model(x), untuned(x), rtol=1e-5, atol=0.5)


class Reciprocal(nn.Module):
    """A linear layer's output beside 1 / ((x + 1e4) - 1e4 - x) of its input: 0 in float64
    (Inf: a float32 x is exact there), a few ulps of 1e4 in float32 (finite)."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(16, 16)

    def forward(self, x, flip=False):
        r = 1 / ((x + 1e4) - 1e4 - x)
        return torch.cat([self.lin(x), -r if flip else r], dim=-1)


def test_values_where_the_reference_is_inf_and_the_original_finite_are_still_compared():
    torch.manual_seed(0)
    model = nn.Sequential(Reciprocal()).eval()
    untuned = copy.deepcopy(model)
    data = [torch.randn(8, 16) for _ in range(2)]
    with torch.no_grad():
        assert all(bool(torch.isfinite(model(x)).all()) for x in data)  # the original: finite everywhere
        found = correctness.reference(model[0], [((x,), {}) for x in data], [model(x) for x in data])
    assert found.measured, found.why
    assert not bool(torch.isfinite(found.outputs[0][0][:, 16:]).any())  # the reference: Inf there
    w = tuned(model, "0", lambda m, x: m(x, flip=True), data)  # the sign of each such value flipped: was kept
    refused(w, "higher-precision run is NaN or Inf and the original finite", "held to the original's")
    same_as_untuned(model, untuned, data)
    w = tuned(model, "0", lambda m, x: m(x), data)
    assert w.tt_backend is not None, w.tt_error
    same_as_untuned(model, untuned, data)


class Varying(nn.Module):
    """One signature, two structures: one tensor or two, by the sign of the first input."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x, off=1.0):
        y = self.lin(x)
        return (y,) if x[0, 0] > 0 else (y, y * 2 * off)


def test_calls_of_one_signature_with_different_numbers_of_outputs_are_judged():
    # the reference read each tensor's dtype from the first call's outputs: IndexError, and every
    # candidate was "build failed"
    torch.manual_seed(0)
    model = nn.Sequential(Varying()).eval()
    untuned = copy.deepcopy(model)
    one, two = torch.randn(4, 8), torch.randn(4, 8)
    one[0, 0], two[0, 0] = 1.0, -1.0
    data = [one, two]
    with torch.no_grad():
        found = correctness.reference(model[0], [((x,), {}) for x in data], [model(x) for x in data])
    assert found.measured and len(found.own) == 2 and [len(t) for t in found.outputs] == [1, 2]
    w = tuned(model, "0", lambda m, x: m(x), data)
    assert w.tt_backend is not None, w.tt_error
    same_as_untuned(model, untuned, data)
    w = tuned(model, "0", lambda m, x: m(x, off=1.01), data)  # the second call's second tensor 1 % off
    refused(w, "sample 1 output[1]", "x the original's error")
    same_as_untuned(model, untuned, data)


def test_decode_logits_where_the_reference_is_inf_are_held_to_the_untuned_ones():
    from torch_tweak._core import decode_numerics

    torch.manual_seed(0)
    untuned = [torch.randn(2, 64) * 3 for _ in range(3)]
    high = [t.double().add(1e-7).float() for t in untuned]
    for h in high:
        h[:, :4] = float("inf")  # the higher-precision logits overflow there, the untuned ones do not
    reference = decode_numerics.step_reference(untuned, high)
    assert decode_numerics.check_steps([t.clone() for t in untuned], reference, "call").multiple == pytest.approx(1)
    flipped = [t.clone() for t in untuned]
    flipped[1][:, :4] *= -1  # was skipped: the higher-precision run has no finite value there
    with pytest.raises(correctness.MismatchError, match="call step 1 logits: at the 8 logits where the higher-precision "
                                                        "run is NaN or Inf"):
        decode_numerics.check_steps(flipped, reference, "call")


def test_a_right_candidate_whose_largest_error_in_one_column_is_5x_the_originals_is_kept():
    """A group's largest error is its noisiest figure (tt.settings.PEAK_SPREAD): per column of
    256, OpenVINO's build of the example's encoder came to 4.9x the original's largest error in
    one column (1.8e-06 absolute) with its root mean squares within 2x, and the example kept
    nothing. Such a candidate is kept; a value off by one part in ten thousand is still refused."""
    g = torch.Generator().manual_seed(0)
    high = torch.randn(64, 256, generator=g, dtype=torch.float64)
    ref = high + 1e-7 * torch.randn(64, 256, generator=g, dtype=torch.float64)  # the original's float32 error
    out = high + 2e-7 * torch.randn(64, 256, generator=g, dtype=torch.float64)  # a candidate's, 2x as large
    column = (ref - high)[:, 135].abs()
    row = int(column.argmin())
    out[row, 135] = high[row, 135] + 5 * float(column.max())  # 5x the original's largest there
    finite = torch.ones_like(high, dtype=torch.bool)
    kept = correctness._measured(out.float(), ref.float(), high, finite, "sample 0 output")
    assert kept.share <= 1.0
    out[7, 9] = high[7, 9] * (1 + 1e-4)  # one ordinary value off by 0.01 %
    with pytest.raises(correctness.MismatchError, match=r"sample 0 output: (row|column)"):
        correctness._measured(out.float(), ref.float(), high, finite, "sample 0 output")
    with pytest.MonkeyPatch.context() as patch:  # the single-figure peak bound refused the first
        patch.setattr(tt.settings, "PEAK_SPREAD", 1.0)
        out[7, 9] = high[7, 9] + 2e-7
        with pytest.raises(correctness.MismatchError, match="largest single error"):
            correctness._measured(out.float(), ref.float(), high, finite, "sample 0 output")


def test_a_bfloat16_models_logits_are_judged_with_bfloat16s_floor_and_cap_though_they_come_as_float32():
    """generate() hands its logits over as float32 whatever the model computes in. A bfloat16
    Llama's own logits were 0.017 off the float32 run in a group, a fused loop's 0.0506 (3x):
    refused at float32's cap of 0.05 on an H100, though 3x is within the rule's 4x. The cap and
    floor are those of the dtype the model computes in; 6x is still refused."""
    from torch_tweak._core import decode_numerics

    g = torch.Generator().manual_seed(0)
    high = [torch.randn(1, 2048, generator=g) * 4 for _ in range(3)]
    noise = [torch.randn(1, 2048, generator=g) for _ in high]
    untuned = [h + 0.017 * h.abs().mean() * n for h, n in zip(high, noise)]
    fused = [h + 3 * 0.017 * h.abs().mean() * n for h, n in zip(high, noise)]  # 3x in every group
    as_float32 = decode_numerics.step_reference(untuned, high)
    with pytest.raises(correctness.MismatchError, match="at most 0.05"):
        decode_numerics.check_steps(fused, as_float32, "call")
    as_bf16 = decode_numerics.step_reference(untuned, high, precision=torch.bfloat16)
    assert decode_numerics.check_steps(fused, as_bf16, "call").multiple < 4
    far = [h + 6 * 0.017 * h.abs().mean() * n for h, n in zip(high, noise)]
    with pytest.raises(correctness.MismatchError, match="more than 4x allowed"):
        decode_numerics.check_steps(far, as_bf16, "call")
