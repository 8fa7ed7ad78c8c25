"""Recording samples for wrapped modules, and tuning each one with its strategy."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from typing import Any, Callable, Iterable, Iterator, Sequence

import torch
import torch.utils._pytree as pytree
from torch import nn

from .. import _C
from .._core import distributed, model_state, noise, records, settings
from . import isolation
from .._core._samples import Call, clone, fresh, load_dataset, resolve_device, synchronizer, unstorable
from ..backends.base import Backend, BackendUnavailable, ShapesVary
from .buildlog import BuildLog, capture_build, log_path
from .._core import correctness
from .._core.correctness import Finding, MismatchError, Reference, check
from .._core.layout import CallLayout
from .._runtime.module import TunedModule, arm_untuned, installed, own_class
from .._view.progress import Progress
from .._view.report import candidates_of, fold
from .._core.shapes import position_table
from .._core.signatures import (SignatureGroup, call_form, forward_params, group_for,
                                is_other, lay_out, merge_varying, proven_signatures)
from ..backends.strategy import Strategy, default_backends, default_strategy

logger = logging.getLogger("torch_tweak")


def record(wrappers: Iterable[TunedModule], run_dataset: Callable[[], None],
           run_edges: Callable[[], None] | None = None, model: nn.Module | None = None) -> None:
    """Runs the dataset once with `wrappers` recording their calls and original outputs,
    grouped by input signature (see torch_tweak._core.signatures), each group with its calls'
    layout (signatures.lay_out; with the position table of `model`, the whole model, where it
    has one). run_edges: then runs the calls at the ends of the declared shapes
    (torch_tweak._core.shapes), each recorded by every wrapper and added to its shape class's
    group, to be checked on and never measured."""
    wrappers = list(wrappers)
    edges: set[int] = set()  # ids of the samples the edge calls recorded
    mode = {"edges": None}
    with contextlib.ExitStack() as recording:
        for wrapper in wrappers:
            release(wrapper, keep_chosen=False)
            wrapper.tt_signatures.clear()
            wrapper.__dict__.pop("tt_writes_inputs", None)  # set again if a recorded call writes into its input
            recording.enter_context(wrapper.tt_record_with(_recorder(wrapper, mode)))
        run_dataset()
        if run_edges is not None:
            mode["edges"] = edges
            run_edges()
    positions = position_table(model) if model is not None else None
    for wrapper in wrappers:  # traffic whose sizes vary: one group per shape class
        params = forward_params(wrapper._tt_original)
        wrapper.tt_signatures[:] = merge_varying(wrapper.tt_signatures, wrapper.tt_samples, wrapper.tt_outputs,
                                                 params, edges)
        lay_out(wrapper.tt_signatures, params, positions)


def _recorder(wrapper: TunedModule, mode: dict) -> Callable[..., Any]:
    original = wrapper._tt_original
    groups = wrapper.tt_signatures
    samples = wrapper.tt_samples
    outputs = wrapper.tt_outputs
    params = forward_params(original)

    def recorder(*args: Any, **kwargs: Any) -> Any:
        group = group_for(groups, args, kwargs, params)  # the caller's own objects: what later calls match
        edges = mode["edges"]
        stored = len(group.samples) < settings.MAX_CALLS_PER_SIGNATURE or edges is not None
        # the call is copied before it runs: a key/value cache passed in grows during it, and a
        # module that writes into its input would leave the values it was not called with
        before = clone((args, kwargs)) if stored else None
        out, wrote = call_writing(original, args, kwargs)
        if wrote:
            wrapper.__dict__["tt_writes_inputs"] = True
        if before is not None:
            args, kwargs = before
            if group.signature is not None:  # stored as the backend will be called: the recorded layout
                args, kwargs = group.signature.bind(args, kwargs)
            sample, result = (args, kwargs), clone(out)
            if edges is not None:
                edges.add(id(sample))
            group.samples.append(sample)
            group.outputs.append(result)
            samples.append(sample)
            outputs.append(result)
        return out

    # never traced: a forward that transformers compiles (a static-cache generate()) calls the
    # recording wrapper inside it, and dynamo would trace these lists' growth, compiling again
    # at every call until its recompile limit
    return torch.compiler.disable(recorder)


@contextlib.contextmanager
def build_scopes(backends: Sequence[Backend], static: bool) -> Iterator[None]:
    """Every distinct Backend.build_scope of `backends`, entered once each."""
    with contextlib.ExitStack() as stack:
        for scope in dict.fromkeys(type(b).build_scope for b in backends):
            stack.enter_context(scope(static))
        yield


OUT_OF_MEMORY = getattr(torch, "OutOfMemoryError", torch.cuda.OutOfMemoryError)


def _tensors(call: Any) -> list[torch.Tensor]:
    return [leaf for leaf in pytree.tree_leaves(call) if isinstance(leaf, torch.Tensor)]


def _versions(call: Any) -> list:
    """The version counter of each tensor in a call (None for an inference tensor, which keeps
    none): one that moved across the call was written into in place."""
    return [model_state.version_of(t) for t in _tensors(call)]


def call_writing(fn: Callable[..., Any], args: tuple, kwargs: dict) -> tuple[Any, bool]:
    """fn(*args, **kwargs), and whether it wrote into a tensor it was given (its version
    counter moved; an inference tensor keeps none, so its values are compared instead)."""
    versions = _versions((args, kwargs))
    kept = [(t, t.clone()) for t, v in zip(_tensors((args, kwargs)), versions) if v is None]
    out = fn(*args, **kwargs)
    return out, _versions((args, kwargs)) != versions or any(not model_state.same_values(t, copy) for t, copy in kept)


WRITES_INPUTS = ("the module writes into a tensor it is given (an in-place operation on an argument, such as "
                 "nn.ReLU(inplace=True)), and {backend} would not write into the caller's tensor")


def _reason(exc: BaseException) -> str:
    """The engine's reason name for a failed build (tw_reason_name)."""
    if isinstance(exc, OUT_OF_MEMORY):
        return "out of memory"
    if isinstance(exc, BackendUnavailable):
        return "unavailable"
    if isinstance(exc, isolation.BuildCrashed):
        return "crashed"
    if isinstance(exc, MismatchError):
        return "mismatch"
    if isinstance(exc, ShapesVary):
        return "dynamic shapes"
    return "build failed"


