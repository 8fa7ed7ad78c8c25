"""torch_tweak._C.Dispatcher and Signature: the per-call path of a tuned module."""

from __future__ import annotations

import gc
import sys
import weakref

import pytest
import torch
from torch import nn

from torch_tweak import _C

VECTORCALL_FLAG = 1 << 11  # Py_TPFLAGS_HAVE_VECTORCALL


class Wrapped(_C.Dispatcher, nn.Module):
    """Shaped like torch_tweak.TunedModule: Dispatcher first in the MRO."""

    def __init__(self, module: nn.Module) -> None:
        nn.Module.__init__(self)
        self.inner = module  # a registered child: state_dict, .to(), named_modules see it
        self._tt_bind(module)
        _C.enable_vectorcall(type(self))


def sig(*args, dynamic=None, **kwargs):
    return _C.Signature(args, kwargs, dynamic)


def counting(result="backend"):
    calls = []

    def backend(*args, **kwargs):
        calls.append((args, kwargs))
        return result

    return backend, calls


# ----------------------------------------------------------- nn.Module subclass


def test_subclass_is_a_working_nn_module():
    lin = nn.Linear(4, 3)
    w = Wrapped(lin)
    assert set(w.state_dict()) == {"inner.weight", "inner.bias"}
    assert [name for name, _ in w.named_modules()] == ["", "inner"]
    w.to(torch.float64)
    assert lin.weight.dtype is torch.float64
    assert w._tt_original is lin
    x = torch.randn(2, 4, dtype=torch.float64)
    assert torch.equal(w(x), lin(x))


def test_dispatcher_call_wins_the_mro_over_nn_module_call():
    assert Wrapped.__call__ is _C.Dispatcher.__call__
    w = Wrapped(nn.Identity())
    hooked = []
    w.register_forward_pre_hook(lambda *a: hooked.append(a))
    backend, calls = counting()
    w._tt_set_entries([(None, backend)])
    w._tt_mode = 1
    assert w(torch.ones(1)) == "backend"
    assert len(calls) == 1 and w._tt_calls == 1
    assert hooked == []  # nn.Module.__call__ (which runs hooks) never ran


def test_vectorcall_flag_is_set_on_the_subclass():
    assert _C.Dispatcher.__flags__ & VECTORCALL_FLAG
    assert Wrapped.__flags__ & VECTORCALL_FLAG
    assert _C.enable_vectorcall(Wrapped) is True


def test_enable_vectorcall_refuses_a_subclass_with_its_own_call():
    class Own(_C.Dispatcher):
        def __call__(self, *args):
            return "own"

    assert _C.enable_vectorcall(Own) is False
    assert not Own.__flags__ & VECTORCALL_FLAG
    assert Own()(1) == "own"
    with pytest.raises(TypeError):
        _C.enable_vectorcall(nn.Module)
    with pytest.raises(TypeError):
        _C.enable_vectorcall(3)


def test_attributes_through_nn_module_setattr():
    w = Wrapped(nn.Identity())
    w._tt_mode = 2
    assert w._tt_mode == 2 and "_tt_mode" not in w.__dict__
    with pytest.raises(ValueError, match="_tt_mode"):
        w._tt_mode = 3
    bound = w._tt_original
    with pytest.raises(AttributeError):
        w._tt_original = print  # not a Module: object.__setattr__ meets the read-only getset
    # a Module goes to nn.Module's child registry, which is why _tt_bind exists
    w._tt_original = nn.ReLU()
    assert w._tt_original is bound and isinstance(w._modules["_tt_original"], nn.ReLU)
    with pytest.raises(AttributeError):
        w._tt_calls = 5


def test_unbound_dispatcher_says_so():
    d = _C.Dispatcher()
    assert d._tt_original is None
    with pytest.raises(RuntimeError, match="_tt_bind"):
        d(1)
    with pytest.raises(TypeError):
        d._tt_bind(42)


# ------------------------------------------------------------------------ modes


def test_mode_0_calls_the_original_with_args_and_kwargs():
    original, calls = counting("original")
    backend, bcalls = counting()
    d = _C.Dispatcher()
    d._tt_bind(original)
    d._tt_set_entries([(None, backend)])
    assert d(1, 2, key="v") == "original"
    assert calls == [((1, 2), {"key": "v"})] and bcalls == []
    assert d._tt_calls == 1 and d._tt_fallbacks == 0


