"""tt.tweak: tune every cut of a model and keep the fastest."""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import logging
import weakref
from typing import Any, Iterator, Literal

import torch
from torch import nn

from . import _C
from .backends import axes
from ._core import correctness, distributed, model_state, noise, records, settings
from ._runtime.decode import loop as decode_loop
from ._store import tuning_cache
from ._core import cpu_load
from ._core.storage import printable
from ._core._samples import load_dataset, resolve_device, synchronizer
from ._runtime.inspecting import ModuleTree, trace
from ._runtime.module import arm_untuned, installed, unwrap
from ._search.plan import plan_of
from ._view.progress import Progress
from ._view.result import TweakResult, speak_tokens
from ._search.session import Session, engine_log
from .backends.strategy import Strategy, default_backends, default_strategy
from ._store.serial import Unstorable
from ._core.shapes import check_calls, check_model, check_shapes, edge_calls
from ._core.signatures import call_form, forward_params, label_pairs
from ._search.tuning import GivenCalls, check_measure, dataset_runner, measure_for, release
from ._runtime.workload import Workload
from ._search import loop_search

_DEFAULTS = _C.default_tweak_config()  # the engine owns every default of the depth search

DEFAULT_MAX_DEPTH: int = _DEFAULTS["max_depth"]
"""The deepest cut tweak tries unless told: 1, the model and its children. Depth 2 was the
fastest on none of the benchmarked models (the GPU run that searched it,
bench/results/runs/gpu-d149c65.json, and the CPU example) and took a third of the tuning
time on ResNet-50 (bench/results/tuning_time.md); max_depth=2, or None for every depth,
searches deeper."""
DEFAULT_BUSY_BUDGET: float = _C.BUSY_BUDGET
"""The busy budget in seconds (tt.tweak's busy_budget, the engine's TW_BUSY_BUDGET_NS): 120."""

Effort = Literal["default", "high"]
"""The values of tt.tweak's ``effort``."""

DEFAULT_TIE_TOLERANCE: float = _DEFAULTS["tie_tolerance"]
"""A depth within 2 % of the fastest counts as a tie; the shallowest tie wins."""


logger = logging.getLogger("torch_tweak")