class ModuleSearch:
    """The callbacks of the engine's module search (``_C.tune_module``, and ``_C.tweak``'s
    ``modules``): the engine walks each module's signature groups and their candidates
    and applies the strategy's rule; this builds, checks and runs what it asks for, and
    installs what it chose.

    wrapper_of(node) and strategy_of(node): the module's wrapper (recorded) and strategy
    template. done(node): called once a module's last group is committed (or at once when
    it has none). What only Python knows of a build (its reason, largest error and tolerance)
    goes to the engine with the build (see build), which keeps it in its result with the
    build time; group() flags the variants of effort= and precision=, which the engine stops
    building once tt.tweak's time_budget is used up, and the candidates that lower precision.
    """

    def __init__(self, wrapper_of: Callable[[int], TunedModule], strategy_of: Callable[[int], Strategy],
                 device: torch.device, progress: Progress | None, model_class: str,
                 done: Callable[[int], None] | None = None) -> None:
        self.wrapper_of = wrapper_of
        self.strategy_of = strategy_of
        self.device = device
        self.progress = progress
        self.model_class = model_class
        self.done = done
        self._open: _OpenGroup | None = None

    def groups(self, node: int) -> int:
        count = len(self.wrapper_of(node).tt_signatures)
        if count == 0 and self.done is not None:
            self.done(node)
        return count

    def group(self, node: int, g: int) -> tuple[str, str, tuple[str, ...], int, tuple[int, ...]]:
        wrapper = self.wrapper_of(node)
        group = wrapper.tt_signatures[g]
        strategy = self.strategy_of(node)
        module = wrapper._tt_original
        marked = strategy.fresh().variants_marked_for(module, group.samples, self.device)
        backends = [b for b, _ in marked]
        variants = frozenset(i for i, (_, variant) in enumerate(marked) if variant)
        label = wrapper.tt_name if len(wrapper.tt_signatures) == 1 else f"{wrapper.tt_name} {group.text}"
        state = model_state.snapshot(module)  # put back at commit, whatever the builds changed
        stack = contextlib.ExitStack()  # closed at commit: the engine commits every group it began
        try:
            stack.enter_context(torch.no_grad())
            stack.enter_context(build_scopes(backends, static=group.signature is not None and not group.varying))
        except BaseException:
            stack.close()
            raise
        stateful = any(unstorable(s) is not None for s in group.samples)  # a cache passed in: copied per call
        # a module that writes into its input is measured on copies, which it may change at will:
        # the recorded calls stay the ones the candidates are checked on
        calls = [clone(s) for s in group.samples] if wrapper.__dict__.get("tt_writes_inputs") else group.samples
        self._open = _OpenGroup(node, g, group, backends, module, state, stack, stateful, calls, label, variants)
        flags = tuple((_C.CANDIDATE_VARIANT if i in variants else 0)
                      | (_C.CANDIDATE_LOWERS_PRECISION if b.config.lowers_precision() else 0)
                      for i, b in enumerate(backends))
        # the calls at the declared shapes' ends (the last ones) are built and checked on, not measured
        return (group.text, strategy.kind, tuple(b.name for b in backends), len(group.samples) - group.declared, flags)

    def build(self, node: int, g: int, c: int) -> tuple[str, float, None]:
        """Builds and checks candidate c; returns its facts for the engine's result (reason,
        largest error, tolerance). A build that fails raises, its facts as the exception's
        ``tt_facts`` (see _C.ModuleSearch)."""
        o = self._current(node, g)
        backend, group, wrapper = o.backends[c], o.group, self.wrapper_of(node)
        if self.progress is not None:
            self.progress.step(o.label, f"building {backend.name}")
        path = log_path(self.model_class, wrapper.tt_name, group.key, backend.name)
        title = f"{backend!r} for {wrapper.tt_name or '(root)'} of {self.model_class}, signature {group.text}"
        with capture_build(path, title) as log:
            try:
                if o.reference is None:
                    o.reference = reference_of(o.module, group, o.state, log)
                    group.judged = correctness.judged_by(o.reference)
                worst = build_checked(backend, o.module, group.samples, group.outputs, self.device, o.state, log,
                                      writes=bool(wrapper.__dict__.get("tt_writes_inputs")), reference=o.reference,
                                      layout=group.layout)
            except Exception as exc:
                mismatch = isinstance(exc, MismatchError)
                _tell(exc, (_reason(exc), exc.error if mismatch else None, exc.tolerance if mismatch else None,
                            exc.own if mismatch else None))
                if isinstance(exc, OUT_OF_MEMORY) and torch.cuda.is_initialized():
                    torch.cuda.empty_cache()  # what the failed build cached goes back to the next candidate
                if mismatch:
                    log.outcome = f"failed the correctness check: {exc}"
                raise
            log.outcome = f"built; passed the correctness check ({correctness.describe_finding(worst)})"
        return ("", float(worst), worst.bound if worst.bound > 0 else None, worst.own)

    def run(self, node: int, g: int, c: int, i: int) -> None:
        o = self._open
        sample = o.calls[i]
        args, kwargs = fresh(sample) if o.stateful else sample
        o.backends[c].callable(*args, **kwargs)

    def commit(self, node: int, g: int, chosen: int) -> None:
        o, self._open = self._open, None
        if o is not None and (o.node, o.g) == (node, g):
            try:
                o.state.restore()  # measuring a train-mode module moves its batch-norm statistics
            finally:
                o.stack.close()
            o.group.backend = o.backends[chosen] if chosen >= 0 else None
            if o.group.backend is not None:
                o.group.unstorable = sum(not o.group.backend.can_store(s) for s in o.group.samples)
        wrapper = self.wrapper_of(node)
        if g == len(wrapper.tt_signatures) - 1:
            apply_groups(wrapper)
            if self.done is not None:
                self.done(node)

    def _current(self, node: int, g: int) -> "_OpenGroup":
        o = self._open
        if o is None or (o.node, o.g) != (node, g):
            raise RuntimeError(f"the engine asked for group {g} of node {node}, which is not open")
        return o