def test_mode_1_with_a_catch_all_entry_calls_the_backend():
    original, calls = counting("original")
    backend, bcalls = counting()
    d = _C.Dispatcher()
    d._tt_bind(original)
    d._tt_set_entries([(None, backend)])
    d._tt_mode = 1
    assert d(torch.ones(2), flag=True) == "backend"
    assert calls == [] and len(bcalls) == 1 and bcalls[0][1] == {"flag": True}


def test_mode_1_without_entries_falls_back():
    original, calls = counting("original")
    d = _C.Dispatcher()
    d._tt_bind(original)
    d._tt_mode = 1
    assert d(1) == "original"
    assert d._tt_fallbacks == 1 and d._tt_calls == 1


def test_mode_2_calls_the_recorder():
    original, calls = counting("original")
    recorder, rcalls = counting("recorded")
    d = _C.Dispatcher()
    d._tt_bind(original)
    d._tt_mode = 2
    with pytest.raises(RuntimeError, match="recorder"):
        d(1)
    d._tt_set_recorder(recorder)
    assert d(1, a=2) == "recorded"
    assert rcalls == [((1,), {"a": 2})] and calls == []
    d._tt_set_recorder(None)
    with pytest.raises(RuntimeError, match="recorder"):
        d(1)
    with pytest.raises(TypeError):
        d._tt_set_recorder(5)


def test_entries_are_validated_and_read_back():
    d = _C.Dispatcher()
    s = sig(torch.ones(2))
    backend, _ = counting()
    d._tt_set_entries([(s, backend), (None, backend)])
    entries = d._tt_entries
    assert entries == [(s, backend), (None, backend)]
    with pytest.raises(TypeError, match="Signature"):
        d._tt_set_entries([("nope", backend)])
    with pytest.raises(TypeError, match="callable"):
        d._tt_set_entries([(None, 3)])
    with pytest.raises(TypeError):
        d._tt_set_entries([(None,)])
    assert d._tt_entries == entries  # a failed set leaves the entries as they were


# -------------------------------------------------------------------- signature


def active(entries, original=None):
    if original is None:
        original, _ = counting("original")
    d = _C.Dispatcher()
    d._tt_bind(original)
    d._tt_set_entries(entries)
    d._tt_mode = 1
    return d


def test_signature_shape_dtype_and_count():
    x = torch.ones(2, 3)
    backend, _ = counting()
    d = active([(sig(x), backend)])
    assert d(torch.zeros(2, 3)) == "backend"
    assert d(torch.zeros(2, 4)) == "original"          # shape
    assert d(torch.zeros(2, 3, 1)) == "original"       # rank
    assert d(torch.zeros(2, 3, dtype=torch.float64)) == "original"  # dtype
    assert d(torch.zeros(2, 3), torch.zeros(2, 3)) == "original"    # argument count
    assert d() == "original"
    assert d(x.tolist()) == "original"                 # not a tensor
    assert d._tt_calls == 7 and d._tt_fallbacks == 6


def test_signature_device():
    backend, _ = counting()
    d = active([(sig(torch.ones(2)), backend)])
    assert d(torch.empty(2, device="meta")) == "original"
    assert d(torch.empty(2)) == "backend"


def test_signature_device_type_both_ways():
    backend, _ = counting()
    d = active([(sig(torch.empty(2, device="meta")), backend)])
    assert d(torch.ones(2)) == "original"
    assert d(torch.empty(2, device="meta")) == "backend"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_signature_device_index_on_cuda():
    backend, _ = counting()
    d = active([(sig(torch.ones(2, device="cuda:0")), backend)])
    assert d(torch.zeros(2, device="cuda:0")) == "backend"
    assert d(torch.zeros(2)) == "original"
    assert _C.Signature((torch.ones(2, device="cuda"),), {}).matches((torch.ones(2, device="cuda:0"),), {})
    if torch.cuda.device_count() > 1:
        assert d(torch.zeros(2, device="cuda:1")) == "original"


def test_signature_keyword_names_match_as_a_set():
    backend, _ = counting()
    d = active([(sig(torch.ones(2), mask=torch.ones(2, dtype=torch.bool), scale=2), backend)])
    m = torch.zeros(2, dtype=torch.bool)
    assert d(torch.ones(2), mask=m, scale=2) == "backend"
    assert d(torch.ones(2), scale=2, mask=m) == "backend"
    assert d(torch.ones(2), mask=m) == "original"             # one missing
    assert d(torch.ones(2), mask=m, scale=2, extra=1) == "original"
    assert d(torch.ones(2), mask=m, scales=2) == "original"   # another name
    assert d(torch.ones(2), m, scale=2) == "original"         # positional instead
    assert d(torch.ones(2), mask=m, scale=3) == "original"    # another value


