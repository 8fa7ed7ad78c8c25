"""The base class of every backend, and what a backend is given to build."""

from __future__ import annotations

import abc
import contextlib
import copy
import dataclasses
import enum
import functools
import logging
import types
import warnings
from typing import Any, Callable, ClassVar, Sequence

import torch
import torch.utils._pytree as pytree

from .. import _C
from .._core import noise
from .._core.model_state import sampled, version_of, weight_change, weights_of
from .._core._samples import Call, unstorable
from .._core.schema import Fraction, Spec
from .._core.layout import CallLayout, layout_of
from .._core.shapes import Shapes
from .._core.signatures import forward_params


@dataclasses.dataclass
class BackendConfig:
    """Settings every backend shares.

    tolerance: the relative tolerance of the correctness check for this backend
    (None: the per-dtype default of torch_tweak.TOLERANCES).
    """

    tolerance: float | None = None

    SCHEMA: ClassVar[dict[str, Spec]] = {"tolerance": Fraction(0.0, 1.0)}
    """What a saved file may hold of each field (torch_tweak._core.schema). A subclass declares
    its own fields here; a field left out, or a value its spec refuses, is saved only as a
    fingerprint, and tt.load takes it from the caller's backends=, never from the file."""

    def __post_init__(self) -> None:
        if self.tolerance is not None and not (self.tolerance >= 0):
            raise ValueError(f"tolerance must be a fraction >= 0, got {self.tolerance!r}")

    def lowers_precision(self) -> bool:
        """Whether this config computes at a lower precision than the module's own, on purpose
        (TF32, autocast, a lower inference precision, quantization): the one rule every reader
        asks. A candidate that does is opt-in: tuning tries it only when asked (tt.tweak's
        precision=, or a backend the caller passed), the report names it, and tt.load builds it
        from a file only when the caller passes it in backends=.

        Here: False; a config class with precision settings answers for them (the variant
        fields of backends.variants.VariantConfig, OpenVINO's inference_precision, TorchAO's
        modes)."""
        return False

    def check_tolerance(self) -> float | None:
        """The tolerance of the correctness check: ``tolerance``, or None for the per-dtype
        default; a config whose settings lower precision may give its own default."""
        return self.tolerance

    def label_parts(self) -> list[str]:
        """What a candidate's name shows of this config besides its backend (its variant,
        e.g. ["channels_last"]); empty here."""
        return []

    def unavailable(self, device: torch.device) -> str | None:
        """Why this config's settings cannot run on `device`, or None (here: None)."""
        return None



class BackendUnavailable(Exception):
    """The backend cannot run here (a package not installed, a device it does not support)."""


class ShapesVary(Exception):
    """The backend serves one shape and the recorded calls' sizes vary (the engine's reason
    "dynamic shapes"). A build raises it, or a subclass, to say so; any other exception is
    "build failed"."""


