"""Input signatures: the calls of one module grouped by what they look like.

A module called with two batch sizes, or once for prefill and then for decode, has
several signatures. Each gets its own copy of the strategy and its own backend; the C
dispatcher picks the entry whose ``_C.Signature`` fits a call and runs the original
module for a call that fits none.

A call binds by name: ``f(a, b)``, ``f(a, b=b)`` and ``f(b=b, a=a)`` are one signature
(the names of forward's parameters go into the ``_C.Signature``), and the dispatcher hands
the backend every call laid out as the signature's first recorded call was (the same
positional count, the same keywords in the same order). Recorded calls are stored in that
layout too, so a backend builds on one layout.

Recording keeps up to MAX_CALLS_PER_SIGNATURE calls of each of the first
MAX_SIGNATURES signatures (and, with tt.tweak's shapes=, up to MAX_DECLARED_CALLS calls at
the declared ends in a shape class's group: stored_bounds says what a module's groups may
hold, for the writers and the readers of files alike). Calls of any further signature share one last group,
"any other call", with no signature of its own. Its backend serves only calls of the
shape classes it was built and checked on (see proven_signatures): a call whose plain
values, structure, dtypes, ranks or devices differ from every recorded call of the
group, or whose tensor sizes differ on an axis that did not vary among them, runs the
original forward (counted as "no signature matched"), as does a call of an earlier
signature that tuning kept on the original.

A shape class (shape_class) is a Signature whose tensor sizes may vary while the call's
structure, plain values, dtypes, ranks and devices are fixed.

Traffic whose sizes vary (a batcher's batch sizes, a tokenizer's padded lengths) is one
decision, not several: after recording, the calls of one shape class that show more than
one size become one group (merge_varying) whose Signature leaves free the axes whose size
varied among them. Its candidates are measured on those calls in their recorded order, the
traffic's own mix, and include those that pad a call up to a bucket (backends/padded.py).
Calls that pass live state (a key/value cache) are left as they are: a decoder's prefill
and decode steps are different calls, not sizes of one.
"""

from __future__ import annotations

import dataclasses
import hashlib
import inspect
import math
from typing import Any, Sequence

import torch
import torch.utils._pytree as pytree

from . import settings
from .. import _C
from ._samples import Call, describe_cache, structure_key, unstorable
from .layout import CallLayout, layout_of

_C.set_value_keyer(structure_key)  # a key/value cache fits a signature by its structure, not its identity

MERGE_VARYING = True
"""Whether the calls of a shape class whose sizes vary get their group (merge_varying)."""

OTHER = "any other call"


@dataclasses.dataclass(eq=False)
class SignatureGroup:
    """The recorded calls of one signature, and what tuning chose for them.

    signature: the _C.Signature the dispatcher matches, or None for "any other call".
    text: a readable form, e.g. ``(float32[8, 16], scale=2.0)``; key: a short stable hash.
    report: one dict per candidate backend (see report.candidates_of).
    unstorable: recorded calls the chosen backend cannot store (they compile on first call).
    """

    signature: Any
    text: str
    key: str
    samples: list[Call] = dataclasses.field(default_factory=list)
    outputs: list[Any] = dataclasses.field(default_factory=list)
    backend: Any = None
    error: str = ""
    report: list[dict] = dataclasses.field(default_factory=list)
    unstorable: int = 0
    serves: tuple = ()  # "any other call": the Signatures its backend serves (proven_signatures)
    varying: bool = False  # the calls of one shape class whose sizes vary (merge_varying)
    declared: int = 0  # its last calls are at the ends of the declared shapes: checked on, never measured
    layout: CallLayout | None = None  # what its calls look like (lay_out); None: calls of several structures
    judged: str = ""  # under the measured rule, the rule that judged its candidates instead and why, else ""

    def release(self) -> None:
        self.samples.clear()
        self.outputs.clear()