def _tell(exc: BaseException, facts: tuple) -> None:
    """Gives a failed build's facts to the engine with its exception (``tt_facts``)."""
    try:
        exc.tt_facts = facts  # type: ignore[attr-defined]
    except AttributeError:  # an exception that takes no attributes: the engine's "build failed"
        pass


@dataclasses.dataclass
class _OpenGroup:
    """The signature group the engine is searching: its candidates and what to put back."""

    node: int
    g: int
    group: SignatureGroup
    backends: list[Backend]
    module: nn.Module
    state: model_state.Snapshot
    stack: contextlib.ExitStack
    stateful: bool
    calls: list[Call]  # what the candidates are measured on: the recorded calls, or copies of them
    label: str
    variants: frozenset[int] = frozenset()  # the candidates an axis added (flagged CANDIDATE_VARIANT)
    reference: Reference | None = None  # the measured rule's reference, made at the group's first build


def absorb(wrapper: TunedModule, report: dict) -> None:
    """Copies what the engine's search of one module found (a ``_C`` module report, with its
    builds' facts) onto the wrapper's signature groups (report, error) and the wrapper
    (tt_report, tt_error); logs each candidate at DEBUG."""
    groups = wrapper.tt_signatures
    for group, found in zip(groups, report["groups"]):
        group.report = [dict(c, rule=group.judged) if group.judged else c for c in candidates_of(found)]
        group.error = found["error"]
        label = wrapper.tt_name if len(groups) == 1 else f"{wrapper.tt_name} {group.text}"
        for candidate, built in zip(group.report, found["candidates"]):
            logger.debug("%s: %s %s%s%s", label or "(root)", candidate["backend"], candidate["state"],
                         f" in {built['build_s']:.2f} s" if built["build_s"] is not None else "",
                         f", {candidate['latency_ms']:.3f} ms" if candidate["latency_ms"] is not None
                         else f": {fold(candidate['error'])}" if candidate["error"] else "")
    wrapper.tt_report = [dict(r, signature=g.text) for g in groups for r in g.report]
    wrapper.tt_error = report["error"]


