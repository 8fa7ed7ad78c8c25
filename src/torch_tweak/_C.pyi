"""Type stubs of torch_tweak._C, the C extension: the engine's bindings and the
tuned-module dispatcher. Everything here is internal; the public API is in
torch_tweak/__init__.py.

Callbacks from the engine into Python: a callback that raises an ``Exception``
fails that one step (its message becomes "ExcType: message"); a callback that
raises anything else (KeyboardInterrupt, SystemExit) stops the whole call, the
engine cleans up, and that exception propagates unchanged.

Statistics are dicts: {"median_ns", "q25_ns", "q75_ns", "min_ns", "spread",
"warmup_rounds", "rounds", "stopped_by"} with stopped_by one of "spread",
"rounds", "time", "decided" (a comparison whose fastest runner was clear).

An engine error that does not come from a bad argument (ValueError) or memory
(MemoryError) raises :class:`EngineError`, a RuntimeError; when a callback's
failure ended the call, that exception is its ``__cause__``.

``config`` arguments are dicts of the engine's measurement config with any
subset of the keys of :func:`default_measure_config`; an unknown key or a bad
value raises ValueError naming it. ``clock`` is a callable returning an int of
nanoseconds, used instead of the monotonic clock (for deterministic tests).
"""

from typing import Any, Callable, Hashable, Literal, Optional, Sequence

Stats = dict[str, Any]

class EngineError(RuntimeError):
    """An engine call failed: a callback failed, a call out of order, the budget."""

def default_measure_config() -> dict[str, Any]:
    """{"warmup_min": 2, "warmup_max": 20, "warmup_patience": 2, "warmup_gain": 0.02,
    "rounds_min": 5, "rounds_max": 50, "rel_spread": 0.05, "time_cap": 5.0 (seconds),
    "stop_when_decided": True}: a comparison of two or more runners also stops, after
    rounds_min, once the fastest one's q75 is below every other's q25."""

class Tree:
    """The tree of called modules (engine tw_tree)."""
    def __init__(self, modules: Sequence[tuple[str, int, int]]) -> None:
        """modules: (path, calls, time_ns) per called module; the root is "".
        ValueError on a duplicate path or a missing root."""
    def __len__(self) -> int: ...
    @property
    def max_depth(self) -> int: ...
    def path(self, i: int) -> str: ...
    def depth(self, i: int) -> int: ...
    def parent(self, i: int) -> int:
        """-1 for the root."""
    def child_count(self, i: int) -> int: ...
    def calls(self, i: int) -> int: ...
    def time_ns(self, i: int) -> int: ...
    def find(self, path: str) -> int:
        """-1 when absent."""
    def cut(self, depth: int) -> list[int]: ...
    def distinct_depths(self, min_depth: int = 0, max_depth: int = -1) -> list[int]: ...
    def format(self) -> str: ...

def measure(run: Callable[[int], object], n_samples: int, *,
            sync: Optional[Callable[[], object]] = None,
            config: Optional[dict[str, Any]] = None,
            clock: Optional[Callable[[], int]] = None) -> Stats:
    """tw_measure: run(i) makes call i of the dataset."""

def measure_paired(first: Callable[[int], object], second: Callable[[int], object], n_samples: int, *,
                   sync: Optional[Callable[[], object]] = None,
                   config: Optional[dict[str, Any]] = None,
                   clock: Optional[Callable[[], int]] = None,
                   rounds_min: Optional[int] = None, rounds_max: Optional[int] = None,
                   width: Optional[float] = None) -> dict[str, Any]:
    """tw_measure_paired: {"ratio", "low", "high", "rounds", "wins"}; ratio is first's round
    over second's (above 1: second is faster)."""

def compare(runs: Sequence[Callable[[int], object]], n_samples: int, *,
            sync: Optional[Callable[[], object]] = None,
            config: Optional[dict[str, Any]] = None,
            clock: Optional[Callable[[], int]] = None) -> list[Stats]:
    """tw_measure_compare: interleaved rounds."""