def test_signature_plain_values_need_the_same_type():
    backend, _ = counting()
    d = active([(sig(torch.ones(1), 1, "relu", None), backend)])
    t = torch.ones(1)
    assert d(t, 1, "relu", None) == "backend"
    assert d(t, 2, "relu", None) == "original"
    assert d(t, True, "relu", None) == "original"
    assert d(t, 1.0, "relu", None) == "original"
    assert d(t, 1, "gelu", None) == "original"
    assert d(t, 1, "relu", 0) == "original"


def test_signature_follows_tuples_and_lists_one_level():
    backend, _ = counting()
    d = active([(sig((torch.ones(2), 3), [torch.ones(1)]), backend)])
    assert d((torch.zeros(2), 3), [torch.zeros(1)]) == "backend"
    assert d((torch.zeros(3), 3), [torch.zeros(1)]) == "original"
    assert d((torch.zeros(2), 4), [torch.zeros(1)]) == "original"
    assert d([torch.zeros(2), 3], [torch.zeros(1)]) == "original"   # list, not tuple
    assert d((torch.zeros(2), 3, 4), [torch.zeros(1)]) == "original"
    assert d((torch.zeros(2), 3), [torch.zeros(1, dtype=torch.int64)]) == "original"


def test_signature_dynamic_axes():
    backend, _ = counting()
    s = sig(torch.ones(4, 8), (torch.ones(4, 2),), dynamic=[[0], [-2]])
    d = active([(s, backend)])
    assert d(torch.ones(1, 8), (torch.ones(7, 2),)) == "backend"
    assert d(torch.ones(100, 8), (torch.ones(4, 2),)) == "backend"
    assert d(torch.ones(4, 9), (torch.ones(4, 2),)) == "original"
    assert d(torch.ones(4, 8), (torch.ones(4, 3),)) == "original"
    assert d(torch.ones(4), (torch.ones(4, 2),)) == "original"


def test_signature_dynamic_keyword_axis():
    s = _C.Signature((torch.ones(2),), {"mask": torch.ones(2, 5)}, [None, [1]])
    assert s.matches((torch.ones(2),), {"mask": torch.ones(2, 9)})
    assert not s.matches((torch.ones(2),), {"mask": torch.ones(3, 9)})
    assert not s.matches((torch.ones(3),), {"mask": torch.ones(2, 5)})


def test_signature_construction_errors():
    with pytest.raises(ValueError, match="out of range"):
        sig(torch.ones(2, 3), dynamic=[[2]])
    with pytest.raises(ValueError, match="not a tensor"):
        sig(3, dynamic=[[0]])
    with pytest.raises(ValueError, match="entries"):
        sig(torch.ones(2), dynamic=[[0], [0]])
    with pytest.raises(TypeError):
        _C.Signature([1], {})
    with pytest.raises(TypeError):
        _C.Signature((1,), [])


def test_signature_matches_uses_the_dict_api():
    s = sig(torch.ones(2), 5, k="x")
    assert s.matches((torch.zeros(2), 5), {"k": "x"}) is True
    assert s.matches((torch.zeros(2), 5), {"k": "y"}) is False
    assert s.matches((torch.zeros(2), 5), {}) is False
    assert sig().matches((), {}) is True
    assert sig().matches((), None) is True
    assert "nargs=3" not in repr(s) and "nargs=2" in repr(s)


def test_a_comparison_that_raises_is_a_mismatch():
    class Touchy:
        def __eq__(self, other):
            raise ValueError("no comparing")

        __hash__ = object.__hash__

    a = Touchy()
    backend, _ = counting()
    d = active([(sig(a), backend)])
    assert d(a) == "backend"          # identity first, no __eq__
    assert d(Touchy()) == "original"  # __eq__ raised: a mismatch, not an error
    assert d._tt_fallbacks == 1


def test_a_base_exception_from_matching_propagates():
    class Stop:
        def __eq__(self, other):
            raise KeyboardInterrupt

        __hash__ = object.__hash__

    d = active([(sig(Stop()), counting()[0])])
    with pytest.raises(KeyboardInterrupt):
        d(Stop())


# ---------------------------------------------------- entry order and the cache


def test_first_match_wins_even_after_the_cache_saw_a_later_entry():
    a, acalls = counting("a")
    b, bcalls = counting("b")
    d = active([(sig(torch.ones(2)), a), (None, b)])
    assert d(torch.ones(2)) == "a"
    assert d(torch.ones(3)) == "b"   # caches entry 1, which matches everything
    assert d(torch.ones(2)) == "a"   # still the first matching entry
    assert d._tt_fallbacks == 0