def describe_value(value: Any, depth: int = 0) -> str:
    if isinstance(value, torch.Tensor):
        dtype = str(value.dtype).replace("torch.", "")
        where = "" if value.device.type == "cpu" else f"@{value.device}"
        return f"{dtype}[{', '.join(map(str, value.shape))}]{where}"
    if isinstance(value, (tuple, list)) and depth == 0:
        inner = ", ".join(describe_value(v, 1) for v in value)
        return f"({inner})" if isinstance(value, tuple) else f"[{inner}]"
    if value is None or isinstance(value, (bool, int, float, str, torch.dtype, torch.device)):
        text = repr(value)
        return text if len(text) <= 24 else text[:21] + "..."
    return describe_cache(value) or type(value).__name__


def describe_call(args: tuple, kwargs: dict) -> str:
    parts = [describe_value(a) for a in args] + [f"{k}={describe_value(v)}" for k, v in kwargs.items()]
    return "(" + ", ".join(parts) + ")"


def call_form(call: tuple[tuple, dict]) -> str:
    """A call's form as ranks compare it before the model runs on it (Ranks.same_calls): the
    call as describe_call shows it (each tensor's dtype and sizes, the plain values); where an
    argument nests deeper than describe_call shows, every leaf of the call and its structure."""
    args, kwargs = call
    shown = describe_call(args, kwargs)
    flat = all(not isinstance(v, (tuple, list, dict)) or (isinstance(v, (tuple, list)) and not any(
        isinstance(item, (tuple, list, dict)) for item in v)) for v in list(args) + list(kwargs.values()))
    if flat:
        return shown
    leaves, spec = pytree.tree_flatten(call)
    return f"{shown} holding {', '.join(describe_value(leaf, 1) for leaf in leaves)} ({key_of(str(spec))})"


def key_of(text: str) -> str:
    return hashlib.sha1(text.encode("utf-8")).hexdigest()[:12]


def call_signature(function: Any) -> inspect.Signature:
    """The signature a call of `function` really has: the function's own, unless it takes
    ``*args`` or ``**kwargs`` and wraps another (functools.wraps: ``__wrapped__``), as a
    pass-through decorator does (torch.no_grad, transformers' forwards), whose wrapped
    function's names then bind the call. A function that says it wraps another but names its
    own parameters (``@functools.wraps(inner) def forward(self, x, b)``) is called with those.
    TypeError or ValueError when neither can be read."""
    own = inspect.signature(function, follow_wrapped=False)
    passes_on = any(p.kind in (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)
                    for p in own.parameters.values())
    return inspect.signature(function) if passes_on else own


def forward_params(module: Any) -> tuple[str | None, ...]:
    """The names of the parameters of ``module.forward`` that take a position (call_signature),
    in order (None for a positional-only one), up to ``*args`` or the first keyword-only one:
    what a Signature binds a call by. () when forward has no inspectable signature."""
    try:
        parameters = call_signature(module.forward).parameters.values()
    except (TypeError, ValueError, AttributeError):
        return ()
    names: list[str | None] = []
    for p in parameters:
        if p.kind is inspect.Parameter.POSITIONAL_ONLY:
            names.append(None)
        elif p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD:
            names.append(p.name)
        else:
            break
    return tuple(names)


def _binds(signature: inspect.Signature, args: tuple) -> bool:
    try:
        signature.bind(*args)
        return True
    except TypeError:
        return False


def label_pairs(module: Any, calls: Sequence[tuple[tuple, dict]]) -> str | None:
    """What to say when a dataset's samples look like (input, label) pairs, as a training
    loader gives them: every call is two positional arguments, and ``module.forward`` takes
    the first alone but not both; None otherwise (the model may take two arguments). Said
    only when forward's own signature refuses both as well as the one its call binds by
    (call_signature): a wrapper that takes ``*args`` may pass them to anything, so what
    the function it wraps takes decides nothing about the call."""
    if not calls or any(kwargs or len(args) != 2 for args, kwargs in calls):
        return None
    try:
        signatures = [inspect.signature(module.forward, follow_wrapped=False), call_signature(module.forward)]
    except (TypeError, ValueError, AttributeError):
        return None
    args = calls[0][0]
    if any(_binds(signature, args) for signature in signatures) or not _binds(signatures[1], args[:1]):
        return None
    shown = ", ".join(describe_value(a) for a in args)
    return (f"the dataset's samples look like (input, label) pairs ({shown}): {type(module).__name__}.forward "
            f"takes one argument, and tt.tweak calls model(*sample). Pass the inputs only, e.g. "
            f"tt.tweak(model, [x for x, _ in pairs]), or a function that calls the model as you do: "
            f"tt.tweak(model, workload=lambda m: [m(x) for x, _ in pairs])")