def choose(kind: str,
           candidates: Sequence[tuple[str, Callable[[], object], Callable[[int], object]]],
           n_samples: int, *,
           sync: Optional[Callable[[], object]] = None,
           config: Optional[dict[str, Any]] = None,
           clock: Optional[Callable[[], int]] = None) -> tuple[int, list[dict[str, Any]]]:
    """tw_strategy_choose. kind: "first-wins", "highest-throughput", "one-backend".
    candidates: (name, build, run); build() raises to reject the candidate.
    Returns (index of the winner or -1, one report per candidate:
    {"name", "state": "not tried"|"failed"|"built"|"measured", "error": str,
     "stats": Stats or None})."""

ModuleReport = dict[str, Any]
"""What a module's search found: {"path", "state": 1 tuned | -1 failed, "error",
"groups": [{"text", "strategy", "samples", "chosen": index or -1, "error",
"candidates": [{"name", "state": "not tried"|"failed"|"built"|"measured",
"verdict": "chosen"|"slower"|"failed"|"not tried"|"built", "error",
"stats": Stats or None, and the build's facts: "reason" ("" or the engine's
reason name: "build failed", "unavailable", "crashed", "mismatch", "dynamic
shapes", "out of memory", "time budget"), "max_error" and "tolerance" (float or
None), "build_s" (seconds by the clock, None when not tried), "variant" and
"lowers_precision" (the flags group() gave)}]}]}."""

ModuleSearch = Any
"""The callbacks of one module's search (tune_module, tweak's ``modules``): an
object whose methods are read once per call, as bound methods. node is the
caller's number for the module (a tree index in a tweak); g a signature group;
c a candidate. A callback that raises an Exception fails that one step:
- groups(node) -> int: how many signature groups; 0: never called (it fails).
- group(node, g) -> (text, strategy kind, candidate names tuple, n_samples[,
  flags tuple]): begins group g; flags, one int per name, of CANDIDATE_VARIANT
  (not built once tweak's time budget is used up) and CANDIDATE_LOWERS_PRECISION.
- build(node, g, c) -> None or (reason, max_error, tolerance): builds and checks
  candidate c and says what it knows (reason "" when it passed; a float or None
  each); raise to reject it, and the exception's ``tt_facts``, when it has that
  tuple, says why.
- run(node, g, c, sample): makes recorded call `sample` with candidate c.
- commit(node, g, chosen): ends group g with the chosen index or -1; follows
  every group() call, also after an interrupt."""

def tune_module(modules: ModuleSearch, node: int, *, path: str = "",
                sync: Optional[Callable[[], object]] = None,
                config: Optional[dict[str, Any]] = None,
                clock: Optional[Callable[[], int]] = None) -> ModuleReport:
    """tw_tune_module: the engine searches one module, group by group, with each
    group's strategy. path names it in messages."""

def check_tweak_config(*, min_depth: int = 0, max_depth: Optional[int] = 1,
                       tie_tolerance: float = 0.02, time_budget: Optional[float] = None,
                       config: Optional[dict[str, Any]] = None) -> dict[str, Any]:
    """Raises ValueError, with the message a user reads, for settings tweak would
    refuse (tw_tweak_config_check and the forms Python gives them). Returns the
    settings as the engine reads them, the keyword arguments of tweak:
    {"min_depth": int, "max_depth": int or None, "tie_tolerance": float,
    "time_budget": float seconds or None}."""

