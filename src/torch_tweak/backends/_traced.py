"""What a model traced for another runtime (OpenVINO's convert_model, ONNX Runtime's exporters)
holds to, since a trace keeps one path through the module's Python: the branch its example
took, and every size its example turned into a Python number.

- **A branch on the call's values is refused at the build** (watch_values): while the module
  is traced, every conversion of a traced tensor to a Python value (``if y.max() > 3``,
  ``int(t)``, ``t.item()``, ``t.tolist()``, ``torch.equal``) is followed back through the
  traced graph. One whose value depends on the values of the call's tensors (not only on their
  sizes, nor on the module's weights, which the converted model keeps and Baked watches) makes
  the build fail, naming the line: no check can prove a trace for values it never saw. A
  conversion of a size (``if x.shape[0] % 2``) is allowed: it is a question per call shape,
  answered below. torch.export (the dynamo ONNX exporter) refuses such a module by itself (a
  branch on a value is its data-dependent error); the TorchScript exporter it then falls back to
  is watched.
- **A call shape is served only once a check proved the trace there** (Served): the shapes of
  the calls the build was checked on are proven; a call of any other shape inside its class is
  answered by the module's own forward, and checked against the traced model's answer on the
  same call; the shape is served by the traced model from its next call if they matched, and by
  the module's own forward from then on (counted, said once) if they did not. A shape once
  proven is not checked again.
- **A call the traced model cannot take** (it raises, as a reshape made for even lengths does
  at an odd one) is answered by the module's own forward, counted and said once, and its shape
  goes to the module from then on; an exception the module itself raises on the call is the
  caller's, as it would be untuned.
"""

from __future__ import annotations

import contextlib
import dataclasses
import linecache
import logging
import os
import sys
import threading
from typing import Any, Callable, Iterable, Iterator, Sequence

import torch
import torch.utils._pytree as pytree
from torch.overrides import TorchFunctionMode

from .._core import settings
from .._core.correctness import MismatchError, check
from .base import FlatModule

logger = logging.getLogger("torch_tweak")

_METADATA = frozenset({
    "__hash__", "dim", "ndimension", "stride", "storage_offset", "element_size", "is_contiguous",
    "is_floating_point", "is_complex", "is_signed", "is_inference", "is_set_to", "is_same_size", "is_pinned",
    "is_shared", "get_device", "data_ptr", "untyped_storage", "__repr__", "__str__", "__format__"})
"""Functions of a tensor whose Python result says only what the tensor is (its rank, strides,
dtype, memory), never what it holds nor its sizes: no value branch."""
_OF_SIZES = frozenset({"__len__", "numel", "nelement", "size", "__get__"})
"""Functions of a tensor whose Python result is one of its sizes (`len(t)`, `t.numel()`, an
attribute such as `t.ndim`): a question of values only where the tensor's size is."""
_COUNTED = frozenset({"__iter__", "unbind", "split", "chunk", "tensor_split", "unsafe_split", "unsafe_chunk",
                      "hsplit", "vsplit", "dsplit"})
"""Functions whose number of results (a Python loop's length) is one of the tensor's sizes."""
_SIZES = frozenset({"aten::size", "aten::sym_size", "aten::dim", "aten::numel", "prim::shape", "aten::len",
                    "aten::zeros_like", "aten::ones_like", "aten::empty_like", "aten::rand_like",
                    "aten::randn_like"})
"""Traced nodes whose result depends on the sizes of the tensors they read, not on their
values: the walk back from a conversion follows those tensors' sizes only."""
_SHAPED_BY_VALUES = frozenset({
    "aten::nonzero", "aten::nonzero_numpy", "aten::argwhere", "aten::masked_select", "aten::_unique",
    "aten::_unique2", "aten::unique_dim", "aten::unique_consecutive", "aten::unique_dim_consecutive",
    "aten::bincount"})
"""Traced nodes whose result's size depends on their inputs' values (see _shaped_by_values for
indexing, torch.where and repeat_interleave)."""
_TORCH = os.path.dirname(torch.__file__)
_CONVERTERS = ("openvino", "onnx", "onnxscript", "onnxruntime")
_OURS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class ValueBranch(ValueError):
    """The module turns a value computed from its call's tensors into a Python value while it
    is traced: a branch (or a size, an index, a number) the trace would keep as it was for its
    example, whatever a later call holds."""