def test_disjoint_entries_alternate():
    a, _ = counting("a")
    b, _ = counting("b")
    d = active([(sig(torch.ones(4)), a), (sig(torch.ones(8)), b)])
    for _ in range(3):
        assert d(torch.ones(8)) == "b"
        assert d(torch.ones(4)) == "a"
    assert d(torch.ones(5)) == "original"
    assert d._tt_fallbacks == 1


def test_overlapping_dynamic_entries_keep_first_match():
    a, _ = counting("a")
    b, _ = counting("b")
    wide = sig(torch.ones(4, 8), dynamic=[[0]])
    narrow = sig(torch.ones(2, 8))
    d = active([(narrow, a), (wide, b)])
    assert d(torch.ones(3, 8)) == "b"
    assert d(torch.ones(2, 8)) == "a"  # the narrow entry is first, though b matched last


def test_a_backend_may_replace_the_entries_during_its_call():
    d = _C.Dispatcher()
    d._tt_bind(lambda *a: "original")
    second, _ = counting("second")

    def first(x):
        d._tt_set_entries([(None, second)])
        return "first"

    d._tt_set_entries([(None, first)])
    d._tt_mode = 1
    assert d(1) == "first"
    assert d(1) == "second"


# ----------------------------------------------------- errors and reference counts


def test_exceptions_from_the_backend_propagate_unchanged():
    error = ValueError("backend broke")

    def backend(x):
        raise error

    d = active([(None, backend)])
    with pytest.raises(ValueError) as info:
        d(1)
    assert info.value is error
    d._tt_set_entries([(None, lambda x: (_ for _ in ()).throw(KeyboardInterrupt()))])
    with pytest.raises(KeyboardInterrupt):
        d(1)


def test_reference_counts_do_not_move():
    x = torch.ones(2, 3)
    mask = torch.ones(3)
    value = object()
    backend = lambda *a, **k: None  # noqa: E731
    original = lambda *a, **k: None  # noqa: E731
    recorder = lambda *a, **k: None  # noqa: E731
    s = sig(x, value, mask=mask)
    d = active([(s, backend)], original)
    d._tt_set_recorder(recorder)
    watched = [x, mask, value, backend, original, recorder, s, torch.float32]

    def counts():
        return [sys.getrefcount(o) for o in watched]

    for mode in (0, 1, 2):
        d._tt_mode = mode
        d(x, value, mask=mask)
        before = counts()
        for _ in range(2000):
            d(x, value, mask=mask)      # a match (mode 1)
            d(x, 7, mask=mask)          # a fallback (mode 1)
            d(x, value, maks=mask)
        assert counts() == before, f"mode {mode}"
    assert d._tt_calls == 3 * 6001
    assert d._tt_fallbacks == 2 * 2000  # two of the three calls in mode 1


@pytest.mark.slow
def test_cycles_through_the_original_are_collected():
    class Holder(nn.Module):
        pass

    inner = Holder()
    w = Wrapped(inner)
    inner.back = [w]  # a cycle: w -> inner -> w, also through the dispatcher's own slot
    w._tt_set_entries([(None, inner)])
    w._tt_set_recorder(inner)
    ref = weakref.ref(w)
    del w, inner
    gc.collect()
    assert ref() is None


def test_signature_values_take_part_in_gc():
    class Node:
        pass

    node = Node()
    node.sig = sig(node)
    ref = weakref.ref(node)
    del node
    gc.collect()
    assert ref() is None


# ------------------------------------------------- binding by name (issue 12)


def laid_out(*args, **kwargs):
    """A backend that returns the layout it was called with."""
    return len(args), tuple(kwargs), args + tuple(kwargs.values())


def bound_dispatcher(signature, backend=laid_out, flags=0, original=None):
    d = _C.Dispatcher()
    d._tt_bind(original or (lambda *a, **k: "original"))
    d._tt_set_entries([(signature, backend, flags)])
    d._tt_mode = 1
    return d


def test_a_call_is_laid_out_as_recorded_whatever_the_callers_order():
    a, b = torch.randn(2), torch.randn(3)
    d = bound_dispatcher(_C.Signature((), {"a": a, "b": b}, None, ("a", "b")))
    for call in (lambda: d(a=a, b=b), lambda: d(b=b, a=a), lambda: d(a, b), lambda: d(a, b=b)):
        n, names, values = call()
        assert (n, names) == (0, ("a", "b"))
        assert values[0] is a and values[1] is b
    assert d._tt_fallbacks == 0
    assert d(b, a=a) == "original"  # b by position is the parameter a: given twice
    assert d._tt_fallbacks == 1