def entry_flags(backend: Backend) -> int:
    """The dispatcher's flags for an entry of `backend`: serialised when it is not
    thread-safe, the original for calls autograd would record when it returns no
    autograd outputs (see Backend.thread_safe, Backend.supports_autograd)."""
    flags = 0
    if not backend.thread_safe:
        flags |= _C.ENTRY_SERIALIZE
    if not backend.supports_autograd:
        flags |= _C.ENTRY_NO_AUTOGRAD
    return flags


def apply_groups(wrapper: TunedModule) -> list[SignatureGroup]:
    """Gives the wrapper's dispatcher one (signature, callable, flags) entry per signature
    group that has a backend, and sets tt_backend (the first one's); returns those groups.

    "Any other call" gets one entry per signature its backend was proven on (its
    ``serves``, from its recorded calls: signatures.proven_signatures), none when it has
    no recorded call; while it has any, each earlier signature kept on the original gets
    an entry with no backend first, so that the wider entries never serve its calls (when
    such a signature is not known, as in a file, which stores no call of it, the proven
    signatures keep every size as recorded).
    A lone entry whose backend checks its inputs itself only has its call laid out by its
    signature: the values are checked once, by the backend, instead of twice. The
    untuned counters start again from 0 (see TunedModule.tt_untuned)."""
    groups = wrapper.tt_signatures
    other = next((g for g in groups if g.signature is None and g.backend is not None), None)
    if other is not None and other.samples:
        unknown = any(g.signature is None and g.backend is None and not is_other(g) for g in groups)
        other.serves = proven_signatures(other.samples, forward_params(wrapper._tt_original), sizes_fixed=unknown)
    chosen = [g for g in groups if g.backend is not None]
    if len(chosen) == 1 and chosen[0].signature is not None and chosen[0].backend.checks_inputs:
        group = chosen[0]
        flags = entry_flags(group.backend) | _C.ENTRY_LAYOUT_ONLY
        wrapper._tt_set_entries([(group.signature, group.backend.callable, flags)])
    else:
        entries: list[tuple] = []
        for g in groups:
            if g.signature is None:
                continue
            if g.backend is not None:
                entries.append((g.signature, g.backend.callable, entry_flags(g.backend)))
            elif other is not None and other.serves:
                entries.append((g.signature, None))  # kept on the original: counted, never the wider entries
        if other is not None:
            flags = entry_flags(other.backend)
            entries.extend((signature, other.backend.callable, flags) for signature in other.serves)
        wrapper._tt_set_entries(entries)
    # read per call on the module's tree as it is then: a call in train mode runs the original, and
    # so does a grad-mode call of a backend without autograd while a parameter requires grad
    wrapper._tt_set_module(wrapper._tt_original)
    wrapper.tt_backend = chosen[0].backend if chosen else None
    wrapper.tt_reset_untuned()
    for group in chosen:  # a backend that counts its calls (padded buckets' hits) counts the user's
        getattr(group.backend.callable, "reset_counts", lambda: None)()
    return chosen