def tweak(model: nn.Module, dataset: Any = None, *, workload: Any = None, min_depth: int = 0,
          max_depth: int | None = DEFAULT_MAX_DEPTH, strategy: Strategy | None = None,
          tie_tolerance: float = DEFAULT_TIE_TOLERANCE, time_budget: float | None = None, dry_run: bool = False, device: Any = None,
          progress: bool | None = None, measure: dict | None = None, cache: bool = True, effort: Effort = "default",
          precision: dict[str, float] | None = None, shapes: dict[str, tuple[int, int]] | None = None,
          group: Any = None, tolerance: float | str = "measured",
          busy_budget: float | None = DEFAULT_BUSY_BUDGET) -> TweakResult:
    """Tunes `model` in place at every depth from min_depth to max_depth and keeps the fastest.
    Returns a TweakResult, a report: keep calling the model itself, under
    torch.inference_mode() (in grad mode a backend without autograd runs the original
    forward). A model with any module in training mode is refused (ValueError) before
    anything runs: call model.eval() first.

    See the module docs and docs/tweak.md for the rules. ``measure`` overrides the
    engine's measurement settings (keys of torch_tweak._C.default_measure_config()).
    ``cache``: reuse and keep the result in the tuning cache (docs/cache.md); False neither
    reads nor writes it. ``workload``: instead of a dataset, a callable that runs the model,
    e.g. ``lambda m: m.generate(ids, max_new_tokens=64)`` (docs/generate.md); what tweak
    measures is then one run of it, and a workload is never cached. ``effort``: "default", or
    "high" to also try, on the heavy modules (the model and those taking at least 20 % of its
    time), channels-last, every SDPA kernel (CUDA), max-autotune and combo kernels (CUDA)
    (torch_tweak.backends.axes).
    ``precision``: {policy: tolerance} of lower-precision candidates you allow ("tf32",
    "bf16", "int8", "fp8"), each checked against its tolerance; None (the default): none.
    Once ``time_budget`` is used up, the variants of either not built yet are left out.
    ``shapes``: ranges the traffic's sizes take beyond the dataset's, ``{"batch": (1, 32), "length": (8, 512)}``:
    candidates are also checked at both ends; the padded backend serves them (docs/serving.md).
    ``group``: under torch.distributed (torchrun, a tensor-parallel model), the ranks that
    tune together, each its own shard, every decision taken by all of them (the slowest
    rank's latency counts; every rank keeps the same plan): None (the default) is the
    default group when one is initialised with several processes, False tunes this process
    alone, or a ProcessGroup (docs/tweak.md, "Tensor-parallel models").
    ``progress``: the progress display on stderr: None (the default) shows it, under
    torch.distributed on rank 0 alone; True shows it on this rank whatever its rank; a tweak
    that does not show it prints nothing (logging's last resort, which prints warnings where no
    handler is configured, does not print torch_tweak's during it; your handlers get them).
    ``tolerance``: how a candidate's outputs are judged against the original's (docs/tweak.md,
    "What "the same answers" means"): "measured" (the default: its error against a
    higher-precision run of the module within 4x the original's own, per output tensor; for
    generate(), greedy tokens may part only at a near-tie), "dtype" (a fixed relative tolerance
    per dtype, torch_tweak.TOLERANCES), or a number from 0 to 1 (that relative tolerance for
    every output; 0: bit-identical outputs and tokens). A backend config's own tolerance and the
    precision= policies keep theirs.
    ``busy_budget``: seconds a tweak may take once the machine is found busy (other processes
    taking more than a quarter of the CPUs while the untuned model is measured): depths not
    started by then are not tried, and the result says so (docs/tweak.md, "A busy machine");
    None: only time_budget bounds it.
    """
    rule = correctness.check_rule(tolerance)
    _check_busy_budget(busy_budget)
    ranks = distributed.resolve(group)
    if progress not in (None, True, False):
        raise TypeError(f"progress must be True, False or None (rank 0 alone under torch.distributed), not {progress!r}")
    speaks = progress if progress is not None else ranks is None or ranks.rank == 0
    shown = Progress(speaks)
    with distributed.noted_alone(group, "tt.tweak"), distributed.using(ranks), _voiced(shown), _own_runs():
        device, measuring, asked, job, calls, limits = distributed.step(lambda: _checked(
            model, dataset, workload=workload, strategy=strategy, device=device, measure=measure, cache=cache,
            effort=effort, precision=precision, min_depth=min_depth, max_depth=max_depth,
            tie_tolerance=tie_tolerance, time_budget=time_budget), "checking tt.tweak's arguments")
        if ranks is not None:  # before any collective whose sequence they decide
            ranks.same_settings(dict(limits, shapes=_shapes_setting(shapes), tolerance=rule.tolerance, asked=asked,
                                     strategy=_strategy_setting(strategy, device), measure=measuring,
                                     calls=len(calls) if job is None else "a workload", cache=cache,
                                     dry_run=bool(dry_run), device=device.type), "tt.tweak")
            if job is None:  # before the model first runs on them: its collectives pair the calls' tensors
                ranks.same_calls([call_form(c) for c in calls], "of the dataset")
        strategy, edges = distributed.step(
            lambda: _declared(model, shapes, calls, job, strategy, device), "checking shapes=")
        # Tracing, recording and measuring run the model; anything they or a build changed is put
        # back when the tweak ends, however it ends.
        with model_state.kept(model), correctness.ruling(rule):
            result = _tweak(model, calls, job, device, measuring, asked, strategy=strategy,
                            shown=shown, dry_run=dry_run,
                            cache=cache, limits=limits,
                            settings={"measure": measure, "effort": effort, "busy_budget": busy_budget},
                            edges=edges)
            if ranks is not None and not dry_run:
                _same_plan(model, ranks)
            return result


def _shapes_setting(shapes: Any) -> Any:
    """shapes= as the ranks compare it: its checked form, or as given when it is not valid (the
    step that checks it then fails on every rank)."""
    try:
        declared = check_shapes(shapes)
    except (TypeError, ValueError):
        return repr(shapes)
    return None if declared is None else declared.as_dict()