class Backend(abc.ABC):
    """One way to run a module. Subclass it to bring a backend of your own:

    - set ``name`` and, if it has settings, ``config_class`` (a BackendConfig subclass);
    - override ``build(module, samples, device)`` to return a callable that runs the module;
      raise an exception to reject the module (the message is reported);
    - optionally override ``unavailable(device)`` to return why it cannot run here (the
      strategy moves on), ``check_device(device)`` to raise ValueError when it was asked
      for on a device it can never run on, and ``can_store(sample)`` to say which
      recorded calls it cannot keep in a saved file (it compiles on first call instead).

    A backend object is a template: strategies copy it per module with ``fresh()``, so a
    built backend never leaks into another module. Its state moves from "new" to "built"
    when build succeeds; the tuned-module wrapper then makes it "active" or "inactive".
    """

    name = "backend"
    thread_safe = True
    """True when the built callable may run on several threads at once and give each call
    its own right answer. The dispatcher runs the calls of a backend that says False one
    at a time (a lock per module and signature), so say False whenever the callable keeps
    per-call state in shared objects (static buffers, one request object, a cache filled
    while running) and you have not made it safe yourself."""
    supports_autograd = True
    """True when the built callable returns outputs that autograd follows back to the
    module's inputs and weights, as the original's are. For a backend that says False the
    dispatcher runs the original forward for every call made with grad mode on whose
    inputs or module weights require grad, so users' outputs keep requires_grad; those
    calls are counted as untuned ("grad mode")."""
    writes_back = False
    """True when the built callable runs the module's own operations on the caller's tensors
    (eager, a torch.compile build), so that what forward writes into a tensor it is given
    lands in the caller's tensor. A module seen writing into one while its calls were recorded
    (nn.ReLU(inplace=True) on an argument) is never given a backend that says False: a
    converted model or a device graph writes into its own copy. See keeps_input_writes."""
    checks_inputs = False
    """True when the built callable checks every call against what it was built for and
    runs the original module itself when a call does not fit (the device graph does). A
    module whose only entry is such a backend then skips the dispatcher's own check."""
    config_class: type[BackendConfig] = BackendConfig
    opt_in = False
    """True for a backend that changes results on purpose (quantization): never a default,
    and tt.load builds it from a file only when the caller passes it in backends=. A backend
    whose config lowers precision (BackendConfig.lowers_precision) is opt-in too."""
    isolate_build = False
    """True when build runs native code that can crash the process (a segfault in a
    compiler): tuning then first builds this candidate in a child process, once per module,
    signature and library versions, and a crash there rejects it instead of killing the
    user's process (see torch_tweak._search.isolation). Opt-in for a backend of your own."""
    records_graph = False
    """True when build records the module's work in a device graph that calls replay (the
    device graph, the padded graphs). Under torch.distributed every rank then records at the
    same step, together, and a group whose collectives a graph cannot record (not NCCL) has
    the candidate refused (torch_tweak._core.distributed.enter_build)."""
    packages: tuple[str, ...] = ()
    own_errors: Any = None
    """Under the measured correctness rule, set before build: per output tensor the original's
    own error against a higher-precision run (torch_tweak._core.correctness.Reference.own).
    A backend that checks calls itself after tuning (a size first seen then) passes it to
    correctness.check as ``own``; None under a fixed tolerance."""
    layout: CallLayout | None = None
    """Set before build: the layout of the calls it is built on (torch_tweak._core.layout's
    CallLayout: their structure and tensor slots, the batch axis, the length inputs and the
    model's position table), made once where they were grouped; None when they differ in
    structure or when a caller builds it directly (layout_for then makes one from the calls)."""
    compiles_with_inductor = False
    """True when the built callable runs Inductor-compiled code: tt.save then keeps
    Inductor's compiled-code cache in the file (applied only with trust_artifacts=True)."""
    build_note = ""
    """What the last build did that its time depends on, in a few words (OpenVINO: "converted in
    1.20 s", or its converted model read from torch-tweak's folder): tt.load's report of what
    it rebuilt (LoadResult) says it beside the build's time; "" says nothing."""

    @staticmethod
    def build_scope(static: bool) -> contextlib.AbstractContextManager:
        """A context the builds of one module and input signature run in, entered once for
        every candidate class that shares it (Inductor's share one torch.compile per
        settings). static: every call the builds serve has the recorded shapes."""
        return contextlib.nullcontext()
    """Distribution names whose versions can change whether a build crashes (part of the
    key of a stored isolation verdict), e.g. ("openvino",)."""

    def __init__(self, config: BackendConfig | None = None, **options: Any) -> None:
        if config is not None and options:
            raise TypeError(f"{type(self).__name__}: pass either a config or keyword options, not both")
        if config is None:
            names = {f.name for f in dataclasses.fields(self.config_class)}
            unknown = sorted(set(options) - names)
            if unknown:
                raise TypeError(
                    f"{type(self).__name__} has no option {', '.join(unknown)}; its options are {', '.join(sorted(names))}"
                )
            config = self.config_class(**options)
        elif not isinstance(config, self.config_class):
            raise TypeError(f"{type(self).__name__} takes a {self.config_class.__name__}, got {type(config).__name__}")
        self.config = config
        self.state = "new"
        self.callable: Callable[..., Any] | None = None
        parts = self.label_parts()
        if parts:  # a candidate is a backend and its axes: "TorchInductor [channels_last]"
            self.name = f"{type(self).name} [{', '.join(parts)}]"
        if config.lowers_precision():
            self.opt_in = True  # lower precision on purpose: tt.load builds it only when the caller passes it

    def label_parts(self) -> list[str]:
        """What the candidate's name shows besides its backend: its config's variant
        (BackendConfig.label_parts), e.g. ["channels_last"], ["bf16 autocast"]; empty for a
        backend as it is."""
        return self.config.label_parts()

    def unavailable(self, device: torch.device) -> str | None:
        """Why this backend cannot run on `device`, or None when it can (here: what its config
        says, BackendConfig.unavailable)."""
        return self.config.unavailable(device)

    def check_tolerance(self) -> float | None:
        """The tolerance of the correctness check: the config's (BackendConfig.check_tolerance),
        or None for the per-dtype default."""
        return self.config.check_tolerance()

    def check_device(self, device: torch.device) -> None:
        """Raises ValueError naming the backend and `device` when it can never run there.

        Called before tuning starts, for backends a strategy was given explicitly, so a
        request that cannot be met fails before anything changes."""

    def can_store(self, sample: Call) -> bool:
        """Whether a saved file may keep this recorded call for this backend to build on.

        False for calls holding live objects that cannot be written down (a transformers
        DynamicCache); a backend that needs samples then compiles on first call instead."""
        return True

    @property
    def keeps_input_writes(self) -> bool:
        """writes_back, and the call's tensors are the caller's (no channels-last copy)."""
        return self.writes_back and getattr(self.config, "memory_format", None) is None

    @abc.abstractmethod
    def build(self, module: torch.nn.Module, samples: Sequence[Call], device: torch.device) -> Callable[..., Any]:
        """A callable that runs `module` on this backend, built and warmed on `samples`."""

    def layout_for(self, module: torch.nn.Module, samples: Sequence[Call]) -> CallLayout:
        """The layout of `samples` (Backend.layout, else made from them: CallLayout; ValueError
        when they differ in structure)."""
        return self.layout if self.layout is not None else layout_of(samples, forward_params(module))

    def for_shapes(self, shapes: Shapes) -> "Backend":
        """This backend for traffic within the declared ranges `shapes` (tt.tweak's shapes=,
        torch_tweak._core.shapes): a backend whose config bounds the sizes it serves returns a fresh
        copy bounded by them (the padded backend's range). Here: itself, unchanged; every
        backend is also built and checked on the calls at the ranges' ends."""
        return self

    def load_bound(self, module: torch.nn.Module, samples: Sequence[Call], model: torch.nn.Module) -> str | None:
        """Why building this backend as a file configured it could take tt.load past its stated
        memory and time (docs/deployment.md, "Bounds on what a file sets"), or None: a message naming
        the config field, its value and the bound. Called by tt.load before anything is built,
        for every backend whose config came from the file, with the module it is built for, the
        group's stored calls and the whole model. Here: None (the schema's bounds suffice)."""
        return None

    def fresh(self) -> "Backend":
        """A new, unbuilt backend with a copy of this one's config."""
        clone = copy.copy(self)
        clone.config = copy.deepcopy(self.config)
        clone.state = "new"
        clone.callable = None
        return clone

    def prepare(self, module: torch.nn.Module, samples: Sequence[Call], device: torch.device) -> Callable[..., Any]:
        """Builds for `module` and records the result; raises on failure."""
        reason = self.unavailable(device)
        if reason is not None:
            raise BackendUnavailable(reason)
        with noise.dropped(noise.BUILD):
            fn = self.build(module, samples, device)
        if not callable(fn):
            raise TypeError(f"{type(self).__name__}.build returned {type(fn).__name__}, not a callable")
        self.callable = fn
        self.state = "built"
        return fn

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.config})"