def _data_inputs(graph_input: Any, count: int) -> set[int]:
    """The unique ids of the traced graph's inputs that are the call's tensors: the first
    `count` inputs that are not a module (torch.jit.trace's first input is the module; the
    TorchScript ONNX exporter puts the weights after the call's tensors)."""
    outputs = [v for v in graph_input.outputs() if v.type().kind() != "ClassType"]
    return {v.unique() for v in outputs[:count]}


def _tensors(value: Any) -> bool:
    """Whether a traced value is a tensor, or a list or optional of them."""
    kind = value.type()
    while kind.kind() in ("ListType", "OptionalType"):
        kind = kind.getElementType()
    return kind.kind() == "TensorType"


def _shaped_by_values(kind: str, inputs: list) -> bool:
    """Whether the size of a traced node's result depends on its inputs' values: a boolean
    mask's count (nonzero, masked_select, indexing with a mask or a tensor of unknown dtype,
    torch.where of a condition alone), unique values, counts (bincount, repeat_interleave by a
    tensor of repeats)."""
    if kind == "aten::index" and len(inputs) > 1:
        listed = inputs[1].node()
        items = list(listed.inputs()) if listed.kind() == "prim::ListConstruct" else [inputs[1]]
        return any(i.type().kind() == "TensorType" and i.type().scalarType() in (None, "Bool", "Byte")
                   for i in items)
    if kind == "aten::where":
        return len(inputs) == 1
    if kind == "aten::repeat_interleave":
        return len(inputs) == 1 or any(i.type().kind() == "TensorType" for i in inputs[1:])
    return kind in _SHAPED_BY_VALUES


def _of_values(value: Any, count: int, sized: bool = False) -> bool:
    """Whether the traced `value` (its size alone, `sized`) depends on the values of the call's
    tensors: a walk back through the nodes that made it reaches one of them for its values. A
    node that reads only sizes passes the walk on to its tensors' sizes; a tensor's size
    follows its inputs' sizes and its plain arguments' values, but its inputs' values where the
    node is one whose result's size they decide (_shaped_by_values)."""
    seen: set[tuple[int, bool]] = set()
    stack = [(value, sized)]
    while stack:
        v, sized = stack.pop()
        if (v.unique(), sized) in seen:
            continue
        seen.add((v.unique(), sized))
        if len(seen) > settings.TRACE_MAX_WALK:
            return True
        node = v.node()
        kind = node.kind()
        inputs = list(node.inputs())
        if kind == "prim::Param":
            if not sized and v.unique() in _data_inputs(node, count):
                return True
        elif sized and _shaped_by_values(kind, inputs):
            stack.extend((i, False) for i in inputs)
        elif sized or kind in _SIZES:
            stack.extend((i, _tensors(i)) for i in inputs)
        else:
            stack.extend((i, False) for i in inputs)
    return False


def _where() -> str:
    """The innermost line on the stack of the module's own code: not torch's, torch-tweak's or a
    converter's (OpenVINO's, ONNX's)."""
    files = [getattr(sys.modules.get(name), "__file__", None) for name in _CONVERTERS]
    skip = tuple(os.path.join(folder, "") for folder in [_TORCH, _OURS] + [os.path.dirname(f) for f in files if f])
    frame: Any = sys._getframe(1)
    while frame is not None:
        name = frame.f_code.co_filename
        if not name.startswith(skip):
            line = linecache.getline(name, frame.f_lineno).strip()
            return f"{os.path.basename(name)}:{frame.f_lineno} in {frame.f_code.co_name}" + (f": {line}" if line else "")
        frame = frame.f_back
    return "a line not found"