def _strategy_setting(strategy: Strategy | None, device: torch.device) -> str:
    """The strategy as the ranks compare it: its class and backends (the defaults by name: an
    optional backend installed on one host only changes the candidates)."""
    if strategy is not None:
        return repr(strategy)
    return "the defaults: " + ", ".join(b.name for b in default_backends(device))


RECOMPILE_LINE = {"torch._dynamo.convert_frame": ("torch._dynamo hit config.",)}
"""That line, dropped during a tweak's own runs should they still reach the raised limit."""


@contextlib.contextmanager
def _own_runs() -> Iterator[None]:
    """Inside a tweak: dynamo's recompile limits raised (DYNAMO_RECOMPILES) and its limit line dropped;
    both as the user had them afterwards."""
    import torch._dynamo.config as dynamo_config

    raised = {name: max(limit, getattr(dynamo_config, name)) for name, limit in settings.DYNAMO_RECOMPILES.items()
              if hasattr(dynamo_config, name)}
    with dynamo_config.patch(raised), noise.dropped(RECOMPILE_LINE):
        yield


class _Noted(logging.Handler):
    """torch_tweak's warnings as lines of the progress display (Progress.note: "torch-tweak: "
    and the message, the status line cleared first), where logging's last resort would print
    them bare between its lines."""

    def __init__(self, shown: Progress) -> None:
        super().__init__(logging.WARNING)
        self.shown = shown

    def emit(self, record: logging.LogRecord) -> None:
        try:
            self.shown.note(record.getMessage())
        except Exception:  # noqa: BLE001 - logging's rule: a handler never raises
            self.handleError(record)


@contextlib.contextmanager
def _voiced(shown: Progress) -> Iterator[None]:
    """Where no handler takes torch_tweak's records, logging's last resort would print its
    warnings (a depth not kept, a busy machine) on stderr, bare. While a tweak runs they are
    lines of its progress display instead, with its "torch-tweak: " prefix; a tweak that does not
    speak (progress=False, or a rank other than 0 under torch.distributed) prints nothing: a
    NullHandler takes them. Handlers you configured get them as always."""
    if logger.hasHandlers():
        yield
        return
    handler = _Noted(shown) if shown.enabled else logging.NullHandler()
    logger.addHandler(handler)
    try:
        yield
    finally:
        logger.removeHandler(handler)