def make_signature(args: tuple, kwargs: dict, params: tuple = (), dynamic: Any = None) -> Any:
    """The _C.Signature of one call, binding by the names in `params` (see forward_params);
    without them when the call itself gives a parameter both ways (the original raises).
    dynamic: the axes that match any size (see _C.Signature), True for every axis."""
    try:
        return _C.Signature(args, kwargs, dynamic, params)
    except ValueError:
        return _C.Signature(args, kwargs, dynamic)


def shape_class(args: tuple, kwargs: dict, params: tuple = ()) -> Any:
    """The shape class of a call: a _C.Signature that fits every call of the same layout,
    structure, plain values, tensor dtypes, ranks and devices, whatever its tensors' sizes."""
    return make_signature(args, kwargs, params, dynamic=True)


def _shapes(value: Any) -> Any:
    """A bound argument's tensor shapes: a shape for a tensor, a list of them (None for an
    item that is not a tensor) for a tuple or list, else None."""
    if isinstance(value, torch.Tensor):
        return tuple(value.shape)
    if isinstance(value, (tuple, list)):
        return [tuple(v.shape) if isinstance(v, torch.Tensor) else None for v in value]
    return None


def _varying(shapes: Sequence[tuple]) -> tuple[int, ...]:
    """The axes on which shapes of one rank take more than one size."""
    return tuple(axis for axis in range(len(shapes[0])) if len({s[axis] for s in shapes}) > 1)


def stored_bounds() -> tuple[int, int]:
    """(the most signature groups one module's recording leaves, the most calls one group holds):
    what merge_varying keeps within, and so what tt.save writes and tt.load accepts
    (checkpoint._groups reads them here, at the call, so the two never part).

    Calls: a group holds at most MAX_CALLS_PER_SIGNATURE of the traffic's calls and
    MAX_DECLARED_CALLS at the declared ends. Groups: every group left holds a traffic call of a
    shape class no other group holds (two groups of one class whose sizes differ are merged),
    and the traffic's classes are at most one per signature group and one per call of "any
    other call" (MAX_CALLS_PER_SIGNATURE of them); a remainder of "any other call" left after
    merging keeps a call whose class is no group's."""
    calls = settings.MAX_CALLS_PER_SIGNATURE
    return settings.MAX_SIGNATURES + calls, calls + settings.MAX_DECLARED_CALLS


def is_other(group: SignatureGroup) -> bool:
    """Whether `group` is "any other call" (also as a file or cache entry gives it back)."""
    return group.key == "other" and group.text == OTHER