def check_measure(measure: dict | None) -> None:
    """A measurement override names only known settings (values are checked by the engine)."""
    if measure is None:
        return
    if not isinstance(measure, dict):
        raise TypeError(f"measure must be a dict of measurement settings, not {type(measure).__name__}")
    known = _C.default_measure_config()
    unknown = sorted(set(measure) - set(known))
    if unknown:
        raise ValueError(f"unknown measurement setting {', '.join(unknown)}; known: {', '.join(sorted(known))}")


def measure_for(device: torch.device, measure: dict | None) -> dict | None:
    """The measurement settings tuning on `device` uses: `measure` as given, and on a device
    other than the CPU no untimed call opening each compared round (settle 0) unless
    `measure` names it. The call exists for a CPU, where a candidate's thread pool still
    spinning slows the next candidate's first call; a GPU's host side only launches."""
    if torch.device(device).type == "cpu" or (measure is not None and "settle" in measure):
        return measure
    return {**(measure or {}), "settle": 0}


def model_class_name(model: nn.Module) -> str:
    """The model's own class name (a wrapped root's class is a subclass of the same name)."""
    return own_class(model).__name__


class GivenCalls(Sequence):
    """The dataset's calls as they were given, a copy of them at each reading: what every run
    is given once the model was seen writing into its inputs (a run on the same tensors again
    would see them changed: x.mul_(0.5) at each run took them towards 0, and a module
    recorded then was tuned and measured on inputs no caller sends)."""

    def __init__(self, calls: Sequence[Call]) -> None:
        self.calls = [clone(call) for call in calls]

    def __len__(self) -> int:
        return len(self.calls)

    def __getitem__(self, i: Any) -> Any:
        if isinstance(i, slice):
            return [clone(call) for call in self.calls[i]]
        return clone(self.calls[i])

    def written(self, calls: Sequence[Call]) -> bool:
        """Whether a run changed a tensor of `calls` (which were equal to these)."""
        return any(not model_state.same_values(a, b) for given, now in zip(self.calls, calls)
                   for a, b in zip(_tensors(given), _tensors(now)))


def dataset_runner(model: nn.Module, calls: Sequence[Call]) -> Callable[[], None]:
    def run_all() -> None:
        with torch.no_grad():
            for args, kwargs in calls:
                model(*args, **kwargs)
    return run_all


def tune(model: nn.Module, dataset: Any, *, strategy: Strategy | None = None, device: Any = None,
         measure: dict | None = None, progress: bool = False, group: Any = None,
         tolerance: float | str = "measured") -> dict[str, str | None]:
    """Records samples for every wrapped module of `model` by running `dataset`, then tunes each
    with the engine's module search (the same as tt.tweak's).

    Returns {path: chosen backend name (of its first signature), or None when the module
    keeps its original forward}.
    Modules whose tuning fails keep their original forward; their reason is in
    ``wrapper.tt_error`` and ``wrapper.tt_report``.
    group: under torch.distributed, the ranks that tune together, as tt.tweak's (every rank
    wraps the same modules and calls tt.tune; the slowest rank's latency counts).
    tolerance: how candidates are judged, as tt.tweak's ("measured", "dtype" or a number).
    """
    rule = correctness.check_rule(tolerance)
    ranks = distributed.resolve(group, "tt.tune")
    with distributed.noted_alone(group, "tt.tune"), distributed.using(ranks), correctness.ruling(rule):
        device, paths, templates, calls = distributed.step(
            lambda: _tune_checked(model, dataset, strategy, device, measure), "checking tt.tune's arguments")
        if ranks is not None:  # before any collective whose sequence they decide
            ranks.same_settings({"strategies": [repr(t) for t in templates], "measure": measure_for(device, measure),
                                 "tolerance": rule.tolerance, "calls": len(calls), "device": device.type}, "tt.tune")
            ranks.same(paths, "the wrapped modules")
            ranks.same_calls([call_form(c) for c in calls], "of the dataset")  # before the model runs on them
        wrappers = installed(model)
        shown = Progress(progress and (ranks is None or ranks.rank == 0))
        search = ModuleSearch(lambda node: wrappers[paths[node]],
                              lambda node: templates[node] if templates[node] is not None else default_strategy(device),
                              device, shown, model_class_name(model))
        timing = {"sync": synchronizer(device)}
        if ranks is not None:  # every step agreed on, the slowest rank's clock
            ranks.agreeing(search, lambda node: paths[node])
            timing = {"sync": ranks.sync_with(timing["sync"]), "clock": ranks.clock}
        chosen: dict[str, str | None] = {}
        with model_state.kept(model):  # recording a train-mode model moves its batch-norm statistics
            distributed.step(lambda: record(wrappers.values(), dataset_runner(model, calls), model=model),
                             "recording the calls")
            for node, path in enumerate(paths):
                wrapper = wrappers[path]
                try:
                    report = _C.tune_module(search, node, path=path, config=measure_for(device, measure), **timing)
                finally:
                    release(wrapper)
                absorb(wrapper, report)
                if not wrapper.tt_activate():
                    wrapper.tt_deactivate()
                chosen[path] = wrapper.tt_backend.name if wrapper.tt_backend is not None else None
        shown.close()
        arm_untuned(model)
        records.made(model).rule = rule
        return chosen