def _tweak(model: nn.Module, calls: Any, job: Workload | None, device: torch.device, measuring: dict | None,
           asked: Any, *, strategy: Strategy | None, shown: Progress, dry_run: bool, cache: bool,
           limits: dict, settings: dict, edges: list) -> TweakResult:
    """tt.tweak once its arguments passed: the tuning cache, else the engine's search.
    limits: the depth search's settings as checked (the engine's forms); the declared shapes
    are the strategy's (Strategy.shapes: one owner, handed down with the backends)."""
    declared = strategy.shapes if strategy is not None else None
    min_depth, max_depth, time_budget = limits["min_depth"], limits["max_depth"], limits["time_budget"]
    speaks_tokens = False
    if job is not None:
        loop_search.record(job)
        speaks_tokens = job.generates and not dry_run
    if speaks_tokens:
        # the decode loop first: the depths are then tuned and measured under it, and a
        # loop's decode steps replay the untuned model, so module tuning serves the prefill
        _choose_loop(job, device, measuring, shown, high=bool(asked) and asked.effort == "high")
    compiled_loop = job is not None and job.loop in decode_loop.COMPILED_LOOPS
    kept = GivenCalls(calls) if job is None else None
    with decode_loop.uncompiled(model):  # hooks traced into transformers' compiled forward compile it again
        tree = ModuleTree(model, distributed.step(lambda: trace(model, calls, job.run if job is not None else None),
                                                  "running the dataset"))
    if kept is not None and kept.written(calls):
        calls = kept  # the model writes into its inputs: every later run gets the calls as they were given
    depths = tree.depths(min_depth, max_depth)
    ranks = distributed.current()
    if ranks is not None:
        ranks.same([tree.tree.path(n) for n in range(len(tree.tree))], "the modules the dataset called")
    if asked:  # the axes' variants, max-autotune for the modules that take most of the time
        strategy = (strategy if strategy is not None else default_strategy(device)).with_axes(
            dataclasses.replace(asked, heavy=axes.heavy_modules(model, tree)))
    key = parts = None
    if cache and not dry_run and job is None:
        # the settings as checked, the engine's forms, and the correctness rule
        wanted = dict(limits, measure=settings["measure"], tolerance=correctness.rule().tolerance)
        if declared:
            wanted["shapes"] = declared.as_dict()
        if asked:
            wanted.update(effort=settings["effort"], precision=[list(p) for p in asked.precision])
        if ranks is not None:  # each rank its own entry: its shard, its rank's plan
            wanted.update(ranks=[ranks.rank, ranks.size])
        key, parts = _cache_key(model, calls, device, strategy, wanted)
        if ranks is not None and not ranks.all(key is not None):
            key = parts = None  # a rank that cannot cache: none does
        if key is not None:
            result = _from_cache(model, tree, calls, device, strategy, key, parts, shown)
            if result is not None:  # plan.apply kept the strategy's shapes (the record's), as the entry was tuned
                arm_untuned(model)
                decode_loop.arm(model)
                return result
    session = _session(model, tree, calls, job, strategy, device, measuring, shown, depths, dry_run=dry_run,
                       speaks_tokens=speaks_tokens, compiled_loop=compiled_loop, edges=edges)
    engine = _search(model, session, calls, job, shown, device, **limits, dry_run=dry_run, config=measuring,
                     busy_budget=settings.get("busy_budget", DEFAULT_BUSY_BUDGET))
    result = _kept(model, engine, tree, session, time_budget, dry_run)
    if speaks_tokens:
        speak_tokens(result, job)
    if key is not None:
        tuning_cache.write(key, tuning_cache.entry_of(parts, result.to_record(), result.modules, model,
                                                      result.selected_depth))
    outcome = result.outcome()
    _mark_busy(model, result)
    logger.info("tweak of %s: %s", session.model_class, outcome)
    shown.finish(outcome)
    arm_untuned(model)
    decode_loop.arm(model)
    return result


def _check_busy_budget(busy_budget: Any) -> None:
    """busy_budget= is a number of seconds >= 0 or None (ValueError before anything runs)."""
    if busy_budget is None:
        return
    if isinstance(busy_budget, bool) or not isinstance(busy_budget, (int, float)) or not busy_budget >= 0 \
            or busy_budget == float("inf"):
        raise ValueError(f"busy_budget must be a number of seconds >= 0 or None, got {busy_budget!r} (the "
                         "model was not changed)")


def _mark_busy(model: nn.Module, result: TweakResult) -> None:
    """tt.status shows a kept figure measured on a busy machine as such (the record's busy)."""
    busy = None
    if result.measurement_quality == "busy" and result.selected_depth is not None:
        # a cache hit's figure is the first tweak's: marked so, with its time
        busy = result.outcome() + (f" {result.cache_note()}" if result.cached else "")
    records.made(model).busy = busy


def plan_digest(model: nn.Module) -> str:
    """What the installed plan decided, as one line per tuned module: its path and, per
    signature, the backend kept (its label) or "original"; what the ranks compare."""
    record = records.of(model)
    lines = [f"depth {record.depth if record is not None else None}"]
    for planned in plan_of(model).modules:
        chosen = ", ".join(f"{g.text}: {g.backend!r}" if g.backend is not None else f"{g.text}: original"
                           for g in planned.groups)
        lines.append(f"{planned.path or '(root)'} [{chosen}]")
    return "\n".join(lines)


def _same_plan(model: nn.Module, ranks: "distributed.Ranks") -> None:
    """Every rank installed the same plan, or the model is unwrapped on every rank and the
    difference raised."""
    digests = ranks.gather(hashlib.sha256(plan_digest(model).encode()).hexdigest())
    if len(set(digests)) == 1:
        return
    mine = plan_digest(model)
    unwrap(model)
    raise RuntimeError(f"the ranks installed different plans (digests {', '.join(d[:12] for d in digests)}); "
                       f"every rank's model is untuned again. This rank ({ranks.rank}) had:\n{mine}")