def proven_signatures(samples: Sequence[Any], params: tuple = (), sizes_fixed: bool = False) -> tuple:
    """What a backend built and checked on `samples` (calls as (args, kwargs)) may serve, as
    _C.Signatures: one per shape class among the samples, laid out as its first call, with
    the plain values, structure, dtypes, ranks and devices of its calls, and sizes fixed
    except on the axes whose size varied among its calls (the backend answered right on
    several sizes there; sizes_fixed: on no axis). Empty when there are no samples: nothing
    was proven.

    The same rule for every backend: one that bakes in a plain value, or specialises on a
    shape, serves only calls that have that value, or that shape."""
    classes: list[tuple[Any, list[tuple[tuple, dict]]]] = []
    for args, kwargs in samples:
        for cls, members in classes:
            if cls.matches(args, kwargs):
                members.append(cls.bind(args, kwargs))
                break
        else:
            try:
                cls = shape_class(args, kwargs, params)
            except Exception:  # an argument the dispatcher cannot describe: no class, served by none
                continue
            classes.append((cls, [cls.bind(args, kwargs)]))
    served = []
    for _, members in classes:
        args, kwargs = members[0]
        values = [list(a) + list(k.values()) for a, k in members]
        dynamic: list[Any] = []
        for i, first in enumerate(values[0]):
            shapes = [_shapes(v[i]) for v in values]
            if sizes_fixed:
                axes = None
            elif isinstance(shapes[0], tuple):
                axes: Any = _varying(shapes) or None
            elif isinstance(shapes[0], list):
                items = [None if item is None else _varying([s[j] for s in shapes]) or None
                         for j, item in enumerate(shapes[0])]
                axes = items if any(a is not None for a in items) else None
            else:
                axes = None
            dynamic.append(axes)
        try:
            served.append(make_signature(args, kwargs, params, dynamic=dynamic))
        except Exception:  # a value read differently the second time: the sizes as recorded
            served.append(make_signature(args, kwargs, params))
    return tuple(served)


def group_for(groups: list[SignatureGroup], args: tuple, kwargs: dict, params: tuple = ()) -> SignatureGroup:
    """The group a call belongs to; a new one is appended when none fits. params: the
    names of forward's positional parameters (forward_params)."""
    for group in groups:
        if group.signature is None or group.signature.matches(args, kwargs):
            return group
    signature = None
    if len(groups) < settings.MAX_SIGNATURES:
        try:
            signature = make_signature(args, kwargs, params)
        except Exception:  # an argument the dispatcher cannot describe: any other call
            signature = None
    text = describe_call(args, kwargs) if signature is not None else OTHER
    group = SignatureGroup(signature, text, key_of(text) if signature is not None else "other")
    groups.append(group)
    return group


def _leaf_shapes(args: tuple, kwargs: dict) -> list[tuple[int, ...]]:
    """The shapes of a call's tensors, those inside a tuple or list argument included (_shapes), in order."""
    shapes: list[tuple[int, ...]] = []
    for value in list(args) + list(kwargs.values()):
        found = _shapes(value)
        shapes.extend([found] if isinstance(found, tuple) else [s for s in found or () if s is not None])
    return shapes


def describe_class(samples: Sequence[Any]) -> str:
    """A readable form of calls of one shape class: each size that varied as its range,
    e.g. ``(float32[1-16, 3, 224, 224])``."""
    args, kwargs = samples[0]
    every = [_leaf_shapes(a, k) for a, k in samples]
    ranges = iter([tuple((min(s[i][axis] for s in every), max(s[i][axis] for s in every))
                         for axis in range(len(every[0][i]))) for i in range(len(every[0]))])

    def text(value: Any, depth: int = 0) -> str:
        if isinstance(value, torch.Tensor):
            sizes = next(ranges)
            dtype = str(value.dtype).replace("torch.", "")
            where = "" if value.device.type == "cpu" else f"@{value.device}"
            dims = ", ".join(str(lo) if lo == hi else f"{lo}-{hi}" for lo, hi in sizes)
            return f"{dtype}[{dims}]{where}"
        if isinstance(value, (tuple, list)) and depth == 0:
            inner = ", ".join(text(v, 1) for v in value)
            return f"({inner})" if isinstance(value, tuple) else f"[{inner}]"
        return describe_value(value, depth)

    parts = [text(a) for a in args] + [f"{k}={text(v)}" for k, v in kwargs.items()]
    return "(" + ", ".join(parts) + ")"