class Result:
    """tw_result. str() is the engine's table."""
    @property
    def rows(self) -> list[dict[str, Any]]:
        """{"depth", "modules", "failed", "state": "measured"|"skipped"|"budget"|"dry",
        "error": str, "stats": Stats or None} per depth."""
    @property
    def selected(self) -> int:
        """Index into rows, or -1 when the model stays untuned."""
    @property
    def baseline(self) -> Optional[Stats]: ...
    @property
    def confirmation(self) -> Optional[dict[str, Any]]:
        """The kept depth measured side by side with the untuned model: {"depth",
        "confirmed", "tuned": Stats, "untuned": Stats, "speedup", "speedup_low",
        "speedup_high", "quality", "tries", "from_search", "side_speedup",
        "search_speedup", "agreed", "others_share", "paired_rounds", "paired_wins",
        "busy_budget_wanted", "time_budget_wanted", "rounds_ran_out", "figure"}; None when none was
        measured. "speedup" is
        the figure reported: side by side, or the smaller of it and the search's when they
        disagree ("from_search" when that is the search's), or on a busy machine (quality
        "busy") the median ratio of paired rounds with its 99 % interval ("speedup_low",
        "speedup_high"), measured busy; "busy_budget_wanted" (or "time_budget_wanted"): when
        those rounds leaned faster but their budget ran out before they could decide, the
        budget in seconds that buys them, else 0 ("rounds_ran_out" True whenever they stopped
        undecided for time, also when no budget would buy them); "figure": "speedup" as the table's confirmed
        column and its last line write it ("1.54x")."""
    @property
    def quality(self) -> Literal["consistent", "remeasured", "inconsistent", "busy", "unchecked"]:
        """How the side-by-side figures held against the search's: "remeasured" when they
        agreed only when measured again, "inconsistent" when they never did (the smaller
        figure counts), "busy" when other processes took more than BUSY_SHARE of the CPUs
        while measuring (the figure comes from paired rounds, measured busy), "unchecked"
        when nothing was measured side by side."""
    @property
    def others_share(self) -> Optional[float]:
        """The share of the CPUs other processes took while the figures were measured
        (0..1), None when unknown."""
    @property
    def busy(self) -> bool:
        """others_share is above BUSY_SHARE."""
    @property
    def busy_stopped(self) -> bool:
        """The busy budget stopped the search: a depth was not tried on a busy machine."""
    @property
    def budgets(self) -> dict[str, int]:
        """{"time_budget_ns", "busy_budget_ns"}: the budgets it was computed under (0: none)."""
    @property
    def noisy(self) -> bool:
        """No speedup was confirmed, and a measurement spread more than the engine's noisy
        limit (a busy machine may have hidden one)."""
    def module(self, node: int) -> tuple[int, str]:
        """(1 tuned, -1 failed, 0 never tuned; error)."""
    @property
    def modules(self) -> list[ModuleReport]:
        """Every searched module, in node order: a ModuleReport with "node", "depths"
        (the rows' depths whose cut holds it) and "kept" (the kept cut holds it)."""
    def format(self, untuned: Optional[str] = None) -> str:
        """The result table; `untuned` ends its last line when no depth is kept (None:
        "it stays untuned")."""
    def outcome(self, untuned: Optional[str] = None) -> str:
        """The lines that end the table, alone: what was kept and by how much (or why
        nothing was), then the notes on the machine, one per line."""

def restore_result(record: dict[str, Any]) -> Result:
    """tw_result_restore: the Result of the numbers a caller kept of one, in the forms Result's
    getters give ({"rows", "selected", "baseline", "confirmation", "others_share",
    "busy_stopped", "budgets"}; other keys are ignored); its table and outcome are written from
    them. TypeError for a value of another form, ValueError with the engine's words for numbers
    no tweak gives. Its modules are not kept (modules is [])."""

MODE_ORIGINAL: int
MODE_ACTIVE: int
MODE_RECORD: int

def default_tweak_config() -> dict[str, Any]:
    """The engine's tweak defaults: {"min_depth", "max_depth", "tie_tolerance",
    "strategies": the strategy kind names, in the engine's order}."""

