"""The tuned-module wrapper and how it is put into, and taken out of, a model.

Tuning is in place: a tuned module stays the same object at the same place, with its
parameters, buffers and children, and its class becomes a subclass of its own whose
__call__ goes to its wrapper. So state_dict keys, .to(), .eval() and a reference to the
module taken before the tweak all see the model as before, and that reference's calls run
the tuned backend too. The wrapper is named by the module's full dotted path; its call is
the C dispatcher (torch_tweak._C.Dispatcher): in the original mode it calls the original
forward (through a view of the module of its own class), in the active mode the chosen
backend, in the record mode a recorder.
"""

from __future__ import annotations

import contextlib
import logging
import warnings
import weakref
from typing import Any, Callable, Iterable, Iterator

from torch import nn

from .. import _C
from .._core import records

MODE_ORIGINAL = _C.MODE_ORIGINAL
MODE_ACTIVE = _C.MODE_ACTIVE
MODE_RECORD = _C.MODE_RECORD

NO_MATCH = "no signature matched"
GRAD_MODE = "grad mode"
GRAPH_FALLBACK = "device graph fell back"
TRAIN_MODE = "train mode"
TRACE_FALLBACK = "trace fell back"
UNTUNED_REASONS = (NO_MATCH, GRAD_MODE, TRAIN_MODE, GRAPH_FALLBACK, TRACE_FALLBACK)
"""Why a call of a tuned module ran its original forward (TunedModule.tt_untuned)."""

_HINTS = {
    NO_MATCH: "the call fits none of its tuned input signatures (another shape, dtype, device, "
              "plain value or argument); tt.tune on such calls adds a signature",
    GRAD_MODE: "grad mode is on and an input or a weight requires grad, and its backend returns no "
               "autograd outputs; call the model under torch.inference_mode() or torch.no_grad()",
    TRAIN_MODE: "the module or one of its submodules is in train mode (model.train()), and its backends were "
                "built and checked in eval mode (dropout off, batch norm's running statistics); model.eval() runs "
                "the tuned path",
    GRAPH_FALLBACK: "the call does not fit the recorded device graph (another shape, dtype, device or "
                    "plain value)",
    TRACE_FALLBACK: "a model traced from the module (OpenVINO, ONNX Runtime) gave another answer than the module at "
                    "sizes no check had run on (a trace keeps the branch of the sizes it was traced on), or could "
                    "not take the call; the module's own forward answers calls of those sizes",
}

logger = logging.getLogger("torch_tweak")


GRAD_MODE_WARNING = ("torch-tweak: the tuned model was called in grad mode, so its tuned modules ran their "
                     "original forward (untuned, no faster). Call it under torch.inference_mode() (or "
                     "torch.no_grad()) to run the tuned path: `with torch.inference_mode(): y = model(x)`. "
                     "Such calls are counted in tt.status(model).")
"""The one warning (warnings channel) at a tuned model's first grad-mode call."""


def _notifier(wrapper: "TunedModule", reason: str | None = None, warned: set | None = None) -> Any:
    """What the dispatcher (or a GraphReplay, with `reason` fixed) calls at the first untuned
    call per reason: one warning through the "torch_tweak" logger. The first grad-mode call
    of the model (`warned` is shared by its wrappers) also warns on the warnings channel,
    which shows without logging set up. Holds the wrapper weakly."""
    ref = weakref.ref(wrapper)

    def notify(given: str | None = None) -> None:
        # the dispatcher gives the reason; a caller whose reason is fixed may give what failed
        why, detail = (reason, f" ({given})" if given else "") if reason is not None else (given, "")
        w = ref()
        name = (w.tt_name or "(root)") if w is not None else "a tuned module"
        logger.warning("torch-tweak: %s ran its original forward (%s): %s%s. Further such calls are "
                       "counted, not logged: see tt.status(model).", name, why, _HINTS.get(why, why), detail)
        if why == GRAD_MODE and warned is not None and GRAD_MODE not in warned:
            warned.add(GRAD_MODE)
            warnings.warn(GRAD_MODE_WARNING, UserWarning, stacklevel=2)

    return notify


