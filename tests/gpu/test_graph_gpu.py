"""The device graph backend on CUDA: replay, fallback, activate/deactivate, failed
captures, and outputs that later calls must not overwrite."""

from __future__ import annotations

import os
import sys

import pytest
import torch
from torch import nn

import torch_tweak as tt
from torch_tweak import _C
from torch_tweak._core import signatures
from torch_tweak.backends import DeviceGraphBackend, InductorGraphBackend, TorchEagerBackend
from torch_tweak.backends.graph import GraphUnsupported

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "examples", "Tweak"))
import encoder  # noqa: E402

FAST = {"warmup_min": 1, "warmup_max": 3, "rounds_min": 3, "rounds_max": 5, "time_cap": 0.5}
GRAPH = tt.OneBackendStrategy(DeviceGraphBackend())


def cuda_mlp(dtype=torch.float32) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 32)).to("cuda", dtype).eval()


def data(batch=8, count=3, dtype=torch.float32, features=32):
    g = torch.Generator().manual_seed(1)
    return [torch.randn(batch, features, generator=g).to("cuda", dtype) for _ in range(count)]


def graphed(model: nn.Module, dataset, path: str = "", strategy=GRAPH):
    """Wraps `path` of `model`, tunes it, returns (wrapper, its GraphReplay)."""
    (wrapper,) = tt.wrap(model, [path], strategy=strategy)
    chosen = tt.tune(model, dataset, measure=FAST)
    assert chosen == {path: "DeviceGraph"}, wrapper.tt_report
    replay = wrapper.tt_backend.callable
    assert isinstance(replay, _C.GraphReplay)
    return wrapper, replay


def test_replay_equals_eager(eager_guard):
    model = cuda_mlp()
    xs = data()
    with torch.no_grad():
        expected = [model(x) for x in xs]
    eager_guard.watch(model)
    _, replay = graphed(model, xs)
    assert replay.driver, "torch with raw_cuda_graph_exec and a CUDA driver: launches go through the driver"
    eager_guard.arm()
    before = replay.replays
    with torch.no_grad():
        got = [model(x) for x in xs]
    assert replay.replays - before == len(xs) and replay.fallbacks == 0
    for g, e in zip(got, expected):
        torch.testing.assert_close(g, e, rtol=1e-5, atol=1e-6)


def test_encoder_blocks_replay_equal_eager_in_bf16(eager_guard):
    model = encoder.build("cuda", torch.bfloat16)
    xs = encoder.samples("cuda", torch.bfloat16, count=2)
    with torch.no_grad():
        expected = [model(x) for x in xs]
    for layer in model.layers:
        eager_guard.watch(layer)
    tt.wrap(model, [f"layers.{i}" for i in range(4)], strategy=GRAPH)
    assert set(tt.tune(model, xs, measure=FAST).values()) == {"DeviceGraph"}
    eager_guard.arm()
    with torch.no_grad():
        for x, e in zip(xs, expected):
            torch.testing.assert_close(model(x), e, rtol=2e-2, atol=2e-2)


def test_a_larger_batch_falls_back_and_is_right(eager_guard):
    model = cuda_mlp()
    xs = data(batch=8)
    eager_guard.watch(model)
    wrapper, replay = graphed(model, xs)
    eager_guard.arm()
    big = torch.randn(16, 32, device="cuda")
    with torch.no_grad():
        with eager_guard.expect(1):
            got = model(big)
        with eager_guard.expect(1):
            want = wrapper._tt_original(big)
    torch.testing.assert_close(got, want)
    # the dispatcher's signature or the replay's own check sent it to the original, once
    assert wrapper._tt_fallbacks + replay.fallbacks == 1
    replays = replay.replays
    with torch.no_grad():
        model(xs[0])  # back to the graph
    assert replay.replays == replays + 1