def tweak(tree: Tree, *,
          enter: Callable[[list[int], list[bool]], object],
          modules: ModuleSearch,
          activate: Callable[[], object],
          leave: Callable[[], object],
          run: Callable[[int], object],
          n_samples: int,
          sync: Optional[Callable[[], object]] = None,
          min_depth: int = 0,
          max_depth: Optional[int] = 1,
          tie_tolerance: float = 0.02,
          time_budget: Optional[float] = None,
          busy_budget: Optional[float] = ...,
          dry_run: bool = False,
          config: Optional[dict[str, Any]] = None,
          clock: Optional[Callable[[], int]] = None,
          deactivate: Optional[Callable[[], object]] = None,
          log: Optional[Callable[[int, str], object]] = None,
          load: Optional[Callable[[], Optional[tuple[float, float]]]] = None) -> Result:
    """tw_tweak_run. The engine searches every module of a cut it enters through
    ``modules`` (see ModuleSearch). time_budget in seconds, >= 0 (None: none; 0:
    used up before the first depth). max_depth None: deepest. The settings'
    errors are check_tweak_config's. deactivate: switch the entered cut back to
    the original forward (given: the kept depth is confirmed side by side).
    log(level, text): the engine's lines, level 0 info, 1 warning.
    load(): the machine's load, (others, capacity) running totals of CPU-seconds
    (torch_tweak._core.cpu_load.reading), or None when unknown; read around each
    measurement of the untuned model and each side-by-side one, to tell a busy
    machine (BUSY_SHARE). busy_budget: once the machine is busy, the search's bound
    in seconds (default BUSY_BUDGET; None: none)."""

BUSY_BUDGET: float
"""The default busy budget, in seconds (TW_BUSY_BUDGET_NS)."""

BUSY_SHARE: float
"""The share of the machine's CPU capacity other processes may take while the figures are
measured; above it the machine is busy (TW_BUSY_SHARE)."""

class Signature:
    """What one call of a module looked like: the number of positional
    arguments, the keyword names, and per argument a tensor's dtype, device and
    shape (a dynamic axis matches any size) or a plain value compared with ==.
    Tuples and lists are followed one level down (same exact type and length).
    A tensor matches a recorded one (any torch.Tensor subclass) with the same
    dtype, the same sizes except on dynamic axes, and the same device type and
    index (checked through is_<type> and get_device(), which allocate nothing).
    A plain value matches when it is the same object, or of the same type and
    ==; a comparison that raises an Exception is a mismatch.
    A call is first bound to the recorded layout (the positional count and the
    keywords in the recorded order): keywords in any order, and, with
    ``params`` (the names of forward's parameters that take a position, None
    for a positional-only one), an argument given by position or by keyword
    alike; then its values are matched. ValueError for params that name a
    parameter twice or one the recorded call gives both ways.
    dynamic[i] (None or a sequence of axes, negative from the end, or True for
    every axis) names the dynamic axes of argument i, counting positional
    arguments then keyword arguments in kwargs' order; for a tuple/list
    argument they apply to every tensor in it, or dynamic[i] gives one entry
    (None, True or axes) per item. dynamic=True: every axis of every tensor,
    the call's shape class (structure, plain values, dtypes, ranks and devices
    fixed). ValueError for an axis out of range, axes of a non-tensor, or a
    per-item form with another number of entries than items."""
    def __init__(self, args: tuple, kwargs: Optional[dict], dynamic: Optional[bool | Sequence[Any]] = None,
                 params: Optional[Sequence[Optional[str]]] = None) -> None: ...
    def matches(self, args: tuple, kwargs: dict) -> bool: ...
    def bind(self, args: tuple, kwargs: dict) -> Optional[tuple[tuple, dict]]:
        """The call in the recorded layout, or None when it cannot be laid out so
        (values are not checked)."""
    @property
    def params(self) -> tuple[Optional[str], ...]: ...