def _checked(model: nn.Module, dataset: Any, *, workload: Any, strategy: Strategy | None, device: Any,
             measure: dict | None, cache: Any, effort: Any, precision: Any, min_depth: int, max_depth: int | None,
             tie_tolerance: float, time_budget: float | None) -> tuple:
    """tt.tweak's arguments checked before anything runs: (device, the measurement config, the
    axes asked for, the workload or None, the dataset's calls or None, the depth search's
    settings as the engine checked them: the one value the cache hashes and the engine gets)."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, not {type(model).__name__}")
    # the engine's rules, raised before anything runs
    limits = _C.check_tweak_config(min_depth=min_depth, max_depth=max_depth, tie_tolerance=tie_tolerance,
                                   time_budget=time_budget)
    if not isinstance(cache, bool):
        raise TypeError(f"cache must be True or False, not {cache!r}; tt.clear_cache() empties the cache")
    if strategy is not None and not isinstance(strategy, Strategy):
        raise TypeError(f"strategy must be a torch_tweak strategy (e.g. tt.FirstWinsStrategy()), "
                        f"not {type(strategy).__name__}")
    if installed(model):
        raise ValueError("the model already has torch-tweak wrappers; call tt.unwrap(model) before a new tweak")
    _refuse_training(model)
    device = resolve_device(model, device)
    default_backends(device)  # an unknown device fails here, before anything changes
    if strategy is not None:
        strategy.check_device(device)  # so does a backend this device can never run
    check_measure(measure)
    measuring = measure_for(device, measure)
    axes.check_effort(effort)
    asked = axes.Axes(effort, tuple(sorted(axes.check_precision(precision, device).items())))
    if asked:
        (strategy if strategy is not None else default_strategy(device)).with_axes(asked)  # raises when it cannot
    if workload is not None:
        if distributed.current() is not None:
            raise ValueError("a workload (generate()) is not tuned under torch.distributed yet: pass a dataset of the "
                             "model's forward calls (the same on every rank), or group=False to tune each process "
                             "alone")
        if dataset is not None:
            raise TypeError("pass a dataset or a workload, not both: a workload is a callable that runs the model, "
                            "e.g. workload=lambda m: m.generate(ids, max_new_tokens=64)")
        return device, measuring, asked, Workload(model, workload, device), None, limits
    if dataset is None:
        raise TypeError("tt.tweak needs a dataset, e.g. tt.tweak(model, [x1, x2]), or a workload, "
                        "e.g. tt.tweak(model, workload=lambda m: m.generate(ids, max_new_tokens=64))")
    calls = load_dataset(dataset, device)
    pairs = label_pairs(model, calls)
    if pairs is not None:
        raise TypeError(pairs)
    return device, measuring, asked, None, calls, limits


def _declared(model: nn.Module, shapes: Any, calls: Any, job: Workload | None, strategy: Strategy | None,
              device: torch.device) -> tuple:
    """(the strategy, given the declared shapes (Strategy.shapes); the calls at their ends):
    shapes= checked against the dataset's calls before anything runs (TypeError or ValueError;
    the model is untouched)."""
    declared = check_shapes(shapes)
    if declared is None:
        return strategy, []
    if job is not None:
        raise TypeError("shapes= declares the sizes of a dataset's calls; a workload (generate()) tunes its own "
                        "calls: leave shapes=None, or pass a dataset")
    check_model(declared, model)
    params = forward_params(model)
    check_calls(declared, calls, params)
    strategy = (strategy if strategy is not None else default_strategy(device)).with_shapes(declared)
    return strategy, edge_calls(declared, calls, params)


def _session(model: nn.Module, tree: ModuleTree, calls: Any, job: Workload | None, strategy: Strategy | None,
             device: torch.device, measuring: dict, shown: Progress, depths: list, *, dry_run: bool,
             speaks_tokens: bool, compiled_loop: bool, edges: list = ()) -> Session:
    """The callbacks of one tweak's engine search, with its progress planned; edges: the calls
    at the declared shapes' ends, recorded with the dataset's."""
    run_dataset = dataset_runner(model, calls) if job is None else job.run
    session = Session(model, tree, run_dataset, strategy, device, measuring, shown, depths)
    session.run_edges = dataset_runner(model, edges) if edges else None
    modules = {n for d in depths for n in tree.tree.cut(d)}
    # each module tuned once, each measurement; a module weighs the called modules it holds
    sizes = _subtree_sizes(tree)
    shown.plan(len(modules) + len(depths) + 2, {tree.tree.path(n): sizes[n] for n in modules})
    if not dry_run:
        shown.phase("measuring the untuned model")
    if speaks_tokens:
        session.on_measure = lambda depth: loop_search.check_depth(job, depth)
    if compiled_loop:
        session.refuse = (f"the decode steps run transformers' compiled forward (decode loop \"{job.loop}\"), "
                          "which must see the model's own modules to give the untuned tokens")
    elif speaks_tokens:
        session.refuse = loop_search.depths_cannot_match(job)
    return session


def _subtree_sizes(tree: ModuleTree) -> list[int]:
    """Per node of the tree of called modules, how many it holds, itself included: what a
    module's tuning costs in proportion to (its builds compile that much), for the estimate of
    the time left (Progress.plan)."""
    sizes = [1] * len(tree.tree)
    for node in sorted(range(len(tree.tree)), key=tree.tree.depth, reverse=True):
        parent = tree.tree.parent(node)
        if parent >= 0:
            sizes[parent] += sizes[node]
    return sizes


def _cache_key(model: nn.Module, calls: Any, device: torch.device, strategy: Strategy | None,
               settings: dict) -> tuple[str | None, dict | None]:
    """(the tuning cache's key, its parts), or (None, None) when a backend config has no JSON form."""
    try:
        parts = tuning_cache.key_parts(model, calls, device, strategy, settings)
        return tuning_cache.key_of(parts), parts
    except (Unstorable, ValueError, TypeError) as exc:
        logger.info("not cached: a backend config has no JSON form (%s)", exc)
        return None, None


def _search(model: nn.Module, session: Session, calls: Any, job: Workload | None, shown: Progress,
            device: torch.device, **limits: Any) -> Any:
    """The engine's depth search (_C.tweak) over the session's callbacks; on any failure the
    model is unwrapped (as it was, the decode loop too) and the error raised."""

    def run(i: int) -> None:
        args, kwargs = calls[i]
        model(*args, **kwargs)

    limits["dry_run"] = bool(limits["dry_run"])
    hooks = dict(enter=session.enter, activate=session.activate, leave=session.leave,
                 deactivate=session.deactivate, run=run if job is None else lambda i: job.run(),
                 sync=synchronizer(device), load=cpu_load.reading)
    ranks = distributed.current()
    if ranks is not None:
        hooks = _together(ranks, session, hooks)
    try:
        with torch.no_grad():
            return _C.tweak(session.tree.tree, modules=session.search, log=engine_log,
                            n_samples=len(calls) if job is None else 1, **hooks, **limits)
    except BaseException:
        unwrap(model)  # whatever happened, the model is as it was (the decode loop too)
        raise
    finally:
        shown.close()


def _together(ranks: "distributed.Ranks", session: Session, hooks: dict) -> dict:
    """The engine's callbacks when the ranks tune together (torch_tweak._core.distributed): each
    step agreed on by every rank, the timed calls' failures agreed at the sync that follows
    them, the ranks' clock and load; the module search's likewise (Ranks.agreeing)."""
    ranks.agreeing(session.search, session.tree.tree.path)

    def agreed(name: str, what: str) -> Any:
        fn = hooks[name]
        return lambda *args: ranks.step(lambda: fn(*args), what)

    return dict(hooks, enter=agreed("enter", "entering a cut"), activate=agreed("activate", "activating a cut"),
                leave=agreed("leave", "leaving a cut"), deactivate=agreed("deactivate", "deactivating a cut"),
                run=ranks.deferred(hooks["run"]), sync=ranks.sync_with(hooks["sync"]), load=ranks.load,
                clock=ranks.clock)


def _kept(model: nn.Module, engine: Any, tree: ModuleTree, session: Session, time_budget: float | None,
          dry_run: bool) -> "TweakResult":
    """The result of the engine's search; the wrappers of the cuts not kept release their calls;
    a kept depth keeps the declared shapes, the search's strategy's (tt.save writes them,
    tt.status shows them)."""
    declared = session.strategy.shapes if session.strategy is not None else None
    selected = engine.selected
    kept_depth = engine.rows[selected]["depth"] if selected >= 0 else None
    result = TweakResult(engine, tree, session.module_results(engine, kept_depth))
    result.time_budget = time_budget
    result.refused = session.refuse
    result._model = weakref.ref(model)
    kept = installed(model)
    for wrapper in session.wrappers.values():
        if kept.get(wrapper.tt_name) is not wrapper:
            release(wrapper, keep_chosen=False)  # only the kept cut's calls are worth saving
    if not dry_run:
        shapes = declared if result.selected_depth is not None else None
        records.made(model).keep(result.selected_depth, shapes, correctness.rule())
    return result


def _refuse_training(model: nn.Module) -> None:
    """Train mode stops a tweak before anything runs: dropout and batch norm make every
    output differ from the recorded one, so every backend would fail its check (and batch
    norm's statistics would move). The model is not touched."""
    training = [name for name, module in model.named_modules() if module.training]
    if not training:
        return
    which = "the model is" if training[0] == "" else f"module {training[0]!r} of the model is"
    raise ValueError(f"{which} in training mode: tweak tunes for inference, and dropout and batch norm in "
                     "training mode change every output, so no backend could pass the correctness check; "
                     "call model.eval() before tt.tweak (the model was not changed)")


def _choose_loop(job: Workload, device: torch.device, measure: dict | None, shown: Progress, *,
                 high: bool = False) -> None:
    """A generate() workload: tweak's decode loops tried on the untuned model (with `high`,
    effort="high", also the ones that cost a compile of their own); the kept one stays
    installed (tt.unwrap takes it out)."""
    with torch.no_grad():
        job.measure_ttft("untuned")
    shown.phase("generate(): trying tweak's decode loops on the untuned model")
    try:
        job.loop, job.loop_report = loop_search.choose_loop(job, device, measure, high=high)
    finally:
        shown.end_phase()
    if job.loop is not None:
        with torch.no_grad():
            job.measure_ttft("loop")
        logger.info("generate(): tweak's decode loop (%s) kept", job.loop)


def _from_cache(model: nn.Module, tree: ModuleTree, calls: list, device: torch.device, strategy: Strategy | None,
                key: str, parts: dict, shown: Progress) -> TweakResult | None:
    """The cached result, its backends built again and active; None on a miss (or a
    rebuild that fails, whose entry is dropped)."""
    entry = tuning_cache.read(key, parts)
    ranks = distributed.current()
    if ranks is not None and not ranks.all(entry is not None):
        return None  # a hit on some ranks only: every rank tunes afresh
    if entry is None:
        return None
    shown.line(f"tuning cache hit {key}: building the cached choices again, no measurement")
    try:  # the engine builds it again from the entry's numbers, checked
        result = tuning_cache.result_of(entry, tree)
    except Exception:  # an entry of another shape is a miss like any other
        result = None
    whole = result is not None if ranks is None else ranks.all(result is not None)
    if not whole:
        failure = "the entry is damaged" if result is None else "another rank's entry is damaged"
    else:
        failure = tuning_cache.apply(entry, model, calls, device, strategy)
    if ranks is not None and not ranks.all(failure is None) and failure is None:
        unwrap(model)  # another rank could not apply its entry: none keeps its own
        failure = "another rank's entry could not be applied"
    if failure is not None:
        logger.warning("tuning cache entry %s dropped (%s); tuning afresh", key, printable(failure))
        tuning_cache.drop(key)
        return None
    result._model = weakref.ref(model)
    _mark_busy(model, result)
    shown.finish(f"{result.outcome()} {result.cache_note()}")
    logger.info("tweak: %s %s", result.outcome(), result.cache_note())
    return result