def test_positional_recording_takes_keywords_by_parameter_name():
    x, mask = torch.randn(2, 4), torch.ones(2, 4, dtype=torch.int64)
    d = bound_dispatcher(_C.Signature((x, mask), {}, None, ("input_ids", "attention_mask")))
    for call in (lambda: d(x, mask), lambda: d(x, attention_mask=mask),
                 lambda: d(attention_mask=mask, input_ids=x)):
        n, names, values = call()
        assert (n, names) == (2, ())
        assert values[0] is x and values[1] is mask
    assert d(mask, x) == "original"  # values checked after binding: dtype differs


def test_without_params_only_keyword_order_is_bound():
    a, b = torch.randn(2), torch.randn(2)
    d = bound_dispatcher(_C.Signature((), {"a": a, "b": b}))
    assert d(b=b, a=a)[1] == ("a", "b")
    assert d(a, b) == "original"


def test_positional_only_parameters_are_never_bound_by_keyword():
    a = torch.randn(2)
    d = bound_dispatcher(_C.Signature((a,), {}, None, (None,)))
    assert d(a)[0] == 1
    assert d(x=a) == "original"


def test_a_long_call_is_bound_on_the_heap():
    values = [torch.randn(1) for _ in range(40)]
    names = tuple(f"p{i}" for i in range(40))
    sig = _C.Signature((), dict(zip(names, values)), None, names)
    d = bound_dispatcher(sig)
    n, got, passed = d(*values[:3], **dict(reversed(list(zip(names[3:], values[3:])))))
    assert n == 0 and got == names and all(p is v for p, v in zip(passed, values))


def test_signature_bind_and_params():
    a, b = torch.randn(2), torch.randn(2)
    sig = _C.Signature((a,), {"b": b}, None, ["a", "b"])
    assert sig.params == ("a", "b")
    args, kwargs = sig.bind((), {"b": b, "a": a})
    assert args[0] is a and list(kwargs) == ["b"] and kwargs["b"] is b
    assert sig.bind((a, b, b), {}) is None
    assert sig.matches((a, b), {}) and not sig.matches((a,), {"c": b})
    with pytest.raises(ValueError, match="both by position and by keyword"):
        _C.Signature((a,), {"a": b}, None, ("a",))
    with pytest.raises(ValueError, match="named twice"):
        _C.Signature((a,), {}, None, ("a", "a"))
    with pytest.raises(TypeError, match="params"):
        _C.Signature((a,), {}, None, (1,))


def test_overlap_is_unsure_between_layouts_that_bind_alike():
    a, b = torch.randn(2), torch.randn(2)
    first, second = counting("first")[0], counting("second")[0]
    d = bound_dispatcher(_C.Signature((a, b), {}, None, ("a", "b")), first)
    d._tt_set_entries([(_C.Signature((a, b), {}, None, ("a", "b")), first),
                       (_C.Signature((a,), {"b": b}, None, ("a", "b")), second)])
    assert d(a, b=b) == "first" and d(a, b=b) == "first"  # first match, also when cached


# ------------------------------------------------------ entry flags (issue 12)


def test_entry_flags_are_checked():
    d = _C.Dispatcher()
    with pytest.raises(ValueError, match="ENTRY_"):
        d._tt_set_entries([(None, print, 64)])
    with pytest.raises(TypeError):
        d._tt_set_entries([(None, print, 1, 2)])
    assert {_C.ENTRY_SERIALIZE, _C.ENTRY_NO_AUTOGRAD, _C.ENTRY_LAYOUT_ONLY} == {1, 2, 4}
    d._tt_set_entries([(None, print, _C.ENTRY_SERIALIZE | _C.ENTRY_NO_AUTOGRAD), (None, len), (None, abs, 0)])
    assert d._tt_entry_flags == [3, 0, 0] and [fn for _, fn in d._tt_entries] == [print, len, abs]


def test_no_autograd_entry_runs_the_original_when_autograd_would_record():
    lin = nn.Linear(3, 3).eval()  # in train mode, the train rule would run the original first
    x = torch.randn(2, 3)
    backend, calls = counting("backend")
    d = bound_dispatcher(_C.Signature((x,), {}), backend, _C.ENTRY_NO_AUTOGRAD, original=lin)
    d._tt_set_module(lin)
    assert d(x).requires_grad and d._tt_grad_fallbacks == 1 and not calls  # weights need grad
    with torch.no_grad():
        assert d(x) == "backend"
    with torch.inference_mode():
        assert d(x) == "backend"
    lin.requires_grad_(False)
    assert d(x) == "backend"
    assert d(x.clone().requires_grad_()).requires_grad  # an input needs grad
    assert d._tt_grad_fallbacks == 2