class Dispatcher:
    """Base type of torch_tweak.TunedModule: its __call__ is the per-call path of
    a tuned module (vectorcall).
    mode 0 (original): calls the original module.
    mode 1 (active): calls the backend of the first entry whose signature
      matches the call (an entry with signature None matches every call), with
      the call laid out as that signature was recorded (the caller's own
      arguments when they already are: no copy), or the original module when
      none does (counted in _tt_fallbacks). Entry flags (ENTRY_*): SERIALIZE
      runs the entry's calls one at a time under its own re-entrant lock,
      waited for without the GIL; NO_AUTOGRAD runs the original instead when
      grad mode is on and an argument or a parameter in the _tt_set_module tree requires
      grad (counted in _tt_grad_fallbacks); LAYOUT_ONLY binds the layout but
      leaves the values to the backend.
    mode 2 (record): calls recorder(*args, **kwargs) and returns its result.
    The index of the last matching entry is tried first when no earlier entry
    can match the same calls, so the first-match rule always holds.
    Subclasses on Python < 3.12 do not inherit vectorcall: call
    enable_vectorcall(cls) once per subclass.
    A Dispatcher never calls itself: _tt_bind, _tt_set_recorder and
    _tt_set_entries raise ValueError for a callable that is this Dispatcher or
    leads back to it through other Dispatchers' originals, recorders or
    backends, and a call that comes back through anything else (a Python
    function, a GraphReplay) raises RecursionError at the interpreter's limit."""
    def _tt_bind(self, original: Callable[..., Any]) -> None: ...
    def _tt_set_entries(self, entries: Sequence[tuple[Optional[Signature], Optional[Callable[..., Any]]]
                                                | tuple[Optional[Signature], Optional[Callable[..., Any]], int]]) -> None:
        """A backend None: the calls its signature fits run the original, counted as
        unmatched (a signature kept on the original, shielded from later entries)."""
    def _tt_set_notify(self, notify: Optional[Callable[[str], object]]) -> None:
        """Called with the reason at the first untuned call per reason from now on."""
    def _tt_set_module(self, module: Optional[Any]) -> None:
        """The module whose tree, as it is at each call, the rules read: in mode 1 a call while
        it or a submodule is in train mode runs the original (counted in _tt_train_fallbacks),
        and so does a grad-mode call of an ENTRY_NO_AUTOGRAD entry while one of their
        parameters requires grad (_tt_grad_fallbacks)."""
    def _tt_reset_untuned(self) -> None: ...
    def _tt_set_recorder(self, recorder: Optional[Callable[..., Any]]) -> None: ...
    _tt_mode: int
    @property
    def _tt_original(self) -> Optional[Callable[..., Any]]:
        """None before _tt_bind."""
    @property
    def _tt_entries(self) -> list[tuple[Optional[Signature], Optional[Callable[..., Any]]]]: ...
    @property
    def _tt_entry_flags(self) -> list[int]: ...
    @property
    def _tt_fallbacks(self) -> int: ...
    @property
    def _tt_grad_fallbacks(self) -> int: ...
    @property
    def _tt_train_fallbacks(self) -> int: ...
    @property
    def _tt_calls(self) -> int:
        """Calls in every mode."""
    def __call__(self, *args: Any, **kwargs: Any) -> Any: ...