class _Watch(TorchFunctionMode):
    """Sees every torch function while a module is traced, and keeps the conversions to Python
    values that depend on the call's values (see the module docs)."""

    def __init__(self, count: int) -> None:
        super().__init__()
        self.count = count
        self.found: list[str] = []

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        out = func(*args, **(kwargs or {}))
        if not self.found and torch._C._get_tracing_state() is not None:
            name = getattr(func, "__name__", "")
            sized = name in _COUNTED or name in _OF_SIZES
            if (name in _COUNTED or (_python_value(out) and name not in _METADATA)) and self._of_values(args, kwargs,
                                                                                                       sized):
                self.found.append(f"{name or func} at {_where()}")  # the first is said
        return out

    def _of_values(self, args: tuple, kwargs: dict | None, sized: bool) -> bool:
        for tensor in (a for a in (*args, *(kwargs or {}).values()) if isinstance(a, torch.Tensor)):
            try:
                traced = torch._C._get_value_trace(tensor)
            except RuntimeError:  # not a value of the trace: a constant of the module
                continue
            if _of_values(traced, self.count, sized):
                return True
        return False


def _python_value(out: Any) -> bool:
    """Whether a torch function's result is a plain Python (or numpy) value, not a tensor or a
    size (a list's first item decides: tolist's nested lists)."""
    if isinstance(out, torch.Size):
        return False
    if isinstance(out, (bool, int, float, complex)):
        return True
    if isinstance(out, (list, tuple)):
        return bool(out) and _python_value(out[0])
    return type(out).__module__ == "numpy"


@contextlib.contextmanager
def watch_values(backend: str, inputs: int) -> Iterator[None]:
    """``with watch_values("OpenVINO", inputs): trace(...)``: raises ValueBranch when the block
    ends if, while it traced the module, a branch or a Python value depended on the values of
    the call's `inputs` tensors (the trace's first inputs); see the module docs."""
    watch = _Watch(inputs)
    with watch:
        yield
    if watch.found:
        raise ValueBranch(
            f"{backend}: the module turns a tensor computed from its inputs' values into a Python value "
            f"({watch.found[0]}), and a trace keeps what that value was for its example: other inputs "
            "would get the branch (or size) of the example's. Another backend (Torch Inductor, Torch Eager) "
            "keeps the module's own control flow")


Traced = Callable[[list, tuple, dict], Any]
"""The traced model's answer to a call, from the call's flattened leaves (and the call)."""