def test_the_rules_read_the_module_tree_as_it_is_at_each_call():
    """A submodule added after _tt_set_module is read too: its parameters (the grad rule)
    and its train flag (the train rule); a tree that contains itself is an error, not a hang."""
    seq = nn.Sequential(nn.Linear(3, 3)).eval().requires_grad_(False)
    x = torch.randn(2, 3)
    backend, calls = counting("backend")
    d = bound_dispatcher(_C.Signature((x,), {}), backend, _C.ENTRY_NO_AUTOGRAD, original=seq)
    d._tt_set_module(seq)
    assert d(x) == "backend"
    seq.append(nn.Linear(3, 3).eval())  # its parameters require grad
    assert d(x).requires_grad and d._tt_grad_fallbacks == 1
    seq[1].requires_grad_(False)
    assert d(x) == "backend" and d._tt_train_fallbacks == 0
    seq[1].training = 1  # true for dropout and batch norm, though not True
    assert torch.is_tensor(d(x)) and d._tt_train_fallbacks == 1
    seq[1].training = False
    seq._modules["loop"] = seq  # hostile: the tree contains itself; each module is read once
    assert d(x) == "backend"
    inner = nn.Identity().eval()
    for _ in range(40):  # 2**40 paths to the innermost module, 41 modules
        pair = nn.Module().eval()
        pair.a = pair.b = inner
        inner = pair
    seq._modules["loop"] = inner
    served = d(x) == "backend"  # not in the assert: pytest's repr of the module would walk every path
    assert served
    seq._modules["loop"] = 5
    with pytest.raises(TypeError, match="a submodule of a tuned module is a int, which is not a module"):
        d(x)
    del seq._modules["loop"]
    d._tt_set_module(None)
    seq.train()
    assert d(x) == "backend" and d._tt_train_fallbacks == 1  # no module: no rule read


def test_dict_change_names_the_first_table_and_key_that_moved():
    a, b = {"x": 1.5, "y": "s", "z": [1, 2]}, {"m": None}
    tables = [(a, {"x": 1.5, "y": "s", "z": [1, 2]}, -1, True), (b, dict(b), 1, False), ({}, {}, 0, False)]
    assert _C.dict_change(tables) is None  # equal values, other objects: by value
    a["w"] = 3  # a key added: only a size that is read minds
    assert _C.dict_change(tables) is None
    b["n"] = 1
    assert _C.dict_change(tables) == (1, None)
    del b["n"]
    b["m"] = 0
    assert _C.dict_change(tables) == (1, "m")  # not None: by identity
    b["m"] = None
    a["z"].append(3)
    assert _C.dict_change(tables) == (0, "z")
    a["z"].pop()
    del a["y"]
    assert _C.dict_change(tables) == (0, "y")
    a["y"] = "s"
    assert _C.dict_change([(a, {"t": torch.ones(2)}, -1, False)]) == (0, "t")  # tensors: never compared by value
    for bad in ((), [(a, a)], [(a, "b", 1, True)], [("a", a, 1, True)], [(a, a, "1", True)]):
        with pytest.raises(TypeError):
            _C.dict_change(bad)


def test_dict_change_by_value_compares_lists_item_by_item_and_tensors_as_objects():
    """A list of tensors (a module's scales) compared by value: the same tensors are equal, a
    replaced one differs (never its __eq__, which gives a tensor: a bool of several values
    raises), lists and tuples item by item to any depth the saved copy has."""
    t, u = torch.ones(3), torch.ones(3)
    live = {"s": [t, 1.5, ([t],)], "n": [2.0]}
    tables = [(live, {"s": [t, 1.5, ([t],)], "n": [2.0]}, -1, True)]
    assert _C.dict_change(tables) is None
    live["s"][2][0][0] = u  # an equal tensor, another object: changed (the converted model kept t)
    assert _C.dict_change(tables) == (0, "s")
    live["s"][2][0][0] = t
    live["s"] = [t, 1.5, [[t]]]  # a list where a tuple was: another value
    assert _C.dict_change(tables) == (0, "s")
    live["s"] = [t, 1.5, ([t],)]
    live["n"].append(3.0)
    assert _C.dict_change(tables) == (0, "n")
    assert _C.dict_change([({"x": t}, {"x": u}, -1, True)]) == (0, "x")

    class Listed(list):
        pass

    live["s"] = Listed([u, 1.5, ([t],)])  # another type of list, holding another tensor: changed, no __eq__
    assert _C.dict_change(tables) == (0, "s")