class PaddedReplay:
    """Base type of the padded backend's callable (backends.padded.PaddedCall): the
    per-call path of a call of varying sizes. Whether a call fits the layout set by
    ``_pad_layout`` is decided here (structure, containers, plain values, each tensor's
    dtype, device, rank and sizes); a call whose batch and length fall in a ready
    bucket's range (``_pad_serve``) is copied into the bucket's buffers (the length axis
    past the call's own zeroed), runs the bucket's graph (its GraphReplay's launch alone)
    or the target on the buffers, and returns copies of the outputs cut back to the
    call's sizes; a call that does not fit or falls outside the range runs the target; a
    call that fits whose bucket is not ready goes to ``self._slow(bb, bn, b, n, *args,
    **kwargs)``; a call made while another is inside runs the target on its own arguments."""
    def __call__(self, *args: Any, **kwargs: Any) -> Any: ...
    def _pad_layout(self, call: tuple[tuple, dict], slots: Sequence[tuple[bool, bool]],
                    outputs: Sequence[tuple[bool, bool]], length: bool, target: Callable[..., Any],
                    flatten: Callable[[Any], list], max_batch: int, max_length: int, step: int) -> None:
        """Set once: slots are (batch, length) per tensor of the call, in the order of its leaves."""
    def _pad_fit(self, call: tuple[tuple, dict]) -> Optional[tuple[int, int, Optional[tuple[int, int]], tuple]]:
        """(b, n, bucket or None outside the range, tensors per slot), or None: it does not fit."""
    def _pad_bucket(self, b: int, n: int, buffers: Sequence[Any], graph: Optional[GraphReplay],
                    outputs: Optional[list], rebuild: Optional[Callable[[list], Any]]) -> None:
        """Bucket (b, n) holds these; it serves no call until _pad_serve."""
    def _pad_serve(self, b: int, n: int) -> None:
        """Bucket (b, n) serves the calls of its range from now on."""
    def _pad_drop(self, b: int, n: int) -> bool:
        """Bucket (b, n) lets go of what it held (True, also with no such bucket); False while a
        call is served from it."""
    def _pad_range(self, max_batch: int, max_length: int) -> None: ...
    def _pad_run(self, call: tuple[tuple, dict], hit: bool = False) -> Any:
        """The call through its bucket (held, ready or not): copies in, graph or target, cuts out."""
    def _pad_filled(self, call: tuple[tuple, dict]) -> tuple[tuple, dict]:
        """The call copied into its bucket's buffers, and the call with the buffers in place."""
    def _pad_counts(self) -> dict[tuple[int, int], tuple[int, int, int]]: ...
    def _pad_ready(self) -> list[tuple[int, int]]: ...
    def reset_counts(self) -> None: ...
    @staticmethod
    def _pad_batch_bucket(b: int) -> int:
        """The batch bucket of batch b: a power of two up to 8, past it a multiple of a
        quarter of the power of two below (at least 4)."""
    @staticmethod
    def _pad_key(b: int, n: int, batch: bool, length: bool, max_batch: int, max_length: int,
                 step: int) -> Optional[tuple[int, int]]:
        """The bucket of a call of batch b and length n, or None outside the range."""
    @staticmethod
    def _pad_lower(b: int, n: int, batch: bool, length: bool, step: int) -> tuple[int, int]:
        """The smallest batch and length that fall into bucket (b, n)."""
    @property
    def fast_calls(self) -> int:
        """Calls served in C, from a ready bucket."""
    @property
    def slow_calls(self) -> int:
        """Calls that fit, in the range, handed to _slow."""
    @property
    def outside_calls(self) -> int:
        """Calls run by the target: they do not fit the layout, or fall outside the range."""
    @property
    def serves_here(self) -> bool:
        """Whether _pad_layout set a layout: calls of it can be served in C."""

CANDIDATE_VARIANT: int
CANDIDATE_LOWERS_PRECISION: int
ENTRY_SERIALIZE: int
ENTRY_NO_AUTOGRAD: int
ENTRY_LAYOUT_ONLY: int

def replay_steps(replay: Callable[[], object], start: int, stop: int, every: int,
                 finished: Callable[[int], object]) -> int:
    """The per-token loop of a graph decode loop: for tokens start..stop-1,
    replay() once each, in bursts of `every`, checking for signals before each
    replay; after each burst finished(tokens so far) ends the loop when
    true. Returns the tokens so far: stop, or fewer when finished
    said so. TypeError for a replay or finished that is not callable,
    ValueError for start or stop < 0 or every < 1; an exception a replay or
    finished raises propagates and no replay follows it."""

def enable_vectorcall(cls: type) -> bool:
    """Sets the vectorcall flag on a subclass of Dispatcher whose __call__ is
    still Dispatcher's (Python 3.10 and 3.11 do not inherit it for classes
    defined in Python; 3.12 does). Returns whether instances of cls are now
    called through vectorcall (False when cls overrides __call__). TypeError
    when cls is not a subclass of Dispatcher."""

def root_call(self: Any, *args: Any, **kwargs: Any) -> Any:
    """The __call__ of a module tuned in place (module.py, _root_class):
    self.__dict__["_tt_root"](*args, **kwargs), the module's wrapper called with
    the arguments as they came; KeyError('_tt_root') when self is not tuned,
    ValueError when _tt_root is self, RecursionError when it leads back to self.
    A method descriptor: read on a module it is a bound method."""

def weight_sample(tensor: Any, span: int) -> bytes:
    """The sampled bytes of the span bytes from tensor.data_ptr(): all of them up to 1 KiB,
    else 16 pieces of 64 bytes spread evenly over them (model_state.sampled; the caller vouches
    that the span is a strided CPU tensor's own memory)."""