def merge_varying(groups: list[SignatureGroup], samples: Sequence[Call], outputs: Sequence[Any],
                  params: tuple = (), edges: set[int] | frozenset[int] = frozenset()) -> list[SignatureGroup]:
    """The recorded groups with the calls of each shape class that show more than one size
    made one group (see the module docstring): its Signature fits the class with the axes
    that varied left free (proven_signatures), its calls are the class's first
    MAX_CALLS_PER_SIGNATURE recorded calls in their recorded order (samples and outputs: every
    recorded call in order, as the groups store them). The groups whose calls it took are
    dropped ("any other call" keeps its calls of other classes); groups of one size stay. A
    module called with live state is left as it is.

    edges: the ids of the samples recorded from the calls at the ends of the declared shapes
    (torch_tweak._core.shapes): they go after the traffic's calls of their class's group (counted
    in its ``declared``, at most MAX_DECLARED_CALLS: the smallest and the largest), whose free
    axes they widen; one whose class has no call of the traffic is dropped, as is every one
    when nothing is merged. Every group returned is within stored_bounds."""
    if not MERGE_VARYING or len(samples) < 2 or any(unstorable(s) is not None for s in samples):
        return _without(groups, edges)
    classes: list[tuple[Any, list[int]]] = []
    for i, (args, kwargs) in enumerate(samples):
        for cls, members in classes:
            if cls.matches(args, kwargs):
                members.append(i)
                break
        else:
            try:
                classes.append((shape_class(args, kwargs, params), [i]))
            except Exception:  # an argument the dispatcher cannot describe: left as recorded
                continue
    merged: list[SignatureGroup] = []
    taken: set[int] = set()
    for cls, members in classes:
        traffic = [i for i in members if id(samples[i]) not in edges]
        if not traffic or len({tuple(_leaf_shapes(*samples[i])) for i in members}) < 2:
            continue
        ends = _extremes([i for i in members if id(samples[i]) in edges], samples)
        kept = traffic[:settings.MAX_CALLS_PER_SIGNATURE] + ends
        calls = [samples[i] for i in kept]
        try:
            (signature,) = proven_signatures(calls, params)
        except ValueError:
            continue
        text = describe_class(calls)
        group = SignatureGroup(signature, text, key_of(text), varying=True, declared=len(ends))
        group.samples.extend(calls)
        group.outputs.extend(outputs[i] for i in kept)
        merged.append(group)
        taken.update(id(samples[i]) for i in members)
    if not merged:
        return _without(groups, edges)
    return merged + _without(groups, taken | set(edges))  # a group none of whose calls went into a class's stays


def _extremes(ends: list[int], samples: Sequence[Call]) -> list[int]:
    """`ends` (indices into samples) when they are at most MAX_DECLARED_CALLS, else the smallest
    and the largest call among them (by their tensors' elements), in recorded order."""
    if len(ends) <= settings.MAX_DECLARED_CALLS:
        return ends

    def size(i: int) -> int:
        return sum(math.prod(shape) for shape in _leaf_shapes(*samples[i]))

    chosen = {min(ends, key=size), max(ends, key=size)}
    return [i for i in ends if i in chosen][:settings.MAX_DECLARED_CALLS]


def _without(groups: list[SignatureGroup], taken: set[int] | frozenset[int]) -> list[SignatureGroup]:
    """`groups` without the samples whose ids are in `taken` (a group left with none is dropped)."""
    if not taken:
        return groups
    rest = []
    for group in groups:
        pairs = [(s, o) for s, o in zip(group.samples, group.outputs) if id(s) not in taken]
        if group.samples and not pairs:
            continue
        group.samples[:] = [s for s, _ in pairs]
        group.outputs[:] = [o for _, o in pairs]
        rest.append(group)
    return rest


def lay_out(groups: Sequence[SignatureGroup], params: tuple = (), positions: tuple[int, str] | None = None) -> None:
    """Each group's layout (torch_tweak._core.layout), made once here, where its calls were
    grouped, from its recorded calls: what every reader of them (the backends built for it)
    reads. None for a group whose calls differ in structure ("any other call"), or that has no
    call. positions: the model's position table (the longest length a call may have), or None."""
    for group in groups:
        try:
            group.layout = layout_of(group.samples, params, positions) if group.samples else None
        except ValueError:
            group.layout = None