class NeedsStorableSamples:
    """Mixin of backends that build from their recorded calls (compile, quantize): a call
    holding an object that cannot be stored is not kept; the backend compiles on first call."""

    def can_store(self, sample: Call) -> bool:
        return unstorable(sample) is None


def copy_module(module: torch.nn.Module) -> torch.nn.Module:
    """A deep copy of `module` for a backend that changes it in place (quantization).

    Tuned-module wrappers it refers to (a wrapped root's own wrapper) are shared, not copied.
    """
    from .. import _C

    memo = {id(v): v for v in module.__dict__.values() if isinstance(v, _C.Dispatcher)}
    return copy.deepcopy(module, memo)


def _hook_tables(module: torch.nn.Module) -> list[dict]:
    from torch.nn.modules import module as torch_module

    return [table for m in module.modules() for table in (m._forward_hooks, m._forward_pre_hooks)] + [
        torch_module._global_forward_hooks, torch_module._global_forward_pre_hooks]


_SCALARS = (bool, int, float, complex, str, bytes, type(None), torch.dtype, torch.device, enum.Enum,
            types.FunctionType, types.BuiltinFunctionType, types.MethodType, functools.partial)


def _plain(value: Any, depth: int = 0, in_sequence: bool = False) -> bool:
    """Whether a converted model takes `value` in as a constant when the module's forward reads
    it: a number, a string, a dtype, an enum, a function or bound method (an activation, a
    forward set on the instance), or a short list or tuple of such and of tensors (each tensor
    is then watched as a weight too); a module's other attributes (objects, dicts) are not
    watched."""
    if isinstance(value, _SCALARS) or (in_sequence and isinstance(value, torch.Tensor)):
        return True
    if not (isinstance(value, (list, tuple, frozenset)) and depth < 4 and len(value) <= 64):
        return False
    return all(_plain(v, depth + 1, not isinstance(value, frozenset)) for v in value)