def weight_change(weights: list[tuple], in_place: bool) -> Optional[tuple[int, int]]:
    """The first entry of weights (model_state.weights_of's list of (table, path, name,
    tensor, address, version, span, sample); table a dict, or a list or tuple and name an
    index) whose tensor changed: (index, 0) replaced in its table, (index, 1) given other
    memory; only with in_place, (index, 2) written in place (for a tensor that keeps a version
    counter), (index, 3) written behind its version counter (the bytes weight_sample took no
    longer there; for an entry whose span is not 0). None when none did."""

def dict_change(pairs: list[tuple[dict, dict, int, bool]]) -> Optional[tuple[int, Optional[str]]]:
    """The first (live, saved, size, by_value) of pairs whose dict live no longer holds what
    saved holds, and the first key that differs: one whose value is another object (with
    by_value, one that is also not equal: lists and tuples of one type item by item, a tensor
    equal only to itself) or is gone; key None when only the number of keys is no longer size
    (-1: not read). None when every one holds."""

def class_change(entries: list[tuple[Any, Optional[str], Any]]) -> Optional[int]:
    """The index of the first (obj, name, expected) of entries that no longer holds: name
    None, type(obj) is expected (a module's class); else getattr(obj, name) == expected (a
    class's forward). None when every one holds."""

def set_value_keyer(fn: Optional[Callable[[object], Optional[Hashable]]]) -> None:
    """fn(value) -> a key of the value's structure, or None. Signatures made
    afterwards match a value that fn keys (a key/value cache) by an equal key,
    not by identity. None removes the keyer."""

class GraphReplay:
    """Replays a recorded device graph (the device-graph backend's per-call path).

    A call whose arguments fit ``signature`` copies each input tensor into its
    static buffer, launches the graph on the current stream and returns fresh
    copies of the static outputs (so a later call never overwrites a tensor the
    caller holds); any other call runs ``original(*args, **kwargs)``. A call made
    while another is inside this object (another thread) also runs the original.
    With ``lent``, a call returns the lending recording's outputs without a copy
    whenever nothing the last such call returned is alive.

    exec_handle: the graph's cudaGraphExec_t as an int, launched through the CUDA
      driver (dlopen'ed on first use) on torch's current stream of CUDA device
      ``device``; 0 to launch with ``replay()`` instead, with torch's copy_ and
      clone for the copies (XPU graphs; torch without a raw exec handle).
    inputs: (position or keyword name, index in a tuple/list argument or -1,
      static tensor) per input tensor of the recorded call.
    Device addresses come only from tensors: each data_ptr() the driver copies
      to or from is checked to lie, with the bytes copied, in that tensor's
      storage, which is held until the copy is queued (ValueError otherwise).
    outputs: a tensor, or a tuple or list of tensors and plain values; with
      ``rebuild``, a list of them, and a call returns rebuild(list of copies).
    keep: anything that must live as long as the graph (the graph object).
    lent: a second recording of the same call on the same static inputs,
      (exec_handle or 0, replay or None, outputs, lend); lend holds per output
      None (always copied) or (storage, storage._cdata, use count with no alias
      of it out), where storage is that output's untyped_storage() (ValueError
      otherwise); the address is read from the storage held, never from the int.
    """
    def __init__(self, exec_handle: int, device: int, signature: Signature,
                 inputs: Sequence[tuple[int | str, int, Any]], outputs: Any,
                 original: Callable[..., Any], *, rebuild: Optional[Callable[[list], Any]] = None,
                 replay: Optional[Callable[[], object]] = None, keep: object = None,
                 lent: Optional[tuple[int, Optional[Callable[[], object]], Any, Sequence[Any]]] = None) -> None: ...
    def __call__(self, *args: Any, **kwargs: Any) -> Any: ...
    @classmethod
    def driver_error(cls) -> Optional[str]:
        """Why the CUDA driver cannot be used, or None when it can (loads it once)."""
    @property
    def replays(self) -> int: ...
    @property
    def lent(self) -> int:
        """Replays that returned the lending recording's outputs without a copy."""
    @property
    def fallbacks(self) -> int: ...
    @property
    def driver(self) -> bool: ...
    @property
    def original(self) -> Callable[..., Any]: ...
    @property
    def signature(self) -> Signature: ...
    on_fallback: Optional[Callable[[], object]]
    """Called once at the next fallback, then None again."""