def test_deactivate_then_activate(eager_guard):
    model = cuda_mlp()
    xs = data()
    with torch.no_grad():
        expected = model(xs[0])
    eager_guard.watch(model)
    _, replay = graphed(model, xs)
    eager_guard.arm()
    with torch.no_grad():
        for _ in range(2):
            tt.deactivate(model)
            replays = replay.replays
            with eager_guard.expect(1):
                torch.testing.assert_close(model(xs[0]), expected)
            assert replay.replays == replays
            tt.activate(model)
            torch.testing.assert_close(model(xs[0]), expected, rtol=1e-5, atol=1e-6)
            assert replay.replays == replays + 1


def test_outputs_the_caller_holds_are_never_overwritten(eager_guard):
    model = cuda_mlp()
    xs = data(count=4)
    with torch.no_grad():
        expected = [model(x).clone() for x in xs]
    eager_guard.watch(model)
    graphed(model, xs)
    eager_guard.arm()
    with torch.no_grad():
        held = [model(x) for x in xs]          # all held at once
        views = [h[0] for h in held]
        again = [model(x) for x in reversed(xs)]
    torch.cuda.synchronize()
    for h, v, e in zip(held, views, expected):
        torch.testing.assert_close(h, e, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(v, e[0], rtol=1e-5, atol=1e-6)
    assert len({h.data_ptr() for h in held + again}) == len(held) + len(again)


def test_outputs_dropped_before_the_next_call_are_lent_without_a_copy(eager_guard):
    model = cuda_mlp()
    xs = data(count=4)
    with torch.no_grad():
        expected = [model(x).clone() for x in xs]
    eager_guard.watch(model)
    _, replay = graphed(model, xs)
    eager_guard.arm()
    lent, addresses = replay.lent, set()
    with torch.no_grad():
        for x, e in zip(xs, expected):
            y = model(x)
            torch.testing.assert_close(y, e, rtol=1e-5, atol=1e-6)
            addresses.add(y.data_ptr())
            del y
        assert replay.lent - lent == len(xs) and len(addresses) == 1  # one static output, lent each time
        first = model(xs[0])
        second = model(xs[1])  # first is held: this call copies
        assert second.data_ptr() != first.data_ptr() and replay.lent - lent == len(xs) + 1
        torch.cuda.synchronize()
        torch.testing.assert_close(first, expected[0], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(second, expected[1], rtol=1e-5, atol=1e-6)


class ReturnsItsInput(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(32, 32)

    def forward(self, x):
        return x, self.lin(x), self.lin.weight


def test_outputs_sharing_inputs_or_weights_are_copied_and_lend_outputs_false_copies_all(eager_guard):
    torch.manual_seed(0)
    model = ReturnsItsInput().cuda().eval()
    xs = data(count=2)
    eager_guard.watch(model)
    _, replay = graphed(model, xs)
    eager_guard.arm()
    lent = replay.lent  # tuning's own measurements lend too
    with torch.no_grad():
        x_out, y, w = model(xs[0])
        assert replay.lent == lent + 1 and torch.equal(x_out, xs[0]) and torch.equal(w, model.lin.weight)
        assert w.data_ptr() != model.lin.weight.data_ptr()  # a copy, not the weight itself
        held_x = x_out
        del x_out, y, w
        _, y2, _ = model(xs[1])  # the copied input output held: lending goes on
        assert replay.lent == lent + 2 and torch.equal(held_x, xs[0])
    eager_guard.disarm()
    tt.unwrap(model)
    plain = cuda_mlp()
    _, copying = graphed(plain, xs, strategy=tt.OneBackendStrategy(DeviceGraphBackend(lend_outputs=False)))
    with torch.no_grad():
        for x in xs + xs:
            plain(x)
    assert copying.lent == 0 and copying.replays >= 4


class Failing(nn.Module):
    """Synchronises inside forward: cannot be recorded in a graph."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(32, 32)

    def forward(self, x):
        y = self.lin(x)
        if y.sum().item() > 1e30:  # a host read: illegal while capturing
            y = y * 0
        return y


def test_a_failed_capture_is_handled_and_tweak_moves_on(eager_guard):
    torch.manual_seed(0)
    model = nn.Sequential(cuda_mlp(), Failing().cuda()).eval()
    xs = data()
    with torch.no_grad():
        expected = [model(x) for x in xs]
    # alone, the device graph fails with the capture's error and the module keeps its forward
    (wrapper,) = tt.wrap(model, ["1"], strategy=GRAPH)
    assert tt.tune(model, xs, measure=FAST) == {"1": None}
    assert "cannot be recorded in a device graph" in wrapper.tt_error, wrapper.tt_error
    tt.unwrap(model)
    # first-wins moves on to the next backend
    tt.wrap(model, ["1"], strategy=tt.FirstWinsStrategy([DeviceGraphBackend(), TorchEagerBackend()]))
    assert tt.tune(model, xs, measure=FAST) == {"1": "TorchEager"}
    tt.unwrap(model)
    # the device is fine afterwards: another module still records and replays
    eager_guard.watch(model[0])
    graphed(model, xs, "0")
    eager_guard.arm()
    with torch.no_grad():
        for x, e in zip(xs, expected):
            torch.testing.assert_close(model(x), e, rtol=1e-5, atol=1e-6)
    tt.unwrap(model)
    eager_guard.disarm()
    # and a whole tweak over both never crashes and stays right
    result = tt.tweak(model, xs, strategy=tt.HighestThroughputStrategy([DeviceGraphBackend(), TorchEagerBackend()]),
                      measure=FAST, progress=False)
    assert result.rows
    with torch.no_grad():
        for x, e in zip(xs, expected):
            torch.testing.assert_close(model(x), e, rtol=1e-5, atol=1e-6)


class KwModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(16, 16)
        self.b = nn.Linear(16, 16)

    def forward(self, pair, scale=1.0, mask=None):
        x, y = pair
        h = self.a(x) + self.b(y)
        if mask is not None:
            h = h * mask
        return {"out": h * scale, "parts": (x.sum(), None)}


def test_kwargs_tuple_items_dict_outputs_and_strided_inputs(eager_guard):
    torch.manual_seed(0)
    model = KwModel().cuda().eval()
    g = torch.Generator().manual_seed(2)

    def sample():
        x, y, m = (torch.randn(4, 16, generator=g).cuda() for _ in range(3))
        return ((x, y),), {"scale": 2.0, "mask": m}

    xs = [sample() for _ in range(3)]
    eager_guard.watch(model)
    graphed(model, xs)
    eager_guard.arm()
    (x, y), kw = xs[0][0][0], xs[0][1]
    strided = torch.randn(16, 4, device="cuda").t()
    with torch.no_grad():
        got = model((strided, y), mask=kw["mask"], scale=2.0)   # keywords in another order
        with eager_guard.expect(1):
            want = tt.installed(model)[""]._tt_original((strided, y), scale=2.0, mask=kw["mask"])
        with eager_guard.expect(1):
            model((x, y), scale=3.0, mask=kw["mask"])  # another plain value: falls back
    assert set(got) == {"out", "parts"} and got["parts"][1] is None
    torch.testing.assert_close(got["out"], want["out"], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got["parts"][0], want["parts"][0], rtol=1e-5, atol=1e-5)


def test_replay_on_another_stream_is_ordered(eager_guard):
    model = cuda_mlp()
    xs = data(count=2)
    with torch.no_grad():
        expected = [model(x) for x in xs]
    eager_guard.watch(model)
    _, replay = graphed(model, xs)
    eager_guard.arm()
    side = torch.cuda.Stream()
    with torch.no_grad():
        a = model(xs[0])
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            b = model(xs[1])
        torch.cuda.current_stream().wait_stream(side)
        c = model(xs[0])
    torch.cuda.synchronize()
    for got, want in ((a, expected[0]), (b, expected[1]), (c, expected[0])):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    assert replay.replays >= 3


def test_dynamic_samples_reject_the_graph_with_a_clear_error(monkeypatch):
    model = cuda_mlp()
    xs = [torch.randn(8, 32, device="cuda"), torch.randn(4, 32, device="cuda")]
    with pytest.raises(GraphUnsupported, match="dynamic shapes: argument 0 axis 0 varies"):
        DeviceGraphBackend().prepare(model, [((x,), {}) for x in xs], torch.device("cuda"))
    batches = range(1, tt.settings.MAX_SIGNATURES + 3)
    data = [torch.randn(b, 32, device="cuda") for b in batches]
    # through tune: the calls of one shape class are one group, whose varying batch rejects the graph
    (wrapper,) = tt.wrap(model, [""], strategy=GRAPH)
    assert tt.tune(model, data, measure=FAST) == {"": None}
    assert "dynamic shapes: argument 0 axis 0 varies" in wrapper.tt_error, wrapper.tt_error
    tt.unwrap(model)
    # one group per signature: each recorded signature gets its own graph; the calls beyond the
    # last signature share one group, whose varying batch rejects the graph
    monkeypatch.setattr(signatures, "MERGE_VARYING", False)
    (wrapper,) = tt.wrap(model, [""], strategy=GRAPH)
    assert tt.tune(model, data, measure=FAST) == {"": "DeviceGraph"}
    assert "dynamic shapes: argument 0 axis 0 varies" in wrapper.tt_error, wrapper.tt_error
    with torch.no_grad():
        for x in data:
            torch.testing.assert_close(model(x), wrapper._tt_original(x), rtol=1e-5, atol=1e-6)


def test_random_graphs_replay_through_torch_and_draw_new_numbers():
    drop = nn.Dropout(0.5).cuda().train()
    x = torch.ones(64, 64, device="cuda")
    replay = DeviceGraphBackend().prepare(drop, [((x,), {})], torch.device("cuda"))
    assert not replay.driver  # torch's replay advances the generator; a raw launch would not
    a, b = replay(x), replay(x)
    assert not torch.equal(a, b)


def test_shared_pool_and_inductor_in_a_graph(eager_guard):
    model = encoder.build("cuda")
    xs = encoder.samples("cuda", count=2)
    with torch.no_grad():
        expected = [model(x) for x in xs]
    strategy = tt.OneBackendStrategy(InductorGraphBackend(share_pool=True))
    for layer in model.layers[:2]:  # the others run their own forward, as they should
        eager_guard.watch(layer)
    tt.wrap(model, ["layers.0", "layers.1"], strategy=strategy)
    assert set(tt.tune(model, xs, measure=FAST).values()) == {"InductorGraph"}
    eager_guard.arm()
    with torch.no_grad():
        for x, e in zip(xs, expected):
            torch.testing.assert_close(model(x), e, rtol=1e-3, atol=1e-3)


def test_default_strategy_on_cuda_tries_the_device_graph_first():
    names = [b.name for b in tt.default_backends("cuda")]
    assert names[0] == "DeviceGraph" and names[-1] == "TorchEager"
    assert "TorchInductor" in names


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_tweak_of_the_encoder_with_graphs_is_right(dtype):
    model = encoder.build("cuda", dtype)
    xs = encoder.samples("cuda", dtype, count=2)
    with torch.no_grad():
        expected = [model(x) for x in xs]
    result = tt.tweak(model, xs, strategy=tt.HighestThroughputStrategy([DeviceGraphBackend(), TorchEagerBackend()]),
                      measure=FAST, progress=False)
    assert result.selected_depth is not None, str(result)
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    with torch.no_grad():
        for x, e in zip(xs, expected):
            torch.testing.assert_close(model(x), e, rtol=tol, atol=tol)