def _held_tensors(value: Any, path: str, found: list[tuple]) -> list[tuple]:
    """The tensors in a plain list or tuple (and in those inside it), each as (the list or
    tuple that holds it, its path, its index, the tensor)."""
    if isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            if isinstance(item, torch.Tensor):
                found.append((value, f"{path}[{i}]", i, item))
            else:
                _held_tensors(item, f"{path}[{i}]", found)
    return found


def _watched_weight(table: Any, path: str, name: Any, t: torch.Tensor) -> tuple:
    """A weights_of entry for a tensor the module holds outside its parameters and buffers (a
    plain attribute, a list's item), with its sampled bytes."""
    return sampled((table, path, name, t, t.data_ptr(), version_of(t), 0, None))


class Baked:
    """What a model converted for another runtime (OpenVINO, ONNX Runtime) took in when it was
    built and cannot see change: the module's parameters and buffers, which became the model's
    constants, its plain attributes (_plain: a slope, an epsilon, a flag, an activation
    function, a list of tensors), its submodules and their classes' forward, and its forward
    hooks, which a conversion runs once. A module with forward hooks is refused at the build
    (its hooks would never run per call).
    changed(), per call (in C, extension baked.c): whether a weight (or a tensor held in a
    plain attribute or list) was replaced, given other memory (p.data = ...), updated in place
    (load_state_dict, p.mul_) or written behind its version counter where its sampled bytes
    show it (numpy, a storage's copy_, another tensor over its memory: model_state.sampled), a
    plain attribute set to another value (a list compared by its items), an attribute,
    parameter, buffer or submodule added, removed or replaced, a module's class changed or its
    class's forward replaced, or a hook added since; the first time it says what, once, in a
    warning, and from then on the backend answers with the module's own forward (the caller's
    answers stay the module's). The train flag is the dispatcher's to read (a call in train
    mode runs the original, and eval mode serves the converted model again)."""

    def __init__(self, module: torch.nn.Module, backend: str) -> None:
        hooks = _hook_tables(module)
        if any(hooks):
            raise ValueError(f"{backend}: the module has forward hooks, which a converted model runs once, at "
                             "conversion, never per call; remove them before tuning (another backend keeps them)")
        self.backend = backend
        self.weights = [sampled(entry) for entry in weights_of(module)]
        # (live dict, as at the build, its size, compared by value): _C.dict_change; what each is
        self.tables: list[tuple[dict, dict, int, bool]] = []
        self.what: list[tuple[str, str]] = []
        # (module, None, its class) and (class, "forward", its forward): _C.class_change; what each is
        self.classes: list[tuple[Any, str | None, Any]] = []
        self.class_what: list[str] = []
        self.seen: set[type] = set()
        for path, m in module.named_modules():
            self._watch(path, m)
        self.tables += [(table, {}, 0, False) for table in hooks]
        self.what += [("forward hook", "the module or torch")] * len(hooks)
        self.stale = ""

    def _watch(self, path: str, m: torch.nn.Module) -> None:
        """Takes in what `m` (at `path`) holds that its converted model keeps."""
        where = f"module {path}" if path else "the module"
        attributes = vars(m)
        plain = {k: v for k, v in attributes.items() if k != "training" and not k.startswith("_tt_") and _plain(v)}
        held = [t for k, v in plain.items() for t in _held_tensors(v, f"{path}.{k}" if path else k, [])]
        keep = {id(t): t for *_, t in held}  # a list's tensors stay themselves (compared as objects)
        self.tables.append((attributes, {k: copy.deepcopy(v, dict(keep)) if isinstance(v, (list, tuple)) else v
                                         for k, v in plain.items()}, len(attributes), True))
        self.what.append(("attribute", where))
        # a tensor kept as a plain attribute, or in a plain list or tuple: checked as a weight
        self.weights += [_watched_weight(attributes, f"{path}.{k}" if path else k, k, t)
                         for k, t in attributes.items() if isinstance(t, torch.Tensor)]
        self.weights += [_watched_weight(table, name, index, t) for table, name, index, t in held]
        for kind, table in (("submodule", m._modules), ("parameter", m._parameters), ("buffer", m._buffers)):
            self.tables.append((table, dict(table), len(table), False))
            self.what.append((kind, where))
        cls = type(m)
        self.classes.append((m, None, cls))
        self.class_what.append(f"the class of {where} ({cls.__qualname__}) was changed")
        if cls not in self.seen:
            self.seen.add(cls)
            self.classes.append((cls, "forward", getattr(cls, "forward", None)))
            self.class_what.append(f"{cls.__qualname__}.forward, the forward of {where}'s class, was replaced")

    def changed(self) -> bool:
        if self.stale:
            return True
        why = weight_change(self.weights, in_place=True)
        if not why:
            found = _C.dict_change(self.tables)
            if found is not None:
                kind, where = self.what[found[0]]
                why = (f"{kind} {found[1]!r} of {where} was set, added, removed or replaced" if found[1] is not None
                       else f"{'an' if kind[0] in 'aeiou' else 'a'} {kind} was added to or removed from {where}")
        if not why:
            index = _C.class_change(self.classes)
            why = self.class_what[index] if index is not None else ""
        if why:
            self.stale = why
            message = (f"torch-tweak: {self.backend}'s model was built from the module as it was at tuning, and {why} "
                       "since: the module's own forward answers its calls from now on (untuned, slower). Tune again "
                       "(tt.tweak or tt.tune) for the module as it is now, or set it back before tuning.")
            logging.getLogger("torch_tweak").warning(message)
            warnings.warn(message, stacklevel=3)
        return bool(why)