class Served:
    """Which call shapes a traced model serves, and what answers the others (see the module
    docs). backend: its name; module: the module's own forward; tolerance: its check's (own:
    under the measured rule, the original's own errors, Backend.own_errors);
    samples: the calls the build is checked on, whose shapes (of their flattened leaves at
    `slots`, the model's inputs, for those laid out as `spec`: the others the backend leaves to
    the module) are proven from the start. A model traced with static shapes
    (one shape in `samples`) is only given calls of that shape (the dispatcher's signature):
    its calls skip the key. fallbacks: calls answered by the module instead (a shape refused, a
    call the model could not take); on_fallback: called once, with what failed, at the next one
    (the tuned-module wrapper sets it, as a device graph's). strict: until the wrapper installs
    the model, a call it cannot take raises (the build's own check must see it)."""

    def __init__(self, backend: str, module: torch.nn.Module, tolerance: float | None, samples: Iterable[Any],
                 spec: Any, slots: list[int], own: Any = None) -> None:
        self.backend, self.module, self.tolerance, self.slots = backend, module, tolerance, slots
        self.own = own  # the original's own errors (Backend.own_errors): the measured rule at first sight
        self.checked = frozenset(tuple(leaves[i].shape for i in slots)
                                 for leaves, layout in map(pytree.tree_flatten, samples) if layout == spec)
        self.fixed = next(iter(self.checked)) if len(self.checked) == 1 else None
        self.one = slots[0] if len(slots) == 1 else None  # one input: its key is made without a loop
        self.proven: set[tuple] = set(self.checked)
        self.refused: dict[tuple, str] = {}
        self.first_sight = 0
        self.fallbacks = 0
        self.on_fallback: Callable[[str], Any] | None = None
        self.strict = True
        self.lock = threading.Lock()

    def __call__(self, traced: Traced, flat: list, args: tuple, kwargs: dict) -> Any:
        """The answer to a call (`flat`: its flattened leaves) from `traced` where its shape is
        proven, else from the module."""
        key = (self.fixed if self.fixed is not None else (flat[self.one].shape,) if self.one is not None
               else tuple([flat[i].shape for i in self.slots]))
        if key in self.proven:
            try:
                return traced(flat, args, kwargs)
            except Exception as exc:
                if self.strict:
                    raise
                reference = self.module(*args, **kwargs)  # an exception of the module's own is the caller's
                self._refuse(key, exc)
                return reference
        return self._unproven(key, traced, flat, args, kwargs)

    def _unproven(self, key: tuple, traced: Traced, flat: list, args: tuple, kwargs: dict) -> Any:
        """A call of a shape no check has proven: the module's answer, checked against the traced
        model's once per shape."""
        if key in self.refused:
            self._count(None)
            return self.module(*args, **kwargs)
        with torch.no_grad():
            reference = self.module(*args, **kwargs)
        self.first_sight += 1
        try:
            check(traced(flat, args, kwargs), reference, self.tolerance, where="its answer", own=self.own)
        except Exception as exc:  # noqa: BLE001 - a mismatch, or a call the model cannot take
            self._refuse(key, exc)
            return reference
        with self.lock:
            if len(self.proven) >= settings.TRACE_PROVEN_LIMIT:
                self.proven = set(self.checked)
            self.proven.add(key)
        return reference

    def _refuse(self, key: tuple, exc: BaseException) -> None:
        text = str(exc).splitlines()[0][:300] if str(exc) else ""
        why = (f"{self.backend}'s model at sizes {_sizes(key)} " +
               (f"gave another answer than the module ({text})" if isinstance(exc, MismatchError)
                else f"could not take the call ({type(exc).__name__}: {text})"))
        with self.lock:
            if len(self.refused) >= settings.TRACE_REFUSED_LIMIT:
                self.refused.clear()
            self.refused[key] = why
            self.proven.discard(key)
        logger.info("torch-tweak: %s; the module's own forward answers calls of those sizes", why)
        self._count(why)

    def _count(self, why: str | None) -> None:
        with self.lock:
            self.fallbacks += 1
            notify, self.on_fallback = self.on_fallback, None
        if notify is not None:
            notify(why or next(iter(self.refused.values()), ""))

    def describe(self) -> str | None:
        """What status shows once a call of a shape not checked at the build came: the shapes
        proven, those checked at first sight, those refused and why (the first); else None."""
        if not self.first_sight and not self.refused:
            return None
        refused = next(iter(self.refused.values()), None)
        return (f"call shapes: {len(self.proven)} proven, {self.first_sight} checked at first sight"
                + (f", {len(self.refused)} refused (the first: {refused})" if refused else ""))


def _sizes(key: tuple) -> list:
    return [list(s) for s in key]


@dataclasses.dataclass
class Flat:
    """A module's first recorded call flattened for a runtime that takes numpy arrays (OpenVINO,
    ONNX Runtime): its leaves and their layout (spec), which leaves are tensors (slots, the
    runtime's inputs in order) and the module as a function of those tensors alone (module)."""

    leaves: list
    spec: Any
    slots: list[int]
    module: torch.nn.Module


def flatten_for_numpy(runtime: str, verb: str, module: torch.nn.Module, samples: Sequence[Any]) -> Flat:
    """The one prologue of a runtime whose inputs cross as numpy arrays: the first call's
    tensors are its inputs, the rest baked in as constants; ValueError for a call with no
    tensor (nothing to convert or export with) or a bfloat16 tensor (numpy has no such type)."""
    leaves, spec = pytree.tree_flatten(samples[0])
    slots = [i for i, leaf in enumerate(leaves) if isinstance(leaf, torch.Tensor)]
    if not slots:
        raise ValueError(f"{runtime} needs at least one tensor argument to {verb} the module")
    if any(leaves[i].dtype == torch.bfloat16 for i in slots):
        raise ValueError(f"{runtime}: bfloat16 inputs cannot cross to {runtime} as numpy arrays")
    constants = [None if i in slots else leaf for i, leaf in enumerate(leaves)]
    return Flat(leaves, spec, slots, FlatModule(module, constants, spec, slots).eval())