def _tune_checked(model: nn.Module, dataset: Any, strategy: Strategy | None, device: Any,
                  measure: dict | None) -> tuple:
    """tt.tune's arguments checked: (the device, the wrapped paths, each one's strategy template
    or None, the dataset's calls)."""
    wrappers = installed(model)
    if not wrappers:
        raise ValueError("the model has no wrapped modules: call tt.wrap(model, modules) first")
    device = resolve_device(model, device)
    default_backends(device)  # an unknown device fails here, before anything changes
    if strategy is not None and not isinstance(strategy, Strategy):
        raise TypeError(f"strategy must be a torch_tweak strategy, not {type(strategy).__name__}")
    check_measure(measure)
    paths = list(wrappers)
    templates = [strategy if strategy is not None else getattr(wrappers[p], "tt_strategy", None) for p in paths]
    for template in templates:
        if template is not None:
            template.check_device(device)  # a backend this device cannot run fails here
    return device, paths, templates, load_dataset(dataset, device)


def release(wrapper: TunedModule, keep_chosen: bool = True) -> None:
    """Drops what tuning recorded, once no backend needs it (the signatures and reports stay).

    The recorded calls and outputs of a signature whose backend was chosen stay unless
    keep_chosen is False: tt.save stores them, for the backend to be built on again at
    load and checked against the outputs."""
    wrapper.tt_samples.clear()
    wrapper.tt_outputs.clear()
    for group in wrapper.tt_signatures:
        if group.backend is None or not keep_chosen:
            group.release()


def rebuild_group(wrapper: TunedModule, group: SignatureGroup, backend: Backend, device: torch.device,
                  model_class: str, bounded: bool = False) -> Finding:
    """Builds `backend` again for one signature on its recorded calls, with no measurement
    (a saved plan or a tuning-cache entry chose it), and checks it against the recorded
    outputs. Raises when it fails to build or to match; returns the worst finding.
    bounded: the calls, outputs and tolerance came from a file (the tolerance is capped, see
    settings.MAX_TOLERANCES): under the measured rule the outputs the candidate is judged
    against are the module's own, run here, and the file's must agree with them by the same
    rule (a file's numbers never widen a check)."""
    module = wrapper._tt_original
    state = model_state.snapshot(module)
    path = log_path(model_class, wrapper.tt_name, group.key, backend.name)
    title = f"{backend!r} for {wrapper.tt_name or '(root)'} of {model_class}, signature {group.text} (rebuilt)"
    static = group.signature is not None and not group.varying
    with capture_build(path, title) as log, torch.no_grad(), build_scopes([backend], static):
        # the module may have come to write into its input since the plan was made (its code changed)
        args, kwargs = clone(group.samples[0])
        writes = call_writing(module, args, kwargs)[1]
        put_back(state, log)
        outputs = group.outputs
        if bounded and backend.check_tolerance() is None and correctness.rule().measured:
            outputs = _own_outputs(module, group.samples)
            put_back(state, log)
        reference = reference_of(module, dataclasses.replace(group, outputs=outputs), state, log)
        if reference.measured and outputs is not group.outputs:
            for j, (stored, own) in enumerate(zip(group.outputs, outputs)):
                # a file's reference with no finite value accepts no backend, whatever the module gives
                correctness.comparable(stored, where=f"sample {j} output", whose="the file's recorded output")
                try:
                    check(stored, own, where=f"sample {j} output", high=reference.outputs[j])
                except MismatchError as exc:
                    raise MismatchError(f"the file's recorded outputs are not this module's ({exc}); its weights or "
                                        "code may have changed since it was saved: tune it again here",
                                        exc.error, exc.tolerance, exc.own) from None
        worst = build_checked(backend, module, group.samples, outputs, device, state, log, bounded, writes,
                              reference, group.layout)
        log.outcome = f"rebuilt; passed the correctness check ({correctness.describe_finding(worst)})"
    return worst


