"""_C.GraphReplay on the CPU: its callable mode (replay() instead of a CUDA launch),
driven by a fake graph that reads the static inputs and writes the static outputs
the way a recorded device graph does. The CUDA launch path is in tests/gpu."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch

from torch_tweak import _C


class FakeGraph:
    """Writes 2 * x + y into the static output, like a graph recorded on model(x, y=y)."""

    def __init__(self, x: torch.Tensor, y: torch.Tensor, out: torch.Tensor) -> None:
        self.x, self.y, self.out = x, y, out
        self.replays = 0

    def replay(self) -> None:
        self.replays += 1
        self.out.copy_(2 * self.x + self.y)


def eager(x, y):
    return 2 * x + y


class Original:
    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, x, y):
        self.calls += 1
        return eager(x, y)


def make(outputs=None, rebuild=None, original=None):
    x, y = torch.zeros(2, 3), torch.zeros(2, 3)
    out = torch.zeros(2, 3)
    graph = FakeGraph(x, y, out)
    sig = _C.Signature((x,), {"y": y})
    original = original if original is not None else Original()
    replay = _C.GraphReplay(0, 0, sig, [(0, -1, x), ("y", -1, y)], out if outputs is None else outputs,
                            original, rebuild=rebuild, replay=graph.replay, keep=graph)
    return replay, graph, original


def test_a_fitting_call_replays_and_returns_a_fresh_tensor():
    replay, graph, original = make()
    x, y = torch.randn(2, 3), torch.randn(2, 3)
    got = replay(x, y=y)
    assert torch.equal(got, eager(x, y))
    assert got is not graph.out and got.data_ptr() != graph.out.data_ptr()
    assert (replay.replays, replay.fallbacks, graph.replays, original.calls) == (1, 0, 1, 0)
    assert replay.driver is False
    assert replay.original is original


def test_a_later_call_never_overwrites_an_output_the_caller_holds():
    replay, _, _ = make()
    x1, x2, y = torch.randn(2, 3), torch.randn(2, 3), torch.randn(2, 3)
    first = replay(x1, y=y)
    view = first[0]
    kept = first.clone()
    second = replay(x2, y=y)
    assert torch.equal(first, kept) and torch.equal(view, kept[0])
    assert torch.equal(second, eager(x2, y))


@pytest.mark.parametrize("args,kwargs", [
    ((torch.randn(4, 3),), {"y": torch.randn(4, 3)}),        # another shape
    ((torch.randn(2, 3, dtype=torch.float64),), {"y": torch.randn(2, 3, dtype=torch.float64)}),
    ((torch.randn(2, 3), torch.randn(2, 3)), {}),            # y given by position
    ((torch.randn(2, 3),), {"y": 1.0}),                      # a value where a tensor was
])
def test_a_call_that_does_not_fit_runs_the_original(args, kwargs):
    replay, graph, original = make()
    got = replay(*args, **kwargs)
    assert torch.equal(got, eager(*args, **kwargs))
    assert (replay.replays, replay.fallbacks, graph.replays, original.calls) == (0, 1, 0, 1)


def test_keyword_order_does_not_matter_and_items_of_a_tuple_are_inputs():
    a, b = torch.zeros(3), torch.zeros(3)
    out = torch.zeros(3)

    def replay_fn():
        out.copy_(a - b)

    sig = _C.Signature(((a, b),), {"scale": 2})
    replay = _C.GraphReplay(0, 0, sig, [(0, 0, a), (0, 1, b)], out, lambda *a, **k: None,
                            replay=replay_fn)
    p, q = torch.randn(3), torch.randn(3)
    assert torch.equal(replay((p, q), scale=2), p - q)
    assert replay.replays == 1
    assert replay((p, q), scale=3) is None  # the original (here a lambda) ran
    assert replay.fallbacks == 1


def test_tuple_and_list_outputs_copy_tensors_and_keep_plain_values():
    for kind in (tuple, list):
        x, y = torch.zeros(2, 3), torch.zeros(2, 3)
        out = torch.zeros(2, 3)
        graph = FakeGraph(x, y, out)
        marker = object()
        static = kind([out, None, 7, marker])
        replay = _C.GraphReplay(0, 0, _C.Signature((x,), {"y": y}), [(0, -1, x), ("y", -1, y)],
                                static, Original(), replay=graph.replay)
        xs, ys = torch.randn(2, 3), torch.randn(2, 3)
        got = replay(xs, y=ys)
        assert type(got) is kind and len(got) == 4
        assert torch.equal(got[0], eager(xs, ys)) and got[0] is not out
        assert got[1] is None and got[2] == 7 and got[3] is marker
        static_after = replay(xs, y=ys)
        assert static_after is not got  # a new container each call


def test_rebuild_gets_the_copies_in_order():
    x, y = torch.zeros(2, 3), torch.zeros(2, 3)
    out = torch.zeros(2, 3)
    graph = FakeGraph(x, y, out)
    replay = _C.GraphReplay(0, 0, _C.Signature((x,), {"y": y}), [(0, -1, x), ("y", -1, y)],
                            [out, "label"], Original(),
                            rebuild=lambda leaves: {"hidden": leaves[0], "name": leaves[1]},
                            replay=graph.replay)
    xs, ys = torch.randn(2, 3), torch.randn(2, 3)
    got = replay(xs, y=ys)
    assert set(got) == {"hidden", "name"} and got["name"] == "label"
    assert torch.equal(got["hidden"], eager(xs, ys)) and got["hidden"] is not out


def test_a_strided_input_is_laid_out_by_copy():
    replay, _, _ = make()
    x = torch.randn(3, 2).t()  # shape (2, 3), not contiguous
    y = torch.randn(2, 3)
    assert not x.is_contiguous()
    assert torch.equal(replay(x, y=y), eager(x, y))
    assert replay.replays == 1


def test_an_error_in_replay_propagates_and_the_next_call_works():
    replay, graph, _ = make()
    calls = {"n": 0}
    real = graph.replay

    def flaky():
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError("device lost")
        real()

    replay2 = _C.GraphReplay(0, 0, replay.signature, [(0, -1, graph.x), ("y", -1, graph.y)], graph.out,
                             Original(), replay=flaky)
    x, y = torch.randn(2, 3), torch.randn(2, 3)
    with pytest.raises(RuntimeError, match="device lost"):
        replay2(x, y=y)
    assert torch.equal(replay2(x, y=y), eager(x, y))
    assert replay2.replays == 1


def test_a_call_made_during_a_replay_runs_the_original():
    holder = {}
    x, y = torch.zeros(2, 3), torch.zeros(2, 3)
    out = torch.zeros(2, 3)
    graph = FakeGraph(x, y, out)
    original = Original()

    def reentrant():
        holder["inner"] = holder["replay"](torch.ones(2, 3), y=torch.ones(2, 3))
        graph.replay()

    replay = _C.GraphReplay(0, 0, _C.Signature((x,), {"y": y}), [(0, -1, x), ("y", -1, y)], out,
                            original, replay=reentrant)
    holder["replay"] = replay
    xs, ys = torch.randn(2, 3), torch.randn(2, 3)
    assert torch.equal(replay(xs, y=ys), eager(xs, ys))
    assert torch.equal(holder["inner"], torch.full((2, 3), 3.0))
    assert (replay.replays, replay.fallbacks, original.calls) == (1, 1, 1)
    holder.clear()


@pytest.mark.slow
def test_keep_lives_as_long_as_the_replay_and_cycles_are_collected():
    class Keep:
        pass

    keep = Keep()
    ref = weakref.ref(keep)
    x = torch.zeros(2)
    out = torch.zeros(2)
    box = []
    replay = _C.GraphReplay(0, 0, _C.Signature((x,), {}), [(0, -1, x)], out, lambda *a: box,
                            replay=lambda: None, keep=keep)
    box.append(replay)  # a cycle through the original
    del keep
    gc.collect()
    assert ref() is not None
    del replay, box
    gc.collect()
    assert ref() is None


def test_bad_arguments_are_named():
    x = torch.zeros(2)
    sig = _C.Signature((x,), {})
    with pytest.raises(ValueError, match="either an exec handle"):
        _C.GraphReplay(0, 0, sig, [(0, -1, x)], x, print)
    with pytest.raises(ValueError, match="either an exec handle"):
        _C.GraphReplay(5, 0, sig, [(0, -1, x)], x, print, replay=print)
    with pytest.raises(TypeError, match="signature must be a Signature"):
        _C.GraphReplay(0, 0, "sig", [(0, -1, x)], x, print, replay=print)
    with pytest.raises(TypeError, match="original must be callable"):
        _C.GraphReplay(0, 0, sig, [(0, -1, x)], x, 3, replay=print)
    with pytest.raises(TypeError, match="input 0 must be a"):
        _C.GraphReplay(0, 0, sig, [x], x, print, replay=print)
    with pytest.raises(TypeError, match="input 0's buffer must be a tensor"):
        _C.GraphReplay(0, 0, sig, [(0, -1, 3)], x, print, replay=print)
    with pytest.raises(ValueError, match="negative position"):
        _C.GraphReplay(0, 0, sig, [(-1, -1, x)], x, print, replay=print)
    with pytest.raises(TypeError, match="outputs must be a tensor"):
        _C.GraphReplay(0, 0, sig, [(0, -1, x)], {"a": x}, print, replay=print)
    with pytest.raises(TypeError, match="with rebuild, outputs must be a list"):
        _C.GraphReplay(0, 0, sig, [(0, -1, x)], (x,), print, replay=print, rebuild=list)


def test_driver_error_says_why_or_none():
    why = _C.GraphReplay.driver_error()
    assert why is None or "CUDA driver" in why
    if why is not None:
        x = torch.zeros(2)
        with pytest.raises(RuntimeError, match="CUDA driver"):
            _C.GraphReplay(1234, 0, _C.Signature((x,), {}), [(0, -1, x)], x, print)


# ------------------------------------------------ a lending second recording


def make_lending(outputs2=None, lend=None, rebuild=None):
    """Two fake recordings of 2 * x + y on the same static inputs; the second one lends."""
    from torch_tweak.backends.graph import lend_specs

    x, y = torch.zeros(2, 3), torch.zeros(2, 3)
    out1, out2 = torch.zeros(2, 3), torch.zeros(2, 3)
    first, second = FakeGraph(x, y, out1), FakeGraph(x, y, out2)
    outputs2 = out2 if outputs2 is None else outputs2(out2, x)
    lend = lend_specs(outputs2 if rebuild is None else list(outputs2), [x, y]) if lend is None else lend
    outputs1 = out1 if isinstance(outputs2, torch.Tensor) else type(outputs2)(
        out1 if v is out2 else v for v in outputs2)
    replay = _C.GraphReplay(0, 0, _C.Signature((x,), {"y": y}), [(0, -1, x), ("y", -1, y)], outputs1,
                            Original(), replay=first.replay, rebuild=rebuild,
                            lent=(0, second.replay, outputs2, lend))
    return replay, first, second


def test_a_free_lending_recording_returns_its_outputs_without_a_copy():
    replay, first, second = make_lending()
    for n in range(1, 4):
        x, y = torch.randn(2, 3), torch.randn(2, 3)
        got = replay(x, y=y)
        assert torch.equal(got, eager(x, y))
        assert got.data_ptr() == second.out.data_ptr() and got is not second.out
        del got
        assert (replay.replays, replay.lent, first.replays, second.replays) == (n, n, 0, n)


@pytest.mark.parametrize("hold", ["tensor", "view", "detached", "strided"])
def test_while_a_lent_output_is_held_the_copying_recording_runs(hold):
    replay, first, second = make_lending()
    x1, x2, x3, y = torch.randn(2, 3), torch.randn(2, 3), torch.randn(2, 3), torch.randn(2, 3)
    lent = replay(x1, y=y)
    held = {"tensor": lambda t: t, "view": lambda t: t[1], "detached": lambda t: t.detach(),
            "strided": lambda t: t.as_strided((3,), (2,), 1)}[hold](lent)
    kept = lent.clone()
    del lent
    second_call = replay(x2, y=y)
    assert second_call.data_ptr() not in (second.out.data_ptr(), first.out.data_ptr())
    assert torch.equal(second_call, eager(x2, y))
    assert torch.equal(second.out, kept)  # what the caller holds was not overwritten
    assert (replay.lent, first.replays, second.replays) == (1, 1, 1)
    del held
    third = replay(x3, y=y)
    assert third.data_ptr() == second.out.data_ptr() and torch.equal(third, eager(x3, y))
    assert (replay.lent, first.replays, second.replays) == (2, 1, 2)


def test_outputs_sharing_an_input_are_copied_and_the_rest_lent():
    replay, first, second = make_lending(outputs2=lambda out, x: (out, x, 7))
    x, y = torch.randn(2, 3), torch.randn(2, 3)
    got = replay(x, y=y)
    assert got[0].data_ptr() == second.out.data_ptr()
    assert torch.equal(got[1], x) and got[1].data_ptr() != first.x.data_ptr()
    assert got[2] == 7
    held = got[1]
    del got
    assert replay(x, y=y)[0].data_ptr() == second.out.data_ptr()  # the copied input holds nothing
    del held


def test_two_outputs_on_one_storage_are_lent_together():
    replay, first, second = make_lending(outputs2=lambda out, x: [out, out[0]])
    x, y = torch.randn(2, 3), torch.randn(2, 3)
    got = replay(x, y=y)
    assert got[0].data_ptr() == second.out.data_ptr() and torch.equal(got[1], eager(x, y)[0])
    row = got[1]
    del got
    again = replay(x, y=y)
    assert again[0].data_ptr() != second.out.data_ptr()  # the row held keeps the storage in use
    del row, again
    assert replay(x, y=y)[0].data_ptr() == second.out.data_ptr()


def test_lent_outputs_pass_through_rebuild():
    replay, _, second = make_lending(outputs2=lambda out, x: [out, "tag"],
                                     rebuild=lambda leaves: {"h": leaves[0], "tag": leaves[1]})
    x, y = torch.randn(2, 3), torch.randn(2, 3)
    got = replay(x, y=y)
    assert got["tag"] == "tag" and got["h"].data_ptr() == second.out.data_ptr()
    assert torch.equal(got["h"], eager(x, y))


def test_a_storage_someone_else_holds_at_construction_is_never_lent():
    from torch_tweak.backends.graph import lend_specs

    x, y = torch.zeros(2, 3), torch.zeros(2, 3)
    out1, out2 = torch.zeros(2, 3), torch.zeros(2, 3)
    first, second = FakeGraph(x, y, out1), FakeGraph(x, y, out2)
    outside = out2.view(6)  # a module attribute, say, that lend_specs cannot see
    lend = lend_specs(out2, [x, y])
    replay = _C.GraphReplay(0, 0, _C.Signature((x,), {"y": y}), [(0, -1, x), ("y", -1, y)], out1,
                            Original(), replay=first.replay, lent=(0, second.replay, out2, lend))
    del outside  # the count it raised is gone, but the leaf was already marked copied
    for _ in range(2):
        got = replay(torch.randn(2, 3), y=torch.randn(2, 3))
        assert got.data_ptr() != out2.data_ptr()
    assert replay.lent == 0


def test_lend_specs_copy_what_shares_memory_with_held_tensors():
    from torch_tweak.backends.graph import lend_specs

    weight, buffer, fresh = torch.zeros(3), torch.zeros(4), torch.zeros(5)
    specs = lend_specs([weight.view(1, 3), buffer, fresh, fresh[1:], None, 2.0], [weight, buffer])
    assert specs[0] is None and specs[1] is None and specs[4] is None and specs[5] is None
    storage, address, uses = specs[2]
    assert address == fresh.untyped_storage()._cdata and specs[3][1] == address
    assert uses == 3 and specs[3][0] is storage  # two tensors on it, plus the storage object
    assert lend_specs(fresh, [])[0][2] == 2


def test_bad_lent_arguments_are_named():
    x = torch.zeros(2)
    sig = _C.Signature((x,), {})
    args = (0, 0, sig, [(0, -1, x)], x, print)
    with pytest.raises(TypeError, match="lent must be an"):
        _C.GraphReplay(*args, replay=print, lent=(0, print, x))
    with pytest.raises(ValueError, match="launched like the first"):
        _C.GraphReplay(*args, replay=print, lent=(7, None, x, [None]))
    with pytest.raises(ValueError, match="same structure"):
        _C.GraphReplay(*args, replay=print, lent=(0, print, (x, x), [None, None]))
    with pytest.raises(ValueError, match="one item per output"):
        _C.GraphReplay(*args, replay=print, lent=(0, print, x, []))
    with pytest.raises(ValueError, match="lend item 0"):
        _C.GraphReplay(*args, replay=print, lent=(0, print, x, [(1, 2)]))


def test_on_fallback_is_called_once_at_the_next_fallback():
    replay, _, _ = make()
    seen = []
    replay.on_fallback = lambda: seen.append(replay.fallbacks)
    replay(torch.randn(5), y=torch.randn(5))
    replay(torch.randn(5), y=torch.randn(5))
    assert seen == [1] and replay.on_fallback is None
    with pytest.raises(TypeError):
        replay.on_fallback = 3


# ------------------------------------- foreign addresses: refused, never a crash
# torch._C._storage_Use_Count reads whatever address it is given, so before these checks a
# lend item's bogus address was a segfault; each case runs in a child interpreter.

_LEND_PRELUDE = """
import pytest
import torch
from torch_tweak import _C
x, out1, out2 = torch.zeros(2), torch.zeros(2), torch.zeros(2)
args = (0, 0, _C.Signature((x,), {}), [(0, -1, x)], out1, print)
def make(spec):
    return _C.GraphReplay(*args, replay=print, lent=(0, print, out2, [spec]))