class TunedModule(_C.Dispatcher, nn.Module):
    """A module of the model, tuned: calls go through the C dispatcher.

    tt_name: the full dotted path of the module in its model ("" for the root).
    tt_backend: the chosen backend (of the first signature), or None while untuned or when
    tuning failed.
    tt_signatures: the recorded input signatures (torch_tweak._core.signatures.SignatureGroup),
    each with its own backend and report.
    tt_report: what every candidate backend did per signature (state, latency, error).
    """

    def __init__(self, module: nn.Module, name: str) -> None:
        nn.Module.__init__(self)
        self._tt_bind(module)
        state = self.__dict__
        # Shared, not copied: the model keeps one set of weights and the same state_dict keys.
        state["_parameters"] = module._parameters
        state["_buffers"] = module._buffers
        state["_modules"] = module._modules
        state["training"] = module.training
        state["tt_name"] = name
        state["tt_backend"] = None
        state["tt_report"] = []
        state["tt_error"] = ""
        state["tt_samples"] = []
        state["tt_outputs"] = []
        state["tt_signatures"] = []
        if hasattr(_C, "enable_vectorcall"):
            _C.enable_vectorcall(type(self))

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        try:
            return nn.Module.__getattr__(self, name)
        except AttributeError:
            original = _C.Dispatcher._tt_original.__get__(self)
            if original is None:
                raise
            # The parent's code may read plain attributes of the module it called.
            return getattr(original, name)

    def train(self, mode: bool = True) -> "TunedModule":
        nn.Module.train(self, mode)
        self._tt_original.train(mode)
        return self

    @property
    def tt_active(self) -> bool:
        return self._tt_mode == MODE_ACTIVE

    # The wrapper's three states (original, active, recording) are set here and nowhere else.

    def tt_activate(self) -> bool:
        """Calls go to the chosen backends (by signature); False, and no change, when the
        wrapper has none (it keeps its original forward)."""
        if self.tt_backend is None:
            return False
        self._tt_mode = MODE_ACTIVE
        return True

    def tt_deactivate(self) -> None:
        """Calls go to the original forward; the backends stay, for tt_activate."""
        self._tt_mode = MODE_ORIGINAL

    @contextlib.contextmanager
    def tt_record_with(self, recorder: Callable[..., Any]) -> Iterator[None]:
        """Calls go to `recorder` inside the block; then the wrapper is back in the state it
        was in, with no recorder, however the block ends."""
        previous = self._tt_mode
        try:
            self._tt_set_recorder(recorder)
            self._tt_mode = MODE_RECORD
            yield
        finally:
            self._tt_mode = previous
            self._tt_set_recorder(None)

    def _tt_graphs(self) -> list:
        return [fn for _, fn in self._tt_entries if isinstance(fn, _C.GraphReplay)]

    def _tt_traces(self) -> list:
        """The call shapes proven of each traced model among the entries (backends._traced.Served)."""
        found = {id(s): s for s in (getattr(fn, "served", None) for _, fn in self._tt_entries) if s is not None}
        return list(found.values())

    @property
    def tt_untuned(self) -> dict[str, int]:
        """Calls since tuning (or the last tt_reset_untuned) that ran the original forward
        while the wrapper was active, by reason: "no signature matched", "grad mode" (see
        Backend.supports_autograd), "train mode" (the module or a submodule in train mode: its
        backends were built and checked in eval mode), "device graph fell back", "trace fell back"
        (a traced model's shape that failed its check, or a call it could not take: backends._traced)."""
        base = self.__dict__.get("_tt_graph_base", {})
        graph = sum(g.fallbacks - base.get(id(g), 0) for g in self._tt_graphs())
        trace = sum(t.fallbacks - base.get(id(t), 0) for t in self._tt_traces())
        return {NO_MATCH: self._tt_fallbacks, GRAD_MODE: self._tt_grad_fallbacks,
                TRAIN_MODE: self._tt_train_fallbacks, GRAPH_FALLBACK: graph, TRACE_FALLBACK: trace}

    @property
    def tt_calls(self) -> int:
        """Calls since tuning (or the last tt_reset_untuned), in every mode: tuning's own calls
        are not counted."""
        return self._tt_calls - self.__dict__.get("_tt_calls_base", 0)

    def tt_reset_untuned(self, notify: bool = False, warned: set | None = None) -> None:
        """Sets the untuned counts and tt_calls to 0. notify: the first untuned call per reason
        from now on logs one warning (logging.getLogger("torch_tweak")); False: none is logged.
        warned: a set shared by the wrappers of one model, so that the model's first grad-mode
        call also warns once on the warnings channel (see arm_untuned)."""
        self._tt_reset_untuned()
        self.__dict__["_tt_calls_base"] = self._tt_calls
        self._tt_set_notify(_notifier(self, None, warned) if notify else None)
        graphs, traces = self._tt_graphs(), self._tt_traces()
        self.__dict__["_tt_graph_base"] = {id(g): g.fallbacks for g in graphs + traces}
        for g in graphs:
            g.on_fallback = _notifier(self, GRAPH_FALLBACK) if notify else None
        for t in traces:  # installed: a call its model cannot take runs the module's own forward, counted
            t.strict = False
            t.on_fallback = _notifier(self, TRACE_FALLBACK) if notify else None

    def extra_repr(self) -> str:
        backend = self.tt_backend.name if self.tt_backend is not None else "original"
        return f"{self.tt_name or '(root)'!r}, backend={backend}, active={self.tt_active}"