def test_autograd_entries_never_read_grad_mode():
    x = torch.randn(2, 3, requires_grad=True)
    backend, calls = counting("backend")
    d = bound_dispatcher(_C.Signature((x,), {}), backend)
    assert d(x) == "backend" and d._tt_grad_fallbacks == 0


def test_serialized_entry_runs_one_call_at_a_time():
    import threading
    import time

    inside, most = [0], [0]

    def backend(x):
        inside[0] += 1
        most[0] = max(most[0], inside[0])
        time.sleep(0.0005)  # lets the other threads in, were they allowed
        inside[0] -= 1
        return x

    x = torch.randn(2)
    for flags, serial in ((_C.ENTRY_SERIALIZE, True), (0, False)):
        inside[0] = most[0] = 0
        d = bound_dispatcher(_C.Signature((x,), {}), backend, flags)
        threads = [threading.Thread(target=lambda: [d(x) for _ in range(50)]) for _ in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert (most[0] == 1) is serial, most[0]


def test_serialized_entry_is_reentrant_on_one_thread():
    x = torch.randn(2)
    box = {}

    def backend(x, depth=0):
        return depth if depth == 2 else box["d"](x, depth=depth + 1)

    d = _C.Dispatcher()
    d._tt_bind(print)
    d._tt_set_entries([(None, backend, _C.ENTRY_SERIALIZE)])
    d._tt_mode = 1
    box["d"] = d
    assert d(x) == 2


def test_layout_only_entry_binds_but_does_not_check_values():
    a = torch.randn(2)
    d = bound_dispatcher(_C.Signature((), {"a": a, "b": 1}, None, ("a", "b")), flags=_C.ENTRY_LAYOUT_ONLY)
    n, names, values = d(torch.randn(5), b=2)  # another shape and value: the backend checks
    assert (n, names, values[1]) == (0, ("a", "b"), 2)
    assert d(torch.randn(5)) == "original"  # but not another layout


def test_notify_is_called_once_per_reason_until_reset():
    x = torch.randn(2, 3)
    seen = []
    d = bound_dispatcher(_C.Signature((x,), {}), counting()[0], _C.ENTRY_NO_AUTOGRAD)
    d._tt_set_notify(seen.append)
    for _ in range(3):
        d(torch.randn(5))
        d(x.clone().requires_grad_())
    assert seen == ["no signature matched", "grad mode"]
    assert (d._tt_fallbacks, d._tt_grad_fallbacks) == (3, 3)
    d._tt_reset_untuned()
    assert (d._tt_fallbacks, d._tt_grad_fallbacks) == (0, 0)
    d(torch.randn(5))
    assert seen[-1] == "no signature matched" and len(seen) == 3
    d._tt_set_notify(None)
    d(x.clone().requires_grad_())
    assert len(seen) == 3


def test_a_failing_notify_never_fails_the_call(monkeypatch):
    x = torch.randn(2, 3)
    d = bound_dispatcher(_C.Signature((x,), {}))
    d._tt_set_notify(lambda reason: 1 / 0)
    reported = []
    monkeypatch.setattr(sys, "unraisablehook", reported.append)
    assert d(torch.randn(5)) == "original"
    assert len(reported) == 1 and reported[0].exc_type is ZeroDivisionError


class RootCalled(nn.Module):
    """A module shaped as one tuned in place: its class's __call__ is _C.root_call."""

    __call__ = _C.root_call

    def forward(self, x):
        raise AssertionError("a module tuned in place runs its wrapper, not its forward")


def test_root_call_sends_the_call_to_the_wrapper_with_its_arguments_as_they_came():
    seen = []
    m = RootCalled()
    m.__dict__["_tt_root"] = lambda *args, **kwargs: seen.append((args, kwargs)) or "out"
    assert m(1, 2, k=3) == "out" and seen == [((1, 2), {"k": 3})]
    assert type(m).__call__ is _C.root_call
    bound = m.__call__  # a method, as a Python function's would be
    assert bound.__self__ is m and bound(4) == "out" and seen[-1] == ((4,), {})
    assert _C.root_call(m, 5) == "out" and seen[-1] == ((5,), {})


def test_root_call_refuses_a_module_without_its_wrapper_as_the_python_call_did():
    with pytest.raises(KeyError, match="_tt_root"):
        RootCalled()(1)
    with pytest.raises(TypeError, match="self"):
        _C.root_call()
    with pytest.raises(TypeError):
        type(_C.root_call)()
    with pytest.raises(AttributeError):
        _C.root_call(object())  # no __dict__


@pytest.mark.slow
def test_root_call_holds_the_wrapper_while_it_runs():
    """A wrapper that takes itself out of the module during the call (tt.unwrap from
    inside it) keeps running: the call holds its own reference."""
    m = RootCalled()

    class Root:
        def __call__(self, x):
            del m.__dict__["_tt_root"]
            gc.collect()
            return self.tag + x

    m.__dict__["_tt_root"] = Root()
    m.__dict__["_tt_root"].tag = 10
    ref = weakref.ref(m.__dict__["_tt_root"])
    assert m(1) == 11 and "_tt_root" not in m.__dict__
    gc.collect()
    assert ref() is None


# ------------------------------------------ self-reference: refused, never a crash
# Each case runs in a child interpreter: before these checks they overflowed the C stack
# (a segfault), which would have killed pytest.

_CYCLE_PRELUDE = """
import pytest
from torch_tweak import _C
a, b = _C.Dispatcher(), _C.Dispatcher()
"""

_SELF_REFERENCE = {
    "bind-itself": """
with pytest.raises(ValueError, match="_tt_bind: the callable is this Dispatcher, so a call of it would never end"):
    a._tt_bind(a)
    a(1)  # before the check: unbounded recursion in C, a segfault
assert a._tt_original is None
""",
    "entry-is-itself": """
a._tt_bind(print)
with pytest.raises(ValueError, match="_tt_set_entries: the backend is this Dispatcher"):
    a._tt_set_entries([(None, a)])
    a._tt_mode = _C.MODE_ACTIVE
    a(1)
assert a._tt_entries == []
""",
    "recorder-is-itself": """
with pytest.raises(ValueError, match="_tt_set_recorder: the callable is this Dispatcher"):
    a._tt_set_recorder(a)
    a._tt_mode = _C.MODE_RECORD
    a(1)
a._tt_mode = _C.MODE_RECORD
with pytest.raises(RuntimeError, match="no recorder"):
    a(1)
""",
    "originals-in-a-circle": """
a._tt_bind(b)
with pytest.raises(ValueError, match="_tt_bind: the callable leads back to this Dispatcher through other"):
    b._tt_bind(a)
    a(1)
c = _C.Dispatcher()
b._tt_bind(c)
with pytest.raises(ValueError, match="leads back"):
    c._tt_set_recorder(a)
    c._tt_mode = _C.MODE_RECORD
    a(1)
""",
    "entries-in-a-circle": """
a._tt_bind(print)
a._tt_set_entries([(None, b, _C.ENTRY_SERIALIZE)])
with pytest.raises(ValueError, match="_tt_set_entries: the backend leads back"):
    b._tt_set_entries([(None, a)])
    a._tt_mode = b._tt_mode = _C.MODE_ACTIVE
    a(1)
a._tt_mode = b._tt_mode = _C.MODE_ORIGINAL
with pytest.raises(ValueError, match="_tt_bind: the callable leads back"):
    b._tt_bind(a)
    a._tt_mode = _C.MODE_ACTIVE
    a(1)
""",
    "root-call-to-the-module-itself": """
class M:
    __call__ = _C.root_call
m = M()
m._tt_root = m
with pytest.raises(ValueError, match="_tt_root is the module itself"):
    m(1)
""",
    "root-call-leading-back-is-a-recursion-error": """
class M:
    __call__ = _C.root_call
m = M()
m._tt_root = m.__call__  # root_call bound to m: leads back to m
with pytest.raises(RecursionError, match="root_call"):
    m(1)
""",
}


@pytest.mark.parametrize("name", sorted(_SELF_REFERENCE))
@pytest.mark.slow
def test_a_dispatcher_that_would_call_itself_is_refused_not_a_crash(name):
    from support import run_in_child

    run_in_child(_CYCLE_PRELUDE + _SELF_REFERENCE[name])


def test_dispatchers_that_call_each_other_without_a_circle_still_work():
    a, b, c = _C.Dispatcher(), _C.Dispatcher(), _C.Dispatcher()
    c._tt_bind(lambda x: x + 1)
    b._tt_bind(c)
    b._tt_set_entries([(None, c)])
    a._tt_bind(b)
    a._tt_set_recorder(c)
    a._tt_set_entries([(None, b), (None, c)])
    b._tt_mode = a._tt_mode = _C.MODE_ACTIVE
    assert a(1) == 2 and b(2) == 3
    a._tt_bind(b)  # the same link again is no circle