"""

_FOREIGN_LENDS = {
    "a-bogus-address": """
with pytest.raises(ValueError, match="lend item 0 .*its address is not that storage's _cdata"):
    make((out2.untyped_storage(), 12345, 2))
""",
    "another-storage's-address": """
with pytest.raises(ValueError, match="its address is not that storage's _cdata"):
    make((out2.untyped_storage(), x.untyped_storage()._cdata, 2))
""",
    "a-storage-that-is-not-the-output's": """
other = torch.zeros(2).untyped_storage()
with pytest.raises(ValueError, match="the storage is not the output's own"):
    make((other, other._cdata, 2))
""",
    "not-a-storage": """
for fake in (None, 12345, "storage", out2):
    with pytest.raises(ValueError, match="its storage is not a torch storage"):
        make((fake, out2.untyped_storage()._cdata, 2))
""",
    "an-address-that-only-compares-equal": """
class Address(int):
    pass
storage = out2.untyped_storage()
with pytest.raises(ValueError, match="its address is not"):
    make((storage, Address(storage._cdata), 2))
""",
}


@pytest.mark.parametrize("name", sorted(_FOREIGN_LENDS))
@pytest.mark.slow
def test_a_lend_item_naming_memory_not_the_outputs_own_is_refused(name):
    from support import run_in_child

    run_in_child(_LEND_PRELUDE + _FOREIGN_LENDS[name])


@pytest.mark.slow
def test_an_original_that_leads_back_is_a_recursion_error_not_a_crash():
    from support import run_in_child

    run_in_child("""