def _own_outputs(module: nn.Module, samples: Sequence[Call]) -> list[Any]:
    """The module's own outputs on `samples`, run here (each on a copy of its call)."""
    return [clone(module(*args, **kwargs)) for args, kwargs in (clone(s) for s in samples)]


def reference_of(module: nn.Module, group: SignatureGroup, state: model_state.Snapshot, log: BuildLog) -> Reference:
    """The measured rule's reference of one signature group (correctness.reference), said in
    the build log; whatever its runs changed in the module is put back."""
    try:
        with torch.no_grad():
            found = correctness.reference(module, group.samples, group.outputs)
    finally:
        put_back(state, log)
    ranks = distributed.current()
    if ranks is not None:  # every rank judges by one rule: the measured one only where every rank has it
        missing = [r for r, measured in enumerate(ranks.gather(found.measured)) if not measured]
        if missing and found.measured:
            found = Reference(None, why=f"rank {missing[0]} has no higher-precision reference")
    if found.measured:
        log.notes.append(f"reference: the module at {str(found.dtype).replace('torch.', '')} on its recorded "
                         f"calls ({found.seconds:.2f} s)")
    else:
        log.notes.append(f"no higher-precision reference ({noise.without_advice(found.why)}): the fixed rule holds")
    return found


def build_checked(backend: Backend, module: nn.Module, samples: Sequence[Call], refs: Sequence[Any],
                  device: torch.device, state: model_state.Snapshot, log: BuildLog, bounded: bool = False,
                  writes: bool = False, reference: Reference | None = None,
                  layout: CallLayout | None = None) -> Finding:
    """Builds `backend` for `module` (first in an isolated child when the backend asks for it)
    and checks it on `samples` against `refs`; returns the largest error. Whatever the build
    and the check changed in the module (its structure: hooks, attributes, submodules,
    registrations; training flags, parameters, buffers) is put back, also when they raise, and
    written in the build log. The structure is put back before the check: the candidate is
    checked on the module as the user will have it. bounded: the tolerance came from a file.
    writes: the module writes into its inputs: a backend that does not write back
    (keeps_input_writes) is refused, and the build and each check get copies of the calls
    (else only a key/value cache in them is copied). reference: the measured rule's
    (correctness.reference) for these calls; None or one without outputs: the fixed rule.
    The backend is given the original's own errors (Backend.own_errors) before it builds, for
    the calls it checks itself later (a size first seen after tuning), and the calls' layout
    (Backend.layout: the group's, made where its calls were grouped)."""
    if writes and not backend.keeps_input_writes:
        raise ValueError(WRITES_INPUTS.format(backend=backend.name))
    refused = distributed.enter_build(backend)
    if refused is not None:
        raise BackendUnavailable(refused)
    # under torch.distributed each step is agreed on by every rank (a failure anywhere fails it everywhere)
    step = distributed.step
    copy = clone if writes else fresh
    backend.layout = layout  # the child of an isolated build is given it too
    if backend.isolate_build:
        isolation.check(backend, module, samples, device, log.notes)  # raises BuildCrashed
    measured = reference is not None and reference.measured and backend.check_tolerance() is None
    backend.own_errors = reference.own if measured else None
    try:
        try:
            # a key/value cache in a call grows at every call: each use gets its own copy
            fn = step(lambda: backend.prepare(module, [copy(s) for s in samples], device), "the build")
        finally:
            put_back(state, log)  # before the check: weights a backend moved are back on their device
        found = []
        for j, sample in enumerate(samples):
            args, kwargs = copy(sample)
            high = reference.outputs[j] if measured else None
            found.append(step(lambda: check(fn(*args, **kwargs), refs[j], backend.check_tolerance(),
                                            where=f"sample {j} output", bounded=bounded, high=high),
                              f"the check of sample {j}"))
        worst = correctness.worst(found)
    finally:
        put_back(state, log)
    return worst


def put_back(state: model_state.Snapshot, log: BuildLog) -> None:
    changes = state.restore()
    if changes:
        log.notes.append(f"restored {len(changes)} changes the build made to the module:")
        log.notes.extend(f"  {line}" for line in changes)