_ROOT_CLASSES: dict[type, type] = {}


# A tuned module's __call__: _call_root(module, *args, **kwargs) is
# module.__dict__["_tt_root"](*args, **kwargs), in C (src/ext/rootcall.c), so a call of the
# module reaches its wrapper's dispatcher without a Python frame in between.
_call_root = _C.root_call


def _refuse_copy(self: nn.Module, *args: Any) -> Any:
    raise TypeError(f"{type(self).__name__} is tuned by torch-tweak, and a tuned module cannot be copied or "
                    "pickled (torch.save(model), copy.deepcopy): save the tuning with tt.save(model, path), "
                    "or tt.unwrap(model) first and tune the copy")


def _root_class(cls: type) -> type:
    """The subclass a tuned module gets: the same module, its call sent to the wrapper."""
    sub = _ROOT_CLASSES.get(cls)
    if sub is None:
        sub = type(cls.__name__, (cls,), {"__call__": _call_root, "_tt_root_class": cls,
                                          "__reduce_ex__": _refuse_copy, "__deepcopy__": _refuse_copy,
                                          "__module__": cls.__module__, "__qualname__": cls.__qualname__})
        _ROOT_CLASSES[cls] = sub
    return sub


def own_class(module: nn.Module) -> type:
    """The module's own class: a tuned module's class is a subclass of it (see install)."""
    return getattr(type(module), "_tt_root_class", type(module))


def _root_view(model: nn.Module) -> nn.Module:
    """An object of the module's own class sharing all its state: the original forward, what
    backends build on."""
    view = object.__new__(type(model))
    view.__dict__ = model.__dict__
    return view


def installed(model: nn.Module) -> dict[str, TunedModule]:
    """The wrappers installed in `model`, by path (a new dict; its record keeps them)."""
    record = records.of(model)
    return dict(record.wrappers) if record is not None else {}


def make_wrapper(model: nn.Module, path: str) -> TunedModule:
    return TunedModule(_root_view(model.get_submodule(path) if path else model), path)


def is_wrapped(module: nn.Module) -> bool:
    """Whether `module` is tuned in place (its calls go to a wrapper)."""
    return "_tt_root" in module.__dict__


def install(model: nn.Module, wrapper: TunedModule) -> None:
    """Tunes the module at the wrapper's path in place: the module object stays where it is,
    with its state, and its class becomes a subclass whose call goes to the wrapper, so a
    reference to it held from before the tweak runs the tuned backend too."""
    path = wrapper.tt_name
    table = records.made(model).wrappers
    if path in table:
        raise ValueError(f"module {path or '(root)'!r} is already wrapped")
    module = model.get_submodule(path) if path else model
    if is_wrapped(module):
        raise ValueError(f"module {path or '(root)'!r} is tuned already (the same module object is also at "
                         "another path of the model); tune it at one path")
    module.__dict__["_tt_root"] = wrapper
    module.__class__ = _root_class(type(module))
    table[path] = wrapper


def uninstall(model: nn.Module, wrapper: TunedModule) -> None:
    path = wrapper.tt_name
    record = records.of(model)
    table = record.wrappers if record is not None else {}
    if table.get(path) is not wrapper:
        return
    wrapper.tt_deactivate()
    module = model.get_submodule(path) if path else model
    module.__class__ = type(module)._tt_root_class
    del module.__dict__["_tt_root"]
    del table[path]


def install_all(model: nn.Module, paths: Iterable[str]) -> list[TunedModule]:
    """A new wrapper installed at each path, in order; when one cannot be, none is (the
    model is as it was) and the error is raised."""
    paths = list(paths)
    resolve_paths(model, paths)  # two names of one module, overlaps: refused before anything changes
    wrappers = [make_wrapper(model, path) for path in paths]
    done: list[str] = []
    try:
        for wrapper in wrappers:
            install(model, wrapper)
            done.append(wrapper.tt_name)
    except BaseException:
        unwrap(model, done)
        raise
    return wrappers


def unwrap(model: nn.Module, paths: Iterable[str] | None = None) -> None:
    """Puts the original modules back (all of them when `paths` is None)."""
    table = installed(model)
    targets = table.keys() if paths is None else paths
    if paths is None and getattr(model.__dict__.get("generate"), "_tt_decode_loop", False):
        del model.__dict__["generate"]  # tweak's decode loop (torch_tweak._runtime.decode.loop)
    # Deepest first, so a parent is never restored around a child that is still wrapped.
    for path in sorted(targets, key=lambda p: -p.count(".") - (p != "")):
        if path in table:
            uninstall(model, table[path])