import pytest
import torch
from torch_tweak import _C
x = torch.zeros(2)
d = _C.Dispatcher()
g = _C.GraphReplay(0, 0, _C.Signature((x,), {}), [(0, -1, x)], x, d, replay=print)
d._tt_bind(g)  # a GraphReplay is not a Dispatcher link: only the call can stop this
with pytest.raises(RecursionError):
    g("does not fit")
""")


def test_an_input_item_below_minus_one_is_refused():
    x = torch.zeros(2)
    with pytest.raises(ValueError, match="input 0's item must be an index >= 0, or -1"):
        _C.GraphReplay(0, 0, _C.Signature(((x,),), {}), [(0, -7, x)], x, print, replay=print)


def test_threads_whose_match_runs_python_never_share_the_static_buffers():
    """Found by an attack: the busy flag was tested before the signature match and set after
    it, and a match that runs Python (a plain argument's __eq__, here one that yields the
    interpreter) let another thread through between the two: both wrote the static input and
    one got the other's result. Eight threads, each result against the original's."""
    import sys
    import threading
    import time

    class Config:
        def __eq__(self, other):
            time.sleep(0)  # lets another thread in, as any Python in a match can
            return type(other) is Config

        __hash__ = object.__hash__

    static_in, static_out = torch.zeros(16), torch.zeros(16)

    def original(x, config):
        return x * 2

    replay = _C.GraphReplay(0, 0, _C.Signature((static_in, Config()), {}), [(0, -1, static_in)], static_out,
                            original, replay=lambda: torch.mul(static_in, 2, out=static_out))
    wrong = []

    def work(k):
        for i in range(300):
            x = torch.full((16,), float(k * 1000 + i))
            if not torch.equal(replay(x, Config()), original(x, None)):
                wrong.append((k, i))

    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-5)
    try:
        threads = [threading.Thread(target=work, args=(k,)) for k in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        sys.setswitchinterval(interval)
    assert not wrong, wrong[:5]
    assert replay.replays > 0 and replay.replays + replay.fallbacks == 8 * 300