class FlatModule(torch.nn.Module):
    """A module called with its input tensors as a flat tuple and returning its output tensors
    as one: the form a model exported or converted for another runtime takes and gives.
    leaves and spec: a recorded call flattened (torch.utils._pytree); slots: where its tensors
    are among the leaves (the others are the call's plain values, kept as they are)."""

    def __init__(self, module: torch.nn.Module, leaves: list, spec: Any, slots: list[int]) -> None:
        super().__init__()
        self.inner = module
        self.leaves = leaves
        self.spec = spec
        self.slots = slots

    def forward(self, *tensors: torch.Tensor) -> tuple:
        leaves = list(self.leaves)
        for slot, tensor in zip(self.slots, tensors):
            leaves[slot] = tensor
        args, kwargs = pytree.tree_unflatten(leaves, self.spec)
        out = self.inner(*args, **kwargs)
        return tuple(t for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor))


class OutputForm:
    """The structure of a module's output: where its tensors stand among its plain values, so
    that the tensors a runtime returns (FlatModule's order) are put back in that structure."""

    def __init__(self, output: Any) -> None:
        leaves, self.spec = pytree.tree_flatten(output)
        self.slots = [i for i, leaf in enumerate(leaves) if isinstance(leaf, torch.Tensor)]
        self.constants = [None if i in self.slots else leaf for i, leaf in enumerate(leaves)]

    def fill(self, tensors: Any) -> Any:
        out = list(self.constants)
        for slot, tensor in zip(self.slots, tensors):
            out[slot] = tensor
        return pytree.tree_unflatten(out, self.spec)