def resolve_paths(model: nn.Module, modules: Any) -> list[str]:
    """The dotted paths of `modules` (paths or module objects), checked, before anything changes."""
    if isinstance(modules, (str, nn.Module)):
        modules = [modules]
    try:
        items = list(modules)
    except TypeError:
        raise TypeError(f"modules must be a path, a module or a list of them, not {type(modules).__name__}") from None
    names = {id(m): p for p, m in model.named_modules(remove_duplicate=False)}
    paths: list[str] = []
    for item in items:
        if isinstance(item, nn.Module):
            path = names.get(id(item))
            if path is None:
                raise ValueError(f"{type(item).__name__} object is not a module of this model")
        elif isinstance(item, str):
            path = item
            try:
                if path:
                    model.get_submodule(path)
            except AttributeError:
                raise ValueError(
                    f"{path!r} is not a module of this model; see [p for p, _ in model.named_modules()]"
                ) from None
        else:
            raise TypeError(f"a module to wrap is a dotted path or a module object, not {type(item).__name__}")
        if path in paths:
            raise ValueError(f"module {path or '(root)'!r} is given twice")
        paths.append(path)
    table = installed(model)
    for path in paths:
        if path in table:
            raise ValueError(f"module {path or '(root)'!r} is already wrapped; tt.unwrap(model) first")
        module = model.get_submodule(path) if path else model
        if isinstance(module, TunedModule) or is_wrapped(module):
            raise ValueError(f"module {path!r} is a torch-tweak wrapper already")
    everything = sorted(set(paths) | set(table))
    _refuse_aliases(model, paths, table)
    for a in everything:
        for b in everything:
            if a != b and (a == "" or b.startswith(a + ".")):
                wrapped = [p for p in (a, b) if p in table]
                hint = (f"{wrapped[0] or '(root)'!r} is wrapped already (tuned by tt.tweak or tt.wrap): "
                        "tt.unwrap(model) first" if wrapped else "wrap the modules of one cut")
                raise ValueError(f"modules {a or '(root)'!r} and {b!r} overlap: one is inside the other; {hint}")
    return paths


def _refuse_aliases(model: nn.Module, paths: list[str], table: dict) -> None:
    """ValueError when two of the paths (or one path and a wrapped module) reach one module
    object, or one's module holds the other's, through different names: a property alias such
    as transformers' ``base_model``, or one module shared at two places (tied embeddings)."""
    objects = {path: model.get_submodule(path) if path else model for path in dict.fromkeys([*paths, *table])}
    holders: dict[int, list[str]] = {}
    for path, module in objects.items():
        for inner in module.modules():
            holders.setdefault(id(inner), []).append(path)
    for b in paths:
        for a in holders.get(id(objects[b]), []):
            if a == b or a == "" or b.startswith(a + ".") or (b == "" or a.startswith(b + ".")):
                continue  # the same path, or an overlap the names show (refused below, with its own message)
            if objects[a] is objects[b]:
                raise ValueError(f"modules {a or '(root)'!r} and {b or '(root)'!r} are one module object under two "
                                 "names (an alias such as a property like base_model, or a module shared at two "
                                 "places such as tied embeddings); give it once, at one path")
            raise ValueError(f"modules {a or '(root)'!r} and {b or '(root)'!r} overlap: {b or '(root)'!r} is inside "
                             f"{a or '(root)'!r} under another name (an alias such as base_model, or a shared "
                             "module); wrap the modules of one cut")


def arm_untuned(model: nn.Module) -> None:
    """Inference starts: every wrapper of `model` counts its calls and untuned calls from 0 and
    logs the first untuned one per reason (tuning's own calls are neither counted nor logged);
    the model's first grad-mode call also warns once on the warnings channel. A backend that
    counts its calls (padded buckets' hits) counts from 0 too."""
    warned: set = set()
    for wrapper in installed(model).values():
        wrapper.tt_reset_untuned(notify=True, warned=warned)
        for group in wrapper.tt_signatures:
            if group.backend is not None:
                getattr(group.backend.callable, "reset_counts", lambda: None)()


def set_mode(model: nn.Module, active: bool) -> int:
    """Switches every tuned wrapper of `model`; returns how many were switched."""
    count = 0
    for wrapper in installed(model).values():
        if wrapper.tt_backend is not None:
            if active:
                wrapper.tt_activate()
            else:
                wrapper.tt_deactivate()
            count += 1
    return count
