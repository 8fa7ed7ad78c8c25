"""Type stubs of torch_tweak._C, the C extension: the engine's bindings and the
tuned-module dispatcher. Everything here is internal; the public API is in
torch_tweak/__init__.py.

Callbacks from the engine into Python: a callback that raises an ``Exception``
fails that one step (its message becomes "ExcType: message"); a callback that
raises anything else (KeyboardInterrupt, SystemExit) stops the whole call, the
engine cleans up, and that exception propagates unchanged.

Statistics are dicts: {"median_ns", "q25_ns", "q75_ns", "min_ns", "spread",
"warmup_rounds", "rounds", "stopped_by"} with stopped_by one of "spread",
"rounds", "time".

``config`` arguments are dicts of the engine's measurement config with any
subset of the keys of :func:`default_measure_config`; an unknown key or a bad
value raises ValueError naming it. ``clock`` is a callable returning an int of
nanoseconds, used instead of the monotonic clock (for deterministic tests).
"""

from typing import Any, Callable, Optional, Sequence

Stats = dict[str, Any]

def default_measure_config() -> dict[str, Any]:
    """{"warmup_min": 2, "warmup_max": 20, "warmup_patience": 2, "warmup_gain": 0.02,
    "rounds_min": 5, "rounds_max": 50, "rel_spread": 0.05, "time_cap": 5.0 (seconds)}"""

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
    def module(self, node: int) -> tuple[int, str]:
        """(1 tuned, -1 failed, 0 never tuned; error)."""
    def format(self) -> str: ...

def tweak(tree: Tree, *,
          enter: Callable[[list[int], list[bool]], object],
          tune: Callable[[int], object],
          activate: Callable[[], object],
          leave: Callable[[], object],
          run: Callable[[int], object],
          n_samples: int,
          sync: Optional[Callable[[], object]] = None,
          min_depth: int = 0,
          max_depth: int = 2,
          tie_tolerance: float = 0.02,
          time_budget: Optional[float] = None,
          dry_run: bool = False,
          config: Optional[dict[str, Any]] = None,
          clock: Optional[Callable[[], int]] = None) -> Result:
    """tw_tweak_run. time_budget in seconds (None: none). max_depth -1: deepest."""

class Signature:
    """What one call of a module looked like: the number of positional
    arguments, the keyword names, and per argument a tensor's dtype, device and
    shape (a dynamic axis matches any size) or a plain value compared with ==.
    Tuples and lists are followed one level down."""
    def __init__(self, args: tuple, kwargs: dict, dynamic: Optional[Sequence[Sequence[int]]] = None) -> None: ...
    def matches(self, args: tuple, kwargs: dict) -> bool: ...

class Dispatcher:
    """Base type of torch_tweak.TunedModule: its __call__ is the per-call path of
    a tuned module (vectorcall).
    mode 0 (original): calls the original module.
    mode 1 (active): calls the backend of the first entry whose signature
      matches the call (an entry with signature None matches every call), or the
      original module when none does (counted in fallbacks).
    mode 2 (record): calls recorder(*args, **kwargs) and returns its result."""
    def _tt_bind(self, original: Callable[..., Any]) -> None: ...
    def _tt_set_entries(self, entries: Sequence[tuple[Optional[Signature], Callable[..., Any]]]) -> None: ...
    def _tt_set_recorder(self, recorder: Optional[Callable[..., Any]]) -> None: ...
    _tt_mode: int
    @property
    def _tt_original(self) -> Callable[..., Any]: ...
    @property
    def _tt_entries(self) -> list[tuple[Optional[Signature], Callable[..., Any]]]: ...
    @property
    def _tt_fallbacks(self) -> int: ...
    @property
    def _tt_calls(self) -> int: ...
    def __call__(self, *args: Any, **kwargs: Any) -> Any: ...
